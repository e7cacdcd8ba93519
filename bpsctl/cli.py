"""The ``bpsctl`` command: parses flags into a :class:`Config` and calls the package APIs.

Exit codes: 0 success, 2 usage or configuration error, 1 runtime failure; ``run`` exits with
its first failing worker's code. Human output goes to stderr, ``--json`` output to stdout.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from bpsctl import launch
from bpsctl.cliutil import (
    LIBRARY_LOG,
    build_config,
    cli_errors,
    config_file_option,
    err_console,
    knob_option,
    missing_python_script,
    name_metavars,
    route_library_logs,
    status_until_output,
)
from bpsctl.config import ConfigError, check_backup_workers, check_training_mode
from bpsctl.engine.common import exit_on_sigterm
from bpsctl.model import Layout

app = typer.Typer(name="bpsctl", no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  rich_markup_mode="markdown",              # re-flows docstring paragraphs
                  pretty_exceptions_show_locals=False,      # locals would show the secret
                  help="Launch, benchmark and tune data-parallel training around an embedded "
                       "BytePS-style parameter server, with no MPI. By default the scheduler, "
                       "servers and workers run as local processes on this machine; --emulate "
                       "builds an emulated cluster instead (a network namespace per host, NIC "
                       "rate set by --nic; needs root), and --hosts runs on real hosts over SSH. "
                       "`bpsctl bench` measures push_pull and synthetic training against ring "
                       "allreduce, Horovod and torch DDP; `bpsctl tune` finds the partition size, "
                       "server count, credit and layout that are fastest on your hosts.")
def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version
        try:
            number = version("bpsctl")
        except PackageNotFoundError:
            number = "unknown (not installed)"
        print(f"bpsctl {number}")
        raise typer.Exit(0)


@app.callback()
def root(ctx: typer.Context,
         state_dir: Path | None = knob_option("state_dir", "--state-dir"),
         debug: bool = typer.Option(False, "--debug", envvar="BPSCTL_DEBUG", show_envvar=True,
                                    help="Also print the log records of the libraries bpsctl "
                                         "uses (paramiko, fabric, ...), tracebacks included; "
                                         "without it they go to the state dir's "
                                         f"{LIBRARY_LOG}."),
         _version: bool = typer.Option(False, "--version", is_eager=True,
                                       callback=_print_version,
                                       help="Print bpsctl's version and exit."),
         ) -> None:
    ctx.obj = {"state_dir": state_dir, "debug": debug}
    route_library_logs(state_dir, debug)


# --------------------------------------------------------------------------- --hosts (SSH)

def _hosts_option() -> Any:
    return typer.Option(None, "--hosts", envvar="BPSCTL_HOSTS", show_envvar=True,
                        help="hosts.yaml, a `host slots=N` hostfile or h1:4,h2:4: launch over "
                             "SSH on those hosts instead of this machine.")


def _ship_option() -> Any:
    return typer.Option(False, "--ship", help="Install this bpsctl (as a wheel), and what each "
                                              "host lacks of its dependencies, into every host's "
                                              "`python:` before starting (with --hosts).")


def _check_ssh_extra(hosts: str | None) -> None:
    if hosts:
        try:
            import fabric  # noqa: F401
            import pydantic  # noqa: F401
            import yaml  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"--hosts needs the [ssh] extra ({exc}); pip install 'bpsctl[ssh]'"
                              ) from None


def _ignored_hosts_option() -> Any:
    # kept so that scripts written when these commands took --hosts still run: the cluster is
    # the one recorded in the state dir, whatever its kind
    return typer.Option(None, "--hosts", hidden=True)


# --------------------------------------------------------------------------- up

@app.command()
def up(ctx: typer.Context,
       servers: int | None = typer.Option(
           None, "--servers", min=0,
           help="Summation servers to start (default: num_servers of the config file, else 1); "
                "with --emulate, each on a CPU host of its own (0 with --colocated-servers)."),
       colocated_servers: bool | None = knob_option("colocated_servers", "--colocated-servers"),
       cpu_share: str | None = knob_option("cpu_share", "--cpu-share"),
       spare_servers: int | None = knob_option("spare_servers", "--spare-servers"),
       port: int | None = knob_option("port", "--port"),
       start_timeout_s: float | None = knob_option("start_timeout_s", "--start-timeout"),
       hosts: str | None = _hosts_option(),
       worker_hostfile: Path | None = typer.Option(
           None, "--worker-hostfile",
           help="BytePS's dist_launcher.py worker hostfile (one host or host:ssh_port a line: "
                "a worker machine each), with --server-hostfile: launch over SSH on them."),
       server_hostfile: Path | None = typer.Option(
           None, "--server-hostfile",
           help="BytePS's dist_launcher.py server hostfile (a server for each line; the "
                "scheduler on the first), with --worker-hostfile."),
       ship: bool = _ship_option(),
       emulate: bool | None = knob_option("emulate", "--emulate"),
       workers: int = typer.Option(2, "--workers", min=1,
                                   help="With --emulate: worker hosts to build."),
       nic: str | None = knob_option("nic", "--nic"),
       straggler: str | None = knob_option("straggler", "--straggler"),
       security: str | None = knob_option("security", "--security"),
       use_slurm: bool = typer.Option(
           False, "--slurm", help="Inside a Slurm allocation (salloc or an sbatch script): "
                                  "start the scheduler and servers as `srun --overlap` steps "
                                  "on the allocation's nodes; `run` then starts one worker per "
                                  "task (--ntasks-per-node)."),
       servers_per_node: int | None = typer.Option(
           None, "--servers-per-node", help="With --slurm: servers on each node (default 1), "
                                            "or on each of the --server-nodes."),
       server_nodes: int = typer.Option(
           0, "--server-nodes", help="With --slurm: the first N nodes of the allocation run "
                                     "only servers; workers go to the others."),
       config_file: Path | None = config_file_option(),
       ) -> None:
    """Start a scheduler and summation servers on this machine (or over SSH with --hosts, or
    on the nodes of a Slurm allocation with --slurm).

    With --emulate (root), each server and worker gets a host of its own: a network namespace
    whose NIC is shaped to --nic, so the cluster behaves like machines on a real network.
    """
    with cli_errors():
        config = build_config(ctx, {"port": (port, "--port"),
                                    "start_timeout_s": (start_timeout_s, "--start-timeout"),
                                    "emulate": (emulate, "--emulate"), "nic": (nic, "--nic"),
                                    "straggler": (straggler, "--straggler"),
                                    "security": (security, "--security"),
                                    "spare_servers": (spare_servers, "--spare-servers"),
                                    "colocated_servers": (colocated_servers,
                                                          "--colocated-servers"),
                                    "cpu_share": (cpu_share, "--cpu-share")},
                              config_file, read_file=True)
        check_backup_workers(config.backup_workers, config.world_size)
        if servers is None:
            servers = 0 if config.colocated_servers else config.num_servers or 1
        the_hosts: Any = hosts
        if worker_hostfile is not None or server_hostfile is not None:
            the_hosts = _byteps_hostfiles(hosts, worker_hostfile, server_hostfile)
        _check_ssh_extra(hosts)
        if config.security == "none":
            err_console.print("[yellow]warning:[/] --security none: anyone who can reach the "
                              "cluster's ports can join it, read and change its gradients; "
                              "use it only on a trusted network", highlight=False)
        if use_slurm:
            doing = "starting job steps on the Slurm allocation"
        elif config.emulate and not hosts:
            doing = (f"building {workers} worker and {servers + config.spare_servers} server "
                     "host(s)" + (", a server on each worker host" if config.colocated_servers
                                  else ""))
        elif the_hosts:
            doing = "starting over SSH"
        else:
            doing = f"starting the scheduler and {servers + config.spare_servers} server(s)"
        with err_console.status(doing) as spinner:
            cluster = launch.up(config, servers=servers, workers=workers, hosts=the_hosts,
                                ship_wheel=ship, progress=lambda text: spinner.update(text),
                                use_slurm=use_slurm, servers_per_node=servers_per_node,
                                server_nodes=server_nodes)
        what = {"emulated": "emulated cluster", "slurm": "Slurm cluster"}.get(cluster.kind,
                                                                             "cluster")
        nic_text = f", NIC {config.nic or 'unshaped'}" if cluster.kind == "emulated" else ""
        nic_text += "".join(f", worker {rank}'s at {factor:g}x" for rank, factor in
                            config.stragglers.items())
        nic_text += "".join(f", worker {rank}'s host at {factor:g} CPU" for rank, factor in
                            config.cpu_stragglers.items())
        err_console.print(f"{what} [bold]{escape(cluster.name)}[/] is up, scheduler at "
                          f"{cluster.scheduler}{nic_text}", highlight=False)
        _print_processes(launch.status(config.state_dir)["processes"])
        if cluster.layout is not None:
            err_console.print(Layout.from_json(cluster.layout).describe(), highlight=False)
        np_hint = {"emulated": f" -np {workers}", "local": " -np N"}.get(cluster.kind, "")
        where = (" (workers go to the worker hosts; bpsctl down removes everything)"
                 if cluster.kind == "emulated" else "   (bpsctl down stops it)")
        err_console.print(f"next: bpsctl run{np_hint} -- python examples/train.py{where}",
                          highlight=False)


def _byteps_hostfiles(hosts: str | None, worker_hostfile: Path | None,
                      server_hostfile: Path | None) -> Any:
    """The HostsSpec of BytePS's --worker-hostfile/--server-hostfile pair (both, no --hosts)."""
    if hosts:
        raise ConfigError("--worker-hostfile/--server-hostfile name the hosts already; drop "
                          "--hosts (or write both roles into one hosts.yaml)")
    if worker_hostfile is None or server_hostfile is None:
        missing = "--server-hostfile" if server_hostfile is None else "--worker-hostfile"
        raise ConfigError(f"{missing}: BytePS's hostfiles come as a pair; give both "
                          "--worker-hostfile and --server-hostfile")
    _check_ssh_extra(str(worker_hostfile))
    from bpsctl.launch.hosts import load_byteps_hostfiles  # PyYAML and pydantic: the [ssh] extra
    return load_byteps_hostfiles(worker_hostfile, server_hostfile)


# --------------------------------------------------------------------------- run

@app.command(context_settings={"allow_interspersed_args": False})
def run(ctx: typer.Context,
        np: int | None = knob_option("world_size", "-np", min=1),
        servers: int | None = typer.Option(
            None, "--servers", min=1, help="Servers of the private cluster started when none "
                                           "is up (default: num_servers of the config, else 1)."),
        start_timeout_s: float | None = knob_option("start_timeout_s", "--start-timeout"),
        min_workers: int | None = knob_option("min_workers", "--min-workers", min=0),
        max_restarts: int | None = knob_option("max_restarts", "--max-restarts", min=0),
        max_workers: int | None = knob_option("max_workers", "--max-workers", min=0),
        attach: bool = typer.Option(
            False, "--attach", help="Start -np more workers of CMD that join the job a `bpsctl "
                                    "run --max-workers W` is running from this state dir, with "
                                    "its next unused ranks (local and emulated clusters)."),
        backup_workers: int | None = knob_option("backup_workers", "--backup-workers"),
        staleness: int | None = knob_option("staleness", "--staleness"),
        async_mode: bool | None = knob_option("async_mode", "--async"),
        cmd: list[str] = typer.Argument(..., metavar="CMD",
                                        help="The worker command, e.g. python train.py."),
        hosts: str | None = _hosts_option(),
        ship: bool = _ship_option(),
        config_file: Path | None = config_file_option(),
        ) -> None:
    """Run N workers of CMD on the cluster that `up` started, or on a private one.

    Each worker's output is prefixed with its rank. When a worker fails the others are
    stopped and bpsctl exits with the failing worker's exit code; with --min-workers M the
    others go on while M live, averaging over the workers left; with --max-restarts R a failed
    worker is started again (R times in all) and rejoins the running job with a live worker's
    model and optimizer state. With --max-workers W the job may grow to W workers while it
    runs: `bpsctl run --attach -np K -- CMD` starts K more, which join it the same way.
    """
    with cli_errors():
        if attach:
            _check_attach_flags({"--servers": servers, "--min-workers": min_workers,
                                 "--max-restarts": max_restarts, "--max-workers": max_workers,
                                 "--backup-workers": backup_workers, "--hosts": hosts,
                                 "--staleness": staleness, "--async": async_mode,
                                 "--ship": ship})
            config = build_config(ctx, {"world_size": (np, "-np"),
                                        "start_timeout_s": (start_timeout_s, "--start-timeout")},
                                  config_file, read_file=True)
            result = launch.attach(cmd, config)
            for rank in result.joined:
                err_console.print(f"bpsctl run --attach: worker {rank} joined the job",
                                  highlight=False)
            _print_outcome(result)
            raise typer.Exit(result.exit_code)
        config = build_config(ctx, {"world_size": (np, "-np"),
                                    "start_timeout_s": (start_timeout_s, "--start-timeout"),
                                    "min_workers": (min_workers, "--min-workers"),
                                    "max_restarts": (max_restarts, "--max-restarts"),
                                    "max_workers": (max_workers, "--max-workers"),
                                    "backup_workers": (backup_workers, "--backup-workers"),
                                    "staleness": (staleness, "--staleness"),
                                    "async_mode": (async_mode, "--async")},
                              config_file, read_file=True)
        if config.min_workers > config.world_size:
            raise ConfigError(f"--min-workers {config.min_workers}: more than the job's "
                              f"{config.world_size} workers (-np); give at most -np")
        check_backup_workers(config.backup_workers, config.world_size)
        check_training_mode(config, {"staleness": "--staleness", "async_mode": "--async",
                                     "backup_workers": "--backup-workers",
                                     "max_restarts": "--max-restarts",
                                     "max_workers": "--max-workers"})
        servers = servers or config.num_servers or 1
        _check_ssh_extra(hosts)
        missing = None if hosts else missing_python_script(cmd, Path.cwd())
        if missing is not None:
            raise ConfigError(f"run: {cmd[0]} cannot open {missing!r}: no such file in "
                              f"{Path.cwd()} (the command after -- runs there on every worker; "
                              "check the script's path)")
        private = "" if launch.load_state(config.state_dir) is not None else \
            f" and a private cluster (scheduler, {servers} server{'s' * (servers != 1)})"
        with status_until_output(f"starting {config.world_size} workers of "
                                 f"{Path(cmd[0]).name}{private}; their output follows") as (
                out, err):
            result = launch.run(cmd, config, servers=servers, hosts=hosts, ship_wheel=ship,
                                stdout=out, stderr=err)
    _print_outcome(result)
    if result.joined:
        err_console.print("membership changed: " + ", ".join(
            f"worker {rank} joined" for rank in result.joined) + " (bpsctl run --attach)",
            highlight=False)
    if result.restarted:
        again = ", ".join(f"worker {f.rank} (pid {f.pid}, {_how(f)})" for f in result.restarted)
        err_console.print(f"membership changed: restarted {again} to rejoin the job",
                          highlight=False)
    if result.left_behind:
        lost = ", ".join(f"worker {f.rank} (pid {f.pid})" for f in result.left_behind)
        err_console.print(f"membership changed: the job went on without {lost}; "
                          f"{config.world_size - len(result.left_behind)} of "
                          f"{config.world_size} workers finished", highlight=False)
    raise typer.Exit(result.exit_code)


def _check_attach_flags(given: dict[str, Any]) -> None:
    """With --attach the job's settings are the running job's: refuse flags that set them."""
    setting = [flag for flag, value in given.items() if value not in (None, False)]
    if setting:
        raise ConfigError(f"{', '.join(setting)}: set when the job started; --attach joins it "
                          f"as it is, so drop {'it' if len(setting) == 1 else 'them'}")


def _print_outcome(result: launch.RunResult) -> None:
    """A lost cluster process, the root-cause table of a failure, or the stop."""
    if result.lost:
        label = "[bold red]error:[/]" if result.exit_code else "[yellow]warning:[/]"
        err_console.print(f"{label} {escape(result.lost)}", highlight=False)
    if result.failures:
        _print_failures(result)
    elif result.exit_code:
        err_console.print(f"bpsctl run: stopped every worker (exit code {result.exit_code})")


def _how(failure: launch.WorkerFailure) -> str:
    return f"signal {failure.signal_name}" if failure.signal_name else \
        f"exit code {failure.exit_code}"


def _print_failures(result: launch.RunResult) -> None:
    root_cause = result.failures[0]
    where = f" on {root_cause.host}" if root_cause.host else ""
    err_console.print(f"[bold red]error:[/] worker {root_cause.rank}{escape(where)} exited with "
                      f"code {root_cause.exit_code}; the remaining workers were stopped",
                      highlight=False)
    table = Table(show_lines=True)
    for column in ("", "rank", "pid", "exit code", "last output"):
        table.add_column(column, overflow="fold")
    for index, failure in enumerate(result.failures):
        exit_code = str(failure.exit_code)
        if failure.signal_name:
            exit_code += f" ({failure.signal_name})"
        table.add_row("root cause" if index == 0 else "", str(failure.rank), str(failure.pid),
                      exit_code, escape("\n".join(failure.last_lines[-8:])) or "(no output)")
    err_console.print(table, highlight=False)


# --------------------------------------------------------------------------- status, logs, down

@app.command()
def status(ctx: typer.Context,
           json_output: bool = typer.Option(False, "--json", help="Print only JSON, on stdout."),
           hosts: str | None = _ignored_hosts_option(),
           ) -> None:
    """Show the cluster's processes: running, spare (a spare server, holding nothing until a
    server is lost), lost (silent to the scheduler) or exited.

    Exits 1 if the scheduler or a server is not running.
    """
    with cli_errors():
        config = build_config(ctx, {})
        info = launch.status(config.state_dir)
    if json_output:
        typer.echo(json.dumps(info, indent=2))
    elif info["cluster"] is None:
        err_console.print(f"no cluster is up (state dir {config.state_dir}); "
                          "`bpsctl up` starts one", highlight=False)
    else:
        err_console.print(f"cluster [bold]{escape(info['cluster'])}[/], scheduler at "
                          f"{info['scheduler']}", highlight=False)
        _print_processes(info["processes"])
        if info["scheduler_error"]:
            err_console.print(f"[yellow]warning:[/] {escape(info['scheduler_error'])}",
                              highlight=False)
    unhealthy = [p for p in info["processes"]
                 if p["role"] != "worker" and p["state"] not in ("running", "spare")]
    raise typer.Exit(1 if unhealthy else 0)


def _print_processes(processes: list[dict[str, Any]]) -> None:
    table = Table()
    for column in ("role", "rank", "address", "pid", "state"):
        table.add_column(column)
    colors = {"running": "green", "spare": "cyan", "lost": "red", "exited": "yellow"}
    for process in processes:
        address = process["host"] + (f":{process['port']}" if process["port"] else "")
        state = process["state"]
        note = ("" if process.get("took_over") is None
                else f" (took over server {process['took_over']})")
        restarts = process.get("restarts")
        if restarts:
            note += f" (restarted {restarts} time{'s' if restarts != 1 else ''})"
        table.add_row(process["role"], str(process["rank"]), address, str(process["pid"]),
                      f"[{colors.get(state, 'white')}]{state}[/]{note}")
    err_console.print(table, highlight=False)


@app.command()
def logs(ctx: typer.Context,
         role: str | None = typer.Argument(
             None, metavar="[ROLE]",
             help="scheduler | server | server:N | worker | worker:N (default: all logs)."),
         hosts: str | None = _ignored_hosts_option(),
         ) -> None:
    """Print the logs of the cluster's processes and of the last run's workers."""
    with cli_errors():
        config = build_config(ctx, {})
        text = launch.logs(config.state_dir, role)
    sys.stdout.write(text)


@app.command()
def down(ctx: typer.Context, hosts: str | None = _ignored_hosts_option()) -> None:
    """Stop the cluster that `up` started (its logs are kept)."""
    with cli_errors():
        config = build_config(ctx, {})
        report = launch.down(config.state_dir)
    if report.removed_leftovers:
        err_console.print(f"removed the network namespaces of crashed emulated cluster(s) "
                          f"{', '.join(report.removed_leftovers)}", highlight=False)
    if report.removed_segments:
        err_console.print(f"removed the shared memory of crashed job(s) from /dev/shm: "
                          f"{', '.join(report.removed_segments)}", highlight=False)
    if report.busy_leftovers:
        err_console.print(f"[yellow]note:[/] emulated cluster(s) "
                          f"{', '.join(report.busy_leftovers)} still have processes in their "
                          "namespaces and were left alone (`ip netns pids bps-<id>-s0` lists "
                          "them; stop them by PID, then run `bpsctl down` again)",
                          highlight=False)
    if report.cluster is None:
        # said even when leftovers of other, crashed clusters were removed above: the cluster
        # this state dir would record is not up
        err_console.print(f"no cluster is up (state dir {config.state_dir}); nothing to stop",
                          highlight=False)
        return
    if report.survivors:
        survivors = escape("; ".join(report.survivors))
        err_console.print(f"[bold red]error:[/] could not stop {survivors}; run `bpsctl down` "
                          "again or kill them by PID", highlight=False)
        raise typer.Exit(1)
    err_console.print(f"stopped cluster {report.cluster} ({len(report.stopped)} processes); "
                      f"logs are in {launch.logs_dir(config.state_dir)}", highlight=False)


# --------------------------------------------------------------------------- k8s

k8s_app = typer.Typer(no_args_is_help=True, help="Kubernetes manifests for a bpsctl job.")


@k8s_app.command(context_settings={"allow_interspersed_args": False})
def render(workers: int = typer.Option(..., "--workers", help="Worker pods (an Indexed Job)."),
           servers: int = typer.Option(..., "--servers", help="Summation server pods (0 with "
                                                              "--colocated-servers)."),
           image: str = typer.Option(..., "--image",
                                     help="Worker image (dockerfiles/worker.Dockerfile)."),
           cmd: list[str] = typer.Argument(..., metavar="CMD",
                                           help="The worker command, e.g. python3 train.py."),
           server_image: str = typer.Option(
               "", "--server-image", help="Scheduler and server image "
                                          "(dockerfiles/server.Dockerfile; default: --image)."),
           name: str = typer.Option("bpsctl", "--name", help="Prefix of every object's name."),
           namespace: str | None = typer.Option(None, "--namespace"),
           port: int = typer.Option(9000, "--port", help="The scheduler's port (servers: +1)."),
           security: str = typer.Option("hmac", "--security", help="hmac, curve or none."),
           worker_cpu: str | None = typer.Option(None, "--worker-cpu", help="e.g. 8 or 500m."),
           worker_memory: str | None = typer.Option(None, "--worker-memory", help="e.g. 32Gi."),
           gpus_per_worker: int = typer.Option(0, "--gpus-per-worker",
                                               help="nvidia.com/gpu per worker pod."),
           server_cpu: str | None = typer.Option(None, "--server-cpu"),
           server_memory: str | None = typer.Option(None, "--server-memory"),
           worker_node: list[str] = typer.Option(
               [], "--worker-node", help="Node label key=value the worker pods require "
                                         "(node affinity; repeatable)."),
           server_node: list[str] = typer.Option(
               [], "--server-node", help="Node label key=value the scheduler and server pods "
                                         "require (repeatable)."),
           hosts_per_node: int = typer.Option(
               1, "--hosts-per-node", metavar="K",
               help="Worker processes in each worker pod (a hosts file's slots: one pod per "
                    "machine, one process per GPU); LOCAL_RANK 0..K-1, WORLD_SIZE = workers x "
                    "K."),
           colocated_servers: bool = typer.Option(
               False, "--colocated-servers",
               help="Every worker pod also runs a server beside its workers (a native sidecar), "
                    "BytePS's mixed layout with the --servers server pods; each server sums its "
                    "share of the bytes from the traffic model."),
           cpu_share: float | None = typer.Option(
               None, "--cpu-share", help="The server pods' share of the bytes, together (0 to "
                                         "1; default: the traffic model's optimum)."),
           dmlc: bool = typer.Option(
               False, "--dmlc", help="BytePS's way: every role runs bpslaunch from DMLC_* "
                                     "variables (scheduler, servers and workers are Jobs that "
                                     "end with the training job; docs/coming-from-byteps.md)."),
           ) -> None:
    """Write the manifests of a job to stdout (YAML, several documents): a Secret, the
    scheduler (Deployment + Service), the servers (Deployment) and the workers (an Indexed Job
    with a headless Service). `kubectl apply -f -` runs it; nothing is applied here.
    """
    from bpsctl.launch.k8s import K8sJob, render_manifests, to_yaml
    with cli_errors():
        job = K8sJob(workers=workers, servers=servers, image=image, command=tuple(cmd),
                     server_image=server_image, name=name, namespace=namespace, port=port,
                     security=security, worker_cpu=worker_cpu, worker_memory=worker_memory,
                     gpus_per_worker=gpus_per_worker, server_cpu=server_cpu,
                     server_memory=server_memory, worker_nodes=tuple(worker_node),
                     server_nodes=tuple(server_node), hosts_per_node=hosts_per_node,
                     colocated_servers=colocated_servers, cpu_share=cpu_share, dmlc=dmlc)
        text = to_yaml(render_manifests(job))
    sys.stdout.write(text)


# --------------------------------------------------------------------------- sub-apps

from bpsctl.bench.cli import bench_app, profile  # noqa: E402  (sub-apps after the root app)
from bpsctl.bench.install import install_app  # noqa: E402
from bpsctl.chaos.cli import chaos  # noqa: E402
from bpsctl.trace.cli import trace  # noqa: E402
from bpsctl.tune.cli import switch_given_a_value, tune  # noqa: E402

app.add_typer(bench_app, name="bench")
app.add_typer(install_app, name="install")
app.add_typer(k8s_app, name="k8s")
app.command(name="tune")(tune)
app.command(name="chaos", context_settings={"allow_interspersed_args": False})(chaos)
app.command(name="trace")(trace)
app.command(name="profile")(profile)



#: options of ``bpsctl`` itself (before any command) that are also taken after the command
#: (``bpsctl status --state-dir X``), as a user who reads one command's help expects
GLOBAL_OPTIONS = {"--state-dir": 1, "--debug": 0}


def hoist_global_options(argv: list[str]) -> list[str]:
    """``argv`` with :data:`GLOBAL_OPTIONS` found after the command moved before it (their
    values with them, ``--state-dir=X`` too); nothing after ``--`` (a worker's own command
    line) is touched."""
    end = argv.index("--") if "--" in argv else len(argv)
    hoisted: list[str] = []
    rest: list[str] = []
    i = 0
    while i < end:
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in GLOBAL_OPTIONS:
            takes = 0 if "=" in arg else GLOBAL_OPTIONS[name]
            hoisted.extend(argv[i:i + 1 + takes])
            i += 1 + takes
        else:
            rest.append(arg)
            i += 1
    return hoisted + rest + argv[end:]


#: narrower than this, help is click's plain layout (each option, then its help beside it,
#: long words such as environment variable names kept whole) instead of rich's panels,
#: whose help column shrinks to about 20 characters at 80 columns
RICH_HELP_MIN_COLUMNS = 120


def _typers(root_app: typer.Typer) -> list[typer.Typer]:
    """``root_app`` and every command group under it."""
    found = [root_app]
    for group in root_app.registered_groups:
        if group.typer_instance is not None:
            found.extend(_typers(group.typer_instance))
    return found


name_metavars(_typers(app))


def fit_help_to(columns: int) -> None:
    """Help in rich's panels on a wide terminal, in click's plain layout on a narrow one
    (:data:`RICH_HELP_MIN_COLUMNS`)."""
    mode = "markdown" if columns >= RICH_HELP_MIN_COLUMNS else None
    for each in _typers(app):
        each.rich_markup_mode = mode    # type: ignore[assignment]


def tune_switch_problem(args: list[str]) -> str | None:
    """:func:`switch_given_a_value` for a `tune` command line: the command is the first word
    that names one (a global option's value cannot: hoisted, they come first), so a worker
    script of `run` that is called tune is left alone. Other command lines cost nothing
    (the command tree is built only when a word reads tune)."""
    if "tune" not in args:
        return None
    import typer.main
    names = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    command = next((i for i, arg in enumerate(args) if arg in names), None)
    return switch_given_a_value(args[command:] if command is not None else [])


def main() -> None:
    # SIGTERM (e.g. `timeout`, a job scheduler) unwinds like Ctrl-C, so a private cluster a
    # command started is stopped by its `finally` instead of left running
    exit_on_sigterm()
    fit_help_to(shutil.get_terminal_size().columns)
    args = hoist_global_options(sys.argv[1:])
    problem = tune_switch_problem(args)
    if problem is not None:
        err_console.print(f"[bold red]error:[/] {escape(problem)}", highlight=False,
                          soft_wrap=True)
        sys.exit(2)
    app(args=args, prog_name="bpsctl")


if __name__ == "__main__":
    main()
