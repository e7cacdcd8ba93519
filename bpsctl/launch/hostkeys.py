"""Host key verification for every SSH connection: trust on first use, never a changed key.

A host's key is checked against one known_hosts file (``ssh.known_hosts`` in the hosts file,
else ``<state_dir>/known_hosts``, fixed at ``up`` and recorded with the cluster). A host not in
it is trusted the first time and its key added; a host whose key differs from the recorded one
is refused (paramiko's ``BadHostKeyException``) before anything is sent to it. Keys are added
under a lock file, re-reading the file first and replacing it atomically, so that connections
opened in parallel (threads or processes) lose no entry; the rest of the file is kept as is.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shlex
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paramiko import HostKeys, MissingHostKeyPolicy, PKey
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey
from paramiko.ssh_exception import BadHostKeyException

SSH_PORT = 22


def known_name(host: str, port: int) -> str:
    """How known_hosts names a host: ``host``, or ``[host]:port`` on another port than 22."""
    return host if port == SSH_PORT else f"[{host}]:{port}"


class KnownHostsError(Exception):
    """The known_hosts file cannot be read or written; the message names it."""


def load(client: Any, path: str | Path) -> None:
    """Make a paramiko ``SSHClient`` verify host keys against ``path`` (trust on first use)."""
    with _file_errors(path, "read"):
        if Path(path).is_file():
            client.get_host_keys().load(str(path))
    client.set_missing_host_key_policy(TrustOnFirstUse(path))


class TrustOnFirstUse(MissingHostKeyPolicy):
    """Accept an unknown host's key and record it in the known_hosts file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def missing_host_key(self, client: Any, hostname: str, key: PKey) -> None:
        with _file_errors(self.path, "record a host key in"):
            record(self.path, hostname, key)


def record(path: str | Path, hostname: str, key: PKey) -> None:
    """Add ``hostname``'s ``key`` to the known_hosts file ``path`` (created 0600), unless it is
    there already; raises ``BadHostKeyException`` if a different key was recorded meanwhile."""
    path = Path(os.path.realpath(path))          # a symlinked ~/.ssh/known_hosts stays one
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(path):
        text = path.read_bytes() if path.exists() else b""
        known = HostKeys()
        if text:
            known.load(str(path))
        recorded = known.lookup(hostname)
        if recorded:
            if recorded.get(key.get_name()) == key:
                return
            raise BadHostKeyException(hostname, key, next(iter(recorded.values())))
        if text and not text.endswith(b"\n"):
            text += b"\n"
        text += HostKeyEntry([hostname], key).to_line().encode()
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o600
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _file_errors(path: str | Path, doing: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise KnownHostsError(f"cannot {doing} the known_hosts file {path} "
                              f"({exc.strerror or exc})") from None
    except InvalidHostKey as exc:
        raise KnownHostsError(f"cannot {doing} the known_hosts file {path}: {exc.line!r} is "
                              "not a valid known_hosts line; fix or remove it") from None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock for changing ``path``: ``<path>.lock`` (flock serialises threads with
    their own descriptors as well as processes)."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def changed_key_message(exc: BadHostKeyException, host: str, port: int, path: str) -> str:
    """Why a host is refused, and how to accept its new key knowingly."""
    name = known_name(host, port)
    return (f"the host key of {name} has changed: {path} has {_fingerprint(exc.expected_key)}, "
            f"the host now offers {_fingerprint(exc.key)}. bpsctl did not log in: someone may be "
            "intercepting the connection. If the host's key was changed on purpose (reinstalled, "
            f"new sshd), remove the old key with `ssh-keygen -R {shlex.quote(name)} -f "
            f"{shlex.quote(path)}` and run the bpsctl command again")


def _fingerprint(key: PKey) -> str:
    """As OpenSSH shows it: ``ssh-ed25519 SHA256:...``."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


__all__ = ["KnownHostsError", "TrustOnFirstUse", "changed_key_message", "known_name", "load",
           "record"]
