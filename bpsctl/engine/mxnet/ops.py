"""The MXNet plugin's engine face: joining the job, the job's shape, BytePS's push_pull of
NDArrays (in place, zero-copy for CPU arrays; GPU arrays through CuPy or the host) and its
compression casts. :mod:`.mpi_ops` (Horovod's collectives) and the package's trainer and
optimizer wrappers are built on it."""
from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np

try:
    import mxnet as mx
    from mxnet.base import _LIB, check_call
except Exception as exc:        # noqa: BLE001 - under numpy>=1.24 it is an AttributeError
    raise ImportError("bpsctl.engine.mxnet needs mxnet 1.9.1, which needs numpy<1.24: "
                      f"pip install 'bpsctl[mxnet]' (import failed: {exc!r})") from exc

from ... import engine as _engine
from ...config import Config
from .. import compression as C
from ..common import EngineError
from ..process_sets import _check_init_sets
from ..worker import Handle


def init(config: Config | None = None, process_sets: Any = None, *, comm: Any = None) -> None:
    """Join the job (default: from the environment, as set by ``bpsctl run``). Idempotent.
    Horovod's ``init(comm=None, process_sets=None)`` is accepted too, as the PyTorch plugin
    takes it: ``comm`` (first, or by name) as a list of ranks must cover every rank of the
    job (:class:`~bpsctl.engine.process_sets.ProcessSetUnsupported` otherwise), and each of
    ``process_sets`` is added as ``add_process_set`` adds it (the same list on every rank).
    A restarted worker cannot rejoin a running MXNet job (only the PyTorch plugin hands a
    rejoining worker the model): it fails here, and the job goes on without it. Under
    asynchronous training (BPSCTL_ASYNC) ``DistributedTrainer`` trains with SGD on the
    servers; ``DistributedOptimizer`` is refused."""
    if config is not None and not isinstance(config, Config):
        config, comm = None, config         # Horovod's positional comm
    _engine.init(config)
    if _engine._w().config.staleness:
        _engine.shutdown()
        raise EngineError("BPSCTL_STALENESS (--staleness) is built for the PyTorch plugin's "
                          "DistributedOptimizer, not for MXNet: set BPSCTL_STALENESS=0")
    if _engine._w().joining:
        _engine.shutdown()
        raise EngineError("a restarted worker cannot rejoin a running MXNet job (only the "
                          "PyTorch plugin hands over the model); the job goes on without it")
    if comm is not None or process_sets is not None:
        _check_init_sets(comm, process_sets)


def shutdown() -> None:
    _engine.shutdown()


def is_initialized() -> bool:
    return _engine.is_initialized()


def size() -> int:
    return _engine.size()


def rank() -> int:
    return _engine.rank()


def local_size() -> int:
    return _engine.local_size()


def local_rank() -> int:
    return _engine.local_rank()


def byteps_declare_tensor(name: str, **kwargs: Any) -> None:
    """Accepted for BytePS scripts; does nothing: bpsctl needs no declaration order."""
    _engine._w()


# --------------------------------------------------------------------------- compression

class Compressor:
    """Turns an NDArray into what travels, and back (BytePS's interface)."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        return tensor


class NoneCompressor(Compressor):
    pass


class FP16Compressor(Compressor):
    """Floating-point NDArrays travel as float16 (one cast each way); others as they are."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f" and dtype != np.float16:
            return tensor.astype(np.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        return tensor if ctx is None else tensor.astype(ctx)


class Compression:
    """``none``, ``fp16`` (float16 on the wire)."""

    none = NoneCompressor
    fp16 = FP16Compressor


# --------------------------------------------------------------------------- push_pull

def _host_view(array: mx.nd.NDArray, writable: bool) -> np.ndarray | None:
    """A NumPy view of ``array``'s own memory once MXNet is done with it, or None where there
    is no such view (GPU or empty arrays)."""
    if array.stype != "default":
        raise TypeError(f"push_pull supports dense NDArrays only, got storage {array.stype!r}")
    if not array.context.device_type.startswith("cpu") or array.size == 0:
        return None
    if writable:
        check_call(_LIB.MXNDArrayWaitToWrite(array.handle))
    else:
        array.wait_to_read()
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    dtype = np.dtype(array.dtype)
    memory = (ctypes.c_char * (array.size * dtype.itemsize)).from_address(pointer.value)
    return np.frombuffer(memory, dtype=dtype).reshape(array.shape)


class _Op:
    """One in-place push_pull of an NDArray: start it, then ``wait()``."""

    __slots__ = ("array", "staged", "handle", "cuda")

    def __init__(self, array: mx.nd.NDArray, name: str, average: bool, priority: int,
                 zero: bool = False, compression: C.Compressor | None = None,
                 once: bool = False, root: int | None = None):
        if not isinstance(array, mx.nd.NDArray):
            raise TypeError(f"push_pull expects an mxnet NDArray, got {type(array).__name__}")
        self.array = array                      # keeps the memory behind the view alive
        view = _host_view(array, writable=True)
        self.cuda = _cuda_push(array, name, average, priority, zero, compression, once, root) \
            if view is None else None
        if self.cuda is not None:
            return
        self.staged = view is None
        if view is None:
            view = np.zeros(array.shape, array.dtype) if zero else array.asnumpy()  # copy
        elif zero:
            view[...] = 0                       # no NaN * 0: memory may be uninitialized
        self.handle: Handle = _engine._w().push_pull_async(view, name=name, average=average,
                                                           priority=priority, out=view,
                                                           compression=compression, once=once,
                                                           root=root)

    def wait(self) -> mx.nd.NDArray:
        worker = _engine._w()
        if self.cuda is not None:
            self.cuda.wait(worker)              # into the array's own GPU memory
            self.cuda.out.device.synchronize()  # before MXNet's streams read it
            return self.array
        result = worker.synchronize(self.handle)
        if self.staged:
            self.array._sync_copyfrom(result)  # copy back
        return self.array


def _cuda_push(array: mx.nd.NDArray, name: str, average: bool, priority: int, zero: bool,
               compression: C.Compressor | None, once: bool = False,
               root: int | None = None) -> Any:
    """A GPU NDArray's push_pull through CuPy, its memory handed over by DLPack (no
    ``asnumpy()``): staged through pinned host buffers by :mod:`bpsctl.engine.cuda`, the
    result written back into the NDArray's own memory. None where that cannot be (not on a
    GPU, empty, or no CuPy): the caller copies through the host instead."""
    if not array.context.device_type.startswith("gpu") or array.size == 0:
        return None
    try:
        import cupy
    except ImportError:
        return None
    device = cupy.from_dlpack(mx.nd.to_dlpack_for_write(array))
    if zero:
        device.fill(0)
    return _engine.cuda.push_pull_async(_engine._w(), _engine._staging, device, name, average,
                                        priority, out=device, compression=compression,
                                        once=once, root=root)


class _Batch:
    """push_pulls started together and waited for together. On an error every one already
    started is still waited for (the engine writes into their arrays) before it is raised."""

    def __init__(self) -> None:
        self.ops: list[_Op | _AsyncOp] = []

    def start(self, array: mx.nd.NDArray, name: str, average: bool, priority: int,
              zero: bool = False, compression: C.Compressor | None = None,
              once: bool = False, root: int | None = None) -> None:
        self.ops.append(_Op(array, name, average, priority, zero, compression, once, root))

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        error = exc
        for op in self.ops:
            try:
                op.wait()
            except BaseException as failure:     # noqa: BLE001 - the first one is raised
                error = error or failure
        if error is not None and exc is None:
            raise error


class _AsyncOp:
    """One push of asynchronous training: ``source`` (a parameter's values with ``init``, its
    gradient with ``update``) goes to the servers, and the parameters they answer with land in
    ``target`` (a parameter's data, of the same shape and dtype): start it, then ``wait()``.
    CPU arrays travel as views of their own memory, as :class:`_Op`'s do."""

    __slots__ = ("source", "target", "staged", "handle")

    def __init__(self, source: mx.nd.NDArray, target: mx.nd.NDArray, name: str, priority: int,
                 update: tuple[float, float, float, float, bool] | None = None,
                 init: bool = False):
        self.source, self.target = source, target   # keep the memory behind the views alive
        out = _host_view(target, writable=True)
        self.staged = out is None
        if out is None:
            out = target.asnumpy()                      # copy
        src = out if source is target else _host_view(source, writable=False)
        if src is None:
            src = source.asnumpy()                      # copy
        self.handle: Handle = _engine._w().push_pull_async(src, name=name, average=False,
                                                           priority=priority, out=out,
                                                           async_update=update,
                                                           async_init=init)

    def wait(self) -> None:
        result = _engine._w().synchronize(self.handle)
        if self.staged:
            self.target._sync_copyfrom(result)          # copy back


_noname = itertools.count()


def _wire_name(name: str | None, wire: mx.nd.NDArray, source: mx.nd.NDArray) -> str:
    if name is None:
        name = f"push_pull.noname.{next(_noname)}"
    if np.dtype(wire.dtype) != np.dtype(source.dtype):
        # a name is bound to one dtype in the engine: the compressed form gets its own
        name = f"{name}:{np.dtype(wire.dtype).name}"
    return name


def byteps_push_pull(tensor: mx.nd.NDArray, version: int = 0, priority: int = 0,
                     name: str | None = None, is_average: bool = True) -> None:
    """Sum (or, with ``is_average``, average) ``tensor`` across workers, in place. Larger
    ``priority`` goes first; ``version`` is accepted and ignored, as in BytePS."""
    del version
    _Op(tensor, _wire_name(name, tensor, tensor), is_average, priority).wait()


# --------------------------------------------------------------------------- broadcast

def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job (0..{size() - 1})")
