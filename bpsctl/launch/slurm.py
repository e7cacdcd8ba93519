"""Clusters inside a Slurm allocation: ``bpsctl up --slurm`` from ``salloc`` or an ``sbatch``
script, then ``run``/``status``/``logs``/``down`` as for any cluster.

The allocation is read once from Slurm's own environment (``SLURM_JOB_ID``,
``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE``); its node list
is expanded by ``scontrol show hostnames`` and each node's address and state come from
``scontrol show node``, so bpsctl never parses a host list itself; preflight finds the NIC
holding each node's address, which the workers' gloo (DDP, Horovod) binds. The allocation becomes a
:class:`~bpsctl.launch.types.HostsSpec` (scheduler on the first node, ``--servers-per-node``
servers on every node or on ``--server-nodes`` dedicated nodes, one worker slot per Slurm task)
and every process is planned by :func:`bpsctl.launch.plan.plan`, as on SSH hosts.

Every scheduler, server and worker is a job step, ``srun --overlap`` on one node, started from
the launching host (the batch host or the ``salloc`` shell) as a process group of its own and
recorded like a local process; its output is the step's output, so logs stay in the state
dir. When the job ends (or is cancelled) Slurm stops every step on every node itself.
``run`` forwards SIGUSR1 (Slurm's usual warning before a time limit, ``--signal=B:USR1@T``) to
its workers; the scheduler and servers ignore it, so a checkpoint signal sent to every step
cannot stop them.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import bpsctl
from bpsctl.config import Config, ConfigError
from bpsctl.engine import EngineError
from bpsctl.engine.client import scheduler_status
from bpsctl.engine.security import new_secret
from bpsctl.launch import state
from bpsctl.launch.local import LocalSpawner, is_live
from bpsctl.launch.plan import Assignment, Plan, plan
from bpsctl.launch.preflight import PreflightError
from bpsctl.launch.processes import (
    StopSignals,
    is_running,
    start_process,
    stop_groups,
    stop_signals_recorded,
)
from bpsctl.launch.report import down_report, local_status
from bpsctl.launch.runloop import STOP_GRACE_S, WorkerProcess
from bpsctl.launch.types import (
    ClusterState,
    DownReport,
    HostSpec,
    HostsSpec,
    LaunchError,
    ProcessRecord,
    SshOptions,
)

SCONTROL_TIMEOUT_S = 30.0
_POLL_INTERVAL_S = 0.05
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
#: node states in which nothing can start there (scontrol's State= words; a trailing * means
#: the node does not answer its controller)
_BAD_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "NO_RESPOND", "POWERED_DOWN",
               "POWER_DOWN", "REBOOT")
NOT_IN_ALLOCATION = ("--slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); get one "
                     "with `salloc -N 2 --ntasks-per-node=1` and run bpsctl in its shell, or put "
                     "`bpsctl up --slurm` and `bpsctl run` in an `sbatch` script")


# --------------------------------------------------------------------------- the allocation

def expand_counts(text: str, what: str) -> tuple[int, ...]:
    """Slurm's compressed per-node counts, ``"2(x3),1"`` -> (2, 2, 2, 1) (the form of
    ``SLURM_TASKS_PER_NODE`` and ``SLURM_JOB_CPUS_PER_NODE``)."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ConfigError(f"{what}: expected Slurm's per-node counts such as 2(x3),1, got "
                              f"{text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(counts)


def _scontrol(*args: str) -> str:
    try:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                                timeout=SCONTROL_TIMEOUT_S)
    except FileNotFoundError:
        raise ConfigError("--slurm: scontrol is not on PATH; run bpsctl where the Slurm client "
                          "commands are installed (a login node, or inside the allocation)"
                          ) from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"scontrol {' '.join(args)} did not answer within "
                          f"{SCONTROL_TIMEOUT_S:g} s; is slurmctld reachable?") from None
    if result.returncode != 0:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """``n[01-03]`` -> ("n01", "n02", "n03"), as ``scontrol show hostnames`` answers."""
    return tuple(_scontrol("show", "hostnames", nodelist).split())


def parse_node_line(line: str) -> dict[str, str]:
    """One line of ``scontrol show node -o``: ``Key=value`` pairs, a value running up to the
    next `` Key=`` (``Reason=`` holds spaces)."""
    key = r"[A-Za-z][A-Za-z0-9_]*"
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(rf"(?:^|\s)({key})=(.*?)(?=\s{key}=|$)", line.strip())}


def node_info(nodes: Sequence[str]) -> dict[str, dict[str, str]]:
    """Each node's ``scontrol show node`` record (NodeAddr, State, Reason, ...)."""
    found = {}
    for line in _scontrol("show", "node", "-o", ",".join(nodes)).splitlines():
        if line.strip():
            record = parse_node_line(line)
            found[record.get("NodeName", "")] = record
    return found


def node_problem(record: dict[str, str] | None) -> str | None:
    """Why Slurm would not run anything on a node, or None."""
    if record is None:
        return "Slurm does not know this node"
    node_state = record.get("State", "")
    words = node_state.rstrip("*").upper().replace("+", " ").split()
    if node_state.endswith("*") or any(w in _BAD_STATES for w in words):
        reason = record.get("Reason") or ""
        return f"Slurm says it is {node_state}" + (f" (reason: {reason})" if reason else "")
    return None


@dataclass(frozen=True)
class Allocation:
    """The Slurm job bpsctl runs in: its nodes, tasks and CPUs per node."""

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    cpus_per_node: tuple[int, ...]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Allocation:
        """Read the allocation from Slurm's environment (this is the one place that does)."""
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not job_id:
            raise ConfigError(NOT_IN_ALLOCATION)
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError("--slurm: SLURM_JOB_NODELIST is not set; run bpsctl in the shell "
                              "of `salloc` or in an `sbatch` script, not in a job step")
        nodes = expand_nodelist(nodelist)
        tasks = expand_counts(environ.get("SLURM_TASKS_PER_NODE", f"1(x{len(nodes)})"),
                              "SLURM_TASKS_PER_NODE")
        if environ.get("SLURM_NTASKS_PER_NODE"):     # --ntasks-per-node, when given
            tasks = (int(environ["SLURM_NTASKS_PER_NODE"]),) * len(nodes)
        cpus = expand_counts(environ.get("SLURM_JOB_CPUS_PER_NODE", f"1(x{len(nodes)})"),
                             "SLURM_JOB_CPUS_PER_NODE")
        if len(tasks) != len(nodes) or len(cpus) != len(nodes):
            raise ConfigError(f"--slurm: the allocation has {len(nodes)} nodes ({nodelist}) but "
                              f"SLURM_TASKS_PER_NODE={environ.get('SLURM_TASKS_PER_NODE')} and "
                              f"SLURM_JOB_CPUS_PER_NODE={environ.get('SLURM_JOB_CPUS_PER_NODE')}"
                              " do not describe as many")
        return cls(job_id=job_id, nodes=nodes, tasks_per_node=tasks, cpus_per_node=cpus)


def default_port(job_id: str) -> int:
    """The scheduler's port when ``--port`` is not given: derived from the job ID, so that two
    jobs sharing a node are unlikely to collide (preflight checks it is free anyway)."""
    digits = int(re.sub(r"\D", "", job_id) or 0)
    return 20000 + (digits % 1000) * 20


def allocation_hosts(allocation: Allocation, *, servers_per_node: int | None,
                     server_nodes: int, port: int, addresses: Mapping[str, str],
                     state_dir: str, interfaces: Mapping[str, str] | None = None,
                     colocated: bool = False) -> HostsSpec:
    """The allocation as a hosts file would describe it (pure).

    Without ``server_nodes`` every node runs ``servers_per_node`` (default 1) servers beside
    its workers (BytePS's colocated layout); with it, the first ``server_nodes`` nodes run only
    servers and the rest workers, and with ``colocated`` also ``servers_per_node`` servers
    each (BytePS's mixed layout: each server's share of the bytes follows launch.plan.layout,
    the traffic model's optimum by default). The scheduler is on the first node; server ports follow
    the scheduler's, and torch's ``MASTER_PORT`` is 1000 above it. ``interfaces`` names the
    NIC holding each node's address, as preflight found it: gloo (DDP, Horovod) binds it
    (``GLOO_SOCKET_IFNAME``) rather than whatever the node's hostname resolves to.
    """
    nodes = allocation.nodes
    per_node = 1 if servers_per_node is None else servers_per_node
    if per_node < 1:
        raise ConfigError(f"--servers-per-node: expected at least 1, got {per_node}")
    if server_nodes < 0:
        raise ConfigError(f"--server-nodes: expected 0 or more, got {server_nodes}")
    if server_nodes >= len(nodes):
        raise ConfigError(f"--server-nodes {server_nodes}: the allocation has {len(nodes)} "
                          f"node(s) and workers need at least one; allocate more nodes "
                          f"(salloc -N {server_nodes + 1}) or lower --server-nodes")
    for node, cpus, tasks in zip(nodes, allocation.cpus_per_node, allocation.tasks_per_node,
                                 strict=True):
        if per_node > cpus:
            raise ConfigError(f"--servers-per-node {per_node}: node {node} has {cpus} CPU(s) in "
                              f"this allocation (SLURM_JOB_CPUS_PER_NODE); use at most {cpus}, "
                              f"or allocate more (salloc --cpus-per-task / -c)")
        del tasks
    local = SshOptions(user="")         # never used: Slurm reaches the nodes
    server_hosts = nodes[:server_nodes] + (nodes[server_nodes:] if colocated else ()) \
        if server_nodes else nodes
    worker_nodes = list(zip(nodes, allocation.tasks_per_node, strict=True))[server_nodes:]

    def address(node: str) -> str:
        return addresses.get(node, node)

    def interface(node: str) -> str | None:
        return (interfaces or {}).get(node)

    scheduler = HostSpec(role="scheduler", host=nodes[0], count=1, ssh=local, port=port,
                         address=address(nodes[0]), interface=interface(nodes[0]))
    servers = []
    next_port = port + 1
    for node in server_hosts:
        servers.append(HostSpec(role="server", host=node, count=per_node, ssh=local,
                                port=next_port, address=address(node),
                                interface=interface(node)))
        next_port += per_node
    workers = tuple(HostSpec(role="worker", host=node, count=tasks, ssh=local,
                             address=address(node), interface=interface(node))
                    for node, tasks in worker_nodes if tasks)
    return HostsSpec(source=f"Slurm job {allocation.job_id}", python=sys.executable,
                     workdir=state_dir, scheduler=scheduler, servers=tuple(servers),
                     workers=workers, master_port=port + 1000)


def _resolve(address: str) -> str:
    try:
        return socket.gethostbyname(address)
    except OSError:
        return address


# --------------------------------------------------------------------------- steps

def step_argv(job_id: str, node: str, name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` as one task of a job step on ``node``, sharing the allocation's resources with
    every other step (``--overlap``)."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={node}", f"--job-name={name}", "--kill-on-bad-exit=1", "--export=ALL",
            "--unbuffered", *argv]


def role_argv(role: str) -> list[str]:
    """A scheduler or server, ignoring SIGUSR1/SIGUSR2 (see the module's docstring)."""
    return [sys.executable, "-m", "bpsctl.launch.slurm", "role", role]


def _steps(job_id: str, prefix: str) -> list[str]:
    """IDs of the job's steps whose name starts with ``prefix`` (empty if the job is gone)."""
    try:
        result = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"],
                                capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    steps = []
    for line in result.stdout.splitlines():
        step_id, _, name = line.strip().partition(" ")
        if name.startswith(prefix):
            steps.append(step_id)
    return steps


def cancel_steps(job_id: str, prefix: str) -> None:
    """Cancel what is left of the steps named ``prefix...`` (after their sruns were stopped)."""
    steps = _steps(job_id, prefix)
    if steps:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", *steps], capture_output=True, timeout=SCONTROL_TIMEOUT_S)


# --------------------------------------------------------------------------- preflight

def _check_nodes(allocation: Allocation, hosts: HostsSpec, records: dict[str, dict[str, str]],
                 timeout_s: float
                 ) -> tuple[dict[str, str], dict[str, str], dict[str, list[str]]]:
    """Check every node at once: its Slurm state, then (one step on every node that is up)
    the same bpsctl version there, the address it binds (and the NIC holding it), and its
    ports free.

    Returns (node -> address, node -> interface, node -> problems)."""
    problems: dict[str, list[str]] = {}
    for node in allocation.nodes:
        problem = node_problem(records.get(node))
        if problem:
            problems.setdefault(node, []).append(problem)
    the_plan = plan(hosts)
    specs: dict[str, dict[str, Any]] = {
        node: {"interface": None, "address": hosts_address(hosts, node), "ports": []}
        for node in allocation.nodes}
    for a in the_plan.assignments:
        if a.port:
            specs[a.host]["ports"].append(a.port)
    up_nodes = [n for n in allocation.nodes if n not in problems]
    addresses: dict[str, str] = {}
    interfaces: dict[str, str] = {}
    if not up_nodes:
        return addresses, interfaces, problems
    answered, why = ask_nodes(allocation.job_id, up_nodes,
                              [sys.executable, "-m", "bpsctl.launch.slurm", "check",
                               json.dumps(specs)], "bpsctl-preflight", timeout_s)
    for node in up_nodes:
        answer = answered.get(node)
        if answer is None:
            problems.setdefault(node, []).append(
                f"unreachable: the check step did not answer{why}")
            continue
        if answer.get("version") != bpsctl.__version__:
            problems.setdefault(node, []).append(
                f"bpsctl {answer.get('version')} for {answer.get('python')}, but this launcher "
                f"is bpsctl {bpsctl.__version__}; install the same version on every node")
        if answer.get("import_error"):
            problems.setdefault(node, []).append(
                f"{answer.get('python')} cannot import what the roles run: "
                f"{answer['import_error']['error']}")
        if answer.get("problems"):
            problems.setdefault(node, []).extend(answer["problems"])
        elif answer.get("address"):
            addresses[node] = answer["address"]
            if answer.get("interface"):
                interfaces[node] = answer["interface"]
    return addresses, interfaces, problems


def ask_nodes(job_id: str, nodes: Sequence[str], argv: Sequence[str], name: str,
              timeout_s: float) -> tuple[dict[str, dict[str, Any]], str]:
    """Run ``argv`` once on each of ``nodes`` (one step, one task per node) and read the JSON
    line each task prints with its ``"node"``. Returns (node -> answer, why a node may not
    have answered: srun's exit code and its last lines, "" when every node answered)."""
    command = ["srun", f"--jobid={job_id}", "--overlap", f"--nodes={len(nodes)}",
               f"--ntasks={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
               f"--job-name={name}", "--kill-on-bad-exit=0", *argv]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                cwd=_PACKAGE_ROOT, stdin=subprocess.DEVNULL)
        output, errors, code = result.stdout, result.stderr, result.returncode
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        errors, code = f"no answer within {timeout_s:g} s", None
        cancel_steps(job_id, name)
    answered: dict[str, dict[str, Any]] = {}
    for line in output.splitlines():
        with contextlib.suppress(ValueError):
            answer = json.loads(line)
            if isinstance(answer, dict) and "node" in answer:
                answered[answer["node"]] = answer
    if all(node in answered for node in nodes):
        return answered, ""
    last = errors.strip().splitlines()[-3:] if errors.strip() else []
    return answered, ((f" (srun exit code {code})" if code is not None else "")
                      + (": " + " / ".join(last) if last else ""))


def hosts_address(hosts: HostsSpec, node: str) -> str:
    for entry in hosts.entries:
        if entry.host == node and entry.address:
            return entry.address
    return node


# --------------------------------------------------------------------------- up

def up(config: Config, *, servers_per_node: int | None = None, server_nodes: int = 0,
       colocated: bool = False, environ: Mapping[str, str] | None = None,
       progress: Callable[[str], None] | None = None) -> ClusterState:
    """Start the scheduler and servers as job steps of the current allocation, wait until
    every server has registered, and record the cluster (kind ``slurm``).

    Bad flags, or no allocation, raise :class:`ConfigError` (exit 2); a node that is down,
    unreachable, of another bpsctl version or with a port taken fails preflight with every
    problem named (:class:`PreflightError`); on any failure what was started is stopped.
    """
    say = progress or (lambda text: None)
    allocation = Allocation.from_environ(os.environ if environ is None else environ)
    port = config.port or default_port(allocation.job_id)
    state_dir = Path(config.state_dir).resolve()
    config = config.replace(state_dir=state_dir)
    # checks the flags against the allocation before asking Slurm anything about the nodes
    allocation_hosts(allocation, servers_per_node=servers_per_node, server_nodes=server_nodes,
                     port=port, addresses={}, state_dir=str(state_dir))
    say("asking Slurm about the nodes")
    records = node_info(allocation.nodes)
    addresses = {n: _resolve(r.get("NodeAddr") or n) for n, r in records.items()}
    hosts = allocation_hosts(allocation, servers_per_node=servers_per_node,
                             server_nodes=server_nodes, colocated=colocated, port=port,
                             addresses=addresses,
                             state_dir=str(state_dir))
    with state.state_lock(state_dir), stop_signals_recorded() as stop_signals:
        existing = state.load_state(state_dir)
        if existing is not None:
            if existing.kind != "slurm" and existing.kind != "local" or is_live(existing):
                raise LaunchError(f"cluster {existing.name} (scheduler {existing.scheduler}) "
                                  f"is recorded in {state_dir}; run `bpsctl down` first")
            state.forget(state_dir)             # every process of it has exited: stale
        say(f"preflight checks on {len(allocation.nodes)} node(s)")
        checked, interfaces, problems = _check_nodes(allocation, hosts, records,
                                                     config.start_timeout_s)
        if problems:
            raise PreflightError(problems)
        addresses.update(checked)
        hosts = allocation_hosts(allocation, servers_per_node=servers_per_node,
                                 server_nodes=server_nodes, colocated=colocated, port=port,
                             addresses=addresses,
                                 state_dir=str(state_dir), interfaces=interfaces)
        stop_signals.check()
        state.rotate_logs(state_dir)
        name = f"slurm-{allocation.job_id}-{secrets.token_hex(2)}"
        cluster_plan = plan(hosts, config, secret=new_secret(), job_id=name)
        say(f"starting the scheduler and {len(cluster_plan.servers)} server(s)")
        started: list[ProcessRecord] = []
        try:
            for a in (cluster_plan.scheduler, *cluster_plan.servers):
                stop_signals.check()
                started.append(_start_role(a, config, cluster_plan, name, allocation.job_id))
            ranks = _wait_registered(cluster_plan, started, config, stop_signals)
            processes = tuple(
                ProcessRecord(**{**p.__dict__, "rank": ranks.get((p.host, p.port), p.rank)})
                for p in started)
            cluster = ClusterState(name=name, kind="slurm",
                                   scheduler=cluster_plan.scheduler_address,
                                   secret=cluster_plan.secret, security=config.security,
                                   state_dir=str(state_dir), hosts=hosts, addresses=addresses,
                                   processes=processes, created=time.time(),
                                   slurm={"job_id": allocation.job_id,
                                          "nodes": list(allocation.nodes),
                                          "tasks_per_node": list(allocation.tasks_per_node)},
                                   layout=cluster_plan.layout.to_json()
                                   if cluster_plan.layout else None)
            state.write_state(cluster)
        except BaseException:
            _stop(started, allocation.job_id, name)
            raise
    return cluster


def _start_role(a: Assignment, config: Config, cluster_plan: Plan, name: str,
                job_id: str) -> ProcessRecord:
    log_path = state.logs_dir(config.state_dir) / f"{a.name}.log"
    env = {**os.environ, **a.to_env(config, cluster_plan)}
    argv = step_argv(job_id, a.host, f"{name}-{a.name}", role_argv(a.role))
    try:
        process, identity = start_process(argv, env, log_path=log_path, cwd=_PACKAGE_ROOT)
    except OSError as exc:
        raise LaunchError(f"cannot start srun for {a.role} {a.rank}: {exc.strerror}") from None
    return ProcessRecord(role=a.role, rank=a.rank, host=a.address, port=a.port, pid=identity.pid,
                         create_time=identity.create_time, pgid=identity.pgid,
                         log_path=str(log_path), node=a.host)


def _wait_registered(cluster_plan: Plan, started: list[ProcessRecord], config: Config,
                     stop_signals: StopSignals) -> dict[tuple[str, int | None], int]:
    """Ask the scheduler (over TCP) until every server registered; (address, port) -> rank."""
    deadline = time.monotonic() + config.start_timeout_s
    last_error = ""
    while True:
        stop_signals.check()
        for p in started:
            if not is_running(p.identity):
                raise LaunchError(f"{p.role} {p.rank} on node {p.node} (srun pid {p.pid}) exited "
                                  f"while starting; last lines of {p.log_path}:\n"
                                  f"{state.log_tail(p.log_path)}")
        try:
            view = scheduler_status(cluster_plan.scheduler_address, cluster_plan.secret,
                                    timeout_s=1.0, security=config.security)
            running = [s for s in view["servers"] if s["state"] == "running"]
            if len(running) >= len(cluster_plan.servers):
                return {(s["host"], int(s["port"])): int(s["rank"]) for s in running}
            last_error = f"{len(running)} of {len(cluster_plan.servers)} servers registered"
        except EngineError as exc:
            last_error = str(exc)
        if time.monotonic() > deadline:
            raise LaunchError(f"the cluster did not come up within {config.start_timeout_s:g} s "
                              f"({last_error}); raise --start-timeout / BPSCTL_START_TIMEOUT if "
                              "steps start slowly here, and see `bpsctl logs`")
        time.sleep(_POLL_INTERVAL_S)


def _stop(processes: Sequence[ProcessRecord], job_id: str, name: str) -> list[int]:
    """SIGTERM each step's srun (it passes the signal to its task), SIGKILL after the grace,
    then cancel what Slurm still runs of the cluster's steps. Returns survivors' pids."""
    survivors = [s.pid for s in stop_groups([p.identity for p in processes], STOP_GRACE_S)]
    cancel_steps(job_id, name)
    return survivors


def _job_id(cluster: ClusterState) -> str:
    assert cluster.slurm is not None, "a Slurm cluster records its job"
    return str(cluster.slurm["job_id"])


# --------------------------------------------------------------------------- down / status

def down(cluster: ClusterState) -> DownReport:
    """Stop the cluster's steps and forget it (the caller holds the state dir's lock). After
    the job has ended there is nothing left to stop, and the record is simply forgotten."""
    survivors = set(_stop(cluster.processes, _job_id(cluster), cluster.name))
    if not survivors:
        state.forget(cluster.state_dir)
    return down_report(cluster, survivors, "srun pid")


def status(cluster: ClusterState, timeout_s: float = 2.0) -> dict[str, Any]:
    """Each step's srun checked here, merged with the scheduler's view (asked over TCP)."""
    return local_status(cluster, cluster.scheduler, timeout_s,
                        f"the scheduler's step (srun pid {cluster.scheduler_record.pid}) has "
                        f"exited; has Slurm job {_job_id(cluster)} ended?")


# --------------------------------------------------------------------------- workers

def worker_plan(cluster: ClusterState, config: Config, job_id: str) -> Plan:
    """One worker per Slurm task of the allocation (``--ntasks-per-node``), planned from the
    hosts the cluster recorded."""
    assert cluster.hosts is not None, "a Slurm cluster records its hosts"
    return plan(cluster.hosts, config, secret=cluster.secret, job_id=job_id)


class SlurmSpawner(LocalSpawner):
    """Starts each worker as a one-task step on its node (output prefixed with its rank, kept
    in the state dir's logs), and forwards SIGUSR1 to every worker while the job runs."""

    def __init__(self, cluster: ClusterState, cmd: list[str], config: Config, stdout: IO[str],
                 stderr: IO[str]):
        super().__init__(cluster, cmd, config, stdout, stderr)
        self.job_id = _job_id(cluster)
        self.step_prefix = f"{cluster.name}-worker-{secrets.token_hex(2)}"
        self._workers: list[WorkerProcess] = []
        self._previous_usr1: Any = None

    def prefix(self, assignment: Assignment) -> tuple[list[str], str]:
        return (step_argv(self.job_id, assignment.host,
                          f"{self.step_prefix}-{assignment.rank}", []), assignment.host)

    def started(self, workers: list[WorkerProcess]) -> None:
        self._workers = list(workers)
        if threading.current_thread() is threading.main_thread():
            self._previous_usr1 = signal.signal(signal.SIGUSR1, self._forward)

    def _forward(self, signum: int, frame: Any) -> None:
        for worker in self._workers:
            if worker.exit_code() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signum)     # srun passes it on to its task

    def stop(self, workers: list[WorkerProcess], grace_s: float) -> None:
        if self._previous_usr1 is not None:
            signal.signal(signal.SIGUSR1, self._previous_usr1)
            self._previous_usr1 = None
        super().stop(workers, grace_s)
        cancel_steps(self.job_id, self.step_prefix)


# --------------------------------------------------------------------------- on the nodes

def main(argv: list[str] | None = None) -> int:
    """``python -m bpsctl.launch.slurm check SPECS`` (one task per node: this node's checks as
    one JSON line) or ``role scheduler|server`` (the role, deaf to SIGUSR1/SIGUSR2)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "role" and args[1] in ("scheduler", "server"):
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, signal.SIG_IGN)       # kept across exec
        os.execv(sys.executable, [sys.executable, "-m", f"bpsctl.engine.{args[1]}"])
    if len(args) == 2 and args[0] == "check":
        from bpsctl.engine.trace import interface_of
        from bpsctl.launch.remote import cmd_check
        node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
        spec = json.loads(args[1]).get(node, {"address": None, "ports": []})
        answer = cmd_check(spec)
        if answer["address"] and not answer["problems"]:
            answer["interface"] = interface_of(answer["address"])
        sys.stdout.write(json.dumps({"node": node, **answer}) + "\n")
        return 0
    sys.stderr.write("usage: python -m bpsctl.launch.slurm check SPECS | role scheduler|server\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
