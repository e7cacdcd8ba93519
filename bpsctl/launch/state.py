"""Where a cluster is recorded, whatever its kind: ``<state_dir>/cluster.json`` and its logs.

The state file (mode 0600 in a 0700 directory: it holds the cluster's secret) is written
atomically and only under the state dir's lock, which serialises ``up`` and ``down``. Logs of
the scheduler, servers and workers live in ``<state_dir>/logs/<role>-<rank>.log``; the previous
cluster's in ``logs.previous/`` until the next ``up``. While ``run`` runs a job,
``<state_dir>/job.json`` records it, so that ``run --attach`` finds the job and its cluster.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bpsctl.config import ConfigError
from bpsctl.launch.processes import ProcessIdentity, is_running
from bpsctl.launch.types import ClusterState, LaunchError

STATE_FILE_NAME = "cluster.json"
JOB_FILE_NAME = "job.json"
LOG_ROLES = ("scheduler", "server", "worker")
_LOG_TAIL_LINES = 15


def state_file(state_dir: Path | str) -> Path:
    return Path(state_dir) / STATE_FILE_NAME


def logs_dir(state_dir: Path | str) -> Path:
    return Path(state_dir) / "logs"


#: the longest path a Unix socket can be bound at (``sockaddr_un.sun_path``'s 108 bytes,
#: less the closing NUL)
SOCKET_PATH_MAX = 107


def control_socket(state_dir: Path | str) -> Path:
    """The scheduler's socket file: reachable from this machine whatever network namespace
    the scheduler runs in (its TCP address may exist only inside an emulated host). In the
    state dir; where that path is too long for a socket (a deep ``TMPDIR``, say), in /tmp
    under a name derived from the state dir, so every command finds the same one."""
    path = Path(state_dir) / "scheduler.sock"
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        return path
    digest = hashlib.sha256(os.fsencode(Path(state_dir).absolute())).hexdigest()[:20]
    return Path("/tmp") / f"bpsctl-{digest}.sock"


def supervision_file(state_dir: Path | str) -> Path:
    """Where the scheduler's supervisor (bpsctl/engine/supervise.py) says which scheduler
    process runs now and how many times it restarted one."""
    return Path(state_dir) / "scheduler.json"


def load_supervision(state_dir: Path | str) -> dict[str, Any] | None:
    """The supervisor's record (see :func:`supervision_file`), None without one."""
    try:
        record = json.loads(supervision_file(state_dir).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def emulation_claim(state_dir: Path | str) -> Path:
    """Names the emulated network ``up`` is building, before the state file can."""
    return Path(state_dir) / "emulation.claim"


def load_state(state_dir: Path | str) -> ClusterState | None:
    """The cluster recorded in ``state_dir``, or None if there is none."""
    path = state_file(state_dir)
    try:
        return ClusterState.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise LaunchError(f"{path} is not a bpsctl cluster state file ({exc}); check that no "
                          "bpsctl scheduler or server it names is left running (on this machine "
                          "or its hosts), then delete it") from None


def write_private_json(path: Path, data: Any) -> None:
    """Atomically write JSON readable only by its owner (a cluster's state holds its secret)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=2)
    os.replace(tmp, path)


def job_file(state_dir: Path | str) -> Path:
    """The job that `bpsctl run` is running from this state dir (mode 0600, like the state
    file: `run --attach` reads the cluster's place from it)."""
    return Path(state_dir) / JOB_FILE_NAME


def write_job(state_dir: Path | str, job: dict[str, Any]) -> None:
    """Record the running job (see :func:`job_file`): its id, sizes, the launcher's pid and
    process start time, and where its cluster is recorded. A record of another `run` from
    this state dir that still runs is kept: `run --attach` joins the job recorded first."""
    with state_lock(state_dir):
        if load_job(state_dir) is None:
            write_private_json(job_file(state_dir), {**job, "joined": []})


def load_job(state_dir: Path | str) -> dict[str, Any] | None:
    """The job recorded in ``state_dir`` while the `bpsctl run` that records it runs, else
    None (none recorded, or left behind by a launcher that was killed)."""
    try:
        job = json.loads(job_file(state_dir).read_text())
        launcher = ProcessIdentity(pid=int(job["pid"]), pgid=0,
                                   create_time=float(job["create_time"]))
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None
    return job if is_running(launcher) else None


def record_joined(state_dir: Path | str, job_id: str, rank: int) -> None:
    """Worker ``rank`` (of `run --attach`) joined job ``job_id``: its `run` says so at the end."""
    with state_lock(state_dir):
        job = load_job(state_dir)
        if job is not None and job["job_id"] == job_id and rank not in job["joined"]:
            write_private_json(job_file(state_dir), {**job, "joined": [*job["joined"], rank]})


def forget_job(state_dir: Path | str, job_id: str) -> list[int]:
    """The job ``job_id`` ended: remove its record; return the ranks that joined it."""
    with state_lock(state_dir):
        try:
            job = json.loads(job_file(state_dir).read_text())
        except (FileNotFoundError, ValueError):
            return []
        if job.get("job_id") != job_id:
            return []           # another run's job (a second run from the same state dir)
        job_file(state_dir).unlink(missing_ok=True)
        return [int(rank) for rank in job.get("joined", [])]


def write_state(cluster: ClusterState) -> None:
    write_private_json(state_file(cluster.state_dir), cluster.to_json())


def forget(state_dir: Path | str) -> None:
    state_file(state_dir).unlink(missing_ok=True)
    supervision_file(state_dir).unlink(missing_ok=True)
    socket = control_socket(state_dir)
    if socket.parent != Path(state_dir):
        socket.unlink(missing_ok=True)      # outside the state dir: nothing else removes it


def make_state_dir(state_dir: Path | str) -> None:
    Path(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    logs_dir(state_dir).mkdir(mode=0o700, exist_ok=True)


@contextlib.contextmanager
def state_lock(state_dir: Path | str) -> Iterator[None]:
    """Serialises `up` and `down` on one state dir (two `bpsctl up` at once start one cluster)."""
    make_state_dir(state_dir)
    with open(Path(state_dir) / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def rotate_logs(state_dir: Path | str) -> None:
    """The previous cluster's logs stay readable (logs.previous/) until the next `up`."""
    current, previous = logs_dir(state_dir), previous_logs_dir(state_dir)
    if current.exists() and any(current.iterdir()):
        shutil.rmtree(previous, ignore_errors=True)
        current.rename(previous)
    current.mkdir(mode=0o700, exist_ok=True)


def log_tail(path: Path | str, lines: int = _LOG_TAIL_LINES) -> str:
    """The last lines of a log, indented for quoting in an error message."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 16384))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return indent(text.splitlines()[-lines:])


def indent(lines: list[str] | str) -> str:
    if isinstance(lines, str):
        lines = lines.splitlines()
    return "\n".join(f"    {line}" for line in lines) if lines else "    (log is empty)"


def parse_log_role(text: str | None) -> tuple[str | None, int | None]:
    """``"server:1"`` -> ("server", 1); ``"worker"`` -> ("worker", None); None -> (None, None)."""
    if text is None:
        return None, None
    role, sep, rank = text.partition(":")
    if role not in LOG_ROLES or (sep and not rank.isdigit()):
        raise ConfigError(f"ROLE: expected scheduler, server, server:N, worker or worker:N, "
                          f"got {text!r}")
    return role, int(rank) if sep else None


def previous_logs_dir(state_dir: Path | str) -> Path:
    """Where `up` moves the previous cluster's logs (:func:`rotate_logs`)."""
    return Path(state_dir) / "logs.previous"


def log_files(state_dir: Path | str, role: str | None = None,
              directory: Path | None = None) -> list[Path]:
    """The log files of ``role`` (``"server:1"``, ``"worker"``, None for all), in rank order,
    in the state dir's logs (or ``directory``)."""
    wanted_role, wanted_rank = parse_log_role(role)
    directory = logs_dir(state_dir) if directory is None else directory
    found = []
    for each_role in LOG_ROLES:
        if wanted_role not in (None, each_role):
            continue
        for path in directory.glob(f"{each_role}-*.log"):
            rank = path.stem.rpartition("-")[2]
            if rank.isdigit() and wanted_rank in (None, int(rank)):
                found.append((LOG_ROLES.index(each_role), int(rank), path))
    return [path for _, _, path in sorted(found)]


def _roles_of(paths: list[Path]) -> str:
    """``scheduler, server:0, worker:1`` for these log files."""
    return ", ".join(path.stem.replace("-", ":") if path.stem.rpartition("-")[0] != "scheduler"
                     else "scheduler" for path in paths)


def read_logs(state_dir: Path | str, role: str | None = None) -> str:
    """The logs of ``role`` in the state dir; several files are each headed ``==> path <==``,
    as ``tail`` does. Where the current logs have none (a failed `up` since, say), the
    previous cluster's (:func:`previous_logs_dir`) are read, under a first line saying so:
    the last run's logs are never out of reach."""
    paths = log_files(state_dir, role)
    note = ""
    if not paths:
        previous = previous_logs_dir(state_dir)
        paths = log_files(state_dir, role, previous) if previous.is_dir() else []
        if paths:
            written = time.strftime("%Y-%m-%d %H:%M:%S",
                                    time.localtime(max(p.stat().st_mtime for p in paths)))
            note = (f"(the previous cluster's logs, last written {written}: the current "
                    f"logs in {logs_dir(state_dir)} have none of {role or 'bpsctl'})\n")
    if not paths:
        there = log_files(state_dir) or (log_files(state_dir, None, previous_logs_dir(state_dir))
                                         if previous_logs_dir(state_dir).is_dir() else [])
        exist = (f"; logs there: {_roles_of(there)}" if there
                 else " (`bpsctl up` and `bpsctl run` write them there)")
        raise LaunchError(f"no {role or 'bpsctl'} logs in {logs_dir(state_dir)} or "
                          f"{previous_logs_dir(state_dir)}{exist}")
    if len(paths) == 1 and not note:
        return paths[0].read_text(errors="replace")
    return note + "".join(f"==> {path} <==\n{path.read_text(errors='replace')}\n"
                          for path in paths)
