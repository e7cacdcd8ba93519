"""tests/lazy_dynamo defers torch's import of torch._dynamo in the processes the tests start:
it must not change what torch computes, and must hand over to torch's own wrappers once
torch._dynamo is loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import LAZY_DYNAMO

# trains a few steps with two optimizers, then loads torch._dynamo and calls a wrapped method
SCRIPT = r"""
import json, sys, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
optimizers = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
              torch.optim.Adam(model.parameters(), lr=0.01)]
for step in range(4):
    for optimizer in optimizers:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()
state = optimizers[1].state_dict()
loaded_while_training = "torch._dynamo" in sys.modules
import torch._dynamo
optimizers[0].zero_grad()
wrapped = torch.optim.Optimizer.zero_grad.__wrapped__
print(json.dumps({
    "dynamo_while_training": loaded_while_training,
    "params": [p.detach().flatten().tolist() for p in model.parameters()],
    "adam_steps": [float(s["step"]) for s in state["state"].values()],
    "torchs_wrapper_after": getattr(wrapped, "__dynamo_disable", None) is not None,
}))
"""


def _run(full_torch: bool) -> subprocess.Popen:
    env = {**os.environ, "BPSCTL_TESTS_FULL_TORCH": "1" if full_torch else "0"}
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_torch_trains_bitwise_the_same_without_importing_dynamo_and_hands_over_once_loaded():
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(LAZY_DYNAMO)
    lazy, full = _run(full_torch=False), _run(full_torch=True)
    outputs = []
    for process in (lazy, full):
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        outputs.append(json.loads(out))
    lazy_out, full_out = outputs
    assert lazy_out["dynamo_while_training"] is False         # what saves the time
    assert full_out["dynamo_while_training"] is True          # torch as users run it
    assert lazy_out["params"] == full_out["params"]           # bitwise: the same floats
    assert lazy_out["adam_steps"] == full_out["adam_steps"] == [4.0, 4.0]
    # once torch._dynamo is loaded, torch's own wrapper does the work, as in a user's process
    assert lazy_out["torchs_wrapper_after"] and full_out["torchs_wrapper_after"]
