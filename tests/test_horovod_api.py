"""Horovod's collective API in bpsctl.engine.torch (``import bpsctl.engine.torch as hvd``).

One worker script runs every check on real workers (``run_local``: ``bpsctl run -np N`` on a
private cluster), at 1, 2 and 3 ranks; each rank computes what every check should give from
every rank's inputs (a function of the rank) on its own, and records each outcome. The pure
arithmetic of :mod:`bpsctl.engine.collectives` has fast tests of its own below.
"""
from __future__ import annotations

import io
import json
import os
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_plugin import assert_ok, run_script  # noqa: E402

from bpsctl.config import Config  # noqa: E402
from bpsctl.engine import collectives as K  # noqa: E402
from bpsctl.launch.api import down, run_local, up_emulated  # noqa: E402

# --------------------------------------------------------------------------- pure functions


def test_reducescatter_splits_rows_as_horovod_does():
    assert K.reducescatter_counts(7, 3) == [3, 2, 2]
    assert K.reducescatter_counts(6, 3) == [2, 2, 2]
    assert K.reducescatter_counts(2, 3) == [1, 1, 0]
    assert K.reducescatter_counts(0, 2) == [0, 0]
    assert K.offsets([3, 2, 2]) == [0, 3, 5]
    with pytest.raises(ValueError, match="at least one rank"):
        K.reducescatter_counts(4, 0)


def test_ops_resolve_as_horovod_and_adasum_names_the_alternative():
    assert [int(o) for o in K.ReduceOp] == [0, 1, 2, 3, 4, 5]      # Horovod's values
    assert K.resolve_op(None, None) is K.ReduceOp.Average
    assert K.resolve_op(4, None) is K.ReduceOp.Max
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert K.resolve_op(None, False) is K.ReduceOp.Sum
        assert K.resolve_op(None, True) is K.ReduceOp.Average
    assert all(w.category is DeprecationWarning for w in caught) and len(caught) == 2
    with pytest.raises(ValueError, match="supersedes average"):
        K.resolve_op(K.ReduceOp.Sum, True)
    with pytest.raises(ValueError, match="use op=hvd.Average instead"):
        K.resolve_op(K.ReduceOp.Adasum, None)
    with pytest.raises(ValueError, match="op=17 is not a reduction op"):
        K.resolve_op(17, None)
    with pytest.raises(ValueError, match="reducescatter: op=hvd.Max is not supported; use "
                                         "hvd.Average or hvd.Sum"):
        K.check_op(K.ReduceOp.Max, K.SERVER_OPS, "reducescatter")


def test_cross_rank_and_size_follow_horovods_definition_on_uneven_hosts():
    # hosts of 2 and 1 workers: ranks 0, 1 on the first, rank 2 on the second
    assert [K.cross_layout([0, 2], 3, r) for r in range(3)] == [(0, 2), (0, 1), (1, 2)]
    # equal hosts: the host's index and count
    assert [K.cross_layout([0, 2, 4], 6, r) for r in range(6)] == \
        [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3)]


def test_cross_rank_from_the_schedulers_host_map_needs_no_exchange_on_any_rank():
    # hosts of 2 and 1 workers: the rank on the 1-worker host once skipped the exchange that
    # the others waited on; with each rank's host from the scheduler, nobody exchanges
    def no_exchange(array, name):
        raise AssertionError("exchanged")
    hosts = [0, 0, 1]
    assert [K.host_layout(r, 3, [0, 1, 0][r], [2, 2, 1][r], no_exchange, hosts)
            for r in range(3)] == [(0, 2, False), (0, 1, False), (1, 2, False)]
    # agrees with the contiguous case's definition, and takes hosts in any order
    assert [K.layout_of_hosts([0, 0, 1, 1, 2, 2], r)[:2] for r in range(6)] == \
        [K.cross_layout([0, 2, 4], 6, r) for r in range(6)]
    assert [K.layout_of_hosts([0, 1, 0, 1], r) for r in range(4)] == \
        [(0, 2, True), (1, 2, True), (0, 2, True), (1, 2, True)]


def test_engine_failures_of_a_collective_are_horovod_internal_errors():
    from bpsctl.engine.common import EngineError, SchedulerGone
    assert issubclass(K.HorovodInternalError, EngineError)
    assert issubclass(SchedulerGone, K.HorovodInternalError)    # still told apart


def test_alltoall_splits_are_checked_and_planned():
    assert K.even_splits(6, 3) == [2, 2, 2]
    with pytest.raises(ValueError, match="divisible by the number of ranks"):
        K.even_splits(5, 3)
    with pytest.raises(ValueError, match="one per rank"):
        K.check_splits([1, 2], 3, 3)
    with pytest.raises(ValueError, match="add up to 4, but the tensor's first dimension is 5"):
        K.check_splits([1, 3], 5, 2)
    with pytest.raises(ValueError, match="negative"):
        K.check_splits([-1, 6], 5, 2)
    # rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 3 to 0 and 0 to 1
    matrix = np.array([[1, 2], [3, 0]])
    assert K.alltoall_plan(matrix, 0) == ([(0, 1), (3, 3)], [1, 3])
    assert K.alltoall_plan(matrix, 1) == ([(1, 2), (6, 0)], [2, 0])


def test_gather_by_sum_concatenates_exactly_for_every_dtype():
    """The algorithm on 3 simulated ranks (threads) whose sum adds, in the dtype, only the
    bytes each says are its own (``mine``; the rest must be zeros), as the servers sum
    PUSH_ZERO and data pushes; each rank's own bytes are its rows."""
    size = 3
    barrier = threading.Barrier(size)
    pushed: dict[str, dict[int, np.ndarray]] = {}
    owned: dict[tuple[str, int], int] = {}

    def push_pull_sum(array: np.ndarray, name: str, rank: int,
                      mine: tuple[int, int] | None = None) -> np.ndarray:
        raw = array.reshape(-1).view(np.uint8)
        if mine is not None:
            assert not raw[:mine[0]].any() and not raw[mine[1]:].any(), (name, rank, mine)
            owned[(name, rank)] = mine[1] - mine[0]
        pushed.setdefault(name, {})[rank] = array.copy()
        barrier.wait(timeout=10)
        total = sum(pushed[name][r] for r in range(size))
        barrier.wait(timeout=10)
        return total

    for dtype in (np.uint8, np.int64, np.float16, np.float64):
        inputs = [np.full((r + 1, 2), r + 1, dtype) for r in range(size)]
        results: dict[int, np.ndarray] = {}

        def rank_(r: int, dtype=dtype, inputs=inputs, results=results) -> None:
            results[r] = K.gather_by_sum(
                inputs[r], r, size, lambda a, n, mine=None: push_pull_sum(a, n, r, mine),
                f"g.{dtype}")
        threads = [threading.Thread(target=rank_, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        for r in range(size):
            assert results[r].dtype == dtype
            assert np.array_equal(results[r], np.concatenate(inputs)), (dtype, r)
            assert owned[(f"g.{dtype}.rows.6", r)] == inputs[r].nbytes, (dtype, r)


# --------------------------------------------------------------------------- on real workers

HOROVOD_SCRIPT = '''
import warnings
hvd = bps
torch.manual_seed(0)
ME = hvd.rank()
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]

def of(r, shape, dtype, offset=0):
    """Rank r's input: small integers (exact in every dtype), distinct per rank."""
    count = 1
    for d in shape:
        count *= d
    return ((torch.arange(count).reshape(shape) * 3 + 5 * r + offset) % 13).to(dtype)

def everyone(shape, dtype, offset=0):
    return [of(r, shape, dtype, offset) for r in range(N)]

def same(got, want, what=""):
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(got, want), (what, got, want)

@check
def names_and_feature_queries():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.mpi_built() is False and hvd.mpi_enabled() is False
    assert hvd.mpi_threads_supported() is False
    assert hvd.gloo_built() is False and hvd.gloo_enabled() is False
    assert hvd.rocm_built() is False and hvd.ddl_built() is False and hvd.ccl_built() is False
    assert hvd.cuda_built() == torch.backends.cuda.is_built()
    if torch.cuda.is_available():
        assert (hvd.nccl_built() > 0) == torch.distributed.is_nccl_available()
    else:
        assert hvd.nccl_built() == 0
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)   # one host
    assert hvd.is_homogeneous() is True
    assert issubclass(hvd.HorovodInternalError, hvd.EngineError)
    assert hvd.global_process_set.size() == N and hvd.global_process_set.rank() == ME
    assert hvd.global_process_set.ranks == list(range(N))

@check
def allreduce_sum_and_average_every_dtype():
    for dtype in FLOATS + INTS:
        inputs = everyone((3, 5), dtype)
        want = sum(i.double() for i in inputs)
        same(hvd.allreduce(inputs[ME], op=hvd.Sum), want.to(dtype), f"sum {dtype}")
        if dtype.is_floating_point:
            got = hvd.allreduce(inputs[ME], name=f"avg.{dtype}")
            assert torch.allclose(got.double(), want / N, rtol=1e-2), dtype
        else:           # integers: Horovod's floor division of the sum
            same(hvd.allreduce(inputs[ME], op=hvd.Average),
                 torch.div(want, N, rounding_mode="floor").to(dtype), f"avg {dtype}")

@check
def allreduce_min_max_product_every_dtype():
    for dtype in FLOATS + INTS:
        inputs = everyone((4, 3), dtype)
        stacked = torch.stack(inputs)
        same(hvd.allreduce(inputs[ME], op=hvd.Min), stacked.amin(0), f"min {dtype}")
        same(hvd.allreduce(inputs[ME], op=hvd.Max, name=f"max.{dtype}"), stacked.amax(0),
             f"max {dtype}")
        same(hvd.allreduce(inputs[ME], op=hvd.Product), stacked.prod(0, dtype=dtype),
             f"product {dtype}")
    flags = torch.tensor([True, ME == 0, False])
    same(hvd.allreduce(flags, op=hvd.Max), torch.tensor([True, True, False]))
    same(hvd.allreduce(flags, op=hvd.Min), torch.tensor([True, N == 1, False]))

@check
def allreduce_min_max_product_push_one_tensors_bytes():
    # the servers reduce: each rank pushes its own tensor once, not every rank's slot
    worker = hvd._p().worker
    def pushed():
        return sum(s["pushed_bytes"] for s in worker.stats()["servers"])
    x = torch.full((2048,), float(ME), dtype=torch.float32)         # 8 KiB
    before = pushed()
    for op in (hvd.Min, hvd.Max, hvd.Product):
        hvd.allreduce(x, op=op, name=f"bytes.{op.name}")
    moved = pushed() - before
    assert moved == (3 * x.numel() * 4 if N > 1 else 0), (moved, N)

#: rows of 2 MiB: whole partitions (pieces of 1 or 2 MiB), so what a rank pushes is exact
ROW = 2 * 1024 * 1024 // 4

@check
def gathers_broadcasts_and_alltoalls_push_one_ranks_bytes():
    # each rank pushes its own rows (uneven: 1 or 2 rows), not every rank's; a broadcast's
    # root pushes the tensor and the others nothing; values stay exact
    worker = hvd._p().worker
    def pushed():
        return sum(s["pushed_bytes"] for s in worker.stats()["servers"])
    counts = [1 + r % 2 for r in range(N)]
    mine = torch.full((counts[ME], ROW), float(ME + 1))
    before = pushed()
    got = hvd.allgather(mine, name="bytes.gather")
    moved = pushed() - before
    same(got, torch.cat([torch.full((c, ROW), float(r + 1)) for r, c in enumerate(counts)]))
    own = mine.numel() * 4 if N > 1 else 0
    # (and the row counts, one int64 per rank, where they go to the servers)
    assert own <= moved <= own + 8 * N, ("allgather", moved, own)
    before = pushed()
    got = hvd.broadcast(torch.full((ROW,), float(ME)), root_rank=N - 1, name="bytes.bcast")
    moved = pushed() - before
    same(got, torch.full((ROW,), float(N - 1)))
    assert moved == (ROW * 4 if N > 1 and ME == N - 1 else 0), ("broadcast", moved)
    splits = [0] * N
    splits[(ME + 1) % N] = counts[ME]           # every row to the next rank
    before = pushed()
    got, received = hvd.alltoall(mine, splits=splits, name="bytes.a2a")
    moved = pushed() - before
    sender = (ME - 1) % N
    same(got, torch.full((counts[sender], ROW), float(sender + 1)))
    assert own <= moved <= own + 8 * N * N, ("alltoall", moved, own)     # (and the splits)

@check
def broadcast_roots_that_disagree_fail_every_rank_naming_them():
    if N == 1:
        return
    roots = [0] * (N - 1) + [1]         # 2 ranks: 0 and 1; 3 ranks: 0, 0 and 1
    said = "rank 0 says 0, rank 1 says 1" if N == 2 else "ranks 0 and 1 say 0, rank 2 says 1"
    started = time.monotonic()
    try:
        hvd.broadcast(torch.ones(3), root_rank=roots[ME], name="roots")
        raise AssertionError("a broadcast whose ranks named different roots went through")
    except hvd.HorovodInternalError as exc:
        assert "broadcast 'broadcast.roots'" in str(exc) and \
            f"ranks disagree on the root of this broadcast: {said}" in str(exc), str(exc)
    assert time.monotonic() - started < 10
    same(hvd.broadcast(torch.full((3,), float(ME)), root_rank=N - 1, name="roots"),
         torch.full((3,), float(N - 1)))                    # the name goes on

@check
def allreduce_scales_in_place_async_grouped_and_deprecated_average():
    inputs = everyone((6,), torch.float64)
    total = sum(inputs)
    got = hvd.allreduce(inputs[ME], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    same(got, total)
    x = inputs[ME].clone()
    out = hvd.allreduce_(x, op=hvd.Average, prescale_factor=3.0)
    assert out is x
    same(x, total * 3 / N)
    ints = of(ME, (5,), torch.int32).clone()
    hvd.allreduce_(ints, op=hvd.Sum, postscale_factor=2.0)
    same(ints, (sum(everyone((5,), torch.int32)) * 2).to(torch.int32))
    handles = [hvd.allreduce_async(inputs[ME], op=op, name=f"async.{int(op)}")
               for op in (hvd.Sum, hvd.Max)]
    same(hvd.synchronize(handles[0]), total)
    while not hvd.poll(handles[1]):
        time.sleep(0.001)
    same(hvd.synchronize(handles[1]), torch.stack(inputs).amax(0))
    y = inputs[ME].clone()
    h = hvd.allreduce_async_(y, op=hvd.Min)
    assert hvd.synchronize(h) is y
    same(y, torch.stack(inputs).amin(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same(hvd.allreduce(inputs[ME], average=False), total)
    assert any(w.category is DeprecationWarning for w in caught)
    group = [inputs[ME], of(ME, (2, 2), torch.int64)]
    sums = [total, sum(everyone((2, 2), torch.int64))]
    for got, want in zip(hvd.grouped_allreduce(group, op=hvd.Sum), sums):
        same(got, want)
    for got, want in zip(hvd.synchronize(hvd.grouped_allreduce_async(group, op=hvd.Sum,
                                                                     name="g")), sums):
        same(got, want)
    copies = [t.clone() for t in group]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(copies, op=hvd.Sum), copies))
    for got, want in zip(copies, sums):
        same(got, want)
    copies = [t.clone() for t in group]
    hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Max))
    same(copies[1], torch.stack(everyone((2, 2), torch.int64)).amax(0))

@check
def scalars_empty_tensors_and_compression():
    for op in (hvd.Sum, hvd.Max):
        got = hvd.allreduce(torch.tensor(float(ME)), op=op)
        assert got.shape == () and got.item() == (sum(range(N)) if op == hvd.Sum else N - 1)
    same(hvd.broadcast(torch.tensor(ME), root_rank=N - 1), torch.tensor(N - 1))
    same(hvd.allreduce(torch.zeros(0), op=hvd.Sum), torch.zeros(0))
    nothing = torch.zeros((0, 3)) if ME else torch.ones((1, 3))     # rank 0 alone has a row
    same(hvd.allgather(nothing), torch.ones((1, 3)))
    x = torch.linspace(-2, 2, 101, dtype=torch.float32) * (ME + 1)
    exact = sum(torch.linspace(-2, 2, 101) * (r + 1) for r in range(N)) / N
    got = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert got.dtype == torch.float32 and torch.allclose(got, exact, atol=1e-2)
    got = hvd.allreduce(x, op=hvd.Max, compression=hvd.Compression.fp16)
    most = torch.stack([torch.linspace(-2, 2, 101) * (r + 1) for r in range(N)]).amax(0)
    assert got.dtype == torch.float32 and torch.allclose(got, most, atol=1e-2)

@check
def automatic_names_come_back_once_synchronized():
    for _ in range(5):
        hvd.allreduce(torch.ones(7), op=hvd.Sum)
    handles = [hvd.allreduce_async(torch.ones(7), op=hvd.Sum) for _ in range(3)]
    for h in handles:
        same(hvd.synchronize(h), torch.full((7,), float(N)))
    worker = hvd._p().worker
    names = set(worker._tensors) | set(worker._solo_bindings)
    if hvd._p().stage is None:          # (the intra-node stage names nothing in the engine)
        mine = sorted(n for n in names if n.startswith("allreduce.noname.float32:7."))
        assert mine == [f"allreduce.noname.float32:7.{i}" for i in range(3)], mine

@check
def allreduce_refusals_name_the_way_out():
    for call, words in [
            (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum), "use op=hvd.Average instead"),
            (lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)), "bool tensor cannot be"),
            (lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)), "is not carried"),
            (lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, average=True), "supersedes"),
            (lambda: hvd.reducescatter(torch.ones(2), op=hvd.Max), "use hvd.Average or"),
            (lambda: hvd.allgather(torch.tensor(1.0)), "at least one dimension")]:
        try:
            call()
            raise AssertionError(f"accepted: {words}")
        except (ValueError, TypeError) as exc:
            assert words in str(exc), str(exc)

@check
def allreduce_gradients_are_horovods():
    for op, scale in [(hvd.Sum, 1.0), (hvd.Average, 1.0), (hvd.Sum, 0.5)]:
        x = of(ME, (4,), torch.float64).requires_grad_()
        y = hvd.allreduce(x, op=op, prescale_factor=scale)
        (y * torch.arange(1.0, 5.0, dtype=torch.float64)).sum().backward()
        # the gradient of every rank is the same: allreduce of it with the same op and scale
        want = torch.arange(1.0, 5.0, dtype=torch.float64) * scale * (N if op == hvd.Sum else 1)
        same(x.grad, want, f"grad {op}")
    xs = [of(ME, (3,), torch.float64).requires_grad_() for _ in range(2)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    sum(o.sum() for o in outs).backward()
    same(xs[1].grad, torch.full((3,), float(N), dtype=torch.float64))

def rows(r, dtype, cols=3):
    """Rank r's rows of an allgather: r + 1 of them (ranks differ in the first dimension)."""
    return of(r, (r + 1, cols), dtype)

@check
def allgather_uneven_rows_every_dtype_async_grouped():
    for dtype in FLOATS + INTS + [torch.bool]:
        mine = rows(ME, dtype) if dtype != torch.bool else rows(ME, torch.int64) > 5
        want = torch.cat([rows(r, dtype) if dtype != torch.bool else rows(r, torch.int64) > 5
                          for r in range(N)])
        same(hvd.allgather(mine), want, f"allgather {dtype}")
        same(hvd.synchronize(hvd.allgather_async(mine, name=f"ag.{dtype}")), want, dtype)
    group = [rows(ME, torch.float32), of(ME, (2,), torch.int32)]
    got = hvd.grouped_allgather(group, name="gag")
    same(got[0], torch.cat([rows(r, torch.float32) for r in range(N)]))
    same(got[1], torch.cat(everyone((2,), torch.int32)))
    got = hvd.synchronize(hvd.grouped_allgather_async(group))
    same(got[1], torch.cat(everyone((2,), torch.int32)))
    # the same name with another number of rows (a last, smaller batch)
    for count in (4, 2):
        x = torch.full((count, 2), float(ME))
        same(hvd.allgather(x, name="batch"),
             torch.cat([torch.full((count, 2), float(r)) for r in range(N)]))

@check
def allgather_object_and_gradient():
    assert hvd.allgather_object({"rank": ME, "blob": "x" * ME}) == \\
        [{"rank": r, "blob": "x" * r} for r in range(N)]
    x = rows(ME, torch.float64).requires_grad_()
    y = hvd.allgather(x)
    weights = torch.arange(float(y.numel()), dtype=torch.float64).reshape(y.shape)
    (y * weights).sum().backward()
    start = sum(r + 1 for r in range(ME))
    same(x.grad, weights[start:start + ME + 1])       # averaged: the same on every rank

@check
def broadcast_from_every_root_in_place_async_and_gradient():
    for root in range(N):
        for dtype in [torch.float32, torch.bfloat16, torch.int8, torch.uint8]:
            inputs = everyone((2, 3), dtype)
            same(hvd.broadcast(inputs[ME], root), inputs[root], f"broadcast {dtype}")
            x = inputs[ME].clone()
            assert hvd.broadcast_(x, root_rank=root, name=f"b.{dtype}") is x
            same(x, inputs[root])
        flags = torch.tensor([ME == root, True])
        same(hvd.synchronize(hvd.broadcast_async(flags, root)), torch.tensor([True, True]))
        y = of(ME, (4,), torch.float64).t()
        hvd.synchronize(hvd.broadcast_async_(y, root))
        same(y, of(root, (4,), torch.float64))
    x = of(ME, (3,), torch.float64).requires_grad_()
    hvd.broadcast(x, root_rank=N - 1).sum().backward()
    same(x.grad, torch.full((3,), 1.0 if ME == N - 1 else 0.0, dtype=torch.float64))
    try:
        hvd.broadcast(torch.ones(1), root_rank=N)
        raise AssertionError("a bad root was accepted")
    except ValueError as exc:
        assert f"root_rank {N} is not a rank" in str(exc)

def splits_of(r):
    """Rank r sends (r + d) % 3 rows to rank d."""
    return [(r + d) % 3 for d in range(N)]

def sent(r, dtype):
    return of(r, (sum(splits_of(r)), 2), dtype)

@check
def alltoall_with_and_without_splits_and_gradient():
    for dtype in [torch.float32, torch.int64, torch.float16]:
        pieces = [torch.split(sent(r, dtype), splits_of(r)) for r in range(N)]
        want = torch.cat([pieces[s][ME] for s in range(N)])
        got, received = hvd.alltoall(sent(ME, dtype), splits=splits_of(ME))
        same(got, want, f"alltoall {dtype}")
        same(received, torch.tensor([splits_of(s)[ME] for s in range(N)], dtype=torch.int32))
        out, rec = hvd.synchronize(hvd.alltoall_async(sent(ME, dtype),
                                                      torch.tensor(splits_of(ME))))
        same(out, want)
        assert rec.dtype == torch.int64
    even = of(ME, (2 * N, 3), torch.float32)
    got = hvd.alltoall(even)
    assert isinstance(got, torch.Tensor)
    same(got, torch.cat([of(s, (2 * N, 3), torch.float32)[2 * ME:2 * ME + 2]
                         for s in range(N)]))
    x = sent(ME, torch.float64).requires_grad_()
    y, _ = hvd.alltoall(x, splits=splits_of(ME))
    (y * (ME + 1)).sum().backward()
    # the rows x sent to rank d come back with d's weight
    same(x.grad, torch.cat([torch.full((c, 2), float(d + 1), dtype=torch.float64)
                            for d, c in enumerate(splits_of(ME))]))

@check
def reducescatter_uneven_sum_average_grouped_and_gradient():
    n_rows = 2 * N + 1
    counts = [n_rows // N + (1 if r < n_rows % N else 0) for r in range(N)]
    start = sum(counts[:ME])
    for dtype in [torch.float32, torch.float64, torch.int32]:
        inputs = everyone((n_rows, 2), dtype)
        total = sum(i.double() for i in inputs)
        same(hvd.reducescatter(inputs[ME], op=hvd.Sum),
             total[start:start + counts[ME]].to(dtype), f"sum {dtype}")
        if dtype.is_floating_point:
            got = hvd.synchronize(hvd.reducescatter_async(inputs[ME], name=f"rs.{dtype}"))
            assert torch.allclose(got.double(), total[start:start + counts[ME]] / N)
    got = hvd.grouped_reducescatter([everyone((n_rows,), torch.float64)[ME],
                                     everyone((N,), torch.float64)[ME]], op=hvd.Sum)
    same(got[1], sum(everyone((N,), torch.float64))[ME:ME + 1])
    got = hvd.synchronize(hvd.grouped_reducescatter_async([everyone((N, 2), torch.float64)[ME]],
                                                          op=hvd.Sum))
    same(got[0], sum(everyone((N, 2), torch.float64))[ME:ME + 1])
    x = everyone((n_rows,), torch.float64)[ME].requires_grad_()
    hvd.reducescatter(x, op=hvd.Average).sum().backward()
    same(x.grad, torch.ones(n_rows, dtype=torch.float64))      # allgather of the ones

@check
def barrier_join_process_sets_and_internal_errors():
    hvd.barrier()
    assert hvd.join() in range(N)
    assert hvd.remove_process_set(hvd.global_process_set) is False
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=hvd.global_process_set),
         torch.full((2,), float(N)))
    if N > 1:       # (tests/test_process_sets.py has the rest)
        first = hvd.add_process_set([0])
        if ME == 0:
            same(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=first), torch.ones(2))
        assert hvd.remove_process_set(first) is True
        try:
            hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))
            raise AssertionError("a set never added was accepted")
        except ValueError as exc:
            assert "not a registered process set" in str(exc), str(exc)
    hvd.init(list(range(N)), process_sets=[hvd.ProcessSet(range(N))])   # Horovod's forms
    hvd.init(comm=list(range(N)), process_sets="dynamic")
    if N > 1:
        try:
            hvd.init([0])
            raise AssertionError("a communicator of some ranks was accepted")
        except hvd.ProcessSetUnsupported as exc:
            assert "init(comm=[0])" in str(exc), str(exc)
    try:
        hvd.add_process_set(range(N))
        raise AssertionError("a duplicate of the global set was accepted")
    except ValueError as exc:
        assert "duplicate" in str(exc)

@check
def the_numpy_api_gathers_too():
    import numpy as np
    import bpsctl.engine as engine
    got = engine.allgather(np.full((ME + 1, 2), ME, np.int16), name="numpy.gather")
    want = np.concatenate([np.full((r + 1, 2), r, np.int16) for r in range(N)])
    assert got.dtype == np.int16 and np.array_equal(got, want), got

@check
def the_numpy_api_reduces_by_every_op_on_the_servers():
    import numpy as np
    import bpsctl.engine as engine
    mine = (np.arange(12) * (ME + 2) % 5 - 2).astype(np.int32)       # negatives, ranks differ
    everyone = np.stack([(np.arange(12) * (r + 2) % 5 - 2).astype(np.int32) for r in range(N)])
    for op, want in [(engine.ReduceOp.Sum, everyone.sum(0)), (engine.ReduceOp.Min, everyone.min(0)),
                     (engine.ReduceOp.Max, everyone.max(0)),
                     (engine.ReduceOp.Product, everyone.prod(0))]:
        got = engine.allreduce(mine, name=f"numpy.{op.name}", op=op)
        assert got.dtype == np.int32 and np.array_equal(got, want.astype(np.int32)), (op, got)
    avg = engine.allreduce(mine.astype(np.float64), name="numpy.avg")
    assert np.allclose(avg, everyone.mean(0)), avg

@check
def a_timeline_is_written():
    path = os.path.join(sys.argv[1], "timeline.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(1000), name="traced")
    hvd.stop_timeline()
    mine = path if ME == 0 else os.path.join(sys.argv[1], f"timeline.rank{ME}.json")
    with open(mine) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any("traced" in str(n) for n in names), names

@check
def a_failed_collective_raises_horovod_internal_error():
    if hvd._p().stage is not None:
        return          # the intra-node stage fails every later push_pull after a mismatch
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(3 + ME), name="mismatch", op=hvd.Sum)
        assert N == 1, "tensors of other shapes on each rank were summed"
    except hvd.HorovodInternalError as exc:
        assert "disagree" in str(exc), str(exc)
    assert time.monotonic() - started < 10
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(N)))  # goes on

def trained(make_opt, sparse=False, **options):
    """One step of a model of an embedding and a linear layer; the gradients after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 3, sparse=sparse), torch.nn.Flatten(),
                                torch.nn.Linear(6, 1))
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), **options)
    model(torch.tensor([[ME % 6, (ME + 2) % 6]])).sum().mul(ME + 1).backward()
    opt.step()
    return [p.grad for p in model.parameters()]

def local_grads(r):
    """Rank r's own gradients of that model, computed here."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 3), torch.nn.Flatten(),
                                torch.nn.Linear(6, 1))
    model(torch.tensor([[r % 6, (r + 2) % 6]])).sum().mul(r + 1).backward()
    return [p.grad for p in model.parameters()]

@check
def distributed_optimizer_takes_horovods_keywords():
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)
    every = [local_grads(r) for r in range(N)]
    total = [sum(g[i] for g in every) for i in range(3)]
    for got, want in zip(trained(sgd, op=hvd.Sum), total):
        assert torch.allclose(got, want), (got, want)
    for got, want in zip(trained(sgd, gradient_predivide_factor=4.0, groups=2), total):
        assert torch.allclose(got, want / N), (got, want / N)
    grads = trained(sgd, sparse=True, sparse_as_dense=True, num_groups=1,
                    process_set=hvd.global_process_set)
    assert grads[0].is_sparse
    assert torch.allclose(grads[0].to_dense(), total[0] / N)
    for options, words in [({"op": hvd.Adasum}, "op=hvd.Average instead"),
                           ({"op": hvd.Max}, "use hvd.Average or hvd.Sum"),
                           ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "op != hvd.Average"),
                           ({"groups": "x"}, "groups should be")]:
        try:
            trained(sgd, **options)
            raise AssertionError(f"accepted {options}")
        except ValueError as exc:
            assert words in str(exc), str(exc)
    try:
        trained(sgd, sparse=True)
        raise AssertionError("a sparse gradient was pushed")
    except ValueError as exc:
        assert "sparse_as_dense=True" in str(exc), str(exc)

@check
def broadcast_optimizer_state_of_other_optimizers():
    for make in [lambda p: torch.optim.SGD(p, lr=0.1 * (ME + 1), momentum=0.9),
                 lambda p: torch.optim.RMSprop(p, lr=0.01 * (ME + 1)),
                 lambda p: torch.optim.Adagrad(p, lr=0.01 * (ME + 1))]:
        torch.manual_seed(ME)
        model = torch.nn.Linear(3, 2)
        opt = make(model.parameters())
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        root_lr = make(model.parameters()).defaults["lr"] / (ME + 1)      # rank 0's
        assert abs(opt.param_groups[0]["lr"] - root_lr) < 1e-12
        for state in opt.state_dict()["state"].values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    same(hvd.broadcast(value, 0), value, key)     # equal on every rank

@check
def sync_batch_norm_is_batch_norm_over_every_ranks_batch():
    torch.manual_seed(1)
    batches = [torch.randn(r + 2, 3, 4, dtype=torch.float64) * (r + 1) + r for r in range(N)]
    weights = [torch.randn(r + 2, 3, 4, dtype=torch.float64) for r in range(N)]
    sync = hvd.SyncBatchNorm(3, momentum=0.3).double()
    with torch.no_grad():
        sync.weight.copy_(torch.tensor([1.0, 2.0, -1.0]))
        sync.bias.copy_(torch.tensor([0.5, 0.0, 1.0]))
    whole = torch.nn.BatchNorm1d(3, momentum=0.3).double()
    whole.load_state_dict(sync.state_dict())
    x = batches[ME].clone().requires_grad_()
    y = sync(x)
    (y * weights[ME]).sum().backward()
    every = torch.cat(batches).requires_grad_()
    out = whole(every)
    (out * torch.cat(weights)).sum().backward()
    start = sum(r + 2 for r in range(ME))
    rows = slice(start, start + ME + 2)
    assert torch.allclose(y, out[rows], atol=1e-12)
    assert torch.allclose(x.grad, every.grad[rows], atol=1e-10), (x.grad, every.grad[rows])
    assert torch.allclose(sync.running_mean, whole.running_mean, atol=1e-12)
    assert torch.allclose(sync.running_var, whole.running_var, atol=1e-12)
    # the weight's gradient is this rank's share; the job's sum is the whole batch's
    assert torch.allclose(hvd.allreduce(sync.weight.grad, op=hvd.Sum), whole.weight.grad)
    sync.eval()
    whole.eval()
    assert torch.allclose(sync(batches[ME]), whole(batches[ME]))
'''

CHECKS = ["sync_batch_norm_is_batch_norm_over_every_ranks_batch",
          "a_failed_collective_raises_horovod_internal_error",
          "automatic_names_come_back_once_synchronized", "scalars_empty_tensors_and_compression",
          "distributed_optimizer_takes_horovods_keywords",
          "broadcast_optimizer_state_of_other_optimizers", "names_and_feature_queries",
          "allreduce_sum_and_average_every_dtype",
          "allreduce_min_max_product_every_dtype",
          "allreduce_min_max_product_push_one_tensors_bytes",
          "gathers_broadcasts_and_alltoalls_push_one_ranks_bytes",
          "broadcast_roots_that_disagree_fail_every_rank_naming_them",
          "allreduce_scales_in_place_async_grouped_and_deprecated_average",
          "allreduce_refusals_name_the_way_out", "allreduce_gradients_are_horovods",
          "allgather_uneven_rows_every_dtype_async_grouped", "allgather_object_and_gradient",
          "broadcast_from_every_root_in_place_async_and_gradient",
          "alltoall_with_and_without_splits_and_gradient",
          "reducescatter_uneven_sum_average_grouped_and_gradient",
          "barrier_join_process_sets_and_internal_errors", "the_numpy_api_gathers_too",
          "the_numpy_api_reduces_by_every_op_on_the_servers",
          "a_timeline_is_written"]


#: (ranks, BPSCTL_LOCAL_REDUCE): one rank alone; two through the intra-node stage (one host,
#: no servers); three through the servers
LAUNCHES = [(1, "auto"), (2, "auto"), (3, "off")]


@pytest.fixture(scope="module", params=LAUNCHES,
                ids=lambda p: f"np{p[0]}-{'stage' if p[1] == 'auto' else 'servers'}")
def horovod_results(request, tmp_path_factory):
    np_, local_reduce = request.param
    return run_script(tmp_path_factory.mktemp(f"hvd{np_}"), HOROVOD_SCRIPT, np=np_,
                      local_reduce=local_reduce)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", CHECKS)
def test_horovod_collectives(horovod_results, check):
    assert_ok(horovod_results, check)


LOST_PEER_SCRIPT = '''
@check
def lost_peer():
    bps.barrier()
    if R == 1:
        os._exit(0)             # gone without leaving (and without failing the job)
    started = time.monotonic()
    try:
        bps.allreduce(torch.ones(3), op=bps.Sum, name="after")
        raise AssertionError("summed without the lost worker")
    except bps.HorovodInternalError as exc:
        RESULTS["message"] = str(exc)
        RESULTS["seconds"] = time.monotonic() - started
'''


@pytest.mark.timeout(120)
def test_a_lost_peer_fails_the_collective_with_horovod_internal_error(tmp_path):
    """Rank 1 vanishes; rank 0's next allreduce raises HorovodInternalError naming it, once
    its heartbeats are overdue (not at the op timeout)."""
    record, = run_script(tmp_path, LOST_PEER_SCRIPT, np=2, ranks=[0], local_reduce="off",
                         heartbeat_timeout_s=2.0)
    assert record["results"]["lost_peer"] == "ok", record["results"]
    assert "lost worker 1" in record["results"]["message"]
    assert record["results"]["seconds"] < 15


# --------------------------------------------------------------------------- Horovod's example

#: a directory holding Horovod's examples (``examples`` of a Horovod source checkout, whose
#: ``pytorch/pytorch_synthetic_benchmark.py`` the test below runs); they are not copied here
HOROVOD_EXAMPLES = os.environ.get("BPSCTL_HOROVOD_EXAMPLES", "")

#: a stand-in for torchvision, whose wheel does not load on CPU torch: the benchmark takes its
#: model from ``torchvision.models`` by name (``--model``), built with ``norm_layer``
TORCHVISION_MODELS = '''
"""torchvision.models for the test: tiny(norm_layer=...), a small convolutional network."""
import torch
from torch import nn


def tiny(norm_layer=nn.BatchNorm2d, num_classes=1000):
    return nn.Sequential(nn.Conv2d(3, 8, 7, stride=4, padding=3, bias=False), norm_layer(8),
                         nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))
'''


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HOROVOD_EXAMPLES, reason="set BPSCTL_HOROVOD_EXAMPLES to the examples "
                    "directory of a Horovod source checkout to run its synthetic benchmark")
def test_horovods_synthetic_benchmark_runs_with_only_its_import_changed(tmp_path, monkeypatch):
    """Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``, its ``import
    horovod.torch as hvd`` line replaced by ``import bpsctl.engine.torch as hvd`` and nothing
    else, on 2 workers, with a small model (``--model tiny`` from a stand-in ``torchvision``
    package on PYTHONPATH, since torchvision's wheel does not load here) and few batches
    (its own flags). The model's batch norm layers are ``hvd.SyncBatchNorm`` (the script
    passes ``norm_layer``)."""
    source = Path(HOROVOD_EXAMPLES, "pytorch", "pytorch_synthetic_benchmark.py").read_text()
    assert source.count("import horovod.torch as hvd\n") == 1
    script = tmp_path / "pytorch_synthetic_benchmark.py"
    script.write_text(source.replace("import horovod.torch as hvd\n",
                                     "import bpsctl.engine.torch as hvd\n"))
    stub = tmp_path / "stub" / "torchvision"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("from . import models\n")
    (stub / "models.py").write_text(TORCHVISION_MODELS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(stub.parent), str(Path(__file__).resolve().parent.parent),
         os.environ.get("PYTHONPATH", "")]))
    log = io.StringIO()
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                    start_timeout_s=30.0, op_timeout_s=30.0)
    result = run_local([sys.executable, str(script), "--model", "tiny", "--batch-size", "4",
                        "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                        "--num-iters", "2", "--no-cuda"], 2, config, servers=1,
                       stdout=log, stderr=log)
    output = log.getvalue()
    assert result.exit_code == 0, output[-4000:]
    assert "Total img/sec on 2 CPU(s)" in output, output[-4000:]


# --------------------------------------------------------------------------- a Horovod script

#: an MNIST-style training script as Horovod users write them (after Horovod's pytorch_mnist
#: example: DistributedSampler shards, the learning rate scaled by size(), broadcast of the
#: model and optimizer state, DistributedOptimizer, and metrics averaged with hvd.allreduce),
#: on data it generates; only its import line names bpsctl
MNIST_STYLE_SCRIPT = '''
import hashlib, json, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
import bpsctl.engine.torch as hvd          # was: import horovod.torch as hvd

epochs = int(sys.argv[1])
hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

# ten classes of 8x8 "images", labelled by a fixed random teacher: learnable in a few epochs
generator = torch.Generator().manual_seed(0)
teacher = torch.randn(64, 10, generator=generator)


def make(n):
    x = torch.randn(n, 1, 8, 8, generator=generator)
    return TensorDataset(x, (x.flatten(1) @ teacher).argmax(1))


train_set, test_set = make(1024), make(256)
train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = DataLoader(train_set, batch_size=32, sampler=train_sampler)
test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                  shuffle=False)
test_loader = DataLoader(test_set, batch_size=64, sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return F.log_softmax(self.fc(F.relu(self.conv(x)).flatten(1)), dim=1)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none, op=hvd.Average,
                                     gradient_predivide_factor=1.0)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


for epoch in range(1, epochs + 1):
    model.train()
    train_sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        F.nll_loss(model(data), target).backward()
        optimizer.step()
    model.eval()
    test_loss = test_accuracy = 0.0
    predictions = []
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(1)
            predictions.append(pred)
            test_accuracy += pred.eq(target).float().sum().item()
    local_loss = test_loss / len(test_sampler)
    local_accuracy = test_accuracy / len(test_sampler)
    test_loss = metric_average(local_loss, "avg_loss")
    test_accuracy = metric_average(local_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100 * test_accuracy:.1f}%")

gathered = hvd.allgather(torch.cat(predictions), name="predictions")
best = hvd.allreduce(torch.tensor([local_accuracy]), op=hvd.Max, name="best")
hvd.barrier()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print("RESULT " + json.dumps({
    "rank": hvd.rank(), "size": hvd.size(), "local_accuracy": local_accuracy,
    "accuracy": test_accuracy, "loss": test_loss, "gathered": gathered.numel(),
    "best": best.item(), "params": hashlib.sha1(flat.numpy().tobytes()).hexdigest()}),
    flush=True)
'''


def _check_mnist_style_run(output: str, workers: int) -> None:
    """What the script's user would check: it ran to the end on every rank, every rank
    holds the same model and the same averaged metrics, each average is the mean of the
    ranks' own, and the model learned."""
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines()
               if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == list(range(workers)), output[-4000:]
    assert {r["size"] for r in results} == {workers}
    assert len({r["params"] for r in results}) == 1, "ranks ended with different models"
    assert len({r["accuracy"] for r in results}) == 1 and len({r["loss"] for r in results}) == 1
    mean = sum(r["local_accuracy"] for r in results) / workers
    assert results[0]["accuracy"] == pytest.approx(mean, abs=1e-6)
    assert results[0]["best"] == pytest.approx(max(r["local_accuracy"] for r in results))
    assert all(r["gathered"] == 256 for r in results)       # every test prediction, once
    assert results[0]["accuracy"] > 0.5, output[-2000:]     # chance is 0.1


@pytest.mark.timeout(180)
def test_an_mnist_style_horovod_script_trains_with_only_its_import_changed(tmp_path):
    """The script on 2 workers of the embedded default (`bpsctl run -np 2`)."""
    script = tmp_path / "train.py"
    script.write_text(MNIST_STYLE_SCRIPT)
    log = io.StringIO()
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                    start_timeout_s=30.0, op_timeout_s=30.0)
    result = run_local([sys.executable, str(script), "3"], 2, config, stdout=log, stderr=log)
    assert result.exit_code == 0, log.getvalue()[-4000:]
    _check_mnist_style_run(log.getvalue(), 2)


@pytest.mark.timeout(240)
def test_an_mnist_style_horovod_script_trains_on_two_emulated_hosts(tmp_path):
    """The script on 2 emulated hosts (network namespaces, 1 Gbit NICs) and a server host:
    its collectives cross the shaped network to the server."""
    script = tmp_path / "train.py"
    script.write_text(MNIST_STYLE_SCRIPT)
    config = Config.from_env({}, state_dir=tmp_path / "state", emulate=True, nic="1gbit",
                             start_timeout_s=30)
    up_emulated(config, workers=2, servers=1)
    try:
        log = io.StringIO()
        result = run_local([sys.executable, str(script), "2"], 2, config, stdout=log,
                           stderr=log)
        assert result.exit_code == 0, log.getvalue()[-4000:]
        _check_mnist_style_run(log.getvalue(), 2)
    finally:
        down(config.state_dir)


ALLTOALL_PULLS_SCRIPT = '''
@check
def alltoall_pulls_what_it_receives():
    import numpy as np
    w = bps._p().worker
    rows = [[40, 8, 24], [8, 40, 16], [16, 8, 40]][R]      # rows to ranks 0, 1, 2
    x = torch.cat([torch.full((n, 4), float(100 * R + d)) for d, n in enumerate(rows)])
    for _ in range(2):                                      # the second round on the same names
        before = sum(s["pulled_bytes"] for s in w.stats()["servers"])
        got, received = bps.alltoall(x, splits=rows, name="a2a")
        pulled = sum(s["pulled_bytes"] for s in w.stats()["servers"]) - before
    sent = [[40, 8, 24], [8, 40, 16], [16, 8, 40]]
    want = torch.cat([torch.full((sent[s][R], 4), float(100 * s + R)) for s in range(N)])
    assert received.tolist() == [sent[s][R] for s in range(N)], received
    assert torch.equal(got, want), (got[:, 0].tolist(), want[:, 0].tolist())
    whole = sum(map(sum, sent)) * 16
    # the rows sent to this rank by the others (whole partitions around them), and the
    # small count exchange; not the whole buffer, nor the rows it sent itself
    RESULTS["pulled"], RESULTS["whole"] = pulled, whole


@check
def allgather_pulls_the_others_rows():
    w = bps._p().worker
    mine = torch.full((10 * (R + 1), 4), float(R + 1))        # 10, 20 and 30 rows of 16 bytes
    for _ in range(2):
        before = sum(s["pulled_bytes"] for s in w.stats()["servers"])
        got = bps.allgather(mine, name="ag")
        pulled = sum(s["pulled_bytes"] for s in w.stats()["servers"]) - before
    want = torch.cat([torch.full((10 * (r + 1), 4), float(r + 1)) for r in range(N)])
    assert torch.equal(got, want), got[:, 0].tolist()
    RESULTS["gathered"] = pulled
'''


def test_an_alltoall_pulls_the_rows_sent_to_it_and_keeps_its_own_at_home(tmp_path):
    """An alltoall pulls the partitions holding the rows the others send each rank (64-byte
    partitions, 16-byte rows): less than half the gathered buffer, the rows a rank sends
    itself not at all, and the output exact, twice; an allgather pulls the others' rows, not
    its own."""
    records = run_script(tmp_path, ALLTOALL_PULLS_SCRIPT, np=3, partition_bytes=64,
                         local_reduce="off")
    assert_ok(records, "alltoall_pulls_what_it_receives")
    for rank, record in enumerate(records):
        pulled, whole = record["results"]["pulled"], record["results"]["whole"]
        others = sum([[40, 8, 24], [8, 40, 16], [16, 8, 40]][s][rank] for s in range(3)
                     if s != rank) * 16
        assert others <= pulled <= others + 6 * 64 + 3 * 8 * 3, (rank, pulled, others, whole)
    assert_ok(records, "allgather_pulls_the_others_rows")
    for rank, record in enumerate(records):
        others = sum(10 * (r + 1) for r in range(3) if r != rank) * 16
        gathered = record["results"]["gathered"]
        assert others <= gathered <= others + 4 * 64 + 3 * 8, (rank, gathered, others)
