"""The stand-in that `bpsctl bench MODEL --replay PROFILE` trains: a module with the profile's
parameters (same names, shapes, dtypes and order) whose steps take the recorded time on the
clock instead of computing.

Its forward pass sleeps the recorded forward time, module by module (each module that owns
parameters its share, split as the backward pass's time is: ``forward_shares`` in
bench/profile.py), so that forward pre-hooks run where the recorded pass reached their module:
a CrossBarrier's wait for the layer's update of the step before. It builds a chain of autograd
nodes, one per parameter, in the reverse of the order the gradients became ready; backward
walks that chain, and each node sleeps until its parameter's offset from the start of
backward, then hands autograd a real gradient of the parameter's size. The autograd engine runs a
parameter's AccumulateGrad before the next node of the chain, so every hook (bpsctl's,
Horovod's, DDP's) fires in the recorded order at the recorded time, and the systems' fusion
and communication run as they would on the device the profile was recorded on. Sleeping
leaves the CPU to the communication, which is the point: the compute-to-network ratio of the
recorded device is kept on a machine that could not compute that fast.

A profile recorded on a CPU and replayed in its own time is the exception: there the recorded
device is the CPU that also runs the communication, and the step's compute competed with it
for the cores. So the stand-in computes through those gaps instead of sleeping (``busy``):
small matrix products, which release the GIL as real compute does, until its thread has spent
the recorded seconds of CPU time in them. A deadline on the clock would not do: a worker that
loses its core to the communication would still meet it, where real compute is set back. Nor
would the thread's CPU time since backward began: the systems' hooks run on that thread
(DDP's and bpsctl's copy each gradient into a bucket) and add to a real step's time, not to
its compute.

The gradients hold a constant (their values do not change a sum's time); they are written
before the node sleeps, so writing them is inside the recorded gap. Each parameter's gradient
is written into a buffer the stand-in keeps across steps and handed to autograd as a new view
of it, which autograd takes as the parameter's ``.grad`` without copying. A fresh tensor each
step would make the kernel map and zero new pages every step (a GPU's caching allocator reuses
its memory instead): host CPU the recorded step never spent, which ``--target-cpu`` would
charge to a worker host's dilated share. :class:`ReplayOptimizer` waits the recorded
optimizer step and updates nothing.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .profile import Profile, ProfileError, replay_schedule

#: every gradient's value: a power of two (exact in every float type, no denormals to sum)
GRADIENT_VALUE = 2.0 ** -10


#: the side of the square matrices a busy wait multiplies: a product takes a fraction of a
#: millisecond on one core, so a deadline is overshot by at most that and the GIL is held for
#: little of each (Python's loop between products)
BUSY_SIDE = 128


class _Clock:
    """How the stand-in's time passes: asleep on the clock, or computing (``busy``: a CPU
    profile replayed in its own time); and, for the backward pass, where it stands."""

    def __init__(self, busy: bool = False):
        self._operands = torch.ones(2, BUSY_SIDE, BUSY_SIDE) if busy else None
        self.backward_start = 0.0      # on the clock, asleep
        self.backward_done = 0.0       # seconds of backward computed, busy
        # the forward pass, layer by layer: when the layers so far are due to have ended
        # (on the clock asleep, in this thread's CPU time busy), and when the last one did
        self._forward_due = self._forward_mark = 0.0

    @property
    def busy(self) -> bool:
        return self._operands is not None

    def spend(self, seconds: float) -> None:
        """Sleep ``seconds``, or compute until this thread has spent them on the CPU."""
        if self._operands is None:
            if seconds > 0:
                time.sleep(seconds)
            return
        a, b = self._operands[0], self._operands[1]
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            torch.mm(a, b)

    def _now(self) -> float:
        return time.perf_counter() if self._operands is None else time.thread_time()

    def start_forward(self) -> None:
        self._forward_due = self._forward_mark = self._now()

    def forward_layer(self, seconds: float) -> None:
        """A layer's share of the forward pass: until ``seconds`` past the end of the layer
        before, not counting what ran between the two (a forward pre-hook's wait) and
        counting the last layer's overshoot (a sleep ends late; a hundred layers' would add
        up), so the layers together take the recorded forward time."""
        now = self._now()
        self._forward_due += now - self._forward_mark + seconds
        self.spend(self._forward_due - now)
        self._forward_mark = self._now()

    def start_backward(self) -> None:
        self.backward_start, self.backward_done = time.perf_counter(), 0.0

    def wrote(self, cpu_s: float) -> None:
        """Writing a gradient took ``cpu_s`` of this thread's CPU: busy, part of the recorded
        compute (the recording wrote its gradients too)."""
        if self._operands is not None:
            self.backward_done += cpu_s

    def reach(self, offset_s: float) -> None:
        """Until ``offset_s`` from the start of backward: on the clock asleep; busy, once the
        backward pass has computed that long (a gap's compute, whatever ran between)."""
        if self._operands is None:
            self.spend(self.backward_start + offset_s - time.perf_counter())
        elif offset_s > self.backward_done:
            self.spend(offset_s - self.backward_done)
            self.backward_done = offset_s


class _BackwardStarts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, clock: _Clock, carry: torch.Tensor) -> torch.Tensor:
        ctx.clock = clock
        return carry.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.clock.start_backward()
        return None, grad


class _GradientReady(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, clock: _Clock, offset_s: float, buffers: list[torch.Tensor],
                carry: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.clock, ctx.offset_s = clock, offset_s
        ctx.pairs = list(zip(params, buffers, strict=True))
        return carry.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        started = time.thread_time()
        grads = tuple(_gradient(param, buffer) for param, buffer in ctx.pairs)
        ctx.clock.wrote(time.thread_time() - started)
        ctx.clock.reach(ctx.offset_s)
        return (None, None, None, grad, *grads)


def _gradient(param: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient, written into ``buffer`` and handed over as a new view of it
    (autograd keeps a tensor nobody else holds as the ``.grad`` as it is). Where the ``.grad``
    still is that buffer (accumulated over backward passes, or zeroed instead of set to
    None) autograd adds the gradient to it: then a tensor of its own."""
    held = param.grad
    if held is not None and held.data_ptr() == buffer.data_ptr():
        return torch.full_like(buffer, GRADIENT_VALUE)
    buffer.fill_(GRADIENT_VALUE)
    return buffer.view(buffer.shape)


class _Layer(nn.Module):
    """A module of the stand-in that owns parameters: its forward pass takes its share of the
    recorded forward time (ReplaySchedule.forward_shares)."""

    def __init__(self, clock: _Clock):
        super().__init__()
        self._clock = clock

    def forward(self, seconds: float) -> None:
        self._clock.forward_layer(seconds)


class ReplayModel(nn.Module):
    """The profile's parameters under the same names (nested modules for the dotted parts),
    replaying its step times multiplied by ``dilation``. ``forward(x)`` returns a tensor of
    ``x.shape[0]`` rows of the profile's classes, for the usual cross-entropy loss. A CPU's
    profile in its own time (dilation 1) is replayed busy (the module's docstring);
    ``busy`` overrides that."""

    def __init__(self, profile: Profile, dilation: float = 1.0, busy: bool | None = None):
        super().__init__()
        self.schedule = replay_schedule(profile, dilation)
        self.num_classes = profile.num_classes
        self.busy = replays_busy(profile, dilation) if busy is None else busy
        self._clock = _Clock(self.busy)
        # the modules that own parameters, in the order of their first one (the order a
        # forward pass reaches them in, for the models whose layers are registered in it),
        # each with its share of the forward pass's time
        layers: dict[nn.Module, float] = {}
        for entry, share in zip(profile.parameters, self.schedule.forward_shares, strict=True):
            *path, leaf = entry.name.split(".")
            module: nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, _Layer(self._clock))
                child = module._modules[part]
                assert child is not None
                module = child
            dtype = getattr(torch, entry.dtype)
            module.register_parameter(leaf, nn.Parameter(torch.zeros(entry.shape, dtype=dtype)))
            layers[module] = layers.get(module, 0.0) + share
        self._own_s = layers.pop(self, 0.0)
        self._layers = list(layers.items())
        names = [name for name, _ in self.named_parameters()]
        if names != [entry.name for entry in profile.parameters]:
            raise ProfileError(f"the profile's parameters cannot be rebuilt in their order "
                               f"(a module's own parameters must come before its children's); "
                               f"rebuilt as {names[:5]}...")
        self._params = [param for _, param in self.named_parameters()]
        # each parameter's gradient, rewritten every step (see _gradient); no page is touched
        # before the first backward pass
        self._grads = [torch.empty_like(param) for param in self._params]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # layer by layer, so that forward pre-hooks (a CrossBarrier's wait for a layer's
        # update) run where the recorded forward pass reached that layer
        self._clock.start_forward()
        self._clock.forward_layer(self._own_s)
        for layer, seconds in self._layers:
            layer(seconds)
        carry = torch.zeros((), requires_grad=True)
        # applied last to first: backward meets them in the order the gradients became
        # ready, ending with a node that waits out the rest of the backward pass
        carry = _GradientReady.apply(self._clock, self.schedule.backward_s, [], carry)
        for index, offset_s in reversed(self.schedule.ready):
            carry = _GradientReady.apply(self._clock, offset_s, [self._grads[index]], carry,
                                         self._params[index])
        carry = _BackwardStarts.apply(self._clock, carry)
        return carry.reshape(1, 1).expand(x.shape[0], self.num_classes)


def replays_busy(profile: Profile, dilation: float) -> bool:
    """Whether a replay computes through its gaps: a profile recorded on a CPU, replayed in
    its own time (dilated, the stretched gaps stand for compute the CPU did not spread out)."""
    return profile.device == "cpu" and dilation == 1.0


class ReplayOptimizer(torch.optim.Optimizer):
    """Waits the recorded optimizer step (``step_s``), busy or asleep as the model does
    (``busy``), and updates nothing. A step over some of the parameters waits their share of
    it, by element count (``numel``: all the parameters' at the start), as an elementwise
    update takes: a CrossBarrier updates one parameter at a time, each on a view of the
    optimizer holding it alone. All three are kept in each parameter group, so the optimizer
    wrappers that rebuild an optimizer from its ``param_groups`` (bpsctl's and Horovod's
    DistributedOptimizer) keep them."""

    def __init__(self, params: Any, step_s: float = 0.0, busy: bool = False):
        super().__init__(params, {"step_s": step_s, "busy": busy, "numel": 0})
        # rebuilt from param_groups, the groups' own values win over the defaults
        numel = sum(p.numel() for group in self.param_groups for p in group["params"])
        for group in self.param_groups:
            group["numel"] = group["numel"] or numel
        self._clock = _Clock(bool(self.param_groups[0]["busy"]))

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        first = self.param_groups[0]
        numel = sum(p.numel() for group in self.param_groups for p in group["params"])
        self._clock.spend(first["step_s"] * numel / max(first["numel"], 1))
        return loss
