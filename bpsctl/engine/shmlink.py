"""Shared memory between a worker and a server on the same host (``BPSCTL_SHM_SERVER``).

On one host every byte between a worker and a server used to cross TCP loopback twice
(worker -> server -> worker). With this link the PUSH and RESULT headers still travel over
the worker's ZeroMQ connection (so acknowledgements, heartbeats, failure detection, failover
and tracing are unchanged), but their bodies are a :data:`REF` naming where the bytes are in a
segment of ``/dev/shm``:

* a worker's **push slots**: one per partition and server, in segments the worker creates
  (:class:`Segments`, named ``bpsctl-<cluster tag>-<job>-w<rank>.<incarnation>-s<server
  rank>-<k>``). The worker copies the partition in and pushes; the server sums straight from
  the slot. The server removes a segment's name as soon as it has mapped it (it is the only
  other process that maps it).
* a server's **sum buffers**: the two (three with backup workers) buffers of each partition
  that rounds take in turn, in segments the server creates (``bpsctl-<cluster tag>-<job>-
  s<server rank>-<k>``), which every local worker of the job maps read-only. Their names stay
  until the job ends (a restarted or attached worker may still need to map them).

Segments are created as the intra-node stage's arena is (mode 0600, ``posix_fallocate`` after
``statvfs`` says there is room) and grow by chunks: the first one 1 MiB (or the slot's size),
each next one twice the last, up to 64 MiB, so a small job reserves little and a large one few
files. What each process's segments may reserve together is its :class:`Budget`
(``BPSCTL_SHM_SERVER_BYTES``): by default as much as the model needs, while a quarter of
``/dev/shm`` stays free for the intra-node arena, other processes and other jobs (a fixed bound
would be too small for a large model and too large for a small ``/dev/shm``); a partition that
does not fit takes TCP, and the log says so once. When the job ends (``close``), at exit, and
by ``bpsctl down`` (the names carry the cluster's tag) every name is removed.

When each region may be rewritten is explained in docs/design.md ("Shared memory between a
worker and a server").

A worker whose tensors live on a GPU has its segments page-locked for the device
(:class:`Pinning`, given by the torch plugin): the GPU's copy engine then writes a gradient
straight into its push slots and reads a sum straight out of the slot or sum buffer it is in
(``Worker.lend``), with no copy by the CPU. A segment is unpinned before this process lets go
of it (``close``: at shutdown, and when a lost server's segments are dropped).
"""
from __future__ import annotations

import atexit
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..config import format_bytes
from . import shm
from .common import EngineError

#: the body of a PUSH or RESULT carrying FLAG_SHM: whose segment (:data:`SERVER_SUMS` or
#: :data:`PUSHER`), which chunk of it, and the offset there; the header's nbytes is the size
REF = struct.Struct("<IIQ")
#: the server's sum buffers of the job
SERVER_SUMS = 0
#: the push slots of the worker that receives (or sent) the message
PUSHER = 1
FIRST_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 64 << 20
#: with BPSCTL_SHM_SERVER_BYTES=auto, the share of /dev/shm's size each process leaves free
KEEP_FREE = 0.25


def merge_runs(entries: list[tuple[int, np.ndarray, Any]]) -> list[tuple[int, np.ndarray, Any]]:
    """``(byte offset in a tensor, uint8 view of a segment, tag)`` per partition (a lease's
    slots, or a handle's lent sums with their divisors), with each run of entries that follow
    one another both in the tensor and in one segment's memory, with equal tags, joined into
    one entry, in offset order. A caller that copies them itself (a GPU's copy engine) makes
    one copy per run instead of one per partition: a tensor's partitions usually take
    consecutive slots of one segment. Never across segments (each is page-locked on its own)."""
    runs: list[tuple[int, np.ndarray, Any]] = []
    # the run being built: its offset, first view, tag, base array, memory from .. to
    offset0, first, tag0, base0, begin, end = 0, None, None, None, 0, 0
    for offset, view, tag in sorted(entries, key=lambda entry: entry[0]):
        address = view.__array_interface__["data"][0]
        if (first is not None and address == end and offset == offset0 + end - begin
                and tag == tag0 and view.base is base0 and isinstance(base0, np.ndarray)):
            end += len(view)
            continue
        if first is not None:
            runs.append(_run(offset0, first, tag0, base0, begin, end))
        offset0, first, tag0, base0 = offset, view, tag, view.base
        begin, end = address, address + len(view)
    if first is not None:
        runs.append(_run(offset0, first, tag0, base0, begin, end))
    return runs


def _run(offset: int, first: np.ndarray, tag: Any, base: Any, begin: int, end: int
         ) -> tuple[int, np.ndarray, Any]:
    """One entry of :func:`merge_runs`: ``first`` alone, or ``base``'s bytes begin..end."""
    if end - begin == len(first):
        return offset, first, tag
    at = begin - base.__array_interface__["data"][0]
    return offset, base[at:at + end - begin], tag


class Pinning(Protocol):
    """Page-locks host memory for a device, and undoes it (the torch plugin's, for CUDA)."""

    def pin(self, view: np.ndarray, writable: bool) -> Any:
        """Page-lock ``view`` (a whole segment, read-only unless ``writable``); a token for
        :meth:`unpin`, or None where it could not (the memory still works, unpinned)."""

    def unpin(self, token: Any) -> None:
        """Undo :meth:`pin` once no copy into or out of the memory is queued or running."""


class _Pins:
    """The segments of one family that are pinned, and how to unpin them."""

    def __init__(self) -> None:
        self.pinning: Pinning | None = None
        self.tokens: list[Any] = []

    def pin(self, view: np.ndarray, writable: bool) -> None:
        if self.pinning is not None:
            token = self.pinning.pin(view, writable)
            if token is not None:
                self.tokens.append(token)

    def release(self) -> None:
        while self.tokens:
            assert self.pinning is not None
            self.pinning.unpin(self.tokens.pop())


def server_base(tag: str, job_id: str, server_rank: int) -> str:
    return f"{shm.PREFIX}{tag}-{shm.job_part(job_id)}-s{server_rank}"


def worker_base(tag: str, job_id: str, rank: int, incarnation: int, server_rank: int) -> str:
    return f"{shm.PREFIX}{tag}-{shm.job_part(job_id)}-w{rank}.{incarnation}-s{server_rank}"


class Segments:
    """The segments one process creates for one peer family (a worker's push slots for one
    server, or a server's sum buffers for one job), handed out by bump allocation. ``budget``
    is shared by every family of the process: what all of them reserved stays within it.
    Thread-safe (a server allocates on its summation threads)."""

    def __init__(self, base: str, budget: Budget, directory: Path = shm.SHM_DIR):
        self.base, self.budget, self.directory = base, budget, directory
        self.chunks: list[tuple[Path, mmap.mmap, np.ndarray]] = []
        self.named: list[Path] = []
        self.used = 0                   # bytes handed out of the last chunk
        self.lock = threading.Lock()
        self.pins = _Pins()
        atexit.register(self.unlink)

    def pin_with(self, pinning: Pinning) -> None:
        """Page-lock every chunk for a device, now and as they are made (see the module
        docstring)."""
        with self.lock:
            self.pins.pinning = pinning
            for _, _, view in self.chunks:
                self.pins.pin(view, writable=True)

    def allocate(self, nbytes: int) -> tuple[int, int, np.ndarray] | None:
        """``(chunk, offset, uint8 view)`` of ``nbytes`` fresh bytes, or None when the budget
        has no room for them (the caller sends over TCP). EngineError when ``/dev/shm`` has no
        room: it names the bound and the knob, and leaves nothing behind."""
        size = shm.align(nbytes)
        with self.lock:
            if not self.chunks or self.used + size > len(self.chunks[-1][1]):
                last = len(self.chunks[-1][1]) if self.chunks else 0
                chunk_bytes = max(size, min(MAX_CHUNK_BYTES, 2 * last or FIRST_CHUNK_BYTES))
                chunk_bytes = min(chunk_bytes, max(size, self.budget.left()))
                if not self.budget.take(chunk_bytes):
                    return None
                try:
                    self._grow(chunk_bytes)
                except BaseException:
                    self.budget.give_back(chunk_bytes)
                    raise
                self.used = 0
            index = len(self.chunks) - 1
            offset = self.used
            self.used += size
            return index, offset, self.chunks[index][2][offset:offset + nbytes]

    def _grow(self, size: int) -> None:
        path = self.directory / f"{self.base}-{len(self.chunks)}"
        try:
            free = shm.free_bytes(self.directory)
        except OSError as exc:
            raise EngineError(f"shared memory between a worker and a server on one host needs "
                              f"{self.directory}: {exc.strerror}; set BPSCTL_SHM_SERVER=0 to "
                              "send through TCP loopback instead") from None
        if free < size:
            raise EngineError(
                f"shared memory between a worker and a server on one host needs "
                f"{format_bytes(size)} more in {self.directory} (each process uses at most "
                f"{self.budget.describe()} for it) but it has {format_bytes(free)} free; give "
                f"{self.directory} more room (docker: --shm-size), set BPSCTL_SHM_SERVER_BYTES "
                "lower (or auto), or set BPSCTL_SHM_SERVER=0 to send through TCP loopback "
                "instead")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:         # left by a crashed process of this job id and rank
            path.unlink(missing_ok=True)
            fd = os.open(path, flags, 0o600)
        self.named.append(path)
        try:
            mapping = shm.map_reserved(fd, size)
        except OSError as exc:
            self._forget(path)
            raise EngineError(f"cannot reserve {format_bytes(size)} of shared memory in {path} "
                              f"({self.budget.describe()}): {exc.strerror}; set "
                              "BPSCTL_SHM_SERVER_BYTES lower, or BPSCTL_SHM_SERVER=0") from None
        except BaseException:
            self._forget(path)
            raise
        finally:
            os.close(fd)
        view = np.frombuffer(mapping, np.uint8)
        self.chunks.append((path, mapping, view))
        self.pins.pin(view, writable=True)

    def _forget(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.named.remove(path)

    def unlink(self) -> None:
        """Remove every name still in ``/dev/shm`` (idempotent); mappings stay valid."""
        while self.named:
            self.named.pop().unlink(missing_ok=True)

    def close(self) -> None:
        """Unpin, remove the names and give the budget back; the memory goes with the last
        mapping (views still held elsewhere keep theirs)."""
        self.unlink()
        atexit.unregister(self.unlink)
        with self.lock:
            self.pins.release()
            for _, mapping, _ in self.chunks:
                self.budget.give_back(len(mapping))
            self.chunks.clear()


class Budget:
    """What one process's segments may reserve in all (``BPSCTL_SHM_SERVER_BYTES``): at most
    ``limit`` bytes, or, with ``limit`` None (auto), anything that leaves :data:`KEEP_FREE` of
    ``directory``'s size free (checked at each reservation, so it sees what other processes
    took meanwhile)."""

    def __init__(self, limit: int | None, directory: Path = shm.SHM_DIR):
        self.limit, self.directory, self.reserved = limit, directory, 0
        self.lock = threading.Lock()

    def describe(self) -> str:
        """The bound as the knob says it, for messages."""
        if self.limit is None:
            return (f"BPSCTL_SHM_SERVER_BYTES=auto (a quarter of {self.directory} kept "
                    "free)")
        return f"BPSCTL_SHM_SERVER_BYTES={self.limit}"

    def left(self) -> int:
        if self.limit is not None:
            return self.limit - self.reserved
        return self._room() or 0

    def _room(self) -> int | None:
        """auto: the bytes that may still be taken from ``directory`` (None: it cannot be
        read; Segments then says so, naming the knobs)."""
        try:
            stats = os.statvfs(self.directory)
        except OSError:
            return None
        return max(0, (stats.f_bavail - int(stats.f_blocks * KEEP_FREE)) * stats.f_frsize)

    def take(self, nbytes: int) -> bool:
        with self.lock:
            if self.limit is None:
                room = self._room()
                if room is not None and nbytes > room:
                    return False
            elif self.reserved + nbytes > self.limit:
                return False
            self.reserved += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self.lock:
            self.reserved -= nbytes


class Mapped:
    """The segments of a peer family another process creates, mapped by name on first use.
    ``unlink``: remove each name once mapped (this process is the only other one to map it)."""

    def __init__(self, base: str, *, writable: bool, unlink: bool,
                 directory: Path = shm.SHM_DIR, pinning: Pinning | None = None):
        self.base, self.writable, self.unlink, self.directory = base, writable, unlink, directory
        self.chunks: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self.pins = _Pins()
        if pinning is not None:
            self.pin_with(pinning)

    def pin_with(self, pinning: Pinning) -> None:
        """Page-lock every chunk mapped, now and as they are mapped."""
        self.pins.pinning = pinning
        for _, view in self.chunks.values():
            self.pins.pin(view, self.writable)

    def view(self, chunk: int, offset: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` at ``offset`` of chunk ``chunk`` (uint8); ValueError saying what is
        wrong when there is no such segment or it is too small."""
        entry = self.chunks.get(chunk)
        if entry is None:
            entry = self.chunks[chunk] = self._open(chunk)
        data = entry[1]
        if offset + nbytes > len(data):
            raise ValueError(f"shared-memory reference past the end of {self.base}-{chunk} "
                             f"({offset} + {nbytes} > {len(data)} bytes)")
        return data[offset:offset + nbytes]

    def _open(self, chunk: int) -> tuple[mmap.mmap, np.ndarray]:
        if chunk > 1 << 16:
            raise ValueError(f"shared-memory reference to chunk {chunk} of {self.base}")
        path = self.directory / f"{self.base}-{chunk}"
        try:
            fd = os.open(path, (os.O_RDWR if self.writable else os.O_RDONLY) | os.O_NOFOLLOW)
        except OSError as exc:
            raise ValueError(f"shared-memory segment {path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot map the shared-memory segment {path}: {exc}") from None
        finally:
            os.close(fd)
        if self.unlink:
            path.unlink(missing_ok=True)
        view = np.frombuffer(mapping, np.uint8)
        if not self.writable:
            view.flags.writeable = False
        self.pins.pin(view, self.writable)
        return mapping, view

    def close(self) -> None:
        """Unpin and forget the mappings (the memory goes once no view of it is left)."""
        self.pins.release()
        self.chunks.clear()
