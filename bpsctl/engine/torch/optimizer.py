"""The wrappers that average gradients across workers: :func:`DistributedOptimizer` (Horovod's
``horovod.torch.optimizer``, its keywords checked as Horovod checks them; under asynchronous
training the servers hold the parameters) and :class:`DistributedDataParallel`, and what an
optimizer step does for a rejoining worker."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ... import engine as _engine
from .. import collectives as K
from ..collectives import ReduceOp
from ..common import EngineError
from ..trace import now_ns
from .compression import Compression, CompressionArg
from .functions import _donate, broadcast_parameters
from .gradients import _AsyncSync, _GradientSync
from .ops import synchronize
from .plugin import _p, _Plugin
from .process_sets import ProcessSet, _check_set
from .staleness import StaleGradients

#: the options of the plugin's gradient hooks when no Horovod keyword is given
DEFAULTS: dict[str, Any] = {"average": True, "predivide": 1.0, "sparse_as_dense": False}


def _optimizer_options(op: Any, gradient_predivide_factor: float, num_groups: int, groups: Any,
                       sparse_as_dense: bool, process_set: ProcessSet | None,
                       backward_passes_per_step: int) -> dict[str, Any]:
    """DistributedOptimizer's Horovod keywords, checked as Horovod checks them, as the
    options of its gradient hooks (``average``, ``predivide``, ``sparse_as_dense``)."""
    resolved = K.resolve_op(op, None, "DistributedOptimizer")
    K.check_op(resolved, K.SERVER_OPS, "DistributedOptimizer")
    if gradient_predivide_factor != 1.0:
        if resolved is not K.ReduceOp.Average:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor is not supported "
                             "with op != hvd.Average")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"DistributedOptimizer: gradient_predivide_factor must be "
                             f"positive, got {gradient_predivide_factor}")
        if _p().config.staleness:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor with "
                             "BPSCTL_STALENESS is not supported; leave it at 1.0")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups and groups is None:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or
                                   (isinstance(groups, int) and groups > 0)):
        raise ValueError("DistributedOptimizer: groups should be a non-negative integer or a "
                         f"list of lists of torch.Tensor, got {groups!r}")
    _check_set(process_set, "DistributedOptimizer")
    return {"average": resolved is K.ReduceOp.Average,
            "predivide": float(gradient_predivide_factor), "sparse_as_dense": bool(sparse_as_dense)}


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's parameters with their names (``param.<i>`` when none are given)."""
    all_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"param.{i}", p) for i, p in enumerate(all_params)]
    unnamed = {id(p) for p in all_params} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError("named_parameters does not cover every parameter of the optimizer "
                         f"({len(unnamed)} missing); pass model.named_parameters()")
    return named


def _check_rejoined(plugin: _Plugin) -> None:
    if plugin.worker.joined_running and plugin.received is None:     # restarted, or attached
        raise EngineError("this worker rejoins a running job and receives the model in "
                          "broadcast_parameters(model.state_dict(), root_rank=0): call it "
                          "before the first step, as with Horovod")


def _load_received(plugin: _Plugin, optimizer: Any) -> None:
    """At a rejoined worker's first step: load the live worker's state of ``optimizer``."""
    if optimizer._index in plugin.unloaded:
        plugin.unloaded.discard(optimizer._index)
        assert plugin.received is not None
        optimizer.load_state_dict(plugin.received["optimizers"][optimizer._index])


def _end_step(plugin: _Plugin) -> None:
    """An optimizer step is over (no push_pull of it in flight): count it, and hand the state
    to any worker waiting to rejoin."""
    plugin.steps += 1
    if plugin.received is not None and plugin.received["params"] and not plugin.unloaded:
        plugin.received = {**plugin.received, "params": {}, "optimizers": []}   # memory
    _engine._w().mark_step()
    if plugin.elastic is None:          # an elastic State hands it over at commit()
        _donate(plugin)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 options: dict[str, Any] | None = None):
        # the class is rebuilt on the wrapped optimizer's class (DistributedOptimizer): this is
        # that optimizer's __init__, whose hyperparameters all have defaults
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        plugin = _p()
        named, prefix = _named(self, named_parameters), "DistributedOptimizer.grad"
        self._sync: _GradientSync
        if plugin.config.async_mode:        # the servers run this optimizer
            self._sync = _AsyncSync(named, prefix, self, backward_passes_per_step)
        else:
            # alone, the gradients are their own averages: no hooks, nothing per step
            # (staleness still delays the update by its s steps, so it keeps the full path)
            self._sync = _GradientSync(named, prefix, compression, backward_passes_per_step,
                                       solo=plugin.worker.solo and not plugin.config.staleness,
                                       **(options or {}))
            if plugin.config.staleness:
                self._sync.stale = StaleGradients(self._sync, plugin.config.staleness)
        self._should_synchronize = True
        self._synchronized = False
        self._update_due = True         # the gradients hold an average to apply
        self._index = len(plugin.optimizers)        # its state's place in a handed-over model
        plugin.optimizers.append(self)

    def synchronize(self) -> None:
        """Wait for every gradient's push_pull (pushing any that has not started). Under
        staleness (``BPSCTL_STALENESS=s``): push this step's, and wait for the averages of
        ``s`` steps ago, which the gradients then hold (none in the first ``s`` steps)."""
        if self._sync.stale is not None:
            self._update_due = self._sync.stale.end_step()
        else:
            self._sync.synchronize(end_of_step=False)   # step() ends it, after the update
        self._synchronized = True

    def flush(self) -> int:
        """Under staleness: apply the averaged gradients of every step still in flight, oldest
        first, one update each, so the model holds every step's gradients (call it after the
        last step, before evaluating or saving). Returns how many updates it applied (0
        without staleness)."""
        stale = self._sync.stale
        if stale is None:
            return 0
        return stale.flush(lambda: super(self.__class__, self).step())

    def _drain(self) -> BaseException | None:
        """At shutdown: wait for the rounds still in flight under staleness."""
        return None if self._sync.stale is None else self._sync.stale.drain()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        plugin = _p()
        _check_rejoined(plugin)
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        _load_received(plugin, self)
        if self._update_due:
            loss = super(self.__class__, self).step(closure)
        else:           # staleness: no averaged gradients yet in the first s steps
            loss = closure() if closure is not None else None
        _end_step(plugin)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._sync.handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


class _AsyncDistributedOptimizer(_DistributedOptimizer):
    """DistributedOptimizer under asynchronous training (see :mod:`bpsctl.engine.torch`); its
    ``__init__`` is DistributedOptimizer's, which gives it an :class:`_AsyncSync`."""

    def synchronize(self) -> None:
        raise EngineError("optimizer.synchronize() under asynchronous training (BPSCTL_ASYNC): "
                          "gradients go to the servers as backward computes them, and the "
                          "servers apply them; nothing can change them between synchronize() "
                          "and step() (gradient clipping included). Call step() alone")

    def step(self, closure=None):
        plugin = _p()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sync = self._sync
        assert isinstance(sync, _AsyncSync)
        started_ns = now_ns()
        if not sync.initialised:
            sync.initialise()
        for bucket, handle in sync.take_handles():      # pushes what the hooks did not
            synchronize(handle)
            sync.unpack_params(bucket)
        plugin.worker.trace_span("synchronize", sync.prefix, started_ns, now_ns())
        _end_step(plugin)
        return loss


def _check_async(optimizer: torch.optim.Optimizer, compression: CompressionArg) -> None:
    """What asynchronous training needs of DistributedOptimizer's arguments."""
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(f"BPSCTL_ASYNC (asynchronous training): DistributedOptimizer got "
                         f"{type(optimizer).__module__}.{type(optimizer).__qualname__}, but the "
                         "servers apply updates as torch.optim.SGD does (momentum, weight "
                         "decay, Nesterov), and only that: wrap a torch.optim.SGD, or train "
                         "synchronously")
    if any(group.get("maximize") for group in optimizer.param_groups):
        raise ValueError("BPSCTL_ASYNC (asynchronous training): torch.optim.SGD with "
                         "maximize=True is not what the servers run; negate the loss instead")
    if compression is not Compression.none:
        raise ValueError(f"BPSCTL_ASYNC (asynchronous training) with compression "
                         f"{getattr(compression, '__name__', compression)}: gradients and "
                         "parameters travel uncompressed (servers apply each gradient as it "
                         "comes); drop the compression, or train synchronously")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: CompressionArg = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so each gradient is averaged across workers from a per-parameter hook
    the moment it is ready; ``step()`` waits only for what is still outstanding. Under
    ``BPSCTL_ASYNC`` (``optimizer`` a ``torch.optim.SGD``) the servers hold the parameters and
    apply the gradients: see :mod:`bpsctl.engine.torch`, "Asynchronous training".

    Horovod's keywords: ``op`` (``Average``, or ``Sum`` to sum the gradients; Adasum is
    refused), ``gradient_predivide_factor`` (Average only: gradients are divided by it before
    the sum and multiplied by it after the average), ``sparse_as_dense`` (sparse gradients
    travel dense and are made sparse again), ``process_set`` (the global one only);
    ``groups`` and ``num_groups`` are checked and otherwise left to bpsctl's buckets
    (``BPSCTL_FUSION_BYTES``), which group gradients in backward order already."""
    options = _optimizer_options(op, gradient_predivide_factor, num_groups, groups,
                                 sparse_as_dense, process_set, backward_passes_per_step)
    methods = dict(_DistributedOptimizer.__dict__)
    if _p().config.async_mode:
        _check_async(optimizer, compression)
        if options != DEFAULTS:
            raise ValueError("BPSCTL_ASYNC (asynchronous training): the servers apply each "
                             "gradient as it comes; op, gradient_predivide_factor and "
                             "sparse_as_dense do not apply there; leave them at their defaults")
        methods.update(_AsyncDistributedOptimizer.__dict__)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               options)


class DistributedDataParallel(torch.nn.Module):
    """Like ``torch.nn.parallel.DistributedDataParallel``: parameters are broadcast from rank 0
    at construction, and after each ``backward()`` every gradient holds the workers' average.
    Inside ``no_sync()`` gradients accumulate locally and are averaged at the next backward
    outside it."""

    def __init__(self, module: torch.nn.Module,
                 compression: CompressionArg = Compression.none):
        if _p().config.async_mode:
            raise EngineError("DistributedDataParallel under asynchronous training "
                              "(BPSCTL_ASYNC): the servers apply the updates, and this wrapper "
                              "has no optimizer to take them from; wrap a torch.optim.SGD in "
                              "bps.DistributedOptimizer instead")
        if _p().config.staleness:
            raise EngineError("BPSCTL_STALENESS (--staleness) applies the averaged gradients of "
                              "s steps ago in the optimizer step: use DistributedOptimizer, not "
                              "DistributedDataParallel, or set BPSCTL_STALENESS=0")
        super().__init__()
        self.module = module
        broadcast_parameters(module.state_dict(), root_rank=0)
        # the first push of a backward pass queues the wait for all of them at its end
        self._sync = _GradientSync(
            list(module.named_parameters()), "DistributedDataParallel.grad", compression, 1,
            before_first_push=lambda: torch.autograd.Variable._execution_engine.queue_callback(
                self._sync.synchronize))

    @contextlib.contextmanager
    def no_sync(self):
        enabled = self._sync.enabled
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = enabled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
