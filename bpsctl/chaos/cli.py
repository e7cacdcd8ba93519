"""`bpsctl chaos`: the command line of bpsctl/chaos/api.py, and its table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from ..cliutil import (
    build_config,
    cli_errors,
    config_file_option,
    err_console,
    knob_option,
    missing_python_script,
)
from ..config import ConfigError
from .api import ChaosSettings, parse_seeds, run_chaos
from .faults import lossy_support
from .schedule import parse_kinds


def chaos(ctx: typer.Context,
          workers: int = typer.Option(4, "--workers", min=2, help="Emulated worker hosts."),
          servers: int = typer.Option(4, "--servers", min=1,
                                      help="Emulated server hosts (spares besides)."),
          nic: str | None = knob_option("nic", "--nic"),
          spare_servers: int | None = knob_option("spare_servers", "--spare-servers"),
          max_restarts: int | None = knob_option("max_restarts", "--max-restarts", min=0),
          steps: int | None = typer.Option(
              None, "--steps", min=10, help="Steps of the default training job (300)."),
          seed: str = typer.Option("0", "--seed", metavar="SEED[,SEED|A-B]",
                                   help="Seeds the schedule: the same seed, the same faults "
                                        "at the same times. Several (1,4,9 or 1-50): a run "
                                        "under each, on a cluster of its own, and a summary."),
          duration: float | None = typer.Option(
              None, "--duration", help="Seconds over which faults start (default: the length "
                                       "of the fault-free run)."),
          faults: str = typer.Option("all", "--faults", metavar="KIND[,KIND]",
                                     help="Kinds of fault: kill, pause, partition, lossy, "
                                          "collapse, disk, or all."),
          json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
          config_file: Path | None = config_file_option(),
          cmd: list[str] | None = typer.Argument(
              None, metavar="[-- CMD]",
              help="A training command of one's own instead of the default job, e.g. python "
                   "train.py (docs/chaos.md: what it records for the checks of steps)."),
          ) -> None:
    """Train through seeded faults on an emulated cluster (root), then check that nothing was
    lost or applied twice.

    Builds the cluster, runs a small training job once without faults and once while a
    schedule seeded by --seed kills, pauses, partitions, slows or collapses its hosts' links
    and fills the disk under its logs, then checks: exit 0, ranks bitwise equal after every
    step, final parameters equal to the fault-free run's within float32 rounding of
    summation order, no step stalled past the heartbeat timeout + 2 s (but under a collapsed
    link), a full disk said once and stopping nothing, every fault undone, nothing left
    behind. Exits 1 if an invariant failed, keeping that run's output, steps and logs in
    bpsctl-chaos-seed-N/ beside the --json report (or here). Unless given: --nic 1gbit,
    --spare-servers 1, --max-restarts 1, --min-workers one less than --workers. After --, a
    training command of one's own runs instead of the default job (bpsctl.chaos.job.Recorder
    records its steps for the checks of steps; without it they do not apply).
    """
    with cli_errors():
        config = build_config(ctx, {"nic": (nic or "1gbit", "--nic"),
                                    "spare_servers": (1 if spare_servers is None
                                                      else spare_servers, "--spare-servers"),
                                    "max_restarts": (1 if max_restarts is None
                                                     else max_restarts, "--max-restarts")},
                              config_file, read_file=True)
        kinds = parse_kinds(faults)
        if cmd and steps is not None:
            raise ConfigError("--steps: the number of steps of the default job; a command of "
                              "one's own (-- CMD) decides its own; drop --steps")
        cmd = cmd or []
        missing = missing_python_script(cmd, Path.cwd()) if cmd else None
        if missing is not None:
            raise ConfigError(f"chaos: {cmd[0]} cannot open {missing!r}: no such file in "
                              f"{Path.cwd()} (the command after -- runs there on every "
                              "worker; check the script's path)")
        support = lossy_support() if "lossy" in kinds else "netem"
        if support == "nft":
            err_console.print("note: lossy links lose packets but are not delayed, reordered "
                              "or duplicated: this kernel has no netem (sch_netem); they drop "
                              "packets with nftables", highlight=False)
        elif not support:
            if faults.strip() != "all":
                raise ConfigError("--faults lossy: a lossy link needs the kernel's netem qdisc "
                                  "(sch_netem), which this kernel does not have, or nftables "
                                  "(apt-get install nftables); leave lossy out")
            kinds = tuple(k for k in kinds if k != "lossy")
            err_console.print("note: lossy links left out: this kernel has no netem "
                              "(sch_netem), and nftables' nft is not installed", highlight=False)
        seeds = parse_seeds(seed)
        settings = ChaosSettings(workers=workers, servers=servers,
                                 steps=300 if steps is None else steps,
                                 duration_s=duration, kinds=kinds, command=tuple(cmd))
        with err_console.status("chaos") as spinner:
            # a failed run's output and logs are kept beside the report (or here)
            runs = run_chaos(config, settings, seeds, lambda text: spinner.update(text),
                             keep_dir=Path.cwd() if json_out is None else json_out.parent)
    for report in runs["runs"]:
        print_chaos(report)
    # one seed: its report as it is; several: every run's, and the summary
    if len(seeds) > 1:
        print_summary(runs)
    if json_out is not None:
        json_out.write_text(json.dumps(runs if len(seeds) > 1 else runs["runs"][0], indent=2))
        err_console.print(f"wrote {json_out}", highlight=False)
    raise typer.Exit(0 if runs["ok"] else 1)


def print_chaos(report: dict[str, Any]) -> None:
    """Each fault with when bpsctl noticed it and what it did; then each invariant."""
    table = Table(title=f"bpsctl chaos, seed {report['seed']}: {len(report['faults'])} faults "
                        f"over {report['duration_s']:g} s")
    for column in ("fault", "target", "at s", "for s", "noticed s", "what bpsctl did"):
        table.add_column(column, justify="right" if " s" in column else "left")
    for record in report["faults"]:
        fault = record["fault"]
        what = record["error"] or record["action"] or "-"
        table.add_row(fault["kind"], fault["target"], f"{fault['start_s']:g}",
                      "-" if fault["length_s"] is None else f"{fault['length_s']:g}",
                      "-" if record["noticed_s"] is None else f"{record['noticed_s']:g}",
                      what[:60])
    err_console.print(table)
    err_console.print(f"steps: median {report['median_step_s']:.3f} s, worst stall "
                      f"{report['worst_stall_s']:.1f} s (bound {report['stall_bound_s']:g} s); "
                      f"final parameters {report['final_rel_diff']:.2e} from the fault-free "
                      "run's" if report["final_rel_diff"] is not None else
                      "steps: none recorded (a command of one's own records its steps with "
                      "bpsctl.chaos.job.Recorder)" if report.get("command") and
                      report["invariants"]["every step done"] is None else
                      "steps: no worker finished", highlight=False)
    for name, held in report["invariants"].items():
        mark = {True: "[green]held[/]", False: "[bold red]FAILED[/]", None: "n/a "}[held]
        err_console.print(f"  {mark}  {name}", highlight=False)
    if report.get("kept"):
        err_console.print(f"  the run's output, steps and logs are kept in {report['kept']}",
                          highlight=False)
    elif report.get("kept_error"):
        err_console.print(f"  the run's output, steps and logs could not be kept: "
                          f"{report['kept_error']}", highlight=False)


def print_summary(runs: dict[str, Any]) -> None:
    """Per fault kind: injected, noticed, survived; then which seeds held every invariant."""
    table = Table(title=f"bpsctl chaos, {len(runs['runs'])} seeded runs")
    for column in ("fault", "injected", "noticed", "survived"):
        table.add_column(column, justify="left" if column == "fault" else "right")
    for kind, counts in sorted(runs["by_kind"].items()):
        table.add_row(kind, *(str(counts[c]) for c in ("injected", "noticed", "survived")))
    err_console.print(table)
    failed = [run["seed"] for run in runs["runs"] if not run["ok"]]
    held = len(runs["runs"]) - len(failed)
    err_console.print(f"{held} of {len(runs['runs'])} runs held every invariant" +
                      (f"; failed: seed {', '.join(map(str, failed))}" if failed else ""),
                      highlight=False)
