"""Showing benchmark results: rich tables on the terminal, PNG plots (matplotlib)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..config import ConfigError, format_bytes


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def comm_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-size reports inside any comm result (one size, several, or a sweep)."""
    if report["kind"] == "comm_sweep":
        return [r for point in report["points"] for r in comm_reports(point)]
    return report.get("sizes", [report])


def _network(report: dict[str, Any]) -> str:
    """What the figures went through: the NIC rate, else an SSH cluster's hosts, else loopback."""
    if report["nic_mbit"]:
        return f"NIC {report['nic_mbit']:g} Mbit/s"
    return f"SSH cluster of {report['hosts_file']}" if report.get("hosts_file") else "loopback"


def print_comm(console: Console, report: dict[str, Any]) -> None:
    reports = comm_reports(report)
    first = reports[0]
    nic = _network(first)
    sweep = report["kind"] == "comm_sweep"
    shape = "" if sweep else f"{first['workers']} workers x {first['servers']} servers, "
    table = Table(title=f"bench comm: {shape}{nic}, median of {first['repeats']}")
    columns = (["workers"] if sweep else []) + ["size", "system", "seconds", "algbw MB/s",
                                                 "busbw MB/s", "NIC frac", "speedup"]
    for column in columns:
        table.add_column(column, justify="left" if column == "system" else "right", no_wrap=True)
    for r in reports:
        for row in r["results"]:
            speedup = r["speedup"].get(row["system"])
            system = row["system"] + (f" {row['security']}" if "security_cost" in r
                                      and "security" in row else "")
            cells = ([str(r["workers"])] if sweep else []) + [
                format_bytes(r["size_bytes"]), system, f"{row['seconds']:.4f}",
                f"{row['algbw_MBps']:.0f}", f"{row['busbw_MBps']:.0f}",
                _fmt(row["nic_fraction"], ".2f"), "" if speedup is None else f"{speedup:.2f}x"]
            table.add_row(*cells)
    console.print(table)
    for r in comm_reports(report):
        if "fraction_of_raw" in r:
            console.print(f"{format_bytes(r['size_bytes'])}: bpsctl algbw is "
                          f"{r['fraction_of_raw']:.0%} of raw ZeroMQ one-way throughput "
                          "(push_pull moves the bytes both ways)", highlight=False)
        if "security_cost" in r:
            console.print(f"{format_bytes(r['size_bytes'])}: time of each security mode over "
                          + ("none" if "none" in r["security_cost"] else "the first") + ": "
                          + ", ".join(f"{mode} {cost:.2f}x"
                                      for mode, cost in r["security_cost"].items()),
                          highlight=False)
        if "allreduce" in r["speedup"] and "theory_speedup" in r:
            console.print(f"{r['workers']} workers, {format_bytes(r['size_bytes'])}: speedup over "
                          f"ring allreduce {r['speedup']['allreduce']:.2f}x "
                          f"(theory 2(n-1)/n = {r['theory_speedup']:.2f}x)", highlight=False)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'bpsctl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_comm(report: dict[str, Any], path: Path) -> None:
    """algbw per system against size; for a sweep, speedup against workers with the theory."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if report["kind"] == "comm_sweep":
        points = [p if "results" in p else p["sizes"][0] for p in report["points"]]
        workers = [p["workers"] for p in points]
        measured = [p["speedup"].get("allreduce") for p in points]
        theory = [2 * (n - 1) / n for n in workers]
        ax.plot(workers, theory, "--", color="gray", label="theory 2(n-1)/n")
        ax.plot(workers, measured, "o-", label="measured: allreduce time / bpsctl time")
        ax.set_xlabel("workers (servers = workers)")
        ax.set_ylabel("speedup over ring allreduce")
        nic = report.get("nic_mbit")
        ax.set_title(f"bpsctl vs gloo allreduce, {format_bytes(report['size_bytes'])}"
                     + (f", NIC {nic:g} Mbit/s" if nic else ""))
    else:
        reports = comm_reports(report)
        systems = [row["system"] for row in reports[0]["results"]]
        sizes = [r["size_bytes"] / 2**20 for r in reports]
        for system in systems:
            values = [next(row["algbw_MBps"] for row in r["results"] if row["system"] == system)
                      for r in reports]
            ax.plot(sizes, values, "o-", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per worker (MiB)")
        ax.set_ylabel("algbw (MB/s)")
        first = reports[0]
        ax.set_title(f"bench comm: {first['workers']} workers x {first['servers']} servers"
                     + (f", NIC {first['nic_mbit']:g} Mbit/s" if first["nic_mbit"] else ""))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_train(console: Console, report: dict[str, Any]) -> None:
    nic = ", " + _network(report)
    table = Table(title=f"bench {report['model']}: {report['workers']} workers, "
                        f"{report['servers']} servers{nic}, batch {report['batch_size']}, "
                        f"{report['image_size']}x{report['image_size']} images, "
                        f"{report['iters']} iters x {report['batches_per_iter']} batches"
                        + (f", {report['rounds']} rounds" if report.get("rounds", 1) > 1 else ""))
    for column in ("system", "img/sec", "± 1.96σ", "per worker", "s/step", "speedup", "version"):
        table.add_column(column, justify="left" if column in ("system", "version") else "right")
    for row in report["results"]:
        speedup = report["speedup"].get(row["system"])
        table.add_row(row["system"], f"{row['img_per_sec']:.2f}", f"{row['img_per_sec_ci95']:.2f}",
                      f"{row['img_per_sec_per_worker']:.2f}", f"{row['step_seconds']:.3f}",
                      "" if speedup is None else f"bpsctl {speedup:.2f}x", row.get("version", ""))
    console.print(table)
    for system, ratios in report.get("speedup_by_round", {}).items():
        console.print(f"bpsctl over {system}, round by round: "
                      + ", ".join(f"{ratio:.2f}x" for ratio in ratios)
                      + f" (median {report['speedup'][system]:.2f}x)", highlight=False)


def plot_train(report: dict[str, Any], path: Path) -> None:
    """img/sec of the whole job per system, with its ± 1.96σ interval."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    systems = [row["system"] for row in report["results"]]
    values = [row["img_per_sec"] for row in report["results"]]
    errors = [row["img_per_sec_ci95"] for row in report["results"]]
    bars = ax.bar(systems, values, yerr=errors, capsize=6,
                  color=["tab:blue", "tab:orange", "tab:green", "tab:gray"][:len(systems)])
    for bar, system in zip(bars, systems, strict=True):
        speedup = report["speedup"].get(system)
        if speedup is not None:
            ax.annotate(f"bpsctl {speedup:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                   bar.get_height()),
                        ha="center", va="bottom", xytext=(0, 4), textcoords="offset points")
    nic = ", " + _network(report)
    ax.set_title(f"{report['model']}: {report['workers']} workers x {report['servers']} servers"
                 f"{nic}, batch {report['batch_size']}")
    ax.set_ylabel("img/sec (whole job), ± 1.96σ")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
