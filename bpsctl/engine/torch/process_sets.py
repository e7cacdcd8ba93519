"""Horovod's process sets (``horovod.common.process_sets``). Only the global set, every rank
of the job, carries collectives: a server completes a round when every worker of the job has
pushed, so an op cannot be scoped to some of them; any other set raises
:class:`ProcessSetUnsupported`, saying so."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..common import EngineError
from .plugin import is_initialized, rank, size

__all__: list[str] = ["ProcessSet", "ProcessSetUnsupported", "global_process_set",
                      "add_process_set", "remove_process_set"]


class ProcessSetUnsupported(EngineError, NotImplementedError):
    """A collective on a process set other than the global one: the servers complete a round
    when every worker of the job has pushed, so an op cannot be scoped to some of them."""


class ProcessSet:
    """Horovod's process set: a list of ranks. Only :data:`global_process_set` (every rank)
    can carry collectives here; see :class:`ProcessSetUnsupported`."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int]):
        if not isinstance(ranks_or_comm, (list, tuple, range)) or \
                not all(isinstance(r, int) for r in ranks_or_comm):
            raise ValueError("ProcessSet takes a list of ranks (bpsctl has no MPI "
                             f"communicators), got {ranks_or_comm!r}")
        self.ranks = sorted(ranks_or_comm)

    def size(self) -> int | None:
        """The number of ranks in the set (None if not added)."""
        if self.process_set_id is None:
            return None
        return size() if self.process_set_id == 0 else len(self.ranks or [])

    def rank(self) -> int | None:
        """This process's rank within the set (None if not added)."""
        if self.process_set_id is None:
            return None
        return rank() if self.process_set_id == 0 else (self.ranks or []).index(rank())

    def included(self) -> bool | None:
        """Whether this process is in the set."""
        if self.process_set_id == 0:
            return True
        return None if self.ranks is None else rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job (``ranks`` as Horovod fills them in at init)."""

    process_set_id = 0

    def __init__(self) -> None:
        pass

    @property
    def ranks(self) -> list[int] | None:  # type: ignore[override]
        return list(range(size())) if is_initialized() else None


global_process_set: ProcessSet = _GlobalProcessSet()


def _unsupported(ranks: Any, what: str) -> ProcessSetUnsupported:
    return ProcessSetUnsupported(
        f"{what}: process set {ranks} is a subset of the job's workers, and bpsctl cannot scope "
        "a collective to some of them: a server completes a round when every worker of the job "
        "has pushed, so the others would wait forever. Use the global process set (leave "
        "process_set out), or run the subset as a job of its own")


def _check_set(process_set: ProcessSet | None, what: str) -> None:
    """Nothing for the global set; :class:`ProcessSetUnsupported` for any other."""
    if process_set is None or process_set is global_process_set or \
            process_set.process_set_id == 0:
        return
    if process_set.ranks is not None and process_set.ranks == list(range(size())):
        return          # every rank: the global set by another name
    raise _unsupported(process_set.ranks, what)


def _check_init_sets(comm: Any, process_sets: Any) -> None:
    """``init(comm, process_sets)`` as Horovod takes them: each must hold every rank (or be
    ``"dynamic"``, for ``process_sets``); :class:`ProcessSetUnsupported` otherwise."""
    if comm is not None:
        ranks = sorted(comm) if isinstance(comm, (list, tuple, range)) else None
        if ranks != list(range(size())):
            raise _unsupported(comm, "init(comm=...)")
    if process_sets is None or process_sets == "dynamic":
        return
    for process_set in process_sets:
        _check_set(process_set if isinstance(process_set, ProcessSet)
                   else ProcessSet(process_set), "init(process_sets=...)")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Horovod's dynamic process sets: ValueError for a set of every rank (the global set
    exists already, as in Horovod), :class:`ProcessSetUnsupported` for a proper subset."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks == list(range(size())):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set} holds every "
                         "rank, as global_process_set does")
    raise _unsupported(process_set.ranks, "add_process_set")


def remove_process_set(process_set: ProcessSet) -> bool:
    """False, as Horovod answers for the global set and for sets never added (the only kinds
    there are here)."""
    del process_set
    return False
