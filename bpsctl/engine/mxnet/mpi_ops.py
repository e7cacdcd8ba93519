"""Horovod's MXNet collectives (``horovod.mxnet.mpi_ops`` and ``horovod.mxnet.functions``) on
bpsctl's engine, for ``import bpsctl.engine.mxnet as hvd``.

Every collective is built from the engine's push_pull, as :mod:`bpsctl.engine.collectives`
describes (the arithmetic is there, shared with the PyTorch plugin): Sum and Average are
summed by the servers (floating-point NDArrays in place, through
:class:`bpsctl.engine.mxnet._Op`; integers as a sum, floor-divided for the average, as
Horovod does); Min, Max and Product are reduced elementwise by the servers
(:func:`bpsctl.engine.allreduce`; bool as its bytes); allgather, broadcast and alltoall
gather through summation (each rank's rows at its offset in a zeroed buffer), each rank
pushing only its own bytes (a broadcast: the root's, the others' pushes naming the root, which
the servers check agree); reducescatter sums the whole tensor and keeps this rank's rows.

Unlike Horovod's, which queue on MXNet's engine, these calls return once the result is in
place (MXNet's pending writes to the input are waited for first). The rules are Horovod's:
every rank calls the same collectives in the same order, with the same names (a name left out
is made the same way on every rank, :class:`~bpsctl.engine.collectives.AutoNames`), and the
same shapes where Horovod needs them. An engine failure is raised as
:class:`HorovodInternalError`. ``process_set=``: a collective on a process set runs among its
ranks only, under names of its own (:mod:`bpsctl.engine.process_sets`; float sums go through
host memory then). Not carried: Adasum (ValueError naming ``op=hvd.Average``); ``priority`` is
passed to the engine where the servers sum, and ignored elsewhere.
"""
from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import mxnet as mx
import numpy as np

from ... import engine as _engine
from .. import collectives as K
from ..basics import (  # noqa: F401 - Horovod's names, as its mxnet module has them
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from ..collectives import HorovodInternalError, ReduceOp
from ..common import EngineError
from ..process_sets import (  # noqa: F401 - Horovod's mpi_ops has these names
    ProcessSet,
    ProcessSetUnsupported,
    Scope,
    _barrier,
    _check_set,
    _scope,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from ..trace import now_ns
from .ops import _check_root, _host_view, _Op, rank, size

Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product

__all__: list[str] = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "ProcessSet", "ProcessSetUnsupported", "global_process_set", "add_process_set",
    "remove_process_set", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
    "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "allgather_object", "broadcast_object", "barrier", "join"]


# --------------------------------------------------------------------------- what bpsctl is

def nccl_built() -> int:
    """0: the MXNet plugin has no NCCL path (GPU NDArrays are staged through host memory)."""
    return 0


def cuda_built() -> bool:
    """Whether this MXNet was built with CUDA (GPU NDArrays are then carried, staged through
    host memory)."""
    return bool(mx.runtime.Features().is_enabled("CUDA"))


_layouts: dict[int, tuple[int, int, bool]] = {}      # id(worker) -> its host layout


def _hosts() -> tuple[int, int, bool]:
    """(cross rank, cross size, homogeneous), found once per job
    (:func:`bpsctl.engine.collectives.host_layout`)."""
    worker = _engine._w()
    if id(worker) not in _layouts:
        with _internal():
            _layouts[id(worker)] = K.host_layout(worker.rank, worker.size, worker.local_rank,
                                                 worker.local_size, _sum, worker.rank_hosts)
    return _layouts[id(worker)]


def cross_rank() -> int:
    """This host's index among the hosts that have a worker of this local rank (Horovod's
    cross rank; with equal hosts, the host's index). When hosts hold different numbers of
    workers the first call is collective (a small exchange): call it on every rank."""
    return _hosts()[0]


def cross_size() -> int:
    """How many hosts have a worker of this local rank (with equal hosts: the host count)."""
    return _hosts()[1]


def is_homogeneous() -> bool:
    """Whether every host runs as many workers (see :func:`cross_rank`)."""
    return _hosts()[2]


# --------------------------------------------------------------------------- common pieces

_auto_names = K.AutoNames()


def _sum(array: np.ndarray, name: str, mine: tuple[int, int] | None = None,
         scope: Scope | None = None) -> np.ndarray:
    """The engine's sum of ``array`` over every worker (over a process set's ranks, for
    ``scope``), a new array; ``mine``: the bytes of ``array`` that are this rank's, the rest
    zeros (pushed as headers alone)."""
    return _engine._w().push_pull(array, name=name, average=False, mine=mine,
                                  ranks=None if scope is None else scope.ranks)


def _joinless(kind: str, scope: Scope) -> K.GatherFn:
    """:func:`_sum` over ``scope`` for a ``kind`` collective that a joined rank cannot add
    zeros to: Horovod's error now if a rank has joined
    (:func:`bpsctl.engine.collectives.check_joined`), or from the sum if one joins before it
    completes."""
    worker = _engine._w()
    message = K.check_joined(kind, worker.joined_ranks)

    def joinless_sum(array: np.ndarray, name: str,
                     mine: tuple[int, int] | None = None, /) -> np.ndarray:
        return worker.synchronize(worker.push_pull_async(
            array, name=name, average=False, join_error=message, ranks=scope.ranks, mine=mine))
    return joinless_sum


def _broadcast(array: np.ndarray, name: str, root_rank: int,
               scope: Scope | None = None) -> np.ndarray:
    """``root_rank``'s ``array`` on every rank of ``scope`` (a new array): only the root
    pushes bytes; ranks that name different roots all fail, naming them; Horovod's error if a
    rank has joined."""
    worker = _engine._w()
    message = K.check_joined("broadcast", worker.joined_ranks)
    return worker.synchronize(worker.push_pull_async(
        array, name=name, average=False, root=root_rank,
        ranks=None if scope is None else scope.ranks, join_error=message))


@contextlib.contextmanager
def _internal() -> Iterator[None]:
    """An engine failure (a worker or server lost, a deadline passed, ranks that disagree on
    a tensor) raised as :class:`HorovodInternalError`, as Horovod raises it."""
    try:
        yield
    except HorovodInternalError:
        raise
    except EngineError as exc:
        raise HorovodInternalError(str(exc)) from exc


@contextlib.contextmanager
def _named(kind: str, name: str | None, signature: str,
           scope: Scope | None = None) -> Iterator[str]:
    """The engine name of a collective of ``kind`` while it runs: ``<kind>.<name>``, or an
    automatic one for the dtype and shape ``signature`` (given back when it ends, whether it
    succeeds or not, so that every rank's next one takes the same name). A collective that
    completes is a ``collective`` span of the worker's trace (a timeline's). A process set's
    names start with its prefix (``ps<id>/``)."""
    prefix = "" if scope is None else scope.prefix
    if name is None:
        wire, release = _auto_names.take(f"{prefix}{kind}.noname.{signature}")
    else:
        wire, release = f"{prefix}{kind}.{name}", None
    started_ns = now_ns()
    try:
        with _internal():
            yield wire
    finally:
        if release is not None:
            release()
    _engine._w().trace_span("collective", wire, started_ns, now_ns())


def _signature(tensor: mx.nd.NDArray, first_dim: bool = True) -> str:
    dims = tensor.shape if first_dim else tensor.shape[1:]
    return f"{np.dtype(tensor.dtype).name}:{'x'.join(map(str, dims))}"


def _check_nd(tensor: Any, what: str) -> mx.nd.NDArray:
    """``tensor`` if it is a dense NDArray (TypeError naming what it is otherwise)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what} expects an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise TypeError(f"{what}: {tensor.stype} NDArrays are not carried; use "
                        "tensor.tostype('default')")
    return tensor


def _check_summable(tensor: mx.nd.NDArray, op: ReduceOp, what: str) -> None:
    if np.dtype(tensor.dtype) == np.bool_ and op in K.SERVER_OPS:
        raise TypeError(f"{what}: a bool tensor cannot be summed or averaged; use op=hvd.Max "
                        "(any) or op=hvd.Min (all), or cast it to uint8")


def _write(target: mx.nd.NDArray, values: np.ndarray) -> mx.nd.NDArray:
    """``values`` copied into ``target``'s own memory; returns ``target``."""
    view = _host_view(target, writable=True)
    if view is not None:
        view[...] = values
    elif target.size:
        target._sync_copyfrom(values)
    return target


def _new(values: np.ndarray, like: mx.nd.NDArray) -> mx.nd.NDArray:
    """A new NDArray of ``values`` on ``like``'s context (an ``mx.np.ndarray`` if it is)."""
    out = mx.nd.array(values, ctx=like.context, dtype=values.dtype)
    return out.as_np_ndarray() if isinstance(like, mx.np.ndarray) else out


def _ints(splits: Any) -> list[int]:
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    return [int(s) for s in np.asarray(splits).reshape(-1)]


# --------------------------------------------------------------------------- allreduce

def _reduce_into(target: mx.nd.NDArray, op: ReduceOp, wire: str, priority: int,
                 prescale_factor: float, postscale_factor: float,
                 scope: Scope | None = None) -> mx.nd.NDArray:
    """``target`` (a private copy, or the caller's tensor for the in-place forms) replaced by
    its reduction over every rank (over a process set's, for ``scope``)."""
    dtype = np.dtype(target.dtype)
    if scope is not None and scope.ranks is not None:
        return _write(target, K.scaled(_reduced_in_set(
            K.scaled(target.asnumpy(), prescale_factor), op, wire, priority, scope),
            postscale_factor))
    if op in K.SERVER_OPS and dtype.kind == "f":
        # in place, without a copy on the host (a GPU array is staged, see _Op)
        if prescale_factor != 1.0:
            target *= prescale_factor
        _Op(target, wire, op is Average, priority).wait()
        if postscale_factor != 1.0:
            target *= postscale_factor
        return target
    values = K.scaled(target.asnumpy(), prescale_factor)
    if op in K.SERVER_OPS:
        total = _engine._w().push_pull(values, name=wire, average=False, priority=priority)
        if op is Average:           # integers: Horovod's floor division of the sum
            total = K.floor_average(total, size())
    else:       # Min, Max, Product: by the servers (bool as its bytes, 0 and 1: all, any)
        total = K.from_bytes(_engine.allreduce(K.as_bytes(values), name=wire, op=op,
                                               priority=priority), values.dtype)
    return _write(target, K.scaled(total, postscale_factor))


def _reduced_in_set(values: np.ndarray, op: ReduceOp, wire: str, priority: int,
                    scope: Scope) -> np.ndarray:
    """``values`` reduced by ``op`` over a process set's ranks (through host memory)."""
    worker = _engine._w()
    if op in K.SERVER_OPS:
        floating = values.dtype.kind == "f"
        total = worker.push_pull(values, name=wire, average=op is Average and floating,
                                 priority=priority, ranks=scope.ranks)
        return K.floor_average(total, scope.size) if op is Average and not floating else total
    return K.from_bytes(worker.push_pull(K.as_bytes(values), name=wire, average=False,
                                         priority=priority, reduction=K.SERVER_REDUCTIONS[op],
                                         ranks=scope.ranks), values.dtype)


def _allreduce(tensor: Any, inplace: bool, average: bool | None, name: str | None,
               priority: int, prescale_factor: float, postscale_factor: float,
               process_set: ProcessSet | None, op: Any, what: str) -> mx.nd.NDArray:
    resolved = K.resolve_op(op, average, what)
    scope = _scope(process_set, what)
    _check_nd(tensor, what)
    _check_summable(tensor, resolved, what)
    kind = f"allreduce.{resolved.name}" if resolved in K.SERVER_REDUCTIONS else "allreduce"
    target = tensor if inplace else tensor.copy()
    with _named(kind, name, _signature(tensor), scope) as wire:
        return _reduce_into(target, resolved, wire, priority, prescale_factor,
                            postscale_factor, scope)


def allreduce(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Any = None) -> mx.nd.NDArray:
    """``tensor`` reduced over every rank, a new NDArray (``tensor`` is not modified). ``op``:
    Average (the default), Sum, Min, Max or Product; ``average`` is Horovod's deprecated
    form (True: Average, False: Sum). Integer averages are floor divisions of the sum, as
    Horovod's. ``prescale_factor`` multiplies the input, ``postscale_factor`` the result.
    Min, Max and Product are reduced by the servers, as sums are (neither averaged nor
    compressed)."""
    return _allreduce(tensor, False, average, name, priority, prescale_factor,
                      postscale_factor, process_set, op, "allreduce")


def allreduce_(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Any = None) -> mx.nd.NDArray:
    """As :func:`allreduce`, in place; returns ``tensor``."""
    return _allreduce(tensor, True, average, name, priority, prescale_factor,
                      postscale_factor, process_set, op, "allreduce_")


def _part(name: str | None, index: int) -> str | None:
    """The name of a grouped collective's ``index``-th tensor (None: automatic)."""
    return None if name is None else f"{name}.{index}"


def grouped_allreduce(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                      name: str | None = None, priority: int = 0, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                      op: Any = None) -> list[mx.nd.NDArray]:
    """:func:`allreduce` of each tensor; returns the list of results."""
    return [_allreduce(t, False, average, _part(name, i), priority, prescale_factor,
                       postscale_factor, process_set, op, "grouped_allreduce")
            for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                       name: str | None = None, priority: int = 0, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: Any = None) -> Sequence[mx.nd.NDArray]:
    """:func:`allreduce_` of each tensor; returns ``tensors``."""
    for i, t in enumerate(tensors):
        _allreduce(t, True, average, _part(name, i), priority, prescale_factor,
                   postscale_factor, process_set, op, "grouped_allreduce_")
    return tensors


# --------------------------------------------------------------------------- allgather

def allgather(tensor: mx.nd.NDArray, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Every rank's ``tensor`` concatenated along the first dimension in rank order (ranks may
    differ in that dimension only), a new NDArray. Each rank pushes its own rows and pulls
    every rank's (:func:`bpsctl.engine.collectives.gather_by_sum`)."""
    del priority
    scope = _scope(process_set, "allgather")
    _check_nd(tensor, "allgather")
    if tensor.ndim == 0:
        raise ValueError("allgather: a tensor of at least one dimension is needed; reshape a "
                         "scalar to shape (1,)")
    summed = _joinless("allgather", scope)
    with _named("allgather", name, _signature(tensor, first_dim=False), scope) as wire:
        return _new(K.gather_by_sum(tensor.asnumpy(), scope.rank, scope.size, summed, wire),
                    tensor)


def grouped_allgather(tensors: Sequence[mx.nd.NDArray], name: str | None = None,
                      priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list[mx.nd.NDArray]:
    """:func:`allgather` of each tensor; returns the list of results."""
    return [allgather(t, _part(name, i), priority, process_set) for i, t in enumerate(tensors)]


# --------------------------------------------------------------------------- broadcast

def broadcast_(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None,
               priority: int = 0,
               process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """``root_rank``'s ``tensor`` copied into ``tensor`` on every rank; returns it. Carried
    as a sum in which only the root pushes bytes (the others' pushes name the root: ranks
    that disagree all fail)."""
    del priority
    scope = _scope(process_set, "broadcast")
    _check_nd(tensor, "broadcast")
    _check_root(root_rank)
    if scope.ranks is not None and root_rank not in scope.ranks:
        raise ValueError(f"broadcast: root_rank {root_rank} is not in the process set "
                         f"{list(scope.ranks)}; root_rank is a global rank (hvd.rank()) of one "
                         "of its members")
    values = tensor.asnumpy() if rank() == root_rank else \
        np.empty(tensor.shape, np.dtype(tensor.dtype))         # not read
    with _named("broadcast", name, _signature(tensor), scope) as wire:
        got = K.from_bytes(_broadcast(K.as_bytes(values), wire, root_rank, scope),
                           values.dtype)
    return _write(tensor, got)


def broadcast(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None,
              priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """``root_rank``'s ``tensor`` on every rank, a new NDArray (``tensor`` is not
    modified)."""
    _check_nd(tensor, "broadcast")
    return broadcast_(tensor.copy(), root_rank, name, priority, process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank. ``name`` defaults to the type's name,
    as Horovod's."""
    _check_root(root_rank)
    key = f"broadcast_object.{name or type(obj).__name__}"
    me = rank() == root_rank
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if me else np.zeros(0, np.uint8)
    with _internal():
        length = int(_broadcast(np.array([data.size], np.int64), f"{key}.length",
                                root_rank)[0])
        payload = data if me else np.empty(length, np.uint8)       # not read
        got = _broadcast(payload, f"{key}.bytes{length}", root_rank)
    return obj if me else pickle.loads(got.tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj`` (pickled), as a list in rank order. ``name`` defaults to the
    type's name, as Horovod's."""
    key = f"allgather_object.{name or type(obj).__name__}"
    with _internal():
        gathered, counts = K.gather_rows(np.frombuffer(pickle.dumps(obj), np.uint8), rank(),
                                         size(), _sum, key)
    data = gathered.tobytes()
    return [pickle.loads(data[s:s + c])
            for s, c in zip(K.offsets(counts), counts, strict=True)]


# --------------------------------------------------------------------------- alltoall

def alltoall(tensor: mx.nd.NDArray, splits: Any = None, name: str | None = None,
             priority: int = 0, process_set: ProcessSet = global_process_set) -> Any:
    """``splits[d]`` rows of ``tensor`` (in order) go to rank ``d`` (equal parts without
    ``splits``); returns the rows received, in rank order, and with ``splits`` also how many
    came from each rank (an int32 NDArray), as Horovod does. Carried as a gather of every
    rank's whole tensor (:func:`bpsctl.engine.collectives.alltoall_by_sum`)."""
    del priority
    scope = _scope(process_set, "alltoall")
    _check_nd(tensor, "alltoall")
    if tensor.ndim == 0:
        raise ValueError("alltoall: a tensor of at least one dimension is needed")
    n = scope.size
    counts = K.even_splits(tensor.shape[0], n) if splits is None else \
        K.check_splits(_ints(splits), tensor.shape[0], n)
    summed = _joinless("alltoall", scope)
    with _named("alltoall", name, _signature(tensor, first_dim=False), scope) as wire:
        output, received = K.alltoall_by_sum(tensor.asnumpy(), counts, scope.rank, n, summed,
                                             wire)
    result = _new(output, tensor)
    if splits is None:
        return result
    return result, mx.nd.array(received, dtype="int32")


# --------------------------------------------------------------------------- reducescatter

def _reducescatter(tensor: Any, op: Any, name: str | None, priority: int,
                   process_set: ProcessSet | None, prescale_factor: float,
                   postscale_factor: float, what: str) -> mx.nd.NDArray:
    resolved = K.resolve_op(op, None, what)
    K.check_op(resolved, K.SERVER_OPS, what)
    scope = _scope(process_set, what)
    _check_summable(_check_nd(tensor, what), resolved, what)
    if tensor.ndim == 0:
        raise ValueError(f"{what}: a tensor of at least one dimension is needed (Horovod does "
                         "not take scalars either)")
    K.check_joined("reducescatter", _engine._w().joined_ranks)
    with _named("reducescatter", name, _signature(tensor), scope) as wire:
        whole = _reduce_into(tensor.copy(), resolved, wire, priority, prescale_factor,
                             postscale_factor, scope)
    counts = K.reducescatter_counts(tensor.shape[0], scope.size)
    start = K.offsets(counts)[scope.rank]
    return _new(whole.asnumpy()[start:start + counts[scope.rank]], tensor)


def reducescatter(tensor: mx.nd.NDArray, op: Any = Average, name: str | None = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> mx.nd.NDArray:
    """This rank's rows of ``tensor`` reduced (Average or Sum) over every rank:
    ``rows // size()`` each, one more for each of the first ``rows % size()`` ranks, as
    Horovod splits. Every rank pushes and pulls the whole tensor (as an allreduce)."""
    return _reducescatter(tensor, op, name, priority, process_set, prescale_factor,
                          postscale_factor, "reducescatter")


def grouped_reducescatter(tensors: Sequence[mx.nd.NDArray], op: Any = Average,
                          name: str | None = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[mx.nd.NDArray]:
    """:func:`reducescatter` of each tensor; returns the list of results."""
    return [_reducescatter(t, op, _part(name, i), priority, process_set, prescale_factor,
                           postscale_factor, "grouped_reducescatter")
            for i, t in enumerate(tensors)]


# --------------------------------------------------------------------------- barrier, join

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank (of ``process_set``) has called barrier() (the scheduler's
    barrier; a process set's: a one-element sum over its ranks); the engine's op timeout
    bounds the wait. Not in ``horovod.mxnet``; as ``horovod.torch``'s."""
    scope = _scope(process_set, "barrier")
    with _internal():
        if scope.ranks is None:
            _engine._w().barrier()
        else:
            _barrier(scope)


def join(device: int = -1) -> int:
    """This rank has no more data (Horovod's join, as ``horovod.torch``'s: not in
    ``horovod.mxnet``): blocks until every rank has joined and returns the rank that joined
    last, on every rank. Meanwhile the other ranks' allreduces (and DistributedTrainer's)
    count this rank as zeros (Average divides by :func:`size`, joined ranks included);
    their allgathers, broadcasts, alltoalls and reducescatters raise Horovod's errors
    (:meth:`bpsctl.engine.Worker.join` carries it). ``device`` is accepted and ignored."""
    del device
    with _internal():
        return _engine._w().join()
