"""Horovod's process sets (``hvd.add_process_set``, ``process_set=``) on bpsctl's engine.

Fast: the engine's scoped push_pull on worker threads of one real cluster (``job``, see
conftest.run_job): a set's sums complete with its ranks alone while a rank outside it does
something else, averages divide by the set's size, and servers refuse what does not belong to
a set. Slow: one ``bpsctl run -np 3`` job of the PyTorch plugin running a script of many
checks (every collective on a set [0, 2] while rank 1 runs its own global allreduce, two
disjoint sets, removal, disagreement, a rank outside a set), through the intra-node stage and
without it.
"""
from __future__ import annotations

import numpy as np
import pytest

from bpsctl.engine import EngineError, Worker
from bpsctl.engine import process_sets as PS
from bpsctl.engine import protocol as P

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- pure functions


def test_a_request_that_is_not_a_set_of_the_jobs_ranks_says_why():
    assert PS._invalid([0, 2], 3) == ""
    assert PS._invalid([], 3) == "a process set needs at least one rank"
    assert PS._invalid([1, 1], 3) == "ranks [1, 1] name a rank twice"
    assert PS._invalid([0, 3, 7], 3) == "ranks [3, 7] are not ranks of this job (0..2)"
    assert PS.ProcessSet([2, 0]).ranks == [0, 2]            # sorted, as Horovod's
    with pytest.raises(ValueError, match="takes a list of ranks"):
        PS.ProcessSet("0,1")


def test_each_ranks_request_is_read_back_from_its_row():
    width = 11
    row = np.zeros(PS._HEAD + 2, np.uint8)
    row[0] = PS._ADD
    bits = np.zeros(width, np.uint8)
    bits[[0, 9, 10]] = 1
    row[PS._HEAD:] = np.packbits(bits, bitorder="little")
    assert PS._described(row, width) == "add process set [0, 9, 10]"
    row[:] = 0
    row[0] = PS._REMOVE
    row[4:PS._HEAD].view(np.uint32)[0] = 7
    assert PS._described(row, width) == "remove process set 7"
    row[0] = 0
    assert PS._described(row, width) == "nothing (it did not take part)"


# --------------------------------------------------------------------------- the engine


def test_a_sets_sums_complete_without_the_rank_outside_it(job):
    """Ranks 0 and 2 sum, average and take the minimum over the set [0, 2] many times while
    rank 1 waits in a global sum that the others join only after all of theirs: were rank 1
    waited for, the set's first sum would never complete."""
    ranks = (0, 2)

    def body(w: Worker):
        if w.rank in ranks:
            out = []
            for step in range(5):
                mine = np.arange(6, dtype=np.float32) * (w.rank + 1) + step
                out.append(w.push_pull(mine, name="set.sum", average=False, ranks=ranks))
                out.append(w.push_pull(mine, name="set.avg", average=True, ranks=ranks))
                out.append(w.push_pull(mine.astype(np.int64), name="set.min", average=False,
                                       reduction=P.REDUCE_MIN, ranks=ranks))
        else:
            out = []
        out.append(w.push_pull(np.ones(2, np.int32), name="everyone", average=False))
        return out

    results = job(3, 2, body, partition_bytes=8)     # several partitions on both servers
    for rank in ranks:
        got = results[rank]
        for step in range(5):
            a, b = (np.arange(6, dtype=np.float32) * (r + 1) + step for r in ranks)
            np.testing.assert_array_equal(got[3 * step], a + b)
            np.testing.assert_array_equal(got[3 * step + 1], (a + b) / 2)   # the set's size
            np.testing.assert_array_equal(got[3 * step + 2], np.minimum(a, b).astype(np.int64))
    for rank in range(3):
        np.testing.assert_array_equal(results[rank][-1], np.full(2, 3, np.int32))


def test_two_disjoint_sets_sum_at_once(job):
    """Sets [0, 1] and [2] sum at once, each under names of its own (the plugins prefix a
    set's names with its id): each rank gets its own set's sum."""
    def body(w: Worker):
        ranks = (0, 1) if w.rank < 2 else (2,)
        name = f"ps{1 if w.rank < 2 else 2}/x"
        return w.push_pull(np.full(3, 10.0 ** w.rank), name=name, average=False, ranks=ranks)

    results = job(3, 1, body)
    np.testing.assert_array_equal(results[0], np.full(3, 11.0))
    np.testing.assert_array_equal(results[1], np.full(3, 11.0))
    np.testing.assert_array_equal(results[2], np.full(3, 100.0))


def test_a_rank_in_two_overlapping_sets_sums_in_both_at_once(job):
    """Rank 1 is in the sets [0, 1] and [1, 2] and has both sums in flight together; ranks 0
    and 2 each wait only for it."""
    def body(w: Worker):
        mine = np.full(1000, 10.0 ** w.rank)
        handles = [w.push_pull_async(mine, name=f"ps{index}/x", average=False, ranks=ranks)
                   for index, ranks in ((1, (0, 1)), (2, (1, 2))) if w.rank in ranks]
        return [w.synchronize(h)[0] for h in handles]

    assert job(3, 2, body, partition_bytes=1024) == [[11.0], [11.0, 110.0], [110.0]]


def test_a_rank_outside_the_set_is_refused_before_anything_is_sent(job):
    def body(w: Worker):
        if w.rank == 1:
            with pytest.raises(ValueError, match=r"this worker \(rank 1\) is not one of the "
                                                 r"process set's ranks \[0\]"):
                w.push_pull(np.ones(2), name="x", ranks=(0,))
        return w.push_pull(np.ones(2), name="y", average=False)

    for result in job(2, 1, body):
        np.testing.assert_array_equal(result, np.full(2, 2.0))


def test_a_server_refuses_a_sets_partition_pushed_by_every_worker(job):
    """Rank 0 sums ``x`` over the set [0]; rank 1 then pushes ``x`` as a tensor of every
    worker: the server names the set and the rank that is not in it."""
    def body(w: Worker):
        if w.rank == 0:
            np.testing.assert_array_equal(
                w.push_pull(np.ones(3), name="x", average=False, ranks=(0,)), np.ones(3))
        w.barrier()
        if w.rank == 1:
            with pytest.raises(EngineError, match=r"belongs to process set \[0\], which rank 1 "
                                                  r"is not in"):
                w.push_pull(np.ones(3), name="x", average=False)

    job(2, 1, body)


# --------------------------------------------------------------------------- PyTorch, 3 ranks

SCRIPT = '''
import math
hvd = bps
ME = R
assert N == 3, N

def same(got, want, what=""):
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(got, want), (what, got, want)

def refused(error, words, call):
    try:
        call()
    except error as exc:
        assert words in str(exc), (words, str(exc))
        return str(exc)
    raise AssertionError(f"accepted: {words}")

def of(r, shape, dtype=torch.float32):
    """Rank r's input: small integers, exact in every dtype, distinct per rank."""
    count = math.prod(shape)
    return ((torch.arange(count).reshape(shape) * 3 + 5 * r + 1) % 13).to(dtype)

EVEN = hvd.add_process_set([2, 0])          # every rank adds it, in the same order
SET = [0, 2]

@check
def a_set_knows_its_ranks():
    assert EVEN.process_set_id == 1 and EVEN.ranks == SET, str(EVEN)
    assert EVEN.size() == 2 and EVEN.included() == (ME != 1)
    if ME == 1:
        refused(ValueError, "not part of provided process set", EVEN.rank)
    else:
        assert EVEN.rank() == SET.index(ME)

@check
def every_collective_of_a_set_runs_among_its_ranks_only():
    if ME != 1:
        ps, me = EVEN, SET.index(ME)
        ins = [of(r, (4, 3)) for r in SET]
        same(hvd.allreduce(ins[me], op=hvd.Sum, process_set=ps), ins[0] + ins[1], "sum")
        same(hvd.allreduce(ins[me], name="avg", process_set=ps), (ins[0] + ins[1]) / 2, "avg")
        same(hvd.allreduce(ins[me].double(), op=hvd.Average, process_set=ps),
             (ins[0] + ins[1]).double() / 2, "avg f64")
        ints = [t.to(torch.int64) for t in ins]
        same(hvd.allreduce(ints[me], op=hvd.Average, process_set=ps),
             torch.div(ints[0] + ints[1], 2, rounding_mode="floor"), "int avg: floor")
        same(hvd.allreduce(ins[me], op=hvd.Min, process_set=ps), torch.minimum(*ins), "min")
        same(hvd.allreduce(ints[me], op=hvd.Max, process_set=ps), torch.maximum(*ints), "max")
        same(hvd.allreduce(ins[me], op=hvd.Product, process_set=ps), ins[0] * ins[1], "prod")
        x = ins[me].clone()
        hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum, name="inplace", process_set=ps))
        same(x, ins[0] + ins[1], "in place")
        pairs = [[of(r, (5,), torch.float64), of(r, (2, 2), torch.int32)] for r in SET]
        got = hvd.grouped_allreduce(pairs[me], op=hvd.Sum, process_set=ps)
        same(got[0], pairs[0][0] + pairs[1][0], "grouped 0")
        same(got[1], pairs[0][1] + pairs[1][1], "grouped 1")
        # allgather, uneven rows: global rank r gives r + 1 rows, in set order
        rows = [of(r, (r + 1, 2), torch.int16) for r in SET]
        same(hvd.allgather(rows[me], process_set=ps), torch.cat(rows), "allgather")
        got = hvd.grouped_allgather([rows[me], rows[me].double()], name="g", process_set=ps)
        same(got[1], torch.cat(rows).double(), "grouped allgather")
        # broadcast from set rank 1, which is global rank 2 (root_rank is global, as Horovod's)
        same(hvd.broadcast(of(ME, (3, 3)), root_rank=2, process_set=ps), of(2, (3, 3)), "bcast")
        y = of(ME, (7,), torch.uint8)
        hvd.broadcast_(y, root_rank=0, name="b_", process_set=ps)
        same(y, of(0, (7,), torch.uint8), "broadcast_")
        refused(ValueError, "root_rank 1 is not in the process set [0, 2]",
                lambda: hvd.broadcast(y, root_rank=1, process_set=ps))
        # alltoall with splits: set rank 0 sends 1 row to itself and 2 to set rank 1; set
        # rank 1 sends 2 rows to set rank 0 and none to itself
        splits = {0: [1, 2], 2: [2, 0]}
        sent = {r: of(r, (sum(splits[r]), 2)) for r in SET}
        out, received = hvd.alltoall(sent[ME], splits=splits[ME], process_set=ps)
        want, got_splits = [], []
        for r in SET:
            start = sum(splits[r][:me])
            want.append(sent[r][start:start + splits[r][me]])
            got_splits.append(splits[r][me])
        same(out, torch.cat(want), "alltoall")
        assert received.tolist() == got_splits, (received, got_splits)
        even = hvd.alltoall(of(ME, (4,)), process_set=ps)          # equal splits of the set
        same(even, torch.cat([of(r, (4,))[2 * me:2 * me + 2] for r in SET]), "alltoall even")
        # reducescatter: 5 rows over a set of 2 ranks: 3 and 2
        whole = [of(r, (5, 2), torch.float64) for r in SET]
        total = whole[0] + whole[1]
        start, count = [(0, 3), (3, 2)][me]
        same(hvd.reducescatter(whole[me], op=hvd.Sum, process_set=ps),
             total[start:start + count], "reducescatter sum")
        same(hvd.reducescatter(whole[me], op=hvd.Average, name="rs", process_set=ps),
             total[start:start + count] / 2, "reducescatter avg")
        # gradients flow within the set: the allreduce (Sum) of ones over 2 ranks
        z = of(ME, (3,)).requires_grad_()
        hvd.allreduce(z, op=hvd.Sum, process_set=ps).sum().backward()
        same(z.grad, torch.full((3,), 2.0), "gradient")
        got = hvd.broadcast_object({"from": ME}, root_rank=2, process_set=ps)
        assert got == {"from": 2}, got
        hvd.barrier(process_set=ps)
    # rank 1 waits here for ranks 0 and 2, which come once all of the set's work is done:
    # had any of it waited for rank 1, this would never complete
    same(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after the set"),
         torch.tensor([3.0]), "global")

@check
def two_disjoint_sets_at_once():
    low, high = hvd.add_process_set([0, 1]), hvd.add_process_set([2])
    assert (low.process_set_id, high.process_set_id) == (2, 3)
    mine, members = (low, [0, 1]) if ME < 2 else (high, [2])
    # the same automatic names in both sets: each set's are its own
    got = hvd.allreduce(torch.tensor([10.0 ** ME]), op=hvd.Sum, process_set=mine)
    same(got, torch.tensor([sum(10.0 ** r for r in members)]), "sum")
    same(hvd.allgather(torch.tensor([ME]), process_set=mine), torch.tensor(members), "gather")
    same(hvd.broadcast(torch.tensor([ME]), root_rank=members[-1], process_set=mine),
         torch.tensor([members[-1]]), "broadcast")
    hvd.barrier(process_set=mine)
    assert hvd.remove_process_set(low) is True and hvd.remove_process_set(high) is True

@check
def a_removed_set_refuses_its_collectives():
    ps = hvd.add_process_set([1, 2])
    first = ps.process_set_id
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None and ps.size() is None and ps.rank() is None
    refused(ValueError, "is not a registered process set (never added, or removed)",
            lambda: hvd.allreduce(torch.ones(1), process_set=ps))
    assert hvd.remove_process_set(ps) is False            # nothing left to remove
    assert hvd.remove_process_set(hvd.global_process_set) is False
    again = hvd.add_process_set([1, 2])                   # the same ranks: a new id
    assert again.process_set_id == first + 1, (again, first)
    if ME != 0:
        same(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=again), torch.tensor([2.0]))
    assert hvd.remove_process_set(again) is True

@check
def ranks_that_disagree_all_fail_naming_each_request():
    asked = [[0, 1], [0, 1], [0, 2]][ME]
    message = refused(ValueError, "add_process_set: the ranks disagree",
                      lambda: hvd.add_process_set(asked))
    for words in ("rank 0 asked to add process set [0, 1]",
                  "rank 1 asked to add process set [0, 1]",
                  "rank 2 asked to add process set [0, 2]", "in the same order"):
        assert words in message, (words, message)
    # a list that is not a set of this job's ranks, on one rank: every rank fails
    message = refused(ValueError, "the ranks disagree",
                      lambda: hvd.add_process_set([0, 7] if ME == 0 else [0, 1]))
    assert "rank 0 asked to add an invalid process set" in message, message
    if ME == 0:
        assert "ranks [7] are not ranks of this job (0..2)" in message, message
    # on every rank alike: the reason alone
    refused(ValueError, "add_process_set([1, 1]): ranks [1, 1] name a rank twice",
            lambda: hvd.add_process_set([1, 1]))
    # duplicates, as Horovod's: of the global set, of a set added before
    refused(ValueError, "Attempted to add a duplicate process set",
            lambda: hvd.add_process_set([0, 1, 2]))
    refused(ValueError, "Attempted to add a duplicate process set",
            lambda: hvd.add_process_set([2, 0]))
    # nothing was added meanwhile: the next set gets the next id on every rank
    ps = hvd.add_process_set([0])
    assert ps.process_set_id == 6, ps
    assert hvd.remove_process_set(ps)

@check
def a_rank_outside_a_set_is_refused_naming_the_set():
    if ME != 1:
        return
    t = torch.ones(4)
    for call in [lambda: hvd.allreduce(t, process_set=EVEN),
                 lambda: hvd.allreduce_async_(t, op=hvd.Max, process_set=EVEN),
                 lambda: hvd.grouped_allreduce([t], process_set=EVEN),
                 lambda: hvd.allgather(t, process_set=EVEN),
                 lambda: hvd.broadcast(t, root_rank=0, process_set=EVEN),
                 lambda: hvd.alltoall(t, process_set=EVEN),
                 lambda: hvd.reducescatter(t, process_set=EVEN),
                 lambda: hvd.barrier(process_set=EVEN)]:
        message = refused(ValueError, "rank 1 is not a member of the provided process set", call)
        assert "ranks=[0, 2]" in message, message

@check
def init_adds_the_sets_it_is_given():
    sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1, 2])]
    hvd.init(process_sets=sets)
    assert [s.process_set_id for s in sets] == [7, 8], [str(s) for s in sets]
    mine = sets[0] if ME == 0 else sets[1]
    same(hvd.allreduce(torch.tensor([ME]), op=hvd.Sum, process_set=mine),
         torch.tensor([0 if ME == 0 else 3]))
    assert all(hvd.remove_process_set(s) for s in sets)
    refused(hvd.ProcessSetUnsupported, "DistributedOptimizer: process set [0, 2]",
            lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.ones(1)], lr=0.1),
                                              process_set=EVEN))
'''

CHECKS = ["a_set_knows_its_ranks", "every_collective_of_a_set_runs_among_its_ranks_only",
          "two_disjoint_sets_at_once", "a_removed_set_refuses_its_collectives",
          "ranks_that_disagree_all_fail_naming_each_request",
          "a_rank_outside_a_set_is_refused_naming_the_set", "init_adds_the_sets_it_is_given"]


@pytest.fixture(scope="module", params=["auto", "off"],
                ids=lambda p: "stage" if p == "auto" else "servers")
def torch_results(request, tmp_path_factory):
    """The script on 3 ranks of one host: global collectives through the intra-node stage
    (``auto``: a process set's go past it, to the servers), or all through the servers."""
    pytest.importorskip("torch")
    from test_torch_plugin import run_script
    return run_script(tmp_path_factory.mktemp(f"psets-{request.param}"), SCRIPT, np=3,
                      local_reduce=request.param)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", CHECKS)
def test_process_sets_of_the_torch_plugin(torch_results, check):
    from test_torch_plugin import assert_ok
    assert_ok(torch_results, check)


# --------------------------------------------------------------------------- a lost worker

LOST_WORKER_SCRIPT = '''
import os, signal, sys
import torch
import bpsctl.engine.torch as hvd

out_dir, steps, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hvd.init()
rank = hvd.rank()
low, high = hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])
for step in range(steps):
    if rank == 2 and step == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    mine = torch.full((5000,), float(6 * (rank + 1) + step))
    got = []
    if rank in (0, 1):
        got.append(hvd.allreduce(mine, name="low", process_set=low)[0].item())
    if rank in (1, 2):
        got.append(hvd.allreduce(mine, name="high", process_set=high)[0].item())
    got.append(hvd.allreduce(mine, name="everyone")[0].item())
    with open(os.path.join(out_dir, f"r{rank}"), "a") as f:
        f.write(" ".join(map(str, got)) + "\\n")
hvd.shutdown()
'''


@pytest.mark.timeout(180)
def test_a_lost_worker_leaves_only_its_own_sets_short(tmp_path):
    """`bpsctl run -np 3 --min-workers 2`, sets [0, 1] and [1, 2], worker 2 killed before its
    pushes of step 3: the set [0, 1] it is not in still averages over both of its ranks (its
    rounds were not shortened), the set [1, 2] goes on with rank 1 alone, and the job's
    averages go from 3 workers to 2."""
    import os
    import subprocess
    import sys
    pytest.importorskip("torch")
    steps, die_at = 6, 3
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(LOST_WORKER_SCRIPT)
    out.mkdir()
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": "1", "BPSCTL_HEARTBEAT_INTERVAL": "0.2"}
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "run", "-np", "3",
                           "--min-workers", "2", "--", sys.executable, str(script), str(out),
                           str(steps), str(die_at)],
                          env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {rank: [list(map(float, line.split()))
                   for line in (out / f"r{rank}").read_text().splitlines()] for rank in (0, 1)}
    for step in range(steps):
        low = (6 + 12) / 2 + step
        high = (12 + 18) / 2 + step if step < die_at else 12 + step
        everyone = (6 + 12 + 18) / 3 + step if step < die_at else (6 + 12) / 2 + step
        assert rows[0][step] == [low, everyone], (step, rows[0][step])
        assert rows[1][step] == [low, high, everyone], (step, rows[1][step])
