"""CUDA tensors through host memory without holding up the caller: the torch plugin's staged
path (a shared GPU, one worker per host, ``BPSCTL_LOCAL_REDUCE=off``, asynchronous training).

The caller (an autograd hook, in backward) records an event on its stream after the work that
produced the tensor and hands the tensor over; it never waits for a copy. Two threads of the
process do the rest, each in submission order:

- the **outbound** thread waits (on the device's own copy stream, not on the caller's) for that
  event, copies the tensor into its pinned host buffer, waits for the copy (the thread sleeps;
  the GPU keeps running the backward pass), and starts the push_pull of the host buffer
  (``start``: the engine's or the intra-node stage's). One thread for all devices keeps the
  order of the pushes that of the calls, which the intra-node stage needs on every rank;
- the **return** thread waits for each push_pull's result and copies it back to the device on
  another copy stream as soon as it is in, while later tensors are still on the wire and
  backward still runs, and waits for that copy: an op is done once its result is on the
  device (the host memory it came from is free again), and its event is what the caller's
  stream waits on (``synchronize``).

Two ops of one name go one after the other: the second is copied to the host only once the
first is done, as both use the name's host buffers (or its push slots in shared memory, which
the GPU may fill straight: ``Worker.lend``). Nothing here blocks on the GPU from the caller's
thread, and every wait has the op deadline.
The threads start with the first CUDA tensor. The copies and events are CUDA's; the order,
errors and deadlines are this module's own and are tested with host tensors
(:class:`Stager` takes the copy functions).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..common import EngineError

#: what ``start`` returns: (wait(timeout_s) that raises on failure, done() -> bool)
Downstream = tuple[Callable[[float], Any], Callable[[], bool]]


def _spent() -> Any:
    raise AssertionError("a staged op's copies ran twice")


class StagedOp:
    """One tensor through the stager: its copies, its push_pull, and how it ended."""

    __slots__ = ("name", "to_host", "start", "to_device", "done", "error", "finished",
                 "downstream", "previous")

    def __init__(self, name: str, to_host: Callable[[], None],
                 start: Callable[[], Downstream], to_device: Callable[[], Any]):
        self.name = name
        self.to_host = to_host          # copy into the host buffer and wait for it
        self.start = start              # start the push_pull of the host buffer
        self.to_device = to_device      # copy the result back; returns what to wait on
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.finished: Any = None       # to_device's answer (a CUDA event) once done
        self.downstream: Downstream | None = None
        self.previous: StagedOp | None = None   # the name's op before, if not done then

    def wait(self, timeout_s: float) -> Any:
        """Wait for the result to be back (or the op to fail, raising its error); returns
        ``finished`` (the event the caller's stream must wait on)."""
        if not self.done.wait(timeout_s):
            raise EngineError(f"push_pull of {self.name!r} did not finish within "
                              f"{timeout_s:g} s (CUDA tensor staged through host memory)")
        if self.error is not None:
            raise self.error
        return self.finished


class Stager:
    """The outbound and return threads of one process (see the module docstring)."""

    def __init__(self, op_timeout_s: float,
                 record: Callable[[str, str, int, int], None] | None = None):
        self.op_timeout_s = op_timeout_s
        # record(stage, name, start_ns, end_ns): each op's to_host and to_device spans (the
        # worker's trace_span, which keeps them while a trace is being taken)
        self.record = record
        self._last: dict[str, StagedOp] = {}    # name -> its latest op not yet done
        self._lock = threading.Lock()
        self._outbound: queue.SimpleQueue[StagedOp | None] = queue.SimpleQueue()
        self._returning: queue.SimpleQueue[StagedOp | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._outbound_loop, daemon=True,
                                          name="bps-cuda-out"),
                         threading.Thread(target=self._return_loop, daemon=True,
                                          name="bps-cuda-back")]
        for thread in self._threads:
            thread.start()

    def submit(self, op: StagedOp) -> StagedOp:
        with self._lock:
            op.previous = self._last.get(op.name)
            self._last[op.name] = op
        self._outbound.put(op)
        return op

    def close(self, timeout_s: float = 5.0) -> None:
        self._outbound.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _outbound_loop(self) -> None:
        while (op := self._outbound.get()) is not None:
            try:
                previous, op.previous = op.previous, None
                limit = self.op_timeout_s + 10
                if previous is not None and not previous.done.wait(limit):
                    raise EngineError(f"push_pull of {op.name!r} waited {limit:g} s for the "
                                      "name's previous push_pull, which did not finish; "
                                      "synchronize a push_pull before pushing its name again")
                began = time.monotonic_ns()
                op.to_host()
                op.downstream = op.start()
                if self.record is not None:
                    self.record("to_host", op.name, began, time.monotonic_ns())
            except BaseException as exc:        # noqa: BLE001 - handed to the caller
                op.error = exc
            self._returning.put(op)
        self._returning.put(None)

    def _return_loop(self) -> None:
        while (op := self._returning.get()) is not None:
            try:
                if op.error is None and op.downstream is not None:
                    wait, _ = op.downstream
                    wait(self.op_timeout_s + 10)
                    arrived = time.monotonic_ns()
                    op.finished = op.to_device()
                    if self.record is not None:
                        self.record("to_device", op.name, arrived, time.monotonic_ns())
            except BaseException as exc:        # noqa: BLE001
                op.error = exc
            with self._lock:
                if self._last.get(op.name) is op:
                    del self._last[op.name]
            # what the copies held (the tensors, the host buffers) is not needed any more
            op.to_host = op.start = op.to_device = _spent
            op.done.set()
