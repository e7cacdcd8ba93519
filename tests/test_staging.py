"""The stager of CUDA tensors through host memory (engine/torch/staging.py): the order it keeps,
the errors it hands back and its deadlines, with host copies in place of the CUDA ones (the
copies themselves are exercised on a GPU by test_torch_gpu.py); and the copies back of a
result read where it arrived in shared memory, on host tensors."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from bpsctl.engine.common import EngineError
from bpsctl.engine.shmlink import merge_runs
from bpsctl.engine.torch import _results_to_device
from bpsctl.engine.torch.staging import StagedOp, Stager
from bpsctl.engine.trace import STAGE


class Push:
    """A push_pull the test completes when it chooses."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout_s: float) -> None:
        if not self.finished.wait(timeout_s):
            raise EngineError("never finished")
        if self.error is not None:
            raise self.error

    def downstream(self):
        return self.wait, self.finished.is_set


@pytest.fixture
def stager():
    stager = Stager(op_timeout_s=5.0)
    yield stager
    stager.close()


def _op(name, log, push, fail_copy=False):
    def to_host():
        if fail_copy:
            raise RuntimeError(f"copy of {name} failed")
        log.append(("to_host", name))

    def start():
        log.append(("start", name))
        return push.downstream()

    def to_device():
        log.append(("to_device", name))
        return f"event of {name}"
    return StagedOp(name, to_host, start, to_device)


def test_pushes_start_in_the_order_of_the_calls_and_come_back_as_they_finish(stager):
    log: list[tuple[str, str]] = []
    pushes = [Push() for _ in range(3)]
    ops = [stager.submit(_op(f"t{i}", log, push)) for i, push in enumerate(pushes)]
    deadline = time.monotonic() + 5
    while sum(kind == "start" for kind, _ in log) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # every copy and push_pull started before any result came back: nothing waited for one
    assert log == [("to_host", "t0"), ("start", "t0"), ("to_host", "t1"), ("start", "t1"),
                   ("to_host", "t2"), ("start", "t2")]
    assert not any(op.done.is_set() for op in ops)
    pushes[0].finished.set()
    assert ops[0].wait(5) == "event of t0"          # copied back as soon as its result is in
    assert not ops[1].done.is_set()
    for push in pushes[1:]:
        push.finished.set()
    assert [op.wait(5) for op in ops[1:]] == ["event of t1", "event of t2"]
    assert [name for kind, name in log if kind == "to_device"] == ["t0", "t1", "t2"]


def test_a_failed_copy_or_push_is_raised_by_its_own_wait_and_the_others_go_on(stager):
    log: list[tuple[str, str]] = []
    failing = stager.submit(_op("bad-copy", log, Push(), fail_copy=True))
    refused = Push()
    refused.error = ValueError("the engine refused it")
    refused.finished.set()
    broken = stager.submit(_op("bad-push", log, refused))
    fine = Push()
    fine.finished.set()
    good = stager.submit(_op("good", log, fine))
    with pytest.raises(RuntimeError, match="copy of bad-copy failed"):
        failing.wait(5)
    with pytest.raises(ValueError, match="the engine refused it"):
        broken.wait(5)
    assert good.wait(5) == "event of good"
    assert ("start", "bad-copy") not in log and ("to_device", "bad-push") not in log


def test_a_result_that_never_comes_fails_its_wait_at_the_deadline_naming_the_tensor(stager):
    push = Push()
    op = stager.submit(_op("stuck", [], push))
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"push_pull of 'stuck' did not finish within 0.2 s"):
        op.wait(0.2)
    assert time.monotonic() - started < 2
    push.finished.set()             # the stager's own threads stop at close


def test_a_names_next_op_is_copied_to_the_host_only_once_its_previous_is_done(stager):
    """Both ops of a name use its host buffers (or its push slots): the second one's copy to
    the host waits until the first one's result is back on the device."""
    log: list[tuple[str, str]] = []
    copying_back, release = threading.Event(), threading.Event()
    second_copied = threading.Event()
    first_push, second_push = Push(), Push()
    first_push.finished.set()
    second_push.finished.set()
    first = _op("g", log, first_push)
    plain_to_device = first.to_device

    def slow_to_device():
        copying_back.set()
        assert release.wait(5)
        return plain_to_device()
    first.to_device = slow_to_device
    second = _op("g", log, second_push)
    plain_to_host = second.to_host

    def to_host():
        second_copied.set()
        plain_to_host()
    second.to_host = to_host
    stager.submit(first)
    stager.submit(second)
    assert copying_back.wait(5)
    assert not second_copied.wait(0.3), "copied over the name's buffers before they were free"
    release.set()
    assert first.wait(5) == "event of g" and second.wait(5) == "event of g"
    assert log == [("to_host", "g"), ("start", "g"), ("to_device", "g"),
                   ("to_host", "g"), ("start", "g"), ("to_device", "g")]


def test_each_op_leaves_its_copy_out_and_its_copy_back_as_trace_spans():
    """With a recorder (the worker's trace_span), each op's to_host span covers its copy to
    the host and its push's start, and its to_device span runs from the push_pull's result to
    the copy back: the staged path's share of a traced step, in stages a trace knows."""
    spans: list[tuple[str, str, int, int]] = []
    stager = Stager(5.0, record=lambda *span: spans.append(span))
    marks: dict[str, int] = {}
    started, push = threading.Event(), Push()

    def to_host():
        marks["to_host"] = time.monotonic_ns()

    def start():
        marks["start"] = time.monotonic_ns()
        started.set()
        return push.downstream()

    def to_device():
        marks["to_device"] = time.monotonic_ns()
        return "event"
    try:
        op = stager.submit(StagedOp("g", to_host, start, to_device))
        assert started.wait(5)
        marks["result"] = time.monotonic_ns()
        push.finished.set()
        assert op.wait(5) == "event"
    finally:
        stager.close()
    assert [(stage, name) for stage, name, _, _ in spans] == [("to_host", "g"), ("to_device", "g")]
    assert all(stage in STAGE for stage, _, _, _ in spans)
    (_, _, out_start, out_end), (_, _, back_start, back_end) = spans
    assert out_start <= marks["to_host"] <= marks["start"] <= out_end
    assert marks["result"] <= back_start <= marks["to_device"] <= back_end


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_result_read_where_it_arrived_lands_whole_and_divided(dtype):
    """The copies back of a result whose partitions are partly lent (in shared memory, one
    read-only, averaged on the device) and partly in the host buffer, as the GPU path queues
    them: every element in place, each lent partition divided as the engine would."""
    count, part = 1000, 96                  # partitions of 96 elements, the last one short
    want = torch.arange(count, dtype=torch.float32).to(dtype) * 2
    itemsize = want.element_size()
    host_out = torch.zeros(count, dtype=dtype)
    lent = []
    for index, start in enumerate(range(0, count, part)):
        chunk = want[start:start + part]
        if index % 3 == 1:          # left in the host buffer by the engine, divided there
            host_out[start:start + part] = chunk / 2
            continue
        # the sum as it is in shared memory (for a partition not averaged: the result)
        summed = chunk if index % 3 == 0 else chunk / 2
        view = summed.view(torch.uint8).numpy().copy()
        view.flags.writeable = index % 2 == 0       # a server's sum buffer is read-only
        lent.append((start * itemsize, view, 2 if index % 3 == 0 else None))
    device_out = torch.full((count,), -1, dtype=dtype)
    _results_to_device(device_out, host_out, lent[::-1])    # in any order
    assert torch.equal(device_out, want / 2)


def test_sums_in_consecutive_memory_come_back_in_one_copy_divided_once():
    """Lent sums of consecutive partitions that lie one after the other in one segment (a
    worker's own slots, or a server's buffers) are joined into one copy (shmlink.merge_runs,
    as the GPU path queues them); the result is whole and each element divided once."""
    count, part = 1000, 128
    want = torch.arange(count, dtype=torch.float32)
    segment = (want * 4).view(torch.uint8).numpy().copy()      # the sums, back to back
    lent = [(start * 4, segment[start * 4:(start + part) * 4], 4)
            for start in range(0, count, part)]
    runs = merge_runs(lent)
    assert [(offset, len(view), divisor) for offset, view, divisor in runs] == [
        (0, count * 4, 4)]
    device_out = torch.full((count,), -1.0)
    _results_to_device(device_out, torch.zeros(count), runs)
    assert torch.equal(device_out, want)
