"""Timelines of the engine, in Chrome trace event format (Perfetto, chrome://tracing).

With ``BPSCTL_TRACE_DIR`` set, each worker writes ``DIR/worker-<rank>/comm.json`` and each
server ``DIR/server-<rank>/comm.json``: one span per partition, round and stage, named by the
tensor, with the partition, round, bytes, peer and priority in its args.

Cost: with tracing off the engine holds ``None`` and pays one branch per message. With it on,
a span is a few stores into preallocated arrays (a ring that keeps the newest ``capacity``
spans); nothing is formatted or written until the traced window closes or the process shuts
down. While the window is open a thread samples the machine's NIC counters at 20 Hz
(:class:`NicSampler`); they become a counter track beside the spans.

Clocks: timestamps are ``time.monotonic_ns()``, one clock for every process of a machine, so
the files of one machine line up exactly as they are. Files of different machines are put on
the scheduler's clock: every process's registration is a clock exchange with the scheduler (the
four readings of NTP, see :func:`clock_offset`), and each file records the offset found and its
error bound. Each file also records its machine's boot id, and a reading of the wall clock as a
fallback for files without an offset.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__

#: the spans a worker or server records; the index is what the arrays store
STAGES = (
    "push_pull",        # worker: one tensor, from the call to its last partition's result
    "queued",           # worker: a partition waiting for credit (or behind higher priorities)
    "push",             # worker: a partition on the wire, from send to the server's ACK
    "wait_result",      # worker: from the ACK until the sum arrives (the other workers, the sum)
    "copy_out",         # worker: the sum copied (or divided) into the output
    "wait_workers",     # server: from a partition's first push of a round to its last
    "sum",              # server: one push added into the round's buffer
    "send_result",      # server: the round's result handed to every worker's connection
    "backward",         # plugin: from the step's first gradient ready to its last (torch)
    "synchronize",      # plugin: optimizer.step() waiting for the averaged gradients
    "step",             # worker: one training step (optimizer step to step, or 1st tensor to 1st)
    "to_host",          # plugin: a staged CUDA tensor, from its turn to its push started (the
                        # wait for the GPU to produce it, its copy to the host)
    "to_device",        # plugin: a staged CUDA tensor's sum, from arrived to copied to the GPU
    "collective",       # plugin: a Horovod collective (torch mpi_ops), from its push_pull's
                        # start to its result, whichever path carried it (the intra-node
                        # stage records nothing of its own)
)
STAGE = {name: index for index, name in enumerate(STAGES)}
FORMAT = "bpsctl-trace"
DEFAULT_CAPACITY = 1 << 18


def boot_id() -> str:
    """Which boot of which machine this is: processes with the same boot id share one
    monotonic clock."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def now_ns() -> int:
    return time.monotonic_ns()


def clock_offset(sent_ns: int, received_ns: int, answered_ns: int, back_ns: int
                 ) -> dict[str, int]:
    """The offset of a peer's clock from ours, from one exchange: we sent at ``sent_ns`` (our
    clock), the peer received at ``received_ns`` and answered at ``answered_ns`` (its clock), and
    the answer came back at ``back_ns`` (ours). The peer's clock reads ours + ``offset_ns``,
    within ``error_ns``: half the round trip spent on the wire, however long the peer held
    the message (as NTP computes it)."""
    return {"offset_ns": ((received_ns - sent_ns) + (answered_ns - back_ns)) // 2,
            "error_ns": max(0, ((back_ns - sent_ns) - (answered_ns - received_ns)) // 2)}


def best_clock(*samples: dict[str, int] | None) -> dict[str, int] | None:
    """Of several clock offsets, the one with the smallest error bound."""
    found = [s for s in samples if s is not None]
    return min(found, key=lambda s: s["error_ns"]) if found else None


def scheduler_clock(registered: dict[str, Any], received_ns: int) -> dict[str, int] | None:
    """The scheduler's clock against ours, from its REGISTERED answer (None if it carries no
    well-formed clock exchange)."""
    readings = registered.get("clock")
    if not (isinstance(readings, list) and len(readings) == 3
            and all(isinstance(r, int) and not isinstance(r, bool) for r in readings)):
        return None
    return clock_offset(readings[0], readings[1], readings[2], received_ns)


# --------------------------------------------------------------------------- NIC samples

SAMPLE_HZ = 20
_PROC_NET_DEV = Path("/proc/net/dev")


def interface_of(address: str) -> str | None:
    """The network interface (of this process's network namespace) holding ``address``; lo
    for a loopback address; None if no interface has it."""
    import ipaddress
    import socket

    import psutil
    try:
        address = socket.gethostbyname(address)
        if ipaddress.ip_address(address).is_loopback:
            return "lo"
    except (OSError, ValueError):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def read_nic(interface: str) -> tuple[int, int] | None:
    """(tx, rx) bytes of ``interface`` so far, from ``/proc/net/dev`` (which shows the
    interfaces of the reader's network namespace); None if it has no such interface."""
    prefix = f"{interface}:"
    with open(_PROC_NET_DEV) as lines:
        for line in lines:
            line = line.strip()
            if line.startswith(prefix):
                fields = line[len(prefix):].split()
                return int(fields[8]), int(fields[0])
    return None


class NicSampler:
    """Samples one interface's tx/rx byte counters at ``hz`` on a thread of its own, into
    preallocated arrays (the newest ``capacity`` samples), while the traced window is open."""

    def __init__(self, interface: str, address: str, rate_mbit: float | None = None,
                 hz: int = SAMPLE_HZ, capacity: int = SAMPLE_HZ * 3600):
        self.interface, self.address, self.period_s = interface, address, 1.0 / hz
        self.rate_mbit = rate_mbit          # the NIC's rate, when known (emulated: --nic)
        self.capacity, self.count = capacity, 0
        self.samples = np.zeros((capacity, 3), np.int64)        # monotonic ns, tx, rx
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.netns = os.stat("/proc/self/ns/net").st_ino    # which machine's view
        except OSError:
            self.netns = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="bps-trace-nic")
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
            self._thread = None
            self._sample()      # the window's last reading

    def _sample(self) -> None:
        counters = read_nic(self.interface)
        if counters is not None:
            i = self.count % self.capacity
            self.samples[i] = (now_ns(), *counters)
            self.count += 1

    def _run(self) -> None:
        # on a fixed grid, so that a late wake-up does not shift every later sample
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._sample()
            next_at += self.period_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def to_json(self) -> dict[str, Any]:
        kept = min(self.count, self.capacity)
        order = [(self.count - kept + k) % self.capacity for k in range(kept)]
        return {"interface": self.interface, "address": self.address, "netns": self.netns,
                "hz": round(1 / self.period_s), "rate_mbit": self.rate_mbit,
                "samples": [[int(v) for v in self.samples[i]] for i in order]}

    def counter_events(self, pid: str) -> list[dict[str, Any]]:
        """The samples as a Chrome counter track: Mbit/s sent and received in each interval."""
        rows = self.to_json()["samples"]
        name = f"NIC {self.interface} ({self.address})"
        events = []
        for (t0, tx0, rx0), (t1, tx1, rx1) in zip(rows, rows[1:], strict=False):
            seconds = (t1 - t0) / 1e9
            if seconds > 0:
                events.append({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": t0 / 1000,
                               "args": {"tx Mbit/s": round((tx1 - tx0) * 8 / seconds / 1e6, 3),
                                        "rx Mbit/s": round((rx1 - rx0) * 8 / seconds / 1e6, 3)}})
        return events


def attach_nic(trace: Trace, interface: str, host: str, rate_mbit: float | None = None
               ) -> str | None:
    """Have ``trace`` sample ``interface`` (or, if empty, the one holding ``host``); returns
    a warning naming the setting if there is nothing to sample."""
    name = interface or interface_of(host)
    if name is None:
        return (f"no NIC samples in the trace: no network interface here holds {host}; name "
                "one with BPSCTL_TRACE_NIC")
    try:
        trace.sample_nic(name, host, rate_mbit)
    except (OSError, ValueError) as exc:
        return f"BPSCTL_TRACE_NIC: {exc}; the trace has no NIC samples"
    return None


class Trace:
    """The spans of one process, recorded between ``start_step`` and ``end_step``."""

    def __init__(self, path: Path, role: str, rank: int, *, start_step: int = 0,
                 end_step: int | None = None, capacity: int = DEFAULT_CAPACITY):
        self.path = Path(path)
        self.role, self.rank = role, rank
        self.start_step, self.end_step = start_step, end_step
        self.step = 0
        self.on = start_step <= 0 and (end_step is None or end_step > 0)
        self.window_ns: list[int | None] = [now_ns() if self.on else None, None]
        self.capacity = capacity
        self.count = 0                      # spans recorded, including those overwritten
        self.count_at_opening = 0           # spans recorded before the window opened
        self.stage = np.zeros(capacity, np.uint8)
        self.name = np.zeros(capacity, np.int32)
        self.start = np.zeros(capacity, np.int64)
        self.end = np.zeros(capacity, np.int64)
        self.part = np.zeros(capacity, np.int32)
        self.round = np.zeros(capacity, np.int32)
        self.nbytes = np.zeros(capacity, np.int64)
        self.peer = np.zeros(capacity, np.int32)
        self.priority = np.zeros(capacity, np.int32)
        self.names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self.written = False
        self.step_started_ns = now_ns()
        #: the scheduler's clock = ours + offset_ns (within error_ns), if known
        self.scheduler_clock: dict[str, int] | None = None
        #: samples this machine's NIC while the window is open (see :meth:`sample_nic`)
        self.nic: NicSampler | None = None
        # the engine's I/O thread records most spans; the plugin's thread and a server's
        # summation threads record some too
        self._lock = threading.Lock()

    def sample_nic(self, interface: str, address: str, rate_mbit: float | None = None) -> None:
        """Sample ``interface`` at 20 Hz while the window is open (from now, if it is)."""
        if read_nic(interface) is None:
            raise ValueError(f"no network interface {interface!r} in /proc/net/dev")
        self.nic = NicSampler(interface, address, rate_mbit)
        if self.on:
            self.nic.start()

    def name_id(self, name: str) -> int:
        index = self._name_ids.get(name)
        if index is None:
            with self._lock:
                index = self._name_ids.get(name)
                if index is None:
                    index = self._name_ids[name] = len(self.names)
                    self.names.append(name)
        return index

    def span(self, stage: int, name: int, start_ns: int, end_ns: int, part: int = -1,
             round_: int = -1, nbytes: int = 0, peer: int = -1, priority: int = 0) -> None:
        """Record one span (callers check ``self.on`` first)."""
        with self._lock:
            i = self.count % self.capacity
            self.count += 1
            self.stage[i], self.name[i], self.start[i], self.end[i] = stage, name, start_ns, end_ns
            self.part[i], self.round[i], self.nbytes[i] = part, round_, nbytes
            self.peer[i], self.priority[i] = peer, priority

    def next_step(self, name: int = 0, at_ns: int | None = None) -> None:
        """A training step ended (now, or at ``at_ns``): record it, open or close the window;
        write the file once the window closes."""
        now = now_ns() if at_ns is None else at_ns
        if self.on:
            self.span(STAGE["step"], name, self.step_started_ns, now, round_=self.step)
        self.step += 1
        self.step_started_ns = now
        if not self.on and self.step == self.start_step and self.window_ns[1] is None:
            self.on = True
            self.window_ns[0] = now            # the step's start, however late this hears of it
            self.count_at_opening = self.count
            if self.nic is not None:
                self.nic.start()
        elif self.on and self.end_step is not None and self.step >= self.end_step:
            self._close_window(now)
            self.write()

    def _close_window(self, at_ns: int | None = None) -> None:
        """The window ends at ``at_ns`` (the closing step's end; now if not given)."""
        self.on = False
        self.window_ns[1] = now_ns() if at_ns is None else at_ns
        if self.nic is not None:
            self.nic.stop()

    def close(self) -> str | None:
        """At shutdown: write what was recorded; returns a warning if the window never opened
        (and writes nothing: an empty file would look like a trace)."""
        if self.on:
            self._close_window()
        if self.written:
            return None
        if self.window_ns[0] is None:
            return (f"BPSCTL_TRACE_START_STEP={self.start_step}: the traced window never opened "
                    f"({self.step} steps ran); no trace written to {self.path}")
        self.write()
        return None

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as out:
            json.dump(self.to_json(), out)
        os.replace(tmp, self.path)
        self.written = True

    def to_json(self) -> dict[str, Any]:
        kept = min(self.count, self.capacity)
        first = self.count - kept
        order = [(first + k) % self.capacity for k in range(kept)]
        pid = f"{self.role} {self.rank}"
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pid}}]
        opened = self.window_ns[0] or 0
        closed = self.window_ns[1]
        for sequence, i in enumerate(order, first):
            if sequence < self.count_at_opening and self.end[i] < opened:
                continue                        # a caller's span from before the window
            if closed is not None and self.start[i] > closed:
                # a caller's span of a step after the window's last: the caller records
                # directly, and ran on before this thread heard the step mark that closed it
                continue
            stage = STAGES[self.stage[i]]
            args: dict[str, Any] = {}
            if self.part[i] >= 0:
                args["part"] = int(self.part[i])
            if self.round[i] >= 0:
                args["round"] = int(self.round[i])
            if self.nbytes[i]:
                args["bytes"] = int(self.nbytes[i])
            if self.peer[i] >= 0:
                args["server" if self.role == "worker" else "worker"] = int(self.peer[i])
            if self.priority[i]:
                args["priority"] = int(self.priority[i])
            event_id = f"{int(self.part[i])}.{int(self.round[i])}.{int(self.peer[i])}"
            common = {"name": self.names[self.name[i]], "cat": stage, "pid": pid, "tid": stage,
                      "id": event_id}
            # async begin/end pairs: spans of one stage overlap (many partitions in flight)
            events.append({**common, "ph": "b", "ts": self.start[i] / 1000, "args": args})
            events.append({**common, "ph": "e", "ts": self.end[i] / 1000})
        if self.nic is not None:
            events.extend(self.nic.counter_events(pid))
        wall_ns, mono_ns = time.time_ns(), now_ns()
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, "version": __version__, "role": self.role,
                              "rank": self.rank, "boot_id": boot_id(),
                              "clock": {"wall_ns": wall_ns, "monotonic_ns": mono_ns},
                              "scheduler_clock": self.scheduler_clock,
                              "nic": None if self.nic is None else self.nic.to_json(),
                              "window_ns": self.window_ns, "steps": self.step,
                              "spans": kept, "dropped": first}}
