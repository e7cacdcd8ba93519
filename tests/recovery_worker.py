"""A small training job for tests/test_fault_recovery.py (run by `bpsctl run`).

    python recovery_worker.py REPORT_DIR STEPS [check | await-rejoin]

An MLP of about 4 MiB of float32 parameters (spread over every server), SGD with momentum,
data seeded by (rank, step) so that a restarted worker and a fault-free run see the same
batches. After each step it appends ``STEP SHA1`` of its parameters to ``hashes-RANK`` and
``STEP SECONDS`` to ``times-RANK``, and writes the step to ``step-RANK``; its pid is in
``pid-RANK``; at the end its parameters go to ``final-RANK.pt``.

With ``check`` (a job whose four workers all stay), rank 0 also recomputes every rank's
gradient of the step from the parameters the step started with and appends ``STEP ERROR`` to
``errors-0``: the largest relative difference, over the parameters, between the averaged
gradient the engine returned and the exact mean of the four in float64. Rounding in a float32
sum of four gives about 1e-7; a contribution missing from a round, or counted twice, gives
more than 1e-2 in the parameters that partition holds.

With ``await-rejoin`` (a worker is restarted, ``bpsctl run --max-restarts``) the workers
pause 1 s after each step while one is missing, so that the job outlasts the restart,
however loaded the machine: a restart slower than the steps left finds the job finished.
"""
from __future__ import annotations

import copy
import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import bpsctl.engine.torch as bps
from bpsctl.chaos.job import batch, make_model  # the same model and data as bpsctl chaos


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    check = sys.argv[3:] == ["check"]
    await_rejoin = sys.argv[3:] == ["await-rejoin"]
    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    with open(os.path.join(out, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    model = make_model()
    optimizer = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    start = bps.step_count()
    errors = open(os.path.join(out, "errors-0"), "a") if check and rank == 0 else None
    with open(os.path.join(out, f"hashes-{rank}"), "a") as hashes, \
            open(os.path.join(out, f"times-{rank}"), "a") as times:
        for step in range(start, steps):
            x, y = batch(rank, step)
            before = copy.deepcopy(model) if errors is not None else None
            began = time.monotonic()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            took = time.monotonic() - began
            if errors is not None:
                assert before is not None
                errors.write(f"{step} {average_error(model, before, step, bps.size()):.3e}\n")
                errors.flush()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            hashes.write(f"{step} {hashlib.sha1(flat.numpy().tobytes()).hexdigest()}\n")
            times.write(f"{step} {took:.4f}\n")
            hashes.flush()
            times.flush()
            with open(os.path.join(out, f"step-{rank}"), "w") as f:
                f.write(str(step))
            if await_rejoin and bps.size() < 4:
                time.sleep(1.0)
    torch.save(flat, os.path.join(out, f"final-{rank}.pt"))
    if errors is not None:
        errors.close()
    bps.shutdown()


def average_error(model: torch.nn.Module, before: torch.nn.Module, step: int,
                  size: int) -> float:
    """Largest relative L2 difference, over the parameters, between ``model``'s gradients (the
    engine's average) and the float64 mean of every rank's gradient computed from ``before``."""
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in before.parameters()]
    for r in range(size):
        before.zero_grad()
        x, y = batch(r, step)
        F.cross_entropy(before(x), y).backward()
        for total, p in zip(exact, before.parameters(), strict=True):
            total += p.grad.double()
    worst = 0.0
    for total, p in zip(exact, model.parameters(), strict=True):
        mean = total / size
        worst = max(worst, float((p.grad.double() - mean).norm() / mean.norm().clamp_min(1e-30)))
    return worst


if __name__ == "__main__":
    main()
