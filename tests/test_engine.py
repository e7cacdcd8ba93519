"""The engine's results: exact sums and averages across workers, servers, dtypes and shapes.

Workers are threads (see conftest.run_job) against one real cluster of four server processes;
each job uses the first ``servers`` of them.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from bpsctl.config import Config, auto_io_threads
from bpsctl.engine import EngineError, Worker
from bpsctl.engine import compression as C
from bpsctl.engine import protocol as P
from bpsctl.engine.common import io_thread_affinity

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
