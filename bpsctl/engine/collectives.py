"""Horovod's collectives on a parameter server: the framework-free part.

The engine does one thing: ``push_pull``, the sum of a tensor over every worker, each worker
getting the sum back. Every Horovod collective is built from it here, with the arithmetic
(who owns which rows, where each rank's rows go) kept apart from any framework so that the
PyTorch plugin (:mod:`bpsctl.engine.torch.mpi_ops`), the NumPy API and the MXNet plugin
share it:

* **allreduce, Sum and Average**: one push_pull (the servers sum; the engine divides).
* **allreduce, Min, Max and Product**: one push_pull whose partitions the servers combine
  elementwise by the op instead of summing (:data:`SERVER_REDUCTIONS`).
* **gather through summation** (allgather, broadcast, alltoall): every
  rank writes its rows at its own offset into a zeroed buffer holding every rank's rows and
  push_pulls it; the others add zeros there, so the sum *is* the concatenation, exactly, for
  every dtype (``x + 0 == x``, integers and floats alike, no rounding; only a float's
  negative zero comes back as zero, and NaN as NaN). Each rank says which bytes are its
  own (the push_pull's ``mine``): every partition wholly outside them goes as a PUSH_ZERO,
  a header without bytes, so a rank pushes about its own rows (plus the partitions it
  shares with a neighbour), not the whole buffer, and pulls the whole result. A broadcast
  is a sum in which only the root pushes bytes (``root``); the servers check that every
  rank names the same root. When ranks may contribute different numbers of rows, a small
  push_pull of one int64 per rank exchanges them first (:func:`gather_by_sum`).
* **reducescatter**: a push_pull of the whole tensor, each rank keeping its own rows
  (:func:`reducescatter_counts`, Horovod's split).

Reduction ops carry Horovod's values (``hvd.Average == 0``, ...), so scripts that compare or
store them behave the same.
"""
from __future__ import annotations

import enum
import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from . import protocol as P
from .common import HorovodInternalError

__all__ = ["HorovodInternalError", "ReduceOp", "SERVER_OPS",
           "SERVER_REDUCTIONS", "resolve_op", "check_op", "cross_layout", "host_layout",
           "layout_of_hosts",
           "timeline_path", "AutoNames", "offsets", "reducescatter_counts", "even_splits",
           "check_splits", "alltoall_plan", "exchange_counts", "as_bytes", "from_bytes",
           "GatherFn", "row_bytes",
           "gather_rows", "gather_by_sum", "scaled", "floor_average", "alltoall_by_sum"]


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
#: how the servers reduce each op other than a sum (protocol.REDUCE_*)
SERVER_REDUCTIONS = {ReduceOp.Min: P.REDUCE_MIN, ReduceOp.Max: P.REDUCE_MAX,
                     ReduceOp.Product: P.REDUCE_PRODUCT}

#: Horovod's errors (its controller's words) for the collectives a joined rank cannot add
#: zeros to (hvd.join(): docs/horovod-api.md), by kind
JOIN_ERRORS = {
    "allgather": "Allgather is not supported with Join at this time. Specify "
                 "sparse_to_dense=True if using DistributedOptimizer",
    "alltoall": "Alltoall is not supported with Join at this time.",
    "broadcast": "Broadcast is not supported with Join at this time.",
    "reducescatter": "Reducescatter is not supported with Join at this time."}


def check_joined(kind: str, joined: frozenset[int]) -> str:
    """Horovod's error for a ``kind`` collective (a gather, a broadcast, a reducescatter)
    while ranks ``joined`` have joined: raised now (HorovodInternalError) if any has; else
    returned, for its push_pulls to fail with if a rank joins before they complete (a worker
    hears of a join before any sum counts the joined rank as zeros)."""
    message = JOIN_ERRORS[kind]
    if joined:
        raise HorovodInternalError(f"{message} (rank(s) {sorted(joined)} joined)")
    return message


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


def layout_of_hosts(rank_hosts: Sequence[int], rank: int) -> tuple[int, int, bool]:
    """(cross rank, cross size, homogeneous) of ``rank`` in a job whose rank ``r`` runs on
    host ``rank_hosts[r]``: among the hosts that have a worker of this rank's local rank (its
    index among its host's ranks), the index of its host and their count; homogeneous when
    every host runs as many workers."""
    seen: dict[int, int] = {}
    local_ranks = []
    for host in rank_hosts:
        local_ranks.append(seen.get(host, 0))
        seen[host] = local_ranks[-1] + 1
    mine = local_ranks[rank]
    with_slot = [host for host, count in seen.items() if count > mine]   # in order of first rank
    return with_slot.index(rank_hosts[rank]), len(with_slot), len(set(seen.values())) == 1


def host_layout(rank: int, size: int, local_rank: int, local_size: int,
                push_pull_sum: SumFn, rank_hosts: Sequence[int] | None = None
                ) -> tuple[int, int, bool]:
    """(cross rank, cross size, homogeneous) of ``rank``: from ``rank_hosts`` (each rank's
    host, as the scheduler tells every worker) where given; else, ranks on a host being
    contiguous as ``bpsctl run`` places them, when ``size`` is a multiple of this host's
    worker count every host is taken to hold that many, and otherwise the ranks exchange which
    of them is first on its host (one push_pull, named ``cross_rank``: collective)."""
    if rank_hosts is not None and len(rank_hosts) == size:
        return layout_of_hosts(rank_hosts, rank)
    if size % local_size == 0:
        return rank // local_size, size // local_size, True
    flags = exchange_counts(int(local_rank == 0), rank, size, push_pull_sum, "cross_rank")
    firsts = [r for r in range(size) if flags[r]]
    return (*cross_layout(firsts, size, rank), False)


def timeline_path(file_path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes the timeline Horovod's ``start_timeline(file_path)`` asks
    for: rank 0 at ``file_path``, rank ``r`` beside it as ``<stem>.rank<r><suffix>``."""
    path = Path(file_path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}") if rank else path


Release = Callable[[], None]


class AutoNames:
    """Names for collectives called without one. Horovod counts them; here an engine name is
    a key that the scheduler declares (a round trip) and the servers keep for the whole job,
    so a count that only grows would declare a new key at every call of a training loop.
    Instead a collective takes the lowest index not held by another collective of the same
    kind, dtype and shape that has not finished yet, and gives it back when it finishes:
    names come back, bounded by how many such collectives are ever outstanding at once.
    Every rank picks the same index, since what it holds depends only on the order of its
    calls (the order Horovod needs anyway), not on timing."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}
        self.lock = threading.Lock()

    def take(self, key: str) -> tuple[str, Release]:
        with self.lock:
            held = self.held.setdefault(key, set())
            index = next(i for i in itertools.count() if i not in held)
            held.add(index)

        def release() -> None:
            with self.lock:
                held.discard(index)
        return f"{key}.{index}", release


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


class GatherFn(Protocol):
    """The engine's sum across ranks of an array under a name, where only the bytes ``mine``
    (start, stop) of this rank's array hold its data and the rest are zeros (push_pull's
    ``mine``: partitions wholly outside go as PUSH_ZERO)."""

    def __call__(self, array: np.ndarray, name: str,
                 mine: tuple[int, int] | None = None, /) -> np.ndarray: ...


def row_bytes(array: np.ndarray, start: int, count: int) -> tuple[int, int]:
    """The byte range of rows ``start .. start + count`` of a C-contiguous ``array``."""
    per_row = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    return start * per_row, (start + count) * per_row


def exchange_counts(mine: int, rank: int, size: int, push_pull_sum: SumFn,
                    name: str) -> list[int]:
    """Every rank's count (of rows, say), from this rank's ``mine``: one push_pull of an int64
    vector with a slot per rank, this rank's count in its own and zeros elsewhere."""
    vector = np.zeros(size, np.int64)
    vector[rank] = mine
    return [int(c) for c in push_pull_sum(vector, name)]


def gather_rows(array: np.ndarray, rank: int, size: int, push_pull_sum: GatherFn,
                name: str) -> tuple[np.ndarray, list[int]]:
    """:func:`gather_by_sum`, and every rank's count of rows."""
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        raise ValueError("allgather: a tensor of at least one dimension is needed; reshape a "
                         "scalar to shape (1,)")
    counts = exchange_counts(array.shape[0], rank, size, push_pull_sum, f"{name}.counts")
    wire = as_bytes(array)
    buffer = np.zeros((sum(counts), *wire.shape[1:]), wire.dtype)
    start = offsets(counts)[rank]
    buffer[start:start + array.shape[0]] = wire
    mine = row_bytes(buffer, start, array.shape[0])
    return from_bytes(push_pull_sum(buffer, f"{name}.rows.{sum(counts)}", mine),
                      array.dtype), counts


def gather_by_sum(array: np.ndarray, rank: int, size: int, push_pull_sum: GatherFn,
                  name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first dimension in rank order (ranks
    may differ in that dimension only), on every rank, with ``push_pull_sum``: the counts
    are exchanged first (under ``<name>.counts``), then each rank writes its rows at its
    offset into a zeroed buffer and sums it, pushing its own rows only (under
    ``<name>.rows.<total rows>``: a name is bound to one shape), see the module docstring.
    The NumPy form of the plugins' allgather. Bool arrays travel as their bytes."""
    return gather_rows(array, rank, size, push_pull_sum, name)[0]


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A bool array's bytes as uint8 (the wire has no bool); other arrays as they are."""
    return array.view(np.uint8) if array.dtype == np.bool_ else array


def from_bytes(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return array.view(np.bool_) if dtype == np.bool_ else array


def scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` in its own dtype (integers: scaled in float64, truncated toward
    zero, as the torch plugin does); ``array`` itself for a factor of 1."""
    if factor == 1.0:
        return array
    if array.dtype.kind == "f":
        return (array * array.dtype.type(factor)).astype(array.dtype, copy=False)
    return (array.astype(np.float64) * factor).astype(array.dtype)


def floor_average(total: np.ndarray, size: int) -> np.ndarray:
    """Horovod's average of integers: the floor division of their sum by ``size``."""
    return np.floor_divide(total, size).astype(total.dtype, copy=False)


def alltoall_by_sum(array: np.ndarray, counts: Sequence[int], rank: int, size: int,
                    push_pull_sum: GatherFn, name: str) -> tuple[np.ndarray, list[int]]:
    """An alltoall (``counts[d]`` rows of ``array`` to rank ``d``, checked with
    :func:`check_splits`) done as a gather of every rank's whole array: every rank's counts
    are exchanged first (one push_pull of ``size`` x ``size`` int64s under
    ``<name>.counts``), then the rows (``<name>.rows.<total rows>``); returns the rows sent
    to this rank in sender order, and how many came from each sender."""
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        raise ValueError("alltoall: a tensor of at least one dimension is needed")
    counts = check_splits(counts, array.shape[0], size)
    table = np.zeros((size, size), np.int64)
    table[rank] = counts
    matrix = push_pull_sum(table, f"{name}.counts")
    spans, received = alltoall_plan(matrix, rank)
    senders = [int(row.sum()) for row in matrix]
    wire = as_bytes(array)
    buffer = np.zeros((sum(senders), *wire.shape[1:]), wire.dtype)
    start = offsets(senders)[rank]
    buffer[start:start + array.shape[0]] = wire
    gathered = from_bytes(push_pull_sum(buffer, f"{name}.rows.{sum(senders)}",
                                        row_bytes(buffer, start, array.shape[0])), array.dtype)
    output = np.concatenate([gathered[s:s + c] for s, c in spans]) if spans else gathered[:0]
    return output, received
