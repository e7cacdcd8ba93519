"""DistributedOptimizer's Horovod keywords (``horovod.torch.optimizer``), checked as Horovod
checks them; the optimizer itself is the plugin's (:func:`bpsctl.engine.torch.
DistributedOptimizer`)."""
from __future__ import annotations

from typing import Any

from .. import collectives as K
from . import _p
from .process_sets import ProcessSet, _check_set

#: the options of the plugin's gradient hooks when no Horovod keyword is given
DEFAULTS: dict[str, Any] = {"average": True, "predivide": 1.0, "sparse_as_dense": False}


def _optimizer_options(op: Any, gradient_predivide_factor: float, num_groups: int, groups: Any,
                       sparse_as_dense: bool, process_set: ProcessSet | None,
                       backward_passes_per_step: int) -> dict[str, Any]:
    """DistributedOptimizer's Horovod keywords, checked as Horovod checks them, as the
    options of its gradient hooks (``average``, ``predivide``, ``sparse_as_dense``)."""
    resolved = K.resolve_op(op, None, "DistributedOptimizer")
    K.check_op(resolved, K.SERVER_OPS, "DistributedOptimizer")
    if gradient_predivide_factor != 1.0:
        if resolved is not K.ReduceOp.Average:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor is not supported "
                             "with op != hvd.Average")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"DistributedOptimizer: gradient_predivide_factor must be "
                             f"positive, got {gradient_predivide_factor}")
        if _p().config.staleness:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor with "
                             "BPSCTL_STALENESS is not supported; leave it at 1.0")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups and groups is None:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or
                                   (isinstance(groups, int) and groups > 0)):
        raise ValueError("DistributedOptimizer: groups should be a non-negative integer or a "
                         f"list of lists of torch.Tensor, got {groups!r}")
    _check_set(process_set, "DistributedOptimizer")
    return {"average": resolved is K.ReduceOp.Average,
            "predivide": float(gradient_predivide_factor), "sparse_as_dense": bool(sparse_as_dense)}
