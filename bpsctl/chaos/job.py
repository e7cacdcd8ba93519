"""The training job `bpsctl chaos` runs by default (``bpsctl run`` starts it on each worker).

    python -m bpsctl.chaos.job REPORT_DIR STEPS

An MLP of about 4 MiB of float32 parameters (spread over every server), SGD with momentum, data
seeded by (rank, step), so that a restarted worker and a fault-free run see the same batches.
After each step a worker appends ``STEP SHA1-OF-ITS-PARAMETERS SECONDS WALL`` to
``steps-RANK`` (the checker compares ranks step by step and finds the stalls) and prints it
with its loss (into its log, as a training script does); at the end its parameters go to
``final-RANK.npy``. A worker that rejoins (``--max-restarts``) goes on from
the job's step.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import bpsctl.engine.torch as bps


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    model = make_model()
    optimizer = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    flat = np.zeros(0, dtype=np.float32)
    with open(os.path.join(out, f"steps-{rank}"), "a") as record:
        for step in range(bps.step_count(), steps):
            x, y = batch(rank, step)
            began = time.monotonic()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            took = time.monotonic() - began
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            digest = hashlib.sha1(flat.tobytes()).hexdigest()
            record.write(f"{step} {digest} {took:.4f} {time.time():.3f}\n")
            record.flush()
            # what a training script says as it goes, into its log (and enough of it that a
            # short job's log outgrows the pages it had when a disk fault fills the disk)
            print(f"step {step} loss {loss.item():.4f} parameters {digest} "
                  f"{1000 * took:.1f} ms", flush=True)
    np.save(os.path.join(out, f"final-{rank}.npy"), flat)
    bps.shutdown()


def make_model() -> torch.nn.Module:
    """The same initial parameters on every rank and in every run (seed 0)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s data at ``step``: the same in every run and after a restart."""
    data = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 512, generator=data), torch.randint(0, 10, (32,), generator=data)


if __name__ == "__main__":
    main()
