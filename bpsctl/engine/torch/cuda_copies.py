"""The copies of a CUDA tensor's push_pull through host memory: pinned buffers, the side
streams that copy to the host and back, and the page-locked shared memory the GPU copies into
directly (:mod:`.pinning`). The order of the staged push_pulls is :mod:`.staging`'s."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..shmlink import merge_runs
from ..worker import Handle, Lease
from .pinning import CudaPinning, host_bytes
from .plugin import _Op, _Plugin
from .staging import Downstream, StagedOp, Stager


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
    in; :func:`~.ops.synchronize` makes the caller's stream wait for that copy.

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
