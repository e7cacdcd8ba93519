"""What bpsctl is, in Horovod's terms (``horovod.common.basics``), for both plugins: the
feature queries that do not depend on the framework, and timelines. The PyTorch plugin's
:mod:`bpsctl.engine.torch.basics` and the MXNet plugin's :mod:`bpsctl.engine.mxnet.mpi_ops`
add what does (``nccl_built``, ``cuda_built``, the host layout)."""
from __future__ import annotations

from pathlib import Path

from .api import _w
from .collectives import timeline_path

__all__: list[str] = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "ddl_built", "ccl_built", "rocm_built", "start_timeline", "stop_timeline"]


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
    """False: Horovod's gloo controller is not used (the PyTorch plugin's intra-node stage may
    run gloo through torch.distributed with ``BPSCTL_LOCAL_SHM=0``, which is not this)."""
    return False


def gloo_enabled() -> bool:
    """False: see :func:`gloo_built`."""
    return False


def rocm_built() -> bool:
    """False: bpsctl has no ROCm path of its own."""
    return False


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this worker's timeline (bpsctl's Chrome trace, :mod:`bpsctl.engine.trace`:
    every push_pull, its partitions on the wire and the waits) from now; rank 0 writes it to
    ``file_path`` at :func:`stop_timeline` (or shutdown), rank ``r`` beside it as
    ``<stem>.rank<r><suffix>``. Unlike ``BPSCTL_TRACE_DIR``, the servers do not trace.
    ``mark_cycles`` is accepted and ignored (bpsctl has no negotiation cycles)."""
    del mark_cycles
    worker = _w()
    worker.start_trace(timeline_path(Path(file_path), worker.rank))


def stop_timeline() -> None:
    """Stop the timeline :func:`start_timeline` started and write it."""
    _w().stop_trace()
