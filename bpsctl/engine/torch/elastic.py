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
workers agree (one sum of a flag and a slot per rank) which workers took part in it and
whether any of them saw the membership change since the last one; if either differs, every
one raises :class:`HostsUpdatedInterrupt` at that same commit; ``run`` then re-shards the
state's :class:`ElasticSampler` objects over the workers that took part, calls the reset
callbacks and ``train(state)`` again, which resumes from the state's counters. A restarted
worker (``bpsctl run --max-restarts``, or one attached with ``bpsctl run --attach``) starts
``train`` with ``state.sync()``, which receives the model, optimizer state, samplers and
counters a live worker hands over: the live workers' next ``commit()`` raises (as Horovod
resets every worker when one is added), and the state travels at the reset, so the joiner
and the others start the training function together.
The first ``sync()`` of a fresh job broadcasts from rank 0, as Horovod's does. Live workers
stay equal bit for bit without any later broadcast: they all apply the same averaged
gradients.

State objects: a value given to ``TorchState``/``ObjectState`` that has ``state_dict()`` and
``load_state_dict()`` (an :class:`ElasticSampler`, an LR scheduler, a ``GradScaler``, a second
model) stays the same object for the whole job: it is saved, restored and synced through those
two methods, so the ``DataLoader`` holding a sampler keeps seeing the synced state. Any other
value is a plain value: deep-copied on save, replaced on sync.

Not provided: host discovery scripts (the run loop restarts workers; ``bpsctl run
--max-restarts``). Engine errors are not retried here: the losses the engine can survive never
reach the script.
"""
from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sized
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

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]

#: rank ids a commit's vote has a slot for (4 bytes each)
VOTE_SLOTS = 1024


class HostsUpdatedInterrupt(RuntimeError):
    """The job's membership changed: ``run`` resets and calls the training function again.
    ``skip_sync``: no state needs to travel (live workers are equal already)."""

    def __init__(self, skip_sync: bool = True):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync


# --------------------------------------------------------------------------- data sampling

def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The dataset's indices in the order of ``epoch``: shuffled by ``seed + epoch`` (the same
    on every rank), or ``0 .. length-1``."""
    order = list(range(length))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def shard_of(remaining: list[int], members: list[int], rank: int) -> list[int]:
    """The part of ``remaining`` that worker ``rank`` (one of ``members``, the rank ids of the
    workers sharing it) processes: every ``len(members)``-th index from its position among
    them, after padding ``remaining`` with its own first indices (repeated if need be) to a
    multiple of ``len(members)``, so every member's part has the same length."""
    if rank not in members:
        raise ValueError(f"rank {rank} is not among the members {members}")
    count = len(members)
    if not remaining:
        return []
    per_member = math.ceil(len(remaining) / count)
    padded = remaining * math.ceil(per_member * count / len(remaining))
    return padded[:per_member * count][members.index(rank)::count]


def _membership() -> tuple[int, list[int]]:
    """This worker's rank id and the rank ids of the workers sharing the data: those of the
    elastic state's last commit once there is one, else the live workers."""
    plugin = _p()
    state = plugin.elastic
    members = state.members if isinstance(state, State) else plugin.worker.live_ranks
    return plugin.worker.rank, sorted(members)


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ``ElasticSampler``: a ``DistributedSampler`` whose shards follow the job's
    workers. Each worker gets every ``size()``-th index of the epoch's order (shuffled by
    ``seed + epoch`` when ``shuffle``), counted from its place among the workers, the order
    padded so every shard has the same length.

    Record what was processed with ``record_batch(batch_idx, batch_size)`` (the shard's
    ``batch_idx``-th batch) or ``record_indices(indices)``, and call ``set_epoch`` at the end
    of an epoch (it clears the record). Kept in a :class:`TorchState`, the sampler stays the
    object the ``DataLoader`` holds; its state (epoch, processed indices) travels with the
    state, and when the workers change the epoch's indices not yet processed are re-sharded
    over the new workers: what any worker recorded before the last commit all workers took
    part in is not processed again; what it recorded after is, by the remaining workers.
    Every worker records the same batches between commits (they train in step).

    Each index is processed once per epoch when what is left at each re-shard divides by the
    number of workers; otherwise the padding repeats fewer indices than there are workers.
    A worker lost after an epoch's last commit: what it processed since is not redone (the
    others have gone on to the next epoch)."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.rank, self.members = _membership()
        self._base: set[int] = set()         # processed by any worker before this layout
        self._remaining: list[int] = []      # the epoch's order less _base
        self._shard: list[int] = []
        self._positions: set[int] = set()    # places in _shard recorded since the layout
        self._places: dict[int, int] | None = None     # index -> place in _shard, when asked
        self._guest = False
        self._layout = 0                     # changes whenever the shards do
        self._relayout(set(), self.members)

    # what Horovod's has
    @property
    def num_replicas(self) -> int:
        return len(self.members)

    @property
    def remaining_indices(self) -> list[int]:
        """The epoch's indices not processed at the last re-shard, in the epoch's order."""
        return list(self._remaining)

    @property
    def num_samples(self) -> int:
        """The length of this worker's shard (every worker's is this long)."""
        return len(self._shard)

    @property
    def total_size(self) -> int:
        """The length of all shards together: ``remaining_indices`` with its padding."""
        return len(self._shard) * len(self.members)

    @property
    def processed_indices(self) -> set[int]:
        """Indices processed this epoch as far as this worker knows: by any worker before the
        last re-shard, and by this one since."""
        return self._base | {self._shard[p] for p in self._positions}

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order, nothing processed. Call it at the end of an epoch, so
        an epoch cut short is resumed rather than restarted."""
        self.epoch = epoch
        self._relayout(set(), self.members)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The indices of this worker's ``batch_idx``-th batch of ``batch_size``."""
        return self._shard[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record this worker's ``batch_idx``-th batch of ``batch_size`` as processed."""
        if batch_idx < 0 or batch_size <= 0:
            raise ValueError(f"record_batch: batch_idx {batch_idx} and batch_size "
                             f"{batch_size}: expected batch_idx >= 0 and batch_size > 0")
        self._positions.update(range(batch_idx * batch_size,
                                     min((batch_idx + 1) * batch_size, len(self._shard))))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record ``indices`` (of this worker's shard) as processed."""
        wanted = set(indices)
        if self._places is None:
            self._places = {index: place
                            for place, index in reversed(list(enumerate(self._shard)))}
        places = self._places
        stray = wanted - places.keys()
        if stray:
            raise ValueError(f"record_indices: {sorted(stray)[:5]} are not in this worker's "
                             f"shard of epoch {self.epoch}")
        self._positions.update(places[index] for index in wanted)

    def state_dict(self) -> dict[str, Any]:
        """``epoch`` and ``processed_indices``: the indices the job processed this epoch, this
        worker's records standing for every worker's (they train in step)."""
        done = set(self._base)
        count, left = len(self.members), len(self._remaining)
        if left:       # place p of every member's shard: the padded order's p-th row
            done.update(self._remaining[(p * count + j) % left]
                        for p in self._positions for j in range(count))
        return {"epoch": self.epoch, "processed_indices": sorted(done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``epoch`` and ``processed_indices``; shard what is left over the workers."""
        self.epoch = int(state_dict["epoch"])
        self.rank, members = _membership()
        self._relayout({int(i) for i in state_dict["processed_indices"]}, members)

    def reset(self) -> None:
        """Shard this epoch's unprocessed indices (as this worker knows them) over the
        workers of the last commit."""
        self.rank, members = _membership()
        self._relayout(self.processed_indices, members)

    def _relayout(self, processed: set[int], members: list[int]) -> None:
        self.members = sorted(members)
        self._base = set(processed)
        order = epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        self._remaining = [i for i in order if i not in self._base]
        # a worker not among them (one that joined since the last commit) goes over the first
        # member's shard without recording it, until the next commit re-shards
        guest = self.rank not in self.members
        self._shard = shard_of(self._remaining, self.members,
                               self.members[0] if guest else self.rank) if self.members else []
        self._guest = guest
        self._places = None
        self._positions = set()
        self._layout += 1

    def _contribution(self, gone: list[int], their_positions: set[int]) -> set[int]:
        """What this worker knows was processed: its own records and, for each worker in
        ``gone``, the places it recorded up to its last commit (``their_positions``)."""
        if self._guest:
            return set()
        done = self.processed_indices
        for member in gone:
            shard = shard_of(self._remaining, self.members, member)
            done.update(shard[p] for p in their_positions if p < len(shard))
        return done

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._shard))

    def __len__(self) -> int:
        return len(self._shard)


class _Progress:
    """An :class:`ElasticSampler`'s records at the last two commits, to learn how far a worker
    lost since got: the last commit it took part in."""

    def __init__(self) -> None:
        self.last: tuple[int, frozenset[int]] = (-1, frozenset())
        self.previous: tuple[int, frozenset[int]] = (-1, frozenset())

    def committed(self, sampler: ElasticSampler) -> None:
        self.previous, self.last = self.last, (sampler._layout,
                                               frozenset(sampler._positions))

    def of_previous(self, sampler: ElasticSampler) -> set[int]:
        layout, positions = self.previous
        return set(positions) if layout == sampler._layout else set()


# --------------------------------------------------------------------------- states

def _kept_in_place(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


class State:
    """What survives a membership change: ``commit()`` at consistent points, ``sync()`` at
    the start of the training function (see the module docstring)."""

    def __init__(self) -> None:
        plugin = _p()
        self._reset_callbacks: list[Callable[[], None]] = []
        self._seen = plugin.worker.membership_changes
        self._synced = False
        #: rank ids of the workers that took part in the last commit
        self.members: list[int] = sorted(plugin.worker.live_ranks)
        plugin.elastic = self          # it hands over the model, not the optimizer's step()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (for ``restore``) and raise :class:`HostsUpdatedInterrupt` on every
        worker if the workers changed or one waits to join: ``run`` then hands the state to
        the joiner after the reset, so that it and the others start the training function
        together."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """All workers agree which of them take part in this commit and whether any saw the
        membership change since the last one (every worker checks at the same commits, so
        the sums line up); if the members or the flag say so, all raise here."""
        worker = _p().worker
        if not 0 <= worker.rank < VOTE_SLOTS:
            raise common.EngineError(f"elastic state: rank {worker.rank} has no slot in a "
                                     f"commit's vote (ranks 0-{VOTE_SLOTS - 1})")
        changed = worker.membership_changes != self._seen or bool(worker.pending_joins)
        self._seen = worker.membership_changes
        vote = torch.zeros(1 + VOTE_SLOTS)
        vote[0] = 1.0 if changed else 0.0
        vote[1 + worker.rank] = 1.0
        votes = push_pull(vote, average=False, name="elastic.host_updates")
        members = [int(r) for r in torch.nonzero(votes[1:] > 0.5).flatten().tolist()]
        previous, self.members = self.members, members
        self._committed()
        if votes[0].item() > 0 or members != previous:
            raise HostsUpdatedInterrupt(skip_sync=True)

    def _committed(self) -> None:
        """A commit every member took part in: note its progress."""

    def sync(self) -> None:
        """The first time: a rejoining worker takes the state a live worker hands it; the
        workers of a fresh job take rank 0's. Later (after a reset): hand the state to workers
        waiting to join."""
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
    """Values kept as attributes: plain Python values (counters such as ``epoch`` and
    ``batch``) are deep-copied on save and replaced on sync; objects with ``state_dict()``
    and ``load_state_dict()`` (samplers, LR schedulers, grad scalers) stay in place and only
    their state travels, through those methods."""

    def __init__(self, **kwargs: Any):
        self._names = [name for name, value in kwargs.items() if not _kept_in_place(value)]
        self._objects = [name for name, value in kwargs.items() if _kept_in_place(value)]
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self._saved_objects: dict[str, Any] = {}
        self._progress = {name: _Progress() for name in self._objects}
        super().__init__()
        self.save()

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def _object_states(self) -> dict[str, Any]:
        return {name: getattr(self, name).state_dict() for name in self._objects}

    def _load_objects(self, states: dict[str, Any]) -> None:
        for name, state in states.items():
            getattr(self, name).load_state_dict(state)

    def _samplers(self) -> dict[str, ElasticSampler]:
        return {name: getattr(self, name) for name in self._objects
                if isinstance(getattr(self, name), ElasticSampler)}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())
        self._saved_objects = copy.deepcopy(self._object_states())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)
        self._load_objects(copy.deepcopy(self._saved_objects))

    def _committed(self) -> None:
        for name, sampler in self._samplers().items():
            self._progress[name].committed(sampler)

    def on_reset(self) -> None:
        """Re-shard the samplers over the workers of the last commit, then call the reset
        callbacks."""
        members = self.members
        for name, sampler in sorted(self._samplers().items()):
            gone = [r for r in sampler.members if r not in members]
            done = sampler._contribution(gone, self._progress[name].of_previous(sampler))
            mask = torch.zeros(len(sampler.dataset))
            if done:
                mask[torch.tensor(sorted(done), dtype=torch.int64)] = 1.0
            # every member adds what it knows (a worker new to the job knows nothing)
            known = push_pull(mask, average=False, name=f"elastic.sampler.{name}")
            sampler.rank = _p().worker.rank
            sampler._relayout({int(i) for i in torch.nonzero(known > 0.5).flatten().tolist()},
                              members)
            self._progress[name] = _Progress()
        self.save()
        super().on_reset()

    def _pack(self) -> Any:
        return {"values": self._values(), "objects": self._object_states(),
                "members": list(self.members)}

    def _unpack(self, packed: Any) -> None:
        self.members = list(packed.get("members", self.members))
        for name, value in packed["values"].items():
            setattr(self, name, value)
        self._load_objects(packed.get("objects", {}))

    def _broadcast(self) -> None:
        got = broadcast_object({"values": self._values(), "objects": self._object_states()},
                               0, name="elastic.values")
        for name, value in got["values"].items():
            setattr(self, name, value)
        self._load_objects(got["objects"])


class TorchState(ObjectState):
    """A model, an optimizer and other values (Horovod's ``TorchState``): see
    :class:`ObjectState` for which values stay in place."""

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
    the membership changes (:class:`HostsUpdatedInterrupt` from a ``commit``), reset the state
    (re-shard its samplers, run the reset callbacks), sync and call it again."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        while True:
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                state.on_reset()

    return wrapper
