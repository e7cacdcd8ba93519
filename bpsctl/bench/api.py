"""Benchmarks as functions: what `bpsctl bench` runs, and what tests call directly."""
from __future__ import annotations

import json
import socket
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .. import __version__, launch
from ..config import Config
from .comm import zmq_pair_seconds


class BenchError(RuntimeError):
    """A benchmark could not produce its figures; the message says why."""


@dataclass(frozen=True)
class CommSettings:
    workers: int = 2
    servers: int = 2
    size_bytes: int = 64 * 1024 * 1024
    tensors: int = 8
    warmup: int = 3
    repeats: int = 10
    raw: bool = True             # also measure raw ZeroMQ in the same run


def _mbps(size_bytes: int, seconds: float) -> float:
    return size_bytes / seconds / 1e6


def run_comm(config: Config, settings: CommSettings, worker_output: IO[str] | None = None) -> dict[str, Any]:
    """push_pull of ``size_bytes`` (over ``tensors`` tensors) with N workers and K servers,
    beside the raw ZeroMQ throughput of this machine for the same bytes and message size.

    Returns the JSON of shared/DESIGN.md (``kind: comm``). Uses the cluster that `bpsctl up`
    started if there is one, otherwise a private one.
    """
    worker_output = worker_output if worker_output is not None else sys.stderr
    n, k = settings.workers, settings.servers
    with tempfile.TemporaryDirectory(prefix="bpsctl-bench-") as tmp:
        out_file = Path(tmp) / "comm.json"
        cmd = [sys.executable, "-m", "bpsctl.bench.comm", "--size", str(settings.size_bytes),
               "--tensors", str(settings.tensors), "--warmup", str(settings.warmup),
               "--repeats", str(settings.repeats), "--out", str(out_file)]
        result = launch.run_local(cmd, n, config.replace(num_servers=k), servers=k,
                                  stdout=worker_output, stderr=worker_output)
        if result.exit_code != 0:
            detail = ""
            if result.failures:
                failure = result.failures[0]
                detail = f": worker {failure.rank} exited {failure.exit_code}: " + \
                    " | ".join(failure.last_lines[-3:])
            raise BenchError(f"the comm benchmark's workers failed{detail}")
        measured = json.loads(out_file.read_text())
    seconds = measured["seconds"]
    size = measured["size_bytes"]
    median = statistics.median(seconds)
    algbw = _mbps(size, median)
    bus_factor = 2 * (n - 1) / n if n > 1 else 1.0     # nccl-tests' allreduce busbw
    results: list[dict[str, Any]] = [{
        "system": "bpsctl", "version": __version__, "seconds": median, "seconds_all": seconds,
        "algbw_MBps": algbw, "busbw_MBps": algbw * bus_factor, "nic_fraction": None,
        "push_pulls_per_s": measured["tensors"] / median,
    }]
    report: dict[str, Any] = {
        "kind": "comm", "workers": n, "servers": k, "nic_mbit": None, "size_bytes": size,
        "tensors": measured["tensors"], "partition_bytes": config.partition_bytes,
        "credit_bytes": config.credit_bytes, "warmup": settings.warmup,
        "repeats": settings.repeats, "host": socket.gethostname(), "results": results,
        "speedup": {},
    }
    if settings.raw:
        raw_seconds = zmq_pair_seconds(size, min(config.partition_bytes, size),
                                       repeats=max(5, settings.repeats))
        raw_median = statistics.median(raw_seconds)
        import zmq
        results.append({
            "system": "zmq_raw", "version": f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}",
            "seconds": raw_median, "seconds_all": raw_seconds,
            "algbw_MBps": _mbps(size, raw_median), "busbw_MBps": _mbps(size, raw_median),
            "nic_fraction": None,
            "what": "one-way PUSH->PULL of the same bytes in partition-sized zero-copy frames, "
                    "between two processes over loopback TCP: this machine's ZeroMQ limit",
        })
        report["fraction_of_raw"] = algbw / _mbps(size, raw_median)
    return report
