"""A worker for tests/test_sched_restart.py (run by `bpsctl run`).

    python sched_restart_worker.py REPORT_DIR STEPS KILL_AT SCHEDULER_PID

Each step push_pulls two integer-valued tensors (one spans two partitions) and checks every
sum exactly. At step KILL_AT rank 0 kills the scheduler (SIGKILL); the job goes on. Each rank
counts the steps it finished while the scheduler was gone; a tensor first push_pulled just
after the kill completes once the scheduler is back (the steps go on meanwhile), and so does one
first push_pulled after the loop. Then it writes ``RANK.json``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import bpsctl.engine as bps


def main() -> None:
    report_dir, steps, kill_at, scheduler_pid = sys.argv[1], *map(int, sys.argv[2:5])
    bps.init()
    rank, size = bps.rank(), bps.size()
    worker = bps._w()
    tensors = [np.zeros(n, np.int32) for n in (1_000, 300_000)]
    gone_steps, step_s = 0, []
    while_gone = np.full(10, rank + 1, np.int64)
    pending = None
    for step in range(steps):
        if step == kill_at and rank == 0:
            os.kill(scheduler_pid, signal.SIGKILL)
        if step == kill_at + 1:     # a new tensor while the scheduler is away: it waits
            pending = bps.push_pull_async(while_gone, name="declared-while-gone", average=False,
                                          out=while_gone)
        started = time.monotonic()
        handles = []
        for index, tensor in enumerate(tensors):
            tensor.fill(rank + step)
            handles.append(bps.push_pull_async(tensor, name=f"layer{index}", average=False,
                                               out=tensor))
        for handle in handles:
            bps.synchronize(handle)
        step_s.append(time.monotonic() - started)
        want = size * step + size * (size - 1) // 2
        for index, tensor in enumerate(tensors):
            if not np.all(tensor == want):
                sys.exit(f"wrong sum of layer{index} at step {step}: {tensor[:4]} != {want}")
        gone_steps += worker._sched_gone is not None
        time.sleep(0.01)
    if pending is not None:
        bps.synchronize(pending)
    if pending is not None and not np.all(while_gone == size * (size + 1) // 2):
        sys.exit(f"wrong sum of the tensor declared while the scheduler was gone: "
                 f"{while_gone[:4]}")
    started = time.monotonic()
    fresh = bps.push_pull(np.full(10, rank + 1, np.int64), name="declared-after-the-restart",
                          average=False)
    new_tensor_s = time.monotonic() - started
    if not np.all(fresh == size * (size + 1) // 2):
        sys.exit(f"wrong sum of the tensor declared after the restart: {fresh[:4]}")
    with open(os.path.join(report_dir, f"{rank}.json"), "w") as f:
        json.dump({"steps": steps, "gone_steps": gone_steps, "step_s": step_s,
                   "new_tensor_s": new_tensor_s}, f)
    bps.shutdown()
    print(f"rank {rank}: {steps} steps, sums exact, {gone_steps} without a scheduler",
          flush=True)


if __name__ == "__main__":
    main()
