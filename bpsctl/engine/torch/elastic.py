"""Horovod's elastic API (``horovod.torch.elastic``) on the parameter server.

A script written for Horovod Elastic runs with its import changed::

    import bpsctl.engine.torch as hvd          # was: import horovod.torch as hvd

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...; optimizer.step()
                state.commit()
            state.batch = 0

    train(state)

What differs underneath, and why it is cheaper than Horovod's: a lost worker or server does
not interrupt anyone (the engine goes on without the worker, or moves the server's
partitions), so nothing is rolled back. Membership changes still reach the script the
Horovod way, so it can re-shard its data or rescale its learning rate: at a ``commit()`` all
workers agree (one 4-byte sum) whether any of them saw the membership change since the last
one, and if so every one raises :class:`HostsUpdatedInterrupt` at that same commit; ``run``
then calls the reset callbacks and ``train(state)`` again, which resumes from the state's
counters. A restarted worker (``bpsctl run --max-restarts``) starts ``train`` with
``state.sync()``, which receives the model, optimizer state and counters a live worker hands
over at its next ``commit()``. The first ``sync()`` of a fresh job broadcasts from rank 0,
as Horovod's does. Live workers stay equal bit for bit without any later broadcast: they all
apply the same averaged gradients.

Not provided: Horovod's ``ElasticSampler`` and host discovery scripts (the run loop restarts
workers; ``bpsctl run --max-restarts``). Engine errors are not retried here: the losses the
engine can survive never reach the script.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import common
from .functions import (
    _donate,
    _received_state,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .ops import push_pull
from .plugin import _p

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class HostsUpdatedInterrupt(RuntimeError):
    """The job's membership changed: ``run`` resets and calls the training function again.
    ``skip_sync``: no state needs to travel (live workers are equal already)."""

    def __init__(self, skip_sync: bool = True):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync


class State:
    """What survives a membership change: ``commit()`` at consistent points, ``sync()`` at
    the start of the training function (see the module docstring)."""

    def __init__(self) -> None:
        plugin = _p()
        self._reset_callbacks: list[Callable[[], None]] = []
        self._seen = plugin.worker.membership_changes
        self._synced = False
        plugin.elastic = self          # it hands over the model, not the optimizer's step()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (for ``restore``), raise :class:`HostsUpdatedInterrupt` on every
        worker if any saw the membership change, else hand the state to rejoining workers."""
        self.save()
        self.check_host_updates()
        _donate(_p(), self._pack())

    def check_host_updates(self) -> None:
        """All workers agree whether the membership changed since the last check (every
        worker checks at the same commits, so the sums line up)."""
        worker = _p().worker
        changed = worker.membership_changes != self._seen
        self._seen = worker.membership_changes
        votes = push_pull(torch.tensor([1.0 if changed else 0.0]), average=False,
                          name="elastic.host_updates")
        if votes.item() > 0:
            raise HostsUpdatedInterrupt(skip_sync=True)

    def sync(self) -> None:
        """The first time: a rejoining worker takes the state a live worker hands it; the
        workers of a fresh job take rank 0's. Later: hand the state to rejoining workers."""
        plugin = _p()
        if self._synced:
            _donate(plugin, self._pack())
            return
        received = _received_state(plugin)
        if received is not None:
            if received["elastic"] is None:
                raise common.EngineError("rejoining: the live worker runs no elastic State "
                                         "(workers run different scripts?)")
            self._unpack(received["elastic"])
        else:
            self._broadcast()
        self._synced = True
        self.save()

    # what subclasses say
    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def _pack(self) -> Any:
        raise NotImplementedError

    def _unpack(self, packed: Any) -> None:
        raise NotImplementedError

    def _broadcast(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values (counters such as ``epoch`` and ``batch``) kept as attributes."""

    def __init__(self, **kwargs: Any):
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        super().__init__()
        self.save()

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def _pack(self) -> Any:
        return {"values": self._values()}

    def _unpack(self, packed: Any) -> None:
        for name, value in packed["values"].items():
            setattr(self, name, value)

    def _broadcast(self) -> None:
        for name, value in broadcast_object(self._values(), 0, name="elastic.values").items():
            setattr(self, name, value)


class TorchState(ObjectState):
    """A model, an optimizer and plain values (Horovod's ``TorchState``)."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any):
        self.model, self.optimizer = model, optimizer
        self._saved_model: dict[str, Any] = {}
        self._saved_optimizer: dict[str, Any] = {}
        super().__init__(**kwargs)

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())

    def restore(self) -> None:
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)

    def _pack(self) -> Any:
        return {**super()._pack(),
                "model": self.model.state_dict() if self.model is not None else None,
                "optimizer": (self.optimizer.state_dict() if self.optimizer is not None
                              else None)}

    def _unpack(self, packed: Any) -> None:
        super()._unpack(packed)
        if self.model is not None:
            self.model.load_state_dict(packed["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(packed["optimizer"])
            _p().unloaded.discard(getattr(self.optimizer, "_index", -1))

    def _broadcast(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super()._broadcast()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run``: call ``func(state, ...)`` after ``state.sync()``; when
    the membership changes (:class:`HostsUpdatedInterrupt` from a ``commit``), run the reset
    callbacks, sync and call it again."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        while True:
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                state.on_reset()

    return wrapper
