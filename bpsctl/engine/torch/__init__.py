"""PyTorch plugin: a drop-in for ``byteps.torch`` and ``horovod.torch``.

    import bpsctl.engine.torch as bps
    bps.init()
    model = ...; optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * bps.size())
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=bps.Compression.fp16)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)

CPU tensors enter the engine as NumPy views of their storage (no copy); CUDA tensors are
staged through pinned host buffers, copied on a side stream. A job of one worker sends
nothing: its push_pulls complete at once (``BPSCTL_FORCE_DISTRIBUTED`` sends anyway). When
several workers share a host (``local_size() > 1``) and ``BPSCTL_LOCAL_REDUCE`` is ``auto``,
push_pulls go through the intra-node stage (:mod:`bpsctl.engine.intranode`): shared memory
for host tensors (``BPSCTL_LOCAL_SHM``; gloo without it), and no servers at all when every
worker is on one host (``BPSCTL_LOCAL_ONLY``); NCCL on the GPU for CUDA tensors where every
host's ranks are on GPUs of their own (one all-reduce on one host; else only each rank's
owned chunk is staged through pinned memory), else they are staged whole and take the host
path. :func:`gradient_path` names the path; rank 0 says it at the first CUDA push_pull.
Handles are integers, as in Horovod. Nothing here touches CUDA until a CUDA tensor is pushed.

**Rejoining** (``bpsctl run --max-restarts``; new ranks of ``bpsctl run --attach`` join the
same way): a live worker hands a restarted one its state at the end of an optimizer step
(``DistributedOptimizer.step``, ``CrossBarrier.step``): the tensors it passed to
``broadcast_parameters``, every such optimizer's state, the step count and the count of
``broadcast_object`` calls (so that later ones line up). The restarted process runs the
script from the top; its ``broadcast_parameters`` waits for that state and copies it in (no
collective), its first ``step()`` loads the optimizer state, and :func:`step_count` says
where to resume. After its first step its parameters equal the others' bit for bit.
:mod:`bpsctl.engine.torch.elastic` does the same for Horovod's elastic API. ``CrossBarrier``
(:mod:`bpsctl.engine.torch.cross_barrier`) updates parameters per layer as their sums arrive,
on the same gradient hooks.

**Asynchronous training** (``BPSCTL_ASYNC``): the servers hold the parameters.
``DistributedOptimizer`` then wraps ``torch.optim.SGD`` only: its first ``step()`` pushes each
bucket's parameter values (the servers keep the first to arrive, and every worker starts from
them), and from then on the hooks push each bucket's gradient with its param group's
hyperparameters; the servers apply it at once, and ``step()`` copies the parameters they
answer with into the model instead of running the optimizer here.
"""

from __future__ import annotations

# The plugin's rooms: plugin.py (its state: init's job, rank, size), compression.py, ops.py
# (push_pull and its handles), cuda_copies.py and staging.py (CUDA tensors through host memory),
# gradients.py (the gradient hooks and buckets), functions.py (broadcasts), optimizer.py
# (DistributedOptimizer, DistributedDataParallel), and Horovod's mpi_ops.py, basics.py,
# process_sets.py, sync_batch_norm.py and elastic.py.
from typing import Any

from ...config import Config
from ..common import EngineError
from . import elastic, mpi_ops
from .compression import (  # noqa: F401  (Horovod's compressor classes, CompressionArg)
    BF16Compressor,
    Compression,
    CompressionArg,
    Compressor,
    EngineCompressor,
    FP16Compressor,
    NoneCompressor,
)
from .cuda_copies import _results_to_device  # noqa: F401  (tests check it directly)
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .gradients import _buckets  # noqa: F401  (tests check it directly)
from .mpi_ops import *  # noqa: F403  (Horovod's collectives: mpi_ops.__all__)
from .ops import (  # noqa: F401  (gradient_path)
    add_membership_callback,
    gradient_path,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    synchronize,
)
from .optimizer import DistributedDataParallel, DistributedOptimizer
from .plugin import (  # noqa: F401  (_p: the plugin's state, for benchmarks and tests)
    _p,
    declare,
    is_initialized,
    join_job,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    step_count,
)
from .process_sets import _check_init_sets
from .sync_batch_norm import SyncBatchNorm

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
           "push_pull", "push_pull_async", "push_pull_inplace", "push_pull_async_inplace",
           "poll", "synchronize", "declare", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object", "Compression", "EngineCompressor", "DistributedOptimizer",
           "DistributedDataParallel", "EngineError", "add_membership_callback", "step_count",
           "elastic", *mpi_ops.__all__, "SyncBatchNorm"]


def init(config: Config | None = None, process_sets: Any = None, *, comm: Any = None) -> None:
    """Join the job (default: from the environment, as set by ``bpsctl run``). Idempotent.

    Horovod's ``init(comm=None, process_sets=None)`` is accepted too: ``comm`` (first, or by
    name) as a list of ranks must cover every rank of the job (see
    :class:`~bpsctl.engine.torch.mpi_ops.ProcessSetUnsupported`); each of ``process_sets``
    is added as ``add_process_set`` adds it (collective: the same list on every rank), and
    ``process_sets="dynamic"`` is accepted (sets are always dynamic here)."""
    if config is not None and not isinstance(config, Config):
        config, comm = None, config         # Horovod's positional comm
    join_job(config)
    if comm is not None or process_sets is not None:
        _check_init_sets(comm, process_sets)
