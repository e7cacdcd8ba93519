"""Horovod Elastic's data sampling: :class:`ElasticSampler` shards the epoch over the workers
of the last commit and re-shards what is left when they change; ``TorchState`` keeps samplers
(and other objects with ``state_dict``/``load_state_dict``) in place and syncs only their
state. Pure tests of the sharding math first, then Horovod-style scripts under `bpsctl run`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bpsctl.engine.common import EngineError
from bpsctl.engine.torch import elastic
from bpsctl.engine.torch.elastic import ElasticSampler, epoch_order, shard_of


class _Data:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _sampler(monkeypatch, n: int, rank: int, members: list[int], **kw) -> ElasticSampler:
    monkeypatch.setattr(elastic, "_membership", lambda: (rank, list(members)))
    return ElasticSampler(_Data(n), **kw)


# --------------------------------------------------------------------------- pure: the math

@pytest.mark.parametrize("length,members", [(12, [0, 1, 2]), (10, [0, 1, 2]), (1, [0, 3]),
                                            (7, [5]), (0, [0, 1])])
def test_shards_are_strided_equal_and_cover_what_is_left(length, members):
    remaining = [100 + i for i in range(length)]
    shards = [shard_of(remaining, members, r) for r in members]
    assert len({len(s) for s in shards}) == 1                      # in step: equal lengths
    assert set().union(*shards) == set(remaining)
    per = len(shards[0])
    assert per * len(members) - length < len(members)              # padding below one row
    if length % len(members) == 0:
        assert sorted(i for s in shards for i in s) == remaining    # no padding, no overlap
    if length >= len(members):
        assert shards[1 % len(members)][:1] == remaining[1 % len(members):][:1] or length == 0


def test_a_rank_outside_the_members_has_no_shard():
    with pytest.raises(ValueError, match="rank 4 is not among the members"):
        shard_of([1, 2, 3], [0, 1], 4)


def test_the_order_depends_on_seed_and_epoch_and_is_the_same_everywhere():
    assert epoch_order(50, True, 3, 1) == epoch_order(50, True, 3, 1)
    assert epoch_order(50, True, 3, 1) != epoch_order(50, True, 3, 2)
    assert sorted(epoch_order(50, True, 3, 1)) == list(range(50))
    assert epoch_order(5, False, 3, 9) == [0, 1, 2, 3, 4]


def test_sampler_shards_by_the_members_and_set_epoch_clears_the_record(monkeypatch):
    samplers = [_sampler(monkeypatch, 24, r, [0, 1, 2], seed=4) for r in range(3)]
    shards = [list(s) for s in samplers]
    assert sorted(i for s in shards for i in s) == list(range(24))
    assert all(len(s) == 8 and s.num_replicas == 3 and s.num_samples == 8 for s in samplers)
    assert samplers[2].total_size == 24 and samplers[2].remaining_indices == epoch_order(
        24, True, 4, 0)
    s0 = samplers[0]
    assert s0.get_indices(1, 3) == shards[0][3:6]
    s0.record_batch(1, 3)
    assert s0.processed_indices == set(shards[0][3:6])
    # the job's view: every member's batch 1, as all train in step
    assert set(s0.state_dict()["processed_indices"]) == {i for s in shards for i in s[3:6]}
    s0.set_epoch(1)
    assert s0.epoch == 1 and s0.processed_indices == set() and list(s0) != shards[0]
    assert sorted(list(s0)) == sorted(shard_of(epoch_order(24, True, 4, 1), [0, 1, 2], 0))


def test_record_indices_and_bad_input(monkeypatch):
    s = _sampler(monkeypatch, 10, 1, [0, 1], shuffle=False)
    assert list(s) == [1, 3, 5, 7, 9]
    s.record_indices([3, 7])
    assert s.processed_indices == {3, 7}
    with pytest.raises(ValueError, match=r"record_indices: \[2\] are not in this worker's "
                                         "shard of epoch 0"):
        s.record_indices([2])
    with pytest.raises(ValueError, match="record_batch: batch_idx -1 and batch_size 2"):
        s.record_batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size 0: expected"):
        s.record_batch(0, 0)


@pytest.mark.parametrize("n,members,batches", [(24, [0, 1, 2], 3), (10, [0, 1, 2], 2),
                                                (5, [1, 4, 6, 7], 2), (3, [0, 1], 1)])
def test_the_job_s_view_is_every_member_s_shard_at_the_places_recorded(monkeypatch, n, members,
                                                                       batches):
    s = _sampler(monkeypatch, n, members[0], members, seed=2)
    for batch in range(batches):
        s.record_batch(batch, 2)
    expected = {i for r in members
                for i in shard_of(epoch_order(n, True, 2, 0), members, r)[:2 * batches]}
    assert set(s.state_dict()["processed_indices"]) == expected


def test_a_sampler_before_init_says_to_call_init(monkeypatch):
    from bpsctl.engine.torch import plugin
    monkeypatch.setattr(plugin, "_plugin", None)
    with pytest.raises(EngineError, match=r"bpsctl is not initialized: call "
                                        r"bpsctl.engine.torch.init\(\) first"):
        ElasticSampler(_Data(4))


def test_a_rank_beyond_the_vote_s_slots_is_refused_at_commit(monkeypatch):
    worker = SimpleNamespace(rank=elastic.VOTE_SLOTS, membership_changes=0, live_ranks=[0],
                             pending_joins=[])
    monkeypatch.setattr(elastic, "_p", lambda: SimpleNamespace(worker=worker, elastic=None))
    state = elastic.ObjectState(epoch=0)
    with pytest.raises(EngineError, match=r"elastic state: rank 1024 has no slot in a commit's "
                                        r"vote \(ranks 0-1023\)"):
        state.commit()


def test_load_state_dict_takes_epoch_and_processed_and_shards_the_rest(monkeypatch):
    s = _sampler(monkeypatch, 20, 0, [0, 1])
    s.load_state_dict({"epoch": 3, "processed_indices": list(range(0, 20, 2))})
    assert s.epoch == 3 and s.processed_indices == set(range(0, 20, 2))
    other = _sampler(monkeypatch, 20, 1, [0, 1])
    other.load_state_dict(s.state_dict())
    assert sorted([*s, *other]) == list(range(1, 20, 2))


def _reset(samplers: dict[int, ElasticSampler], survivors: list[int],
           previous: dict[int, set[int]]) -> set[int]:
    """What ``ObjectState.on_reset`` does, its sum done by hand: every survivor adds what it
    knows (its records, and the lost workers' up to the commit before); all re-shard."""
    known: set[int] = set()
    for r in survivors:
        s = samplers[r]
        gone = [m for m in s.members if m not in survivors]
        known |= s._contribution(gone, previous[r])
    for r in survivors:
        samplers[r]._relayout(known, survivors)
    return known


def test_a_lost_worker_s_committed_batches_are_not_redone_and_its_later_ones_are(monkeypatch):
    """3 workers, 48 samples, batches of 2, commits every 2 batches: worker 2 is lost after
    recording batch 3 (the commit at batch 2 was its last). Survivors record batches 0-3 and
    reset at the commit at batch 4: the 2 x 8 of theirs and worker 2's first 4 are done; the
    other 28 are shared 14 and 14 and, processed, make every index exactly once."""
    samplers = {r: _sampler(monkeypatch, 48, r, [0, 1, 2], seed=1) for r in range(3)}
    done: list[int] = []
    for batch in range(4):
        for r in range(3):
            samplers[r].record_batch(batch, 2)
            if r < 2 or batch < 2:                      # worker 2's batches 2, 3: not committed
                done += samplers[r].get_indices(batch, 2)
    at_commit_2 = {r: set(range(4)) for r in range(2)}  # places recorded by the commit before
    known = _reset(samplers, [0, 1], at_commit_2)
    assert len(known) == 20 and sorted(known) == sorted(done)
    shards = [list(samplers[r]) for r in (0, 1)]
    assert [len(s) for s in shards] == [14, 14]
    assert sorted(done + shards[0] + shards[1]) == list(range(48))
    # a second loss before any commit of the new layout: nothing of worker 1's is known done
    samplers[0].record_batch(0, 2)
    known = _reset(samplers, [0], {0: set()})
    assert len(list(samplers[0])) == 28 - 2 and not set(samplers[0]) & known


def test_a_re_shard_that_does_not_divide_repeats_fewer_indices_than_workers(monkeypatch):
    """Horovod's padding: 3 workers re-sharding 7 left each get 3, so 2 of the 7 are
    processed twice (equal shards keep the workers in step)."""
    samplers = {r: _sampler(monkeypatch, 9, r, [0, 1], shuffle=False) for r in (0, 1)}
    samplers[0].record_batch(0, 1)
    samplers[1].record_batch(0, 1)
    samplers[2] = _sampler(monkeypatch, 9, 2, [0, 1], shuffle=False)
    known = _reset(samplers, [0, 1, 2], {0: set(), 1: set(), 2: set()})
    assert known == {0, 1}
    shards = [list(samplers[r]) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    together = sorted(i for s in shards for i in s)
    assert set(together) == set(range(2, 9)) and len(together) - 7 == 2


def test_a_worker_new_to_the_members_goes_over_a_shard_without_recording(monkeypatch):
    s = _sampler(monkeypatch, 12, 3, [0, 1, 2], shuffle=False)
    assert list(s) == [0, 3, 6, 9] and s._guest
    s.record_batch(0, 2)
    assert s._contribution([], set()) == set()


# --------------------------------------------------------------------------- TorchState rules

class _FakeWorker:
    rank, membership_changes, live_ranks = 0, 0, [0]


def test_torch_state_keeps_objects_with_state_dict_in_place(monkeypatch):
    """An LR scheduler and a sampler in a TorchState: restore and a received state load into
    the same objects; plain values are copied and replaced."""
    monkeypatch.setattr(elastic, "_p", lambda: SimpleNamespace(worker=_FakeWorker(),
                                                               elastic=None, unloaded=set()))
    monkeypatch.setattr(elastic, "_membership", lambda: (0, [0]))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sampler = ElasticSampler(_Data(8))
    state = elastic.TorchState(model, optimizer, scheduler=scheduler, train_sampler=sampler,
                               epoch=0, history=[1])
    assert state._objects == ["scheduler", "train_sampler"]
    assert state._names == ["epoch", "history"]
    packed = state._pack()
    optimizer.step()
    scheduler.step()
    sampler.set_epoch(5)
    state.epoch, state.history = 5, [1, 2]
    state.restore()
    assert state.scheduler is scheduler and state.train_sampler is sampler
    assert scheduler.last_epoch == 0 and sampler.epoch == 0
    assert state.epoch == 0 and state.history == [1]
    packed["objects"]["train_sampler"] = {"epoch": 2, "processed_indices": [0, 1]}
    state._unpack(packed)
    assert state.train_sampler is sampler and sampler.epoch == 2
    assert sampler.processed_indices == {0, 1} and sorted(sampler) == list(range(2, 8))


# --------------------------------------------------------------------------- under bpsctl run

# in the shape of Horovod's examples/elastic/pytorch scripts; only the import line differs.
# Each rank writes, per batch, the indices it trained on ("P epoch i,j,..."), after each
# commit "C epoch" (a commit that raised counts: its records are kept), and after each epoch
# the epoch its DataLoader's sampler is on and whether that sampler is the state's.
SCRIPT = '''
import os, signal, sys, time
import torch
import bpsctl.engine.torch as hvd          # was: import horovod.torch as hvd

out_dir, epochs, n, batch_size, commit_every, kill = sys.argv[1:7]
epochs, n, batch_size, commit_every = int(epochs), int(n), int(batch_size), int(commit_every)
die_rank, die_epoch, die_batch = (int(x) for x in kill.split(":")) if kill else (-1, -1, -1)
hvd.init()
rank = hvd.rank()
torch.manual_seed(rank)
dataset = torch.utils.data.TensorDataset(torch.arange(n), torch.randn(n, 8), torch.randn(n, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
train_sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=11)
train_loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=train_sampler)
val_dataset = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randn(10, 1))
val_sampler = hvd.elastic.ElasticSampler(val_dataset, shuffle=False)
val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=2, sampler=val_sampler)
log = open(os.path.join(out_dir, f"log-{rank}"), "a")
log.write("S 0\\n"); log.flush()          # a (re)start: what came before it was lost
rejoined = os.environ.get("BPSCTL_REJOIN") == "1"

def commit(state):
    try:
        state.commit()
    except hvd.elastic.HostsUpdatedInterrupt:
        log.write(f"C {state.epoch}\\n"); log.flush()
        raise
    log.write(f"C {state.epoch}\\n"); log.flush()

def train(state):
    for batch_idx, (idx, x, y) in enumerate(train_loader):
        state.batch = batch_idx
        if state.batch % commit_every == 0:
            commit(state)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        state.train_sampler.record_batch(batch_idx, batch_size)
        log.write(f"P {state.epoch} {','.join(map(str, idx.tolist()))}\\n"); log.flush()
        if (rank, state.epoch, batch_idx) == (die_rank, die_epoch, die_batch) and not rejoined:
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.size() < 3 and kill:         # slow down while one is missing
            time.sleep(0.2)
        if hvd.size() < 3:                  # waiting for one to attach
            time.sleep(float(os.environ.get("PACE", "0")))

def validate():
    with torch.no_grad():
        for x, y in val_loader:
            hvd.allreduce(torch.nn.functional.mse_loss(model(x), y), name="val_loss")

def end_epoch(state):
    state.epoch += 1
    state.batch = 0
    state.train_sampler.set_epoch(state.epoch)
    state.scheduler.step()
    with open(os.path.join(out_dir, f"epochs-{rank}"), "a") as f:
        f.write(f"{state.epoch} {train_loader.sampler.epoch} "
                f"{train_loader.sampler is state.train_sampler} "
                f"{state.scheduler is scheduler} {scheduler.last_epoch}\\n")
    commit(state)

@hvd.elastic.run
def full_train(state):
    while state.epoch < epochs:
        train(state)
        validate()
        end_epoch(state)

state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler,
                               val_sampler=val_sampler, scheduler=scheduler, epoch=0, batch=0)
full_train(state)
hvd.shutdown()
'''


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    """A private cluster that declares a silent worker lost within 1 s."""
    return {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
            "BPSCTL_HEARTBEAT_TIMEOUT": "1", "BPSCTL_HEARTBEAT_INTERVAL": "0.2", **more}


def _start(tmp_path: Path, run_args: list[str], args: list[str],
           **env: str) -> tuple[subprocess.Popen, Path]:
    """`bpsctl run RUN_ARGS -- python SCRIPT OUT ARGS` in a new process group."""
    script, out = tmp_path / "train.py", tmp_path / "out"
    if not script.exists():
        script.write_text(SCRIPT)
        out.mkdir()
    cmd = [sys.executable, "-m", "bpsctl.cli", "run", *run_args, "--",
           sys.executable, str(script), str(out), *args]
    return subprocess.Popen(cmd, env=_env(tmp_path, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True), out


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Its outcome; past ``timeout`` its whole process group is killed and the test fails."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{proc.args} ran past {timeout} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _job(tmp_path: Path, np_: int, args: list[str], extra: tuple[str, ...] = (),
         timeout: float = 150) -> tuple[subprocess.CompletedProcess, Path]:
    """`bpsctl run -np NP EXTRA -- python SCRIPT OUT ARGS`, waited for."""
    proc, out = _start(tmp_path, ["-np", str(np_), *extra], args)
    return _finish(proc, timeout), out


def _committed(log: str) -> dict[int, list[int]]:
    """Per epoch, the indices a rank trained on before one of its commits."""
    done: dict[int, list[int]] = {}
    pending: list[tuple[int, int]] = []
    for line in log.splitlines():
        kind, epoch, *rest = line.split()
        if kind == "S":
            pending = []
        elif kind == "P":
            pending += [(int(epoch), int(i)) for i in rest[0].split(",")]
        else:
            for e, i in pending:
                done.setdefault(e, []).append(i)
            pending = []
    return done


@pytest.mark.parametrize("workers", [2, 3])
def test_a_horovod_elastic_script_keeps_every_rank_s_loader_on_the_state_s_sampler(
        tmp_path, workers):
    """Horovod's elastic example shape (ElasticSampler in the DataLoader and in TorchState,
    set_epoch in end_epoch) on 2 and 3 workers: after every epoch each rank's DataLoader
    holds the state's sampler, on the next epoch, and the LR scheduler is the state's too;
    each epoch every index is trained on exactly once across the ranks."""
    epochs, n = 3, 24 * workers
    done, out = _job(tmp_path, workers, [str(epochs), str(n), "4", "2", ""])
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(workers):
        rows = (out / f"epochs-{rank}").read_text().splitlines()
        assert rows == [f"{e} {e} True True {e}" for e in range(1, epochs + 1)], (rank, rows)
    per_rank = [_committed((out / f"log-{r}").read_text()) for r in range(workers)]
    for epoch in range(epochs):
        seen = sorted(i for done_ in per_rank for i in done_[epoch])
        assert seen == list(range(n)), f"epoch {epoch}: {seen}"
    orders = {tuple(done_[1]) for done_ in per_rank} | {tuple(per_rank[0][0])}
    assert len(orders) == workers + 1          # the epochs' shards differ


def test_a_lost_worker_s_samples_are_each_processed_exactly_once(tmp_path):
    """`bpsctl run -np 3 --min-workers 2` over 48 indexed samples, batches of 2, a commit
    every 2 batches: worker 2 dies in epoch 1 right after its batch 3 (its last commit was at
    batch 2). Over that epoch every index is trained on and committed exactly once across
    the ranks: worker 2's batches 0-1 are not redone, its batches 2-3 are, by the two others,
    whose samplers then hold 14 each; epoch 2 goes on over the two."""
    done, out = _job(tmp_path, 3, ["3", "48", "2", "2", "2:1:3"], ("--min-workers", "2"))
    assert done.returncode == 0, done.stdout + done.stderr
    per_rank = [_committed((out / f"log-{r}").read_text()) for r in range(3)]
    for epoch in range(3):
        seen = sorted(i for done_ in per_rank for i in done_.get(epoch, []))
        assert seen == list(range(48)), f"epoch {epoch}: {seen}"
    assert len(per_rank[2][1]) == 4 and 2 not in per_rank[2]
    assert [len(per_rank[r][1]) for r in (0, 1)] == [8 + 14, 8 + 14]     # 4 batches, then 7
    assert "the job goes on with 2 workers" in done.stdout + done.stderr
    for rank in (0, 1):
        rows = (out / f"epochs-{rank}").read_text().splitlines()
        assert rows == [f"{e} {e} True True {e}" for e in (1, 2, 3)], (rank, rows)


def test_a_restarted_worker_rejoins_at_a_reset_and_every_index_is_still_processed_once(
        tmp_path):
    """`bpsctl run -np 3 --max-restarts 1`, worker 2 killed in epoch 1 after its batch 3 and
    restarted: the live workers reset when it asks to join, it receives the state there, and
    from the next commit the epoch's rest is shared by three; every epoch's indices are each
    trained on and committed exactly once across the ranks, and after every epoch each rank's
    DataLoader holds the state's sampler on the right epoch."""
    # 72 samples in batches of 3: whenever the workers change, what is left (72 or 42 less
    # 6 per step of two workers) divides by 2 and by 3, so no shard is padded with repeats
    epochs, n = 8, 72
    done, out = _job(tmp_path, 3, [str(epochs), str(n), "3", "2", "2:1:3"],
                     ("--max-restarts", "1"), timeout=240)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "restarted worker 2" in text and "rejoined the job" in text, text
    per_rank = [_committed((out / f"log-{r}").read_text()) for r in range(3)]
    for epoch in range(epochs):
        seen = sorted(i for done_ in per_rank for i in done_.get(epoch, []))
        assert seen == list(range(n)), f"epoch {epoch}: {seen}"
    assert per_rank[2].get(epochs - 1), "the restarted worker trained nothing in the last epoch"
    rows = {r: (out / f"epochs-{r}").read_text().splitlines() for r in range(3)}
    for rank in (0, 1):
        assert rows[rank] == [f"{e} {e} True True {e}" for e in range(1, epochs + 1)], rows
    assert rows[2][-1] == f"{epochs} {epochs} True True {epochs}", rows[2]


def test_a_worker_attached_mid_epoch_takes_a_share_of_what_is_left(tmp_path):
    """`bpsctl run -np 2 --max-workers 3`, then `bpsctl run --attach -np 1` while it trains:
    the two reset when it asks to join, it receives the state there and from the next commit
    the epoch's rest is shared by three; every epoch's indices are each trained on and
    committed exactly once across the ranks; the joiner's DataLoader holds the state's
    sampler on the job's epoch."""
    epochs, n = 30, 72          # 72 - 6 per step of two workers always divides by 3
    args = [str(epochs), str(n), "3", "2", ""]
    job, out = _start(tmp_path, ["-np", "2", "--max-workers", "3"], args, PACE="0.1")
    attached = None
    try:
        deadline = time.monotonic() + 120
        while "P 1 " not in ((out / "log-0").read_text() if (out / "log-0").exists() else ""):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job did not reach epoch 1 within 120 s"
            time.sleep(0.05)
        attached = _finish(_start(tmp_path, ["--attach", "-np", "1"], args)[0], 180)
        done = _finish(job, 180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker 2 joined" in done.stdout + done.stderr, done.stdout + done.stderr
    per_rank = [_committed((out / f"log-{r}").read_text()) for r in range(3)]
    for epoch in range(epochs):
        seen = sorted(i for done_ in per_rank for i in done_.get(epoch, []))
        assert seen == list(range(n)), f"epoch {epoch}: {seen}"
    joined = min(per_rank[2])
    assert 1 <= joined < epochs - 1 and per_rank[2].get(epochs - 1), sorted(per_rank[2])
    rows = {r: (out / f"epochs-{r}").read_text().splitlines() for r in range(3)}
    for rank in (0, 1):
        assert rows[rank] == [f"{e} {e} True True {e}" for e in range(1, epochs + 1)], rows
    assert rows[2] == [f"{e} {e} True True {e}" for e in range(joined + 1, epochs + 1)], rows
