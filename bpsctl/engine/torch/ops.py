"""push_pull and its handles: starting one (on the host, through the intra-node stage, or a
CUDA tensor staged through host memory), :func:`poll` and :func:`synchronize`, composite
handles for the collectives of :mod:`.mpi_ops`, the pushes of asynchronous training, and the
membership callbacks told at each synchronize."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .. import paths
from ..collectives import HorovodInternalError
from ..common import EngineError
from ..intranode import JOIN_WAY_OUT, LocalOp, LocalStage, _as_array
from .compression import Compression, CompressionArg, EngineCompressor
from .cuda_copies import _contiguous_output, _Direct, _stage_through_host
from .plugin import _Op, _p, _Plugin, _wire_dtype
from .staging import Downstream, StagedOp


def _start(tensor: torch.Tensor, average: bool, name: str | None, priority: int,
           compression: CompressionArg, inplace: bool, once: bool = False,
           ranks: tuple[int, ...] | None = None, join_error: str | None = None) -> int:
    """Start a push_pull (``once``: a broadcast's, see Worker.push_pull_async; ``ranks``: a
    process set's, over those ranks only, straight to the servers: the intra-node stage
    sums over every worker of the host; ``join_error``: one that fails once a rank has
    joined)."""
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
    stage = plugin.stage if ranks is None else None
    if stage is not None and plugin.worker.joined_ranks:
        raise HorovodInternalError(
            f"push_pull of {name!r}: worker(s) {sorted(plugin.worker.joined_ranks)} joined "
            f"(hvd.join()), and the intra-node stage cannot count a rank as zeros; "
            f"{JOIN_WAY_OUT}")
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
            filled=None if direct is None else direct.lease, lend_results=direct is not None,
            ranks=ranks, join_error=join_error)
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


#: what a push of asynchronous training carries besides the gradient (see Worker.push_pull_async)
Hyperparameters = tuple[float, float, float, float, bool]


def _start_async(source: torch.Tensor, output: torch.Tensor, name: str, priority: int, *,
                 update: Hyperparameters | None = None, init: bool = False) -> int:
    """A push of asynchronous training: ``source`` (a gradient with ``update``, the
    parameter values with ``init``) goes to the servers, and the parameters they answer with
    land in ``output`` (contiguous, same shape, dtype and device); a handle for
    :func:`synchronize`. CUDA tensors are staged through pinned host buffers, as push_pulls
    are."""
    return _start_direct(source, output, name, priority, async_update=update, async_init=init)


def _start_reduced(source: torch.Tensor, output: torch.Tensor, name: str, priority: int,
                   reduction: int, ranks: tuple[int, ...] | None = None) -> int:
    """Reduce ``source`` across workers (``ranks``: a process set's) by ``reduction``
    (``protocol.REDUCE_MIN``, ``MAX``, ``PRODUCT``) on the servers, elementwise; the result
    lands in ``output`` (contiguous, same shape, dtype and device). Every worker pushes its
    own tensor: the intra-node stage sums."""
    return _start_direct(source, output, name, priority, reduction=reduction, ranks=ranks)


def _start_direct(source: torch.Tensor, output: torch.Tensor, name: str, priority: int,
                  **push: Any) -> int:
    """A push of ``source`` straight to the servers, past the intra-node stage, with the
    engine's ``push`` options; the answer lands in ``output``. CUDA tensors are staged through
    pinned host buffers, as push_pulls are."""
    plugin = _p()
    op = _Op(name, output, output, None, Compression.none)

    def start(host_in: torch.Tensor, host_out: torch.Tensor,
              direct: _Direct | None = None) -> Downstream:
        handle = plugin.worker.push_pull_async(
            _as_array(host_in), name=name, average=False, priority=priority,
            out=_as_array(host_out), **push)
        return handle.wait, handle.done
    if source.is_cuda:
        # the whole host copy of the result goes back to the device: every partition must
        # come back with its bytes (``want`` would leave the host buffer's old bytes there)
        push.pop("want", None)
        _stage_through_host(plugin, op, name, source, output, start, direct=False)
        return _track(plugin, op)
    op.keep = source
    wait, done = start(source, output)
    op.wait, op.done = wait, done
    return _track(plugin, op)
