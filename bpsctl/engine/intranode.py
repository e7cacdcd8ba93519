"""The intra-node stage of the torch plugin: when several workers share a host, each byte
crosses the host's NIC once.

For a tensor of ``n`` elements on a host with ``L`` local ranks:

1. **reduce-scatter** across the local ranks: local rank ``j`` ends up with the host's sum of
   chunk ``j`` (``ceil(n / L)`` elements);
2. local rank ``j`` push_pulls only its chunk, under the name ``<name>@<j>/<L>`` and flagged
   host-reduced, so the server completes a round after one push per host;
3. **all-gather** the summed chunks across the local ranks into the output.

Collectives must be issued in the same order on every local rank, so steps 1 and 3 each run
on their own thread (FIFO in submission order), and the submission order is the caller's (the
order of push_pull calls, as in Horovod without its coordinator). Ranks on one host are
contiguous: host ``h`` has ranks ``h*L .. h*L+L-1``.

**Host tensors, shared memory** (``BPSCTL_LOCAL_SHM``, the default): steps 1 and 3 go through
one arena per host in ``/dev/shm`` (:mod:`bpsctl.engine.shm`), used as a ring in which every
push_pull gets a region (the same offset on every local rank: they place the same sizes in the
same order) holding a small header per local rank and one slot of ``L`` chunks per local rank.
Local rank ``j`` copies its tensor into its slot and bumps its ``COPIED`` counter; once every
local rank's is there it adds chunk ``j`` of every other slot into chunk ``j`` of its own, in
place, and push_pulls that chunk straight from shared memory, the result landing there too. The
all-gather thread then bumps ``RESULT`` and, once every local rank's result is in, copies chunk
``r`` of slot ``r`` (for every ``r``) into the output and bumps ``DONE``; a region is reused only
after every local rank's ``DONE`` has passed it. Each local rank's header in the region says
which push_pull it put there (sequence number, name, size, dtype), so local ranks that disagree
on the order or shape of their push_pulls get an error naming both, and whether it failed there,
so its peers fail it too instead of using what it did not finish. Every wait has the op
deadline (``BPSCTL_OP_TIMEOUT``) and checks every 0.1 s that the peers it waits for live: one
that died is named (worker rank, local rank, pid) and every later push_pull of the stage fails
with the same error, as the engine does for a lost worker. The sums run on the tensors' own
dtype with torch's in-place add (bfloat16 included, which NumPy lacks), in the order of the
local ranks.

**One host, no servers** (``BPSCTL_LOCAL_ONLY``: ``auto`` when every worker of the job is on
this host): after step 1 chunk ``j`` already holds the job's sum; it is divided by the number
of workers when averaging (rounded as the engine rounds) and step 2 is skipped.

**Host tensors, gloo** (``BPSCTL_LOCAL_SHM=0``): steps 1 and 3 are torch.distributed's
reduce-scatter and all-gather over gloo, each with its own process group.

**CUDA tensors** (when every host's ranks are on GPUs of their own, decided job-wide: see
:meth:`LocalStage.cuda_path` and :mod:`bpsctl.engine.paths`) take the same three steps on the
GPU, through two NCCL process groups per host (one per thread, as the gloo pair):
the reduce-scatter thread waits (on its own CUDA stream) for the event the caller recorded
after producing the tensor, reduce-scatters with NCCL into the owned chunk, copies only that
chunk into a pinned host buffer on the same side stream and waits for it (an event), then
push_pulls it host-reduced; the all-gather thread waits for the engine, copies the summed chunk
back (H2D, on its own side stream), all-gathers with NCCL into the output and divides there for
averaging, then records an event the caller's stream waits on (``synchronize``). With every
worker on one host (``local_only_cuda``) the three steps are one NCCL all-reduce on the GPUs,
and nothing goes to the host or the servers. Every local rank must push_pull the same tensors
on the same kind of device in the same order (as for the gloo path). Where ranks share a GPU
(NCCL refuses two ranks on one device) CUDA tensors are staged through host memory by the
plugin and take the host path. Nothing CUDA is touched until a CUDA tensor arrives, except the
device count of the check at start.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import queue
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import protocol as P
from . import shm
from .common import EngineError
from .paths import nccl_veto, nccl_within_hosts
from .worker import Worker

# the newer name, where there is one (the old one warns of its deprecation on every call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class LocalOp:
    """One push_pull going through the stage; ``wait`` re-raises its failure."""

    __slots__ = ("name", "src", "dst", "average", "priority", "done", "error", "engine_handle",
                 "buffers", "valid", "on_done", "ready", "finished", "compression", "once")

    def __init__(self, name: str, src: torch.Tensor, dst: torch.Tensor, average: bool,
                 priority: int, on_done: Callable[[], None] | None = None,
                 ready: Any = None, compression: Any = None, once: bool = False):
        self.name, self.src, self.dst = name, src, dst
        self.once = once            # a broadcast: the engine's push takes no shared-memory slot
        # the engine compresses what leaves the host (the owned chunk), not the local stage
        self.compression = compression
        self.average, self.priority = average, priority
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.engine_handle: Any = None
        self.buffers: Any = None
        self.valid = 0
        self.on_done = on_done
        # CUDA: ``ready`` is recorded by the caller after the work that produced ``src``;
        # ``finished`` by the stage after the work that wrote ``dst`` (wait on it before use)
        self.ready = ready
        self.finished: Any = None

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise EngineError(f"push_pull of {self.name!r} did not finish within {timeout_s:g} s "
                              "(intra-node stage)")
        if self.error is not None:
            raise self.error


class LocalStage:
    """Reduce-scatter / push_pull / all-gather across the workers of this host (see module doc)."""

    def __init__(self, worker: Worker, master_addr: str, master_port: int, timeout_s: float,
                 *, shm_bytes: int = 0, local_only: bool = False,
                 local_only_cuda: bool = False, start_timeout_s: float = 30.0):
        """``shm_bytes``: the size of this host's shared-memory arena for host tensors (0:
        gloo); ``local_only``: every worker is on this host, and host tensors never go to the
        servers (needs ``shm_bytes``); ``local_only_cuda``: likewise for CUDA tensors summed
        with NCCL (one all-reduce on the GPUs)."""
        if local_only_cuda and worker.local_size != worker.size:
            raise EngineError("local_only_cuda needs every worker of the job on one host, got "
                              f"{worker.local_size} local of {worker.size} workers")
        self.worker = worker
        self.local_size = worker.local_size
        self.local_rank = worker.rank % self.local_size
        self.timeout_s = timeout_s
        if local_only and (not shm_bytes or worker.local_size != worker.size):
            raise EngineError("BPSCTL_LOCAL_ONLY=on needs shared memory (BPSCTL_LOCAL_SHM=1) "
                              "and every worker of the job on one host, got "
                              f"{worker.local_size} local of {worker.size} workers")
        self.local_only = local_only
        self._closing = False
        self._arena: shm.Arena | None = None
        self._arena_bytes: torch.Tensor | None = None
        if shm_bytes:
            self._open_arena(shm_bytes, start_timeout_s)
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=worker.rank, world_size=worker.size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            self._owns_default_group = True
        else:
            self._owns_default_group = False
        # every rank must create every group, in the same order (BPSCTL_LOCAL_SHM is the same
        # on every rank: launchers hand every worker the same knobs)
        host = worker.rank // self.local_size
        self.scatter_group = self.gather_group = None
        for h in range(worker.size // self.local_size if self._arena is None else 0):
            ranks = list(range(h * self.local_size, (h + 1) * self.local_size))
            scatter_group, gather_group = dist.new_group(ranks), dist.new_group(ranks)
            if h == host:
                self.scatter_group, self.gather_group = scatter_group, gather_group
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # CUDA tensors: two NCCL groups of this host's ranks, made at the first CUDA push_pull
        # where every host's ranks turn out to be on distinct GPUs (engine/paths.py), unless a
        # rank's host rules it out now (new_group is collective over the whole job: every rank
        # must decide alike)
        self.nccl_scatter_group = self.nccl_gather_group = None
        self._stage_key = f"bpsctl/intranode/{next(_stage_counter)}"
        self._cuda_lock = threading.Lock()
        self.cuda_decision: tuple[bool, str] | None = None   # (NCCL groups made, why)
        veto = _job_veto(f"{self._stage_key}/veto", worker.rank, worker.size,
                         nccl_veto(dist.is_nccl_available(), torch.cuda.is_available(),
                                   torch.cuda.device_count(), self.local_size), timeout_s)
        if veto is not None:
            self.cuda_decision = (False, veto)
        #: CUDA tensors of a one-host job: one NCCL all-reduce on the GPUs, no servers
        self.local_only_cuda = local_only_cuda
        self._cuda_buffers: dict[str, _CudaBuffers] = {}
        self._streams: dict[tuple[int, str], Any] = {}      # (device, thread) -> side stream
        self._scatter_q: queue.SimpleQueue = queue.SimpleQueue()
        self._gather_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._scatter_loop, daemon=True, name="bps-local-rs"),
            threading.Thread(target=self._gather_loop, daemon=True, name="bps-local-ag")]
        for thread in self._threads:
            thread.start()

    def submit(self, op: LocalOp) -> LocalOp:
        pieces = self._pieces(op) if self._arena is not None and not op.src.is_cuda else None
        for piece in pieces or (op,):
            self._scatter_q.put(piece)
        return op

    def _pieces(self, op: LocalOp) -> list[LocalOp] | None:
        """A host tensor too large for half the arena, cut into pieces that fit (each its own
        push_pull, ``<name>#<k>``, so that two are in flight at a time); None: no need."""
        L, itemsize = self.local_size, op.src.element_size()
        # a piece of chunk * L elements takes L op headers and L slots of chunk elements
        # (each slot padded to a cache line)
        chunk = ((self._ring.capacity // 2 - L * _OP_HEADER) // L - shm.ALIGN) // (L * itemsize)
        n = op.src.numel()
        if n <= chunk * L or chunk < 1:
            return None                     # fits (or cannot: the scatter thread says why)
        step = chunk * L
        src, dst = op.src.reshape(-1), op.dst.reshape(-1)      # contiguous: views
        pieces = [LocalOp(f"{op.name}#{k}", src[a:a + step], dst[a:a + step], op.average,
                          op.priority, compression=op.compression)
                  for k, a in enumerate(range(0, n, step))]
        left = [len(pieces)]

        def piece_done(piece: LocalOp) -> None:     # on the all-gather thread only
            op.error = op.error or piece.error
            left[0] -= 1
            if left[0] == 0:
                op.done.set()
                if op.on_done is not None:
                    op.on_done()

        for piece in pieces:
            piece.on_done = functools.partial(piece_done, piece)
        return pieces

    def close(self) -> None:
        self._closing = True                # waits on peers give up at once
        self._scatter_q.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        if self._arena is not None:
            self._arena_bytes = None
            self._arena.release()
            self._arena = None
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        elif self.nccl_scatter_group is not None and dist.is_initialized():
            # the caller's default group lives on; ours are released (NCCL communicators)
            for group in (self.nccl_scatter_group, self.nccl_gather_group):
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
        self.nccl_scatter_group = self.nccl_gather_group = None

    @property
    def handles_cuda(self) -> bool:
        """True when CUDA tensors go through NCCL here (else: staged to the host first)."""
        return self.nccl_scatter_group is not None

    def cuda_path(self, device: torch.device) -> bool:
        """Whether CUDA tensors take NCCL here (else they are staged through host memory),
        decided job-wide at the first CUDA push_pull, from ``device`` (where that tensor is)
        and every other rank's: each publishes its GPU's UUID, and NCCL groups are made only
        where every host's ranks are on distinct GPUs (:func:`~bpsctl.engine.paths.
        nccl_within_hosts`). Every rank calls this at its first CUDA push_pull (the ranks push
        the same tensors in the same order)."""
        if self.cuda_decision is None:
            with self._cuda_lock:
                if self.cuda_decision is None:
                    self.cuda_decision = self._decide_cuda(device)
        return self.cuda_decision[0]

    def _decide_cuda(self, device: torch.device) -> tuple[bool, str]:
        worker = self.worker
        store = dist.distributed_c10d._get_default_store()
        key = f"{self._stage_key}/device"
        store.set(f"{key}/{worker.rank}", str(torch.cuda.get_device_properties(device).uuid))
        keys = [f"{key}/{r}" for r in range(worker.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:            # noqa: BLE001 - a deadline, named
            raise EngineError(f"the intra-node stage: not every worker pushed a CUDA tensor "
                              f"within {self.timeout_s:g} s (BPSCTL_OP_TIMEOUT) to agree on "
                              f"NCCL: {exc}") from None
        devices = [store.get(k).decode() for k in keys]
        distinct, why = nccl_within_hosts(devices, self.local_size)
        if distinct:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            host = worker.rank // self.local_size
            for h in range(worker.size // self.local_size):
                ranks = list(range(h * self.local_size, (h + 1) * self.local_size))
                scatter_group = dist.new_group(ranks, timeout=timeout, backend="nccl")
                gather_group = dist.new_group(ranks, timeout=timeout, backend="nccl")
                if h == host:
                    self.nccl_scatter_group, self.nccl_gather_group = scatter_group, gather_group
        return distinct, why

    # ------------------------------------------------------------------ threads

    def _buffers_for(self, name: str,
                     src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            if op.src.is_cuda:
                self._scatter_cuda(op)
                self._gather_q.put(op)
                continue
            if self._arena is not None:
                self._scatter_shm(op)
                self._gather_q.put(op)
                continue
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
                    average=op.average, priority=op.priority, out=piece, host_reduced=True,
                    compression=op.compression, once=op.once)
            except BaseException as exc:     # noqa: BLE001 - handed to the caller
                op.error = exc
            self._gather_q.put(op)
        self._gather_q.put(None)

    def _gather_loop(self) -> None:
        while (op := self._gather_q.get()) is not None:
            if op.src.is_cuda or self._arena is not None:
                if op.src.is_cuda:
                    self._gather_cuda(op)
                else:
                    self._gather_shm(op)
                op.done.set()
                if op.on_done is not None:
                    op.on_done()
                continue
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


    # ------------------------------------------------------------------ host tensors (shm)

    def _open_arena(self, shm_bytes: int, start_timeout_s: float) -> None:
        """Create (local rank 0) or attach to this host's arena; every local rank has attached
        when this returns on local rank 0, and the arena's name is gone from /dev/shm."""
        worker = self.worker
        host = worker.rank // self.local_size
        name = shm.segment_name(shm.cluster_tag(worker.scheduler_address, worker.security.secret),
                                worker.config.job_id, host)
        path = shm.SHM_DIR / name
        deadline = time.monotonic() + start_timeout_s
        if self.local_rank == 0:
            arena = shm.Arena.create(path, shm_bytes, self.local_size)
            try:
                arena.wait_attached(deadline, self._check_engine)
            except BaseException:
                arena.release()
                raise
        else:
            arena = shm.Arena.attach(path, shm_bytes, self.local_rank, self.local_size,
                                     deadline, self._check_engine)
        self._arena = arena
        self._shm_bytes = shm_bytes
        # the whole arena as one byte tensor: regions are views of it, made per push_pull
        self._arena_bytes = torch.frombuffer(arena.mapping, dtype=torch.uint8)
        self._ring = shm.Ring(arena.data_start, arena.size)
        self._seq = 0                       # push_pulls placed so far (the scatter thread's)
        self._shm_broken: EngineError | None = None   # a peer died, or the ranks disagreed

    def _check_engine(self) -> None:
        """Raise if waiting on local peers is pointless: shutting down, or the engine broke
        (a lost worker or server, as the scheduler said)."""
        if self._closing:
            raise EngineError("the engine is shut down")
        broken = self.worker._broken
        if broken is not None:
            raise broken

    def _wait_all(self, word: int, seq: int, op: LocalOp, what: str) -> None:
        """Wait until every local rank's counter ``word`` has reached ``seq``, at most the op
        deadline; a peer that died meanwhile is named (and breaks the stage for good)."""
        arena = self._arena
        assert arena is not None
        column = arena.control[:, word]
        if int(column.min()) >= seq:
            return
        started = time.monotonic()
        deadline = started + self.timeout_s
        next_check = started + shm.PEER_CHECK_S
        delay = 50e-6
        while int(column.min()) < seq:
            time.sleep(delay)
            delay = min(delay * 2, 0.001)
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + shm.PEER_CHECK_S
            self._check_engine()
            late = [r for r in range(self.local_size) if column[r] < seq]
            joined = [self._rank_of(r) for r in late
                      if self._rank_of(r) in self.worker.joined_ranks]
            if joined:
                self._shm_broken = EngineError(
                    f"push_pull of {op.name!r}: worker(s) {joined} of this host joined "
                    f"(hvd.join()), and the intra-node stage cannot count a rank as zeros; "
                    f"{JOIN_WAY_OUT}")
                raise self._shm_broken
            for r in late:
                if not arena.peer_alive(r):
                    self._shm_broken = EngineError(
                        f"worker {self._rank_of(r)} (local rank {r}, pid {arena.peer_pid(r)}) on "
                        f"this host exited during the push_pull of {op.name!r}; the intra-node "
                        "stage cannot go on without it")
                    raise self._shm_broken
            if now > deadline:
                raise EngineError(
                    f"push_pull of {op.name!r}: worker(s) {[self._rank_of(r) for r in late]} of "
                    f"this host did not {what} within {self.timeout_s:g} s (BPSCTL_OP_TIMEOUT)")

    def _rank_of(self, local_rank: int) -> int:
        return self.worker.rank - self.local_rank + local_rank

    def _scatter_shm(self, op: LocalOp) -> None:
        """Steps 1 and 2 through the arena (see the module doc). Once the op has a region
        (``op.buffers``), the gather thread publishes its counters whatever happens, so the
        other local ranks never wait in vain."""
        arena, L, j = self._arena, self.local_size, self.local_rank
        assert arena is not None and self._arena_bytes is not None
        try:
            if self._shm_broken is not None:
                raise self._shm_broken
            src = op.src.reshape(-1)
            n, itemsize = src.numel(), src.element_size()
            code = P.dtype_code(_as_array(src[:0]).dtype)     # the engine's dtype errors
            if op.average and not src.dtype.is_floating_point:     # as the engine says
                raise TypeError(f"average=True needs a floating-point tensor, got {src.dtype} "
                                f"for {op.name!r}; pass average=False to sum")
            chunk, _, valid = chunk_layout(n, L, j)
            slot_bytes = shm.align(chunk * L * itemsize)     # a local rank's whole tensor
            nbytes = _OP_HEADER * L + slot_bytes * L
            if nbytes > self._ring.capacity:
                raise EngineError(
                    f"push_pull of {op.name!r} ({n * itemsize} bytes) needs {nbytes} bytes of "
                    f"this host's shared-memory arena, which holds {self._ring.capacity} "
                    f"(BPSCTL_SHM_BYTES={self._shm_bytes}); raise BPSCTL_SHM_BYTES or set "
                    "BPSCTL_LOCAL_SHM=0")
            self._seq += 1
            seq = self._seq
            offset, wait_for = self._ring.place(nbytes, seq, int(arena.control[:, shm.DONE].min()))
            op.buffers = _ShmOp(seq, offset, chunk, slot_bytes, n, zlib.crc32(op.name.encode()),
                                code)
            op.valid = valid
        except BaseException as exc:     # noqa: BLE001 - handed to the caller
            op.error = exc
            return
        words = _op_words(arena, op.buffers)
        slots = self._arena_bytes[offset + _OP_HEADER * L:offset + nbytes]
        failed = 0
        try:
            self._wait_all(shm.DONE, wait_for, op, "finish an earlier push_pull")
            if n:
                mine = slots[j * slot_bytes:j * slot_bytes + n * itemsize].view(src.dtype)
                mine.copy_(src)
        except BaseException as exc:     # noqa: BLE001
            op.error, failed = exc, 1
        words[j] = (seq, n, code, op.buffers.crc, failed, 0, 0, 0)
        arena.control[j, shm.COPIED] = seq
        if op.error is not None:
            return
        try:
            self._wait_all(shm.COPIED, seq, op, "start it")
            self._check_peers(op, words, check_shapes=True)
            start = j * slot_bytes + j * chunk * itemsize
            own = slots[start:start + valid * itemsize].view(src.dtype)
            for r in range(L):
                if r != j:
                    peer = r * slot_bytes + j * chunk * itemsize
                    own.add_(slots[peer:peer + valid * itemsize].view(src.dtype))
            if self.local_only:
                if op.average and self.worker.size > 1:
                    divide_exactly(own, self.worker.size)
            else:
                piece = _as_array(own)
                op.engine_handle = self.worker.push_pull_async(
                    piece, name=f"{op.name}@{j}/{L}", average=op.average, priority=op.priority,
                    out=piece, host_reduced=True, compression=op.compression, once=op.once)
        except BaseException as exc:     # noqa: BLE001
            op.error = exc

    def _check_peers(self, op: LocalOp, words: np.ndarray, check_shapes: bool) -> None:
        """Raise if another local rank put a different push_pull in this region, or failed
        its part of this one."""
        mine = op.buffers
        for r in range(self.local_size):
            seq, n, code, crc, failed = (int(x) for x in words[r, :5])
            if check_shapes and (seq, n, code, crc) != (mine.seq, mine.n, mine.code, mine.crc):
                self._shm_broken = EngineError(
                    f"the workers of this host disagree on the order or shape of their "
                    f"push_pulls: worker {self.worker.rank} pushed {op.name!r} ({mine.n} "
                    f"elements, {op.src.dtype}) where worker {self._rank_of(r)} pushed another "
                    "tensor or shape; every local rank must push_pull the same tensors in the "
                    "same order")
                raise self._shm_broken
            if failed and r != self.local_rank:
                raise EngineError(f"push_pull of {op.name!r} failed on worker "
                                  f"{self._rank_of(r)} of this host (its own error says why)")

    def _gather_shm(self, op: LocalOp) -> None:
        """Step 3 through the arena: publish this rank's result, copy every rank's out."""
        mine = op.buffers
        if mine is None:
            return                          # failed before it had a region
        arena, L, j = self._arena, self.local_size, self.local_rank
        assert arena is not None and self._arena_bytes is not None
        words = _op_words(arena, mine)
        try:
            if op.engine_handle is not None:
                self.worker.synchronize(op.engine_handle)
        except BaseException as exc:     # noqa: BLE001
            op.error = exc
        if op.error is not None:
            words[j, _FAILED] = 1
        arena.control[j, shm.RESULT] = mine.seq
        try:
            self._wait_all(shm.RESULT, mine.seq, op, "finish it")
            if op.error is None:
                self._check_peers(op, words, check_shapes=False)
                itemsize = op.src.element_size()
                base = mine.offset + _OP_HEADER * L
                dst = op.dst.reshape(-1)
                for r in range(L):
                    _, first, valid = chunk_layout(mine.n, L, r)
                    if valid:
                        at = base + r * mine.slot_bytes + first * itemsize
                        dst[first:first + valid].copy_(
                            self._arena_bytes[at:at + valid * itemsize].view(op.src.dtype))
        except BaseException as exc:     # noqa: BLE001
            op.error = op.error or exc
        arena.control[j, shm.DONE] = mine.seq

    # ------------------------------------------------------------------ CUDA tensors (NCCL)

    def _stream(self, device: torch.device, thread: str) -> Any:
        """This thread's side stream on ``device`` (each key is used by one thread only)."""
        key = (device.index, thread)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device)
        return stream

    def _cuda_buffers_for(self, name: str, src: torch.Tensor) -> _CudaBuffers:
        """Per name, as ``_buffers_for``; called on the reduce-scatter side stream after it
        waited for the caller, so memory handed back by a previous size is free there."""
        n = src.numel()
        cached = self._cuda_buffers.get(name)
        if (cached is None or cached.numel != n or cached.own.dtype != src.dtype
                or cached.own.device != src.device):
            chunk, _, _ = chunk_layout(n, self.local_size, self.local_rank)
            even = chunk * self.local_size == n    # then the tensors themselves are used
            full = chunk * self.local_size
            cached = _CudaBuffers(
                n,
                padded=None if even else torch.zeros(full, dtype=src.dtype, device=src.device),
                own=torch.empty(chunk, dtype=src.dtype, device=src.device),
                gathered=None if even else torch.empty(full, dtype=src.dtype, device=src.device),
                host=torch.empty(chunk, dtype=src.dtype, pin_memory=True))
            self._cuda_buffers[name] = cached
        return cached

    def _scatter_cuda(self, op: LocalOp) -> None:
        """Step 1 on the GPU, then the push of the owned chunk through pinned host memory.
        Failures go to ``op.error``; once ``op.buffers`` is set (the reduce-scatter is being
        issued) the all-gather thread takes part whatever happens, as in the gloo path."""
        try:
            if self.nccl_scatter_group is None:
                raise EngineError("the intra-node stage has no NCCL groups for CUDA tensors "
                                  "(the plugin stages them through host memory instead)")
            if not (op.src.is_contiguous() and op.dst.is_contiguous()
                    and op.dst.device == op.src.device and op.dst.dtype == op.src.dtype):
                raise ValueError(f"{op.name!r}: the stage needs contiguous CUDA tensors of one "
                                 "device and dtype")
            n = op.src.numel()
            if n == 0:
                return                              # nothing to sum: no collective, no push
            if op.average and not op.src.dtype.is_floating_point:
                raise TypeError(f"average=True needs a floating-point tensor, got {op.src.dtype} "
                                f"for {op.name!r}; pass average=False to sum")
            device = op.src.device
            stream = self._stream(device, "rs")
            if self.local_only_cuda:
                self._all_reduce_cuda(op, stream)
                return
            with torch.cuda.device(device), torch.cuda.stream(stream):
                if op.ready is not None:
                    stream.wait_event(op.ready)     # the caller's work that produced src
                buffers = self._cuda_buffers_for(op.name, op.src)
                _, _, op.valid = chunk_layout(n, self.local_size, self.local_rank)
                if buffers.padded is None:
                    source = op.src.reshape(-1)     # a view: n == chunk * L
                else:
                    buffers.padded[:n].copy_(op.src.reshape(-1))
                    source = buffers.padded
                op.buffers = buffers
                # NCCL's stream waits for this thread's current stream (the side stream), and
                # (async_op=False) the side stream then waits for NCCL: the copy below follows
                _reduce_scatter(buffers.own, source, group=self.nccl_scatter_group)
                host = buffers.host[:op.valid]
                host.copy_(buffers.own[:op.valid], non_blocking=True)
                copied = torch.cuda.Event(blocking=True)    # the wait below sleeps, not spins
                copied.record(stream)
            copied.synchronize()                    # the chunk is on the host
            piece = _as_array(host)
            # the engine sums only; the division for averaging runs on the GPU after the gather
            op.engine_handle = self.worker.push_pull_async(
                piece, name=f"{op.name}@{self.local_rank}/{self.local_size}",
                average=False, priority=op.priority, out=piece, host_reduced=True,
                compression=op.compression, once=op.once)
        except BaseException as exc:     # noqa: BLE001 - handed to the caller
            op.error = exc

    def _all_reduce_cuda(self, op: LocalOp, stream: Any) -> None:
        """A one-host job's CUDA tensor: one NCCL all-reduce into ``op.dst`` on the GPUs after
        the caller's work that produced it, the division for averaging there too, and
        ``op.finished`` recorded after it (no host copy, no push; the all-gather thread has
        nothing left to do)."""
        with torch.cuda.device(op.src.device), torch.cuda.stream(stream):
            if op.ready is not None:
                stream.wait_event(op.ready)
            dst = op.dst.reshape(-1)                # contiguous: a view
            if dst.data_ptr() != op.src.data_ptr():
                dst.copy_(op.src.reshape(-1))
            dist.all_reduce(dst, group=self.nccl_scatter_group)
            if op.average and self.worker.size > 1:
                divide_exactly(dst, self.worker.size)
            finished = torch.cuda.Event()
            finished.record(stream)
            op.finished = finished

    def _gather_cuda(self, op: LocalOp) -> None:
        """Step 3 on the GPU: the summed chunk back (H2D), all-gather into ``op.dst``, divide;
        ``op.finished`` is recorded after all of it."""
        try:
            if op.engine_handle is not None:
                self.worker.synchronize(op.engine_handle)
        except BaseException as exc:     # noqa: BLE001
            op.error = exc
        buffers = op.buffers
        if buffers is None:
            return                                  # no reduce-scatter was issued
        try:
            device = op.src.device
            stream = self._stream(device, "ag")
            with torch.cuda.device(device), torch.cuda.stream(stream):
                dst = op.dst.reshape(-1)            # contiguous: a view
                if op.error is None:
                    buffers.own[:op.valid].copy_(buffers.host[:op.valid], non_blocking=True)
                    target = dst if buffers.gathered is None else buffers.gathered
                else:
                    # taken part in all the same (the other local ranks' collectives stay
                    # matched), into scratch: the caller's output is left alone
                    target = (buffers.gathered if buffers.gathered is not None
                              else torch.empty_like(dst))
                _all_gather(target, buffers.own, group=self.nccl_gather_group)
                if op.error is None:
                    if target is not dst:
                        dst.copy_(target[:dst.numel()])
                    if op.average and self.worker.size > 1:
                        divide_exactly(dst, self.worker.size)
                finished = torch.cuda.Event()
                finished.record(stream)
                op.finished = finished
        except BaseException as exc:     # noqa: BLE001
            op.error = op.error or exc


#: bytes of each local rank's header in a push_pull's region: seq, elements, dtype code, name
#: crc, failed (int64 words), padded to a cache line
_OP_HEADER = shm.ALIGN
_FAILED = 4


class _ShmOp:
    """Where a push_pull lives in the arena, and what it is (to check the peers agree)."""

    __slots__ = ("seq", "offset", "chunk", "slot_bytes", "n", "crc", "code")

    def __init__(self, seq: int, offset: int, chunk: int, slot_bytes: int, n: int, crc: int,
                 code: int):
        self.seq, self.offset, self.chunk, self.slot_bytes = seq, offset, chunk, slot_bytes
        self.n, self.crc, self.code = n, crc, code


def _op_words(arena: shm.Arena, op: _ShmOp) -> np.ndarray:
    """The (L, 8) int64 headers of the local ranks in ``op``'s region."""
    return np.ndarray((arena.local_size, _OP_HEADER // 8), dtype=np.int64, buffer=arena.mapping,
                      offset=op.offset)


class _CudaBuffers:
    """A name's device buffers: ``padded``/``gathered`` (L*c) only when the tensor does not
    split evenly, the owned chunk ``own`` (c) and its pinned host copy ``host`` (c)."""

    __slots__ = ("numel", "padded", "own", "gathered", "host")

    def __init__(self, numel: int, *, padded: torch.Tensor | None, own: torch.Tensor,
                 gathered: torch.Tensor | None, host: torch.Tensor):
        self.numel, self.padded, self.own, self.gathered, self.host = (
            numel, padded, own, gathered, host)


#: what a collective of the stage while a rank has joined (hvd.join()) does instead
JOIN_WAY_OUT = ("set BPSCTL_LOCAL_REDUCE=off (every worker pushes to the servers on its own) to "
                "go on with collectives after a rank joined")


def chunk_layout(n: int, local_size: int, local_rank: int) -> tuple[int, int, int]:
    """``(chunk, start, valid)``: of a tensor of ``n`` elements cut into ``local_size`` chunks of
    ``ceil(n / local_size)``, local rank ``local_rank`` owns ``chunk`` elements from ``start``,
    of which the first ``valid`` are the tensor's (the rest is padding)."""
    chunk = -(-n // local_size)
    start = local_rank * chunk
    return chunk, start, max(0, min(chunk, n - start))


def divide_exactly(tensor: torch.Tensor, divisor: int) -> None:
    """``tensor /= divisor`` in place, rounded as the engine divides on the host: a true
    division (torch multiplies by the reciprocal when the divisor is a Python scalar, which can
    be an ulp off), float16 and bfloat16 through float32 and rounded once."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        wide = tensor.float()
        wide.div_(torch.full((), divisor, dtype=torch.float32, device=tensor.device))
        tensor.copy_(wide)
    else:
        tensor.div_(torch.full((), divisor, dtype=tensor.dtype, device=tensor.device))


_stage_counter = itertools.count()


def _job_veto(key: str, rank: int, size: int, mine: str | None, timeout_s: float,
              store: Any = None) -> str | None:
    """None when no rank of the job has a veto, else one (``rank r: why``), through the
    default group's store: each rank publishes its own (``mine``); a rank that has one knows
    the answer at once and does not wait for the others."""
    if store is None:
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:                # noqa: BLE001 - no store: the same on every rank
            return "no torch.distributed store to agree through"
    store.set(f"{key}/{rank}", mine or "")
    if mine:
        return f"rank {rank}: {mine}"
    keys = [f"{key}/{r}" for r in range(size)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    for r, k in enumerate(keys):
        why = store.get(k).decode()
        if why:
            return f"rank {r}: {why}"
    return None


def _as_array(tensor: torch.Tensor):
    """A NumPy view of a contiguous CPU tensor (bfloat16 as the engine's |V2), no copy."""
    from . import protocol as P
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(P.BFLOAT16)
    return tensor.numpy()
