"""The torch plugin's state in this worker process: the job it joined (:func:`join_job`,
:func:`shutdown`), who it is in it (:func:`rank`, :func:`size`, ...), and the push_pulls it has
in flight. One :class:`_Plugin` per process; every other module of the plugin reaches it
through :func:`_p`."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from typing import Any

import torch

from ... import engine as _engine
from ...config import Config
from .. import protocol as P
from ..common import EngineError, keep_large_buffers
from ..intranode import LocalOp, LocalStage
from .compression import CompressionArg
from .pinning import CudaPinning
from .staging import StagedOp, Stager


class _Op:
    """One push_pull from the plugin's side: what to give back, and how."""

    __slots__ = ("name", "output", "wire_out", "ctx", "compression", "wait", "done", "device_out",
                 "keep", "local", "staged")

    def __init__(self, name: str, output: torch.Tensor, wire_out: torch.Tensor, ctx: Any,
                 compression: CompressionArg):
        self.name, self.output, self.wire_out = name, output, wire_out
        self.ctx, self.compression = ctx, compression
        self.wait: Any = None           # callable(timeout_s) that raises on failure
        self.done: Any = None           # callable() -> bool
        self.device_out: torch.Tensor | None = None
        self.keep: Any = None           # inputs that must outlive the transfer
        self.local: LocalOp | None = None   # CUDA through the stage's NCCL path
        self.staged: StagedOp | None = None  # CUDA through host memory (staging.py)


class _Plugin:
    def __init__(self, config: Config | None):
        _engine.init(config)
        self.worker = _engine._w()
        self.config = self.worker.config
        self.ops: dict[int, Any] = {}    # handle -> _Op, or ops._Composite
        self.handles = itertools.count(1)
        self.noname = itertools.count()
        self.lock = threading.Lock()
        self.stage: LocalStage | None = None
        self.announced = False          # the path of CUDA tensors, said once (rank 0)
        self.membership_seen = 0                # worker.membership_changes already told
        # what a rejoining worker receives (see bpsctl.engine.torch, "Rejoining")
        self.steps = 0                          # optimizer steps this model has taken
        self.objects = 0                        # broadcast_object calls: each names its tensors
        self.shared: dict[str, torch.Tensor] = {}           # from broadcast_parameters
        self.optimizers: list[torch.optim.Optimizer] = []   # every DistributedOptimizer
        self.elastic: Any = None                # an elastic State: it hands over the model
        self.received: dict[str, Any] | None = None     # a rejoining worker's state, unpacked
        self.unloaded: set[int] = set()         # optimizers whose received state is not in
        self.stager: Stager | None = None           # CUDA through host memory, from the first
        self.copy_streams: dict[tuple[int, str], Any] = {}  # (device, direction) -> stream
        self.pinned: dict[str, torch.Tensor] = {}
        self.pinning: CudaPinning | None = None     # the engine's shared memory, for CUDA
        w, cfg = self.worker, self.config
        if cfg.reuse_memory:
            # autograd allocates every gradient anew each step; a big one (VGG16's fc6: 411 MB)
            # would otherwise be a fresh mapping, page-faulted in during backward every step
            keep_large_buffers()
        # the intra-node stage (shared memory or a gloo group of the host's workers) cannot
        # lose one, gain one, and waits for its slowest: with BPSCTL_MIN_WORKERS below the
        # world size, room to grow (BPSCTL_MAX_WORKERS), backup workers, staleness or
        # asynchronous training, every worker pushes on its own
        elastic = (0 < cfg.min_workers < w.size or cfg.max_workers > cfg.world_size
                   or cfg.backup_workers > 0 or cfg.staleness > 0 or cfg.async_mode)
        if (w.local_size > 1 and cfg.local_reduce == "auto" and w.size % w.local_size == 0
                and not elastic):
            if not cfg.master_port:
                raise EngineError("the intra-node stage needs a rendezvous port: MASTER_PORT is "
                                  "not set; launch with `bpsctl run`, or set "
                                  "BPSCTL_LOCAL_REDUCE=off")
            one_host = w.local_size == w.size
            if cfg.local_only == "on" and not (one_host and cfg.local_shm):
                raise EngineError("BPSCTL_LOCAL_ONLY=on needs every worker of the job on one "
                                  f"host (here {w.local_size} of {w.size} workers share it) and "
                                  "BPSCTL_LOCAL_SHM=1; set BPSCTL_LOCAL_ONLY=auto")
            self.stage = LocalStage(
                w, cfg.master_addr, cfg.master_port, cfg.op_timeout_s,
                shm_bytes=cfg.shm_bytes if cfg.local_shm else 0,
                local_only=cfg.local_only != "off" and cfg.local_shm and one_host,
                local_only_cuda=cfg.local_only != "off" and one_host,
                start_timeout_s=cfg.start_timeout_s)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.stage is not None:
            self.stage.close()
        _engine.shutdown()


_plugin: _Plugin | None = None


def join_job(config: Config | None) -> None:
    """Join the job described by ``config`` (default: the environment), once per process
    (:func:`bpsctl.engine.torch.init` is the public face)."""
    global _plugin
    if _plugin is None:
        _plugin = _Plugin(config)


def shutdown() -> None:
    """Leave the job. Parameter updates a ``CrossBarrier`` still has in flight finish first; an
    error of one that nothing has raised yet is raised once the engine is closed."""
    global _plugin
    if _plugin is not None:
        errors = [drain() for drain in (getattr(opt, "_drain", None) for opt in _plugin.optimizers)
                  if drain is not None]
        plugin, _plugin = _plugin, None
        plugin.close()
        for error in errors:
            if error is not None:
                raise error


def is_initialized() -> bool:
    """Whether :func:`~bpsctl.engine.torch.init` has joined a job (and no shutdown since)."""
    return _plugin is not None


def _p() -> _Plugin:
    if _plugin is None:
        raise EngineError("bpsctl is not initialized: call bpsctl.engine.torch.init() first")
    return _plugin


def size() -> int:
    """The number of workers in the job."""
    return _p().worker.size


def rank() -> int:
    """This worker's rank in the job (0 .. size() - 1)."""
    return _p().worker.rank


def local_size() -> int:
    """The number of the job's workers on this host."""
    return _p().worker.local_size


def local_rank() -> int:
    """This worker's rank among the workers on its host."""
    return _p().worker.local_rank


def step_count() -> int:
    """Optimizer steps (``DistributedOptimizer.step``) this model has taken in the job: 0 at
    the start; in a worker that rejoined, the count it received with the model (after
    ``broadcast_parameters``), so a script can resume its loop there."""
    return _p().steps


def _wire_dtype(dtype: torch.dtype) -> Any:
    """The NumPy dtype a tensor of ``dtype`` enters the engine as (bfloat16: the engine's)."""
    return P.BFLOAT16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def declare(name: str, shape: Iterable[int] | None = None,
            dtype: torch.dtype | None = None) -> None:
    """Declare a tensor ahead of its first push_pull. BytePS's ``declare(name)`` (no shape) is
    accepted and does nothing: bpsctl needs no declaration order."""
    plugin = _p()
    if shape is not None and dtype is not None and plugin.stage is None:
        plugin.worker.declare(name, tuple(shape), _wire_dtype(dtype))
