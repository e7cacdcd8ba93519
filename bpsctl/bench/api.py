"""Benchmarks as functions: what `bpsctl bench` runs, and what tests call directly.

Every figure of one report comes from one run on one cluster: bpsctl's push_pull, the
baselines (`--compare`) and the raw ZeroMQ limit are measured side by side, with the same
bytes, hosts, warm-up and repeats.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from .. import __version__, launch
from ..config import SECURITY_MODES, Config, ConfigError
from ..engine.paths import solo_job
from ..errors import BpsctlError
from ..launch.local import host_command
from ..model import GOODPUT_SHARE as GOODPUT_SHARE  # (where bench and its tests find it)
from ..model import goodput_bytes_s, job_shares, round_seconds
from .comm import zmq_pair_seconds
from .common import RESULT_MARKER
from .gpu import HostGPUs, gpu_keys, last_json, probe_code, probe_here
from .train import throughput

COMM_BASELINES = ("allreduce",)
#: interleaved passes over the security modes when `bench comm --security` compares several
SECURITY_PASSES = 3


class BenchError(BpsctlError, RuntimeError):
    """A benchmark could not produce its figures; the message says why."""


@dataclass(frozen=True)
class CommSettings:
    workers: int = 2
    servers: int = 2
    sizes: tuple[int, ...] = (64 * 1024 * 1024,)
    tensors: int = 8
    warmup: int = 3
    repeats: int = 10
    raw: bool = True                     # also measure raw ZeroMQ (embedded default only)
    compare: tuple[str, ...] = field(default=())
    # security modes measured side by side, each on a private cluster of its own (empty: the
    # config's mode only)
    security: tuple[str, ...] = field(default=())
    #: workers on each emulated worker host (``workers`` counts every process: hosts times this)
    workers_per_host: int = 1
    device: str = "cpu"                  # cuda: CUDA tensors, copies to and from the GPU timed
    gpu_by: str = "local_rank"           # as TrainSettings.gpu_by
    backend: str = "gloo"                # the allreduce baseline's
    backend_why: str = ""
    gpus: tuple[Any, ...] = ()           # bench.gpu.HostGPUs of the worker hosts (on CUDA)

    def __post_init__(self) -> None:
        check_per_host_split(self.workers, self.workers_per_host)
        wrong = [m for m in self.security if m not in SECURITY_MODES]
        if wrong or len(set(self.security)) != len(self.security):
            raise ConfigError(f"--security: expected distinct modes among "
                              f"{', '.join(SECURITY_MODES)}, got {','.join(self.security)}")
        unknown = [c for c in self.compare if c not in COMM_BASELINES]
        if unknown:
            raise ConfigError(f"--compare: {', '.join(unknown)} is not a baseline of bench comm; "
                              f"choose from {', '.join(COMM_BASELINES)} (horovod and ddp are "
                              "baselines of the training benchmarks)")
        if "allreduce" in self.compare:
            try:
                import torch.distributed  # noqa: F401
            except ImportError:
                raise ConfigError("--compare allreduce needs torch: pip install torch==2.13.0 (the "
                                  "CPU build; a plain `pip install torch` pulls CUDA)") from None


def ideal_seconds(system: str, size_bytes: int, host_workers: Sequence[int], servers: int,
                  nic_mbit: float) -> float:
    """The NIC-bound time of one round of `bench comm` (docs/design.md §7), ``host_workers``
    the workers on each worker host: a parameter server moves S out and S in per worker
    through its host's NIC (comm's workers push on their own: no intra-node stage), and n·S/K
    through each server's; ring allreduce moves 2(N-1)/N · S each way through each of the N
    worker hosts' NICs, the least any allreduce moves between hosts. The busier NIC sets the
    time."""
    hosts = len(host_workers)
    if system == "allreduce":
        return 2 * (hosts - 1) / hosts * size_bytes / goodput_bytes_s(nic_mbit)
    busiest_bytes = max(max(host_workers) * size_bytes, sum(host_workers) * size_bytes / servers)
    return busiest_bytes / goodput_bytes_s(nic_mbit)


#: the training baselines whose gradients go through a plain allreduce (gloo); PowerSGD's
#: low-rank factors have no NIC-bound ideal here
RING_SYSTEMS = ("horovod", "ddp")
def ideal_step_seconds(system: str, step_bytes: int, host_workers: Sequence[int], servers: int,
                       nic_mbit: float | None, streams: Sequence[int] | None = None
                       ) -> float | None:
    """The NIC-bound time of one training step (docs/design.md §7), or None when no NIC rate
    is known or nothing of the system's crosses a NIC.

    ``step_bytes`` is what one worker pushes per step (bpsctl: the compressed wire bytes; the
    baselines: the gradient bytes); ``host_workers`` the workers on each worker host. bpsctl:
    each worker host's NIC carries ``step_bytes`` each way ``streams[h]`` times (default once
    per host: the intra-node stage reduces first; see :func:`host_streams`), each server's NIC
    its share of all of them, and the busier NIC sets the time. Ring allreduce (DDP, Horovod):
    ``2(n-1)/n · step_bytes`` per NIC each way, n the worker hosts: the least any allreduce
    moves between hosts. Full duplex: both directions at once."""
    hosts = len(host_workers)
    if nic_mbit is None or hosts == 0:
        return None
    if system in RING_SYSTEMS:
        return ideal_seconds("allreduce", step_bytes, host_workers, servers, nic_mbit) \
            if hosts > 1 else None
    streams = [1] * hosts if streams is None else list(streams)
    if system != "bpsctl" or not any(streams):
        return None
    busiest_bytes = max(max(streams) * step_bytes, sum(streams) * step_bytes / servers)
    return busiest_bytes / goodput_bytes_s(nic_mbit)


def host_streams(config: Config, host_workers: Sequence[int]) -> list[int]:
    """How many times each worker host's NIC carries a worker's gradient per step in bpsctl,
    by the conditions of engine/torch's intra-node stage: once when the host's workers
    reduce-scatter first, once per worker when they do not (a single worker, BPSCTL_LOCAL_REDUCE
    off, a host whose workers do not divide the job's, elastic or asynchronous training), and
    not at all when the stage finishes each step in shared memory (the job's one host) or
    the job is one worker's (nothing to sum: engine/paths.py's solo_job)."""
    workers = sum(host_workers)
    if workers == 1 and solo_job(config, 1, joined_running=False):
        return [0] * len(host_workers)
    elastic = (0 < config.min_workers < workers or config.max_workers > workers
               or config.backup_workers > 0 or config.staleness > 0 or config.async_mode)
    streams = []
    for count in host_workers:
        if count == 1 or config.local_reduce != "auto" or workers % count or elastic:
            streams.append(count)
        elif len(host_workers) == 1 and config.local_only != "off" and config.local_shm:
            streams.append(0)
        else:
            streams.append(1)
    return streams


def ssh_cluster(state_dir: Path | str) -> launch.ClusterState | None:
    """The SSH cluster `bpsctl up --hosts` recorded in ``state_dir``, or None."""
    cluster = launch.load_state(state_dir)
    return cluster if cluster is not None and cluster.kind == "ssh" else None


def hosts_cluster(state_dir: Path | str) -> launch.ClusterState | None:
    """The cluster of fixed hosts recorded in ``state_dir``: `bpsctl up --hosts` (SSH) or
    `bpsctl up --slurm` (the nodes of a Slurm allocation), or None. A benchmark on it runs
    one worker per slot (per Slurm task), and its figures are those machines', not this
    one's."""
    cluster = launch.load_state(state_dir)
    return cluster if cluster is not None and cluster.kind in ("ssh", "slurm") else None


def _up_again(cluster: launch.ClusterState) -> str:
    return "bpsctl up --slurm" if cluster.kind == "slurm" else "bpsctl up --hosts"


def _refuse_live(config: Config, flags: tuple[str, ...]) -> None:
    for flag in flags:
        if flag:
            raise ConfigError(f"{flag}: a cluster is already up in {config.state_dir}; bench "
                              f"uses it as it is (drop {flag}), or run `bpsctl down` first")


def check_per_host_split(workers: int, workers_per_host: int) -> None:
    """A ConfigError unless ``workers`` processes split into whole hosts of
    ``workers_per_host`` (at least 1) each."""
    if workers_per_host < 1:
        raise ConfigError(f"--workers-per-host: expected at least 1 worker per host, got "
                          f"{workers_per_host}")
    if workers % workers_per_host:
        raise ConfigError(f"--workers-per-host: {workers} workers do not fill hosts of "
                          f"{workers_per_host}; give a multiple of {workers_per_host}")


def check_workers_per_host(config: Config, workers_per_host: int) -> None:
    """A ConfigError, saying what to do instead, for ``--workers-per-host`` where bench does
    not build the worker hosts itself: anything but a private emulated cluster (--emulate)."""
    if workers_per_host < 1:
        check_per_host_split(1, workers_per_host)
    if workers_per_host == 1:
        return
    flag = f"--workers-per-host {workers_per_host}"
    cluster = hosts_cluster(config.state_dir)
    if cluster is not None:
        if cluster.kind == "slurm":
            where, change = "Slurm", ("tasks per node of the allocation (salloc/sbatch "
                                      "--ntasks-per-node), then `bpsctl up --slurm` again")
        else:
            where, change = "SSH", ("slots of each worker host in the hosts file (slots: N), "
                                    "then `bpsctl up --hosts` again")
        unit = "task" if cluster.kind == "slurm" else "slot"
        raise ConfigError(f"{flag}: the {where} cluster up in {config.state_dir} runs one worker "
                          f"per {unit}; drop {flag} and change the {change}")
    live = launch.load_state(config.state_dir)
    if live is not None and live.emulation is not None \
            and launch.status(config.state_dir)["scheduler_error"] is None:
        raise ConfigError(f"{flag}: an emulated cluster is already up in {config.state_dir}, "
                          "and bench spreads --workers over its worker hosts in contiguous "
                          f"blocks; drop {flag} and give --workers as hosts x {workers_per_host}")
    if not config.emulate:
        raise ConfigError(f"{flag}: only with --emulate, which builds the worker hosts; on this "
                          "machine every worker already shares one host: drop "
                          f"{flag} and give --workers as the number of worker processes")


def cluster_size(config: Config, workers: int | None, servers: int | None,
                 own_cluster_for: str = "", workers_per_host: int = 1) -> tuple[int, int]:
    """(workers, servers) a benchmark runs with. On an SSH or Slurm cluster: one worker per
    slot of its hosts file or task of its allocation (a different --workers is refused) and
    its servers (--servers may use fewer). Otherwise the flags', by default 2 workers and
    num_servers of the config or as many servers as workers (on a live emulated cluster, one
    worker per worker host and its servers). With --emulate and
    ``workers_per_host`` K, ``workers`` counts worker hosts (by default 2, and as many servers):
    the workers returned are hosts x K (:func:`check_workers_per_host` says where K may be
    more than 1). With --emulate --colocated-servers, ``servers`` counts CPU hosts (by
    default 0) and the servers returned are those and one per worker host: every server the
    private cluster runs (:func:`bench_cluster` builds it so)."""
    check_workers_per_host(config, workers_per_host)
    if config.colocated_servers and not config.emulate:
        if launch.load_state(config.state_dir) is not None:
            _refuse_live(config, ("--colocated-servers",))
        raise ConfigError("--colocated-servers / BPSCTL_COLOCATED_SERVERS: puts a server on each "
                          "worker host of the emulated cluster bench builds; add --emulate")
    if servers == 0 and not config.colocated_servers:
        raise ConfigError("--servers: expected at least 1 (0 only with --emulate "
                          "--colocated-servers: the worker hosts' own servers)")
    cluster = hosts_cluster(config.state_dir)
    if cluster is None:
        live = launch.load_state(config.state_dir)
        if live is not None and live.emulation and not config.emulate:
            # a live emulated cluster: by default one worker per worker host it was built with
            # and every server it runs but its spares (the scheduler says which are spare)
            rows = launch.status(config.state_dir)["processes"]
            live_servers = sum(1 for row in rows
                               if row["role"] == "server" and row["state"] == "running") or 1
            hosts = workers or len(live.emulation["workers"])
            return hosts, servers or min(config.num_servers or live_servers, live_servers)
        hosts = workers or 2
        if config.colocated_servers:
            return hosts * workers_per_host, (servers or 0) + hosts
        return hosts * workers_per_host, servers or config.num_servers or hosts
    _refuse_live(config, ("--emulate" if config.emulate else "", own_cluster_for))
    assert cluster.hosts is not None
    slots = cluster.hosts.world_size
    total = sum(entry.count for entry in cluster.hosts.servers)
    if cluster.kind == "slurm":
        where = f"the Slurm cluster up in {config.state_dir} ({cluster.hosts.source})"
        change = ("allocate as many tasks (salloc/sbatch --ntasks-per-node) and "
                  "`bpsctl up --slurm` again")
    else:
        where = f"the SSH cluster up in {config.state_dir} (hosts file {cluster.hosts.source})"
        change = "change the slots in the hosts file and `bpsctl up --hosts` again"
    if workers is not None and workers != slots:
        raise ConfigError(f"--workers: {where} has {slots} worker slots, and bench runs one "
                          f"worker per slot: drop --workers (or give --workers {slots}), or "
                          f"{change}")
    if servers is not None and servers > total:
        raise ConfigError(f"--servers: {where} has {total} servers; give at most {total}")
    return slots, servers or min(config.num_servers or total, total)


@contextlib.contextmanager
def bench_cluster(config: Config, workers: int | None, servers: int | None,
                  own_cluster_for: str = "", workers_per_host: int = 1
                  ) -> Iterator[tuple[Config, float | None]]:
    """The cluster to measure on: the one `bpsctl up` started (local, emulated, over SSH or in
    a Slurm allocation), or a private one (emulated with ``config.emulate``: ``workers`` /
    ``workers_per_host`` worker hosts, so that the ``workers`` a job runs on it go
    ``workers_per_host`` to each host). Yields a config whose state dir names it, and the NIC
    rate (an SSH or Slurm cluster's is unknown: ``--nic`` if given, else None).
    ``own_cluster_for`` names a flag that needs a private cluster (a live one is an error).
    ``servers`` is what the job uses: with --colocated-servers, the worker hosts' own
    servers and the CPU hosts' (default: none of those)."""
    hosts = None                # cluster_size counts emulated worker hosts, as --workers does
    if workers is not None:
        check_per_host_split(workers, workers_per_host)
        hosts = workers // workers_per_host
    total = servers
    workers, servers = cluster_size(config, hosts, None if config.colocated_servers else servers,
                                    own_cluster_for, workers_per_host)
    servers = total if config.colocated_servers and total is not None else servers
    fixed = hosts_cluster(config.state_dir)
    if fixed is not None:
        problem = launch.status(config.state_dir)["scheduler_error"]
        if problem is not None:
            kind = "Slurm" if fixed.kind == "slurm" else "SSH"
            raise BenchError(f"the {kind} cluster recorded in {config.state_dir} is not healthy "
                             f"({problem}); `bpsctl down`, then `{_up_again(fixed)}` again")
        yield config, config.nic_mbit
        return
    live = launch.load_state(config.state_dir)
    if live is not None and launch.status(config.state_dir)["scheduler_error"] is None:
        _refuse_live(config, ("--emulate" if config.emulate else "", own_cluster_for,
                              "--colocated-servers" if config.colocated_servers else ""))
        nic = live.emulation["nic_mbit"] if live.emulation else None
        yield config, nic
        return
    hosts = hosts or workers // workers_per_host
    if config.colocated_servers:
        servers -= hosts            # the CPU hosts: each worker host runs a server besides
        if servers < 0:
            raise ConfigError(f"--servers: {servers + hosts} servers cannot put one on each of "
                              f"{hosts} worker hosts (--colocated-servers)")
    with launch.local_cluster(config, servers=servers, workers=hosts) as cluster:
        nic = config.nic_mbit if config.emulate else None
        yield config.replace(state_dir=Path(cluster.state_dir)), nic


class _ResultCatcher(io.TextIOBase):
    """Worker output on its way to ``output``, less the :data:`RESULT_MARKER` lines: those are
    records for bench itself, kept (rank 0's is :attr:`result`) and never forwarded.

    The relays write whole lines, each prefixed with its ``[rank] `` or ``[host:rank] ``; text
    is still split into lines here (several threads write, so under a lock), so that a line
    cut over two writes is read whole."""

    _RANK = re.compile(r"\[(?:[^\]]*:)?(\d+)\] $")   # "[1] " or "[10.0.0.2:1] " before the marker

    def __init__(self, output: IO[str]):
        super().__init__()
        self.output = output
        self.results: dict[int, dict[str, Any]] = {}
        self._partial = ""
        self._lock = threading.Lock()

    @property
    def result(self) -> dict[str, Any] | None:
        """Rank 0's record (a marker line without a rank prefix counts as rank 0's)."""
        with self._lock:
            if self._partial:                       # a last line without its newline
                self._line(self._partial)
                self._partial = ""
        return self.results.get(0)

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self._line(line + "\n")
        return len(text)

    def _line(self, line: str) -> None:
        prefix, marker, data = line.partition(RESULT_MARKER)
        rank = self._RANK.search(prefix)
        if marker and (rank or not prefix):
            try:
                self.results[int(rank.group(1)) if rank else 0] = json.loads(data)
                return
            except ValueError:
                pass                                # not a record after all: the user sees it
        self.output.write(line)

    def flush(self) -> None:
        self.output.flush()


def _run_workers(config: Config, module: str, args: list[str], workers: int, servers: int,
                 output: IO[str]) -> dict[str, Any]:
    """``python -m module args`` as every worker of the cluster named by ``config`` (over SSH
    with the hosts file's ``python:``, as Slurm job steps with the python that started the
    cluster); rank 0's result, read from the relayed output."""
    catcher = _ResultCatcher(output)
    stream = cast(IO[str], catcher)     # a text stream: the relays only write and flush
    job_config = config.replace(num_servers=servers)
    cluster = hosts_cluster(config.state_dir)
    python = cluster.hosts.python if cluster is not None and cluster.hosts else sys.executable
    result = launch.run([python, "-m", module, *args], job_config, workers=workers,
                        servers=servers, stdout=stream, stderr=stream)
    if result.exit_code != 0:
        detail = ""
        if result.failures:
            failure = result.failures[0]
            where = f" on {failure.host}" if failure.host else ""
            detail = f": worker {failure.rank}{where} exited {failure.exit_code}: " + \
                " | ".join(failure.last_lines[-3:])
        kept = _keep_logs(config.state_dir) if cluster is None else None
        where_logs = f"; the scheduler's and servers' logs at that moment: {kept}" if kept else ""
        raise BenchError(f"{module}'s workers failed{detail}{where_logs}")
    if catcher.result is None:
        raise BenchError(f"{module}'s workers exited 0, but rank 0 printed no "
                         f"{RESULT_MARKER.strip()} line (its output is above)")
    return catcher.result


def _keep_logs(state_dir: Path | str) -> Path | None:
    """A copy of the cluster's own logs as they are now, or None if it has none. A private
    cluster's state dir goes away with it, and a lost server's or the scheduler's log is
    where the reason is (the workers only see that it went quiet)."""
    logs = Path(state_dir) / "logs"
    if not logs.is_dir():
        return None
    try:
        kept = Path(tempfile.mkdtemp(prefix="bpsctl-bench-logs-"))
        shutil.copytree(logs, kept, dirs_exist_ok=True)
    except OSError:
        return None             # the failure itself is what the error must report
    return kept


def _row(system: str, version: str, seconds: list[float], size: int, host_workers: list[int],
         servers: int, nic_mbit: float | None, ideal: float | None = None) -> dict[str, Any]:
    """A result row; its ``nic_fraction`` is ``ideal`` (default :func:`ideal_seconds`) over
    the median."""
    median = statistics.median(seconds)
    algbw = size / median / 1e6
    workers = sum(host_workers)
    bus_factor = 2 * (workers - 1) / workers if workers > 1 else 1.0     # nccl-tests' allreduce
    fraction = None
    if nic_mbit is not None:
        if ideal is None:
            ideal = ideal_seconds(system, size, host_workers, servers, nic_mbit)
        fraction = ideal / median
    return {"system": system, "version": version, "seconds": median, "seconds_all": seconds,
            "algbw_MBps": algbw, "busbw_MBps": algbw * bus_factor, "nic_fraction": fraction}


def _cluster_keys(config: Config) -> dict[str, Any]:
    """Report keys naming an SSH cluster's hosts file or a Slurm cluster's job and nodes (the
    figures are not this machine's), or an emulated cluster's slow hosts (--straggler)."""
    cluster = hosts_cluster(config.state_dir)
    if cluster and cluster.kind == "slurm" and cluster.slurm:
        return {"cluster": "slurm", "slurm_job": str(cluster.slurm["job_id"]),
                "nodes": list(cluster.slurm["nodes"])}
    if cluster and cluster.hosts:
        return {"cluster": "ssh", "hosts_file": cluster.hosts.source}
    if config.emulate and (config.stragglers or config.cpu_stragglers):
        return {"stragglers": {str(rank): factor for rank, factor in config.stragglers.items()},
                "cpu_stragglers": {str(rank): factor
                                   for rank, factor in config.cpu_stragglers.items()}}
    return {}


def _job_servers(config: Config, workers: int, servers: int
                 ) -> tuple[list[str], list[str], list[bool], list[float]]:
    """(each worker's host, each of the job's servers' host, whether it sits on a worker host,
    its share of the bytes) for a job of ``workers`` workers and ``servers`` servers on the
    cluster named by ``config``, as the scheduler places it (bpsctl/model.py's job_shares:
    BPSCTL_CPU_SHARE, else the servers' registered shares, else evenly)."""
    cluster = launch.load_state(config.state_dir)
    if cluster is None:
        raise BenchError(f"no cluster recorded in {config.state_dir}")
    streams = [slot.address for slot in launch.worker_slots(cluster, workers)]
    rows = sorted((row for row in launch.status(config.state_dir)["processes"]
                   if row["role"] == "server" and row["state"] == "running"),
                  key=lambda row: row["rank"])[:servers]
    server_hosts = [row["host"] for row in rows]
    colocated = [host in streams for host in server_hosts]
    shares = job_shares([row.get("share") for row in rows], colocated, config.cpu_share_value)
    return streams, server_hosts, colocated, shares


def job_layout(config: Config, workers: int, servers: int, size: int,
               nic_mbit: float | None) -> dict[str, Any]:
    """The layout a job of ``workers`` workers and ``servers`` servers uses on the cluster named
    by ``config`` (:func:`_job_servers`), with the modelled round of ``size`` bytes per worker
    at ``nic_mbit`` (docs/design.md §7; null without a rate) for it and for the two pure layouts
    of the same hosts: servers on the worker hosts only, and on the CPU hosts only (null
    without CPU hosts). Each worker is a stream of its own (comm's workers push on their own);
    a server on a worker host is colocated."""
    streams, server_hosts, colocated, shares = _job_servers(config, workers, servers)
    hosts = list(dict.fromkeys(streams))
    cpu_hosts = list(dict.fromkeys(h for h, on_worker in zip(server_hosts, colocated,
                                                             strict=True) if not on_worker))

    def model(on: list[str], weights: list[float] | None = None) -> float | None:
        if nic_mbit is None or not on:
            return None
        return round_seconds(size, streams, on, nic_mbit, weights)

    return {"worker_hosts": len(hosts), "cpu_hosts": len(cpu_hosts), "shares": shares,
            "server_hosts": server_hosts, "colocated": colocated,
            "model_seconds": model(server_hosts, shares),
            "colocated_only_seconds": model(hosts), "cpu_hosts_only_seconds": model(cpu_hosts)}


def comm_point(config: Config, settings: CommSettings, size: int, nic_mbit: float | None,
               output: IO[str]) -> dict[str, Any]:
    """One size on the cluster named by ``config``: bpsctl, then each baseline, then raw ZeroMQ.
    bpsctl's ideal is the modelled round of the layout it ran on (:func:`job_layout`)."""
    n, k = settings.workers, settings.servers
    host_workers = worker_hosts(config, n)
    common = ["--size", str(size), "--warmup", str(settings.warmup),
              "--repeats", str(settings.repeats)]
    if settings.device == "cuda":
        common += ["--device", "cuda", "--gpu-by", settings.gpu_by]
    # the point is to measure the path: one worker pushes through the servers too
    ours = _run_workers(config.replace(force_distributed=True), "bpsctl.bench.comm",
                        [*common, "--tensors", str(settings.tensors)], n, k, output)
    size = ours["size_bytes"]
    layout = job_layout(config, n, k, size, nic_mbit)
    row = _row("bpsctl", __version__, ours["seconds"], size, host_workers, k, nic_mbit,
               layout["model_seconds"])
    row["push_pulls_per_s"] = ours["tensors"] / row["seconds"]
    if layout["model_seconds"]:
        layout["measured_over_model"] = row["seconds"] / layout["model_seconds"]
    row.update({key: ours[key] for key in ("gradient_path", "shm_share", "direct_share")
                if key in ours})
    results = [row]
    speedup: dict[str, float] = {}
    if "allreduce" in settings.compare:
        theirs = _run_workers(config.replace(trace_dir=""), "bpsctl.bench.allreduce",
                              [*common, "--backend", settings.backend], n, k, output)
        results.append(_row("allreduce", theirs["version"], theirs["seconds"], size,
                            host_workers, k, nic_mbit))
        speedup["allreduce"] = results[-1]["seconds"] / row["seconds"]
    report: dict[str, Any] = {
        "kind": "comm", "workers": n, "servers": k, "nic_mbit": nic_mbit, "size_bytes": size,
        "workers_per_host": settings.workers_per_host, "worker_hosts": host_workers,
        "tensors": ours["tensors"], "partition_bytes": config.partition_bytes,
        "credit_bytes": config.credit_bytes, "warmup": settings.warmup,
        "repeats": settings.repeats, "host": socket.gethostname(), "results": results,
        "speedup": speedup, "layout": layout, **_cluster_keys(config), "device": settings.device,
        **(gpu_keys(settings.gpus) if settings.device == "cuda" else {}),
    }
    if n > 1 and (max(host_workers) == 1 or len(host_workers) == 1):
        # one worker per host: ring allreduce moves 2(n-1)/n·S through every NIC, the layout
        # what the model says (S with enough dedicated servers; on loopback, what that would
        # be). With several per host on several hosts, comm's workers push on their own (k·S
        # per host NIC) while a ring of contiguous blocks crosses each NIC once: no one-number
        # theory then
        report["theory_speedup"] = 2 * (n - 1) / n
        if layout["model_seconds"] and len(host_workers) > 1:
            report["theory_speedup"] = ideal_seconds("allreduce", size, host_workers, k,
                                                     nic_mbit or 0) / layout["model_seconds"]
    if settings.raw and nic_mbit is None and hosts_cluster(config.state_dir) is None \
            and settings.device == "cpu":
        raw_seconds = zmq_pair_seconds(size, min(config.partition_bytes, size),
                                       repeats=max(5, settings.repeats))
        import zmq
        raw = _row("zmq_raw", f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}",
                   raw_seconds, size, [1, 1], 1, None)
        raw["busbw_MBps"] = raw["algbw_MBps"]
        raw["what"] = ("one-way PUSH->PULL of the same bytes in partition-sized zero-copy frames, "
                       "between two processes over loopback TCP: this machine's ZeroMQ limit")
        results.append(raw)
        report["fraction_of_raw"] = row["algbw_MBps"] / raw["algbw_MBps"]
    return report


def run_comm(config: Config, settings: CommSettings, output: IO[str] | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The comm benchmark on one cluster. One size gives the JSON of docs/design.md
    (``kind: comm``); several give ``{"kind": "comm", "sizes": [that, ...]}``."""
    output = output if output is not None else sys.stderr
    progress = progress or (lambda message: None)
    modes = settings.security or (config.security,)
    # several modes: each on a cluster of its own, all up at once, measured in interleaved
    # passes so that a burst of load on this machine does not fall on one mode only
    passes = min(SECURITY_PASSES, settings.repeats) if len(modes) > 1 else 1
    per_pass = -(-settings.repeats // passes)           # rounds of each mode in each pass
    with contextlib.ExitStack() as stack:
        clusters = [stack.enter_context(bench_cluster(
            config.replace(security=mode), settings.workers, settings.servers,
            "--security" if settings.security else "", settings.workers_per_host))
            for mode in modes]
        reports = []
        for size in settings.sizes:
            points: list[list[dict[str, Any]]] = [[] for _ in modes]
            for done in range(passes):
                for index, (mode, (cluster_config, nic)) in enumerate(
                        zip(modes, clusters, strict=True)):
                    progress(f"{size} bytes" + (f", security {mode}, pass {done + 1} of "
                                                f"{passes}" if settings.security else ""))
                    # the baselines and raw ZeroMQ do not depend on the mode: measured once,
                    # with all the repeats asked for
                    first = index == 0 and done == 0
                    pass_settings = dataclasses.replace(
                        settings, repeats=settings.repeats if first else per_pass,
                        warmup=settings.warmup if done == 0 else 1,
                        compare=settings.compare if first else (), raw=settings.raw and first)
                    points[index].append(comm_point(cluster_config, pass_settings, size, nic,
                                                    output))
            reports.append(_with_security_modes(points, modes, per_pass))
    if len(reports) == 1:
        return reports[0]
    return {"kind": "comm", "workers": settings.workers, "servers": settings.servers,
            "workers_per_host": settings.workers_per_host,
            "nic_mbit": reports[0]["nic_mbit"], "sizes": reports}


def _with_security_modes(points: list[list[dict[str, Any]]], modes: tuple[str, ...],
                         per_pass: int) -> dict[str, Any]:
    """One size's report from each mode's passes: a bpsctl row per security mode (the median
    of its last ``per_pass`` rounds of each pass), and each mode's time over the reference's
    (``none`` if measured, else the first mode) as ``security_cost``."""
    report = points[0][0]
    k, size, nic = report["servers"], report["size_bytes"], report["nic_mbit"]
    rows = []
    for mode, passes in zip(modes, points, strict=True):
        seconds = [s for point in passes for s in point["results"][0]["seconds_all"][-per_pass:]]
        row = _row("bpsctl", __version__, seconds, size, report["worker_hosts"], k, nic,
                   report["layout"]["model_seconds"])
        row["push_pulls_per_s"] = report["tensors"] / row["seconds"]
        rows.append(dict(row, security=mode))
    report["results"] = [rows[0], *rows[1:], *report["results"][1:]]
    report["repeats"] = len(rows[0]["seconds_all"])
    if report["layout"]["model_seconds"]:
        report["layout"]["measured_over_model"] = (rows[0]["seconds"]
                                                   / report["layout"]["model_seconds"])
    if len(modes) > 1:
        reference = rows[modes.index("none") if "none" in modes else 0]["seconds"]
        report["security_cost"] = {row["security"]: row["seconds"] / reference for row in rows}
        report["security_passes"] = len(points[0])
    if "fraction_of_raw" in report:
        raw = next(r for r in report["results"] if r["system"] == "zmq_raw")
        report["fraction_of_raw"] = rows[0]["algbw_MBps"] / raw["algbw_MBps"]
    if "allreduce" in report["speedup"]:
        theirs = next(r for r in report["results"] if r["system"] == "allreduce")
        report["speedup"]["allreduce"] = theirs["seconds"] / rows[0]["seconds"]
    return report


def run_sweep(config: Config, settings: CommSettings, worker_counts: list[int],
              servers: int | None, output: IO[str] | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`--sweep workers=2,4,...`: a fresh cluster per worker count (servers = workers unless
    given; with ``settings.workers_per_host`` K, each count is of worker hosts, K workers
    each), bpsctl against allreduce at each, and the theory 2(n-1)/n beside it."""
    points = []
    for n in worker_counts:
        total = (servers or 0) + n if config.colocated_servers else servers or n
        point_settings = CommSettings(workers=n * settings.workers_per_host,
                                      servers=total, sizes=settings.sizes[:1],
                                      tensors=settings.tensors, warmup=settings.warmup,
                                      repeats=settings.repeats, raw=False,
                                      compare=tuple(sorted({*settings.compare, "allreduce"})),
                                      workers_per_host=settings.workers_per_host)
        if progress:
            progress(f"{n} workers")
        points.append(run_comm(config, point_settings, output))
    return {"kind": "comm_sweep", "nic_mbit": points[0]["nic_mbit"],
            "size_bytes": points[0]["size_bytes"], "points": points}


# --------------------------------------------------------------------------- training

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

    def __post_init__(self) -> None:
        from ..engine.compression import parse
        check_per_host_split(self.workers, self.workers_per_host)
        from .models import MODELS
        if self.model not in MODELS:
            raise ConfigError(f"model: expected one of {', '.join(MODELS)}, got {self.model!r}")
        if self.compression:
            try:
                parse(self.compression)
            except ValueError as exc:
                raise ConfigError(f"--compression: {exc}") from None
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


def _host_plan(config: Config, workers: int) -> tuple[list[tuple[str, int]], tuple[str, ...]]:
    """Worker hosts with their slot counts in rank order (Horovod's -H), and how to run a
    command on the first of them (on this machine)."""
    cluster = launch.load_state(config.state_dir)
    if cluster is None:
        raise BenchError(f"no cluster recorded in {config.state_dir}")
    slots = launch.worker_slots(cluster, workers)
    return (_grouped([slot.address for slot in slots]),
            tuple(host_command(cluster, slots[0].address)))


def _grouped(hosts: list[str]) -> list[tuple[str, int]]:
    """Each rank's host in rank order -> [(host, consecutive ranks on it)]."""
    plan: list[tuple[str, int]] = []
    for host in hosts:
        if plan and plan[-1][0] == host:
            plan[-1] = (host, plan[-1][1] + 1)
        else:
            plan.append((host, 1))
    return plan


@contextlib.contextmanager
def _horovod_rendezvous(config: Config, workers: int
                        ) -> Iterator[tuple[list[tuple[str, int]], str, int]]:
    """Horovod's rendezvous server: on the first worker host (over SSH on an SSH cluster, in
    its namespace on an emulated one), or in this process on a Slurm cluster (every step
    reaches the host that launches them, as srun itself needs). Yields the host plan it
    serves, and the address and port the workers reach it at."""
    recorded = launch.load_state(config.state_dir)
    if recorded is not None and recorded.kind == "slurm":
        from .horovod import address_towards, serve_rendezvous
        hosts = _grouped([a.address for a in launch.worker_slots(recorded)])
        with serve_rendezvous(hosts) as port:
            yield hosts, address_towards(hosts[0][0]), port
        return
    cluster = ssh_cluster(config.state_dir)
    if cluster is None:
        from .horovod import rendezvous
        hosts, prefix = _host_plan(config, workers)
        with rendezvous(hosts, prefix) as port:
            yield hosts, hosts[0][0], port
        return
    from ..launch.transport import remote_service
    assert cluster.hosts is not None
    slots = launch.worker_slots(cluster)
    hosts = _grouped([a.address for a in slots])
    argv = [cluster.hosts.python, "-m", "bpsctl.bench.horovod", "rendezvous", json.dumps(hosts)]
    try:
        with remote_service(cluster.hosts, slots[0].host, argv) as line:
            yield hosts, hosts[0][0], int(line)
    except launch.LaunchError as exc:
        raise BenchError(f"Horovod's rendezvous server: {exc}") from None


def _check_horovod(config: Config) -> None:
    """Horovod loads where its workers will run (every worker host of an SSH cluster, every
    worker node of a Slurm cluster), and on an SSH cluster every worker host names the NIC its
    Gloo binds; a ConfigError otherwise."""
    from .horovod import INSTALL_COMMAND, installed_version, missing_message
    recorded = launch.load_state(config.state_dir)
    if recorded is not None and recorded.kind == "slurm":
        _check_horovod_on_nodes(recorded)
        return
    cluster = ssh_cluster(config.state_dir)
    if cluster is None:
        if installed_version() is None:
            raise ConfigError(missing_message())
        return
    assert cluster.hosts is not None
    unnamed = [entry.host for entry in cluster.hosts.workers if not entry.interface]
    if unnamed:
        raise ConfigError(f"--compare horovod: worker host {', '.join(unnamed)} in "
                          f"{cluster.hosts.source} has no `interface:`; Horovod's Gloo binds a "
                          "named NIC (e.g. interface: eth0)")
    from ..launch.transport import run_on_hosts
    python = cluster.hosts.python
    worker_hosts = list(dict.fromkeys(entry.host for entry in cluster.hosts.workers))
    answers = run_on_hosts(cluster.hosts, worker_hosts, [
        python, "-c", "import horovod, horovod.torch; print(horovod.__version__)"], timeout_s=60)
    missing = [f"{host} ({why})" for host, (ok, why) in answers.items() if not ok]
    if missing:
        raise ConfigError(f"--compare horovod: Horovod does not load with torch for {python} "
                          f"on worker host {'; '.join(missing)}. Build it there "
                          f"(`{INSTALL_COMMAND}` on that host), or drop horovod from --compare")


def _check_horovod_on_nodes(cluster: launch.ClusterState) -> None:
    """Horovod loads with torch on every worker node of a Slurm cluster (one step on them
    all), or a ConfigError naming the nodes where it does not."""
    from ..launch import slurm
    from .horovod import INSTALL_COMMAND
    assert cluster.hosts is not None and cluster.slurm is not None
    nodes = list(dict.fromkeys(entry.host for entry in cluster.hosts.workers))
    probe = ("import json, os\nanswer = {'node': os.environ.get('SLURMD_NODENAME')}\n"
             "try:\n    import horovod, horovod.torch\n"
             "    answer['version'] = horovod.__version__\n"
             "except Exception as exc:\n    answer['error'] = f'{type(exc).__name__}: {exc}'\n"
             "print(json.dumps(answer))")
    answers, why = slurm.ask_nodes(str(cluster.slurm["job_id"]), nodes,
                                   [cluster.hosts.python, "-c", probe], "bpsctl-horovod-check",
                                   timeout_s=120.0)
    missing = [f"{node} ({answers[node].get('error')})" if node in answers
               else f"{node} (no answer{why})"
               for node in nodes if node not in answers or "version" not in answers[node]]
    if missing:
        raise ConfigError(f"--compare horovod: Horovod does not load with torch for "
                          f"{cluster.hosts.python} on worker node {'; '.join(missing)}. Build it "
                          f"there (`{INSTALL_COMMAND}` on that node), or drop horovod from "
                          "--compare")


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
    try:
        import torch
    except ImportError:
        return [HostGPUs(host=socket.gethostname(), error="torch is not installed")]
    if torch.version.cuda is None:          # a CPU build: no need for a fresh interpreter
        return [HostGPUs(host=socket.gethostname(), torch=torch.__version__)]
    return [probe_here(socket.gethostname(), code)]


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
                 output: IO[str]) -> dict[str, Any]:
    """One system's run of the training loop on the cluster named by ``config``."""
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
    if settings.device == "cuda":
        args += ["--device", "cuda", "--gpu-by", settings.gpu_by]
    if system in ("ddp", "ddp-powersgd"):
        args += ["--backend", settings.backend]
    if system != "bpsctl":
        config = config.replace(trace_dir="")       # --trace is bpsctl's timeline only
    if system != "horovod":
        return _run_workers(config, "bpsctl.bench.train", args, n, k, output)
    with _horovod_rendezvous(config, n) as (hosts, address, port):
        args += ["--horovod-hosts", ",".join(f"{h}:{c}" for h, c in hosts),
                 "--rendezvous-addr", address, "--rendezvous-port", str(port)]
        return _run_workers(config, "bpsctl.bench.train", args, n, k, output)


def run_train(config: Config, settings: TrainSettings, output: IO[str] | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """bpsctl, then each baseline of ``settings.compare``, training ``settings.model`` on
    synthetic data on one cluster; the JSON of docs/design.md (``kind: train``).

    A baseline that is not installed is a :class:`ConfigError` raised before anything starts:
    there is no silent substitute."""
    output = output if output is not None else sys.stderr
    progress = progress or (lambda message: None)
    if "horovod" in settings.compare:
        _check_horovod(config)
    from .models import build
    model = build(settings.model, settings.num_classes)
    params = [p.numel() for p in model.parameters()]
    wire = wire_bytes_per_step(model, config, settings.compression, settings.servers)
    del model
    # plain: one worker training alone, no communication, for the scaling efficiency
    systems = ("bpsctl", *[b for b in TRAIN_BASELINES if b in settings.compare], "plain")
    rounds: list[dict[str, dict[str, Any]]] = []
    with bench_cluster(config, settings.workers, settings.servers,
                       workers_per_host=settings.workers_per_host) as (cluster_config, nic):
        host_workers = worker_hosts(cluster_config, settings.workers)
        workers_at, server_hosts, _, shares = _job_servers(cluster_config, settings.workers,
                                                           settings.servers)
        for index in range(settings.rounds):
            # each system goes first in turn, so that a machine that slows down (or speeds
            # up) during the run does not favour whichever always runs first
            turn = index % len(systems)
            rows = {}
            for system in systems[turn:] + systems[:turn]:
                progress(system if settings.rounds == 1
                         else f"{system} (round {index + 1} of {settings.rounds})")
                rows[system] = train_system(cluster_config, settings, system, output)
            rounds.append(rows)
    results = [_pooled(system, [rows[system] for rows in rounds], settings.batch_size)
               for system in systems]
    streams = host_streams(config, host_workers)
    if results[0].get("gradient_path") in ("none", "nccl-local", "shm-local"):
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
        "results": results, **_cluster_keys(config),
        "speedup": {system: statistics.median(values) for system, values in ratios.items()},
        **({"speedup_by_round": ratios} if settings.rounds > 1 else {}),
    }


def worker_hosts(config: Config, workers: int) -> list[int]:
    """The workers of a job on each worker host of the cluster named by ``config``, in host
    order (one host on the embedded default)."""
    cluster = launch.load_state(config.state_dir)
    if cluster is None:
        raise BenchError(f"no cluster recorded in {config.state_dir}")
    return list(Counter(slot.address for slot in launch.worker_slots(cluster, workers)).values())


def wire_bytes_per_step(model: Any, config: Config, spec: str, servers: int = 1) -> int:
    """The bytes one bpsctl worker pushes per step (and pulls back) as the compressors state
    them: DistributedOptimizer's buckets, cut into partitions, each compressed unless its
    tensor is under the minimum size."""
    from ..engine.compression import KIND_BF16, KIND_FP16, parse
    from ..engine.partition import piece_bytes, split
    from ..engine.torch import _buckets
    compressor = parse(spec) if spec else None
    params = [p for p in model.parameters() if p.requires_grad]
    names = {p: f"grad.{i}" for i, p in enumerate(params)}
    total = 0
    for bucket in _buckets(params, names, config.fusion_bytes, "grad"):
        nbytes = sum(p.numel() * p.element_size() for p in bucket.params)
        itemsize = bucket.params[0].element_size()
        size = piece_bytes(nbytes, servers, config.partition_bytes, config.partition_depth)
        for _, length in split(nbytes, itemsize, size):
            if compressor is None or compressor.kind in (KIND_FP16, KIND_BF16) \
                    or nbytes < config.min_compress_bytes:
                # fp16/bf16 are casts in the plugin: half the bytes, no header
                total += length if compressor is None else length // 2
            else:
                total += compressor.wire_bytes(length // itemsize)
    return total


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
    model = student(16, 4, settings.hidden) if compressions else None
    gradient_bytes = None
    with bench_cluster(config, settings.workers, settings.servers) as (cluster_config, nic):
        if compressions:
            gradient_bytes = wire_bytes_per_step(model, cluster_config, "")
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
                           wire_bytes_per_step=wire_bytes_per_step(model, system_config, spec))
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
