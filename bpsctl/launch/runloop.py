"""The one run loop: start every worker of a plan, watch them and the cluster, stop the rest.

Backends differ only in how a worker is started and watched (a local process group, a process
in an emulated host's namespace, a process the SSH agent runs on a host), which a
:class:`Spawner` hides. The loop is the same for all: the first worker to fail is the root
cause; when one fails, or a scheduler or server of the cluster is lost and the workers have not
ended ``lost_grace_s`` later, every other worker is stopped; Ctrl-C or SIGTERM stops them all.
Every worker has been stopped and waited for when :func:`run_workers` returns.
"""
from __future__ import annotations

import time
import uuid
from typing import Protocol

from bpsctl.config import Config
from bpsctl.launch.plan import Assignment, Plan
from bpsctl.launch.processes import Interrupted, StopSignals, stop_signals_recorded
from bpsctl.launch.types import ProcessRecord, RunResult, WorkerFailure

STOP_GRACE_S = 5.0              # SIGTERM -> SIGKILL, for cluster processes and workers
_POLL_INTERVAL_S = 0.02


class WorkerProcess(Protocol):
    """One running worker, as the run loop sees it."""

    rank: int
    pid: int
    host: str                   # where it runs, "" when that is simply this machine

    def exit_code(self) -> int | None:
        """None while it runs; then its shell-style exit code (128 + N for signal N)."""

    def signal_name(self) -> str | None: ...

    def last_lines(self) -> list[str]: ...


class Spawner(Protocol):
    """How one backend starts, watches and stops the workers of one job."""

    def start(self, assignment: Assignment, env: dict[str, str]) -> WorkerProcess:
        """Start the worker of ``assignment`` with ``env`` (its whole bpsctl environment)."""

    def started(self, workers: list[WorkerProcess]) -> None:
        """Called once every worker has been asked to start (they start in parallel)."""

    def lost(self) -> ProcessRecord | None:
        """A scheduler or server of the cluster that has exited, if any (cheap to call often:
        the spawner decides how often it really looks)."""

    def stop(self, workers: list[WorkerProcess], grace_s: float) -> None:
        """Stop every worker still running (and what it started), and wait for them."""


def new_job_id() -> str:
    return uuid.uuid4().hex


def run_workers(spawner: Spawner, the_plan: Plan, config: Config, *,
                lost_grace_s: float | None = None,
                stop_grace_s: float = STOP_GRACE_S) -> RunResult:
    """Run every worker of ``the_plan`` through ``spawner`` until all have exited or one
    failed; see the module's docstring."""
    lost_grace_s = config.heartbeat_timeout_s + 1.0 if lost_grace_s is None else lost_grace_s
    with stop_signals_recorded() as stop_signals:
        try:
            return _run(spawner, the_plan, config, stop_signals, lost_grace_s, stop_grace_s)
        except Interrupted as interrupted:
            return RunResult(exit_code=128 + interrupted.signum)


def _run(spawner: Spawner, the_plan: Plan, config: Config, stop_signals: StopSignals,
         lost_grace_s: float, stop_grace_s: float) -> RunResult:
    workers: list[WorkerProcess] = []
    failed: list[WorkerProcess] = []
    codes: dict[int, int] = {}
    lost: ProcessRecord | None = None
    give_up_at = float("inf")
    try:
        for assignment in the_plan.workers:
            stop_signals.check()
            workers.append(spawner.start(assignment, assignment.to_env(config, the_plan)))
        spawner.started(workers)
        while True:
            stop_signals.check()
            for worker in workers:
                if worker.rank not in codes:
                    code = worker.exit_code()
                    if code is not None:
                        codes[worker.rank] = code
                        if code:
                            failed.append(worker)
            if failed or len(codes) == len(workers):
                break
            now = time.monotonic()
            if lost is None:
                lost = spawner.lost()
                if lost is not None:
                    give_up_at = now + lost_grace_s
            elif now > give_up_at:
                break
            time.sleep(_POLL_INTERVAL_S)
    finally:
        spawner.stop(workers, stop_grace_s)
    message = f"lost {lost.label}: it exited during the run" if lost is not None else ""
    if not failed:
        stopped = len(codes) < len(workers)         # by the watch, after its grace
        return RunResult(exit_code=1 if stopped else 0, lost=message)
    failures = tuple(WorkerFailure(rank=w.rank, pid=w.pid, exit_code=codes[w.rank],
                                   signal_name=w.signal_name(), host=w.host,
                                   last_lines=tuple(w.last_lines())) for w in failed)
    return RunResult(exit_code=failures[0].exit_code, failures=failures, lost=message)
