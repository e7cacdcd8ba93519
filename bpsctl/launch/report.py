"""The status report every backend returns: the recorded processes merged with the scheduler's
view of the cluster (which marks silent members lost and knows the workers of a running job).
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from bpsctl.engine import EngineError
from bpsctl.engine.client import scheduler_status
from bpsctl.launch.processes import is_running, pid_running
from bpsctl.launch.types import ClusterState, DownReport, ProcessRecord


def no_cluster(state_dir: Path | str) -> dict[str, Any]:
    return {"cluster": None, "kind": None, "scheduler": None, "state_dir": str(state_dir),
            "processes": [], "job": None, "scheduler_error": None}


def local_status(cluster: ClusterState, address: str, timeout_s: float,
                 scheduler_gone: str, supervision: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The report for a cluster whose processes this machine can see (local, emulated, and
    Slurm's sruns): each checked here, merged with the scheduler's view asked at ``address``;
    ``scheduler_gone`` is the error when the scheduler's process has exited; ``supervision``
    the scheduler's supervisor's record (bpsctl/engine/supervise.py), if it runs under one."""
    running: dict[ProcessRecord, bool | None] = {p: is_running(p.identity)
                                                 for p in cluster.processes}
    view, scheduler_error = None, None
    if running[cluster.scheduler_record]:
        try:
            view = scheduler_status(address, cluster.secret, timeout_s=timeout_s,
                                    security=cluster.security)
        except EngineError as exc:
            scheduler_error = str(exc)
    else:
        scheduler_error = scheduler_gone
    return status_report(cluster, running, view, scheduler_error, supervision)


def down_report(cluster: ClusterState, survivors: set[int], what: str = "pid") -> DownReport:
    """What ``down`` did, given the pids that survived SIGKILL (``what`` names those pids)."""
    return DownReport(
        cluster=cluster.name,
        stopped=tuple(p for p in cluster.processes if p.pid not in survivors),
        survivors=tuple(f"{p.name} ({what} {p.pid}): survived SIGKILL"
                        for p in cluster.processes if p.pid in survivors))


def status_report(cluster: ClusterState, running: dict[ProcessRecord, bool | None],
                  view: dict[str, Any] | None, scheduler_error: str | None,
                  supervision: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"cluster", "kind", "scheduler", "state_dir", "created", "processes": [{"role", "rank",
    "host", "port", "pid", "state"}], "job", "scheduler_error"}``.

    ``running`` says whether each recorded process still runs (None: could not be asked);
    ``view`` is the scheduler's answer, None if it gave none. A process's state is running,
    spare (a spare server holding nothing yet), lost (running but silent to the scheduler),
    exited, or unknown; a supervised scheduler's (``supervision``: see
    bpsctl/engine/supervise.py) also restarting, and its row says the scheduler's own pid,
    ``supervisor_pid`` and ``restarts``. A former spare that took over a lost server's place
    says whose (``took_over``: its rank). A server's row also carries its ``share`` of the bytes
    in the cluster's layout and whether it is ``colocated`` with workers, as it registered.
    """
    seen_servers: dict[tuple[str, int | None], dict[str, Any]] = (
        {(s["host"], int(s["port"])): s for s in view["servers"]} if view else {})
    processes = []
    for record in cluster.processes:
        alive = running.get(record)
        state = "running" if alive else ("unknown" if alive is None else "exited")
        seen = (seen_servers.pop((record.host, record.port), None) if record.role == "server"
                else None)
        if state == "running" and seen is not None and seen["state"] != "running":
            state = "spare" if seen["state"] == "spare" else "lost"
        row = {"role": record.role, "rank": record.rank, "host": record.host,
               "port": record.port, "pid": record.pid, "state": state}
        if seen is not None:
            row.update(_layout_keys(seen))
        if record.role == "scheduler" and supervision is not None:
            row.update(_supervised(record, state, supervision))
        if record.ssh_host:
            row["ssh_host"] = record.ssh_host
        if record.node:
            row["node"] = record.node
        processes.append(row)
    # members the scheduler knows that `up` did not start: the workers of a job, and servers
    # some other launcher started
    unrecorded = [("server", member) for member in seen_servers.values()]
    unrecorded += [("worker", member) for member in (view["workers"] if view else [])]
    for role, member in unrecorded:
        state = {"running": "running", "spare": "spare", "lost": "lost"}.get(member["state"],
                                                                             "exited")
        if state == "running" and _is_this_machine(member["host"]) \
                and not pid_running(member["pid"]):
            state = "exited"
        row = {"role": role, "rank": member["rank"], "host": member["host"],
               "port": member["port"], "pid": member["pid"], "state": state}
        row.update(_layout_keys(member))
        processes.append(row)
    return {"cluster": cluster.name, "kind": cluster.kind, "scheduler": cluster.scheduler,
            "state_dir": cluster.state_dir, "created": cluster.created, "processes": processes,
            "job": view["job"] if view else None, "scheduler_error": scheduler_error}


def _layout_keys(member: dict[str, Any]) -> dict[str, Any]:
    """What a server row adds from the scheduler's view: the lost server it took the place of
    (``took_over``), its share of the bytes in the cluster's layout (``share``, null: none
    given) and whether it shares a host with workers (``colocated``)."""
    return {key: member[key] for key in ("took_over", "share", "colocated") if key in member}


def _supervised(record: ProcessRecord, state: str,
                supervision: dict[str, Any]) -> dict[str, Any]:
    """A supervised scheduler's row: the record's pid is its supervisor's."""
    row: dict[str, Any] = {"supervisor_pid": record.pid,
                           "restarts": int(supervision.get("restarts") or 0)}
    pid = supervision.get("pid")
    if isinstance(pid, int):
        row["pid"] = pid
    if state == "running" and supervision.get("state") == "restarting":
        row["state"] = "restarting"
    elif state == "running" and isinstance(pid, int) and not record.ssh_host \
            and not pid_running(pid):
        row["state"] = "restarting"         # died a moment ago; the supervisor will say so
    return row


def _is_this_machine(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", socket.gethostname())
