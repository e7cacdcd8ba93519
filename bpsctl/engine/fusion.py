"""Which gradients travel together (tensor fusion): runs of small gradients, adjacent in the
order backward produces them, share one push. Decided from what each parameter is (its
size, dtype and device) and nothing of torch, so that the bench's own process counts a
model's pushes from its parameter shapes alone (bpsctl/bench/shapes.py), grouped exactly as
the torch plugin's workers group the real parameters (bpsctl/engine/torch/gradients.py)."""
from __future__ import annotations

from typing import Any


class Bucket:
    """Gradients pushed as one tensor: one parameter's own gradient (no copy), or several small
    ones consecutive in backward order, packed into a flat buffer allocated once."""

    __slots__ = ("params", "name", "priority", "flat", "views", "ready", "handle")

    def __init__(self, params: list[Any], name: str, priority: int):
        self.params, self.name, self.priority = params, name, priority
        self.flat: Any = None                # the packed tensor of several members
        self.views: list[Any] = []          # flat's slice of each member, in its shape
        self.ready = 0                      # members whose gradient is final for this step
        self.handle: int | None = None


def buckets(params: list[Any], names: dict, fusion_bytes: int, prefix: str,
            group_of: dict | None = None, cuda_fusion_bytes: int | None = None) -> list[Bucket]:
    """Group ``params`` (in registration order; anything with torch's ``numel()``,
    ``element_size()``, ``dtype``, ``device`` and ``is_cuda``) for pushing. Backward produces
    gradients roughly in reverse order, so runs of small gradients adjacent in that order share
    a bucket of at most ``fusion_bytes`` (``cuda_fusion_bytes`` for parameters on a GPU, if
    given); a gradient of that size or more travels alone. Every worker derives the same
    buckets from the same model, so the names agree across workers. Priorities follow layer
    order (the first parameter highest): the next forward pass needs the first layers first,
    and the engine sends larger priority first (a CrossBarrier pushes by them; a
    DistributedOptimizer, whose step waits for every bucket, in the order they are ready).
    With ``group_of`` (parameter -> its param group) a bucket holds one group's parameters
    only."""
    index = {p: i for i, p in enumerate(params)}
    found: list[Bucket] = []
    run: list[Any] = []
    run_bytes = 0

    def close_run() -> None:
        nonlocal run_bytes
        run_bytes = 0
        if len(run) == 1:
            found.append(Bucket(list(run), names[run[0]], -index[run[0]]))
        elif run:
            found.append(Bucket(list(run), f"{prefix}.fused.{len(found)}",
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
    return found
