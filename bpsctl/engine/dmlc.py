"""What the DMLC variables say, for ``bpslaunch`` (:mod:`bpsctl.launch.dmlc`) and for a worker
that BytePS's own tests start without it (``DMLC_ROLE=worker`` and ``bps.init()``): this
machine's role and place in the job, its Config (``BYTEPS_*`` knobs translated by
:mod:`bpsctl.engine.byteps`, the key), and the waits for the scheduler and the servers, each
with a deadline and a message naming the variable to check. The engine's layer, so that
:class:`bpsctl.engine.Worker` can read them without the launcher.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import zmq

from bpsctl.config import Config, ConfigError
from bpsctl.engine import byteps
from bpsctl.engine.client import scheduler_status
from bpsctl.engine.common import EngineError

ROLES = ("scheduler", "server", "worker")
#: the job every bpslaunch worker joins unless BPSCTL_JOB_ID names another
DEFAULT_JOB_ID = "dmlc"
_POLL_S = 0.25
class DmlcError(ConfigError):
    """A DMLC variable is missing or wrong; the message names it."""


class LaunchFailed(EngineError):
    """A role could not start or its job failed; the message says why and what to check."""


@dataclass(frozen=True)
class DmlcSpec:
    """What the DMLC variables say about this machine's part of the job."""

    role: str
    root_uri: str
    root_port: int
    num_worker: int
    num_server: int
    worker_id: int              # -1 but for a worker
    node_host: str              # DMLC_NODE_HOST, "" when not given
    interface: str              # DMLC_INTERFACE, "" when not given

    @property
    def root(self) -> str:
        return f"{self.root_uri}:{self.root_port}"

    @property
    def root_vars(self) -> str:
        return f"DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT = {self.root}"


def _int_var(environ: Mapping[str, str], name: str, low: int, what: str) -> int:
    text = environ.get(name, "")
    if text == "":
        raise DmlcError(f"{name} is not set: expected {what}")
    try:
        value = int(text)
    except ValueError:
        raise DmlcError(f"{name}: expected {what}, got {text!r}") from None
    if value < low:
        raise DmlcError(f"{name}: expected {what}, got {value}")
    return value


def parse_dmlc(environ: Mapping[str, str]) -> DmlcSpec:
    """The DMLC variables of ``environ``, checked (pure); DmlcError names the one that is
    missing or wrong and says what it should be."""
    role = environ.get("DMLC_ROLE", "").strip().lower()
    if role not in ROLES:
        got = f"got {environ['DMLC_ROLE']!r}" if "DMLC_ROLE" in environ else "it is not set"
        raise DmlcError(f"DMLC_ROLE: expected scheduler, server or worker, {got}")
    uri = environ.get("DMLC_PS_ROOT_URI", "").strip()
    if not uri:
        raise DmlcError("DMLC_PS_ROOT_URI is not set: expected the scheduler's IP address or "
                        "host name")
    port = _int_var(environ, "DMLC_PS_ROOT_PORT", 1, "the scheduler's port, 1..65535")
    if port > 65535:
        raise DmlcError(f"DMLC_PS_ROOT_PORT: expected the scheduler's port, 1..65535, got {port}")
    num_worker = _int_var(environ, "DMLC_NUM_WORKER", 1,
                          "the number of worker machines, 1 or more")
    num_server = _int_var(environ, "DMLC_NUM_SERVER", 1, "the number of servers, 1 or more")
    worker_id = -1
    if role == "worker":
        worker_id = _int_var(environ, "DMLC_WORKER_ID", 0,
                             f"this worker machine's index, 0..{num_worker - 1}")
        if worker_id >= num_worker:
            raise DmlcError(f"DMLC_WORKER_ID: expected this worker machine's index, "
                            f"0..{num_worker - 1} (DMLC_NUM_WORKER={num_worker}), got "
                            f"{worker_id}")
    return DmlcSpec(role=role, root_uri=uri, root_port=port, num_worker=num_worker,
                    num_server=num_server, worker_id=worker_id,
                    node_host=environ.get("DMLC_NODE_HOST", "").strip(),
                    interface=environ.get("DMLC_INTERFACE", "").strip())


def local_gpus(environ: Mapping[str, str]) -> int:
    """Worker processes this machine runs: one per GPU of ``NVIDIA_VISIBLE_DEVICES`` (as
    BytePS counts them), else of ``CUDA_VISIBLE_DEVICES``; 1 on a CPU host (neither set, or
    ``none``/``void``/empty). ``all`` counts the GPUs ``nvidia-smi -L`` lists (1 without it)."""
    for name in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        text = environ.get(name, "").strip()
        if text.lower() in ("", "none", "void", "-1"):
            continue
        if text.lower() == "all":
            try:
                listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                        timeout=10, check=False).stdout
            except (OSError, subprocess.TimeoutExpired):
                return 1
            return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))
        return len([d for d in text.split(",") if d.strip()])
    return 1


def node_address(spec: DmlcSpec) -> str:
    """The address this machine's processes advertise: ``DMLC_NODE_HOST``, else the IPv4
    address of ``DMLC_INTERFACE``, else the one this machine reaches the scheduler from."""
    if spec.node_host:
        return spec.node_host
    if spec.interface:
        addresses = psutil.net_if_addrs().get(spec.interface)
        if addresses is None:
            raise DmlcError(f"DMLC_INTERFACE: this machine has no interface "
                            f"{spec.interface!r}; expected one of "
                            f"{', '.join(sorted(psutil.net_if_addrs()))}")
        for address in addresses:
            if address.family == socket.AF_INET:
                return address.address
        raise DmlcError(f"DMLC_INTERFACE: interface {spec.interface!r} has no IPv4 address")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((spec.root_uri, spec.root_port))      # no packet is sent
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise DmlcError(f"DMLC_PS_ROOT_URI: cannot find a route from this machine to "
                        f"{spec.root_uri!r} ({exc.strerror}); check DMLC_PS_ROOT_URI, or set "
                        "DMLC_NODE_HOST / DMLC_INTERFACE to this machine's address") from None


def _bind_address(spec: DmlcSpec) -> str:
    try:
        return socket.gethostbyname(spec.root_uri)
    except OSError:
        raise DmlcError(f"DMLC_PS_ROOT_URI: cannot resolve {spec.root_uri!r}; expected the "
                        "scheduler's IP address or host name") from None


def _secret(environ: Mapping[str, str]) -> tuple[str, str]:
    """(secret, where it came from): BPSCTL_SECRET, else the file BPSCTL_SECRET_FILE names."""
    if environ.get("BPSCTL_SECRET"):
        return environ["BPSCTL_SECRET"], "BPSCTL_SECRET"
    path = environ.get("BPSCTL_SECRET_FILE", "")
    if not path:
        return "", ""
    try:
        secret = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise DmlcError(f"BPSCTL_SECRET_FILE: cannot read {path}: {exc.strerror}") from None
    if not secret:
        raise DmlcError(f"BPSCTL_SECRET_FILE: {path} is empty; expected the job's secret "
                        "(the same on every machine)")
    return secret, "BPSCTL_SECRET_FILE"


def _say(message: str) -> None:
    sys.stderr.write(f"bpslaunch: {message}\n")
    sys.stderr.flush()


def role_config(spec: DmlcSpec, environ: Mapping[str, str]) -> tuple[Config, list[str]]:
    """This role's Config from ``environ`` with the BytePS knobs translated and the key (HMAC
    with one, ``none`` without), and the lines to log (ignored and conflicting knobs, the
    key's source)."""
    translation = byteps.translate(environ)
    merged = {**environ, **translation.env}
    secret, source = _secret(environ)
    notes = list(translation.notes)
    security = environ.get("BPSCTL_SECURITY", "")
    if secret:
        security = security or "hmac"
    elif security and security != "none":
        raise DmlcError(f"BPSCTL_SECURITY={security} needs the job's secret: set BPSCTL_SECRET "
                        "or BPSCTL_SECRET_FILE (the same on every machine), or leave "
                        "BPSCTL_SECURITY unset to run unauthenticated")
    else:
        security = "none"
    merged = {**merged, "BPSCTL_SECRET": secret, "BPSCTL_SECURITY": security}
    try:
        config = Config.from_env(merged, role=spec.role)
    except ConfigError as exc:
        raise DmlcError(str(exc)) from None
    if secret:
        notes.append(f"{spec.role}: members prove the secret of {source} "
                     f"(BPSCTL_SECURITY={security})")
    return config, notes


def unauthenticated_warning(spec: DmlcSpec) -> str:
    return (f"WARNING: this job is UNAUTHENTICATED: no BPSCTL_SECRET or BPSCTL_SECRET_FILE is "
            f"set, so anyone who can reach {spec.root} or a server's port can join the job, "
            "read its gradients and push its own (as with BytePS). Give every machine the same "
            "BPSCTL_SECRET (e.g. `openssl rand -hex 32`) to turn on bpsctl's HMAC handshake")




def _status(config: Config, address: str, timeout_s: float = 1.0) -> dict[str, Any]:
    try:
        return scheduler_status(address, config.secret, timeout_s=timeout_s,
                                security=config.security)
    except zmq.ZMQError as exc:         # e.g. a host name ZeroMQ cannot resolve
        raise EngineError(f"cannot connect to {address}: {exc}") from None


def wait_scheduler(spec: DmlcSpec, config: Config, deadline: float) -> dict[str, Any]:
    """The scheduler's status once it answers; LaunchFailed naming DMLC_PS_ROOT_URI and
    DMLC_PS_ROOT_PORT at the deadline."""
    last = ""
    while True:
        try:
            return _status(config, spec.root, timeout_s=max(0.2, min(1.0, deadline
                                                                      - time.monotonic())))
        except EngineError as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise LaunchFailed(
                f"{spec.role}: no scheduler answered at {spec.root_vars} within "
                f"{config.start_timeout_s:g} s (BPSCTL_START_TIMEOUT); check DMLC_PS_ROOT_URI "
                f"and DMLC_PS_ROOT_PORT, and that `DMLC_ROLE=scheduler bpslaunch` runs there "
                f"with the same BPSCTL_SECRET. Last answer: {last}")
        time.sleep(_POLL_S)


def _running_servers(status: dict[str, Any]) -> int:
    return sum(1 for s in status["servers"] if s["state"] == "running")


def wait_servers(spec: DmlcSpec, config: Config, deadline: float) -> None:
    """Until DMLC_NUM_SERVER servers have registered; LaunchFailed naming it at the
    deadline."""
    running = 0
    while True:
        try:
            running = _running_servers(_status(config, spec.root))
        except EngineError:
            pass
        if running >= spec.num_server:
            return
        if time.monotonic() >= deadline:
            raise LaunchFailed(
                f"worker {spec.worker_id}: {running} of DMLC_NUM_SERVER={spec.num_server} "
                f"servers registered with the scheduler at {spec.root} within "
                f"{config.start_timeout_s:g} s (BPSCTL_START_TIMEOUT); start "
                f"{spec.num_server} servers with DMLC_ROLE=server bpslaunch, or check "
                "DMLC_NUM_SERVER")
        time.sleep(_POLL_S)


def _taken(status: dict[str, Any], job_id: str, ranks: Sequence[int],
           mine: set[int]) -> dict[str, Any] | None:
    """A worker of job ``job_id`` other than ours (pids ``mine``) that holds one of
    ``ranks``."""
    job = status.get("job")
    if not job or job.get("id") != job_id:
        return None
    for worker in status.get("workers", []):
        if worker["rank"] in ranks and worker["pid"] not in mine \
                and worker["state"] in ("running", "joining"):
            return worker
    return None


def _taken_message(spec: DmlcSpec, worker: dict[str, Any]) -> str:
    return (f"DMLC_WORKER_ID={spec.worker_id}: rank {worker['rank']} is already held by "
            f"another worker (pid {worker['pid']} on {worker['host']}); every worker machine "
            f"needs its own DMLC_WORKER_ID, 0..{spec.num_worker - 1}")


def _intranode(spec: DmlcSpec, config: Config, local_size: int, *,
               launcher: bool = True) -> Config:
    """Where the torch plugin's intra-node stage meets. Its gloo group spans the whole job
    (rank 0 serves the rendezvous at MASTER_ADDR:MASTER_PORT), which DMLC variables do not
    name: on one worker machine, a port bpslaunch (``launcher``) picks for its processes;
    else MASTER_ADDR (worker machine 0) and MASTER_PORT given to every process; without them
    each process pushes on its own (BPSCTL_LOCAL_REDUCE=off, the same sums), said once."""
    if local_size == 1 or config.local_reduce == "off":
        return config
    if spec.num_worker == 1 and launcher and not config.master_port:
        return config.replace(master_addr="127.0.0.1", master_port=_free_port())
    if config.master_port:
        return config
    _say(f"worker {spec.worker_id}: its {local_size} processes push on their own "
         "(BPSCTL_LOCAL_REDUCE=off): the intra-node stage needs MASTER_ADDR (worker machine 0's "
         "address) and MASTER_PORT (a free port there) on every worker machine")
    return config.replace(local_reduce="off")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _byteps_local(environ: Mapping[str, str]) -> tuple[int, int]:
    """(BYTEPS_LOCAL_RANK, BYTEPS_LOCAL_SIZE) of a process started without bpslaunch."""
    size = _int_var({"BYTEPS_LOCAL_SIZE": environ.get("BYTEPS_LOCAL_SIZE") or "1"},
                    "BYTEPS_LOCAL_SIZE", 1, "the worker processes on this machine, 1 or more")
    rank = _int_var({"BYTEPS_LOCAL_RANK": environ.get("BYTEPS_LOCAL_RANK") or "0"},
                    "BYTEPS_LOCAL_RANK", 0, f"this process's index on its machine, 0..{size - 1}")
    if rank >= size:
        raise DmlcError(f"BYTEPS_LOCAL_RANK: expected this process's index on its machine, "
                        f"0..{size - 1} (BYTEPS_LOCAL_SIZE={size}), got {rank}")
    return rank, size


def direct_worker_config(environ: Mapping[str, str]) -> Config | None:
    """The Config of a worker process started BytePS's other way, without bpslaunch:
    ``DMLC_ROLE=worker``, ``DMLC_WORKER_ID`` and ``BYTEPS_LOCAL_RANK``/``BYTEPS_LOCAL_SIZE``
    in its environment and ``bps.init()`` in the process (BytePS's docs/env.md; its own tests
    start their workers so). Returned once the scheduler and ``DMLC_NUM_SERVER`` servers are
    there, with bpslaunch's deadlines and messages. None when this is not such a process:
    ``DMLC_ROLE`` is not worker, or ``BPSCTL_SCHEDULER`` is set (bpslaunch and `bpsctl run`
    set it for the processes they start)."""
    if environ.get("DMLC_ROLE", "").strip().lower() != "worker" \
            or environ.get("BPSCTL_SCHEDULER"):
        return None
    spec = parse_dmlc(environ)
    local_rank, local_size = _byteps_local(environ)
    config, notes = role_config(spec, environ)
    for note in notes:
        _say(note)
    if config.security == "none":
        _say(unauthenticated_warning(spec))
    deadline = time.monotonic() + config.start_timeout_s
    wait_scheduler(spec, config, deadline)
    wait_servers(spec, config, deadline)
    config = _intranode(spec, config, local_size, launcher=False) if local_rank == 0 else \
        (config if config.master_port else config.replace(local_reduce="off"))
    return config.replace(
        role="worker", scheduler=spec.root, host=node_address(spec),
        job_id=environ.get("BPSCTL_JOB_ID") or DEFAULT_JOB_ID, num_servers=spec.num_server,
        port=0, rank=spec.worker_id * local_size + local_rank,
        world_size=spec.num_worker * local_size, local_rank=local_rank, local_size=local_size)


