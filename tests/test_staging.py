"""The stager of CUDA tensors through host memory (engine/torch/staging.py): the order it keeps,
the errors it hands back and its deadlines, with host copies in place of the CUDA ones (the
copies themselves are exercised on a GPU by test_torch_gpu.py)."""
from __future__ import annotations

import threading
import time

import pytest

from bpsctl.engine.common import EngineError
from bpsctl.engine.torch.staging import StagedOp, Stager


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
