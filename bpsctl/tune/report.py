"""What `bpsctl tune` leaves behind: the tuned config file, a CSV of every trial, a PNG, a table."""
from __future__ import annotations

import csv
import datetime
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .. import __version__
from ..bench.report import _pyplot
from ..config import CONFIG_FILE_FORMAT, CONFIG_FILE_VERSION, format_bytes

#: the tuned point's values under the Config knob names the file uses
_FILE_KNOB = {"partition_bytes": ("partition_bytes", "partition_bytes"),
              "servers": ("num_servers", "servers"), "credit": ("credit_bytes", "credit"),
              "layout": ("cpu_share", "cpu_share")}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))       # a JSON string is a TOML basic string


def tuned_file_text(report: dict[str, Any], command: str) -> str:
    """The TOML of a tuned config file: the tuned knobs, and where they came from."""
    best = report["best"]
    knobs = {_FILE_KNOB[k][0]: best[_FILE_KNOB[k][1]] for k in report["knobs"]}
    baseline = report["baseline"] or {}
    provenance = {
        "command": command, "cluster": report["cluster"], "nic_mbit": report["nic_mbit"],
        "workers": report["workers"], "servers": report["servers"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bpsctl_version": __version__, "benchmark": report["benchmark"],
        "score": best["score"], "score_unit": report["score_unit"],
        "baseline_score": baseline.get("score"), "mode": report["mode"],
        "measurements": report["measurements"],
    }
    lines = ["# bpsctl tuned config, written by `bpsctl tune`. `bpsctl up`, `run` and `bench` read",
             "# it (--config FILE, or this default location); flags and BPSCTL_* variables",
             "# override it. Edit the [knobs] freely; [tuned] only records where they came from.",
             "", "[bpsctl]", f'format = "{CONFIG_FILE_FORMAT}"', f"version = {CONFIG_FILE_VERSION}",
             "", "[knobs]"]
    lines += [f"{name} = {_toml_value(value)}" for name, value in knobs.items()]
    lines += ["", "[tuned]"]
    lines += [f"{name} = {_toml_value(value)}" for name, value in provenance.items()
              if value is not None]
    return "\n".join(lines) + "\n"


def write_tuned_file(path: Path, report: dict[str, Any], command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tuned_file_text(report, command))
    tmp.replace(path)                   # never a half-written file where `up` looks


CSV_COLUMNS = ("number", "stage", "partition_bytes", "servers", "credit", "cpu_share", "score",
               "seconds", "repeats")


def write_csv(path: Path, report: dict[str, Any]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(report["trials"])


def plot_tune(report: dict[str, Any], path: Path) -> None:
    """Score against partition size, one line per server count (the best credit at each)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    best: dict[int, dict[int, float]] = {}
    for t in report["trials"]:
        if t["stage"] in ("search", "grid"):
            line = best.setdefault(t["servers"], {})
            line[t["partition_bytes"]] = max(line.get(t["partition_bytes"], 0.0), t["score"])
    for servers in sorted(best):
        xs = sorted(best[servers])
        ax.plot([x / 1024 for x in xs], [best[servers][x] for x in xs], "o-",
                label=f"{servers} server{'s' if servers > 1 else ''}")
    if report["baseline"]:
        ax.axhline(report["baseline"]["score"], color="gray", linestyle="--",
                   label="current config (re-measured median)")
    chosen = report["best"]
    ax.plot([chosen["partition_bytes"] / 1024], [chosen["score"]], "*", color="black",
            markersize=14, label="chosen (re-measured median)")
    ax.set_xscale("log", base=2)
    sizes = sorted({x for line in best.values() for x in line})
    ax.set_xticks([x / 1024 for x in sizes], [format_bytes(x) for x in sizes])
    ax.set_xlabel("partition size")
    ax.set_ylabel(report["score_unit"] + " (higher is better)")
    nic = f", NIC {report['nic_mbit']:g} Mbit/s" if report["nic_mbit"] else ", loopback"
    ax.set_title(f"bpsctl tune ({report['mode']}): {report['workers']} workers, up to "
                 f"{report['servers']} servers{nic}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _key(trial: dict[str, Any]) -> tuple[int, int, int, float | None]:
    return trial["partition_bytes"], trial["servers"], trial["credit"], trial.get("cpu_share")


def print_tune(console: Console, report: dict[str, Any]) -> None:
    """The finalists against the current config, then the choice beside the model's guess."""
    table = Table(title=f"bpsctl tune ({report['mode']}): {report['measurements']} measurements "
                        f"of {report['space_points']} points")
    # two-line headers, so that the table fits 80 columns with a "chosen + current" row
    # with the layout searched every job uses all the servers: its column instead of theirs
    layout = "layout" in report.get("knobs", ())
    for column in ("", "partition", "CPU\nshare" if layout else "servers", "credit",
                   f"{report['score_unit']}\n(median)", "vs\ncurrent"):
        table.add_column(column, justify="left" if not column else "right", no_wrap=True)
    base = report["baseline"]
    for t in report["finalists"]:
        label = " + ".join(name for name, other in (("chosen", report["best"]), ("current", base))
                           if other and _key(t) == _key(other))
        share = [] if not layout else ["auto" if t.get("cpu_share") is None
                                       else f"{t['cpu_share']:.3g}"]
        table.add_row(label, format_bytes(t["partition_bytes"]), *(share or [str(t["servers"])]),
                      format_bytes(t["credit"]), f"{t['score']:.1f}",
                      "" if not base else f"{t['score'] / base['score']:.2f}x")
    console.print(table)
    console.print(f"score: {report['benchmark']}", highlight=False)
    model_layout = report.get("model_layout")
    if model_layout is not None and layout:
        chosen = report["best"].get("cpu_share")
        console.print(f"layout: measured best CPU hosts' share "
                      f"{'auto' if chosen is None else format(chosen, '.3g')}, traffic model "
                      f"{model_layout['cpu_share']:.3f} ({model_layout['why']})", highlight=False)
    unpaced = report.get("unpaced")
    if unpaced:
        score = report["best"]["score"]
        console.print(f"pacing: the chosen layout {score:.1f} paced by share, "
                      f"{unpaced['score']:.1f} without (BPSCTL_PACING=0): "
                      f"{score / unpaced['score']:.2f}x", highlight=False)
    guess = report["model_guess"]
    if layout:
        return                  # every job used all the servers: no count was chosen
    if guess is not None:
        console.print(f"servers: measured best {report['best']['servers']}, traffic model "
                      f"{guess['servers']} ({guess['why']})", highlight=False)
    else:
        console.print(f"servers: measured best {report['best']['servers']}; "
                      f"{report['model_note']}", highlight=False)
