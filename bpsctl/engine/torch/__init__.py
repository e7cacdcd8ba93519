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

import contextlib
import io
import itertools
import pickle
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ... import engine as _engine
from ...config import Config
from .. import compression as C
from .. import paths
from .. import protocol as P
from ..collectives import HorovodInternalError, ReduceOp
from ..common import EngineError, JobFinished, keep_large_buffers
from ..intranode import LocalOp, LocalStage, _as_array
from ..shmlink import merge_runs
from ..trace import now_ns
from ..worker import Handle, Lease
from .pinning import CudaPinning, host_bytes
from .staging import Downstream, StagedOp, Stager
from .staleness import StaleGradients

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
           "push_pull", "push_pull_async", "push_pull_inplace", "push_pull_async_inplace",
           "poll", "synchronize", "declare", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object", "Compression", "EngineCompressor", "DistributedOptimizer",
           "DistributedDataParallel", "EngineError", "add_membership_callback", "step_count",
           "elastic"]


# --------------------------------------------------------------------------- compression

class Compressor:
    """Turns a tensor into what travels, and back (Horovod's interface)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    pass


def _cast_compressor(wire_dtype: torch.dtype) -> type[Compressor]:
    class CastCompressor(Compressor):
        """Floating-point tensors travel as ``wire_dtype``; others as they are."""

        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            if tensor.dtype.is_floating_point and tensor.dtype != wire_dtype:
                return tensor.to(wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
            return tensor if ctx is None else tensor.to(ctx)
    return CastCompressor


FP16Compressor = _cast_compressor(torch.float16)
BF16Compressor = _cast_compressor(torch.bfloat16)


class EngineCompressor(Compressor):
    """Compression done by the engine between machines (:mod:`bpsctl.engine.compression`):
    the tensor enters the engine as it is, workers compress each partition they push,
    servers decompress, sum and compress the sum again for the pull. Tensors smaller than
    ``BPSCTL_MIN_COMPRESS_BYTES`` and broadcasts travel uncompressed; the intra-node stage
    keeps full precision."""

    def __init__(self, engine: C.Compressor):
        self.engine = engine

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return tensor

    def __repr__(self) -> str:
        return f"Compression({self.engine})"


class Compression:
    """``none``, ``fp16`` (float16 on the wire), ``bf16`` (bfloat16, summed in float32), and
    the engine's compressors between machines, with error feedback (``ef``) by default:
    ``onebit(scaling=True)``, ``topk(ratio)``, ``randomk(ratio)``, ``dithering(levels)``."""

    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor] = FP16Compressor
    bf16: type[Compressor] = BF16Compressor

    @staticmethod
    def onebit(scaling: bool = True, ef: bool = True) -> EngineCompressor:
        """Signs, 8 to a byte, times mean |g| per partition (``scaling``), else ±1."""
        return EngineCompressor(C.OneBit(ef=ef, scaling=scaling))

    @staticmethod
    def topk(ratio: float, ef: bool = True) -> EngineCompressor:
        """The ``ratio`` of values of largest magnitude, with their indices."""
        return EngineCompressor(C.TopK(ratio=ratio, ef=ef))

    @staticmethod
    def randomk(ratio: float, ef: bool = True, seed: int = 0) -> EngineCompressor:
        """A ``ratio`` of values at random indices that every worker and server draw alike."""
        return EngineCompressor(C.RandomK(ratio=ratio, ef=ef, seed=seed))

    @staticmethod
    def dithering(levels: int, ef: bool = True, natural: bool = False,
                  norm: str = "max") -> EngineCompressor:
        """Stochastic rounding to ``levels`` magnitudes (linear, or powers of two with
        ``natural``) of the max or L2 ``norm``."""
        return EngineCompressor(C.Dithering(levels=levels, ef=ef, natural=natural, norm=norm))

    @staticmethod
    def from_spec(spec: str) -> CompressionArg:
        """The compression a CLI spec names (:func:`bpsctl.engine.compression.parse`, such as
        ``onebit:noef``): fp16 and bf16 as the plugin's casts (half the bytes, summed as they
        travel), the lossy kinds as the engine's, ``none`` or an empty spec as none."""
        if spec in ("fp16", "bf16"):
            return Compression.fp16 if spec == "fp16" else Compression.bf16
        engine = C.parse(spec) if spec else None
        return Compression.none if engine is None else EngineCompressor(engine)


#: what ``compression=`` takes: a class above (Horovod's interface) or an engine compressor
CompressionArg = type[Compressor] | Compressor


# --------------------------------------------------------------------------- state

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
        self.ops: dict[int, _Op | _Composite] = {}
        self.handles = itertools.count(1)
        self.noname = itertools.count()
        self.lock = threading.Lock()
        self.stage: LocalStage | None = None
        self.announced = False          # the path of CUDA tensors, said once (rank 0)
        self.membership_seen = 0                # worker.membership_changes already told
        # what a rejoining worker receives (see the module docstring)
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


def init(config: Config | None = None, process_sets: Any = None, *, comm: Any = None) -> None:
    """Join the job (default: from the environment, as set by ``bpsctl run``). Idempotent.

    Horovod's ``init(comm=None, process_sets=None)`` is accepted too: ``comm`` (first, or by
    name) as a list of ranks and ``process_sets`` must cover every rank of the job (see
    :class:`~bpsctl.engine.torch.mpi_ops.ProcessSetUnsupported`); ``process_sets="dynamic"``
    is accepted (``add_process_set`` then says what it can do)."""
    global _plugin
    if config is not None and not isinstance(config, Config):
        config, comm = None, config         # Horovod's positional comm
    if _plugin is None:
        _plugin = _Plugin(config)
    if comm is not None or process_sets is not None:
        from .process_sets import _check_init_sets  # (it imports this module)
        _check_init_sets(comm, process_sets)


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
    return _plugin is not None


def _p() -> _Plugin:
    if _plugin is None:
        raise EngineError("bpsctl is not initialized: call bpsctl.engine.torch.init() first")
    return _plugin


def size() -> int:
    return _p().worker.size


def rank() -> int:
    return _p().worker.rank


def local_size() -> int:
    return _p().worker.local_size


def local_rank() -> int:
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


# --------------------------------------------------------------------------- push_pull

def _pinned(plugin: _Plugin, key: str, like: torch.Tensor) -> torch.Tensor:
    buf = plugin.pinned.get(key)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = plugin.pinned[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return buf


def _contiguous_output(op: _Op, wire: torch.Tensor, source: torch.Tensor,
                       inplace: bool) -> torch.Tensor:
    """Make ``wire`` contiguous and choose ``op.wire_out`` (same device and dtype, contiguous):
    the caller's tensor itself for an in-place push_pull of a contiguous tensor, a private
    copy of the input when there is one, else a new tensor. Returns the (contiguous) input."""
    if not wire.is_contiguous():
        wire = wire.contiguous()
    if wire is source and inplace:
        op.wire_out = wire                          # the result is written in place
    elif wire is source or wire.data_ptr() == source.data_ptr():
        op.wire_out = torch.empty_like(wire)
    else:
        op.wire_out = wire                          # a private copy: reuse it for the result
    return wire


def _copy_stream(plugin: _Plugin, device: torch.device, direction: str) -> Any:
    """The device's side stream for copies to the host (``d2h``) or back (``h2d``): each
    direction has its own, so results come back while gradients still go out."""
    key = (device.index, direction)
    stream = plugin.copy_streams.get(key)
    if stream is None:
        stream = plugin.copy_streams[key] = torch.cuda.Stream(device=device)
    return stream


class _Direct:
    """A CUDA tensor's push_pull straight between the GPU and the engine's shared memory with
    the servers on this host (see :func:`_stage_through_host`): the slots lent, the handle."""

    __slots__ = ("pinning", "lease", "handle")

    def __init__(self, pinning: CudaPinning):
        self.pinning = pinning
        self.lease: Lease | None = None
        self.handle: Handle | None = None


def _pinning(plugin: _Plugin, device: torch.device) -> CudaPinning:
    """The plugin's page-locking of the engine's shared memory, handed to the engine on first
    use (nothing is pinned for a job that never stages a CUDA tensor)."""
    if plugin.pinning is None:
        plugin.pinning = CudaPinning(device)
        plugin.worker.pin_shared_memory(plugin.pinning)
    return plugin.pinning


def _results_to_device(device_out: torch.Tensor, host_out: torch.Tensor,
                       lent: list[tuple[int, Any, int | None]]) -> None:
    """Queue the copies of a push_pull's result to ``device_out``: each lent partition from
    where its sum is in shared memory (divided on the GPU when averaging), the rest from
    ``host_out``, where the engine put it."""
    out_bytes = device_out.view(-1).view(torch.uint8)
    host = host_out.view(-1).view(torch.uint8)
    flat, itemsize = device_out.view(-1), device_out.element_size()
    at = 0
    for offset, view, divisor in sorted(lent, key=lambda entry: entry[0]):
        if offset > at:
            out_bytes[at:offset].copy_(host[at:offset], non_blocking=True)
        end = offset + len(view)
        out_bytes[offset:end].copy_(host_bytes(view), non_blocking=True)
        if divisor is not None:
            flat[offset // itemsize:end // itemsize].div_(divisor)
        at = end
    if at < len(out_bytes):
        out_bytes[at:].copy_(host[at:], non_blocking=True)


def _stage_through_host(plugin: _Plugin, op: _Op, name: str, tensor: torch.Tensor,
                        device_out: torch.Tensor,
                        start: Callable[[torch.Tensor, torch.Tensor, _Direct | None], Downstream],
                        direct: bool) -> None:
    """Stage a CUDA ``tensor`` through host memory without waiting here (see :mod:`.staging`):
    after the work the caller's stream has queued so far, it is copied to the host on the
    device's outbound copy stream, ``start(host_in, host_out, direct)`` starts its push_pull,
    and the result is copied into ``device_out`` on the inbound copy stream as soon as it is
    in; :func:`synchronize` makes the caller's stream wait for that copy.

    ``direct`` (the engine's own servers, uncompressed): from the name's second push on, the
    GPU copies each partition straight into its push slot in shared memory (``Worker.lend``)
    and each sum straight back from where it arrived (``lend_results``), both page-locked
    (:mod:`.pinning`); otherwise, and for what went over TCP, through the name's pinned
    buffers ``host_in`` and ``host_out``."""
    device = tensor.device
    host_in = _pinned(plugin, name + "/in", tensor)
    host_out = _pinned(plugin, name + "/out", tensor)
    outbound, inbound = _copy_stream(plugin, device, "d2h"), _copy_stream(plugin, device, "h2d")
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    # the caching allocator must not hand these to others while the side streams use them
    tensor.record_stream(outbound)
    device_out.record_stream(inbound)
    lending = _Direct(_pinning(plugin, device)) if direct else None

    def to_host() -> None:
        lease = None
        if lending is not None:
            lease = lending.lease = plugin.worker.lend(name, tensor.nbytes)
        with (lending.pinning.lock if lending is not None and lease is not None
              else contextlib.nullcontext()), \
                torch.cuda.device(device), torch.cuda.stream(outbound):
            outbound.wait_event(ready)
            if lease is None:
                host_in.copy_(tensor, non_blocking=True)
            else:
                source = tensor.view(-1).view(torch.uint8)
                # one copy per run of consecutive slots, not one per partition
                for offset, view in lease.runs():
                    host_bytes(view).copy_(source[offset:offset + len(view)], non_blocking=True)
            copied = torch.cuda.Event(blocking=True)        # the wait below sleeps
            copied.record(outbound)
        copied.synchronize()

    def to_device() -> Any:
        lent = lending.handle.lent if lending is not None and lending.handle else []
        with (lending.pinning.lock if lending is not None and lent
              else contextlib.nullcontext()), \
                torch.cuda.device(device), torch.cuda.stream(inbound):
            if lent:
                _results_to_device(device_out, host_out, merge_runs(lent))
            else:
                device_out.copy_(host_out, non_blocking=True)
            back = torch.cuda.Event(blocking=True)
            back.record(inbound)
        back.synchronize()      # done: the result is on the GPU, its host memory free again
        return back

    if plugin.stager is None:
        plugin.stager = Stager(plugin.config.op_timeout_s, record=plugin.worker.trace_span)
    staged = plugin.stager.submit(StagedOp(name, to_host,
                                           lambda: start(host_in, host_out, lending),
                                           to_device))
    op.staged, op.device_out, op.wire_out = staged, device_out, host_out
    op.keep = (tensor, host_in)
    op.wait, op.done = staged.wait, staged.done.is_set


def _start(tensor: torch.Tensor, average: bool, name: str | None, priority: int,
           compression: CompressionArg, inplace: bool, once: bool = False) -> int:
    """Start a push_pull (``once``: a broadcast's, see Worker.push_pull_async)."""
    plugin = _p()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull expects a torch.Tensor, got {type(tensor).__name__}")
    if name is None:
        name = f"push_pull.noname.{next(plugin.noname)}"
    source = tensor.detach()
    engine = compression.engine if isinstance(compression, EngineCompressor) else None
    if engine is not None and (not source.dtype.is_floating_point
                               or source.dtype == torch.bfloat16):
        raise ValueError(f"compression: {engine.spec()} needs a float16, float32 or float64 "
                         f"tensor, got {source.dtype} for {name!r}; push it without compression"
                         + (" (or with Compression.bf16)" if source.dtype == torch.bfloat16
                            else ""))
    output = tensor if inplace else torch.empty_like(source)
    wire, ctx = compression.compress(source)
    if wire.dtype != source.dtype:
        # a name is bound to one dtype in the engine: the compressed form gets its own
        name = f"{name}:{str(wire.dtype).replace('torch.', '')}"
    elif engine is not None:
        name = f"{name}:{engine.spec()}"        # likewise: servers sum it another way
    if plugin.worker.solo:
        plugin.worker.check_push(_wire_dtype(source.dtype), average, name)
        return _solo(plugin, name, source, output)
    op = _Op(name, output, wire, ctx, compression)
    stage = plugin.stage
    nccl = wire.is_cuda and stage is not None and stage.cuda_path(wire.device)
    if wire.is_cuda and not plugin.announced:
        _announce(plugin, cuda=True)
    if nccl:
        assert stage is not None
        # reduce-scatter / all-gather with NCCL on the GPU; only the owned chunk is staged
        # through pinned host memory (intranode); the stage starts after the caller's stream
        # has produced the tensor, and synchronize makes it wait for the result
        wire = _contiguous_output(op, wire, source, inplace)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(wire.device))
        local = stage.submit(LocalOp(name, wire, op.wire_out, average, priority,
                                     ready=ready, compression=engine, once=once))
        op.wait, op.done, op.local = local.wait, local.done.is_set, local
        op.keep = wire
        return _track(plugin, op)

    def start(host_in: torch.Tensor, host_out: torch.Tensor,
              direct: _Direct | None = None) -> Downstream:
        """Start the push_pull of host tensors: through the host's stage, or the engine
        (``direct``: see _stage_through_host)."""
        if stage is not None:
            return _submit_local(stage, LocalOp(name, host_in, host_out, average, priority,
                                                compression=engine, once=once))
        handle = plugin.worker.push_pull_async(
            _as_array(host_in), name=name, average=average, priority=priority,
            out=_as_array(host_out), compression=engine, once=once,
            filled=None if direct is None else direct.lease, lend_results=direct is not None)
        if direct is not None:
            direct.handle = handle
        return handle.wait, handle.done

    wire = _contiguous_output(op, wire, source, inplace)
    if wire.is_cuda:
        plugin.worker.check_push(_wire_dtype(wire.dtype), average, name)
        _stage_through_host(plugin, op, name, wire, op.wire_out, start,
                            direct=stage is None and engine is None)
    elif stage is not None and plugin.stager is not None:
        # behind the CUDA tensors still on their way to the stage: every local rank must
        # submit to it in the order of the calls
        host, out = wire, op.wire_out
        op.staged = plugin.stager.submit(StagedOp(name, lambda: None, lambda: start(host, out),
                                                  lambda: None))
        op.keep = wire
        op.wait, op.done = op.staged.wait, op.staged.done.is_set
    else:
        op.keep = (op.keep, wire)
        op.wait, op.done = start(wire, op.wire_out)
    return _track(plugin, op)


def _submit_local(stage: LocalStage, op: LocalOp) -> Downstream:
    """Hand ``op`` to the intra-node stage; how to wait for it."""
    local = stage.submit(op)
    return local.wait, local.done.is_set


def _solo(plugin: _Plugin, name: str, source: torch.Tensor, output: torch.Tensor) -> int:
    """A push_pull of a job of one worker: the sum and the average are the tensor itself, on
    its own device; nothing is copied to the host, compressed or sent. The name is still
    bound to its first dtype and shape, as in any job."""
    if source.is_cuda and not plugin.announced:
        _announce(plugin, cuda=True)
    error = plugin.worker.check_solo_binding(name, str(source.dtype), list(source.shape))
    if error is None and output.data_ptr() != source.data_ptr():
        output.detach().copy_(source)
    op = _Op(name, output, output, None, Compression.none)

    def wait(timeout_s: float) -> None:
        if error is not None:
            raise error
    op.wait, op.done = wait, lambda: True
    return _track(plugin, op)


def gradient_path(cuda: bool) -> str:
    """How this job's gradients travel (a name of :data:`bpsctl.engine.paths.GRADIENT_PATHS`)
    for tensors on CUDA (``cuda``) or on the host. For CUDA tensors of a job whose workers
    share hosts, known once the first one was pushed (before that: as the start-time checks
    leave it)."""
    plugin = _p()
    stage = plugin.stage
    decision = None if stage is None else stage.cuda_decision
    return paths.gradient_path(
        solo=plugin.worker.solo, cuda=cuda, stage=stage is not None,
        nccl=decision is not None and decision[0],
        local_only=stage is not None and (stage.local_only_cuda if cuda else stage.local_only))


def _announce(plugin: _Plugin, cuda: bool) -> None:
    """Say once, on rank 0, which way CUDA tensors go and why (the first lines of a GPU
    job's output)."""
    plugin.announced = True
    if plugin.worker.rank != 0:
        return
    path = gradient_path(cuda)
    why = {"none": "BPSCTL_FORCE_DISTRIBUTED=1 sends through the servers anyway"}.get(path, "")
    stage = plugin.stage
    if stage is not None and stage.cuda_decision is not None:
        why = stage.cuda_decision[1]
    elif stage is None and path == "host-staged":
        why = "one worker per host: no intra-node stage"
    print(f"bpsctl: CUDA tensors: {path} ({paths.GRADIENT_PATHS[path]})"
          + (f"; {why}" if why else ""), file=sys.stderr, flush=True)


def _track(plugin: _Plugin, op: _Op, handle: Any = None) -> int:
    """The plugin's handle of ``op``, for :func:`poll` and :func:`synchronize`; ``handle``:
    the engine's, when the op waits on one push_pull of the engine."""
    if handle is not None:
        op.wait = lambda timeout_s: handle.wait(timeout_s)
        op.done = handle.done
    with plugin.lock:
        number = next(plugin.handles)
        plugin.ops[number] = op
    return number


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                    priority: int = 0, compression: CompressionArg = Compression.none) -> int:
    """Start summing (or averaging) ``tensor`` across workers; returns a handle for ``poll`` and
    ``synchronize``, which returns a new tensor. Larger ``priority`` goes first."""
    return _start(tensor, average, name, priority, compression, inplace=False)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                            priority: int = 0,
                            compression: CompressionArg = Compression.none) -> int:
    """As :func:`push_pull_async`, but the result is written into ``tensor``."""
    return _start(tensor, average, name, priority, compression, inplace=True)


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None,
              priority: int = 0, compression: CompressionArg = Compression.none) -> torch.Tensor:
    """Sum (or average) ``tensor`` across workers; returns a new tensor."""
    return synchronize(push_pull_async(tensor, average, name, priority, compression))


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      priority: int = 0,
                      compression: CompressionArg = Compression.none) -> torch.Tensor:
    """Sum (or average) ``tensor`` across workers in place; returns ``tensor``."""
    return synchronize(push_pull_async_inplace(tensor, average, name, priority, compression))


class _Composite:
    """A handle whose result is made from other handles' results: a collective of several
    push_pulls, or one followed by work of its own (:mod:`.mpi_ops`)."""

    __slots__ = ("handles", "finish")

    def __init__(self, handles: list[int], finish: Callable[[list[Any]], Any]):
        self.handles, self.finish = handles, finish

    def done(self) -> bool:
        ops = _p().ops
        return all(ops[h].done() for h in self.handles if h in ops)

    def result(self) -> Any:
        """Wait for every part (each within its deadline, even after one failed, so none is
        left in flight), then finish."""
        results, error = [], None
        for handle in self.handles:
            try:
                results.append(_finish(handle))
            except BaseException as exc:        # noqa: BLE001 (raised below, once all are in)
                error = error or exc
        if error is not None:
            raise error
        return self.finish(results)


def _track_composite(handles: list[int], finish: Callable[[list[Any]], Any]) -> int:
    """A handle for :func:`synchronize` that returns ``finish(results of handles)``."""
    plugin = _p()
    with plugin.lock:
        number = next(plugin.handles)
        plugin.ops[number] = _Composite(handles, finish)
    return number


def poll(handle: int) -> bool:
    """True once the push_pull behind ``handle`` has finished (``synchronize`` will not block)."""
    op = _p().ops.get(handle)
    if op is None:
        raise ValueError(f"unknown push_pull handle {handle!r} (already synchronized?)")
    return op.done()


def synchronize(handle: int) -> Any:
    """Wait for the push_pull (or collective) behind ``handle``; return its output tensor (a
    collective's result). An engine failure is raised as
    :class:`~bpsctl.engine.collectives.HorovodInternalError` (an EngineError), as Horovod's."""
    try:
        output = _finish(handle)
    except HorovodInternalError:
        raise
    except EngineError as exc:
        raise HorovodInternalError(str(exc)) from exc
    _tell_membership(_p())
    return output


def _finish(handle: int) -> Any:
    """:func:`synchronize` without telling membership callbacks: the cross-barrier's update
    thread finishes its push_pulls here, and callbacks run on the caller's thread."""
    plugin = _p()
    with plugin.lock:
        op = plugin.ops.pop(handle, None)
    if op is None:
        raise ValueError(f"unknown push_pull handle {handle!r} (already synchronized?)")
    if isinstance(op, _Composite):
        return op.result()
    op.wait(plugin.config.op_timeout_s + 10)
    if op.local is not None and op.local.finished is not None:
        # CUDA through NCCL: the caller's stream waits for the stage's last GPU work
        torch.cuda.current_stream(op.wire_out.device).wait_event(op.local.finished)
    if op.staged is not None and op.device_out is not None:
        # CUDA through host memory: the copy back was queued as the result came in
        torch.cuda.current_stream(op.device_out.device).wait_event(op.staged.finished)
        result = op.compression.decompress(op.device_out, op.ctx)
    else:
        result = op.compression.decompress(op.wire_out, op.ctx)
    if result.data_ptr() != op.output.data_ptr():
        op.output.detach().copy_(result.reshape(op.output.shape))
    return op.output


_membership_callbacks: list[Callable[[list[int]], None]] = []


def add_membership_callback(callback: Callable[[list[int]], None]) -> None:
    """Call ``callback(live_ranks)`` when the job goes on without a lost worker
    (``bpsctl run --min-workers``) or a worker joins it (``--max-restarts``, ``--attach``),
    on the caller's thread, at the next ``synchronize`` (an optimizer step synchronizes): for
    example to re-shard the data over ``size()`` workers."""
    _membership_callbacks.append(callback)


def _tell_membership(plugin: Any) -> None:
    worker = plugin.worker
    if worker.membership_changes != plugin.membership_seen:
        plugin.membership_seen = worker.membership_changes
        for callback in list(_membership_callbacks):
            callback(list(worker.live_ranks))


# --------------------------------------------------------------------------- broadcast

def _broadcast_tensors(named: list[tuple[str, torch.Tensor]], root_rank: int, prefix: str) -> None:
    """Broadcast by summation: every rank but the root contributes zeros (as BytePS does)."""
    handles = []
    with torch.no_grad():
        for name, tensor in named:
            if rank() != root_rank:
                tensor.zero_()
            handles.append(_start(tensor, False, f"{prefix}.{name}", 0, Compression.none,
                                  inplace=True, once=True))
    for handle in handles:
        synchronize(handle)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy ``params`` (a ``state_dict()`` or ``named_parameters()``) from ``root_rank`` to all.
    In a rejoining worker: copy them from the state a live worker hands it instead."""
    if isinstance(params, dict):
        named = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        named = list(params)
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: expected a dict "
                         "(state_dict) or (name, tensor) pairs (named_parameters)")
    tensors = []
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"parameter {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.dtype == torch.bool:
            raise TypeError(f"parameter {name!r}: bool tensors cannot be broadcast; "
                            "use broadcast_object")
        tensors.append((name, tensor))
    _check_root(root_rank)
    plugin = _p()
    plugin.shared.update(tensors)
    received = _received_state(plugin)
    if received is None:
        _broadcast_tensors(tensors, root_rank, "Parameter")
        return
    missing = [name for name, _ in tensors if name not in received["params"]]
    if missing:
        raise EngineError(f"rejoining: the live worker's model has no {missing[:3]} (workers run "
                          "different scripts?)")
    with torch.no_grad():
        for name, tensor in tensors:
            tensor.copy_(received["params"][name])


def _received_state(plugin: _Plugin) -> dict[str, Any] | None:
    """A rejoining worker's state from a live worker (waiting for it once), else None."""
    if plugin.received is None and plugin.worker.joined_running:   # restarted, or attached
        try:
            payload = plugin.worker.receive_state()
        except JobFinished as finished:
            _engine.nothing_to_do(finished)
        plugin.received = torch.load(io.BytesIO(payload), weights_only=False)
        plugin.steps = plugin.received["steps"]
        # the next broadcast_object pushes under the name the live workers' next one does
        plugin.objects = plugin.received["objects"]
        plugin.unloaded = set(range(len(plugin.received["optimizers"])))
    return plugin.received


def _pack_state(plugin: _Plugin, elastic: Any = None) -> memoryview:
    """What a rejoining worker starts from (see the module docstring)."""
    buffer = io.BytesIO()
    torch.save({"steps": plugin.steps, "objects": plugin.objects, "params": plugin.shared,
                "optimizers": [opt.state_dict() for opt in plugin.optimizers],
                "elastic": elastic}, buffer)
    return buffer.getbuffer()           # sent without another copy


def _donate(plugin: _Plugin, elastic: Any = None) -> None:
    """At a step boundary: hand the state to every worker waiting to rejoin."""
    worker = plugin.worker
    if worker.pending_joins:
        state = _pack_state(plugin, elastic)
        for rank_, incarnation in list(worker.pending_joins):
            worker.donate(rank_, incarnation, state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Return ``obj`` from ``root_rank`` on every rank (pickled; all ranks must call it).
    ``process_set``: Horovod's, the global one only."""
    if process_set is not None:
        from .process_sets import _check_set  # (it imports this module)
        _check_set(process_set, "broadcast_object")
    _check_root(root_rank)
    plugin = _p()
    key = f"broadcast_object.{name or 'object'}.{plugin.objects}"
    plugin.objects += 1
    me = rank() == root_rank
    data = pickle.dumps(obj) if me else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    _broadcast_tensors([("length", length)], root_rank, key)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8)
    if me:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    _broadcast_tensors([("data", payload)], root_rank, key)
    return obj if me else pickle.loads(payload.numpy().tobytes())


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Copy ``optimizer``'s state (and hyper-parameters) from ``root_rank`` to all ranks. In a
    rejoining worker nothing happens here: a DistributedOptimizer's first ``step()`` loads the
    state the live worker handed over. ``model`` (Horovod's, to find sparse parameters) is
    not needed: the whole state travels pickled."""
    del model
    if _received_state(_p()) is not None:
        return
    buffer = io.BytesIO()
    if rank() == root_rank:
        torch.save(optimizer.state_dict(), buffer)
    state = broadcast_object(buffer.getvalue(), root_rank, name="optimizer_state")
    if rank() != root_rank:
        optimizer.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job (0..{size() - 1})")


# --------------------------------------------------------------------------- gradients

class _Bucket:
    """Gradients pushed as one tensor: one parameter's own gradient (no copy), or several small
    ones consecutive in backward order, packed into a flat buffer allocated once."""

    __slots__ = ("params", "name", "priority", "flat", "views", "ready", "handle")

    def __init__(self, params: list[torch.nn.Parameter], name: str, priority: int):
        self.params, self.name, self.priority = params, name, priority
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []    # flat's slice of each member, in its shape
        self.ready = 0                      # members whose gradient is final for this step
        self.handle: int | None = None


def _member_views(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """``flat``'s slice of each of ``params`` (packed in order), shaped like it."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i in one call (on a GPU, a few kernel launches
    rather than one per tensor: a bucket's members are many and small, and the optimizer's
    step waits for their launches)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:         # an older torch
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    else:
        foreach(dst, src)


def _buckets(params: list[torch.nn.Parameter], names: dict, fusion_bytes: int,
             prefix: str, group_of: dict | None = None,
             cuda_fusion_bytes: int | None = None) -> list[_Bucket]:
    """Group ``params`` (in registration order) for pushing. Backward produces gradients roughly
    in reverse order, so runs of small gradients adjacent in that order share a bucket of at most
    ``fusion_bytes`` (``cuda_fusion_bytes`` for parameters on a GPU, if given); a gradient of
    that size or more travels alone. Every worker derives
    the same buckets from the same model, so the names agree across workers. Priorities follow
    layer order (the first parameter highest): the next forward pass needs the first layers
    first, and the engine sends larger priority first. With ``group_of`` (parameter -> its
    param group) a bucket holds one group's parameters only."""
    index = {p: i for i, p in enumerate(params)}
    buckets: list[_Bucket] = []
    run: list[torch.nn.Parameter] = []
    run_bytes = 0

    def close_run() -> None:
        nonlocal run_bytes
        run_bytes = 0
        if len(run) == 1:
            buckets.append(_Bucket(list(run), names[run[0]], -index[run[0]]))
        elif run:
            buckets.append(_Bucket(list(run), f"{prefix}.fused.{len(buckets)}",
                                   -min(index[p] for p in run)))
        run.clear()

    for p in reversed(params):
        size = p.numel() * p.element_size()
        limit = cuda_fusion_bytes if p.is_cuda and cuda_fusion_bytes is not None \
            else fusion_bytes
        fits = (run and p.dtype == run[0].dtype and p.device == run[0].device
                and run_bytes + size <= limit
                and (group_of is None or group_of[p] == group_of[run[0]]))
        if not fits:
            close_run()
        run.append(p)
        run_bytes += size
        if size >= limit:
            close_run()
    close_run()
    return buckets


class _GradientSync:
    """Hooks that push gradients as soon as autograd has accumulated them: a bucket goes when
    the last of its gradients is ready (see :func:`_buckets`).

    ``solo`` (a job of one worker, whose averages are the gradients themselves): no hooks at
    all, so that backward runs as in plain torch; the first :meth:`synchronize` pushes every
    bucket once, which binds each name to its dtype and shape as in any job, and later ones
    only end the step."""

    def __init__(self, named_parameters: list[tuple[str, torch.nn.Parameter]], prefix: str,
                 compression: CompressionArg, passes_per_step: int,
                 before_first_push: Callable[[], None] | None = None,
                 group_of: dict | None = None, solo: bool = False, average: bool = True,
                 predivide: float = 1.0, sparse_as_dense: bool = False):
        if passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step: expected at least 1, "
                             f"got {passes_per_step}")
        names = [name for name, _ in named_parameters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names: {duplicates}")
        self.prefix = prefix
        self.params = [p for _, p in named_parameters if p.requires_grad]
        full_names = {p: f"{prefix}.{name}" for name, p in named_parameters}
        config = _p().config
        self.buckets = _buckets(self.params, full_names, config.fusion_bytes, prefix,
                                group_of, config.cuda_fusion_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.compression = compression
        # Horovod's op=Sum (average=False), gradient_predivide_factor (gradients divided by it
        # before the sum, multiplied by it after the average: the same average, summed in a
        # range that overflows less) and sparse_as_dense
        self.average, self.predivide = average, predivide
        self.sparse_as_dense = sparse_as_dense
        self.densified: set[torch.nn.Parameter] = set()     # sparse gradients pushed dense
        self.passes_per_step = passes_per_step
        self.delay = {p: passes_per_step for p in self.params}
        self.handles: dict[_Bucket, int] = {}
        self.enabled = True
        self.before_first_push = before_first_push
        self.solo, self.checked = solo, False
        self.hooks = [] if solo else [p.register_post_accumulate_grad_hook(self._hook)
                                      for p in self.params]
        self.stale: StaleGradients | None = None    # bounded staleness: pushes from slots
        # when this step's first and last bucket were ready (the backward span of a trace)
        self.first_ready_ns = self.last_ready_ns = 0

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        if self.delay[p] == 0:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before "
                "step() or synchronize(); increase backward_passes_per_step to accumulate "
                "gradients locally")
        self.delay[p] -= 1
        if self.delay[p] == 0:
            bucket = self.bucket_of[p]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self.last_ready_ns = now_ns()
                if not self.handles:
                    self.first_ready_ns = self.last_ready_ns
                    if self.before_first_push is not None:
                        self.before_first_push()
                self._push(bucket)

    def _push(self, bucket: _Bucket) -> None:
        name, into = bucket.name, None
        if self.stale is not None:
            # this step's slot: the gradients stay there while s more steps run
            into, name = self.stale.slot_tensor(bucket)
        tensor = self.gradient(bucket, into)
        if self.predivide != 1.0:
            tensor.div_(self.predivide)             # the push_pull overwrites it anyway
        self.handles[bucket] = push_pull_async_inplace(tensor, average=self.average, name=name,
                                                       priority=bucket.priority,
                                                       compression=self.compression)

    def grads(self, bucket: _Bucket) -> list[torch.Tensor]:
        """The bucket's members' gradients (a missing one becomes zeros; a sparse one dense,
        with ``sparse_as_dense``, made sparse again after the push_pull)."""
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"{self.prefix}: the gradient of a parameter of shape "
                                     f"{tuple(p.shape)} is sparse; pass sparse_as_dense=True to "
                                     "DistributedOptimizer (it is pushed dense and made sparse "
                                     "again), or make the layer dense (sparse=False)")
                p.grad = p.grad.to_dense()
                self.densified.add(p)
            grads.append(p.grad)
        return grads

    def gradient(self, bucket: _Bucket, into: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's gradient as one tensor: a lone parameter's own, or its members'
        packed into the bucket's flat buffer; with ``into``, packed there (even a lone one)."""
        grads = self.grads(bucket)
        if into is None:
            if len(grads) == 1:
                return grads[0]
            if bucket.flat is None:
                first = bucket.params[0]
                bucket.flat = torch.empty(sum(p.numel() for p in bucket.params),
                                          dtype=first.dtype, device=first.device)
                bucket.views = _member_views(bucket.flat, bucket.params)
            into = bucket.flat
        torch.cat([g.reshape(-1) for g in grads], out=into)
        return into

    def synchronize(self, end_of_step: bool = True) -> None:
        """Wait for every bucket's push_pull; ``end_of_step``: the step ends here (no
        optimizer update follows that would end it)."""
        if self.solo and self.checked:
            if end_of_step:
                _engine._w().mark_step()
            return
        self.checked = True
        started_ns = now_ns()
        for bucket, handle in self.take_handles():
            synchronize(handle)
            self.unpack(bucket)
            self.rescale(bucket)
        # the wait for the averaged gradients, on the worker's timeline
        worker = _engine._w()
        worker.trace_span("synchronize", self.prefix, started_ns, now_ns())
        if end_of_step:
            worker.mark_step()

    def take_handles(self) -> list[tuple[_Bucket, int]]:
        """End the step's pushes: push every bucket not pushed yet, then hand over each
        bucket's handle (highest priority first) and reset the counts for the next step."""
        # buckets not pushed yet (a parameter unused this step, or fewer backward passes than
        # backward_passes_per_step) still take part, so every worker pushes the same tensors
        for bucket in self.buckets:
            if bucket not in self.handles:
                self._push(bucket)
        taken = sorted(self.handles.items(), key=lambda item: -item[0].priority)
        for bucket in self.buckets:
            bucket.ready = 0
        for p in self.params:
            self.delay[p] = self.passes_per_step
        self.handles.clear()
        # the backward pass (first to last gradient ready), on the worker's timeline
        if self.first_ready_ns:
            _engine._w().trace_span("backward", self.prefix, self.first_ready_ns,
                                    self.last_ready_ns)
            self.first_ready_ns = 0
        return taken

    def rescale(self, bucket: _Bucket) -> None:
        """After the bucket's push_pull is unpacked: undo the predivision, make densified
        gradients sparse again."""
        if self.predivide == 1.0 and not self.densified:
            return
        for p in bucket.params:
            if p.grad is None:
                continue
            if self.predivide != 1.0:
                p.grad.mul_(self.predivide)
            if p in self.densified:
                p.grad = p.grad.to_sparse()
                self.densified.discard(p)

    @staticmethod
    def unpack(bucket: _Bucket, flat: torch.Tensor | None = None) -> None:
        """After a fused bucket's push_pull: copy the averages back into its gradients (a lone
        gradient was averaged in place); ``flat``: from there instead of the bucket's buffer."""
        if flat is None:
            flat, views = bucket.flat, bucket.views
        else:
            views = _member_views(flat, bucket.params)
        if flat is not None:
            grads = []
            for p in bucket.params:
                if p.grad is None:          # set to None since the push (zero_grad)
                    p.grad = torch.empty_like(p)
                grads.append(p.grad)
            _copy_all(grads, views)


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's parameters with their names (``param.<i>`` when none are given)."""
    all_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"param.{i}", p) for i, p in enumerate(all_params)]
    unnamed = {id(p) for p in all_params} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError("named_parameters does not cover every parameter of the optimizer "
                         f"({len(unnamed)} missing); pass model.named_parameters()")
    return named


def _check_rejoined(plugin: _Plugin) -> None:
    if plugin.worker.joined_running and plugin.received is None:     # restarted, or attached
        raise EngineError("this worker rejoins a running job and receives the model in "
                          "broadcast_parameters(model.state_dict(), root_rank=0): call it "
                          "before the first step, as with Horovod")


def _load_received(plugin: _Plugin, optimizer: Any) -> None:
    """At a rejoined worker's first step: load the live worker's state of ``optimizer``."""
    if optimizer._index in plugin.unloaded:
        plugin.unloaded.discard(optimizer._index)
        assert plugin.received is not None
        optimizer.load_state_dict(plugin.received["optimizers"][optimizer._index])


def _end_step(plugin: _Plugin) -> None:
    """An optimizer step is over (no push_pull of it in flight): count it, and hand the state
    to any worker waiting to rejoin."""
    plugin.steps += 1
    if plugin.received is not None and plugin.received["params"] and not plugin.unloaded:
        plugin.received = {**plugin.received, "params": {}, "optimizers": []}   # memory
    _engine._w().mark_step()
    if plugin.elastic is None:          # an elastic State hands it over at commit()
        _donate(plugin)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 options: dict[str, Any] | None = None):
        # the class is rebuilt on the wrapped optimizer's class (DistributedOptimizer): this is
        # that optimizer's __init__, whose hyperparameters all have defaults
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        plugin = _p()
        named, prefix = _named(self, named_parameters), "DistributedOptimizer.grad"
        self._sync: _GradientSync
        if plugin.config.async_mode:        # the servers run this optimizer
            self._sync = _AsyncSync(named, prefix, self, backward_passes_per_step)
        else:
            # alone, the gradients are their own averages: no hooks, nothing per step
            # (staleness still delays the update by its s steps, so it keeps the full path)
            self._sync = _GradientSync(named, prefix, compression, backward_passes_per_step,
                                       solo=plugin.worker.solo and not plugin.config.staleness,
                                       **(options or {}))
            if plugin.config.staleness:
                self._sync.stale = StaleGradients(self._sync, plugin.config.staleness)
        self._should_synchronize = True
        self._synchronized = False
        self._update_due = True         # the gradients hold an average to apply
        self._index = len(plugin.optimizers)        # its state's place in a handed-over model
        plugin.optimizers.append(self)

    def synchronize(self) -> None:
        """Wait for every gradient's push_pull (pushing any that has not started). Under
        staleness (``BPSCTL_STALENESS=s``): push this step's, and wait for the averages of
        ``s`` steps ago, which the gradients then hold (none in the first ``s`` steps)."""
        if self._sync.stale is not None:
            self._update_due = self._sync.stale.end_step()
        else:
            self._sync.synchronize(end_of_step=False)   # step() ends it, after the update
        self._synchronized = True

    def flush(self) -> int:
        """Under staleness: apply the averaged gradients of every step still in flight, oldest
        first, one update each, so the model holds every step's gradients (call it after the
        last step, before evaluating or saving). Returns how many updates it applied (0
        without staleness)."""
        stale = self._sync.stale
        if stale is None:
            return 0
        return stale.flush(lambda: super(self.__class__, self).step())

    def _drain(self) -> BaseException | None:
        """At shutdown: wait for the rounds still in flight under staleness."""
        return None if self._sync.stale is None else self._sync.stale.drain()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        plugin = _p()
        _check_rejoined(plugin)
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        _load_received(plugin, self)
        if self._update_due:
            loss = super(self.__class__, self).step(closure)
        else:           # staleness: no averaged gradients yet in the first s steps
            loss = closure() if closure is not None else None
        _end_step(plugin)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._sync.handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


# --------------------------------------------------------------------------- asynchronous

#: what a push of asynchronous training carries besides the gradient (see Worker.push_pull_async)
Hyperparameters = tuple[float, float, float, float, bool]


def _start_async(source: torch.Tensor, output: torch.Tensor, name: str, priority: int, *,
                 update: Hyperparameters | None = None, init: bool = False) -> int:
    """A push of asynchronous training: ``source`` (a gradient with ``update``, the
    parameter values with ``init``) goes to the servers, and the parameters they answer with
    land in ``output`` (contiguous, same shape, dtype and device); a handle for
    :func:`synchronize`. CUDA tensors are staged through pinned host buffers, as push_pulls
    are."""
    plugin = _p()
    op = _Op(name, output, output, None, Compression.none)

    def start(host_in: torch.Tensor, host_out: torch.Tensor,
              direct: _Direct | None = None) -> Downstream:
        handle = plugin.worker.push_pull_async(
            _as_array(host_in), name=name, average=False, priority=priority,
            out=_as_array(host_out), async_update=update, async_init=init)
        return handle.wait, handle.done
    if source.is_cuda:
        _stage_through_host(plugin, op, name, source, output, start, direct=False)
        return _track(plugin, op)
    op.keep = source
    wait, done = start(source, output)
    op.wait, op.done = wait, done
    return _track(plugin, op)


class _AsyncSync(_GradientSync):
    """The gradient hooks under asynchronous training: each bucket (one param group's
    parameters only) pushes its gradient with the group's hyperparameters, and its push_pull
    answers with the servers' parameters, into the parameter itself (a lone, contiguous one)
    or the bucket's parameter buffer (``unpack_params`` copies them out)."""

    def __init__(self, named_parameters: list[tuple[str, torch.nn.Parameter]], prefix: str,
                 optimizer: torch.optim.Optimizer, passes_per_step: int):
        group_of = {p: i for i, group in enumerate(optimizer.param_groups)
                    for p in group["params"]}
        super().__init__(named_parameters, prefix, Compression.none, passes_per_step,
                         group_of=group_of)
        # its groups are looked up at each push: load_state_dict (broadcast_optimizer_state)
        # replaces them, and LR schedulers change them
        self.optimizer, self.group_of = optimizer, group_of
        self.initialised = False        # the buckets' init pushes are done (the first step)
        self.param_buffers: dict[_Bucket, torch.Tensor] = {}

    def _push(self, bucket: _Bucket) -> None:
        if self.initialised:        # the first step pushes its gradients after the init pushes
            self.handles[bucket] = _start_async(self.gradient(bucket), self.params_out(bucket),
                                                bucket.name, bucket.priority,
                                                update=self.hyperparameters(bucket))

    def hyperparameters(self, bucket: _Bucket) -> Hyperparameters:
        """The bucket's param group's SGD hyperparameters now (so LR schedules apply)."""
        group = self.optimizer.param_groups[self.group_of[bucket.params[0]]]
        return (float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]),
                float(group["dampening"]), bool(group["nesterov"]))

    def params_out(self, bucket: _Bucket) -> torch.Tensor:
        """Where the servers' parameters of ``bucket`` land."""
        first = bucket.params[0]
        if len(bucket.params) == 1 and first.is_contiguous():
            return first.detach()
        buffer = self.param_buffers.get(bucket)
        if buffer is None:
            buffer = self.param_buffers[bucket] = torch.empty(
                sum(p.numel() for p in bucket.params), dtype=first.dtype, device=first.device)
        return buffer

    def unpack_params(self, bucket: _Bucket) -> None:
        buffer = self.param_buffers.get(bucket)
        if buffer is not None:
            with torch.no_grad():
                _copy_all([p.detach() for p in bucket.params],
                          _member_views(buffer, bucket.params))

    def initialise(self) -> None:
        """Every bucket's init push: its parameter values; the servers answer with the first
        worker's (in practice equal: broadcast_parameters came first), copied in."""
        handles = []
        for bucket in self.buckets:
            out = self.params_out(bucket)
            if out.data_ptr() != bucket.params[0].data_ptr():
                torch.cat([p.detach().reshape(-1) for p in bucket.params], out=out)
            handles.append((bucket, _start_async(out, out, bucket.name, bucket.priority,
                                                 init=True)))
        for bucket, handle in handles:
            synchronize(handle)
            self.unpack_params(bucket)
        self.initialised = True


class _AsyncDistributedOptimizer(_DistributedOptimizer):
    """DistributedOptimizer under asynchronous training (see the module docstring); its
    ``__init__`` is DistributedOptimizer's, which gives it an :class:`_AsyncSync`."""

    def synchronize(self) -> None:
        raise EngineError("optimizer.synchronize() under asynchronous training (BPSCTL_ASYNC): "
                          "gradients go to the servers as backward computes them, and the "
                          "servers apply them; nothing can change them between synchronize() "
                          "and step() (gradient clipping included). Call step() alone")

    def step(self, closure=None):
        plugin = _p()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sync = self._sync
        assert isinstance(sync, _AsyncSync)
        started_ns = now_ns()
        if not sync.initialised:
            sync.initialise()
        for bucket, handle in sync.take_handles():      # pushes what the hooks did not
            synchronize(handle)
            sync.unpack_params(bucket)
        plugin.worker.trace_span("synchronize", sync.prefix, started_ns, now_ns())
        _end_step(plugin)
        return loss


def _check_async(optimizer: torch.optim.Optimizer, compression: CompressionArg) -> None:
    """What asynchronous training needs of DistributedOptimizer's arguments."""
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(f"BPSCTL_ASYNC (asynchronous training): DistributedOptimizer got "
                         f"{type(optimizer).__module__}.{type(optimizer).__qualname__}, but the "
                         "servers apply updates as torch.optim.SGD does (momentum, weight "
                         "decay, Nesterov), and only that: wrap a torch.optim.SGD, or train "
                         "synchronously")
    if any(group.get("maximize") for group in optimizer.param_groups):
        raise ValueError("BPSCTL_ASYNC (asynchronous training): torch.optim.SGD with "
                         "maximize=True is not what the servers run; negate the loss instead")
    if compression is not Compression.none:
        raise ValueError(f"BPSCTL_ASYNC (asynchronous training) with compression "
                         f"{getattr(compression, '__name__', compression)}: gradients and "
                         "parameters travel uncompressed (servers apply each gradient as it "
                         "comes); drop the compression, or train synchronously")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: CompressionArg = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so each gradient is averaged across workers from a per-parameter hook
    the moment it is ready; ``step()`` waits only for what is still outstanding. Under
    ``BPSCTL_ASYNC`` (``optimizer`` a ``torch.optim.SGD``) the servers hold the parameters and
    apply the gradients: see the module docstring.

    Horovod's keywords: ``op`` (``Average``, or ``Sum`` to sum the gradients; Adasum is
    refused), ``gradient_predivide_factor`` (Average only: gradients are divided by it before
    the sum and multiplied by it after the average), ``sparse_as_dense`` (sparse gradients
    travel dense and are made sparse again), ``process_set`` (the global one only);
    ``groups`` and ``num_groups`` are checked and otherwise left to bpsctl's buckets
    (``BPSCTL_FUSION_BYTES``), which group gradients in backward order already."""
    from .optimizer import DEFAULTS, _optimizer_options  # (it imports this module)
    options = _optimizer_options(op, gradient_predivide_factor, num_groups, groups,
                                 sparse_as_dense, process_set, backward_passes_per_step)
    methods = dict(_DistributedOptimizer.__dict__)
    if _p().config.async_mode:
        _check_async(optimizer, compression)
        if options != DEFAULTS:
            raise ValueError("BPSCTL_ASYNC (asynchronous training): the servers apply each "
                             "gradient as it comes; op, gradient_predivide_factor and "
                             "sparse_as_dense do not apply there; leave them at their defaults")
        methods.update(_AsyncDistributedOptimizer.__dict__)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               options)


class DistributedDataParallel(torch.nn.Module):
    """Like ``torch.nn.parallel.DistributedDataParallel``: parameters are broadcast from rank 0
    at construction, and after each ``backward()`` every gradient holds the workers' average.
    Inside ``no_sync()`` gradients accumulate locally and are averaged at the next backward
    outside it."""

    def __init__(self, module: torch.nn.Module,
                 compression: CompressionArg = Compression.none):
        if _p().config.async_mode:
            raise EngineError("DistributedDataParallel under asynchronous training "
                              "(BPSCTL_ASYNC): the servers apply the updates, and this wrapper "
                              "has no optimizer to take them from; wrap a torch.optim.SGD in "
                              "bps.DistributedOptimizer instead")
        if _p().config.staleness:
            raise EngineError("BPSCTL_STALENESS (--staleness) applies the averaged gradients of "
                              "s steps ago in the optimizer step: use DistributedOptimizer, not "
                              "DistributedDataParallel, or set BPSCTL_STALENESS=0")
        super().__init__()
        self.module = module
        broadcast_parameters(module.state_dict(), root_rank=0)
        # the first push of a backward pass queues the wait for all of them at its end
        self._sync = _GradientSync(
            list(module.named_parameters()), "DistributedDataParallel.grad", compression, 1,
            before_first_push=lambda: torch.autograd.Variable._execution_engine.queue_callback(
                self._sync.synchronize))

    @contextlib.contextmanager
    def no_sync(self):
        enabled = self._sync.enabled
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = enabled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)



# Horovod's hvd.elastic, its collectives (mpi_ops) and SyncBatchNorm, on the functions above
from . import elastic, mpi_ops  # noqa: E402
from .mpi_ops import *  # noqa: E402,F401,F403
from .sync_batch_norm import SyncBatchNorm  # noqa: E402

__all__ += [*mpi_ops.__all__, "SyncBatchNorm"]
