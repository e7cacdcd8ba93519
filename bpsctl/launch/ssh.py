"""Clusters on real hosts over SSH: up, down, status, logs and the workers of a run.

Every host runs the agent :mod:`bpsctl.launch.remote` with the interpreter named by
``python:`` in the hosts file; it starts the scheduler and servers detached, each the leader of
its own process group, with ``<workdir>/<cluster>/<role>-<n>.log`` and ``.pid`` beside it. The
cluster is recorded locally like any other (:mod:`bpsctl.launch.state`, kind ``ssh``). Before
anything starts, :mod:`bpsctl.launch.preflight` checks every host; :mod:`~bpsctl.launch.ship`
installs this bpsctl there on request; :mod:`~bpsctl.launch.transport` carries it all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from bpsctl.config import Config
from bpsctl.engine.security import new_secret
from bpsctl.launch import state
from bpsctl.launch.output import OutputRelay
from bpsctl.launch.plan import Assignment, Plan, plan
from bpsctl.launch.preflight import preflight
from bpsctl.launch.processes import stop_signals_recorded
from bpsctl.launch.report import status_report
from bpsctl.launch.runloop import STOP_GRACE_S, WorkerProcess
from bpsctl.launch.ship import ship
from bpsctl.launch.transport import (
    COMMAND_TIMEOUT_S,
    HostFailure,
    Hosts,
    check_keys,
    parallel,
    remote_argv,
)
from bpsctl.launch.types import (
    KNOWN_HOSTS_FILE,
    ClusterState,
    DownReport,
    HostsSpec,
    LaunchError,
    ProcessRecord,
)

_POLL_INTERVAL_S = 0.05
_WATCH_INTERVAL_S = 5.0         # how often a run asks the hosts whether servers still run
_WATCH_TIMEOUT_S = 5.0


def agent_record(p: ProcessRecord) -> dict[str, Any]:
    """How the agent on ``p.ssh_host`` is told about a process it started."""
    return {"name": f"{p.role} {p.rank} on {p.ssh_host}", "pid": p.pid, "pgid": p.pgid,
            "create_time": p.create_time, "log": p.log_path}


def remote_dir(hosts: HostsSpec, cluster_name: str) -> str:
    return f"{hosts.workdir.rstrip('/')}/{cluster_name}"


def supervision_path(hosts: HostsSpec, cluster_name: str) -> str:
    """The scheduler's supervisor's record on the scheduler's host (see
    bpsctl/engine/supervise.py)."""
    return f"{remote_dir(hosts, cluster_name)}/scheduler.json"


def _hosts_of(cluster: ClusterState) -> HostsSpec:
    assert cluster.hosts is not None, "an SSH cluster records its hosts file"
    return cluster.hosts


# --------------------------------------------------------------------------- up

def up(hosts: HostsSpec | str | Path, config: Config, *, ship_wheel: bool = False,
       progress: Callable[[str], None] | None = None) -> ClusterState:
    """Preflight every host, start the scheduler and servers over SSH, wait until every server
    has registered, and record the cluster in ``config.state_dir``.

    On any failure everything started is stopped again and :class:`LaunchError` (or
    :class:`~bpsctl.launch.preflight.PreflightError`) names the host and the problem.
    """
    if not isinstance(hosts, HostsSpec):
        from bpsctl.launch.hosts import load_hosts  # PyYAML and pydantic: the [ssh] extra
        hosts = load_hosts(hosts)
    state_dir = Path(config.state_dir).resolve()
    # host keys: the hosts file's known_hosts, else the state dir's; recorded with the cluster,
    # so that every later command checks against the same file
    hosts = hosts.with_known_hosts(str(state_dir / KNOWN_HOSTS_FILE))
    check_keys(hosts)
    say = progress or (lambda text: None)
    with state.state_lock(state_dir), stop_signals_recorded() as stop_signals:
        existing = state.load_state(state_dir)
        if existing is not None:
            raise LaunchError(f"cluster {existing.name} (scheduler {existing.scheduler}) is "
                              f"recorded in {state_dir}; run `bpsctl down` first")
        state.rotate_logs(state_dir)
        with Hosts(hosts) as session:
            say(f"connecting to {len(session.targets)} host(s)")
            session.open()
            if ship_wheel and session.connections:
                say("installing this bpsctl on every host (--ship)")
                for host, message in ship(session, list(session.connections),
                                          cache_dir=state_dir / "wheelhouse",
                                          progress=say).items():
                    session.failures[host] = message
                    session.connections.pop(host).close()
            say("preflight checks")
            addresses = preflight(session, hosts)
            stop_signals.check()
            name = f"ssh-{secrets.token_hex(3)}"
            # the secret (and so the CURVE keys derived from it) reaches each process only
            # inside the JSON the agent reads on stdin, and lives in its environment
            cluster_plan = plan(hosts, config, secret=new_secret(), job_id=name,
                                addresses=addresses)
            started: list[ProcessRecord] = []
            try:
                say(f"starting the scheduler and {len(cluster_plan.servers)} server(s)")
                # spares once the others have registered: the scheduler ranks servers in the
                # order they register, so spares come last
                regular = tuple(a for a in cluster_plan.servers if not a.entry.spare)
                started = _start_roles(session, hosts, config, cluster_plan, name, regular)
                stop_signals.check()
                ranks = _wait_registered(session, cluster_plan, started, config, len(regular))
                spares = tuple(a for a in cluster_plan.servers if a.entry.spare)
                if spares:
                    started += _start_roles(session, hosts, config, cluster_plan, name, spares,
                                            scheduler=False)
                    stop_signals.check()
                    ranks = _wait_registered(session, cluster_plan, started, config,
                                             len(cluster_plan.servers))
                processes = tuple(dataclasses.replace(p, rank=ranks.get((p.host, p.port), p.rank))
                                  for p in started)
                cluster = ClusterState(name=name, kind="ssh",
                                       scheduler=cluster_plan.scheduler_address,
                                       secret=cluster_plan.secret, security=config.security,
                                       state_dir=str(state_dir), hosts=hosts,
                                       addresses=addresses, processes=processes,
                                       created=time.time(),
                                       layout=cluster_plan.layout.to_json()
                                       if cluster_plan.layout else None)
                state.write_state(cluster)
            except BaseException:
                _stop_processes(session, started, cluster_plan.secret)
                raise
        return cluster


def _start_roles(session: Hosts, hosts: HostsSpec, config: Config, cluster_plan: Plan,
                 name: str, servers: tuple[Assignment, ...], scheduler: bool = True
                 ) -> list[ProcessRecord]:
    """Start the scheduler (unless told not to), then ``servers``, over SSH."""
    directory = remote_dir(hosts, name)
    started: list[ProcessRecord] = []
    lock = threading.Lock()

    def start(a: Assignment) -> ProcessRecord:
        # the scheduler under its supervisor, which restarts it (bpsctl/engine/supervise.py)
        module = ["bpsctl.engine.supervise", "--record", supervision_path(hosts, name)] \
            if a.role == "scheduler" else [f"bpsctl.engine.{a.role}"]
        spec = {"argv": [hosts.python, "-m", *module],
                "env": a.to_env(config, cluster_plan),
                "log": f"{directory}/{a.name}.log"}
        answer = session.agent(a.host, "start", spec)
        process = ProcessRecord(role=a.role, rank=a.rank, host=a.address,
                                port=int(a.port or 0), pid=int(answer["pid"]),
                                pgid=int(answer["pgid"]),
                                create_time=float(answer["create_time"]),
                                log_path=answer["log"], ssh_host=a.host)
        with lock:
            started.append(process)
        return process

    # the scheduler first, so servers find it listening
    if scheduler:
        ok, value = parallel([cluster_plan.scheduler.host],
                             lambda _: start(cluster_plan.scheduler))[cluster_plan.scheduler.host]
        if not ok:
            raise LaunchError(f"cannot start the scheduler on {cluster_plan.scheduler.host}: "
                              f"{value}")
    by_host: dict[str, list[Assignment]] = {}
    for s in servers:
        by_host.setdefault(s.host, []).append(s)
    failures = {}
    for host, (ok, value) in parallel(list(by_host),
                                      lambda h: [start(a) for a in by_host[h]]).items():
        if not ok:
            failures[host] = value
    if failures:
        raise LaunchError("cannot start servers: " + "; ".join(f"{h}: {m}"
                                                                for h, m in failures.items()))
    order = {a.name: i for i, a in enumerate(cluster_plan.assignments)}
    return sorted(started, key=lambda p: order[f"{p.role}-{p.rank}"])


def _wait_registered(session: Hosts, cluster_plan: Plan, started: list[ProcessRecord],
                     config: Config, servers: int) -> dict[tuple[str, int | None], int]:
    """Wait on the scheduler's host until ``servers`` servers registered; (address, port) ->
    rank."""
    scheduler = cluster_plan.scheduler
    watch = [agent_record(p) for p in started if p.ssh_host == scheduler.host]
    answer = session.agent(scheduler.host, "scheduler", {
        "address": cluster_plan.scheduler_address, "security": config.security,
        "secret": cluster_plan.secret, "servers": servers,
        "timeout_s": config.start_timeout_s, "watch": watch},
        timeout_s=config.start_timeout_s + COMMAND_TIMEOUT_S)
    if "view" in answer:
        return {(s["host"], int(s["port"])): int(s["rank"]) for s in answer["view"]["servers"]}
    # say which process is missing, with the end of its log
    exited = _exited_processes(session, started)
    if exited:
        process, tail = exited[0]
        raise LaunchError(f"{process.role} (pid {process.pid}) on {process.ssh_host} exited "
                          f"while starting; last lines of {process.log_path}:\n"
                          f"{state.indent(tail)}")
    if answer.get("exited"):
        raise LaunchError(f"{answer['error']}; last lines of its log:\n"
                          f"{state.indent(answer.get('log_tail', ''))}")
    raise LaunchError(f"the cluster did not come up within {config.start_timeout_s:g} s: "
                      f"{answer.get('error')} (raise --start-timeout / BPSCTL_START_TIMEOUT if "
                      "the hosts are slow)")


def _exited_processes(session: Hosts, processes: Sequence[ProcessRecord]
                      ) -> list[tuple[ProcessRecord, str]]:
    states = _process_states(session, processes)
    exited = []
    for process in processes:
        if states.get(process) is False:
            tail = ""
            with contextlib.suppress(Exception):
                conn = session.connections[process.ssh_host]
                tail = conn.run(remote_argv(["tail", "-n", "15", process.log_path]), hide=True,
                                warn=True, timeout=10).stdout
            exited.append((process, tail))
    return exited


def _by_host(processes: Sequence[ProcessRecord]) -> dict[str, list[ProcessRecord]]:
    by_host: dict[str, list[ProcessRecord]] = {}
    for p in processes:
        by_host.setdefault(p.ssh_host, []).append(p)
    return by_host


def _process_states(session: Hosts, processes: Sequence[ProcessRecord],
                    timeout_s: float = COMMAND_TIMEOUT_S) -> dict[ProcessRecord, bool | None]:
    """Whether each recorded process still runs (None: its host could not be asked)."""
    by_host = _by_host(processes)
    reachable = [h for h in by_host if h in session.connections]
    states: dict[ProcessRecord, bool | None] = {p: None for p in processes}
    results = parallel(reachable, lambda h: session.agent(
        h, "ps", {"records": [agent_record(p) for p in by_host[h]]}, timeout_s=timeout_s))
    for host, (ok, value) in results.items():
        if ok:
            for p, running in zip(by_host[host], value["running"], strict=False):
                states[p] = bool(running)
    return states


def _stop_processes(session: Hosts, processes: Sequence[ProcessRecord],
                    secret: str) -> tuple[list[ProcessRecord], list[str]]:
    """Stop ``processes`` (and anything else with the cluster's secret) on every host that has
    any; returns (stopped, problems)."""
    by_host = _by_host(processes)
    for host in session.spec.ssh_hosts():
        by_host.setdefault(host, [])
    problems: list[str] = []
    stopped: list[ProcessRecord] = []
    reachable = [h for h in by_host if h in session.connections]
    for host in by_host:
        if host not in session.connections and by_host[host]:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in by_host[host])
            problems.append(f"{names} on {host}: host unreachable "
                            f"({session.failures.get(host, 'not connected')})")
    results = parallel(reachable, lambda h: session.agent(
        h, "stop", {"records": [agent_record(p) for p in by_host[h]], "secret": secret,
                    "grace_s": STOP_GRACE_S}, timeout_s=4 * STOP_GRACE_S + COMMAND_TIMEOUT_S))
    for host, (ok, value) in results.items():
        if not ok:
            problems.append(f"{host}: could not stop its processes: {value}")
            continue
        survivors = set(value.get("survivors", []))
        for p in by_host[host]:
            if p.pid in survivors:
                problems.append(f"{p.name} (pid {p.pid}) on {host} survived SIGKILL")
            else:
                stopped.append(p)
        if value.get("stray"):
            problems.append(f"{host}: processes {value['stray']} of this cluster are still "
                            "running")
    return stopped, problems


# --------------------------------------------------------------------------- down

def down(cluster: ClusterState) -> DownReport:
    """Stop everything the SSH cluster started on every host, verify nothing of it is left,
    and forget it (the caller holds the state dir's lock). The state file stays while anything
    survives, so ``down`` can be run again."""
    with Hosts(_hosts_of(cluster)) as session:
        session.open()
        stopped, problems = _stop_processes(session, cluster.processes, cluster.secret)
    if not problems:
        state.forget(cluster.state_dir)
    return DownReport(cluster=cluster.name, stopped=tuple(stopped), survivors=tuple(problems))


# --------------------------------------------------------------------------- status / logs

def status(cluster: ClusterState) -> dict[str, Any]:
    """The SSH cluster's processes, checked on their hosts, merged with the scheduler's view
    (asked on its host; see :func:`bpsctl.launch.report.status_report`)."""
    scheduler = cluster.scheduler_record
    with Hosts(_hosts_of(cluster), targets=list(_by_host(cluster.processes))) as session:
        session.open()
        running = _process_states(session, cluster.processes)
        view, scheduler_error, supervision = None, None, None
        if scheduler.ssh_host not in session.connections:
            scheduler_error = (f"cannot reach the scheduler's host {scheduler.ssh_host}: "
                               f"{session.failures.get(scheduler.ssh_host)}")
        elif running.get(scheduler) is False:
            scheduler_error = (f"the scheduler (pid {scheduler.pid}) on {scheduler.ssh_host} "
                               "has exited")
        else:
            try:
                answer = session.agent(scheduler.ssh_host, "scheduler", {
                    "address": cluster.scheduler, "secret": cluster.secret,
                    "security": cluster.security, "servers": 0, "timeout_s": 2.0,
                    "record": supervision_path(_hosts_of(cluster), cluster.name)})
                view = answer.get("view")
                scheduler_error = answer.get("error")
                supervision = answer.get("supervision")
            except HostFailure as exc:
                scheduler_error = str(exc)
    return status_report(cluster, running, view, scheduler_error, supervision)


def fetch_logs(cluster: ClusterState, role: str | None = None) -> None:
    """Copy the scheduler's and servers' logs (of ``role``) from their hosts into the state
    dir's logs, beside the last run's worker logs."""
    wanted_role, wanted_rank = state.parse_log_role(role)
    wanted = [p for p in cluster.processes
              if wanted_role in (None, p.role) and wanted_rank in (None, p.rank)]
    directory = state.logs_dir(cluster.state_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with Hosts(_hosts_of(cluster), targets=list(_by_host(wanted))) as session:
        session.open()
        problems = [f"{h}: {m}" for h, m in session.failures.items()]

        def fetch(host: str) -> None:
            for p in wanted:
                if p.ssh_host == host:
                    # cat, not SFTP: hosts without an sftp subsystem work too
                    text = session.connections[host].run(
                        remote_argv(["cat", p.log_path]), hide=True, warn=True,
                        timeout=COMMAND_TIMEOUT_S)
                    if text.exited != 0:
                        raise HostFailure(f"cannot read {p.log_path}: "
                                          f"{text.stderr.strip()[-200:]}")
                    (directory / f"{p.role}-{p.rank}.log").write_text(text.stdout)

        for host, (ok, value) in parallel(list(session.connections), fetch).items():
            if not ok:
                problems.append(f"{host}: cannot fetch logs: {value}")
    if problems:
        raise LaunchError("; ".join(problems))


# --------------------------------------------------------------------------- workers

def worker_plan(cluster: ClusterState, config: Config, job_id: str) -> Plan:
    """Every worker slot of the hosts file, with the cluster's addresses, for one job."""
    the_plan = plan(_hosts_of(cluster), config, secret=cluster.secret, job_id=job_id,
                    addresses=cluster.addresses)
    return dataclasses.replace(the_plan, workdir=remote_dir(_hosts_of(cluster), cluster.name))


class _RemoteWorker:
    """A worker the agent on its host runs; its stdin is the SSH channel (closing it stops
    the worker), its output comes back over the channel."""

    def __init__(self, assignment: Assignment, channel: Any):
        self.rank, self.host, self.pid = assignment.rank, assignment.host, 0
        self.channel = channel
        self.relay: OutputRelay | None = None
        self.start_error = ""
        self._code: int | None = None

    def exit_code(self) -> int | None:
        if self._code is None and self.channel.exit_status_ready():
            self._code = self.channel.recv_exit_status()
        return self._code

    def signal_name(self) -> str | None:
        code = self._code or 0
        if code > 128:
            with contextlib.suppress(ValueError):
                return signal.Signals(code - 128).name
        return None

    def last_lines(self) -> list[str]:
        lines = self.relay.last_lines() if self.relay is not None else []
        return [self.start_error, *lines] if self.start_error else lines


class SshSpawner:
    """Starts each worker through the agent on its host (``exec``), output prefixed
    ``[host:rank] ``; watches the cluster's processes on their hosts every few seconds."""

    def __init__(self, cluster: ClusterState, cmd: list[str], config: Config, stdout: IO[str],
                 stderr: IO[str]):
        self.cluster, self.cmd, self.config = cluster, cmd, config
        self.stdout, self.stderr = stdout, stderr
        self.directory = state.logs_dir(cluster.state_dir)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.session: Hosts | None = None
        self._next_check = time.monotonic() + _WATCH_INTERVAL_S

    def __enter__(self) -> SshSpawner:
        hosts = _hosts_of(self.cluster)
        targets = [*dict.fromkeys(w.host for w in hosts.workers),
                   *_by_host(self.cluster.processes)]
        self.session = Hosts(hosts, targets=list(dict.fromkeys(targets)))
        failures = self.session.open()
        if failures:
            self.session.close()
            raise LaunchError("cannot start workers: " + "; ".join(
                f"{h}: {m}" for h, m in failures.items()))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.session is not None:
            self.session.close()

    def start(self, assignment: Assignment, env: dict[str, str]) -> WorkerProcess:
        assert self.session is not None, "use SshSpawner as a context manager"
        channel = self.session.open_channel(assignment.host, "exec")
        worker = _RemoteWorker(assignment, channel)
        spec = {"argv": self.cmd, "env": env, "cwd": os.getcwd(), "grace_s": STOP_GRACE_S}
        channel.sendall((json.dumps(spec) + "\n").encode())
        return worker

    def started(self, workers: list[WorkerProcess]) -> None:
        for worker in workers:
            assert isinstance(worker, _RemoteWorker)
            self._attach(worker)

    def _attach(self, worker: _RemoteWorker) -> None:
        """Read the agent's first line (the worker's pid, or why it could not start), then
        relay the rest of its output."""
        out = worker.channel.makefile("rb")
        worker.channel.settimeout(COMMAND_TIMEOUT_S)
        header = out.readline()
        worker.channel.settimeout(None)
        try:
            info = json.loads(header)
        except ValueError:
            info = {}
        if "pid" in info:
            worker.pid = int(info["pid"])
        else:
            worker.start_error = info.get("error") or header.decode(errors="replace").strip()
        worker.relay = OutputRelay(worker.rank, out, worker.channel.makefile_stderr("rb"),
                                   self.stdout, self.stderr,
                                   self.directory / f"worker-{worker.rank}.log",
                                   prefix=f"[{worker.host}:{worker.rank}] ")

    def lost(self) -> list[ProcessRecord]:
        now = time.monotonic()
        if now < self._next_check or self.session is None:
            return []
        running = _process_states(self.session, self.cluster.processes, _WATCH_TIMEOUT_S)
        self._next_check = time.monotonic() + _WATCH_INTERVAL_S
        return [p for p in self.cluster.processes if running.get(p) is False]

    def stop(self, workers: list[WorkerProcess], grace_s: float) -> None:
        remote = [w for w in workers if isinstance(w, _RemoteWorker)]
        for worker in remote:
            with contextlib.suppress(Exception):
                worker.channel.shutdown_write()     # the agent stops its worker
        deadline = time.monotonic() + 3 * grace_s
        for worker in remote:
            while not worker.channel.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(_POLL_INTERVAL_S)
            worker.exit_code()
            if worker.relay is not None:
                worker.relay.close()
            worker.channel.close()
