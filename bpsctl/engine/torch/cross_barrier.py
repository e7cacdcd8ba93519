"""Crossing the step barrier: BytePS's ``byteps.torch.cross_barrier.CrossBarrier``.

    import bpsctl.engine.torch as bps
    from bpsctl.engine.torch.cross_barrier import CrossBarrier
    optimizer = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             named_parameters=model.named_parameters(), num_steps=steps)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()            # returns at once; the updates follow the sums in
    optimizer.synchronize()         # every update applied (also done by the last step)

With :func:`~bpsctl.engine.torch.DistributedOptimizer` a step ends at a barrier: ``step()``
waits for every averaged gradient, then updates every parameter, and only then may the next
forward pass begin. Here each parameter is updated as soon as its own average arrives, and
the next forward pass waits per module: a forward pre-hook on every module that owns
parameters waits for *those* parameters' update of the previous step. Gradients are pushed
exactly as DistributedOptimizer pushes them (the same buckets, the first layers with the
highest priority), so the first layers' sums come back first and the next step's forward
starts on them while the last layers' sums are still on the wire (ByteScheduler's idea).

The arithmetic is the wrapped optimizer's own: each update calls the wrapped class's
``step()`` on a view of the optimizer holding one parameter and a copy of its group's
hyper-parameters as they were when ``step()`` was called (a learning-rate scheduler that
changes ``param_groups[i]["lr"]`` after ``step()`` acts on the next step, as it does without
the cross-barrier). The view shares the optimizer's ``state``, so ``state_dict()`` and
``load_state_dict()`` see one optimizer; both wait for the updates in flight first. Any
``torch.optim`` optimizer whose update of a parameter depends only on that parameter's
gradient and state works (SGD, Adam, AdamW, RMSprop, ...); its single-tensor, foreach or fused
path is chosen for one tensor as it would be for the group, so the results equal
DistributedOptimizer's bit for bit where the path is the same (``foreach=False`` on both is
certain). Optimizers that look at all parameters at once (LBFGS; gradient clipping between
backward and step) cannot be split this way: use DistributedOptimizer.

Rules that follow from updating behind the user's back:

- After ``step()`` the gradients belong to the update thread: each is cleared (set to None)
  once its parameter is updated, so ``zero_grad()`` has nothing left to do for them.
- A parameter is waited for when the module that owns it starts its forward pass. A
  parameter used before that (by another module, or outside any module) is not; keep to
  ``module(x)`` calls, as ordinary models do.
- CUDA models run their forward pass on the default stream (the updates are queued there).

**Rejoining** (``bpsctl run --max-restarts``) keeps working: when a worker waits to rejoin,
``step()`` waits for its own updates to be applied (a step boundary with nothing in flight)
and hands the state over as DistributedOptimizer does; ``bps.step_count()`` counts
``step()`` calls. With an elastic ``State``, ``commit()`` saves the optimizer's state and so
waits for the step's updates: each commit is a barrier.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from ..common import EngineError
from .compression import Compression, CompressionArg
from .gradients import _Bucket, _GradientSync
from .ops import _finish, _tell_membership
from .optimizer import _check_rejoined, _end_step, _load_received, _named
from .plugin import _p

__all__ = ["CrossBarrier"]


class _CrossBarrier(torch.optim.Optimizer):
    """The methods of a cross-barrier optimizer; :func:`CrossBarrier` builds its class on the
    wrapped optimizer's class (as DistributedOptimizer does), so it is an instance of it.

    Updates run on one thread per optimizer, which takes each step's buckets in priority
    order (the first layers first: the order the next forward pass needs them) and waits for
    each push_pull, then updates its parameters. Not on a completion callback: the engine
    completes push_pulls on its I/O thread, which must not be held by optimizer arithmetic,
    and a callback may run while the main thread is inside the autograd engine. One thread
    keeps every parameter's update and its optimizer state on one thread at a time; the main
    thread touches a parameter only after waiting, under a lock, for its update (a forward
    pre-hook), so each tensor has one user at a time and no torch object is shared unguarded.
    """

    def __init__(self, params: Any, base: type[torch.optim.Optimizer], model: torch.nn.Module,
                 named_parameters: Any, compression: CompressionArg,
                 backward_passes_per_step: int, num_steps: int):
        # the wrapped optimizer's __init__, whose hyper-parameters all have defaults; the
        # param_groups passed in carry the user's
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        if _p().config.async_mode:
            raise EngineError("CrossBarrier under asynchronous training (BPSCTL_ASYNC): the "
                              "servers update the parameters, so there is no update here to "
                              "overlap; use bps.DistributedOptimizer(torch.optim.SGD(...))")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"CrossBarrier: model must be a torch.nn.Module (the forward pre-hooks "
                            f"go on its modules), got {type(model).__name__}")
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"CrossBarrier: num_steps must be a positive integer (the step "
                             f"after which step() waits for every update), got {num_steps!r}")
        named = _named(self, named_parameters)
        owned = {id(p) for p in model.parameters()}
        outside = [name for name, p in named if p.requires_grad and id(p) not in owned]
        if outside:
            raise ValueError(f"CrossBarrier: parameters {outside[:3]} are not parameters of the "
                             "model: the next forward pass could not wait for their update; "
                             "pass the model that owns every parameter of the optimizer")
        plugin = _p()
        if plugin.config.staleness:
            raise EngineError("CrossBarrier with BPSCTL_STALENESS (--staleness): the cross "
                              "barrier updates each layer as its average of this step arrives; "
                              "use DistributedOptimizer for stale updates, or set "
                              "BPSCTL_STALENESS=0")
        self._base = base
        self._sync = _GradientSync(named, "CrossBarrier.grad", compression,
                                   backward_passes_per_step, by_priority=True)
        self._group_of = {p: i for i, group in enumerate(self.param_groups)
                          for p in group["params"]}
        self._names = {p: name for name, p in named}
        self._num_steps = num_steps
        self._deadline_s = plugin.config.op_timeout_s + 10
        # guarded by _cond: steps handed to the update thread, the last step applied to each
        # parameter, the steps waiting, the first failure and whether it reached the user
        self._cond = threading.Condition()
        self._issued = 0
        self._applied = {p: 0 for p in self._sync.params}
        self._queue: deque[tuple[int, list[tuple[_Bucket, int]], list[dict]]] = deque()
        self._error: BaseException | None = None
        self._error_raised = False
        self._thread: threading.Thread | None = None
        self._module_hooks: list[Any] = []
        names = {module: name or "model" for name, module in model.named_modules()}
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in self._applied]
            if own:
                hook = self._make_forward_hook(own, names[module])
                self._module_hooks.append(module.register_forward_pre_hook(hook))
        self._index = len(plugin.optimizers)        # its state's place in a handed-over model
        plugin.optimizers.append(self)

    # ------------------------------------------------------------------ the training loop

    def step(self, closure=None):
        """Hand this step's gradients to the update thread and return: each parameter is
        updated when its average arrives. The ``num_steps``-th call (and any later) waits
        for every update."""
        plugin = _p()
        _check_rejoined(plugin)
        self._raise_failure()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # nothing of the previous step may still be in flight when this one's remaining
        # buckets are pushed (their forward pass waited for almost all of it already)
        self._wait_applied(self._sync.params, "step()")
        _load_received(plugin, self)
        handles = self._sync.take_handles()
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        with self._cond:
            self._issued += 1
            self._queue.append((self._issued, handles, hyper))
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_updates, daemon=True,
                                            name="bpsctl-cross-barrier")
            self._thread.start()
        _tell_membership(plugin)
        if self._issued >= self._num_steps or (plugin.elastic is None
                                               and plugin.worker.pending_joins):
            self.synchronize()      # the last step, or a step boundary to hand the model over
        _end_step(plugin)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients. Those of a step still being applied are cleared by the update
        thread (nothing to do here); calling this after ``backward()`` and before ``step()``
        is an error, as with DistributedOptimizer."""
        if self._sync.handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step(): CrossBarrier pushes gradients "
                                 "during backward and applies them after step(); call "
                                 "zero_grad() before the forward pass")
        self._raise_failure()
        with self._cond:
            if self._queue or any(n < self._issued for n in self._applied.values()):
                return
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Wait until every step handed over is applied (raising the first failure)."""
        if self._sync.handles:
            raise AssertionError("optimizer.synchronize() was called between loss.backward() "
                                 "and optimizer.step(): CrossBarrier updates each parameter as "
                                 "its average arrives, so there is no moment with all averaged "
                                 "gradients to inspect or clip; use DistributedOptimizer for that")
        self._wait_applied(self._sync.params, "synchronize()")

    def state_dict(self):
        self._wait_applied(self._sync.params, "state_dict()")
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict):
        self._wait_applied(self._sync.params, "load_state_dict()")
        return super(self.__class__, self).load_state_dict(state_dict)

    # ------------------------------------------------------------------ waiting

    def _make_forward_hook(self, params: list[torch.nn.Parameter], where: str):
        def wait_for_update(module: torch.nn.Module, args: Any) -> None:
            self._wait_applied(params, f"the forward pass of {where}")
        return wait_for_update

    def _wait_applied(self, params: list[torch.nn.Parameter], who: str) -> None:
        """Wait until ``params`` hold every step handed over (deadline: the op deadline)."""
        deadline = time.monotonic() + self._deadline_s
        with self._cond:
            while True:
                if self._error is not None:
                    self._error_raised = True
                    raise self._error
                late = [p for p in params if self._applied[p] < self._issued]
                if not late:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = [self._names.get(p, "?") for p in late[:3]]
                    raise EngineError(
                        f"CrossBarrier: {who} waited {self._deadline_s:g} s for the update of "
                        f"step {self._issued} of {names}; their push_pulls did not finish "
                        "(increase BPSCTL_OP_TIMEOUT if they are that slow)")
                self._cond.wait(remaining)

    def _raise_failure(self) -> None:
        with self._cond:
            if self._error is not None:
                self._error_raised = True
                raise self._error

    def _drain(self) -> BaseException | None:
        """At shutdown: wait for the updates in flight; return a failure nothing raised yet."""
        try:
            self._wait_applied(self._sync.params, "shutdown()")
        except BaseException as exc:                                # noqa: BLE001
            with self._cond:
                if self._error is None:
                    self._error = exc
        with self._cond:
            if self._error is not None and not self._error_raised:
                self._error_raised = True
                return self._error
        return None

    # ------------------------------------------------------------------ the update thread

    def _run_updates(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                step, handles, hyper = self._queue.popleft()
            for bucket, handle in handles:
                try:
                    _finish(handle)         # waits, with the engine's op deadline
                    self._sync.unpack(bucket)
                    for p in bucket.params:
                        self._update(p, hyper[self._group_of[p]])
                except BaseException as exc:                        # noqa: BLE001
                    with self._cond:
                        self._error = EngineError(
                            f"CrossBarrier: the update of {bucket.name!r} in step {step} failed: "
                            f"{exc}")
                        self._error.__cause__ = exc
                        self._cond.notify_all()
                    return
                with self._cond:
                    for p in bucket.params:
                        self._applied[p] = step
                    self._cond.notify_all()

    def _update(self, p: torch.nn.Parameter, hyper: dict) -> None:
        """The wrapped optimizer's step for ``p`` alone, with its group's hyper-parameters as
        they were at ``step()``; then clear its gradient."""
        view: torch.optim.Optimizer = object.__new__(self._base)
        view.__dict__.update(self.__dict__)          # shares state and defaults
        view.param_groups = [{**hyper, "params": [p]}]
        # the user's hooks on this optimizer ran once, at step(); not once per parameter
        view._optimizer_step_pre_hooks = OrderedDict()
        view._optimizer_step_post_hooks = OrderedDict()
        self._base.step(view)
        p.grad = None


def CrossBarrier(model: torch.nn.Module, optimizer: torch.optim.Optimizer,  # noqa: N802
                 named_parameters: Any = None,
                 compression: CompressionArg = Compression.none,
                 backward_passes_per_step: int = 1,
                 num_steps: int = 10**6) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` as :func:`~bpsctl.engine.torch.DistributedOptimizer` does, and
    update each parameter as soon as its averaged gradient arrives; the next forward pass
    waits per module for its own parameters. ``num_steps``: the number of training steps;
    the last one's ``step()`` waits for every update (``synchronize()`` does so at any time).
    See the module docstring for what it changes."""
    base = optimizer.__class__
    cls = type(base.__name__, (base,), dict(_CrossBarrier.__dict__))
    return cls(optimizer.param_groups, base, model, named_parameters, compression,
               backward_passes_per_step, num_steps)
