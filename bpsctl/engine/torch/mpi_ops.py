"""Horovod's collectives (``horovod.torch.mpi_ops``) on bpsctl's engine.

Every collective is one or two push_pulls through the plugin's own path (:func:`_start`: the
servers, or the intra-node stage when workers share a host), built as
:mod:`bpsctl.engine.collectives` describes: Sum and Average are summed by the servers, and
Min, Max and Product reduced by them elementwise (every rank pushing its own tensor, past the
intra-node stage); allgather, broadcast and alltoall gather through summation (each rank's
rows at its offset in a zeroed buffer), each rank pushing only its own bytes (a broadcast:
the root's; the others push headers naming the root, which the servers check agree), past
the intra-node stage too, whose local sums would not know whose bytes are whose;
reducescatter sums the whole tensor and keeps this rank's rows. Handles are integers for
:func:`poll` and :func:`synchronize`, as push_pull's.

Rules Horovod has too: every rank calls the same collectives in the same order, with the
same names (a name left out is made the same way on every rank:
:class:`~bpsctl.engine.collectives.AutoNames`), and the same shapes where Horovod needs
them. The ``*_async`` forms of allgather and alltoall wait for the exchange of row counts
(one small push_pull) before returning; the data travels in the background. A failed
collective raises :class:`HorovodInternalError` at :func:`synchronize`.

Process sets (``process_set=``): a collective on one runs among its ranks only, under
engine names of its own, with ranks and sizes within the set
(:mod:`bpsctl.engine.process_sets`). Not carried: Adasum (ValueError naming
``op=hvd.Average``). :func:`join` is Horovod's for the global set. Horovod's other names of
this module are in :mod:`.basics` (feature queries, host layout, timelines) and
:mod:`.process_sets`, and re-exported here as in Horovod.
"""
from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import collectives as K
from .. import protocol as P
from ..collectives import HorovodInternalError, ReduceOp
from ..common import EngineError
from ..trace import now_ns
from . import basics, process_sets

# Horovod's mpi_ops has these names too
from .basics import (  # noqa: F401
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from .compression import Compression, CompressionArg
from .functions import _check_root
from .ops import _start, _start_direct, _start_reduced, _track_composite, synchronize
from .plugin import _p, _wire_dtype, rank, size
from .process_sets import (  # noqa: F401
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

Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product

__all__: list[str] = [
    *basics.__all__, *process_sets.__all__,
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "allgather_object", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join"]


# --------------------------------------------------------------------------- common pieces

Release = K.Release


#: names for collectives called without one (see :class:`~bpsctl.engine.collectives.AutoNames`)
_auto_names = K.AutoNames()


def _keep() -> None:
    """A user's name is not given back: it is the user's."""


def _signature(tensor: torch.Tensor, first_dim: bool = True) -> str:
    """The dtype and shape (without the first dimension unless ``first_dim``) in a name."""
    dims = tensor.shape if first_dim else tensor.shape[1:]
    return f"{str(tensor.dtype).replace('torch.', '')}:{'x'.join(map(str, dims))}"


def _name(kind: str, name: str | None, signature: str,
          scope: Scope | None = None) -> tuple[str, Release]:
    """The engine name of a collective of ``kind`` (``<kind>.<name>``, or one of
    :class:`~bpsctl.engine.collectives.AutoNames` for the ``signature`` when ``name`` is
    None) and what to call when it is synchronized. The engine binds a name to the dtype and
    shape of its first push_pull: a named allreduce, broadcast or reducescatter keeps its
    shape (another one is refused, naming it), while gathered buffers, whose rows change
    from call to call, are named by their row count (:func:`_rows`). A process set's names
    start with its prefix (``ps<id>/``), automatic ones counted apart from the others'
    (ranks outside the set do not make them)."""
    prefix = "" if scope is None else scope.prefix
    if name is None:
        return _auto_names.take(f"{prefix}{kind}.noname.{signature}")
    return f"{prefix}{kind}.{name}", _keep


def _rows(name: str, buffer: torch.Tensor) -> str:
    """The engine name of a gathered ``buffer``: ``name`` and its row count, the same on every
    rank (the counts were exchanged), since a gather under one name may come back with other
    counts (a last, smaller batch). Other dimensions stay out of it: ranks that disagree on
    them get the engine's error naming the tensor, rather than waiting on different names."""
    return f"{name}.rows{buffer.shape[0]}"


def _check_tensor(tensor: Any, what: str, bool_ok: bool = True) -> torch.Tensor:
    """``tensor`` if the engine can carry it (TypeError naming what is wrong otherwise); bool
    tensors travel as uint8 where ``bool_ok`` (the ops that only move bytes)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not carried; use sparse_allreduce_async, "
                        "or tensor.to_dense()")
    if tensor.dtype == torch.bool:
        if bool_ok:
            return tensor
        raise TypeError(f"{what}: a bool tensor cannot be summed or averaged; use "
                        "op=hvd.Max (any) or op=hvd.Min (all), or cast it to torch.uint8")
    try:
        P.dtype_code(_wire_dtype(tensor.dtype))
    except (TypeError, RuntimeError):
        raise TypeError(f"{what}: dtype {tensor.dtype} is not carried; use one of uint8, "
                        "int8, int16, int32, int64, float16, bfloat16, float32, float64 (or "
                        "bool where only bytes move)") from None
    return tensor


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A bool tensor's bytes as uint8 (the wire has no bool); other tensors as they are."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` in its own dtype (integers: scaled in float64, truncated)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point:
        return tensor * factor
    return (tensor.double() * factor).to(tensor.dtype)


def _push_sum(tensor: torch.Tensor, name: str, scope: Scope | None = None,
              join_error: str | None = None) -> int:
    """Start the push_pull (a sum) of ``tensor``, a private buffer: the result lands in it
    (over the ranks of ``scope``, a process set, where given; ``join_error``: it fails once a
    rank has joined, see :func:`_check_joined`)."""
    return _start(tensor, False, name, 0, Compression.none, inplace=True,
                  ranks=None if scope is None else scope.ranks, join_error=join_error)


def _push_own(buffer: torch.Tensor, name: str, start: int, count: int,
              scope: Scope | None = None, join_error: str | None = None,
              read: Sequence[tuple[int, int]] | None = None,
              kept: tuple[int, int] | None = None) -> int:
    """Start the sum of a gathered ``buffer`` (contiguous, private: the result lands in it)
    whose rows ``start .. start + count`` are this rank's and the rest zeros: straight to the
    servers, the partitions without this rank's rows pushed as headers alone
    (Worker.push_pull_async's ``mine``); over the ranks of ``scope`` where given. ``read``:
    the (start, count) row spans this rank reads of the result (an alltoall's); the others'
    partitions come back as a header alone (Worker.push_pull_async's ``want``). ``kept``:
    a (start, count) span of this rank's rows that only it reads (an alltoall's rows to
    itself): not pushed where whole partitions of it can stay home."""
    per_row = buffer.element_size() * (buffer[0].numel() if buffer.shape[0] else 0)
    wire = _as_bytes(buffer)
    own = [(start, start + count)]
    if kept is not None:
        own = [(start, kept[0]), (kept[0] + kept[1], start + count)]
    mine = [(a * per_row, b * per_row) for a, b in own if a < b] or [(0, 0)]
    want = None if read is None else [(s * per_row, (s + c) * per_row) for s, c in read]
    return _start_direct(wire, wire, name, 0, mine=mine,
                         ranks=None if scope is None else scope.ranks, join_error=join_error,
                         want=want)


def _exchange_ints(mine: np.ndarray, name: str, scope: Scope | None = None,
                   join_error: str | None = None) -> np.ndarray:
    """Every rank's ``mine`` (a small int64 vector, the same length on every rank), as a
    ``size() x len(mine)`` array (the set's ranks in set order, for ``scope``): one
    push_pull, waited for here."""
    n, me = (size(), rank()) if scope is None else (scope.size, scope.rank)
    table = torch.zeros((n, len(mine)), dtype=torch.int64)
    table[me] = torch.from_numpy(np.asarray(mine, np.int64))
    synchronize(_push_sum(table, f"{name}.counts", scope, join_error))
    return table.numpy()


def _check_joined(kind: str) -> str:
    """:func:`bpsctl.engine.collectives.check_joined` for this worker: Horovod's error for a
    ``kind`` collective, raised if a rank has joined, else returned for its push_pulls."""
    return K.check_joined(kind, _p().worker.joined_ranks)


@contextlib.contextmanager
def _released_on_error(release: Release) -> Iterator[None]:
    """Give an automatic name back if the collective fails to start (bad input, the engine
    gone), so that this rank's next collective of its kind takes the same name as the
    others'."""
    try:
        yield
    except BaseException:
        release()
        raise


def _then(name: str, handles: list[int], finish: Callable[[list[Any]], Any],
          release: Release = _keep) -> int:
    """A handle whose :func:`synchronize` returns ``finish(results of handles)`` and then gives
    the collective's automatic name back (``release``); the collective ``name`` is a
    ``collective`` span of the worker's trace, from now to then."""
    started_ns = now_ns()

    def finish_traced(results: list[Any]) -> Any:
        try:
            result = finish(results)
        finally:
            release()
        _p().worker.trace_span("collective", name, started_ns, now_ns())
        return result
    return _track_composite(handles, finish_traced)


# --------------------------------------------------------------------------- allreduce

def _allreduce_start(tensor: torch.Tensor, output: torch.Tensor | None, name: str | None,
                     op: ReduceOp, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet | None,
                     compression: CompressionArg = Compression.none,
                     kind: str = "allreduce", join_error: str | None = None) -> int:
    """Start an allreduce of ``tensor``; the result lands in ``output`` (in-place forms) or a
    new tensor (``join_error``: a reducescatter's, see :func:`_check_joined`)."""
    scope = _scope(process_set, kind)
    _check_tensor(tensor, kind, bool_ok=op in K.SERVER_REDUCTIONS)
    by_op = op in K.SERVER_REDUCTIONS     # a name bound to its op: a name of its own
    wire_name, release = _name(f"{kind}.{op.name}" if by_op else kind, name,
                               _signature(tensor), scope)
    detached = tensor.detach()
    source = _scaled(detached, prescale_factor)
    if op in K.SERVER_OPS:
        floating = tensor.dtype.is_floating_point
        private = source is not detached        # a scaled copy: the result may land in it
        inplace = output is not None and not private
        with _released_on_error(release):
            handle = _start(tensor if inplace else source, op is Average and floating,
                            wire_name, 0, compression, inplace=inplace or private,
                            ranks=scope.ranks, join_error=join_error)
        divide = op is Average and not floating

        def finish(results: list[torch.Tensor]) -> torch.Tensor:
            result = results[0]
            if divide:              # integers: Horovod's floor division of the sum
                result = torch.div(result, scope.size, rounding_mode="floor")
            result = _scaled(result, postscale_factor)
            if output is None:
                return result
            if result is not output:
                output.detach().copy_(result)
            return output
        return _then(wire_name, [handle], finish, release)
    # Min, Max, Product: reduced by the servers, elementwise, each rank pushing its own
    # tensor; bool as its bytes (0 or 1: min is all, max any, product all); the casts of
    # Compression apply (the engine's compressors sum)
    cast = compression if isinstance(compression, type) else Compression.none
    wire, ctx = cast.compress(source)
    wire = _as_bytes(wire.contiguous())
    reduced = torch.empty_like(wire)
    with _released_on_error(release):
        handle = _start_reduced(wire, reduced, wire_name, 0, K.SERVER_REDUCTIONS[op],
                                ranks=scope.ranks)

    def finish_reduced(_: list[torch.Tensor]) -> torch.Tensor:
        values = reduced.view(torch.bool) if source.dtype == torch.bool else reduced
        result = _scaled(cast.decompress(values, ctx), postscale_factor)
        if output is None:
            return result
        output.detach().copy_(result)
        return output
    return _then(wire_name, [handle], finish_reduced, release)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` across ranks (``op``: Average by default, Sum, Min, Max,
    Product); :func:`synchronize` returns a new tensor. Sum and Average are summed by the
    servers, Min, Max and Product reduced by them elementwise (bool: Min is all, Max any).
    Integer averages are floor divisions of the sum, as
    Horovod's. ``prescale_factor`` multiplies the input, ``postscale_factor`` the result."""
    return _allreduce_start(tensor, None, name, K.resolve_op(op, average), prescale_factor,
                            postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None,
                     name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """As :func:`allreduce_async`, the result written into ``tensor``."""
    return _allreduce_start(tensor, tensor, name, K.resolve_op(op, average), prescale_factor,
                            postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """As :func:`allreduce`, in place; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """allreduce as autograd sees it: the gradient is the allreduce of the output's gradient
    with the same op and scales (Horovod's definition)."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set,
                compression):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(_allreduce_start(tensor, None, name, op, prescale_factor,
                                            postscale_factor, process_set, compression))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, process_set = ctx.args
        grad = synchronize(_allreduce_start(grad_output.contiguous(), None, None, op, pre, post,
                                            process_set))
        return grad, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: CompressionArg = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (see :func:`allreduce_async`); a new tensor, through
    which gradients flow (Horovod's: the allreduce of the gradient). ``compression``: as
    push_pull's (Sum and Average; Min, Max and Product take the casts only)."""
    return _Allreduce.apply(tensor, name, K.resolve_op(op, average), prescale_factor,
                            postscale_factor, process_set, compression)


def _grouped(kind: str, tensors: Sequence[torch.Tensor], name: str | None,
             start: Callable[[torch.Tensor, str | None], int]) -> int:
    """One handle for a list of collectives (``start(tensor, member name)`` each); its
    :func:`synchronize` returns the list of results. Members are named ``<name>.<i>`` (each
    its own automatic name without ``name``)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{kind}: the list of tensors is empty")
    handles = [start(t, None if name is None else f"{name}.{i}") for i, t in enumerate(tensors)]
    return _then(name or kind, handles, list)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`allreduce_async` of each tensor; :func:`synchronize` returns the list."""
    resolved = K.resolve_op(op, average, "grouped_allreduce")
    return _grouped("grouped_allreduce", tensors, name, lambda t, n: _allreduce_start(
        t, None, n, resolved, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """:func:`allreduce_async_` of each tensor (in place); :func:`synchronize` returns the
    list."""
    resolved = K.resolve_op(op, average, "grouped_allreduce")
    return _grouped("grouped_allreduce", tensors, name, lambda t, n: _allreduce_start(
        t, t, n, resolved, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce_` of each tensor; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, compression,
                *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(_grouped("grouped_allreduce", tensors, name, lambda t, n:
                                          _allreduce_start(t, None, n, op, prescale_factor,
                                                           postscale_factor, process_set,
                                                           compression))))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        reduced = synchronize(_grouped("grouped_allreduce", [g.contiguous() for g in grads],
                                       None, lambda t, n: _allreduce_start(
                                           t, None, n, op, pre, post, process_set)))
        return (None,) * 6 + tuple(reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: CompressionArg = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce` of each tensor; returns the list (differentiable)."""
    return list(_GroupedAllreduce.apply(name, K.resolve_op(op, average, "grouped_allreduce"),
                                        prescale_factor, postscale_factor, process_set,
                                        compression, *tensors))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: ProcessSet = global_process_set) -> Callable[[], Any]:
    """Horovod's allreduce of a sparse tensor: its indices and values are allgathered (the
    sum is the coalesced result); returns a function that waits and returns it."""
    resolved = K.resolve_op(op, None, "sparse_allreduce_async")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), f"{name}.indices",
                              process_set)
    values = allgather_async(t._values(), f"{name}.values", process_set)

    def wait() -> torch.Tensor:
        v, i = synchronize(values), synchronize(indices)
        if resolved is Average:
            v = v / _scope(process_set, "sparse_allreduce_async").size
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size())
    return wait


# --------------------------------------------------------------------------- allgather

def _allgather_start(tensors: Sequence[torch.Tensor], name: str | None, kind: str,
                     process_set: ProcessSet | None
                     ) -> tuple[list[int], list[list[int]], str, Release]:
    """Start gathering each of ``tensors`` along its first dimension: one exchange of row
    counts (waited for) for all of them, then a push_pull of each gathered buffer, pushing
    this rank's rows and pulling the others'. Returns
    the handles (each gives its buffer), every tensor's counts per rank, the base name and
    what gives it back (for :func:`_then`)."""
    scope = _scope(process_set, kind)
    for t in tensors:
        _check_tensor(t, kind)
        if t.dim() == 0:
            raise ValueError(f"{kind}: a tensor of at least one dimension is needed; reshape "
                             "a scalar with tensor.reshape(1)")
    join_error = _check_joined("allgather")
    base, release = _name(kind, name, ";".join(_signature(t, first_dim=False) for t in tensors),
                          scope)
    with _released_on_error(release):
        table = _exchange_ints(np.array([t.shape[0] for t in tensors], np.int64), base, scope,
                               join_error)
        me = scope.rank
        handles, all_counts = [], []
        for i, t in enumerate(tensors):
            counts = [int(c) for c in table[:, i]]
            buffer = torch.zeros((sum(counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
            starts = K.offsets(counts)
            start = starts[me]
            buffer[start:start + counts[me]] = t.detach()
            member = f"{base}.{i}" if len(tensors) > 1 else base
            # this rank's own rows are in the buffer already: partitions holding only those
            # come back as a header alone, so a rank pulls about the others' rows
            others = [(starts[s], counts[s]) for s in range(len(counts)) if s != me]
            handles.append(_push_own(buffer, _rows(member, buffer), start, counts[me], scope,
                                     join_error, read=others))
            all_counts.append(counts)
    return handles, all_counts, base, release


def _as_dtype(result: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return result.view(torch.bool) if dtype == torch.bool else result


def _allgather(tensors: Sequence[torch.Tensor], name: str | None, kind: str,
               process_set: ProcessSet | None, one: bool) -> tuple[int, list[list[int]]]:
    """A handle gathering each of ``tensors`` (:func:`_allgather_start`) whose
    :func:`synchronize` gives the list of results (the result alone with ``one``), and every
    tensor's counts per rank."""
    tensors = list(tensors)
    handles, counts, base, release = _allgather_start(tensors, name, kind, process_set)

    def results(gathered: list[torch.Tensor]) -> Any:
        typed = [_as_dtype(r, t.dtype) for r, t in zip(gathered, tensors, strict=True)]
        return typed[0] if one else typed
    return _then(base, handles, results, release), counts


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension (which may
    differ between ranks; the others must match), in rank order; :func:`synchronize` returns
    it. Gathered through summation: one push_pull of the row counts (waited for here), then
    one of the whole result, each rank's rows at its offset and zeros elsewhere (every rank
    pushes its own rows and pulls the whole result)."""
    return _allgather([tensor], name, "allgather", process_set, one=True)[0]


class _Allgather(torch.autograd.Function):
    """Horovod's gradient: the average across ranks of the output's gradient, this rank's
    rows of it."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        handle, counts = _allgather([tensor], name, "allgather", process_set, one=True)
        ctx.process_set, ctx.counts = process_set, counts[0]
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        me = _scope(ctx.process_set, "allgather").rank
        return grad.narrow(0, K.offsets(ctx.counts)[me], ctx.counts[me]), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (see
    :func:`allgather_async`); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`allgather_async` of each tensor, with one exchange of row counts for all;
    :func:`synchronize` returns the list."""
    return _allgather(tensors, name, "grouped_allgather", process_set, one=False)[0]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        handle, counts = _allgather(tensors, name, "grouped_allgather", process_set, one=False)
        ctx.process_set, ctx.counts = process_set, counts
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                    process_set=ctx.process_set)
        me = _scope(ctx.process_set, "grouped_allgather").rank
        return (None, None, *[g.narrow(0, K.offsets(c)[me], c[me])
                              for g, c in zip(reduced, ctx.counts, strict=True)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor; returns the list (differentiable)."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    handle, counts = _allgather([data], name, "allgather_object", None, one=True)
    gathered = synchronize(handle).numpy().tobytes()
    starts = K.offsets(counts[0])
    return [pickle.loads(gathered[s:s + c]) for s, c in zip(starts, counts[0], strict=True)]


# --------------------------------------------------------------------------- broadcast

def _check_set_root(root_rank: int, scope: Scope, what: str) -> None:
    """ValueError for a process set's broadcast whose root (a global rank, as Horovod's)
    is not in the set."""
    if scope.ranks is not None and root_rank not in scope.ranks:
        raise ValueError(f"{what}: root_rank {root_rank} is not in the process set "
                         f"{list(scope.ranks)}; root_rank is a global rank (hvd.rank()) of one "
                         "of its members")


def _broadcast_start(tensor: torch.Tensor, output: torch.Tensor | None, root_rank: int,
                     name: str | None, process_set: ProcessSet | None) -> int:
    """Start copying the root's ``tensor`` to every rank, into ``output`` (in place) or a new
    tensor: a sum in which only the root pushes bytes, the others' pushes headers naming the
    root they were given (Worker.push_pull_async's ``root``: ranks that disagree all fail),
    straight to the servers."""
    scope = _scope(process_set, "broadcast")
    _check_tensor(tensor, "broadcast")
    _check_root(root_rank)
    _check_set_root(root_rank, scope, "broadcast")
    join_error = _check_joined("broadcast")
    wire_name, release = _name("broadcast", name, _signature(tensor), scope)
    buffer = (output if output is not None else tensor).detach()
    if output is None or not buffer.is_contiguous():
        buffer = torch.empty_like(buffer, memory_format=torch.contiguous_format)
    if rank() == root_rank and buffer.data_ptr() != tensor.data_ptr():
        buffer.copy_(tensor.detach())               # (elsewhere it is not read)
    with _released_on_error(release):
        wire = _as_bytes(buffer)
        handle = _start_direct(wire, wire, wire_name, 0, root=root_rank, ranks=scope.ranks,
                               join_error=join_error)

    def finish(_: list[Any]) -> torch.Tensor:
        if output is None:
            return buffer
        if buffer.data_ptr() != output.data_ptr():
            output.detach().copy_(buffer)           # a non-contiguous output
        return output
    return _then(wire_name, [handle], finish, release)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying ``root_rank``'s ``tensor`` to every rank; :func:`synchronize` returns a
    new tensor. Only the root pushes the tensor's bytes; every other rank pushes a header
    per partition naming the root it was given (ranks that disagree all fail, naming the
    roots)."""
    return _broadcast_start(tensor, None, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """As :func:`broadcast_async`, into ``tensor`` itself."""
    return _broadcast_start(tensor, tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` copied into ``tensor`` on every rank; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Horovod's gradient: the average of the output's gradient on the root, zeros
    elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(_broadcast_start(tensor, None, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, a new tensor (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# --------------------------------------------------------------------------- alltoall

def _alltoall_start(tensor: torch.Tensor, splits: Any, name: str | None,
                    process_set: ProcessSet | None) -> int:
    """Start an alltoall as an allgather of every rank's whole tensor (the splits of every
    rank exchanged first), from which each rank keeps the rows sent to it: only the
    partitions holding those come back with their bytes (the others as a header alone), so
    a rank pulls about what it receives; its :func:`synchronize` gives ``(output,
    received_splits)``."""
    scope = _scope(process_set, "alltoall")
    _check_tensor(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall: a tensor of at least one dimension is needed")
    n, me = scope.size, scope.rank
    rows = tensor.shape[0]
    if splits is None:
        counts = K.even_splits(rows, n)
    else:
        values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
        counts = K.check_splits(values, rows, n)
    join_error = _check_joined("alltoall")
    base, release = _name("alltoall", name, _signature(tensor, first_dim=False), scope)
    with _released_on_error(release):
        matrix = _exchange_ints(np.array(counts, np.int64), base, scope, join_error)
        spans, received = K.alltoall_plan(matrix, me)
        senders = [int(row.sum()) for row in matrix]
        buffer = torch.zeros((sum(senders), *tensor.shape[1:]), dtype=tensor.dtype,
                             device=tensor.device)
        start = K.offsets(senders)[me]
        buffer[start:start + rows] = tensor.detach()
        # the rows this rank sends itself stay where they are in the buffer: partitions
        # holding only those go as zeros and come back as a header alone
        handle = _push_own(buffer, _rows(base, buffer), start, rows, scope, join_error,
                           read=[span for s, span in enumerate(spans) if s != me],
                           kept=spans[me])
    splits_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def pick(_: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        output = torch.cat([buffer[s:s + c] for s, c in spans])
        return output, torch.tensor(received, dtype=splits_dtype)
    return _then(base, [handle], pick, release)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall: ``splits[d]`` rows of ``tensor`` (in order) go to rank ``d`` (equal
    parts without ``splits``); :func:`synchronize` returns ``(output, received_splits)``, the
    rows received in rank order and how many came from each rank. Carried as an allgather of
    every rank's whole tensor (each rank pushes its own tensor and pulls the partitions that
    hold the rows sent to it)."""
    return _alltoall_start(tensor, splits, name, process_set)


class _Alltoall(torch.autograd.Function):
    """Horovod's gradient: the alltoall back of the output's gradient, with the received
    splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(_alltoall_start(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_):
        grad, _ = synchronize(_alltoall_start(grad_output.contiguous(), ctx.received, None,
                                              ctx.process_set))
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """An alltoall (see :func:`alltoall_async`), differentiable: the output alone without
    ``splits``, ``(output, received_splits)`` with them, as Horovod returns."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# --------------------------------------------------------------------------- reducescatter

def _reducescatter_start(tensor: torch.Tensor, name: str | None, op: ReduceOp,
                         process_set: ProcessSet | None, prescale_factor: float,
                         postscale_factor: float,
                         compression: CompressionArg = Compression.none) -> int:
    """Start a reducescatter: the whole tensor summed (averaged) by the servers, this rank
    keeping its rows of it (Horovod's split: :func:`bpsctl.engine.collectives.
    reducescatter_counts`)."""
    K.check_op(op, K.SERVER_OPS, "reducescatter")
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
        raise ValueError("reducescatter: a tensor of at least one dimension is needed")
    join_error = _check_joined("reducescatter")
    handle = _allreduce_start(tensor, None, name, op, prescale_factor, postscale_factor,
                              process_set, compression, kind="reducescatter",
                              join_error=join_error)
    scope = _scope(process_set, "reducescatter")
    counts = K.reducescatter_counts(tensor.shape[0], scope.size)
    start, count = K.offsets(counts)[scope.rank], counts[scope.rank]
    return _then(f"reducescatter.{name or 'noname'}", [handle],
                 lambda results: results[0].narrow(0, start, count).clone())


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` (Sum or Average) and keeping this rank's rows of the result:
    ``rows // size()`` each, one more for each of the first ``rows % size()`` ranks, as
    Horovod splits. Every rank pushes and pulls the whole tensor (as an allreduce)."""
    return _reducescatter_start(tensor, name, K.resolve_op(op, None, "reducescatter"),
                                process_set, prescale_factor, postscale_factor)


def _reducescatter_grad(grad: torch.Tensor, op: ReduceOp, size_: int, pre: float,
                        post: float) -> torch.Tensor:
    """What Horovod allgathers as a reducescatter's input gradient, before the gather."""
    if op is Sum:
        grad = grad * size_
    return _scaled(_scaled(grad, pre), post)


class _Reducescatter(torch.autograd.Function):
    """Horovod's gradient: the allgather of the output's gradient (times ``size()`` for Sum,
    times the scale factors)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor,
                compression):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(_reducescatter_start(tensor, name, op, process_set, prescale_factor,
                                                postscale_factor, compression))

    @staticmethod
    def backward(ctx, grad_output):
        op, process_set, pre, post = ctx.args
        grad = _reducescatter_grad(grad_output.contiguous(), op,
                                   _scope(process_set, "reducescatter").size, pre, post)
        return allgather(grad, process_set=process_set), None, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: CompressionArg = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the reduction of ``tensor`` (see :func:`reducescatter_async`);
    differentiable."""
    return _Reducescatter.apply(tensor, name, K.resolve_op(op, None, "reducescatter"),
                                process_set, prescale_factor, postscale_factor, compression)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """:func:`reducescatter_async` of each tensor; :func:`synchronize` returns the list."""
    resolved = K.resolve_op(op, None, "grouped_reducescatter")
    return _grouped("grouped_reducescatter", tensors, name, lambda t, n: _reducescatter_start(
        t, n, resolved, process_set, prescale_factor, postscale_factor))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, compression,
                *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(_grouped(
            "grouped_reducescatter", tensors, name, lambda t, n: _reducescatter_start(
                t, n, op, process_set, prescale_factor, postscale_factor, compression))))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        n = _scope(process_set, "grouped_reducescatter").size
        scaled = [_reducescatter_grad(g.contiguous(), op, n, pre, post) for g in grads]
        return (None,) * 6 + tuple(grouped_allgather(scaled, process_set=process_set))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: CompressionArg = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor; returns the list (differentiable)."""
    return list(_GroupedReducescatter.apply(
        name, K.resolve_op(op, None, "grouped_reducescatter"), process_set, prescale_factor,
        postscale_factor, compression, *tensors))


# --------------------------------------------------------------------------- optimizer
# --------------------------------------------------------------------------- barrier, join

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank (of ``process_set``) has called barrier() (the scheduler's
    barrier; a process set's: a one-element sum over its ranks); the engine's op timeout
    bounds the wait."""
    scope = _scope(process_set, "barrier")
    try:
        if scope.ranks is None:
            _p().worker.barrier()
        else:
            _barrier(scope)
    except EngineError as exc:
        raise HorovodInternalError(str(exc)) from exc


def join(device: int = -1) -> int:
    """This rank has no more data (Horovod's join): blocks until every rank has joined and
    returns the rank that joined last, on every rank. Meanwhile the other ranks go on with
    allreduces (and DistributedOptimizer's), to which this rank adds zeros: Sum and Average
    over every rank (Average divides by :func:`size`, joined ranks included, as Horovod's),
    Min, Max and Product with a zero folded in; their allgathers, broadcasts, alltoalls and
    reducescatters raise Horovod's errors. Afterwards training goes on as before.

    Carried by the servers (:meth:`bpsctl.engine.Worker.join`): ranks sharing a host through
    the intra-node stage may all join, but a collective of the stage while one of them has
    joined raises HorovodInternalError saying to set ``BPSCTL_LOCAL_REDUCE=off``. Refused
    under bounded staleness, asynchronous training and backup workers. ``device`` is
    accepted and ignored (no zero tensors are made)."""
    del device
    plugin = _p()
    if plugin.config.staleness > 0:
        raise HorovodInternalError(
            f"join(): bounded staleness (BPSCTL_STALENESS={plugin.config.staleness}) keeps "
            "steps of this rank in flight that the others would apply after it joined; train "
            "without it, or give every rank the same number of batches")
    try:
        return plugin.worker.join()
    except HorovodInternalError:
        raise
    except EngineError as exc:
        raise HorovodInternalError(str(exc)) from exc
