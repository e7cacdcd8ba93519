"""Spare servers (`bpsctl up --spare-servers N`): they register with the scheduler and hold
nothing until a server is lost; then one takes over all of the lost server's partitions."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import cluster_config, exact_integer_step, gone, kill_pids, run_job, wait_until

from bpsctl.launch import api

HEARTBEAT_TIMEOUT_S = 1.0
KiB = 1024


@pytest.fixture
def cluster():
    """A private cluster of two servers and one spare that declares a silent one lost in 1 s."""
    config = cluster_config(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, spare_servers=1)
    with api.local_cluster(config, servers=2) as state:
        pids = [p.pid for p in state.processes]
        yield state
    kill_pids(pid for pid in pids if not gone(pid))
    wait_until(lambda: all(gone(pid) for pid in pids), 5, "the cluster's processes to exit")


def _rows(cluster) -> dict[int, dict]:
    """`bpsctl status`'s server rows, by rank."""
    report = api.status(cluster.state_dir)
    return {row["rank"]: row for row in report["processes"] if row["role"] == "server"}


def test_a_spare_holds_nothing_until_it_takes_over_a_killed_servers_partitions(cluster, caplog):
    """Two servers and a spare: the job places nothing on the spare; kill -9 server 0 mid-run
    and every partition it held moves to the spare (the others stay where they were), every sum
    of integer-valued data stays exact on both workers, the workers say the spare took over,
    and `bpsctl status` shows the spare as spare, then as the server that replaced server 0."""
    steps, kill_at = 24, 8
    rows = _rows(cluster)
    assert [rows[rank]["state"] for rank in sorted(rows)] == ["running", "running", "spare"]
    victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 0)
    spare = next(p for p in cluster.processes if p.role == "server" and p.rank == 2)

    def body(worker):
        index = {s["port"]: i for i, s in enumerate(worker._servers)}
        victim_index, spare_index = index[victim.port], index[spare.port]
        grads = [np.zeros(n, np.float32) for n in (10, 40 * KiB, 100 * KiB)]  # 1, 3, 7 parts
        placed: dict[int, int] = {}
        seconds = []
        for step in range(steps):
            if step == kill_at:
                placed = {part_id: part[1] for part_id, part in worker._parts.items()}
                # both ranks hold every sum of the step before: a server killed while its
                # last sum had reached one worker but not the other fails the job by design
                worker.barrier()
                if worker.rank == 0:
                    os.kill(victim.pid, signal.SIGKILL)
            started = time.monotonic()
            exact_integer_step(worker, grads, step)
            seconds.append(time.monotonic() - started)
        after = {part_id: part[1] for part_id, part in worker._parts.items()}
        return placed, after, victim_index, spare_index, seconds

    with caplog.at_level(logging.WARNING):
        results = run_job(cluster, 2, 2, body, partition_bytes=64 * KiB,
                          heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert gone(victim.pid)
    for placed, after, victim_index, spare_index, seconds in results:
        assert len(placed) == 11 and spare_index not in placed.values(), placed
        on_victim = {part for part, server in placed.items() if server == victim_index}
        assert on_victim, f"server 0 held nothing: {placed}"
        assert after == {part: spare_index if part in on_victim else server
                         for part, server in placed.items()}, (placed, after)
        usual = float(np.median(seconds))
        assert max(seconds) <= usual + HEARTBEAT_TIMEOUT_S + 2, seconds
    said = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len([m for m in said if m.startswith("worker ")]) == 2, said
    assert all(f"spare server 2 took over its {len(on_victim)} partitions" in m
               for m in said if m.startswith("worker ")), said
    rows = _rows(cluster)
    assert rows[0]["state"] == "exited", rows
    assert rows[2]["state"] == "running" and rows[2]["took_over"] == 0, rows


def test_a_server_lost_between_jobs_is_replaced_by_the_spare_for_the_next_job(cluster):
    """kill -9 server 1 while no job runs: `bpsctl status` soon shows the spare as having taken
    its place, and the next job of two servers runs on server 0 and the former spare."""
    victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: _rows(cluster)[2].get("took_over") == 1, 10,
               "the spare to take the lost server's place")
    assert _rows(cluster)[2]["state"] == "running"

    def body(worker):
        grad = np.full(100 * KiB, worker.rank + 1, np.int32)      # 7 partitions
        worker.push_pull(grad, name="grad", average=False, out=grad)
        assert np.all(grad == 3), grad[:4]
        return sorted({worker._servers[part[1]]["rank"] for part in worker._parts.values()})

    assert run_job(cluster, 2, 2, body, partition_bytes=64 * KiB) == [[0, 2], [0, 2]]


@pytest.mark.parametrize("args, spares, message", [
    (["up", "--spare-servers", "-1"], "", "--spare-servers / BPSCTL_SPARE_SERVERS: expected 0 "
                                          "or more, got -1"),
    (["up"], "-2", "--spare-servers / BPSCTL_SPARE_SERVERS: expected 0 or more, got -2"),
    (["up", "--slurm", "--spare-servers", "1"], "", "--spare-servers / BPSCTL_SPARE_SERVERS: "
     "spare servers are started on this machine, on emulated hosts or on SSH hosts; on a Slurm "
     "allocation give --spare-servers 0"),
    (["up", "--hosts", "h1:2", "--spare-servers", "1"], "", "--spare-servers / "
     "BPSCTL_SPARE_SERVERS: on SSH hosts the hosts file says where spare servers run: add "
     "`spare: true` to a `servers:` entry"),
])
def test_a_spare_count_bpsctl_cannot_start_exits_2_naming_the_flag(tmp_path, args, spares,
                                                                   message):
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "BPSCTL_SPARE_SERVERS": spares}
    result = subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "state" / "cluster.json").exists()
