"""What bpsctl is, in Horovod's terms (``horovod.common.basics``): the feature queries, the
host layout (``cross_rank``, ``cross_size``, ``is_homogeneous``) and timelines; those that do
not depend on the framework are :mod:`bpsctl.engine.basics`, shared with the MXNet plugin."""
from __future__ import annotations

import numpy as np
import torch

from .. import collectives as K
from ..basics import (  # noqa: F401 - Horovod's names, as its torch module has them
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from .ops import synchronize
from .plugin import _p

__all__: list[str] = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "cross_rank",
    "cross_size", "is_homogeneous", "start_timeline", "stop_timeline"]


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


_layouts: dict[int, tuple[int, int, bool]] = {}      # id(plugin) -> what _hosts found


def _hosts() -> tuple[int, int, bool]:
    """(cross rank, cross size, homogeneous), found once per job
    (:func:`bpsctl.engine.collectives.host_layout`), the exchange it may need through the
    plugin's own path (the intra-node stage, where there is one)."""
    plugin = _p()
    if id(plugin) not in _layouts:
        from .mpi_ops import _push_sum  # (mpi_ops imports this module)

        def push_pull_sum(array: np.ndarray, name: str) -> np.ndarray:
            return synchronize(_push_sum(torch.from_numpy(array.copy()), name)).numpy()
        worker = plugin.worker
        _layouts[id(plugin)] = K.host_layout(worker.rank, worker.size, worker.local_rank,
                                             worker.local_size, push_pull_sum,
                                             worker.rank_hosts)
    return _layouts[id(plugin)]


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
