"""Starting, using and stopping bpsctl clusters: on this machine, on emulated hosts, over SSH.

Modules, bottom up: ``types`` (hosts, cluster records, results), ``processes`` (process groups),
``output`` (worker output relay), ``state`` (the state dir), ``hosts`` (hosts files),
``plan`` (pure: roles, ranks, ports, env), ``status`` (the status report), ``runloop`` (the one
run loop), ``emulate`` (network namespaces), ``transport``/``preflight``/``ship`` (SSH), the
backends ``local`` (local and emulated) and ``ssh``, then ``cluster`` (the one interface) and
``api`` (its entry points). ``remote`` is the agent that runs on SSH hosts.
"""
from bpsctl.launch.api import (ClusterState, DownReport, LaunchError, ProcessRecord, RunResult,
                               WorkerFailure, down, load_state, local_cluster, log_files, logs,
                               logs_dir, run, run_local, status, up, up_emulated, up_local,
                               worker_slots)
from bpsctl.launch.processes import Interrupted

__all__ = ["ClusterState", "DownReport", "Interrupted", "LaunchError", "ProcessRecord",
           "RunResult", "WorkerFailure", "down", "load_state", "local_cluster", "log_files",
           "logs", "logs_dir", "run", "run_local", "status", "up", "up_emulated", "up_local",
           "worker_slots"]
