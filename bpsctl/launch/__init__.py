"""Starting, using and stopping bpsctl clusters: on this machine, on emulated hosts, over SSH.

Modules, bottom up: ``types`` (hosts, cluster records, results), ``processes`` (process groups),
``output`` (worker output relay), ``state`` (the state dir), ``hosts`` (hosts files),
``plan`` (pure: roles, ranks, ports, env), ``report`` (the status report), ``runloop`` (the one
run loop), ``emulate`` (network namespaces), ``transport``/``hostkeys``/``preflight``/``ship``
(SSH), the backends ``local`` (local and emulated), ``ssh`` and ``slurm`` (steps of a Slurm
allocation), then ``cluster`` (the one interface) and ``api`` (its entry points). ``remote`` is
the agent that runs on SSH hosts; ``k8s`` renders Kubernetes manifests (nothing is launched),
and ``pod`` runs the worker processes of one such pod.

The entry points are importable from here (``from bpsctl import launch; launch.run(...)``);
they load on first use, so that the agent, which needs none of them, starts quickly.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ClusterState", "DownReport", "Interrupted", "LaunchError", "ProcessRecord",
           "RunResult", "WorkerFailure", "attach", "down", "load_state", "local_cluster",
           "log_files", "logs", "logs_dir", "recorded", "run", "run_local", "run_on", "status",
           "up", "up_emulated", "up_local", "worker_plan", "worker_slots"]


def __getattr__(name: str) -> Any:
    if name == "Interrupted":
        from bpsctl.launch.processes import Interrupted
        return Interrupted
    if name in __all__:
        from bpsctl.launch import api
        return getattr(api, name)
    raise AttributeError(f"module 'bpsctl.launch' has no attribute {name!r}")
