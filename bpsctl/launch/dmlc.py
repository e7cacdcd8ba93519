"""``bpslaunch``: BytePS's launcher, so that a BytePS deployment runs unchanged.

Every machine starts its own role from the DMLC variables, as BytePS's docs/running.md says::

    DMLC_ROLE=scheduler DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 \\
        DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 bpslaunch
    DMLC_ROLE=server    ... bpslaunch
    DMLC_ROLE=worker    ... DMLC_WORKER_ID=0 bpslaunch python train.py

* ``scheduler``: bpsctl's scheduler, bound to ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``.
* ``server``: a summation server; it waits for the scheduler, registers and serves.
* ``worker``: waits for the scheduler and ``DMLC_NUM_SERVER`` servers, then runs the command
  once per GPU it sees (``NVIDIA_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``), or once on a
  CPU host. Machine ``DMLC_WORKER_ID`` with ``L`` processes holds ranks ``ID·L .. ID·L+L-1`` of
  ``DMLC_NUM_WORKER·L``; each process gets the variables the plugins read (``BPSCTL_RANK``,
  ``RANK``, ``LOCAL_RANK``, ``BYTEPS_LOCAL_RANK``, their sizes, the scheduler's address).

Machines may start in any order: each waits for what it needs up to ``BPSCTL_START_TIMEOUT``
and then fails with a message naming the variable to check. The scheduler and the servers end
with the job (as BytePS's do): once the scheduler says the job finished (exit 0) or ended
otherwise (exit 1, saying why). ``BYTEPS_*`` knobs are translated by
:mod:`bpsctl.engine.byteps`.

Security: DMLC deployments carry no key. With ``BPSCTL_SECRET`` (or ``BPSCTL_SECRET_FILE``, a
file holding it) every role proves it with bpsctl's HMAC handshake; without one the job runs
unauthenticated (``BPSCTL_SECURITY=none``), as BytePS did, and every role says so once, loudly.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from bpsctl.config import Config
from bpsctl.engine import EngineError
from bpsctl.engine.dmlc import (
    _POLL_S,
    DEFAULT_JOB_ID,
    DmlcError,
    DmlcSpec,
    LaunchFailed,
    _bind_address,
    _intranode,
    _say,
    _status,
    _taken,
    _taken_message,
    local_gpus,
    node_address,
    parse_dmlc,
    role_config,
    unauthenticated_warning,
    wait_scheduler,
    wait_servers,
)
from bpsctl.errors import BpsctlError
from bpsctl.launch.pod import run_pod
from bpsctl.launch.processes import (
    Interrupted,
    ProcessIdentity,
    identify,
    stop_groups,
    stop_signals_recorded,
)
from bpsctl.launch.runloop import STOP_GRACE_S

#: how long the scheduler stays up once its job ended, so that every server learns it
_LINGER_S = 2.0
_PR_SET_PDEATHSIG = 1       # linux/prctl.h
#: the scheduler and servers wait this many times BPSCTL_START_TIMEOUT for a worker to come
_WORKERS_WAIT = 2
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the directory that holds bpsctl/


# --------------------------------------------------------------------------- roles


def _die_with_parent() -> None:
    """In a scheduler or server we start: the kernel stops it if bpslaunch dies."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _start_engine(role: str, config: Config, ready_file: Path) -> tuple[subprocess.Popen,
                                                                        ProcessIdentity]:
    env = {**os.environ, **config.replace(ready_file=str(ready_file)).to_env()}
    process = subprocess.Popen([sys.executable, "-m", f"bpsctl.engine.{role}"], env=env,
                               stdin=subprocess.DEVNULL, cwd=_PACKAGE_ROOT,
                               start_new_session=True, preexec_fn=_die_with_parent)
    return process, identify(process.pid)


def _wait_ready(process: subprocess.Popen, ready_file: Path, deadline: float,
                config: Config, hint: str) -> None:
    while True:
        try:
            json.loads(ready_file.read_text())
            return
        except (FileNotFoundError, ValueError):
            pass
        code = process.poll()
        if code is not None:
            raise LaunchFailed(f"the {config.role} exited with code {code} while starting "
                               f"(its log is above); {hint}")
        if time.monotonic() > deadline:
            raise LaunchFailed(f"the {config.role} was not serving within "
                               f"{config.start_timeout_s:g} s (BPSCTL_START_TIMEOUT); {hint}")
        time.sleep(_POLL_S / 5)


def serve(spec: DmlcSpec, config: Config, job_id: str) -> int:
    """Run the scheduler or a server until the job ends; 0 when it finished."""
    deadline = time.monotonic() + config.start_timeout_s
    address = spec.root
    if spec.role == "scheduler":
        config = config.replace(host=_bind_address(spec), port=spec.root_port)
        hint = (f"check that DMLC_PS_ROOT_URI={spec.root_uri} is an address of this machine and "
                f"that DMLC_PS_ROOT_PORT={spec.root_port} is free")
    else:
        wait_scheduler(spec, config, deadline)
        config = config.replace(host=node_address(spec), scheduler=address, port=0)
        hint = f"check DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT ({spec.root})"
    with tempfile.TemporaryDirectory(prefix="bpslaunch-") as tmp, \
            stop_signals_recorded() as stop_signals:
        process, identity = _start_engine(spec.role, config, Path(tmp) / "ready")
        try:
            # its own deadline: the wait for the scheduler may have used up the first
            _wait_ready(process, Path(tmp) / "ready", time.monotonic() + config.start_timeout_s,
                        config, hint)
            _say(f"{spec.role} serving; it ends with job {job_id!r}")
            return _watch(spec, config, job_id, process, stop_signals)
        except Interrupted as interrupted:
            return 128 + interrupted.signum
        finally:
            stop_groups([identity], STOP_GRACE_S)
            process.wait()


def _watch(spec: DmlcSpec, config: Config, job_id: str, process: subprocess.Popen,
           stop_signals: Any) -> int:
    """Until the scheduler says job ``job_id`` ended, or our process or the scheduler is
    gone for good, or no worker of the job came within twice BPSCTL_START_TIMEOUT (a worker
    waits up to that for the scheduler and servers, then its command starts)."""
    unreachable_since: float | None = None
    seen, came_by = False, time.monotonic() + _WORKERS_WAIT * config.start_timeout_s
    while True:
        stop_signals.check()
        code = process.poll()
        if code is not None:
            raise LaunchFailed(f"the {spec.role} exited with code {code} during the job (its "
                               "log is above)")
        if not seen and time.monotonic() > came_by:
            raise LaunchFailed(
                f"{spec.role}: no worker of job {job_id!r} registered within "
                f"{_WORKERS_WAIT * config.start_timeout_s:g} s (twice BPSCTL_START_TIMEOUT); "
                f"start the DMLC_NUM_WORKER={spec.num_worker} worker machines "
                f"(DMLC_ROLE=worker bpslaunch CMD) with {spec.root_vars}")
        try:
            status = _status(config, spec.root)
            how = status.get("ended", {}).get(job_id)
            seen = seen or how is not None or (status.get("job") or {}).get("id") == job_id
            unreachable_since = None
        except EngineError as exc:
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since > config.scheduler_timeout_s:
                raise LaunchFailed(f"{spec.role}: the scheduler at {spec.root_vars} has not "
                                   f"answered for {config.scheduler_timeout_s:g} s "
                                   f"(BPSCTL_SCHEDULER_TIMEOUT): {exc}") from None
            how = None
        if how is not None:
            if spec.role == "scheduler":
                deadline = time.monotonic() + _LINGER_S     # the servers learn it meanwhile
                while time.monotonic() < deadline:
                    stop_signals.check()
                    time.sleep(_POLL_S)
            if how == "finished":
                _say(f"{spec.role}: job {job_id!r} finished")
                return 0
            raise LaunchFailed(f"{spec.role}: job {job_id!r} ended without finishing: {how}")
        time.sleep(_POLL_S)


def _local_env(spec: DmlcSpec, config: Config, local_size: int, local_rank: int
               ) -> dict[str, str]:
    """Everything local process ``local_rank`` of this worker machine reads."""
    world_size = spec.num_worker * local_size
    rank = spec.worker_id * local_size + local_rank
    process = config.replace(rank=rank, world_size=world_size, local_rank=local_rank,
                             local_size=local_size)
    return {**process.to_env(), "BYTEPS_LOCAL_RANK": str(local_rank),
            "BYTEPS_LOCAL_SIZE": str(local_size), "DMLC_WORKER_ID": str(spec.worker_id),
            "PYTHONUNBUFFERED": "1"}


def work(spec: DmlcSpec, config: Config, job_id: str, cmd: Sequence[str],
         local_size: int) -> int:
    """Run the command once per local GPU (once on a CPU host) when the scheduler and the
    servers are there; the first failure's exit code."""
    if not cmd:
        raise DmlcError("DMLC_ROLE=worker: expected the training command after bpslaunch, "
                        "e.g. bpslaunch python train.py")
    deadline = time.monotonic() + config.start_timeout_s
    status = wait_scheduler(spec, config, deadline)
    ranks = range(spec.worker_id * local_size, (spec.worker_id + 1) * local_size)
    taken = _taken(status, job_id, ranks, set())
    if taken is not None:
        raise LaunchFailed(_taken_message(spec, taken))
    wait_servers(spec, config, deadline)
    config = config.replace(role="worker", scheduler=spec.root, host=node_address(spec),
                            job_id=job_id, num_servers=spec.num_server, port=0)
    world_size = spec.num_worker * local_size
    _say(f"worker {spec.worker_id}: ranks {ranks.start}..{ranks.stop - 1} of {world_size} "
         f"({local_size} process{'es' if local_size > 1 else ''} on this machine)")
    config = _intranode(spec, config, local_size)
    started: list[int] = []
    code = run_pod(list(cmd), spec.worker_id, local_size, world_size,
                   env_of=functools.partial(_local_env, spec, config, local_size),
                   what=f"worker machine {spec.worker_id}", pids=started)
    if code:
        taken = None
        with contextlib.suppress(EngineError):
            mine = {*started, *(p.pid for p in psutil.Process().children(recursive=True))}
            taken = _taken(_status(config, spec.root), job_id, ranks, mine)
        if taken is not None:
            raise LaunchFailed(_taken_message(spec, taken))
        _say(f"worker {spec.worker_id} (DMLC_WORKER_ID): the command failed with exit code "
             f"{code}")
    return code


def launch(environ: Mapping[str, str], cmd: Sequence[str]) -> int:
    """bpslaunch: start this machine's role as ``environ`` says; its exit code."""
    spec = parse_dmlc(environ)
    config, notes = role_config(spec, environ)
    for note in notes:
        _say(note)
    if config.security == "none":
        _say(unauthenticated_warning(spec))
    job_id = environ.get("BPSCTL_JOB_ID") or DEFAULT_JOB_ID
    if spec.role == "worker":
        return work(spec, config, job_id, cmd, local_gpus(environ))
    if cmd:
        _say(f"{spec.role}: the command {' '.join(cmd)!r} is for workers; ignored")
    return serve(spec, config, job_id)


def main(argv: list[str] | None = None) -> int:
    """The ``bpslaunch`` console script: ``bpslaunch [COMMAND ...]``."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print((__doc__ or "").split("\n\n")[0] + "\n\nusage: bpslaunch [COMMAND ...]  "
              "(see docs/coming-from-byteps.md)")
        return 0
    if args[:1] == ["--"]:
        args = args[1:]
    try:
        return launch(os.environ, args)
    except BpsctlError as exc:
        _say(f"error: {exc}")
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())

