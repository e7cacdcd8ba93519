"""A small training job for tests/test_fault_recovery.py (run by `bpsctl run`).

    python recovery_worker.py REPORT_DIR STEPS

An MLP of about 4 MiB of float32 parameters (spread over every server), SGD with momentum,
data seeded by (rank, step) so that a restarted worker and a fault-free run see the same
batches. After each step it appends ``STEP SHA1`` of its parameters to ``hashes-RANK`` and
``STEP SECONDS`` to ``times-RANK``, and writes the step to ``step-RANK``; its pid is in
``pid-RANK``; at the end its parameters go to ``final-RANK.pt``.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import bpsctl.engine.torch as bps


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    with open(os.path.join(out, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    optimizer = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    start = bps.step_count()
    with open(os.path.join(out, f"hashes-{rank}"), "a") as hashes, \
            open(os.path.join(out, f"times-{rank}"), "a") as times:
        for step in range(start, steps):
            data = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(32, 512, generator=data)
            y = torch.randint(0, 10, (32,), generator=data)
            began = time.monotonic()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            took = time.monotonic() - began
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            hashes.write(f"{step} {hashlib.sha1(flat.numpy().tobytes()).hexdigest()}\n")
            times.write(f"{step} {took:.4f}\n")
            hashes.flush()
            times.flush()
            with open(os.path.join(out, f"step-{rank}"), "w") as f:
                f.write(str(step))
    torch.save(flat, os.path.join(out, f"final-{rank}.pt"))
    bps.shutdown()


if __name__ == "__main__":
    main()
