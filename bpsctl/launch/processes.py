"""Process lifecycle on this machine: start a child in its own process group, tell whether a
recorded process still runs, stop whole groups without ever hitting a process we did not start.

PID 1 on these machines does not reap orphans, so a process left by an earlier ``bpsctl up``
stays a zombie after it exits: a zombie counts as exited everywhere here.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

# psutil reports create_time rounded to the clock tick; two processes that share a PID are
# created far more than this apart.
_CREATE_TIME_TOLERANCE_S = 0.05
_POLL_INTERVAL_S = 0.02


@dataclass(frozen=True)
class ProcessIdentity:
    """Enough to find a process again later and be sure it is the same one (not a reused PID)."""

    pid: int
    pgid: int
    create_time: float


def start_process(argv: Sequence[str], env: dict[str, str], log_path: Path | None = None,
                  stdout: int | IO | None = None, stderr: int | IO | None = None,
                  cwd: Path | None = None) -> tuple[subprocess.Popen, ProcessIdentity]:
    """Start ``argv`` as the leader of a new process group (so the whole group can be stopped).

    With ``log_path`` stdout and stderr both go to that file; otherwise to ``stdout``/``stderr``.
    """
    if log_path is not None:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    else:
        process = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                   stderr=stderr, cwd=cwd, start_new_session=True)
    return process, identify(process.pid)


def identify(pid: int) -> ProcessIdentity:
    # start_new_session made the child a group leader: its pgid is its pid, even if it already
    # exited (then os.getpgid would fail on some kernels, so do not ask).
    try:
        create_time = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        create_time = 0.0
    return ProcessIdentity(pid=pid, pgid=pid, create_time=create_time)


def is_running(identity: ProcessIdentity) -> bool:
    """True while the process we started still runs (zombies and reused PIDs are not it)."""
    try:
        process = psutil.Process(identity.pid)
        if abs(process.create_time() - identity.create_time) > _CREATE_TIME_TOLERANCE_S:
            return False
        return process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def pid_running(pid: int) -> bool:
    """True while some process (not a zombie) has this PID; for PIDs we did not record."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _group_members(pgid: int) -> list[int]:
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess, PermissionError):
            continue
    return members


def _group_is_ours(identity: ProcessIdentity) -> bool:
    """Whether signalling ``identity.pgid`` can only reach processes we started."""
    try:
        leader = psutil.Process(identity.pgid)
        # a zombie leader still holds its PID, so the group ID cannot have been reused
        return abs(leader.create_time() - identity.create_time) <= _CREATE_TIME_TOLERANCE_S
    except psutil.NoSuchProcess:
        # The leader is gone, but the kernel keeps a group ID from being reused as a PID while
        # any member lives: whoever is still in the group descends from our process.
        return bool(_group_members(identity.pgid))


def _group_has_live_members(identity: ProcessIdentity) -> bool:
    return is_running(identity) or bool(_group_members(identity.pgid))


def signal_group(identity: ProcessIdentity, signum: int) -> None:
    """Send ``signum`` to the process group we started, if it is still ours."""
    if not _group_is_ours(identity):
        return
    try:
        os.killpg(identity.pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def reap_if_child(pid: int) -> None:
    """Collect the exit status of ``pid`` if it is a child of this process, so it is no zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_groups(identities: Iterable[ProcessIdentity], grace_s: float) -> list[ProcessIdentity]:
    """SIGTERM every group, SIGKILL what is left after ``grace_s``; return what still runs.

    Does not reap: the caller reaps its own children (``Popen.wait`` keeps their exit codes).
    """
    identities = list(identities)
    for identity in identities:
        signal_group(identity, signal.SIGTERM)
        signal_group(identity, signal.SIGCONT)     # a stopped (Ctrl-Z, SIGSTOP) process too
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_running(i) for i in identities):
        time.sleep(_POLL_INTERVAL_S)
    # Leaders may be gone while their children linger in the group: kill the whole group.
    for identity in identities:
        if _group_has_live_members(identity):
            signal_group(identity, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    survivors = identities
    while survivors and time.monotonic() < deadline:
        survivors = [i for i in survivors if _group_has_live_members(i)]
        if survivors:
            time.sleep(_POLL_INTERVAL_S)
    return survivors


# --------------------------------------------------------------------------- stop signals

class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM asked the launcher to stop; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """Records SIGINT/SIGTERM instead of raising wherever Python happens to be, so starting
    or stopping a process is never cut half-way (leaving one unrecorded or unstopped).
    Waiting loops call :meth:`check` at safe points; it raises :class:`Interrupted` once,
    so the cleanup that follows runs to the end whatever the user presses."""

    def __init__(self) -> None:
        self.signum = 0
        self._raised = False

    def record(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def check(self) -> None:
        if self.signum and not self._raised:
            self._raised = True
            raise Interrupted(self.signum)


_active_stop_signals: StopSignals | None = None


@contextlib.contextmanager
def stop_signals_recorded() -> Iterator[StopSignals]:
    """Within the block SIGINT and SIGTERM are recorded by one shared :class:`StopSignals`
    (nested blocks share it). Outside the main thread signals cannot be caught: check() is
    then a no-op and Ctrl-C behaves as usual."""
    global _active_stop_signals
    if _active_stop_signals is not None:
        yield _active_stop_signals
        return
    stop_signals = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop_signals
        return
    previous = {s: signal.signal(s, stop_signals.record) for s in (signal.SIGINT, signal.SIGTERM)}
    _active_stop_signals = stop_signals
    try:
        yield stop_signals
    finally:
        _active_stop_signals = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)
