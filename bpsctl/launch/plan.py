"""The role plan: a pure function from a hosts file to every process's place and environment.

``plan(hosts, config)`` says which host runs the scheduler, each server and each worker, with
ranks, ports and the environment each process starts with (``BPSCTL_*`` from
:meth:`Config.to_env` plus torch's ``RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT``). Worker ranks follow the file: host by host, slot by slot.

Every backend plans through it: an SSH cluster from its hosts file, a local or emulated one
from :func:`cluster_hosts`, which describes the recorded cluster as a hosts file would.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bpsctl.config import Config, ConfigError
from bpsctl.launch.types import LOCALHOST, ClusterState, HostSpec, HostsSpec, SshOptions
from bpsctl.model import Layout, plan_layout


@dataclass(frozen=True)
class Assignment:
    """One process of the cluster.

    For a server ``rank`` is its place in the file; the scheduler gives it its real rank when
    it registers (in the order servers arrive). A server of a ``spare: true`` entry starts as a
    spare server (``BPSCTL_SPARE``). ``share`` is a server's share of the bytes in the
    cluster's layout (None for a spare) and ``colocated`` says it shares a host with workers.
    """

    role: str                   # scheduler | server | worker
    rank: int
    host: str                   # the SSH target
    address: str                # what it binds and advertises
    port: int | None            # scheduler and servers
    local_rank: int
    local_size: int
    entry: HostSpec
    share: float | None = None
    colocated: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    def to_env(self, config: Config, plan: Plan) -> dict[str, str]:
        """Everything this process needs in its environment (no other variable is read)."""
        common = dict(scheduler=plan.scheduler_address, secret=plan.secret, host=self.address,
                      state_dir=plan.workdir, job_id=plan.job_id,
                      trace_nic=config.trace_nic or self.entry.interface or "")
        if self.role == "worker":
            # the intra-node stage meets at MASTER_ADDR:MASTER_PORT, as torch.distributed does
            process_config = config.replace(
                role="worker", rank=self.rank, world_size=plan.world_size,
                local_rank=self.local_rank, local_size=self.local_size, port=0,
                master_addr=plan.master_addr, master_port=plan.master_port, **common)
            torch_env = {"RANK": str(self.rank), "WORLD_SIZE": str(plan.world_size),
                         "LOCAL_RANK": str(self.local_rank),
                         "LOCAL_WORLD_SIZE": str(self.local_size),
                         "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port),
                         "PYTHONUNBUFFERED": "1"}
            if self.entry.interface:        # gloo (DDP, Horovod) binds this NIC, not the hostname's
                torch_env["GLOO_SOCKET_IFNAME"] = self.entry.interface
        else:
            process_config = config.replace(role=self.role, rank=-1, world_size=1, local_rank=0,
                                            local_size=1, port=self.port or 0,
                                            spare=self.entry.spare,
                                            server_share=-1.0 if self.share is None
                                            else self.share, server_colocated=self.colocated,
                                            **common)
            torch_env = {}
        return {**dict(plan.extra_env), **process_config.to_env(), **torch_env}


@dataclass(frozen=True)
class Plan:
    """The whole cluster: scheduler, servers and workers, in rank order."""

    scheduler: Assignment
    servers: tuple[Assignment, ...]
    workers: tuple[Assignment, ...]
    secret: str
    job_id: str
    workdir: str
    master_addr: str
    master_port: int
    extra_env: tuple[tuple[str, str], ...] = ()
    #: the job's world size when this plan starts only some of its workers (the new ranks of
    #: `run --attach`); 0: the plan's workers are the whole job
    job_size: int = 0
    #: which hosts sum what share of the bytes (:func:`layout`)
    layout: Layout | None = None

    @property
    def scheduler_address(self) -> str:
        return f"{self.scheduler.address}:{self.scheduler.port}"

    @property
    def world_size(self) -> int:
        return self.job_size or len(self.workers)

    @property
    def assignments(self) -> tuple[Assignment, ...]:
        return (self.scheduler, *self.servers, *self.workers)


def plan(hosts: HostsSpec, config: Config | None = None, *, secret: str = "",
         job_id: str = "default", addresses: Mapping[str, str] | None = None) -> Plan:
    """Assign every role of ``hosts`` (pure: same arguments, same plan).

    ``addresses`` maps an SSH target to the address its processes bind, as preflight found it
    (from the entry's ``interface:``); otherwise an entry's ``address:``, else its ``host``.
    """
    config = config or Config()
    addresses = addresses or {}

    def address_of(entry: HostSpec) -> str:
        return addresses.get(entry.host) or entry.address or entry.host

    s = hosts.scheduler
    scheduler = Assignment(role="scheduler", rank=0, host=s.host, address=address_of(s),
                           port=s.port, local_rank=0, local_size=1, entry=s)
    servers: list[Assignment] = []
    the_layout = layout(hosts, config)
    shares = iter(the_layout.shares)
    for entry in hosts.servers:
        for index in range(entry.count):
            servers.append(Assignment(role="server", rank=len(servers), host=entry.host,
                                      address=address_of(entry), port=(entry.port or 0) + index,
                                      local_rank=index, local_size=entry.count, entry=entry,
                                      share=None if entry.spare else next(shares),
                                      colocated=entry.host in the_layout.worker_hosts))
    workers: list[Assignment] = []
    for entry in hosts.workers:
        for slot in range(entry.count):
            workers.append(Assignment(role="worker", rank=len(workers), host=entry.host,
                                      address=address_of(entry), port=None, local_rank=slot,
                                      local_size=entry.count, entry=entry))
    return Plan(scheduler=scheduler, servers=tuple(servers), workers=tuple(workers),
                secret=secret, job_id=job_id, workdir=hosts.workdir,
                master_addr=workers[0].address, master_port=hosts.master_port,
                extra_env=hosts.env, layout=the_layout)


def layout(hosts: HostsSpec, config: Config | None = None) -> Layout:
    """The cluster's layout: the share of the bytes each (non-spare) server of ``hosts`` sums,
    in file order. ``BPSCTL_CPU_SHARE`` if the config gives one, else the entries' ``share:``,
    else the traffic model's optimum for servers on worker hosts and on CPU-only hosts at the
    entries' ``nic:`` rates (equal rates without them; :func:`bpsctl.model.plan_layout`).
    A server is on a worker host when its entry names a host a worker entry names."""
    config = config or Config()
    servers = [entry for entry in hosts.servers if not entry.spare]
    server_hosts = [entry.host for entry in servers for _ in range(entry.count)]
    rates = {entry.host: entry.nic_mbit for entry in (*hosts.workers, *servers)
             if entry.nic_mbit is not None}
    given = None
    if all(entry.share is not None for entry in servers):
        given = [float(entry.share or 0) / entry.count for entry in servers
                 for _ in range(entry.count)]        # hosts.py: they sum to 1
    return plan_layout([w.host for w in hosts.workers], server_hosts, rates_mbit=rates,
                       cpu_share=config.cpu_share_value, given=given)


def cluster_hosts(cluster: ClusterState, workers: int, master_port: int) -> HostsSpec:
    """A local or emulated cluster as a hosts file would describe it, with ``workers`` slots.

    The scheduler and servers are the recorded ones. On the embedded default every worker is on
    this machine; on an emulated cluster ranks go to the worker hosts in contiguous blocks, as
    even as possible, in host order.
    """
    if workers < 1:
        raise ConfigError(f"-np: expected at least 1 worker, got {workers}")
    local = SshOptions(user="")         # never used to connect: these hosts are this machine
    host, _, port = cluster.scheduler.rpartition(":")
    scheduler = HostSpec(role="scheduler", host=host, count=1, ssh=local, port=int(port))
    servers = tuple(HostSpec(role="server", host=p.host, count=1, ssh=local, port=p.port)
                    for p in cluster.processes if p.role == "server")
    if cluster.emulation is None:
        hosts = [HostSpec(role="worker", host=LOCALHOST, count=workers, ssh=local)]
    else:
        emulated = cluster.emulation["workers"]
        hosts = []
        for index, entry in enumerate(emulated):
            count = workers // len(emulated) + (1 if index < workers % len(emulated) else 0)
            if count:
                hosts.append(HostSpec(role="worker", host=entry["address"], count=count, ssh=local,
                                      interface=entry["interface"]))
    return HostsSpec(source=f"cluster {cluster.name}", python="", workdir=cluster.state_dir,
                     scheduler=scheduler, servers=servers, workers=tuple(hosts),
                     master_port=master_port)


__all__ = ["Assignment", "Plan", "cluster_hosts", "layout", "plan"]
