"""Shared memory between the worker processes of one host: the arena of the intra-node stage.

One arena per host and job, a file in ``/dev/shm`` named
``bpsctl-<scheduler port>-<cluster tag>-<job id>-h<host index>`` (the tag is a hash of the
cluster's secret, so two clusters on one machine never meet, and ``bpsctl down`` finds what a
crashed job of its cluster left). Local rank 0 creates it (mode 0600, all of
``BPSCTL_SHM_BYTES`` reserved at once with ``posix_fallocate``, after checking with
``statvfs`` that ``/dev/shm`` has room: a full tmpfs later would be a SIGBUS in the middle of a
step, not an error); the other local ranks attach to it by name; once every local rank has
attached, the creator removes the name. From then on nothing is left in ``/dev/shm`` whatever
happens to the processes: the kernel frees the memory with the last mapping. Only a crash
between creation and the last attach leaves the file, and the creator's ``atexit`` handler, its
``close`` and ``bpsctl down`` remove it.

Layout: a header page (magic, size, local size, then one control block per local rank: pid,
process start time, attached, and the sequence counters ``COPIED``, ``RESULT`` and ``DONE``
the stage publishes per push_pull), then the data area, which the stage uses as a ring
(:class:`Ring`).

**Wake-ups.** A local rank waits for its peers by polling their counters in the arena, with a
short backoff (50 us doubling to 1 ms) and a deadline. The other choice was a ZeroMQ IPC
socket per pair of threads: a wake-up at once and no polling, but two sockets per thread and
local rank, socket files to clean up, and a system call per signal. Polling costs at most about
1 ms of latency per wait and a little CPU while a peer is late, needs nothing outside the
arena, and lets every wait check, every 0.1 s, that the peers it waits for still live (their
pid and start time are in the arena): a peer that died is named within a fraction of a second.
Counters are aligned 8-byte words, each written by one thread of one process, stored after the
data they announce; on x86 stores are seen in program order. On CPUs with weaker ordering the
Python interpreter's own locking between the two stores orders them in practice, but no fence
is issued here.
"""
from __future__ import annotations

import atexit
import collections
import hashlib
import mmap
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from ..config import format_bytes
from .common import EngineError

SHM_DIR = Path("/dev/shm")
PREFIX = "bpsctl-"
MAGIC = 0x48534C5443535042          # b"BPSCTLSH", little-endian
VERSION = 1
ALIGN = 64                           # every region and slot starts on a cache line
#: int64 words of each local rank's control block, and what they hold
BLOCK_WORDS = 16
PID, STARTED_MS, ATTACHED, COPIED, RESULT, DONE = range(6)
_GLOBAL_WORDS = 8                    # magic, version, size, local size, ready, ...
_MAGIC_W, _VERSION_W, _SIZE_W, _LOCAL_SIZE_W, _READY_W = range(5)
PEER_CHECK_S = 0.1


def cluster_tag(scheduler_address: str, secret: str) -> str:
    """``<port>-<8 hex digits>``: the scheduler's port and a hash of the cluster's secret (one
    way: the name says which cluster, not the secret)."""
    port = scheduler_address.rpartition(":")[2] or "0"
    digest = hashlib.sha256(b"bpsctl shared memory:" + secret.encode()).hexdigest()[:8]
    return f"{port}-{digest}"


def job_part(job_id: str) -> str:
    """A job id as it appears in segment names (a file name's safe characters only)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", job_id)[:64]


def segment_name(tag: str, job_id: str, host: int) -> str:
    return f"{PREFIX}{tag}-{job_part(job_id)}-h{host}"


def host_id() -> str:
    """Which machine, as shared memory sees it: a hash of the kernel's boot id, this
    process's network namespace and the device of ``/dev/shm``. Two processes with the same id
    can map each other's segments; the hosts of an emulated cluster (one network namespace
    each, on one machine) get different ids, so their traffic keeps crossing the shaped NICs.
    Empty when it cannot be told (no /proc): then nothing is taken for local."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        shm_dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return ""
    return hashlib.sha256(f"{boot}/{netns}/{shm_dev}".encode()).hexdigest()[:16]


def leftovers(tag: str, directory: Path = SHM_DIR) -> list[Path]:
    """The arenas of the cluster with ``tag`` still named in ``directory``."""
    return sorted(directory.glob(f"{PREFIX}{tag}-*"))


def remove_leftovers(tag: str, directory: Path = SHM_DIR) -> tuple[str, ...]:
    """Remove the arenas of the cluster with ``tag`` (its jobs have ended: ``bpsctl down``
    stopped its scheduler); returns their names."""
    removed = []
    for path in leftovers(tag, directory):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return tuple(removed)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_bytes(local_size: int) -> int:
    return -(-(8 * (_GLOBAL_WORDS + BLOCK_WORDS * local_size)) // 4096) * 4096


def _started_ms(process: psutil.Process) -> int:
    return int(process.create_time() * 1000)


def _alive(pid: int, started_ms: int) -> bool:
    """True while the process ``pid`` that started at ``started_ms`` runs (a zombie, or
    another process that got its pid since, does not count)."""
    try:
        process = psutil.Process(pid)
        return (abs(_started_ms(process) - started_ms) <= 10
                and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False



def free_bytes(directory: Path) -> int:
    """Bytes free in ``directory``'s file system (a tmpfs such as ``/dev/shm``): checked before
    reserving, because a tmpfs that fills up later is a SIGBUS mid-step, not an error."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def map_reserved(fd: int, size: int) -> mmap.mmap:
    """Reserve all ``size`` bytes of the file behind ``fd`` now (``posix_fallocate``) and map
    them shared, read-write."""
    os.posix_fallocate(fd, 0, size)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

class Arena:
    """One host's shared-memory arena (see the module doc): ``create`` on local rank 0,
    ``attach`` on the others. ``control`` is the (local_size, BLOCK_WORDS) int64 array of
    control blocks; ``data`` the whole arena as bytes (a memoryview of the mapping)."""

    def __init__(self, path: Path, mapping: mmap.mmap, local_rank: int, local_size: int,
                 creator: bool):
        self.path, self.mapping = path, mapping
        self.local_rank, self.local_size, self.creator = local_rank, local_size, creator
        self.size = len(mapping)
        words: np.ndarray = np.ndarray((_GLOBAL_WORDS + BLOCK_WORDS * local_size,), dtype=np.int64,
                           buffer=mapping)
        self.header = words[:_GLOBAL_WORDS]
        self.control = words[_GLOBAL_WORDS:].reshape(local_size, BLOCK_WORDS)
        self.data_start = header_bytes(local_size)
        self._named = creator            # the creator removes the name once all attached

    # ---------------------------------------------------------------- opening

    @classmethod
    def create(cls, path: Path, size: int, local_size: int) -> Arena:
        """Create the arena of ``size`` bytes (0600), or raise naming BPSCTL_SHM_BYTES when
        ``/dev/shm`` has no room for it."""
        directory = path.parent
        try:
            free = free_bytes(directory)
        except OSError as exc:
            raise EngineError(f"the intra-node stage needs shared memory in {directory}: "
                              f"{exc.strerror}; set BPSCTL_LOCAL_SHM=0 to use gloo over TCP "
                              "instead") from None
        if free < size:
            raise EngineError(f"the intra-node stage needs {format_bytes(size)} of shared memory "
                              f"(BPSCTL_SHM_BYTES={size}) but {directory} has "
                              f"{format_bytes(free)} free; set BPSCTL_SHM_BYTES lower, give "
                              f"{directory} more room (docker: --shm-size), or set "
                              "BPSCTL_LOCAL_SHM=0 to use gloo over TCP instead")
        if size < header_bytes(local_size) + ALIGN * local_size:
            raise EngineError(f"BPSCTL_SHM_BYTES={size} is too small for {local_size} local "
                              "ranks")
        fd = cls._open_exclusive(path)
        try:
            mapping = map_reserved(fd, size)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise EngineError(f"cannot reserve {format_bytes(size)} of shared memory in "
                              f"{path} (BPSCTL_SHM_BYTES={size}): {exc.strerror}; set "
                              "BPSCTL_SHM_BYTES lower or BPSCTL_LOCAL_SHM=0") from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        arena = cls(path, mapping, 0, local_size, creator=True)
        atexit.register(arena.unlink)
        arena.header[_SIZE_W] = size
        arena.header[_LOCAL_SIZE_W] = local_size
        arena.header[_VERSION_W] = VERSION
        arena.header[_MAGIC_W] = MAGIC
        arena._announce()
        arena.control[0, ATTACHED] = 1
        arena.header[_READY_W] = 1
        return arena

    @staticmethod
    def _open_exclusive(path: Path) -> int:
        for _ in range(2):
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                owner = _creator_of(path)
                if owner is not None:
                    raise EngineError(f"the shared-memory arena {path} is in use by pid {owner} "
                                      "(another job with the same job id on this host?); "
                                      "give each job its own BPSCTL_JOB_ID") from None
                path.unlink(missing_ok=True)      # left by a job whose creator is gone
        raise EngineError(f"cannot create the shared-memory arena {path}: it keeps reappearing")

    @classmethod
    def attach(cls, path: Path, size: int, local_rank: int, local_size: int,
               deadline: float, abort: Callable[[], None]) -> Arena:
        """Attach to the arena local rank 0 creates, waiting for it until ``deadline``."""
        delay = 0.001
        while True:
            abort()
            arena = cls._try_attach(path, size, local_rank, local_size)
            if arena is not None:
                arena._announce()
                arena.control[local_rank, ATTACHED] = 1
                return arena
            if time.monotonic() > deadline:
                raise EngineError(f"local rank {local_rank}: local rank 0 did not create the "
                                  f"shared-memory arena {path} in time (BPSCTL_START_TIMEOUT)")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    @classmethod
    def _try_attach(cls, path: Path, size: int, local_rank: int,
                    local_size: int) -> Arena | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None                     # not reserved yet (or not ours: a stale one)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arena = cls(path, mapping, local_rank, local_size, creator=False)
        header, creator = arena.header, arena.control[0]
        if (header[_READY_W] != 1 or header[_MAGIC_W] != MAGIC
                or header[_LOCAL_SIZE_W] != local_size
                or not _alive(int(creator[PID]), int(creator[STARTED_MS]))):
            arena.release()
            return None                         # being made, or left by a dead job
        return arena

    def _announce(self) -> None:
        me = psutil.Process()
        block = self.control[self.local_rank]
        block[PID] = me.pid
        block[STARTED_MS] = _started_ms(me)
        block[COPIED] = block[RESULT] = block[DONE] = 0

    def wait_attached(self, deadline: float, abort: Callable[[], None]) -> None:
        """Creator: wait until every local rank has attached, then remove the name."""
        delay = 0.001
        while not self.control[:, ATTACHED].all():
            abort()
            if time.monotonic() > deadline:
                missing = [r for r in range(self.local_size) if not self.control[r, ATTACHED]]
                self.unlink()
                raise EngineError(f"local ranks {missing} did not attach to the shared-memory "
                                  f"arena {self.path} in time (BPSCTL_START_TIMEOUT)")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self.unlink()

    # ---------------------------------------------------------------- peers

    def peer_alive(self, local_rank: int) -> bool:
        block = self.control[local_rank]
        return _alive(int(block[PID]), int(block[STARTED_MS]))

    def peer_pid(self, local_rank: int) -> int:
        return int(self.control[local_rank, PID])

    # ---------------------------------------------------------------- closing

    def unlink(self) -> None:
        """Remove the arena's name (creator only; idempotent). Mappings stay valid."""
        if self._named:
            self._named = False
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Unmap, where nothing still exports the memory (else the process exit does it)."""
        self.unlink()
        del self.header, self.control
        try:
            self.mapping.close()
        except BufferError:
            pass


def _creator_of(path: Path) -> int | None:
    """The pid of the live process that created the arena at ``path``, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(8 * (_GLOBAL_WORDS + BLOCK_WORDS))
    except OSError:
        return None
    if len(head) < 8 * (_GLOBAL_WORDS + BLOCK_WORDS):
        return None
    words = np.frombuffer(head, dtype=np.int64)
    pid, started = int(words[_GLOBAL_WORDS + PID]), int(words[_GLOBAL_WORDS + STARTED_MS])
    return pid if words[_MAGIC_W] == MAGIC and _alive(pid, started) else None


class Ring:
    """Where each push_pull's region goes in the data area ``[start, end)``, in submission
    order. Every local rank places the same regions in the same order, so they agree on every
    offset without talking. A region is reused only after every local rank has finished the
    push_pull that had it (``place`` says which one to wait for)."""

    def __init__(self, start: int, end: int):
        self.start, self.end, self.cursor = start, end, start
        self.live: collections.deque[tuple[int, int, int]] = collections.deque()  # seq, a, b

    @property
    def capacity(self) -> int:
        return self.end - self.start

    def place(self, nbytes: int, seq: int, done: int) -> tuple[int, int]:
        """``(offset, wait_for)``: the region of ``nbytes`` for push_pull ``seq``, free once
        every local rank's DONE counter has reached ``wait_for``; ``done`` is the lowest DONE
        counter now (regions of push_pulls up to it are free)."""
        while self.live and self.live[0][0] <= done:
            self.live.popleft()
        if self.cursor + nbytes > self.end:
            self.cursor = self.start
        first, last = self.cursor, self.cursor + nbytes
        wait_for = 0
        for seq_before, a, b in self.live:
            if a < last and first < b:
                wait_for = max(wait_for, seq_before)
        self.live.append((seq, first, last))
        self.cursor = last
        return first, wait_for
