"""A real Slurm cluster on emulated hosts, for the tests of ``bpsctl up --slurm`` (root only).

Debian's ``slurm-wlm`` 22.05 and ``munge``: one ``munged`` (its socket is a file, so every
network namespace reaches it), ``slurmctld`` in the namespace of host ``s0``, and one
``slurmd -N wK`` in the namespace of every worker host ``wK`` (each binds port 6818 on its own
address), all reading one ``slurm.conf`` written here. Every daemon runs in the foreground
(``-D``), started by this helper as the leader of its own process group and stopped by PID.
Clients (``sbatch``, ``squeue``, ``scontrol``) run in the controller's namespace with
``SLURM_CONF`` pointing at the file.

What does not work in this VM, and is therefore not used: cgroups for process tracking
(``proctrack/cgroup`` needs a cgroup v2 hierarchy with delegation), so processes are tracked by
``proctrack/linuxproc`` (the parent-child tree under ``slurmstepd``), which is what makes
``scancel`` reach every process of a step.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bpsctl.launch import emulate

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue",
                  "scancel")
PACKAGES = "apt-get install -y slurm-wlm slurmctld slurmd slurm-client munge"
READY_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[1]      # the bpsctl under test
CPUS_PER_NODE = 2        # what slurmd finds on this VM


def missing_slurm() -> str | None:
    """Why a real Slurm cannot be started here, or None."""
    absent = [name for name in SLURM_BINARIES if shutil.which(name) is None
              and not Path(f"/usr/sbin/{name}").exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): {PACKAGES}"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    network: emulate.EmulatedNetwork
    directory: Path
    nodes: tuple[str, ...]                  # worker host names: w0, w1, ...
    controller: str = "s0"
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)
    setup_s: float = 0.0

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    def env(self) -> dict[str, str]:
        """Our environment for a Slurm client, without any SLURM_* of an enclosing job; jobs
        import the bpsctl under test and run the Python running the tests, as `python`,
        whether or not its virtualenv is activated (sbatch and salloc pass the environment
        on)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        path = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        bin_path = [str(Path(sys.executable).parent), env.get("PATH", os.defpath)]
        return {**env, "SLURM_CONF": str(self.conf), "PYTHONPATH": os.pathsep.join(path),
                "PATH": os.pathsep.join(bin_path)}

    def popen(self, *argv: str, out: Path) -> subprocess.Popen:
        """A client command (``salloc ...``) in the background, output to ``out``."""
        with open(out, "w") as log:
            return subprocess.Popen(self.command(self.controller, list(argv)), env=self.env(),
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` in ``host``'s network namespace. ``nsenter`` rather than ``ip netns
        exec``: the latter remounts /sys, and slurmd refuses to start without the machine's
        cgroup mounts under /sys/fs/cgroup. Only the host's ``/etc/hosts`` (the one ``ip netns
        exec`` would give it) is bound over the machine's, in a mount namespace of its own:
        there this machine's hostname is the host's address, as a real node's hostname is its
        own (Horovod's Gloo resolves it)."""
        namespace = self.network.host(host).namespace
        hosts = emulate.NETNS_ETC / namespace / "hosts"
        return ["nsenter", f"--net=/run/netns/{namespace}", "--", "unshare", "--mount",
                "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]

    def client(self, *argv: str, timeout_s: float = 30, check: bool = True,
               host: str | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command (``scontrol ...``) on the controller's host."""
        result = subprocess.run(self.command(host or self.controller, list(argv)),
                                env=self.env(), capture_output=True, text=True,
                                timeout=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                               f"{result.stderr.strip()}")
        return result

    # ------------------------------------------------------------------ daemons

    def _start(self, name: str, host: str, argv: list[str]) -> None:
        log = self.directory / f"{name}.out"
        with open(log, "w") as out:
            self.daemons[name] = subprocess.Popen(
                self.command(host, argv), env=self.env(), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _stop(self, name: str) -> None:
        process = self.daemons.pop(name, None)
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def start_slurmd(self, node: str) -> None:
        self._start(f"slurmd-{node}", node, [_binary("slurmd"), "-D", "-N", node,
                                              "-f", str(self.conf)])

    def stop_slurmd(self, node: str) -> None:
        self._stop(f"slurmd-{node}")

    def node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every node registered and idle (or the failure with the daemons' logs)."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, process in self.daemons.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.logs()}")
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                states = self.node_states()
                if states and all(s == "idle" for s in states.values()) \
                        and set(states) == set(self.nodes):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle within {timeout_s} s: {states}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"==> {p.name} <==\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.directory.glob("*.out")) if p.exists())

    def resume(self, node: str) -> None:
        """Bring a node set DOWN (or drained) back; a node that is not (the step that set it
        down never ran: the test's own assertions say why) is left as it is, since Slurm
        refuses RESUME for it."""
        state = self.node_states().get(node, "")
        if state.startswith(("down", "drain")):
            self.client("scontrol", "update", f"NodeName={node}", "State=RESUME")

    def jobs(self) -> list[str]:
        return self.client("squeue", "-h", "-o", "%i").stdout.split()

    def wait_no_jobs(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.jobs():
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs still in the queue after {timeout_s} s: "
                                     f"{self.client('squeue').stdout}")
            time.sleep(0.2)

    def foreign_pids(self, host: str) -> list[tuple[int, str]]:
        """Processes in ``host``'s namespace other than the Slurm daemons and their own helpers
        (slurmctld's slurmscriptd); zombies excluded."""
        daemons = {p.pid for p in self.daemons.values()}
        found = []
        for pid in emulate.namespace_pids(self.network.host(host).namespace):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            state, parent = stat.rsplit(")", 1)[1].split()[:2]
            if state == "Z" or pid in daemons or (int(parent) in daemons
                                                   and cmdline.startswith("slurmctld:")):
                continue
            found.append((pid, cmdline.strip()))
        return found


def _slurm_conf(cluster: SlurmCluster) -> str:
    d = cluster.directory
    ctl = cluster.network.host(cluster.controller)
    hostname = cluster.network.plan.hostname
    nodes = "\n".join(f"NodeName={n} NodeAddr={cluster.network.address(n)} "
                      f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for n in cluster.nodes)
    return textwrap.dedent(f"""\
        ClusterName=bpsctltest
        SlurmctldHost={hostname}({ctl.address})
        AuthType=auth/munge
        CredType=cred/munge
        AuthInfo=socket={d / 'munge.sock'}
        SlurmUser=root
        SlurmdUser=root
        StateSaveLocation={d / 'ctld-state'}
        SlurmdSpoolDir={d / 'spool'}/%n
        SlurmctldPidFile={d / 'slurmctld.pid'}
        SlurmdPidFile={d / 'slurmd'}-%n.pid
        SlurmctldLogFile={d / 'slurmctld.log'}
        SlurmdLogFile={d / 'slurmd'}-%n.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        JobAcctGatherType=jobacct_gather/none
        SwitchType=switch/none
        MpiDefault=none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_CPU
        ReturnToService=2
        SlurmdParameters=config_overrides
        SlurmdTimeout=30
        KillWait=5
        MinJobAge=5
        InactiveLimit=0
        Waittime=0
        {nodes}
        PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
        """)


@contextlib.contextmanager
def slurm_cluster(directory: Path, nodes: int = 2) -> Iterator[SlurmCluster]:
    """Hosts w0..w{N-1} (a ``slurmd`` each) and s0 (``slurmctld``); all idle on entry.
    Always torn down: daemons by PID, then the namespaces (which kills anything left)."""
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    for sub in ("ctld-state", "spool"):
        (directory / sub).mkdir(exist_ok=True)
    for rank in range(nodes):
        (directory / "spool" / f"w{rank}").mkdir(exist_ok=True)
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    plan = emulate.plan_network(nodes, 1)
    with emulate.emulated_network(plan) as network:
        cluster = SlurmCluster(network=network, directory=directory,
                               nodes=tuple(h.name for h in network.plan.workers))
        try:
            cluster.conf.write_text(_slurm_conf(cluster))
            cluster._start("munged", cluster.controller, [
                _binary("munged"), "--foreground", "--force", f"--key-file={key}",
                f"--socket={directory / 'munge.sock'}",
                f"--pid-file={directory / 'munged.pid'}",
                f"--log-file={directory / 'munged.log'}",
                f"--seed-file={directory / 'munge.seed'}"])
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (directory / "munge.sock").exists():
                if cluster.daemons["munged"].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"munged did not start: {cluster.logs()}")
                time.sleep(0.02)
            cluster._start("slurmctld", cluster.controller,
                           [_binary("slurmctld"), "-D", "-i", "-f", str(cluster.conf)])
            for node in cluster.nodes:
                cluster.start_slurmd(node)
            cluster.wait_idle()
            cluster.setup_s = time.monotonic() - started
            yield cluster
        finally:
            for name in [n for n in cluster.daemons if n.startswith("slurmd")]:
                cluster._stop(name)
            cluster._stop("slurmctld")
            cluster._stop("munged")
