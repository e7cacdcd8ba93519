"""Clusters on this machine: the embedded default (local processes on loopback) and emulated
hosts (the same processes, each inside the network namespace of an emulated host).

A cluster is one scheduler and K servers, each a process group of its own, recorded in the
state dir (:mod:`bpsctl.launch.state`). Workers are the user's command, started for one job by
the run loop (:mod:`bpsctl.launch.runloop`) through :class:`LocalSpawner`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bpsctl.config import Config, ConfigError
from bpsctl.engine import EngineError, shm
from bpsctl.engine.client import scheduler_status
from bpsctl.engine.common import jemalloc_preload
from bpsctl.engine.security import new_secret
from bpsctl.launch import emulate, state
from bpsctl.launch.output import OutputRelay
from bpsctl.launch.plan import Assignment
from bpsctl.launch.processes import (
    ProcessIdentity,
    StopSignals,
    is_running,
    reap_if_child,
    start_process,
    stop_groups,
    stop_signals_recorded,
)
from bpsctl.launch.report import down_report, local_status
from bpsctl.launch.runloop import STOP_GRACE_S, WorkerProcess
from bpsctl.launch.types import ClusterState, DownReport, LaunchError, ProcessRecord
from bpsctl.model import Layout, plan_layout

STATUS_TIMEOUT_S = 2.0          # how long `status` waits for the scheduler's answer
_WATCH_INTERVAL_S = 0.2         # how often a run checks that the cluster's processes still run
_POLL_INTERVAL_S = 0.02
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the directory that holds bpsctl/


def is_live(cluster: ClusterState) -> bool:
    return any(is_running(p.identity) for p in cluster.processes)


def _child_env(config: Config, extra: dict[str, str] | None = None) -> dict[str, str]:
    # Children inherit our environment (PATH, virtualenv, ...) but every BPSCTL_* knob comes
    # from ``config``.
    return {**os.environ, **config.to_env(), **(extra or {})}


# --------------------------------------------------------------------------- up

@dataclass
class _Child:
    """A cluster process being started: not yet in the state file."""

    name: str                   # scheduler | server
    process: subprocess.Popen
    identity: ProcessIdentity
    log_path: Path
    ready_path: Path

    def failure(self, what: str) -> LaunchError:
        return LaunchError(f"{self.name} (pid {self.identity.pid}) {what}; last lines of "
                           f"{self.log_path}:\n{state.log_tail(self.log_path)}")

    def record(self, role: str, rank: int, ready: dict[str, Any]) -> ProcessRecord:
        return ProcessRecord(role=role, rank=rank, host=str(ready["host"]),
                             port=int(ready["port"]), pid=self.identity.pid,
                             create_time=self.identity.create_time, pgid=self.identity.pgid,
                             log_path=str(self.log_path))


def _start_child(role: str, index: int, config: Config, state_dir: Path,
                 prefix: tuple[str, ...] = ()) -> _Child:
    # A server learns its rank when it registers; until then its log is named by start order.
    stem = "scheduler-0" if role == "scheduler" else f"{role}-starting-{index}"
    ready_path = state_dir / f"{stem}.ready"
    ready_path.unlink(missing_ok=True)
    log_path = state.logs_dir(state_dir) / f"{stem}.log"
    env = _child_env(config.replace(ready_file=str(ready_path)))
    if role == "server":            # its allocator from the start: no second interpreter
        env.update(jemalloc_preload(config.server_malloc, env))
    # The scheduler runs under a supervisor that restarts it when it dies (the same group:
    # stopping it stops both). Run from the directory holding bpsctl/, so that `python -m`
    # imports the very bpsctl this launcher runs, installed or not.
    # ``prefix`` places the process elsewhere, e.g. in an emulated host's network namespace.
    module = ["bpsctl.engine.supervise", "--record", str(state.supervision_file(state_dir))] \
        if role == "scheduler" else [f"bpsctl.engine.{role}"]
    process, identity = start_process([*prefix, sys.executable, "-m", *module], env,
                                      log_path=log_path, cwd=_PACKAGE_ROOT)
    return _Child(role, process, identity, log_path, ready_path)


def _wait_ready(child: _Child, deadline: float, timeout_s: float,
                stop_signals: StopSignals) -> dict[str, Any]:
    """The JSON the child writes to its ready file once it serves."""
    while True:
        stop_signals.check()
        try:
            return json.loads(child.ready_path.read_text())
        except (FileNotFoundError, ValueError):
            pass
        exit_code = child.process.poll()
        if exit_code is not None:
            raise child.failure(f"exited with code {exit_code} while starting")
        if time.monotonic() > deadline:
            raise child.failure(f"was not ready within {timeout_s:g} s (raise --start-timeout / "
                                "BPSCTL_START_TIMEOUT if the machine is slow)")
        time.sleep(_POLL_INTERVAL_S)


def _wait_servers_registered(scheduler: _Child, servers: list[_Child], address: str, secret: str,
                             security: str, deadline: float, timeout_s: float,
                             stop_signals: StopSignals) -> None:
    registered, last_error = 0, ""
    while True:
        stop_signals.check()
        for child in (scheduler, *servers):
            exit_code = child.process.poll()
            if exit_code is not None:
                raise child.failure(f"exited with code {exit_code} while starting")
        # ask at least once, even when the ready files used up the deadline
        remaining_s = max(deadline - time.monotonic(), 0.2)
        try:
            view = scheduler_status(address, secret, timeout_s=min(1.0, remaining_s),
                                    security=security)
            registered = sum(1 for s in view["servers"] if s["state"] in ("running", "spare"))
            if registered >= len(servers):
                return
        except EngineError as exc:
            last_error = f"({exc}) "
        if time.monotonic() > deadline:
            raise scheduler.failure(
                f"saw {registered} of {len(servers)} servers register within {timeout_s:g} s "
                f"{last_error}(raise --start-timeout / BPSCTL_START_TIMEOUT if the machine is "
                "slow)")
        time.sleep(_POLL_INTERVAL_S)


def up_local(config: Config, servers: int) -> ClusterState:
    """Start a scheduler and ``servers`` servers on this machine, recorded in ``config.state_dir``,
    and then ``config.spare_servers`` spare servers (so they have the highest ranks).

    Returns once the scheduler reports every server registered. On any failure everything
    started is stopped and :class:`LaunchError` names the process and quotes its log.
    """
    return _up(config, servers, network=None)


def up_emulated(config: Config, workers: int, servers: int) -> ClusterState:
    """Build an emulated cluster on this machine (root): ``workers`` worker hosts and ``servers``
    server hosts (CPU hosts), each a network namespace with a NIC shaped to ``config.nic`` (see
    :mod:`bpsctl.launch.emulate`), then start the scheduler (beside the first server, else the
    first worker host) and one server per server host, and with
    ``config.colocated_servers`` one on each worker host too (``servers`` may then be 0); each
    server sums its share of the bytes in the layout :func:`emulated_layout` plans.
    ``config.spare_servers`` more server hosts run the spare servers. Workers of later runs go
    to the worker hosts. On any failure, everything built or started is removed again.
    """
    plan = emulate.plan_network(workers, servers + config.spare_servers,     # checks the flags
                                config.nic or None,
                                slow=config.stragglers, slow_cpu=config.cpu_stragglers,
                                host_cpu=config.host_cpu or None)
    emulate.check_prerequisites()
    state_dir = Path(config.state_dir).resolve()
    existing = state.load_state(state_dir)
    if existing is not None and is_live(existing):
        raise _already_up(existing, state_dir)
    # claimed before it exists: if this process dies mid-way, `bpsctl down` knows what to remove
    state.make_state_dir(state_dir)
    claim = state.emulation_claim(state_dir)
    claim.write_text(plan.cluster_id)
    network = None
    try:
        network = emulate.create(plan)
        return _up(config, servers, network=network)
    except BaseException:
        if network is not None:
            emulate.destroy(network)
        raise
    finally:
        claim.unlink(missing_ok=True)      # the state file (or nothing) records it from now on


def _already_up(existing: ClusterState, state_dir: Path) -> LaunchError:
    return LaunchError(f"cluster {existing.name} (scheduler {existing.scheduler}) is already "
                       f"running from {state_dir}; run `bpsctl down` first")


def emulated_layout(plan: emulate.NetworkPlan, servers: int, config: Config) -> Layout:
    """The layout of an emulated cluster: its first ``servers`` server hosts and, with
    ``config.colocated_servers``, every worker host run a server (spares left out); each
    host's NIC at its rate (a straggler's is slower), shares as launch.plan.layout's rule
    gives them (BPSCTL_CPU_SHARE, else the traffic model's)."""
    cpu_hosts = [h.address for h in plan.servers[:servers]]
    worker_hosts = [h.address for h in plan.workers]
    rates = ({h.address: h.nic_mbit or plan.nic_mbit for h in plan.hosts}
             if plan.nic_mbit is not None else {})
    return plan_layout(worker_hosts,
                       cpu_hosts + (worker_hosts if config.colocated_servers else []),
                       rates_mbit=rates, cpu_share=config.cpu_share_value)


def _emulation_record(network: emulate.EmulatedNetwork) -> dict[str, Any]:
    def hosts(role: str) -> list[dict[str, Any]]:
        return [{"name": h.name, "namespace": h.namespace, "address": h.address,
                 "interface": h.interface,
                 **({} if h.cpu_factor is None else {
                     "cpu": h.cpu_factor,
                     "cgroup": str(emulate.cpu_cgroup(network.cluster_id, h.name))})}
                for h in network.hosts if h.role == role]
    return {"cluster_id": network.cluster_id, "nic_mbit": network.plan.nic_mbit,
            "workers": hosts("worker"), "servers": hosts("server")}


def _up(config: Config, servers: int, network: emulate.EmulatedNetwork | None) -> ClusterState:
    colocated = network is not None and config.colocated_servers
    if servers < (0 if colocated else 1):
        raise ConfigError(f"--servers: expected at least 1, got {servers}"
                          + ("" if network is None else " (or --colocated-servers, with which "
                             "each worker host runs a server too)"))
    the_layout = emulated_layout(network.plan, servers, config) if network is not None else None
    # absolute: children run elsewhere, and the state file must name the same place for everyone
    state_dir = Path(config.state_dir).resolve()
    config = config.replace(state_dir=state_dir)
    with state.state_lock(state_dir), stop_signals_recorded() as stop_signals:
        existing = state.load_state(state_dir)
        if existing is not None:
            if existing.kind == "ssh" or is_live(existing):
                raise _already_up(existing, state_dir)
            state.forget(state_dir)             # every process of it has exited: stale
        state.rotate_logs(state_dir)
        state.supervision_file(state_dir).unlink(missing_ok=True)
        secret = new_secret()
        deadline = time.monotonic() + config.start_timeout_s
        started: list[_Child] = []
        try:
            scheduler_config = config.replace(role="scheduler", secret=secret,
                                              control_socket=str(state.control_socket(state_dir)))
            scheduler_prefix: tuple[str, ...] = ()
            if network is not None:
                host = network.plan.scheduler_host
                scheduler_config = scheduler_config.replace(host=host.address)
                scheduler_prefix = tuple(network.command(host.name, []))
            scheduler = _start_child("scheduler", 0, scheduler_config, state_dir, scheduler_prefix)
            started.append(scheduler)
            ready = _wait_ready(scheduler, deadline, config.start_timeout_s, stop_signals)
            address = f"{ready['host']}:{ready['port']}"
            # on this machine alone every server shares its host with the workers (the
            # colocated layout); emulated hosts say per host below
            server_config = config.replace(role="server", scheduler=address, secret=secret, port=0,
                                           server_colocated=network is None)
            server_children: list[_Child] = []
            server_ready: list[dict[str, Any]] = []
            # the spares once the others have registered: the scheduler ranks servers in the
            # order they register, so spares come last
            # where each server runs (None: this machine), and whether it is a spare
            placed: list[tuple[emulate.EmulatedHost | None, bool]] = []
            if network is None:
                placed += [(None, False)] * servers + [(None, True)] * config.spare_servers
            else:
                server_hosts = network.plan.servers
                hosts = [*server_hosts[:servers], *(network.plan.workers if colocated else ())]
                placed += [(h, False) for h in hosts]
                placed += [(h, True)
                           for h in server_hosts[servers:servers + config.spare_servers]]
            shares = iter(the_layout.shares if the_layout is not None else ())
            regular = sum(1 for _, spare in placed if not spare)
            for batch in (placed[:regular], placed[regular:]):
                children: list[_Child] = []
                for server_host, spare in batch:
                    child_config = server_config.replace(spare=spare)
                    prefix: tuple[str, ...] = ()
                    if network is not None and server_host is not None:
                        child_config = child_config.replace(
                            host=server_host.address,
                            server_colocated=server_host.role == "worker",
                            server_share=-1.0 if spare else next(shares))
                        prefix = tuple(network.command(server_host.name, []))
                    children.append(_start_child("server", len(server_children) + len(children),
                                                 child_config, state_dir, prefix))
                started.extend(children)
                server_children.extend(children)
                server_ready += [_wait_ready(c, deadline, config.start_timeout_s, stop_signals)
                                 for c in children]
            _wait_servers_registered(scheduler, server_children,
                                     f"ipc://{state.control_socket(state_dir)}", secret,
                                     config.security, deadline, config.start_timeout_s,
                                     stop_signals)
            server_records = []
            for child, info in zip(server_children, server_ready, strict=True):
                rank = int(info["rank"])
                child.log_path = child.log_path.rename(
                    state.logs_dir(state_dir) / f"server-{rank}.log")
                server_records.append(child.record("server", rank, info))
            cluster = ClusterState(
                name=(f"emulated-{network.cluster_id}" if network is not None
                      else f"local-{secrets.token_hex(3)}"),
                kind="emulated" if network is not None else "local",
                scheduler=address, secret=secret, security=config.security,
                state_dir=str(state_dir), created=time.time(),
                processes=(scheduler.record("scheduler", 0, ready),
                           *sorted(server_records, key=lambda r: r.rank)),
                emulation=_emulation_record(network) if network is not None else None,
                layout=the_layout.to_json() if the_layout is not None else None)
            state.write_state(cluster)
        except BaseException:
            # until the state file names them, nobody else could ever stop these processes
            _stop_children(started)
            raise
        finally:
            for child in started:
                child.ready_path.unlink(missing_ok=True)
        return cluster


def _stop_children(children: list[_Child]) -> None:
    stop_groups([c.identity for c in children], STOP_GRACE_S)
    for child in children:
        child.process.wait()


# --------------------------------------------------------------------------- down

def down(cluster: ClusterState) -> DownReport:
    """Stop the recorded local or emulated cluster (SIGTERM, then SIGKILL) and remove its
    emulated network; the caller holds the state dir's lock. If a process survives SIGKILL the
    state file is kept, so ``down`` can be run again."""
    survivors = {s.pid for s in stop_groups([p.identity for p in cluster.processes],
                                            STOP_GRACE_S)}
    for record in cluster.processes:
        reap_if_child(record.pid)      # ours when `up` ran in this process (bench, tests)
    if not survivors:
        if cluster.emulation is not None:
            emulate.destroy(cluster.emulation["cluster_id"])
        state.forget(cluster.state_dir)
    return dataclasses.replace(down_report(cluster, survivors),
                               removed_segments=remove_shared_memory(cluster))


def remove_shared_memory(cluster: ClusterState) -> tuple[str, ...]:
    """Remove what crashed jobs of ``cluster`` left in this machine's /dev/shm (an intra-node
    stage's arena whose workers died before every one of them had attached, see
    :mod:`bpsctl.engine.shm`; a server's sum buffers or a worker's push slots of the
    worker-server link, see :mod:`bpsctl.engine.shmlink`), found by the cluster's tag in the
    names: its scheduler's port and a hash of its secret."""
    return shm.remove_leftovers(shm.cluster_tag(cluster.scheduler, cluster.secret))


def remove_leftovers(state_dir: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Emulated clusters left by crashed runs: this state dir's claim, and every other one
    :func:`remove_abandoned_clusters` removes. Returns (removed, left alone)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return (), ()
    removed = []
    claim = state.emulation_claim(state_dir)
    if claim.exists():
        cluster_id = claim.read_text().strip()
        emulate.destroy(cluster_id)
        claim.unlink(missing_ok=True)
        removed.append(cluster_id)
    abandoned, busy = remove_abandoned_clusters()
    return (*removed, *abandoned), busy


def remove_abandoned_clusters() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Remove every emulated cluster on this machine whose namespaces have no process left and
    whose builder has exited (one with processes, or still being built, may be someone's live
    cluster). Root only. Returns (removed, left alone)."""
    removed, busy = [], []
    for leftover in emulate.find_leftovers():
        running = (any(emulate.namespace_pids(ns) for ns in leftover.namespaces)
                   or emulate.owner_alive(leftover.cluster_id))
        if running:
            busy.append(leftover.cluster_id)
        else:
            emulate.destroy(leftover.cluster_id)
            removed.append(leftover.cluster_id)
    return tuple(removed), tuple(busy)


# --------------------------------------------------------------------------- status

def _control_address(cluster: ClusterState) -> str:
    path = state.control_socket(cluster.state_dir)
    return f"ipc://{path}" if path.exists() else cluster.scheduler


def status(cluster: ClusterState, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """The recorded cluster's processes, each checked here, merged with the scheduler's view
    (see :func:`bpsctl.launch.report.status_report`)."""
    return local_status(cluster, _control_address(cluster), timeout_s,
                        f"the scheduler (pid {cluster.scheduler_record.pid}) has exited",
                        state.load_supervision(cluster.state_dir))


def scheduler_view(cluster: ClusterState, timeout_s: float = STATUS_TIMEOUT_S
                   ) -> dict[str, Any]:
    """The scheduler's own view of ``cluster``: servers, the running job and its workers
    (see :func:`bpsctl.engine.client.scheduler_status`)."""
    return scheduler_status(_control_address(cluster), cluster.secret, timeout_s,
                            security=cluster.security)


def live_cluster(state_dir: Path) -> ClusterState | None:
    """The cluster recorded in ``state_dir`` if any of its processes still runs."""
    cluster = state.load_state(state_dir)
    if cluster is None or not is_live(cluster):
        return None         # a stale state file: every process of it has exited
    scheduler = cluster.scheduler_record
    if not is_running(scheduler.identity):
        raise LaunchError(f"the scheduler of cluster {cluster.name} (pid {scheduler.pid}) has "
                          f"exited; run `bpsctl down` then `bpsctl up` (state dir {state_dir})")
    return cluster


@contextlib.contextmanager
def local_cluster(config: Config, servers: int = 1, workers: int | None = None
                  ) -> Iterator[ClusterState]:
    """A private cluster in a temporary state dir, always stopped and removed on exit.

    With ``config.emulate`` it is an emulated cluster of ``workers`` worker hosts (root).
    """
    state_dir = Path(tempfile.mkdtemp(prefix="bpsctl-cluster-"))
    try:
        if config.emulate:
            if workers is None:
                raise ConfigError("--workers: an emulated cluster needs the number of worker hosts")
            cluster = up_emulated(config.replace(state_dir=state_dir), workers, servers)
        else:
            cluster = up_local(config.replace(state_dir=state_dir), servers)
        try:
            yield cluster
        finally:
            with state.state_lock(state_dir), stop_signals_recorded():
                down(cluster)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


# --------------------------------------------------------------------------- workers

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def host_command(cluster: ClusterState, address: str) -> list[str]:
    """The prefix that runs a command on the worker host at ``address``: its namespace's
    ``ip netns exec`` on an emulated cluster (and, for a host with a CPU limit, joining its
    cgroup), nothing on the embedded default."""
    for host in (cluster.emulation or {}).get("workers", []):
        if host["address"] == address:
            prefix = emulate.netns_command(host["namespace"], [])
            if host.get("cgroup"):
                # joined before entering the namespace: `ip netns exec` mounts its own /sys
                prefix = emulate.cgroup_command(host["cgroup"]) + prefix
            return prefix
    return []


class _LocalWorker:
    """A worker process group on this machine (or in an emulated host's namespace)."""

    def __init__(self, rank: int, host: str, process: subprocess.Popen,
                 identity: ProcessIdentity, relay: OutputRelay):
        self.rank, self.host, self.pid = rank, host, identity.pid
        self.process, self.identity, self.relay = process, identity, relay
        self._code: int | None = None
        self._signal: str | None = None

    def exit_code(self) -> int | None:
        """The shell-style exit code once it has exited, without reaping it: WNOWAIT leaves
        it a zombie, so its process group ID cannot be reused until we have signalled the
        group (to stop its descendants) and reaped it."""
        if self._code is None:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid != 0:
                if info.si_code == os.CLD_EXITED:
                    self._code = info.si_status
                else:
                    self._code = 128 + info.si_status
                    try:
                        self._signal = signal.Signals(info.si_status).name
                    except ValueError:      # a real-time signal has no name of its own
                        self._signal = f"signal {info.si_status}"
        return self._code

    def signal_name(self) -> str | None:
        return self._signal

    def last_lines(self) -> list[str]:
        return self.relay.last_lines()


class LocalSpawner:
    """Starts workers as process groups here, inside the worker host's namespace on an
    emulated cluster, with output prefixed ``[rank] `` and kept in the state dir's logs."""

    def __init__(self, cluster: ClusterState, cmd: list[str], config: Config, stdout: IO[str],
                 stderr: IO[str]):
        self.cluster, self.cmd, self.config = cluster, cmd, config
        self.stdout, self.stderr = stdout, stderr
        self.watched = [p for p in cluster.processes if is_running(p.identity)]
        self._next_check = 0.0

    def prefix(self, assignment: Assignment) -> tuple[list[str], str]:
        """What runs a command where ``assignment`` lives, and that place's name for messages
        ("" for this machine)."""
        prefix = host_command(self.cluster, assignment.address)
        return prefix, assignment.address if prefix else ""

    def start(self, assignment: Assignment, env: dict[str, str]) -> WorkerProcess:
        prefix, host = self.prefix(assignment)
        argv = [*prefix, *self.cmd]
        try:
            process, identity = start_process(argv, {**os.environ, **env},
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            raise LaunchError(f"cannot start worker {assignment.rank}: {self.cmd[0]}: "
                              f"{exc.strerror}") from None
        assert process.stdout is not None and process.stderr is not None     # PIPE
        relay = OutputRelay(assignment.rank, process.stdout, process.stderr, self.stdout,
                            self.stderr, state.logs_dir(self.config.state_dir)
                            / f"worker-{assignment.rank}.log")
        return _LocalWorker(assignment.rank, host, process, identity, relay)

    def started(self, workers: list[WorkerProcess]) -> None:
        pass

    def lost(self) -> list[ProcessRecord]:
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + _WATCH_INTERVAL_S
        return [p for p in self.watched if not is_running(p.identity)]

    def stop(self, workers: list[WorkerProcess], grace_s: float) -> None:
        local = [w for w in workers if isinstance(w, _LocalWorker)]
        # also stops what exited workers left behind in their process groups
        stop_groups([w.identity for w in local], grace_s)
        for worker in local:
            worker.process.wait()
            worker.relay.close()
