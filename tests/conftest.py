"""Shared pieces of the engine tests: a real cluster per module, jobs of worker threads, and
process checks.

Several ``Worker`` objects can live in one process (each owns its own ZeroMQ context and I/O
thread), so correctness tests run their workers as threads against real server processes.
"""
from __future__ import annotations

import os
import textwrap
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from bpsctl.config import Config
from bpsctl.engine import Worker
from bpsctl.launch import api

#: servers in the module-scoped cluster; a job uses the first ``num_servers`` of them
CLUSTER_SERVERS = 4
#: deadlines for worker threads: short enough that a hang fails the test quickly
WORKER_DEADLINES = {"start_timeout_s": 10.0, "heartbeat_interval_s": 0.2,
                    "heartbeat_timeout_s": 5.0, "op_timeout_s": 30.0}
JOB_TIMEOUT_S = 60.0


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: PID 1 here does not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cluster_config(**knobs: Any) -> Config:
    """Config for a test cluster's scheduler and servers."""
    return Config(**{
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "start_timeout_s": 20.0,
        **knobs})


# worker scripts' check(): records each check's outcome (or traceback) in RESULTS and goes on,
# so one failing check does not hide the others
CHECK_HELPER = textwrap.dedent('''
    def check(fn):
        try:
            fn()
            RESULTS[fn.__name__] = "ok"
        except BaseException as exc:
            RESULTS[fn.__name__] = "".join(traceback.format_exception(exc))[-1500:]
        return fn
''')

@pytest.fixture(scope="module")
def engine_cluster():
    """One real scheduler and four servers for a whole test module; stopped and checked after."""
    with api.local_cluster(cluster_config(), servers=CLUSTER_SERVERS) as cluster:
        pids = [p.pid for p in cluster.processes]
        yield cluster
    kill_pids(pid for pid in pids if not gone(pid))
    assert all(gone(pid) for pid in pids), "the test cluster outlived its fixture"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI as root, a test marked ``root`` that skips has failed (see .ci/run).

    Without root those tests skip, saying why; with root (as CI runs) nothing should stop them.
    """
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and item.get_closest_marker("root") is not None
            and os.environ.get("CI", "").lower() not in ("", "0", "false")
            and os.geteuid() == 0):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"a root test skipped under CI as root: {reason}"


class JobFailed(AssertionError):
    pass


def run_job(cluster: api.ClusterState, workers: int, servers: int,
            body: Callable[[Worker], Any], timeout_s: float = JOB_TIMEOUT_S,
            **knobs: Any) -> list[Any]:
    """Run ``body(worker)`` on ``workers`` worker threads of one job using ``servers`` servers.

    Returns each rank's result. If any rank raises, every worker is shut down (so the others
    stop waiting for it) and the first failure is raised, naming its rank. Workers are always
    shut down, so the cluster is free for the next job.
    """
    job_id = f"test-{uuid.uuid4().hex[:12]}"
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    live: dict[int, Worker] = {}
    lock = threading.Lock()
    failed = threading.Event()

    def run_rank(rank: int) -> None:
        config = Config(rank=rank, world_size=workers, job_id=job_id, num_servers=servers,
                        scheduler=cluster.scheduler, secret=cluster.secret,
                        **{**WORKER_DEADLINES, **knobs})
        try:
            worker = Worker(config)
        except BaseException as exc:        # noqa: BLE001 - reported to the test below
            errors[rank] = exc
            failed.set()
            return
        with lock:
            live[rank] = worker
        try:
            results[rank] = body(worker)
        except BaseException as exc:        # noqa: BLE001
            errors[rank] = exc
            failed.set()
        finally:
            worker.shutdown()

    threads = [threading.Thread(target=run_rank, args=(rank,), daemon=True,
                                name=f"test-rank-{rank}") for rank in range(workers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if failed.wait(0.05):
            with lock:
                for worker in live.values():
                    worker.shutdown()       # idempotent; fails what the others wait for
            time.sleep(0.05)
    if errors:
        rank = min(errors)
        raise JobFailed(f"rank {rank} of {workers} (servers {servers}) failed: "
                        f"{errors[rank]!r}") from errors[rank]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        with lock:
            for worker in live.values():
                worker.shutdown()
        raise JobFailed(f"job did not finish within {timeout_s:g} s: {stuck} still running")
    return [results[rank] for rank in range(workers)]


@pytest.fixture
def job(engine_cluster):
    """``job(workers, servers, body, **knobs)``: :func:`run_job` on the module's cluster."""
    def run(workers: int, servers: int, body: Callable[[Worker], Any], **knobs: Any) -> list[Any]:
        return run_job(engine_cluster, workers, servers, body, **knobs)
    return run
