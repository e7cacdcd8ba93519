"""Pacing a worker's pushes by each server's share of the bytes (the mixed layout).

When servers sum unequal shares (servers on the worker hosts beside CPU-only hosts, or a hosts
file's ``share:``), a worker must feed each server's flow at a rate in proportion to its share,
or the round ends late: the CPU hosts carry several times a worker host's bytes, and their
NICs are the busiest.

The partitions are already placed in that proportion: the scheduler gives each new partition
to the server furthest below its share, so a tensor's partitions, sent in order, go to the
servers in turn by share (a weighted round robin within one priority level). What spoils it is
sending too far ahead of the wire. Pushes handed to the kernel beyond what the NIC drains in a
fraction of a second wait in its queues, and there a NIC, emulated or real, shares its rate
evenly among the flows that have bytes queued: a worker then sends to a small share as fast as
to a large one, the small ones finish early, and the large ones run alone at the end.

So under unequal shares a worker's bytes pushed and not yet acknowledged are bounded by the
pacing window (``BPSCTL_PACING_WINDOW``) instead of the credit, when that is smaller: the order
the worker sends in is then the order the bytes leave. The credit keeps its meaning for
priorities (a late high-priority tensor waits behind at most the smaller of the two). With
equal shares (the dedicated and colocated layouts' default) pacing is off: an even split of the
NIC is already each flow's share.

Bounding each server's bytes in flight by its share instead was measured and does not do this
(docs/benchmarks-layouts.md): with a whole round in flight every flow stays backlogged, and
with a small window a server's bound holds up the pushes behind it.
"""
from __future__ import annotations

from collections.abc import Iterable

#: shares within this factor of each other count as equal
EQUAL_WITHIN = 1.05


def unequal(shares: Iterable[float]) -> bool:
    """Whether servers with these shares (spares' zeros left out) need pacing."""
    live = [share for share in shares if share > 0]
    return len(live) > 1 and max(live) > min(live) * EQUAL_WITHIN


def credit_for(shares: Iterable[float], credit_bytes: int, window_bytes: int,
               pacing: bool = True) -> int:
    """The most bytes a worker may have pushed and not seen acknowledged, for a job whose
    servers sum ``shares``: the pacing window under unequal shares (when pacing is on and
    the window is the smaller), else the credit."""
    if pacing and unequal(shares):
        return min(credit_bytes, window_bytes)
    return credit_bytes
