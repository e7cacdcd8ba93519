"""Starting, using and stopping bpsctl clusters: the embedded local default and emulated hosts."""
from bpsctl.launch.api import (ClusterState, DownReport, LaunchError, ProcessRecord, RunResult,
                               WorkerFailure, down, load_state, local_cluster, log_files, logs,
                               logs_dir, run_local, status, up_emulated, up_local,
                               worker_slots)
from bpsctl.launch.processes import Interrupted

__all__ = ["ClusterState", "DownReport", "Interrupted", "LaunchError", "ProcessRecord",
           "RunResult", "WorkerFailure", "down", "load_state", "local_cluster", "log_files",
           "logs", "logs_dir", "run_local", "status", "up_emulated", "up_local", "worker_slots"]
