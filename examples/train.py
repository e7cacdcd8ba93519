"""Hello world: a tiny PyTorch model trained data-parallel through bpsctl.

    bpsctl run -np 2 -- python examples/train.py

Every worker draws its own batches of a synthetic regression task (y = x @ w_true + noise);
DistributedOptimizer averages the gradients across workers through the parameter servers, so
all workers hold the same weights after every step. Rank 0 prints the loss; every worker
checks at the end that its weights equal rank 0's. Runs in seconds on the CPU. The same script
runs under torchrun, and with `import horovod.torch as hvd` in place of the import below.
"""
import sys

import torch

import bpsctl.engine.torch as bps

STEPS = 50
BATCH = 32
FEATURES = 16

bps.init()
torch.manual_seed(1234 + bps.rank())            # each worker its own data and initial weights

w_true = torch.arange(FEATURES, dtype=torch.float32) / FEATURES
model = torch.nn.Linear(FEATURES, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)     # start from rank 0's weights
bps.broadcast_optimizer_state(optimizer, root_rank=0)

# a worker restarted by `bpsctl run --max-restarts` got the model above from a live worker,
# and resumes where the job is (step_count() is 0 otherwise)
for step in range(bps.step_count() + 1, STEPS + 1):
    x = torch.randn(BATCH, FEATURES)
    y = x @ w_true + 0.01 * torch.randn(BATCH)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
    loss.backward()                              # gradients are pushed as they become ready
    optimizer.step()                             # waits for their averages, then updates
    if bps.rank() == 0 and step % 10 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

# every worker applied the same averaged gradients, so the weights agree with rank 0's
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
reference = bps.broadcast_object(weights, root_rank=0, name="final_weights")
same = torch.allclose(weights, reference)
print(f"rank {bps.rank()} of {bps.size()}: weights {'match' if same else 'DIFFER from'} rank 0's",
      flush=True)
bps.shutdown()
sys.exit(0 if same else 1)
