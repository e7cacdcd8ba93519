"""Horovod's collectives on a parameter server: the framework-free part.

The engine does one thing: ``push_pull``, the sum of a tensor over every worker, each worker
getting the sum back. Every Horovod collective is built from it here, with the arithmetic
(who owns which rows, where each rank's rows go) kept apart from any framework so that the
PyTorch plugin (:mod:`bpsctl.engine.torch.mpi_ops`), the NumPy API and the MXNet plugin
share it:

* **allreduce, Sum and Average**: one push_pull (the servers sum; the engine divides).
* **gather through summation** (allgather, broadcast, alltoall, and Min, Max, Product): every
  rank writes its rows at its own offset into a zeroed buffer holding every rank's rows and
  push_pulls it; the others add zeros there, so the sum *is* the concatenation, exactly, for
  every dtype (``x + 0 == x``, integers and floats alike, no rounding; only a float's
  negative zero comes back as zero, and NaN as NaN). It costs what it
  moves: each rank pushes and pulls the whole buffer, ``size()`` times the bytes of one
  rank's rows when all ranks contribute alike (a broadcast pushes zeros from all but the
  root, as BytePS does). When ranks may contribute different numbers of rows, a small
  push_pull of one int64 per rank exchanges them first (:func:`gather_by_sum`).
* **Min, Max, Product**: gathered as above, then reduced on each rank along the new first
  dimension: every rank computes the same result from the same rows.
* **reducescatter**: a push_pull of the whole tensor, each rank keeping its own rows
  (:func:`reducescatter_counts`, Horovod's split).

Reduction ops carry Horovod's values (``hvd.Average == 0``, ...), so scripts that compare or
store them behave the same.
"""
from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import protocol as P
from .common import HorovodInternalError

__all__ = ["HorovodInternalError", "ReduceOp", "SERVER_OPS", "GATHERED_OPS",
           "SERVER_REDUCTIONS", "resolve_op",
           "check_op", "cross_layout", "offsets", "reducescatter_counts", "even_splits",
           "check_splits", "alltoall_plan", "exchange_counts", "gather_by_sum"]


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's values."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


#: the ops the servers compute themselves (a sum, divided for the average)
SERVER_OPS = (ReduceOp.Average, ReduceOp.Sum)
#: the ops computed on every rank after gathering every rank's tensor
GATHERED_OPS = (ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)
#: how the servers reduce each op other than a sum (protocol.REDUCE_*)
SERVER_REDUCTIONS = {ReduceOp.Min: P.REDUCE_MIN, ReduceOp.Max: P.REDUCE_MAX,
                     ReduceOp.Product: P.REDUCE_PRODUCT}


def resolve_op(op: Any, average: bool | None, what: str = "allreduce") -> ReduceOp:
    """The op a Horovod call means: ``op`` if given, else the deprecated ``average`` (True:
    Average, False: Sum), else Average, as Horovod decides. ValueError for both given, for
    an op that is not one of Horovod's, and for Adasum (which bpsctl does not compute)."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; pass only one of them "
                         f"(op=hvd.Sum for average=False, op=hvd.Average for average=True)")
    if op is None:
        if average is None:
            return ReduceOp.Average
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        return ReduceOp.Average if average else ReduceOp.Sum
    try:
        resolved = ReduceOp(op)
    except ValueError:
        names = ", ".join(f"hvd.{o.name}" for o in ReduceOp if o is not ReduceOp.Adasum)
        raise ValueError(f"{what}: op={op!r} is not a reduction op; use one of {names}") from None
    if resolved is ReduceOp.Adasum:
        raise ValueError(f"{what}: op=hvd.Adasum is not supported by bpsctl (its servers sum; "
                         "Adasum needs pairwise reductions between workers); use "
                         "op=hvd.Average instead")
    return resolved


def cross_layout(firsts: Sequence[int], size: int, rank: int) -> tuple[int, int]:
    """Horovod's cross rank and cross size of ``rank`` in a job of ``size`` ranks whose hosts
    start at ranks ``firsts`` (ranks of a host are contiguous): among the hosts that have a
    worker of this one's local rank, the index of this one's host and their count."""
    ends = [*firsts[1:], size]
    host = max(i for i, first in enumerate(firsts) if first <= rank)
    local_rank = rank - firsts[host]
    with_slot = [i for i in range(len(firsts)) if ends[i] - firsts[i] > local_rank]
    return with_slot.index(host), len(with_slot)


def check_op(op: ReduceOp, allowed: Sequence[ReduceOp], what: str) -> None:
    """ValueError unless ``op`` is one of ``allowed`` for the collective ``what``."""
    if op not in allowed:
        names = " or ".join(f"hvd.{o.name}" for o in allowed)
        raise ValueError(f"{what}: op=hvd.{op.name} is not supported; use {names}")


def offsets(counts: Sequence[int]) -> list[int]:
    """Where each rank's rows start when ``counts[r]`` rows of each rank ``r`` are
    concatenated in rank order."""
    starts, at = [], 0
    for count in counts:
        starts.append(at)
        at += int(count)
    return starts


def reducescatter_counts(rows: int, size: int) -> list[int]:
    """How many of ``rows`` rows each of ``size`` ranks gets from a reducescatter, as Horovod
    splits them: ``rows // size`` each, and one more for each of the first ``rows % size``
    ranks."""
    if size < 1:
        raise ValueError(f"reducescatter: a job has at least one rank, got size {size}")
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def even_splits(rows: int, size: int, what: str = "alltoall") -> list[int]:
    """The splits of an alltoall without ``splits``: the first dimension cut into ``size``
    equal parts (ValueError if it does not divide, naming how to fix it)."""
    if rows % size:
        raise ValueError(f"{what}: the first dimension ({rows}) must be divisible by the number "
                         f"of ranks ({size}) when splits is not given; pass splits=[...] (one "
                         "row count per destination rank)")
    return [rows // size] * size


def check_splits(splits: Sequence[int], rows: int, size: int, what: str = "alltoall") -> list[int]:
    """``splits`` as a list of ints, checked: one non-negative count per rank, adding up to
    the first dimension of the tensor."""
    counts = [int(s) for s in splits]
    if len(counts) != size:
        raise ValueError(f"{what}: splits has {len(counts)} entries; it needs one per rank "
                         f"({size})")
    if any(c < 0 for c in counts):
        raise ValueError(f"{what}: splits {counts} has a negative count")
    if sum(counts) != rows:
        raise ValueError(f"{what}: splits {counts} add up to {sum(counts)}, but the tensor's "
                         f"first dimension is {rows}")
    return counts


def alltoall_plan(matrix: np.ndarray, rank: int) -> tuple[list[tuple[int, int]], list[int]]:
    """What rank ``rank`` receives in an alltoall done as an allgather, from ``matrix``
    (``matrix[s][d]``: rows sender ``s`` sends to destination ``d``): the (start, count) of
    the rows for ``rank`` in the gathered buffer (every sender's whole tensor, in rank
    order), one per sender, and the counts received from each sender."""
    senders = [int(row.sum()) for row in matrix]
    starts = offsets(senders)
    received = [int(matrix[s][rank]) for s in range(len(matrix))]
    spans = [(starts[s] + int(matrix[s][:rank].sum()), received[s]) for s in range(len(matrix))]
    return spans, received


#: the engine's sum across ranks of an array under a name (push_pull, ``average=False``)
SumFn = Callable[[np.ndarray, str], np.ndarray]


def exchange_counts(mine: int, rank: int, size: int, push_pull_sum: SumFn,
                    name: str) -> list[int]:
    """Every rank's count (of rows, say), from this rank's ``mine``: one push_pull of an int64
    vector with a slot per rank, this rank's count in its own and zeros elsewhere."""
    vector = np.zeros(size, np.int64)
    vector[rank] = mine
    return [int(c) for c in push_pull_sum(vector, name)]


def gather_by_sum(array: np.ndarray, rank: int, size: int, push_pull_sum: SumFn,
                  name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first dimension in rank order (ranks
    may differ in that dimension only), on every rank, with ``push_pull_sum``: the counts
    are exchanged first (under ``<name>.counts``), then each rank writes its rows at its
    offset into a zeroed buffer and sums it (under ``<name>.rows.<total rows>``: a name is
    bound to one shape), see the module docstring. The NumPy form of the plugins'
    allgather."""
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        raise ValueError("allgather: a tensor of at least one dimension is needed; reshape a "
                         "scalar to shape (1,)")
    counts = exchange_counts(array.shape[0], rank, size, push_pull_sum, f"{name}.counts")
    buffer = np.zeros((sum(counts), *array.shape[1:]), array.dtype)
    start = offsets(counts)[rank]
    buffer[start:start + array.shape[0]] = array
    return push_pull_sum(buffer, f"{name}.rows.{sum(counts)}")
