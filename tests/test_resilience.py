"""Keeping going through a lost server: its partitions move to the job's other servers, the
workers push again what it had not answered, and every sum stays exact."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import cluster_config, gone, kill_pids, run_job, wait_until

from bpsctl.launch import api

HEARTBEAT_TIMEOUT_S = 1.0
KiB = 1024


@pytest.fixture
def cluster():
    """A private cluster of three servers that declares a silent one lost within 1 s."""
    with api.local_cluster(cluster_config(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S),
                           servers=3) as state:
        pids = [p.pid for p in state.processes]
        yield state
    kill_pids(pid for pid in pids if not gone(pid))
    wait_until(lambda: all(gone(pid) for pid in pids), 5, "the cluster's processes to exit")


def _server(cluster, worker, part_id: int):
    """The recorded process of the server that holds ``part_id`` for ``worker``."""
    index = worker._parts[part_id][1]
    port = worker._servers[index]["port"]
    return next(p for p in cluster.processes if p.role == "server" and p.port == port)


def test_a_killed_server_is_replaced_and_every_sum_stays_exact(cluster):
    """kill -9 one of three servers mid-run: the job goes on to its last step, every sum of
    integer-valued data exact on both workers, and the step that saw the loss is at most the
    heartbeat timeout + 2 s slower."""
    steps, kill_at = 30, 10
    victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)

    def body(worker):
        grads = [np.zeros(64 * KiB, np.float32) for _ in range(4)]     # 256 KiB each
        seconds = []
        for step in range(steps):
            if step == kill_at and worker.rank == 0:
                os.kill(victim.pid, signal.SIGKILL)
            started = time.monotonic()
            for i, grad in enumerate(grads):
                grad[:] = (worker.rank + 1) * (step + 1) + i
            handles = [worker.push_pull_async(g, name=f"grad{i}", average=False, out=g)
                       for i, g in enumerate(grads)]
            for handle in handles:
                worker.synchronize(handle)
            seconds.append(time.monotonic() - started)
            for i, grad in enumerate(grads):
                # ranks 1 and 2 push (step + 1) and 2 (step + 1), plus i each
                expected = 3 * (step + 1) + 2 * i
                assert np.all(grad == expected), (worker.rank, step, i, grad[:4])
        return seconds

    results = run_job(cluster, 2, 3, body, partition_bytes=64 * KiB,
                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert gone(victim.pid)
    for seconds in results:
        assert len(seconds) == steps
        usual = float(np.median(seconds))
        assert max(seconds) <= usual + HEARTBEAT_TIMEOUT_S + 2, seconds


def test_a_push_the_lost_server_had_summed_is_not_counted_twice(cluster):
    """Ranks 0 and 1 push a partition, the server that holds it acknowledges both and is
    killed before rank 2 pushes: after the move all three push again to the new server, and
    the sum is 1 + 2 + 3, not 1 + 2 + 1 + 2 + 3."""
    acked = threading.Barrier(3, timeout=30)
    killed = threading.Event()

    def body(worker):
        grad = np.full(1024, worker.rank + 1, np.float32)
        worker.push_pull(np.zeros(4, np.float32), name="warm-up", average=False)
        if worker.rank < 2:
            handle = worker.push_pull_async(grad, name="grad", average=False, out=grad)
            # acknowledged: the server holds this worker's contribution
            wait_until(lambda: _acknowledged(worker, "grad"), 10,
                       f"rank {worker.rank}'s push to be acknowledged")
            acked.wait()
        else:
            acked.wait()
            wait_until(lambda: all(w["port"] for w in worker._servers), 1, "the address book")
            victim = _server(cluster, worker, _part_of(worker, "grad"))
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: gone(victim.pid), 5, "the server to die")
            killed.set()
            handle = worker.push_pull_async(grad, name="grad", average=False, out=grad)
        worker.synchronize(handle)
        return grad.copy()

    results = run_job(cluster, 3, 3, body, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert killed.is_set()
    for result in results:
        assert np.all(result == 6), result[:4]


def _part_of(worker, name: str) -> int:
    """The id of tensor ``name``'s one partition, declared by any rank (ask the scheduler)."""
    if name not in worker._tensors:
        worker.declare(name, (1024,), np.float32)
        wait_until(lambda: name in worker._tensors, 10, f"{name} to be declared")
    [part] = worker._tensors[name]["parts"]
    return part[0]


def _acknowledged(worker, name: str) -> bool:
    """Whether ``worker`` has sent tensor ``name``'s partition and its server acknowledged it
    (``_active`` is filled after ``_unacked`` when a push leaves; an ACK empties the latter)."""
    info = worker._tensors.get(name)
    if info is None:
        return False
    part_id = info["parts"][0][0]
    return part_id in worker._active and part_id not in worker._unacked
