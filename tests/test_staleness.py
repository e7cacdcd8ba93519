"""Bounded staleness (`bpsctl run --staleness s`): the optimizer step of step t applies the
workers' average of step t - s, every worker the same, so models stay equal; a fast worker
runs at most s steps ahead of a slow one and does get there."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# gradients that do not depend on the parameters, so every update is known in advance:
# d/dw (w * x).sum() = x, with x = (t + 1) * (rank + 1) at step t
SCRIPT = '''
import json, os, sys, time
import torch
import bpsctl.engine.torch as bps

out_dir, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
bps.init()
rank = bps.rank()
w = torch.nn.Parameter(torch.zeros(50_000))        # its own bucket
b = torch.nn.Parameter(torch.zeros(3))             # a fused one
optimizer = bps.DistributedOptimizer(torch.optim.SGD([w, b], lr=1.0),
                                     named_parameters=[("w", w), ("b", b)])
bps.broadcast_parameters({"w": w, "b": b}, root_rank=0)
progress = os.path.join(out_dir, f"started-{rank}")
history, leads = [], []
for t in range(steps):
    if rank == 1:
        time.sleep(delay)                            # the slow worker
    with open(progress + ".tmp", "w") as f:          # steps this worker has started
        f.write(str(t + 1))
    os.replace(progress + ".tmp", progress)
    optimizer.zero_grad()
    x = torch.full((50_000,), float((t + 1) * (rank + 1)))
    ((w * x).sum() + (b * x[:3]).sum()).backward()
    optimizer.step()
    history.append([w.detach()[0].item(), w.detach()[-1].item(), b.detach()[0].item()])
    if rank == 0:
        # how many steps rank 0 has finished beyond those rank 1 has started
        try:
            with open(os.path.join(out_dir, "started-1")) as f:
                started = int(f.read())
        except FileNotFoundError:
            started = 0
        leads.append(t + 1 - started)
flushed = optimizer.flush()
final = [w.detach()[0].item(), w.detach()[-1].item(), b.detach()[0].item()]
with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
    json.dump({"history": history, "leads": leads, "flushed": flushed, "final": final}, f)
bps.shutdown()
'''


def _run(tmp_path, *flags: str, steps: int, delay: float, np: int = 2
         ) -> subprocess.CompletedProcess:
    script = tmp_path / "stale.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", "run", "-np", str(np), *flags,
                           "--", sys.executable, str(script), str(tmp_path), str(steps),
                           str(delay)],
                          env={**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state")},
                          capture_output=True, text=True, timeout=180)


def _expected(step: int, staleness: int, workers: int) -> float:
    """w after ``step`` (0-based) optimizer steps: minus the averages of steps 0..step - s."""
    mean = (workers + 1) / 2
    return -sum((t + 1) * mean for t in range(step - staleness + 1))


@pytest.mark.parametrize("staleness", [0, 2])
def test_updates_are_the_averages_of_s_steps_ago_and_a_fast_worker_leads_by_at_most_s(
        tmp_path, staleness):
    steps = 12
    done = _run(tmp_path, "--staleness", str(staleness), steps=steps, delay=0.15)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    # the same updates on both workers, each the exact average of step t - s
    assert results[0]["history"] == results[1]["history"]
    for step, (w0, w_last, b0) in enumerate(results[0]["history"]):
        assert w0 == w_last == b0 == _expected(step, staleness, 2), (step, staleness)
    # flush applies the s steps still in flight: the model then holds every step's average
    assert results[0]["flushed"] == staleness
    assert results[0]["final"] == [_expected(steps - 1 + staleness, staleness, 2)] * 3
    # rank 1 sleeps before each step: rank 0 runs ahead, by s steps and never more
    leads = results[0]["leads"]
    assert max(leads) == staleness, leads


@pytest.mark.parametrize("flags, words", [
    (["--staleness", "-1"], ["--staleness", "0 (synchronous) or more"]),
    (["--staleness", "1", "--async"], ["--async", "--staleness"]),
    (["--async", "--backup-workers", "1"], ["--async", "--backup-workers"]),
    (["--staleness", "1", "--max-restarts", "1"], ["--staleness", "--max-restarts"]),
], ids=["negative", "async", "backup", "restarts"])
def test_bad_staleness_and_combinations_exit_2_naming_the_flags(tmp_path, flags, words):
    done = _run(tmp_path, *flags, steps=1, delay=0)
    assert done.returncode == 2, (flags, done.stdout + done.stderr)
    for word in words:
        assert word in done.stderr, (flags, done.stderr)
