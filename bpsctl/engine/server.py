"""The summation server: sums each partition's pushes from all workers, answers with the sum.

One ROUTER socket carries everything from workers. Per partition, a round goes:

1. each worker pushes its bytes (header + zero-copy payload); the server acknowledges at
   once, so the worker can release credit before the round completes;
2. the pushes are summed into one of two preallocated buffers (rounds alternate, so a
   buffer is never rewritten while a previous round's answer may still be on the wire).
   The first push is kept as it arrived and summed with the second in one pass;
   with a single worker the push itself is the answer, without a copy;
3. when every worker has pushed, the sum goes to all of them, zero-copy.

With backup workers (``BPSCTL_BACKUP_WORKERS=b``, from the job's HELLO) a round of an
averaged push_pull completes once ``N - b`` of the ``N`` live workers pushed it. A push that
comes after that is not summed: it is answered with the round's result (``FLAG_LATE``), kept
until every live worker has pushed the round, and the next round completes only then, so a
worker lags by at most one round. Rounds then take three buffers in turn, not two: the one
summing, the completed one held for late pushes, and the one before, whose answer to a late
worker may still be on the wire.

Large partitions are summed on summation threads (NumPy releases the GIL), each
partition pinned to one thread so its pushes are summed in order without locks; small
ones are summed inline, where a thread hop would cost more than the add.

A worker on this server's host (``BPSCTL_SHM_SERVER``; engine/shmlink.py) pushes a reference
to its partition's slot in shared memory instead of the bytes (``FLAG_SHM``): the server sums
straight from the slot, keeps the sum buffers of such partitions in shared segments of its own,
and answers local workers with a reference to the round's buffer (``_shm_payload``,
``_shm_buffers``, ``_shm_ref``).

A PUSH_ZERO (a header alone: the pusher's share of the round is zeros, as a gather's rank
sends for partitions without its rows) counts as a push and is answered as one, with nothing
folded in: a round of such pushes alone answers zeros, one of a single data push and zeros
that push (copied first when it is a worker's slot in shared memory, which its pusher
rewrites once answered). In a broadcast's partitions (``REDUCE_BROADCAST``) each push names
a root (a data push its pusher, a PUSH_ZERO its rank field): a round whose pushes name
different roots, or whose root pushed nothing, is answered with an ERROR to every pusher
(``_refused_broadcast``).

Under asynchronous training (``FLAG_ASYNC`` pushes, ``BPSCTL_ASYNC``) a partition holds the
model's parameters instead (:class:`AsyncPartition`): there are no rounds across workers;
each push is one SGD step, applied at once in arrival order (on the same thread a sum would
use) and answered with the parameters after it.
"""
from __future__ import annotations

import collections
import json
import math
import os
import queue
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # A server sums with NumPy's elementwise ufuncs and never calls BLAS. One BLAS thread spares
    # the process the pool that OpenBLAS starts at import (a thread per core: most of the CPU
    # time of importing NumPy). Set before NumPy loads; a value the user gave wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import zmq

from .. import __version__
from ..config import Config
from . import protocol as P
from . import shm, shmlink
from .client import measure_clock
from .common import (
    EngineError,
    bound_router,
    exec_with_jemalloc,
    exit_on_sigterm,
    jemalloc_loaded,
    keep_large_buffers,
    lost_link,
    make_socket,
    monitor,
    monitor_events,
    release_free_memory,
    setup_process_logging,
    watch_link,
    write_ready_file,
)
from .compression import ServerCodec
from .security import Login, Security, handshake_failed, refused_handshake, version_mismatch
from .trace import STAGE, Trace, attach_nic, best_clock, now_ns, scheduler_clock

#: partitions at least this large are summed on a summation thread
THREADED_SUM_BYTES = 256 * 1024
#: how long a stopping server waits for its summation threads to finish the sum in hand and
#: close their sockets (a partition's sum takes milliseconds)
SUM_THREAD_STOP_S = 2.0
_PART_ID = struct.Struct("<I")
#: what servers hold as parameters under asynchronous training
ASYNC_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _Zero:
    """The payload of a PUSH_ZERO as the summing code sees it: a push counted towards its
    round, with nothing to fold in."""

    __slots__ = ()


ZERO = _Zero()


class PartitionState:
    """One partition's round in progress. ``received``/``waiting`` belong to the I/O thread;
    ``summed``/``first``/``buffers``/``result`` to the partition's summation thread."""

    __slots__ = ("part", "dtype", "dtype_code", "nbytes", "expected", "round", "received",
                 "waiting", "summed", "first", "buffers", "result", "thread", "wide",
                 "first_push_ns", "traced", "adopted", "leaving", "widened", "codec", "rotation",
                 "backup", "late_waiting", "pushed_last", "owed", "held", "held_count",
                 "deferred", "shm_alloc", "shm_refs", "first_ref", "copy_single",
                 "reduction", "combine", "folded", "first_shared", "claims", "data_pushes",
                 "headers_only", "last", "answered", "threaded")

    def __init__(self, part: int, dtype_code: int, nbytes: int, thread: int, expected: int,
                 rotation: int = 2, reduction: int = P.REDUCE_SUM):
        self.part, self.dtype_code, self.nbytes, self.thread = part, dtype_code, nbytes, thread
        # how pushes combine (P.REDUCE_*): a sum, or an elementwise min, max or product
        self.reduction, self.combine = reduction, P.REDUCE_UFUNCS[reduction]
        self.expected = expected        # pushes per round: workers, or hosts when host-reduced
        self.rotation = rotation        # sum buffers taken in turn (3 with backup workers)
        # backup workers (all on the I/O thread): pushes this round may lack; pushes that came
        # after it was full (answered when it completes, not summed); who pushed the last
        # completed round and how many live workers have yet to; that round's result and count
        self.backup = 0
        self.late_waiting: list[bytes] = []
        self.pushed_last: list[bytes] = []
        self.owed = 0
        self.held: Any = None
        self.held_count = 0
        self.deferred = False           # complete, but held back until ``owed`` is 0
        # bfloat16 travels as its uint16 bits and is summed in float32 (``wide``: the sum
        # and a scratch, allocated once per partition), then rounded into ``buffers``
        self.dtype = np.dtype(np.uint16) if dtype_code == P.BFLOAT16_CODE else P.DTYPES[dtype_code]
        self.wide: tuple[np.ndarray, np.ndarray] | None = None
        self.round = 0
        self.received = 0
        self.waiting: list[bytes] = []
        self.summed = 0
        self.first: np.ndarray | None = None
        self.buffers: list[np.ndarray] | None = None
        self.result: Any = None
        self.first_push_ns = 0              # traced rounds: when the round's first push came
        self.traced = False                 # a worker traces this round (engine/trace.py)
        self.adopted = False                # moved here from a lost server mid-job
        self.leaving: list[int] = []        # ranks lost after pushing this round: not next
        self.widened = False                # this round's bf16 sum is in ``wide`` (float32)
        self.codec: ServerCodec | None = None   # compressed pushes: decompress, sum, recompress
        # shared memory with workers on this host (engine/shmlink.py): where the sum buffers
        # come from (set by a local worker's first push) and their references; the round's
        # first push, if it came through shared memory (a sum of one push is that push's slot);
        # whether such a sum is copied into a buffer anyway (backup workers: another worker
        # may read it after its pusher rewrote the slot)
        self.shm_alloc: Any = None
        self.shm_refs: list[bytes] | None = None
        self.first_ref: tuple[bytes, bytes] | None = None      # (pusher's rid, its REF)
        self.copy_single = False
        # PUSH_ZERO: pushes of this round folded in (the others were zeros), and whether the
        # first of them is a view of its pusher's shared memory (copied before others read it)
        self.folded = 0
        self.first_shared = False
        # REDUCE_BROADCAST (on the I/O thread): this round's root as each pusher names it
        # (rank -> root; a data push names its own pusher), and its data pushes
        self.claims: dict[int, int] = {}
        self.data_pushes = 0
        # pushers of this round that read nothing of its sum (P.RESULT_HEADER_ONLY): answered
        # with the RESULT header alone
        self.headers_only: set[bytes] = set()
        # the last completed round: (round, RESULT header, sum), answered again to a pusher
        # whose connection came back before that answer reached it (I/O thread). The sum's
        # buffer is not reused before every pusher of that round has pushed the next one
        self.last: tuple[int, bytes, Any] | None = None
        # the connections that round's sum went to, once a connection has come back (only
        # those ask again): a push of the round that crossed its answer is not answered twice
        self.answered: list[bytes] = []
        # the summation thread it takes (-1: the I/O thread's): the first round of a partition
        # moved here from a lost server is summed inline all the same, since a lost server's
        # last sum (LAST_SUM) may take the place of its pushes
        self.threaded = thread

    def quorum(self) -> int:
        """Pushes that complete this round: every expected one, less the backup workers'."""
        return max(1, self.expected - self.backup)

    def accumulate(self, payload: Any, num_workers: int) -> bool:
        """Add one push (:data:`ZERO`: a PUSH_ZERO, counted, not folded in); return True when
        the round's sum is complete (in ``result``)."""
        if payload is ZERO:
            self.summed += 1
            return self.finish(num_workers)
        if self.codec is not None:
            self.codec.add(payload, self.summed == 0, self.part, self.round)
            self.summed += 1
            return self.finish(num_workers)
        arr = np.frombuffer(payload, dtype=self.dtype)
        if self.dtype_code == P.BFLOAT16_CODE and num_workers > 1:
            return self._accumulate_bf16(arr, num_workers)
        if self.folded == 0:
            self.first = arr
            self.first_shared = isinstance(payload, np.ndarray)     # a view of shared memory
        else:
            out = self._buffer()
            if self.first is not None:          # the second push: first + second
                self.combine(self.first, arr, out=out)
                self.first = None
            else:
                self.combine(out, arr, out=out)
        self.folded += 1
        self.summed += 1
        return self.finish(num_workers)

    def finish(self, num_workers: int) -> bool:
        """Whether the round's sum is complete with ``num_workers`` pushes (fewer than the
        round began with, when workers were lost); if so it is in ``result``."""
        if self.summed < max(1, num_workers):
            return False
        if self.codec is not None:
            self.result = self.codec.finish(self.part, self.round)
        elif self.widened:
            assert self.wide is not None
            total, scratch = self.wide
            self.result = P.bf16_round(total, scratch.view(np.uint32), self._buffer())
            self.widened = False
        elif self.first is not None and (self.copy_single or
                                         (self.first_shared and self.summed > 1)):
            # others read this one push (PUSH_ZERO from the rest): not from its pusher's
            # slot, which it may rewrite once it has its own answer
            self.result = self._buffer()
            np.copyto(self.result, self.first)
        elif self.first is None and self.folded == 0:
            self.result = self._buffer()            # every push was a PUSH_ZERO
            self.result.fill(0)
        else:
            self.result = self.first if self.first is not None else self._buffer()
        self.first = None
        self.folded = 0
        return True

    def _buffer(self) -> np.ndarray:
        """This round's sum: two (three) buffers, used in turn by round, allocated on first use."""
        if self.buffers is None:
            count = self.nbytes // self.dtype.itemsize
            shared = self.shm_alloc(self) if self.shm_alloc is not None else None
            if shared is not None:
                self.buffers, self.shm_refs = shared
            else:
                self.buffers = [np.empty(count, self.dtype) for _ in range(self.rotation)]
        return self.buffers[self.round % self.rotation]

    def _accumulate_bf16(self, arr: np.ndarray, num_workers: int) -> bool:
        if self.wide is None:
            count = self.nbytes // 2
            self.wide = (np.empty(count, np.float32), np.empty(count, np.float32))
        total, scratch = self.wide
        self.widened = True
        if self.folded == 0:
            P.bf16_widen(arr, total)
        else:
            self.combine(total, P.bf16_widen(arr, scratch), out=total)
        self.folded += 1
        self.summed += 1
        return self.finish(num_workers)


class AsyncPartition:
    """One partition's parameters under asynchronous training (``FLAG_ASYNC``; docs/design.md
    §5): the first init push sets them; each gradient push is applied at once as one step of
    ``torch.optim.SGD`` with the hyperparameters it carries (weight decay added to the
    gradient, a momentum buffer with dampening, Nesterov), in place, and answered with the
    parameters after it. ``applied`` (rank -> the last round of that worker's pushes taken)
    belongs to the I/O thread. ``params``, ``momentum`` and ``scratch`` belong to the thread
    that applies: the I/O thread for a small partition; for a large one its summation thread,
    under ``lock``, which the I/O thread takes too while it sends the parameters (``answers``:
    pushes applied there and not yet answered, in order)."""

    __slots__ = ("part", "dtype_code", "dtype", "nbytes", "thread", "applied", "params",
                 "momentum", "scratch", "lock", "answers")

    def __init__(self, part: int, dtype_code: int, nbytes: int, thread: int):
        self.part, self.dtype_code, self.nbytes, self.thread = part, dtype_code, nbytes, thread
        self.dtype = P.DTYPES[dtype_code]
        self.applied: dict[int, int] = {}
        self.params = np.zeros(nbytes // self.dtype.itemsize, self.dtype)
        self.momentum: np.ndarray | None = None     # from the first update with momentum on
        self.scratch: tuple[np.ndarray, np.ndarray] | None = None     # from the first update
        self.lock = threading.Lock()
        self.answers: collections.deque[tuple[bytes, int]] = collections.deque()

    def apply(self, payload: Any, hyper: tuple[float, float, float, float, bool] | None) -> None:
        """One push: with ``hyper`` a gradient (one SGD step), without it the initial
        parameters; a ``payload`` of None (a push applied already) changes nothing.
        Preallocated buffers only: nothing is allocated per push."""
        if payload is None:
            return
        values = np.frombuffer(payload, dtype=self.dtype)
        params = self.params
        if hyper is None:
            np.copyto(params, values)
            return
        lr, momentum, weight_decay, dampening, nesterov = hyper
        if self.scratch is None:
            self.scratch = (np.empty_like(params), np.empty_like(params))
        step, product = self.scratch
        grad = values                   # the payload's memory: read, never written
        if weight_decay:
            np.multiply(params, weight_decay, out=step)
            grad = np.add(grad, step, out=step)
        if momentum:
            buf = self.momentum
            if buf is None:             # as torch: the first buffer is the gradient itself
                self.momentum = buf = grad.copy()
            else:
                np.multiply(buf, momentum, out=buf)
                if dampening:
                    np.add(buf, np.multiply(grad, 1 - dampening, out=product), out=buf)
                else:
                    np.add(buf, grad, out=buf)
            if nesterov:
                grad = np.add(grad, np.multiply(buf, momentum, out=product), out=step)
            else:
                grad = buf
        np.subtract(params, np.multiply(grad, lr, out=product), out=params)


class Server:
    def __init__(self, config: Config):
        self.config = config
        self.log = setup_process_logging("server")
        if jemalloc_loaded():
            self.log.info("allocator: jemalloc (BPSCTL_SERVER_MALLOC=glibc for glibc's malloc)")
        else:
            keep_large_buffers()
            why = ("BPSCTL_SERVER_MALLOC=glibc" if config.server_malloc == "glibc" else
                   "jemalloc is not installed; with it RSS does not ratchet up under load: "
                   "apt-get install libjemalloc2")
            self.log.info("allocator: glibc's malloc (%s)", why)
        self.ctx = zmq.Context(io_threads=config.zmq_io_threads)
        self.security = Security(config.security, config.secret)
        self.zap = self.security.start_zap(self.ctx, "a server", self.log)
        self.sock, self.port = bound_router(self.ctx, config.host, config.port, self.security)
        self.gate = self.security.gate("a server", self.log)       # named once it has a rank
        self.rank = -1
        self.scheduler_address = config.scheduler
        self.sched, self.sched_monitor = self._connect_scheduler()
        # a lost scheduler (docs/design.md, "Keeping going", item 4): since when, and the
        # re-registration with the one restarted in its place
        self.sched_gone: float | None = None
        self.sched_overdue_said = False         # that it has been gone too long, once
        self.sched_login: Login | None = None
        self.poller = zmq.Poller()

        self.job_id: str | None = None
        self.num_workers = 0
        self.num_hosts = 0                          # pushes per round of host-reduced partitions
        self.peers: dict[bytes, int] = {}           # worker routing id -> rank
        self.incarnations: dict[bytes, int] = {}    # worker routing id -> its rank's restarts
        self.lost_ranks: set[int] = set()           # workers the job goes on without
        self.admitted: dict[int, int] = {}          # rank -> the restart of it admitted last
        self.lost_peers: set[bytes] = set()         # connections of lost workers: ignored
        # connections that came back (a worker's HELLO again, on a new connection: the old one
        # dropped): the new ones, whose pushes of a round already counted are pushed again,
        # and the old ones, whatever still arrives from which is ignored
        self.returned: set[bytes] = set()
        self.retired: set[bytes] = set()
        self.dead: set[tuple[int, int]] = set()     # (rank, incarnation) lost: never admitted
        self.mailbox: dict[tuple[int, int], list[zmq.Frame]] = {}   # a joiner's model, till HELLO
        # pushes of a joiner not admitted here yet (connection -> its pushes' arguments, in
        # order): its donor's ADMIT comes on another connection, and may come after them
        self.unadmitted: dict[bytes, list[tuple[Any, ...]]] = {}
        # a lost server's last sums of partitions not pushed here yet (part -> round, RESULT
        # header, sum; see _last_sum)
        self.held_sums: dict[int, tuple[int, bytes, Any]] = {}
        self.backup_workers = 0                     # the job's BPSCTL_BACKUP_WORKERS
        self.late_pushes = 0                        # the job's pushes that came too late
        self.parts: dict[int, PartitionState] = {}
        self.async_parts: dict[int, AsyncPartition] = {}   # asynchronous training: parameters
        # partitions of a process set's tensors (SCOPE): part id -> the ranks that push them
        self.scopes: dict[int, frozenset[int]] = {}
        # Horovod's join (hvd.join()): ranks whose pushes every round counts as zeros; the
        # host-reduced partitions, which count hosts and are left alone (_hvd_join)
        self.joined: set[int] = set()
        self.host_parts: set[int] = set()
        # the job's timeline, when its workers trace (their HELLO names the directory); the
        # summation threads record into it too
        self.trace: Trace | None = None
        self.trace_lock = threading.Lock()
        self.clock: dict[str, int] | None = None    # the scheduler's, from the registration
        # shared memory with workers on this host (BPSCTL_SHM_SERVER; engine/shmlink.py):
        # this host's id (empty: off), the job's sum buffers, each local worker's push slots
        self.host_id = shm.host_id() if config.shm_server == "auto" else ""
        self.shm_tag = shm.cluster_tag(config.scheduler, config.secret)
        self.shm_budget = shmlink.Budget(config.shm_server_limit)
        self.shm_sums: shmlink.Segments | None = None
        self.shm_peers: dict[bytes, shmlink.Mapped] = {}
        self.shm_pushes = 0                         # the job's pushes through shared memory
        self.shm_said = False                       # a fallback to TCP, said once per job

        # summation threads report completed partitions through an inproc socket
        self.done_endpoint = f"inproc://bps-done-{id(self)}"
        self.done = make_socket(self.ctx, zmq.PULL)
        self.done.bind(self.done_endpoint)
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue()
                                                for _ in range(config.server_threads)]
        self.threads = [threading.Thread(target=self._sum_loop, args=(q,), daemon=True,
                                         name=f"bps-sum-{i}") for i, q in enumerate(self.queues)]

    # ------------------------------------------------------------------ startup

    def _connect_scheduler(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A fresh connection to the scheduler, and its monitor."""
        sock = make_socket(self.ctx, zmq.DEALER)
        self.security.protect_connecting(sock)
        watch_link(sock, self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s)
        watch = monitor(sock)
        sock.connect(f"tcp://{self.scheduler_address}")
        return sock, watch

    def _layout(self) -> dict[str, Any]:
        """REGISTER's fields of the cluster's layout: this server's planned share of the bytes
        (if its launcher gave one) and whether it shares its host with workers."""
        share = self.config.server_share
        return {"colocated": self.config.server_colocated,
                **({"share": share} if share >= 0 else {})}

    def register(self) -> None:
        """Register with the scheduler; raise EngineError by the start deadline."""
        where = f"the scheduler at {self.scheduler_address}"
        # stamped as it leaves: the registration is also a clock exchange (for traces)
        login = self.security.login(self.sched, lambda: P.control(P.REGISTER, {
            "role": "server", "host": self.config.host, "port": self.port, "pid": os.getpid(),
            "version": __version__, "spare": self.config.spare, "clock_ns": now_ns(),
            "host_id": self.host_id, **self._layout()}), where)
        deadline = time.monotonic() + self.config.start_timeout_s
        connected = False
        while time.monotonic() < deadline:
            events = monitor_events(self.sched_monitor)
            if handshake_failed(events):
                raise refused_handshake(where, self.security)
            connected |= zmq.EVENT_CONNECTED in events
            if self.sched.poll(100, zmq.POLLIN):
                try:
                    msg_type, msg = P.parse_control(self.sched.recv_multipart())
                    received_ns = now_ns()
                except P.ProtocolError as exc:
                    raise EngineError(f"{where} answered with a bad message: {exc}") from None
                if login.handle(msg_type, msg):
                    continue
                if msg_type == P.REGISTERED:
                    self.rank = int(msg["rank"])
                    # more exchanges than the registration's one: traces of several
                    # machines line up through this
                    self.clock = best_clock(scheduler_clock(msg, received_ns), measure_clock(
                        self.ctx, self.scheduler_address, self.security))
                    self.log = setup_process_logging(f"server {self.rank}")
                    self.gate = self.security.gate(f"server {self.rank}", self.log)
                    return
                raise EngineError(f"the scheduler at {self.scheduler_address} refused this server: "
                                  f"{msg.get('message')}")
        if not connected:
            raise EngineError(f"cannot reach the scheduler at {self.scheduler_address} within "
                              f"{self.config.start_timeout_s:g} s: nothing is listening there. "
                              "Start the cluster with `bpsctl up`, or set BPSCTL_SCHEDULER")
        raise EngineError(f"the scheduler at {self.scheduler_address} did not answer the "
                          f"registration within {self.config.start_timeout_s:g} s "
                          "(BPSCTL_START_TIMEOUT)")

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        self.register()
        for thread in self.threads:
            thread.start()
        write_ready_file(self.config.ready_file, {"host": self.config.host, "port": self.port,
                                                  "pid": os.getpid(), "rank": self.rank})
        self.log.info("serving on %s:%d with %d summation threads", self.config.host, self.port,
                      len(self.threads))
        poller = self.poller
        for sock in (self.sock, self.done, self.sched, self.sched_monitor):
            poller.register(sock, zmq.POLLIN)
        interval, release_after = self.config.heartbeat_interval_s, self.config.idle_release_s
        next_heartbeat = time.monotonic() + interval
        last_traffic, kept = 0.0, False        # kept: the allocator may hold freed messages
        try:
            while True:
                ready = dict(poller.poll(int(interval * 1000)))
                if self.sock in ready:
                    self._drain_workers()
                    last_traffic, kept = time.monotonic(), True
                if self.done in ready:
                    self._drain_done()
                if self.sched in ready:
                    self._drain_scheduler()
                if self.sched_monitor in ready and \
                        zmq.EVENT_DISCONNECTED in monitor_events(self.sched_monitor):
                    self._lost_scheduler()
                now = time.monotonic()
                if now >= next_heartbeat:
                    if self.sched_gone is None:
                        self.sched.send_multipart(P.control(P.HEARTBEAT))
                    else:
                        self._still_gone(now)
                    next_heartbeat = now + interval
                if kept and release_after and now - last_traffic >= release_after:
                    kept = False
                    released = release_free_memory()
                    self.log.info("quiet for %g s: gave %.1f MiB of free memory back to the "
                                  "system", release_after, released / 2**20)
        finally:
            for q in self.queues:
                q.put(None)
            self._write_trace()
            if self.zap is not None:
                self.zap.stop()
            # each summation thread closes its own socket once it has its None; destroy()
            # closes every socket of the context from this thread, and closing one that its
            # thread is closing too left the context's term() waiting for ever (the launcher's
            # SIGTERM then waited its whole grace before the SIGKILL)
            deadline = time.monotonic() + SUM_THREAD_STOP_S
            for thread in self.threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            self.ctx.destroy(linger=0)

    def _lost_scheduler(self) -> None:
        """The scheduler is gone: go on serving the workers (the data path does not need it)
        and register again, with this server's rank, with the scheduler restarted in its
        place (``bpsctl up``'s supervisor restarts it on the same address)."""
        now = time.monotonic()
        if self.sched_gone is None:
            self.sched_gone = now
            self.log.warning("%s; serving on, and registering again once it is back (it waits "
                             "BPSCTL_SCHEDULER_TIMEOUT=%g s before anything that needs it fails)",
                             lost_link(f"the scheduler at {self.scheduler_address}",
                                       self.config.heartbeat_timeout_s),
                             self.config.scheduler_timeout_s)
        for sock in (self.sched, self.sched_monitor):
            self.poller.unregister(sock)
        self.sched.disable_monitor()
        self.sched_monitor.close(0)
        self.sched.close(0)
        self.sched, self.sched_monitor = self._connect_scheduler()
        for sock in (self.sched, self.sched_monitor):
            self.poller.register(sock, zmq.POLLIN)
        self.sched_login = self.security.login(self.sched, P.control(P.REGISTER, {
            "role": "server", "host": self.config.host, "port": self.port, "pid": os.getpid(),
            "version": __version__, "reregister": True, "rank": self.rank,
            "job": self.job_id, "host_id": self.host_id, **self._layout()}),
            f"the scheduler at {self.scheduler_address}")

    def _still_gone(self, now: float) -> None:
        """Said once, when the scheduler has been gone for BPSCTL_SCHEDULER_TIMEOUT."""
        assert self.sched_gone is not None
        if not self.sched_overdue_said and \
                now - self.sched_gone >= self.config.scheduler_timeout_s:
            self.sched_overdue_said = True
            self.log.warning("the scheduler at %s has been gone for %.0f s "
                             "(BPSCTL_SCHEDULER_TIMEOUT): serving the workers still connected; "
                             "a lost worker or server cannot be handled until it is back",
                             self.scheduler_address, now - self.sched_gone)

    def _registered_again(self, msg: dict[str, Any]) -> None:
        assert self.sched_gone is not None
        if int(msg.get("rank", -1)) != self.rank:
            raise EngineError(f"the restarted scheduler at {self.scheduler_address} gave server "
                              f"{self.rank} rank {msg.get('rank')}; stopping")
        self.log.warning("registered again with the restarted scheduler at %s, %.1f s after "
                         "losing it", self.scheduler_address, time.monotonic() - self.sched_gone)
        self.sched_gone, self.sched_login, self.sched_overdue_said = None, None, False

    def _drain_workers(self) -> None:
        sock = self.sock
        # at most half a heartbeat interval at a time (summing and recompressing inline can
        # be slow): the rest is read on the next turn of the loop, after the heartbeat
        give_way = time.monotonic() + self.config.heartbeat_interval_s / 2
        while time.monotonic() < give_way:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid = frames[0].bytes
            try:
                if len(frames) < 2:
                    raise P.ProtocolError("message without a header")
                msg_type, dtype, flags, rank, part, round_, nbytes = P.unpack_header(
                    frames[1].buffer)
                if msg_type == P.PUSH:
                    self._push(rid, dtype, flags, part, round_, nbytes, frames,
                               header_only=bool(rank & P.RESULT_HEADER_ONLY))
                elif msg_type == P.PUSH_ZERO:
                    self._push(rid, dtype, flags, part, round_, nbytes, frames,
                               claim=rank & ~P.RESULT_HEADER_ONLY,
                               header_only=bool(rank & P.RESULT_HEADER_ONLY))
                elif msg_type == P.STATE:
                    self._state(rid, rank, round_, frames)
                elif msg_type == P.LAST_SUM:
                    self._last_sum(rid, dtype, rank, part, round_, nbytes, frames)
                elif msg_type == P.ADMIT:
                    _, body = P.parse_control([frame.buffer for frame in frames[1:]])
                    self._admit(rid, body)
                elif msg_type == P.SCOPE:
                    _, body = P.parse_control([frame.buffer for frame in frames[1:]])
                    self._scope(rid, body)
                elif msg_type in (P.HELLO, P.AUTH, P.PROOF):
                    _, body = P.parse_control([frame.buffer for frame in frames[1:]])
                    if msg_type == P.HELLO:
                        self._hello(rid, body)
                    elif (reply := self.gate.handle(rid, msg_type, body)) is not None:
                        self._send(rid, *reply)
                else:
                    raise P.ProtocolError(f"unexpected message type {msg_type}")
            except P.ProtocolError as exc:
                self._error(rid, f"server {self.rank} rejected a message: {exc}")
            except Exception:       # a bug: say so loudly, and go on serving everyone else
                self.log.exception("bug: failed on a message; the server goes on")
                self._error(rid, f"server {self.rank} failed on this message (a bpsctl bug; its "
                                 "log has the details)")

    def _send(self, rid: bytes, msg_type: int, body: dict[str, Any]) -> None:
        if msg_type == P.ERROR:
            self.log.warning(body["message"])
        try:
            self.sock.send_multipart([rid, *P.control(msg_type, body)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _error(self, rid: bytes, message: str) -> None:
        self._send(rid, P.ERROR, {"message": message})

    def _hello(self, rid: bytes, msg: dict[str, Any]) -> None:
        if not self.gate.admit(rid):
            self._error(rid, self.gate.refusal()["message"])
            return
        if msg.get("version") != __version__:
            self._error(rid, version_mismatch(msg.get("version"), f"server {self.rank}"))
            return
        job = P.str_field(msg, "job")
        world_size = P.int_field(msg, "world_size", 1, P.MAX_WORKERS)
        hosts = P.int_field(msg, "hosts", 1, world_size, default=world_size)
        max_workers = P.int_field(msg, "max_workers", 0, P.MAX_WORKERS, default=0)
        rank = P.int_field(msg, "rank", 0, max(world_size, max_workers) - 1)
        incarnation = P.int_field(msg, "incarnation", 0, 1 << 30, default=0)
        backup = P.int_field(msg, "backup_workers", 0, max(0, world_size - 1), default=0)
        if job != self.job_id:
            self._reset(job, world_size, hosts, backup, max_workers)
        elif backup != self.backup_workers:
            raise P.ProtocolError(f"rank {rank} has {backup} backup workers, the job's first "
                                  f"worker {self.backup_workers}: every worker of a job must "
                                  "have the same BPSCTL_BACKUP_WORKERS")
        if (rank, incarnation) in self.dead:
            self._error(rid, f"server {self.rank}: worker {rank} (restart {incarnation}) was "
                             "declared lost")
            return
        trace_dir = msg.get("trace_dir")
        if isinstance(trace_dir, str) and trace_dir and self.trace is None:
            self.trace = Trace(Path(trace_dir) / f"server-{self.rank}" / "comm.json", "server",
                               self.rank)
            self.trace.scheduler_clock = self.clock
            warning = attach_nic(self.trace, self.config.trace_nic, self.config.host,
                                 self.config.nic_mbit)
            if warning:
                self.log.warning(warning)
        old = next((peer for peer, r in self.peers.items() if r == rank and peer != rid
                    and self.incarnations.get(peer) == incarnation
                    and peer not in self.lost_peers), None)
        if old is not None:
            self._came_back(old, rid, rank)
        self.peers[rid] = rank
        self.incarnations[rid] = incarnation
        if self.host_id and msg.get("shm") == self.host_id:
            # a worker on this host: its pushes may name slots of its segments
            self.shm_peers[rid] = shmlink.Mapped(shmlink.worker_base(
                self.shm_tag, job, rank, incarnation, self.rank), writable=False, unlink=True)
            if self.shm_sums is None:
                self.shm_sums = shmlink.Segments(shmlink.server_base(self.shm_tag, job,
                                                                     self.rank), self.shm_budget)
        state = self.mailbox.pop((rank, incarnation), None)
        if state is not None:
            self._relay_state(rid, state)

    def _reset(self, job_id: str | None, num_workers: int, num_hosts: int = 0,
               backup_workers: int = 0, max_workers: int = 0) -> None:
        self._write_trace()
        if self.shm_pushes:
            self.log.info("job %s: %d pushes came through shared memory", self.job_id,
                          self.shm_pushes)
        self.shm_pushes, self.shm_said = 0, False
        if self.shm_sums is not None:
            self.shm_sums.close()
            self.shm_sums = None
        for mapped in self.shm_peers.values():
            mapped.close()
        self.shm_peers = {}
        if self.late_pushes:
            self.log.info("job %s: %d pushes came after their round was complete (backup "
                          "workers): dropped from the sums", self.job_id, self.late_pushes)
        self.job_id, self.num_workers, self.num_hosts = job_id, num_workers, num_hosts
        self.backup_workers, self.late_pushes = backup_workers, 0
        self.peers = {}
        self.incarnations = {}
        self.parts = {}
        self.async_parts = {}
        self.scopes = {}
        self.joined, self.host_parts = set(), set()
        # ranks the job may grow into (`bpsctl run --attach`) count as lost until a donor
        # admits them: a new worker joins exactly as a restarted one rejoins
        self.lost_ranks = set(range(num_workers, max_workers))
        self.admitted = {}
        self.lost_peers = set()
        self.returned, self.retired = set(), set()
        self.dead = set()
        self.mailbox = {}
        self.unadmitted = {}
        self.held_sums = {}

    def _write_trace(self) -> None:
        """The finished job's timeline, if it was traced (a server outlives its jobs)."""
        if self.trace is not None:
            with self.trace_lock:
                try:
                    if self.trace.count:
                        self.trace.close()
                    elif self.trace.nic is not None:
                        self.trace.nic.stop()       # nothing traced: no file, no sampler
                except OSError as exc:
                    self.log.warning("cannot write the trace %s: %s", self.trace.path, exc)
                self.trace = None

    def _push(self, rid: bytes, dtype: int, flags: int, part: int, round_: int, nbytes: int,
              frames: list[zmq.Frame], claim: int | None = None,
              header_only: bool = False) -> None:
        """A PUSH, or (``claim``: its header's rank field) a PUSH_ZERO: counted as a push of
        the round, answered as one, with nothing folded into the sum. ``header_only``
        (P.RESULT_HEADER_ONLY): its pusher reads nothing of the sum; a plain sum's only."""
        if rid in self.retired:
            return          # sent on a connection that dropped: pushed again on its new one
        rank = self.peers.get(rid)
        if rank is None:
            raise P.ProtocolError("push from a connection that has not said HELLO (after proving "
                                  "the cluster secret)")
        if rid in self.lost_peers:
            return          # sent before it was lost: the rounds already go on without it
        if rank in self.lost_ranks:
            # a restarted (or attached) worker that this server has not admitted yet: it may
            # push before its donor's ADMIT arrives (another connection; the donor's link to
            # this server may even be down). Counted now, it would complete a round without
            # the donor's push; it waits for the ADMIT instead (or for the joiner's loss)
            self.unadmitted.setdefault(rid, []).append(
                (dtype, flags, part, round_, nbytes, frames, claim, header_only))
            return
        if self.joined and rank in self.joined:
            raise P.ProtocolError(f"rank {rank} pushed partition {part} while it has joined "
                                  "(hvd.join()): a joined rank pushes nothing until every rank "
                                  "has joined")
        dtype, reduction = P.split_push_dtype(dtype)
        if reduction not in P.REDUCTIONS or (reduction != P.REDUCE_SUM and flags & (
                P.FLAG_ASYNC | P.FLAG_COMPRESSED | P.FLAG_HOST_REDUCED | P.FLAG_BACKUP)):
            raise P.ProtocolError(f"push of partition {part} asks for reduction {reduction}, "
                                  "which is unknown or not allowed with its flags "
                                  f"({flags:#x}): only sums are averaged, compressed, "
                                  "host-reduced or asynchronous")
        if header_only and (reduction != P.REDUCE_SUM or flags & (
                P.FLAG_ASYNC | P.FLAG_COMPRESSED | P.FLAG_HOST_REDUCED | P.FLAG_BACKUP)):
            raise P.ProtocolError(f"push of partition {part} asks for its result's header "
                                  f"alone with flags {flags:#x}, reduction {reduction}: only "
                                  "a plain sum's pusher may read nothing of it")
        payload: Any = ZERO
        if claim is not None:
            self._check_zero(flags, part, reduction, frames)
        elif flags & P.FLAG_ASYNC:
            self._async_push(rid, rank, dtype, flags, part, round_, nbytes, frames)
            return
        elif len(frames) != 3:
            raise P.ProtocolError(f"push of partition {part} announces {nbytes} bytes but carries "
                                  "no payload")
        else:
            payload = frames[2]
            if flags & P.FLAG_SHM:
                payload = self._shm_payload(rid, rank, flags, part, nbytes, frames[2])
            if len(payload) != nbytes:
                raise P.ProtocolError(f"push of partition {part} announces {nbytes} bytes but "
                                      f"carries {len(payload)}")
        compressed = bool(flags & P.FLAG_COMPRESSED)
        if dtype >= len(P.DTYPES) or (not compressed and nbytes % P.DTYPES[dtype].itemsize):
            raise P.ProtocolError(f"push of partition {part} has a bad dtype code {dtype} for "
                                  f"{nbytes} bytes")
        expected = self.num_hosts if flags & P.FLAG_HOST_REDUCED else self.num_workers
        if self.scopes and part in self.scopes:
            expected = self._scoped_pushers(rank, part, flags)
        state = self.parts.get(part)
        if state is None:
            if part in self.async_parts:
                raise P.ProtocolError(f"partition {part}: rank {rank} pushed it to be summed, "
                                      "but it holds parameters of asynchronous training: a "
                                      "tensor is either summed or trained asynchronously; use "
                                      "another name")
            rotation = 3 if self.backup_workers else 2
            codec = ServerCodec.open(frames[2].buffer, nbytes, rotation) if compressed else None
            work = nbytes if codec is None else 4 * codec.count
            thread = part % len(self.queues) if work >= THREADED_SUM_BYTES else -1
            state = self.parts[part] = PartitionState(part, dtype, nbytes, thread, expected,
                                                      rotation, reduction)
            if flags & P.FLAG_HOST_REDUCED:
                self.host_parts.add(part)
            state.codec = codec
            # a partition moved here from a lost server starts at the round its workers
            # (re-)push, with an empty sum: each of them pushes its own contribution again
            state.round, state.adopted = round_, round_ > 0
            if state.adopted:
                state.thread = -1           # (see PartitionState.threaded)
                held = self.held_sums.pop(part, None)
                if held is not None and held[0] in (round_ - 1, round_):
                    state.last = held
                    state.round = held[0] + 1       # a push of the held round: answered below
        elif (state.dtype_code != dtype or state.nbytes != nbytes
              or state.reduction != reduction
              or (not self.lost_ranks and not self.joined and state.expected != expected)
              or (state.codec is not None) != compressed):
            raise P.ProtocolError(
                f"partition {part}: rank {rank} pushed {nbytes} bytes of {P.DTYPES[dtype]} "
                f"(reduced by {P.REDUCTIONS[reduction]}, host-reduced: "
                f"{bool(flags & P.FLAG_HOST_REDUCED)}, compressed: {compressed}) but earlier "
                f"pushes had {state.nbytes} bytes of {P.DTYPES[state.dtype_code]} (reduced by "
                f"{P.REDUCTIONS[state.reduction]}, from {state.expected} pushers, compressed: "
                f"{state.codec is not None})")
        if state.codec is not None:
            state.codec.check(frames[2].buffer, part)
        if rid in self.returned and self._pushed_again(state, rid, round_, header_only):
            return
        if round_ != state.round:
            if state.owed and round_ + 1 == state.round and rid not in state.pushed_last:
                self._late(state, rid, rank, round_)
                return
            last = state.last
            if state.adopted and last is not None and last[0] == round_ and \
                    round_ + 1 == state.round:
                # the lost server's last sum did not reach this worker; another worker's copy
                # of it did come (LAST_SUM)
                self.log.info("partition %d: rank %d lacked round %d's sum from the lost server "
                              "that held it; answered with a copy another worker handed over",
                              part, rank, round_)
                if header_only:
                    self._send_header(rid, last[1])
                else:
                    self._send_result(rid, last[1], last[2], None)
                return
            if state.adopted:
                raise P.ProtocolError(
                    f"partition {part} moved to server {self.rank} from a lost server, whose "
                    f"last sum reached some workers but not all: rank {rank} pushed round "
                    f"{round_}, others round {state.round}, and no worker it reached handed "
                    "it over (compressed, shared-memory and backup workers' sums are not "
                    "kept). That sum is gone; the job cannot go on from here (restart it from "
                    "a checkpoint)")
            raise P.ProtocolError(f"partition {part}: rank {rank} pushed round {round_}, "
                                  f"the server is at round {state.round}")
        if rid in state.waiting or rid in state.late_waiting:
            # counted twice it would complete the round without another worker's push
            raise P.ProtocolError(f"partition {part}: rank {rank} pushed round {round_} twice "
                                  "(a push_pull retried after it failed?)")
        if state.received == 0:
            # sums (broadcasts: the root's values and everyone's zeros) wait for every worker
            state.backup = self.backup_workers if flags & P.FLAG_BACKUP and \
                not flags & P.FLAG_HOST_REDUCED else 0
        self._ack(rid, part, round_)
        if state.received >= state.quorum():
            # the round is complete without it: answered with its result, not summed
            state.late_waiting.append(rid)
            self._count_late(state, rank, round_)
            return
        state.received += 1
        state.waiting.append(rid)
        if header_only:
            state.headers_only.add(rid)
        if reduction == P.REDUCE_BROADCAST:
            state.claims[rank] = rank if claim is None else claim
            state.data_pushes += claim is None
        if flags & P.FLAG_SHM:
            if state.received == 1:
                state.first_ref = (rid, frames[2].bytes)
            if state.buffers is None and self.shm_sums is not None:
                state.shm_alloc = self._shm_buffers
            state.copy_single = state.copy_single or bool(self.backup_workers)
        traced = bool(flags & P.FLAG_TRACED) and self.trace is not None
        if traced:
            self._trace_arrival(state, rank)
        if state.thread < 0:
            if self._accumulate(state, payload, state.quorum(), rank, traced):
                self._complete(state)
        else:
            self.queues[state.thread].put((state, payload, state.quorum(), rank, traced))

    @staticmethod
    def _check_zero(flags: int, part: int, reduction: int, frames: list[zmq.Frame]) -> None:
        """ProtocolError naming what a PUSH_ZERO cannot be: zeros are the identity of a sum
        (and of a broadcast's non-roots) only, and a round that is compressed, host-reduced
        (one push per host, summed before) or asynchronous has no place for one."""
        if len(frames) != 2:
            raise P.ProtocolError(f"PUSH_ZERO of partition {part} carries {len(frames) - 2} "
                                  "frames after its header; it has none")
        if flags & ~(P.FLAG_TRACED | P.FLAG_BACKUP):
            raise P.ProtocolError(f"PUSH_ZERO of partition {part} with flags {flags:#x}: a zero "
                                  "push is never compressed, host-reduced, asynchronous or "
                                  "through shared memory")
        if reduction not in P.ZERO_REDUCTIONS:
            raise P.ProtocolError(f"PUSH_ZERO of partition {part} reduced by "
                                  f"{P.REDUCTIONS[reduction]}: zeros are the identity of a sum "
                                  "only; push the values")

    def _shm_payload(self, rid: bytes, rank: int, flags: int, part: int, nbytes: int,
                     frame: zmq.Frame) -> np.ndarray:
        """The bytes of a push through shared memory: a view of the slot its REF names in the
        pusher's segment, summed from in place (never copied)."""
        peer = self.shm_peers.get(rid)
        if peer is None:
            raise P.ProtocolError(f"rank {rank} pushed partition {part} through shared memory, "
                                  f"but its HELLO did not say it runs on server {self.rank}'s "
                                  "host")
        if flags & P.FLAG_COMPRESSED or len(frame) != shmlink.REF.size:
            raise P.ProtocolError(f"shared-memory push of partition {part}: expected a "
                                  f"{shmlink.REF.size}-byte reference to uncompressed bytes, "
                                  f"got {len(frame)} bytes, flags {flags:#x}")
        owner, chunk, offset = shmlink.REF.unpack(frame.buffer)
        if owner != shmlink.PUSHER:
            raise P.ProtocolError(f"shared-memory push of partition {part} names segment "
                                  f"owner {owner}, not its pusher's")
        try:
            view = peer.view(chunk, offset, nbytes)
        except ValueError as exc:
            raise P.ProtocolError(f"shared-memory push of partition {part}: {exc}") from None
        self.shm_pushes += 1
        return view

    def _shm_buffers(self, state: PartitionState) -> tuple[list[np.ndarray], list[bytes]] | None:
        """A partition's sum buffers in the job's shared segments, which local workers map
        (on the thread that sums it); None, for buffers of the heap and answers over TCP,
        when BPSCTL_SHM_SERVER_BYTES has no room left or /dev/shm is full (said once per job)."""
        sums = self.shm_sums
        if sums is None:
            return None
        buffers, refs = [], []
        try:
            for _ in range(state.rotation):
                got = sums.allocate(state.nbytes)
                if got is None:
                    if not self.shm_said:
                        self.shm_said = True
                        self.log.info("job %s: sums beyond %s of shared memory go to local "
                                      "workers over TCP (from partition %d on)", self.job_id,
                                      self.shm_budget.describe(), state.part)
                    return None
                chunk, offset, view = got
                buffers.append(view.view(state.dtype))
                refs.append(shmlink.REF.pack(shmlink.SERVER_SUMS, chunk, offset))
        except EngineError as exc:
            if not self.shm_said:
                self.shm_said = True
                self.log.warning("%s; sums go to local workers over TCP", exc)
            return None
        return buffers, refs

    def _shm_ref(self, state: PartitionState, result: Any, round_: int,
                 rid: bytes) -> bytes | None:
        """Where a local worker finds ``result`` (round ``round_``'s) in shared memory: one of
        the partition's shared sum buffers, or its own push slot when the sum is its push
        alone; None when the result lives elsewhere (it then goes over TCP)."""
        if rid not in self.shm_peers:
            return None
        if state.shm_refs is not None and state.buffers is not None:
            index = round_ % state.rotation
            if result is state.buffers[index]:
                return state.shm_refs[index]
            if any(result is buffer for buffer in state.buffers):
                return None
        first = state.first_ref     # this round's only push, answered to its own pusher
        if first is not None and first[0] == rid and round_ == state.round and \
                state.received == 1:
            return first[1]
        return None

    def _ack(self, rid: bytes, part: int, round_: int) -> None:
        """Acknowledge a push. A pusher that vanished since it pushed is as an ACK lost on its
        way: its push counts as any other, and its loss is the scheduler's to tell."""
        try:
            self.sock.send_multipart([rid, P.pack_header(P.ACK, part=part, round=round_)])
        except zmq.ZMQError:
            pass

    def _send_header(self, rid: bytes, header: bytes) -> None:
        """A RESULT's header alone, to a pusher that reads nothing of the sum
        (P.RESULT_HEADER_ONLY): the round is complete."""
        try:
            self.sock.send_multipart([rid, header])
        except zmq.ZMQError:
            pass    # that worker is gone; the scheduler tells the others

    def _send_result(self, rid: bytes, header: bytes, result: Any, ref: bytes | None) -> None:
        """A RESULT: its bytes zero-copy over TCP, or (``ref``) where they are in shared
        memory."""
        try:
            self.sock.send(rid, zmq.SNDMORE)
            if ref is None:
                self.sock.send(header, zmq.SNDMORE)
                self.sock.send(result, copy=False)
            else:
                self.sock.send(P.with_flag(header, P.FLAG_SHM), zmq.SNDMORE)
                self.sock.send(ref)
        except zmq.ZMQError:
            pass    # that worker is gone; the scheduler tells the others

    def _async_push(self, rid: bytes, rank: int, dtype: int, flags: int, part: int, round_: int,
                    nbytes: int, frames: list[zmq.Frame]) -> None:
        """A push of asynchronous training: applied to the partition's parameters now (inline,
        or queued for its summation thread, behind the pushes before it) unless this worker's
        push of that round was taken already (a re-push: answered, not applied again); then
        answered with the parameters."""
        init = bool(flags & P.FLAG_ASYNC_INIT)
        if flags & ~(P.FLAG_ASYNC | P.FLAG_ASYNC_INIT | P.FLAG_TRACED):
            raise P.ProtocolError(f"async push of partition {part} with flags {flags:#x}: "
                                  "asynchronous training is never compressed, host-reduced or "
                                  "backed up")
        what = "parameters" if init else "gradient, then its hyperparameters"
        if len(frames) != (3 if init else 4) or len(frames[2]) != nbytes:
            raise P.ProtocolError(f"async push of partition {part} announces {nbytes} bytes of "
                                  f"{what}, but carries {len(frames) - 2} frames "
                                  f"of {[len(f) for f in frames[2:]]} bytes")
        if dtype >= len(P.DTYPES) or P.DTYPES[dtype] not in ASYNC_DTYPES or \
                nbytes % P.DTYPES[dtype].itemsize:
            raise P.ProtocolError(f"async push of partition {part}: servers hold float32 or "
                                  f"float64 parameters, got dtype code {dtype} for {nbytes} "
                                  "bytes")
        hyper = None if init else self._hyperparameters(frames[3], part)
        state = self.async_parts.get(part)
        fresh = state is None
        if state is None:
            if part in self.parts:
                raise P.ProtocolError(f"partition {part}: rank {rank} pushed it for "
                                      "asynchronous training, but earlier pushes summed it: a "
                                      "tensor is either summed or trained asynchronously; use "
                                      "another name")
            if not init:
                raise P.ProtocolError(f"partition {part}: rank {rank}'s async push came before "
                                      "any init push (FLAG_ASYNC_INIT): the server has no "
                                      "parameters to update")
            thread = part % len(self.queues) if nbytes >= THREADED_SUM_BYTES else -1
            state = self.async_parts[part] = AsyncPartition(part, dtype, nbytes, thread)
        elif state.dtype_code != dtype or state.nbytes != nbytes:
            raise P.ProtocolError(f"partition {part}: rank {rank} pushed {nbytes} bytes of "
                                  f"{P.DTYPES[dtype]}, but its parameters are {state.nbytes} "
                                  f"bytes of {state.dtype}")
        self._ack(rid, part, round_)
        payload = None                  # nothing to apply: answered with the parameters
        if round_ > state.applied.get(rank, -1):
            state.applied[rank] = round_
            if fresh or not init:       # the first init push sets the parameters
                payload = frames[2]
        if state.thread < 0:
            state.apply(payload, hyper)
            self._send_params(state, rid, round_)
        else:
            self.queues[state.thread].put((state, payload, hyper, rid, round_))

    @staticmethod
    def _hyperparameters(frame: zmq.Frame, part: int) -> tuple[float, float, float, float, bool]:
        if len(frame) != P.ASYNC_HYPER.size:
            raise P.ProtocolError(f"async push of partition {part}: hyperparameters of "
                                  f"{len(frame)} bytes, expected {P.ASYNC_HYPER.size}")
        lr, momentum, weight_decay, dampening, nesterov = P.ASYNC_HYPER.unpack(frame.buffer)
        if not all(map(math.isfinite, (lr, momentum, weight_decay, dampening))) or nesterov > 1:
            raise P.ProtocolError(f"async push of partition {part}: hyperparameters lr={lr}, "
                                  f"momentum={momentum}, weight_decay={weight_decay}, "
                                  f"dampening={dampening}, nesterov={nesterov} are not finite "
                                  "numbers and a flag")
        return lr, momentum, weight_decay, dampening, bool(nesterov)

    def _send_params(self, state: AsyncPartition, rid: bytes, round_: int) -> None:
        """Answer a push of asynchronous training with the partition's parameters now. They are
        copied as they are sent (into libzmq's own message; no Python object): the next push
        changes them in place, so a zero-copy send could carry a later update, or half of one."""
        try:
            self.sock.send(rid, zmq.SNDMORE)
            self.sock.send(P.pack_header(P.RESULT, dtype=state.dtype_code, flags=P.FLAG_ASYNC,
                                         rank=1, part=state.part, round=round_,
                                         nbytes=state.nbytes), zmq.SNDMORE)
            self.sock.send(state.params.data, copy=True)
        except zmq.ZMQError:
            pass        # that worker is gone

    def _answer_applied(self, state: AsyncPartition | None) -> None:
        """Pushes the summation thread has applied: answered in order, with the parameters
        held still meanwhile."""
        if state is None:
            return
        with state.lock:
            while state.answers:
                self._send_params(state, *state.answers.popleft())

    def _came_back(self, old: bytes, new: bytes, rank: int) -> None:
        """Worker ``rank`` said HELLO again on a new connection while its old one is still
        known here: the old one dropped (a link cut, or a pause past the heartbeat timeout)
        and ZeroMQ connected again. The new connection takes the old one's place in every
        round; the worker pushes again what was not answered (:meth:`_pushed_again`)."""
        self.retired.add(old)
        self.returned.add(new)
        self.unadmitted.pop(old, None)      # never counted: pushed again on the new one
        del self.peers[old]
        del self.incarnations[old]
        for state in self.parts.values():
            for rids in (state.waiting, state.late_waiting, state.pushed_last):
                rids[:] = [new if rid == old else rid for rid in rids]
            if old in state.headers_only:
                state.headers_only.discard(old)
                state.headers_only.add(new)
        self.log.warning("worker %d connected again (its connection dropped: a cut link or a "
                         "pause); it pushes again what was not answered, each round counted "
                         "once", rank)

    def _pushed_again(self, state: PartitionState, rid: bytes, round_: int,
                      header_only: bool) -> bool:
        """A push on a connection that came back, of a round this server already counted
        from it: acknowledged, not counted again; of the round completed last, before its sum
        reached the pusher: answered with that sum, unless that sum went out on this
        connection already (the push crossed it). False: a push to take as any other."""
        if round_ == state.round and (rid in state.waiting or rid in state.late_waiting):
            self._ack(rid, state.part, round_)
            return True
        last = state.last
        if last is None or last[0] != round_ or round_ + 1 != state.round or (
                state.owed and rid not in state.pushed_last):
            return False
        if rid in state.answered:
            return True         # sent before its sum went out on this same connection
        _, header, result = last
        if header_only:
            self._send_header(rid, header)
        else:
            self._send_result(rid, header, result, None)
        return True

    def _late(self, state: PartitionState, rid: bytes, rank: int, round_: int) -> None:
        """A push of the round before the partition's current one, which completed without it
        (backup workers): not summed; answered with that round's result, held for this."""
        self._count_late(state, rank, round_)
        header = P.pack_header(P.RESULT, dtype=state.dtype_code, part=state.part, round=round_,
                               nbytes=state.nbytes, rank=state.held_count & 0xFFFF,
                               flags=P.FLAG_LATE | (0 if state.codec is None
                                                    else P.FLAG_COMPRESSED))
        self._send_result(rid, header, state.held, self._shm_ref(state, state.held, round_, rid))
        state.pushed_last.append(rid)
        self._paid(state)

    def _paid(self, state: PartitionState) -> None:
        """One live worker fewer owes the last completed round a push; once none does, the
        round after it may complete (it may be waiting for just that)."""
        state.owed -= 1
        if state.owed == 0:
            state.held = None
            if state.deferred:
                state.deferred = False
                self._complete(state)

    def _count_late(self, state: PartitionState, rank: int, round_: int) -> None:
        if not self.late_pushes:
            self.log.info("rank %d pushed partition %d round %d after the round was complete "
                          "(backup workers: %d): dropped from the sum, answered with the "
                          "round's result; the job's count of such pushes is logged at its "
                          "end", rank, state.part, round_, self.backup_workers)
        self.late_pushes += 1

    def _trace_arrival(self, state: PartitionState, rank: int) -> None:
        now = now_ns()
        if state.received == 1:
            state.first_push_ns, state.traced = now, True
        if state.received == state.quorum() and state.traced and self.trace is not None:
            with self.trace_lock:
                self.trace.span(STAGE["wait_workers"], self.trace.name_id(f"part {state.part}"),
                                state.first_push_ns, now, state.part, state.round, state.nbytes,
                                rank)

    def _accumulate(self, state: PartitionState, payload: Any, expected: int, rank: int,
                    traced: bool) -> bool:
        """``state.accumulate``, timed when traced (on the I/O or a summation thread); a
        PUSH_ZERO sums nothing, so it has no span."""
        if not traced or payload is ZERO:
            return state.accumulate(payload, expected)
        start = now_ns()
        complete = state.accumulate(payload, expected)
        trace = self.trace
        if trace is not None:
            with self.trace_lock:
                trace.span(STAGE["sum"], trace.name_id(f"part {state.part}"), start, now_ns(),
                           state.part, state.round, state.nbytes, rank)
        return complete

    def _sum_loop(self, work: queue.SimpleQueue) -> None:
        done = make_socket(self.ctx, zmq.PUSH)
        done.connect(self.done_endpoint)
        try:
            while (item := work.get()) is not None:
                if isinstance(item[0], AsyncPartition):    # one SGD step, then answered
                    applying, payload, hyper, rid, round_ = item
                    with applying.lock:
                        applying.apply(payload, hyper)
                        applying.answers.append((rid, round_))
                    done.send(_PART_ID.pack(applying.part))
                    continue
                state, payload, num_workers, rank, traced = item
                if payload is None:         # fewer pushers now (a worker was lost): done?
                    complete = state.finish(num_workers)
                else:
                    complete = self._accumulate(state, payload, num_workers, rank, traced)
                if complete:
                    done.send(_PART_ID.pack(state.part))
        finally:
            done.close(0)

    def _drain_done(self) -> None:
        while True:
            try:
                part, = _PART_ID.unpack(self.done.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            state = self.parts.get(part)
            if state is None:
                self._answer_applied(self.async_parts.get(part))
            elif state.result is not None:
                self._complete(state)

    def _complete(self, state: PartitionState) -> None:
        if state.owed:
            # a late worker has not yet pushed the last round (and got its result): this one
            # waits for that push, so no worker falls more than one round behind
            state.deferred = True
            return
        # the rank field says how many pushes the sum holds (averages divide by it), joined
        # ranks' zeros included (Horovod divides by every rank)
        count, result = state.received, state.result
        if self.joined and state.part not in self.host_parts:
            count, result = self._with_zeros(state, result)
        header = P.pack_header(P.RESULT, dtype=state.dtype_code, part=state.part,
                               round=state.round, nbytes=state.nbytes,
                               rank=count & 0xFFFF,
                               flags=0 if state.codec is None else P.FLAG_COMPRESSED)
        start = now_ns() if state.traced else 0
        refused = self._refused_broadcast(state) if state.reduction == P.REDUCE_BROADCAST \
            else None
        for rid in state.waiting:
            if refused is not None:
                self._send_part_error(rid, state, refused)
                continue
            if rid in state.headers_only:
                self._send_header(rid, header)
                continue
            self._send_result(rid, header, result, self._shm_ref(state, result, state.round, rid))
        if start and self.trace is not None:
            with self.trace_lock:
                self.trace.span(STAGE["send_result"], self.trace.name_id(f"part {state.part}"),
                                start, now_ns(), state.part, state.round, state.nbytes)
        if state.late_waiting:
            late = P.pack_header(P.RESULT, dtype=state.dtype_code, part=state.part,
                                 round=state.round, nbytes=state.nbytes,
                                 rank=state.received & 0xFFFF, flags=P.FLAG_LATE | (
                                     0 if state.codec is None else P.FLAG_COMPRESSED))
            for rid in state.late_waiting:
                self._send_result(rid, late, result,
                                  self._shm_ref(state, result, state.round, rid))
        state.last = None if refused is not None or state.codec is not None else (
            state.round, header, result)
        if self.returned:
            state.answered[:] = state.waiting
            state.answered += state.late_waiting
        if state.backup:
            # held for the live workers that have not pushed this round yet
            state.owed = state.expected - state.received - len(state.late_waiting)
            state.held, state.held_count = (result, state.received) if state.owed else (None, 0)
            state.waiting, state.pushed_last = state.pushed_last, state.waiting
            state.pushed_last.extend(state.late_waiting)
        self._next_round(state)

    def _next_round(self, state: PartitionState) -> None:
        """``state``'s round is answered: the next one begins, empty."""
        state.late_waiting.clear()
        state.thread = state.threaded
        state.first_ref = None
        state.traced = False
        state.waiting.clear()
        state.headers_only.clear()
        state.received = 0
        state.summed = 0
        state.result = None
        state.round += 1
        if state.leaving:
            state.expected -= len(state.leaving)
            state.leaving.clear()

    def _last_sum(self, rid: bytes, dtype: int, count: int, part: int, round_: int,
                  nbytes: int, frames: list[zmq.Frame]) -> None:
        """LAST_SUM: a worker's copy of the sum of round ``round_`` of ``part`` that the lost
        server which held it sent, before that worker's pushes of ``part`` here. A worker it
        did not reach pushes that round here again and is answered with it: this server
        could sum the round again only from every worker's push, and the workers it reached
        have moved on. Kept for the partition's first push here, or answering the round in
        progress here (pushes of it came first), or the round before it."""
        if rid in self.retired:
            return
        if rid not in self.peers:
            raise P.ProtocolError("LAST_SUM from a connection that has not said HELLO")
        if len(frames) != 3 or len(frames[2]) != nbytes or dtype >= len(P.DTYPES) or \
                nbytes % P.DTYPES[dtype].itemsize:
            raise P.ProtocolError(f"LAST_SUM of partition {part} announces {nbytes} bytes of "
                                  f"dtype code {dtype} but carries {len(frames) - 2} frame(s)")
        held = (round_, P.pack_header(P.RESULT, dtype=dtype, part=part, round=round_,
                                      nbytes=nbytes, rank=count), frames[2].buffer)
        state = self.parts.get(part)
        if state is None:
            if part not in self.held_sums or self.held_sums[part][0] < round_:
                self.held_sums[part] = held
        elif not state.adopted or state.nbytes != nbytes or state.dtype_code != dtype:
            return              # summed here from its first round, or not that partition
        elif state.round == round_ + 1 and (state.last is None or state.last[0] < round_):
            state.last = held
        elif state.round == round_ and state.thread < 0 and state.codec is None and \
                not state.backup and not self.joined and \
                state.reduction != P.REDUCE_BROADCAST:
            # pushes of that round came before it: answered with it, their partial sum dropped
            self.log.info("partition %d: rank(s) %s lacked round %d's sum from the lost server "
                          "that held it; answered with a copy rank %d handed over", part,
                          sorted(self.peers.get(w, -1) for w in state.waiting), round_,
                          self.peers[rid])
            state.first, state.folded, state.widened = None, 0, False
            for waiting in state.waiting:
                if waiting in state.headers_only:
                    self._send_header(waiting, held[1])
                else:
                    self._send_result(waiting, held[1], held[2], None)
            state.last = held
            if self.returned:
                state.answered[:] = state.waiting
            self._next_round(state)

    def _refused_broadcast(self, state: PartitionState) -> str | None:
        """Why a broadcast's completed round has no answer (None: it has one): its pushers
        named different roots, or the root they name pushed no data. Clears the round's
        claims."""
        claims, data = state.claims, state.data_pushes
        state.claims, state.data_pushes = {}, 0
        by_root: dict[int, list[int]] = {}
        for rank in sorted(claims):
            by_root.setdefault(claims[rank], []).append(rank)
        if len(by_root) > 1:
            return "ranks disagree on the root of this broadcast: " + ", ".join(
                _ranks_say(ranks, root) for root, ranks in by_root.items())
        if data == 1:
            return None
        root = next(iter(by_root), -1)
        return (f"every rank names rank {root} the root of this broadcast, but it pushed no "
                "data (lost, or not a rank of this job?)")

    def _send_part_error(self, rid: bytes, state: PartitionState, message: str) -> None:
        """Answer a push of ``state``'s round with an ERROR naming the partition and round:
        that push fails, and nothing else of the pusher's."""
        body = {"message": f"server {self.rank}, partition {state.part}: {message}",
                "part": state.part, "round": state.round}
        if rid == state.waiting[0]:
            self.log.warning(body["message"])
        try:
            self.sock.send_multipart([rid, P.pack_header(P.ERROR, part=state.part,
                                                         round=state.round),
                                      json.dumps(body).encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass        # that worker is gone; the scheduler tells the others

    def _drain_scheduler(self) -> None:
        while True:
            try:
                frames = self.sched.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg_type, msg = P.parse_control(frames)
            if self.sched_login is not None and self.sched_login.handle(msg_type, msg):
                continue
            if msg_type == P.REGISTERED and self.sched_gone is not None:
                self._registered_again(msg)
            elif msg_type == P.ERROR and self.sched_gone is not None:
                raise EngineError(f"the restarted scheduler at {self.scheduler_address} refused "
                                  f"server {self.rank}: {msg.get('message')}")
            elif msg_type == P.JOB_END and msg.get("job") == self.job_id:
                self.log.info("job %s ended; freeing its %d partitions", self.job_id,
                              len(self.parts))
                self._reset(None, 0)
            elif msg_type == P.JOINED:
                self._hvd_joined(msg)
            elif msg_type == P.WORKER_LOST:
                self._worker_lost(int(msg["rank"]), int(msg.get("incarnation", 0)),
                                  {int(r) for r in msg["live"]}, str(msg["message"]))
            elif msg_type == P.ERROR and msg.get("fenced") is True:
                # declared lost while paused or cut off: the job went on without this server,
                # its partitions live elsewhere now, and nothing it holds may be sent
                raise EngineError(f"server {self.rank}: {msg.get('message')}")
            elif msg_type == P.ERROR:
                self.log.warning("scheduler: %s", msg.get("message"))

    def _worker_lost(self, rank: int, incarnation: int, live: set[int], message: str) -> None:
        """The job goes on without worker ``rank``: rounds it already pushed keep its
        contribution; the others complete without it, now if every other push is in. The
        ``live`` workers that have joined (Horovod's join) are not counted until the join
        ends, whichever of the two this server heard first. The loss of a process of ``rank``
        older than the one admitted since (told again by the scheduler after this server
        registered again) is old news: that rank is in the rounds again."""
        if incarnation < self.admitted.get(rank, 0):
            return
        if rank in self.joined:
            self._hvd_unjoin(rank)          # counted as zeros no longer: lost instead
        rid = self._peer(rank, incarnation)
        self.dead.add((rank, incarnation))
        self.mailbox.pop((rank, incarnation), None)
        if rid is not None:
            self.unadmitted.pop(rid, None)
            self.lost_peers.add(rid)
        if rank in self.lost_ranks:
            return          # a restarted worker lost before it was admitted: never counted
        self.lost_ranks.add(rank)
        self.num_workers = len(live - self.joined)
        finished = 0
        for state in list(self.parts.values()):
            if not self._counts_in(rank, state.part):
                continue        # a process set's partition without that rank: unchanged
            if rid is not None and (rid in state.waiting or rid in state.late_waiting):
                state.leaving.append(rank)      # in this round's sum; not in the next
                continue
            quorum = state.quorum()
            state.expected -= 1
            if state.owed and rid not in state.pushed_last:
                self._paid(state)               # it will never push the last round
            finished += self._finish_if_full(state, quorum, rank)
        self.log.warning("%s; rounds go on with %d workers (%d completed without it)", message,
                         len(live), finished)


    def _finish_if_full(self, state: PartitionState, quorum: int, rank: int) -> bool:
        """A round that waited for ``quorum`` pushes and now, one pusher fewer (worker ``rank``
        lost or joined), has all it needs: finished now, or after the pushes already queued
        for its summation thread. A round already full (its sum being finished, or held
        back) is left alone. Whether it was finished."""
        if not (state.received and quorum > state.received >= state.quorum()):
            return False
        if state.thread < 0:
            if state.finish(state.quorum()):
                self._complete(state)
        else:
            self.queues[state.thread].put((state, None, state.quorum(), rank, False))
        return True

    def _hvd_joined(self, msg: dict[str, Any]) -> None:
        """The scheduler says which ranks have joined (hvd.join(); every live worker knew it
        before this came), or that the join is over: then every rank counts again, and the
        scheduler hears so before any worker goes on (so no push of a rank that has come back
        finds its zeros still counted)."""
        if msg.get("job") != self.job_id:
            ranks: list[int] = []
        else:
            ranks = [r for r in msg.get("ranks", []) if isinstance(r, int)]
        if msg.get("done") is True:
            for rank in sorted(self.joined):
                self._hvd_unjoin(rank)
            self.sched.send_multipart(P.control(P.JOINED_ACK, {"epoch": msg.get("epoch")}))
            return
        for rank in ranks:
            if rank not in self.joined and rank not in self.lost_ranks:
                self._hvd_join(rank)

    def _hvd_join(self, rank: int) -> None:
        """Worker ``rank`` has joined: every round counts it as zeros, without waiting for its
        push (as for a lost worker: rounds that hold its push count it once, in the sum; the
        others complete, now if every other push is in) until :meth:`_hvd_unjoin`. The
        count in each RESULT still includes it (:meth:`_with_zeros`)."""
        rid = next((rid for rid, peer in self.peers.items()
                    if peer == rank and rid not in self.lost_peers), None)
        self.joined.add(rank)
        self.num_workers -= 1
        finished = 0
        for state in list(self.parts.values()):
            if state.part in self.host_parts or not self._counts_in(rank, state.part):
                continue
            if rid is not None and rid in state.waiting:
                state.leaving.append(rank)      # in this round's sum; zeros from the next
                continue
            quorum = state.quorum()
            state.expected -= 1
            finished += self._finish_if_full(state, quorum, rank)
        self.log.info("worker %d joined (hvd.join()): rounds count it as zeros (%d completed "
                      "at once)", rank, finished)

    def _hvd_unjoin(self, rank: int) -> None:
        """Worker ``rank`` counts again (the join is over, or it was lost): undoes
        :meth:`_hvd_join`, partition by partition."""
        self.joined.discard(rank)
        self.num_workers += 1
        for state in self.parts.values():
            if state.part in self.host_parts or not self._counts_in(rank, state.part):
                continue
            if rank in state.leaving:
                state.leaving.remove(rank)
            else:
                state.expected += 1

    def _with_zeros(self, state: PartitionState, result: Any) -> tuple[int, Any]:
        """A completed round's count and result with a zero for each joined rank whose push
        it lacks: the count includes them (an average divides by every rank, as Horovod's);
        Min, Max and Product fold a zero in, into the round's buffer (the result may be a
        push's own bytes). Only while ranks have joined, so the extra work is off the usual
        path."""
        pushers = {self.peers.get(rid) for rid in state.waiting}
        zeros = sum(rank not in pushers and self._counts_in(rank, state.part)
                    for rank in self.joined)
        if not zeros or state.reduction in P.ZERO_REDUCTIONS:
            return state.received + zeros, result
        out = state._buffer()
        if state.dtype_code == P.BFLOAT16_CODE:
            wide = P.bf16_widen(np.asarray(result, np.uint16), np.empty(len(out), np.float32))
            state.combine(wide, np.float32(0), out=wide)
            P.bf16_round(wide, np.empty(len(out), np.uint32), out)
        else:
            state.combine(result, state.dtype.type(0), out=out)
        state.result = out
        return state.received + zeros, out

    def _admit(self, rid: bytes, msg: dict[str, Any]) -> None:
        """A restarted worker rejoins, or a new one joins (its donor says so at a step
        boundary, before pushing anything more): count its pushes from each partition's
        current round on. The donor has every round before those, so none of them can
        complete without it meanwhile; what the joiner pushed before this came was held
        (:attr:`unadmitted`) and counts from now on."""
        if rid not in self.peers:
            raise P.ProtocolError("ADMIT from a connection that has not said HELLO")
        rank = P.int_field(msg, "rank", 0, P.MAX_WORKERS)
        incarnation = P.int_field(msg, "incarnation", 0, 1 << 30)
        rounds = msg.get("rounds")
        if not isinstance(rounds, dict):
            raise P.ProtocolError("ADMIT without its rounds")
        if (rank, incarnation) in self.dead:
            self.log.warning("worker %d (restart %d) was lost before it was admitted", rank,
                             incarnation)
            return
        if rank not in self.lost_ranks:
            raise P.ProtocolError(f"ADMIT of worker {rank}, which this server still counts")
        for state in self.parts.values():
            expected_round = rounds.get(str(state.part))
            if rank in state.leaving or (expected_round is not None
                                         and int(expected_round) != state.round):
                raise P.ProtocolError(
                    f"cannot admit worker {rank} at partition {state.part}: the server is at "
                    f"round {state.round}, the donor at {expected_round}, and the previous "
                    "process of that rank may have pushed it")
        self.lost_ranks.discard(rank)
        self.admitted[rank] = incarnation
        self.num_workers += 1
        for state in self.parts.values():
            if self._counts_in(rank, state.part):
                state.expected += 1
        self.log.warning("worker %d (%s) joined: rounds go on with %d workers", rank,
                         f"restart {incarnation}" if incarnation else "a new rank",
                         self.num_workers)
        joiner = self._peer(rank, incarnation)
        held = self.unadmitted.pop(joiner, []) if joiner is not None else []
        if held:
            self.log.info("worker %d (restart %d) pushed %d partitions before it was admitted "
                          "here: counted now", rank, incarnation, len(held))
        for args in held:
            assert joiner is not None
            try:
                self._push(joiner, *args)
            except P.ProtocolError as exc:
                self._error(joiner, f"server {self.rank} rejected a message: {exc}")
                return      # that push_pull has failed, and the job with it

    def _scope(self, rid: bytes, msg: dict[str, Any]) -> None:
        """A worker's SCOPE, sent before its first push of these partitions: they belong to
        a process set's tensor (Horovod's ``process_set=``), and a round of each completes once
        every live rank of ``ranks`` pushed it, not every worker of the job. Refused if a
        partition was summed over another set (or over every worker) already."""
        rank = self.peers.get(rid)
        if rank is None:
            raise P.ProtocolError("SCOPE from a connection that has not said HELLO")
        parts, ranks = msg.get("parts"), msg.get("ranks")
        if not isinstance(parts, list) or len(parts) > P.MAX_PARTITIONS_PER_DECLARE or \
                not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 1 << 32
                        for p in parts):
            raise P.ProtocolError("SCOPE: parts must be a list of partition ids")
        if not isinstance(ranks, list) or not ranks or len(ranks) > P.MAX_WORKERS or \
                not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < P.MAX_WORKERS
                        for r in ranks):
            raise P.ProtocolError("SCOPE: ranks must be a non-empty list of worker ranks")
        scope = frozenset(ranks)
        if rank not in scope:
            raise P.ProtocolError(f"SCOPE of partitions {parts[:4]} from rank {rank}, which is "
                                  f"not one of their process set's ranks {sorted(scope)}")
        for part in parts:
            known = self.scopes.get(part)
            if (known is None and part in self.parts) or part in self.async_parts:
                raise P.ProtocolError(f"partition {part}: rank {rank} says it belongs to process "
                                      f"set {sorted(scope)}, but it was pushed by every worker "
                                      "of the job before; use another name")
            if known is not None and known != scope:
                raise P.ProtocolError(f"partition {part}: rank {rank} says it belongs to process "
                                      f"set {sorted(scope)}, another rank said {sorted(known)}; "
                                      "a tensor is bound to one process set")
        for part in parts:
            self.scopes[part] = scope

    def _counts_in(self, rank: int, part: int) -> bool:
        """Whether worker ``rank`` pushes partition ``part``: every worker does, but a
        process set's partition only its ranks (:meth:`_scope`)."""
        return not self.scopes or rank in self.scopes.get(part, (rank,))

    def _scoped_pushers(self, rank: int, part: int, flags: int) -> int:
        """Pushes per round of a process set's partition ``part`` (its live ranks);
        ProtocolError for a push from a rank outside the set, or one reduced over a host
        (the intra-node stage sums over every local worker, not a set's)."""
        scope = self.scopes[part]
        if rank not in scope:
            raise P.ProtocolError(f"partition {part}: rank {rank} pushed it, but it belongs to "
                                  f"process set {sorted(scope)}, which rank {rank} is not in")
        if flags & P.FLAG_HOST_REDUCED:
            raise P.ProtocolError(f"partition {part} of process set {sorted(scope)}: a "
                                  "host-reduced push sums every worker of its host; push it "
                                  "from each rank of the set")
        return len(scope - self.lost_ranks - self.joined)

    def _peer(self, rank: int, incarnation: int) -> bytes | None:
        """The connection of worker ``rank``'s process of that incarnation, if it said HELLO."""
        return next((rid for rid, peer in self.peers.items()
                     if peer == rank and self.incarnations.get(rid) == incarnation), None)

    def _state(self, rid: bytes, rank: int, incarnation: int, frames: list[zmq.Frame]) -> None:
        """The model a donor hands a restarted worker: relay it, or keep it until the joiner
        says HELLO (one per joiner; gone when relayed, when the joiner is lost, or at the
        job's end). Its frames after the header travel on as they came, never copied."""
        if rid not in self.peers or len(frames) != 4:
            raise P.ProtocolError("STATE from a connection that has not said HELLO, or "
                                  "without its rounds and payload")
        if (rank, incarnation) in self.dead:
            return
        joiner = self._peer(rank, incarnation)
        if joiner is None:
            self.mailbox[(rank, incarnation)] = frames[1:]
        else:
            self._relay_state(joiner, frames[1:])

    def _relay_state(self, rid: bytes, frames: list[zmq.Frame]) -> None:
        try:
            self.sock.send_multipart([rid, *frames], copy=False)
        except zmq.ZMQError:
            pass        # the joiner is gone; the scheduler will say so


def _ranks_say(ranks: list[int], root: int) -> str:
    """``rank 2 says 1``, ``ranks 0 and 1 say 0``, ``ranks 0, 1 and 3 say 0``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} says {root}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]} say {root}"


def main() -> None:
    exit_on_sigterm()
    config = Config.from_env(role="server")
    exec_with_jemalloc("bpsctl.engine.server", config.server_malloc)
    if not config.scheduler:
        print("bpsctl server: BPSCTL_SCHEDULER is not set; a server must know the scheduler's "
              "host:port (`bpsctl up` sets it)", file=sys.stderr)
        sys.exit(2)
    server = Server(config)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.log.info("stopped")
    except EngineError as exc:
        server.log.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
