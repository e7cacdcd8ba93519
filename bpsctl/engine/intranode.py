"""The intra-node stage of the torch plugin: when several workers share a host, each byte
crosses the host's NIC once.

For a tensor of ``n`` elements on a host with ``L`` local ranks:

1. **reduce-scatter** across the local ranks (torch.distributed, gloo for host tensors):
   local rank ``j`` ends up with the host's sum of chunk ``j`` (``ceil(n / L)`` elements);
2. local rank ``j`` push_pulls only its chunk, under the name ``<name>@<j>/<L>`` and flagged
   host-reduced, so the server completes a round after one push per host;
3. **all-gather** the summed chunks across the local ranks into the output.

Collectives must be issued in the same order on every local rank, so steps 1 and 3 each run
on their own thread with their own process group (FIFO in submission order), and the
submission order is the caller's (the order of push_pull calls, as in Horovod without its
coordinator). Ranks on one host are contiguous: host ``h`` has ranks ``h*L .. h*L+L-1``.
"""
from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from .common import EngineError
from .worker import Worker

# the newer name, where there is one (the old one warns of its deprecation on every call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class LocalOp:
    """One push_pull going through the stage; ``wait`` re-raises its failure."""

    __slots__ = ("name", "src", "dst", "average", "priority", "done", "error", "engine_handle",
                 "buffers", "valid", "on_done")

    def __init__(self, name: str, src: torch.Tensor, dst: torch.Tensor, average: bool,
                 priority: int, on_done: Callable[[], None] | None = None):
        self.name, self.src, self.dst = name, src, dst
        self.average, self.priority = average, priority
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.engine_handle: Any = None
        self.buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.valid = 0
        self.on_done = on_done

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise EngineError(f"push_pull of {self.name!r} did not finish within {timeout_s:g} s "
                              "(intra-node stage)")
        if self.error is not None:
            raise self.error


class LocalStage:
    """Reduce-scatter / push_pull / all-gather across the workers of this host (see module doc)."""

    def __init__(self, worker: Worker, master_addr: str, master_port: int, timeout_s: float):
        self.worker = worker
        self.local_size = worker.local_size
        self.local_rank = worker.rank % self.local_size
        self.timeout_s = timeout_s
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=worker.rank, world_size=worker.size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            self._owns_default_group = True
        else:
            self._owns_default_group = False
        # every rank must create every group, in the same order
        host = worker.rank // self.local_size
        self.scatter_group = self.gather_group = None
        for h in range(worker.size // self.local_size):
            ranks = list(range(h * self.local_size, (h + 1) * self.local_size))
            scatter_group, gather_group = dist.new_group(ranks), dist.new_group(ranks)
            if h == host:
                self.scatter_group, self.gather_group = scatter_group, gather_group
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._scatter_q: queue.SimpleQueue = queue.SimpleQueue()
        self._gather_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._scatter_loop, daemon=True, name="bps-local-rs"),
                         threading.Thread(target=self._gather_loop, daemon=True, name="bps-local-ag")]
        for thread in self._threads:
            thread.start()

    def submit(self, op: LocalOp) -> LocalOp:
        self._scatter_q.put(op)
        return op

    def close(self) -> None:
        self._scatter_q.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ threads

    def _buffers_for(self, name: str, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(padded input L*c, own chunk c, gathered L*c), kept per name: a name is never in
        flight twice, so they are free when it comes again."""
        chunk = -(-src.numel() // self.local_size)
        cached = self._buffers.get(name)
        if cached is None or cached[1].numel() != chunk or cached[1].dtype != src.dtype:
            padded = torch.zeros(chunk * self.local_size, dtype=src.dtype)
            cached = (padded, torch.empty(chunk, dtype=src.dtype), torch.empty_like(padded))
            self._buffers[name] = cached
        return cached

    def _scatter_loop(self) -> None:
        while (op := self._scatter_q.get()) is not None:
            try:
                padded, own, _ = op.buffers = self._buffers_for(op.name, op.src)
                n, chunk = op.src.numel(), own.numel()
                padded[:n].copy_(op.src.reshape(-1))
                _reduce_scatter(own, padded, group=self.scatter_group)
                start = self.local_rank * chunk
                op.valid = max(0, min(chunk, n - start))
                piece = _as_array(own[:op.valid])
                op.engine_handle = self.worker.push_pull_async(
                    piece, name=f"{op.name}@{self.local_rank}/{self.local_size}",
                    average=op.average, priority=op.priority, out=piece, host_reduced=True)
            except BaseException as exc:     # noqa: BLE001 - handed to the caller
                op.error = exc
            self._gather_q.put(op)
        self._gather_q.put(None)

    def _gather_loop(self) -> None:
        while (op := self._gather_q.get()) is not None:
            try:
                if op.engine_handle is not None:
                    self.worker.synchronize(op.engine_handle)
            except BaseException as exc:     # noqa: BLE001
                op.error = exc
            try:
                if op.buffers is not None:
                    # taken part in even after a failure, so the other local ranks' collectives
                    # stay matched and they see their own errors instead of a hang
                    _, own, gathered = op.buffers
                    _all_gather(gathered, own, group=self.gather_group)
                    if op.error is None:
                        op.dst.reshape(-1).copy_(gathered[:op.src.numel()])
            except BaseException as exc:     # noqa: BLE001
                op.error = op.error or exc
            op.done.set()
            if op.on_done is not None:
                op.on_done()


def _as_array(tensor: torch.Tensor):
    """A NumPy view of a contiguous CPU tensor (bfloat16 as the engine's |V2), no copy."""
    from . import protocol as P
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(P.BFLOAT16)
    return tensor.numpy()
