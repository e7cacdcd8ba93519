"""The embedded local cluster: types, and the functions the CLI, ``bench`` and tests call.

A cluster is one scheduler and K servers, each a process group of its own on this machine,
recorded in ``<state_dir>/cluster.json`` (mode 0600: it holds the cluster's secret). Their
output goes to ``<state_dir>/logs/<role>-<rank>.log``. Workers are the user's command, started
by :func:`run_local` for one job and always stopped and waited for before it returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
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
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from bpsctl.config import DEFAULT_SECURITY, Config, ConfigError
from bpsctl.errors import BpsctlError
from bpsctl.launch.output import OutputRelay
from bpsctl.launch.processes import (Interrupted, ProcessIdentity, StopSignals, is_running,
                                     pid_running, reap_if_child, start_process, stop_groups,
                                     stop_signals_recorded)

STATE_FILE_NAME = "cluster.json"
STOP_GRACE_S = 5.0              # SIGTERM -> SIGKILL, for cluster processes and workers
STATUS_TIMEOUT_S = 2.0          # how long `status` waits for the scheduler's answer
_WATCH_INTERVAL_S = 0.2         # how often `run` checks that the cluster's processes still run
_POLL_INTERVAL_S = 0.02
_LOG_TAIL_LINES = 15
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the directory that holds bpsctl/


class LaunchError(BpsctlError, RuntimeError):
    """Starting, using or stopping a cluster failed; the message names the process and the fix."""


# --------------------------------------------------------------------------- types

@dataclass(frozen=True)
class ProcessRecord:
    """One scheduler or server process as ``bpsctl up`` recorded it."""

    role: str                   # scheduler | server
    rank: int
    host: str
    port: int | None
    pid: int
    create_time: float          # psutil's, to tell our process from a later one with its PID
    pgid: int
    log_path: str

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(pid=self.pid, pgid=self.pgid, create_time=self.create_time)

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"


@dataclass(frozen=True)
class ClusterState:
    """What ``<state_dir>/cluster.json`` records about a running cluster."""

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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClusterState":
        processes = tuple(ProcessRecord(**p) for p in data["processes"])
        return cls(**{**data, "processes": processes})


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


@dataclass(frozen=True)
class DownReport:
    """What ``down`` did: ``cluster`` is None when there was nothing to stop."""

    cluster: str | None
    stopped: tuple[ProcessRecord, ...] = ()
    survivors: tuple[ProcessRecord, ...] = ()
    # emulated clusters of crashed runs: removed, or left alone because processes still run there
    removed_leftovers: tuple[str, ...] = ()
    busy_leftovers: tuple[str, ...] = ()


# --------------------------------------------------------------------------- state file

def state_file(state_dir: Path | str) -> Path:
    return Path(state_dir) / STATE_FILE_NAME


def logs_dir(state_dir: Path | str) -> Path:
    return Path(state_dir) / "logs"


def control_socket(state_dir: Path | str) -> Path:
    """The scheduler's socket file: reachable from this machine whatever network namespace
    the scheduler runs in (its TCP address may exist only inside an emulated host)."""
    return Path(state_dir) / "scheduler.sock"


def _control_address(cluster: ClusterState) -> str:
    path = control_socket(cluster.state_dir)
    return f"ipc://{path}" if path.exists() else cluster.scheduler


def load_state(state_dir: Path | str) -> ClusterState | None:
    """The cluster recorded in ``state_dir``, or None if there is none."""
    path = state_file(state_dir)
    try:
        return ClusterState.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise LaunchError(f"{path} is not a bpsctl cluster state file ({exc}); check that no "
                          "bpsctl scheduler or server is left running, then delete it") from None


def write_private_json(path: Path, data: Any) -> None:
    """Atomically write JSON readable only by its owner (a cluster's state holds its secret)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=2)
    os.replace(tmp, path)


def _write_state(cluster: ClusterState) -> None:
    write_private_json(state_file(cluster.state_dir), cluster.to_json())


def _make_state_dir(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    logs_dir(state_dir).mkdir(mode=0o700, exist_ok=True)


@contextlib.contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    """Serialises `up` and `down` on one state dir (two `bpsctl up` at once start one cluster)."""
    _make_state_dir(state_dir)
    with open(state_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _is_live(cluster: ClusterState) -> bool:
    return any(is_running(p.identity) for p in cluster.processes)


# --------------------------------------------------------------------------- children

def _child_env(config: Config, extra: dict[str, str] | None = None) -> dict[str, str]:
    # Children inherit our environment (PATH, virtualenv, ...) but every BPSCTL_* knob comes
    # from ``config``.
    return {**os.environ, **config.to_env(), **(extra or {})}


def _log_tail(path: Path | str, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 16384))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    tail = text.splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in tail) if tail else "    (log is empty)"


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
                           f"{self.log_path}:\n{_log_tail(self.log_path)}")


def _start_child(role: str, index: int, config: Config, state_dir: Path,
                 prefix: tuple[str, ...] = ()) -> _Child:
    # A server learns its rank when it registers; until then its log is named by start order.
    stem = "scheduler-0" if role == "scheduler" else f"{role}-starting-{index}"
    ready_path = state_dir / f"{stem}.ready"
    ready_path.unlink(missing_ok=True)
    log_path = logs_dir(state_dir) / f"{stem}.log"
    env = _child_env(config.replace(ready_file=str(ready_path)))
    # Run from the directory holding bpsctl/, so that `python -m` imports the very bpsctl this
    # launcher runs, installed or not.
    # ``prefix`` places the process elsewhere, e.g. in an emulated host's network namespace.
    process, identity = start_process([*prefix, sys.executable, "-m", f"bpsctl.engine.{role}"], env,
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
    from bpsctl.engine import EngineError
    from bpsctl.engine.client import scheduler_status

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
            registered = sum(1 for s in view["servers"] if s["state"] == "running")
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


def _rotate_logs(state_dir: Path) -> None:
    # The previous cluster's logs stay readable (logs.previous/) until the next `up`.
    current, previous = logs_dir(state_dir), state_dir / "logs.previous"
    if current.exists() and any(current.iterdir()):
        shutil.rmtree(previous, ignore_errors=True)
        current.rename(previous)
    current.mkdir(mode=0o700, exist_ok=True)


# --------------------------------------------------------------------------- up / down

def up_local(config: Config, servers: int) -> ClusterState:
    """Start a scheduler and ``servers`` servers on this machine, recorded in ``config.state_dir``.

    Returns once the scheduler reports every server registered. On any failure everything
    started is stopped and :class:`LaunchError` names the process and quotes its log.
    """
    return _up(config, servers, network=None)


def up_emulated(config: Config, workers: int, servers: int) -> ClusterState:
    """Build an emulated cluster on this machine (root): ``workers`` worker hosts and ``servers``
    server hosts, each a network namespace with a NIC shaped to ``config.nic`` (see
    launch/emulate.py), then start the scheduler (beside the first server) and one server per
    server host. Workers of later runs go to the worker hosts. On any failure, everything built
    or started is removed again.
    """
    from bpsctl.launch import emulate

    plan = emulate.plan_network(workers, servers, config.nic or None)   # checks the flags
    emulate.check_prerequisites()
    state_dir = Path(config.state_dir).resolve()
    existing = load_state(state_dir)
    if existing is not None and _is_live(existing):
        raise LaunchError(f"cluster {existing.name} (scheduler {existing.scheduler}) is already "
                          f"running from {state_dir}; run `bpsctl down` first")
    # claimed before it exists: if this process dies mid-way, `bpsctl down` knows what to remove
    _make_state_dir(state_dir)
    claim = _emulation_claim(state_dir)
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


def _emulation_claim(state_dir: Path) -> Path:
    return Path(state_dir) / "emulation.claim"


def _remove_leftovers(state_dir: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Emulated clusters left by crashed runs: this state dir's claim, and any other whose
    namespaces have no process left and whose builder has exited (one with processes, or
    still being built, may be someone's live cluster)."""
    from bpsctl.launch import emulate
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return (), ()
    removed, busy = [], []
    claim = _emulation_claim(state_dir)
    if claim.exists():
        cluster_id = claim.read_text().strip()
        emulate.destroy(cluster_id)
        claim.unlink(missing_ok=True)
        removed.append(cluster_id)
    for leftover in emulate.find_leftovers():
        running = (any(emulate.namespace_pids(ns) for ns in leftover.namespaces)
                   or emulate.owner_alive(leftover.cluster_id))
        if running:
            busy.append(leftover.cluster_id)
        else:
            emulate.destroy(leftover.cluster_id)
            removed.append(leftover.cluster_id)
    return tuple(removed), tuple(busy)


def _emulation_record(network: Any) -> dict[str, Any]:
    def hosts(role: str) -> list[dict[str, Any]]:
        return [{"name": h.name, "namespace": h.namespace, "address": h.address,
                 "interface": h.interface} for h in network.hosts if h.role == role]
    return {"cluster_id": network.cluster_id, "nic_mbit": network.plan.nic_mbit,
            "workers": hosts("worker"), "servers": hosts("server")}


def _up(config: Config, servers: int, network: Any) -> ClusterState:
    if servers < 1:
        raise ConfigError(f"--servers: expected at least 1, got {servers}")
    # absolute: children run elsewhere, and the state file must name the same place for everyone
    state_dir = Path(config.state_dir).resolve()
    config = config.replace(state_dir=state_dir)
    with _state_lock(state_dir), stop_signals_recorded() as stop_signals:
        existing = load_state(state_dir)
        if existing is not None:
            if _is_live(existing):
                raise LaunchError(f"cluster {existing.name} (scheduler {existing.scheduler}) is "
                                  f"already running from {state_dir}; run `bpsctl down` first")
            state_file(state_dir).unlink()      # every process of it has exited: stale
        _rotate_logs(state_dir)
        from bpsctl.engine.security import new_secret
        secret = new_secret()
        deadline = time.monotonic() + config.start_timeout_s
        started: list[_Child] = []
        try:
            scheduler_config = config.replace(role="scheduler", secret=secret,
                                              control_socket=str(control_socket(state_dir)))
            scheduler_prefix: tuple[str, ...] = ()
            if network is not None:
                host = network.plan.scheduler_host
                scheduler_config = scheduler_config.replace(host=host.address)
                scheduler_prefix = tuple(network.command(host.name, []))
            scheduler = _start_child("scheduler", 0, scheduler_config, state_dir, scheduler_prefix)
            started.append(scheduler)
            ready = _wait_ready(scheduler, deadline, config.start_timeout_s, stop_signals)
            address = f"{ready['host']}:{ready['port']}"
            server_config = config.replace(role="server", scheduler=address, secret=secret, port=0)
            server_children = []
            for i in range(servers):
                if network is None:
                    server_children.append(_start_child("server", i, server_config, state_dir))
                else:
                    host = network.plan.servers[i]
                    server_children.append(_start_child(
                        "server", i, server_config.replace(host=host.address), state_dir,
                        tuple(network.command(host.name, []))))
            started.extend(server_children)
            server_ready = [_wait_ready(c, deadline, config.start_timeout_s, stop_signals)
                            for c in server_children]
            _wait_servers_registered(scheduler, server_children,
                                     f"ipc://{control_socket(state_dir)}", secret,
                                     config.security, deadline, config.start_timeout_s,
                                     stop_signals)
            server_records = []
            for child, info in zip(server_children, server_ready):
                rank = int(info["rank"])
                child.log_path = child.log_path.rename(logs_dir(state_dir) / f"server-{rank}.log")
                server_records.append(_record(child, "server", rank, info))
            cluster = ClusterState(
                name=(f"emulated-{network.cluster_id}" if network is not None
                      else f"local-{secrets.token_hex(3)}"),
                scheduler=address, secret=secret, security=config.security,
                state_dir=str(state_dir), created=time.time(),
                processes=(_record(scheduler, "scheduler", 0, ready),
                           *sorted(server_records, key=lambda r: r.rank)),
                emulation=_emulation_record(network) if network is not None else None)
            _write_state(cluster)
        except BaseException:
            # until the state file names them, nobody else could ever stop these processes
            _stop_children(started)
            raise
        finally:
            for child in started:
                child.ready_path.unlink(missing_ok=True)
        return cluster


def _record(child: _Child, role: str, rank: int, ready: dict[str, Any]) -> ProcessRecord:
    return ProcessRecord(role=role, rank=rank, host=str(ready["host"]), port=int(ready["port"]),
                         pid=child.identity.pid, create_time=child.identity.create_time,
                         pgid=child.identity.pgid, log_path=str(child.log_path))


def _stop_children(children: list[_Child]) -> None:
    stop_groups([c.identity for c in children], STOP_GRACE_S)
    for child in children:
        child.process.wait()


def down(state_dir: Path | str) -> DownReport:
    """Stop the cluster recorded in ``state_dir`` (SIGTERM, then SIGKILL) and forget it.

    Logs are kept. With no cluster recorded there is nothing to do. If a process survives
    SIGKILL the state file is kept, so ``down`` can be run again.
    """
    state_dir = Path(state_dir)
    if not state_file(state_dir).exists():
        removed, busy = _remove_leftovers(state_dir)
        return DownReport(cluster=None, removed_leftovers=removed, busy_leftovers=busy)
    # Ctrl-C is recorded and ignored: stopping half the cluster would help nobody.
    with _state_lock(state_dir), stop_signals_recorded():
        cluster = load_state(state_dir)
        if cluster is None:
            return DownReport(cluster=None)
        survivors = stop_groups([p.identity for p in cluster.processes], STOP_GRACE_S)
        for record in cluster.processes:
            reap_if_child(record.pid)      # ours when `up` ran in this process (bench, tests)
        surviving_pids = {s.pid for s in survivors}
        if not surviving_pids:
            if cluster.emulation is not None:
                from bpsctl.launch import emulate
                emulate.destroy(cluster.emulation["cluster_id"])
            state_file(state_dir).unlink(missing_ok=True)
        return DownReport(
            cluster=cluster.name,
            stopped=tuple(p for p in cluster.processes if p.pid not in surviving_pids),
            survivors=tuple(p for p in cluster.processes if p.pid in surviving_pids))


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
            down(state_dir)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


# --------------------------------------------------------------------------- status / logs

def status(state_dir: Path | str, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """The cluster as JSON: ``{"cluster", "scheduler", "processes": [{"role", "rank", "host",
    "port", "pid", "state"}], "job", "scheduler_error"}``; state is running, lost or exited.

    Merges the state file, whether each recorded process still runs, and the scheduler's view
    (which marks silent servers lost and knows the workers of a running job).
    """
    cluster = load_state(state_dir)
    if cluster is None:
        return {"cluster": None, "scheduler": None, "state_dir": str(state_dir), "processes": [],
                "job": None, "scheduler_error": None}
    view, scheduler_error = None, None
    scheduler_record = next(p for p in cluster.processes if p.role == "scheduler")
    if is_running(scheduler_record.identity):
        from bpsctl.engine import EngineError
        from bpsctl.engine.client import scheduler_status
        try:
            view = scheduler_status(_control_address(cluster), cluster.secret, timeout_s=timeout_s,
                                    security=cluster.security)
        except EngineError as exc:
            scheduler_error = str(exc)
    else:
        scheduler_error = f"the scheduler (pid {scheduler_record.pid}) has exited"
    seen_servers = {s["rank"]: s for s in view["servers"]} if view else {}
    processes = []
    for record in cluster.processes:
        state = "running" if is_running(record.identity) else "exited"
        seen = seen_servers.pop(record.rank, None) if record.role == "server" else None
        if state == "running" and seen is not None and seen["state"] != "running":
            state = "lost"
        processes.append({"role": record.role, "rank": record.rank, "host": record.host,
                          "port": record.port, "pid": record.pid, "state": state})
    # members the scheduler knows that `up` did not start: the workers of a job, and servers
    # some other launcher started
    unrecorded = [("server", member) for member in seen_servers.values()]
    unrecorded += [("worker", member) for member in (view["workers"] if view else [])]
    for role, member in unrecorded:
        state = {"running": "running", "lost": "lost"}.get(member["state"], "exited")
        if state == "running" and _is_local(member["host"]) and not pid_running(member["pid"]):
            state = "exited"
        processes.append({"role": role, "rank": member["rank"], "host": member["host"],
                          "port": member["port"], "pid": member["pid"], "state": state})
    return {"cluster": cluster.name, "scheduler": cluster.scheduler, "state_dir": str(state_dir),
            "created": cluster.created, "processes": processes,
            "job": view["job"] if view else None, "scheduler_error": scheduler_error}


def _is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", socket.gethostname())


LOG_ROLES = ("scheduler", "server", "worker")


def parse_log_role(text: str | None) -> tuple[str | None, int | None]:
    """``"server:1"`` -> ("server", 1); ``"worker"`` -> ("worker", None); None -> (None, None)."""
    if text is None:
        return None, None
    role, sep, rank = text.partition(":")
    if role not in LOG_ROLES or (sep and not rank.isdigit()):
        raise ConfigError(f"ROLE: expected scheduler, server, server:N, worker or worker:N, "
                          f"got {text!r}")
    return role, int(rank) if sep else None


def log_files(state_dir: Path | str, role: str | None = None) -> list[Path]:
    """The log files of ``role`` (``"server:1"``, ``"worker"``, None for all), in rank order."""
    wanted_role, wanted_rank = parse_log_role(role)
    directory = logs_dir(state_dir)
    found = []
    for each_role in LOG_ROLES:
        if wanted_role not in (None, each_role):
            continue
        for path in directory.glob(f"{each_role}-*.log"):
            rank = path.stem.rpartition("-")[2]
            if rank.isdigit() and wanted_rank in (None, int(rank)):
                found.append((LOG_ROLES.index(each_role), int(rank), path))
    return [path for _, _, path in sorted(found)]


def logs(state_dir: Path | str, role: str | None = None) -> str:
    """The logs of ``role`` (scheduler | server | server:N | worker | worker:N | None for all).

    Several files are each headed by ``==> path <==``, as ``tail`` does.
    """
    paths = log_files(state_dir, role)
    if not paths:
        raise LaunchError(f"no {role or 'bpsctl'} logs in {logs_dir(state_dir)} "
                          "(`bpsctl up` and `bpsctl run` write them there)")
    if len(paths) == 1:
        return paths[0].read_text(errors="replace")
    return "".join(f"==> {path} <==\n{path.read_text(errors='replace')}\n" for path in paths)


# --------------------------------------------------------------------------- run

def run_local(cmd: list[str], np: int, config: Config, servers: int = 1,
              stdout: IO[str] | None = None, stderr: IO[str] | None = None,
              stop_grace_s: float = STOP_GRACE_S) -> RunResult:
    """Run ``np`` workers of ``cmd`` on the cluster in ``config.state_dir``, or on a private one
    with ``servers`` servers if none is up; stream their output prefixed with ``[rank] ``.

    When the first worker fails, the others are stopped and its exit code is returned; Ctrl-C
    or SIGTERM stops every worker. Every worker has been waited for when this returns.
    """
    if np < 1:
        raise ConfigError(f"-np: expected at least 1 worker, got {np}")
    if not cmd:
        raise ConfigError("CMD: expected the command to run after `--`, e.g. "
                          "`bpsctl run -np 2 -- python train.py`")
    if shutil.which(cmd[0]) is None:
        raise LaunchError(f"cannot run {cmd[0]!r}: no such executable (in PATH)")
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    state_dir = Path(config.state_dir)
    _make_state_dir(state_dir)
    with stop_signals_recorded() as stop_signals:
        try:
            cluster = _live_cluster(state_dir)
            if cluster is not None:
                return _run_workers(cluster, cmd, np, config, stdout, stderr, stop_grace_s,
                                    stop_signals)
            with local_cluster(config, servers) as cluster:
                return _run_workers(cluster, cmd, np, config, stdout, stderr, stop_grace_s,
                                    stop_signals)
        except Interrupted as interrupted:
            return RunResult(exit_code=128 + interrupted.signum)


def _live_cluster(state_dir: Path) -> ClusterState | None:
    cluster = load_state(state_dir)
    if cluster is None or not _is_live(cluster):
        return None         # a stale state file: every process of it has exited
    scheduler = next(p for p in cluster.processes if p.role == "scheduler")
    if not is_running(scheduler.identity):
        raise LaunchError(f"the scheduler of cluster {cluster.name} (pid {scheduler.pid}) has "
                          f"exited; run `bpsctl down` then `bpsctl up` (state dir {state_dir})")
    return cluster


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class _Worker:
    rank: int
    host: str
    process: subprocess.Popen
    identity: ProcessIdentity
    relay: OutputRelay
    # seen before we stopped anyone, so the worker's own doing
    exit_code: int | None = None
    signal_name: str | None = None


def _check_exit(worker: _Worker) -> None:
    """Note the shell-style exit code of a worker that has exited, without reaping it.

    WNOWAIT leaves it a zombie, so its process group ID cannot be reused until we have
    signalled the group (to stop its descendants) and reaped it.
    """
    info = os.waitid(os.P_PID, worker.identity.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return
    if info.si_code == os.CLD_EXITED:
        worker.exit_code = info.si_status
    else:
        worker.exit_code = 128 + info.si_status
        try:
            worker.signal_name = signal.Signals(info.si_status).name
        except ValueError:          # a real-time signal has no name of its own
            worker.signal_name = f"signal {info.si_status}"


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker rank runs: its host, its place on it, and how to start it there."""

    rank: int
    host: str                   # address the worker is reached at
    local_rank: int
    local_size: int
    prefix: tuple[str, ...] = ()     # e.g. `ip netns exec <ns>` on an emulated host
    interface: str | None = None     # the host's NIC, for GLOO_SOCKET_IFNAME


def worker_slots(cluster: ClusterState, np: int) -> list[WorkerSlot]:
    """Ranks to hosts: all local on the embedded default; on an emulated cluster, contiguous
    blocks of ranks per worker host, as even as possible, in host order."""
    if cluster.emulation is None:
        return [WorkerSlot(rank, "127.0.0.1", rank, np) for rank in range(np)]
    hosts = cluster.emulation["workers"]
    slots, rank = [], 0
    for index, host in enumerate(hosts):
        count = np // len(hosts) + (1 if index < np % len(hosts) else 0)
        for local_rank in range(count):
            slots.append(WorkerSlot(rank, host["address"], local_rank, count,
                                    ("ip", "netns", "exec", host["namespace"]),
                                    host["interface"]))
            rank += 1
    return slots


class _ClusterWatch:
    """Notices a scheduler or server of the cluster exiting during a run.

    The workers normally fail by themselves within seconds, naming it; if they have not ended
    ``grace_s`` after it (say, they were still connecting to a scheduler that is gone, which
    only the start timeout would end), the run is stopped.
    """

    def __init__(self, cluster: ClusterState, grace_s: float):
        self.watched = [p for p in cluster.processes if is_running(p.identity)]
        self.grace_s = grace_s
        self.lost: ProcessRecord | None = None
        self._give_up_at = float("inf")
        self._next_check = 0.0

    def expired(self, now: float) -> bool:
        if self.lost is None and now >= self._next_check:
            self._next_check = now + _WATCH_INTERVAL_S
            self.lost = next((p for p in self.watched if not is_running(p.identity)), None)
            if self.lost is not None:
                self._give_up_at = now + self.grace_s
        return now > self._give_up_at

    def message(self) -> str:
        if self.lost is None:
            return ""
        p = self.lost
        name = "the scheduler" if p.role == "scheduler" else f"{p.role} {p.rank}"
        return f"lost {name} at {p.host}:{p.port} (pid {p.pid}): it exited during the run"


def _run_workers(cluster: ClusterState, cmd: list[str], np: int, config: Config,
                 stdout: IO[str], stderr: IO[str], stop_grace_s: float,
                 stop_signals: StopSignals) -> RunResult:
    job_id = uuid.uuid4().hex
    master_port = _free_port()
    worker_config = config.replace(role="worker", scheduler=cluster.scheduler,
                                   secret=cluster.secret, security=cluster.security,
                                   world_size=np, job_id=job_id)
    slots = worker_slots(cluster, np)
    workers: list[_Worker] = []
    failed_order: list[_Worker] = []
    watch = _ClusterWatch(cluster, config.heartbeat_timeout_s + 1.0)
    try:
        for slot in slots:
            rank = slot.rank
            stop_signals.check()
            extra = {
                "RANK": str(rank), "WORLD_SIZE": str(np), "LOCAL_RANK": str(slot.local_rank),
                "LOCAL_WORLD_SIZE": str(slot.local_size), "MASTER_ADDR": slots[0].host,
                "MASTER_PORT": str(master_port),
                "PYTHONUNBUFFERED": "1",     # so output streams line by line, not at exit
            }
            if slot.interface:
                extra["GLOO_SOCKET_IFNAME"] = slot.interface
            env = _child_env(worker_config.replace(rank=rank, local_rank=slot.local_rank,
                                                   local_size=slot.local_size, host=slot.host),
                             extra)
            try:
                process, identity = start_process([*slot.prefix, *cmd], env,
                                                  stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE)
            except OSError as exc:
                raise LaunchError(f"cannot start worker {rank}: {cmd[0]}: {exc.strerror}") from None
            relay = OutputRelay(rank, process.stdout, process.stderr, stdout, stderr,
                                logs_dir(config.state_dir) / f"worker-{rank}.log")
            workers.append(_Worker(rank, slot.host if slot.prefix else "", process, identity, relay))
        while True:
            stop_signals.check()
            for worker in workers:
                if worker.exit_code is None:
                    _check_exit(worker)
                    if worker.exit_code:
                        failed_order.append(worker)
            if failed_order or all(w.exit_code is not None for w in workers) \
                    or watch.expired(time.monotonic()):
                break
            time.sleep(_POLL_INTERVAL_S)
    finally:
        # Also stops what exited workers left behind in their process groups.
        stop_groups([w.identity for w in workers], stop_grace_s)
        for worker in workers:
            worker.process.wait()
            worker.relay.close()
    lost = watch.message()
    if not failed_order:
        stopped = any(w.exit_code is None for w in workers)     # by the watch, after its grace
        return RunResult(exit_code=1 if stopped else 0, lost=lost)
    failures = tuple(_failure(w) for w in failed_order)
    return RunResult(exit_code=failures[0].exit_code, failures=failures, lost=lost)


def _failure(worker: _Worker) -> WorkerFailure:
    return WorkerFailure(rank=worker.rank, pid=worker.identity.pid, exit_code=worker.exit_code,
                         signal_name=worker.signal_name, host=worker.host,
                         last_lines=tuple(worker.relay.last_lines()))
