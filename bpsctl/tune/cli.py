"""`bpsctl tune`: flags in; the tuned config file, a CSV, JSON and a PNG out."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bpsctl.bench.cli import (
    _cluster_config,
    _write_json,
    check_target_cpu,
    target_cpu_option,
    with_target_cpu,
)
from bpsctl.cliutil import cli_errors, config_file_option, err_console, knob_option
from bpsctl.config import ConfigError, default_config_file, parse_rate_mbit, parse_size

from .api import KNOBS, TuneSettings, run_tune
from .report import plot_tune, print_tune, write_csv, write_tuned_file

#: tune's switches naming the knobs to tune, and the variable that holds each at a value
KNOB_SWITCHES = {"--partition-bytes": "BPSCTL_PARTITION_BYTES",
                 "--server-count": "BPSCTL_NUM_SERVERS", "--credit": "BPSCTL_CREDIT_BYTES",
                 "--layout": "BPSCTL_CPU_SHARE"}


def switch_given_a_value(argv: list[str]) -> str | None:
    """What is wrong when ``bpsctl tune`` got a value after one of its knob switches
    (``tune --partition-bytes 4MiB``, as `bench --partition-bytes 4MiB` takes one), else None:
    click would only say "unexpected extra argument"."""
    if not argv or argv[0] != "tune":
        return None
    for flag, value in zip(argv[1:], argv[2:], strict=False):
        if flag in KNOB_SWITCHES and not value.startswith("-"):
            variable = KNOB_SWITCHES[flag]
            held = (f"with it held at {value}, set {variable}={value}"
                    if flag == "--partition-bytes" else f"with it held, set {variable}")
            unlike = " (bench's --partition-bytes sets a size)" \
                if flag == "--partition-bytes" else ""
            return (f"tune {flag} takes no value ({value!r}): it names a knob to tune{unlike}. "
                    f"To tune the others {held} and leave {flag} out")
    return None


def tune(ctx: typer.Context,
         partition_bytes: bool = typer.Option(False, "--partition-bytes",
                                              help="Tune the partition size (64 KiB to 64 MiB, "
                                                   "x4 steps)."),
         server_count: bool = typer.Option(False, "--server-count",
                                           help="Tune how many of the servers a job uses (1..K)."),
         credit: bool = typer.Option(False, "--credit",
                                     help="Tune the credit (2, 8 or 32 partitions in flight)."),
         layout: bool = typer.Option(False, "--layout",
                                     help="Tune the layout: the CPU hosts' servers' share of the "
                                          "bytes, from the traffic model's optimum to the pure "
                                          "layouts (on servers on worker hosts and CPU hosts at "
                                          "once)."),
         trials: int = typer.Option(16, "--trials", min=1,
                                    help="Points the search measures (besides the current config "
                                         "and the re-measured leaders)."),
         grid: bool = typer.Option(False, "--grid",
                                   help="Measure every point instead of searching (for "
                                        "comparison)."),
         out: Path | None = typer.Option(None, "--out", metavar="FILE",
                                         help=f"Tuned config file to write (default: "
                                              f"{default_config_file()})."),
         model: str | None = typer.Option(None, "--model", metavar="vgg16|resnet50",
                                          help="Score on this training benchmark (img/sec) "
                                               "instead of push_pull throughput."),
         replay: str | None = typer.Option(
             None, "--replay", metavar="PROFILE",
             help="With --model: train the stand-in that replays this profile's step (a "
                  "shipped name, `bpsctl profile --list`, or a file), to tune for the recorded "
                  "device's compute-to-network ratio. See docs/replay.md."),
         target_nic: str | None = typer.Option(
             None, "--target-nic", metavar="RATE",
             help="With --replay and an emulated --nic: the NIC that one stands for; every "
                  "recorded time is dilated by their ratio, img/sec given in the target's time."),
         target_cpu: float | None = target_cpu_option(
             "so each point pays for its messages' CPU as the target would (small pieces cost "
             "more). See docs/replay.md."),
         workers: int | None = typer.Option(None, "--workers", "-n", min=1,
                                            help="Worker processes (default: one per worker "
                                                 "host of a running emulated cluster, else 2)."),
         servers: int | None = typer.Option(None, "--servers", min=1,
                                            help="Servers of the private cluster, the most a "
                                                 "job may use (default: as many as workers)."),
         emulate: bool | None = knob_option("emulate", "--emulate"),
         nic: str | None = knob_option("nic", "--nic"),
         colocated_servers: bool | None = knob_option("colocated_servers", "--colocated-servers"),
         cpu_share: str | None = knob_option("cpu_share", "--cpu-share"),
         size: str = typer.Option("32MiB", "--size",
                                  help="Comm score: bytes each worker push_pulls per round."),
         tensors: int = typer.Option(8, "--tensors", min=1,
                                     help="Comm score: tensors the bytes are spread over."),
         warmup: int = typer.Option(2, "--warmup", min=0, help="Untimed rounds per point."),
         repeats: int = typer.Option(5, "--repeats", min=1,
                                     help="Timed rounds per point (the median scores it)."),
         finalists: int = typer.Option(3, "--finalists", min=1,
                                       help="Leading points measured again before choosing."),
         final_passes: int = typer.Option(3, "--final-passes", min=1,
                                          help="Interleaved re-measurements of the finalists "
                                               "and the current config (the median decides)."),
         seed: int = typer.Option(0, "--seed", help="Seed of the TPE sampler."),
         json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                               help="Write every trial and the choice as "
                                                    "JSON (- for stdout)."),
         plot_file: Path | None = typer.Option(None, "--plot", metavar="FILE",
                                               help="Draw score against partition size, one "
                                                    "line per server count, as a PNG."),
         csv_file: Path | None = typer.Option(None, "--csv", metavar="FILE",
                                              help="CSV of every trial (default: beside the "
                                                   "tuned file, *.trials.csv)."),
         config_file: Path | None = config_file_option(),
         ) -> None:
    """Find the partition size, server count, credit and layout that make push_pull (or
    training) fastest on these hosts, and write them to the tuned config file that `up`, `run`
    and `bench` read.

    The flags --partition-bytes, --server-count, --credit and --layout name the knobs to tune
    (none: all of them; the layout where servers sit on worker hosts and CPU hosts at once,
    and then not the server count); the others stay at the current config. Each point is a
    fresh job on one cluster (the one `up` started, or a private one: --emulate builds
    emulated hosts).
    """
    with cli_errors():
        config = _cluster_config(ctx, None, None, emulate, nic, config_file,
                                 colocated_servers=colocated_servers, cpu_share=cpu_share)
        flags = (partition_bytes, server_count, credit, layout)
        chosen = [k for k, on in zip(KNOBS, flags, strict=True) if on]
        settings = TuneSettings(knobs=tuple(chosen) or KNOBS, trials=trials, grid=grid,
                                model=model, replay=replay or "",
                                target_nic_mbit=None if target_nic is None else
                                parse_rate_mbit(target_nic, "--target-nic"),
                                target_cpu=target_cpu,
                                workers=workers, servers=servers,
                                size_bytes=parse_size(size, "--size"), tensors=tensors,
                                warmup=warmup, repeats=repeats, finalists=finalists,
                                final_passes=final_passes, seed=seed)
        check_target_cpu(target_cpu, bool(replay), settings.target_nic_mbit, config.emulate)
        if settings.target_nic_mbit is not None and config.emulate:
            from bpsctl.bench.profile import dilation_factor
            dilation_factor(settings.target_nic_mbit, config.nic_mbit)     # before a cluster
            if target_cpu is not None:
                config = with_target_cpu(config, target_cpu, settings.target_nic_mbit)
        if model is not None:
            from bpsctl.bench.models import MODELS
            if model not in MODELS:
                raise ConfigError(f"--model: expected one of {', '.join(MODELS)}, got {model!r}")
        if plot_file is not None:
            from bpsctl.bench.report import _pyplot
            _pyplot()                       # a missing matplotlib is said up front
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("tune needs optuna: pip install 'bpsctl[tune]'") from None
        out = out or default_config_file()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err_console, transient=True) as bar:
            task = bar.add_task("starting the cluster", total=None)

            def progress(done: int, total: int, text: str) -> None:
                bar.update(task, completed=done, total=total, description=text)
            tuning = run_tune(config, settings, progress=progress)
        report = tuning.report()
        report["config"] = str(out)
        write_tuned_file(out, report, shlex.join(["bpsctl", *sys.argv[1:]]))
        print_tune(err_console, report)
        csv_path = csv_file or out.with_suffix(".trials.csv")
        write_csv(csv_path, report)
        err_console.print(f"wrote {out} (tuned config) and {csv_path} (every trial)",
                          highlight=False)
        _write_json(json_file, report)
        if plot_file is not None:
            plot_tune(report, plot_file)
            err_console.print(f"wrote {plot_file}", highlight=False)
