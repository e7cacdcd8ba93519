"""`bpsctl bench ...`: flags in, figures out (a table on stderr, JSON to a file)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from bpsctl.cliutil import build_config, cli_errors, err_console, knob_option
from bpsctl.config import ConfigError, format_bytes, parse_size

from .api import BenchError, CommSettings, run_comm

bench_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Benchmarks, measured side by side in one run.")


def _size(text: str, flag: str) -> int:
    try:
        return parse_size(text, flag)
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None


def _write_json(path: Optional[Path], report: dict[str, Any]) -> None:
    if path is None:
        return
    if str(path) == "-":
        typer.echo(json.dumps(report, indent=2))
        return
    path.write_text(json.dumps(report, indent=2) + "\n")
    err_console.print(f"wrote {path}", highlight=False)


@bench_app.command()
def comm(ctx: typer.Context,
         workers: int = typer.Option(2, "--workers", "-n", min=1, help="Worker processes."),
         servers: Optional[int] = typer.Option(None, "--servers", min=1,
                                               help="Summation servers (default: as many as workers)."),
         size: str = typer.Option("64MiB", "--size", help="Bytes each worker push_pulls per round "
                                  "(64MiB, 4MB, 4096000)."),
         tensors: int = typer.Option(8, "--tensors", min=1, help="Tensors the bytes are spread over."),
         warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed rounds first."),
         repeats: int = typer.Option(10, "--repeats", min=1, help="Timed rounds (the median is reported)."),
         partition_bytes: Optional[str] = knob_option("partition_bytes", "--partition-bytes"),
         credit_bytes: Optional[str] = knob_option("credit_bytes", "--credit-bytes"),
         raw: bool = typer.Option(True, "--raw/--no-raw",
                                  help="Also measure raw ZeroMQ throughput for the same bytes."),
         json_file: Optional[Path] = typer.Option(None, "--json", metavar="FILE",
                                                  help="Write the results as JSON (- for stdout)."),
         ) -> None:
    """push_pull throughput of N workers and K servers on this machine, beside raw ZeroMQ."""
    with cli_errors():
        flags = {"partition_bytes": (None if partition_bytes is None
                                     else _size(partition_bytes, "--partition-bytes"), "--partition-bytes"),
                 "credit_bytes": (None if credit_bytes is None
                                  else _size(credit_bytes, "--credit-bytes"), "--credit-bytes")}
        config = build_config(ctx, flags)
        settings = CommSettings(workers=workers, servers=servers or workers,
                                size_bytes=_size(size, "--size"), tensors=tensors,
                                warmup=warmup, repeats=repeats, raw=raw)
        if settings.size_bytes < 4 * tensors:
            raise ConfigError(f"--size: {size} is too small for {tensors} float32 tensors "
                              f"(at least {4 * tensors} bytes)")
        with err_console.status(f"bench comm: {workers} worker(s), {settings.servers} server(s), "
                                f"{format_bytes(settings.size_bytes)} in {tensors} tensors"):
            try:
                report = run_comm(config, settings)
            except BenchError as exc:
                err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
                raise typer.Exit(1) from None
    _print_comm(report)
    _write_json(json_file, report)


def _print_comm(report: dict[str, Any]) -> None:
    table = Table(title=f"bench comm: {report['workers']} workers x {report['servers']} servers, "
                        f"{format_bytes(report['size_bytes'])} in {report['tensors']} tensors, "
                        f"median of {report['repeats']}")
    for column in ("system", "seconds", "algbw MB/s", "busbw MB/s", "push_pulls/s"):
        table.add_column(column, justify="right" if column != "system" else "left")
    for row in report["results"]:
        per_s = row.get("push_pulls_per_s")
        table.add_row(row["system"], f"{row['seconds']:.4f}", f"{row['algbw_MBps']:.0f}",
                      f"{row['busbw_MBps']:.0f}", f"{per_s:.0f}" if per_s else "")
    err_console.print(table)
    if "fraction_of_raw" in report:
        err_console.print(f"bpsctl algbw is {report['fraction_of_raw']:.0%} of raw ZeroMQ "
                          "one-way throughput (push_pull moves the bytes both ways)",
                          highlight=False)
