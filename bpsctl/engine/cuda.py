"""CUDA arrays (CuPy, or anything that hands its memory over by DLPack or the CUDA array
interface) through the framework-free engine: staged through pinned host buffers, one per
name and direction, allocated once.

    import cupy, bpsctl.engine as bps
    bps.init()
    g = cupy.ones(1 << 20, dtype=cupy.float32)
    out = bps.push_pull(g, name="g")         # a CuPy array on g's device

The copy to the host runs on the caller's current stream after its queued work; the copy
back, when the result is waited for (``synchronize``), on the same stream, so later work on
it sees the result. The MXNet plugin hands GPU NDArrays over by DLPack (no ``asnumpy()``).
CuPy is imported only when a CUDA array arrives.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .common import EngineError


def is_cuda_array(array: Any) -> bool:
    """Whether ``array`` lives on a GPU (it offers the CUDA array interface)."""
    return not isinstance(array, np.ndarray) and hasattr(array, "__cuda_array_interface__")


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise EngineError("a CUDA array was pushed, and staging it through host memory needs "
                          "CuPy: pip install cupy-cuda12x (or the wheel of your CUDA)") from None
    return cupy


class CudaStaging:
    """The pinned host buffers of one worker's CUDA push_pulls, by name (a name is never in
    flight twice, so its buffers are free when it comes again)."""

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def buffers(self, name: str | None, shape: tuple[int, ...],
                dtype: Any) -> tuple[np.ndarray, np.ndarray]:
        """Pinned (input, output) buffers for ``name`` (fresh ones for an unnamed push_pull)."""
        cached = self._buffers.get(name) if name is not None else None
        if cached is None or cached[0].shape != shape or cached[0].dtype != dtype:
            import cupyx
            cached = (cupyx.empty_pinned(shape, dtype), cupyx.empty_pinned(shape, dtype))
            if name is not None:
                self._buffers[name] = cached
        return cached


class CudaHandle:
    """A CUDA push_pull in progress: the engine's handle of the host buffers, and where the
    result goes back on the GPU."""

    __slots__ = ("handle", "host_out", "out")

    def __init__(self, handle: Any, host_out: np.ndarray, out: Any):
        self.handle, self.host_out, self.out = handle, host_out, out

    def done(self) -> bool:
        return bool(self.handle.done())

    def wait(self, worker: Any, timeout_s: float | None = None) -> Any:
        """The result, copied back into ``out`` on the current stream."""
        worker.synchronize(self.handle, timeout_s)
        self.out.set(self.host_out)
        return self.out


def push_pull_async(worker: Any, staging: CudaStaging, array: Any, name: str | None,
                    average: bool, priority: int, out: Any = None,
                    compression: Any = None, once: bool = False,
                    reduction: int = 0, root: int | None = None) -> CudaHandle:
    """Start the push_pull of a CUDA ``array`` (see the module docstring); ``out`` (a CuPy
    array of the same shape and dtype, default a new one) receives the result. ``once`` and
    ``root``: a broadcast's (see Worker.push_pull_async)."""
    cupy = _cupy()
    device_in = cupy.asarray(array)                # no copy: a view of the same memory
    if not device_in.flags.c_contiguous:
        device_in = cupy.ascontiguousarray(device_in)
    if out is None:
        out = cupy.empty_like(device_in)
    elif out.shape != device_in.shape or out.dtype != device_in.dtype:
        raise ValueError(f"out must be a {device_in.dtype} CUDA array of shape "
                         f"{device_in.shape}, got {out.dtype} {out.shape}")
    worker.check_push(device_in.dtype, average, name)
    host_in, host_out = staging.buffers(name, device_in.shape, device_in.dtype)
    device_in.get(out=host_in)                      # after the stream's queued work
    handle = worker.push_pull_async(host_in, name=name, average=average, priority=priority,
                                    out=host_out, compression=compression, once=once,
                                    reduction=reduction, root=root)
    return CudaHandle(handle, host_out, out)
