"""Per-tensor overhead of push_pull: a ResNet50-sized gradient set against the same bytes as
one tensor.

    python -m bpsctl.bench.grads [--workers 2] [--servers 2] [--repeats 10] [--json FILE]

Starts a private cluster over loopback, then ``--workers`` worker processes that each push_pull
ResNet50's 161 gradient tensors (25,557,032 float32, 97.5 MiB; layer order, earlier layers at
higher priority, all started then all synchronized, as DistributedOptimizer does), and the same
bytes as one tensor. Prints the medians and the overhead ratio; every round's sums are checked.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
import uuid

import numpy as np

from ..config import Config
from ..engine import Worker
from ..launch.api import local_cluster
from .shapes import resnet50_shapes


def _worker(rank: int, workers: int, scheduler: str, secret: str, security: str, job: str,
            repeats: int, warmup: int, results) -> None:
    w = Worker(Config(rank=rank, world_size=workers, job_id=job, scheduler=scheduler,
                      secret=secret, security=security, op_timeout_s=120.0))
    try:
        grads = [np.full(shape, rank + 1, np.float32) for shape in resnet50_shapes()]
        total = sum(g.size for g in grads)
        flat = np.full(total, rank + 1, np.float32)
        want = workers * (workers + 1) / 2

        def many() -> None:
            handles = [w.push_pull_async(g, name=f"grad.{i}", average=False, priority=-i)
                       for i, g in enumerate(grads)]
            outs = [w.synchronize(h) for h in handles]
            if any(out.reshape(-1)[0] != want or out.reshape(-1)[-1] != want for out in outs):
                raise SystemExit("wrong sums (many tensors)")

        def one() -> None:
            out = w.push_pull(flat, name="flat", average=False)
            if out[0] != want or out[-1] != want:
                raise SystemExit("wrong sums (one tensor)")

        times: dict[str, list[float]] = {"many": [], "one": []}
        for round_ in range(warmup + repeats):
            for kind, fn in (("many", many), ("one", one)):
                w.barrier()
                start = time.perf_counter()
                fn()
                if round_ >= warmup:
                    times[kind].append(time.perf_counter() - start)
        results.put((rank, times, total * 4, len(grads)))
    finally:
        w.shutdown()


def main(argv: list[str] | None = None) -> int:
    from bpsctl.engine.common import exit_on_sigterm
    exit_on_sigterm()           # a SIGTERM unwinds, so the private cluster is stopped
    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.grads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", dest="json_file", default=None)
    args = parser.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    config = Config.from_env()
    with local_cluster(config, servers=args.servers) as cluster:
        results = ctx.Queue()
        job = f"bench-grads-{uuid.uuid4().hex[:8]}"
        procs = [ctx.Process(target=_worker, args=(r, args.workers, cluster.scheduler,
                                                   cluster.secret, cluster.security, job,
                                                   args.repeats,
                                                   args.warmup, results))
                 for r in range(args.workers)]
        for proc in procs:
            proc.start()
        collected: list[tuple[int, dict[str, list[float]], int, int]] = []
        try:
            deadline = time.monotonic() + 600
            while len(collected) < len(procs):
                try:
                    collected.append(results.get(timeout=1))
                except Exception:       # queue.Empty: is a worker dead?
                    failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if failed or time.monotonic() > deadline:
                        print(f"bench grads: a worker failed (exit codes {failed}) or timed out",
                              file=sys.stderr)
                        return 1
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    # a step takes as long as its slowest worker: per round, the max over ranks
    rounds = {kind: [max(times[kind][i] for _, times, _, _ in collected)
                     for i in range(args.repeats)] for kind in ("many", "one")}
    nbytes, tensors = collected[0][2], collected[0][3]
    many, one = statistics.median(rounds["many"]), statistics.median(rounds["one"])
    report = {"kind": "grads", "workers": args.workers, "servers": args.servers,
              "tensors": tensors, "size_bytes": nbytes, "repeats": args.repeats,
              "partition_bytes": config.partition_bytes, "credit_bytes": config.credit_bytes,
              "many_tensors_s": round(many, 4), "one_tensor_s": round(one, 4),
              "overhead": round(many / one - 1, 4),
              "many_algbw_MBps": round(nbytes / many / 1e6, 1),
              "one_algbw_MBps": round(nbytes / one / 1e6, 1)}
    print(f"{tensors} tensors, {nbytes / 2**20:.1f} MiB, {args.workers} workers, "
          f"{args.servers} servers: all gradients {many * 1e3:.1f} ms, one tensor "
          f"{one * 1e3:.1f} ms (median of {args.repeats}); per-tensor overhead "
          f"{report['overhead'] * 100:+.1f}%", file=sys.stderr)
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(report, f, indent=2)
    else:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
