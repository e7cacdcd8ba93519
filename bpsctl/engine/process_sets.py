"""Horovod's process sets (``horovod.common.process_sets``), shared by the PyTorch and MXNet
plugins (one :data:`global_process_set`, as in Horovod).

A process set is a sorted list of ranks that run collectives among themselves: ranks outside
it do not call them and are not waited for. How bpsctl carries one:

* **Registering** (:func:`add_process_set`, :func:`remove_process_set`) is collective over
  every live rank, as in Horovod: each rank writes what it asks for (add these ranks, remove
  set ``id``) into its own row of a zeroed table and the table is summed once over the job
  (a gather through summation, ``process_sets.agree``), so every rank sees every rank's
  request and they all decide alike: the set gets the next id (ids are never reused, so a
  removed set's tensors cannot be mistaken for a later one's), or every rank raises the same
  ValueError naming what differs.
* **Scoping**: a collective on a set gets engine names of its own (``ps<id>/<name>``) and
  pushes with the set's ranks (``Worker.push_pull_async(ranks=...)``); before its first push
  of such a partition a worker tells that server which ranks push it (``SCOPE``), so the
  server completes the partition's rounds once those ranks pushed. Averages divide by the
  pushes a sum holds, so by the set's size. A lost worker lowers only its sets' counts.
* Gathers use the rank and size within the set (:class:`Scope`); roots of broadcasts stay
  global ranks, as Horovod's.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .api import _w, is_initialized, rank, size
from .common import EngineError

__all__: list[str] = ["ProcessSet", "ProcessSetUnsupported", "global_process_set",
                      "add_process_set", "remove_process_set"]

#: the engine name of the table through which ranks agree on adding or removing a set
AGREE_NAME = "process_sets.agree"
_ADD, _REMOVE, _INVALID = 1, 2, 3
#: a row of that table: what (1 byte), 3 spare, the set id (uint32), then a bit per rank
_HEAD = 8


class ProcessSetUnsupported(EngineError, NotImplementedError):
    """A process set where bpsctl takes the global one only (``DistributedOptimizer``, MXNet's
    ``DistributedTrainer``, ``init(comm=...)``)."""


class ProcessSet:
    """Horovod's process set: a sorted list of ranks. :func:`add_process_set` registers it
    (``process_set_id``); :func:`remove_process_set` invalidates it."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int]):
        if not isinstance(ranks_or_comm, (list, tuple, range)) or \
                not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks_or_comm):
            raise ValueError("ProcessSet takes a list of ranks (bpsctl has no MPI "
                             f"communicators), got {ranks_or_comm!r}")
        self.ranks = sorted(ranks_or_comm)

    def size(self) -> int | None:
        """The number of ranks in the set (None if not added)."""
        if self.process_set_id is None:
            return None
        return size() if self.process_set_id == 0 else len(self.ranks or [])

    def rank(self) -> int | None:
        """This process's rank within the set (None if not added; ValueError if this process
        is not in it, as Horovod's)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return rank()
        if rank() not in (self.ranks or []):
            raise ValueError(f"Process is not part of provided process set: rank {rank()} is "
                             f"not in {self}")
        return (self.ranks or []).index(rank())

    def included(self) -> bool | None:
        """Whether this process is in the set."""
        if self.process_set_id == 0:
            return True
        return None if self.ranks is None else rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job (``ranks`` as Horovod fills them in at init)."""

    process_set_id = 0

    def __init__(self) -> None:
        pass

    @property
    def ranks(self) -> list[int] | None:  # type: ignore[override]
        return list(range(size())) if is_initialized() else None


global_process_set: ProcessSet = _GlobalProcessSet()


class Scope(NamedTuple):
    """Where a collective runs: ``ranks`` (None: every rank of the job), this process's
    ``rank`` and the ``size`` within them, and the ``prefix`` of its engine names."""

    ranks: tuple[int, ...] | None
    rank: int
    size: int
    prefix: str


class _Registry:
    """The sets this worker process has added (the same on every rank: they are added and
    removed collectively, in the same order)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.next_id = 1
        self.sets: dict[int, tuple[int, ...]] = {}


_registry: _Registry | None = None


def _sets() -> _Registry:
    """This job's registry (a new one after ``shutdown()`` and ``init()``)."""
    global _registry
    worker = _w()
    if _registry is None or _registry.worker is not worker:
        _registry = _Registry(worker)
    return _registry


def _scope(process_set: ProcessSet | None, what: str) -> Scope:
    """Where a collective ``what`` on ``process_set`` runs; ValueError for a set that was
    never added or was removed, and for a rank outside the set, naming the set."""
    if process_set is None or process_set is global_process_set or \
            process_set.process_set_id == 0:
        return Scope(None, rank(), size(), "")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet (from "
                        f"hvd.add_process_set), got {type(process_set).__name__}")
    ranks = tuple(process_set.ranks or ())
    ps_id = process_set.process_set_id
    if ps_id is None or _sets().sets.get(ps_id) != ranks:
        if list(ranks) == list(range(size())):
            return Scope(None, rank(), size(), "")      # every rank: the global set
        raise ValueError(f"{what}: {process_set} is not a registered process set (never added, "
                         "or removed); call hvd.add_process_set(ranks) on every rank first")
    me = rank()
    if me not in ranks:
        raise ValueError(f"{what}: rank {me} is not a member of the provided process set "
                         f"{process_set}; only its ranks {list(ranks)} call its collectives")
    return Scope(ranks, ranks.index(me), len(ranks), f"ps{ps_id}/")


def _check_set(process_set: ProcessSet | None, what: str) -> None:
    """Nothing for the global set; :class:`ProcessSetUnsupported` for any other (where bpsctl
    takes the global set only)."""
    if process_set is None or process_set is global_process_set or \
            process_set.process_set_id == 0:
        return
    if process_set.ranks is not None and process_set.ranks == list(range(size())):
        return          # every rank: the global set by another name
    raise ProcessSetUnsupported(
        f"{what}: process set {process_set.ranks} is not the global set, and {what} runs over "
        "every rank here; leave process_set out (a process set carries hvd's collectives: "
        "allreduce, allgather, broadcast, alltoall, reducescatter, barrier, broadcast_object)")


def _check_init_sets(comm: Any, process_sets: Any) -> None:
    """``init(comm, process_sets)`` as Horovod takes them: ``comm`` must hold every rank
    (:class:`ProcessSetUnsupported` otherwise); each of ``process_sets`` (a ProcessSet or a
    list of ranks; ``"dynamic"``: none) is added, in order, as :func:`add_process_set`
    does, so every rank must pass the same list."""
    if comm is not None:
        ranks = sorted(comm) if isinstance(comm, (list, tuple, range)) else None
        if ranks != list(range(size())):
            raise ProcessSetUnsupported(
                f"init(comm={comm!r}): bpsctl runs a job over every rank `bpsctl run` started; "
                "leave comm out and use hvd.add_process_set(ranks) for collectives among some "
                "of them")
    if process_sets is None or process_sets == "dynamic":
        return
    for process_set in process_sets:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.ranks == list(range(size())):
            ps.process_set_id = 0       # Horovod's: the global set, listed again
            continue
        add_process_set(ps)


def _invalid(ranks: list[int], job_ranks: int) -> str:
    """Why ``ranks`` cannot be a process set of a job of ranks ``0..job_ranks-1`` ('' if it
    can)."""
    if not ranks:
        return "a process set needs at least one rank"
    if len(set(ranks)) != len(ranks):
        return f"ranks {ranks} name a rank twice"
    outside = [r for r in ranks if not 0 <= r < job_ranks]
    if outside:
        return f"ranks {outside} are not ranks of this job (0..{job_ranks - 1})"
    return ""


def _described(row: np.ndarray, width: int) -> str:
    """What one rank asked for, from its row of the agreement table."""
    kind, ps_id = int(row[0]), int(row[4:_HEAD].view(np.uint32)[0])
    if kind == _ADD:
        bits = np.unpackbits(row[_HEAD:], bitorder="little")[:width]
        return f"add process set {np.flatnonzero(bits).tolist()}"
    if kind == _REMOVE:
        return f"remove process set {ps_id}"
    if kind == _INVALID:
        return "add an invalid process set (its own error says why)"
    return "nothing (it did not take part)"


def _agree(kind: int, ps_id: int, ranks: Sequence[int], what: str, why: str = "") -> None:
    """Every live rank's request, summed into one table (collective); ValueError on every
    rank, naming each rank's request, unless they all asked for the same (``why``: what is
    wrong with this rank's own request, said too)."""
    worker = _w()
    width = max(worker.config.world_size, worker.config.max_workers, size())
    table = np.zeros((width, _HEAD + (width + 7) // 8), np.uint8)
    mine = table[worker.rank]
    mine[0] = kind
    mine[4:_HEAD].view(np.uint32)[0] = ps_id
    if kind == _ADD:
        bits = np.zeros(width, np.uint8)
        bits[list(ranks)] = 1
        mine[_HEAD:] = np.packbits(bits, bitorder="little")
    try:
        agreed = worker.push_pull(table, name=AGREE_NAME, average=False)
    except EngineError as exc:
        raise EngineError(f"{what}: the ranks could not agree on it: {exc}") from exc
    live = [r for r in worker.live_ranks if r < width]
    rows = {r: bytes(agreed[r]) for r in live}
    if len(set(rows.values())) > 1:
        asked = "; ".join(f"rank {r} asked to {_described(agreed[r], width)}" for r in live)
        raise ValueError(f"{what}: the ranks disagree: {asked}. Every rank must call "
                         "add_process_set and remove_process_set in the same order with the "
                         "same arguments" + (f" (this rank's: {why})" if why else ""))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (a ProcessSet or a list of ranks) on every rank and return it
    with its id. Collective over every rank, in the same order with the same ranks, as
    Horovod's; ValueError (on every rank) if they disagree, for ranks that are not the job's,
    and for a set whose ranks an existing one has (the global set included), as Horovod's
    "duplicate process set"."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.mpi_comm is not None or process_set.ranks is None:
        raise ValueError("add_process_set takes a list of ranks (bpsctl has no MPI "
                         "communicators)")
    registry = _sets()
    worker = registry.worker
    ranks = list(process_set.ranks)
    width = max(worker.config.world_size, worker.config.max_workers, size())
    why = _invalid(ranks, width)
    _agree(_INVALID if why else _ADD, registry.next_id, ranks, "add_process_set", why)
    if why:
        raise ValueError(f"add_process_set({ranks}): {why}")
    if ranks == list(range(size())) or tuple(ranks) in registry.sets.values():
        raise ValueError(f"Attempted to add a duplicate process set: {process_set} has the "
                         "ranks of " + ("global_process_set" if ranks == list(range(size()))
                                        else "a process set added before"))
    process_set.process_set_id = registry.next_id
    registry.sets[registry.next_id] = tuple(ranks)
    registry.next_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a set :func:`add_process_set` registered and invalidate it (its collectives
    raise ValueError from now on); collective over every rank, as Horovod's. False, with no
    exchange, for the global set and for a set not registered, as Horovod answers."""
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0:
        return False
    registry = _sets()
    if ps_id not in registry.sets:
        return False
    _agree(_REMOVE, ps_id, (), "remove_process_set")
    del registry.sets[ps_id]
    process_set._invalidate()
    return True


def _barrier(scope: Scope, timeout_s: float | None = None) -> None:
    """Wait until every rank of a process set has called its barrier: a one-element sum over
    the set (the scheduler's barrier counts every worker of the job)."""
    worker = _w()
    assert scope.ranks is not None
    worker.synchronize(worker.push_pull_async(np.zeros(1, np.int32), f"{scope.prefix}barrier",
                                              average=False, ranks=scope.ranks), timeout_s)
