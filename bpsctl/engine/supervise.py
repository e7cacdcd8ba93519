"""Keeps a cluster's scheduler running: ``bpsctl up`` starts this in the scheduler's place.

``python -m bpsctl.engine.supervise --record FILE`` runs ``python -m bpsctl.engine.scheduler``
as its child, in the supervisor's process group (so stopping the group stops both; the child
also dies with the supervisor), with the environment it was given: the same secret, security
mode and address. When the scheduler dies the supervisor starts it again on the port the
first one bound, after a short back-off (0.2 s, doubling while restarts come fast, at most
5 s), ``BPSCTL_SCHEDULER_RESTARTS`` times in all; then it exits with the scheduler's exit
code. Servers and workers re-register with
the new scheduler (docs/design.md, "Keeping going through a lost machine", item 4).

``FILE`` (JSON) says who runs now, for ``bpsctl status``: ``{"supervisor_pid", "pid",
"create_time", "host", "port", "restarts", "state": "running|restarting|stopped", "last_exit"}``.
The ready file (``BPSCTL_READY_FILE``) is written once, when the first scheduler serves, with
that scheduler's address and pid. A scheduler that fails before it first serves is not
restarted: the launcher reports its failure.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from ..config import Config
from .common import DISK_FULL_ERRNOS, setup_process_logging, write_ready_file

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
_STEADY_S = 10.0            # a scheduler that ran this long resets the back-off
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1       # linux/prctl.h


class Supervisor:
    """Runs the scheduler, restarts it when it dies, and keeps ``record`` up to date."""

    def __init__(self, config: Config, record: Path):
        self.config, self.record = config, record
        self.log = setup_process_logging("supervisor")
        self.child_ready = record.with_name(record.name + ".ready")
        self.env = dict(os.environ)
        self.env["BPSCTL_READY_FILE"] = str(self.child_ready)
        self.child: subprocess.Popen | None = None
        self.info: dict[str, Any] = {"supervisor_pid": os.getpid(), "pid": None,
                                     "create_time": 0.0, "host": config.host, "port": None,
                                     "restarts": 0, "state": "restarting", "last_exit": None}
        self.stopping = False

    def stop(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def _start(self) -> int | None:
        """Start a scheduler and wait until it serves; its exit code if it died first."""
        self.child_ready.unlink(missing_ok=True)
        self.child = subprocess.Popen([sys.executable, "-m", "bpsctl.engine.scheduler"],
                                      env=self.env, stdin=subprocess.DEVNULL,
                                      preexec_fn=functools.partial(_die_with_parent,
                                                                   os.getpid()))
        deadline = time.monotonic() + self.config.start_timeout_s
        while not self.stopping:
            try:
                ready = json.loads(self.child_ready.read_text())
                break
            except (FileNotFoundError, ValueError):
                pass
            code = self.child.poll()
            if code is not None:
                return code
            if time.monotonic() > deadline:
                self.log.error("the scheduler (pid %d) did not serve within %g s "
                               "(BPSCTL_START_TIMEOUT)", self.child.pid,
                               self.config.start_timeout_s)
                self.child.kill()
                return self.child.wait()
            time.sleep(_POLL_S)
        else:
            return None
        self.env["BPSCTL_PORT"] = str(ready["port"])        # restarts bind the same port
        try:
            create_time = psutil.Process(self.child.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = 0.0
        self.info.update(pid=self.child.pid, create_time=create_time, host=ready["host"],
                         port=ready["port"], state="running")
        self._write()
        return None

    def _write(self) -> None:
        tmp = self.record.with_name(self.record.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.info))
            os.replace(tmp, self.record)
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            # the record is for `bpsctl status`; the scheduler goes on without it, and the
            # next change writes it whole
            self.log.warning("cannot write %s (%s); it stays as it was until there is room",
                             self.record, exc.strerror)
            tmp.unlink(missing_ok=True)

    def run(self) -> int:
        code = self._start()
        if code is not None:
            return code                 # never served: the launcher says why
        if self.stopping:
            return self._stopped()
        write_ready_file(self.config.ready_file, {"host": self.info["host"],
                                                  "port": self.info["port"],
                                                  "pid": self.info["pid"]})
        limit, backoff = self.config.scheduler_restarts, _FIRST_BACKOFF_S
        code, pid = None, self.info["pid"]      # code: of a restart that died before serving
        while True:
            started = time.monotonic()
            if code is None:
                assert self.child is not None
                code = self.child.wait()
            if self.stopping:
                return self._stopped()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            self.info.update(state="restarting", last_exit=code)
            if self.info["restarts"] >= limit:
                self.info["state"] = "stopped"
                self._write()
                self.log.error("the scheduler (pid %s) died (%s); it was restarted %d times, "
                               "the most BPSCTL_SCHEDULER_RESTARTS allows: giving up", pid, how,
                               self.info["restarts"])
                return code if code > 0 else 1
            self._write()
            backoff = _FIRST_BACKOFF_S if time.monotonic() - started > _STEADY_S else backoff
            self.log.warning("the scheduler (pid %s) died (%s); restarting it in %.1f s "
                             "(restart %d of at most %d, BPSCTL_SCHEDULER_RESTARTS)", pid, how,
                             backoff, self.info["restarts"] + 1, limit)
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
            if self.stopping:
                return self._stopped()
            self.info["restarts"] += 1
            code = self._start()
            if self.stopping:
                return self._stopped()
            pid = self.child.pid if self.child is not None else None
            if code is None:
                self.log.warning("restarted the scheduler: pid %d on %s:%s (restarted %d times)",
                                 self.info["pid"], self.info["host"], self.info["port"],
                                 self.info["restarts"])

    def _stopped(self) -> int:
        if self.child is not None:
            try:
                self.child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self.info["state"] = "stopped"
        self._write()
        self.child_ready.unlink(missing_ok=True)
        return 0


def _die_with_parent(parent: int) -> None:
    """In the scheduler, before it runs: the kernel kills it if the supervisor dies (a
    supervisor killed alone would otherwise leave a scheduler nobody records)."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:      # it died before that took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bpsctl.engine.supervise")
    parser.add_argument("--record", required=True, type=Path,
                        help="where to write the running scheduler's pid and restart count")
    args = parser.parse_args(argv)
    supervisor = Supervisor(Config.from_env(role="scheduler"), args.record.expanduser())
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    sys.exit(supervisor.run())


if __name__ == "__main__":
    main()
