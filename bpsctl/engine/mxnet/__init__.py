"""MXNet plugin: a drop-in for ``byteps.mxnet`` and ``horovod.mxnet``.

    import bpsctl.engine.mxnet as bps
    bps.init()
    net = ...; net.initialize(ctx=mx.cpu())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.1}, compression=bps.Compression.fp16)
    ...; trainer.step(local_batch_size)        # parameters are broadcast from rank 0 first

    # or, with the Module API / a hand-written loop:
    opt = bps.DistributedOptimizer(mx.optimizer.create("sgd", learning_rate=0.1))
    bps.broadcast_parameters(arg_params, root_rank=0)

    # or as a Horovod script: every name of horovod.mxnet (its collectives are in .mpi_ops)
    import bpsctl.engine.mxnet as hvd
    hvd.init()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     gradient_predivide_factor=1.0, prefix=None)
    loss = hvd.allreduce(mx.nd.array([local_loss]), op=hvd.Average, name="loss")

Where the bytes are copied: a CPU NDArray in the default (dense) storage enters the engine as
a NumPy view of its own memory (``MXNDArrayGetData``), once MXNet's engine has finished every
pending read and write of it (``MXNDArrayWaitToWrite``), and the result is written back into
that memory: no copy. GPU NDArrays go to the engine by DLPack as CuPy arrays, staged through
pinned host buffers (:mod:`bpsctl.engine.cuda`), the result written back into their own
memory; without CuPy, and for empty arrays, they are copied out with ``asnumpy()`` and back
with ``_sync_copyfrom`` (two copies). Sparse ones are refused. fp16 compression adds a
cast each way (``astype``, as in BytePS) and a copy of the result into the gradient; a
trainer on several contexts sums them into the first before the push and copies the result
back to the others. A push_pull blocks the calling thread until its result is in place, so
MXNet cannot schedule other work on the array meanwhile; the trainer, the optimizer and
broadcasts start every push_pull of a step before waiting for any.

Names are bound to one shape and dtype for the whole job: gradients travel as
``DistributedTrainer.grad.<prefix><parameter name>`` / ``DistributedOptimizer.grad.<index>``,
broadcasts as ``Parameter.<prefix><name>``; a compressed tensor gets its own name
(``...:float16``). Horovod's collectives (:mod:`.mpi_ops`) are named ``<kind>.<name>``.

Asynchronous training (``BPSCTL_ASYNC``, ``bpsctl run --async``): ``DistributedTrainer`` with
MXNet's SGD lets the servers hold the parameters. Its first ``step()``/``update()`` pushes each
parameter's values (the init push, under the name its gradients take later); from then on it
pushes each ``rescale_grad * grad`` with the SGD's learning rate, momentum and weight decay,
and copies the parameters the servers answer with into every context's copy instead of running
the optimizer. MXNet's ``mom = momentum * mom - lr * g; w += mom`` is torch's ``buf = momentum
* buf + g; w -= lr * buf`` (what the servers run) for a constant learning rate.
"""
from __future__ import annotations

from typing import Any

import numpy as np

try:
    import mxnet as mx
except Exception as exc:        # noqa: BLE001 - under numpy>=1.24 it is an AttributeError
    raise ImportError("bpsctl.engine.mxnet needs mxnet 1.9.1, which needs numpy<1.24: "
                      f"pip install 'bpsctl[mxnet]' (import failed: {exc!r})") from exc

from ... import engine as _engine
from .. import compression as C
from ..collectives import HorovodInternalError
from ..common import EngineError
from ..process_sets import ProcessSet, _check_set, global_process_set
from ..trace import now_ns

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
           "byteps_declare_tensor", "byteps_push_pull", "broadcast_parameters", "Compression",
           "Compressor", "DistributedOptimizer", "DistributedTrainer", "EngineError",
           "HorovodInternalError"]


# --------------------------------------------------------------------------- lifecycle

from .ops import (  # noqa: F401 - the public face re-exports them
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    _AsyncOp,
    _Batch,
    _check_root,
    _cuda_push,
    _host_view,
    _Op,
    _wire_name,
    byteps_declare_tensor,
    byteps_push_pull,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)


def _broadcast_arrays(named: list[tuple[str, mx.nd.NDArray]], root_rank: int) -> None:
    """Broadcast by summation in which only the root pushes bytes: every other rank's pushes
    are headers naming the root it was given (Worker.push_pull_async's ``root``; ranks that
    disagree all fail)."""
    _check_root(root_rank)
    with _Batch() as batch:
        for name, array in named:
            batch.start(array, f"Parameter.{name}", average=False, priority=0, once=True,
                        root=root_rank)


def _broadcast_when_initialized(param: mx.gluon.Parameter, name: str, root_rank: int) -> None:
    """Broadcast a parameter whose initialization is deferred (its shape known only at the
    first forward pass) right after it is initialized, as Horovod does: that forward pass is
    then collective (every rank runs it)."""
    initialize = param._init_impl

    def init_then_broadcast(*args: Any, **kwargs: Any) -> None:
        initialize(*args, **kwargs)
        arrays = param.list_data()
        _broadcast_arrays([(name, arrays[0])], root_rank)
        for other in arrays[1:]:
            arrays[0].copyto(other)
    param._init_impl = init_then_broadcast


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None) -> None:
    """Copy ``params`` from ``root_rank`` to every rank, in place.

    ``params``: a dict of name -> NDArray (the Module API's ``arg_params``), or a Gluon
    ``ParameterDict`` / dict of name -> ``Parameter`` (every copy on every context is
    overwritten). Names are taken in sorted order, so insertion order does not matter. A
    Gluon parameter whose initialization is deferred is broadcast when it is initialized (at
    the first forward pass, which every rank must then run), as Horovod does. ``prefix``
    (Horovod's) sets apart the names of several calls with parameters of the same names.
    """
    if isinstance(params, mx.gluon.ParameterDict) or isinstance(params, dict):
        named = sorted(params.items())
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: expected a dict of "
                         "NDArrays or a Gluon ParameterDict")
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters: prefix must be a str, got {prefix!r}")
    prefix = prefix or ""
    _check_root(root_rank)
    first: list[tuple[str, mx.nd.NDArray]] = []
    copies: list[tuple[mx.nd.NDArray, list[mx.nd.NDArray]]] = []
    for name, value in named:
        if isinstance(value, mx.gluon.Parameter):
            if value._data is None:
                if not value._deferred_init:
                    raise ValueError(f"parameter {name!r} is not initialized: call "
                                     "initialize() before broadcasting it")
                _broadcast_when_initialized(value, prefix + name, root_rank)
                continue
            arrays = value.list_data()
            first.append((prefix + name, arrays[0]))
            copies.append((arrays[0], arrays[1:]))
        elif isinstance(value, mx.nd.NDArray):
            first.append((prefix + name, value))
        else:
            raise ValueError(f"parameter {name!r} is a {type(value).__name__}, not an NDArray "
                             "or a Gluon Parameter")
    _broadcast_arrays(first, root_rank)
    for source, others in copies:
        for other in others:
            source.copyto(other)


# --------------------------------------------------------------------------- optimizer

def _check_factor(factor: float, what: str) -> float:
    if not factor > 0:
        raise ValueError(f"{what}: gradient_predivide_factor must be positive, got {factor!r}")
    return float(factor)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer``: ``update`` first averages the gradient(s) across
    workers (in place), then lets the wrapped optimizer update. Every other attribute is the
    wrapped optimizer's, read and written through.

    Horovod's keywords: ``gradient_predivide_factor`` divides each gradient before the sum
    and multiplies the sum by it, over ``size()`` (the average is the same; the sum is
    smaller); ``num_groups`` is accepted (a call's gradients travel together anyway);
    ``process_set`` must be the global set."""

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set):
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError("DistributedOptimizer expects an mx.optimizer.Optimizer, got "
                            f"{type(optimizer).__name__}")
        _check_set(process_set, "DistributedOptimizer")
        factor = _check_factor(gradient_predivide_factor, "DistributedOptimizer")
        if _engine._w().config.async_mode:
            # it would average the gradients in synchronous rounds, which async has none of
            raise EngineError("DistributedOptimizer under asynchronous training (BPSCTL_ASYNC): "
                              "the servers run the optimizer, so use DistributedTrainer with "
                              "an mx.optimizer.SGD, or train synchronously")
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_gradient_predivide_factor", factor)
        object.__setattr__(self, "_num_groups", num_groups)

    def __getattr__(self, item: str) -> Any:
        if item == "_optimizer":                # not set yet (copy, unpickling)
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, item: str, value: Any) -> None:
        setattr(self._optimizer, item, value)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_push_pull(self, index, grad) -> None:
        indices, grads = (index, grad) if isinstance(index, (tuple, list)) else ([index], [grad])
        factor = self._gradient_predivide_factor
        with _Batch() as batch:
            for i, g in zip(indices, grads, strict=True):
                if factor != 1.0:
                    g /= factor
                batch.start(g, f"DistributedOptimizer.grad.{i}", average=True, priority=-i)
        if factor != 1.0:
            for g in grads:
                g *= factor

    def update(self, index, weight, grad, state):
        self._do_push_pull(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._do_push_pull(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


# --------------------------------------------------------------------------- trainer

def _sorted_params(params: Any) -> list[mx.gluon.Parameter]:
    if isinstance(params, (mx.gluon.ParameterDict, dict)):
        return [params[key] for key in sorted(params.keys())]
    if isinstance(params, (list, tuple)):
        return sorted(params, key=lambda p: p.name)
    raise ValueError(f"invalid params of type {type(params).__name__}: expected a Gluon "
                     "ParameterDict, a dict or a list of Parameters")


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step()`` sums every gradient across workers first.

    Parameters are taken sorted by name, so workers that built their blocks in another order
    still agree. Every initialized parameter is broadcast from ``root_rank`` when the trainer
    is built (every worker builds it, so the first forward pass already starts from the
    root's values); parameters whose initialization is still deferred (shape unknown until
    the first forward pass) are broadcast at the first ``step()`` / ``allreduce_grads()`` /
    ``update()``, before the update, as BytePS does: their first gradients then come from
    each worker's own initial values, so run one forward pass before building the trainer
    for an exact start. Gradients are summed, and ``rescale_grad`` divides by ``size()`` as
    well as the batch size, so ``trainer.step(local_batch_size)`` matches one process on
    the concatenated batch (as in BytePS). With several contexts per worker, the local
    copies of a gradient are summed before the push.

    Horovod's signature is taken as well: ``gradient_predivide_factor`` divides each gradient
    before the sum and multiplies the sum by it (the update is the same; the sum on the wire
    is smaller), ``prefix`` goes in front of every engine name of the trainer (several
    trainers over parameters of the same names), ``num_groups`` is accepted (a step's
    gradients travel together anyway) and ``process_set`` must be the global set. Unlike
    Horovod's, after ``allreduce_grads()`` the gradients hold the sum, not the average (the
    ``1 / size()`` is in ``rescale_grad``), and the parameters are broadcast at construction.

    ``compression_params`` (BytePS's): ``{"compressor": "onebit"|"topk"|"randomk"|"dithering",
    "ef": "vanilla"|None, "scaling": bool, "k": ratio (topk, randomk) or levels (dithering),
    "seed": int, "partition": "linear"|"natural", "normalize": "max"|"l2"}``: floating-point
    gradients of at least ``BPSCTL_MIN_COMPRESS_BYTES`` travel compressed by the engine, both
    ways (see :mod:`bpsctl.engine.compression`); ``compression=`` (fp16) applies before.

    Under asynchronous training (``BPSCTL_ASYNC``) the optimizer must be ``mx.optimizer.SGD``
    (``"sgd"``) without ``clip_gradient``, the parameters float32 or float64, and there is no
    compression: the servers hold the parameters and apply each worker's gradient alone.
    ``step()`` / ``update()`` push every fresh gradient, rescaled (``rescale_grad``, which
    holds ``1 / size()``: each worker's share of a synchronous step) and with the optimizer's
    learning rate (``lr_mult``, ``lr_scheduler``), momentum and weight decay (``wd_mult``) for
    that parameter, and copy the parameters the servers answer with into every context's copy
    instead of running the optimizer; the first one pushes the parameters' values first (the
    init push: the servers keep the first worker's to arrive). ``allreduce_grads()`` is
    refused: there is no sum of the gradients to change.
    """

    _params_to_init: list[Any]     # gluon.Trainer's: parameters it has not initialized yet

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None,
                 compression: type[Compressor] = Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: str | None = None,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set,
                 root_rank: int = 0, compression_params: dict[str, Any] | None = None,
                 **kwargs: Any):
        # checked first: a mistake there is the user's, and nothing has started yet
        _check_set(process_set, "DistributedTrainer")
        self._gradient_predivide_factor = _check_factor(gradient_predivide_factor,
                                                        "DistributedTrainer")
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer: prefix must be a str, got {prefix!r}")
        self._prefix = prefix or ""
        self._num_groups = num_groups       # accepted: a step's gradients travel together
        self._engine_compression = (C.from_params(compression_params)
                                    if compression_params is not None else None)
        self._async = _engine._w().config.async_mode
        given = ([f"compression={getattr(compression, '__name__', compression)}"]
                 if compression is not Compression.none else []) + \
                ([f"compression_params={compression_params}"]
                 if compression_params is not None else [])
        if self._async and given:
            raise ValueError(f"BPSCTL_ASYNC (asynchronous training) with {' and '.join(given)}: "
                             "gradients and parameters travel uncompressed (the servers apply "
                             "each gradient as it comes); drop it, or train synchronously")
        if self._async and self._gradient_predivide_factor != 1.0:
            raise ValueError("BPSCTL_ASYNC (asynchronous training) with gradient_predivide_factor="
                             f"{gradient_predivide_factor:g}: there is no sum to split it "
                             "around (the servers apply each worker's gradient as pushed); "
                             "drop it, or train synchronously")
        self._async_initialised = False     # the init pushes are done (at the first update)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer        # the trainer push_pulls the gradients itself
        kwargs.pop("kvstore", None)
        super().__init__(_sorted_params(params), optimizer, optimizer_params=optimizer_params,
                         kvstore=None, **kwargs)
        if self._async:
            _check_async(self._optimizer)
        self._compression = compression
        self._scale /= size()
        _check_root(root_rank)
        self.root_rank = root_rank
        self._init_params()

    def _init_params(self) -> None:
        ready: list[Any] = []
        deferred: list[Any] = []
        for param in self._params_to_init:
            (deferred if param._deferred_init else ready).append(param)
        named = [(self._prefix + param.name, param.list_data()[0]) for param in ready]
        _broadcast_arrays(named, self.root_rank)
        for param in ready:
            arrays = param.list_data()
            for other in arrays[1:]:
                arrays[0].copyto(other)
        self._params_to_init = deferred

    def allreduce_grads(self) -> None:
        if self._async:
            raise EngineError("trainer.allreduce_grads() under asynchronous training "
                              "(BPSCTL_ASYNC): there is no sum of the gradients to change (the "
                              "servers apply each worker's gradient as it comes); change a "
                              "worker's own gradients, if need be, and call update(), which "
                              "pushes them, or step()")
        super().allreduce_grads()

    def _allreduce_grads(self) -> None:
        if self._async:
            return          # step(): the gradients go to the servers in _update
        started_ns = now_ns()
        factor = self._gradient_predivide_factor
        pending = []
        with _Batch() as batch:
            for index, param in enumerate(self._params):
                if param.grad_req == "null":
                    continue
                grads = param.list_grad()
                for other in grads[1:]:
                    grads[0] += other.as_in_context(grads[0].context)
                if factor != 1.0:
                    grads[0] /= factor
                wire, ctx = self._compression.compress(grads[0])
                name = _wire_name(self._async_name(param), wire, grads[0])
                engine = (self._engine_compression
                          if np.dtype(wire.dtype).kind == "f" else None)
                if engine is not None:
                    name = f"{name}:{engine.spec()}"        # as a cast's own name, above
                batch.start(wire, name, average=False, priority=-index, compression=engine)
                pending.append((wire, ctx, grads))
        for wire, ctx, grads in pending:
            if wire is not grads[0]:
                self._compression.decompress(wire, ctx).copyto(grads[0])
            if factor != 1.0:
                grads[0] *= factor
            for other in grads[1:]:
                grads[0].copyto(other)
        # every gradient's push_pull happens here, after the backward pass: the wait for them
        _engine._w().trace_span("synchronize", "DistributedTrainer.grad", started_ns, now_ns())

    def _update(self, ignore_stale_grad: bool = False) -> None:
        if self._async:
            self._async_update(ignore_stale_grad)
        else:
            super()._update(ignore_stale_grad)
        _engine._w().mark_step()       # the step ends with the update (traces count steps)

    def _async_name(self, param: mx.gluon.Parameter) -> str:
        """The engine name of a parameter's gradient (of its values too, asynchronously)."""
        return f"DistributedTrainer.grad.{self._prefix}{param.name}"

    def _async_initialise(self) -> None:
        """Every trained parameter's init push: its values, under the name its gradients take;
        the servers answer with the first worker's to arrive (equal in practice: the trainer
        broadcast them), copied into every context's copy."""
        trained = [(index, param) for index, param in enumerate(self._params)
                   if param.grad_req != "null"]
        for _, param in trained:
            dtype = np.dtype(param.list_data()[0].dtype)
            if dtype not in (np.float32, np.float64):
                raise ValueError(f"BPSCTL_ASYNC (asynchronous training): parameter "
                                 f"{param.name!r} is {dtype}, but the servers hold float32 or "
                                 "float64 parameters (so SGD's multi_precision has nothing to "
                                 "do); cast the net to float32 (net.cast('float32')), or train "
                                 "synchronously")
        with _Batch() as batch:
            for index, param in trained:
                data = param.list_data()[0]
                batch.ops.append(_AsyncOp(data, data, self._async_name(param), -index,
                                          init=True))
        for _, param in trained:
            self._copy_to_contexts(param)
        self._async_initialised = True

    @staticmethod
    def _copy_to_contexts(param: mx.gluon.Parameter) -> None:
        arrays = param.list_data()
        for other in arrays[1:]:
            arrays[0].copyto(other)

    def _async_update(self, ignore_stale_grad: bool) -> None:
        """Push every fresh gradient (summed over contexts, rescaled in place) with SGD's
        hyperparameters for its parameter; the servers' parameters replace the local ones."""
        started_ns = now_ns()
        if not self._async_initialised:
            self._async_initialise()
        optimizer = self._optimizer
        rescale = float(optimizer.rescale_grad)
        pushed = []
        with _Batch() as batch:
            for index, param in enumerate(self._params):
                if param.grad_req == "null":
                    continue
                data = param.list_data()
                if not all(array._fresh_grad for array in data):
                    if ignore_stale_grad:
                        continue
                    raise UserWarning(f"Gradient of Parameter `{param.name}` has not been "
                                      "updated by backward since the last step: call step "
                                      "with ignore_stale_grad=True to skip parameters with "
                                      "stale gradients")
                grads = param.list_grad()
                for other in grads[1:]:
                    grads[0] += other.as_in_context(grads[0].context)
                if rescale != 1.0:
                    grads[0] *= rescale                 # what MXNet's SGD applies
                optimizer._update_count(index)          # as SGD does: lr_scheduler counts them
                hyper = (float(optimizer._get_lr(index)), float(optimizer.momentum),
                         float(optimizer._get_wd(index)), 0.0, False)
                batch.ops.append(_AsyncOp(grads[0], data[0], self._async_name(param), -index,
                                          update=hyper))
                for array in data:
                    array._fresh_grad = False
                pushed.append(param)
        for param in pushed:
            self._copy_to_contexts(param)
        _engine._w().trace_span("synchronize", "DistributedTrainer.grad", started_ns, now_ns())


def _check_async(optimizer: mx.optimizer.Optimizer) -> None:
    """What asynchronous training needs of DistributedTrainer's optimizer: what the servers
    run, torch's SGD, is MXNet's SGD for a constant learning rate (see the module docstring)."""
    if type(optimizer) is not mx.optimizer.SGD:
        raise ValueError(f"BPSCTL_ASYNC (asynchronous training): DistributedTrainer got "
                         f"{type(optimizer).__module__}.{type(optimizer).__qualname__}, but "
                         "the servers apply updates as SGD does (learning rate, momentum, "
                         "weight decay), and only that: use mx.optimizer.SGD (\"sgd\"), or "
                         "train synchronously")
    if optimizer.clip_gradient is not None and optimizer.clip_gradient > 0:
        raise ValueError(f"BPSCTL_ASYNC (asynchronous training): SGD with clip_gradient="
                         f"{optimizer.clip_gradient:g} is not what the servers run (they apply "
                         "the gradient as pushed); drop clip_gradient, or train synchronously")


# Horovod's names (``horovod.mxnet``): the collectives, the ops, the feature queries
from .mpi_ops import *  # noqa: E402,F403
from .mpi_ops import __all__ as _mpi_ops_all  # noqa: E402

__all__ += [name for name in _mpi_ops_all if name not in __all__]
