"""The engine's module-level API (``bpsctl.engine.init``, ``push_pull``, ...), on one
:class:`~bpsctl.engine.worker.Worker` per process.

``import bpsctl.engine`` does not load this module: the package resolves these names on first
use (:func:`bpsctl.engine.__getattr__`), so the processes that only use the engine's parts
(a scheduler, its supervisor, the command line) start without loading NumPy for it."""
from __future__ import annotations

import atexit
import sys
from typing import Any, NoReturn

from ..config import Config
from . import cuda
from .collectives import SERVER_REDUCTIONS, ReduceOp, check_op, gather_by_sum
from .common import EngineError, JobFinished
from .worker import Handle, Worker

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "push_pull", "push_pull_async", "poll", "synchronize", "declare", "barrier", "join",
           "allgather", "allreduce", "allreduce_async", "ReduceOp",
           "Worker", "Handle", "EngineError", "Config"]

_worker: Worker | None = None
_staging = cuda.CudaStaging()


def init(config: Config | None = None) -> None:
    """Join the job described by ``config`` (default: the environment). Idempotent."""
    global _worker
    if _worker is None:
        try:
            _worker = Worker(config)
        except JobFinished as exc:
            nothing_to_do(exc)
        _say_an_uncaught_error()


def _say_an_uncaught_error() -> None:
    """Have this worker leave the job saying it failed when the process dies of an uncaught
    exception (``sys.excepthook`` runs before the ``atexit`` shutdown): a script that died of
    a push_pull's error (a timeout) leaves its engine working, and a job whose last worker
    left that way must not be taken for a finished one (a restarted worker would exit 0,
    "nothing to do")."""
    previous = sys.excepthook
    if getattr(previous, "bpsctl_leaves_failed", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if _worker is not None:
            _worker.died_of(f"{kind.__name__}: {value}")
        previous(kind, value, tb)

    hook.bpsctl_leaves_failed = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def nothing_to_do(finished: JobFinished) -> NoReturn:
    """A restarted worker whose job finished before it could rejoin: the job succeeded
    without it, so the process says so and exits 0 rather than failing the run."""
    print(f"bpsctl: {finished}; nothing to do", file=sys.stderr, flush=True)
    raise SystemExit(0)


def shutdown() -> None:
    global _worker
    if _worker is not None:
        _worker.shutdown()
        _worker = None


atexit.register(shutdown)


def is_initialized() -> bool:
    return _worker is not None


def _w() -> Worker:
    if _worker is None:
        raise EngineError("bpsctl engine is not initialized: call init() first")
    return _worker


def rank() -> int:
    return _w().rank


def size() -> int:
    return _w().size


def local_rank() -> int:
    return _w().local_rank


def local_size() -> int:
    return _w().local_size


def push_pull_async(array: Any, name: str | None = None, average: bool = True,
                    priority: int = 0, out: Any = None) -> Handle | cuda.CudaHandle:
    if cuda.is_cuda_array(array):
        return cuda.push_pull_async(_w(), _staging, array, name, average, priority, out)
    return _w().push_pull_async(array, name, average, priority, out)


def push_pull(array: Any, name: str | None = None, average: bool = True, priority: int = 0,
              out: Any = None) -> Any:
    return synchronize(push_pull_async(array, name, average, priority, out))


def poll(handle: Handle | cuda.CudaHandle) -> bool:
    return handle.done()


def synchronize(handle: Handle | cuda.CudaHandle, timeout_s: float | None = None) -> Any:
    """The result: a NumPy array, or for a CUDA array one on its device."""
    if isinstance(handle, cuda.CudaHandle):
        return handle.wait(_w(), timeout_s)
    return _w().synchronize(handle, timeout_s)


def declare(name: str, shape: tuple[int, ...], dtype: Any) -> None:
    _w().declare(name, shape, dtype)


def barrier(timeout_s: float | None = None) -> None:
    _w().barrier(timeout_s)


def join() -> int:
    """Horovod's join: this worker has no more data; the others' push_pulls count it as zeros
    until every worker has joined. Returns the rank that joined last (see Worker.join)."""
    return _w().join()


def allreduce_async(array: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                    priority: int = 0, out: Any = None) -> Handle | cuda.CudaHandle:
    """Start reducing ``array`` across workers by ``op`` (Horovod's ops): Average and Sum are
    push_pull's; Min, Max and Product are applied elementwise by the servers, over the same
    partitioned, prioritized path (neither averaged nor compressed). Floor division is not
    applied to integers: Average of an integer array is refused, as push_pull refuses it."""
    op = ReduceOp(op)
    check_op(op, [ReduceOp.Average, ReduceOp.Sum, *SERVER_REDUCTIONS], "allreduce")
    average = op is ReduceOp.Average
    reduction = SERVER_REDUCTIONS.get(op, 0)
    if cuda.is_cuda_array(array):
        return cuda.push_pull_async(_w(), _staging, array, name, average, priority, out,
                                    reduction=reduction)
    return _w().push_pull_async(array, name, average, priority, out, reduction=reduction)


def allreduce(array: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
              priority: int = 0, out: Any = None) -> Any:
    """:func:`allreduce_async`, waited for: the reduced array."""
    return synchronize(allreduce_async(array, name, op, priority, out))


def allgather(array: Any, name: str) -> Any:
    """Every worker's ``array`` (host memory) concatenated along the first dimension in rank
    order (workers may differ in that dimension only), through summation, each worker
    pushing its own rows: see :func:`bpsctl.engine.collectives.gather_by_sum`. ``name`` is
    the same on every worker."""
    worker = _w()

    def push_pull_sum(a: Any, n: str, mine: tuple[int, int] | None = None) -> Any:
        return worker.push_pull(a, name=n, average=False, mine=mine)
    return gather_by_sum(array, worker.rank, worker.size, push_pull_sum, name)
