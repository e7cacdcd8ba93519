"""Starting, using and stopping bpsctl clusters (the embedded local default)."""
from bpsctl.launch.api import (ClusterState, DownReport, LaunchError, ProcessRecord, RunResult,
                               WorkerFailure, down, load_state, local_cluster, log_files, logs,
                               logs_dir, run_local, status, up_local)
from bpsctl.launch.processes import Interrupted

__all__ = ["ClusterState", "DownReport", "Interrupted", "LaunchError", "ProcessRecord",
           "RunResult", "WorkerFailure", "down", "load_state", "local_cluster", "log_files",
           "logs", "logs_dir", "run_local", "status", "up_local"]
