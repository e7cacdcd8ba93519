"""A traffic model of one push_pull round: the first guess for how many servers to use, and
how much of the bytes each server should sum.

Each worker host sends its S bytes of gradients once and receives the sum once (several
workers on one host reduce locally first). The engine spreads partitions over the job's
servers by their shares of the bytes (evenly unless told otherwise), so a server of share s
takes s·S from every worker host and sends s·S back to each; a byte between a worker and a
server on the same host crosses no NIC. The round lasts as long as the busiest NIC direction:
max over hosts of max(in, out) / rate.

Dedicated server hosts (what ``--emulate`` builds): each of n worker hosts moves S each way,
each of s servers n·S/s each way, so a round takes max(S/R_w, n·S/(s·R_s)) — flat once
s ≥ n·R_w/R_s, i.e. s ≥ n at equal NIC rates. Servers on the worker hosts and on k CPU-only
hosts at once: BytePS (OSDI'20, §3.2) splits the summation between them; :func:`summation_split`
gives that optimum at equal rates, :func:`optimal_shares` at any rates, and :func:`plan_layout`
turns a cluster's hosts into each server's share.

This module imports nothing of bpsctl: the launchers plan a cluster's layout with it.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: TCP goodput as a share of an emulated NIC's configured rate (docs/benchmarks.md)
GOODPUT_SHARE = 0.957


def round_seconds(size_bytes: float, worker_hosts: Sequence[str], server_hosts: Sequence[str],
                  nic_mbit: float, shares: Sequence[float] | None = None,
                  rates_mbit: Mapping[str, float] | None = None) -> float:
    """NIC-bound time of one push_pull round of ``size_bytes`` per worker stream.

    ``worker_hosts`` names the host of each stream (a host named twice pushes twice: workers
    that push on their own); ``server_hosts`` each server's host in the order the job uses
    them; ``shares`` the fraction of the bytes each server sums (default: equal). A host's
    NIC runs at ``rates_mbit[host]`` if given, else ``nic_mbit``, at TCP's goodput.
    """
    if shares is None:
        shares = [1 / len(server_hosts)] * len(server_hosts)
    total_share = sum(shares)
    shares = [share / total_share for share in shares]
    rates = rates_mbit or {}
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
    return max((max(sent[host], received[host]) / goodput_bytes_s(rates.get(host, nic_mbit))
                for host in {*sent, *received}), default=0.0)


def goodput_bytes_s(nic_mbit: float) -> float:
    """What TCP carries through a NIC of ``nic_mbit`` each way, in bytes per second."""
    return nic_mbit * 1e6 / 8 * GOODPUT_SHARE


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
    (k = 0, allreduce's cost) down to 1 (k = n). With k > n the worker hosts' own S bounds
    the round at 1 whatever the split, and the CPU hosts alone take it: x = 1/k, y = 0.
    """
    n, k = worker_hosts, cpu_hosts
    if n == 1:
        return 0.0, 1.0, 0.0            # nothing to sum: the lone worker keeps its own bytes
    if k > n:
        return 1 / k, 0.0, 1.0
    denominator = n * n + k * n - 2 * k
    x = 2 * (n - 1) / denominator
    y = (n - k) / denominator
    return x, y, n * x


def optimal_shares(worker_rates: Sequence[float], colocated: Sequence[bool],
                   cpu_rates: Sequence[float]) -> tuple[list[float], list[float], float]:
    """The split of :func:`summation_split` at any NIC rates: (share of each worker host's
    servers, share of each CPU host's, round time per byte of S in the rates' units).

    ``worker_rates`` are the n worker hosts' NIC rates, ``colocated`` says which of them runs
    servers, ``cpu_rates`` the CPU-only hosts' (any one unit, e.g. Mbit/s). Per byte of S, a
    worker host with share y moves 1 + (n-2)·y each way (its own S less what its server keeps,
    plus its server's sums to the n-1 others; a worker host without servers moves 1), a CPU host
    with share x moves n·x. The round T is the least for which the shares each host can take
    within T sum to 1: y ≤ (T·R - 1)/(n-2), x ≤ T·C/n, and T ≥ 1/R of every worker host
    (linear in T, so solved exactly). At T the CPU hosts take all they can and the worker
    hosts the rest, in proportion to what each can take (with n = 2 a worker host's traffic
    does not depend on its share: in proportion to its rate). Equal rates give
    :func:`summation_split`'s shares.
    """
    n = len(worker_rates)
    if n == 0 or len(colocated) != n:
        raise ValueError("optimal_shares: expected a rate and a colocated flag per worker host")
    if any(not (math.isfinite(r) and r > 0) for r in (*worker_rates, *cpu_rates)):
        raise ValueError("optimal_shares: every NIC rate must be a positive number")
    hosts = [i for i in range(n) if colocated[i]]
    if not hosts and not cpu_rates:
        raise ValueError("optimal_shares: no host runs a server")
    if n == 1:
        if hosts:                       # the lone worker host sums its own bytes: no traffic
            return [1.0], [0.0] * len(cpu_rates), 0.0
        total = sum(cpu_rates)
        return [0.0], [c / total for c in cpu_rates], max(1 / worker_rates[0], 1 / total)
    floor = max(1 / r for r in worker_rates)
    cpu_total = sum(cpu_rates)
    if n == 2 and hosts:
        time = floor
    elif n == 2:
        time = max(floor, n / cpu_total)
    else:
        # capacity(T) = T·(ΣC/n + ΣR_c/(n-2)) - n_c/(n-2) = 1
        slope = cpu_total / n + sum(worker_rates[i] for i in hosts) / (n - 2)
        time = max(floor, (1 + len(hosts) / (n - 2)) / slope)
    cpu = [time * c / n for c in cpu_rates]
    taken = sum(cpu)
    if taken >= 1:
        return [0.0] * n, [x / taken for x in cpu], time
    if n == 2:
        room = [worker_rates[i] if colocated[i] else 0.0 for i in range(n)]
    else:
        room = [max(0.0, (time * worker_rates[i] - 1) / (n - 2)) if colocated[i] else 0.0
                for i in range(n)]
    if sum(room) <= 0:                  # rounding at the floor: the CPU hosts take it all
        return [0.0] * n, [x / taken for x in cpu], time
    scale = (1 - taken) / sum(room)
    return [r * scale for r in room], cpu, time


@dataclass(frozen=True)
class Layout:
    """Which hosts run servers and what share of the bytes each server sums.

    ``worker_hosts`` are the hosts that run workers (each once), ``server_hosts`` each server's
    host in plan order, ``shares`` each server's share (summing to 1). A server on a worker
    host is colocated; the other server hosts are the CPU hosts.
    ``rates_mbit`` gives a host's NIC rate where known."""

    worker_hosts: tuple[str, ...]
    server_hosts: tuple[str, ...]
    shares: tuple[float, ...]
    rates_mbit: tuple[tuple[str, float], ...] = ()
    source: str = "model"               # model | hosts file | the knob BPSCTL_CPU_SHARE

    @property
    def colocated(self) -> tuple[bool, ...]:
        return tuple(host in self.worker_hosts for host in self.server_hosts)

    @property
    def cpu_hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h for h in self.server_hosts if h not in self.worker_hosts))

    @property
    def colocated_hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h for h in self.server_hosts if h in self.worker_hosts))

    def round_seconds(self, size_bytes: float, nic_mbit: float) -> float:
        """The modelled round of ``size_bytes`` per worker host (one stream each), a host's NIC
        at its rate where known, else at ``nic_mbit``."""
        return round_seconds(size_bytes, self.worker_hosts, self.server_hosts, nic_mbit,
                             self.shares, dict(self.rates_mbit) or None)

    def round_factor(self) -> float:
        """The round in units of S/R, R the slowest worker host's NIC (its own S alone at
        full rate takes 1): 2(n-1)/n for servers on the worker hosts only at equal rates."""
        rates = dict(self.rates_mbit)
        default = min(rates.values(), default=1.0)
        slowest = min(rates.get(h, default) for h in self.worker_hosts)
        return self.round_seconds(goodput_bytes_s(slowest), default)

    def to_json(self) -> dict[str, Any]:
        return {"worker_hosts": list(self.worker_hosts), "server_hosts": list(self.server_hosts),
                "shares": list(self.shares), "rates_mbit": dict(self.rates_mbit),
                "source": self.source}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        return cls(tuple(data["worker_hosts"]), tuple(data["server_hosts"]),
                   tuple(float(s) for s in data["shares"]),
                   tuple(sorted((str(h), float(r)) for h, r in data["rates_mbit"].items())),
                   str(data["source"]))

    def describe(self) -> str:
        """One line per host kind: what each sums and the modelled round."""
        n, k = len(self.worker_hosts), len(self.cpu_hosts)
        by_host: dict[str, float] = defaultdict(float)
        for host, share in zip(self.server_hosts, self.shares, strict=True):
            by_host[host] += share
        parts = []
        if self.colocated_hosts:
            parts.append(f"{len(self.colocated_hosts)} of {n} worker host(s) sum "
                         + ", ".join(f"{by_host[h]:.3f}" for h in self.colocated_hosts))
        if k:
            parts.append(f"{k} CPU host(s) sum " + ", ".join(f"{by_host[h]:.3f}"
                                                              for h in self.cpu_hosts))
        rates = dict(self.rates_mbit)
        seconds = ""
        if rates and all(h in rates for h in (*self.worker_hosts, *self.server_hosts)):
            example = 64 * 2**20
            seconds = (f", {self.round_seconds(example, min(rates.values())):.2f} s for 64 MiB "
                       "per worker host")
        return (f"layout ({self.source}): {'; '.join(parts)} of the bytes; modelled round "
                f"{self.round_factor():.2f} S/R{seconds} (servers on the worker hosts only: "
                f"{pure_round_factor(n, 0):.2f}" + (f", the CPU hosts only: "
                                                    f"{pure_round_factor(n, k):.2f}" if k else "")
                + " S/R)")


def pure_round_factor(worker_hosts: int, cpu_hosts: int) -> float:
    """The round of a pure layout at equal rates, in units of S/R: servers on the n worker
    hosts only (``cpu_hosts`` 0: 2(n-1)/n, allreduce's cost), or on the k CPU hosts only
    (max(1, n/k): each worker host moves S, each CPU host n·S/k)."""
    n, k = worker_hosts, cpu_hosts
    if k == 0:
        return 2 * (n - 1) / n
    return max(1.0, n / k)


def group_shares(colocated: Sequence[bool], cpu_share: float) -> list[float]:
    """Each server's share when the servers on CPU-only hosts sum ``cpu_share`` of the bytes
    together and the servers on worker hosts the rest, evenly within each group (a group with
    no server gives its part to the other)."""
    cpu = sum(1 for c in colocated if not c)
    on_workers = len(colocated) - cpu
    if cpu == 0 or on_workers == 0:
        return [1 / len(colocated)] * len(colocated)
    return [(1 - cpu_share) / on_workers if c else cpu_share / cpu for c in colocated]


def job_shares(registered: Sequence[float | None], colocated: Sequence[bool],
               cpu_share: float | None) -> list[float]:
    """The share of the bytes each of a job's servers sums, as the scheduler places them:
    the job's ``cpu_share`` (BPSCTL_CPU_SHARE) split by :func:`group_shares` when it gives
    one, else what the servers registered with (the cluster's layout, planned at `up`;
    rescaled to sum to 1 over the servers the job uses), else evenly."""
    if cpu_share is not None:
        return group_shares(colocated, cpu_share)
    given = [share for share in registered if share is not None]
    if len(given) < len(registered) or not sum(given):
        return [1 / len(registered)] * len(registered)
    return [share / sum(given) for share in given]


def plan_layout(worker_hosts: Sequence[str], server_hosts: Sequence[str], *,
                rates_mbit: Mapping[str, float] | None = None, cpu_share: float | None = None,
                given: Sequence[float] | None = None) -> Layout:
    """Each server's share of the bytes for servers on ``server_hosts`` (in plan order; spares
    left out) beside workers on ``worker_hosts``: ``cpu_share`` if given (:func:`group_shares`),
    else ``given`` (a hosts file's ``share:`` per server), else the model's optimum at the
    hosts' NIC rates (equal rates where none is known): :func:`optimal_shares` per host, split
    evenly among a host's servers."""
    workers = tuple(dict.fromkeys(worker_hosts))
    servers = tuple(server_hosts)
    rates = dict(rates_mbit or {})
    rate_items = tuple(sorted(rates.items()))
    colocated = [h in workers for h in servers]
    if not servers:
        raise ValueError("plan_layout: no server")
    if cpu_share is not None:
        return Layout(workers, servers, tuple(group_shares(colocated, cpu_share)), rate_items,
                      "BPSCTL_CPU_SHARE")
    if given is not None:
        total = sum(given)
        return Layout(workers, servers, tuple(share / total for share in given), rate_items,
                      "hosts file")
    cpu_hosts = list(dict.fromkeys(h for h in servers if h not in workers))
    default = min(rates.values(), default=1.0)
    worker_shares, cpu_shares, _ = optimal_shares(
        [rates.get(h, default) for h in workers], [h in servers for h in workers],
        [rates.get(h, default) for h in cpu_hosts])
    host_share = {**dict(zip(workers, worker_shares, strict=True)),
                  **dict(zip(cpu_hosts, cpu_shares, strict=True))}
    count = {h: servers.count(h) for h in set(servers)}
    return Layout(workers, servers, tuple(host_share[h] / count[h] for h in servers),
                  rate_items)
