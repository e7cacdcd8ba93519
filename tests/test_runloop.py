"""The one run loop, driven by a fake spawner: what every backend's `run` inherits from it.

The real spawners (local processes, emulated hosts, SSH) are exercised end to end by
test_launch.py, test_emulated_cluster.py and test_ssh_cluster.py.
"""
from __future__ import annotations

import dataclasses
import time

from bpsctl.config import Config
from bpsctl.launch.plan import cluster_hosts, plan
from bpsctl.launch.runloop import run_workers
from bpsctl.launch.types import ClusterState, ProcessRecord

SERVER = ProcessRecord(role="server", rank=0, host="127.0.0.1", port=9001, pid=4242,
                       create_time=0.0, pgid=4242, log_path="server-0.log")
CLUSTER = ClusterState(name="local-test", scheduler="127.0.0.1:9000", secret="s", state_dir="/x",
                       created=0.0,
                       processes=(ProcessRecord(role="scheduler", rank=0, host="127.0.0.1",
                                                port=9000, pid=4241, create_time=0.0, pgid=4241,
                                                log_path="scheduler-0.log"), SERVER))


class FakeWorker:
    def __init__(self, rank: int, exits_at: float | None, code: int):
        self.rank, self.pid, self.host = rank, 1000 + rank, ""
        self.exits_at, self.code = exits_at, code
        self.stopped = False

    def exit_code(self) -> int | None:
        if self.stopped:
            return -1
        if self.exits_at is not None and time.monotonic() >= self.exits_at:
            return self.code
        return None

    def signal_name(self) -> str | None:
        return None

    def last_lines(self) -> list[str]:
        return [f"rank {self.rank} says goodbye"]


class FakeSpawner:
    """Worker r exits with ``codes[r]`` after ``delays_s[r]`` (None: runs until stopped)."""

    def __init__(self, delays_s, codes, lost_after_s: float | None = None):
        self.delays_s, self.codes = delays_s, codes
        self.started_at = time.monotonic()
        self.lost_after_s = lost_after_s
        self.envs: dict[int, dict[str, str]] = {}
        self.workers: list[FakeWorker] = []
        self.stopped_with: list[int] | None = None

    def start(self, assignment, env):
        self.envs[assignment.rank] = env
        delay = self.delays_s[assignment.rank]
        worker = FakeWorker(assignment.rank, None if delay is None else self.started_at + delay,
                            self.codes[assignment.rank])
        self.workers.append(worker)
        return worker

    def started(self, workers) -> None:
        pass

    def lost(self):
        if self.lost_after_s is not None and time.monotonic() - self.started_at > self.lost_after_s:
            return [SERVER]
        return []

    def stop(self, workers, grace_s) -> None:
        self.stopped_with = [w.rank for w in workers if w.exit_code() is None]
        for w in workers:
            w.stopped = True


def _plan(workers: int, cluster: ClusterState = CLUSTER):
    return plan(cluster_hosts(cluster, workers, master_port=29501), Config(), secret="s",
                job_id="job")


def test_all_workers_exit_zero():
    spawner = FakeSpawner([0.0, 0.05, 0.1], [0, 0, 0])
    result = run_workers(spawner, _plan(3), Config())
    assert result.exit_code == 0 and not result.failures and not result.lost
    assert spawner.stopped_with == []


def test_the_first_failure_is_the_root_cause_and_the_rest_are_stopped():
    spawner = FakeSpawner([None, 0.05, None, 0.3], [0, 3, 0, 4])
    result = run_workers(spawner, _plan(4), Config())
    assert result.exit_code == 3
    assert [f.rank for f in result.failures] == [1]
    assert result.failures[0].last_lines == ("rank 1 says goodbye",)
    assert sorted(spawner.stopped_with) == [0, 2, 3]


def test_every_worker_gets_its_place_in_the_job_in_its_environment():
    spawner = FakeSpawner([0.0, 0.0], [0, 0])
    run_workers(spawner, _plan(2), Config())
    for rank, env in spawner.envs.items():
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert env["BPSCTL_SCHEDULER"] == "127.0.0.1:9000" and env["BPSCTL_JOB_ID"] == "job"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29501"


def test_a_lost_server_is_named_and_stuck_workers_are_stopped_after_the_grace():
    spawner = FakeSpawner([None, None], [0, 0], lost_after_s=0.05)
    started = time.monotonic()
    result = run_workers(spawner, _plan(2), Config(), lost_grace_s=0.2)
    assert 0.2 <= time.monotonic() - started < 5
    assert result.exit_code == 1
    assert result.lost == "lost server 0 at 127.0.0.1:9001 (pid 4242): it exited during the run"
    assert sorted(spawner.stopped_with) == [0, 1]


def test_a_lost_server_while_others_remain_is_said_and_the_workers_go_on(caplog):
    """With failover (the default) the job's workers move its partitions to the other
    servers: the run loop says so and lets them finish; with it off, it stops them."""
    second = dataclasses.replace(SERVER, rank=1, port=9002, pid=4243, pgid=4243)
    two_servers = dataclasses.replace(CLUSTER, processes=(*CLUSTER.processes, second))
    spawner = FakeSpawner([0.5, 0.5], [0, 0], lost_after_s=0.05)
    result = run_workers(spawner, _plan(2, two_servers), Config(), lost_grace_s=0.1)
    assert result.exit_code == 0 and result.lost == "" and spawner.stopped_with == []
    assert "lost server 0 at 127.0.0.1:9001 (pid 4242): it exited during the run; the job " \
        "goes on" in caplog.text
    spawner = FakeSpawner([2.0, 2.0], [0, 0], lost_after_s=0.05)
    result = run_workers(spawner, _plan(2, two_servers), Config(server_failover=False),
                         lost_grace_s=0.1)
    assert result.exit_code == 1 and sorted(spawner.stopped_with) == [0, 1]
