"""Cutting tensors into partitions and placing them on servers (pure functions).

The scheduler runs the placement for the whole job, so every worker gets the same answer
whatever order it declares its tensors in, and the servers' byte loads stay balanced.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Partition:
    part_id: int      # job-wide id, the key of the partition on its server
    server: int       # index into the job's server list
    offset: int       # byte offset in the tensor
    length: int       # bytes


def split(nbytes: int, itemsize: int, partition_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of at most ``partition_bytes``, cut on element boundaries.

    A tensor of 0 bytes still gets one (empty) piece, so that every worker takes part in
    every declared tensor and disagreements surface instead of hanging.
    """
    step = max(itemsize, partition_bytes // itemsize * itemsize)
    if nbytes == 0:
        return [(0, 0)]
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


@dataclass
class Placement:
    """Assigns partitions to the least-loaded server by bytes; ties go to the lowest index."""

    num_servers: int
    loads: list[int] = field(default_factory=list)
    next_part_id: int = 0

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError("a job needs at least one server")
        self.loads = [0] * self.num_servers

    def place(self, nbytes: int, itemsize: int, partition_bytes: int) -> list[Partition]:
        parts = []
        for offset, length in split(nbytes, itemsize, partition_bytes):
            server = min(range(self.num_servers), key=lambda s: (self.loads[s], s))
            self.loads[server] += max(length, 1)
            parts.append(Partition(self.next_part_id, server, offset, length))
            self.next_part_id += 1
        return parts
