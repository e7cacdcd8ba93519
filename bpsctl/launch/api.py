"""The launch package's API: its types and the functions the CLI, ``bench`` and tests call.

Every cluster — the embedded default, emulated hosts, SSH hosts — is recorded in
``<state_dir>/cluster.json`` (mode 0600: it holds the cluster's secret) and driven through
:mod:`bpsctl.launch.cluster`; this module names the common entry points in one place.
"""
from __future__ import annotations

from pathlib import Path
from typing import IO

from bpsctl.config import Config
from bpsctl.launch.cluster import (
    attach,
    down,
    logs,
    private_cluster,
    recorded,
    run,
    run_on,
    status,
    up,
    worker_plan,
    worker_slots,
)
from bpsctl.launch.local import local_cluster, up_emulated, up_local
from bpsctl.launch.runloop import STOP_GRACE_S
from bpsctl.launch.state import load_state, log_files, logs_dir, state_file
from bpsctl.launch.types import (
    ClusterState,
    DownReport,
    LaunchError,
    ProcessRecord,
    RunResult,
    WorkerFailure,
)


def run_local(cmd: list[str], np: int, config: Config, servers: int = 1,
              stdout: IO[str] | None = None, stderr: IO[str] | None = None,
              stop_grace_s: float = STOP_GRACE_S) -> RunResult:
    """Run ``np`` workers of ``cmd`` on the cluster in ``config.state_dir``, or on a private
    local one with ``servers`` servers; see :func:`bpsctl.launch.cluster.run`."""
    return run(cmd, config, workers=np, servers=servers, stdout=stdout, stderr=stderr,
               stop_grace_s=stop_grace_s)


def up_ssh(hosts: str | Path, config: Config, *, ship_wheel: bool = False) -> ClusterState:
    """Start a cluster on the hosts of a hosts file over SSH; see :func:`bpsctl.launch.ssh.up`."""
    return up(config, servers=0, hosts=hosts, ship_wheel=ship_wheel)


__all__ = ["ClusterState", "DownReport", "LaunchError", "ProcessRecord", "RunResult",
           "WorkerFailure", "attach", "down", "load_state", "local_cluster", "log_files", "logs",
           "logs_dir", "private_cluster", "recorded", "run", "run_local", "run_on", "state_file",
           "status", "up", "up_emulated", "up_local", "up_ssh", "worker_plan", "worker_slots"]
