"""``bpsctl trace DIR``: merge a trace directory into ``merged.json`` and say where time went."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from bpsctl.bench.cli import _write_json
from bpsctl.cliutil import cli_errors, err_console

from .api import load, merge, summarize


def _s(value: float | None) -> str:
    """Seconds to the millisecond; below 10 ms (a GPU's copies) to 10 µs."""
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.5f}"


def trace(directory: Path = typer.Argument(..., metavar="DIR",
                                           help="The trace directory (BPSCTL_TRACE_DIR, or "
                                                "`bench --trace DIR`)."),
          json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                                help="Write the summary as JSON (- for stdout)."),
          plot_file: Path | None = typer.Option(None, "--plot", metavar="FILE",
                                                help="Draw one traced step as lanes (PNG)."),
          ) -> None:
    """Merge the traces of every worker and server into DIR/merged.json (open it in Perfetto
    or chrome://tracing) and summarise where the steps' time went."""
    with cli_errors():
        if plot_file is not None:
            from bpsctl.bench.report import _pyplot
            _pyplot()                       # a missing matplotlib is said up front
        timeline = load(directory)
        merged = merge(timeline)
        summary = summarize(timeline)
        summary["merged"] = str(merged)
        _print(summary)
        err_console.print(f"wrote {merged}", highlight=False, soft_wrap=True)
        _write_json(json_file, summary)
        if plot_file is not None and not summary["communication"]:
            # soft_wrap: the path stays whole, to copy
            err_console.print(f"--plot: did not draw {plot_file}: its lanes (pushes, sums, "
                              "NICs) would be empty, see above", highlight=False, soft_wrap=True)
        elif plot_file is not None:
            from .plot import plot_step
            plot_step(timeline, plot_file)
            err_console.print(f"wrote {plot_file}", highlight=False, soft_wrap=True)


#: traced steps a summary prints (the first few, when things warm up, and the last ones,
#: steady); ``--json`` has every step
STEPS_SHOWN = 10


def shown_steps(rows: list[dict[str, Any]], limit: int = STEPS_SHOWN
                ) -> list[dict[str, Any] | None]:
    """``rows``, or where there are more than ``limit`` its first 3 and last ``limit - 3``
    with None where the others were left out."""
    if len(rows) <= limit:
        return list(rows)
    return [*rows[:3], None, *rows[len(rows) - (limit - 3):]]


def _print(summary: dict[str, Any]) -> None:
    if summary["steps"]:
        table = Table(title="steps (medians over workers, seconds)")
        phases = ("step_s", "forward_s", "backward_s", "wait_s", "optimizer_s")
        for column in ("step", "total", "forward", "backward", "wait", "optimizer"):
            table.add_column(column, justify="right")
        for row in shown_steps(summary["steps"]):
            if row is None:
                left_out = len(summary["steps"]) - STEPS_SHOWN
                table.add_row("…", f"{left_out} more", *[""] * (len(phases) - 1))
                continue
            table.add_row(str(row["step"]), *(_s(row.get(phase)) for phase in phases))
        err_console.print(table)
    table = Table(title="workers (medians per step, seconds)")
    # the staged CUDA path's columns, where a worker staged tensors from a GPU
    staged = any(w.get("to_host_s") is not None for w in summary["workers"])
    for column in ("rank", "steps", "step", "comm", "queued", "push", "wait sum",
                   "skew", "late") + (("to host", "to GPU") if staged else ()):
        table.add_column(column, justify="right")
    for w in summary["workers"]:
        table.add_row(str(w["rank"]), str(w["steps"]), _s(w["step_s"]),
                      _s(w["communication_s"]), _s(w["queued_s"]), _s(w["push_s"]),
                      _s(w["wait_result_s"]), _s(w["push_start_skew_s"]),
                      _s(w["last_result_lateness_s"]),
                      *((_s(w["to_host_s"]), _s(w["to_device_s"])) if staged else ()))
    err_console.print(table)
    # (without communication in the steps, what servers summed came before them: a
    # broadcast, a warm-up; --json has it)
    if summary["servers"] and summary["communication"]:
        table = Table(title="servers")
        for column in ("rank", "rounds", "MiB summed", "busy s", "wait workers s"):
            table.add_column(column, justify="right")
        for s in summary["servers"]:
            table.add_row(str(s["rank"]), str(s["rounds"]), f"{s['bytes_summed'] / 2**20:.1f}",
                          _s(s["busy_s"]), _s(s["wait_workers_s"]))
        err_console.print(table)
    if len(summary.get("flows", [])) > 1:
        table = Table(title="flows to each server (the workers' pushes, sent to acknowledged)")
        for column in ("server", "fed", "most in flight (one worker)"):
            table.add_column(column, justify="right")
        for flow in summary["flows"]:
            table.add_row(str(flow["server"]), f"{flow['fed']:.0%}",
                          f"{flow['most_bytes_in_flight'] / 2**20:.2f} MiB")
        err_console.print(table)
    if summary["nics"]:
        table = Table(title="NICs over the traced steps")
        for column in ("NIC", "tx Mbit/s", "rx Mbit/s", "used", "longest idle s"):
            table.add_column(column, justify="right")
        for nic in summary["nics"]:
            table.add_row(nic["nic"], _s(nic["tx_mbit_s"]), _s(nic["rx_mbit_s"]),
                          "-" if nic["utilisation"] is None else f"{nic['utilisation']:.0%}",
                          _s(nic["longest_idle_s"]))
        err_console.print(table)
    for sentence in summary["sentences"]:
        err_console.print(f"- {sentence}", highlight=False)
