"""Who may talk to a cluster: the security modes (``BPSCTL_SECURITY``).

Every member of a cluster holds its secret (``BPSCTL_SECRET``, 256 random bits that `bpsctl up`
generates). The secret itself never crosses the wire; what a connection must prove depends on
the mode:

* ``hmac`` (default): each connection to a scheduler or server starts with a challenge-response
  handshake. The connecting side sends a nonce (AUTH), the bound side answers with its own
  nonce and an HMAC-SHA256 of both (CHALLENGE), and the connecting side answers with its HMAC
  (PROOF). Until then the connection can neither register, ask for status, say HELLO, push nor
  pull. Both sides prove themselves, so a worker never pushes gradients to an impostor. After
  the handshake data flows unencrypted: the data path costs nothing more. It stops anyone who
  can only connect or listen; an attacker who sits in the path and rewrites traffic is the
  ``curve`` mode's business.
* ``curve``: ZeroMQ CURVE on every socket: every byte encrypted and authenticated, and a ZAP
  handler admits only the cluster's client key. The keys are derived from the secret, so
  whatever carries the secret carries them. It costs a lot of CPU on the data path (see
  ``bpsctl bench comm --security``).
* ``none``: no check at all; only for networks where every host that can reach the cluster's
  ports is trusted.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from .. import __version__
from ..config import SECURITY_MODES
from . import protocol as P
from .common import EngineError

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_NONCE_BYTES = 16
#: handshakes begun and not finished, and connections proven but not yet logged in, kept per
#: bound socket; the oldest are forgotten first, so a flood of AUTHs cannot grow memory
_MAX_OPEN_HANDSHAKES = 1024


def new_secret() -> str:
    """A fresh cluster secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def version_mismatch(theirs: Any, who: str) -> str:
    """The refusal a process of another bpsctl version gets, naming both versions."""
    return (f"version mismatch: this process runs bpsctl {str(theirs)[:40]}, {who} runs bpsctl "
            f"{__version__}; install the same bpsctl version on every host")


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs of a cluster's bound sockets and of its members."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@dataclass(frozen=True)
class Security:
    """A process's security mode and the cluster secret it proves itself with."""

    mode: str
    secret: str

    def __post_init__(self) -> None:
        if self.mode not in SECURITY_MODES:
            raise ValueError(f"security mode {self.mode!r}: expected one of "
                             f"{', '.join(SECURITY_MODES)}")

    # ------------------------------------------------------------------ keys

    def _derive(self, label: bytes) -> bytes:
        return hashlib.blake2b(label, key=self.secret.encode(), digest_size=32).digest()

    def curve_keys(self) -> CurveKeys:
        """Both key pairs, derived from the secret (a CURVE secret key is any 32 bytes)."""
        server_secret = z85.encode(self._derive(b"bpsctl curve server"))
        client_secret = z85.encode(self._derive(b"bpsctl curve client"))
        return CurveKeys(zmq.curve_public(server_secret), server_secret,
                         zmq.curve_public(client_secret), client_secret)

    def _proof(self, side: bytes, first: bytes, second: bytes) -> str:
        return hmac.new(self.secret.encode(), b"bpsctl " + side + b"\0" + first + second,
                        hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ sockets

    def start_zap(self, ctx: zmq.Context, who: str, log: logging.Logger) -> ZapHandler | None:
        """In ``curve`` mode, the ZAP handler of ``ctx`` (start it before binding)."""
        if self.mode != "curve":
            return None
        handler = ZapHandler(ctx, self.curve_keys().client_public, who, log)
        handler.start()
        return handler

    def protect_bound(self, sock: zmq.Socket) -> None:
        """Configure a socket that will bind (scheduler, server) before it binds."""
        if self.mode == "curve":
            keys = self.curve_keys()
            sock.curve_server = True
            sock.curve_publickey = keys.server_public
            sock.curve_secretkey = keys.server_secret

    def protect_connecting(self, sock: zmq.Socket) -> None:
        """Configure a socket that will connect to a scheduler or server before it connects."""
        if self.mode == "curve":
            keys = self.curve_keys()
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.client_public
            sock.curve_secretkey = keys.client_secret

    def gate(self, who: str, log: logging.Logger) -> Gate:
        return Gate(self, who, log)

    def login(self, sock: zmq.Socket, message: list[bytes] | Callable[[], list[bytes]],
              peer: str) -> Login:
        return Login(self, sock, message, peer)


def handshake_failed(events: list[int]) -> bool:
    """Whether monitor events (see common.monitor) say the peer refused the security handshake."""
    return any(e in events for e in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                     zmq.EVENT_HANDSHAKE_FAILED_AUTH))


def refused_handshake(peer: str, security: Security) -> EngineError:
    return EngineError(f"{peer} refused this process's security handshake (BPSCTL_SECURITY="
                       f"{security.mode}): the cluster runs another security mode, or this "
                       "process lacks its secret (BPSCTL_SECRET; `bpsctl run` sets both from "
                       "the cluster state)")


class ZapHandler(threading.Thread):
    """ZeroMQ's authentication hook for ``curve``: admits only the cluster's client key.

    libzmq asks it about every new connection to a CURVE socket of the same context, over
    ``inproc://zeromq.zap.01``; a refused connection is closed before it carries a message.
    """

    def __init__(self, ctx: zmq.Context, client_public: bytes, who: str, log: logging.Logger):
        super().__init__(name="bps-zap", daemon=True)
        self._client_key = z85.decode(client_public)
        self._who, self._log = who, log
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100):
                    continue
                request = self._sock.recv_multipart()
                # version, request id, domain, address, identity, mechanism, credentials...
                version, request_id, address, mechanism = (request[0], request[1], request[3],
                                                           request[5])
                ok = mechanism == b"CURVE" and len(request) > 6 and \
                    hmac.compare_digest(request[6], self._client_key)
                if not ok:
                    self._log.warning("%s refused a CURVE connection from %s: not the cluster's "
                                      "key", self._who, address.decode(errors="replace"))
                self._sock.send_multipart([version, request_id, b"200" if ok else b"400",
                                           b"OK" if ok else b"not a member of this cluster",
                                           b"", b""])
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self.join(2)


def _nonce(text: Any) -> bytes | None:
    try:
        value = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        return None
    return value if len(value) == _NONCE_BYTES else None


def _remember(table: OrderedDict, key: bytes, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > _MAX_OPEN_HANDSHAKES:
        table.popitem(last=False)


class Gate:
    """The bound side of the ``hmac`` handshake: which connections (routing ids) have proven
    the secret. In the other modes every connection passes (CURVE's ZAP handler, or nothing,
    did the checking)."""

    def __init__(self, security: Security, who: str, log: logging.Logger):
        self.security, self.who, self.log = security, who, log
        self._challenged: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._proven: OrderedDict[bytes, None] = OrderedDict()

    def handle(self, rid: bytes, msg_type: int,
               msg: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """Answer an AUTH or PROOF message; returns the reply to send, if any."""
        mode = self.security.mode
        if mode != "hmac":
            return P.ERROR, {"message": f"{self.who} runs security mode {mode}, but this process "
                             f"uses hmac: set BPSCTL_SECURITY={mode} (`bpsctl run` takes it from "
                             "the cluster state)"}
        if msg_type == P.AUTH:
            if msg.get("version") != __version__:
                return P.ERROR, {"message": version_mismatch(msg.get("version"), self.who)}
            theirs = _nonce(msg.get("nonce"))
            if theirs is None:
                return P.ERROR, {"message": f"{self.who} rejected an AUTH without a "
                                 f"{_NONCE_BYTES}-byte hex nonce"}
            ours = secrets.token_bytes(_NONCE_BYTES)
            _remember(self._challenged, rid, (theirs, ours))
            return P.CHALLENGE, {"nonce": ours.hex(),
                                 "proof": self.security._proof(b"bound", theirs, ours)}
        nonces = self._challenged.pop(rid, None)
        proof = msg.get("proof")
        if nonces is None or not isinstance(proof, str) or not hmac.compare_digest(
                proof.encode(), self.security._proof(b"connecting", nonces[1], nonces[0]).encode()):
            self.log.warning("%s refused a connection that does not know the cluster secret",
                             self.who)
            return P.ERROR, {"message": f"{self.who} refused this connection: wrong cluster "
                             "secret (BPSCTL_SECRET; `bpsctl run` sets it from the cluster state)"}
        _remember(self._proven, rid, None)
        return None

    def admit(self, rid: bytes) -> bool:
        """Whether this connection may log in (REGISTER, STATUS, HELLO); each proof admits once."""
        if self.security.mode != "hmac":
            return True
        if rid in self._proven:
            del self._proven[rid]
            return True
        return False

    def refusal(self) -> dict[str, Any]:
        """The ERROR body for a login that has not proven the secret."""
        return {"message": f"{self.who} refused a connection that has not proven the cluster "
                f"secret (security mode {self.security.mode}; BPSCTL_SECURITY must match the "
                "cluster's, and BPSCTL_SECRET be its secret)"}


class Login:
    """The connecting side of a connection's handshake: sends ``message`` (REGISTER, STATUS or
    HELLO) once the bound side has proven itself, or at once in the other modes. ``message``
    may be a function that builds the frames, called when they are sent (a registration
    stamps its clock reading then)."""

    def __init__(self, security: Security, sock: zmq.Socket,
                 message: list[bytes] | Callable[[], list[bytes]], peer: str):
        self.security, self.sock, self.message, self.peer = security, sock, message, peer
        self.done = security.mode != "hmac"
        if self.done:
            self._send_message()
            return
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self._send(P.control(P.AUTH, {"version": __version__, "nonce": self._nonce.hex()}))

    def handle(self, msg_type: int, msg: dict[str, Any]) -> bool:
        """Take a CHALLENGE (returns True); anything else is the caller's (returns False)."""
        if msg_type != P.CHALLENGE or self.done:
            return False
        theirs = _nonce(msg.get("nonce"))
        proof = msg.get("proof")
        if theirs is None or not isinstance(proof, str) or not hmac.compare_digest(
                proof.encode(), self.security._proof(b"bound", self._nonce, theirs).encode()):
            raise EngineError(f"{self.peer} did not prove it knows this cluster's secret: "
                              "BPSCTL_SECRET differs from the cluster's (`bpsctl run` sets it "
                              "from the cluster state), or this is not the cluster's process")
        self._send(P.control(P.PROOF, {
            "proof": self.security._proof(b"connecting", theirs, self._nonce)}))
        self._send_message()
        self.done = True
        return True

    def _send_message(self) -> None:
        message = self.message
        self._send(message() if callable(message) else message)

    def _send(self, frames: list[bytes]) -> None:
        """Send without waiting. A DEALER without high-water marks queues a message whenever
        it has a connection, even one still being made; it has none only once ZeroMQ has
        closed the connection for good, which it does when the peer refuses the security
        handshake with a protocol error (another mode's peer, often before this first send).
        A blocking send would then wait forever; dropped, the caller's monitor reports the
        refusal (or its deadline passes) as for any other refused login."""
        try:
            self.sock.send_multipart(frames, zmq.DONTWAIT)
        except zmq.Again:
            pass


__all__ = ["Security", "Gate", "Login", "ZapHandler", "CurveKeys", "new_secret",
           "version_mismatch", "handshake_failed", "refused_handshake"]
