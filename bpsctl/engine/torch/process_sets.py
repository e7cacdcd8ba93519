"""Horovod's process sets for the PyTorch plugin: :mod:`bpsctl.engine.process_sets`, which the
MXNet plugin shares (one global set, as in Horovod)."""
from __future__ import annotations

from ..process_sets import (  # noqa: F401
    ProcessSet,
    ProcessSetUnsupported,
    Scope,
    __all__,
    _barrier,
    _check_init_sets,
    _check_set,
    _scope,
    add_process_set,
    global_process_set,
    remove_process_set,
)
