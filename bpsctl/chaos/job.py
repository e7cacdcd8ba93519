"""The training job `bpsctl chaos` runs by default (``bpsctl run`` starts it on each worker),
and what any training script run under `bpsctl chaos -- CMD` may record for its checker.

    python -m bpsctl.chaos.job REPORT_DIR STEPS

An MLP of about 4 MiB of float32 parameters (spread over every server), SGD with momentum, data
seeded by (rank, step), so that a restarted worker and a fault-free run see the same batches.
After each step a worker appends ``STEP SHA1-OF-ITS-PARAMETERS SECONDS WALL PID`` to
``steps-RANK`` (the checker compares ranks step by step and finds the stalls) and prints it
with its loss (into its log, as a training script does); at the end its parameters go to
``final-RANK.npy``. A worker that rejoins (``--max-restarts``) goes on from
the job's step. A script of one's own records the same through :class:`Recorder`, which
writes under ``BPSCTL_CHAOS_DIR`` (set by `bpsctl chaos` for every worker) and does nothing
when the script runs outside it.
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
from bpsctl.chaos import CHAOS_DIR


class Recorder:
    """What the checker of `bpsctl chaos` reads of one rank: after each step the parameters'
    digest and the step's time (``steps-RANK``), at the end the parameters (``final-RANK.npy``),
    in ``directory`` (default: ``BPSCTL_CHAOS_DIR``; without it nothing is written)."""

    def __init__(self, rank: int, directory: str | None = None) -> None:
        self.rank = rank
        self.directory = directory or os.environ.get(CHAOS_DIR) or None
        self._file = None if self.directory is None else \
            open(os.path.join(self.directory, f"steps-{rank}"), "a")

    def step(self, step: int, parameters: np.ndarray, seconds: float) -> str:
        """Record ``step`` done in ``seconds`` with these (flat, float32) parameters; their
        digest."""
        digest = hashlib.sha1(np.ascontiguousarray(parameters).tobytes()).hexdigest()
        if self._file is not None:
            self._file.write(f"{step} {digest} {seconds:.4f} {time.time():.3f} {os.getpid()}\n")
            self._file.flush()
        return digest

    def final(self, parameters: np.ndarray) -> None:
        """Record the parameters the rank ended with, and close."""
        if self.directory is not None:
            np.save(os.path.join(self.directory, f"final-{self.rank}.npy"), parameters)
        if self._file is not None:
            self._file.close()
            self._file = None


def flat_parameters(model: torch.nn.Module) -> np.ndarray:
    """Every parameter of ``model`` in one float32 array, in the order of ``parameters()``."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


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
    record = Recorder(rank, out)
    flat = np.zeros(0, dtype=np.float32)
    for step in range(bps.step_count(), steps):
        x, y = batch(rank, step)
        began = time.monotonic()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        took = time.monotonic() - began
        flat = flat_parameters(model)
        digest = record.step(step, flat, took)
        # what a training script says as it goes, into its log (and enough of it that a
        # short job's log outgrows the pages it had when a disk fault fills the disk)
        print(f"step {step} loss {loss.item():.4f} parameters {digest} "
              f"{1000 * took:.1f} ms", flush=True)
    record.final(flat)
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
