"""The one run loop: start every worker of a plan, watch them and the cluster, stop the rest.

Backends differ only in how a worker is started and watched (a local process group, a process
in an emulated host's namespace, a process the SSH agent runs on a host), which a
:class:`Spawner` hides. The loop is the same for all: the first worker to fail is the root
cause; when one fails, or the scheduler or the last server of the cluster is lost and the
workers have not ended ``lost_grace_s`` later, every other worker is stopped; Ctrl-C or SIGTERM
stops them all. A lost server while others remain is only said: the job's workers go on with
its partitions on the other servers (``BPSCTL_SERVER_FAILOVER``, docs/design.md), or fail by
themselves, naming it. With ``BPSCTL_MAX_RESTARTS`` a failed worker is started again (same
host, same rank, ``BPSCTL_REJOIN=1``) while restarts are left, and rejoins the running job;
the job goes on without it meanwhile. Every worker has been stopped and waited for when
:func:`run_workers` returns.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Protocol

from bpsctl.config import Config
from bpsctl.launch.plan import Assignment, Plan
from bpsctl.launch.processes import Interrupted, StopSignals, stop_signals_recorded
from bpsctl.launch.types import ProcessRecord, RunResult, WorkerFailure

log = logging.getLogger("bpsctl.launch")

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

    def lost(self) -> list[ProcessRecord]:
        """The scheduler and servers of the cluster that have exited (cheap to call often:
        the spawner decides how often it really looks, and says [] in between)."""

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
            return RunResult(exit_code=128 + interrupted.signum, interrupted=interrupted.signum)


def _fatal_loss(gone: list[ProcessRecord], servers_lost: set[str], servers: int,
                config: Config) -> ProcessRecord | None:
    """Of the cluster processes found gone, the one the job cannot go on without, if any; a
    server while others remain (with failover) is said once and tolerated."""
    for record in gone:
        if record.label in servers_lost:
            continue
        if record.role == "server" and config.server_failover \
                and len(servers_lost) + 1 < servers:
            servers_lost.add(record.label)
            log.warning("lost %s: it exited during the run; the job goes on with its "
                        "partitions on a spare server if one is left, else on the other "
                        "servers (each worker says where)", record.label)
            continue
        return record
    return None


def _run(spawner: Spawner, the_plan: Plan, config: Config, stop_signals: StopSignals,
         lost_grace_s: float, stop_grace_s: float) -> RunResult:
    workers: list[WorkerProcess] = []
    retired: list[WorkerProcess] = []       # failed and restarted: stopped (waited) at the end
    restarted: list[WorkerFailure] = []
    failed: list[WorkerProcess] = []
    gone_on: list[WorkerProcess] = []       # failed, and the job went on without them
    codes: dict[int, int] = {}
    lost: ProcessRecord | None = None
    give_up_at = float("inf")
    servers_lost: set[str] = set()      # said, and left to the engine's failover
    # restarting needs a job that goes on without a worker while it restarts
    engine_config = (config.replace(min_workers=1)
                     if config.max_restarts and not config.min_workers else config)
    envs = [a.to_env(engine_config, the_plan) for a in the_plan.workers]
    try:
        for assignment, env in zip(the_plan.workers, envs, strict=True):
            stop_signals.check()
            workers.append(spawner.start(assignment, env))
        spawner.started(workers)
        while True:
            stop_signals.check()
            for index, worker in enumerate(workers):
                if worker.rank not in codes:
                    code = worker.exit_code()
                    if code and len(restarted) < config.max_restarts:
                        restarted.append(_failure(worker, code))
                        retired.append(worker)
                        workers[index] = _restart(spawner, the_plan.workers[index], envs[index],
                                                  worker, code, len(restarted), config)
                        continue
                    if code is not None:
                        codes[worker.rank] = code
                        if code and _goes_on_without(worker, code, len(workers),
                                                     len(gone_on), config):
                            gone_on.append(worker)
                        elif code:
                            failed.append(worker)
            if failed or len(codes) == len(workers):
                break
            now = time.monotonic()
            if lost is None:
                lost = _fatal_loss(spawner.lost(), servers_lost, len(the_plan.servers), config)
                if lost is not None:
                    give_up_at = now + lost_grace_s
            elif now > give_up_at:
                break
            time.sleep(_POLL_INTERVAL_S)
    finally:
        spawner.stop([*retired, *workers], stop_grace_s)
    message = f"lost {lost.label}: it exited during the run" if lost is not None else ""
    left_behind = tuple(_failure(w, codes[w.rank]) for w in gone_on)
    if not failed:
        stopped = len(codes) < len(workers)         # by the watch, after its grace
        return RunResult(exit_code=1 if stopped else 0, lost=message, left_behind=left_behind,
                         restarted=tuple(restarted))
    failures = tuple(_failure(w, codes[w.rank]) for w in failed)
    return RunResult(exit_code=failures[0].exit_code, failures=failures, lost=message,
                     left_behind=left_behind, restarted=tuple(restarted))


def _restart(spawner: Spawner, assignment: Assignment, env: dict[str, str],
             worker: WorkerProcess, code: int, count: int, config: Config) -> WorkerProcess:
    """Start ``worker``'s rank again, to rejoin the running job. Said once."""
    new = spawner.start(assignment, {**env, "BPSCTL_REJOIN": "1"})
    spawner.started([new])
    how = f"signal {worker.signal_name()}" if worker.signal_name() else f"exit code {code}"
    where = f" on {worker.host}" if worker.host else ""
    log.warning("worker %d (pid %d%s) failed (%s); restarted it as pid %d to rejoin the job "
                "(restart %d of %d)", worker.rank, worker.pid, where, how, new.pid, count,
                config.max_restarts)
    return new


def _failure(worker: WorkerProcess, code: int) -> WorkerFailure:
    return WorkerFailure(rank=worker.rank, pid=worker.pid, exit_code=code,
                         signal_name=worker.signal_name(), host=worker.host,
                         last_lines=tuple(worker.last_lines()))


def _goes_on_without(worker: WorkerProcess, code: int, workers: int, gone: int,
                     config: Config) -> bool:
    """Whether the job keeps going after ``worker`` failed: BPSCTL_MIN_WORKERS lets it while
    that many are left (the engine drops the worker's share from the averages). Said once."""
    left = workers - gone - 1
    if not config.min_workers or left < config.min_workers:
        return False
    how = f"signal {worker.signal_name()}" if worker.signal_name() else f"exit code {code}"
    where = f" on {worker.host}" if worker.host else ""
    log.warning("worker %d (pid %d%s) failed (%s); the job goes on with %d workers "
                "(--min-workers %d)", worker.rank, worker.pid, where, how, left,
                config.min_workers)
    return True
