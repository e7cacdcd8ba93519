"""A caller that copies its own bytes (a GPU's copy engine) between its tensors and the engine's
shared memory with the servers on its host: ``Worker.lend`` hands it a name's push slots to
fill, ``lend_results=True`` leaves each sum where it arrived for it to read, and
``pin_shared_memory`` page-locks that memory for it (engine/shmlink.py, docs/design.md
"Gradients on GPUs").

On this machine the caller's copies are NumPy's, standing in for the GPU's (the CUDA ones run
in test_torch_gpu.py). The sums are real: real servers, real shared memory. The page-locking
is a recorder here (``cudaHostRegister`` needs a GPU), which checks what the engine pins and
that it unpins all of it at shutdown and a lost server's share at its failover.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np
import pytest
from conftest import private_cluster, run_job

from bpsctl.engine import Worker
from bpsctl.engine import protocol as P
from bpsctl.engine.shmlink import merge_runs
from bpsctl.engine.worker import sum_into

PARTITION_BYTES = 65536
#: four and a half partitions of float32; two and a quarter of the 2-byte types
COUNT = 73728


@pytest.fixture(scope="module")
def cluster(engine_cluster):
    return engine_cluster


def values(rank: int, step: int, dtype: np.dtype) -> np.ndarray:
    """Small integers, exact in every dtype and different per rank and step."""
    ints = np.arange(COUNT) % 9 + rank + step
    if dtype == P.BFLOAT16:
        return (ints.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(dtype)
    return ints.astype(dtype)


def as_float(array: np.ndarray) -> np.ndarray:
    if array.dtype == P.BFLOAT16:
        return (array.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float64)


def push_filled(worker: Worker, array: np.ndarray, name: str, average: bool
                ) -> tuple[np.ndarray, int, bool]:
    """One push_pull the way the torch plugin's GPU path makes it: the caller fills the lent
    slots itself (np.copyto here, the GPU's copy there) and reads each sum where it arrived.
    Returns the result, how many partitions were lent back, and whether the engine left
    ``out`` alone (it copied no sum)."""
    lease = worker.lend(name, array.nbytes)
    assert lease is not None, f"no slots lent for {name}"
    raw = array.reshape(-1).view(np.uint8)
    # by runs of consecutive slots, as the GPU copies them
    for offset, view in lease.runs():
        np.copyto(view, raw[offset:offset + len(view)])
    unread = np.full_like(array, 99)        # the engine must push the slots, not this
    out = np.zeros_like(array)
    handle = worker.push_pull_async(unread, name=name, average=average, out=out, filled=lease,
                                    lend_results=True)
    worker.synchronize(handle)
    untouched = not out.view(np.uint8).any()
    result = out.reshape(-1).copy()
    itemsize = array.dtype.itemsize
    for offset, view, divisor in merge_runs(handle.lent):
        assert not view.flags.writeable or worker.size == 1, "a server's sum lent writable"
        summed = view.view(array.dtype)
        sum_into(summed, divisor, result[offset // itemsize:offset // itemsize + len(summed)])
    return result.reshape(array.shape), len(handle.lent), untouched


def filled_steps(worker: Worker) -> dict[str, Any]:
    """Three steps of sums and averages per dtype: the first pushed as usual (it places the
    slots), the next two filled by the caller; every result checked exactly."""
    lent = 0
    for dtype in (np.dtype(np.float32), np.dtype(np.float16), P.BFLOAT16,
                  np.dtype(np.int32)):
        for average in (False, True) if dtype.kind == "f" or dtype == P.BFLOAT16 else (False,):
            name = f"{dtype.str}.{average}"
            assert worker.lend(name, COUNT * dtype.itemsize) is None     # not pushed yet
            for step in range(3):
                want = sum(as_float(values(r, step, dtype)) for r in range(worker.size))
                if average:
                    want = as_float((want / worker.size).astype(np.float32).astype(dtype)
                                    if dtype != P.BFLOAT16 else want / worker.size)
                mine = values(worker.rank, step, dtype)
                if step == 0:
                    got = worker.push_pull(mine, name=name, average=average)
                else:
                    got, parts, untouched = push_filled(worker, mine, name, average)
                    assert untouched, f"{name}: the engine copied a sum it lent"
                    lent += parts
                assert (as_float(got) == want).all(), (name, step, as_float(got)[:4], want[:4])
    return {"lent": lent, **worker.stats()}


@pytest.mark.parametrize("workers,servers", [(1, 1), (2, 1), (2, 2)])
def test_slots_the_caller_fills_and_sums_it_reads_in_place_are_exact(cluster, workers, servers):
    results = run_job(cluster, workers, servers, filled_steps, partition_bytes=PARTITION_BYTES,
                      force_distributed=True)
    for result in results:
        # two filled steps of 7 names: float32 (sum, average) and int32 of 5 partitions
        # each, float16 and bfloat16 (sum, average) of 3
        parts = 2 * (3 * 5 + 4 * 3)
        # every filled push went out of its slot with no copy, every sum was read in place
        assert result["filled_pushes"] == parts, result
        assert result["lent"] == result["lent_results"] == parts, result


def test_nothing_is_lent_in_flight_over_tcp_or_before_the_first_push(cluster):
    def body(worker: Worker) -> list[str]:
        seen = []
        x = np.ones(10240, np.float32)      # 40 KiB: the bound below has room for one
        worker.push_pull(x, name="fits", average=False)
        worker.push_pull(x, name="spills", average=False)
        seen.append("fits" if worker.lend("fits", x.nbytes) is not None else "")
        seen.append("spills" if worker.lend("spills", x.nbytes) is not None else "")
        assert worker.lend("fits", x.nbytes - 4) is None      # another size: not that name's
        handle = worker.push_pull_async(x, name="fits", average=False)
        in_flight = worker.lend("fits", x.nbytes)
        worker.synchronize(handle)
        seen.append("in flight" if in_flight is not None else "")
        return seen
    for seen in run_job(cluster, 2, 1, body, shm_server_bytes="64KiB",
                        partition_bytes=PARTITION_BYTES):
        assert seen == ["fits", "", ""], seen


class Recorder:
    """A Pinning that records: every segment the engine pins and unpins, once each."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pinned: dict[int, tuple[np.ndarray, bool]] = {}    # token -> (view, writable)
        self.unpinned: list[int] = []
        self.tokens = iter(range(1, 1 << 30))

    def pin(self, view: np.ndarray, writable: bool) -> int:
        with self.lock:
            assert all(v.ctypes.data != view.ctypes.data for v, _ in self.pinned.values()), \
                "a segment pinned twice"
            token = next(self.tokens)
            self.pinned[token] = (view, writable)
            return token

    def unpin(self, token: int) -> None:
        with self.lock:
            assert token in self.pinned, f"token {token} unpinned twice or never pinned"
            del self.pinned[token]
            self.unpinned.append(token)

    def pinned_bytes(self, writable: bool) -> int:
        with self.lock:
            return sum(view.nbytes for view, w in self.pinned.values() if w == writable)

    def addresses(self) -> set[int]:
        with self.lock:
            return {view.ctypes.data for view, _ in self.pinned.values()}


def _segments(worker: Worker, server: int | None = None) -> list[np.ndarray]:
    """The chunks the worker has mapped for its servers (or one): its push slots' segments,
    and the servers' sum buffers it mapped."""
    views = [view for index, family in worker._shm_slots.items() if server in (None, index)
             for _, _, view in family.chunks]
    return views + [view for index, family in worker._shm_sums.items()
                    if server in (None, index) for _, view in family.chunks.values()]


def test_shared_memory_is_pinned_as_it_is_made_and_unpinned_at_shutdown(cluster):
    recorders = {0: Recorder(), 1: Recorder()}

    def body(worker: Worker) -> tuple[int, int]:
        recorder = recorders[worker.rank]
        x = np.ones(COUNT, np.float32)
        worker.push_pull(x, name="before", average=False)     # segments made before ...
        worker.pin_shared_memory(recorder)                      # ... are pinned now
        for _ in range(2):
            worker.push_pull(x, name="before", average=False)
            worker.push_pull(x, name="after", average=False)    # ... and those made later
        slots = sum(view.nbytes for view in _segments(worker) if view.flags.writeable)
        sums = sum(view.nbytes for view in _segments(worker) if not view.flags.writeable)
        assert slots > 0 and sums > 0
        # every segment pinned, the servers' sums read-only
        assert (recorder.pinned_bytes(True), recorder.pinned_bytes(False)) == (slots, sums)
        return slots, sums
    run_job(cluster, 2, 2, body, partition_bytes=PARTITION_BYTES)
    for recorder in recorders.values():
        assert recorder.unpinned and not recorder.pinned, "left pinned after shutdown"


@pytest.fixture
def lossy_cluster():
    """A private cluster of two servers that declares a silent one lost within 1 s."""
    with private_cluster(2, heartbeat_timeout_s=1.0) as state:
        yield state


def test_filled_slots_survive_a_lost_server_whose_memory_is_unpinned(lossy_cluster):
    """Both workers fill their slots for the next step, then one of the two servers is
    killed: the partitions it held move to the other, which gets the bytes the workers had
    filled (the sums stay exact), and each worker unpins the lost server's shared memory at
    the failover while the rest stays pinned until shutdown."""
    recorders = {0: Recorder(), 1: Recorder()}
    killed = threading.Barrier(2, timeout=30)

    def body(worker: Worker) -> None:
        recorder = recorders[worker.rank]
        worker.pin_shared_memory(recorder)
        x = np.full(COUNT, worker.rank + 1, np.float32)
        for step in range(2):
            assert (worker.push_pull(x, name="g", average=False) == 3).all(), step
        assert {part[1] for part in worker._tensors["g"]["parts"]} == {0, 1}   # both servers
        lease = worker.lend("g", x.nbytes)
        assert lease is not None
        for _, _, view in lease.views:
            view.view(np.float32)[:] = worker.rank + 1
        lost = {view.ctypes.data for view in _segments(worker, 1)}
        kept = {view.ctypes.data for view in _segments(worker, 0)}
        assert lost and kept and recorder.addresses() == lost | kept
        killed.wait()
        if worker.rank == 0:
            port = worker._servers[1]["port"]
            victim = next(p for p in lossy_cluster.processes
                          if p.role == "server" and p.port == port)
            os.kill(victim.pid, signal.SIGKILL)
        killed.wait()
        out = np.zeros_like(x)
        worker.synchronize(worker.push_pull_async(x * 0, name="g", average=False, out=out,
                                                  filled=lease))
        assert (out == 3).all(), out[::PARTITION_BYTES // 4]
        # after the move: the lost server's memory unpinned, the other's still pinned
        pinned = recorder.addresses()
        assert not pinned & lost and kept <= pinned, "the lost server's memory is still pinned"
        assert (worker.push_pull(x, name="g", average=False) == 3).all()

    run_job(lossy_cluster, 2, 2, body, partition_bytes=PARTITION_BYTES,
            heartbeat_timeout_s=1.0)
    for recorder in recorders.values():
        assert not recorder.pinned, "left pinned after shutdown"
