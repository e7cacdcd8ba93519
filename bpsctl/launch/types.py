"""The launch package's types: hosts, cluster records, and how a run or a ``down`` ended.

Pure data with no third-party imports, so that every backend, the planner and the state module
share them without importing each other.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from bpsctl.config import DEFAULT_SECURITY
from bpsctl.errors import BpsctlError
from bpsctl.launch.processes import ProcessIdentity

DEFAULT_SSH_PORT = 22
DEFAULT_MASTER_PORT = 29500
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 2
LOCALHOST = "127.0.0.1"
KNOWN_HOSTS_FILE = "known_hosts"        # in the state dir, unless ssh.known_hosts names one


class LaunchError(BpsctlError, RuntimeError):
    """Starting, using or stopping a cluster failed; the message names the process and the fix."""


# --------------------------------------------------------------------------- hosts

@dataclass(frozen=True)
class SshOptions:
    """How to reach one host over SSH."""

    user: str
    port: int = DEFAULT_SSH_PORT
    key: str | None = None                  # None: the SSH agent and ~/.ssh keys
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES         # extra connection attempts after the first
    known_hosts: str | None = None          # host keys checked against; None: set by ``up``


@dataclass(frozen=True)
class HostSpec:
    """One entry of the file: a machine and what runs on it.

    ``count`` is servers on the host for a server entry, worker processes (slots) for a worker
    entry, 1 for the scheduler. ``port`` is the first port a scheduler/server entry binds.
    """

    role: str                               # scheduler | server | worker
    host: str                               # what SSH connects to
    count: int
    ssh: SshOptions
    port: int | None = None
    interface: str | None = None            # bind/advertise this NIC's IPv4 address
    address: str | None = None              # or this address (default: ``host``)
    line: int | None = None                 # where the entry is in its file
    spare: bool = False                     # a server entry of spare servers (``spare: true``)
    # a server entry's share of the bytes (its servers together, evenly); None: the layout
    # model's (launch/plan.py)
    share: float | None = None
    nic_mbit: float | None = None           # the host's NIC rate (``nic:``), for the layout model


@dataclass(frozen=True)
class HostsSpec:
    """A whole validated hosts file; rank order follows the file."""

    source: str                             # the file (or -H text) it came from
    python: str
    workdir: str                            # logs and pid files on each host
    scheduler: HostSpec
    servers: tuple[HostSpec, ...]
    workers: tuple[HostSpec, ...]
    master_port: int = DEFAULT_MASTER_PORT
    env: tuple[tuple[str, str], ...] = field(default=())   # extra environment for every role

    @property
    def entries(self) -> tuple[HostSpec, ...]:
        return (self.scheduler, *self.servers, *self.workers)

    def ssh_hosts(self) -> dict[str, SshOptions]:
        """Every distinct SSH target, in file order."""
        found: dict[str, SshOptions] = {}
        for entry in self.entries:
            found.setdefault(entry.host, entry.ssh)
        return found

    @property
    def world_size(self) -> int:
        return sum(w.count for w in self.workers)

    def with_known_hosts(self, path: str) -> HostsSpec:
        """Every entry that names no known_hosts file checks host keys against ``path``."""
        def fill(entry: HostSpec) -> HostSpec:
            if entry.ssh.known_hosts:
                return entry
            return dataclasses.replace(entry, ssh=dataclasses.replace(entry.ssh,
                                                                      known_hosts=path))
        return dataclasses.replace(self, scheduler=fill(self.scheduler),
                                   servers=tuple(map(fill, self.servers)),
                                   workers=tuple(map(fill, self.workers)))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostsSpec:
        def entry(d: dict[str, Any]) -> HostSpec:
            return HostSpec(**{**d, "ssh": SshOptions(**d["ssh"])})
        return cls(source=data["source"], python=data["python"], workdir=data["workdir"],
                   scheduler=entry(data["scheduler"]),
                   servers=tuple(entry(s) for s in data["servers"]),
                   workers=tuple(entry(w) for w in data["workers"]),
                   master_port=data["master_port"],
                   env=tuple(tuple(kv) for kv in data["env"]))



# --------------------------------------------------------------------------- cluster records

@dataclass(frozen=True)
class ProcessRecord:
    """One scheduler or server process as ``bpsctl up`` recorded it."""

    role: str                   # scheduler | server
    rank: int
    host: str                   # the address it binds and advertises
    port: int | None
    pid: int
    create_time: float          # psutil's, to tell our process from a later one with its PID
    pgid: int
    log_path: str               # on the host it runs on
    ssh_host: str = ""          # the SSH target it was started on; "" for this machine
    node: str = ""              # the Slurm node its step runs on (pid: its srun, here)

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(pid=self.pid, pgid=self.pgid, create_time=self.create_time)

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"

    @property
    def label(self) -> str:
        """How messages name it: ``server 1 at 10.0.0.5:9001 (pid 123)``."""
        who = "the scheduler" if self.role == "scheduler" else f"{self.role} {self.rank}"
        return f"{who} at {self.host}:{self.port} (pid {self.pid})"


KINDS = ("local", "emulated", "ssh", "slurm")


@dataclass(frozen=True)
class ClusterState:
    """What ``<state_dir>/cluster.json`` records about a running cluster, whatever its kind.

    ``kind`` is local (processes on this machine), emulated (processes in network namespaces
    of this machine), ssh (processes on the hosts of ``hosts``) or slurm (job steps on the
    nodes of a Slurm allocation, described by ``hosts`` and ``slurm``).
    """

    name: str
    scheduler: str              # host:port
    secret: str
    state_dir: str
    processes: tuple[ProcessRecord, ...]
    created: float              # seconds since the epoch
    # an emulated cluster's network (see launch/emulate.py): {"cluster_id", "nic_mbit",
    # "workers": [{"name", "namespace", "address", "interface"}], "servers": [...]}
    emulation: dict[str, Any] | None = None
    security: str = DEFAULT_SECURITY   # BPSCTL_SECURITY of every member (engine/security.py)
    kind: str = "local"
    hosts: HostsSpec | None = None     # an SSH cluster's hosts file
    addresses: dict[str, str] = field(default_factory=dict)   # SSH target -> bound address
    # a Slurm cluster's allocation: {"job_id", "nodes": [...], "tasks_per_node": [...]}
    slurm: dict[str, Any] | None = None
    # which hosts sum what share of the bytes, as planned at `up` (bpsctl/model.py's
    # Layout.to_json); None for a cluster recorded before layouts were
    layout: dict[str, Any] | None = None

    @property
    def scheduler_record(self) -> ProcessRecord:
        return next(p for p in self.processes if p.role == "scheduler")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["hosts"] = self.hosts.to_json() if self.hosts is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterState:
        if data.get("kind", "local") not in KINDS:
            raise ValueError(f"kind {data.get('kind')!r} is not one of {', '.join(KINDS)}")
        hosts = HostsSpec.from_json(data["hosts"]) if data.get("hosts") else None
        if hosts is not None:       # recorded before ssh.known_hosts: the state dir's file
            hosts = hosts.with_known_hosts(os.path.join(data["state_dir"], KNOWN_HOSTS_FILE))
        processes = tuple(ProcessRecord(**p) for p in data["processes"])
        return cls(**{**data, "processes": processes, "hosts": hosts})


@dataclass(frozen=True)
class WorkerFailure:
    """A worker that exited non-zero (or was killed by a signal) on its own."""

    rank: int
    pid: int
    exit_code: int              # 128 + N when killed by signal N, as a shell reports it
    signal_name: str | None
    last_lines: tuple[str, ...]
    host: str = ""              # where it ran, when that is not simply this machine


@dataclass(frozen=True)
class RunResult:
    """How a job ended: ``exit_code`` is the first failing worker's (0 when all succeeded,
    128 + N when stopped by signal N); ``failures`` lists the root cause first."""

    exit_code: int
    failures: tuple[WorkerFailure, ...] = ()
    lost: str = ""              # a scheduler or server that exited during the run, named
    #: workers that failed while the job went on without them (BPSCTL_MIN_WORKERS)
    left_behind: tuple[WorkerFailure, ...] = ()
    #: workers that failed and were started again to rejoin the job (BPSCTL_MAX_RESTARTS)
    restarted: tuple[WorkerFailure, ...] = ()
    #: ranks of workers that `run --attach` started and that joined the job while it ran
    joined: tuple[int, ...] = ()
    #: the signal (SIGINT, SIGTERM) that stopped the job, 0 if none did
    interrupted: int = 0


@dataclass(frozen=True)
class DownReport:
    """What ``down`` did: ``cluster`` is None when there was nothing to stop.

    ``survivors`` says, for each process that could not be stopped, which and why.
    """

    cluster: str | None
    stopped: tuple[ProcessRecord, ...] = ()
    survivors: tuple[str, ...] = ()
    # emulated clusters of crashed runs: removed, or left alone because processes still run there
    removed_leftovers: tuple[str, ...] = ()
    busy_leftovers: tuple[str, ...] = ()
    # shared-memory arenas of the cluster's crashed jobs, removed from this machine's /dev/shm
    removed_segments: tuple[str, ...] = ()


__all__ = ["ClusterState", "DownReport", "HostSpec", "HostsSpec", "KINDS", "LaunchError",
           "ProcessRecord", "RunResult", "SshOptions", "WorkerFailure"]
