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
    """Assigns partitions to the least-loaded server by bytes; ties go to the lowest index.

    Servers in ``spare`` (spare servers, ``bpsctl up --spare-servers``) get nothing until one
    takes over a lost server's partitions (:meth:`move_off` with ``to``)."""

    num_servers: int
    loads: list[int] = field(default_factory=list)
    next_part_id: int = 0

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError("a job needs at least one server")
        self.loads = [0] * self.num_servers

    lost: set[int] = field(default_factory=set)
    spare: set[int] = field(default_factory=set)

    def place(self, nbytes: int, itemsize: int, partition_bytes: int) -> list[Partition]:
        parts = []
        for offset, length in split(nbytes, itemsize, partition_bytes):
            server = self.least_loaded()
            self.loads[server] += max(length, 1)
            parts.append(Partition(self.next_part_id, server, offset, length))
            self.next_part_id += 1
        return parts

    def least_loaded(self) -> int:
        """The server with the fewest bytes placed on it, of those neither lost nor spare."""
        alive = [s for s in range(self.num_servers) if s not in self.lost and s not in self.spare]
        if not alive:
            raise ValueError("every server of the job is lost")
        return min(alive, key=lambda s: (self.loads[s], s))

    def move_off(self, server: int, parts: list[list[int]],
                 to: int | None = None) -> list[list[int]]:
        """Server ``server`` is lost: move each of ``parts`` (``[part id, server, offset,
        length]`` lists, changed in place) that lives there to spare server ``to``, which is
        no longer spare from now on, or else each to the least-loaded survivor (largest first,
        so loads stay balanced); returns ``[part id, new server]`` per move."""
        self.lost.add(server)
        self.spare.discard(server)
        if to is not None:
            self.spare.discard(to)
        moves = []
        for part in sorted((p for p in parts if p[1] == server), key=lambda p: (-p[3], p[0])):
            target = self.least_loaded() if to is None else to
            self.loads[target] += max(part[3], 1)
            part[1] = target
            moves.append([part[0], target])
        self.loads[server] = 0
        return moves
