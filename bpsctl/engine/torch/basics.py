"""What bpsctl is, in Horovod's terms (``horovod.common.basics``): the feature queries, the
host layout (``cross_rank``, ``cross_size``, ``is_homogeneous``) and timelines."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import collectives as K
from .plugin import _p, rank

__all__: list[str] = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "cross_rank",
    "cross_size", "is_homogeneous", "start_timeline", "stop_timeline"]


def mpi_built() -> bool:
    """False: bpsctl uses no MPI (its launcher is ``bpsctl run``)."""
    return False


def mpi_enabled() -> bool:
    """False: bpsctl uses no MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: bpsctl uses no MPI. (Horovod without MPI raises ValueError here; False lets a
    script that only asks go on.)"""
    return False


def gloo_built() -> bool:
    """False: Horovod's gloo controller is not used (the intra-node stage may run gloo through
    torch.distributed with ``BPSCTL_LOCAL_SHM=0``, which is not this)."""
    return False


def gloo_enabled() -> bool:
    """False: see :func:`gloo_built`."""
    return False


def nccl_built() -> int:
    """NCCL's version code (as Horovod's: ``major * 10000 + minor * 100 + patch``) where torch
    has NCCL and a CUDA device is usable (the intra-node stage then all-reduces CUDA tensors
    with it), else 0."""
    if not torch.cuda.is_available():
        return 0
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return 0
    if isinstance(version, int):
        return version
    major, minor, patch = (list(version) + [0, 0, 0])[:3]
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """Whether this torch was built with CUDA (CUDA tensors are then carried, staged through
    host memory or through NCCL)."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """False: bpsctl has no ROCm path of its own."""
    return False


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


_layouts: dict[int, tuple[int, int, bool]] = {}      # id(plugin) -> what _hosts found


def _hosts() -> tuple[int, int, bool]:
    """(cross rank, cross size, homogeneous). Ranks on a host are contiguous, as ``bpsctl
    run`` places them; when the job's size is a multiple of this host's worker count, every
    host is taken to hold that many (the intra-node stage assumes the same). Otherwise the
    ranks exchange which of them is first on its host (once per job)."""
    plugin = _p()
    worker = plugin.worker
    if worker.size % worker.local_size == 0:
        return worker.rank // worker.local_size, worker.size // worker.local_size, True
    if id(plugin) in _layouts:
        return _layouts[id(plugin)]
    from .mpi_ops import _exchange_ints  # (mpi_ops imports this module)
    table = _exchange_ints(np.array([worker.local_rank == 0], np.int64), "cross_rank")
    firsts = [r for r in range(worker.size) if table[r, 0]]
    found = _layouts[id(plugin)] = (*K.cross_layout(firsts, worker.size, worker.rank), False)
    return found


def cross_rank() -> int:
    """This host's index among the hosts that have a worker of this local rank (Horovod's
    cross rank; with equal hosts: the host's index). When hosts hold different numbers of
    workers the first call is collective (a small exchange): call it on every rank."""
    return _hosts()[0]


def cross_size() -> int:
    """How many hosts have a worker of this local rank (with equal hosts: the host count);
    see :func:`cross_rank`."""
    return _hosts()[1]


def is_homogeneous() -> bool:
    """Whether every host runs as many workers (see :func:`cross_rank`)."""
    return _hosts()[2]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this worker's timeline (bpsctl's Chrome trace, :mod:`bpsctl.engine.trace`:
    every push_pull, its partitions on the wire and the waits) from now; rank 0 writes it to
    ``file_path`` at :func:`stop_timeline` (or shutdown), rank ``r`` beside it as
    ``<stem>.rank<r><suffix>``. Unlike ``BPSCTL_TRACE_DIR``, the servers do not trace.
    ``mark_cycles`` is accepted and ignored (bpsctl has no negotiation cycles)."""
    del mark_cycles
    path = Path(file_path)
    me = rank()
    if me:
        path = path.with_name(f"{path.stem}.rank{me}{path.suffix}")
    _p().worker.start_trace(path)


def stop_timeline() -> None:
    """Stop the timeline :func:`start_timeline` started and write it."""
    _p().worker.stop_trace()
