"""The stand-in that `bpsctl bench MODEL --replay PROFILE` trains: a module with the profile's
parameters (same names, shapes, dtypes and order) whose steps take the recorded time on the
clock instead of computing.

Its forward pass sleeps the recorded forward time and builds a chain of autograd nodes, one
per parameter, in the reverse of the order the gradients became ready; backward walks that
chain, and each node sleeps until its parameter's offset from the start of backward, then
hands autograd a real gradient of the parameter's size. The autograd engine runs a
parameter's AccumulateGrad before the next node of the chain, so every hook (bpsctl's,
Horovod's, DDP's) fires in the recorded order at the recorded time, and the systems' fusion
and communication run as they would on the device the profile was recorded on. Sleeping
leaves the CPU to the communication, which is the point: the compute-to-network ratio of the
recorded device is kept on a machine that could not compute that fast.

The gradients hold a constant (their values do not change a sum's time); they are made
before the node sleeps, so writing them is inside the recorded gap. :class:`ReplayOptimizer`
waits the recorded optimizer step and updates nothing.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .profile import Profile, ProfileError, replay_schedule

#: every gradient's value: a power of two (exact in every float type, no denormals to sum)
GRADIENT_VALUE = 2.0 ** -10


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class _Clock:
    """When the current backward pass started (the first node of the chain sets it)."""

    backward_start = 0.0


class _BackwardStarts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, clock: _Clock, carry: torch.Tensor) -> torch.Tensor:
        ctx.clock = clock
        return carry.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.clock.backward_start = time.perf_counter()
        return None, grad


class _GradientReady(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, clock: _Clock, offset_s: float, carry: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.clock, ctx.offset_s = clock, offset_s
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return carry.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grads = tuple(torch.full(shape, GRADIENT_VALUE, dtype=dtype, device=device)
                      for shape, dtype, device in ctx.like)
        _sleep_until(ctx.clock.backward_start + ctx.offset_s)
        return (None, None, grad, *grads)


class ReplayModel(nn.Module):
    """The profile's parameters under the same names (nested modules for the dotted parts),
    replaying its step times multiplied by ``dilation``. ``forward(x)`` returns a tensor of
    ``x.shape[0]`` rows of the profile's classes, for the usual cross-entropy loss."""

    def __init__(self, profile: Profile, dilation: float = 1.0):
        super().__init__()
        self.schedule = replay_schedule(profile, dilation)
        self.num_classes = profile.num_classes
        self._clock = _Clock()
        for entry in profile.parameters:
            *path, leaf = entry.name.split(".")
            module: nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                child = module._modules[part]
                assert child is not None
                module = child
            dtype = getattr(torch, entry.dtype)
            module.register_parameter(leaf, nn.Parameter(torch.zeros(entry.shape, dtype=dtype)))
        names = [name for name, _ in self.named_parameters()]
        if names != [entry.name for entry in profile.parameters]:
            raise ProfileError(f"the profile's parameters cannot be rebuilt in their order "
                               f"(a module's own parameters must come before its children's); "
                               f"rebuilt as {names[:5]}...")
        self._params = [param for _, param in self.named_parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _sleep_until(time.perf_counter() + self.schedule.forward_s)
        carry = torch.zeros((), requires_grad=True)
        # applied last to first: backward meets them in the order the gradients became
        # ready, ending with a node that waits out the rest of the backward pass
        carry = _GradientReady.apply(self._clock, self.schedule.backward_s, carry)
        for index, offset_s in reversed(self.schedule.ready):
            carry = _GradientReady.apply(self._clock, offset_s, carry, self._params[index])
        carry = _BackwardStarts.apply(self._clock, carry)
        return carry.reshape(1, 1).expand(x.shape[0], self.num_classes)


class ReplayOptimizer(torch.optim.Optimizer):
    """Waits the recorded optimizer step (``step_s``) and updates nothing. The wait is kept
    in each parameter group, so the optimizer wrappers that rebuild an optimizer from its
    ``param_groups`` (bpsctl's and Horovod's DistributedOptimizer) keep it."""

    def __init__(self, params: Any, step_s: float = 0.0):
        super().__init__(params, {"step_s": step_s})

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        _sleep_until(time.perf_counter() + self.param_groups[0]["step_s"])
        return loss
