"""Horovod's join (``hvd.join()``): ranks out of data add zeros to the others' collectives
until every rank has joined, and ``join()`` returns the rank that joined last.

The fast test runs the engine's join on worker threads against the module's real cluster
(conftest.run_job); the slow ones run real ``bpsctl run -np N`` jobs of torch and MXNet
scripts (the helpers of test_horovod_api.py and test_mxnet_plugin.py) with uneven data: each
rank computes on its own what every collective and optimizer step should give from every
rank's inputs and records each outcome.
"""
from __future__ import annotations

import io
import json
import sys
import textwrap

import numpy as np
import pytest
from conftest import JobFailed

from bpsctl.config import Config
from bpsctl.engine import Worker
from bpsctl.engine import protocol as P
from bpsctl.engine.common import HorovodInternalError
from bpsctl.launch.api import run_local

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- the engine


def test_joined_workers_add_zeros_until_all_joined_and_rounds_go_on_after(job):
    """Rank 2 joins at once, rank 1 after one collective, rank 0 after two: the live ranks'
    sums hold zeros for the joined, averages divide by all 3, Min folds a zero in, a push_pull
    that cannot take zeros fails with its message; every rank gets 0, the last to join, and
    the next sums of all three (rounds the joined ones sat out) are exact."""
    def x(rank: int, step: int) -> np.ndarray:
        return (np.arange(6, dtype=np.float64) - 2.5) * (rank + 1) + step

    def body(w: Worker) -> tuple[int, list[str]]:
        seen = []
        steps = {0: 2, 1: 1, 2: 0}[w.rank]
        for step in range(steps):
            live = [r for r in range(3) if {0: 2, 1: 1, 2: 0}[r] > step]
            total = sum(x(r, step) for r in live)
            got = w.push_pull(x(w.rank, step), name="sum", average=False)
            assert np.array_equal(got, total), (w.rank, step, got, total)
            got = w.push_pull(x(w.rank, step), name="avg")
            assert np.allclose(got, total / 3, rtol=0, atol=1e-12), (w.rank, step, got)
            got = w.push_pull(x(w.rank, step), name="min", average=False,
                              reduction=P.REDUCE_MIN)
            want = np.minimum.reduce([*(x(r, step) for r in live), np.zeros(6)])
            assert np.array_equal(got, want), (w.rank, step, got, want)
            if step == 0:
                # bfloat16 bits: [1, -1] on rank 0, [2, -2] on rank 1, a zero from rank 2
                bits = np.array([[0x3F80, 0xBF80], [0x4000, 0xC000]][w.rank], np.uint16)
                got = w.push_pull(bits.view(P.BFLOAT16), name="bf16.min", average=False,
                                  reduction=P.REDUCE_MIN)
                assert got.view(np.uint16).tolist() == [0x0000, 0xC000], got.view(np.uint16)
                # rank 2 joined before rank 1 could finish its first sum: known here
                with pytest.raises(HorovodInternalError, match="not supported with Join"):
                    w.synchronize(w.push_pull_async(
                        np.ones(2), name="gather", average=False,
                        join_error="Allgather is not supported with Join at this time."))
                seen.append("refused")
        last = w.join()
        assert not w.joined_ranks
        for step in range(2):           # every rank again, through rounds it sat out
            got = w.push_pull(x(w.rank, step), name="sum", average=False)
            assert np.array_equal(got, sum(x(r, step) for r in range(3))), (w.rank, got)
            got = w.push_pull(x(w.rank, step), name="min", average=False,
                              reduction=P.REDUCE_MIN)
            assert np.array_equal(got, np.minimum.reduce([x(r, step) for r in range(3)]))
        return last, seen

    results = job(3, 2, body)
    assert [last for last, _ in results] == [0, 0, 0]
    assert [seen for _, seen in results] == [["refused"], ["refused"], []]


def test_compressed_rounds_a_joined_worker_sat_out_decode_exactly_after_the_join(job):
    """Random-k with every value (a permutation drawn from the partition and round): the
    ranks that go on push three compressed rounds while rank 2 has joined; after the join its
    pushes are drawn from the job's round, not its own, so every sum is exact."""
    from bpsctl.engine import compression as C
    randomk = C.RandomK(ratio=1.0)

    def x(rank: int, step: int) -> np.ndarray:
        return np.arange(8, dtype=np.float32) * (rank + 1) + step

    def body(w: Worker) -> int:
        steps = 0 if w.rank == 2 else 3
        for step in range(steps):
            got = w.push_pull(x(w.rank, step), name="c", average=False, compression=randomk)
            assert np.array_equal(got, x(0, step) + x(1, step)), (w.rank, step, got)
        last = w.join()
        for step in range(3, 5):
            got = w.push_pull(x(w.rank, step), name="c", average=False, compression=randomk)
            assert np.array_equal(got, sum(x(r, step) for r in range(3))), (w.rank, step, got)
        return last

    assert job(3, 2, body, min_compress_bytes=0) in ([0, 0, 0], [1, 1, 1])


def test_join_is_refused_with_backup_workers_naming_the_knob(job):
    def body(w: Worker) -> None:
        w.join()
    with pytest.raises(JobFailed, match="BPSCTL_BACKUP_WORKERS=1"):
        job(2, 1, body, backup_workers=1)


# --------------------------------------------------------------------------- torch, real jobs

TORCH_JOIN_SCRIPT = '''
hvd = bps
STEPS = {0: 6, 1: 4, 2: 2}       # uneven data: rank 2 runs out first, rank 0 last

def live(step):
    return [r for r in range(N) if STEPS[r] > step]

def x(r, step):
    return (torch.arange(6, dtype=torch.float64) - 2.5) * (r + 1) + step

def batch(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(4, 3, generator=g, dtype=torch.float64)

def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).double()

def loss_of(model, r, step):
    return (model(batch(r, step)) ** 2).mean() * (r + 1)

def reference_step(ref, step, ranks):
    """One step of a single process: the gradient summed over ``ranks``, zeros from the
    others, divided by every rank (Horovod's average with joined ranks)."""
    grads = []
    for r in ranks:
        ref.zero_grad()
        loss_of(ref, r, step).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p -= 0.1 * sum(g[i] for g in grads) / N

model, ref = make_model(), make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

def exact(got, want, what, step):
    assert got.dtype == want.dtype and torch.equal(got, want), (what, step, got, want)

def same_model(what):
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (what, got, want)

def refused(call):
    try:
        call()
        return "no error"
    except hvd.HorovodInternalError as exc:
        return str(exc)

@check
def live_ranks_collectives_count_joined_ranks_as_zeros():
    for step in range(STEPS[R]):
        L = live(step)
        total = sum(x(r, step) for r in L)
        exact(hvd.allreduce(x(R, step), op=hvd.Sum, name="sum"), total, "sum", step)
        got = hvd.allreduce(x(R, step), op=hvd.Average, name="avg")
        assert torch.allclose(got, total / N, rtol=0, atol=1e-12), ("avg", step, got)
        zeros = [torch.zeros(6, dtype=torch.float64)] * (N - len(L))
        want = torch.stack([x(r, step) for r in L] + zeros).amin(0)
        exact(hvd.allreduce(x(R, step), op=hvd.Min, name="min"), want, "min", step)
        ints = torch.arange(4, dtype=torch.int64) * (R + 1) + step
        exact(hvd.allreduce(ints, op=hvd.Sum, name="ints"),
              sum(torch.arange(4, dtype=torch.int64) * (r + 1) + step for r in L), "ints", step)
        opt.zero_grad()
        loss_of(model, R, step).backward()
        opt.step()
        reference_step(ref, step, L)
        same_model(f"optimizer step {step}")
        if step == 2:       # rank 2 has joined (its last step was step 1)
            RESULTS["gather_while_joined"] = refused(
                lambda: hvd.allgather(torch.ones(2, 1), name="gather_while_joined"))
            RESULTS["broadcast_while_joined"] = refused(
                lambda: hvd.broadcast(torch.ones(3), root_rank=0, name="bcast_while_joined"))

@check
def join_returns_the_last_rank_to_join_everywhere():
    RESULTS["last"] = hvd.join()

@check
def after_join_every_rank_trains_on_exactly():
    # the joined ranks' models sat the others' steps out: take rank 0's, as an epoch would
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(6):       # the reference's steps the joined ranks missed
        if step >= STEPS[R]:
            reference_step(ref, step, live(step))
    same_model("after broadcast")
    for step in range(6, 8):
        total = sum(x(r, step) for r in range(N))
        assert torch.equal(hvd.allreduce(x(R, step), op=hvd.Sum, name="sum"), total), step
        want = torch.stack([x(r, step) for r in range(N)]).amin(0)
        assert torch.equal(hvd.allreduce(x(R, step), op=hvd.Min, name="min"), want), step
        opt.zero_grad()
        loss_of(model, R, step).backward()
        opt.step()
        reference_step(ref, step, range(N))
        same_model(f"optimizer step {step}")
    got = hvd.allgather(torch.full((R + 1, 1), float(R)), name="gather_after")
    assert got.flatten().tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0], got
'''

CHECKS = ["live_ranks_collectives_count_joined_ranks_as_zeros",
          "join_returns_the_last_rank_to_join_everywhere",
          "after_join_every_rank_trains_on_exactly"]


@pytest.fixture(scope="module")
def torch_join(tmp_path_factory):
    pytest.importorskip("torch")
    from test_torch_plugin import run_script
    return run_script(tmp_path_factory.mktemp("hvdjoin"), TORCH_JOIN_SCRIPT, np=3,
                      local_reduce="off")


@pytest.mark.parametrize("check", CHECKS)
def test_uneven_data_with_join_on_three_ranks(torch_join, check):
    """Ranks 2, 1, 0 run out after 2, 4 and 6 steps and join: every allreduce and optimizer
    step of the live ranks is exact with zeros for the joined; join() returns 0 on every
    rank; two more steps of all ranks are exact."""
    from test_torch_plugin import assert_ok
    assert_ok(torch_join, check)
    if check == "join_returns_the_last_rank_to_join_everywhere":
        assert [r["results"]["last"] for r in torch_join] == [0, 0, 0]


def test_a_gather_or_broadcast_while_a_rank_has_joined_raises_horovods_error(torch_join):
    for rank in (0, 1):     # the ranks that called them, with rank 2 joined
        results = torch_join[rank]["results"]
        assert "Allgather is not supported with Join at this time. Specify " \
            "sparse_to_dense=True if using DistributedOptimizer" in \
            results["gather_while_joined"], results
        assert "Broadcast is not supported with Join at this time." in \
            results["broadcast_while_joined"], results
    assert "gather_while_joined" not in torch_join[2]["results"]


STALLED_SCRIPT = '''
hvd = bps
@check
def stalled():
    if R == 1:
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name="first")
        started = time.monotonic()
        try:
            hvd.join()
            RESULTS["outcome"] = "returned"
        except hvd.HorovodInternalError as exc:
            RESULTS["outcome"] = str(exc)
        RESULTS["seconds"] = time.monotonic() - started
    else:
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name="first")
        time.sleep(5)           # computes on, calling no collective and not joining
        try:
            hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late")
        except Exception as exc:        # the job failed meanwhile
            RESULTS["outcome"] = str(exc)
'''


def test_a_rank_that_neither_joins_nor_makes_progress_fails_the_join_at_the_op_timeout(
        tmp_path):
    """Rank 1 joins; rank 0 calls no collective for longer than BPSCTL_OP_TIMEOUT: the join
    fails on rank 1, naming rank 0 and the knob, instead of waiting forever."""
    pytest.importorskip("torch")
    from test_torch_plugin import PRELUDE
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(STALLED_SCRIPT) + "\nsave()\nbps.shutdown()\n")
    out = tmp_path / "out"
    out.mkdir()
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                    start_timeout_s=30.0, op_timeout_s=2.0, local_reduce="off")
    log = io.StringIO()
    result = run_local([sys.executable, str(script), str(out)], 2, config, servers=1,
                       stdout=log, stderr=log)
    assert result.exit_code == 0, log.getvalue()[-4000:]
    joined = json.loads((out / "rank1.json").read_text())["results"]
    assert joined["stalled"] == "ok", joined
    assert "worker(s) [0]" in joined["outcome"] and "BPSCTL_OP_TIMEOUT=2" in \
        joined["outcome"], joined
    assert joined["seconds"] < 5, joined


LOST_SCRIPT = '''
hvd = bps
@check
def lost_during_join():
    hvd.allreduce(torch.ones(2), op=hvd.Sum, name="first")
    if R == 1:
        os._exit(0)             # gone without joining (and without failing the job)
    started = time.monotonic()
    RESULTS["last"] = hvd.join()
    RESULTS["seconds"] = time.monotonic() - started
    RESULTS["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
'''


def test_a_worker_lost_during_a_join_counts_as_joined(tmp_path):
    """--min-workers 2: rank 1 vanishes while ranks 0 and 2 wait in join(); once its
    heartbeats are overdue it counts as joined, the join ends on both, and they go on."""
    pytest.importorskip("torch")
    from test_torch_plugin import run_script
    records = run_script(tmp_path, LOST_SCRIPT, np=3, ranks=[0, 2], local_reduce="off",
                         min_workers=2, heartbeat_timeout_s=2.0)
    results = [r["results"] for r in records]
    assert [r["lost_during_join"] for r in results] == ["ok", "ok"], results
    assert results[0]["last"] == results[1]["last"] in (0, 2), results
    assert all(r["seconds"] < 15 for r in results), results
    assert [r["after"] for r in results] == [[2.0, 2.0]] * 2, results


STAGE_SCRIPT = '''
hvd = bps
@check
def stage_after_join():
    assert bps._p().stage is not None, "two ranks on one host: the intra-node stage"
    hvd.allreduce(torch.ones(2), op=hvd.Sum, name="first")
    if R == 0:
        # past the stage, to the servers: rank 1's zero folded in
        RESULTS["min"] = hvd.allreduce(torch.ones(2), op=hvd.Min, name="min").tolist()
        try:
            hvd.allreduce(torch.ones(2), op=hvd.Sum, name="through_the_stage")
            RESULTS["sum"] = "summed"
        except hvd.HorovodInternalError as exc:
            RESULTS["sum"] = str(exc)
    RESULTS["last"] = hvd.join()
'''


def test_through_the_intra_node_stage_a_collective_after_a_join_says_how_to_go_on(tmp_path):
    """Two ranks on one host (the intra-node stage): rank 1 joins; rank 0's Min (past the
    stage) folds its zero in, its Sum through the stage raises HorovodInternalError naming
    BPSCTL_LOCAL_REDUCE=off, and both ranks' join() return 0."""
    pytest.importorskip("torch")
    from test_torch_plugin import run_script
    records = run_script(tmp_path, STAGE_SCRIPT, np=2)
    results = [r["results"] for r in records]
    assert [r["stage_after_join"] for r in results] == ["ok", "ok"], results
    assert results[0]["min"] == [0.0, 0.0], results
    assert "BPSCTL_LOCAL_REDUCE=off" in results[0]["sum"], results
    assert [r["last"] for r in results] == [0, 0], results


# --------------------------------------------------------------------------- MXNet, a real job

MXNET_JOIN_SCRIPT = '''
import bpsctl.engine.mxnet as hvd
STEPS = {0: 3, 1: 1}

def x(r, step):
    return (np.arange(4, dtype=np.float32) - 1.5) * (r + 1) + step

@check
def mxnet_join():
    for step in range(STEPS[R]):
        live = [r for r in range(N) if STEPS[r] > step]
        total = sum(x(r, step) for r in live)
        got = hvd.allreduce(mx.nd.array(x(R, step)), op=hvd.Sum, name="sum").asnumpy()
        assert np.array_equal(got, total), (step, got, total)
        got = hvd.allreduce(mx.nd.array(x(R, step)), name="avg").asnumpy()
        assert np.allclose(got, total / N), (step, got)
        want = np.maximum.reduce([*(x(r, step) for r in live), *[np.zeros(4, np.float32)] *
                                  (N - len(live))])
        got = hvd.allreduce(mx.nd.array(x(R, step)), op=hvd.Max, name="max").asnumpy()
        assert np.array_equal(got, want), (step, got, want)
        if step == 1:
            try:
                hvd.allgather(mx.nd.ones((1, 2)), name="gather_while_joined")
                raise AssertionError("gathered while rank 1 had joined")
            except hvd.HorovodInternalError as exc:
                assert "Allgather is not supported with Join" in str(exc), str(exc)
    RESULTS["last"] = hvd.join()
    got = hvd.allreduce(mx.nd.array(x(R, 5)), op=hvd.Sum, name="sum").asnumpy()
    assert np.array_equal(got, x(0, 5) + x(1, 5)), got
'''


def test_mxnet_join_on_two_ranks(tmp_path):
    """MXNet's join: rank 1 joins after one step, rank 0 after three; rank 0's allreduces
    count rank 1 as zeros, its allgather raises Horovod's error, join returns 0 on both, and
    both sum exactly afterwards."""
    from test_mxnet_plugin import MXNET_MISSING, run_script
    if MXNET_MISSING:
        pytest.skip(MXNET_MISSING)
    records = run_script(tmp_path, MXNET_JOIN_SCRIPT, 2)
    assert [r["mxnet_join"] for r in records] == ["ok", "ok"], records
    assert [r["last"] for r in records] == [0, 0]
