"""Small pieces shared by the scheduler, servers and workers."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import zmq

from bpsctl.errors import BpsctlError


class EngineError(BpsctlError, RuntimeError):
    """A distributed operation failed; the message names the culprit (role, rank, host:port)."""


class HorovodInternalError(EngineError):
    """A collective failed in the engine (a worker or server lost, a deadline passed, workers
    that disagree on a tensor): what Horovod raises at ``synchronize`` for a collective that
    cannot complete. The torch plugin's ``synchronize`` raises every engine failure as one."""


class JobFinished(EngineError):
    """A worker restarted to rejoin its job (``bpsctl run --max-restarts``) came back after
    the job had ended: there is nothing left for it to do."""


class SchedulerGone(HorovodInternalError):
    """What needs the scheduler (a new tensor, a barrier, a lost server's partitions moved)
    failed: it has been gone for BPSCTL_SCHEDULER_TIMEOUT and no restarted one took over."""


def make_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket that never blocks on close and never drops messages at a high-water mark.

    Memory stays bounded without HWMs: workers cap bytes on the wire with their credit (a
    server acknowledges a push when it arrives, not when it is summed), no worker pushes a
    partition's next round before it has that round's sum, and servers only answer what was
    pushed. So a server whose summation threads are starved of CPU holds at most one step's
    pushes from every worker. What the allocator makes of such bursts is another matter (see
    :func:`exec_with_jemalloc`).
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def io_thread_affinity(index: int, io_threads: int) -> int:
    """The ``ZMQ_AFFINITY`` of a worker's socket to its ``index``-th server: ZeroMQ I/O thread
    ``index % io_threads``, so that the connections to several servers run on different
    threads. Left to itself ZeroMQ gives a new connection the thread with the fewest
    connections at that moment, but a thread counts one only once it has set it up, so
    connections made back to back may all see the same counts and land on one thread, which
    then carries every byte both ways."""
    return 1 << (index % max(1, io_threads))


def bound_router(ctx: zmq.Context, host: str, port: int, security: Any,
                 max_frame_bytes: int = -1) -> tuple[zmq.Socket, int]:
    """The one bound socket of a scheduler or server, on ``port`` (0: any free one), and its
    port. ROUTER_MANDATORY: a reply to a vanished peer raises instead of vanishing silently.
    ``security`` (a security.Security) configures it before it binds; a peer that sends a
    frame over ``max_frame_bytes`` is disconnected before the frame is buffered."""
    sock = make_socket(ctx, zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    security.protect_bound(sock)
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return sock, port
    return sock, sock.bind_to_random_port(f"tcp://{host}")


#: set on the re-executed process: it never tries a second time, even if the preload failed
_REEXEC_MARK = "BPSCTL_MALLOC_REEXEC"


def loaded_allocator() -> str:
    """This process's malloc: "jemalloc" or "tcmalloc" when mapped into it, else "glibc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    return next((name for name in ("jemalloc", "tcmalloc") if f"lib{name}" in maps), "glibc")


def jemalloc_loaded() -> bool:
    """Whether jemalloc is this process's allocator (mapped into it)."""
    return loaded_allocator() == "jemalloc"


@functools.cache
def _jemalloc_library() -> str | None:
    """jemalloc's soname (e.g. libjemalloc.so.2), or None; looked up once (``ldconfig -p``)."""
    return ctypes.util.find_library("jemalloc")


def jemalloc_preload(choice: str, env: Mapping[str, str]) -> dict[str, str]:
    """What to add to ``env`` so that a server started with it has jemalloc from its first
    instruction (the variables :func:`exec_with_jemalloc` would re-execute it with), or {} when
    ``choice`` is not "auto" or jemalloc is not installed. A launcher on the server's own
    machine passes these, and the server does not start a second interpreter to load it."""
    if choice != "auto":
        return {}
    library = _jemalloc_library()
    if library is None:
        return {}
    preload = env.get("LD_PRELOAD", "")
    if library in preload.split():
        return {_REEXEC_MARK: "1"}
    return {_REEXEC_MARK: "1", "LD_PRELOAD": " ".join(x for x in (preload, library) if x)}


def exec_with_jemalloc(module: str, choice: str) -> None:
    """Re-execute this process (same pid, same arguments) as ``python -m module`` with
    jemalloc preloaded, if ``choice`` is "auto", jemalloc is installed and not yet loaded;
    otherwise return and keep glibc's malloc.

    Why, for a server: ZeroMQ mallocs every message it receives, in its I/O thread, and the
    server frees it after summing, in another. With glibc's malloc (and
    :func:`keep_large_buffers`) a server's RSS is a ratchet: over a long ``bench load`` it
    never goes down from one checkpoint to the next while what the server holds stays flat, as
    the heap keeps the worst burst of pushes seen so far, fragmented. With jemalloc it goes up
    and down with the bursts, and once quiet it gives them back
    (:func:`release_free_memory`), at a cost per push_pull within the machine's noise (figures
    in docs/benchmarks.md, "Memory over many steps"). A server is our own process; a
    worker lives in the user's training process, whose allocator is not ours to choose (it
    keeps glibc's defaults: see :func:`keep_large_buffers`)."""
    if choice != "auto" or os.environ.get(_REEXEC_MARK) or jemalloc_loaded():
        return
    preload = jemalloc_preload(choice, os.environ)
    if not preload:
        return
    env = {**os.environ, **preload}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def keep_large_buffers() -> None:
    """Stop glibc from returning each freed multi-MiB buffer to the kernel: for servers that
    run on glibc's malloc (BPSCTL_SERVER_MALLOC=glibc, or jemalloc not installed), and for
    workers that train through the torch plugin (BPSCTL_REUSE_MEMORY).

    By default glibc serves an allocation above its mmap threshold (at most 32 MiB, however it
    adapts) with a fresh mapping and unmaps it on free, so the next one of that size is
    page-faulted in again. A server's ZeroMQ allocates every received message. A torch
    worker's autograd allocates every gradient anew each step: a 411 MB layer's costs over
    100,000 page faults in every backward pass, time in which that gradient cannot leave.
    Kept, the next step reuses the same memory.

    The engine's own worker (without the plugin) keeps glibc's defaults: there, with nothing
    as large as a model's layer per step, a long ``bench load`` kept RSS flat with them, while
    keeping buffers made it ratchet up. A quiet process still gives back what it keeps
    (Config.idle_release_s, :func:`release_free_memory`).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return                      # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def rss_bytes(pid: int | str = "self") -> int:
    """The resident set size of this process (or of ``pid``), in bytes, as the page tables
    hold it now: ``Rss`` of ``/proc/<pid>/smaps_rollup``, a walk of the process's mappings.
    Not the kernel's RSS counter (``statm``, psutil's ``rss``): that one is kept per CPU and
    folded in lazily, so it can trail a large ``madvise``/``munmap`` by many megabytes, and a
    release measured with it could read as nothing given back. Falls back to psutil where
    smaps_rollup is missing (kernels before 4.14, other systems)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Rss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss


def release_free_memory() -> int:
    """Give back to the system the free memory this process's allocator keeps; return how many
    bytes RSS fell by. For an engine that has gone quiet (see Config.idle_release_s).

    Why: the allocator keeps what a burst of messages freed, to serve the next burst without
    page faults (a fresh buffer's faults cost several times filling one it kept). That is
    right while traffic flows, but how much it keeps depends on how the last bursts
    overlapped, so a quiet process's RSS says little about what it holds. Released when quiet,
    what is left is what the process holds, up to a partition or two of a worker's that
    ``malloc_trim`` cannot reach at the top of a thread's heap (figures in docs/benchmarks.md).
    jemalloc: purge every arena; tcmalloc: release its free pages; glibc: ``malloc_trim(0)``,
    which also returns whole free pages inside its heaps."""
    before, allocator = rss_bytes(), loaded_allocator()
    try:
        if allocator == "jemalloc":
            arenas_all = 4096                   # jemalloc's MALLCTL_ARENAS_ALL
            ctypes.CDLL(None).mallctl(f"arena.{arenas_all}.purge".encode(), None, None, None,
                                      ctypes.c_size_t(0))
        elif allocator == "tcmalloc":
            ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return 0                                # not glibc, or a library without the call
    return max(0, before - rss_bytes())


def monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR socket that reports when ``sock``'s connection is made or lost, or its peer
    refuses the security handshake (see security.handshake_failed)."""
    return sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def watch_link(sock: zmq.Socket, interval_s: float, timeout_s: float) -> None:
    """Have ZeroMQ ping the peer of a connecting socket every ``interval_s`` and drop the
    connection after ``timeout_s`` without any traffic, so that :func:`monitor` reports a cut
    link as a disconnect. Without this a link that goes down (no FIN, no RST) looks like a
    quiet peer until TCP gives up, some 15 minutes later. Set before ``connect``."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(interval_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, max(1, int(timeout_s * 1000)))


def lost_link(peer: str, timeout_s: float) -> str:
    """Why a watched connection (see :func:`watch_link`) was reported lost, naming ``peer``."""
    return (f"lost {peer}: the connection closed (its process died) or carried nothing for "
            f"{timeout_s:g} s (a link between the hosts went down; BPSCTL_HEARTBEAT_TIMEOUT)")


def monitor_events(mon: zmq.Socket) -> list[int]:
    """Drain a monitor socket, returning the event codes seen."""
    events: list[int] = []
    while True:
        try:
            frames = mon.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return events
        # libzmq's monitor message: its first frame is the event (16 bits), then a 32-bit
        # value (read here directly: pyzmq's parser would load asyncio into every process)
        events.append(int.from_bytes(frames[0][:2], sys.byteorder))


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    """Atomically tell a launcher where this process serves."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


#: a write that fails with one of these lost its line to a full disk (or quota): the process
#: goes on without it
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class FullDiskTolerantHandler(logging.StreamHandler):
    """Writes each record to the stream's file descriptor in one ``write()``, unbuffered. While
    the disk under the log is full the records are dropped and counted, and the first one
    written after says how many were lost and since when: a server or scheduler, whose log is
    its only output, neither dies of a full disk nor keeps a growing buffer of lines, and says
    once what it could not write."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.lost = 0
        self.lost_since = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self.lost:
                since = time.strftime("%H:%M:%S", time.localtime(self.lost_since))
                notice = logging.LogRecord(
                    record.name, logging.WARNING, __file__, 0, "%d line(s) of this log were "
                    "lost from %s on: its disk was full", (self.lost, since), None)
                line = self.format(notice) + "\n" + line
            self.stream.flush()         # what was written to the stream itself comes first
            try:
                fd = self.stream.fileno()
            except (AttributeError, ValueError):     # not a file (a test's captured stream)
                self.stream.write(line)
                self.stream.flush()
            else:
                os.write(fd, line.encode("utf-8", "replace"))
            self.lost = 0
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                self.handleError(record)
                return
            if not self.lost:
                self.lost_since = record.created
            self.lost += 1
        except Exception:
            self.handleError(record)


def setup_process_logging(name: str) -> logging.Logger:
    """The process's logging (a server's, the scheduler's, its supervisor's): to stderr, which
    the launcher points at the process's log file, through :class:`FullDiskTolerantHandler`."""
    logging.basicConfig(level=logging.INFO, handlers=[FullDiskTolerantHandler(sys.stderr)],
                        format="%(asctime)s [%(name)s] %(levelname)s %(message)s")
    return logging.getLogger(name)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so ``finally`` blocks close sockets and log a last line."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)
