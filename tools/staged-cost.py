#!/usr/bin/env python3
"""The host's share of the GPU direct path, on any machine: the engine's and the stager's own
time per staged tensor, with NumPy copies standing in for the CUDA ones.

One worker forced through one server on this host (shared memory), the torch plugin's stager
(outbound and return threads), and per step ``--buckets`` tensors of ``--bytes`` each, pushed
as the plugin's direct path pushes a CUDA gradient: the push slots lent (``Worker.lend``),
filled by runs of consecutive slots, each sum read where it arrived (``lend_results``) by runs.
Prints the wall time per tensor (one step's worth at a time, so this is throughput, not
latency), the worker process's CPU time per tensor (all its threads), and the step time.
``--no-copy`` leaves the bytes alone (only the engine's and stager's own work remains);
``--buckets 1`` times one tensor at a time (the latency of the chain of threads).

    python tools/staged-cost.py --buckets 32 --bytes 3200000 --no-copy
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bpsctl.config import Config  # noqa: E402
from bpsctl.engine import Worker  # noqa: E402
from bpsctl.engine.shmlink import merge_runs  # noqa: E402
from bpsctl.engine.torch.staging import StagedOp, Stager  # noqa: E402
from bpsctl.launch import api  # noqa: E402


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def staged_op(worker: Worker, name: str, grad: np.ndarray, host_in: np.ndarray,
              host_out: np.ndarray, device_out: np.ndarray, copy: bool) -> StagedOp:
    """One tensor through the stager as the torch plugin's direct path sends it."""
    state: dict[str, Any] = {}

    def to_host() -> None:
        lease = state["lease"] = worker.lend(name, grad.nbytes)
        if lease is None:                   # the name's first push: the engine copies
            np.copyto(host_in, grad)
            return
        raw = grad.view(np.uint8)
        for offset, view in lease.runs():
            if copy:
                np.copyto(view, raw[offset:offset + len(view)])

    def start() -> Any:
        handle = state["handle"] = worker.push_pull_async(
            host_in, name=name, out=host_out, filled=state["lease"], lend_results=True)
        return handle.wait, handle.done

    def to_device() -> None:
        raw, host = device_out.view(np.uint8), host_out.view(np.uint8)
        at = 0
        for offset, view, _ in merge_runs(state["handle"].lent):
            if offset > at:
                raw[at:offset] = host[at:offset]
            if copy:
                np.copyto(raw[offset:offset + len(view)], view)
            at = offset + len(view)
        raw[at:] = host[at:]

    return StagedOp(name, to_host, start, to_device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", type=int, default=32, help="tensors per step")
    parser.add_argument("--bytes", type=int, default=3_200_000, help="bytes per tensor")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after 3)")
    parser.add_argument("--no-copy", dest="copy", action="store_false",
                        help="skip the copies standing in for the GPU's")
    parser.add_argument("--partition-bytes", type=int, default=Config().partition_bytes)
    parser.add_argument("--partition-depth", type=int, default=Config().partition_depth)
    args = parser.parse_args(argv)
    knobs = {"partition_bytes": args.partition_bytes, "partition_depth": args.partition_depth}
    cluster_config = Config(heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0,
                            start_timeout_s=20.0, **knobs)
    with api.local_cluster(cluster_config, servers=1) as cluster:
        worker = Worker(Config(rank=0, world_size=1, num_servers=1, job_id="staged-cost",
                               scheduler=cluster.scheduler, secret=cluster.secret,
                               force_distributed=True, **knobs))
        stager = Stager(60.0)
        try:
            count = args.bytes // 4
            grads = [np.full(count, i, np.float32) for i in range(args.buckets)]
            buffers = [(np.empty_like(g), np.empty_like(g), np.empty_like(g)) for g in grads]

            def step() -> None:
                ops = [stager.submit(staged_op(worker, f"grad.{i}", grads[i], *buffers[i],
                                               args.copy))
                       for i in range(args.buckets)]
                for op in ops:
                    op.wait(60)

            for _ in range(3):
                step()
            cpu, wall = cpu_seconds(), time.perf_counter()
            for _ in range(args.steps):
                step()
            wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
            tensors = args.steps * args.buckets
            stats = worker.stats()
            parts = len(worker._tensors["grad.0"]["parts"])
            print(f"{args.buckets} tensors of {args.bytes} bytes ({parts} partitions) per step"
                  f"{'' if args.copy else ', no copies'}: {1e6 * wall / tensors:.0f} us wall "
                  f"and {1e6 * cpu / tensors:.0f} us of the worker's CPU per tensor, "
                  f"{1e3 * wall / args.steps:.2f} ms per step (pushes filled by the caller: "
                  f"{stats['filled_pushes']}, sums read where they arrived: "
                  f"{stats['lent_results']})")
        finally:
            stager.close()
            worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
