"""Cutting tensors into partitions and placing them on servers (pure functions).

The scheduler runs the placement for the whole job, so every worker gets the same answer
whatever order it declares its tensors in, and the servers' byte loads stay balanced.
"""
from __future__ import annotations

import math
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


#: the smallest piece ``partition_depth`` cuts a tensor into: below it, per-message costs grow
MIN_PIECE_BYTES = 1024 * 1024


def piece_bytes(nbytes: int, servers: int, partition_bytes: int, depth: int) -> int:
    """The partition size of an ``nbytes`` tensor: at most ``partition_bytes`` and, with
    ``depth`` > 0, small enough that each of ``servers`` gets ``depth`` pieces of it (but not
    below :data:`MIN_PIECE_BYTES`).

    Why: a round completes on its server once every worker has pushed that partition, and
    only then can its sum come back. Each worker's uplink carries its pushes to all servers at
    once, so the first rounds complete after about ``servers x partition`` bytes of each
    uplink, and the last sums leave the servers after the last push; the downlink idles for
    both. Pieces of 1/(servers·depth) of the tensor bound that head and tail to about 1/depth
    of the transfer each, whatever the partition size a whole model trains best with."""
    if depth <= 0:
        return partition_bytes
    return max(min(partition_bytes, MIN_PIECE_BYTES),
               min(partition_bytes, -(-nbytes // (max(1, servers) * depth))))


@dataclass
class Placement:
    """Assigns each partition to the server furthest below its share of the bytes; ties go to
    the lowest index.

    ``shares`` weighs the servers (BytePS's layout of servers on the worker hosts and on CPU
    hosts gives them unequal shares, see :func:`bpsctl.model.optimal_shares`); none or
    equal weights is the even split by bytes. Weights need not sum to 1: each server's target
    is its weight over the sum of the serving servers' weights. A server of weight 0 gets
    nothing while another serving server has weight; if none has, the serving ones share
    evenly. Servers in ``spare`` (spare servers, ``bpsctl up --spare-servers``) get nothing
    until one takes over a lost server's partitions, and its share (:meth:`move_off` with
    ``to``)."""

    num_servers: int
    loads: list[int] = field(default_factory=list)
    next_part_id: int = 0
    lost: set[int] = field(default_factory=set)
    spare: set[int] = field(default_factory=set)
    shares: list[float] = field(default_factory=list)     # empty: equal

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError("a job needs at least one server")
        self.loads = [0] * self.num_servers
        self.shares = [float(share) for share in self.shares or [1.0] * self.num_servers]
        if len(self.shares) != self.num_servers or not all(
                math.isfinite(share) and share >= 0 for share in self.shares):
            raise ValueError(f"shares: expected {self.num_servers} finite weights of 0 or more, "
                             f"got {self.shares}")

    def serving(self) -> list[int]:
        """The servers that take partitions: neither lost nor spare."""
        return [s for s in range(self.num_servers) if s not in self.lost and s not in self.spare]

    def place(self, nbytes: int, itemsize: int, partition_bytes: int,
              depth: int = 0) -> list[Partition]:
        """Cut a tensor (:func:`piece_bytes` over the servers that take partitions) and give
        each piece to the server furthest below its share."""
        weights = self._weights()
        parts = []
        size = piece_bytes(nbytes, sum(1 for w in weights if w > 0), partition_bytes, depth)
        for offset, length in split(nbytes, itemsize, size):
            server = self.least_loaded(max(length, 1))
            self.loads[server] += max(length, 1)
            parts.append(Partition(self.next_part_id, server, offset, length))
            self.next_part_id += 1
        return parts

    def _weights(self) -> list[float]:
        """The shares of the serving servers (the others 0); evenly when none has weight."""
        serving = set(self.serving())
        weights = [share if s in serving else 0.0 for s, share in enumerate(self.shares)]
        if not any(weights):
            weights = [1.0 if s in serving else 0.0 for s in range(self.num_servers)]
        return weights

    def least_loaded(self, nbytes: int = 1) -> int:
        """The serving server furthest below its share once ``nbytes`` more are placed.

        Its deficit is ``w_s·(T + nbytes)/W − load_s`` (``T`` the bytes placed on serving
        servers, ``W`` their weights' sum). The deficits sum to ``nbytes``, so the largest is
        positive and the chosen server ends at most ``nbytes`` above its share: every server
        stays within about one partition of its share (an even split is the old rule: the
        fewest bytes). Compared as ``w_s·(T + nbytes) − W·load_s``, exact for equal weights."""
        serving = self.serving()
        if not serving:
            raise ValueError("every server of the job is lost")
        weights = self._weights()
        total_weight = sum(weights)
        after = sum(self.loads[s] for s in serving) + nbytes
        return max((s for s in serving if weights[s] > 0),
                   key=lambda s: (weights[s] * after - total_weight * self.loads[s], -s))

    def move_off(self, server: int, parts: list[list[int]],
                 to: int | None = None) -> list[list[int]]:
        """Server ``server`` is lost: move each of ``parts`` (``[part id, server, offset,
        length]`` lists, changed in place) that lives there to spare server ``to``, which is
        no longer spare from now on and takes the lost server's share, or else each to the
        survivor furthest below its share (largest first, so the survivors end within about
        one partition of their shares of everything); returns ``[part id, new server]`` per
        move."""
        self.lost.add(server)
        self.spare.discard(server)
        if to is not None:
            self.spare.discard(to)
            self.shares[to] = self.shares[server]
        moves = []
        for part in sorted((p for p in parts if p[1] == server), key=lambda p: (-p[3], p[0])):
            target = self.least_loaded(max(part[3], 1)) if to is None else to
            self.loads[target] += max(part[3], 1)
            part[1] = target
            moves.append([part[0], target])
        self.loads[server] = 0
        return moves
