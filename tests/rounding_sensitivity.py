"""How far apart rounding alone puts two runs of tests/recovery_worker.py's job, without the engine.

    python tests/rounding_sensitivity.py [STEPS]

Trains recovery_worker.py's MLP in one process on the four ranks' data, averaging the four
gradients itself, and prints the final parameters' relative L2 difference from a reference
run for: the four-way sum of one step taken in another order (what a server summing in arrival
order may do), one step with one rank's gradient missing, and one rank missing from the middle
step on. tests/test_fault_recovery.py's bound on the final parameters comes from these figures.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from recovery_worker import batch, make_model


def train(steps: int, order_at: int = -1, missing_at: int = -1, missing_from: int = -1
          ) -> torch.Tensor:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(steps):
        grads = []
        for rank in range(4):
            model.zero_grad()
            x, y = batch(rank, step)
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        ranks = [3, 1, 0, 2] if step == order_at else [0, 1, 2, 3]
        if step == missing_at or 0 <= missing_from <= step:
            ranks = ranks[:3]
        for i, p in enumerate(model.parameters()):
            total = grads[ranks[0]][i].clone()
            for rank in ranks[1:]:
                total += grads[rank][i]
            p.grad = total / len(ranks)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    torch.set_num_threads(1)
    reference = train(steps)

    def diff(final: torch.Tensor) -> str:
        return f"{float((final - reference).norm() / reference.norm()):.2e}"

    for step in (steps // 20, steps // 4, 2 * steps // 5, 7 * steps // 10, 19 * steps // 20):
        print(f"sum of step {step} in another order: {diff(train(steps, order_at=step))}")
    print(f"rank 3 missing from step {steps // 2}: {diff(train(steps, missing_at=steps // 2))}")
    print(f"rank 3 missing from step {steps // 2} on: "
          f"{diff(train(steps, missing_from=steps // 2))}")


if __name__ == "__main__":
    main()
