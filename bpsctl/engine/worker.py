"""The worker side of the engine: declare, partition, prioritize, push and pull.

A :class:`Worker` owns one background I/O thread and all of its sockets (ZeroMQ sockets
are not thread-safe). Callers hand it work through a deque and a wake-up pipe, and wait on
the returned :class:`Handle`.

Path of one ``push_pull``:

1. the tensor's name is declared to the scheduler once; the scheduler answers with its
   partitions (at most ``partition_bytes`` each) and the server of each;
2. every partition goes into one priority queue (higher ``priority`` first, then FIFO);
3. partitions are pushed, zero-copy from the caller's array, while the bytes pushed and not
   yet acknowledged stay within ``credit_bytes`` — so a late high-priority tensor waits
   behind at most ``credit_bytes``, not behind a whole model;
4. each partition's sum arrives as soon as every worker has pushed it, and is copied (or
   divided, when averaging) straight into the output; pushes of later partitions go on
   meanwhile, so both directions of the link stay busy.

To a server on the same host (``BPSCTL_SHM_SERVER``; engine/shmlink.py) step 3 copies each
partition once into its slot in shared memory and pushes a reference to it (``FLAG_SHM``), and
step 4 copies the sum out of shared memory (``_shm_slot``, ``_shm_result``). A caller with its
own copy engine (a GPU) makes neither copy: it fills the slots itself (``lend``, then
``push_pull_async(filled=...)``) and reads each sum where it is (``lend_results=True``:
``Handle.lent``), from memory it had page-locked (``pin_shared_memory``).

A push_pull that says which bytes are this worker's (``mine``: a gather's rows; ``root``: a
broadcast, the root's all, the others' none) sends each partition without them as a
PUSH_ZERO, a header alone, which the server counts as a push of zeros.

Under asynchronous training (``async_update``/``async_init``, ``BPSCTL_ASYNC``) the same path
carries a gradient, with the optimizer's hyperparameters, to servers that hold the
parameters; each partition's answer is its parameters, copied into the output.
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from .. import __version__
from ..config import Config, check_training_mode
from . import compression as C
from . import protocol as P
from . import shm, shmlink
from .client import measure_clock
from .common import (
    EngineError,
    HorovodInternalError,
    JobFinished,
    SchedulerGone,
    io_thread_affinity,
    lost_link,
    make_socket,
    monitor,
    monitor_events,
    release_free_memory,
    watch_link,
)
from .pacing import credit_for
from .paths import solo_job
from .security import Login, Security, handshake_failed, refused_handshake
from .trace import STAGE, Trace, attach_nic, best_clock, now_ns, scheduler_clock


class Handle:
    """An asynchronous push_pull in progress; pass it to ``poll`` or ``synchronize``.

    A compressed push_pull's results are decompressed by whoever waits for it, not on the
    engine's I/O thread (which must keep sending, receiving and heartbeating): the I/O thread
    queues each partition's compressed sum here as it arrives, and ``wait`` decompresses them
    one by one while the rest are still on the wire. ``done()`` is True once every sum has
    arrived; the output is complete once ``wait`` (``synchronize``) returns."""

    __slots__ = ("name", "output", "_done", "error", "_arrived", "_news", "_decoding", "lent")

    def __init__(self, name: str, output: np.ndarray):
        self.name = name
        self.output = output
        # push_pull_async(lend_results=True): (byte offset, view, divisor or None) of each
        # partition whose sum arrived in shared memory, which is left there, not in output
        self.lent: list[tuple[int, np.ndarray, int | None]] = []
        self._done = threading.Event()
        self.error: BaseException | None = None
        # compressed: (codec, payload, part id, round, destination, divisor) per partition
        self._arrived: collections.deque[tuple[Any, ...]] | None = None
        self._news: threading.Event | None = None
        self._decoding: threading.Lock | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def _compressed(self) -> None:
        """Results will come compressed: ``wait`` decompresses them (see the class doc)."""
        self._arrived = collections.deque()
        self._news = threading.Event()
        self._decoding = threading.Lock()

    def _set_done(self) -> None:
        """The op is over (every sum arrived, or it failed). A compressed op's waiter sleeps on
        ``_news``, so it is woken too: it may have taken the last sum already and be waiting
        for news that no further sum would bring."""
        self._done.set()
        if self._news is not None:
            self._news.set()

    def _result_arrived(self, job: tuple[Any, ...]) -> None:
        """On the I/O thread: one partition's compressed sum, for the waiter to decompress."""
        assert self._arrived is not None and self._news is not None
        self._arrived.append(job)
        self._news.set()

    def _decompress(self) -> None:
        """Decompress the sums that have arrived (the first failure ends the op)."""
        assert self._arrived is not None
        while self._arrived:
            codec, payload, part_id, round_, dst, divisor = self._arrived.popleft()
            if self.error is None:
                try:
                    codec.decode(payload.buffer, part_id, round_, dst, divisor)
                except (P.ProtocolError, ValueError) as exc:
                    self.error = EngineError(f"push_pull of {self.name!r}: the sum of "
                                             f"partition {part_id} could not be "
                                             f"decompressed: {exc}")

    def _finish_decompressing(self) -> None:
        """Decompress whatever is left of a finished op (before its name is pushed again)."""
        if self._decoding is not None:
            with self._decoding:
                self._decompress()

    def wait(self, timeout_s: float | None) -> np.ndarray:
        if self._decoding is None:
            if not self._done.wait(timeout_s):
                raise EngineError(f"push_pull of {self.name!r} did not finish within "
                                  f"{timeout_s:g} s")
        else:
            assert self._news is not None
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            with self._decoding:
                while True:
                    self._news.clear()
                    finished = self._done.is_set()
                    self._decompress()
                    if finished:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or not self._news.wait(left):
                        raise EngineError(f"push_pull of {self.name!r} did not finish within "
                                          f"{timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.output


class Lease:
    """A name's push slots, lent to a caller that fills them itself (:meth:`Worker.lend`):
    ``views`` holds (byte offset in the tensor, byte length, writable view of the slot) of
    each partition, to be filled before ``push_pull_async(..., filled=lease)``."""

    __slots__ = ("name", "slots", "views")

    def __init__(self, name: str):
        self.name = name
        self.slots: dict[int, tuple[bytes, np.ndarray]] = {}     # part id -> its slot
        self.views: list[tuple[int, int, np.ndarray]] = []

    def runs(self) -> list[tuple[int, np.ndarray]]:
        """(byte offset in the tensor, writable view) of each run of slots consecutive both in
        the tensor and in one segment (:func:`shmlink.merge_runs`): one copy fills each."""
        return [(offset, view) for offset, view, _ in
                shmlink.merge_runs([(at, view, None) for at, _, view in self.views])]


class _Task:
    """The I/O thread's record of one push_pull."""

    __slots__ = ("handle", "name", "src", "dst", "dtype", "shape", "priority", "divisor",
                 "remaining", "deadline", "parts", "flags", "called_ns", "queued_ns", "codec",
                 "hyper", "once", "filled", "lend_results", "reduction",
                 "scope", "join_error", "mine", "claim", "want")

    def __init__(self, handle: Handle, src: np.ndarray, dst: np.ndarray, priority: int,
                 divisor: int | None, deadline: float, flags: int = 0,
                 hyper: bytes | None = None):
        self.handle = handle
        self.name = handle.name
        self.src = src.reshape(-1).view(np.uint8)        # bytes to push
        self.dst = dst.reshape(-1)                       # typed, written by results
        self.dtype = dst.dtype
        self.shape = list(dst.shape)
        self.priority = priority
        self.divisor = divisor
        self.remaining = 0
        self.deadline = deadline
        self.parts: list[list[int]] = []
        self.flags = flags
        self.called_ns = self.queued_ns = 0         # traced: when push_pull and the queue saw it
        self.codec: C.WorkerCodec | None = None     # compressed pushes and pulls
        self.hyper = hyper          # asynchronous training: the third frame of every push
        self.once = False           # pushed once (a broadcast): no shared-memory slot
        self.filled: Lease | None = None    # slots the caller filled (src was not)
        self.lend_results = False   # sums in shared memory stay there (Handle.lent)
        self.reduction = P.REDUCE_SUM    # how servers combine the pushes (P.REDUCE_*)
        self.scope: tuple[int, ...] | None = None   # a process set's ranks (None: every worker)
        self.join_error: str | None = None  # fails it if a rank joins first (see join_error)
        # the bytes of src holding this worker's data (push_pull_async's ``mine``): partitions
        # wholly outside go as PUSH_ZERO, naming ``claim`` (a broadcast's root)
        self.mine: list[tuple[int, int]] | None = None
        self.claim = 0
        # the byte ranges of dst the caller reads (push_pull_async's ``want``): partitions
        # wholly outside all of them are answered with the RESULT header alone
        self.want: list[tuple[int, int]] | None = None

    def unwanted(self, part: list[int]) -> bool:
        """Whether the caller reads nothing of partition ``part``'s sum: outside ``want``."""
        if self.want is None:
            return False
        end = part[2] + part[3]
        return not any(start < end and part[2] < stop for start, stop in self.want)

    def zero(self, part: list[int]) -> bool:
        """Whether partition ``part`` goes as a PUSH_ZERO: wholly outside ``mine``."""
        if self.mine is None:
            return False
        end = part[2] + part[3]
        return not any(start < end and part[2] < stop for start, stop in self.mine)


def _ranges(ranges: Any) -> list[Any]:
    """``mine``: one (start, stop) range, or a list of them, as a list."""
    if isinstance(ranges, tuple) and len(ranges) == 2 and \
            all(isinstance(b, (int, np.integer)) for b in ranges):
        return [ranges]
    if isinstance(ranges, (list, tuple)):
        return list(ranges)
    return [ranges]         # refused, naming it, by Worker._check_mine


_WAKE = b"\0"
log = logging.getLogger("bpsctl.worker")


def _divide_bf16(bits: np.ndarray, divisor: int, out: np.ndarray) -> None:
    """out = bits / divisor, for bfloat16 bits, through float32 (as the server sums)."""
    wide = P.bf16_widen(bits, np.empty(len(bits), np.float32))
    np.divide(wide, divisor, out=wide)
    P.bf16_round(wide, np.empty(len(bits), np.uint32), out)


def sum_into(summed: np.ndarray, divisor: int | None, out: np.ndarray) -> None:
    """A partition's sum into its place in the output: copied, or divided by ``divisor`` when
    averaging (bfloat16 through float32, as the server sums). ``summed`` has ``out``'s dtype;
    a caller reading a lent sum (``Handle.lent``) finishes it the same way."""
    if divisor is None:
        np.copyto(out, summed)
    elif out.dtype == P.BFLOAT16:
        _divide_bf16(summed.view(np.uint16), divisor, out.view(np.uint16))
    else:
        np.divide(summed, divisor, out=out)


class Worker:
    """One worker process's connection to a bpsctl cluster (see module docstring)."""

    def __init__(self, config: Config | None = None, *, scheduler: str | None = None,
                 secret: str | None = None):
        if config is None and "DMLC_ROLE" in os.environ:
            # a worker started BytePS's way without bpslaunch (DMLC_ROLE=worker ...)
            from .dmlc import direct_worker_config
            config = direct_worker_config(os.environ)
        if config is None:
            config = Config.from_env(role="worker")
        self.config = config
        if self.config.async_mode:
            check_training_mode(self.config)    # what asynchronous training cannot go with
        self.scheduler_address, self.security = self._locate_cluster(scheduler, secret)
        self.rank = self.config.rank
        self.size = self.config.world_size
        self.live_ranks: list[int] = list(range(self.size))   # fewer once a worker is lost
        # each rank's host as an index, from the scheduler when the job starts (None: not told)
        self.rank_hosts: list[int] | None = None
        self.membership_changes = 0                             # how many times it changed
        # joining a running job (a lost rank restarted by `bpsctl run --max-restarts`, or a
        # new rank from `bpsctl run --attach`): this process waits for a live worker's model
        # (receive_state); as a live worker, the joiners this one hands the model to at its
        # next step boundary (donate)
        self.incarnation = 0                    # > 0: this process restarted a lost rank
        self.joined_running = False             # this process joined a running job ...
        self.joining = False                    # ... and has not received the state yet
        self.pending_joins: list[tuple[int, int]] = []         # (rank, incarnation)
        self._join_payload: memoryview | None = None
        self._joined = threading.Event()
        self._lost_at_start: list[int] = []     # servers already lost when this one joined
        self._job_size = self.size              # the job's world size, whoever is live
        self._spare_servers: set[int] = set()   # indices of the job's spares still holding nothing
        # results of pushes that came after their round was complete (backup workers): those
        # pushes are not in the sums
        self.late_pushes = 0
        # ACKs and results of a round this worker was already answered: dropped
        self.stale_answers = 0
        # each partition's last sum from its server (round, count, dtype code, the frame it
        # came in: kept, not copied), for the server its partitions move to if that one is
        # lost (LAST_SUM): its sum may have reached this worker and not every other
        self._last_sums: dict[int, tuple[int, int, int, zmq.Frame]] = {}
        self._keep_sums = False
        self.local_rank = self.config.local_rank
        self.local_size = self.config.local_size

        # glibc's malloc keeps its default thresholds here (see common.keep_large_buffers);
        # the I/O thread releases what it keeps once quiet (common.release_free_memory)
        self._ctx = zmq.Context(io_threads=self.config.zmq_io_threads)
        self._sched = self._linked_socket()
        self._sched_monitor = monitor(self._sched)
        self._sched.connect(f"tcp://{self.scheduler_address}")
        self._servers: list[dict[str, Any]] = []
        self._server_socks: list[zmq.Socket] = []
        # each server's HELLO, and the logins again of connections that came back (index ->
        # its Login until the server answers; the server counts as down meanwhile)
        self._hellos: list[list[bytes]] = []
        self._relogins: dict[int, Login] = {}
        self._server_monitors: list[zmq.Socket] = []
        self._trace: Trace | None = None        # with BPSCTL_TRACE_DIR; opened once ranked
        self._step_tensor: str | None = None    # traced steps count push_pulls of the first tensor
        self._marked_steps = False              # ... unless a plugin marks them (mark_step)
        self._trace_sent: dict[int, int] = {}   # part id -> ns its traced push left
        self._trace_acked: dict[int, int] = {}  # part id -> ns its ACK came
        # shared memory with the servers on this host (BPSCTL_SHM_SERVER; engine/shmlink.py):
        # this host's id (empty: off), the indices of those servers, this worker's push slots
        # ((server index, part id) -> (REF, view), None when the budget had no room)
        # in segments of its own per server, and the servers' sum buffers it maps
        self._shm_host = shm.host_id() if self.config.shm_server == "auto" else ""
        self._shm_tag = shm.cluster_tag(self.scheduler_address, self.security.secret)
        self._shm_local: set[int] = set()
        self._shm_budget = shmlink.Budget(self.config.shm_server_limit)
        self._shm_slots: dict[int, shmlink.Segments] = {}
        self._shm_parts: dict[tuple[int, int], tuple[bytes, np.ndarray] | None] = {}
        self._shm_sums: dict[int, shmlink.Mapped] = {}
        self._pinning: shmlink.Pinning | None = None    # pin_shared_memory
        self.shm_pushes = self.shm_results = 0      # through shared memory
        self.shm_pushed_bytes = 0
        self.filled_pushes = self.lent_results = 0  # of those: not copied by the engine (lend)
        # bytes pushed to each server of the job (its index), re-pushes included: what the
        # layout's shares (BPSCTL_CPU_SHARE, hosts.yaml's share:) come to on the wire
        self._pushed_bytes: collections.Counter[int] = collections.Counter()
        self._pulled_bytes: collections.Counter[int] = collections.Counter()
        try:
            self._register()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

        # shared with callers
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._signaled = False
        self._lock = threading.Lock()          # guards names in flight and the broken flag
        self._in_flight_names: set[str] = set()
        self._broken: EngineError | None = None
        self._codecs: dict[str, C.WorkerCodec] = {}         # name -> its compression
        # name -> (dtype, shape, compressor) of a solo job's push_pulls
        self._solo_bindings: dict[str, tuple[str, list[int], Any]] = {}
        self._noname_counter = itertools.count()
        self._barrier_counter = itertools.count()
        self._closed = False

        # owned by the I/O thread
        self._tensors: dict[str, dict[str, Any]] = {}         # name -> {key, parts, dtype, shape}
        # name -> (spec, tasks)
        self._awaiting_declare: dict[str, tuple[dict[str, Any], list[_Task]]] = {}
        self._queue: list[tuple[int, int, _Task, list[int]]] = []
        self._seq = itertools.count()
        self._inflight_bytes = 0
        self._unacked: dict[int, int] = {}                     # part id -> bytes
        # the bound on _inflight_bytes: the credit, or the pacing window when the servers
        # sum unequal shares (engine/pacing.py); None: to be worked out again (the servers or
        # their shares changed)
        self._credit: int | None = None
        self._active: dict[int, tuple[_Task, list[int]]] = {}  # part id -> (task, part)
        # (server index, part id) of a process set's partitions whose SCOPE that server has
        self._scoped: set[tuple[int, int]] = set()
        self._rounds: dict[int, int] = {}                      # part id -> round
        self._parts: dict[int, list[int]] = {}                 # part id -> [id, server, ...]
        # servers whose connection dropped: index -> when to give up waiting for the
        # scheduler to move their partitions (failover); and those it moved off
        self._server_down: dict[int, tuple[float, float]] = {}   # index -> (since, give up)
        self._servers_lost: set[int] = set(self._lost_at_start)
        self._join_waiting: list[_Task] = []    # push_pulls called before the model came
        self._parked: list[tuple[int, int, _Task, list[int]]] = []   # pushes for a down one
        # ADMITs for servers whose connection was down when this worker donated: sent first
        # once it is back (index -> messages)
        self._owed_admits: dict[int, list[list[bytes]]] = {}
        self._tasks: set[_Task] = set()
        self._barriers: dict[str, Handle] = {}
        self._barriers_passed = 0               # told to a restarted scheduler
        self._peer_left = ""                                    # why later ops cannot complete
        self._died = ""                 # the uncaught exception the process is dying of
        self._stop = False
        # a lost scheduler (docs/design.md, "Keeping going", item 4): since when; the
        # re-registration with the one restarted in its place; what waits to be said to it
        # (JOIN_DONE, LEAVE; declarations and barriers are asked again from their records);
        # what a restarted scheduler needs to hear: ranks that left, incarnations of others
        self._sched_gone: float | None = None
        self._sched_login: Login | None = None
        self._sched_outbox: list[list[bytes]] = []
        self._leaving = False                   # shutdown waits to say LEAVE to it
        self._left_ranks: set[int] = set()
        self._incarnations: dict[int, int] = {}
        # Horovod's join (:meth:`join`): the ranks the scheduler said have joined (read by
        # callers: a new frozenset each time), this worker's own join while it waits (to be
        # sent once nothing is in flight, then answered), the last rank to join, and the
        # push_pulls completed (heartbeats carry the count: the others' join waits on progress)
        self.joined_ranks: frozenset[int] = frozenset()
        self._hvd_join: Handle | None = None
        self._hvd_join_sent = False
        self._hvd_join_last = -1
        self._ops_done = 0
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[], None]] = {}

        self._thread = threading.Thread(target=self._io_loop, name=f"bps-worker-{self.rank}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ startup

    def _locate_cluster(self, scheduler: str | None, secret: str | None) -> tuple[str, Security]:
        """The scheduler's address, secret and security mode: arguments, then config, then
        `bpsctl up`'s state."""
        address = scheduler or self.config.scheduler
        secret = secret if secret is not None else self.config.secret
        mode = self.config.security
        if not address:
            state_file = self.config.state_dir / "cluster.json"
            try:
                state = json.loads(state_file.read_text())
                address = state["scheduler"]
                secret = secret or state.get("secret", "")
                mode = state.get("security", mode)
            except FileNotFoundError:
                raise EngineError("no scheduler to connect to: BPSCTL_SCHEDULER is not set and no "
                                  f"cluster is recorded in {state_file}. Start one with "
                                  "`bpsctl up`, or launch this script with `bpsctl run`") from None
            except (ValueError, KeyError, TypeError) as exc:
                raise EngineError(f"cannot read the cluster state in {state_file}: {exc}; "
                                  "run `bpsctl down` and `bpsctl up` again") from None
        return address, Security(mode, secret)

    def _linked_socket(self, affinity: int = 0) -> zmq.Socket:
        """A DEALER whose connection drops (and is reported) when its link goes silent;
        ``affinity``: the ZeroMQ I/O threads its connections may use (a bitmask, 0: any)."""
        sock = make_socket(self._ctx, zmq.DEALER)
        sock.setsockopt(zmq.AFFINITY, affinity)
        watch_link(sock, self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s)
        self.security.protect_connecting(sock)
        return sock

    def _register(self) -> None:
        cfg = self.config
        where = f"the scheduler at {self.scheduler_address}"
        register = {
            "role": "worker", "rank": cfg.rank, "world_size": cfg.world_size, "job": cfg.job_id,
            "host": cfg.host, "host_id": shm.host_id(), "pid": os.getpid(),
            "version": __version__, "num_servers": cfg.num_servers,
            "cpu_share": cfg.cpu_share_value,
            "partition_bytes": cfg.partition_bytes, "partition_depth": cfg.partition_depth,
            "start_timeout_s": cfg.start_timeout_s,
            "min_workers": cfg.min_workers, "max_workers": cfg.max_workers,
            "rejoin": cfg.rejoin, "attach": cfg.attach}
        # stamped as it leaves: the registration is also a clock exchange (for traces)
        login = self.security.login(self._sched, lambda: P.control(P.REGISTER, {
            **register, "clock_ns": now_ns()}), where)
        clock: dict[str, int] | None = None
        # the scheduler enforces the start timeout and names missing ranks; our own deadline
        # (a little later) is a backstop for a scheduler that never answers
        start = time.monotonic()
        connect_deadline = start + cfg.start_timeout_s
        reply_deadline = connect_deadline + 2 * cfg.heartbeat_interval_s + 1
        next_heartbeat = start + cfg.heartbeat_interval_s
        connected = False
        while True:
            now = time.monotonic()
            if now >= reply_deadline or (not connected and now >= connect_deadline):
                break
            events = monitor_events(self._sched_monitor)
            if handshake_failed(events):
                raise EngineError(f"rank {cfg.rank}: {refused_handshake(where, self.security)}")
            connected |= zmq.EVENT_CONNECTED in events
            if zmq.EVENT_DISCONNECTED in events:
                raise EngineError(lost_link(f"the scheduler at {self.scheduler_address}",
                                            cfg.heartbeat_timeout_s) + " during registration")
            if now >= next_heartbeat and connected:
                self._sched.send_multipart(P.control(P.HEARTBEAT))
                next_heartbeat = now + cfg.heartbeat_interval_s
            if not self._sched.poll(50, zmq.POLLIN):
                continue
            try:
                msg_type, msg = P.parse_control(self._sched.recv_multipart())
                received_ns = now_ns()
            except P.ProtocolError as exc:
                raise EngineError(f"rank {cfg.rank}: {where} answered with a bad message: "
                                  f"{exc}") from None
            if self._answer(login, msg_type, msg):
                continue
            if msg_type == P.ERROR:
                error = JobFinished if msg.get("finished") is True else EngineError
                raise error(f"rank {cfg.rank}: {msg.get('message')}")
            if msg_type == P.MEMBER_LOST and msg.get("role") == "worker":
                # the scheduler has dropped the job: it can never start
                raise EngineError(f"rank {cfg.rank}: {msg.get('message')} before the job started")
            if msg_type == P.REGISTERED:
                self.rank = int(msg["rank"])
                self.size = self._job_size = int(msg["world_size"])
                self.live_ranks = list(range(self.size))
                self._servers = msg["servers"]
                self._spare_servers = {int(i) for i in msg.get("spares", [])}
                hosts = msg.get("hosts")
                self.rank_hosts = [int(h) for h in hosts] if isinstance(hosts, list) and \
                    len(hosts) == self.size else None
                if msg.get("joining"):      # live ones, and this one once it is admitted
                    self.joining, self.incarnation = True, int(msg["incarnation"])
                    self.joined_running = True
                    self.live_ranks = sorted({*map(int, msg["live"]), self.rank})
                    self.size = len(self.live_ranks)
                    self._lost_at_start = [int(i) for i in msg.get("lost_servers", [])]
                clock = scheduler_clock(msg, received_ns)
                break
        if not self._servers:
            if not connected:
                raise EngineError(f"cannot reach the scheduler at {self.scheduler_address} within "
                                  f"{cfg.start_timeout_s:g} s: nothing is listening there. Start a "
                                  "cluster with `bpsctl up` (or set BPSCTL_SCHEDULER to a running "
                                  "scheduler's host:port)")
            raise EngineError(f"the scheduler at {self.scheduler_address} did not start the job "
                              f"within {cfg.start_timeout_s:g} s (BPSCTL_START_TIMEOUT)")
        self._keep_sums = cfg.server_failover and not cfg.async_mode and \
            not cfg.backup_workers and len(self._servers) > 1
        # pushes of a host-reduced partition per round: one per host (see push_pull_async)
        self.hosts = self.size // self.local_size if self.size % self.local_size == 0 else self.size
        self.solo = solo_job(cfg, self.size, self.joined_running)
        hello_body: dict[str, Any] = {"job": cfg.job_id, "rank": self.rank,
                                      "world_size": self.size, "hosts": self.hosts,
                                      "version": __version__, "incarnation": self.incarnation,
                                      "backup_workers": cfg.backup_workers,
                                      "max_workers": cfg.max_workers}
        if cfg.trace_dir:
            self._trace = self._open_trace(Path(cfg.trace_dir))
            self._trace.scheduler_clock = best_clock(clock, measure_clock(
                self._ctx, self.scheduler_address, self.security))
            hello_body["trace_dir"] = str(Path(cfg.trace_dir).resolve())    # servers trace too
        hello = P.control(P.HELLO, hello_body)
        logins = []
        for index, server in enumerate(self._servers):
            sock = self._linked_socket(io_thread_affinity(index, self.config.zmq_io_threads))
            self._server_monitors.append(monitor(sock))
            self._server_socks.append(sock)
            if index in self._lost_at_start:
                self._hellos.append(hello)
                continue                    # its partitions live on other servers now
            sock.connect(f"tcp://{server['host']}:{server['port']}")
            local = bool(self._shm_host) and server.get("host_id") == self._shm_host
            if local:       # same machine, network namespace and /dev/shm: shared memory
                self._shm_local.add(index)
            self._hellos.append(P.control(P.HELLO, {**hello_body, "shm": self._shm_host})
                                if local else hello)
            logins.append(self.security.login(sock, self._hellos[-1], self._server_name(index)))
        self._await_logins(logins, time.monotonic() + cfg.start_timeout_s)

    def _open_trace(self, directory: Path) -> Trace:
        path = directory / f"worker-{self.rank}" / "comm.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK):
                raise PermissionError(f"cannot write to {path.parent}")
        except OSError as exc:
            raise EngineError(f"BPSCTL_TRACE_DIR: cannot write traces under {directory}: "
                              f"{exc.strerror or exc}; choose a writable directory") from None
        cfg = self.config
        trace = Trace(path, "worker", self.rank, start_step=cfg.trace_start_step,
                      end_step=cfg.trace_end_step or None)
        warning = attach_nic(trace, cfg.trace_nic, cfg.host, cfg.nic_mbit)
        if warning:
            log.warning("rank %d: %s", self.rank, warning)
        return trace

    def _answer(self, login: Login, msg_type: int, msg: dict[str, Any]) -> bool:
        try:
            return login.handle(msg_type, msg)
        except EngineError as exc:
            raise EngineError(f"rank {self.config.rank}: {exc}") from None

    def _await_logins(self, logins: list[Login], deadline: float) -> None:
        """Finish the handshake with every server before the first push (hmac mode). The job
        has started: heartbeats go on meanwhile, or a slow handshake (servers busy on a loaded
        machine) would have the scheduler declare this worker lost before its first push."""
        interval = self.config.heartbeat_interval_s
        next_heartbeat = time.monotonic() + interval
        while not all(login.done for login in logins):
            pending = [login for login in logins if not login.done]
            now = time.monotonic()
            if now >= next_heartbeat:
                self._sched.send_multipart(P.control(P.HEARTBEAT))
                next_heartbeat = now + interval
            if now > deadline:
                raise EngineError(f"rank {self.rank}: {pending[0].peer} did not answer the "
                                  f"security handshake within {self.config.start_timeout_s:g} s "
                                  "(BPSCTL_START_TIMEOUT)")
            for login in pending:
                if not login.sock.poll(10, zmq.POLLIN):
                    continue
                try:
                    msg_type, msg = P.parse_control(login.sock.recv_multipart())
                except P.ProtocolError as exc:
                    raise EngineError(f"rank {self.rank}: {login.peer} answered with a bad "
                                      f"message: {exc}") from None
                if not self._answer(login, msg_type, msg) and msg_type == P.ERROR:
                    raise EngineError(f"rank {self.rank}: {msg.get('message')}")

    # ------------------------------------------------------------------ caller API

    def push_pull_async(self, array: Any, name: str | None = None, average: bool = True,
                        priority: int = 0, out: np.ndarray | None = None, *,
                        host_reduced: bool = False,
                        compression: C.Compressor | None = None,
                        async_update: tuple[float, float, float, float, bool] | None = None,
                        async_init: bool = False, once: bool = False,
                        filled: Lease | None = None, lend_results: bool = False,
                        reduction: int = P.REDUCE_SUM,
                        ranks: tuple[int, ...] | None = None,
                        join_error: str | None = None,
                        mine: tuple[int, int] | Sequence[tuple[int, int]] | None = None,
                        root: int | None = None,
                        want: Sequence[tuple[int, int]] | None = None) -> Handle:
        """Start summing ``array`` across all workers; the result lands in ``out``.

        ``ranks`` (sorted, this worker's among them): a process set's push_pull, summed over
        those workers only (the others do not take part and are not waited for); its name
        is bound to that set (a process set's names are its own, see
        :mod:`bpsctl.engine.process_sets`). Not host-reduced, asynchronous or backed up.

        ``mine=(start, stop)`` (or a list of such ranges): only bytes ``start:stop`` of
        ``array`` hold this worker's
        data, every other byte being zero (a gather's buffer: each rank's rows at their
        offset): each partition wholly outside that range goes as a PUSH_ZERO, a header
        without its bytes, so a gather pushes about this rank's bytes, not the whole buffer.
        A plain sum only (no compression, other reduction, intra-node or asynchronous push).

        ``root=r``: a broadcast of rank ``r``'s ``array``, which ``out`` receives on every
        worker (``array`` is read on the root only; ``average=False``). The other workers
        push only PUSH_ZERO headers naming ``r``; if the workers name different roots (or a
        root that pushed nothing), every one of them fails with an error naming the roots.
        A name keeps being a broadcast (its reduction).

        ``want=[(start, stop), ...]``: the byte ranges of ``out`` the caller reads (an
        alltoall's rows sent to this rank); a partition wholly outside all of them is answered
        with its RESULT header alone, and its bytes of ``out`` are left as they were. A plain
        sum only, as ``mine``.

        ``reduction`` (``P.REDUCE_MIN``, ``REDUCE_MAX``, ``REDUCE_PRODUCT``): the servers
        combine the workers' arrays elementwise that way instead of summing them; such a
        push_pull is neither averaged, compressed, host-reduced nor asynchronous, and a name
        keeps the reduction of its first push_pull.

        ``once=True``: the name is pushed this once (a broadcast, whose names are new each
        time or never come again): to a server on this host it goes through TCP, not a
        shared-memory slot, which would stay reserved for the rest of the job.

        ``filled``: the name's slots from :meth:`lend`, which the caller has filled with this
        push's bytes (``array``'s contents are then not read). ``lend_results=True``: each
        partition whose sum arrives in shared memory is not copied into ``out`` but listed in
        the handle's ``lent`` (byte offset, read-only view, divisor to apply or None); a view
        stays valid until the name's next push_pull starts.

        ``host_reduced=True`` (the intra-node stage): ``array`` already holds the sum over this
        host's workers, and only one worker per host pushes this name; the sum is over hosts.
        ``compression``: pushes and pulls travel compressed (:mod:`.compression`), unless the
        tensor is smaller than ``min_compress_bytes``.

        Asynchronous training (``BPSCTL_ASYNC``; float32 or float64, uncompressed): the servers
        hold the tensor as parameters, and ``out`` receives them (``average`` does not apply).
        ``async_init=True``: ``array`` is this worker's parameter values, the first push of the
        name; the first worker's to arrive sets the servers' parameters, and every worker gets
        them back. ``async_update=(lr, momentum, weight_decay, dampening, nesterov)``:
        ``array`` is a gradient, which each server applies to its parameters at once as one
        step of ``torch.optim.SGD`` with these hyperparameters, whatever the other workers do;
        ``out`` gets the parameters after it. A push the servers have already applied (the
        same push sent again) is answered, not applied twice.

        ``join_error``: the push_pull cannot take zeros for a rank that has joined (a gather,
        a broadcast: Horovod refuses them after ``join()``); it fails with this message if a
        rank has joined, at once or when the scheduler says so while it is in flight.
        """
        if join_error is not None and self.joined_ranks:
            raise HorovodInternalError(f"{join_error} (rank(s) {sorted(self.joined_ranks)} "
                                       "joined)")
        src = np.asarray(array)
        self.check_push(src.dtype, average, name)
        if root is not None:
            self._check_root(root, name, mine, reduction)
            reduction, mine = P.REDUCE_BROADCAST, None if root == self.rank else (0, 0)
        elif reduction == P.REDUCE_BROADCAST:
            raise ValueError(f"push_pull of {name!r}: a broadcast names its root: pass "
                             "root=RANK instead of the reduction")
        if reduction != P.REDUCE_SUM:
            self._check_reduction(reduction, name, average, host_reduced, compression,
                                  async_update is not None or async_init)
        owned = None
        if mine is not None:
            owned = [self._check_mine(r, src.nbytes, name, reduction, host_reduced, compression,
                                      async_update is not None or async_init)
                     for r in _ranges(mine)]
        wanted = None
        if want is not None:
            if reduction != P.REDUCE_SUM:
                raise ValueError(f"push_pull of {name!r}: want= goes with a plain sum only, "
                                 f"not a {P.REDUCTIONS.get(reduction, reduction)}")
            wanted = [self._check_mine(r, src.nbytes, name, reduction, host_reduced,
                                       compression, async_update is not None or async_init,
                                       "want") for r in want]
        if not src.flags.c_contiguous:
            src = np.ascontiguousarray(src)
        if out is None:
            out = np.empty_like(src)
        elif out.shape != src.shape or out.dtype != src.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {src.dtype} array of shape {src.shape}, "
                             f"got {out.dtype} {out.shape}")
        elif not out.flags.writeable:
            # caught here, not when the I/O thread writes the result (that would break the engine)
            raise ValueError(f"out must be writable, got a read-only array for {name!r}")
        # an average divides each partition's sum by the count of pushes its server says it
        # holds (fewer than size() after a loss), even where this worker counts one worker
        # now: a worker that rejoined after a loss may already have pushed into this round
        divisor = self.size if average else None
        flags = (P.FLAG_HOST_REDUCED if host_reduced
                 # averages may go without the backup workers' pushes; sums may not
                 else P.FLAG_BACKUP if average and self.config.backup_workers else 0)
        if ranks is not None:
            ranks = tuple(ranks)
            self._check_scope(ranks, name, host_reduced, async_update is not None or async_init)
            divisor, flags = (len(ranks) if average else None), 0
        hyper = None
        if async_update is not None or async_init:
            flags, hyper = self._async_flags(src, name, async_update, async_init, host_reduced,
                                             compression)
            divisor = None                  # the answer is the parameters, not a sum
        if name is None:
            name = f"push_pull.noname.{next(self._noname_counter)}"
        handle = Handle(name, out)
        self._check_open()
        if self.solo:
            # one worker: the sum is the tensor itself, and nothing travels
            handle.error = self.check_solo_binding(
                name, src.dtype, list(src.shape),
                compression if src.nbytes >= self.config.min_compress_bytes else None)
            if root is not None and root != self.rank and handle.error is None:
                handle.error = ValueError(f"broadcast {name!r}: root {root} is not a rank of "
                                          f"this one-worker job (rank {self.rank})")
            if handle.error is None and not np.shares_memory(src, out):
                np.copyto(out, src)
            handle._set_done()
            return handle
        with self._lock:
            if name in self._in_flight_names:
                raise ValueError(f"a push_pull of {name!r} is already in flight; synchronize it "
                                 "before starting another with the same name")
            self._in_flight_names.add(name)
        task = _Task(handle, src, out, priority, divisor,
                     time.monotonic() + self.config.op_timeout_s, flags, hyper)
        task.once, task.reduction, task.scope = once, reduction, ranks
        task.join_error = join_error
        task.mine, task.claim = owned, self.rank if root is None else int(root)
        task.want = wanted
        if compression is None and hyper is None:
            task.filled, task.lend_results = filled, lend_results
        elif filled is not None:
            with self._lock:
                self._in_flight_names.discard(name)
            raise ValueError(f"push_pull of {name!r}: filled slots go with neither compression "
                             "nor asynchronous training (lend() offers none then)")
        if compression is not None and src.nbytes >= self.config.min_compress_bytes:
            try:
                task.codec = self._codec(name, src, compression)
            except ValueError:
                with self._lock:
                    self._in_flight_names.discard(name)
                raise
            previous, task.codec.handle = task.codec.handle, handle
            if previous is not None:        # finished, perhaps never waited for: its sums
                previous._finish_decompressing()    # land before this op's
            handle._compressed()
            # compressed here, in the caller's thread (NumPy lets go of the GIL), so the I/O
            # thread only sends; the first push of a tensor, not yet declared, is compressed
            # there. Safe: the name's previous push_pull, and so its last round, is finished
            info = self._tensors.get(name)
            if info is not None and info["dtype"] == str(src.dtype) and \
                    info["shape"] == task.shape:
                for part_id, _, offset, length in info["parts"]:
                    task.codec.encode(task.src, part_id, offset, length,
                                      self._rounds.get(part_id, 0))
        if self._trace is not None:
            task.called_ns = now_ns()
        self._command("task", task)
        return handle

    def _check_open(self) -> None:
        """Raise what broke the engine, or that it was shut down."""
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._closed:
                raise EngineError("the engine is shut down; call init() again")

    def push_pull(self, array: Any, name: str | None = None, average: bool = True,
                  priority: int = 0, out: np.ndarray | None = None, *,
                  compression: C.Compressor | None = None,
                  async_update: tuple[float, float, float, float, bool] | None = None,
                  async_init: bool = False, reduction: int = P.REDUCE_SUM,
                  ranks: tuple[int, ...] | None = None,
                  mine: tuple[int, int] | Sequence[tuple[int, int]] | None = None,
                  root: int | None = None, once: bool = False,
                  want: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        return self.synchronize(self.push_pull_async(array, name, average, priority, out,
                                                     compression=compression,
                                                     async_update=async_update,
                                                     async_init=async_init,
                                                     reduction=reduction, ranks=ranks,
                                                     mine=mine, root=root, once=once,
                                                     want=want))

    @staticmethod
    def _check_root(root: Any, name: str | None, mine: Any, reduction: int) -> None:
        """ValueError naming what is wrong with a broadcast's ``root``."""
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or \
                not 0 <= root < P.MAX_WORKERS:
            raise ValueError(f"broadcast {name!r}: root {root!r} is not a rank; pass the rank "
                             "(an int) whose array every worker receives")
        if mine is not None or reduction != P.REDUCE_SUM:
            raise ValueError(f"broadcast {name!r}: root= goes with neither mine= nor "
                             "reduction= (the root pushes everything, the others nothing)")

    @staticmethod
    def _check_mine(mine: Any, nbytes: int, name: str | None, reduction: int,
                    host_reduced: bool, compression: C.Compressor | None,
                    asynchronous: bool, what: str = "mine") -> tuple[int, int]:
        """``mine`` (or a range of ``want``: ``what``), a byte range of a sum, as two ints;
        ValueError naming what is wrong with it."""
        try:
            start, stop = (int(b) for b in mine)
        except (TypeError, ValueError):
            raise ValueError(f"push_pull of {name!r}: {what} must be (start, stop), byte "
                             f"offsets into the array, got {mine!r}") from None
        if not 0 <= start <= stop <= nbytes:
            raise ValueError(f"push_pull of {name!r}: {what}=({start}, {stop}) is not a byte "
                             f"range within the array's {nbytes} bytes")
        for wrong, why in [(reduction not in P.ZERO_REDUCTIONS,
                            f"reduced by {P.REDUCTIONS.get(reduction)}"),
                           (host_reduced, "host-reduced"),
                           (compression is not None, f"compressed ({compression})"),
                           (asynchronous, "asynchronous training")]:
            if wrong:
                raise ValueError(f"push_pull of {name!r} with {what}= cannot be {why}: "
                                 f"{what} applies to a plain sum only")
        return start, stop

    @staticmethod
    def _check_reduction(reduction: int, name: str | None, average: bool, host_reduced: bool,
                         compression: C.Compressor | None, asynchronous: bool) -> None:
        """ValueError naming what a push_pull reduced other than by a sum cannot be."""
        what = P.REDUCTIONS.get(reduction)
        if what is None:
            raise ValueError(f"push_pull of {name!r}: unknown reduction {reduction!r}; use one "
                             f"of {sorted(P.REDUCTIONS)} ({', '.join(P.REDUCTIONS.values())})")
        for wrong, why in [(average, "averaged"), (host_reduced, "host-reduced"),
                           (compression is not None, f"compressed ({compression})"),
                           (asynchronous, "asynchronous training")]:
            if wrong:
                raise ValueError(f"push_pull of {name!r} by {what} cannot be {why}: only sums "
                                 "are; push it with average=False and no compression")

    def _check_scope(self, ranks: tuple[int, ...], name: str | None, host_reduced: bool,
                     asynchronous: bool) -> None:
        """ValueError naming what a process set's push_pull (``ranks``) cannot be."""
        if self.rank not in ranks:
            raise ValueError(f"push_pull of {name!r}: this worker (rank {self.rank}) is not one "
                             f"of the process set's ranks {list(ranks)}")
        if host_reduced or asynchronous:
            raise ValueError(f"push_pull of {name!r} over process set {list(ranks)} cannot be "
                             f"{'host-reduced' if host_reduced else 'asynchronous training'}: "
                             "each rank of the set pushes its own tensor")

    def _async_flags(self, src: np.ndarray, name: str | None,
                     update: tuple[float, float, float, float, bool] | None, init: bool,
                     host_reduced: bool, compression: C.Compressor | None
                     ) -> tuple[int, bytes | None]:
        """The flags and hyperparameter frame of a push of asynchronous training; ValueError
        or TypeError naming what it cannot be."""
        what = f"asynchronous training (BPSCTL_ASYNC) of {name!r}"
        if not self.config.async_mode:
            raise ValueError(f"{what}: this worker's job is not asynchronous; set BPSCTL_ASYNC=1 "
                             "(`bpsctl run --async`) for every worker of the job")
        if update is not None and init:
            raise ValueError(f"{what}: a push is either the init push of the parameters "
                             "(async_init) or a gradient (async_update), not both")
        if compression is not None:
            raise ValueError(f"{what} with compression {compression}: servers apply each "
                             "gradient as it comes and send the parameters back whole; push it "
                             "uncompressed, or train synchronously to compress")
        if host_reduced:
            raise ValueError(f"{what}: every worker pushes its own gradient (no intra-node "
                             "stage)")
        if src.dtype not in (np.float32, np.float64):
            raise TypeError(f"{what}: servers hold float32 or float64 parameters, got "
                            f"{src.dtype}")
        if update is None:
            return P.FLAG_ASYNC | P.FLAG_ASYNC_INIT, None
        if len(update) != 5:
            raise ValueError(f"{what}: async_update must be (lr, momentum, weight_decay, "
                             f"dampening, nesterov), got {update!r}")
        lr, momentum, weight_decay, dampening = map(float, update[:4])
        nesterov = bool(update[4])
        if not all(map(math.isfinite, (lr, momentum, weight_decay, dampening))):
            raise ValueError(f"{what}: async_update must be (lr, momentum, weight_decay, "
                             f"dampening, nesterov) with finite numbers, got {update!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{what}: Nesterov momentum needs a momentum and zero dampening "
                             f"(as torch.optim.SGD), got momentum {momentum:g}, dampening "
                             f"{dampening:g}")
        return P.FLAG_ASYNC, P.ASYNC_HYPER.pack(lr, momentum, weight_decay, dampening, nesterov)

    def _codec(self, name: str, src: np.ndarray, compression: C.Compressor) -> C.WorkerCodec:
        """The tensor's compression state (its residual lives from one push_pull to the next)."""
        C.check_tensor(compression, src.dtype, name)
        with self._lock:
            codec = self._codecs.get(name)
            if codec is None:
                codec = self._codecs[name] = C.WorkerCodec(compression, src.dtype, src.size,
                                                           self.rank)
        if codec.compressor != compression:
            raise ValueError(f"compression: tensor {name!r} was pushed with "
                             f"{codec.compressor}, now with {compression}; use another name "
                             "for another compression")
        return codec

    @staticmethod
    def check_push(dtype: Any, average: bool, name: str | None) -> None:
        """TypeError for a push_pull no job can do: a dtype the wire does not carry (naming
        those it does), or an average of integers."""
        P.dtype_code(np.dtype(dtype))
        if average and np.dtype(dtype).kind != "f" and np.dtype(dtype) != P.BFLOAT16:
            raise TypeError(f"average=True needs a floating-point tensor, got {np.dtype(dtype)} "
                            f"for {name!r}; pass average=False to sum")

    def check_solo_binding(self, name: str, dtype: Any, shape: list[int],
                           compression: C.Compressor | None = None) -> ValueError | None:
        """A job of one worker (:attr:`solo`) declares nothing and compresses nothing, yet a
        name stays bound to the dtype, shape and compressor of its first push_pull as in any
        job: the error a push_pull of ``name`` gets if one of those differs (or the compressor
        cannot take the dtype), else None; the first one binds the name."""
        if compression is not None:
            try:
                C.check_tensor(compression, np.dtype(dtype), name)
            except (TypeError, ValueError) as exc:
                return ValueError(str(exc))
        with self._lock:
            bound = self._solo_bindings.setdefault(name, (str(dtype), shape, compression))
        if bound[:2] != (str(dtype), shape):
            return ValueError(f"tensor {name!r} was declared as {bound[0]}{tuple(bound[1])} but "
                              f"push_pull got {dtype}{tuple(shape)}; use another name for "
                              "another tensor")
        if bound[2] != compression:
            return ValueError(f"compression: tensor {name!r} was pushed with {bound[2]}, now "
                              f"with {compression}; use another name for another compression")
        return None

    def lend(self, name: str, nbytes: int) -> Lease | None:
        """The push slots of ``name`` (``nbytes`` bytes), for a caller that copies the next
        push into them itself (a GPU straight into page-locked shared memory): a
        :class:`Lease` when every partition of the name goes to a server on this host through
        a slot it already has (so from the name's second push on) and the name is not in
        flight; None otherwise (push ``array`` as usual). Safe from any thread; if a partition
        moves meanwhile (a lost server), the push still sends what the caller filled."""
        info = self._tensors.get(name)
        if info is None or self.solo or self.config.async_mode:
            return None
        with self._lock:
            if name in self._in_flight_names:
                return None
        lease, total = Lease(name), 0
        for part_id, server, offset, length in list(info["parts"]):
            slot = self._shm_parts.get((server, part_id))
            if slot is None or part_id in self._active or server in self._server_down:
                return None
            lease.slots[part_id] = slot
            lease.views.append((offset, length, slot[1]))
            total += length
        return lease if total == nbytes and lease.views else None

    def pin_shared_memory(self, pinning: shmlink.Pinning) -> None:
        """Page-lock this worker's shared memory with the servers on its host for a device
        (see engine/shmlink.py): what is there now and what comes later, on the I/O thread."""
        self._command("pin", pinning)

    def poll(self, handle: Handle) -> bool:
        return handle.done()

    def synchronize(self, handle: Handle, timeout_s: float | None = None) -> np.ndarray:
        # the I/O thread fails overdue tasks itself; this backstop covers a dead I/O thread
        limit = timeout_s if timeout_s is not None else self.config.op_timeout_s + 10
        return handle.wait(limit)

    def declare(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        """Declare a tensor ahead of its first push_pull (optional; saves a round trip later)."""
        spec = {"name": name, "dtype": str(np.dtype(dtype)), "shape": [int(d) for d in shape]}
        self._command("declare", spec)

    def barrier(self, timeout_s: float | None = None) -> None:
        """Wait until every worker of the job has called barrier()."""
        name = f"barrier.{next(self._barrier_counter)}"
        handle = Handle(name, np.empty(0))
        self._command("barrier", handle)
        handle.wait(timeout_s if timeout_s is not None else self.config.op_timeout_s)

    def join(self) -> int:
        """Horovod's join: this worker has no more data. Blocks until every live worker has
        joined, and returns the rank that joined last (the same on every worker).

        It first waits for this worker's push_pulls in flight (each within its op deadline),
        then tells the scheduler, which tells the other workers and then the servers: from
        then on every round counts this rank as zeros (an average still divides by every
        rank, as Horovod's), so the others go on with push_pulls. Once every live worker has
        joined, the servers stop, and each worker takes up the partitions' rounds where the
        job is (rounds this one sat out included), so training goes on exactly.

        Deadline: the scheduler fails the job (every worker's join() and push_pulls raise)
        when no worker that has not joined completes a push_pull for ``BPSCTL_OP_TIMEOUT``,
        the deadline a push_pull waiting for them would have; a lost worker counts as joined
        (``--min-workers``) or ends the job. Refused (EngineError) under asynchronous
        training, whose pushes are not rounds, and with backup workers, whose rounds may
        complete without any worker's push."""
        cfg = self.config
        for wrong, why in [(cfg.async_mode, "asynchronous training (BPSCTL_ASYNC) has no "
                            "rounds a joined rank could add zeros to"),
                           (cfg.backup_workers > 0, f"backup workers "
                            f"(BPSCTL_BACKUP_WORKERS={cfg.backup_workers}) already let rounds "
                            "complete without some workers")]:
            if wrong:
                raise EngineError(f"worker {self.rank}: join(): {why}; train without it, or "
                                  "give every rank the same number of batches")
        self._check_open()
        if self.solo:
            return self.rank
        handle = Handle("join", np.empty(0))
        self._command("hvd_join", handle)
        # no deadline of its own: the scheduler's (see above) and losing it end the wait
        while not handle._done.wait(1.0):
            if not self._thread.is_alive():
                raise EngineError(f"worker {self.rank}: the engine stopped during join()")
        if handle.error is not None:
            raise handle.error
        return self._hvd_join_last

    def donate(self, rank: int, incarnation: int, state: bytes | memoryview,
               timeout_s: float | None = None) -> None:
        """Hand a rejoining worker (one of :attr:`pending_joins`) the job's state at a step
        boundary, with no push_pull in flight: every server counts its pushes from the next
        round on, and ``state`` (the model, as the plugin packs it) reaches it through one
        server. Call it before starting the next step's push_pulls."""
        handle = Handle(f"donate.{rank}", np.empty(0))
        self._command("donate", (handle, rank, incarnation, state))
        handle.wait(timeout_s if timeout_s is not None else self.config.op_timeout_s)

    def receive_state(self, timeout_s: float | None = None) -> memoryview:
        """A rejoining worker: wait for the state a live worker hands it (see :meth:`donate`)
        and join the job's rounds. Push_pulls called before wait for it too."""
        if not self.joining and self._join_payload is None:
            raise EngineError(f"worker {self.rank} did not rejoin a running job: it has no "
                              "state to receive")
        limit = timeout_s if timeout_s is not None else max(self.config.op_timeout_s,
                                                             self.config.start_timeout_s)
        if not self._joined.wait(limit):
            raise EngineError(f"worker {self.rank}: no live worker handed over the model within "
                              f"{limit:g} s of rejoining (BPSCTL_OP_TIMEOUT); the others may be "
                              "stuck in a step")
        with self._lock:
            if self._broken is not None:
                raise self._broken
        assert self._join_payload is not None
        return self._join_payload

    def stats(self) -> dict[str, Any]:
        """Counters of this worker's engine: ``late_pushes`` (pushes that came after their
        round was complete, under backup workers: not in the sums, answered with the round's
        result), ``stale_answers`` (ACKs and results of a round already answered, after a
        connection came back: dropped), ``membership_changes``, ``live_ranks``, and
        ``shm_pushes`` and ``shm_results``: pushes and results that went through shared
        memory to and from servers on this host (BPSCTL_SHM_SERVER), ``shm_pushed_bytes``:
        the bytes of those pushes, ``filled_pushes`` and ``lent_results``: of those, the
        pushes whose slot the caller had filled and the results it read where they arrived
        (:meth:`lend`; a GPU's copies, none by the engine), and ``servers``: the job's
        servers (``rank``, ``host``, ``share`` of the bytes, ``pushed_bytes``: what this
        worker pushed to it, uncompressed, re-pushes included, ``pulled_bytes``: the sums it
        answered with, uncompressed; a RESULT's header alone counts nothing)."""
        return {"late_pushes": self.late_pushes, "stale_answers": self.stale_answers,
                "membership_changes": self.membership_changes,
                "live_ranks": list(self.live_ranks), "shm_pushes": self.shm_pushes,
                "shm_results": self.shm_results, "shm_pushed_bytes": self.shm_pushed_bytes,
                "filled_pushes": self.filled_pushes, "lent_results": self.lent_results,
                "servers": [{"rank": s["rank"], "host": s["host"], "share": s.get("share"),
                             "pushed_bytes": self._pushed_bytes[index],
                             "pulled_bytes": self._pulled_bytes[index]}
                            for index, s in enumerate(self._servers)]}

    def mark_step(self) -> None:
        """A training step ended (the plugins' optimizers say so): from now on the traced
        window counts these instead of push_pulls of the first tensor."""
        if self._trace is not None:
            self._command("step", now_ns())     # the step ends now, not when the I/O thread hears

    def start_trace(self, path: Path) -> None:
        """Start recording this worker's trace now, to be written to ``path`` at
        :meth:`stop_trace` or shutdown (Horovod's ``start_timeline``). The worker's spans
        only: servers trace when told at registration (``BPSCTL_TRACE_DIR``). EngineError if
        this worker is tracing already."""
        if self._trace is not None:
            raise EngineError(f"worker {self.rank}: a trace is being recorded already (to "
                              f"{self._trace.path}); stop it first, or unset BPSCTL_TRACE_DIR")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._trace = Trace(path, "worker", self.rank)      # the I/O thread records from now

    def stop_trace(self, timeout_s: float | None = None) -> None:
        """Stop the trace :meth:`start_trace` started and write it (on the I/O thread, which
        records into it; waited for within the op timeout). Nothing if none is recording."""
        if self._trace is None:
            return
        handle = Handle("stop_trace", np.empty(0))
        self._command("stop_trace", handle)
        handle.wait(timeout_s if timeout_s is not None else self.config.op_timeout_s)

    def trace_span(self, stage: str, name: str, start_ns: int, end_ns: int) -> None:
        """Record a span of the caller's own (a plugin's) in this worker's trace while its
        window is open or still to come; ``stage`` is one of :data:`bpsctl.engine.trace.STAGES`.

        Not only while ``trace.on``: the I/O thread opens the window when it hears of the step
        mark that opens it, and a short step's spans can come before that; spans that ended
        before the window are left out when the trace is written."""
        trace = self._trace
        if trace is not None and trace.window_ns[1] is None:
            trace.span(STAGE[stage], trace.name_id(name), start_ns, end_ns)

    def died_of(self, why: str) -> None:
        """The process is dying of an uncaught exception (``why``): its LEAVE says it failed
        (bpsctl.engine.api installs the hook that calls this)."""
        self._died = why

    def shutdown(self) -> None:
        """Leave the job; outstanding push_pulls fail. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._command("stop", None)
        # with the scheduler gone, the I/O thread waits (up to BPSCTL_SCHEDULER_TIMEOUT) to
        # tell the restarted one that this worker left, not lost (unless the job failed here)
        self._thread.join(timeout=10 + self.config.scheduler_timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.destroy(linger=0)
        for segments in self._shm_slots.values():
            segments.close()            # (unpinned first, as the servers' sums below)
        for sums in self._shm_sums.values():
            sums.close()
        if self._trace is not None:
            warning = self._trace.close()
            if warning:
                log.warning("worker %d: %s", self.rank, warning)

    def _command(self, kind: str, payload: Any) -> None:
        self._commands.append((kind, payload))
        if not self._signaled:
            self._signaled = True
            try:
                os.write(self._wake_w, _WAKE)
            except OSError:
                pass

    # ------------------------------------------------------------------ I/O thread

    def _io_loop(self) -> None:
        poller, handlers = self._poller, self._handlers
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._sched, zmq.POLLIN)
        poller.register(self._sched_monitor, zmq.POLLIN)
        handlers.update({
            self._wake_r: self._drain_commands,
            self._sched: self._drain_scheduler,
            self._sched_monitor: self._check_scheduler_link,
        })
        for index, (sock, mon) in enumerate(zip(self._server_socks, self._server_monitors,
                                                strict=True)):
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            handlers[sock] = functools.partial(self._drain_server, sock)
            handlers[mon] = functools.partial(self._check_server_link, index)
        interval, release_after = self.config.heartbeat_interval_s, self.config.idle_release_s
        next_tick = time.monotonic() + interval
        last_busy, kept = 0.0, False        # kept: the allocator may hold freed results
        more = False                        # pushes left to send at once (see _send_pushes)
        try:
            while not self._stop:
                for sock, _ in poller.poll(0 if more else int(interval * 1000)):
                    handler = handlers.get(sock)    # None: a scheduler socket just replaced
                    if handler is not None:
                        handler()
                more = self._send_pushes()
                if self._hvd_join is not None and not self._hvd_join_sent:
                    self._send_hvd_join()
                now = time.monotonic()
                if self._tasks:
                    last_busy, kept = now, True
                elif kept and release_after and now - last_busy >= release_after:
                    kept = False            # quiet: see common.release_free_memory
                    released = release_free_memory()
                    log.debug("worker %d: quiet for %g s: gave %.1f MiB of free memory back to "
                              "the system", self.rank, release_after, released / 2**20)
                if now >= next_tick:
                    self._to_scheduler(P.control(P.HEARTBEAT, {"done": self._ops_done}))
                    self._fail_overdue(now)
                    next_tick = now + interval
        except Exception as exc:    # a bug here must not leave callers waiting forever
            self._fail_all(EngineError(f"worker {self.rank}: engine I/O thread crashed: {exc!r}"))
            raise
        finally:
            self._fail_all(EngineError("the engine was shut down"), broken=False)

    def _drain_commands(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        self._signaled = False
        declares: list[dict[str, Any]] = []
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "task":
                self._start_task(payload, declares)
            elif kind == "declare":
                if (payload["name"] not in self._tensors
                        and payload["name"] not in self._awaiting_declare):
                    self._awaiting_declare[payload["name"]] = (payload, [])
                    declares.append(payload)
            elif kind == "barrier":
                self._barriers[payload.name] = payload
                self._to_scheduler(P.control(P.BARRIER, {"name": payload.name}))
            elif kind == "step" and self._trace is not None:
                if not self._marked_steps:
                    self._marked_steps = True
                    self._trace.step_started_ns = payload
                else:
                    self._trace.next_step(self._trace.name_id("step"), payload)
            elif kind == "donate":
                self._donate(*payload)
            elif kind == "hvd_join":
                self._start_hvd_join(payload)
            elif kind == "stop_trace":
                trace, self._trace = self._trace, None
                if trace is not None:
                    trace.close()
                payload._set_done()
            elif kind == "pin":
                self._pinning = payload
                for segments in self._shm_slots.values():
                    segments.pin_with(payload)
                for sums in self._shm_sums.values():
                    sums.pin_with(payload)
            elif kind == "stop":
                # a broken worker says why, so that a job whose workers all failed is not
                # taken for a finished one (a restarted worker must not find "nothing to do")
                why = self._died if self._broken is None else str(self._broken)
                failed = {"failed": why[:500]} if why else {}
                self._to_scheduler(P.control(P.LEAVE, failed), keep=True)
                self._leaving = True
                # a broken worker's job has failed: nobody needs to hear that it left
                self._stop = self._sched_gone is None or self._broken is not None
        if declares:
            self._to_scheduler(P.control(P.DECLARE, {"tensors": declares}))

    def _start_task(self, task: _Task, declares: list[dict[str, Any]]) -> None:
        if self._broken is not None:
            self._finish(task, self._broken)
            return
        self._tasks.add(task)
        if task.join_error is not None and self.joined_ranks:
            self._finish(task, HorovodInternalError(
                f"{task.join_error} (rank(s) {sorted(self.joined_ranks)} joined)"))
            return
        if self.joining:
            self._join_waiting.append(task)     # its rounds come with the model
            return
        if self._trace is not None and not self._marked_steps:
            self._count_step(task.name)
        if self._peer_left:
            task.deadline = min(task.deadline, time.monotonic() + self.config.heartbeat_timeout_s)
        info = self._tensors.get(task.name)
        if info is None:
            pending = self._awaiting_declare.get(task.name)
            if pending is None:
                spec = {"name": task.name, "dtype": str(task.dtype), "shape": task.shape,
                        "reduce": P.REDUCTIONS[task.reduction]}
                self._awaiting_declare[task.name] = pending = (spec, [])
                declares.append(spec)
            pending[1].append(task)
            return
        self._enqueue(task, info)

    def _count_step(self, name: str) -> None:
        """Each push_pull of the job's first tensor starts a step (the traced window counts
        them); the first one only starts the count."""
        assert self._trace is not None
        if self._step_tensor is None:
            self._step_tensor = name
            self._trace.step_started_ns = now_ns()
        elif name == self._step_tensor:
            self._trace.next_step(self._trace.name_id("step"))

    def _enqueue(self, task: _Task, info: dict[str, Any]) -> None:
        if info["dtype"] != str(task.dtype) or info["shape"] != task.shape:
            self._finish(task, ValueError(
                f"tensor {task.name!r} was declared as {info['dtype']}{tuple(info['shape'])} but "
                f"push_pull got {task.dtype}{tuple(task.shape)}; use another name for another "
                "tensor"))
            return
        if info.get("reduce", "sum") != P.REDUCTIONS[task.reduction]:
            self._finish(task, ValueError(
                f"tensor {task.name!r} was reduced by {info.get('reduce', 'sum')} before, now "
                f"by {P.REDUCTIONS[task.reduction]}; use another name for another reduction"))
            return
        task.parts = info["parts"]
        task.remaining = len(task.parts)
        if self._trace is not None:
            task.queued_ns = now_ns()
        order = -task.priority
        for part in task.parts:
            heapq.heappush(self._queue, (order, next(self._seq), task, part))

    def _send_pushes(self) -> bool:
        """Send queued partitions while the credit lasts. At most half a heartbeat interval
        at a time (compressing a large tensor's first push here can take seconds): returns
        True if it stopped for that with more to send, so the loop comes straight back."""
        queue, trace = self._queue, self._trace
        credit = self._credit
        if credit is None:
            cfg = self.config
            credit = self._credit = credit_for(
                [float(s.get("share") or 0.0) for i, s in enumerate(self._servers)
                 if i not in self._servers_lost], cfg.credit_bytes, cfg.pacing_window_bytes,
                cfg.pacing)
        give_way = time.monotonic() + self.config.heartbeat_interval_s / 2
        while queue:
            if time.monotonic() >= give_way:
                return True
            _, _, task, part = queue[0]
            zero = task.zero(part)          # a PUSH_ZERO: a header alone
            length = 0 if zero else part[3] if task.codec is None else \
                task.codec.wire_bytes(part[3])
            if self._inflight_bytes and self._inflight_bytes + length > credit:
                return False
            entry = heapq.heappop(queue)
            if task.handle.error is not None:       # failed meanwhile (e.g. a key error)
                continue
            if part[1] in self._server_down:
                self._parked.append(entry)          # until it is reachable again, or moved
                continue
            part_id, server, offset = part[0], part[1], part[2]
            round_, flags = self._rounds.get(part_id, 0), task.flags
            data: Any = None
            if zero:
                pass                # nothing to read, copy or compress
            elif task.codec is None:
                # the bytes: the caller's array, or the slot the caller filled (Worker.lend)
                filled = task.filled.slots.get(part_id) if task.filled is not None else None
                source = task.src[offset:offset + length] if filled is None else filled[1]
                data = source.data
                # a server on this host: copied once into shared memory, not sent through TCP
                # (the slot is rewritten only once the partition's previous push was answered)
                if server in self._shm_local and not flags & P.FLAG_ASYNC and \
                        not task.once and part_id not in self._active:
                    try:
                        slot = self._shm_slot(server, part_id, length)
                    except EngineError as exc:
                        self._finish(task, exc)
                        continue
                    if slot is not None:
                        if slot is filled:          # the caller copied it there
                            self.filled_pushes += 1
                        else:
                            np.copyto(slot[1], source)
                        data, flags = memoryview(slot[0]), flags | P.FLAG_SHM
                        self.shm_pushes += 1
                        self.shm_pushed_bytes += length
            else:
                data = task.codec.encode(task.src, part_id, offset, part[3], round_).data
                flags |= P.FLAG_COMPRESSED
            if trace is not None and trace.on:
                now = self._trace_sent[part_id] = now_ns()
                trace.span(STAGE["queued"], trace.name_id(task.name), task.queued_ns, now,
                           part_id, round_, length, server, task.priority)
                flags |= P.FLAG_TRACED
            if task.scope is not None and (server, part_id) not in self._scoped:
                self._send_scope(server, task)
            sock = self._server_socks[server]
            dtype = P.push_dtype(P.DTYPE_CODES[task.dtype], task.reduction)
            # the rank field: a broadcast's root (PUSH_ZERO) or this worker's, and whether the
            # sum comes back or only its header (nothing of it read here)
            unread = P.RESULT_HEADER_ONLY if task.unwanted(part) else 0
            if zero:        # the partition's size
                sock.send(P.pack_header(P.PUSH_ZERO, flags=flags, dtype=dtype,
                                        rank=task.claim | unread, part=part_id, round=round_,
                                        nbytes=part[3]))
            else:
                sock.send(P.pack_header(P.PUSH, flags=flags, dtype=dtype, rank=self.rank | unread,
                                        part=part_id, round=round_, nbytes=length), zmq.SNDMORE)
                if task.hyper is None:
                    sock.send(data, copy=False)
                else:       # asynchronous training: the hyperparameters go with the gradient
                    sock.send(data, zmq.SNDMORE, copy=False)
                    sock.send(task.hyper)
            self._inflight_bytes += length
            self._unacked[part_id] = length
            self._active[part_id] = (task, part)
            self._pushed_bytes[server] += 0 if zero else part[3]
        return False

    def _send_scope(self, server: int, task: _Task) -> None:
        """Tell server ``server`` which ranks push ``task``'s partitions there (a process
        set's), on the connection its pushes take, so it hears before the first one (also a
        server that took partitions over from a lost one)."""
        assert task.scope is not None
        parts = [p[0] for p in task.parts if p[1] == server and (server, p[0]) not in self._scoped]
        self._server_socks[server].send_multipart(
            P.control(P.SCOPE, {"parts": parts, "ranks": list(task.scope)}))
        self._scoped.update((server, part) for part in parts)

    def _drain_server(self, sock: zmq.Socket) -> None:
        # at most half a heartbeat interval at a time (decompressing results can be slow):
        # what is left is read on the next turn of the loop, after the heartbeat is sent
        give_way = time.monotonic() + self.config.heartbeat_interval_s / 2
        while time.monotonic() < give_way:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg_type, _, flags, count, part_id, round_, nbytes = P.unpack_header(
                frames[0].buffer)
            if msg_type in (P.ACK, P.RESULT) and round_ != self._rounds.get(part_id, 0):
                # the answer to a round this worker has its sum of already: a push sent again
                # on a connection that came back, answered twice (item 7 of "Keeping going" in
                # docs/design.md); taken, it would be the next round's sum
                self.stale_answers += 1
                continue
            if msg_type == P.ACK:
                self._inflight_bytes -= self._unacked.pop(part_id, 0)
                if self._trace is not None and part_id in self._trace_sent:
                    self._trace_acked[part_id] = now_ns()
            elif msg_type == P.RESULT:
                self._inflight_bytes -= self._unacked.pop(part_id, 0)
                if flags & P.FLAG_LATE:
                    self.late_pushes += 1
                payload: Any = frames[1] if len(frames) > 1 else None   # None: header alone
                if flags & P.FLAG_SHM:
                    payload = self._shm_result(part_id, frames[1].buffer, nbytes)
                    if payload is None:
                        return
                self._result(part_id, round_, payload, count or 1 << 16)
            elif msg_type == P.STATE:
                self._received_state(frames[1], frames[2])
            elif msg_type == P.CHALLENGE:       # logging in again (_connection_came_back)
                self._login_again(sock, frames)
            elif msg_type == P.ERROR:
                _, msg = P.parse_control([frames[0].buffer, frames[1].buffer])
                part = msg.get("part")
                if isinstance(part, int):       # one partition's round, nothing else
                    if part in self._active and round_ == self._rounds.get(part, 0):
                        self._part_refused(part, round_, str(msg.get("message")))
                else:
                    self._fail_all(EngineError(f"worker {self.rank}: {msg.get('message')}"))

    def _part_refused(self, part_id: int, round_: int, message: str) -> None:
        """A server answered a partition's round with an error (a broadcast whose workers
        named different roots): the round is over, so later push_pulls of the name go on at
        the next one; the push_pull fails once every partition is answered."""
        task, _ = self._active.pop(part_id)
        self._inflight_bytes -= self._unacked.pop(part_id, 0)
        self._rounds[part_id] = round_ + 1
        self._trace_sent.pop(part_id, None)
        self._trace_acked.pop(part_id, None)
        if task.handle.error is None:
            what = "broadcast" if task.reduction == P.REDUCE_BROADCAST else "push_pull"
            task.handle.error = EngineError(f"worker {self.rank}: {what} {task.name!r}: "
                                            f"{message}")
        task.remaining -= 1
        if task.remaining == 0:
            self._finish(task, None)

    def _donate(self, handle: Handle, rank: int, incarnation: int,
                state: bytes | memoryview) -> None:
        """ADMIT to every server, then the rounds and ``state`` to the joiner through the
        first live one (same connection as this worker's later pushes: they come after). A
        server whose connection is down now gets its ADMIT once it is back, before this
        worker's pushes held for it (the joiner's wait there until it comes)."""
        try:
            if self._tasks or self._queue:
                raise EngineError(f"worker {self.rank}: donate() needs a step boundary, but "
                                  f"{len(self._tasks)} push_pulls are in flight")
            live = [i for i in range(len(self._servers))
                    if i not in self._servers_lost and i not in self._server_down]
            if not live:
                raise EngineError(f"worker {self.rank}: no server to admit worker {rank} to")
            rounds = {str(part): round_ for part, round_ in self._rounds.items()}
            admit = P.control(P.ADMIT, {"rank": rank, "incarnation": incarnation,
                                        "rounds": rounds})
            for index in live:
                self._server_socks[index].send_multipart(admit)
            for index in self._server_down:        # never a lost one (see _server_moved)
                self._owed_admits.setdefault(index, []).append(admit)
            self._server_socks[live[0]].send_multipart([
                P.pack_header(P.STATE, rank=rank, round=incarnation, nbytes=len(state)),
                json.dumps(rounds).encode(), state], copy=False)
            self._to_scheduler(P.control(P.JOIN_DONE, {"rank": rank}), keep=True)
            self.pending_joins = [j for j in self.pending_joins if j != (rank, incarnation)]
            log.warning("worker %d: handed the model (%.1f MiB) to joining worker %d",
                        self.rank, len(state) / 2**20, rank)
        except EngineError as exc:
            handle.error = exc
        handle._set_done()

    def _received_state(self, rounds: zmq.Frame, state: zmq.Frame) -> None:
        """This rejoining worker's state came: take the donor's rounds, start what waited."""
        if not self.joining:
            return
        self._rounds.update({int(part): int(round_)
                             for part, round_ in json.loads(rounds.bytes).items()})
        self._join_payload = state.buffer       # the frame's memory, not a copy
        self.joining = False
        waiting, self._join_waiting = self._join_waiting, []
        declares: list[dict[str, Any]] = []
        for task in waiting:
            self._tasks.discard(task)
            self._start_task(task, declares)
        if declares:
            self._to_scheduler(P.control(P.DECLARE, {"tensors": declares}))
        self._joined.set()

    def _start_hvd_join(self, handle: Handle) -> None:
        """join() was called: sent once nothing is in flight (see :meth:`_send_hvd_join`)."""
        if self._broken is not None or self._hvd_join is not None:
            handle.error = self._broken or EngineError(
                f"worker {self.rank}: join() is already waiting on another thread")
            handle._set_done()
            return
        self._hvd_join, self._hvd_join_sent = handle, False

    def _send_hvd_join(self) -> None:
        """Tell the scheduler this worker joined, with its rounds, once none of its push_pulls
        is in flight: its rounds are then final, and no round waits for a push of it."""
        if self._tasks or self._sched_gone is not None:
            return
        self._hvd_join_sent = True
        self._to_scheduler(P.control(P.HVD_JOIN, {
            "rounds": {str(part): round_ for part, round_ in self._rounds.items()},
            "op_timeout_s": self.config.op_timeout_s}))

    def _hvd_joined(self, msg: dict[str, Any]) -> None:
        """The scheduler says who has joined: push_pulls that cannot take zeros fail, and the
        scheduler hears it was heard (only then do the servers count the zeros, so no sum
        holds them before this worker knows). At the end of the join: every partition's round
        where the job is, and this worker's join() returns the last rank to join."""
        epoch = P.int_field(msg, "epoch", 0, 1 << 62)
        if msg.get("done") is True:
            self.joined_ranks = frozenset()
            rounds = msg.get("rounds", {})
            if isinstance(rounds, dict):
                for part, round_ in rounds.items():
                    part_id = int(part)
                    self._rounds[part_id] = max(self._rounds.get(part_id, 0), int(round_))
            handle, self._hvd_join, self._hvd_join_sent = self._hvd_join, None, False
            if handle is not None:
                self._hvd_join_last = P.int_field(msg, "last", 0, P.MAX_WORKERS)
                handle._set_done()
            return
        ranks = msg.get("ranks", [])
        self.joined_ranks = frozenset(int(r) for r in ranks if isinstance(r, int))
        for task in [t for t in self._tasks if t.join_error is not None]:
            self._finish(task, HorovodInternalError(
                f"{task.join_error} (rank(s) {sorted(self.joined_ranks)} joined)"))
        self._to_scheduler(P.control(P.JOINED_ACK, {"epoch": epoch}))

    def _fail_hvd_join(self, error: EngineError) -> None:
        handle, self._hvd_join = self._hvd_join, None
        if handle is not None:
            handle.error = error
            handle._set_done()

    def _shm_slot(self, server: int, part_id: int,
                  length: int) -> tuple[bytes, np.ndarray] | None:
        """This worker's slot for partition ``part_id`` on server ``server`` (placed on its
        first push there and kept for the job), or None when BPSCTL_SHM_SERVER_BYTES has no
        room left: that partition goes through TCP."""
        key = (server, part_id)
        if key in self._shm_parts:
            return self._shm_parts[key]
        segments = self._shm_slots.get(server)
        if segments is None:
            segments = self._shm_slots[server] = shmlink.Segments(shmlink.worker_base(
                self._shm_tag, self.config.job_id, self.rank, self.incarnation,
                int(self._servers[server]["rank"])), self._shm_budget)
            if self._pinning is not None:
                segments.pin_with(self._pinning)
        got = segments.allocate(length)
        slot = None
        if got is not None:
            chunk, offset, view = got
            slot = (shmlink.REF.pack(shmlink.PUSHER, chunk, offset), view)
        elif not any(value is None for value in self._shm_parts.values()):
            log.info("worker %d: partitions beyond %s of shared memory go to servers on "
                     "this host through TCP (from partition %d on)", self.rank,
                     self._shm_budget.describe(), part_id)
        self._shm_parts[key] = slot
        return slot

    def _shm_result(self, part_id: int, ref: memoryview, nbytes: int) -> Any:
        """A result in shared memory: the view its REF names (this worker's own push slot,
        or the server's sum buffer, mapped read-only on first use); None if the engine
        failed on it."""
        entry = self._active.get(part_id)
        if entry is None:
            return memoryview(b"")          # its task already failed: nothing is read
        server = entry[1][1]
        try:
            if ref.nbytes != shmlink.REF.size:
                raise ValueError(f"a reference of {ref.nbytes} bytes")
            owner, chunk, offset = shmlink.REF.unpack(ref)
            if owner == shmlink.PUSHER:
                slot = self._shm_parts.get((server, part_id))
                if slot is None or len(slot[1]) != nbytes:
                    raise ValueError(f"no push slot of partition {part_id} here")
                view = slot[1]
            else:
                sums = self._shm_sums.get(server)
                if sums is None:
                    sums = self._shm_sums[server] = shmlink.Mapped(shmlink.server_base(
                        self._shm_tag, self.config.job_id, int(self._servers[server]["rank"])),
                        writable=False, unlink=False, pinning=self._pinning)
                view = sums.view(chunk, offset, nbytes)
        except ValueError as exc:
            self._fail_all(EngineError(f"worker {self.rank}: {self._server_name(server)} "
                                       f"answered partition {part_id} through shared memory, "
                                       f"but: {exc}"))
            return None
        self.shm_results += 1
        return view

    def _result(self, part_id: int, round_: int, payload: Any, count: int) -> None:
        """A partition's sum of ``count`` workers' pushes (the frame that carried it, or its
        view in shared memory): into the output, divided by that count when averaging (all of
        the job's workers, unless some were lost). ``payload`` None: the header alone (the
        caller reads nothing of this partition, Task.unwanted): the round is complete."""
        entry = self._active.pop(part_id, None)
        if entry is None:
            return                                 # its task already failed
        task, part = entry
        self._rounds[part_id] = round_ + 1
        arrived_ns = now_ns() if self._trace is not None else 0
        if payload is None and not task.unwanted(part) and task.handle.error is None:
            task.handle.error = EngineError(f"push_pull of {task.name!r}: server {part[1]} "
                                            f"answered partition {part_id} without its sum")
        if payload is not None:
            self._pulled_bytes[part[1]] += part[3]
            if self._keep_sums and isinstance(payload, zmq.Frame) and task.codec is None and \
                    task.reduction != P.REDUCE_BROADCAST and \
                    not task.flags & P.FLAG_HOST_REDUCED:
                self._last_sums[part_id] = (round_, count, P.DTYPE_CODES[task.dtype], payload)
        if task.handle.error is None and payload is not None:
            itemsize = task.dtype.itemsize
            start = part[2] // itemsize
            dst = task.dst[start:start + part[3] // itemsize]
            divisor = task.divisor
            if divisor is not None and not task.flags & P.FLAG_HOST_REDUCED:
                divisor = count             # fewer than size() if workers were lost
            if task.codec is not None:      # decompressed by the waiter (see Handle)
                task.handle._result_arrived((task.codec, payload, part_id, round_, dst,
                                             divisor))
            elif task.lend_results and isinstance(payload, np.ndarray):
                task.handle.lent.append((part[2], payload, divisor))  # read there by the caller
                self.lent_results += 1
            else:
                sum_into(np.frombuffer(payload.buffer if isinstance(payload, zmq.Frame)
                                       else payload, dtype=task.dtype), divisor, dst)
        if arrived_ns:
            self._trace_result(task, part, round_, arrived_ns)
        task.remaining -= 1
        if task.remaining == 0:
            self._finish(task, None)

    def _trace_result(self, task: _Task, part: list[int], round_: int, arrived_ns: int) -> None:
        """The spans of a partition's round once its sum is in the output: on the wire to the
        server and acknowledged, waiting for the sum, copied out."""
        trace, part_id = self._trace, part[0]
        assert trace is not None
        sent = self._trace_sent.pop(part_id, None)
        acked = self._trace_acked.pop(part_id, arrived_ns)
        if sent is None or not trace.on:
            return                          # pushed before the window opened
        name, server = trace.name_id(task.name), part[1]
        nbytes = 0 if task.zero(part) else part[3] if task.codec is None else \
            task.codec.wire_bytes(part[3])      # as sent
        trace.span(STAGE["push"], name, sent, acked, part_id, round_, nbytes, server,
                   task.priority)
        trace.span(STAGE["wait_result"], name, acked, arrived_ns, part_id, round_, nbytes,
                   server, task.priority)
        trace.span(STAGE["copy_out"], name, arrived_ns, now_ns(), part_id, round_, nbytes,
                   server, task.priority)

    def _finish(self, task: _Task, error: BaseException | None) -> None:
        self._tasks.discard(task)
        handle = task.handle
        if handle.done():
            return
        trace = self._trace
        if trace is not None and trace.on and task.called_ns and error is None:
            trace.span(STAGE["push_pull"], trace.name_id(task.name), task.called_ns, now_ns(),
                       nbytes=task.src.nbytes, priority=task.priority)
        if handle.error is None:
            handle.error = error
        if error is None:
            self._ops_done += 1
        with self._lock:
            self._in_flight_names.discard(task.name)
        handle._set_done()

    def _drain_scheduler(self) -> None:
        while True:
            try:
                frames = self._sched.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg_type, msg = P.parse_control(frames)
            if self._sched_login is not None and self._sched_login.handle(msg_type, msg):
                continue
            if msg_type == P.REGISTERED and self._sched_gone is not None:
                self._registered_again()
            elif msg_type == P.DECLARED:
                for info in msg["tensors"]:
                    self._declared(info)
            elif msg_type == P.BARRIER_DONE:
                handle = self._barriers.pop(msg["name"], None)
                if handle is not None:
                    self._barriers_passed += 1      # one at a time: barrier() waits
                    handle._set_done()
            elif msg_type == P.MEMBER_LOST:
                self._fail_all(EngineError(f"worker {self.rank}: {msg['message']}"))
            elif msg_type == P.SERVER_MOVED:
                self._server_moved(msg)
            elif msg_type == P.WORKER_LOST:
                lost = (int(msg["rank"]), int(msg.get("incarnation", 0)))
                self._incarnations[lost[0]] = lost[1]
                self.pending_joins = [j for j in self.pending_joins if j != lost]
                self._membership([int(r) for r in msg["live"]], str(msg["message"]))
            elif msg_type == P.JOINED:
                self._hvd_joined(msg)
            elif msg_type == P.WORKER_JOINING:
                self.pending_joins.append((int(msg["rank"]), int(msg["incarnation"])))
            elif msg_type == P.WORKER_JOINED:
                self._incarnations[int(msg["rank"])] = int(msg.get("incarnation", 0))
                self._membership([int(r) for r in msg["live"]], str(msg["message"]))
            elif msg_type == P.MEMBER_LEFT:
                # results already on their way still land; what is left over after a grace
                # period waits for the leaver in vain
                self._peer_left = str(msg["message"])
                self._left_ranks.add(int(msg["rank"]))
                grace_deadline = time.monotonic() + self.config.heartbeat_timeout_s
                for task in self._tasks:
                    task.deadline = min(task.deadline, grace_deadline)
            elif msg_type == P.ERROR:
                name = msg.get("name")
                kind = JobFinished if msg.get("finished") is True else EngineError
                error = kind(f"worker {self.rank}: {msg.get('message')}")
                if name is not None:
                    self._fail_name(name, error)
                else:
                    self._fail_all(error)

    def _membership(self, live: list[int], message: str) -> None:
        if self.joining:
            live = sorted({*live, self.rank})
        if live != self.live_ranks:
            self.live_ranks, self.size = live, len(live)
            self.membership_changes += 1
            log.warning("worker %d: %s; the job goes on with %d workers", self.rank, message,
                        self.size)

    def _declared(self, info: dict[str, Any]) -> None:
        name = info["name"]
        spec, waiting = self._awaiting_declare.pop(name, (None, []))
        if spec is None:
            return                                  # failed meanwhile
        self._tensors[name] = {"key": info["key"], "parts": info["parts"],
                               "dtype": spec["dtype"], "shape": spec["shape"],
                               "reduce": spec.get("reduce", "sum")}
        for part in info["parts"]:
            self._parts[part[0]] = part
        for task in waiting:
            self._enqueue(task, self._tensors[name])

    def _fail_name(self, name: str, error: BaseException) -> None:
        self._awaiting_declare.pop(name, None)
        for task in [t for t in self._tasks if t.name == name]:
            self._finish(task, error)

    def _check_scheduler_link(self) -> None:
        if zmq.EVENT_DISCONNECTED in monitor_events(self._sched_monitor) and not self._stop:
            self._lost_scheduler()

    def _to_scheduler(self, frames: list[bytes], keep: bool = False) -> None:
        """Send to the scheduler; while it is gone, drop the message (heartbeats, and
        declarations and barriers, which are asked again from their records once it is
        back) or, with ``keep``, hold it until then."""
        if self._sched_gone is None:
            self._sched.send_multipart(frames)
        elif keep:
            self._sched_outbox.append(frames)

    def _lost_scheduler(self) -> None:
        """The scheduler is gone. Push_pulls of declared tensors go on (the data path never
        touches it); a fresh connection registers this worker again with the scheduler
        restarted in its place (``bpsctl up``'s supervisor restarts it on the same address)
        and says what it needs to go on with the job (see :meth:`_reregistration`)."""
        now = time.monotonic()
        self._fail_hvd_join(SchedulerGone(
            f"worker {self.rank}: join() lost the scheduler at {self.scheduler_address}, which "
            "keeps the joined ranks (a join does not survive a scheduler restart)"))
        if self._sched_gone is None:
            self._sched_gone = now
            log.warning("worker %d: %s; training goes on, and this worker registers again once "
                        "it is back (what needs it waits up to BPSCTL_SCHEDULER_TIMEOUT=%g s)",
                        self.rank, lost_link(f"the scheduler at {self.scheduler_address}",
                                             self.config.heartbeat_timeout_s),
                        self.config.scheduler_timeout_s)
        for sock in (self._sched, self._sched_monitor):
            self._poller.unregister(sock)
            self._handlers.pop(sock, None)
        self._sched.disable_monitor()
        self._sched_monitor.close(0)
        self._sched.close(0)
        self._sched = self._linked_socket()
        self._sched_monitor = monitor(self._sched)
        self._sched.connect(f"tcp://{self.scheduler_address}")
        self._poller.register(self._sched, zmq.POLLIN)
        self._poller.register(self._sched_monitor, zmq.POLLIN)
        self._handlers[self._sched] = self._drain_scheduler
        self._handlers[self._sched_monitor] = self._check_scheduler_link
        self._sched_login = self.security.login(
            self._sched, lambda: P.control(P.REGISTER, self._reregistration()),
            f"the scheduler at {self.scheduler_address}")

    def _reregistration(self) -> dict[str, Any]:
        """What a restarted scheduler needs to go on with the job as it was (the job, this
        worker's rank and incarnation, who was live, left or joining, the job's servers and
        which were lost, every tensor this worker knows with its partitions where they live
        now): nothing is placed again, nobody renumbered."""
        cfg = self.config
        tensors = [{"name": name, "key": info["key"], "dtype": info["dtype"],
                    "shape": info["shape"], "reduce": info.get("reduce", "sum"),
                    "parts": info["parts"]}
                   for name, info in self._tensors.items()]
        return {
            "role": "worker", "rank": self.rank, "world_size": self._job_size,
            "job": cfg.job_id, "host": cfg.host, "pid": os.getpid(), "version": __version__,
            "num_servers": cfg.num_servers, "partition_bytes": cfg.partition_bytes,
            "partition_depth": cfg.partition_depth,
            "start_timeout_s": cfg.start_timeout_s, "min_workers": cfg.min_workers,
            "max_workers": cfg.max_workers, "clock_ns": now_ns(),
            "reregister": {
                "incarnation": self.incarnation, "joining": self.joining,
                "servers": [{"rank": s["rank"], "host": s["host"], "port": s["port"],
                             "host_id": s.get("host_id", ""), "share": s.get("share")}
                            for s in self._servers],
                "lost_servers": sorted(self._servers_lost), "live": list(self.live_ranks),
                "spares": sorted(self._spare_servers),
                "left": sorted(self._left_ranks),
                "incarnations": {str(r): i for r, i in self._incarnations.items()},
                "donating": [list(join) for join in self.pending_joins], "tensors": tensors,
                "barriers_passed": self._barriers_passed}}

    def _registered_again(self) -> None:
        """The restarted scheduler has this worker: ask again what waited for the lost one."""
        assert self._sched_gone is not None
        log.warning("worker %d: registered again with the restarted scheduler at %s, %.1f s "
                    "after losing it", self.rank, self.scheduler_address,
                    time.monotonic() - self._sched_gone)
        self._sched_gone, self._sched_login = None, None
        if self._awaiting_declare:
            self._to_scheduler(P.control(P.DECLARE, {"tensors": [
                spec for spec, _ in self._awaiting_declare.values()]}))
        for name in self._barriers:
            self._to_scheduler(P.control(P.BARRIER, {"name": name}))
        outbox, self._sched_outbox = self._sched_outbox, []
        for frames in outbox:
            self._to_scheduler(frames)
        cfg, now = self.config, time.monotonic()
        for index, (since, _) in list(self._server_down.items()):
            # the new scheduler decides within a heartbeat timeout whether the server is lost
            self._server_down[index] = (since, now + cfg.heartbeat_timeout_s
                                        + 2 * cfg.heartbeat_interval_s + 1)
        self._stop = self._leaving

    def _scheduler_overdue(self, now: float) -> None:
        """The scheduler has been gone for BPSCTL_SCHEDULER_TIMEOUT: what needs it fails,
        naming it; push_pulls of declared tensors go on."""
        assert self._sched_gone is not None
        gone = (f"the scheduler at {self.scheduler_address} has been gone for "
                f"{now - self._sched_gone:.0f} s (BPSCTL_SCHEDULER_TIMEOUT="
                f"{self.config.scheduler_timeout_s:g}; `bpsctl status` shows whether it "
                "restarts)")
        for name in list(self._awaiting_declare):
            self._fail_name(name, SchedulerGone(f"worker {self.rank}: {gone}: tensor {name!r} "
                                                "cannot be declared"))
        for name, handle in self._barriers.items():
            handle.error = SchedulerGone(f"worker {self.rank}: {gone}: barrier {name!r} cannot "
                                         "complete")
            handle._set_done()
        self._barriers.clear()
        if self._server_down:
            names = ", ".join(self._server_name(i) for i in self._server_down)
            self._server_down.clear()
            self._fail_all(SchedulerGone(f"worker {self.rank}: lost the connection to {names}, "
                                         f"and {gone}: nobody can move its partitions"))
        if self._leaving:
            self._stop = True

    def _check_server_link(self, index: int) -> None:
        events = monitor_events(self._server_monitors[index])
        if self._stop or index in self._servers_lost:
            return
        if zmq.EVENT_DISCONNECTED in events:
            came_back = zmq.EVENT_CONNECTED in events[events.index(zmq.EVENT_DISCONNECTED):]
        else:
            came_back = index in self._server_down and zmq.EVENT_CONNECTED in events
        if came_back:
            self._connection_came_back(index)
            return
        if zmq.EVENT_DISCONNECTED not in events or index in self._server_down:
            return
        cfg = self.config
        # asynchronous training: the lost server's parameters are gone with it (_fail_server)
        if cfg.server_failover and not cfg.async_mode and \
                len(self._servers) - len(self._servers_lost) > 1:
            # the scheduler decides whether the server is lost (its heartbeats stop) and, if
            # so, moves its partitions (SERVER_MOVED); wait for that, not much longer
            now = time.monotonic()
            self._server_down[index] = (now, now + cfg.heartbeat_timeout_s
                                        + 2 * cfg.heartbeat_interval_s + 1)
            log.warning("worker %d: lost the connection to %s; waiting for the scheduler to "
                        "move its partitions", self.rank, self._server_name(index))
            return
        self._fail_server(index)

    def _connection_came_back(self, index: int) -> None:
        """The connection to server ``index`` dropped (a link cut, or this process or the
        server paused, past the heartbeat timeout) and ZeroMQ has opened a new one: the server
        is alive, and what was in flight on the old connection, either way, may be lost. Log
        in again on the new one, then push again every partition of this server not answered
        yet, at the same round: the server counts a round's push from this rank once and
        answers a round it has completed since with that round's sum (docs/design.md,
        "Keeping going", item 7)."""
        since, _ = self._server_down.pop(index, (time.monotonic(), 0.0))
        cannot = ("its pushes went through shared memory" if index in self._shm_local else
                  "its partitions hold the parameters of asynchronous training (BPSCTL_ASYNC)"
                  if self.config.async_mode else
                  "compressed pushes carry error feedback that cannot be sent twice"
                  if any(task.codec is not None for task, part in self._active.values()
                         if part[1] == index) else "")
        if cannot:
            self._fail_all(EngineError(
                f"worker {self.rank}: the connection to {self._server_name(index)} dropped and "
                f"came back, but what was on it cannot be pushed again ({cannot}): "
                + lost_link(self._server_name(index), self.config.heartbeat_timeout_s)))
            return
        self._scoped = {(server, part) for server, part in self._scoped if server != index}
        again = 0
        for part_id, (task, part) in list(self._active.items()):
            if part[1] == index:
                del self._active[part_id]
                self._inflight_bytes -= self._unacked.pop(part_id, 0)
                heapq.heappush(self._queue, (-task.priority, next(self._seq), task, part))
                again += 1
        login = self.security.login(self._server_socks[index], self._hellos[index],
                                    self._server_name(index))
        if login.done:
            self._unpark(index)
        else:
            # pushes wait for the server's CHALLENGE, as long as for a server whose connection
            # dropped: a paused server's host accepts the connection but nothing answers, and
            # the scheduler may move its partitions meanwhile (SERVER_MOVED)
            self._relogins[index] = login
            now = time.monotonic()
            self._server_down[index] = (since, now + self.config.heartbeat_timeout_s
                                        + 2 * self.config.heartbeat_interval_s + 1)
        log.warning("worker %d: the connection to %s came back %.1f s after it dropped; "
                    "logging in again and pushing %d partitions again", self.rank,
                    self._server_name(index), time.monotonic() - since, again)

    def _login_again(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        """A CHALLENGE on a connection that came back: prove the secret (the HELLO follows),
        then send what waited for it."""
        index = self._server_socks.index(sock)
        login = self._relogins.get(index)
        if login is None:
            return
        self._answer(login, *P.parse_control([frame.buffer for frame in frames]))
        if login.done:
            del self._relogins[index]
            self._server_down.pop(index, None)
            self._unpark(index)

    def _unpark(self, index: int) -> None:
        """Queue again the pushes held back while server ``index`` was unreachable, after
        the ADMITs it missed meanwhile (:meth:`_donate`)."""
        for admit in self._owed_admits.pop(index, []):
            self._server_socks[index].send_multipart(admit)
        held = [entry for entry in self._parked if entry[3][1] == index]
        self._parked = [entry for entry in self._parked if entry[3][1] != index]
        for entry in held:
            heapq.heappush(self._queue, entry)

    def _server_name(self, index: int) -> str:
        server = self._servers[index]
        return f"server {server['rank']} at {server['host']}:{server['port']}"

    def _fail_server(self, index: int) -> None:
        self._fail_all(EngineError(f"worker {self.rank}: " + lost_link(
            self._server_name(index), self.config.heartbeat_timeout_s) + self._params_gone()))

    def _params_gone(self) -> str:
        """Why a lost server ends a job of asynchronous training, whatever the failover."""
        if not self.config.async_mode:
            return ""
        return ("; under asynchronous training (BPSCTL_ASYNC) the servers hold the model's "
                "parameters, and that server's are gone with it: the job cannot go on (restart "
                "it from a checkpoint)")

    def _server_moved(self, msg: dict[str, Any]) -> None:
        """A lost server's partitions live on other servers now: send what it had not
        answered to them again (same round: the new server starts each partition empty at
        the round it is pushed), and later rounds there too."""
        index = int(msg["index"])
        if index in self._servers_lost:
            return          # told again after registering again: known, and acted on
        if self.config.async_mode:
            self._fail_all(EngineError(f"worker {self.rank}: {msg['message']}"
                                       + self._params_gone()))
            return
        since, _ = self._server_down.pop(index, (time.monotonic(), 0.0))
        self._relogins.pop(index, None)
        self._owed_admits.pop(index, None)     # its partitions' new servers were admitted
        self._servers_lost.add(index)
        taker = [i for i, s in enumerate(self._servers) if s["rank"] == msg.get("spare")]
        self._spare_servers -= {index, *taker}
        server = self._servers[index]
        for i in taker:         # it sums the lost one's share now (a restarted scheduler asks)
            self._servers[i]["share"] = server.get("share")
        self._credit = None     # the survivors' shares may be equal now, or no longer
        try:        # stop reconnecting to it
            self._server_socks[index].disconnect(f"tcp://{server['host']}:{server['port']}")
        except zmq.ZMQError:
            pass
        self._drop_shm(index)
        again = 0
        for part_id, target in msg["moves"]:
            part = self._parts.get(part_id)
            if part is None:
                continue            # not declared here yet: DECLARED will say where it lives
            part[1] = int(target)
            self._hand_last_sum(part_id, int(target))
            entry = self._active.pop(part_id, None)
            if entry is not None:
                self._inflight_bytes -= self._unacked.pop(part_id, 0)
                task, _ = entry
                heapq.heappush(self._queue, (-task.priority, next(self._seq), task, part))
                again += 1
        for parked in self._parked:                 # held back while it was unreachable
            heapq.heappush(self._queue, parked)
        self._parked.clear()
        moved = (f"its {len(msg['moves'])} partitions moved to other servers"
                 if msg.get("spare") is None else
                 f"spare server {msg['spare']} took over its {len(msg['moves'])} partitions")
        log.warning("worker %d: %s; %s, %d pushed again (%.1f s after its connection dropped)",
                    self.rank, msg["message"], moved, again, time.monotonic() - since)

    def _hand_last_sum(self, part_id: int, target: int) -> None:
        """Send the server a lost one's partition moved to the sum of its last round that
        reached this worker (before this worker's pushes of it, on the same connection): a
        worker it did not reach pushes that round there again, and is answered with it."""
        last = self._last_sums.pop(part_id, None)
        if last is None or last[0] + 1 != self._rounds.get(part_id, 0) or \
                target in self._server_down:        # (a login again would come after it)
            return
        round_, count, dtype, frame = last
        self._server_socks[target].send_multipart(
            [P.pack_header(P.LAST_SUM, dtype=dtype, rank=count & 0xFFFF, part=part_id,
                           round=round_, nbytes=len(frame)), frame], copy=False)

    def _drop_shm(self, index: int) -> None:
        """Let go of the shared memory with lost server ``index``: its push slots (pushes
        filled into one are sent from it: the view keeps the memory) and its sum buffers,
        unpinned first."""
        self._shm_local.discard(index)
        for key in [key for key in self._shm_parts if key[0] == index]:
            del self._shm_parts[key]
        segments, sums = self._shm_slots.pop(index, None), self._shm_sums.pop(index, None)
        if segments is not None:
            segments.close()
        if sums is not None:
            sums.close()

    def _fail_overdue(self, now: float) -> None:
        if self._sched_gone is not None and \
                now - self._sched_gone >= self.config.scheduler_timeout_s:
            self._scheduler_overdue(now)
        for index, (_, give_up) in list(self._server_down.items()):
            if now >= give_up and self._sched_gone is None:
                del self._server_down[index]
                self._fail_server(index)
        for task in [t for t in self._tasks if t.deadline < now]:
            if self._peer_left:
                self._finish(task, EngineError(f"worker {self.rank}: push_pull of {task.name!r} "
                                               f"did not complete: {self._peer_left}"))
                continue
            servers = sorted({self._servers[p[1]]["rank"] for p in task.parts
                              if p[0] in self._active})
            self._finish(task, EngineError(
                f"worker {self.rank}: push_pull of {task.name!r} did not complete within "
                f"{self.config.op_timeout_s:g} s (BPSCTL_OP_TIMEOUT); still waiting on server(s) "
                f"{servers or 'none: not yet declared'} for the other workers' pushes"))

    def _fail_all(self, error: EngineError, broken: bool = True) -> None:
        if broken:
            with self._lock:
                if self._broken is None:
                    self._broken = error
        for task in list(self._tasks):
            self._finish(task, error)
        for _, waiting in self._awaiting_declare.values():
            for task in waiting:
                self._finish(task, error)
        self._awaiting_declare.clear()
        self._queue.clear()
        self._parked.clear()
        self._join_waiting.clear()
        if self.joining:
            self._joined.set()          # receive_state raises the error
        self._active.clear()
        self._unacked.clear()
        self._inflight_bytes = 0
        for handle in self._barriers.values():
            handle.error = error
            handle._set_done()
        self._barriers.clear()
        self._fail_hvd_join(error)
