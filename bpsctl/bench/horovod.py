"""The Horovod baseline: building it (`bpsctl install horovod`) and starting its workers
without horovodrun (which needs SSH to reach other hosts).

Workers are started by bpsctl's own launcher, the way horovodrun's gloo launcher does it
(horovod/runner/gloo_run.py): a RendezvousServer holds the host plan, and each worker gets
HOROVOD_RANK/SIZE/LOCAL_*/CROSS_*, HOROVOD_HOSTNAME, HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT,
HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo and HOROVOD_GLOO_IFACE (see
:func:`bpsctl.bench.common.horovod_env`). The rendezvous server runs in the first worker host's
network namespace, since an emulated cluster's addresses exist only inside the namespaces; on
a Slurm cluster it runs in the bench process itself (:func:`serve_rendezvous`), whose host
every job step can reach. :func:`check_installed` and :func:`horovod_rendezvous` are what a
benchmark with a Horovod baseline calls (`bench vgg16|resnet50 --compare horovod`, `bench comm
--op ... --compare horovod`): both run Horovod's workers the same way, on the same hosts.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from bpsctl.errors import BpsctlError

from .common import HOROVOD_VERSION, INSTALL_COMMAND, horovod_env

if TYPE_CHECKING:
    from ..config import Config
    from ..launch import ClusterState

BUILD_ENV = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MPI": "1",
             "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1"}
# the sdist asks for C++14; torch 2.13's headers need C++17 (fixed upstream, never released)
_CXX_PATCH_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")


class HorovodError(BpsctlError, RuntimeError):
    """Horovod could not be built or started; the message says why."""


def installed_version(python: str = sys.executable, timeout_s: float = 60.0) -> str | None:
    """Horovod's version if ``import horovod.torch`` works in ``python``, else None. Checked in
    a fresh interpreter: a build against another torch fails only when its extension loads."""
    try:
        done = subprocess.run([python, "-c",
                               "import horovod, horovod.torch; print(horovod.__version__)"],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else None


def nccl_built(python: str = sys.executable, timeout_s: float = 60.0) -> bool | None:
    """Whether Horovod in ``python``'s environment takes CUDA tensors over NCCL (None: it does
    not load)."""
    try:
        done = subprocess.run([python, "-c", "import horovod.torch as h; print(h.nccl_built())"],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    return lines[-1].strip() not in ("0", "False")


def find_cuda_home(environ: dict[str, str] | None = None) -> str | None:
    """The CUDA toolkit Horovod's GPU build needs (the directory holding ``bin/nvcc``):
    ``$CUDA_HOME``, the ``nvcc`` on the PATH, or ``/usr/local/cuda``; None without one."""
    environ = dict(os.environ) if environ is None else environ
    candidates = [environ.get("CUDA_HOME", ""), environ.get("CUDA_PATH", "")]
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists():
            return home
    return None


def find_nccl_home(environ: dict[str, str] | None = None,
                   roots: tuple[str, ...] = ("/usr", "/usr/local", "/usr/local/cuda")
                   ) -> str | None:
    """Where NCCL's header and library are (``include/nccl.h`` and ``lib/libnccl.so*``):
    ``$NCCL_HOME``, the ``nvidia-nccl`` wheel torch's CUDA builds install, or a system
    prefix; None without one."""
    environ = dict(os.environ) if environ is None else environ
    candidates = [environ.get("NCCL_HOME", "")]
    try:
        import nvidia.nccl  # type: ignore[import-not-found]   # the wheel of torch's CUDA builds
        candidates += [str(Path(p)) for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    candidates += list(roots)
    for home in filter(None, candidates):
        base = Path(home)
        libs = [*base.glob("lib/libnccl.so*"), *base.glob("lib/x86_64-linux-gnu/libnccl.so*"),
                *base.glob("lib64/libnccl.so*")]
        if (base / "include" / "nccl.h").exists() and libs:
            return home
    return None


def build_env(cuda_home: str | None, nccl_home: str | None) -> dict[str, str]:
    """The environment of Horovod's build: PyTorch and Gloo always; NCCL for CUDA tensors
    where a CUDA toolkit and NCCL are both found (a GPU machine), so that the GPU baseline
    allreduces on the GPUs as Horovod's users run it."""
    env = dict(BUILD_ENV)
    if cuda_home and nccl_home:
        env.update(HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_CUDA_HOME=cuda_home,
                   HOROVOD_NCCL_HOME=nccl_home)
    return env


def missing_message() -> str:
    return (f"--compare horovod: Horovod is not installed (or does not load with torch here). "
            f"Build it with `{INSTALL_COMMAND}` (Horovod {HOROVOD_VERSION} with PyTorch and Gloo, "
            "about 150 s; needs cmake and g++), or drop horovod from --compare")


def patch_cxx_standard(source: Path) -> list[Path]:
    """Raise ``CMAKE_CXX_STANDARD 14`` to 17 in the sdist's CMake files; returns those changed."""
    changed = []
    for relative in _CXX_PATCH_FILES:
        path = source / relative
        text = path.read_text()
        patched = re.sub(r"set\(CMAKE_CXX_STANDARD 14\)", "set(CMAKE_CXX_STANDARD 17)", text)
        if patched != text:
            path.write_text(patched)
            changed.append(path)
    return changed


def _run(cmd: list[str], output: IO[str], env: dict[str, str] | None = None,
         cwd: Path | None = None) -> None:
    output.write("$ " + " ".join(cmd) + "\n")
    output.flush()
    done = subprocess.run(cmd, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                          check=False)
    if done.returncode != 0:
        raise HorovodError(f"`{' '.join(cmd)}` exited {done.returncode} (its output is above)")


def install(version: str = HOROVOD_VERSION, output: IO[str] | None = None,
            force: bool = False, python: str = sys.executable) -> str:
    """Build and install Horovod ``version`` from its sdist with PyTorch and Gloo (no MPI,
    TensorFlow or MXNet) into ``python``'s environment; returns the installed version."""
    output = output if output is not None else sys.stderr
    current = installed_version(python)
    env = build_env(find_cuda_home(), find_nccl_home())
    gpu = "HOROVOD_GPU_OPERATIONS" in env
    if current == version and not force:
        output.write(f"horovod {current} is already installed and loads with torch\n")
        if gpu and nccl_built(python) is False:
            output.write("it was built without NCCL, and this machine has a CUDA toolkit and "
                         f"NCCL: `{INSTALL_COMMAND} --force` rebuilds it for CUDA tensors\n")
        return current
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            raise HorovodError(f"building Horovod needs {tool}: apt-get install -y "
                               f"{'cmake' if tool == 'cmake' else 'g++'}")
    with tempfile.TemporaryDirectory(prefix="bpsctl-horovod-") as tmp:
        work = Path(tmp)
        _run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"horovod=={version}", "-d", str(work)], output)
        archives = sorted(work.glob("horovod-*.tar.gz"))
        if not archives:
            raise HorovodError(f"pip download gave no horovod sdist in {work}")
        with tarfile.open(archives[0]) as archive:
            archive.extractall(work, filter="data")
        source = work / f"horovod-{version}"
        changed = patch_cxx_standard(source)
        output.write(f"patched CMAKE_CXX_STANDARD 14 -> 17 in {len(changed)} file(s)\n")
        output.write("building with NCCL for CUDA tensors (CUDA "
                     f"{env['HOROVOD_CUDA_HOME']}, NCCL {env['HOROVOD_NCCL_HOME']})\n" if gpu else
                     "building for CPU tensors (no CUDA toolkit with NCCL found)\n")
        _run([python, "-m", "pip", "install", "--no-build-isolation", str(source)], output,
             env={**os.environ, **env})
    current = installed_version(python)
    if current is None:
        raise HorovodError("Horovod was built but `import horovod.torch` fails; "
                           f"run `{python} -c 'import horovod.torch'` to see why")
    return current


# --------------------------------------------------------------------------- rendezvous

def _slot_plan(hosts: list[tuple[str, int]]) -> list[Any]:
    """Horovod's SlotInfo of every rank of the plan [(host, slots)], as each worker's
    HOROVOD_* environment states it."""
    from horovod.runner.common.util.hosts import SlotInfo

    size = sum(count for _, count in hosts)
    plan = []
    for rank in range(size):
        env = horovod_env(rank, hosts, "", 0, "", 0)
        plan.append(SlotInfo(hostname=env["HOROVOD_HOSTNAME"], rank=rank,
                             local_rank=int(env["HOROVOD_LOCAL_RANK"]),
                             cross_rank=int(env["HOROVOD_CROSS_RANK"]), size=size,
                             local_size=int(env["HOROVOD_LOCAL_SIZE"]),
                             cross_size=int(env["HOROVOD_CROSS_SIZE"])))
    return plan


@contextlib.contextmanager
def serve_rendezvous(hosts: list[tuple[str, int]]) -> Iterator[int]:
    """Horovod's rendezvous server for the plan [(host, slots)] in this process (its HTTP
    server on a thread, on every address of this host); yields its port, stops it on exit."""
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(verbose=0)
    port = server.start()
    try:
        server.init(_slot_plan(hosts))
        yield port
    finally:
        server.stop()


def address_towards(peer: str) -> str:
    """This host's address on the route to ``peer``: where ``peer`` reaches a server here.
    (Connecting a UDP socket only picks the route; nothing is sent.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
        except OSError as exc:
            raise HorovodError(f"no route from this host to worker {peer} for Horovod's "
                               f"rendezvous ({exc.strerror or exc})") from None
        return str(probe.getsockname()[0])


def rendezvous_main(plan_json: str) -> None:
    """Inside a worker host: serve Horovod's rendezvous for the plan [(host, slots)], print
    the port, and serve until stdin closes (the launcher going away ends it too)."""
    hosts = [(host, int(count)) for host, count in json.loads(plan_json)]
    with serve_rendezvous(hosts) as port:
        print(port, flush=True)
        sys.stdin.read()


@contextlib.contextmanager
def rendezvous(hosts: list[tuple[str, int]], prefix: tuple[str, ...] = (),
               timeout_s: float = 60.0) -> Iterator[int]:
    """A Horovod rendezvous server for ``hosts`` (run with ``prefix``, e.g. inside the first
    worker host's namespace); yields its port, and stops it on exit."""
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", "bpsctl.bench.horovod", "rendezvous", json.dumps(hosts)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
    assert stdin is not None and stdout is not None and stderr is not None     # PIPEs
    try:
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line:
            left = deadline - time.monotonic()
            if process.poll() is not None or left <= 0:
                error = stderr.read() if process.poll() is not None else ""
                raise HorovodError("Horovod's rendezvous server did not start"
                                   + (f": {error.strip().splitlines()[-1]}" if error.strip() else
                                      f" within {timeout_s:g} s"))
            ready, _, _ = select.select([stdout], [], [], min(left, 0.5))
            if ready:
                line = stdout.readline().strip()
                if not line:
                    continue
        yield int(line)
    finally:
        with contextlib.suppress(OSError):
            stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait()
        stdout.close()
        stderr.close()


# --------------------------------------------------------------------------- on a cluster

def _grouped(hosts: list[str]) -> list[tuple[str, int]]:
    """Each rank's host in rank order -> [(host, consecutive ranks on it)]."""
    plan: list[tuple[str, int]] = []
    for host in hosts:
        if plan and plan[-1][0] == host:
            plan[-1] = (host, plan[-1][1] + 1)
        else:
            plan.append((host, 1))
    return plan


def _host_plan(config: Config, workers: int) -> tuple[list[tuple[str, int]], tuple[str, ...]]:
    """Worker hosts with their slot counts in rank order (Horovod's -H), and how to run a
    command on the first of them (on this machine)."""
    from .. import launch
    from ..launch.local import host_command
    cluster = launch.load_state(config.state_dir)
    if cluster is None:
        raise HorovodError(f"no cluster recorded in {config.state_dir}")
    slots = launch.worker_slots(cluster, workers)
    return (_grouped([slot.address for slot in slots]),
            tuple(host_command(cluster, slots[0].address)))


def _ssh_cluster(config: Config) -> ClusterState | None:
    from .. import launch
    cluster = launch.load_state(config.state_dir)
    return cluster if cluster is not None and cluster.kind == "ssh" else None


@contextlib.contextmanager
def horovod_rendezvous(config: Config, workers: int
                       ) -> Iterator[tuple[list[tuple[str, int]], str, int]]:
    """Horovod's rendezvous server for a job of ``workers`` workers on the cluster named by
    ``config``: on the first worker host (over SSH on an SSH cluster, in its namespace on an
    emulated one), or in this process on a Slurm cluster (every step reaches the host that
    launches them, as srun itself needs). Yields the host plan it serves, and the address and
    port the workers reach it at (:func:`worker_args` makes them flags)."""
    from .. import launch
    recorded = launch.load_state(config.state_dir)
    if recorded is not None and recorded.kind == "slurm":
        hosts = _grouped([a.address for a in launch.worker_slots(recorded)])
        with serve_rendezvous(hosts) as port:
            yield hosts, address_towards(hosts[0][0]), port
        return
    cluster = _ssh_cluster(config)
    if cluster is None:
        hosts, prefix = _host_plan(config, workers)
        with rendezvous(hosts, prefix) as port:
            yield hosts, hosts[0][0], port
        return
    from ..launch.transport import remote_service
    assert cluster.hosts is not None
    slots = launch.worker_slots(cluster)
    hosts = _grouped([a.address for a in slots])
    argv = [cluster.hosts.python, "-m", "bpsctl.bench.horovod", "rendezvous", json.dumps(hosts)]
    try:
        with remote_service(cluster.hosts, slots[0].host, argv) as line:
            yield hosts, hosts[0][0], int(line)
    except launch.LaunchError as exc:
        raise HorovodError(f"Horovod's rendezvous server: {exc}") from None


def worker_args(hosts: list[tuple[str, int]], address: str, port: int) -> list[str]:
    """The flags of :func:`bpsctl.bench.common.add_horovod_arguments` for what
    :func:`horovod_rendezvous` yielded: each worker's way to its rendezvous."""
    return ["--horovod-hosts", ",".join(f"{h}:{c}" for h, c in hosts),
            "--rendezvous-addr", address, "--rendezvous-port", str(port)]


def check_installed(config: Config) -> None:
    """Horovod loads where its workers will run (every worker host of an SSH cluster, every
    worker node of a Slurm cluster, else this machine), and on an SSH cluster every worker
    host names the NIC its Gloo binds; a ConfigError otherwise, raised before anything
    starts: there is no silent substitute."""
    from .. import launch
    from ..config import ConfigError
    recorded = launch.load_state(config.state_dir)
    if recorded is not None and recorded.kind == "slurm":
        _check_on_nodes(recorded)
        return
    cluster = _ssh_cluster(config)
    if cluster is None:
        if installed_version() is None:
            raise ConfigError(missing_message())
        return
    assert cluster.hosts is not None
    unnamed = [entry.host for entry in cluster.hosts.workers if not entry.interface]
    if unnamed:
        raise ConfigError(f"--compare horovod: worker host {', '.join(unnamed)} in "
                          f"{cluster.hosts.source} has no `interface:`; Horovod's Gloo binds a "
                          "named NIC (e.g. interface: eth0)")
    from ..launch.transport import run_on_hosts
    python = cluster.hosts.python
    worker_hosts = list(dict.fromkeys(entry.host for entry in cluster.hosts.workers))
    answers = run_on_hosts(cluster.hosts, worker_hosts, [
        python, "-c", "import horovod, horovod.torch; print(horovod.__version__)"], timeout_s=60)
    missing = [f"{host} ({why})" for host, (ok, why) in answers.items() if not ok]
    if missing:
        raise ConfigError(f"--compare horovod: Horovod does not load with torch for {python} "
                          f"on worker host {'; '.join(missing)}. Build it there "
                          f"(`{INSTALL_COMMAND}` on that host), or drop horovod from --compare")


def _check_on_nodes(cluster: ClusterState) -> None:
    """Horovod loads with torch on every worker node of a Slurm cluster (one step on them
    all), or a ConfigError naming the nodes where it does not."""
    from ..config import ConfigError
    from ..launch import slurm
    assert cluster.hosts is not None and cluster.slurm is not None
    nodes = list(dict.fromkeys(entry.host for entry in cluster.hosts.workers))
    probe = ("import json, os\nanswer = {'node': os.environ.get('SLURMD_NODENAME')}\n"
             "try:\n    import horovod, horovod.torch\n"
             "    answer['version'] = horovod.__version__\n"
             "except Exception as exc:\n    answer['error'] = f'{type(exc).__name__}: {exc}'\n"
             "print(json.dumps(answer))")
    answers, why = slurm.ask_nodes(str(cluster.slurm["job_id"]), nodes,
                                   [cluster.hosts.python, "-c", probe], "bpsctl-horovod-check",
                                   timeout_s=120.0)
    missing = [f"{node} ({answers[node].get('error')})" if node in answers
               else f"{node} (no answer{why})"
               for node in nodes if node not in answers or "version" not in answers[node]]
    if missing:
        raise ConfigError(f"--compare horovod: Horovod does not load with torch for "
                          f"{cluster.hosts.python} on worker node {'; '.join(missing)}. Build it "
                          f"there (`{INSTALL_COMMAND}` on that node), or drop horovod from "
                          "--compare")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "rendezvous":
        rendezvous_main(sys.argv[2])
    else:
        raise SystemExit("usage: python -m bpsctl.bench.horovod rendezvous PLAN_JSON")
