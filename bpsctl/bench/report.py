"""Showing benchmark results: rich tables on the terminal, PNG plots (matplotlib)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..config import ConfigError, format_bytes
from ..engine.paths import LOCAL_PATHS


def shm_shares(stats: dict[str, Any]) -> dict[str, float]:
    """From a worker's ``stats()``: ``shm_share``, the share of the bytes it pushed to servers
    that went through shared memory (servers on its host; the rest took TCP, e.g. past
    BPSCTL_SHM_SERVER_BYTES), and ``direct_share``, the share of those pushes whose slot the
    GPU filled itself (CUDA tensors from a name's second push on; the engine copied the rest).
    Empty when nothing reached a server."""
    pushed = sum(server["pushed_bytes"] for server in stats["servers"])
    if not pushed:
        return {}
    shares = {"shm_share": stats["shm_pushed_bytes"] / pushed}
    if stats["shm_pushes"]:
        shares["direct_share"] = stats["filled_pushes"] / stats["shm_pushes"]
    return shares


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def comm_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-size reports inside any comm result (one size, several, or a sweep)."""
    if report["kind"] == "comm_sweep":
        return [r for point in report["points"] for r in comm_reports(point)]
    return report.get("sizes", [report])


def _machines(report: dict[str, Any]) -> str:
    """The real machines the figures were measured on ("" for this machine or emulated
    hosts): an SSH cluster's hosts file, or a Slurm job's nodes."""
    if report.get("slurm_job"):
        return f"Slurm job {report['slurm_job']} ({', '.join(report.get('nodes', []))})"
    return f"SSH cluster of {Path(report['hosts_file']).name}" if report.get("hosts_file") else ""


def _network(report: dict[str, Any]) -> str:
    """What the figures went through: the NIC rate, else an SSH or Slurm cluster's machines,
    else loopback."""
    every = report.get("host_cpu")
    slow_cpu = (f", every worker host at {every:.3g} CPU" if every else "") + "".join(
        f", worker {rank}'s host at {factor:g} {'of that' if every else 'CPU'}"
        for rank, factor in report.get("cpu_stragglers", {}).items())
    if report["nic_mbit"]:
        slow = "".join(f", worker {rank}'s at {factor:g}x"
                       for rank, factor in report.get("stragglers", {}).items())
        return f"NIC {report['nic_mbit']:g} Mbit/s{slow}{slow_cpu}"
    return _machines(report) or "loopback" + slow_cpu


#: how the summary sentence names each system
_NAMES = {"ddp": "DDP", "horovod": "Horovod", "allreduce": "ring allreduce"}
_TRY_NETWORK = "try --emulate --nic 1gbit or --hosts"


def _table(title: str, columns: list[str], left: tuple[str, ...]) -> Table:
    """A results table whose cells never wrap (the columns are chosen to fit 80 columns)."""
    table = Table(title=title, min_width=len(title))
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    return table


def _where(report: dict[str, Any], slower: bool) -> str:
    """Where the figures were measured, for the summary sentence; when bpsctl was slower, what
    in that setting works against it."""
    if report.get("hosts_file"):
        return f"on the SSH cluster of {report['hosts_file']}"
    if report.get("slurm_job"):
        return f"on the nodes of Slurm job {report['slurm_job']}"
    target = (report.get("replay") or {}).get("target_nic_mbit")
    if report["nic_mbit"] and target:
        return (f"through emulated {report['nic_mbit']:g} Mbit/s NICs standing for "
                f"{target:g} Mbit/s ones")
    if report["nic_mbit"]:
        return f"through emulated {report['nic_mbit']:g} Mbit/s NICs" + (
            ", on hosts that share this machine's CPU cores" if slower else "")
    sums = "bpsctl's sums share" if _servers_unused(report) else "the servers share"
    return "on loopback, where there is no network bottleneck" + (
        f" and {sums} the workers' CPU cores" if slower else "")


def _servers_unused(report: dict[str, Any]) -> bool:
    """Whether bpsctl's gradients never went to the servers (one host, or one worker)."""
    results = report.get("results") or [{}]
    return results[0].get("gradient_path") in LOCAL_PATHS


def _servers(report: dict[str, Any]) -> str:
    """"2 servers", or "2 servers (unused)" when bpsctl's gradients never reached them."""
    return f"{report['servers']} servers" + (" (unused)" if _servers_unused(report) else "")


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def _worker_shape(report: dict[str, Any]) -> str:
    """"4 workers (2 per host on 2 hosts)" where worker hosts hold several workers each
    (`--workers-per-host`, or a live cluster's hosts or slots), else "4 workers"."""
    counts = report.get("worker_hosts") or []
    shape = _workers(report["workers"])
    if len(counts) < 2 or max(counts) < 2:
        return shape
    if len(set(counts)) == 1:
        return f"{shape} ({counts[0]} per host on {len(counts)} hosts)"
    return f"{shape} ({'+'.join(map(str, counts))} on {len(counts)} hosts)"


def _sentence(text: str, *hints: str) -> str:
    """``text``, then what to try (the hints that are not empty), as one sentence."""
    given = [hint for hint in hints if hint]
    return text + (" — " + ", or ".join(given) if given else "") + "."


def _theory(report: dict[str, Any]) -> str:
    """How the theory speedup over ring allreduce was found: the layout's model, or (without a
    NIC rate) 2(n-1)/n."""
    layout = report.get("layout") or {}
    how = "t_allreduce/t_layout" if layout.get("model_seconds") else "2(n-1)/n"
    return f"{how} = {report['theory_speedup']:.2f}×"


def layout_line(report: dict[str, Any]) -> str:
    """The layout a comm report ran on, its modelled round and the pure layouts' beside the
    measured round."""
    layout = report["layout"]
    n, k = layout["worker_hosts"], layout["cpu_hosts"]
    groups: dict[bool, dict[str, float]] = {True: {}, False: {}}
    for host, share, colocated in zip(layout["server_hosts"], layout["shares"],
                                      layout["colocated"], strict=True):
        groups[colocated][host] = groups[colocated].get(host, 0.0) + share
    kinds = []
    for what, hosts in (("worker", groups[True]), ("CPU", groups[False])):
        if hosts:
            shares = "/".join(sorted({f"{share:.3f}" for share in hosts.values()}))
            kinds.append(f"{len(hosts)} {what} host(s) sum {shares}")
    pure = f"servers on the {n} worker hosts only {layout['colocated_only_seconds']:.3f} s"
    if layout["cpu_hosts_only_seconds"] is not None:
        pure += f", on the {k} CPU hosts only {layout['cpu_hosts_only_seconds']:.3f} s"
    measured = (f"; measured {layout['measured_over_model']:.2f}x the model"
                if layout.get("measured_over_model") else "")
    return (f"layout: {', '.join(kinds)} of the bytes each; modelled round "
            f"{layout['model_seconds']:.3f} s ({pure}){measured}")


def comm_summary(report: dict[str, Any]) -> str:
    """One sentence on what a comm result means: the point with the most workers and bytes."""
    r = max(comm_reports(report), key=lambda r: (r["workers"], r["size_bytes"]))
    ours, n = r["results"][0], r["workers"]
    what = f"bpsctl's push_pull of {format_bytes(r['size_bytes'])} with {_workers(n)}"
    speedup = r["speedup"].get("allreduce")
    if speedup is not None:
        verdict = ("faster than" if speedup > 1.05 else "slower than" if speedup < 0.95
                   else "as fast as")
        theory = f"; theory {_theory(r)}" if "theory_speedup" in r else ""
        text = f"{what} was {verdict} ring allreduce ({speedup:.2f}×{theory})"
    elif ours["nic_fraction"] is not None:
        text = f"{what} reached {ours['nic_fraction']:.0%} of what the NICs allow"
    else:
        text = f"{what} took {ours['seconds']:.3g} s ({ours['algbw_MBps']:.0f} MB/s algbw)"
    slower = speedup is not None and speedup < 0.95
    network = not r["nic_mbit"] and not _machines(r)
    return _sentence(f"{text} {_where(r, slower)}",
                     "" if speedup is not None else "add --compare allreduce",
                     _TRY_NETWORK if network else "")


#: how the line under an --op table says what each op's bytes are (nccl-tests' counting)
_OP_BYTES = ("allreduce, alltoall, reducescatter: each rank's input; allgather: each rank's "
             "gathered output")


def ops_summary(report: dict[str, Any]) -> str:
    """One sentence on what an --op result means: each op's ratio bpsctl/Horovod (Horovod's
    time over bpsctl's) at the largest size, or bpsctl's algbw per op without Horovod."""
    r = max(comm_reports(report), key=lambda r: r["size_bytes"])
    what = f"{format_bytes(r['size_bytes'])} with {_workers(r['workers'])}"
    speedup = r["speedup"]
    slower = any(x < 0.95 for x in speedup.values())
    where = _where(r, slower)
    if speedup:
        ratios = ", ".join(f"{op} {x:.2f}×" for op, x in speedup.items())
        text = (f"bpsctl/Horovod for {what} {where}: {ratios} (Horovod's time over bpsctl's; "
                "above 1, bpsctl is faster)")
    else:
        text = f"bpsctl's collectives of {what} {where}: " + ", ".join(
            f"{row['op']} {row['algbw_MBps']:.0f} MB/s" for row in r["results"]) + " algbw"
    network = not r["nic_mbit"] and not _machines(r)
    return _sentence(text, "" if speedup else "add --compare horovod",
                     _TRY_NETWORK if network else "")


def _print_ops(console: Console, report: dict[str, Any]) -> None:
    """`bench comm --op`: a row per (op, system), the ratio bpsctl/Horovod (Horovod's time over
    bpsctl's) on Horovod's row."""
    reports = comm_reports(report)
    first = reports[0]
    several = len(reports) > 1
    ratio = any(r["speedup"] for r in reports)
    columns = ((["size"] if several else []) + ["op", "system", "seconds", "algbw\nMB/s",
                                                 "busbw\nMB/s"]
               + (["bpsctl/\nHorovod"] if ratio else []))
    table = _table(f"bench comm --op: {_worker_shape(first)} x {first['servers']} servers, "
                   f"{_network(first)}", columns, ("op", "system"))
    for r in reports:
        for row in r["results"]:
            speedup = r["speedup"].get(row["op"]) if row["system"] == "horovod" else None
            cells = ([format_bytes(r["size_bytes"])] if several else []) + [
                row["op"], row["system"], f"{row['seconds']:.4f}", f"{row['algbw_MBps']:.0f}",
                f"{row['busbw_MBps']:.0f}"]
            if ratio:
                cells.append("" if speedup is None else f"{speedup:.2f}x")
            table.add_row(*cells)
    console.print(table)
    size = "each size" if several else format_bytes(first["size_bytes"])
    console.print(f"{size} per op per worker ({_OP_BYTES}) in {first['tensors']} float32 "
                  f"tensors; median of {first['repeats']} rounds after {first['warmup']} "
                  f"warm-up; allreduce and reducescatter {first['reduce']}; every op's first "
                  "round checked on every rank", highlight=False)
    console.print(ops_summary(report), highlight=False)


def print_comm(console: Console, report: dict[str, Any]) -> None:
    reports = comm_reports(report)
    if "ops" in reports[0]:
        _print_ops(console, report)
        return
    first = reports[0]
    sweep = report["kind"] == "comm_sweep"
    several = len(reports) > 1 and not sweep
    shape = "" if sweep else f"{_worker_shape(first)} x {first['servers']} servers, "
    rows = [(r, row) for r in reports for row in r["results"]]
    nic = any(row["nic_fraction"] is not None for _, row in rows)
    # two-line headers: the widest table (a sweep with a NIC) still fits 80 columns
    headers = {"workers": "workers", "size": "size", "system": "system", "seconds": "seconds",
               "algbw": "algbw\nMB/s", "busbw": "busbw\nMB/s", "nic": "NIC\nfrac",
               "speedup": "speedup"}
    keys = ((["workers"] if sweep else []) + (["size"] if several else [])
            + ["system", "seconds", "algbw", "busbw"] + (["nic"] if nic else [])
            + (["speedup"] if any(r["speedup"] for r in reports) else []))
    table = _table(f"bench comm: {shape}{_network(first)}", [headers[k] for k in keys],
                   ("system",))
    for r, row in rows:
        speedup = r["speedup"].get(row["system"])
        system = row["system"] + (f" {row['security']}" if "security_cost" in r
                                  and "security" in row else "")
        cells = {"workers": str(r["workers"]), "size": format_bytes(r["size_bytes"]),
                 "system": system, "seconds": f"{row['seconds']:.4f}",
                 "algbw": f"{row['algbw_MBps']:.0f}", "busbw": f"{row['busbw_MBps']:.0f}",
                 "nic": _fmt(row["nic_fraction"], ".2f"),
                 "speedup": "" if speedup is None else f"bpsctl {speedup:.2f}x"}
        table.add_row(*(cells[k] for k in keys))
    console.print(table)
    console.print(("each size" if several else f"{format_bytes(first['size_bytes'])} per worker")
                  + f" in {first['tensors']} tensors, median of {first['repeats']} rounds after "
                  f"{first['warmup']} warm-up", highlight=False)
    for r in reports:
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
        if "allreduce" in r["speedup"] and "theory_speedup" in r and len(reports) > 1:
            console.print(f"{r['workers']} workers, {format_bytes(r['size_bytes'])}: speedup over "
                          f"ring allreduce {r['speedup']['allreduce']:.2f}x "
                          f"(theory {_theory(r)})", highlight=False)
        layout = r.get("layout") or {}
        # one size, or servers on worker hosts: the layout is worth a line per report
        if layout.get("model_seconds") and (len(reports) == 1 or any(layout["colocated"])):
            console.print(layout_line(r), highlight=False)
    console.print(comm_summary(report), highlight=False)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'bpsctl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_comm(report: dict[str, Any], path: Path) -> None:
    """algbw per system against size (with --op, per op and system); for a sweep, speedup
    against workers with the theory."""
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
    elif "ops" in comm_reports(report)[0]:
        reports = comm_reports(report)
        sizes = [r["size_bytes"] / 2**20 for r in reports]
        for op, system in [(row["op"], row["system"]) for row in reports[0]["results"]]:
            values = [next(row["algbw_MBps"] for row in r["results"]
                           if (row["op"], row["system"]) == (op, system)) for r in reports]
            ax.plot(sizes, values, "o-" if system == "bpsctl" else "s--",
                    label=f"{op} ({system})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per op per worker (MiB)")
        ax.set_ylabel("algbw (MB/s)")
        first = reports[0]
        ax.set_title(f"bench comm --op: {first['workers']} workers x {first['servers']} servers"
                     + (f", NIC {first['nic_mbit']:g} Mbit/s" if first["nic_mbit"] else ""))
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


def _device(report: dict[str, Any]) -> str:
    """What the figures were trained on: "CPU", or the GPUs ("1x NVIDIA H200")."""
    if report.get("device") != "cuda":
        return "CPU"
    kinds = sorted({f"{gpu['count']}x {gpu['name']}" for gpu in report.get("gpus", [])})
    hosts = len(report.get("gpus", []))
    return (", ".join(kinds) or "CUDA") + (f" per host ({hosts} hosts)" if hosts > 1 else "")


def train_summary(report: dict[str, Any]) -> str:
    """One sentence on what a training result means, e.g. "bpsctl was slower: it trained at
    0.61× DDP's speed on loopback, where there is no network bottleneck — try ..."."""
    ratios = [(system, report["speedup"][system]) for system in
              (row["system"] for row in report["results"]) if system in report["speedup"]]
    if ratios:
        speeds = [f"{ratio:.2f}× {_NAMES.get(system, system)}'s" for system, ratio in ratios]
        speeds[0] += " speed"                   # "0.61× DDP's speed and 0.83× Horovod's"
        faster = all(ratio > 1.05 for _, ratio in ratios)
        slower = all(ratio < 0.95 for _, ratio in ratios)
        verdict = f"was {'faster' if faster else 'slower'}: it " if faster or slower else ""
        lead = f"bpsctl {verdict}trained at {' and '.join(speeds)}"
    else:
        slower = False
        lead = (f"bpsctl trained {report['model']} at {report['results'][0]['img_per_sec']:.1f} "
                f"img/sec on {_workers(report['workers'])}")
    network = not report["nic_mbit"] and not _machines(report)
    return _sentence(f"{lead} {_where(report, slower)}",
                     "" if ratios else "add --compare horovod,ddp to see the baselines",
                     _TRY_NETWORK if network else "")


#: how much slower than its profile one worker alone may replay a step before the report says
#: the replay fell behind
REPLAY_BEHIND = 1.1


def replay_line(replay: dict[str, Any], plain_step_s: float | None = None) -> str:
    """What a replayed run's figures are: its label, and in whose time they are given; and
    when one worker alone (``plain_step_s``, in that time) was well slower than the profile,
    that the replay fell behind it."""
    line = replay["label"]
    if replay["source"] == "derived":
        line += f" (a derived profile: {replay['derived_from']}'s fractions, not a recording)"
    if replay["dilation"] != 1.0:
        target = replay["target_nic_mbit"]
        rate = f"{target / 1e3:g} Gbit" if target >= 1e3 else f"{target:g} Mbit"
        line += (f"; img/sec and s/step are given in the {rate} cluster's time (the emulated "
                 "figures are in the JSON, under emulated)")
    recorded = replay.get("profile_step_s")
    if plain_step_s and recorded and plain_step_s > REPLAY_BEHIND * recorded:
        line += (f". The replay fell behind its profile: one worker alone took "
                 f"{plain_step_s * 1e3:.1f} ms a step against the recorded "
                 f"{recorded * 1e3:.1f} ms (writing each gradient took longer than its "
                 "recorded gap); dilate more (--target-nic with a slower --nic)")
    return line


def print_train(console: Console, report: dict[str, Any]) -> None:
    # the NIC-bound ideal beside the measured step, where a NIC rate is known (two-line
    # headers; per worker's img/sec makes room for them: it is img/sec over the title's workers)
    ideal = any(row.get("ideal_step_s") is not None for row in report["results"])
    cuda = report.get("device") == "cuda"
    # (beside the ideal's two columns there is no room for it at 80 columns: the JSON has it)
    scaling = not ideal and any(row.get("scaling_efficiency") is not None
                                for row in report["results"])
    columns = ["system", "img/sec", "± 1.96σ"] \
        + (["s/step", "ideal\ns/step", "NIC\nfrac"] if ideal
           else ["per GPU" if cuda else "per worker", "s/step"]) \
        + (["scaling"] if scaling else []) + (["speedup"] if report["speedup"] else [])
    table = _table(f"bench {report['model']} on {_device(report)}: {_worker_shape(report)}, "
                   f"{_servers(report)}, {_network(report)}", columns, ("system",))
    # one timed iteration has no spread to show: a dash, and a line saying how to get one
    single = report["iters"] * report.get("rounds", 1) < 2
    for row in report["results"]:
        speedup = report["speedup"].get(row["system"])
        cells = [row["system"], f"{row['img_per_sec']:.2f}",
                 "-" if single else f"{row['img_per_sec_ci95']:.2f}"]
        if ideal:
            cells += [f"{row['step_seconds']:.3f}", _fmt(row.get("ideal_step_s"), ".3f"),
                      _fmt(row.get("nic_fraction"), ".2f")]
        else:
            cells += [f"{row['img_per_sec_per_worker']:.2f}", f"{row['step_seconds']:.3f}"]
        if scaling:
            cells.append(_fmt(row.get("scaling_efficiency"), ".2f"))
        if report["speedup"]:
            cells.append("" if speedup is None else f"bpsctl {speedup:.2f}x")
        table.add_row(*cells)
    console.print(table)
    replay = report.get("replay")
    if replay:
        plain = [row["step_seconds"] for row in report["results"] if row["system"] == "plain"]
        console.print(replay_line(replay, plain[0] if plain else None), highlight=False)
        model = model_line(report)
        if model:
            console.print(model, highlight=False)
    ours = report["results"][0]
    if ours.get("gradient_path"):
        from ..engine.paths import GRADIENT_PATHS
        path = ours["gradient_path"]
        console.print(f"bpsctl's gradients: {path} ({GRADIENT_PATHS.get(path, '')})",
                      highlight=False)
    if cuda and any(row["system"].startswith("ddp") for row in report["results"]):
        console.print(f"DDP over {report.get('baseline_backend')}: "
                      f"{report.get('baseline_backend_why')}", highlight=False)
    if scaling:
        console.print(_scaling_said(cuda), highlight=False)
    batches = report["batches_per_iter"]
    versions = ", ".join(row["version"] for row in report["results"] if row.get("version"))
    console.print(f"batch {report['batch_size']} per worker, {report['image_size']}x"
                  f"{report['image_size']} images, {report['iters']} iters x {batches} "
                  f"batch{'es' if batches > 1 else ''}"
                  + (f", {report['rounds']} rounds" if report.get("rounds", 1) > 1 else "")
                  + f"; {versions}", highlight=False)
    if single:
        console.print("± 1.96σ needs two timed iterations or more (--iters 2)", highlight=False)
    wire = [f"{row['system']} {row['nic_tx_bytes_per_step'] / 1e6:.1f}/"
            f"{row['nic_rx_bytes_per_step'] / 1e6:.1f}"
            for row in report["results"] if row.get("nic_tx_bytes_per_step") is not None]
    if wire:
        stated = report.get("wire_bytes_per_step")
        console.print(f"MB per step through rank 0's host NIC, sent/received: {', '.join(wire)}"
                      + (f" (bpsctl states {stated / 1e6:.1f} MB each way per worker)"
                         if stated else ""), highlight=False)
    for system, ratios in report.get("speedup_by_round", {}).items():
        console.print(f"bpsctl over {system}, round by round: "
                      + ", ".join(f"{ratio:.2f}x" for ratio in ratios)
                      + f" (median {report['speedup'][system]:.2f}x)", highlight=False)
    console.print(train_summary(report), highlight=False)


def plot_train(report: dict[str, Any], path: Path) -> None:
    """img/sec of the whole job per system, with its ± 1.96σ interval."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    systems = [row["system"] for row in report["results"]]
    values = [row["img_per_sec"] for row in report["results"]]
    errors = [row["img_per_sec_ci95"] for row in report["results"]]
    bars = ax.bar(systems, values, yerr=errors, capsize=6,
                  color=["tab:blue", "tab:orange", "tab:green", "tab:gray",
                         "tab:olive"][:len(systems)])
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


#: how far above the step model a measured step may be before the report says what the model
#: leaves out
MODEL_MISS = 0.15
_STEP_MODEL = ("the step model (backward overlapped with the NIC-bound transfer, then the "
               "servers' rounds)")


def _step_model(report: dict[str, Any]) -> str:
    """What the step model counts, as the report says it (bpsctl's next forward pass too, with
    the cross barrier)."""
    return _STEP_MODEL[:-1] + "; with the cross barrier, bpsctl's next forward pass too)" \
        if report.get("cross_barrier") else _STEP_MODEL


def _scaling_said(cuda: bool) -> str:
    return ("scaling: img/sec per " + ("GPU" if cuda else "worker")
            + " over plain's (one worker alone, no communication)")


def model_miss(reports: list[dict[str, Any]]) -> str:
    """For the replayed rows more than :data:`MODEL_MISS` slower than the step model, what the
    model does not count ("" when none is): the systems' own CPU time and each message's
    latency, and on emulated hosts, that they share this machine's cores; for rows whose
    gradients went through servers, a credit too small to keep the NICs busy or so large that
    the workers' flows drift apart (the servers' rounds then wait for the last), partitions placed
    unevenly (each whole on one server, so a server may carry up to a partition more than its
    share) and the cost of many small partitions (docs/replay-results.md measures them; the
    rounds' own latency is in the model); and for bpsctl with the cross barrier, its pushes
    by priority."""
    missed = [(r, row) for r in reports for row in r["results"]
              if (row.get("model_error") or 0.0) > MODEL_MISS]
    if not missed:
        return ""
    slow = [f"{row['system']}{'' if len(reports) == 1 else ' at ' + str(r['workers'])} "
            f"({row['model_error']:+.0%})" for r, row in missed]
    shared = " (here every emulated host shares this machine's CPU cores)" \
        if reports[0].get("nic_mbit") and not _machines(reports[0]) else ""
    through_servers = any(row.get("gradient_path") == "servers" for _, row in missed)
    crossed = any(r.get("cross_barrier") and row["system"] == "bpsctl" for r, row in missed)
    return (f"more than the network explains: {', '.join(slow)}; the step model leaves out the "
            f"CPU time of each system's own workers and servers{shared}, each message's "
            "latency" + (", and, through servers, a credit (BPSCTL_CREDIT_BYTES) too small to "
                         "keep the NICs busy or so large that the workers' flows drift apart "
                         "(with many servers try --partition-bytes 256k --credit-bytes 8m, though "
                         "a replay does not dilate what 4x as many messages cost the CPUs), "
                         "servers given up to a partition more than their share, or the cost "
                         "of many small partitions"
                         if through_servers else "")
            + (", and, with the cross barrier, pushes by priority, which each worker's later "
               "layers overtake at a different point (a round waits for its last push; the "
               "model hides the whole forward pass)" if crossed else ""))


def model_line(report: dict[str, Any]) -> str:
    """For a replay: the step model's prediction per system beside the measured step, e.g.
    "the step model predicts 0.052 s a step for bpsctl (measured +3%), ..." ("" otherwise),
    and what the model leaves out where a row is well above it (:func:`model_miss`)."""
    rows = [row for row in report["results"] if row.get("model_step_s") is not None]
    if not rows:
        return ""
    miss = model_miss([report])
    return (f"{_step_model(report)} predicts "
            + ", ".join(f"{row['model_step_s']:.3f} s a step for {row['system']} (measured "
                        f"{row['model_error']:+.0%})" for row in rows)
            + (f"; {miss}" if miss else ""))


def print_train_sweep(console: Console, report: dict[str, Any]) -> None:
    """One row per worker count and system: img/sec per worker, the scaling (over one worker
    alone without communication), the step model's error for a replay, bpsctl's speedup."""
    points = report["points"]
    first = points[0]
    cuda = first.get("device") == "cuda"
    model = any(row.get("model_step_s") is not None for p in points for row in p["results"])
    columns = ["workers", "system", "per GPU" if cuda else "per worker", "scaling"] \
        + (["model\ns/step", "vs\nmodel"] if model else []) + ["speedup"]
    table = _table(f"bench {report['model']} --sweep on {_device(first)}: {_network(first)}",
                   columns, ("system",))
    for point in points:
        for row in point["results"]:
            if row["system"] == "plain" and point is not first:
                continue            # one worker alone: the same at every count
            speedup = point["speedup"].get(row["system"])
            cells = [str(point["workers"]), row["system"], f"{row['img_per_sec_per_worker']:.2f}",
                     _fmt(row.get("scaling_efficiency"), ".2f")]
            if model:
                cells += [_fmt(row.get("model_step_s"), ".3f"),
                          _fmt(row.get("model_error"), "+.0%")]
            cells.append("" if speedup is None else f"bpsctl {speedup:.2f}x")
            table.add_row(*cells)
    console.print(table)
    if first.get("replay"):
        console.print(replay_line(first["replay"]), highlight=False)
    console.print(_scaling_said(cuda) + "; servers: "
                  + ", ".join(f"{p['servers']} at {p['workers']}" for p in points)
                  + (f". vs model: the measured step over {_step_model(first)}'s, less 1"
                     if model else ""),
                  highlight=False)
    miss = model_miss(points)
    if miss:
        console.print(miss, highlight=False)


def plot_train_sweep(report: dict[str, Any], path: Path) -> None:
    """Scaling efficiency against workers per system; for a replay, the step model's as
    dashed lines of the same colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = report["points"]
    workers = [p["workers"] for p in points]
    systems = [row["system"] for row in points[0]["results"] if row["system"] != "plain"]
    alone = next(row for row in points[0]["results"] if row["system"] == "plain")
    for index, system in enumerate(systems):
        rows = [next(row for row in p["results"] if row["system"] == system) for p in points]
        color = f"C{index}"
        ax.plot(workers, [row["scaling_efficiency"] for row in rows], "o-", color=color,
                label=system)
        if alone.get("model_step_s") and all(row.get("model_step_s") for row in rows):
            ax.plot(workers, [alone["model_step_s"] / row["model_step_s"] for row in rows], "--",
                    color=color, label=f"{system} (step model)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(n) for n in workers])
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency (per worker / one alone)")
    replay = points[0].get("replay")
    ax.set_title(f"{report['model']}: {_network(points[0])}"
                 + (f"\n{replay['label']}" if replay else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_convergence(console: Console, report: dict[str, Any]) -> None:
    """One row per system: whether (with --steps: at which step) it reached the target, its
    steps, seconds and final accuracy; with --compression, the gradient bytes each worker
    pushes per step and what share of the uncompressed bytes that is."""
    fixed = report.get("steps")
    gradient = report.get("gradient_bytes_per_step")
    title = (f"bench convergence: {report['workers']} workers, {report['servers']} servers, "
             f"{_network(report)}, target {report['target_accuracy']:g}"
             + (f", {fixed} steps each" if fixed else ""))
    columns = ["system", "target at" if fixed else "reached", "steps", "seconds", "accuracy"]
    table = _table(title, columns + (["bytes/step"] if gradient else []), ("system",))
    for row in report["results"]:
        reached = "yes" if row["reached"] else "no"
        if fixed:
            reached = f"step {row['target_step']}" if row["reached"] else "no"
        cells = [row["system"], reached, str(row["steps"]), f"{row['seconds']:.2f}",
                 f"{row['final_accuracy']:.3f}"]
        if gradient:
            wire = row.get("wire_bytes_per_step")
            cells.append("" if row["version"].startswith("torch") else
                         format_bytes(gradient) if wire is None else
                         f"{format_bytes(wire)} ({wire / gradient:.0%})")
        table.add_row(*cells)
    console.print(table)
    versions = ", ".join(f"{row['system']}: {row['version']}" for row in report["results"])
    console.print(f"task: a seeded teacher network's labels (seed {report['task']['seed']}); "
                  f"{versions}", highlight=False)
    if gradient:
        console.print("the compressed rows' workers compress every tensor and each push "
                      "their own (BPSCTL_MIN_COMPRESS_BYTES=0, BPSCTL_LOCAL_REDUCE=off); "
                      "bytes/step: what one worker pushes per step (and pulls back), headers "
                      "included", highlight=False)


def plot_convergence(report: dict[str, Any], path: Path) -> None:
    """Test accuracy against wall time per system, with the target."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in report["results"]:
        ax.plot([p["seconds"] for p in row["curve"]], [p["accuracy"] for p in row["curve"]],
                "-", label=f"{row['system']} ({row['steps']} steps)")
    ax.axhline(report["target_accuracy"], color="gray", linestyle="--", label="target")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"time to accuracy: {report['workers']} workers x {report['servers']} "
                 f"servers, {_network(report)}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
