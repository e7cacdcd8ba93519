"""A traffic model of one push_pull round: the first guess for how many servers to use.

Each worker host sends its S bytes of gradients once and receives the sum once (several
workers on one host reduce locally first). The engine spreads partitions over the job's
servers evenly by bytes, so with s servers every worker host pushes S/s to each server and
pulls S/s back; a byte between a worker and a server on the same host crosses no NIC. The
round lasts as long as the busiest NIC direction: max over hosts of max(in, out) / rate.

Dedicated server hosts (what ``--emulate`` builds): each of n worker hosts moves S each way,
each of s servers n·S/s each way, so a round takes max(S/R_w, n·S/(s·R_s)) — flat once
s ≥ n·R_w/R_s, i.e. s ≥ n at equal NIC rates. Servers on the worker hosts themselves: BytePS
(OSDI'20, §3.2) splits the summation between k CPU-only hosts and the n worker hosts;
:func:`summation_split` gives that optimum.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..bench.api import GOODPUT_SHARE


def round_seconds(size_bytes: float, worker_hosts: Sequence[str], server_hosts: Sequence[str],
                  nic_mbit: float, shares: Sequence[float] | None = None) -> float:
    """NIC-bound time of one push_pull round of ``size_bytes`` per worker host.

    ``server_hosts`` names each server's host in the order the job uses them; ``shares`` is
    the fraction of the bytes each server sums (default: equal, as the engine places them).
    """
    if shares is None:
        shares = [1 / len(server_hosts)] * len(server_hosts)
    sent: dict[str, float] = defaultdict(float)
    received: dict[str, float] = defaultdict(float)
    for worker in worker_hosts:
        for server, share in zip(server_hosts, shares, strict=True):
            if server == worker:
                continue
            piece = share * size_bytes
            sent[worker] += piece           # push
            received[server] += piece
            sent[server] += piece           # pull
            received[worker] += piece
    busiest = max([*sent.values(), *received.values()], default=0.0)
    return busiest / (nic_mbit * 1e6 / 8 * GOODPUT_SHARE)


@dataclass(frozen=True)
class ServerGuess:
    servers: int                # how many of the cluster's servers to use
    round_seconds: float        # the model's time for one round at that count
    why: str


def guess_servers(worker_hosts: Sequence[str], server_hosts: Sequence[str], nic_mbit: float,
                  size_bytes: float) -> ServerGuess:
    """The fewest of ``server_hosts`` (in the job's order) whose modelled round is within 1%
    of the best count's: more servers than that only cost processes, not time."""
    times = {s: round_seconds(size_bytes, worker_hosts, server_hosts[:s], nic_mbit)
             for s in range(1, len(server_hosts) + 1)}
    best = min(times.values())
    servers = min(s for s, t in times.items() if t <= best * 1.01)
    dedicated = not set(worker_hosts) & set(server_hosts[:servers])
    n = len(set(worker_hosts))
    if dedicated:
        why = (f"{n} worker hosts push and pull S each; {servers} dedicated server(s) carry "
               f"{n}·S/{servers} each: servers' total bandwidth "
               f"{'matches' if servers >= n else 'is the bound, below'} the workers'")
    else:
        why = "servers share worker hosts: the count whose busiest NIC moves the fewest bytes"
    return ServerGuess(servers, times[servers], why)


def summation_split(worker_hosts: int, cpu_hosts: int) -> tuple[float, float, float]:
    """BytePS's optimal split with ``n`` worker hosts (each also summing) and ``k`` CPU-only
    hosts at one NIC rate: (share of each CPU host, share of each worker host, round time in
    units of S/R).

    A worker host moves k·x + 2(n-1)·y each way, a CPU host n·x; equal at the optimum with
    k·x + n·y = 1: x = 2(n-1)/(n²+kn-2k), y = (n-k)/(n²+kn-2k), time n·x — from 2(n-1)/n
    (k = 0, allreduce's cost) down to 1 (k = n). Valid for k ≤ n; beyond, CPU hosts alone.
    """
    n, k = worker_hosts, min(cpu_hosts, worker_hosts)
    if n == 1:
        return 0.0, 1.0, 0.0            # nothing to sum: the lone worker keeps its own bytes
    denominator = n * n + k * n - 2 * k
    x = 2 * (n - 1) / denominator
    y = (n - k) / denominator
    return x, y, n * x
