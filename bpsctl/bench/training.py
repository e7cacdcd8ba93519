"""The training benchmarks as functions: `bpsctl bench vgg16|resnet50` (bpsctl against Horovod,
DDP and PowerSGD on the same hosts, each a job of :mod:`bpsctl.bench.train` workers) and
`bpsctl bench convergence` (each system trained to the same target accuracy,
:mod:`bpsctl.bench.convergence`). The cluster, the workers' launch and the result lines are
:mod:`bpsctl.bench.api`'s, as for `bench comm`.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import socket
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from .. import launch
from ..config import Config, ConfigError
from ..engine.paths import LOCAL_PATHS
from ..model import GOODPUT_SHARE as GOODPUT_SHARE  # (where bench and its tests find it)
from ..model import round_seconds
from .api import (
    _cluster_keys,
    _job_servers,
    _run_workers,
    bench_cluster,
    check_per_host_split,
    host_streams,
    hosts_cluster,
    ideal_step_seconds,
    sweep_servers,
    worker_hosts,
)
from .gpu import HostGPUs, gpu_keys, last_json, probe_code, probe_here
from .horovod import check_installed, horovod_rendezvous, worker_args
from .profile import (
    dilation_factor,
    predicted_step_s,
    replay_label,
    resolve,
    round_latency_s,
    shipped_names,
    undilate_row,
)
from .train import throughput

TRAIN_BASELINES = ("horovod", "ddp", "ddp-powersgd")


@dataclass(frozen=True)
class TrainSettings:
    """`bench vgg16|resnet50`: Horovod's synthetic benchmark, the same for every system."""

    model: str = "vgg16"
    workers: int = 2
    servers: int = 2
    batch_size: int = 4
    image_size: int = 32
    num_classes: int = 1000
    warmup: int = 2
    iters: int = 5
    batches_per_iter: int = 1
    compare: tuple[str, ...] = field(default=())
    rounds: int = 1                      # each system runs once per round; rounds rotate the order
    timeout_s: float = 900.0             # per system; a hung worker exits after it
    compression: str = ""                # bpsctl's gradients: a spec of engine/compression.py
    cross_barrier: bool = False          # bpsctl updates per layer (engine/torch/cross_barrier.py)
    #: workers on each emulated worker host (``workers`` counts every process: hosts times this)
    workers_per_host: int = 1
    device: str = "cpu"                  # cuda or cpu (resolved: see bench/gpu.py)
    #: the GPU of a worker: its local rank's (hosts with GPUs of their own) or its rank's
    #: (emulated hosts, which share this machine's) modulo the GPUs
    gpu_by: str = "local_rank"
    backend: str = "gloo"                # DDP's (and PowerSGD's) torch.distributed backend
    backend_why: str = ""                # why that backend, for the report
    gpus: tuple[Any, ...] = ()           # bench.gpu.HostGPUs of the worker hosts (on CUDA)
    #: a profile's shipped name or file: every worker trains bench/replay.py's stand-in
    replay: str = ""
    #: with ``replay``: the NIC rate the emulated one stands for (the time dilation's target)
    target_nic_mbit: float | None = None
    #: with ``target_nic_mbit`` on emulated hosts: the cores of this machine a target worker
    #: host's communication has (each emulated worker host gets them over the dilation)
    target_cpu: float | None = None

    def __post_init__(self) -> None:
        from ..engine.compression import parse
        check_per_host_split(self.workers, self.workers_per_host)
        from .shapes import MODELS
        if self.model not in MODELS:
            raise ConfigError(f"model: expected one of {', '.join(MODELS)}, got {self.model!r}")
        if self.compression:
            try:
                parse(self.compression)
            except ValueError as exc:
                raise ConfigError(f"--compression: {exc}") from None
        if self.replay:
            self.replayed()
        elif self.target_nic_mbit is not None:
            raise ConfigError("--target-nic: only a replay can be dilated to another NIC's "
                              "time; add --replay PROFILE (`bpsctl profile --list`)")
        unknown = [c for c in self.compare if c not in TRAIN_BASELINES]
        if unknown:
            raise ConfigError(f"--compare: {', '.join(unknown)} is not a baseline of bench "
                              f"{self.model}; choose from {', '.join(TRAIN_BASELINES)}")
        for name, value, least in (("--batch-size", self.batch_size, 1),
                                   ("--image-size", self.image_size, 32),
                                   ("--warmup", self.warmup, 1), ("--iters", self.iters, 1),
                                   ("--batches-per-iter", self.batches_per_iter, 1),
                                   ("--rounds", self.rounds, 1)):
            if value < least:
                raise ConfigError(f"{name}: expected at least {least}, got {value}"
                                  + (" (the warm-up declares every tensor before timing)"
                                     if name == "--warmup" else ""))

    def replayed(self) -> Any:
        """The profile of ``replay`` (a :class:`~bpsctl.bench.profile.Profile`); ConfigError
        where it cannot be replayed with these settings."""
        from .profile import load
        profile = load(self.replay)
        where = f"--replay {self.replay}"
        if profile.model != self.model:
            raise ConfigError(f"{where}: a profile of {profile.model}, not {self.model}; run "
                              f"`bpsctl bench {profile.model} --replay {self.replay}`")
        if (self.batch_size, self.image_size) != (profile.batch_size, profile.image_size):
            raise ConfigError(f"{where}: recorded at batch {profile.batch_size} of "
                              f"{profile.image_size}x{profile.image_size} images, and a replay "
                              f"runs at those; drop --batch-size and --image-size (got batch "
                              f"{self.batch_size} of {self.image_size}x{self.image_size})")
        if self.device == "cuda":
            raise ConfigError(f"{where} with --device cuda: the stand-in computes nothing and "
                              "holds its gradients in host memory; drop --device cuda")
        return profile


def probe_gpus(config: Config, horovod: bool = False) -> list[HostGPUs]:
    """The GPUs of each worker host, in host order: every worker host of an SSH cluster (over
    SSH) or a Slurm cluster (one step per node) that `bpsctl up` started; else this machine,
    whose GPUs the embedded default's workers and every emulated host share (one entry).
    ``horovod``: also whether Horovod there allreduces CUDA tensors over NCCL."""
    code = probe_code(horovod)
    recorded = launch.load_state(config.state_dir)
    if recorded is not None and recorded.kind in ("ssh", "slurm") and recorded.hosts:
        hosts = list(dict.fromkeys(entry.host for entry in recorded.hosts.workers))
        python = recorded.hosts.python
        if recorded.kind == "slurm" and recorded.slurm:
            from ..launch import slurm
            answers, why = slurm.ask_nodes(str(recorded.slurm["job_id"]), hosts,
                                           [python, "-c", code], "bpsctl-gpu-probe",
                                           timeout_s=120.0)
            return [HostGPUs.from_answer(host, answers.get(host, {"error": f"no answer{why}"}))
                    for host in hosts]
        from ..launch.transport import run_on_hosts
        found = run_on_hosts(recorded.hosts, hosts, [python, "-c", code], timeout_s=120)
        result = []
        for host in hosts:
            ok, text = found[host]
            answer = last_json(text) if ok else None
            result.append(HostGPUs.from_answer(host, answer or {"error": text or "no answer"}))
        return result
    cpu_build = cpu_torch_version()
    if cpu_build is not None:       # no GPU to find, and no need to import torch to say so
        return [HostGPUs(host=socket.gethostname(), torch=cpu_build)]
    try:
        import torch
    except ImportError:
        return [HostGPUs(host=socket.gethostname(), error="torch is not installed")]
    if torch.version.cuda is None:          # a CPU build: no need for a fresh interpreter
        return [HostGPUs(host=socket.gethostname(), torch=torch.__version__)]
    return [probe_here(socket.gethostname(), code)]


def cpu_torch_version() -> str | None:
    """The installed torch's version if its package says it is a CPU build (PyTorch's CPU
    wheels carry the local version ``+cpu``), else None. Read from the package's metadata:
    importing torch costs the bench's own process seconds of CPU before any worker starts."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if version.endswith("+cpu") else None


def physical_hosts(config: Config, workers: int, gpus: Sequence[HostGPUs]
                   ) -> tuple[list[int], list[int], str]:
    """The workers and GPUs of each physical worker host, and which rank picks a worker's GPU
    (rank %% GPUs): on an SSH or Slurm cluster each host's workers use its own GPUs (by local
    rank); otherwise every worker runs on this machine (emulated hosts included) and shares
    its GPUs (by rank)."""
    if hosts_cluster(config.state_dir) is not None:
        return worker_hosts(config, workers), [host.count for host in gpus], "local_rank"
    return [workers], [gpus[0].count if gpus else 0], "rank"


def train_system(config: Config, settings: TrainSettings, system: str,
                 output: IO[str], dilation: float = 1.0) -> dict[str, Any]:
    """One system's run of the training loop on the cluster named by ``config`` (replaying
    ``settings.replay`` with its times multiplied by ``dilation``, where one is given)."""
    n, k = settings.workers, settings.servers
    args = ["--system", system, "--model", settings.model,
            "--batch-size", str(settings.batch_size), "--image-size", str(settings.image_size),
            "--num-classes", str(settings.num_classes), "--warmup", str(settings.warmup),
            "--iters", str(settings.iters), "--batches-per-iter", str(settings.batches_per_iter),
            "--timeout", str(settings.timeout_s)]
    if system == "bpsctl" and settings.compression:
        args += ["--compression", settings.compression]
    if system == "bpsctl" and settings.cross_barrier:
        args += ["--cross-barrier"]
    if settings.replay:
        # a shipped profile by its name (every host's bpsctl has it), a file by its path
        replay = settings.replay if settings.replay in shipped_names() \
            else str(resolve(settings.replay)[1])
        args += ["--replay", replay, "--dilation", repr(dilation)]
    if settings.device == "cuda":
        args += ["--device", "cuda", "--gpu-by", settings.gpu_by]
    if system in ("ddp", "ddp-powersgd"):
        args += ["--backend", settings.backend]
    if system != "bpsctl":
        config = config.replace(trace_dir="")       # --trace is bpsctl's timeline only
    if system != "horovod":
        return _run_workers(config, "bpsctl.bench.train", args, n, k, output)
    with horovod_rendezvous(config, n) as (hosts, address, port):
        return _run_workers(config, "bpsctl.bench.train",
                            [*args, *worker_args(hosts, address, port)], n, k, output)


def run_train(config: Config, settings: TrainSettings, output: IO[str] | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """bpsctl, then each baseline of ``settings.compare``, training ``settings.model`` on
    synthetic data on one cluster; the JSON of docs/design.md (``kind: train``).

    A baseline that is not installed is a :class:`ConfigError` raised before anything starts:
    there is no silent substitute."""
    output = output if output is not None else sys.stderr
    progress = progress or (lambda message: None)
    if "horovod" in settings.compare:
        check_installed(config)
    # the model's parameters by shape: this process counts values and bytes, the workers
    # train (a replay's stand-in is built, and small)
    parameters: list[Any]
    if settings.replay:
        from .replay import ReplayModel, replays_busy
        profile = settings.replayed()
        parameters = list(ReplayModel(profile).parameters())
    else:
        from .shapes import parameters as shaped
        parameters = list(shaped(settings.model, settings.num_classes))
    params = [p.numel() for p in parameters]
    wire = wire_bytes_per_step(parameters, config, settings.compression, settings.servers)
    piece = largest_piece_bytes(parameters, config, settings.servers)
    del parameters
    # plain: one worker training alone, no communication, for the scaling efficiency
    systems = ("bpsctl", *[b for b in TRAIN_BASELINES if b in settings.compare], "plain")
    rounds: list[dict[str, dict[str, Any]]] = []
    with bench_cluster(config, settings.workers, settings.servers,
                       workers_per_host=settings.workers_per_host) as (cluster_config, nic):
        host_workers = worker_hosts(cluster_config, settings.workers)
        workers_at, server_hosts, _, shares = _job_servers(cluster_config, settings.workers,
                                                           settings.servers)
        dilation = dilation_factor(settings.target_nic_mbit, nic)
        for index in range(settings.rounds):
            # each system goes first in turn, so that a machine that slows down (or speeds
            # up) during the run does not favour whichever always runs first
            turn = index % len(systems)
            rows = {}
            for system in systems[turn:] + systems[:turn]:
                progress(system if settings.rounds == 1
                         else f"{system} (round {index + 1} of {settings.rounds})")
                rows[system] = train_system(cluster_config, settings, system, output, dilation)
            rounds.append(rows)
    results = [_pooled(system, [rows[system] for rows in rounds], settings.batch_size)
               for system in systems]
    streams = host_streams(config, host_workers)
    if results[0].get("gradient_path") in LOCAL_PATHS:
        streams = [0] * len(host_workers)       # as bpsctl's workers found it: nothing left
    # bpsctl's: each worker host's streams to the job's servers by their shares (its layout)
    stream_hosts = [host for host, count in zip(dict.fromkeys(workers_at), streams, strict=True)
                    for _ in range(count)]
    plain = results[-1]["img_per_sec_per_worker"]
    for row in results:
        step_bytes = wire if row["system"] == "bpsctl" else 4 * sum(params)
        ideal = ideal_step_seconds(row["system"], step_bytes, host_workers, settings.servers, nic,
                                   streams)
        if row["system"] == "bpsctl" and ideal is not None and nic is not None:
            ideal = round_seconds(step_bytes, stream_hosts, server_hosts, nic, shares)
        row["ideal_step_s"] = ideal
        row["nic_fraction"] = None if ideal is None else ideal / row["step_seconds"]
        # each worker's img/sec against one worker's alone: 1.0 is perfect scaling
        row["scaling_efficiency"] = row["img_per_sec_per_worker"] / plain
        if row["system"] in ("ddp", "ddp-powersgd"):
            row["backend"] = settings.backend
    replay: dict[str, Any] = {}
    if settings.replay:
        # the figures in the time of the cluster the replay stands for
        results = [undilate_row(row, dilation) for row in results]
        for row in results:
            # the step model's prediction, in the same time, beside what was measured; a
            # step through servers waits for their rounds too
            round_s = 0.0 if row.get("gradient_path") != "servers" or nic is None else \
                round_latency_s(piece, settings.workers, len(server_hosts), nic * dilation)
            row["model_step_s"] = predicted_step_s(
                profile, row["system"], row["ideal_step_s"], round_s,
                cross_barrier=settings.cross_barrier and row["system"] == "bpsctl")
            row["model_error"] = row["step_seconds"] / row["model_step_s"] - 1
        name, path = resolve(settings.replay)
        busy = replays_busy(profile, dilation)
        replay = {"replay": {
            "profile": name, "file": str(path), "source": profile.source,
            "derived_from": profile.derived_from or None, "device": profile.device,
            "device_name": profile.device_name, "dilation": dilation,
            "profile_step_s": profile.total_s,
            "target_nic_mbit": settings.target_nic_mbit, "emulated_nic_mbit": nic,
            "target_cpu": settings.target_cpu, "host_cpu": config.host_cpu or None,
            "busy": busy,
            "label": replay_label(name, dilation, settings.target_nic_mbit, nic,
                                  settings.target_cpu)
            + (", computing through the recorded gaps as the CPU did" if busy else "")}}
    # per round, both sides measured minutes apart at most: the median of those paired ratios
    ratios = {system: [rows["bpsctl"]["img_per_sec"] / rows[system]["img_per_sec"]
                       for rows in rounds] for system in systems[1:-1]}
    gpus = gpu_keys(settings.gpus) if settings.device == "cuda" else {}
    return {
        "device": settings.device, **gpus,
        **({"baseline_backend": settings.backend, "baseline_backend_why": settings.backend_why}
           if settings.device == "cuda" else {}),
        "kind": "train", "model": settings.model, "workers": settings.workers,
        "workers_per_host": settings.workers_per_host, "servers": settings.servers,
        "batch_size": settings.batch_size, "nic_mbit": nic,
        "image_size": settings.image_size, "num_classes": settings.num_classes,
        "warmup": settings.warmup, "iters": settings.iters,
        "batches_per_iter": settings.batches_per_iter, "rounds": settings.rounds,
        "partition_bytes": config.partition_bytes, "credit_bytes": config.credit_bytes,
        "parameters": sum(params), "gradient_tensors": len(params),
        "gradient_bytes": 4 * sum(params), "host": socket.gethostname(),
        "compression": settings.compression or None, "wire_bytes_per_step": wire,
        "cross_barrier": settings.cross_barrier, "worker_hosts": host_workers,
        "results": results, **_cluster_keys(config), **replay,
        "speedup": {system: statistics.median(values) for system, values in ratios.items()},
        **({"speedup_by_round": ratios} if settings.rounds > 1 else {}),
    }


def run_train_sweep(config: Config, settings: TrainSettings, worker_counts: Sequence[int],
                    servers: int | None, output: IO[str] | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`--sweep workers=1,2,4,...`: a fresh cluster per worker count and a run of every system
    on it (:func:`run_train`); servers = workers unless ``servers`` is given (with colocated
    servers: one on each worker host and ``servers`` CPU hosts); with
    ``settings.workers_per_host`` K, each count is of worker hosts, K workers each. The
    points are `train` reports, the step model's prediction in each row of a replay."""
    points = []
    for n in worker_counts:
        point = dataclasses.replace(settings, workers=n * settings.workers_per_host,
                                    servers=sweep_servers(config, servers, n))
        where = f"{n} worker{'s' if n > 1 else ''}"

        def said(message: str, where: str = where) -> None:
            if progress:
                progress(f"{where}: {message}")
        points.append(run_train(config, point, output, progress=said))
    return {"kind": "train_sweep", "model": settings.model, "nic_mbit": points[0]["nic_mbit"],
            "worker_counts": list(worker_counts), "points": points}


def _pieces(parameters: Sequence[Any], config: Config,
            servers: int) -> Iterator[tuple[int, int, int]]:
    """(its tensor's bytes, its element size, its bytes) of each partition one bpsctl worker
    pushes per step: DistributedOptimizer's buckets of the model's ``parameters`` (torch's,
    or bench.shapes'), cut as the engine cuts them for ``servers`` servers."""
    from ..engine.fusion import buckets
    from ..engine.partition import piece_bytes, split
    params = [p for p in parameters if p.requires_grad]
    names = {p: f"grad.{i}" for i, p in enumerate(params)}
    for bucket in buckets(params, names, config.fusion_bytes, "grad"):
        nbytes = sum(p.numel() * p.element_size() for p in bucket.params)
        itemsize = bucket.params[0].element_size()
        size = piece_bytes(nbytes, servers, config.partition_bytes, config.partition_depth)
        for _, length in split(nbytes, itemsize, size):
            yield nbytes, itemsize, length


def wire_bytes_per_step(parameters: Sequence[Any], config: Config, spec: str,
                        servers: int = 1) -> int:
    """The bytes one bpsctl worker pushes per step (and pulls back) as the compressors state
    them: its partitions (:func:`_pieces`), each compressed unless its tensor is under the
    minimum size."""
    from ..engine.compression import KIND_BF16, KIND_FP16, parse
    compressor = parse(spec) if spec else None
    total = 0
    for nbytes, itemsize, length in _pieces(parameters, config, servers):
        if compressor is None or compressor.kind in (KIND_FP16, KIND_BF16) \
                or nbytes < config.min_compress_bytes:
            # fp16/bf16 are casts in the plugin: half the bytes, no header
            total += length if compressor is None else length // 2
        else:
            total += compressor.wire_bytes(length // itemsize)
    return total


def largest_piece_bytes(parameters: Sequence[Any], config: Config, servers: int) -> int:
    """The largest partition one bpsctl worker pushes (uncompressed): what sets a server
    round's latency (:func:`bpsctl.bench.profile.round_latency_s`)."""
    return max((length for _, _, length in _pieces(parameters, config, servers)), default=0)


def _pooled(system: str, rows: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
    """One system's result over all rounds: every timed iteration pooled, as if one run had
    made them all (a single round's row is returned as it came)."""
    if len(rows) == 1:
        return {"system": system,
                **{key: value for key, value in rows[0].items() if key != "system"}}
    img_secs = [value for row in rows for value in row["img_secs_per_worker"]]
    return {"system": system, "version": rows[0]["version"],
            **throughput(img_secs, rows[0]["workers"], batch_size),
            "img_per_sec_by_round": [row["img_per_sec"] for row in rows],
            "phase_seconds_per_step": {phase: statistics.fmean(row["phase_seconds_per_step"][phase]
                                                               for row in rows)
                                       for phase in rows[0]["phase_seconds_per_step"]},
            **{key: statistics.fmean(row[key] for row in rows)
               for key in ("nic_tx_bytes_per_step", "nic_rx_bytes_per_step")
               if all(row.get(key) is not None for row in rows)},
            **{key: rows[0][key] for key in ("gradient_path", "nic") if key in rows[0]}}


@dataclass(frozen=True)
class ConvergenceSettings:
    """`bench convergence`: the same task, seed and target for every system. Each spec of
    ``compression`` adds a row: the sync system with its gradients compressed so. ``steps``
    (when not 0) makes every row train exactly that many steps, past the target."""

    workers: int = 2
    servers: int = 1
    compare: tuple[str, ...] = ("sync", "backup", "ddp")
    target: float = 0.85
    max_steps: int = 2000
    steps: int = 0
    compression: tuple[str, ...] = ()
    eval_every: int = 5
    batch_size: int = 32
    lr: float = 0.05
    train: int = 4096
    test: int = 1024
    seed: int = 0
    hidden: int = 64                     # the student's hidden units: its gradient's size
    backup_workers: int = 1              # the `backup` system's
    staleness: int = 2                   # the `stale` system's
    timeout_s: float = 900.0             # per system; a hung worker exits after it

    def __post_init__(self) -> None:
        from .convergence import SYSTEMS
        if not self.compare:
            raise ConfigError(f"--compare: expected systems such as sync,backup,ddp; choose "
                              f"from {', '.join(SYSTEMS)}")
        for name in self.compare:
            if name not in SYSTEMS:
                raise ConfigError(f"--compare: {name!r} is not a system of bench convergence; "
                                  f"choose from {', '.join(SYSTEMS)}")
        if not 0 < self.target <= 1:
            raise ConfigError(f"--target: expected an accuracy above 0 and at most 1, got "
                              f"{self.target!r}")
        if "backup" in self.compare and not 1 <= self.backup_workers < self.workers:
            raise ConfigError(f"--backup-workers / BPSCTL_BACKUP_WORKERS: the backup system "
                              f"needs 1..{self.workers - 1} backup workers of {self.workers} "
                              f"workers, got {self.backup_workers}"
                              + ("; give --workers 2 or more" if self.workers < 2 else ""))
        if "stale" in self.compare and self.staleness < 1:
            raise ConfigError(f"--staleness / BPSCTL_STALENESS: the stale system needs 1 or "
                              f"more steps of staleness, got {self.staleness}")
        if self.steps < 0:
            raise ConfigError(f"--steps: expected 1 or more steps (or none: train to --target), "
                              f"got {self.steps}")
        self.compressions()

    def compressions(self) -> list[str]:
        """The ``compression`` specs as :func:`~bpsctl.engine.compression.spec_of` writes
        them (``topk:0.010`` is ``topk:0.01``); ConfigError for a bad, repeated or ``none``
        one, naming it."""
        from ..engine.compression import parse, spec_of
        specs: list[str] = []
        for text in self.compression:
            try:
                spec = spec_of(parse(text))
            except ValueError as exc:
                raise ConfigError(f"--compression: {exc}") from None
            if spec == "none":
                raise ConfigError("--compression: none is the uncompressed sync row; give "
                                  "compressors such as onebit,onebit:noef (add sync to "
                                  "--compare for the uncompressed row)")
            if spec in specs:
                raise ConfigError(f"--compression: {text!r} is given twice (as {spec}); give "
                                  "each compressor once")
            specs.append(spec)
        return specs


def run_convergence(config: Config, settings: ConvergenceSettings,
                    output: IO[str] | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Each system of ``settings.compare``, then sync with each compressor of
    ``settings.compression``, trains the teacher-labelled task on one cluster, one after
    another, to the target accuracy (or for exactly ``settings.steps``); steps, seconds and
    the accuracy curve each. The compressed rows' workers compress every tensor
    (BPSCTL_MIN_COMPRESS_BYTES=0: the student's are far below the default minimum) and push
    on their own (BPSCTL_LOCAL_REDUCE=off), and each row says the bytes one worker pushes per
    step as the compressor states them."""
    from .convergence import SYSTEMS, student
    output = output if output is not None else sys.stderr
    progress = progress or (lambda message: None)
    compressions = settings.compressions()
    rows = [(name, "") for name in settings.compare] + [("sync", spec) for spec in compressions]
    args = ["--target", str(settings.target), "--max-steps", str(settings.max_steps),
            "--steps", str(settings.steps),
            "--eval-every", str(settings.eval_every), "--batch-size", str(settings.batch_size),
            "--lr", str(settings.lr), "--train", str(settings.train),
            "--test", str(settings.test), "--seed", str(settings.seed),
            "--hidden", str(settings.hidden), "--timeout", str(settings.timeout_s)]
    results = []
    # the student as the workers build it (features 16, classes 4: their defaults), for the
    # bytes each step pushes
    parameters = list(student(16, 4, settings.hidden).parameters()) if compressions else []
    gradient_bytes = None
    with bench_cluster(config, settings.workers, settings.servers) as (cluster_config, nic):
        if compressions:
            gradient_bytes = wire_bytes_per_step(parameters, cluster_config, "")
        for name, spec in rows:
            progress(f"{name}+{spec}: {SYSTEMS[name].description}, {spec} compression" if spec
                     else f"{name}: {SYSTEMS[name].description}")
            # the backup system is bpsctl with backup workers, the stale one with staleness, the
            # async one asynchronous; every other runs without
            engine = SYSTEMS[name].engine == "bpsctl"       # --trace is bpsctl's timeline only
            system_config = cluster_config.replace(
                trace_dir=cluster_config.trace_dir if engine else "",
                backup_workers=settings.backup_workers if name == "backup" else 0,
                staleness=settings.staleness if name == "stale" else 0,
                async_mode=name == "async")
            if spec:
                # every tensor compressed, and every worker's gradient through the compressor:
                # the intra-node stage would sum a host's workers first at full precision, and
                # with every worker on one host it skips the servers (and the compression);
                # one worker alone would push nothing at all
                system_config = system_config.replace(min_compress_bytes=0, local_reduce="off",
                                                      force_distributed=True)
            row = _run_workers(system_config, "bpsctl.bench.convergence",
                               ["--system", name, "--compression", spec, *args],
                               settings.workers, settings.servers, output)
            if spec:
                row.update(compression=spec, min_compress_bytes=0, local_reduce="off",
                           wire_bytes_per_step=wire_bytes_per_step(parameters, system_config, spec))
            results.append(row)
    return {
        "kind": "convergence", "workers": settings.workers, "servers": settings.servers,
        "nic_mbit": nic, "target_accuracy": settings.target, "max_steps": settings.max_steps,
        "steps": settings.steps or None, "compression": compressions,
        "gradient_bytes_per_step": gradient_bytes,
        "backup_workers": settings.backup_workers if "backup" in settings.compare else 0,
        "staleness": settings.staleness if "stale" in settings.compare else 0,
        "task": {"name": "teacher-student", "seed": settings.seed, "train": settings.train,
                 "test": settings.test, "batch_size": settings.batch_size, "lr": settings.lr,
                 "hidden": settings.hidden},
        "host": socket.gethostname(), "results": results, **_cluster_keys(config),
        "all_reached": all(row["reached"] for row in results),
    }
