"""SSH transport: one fabric connection per host, opened in parallel with retries, each host's
key verified (:mod:`bpsctl.launch.hostkeys`), and the agent (:mod:`bpsctl.launch.remote`) run
over raw channels; failures gathered per host.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bpsctl
from bpsctl.config import ConfigError
from bpsctl.launch.types import HostsSpec, LaunchError, SshOptions

AGENT = "bpsctl.launch.remote"
COMMAND_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
_POLL_INTERVAL_S = 0.05


def check_keys(hosts: HostsSpec) -> None:
    """A key file named in the hosts file must exist here, and a known_hosts file must be a
    file if it exists (a config error, exit 2)."""
    for host, options in hosts.ssh_hosts().items():
        if options.key and not Path(options.key).is_file():
            raise ConfigError(f"{hosts.source}: ssh.key for {host}: {options.key}: no such file "
                              "(expected the private key SSH logs in with)")
        known = options.known_hosts
        if known and Path(known).exists() and not Path(known).is_file():
            raise ConfigError(f"{hosts.source}: ssh.known_hosts for {host}: {known}: not a file "
                              "(expected a known_hosts file such as ~/.ssh/known_hosts; it is "
                              "created if missing)")


def remote_argv(argv: Sequence[str]) -> str:
    """A command line for the remote shell: every word quoted, a leading ``~/`` kept."""
    words = []
    for word in argv:
        if word.startswith("~/"):
            words.append('"$HOME"/' + shlex.quote(word[2:]))
        else:
            words.append(shlex.quote(word))
    return " ".join(words)


def cannot_import(python: str, error: str, module: str | None) -> str:
    """A host's bpsctl is there but fails to import ``module`` (one of its dependencies)."""
    fix = "use --ship (it installs bpsctl's dependencies too)"
    if module:
        top = module.split(".")[0]
        package = importlib.metadata.packages_distributions().get(top, [top])[0]
        fix += f" or install {package} there ({python} -m pip install {package})"
    return f"bpsctl is installed for {python} on this host but cannot be imported: {error}; {fix}"


class Hosts:
    """One fabric connection per host, opened in parallel with retries, closed on exit.
    Every host's key is checked against its ``ssh.known_hosts`` (trusted on first use)."""

    def __init__(self, hosts: HostsSpec, targets: Sequence[str] | None = None):
        self.spec = hosts
        self.options = hosts.ssh_hosts()
        self.targets = list(targets) if targets is not None else list(self.options)
        self.connections: dict[str, Any] = {}
        self.failures: dict[str, str] = {}

    def __enter__(self) -> Hosts:
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
        from paramiko.ssh_exception import (
            AuthenticationException,
            BadHostKeyException,
            NoValidConnectionsError,
            SSHException,
        )

        from bpsctl.launch import hostkeys
        options: SshOptions = self.options[host]
        if not options.known_hosts:
            raise HostFailure("no known_hosts file to check its host key against")
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
                hostkeys.load(conn.client, options.known_hosts)
                conn.open()
                return conn
            except BadHostKeyException as exc:
                conn.close()
                raise HostFailure(hostkeys.changed_key_message(
                    exc, host, options.port, options.known_hosts)) from None
            except hostkeys.KnownHostsError as exc:
                conn.close()
                raise HostFailure(str(exc)) from None
            except AuthenticationException as exc:
                conn.close()
                key = f"key {options.key}" if options.key else "the agent's and ~/.ssh keys"
                raise HostFailure(f"SSH authentication failed for {where} with {key} ({exc}); "
                                   "check ssh.key and ssh.user in the hosts file") from None
            except NoValidConnectionsError as exc:
                last = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()}))
            except TimeoutError:
                last = f"timed out after {options.connect_timeout_s:g} s"
            except (OSError, SSHException, EOFError) as exc:
                last = str(exc) or type(exc).__name__
            conn.close()
        raise HostFailure(f"cannot connect over SSH to {where} ({last}) after "
                           f"{options.retries + 1} attempt(s); is sshd running and reachable? "
                           "(ssh.connect_timeout_s, ssh.retries)")

    def agent(self, host: str, command: str, spec: dict[str, Any],
              timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """Run one agent command on ``host``; its JSON answer, or :class:`HostFailure`."""
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
        except TimeoutError:
            raise HostFailure(f"`bpsctl agent {command}` did not answer within "
                               f"{timeout_s:g} s") from None
        except Exception as exc:        # noqa: BLE001 - the connection broke
            raise HostFailure(f"SSH command failed: {exc}") from None
        stderr = b"".join(errors).decode(errors="replace")
        if code != 0:
            raise HostFailure(self._explain_failure(code, stderr))
        try:
            return json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HostFailure(f"the bpsctl agent gave no answer (stderr: "
                               f"{stderr.strip()[-300:]})") from None

    def _explain_failure(self, code: int, stderr: str) -> str:
        python = self.spec.python
        if code == 127:
            return (f"{python}: not found on this host; set `python:` in {self.spec.source} "
                    f"to an interpreter with bpsctl {bpsctl.__version__}")
        missing = re.findall(r"No module named '([\w.]+)'", stderr)
        if missing and missing[-1].split(".")[0] == "bpsctl":
            return (f"bpsctl is not installed for {python} on this host; install bpsctl "
                    f"{bpsctl.__version__} there (pip install bpsctl=={bpsctl.__version__}) "
                    "or use --ship")
        error = re.findall(r"^(?:ModuleNotFoundError|ImportError): .*$", stderr, re.M)
        if error:       # bpsctl was found, something it imports was not
            return cannot_import(python, error[-1], missing[-1] if missing else None)
        tail = stderr.strip().splitlines()[-3:]
        return f"{python} -m {AGENT} exited with code {code}: {' | '.join(tail)}"

    def open_channel(self, host: str, command: str) -> Any:
        """A raw paramiko channel running an agent command (for streaming)."""
        conn = self.connections[host]
        channel = conn.client.get_transport().open_session(timeout=COMMAND_TIMEOUT_S)
        channel.exec_command(remote_argv([self.spec.python, "-m", AGENT, command]))
        return channel


class HostFailure(Exception):
    """What went wrong on one host; gathered into one report."""


def parallel(hosts: Sequence[str], fn: Callable[[str], Any]) -> dict[str, tuple[bool, Any]]:
    """``fn(host)`` for every host at once: {host: (True, result) | (False, message)}."""
    results: dict[str, tuple[bool, Any]] = {}
    if not hosts:
        return results

    def call(host: str) -> None:
        try:
            results[host] = (True, fn(host))
        except HostFailure as exc:
            results[host] = (False, str(exc))
        except Exception as exc:        # noqa: BLE001 - reported with the host's name
            results[host] = (False, f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        list(pool.map(call, hosts))
    return {host: results[host] for host in hosts}


# --------------------------------------------------------------------------- helpers for bench

def run_on_hosts(hosts: HostsSpec, targets: Sequence[str], argv: Sequence[str],
                 timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, tuple[bool, str]]:
    """``argv`` once on every target at once: {host: (True, stdout) | (False, why)}."""
    with Hosts(hosts, targets=targets) as session:
        session.open()

        def call(host: str) -> str:
            done = session.connections[host].run(remote_argv(argv), hide=True, warn=True,
                                                 timeout=timeout_s)
            if done.exited != 0:
                tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
                raise HostFailure(f"`{' '.join(argv)}` exited {done.exited}"
                                   + (f": {tail[0]}" if tail else ""))
            return done.stdout

        answers = parallel(list(session.connections), call)
    return {host: answers.get(host, (False, session.failures.get(host, "not reached")))
            for host in targets}


@contextlib.contextmanager
def remote_service(hosts: HostsSpec, host: str, argv: Sequence[str],
                   timeout_s: float = COMMAND_TIMEOUT_S) -> Iterator[str]:
    """``argv`` on ``host`` for as long as the block lasts; yields the first line it prints.
    Its stdin is the SSH channel: closing it (or losing the connection) ends the command."""
    with Hosts(hosts, targets=[host]) as session:
        failures = session.open()
        if failures:
            raise LaunchError(f"{host}: {failures[host]}")
        channel = session.connections[host].client.get_transport().open_session(
            timeout=timeout_s)
        try:
            channel.settimeout(timeout_s)
            channel.exec_command(remote_argv(argv))
            try:
                line = channel.makefile("rb").readline().decode(errors="replace").strip()
            except TimeoutError:
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


