"""Benchmarks as functions: what `bpsctl bench` runs, and what tests call directly. Here: the
cluster a benchmark runs on, its workers' launch and result lines, the ideal times, and
`bench comm`; the training benchmarks (`bench vgg16|resnet50`, `bench convergence`) are
:mod:`bpsctl.bench.training`'s, on the same pieces.

Every figure of one report comes from one run on one cluster: bpsctl's push_pull, the
baselines (`--compare`) and the raw ZeroMQ limit are measured side by side, with the same
bytes, hosts, warm-up and repeats. `bench comm --op` (:func:`run_ops`) does the same for
Horovod's collectives: bpsctl's (the torch plugin's) beside Horovod's own.
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
from ..model import GOODPUT_SHARE as GOODPUT_SHARE  # (where bench and its tests find it)
from ..model import goodput_bytes_s, job_shares, round_seconds
from .collectives import BYTES_OF, OPS, REDUCES, bus_factor
from .common import RESULT_MARKER
from .gpu import gpu_keys

COMM_BASELINES = ("allreduce", "horovod")
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
    #: what is measured (bench.collectives.OPS): push_pull alone is today's bench comm; any
    #: other op measures Horovod's collectives instead (:func:`run_ops`)
    ops: tuple[str, ...] = ("push_pull",)
    reduce: str = "average"              # allreduce's and reducescatter's op with --op
    timeout_s: float = 900.0             # per job of --op; a hung worker exits after it

    def __post_init__(self) -> None:
        check_per_host_split(self.workers, self.workers_per_host)
        check_ops(self.ops, self.compare, self.device, self.security,
                  reduce=self.reduce if self.collectives else None)
        wrong = [m for m in self.security if m not in SECURITY_MODES]
        if wrong or len(set(self.security)) != len(self.security):
            raise ConfigError(f"--security: expected distinct modes among "
                              f"{', '.join(SECURITY_MODES)}, got {','.join(self.security)}")
        unknown = [c for c in self.compare if c not in COMM_BASELINES]
        if unknown:
            raise ConfigError(f"--compare: {', '.join(unknown)} is not a baseline of bench comm; "
                              f"choose from {', '.join(COMM_BASELINES)} (horovod with --op; ddp "
                              "is a baseline of the training benchmarks)")
        if "allreduce" in self.compare:
            try:
                import torch.distributed  # noqa: F401
            except ImportError:
                raise ConfigError("--compare allreduce needs torch: pip install torch==2.13.0 (the "
                                  "CPU build; a plain `pip install torch` pulls CUDA)") from None

    @property
    def collectives(self) -> bool:
        """Whether Horovod's collectives are measured (any op but push_pull)."""
        return is_collectives(self.ops)


def is_collectives(ops: Sequence[str]) -> bool:
    """Whether ``ops`` (of `--op`) name any of Horovod's collectives, not push_pull alone."""
    return any(op != "push_pull" for op in ops)


def check_ops(ops: Sequence[str], compare: Sequence[str], device: str = "cpu",
              security: Sequence[str] = (), sweep: bool = False,
              reduce: str | None = None) -> None:
    """A ConfigError, saying what to do instead, for `--op` values bench comm cannot measure:
    an unknown or repeated op, or Horovod's collectives with what only push_pull has (the gloo
    ring allreduce baseline, CUDA tensors, a sweep, security modes side by side); and
    `--compare horovod` or `--reduce` without them. ``reduce`` None: not given."""
    if not ops:
        raise ConfigError(f"--op: expected ops such as allreduce,allgather; choose from "
                          f"{', '.join(OPS)}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ConfigError(f"--op: {', '.join(unknown)} is not an op of bench comm; choose from "
                          f"{', '.join(OPS)} (comma-separated for several)")
    twice = sorted({op for op in ops if ops.count(op) > 1})
    if twice:
        raise ConfigError(f"--op: {', '.join(twice)} is given twice; give each op once")
    if reduce is not None and reduce not in REDUCES:
        raise ConfigError(f"--reduce: expected {' or '.join(REDUCES)}, got {reduce!r}")
    if not is_collectives(ops):
        if "horovod" in compare:
            raise ConfigError("--compare horovod: bench comm compares Horovod on Horovod's "
                              "collectives; add --op allreduce (or allgather, alltoall, "
                              "reducescatter, comma-separated)")
        if reduce is not None:
            raise ConfigError("--reduce: applies to --op's allreduce and reducescatter; add "
                              "--op allreduce (push_pull alone always sums)")
        return
    what = f"--op {','.join(ops)}"
    if "allreduce" in compare:
        raise ConfigError(f"--compare allreduce with {what}: the gloo ring allreduce is "
                          "push_pull's baseline; compare the collectives with --compare horovod, "
                          "or drop --op")
    if device == "cuda":
        raise ConfigError(f"--device cuda with {what}: the collectives are measured on CPU "
                          "float32 tensors; drop --device cuda (or --op, for push_pull of CUDA "
                          "tensors)")
    if sweep:
        raise ConfigError(f"--sweep with {what}: the sweep measures push_pull against ring "
                          "allreduce; run one worker count at a time (--workers), or drop --op")
    if security:
        raise ConfigError(f"--security with {what}: security modes are compared on push_pull; "
                          "drop --security (BPSCTL_SECURITY sets the mode of the collectives' "
                          "run), or drop --op")


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
    if result.interrupted:
        # the user's Ctrl-C (or a SIGTERM) stopped the workers: not their failure, and no
        # logs to keep; the benchmark's clusters stop as this unwinds (cli_errors says so)
        raise launch.Interrupted(result.interrupted)
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
    figures are not this machine's), or an emulated cluster's slow hosts (--straggler) and
    every worker host's CPU limit (BPSCTL_HOST_CPU)."""
    cluster = hosts_cluster(config.state_dir)
    if cluster and cluster.kind == "slurm" and cluster.slurm:
        return {"cluster": "slurm", "slurm_job": str(cluster.slurm["job_id"]),
                "nodes": list(cluster.slurm["nodes"])}
    if cluster and cluster.hosts:
        return {"cluster": "ssh", "hosts_file": cluster.hosts.source}
    if config.emulate and (config.stragglers or config.cpu_stragglers or config.host_cpu):
        return {"stragglers": {str(rank): factor for rank, factor in config.stragglers.items()},
                "cpu_stragglers": {str(rank): factor
                                   for rank, factor in config.cpu_stragglers.items()},
                **({"host_cpu": config.host_cpu} if config.host_cpu else {})}
    return {}


def worker_hosts(config: Config, workers: int) -> list[int]:
    """The workers of a job on each worker host of the cluster named by ``config``, in host
    order (one host on the embedded default)."""
    cluster = launch.load_state(config.state_dir)
    if cluster is None:
        raise BenchError(f"no cluster recorded in {config.state_dir}")
    return list(Counter(slot.address for slot in launch.worker_slots(cluster, workers)).values())


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
        from .comm import zmq_pair_seconds  # NumPy: loaded by the commands that measure
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
    if settings.collectives:
        return run_ops(config, settings, output, progress)
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


def run_ops(config: Config, settings: CommSettings, output: IO[str] | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`bench comm --op`: bpsctl's Horovod collectives of ``settings.ops`` (and its push_pull
    on the same bytes beside allreduce), then with ``--compare horovod`` Horovod's own, on one
    cluster, each size a report (:func:`ops_point`); one size gives its report, several
    ``{"kind": "comm", "ops", ..., "sizes": [reports]}``. Horovod missing where its workers
    would run is a ConfigError before anything starts."""
    output = output if output is not None else sys.stderr
    progress = progress or (lambda message: None)
    if "horovod" in settings.compare:
        from .horovod import check_installed
        check_installed(config)
    with bench_cluster(config, settings.workers, settings.servers,
                       workers_per_host=settings.workers_per_host) as (cluster_config, nic):
        reports = [ops_point(cluster_config, settings, size, nic, output, progress)
                   for size in settings.sizes]
    if len(reports) == 1:
        return reports[0]
    return {"kind": "comm", "ops": list(settings.ops), "reduce": settings.reduce,
            "workers": settings.workers, "servers": settings.servers,
            "workers_per_host": settings.workers_per_host,
            "nic_mbit": reports[0]["nic_mbit"], "sizes": reports}


def _measured_ops(ops: Sequence[str]) -> list[str]:
    """The rows of an --op report in order: each op, and bpsctl's push_pull on allreduce's
    bytes right after allreduce (unless push_pull is asked for itself)."""
    rows = []
    for op in ops:
        rows.append(op)
        if op == "allreduce" and "push_pull" not in ops:
            rows.append("push_pull")
    return rows


def ops_point(config: Config, settings: CommSettings, size: int, nic_mbit: float | None,
              output: IO[str], progress: Callable[[str], None]) -> dict[str, Any]:
    """One size of `bench comm --op` on the cluster named by ``config``: a job of
    :mod:`bpsctl.bench.collectives` workers for bpsctl (every op, through the servers even
    with one worker), then one for Horovod (its rendezvous and workers as the training
    benchmarks start them: :func:`bpsctl.bench.horovod.horovod_rendezvous`). A row per (op,
    system): the median round, algbw (the op's bytes per worker, as nccl-tests counts them,
    over it) and busbw (nccl-tests' factor); ``speedup`` per op: Horovod's time over
    bpsctl's."""
    n, k = settings.workers, settings.servers
    host_workers = worker_hosts(config, n)
    measured = _measured_ops(settings.ops)
    common = ["--size", str(size), "--tensors", str(settings.tensors),
              "--warmup", str(settings.warmup), "--repeats", str(settings.repeats),
              "--reduce", settings.reduce, "--timeout", str(settings.timeout_s)]
    progress(f"{size} bytes, bpsctl's {', '.join(measured)}")
    runs = {"bpsctl": _run_workers(config.replace(force_distributed=True),
                                   "bpsctl.bench.collectives",
                                   ["--system", "bpsctl", "--ops", ",".join(measured), *common],
                                   n, k, output)}
    if "horovod" in settings.compare:
        from .horovod import horovod_rendezvous, worker_args
        theirs = [op for op in settings.ops if op != "push_pull"]
        progress(f"{size} bytes, Horovod's {', '.join(theirs)}")
        plain = config.replace(trace_dir="")            # --trace is bpsctl's timeline only
        with horovod_rendezvous(plain, n) as (hosts, address, port):
            runs["horovod"] = _run_workers(
                plain, "bpsctl.bench.collectives",
                ["--system", "horovod", "--ops", ",".join(theirs), *common,
                 *worker_args(hosts, address, port)], n, k, output)
    results: list[dict[str, Any]] = []
    speedup: dict[str, float] = {}
    for op in measured:
        rows: dict[str, dict[str, Any]] = {}
        for system, run in runs.items():
            if op in run["ops"]:
                got = run["ops"][op]
                median = statistics.median(got["seconds"])
                algbw = got["bytes"] / median / 1e6
                rows[system] = {"op": op, "system": system, "version": run["version"],
                                "seconds": median, "seconds_all": got["seconds"],
                                "bytes": got["bytes"], "bytes_of": BYTES_OF[op],
                                "algbw_MBps": algbw, "busbw_MBps": algbw * bus_factor(op, n),
                                "checked": got["checked"]}
        results += rows.values()
        if len(rows) == 2:
            speedup[op] = rows["horovod"]["seconds"] / rows["bpsctl"]["seconds"]
    ours = runs["bpsctl"]
    return {"kind": "comm", "ops": list(settings.ops), "reduce": settings.reduce, "workers": n,
            "servers": k, "nic_mbit": nic_mbit,
            "size_bytes": next(iter(ours["ops"].values()))["bytes"],
            "workers_per_host": settings.workers_per_host, "worker_hosts": host_workers,
            "tensors": ours["tensors"], "partition_bytes": config.partition_bytes,
            "credit_bytes": config.credit_bytes, "warmup": settings.warmup,
            "repeats": settings.repeats, "host": socket.gethostname(), "device": "cpu",
            "results": results, "speedup": speedup, **_cluster_keys(config)}


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


def sweep_servers(config: Config, servers: int | None, worker_hosts: int) -> int:
    """The servers of a `--sweep` point of ``worker_hosts``: ``servers`` if given, else one
    per worker host; with colocated servers, one on each worker host and ``servers`` CPU
    hosts besides."""
    if config.colocated_servers:
        return (servers or 0) + worker_hosts
    return servers or worker_hosts


def run_sweep(config: Config, settings: CommSettings, worker_counts: list[int],
              servers: int | None, output: IO[str] | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`--sweep workers=2,4,...`: a fresh cluster per worker count (servers = workers unless
    given; with ``settings.workers_per_host`` K, each count is of worker hosts, K workers
    each), bpsctl against allreduce at each, and the theory 2(n-1)/n beside it."""
    points = []
    for n in worker_counts:
        total = sweep_servers(config, servers, n)
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
