"""A seeded schedule of faults for a chaos run (docs/chaos.md): which fault, on which emulated
host, when and for how long. A pure function of its arguments, so a seed reproduces a run.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError

#: each kind's length range in seconds (None: for good) and its parameters' ranges
KINDS: dict[str, tuple[tuple[float, float] | None, dict[str, tuple[float, float]]]] = {
    "kill": (None, {}),
    "pause": ((1.0, 30.0), {}),
    "partition": ((1.0, 30.0), {}),
    "lossy": ((10.0, 60.0), {"loss_percent": (1.0, 5.0), "delay_ms": (10.0, 100.0)}),
    "collapse": ((10.0, 60.0), {"factor": (0.01, 0.05)}),
    "disk": ((5.0, 30.0), {}),
}
#: the target of a ``disk`` fault: the cluster's state and log directory, which every emulated
#: host shares (they share this machine's file system)
DISK = "logs"


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on emulated host ``target`` (``w0``, ``s1``, ...) from ``start_s``
    after the job began, for ``length_s`` (None: for good), with its ``params``."""

    kind: str
    target: str
    start_s: float
    length_s: float | None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return float("inf") if self.length_s is None else self.start_s + self.length_s

    def describe(self) -> str:
        what = ", ".join(f"{k} {v:g}" for k, v in self.params.items())
        span = "for good" if self.length_s is None else f"for {self.length_s:.1f} s"
        return (f"{self.kind} {self.target} at {self.start_s:.1f} s {span}"
                + (f" ({what})" if what else ""))


def parse_kinds(text: str) -> tuple[str, ...]:
    """``--faults pause,partition`` (or ``all``) as kinds, checked."""
    kinds = tuple(KINDS) if text.strip() == "all" else \
        tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ConfigError(f"--faults: unknown kind(s) {', '.join(unknown) or '(none)'}; expected "
                          f"a comma-separated list of {', '.join(KINDS)}, or all")
    return kinds


def make_schedule(seed: int, duration_s: float, workers: Sequence[str], servers: Sequence[str],
                  kinds: Sequence[str] = tuple(KINDS), count: tuple[int, int] = (3, 6),
                  together: float = 0.2) -> list[Fault]:
    """3-6 faults (``count``) drawn with ``random.Random(seed)`` within ``duration_s``, in order
    of their start. ``workers``/``servers``: the hosts' names. A fault's host has no other
    fault while it lasts; ``kill`` never takes the last server nor more than one worker (so
    the job can go on); with probability ``together`` a fault gets a second one on another
    host in the same second (two at once)."""
    if duration_s <= 0:
        raise ConfigError(f"--duration: expected more than 0 seconds, got {duration_s:g}")
    rng = random.Random(seed)
    hosts = [*workers, *servers]
    faults: list[Fault] = []
    killed: set[str] = set()
    wanted = rng.randint(*count)
    attempts = 0
    while len(faults) < wanted and attempts < 100 * wanted:
        attempts += 1
        start = round(rng.uniform(0.05, 0.8) * duration_s, 1)
        group = [start] if rng.random() >= together else [start, start]
        for at in group:
            if len(faults) >= wanted:
                break
            kind = rng.choice(list(kinds))
            target = DISK if kind == "disk" else rng.choice(hosts)
            span, ranges = KINDS[kind]
            length = None if span is None else round(rng.uniform(*span), 1)
            fault = Fault(kind, target, at, length,
                          {name: round(rng.uniform(*r), 3) for name, r in ranges.items()})
            if _fits(fault, faults, killed, workers, servers):
                faults.append(fault)
                if kind == "kill":
                    killed.add(target)
    return sorted(faults, key=lambda f: (f.start_s, f.target))


def _fits(fault: Fault, faults: list[Fault], killed: set[str], workers: Sequence[str],
          servers: Sequence[str]) -> bool:
    if fault.target in killed:
        return False
    for other in faults:
        if other.target == fault.target and fault.start_s < other.end_s and \
                other.start_s < fault.end_s:
            return False
    if fault.kind == "kill":
        if fault.target in servers:
            return len([s for s in servers if s not in killed]) > 1
        return not any(w in killed for w in workers)
    return True
