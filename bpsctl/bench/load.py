"""Load: many steps of a ResNet50-shaped gradient set, exact sums, memory that stays flat.

    bpsctl bench load [--workers 8] [--servers 4] [--steps 1000] [--scale 1.0] [--warmup 100]
                      [--json FILE]

On the embedded default (a private scheduler and servers over loopback) every worker process
push_pulls ResNet50's 161 gradient tensors each step (``--scale 1``: 25,557,032 float32, 97.5
MiB; ``--scale 0.001``: the same 161 tensors, each a thousandth of its size, at least one
element), earlier layers at higher priority, plus a canary: integers whose sum across ranks is
known exactly for every step, checked every step (as is each gradient's first element).

Memory: at checkpoints (after ``--warmup`` steps, then evenly, and at the end) every worker waits
at a barrier while the RSS of every process of the job is read: scheduler, servers, workers.
It is read twice: as soon as the last worker arrives ("at the barrier": what the allocators
keep of the last bursts included, which varies by a few partitions from one reading to the
next), and again once every process has been quiet for BPSCTL_IDLE_RELEASE seconds and has
given that back (what the processes hold: the figure judged). Growth is the last checkpoint
over the warm-up one, per process; the run fails above ``--max-growth`` (5%). Exit 0 when every
sum was exact and memory stayed within bounds.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import queue
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..config import Config
from ..engine import EngineError, Worker
from ..engine.common import rss_bytes
from ..errors import BpsctlError
from ..launch.api import local_cluster
from .shapes import resnet50_shapes

CANARY_ELEMENTS = 4096
CHECKPOINT_TIMEOUT_S = 120.0        # a step, or waiting at a checkpoint, never takes longer


class LoadError(BpsctlError, RuntimeError):
    """A worker failed, a sum was wrong, or a deadline passed; the message says which."""


@dataclass(frozen=True)
class LoadSettings:
    workers: int = 8
    servers: int = 4
    steps: int = 1000
    warmup: int = 100
    scale: float = 1.0              # of each ResNet50 tensor's element count
    checkpoints: int = 4            # RSS readings after the warm-up one (the last at the end)
    max_growth: float = 0.05

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 1:
            raise ValueError("--workers and --servers: expected at least 1")
        if not 0 < self.warmup < self.steps:
            raise ValueError(f"--warmup: expected 1 to {self.steps - 1} steps (fewer than "
                             f"--steps), got {self.warmup}")
        if not 0 < self.scale <= 1:
            raise ValueError(f"--scale: expected more than 0 and at most 1, got {self.scale}")

    def checkpoint_steps(self) -> list[int]:
        """Steps done at each RSS reading: the warm-up, then evenly to the end."""
        span = self.steps - self.warmup
        marks = {self.warmup + round(span * (i + 1) / self.checkpoints)
                 for i in range(self.checkpoints)}
        return sorted({self.warmup, *marks})


def gradient_sizes(scale: float) -> list[int]:
    """Element counts of ResNet50's 161 gradients, each scaled (and at least 1)."""
    return [max(1, math.ceil(math.prod(shape) * scale)) for shape in resnet50_shapes()]


def _worker(rank: int, settings: LoadSettings, config: Config, scheduler: str, secret: str,
            job: str, events: Any, resume: list[Any]) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = Worker(dataclasses.replace(config, role="worker", rank=rank,
                                        world_size=settings.workers, job_id=job,
                                        num_servers=settings.servers, scheduler=scheduler,
                                        secret=secret, op_timeout_s=CHECKPOINT_TIMEOUT_S))
    try:
        # started with SIGINT blocked (run_load): a Ctrl-C pressed while this process started
        # lands here, where it ends the worker quietly (below)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        size = settings.workers
        grads = [np.full(n, rank + 1, np.float32) for n in gradient_sizes(settings.scale)]
        outs = [np.empty_like(g) for g in grads]
        grad_sum = size * (size + 1) // 2
        offsets = np.arange(CANARY_ELEMENTS, dtype=np.int64)
        canary = np.empty(CANARY_ELEMENTS, np.int64)
        canary_out = np.empty(CANARY_ELEMENTS, np.int64)
        want = np.empty(CANARY_ELEMENTS, np.int64)
        checkpoints = settings.checkpoint_steps()
        step_times = []
        for step in range(settings.steps):
            started = time.perf_counter()
            # rank r sends (r + 1) * (step + 1) + i: the sum is known exactly for every element
            np.add(offsets, (rank + 1) * (step + 1), out=canary)
            handles = [worker.push_pull_async(g, name=f"grad.{i}", average=False, priority=-i,
                                              out=o)
                       for i, (g, o) in enumerate(zip(grads, outs, strict=True))]
            handles.append(worker.push_pull_async(canary, name="canary", average=False,
                                                  priority=-len(grads), out=canary_out))
            for handle in handles:
                worker.synchronize(handle)
            np.multiply(offsets, size, out=want)
            want += (step + 1) * grad_sum
            if not np.array_equal(canary_out, want):
                bad = int(np.flatnonzero(canary_out != want)[0])
                raise LoadError(f"rank {rank}, step {step}: canary element {bad} summed to "
                                f"{canary_out[bad]}, expected {want[bad]}")
            wrong = next((i for i, o in enumerate(outs) if o[0] != grad_sum), None)
            if wrong is not None:
                raise LoadError(f"rank {rank}, step {step}: grad.{wrong} summed to "
                                f"{outs[wrong][0]}, expected {grad_sum}")
            step_times.append(time.perf_counter() - started)
            done = step + 1
            if done in checkpoints:
                worker.barrier()
                events.put(("checkpoint", rank, done))
                if not resume[checkpoints.index(done)].wait(CHECKPOINT_TIMEOUT_S):
                    raise LoadError(f"rank {rank}: not resumed after the checkpoint at step {done}")
            if rank == 0 and done % 10 == 0:
                events.put(("progress", rank, done))
        events.put(("done", rank, statistics.median(step_times[settings.warmup:])))
    except (EngineError, LoadError) as exc:
        events.put(("error", rank, str(exc)))
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal's group: the parent says it was
        # interrupted and stops the cluster; a traceback from each worker would only bury that
        raise SystemExit(130) from None
    finally:
        worker.shutdown()


def _rss(pids: dict[str, int]) -> dict[str, int]:
    return {name: rss_bytes(pid) for name, pid in pids.items()}


def settle_s(config: Config) -> float:
    """How long the job waits, quiet, at a checkpoint before its settled RSS reading: long enough
    for every server and worker to notice it is quiet and release (see Config.idle_release_s)."""
    if not config.idle_release_s:
        return 0.0
    return config.idle_release_s + 2 * config.heartbeat_interval_s + 0.5


def run_load(config: Config, settings: LoadSettings,
             progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Run the load on a private local cluster; raise LoadError on any failure."""
    ctx = multiprocessing.get_context("spawn")
    checkpoints = settings.checkpoint_steps()
    sizes = gradient_sizes(settings.scale)
    started = time.monotonic()
    with local_cluster(config, servers=settings.servers) as cluster:
        pids = {p.name: p.pid for p in cluster.processes}
        events = ctx.Queue()
        resume = [ctx.Event() for _ in checkpoints]
        job = f"bench-load-{uuid.uuid4().hex[:8]}"
        procs = [ctx.Process(target=_worker, args=(rank, settings, config, cluster.scheduler,
                                                   cluster.secret, job, events, resume))
                 for rank in range(settings.workers)]
        # A Ctrl-C reaches the whole process group. While the workers start it is neither lost
        # nor a traceback: this process notes it, to stop the workers once they are started,
        # and each worker starts with SIGINT blocked (a process inherits the mask of the thread
        # that started it) and takes it once it can end quietly (_worker). (Only the main
        # thread handles signals; elsewhere Ctrl-C is not ours to handle.)
        main = threading.current_thread() is threading.main_thread()
        pressed: list[int] = []
        previous = None
        if main:
            previous = signal.signal(signal.SIGINT, lambda signum, _: pressed.append(signum))
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        readings: dict[int, dict[str, int]] = {}          # settled
        at_barrier: dict[int, dict[str, int]] = {}
        arrived: dict[int, int] = {}
        step_s: list[float] = []
        try:
            try:
                for rank, proc in enumerate(procs):
                    proc.start()
                    assert proc.pid is not None             # set by start()
                    pids[f"worker:{rank}"] = proc.pid
            finally:
                if main:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                    signal.signal(signal.SIGINT, previous)
            if pressed:
                raise KeyboardInterrupt         # pressed while the workers started
            last_event = time.monotonic()
            while len(step_s) < settings.workers:
                try:
                    kind, rank, value = events.get(timeout=1.0)
                    last_event = time.monotonic()
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode is not None]
                    if dead or time.monotonic() - last_event > CHECKPOINT_TIMEOUT_S:
                        raise LoadError(f"no word from the workers for "
                                        f"{time.monotonic() - last_event:.0f} s; worker(s) "
                                        f"{dead or 'none'} exited without a report") from None
                    continue
                if kind == "error":
                    raise LoadError(f"worker {rank}: {value}")
                if kind == "progress":
                    progress(f"step {value} of {settings.steps}")
                elif kind == "checkpoint":
                    arrived[value] = arrived.get(value, 0) + 1
                    if arrived[value] == settings.workers:      # every worker waits: quiet
                        at_barrier[value] = _rss(pids)
                        time.sleep(settle_s(config))
                        readings[value] = _rss(pids)
                        resume[checkpoints.index(value)].set()
                elif kind == "done":
                    step_s.append(value)
        except BaseException:
            # a failure or Ctrl-C: the workers still stepping would wait for the others
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            raise
        finally:
            for proc in procs:
                if proc.pid is None:                    # never started
                    continue
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return _report(settings, sizes, readings, at_barrier, checkpoints, step_s,
                   time.monotonic() - started)


def _growth(readings: dict[int, dict[str, int]], checkpoints: list[int]) -> dict[str, float]:
    first, last = readings[checkpoints[0]], readings[checkpoints[-1]]
    return {name: (last[name] - first[name]) / first[name] for name in first}


def _report(settings: LoadSettings, sizes: list[int], readings: dict[int, dict[str, int]],
            at_barrier: dict[int, dict[str, int]], checkpoints: list[int], step_s: list[float],
            wall_s: float) -> dict[str, Any]:
    first, last = readings[checkpoints[0]], readings[checkpoints[-1]]
    growth, busy_growth = _growth(readings, checkpoints), _growth(at_barrier, checkpoints)
    roles: dict[str, dict[str, Any]] = {}
    for name in first:
        role = name.partition(":")[0]
        entry = roles.setdefault(role, {"processes": 0, "warmup_rss_MiB": 0.0, "end_rss_MiB": 0.0,
                                        "max_growth": -1.0, "max_growth_at_barrier": -1.0})
        entry["processes"] += 1
        entry["warmup_rss_MiB"] = max(entry["warmup_rss_MiB"], round(first[name] / 2**20, 1))
        entry["end_rss_MiB"] = max(entry["end_rss_MiB"], round(last[name] / 2**20, 1))
        entry["max_growth"] = max(entry["max_growth"], round(growth[name], 4))
        entry["max_growth_at_barrier"] = max(entry["max_growth_at_barrier"],
                                             round(busy_growth[name], 4))
    params = {k: v for k, v in asdict(settings).items() if k != "max_growth"}
    return {"kind": "load", **params, "max_growth_limit": settings.max_growth,
            "tensors": len(sizes) + 1, "gradient_bytes": 4 * sum(sizes),
            "canary_elements": CANARY_ELEMENTS,
            # the slowest worker's median step after the warm-up: the job's pace
            "median_step_s": round(max(step_s), 4), "wall_s": round(wall_s, 1),
            "checkpoint_steps": checkpoints, "roles": roles,
            "rss_MiB": _mib(readings), "rss_at_barrier_MiB": _mib(at_barrier),
            "max_growth": round(max(growth.values()), 4),
            "ok": max(growth.values()) < settings.max_growth}


def _mib(readings: dict[int, dict[str, int]]) -> dict[str, dict[str, float]]:
    return {str(step): {name: round(rss / 2**20, 1) for name, rss in reading.items()}
            for step, reading in sorted(readings.items())}


def format_report(report: dict[str, Any]) -> str:
    lines = [(f"{report['steps']} steps of {report['tensors']} tensors "
              f"({report['gradient_bytes'] / 2**20:.1f} MiB of gradients, "
              f"scale {report['scale']:g}), "
              f"{report['workers']} workers x {report['servers']} servers: every canary sum exact; "
              f"median step {report['median_step_s'] * 1e3:.1f} ms, "
              f"{report['wall_s']:.0f} s in all")]
    for role, entry in report["roles"].items():
        lines.append(f"  {role:9} x{entry['processes']}: RSS {entry['warmup_rss_MiB']:.1f} MiB "
                     f"after warm-up, {entry['end_rss_MiB']:.1f} MiB at the end (largest process); "
                     f"growth at most {entry['max_growth'] * 100:+.2f}% "
                     f"({entry['max_growth_at_barrier'] * 100:+.2f}% at the barrier)")
    verdict = "within" if report["ok"] else "OVER"
    lines.append(f"  memory growth {report['max_growth'] * 100:+.2f}%: {verdict} the "
                 f"{report['max_growth_limit'] * 100:g}% bound")
    return "\n".join(lines)

