"""Bounded staleness for ``DistributedOptimizer`` (``BPSCTL_STALENESS=s``, ``bpsctl run
--staleness s``).

With staleness ``s`` the optimizer step that ends step ``t`` applies the workers' averaged
gradients of step ``t - s``, not of step ``t``: a worker waits only for the round of ``s``
steps ago, so it may run up to ``s`` steps ahead of the slowest worker, and the ``s`` rounds
in between stay on the wire while it computes (communication hides behind up to ``s`` steps
of compute). Every worker applies the same averages in the same order, so their models stay
equal bit for bit; they are ``s`` updates behind a synchronous run's. ``s = 0`` is the
synchronous optimizer.

How: step ``t``'s gradients are copied into slot ``t mod (s+1)`` of each bucket (buffers
allocated once) and pushed under the bucket's name plus the slot, so the ``s + 1`` steps in
flight are ``s + 1`` different tensors to the engine and the servers: nothing in the engine
changes, and backup workers, lost workers and compression work per slot as they do per
tensor. The cost is one copy of the gradients per step, and ``s + 1`` times the gradients'
memory on each worker and (two buffers per partition) ``2(s + 1)`` times on the servers.

The first ``s`` steps have no averaged gradient to apply yet, and update nothing. At the
end of training ``s`` rounds are still in flight: :meth:`flush` applies them (one update
each), and ``shutdown()`` waits for them otherwise, so no worker leaves a round the others
still need.
"""
from __future__ import annotations

import collections
from typing import Any

import torch

from ..common import EngineError
from .ops import _finish, synchronize


class StaleGradients:
    """The slots and the rounds in flight of one DistributedOptimizer under staleness."""

    def __init__(self, sync: Any, staleness: int):
        self.sync = sync                        # the optimizer's _GradientSync
        self.depth = staleness + 1
        self.steps = 0                          # steps whose gradients were pushed
        # (slot, [(bucket, handle)]) per step in flight, oldest first
        self.pending: collections.deque[tuple[int, list[tuple[Any, int]]]] = collections.deque()
        self.slots: dict[Any, list[torch.Tensor]] = {}

    def slot_tensor(self, bucket: Any) -> tuple[torch.Tensor, str]:
        """This step's slot of ``bucket`` (the flat buffer its gradients are copied into) and
        the name it is pushed under."""
        buffers = self.slots.get(bucket)
        if buffers is None:
            first = bucket.params[0]
            count = sum(p.numel() for p in bucket.params)
            buffers = self.slots[bucket] = [torch.empty(count, dtype=first.dtype,
                                                        device=first.device)
                                            for _ in range(self.depth)]
        slot = self.steps % self.depth
        return buffers[slot], f"{bucket.name}.stale{slot}"

    def end_step(self) -> bool:
        """This step's pushes are out (every bucket): keep their handles. If a round ``s``
        steps old is due, wait for it and put its averages into the gradients; returns
        whether it did (whether the optimizer update should run)."""
        self.pending.append((self.steps % self.depth, self.sync.take_handles()))
        self.steps += 1
        if len(self.pending) < self.depth:
            return False            # the first s steps: nothing averaged yet
        self._apply_oldest()
        return True

    def _apply_oldest(self) -> None:
        slot, taken = self.pending.popleft()
        for bucket, handle in taken:
            synchronize(handle)
            self.sync.unpack(bucket, self.slots[bucket][slot])

    def flush(self, update: Any) -> int:
        """Apply every round still in flight, oldest first, calling ``update()`` (the wrapped
        optimizer's step) after each; returns how many."""
        applied = 0
        while self.pending:
            self._apply_oldest()
            update()
            applied += 1
        return applied

    def drain(self) -> BaseException | None:
        """At shutdown: wait for the rounds in flight (the other workers need this worker's
        pushes of them to complete, and it theirs), without applying them."""
        error: BaseException | None = None
        while self.pending:
            _, taken = self.pending.popleft()
            for _, handle in taken:
                try:
                    _finish(handle)
                except (EngineError, ValueError) as exc:
                    error = error or exc
        return error
