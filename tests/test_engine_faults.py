"""Failures a user meets, with real worker processes: each must end in a clear error, in time.

Every test owns its cluster (some kill part of it), bounds its run time, and checks with psutil
that no process it started is left running.
"""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, gone, kill_pids, run_job, wait_until

from bpsctl.config import Config
from bpsctl.engine import EngineError, Worker
from bpsctl.engine.client import scheduler_status
from bpsctl.engine.common import SchedulerGone
from bpsctl.launch import api
from bpsctl.launch.state import load_supervision

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[1]
#: the engine's promise: a failure is reported within this many seconds
REPORT_WITHIN_S = 10.0

# Shared by the worker scripts: on an engine error, print it with the time it was seen, then
# wait (bounded) until every rank has reported, so the launcher stops nobody before it speaks.
REPORT_PRELUDE = """
import os, sys, time
import numpy as np
import bpsctl.engine as bps
from bpsctl.engine import EngineError

REPORT_DIR = sys.argv[1]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
EXPECTED_REPORTS = int(os.environ.get("TEST_EXPECTED_REPORTS", WORLD))
open(os.path.join(REPORT_DIR, f"pid-{RANK}"), "w").write(str(os.getpid()))


def report(exc):
    print(f"ERROR at {time.monotonic():.3f}: {type(exc).__name__}: {exc}", flush=True)
    open(os.path.join(REPORT_DIR, f"error-{RANK}"), "w").write(str(exc))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sum(
            name.startswith("error-") for name in os.listdir(REPORT_DIR)) < EXPECTED_REPORTS:
        time.sleep(0.02)
    sys.exit(1)
"""


def worker_script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(REPORT_PRELUDE) + textwrap.dedent(body))
    report_dir = tmp_path / "reports"
    report_dir.mkdir(exist_ok=True)
    return [sys.executable, str(path), str(report_dir)]


def report_dir(tmp_path: Path) -> Path:
    return tmp_path / "reports"


def worker_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in report_dir(tmp_path).glob("pid-*")]


def errors_seen(output: str) -> dict[int, tuple[float, str]]:
    """rank -> (monotonic time, message) of each ``ERROR at T: ...`` line in prefixed output."""
    seen = {}
    for line in output.splitlines():
        prefix, _, rest = line.partition("] ERROR at ")
        if rest:
            at, _, message = rest.partition(": ")
            seen[int(prefix.lstrip("["))] = (float(at), message)
    return seen


def prefixed(rank: int, output: str) -> str:
    """Output of a worker started directly, prefixed as run_local prefixes it."""
    return "".join(f"[{rank}] {line}\n" for line in output.splitlines())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def cluster(tmp_path, request):
    """A private cluster of two servers that notices silence within 2 s (a test marked
    ``no_failover`` gets one that fails a job whose server is lost, rather than go on)."""
    knobs = {"server_failover": False} if request.node.get_closest_marker("no_failover") else {}
    with api.local_cluster(cluster_config(heartbeat_timeout_s=2.0, **knobs), servers=2) as state:
        pids = [p.pid for p in state.processes]
        try:
            yield state
        finally:
            kill_pids(worker_pids(tmp_path) if report_dir(tmp_path).exists() else [])
    wait_until(lambda: all(gone(pid) for pid in pids), 5, "the cluster's processes to exit")


def run_config(cluster: api.ClusterState, **knobs) -> Config:
    """What `bpsctl run` would give the workers of a job on ``cluster``."""
    return cluster_config(**{"state_dir": Path(cluster.state_dir), "start_timeout_s": 10.0,
                             "op_timeout_s": 60.0, "heartbeat_interval_s": 0.2,
                             "heartbeat_timeout_s": 2.0, **knobs})


class Workers:
    """Worker processes started directly (not by run_local), always killed and reaped."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []

    def start(self, cmd: list[str], config: Config, **extra_env: str) -> subprocess.Popen:
        env = {**os.environ, **config.to_env(), **extra_env, "RANK": str(config.rank),
               "WORLD_SIZE": str(config.world_size), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                            os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        self.processes.append(process)
        return process

    def outputs(self, timeout_s: float) -> list[tuple[int, str]]:
        """(exit code, output) of each process, waiting at most ``timeout_s`` for all."""
        deadline = time.monotonic() + timeout_s
        outputs = [p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
                   for p in self.processes]
        return [(p.returncode, output) for p, output in zip(self.processes, outputs, strict=True)]

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.communicate()
        assert all(gone(p.pid) for p in self.processes)


@pytest.fixture
def workers():
    started = Workers()
    try:
        yield started
    finally:
        started.kill_all()


# --------------------------------------------------------------------------- disagreements

def test_workers_disagreeing_on_a_shape_all_fail_naming_it(cluster, tmp_path):
    cmd = worker_script(tmp_path, """
        bps.init()
        shape = (4,) if RANK == 0 else (5,)
        try:
            bps.push_pull(np.ones(shape, np.float32), name="layer3.weight")
        except EngineError as exc:
            report(exc)
        print("no error", flush=True)
    """)
    out = io.StringIO()
    started = time.monotonic()
    result = api.run_local(cmd, 2, run_config(cluster), stdout=out, stderr=out)
    elapsed = time.monotonic() - started
    output = out.getvalue()

    assert result.exit_code == 1, output
    seen = errors_seen(output)
    assert sorted(seen) == [0, 1], output
    for rank, (_at, message) in seen.items():
        assert message.startswith(f"EngineError: worker {rank}: workers disagree on tensor "
                                  "'layer3.weight': rank "), message
        assert "float32(4,)" in message and "float32(5,)" in message, message
        assert "rank 0 has" in message and "rank 1 has" in message, message
    assert "no error" not in output
    assert elapsed < REPORT_WITHIN_S + 5, f"took {elapsed:.1f} s (including two interpreters)"
    assert all(gone(pid) for pid in worker_pids(tmp_path))


def test_a_worker_reaching_the_tensor_after_the_disagreement_fails_too(cluster):
    def body(w: Worker):
        if w.rank == 2:
            time.sleep(0.5)                  # ranks 0 and 1 have disagreed by now
        started = time.monotonic()
        with pytest.raises(EngineError, match=rf"^worker {w.rank}: workers disagree on tensor 'x': "
                                              r"rank \d has float64\(\d,\), rank \d has"):
            w.push_pull(np.ones((5,) if w.rank == 1 else (4,)), name="x", average=False)
        return time.monotonic() - started

    # rank 2's shape agrees with rank 0's, but its push_pull can never complete
    waited = run_job(cluster, 3, 1, body, op_timeout_s=30.0)
    assert max(waited) < 3, waited


# --------------------------------------------------------------------------- deaths

@pytest.mark.no_failover
def test_a_server_killed_mid_round_fails_every_worker_naming_it(cluster, tmp_path):
    """With BPSCTL_SERVER_FAILOVER=0 (test_resilience.py has the default: the job goes on)."""
    victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)
    running_dir = tmp_path / "running"
    running_dir.mkdir()
    cmd = worker_script(tmp_path, f"""
        bps.init()
        grad = np.ones(256 * 1024, np.float32)       # 1 MiB in 64 KiB pieces: on both servers
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                bps.push_pull(grad, name="grad", average=False)
                open(os.path.join({str(running_dir)!r}, str(RANK)), "w").close()
        except EngineError as exc:
            report(exc)
        print("no error", flush=True)
    """)
    out, results = io.StringIO(), []
    config = run_config(cluster, partition_bytes=64 * 1024, server_failover=False)
    runner = threading.Thread(target=lambda: results.append(
        api.run_local(cmd, 2, config, stdout=out, stderr=out)), daemon=True)
    runner.start()
    try:
        wait_until(lambda: len(os.listdir(running_dir)) == 2, 20, "both workers to be pushing")
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        runner.join(REPORT_WITHIN_S + 10)
    assert not runner.is_alive(), "run_local did not return after the server died"
    output = out.getvalue()

    assert results[0].exit_code == 1, output
    seen = errors_seen(output)
    assert sorted(seen) == [0, 1], output
    for rank, (at, message) in seen.items():
        assert message.startswith(f"EngineError: worker {rank}: lost server 1"), message
        assert f"{victim.host}:{victim.port}" in message, message
        assert at - killed_at < REPORT_WITHIN_S, f"rank {rank} took {at - killed_at:.1f} s"
    assert "no error" not in output
    assert gone(victim.pid)
    assert all(gone(pid) for pid in worker_pids(tmp_path))


def test_a_worker_killed_mid_round_fails_the_others_naming_it(cluster, tmp_path, workers):
    running_dir = tmp_path / "running"
    running_dir.mkdir()
    cmd = worker_script(tmp_path, f"""
        bps.init()
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                bps.push_pull(np.ones(1000, np.float32), name="grad")
                open(os.path.join({str(running_dir)!r}, str(RANK)), "w").close()
        except EngineError as exc:
            report(exc)
    """)
    config = run_config(cluster, world_size=3, job_id=uuid.uuid4().hex)
    # no launcher here stops the others early, so nobody needs to wait for the others' reports
    processes = [workers.start(cmd, config.replace(rank=rank), TEST_EXPECTED_REPORTS="0")
                 for rank in range(3)]
    wait_until(lambda: len(os.listdir(running_dir)) == 3, 20, "all three workers to be pushing")
    killed_at = time.monotonic()
    processes[2].kill()
    (code0, out0), (code1, out1), _ = workers.outputs(timeout_s=REPORT_WITHIN_S + 5)

    for rank, code, output in ((0, code0, out0), (1, code1, out1)):
        assert code == 1, output
        (at, message), = errors_seen(prefixed(rank, output)).values()
        assert message.startswith(f"EngineError: worker {rank}: lost worker 2 ("), message
        assert f"pid {processes[2].pid}" in message, message
        assert at - killed_at < REPORT_WITHIN_S, f"rank {rank} took {at - killed_at:.1f} s"


def test_a_worker_killed_before_the_job_starts_is_named_to_the_others(cluster, tmp_path, workers):
    cmd = worker_script(tmp_path, """
        try:
            bps.init()
        except EngineError as exc:
            report(exc)
        print("joined", flush=True)
    """)
    config = run_config(cluster, world_size=3, job_id=uuid.uuid4().hex, start_timeout_s=30.0)
    processes = [workers.start(cmd, config.replace(rank=rank), TEST_EXPECTED_REPORTS="0")
                 for rank in (0, 1)]                          # rank 2 is still to come
    wait_until(lambda: len(scheduler_status(cluster.scheduler, cluster.secret)["workers"]) == 2,
               20, "ranks 0 and 1 to register")
    killed_at = time.monotonic()
    processes[0].kill()
    _, (code, output) = workers.outputs(timeout_s=REPORT_WITHIN_S + 5)

    assert code == 1, output
    (at, message), = errors_seen(prefixed(1, output)).values()
    assert message.startswith("EngineError: rank 1: lost worker 0 ("), message
    assert f"pid {processes[0].pid}" in message and "before the job started" in message, message
    # the heartbeat timeout (2 s) names it, long before the start timeout (30 s)
    assert at - killed_at < REPORT_WITHIN_S, f"took {at - killed_at:.1f} s"


def test_the_scheduler_and_its_supervisor_killed_mid_round_leave_the_data_path_going(cluster):
    """Nothing restarts the scheduler: push_pulls of the declared tensor go on, the servers
    stay up, and a barrier (which needs the scheduler) fails within BPSCTL_SCHEDULER_TIMEOUT
    naming it."""
    supervisor = cluster.scheduler_record
    scheduler_pid = load_supervision(cluster.state_dir)["pid"]
    servers = [p.pid for p in cluster.processes if p.role == "server"]
    pushing = threading.Barrier(3)
    timeout_s = 2.0

    def body(w: Worker):
        for rounds in range(23):
            if rounds == 3:
                pushing.wait(20)
                wait_until(lambda: w._sched_gone is not None, 10, "the scheduler's loss")
            assert np.all(w.push_pull(np.ones(100_000, np.float32), name="g", average=False)
                          == 2)
        started = time.monotonic()
        with pytest.raises(SchedulerGone) as failure:
            w.barrier()
        return time.monotonic() - started, str(failure.value)

    def kill_scheduler() -> None:
        pushing.wait(20)
        os.kill(supervisor.pid, signal.SIGKILL)
        os.kill(scheduler_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_scheduler, daemon=True)
    killer.start()
    results = run_job(cluster, 2, 2, body, partition_bytes=64 * 1024,
                      scheduler_timeout_s=timeout_s)
    killer.join(5)
    for rank, (after_s, message) in enumerate(results):
        assert message.startswith(f"worker {rank}: the scheduler at {cluster.scheduler} has "
                                  "been gone for"), message
        assert "cannot complete" in message, message
        assert after_s < timeout_s + 2
    assert not any(gone(pid) for pid in servers), "a server exited without its scheduler"


# --------------------------------------------------------------------------- never started

#: a worker that only joins, printing how long init took and why it failed
INIT_AND_REPORT = """
    started = time.monotonic()
    try:
        bps.init()
    except EngineError as exc:
        print(f"elapsed {time.monotonic() - started:.2f}", flush=True)
        print(f"message {exc}", flush=True)
        sys.exit(1)
    print("joined", flush=True)
"""

def test_no_scheduler_fails_init_within_the_start_timeout_saying_how_to_start_one(tmp_path,
                                                                                   workers):
    port = free_port()
    cmd = worker_script(tmp_path, INIT_AND_REPORT)
    config = Config(scheduler=f"127.0.0.1:{port}", secret="s", start_timeout_s=2.0,
                    heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, state_dir=tmp_path)
    workers.start(cmd, config.replace(rank=0))
    (code, output), = workers.outputs(timeout_s=15)

    assert code == 1, output
    assert f"message cannot reach the scheduler at 127.0.0.1:{port} within 2 s" in output, output
    assert "`bpsctl up`" in output and "BPSCTL_SCHEDULER" in output, output
    elapsed = float(output.split("elapsed ")[1].split()[0])
    assert 1.9 <= elapsed < 4.0, output


def test_no_scheduler_recorded_fails_at_once_saying_how_to_start_one(tmp_path):
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"no scheduler to connect to: BPSCTL_SCHEDULER is not "
                                          r"set .*Start one with `bpsctl up`"):
        Worker(Config(state_dir=tmp_path / "nothing-here"))
    assert time.monotonic() - started < 1


def test_a_worker_that_never_arrives_is_named_after_the_start_timeout(cluster, tmp_path, workers):
    cmd = worker_script(tmp_path, INIT_AND_REPORT)
    config = run_config(cluster, world_size=3, job_id=uuid.uuid4().hex, start_timeout_s=2.0)
    for rank in (0, 1):                                    # rank 2 never starts
        workers.start(cmd, config.replace(rank=rank))
    outputs = workers.outputs(timeout_s=20)

    elapsed = []
    for rank, (code, output) in enumerate(outputs):
        assert code == 1, output
        assert (f"message rank {rank}: job {config.job_id!r}: worker rank(s) [2] never registered "
                "within 2 s (raise it with BPSCTL_START_TIMEOUT") in output, output
        elapsed.append(float(output.split("elapsed ")[1].split()[0]))
    # the timeout runs from the first registration: a rank slowed by a loaded machine joins later
    assert 1.5 <= max(elapsed) and max(elapsed) < 2.0 + 3.0, outputs
    # the scheduler forgot the failed job: a complete one runs on the same cluster
    assert run_job(cluster, 2, 2, lambda w: w.push_pull(np.ones(3), name="x", average=False)
                   .tolist()) == [[2.0] * 3] * 2


# --------------------------------------------------------------------------- deadlines

def test_a_push_pull_the_others_never_join_times_out_and_a_retry_is_never_wrong(cluster):
    """Rank 0's push_pull times out; its retry must not be summed with its own first push."""
    retried = threading.Event()

    def body(w: Worker):
        if w.rank == 1:
            assert retried.wait(20)
            time.sleep(0.3)                       # rank 0's retry has reached the server
            return w.push_pull(np.full(4, 2.0), name="x", average=False)
        started = time.monotonic()
        with pytest.raises(EngineError, match=r"^worker 0: push_pull of 'x' did not complete "
                                              r"within 1 s \(BPSCTL_OP_TIMEOUT\); still waiting "
                                              r"on server\(s\) \[0\]"):
            w.push_pull(np.ones(4), name="x", average=False)
        timed_out_after = time.monotonic() - started
        retried.set()
        with pytest.raises(EngineError, match=r"rank 0 pushed round 0 twice"):
            w.push_pull(np.ones(4), name="x", average=False)
        return timed_out_after

    timed_out_after, rank1_sum = run_job(cluster, 2, 1, body, op_timeout_s=1.0)
    assert 0.9 <= timed_out_after < 2.0
    # rank 1 completes the round rank 0 started: rank 0's first push plus its own
    np.testing.assert_array_equal(rank1_sum, np.full(4, 3.0))


# --------------------------------------------------------------------------- registration mistakes

def test_a_taken_rank_a_busy_cluster_and_too_many_servers_are_refused_at_once(cluster):
    def config(**knobs) -> Config:
        return run_config(cluster, scheduler=cluster.scheduler, secret=cluster.secret,
                          **{"world_size": 2, "rank": 0, "job_id": "first", **knobs})

    outcome: list[BaseException] = []

    def first_worker() -> None:          # waits for a rank 1 that never comes
        try:
            Worker(config(start_timeout_s=3.0)).shutdown()
        except EngineError as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=first_worker, daemon=True)
    waiting.start()
    try:
        wait_until(lambda: len(scheduler_status(cluster.scheduler, cluster.secret)["workers"]) == 1,
                   10, "the first worker to register")
        started = time.monotonic()
        with pytest.raises(EngineError, match=r"^rank 0: job 'first': rank 0 is already taken by "
                                              rf"worker 0 \(.*, pid {os.getpid()}\)"):
            Worker(config())
        with pytest.raises(EngineError, match=r"^rank 0: the cluster is busy with job 'first' "
                                              r"\(2 workers\); wait for it to end or run "
                                              r"`bpsctl down`"):
            Worker(config(job_id="second"))
        assert time.monotonic() - started < 2
    finally:
        waiting.join(10)
    assert len(outcome) == 1 and "worker rank(s) [1] never registered" in str(outcome[0])

    with pytest.raises(EngineError, match=r"^rank 0: the job asks for 3 servers "
                                          r"\(BPSCTL_NUM_SERVERS\) but only 2 are running"):
        Worker(config(world_size=1, job_id="third", num_servers=3))


@pytest.mark.timeout(60)
def test_a_worker_that_leaves_early_is_named_within_seconds(engine_cluster):
    """Under torchrun nobody stops the others: a peer that shuts down cleanly while they
    still need its pushes must be named at once, not after the 300 s op timeout."""
    job_id = f"left-{uuid.uuid4().hex[:8]}"
    made: dict[int, Worker] = {}

    def join(rank: int) -> None:
        made[rank] = Worker(Config(rank=rank, world_size=2, job_id=job_id, num_servers=1,
                                   scheduler=engine_cluster.scheduler, secret=engine_cluster.secret,
                                   start_timeout_s=10, heartbeat_interval_s=0.2,
                                   heartbeat_timeout_s=2.0, op_timeout_s=300))
    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        handles = [made[r].push_pull_async(np.ones(4, np.float32), name="warm", average=False)
                   for r in range(2)]
        for r, h in enumerate(handles):
            assert list(made[r].synchronize(h, timeout_s=20)) == [2.0] * 4
        made[1].shutdown()
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"worker 1 .*left the job"):
            made[0].push_pull(np.ones(4, np.float32), name="after", average=False)
        assert time.monotonic() - start < 10
    finally:
        for worker in made.values():
            worker.shutdown()


def test_a_rerun_right_after_a_crash_starts_once_the_crashed_job_is_declared_lost(cluster,
                                                                                   tmp_path):
    """The crashed job's workers went silent without leaving; the scheduler holds the new job's
    registrations until it declares them lost, instead of refusing them as a busy cluster."""
    config = run_config(cluster)
    crash = worker_script(tmp_path, """
        bps.init()
        if RANK == 1:
            os._exit(3)
        time.sleep(60)
    """)
    out = io.StringIO()
    assert api.run_local(crash, 2, config, stdout=out, stderr=out).exit_code == 3, out.getvalue()
    (tmp_path / "rerun").mkdir()
    rerun = worker_script(tmp_path / "rerun", """
        bps.init()
        out = bps.push_pull(np.ones(10, np.float32), name="x", average=False)
        print("sum", out[0], flush=True)
    """)
    started = time.monotonic()
    result = api.run_local(rerun, 2, config, stdout=out, stderr=out)
    assert result.exit_code == 0, out.getvalue()
    assert "[0] sum 2.0" in out.getvalue() and "[1] sum 2.0" in out.getvalue()
    assert time.monotonic() - started < config.heartbeat_timeout_s + REPORT_WITHIN_S
