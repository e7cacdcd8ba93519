"""`bpsctl chaos` as a function: a training job on an emulated cluster while a seeded schedule
of faults hits its hosts, then the checker (docs/chaos.md).

A fault-free reference run of the job comes first (its length is the schedule's duration
unless one is given), then the same job under the faults of each seed, each on a cluster of
its own. The checker
reads what the job's workers recorded (bpsctl/chaos/job.py: each step's parameter digest and
time, the final parameters) and what the cluster left behind.
"""
from __future__ import annotations

import collections
import contextlib
import io
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import launch
from ..config import Config, ConfigError
from ..launch import emulate
from . import CHAOS_DIR
from .faults import Undo, apply
from .schedule import KINDS, Fault, make_schedule

#: final parameters against the fault-free run's, relative L2: servers sum in arrival order,
#: so two runs round differently, and this model turns one early rounding difference into
#: about 2e-4 (tests/rounding_sensitivity.py); a rank missing for half the run gives 3e-3
FINAL_DIFF_BOUND = 1e-3
#: the longest a push_pull of the chaos job may wait (BPSCTL_OP_TIMEOUT; 300 s by default): a
#: lost machine is noticed and replaced within the heartbeat timeout and a few seconds, and a
#: collapsed link slows a step to seconds, so a wait of this long is a hang
OP_WAIT_S = 30.0
#: what a worker's output says, once, when the disk under its log is full; what a log says
#: once there is room again (bpsctl/launch/output.py, bpsctl/engine/common.py)
CANNOT_LOG = re.compile(r"\[bpsctl\] cannot write (\S+\.log): ")
LOST_LINES = "line(s) of this log were lost"
#: the emulated host of the scheduler (beside server 0): the checker's rules treat it apart
SCHEDULER_HOST = "s0"
#: the invariant of full-disk faults
FULL_DISK = "a full disk was said at most once per log by each process"
#: the size of the state directory's own file system when --faults has disk: room for every
#: log of a chaos run, small enough to fill at once
STATE_DISK_BYTES = 64 << 20
#: what a worker's output says when bpsctl notices a fault and acts on it
NOTICED = re.compile(r"lost|moved|took over|restart|rejoin|joined|went on|fenc|unreachable",
                     re.IGNORECASE)


@dataclass(frozen=True)
class ChaosSettings:
    workers: int = 4
    servers: int = 4
    steps: int = 300
    duration_s: float | None = None     # None: the fault-free run's length
    kinds: tuple[str, ...] = tuple(KINDS)
    count: tuple[int, int] = (3, 6)
    #: a training command of one's own (``bpsctl chaos -- CMD``) instead of the default job
    #: (bpsctl/chaos/job.py, ``steps`` steps); it records its steps for the checker with
    #: bpsctl.chaos.job.Recorder, or the checks of steps do not apply
    command: tuple[str, ...] = ()


@dataclass
class FaultRecord:
    """One fault as it happened: when it was applied and undone (seconds from the job's start),
    and the first thing bpsctl said about it."""

    fault: Fault
    applied_s: float | None = None
    undone_s: float | None = None
    noticed_s: float | None = None
    action: str = ""
    error: str = ""


class Lines(io.TextIOBase):
    """The workers' output, each line with when it came (seconds from ``start``)."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.start = start
        self.lines: list[tuple[float, str]] = []
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            now = time.monotonic() - self.start
            self._partial += text
            *whole, self._partial = self._partial.split("\n")
            self.lines.extend((now, line) for line in whole)
        return len(text)


def run_chaos(config: Config, settings: ChaosSettings, seeds: list[int],
              progress: Callable[[str], None] = lambda message: None,
              keep_dir: Path | None = None) -> dict[str, Any]:
    """Run the job fault-free once, then under the schedule of each of ``seeds`` in turn, each
    on an emulated cluster of its own (``config.nic``, ``config.spare_servers``), built before
    its run and torn down after it (a seed's faults may have killed or fenced its machines);
    check each run. The report of each run, each fault kind's count of faults injected,
    noticed and survived (in a run that held every invariant), and whether every run held.
    A run that failed an invariant is kept in ``keep_dir`` (see :func:`_keep`), if given: the
    rest of the temporary directory goes at the end."""
    emulate.check_prerequisites()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bpsctl-chaos-") as tmp, \
            _state_disk(Path(tmp) / "state", "disk" in settings.kinds) as (state_dir, disk):
        # a push_pull that waits past OP_WAIT_S has hung: the job fails naming it, in time
        config = config.replace(emulate=True, state_dir=state_dir,
                                world_size=settings.workers,
                                min_workers=config.min_workers or settings.workers - 1,
                                op_timeout_s=min(config.op_timeout_s, OP_WAIT_S))
        reference = Path(tmp) / "reference"
        ref_s = 0.0
        for seed in seeds:
            progress(f"seed {seed}: building {settings.workers} worker and {settings.servers} "
                     "server host(s)")
            cluster = launch.up(config, servers=settings.servers, workers=settings.workers)
            assert cluster.emulation is not None
            plan = emulate.plan_network(len(cluster.emulation["workers"]),
                                        len(cluster.emulation["servers"]), config.nic or None,
                                        cluster_id=cluster.emulation["cluster_id"])
            report: dict[str, Any] = {}
            try:
                if not runs:
                    progress(f"the fault-free run: {settings.steps} steps")
                    ref_run, ref_s, _, _ = _job(config, settings, reference, plan, [], disk)
                    if ref_run.exit_code != 0:
                        raise ConfigError(f"chaos: the fault-free run failed (exit "
                                          f"{ref_run.exit_code}); nothing to compare with")
                report = _seeded_run(config, settings, seed, plan, reference, ref_s, disk,
                                     Path(tmp) / f"chaos-{seed}", state_dir, progress)
            finally:
                down = launch.down(state_dir)
            left = emulate.find_leftovers([plan.cluster_id])
            report["left_behind"] = [*down.survivors,
                                     *(f"namespace {ns}" for leftover in left
                                       for ns in leftover.namespaces)]
            report["invariants"]["nothing left behind"] = not report["left_behind"]
            report["ok"] = all(held is not False for held in report["invariants"].values())
            if not report["ok"] and keep_dir is not None:
                try:
                    report["kept"] = str(_keep(Path(tmp) / f"chaos-{seed}", state_dir,
                                               keep_dir / f"bpsctl-chaos-seed-{seed}"))
                except OSError as exc:      # the report and the other seeds matter more
                    report["kept"] = None
                    report["kept_error"] = f"{exc.strerror or exc}: {exc.filename or ''}"
            runs.append(report)
    return {"kind": "chaos_runs", "seeds": list(seeds), "runs": runs,
            "by_kind": _by_kind(runs), "ok": all(run["ok"] for run in runs)}


def _keep(run_dir: Path, state_dir: Path, where: Path) -> Path:
    """What a failed run leaves to find its cause with, copied out of the temporary directory:
    its workers' output (``output.txt``, with the time of each line), the steps each rank
    recorded, and the logs of its cluster's scheduler, servers and workers (``logs/``: what
    the output does not say, such as a server admitting a worker). ``where``, or ``where``
    with a number after it if that exists already."""
    target = where
    for number in itertools.count(2):
        if not target.exists():
            break
        target = where.with_name(f"{where.name}.{number}")
    shutil.copytree(run_dir, target)
    logs = launch.logs_dir(state_dir)
    if logs.is_dir():
        shutil.copytree(logs, target / "logs")
    return target


def _seeded_run(config: Config, settings: ChaosSettings, seed: int, plan: emulate.NetworkPlan,
                reference: Path, ref_s: float, disk: Path | None, out: Path, state_dir: Path,
                progress: Callable[[str], None]) -> dict[str, Any]:
    """The job under the schedule of ``seed`` on the cluster of ``plan``, checked against the
    fault-free run in ``reference`` (``ref_s`` long); its report, but for what the cluster
    left behind (known once it is down)."""
    duration = settings.duration_s or ref_s
    faults = make_schedule(seed, duration, [h.name for h in plan.workers],
                           [h.name for h in plan.servers][:settings.servers],
                           settings.kinds, settings.count)
    progress(f"seed {seed}: the run under {len(faults)} fault(s)")
    result, took_s, records, output = _job(config, settings, out, plan, faults, disk)
    report = _check(config, settings, reference, out, result, records)
    report["invariants"][FULL_DISK] = _full_disk_said(
        records, output, state_dir, collections.Counter(f.rank for f in result.restarted))
    # what the workers said about the faults, and how the job ended
    report["said"] = [f"{t:7.2f} {line}" for t, line in output.lines
                      if NOTICED.search(line) or CANNOT_LOG.search(line)][:40]
    report["output_tail"] = [f"{t:7.2f} {line}" for t, line in output.lines[-30:]]
    # the cap on TCP's backoff in the emulated hosts (None: this kernel has none)
    report["tcp_rto_max_ms"] = (emulate.TCP_RTO_MAX_MS if emulate.tcp_rto_max_capped()
                                else None)
    report.update(seed=seed, duration_s=round(duration, 1), reference_s=round(ref_s, 1),
                  run_s=round(took_s, 1))
    return report


def _by_kind(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per fault kind: faults injected (applied), noticed (bpsctl said something of their
    host), and survived (in a run that held every invariant)."""
    counts: dict[str, dict[str, int]] = {}
    for run in runs:
        for record in run["faults"]:
            kind = counts.setdefault(record["fault"]["kind"],
                                     {"injected": 0, "noticed": 0, "survived": 0})
            if record["applied_s"] is None:
                continue
            kind["injected"] += 1
            kind["noticed"] += record["noticed_s"] is not None
            kind["survived"] += bool(run["ok"])
    return counts


def parse_seeds(text: str) -> list[int]:
    """``--seed``: one seed (``7``), a list (``1,4,9``) or a range (``1-50``, both ends in)."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            if dash and first:
                if int(last) < int(first):
                    raise ValueError
                seeds.extend(range(int(first), int(last) + 1))
            else:
                seeds.append(int(part))
    except ValueError:
        raise ConfigError(f"--seed {text!r}: give a seed (7), seeds (1,4,9) or a range "
                          "(1-50)") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seed {text!r}: a seed is given twice; each runs once")
    return seeds


def _job(config: Config, settings: ChaosSettings, out: Path, plan: emulate.NetworkPlan,
         faults: list[Fault], disk: Path | None = None
         ) -> tuple[launch.RunResult, float, list[FaultRecord], Lines]:
    """Run the job into ``out`` while ``faults`` are applied and undone on time, the clock
    starting at its first step (``disk``: the directory a full-disk fault fills); (how it
    ended, how long it trained, each fault's record, the workers' output)."""
    out.mkdir(parents=True)
    output = Lines(time.monotonic())
    records = [FaultRecord(fault) for fault in faults]
    done = threading.Event()
    clock: list[float] = []         # when the first step ended: the schedule's zero
    # the schedule's zero: the default job's first step; a script of one's own may record
    # none, so its first step or its first line of output, whichever comes first
    began = (lambda: bool(output.lines)) if settings.command else (lambda: False)
    injector = threading.Thread(target=_inject,
                                args=(plan, records, out, clock, done, disk, began),
                                name="chaos-injector", daemon=True)
    injector.start()
    argv = list(settings.command) or [sys.executable, "-m", "bpsctl.chaos.job", str(out),
                                      str(settings.steps)]
    try:
        with _environ(CHAOS_DIR, str(out)):
            result = launch.run(argv, config, servers=settings.servers, stdout=output,
                                stderr=output)
    finally:
        done.set()
        injector.join(60)
    if result.interrupted:
        # the user's Ctrl-C (or a SIGTERM): no seed after it runs, and this one is not judged;
        # its cluster stops as this unwinds
        raise launch.Interrupted(result.interrupted)
    start = clock[0] if clock else output.start
    took = time.monotonic() - start
    output.lines = [(t + output.start - start, line) for t, line in output.lines]
    for record in records:
        if record.applied_s is None:
            continue
        if record.fault.kind == "disk":
            said = next(((t, line) for t, line in output.lines if t >= record.applied_s and
                         CANNOT_LOG.search(line)), None)
        else:
            said = next(((t, line) for t, line in output.lines if t >= record.applied_s and
                         NOTICED.search(line) and
                         _names(plan.host(record.fault.target).address, line)), None)
        if said is not None:
            record.noticed_s, record.action = round(said[0], 2), said[1].strip()[:160]
    (out / "output.txt").write_text("\n".join(f"{t:8.2f} {line}" for t, line in output.lines))
    return result, took, records, output


def _names(address: str, line: str) -> bool:
    """Whether a line of output speaks of the emulated host at ``address`` (the engine names a
    lost worker, server or scheduler by its address)."""
    return re.search(rf"\b{re.escape(address)}\b(?![.\d])", line) is not None


def _inject(plan: emulate.NetworkPlan, records: list[FaultRecord], out: Path,
            clock: list[float], done: threading.Event, disk: Path | None = None,
            began: Callable[[], bool] = lambda: False) -> None:
    """Once the job has trained its first step (a worker recorded it in ``out``), or
    ``began()`` says it has: the schedule's zero, put in ``clock`` and, as wall-clock time, in
    ``out/start``; apply each fault at its start and undo it at its end; undo everything
    once the job ends (``done``), whatever is still applied."""
    while not any(p.stat().st_size for p in out.glob("steps-*")) and not began():
        if done.wait(0.02):
            return
    start = time.monotonic()
    clock.append(start)
    (out / "start").write_text(f"{time.time():.3f}")
    pending: list[tuple[float, int, str]] = sorted(
        [(r.fault.start_s, i, "apply") for i, r in enumerate(records)])
    undos: dict[int, Undo] = {}
    while pending and not done.is_set():
        at, index, what = pending[0]
        if done.wait(max(0.0, start + at - time.monotonic())):
            break
        pending.pop(0)
        record = records[index]
        now = round(time.monotonic() - start, 2)
        try:
            if what == "apply":
                undos[index] = apply(plan, record.fault, disk)
                record.applied_s = now
                if record.fault.length_s is not None:
                    pending.append((at + record.fault.length_s, index, "undo"))
                    pending.sort()
            else:
                undos.pop(index)()
                record.undone_s = now
        except Exception as exc:        # a fault that could not be applied is reported, not fatal
            record.error = f"{what}: {exc}"
    for index, undo in undos.items():   # the job ended first
        try:
            undo()
            records[index].undone_s = round(time.monotonic() - start, 2)
        except Exception as exc:
            records[index].error = f"undo: {exc}"


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` in this process's environment (which the job's workers
    inherit) for the block."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _state_disk(state_dir: Path, small: bool) -> Iterator[tuple[Path, Path | None]]:
    """The cluster's state and log directory; with ``small``, on a tmpfs of its own of
    STATE_DISK_BYTES (what a full-disk fault fills), unmounted at the end. (the directory, the
    directory a full-disk fault fills or None)"""
    state_dir.mkdir(parents=True)
    if not small:
        yield state_dir, None
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o",
                              f"size={STATE_DISK_BYTES},mode=0700", "bpsctl-chaos",
                              str(state_dir)], capture_output=True, text=True, timeout=30)
    if mounted.returncode:
        raise ConfigError(f"--faults disk: could not mount a tmpfs on {state_dir} "
                          f"({mounted.stderr.strip() or f'exit {mounted.returncode}'}); it needs "
                          "root and mount(8), or leave disk out of --faults")
    try:
        yield state_dir, state_dir
    finally:
        subprocess.run(["umount", "--lazy", str(state_dir)], check=False, capture_output=True,
                       timeout=30)


def _full_disk_said(records: list[FaultRecord], output: Lines, state_dir: Path,
                    restarts: collections.Counter[int]) -> bool | None:
    """Whether each full disk was said at most once where it cut a log, by each process that
    wrote it: the workers' output says a log cannot be written, and a log counts its lost
    lines, no more often than the disk filled, times the processes that wrote the log (a
    worker restarted ``restarts[rank]`` times writes its rank's log as a new process, which
    finds the disk full anew). Room that came back while the disk was meant to be full (a
    file some process removed) and ran out again is a new fill: a log's count of lost lines
    is the evidence that room came back, and a worker's saying again then the evidence that
    it ran out again, so each side may exceed that bound by the other's count. (A log whose
    lines still fit the pages it had written stayed whole and says nothing; the job going on
    is the step invariants'.) None without a disk fault."""
    filled = sum(1 for r in records if r.fault.kind == "disk" and r.applied_s is not None)
    if not filled:
        return None

    def allowed(log: str) -> int:
        rank = re.fullmatch(r"worker-(\d+)\.log", Path(log).name)
        return filled * (1 + (restarts[int(rank.group(1))] if rank else 0))

    told = collections.Counter(match.group(1) for _, line in output.lines
                               if (match := CANNOT_LOG.search(line)))
    logs = (state_dir / "logs").glob("*.log") if (state_dir / "logs").is_dir() else []
    counted = {str(path): path.read_text(errors="replace").count(LOST_LINES) for path in logs}
    return all(n <= allowed(log) + counted.get(log, 0) for log, n in told.items()) and \
        all(n <= allowed(log) + told.get(log, 0) for log, n in counted.items())


def _stall_bound(windows: list[tuple[float, float, str]], per_loss_s: float) -> float:
    """The longest a step may stall: ``per_loss_s`` (the heartbeat timeout + 2 s) for a loss,
    and for losses that follow each other while the job still waits out the one before (a
    worker lost, then a server 4 s later), the time from the first's start to the last's
    end of wait. ``windows``: each host's time down (:func:`_down_windows`); the scheduler's
    host is left out (no bound applies while it is down)."""
    waits = sorted((start, start + per_loss_s) for start, _, host in windows
                   if host != SCHEDULER_HOST)
    bound, chain = per_loss_s, None
    for start, end in waits:
        if chain is not None and start <= chain[1]:
            chain = (chain[0], max(chain[1], end))
        else:
            chain = (start, end)
        bound = max(bound, chain[1] - chain[0])
    return bound


def _survivable(settings: ChaosSettings, windows: list[tuple[float, float, str]],
                min_workers: int, scheduler_wait_s: float = float("inf")) -> bool:
    """Whether the faults as applied always left the job a way on: at each moment a server up
    (spares aside), the scheduler's host (beside server 0) up while another server is down,
    and at least ``min_workers`` workers up; and the scheduler's host never down for as long
    as the workers wait for the scheduler (``scheduler_wait_s``: server 0's partitions can
    only move once it is back). ``windows``: each host's time down (:func:`_down_windows`);
    a slow or lossy link is up."""
    if any(host == SCHEDULER_HOST and end - start >= scheduler_wait_s - BOUNDARY_S
           for start, end, host in windows):
        return False
    for at, _, _ in windows:
        down = {target for start, end, target in windows if start <= at < end}
        servers = {t for t in down if t.startswith("s")}
        workers = {t for t in down if t.startswith("w")}
        if len(servers) >= settings.servers or \
                (SCHEDULER_HOST in down and servers - {SCHEDULER_HOST}) or \
                settings.workers - len(workers) < max(1, min_workers):
            return False
    return True


#: a silence this close to the heartbeat timeout may be declared a loss or not (when the
#: scheduler checks, when the last heartbeat arrived): either ending is right
BOUNDARY_S = 0.5


def _down_windows(records: list[FaultRecord], timeout_s: float,
                  interval_s: float) -> list[tuple[float, float, str]]:
    """(start, end, host) of each host's time down: killed, or silent towards the scheduler
    for the heartbeat timeout. A host is silent while it is paused or cut off from every
    host; a cut or pause of the scheduler's host (``s0``) shorter than the timeout adds to an
    overlapping silence of another host (alone, it silences every host at once, which the
    scheduler takes for its own isolation). The last heartbeat may have left an interval
    before a silence began: one that lasts the timeout, less that interval and
    :data:`BOUNDARY_S`, is down."""
    own: dict[str, list[tuple[float, float]]] = {}
    windows: list[tuple[float, float, str]] = []
    for r in records:
        whole = r.fault.kind in ("pause", "kill") or \
            r.fault.kind == "partition" and not r.fault.params.get("peers")
        if r.applied_s is None or not whole:
            continue
        if r.fault.kind == "kill":
            windows.append((r.applied_s, float("inf"), r.fault.target))
            continue
        end = r.undone_s if r.undone_s is not None else float("inf")
        own.setdefault(r.fault.target, []).append((r.applied_s, end))
    scheduler = [(a, b) for a, b in own.get(SCHEDULER_HOST, []) if b - a + interval_s < timeout_s]
    for host, spans in own.items():
        merged: list[list[Any]] = []            # [start, end, has one of the host's own]
        for a, b, mine in sorted([(a, b, True) for a, b in spans] + (
                [(a, b, False) for a, b in scheduler] if host != SCHEDULER_HOST else [])):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
                merged[-1][2] |= mine
            else:
                merged.append([a, b, mine])
        windows += [(a, b, host) for a, b, mine in merged
                    if mine and b - a + interval_s >= timeout_s - BOUNDARY_S]
    return windows


def _steps(out: Path) -> dict[int, dict[int, tuple[str, float, float, int]]]:
    """rank -> step -> (digest, seconds, wall clock, pid of the process that recorded it)
    from the workers' records (a restarted worker's later record of a step wins)."""
    steps: dict[int, dict[int, tuple[str, float, float, int]]] = {}
    for path in out.glob("steps-*"):
        rank = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            step, digest, seconds, wall, pid = line.split()
            steps.setdefault(rank, {})[int(step)] = (digest, float(seconds), float(wall),
                                                     int(pid))
    return steps


def _unequal_steps(steps: dict[int, dict[int, tuple[str, float, float, int]]],
                   left: list[int]) -> list[int]:
    """The steps after which the ranks' parameters differ. The last step a process of a
    worker that left took before it went (the job going on past it, and that process not
    recording the next step) is not compared: the sum it got may have come from a server lost
    at about the same time, whose round the others then did again on the server that took
    over, without that worker's push. Its model goes with it; a restart takes the donor's,
    which may have done that very step, and goes on from the donor's next step: the
    restart's steps are compared."""
    end = max((step for rank in steps.values() for step in rank), default=-1)
    gone = {(r, step) for r in set(left) for step, record in steps.get(r, {}).items()
            if step < end and (step + 1 not in steps[r] or steps[r][step + 1][3] != record[3])}
    return sorted(step for step in {s for rank in steps.values() for s in rank}
                  if len({steps[r][step][0] for r in steps
                          if step in steps[r] and (r, step) not in gone}) > 1)


def _check(config: Config, settings: ChaosSettings, reference: Path, chaos: Path,
           result: launch.RunResult, records: list[FaultRecord]) -> dict[str, Any]:
    """The report, with each invariant True (held), False (failed) or None (does not apply)."""
    import numpy as np  # here: `bpsctl` itself starts without NumPy
    steps = _steps(chaos)
    exit_code = result.exit_code
    # a worker that left the job (lost, restarted) took its share out of some averages: then
    # the final parameters differ from the fault-free run's by design
    left = [f.rank for f in (*result.restarted, *result.left_behind)]
    unequal = _unequal_steps(steps, left)
    # the final parameters against the fault-free run's
    finals = sorted(chaos.glob("final-*.npy"))
    worst = None
    if finals and (reference / finals[0].name).exists():
        mine = np.load(finals[0]).astype(np.float64)
        theirs = np.load(reference / finals[0].name).astype(np.float64)
        scale = float(np.linalg.norm(theirs)) or 1e-30
        worst = float(np.linalg.norm(mine - theirs)) / scale
    # the worst stall: a step's time over the median step's; a step under a collapsed link
    # may be as slow as the link, so those do not count
    began = float((chaos / "start").read_text()) if (chaos / "start").exists() else 0.0
    collapsed = [(r.applied_s or 0.0, r.undone_s if r.undone_s is not None else float("inf"))
                 for r in records if r.fault.kind == "collapse" and r.applied_s is not None]

    def under_collapse(seconds: float, wall: float) -> bool:
        end = wall - began
        return any(end >= a and end - seconds <= b for a, b in collapsed)

    # the job's progress: when some rank first finished each step; a stall is a gap between
    # two steps beyond the median gap
    first = sorted(min(rank[step][2] for rank in steps.values() if step in rank)
                   for step in {s for rank in steps.values() for s in rank})
    gaps = [(b - a, b) for a, b in itertools.pairwise(first)]
    median = statistics.median(gap for gap, _ in gaps) if gaps else 0.0
    stall = max((gap - median for gap, wall in gaps if not under_collapse(gap, wall)),
                default=0.0)
    windows = _down_windows(records, config.heartbeat_timeout_s, config.heartbeat_interval_s)
    bound = _stall_bound(windows, config.heartbeat_timeout_s + 2.0)
    # a worker whose server is lost waits BPSCTL_SCHEDULER_TIMEOUT for the scheduler to
    # move its partitions, then ends with an error naming both
    survivable = _survivable(settings, windows, config.min_workers,
                             config.heartbeat_timeout_s + config.scheduler_timeout_s)
    # nothing moves while the scheduler's host is down (server 0 beside it): the steps wait
    # for it to come back, however long that is, and no stall bound applies
    scheduler_down = any(host == SCHEDULER_HOST for _, _, host in windows)
    # a script of one's own that records no steps (bpsctl.chaos.job.Recorder): the checks
    # of steps do not apply; it is judged by how it ended, its faults, and what it left
    judged = bool(steps) or not settings.command
    if settings.command:        # its own number of steps: the most any rank recorded
        completed = bool(steps) and len({max(rank) for rank in steps.values()}) == 1
    else:
        # by at least one rank, and by every rank that never left the job: one lost (and
        # restarted too late, or not at all under --min-workers) stops short by design
        done = {r for r, rank in steps.items() if max(rank, default=-1) == settings.steps - 1}
        completed = bool(done) and all(r in done for r in steps if r not in left)
    return {
        "kind": "chaos", "workers": settings.workers, "servers": settings.servers,
        "steps": None if settings.command else settings.steps,
        "command": list(settings.command) or None, "nic": config.nic,
        "spare_servers": config.spare_servers, "max_restarts": config.max_restarts,
        "exit_code": exit_code,
        "faults": [dict(asdict(r), fault=asdict(r.fault)) for r in records],
        "unequal_steps": unequal[:20], "final_rel_diff": worst, "workers_left": left,
        "worst_stall_s": round(stall, 2), "median_step_s": round(median, 4),
        "stall_bound_s": bound, "survivable": survivable,
        "invariants": {
            # faults that left no server, no scheduler beside a lost server, or too few
            # workers reachable may end the job, with an error that names the loss
            "exit 0, or a named error where the faults left no way on":
                exit_code == 0 or not survivable and bool(result.lost or result.failures),
            # a job the faults ended (above) has no steps or stalls to judge
            "every step done":
                completed if judged and (exit_code == 0 or survivable) else None,
            "ranks bitwise equal after every step": not unequal if judged else None,
            f"final parameters within {FINAL_DIFF_BOUND:g} of the fault-free run's":
                None if left or not (finals or judged) else
                worst is not None and worst <= FINAL_DIFF_BOUND,
            # faults beyond a way on that the job rode through all the same (the scheduler's
            # host cut off while a server was lost: nothing moves until it is back) bound no
            # stall
            "worst stall within the heartbeat timeout + 2 s per loss":
                stall <= bound if judged and survivable and not scheduler_down else None,
            "every fault applied and undone": all(not r.error for r in records),
        },
    }
