#!/usr/bin/env python3
"""Where a training step's time goes on a GPU, with and without bpsctl: torch.profiler over a
few steps of a synthetic model, and a summary that says what each host thread did while the
GPU's compute stream sat idle.

Run one worker through the engine (the staged path with a server on this host):

    BPSCTL_FORCE_DISTRIBUTED=1 bpsctl run -np 1 -- python tools/gpu-profile.py \\
        --model resnet50 --out profile

For each system (``plain``: the same steps with no communication; ``bpsctl``: through
``DistributedOptimizer``) it prints the step time, the compute stream's busy share of the
steps and of their backward passes, the idle gaps of the compute stream during backward (how
many, how long, and the host op each thread was in when the largest began), the host threads'
busiest ops and the CUDA runtime calls by total time; ``--out`` gets each system's Chrome
trace (``chrome://tracing`` or https://ui.perfetto.dev). On a machine without CUDA it
profiles the CPU steps (no GPU rows), which is how it is checked where CUDA is missing.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: compute-stream gaps shorter than this are launch latency, not waiting
GAP_US = 50.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="resnet50 or vgg16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=5, help="steps before profiling")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--systems", default="plain,bpsctl")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--out", default="", help="directory for the Chrome traces")
    parser.add_argument("--top", type=int, default=8, help="rows per table")
    return parser.parse_args(argv)


def train_steps(system: str, args: argparse.Namespace, device: Any) -> tuple[Any, float]:
    """Profile ``args.steps`` steps after ``args.warmup``; returns (profiler, host s/step)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile, record_function

    from bpsctl.bench.models import build

    torch.manual_seed(0)
    model = build(args.model).to(device)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    if system == "bpsctl":
        import bpsctl.engine.torch as bps
        bps.init()
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = bps.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    cuda = device.type == "cuda"

    def step() -> None:
        with record_function("step"):
            optimizer.zero_grad()
            with record_function("forward"):
                loss = F.cross_entropy(model(data), target)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        seconds = (time.perf_counter() - start) / args.steps
    if system == "bpsctl":
        bps.shutdown()
    return prof, seconds


def summarise(system: str, prof: Any, seconds: float, top: int) -> None:
    from torch.autograd import DeviceType

    from bpsctl.trace.api import idle_gaps, union_us

    events = list(prof.events())
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    names = {e.thread: "autograd" for e in cpu if e.name.startswith("autograd::engine")}
    print(f"\n=== {system}: {1e3 * seconds:.1f} ms per step (host clock)")
    steps = [e for e in cpu if e.name == "step"]
    backwards = [e for e in cpu if e.name == "backward"]
    if gpu and steps:
        by_stream: dict[Any, list[tuple[float, float]]] = collections.defaultdict(list)
        for e in gpu:
            stream = getattr(e, "device_resource_id", None)
            by_stream[stream].append((e.time_range.start, e.time_range.end))
        compute = max(by_stream, key=lambda s: union_us(by_stream[s]))
        kernels = by_stream[compute]
        lo, hi = steps[0].time_range.start, max(e.time_range.end for e in gpu)
        print(f"GPU streams busy over the steps ({(hi - lo) / 1e3:.1f} ms): " + ", ".join(
            f"{'compute ' if s == compute else ''}stream {s} {union_us(v) / (hi - lo):.0%}"
            for s, v in sorted(by_stream.items(), key=lambda kv: -union_us(kv[1]))))
        # backward on the GPU: from the first kernel after the host began it to the last kernel
        # before the optimizer began (the host runs ahead, so these are the GPU's own bounds)
        idle: list[tuple[float, float]] = []
        busy = window = 0.0
        for back in backwards:
            after = [s for s, _ in kernels if s >= back.time_range.start]
            optim = [e.time_range.start for e in cpu if e.name == "optimizer"
                     and e.time_range.start >= back.time_range.start]
            if not after:
                continue
            begin = min(after)
            until = min(optim) if optim else hi
            mine = [(s, e) for s, e in kernels if begin <= s < until]
            if not mine:
                continue
            end = max(e for _, e in mine)
            window += end - begin
            busy += union_us(mine)
            idle += [(a, b) for a, b in idle_gaps(mine, begin, end) if b - a >= GAP_US]
        if window:
            steps_n = len(backwards)
            idle_ms = sum(b - a for a, b in idle) / 1e3 / steps_n
            print(f"backward on the compute stream: {window / 1e3 / steps_n:.1f} ms per step, "
                  f"busy {busy / window:.0%}; {len(idle) / steps_n:.0f} gaps of {GAP_US:.0f} us "
                  f"or more per step, {idle_ms:.1f} ms idle")
            # each thread's innermost op at the start of the largest gaps (the GPU ran out of
            # work then: what was the host doing?)
            for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:top]:
                doing = {}
                for e in cpu:
                    if e.time_range.start <= a <= e.time_range.end:
                        held = doing.get(e.thread)
                        if held is None or e.time_range.start >= held.time_range.start:
                            doing[e.thread] = e
                print(f"  gap {(b - a):7.0f} us: " + "; ".join(
                    f"[{names.get(t, t)}] {e.name}" for t, e in sorted(doing.items())))
    # host threads: busiest ops by self time, and the CUDA runtime calls
    self_us: dict[Any, collections.Counter] = collections.defaultdict(collections.Counter)
    runtime: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in cpu:
        self_us[e.thread][e.name] += e.self_cpu_time_total
        if e.name.startswith("cuda"):
            runtime[e.name] += e.cpu_time_total
            calls[e.name] += 1
    for thread, ops in sorted(self_us.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(ops.values())
        if total < 100:
            continue
        print(f"thread {thread} ({names.get(thread, 'host')}): {total / 1e3:.1f} ms self time; "
              + ", ".join(f"{name} {us / 1e3:.1f}" for name, us in ops.most_common(top)))
    if runtime:
        print("CUDA runtime: " + ", ".join(f"{name} {us / 1e3:.1f} ms ({calls[name]})"
                                            for name, us in runtime.most_common(top)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for system in args.systems.split(","):
        prof, seconds = train_steps(system, args, device)
        try:
            summarise(system, prof, seconds, args.top)
        except Exception:           # the trace below is still worth having
            traceback.print_exc()
        if out:
            plain = out / f"{system}.json"
            prof.export_chrome_trace(str(plain))
            with open(plain, "rb") as src, gzip.open(f"{plain}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            plain.unlink()
            print(f"wrote {plain}.gz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
