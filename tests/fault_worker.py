"""A training-like worker for tests/test_fault_injection.py (run by `bpsctl run`).

    python fault_worker.py REPORT_DIR STEPS [HOLD_AT]

Each step push_pulls a few tensors of mixed sizes (one spans two partitions), earlier layers at
higher priority, all started then all synchronized as an optimizer does, and checks every sum
exactly (integers in float32). It writes ``pid-RANK`` before joining and ``step-RANK`` after
each step, so the harness can strike at a chosen point, and prints an engine error with the
time it saw it before exiting 1. With ``HOLD_AT``, each worker writes ``held-RANK`` after that
step and waits (up to a minute) for a file ``go``: the harness can then strike between steps,
when every sum of the step has reached every worker.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import bpsctl.engine as bps
from bpsctl.engine import EngineError

#: elements per tensor: a bias, small and mid-sized weights, one larger than a 4 MB partition
SIZES = (1_000, 25_000, 300_000, 1_200_000)


def main() -> None:
    report_dir, steps = sys.argv[1], int(sys.argv[2])
    hold_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    rank = int(os.environ["RANK"])
    with open(os.path.join(report_dir, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    try:
        bps.init()
        size = bps.size()
        tensors = [np.zeros(n, np.float32) for n in SIZES]
        for step in range(steps):
            handles = []
            for index, tensor in enumerate(tensors):
                tensor.fill(rank + step)
                handles.append(bps.push_pull_async(tensor, name=f"layer{index}", average=False,
                                                   priority=-index, out=tensor))
            for handle in handles:
                bps.synchronize(handle)
            want = size * step + size * (size - 1) // 2
            for index, tensor in enumerate(tensors):
                if tensor[0] != want or tensor[-1] != want:
                    sys.exit(f"wrong sum of layer{index} at step {step}: {tensor[0]} != {want}")
            with open(os.path.join(report_dir, f"step-{rank}"), "w") as f:
                f.write(str(step))
            if step == hold_at:
                _hold(report_dir, rank)
    except EngineError as exc:
        print(f"ERROR at {time.monotonic():.3f}: {exc}", flush=True)
        sys.exit(1)
    bps.shutdown()
    print(f"rank {rank}: {steps} steps, sums exact", flush=True)


def _hold(report_dir: str, rank: int, timeout_s: float = 60.0) -> None:
    """Say this worker is between steps and wait for the harness's ``go``."""
    with open(os.path.join(report_dir, f"held-{rank}"), "w") as f:
        f.write("held")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(report_dir, "go")):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: no 'go' within {timeout_s:.0f} s of holding")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
