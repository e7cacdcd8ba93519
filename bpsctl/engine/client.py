"""Asking a running scheduler about its cluster (used by `bpsctl status` and launchers)."""
from __future__ import annotations

import time
from typing import Any

import zmq

from ..config import DEFAULT_SECURITY
from . import protocol as P
from .common import EngineError, make_socket, monitor, monitor_events
from .security import Security, handshake_failed, refused_handshake
from .trace import now_ns, scheduler_clock


def scheduler_status(address: str, secret: str, timeout_s: float = 3.0,
                     security: str = DEFAULT_SECURITY) -> dict[str, Any]:
    """The scheduler's view: ``{"servers": [...], "workers": [...], "job": {...}|None,
    "ended": {job id: "finished" or why it ended}}``.

    ``address`` is host:port, or a ZeroMQ endpoint such as the scheduler's control socket;
    ``security`` is the cluster's mode (see security.py), ``secret`` its secret.

    Each member is ``{"role", "rank", "host", "port", "pid", "state", "last_seen_s"}``.
    """
    where = f"the scheduler at {address}"
    guard = Security(security, secret)
    ctx: zmq.Context = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER)
    guard.protect_connecting(sock)
    watch = monitor(sock)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(address if "://" in address else f"tcp://{address}")
        login = guard.login(sock, P.control(P.STATUS), where)
        while True:
            if handshake_failed(monitor_events(watch)):
                raise refused_handshake(where, guard)
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise EngineError(f"{where} did not answer within {timeout_s:g} s; is the cluster "
                                  "up? (`bpsctl status`, `bpsctl up`)")
            if not sock.poll(min(remaining_ms, 50), zmq.POLLIN):
                continue
            try:
                msg_type, msg = P.parse_control(sock.recv_multipart())
            except P.ProtocolError as exc:
                raise EngineError(f"{where} answered with a bad message: {exc}") from None
            if not login.handle(msg_type, msg):
                break
    finally:
        sock.disable_monitor()
        watch.close(0)
        sock.close(0)
    if msg_type != P.STATUS_REPLY:
        raise EngineError(f"{where} refused the status request: {msg.get('message')}")
    return msg


#: clock exchanges one connection may make (the best of them is kept)
CLOCK_EXCHANGES = 8


def measure_clock(ctx: zmq.Context, address: str, security: Security,
                  exchanges: int = CLOCK_EXCHANGES, timeout_s: float = 2.0
                  ) -> dict[str, int] | None:
    """The scheduler's clock against ours, from the best (shortest round trip) of
    ``exchanges`` clock exchanges over a connection of its own; None if the scheduler did not
    answer in ``timeout_s``. Traces use it to put processes of several machines on one clock.
    """
    def request() -> list[bytes]:
        return P.control(P.CLOCK, {"clock_ns": now_ns()})

    sock = make_socket(ctx, zmq.DEALER)
    security.protect_connecting(sock)
    deadline = time.monotonic() + timeout_s
    best: dict[str, int] | None = None
    try:
        sock.connect(address if "://" in address else f"tcp://{address}")
        login = security.login(sock, request, f"the scheduler at {address}")
        answered = 0
        while answered < exchanges:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                break
            try:
                msg_type, msg = P.parse_control(sock.recv_multipart())
                back_ns = now_ns()
                if login.handle(msg_type, msg):
                    continue
            except (P.ProtocolError, EngineError):
                break
            sample = scheduler_clock(msg, back_ns) if msg_type == P.CLOCK else None
            if sample is None:
                break
            answered += 1
            if best is None or sample["error_ns"] < best["error_ns"]:
                best = sample
            if answered < exchanges:
                sock.send_multipart(request())
    finally:
        sock.close(0)
    return best
