"""Preflight: before anything starts, check every host in parallel and report every problem
at once: SSH reachable, the remote bpsctl importable and of this version, interfaces and
addresses present, ports free, and every worker host able to open TCP connections to the
scheduler's and every server's port (the agent holds them open while the workers try).
"""
from __future__ import annotations

import contextlib
import json
from typing import Any

import bpsctl
from bpsctl.launch.plan import plan
from bpsctl.launch.transport import COMMAND_TIMEOUT_S, HostFailure, Hosts, cannot_import, parallel
from bpsctl.launch.types import HostsSpec, LaunchError

PROBE_TIMEOUT_S = 3.0


class PreflightError(LaunchError):
    """One or more hosts failed the checks; ``problems`` maps each host to what is wrong."""

    def __init__(self, problems: dict[str, list[str]]):
        self.problems = problems
        lines = [f"  {host}: {problem}" for host, items in problems.items() for problem in items]
        super().__init__(f"preflight failed on {len(problems)} host(s), nothing was started:\n"
                         + "\n".join(lines))


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
        failed = value.get("import_error")
        if failed:
            problems.setdefault(host, []).append(
                cannot_import(hosts.python, failed["error"], failed.get("module")))
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
        if a.host not in skip and a.port is not None:
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
                raise HostFailure(f"the port check could not start: {err.strip()[-300:]}"
                                  ) from None

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


