"""One traced step as a picture: a lane per worker's uplink, per server's summation and per NIC."""
from __future__ import annotations

import zlib
from pathlib import Path

from bpsctl.bench.report import _pyplot
from bpsctl.config import ConfigError

from .api import Timeline


def plot_step(timeline: Timeline, path: Path) -> None:
    """The last complete step of worker 0 (the others' spans in the same time range): pushes
    on each worker's lane and sums on each server's, coloured by tensor, and what each NIC
    sent (bar height: share of its rate, or of its peak when the rate is unknown)."""
    plt = _pyplot()
    workers, servers = timeline.of("worker"), timeline.of("server")
    steps = sorted(workers[0].spans.get("step", []), key=lambda s: s.start_us) if workers else []
    if not steps:
        raise ConfigError(f"{timeline.directory}: no complete step was traced; trace at least "
                          "two steps (BPSCTL_TRACE_END_STEP > BPSCTL_TRACE_START_STEP + 1)")
    step = steps[-1]
    start, stop = step.start_us, step.end_us
    # servers name partitions, workers name tensors: colour a partition as its tensor
    tensor_of = {int(s.args["part"]): s.name for w in workers for s in w.spans.get("push", [])
                 if "part" in s.args}
    colormap = plt.get_cmap("tab20")

    def colour(name: str) -> object:
        return colormap(zlib.crc32(name.encode()) % 20)

    lanes = [(f"worker {w.rank} push", w.spans.get("push", []), False) for w in workers]
    lanes += [(f"server {s.rank} sum", s.spans.get("sum", []), True) for s in servers]
    nics = timeline.nics
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * (len(lanes) + len(nics))))
    for row, (_, spans, by_part) in enumerate(lanes):
        shown = sorted((s for s in spans if s.end_us >= start and s.start_us <= stop),
                       key=lambda s: s.start_us)
        # spans of one lane overlap (several partitions in flight): each goes to the first
        # sub-row free at its start, so none hides another
        free_at: list[float] = []
        placed = []
        for span in shown:
            sub = next((i for i, end in enumerate(free_at) if end <= span.start_us), None)
            if sub is None:
                sub = len(free_at)
                free_at.append(0.0)
            free_at[sub] = span.end_us
            placed.append((span, sub))
        height = 0.8 / max(1, len(free_at))
        for span, sub in placed:
            name = tensor_of.get(int(span.args.get("part", -1)), span.name) if by_part \
                else span.name
            ax.broken_barh([((span.start_us - start) / 1e3, (span.end_us - span.start_us) / 1e3)],
                           (row - 0.4 + sub * height, height), facecolors=colour(name),
                           edgecolor="white", linewidth=0.3)
    # a NIC's lane: what it sent in each sample interval, as a share of its rate (or peak)
    for row, nic in enumerate(nics, start=len(lanes)):
        rates = nic.rates()
        in_step = [r for r in rates if r[2] >= start and r[1] <= stop]
        top = nic.rate_mbit or max((r for r, _, _ in rates), default=0.0) or 1.0
        for rate, a, b in in_step:
            height = 0.8 * min(1.0, rate / top)
            ax.broken_barh([((max(a, start) - start) / 1e3, (min(b, stop) - max(a, start)) / 1e3)],
                           (row + 0.4 - height, height), facecolors="0.35")
    labels = [label for label, _, _ in lanes] + [f"NIC {n.address} tx" for n in nics]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms into step {step.args.get('round', '?')} "
                  f"({(stop - start) / 1e3:.0f} ms); colour: tensor")
    ax.set_xlim(0, (stop - start) / 1e3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
