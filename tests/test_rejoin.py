"""A restarted worker rejoins the running job (`bpsctl run --max-restarts`), and a new one joins
it (`bpsctl run --attach`): it receives a live worker's model and optimizer state at a step
boundary, and from its first step on its parameters equal the others' bit for bit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zmq
from conftest import Peer, private_cluster

import bpsctl
from bpsctl.engine import protocol as P
from bpsctl.launch.local import scheduler_view
from bpsctl.launch.state import load_job, load_state

SCRIPT = '''
import os, signal, sys, time
import torch
import bpsctl.engine.torch as bps

out_dir, steps, die_at, again = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rejoined = os.environ.get("BPSCTL_REJOIN") == "1"
if rejoined and again == "late":    # a restart slower than the steps left
    time.sleep(3)
bps.init()
rank = bps.rank()
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = bps.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4),
    named_parameters=model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(optimizer, root_rank=0)
start = bps.step_count()
for step in range(start, steps):
    if rank == 2 and (step == die_at and not rejoined or again == "die-again" and rejoined):
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.randn(16, 32)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(flat, os.path.join(out_dir, f"r{rank}-s{step}.pt"))
    with open(os.path.join(out_dir, f"size-{rank}"), "a") as f:
        f.write(f"{bps.size()} ")
    if bps.size() < 3:      # slow down while one is missing: the job lasts until it is back
        time.sleep(0.5)
with open(os.path.join(out_dir, f"start-{rank}"), "w") as f:
    f.write(str(start))
bps.shutdown()
'''


def _run(tmp_path: Path, source: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`bpsctl run -np 3 --max-restarts 1 -- python SCRIPT OUT ARGS...` on a private cluster
    that declares a silent worker lost within 1 s."""
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(source)
    out.mkdir()
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": "1", "BPSCTL_HEARTBEAT_INTERVAL": "0.2"}
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "run", "-np", "3",
                           "--max-restarts", "1", "--", sys.executable, str(script), str(out),
                           *args], env=env, capture_output=True, text=True, timeout=240)
    return done, out


def test_a_killed_worker_is_restarted_and_rejoins_bitwise_equal(tmp_path):
    """`bpsctl run -np 3 --max-restarts 1`, worker 2 killed at step 4: it is restarted,
    resumes at the step the live worker had reached, and after each of its steps all three
    workers hold the same parameters (SGD with momentum and weight decay: the optimizer state
    came with the model)."""
    steps, die_at = 60, 4
    done, out = _run(tmp_path, SCRIPT, str(steps), str(die_at), "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarted worker 2" in done.stderr and "rejoined the job" in done.stderr, \
        done.stdout + done.stderr
    start = int((out / "start-2").read_text())
    assert die_at <= start < steps, f"the restarted worker resumed at step {start}"
    for step in [*range(die_at), *range(start, steps)]:
        first, *others = (torch.load(out / f"r{rank}-s{step}.pt") for rank in range(3))
        assert all(torch.equal(first, other) for other in others), f"step {step} differs"
    for step in range(die_at, start):     # the two live ones went on meanwhile, in step
        assert torch.equal(*(torch.load(out / f"r{rank}-s{step}.pt") for rank in (0, 1)))
    sizes = (out / "size-0").read_text().split()
    assert sizes[0] == "3" and sizes[-1] == "3", sizes
    # the live ones went on without it. Each rank writes its view of the size after each
    # step, and that view follows the scheduler's message, which may come a step after the
    # sums that went on without the lost worker; the step at whose end the restarted one
    # rejoined (start - 1) counts it again: so some step in between shows 2 once there was
    # one in between
    assert set(sizes) <= {"2", "3"}, sizes
    if start - 1 > die_at + 1:
        assert "2" in sizes[die_at:start], (sizes, die_at, start)


def test_a_worker_that_fails_again_after_its_last_restart_ends_the_job(tmp_path):
    """With one restart allowed, a worker that dies again after rejoining ends the job (no
    --min-workers): exit non-zero, naming it, nothing left running."""
    done, _ = _run(tmp_path, SCRIPT, "200", "4", "die-again")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "worker 2" in done.stderr and "SIGKILL" in done.stderr, done.stderr


def test_a_worker_restarted_after_its_job_finished_exits_0_saying_so(tmp_path):
    """Worker 2 killed at the last step, and its restart slower than what is left: the other
    two finish without it, and the restarted process, finding the job over, says so and
    exits 0 (it used to start a job of its own and fail it 30 s later for want of workers);
    `bpsctl run` exits 0."""
    steps = 6
    done, out = _run(tmp_path, SCRIPT, str(steps), str(steps - 1), "late")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarted worker 2" in done.stderr, done.stderr
    assert "finished before this restarted worker could rejoin it; nothing to do" in \
        done.stdout + done.stderr, done.stdout + done.stderr
    assert not (out / "start-2").exists()       # the restarted process trained nothing
    assert (out / "start-0").exists() and (out / "start-1").exists()


# written against horovod.torch.elastic; only the import line differs
ELASTIC_SCRIPT = '''
import os, signal, sys, time
import torch
import bpsctl.engine.torch as hvd          # was: import horovod.torch as hvd

out_dir, epochs, batches, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
hvd.init()
rank = hvd.rank()
torch.manual_seed(rank)                      # different on every rank: sync() makes them equal
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
resets = []

def on_reset():
    # at which commit (each rank's view of the job's size may lag the others' by a message)
    resets.append(state.epoch * batches + state.batch)

state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
state.register_reset_callbacks([on_reset])
rejoined = os.environ.get("BPSCTL_REJOIN") == "1"

@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        for state.batch in range(state.batch, batches):
            step = state.epoch * batches + state.batch
            if rank == 2 and step == die_at and not rejoined:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            model(torch.randn(16, 32)).pow(2).mean().backward()
            optimizer.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            torch.save(flat, os.path.join(out_dir, f"r{rank}-s{step}.pt"))
            state.batch += 1
            state.commit()
            if hvd.size() < 3:      # slow down while one is missing, as SCRIPT does
                time.sleep(0.5)
        state.batch = 0

train(state)
with open(os.path.join(out_dir, f"resets-{rank}"), "w") as f:
    f.write(repr(resets))
hvd.shutdown()
'''


def test_a_horovod_elastic_script_runs_with_its_import_changed_and_rejoins(tmp_path):
    """A horovod.torch.elastic script (TorchState, commit, reset callbacks, run): ranks start
    from different weights and sync() makes them equal; worker 2 killed at step 6 is
    restarted, resumes from the committed epoch and batch, and from then on all three hold
    the same parameters; every live worker's reset callbacks ran at the same commits."""
    epochs, batches, die_at = 4, 15, 6
    done, out = _run(tmp_path, ELASTIC_SCRIPT, str(epochs), str(batches), str(die_at))
    assert done.returncode == 0, done.stdout + done.stderr
    total = epochs * batches
    joined = min(s for s in range(die_at + 1, total) if (out / f"r2-s{s}.pt").exists())
    for step in [*range(die_at), *range(joined, total)]:
        first, *others = (torch.load(out / f"r{rank}-s{step}.pt") for rank in range(3))
        assert all(torch.equal(first, other) for other in others), f"step {step} differs"
    assert not any((out / f"r2-s{s}.pt").exists() for s in range(die_at, joined))
    resets = [(out / f"resets-{rank}").read_text() for rank in (0, 1)]
    assert resets[0] == resets[1] and resets[0] != "[]", resets    # the same resets, in step


# a job that may grow (`--max-workers 3`), paced so that a worker attached a few seconds in
# finds it running; every worker counts the workers in each step (a sum of ones) and they all
# stop 10 steps after the first step that counted three
GROWING_SCRIPT = '''
import os, sys, time
import torch
import bpsctl.engine.torch as bps

out_dir = sys.argv[1]
bps.init()
rank = bps.rank()
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = bps.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4),
    named_parameters=model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(optimizer, root_rank=0)
bps.add_membership_callback(lambda live: open(os.path.join(out_dir, f"live-{rank}"), "a").write(
    f"{live}\\n"))
start, full_at = bps.step_count(), None
with open(os.path.join(out_dir, f"start-{rank}"), "w") as f:
    f.write(str(start))
for step in range(start, 2000):
    # at the top of a step: a joiner starts at the step after its donor's boundary
    count = bps.push_pull(torch.ones(1, dtype=torch.int32), average=False, name="count")
    if count.item() == 3 and full_at is None:
        full_at = step
    optimizer.zero_grad()
    model(torch.randn(16, 32)).pow(2).mean().backward()
    optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(flat, os.path.join(out_dir, f"r{rank}-s{step}.pt"))
    with open(os.path.join(out_dir, f"steps-{rank}"), "a") as f:
        f.write(f"{step}:{count.item()}:{bps.size()} ")
    if full_at is not None and step >= full_at + 10:
        break
    time.sleep(0.02)
# named like the live workers' (the joiner skipped broadcast_optimizer_state's object)
reference = bps.broadcast_object(flat, root_rank=0, name="final")
with open(os.path.join(out_dir, f"final-{rank}"), "w") as f:
    f.write(str(torch.equal(flat, reference)))
bps.shutdown()
'''


def _bpsctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "bpsctl.cli", *args]


def test_a_worker_attached_to_a_running_job_joins_it_as_rank_2_bitwise_equal(tmp_path):
    """`bpsctl run -np 2 --max-workers 3`, then `bpsctl run --attach -np 1` while it runs: the
    new worker is rank 2; from its first step on all three hold the same parameters; size()
    and the sums count three workers, the others' membership callbacks see ranks 0-2; asking
    for more than the job has room for exits 2; everything exits 0."""
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(GROWING_SCRIPT)
    out.mkdir()
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}
    train = [sys.executable, str(script), str(out)]
    job = subprocess.Popen(_bpsctl("run", "-np", "2", "--max-workers", "3", "--", *train),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "r0-s1.pt").exists():      # the job is running
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job did not start within 120 s"
            time.sleep(0.05)
        too_many = subprocess.run(_bpsctl("run", "--attach", "-np", "2", "--", *train), env=env,
                                  capture_output=True, text=True, timeout=60)
        assert too_many.returncode == 2, too_many.stdout + too_many.stderr
        assert "has room for 1 more worker" in " ".join(too_many.stderr.split()), too_many.stderr
        attached = subprocess.run(_bpsctl("run", "--attach", "-np", "1", "--", *train), env=env,
                                  capture_output=True, text=True, timeout=180)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.terminate()                 # the launcher stops its workers
            job.wait(timeout=30)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert "worker 2 joined the job" in attached.stderr, attached.stderr
    assert job.returncode == 0, stdout + stderr
    assert "membership changed: worker 2 joined" in stderr, stderr
    start = int((out / "start-2").read_text())
    steps = {rank: [entry.split(":") for entry in (out / f"steps-{rank}").read_text().split()]
             for rank in range(3)}
    last = int(steps[0][-1][0])
    assert start > 1 and [int(s) for s, _, _ in steps[2]] == list(range(start, last + 1))
    for step in range(start, last + 1):         # bitwise equal from the joiner's first step
        first, *others = (torch.load(out / f"r{rank}-s{step}.pt") for rank in range(3))
        assert all(torch.equal(first, other) for other in others), f"step {step} differs"
    for rank in (0, 1):                         # two workers until it joined, three after
        assert [int(c) for s, c, _ in steps[rank]] == [2] * start + [3] * (last + 1 - start)
        assert steps[rank][0][2] == "2" and steps[rank][-1][2] == "3", steps[rank]
        assert (out / f"live-{rank}").read_text().split("\n")[-2] == "[0, 1, 2]"
    assert all(c == "3" and size == "3" for _, c, size in steps[2]), steps[2]
    assert all((out / f"final-{rank}").read_text() == "True" for rank in range(3))


# bare-engine workers never hand over a model, so a worker attached to their job stays
# unadmitted; they sum ones until the test says stop (all of them after the same round)
SUMMING_SCRIPT = '''
import os, sys, time
import numpy as np
import bpsctl.engine as bps

out_dir = sys.argv[1]
bps.init()
if bps.rank() >= 2:                 # attached: gone before any worker admitted it
    os.kill(os.getpid(), 9)
with open(os.path.join(out_dir, f"sums-{bps.rank()}"), "w") as f:
    while True:
        # [1, saw stop]: the workers stop after the same round, so none waits on a round
        # the other has already left
        stop = os.path.exists(os.path.join(out_dir, "stop"))
        count, stops = bps.push_pull(np.array([1, stop], np.int32), name='count', average=False)
        f.write(f"{int(count)} ")
        f.flush()
        if stops:
            break
        time.sleep(0.02)
bps.shutdown()
'''


def test_an_attached_worker_lost_before_it_joined_leaves_the_job_going(tmp_path):
    """A worker attached to a fail-fast job (no --min-workers) and killed before any worker
    admitted it was never in the job's rounds: the scheduler declares it lost and the job
    goes on as it was (sums of two), and ends 0; the attaching run exits with its code."""
    script, out = tmp_path / "sum.py", tmp_path / "out"
    script.write_text(SUMMING_SCRIPT)
    out.mkdir()
    state_dir = tmp_path / "state"
    # a silent worker is lost within 3 s (a loaded machine can hold a heartbeat back a second)
    env = {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": "3", "BPSCTL_HEARTBEAT_INTERVAL": "0.3"}
    train = [sys.executable, str(script), str(out)]
    job = subprocess.Popen(_bpsctl("run", "-np", "2", "--max-workers", "3", "--", *train),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (record := load_job(state_dir)) is None:
            assert job.poll() is None and time.monotonic() < deadline, "no job within 60 s"
            time.sleep(0.05)
        cluster = load_state(record["cluster_state_dir"])
        assert cluster is not None
        while not ((view := scheduler_view(cluster))["job"] or {}).get("started"):
            assert time.monotonic() < deadline, "the job did not start within 60 s"
            time.sleep(0.05)
        attached = subprocess.run(_bpsctl("run", "--attach", "--", *train), env=env,
                                  capture_output=True, text=True, timeout=60)
        assert attached.returncode == 128 + 9, attached.stdout + attached.stderr
        while not any(w["rank"] == 2 and w["state"] == "lost" for w in view["workers"]):
            assert time.monotonic() < deadline, f"worker 2 was not declared lost: {view}"
            time.sleep(0.05)
            view = scheduler_view(cluster)
        done_at_verdict = len((out / "sums-0").read_text().split())
        while len((out / "sums-0").read_text().split()) < done_at_verdict + 20:
            assert job.poll() is None, job.communicate()    # it goes on past the verdict
            assert time.monotonic() < deadline, "the job did not go on after the verdict"
            time.sleep(0.05)
        (out / "stop").touch()
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.terminate()
            job.wait(timeout=30)
    assert job.returncode == 0, stdout + stderr
    assert "joined" not in stderr, stderr
    for rank in (0, 1):
        sums = (out / f"sums-{rank}").read_text().split()
        assert sums and set(sums) == {"2"}, sums


def _result(peer: Peer) -> tuple[int, int, np.ndarray]:
    """The next RESULT (its count, round and sum) or ERROR a peer gets; ACKs are skipped."""
    deadline = time.monotonic() + 10
    while True:
        assert peer.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))), \
            "the server answered nothing within 10 s"
        frames = peer.sock.recv_multipart()
        msg_type, _, _, count, _, round_, _ = P.unpack_header(frames[0])
        if msg_type == P.ERROR:
            raise AssertionError(P.parse_control(frames)[1]["message"])
        if msg_type == P.RESULT:
            return count, round_, np.frombuffer(frames[1], np.float32)


def test_a_joiners_push_that_comes_before_its_admit_waits_for_it():
    """Whatever the network's order: a joiner's push that reaches a server before its donor's
    ADMIT (which comes on another connection) is held until the ADMIT, not counted at once,
    where it would complete a round without the donor's push (the sums of the two ranks
    would differ, or the ADMIT would be refused). Ranks 0 and 1 of a job that rank 2 may
    join (max_workers 3) talk to a real server by hand; rank 2 pushes round 1 first."""
    job = f"admit-{os.getpid()}"
    part, round_bytes = 7, 16
    ctx = zmq.Context()
    with private_cluster(1) as cluster:
        server = next(p for p in cluster.processes if p.role == "server")
        peers = []
        for rank in range(3):
            peer = Peer(ctx, f"{server.host}:{server.port}")
            peers.append(peer)
            peer.prove(cluster.secret)
            peer.send(P.HELLO, {"job": job, "rank": rank, "world_size": 2, "hosts": 2,
                                "max_workers": 3, "version": bpsctl.__version__})
        first, donor, joiner = peers

        def push(peer: Peer, round_: int, value: float) -> None:
            peer.sock.send_multipart([P.pack_header(P.PUSH, dtype=9, part=part, round=round_,
                                                    nbytes=round_bytes),
                                      np.full(4, value, np.float32).tobytes()])

        try:
            push(first, 0, 1.0)             # round 0: ranks 0 and 1
            push(donor, 0, 2.0)
            for peer in (first, donor):
                count, round_, total = _result(peer)
                assert (count, round_, total.tolist()) == (2, 0, [3.0] * 4)
            push(joiner, 1, 4.0)            # before its ADMIT: not counted yet
            push(first, 1, 1.0)             # with it, these two would complete round 1
            donor.send(P.ADMIT, {"rank": 2, "incarnation": 0, "rounds": {str(part): 1}})
            push(donor, 1, 2.0)
            for peer in peers:              # one round of all three, the same for each
                count, round_, total = _result(peer)
                assert (count, round_, total.tolist()) == (3, 1, [7.0] * 4)
        finally:
            ctx.destroy(linger=0)           # closes every peer's socket


def test_a_joiner_hears_of_a_server_lost_before_it_was_admitted():
    """A server lost while a worker joins (registered, not yet admitted by its donor) moves
    its partitions: the joiner is told as the running workers are, or it would push them to
    the lost server and the job would wait for its pushes elsewhere. Rank 0 of a 1-worker
    job that rank 1 joins (max_workers 2) talks to a real scheduler by hand; the job's second
    server is killed while rank 1 waits for its model."""
    job, ctx = f"joining-{os.getpid()}", zmq.Context()
    with private_cluster(2, heartbeat_timeout_s=1.0) as cluster:
        scheduler = next(p for p in cluster.processes if p.role == "scheduler")
        victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)

        def register(peer: Peer, rank: int, **how) -> dict:
            peer.prove(cluster.secret)
            peer.send(P.REGISTER, {"role": "worker", "version": bpsctl.__version__,
                                   "host": "127.0.0.1", "pid": os.getpid(), "job": job,
                                   "world_size": 1, "max_workers": 2, "rank": rank,
                                   "num_servers": 2, "partition_bytes": 4096,
                                   "start_timeout_s": 10.0, **how})
            return _next(peer, P.REGISTERED, peers)

        try:
            peers: list[Peer] = []
            donor = Peer(ctx, f"{scheduler.host}:{scheduler.port}")
            servers = register(donor, 0)["servers"]
            peers.append(donor)
            joiner = Peer(ctx, f"{scheduler.host}:{scheduler.port}")
            assert register(joiner, 1, attach=True)["joining"] is True
            peers.append(joiner)
            _next(donor, P.WORKER_JOINING, peers)   # it would admit rank 1 at its next step
            os.kill(victim.pid, signal.SIGKILL)
            moved = _next(joiner, P.SERVER_MOVED, peers)
            assert servers[moved["index"]]["port"] == victim.port
            assert _next(donor, P.SERVER_MOVED, peers) == moved
        finally:
            ctx.destroy(linger=0)


def _next(peer: Peer, wanted: int, alive: list[Peer]) -> dict:
    """The body of the next message of type ``wanted`` from the scheduler (clock exchanges
    and others skipped), within 10 s; meanwhile the ``alive`` peers send their heartbeats."""
    deadline = time.monotonic() + 10
    while True:
        for other in alive:
            other.send(P.HEARTBEAT, {})
        assert time.monotonic() < deadline, f"no {P.TYPE_NAMES[wanted]} within 10 s"
        if not peer.sock.poll(200):
            continue
        msg_type, body = P.parse_control(peer.sock.recv_multipart())
        if msg_type == wanted:
            return body
        assert msg_type != P.ERROR, body
