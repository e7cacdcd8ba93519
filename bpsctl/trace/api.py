"""Reading the engine's traces: merge every process's file into one timeline, and summarise it.

The files are those :mod:`bpsctl.engine.trace` writes under a trace directory
(``worker-<rank>/comm.json``, ``server-<rank>/comm.json``). :func:`load` checks and aligns
them (files of one machine share its monotonic clock; files of several machines are put on the
scheduler's clock through the offset each process measured when it registered), :func:`merge`
writes ``merged.json``, and
:func:`summarize` says where the steps' time went: per worker, per server, and the longest
stalls of each worker's uplink, in words.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpsctl import __version__
from bpsctl.config import ConfigError


@dataclass
class Span:
    stage: str
    name: str
    start_us: float
    end_us: float
    args: dict[str, Any]

    @property
    def seconds(self) -> float:
        return (self.end_us - self.start_us) / 1e6


@dataclass
class ProcessTrace:
    """One process's file: its spans by stage, on the merged clock (µs)."""

    path: Path
    role: str
    rank: int
    meta: dict[str, Any]
    events: list[dict[str, Any]]
    spans: dict[str, list[Span]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}"


@dataclass
class Nic:
    """One machine's NIC, sampled by a process on it: samples are (µs on the merged clock,
    tx bytes, rx bytes) so far."""

    interface: str
    address: str
    rate_mbit: float | None
    samples: list[tuple[float, int, int]]
    processes: list[str]              # the traced processes that share this NIC

    @property
    def label(self) -> str:
        return f"{self.interface} of {self.address} ({', '.join(self.processes)})"

    def rates(self) -> list[tuple[float, float, float]]:
        """(Mbit/s sent, start µs, end µs) of each interval between consecutive samples."""
        return [((b[1] - a[1]) * 8 / ((b[0] - a[0]) / 1e6) / 1e6, a[0], b[0])
                for a, b in zip(self.samples, self.samples[1:], strict=False) if b[0] > a[0]]


@dataclass
class Timeline:
    directory: Path
    processes: list[ProcessTrace]
    #: how the files were put on one clock: method (monotonic | handshake | wall),
    #: error_bound_s, handshake_offset_s (see _alignment)
    clock: dict[str, Any] = field(default_factory=dict)
    nics: list[Nic] = field(default_factory=list)

    def of(self, role: str) -> list[ProcessTrace]:
        return sorted((p for p in self.processes if p.role == role), key=lambda p: p.rank)


# --------------------------------------------------------------------------- loading

def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not JSON, or cut short ({exc}); was the process stopped "
                          "while it wrote the trace?") from None
    from bpsctl.engine.trace import FORMAT  # here: that module loads NumPy, `bpsctl` need not
    meta = data.get("otherData") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"{path}: not a bpsctl trace (expected Chrome trace JSON with "
                          f"otherData.format = {FORMAT!r})")
    if meta.get("version") != __version__:
        raise ConfigError(f"{path}: written by bpsctl {meta.get('version')}, this is bpsctl "
                          f"{__version__}; read it with that version, or trace again")
    return data


def load(directory: Path | str) -> Timeline:
    """Every trace file under ``directory``, checked and put on one clock; ConfigError (exit 2)
    naming the file for anything that is not a trace of this bpsctl."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such directory (give the directory that "
                          "BPSCTL_TRACE_DIR or `bench --trace` named)")
    paths = sorted(directory.glob("worker-*/comm.json")) + sorted(
        directory.glob("server-*/comm.json"))
    if not paths:
        raise ConfigError(f"{directory}: no traces (expected worker-<rank>/comm.json and "
                          "server-<rank>/comm.json, as BPSCTL_TRACE_DIR=DIR or `bpsctl bench "
                          "... --trace DIR` write them)")
    loaded = [(path, _read(path)) for path in paths]
    shifts, clock = _alignment([data["otherData"] for _, data in loaded])
    processes = []
    for (path, data), shift_ns in zip(loaded, shifts, strict=True):
        meta = data["otherData"]
        process = ProcessTrace(path, str(meta["role"]), int(meta["rank"]), meta,
                               data["traceEvents"])
        begins: dict[tuple[str, str], dict[str, Any]] = {}
        for event in process.events:
            if "ts" in event:
                event["ts"] = event["ts"] + shift_ns / 1000
            if event.get("ph") == "b":
                begins[(event["cat"], event["id"])] = event
            elif event.get("ph") == "e":
                begin = begins.pop((event["cat"], event["id"]), None)
                if begin is not None:
                    process.spans.setdefault(event["cat"], []).append(
                        Span(event["cat"], begin["name"], begin["ts"], event["ts"],
                             begin.get("args", {})))
        processes.append(process)
    return Timeline(directory, processes, clock, _nics(processes, shifts))


def _nics(processes: list[ProcessTrace], shifts: list[int]) -> list[Nic]:
    """One NIC per machine (boot, network namespace, interface), from the first process that
    sampled it; several processes of one machine sample the same counters."""
    nics: dict[tuple[Any, ...], Nic] = {}
    for process, shift_ns in zip(processes, shifts, strict=True):
        nic = process.meta.get("nic")
        if not isinstance(nic, dict) or not nic.get("samples"):
            continue
        key = (process.meta.get("boot_id"), nic.get("netns"), nic.get("interface"))
        if key in nics:
            nics[key].processes.append(process.label)
            continue
        nics[key] = Nic(str(nic["interface"]), str(nic.get("address")), nic.get("rate_mbit"),
                        [((t + shift_ns) / 1000, int(tx), int(rx))
                         for t, tx, rx in nic["samples"]], [process.label])
    return list(nics.values())


def _alignment(metas: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
    """How much to shift each file's timestamps (ns) to put them on one clock, and how.

    Files of one boot of one machine share its monotonic clock: no shift, no error. Otherwise
    each file moves onto the scheduler's clock through the offset its registration measured
    (error: the sum of the two largest bounds, the worst pair); files without one fall back to
    their wall-clock readings (as good as NTP keeps the machines in step; error unknown).
    """
    offsets = [meta.get("scheduler_clock") for meta in metas]
    measured = [o for o in offsets if isinstance(o, dict)]
    check = None
    if measured:
        # what the handshake says between processes that share a clock (truly 0): its error
        check = max(abs(o["offset_ns"]) for o in measured) / 1e9 if len(
            {m.get("boot_id") for m in metas}) == 1 else None
    boots = {meta.get("boot_id") for meta in metas}
    if len(boots) == 1 and all(boots):
        return [0] * len(metas), {"method": "monotonic", "error_bound_s": 0.0,
                                  "handshake_offset_s": check}
    if len(measured) == len(metas):
        bounds = sorted((o["error_ns"] for o in measured), reverse=True)
        return [int(o["offset_ns"]) for o in measured], {
            "method": "handshake", "error_bound_s": sum(bounds[:2]) / 1e9,
            "handshake_offset_s": check}
    reference = metas[0]["clock"]
    shifts = [(m["clock"]["wall_ns"] - m["clock"]["monotonic_ns"])
              - (reference["wall_ns"] - reference["monotonic_ns"]) for m in metas]
    return shifts, {"method": "wall", "error_bound_s": None, "handshake_offset_s": check}


def merge(timeline: Timeline) -> Path:
    """Write every process's events, on the merged clock, to ``<dir>/merged.json``."""
    from bpsctl.engine.trace import FORMAT
    events: list[dict[str, Any]] = []
    for process in timeline.processes:
        events.extend(process.events)
    path = timeline.directory / "merged.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                "otherData": {"format": f"{FORMAT}-merged",
                                              "version": __version__,
                                              "files": [str(p.path) for p in
                                                        timeline.processes]}}))
    return path


# --------------------------------------------------------------------------- summary

def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def idle_gaps(busy: list[tuple[float, float]], start: float, stop: float
               ) -> list[tuple[float, float]]:
    """The gaps in [start, stop) that no interval of ``busy`` covers."""
    gaps, cursor = [], start
    for begin, end in sorted(busy):
        if begin > cursor:
            gaps.append((cursor, min(begin, stop)))
        cursor = max(cursor, end)
        if cursor >= stop:
            break
    if cursor < stop:
        gaps.append((cursor, stop))
    return [(a, b) for a, b in gaps if b > a]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def flows(workers: list[ProcessTrace], window: tuple[float, float] | None
          ) -> list[dict[str, Any]]:
    """Each server's flow, from the workers' pushes to it (sent to acknowledged) within
    ``window`` (µs; None: all of them): the share of the window some worker had a push in
    flight there (``fed``: a flow kept busy is near 1 for the whole round) and the most bytes
    one worker had in flight there at once (the credit bounds their sum over the servers)."""
    busy: dict[int, list[tuple[float, float]]] = {}
    most: dict[int, int] = {}
    for w in workers:
        mine: dict[int, list[Span]] = {}
        for span in w.spans.get("push", []):
            if "server" in span.args and (window is None or (
                    span.end_us > window[0] and span.start_us < window[1])):
                mine.setdefault(int(span.args["server"]), []).append(span)
        for server, spans in mine.items():
            busy.setdefault(server, []).extend((s.start_us, s.end_us) for s in spans)
            # its bytes in flight over time: at one instant, ends before starts
            events = sorted([(s.start_us, 1, int(s.args.get("bytes", 0))) for s in spans]
                            + [(s.end_us, 0, -int(s.args.get("bytes", 0))) for s in spans])
            held = 0
            for _, _, change in events:
                held += change
                most[server] = max(most.get(server, 0), held)
    if not busy:
        return []
    start, stop = window if window is not None else (
        min(a for spans in busy.values() for a, _ in spans),
        max(b for spans in busy.values() for _, b in spans))
    return [{"server": server,
             "fed": union_us([(max(a, start), min(b, stop)) for a, b in intervals])
             / max(stop - start, 1e-9),
             "most_bytes_in_flight": most[server]}
            for server, intervals in sorted(busy.items())]


def summarize(timeline: Timeline, top: int = 5) -> dict[str, Any]:
    """Where the traced steps' time went (the keys are documented in docs/design.md)."""
    workers, servers = timeline.of("worker"), timeline.of("server")
    steps_by_worker = {w.rank: sorted(w.spans.get("step", []), key=lambda s: s.start_us)
                       for w in workers}
    worker_rows: list[dict[str, Any]] = []
    stalls: list[dict[str, Any]] = []
    first_push: dict[int, dict[int, float]] = {}     # step -> rank -> first push sent
    last_result: dict[int, dict[int, float]] = {}    # step -> rank -> last result copied out
    phases: dict[int, dict[str, list[float]]] = {}    # step -> phase -> one per worker
    pushed_in_steps = 0     # pushes inside traced steps, all workers: none, no network traffic
    for w in workers:
        steps = steps_by_worker[w.rank]
        pushes = w.spans.get("push", [])
        comm = pushes + w.spans.get("wait_result", [])
        queued = {(s.name, s.args.get("part"), s.args.get("round")): s
                  for s in w.spans.get("queued", [])}
        comm_s, step_s = [], []
        for step in steps:
            index = int(step.args.get("round", 0))
            for phase, seconds in _phases(w, step).items():
                phases.setdefault(index, {}).setdefault(phase, []).append(seconds)
            inside = [(s.start_us, s.end_us) for s in comm
                      if s.end_us > step.start_us and s.start_us < step.end_us]
            comm_s.append(union_us([(max(a, step.start_us), min(b, step.end_us))
                                     for a, b in inside]) / 1e6)
            step_s.append(step.seconds)
            step_pushes = [s for s in pushes if step.start_us <= s.start_us < step.end_us]
            pushed_in_steps += len(step_pushes)
            if step_pushes:
                first_push.setdefault(index, {})[w.rank] = min(s.start_us for s in step_pushes)
            copies = [s.end_us for s in w.spans.get("copy_out", [])
                      if step.start_us <= s.end_us < step.end_us]
            if copies:
                last_result.setdefault(index, {})[w.rank] = max(copies)
            # the uplink idle while the step was not finished: the longest gaps between pushes
            for gap_start, gap_end in idle_gaps([(s.start_us, s.end_us) for s in step_pushes],
                                                 step.start_us, step.end_us):
                after = next((s for s in sorted(step_pushes, key=lambda s: s.start_us)
                              if s.start_us >= gap_end), None)
                # why the uplink waited: the next partition was not handed to the engine yet
                # (its gradient was being computed), or it was, and waited for credit
                waited = after and queued.get((after.name, after.args.get("part"),
                                               after.args.get("round")))
                cause = None if after is None else "credit" if (
                    waited and waited.start_us <= (gap_start + gap_end) / 2) else "compute"
                stalls.append({"worker": w.rank, "step": index,
                               "seconds": (gap_end - gap_start) / 1e6,
                               "at_s": (gap_start - step.start_us) / 1e6,
                               "before": after.name if after else None, "cause": cause})
        worker_rows.append({
            "rank": w.rank, "steps": len(steps), "step_s": _median(step_s),
            "communication_s": _median(comm_s),
            "bytes_pushed": sum(int(s.args.get("bytes", 0)) for s in pushes),
            "queued_s": _median([s.seconds for s in w.spans.get("queued", [])]),
            "push_s": _median([s.seconds for s in pushes]),
            "wait_result_s": _median([s.seconds for s in w.spans.get("wait_result", [])]),
            # staged CUDA tensors (torch plugin): GPU to push started, sum to back on the GPU
            "to_host_s": _median([s.seconds for s in w.spans.get("to_host", [])]),
            "to_device_s": _median([s.seconds for s in w.spans.get("to_device", [])])})
    # per step: how much later than the earliest worker each one started pushing, and
    # received its last result
    skews = _behind_earliest(first_push)
    lateness = _behind_earliest(last_result)
    for row in worker_rows:
        row["push_start_skew_s"] = _median(skews.get(row["rank"], []))
        row["last_result_lateness_s"] = _median(lateness.get(row["rank"], []))

    server_rows: list[dict[str, Any]] = []
    last_pusher: dict[int, int] = {}
    window = _steps_window(steps_by_worker)
    for s in servers:
        sums = s.spans.get("sum", [])
        waits = s.spans.get("wait_workers", [])
        for wait in waits:
            # only the traced steps' rounds: before them, a broadcast's rounds each wait for
            # its root, the one worker that sends data, which is no straggler
            if window is not None and not window[0] <= wait.end_us <= window[1]:
                continue
            rank = int(wait.args.get("worker", -1))
            last_pusher[rank] = last_pusher.get(rank, 0) + 1
        server_rows.append({
            "rank": s.rank, "rounds": len(waits),
            "bytes_summed": sum(int(x.args.get("bytes", 0)) for x in sums),
            "busy_s": union_us([(x.start_us, x.end_us) for x in sums]) / 1e6,
            "wait_workers_s": _median([x.seconds for x in waits])})
    rounds = sum(last_pusher.values())
    slowest = None
    if rounds and len(workers) > 1:
        # the worker whose push completes a round is the one the others waited for; one that
        # completes clearly more than its share of rounds is the straggler
        rank, count = max(last_pusher.items(), key=lambda item: item[1])
        fraction = count / rounds
        if fraction >= min(0.9, 1.5 / len(workers)):
            slowest = {"rank": rank, "last_in_rounds": count, "rounds": rounds,
                       "fraction": fraction}
    # gradients that never left their host (one host: summed in shared memory, or one
    # worker) leave the uplink idle for whole steps: no stall to explain, nothing to draw
    communication = pushed_in_steps > 0 or window is None and bool(
        any(w.spans.get("push") for w in workers) or any(x for x in server_rows if x["rounds"]))
    if not communication:
        stalls = []
    stalls.sort(key=lambda s: s["seconds"], reverse=True)
    step_rows = [{"step": index, **{phase: _median(values) for phase, values in
                                     sorted(by_phase.items())}}
                 for index, by_phase in sorted(phases.items())]
    summary: dict[str, Any] = {"kind": "trace", "directory": str(timeline.directory),
                               "steps": step_rows,
                               "nics": [_nic_row(nic, window) for nic in timeline.nics],
                               "workers": worker_rows, "servers": server_rows,
                               "slowest_worker": slowest, "stalls": stalls[:top],
                               "communication": communication,
                               "flows": flows(workers, window) if communication else [],
                               "clock": timeline.clock}
    summary["sentences"] = _sentences(summary)
    return summary


def _phases(worker: ProcessTrace, step: Span) -> dict[str, float]:
    """Where one step of one worker went: ``forward_s`` from the step's start to its first
    gradient ready (the forward pass and the first layers' backward), ``backward_s`` to its
    last gradient, ``wait_s`` in synchronize after that (the optimizer waiting for averaged
    gradients), ``optimizer_s`` from there to the step's end (the update): they never
    overlap, so they add up to the step at most. Only what the plugin traced."""
    def inside(stage: str) -> Span | None:
        return next((s for s in worker.spans.get(stage, [])
                     if step.start_us <= s.start_us < step.end_us), None)

    phases = {"step_s": step.seconds}
    backward, wait = inside("backward"), inside("synchronize")
    if backward is not None:
        phases["forward_s"] = (backward.start_us - step.start_us) / 1e6
        phases["backward_s"] = backward.seconds
    if wait is not None:
        # counted from the last gradient on: a wait that began before it (the optimizer
        # synchronizing a bucket while autograd still ran the last hooks) is not counted twice
        begin = wait.start_us if backward is None else max(wait.start_us, backward.end_us)
        end = max(wait.end_us, begin)
        phases["wait_s"] = (end - begin) / 1e6
        phases["optimizer_s"] = (step.end_us - end) / 1e6
    return phases


def _steps_window(steps_by_worker: dict[int, list[Span]]) -> tuple[float, float] | None:
    """From the first traced step's start to the last one's end, on any worker (µs)."""
    steps = [s for spans in steps_by_worker.values() for s in spans]
    if not steps:
        return None
    return min(s.start_us for s in steps), max(s.end_us for s in steps)


IDLE_FRACTION = 0.1     # a NIC sending less than this share of its rate (or peak) is idle


def _nic_row(nic: Nic, window: tuple[float, float] | None) -> dict[str, Any]:
    """A NIC over the traced steps: mean rates, utilisation (of its rate, when known), and the
    longest time it sent next to nothing while a step was under way."""
    samples = nic.samples
    if window is not None:
        samples = [s for s in samples if window[0] <= s[0] <= window[1]]
    row: dict[str, Any] = {"nic": nic.label, "interface": nic.interface,
                           "address": nic.address, "rate_mbit": nic.rate_mbit,
                           "samples": len(samples), "tx_mbit_s": None, "rx_mbit_s": None,
                           "tx_bytes": None, "rx_bytes": None, "utilisation": None,
                           "longest_idle_s": None, "idle_at_s": None}
    if len(samples) < 2:
        return row
    seconds = (samples[-1][0] - samples[0][0]) / 1e6
    tx, rx = samples[-1][1] - samples[0][1], samples[-1][2] - samples[0][2]
    row.update(tx_bytes=tx, rx_bytes=rx, tx_mbit_s=tx * 8 / seconds / 1e6,
               rx_mbit_s=rx * 8 / seconds / 1e6)
    rates = [r for r in nic.rates() if window is None or window[0] <= r[1] and r[2] <= window[1]]
    reference = nic.rate_mbit or max(r for r, _, _ in rates)
    if nic.rate_mbit:
        row["utilisation"] = max(row["tx_mbit_s"], row["rx_mbit_s"]) / nic.rate_mbit
    # the longest run of consecutive intervals sending next to nothing
    longest, at, run_start = 0.0, None, None
    for rate, a, b in rates:
        if rate >= IDLE_FRACTION * reference:
            run_start = None
            continue
        run_start = a if run_start is None else run_start
        if b - run_start > longest:
            longest, at = b - run_start, run_start
    if at is not None:
        row["longest_idle_s"] = longest / 1e6
        row["idle_at_s"] = (at - samples[0][0]) / 1e6
    return row


def _behind_earliest(by_step: dict[int, dict[int, float]]) -> dict[int, list[float]]:
    """rank -> seconds behind the earliest worker, one figure per step."""
    behind: dict[int, list[float]] = {}
    for by_rank in by_step.values():
        earliest = min(by_rank.values())
        for rank, at in by_rank.items():
            behind.setdefault(rank, []).append((at - earliest) / 1e6)
    return behind


#: what the summary says first when no traced step pushed anything
NO_COMMUNICATION = ("no gradient left its host in the traced steps: the workers summed them in "
                    "shared memory on their one host (or there is one worker), so the servers "
                    "and the network were not used; trace a run on several hosts (--emulate, "
                    "--hosts) to see communication")


def _sentences(summary: dict[str, Any]) -> list[str]:
    if not summary["communication"]:
        return [NO_COMMUNICATION]
    said = []
    slowest = summary["slowest_worker"]
    if slowest is not None:
        said.append(f"worker {slowest['rank']} was the slowest: its push completed "
                    f"{slowest['last_in_rounds']} of {slowest['rounds']} rounds on the servers "
                    f"({slowest['fraction']:.0%}); the others waited for it")
    for stall in summary["stalls"]:
        if stall["before"] is None:
            why = " at the end of the step (waiting for results, then the update)"
        elif stall.get("cause") == "credit":
            why = f" while {stall['before']} waited for credit (pushes not yet acknowledged)"
        else:
            why = f" while {stall['before']}'s gradient was computed"
        said.append(f"uplink of worker {stall['worker']} idle {stall['seconds']:.3f} s in step "
                    f"{stall['step']}, {stall['at_s']:.3f} s into it,{why}")
    for nic in summary["nics"]:
        if nic["longest_idle_s"]:
            use = f" ({nic['utilisation']:.0%} used)" if nic["utilisation"] is not None else ""
            said.append(f"NIC {nic['nic']}{use}: sent next to nothing for "
                        f"{nic['longest_idle_s']:.2f} s, {nic['idle_at_s']:.2f} s into the "
                        "traced steps")
    return said
