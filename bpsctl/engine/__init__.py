"""The bpsctl engine, framework-free, on NumPy arrays.

    import bpsctl.engine as bps
    bps.init()                                   # reads BPSCTL_* (set by `bpsctl run`)
    out = bps.push_pull(grad, name="layer1.weight")            # average across workers
    h = bps.push_pull_async(grad, name="layer1.bias", priority=-1)
    ...; bps.synchronize(h)
    bps.shutdown()

Larger ``priority`` goes first. ``average=True`` divides the sum by the number of workers.
CUDA arrays (CuPy's) are staged through pinned host memory and come back on their device
(:mod:`bpsctl.engine.cuda`).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..config import Config
from .common import EngineError, JobFinished  # noqa: F401  (the API raises and catches these)

if TYPE_CHECKING:       # for type checkers; at run time these come from __getattr__
    from . import cuda  # noqa: F401
    from .api import (  # noqa: F401
        Handle,
        ReduceOp,
        Worker,
        _staging,
        _w,
        allgather,
        allreduce,
        allreduce_async,
        barrier,
        declare,
        init,
        is_initialized,
        join,
        local_rank,
        local_size,
        nothing_to_do,
        poll,
        push_pull,
        push_pull_async,
        rank,
        shutdown,
        size,
        synchronize,
    )

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "push_pull", "push_pull_async", "poll", "synchronize", "declare", "barrier", "join",
           "allgather", "allreduce", "allreduce_async", "ReduceOp",
           "Worker", "Handle", "EngineError", "Config"]

#: names of :mod:`bpsctl.engine.api` the package hands out (the plugins' ``_w``, ``_staging``,
#: ``nothing_to_do`` and ``cuda`` included); the worker's state stays in that module
_API_NAMES = frozenset(__all__) - {"EngineError", "Config"} | {
    "_w", "_staging", "nothing_to_do", "cuda"}


def __getattr__(name: str) -> Any:
    """Load the API on first use (PEP 562). Loading it imports the worker and NumPy; a
    scheduler, a supervisor or ``bpsctl --help`` never pays for that."""
    if name == "_worker":       # this process's Worker or None: read where it lives, each time
        return importlib.import_module(".api", __name__)._worker
    if name not in _API_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".api", __name__), name)
    globals()[name] = value         # later look-ups are plain attribute reads
    return value
