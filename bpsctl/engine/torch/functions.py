"""Broadcasts (Horovod's ``horovod.torch.functions``): parameters, optimizer state and
picklable objects from one rank to all, and the state a live worker hands a rejoining one."""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ... import engine as _engine
from ..common import EngineError, JobFinished
from .ops import _start_direct, synchronize
from .plugin import _p, _Plugin, rank, size
from .process_sets import _scope

#: broadcast_object calls on each process set (its prefix), counted apart from the global ones:
#: ranks outside a set do not make them
_set_objects: dict[tuple[int, str], int] = {}


def _broadcast_tensors(named: list[tuple[str, torch.Tensor]], root_rank: int, prefix: str,
                       ranks: tuple[int, ...] | None = None) -> None:
    """Broadcast by summation in which only the root pushes bytes: every other rank's pushes
    are headers naming the root it was given (Worker.push_pull_async's ``root``; ranks that
    disagree all fail), straight to the servers (past the intra-node stage, whose local sums
    would not know whose bytes are whose), pushed once (no shared-memory slot kept); over a
    process set's ``ranks`` where given."""
    handles, copies = [], []
    for name, tensor in named:
        wire = tensor.detach()
        if not wire.is_contiguous():
            wire = wire.contiguous()        # (read on the root only)
            copies.append((tensor, wire))
        handles.append(_start_direct(wire, wire, f"{prefix}.{name}", 0, root=root_rank,
                                     once=True, ranks=ranks))
    for handle in handles:
        synchronize(handle)
    with torch.no_grad():
        for tensor, wire in copies:
            tensor.copy_(wire)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy ``params`` (a ``state_dict()`` or ``named_parameters()``) from ``root_rank`` to all.
    In a rejoining worker: copy them from the state a live worker hands it instead."""
    if isinstance(params, dict):
        named = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        named = list(params)
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: expected a dict "
                         "(state_dict) or (name, tensor) pairs (named_parameters)")
    tensors = []
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"parameter {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.dtype == torch.bool:
            raise TypeError(f"parameter {name!r}: bool tensors cannot be broadcast; "
                            "use broadcast_object")
        tensors.append((name, tensor))
    _check_root(root_rank)
    plugin = _p()
    plugin.shared.update(tensors)
    received = _received_state(plugin)
    if received is None:
        _broadcast_tensors(tensors, root_rank, "Parameter")
        return
    missing = [name for name, _ in tensors if name not in received["params"]]
    if missing:
        raise EngineError(f"rejoining: the live worker's model has no {missing[:3]} (workers run "
                          "different scripts?)")
    with torch.no_grad():
        for name, tensor in tensors:
            tensor.copy_(received["params"][name])


def _received_state(plugin: _Plugin) -> dict[str, Any] | None:
    """A rejoining worker's state from a live worker (waiting for it once), else None."""
    if plugin.received is None and plugin.worker.joined_running:   # restarted, or attached
        try:
            payload = plugin.worker.receive_state()
        except JobFinished as finished:
            _engine.nothing_to_do(finished)
        plugin.received = torch.load(io.BytesIO(payload), weights_only=False)
        plugin.steps = plugin.received["steps"]
        # the next broadcast_object pushes under the name the live workers' next one does
        plugin.objects = plugin.received["objects"]
        plugin.unloaded = set(range(len(plugin.received["optimizers"])))
    return plugin.received


def _pack_state(plugin: _Plugin, elastic: Any = None) -> memoryview:
    """What a rejoining worker starts from (see :mod:`bpsctl.engine.torch`, "Rejoining")."""
    buffer = io.BytesIO()
    torch.save({"steps": plugin.steps, "objects": plugin.objects, "params": plugin.shared,
                "optimizers": [opt.state_dict() for opt in plugin.optimizers],
                "elastic": elastic}, buffer)
    return buffer.getbuffer()           # sent without another copy


def _donate(plugin: _Plugin, elastic: Any = None) -> None:
    """At a step boundary: hand the state to every worker waiting to rejoin."""
    worker = plugin.worker
    if worker.pending_joins:
        state = _pack_state(plugin, elastic)
        for rank_, incarnation in list(worker.pending_joins):
            worker.donate(rank_, incarnation, state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Return ``obj`` from ``root_rank`` on every rank (pickled; all ranks must call it), or on
    every rank of ``process_set`` (Horovod's; ``root_rank`` a global rank in it)."""
    scope = _scope(process_set, "broadcast_object")
    _check_root(root_rank)
    plugin = _p()
    if scope.ranks is None:
        key = f"broadcast_object.{name or 'object'}.{plugin.objects}"
        plugin.objects += 1
    else:
        if root_rank not in scope.ranks:
            raise ValueError(f"broadcast_object: root_rank {root_rank} is not in the process "
                             f"set {list(scope.ranks)}")
        count = _set_objects.get((id(plugin), scope.prefix), 0)
        _set_objects[(id(plugin), scope.prefix)] = count + 1
        key = f"{scope.prefix}broadcast_object.{name or 'object'}.{count}"
    me = rank() == root_rank
    data = pickle.dumps(obj) if me else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    _broadcast_tensors([("length", length)], root_rank, key, scope.ranks)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8)
    if me:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    _broadcast_tensors([("data", payload)], root_rank, key, scope.ranks)
    return obj if me else pickle.loads(payload.numpy().tobytes())


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Copy ``optimizer``'s state (and hyper-parameters) from ``root_rank`` to all ranks. In a
    rejoining worker nothing happens here: a DistributedOptimizer's first ``step()`` loads the
    state the live worker handed over. ``model`` (Horovod's, to find sparse parameters) is
    not needed: the whole state travels pickled."""
    del model
    if _received_state(_p()) is not None:
        return
    buffer = io.BytesIO()
    if rank() == root_rank:
        torch.save(optimizer.state_dict(), buffer)
    state = broadcast_object(buffer.getvalue(), root_rank, name="optimizer_state")
    if rank() != root_rank:
        optimizer.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job (0..{size() - 1})")
