"""The engine's results: exact sums and averages across workers, servers, dtypes and shapes.

Workers are threads (see conftest.run_job) against one real cluster of four server processes;
each job uses the first ``servers`` of them.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import zmq

import bpsctl
from bpsctl.config import Config, auto_io_threads
from bpsctl.engine import EngineError, Worker
from bpsctl.engine import compression as C
from bpsctl.engine import protocol as P
from bpsctl.engine.common import io_thread_affinity
from bpsctl.engine.security import Security

pytestmark = pytest.mark.timeout(120)


def _ranked_int64(rank: int, count: int, signed: bool, scale: int) -> np.ndarray:
    base = np.arange(count, dtype=np.int64) % scale
    if signed:
        base -= scale // 2
    return base * (rank + 1) + rank


def ranked(rank: int, count: int, dtype, scale: int = 50) -> np.ndarray:
    """Integer-valued data, different on every rank, exactly representable in ``dtype``
    (negative values too, unless ``dtype`` is unsigned)."""
    signed = np.dtype(dtype).kind != "u"
    return _ranked_int64(rank, count, signed, scale).astype(dtype)


def expected_sum(workers: int, count: int, dtype, scale: int = 50) -> np.ndarray:
    """The sum of ``ranked`` over ``workers`` ranks, computed in int64."""
    signed = np.dtype(dtype).kind != "u"
    total = sum(_ranked_int64(r, count, signed, scale) for r in range(workers))
    return np.asarray(total).astype(dtype)


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64",
                                   "int8", "uint8", "int16", "uint16", "uint32", "uint64"])
def test_sum_is_exact_for_integer_valued_data(job, dtype):
    count, scale = 1001, 10 if np.dtype(dtype).itemsize == 1 else 50

    def body(w: Worker):
        return w.push_pull(ranked(w.rank, count, dtype, scale), name="grad", average=False)

    for result in job(3, 2, body, partition_bytes=200):     # several partitions on each server
        assert_same(result, expected_sum(3, count, dtype, scale))


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
def test_averaging_an_integer_tensor_is_refused(job, dtype):
    def body(w: Worker):
        with pytest.raises(TypeError, match=r"average=True needs a floating-point tensor, got "
                                            rf"{dtype} for 'counts'; pass average=False to sum"):
            w.push_pull(np.ones(4, dtype), name="counts")
        # the refused call left nothing behind: the same name sums fine
        return w.push_pull(np.ones(4, dtype), name="counts", average=False)

    for result in job(2, 1, body):
        assert_same(result, np.full(4, 2, dtype))


@pytest.mark.parametrize("dtype", ["bool", "complex64"])
def test_an_unsupported_dtype_is_refused_with_the_supported_list(job, dtype):
    def body(w: Worker):
        with pytest.raises(TypeError, match=rf"dtype {dtype} is not supported by push_pull; "
                                            r"use one of: uint8, .*float64"):
            w.push_pull(np.zeros(3, dtype), name="x", average=False)

    job(1, 1, body)


# --------------------------------------------------------------------------- min, max, product

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int64",
                                   "bfloat16"])
def test_servers_reduce_by_min_max_and_product_elementwise(job, dtype):
    # each rank's values differ per element, with negatives where signed: the servers must
    # combine elementwise, across partitions on both servers, not sum
    count = 999
    real = np.dtype(np.float32) if dtype == "bfloat16" else np.dtype(dtype)

    def values(rank: int) -> np.ndarray:
        signed = real.kind != "u"
        base = (np.arange(count) * (rank + 3)) % 7 - (3 if signed else 0)
        return base.astype(real)

    def on_wire(a: np.ndarray) -> np.ndarray:            # bfloat16: a float32's upper half
        if dtype != "bfloat16":
            return a
        return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(P.BFLOAT16)

    def from_wire(a: np.ndarray) -> np.ndarray:
        if dtype != "bfloat16":
            return a
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def body(w: Worker):
        mine = on_wire(values(w.rank))
        return [from_wire(w.push_pull(mine, name=f"r{reduction}", average=False,
                                      reduction=reduction))
                for reduction in (P.REDUCE_MIN, P.REDUCE_MAX, P.REDUCE_PRODUCT)]

    everyone = np.stack([values(r) for r in range(3)])
    for low, high, product in job(3, 2, body, partition_bytes=256):
        assert_same(low, everyone.min(axis=0))
        assert_same(high, everyone.max(axis=0))
        assert_same(product, np.prod(everyone, axis=0, dtype=real))


def test_a_reduction_other_than_a_sum_refuses_averaging_and_compression(job):
    def body(w: Worker):
        for kwargs, why in [({"average": True}, "averaged"),
                            ({"average": False, "compression": C.FP16()}, "compressed")]:
            with pytest.raises(ValueError, match=rf"push_pull of 'x' by max cannot be {why}"):
                w.push_pull(np.ones(4, np.float32), name="x", reduction=P.REDUCE_MAX,
                            **kwargs)
        with pytest.raises(ValueError, match=r"unknown reduction 9"):
            w.push_pull(np.ones(4, np.float32), name="x", average=False, reduction=9)
        # nothing was left behind: the name reduces by max, and then keeps that reduction
        got = w.push_pull(np.full(4, w.rank, np.float32), name="x", average=False,
                          reduction=P.REDUCE_MAX)
        with pytest.raises(ValueError, match=r"tensor 'x' was reduced by max before, now by "
                                             r"sum; use another name"):
            w.push_pull(np.ones(4, np.float32), name="x", average=False)
        return got

    for result in job(2, 1, body):
        assert_same(result, np.full(4, 1, np.float32))


def test_ranks_reducing_a_name_by_different_ops_all_fail_naming_both(job):
    def body(w: Worker):
        with pytest.raises(EngineError, match=rf"^worker {w.rank}: workers disagree on tensor "
                                              r"'m': rank \d has float32\(4,\)( reduced by max)?, "
                                              r"rank \d has float32\(4,\)( reduced by max)?$"):
            w.push_pull(np.ones(4, np.float32), name="m", average=False,
                        reduction=P.REDUCE_MAX if w.rank == 0 else P.REDUCE_SUM)
        return True

    assert job(2, 1, body, op_timeout_s=30.0) == [True, True]


# --------------------------------------------------------------------------- shapes and sizes

@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (1001,), (3, 333)])
def test_every_shape_comes_back_with_its_sum(job, shape):
    def body(w: Worker):
        data = np.full(shape, w.rank + 1, np.float32)
        return w.push_pull(data, name="t", average=False)

    for result in job(2, 2, body, partition_bytes=16):
        assert_same(result, np.full(shape, 3, np.float32))


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_a_one_byte_tensor(job, dtype):
    def body(w: Worker):
        return w.push_pull(np.array([w.rank + 1], dtype), name="byte", average=False)

    for result in job(4, 4, body):
        assert_same(result, np.array([10], dtype))


@pytest.mark.parametrize("dtype,partition_bytes,count", [
    ("float64", 1000, 1001),    # 1000 is not a multiple of 8: pieces of 992 bytes
    ("float64", 12, 5),         # one element per piece
    ("int32", 10, 999),
    ("float16", 9, 333),
    ("uint8", 1000, 2501),      # last piece shorter
    ("float32", 4096, 3 * 1024 + 1),
])
def test_sizes_the_partition_size_does_not_divide(job, dtype, partition_bytes, count):
    def body(w: Worker):
        return w.push_pull(ranked(w.rank, count, dtype, 10), name="odd", average=False)

    for result in job(2, 3, body, partition_bytes=partition_bytes):
        assert_same(result, expected_sum(2, count, dtype, 10))


def test_a_100mb_tensor_averaged_over_two_workers(job):
    count = 25 * 1024 * 1024                 # 100 MiB of float32
    base = (np.arange(count, dtype=np.int64) % 4096).astype(np.float32)

    def body(w: Worker):
        data = base + 2 * w.rank             # ranks 0 and 1: mean is base + 1, exactly
        result = w.push_pull(data, name="big")
        ok = np.array_equal(result, base + 1)  # compared here: keeps one copy alive, not two
        return ok, result.shape, result.dtype

    for ok, shape, dtype in job(2, 4, body):
        assert ok and shape == (count,) and dtype == np.float32


def test_partition_depth_gives_every_server_its_share_of_pieces_and_the_same_sum(job):
    count = 6 * 1024 * 1024 + 5              # 24 MiB and 20 bytes of float32
    base = (np.arange(count, dtype=np.int64) % 4096).astype(np.float32)

    def body(w: Worker):
        result = w.push_pull(base * (w.rank + 1), name="deep", average=False)
        return np.array_equal(result, base * 3), w._tensors["deep"]["parts"]

    for ok, parts in job(2, 3, body, partition_depth=8):
        assert ok
        # 24 MiB over 3 servers x 8: 1 MiB pieces (2 MiB without the depth)
        assert max(p[3] for p in parts) == 1 << 20 and len(parts) == 25
        assert sorted({p[1] for p in parts}) == [0, 1, 2]


def test_non_contiguous_input_is_summed_as_its_values(job):
    def body(w: Worker):
        matrix = np.arange(24, dtype=np.float64).reshape(4, 6) * (w.rank + 1)
        return w.push_pull(matrix[:, ::2].T, name="view", average=False)

    expected = (np.arange(24, dtype=np.float64).reshape(4, 6) * 3)[:, ::2].T
    for result in job(2, 2, body, partition_bytes=16):
        np.testing.assert_array_equal(result, expected)


# --------------------------------------------------------------------------- many tensors, rounds

def test_six_hundred_tensors_in_one_step(job):
    sizes = [(i * 37) % 300 + 1 for i in range(600)]

    def body(w: Worker):
        handles = [w.push_pull_async(np.full(size, i * 10 + w.rank, np.float32), name=f"p{i}",
                                     average=False, priority=-i)
                   for i, size in enumerate(sizes)]
        return [w.synchronize(h) for h in handles]

    for results in job(2, 4, body, partition_bytes=400):
        for i, (size, result) in enumerate(zip(sizes, results, strict=True)):
            assert_same(result, np.full(size, 2 * i * 10 + 1, np.float32))


def test_sixty_rounds_reuse_the_same_names_with_new_values(job):
    names = ["w0", "w1", "b0", "scalar"]
    shapes = [(300,), (17, 3), (5,), ()]
    rounds = 60

    def body(w: Worker):
        wrong = []
        for step in range(rounds):
            handles = [w.push_pull_async(np.full(shape, step * 7 + w.rank + k, np.float64),
                                         name=name, average=False)
                       for k, (name, shape) in enumerate(zip(names, shapes, strict=True))]
            for k, (handle, shape) in enumerate(zip(handles, shapes, strict=True)):
                expected = np.full(shape, 3 * (step * 7 + k) + 3, np.float64)   # ranks 0, 1, 2
                if not np.array_equal(w.synchronize(handle), expected):
                    wrong.append((step, names[k]))
        return wrong

    assert job(3, 2, body, partition_bytes=256) == [[], [], []]


# --------------------------------------------------------------------------- averaging, out=

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_average_is_the_default(job, dtype):
    def body(w: Worker):
        return w.push_pull(np.arange(10, dtype=dtype) * 3 + 3 * w.rank, name="g")

    for result in job(3, 2, body):              # mean of x, x+3, x+6 is x+3
        assert_same(result, (np.arange(10) * 3 + 3).astype(dtype))


def test_an_average_divides_by_the_pushes_held_even_where_a_worker_counts_one(job):
    """A worker that lost its peer and handed its model to the one rejoining counts one worker
    until the scheduler's word that they are two again reaches it; its next average must still
    be divided by the two pushes its server holds, or the ranks' models part for good."""
    def body(w: Worker):
        if w.rank == 1:
            w.size = 1                  # its view of the job, before the rejoin reaches it
        return w.push_pull(np.arange(10, dtype="float32") * 2 + 2 * w.rank, name="g")

    for result in job(2, 1, body):              # mean of 2x, 2x + 2 is 2x + 1
        assert_same(result, (np.arange(10) * 2 + 1).astype("float32"))


def test_average_with_one_worker_is_the_input(job):
    data = np.linspace(-1, 1, 101)

    def body(w: Worker):
        return w.push_pull(data, name="g")

    assert_same(job(1, 2, body)[0], data)


@pytest.mark.parametrize("count,partition_bytes", [(10_001, 64), (1024 * 1024, 256 * 1024)])
def test_out_may_be_the_input_itself(job, count, partition_bytes):
    def body(w: Worker):
        data = (np.arange(count) % 100 + w.rank).astype(np.float32)
        result = w.push_pull(data, name="inplace", average=False, out=data)
        return result is data, data

    for same_object, data in job(2, 2, body, partition_bytes=partition_bytes):
        assert same_object
        assert_same(data, (2 * (np.arange(count) % 100) + 1).astype(np.float32))


def test_out_receives_the_result_and_a_wrong_out_is_refused(job):
    def body(w: Worker):
        out = np.full(6, -1.0)
        with pytest.raises(ValueError, match=r"out must be a C-contiguous float64 array of "
                                             r"shape \(6,\), got float32 \(6,\)"):
            w.push_pull(np.ones(6), name="o", out=np.empty(6, np.float32))
        result = w.push_pull(np.ones(6) * (w.rank + 1), name="o", average=False, out=out)
        return result is out, out

    for same_object, out in job(2, 1, body):
        assert same_object
        assert_same(out, np.full(6, 3.0))


def test_a_read_only_out_is_refused_and_a_read_only_input_is_fine(job):
    def body(w: Worker):
        read_only = np.frombuffer(np.full(3, w.rank + 1.0).tobytes(), dtype=np.float64)
        with pytest.raises(ValueError, match=r"out must be writable, got a read-only array "
                                             r"for 'r'"):
            w.push_pull(read_only, name="r", average=False, out=read_only)
        # the refusal broke nothing: the input itself may be read-only
        return w.push_pull(read_only, name="r", average=False)

    for result in job(2, 1, body):
        assert_same(result, np.full(3, 3.0))


# --------------------------------------------------------------------------- workers x servers

@pytest.mark.parametrize("servers", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_every_worker_and_server_count(job, workers, servers):
    def body(w: Worker):
        grad = w.push_pull_async(ranked(w.rank, 250, np.float32), name="grad", average=False)
        scalar = w.push_pull_async(np.float64(w.rank + 1), name="loss")   # averaged
        return w.rank, w.size, w.synchronize(grad), w.synchronize(scalar)

    # 1000 bytes in pieces of 64: every server holds some of "grad"
    results = job(workers, servers, body, partition_bytes=64)
    assert [(rank, size) for rank, size, _, _ in results] == [(r, workers) for r in range(workers)]
    for _, _, grad, scalar in results:
        assert_same(grad, expected_sum(workers, 250, np.float32))
        assert_same(scalar, np.asarray((workers + 1) / 2))


def io_threads_cpu() -> dict[int, tuple[str, float]]:
    """This process's ZeroMQ I/O threads now: thread id -> (name, seconds on a CPU so far, to
    the nanosecond: /proc's schedstat)."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
            ran = Path(f"/proc/self/task/{task}/schedstat").read_text().split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue                # it ended while being read
        if name.startswith("ZMQbg/IO/"):
            found[int(task)] = (name, int(ran) / 1e9)
    return found


def test_a_workers_connections_to_two_servers_run_on_its_two_io_threads(job):
    """BPSCTL_IO_THREADS=2, TCP to two servers: each of the worker's two ZeroMQ I/O threads
    carries one connection, so both do a share of the sending and receiving (left to ZeroMQ,
    both connections could land on one thread, the other idle) and the sums stay exact."""
    before = set(io_threads_cpu())
    tensor = ranked(0, 2 << 20, np.float32)         # 8 MiB: half to each server

    def body(w: Worker):
        assert w._ctx.get(zmq.IO_THREADS) == 2
        mine = {tid for tid in io_threads_cpu() if tid not in before}
        assert len(mine) == 2, f"expected the worker's two ZeroMQ I/O threads, found {mine}"
        got = w.push_pull(tensor, name="grad", average=False)      # connections settle
        start = io_threads_cpu()
        for _ in range(6):
            got = w.push_pull(tensor, name="grad", average=False)
        end = io_threads_cpu()
        return got, {end[tid][0]: end[tid][1] - start[tid][1] for tid in mine}

    for got, cpu in job(1, 2, body, io_threads=2, shm_server="0", force_distributed=True):
        assert_same(got, tensor)
        total = sum(cpu.values())
        assert total > 0, f"no CPU time on the I/O threads: {cpu}"
        assert min(cpu.values()) >= 0.2 * total, f"one I/O thread did most of the work: {cpu}"


def test_auto_io_threads_are_one_per_8_cores_from_1_to_4():
    assert [auto_io_threads(cores) for cores in (1, 2, 7, 8, 16, 24, 32, 96)] == \
        [1, 1, 1, 1, 2, 3, 4, 4]
    assert Config.from_env({"BPSCTL_IO_THREADS": "3"}).zmq_io_threads == 3
    # a worker's connections to its servers, in turn on each I/O thread (ZMQ_AFFINITY bits)
    assert [io_thread_affinity(index, 2) for index in range(5)] == [1, 2, 1, 2, 1]
    assert [io_thread_affinity(index, 1) for index in range(3)] == [1, 1, 1]


def test_workers_may_start_their_tensors_in_different_orders(job):
    names = [f"layer{i}" for i in range(8)]

    def body(w: Worker):
        order = names if w.rank % 2 == 0 else names[::-1]
        handles = {name: w.push_pull_async(np.full(1000, names.index(name) + w.rank, np.int64),
                                           name=name, average=False) for name in order}
        return {name: w.synchronize(h) for name, h in handles.items()}

    # with credit for one partition only, a worker cannot push far ahead of the others
    for results in job(3, 3, body, partition_bytes=800, credit_bytes=800):
        for i, name in enumerate(names):
            assert_same(results[name], np.full(1000, 3 * i + 3, np.int64))


# --------------------------------------------------------------------------- priority

def test_a_late_high_priority_tensor_overtakes_queued_low_priority_ones(job, engine_cluster):
    """With credit for one partition, a tensor submitted after 200 others goes next.

    The job's only server is stopped (SIGSTOP) while the tensors are submitted, so exactly one
    low-priority partition is in flight and everything else is queued when it resumes; the
    order in which handles complete is then the engine's priority order.
    """
    server_pid = next(p.pid for p in engine_cluster.processes if p.role == "server" and p.rank == 0)
    part_bytes = 64 * 1024
    lows = [np.full(part_bytes // 4, i, np.float32) for i in range(200)]
    high = np.full(part_bytes // 4, -1, np.float32)

    def body(w: Worker):
        # one round first, so every name is declared and nothing waits for the scheduler
        warm = [w.push_pull_async(x, name=f"low{i}", average=False) for i, x in enumerate(lows)]
        warm.append(w.push_pull_async(high, name="high", average=False))
        for handle in warm:
            w.synchronize(handle)

        os.kill(server_pid, signal.SIGSTOP)
        try:
            handles = {f"low{i}": w.push_pull_async(x, name=f"low{i}", average=False, priority=0)
                       for i, x in enumerate(lows)}
            handles["high"] = w.push_pull_async(high, name="high", average=False, priority=10)
            time.sleep(0.5)                  # the I/O thread queues them all meanwhile
            assert not any(h.done() for h in handles.values())
        finally:
            os.kill(server_pid, signal.SIGCONT)

        done_at: dict[str, int] = {}         # name -> sweep in which it was first seen done
        sweep, deadline = 0, time.monotonic() + 20
        while len(done_at) < len(handles) and time.monotonic() < deadline:
            sweep += 1
            for name, handle in handles.items():
                if name not in done_at and handle.done():
                    done_at[name] = sweep
            time.sleep(0)
        for name, handle in handles.items():
            assert_same(w.synchronize(handle), high if name == "high" else lows[int(name[3:])])
        return sum(1 for name, at in done_at.items() if name != "high" and at < done_at["high"])

    # one worker, sent through its server all the same (BPSCTL_FORCE_DISTRIBUTED)
    lows_before_high, = job(1, 1, body, partition_bytes=part_bytes, credit_bytes=part_bytes,
                            force_distributed=True)
    # only the partition already in flight when the server stopped may finish first
    assert lows_before_high <= 2, f"{lows_before_high} of 200 low-priority tensors finished first"


# --------------------------------------------------------------------------- misuse of names

def test_a_name_already_in_flight_is_refused(job):
    first_submitted = threading.Event()

    def body(w: Worker):
        if w.rank == 0:
            handle = w.push_pull_async(np.ones(5), name="dup", average=False)
            try:
                # rank 1 has not pushed yet, so "dup" cannot have completed
                with pytest.raises(ValueError, match=r"a push_pull of 'dup' is already in flight"):
                    w.push_pull_async(np.ones(5), name="dup", average=False)
            finally:
                first_submitted.set()
            first = w.synchronize(handle)
        else:
            assert first_submitted.wait(20)
            first = w.push_pull(np.ones(5) * 2, name="dup", average=False)
        # once synchronized, the name can be used again
        return first, w.push_pull(np.ones(5), name="dup", average=False)

    for first, second in job(2, 1, body):
        assert_same(first, np.full(5, 3.0))
        assert_same(second, np.full(5, 2.0))


def test_reusing_a_name_with_another_dtype_or_shape_is_refused(job):
    def body(w: Worker):
        first = w.push_pull(np.ones(4, np.float32), name="y", average=False)
        with pytest.raises(ValueError, match=r"tensor 'y' was declared as float32\(4,\) but "
                                             r"push_pull got float64\(4,\)"):
            w.push_pull(np.ones(4, np.float64), name="y", average=False)
        with pytest.raises(ValueError, match=r"float32\(4,\) but push_pull got float32\(2, 2\)"):
            w.push_pull(np.ones((2, 2), np.float32), name="y", average=False)
        return first, w.push_pull(np.full(4, 3, np.float32), name="y", average=False)

    for first, again in job(2, 2, body):
        assert_same(first, np.full(4, 2, np.float32))
        assert_same(again, np.full(4, 6, np.float32))


def test_push_pull_must_match_the_declared_shape(job):
    def body(w: Worker):
        w.declare("d", (3,), np.float32)
        with pytest.raises(ValueError, match=r"tensor 'd' was declared as float32\(3,\) but "
                                             r"push_pull got float32\(4,\)"):
            w.push_pull(np.ones(4, np.float32), name="d", average=False)
        return w.push_pull(np.ones(3, np.float32), name="d", average=False)

    for result in job(2, 1, body):
        assert_same(result, np.full(3, 2, np.float32))


# --------------------------------------------------------------------------- barrier, shutdown

def test_barrier_waits_for_every_worker(job):
    def body(w: Worker):
        if w.rank == 2:
            time.sleep(0.5)
        started = time.monotonic()
        w.barrier()
        return time.monotonic() - started

    waited = job(3, 1, body)
    assert waited[0] >= 0.4 and waited[1] >= 0.4


def test_after_shutdown_push_pull_says_so(job):
    def body(w: Worker):
        w.shutdown()
        w.shutdown()                                   # twice is fine
        with pytest.raises(EngineError, match="shut down"):
            w.push_pull(np.ones(2), name="late")

    job(1, 1, body)


# --------------------------------------------------------------------------- PUSH_ZERO, roots

def rows_of(rank: int, count: int, cols: int, dtype: str, step: int) -> np.ndarray:
    """Rank ``rank``'s rows of a gather at ``step``: small integers (exact in every dtype;
    bfloat16 as a float32's upper half), never zero."""
    base = (np.arange(count * cols) % 11 + rank + step + 1).reshape(count, cols)
    if dtype == "bfloat16":
        return (base.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return base.astype(dtype)


def pushed(w: Worker) -> int:
    return sum(s["pushed_bytes"] for s in w.stats()["servers"])


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "float16", "bfloat16"])
def test_a_gather_pushes_only_each_ranks_partitions_and_is_exact(job, dtype):
    """Each rank's rows at its offset in a zeroed buffer (uneven: 1, 5 and 0 rows), ``mine``
    naming its bytes: the partitions without them go as PUSH_ZERO (rank 2 pushes headers
    only), every rank gets the concatenation, twice (the second round rewrites the sum
    buffers), and what each rank pushed is the bytes of the partitions holding its rows."""
    rows, cols, size = [1, 5, 0], 3, 32      # 32-byte partitions: rows straddle them
    starts = [sum(rows[:r]) for r in range(3)]

    def body(w: Worker):
        out = []
        for step in range(2):
            mine = rows_of(w.rank, rows[w.rank], cols, dtype, step)
            buffer = np.zeros((sum(rows), cols), mine.dtype)
            buffer[starts[w.rank]:starts[w.rank] + rows[w.rank]] = mine
            per_row = cols * mine.itemsize
            wire = buffer.view(P.BFLOAT16) if dtype == "bfloat16" else buffer
            before = pushed(w)
            got = w.push_pull(wire, name="rows", average=False,
                              mine=(starts[w.rank] * per_row,
                                    (starts[w.rank] + rows[w.rank]) * per_row))
            out.append((got.view(mine.dtype).copy(), pushed(w) - before))
        return out

    results = job(3, 2, body, partition_bytes=size)
    for step in range(2):
        want = np.concatenate([rows_of(r, rows[r], cols, dtype, step) for r in range(3)])
        nbytes = want.nbytes
        per_row = cols * want.itemsize
        for rank, per_step in enumerate(results):
            got, moved = per_step[step]
            assert_same(got, want)
            a, b = starts[rank] * per_row, (starts[rank] + rows[rank]) * per_row
            touched = 0 if a == b else min(-(-b // size) * size, nbytes) - a // size * size
            assert moved == touched, (rank, step, moved, touched)


def test_rounds_of_all_zeros_answer_zeros_also_after_rounds_with_data(job):
    """A partition whose every push is a PUSH_ZERO, as its first round (the server learns its
    size from the header) and after a round with data in the same sum buffers; on 1
    worker too (a PUSH_ZERO alone is the whole round)."""
    def body(w: Worker):
        x = np.full(100, 7.0, np.float64)
        first = w.push_pull(np.zeros(100), name="z", average=False, mine=(0, 0)).copy()
        data = w.push_pull(x, name="z", average=False).copy()
        again = [w.push_pull(x, name="z", average=False, mine=(800, 800)).copy()
                 for _ in range(3)]            # (x is not read: it is promised zero)
        return first, data, again

    for workers in (1, 2):
        for first, data, again in job(workers, 2, body, partition_bytes=256,
                                      force_distributed=True):
            assert_same(first, np.zeros(100))
            assert_same(data, np.full(100, 7.0 * workers))
            for zeros in again:
                assert_same(zeros, np.zeros(100))


def test_zero_and_data_pushes_of_large_partitions_are_summed_on_the_threads(job):
    """Partitions of 512 KiB (summed on the servers' summation threads): zero and data pushes
    of one partition, in whatever order they come, and a partition of two ranks' data."""
    count = 3 * 64 * 1024          # float32: 768 KiB per rank, 2.25 MiB in all

    def body(w: Worker):
        results = []
        for step in range(2):
            buffer = np.zeros(3 * count, np.float32)
            mine = slice(w.rank * count, (w.rank + 1) * count)
            buffer[mine] = np.arange(count, dtype=np.float32) % 251 + w.rank + step
            results.append(w.push_pull(buffer, name="big", average=False,
                                       mine=(mine.start * 4, mine.stop * 4)).copy())
        return results

    for per_step in job(3, 2, body, partition_bytes=512 * 1024):
        for step, got in enumerate(per_step):
            want = np.concatenate([np.arange(count, dtype=np.float32) % 251 + r + step
                                   for r in range(3)])
            assert_same(got, want)


def test_mine_and_root_are_refused_where_they_cannot_apply(job):
    def body(w: Worker):
        x = np.ones(8, np.float32)
        for kwargs, words in [
                ({"mine": (0, 33)}, r"mine=\(0, 33\) is not a byte range within the array's 32"),
                ({"mine": "ab"}, r"mine must be \(start, stop\)"),
                ({"mine": (0, 4), "compression": C.FP16()}, r"with mine= cannot be compressed"),
                ({"mine": (0, 4), "reduction": P.REDUCE_MAX}, r"cannot be reduced by max"),
                ({"mine": (0, 4), "host_reduced": True}, r"cannot be host-reduced"),
                ({"root": 0, "average": True}, r"by broadcast cannot be averaged"),
                ({"root": -1}, r"root -1 is not a rank"),
                ({"root": 0, "mine": (0, 4)}, r"root= goes with neither mine= nor"),
                ({"reduction": P.REDUCE_BROADCAST}, r"pass root=RANK")]:
            with pytest.raises(ValueError, match=words):
                w.push_pull_async(x, name="x", **{"average": False, **kwargs})
        # nothing was left behind: the name sums as usual
        return w.push_pull(x, name="x", average=False)

    for result in job(2, 1, body):
        assert_same(result, np.full(8, 2, np.float32))


def test_a_broadcast_pushes_only_the_roots_bytes(job):
    def body(w: Worker):
        x = np.arange(1000, dtype=np.float32) * (w.rank + 1)
        before = pushed(w)
        got = w.push_pull(x, name="w", average=False, root=1)
        return got, pushed(w) - before

    results = job(3, 2, body, partition_bytes=512)
    for rank, (got, moved) in enumerate(results):
        assert_same(got, np.arange(1000, dtype=np.float32) * 2)
        assert moved == (4000 if rank == 1 else 0), (rank, moved)


@pytest.mark.parametrize("roots", [[0, 0, 1], [0, 1], [2, 2, 0]])
def test_ranks_naming_different_roots_of_a_broadcast_all_fail_naming_them(job, roots):
    """[0, 0, 1]: one rank pushes data, as a good broadcast; [0, 1]: every rank pushes data;
    [2, 2, 0]: nobody does. Every rank fails within seconds (not the op timeout) with the
    tensor's name and what each rank said; the name is usable again at once."""
    said = {0: "ranks 0 and 1 say 0, rank 2 says 1", 1: "rank 0 says 0, rank 1 says 1",
            2: "ranks 0 and 1 say 2, rank 2 says 0"}[[[0, 0, 1], [0, 1], [2, 2, 0]].index(roots)]

    def body(w: Worker):
        x = np.full(300, w.rank + 1.0, np.float32)
        started = time.monotonic()
        with pytest.raises(EngineError, match=rf"^worker {w.rank}: broadcast 'w': server \d+, "
                                              r"partition \d+: ranks disagree on the root of "
                                              rf"this broadcast: {said}$"):
            w.push_pull(x, name="w", average=False, root=roots[w.rank])
        took = time.monotonic() - started
        return took, w.push_pull(x, name="w", average=False, root=0)

    for took, again in job(len(roots), 2, body, partition_bytes=256, op_timeout_s=30.0):
        assert took < 5, took
        assert_same(again, np.full(300, 1.0, np.float32))


def test_a_broadcast_whose_root_pushed_nothing_fails_naming_it(job):
    def body(w: Worker):
        with pytest.raises(EngineError, match=r"every rank names rank 5 the root of this "
                                              r"broadcast, but it pushed no data"):
            w.push_pull(np.ones(4, np.float32), name="w", average=False, root=5)
        return True

    assert job(2, 1, body) == [True, True]


def _hello(ctx: zmq.Context, address: str, secret: str, job_id: str, rank: int = 0,
           world_size: int = 1) -> zmq.Socket:
    """A worker's connection to a server, spoken by hand: the hmac handshake, then HELLO of
    rank ``rank`` of a job of ``world_size`` workers (one by default)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    ours = secrets.token_bytes(16)
    sock.send_multipart(P.control(P.AUTH, {"version": bpsctl.__version__, "nonce": ours.hex()}))
    assert sock.poll(5000), "no CHALLENGE within 5 s"
    theirs = bytes.fromhex(json.loads(sock.recv_multipart()[1])["nonce"])
    sock.send_multipart(P.control(P.PROOF, {"proof": Security("hmac", secret)._proof(
        b"connecting", theirs, ours)}))
    sock.send_multipart(P.control(P.HELLO, {"job": job_id, "rank": rank,
                                            "world_size": world_size,
                                            "version": bpsctl.__version__}))
    return sock


def test_a_worker_whose_connection_came_back_is_counted_once_and_answered_again(
        engine_cluster):
    """Rank 0 of a 2-worker job says HELLO again on a new connection (its old one dropped:
    a cut link or a pause) and pushes again what was not answered: a round the server had
    counted from it is counted once, a round completed before its sum arrived is answered
    again with that sum, and what still comes on the old connection is ignored."""
    server = next(p for p in engine_cluster.processes if p.role == "server")
    address = f"{server.host}:{server.port}"
    job_id = f"test-back-{os.getpid()}-{time.monotonic_ns()}"
    code = P.DTYPE_CODES[np.dtype(np.float32)]
    ctx = zmq.Context()

    def hello(rank: int) -> zmq.Socket:
        return _hello(ctx, address, engine_cluster.secret, job_id, rank, 2)

    def push(sock: zmq.Socket, round_: int, value: float) -> None:
        sock.send_multipart([P.pack_header(P.PUSH, dtype=code, rank=0, part=7, round=round_,
                                           nbytes=40), np.full(10, value, np.float32).tobytes()])

    def answers(sock: zmq.Socket, kinds: int) -> list[tuple[int, int, np.ndarray | None]]:
        """The next ``kinds`` messages: (type, round, sum)."""
        got = []
        for _ in range(kinds):
            assert sock.poll(5000), f"no answer within 5 s (had {got})"
            frames = sock.recv_multipart()
            kind, _, _, _, _, round_, _ = P.unpack_header(frames[0])
            got.append((kind, round_, np.frombuffer(frames[1], np.float32)
                        if kind == P.RESULT else None))
        return got

    try:
        first, other = hello(0), hello(1)
        push(first, 0, 1.0)
        assert answers(first, 1)[0][:2] == (P.ACK, 0)
        again = hello(0)                 # rank 0's connection came back
        push(again, 0, 1.0)              # pushed again: acknowledged, not counted
        assert answers(again, 1)[0][:2] == (P.ACK, 0)
        push(other, 0, 10.0)             # the round's other push completes it
        [(kind, round_, values)] = answers(again, 1)
        assert (kind, round_) == (P.RESULT, 0)
        assert_same(values, np.full(10, 11.0, np.float32))       # 1 + 10, not 1 + 1 + 10
        assert [a[:2] for a in answers(other, 2)] == [(P.ACK, 0), (P.RESULT, 0)]
        assert not first.poll(300), "the old connection was answered"
        # the sum of round 0 is lost on its way: the connection comes back once more, and
        # the round pushed again is answered with that sum, not summed anew
        third = hello(0)
        push(third, 0, 1.0)
        [(kind, round_, values)] = answers(third, 1)
        assert (kind, round_) == (P.RESULT, 0)
        assert_same(values, np.full(10, 11.0, np.float32))
        push(first, 1, 100.0)            # late, on a connection that is gone: ignored
        push(third, 1, 2.0)
        push(other, 1, 20.0)
        assert [a[:2] for a in answers(third, 2)] == [(P.ACK, 1), (P.RESULT, 1)]
        assert_same(answers(other, 2)[1][2], np.full(10, 22.0, np.float32))
    finally:
        ctx.destroy(linger=0)


def _wire_job(ctx: zmq.Context, cluster) -> Callable[[int], zmq.Socket]:
    """For a new 2-worker job on ``cluster``'s first server: a function that says HELLO as
    rank ``rank`` on a new connection (a worker's, or one that came back), spoken by hand."""
    server = next(p for p in cluster.processes if p.role == "server")
    job_id = f"test-wire-{os.getpid()}-{time.monotonic_ns()}"
    return lambda rank: _hello(ctx, f"{server.host}:{server.port}", cluster.secret, job_id,
                               rank, 2)


def _push_ten(sock: zmq.Socket, round_: int, value: float, *, part: int,
              kind: int = P.PUSH, rank: int = 0) -> None:
    """A message of ``kind`` (PUSH, LAST_SUM) carrying ten float32s of ``value``."""
    sock.send_multipart([P.pack_header(kind, dtype=P.DTYPE_CODES[np.dtype(np.float32)],
                                       rank=rank, part=part, round=round_, nbytes=40),
                         np.full(10, value, np.float32).tobytes()])


def _answers(sock: zmq.Socket, kinds: int) -> list[tuple[int, int, int, float | None]]:
    """The next ``kinds`` messages from a server: (type, round, count, the sum's first
    value)."""
    got: list[tuple[int, int, int, float | None]] = []
    for _ in range(kinds):
        assert sock.poll(5000), f"no answer within 5 s (had {got})"
        frames = sock.recv_multipart()
        kind, _, _, count, _, round_, _ = P.unpack_header(frames[0])
        got.append((kind, round_, count, float(np.frombuffer(frames[1], np.float32)[0])
                    if kind == P.RESULT else None))
    return got


def test_a_push_again_that_crossed_its_rounds_sum_is_not_answered_twice(engine_cluster):
    """Rank 0's connection comes back while its round waits for rank 1; rank 1's push then
    completes the round, whose sum goes out on the new connection, and only after that does
    a push again of rank 0's (sent before the sum reached it) arrive. Answered again, that
    sum would be taken for the next round's: a paused server's host, resumed, gives this
    order."""
    ctx = zmq.Context()
    hello, push, answers = _wire_job(ctx, engine_cluster), partial(_push_ten, part=3), _answers
    try:
        first, other = hello(0), hello(1)
        push(first, 0, 1.0)
        assert answers(first, 1) == [(P.ACK, 0, 0, None)]
        again = hello(0)
        push(again, 0, 1.0)              # pushed again: acknowledged (its HELLO came first)
        assert answers(again, 1) == [(P.ACK, 0, 0, None)]
        push(other, 0, 10.0)             # completes round 0: its sum goes to `again`
        assert answers(other, 2) == [(P.ACK, 0, 0, None), (P.RESULT, 0, 2, 11.0)]
        assert answers(again, 1) == [(P.RESULT, 0, 2, 11.0)]
        push(again, 0, 1.0)              # pushed again once more, crossing that sum
        push(again, 1, 2.0)              # rank 0's next round, as it goes on
        push(other, 1, 20.0)
        # round 1's ACK and sum come next: no second answer to round 0 before them
        assert answers(again, 2) == [(P.ACK, 1, 0, None), (P.RESULT, 1, 2, 22.0)]
        assert answers(other, 2) == [(P.ACK, 1, 0, None), (P.RESULT, 1, 2, 22.0)]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("sum_first", [False, True])
def test_a_lost_servers_last_sum_reaches_the_worker_it_missed_through_the_new_server(
        engine_cluster, sum_first):
    """A partition moved here from a lost server whose last sum, of round 5, reached rank 0
    but not rank 1: rank 0 hands that sum over (LAST_SUM) and pushes round 6, rank 1 pushes
    round 5 again. Rank 1 is answered with the lost server's sum, then round 6 is summed from
    both, whichever of the two came first; before, the job failed here."""
    ctx = zmq.Context()
    hello, push, answers = _wire_job(ctx, engine_cluster), partial(_push_ten, part=9), _answers
    try:
        ahead, behind = hello(0), hello(1)
        if not sum_first:
            push(behind, 5, 1.0)             # rank 1 lacks round 5's sum: pushed again here
            assert answers(behind, 1) == [(P.ACK, 5, 0, None)]
        push(ahead, 5, 7.0, kind=P.LAST_SUM, rank=2)     # a sum of two pushes
        push(ahead, 6, 2.0)
        if sum_first:
            assert answers(ahead, 1) == [(P.ACK, 6, 0, None)]    # the push after the sum
            push(behind, 5, 1.0)
        assert answers(behind, 1) == [(P.RESULT, 5, 2, 7.0)]    # the lost server's sum
        push(behind, 6, 3.0)
        assert answers(behind, 2) == [(P.ACK, 6, 0, None), (P.RESULT, 6, 2, 5.0)]
        assert answers(ahead, 1 if sum_first else 2)[-1] == (P.RESULT, 6, 2, 5.0)
    finally:
        ctx.destroy(linger=0)


def test_a_push_zero_on_the_wire_is_answered_with_zeros_and_refused_where_it_cannot_apply(
        engine_cluster):
    """PUSH_ZERO by hand: ACK and a RESULT of zeros of the header's size, counting one push;
    a payload, a compressed or host-reduced flag and a min reduction are refused with an
    ERROR naming PUSH_ZERO."""
    server = next(p for p in engine_cluster.processes if p.role == "server")
    ctx = zmq.Context()
    try:
        sock = _hello(ctx, f"{server.host}:{server.port}", engine_cluster.secret,
                      f"test-zero-{os.getpid()}-{time.monotonic_ns()}")

        def answer() -> list[bytes]:
            assert sock.poll(5000), "the server did not answer within 5 s"
            return sock.recv_multipart()

        for round_ in range(2):
            sock.send(P.pack_header(P.PUSH_ZERO, dtype=P.DTYPE_CODES[np.dtype(np.float32)],
                                    part=0, round=round_, nbytes=40))
            assert P.unpack_header(answer()[0])[0] == P.ACK
            header, body = answer()
            kind, _, flags, count, part, got_round, nbytes = P.unpack_header(header)
            assert (kind, count, part, got_round, nbytes) == (P.RESULT, 1, 0, round_, 40)
            assert_same(np.frombuffer(body, np.float32), np.zeros(10, np.float32))
        code = P.DTYPE_CODES[np.dtype(np.float32)]
        for frames, words in [
                ([P.pack_header(P.PUSH_ZERO, dtype=code, part=1, nbytes=4), b"\0" * 4],
                 "PUSH_ZERO of partition 1 carries 1 frames after its header"),
                ([P.pack_header(P.PUSH_ZERO, dtype=code, part=1, nbytes=4,
                                flags=P.FLAG_COMPRESSED)], "a zero push is never compressed"),
                ([P.pack_header(P.PUSH_ZERO, dtype=code, part=1, nbytes=4,
                                flags=P.FLAG_HOST_REDUCED)], "host-reduced"),
                ([P.pack_header(P.PUSH_ZERO, dtype=P.push_dtype(code, P.REDUCE_MIN), part=1,
                                nbytes=4)], "PUSH_ZERO of partition 1 reduced by min")]:
            sock.send_multipart(frames)
            reply = answer()
            assert P.unpack_header(reply[0])[0] == P.ERROR, reply
            assert words in json.loads(reply[1])["message"], reply[1]
    finally:
        ctx.destroy(linger=0)


def test_a_sum_read_in_part_pulls_only_the_partitions_read_and_rounds_stay_in_step(job):
    """``want``: the byte ranges of the output a worker reads (an alltoall's rows sent to it).
    Partitions wholly outside them come back as a RESULT header alone: their bytes of ``out``
    stay as they were, the worker pulls only the partitions it reads, and the name's rounds
    stay in step (three rounds, each rank reading another part)."""
    size, count = 32, 40                         # 160 bytes of float32: 5 partitions

    def body(w: Worker):
        out = []
        for step in range(3):
            part = (w.rank + step) % 5
            want = [(part * size, part * size + 8)]         # inside one partition
            if w.rank == 0:
                want.append((4 * size + 4, 4 * size + 12))  # and a piece of the last
            x = np.full(count, w.rank + 1 + step, np.float32)
            got = np.full(count, -1.0, np.float32)
            before = sum(s["pulled_bytes"] for s in w.stats()["servers"])
            w.push_pull(x, name="partly", average=False, out=got, want=want)
            pulled = sum(s["pulled_bytes"] for s in w.stats()["servers"]) - before
            out.append((got.copy(), sorted({a // size for a, _ in want}), pulled))
        return out

    results = job(3, 2, body, partition_bytes=size)
    for rank, steps in enumerate(results):
        for step, (got, read, pulled) in enumerate(steps):
            total = sum(r + 1 + step for r in range(3))
            per = size // 4
            for p in range(5):
                block = got[p * per:(p + 1) * per]
                expected = total if p in read else -1.0
                assert (block == expected).all(), (rank, step, p, block)
            assert pulled == len(read) * size, (rank, step, pulled)


def test_want_is_refused_where_it_cannot_apply(job):
    def body(w: Worker):
        x = np.ones(8, np.float32)
        for kwargs, words in [({"want": [(0, 64)]}, "is not a byte range"),
                              ({"want": [(0, 4)], "root": 0}, "plain sum"),
                              ({"want": [(0, 4)], "reduction": P.REDUCE_MAX,
                                "average": False}, "plain sum")]:
            with pytest.raises(ValueError, match=words):
                w.push_pull(x, name="w", **{"average": False, **kwargs})
        return True

    assert job(1, 1, body) == [True]


def _registered_again(cluster, job_id: str) -> dict:
    """What the scheduler answers a worker of job ``job_id`` (rank 0 of 1) that registers
    again, as one cut off from it does once the link is back; spoken by hand."""
    scheduler = next(p for p in cluster.processes if p.role == "scheduler")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{scheduler.host}:{scheduler.port}")
        ours = secrets.token_bytes(16)
        sock.send_multipart(P.control(P.AUTH, {"version": bpsctl.__version__,
                                               "nonce": ours.hex()}))
        assert sock.poll(5000), "no CHALLENGE within 5 s"
        theirs = bytes.fromhex(json.loads(sock.recv_multipart()[1])["nonce"])
        sock.send_multipart(P.control(P.PROOF, {"proof": Security(
            "hmac", cluster.secret)._proof(b"connecting", theirs, ours)}))
        sock.send_multipart(P.control(P.REGISTER, {
            "role": "worker", "version": bpsctl.__version__, "host": "127.0.0.1",
            "pid": os.getpid(), "job": job_id, "world_size": 1, "rank": 0,
            "partition_bytes": 4096, "start_timeout_s": 10.0,
            "reregister": {"incarnation": 0, "servers": [
                {"rank": 0, "host": "127.0.0.1", "port": 1}]}}))
        while True:
            assert sock.poll(5000), "the scheduler did not answer within 5 s"
            kind, body = P.parse_control(sock.recv_multipart())
            if kind != P.CLOCK:
                assert kind == P.ERROR, (kind, body)
                return body
    finally:
        ctx.destroy(linger=0)


def test_a_worker_that_registers_again_for_a_job_that_ended_is_told_so(job, engine_cluster):
    """A worker cut off from the scheduler while its job ended (here: finished without it)
    registers again once the link is back: the scheduler, which was not restarted, answers
    that the job ended, instead of rebuilding the job from what that worker says."""
    [job_id] = {*job(1, 1, lambda w: w.config.job_id)}
    assert _registered_again(engine_cluster, job_id)["message"] == (
        f"job {job_id!r} ended (finished) while this worker could not reach the scheduler")


def test_a_worker_that_dies_of_an_uncaught_error_leaves_its_job_failed(engine_cluster):
    """A script that dies of an uncaught exception (as of a push_pull's timeout, which leaves
    the engine working) leaves its job saying so: its last worker gone that way, the job
    ended as failed, not finished (a worker restarted meanwhile must not exit 0)."""
    job_id = f"test-died-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "BPSCTL_SCHEDULER": engine_cluster.scheduler,
           "BPSCTL_SECRET": engine_cluster.secret, "BPSCTL_JOB_ID": job_id,
           "BPSCTL_WORLD_SIZE": "1", "BPSCTL_RANK": "0", "BPSCTL_NUM_SERVERS": "1"}
    done = subprocess.run([sys.executable, "-c", "import bpsctl.engine as bps\nbps.init()\n"
                           "raise ValueError('the data ran out')"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ValueError: the data ran out" in done.stderr, done.stderr
    assert _registered_again(engine_cluster, job_id)["message"] == (
        f"job {job_id!r} ended (its workers failed: ValueError: the data ran out) while "
        "this worker could not reach the scheduler")
