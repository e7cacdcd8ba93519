"""Every bpsctl knob, declared once: name, type, default, environment variable, help.

Nothing else in bpsctl reads ``os.environ``: processes get a frozen :class:`Config`
from :meth:`Config.from_env`, and launchers hand knobs to child processes with
:meth:`Config.to_env`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpsctl.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:                                   # Python 3.10
    import tomli as tomllib


#: BPSCTL_SECURITY's choices (see bpsctl/engine/security.py); hmac is the default because it
#: keeps outsiders out at no cost on the data path, where CURVE costs several times the time
#: (measure with `bpsctl bench comm --security hmac,curve,none`)
SECURITY_MODES = ("hmac", "curve", "none")
DEFAULT_SECURITY = "hmac"
#: the smallest BPSCTL_SHM_BYTES: the arena's header and a few small tensors
SHM_MIN_BYTES = 65536


class ConfigError(UsageError, ValueError):
    """A knob has a value bpsctl cannot use; the message names it and the expected form."""


# --------------------------------------------------------------------------- units

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """``"64MiB"`` -> 67108864, ``"4MB"`` -> 4000000, ``"4096000"`` -> 4096000.

    K/M/G alone are binary (as in ``dd``); KB/MB/GB are decimal, KiB/MiB/GiB binary.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{what}: expected a size such as 4096000, 4MB or 64MiB, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what}: must not be negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(f"{what}: expected a size such as 4096000, 4MB or 64MiB, got {text!r}")
    number, scale = m.group(1), _SIZE_UNITS[unit]
    if "." not in number:
        return int(number) * scale                     # exact, however large
    value = float(number) * scale
    if value != int(value):
        raise ConfigError(f"{what}: {text!r} is not a whole number of bytes")
    return int(value)


_RATE_UNITS = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6,
               "kbps": 8e-3, "mbps": 8.0, "gbps": 8e3}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_rate_mbit(text: str, what: str = "rate") -> float:
    """``"500mbit"`` -> 500.0, ``"1gbit"`` -> 1000.0 (megabits per second; *bps forms are bytes)."""
    m = _RATE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}: expected a rate such as 500mbit or 1gbit, got {text!r}")
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_straggler_spec(text: str, what: str = "--straggler"
                         ) -> tuple[dict[int, float], dict[int, float]]:
    """``"1:0.25,1:cpu=0.5"`` -> ({1: 0.25}, {1: 0.5}): worker ranks whose emulated host's NIC
    runs at a factor of --nic (``RANK:FACTOR``), and whose host's worker processes get a
    factor of one CPU (``RANK:cpu=FACTOR``); comma-separated, each form at most once a rank."""
    nic: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        rank_text, _, factor_text = item.partition(":")
        kind, target = ("cpu", cpu) if factor_text.startswith("cpu=") else ("nic", nic)
        try:
            rank, factor = int(rank_text), float(factor_text.removeprefix("cpu="))
        except ValueError:
            raise ConfigError(f"{what}: expected RANK:FACTOR such as 1:0.25 (worker 1's host NIC "
                              f"at a quarter of --nic) or RANK:cpu=FACTOR such as 1:cpu=0.5 "
                              f"(half of one CPU), got {item!r}") from None
        top = MAX_CPU_FACTOR if kind == "cpu" else 1
        if rank < 0 or not 0 < factor <= top or rank in target:
            raise ConfigError(f"{what}: {item!r}: expected a worker rank of 0 or more, once per "
                              f"form, and a factor above 0 and at most {top:g}")
        target[rank] = factor
    return nic, cpu


#: most CPUs ``RANK:cpu=FACTOR`` may give a host
MAX_CPU_FACTOR = 64.0
#: the least share of one CPU BPSCTL_HOST_CPU may give a host: the cgroup's quota is at least
#: 1 ms of each 100 ms period
MIN_HOST_CPU = 0.01


def parse_stragglers(text: str, what: str = "--straggler") -> dict[int, float]:
    """``"1:0.25"`` -> {1: 0.25}: worker ranks whose host's NIC runs at a factor of the
    others' rate (several comma-separated; ``RANK:cpu=FACTOR`` items are CPU limits)."""
    return parse_straggler_spec(text, what)[0]


def parse_cpu_stragglers(text: str, what: str = "--straggler") -> dict[int, float]:
    """``"1:cpu=0.5"`` -> {1: 0.5}: worker ranks whose host gets that share of one CPU."""
    return parse_straggler_spec(text, what)[1]


def parse_cpu_share(text: str | float, what: str = "BPSCTL_CPU_SHARE") -> float | None:
    """``auto`` -> None; a number in 0..1 -> itself (the share of the bytes the servers on
    CPU-only hosts sum together); anything else raises ConfigError naming ``what``."""
    if isinstance(text, str) and text.strip().lower() in ("auto", ""):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 <= value <= 1:
        raise ConfigError(f"{what}: expected auto or the share of the bytes the servers on "
                          f"CPU-only hosts sum together, from 0 (servers on the worker hosts "
                          f"only) to 1 (the CPU hosts only), got {text!r}")
    return value


def auto_io_threads(cores: int) -> int:
    """ZeroMQ I/O threads for a process on a machine of ``cores``: one per 8 cores, 1 to 4.
    One thread carries every connection of a process; on a machine with cores to spare a
    worker's connections to several servers then run side by side, and a small machine keeps
    the one thread that leaves its cores to the summing and training."""
    return max(1, min(4, cores // 8))


def parse_shm_server_bytes(text: str | int,
                           what: str = "BPSCTL_SHM_SERVER_BYTES") -> int | None:
    """``auto`` -> None (as the job needs while a quarter of ``/dev/shm`` stays free); a size
    of at least 64 KiB -> its bytes; anything else raises ConfigError naming ``what``."""
    if isinstance(text, str) and text.strip().lower() in ("auto", ""):
        return None
    try:
        value = parse_size(text, what)
    except ConfigError:
        value = -1
    if value < SHM_MIN_BYTES:
        raise ConfigError(f"{what}: expected auto or a size of at least {SHM_MIN_BYTES} bytes "
                          f"(64KiB), such as 2GiB, got {text!r}")
    return value


def check_backup_workers(backup_workers: int, workers: int,
                         flag: str = "--backup-workers") -> None:
    """Refuse a backup worker count a job of ``workers`` workers cannot have."""
    if not 0 <= backup_workers < max(workers, 1):
        raise ConfigError(f"{flag} / BPSCTL_BACKUP_WORKERS: expected {backup_range(workers)}, "
                          f"got {backup_workers}")


def check_training_mode(config: Config, flags: dict[str, str] | None = None,
                        compression: str | None = None) -> None:
    """Refuse the combinations of --staleness, --async and --backup-workers that have no
    meaning: asynchronous training has no rounds to be stale in or to complete early, and
    sends everything uncompressed (``compression``: a bench's --compression spec).
    ``flags`` names the flag that set each knob, for the message."""
    flags = flags or {}

    def name(knob: str, env: str) -> str:
        return f"{flags[knob]} / {env}" if knob in flags else env

    if config.staleness < 0:
        raise ConfigError(f"{name('staleness', 'BPSCTL_STALENESS')}: expected 0 (synchronous) "
                          f"or more steps, got {config.staleness}")
    if config.async_mode and config.staleness:
        raise ConfigError(f"{name('async_mode', 'BPSCTL_ASYNC')} with "
                          f"{name('staleness', 'BPSCTL_STALENESS')} {config.staleness}: "
                          "asynchronous training has no steps to bound; choose one")
    for knob, env, what in (("staleness", "BPSCTL_STALENESS", "staleness"),
                            ("async_mode", "BPSCTL_ASYNC", "asynchronous training")):
        if not getattr(config, knob):
            continue
        for other, other_env, value in (
                ("max_restarts", "BPSCTL_MAX_RESTARTS", config.max_restarts),
                ("max_workers", "BPSCTL_MAX_WORKERS",
                 config.max_workers if config.max_workers > config.world_size else 0)):
            if value:
                raise ConfigError(
                    f"{name(knob, env)} with {name(other, other_env)} {value}: a worker "
                    f"joins a running job at a step with no push_pull in flight, which "
                    f"{what} never has; choose one")
    if config.async_mode and config.backup_workers:
        raise ConfigError(f"{name('async_mode', 'BPSCTL_ASYNC')} with "
                          f"{name('backup_workers', 'BPSCTL_BACKUP_WORKERS')} "
                          f"{config.backup_workers}: asynchronous training waits for no one "
                          "already; choose one")
    if config.async_mode and compression:
        raise ConfigError(f"{name('async_mode', 'BPSCTL_ASYNC')} with "
                          f"{flags.get('compression', 'compression')} {compression}: "
                          "asynchronous training sends gradients and parameters uncompressed "
                          "(servers apply each gradient as it comes); choose one")


def backup_range(workers: int) -> str:
    """What a backup worker count may be in a job of ``workers`` workers."""
    if workers <= 0:
        return "0 or more"      # the job's size is not known here
    if workers == 1:
        return "0 (a job of one worker has no backup)"
    return f"0..{workers - 1} (fewer than the job's {workers} workers)"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# --------------------------------------------------------------------------- knobs

def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}: expected an integer, got {text!r}") from None


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what}: expected a number of seconds, got {text!r}") from None
    return value


def _str(text: str, what: str) -> str:
    return text


def _bool(text: str, what: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: expected true or false (1/0, yes/no), got {text!r}")


def _path(text: str, what: str) -> Path:
    return Path(text).expanduser()


# (text, what) -> value; parse_size also takes a file's integer as it is
_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "int": _int, "float": _float, "str": _str, "size": parse_size, "path": _path, "bool": _bool,
}


def knob(default: Any, env: str, help: str, kind: str, fallback_env: tuple[str, ...] = (),
         in_file: bool = False) -> Any:
    """``in_file``: a tuned config file may set it (a cluster-wide setting, not a process's
    identity or address)."""
    return field(default=default, metadata={"env": env, "help": help, "kind": kind,
                                            "fallback_env": fallback_env, "in_file": in_file})


@dataclass(frozen=True)
class Config:
    """The whole configuration of one bpsctl process (scheduler, server, worker or CLI)."""

    # identity of this process in the job
    role: str = knob("worker", "BPSCTL_ROLE", "scheduler, server or worker", "str")
    rank: int = knob(-1, "BPSCTL_RANK", "this worker's rank (-1: assigned at registration)", "int",
                     ("RANK",))
    world_size: int = knob(1, "BPSCTL_WORLD_SIZE", "number of worker processes in the job", "int",
                           ("WORLD_SIZE",))
    local_rank: int = knob(0, "BPSCTL_LOCAL_RANK", "rank among the workers on this host", "int",
                           ("LOCAL_RANK",))
    local_size: int = knob(1, "BPSCTL_LOCAL_SIZE", "number of workers on this host", "int",
                           ("LOCAL_WORLD_SIZE",))
    job_id: str = knob("default", "BPSCTL_JOB_ID", "name of the job the workers belong to", "str")

    # where things are
    scheduler: str = knob("", "BPSCTL_SCHEDULER",
                          "scheduler address host:port (empty: the cluster started by `bpsctl up`)",
                          "str")
    host: str = knob("127.0.0.1", "BPSCTL_HOST",
                     "address this process binds and advertises to its peers", "str")
    port: int = knob(0, "BPSCTL_PORT", "port a scheduler or server binds (0: any free port)", "int")
    secret: str = knob("", "BPSCTL_SECRET",
                       "the cluster's shared secret (generated by `bpsctl up`)", "str")
    security: str = knob(DEFAULT_SECURITY, "BPSCTL_SECURITY",
                         "how members prove they hold the secret: hmac (a handshake per "
                         "connection, data unencrypted at full speed), curve (ZeroMQ CURVE: "
                         "every byte encrypted, much slower) or none (trusted networks only)",
                         "str")
    state_dir: Path = knob(Path("~/.bpsctl").expanduser(), "BPSCTL_STATE_DIR",
                           "where `bpsctl up` records the cluster (state file, logs)", "path")
    control_socket: str = knob("", "BPSCTL_CONTROL_SOCKET",
                               "a socket file the scheduler also listens on, so that tools on "
                               "this machine reach it from any network namespace", "str")
    ready_file: str = knob("", "BPSCTL_READY_FILE",
                           "a scheduler or server writes its bound address here once serving",
                           "str")

    # emulated cluster (root): network namespaces with shaped NICs on this machine
    emulate: bool = knob(False, "BPSCTL_EMULATE",
                         "build an emulated cluster: one network namespace per host (root)", "bool")
    colocated_servers: bool = knob(False, "BPSCTL_COLOCATED_SERVERS",
                                   "an emulated cluster also runs one server on each worker "
                                   "host, beside the --servers K on CPU hosts of their own (K "
                                   "may be 0)", "bool")
    nic: str = knob("", "BPSCTL_NIC",
                    "each emulated host's full-duplex NIC rate, e.g. 500mbit or 1gbit "
                    "(empty: unshaped)", "str")
    straggler: str = knob("", "BPSCTL_STRAGGLER",
                          "a slow machine on purpose: RANK:FACTOR shapes worker RANK's emulated "
                          "host NIC to FACTOR x --nic (e.g. 1:0.25); RANK:cpu=FACTOR limits its "
                          "host's worker processes to FACTOR of one CPU (e.g. 1:cpu=0.5; a "
                          "cgroup, root); several comma-separated, both forms for one rank "
                          "allowed (1:0.25,1:cpu=0.5)",
                          "str")
    host_cpu: float = knob(0.0, "BPSCTL_HOST_CPU",
                           "an emulated cluster limits every worker host's processes to this "
                           "share of one CPU (a cgroup, root; 0: no limit, else at least "
                           "0.01); a RANK:cpu=FACTOR straggler's host gets FACTOR of it",
                           "float")

    # data path. Defaults chosen as the fastest for ResNet50 on 4 x 4 emulated hosts at 1 Gbit;
    # BytePS's 4096000 / 16384000 leave uplinks idle waiting for ACKs (docs/benchmarks.md)
    partition_bytes: int = knob(2097152, "BPSCTL_PARTITION_BYTES",
                                "largest piece a tensor is cut into for push/pull", "size",
                                in_file=True)
    # 16: bench comm of 64 MiB over 4 x 4 emulated hosts comes closer to the NIC limit than
    # with every piece at BPSCTL_PARTITION_BYTES, and VGG16's step is no slower (docs/benchmarks.md)
    partition_depth: int = knob(16, "BPSCTL_PARTITION_DEPTH",
                                "above 0: a large tensor is cut smaller than "
                                "BPSCTL_PARTITION_BYTES, so that every server gets this many of "
                                "its partitions (none under 1 MiB) and the first sums come "
                                "back while the rest is still being pushed", "int", in_file=True)
    credit_bytes: int = knob(67108864, "BPSCTL_CREDIT_BYTES",
                             "most bytes a worker has pushed and not yet seen acknowledged", "size",
                             in_file=True)
    pacing: bool = knob(True, "BPSCTL_PACING",
                        "when servers sum unequal shares (the mixed layout), a worker's bytes in "
                        "flight stay within BPSCTL_PACING_WINDOW, so that they leave in the "
                        "order of the servers' shares (0: off, the credit alone binds)", "bool",
                        in_file=True)
    # 6 MiB: the 4 + 2 mixed layout at 500 Mbit comes closest to its model (docs/benchmarks-
    # layouts.md); what the NIC drains in about 0.1 s there
    pacing_window_bytes: int = knob(6291456, "BPSCTL_PACING_WINDOW",
                                    "under pacing, most bytes a worker has pushed and not yet "
                                    "seen acknowledged (the credit, when that is smaller)",
                                    "size", in_file=True)
    fusion_bytes: int = knob(4096000, "BPSCTL_FUSION_BYTES",
                             "DistributedOptimizer packs gradients smaller than this, consecutive "
                             "in backward order, into one push_pull of up to this size (0: off)",
                             "size", in_file=True)
    cuda_fusion_bytes: int = knob(33554432, "BPSCTL_CUDA_FUSION_BYTES",
                                  "BPSCTL_FUSION_BYTES for CUDA gradients: each bucket's push "
                                  "costs events and a hand-off between threads, so a GPU step "
                                  "does better with fewer, larger ones (0: off)", "size",
                                  in_file=True)
    min_compress_bytes: int = knob(65536, "BPSCTL_MIN_COMPRESS_BYTES",
                                   "tensors smaller than this are pushed uncompressed even when a "
                                   "compressor is given (the saving would not pay for the work)",
                                   "size", ("BYTEPS_MIN_COMPRESS_BYTES",))
    num_servers: int = knob(0, "BPSCTL_NUM_SERVERS",
                            "servers a job uses, the first N registered (0: all of them)", "int",
                            in_file=True)
    cpu_share: str = knob("auto", "BPSCTL_CPU_SHARE",
                          "the share of the bytes the servers on CPU-only hosts sum together, "
                          "evenly, the servers on worker hosts the rest: 0 (servers on the "
                          "worker hosts only) to 1 (the CPU hosts only); auto: the cluster's "
                          "layout (hosts.yaml's share:, else the traffic model's optimum)",
                          "str", in_file=True)
    server_share: float = knob(-1.0, "BPSCTL_SERVER_SHARE",
                               "set by `bpsctl up` on a server: its share of the bytes in the "
                               "cluster's layout, 0 to 1 (negative: none, the job's servers "
                               "share evenly)", "float")
    server_colocated: bool = knob(False, "BPSCTL_SERVER_COLOCATED",
                                  "set by `bpsctl up` on a server that shares its host with "
                                  "workers (BPSCTL_CPU_SHARE tells such servers from those on "
                                  "CPU-only hosts)", "bool")
    server_threads: int = knob(2, "BPSCTL_SERVER_THREADS", "summation threads per server", "int",
                                in_file=True)
    io_threads: int = knob(0, "BPSCTL_IO_THREADS",
                           "ZeroMQ I/O threads of each worker and server process, which carry "
                           "its TCP connections (a worker's to several servers on different "
                           "threads): 0 (auto: one per 8 cores, 1 to 4) or 1..16", "int",
                           in_file=True)
    server_malloc: str = knob("auto", "BPSCTL_SERVER_MALLOC",
                              "allocator of a server process: auto (jemalloc when libjemalloc.so.2 "
                              "is installed, else glibc's) or glibc", "str", in_file=True)
    idle_release_s: float = knob(3.0, "BPSCTL_IDLE_RELEASE",
                                 "seconds without push/pull traffic after which a server or a "
                                 "worker's engine gives the free memory its allocator keeps "
                                 "for the next burst back to the system (0: never)", "float",
                                 in_file=True)
    local_reduce: str = knob("auto", "BPSCTL_LOCAL_REDUCE",
                             "intra-node stage of the torch plugin when several workers share a "
                             "host: auto (reduce-scatter before push, all-gather after pull) or "
                             "off", "str", in_file=True)
    local_shm: bool = knob(True, "BPSCTL_LOCAL_SHM",
                           "the intra-node stage sums CPU tensors in one shared-memory arena per "
                           "host (0: gloo over TCP loopback, as before)", "bool", in_file=True)
    local_only: str = knob("auto", "BPSCTL_LOCAL_ONLY",
                           "with every worker on one host, finish each push_pull in shared "
                           "memory without the servers: auto (on when the job has one host and "
                           "BPSCTL_LOCAL_SHM is on), on (an error otherwise) or off", "str",
                           in_file=True)
    shm_bytes: int = knob(536870912, "BPSCTL_SHM_BYTES",
                          "size of each host's shared-memory arena of the intra-node stage (in "
                          "/dev/shm); one push_pull needs about its tensor's size in it", "size",
                          in_file=True)
    shm_server: str = knob("auto", "BPSCTL_SHM_SERVER",
                           "a worker and a server on the same host exchange partitions through "
                           "shared memory in /dev/shm, the header still over TCP: auto, or 0 "
                           "(everything over TCP loopback); how much each process may take "
                           "for it: BPSCTL_SHM_SERVER_BYTES", "str", in_file=True)
    shm_server_bytes: str = knob("auto", "BPSCTL_SHM_SERVER_BYTES",
                                 "what each process may reserve in /dev/shm for shared memory "
                                 "with a server on its host: auto (as much as the model needs, "
                                 "while a quarter of /dev/shm stays free for others) or a size; "
                                 "partitions beyond it go through TCP (said once)", "str",
                                 in_file=True)
    force_distributed: bool = knob(False, "BPSCTL_FORCE_DISTRIBUTED",
                                   "a job of one worker sends its push_pulls through the "
                                   "servers all the same (by default there is nothing to sum "
                                   "and they complete at once, as in Horovod and BytePS): to "
                                   "measure the full path with one worker or GPU", "bool",
                                   ("BYTEPS_FORCE_DISTRIBUTED",), in_file=True)
    reuse_memory: bool = knob(True, "BPSCTL_REUSE_MEMORY",
                              "a worker using the torch plugin has glibc's malloc keep freed "
                              "large buffers (gradients, activations) for the next step instead "
                              "of unmapping them, sparing each step their page faults (0: "
                              "glibc's defaults)", "bool", in_file=True)
    # the standard names, not BPSCTL_*: launchers (bpsctl run, torchrun) set these per job,
    # after the BPSCTL_* variables of their own config
    master_addr: str = knob("127.0.0.1", "MASTER_ADDR",
                            "rendezvous host of the intra-node stage's torch.distributed groups",
                            "str")
    master_port: int = knob(0, "MASTER_PORT",
                            "rendezvous port of the intra-node stage (0: none)", "int")

    # timelines (engine/trace.py); BytePS's BYTEPS_TRACE_ON=1 with BYTEPS_TRACE_DIR works too
    trace_dir: str = knob("", "BPSCTL_TRACE_DIR",
                          "write Chrome traces of workers and servers under this directory "
                          "(empty: no tracing)", "str")
    trace_start_step: int = knob(0, "BPSCTL_TRACE_START_STEP",
                                 "first training step traced (the plugin's optimizer steps, "
                                 "else push_pulls of the first tensor)", "int",
                                 ("BYTEPS_TRACE_START_STEP",))
    trace_end_step: int = knob(0, "BPSCTL_TRACE_END_STEP",
                               "step at which tracing stops and the trace is written "
                               "(0: at shutdown)", "int", ("BYTEPS_TRACE_END_STEP",))
    trace_nic: str = knob("", "BPSCTL_TRACE_NIC",
                          "the network interface a trace samples (empty: the one holding "
                          "BPSCTL_HOST's address, lo for loopback)", "str")

    # deadlines
    start_timeout_s: float = knob(30.0, "BPSCTL_START_TIMEOUT",
                                  "seconds to wait for the scheduler and every peer to register",
                                  "float", in_file=True)
    op_timeout_s: float = knob(300.0, "BPSCTL_OP_TIMEOUT",
                               "seconds one push_pull may wait for the other workers", "float",
                               in_file=True)
    heartbeat_interval_s: float = knob(0.5, "BPSCTL_HEARTBEAT_INTERVAL",
                                       "seconds between heartbeats to the scheduler", "float",
                                       in_file=True)
    min_workers: int = knob(0, "BPSCTL_MIN_WORKERS",
                            "keep the job going while at least this many workers live; a lost "
                            "worker's share drops out of the averages (0: every worker, so any "
                            "loss ends the job)", "int")
    max_restarts: int = knob(0, "BPSCTL_MAX_RESTARTS",
                             "`bpsctl run` restarts a failed worker this many times in all; the "
                             "restarted worker rejoins the running job (the job goes on without "
                             "it meanwhile)", "int")
    max_workers: int = knob(0, "BPSCTL_MAX_WORKERS",
                            "the job may grow to this many workers: `bpsctl run --attach` starts "
                            "more that join it while it runs, with the next unused ranks (0: the "
                            "job's -np, no growth)", "int")
    attach: bool = knob(False, "BPSCTL_ATTACH",
                        "set by `bpsctl run --attach` on a worker that joins a running job with "
                        "a new rank instead of starting a new job", "bool")
    rejoin: bool = knob(False, "BPSCTL_REJOIN",
                        "set by `bpsctl run` on a restarted worker: it takes its rank back in "
                        "the running job instead of starting a new one", "bool")
    backup_workers: int = knob(0, "BPSCTL_BACKUP_WORKERS",
                               "a round of an averaged push_pull completes once all but this many "
                               "live workers pushed it; later pushes are dropped from the sum and "
                               "answered with the round's result (0: wait for every worker)",
                               "int")
    staleness: int = knob(0, "BPSCTL_STALENESS",
                          "bounded staleness: a worker may run up to this many steps ahead of "
                          "the slowest, updating with the averaged gradients of that many steps "
                          "ago (0: synchronous)", "int")
    async_mode: bool = knob(False, "BPSCTL_ASYNC",
                            "asynchronous training: servers hold the parameters and apply each "
                            "worker's gradient as it arrives (SGD with momentum on the server); "
                            "workers push gradients and pull parameters", "bool",
                            ("BYTEPS_ENABLE_ASYNC",))
    spare_servers: int = knob(0, "BPSCTL_SPARE_SERVERS",
                              "spare servers `bpsctl up` starts besides --servers: they hold no "
                              "partition until a server is lost, then one takes over all of its "
                              "partitions", "int")
    spare: bool = knob(False, "BPSCTL_SPARE",
                       "set by `bpsctl up` on a spare server: it registers as a spare and holds "
                       "nothing until it takes over a lost server's partitions", "bool")
    server_failover: bool = knob(True, "BPSCTL_SERVER_FAILOVER",
                                 "when a server is lost, move its partitions to the job's other "
                                 "servers and go on (0: fail the job, naming the server)", "bool",
                                 in_file=True)
    heartbeat_timeout_s: float = knob(5.0, "BPSCTL_HEARTBEAT_TIMEOUT",
                                      "seconds without a heartbeat before a process is declared "
                                      "lost", "float", in_file=True)
    scheduler_restarts: int = knob(10, "BPSCTL_SCHEDULER_RESTARTS",
                                   "times the supervisor `bpsctl up` leaves beside the scheduler "
                                   "restarts it (same address, same secret) when it dies; "
                                   "servers and workers re-register with it (0: never)", "int")
    scheduler_timeout_s: float = knob(15.0, "BPSCTL_SCHEDULER_TIMEOUT",
                                      "seconds servers and workers wait for a lost scheduler to "
                                      "come back before what needs it (a new tensor, a barrier, "
                                      "a loss or rejoin) fails; push_pulls of declared tensors "
                                      "go on meanwhile", "float")

    def __post_init__(self) -> None:
        if self.role not in ("scheduler", "server", "worker"):
            raise ConfigError(f"BPSCTL_ROLE: expected scheduler, server or worker, "
                              f"got {self.role!r}")
        checks = [
            (self.world_size >= 1, "BPSCTL_WORLD_SIZE", "at least 1", self.world_size),
            (self.max_workers == 0 or self.max_workers >= self.world_size, "BPSCTL_MAX_WORKERS",
             f"0 (the job's -np) or at least the job's {self.world_size} workers",
             self.max_workers),
            (self.rank >= -1 and self.rank < max(self.world_size, self.max_workers), "BPSCTL_RANK",
             f"-1 or 0..{max(self.world_size, self.max_workers) - 1} (world size "
             f"{self.world_size}" + (f", up to {self.max_workers} workers)"
                                     if self.max_workers > self.world_size else ")"), self.rank),
            (self.local_size >= 1, "BPSCTL_LOCAL_SIZE", "at least 1", self.local_size),
            (0 <= self.local_rank < self.local_size, "BPSCTL_LOCAL_RANK",
             f"0..{self.local_size - 1}", self.local_rank),
            (0 <= self.port < 65536, "BPSCTL_PORT", "0..65535", self.port),
            (self.partition_bytes >= 8, "BPSCTL_PARTITION_BYTES", "at least 8 bytes",
             self.partition_bytes),
            (0 <= self.partition_depth <= 65536, "BPSCTL_PARTITION_DEPTH", "0..65536 (0: off)",
             self.partition_depth),
            (self.credit_bytes >= 1, "BPSCTL_CREDIT_BYTES", "at least 1 byte", self.credit_bytes),
            (self.pacing_window_bytes >= 1, "BPSCTL_PACING_WINDOW", "at least 1 byte",
             self.pacing_window_bytes),
            (self.fusion_bytes >= 0, "BPSCTL_FUSION_BYTES", "0 or more bytes", self.fusion_bytes),
            (self.cuda_fusion_bytes >= 0, "BPSCTL_CUDA_FUSION_BYTES", "0 or more bytes",
             self.cuda_fusion_bytes),
            (self.min_compress_bytes >= 0, "BPSCTL_MIN_COMPRESS_BYTES", "0 or more bytes",
             self.min_compress_bytes),
            (self.num_servers >= 0, "BPSCTL_NUM_SERVERS", "0 (all) or more", self.num_servers),
            (1 <= self.server_threads <= 64, "BPSCTL_SERVER_THREADS", "1..64", self.server_threads),
            (0 <= self.io_threads <= 16, "BPSCTL_IO_THREADS", "0 (auto) or 1..16",
             self.io_threads),
            (self.local_reduce in ("auto", "off"), "BPSCTL_LOCAL_REDUCE", "auto or off",
             self.local_reduce),
            (self.local_only in ("auto", "on", "off"), "BPSCTL_LOCAL_ONLY", "auto, on or off",
             self.local_only),
            (self.shm_server in ("auto", "0"), "BPSCTL_SHM_SERVER", "auto or 0",
             self.shm_server),
            (self.shm_bytes >= SHM_MIN_BYTES, "BPSCTL_SHM_BYTES",
             f"at least {SHM_MIN_BYTES} bytes (64KiB)", self.shm_bytes),
            (self.server_malloc in ("auto", "glibc"), "BPSCTL_SERVER_MALLOC", "auto or glibc",
             self.server_malloc),
            (self.idle_release_s >= 0, "BPSCTL_IDLE_RELEASE", "0 (never) or more seconds",
             self.idle_release_s),
            (self.security in SECURITY_MODES, "BPSCTL_SECURITY", " or ".join(SECURITY_MODES),
             self.security),
            (0 <= self.master_port < 65536, "MASTER_PORT", "0..65535", self.master_port),
            (self.trace_start_step >= 0, "BPSCTL_TRACE_START_STEP", "0 or more",
             self.trace_start_step),
            (self.trace_end_step == 0 or self.trace_end_step > self.trace_start_step,
             "BPSCTL_TRACE_END_STEP", f"0 (at shutdown) or more than BPSCTL_TRACE_START_STEP "
             f"({self.trace_start_step})", self.trace_end_step),
            (self.start_timeout_s > 0, "BPSCTL_START_TIMEOUT", "more than 0 s",
             self.start_timeout_s),
            (self.host_cpu == 0 or MIN_HOST_CPU <= self.host_cpu <= MAX_CPU_FACTOR,
             "BPSCTL_HOST_CPU", f"0 (no limit) or {MIN_HOST_CPU:g} to {MAX_CPU_FACTOR:g} CPUs",
             self.host_cpu),
            (self.op_timeout_s > 0, "BPSCTL_OP_TIMEOUT", "more than 0 s", self.op_timeout_s),
            (self.min_workers >= 0, "BPSCTL_MIN_WORKERS", "0 or more", self.min_workers),
            (self.max_restarts >= 0, "BPSCTL_MAX_RESTARTS", "0 or more", self.max_restarts),
            (self.spare_servers >= 0, "BPSCTL_SPARE_SERVERS", "0 or more", self.spare_servers),
            (self.backup_workers >= 0 and (self.world_size == 1
                                            or self.backup_workers < self.world_size),
             "BPSCTL_BACKUP_WORKERS", backup_range(self.world_size if self.world_size > 1
                                                   else 0), self.backup_workers),
            (self.heartbeat_interval_s > 0, "BPSCTL_HEARTBEAT_INTERVAL", "more than 0 s",
             self.heartbeat_interval_s),
            (self.heartbeat_timeout_s > self.heartbeat_interval_s, "BPSCTL_HEARTBEAT_TIMEOUT",
             "more than the heartbeat interval", self.heartbeat_timeout_s),
            (self.scheduler_restarts >= 0, "BPSCTL_SCHEDULER_RESTARTS", "0 or more",
             self.scheduler_restarts),
            (self.scheduler_timeout_s > 0, "BPSCTL_SCHEDULER_TIMEOUT", "more than 0 s",
             self.scheduler_timeout_s),
        ]
        for ok, env, expected, value in checks:
            if not ok:
                raise ConfigError(f"{env}: expected {expected}, got {value!r}")
        if self.scheduler:
            parse_address(self.scheduler, "BPSCTL_SCHEDULER")
        if self.nic:
            parse_rate_mbit(self.nic, "BPSCTL_NIC")
        if self.straggler:
            parse_stragglers(self.straggler, "BPSCTL_STRAGGLER")
        parse_cpu_share(self.cpu_share)
        parse_shm_server_bytes(self.shm_server_bytes)
        if self.server_share > 1:
            raise ConfigError(f"BPSCTL_SERVER_SHARE: expected a share of the bytes from 0 to 1 "
                              f"(negative: none), got {self.server_share!r}")

    @property
    def nic_mbit(self) -> float | None:
        return parse_rate_mbit(self.nic, "BPSCTL_NIC") if self.nic else None

    @property
    def cpu_share_value(self) -> float | None:
        """BPSCTL_CPU_SHARE as a number, None for auto."""
        return parse_cpu_share(self.cpu_share)

    @property
    def zmq_io_threads(self) -> int:
        """BPSCTL_IO_THREADS, auto resolved from this machine's cores."""
        return self.io_threads or auto_io_threads(os.cpu_count() or 1)

    @property
    def shm_server_limit(self) -> int | None:
        """BPSCTL_SHM_SERVER_BYTES in bytes, None for auto."""
        return parse_shm_server_bytes(self.shm_server_bytes)

    @property
    def stragglers(self) -> dict[int, float]:
        return parse_stragglers(self.straggler, "--straggler") if self.straggler else {}

    @property
    def cpu_stragglers(self) -> dict[int, float]:
        return parse_cpu_stragglers(self.straggler, "--straggler") if self.straggler else {}

    # ---------------------------------------------------------------- building

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, file: Path | None = None,
                 **overrides: Any) -> Config:
        """Read every knob. Later sources win: built-in defaults, then ``file`` (a tuned config
        file, see :func:`read_config_file`), then ``environ`` (default: the process
        environment), then ``overrides`` (explicit command-line flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = read_config_file(file) if file is not None else {}
        for f in dataclasses.fields(cls):
            if f.name in overrides:
                continue
            for env in (f.metadata["env"], *f.metadata["fallback_env"]):
                text = environ.get(env)
                if text is not None and text != "":
                    values[f.name] = _PARSERS[f.metadata["kind"]](text, env)
                    break
        if environ.get("BYTEPS_TRACE_ON") == "1" and not values.get("trace_dir"):
            values["trace_dir"] = environ.get("BYTEPS_TRACE_DIR") or "./traces"   # as BytePS
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The ``BPSCTL_*`` variables that make a child process see this config."""
        return {f.metadata["env"]: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @staticmethod
    def describe() -> list[tuple[str, str, str, str]]:
        """(name, env var, default, help) of every knob, for docs and --help."""
        return [(f.name, f.metadata["env"], str(f.default), f.metadata["help"])
                for f in dataclasses.fields(Config)]


# --------------------------------------------------------------------------- config files

#: what ``[bpsctl] format`` says in a file `bpsctl tune` wrote, and the version this bpsctl reads
CONFIG_FILE_FORMAT = "tuned-config"
CONFIG_FILE_VERSION = 1
CONFIG_FILE_ENV = "BPSCTL_CONFIG"
_FILE_TABLES = ("bpsctl", "knobs", "tuned")
_FILE_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "size": "a size such as 4096000 or \"64MiB\"", "path": "a path"}


def default_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """Where `bpsctl tune` writes and `up`, `run`, `bench` look: $XDG_CONFIG_HOME/bpsctl/tuned.toml
    (XDG_CONFIG_HOME defaults to ~/.config; a relative one is ignored, as the XDG spec says)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path("~/.config").expanduser()
    return root / "bpsctl" / "tuned.toml"


def find_config_file(explicit: Path | None = None,
                     environ: Mapping[str, str] | None = None) -> Path | None:
    """The config file a command reads: ``--config FILE``, else $BPSCTL_CONFIG, else the
    default location if a file is there (else none). A file named explicitly must exist."""
    environ = os.environ if environ is None else environ
    for path, what in ((explicit, "--config"),
                       (environ.get(CONFIG_FILE_ENV) or None, CONFIG_FILE_ENV)):
        if path is not None:
            path = Path(path).expanduser()
            if not path.is_file():
                raise ConfigError(f"{what}: {path} is not a file")
            return path
    default = default_config_file(environ)
    return default if default.is_file() else None


def read_config_file(path: Path) -> dict[str, Any]:
    """The knobs a tuned config file sets, parsed and checked: ``{knob name: value}``.

    The file is TOML: ``[bpsctl] format = "tuned-config", version = 1`` says what it is,
    ``[knobs]`` holds Config knobs by name (sizes as numbers or strings such as ``"512KiB"``),
    ``[tuned]`` records where the values came from (not read). Anything else is an error that
    names the file, the key and what was expected.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    header = data.get("bpsctl")
    if not isinstance(header, dict) or header.get("format") != CONFIG_FILE_FORMAT:
        raise ConfigError(f"{path}: not a bpsctl tuned config: expected a [bpsctl] table with "
                          f"format = {CONFIG_FILE_FORMAT!r} (files that `bpsctl tune` writes)")
    version = header.get("version")
    if version != CONFIG_FILE_VERSION:
        raise ConfigError(f"{path}: [bpsctl] version: this bpsctl reads version "
                          f"{CONFIG_FILE_VERSION}, got {version!r}; run `bpsctl tune` again to "
                          "write a file this version reads")
    for key, value in data.items():
        if key not in _FILE_TABLES or not isinstance(value, dict):
            raise ConfigError(f"{path}: {key}: expected only the tables "
                              f"{', '.join(f'[{t}]' for t in _FILE_TABLES)}")
    allowed = {f.name: f for f in dataclasses.fields(Config) if f.metadata["in_file"]}
    values: dict[str, Any] = {}
    for name, raw in data.get("knobs", {}).items():
        what = f"{path}: [knobs] {name}"
        if name not in allowed:
            raise ConfigError(f"{what}: not a knob a config file sets; expected one of "
                              f"{', '.join(allowed)}")
        kind = allowed[name].metadata["kind"]
        if isinstance(raw, bool) and kind == "bool":
            values[name] = raw
        elif isinstance(raw, (int, float, str)) and not isinstance(raw, bool):
            values[name] = _PARSERS[kind](raw if kind == "size" and isinstance(raw, int)
                                          else str(raw), what)
        else:
            raise ConfigError(f"{what}: expected {_FILE_KINDS[kind]}, got {raw!r}")
    try:
        Config(**values)
    except ConfigError as exc:          # the range checks of __post_init__, under the file's name
        env, _, detail = str(exc).partition(": ")
        name = next((n for n, f in allowed.items() if f.metadata["env"] == env), env)
        raise ConfigError(f"{path}: [knobs] {name}: {detail}") from None
    return values


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """``"10.0.0.5:9000"`` -> ("10.0.0.5", 9000)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: expected host:port such as 127.0.0.1:9000, got {text!r}")
    return host, int(port)
