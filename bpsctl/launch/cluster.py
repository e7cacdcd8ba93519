"""One interface to every cluster: ``up``, ``down``, ``status``, ``logs`` and ``run``.

The backend is chosen once: by the flags for ``up`` (``--emulate``: emulated hosts,
``--hosts``: SSH, ``--slurm``: job steps of the Slurm allocation bpsctl runs in, else the
embedded default of local processes), and by what the state dir records for everything after
it. ``run`` uses the recorded cluster, or starts a private one
for the job (and stops it afterwards); ``attach`` (``run --attach``) starts more workers that
join the job a ``run`` is running. The CLI, ``bench`` and ``tune`` call only this module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from bpsctl.config import Config, ConfigError
from bpsctl.engine import EngineError
from bpsctl.errors import UsageError
from bpsctl.launch import local, slurm, ssh, state
from bpsctl.launch.plan import Assignment, Plan, cluster_hosts, plan
from bpsctl.launch.processes import identify, stop_signals_recorded
from bpsctl.launch.report import no_cluster
from bpsctl.launch.runloop import STOP_GRACE_S, new_job_id, run_workers
from bpsctl.launch.types import ClusterState, DownReport, HostsSpec, LaunchError, RunResult


def up(config: Config, *, servers: int, workers: int | None = None,
       hosts: HostsSpec | str | Path | None = None, ship_wheel: bool = False,
       progress: Callable[[str], None] | None = None, use_slurm: bool = False,
       servers_per_node: int | None = None, server_nodes: int = 0) -> ClusterState:
    """Start a scheduler and ``servers`` summation servers and record them in the state dir:
    on emulated hosts with ``config.emulate`` (``workers`` worker hosts), on the hosts of
    ``hosts`` over SSH, as steps of the current Slurm allocation with ``use_slurm``
    (``servers_per_node`` on each node, or on ``server_nodes`` dedicated nodes), else on this
    machine."""
    if config.spare_servers and use_slurm:
        raise ConfigError("--spare-servers / BPSCTL_SPARE_SERVERS: spare servers are started on "
                          "this machine, on emulated hosts or on SSH hosts; on a Slurm "
                          "allocation give --spare-servers 0 (the job still goes on through a "
                          "lost server, on the others)")
    if config.spare_servers and hosts:
        raise ConfigError("--spare-servers / BPSCTL_SPARE_SERVERS: on SSH hosts the hosts file "
                          "says where spare servers run: add `spare: true` to a `servers:` entry, "
                          "e.g. {host: 10.0.0.7, spare: true}, and give --spare-servers 0")
    if config.colocated_servers and not (config.emulate or use_slurm):
        raise ConfigError("--colocated-servers / BPSCTL_COLOCATED_SERVERS: puts a server on each "
                          "emulated worker host (--emulate) or worker node (--slurm); "
                          + ("on SSH hosts list the worker hosts under `servers:` in the hosts "
                             "file instead, and drop it" if hosts else "on this machine every "
                             "server already shares the workers' host: drop it"))
    if use_slurm:
        if config.emulate or hosts:
            raise ConfigError("--slurm places everything on the allocation's nodes; drop "
                              + ("--emulate" if config.emulate else "--hosts"))
        return slurm.up(config, servers_per_node=servers_per_node, server_nodes=server_nodes,
                        colocated=config.colocated_servers, progress=progress)
    if servers_per_node is not None or server_nodes:
        raise ConfigError("--servers-per-node and --server-nodes place servers on the nodes of "
                          "a Slurm allocation; add --slurm (or use --servers)")
    if config.emulate:
        if hosts:
            raise ConfigError("--emulate builds its own hosts; drop --hosts")
        if workers is None:
            raise ConfigError("--workers: an emulated cluster needs the number of worker hosts")
        return local.up_emulated(config, workers, servers)
    if config.straggler:
        raise ConfigError("--straggler: a slow NIC or CPU on purpose needs an emulated "
                          "cluster; add --emulate (and --nic for a slow NIC)")
    if config.nic:
        raise ConfigError("--nic: a NIC rate only applies to an emulated cluster; add --emulate")
    if hosts:
        return ssh.up(hosts, config, ship_wheel=ship_wheel, progress=progress)
    return local.up_local(config, servers)


def down(state_dir: Path | str) -> DownReport:
    """Stop the cluster recorded in ``state_dir`` and forget it; logs are kept. With none
    recorded, remove what crashed emulated runs left. Safe to repeat: if a process survives,
    the state file is kept so that ``down`` can be run again."""
    state_dir = Path(state_dir)
    if not state.state_file(state_dir).exists():
        removed, busy = local.remove_leftovers(state_dir)
        return DownReport(cluster=None, removed_leftovers=removed, busy_leftovers=busy)
    # Ctrl-C is recorded and ignored: stopping half the cluster would help nobody.
    with state.state_lock(state_dir), stop_signals_recorded():
        cluster = state.load_state(state_dir)
        if cluster is None:
            return DownReport(cluster=None)
        if cluster.kind == "local" or cluster.kind == "emulated":
            return local.down(cluster)
        report = slurm.down(cluster) if cluster.kind == "slurm" else ssh.down(cluster)
        # workers may have run on this machine too
        return dataclasses.replace(report, removed_segments=local.remove_shared_memory(cluster))


def status(state_dir: Path | str) -> dict[str, Any]:
    """The recorded cluster as JSON (see :func:`bpsctl.launch.report.status_report`)."""
    cluster = state.load_state(state_dir)
    if cluster is None:
        return no_cluster(state_dir)
    if cluster.kind == "slurm":
        return slurm.status(cluster)
    return ssh.status(cluster) if cluster.kind == "ssh" else local.status(cluster)


def logs(state_dir: Path | str, role: str | None = None) -> str:
    """The logs of ``role`` (scheduler | server | server:N | worker | worker:N | None for all),
    fetched from the hosts first for an SSH cluster (a Slurm step's output is already here)."""
    cluster = state.load_state(state_dir)
    if cluster is not None and cluster.kind == "ssh":
        ssh.fetch_logs(cluster, role)
    return state.read_logs(state_dir, role)


def recorded(state_dir: Path | str) -> ClusterState | None:
    """The cluster recorded in ``state_dir`` that still runs, or None. A local cluster whose
    servers run but whose scheduler has exited is an error that says how to recover."""
    cluster = state.load_state(state_dir)
    if cluster is None or cluster.kind == "ssh":
        return cluster
    return local.live_cluster(Path(state_dir))


@contextlib.contextmanager
def private_cluster(config: Config, *, servers: int = 1, workers: int | None = None,
                    hosts: HostsSpec | str | Path | None = None,
                    ship_wheel: bool = False) -> Iterator[ClusterState]:
    """A cluster for one job: on ``hosts`` over SSH, recorded in ``config.state_dir`` (where
    ``run`` records every job's logs); else local or emulated, in a temporary state dir.
    Always stopped (and a temporary state dir removed) on exit."""
    if not hosts:
        with local.local_cluster(config, servers, workers) as cluster:
            yield cluster
        return
    cluster = ssh.up(hosts, config, ship_wheel=ship_wheel)
    try:
        yield cluster
    finally:
        down(cluster.state_dir)


def worker_plan(cluster: ClusterState, config: Config, workers: int | None = None,
                job_id: str = "", master_port: int | None = None) -> Plan:
    """Every worker of one job on ``cluster``: one per slot of an SSH cluster's hosts file, else
    ``workers`` of them (the embedded default: on this machine; emulated: spread over the
    worker hosts). A local job's ``MASTER_PORT`` is a free port unless ``master_port`` says."""
    config = config.replace(security=cluster.security)
    job_id = job_id or new_job_id()
    if cluster.kind == "ssh":
        return ssh.worker_plan(cluster, config, job_id)
    if cluster.kind == "slurm":
        return slurm.worker_plan(cluster, config, job_id)
    hosts = cluster_hosts(cluster, workers if workers is not None else config.world_size,
                          master_port=local.free_port() if master_port is None else master_port)
    return plan(hosts, config, secret=cluster.secret, job_id=job_id)


def worker_slots(cluster: ClusterState, workers: int | None = None) -> tuple[Assignment, ...]:
    """Where each worker rank of a job on ``cluster`` would run (``.rank``, ``.host``,
    ``.address``, ``.local_rank``, ...)."""
    return worker_plan(cluster, Config(), workers, master_port=0).workers    # no job: no port


def run(cmd: list[str], config: Config, *, workers: int | None = None, servers: int = 1,
        hosts: HostsSpec | str | Path | None = None, ship_wheel: bool = False,
        stdout: IO[str] | None = None, stderr: IO[str] | None = None,
        stop_grace_s: float = STOP_GRACE_S) -> RunResult:
    """Run the workers of ``cmd`` on the recorded cluster, or on a private one (``servers``
    servers, on ``hosts`` if given) stopped afterwards; stream their output prefixed with
    their rank. ``workers`` (default ``config.world_size``) is the job's size except on an SSH
    cluster, where it is the hosts file's slots.

    The first worker to fail is the root cause: the others are stopped and its exit code is
    returned. Ctrl-C or SIGTERM stops every worker. Every worker has been waited for when this
    returns.
    """
    workers = _checked_workers(config, workers, cmd, "bpsctl run -np 2 -- python train.py")
    state_dir = Path(config.state_dir).resolve()
    config = config.replace(state_dir=state_dir)
    state.make_state_dir(state_dir)
    cluster = recorded(state_dir)
    if cluster is not None:
        return run_on(cluster, cmd, config, workers, stdout=stdout, stderr=stderr,
                      stop_grace_s=stop_grace_s)
    with private_cluster(config, servers=servers, hosts=hosts, ship_wheel=ship_wheel) as cluster:
        return run_on(cluster, cmd, config, workers, stdout=stdout, stderr=stderr,
                      stop_grace_s=stop_grace_s)


def run_on(cluster: ClusterState, cmd: list[str], config: Config, workers: int | None = None, *,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None,
           stop_grace_s: float = STOP_GRACE_S) -> RunResult:
    """Run one job's workers on ``cluster`` through the one run loop (see :func:`run`). While
    it runs, the job is recorded in ``config.state_dir`` for :func:`attach`."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    config = config.replace(security=cluster.security)
    the_plan = worker_plan(cluster, config, workers)
    if cluster.kind in ("local", "emulated") and shutil.which(cmd[0]) is None:
        raise LaunchError(f"cannot run {cmd[0]!r}: no such executable (in PATH)")
    state.write_job(config.state_dir, {
        "job_id": the_plan.job_id, "world_size": the_plan.world_size,
        "max_workers": max(config.max_workers, the_plan.world_size),
        "backup_workers": config.backup_workers, "master_port": the_plan.master_port,
        "cluster_state_dir": cluster.state_dir, "pid": os.getpid(),
        "create_time": identify(os.getpid()).create_time})
    try:
        if cluster.kind == "ssh":
            with ssh.SshSpawner(cluster, cmd, config, stdout, stderr) as spawner:
                result = run_workers(spawner, the_plan, config, stop_grace_s=stop_grace_s)
        elif cluster.kind == "slurm":
            result = run_workers(slurm.SlurmSpawner(cluster, cmd, config, stdout, stderr),
                                 the_plan, config, stop_grace_s=stop_grace_s)
        else:
            # the worker logs of a private cluster go to the caller's state dir, which
            # outlives it
            result = run_workers(local.LocalSpawner(cluster, cmd, config, stdout, stderr),
                                 the_plan, config, stop_grace_s=stop_grace_s)
    finally:
        joined = state.forget_job(config.state_dir, the_plan.job_id)
    return dataclasses.replace(result, joined=tuple(joined))


def attach(cmd: list[str], config: Config, workers: int | None = None, *,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None,
           stop_grace_s: float = STOP_GRACE_S) -> RunResult:
    """Start ``workers`` (default ``config.world_size``) more workers of ``cmd`` that join the
    job a `bpsctl run --max-workers W` runs from ``config.state_dir``, on its cluster's worker
    hosts, with the job's next unused ranks (placed where `run` places those ranks of a job
    that size). Each joins as a restarted worker rejoins (docs/design.md §5): a live worker
    admits it to every server at its next step boundary and hands it the model. Their output
    is streamed; the first to fail is the root cause (see :func:`run`). ``joined`` of the
    result lists the ranks the scheduler saw join.

    A :class:`UsageError` (exit 2) says why when no job runs, the job's cluster is not local
    or emulated, or the job has fewer than ``workers`` ranks left below W.
    """
    workers = _checked_workers(config, workers, cmd,
                               "bpsctl run --attach -np 1 -- python train.py")
    state_dir = Path(config.state_dir).resolve()
    job = state.load_job(state_dir)
    cluster = state.load_state(job["cluster_state_dir"]) if job is not None else None
    if job is None or cluster is None:
        raise UsageError(f"--attach: no job is running from {state_dir}; start one with "
                         "`bpsctl run --max-workers W -np N -- CMD`, then attach while it runs "
                         "(with the same --state-dir)")
    job_id = str(job["job_id"])
    if cluster.kind not in ("local", "emulated"):
        raise UsageError(f"--attach: job {job_id} runs on a {cluster.kind} cluster; attaching "
                         "workers is built for local and emulated clusters only")
    try:
        view = local.scheduler_view(cluster)
    except EngineError as exc:
        raise LaunchError(f"--attach: the scheduler of job {job_id} did not answer: {exc}"
                          ) from None
    running = view.get("job")
    if not running or running["id"] != job_id or not running["started"]:
        raise UsageError(f"--attach: job {job_id} is not running (it has not started yet, or "
                         "has ended); attach while it runs")
    max_workers = int(running.get("max_workers") or running["world_size"])
    taken = {int(w["rank"]) for w in view["workers"]}
    free = sorted(set(range(max_workers)) - taken)
    if len(free) < workers:
        grow = ("it was started without --max-workers, so it cannot grow"
                if max_workers == running["world_size"] else
                f"ranks {', '.join(map(str, sorted(taken)))} of its --max-workers "
                f"{max_workers} are taken")
        raise UsageError(f"--attach -np {workers}: job {job_id} has room for {len(free)} more "
                         f"worker(s) ({grow}); start the job with a larger `bpsctl run "
                         "--max-workers W`, or attach fewer")
    if shutil.which(cmd[0]) is None:
        raise LaunchError(f"cannot run {cmd[0]!r}: no such executable (in PATH)")
    ranks = free[:workers]
    # the job's own settings, whatever this command's environment says
    engine_config = config.replace(
        state_dir=state_dir, security=cluster.security, world_size=int(job["world_size"]),
        max_workers=max_workers, backup_workers=int(job["backup_workers"]), attach=True,
        min_workers=0, max_restarts=0, rejoin=False)
    grown = worker_plan(cluster, engine_config, ranks[-1] + 1, job_id=job_id,
                        master_port=int(job["master_port"]))
    the_plan = dataclasses.replace(grown, workers=tuple(grown.workers[r] for r in ranks),
                                   job_size=int(job["world_size"]))
    done = threading.Event()
    joined: list[int] = []
    watcher = threading.Thread(target=_watch_joins, name="bpsctl-attach-watch", daemon=True,
                               args=(cluster, state_dir, job_id, ranks, joined, done))
    watcher.start()
    try:
        result = run_workers(local.LocalSpawner(cluster, cmd, engine_config,
                                                stdout if stdout is not None else sys.stdout,
                                                stderr if stderr is not None else sys.stderr),
                             the_plan, engine_config, stop_grace_s=stop_grace_s)
    finally:
        done.set()
        watcher.join(timeout=5)
    return dataclasses.replace(result, joined=tuple(sorted(joined)))


_JOIN_POLL_S = 0.25


def _watch_joins(cluster: ClusterState, state_dir: Path, job_id: str, ranks: list[int],
                 joined: list[int], done: threading.Event) -> None:
    """Until ``done`` or every one of ``ranks`` joined: ask the scheduler which run in job
    ``job_id`` now, and record each that does in the job's record (its `run` says so)."""
    while len(joined) < len(ranks) and not done.wait(_JOIN_POLL_S):
        try:
            view = local.scheduler_view(cluster, timeout_s=1.0)
        except EngineError:
            continue            # the run loop notices a lost scheduler
        if (view.get("job") or {}).get("id") != job_id:
            continue
        for worker in view["workers"]:
            rank = int(worker["rank"])
            if rank in ranks and worker["state"] == "running" and rank not in joined:
                joined.append(rank)
                state.record_joined(state_dir, job_id, rank)


def _checked_workers(config: Config, workers: int | None, cmd: Sequence[str],
                     example: str) -> int:
    """The number of workers to start (``-np``, else the config's world size), after checking
    it and that there is a command; ``example`` is the command line the error shows."""
    workers = config.world_size if workers is None else workers
    if workers < 1:
        raise ConfigError(f"-np: expected at least 1 worker, got {workers}")
    if not cmd:
        raise ConfigError(f"CMD: expected the command to run after `--`, e.g. `{example}`")
    return workers
