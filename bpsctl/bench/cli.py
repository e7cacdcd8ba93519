"""`bpsctl bench ...`: flags in, figures out (a table on stderr, JSON and PNG to files)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import typer

from bpsctl.cliutil import build_config, cli_errors, config_file_option, err_console, knob_option
from bpsctl.config import (
    Config,
    ConfigError,
    check_backup_workers,
    check_training_mode,
    parse_rate_mbit,
    parse_size,
)

from .. import launch
from .api import (
    CommSettings,
    check_ops,
    cluster_size,
    hosts_cluster,
    is_collectives,
    run_comm,
    run_sweep,
    sweep_servers,
)
from .gpu import TRAIN_DEFAULTS, baseline_backend, check_horovod_nccl, resolve_device
from .profile import (
    dilated_host_cpu,
    dilation_factor,
    rate_flag,
    replay_fit_note,
    replay_memory_note,
    replay_nic_mbit,
)
from .report import (
    plot_comm,
    plot_convergence,
    plot_train,
    plot_train_sweep,
    print_comm,
    print_convergence,
    print_train,
    print_train_sweep,
)
from .training import (
    ConvergenceSettings,
    TrainSettings,
    physical_hosts,
    probe_gpus,
    run_convergence,
    run_train,
    run_train_sweep,
)

WORKERS_HELP = ("Worker processes (with --emulate: worker hosts; on a live emulated cluster: "
                "default one per worker host; on an SSH cluster: its hosts file's worker slots; "
                "on a Slurm cluster: the allocation's tasks).")
SERVERS_HELP = ("Summation servers (default: num_servers of the config, else as many as "
                "workers); with --emulate, each on a CPU host of its own, and with "
                "--colocated-servers besides one on each worker host (default 0 then).")
WORKERS_PER_HOST_HELP = ("With --emulate: worker processes on each worker host, ranks in "
                         "contiguous blocks (--workers N runs N x K workers on N hosts; "
                         "servers default to N).")
bench_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Benchmarks, measured side by side in one run.")


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(part, "--size") for part in text.split(",") if part.strip())
    if not sizes:
        raise ConfigError(f"--size: expected sizes such as 64MiB or 1MiB,16MiB, got {text!r}")
    return sizes


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def _sweep(text: str | None) -> list[int] | None:
    if text is None:
        return None
    key, sep, values = text.partition("=")
    try:
        counts = [int(v) for v in values.split(",")]
    except ValueError:
        counts = []
    if key.strip() != "workers" or not sep or not counts or min(counts) < 1:
        raise ConfigError(f"--sweep: expected workers=2,4,6,8, got {text!r}")
    return counts


def target_cpu_option(then: str) -> Any:
    """bench's and tune's ``--target-cpu``; ``then``: what it does there."""
    return typer.Option(None, "--target-cpu", metavar="CORES",
                        help="With --replay, --target-nic and --emulate: the CPU a target GPU "
                             "host's communication has, in this machine's cores; each emulated "
                             "worker host gets CORES over the dilation of one CPU (a cgroup), "
                             + then)


def check_target_cpu(target_cpu: float | None, replay: bool, target_mbit: float | None,
                     emulate: bool) -> None:
    """ConfigError where ``--target-cpu`` is given without what it dilates with."""
    if target_cpu is not None and not (replay and target_mbit and emulate):
        raise ConfigError("--target-cpu: the cores a replayed GPU host's communication has, "
                          "dilated with its time on emulated hosts; it needs --replay, "
                          "--target-nic and --emulate")


def with_target_cpu(config: Config, target_cpu: float, target_mbit: float) -> Config:
    """``config`` with every emulated worker host at ``target_cpu`` of this machine's cores
    over the replay's dilation (BPSCTL_HOST_CPU), and a start deadline as much longer: the
    imports and the model's set-up run at that share of a CPU too."""
    host_cpu = dilated_host_cpu(target_cpu, dilation_factor(target_mbit, config.nic_mbit))
    return config.replace(host_cpu=host_cpu,
                          start_timeout_s=config.start_timeout_s / min(1.0, host_cpu))


def _cluster_config(ctx: typer.Context, partition_bytes: str | None,
                    credit_bytes: str | None, emulate: bool | None,
                    nic: str | None, config_file: Path | None = None,
                    trace_dir: Path | None = None, straggler: str | None = None,
                    backup_workers: int | None = None, staleness: int | None = None,
                    async_mode: bool | None = None, colocated_servers: bool | None = None,
                    cpu_share: str | None = None) -> Any:
    """The Config every benchmark (and tune) shares: data-path knobs, the (emulated) cluster
    flags, and the tuned config file under them."""
    flags = {"partition_bytes": (None if partition_bytes is None
                                 else parse_size(partition_bytes, "--partition-bytes"),
                                 "--partition-bytes"),
             "credit_bytes": (None if credit_bytes is None
                              else parse_size(credit_bytes, "--credit-bytes"), "--credit-bytes"),
             "emulate": (emulate, "--emulate"), "nic": (nic, "--nic"),
             "straggler": (straggler, "--straggler"),
             "backup_workers": (backup_workers, "--backup-workers"),
             "staleness": (staleness, "--staleness"),
             "async_mode": (async_mode, "--async"),
             "colocated_servers": (colocated_servers, "--colocated-servers"),
             "cpu_share": (cpu_share, "--cpu-share"),
             "trace_dir": (None if trace_dir is None else str(trace_dir.resolve()), "--trace")}
    # a figure must not hide a failover: a server lost mid-benchmark fails the run, naming it
    config = build_config(ctx, flags, config_file, read_file=True).replace(server_failover=False)
    if config.trace_dir:
        _check_trace_dir(Path(config.trace_dir))
    if config.nic and not config.emulate and hosts_cluster(config.state_dir) is None:
        raise ConfigError("--nic: a NIC rate only applies to an emulated cluster; add --emulate "
                          "(or, as the ideal of nic_fraction, to an SSH or Slurm cluster "
                          "`bpsctl up --hosts` or `bpsctl up --slurm` started)")
    return config


def _check_trace_dir(directory: Path) -> None:
    """A trace directory that cannot be written is a usage error, said before anything runs."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".bpsctl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--trace / BPSCTL_TRACE_DIR: cannot write to {directory} "
                          f"({exc.strerror or exc}); choose a writable directory") from None


def _trace_option() -> Any:
    return typer.Option(None, "--trace", metavar="DIR", envvar="BPSCTL_TRACE_DIR",
                        show_envvar=True,
                        help="Write bpsctl's timelines (every worker and server) under DIR; "
                             "`bpsctl trace DIR` reads them. The baselines are not traced.")


def _said_traces(config: Any) -> None:
    if config.trace_dir:
        # soft_wrap: the command stays whole, to copy and paste
        err_console.print(f"traces of the last bpsctl run in {config.trace_dir}: "
                          f"bpsctl trace {config.trace_dir}", highlight=False, soft_wrap=True)


def _where(config: Any) -> str:
    """Where a benchmark runs, for its progress line."""
    if config.emulate:
        slow = "".join(f", worker {rank}'s at {factor:g}x" for rank, factor in
                       config.stragglers.items())
        slow += "".join(f", worker {rank}'s host at {factor:g} CPU" for rank, factor in
                        config.cpu_stragglers.items())
        return f"emulated NIC {config.nic or 'unshaped'}{slow}"
    cluster = hosts_cluster(config.state_dir)
    if cluster and cluster.slurm:
        return f"the nodes of Slurm job {cluster.slurm['job_id']}"
    return f"the SSH cluster of {cluster.hosts.source}" if cluster and cluster.hosts \
        else "this machine"


def _run_bench(what: str, config: Any, run: Callable[[Callable[[str], None]], dict[str, Any]],
               show: Callable[[Any, dict[str, Any]], None], json_file: Path | None,
               plot_file: Path | None,
               plot: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """One bench command's frame: matplotlib checked up front when plotting (a missing one is
    a usage error), ``run(progress)`` under a status line, then the table, traces, JSON, plot.
    Returns the report."""
    if plot_file is not None:
        from .report import _pyplot
        _pyplot()
    where = _where(config)
    with err_console.status(f"bench {what} on {where}") as status:
        report = run(lambda message: status.update(f"bench {what} on {where}: {message}"))
    show(err_console, report)
    _said_traces(config)
    _write_json(json_file, report)
    if plot_file is not None:
        plot(report, plot_file)
        err_console.print(f"wrote {plot_file}", highlight=False)
    return report


def _write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is None:
        return
    if str(path) == "-":
        typer.echo(json.dumps(report, indent=2))
        return
    path.write_text(json.dumps(report, indent=2) + "\n")
    err_console.print(f"wrote {path}", highlight=False)


@bench_app.command()
def comm(ctx: typer.Context,
         workers: int | None = typer.Option(None, "--workers", "-n", min=1, show_default="2",
                                            help=WORKERS_HELP),
         servers: int | None = typer.Option(None, "--servers", min=0, help=SERVERS_HELP),
         colocated_servers: bool | None = knob_option("colocated_servers",
                                                      "--colocated-servers"),
         cpu_share: str | None = knob_option("cpu_share", "--cpu-share"),
         size: str = typer.Option("64MiB", "--size", help="Bytes each worker push_pulls per round "
                                  "(64MiB, 4MB, 4096000), or several: 1MiB,16MiB,64MiB,256MiB."),
         tensors: int = typer.Option(8, "--tensors", min=1,
                                     help="Tensors the bytes are spread over."),
         warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed rounds first."),
         repeats: int = typer.Option(10, "--repeats", min=1,
                                     help="Timed rounds (the median is reported)."),
         compare: str | None = typer.Option(None, "--compare",
                                            help="Baselines in the same run: allreduce "
                                                 "(torch.distributed gloo ring allreduce, "
                                                 "beside push_pull), horovod (Horovod's own "
                                                 "collectives over Gloo, beside --op's)."),
         op: str = typer.Option(
             "push_pull", "--op", metavar="OP[,OP]",
             help="What to measure: push_pull, or Horovod's collectives through bpsctl's torch "
                  "plugin (allreduce, allgather, alltoall, reducescatter; several "
                  "comma-separated) on CPU float32 tensors, each result checked; allreduce "
                  "adds push_pull of the same bytes. Bytes per op as nccl-tests counts them: "
                  "--size is each rank's input (allreduce, alltoall, reducescatter) or "
                  "gathered output (allgather: each rank gives --size/N)."),
         reduce: str | None = typer.Option(
             None, "--reduce", metavar="average|sum", show_default="average",
             help="The op of --op's allreduce and reducescatter, and of the push_pull beside "
                  "allreduce (Horovod's default: average)."),
         emulate: bool | None = knob_option("emulate", "--emulate"),
         nic: str | None = knob_option("nic", "--nic"),
         straggler: str | None = knob_option("straggler", "--straggler"),
         backup_workers: int | None = knob_option("backup_workers", "--backup-workers"),
         workers_per_host: int = typer.Option(1, "--workers-per-host", metavar="K",
                                              help=WORKERS_PER_HOST_HELP),
         sweep: str | None = typer.Option(None, "--sweep", metavar="workers=2,4,6,8",
                                          help="A cluster per worker count; speedup over "
                                               "allreduce against the theory 2(n-1)/n."),
         partition_bytes: str | None = knob_option("partition_bytes", "--partition-bytes"),
         credit_bytes: str | None = knob_option("credit_bytes", "--credit-bytes"),
         security: str | None = typer.Option(
             None, "--security", metavar="MODE[,MODE]",
             help="Security modes to measure side by side, each on a private cluster: hmac, "
                  "curve, none (default: BPSCTL_SECURITY's mode only)."),
         raw: bool = typer.Option(True, "--raw/--no-raw",
                                  help="Also measure raw ZeroMQ for the same bytes (loopback "
                                       "only; not with --op)."),
         device: str = typer.Option(
             "cpu", "--device", metavar="cpu|cuda|auto",
             help="Where the tensors are: host memory, or CUDA (the copies to and from the GPU "
                  "included; --compare allreduce then runs over NCCL where every worker has "
                  "a GPU of its own); auto: cuda where every worker host has a GPU."),
         json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                               help="Write the results as JSON (- for stdout)."),
         plot_file: Path | None = typer.Option(None, "--plot", metavar="FILE",
                                               help="Draw the results as a PNG."),
         trace_dir: Path | None = _trace_option(),
         config_file: Path | None = config_file_option(),
         ) -> None:
    """push_pull throughput of N workers and K servers, beside raw ZeroMQ and ring allreduce;
    or (--op) Horovod's collectives through bpsctl, beside Horovod's own (--compare horovod)."""
    with cli_errors():
        config = _cluster_config(ctx, partition_bytes, credit_bytes, emulate, nic, config_file,
                                 trace_dir, straggler, backup_workers,
                                 colocated_servers=colocated_servers, cpu_share=cpu_share)
        ops = _names(op)
        check_ops(ops, _names(compare), device, _names(security), sweep is not None, reduce)
        if is_collectives(ops):
            device = "cpu"          # (auto: the collectives are measured on CPU tensors)
        n, k = cluster_size(config, workers, servers, "--sweep" if sweep is not None else "",
                            workers_per_host)
        worker_counts = _sweep(sweep)
        for count in [c * workers_per_host for c in worker_counts] if worker_counts else [n]:
            check_backup_workers(config.backup_workers, count)
            if count == 1 and "allreduce" in _names(compare):
                raise ConfigError("--compare allreduce with one worker: an allreduce of one "
                                  "rank moves nothing, so there is nothing to compare; run 2 "
                                  "or more workers (--workers), or drop --compare")
        gpus = [] if device == "cpu" else probe_gpus(config)
        device = resolve_device(device, gpus)
        host_workers, host_gpus, gpu_by = physical_hosts(config, n, gpus)
        backend, backend_why = baseline_backend(device, host_workers, host_gpus)
        settings = CommSettings(workers=n, servers=k, sizes=_sizes(size),
                                tensors=tensors, warmup=warmup, repeats=repeats, raw=raw,
                                compare=_names(compare), security=_names(security),
                                workers_per_host=workers_per_host, device=device,
                                gpu_by=gpu_by, backend=backend, backend_why=backend_why,
                                gpus=tuple(gpus), ops=ops, reduce=reduce or "average")
        too_small = [s for s in settings.sizes if s < 4 * tensors]
        if too_small:
            raise ConfigError(f"--size: {too_small[0]} bytes is too small for {tensors} float32 "
                              f"tensors (at least {4 * tensors} bytes)")
        def run(progress: Callable[[str], None]) -> dict[str, Any]:
            if worker_counts is None:
                return run_comm(config, settings, progress=progress)
            return run_sweep(config, settings, worker_counts, servers, progress=progress)
        _run_bench("comm", config, run, print_comm, json_file, plot_file, plot_comm)


def _train(ctx: typer.Context, model: str, workers: int | None, servers: int | None,
           batch_size: int | None, image_size: int | None, num_classes: int, warmup: int,
           iters: int,
           batches_per_iter: int,
           compare: str | None, rounds: int, emulate: bool | None, nic: str | None,
           partition_bytes: str | None, credit_bytes: str | None,
           json_file: Path | None, plot_file: Path | None,
           config_file: Path | None, trace_dir: Path | None = None,
           straggler: str | None = None, compression: str | None = None,
           backup_workers: int | None = None, cross_barrier: bool = False,
           staleness: int | None = None, async_mode: bool | None = None,
           workers_per_host: int = 1, colocated_servers: bool | None = None,
           cpu_share: str | None = None, device: str = "auto", replay: str | None = None,
           target_nic: str | None = None, sweep: str | None = None,
           target_cpu: float | None = None) -> None:
    with cli_errors():
        config = _cluster_config(ctx, partition_bytes, credit_bytes, emulate, nic, config_file,
                                 trace_dir, straggler, backup_workers, staleness, async_mode,
                                 colocated_servers, cpu_share)
        target_mbit = None if target_nic is None else parse_rate_mbit(target_nic, "--target-nic")
        if replay:
            from .profile import load
            profile = load(replay)
            if device == "auto":
                device = "cpu"          # the stand-in needs no GPU: host memory
            batch_size = batch_size or profile.batch_size
            image_size = image_size or profile.image_size
            if target_mbit is not None and not config.emulate and \
                    hosts_cluster(config.state_dir) is None:
                dilation_factor(target_mbit, config.nic_mbit)     # a NIC rate to dilate to
            if config.async_mode:
                raise ConfigError("--replay with --async: the servers would apply SGD updates "
                                  "the stand-in's optimizer does not make; drop --async")
        baselines = _names(compare)
        if target_cpu is not None and "horovod" in baselines:
            raise ConfigError("--target-cpu with --compare horovod: Horovod waits for each "
                              "result by waking every millisecond, which no dilation slows, so "
                              "a dilated CPU would go on waking up; drop horovod from --compare "
                              "(or --target-cpu)")
        check_target_cpu(target_cpu, bool(replay), target_mbit, config.emulate)
        gpus = [] if device == "cpu" else probe_gpus(config, horovod="horovod" in baselines)
        device = resolve_device(device, gpus)
        live = launch.load_state(config.state_dir)
        if device == "cuda" and workers is None and not config.emulate and \
                (live is None or (live.kind == "local" and not live.emulation)):
            workers = gpus[0].count             # one worker per GPU of this machine
        worker_counts = _sweep(sweep)
        given_servers = servers
        workers, servers = cluster_size(config, workers, servers,
                                        "--sweep" if sweep is not None else "",
                                        workers_per_host=workers_per_host)
        if replay and hosts_cluster(config.state_dir) is None:     # all on this machine
            points = [(count, count * workers_per_host,
                       sweep_servers(config, given_servers, count))
                      for count in worker_counts] if worker_counts else \
                [(workers // workers_per_host, workers, servers)]
            config = _replay_fit(config, profile.nbytes,
                                 target_mbit if config.emulate else None, points)
            if target_cpu is not None:
                assert target_mbit is not None
                config = with_target_cpu(config, target_cpu, target_mbit)
        host_workers, host_gpus, gpu_by = physical_hosts(config, workers, gpus)
        backend, backend_why = baseline_backend(device, host_workers, host_gpus)
        if device == "cuda" and "horovod" in baselines:
            check_horovod_nccl(gpus)
            if backend != "nccl":
                raise ConfigError(f"--compare horovod on GPUs: {backend_why}, but Horovod takes "
                                  "CUDA tensors over NCCL only; run at most one worker per GPU "
                                  "(--workers), or drop horovod from --compare")
        for count in [c * workers_per_host for c in worker_counts] if worker_counts else [workers]:
            check_backup_workers(config.backup_workers, count)
        check_training_mode(config, {"staleness": "--staleness", "async_mode": "--async",
                                     "backup_workers": "--backup-workers"},
                            compression=compression or None)
        if (config.staleness or config.async_mode) and cross_barrier:
            raise ConfigError(f"{'--staleness' if config.staleness else '--async'} with "
                              "--cross-barrier: the cross barrier applies each layer's average "
                              "of the same step itself; choose one")
        settings = TrainSettings(model=model, workers=workers, servers=servers,
                                 batch_size=batch_size or TRAIN_DEFAULTS[device]["batch_size"],
                                 image_size=image_size or TRAIN_DEFAULTS[device]["image_size"],
                                 num_classes=num_classes, warmup=warmup, iters=iters,
                                 batches_per_iter=batches_per_iter, compare=baselines,
                                 rounds=rounds, compression=compression or "",
                                 cross_barrier=cross_barrier, workers_per_host=workers_per_host,
                                 device=device, gpu_by=gpu_by, backend=backend,
                                 backend_why=backend_why, gpus=tuple(gpus),
                                 replay=replay or "", target_nic_mbit=target_mbit,
                                 target_cpu=target_cpu)
        if worker_counts is not None:
            _run_bench(model, config, lambda progress: run_train_sweep(
                config, settings, worker_counts, given_servers,
                progress=lambda message: progress(f"training, {message}")),
                print_train_sweep, json_file, plot_file, plot_train_sweep)
            return
        _run_bench(model, config, lambda progress: run_train(
            config, settings, progress=lambda message: progress(f"training with {message}")),
            print_train, json_file, plot_file, plot_train)


def _replay_fit(config: Any, model_bytes: int, target_mbit: float | None,
                points: list[tuple[int, int, int]]) -> Any:
    """A replay on this machine (embedded or emulated), of a model of ``model_bytes``,
    ``points`` (worker hosts, workers, servers) per cluster the run builds: a note if the
    largest would not fit this machine's memory. On emulated hosts, dilated (``target_mbit``):
    without --nic, the config with the fastest NIC rate at which the most hosts fit this
    machine's cores; with one, the config as it is, after a note if they would not."""
    _, workers, servers = max(points, key=lambda point: point[1] + point[2])
    note = replay_memory_note(model_bytes, workers, servers,
                              psutil.virtual_memory().available / 2**20)
    if note:
        err_console.print(f"note: {note}")
    if target_mbit is None:
        return config
    hosts = max(srv if config.colocated_servers else worker_hosts + srv
                for worker_hosts, _, srv in points)
    cores = len(os.sched_getaffinity(0))
    if config.nic_mbit is None:
        rate = replay_nic_mbit(hosts, cores)
        err_console.print(f"note: --nic {rate_flag(rate)} (x{target_mbit / rate:g} dilation): the "
                          f"fastest emulated NIC at which {hosts} hosts fit this machine's "
                          f"{cores} CPU cores in a replay")
        return config.replace(nic=rate_flag(rate))
    note = replay_fit_note(hosts, cores, config.nic_mbit, target_mbit)
    if note:
        err_console.print(f"note: {note}")
    return config


def _train_command(model: str, title: str) -> None:
    def command(ctx: typer.Context,
                workers: int | None = typer.Option(None, "--workers", "-n", min=1,
                                                   show_default="2", help=WORKERS_HELP),
                workers_per_host: int = typer.Option(1, "--workers-per-host", metavar="K",
                                                     help=WORKERS_PER_HOST_HELP),
                servers: int | None = typer.Option(None, "--servers", min=0, help=SERVERS_HELP),
                colocated_servers: bool | None = knob_option("colocated_servers",
                                                             "--colocated-servers"),
                cpu_share: str | None = knob_option("cpu_share", "--cpu-share"),
                device: str = typer.Option(
                    "auto", "--device", metavar="auto|cuda|cpu",
                    help="Train on the GPUs (cuda: one worker per GPU by default, DDP over "
                         "NCCL) or the CPUs; auto: cuda where every worker host has a GPU."),
                batch_size: int | None = typer.Option(
                    None, "--batch-size", min=1, show_default="64 on cuda, 4 on cpu",
                    help="Images per worker per batch."),
                image_size: int | None = typer.Option(
                    None, "--image-size", min=32, show_default="224 on cuda, 32 on cpu",
                    help="Side of the square synthetic images (pixels)."),
                num_classes: int = typer.Option(1000, "--num-classes", min=2,
                                                help="Output classes."),
                warmup: int = typer.Option(2, "--warmup", min=1,
                                           help="Untimed batches first (they declare every "
                                                "tensor)."),
                iters: int = typer.Option(5, "--iters", min=1, help="Timed iterations."),
                batches_per_iter: int = typer.Option(1, "--batches-per-iter", min=1,
                                                     help="Batches per timed iteration."),
                compare: str | None = typer.Option(
                    None, "--compare", help="Baselines in the same run: horovod (Horovod with "
                    "Gloo, NCCL on GPUs; `bpsctl install horovod`), ddp (torch DDP, 25 MB "
                    "buckets, gloo or NCCL on GPUs), ddp-powersgd (the same with torch's "
                    "PowerSGD hook, rank 4). A plain row (one worker alone, no communication) "
                    "is always measured, for the scaling efficiency."),
                compression: str | None = typer.Option(
                    None, "--compression", metavar="SPEC",
                    help="bpsctl's gradients between machines: onebit, topk:RATIO, "
                    "randomk:RATIO, dithering:LEVELS (with error feedback), fp16 or bf16; "
                    "tensors under BPSCTL_MIN_COMPRESS_BYTES travel as they are."),
                cross_barrier: bool = typer.Option(
                    False, "--cross-barrier",
                    help="bpsctl trains with CrossBarrier instead of DistributedOptimizer: "
                    "each layer is updated as its sum arrives and the next forward pass starts "
                    "on the first layers."),
                rounds: int = typer.Option(1, "--rounds", min=1,
                                           help="Run every system this many times, each going "
                                                "first in turn; speedup is the median of the "
                                                "rounds' ratios (for machines whose speed "
                                                "drifts)."),
                replay: str | None = typer.Option(
                    None, "--replay", metavar="PROFILE",
                    help="Train a stand-in with the profile's parameters that replays its "
                         "recorded step times on the clock instead of computing (a shipped "
                         "profile's name or a `bpsctl profile` file; `bpsctl profile --list`); "
                         "batch and image size are the profile's. See docs/replay.md."),
                target_nic: str | None = typer.Option(
                    None, "--target-nic", metavar="RATE",
                    help="With --replay and an emulated --nic: the NIC that one stands for; "
                         "every recorded time is multiplied by RATE over --nic, and img/sec "
                         "and s/step are reported in the target's time (e.g. --nic 500mbit "
                         "--target-nic 25gbit: x50). With --emulate and no --nic, the fastest "
                         "NIC at which the emulated hosts fit this machine's CPU cores."),
                target_cpu: float | None = target_cpu_option(
                    "so the systems' own CPU work per message is dilated as well (e.g. 6 at "
                    "x125: 0.048 of a CPU). Without it, that work runs undilated: see "
                    "docs/replay.md. Not with --compare horovod, which polls every ms."),
                sweep: str | None = typer.Option(
                    None, "--sweep", metavar="workers=1,2,4,8",
                    help="A cluster per worker count (servers = workers unless --servers), "
                         "every system on each: img/sec per worker and scaling; with --replay, "
                         "the step model's prediction beside each row."),
                emulate: bool | None = knob_option("emulate", "--emulate"),
                nic: str | None = knob_option("nic", "--nic"),
                straggler: str | None = knob_option("straggler", "--straggler"),
                backup_workers: int | None = knob_option("backup_workers", "--backup-workers"),
                staleness: int | None = knob_option("staleness", "--staleness"),
                async_mode: bool | None = knob_option("async_mode", "--async"),
                partition_bytes: str | None = knob_option("partition_bytes", "--partition-bytes"),
                credit_bytes: str | None = knob_option("credit_bytes", "--credit-bytes"),
                json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                                      help="Write the results as JSON (- for "
                                                           "stdout)."),
                plot_file: Path | None = typer.Option(None, "--plot", metavar="FILE",
                                                      help="Draw img/sec per system as a PNG."),
                trace_dir: Path | None = _trace_option(),
                config_file: Path | None = config_file_option(),
                ) -> None:
        _train(ctx, model, workers, servers, batch_size, image_size, num_classes, warmup, iters,
               batches_per_iter, compare, rounds, emulate, nic, partition_bytes, credit_bytes,
               json_file, plot_file, config_file, trace_dir, straggler, compression,
               backup_workers, cross_barrier, staleness, async_mode, workers_per_host,
               colocated_servers, cpu_share, device, replay, target_nic, sweep, target_cpu)

    command.__doc__ = (f"Synthetic {title} training: img/sec of bpsctl beside Horovod and torch "
                       "DDP, same hosts and settings, one run.")
    bench_app.command(name=model)(command)


_train_command("vgg16", "VGG16")
_train_command("resnet50", "ResNet50")


@bench_app.command()
def convergence(ctx: typer.Context,
                workers: int | None = typer.Option(None, "--workers", "-n", min=1,
                                                   show_default="2", help=WORKERS_HELP),
                servers: int | None = typer.Option(None, "--servers", min=0, help=SERVERS_HELP),
                colocated_servers: bool | None = knob_option("colocated_servers",
                                                             "--colocated-servers"),
                cpu_share: str | None = knob_option("cpu_share", "--cpu-share"),
                compare: str = typer.Option(
                    "sync,backup,ddp", "--compare", metavar="SYSTEM[,SYSTEM]",
                    help="Systems trained one after another on the same cluster: sync (bpsctl, "
                         "every worker every step), backup (bpsctl with --backup-workers, "
                         "default 1), stale (bpsctl with --staleness, default 2), async (bpsctl "
                         "asynchronous, servers hold the parameters), ddp (torch DDP, gloo)."),
                target: float = typer.Option(0.85, "--target", min=0.0, max=1.0,
                                             help="Test accuracy each system trains to."),
                max_steps: int = typer.Option(2000, "--max-steps", min=1,
                                              help="A system that has not reached the target "
                                                   "by then stops (reported as not reached)."),
                steps: int | None = typer.Option(
                    None, "--steps", min=1,
                    help="Train every system exactly this many steps, past the target (in "
                         "place of --target/--max-steps as the stop); the table gives the "
                         "accuracy then and the step the target was first reached."),
                compression: str | None = typer.Option(
                    None, "--compression", metavar="SPEC[,SPEC]",
                    help="Add a row per compressor: the sync system with its gradients "
                         "compressed (onebit, topk:RATIO, randomk:RATIO, dithering:LEVELS, fp16, "
                         "bf16; :noef switches error feedback off, e.g. onebit:noef). Every "
                         "tensor is compressed, however small."),
                eval_every: int = typer.Option(5, "--eval-every", min=1,
                                               help="Steps between measurements of the test "
                                                    "accuracy."),
                batch_size: int = typer.Option(32, "--batch-size", min=1,
                                               help="Samples per worker per step."),
                lr: float = typer.Option(0.05, "--lr", min=0.0, help="SGD learning rate "
                                                                     "(momentum 0.9)."),
                train_samples: int = typer.Option(4096, "--train-samples", min=16,
                                                  help="Training set, split over the workers."),
                seed: int = typer.Option(0, "--seed", help="The teacher's, the data's and the "
                                                           "student's seed."),
                hidden: int = typer.Option(64, "--hidden", min=1,
                                           help="The student's hidden units: its gradient is "
                                                "about 84 bytes per unit, so this sets how much "
                                                "each step puts on the network."),
                backup_workers: int | None = knob_option("backup_workers", "--backup-workers"),
                staleness: int | None = typer.Option(
                    None, "--staleness", min=1, show_default="2",
                    help="The stale system's staleness: a worker applies the averages of this "
                         "many steps ago (default: BPSCTL_STALENESS if set, else 2)."),
                emulate: bool | None = knob_option("emulate", "--emulate"),
                nic: str | None = knob_option("nic", "--nic"),
                straggler: str | None = knob_option("straggler", "--straggler"),
                json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                                      help="Write the results as JSON (- for "
                                                           "stdout)."),
                plot_file: Path | None = typer.Option(None, "--plot", metavar="FILE",
                                                      help="Draw accuracy against time per "
                                                           "system as a PNG."),
                config_file: Path | None = config_file_option(),
                ) -> None:
    """Time to accuracy: each system trains a small real classification task (a seeded
    teacher network labels random inputs; no download) to --target on the same cluster;
    steps, wall time and final accuracy per system. --compression adds compressed sync rows;
    --steps compares accuracy after the same number of steps."""
    with cli_errors():
        config = _cluster_config(ctx, None, None, emulate, nic, config_file, None, straggler,
                                 colocated_servers=colocated_servers, cpu_share=cpu_share)
        n, k = cluster_size(config, workers, servers)
        backup = backup_workers if backup_workers is not None else (config.backup_workers or 1)
        settings = ConvergenceSettings(workers=n, servers=k, compare=_names(compare),
                                       target=target, max_steps=max_steps, steps=steps or 0,
                                       compression=_names(compression),
                                       eval_every=eval_every, batch_size=batch_size, lr=lr,
                                       train=train_samples, seed=seed, hidden=hidden,
                                       backup_workers=backup,
                                       staleness=staleness if staleness is not None else (
                                           config.staleness or 2))
        report = _run_bench("convergence", config,
                            lambda progress: run_convergence(config, settings,
                                                             progress=progress),
                            print_convergence, json_file, plot_file, plot_convergence)
        if not report["all_reached"] and not steps:
            missed = ", ".join(r["system"] for r in report["results"] if not r["reached"])
            err_console.print(f"[bold red]error:[/] {missed} did not reach {target:g} within "
                              f"{max_steps} steps (raise --max-steps or lower --target)",
                              highlight=False)
            raise typer.Exit(1)


@bench_app.command()
def load(ctx: typer.Context,
         workers: int = typer.Option(8, "--workers", "-n", min=1, help="Worker processes."),
         servers: int = typer.Option(4, "--servers", min=1, help="Summation servers."),
         steps: int = typer.Option(1000, "--steps", min=2, help="Steps in all."),
         warmup: int = typer.Option(100, "--warmup", min=1,
                                    help="Steps before the memory baseline is read."),
         scale: float = typer.Option(1.0, "--scale", min=0.0, max=1.0,
                                     help="Of each ResNet50 gradient's size (1: 97.5 MiB in all)."),
         max_growth: float = typer.Option(0.05, "--max-growth", min=0.0,
                                          help="Largest RSS growth after warm-up that passes."),
         partition_bytes: str | None = knob_option("partition_bytes", "--partition-bytes"),
         credit_bytes: str | None = knob_option("credit_bytes", "--credit-bytes"),
         json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                               help="Write the results as JSON (- for stdout)."),
         ) -> None:
    """Many steps of ResNet50's gradients on the embedded default: exact canary sums every
    step, and every process's memory flat after warm-up (exit 1 otherwise)."""
    from .load import LoadSettings, format_report, run_load
    with cli_errors():
        config = _cluster_config(ctx, partition_bytes, credit_bytes, None, None)
        try:
            settings = LoadSettings(workers=workers, servers=servers, steps=steps, warmup=warmup,
                                    scale=scale, max_growth=max_growth)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        with err_console.status("bench load") as status:
            report = run_load(config, settings,
                              progress=lambda message: status.update(f"bench load: {message}"))
        err_console.print(format_report(report), highlight=False)
        _write_json(json_file, report)
        if not report["ok"]:
            raise typer.Exit(1)


#: `bpsctl profile`'s batch by device: bench's on a GPU; a few images on a CPU, which takes
#: seconds per step at 224x224
PROFILE_BATCH = {"cuda": 64, "cpu": 4}


def profile(model: str | None = typer.Argument(None, metavar="MODEL",
                                               help="vgg16 or resnet50."),
            device: str = typer.Option("cpu", "--device", metavar="cpu|cuda",
                                       help="Where to train while recording."),
            batch_size: int | None = typer.Option(None, "--batch-size", min=1,
                                                  show_default="64 on cuda, 4 on cpu",
                                                  help="Images per batch."),
            image_size: int = typer.Option(224, "--image-size", min=32,
                                           help="Side of the square synthetic images (pixels)."),
            steps: int = typer.Option(5, "--steps", min=1,
                                      help="Timed steps; every time is their median."),
            warmup: int = typer.Option(2, "--warmup", min=1, help="Untimed steps first."),
            output: Path | None = typer.Option(None, "--output", "-o", metavar="FILE",
                                               help="Write the profile (JSON) to FILE."),
            list_profiles: bool = typer.Option(False, "--list",
                                               help="List the shipped profiles (each with its "
                                                    "device, and whether it was recorded or "
                                                    "derived) and exit."),
            ) -> None:
    """Record where a training step of MODEL spends its time (forward, each gradient's ready
    time in backward, the optimizer step; medians over --steps) into a profile that `bpsctl
    bench MODEL --replay FILE` replays. See docs/replay.md."""
    from . import profile as profiles
    with cli_errors():
        if list_profiles:
            _list_profiles()
            return
        if model is None or output is None:
            raise ConfigError("bpsctl profile: give MODEL (vgg16 or resnet50) and -o FILE, or "
                              "--list for the shipped profiles")
        from .models import MODELS
        if model not in MODELS:
            raise ConfigError(f"MODEL: expected one of {', '.join(MODELS)}, got {model!r}")
        if device not in profiles.DEVICES:
            raise ConfigError(f"--device: expected cpu or cuda, got {device!r}")
        if output.parent and not output.parent.is_dir():
            raise ConfigError(f"-o: {output.parent} is not a directory")
        with err_console.status(f"profile {model} on {device}") as status:
            recorded = profiles.record(
                model, device, batch_size or PROFILE_BATCH[device], image_size, steps, warmup,
                progress=lambda message: status.update(f"profile {model} on {device}: "
                                                       f"{message}"))
        recorded.write(output)
        err_console.print(
            f"{model} on {recorded.device_name}, batch {recorded.batch_size} of "
            f"{image_size}x{image_size}: forward {recorded.forward_s * 1e3:.1f} ms, backward "
            f"{recorded.backward_s * 1e3:.1f} ms, optimizer step "
            f"{recorded.optimizer_s * 1e3:.1f} ms (medians of {steps} steps); wrote {output}",
            highlight=False)


def _list_profiles() -> None:
    from rich.table import Table

    from . import profile as profiles
    table = Table(title="shipped profiles (bpsctl bench MODEL --replay NAME)")
    for column in ("name", "device", "batch", "ms/step", "source"):
        # the name, batch and time whole; the device and the source wrap where they must
        table.add_column(column, justify="right" if column in ("batch", "ms/step") else "left",
                         no_wrap=column in ("name", "batch", "ms/step"))
    for name in profiles.shipped_names():
        found = profiles.load(name)
        table.add_row(name, f"{found.device}: {found.device_name}",
                      f"{found.batch_size} of {found.image_size}px",
                      f"{(found.step_s or found.total_s) * 1e3:.1f}",
                      "recorded" if found.source == "recorded"
                      else f"derived from {found.derived_from}")
    err_console.print(table)
