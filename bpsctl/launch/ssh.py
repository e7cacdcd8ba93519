"""Clusters on real hosts over SSH (fabric): preflight, up, run, status, logs, down.

Every host runs the agent :mod:`bpsctl.launch.remote` with the interpreter named by
``python:`` in the hosts file; it starts the scheduler and servers detached, each the leader of
its own process group, with ``<workdir>/<cluster>/<role>-<n>.log`` and ``.pid`` beside it.
The cluster is recorded locally in ``<state_dir>/ssh-cluster.json`` (mode 0600: it holds the
secret), which ``status``, ``logs``, ``run`` and ``down`` read.

Preflight (before anything starts, in parallel over hosts, every problem reported at once):
SSH reachable (with retries), the remote bpsctl importable and of this version, interfaces and
addresses present, ports free, and every worker host able to open TCP connections to the
scheduler's and every server's port (the agent holds them open while the workers try).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence

import bpsctl
from bpsctl.config import DEFAULT_SECURITY, Config, ConfigError
from bpsctl.launch.api import (LaunchError, RunResult, WorkerFailure, logs_dir, parse_log_role,
                               write_private_json)
from bpsctl.launch.hosts import HostsSpec, SshOptions, load_hosts
from bpsctl.launch.output import OutputRelay
from bpsctl.launch.plan import Assignment, Plan, plan
from bpsctl.launch.processes import Interrupted, stop_signals_recorded

STATE_FILE_NAME = "ssh-cluster.json"
AGENT = "bpsctl.launch.remote"
STOP_GRACE_S = 5.0
COMMAND_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 3.0
_POLL_INTERVAL_S = 0.05


class PreflightError(LaunchError):
    """One or more hosts failed the checks; ``problems`` maps each host to what is wrong."""

    def __init__(self, problems: dict[str, list[str]]):
        self.problems = problems
        lines = [f"  {host}: {problem}" for host, items in problems.items() for problem in items]
        super().__init__(f"preflight failed on {len(problems)} host(s), nothing was started:\n"
                         + "\n".join(lines))


@dataclass(frozen=True)
class RemoteProcess:
    """One scheduler or server started over SSH."""

    role: str
    rank: int
    host: str                   # SSH target
    address: str
    port: int
    pid: int
    pgid: int
    create_time: float
    log_path: str               # on the host

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"

    def agent_record(self) -> dict[str, Any]:
        return {"name": f"{self.role} {self.rank} on {self.host}", "pid": self.pid,
                "pgid": self.pgid, "create_time": self.create_time, "log": self.log_path}


@dataclass(frozen=True)
class SshCluster:
    """What ``<state_dir>/ssh-cluster.json`` records."""

    name: str
    scheduler: str              # address:port
    secret: str
    state_dir: str
    hosts: HostsSpec
    addresses: dict[str, str]   # SSH target -> bound address
    processes: tuple[RemoteProcess, ...]
    created: float
    security: str = DEFAULT_SECURITY    # BPSCTL_SECURITY of every member (engine/security.py)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hosts": self.hosts.to_json(), "kind": "ssh"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SshCluster":
        data = {k: v for k, v in data.items() if k != "kind"}
        return cls(**{**data, "hosts": HostsSpec.from_json(data["hosts"]),
                      "processes": tuple(RemoteProcess(**p) for p in data["processes"])})


@dataclass(frozen=True)
class SshDownReport:
    cluster: str | None
    stopped: tuple[RemoteProcess, ...] = ()
    survivors: tuple[str, ...] = ()     # "what (host): why"


# --------------------------------------------------------------------------- state file

def state_file(state_dir: Path | str) -> Path:
    return Path(state_dir) / STATE_FILE_NAME


def load_cluster(state_dir: Path | str) -> SshCluster | None:
    """The SSH cluster recorded in ``state_dir``, or None."""
    path = state_file(state_dir)
    try:
        return SshCluster.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise LaunchError(f"{path} is not a bpsctl SSH cluster state file ({exc}); stop what it "
                          "started on the hosts by hand, then delete it") from None


def _write_cluster(cluster: SshCluster) -> None:
    write_private_json(state_file(cluster.state_dir), cluster.to_json())


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    logs_dir(state_dir).mkdir(mode=0o700, exist_ok=True)
    with open(state_dir / ".ssh-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# --------------------------------------------------------------------------- SSH plumbing

def check_keys(hosts: HostsSpec) -> None:
    """A key file named in the hosts file must exist here (a config error, exit 2)."""
    for host, options in hosts.ssh_hosts().items():
        if options.key and not Path(options.key).is_file():
            raise ConfigError(f"{hosts.source}: ssh.key for {host}: {options.key}: no such file "
                              "(expected the private key SSH logs in with)")


def _remote_argv(argv: Sequence[str]) -> str:
    """A command line for the remote shell: every word quoted, a leading ``~/`` kept."""
    words = []
    for word in argv:
        if word.startswith("~/"):
            words.append('"$HOME"/' + shlex.quote(word[2:]))
        else:
            words.append(shlex.quote(word))
    return " ".join(words)


class Hosts:
    """One fabric connection per host, opened in parallel with retries, closed on exit."""

    def __init__(self, hosts: HostsSpec, targets: Sequence[str] | None = None):
        self.spec = hosts
        self.options = hosts.ssh_hosts()
        self.targets = list(targets) if targets is not None else list(self.options)
        self.connections: dict[str, Any] = {}
        self.failures: dict[str, str] = {}

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for conn in self.connections.values():
            with contextlib.suppress(Exception):
                conn.close()
        self.connections.clear()

    def open(self) -> dict[str, str]:
        """Connect to every target; returns (and keeps) the failures by host."""
        results = parallel(self.targets, self._connect)
        for host, (ok, value) in results.items():
            if ok:
                self.connections[host] = value
            else:
                self.failures[host] = value
        return dict(self.failures)

    def _connect(self, host: str) -> Any:
        from fabric import Connection
        from paramiko.ssh_exception import (AuthenticationException, NoValidConnectionsError,
                                            SSHException)
        options: SshOptions = self.options[host]
        kwargs: dict[str, Any] = {"banner_timeout": options.connect_timeout_s,
                                  "auth_timeout": options.connect_timeout_s}
        if options.key:
            kwargs.update(key_filename=options.key, look_for_keys=False, allow_agent=False)
        where = f"{options.user}@{host}:{options.port}"
        last = ""
        for attempt in range(options.retries + 1):
            if attempt:
                time.sleep(min(2.0, 0.5 * attempt))
            conn = Connection(host, user=options.user, port=options.port,
                              connect_timeout=options.connect_timeout_s, connect_kwargs=kwargs)
            try:
                conn.open()
                return conn
            except AuthenticationException as exc:
                conn.close()
                key = f"key {options.key}" if options.key else "the agent's and ~/.ssh keys"
                raise _HostFailure(f"SSH authentication failed for {where} with {key} ({exc}); "
                                   "check ssh.key and ssh.user in the hosts file") from None
            except NoValidConnectionsError as exc:
                last = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()}))
            except (socket.timeout, TimeoutError):
                last = f"timed out after {options.connect_timeout_s:g} s"
            except (OSError, SSHException, EOFError) as exc:
                last = str(exc) or type(exc).__name__
            conn.close()
        raise _HostFailure(f"cannot connect over SSH to {where} ({last}) after "
                           f"{options.retries + 1} attempt(s); is sshd running and reachable? "
                           "(ssh.connect_timeout_s, ssh.retries)")

    def agent(self, host: str, command: str, spec: dict[str, Any],
              timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """Run one agent command on ``host``; its JSON answer, or :class:`_HostFailure`."""
        # A raw channel, not fabric's run(in_stream=...): invoke feeds a non-terminal stdin
        # one byte per 10 ms, which makes a 1 KiB spec take 10 s.
        try:
            channel = self.open_channel(host, command)
            channel.settimeout(timeout_s)
            channel.sendall((json.dumps(spec) + "\n").encode())
            channel.shutdown_write()
            errors: list[bytes] = []
            reader = threading.Thread(target=lambda: errors.append(
                channel.makefile_stderr("rb").read()), daemon=True)
            reader.start()
            out = channel.makefile("rb").read()
            reader.join(timeout_s)
            code = channel.recv_exit_status()
            channel.close()
        except (socket.timeout, TimeoutError):
            raise _HostFailure(f"`bpsctl agent {command}` did not answer within "
                               f"{timeout_s:g} s") from None
        except Exception as exc:        # noqa: BLE001 - the connection broke
            raise _HostFailure(f"SSH command failed: {exc}") from None
        stderr = b"".join(errors).decode(errors="replace")
        if code != 0:
            raise _HostFailure(self._explain_failure(code, stderr))
        try:
            return json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise _HostFailure(f"the bpsctl agent gave no answer (stderr: "
                               f"{stderr.strip()[-300:]})") from None

    def _explain_failure(self, code: int, stderr: str) -> str:
        python = self.spec.python
        if code == 127:
            return (f"{python}: not found on this host; set `python:` in {self.spec.source} "
                    f"to an interpreter with bpsctl {bpsctl.__version__}")
        if "No module named" in stderr and "bpsctl" in stderr:
            return (f"bpsctl is not installed for {python} on this host; install bpsctl "
                    f"{bpsctl.__version__} there (pip install bpsctl=={bpsctl.__version__}) "
                    "or use --ship")
        tail = stderr.strip().splitlines()[-3:]
        return f"{python} -m {AGENT} exited with code {code}: {' | '.join(tail)}"

    def open_channel(self, host: str, command: str) -> Any:
        """A raw paramiko channel running an agent command (for streaming)."""
        conn = self.connections[host]
        channel = conn.client.get_transport().open_session(timeout=COMMAND_TIMEOUT_S)
        channel.exec_command(_remote_argv([self.spec.python, "-m", AGENT, command]))
        return channel


class _HostFailure(Exception):
    """What went wrong on one host; gathered into one report."""


def parallel(hosts: Sequence[str], fn: Callable[[str], Any]) -> dict[str, tuple[bool, Any]]:
    """``fn(host)`` for every host at once: {host: (True, result) | (False, message)}."""
    results: dict[str, tuple[bool, Any]] = {}
    if not hosts:
        return results

    def call(host: str) -> None:
        try:
            results[host] = (True, fn(host))
        except _HostFailure as exc:
            results[host] = (False, str(exc))
        except Exception as exc:        # noqa: BLE001 - reported with the host's name
            results[host] = (False, f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        list(pool.map(call, hosts))
    return {host: results[host] for host in hosts}


# --------------------------------------------------------------------------- provisioning

def build_wheel(out_dir: Path) -> Path:
    """A wheel of the bpsctl this launcher runs (from its source tree)."""
    root = Path(bpsctl.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").exists():
        raise LaunchError(f"--ship: bpsctl at {root} is not a source tree (no pyproject.toml); "
                          "install the same bpsctl version on every host instead")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out_dir), str(root)], capture_output=True, text=True)
    wheels = sorted(out_dir.glob("bpsctl-*.whl"))
    if done.returncode != 0 or not wheels:
        raise LaunchError(f"--ship: building the bpsctl wheel failed: {done.stderr.strip()[-500:]}")
    return wheels[-1]


# Run by the hosts' python: pip install, holding a lock file in the target site-packages.
# Hosts may share one installation (a venv on NFS, one machine under two names); concurrent
# --force-reinstalls into it delete each other's files. No index: the wheel has no deps to find.
_SHIP_INSTALL = """\
import fcntl, os, runpy, sys, sysconfig
try:
    lock = open(os.path.join(sysconfig.get_paths()["purelib"], ".bpsctl-ship.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
except OSError:
    pass                # not writable: pip says so
sys.argv = ["pip", "install", "-q", "--force-reinstall", "--no-deps", "--no-index",
            "--disable-pip-version-check", sys.argv[1]]
try:
    runpy.run_module("pip", run_name="__main__", alter_sys=True)
except ImportError as exc:
    sys.exit(f"{sys.executable}: {exc} (pip is needed for --ship)")
"""


def _pip_error(stderr: str) -> str:
    """pip's ERROR lines (its warnings and notices left out), else the last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return " | ".join(errors or [line for line in lines if not line.startswith(
        ("[notice]", "WARNING"))][-3:] or lines[-3:])[-500:]


def ship(session: Hosts, targets: Sequence[str]) -> dict[str, str]:
    """Copy a wheel of this bpsctl to every target and install it into ``python:``."""
    with tempfile.TemporaryDirectory(prefix="bpsctl-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))

        def install(host: str) -> None:
            conn = session.connections[host]
            remote_dir = conn.run("mktemp -d", hide=True, in_stream=False).stdout.strip()
            remote_wheel = f"{remote_dir}/{wheel.name}"
            conn.put(str(wheel), remote_wheel)
            result = conn.run(_remote_argv([session.spec.python, "-c", _SHIP_INSTALL,
                                            remote_wheel]),
                              hide=True, warn=True, timeout=600, in_stream=False)
            conn.run(_remote_argv(["rm", "-rf", remote_dir]), hide=True, warn=True,
                     in_stream=False)
            if result.exited != 0:
                raise _HostFailure(f"--ship: pip install of {wheel.name} into "
                                   f"{session.spec.python} failed (exit {result.exited}): "
                                   f"{_pip_error(result.stderr)}")

        return {h: msg for h, (ok, msg) in parallel(targets, install).items() if not ok}


# --------------------------------------------------------------------------- preflight

def _host_entries(hosts: HostsSpec) -> dict[str, dict[str, Any]]:
    """Per SSH target: its interface/address, and the ports it must bind."""
    info: dict[str, dict[str, Any]] = {}
    the_plan = plan(hosts)
    for a in the_plan.assignments:
        item = info.setdefault(a.host, {"interface": None, "address": None, "ports": []})
        item["interface"] = item["interface"] or a.entry.interface
        item["address"] = item["address"] or a.entry.address
        if a.port:
            item["ports"].append(a.port)
    for item in info.values():
        if not item["interface"] and not item["address"]:
            item["address"] = None
    return info


def preflight(session: Hosts, hosts: HostsSpec) -> dict[str, str]:
    """Check every host (in parallel) and return each host's bind address.

    Raises :class:`PreflightError` with every problem of every host at once.
    """
    problems: dict[str, list[str]] = {}
    for host, message in session.failures.items():
        problems.setdefault(host, []).append(message)
    entries = _host_entries(hosts)
    reachable = [h for h in entries if h in session.connections]

    def check(host: str) -> dict[str, Any]:
        item = entries[host]
        spec = {"interface": item["interface"], "address": item["address"] or host,
                "ports": item["ports"]}
        return session.agent(host, "check", spec, timeout_s=COMMAND_TIMEOUT_S)

    addresses: dict[str, str] = {}
    for host, (ok, value) in parallel(reachable, check).items():
        if not ok:
            problems.setdefault(host, []).append(value)
            continue
        if value.get("version") != bpsctl.__version__:
            problems.setdefault(host, []).append(
                f"bpsctl {value.get('version')} for {value.get('python')}, but this launcher is "
                f"bpsctl {bpsctl.__version__}; install the same version there or use --ship")
        problems_here = value.get("problems") or []
        if problems_here:
            problems.setdefault(host, []).extend(problems_here)
        elif value.get("address"):
            addresses[host] = value["address"]
    # hosts that already failed are left out; the others are still checked, so that every
    # problem is reported in one go
    _check_reachability(session, hosts, addresses, problems, skip=set(problems))
    if problems:
        raise PreflightError(problems)
    return addresses


def _check_reachability(session: Hosts, hosts: HostsSpec, addresses: dict[str, str],
                        problems: dict[str, list[str]], skip: set[str]) -> None:
    """Hold the scheduler's and servers' ports open; every worker host connects to each."""
    the_plan = plan(hosts, addresses=addresses)
    listeners: dict[str, list[int]] = {}
    for a in (the_plan.scheduler, *the_plan.servers):
        if a.host not in skip:
            listeners.setdefault(a.host, []).append(a.port)
    channels: dict[str, Any] = {}
    try:
        def listen(host: str) -> Any:
            channel = session.open_channel(host, "listen")
            channel.sendall((json.dumps({"address": addresses[host], "ports": listeners[host],
                                         "hold_s": 60}) + "\n").encode())
            channels[host] = channel
            channel.settimeout(COMMAND_TIMEOUT_S)
            answer = channel.makefile("rb").readline()
            try:
                return json.loads(answer)
            except ValueError:
                err = channel.makefile_stderr("rb").read().decode(errors="replace")
                raise _HostFailure(f"the port check could not start: {err.strip()[-300:]}")

        for host, (ok, value) in parallel(list(listeners), listen).items():
            if not ok:
                problems.setdefault(host, []).append(value)
            elif value.get("problems"):
                problems.setdefault(host, []).extend(value["problems"])
        listening = {h for h in listeners if h not in problems}
        targets = [[a.address, a.port, f"the scheduler ({a.host})" if a.role == "scheduler"
                    else f"server {a.rank} ({a.host})"]
                   for a in (the_plan.scheduler, *the_plan.servers) if a.host in listening]
        worker_hosts = list(dict.fromkeys(w.host for w in the_plan.workers
                                          if w.host not in skip))
        if not targets:
            return

        def connect(host: str) -> dict[str, Any]:
            return session.agent(host, "connect", {"targets": targets,
                                                   "timeout_s": PROBE_TIMEOUT_S})

        for host, (ok, value) in parallel(worker_hosts, connect).items():
            if not ok:
                problems.setdefault(host, []).append(value)
            else:
                problems_here = value.get("problems") or []
                if problems_here:
                    problems.setdefault(host, []).extend(problems_here)
    finally:
        for channel in channels.values():
            with contextlib.suppress(Exception):
                channel.shutdown_write()
        for channel in channels.values():
            with contextlib.suppress(Exception):
                channel.recv_exit_status()
                channel.close()


# --------------------------------------------------------------------------- up

def _remote_dir(hosts: HostsSpec, cluster_name: str) -> str:
    return f"{hosts.workdir.rstrip('/')}/{cluster_name}"


def up_ssh(hosts: HostsSpec | str | Path, config: Config, *, ship_wheel: bool = False,
           progress: Callable[[str], None] | None = None) -> SshCluster:
    """Preflight every host, start the scheduler and servers over SSH, wait until every server
    has registered, and record the cluster in ``config.state_dir``.

    On any failure everything started is stopped again and :class:`LaunchError` (or
    :class:`PreflightError`) names the host and the problem.
    """
    hosts = hosts if isinstance(hosts, HostsSpec) else load_hosts(hosts)
    check_keys(hosts)
    say = progress or (lambda text: None)
    state_dir = Path(config.state_dir).resolve()
    with _locked(state_dir), stop_signals_recorded() as stop_signals:
        existing = load_cluster(state_dir)
        if existing is not None:
            raise LaunchError(f"SSH cluster {existing.name} (scheduler {existing.scheduler}) is "
                              f"recorded in {state_dir}; run `bpsctl down` first")
        with Hosts(hosts) as session:
            say(f"connecting to {len(session.targets)} host(s)")
            session.open()
            if ship_wheel and session.connections:
                say("installing this bpsctl on every host (--ship)")
                for host, message in ship(session, list(session.connections)).items():
                    session.failures[host] = message
                    session.connections.pop(host).close()
            say("preflight checks")
            addresses = preflight(session, hosts)
            stop_signals.check()
            name = f"ssh-{secrets.token_hex(3)}"
            from bpsctl.engine.security import new_secret
            # the secret (and so the CURVE keys derived from it) reaches each process only
            # inside the JSON the agent reads on stdin, and lives in its environment
            cluster_plan = plan(hosts, config, secret=new_secret(), job_id=name,
                                addresses=addresses)
            started: list[RemoteProcess] = []
            try:
                say(f"starting the scheduler and {len(cluster_plan.servers)} server(s)")
                started = _start_roles(session, hosts, config, cluster_plan, name)
                stop_signals.check()
                ranks = _wait_registered(session, cluster_plan, started, config)
                processes = tuple(dataclasses.replace(p, rank=ranks.get((p.address, p.port),
                                                                        p.rank))
                                  for p in started)
                cluster = SshCluster(name=name, scheduler=cluster_plan.scheduler_address,
                                     secret=cluster_plan.secret, security=config.security,
                                     state_dir=str(state_dir),
                                     hosts=hosts, addresses=addresses, processes=processes,
                                     created=time.time())
                _write_cluster(cluster)
            except BaseException:
                _stop_processes(session, started, cluster_plan.secret)
                raise
        return cluster


def _start_roles(session: Hosts, hosts: HostsSpec, config: Config, cluster_plan: Plan,
                 name: str) -> list[RemoteProcess]:
    remote_dir = _remote_dir(hosts, name)
    started: list[RemoteProcess] = []
    lock = threading.Lock()

    def start(a: Assignment) -> RemoteProcess:
        spec = {"argv": [hosts.python, "-m", f"bpsctl.engine.{a.role}"],
                "env": a.to_env(config, cluster_plan),
                "log": f"{remote_dir}/{a.name}.log"}
        record = session.agent(a.host, "start", spec)
        process = RemoteProcess(role=a.role, rank=a.rank, host=a.host, address=a.address,
                                port=int(a.port or 0), pid=int(record["pid"]),
                                pgid=int(record["pgid"]), create_time=float(record["create_time"]),
                                log_path=record["log"])
        with lock:
            started.append(process)
        return process

    # the scheduler first, so servers find it listening
    failures = {}
    ok, value = parallel([cluster_plan.scheduler.host], lambda _: start(cluster_plan.scheduler))[
        cluster_plan.scheduler.host]
    if not ok:
        raise LaunchError(f"cannot start the scheduler on {cluster_plan.scheduler.host}: {value}")
    by_host: dict[str, list[Assignment]] = {}
    for s in cluster_plan.servers:
        by_host.setdefault(s.host, []).append(s)
    for host, (ok, value) in parallel(list(by_host),
                                      lambda h: [start(a) for a in by_host[h]]).items():
        if not ok:
            failures[host] = value
    if failures:
        raise LaunchError("cannot start servers: " + "; ".join(f"{h}: {m}"
                                                                for h, m in failures.items()))
    order = {a.name: i for i, a in enumerate(cluster_plan.assignments)}
    return sorted(started, key=lambda p: order[f"{p.role}-{p.rank}"])


def _wait_registered(session: Hosts, cluster_plan: Plan, started: list[RemoteProcess],
                     config: Config) -> dict[tuple[str, int], int]:
    """Wait on the scheduler's host until every server registered; (address, port) -> rank."""
    scheduler = cluster_plan.scheduler
    watch = [p.agent_record() for p in started if p.host == scheduler.host]
    answer = session.agent(scheduler.host, "scheduler", {
        "address": cluster_plan.scheduler_address, "security": config.security,
        "secret": cluster_plan.secret, "servers": len(cluster_plan.servers),
        "timeout_s": config.start_timeout_s, "watch": watch},
        timeout_s=config.start_timeout_s + COMMAND_TIMEOUT_S)
    if "view" in answer:
        return {(s["host"], int(s["port"])): int(s["rank"]) for s in answer["view"]["servers"]}
    # say which process is missing, with the end of its log
    exited = _exited_processes(session, started)
    if exited:
        process, tail = exited[0]
        raise LaunchError(f"{process.role} (pid {process.pid}) on {process.host} exited while "
                          f"starting; last lines of {process.log_path}:\n{_indent(tail)}")
    if answer.get("exited"):
        raise LaunchError(f"{answer['error']}; last lines of its log:\n"
                          f"{_indent(answer.get('log_tail', ''))}")
    raise LaunchError(f"the cluster did not come up within {config.start_timeout_s:g} s: "
                      f"{answer.get('error')} (raise --start-timeout / BPSCTL_START_TIMEOUT if "
                      "the hosts are slow)")


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in (text or "(log is empty)").splitlines())


def _exited_processes(session: Hosts, processes: Sequence[RemoteProcess]
                      ) -> list[tuple[RemoteProcess, str]]:
    states = _process_states(session, processes)
    exited = []
    for process in processes:
        if states.get(process) is False:
            tail = ""
            with contextlib.suppress(Exception):
                conn = session.connections[process.host]
                tail = conn.run(_remote_argv(["tail", "-n", "15", process.log_path]), hide=True,
                                warn=True, timeout=10).stdout
            exited.append((process, tail))
    return exited


def _process_states(session: Hosts, processes: Sequence[RemoteProcess]
                    ) -> dict[RemoteProcess, bool | None]:
    """Whether each recorded process still runs (None: its host could not be asked)."""
    by_host: dict[str, list[RemoteProcess]] = {}
    for p in processes:
        by_host.setdefault(p.host, []).append(p)
    reachable = [h for h in by_host if h in session.connections]
    states: dict[RemoteProcess, bool | None] = {p: None for p in processes}
    results = parallel(reachable, lambda h: session.agent(
        h, "ps", {"records": [p.agent_record() for p in by_host[h]]}))
    for host, (ok, value) in results.items():
        if ok:
            for p, running in zip(by_host[host], value["running"]):
                states[p] = bool(running)
    return states


def _stop_processes(session: Hosts, processes: Sequence[RemoteProcess],
                    secret: str) -> tuple[list[RemoteProcess], list[str]]:
    """Stop ``processes`` (and anything else with the cluster's secret) on every host that has
    any; returns (stopped, problems)."""
    by_host: dict[str, list[RemoteProcess]] = {}
    for p in processes:
        by_host.setdefault(p.host, []).append(p)
    for host in session.spec.ssh_hosts():
        by_host.setdefault(host, [])
    problems: list[str] = []
    stopped: list[RemoteProcess] = []
    reachable = [h for h in by_host if h in session.connections]
    for host in by_host:
        if host not in session.connections and by_host[host]:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in by_host[host])
            problems.append(f"{names} on {host}: host unreachable "
                            f"({session.failures.get(host, 'not connected')})")
    results = parallel(reachable, lambda h: session.agent(
        h, "stop", {"records": [p.agent_record() for p in by_host[h]], "secret": secret,
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

def down_ssh(state_dir: Path | str) -> SshDownReport:
    """Stop everything the recorded SSH cluster started on every host, verify nothing of it
    is left, and forget it. Safe to repeat; the state file stays while anything survives."""
    state_dir = Path(state_dir)
    if not state_file(state_dir).exists():
        return SshDownReport(cluster=None)
    with _locked(state_dir), stop_signals_recorded():
        cluster = load_cluster(state_dir)
        if cluster is None:
            return SshDownReport(cluster=None)
        with Hosts(cluster.hosts) as session:
            session.open()
            stopped, problems = _stop_processes(session, cluster.processes, cluster.secret)
        if not problems:
            state_file(state_dir).unlink(missing_ok=True)
        return SshDownReport(cluster=cluster.name, stopped=tuple(stopped),
                             survivors=tuple(problems))


# --------------------------------------------------------------------------- status / logs

def status_ssh(state_dir: Path | str) -> dict[str, Any]:
    """The SSH cluster as JSON, in the shape of :func:`bpsctl.launch.status`, from the
    scheduler's view (asked on its host) and a process check on every host."""
    cluster = load_cluster(state_dir)
    if cluster is None:
        return {"cluster": None, "scheduler": None, "state_dir": str(state_dir), "processes": [],
                "job": None, "scheduler_error": None}
    scheduler = next(p for p in cluster.processes if p.role == "scheduler")
    with Hosts(cluster.hosts, targets=list(dict.fromkeys(p.host for p in cluster.processes))
               ) as session:
        session.open()
        states = _process_states(session, cluster.processes)
        view, scheduler_error = None, None
        if scheduler.host not in session.connections:
            scheduler_error = (f"cannot reach the scheduler's host {scheduler.host}: "
                               f"{session.failures.get(scheduler.host)}")
        elif states.get(scheduler) is False:
            scheduler_error = f"the scheduler (pid {scheduler.pid}) on {scheduler.host} has exited"
        else:
            try:
                answer = session.agent(scheduler.host, "scheduler", {
                    "address": cluster.scheduler, "secret": cluster.secret,
                    "security": cluster.security, "servers": 0,
                    "timeout_s": 2.0})
                view = answer.get("view")
                scheduler_error = answer.get("error")
            except _HostFailure as exc:
                scheduler_error = str(exc)
    seen = {(s["host"], int(s["port"])): s for s in view["servers"]} if view else {}
    processes = []
    for p in cluster.processes:
        running = states.get(p)
        state = "running" if running else ("unknown" if running is None else "exited")
        member = seen.pop((p.address, p.port), None) if p.role == "server" else None
        if state == "running" and member is not None and member["state"] != "running":
            state = "lost"
        processes.append({"role": p.role, "rank": p.rank, "host": p.address, "ssh_host": p.host,
                          "port": p.port, "pid": p.pid, "state": state})
    extra = [("server", m) for m in seen.values()]
    extra += [("worker", m) for m in (view["workers"] if view else [])]
    for role, m in extra:
        processes.append({"role": role, "rank": m["rank"], "host": m["host"],
                          "port": m["port"], "pid": m["pid"],
                          "state": m["state"] if m["state"] in ("running", "lost") else "exited"})
    return {"cluster": cluster.name, "kind": "ssh", "scheduler": cluster.scheduler,
            "state_dir": str(state_dir), "created": cluster.created, "processes": processes,
            "job": view["job"] if view else None, "scheduler_error": scheduler_error}


def logs_ssh(state_dir: Path | str, role: str | None = None) -> str:
    """Fetch the scheduler's and servers' logs from their hosts into ``<state_dir>/logs`` and
    return them (with the last run's worker logs, kept here), as :func:`bpsctl.launch.logs`."""
    from bpsctl.launch.api import logs as local_logs
    wanted_role, wanted_rank = parse_log_role(role)
    cluster = load_cluster(state_dir)
    if cluster is not None:
        wanted = [p for p in cluster.processes
                  if wanted_role in (None, p.role) and wanted_rank in (None, p.rank)]
        directory = logs_dir(state_dir)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with Hosts(cluster.hosts, targets=list(dict.fromkeys(p.host for p in wanted))) as session:
            session.open()
            problems = [f"{h}: {m}" for h, m in session.failures.items()]

            def fetch(host: str) -> None:
                for p in wanted:
                    if p.host == host:
                        # cat, not SFTP: hosts without an sftp subsystem work too
                        text = session.connections[host].run(
                            _remote_argv(["cat", p.log_path]), hide=True, warn=True,
                            timeout=COMMAND_TIMEOUT_S)
                        if text.exited != 0:
                            raise _HostFailure(f"cannot read {p.log_path}: "
                                               f"{text.stderr.strip()[-200:]}")
                        (directory / f"{p.role}-{p.rank}.log").write_text(text.stdout)

            for host, (ok, value) in parallel(list(session.connections), fetch).items():
                if not ok:
                    problems.append(f"{host}: cannot fetch logs: {value}")
        if problems:
            raise LaunchError("; ".join(problems))
    return local_logs(state_dir, role)


# --------------------------------------------------------------------------- run

class _HostRelay(OutputRelay):
    """OutputRelay with a ``[host:rank]`` prefix."""

    def __init__(self, label: str, *args: Any, **kwargs: Any):
        self._label = label
        super().__init__(*args, **kwargs)

    @property
    def prefix(self) -> str:        # type: ignore[override]
        return self._label

    @prefix.setter
    def prefix(self, value: str) -> None:
        pass


@dataclass
class _RemoteWorker:
    assignment: Assignment
    channel: Any
    pid: int = 0
    relay: _HostRelay | None = None
    exit_code: int | None = None
    start_error: str = ""


def run_ssh(cmd: list[str], config: Config, hosts: HostsSpec | str | Path | None = None, *,
            ship_wheel: bool = False, stdout: IO[str] | None = None,
            stderr: IO[str] | None = None) -> RunResult:
    """Run ``cmd`` as every worker slot of the hosts file, on the SSH cluster ``up`` started
    (or on one started for this run from ``hosts`` and stopped afterwards).

    Output is streamed prefixed with ``[host:rank]`` and kept in ``<state_dir>/logs``. The first
    worker to fail stops the others; its exit code is returned with the root cause first.
    """
    if not cmd:
        raise ConfigError("CMD: expected the command to run after `--`, e.g. "
                          "`bpsctl run --hosts hosts.yaml -- python train.py`")
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    state_dir = Path(config.state_dir).resolve()
    config = config.replace(state_dir=state_dir)
    cluster = load_cluster(state_dir)
    own = False
    if cluster is None:
        if hosts is None:
            raise ConfigError("--hosts: no SSH cluster is up in "
                              f"{state_dir}; give --hosts hosts.yaml (or run `bpsctl up --hosts`)")
        cluster = up_ssh(hosts, config, ship_wheel=ship_wheel)
        own = True
    try:
        with stop_signals_recorded() as stop_signals:
            try:
                return _run_workers(cluster, cmd, config, stdout, stderr, stop_signals)
            except Interrupted as interrupted:
                return RunResult(exit_code=128 + interrupted.signum)
    finally:
        if own:
            down_ssh(state_dir)


def _run_workers(cluster: SshCluster, cmd: list[str], config: Config, stdout: IO[str],
                 stderr: IO[str], stop_signals: Any) -> RunResult:
    job_id = uuid.uuid4().hex
    config = config.replace(security=cluster.security)
    the_plan = plan(cluster.hosts, config, secret=cluster.secret, job_id=job_id,
                    addresses=cluster.addresses)
    the_plan = dataclasses.replace(the_plan, workdir=_remote_dir(cluster.hosts, cluster.name))
    directory = logs_dir(cluster.state_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    targets = list(dict.fromkeys(w.host for w in the_plan.workers))
    workers: list[_RemoteWorker] = []
    with Hosts(cluster.hosts, targets=targets) as session:
        failures = session.open()
        if failures:
            raise LaunchError("cannot start workers: " + "; ".join(
                f"{h}: {m}" for h, m in failures.items()))
        try:
            for a in the_plan.workers:
                stop_signals.check()
                channel = session.open_channel(a.host, "exec")
                worker = _RemoteWorker(a, channel)
                workers.append(worker)
                spec = {"argv": cmd, "env": a.to_env(config, the_plan), "cwd": os.getcwd(),
                        "grace_s": STOP_GRACE_S}
                channel.sendall((json.dumps(spec) + "\n").encode())
            for worker in workers:
                _attach(worker, stdout, stderr, directory)
            failed = _watch(workers, stop_signals)
        finally:
            for worker in workers:
                with contextlib.suppress(Exception):
                    worker.channel.shutdown_write()     # the agent stops its worker
            deadline = time.monotonic() + 3 * STOP_GRACE_S
            for worker in workers:
                while not worker.channel.exit_status_ready() and time.monotonic() < deadline:
                    time.sleep(_POLL_INTERVAL_S)
                if worker.exit_code is None and worker.channel.exit_status_ready():
                    worker.exit_code = worker.channel.recv_exit_status()
                if worker.relay is not None:
                    worker.relay.close()
                worker.channel.close()
    if not failed:
        return RunResult(exit_code=0)
    result = tuple(_failure(w) for w in failed)
    return RunResult(exit_code=result[0].exit_code, failures=result)


def _attach(worker: _RemoteWorker, stdout: IO[str], stderr: IO[str], directory: Path) -> None:
    a = worker.assignment
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
    worker.relay = _HostRelay(f"[{a.host}:{a.rank}] ", a.rank, out,
                              worker.channel.makefile_stderr("rb"), stdout, stderr,
                              directory / f"worker-{a.rank}.log")


def _watch(workers: list[_RemoteWorker], stop_signals: Any) -> list[_RemoteWorker]:
    failed: list[_RemoteWorker] = []
    while True:
        stop_signals.check()
        for worker in workers:
            if worker.exit_code is None and worker.channel.exit_status_ready():
                worker.exit_code = worker.channel.recv_exit_status()
                if worker.exit_code:
                    failed.append(worker)
        if failed or all(w.exit_code is not None for w in workers):
            return failed
        time.sleep(_POLL_INTERVAL_S)


def _failure(worker: _RemoteWorker) -> WorkerFailure:
    code = worker.exit_code if worker.exit_code is not None else 1
    signal_name = None
    if code > 128:
        import signal as signals
        with contextlib.suppress(ValueError):
            signal_name = signals.Signals(code - 128).name
    lines = tuple(worker.relay.last_lines()) if worker.relay else ()
    if worker.start_error:
        lines = (worker.start_error, *lines)
    return WorkerFailure(rank=worker.assignment.rank, pid=worker.pid, exit_code=code,
                         signal_name=signal_name, last_lines=lines, host=worker.assignment.host)


# --------------------------------------------------------------------------- helpers for bench

def worker_hosts(cluster: SshCluster) -> list[str]:
    """The SSH targets of the worker entries, in rank order, each once."""
    return list(dict.fromkeys(entry.host for entry in cluster.hosts.workers))


def run_on_hosts(cluster: SshCluster, targets: Sequence[str], argv: Sequence[str],
                 timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, tuple[bool, str]]:
    """``argv`` once on every target at once: {host: (True, stdout) | (False, why)}."""
    with Hosts(cluster.hosts, targets=targets) as session:
        session.open()

        def call(host: str) -> str:
            done = session.connections[host].run(_remote_argv(argv), hide=True, warn=True,
                                                 timeout=timeout_s)
            if done.exited != 0:
                tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
                raise _HostFailure(f"`{' '.join(argv)}` exited {done.exited}"
                                   + (f": {tail[0]}" if tail else ""))
            return done.stdout

        answers = parallel(list(session.connections), call)
    return {host: answers.get(host, (False, session.failures.get(host, "not reached")))
            for host in targets}


@contextlib.contextmanager
def remote_service(cluster: SshCluster, host: str, argv: Sequence[str],
                   timeout_s: float = COMMAND_TIMEOUT_S) -> Iterator[str]:
    """``argv`` on ``host`` for as long as the block lasts; yields the first line it prints.
    Its stdin is the SSH channel: closing it (or losing the connection) ends the command."""
    with Hosts(cluster.hosts, targets=[host]) as session:
        failures = session.open()
        if failures:
            raise LaunchError(f"{host}: {failures[host]}")
        channel = session.connections[host].client.get_transport().open_session(
            timeout=timeout_s)
        try:
            channel.settimeout(timeout_s)
            channel.exec_command(_remote_argv(argv))
            try:
                line = channel.makefile("rb").readline().decode(errors="replace").strip()
            except socket.timeout:
                line = ""
            if not line:
                error = b""
                with contextlib.suppress(socket.timeout):
                    error = channel.makefile_stderr("rb").read()
                tail = error.decode(errors="replace").strip().splitlines()[-1:]
                raise LaunchError(f"{host}: `{' '.join(argv)}` did not start"
                                  + (f": {tail[0]}" if tail else f" within {timeout_s:g} s"))
            yield line
        finally:
            with contextlib.suppress(Exception):
                channel.shutdown_write()
            deadline = time.monotonic() + STOP_GRACE_S
            while not channel.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(_POLL_INTERVAL_S)
            channel.close()


__all__ = ["PreflightError", "RemoteProcess", "SshCluster",
           "SshDownReport", "down_ssh", "load_cluster", "logs_ssh", "preflight", "remote_service",
           "run_on_hosts", "run_ssh", "status_ssh", "up_ssh", "worker_hosts"]
