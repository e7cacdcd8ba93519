"""Keeping going through a lost server: its partitions move to the job's other servers, the
workers push again what it had not answered, and every sum stays exact."""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from conftest import (
    Peer,
    exact_integer_step,
    gone,
    private_cluster,
    run_job,
    wait_until,
)

import bpsctl
from bpsctl.chaos.faults import partition
from bpsctl.engine import protocol as P
from bpsctl.launch import api, emulate

HEARTBEAT_TIMEOUT_S = 1.0
KiB = 1024


@pytest.fixture
def cluster():
    """A private cluster of three servers that declares a silent one lost within 1 s."""
    with private_cluster(3, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as state:
        yield state


def _server(cluster, worker, part_id: int):
    """The recorded process of the server that holds ``part_id`` for ``worker``."""
    index = worker._parts[part_id][1]
    port = worker._servers[index]["port"]
    return next(p for p in cluster.processes if p.role == "server" and p.port == port)


def test_a_killed_server_is_replaced_and_every_sum_stays_exact(cluster):
    """kill -9 one of three servers mid-run: the job goes on to its last step, every sum of
    integer-valued data exact on both workers, and the step that saw the loss is at most the
    heartbeat timeout + 2 s slower."""
    steps, kill_at = 30, 10
    victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)

    def body(worker):
        grads = [np.zeros(64 * KiB, np.float32) for _ in range(4)]     # 256 KiB each
        seconds = []
        for step in range(steps):
            if step == kill_at:
                # both ranks hold every sum of the step before: a server killed while its
                # last sum had reached one worker but not the other fails the job by design
                worker.barrier()
                if worker.rank == 0:
                    os.kill(victim.pid, signal.SIGKILL)
            started = time.monotonic()
            exact_integer_step(worker, grads, step)
            seconds.append(time.monotonic() - started)
        return seconds

    results = run_job(cluster, 2, 3, body, partition_bytes=64 * KiB,
                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert gone(victim.pid)
    for seconds in results:
        assert len(seconds) == steps
        usual = float(np.median(seconds))
        assert max(seconds) <= usual + HEARTBEAT_TIMEOUT_S + 2, seconds


def test_a_paused_server_declared_lost_is_fenced_when_it_comes_back(cluster):
    """SIGSTOP one of three servers past the heartbeat timeout: its partitions move and the job
    goes on with every sum exact; SIGCONT it and the scheduler tells it it was declared lost,
    so it exits naming the fence instead of serving stale rounds (a paused VM that resumes)."""
    steps, pause_at = 30, 10
    victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)
    log = api.log_files(cluster.state_dir, "server:1")[0]

    def body(worker):
        grads = [np.zeros(64 * KiB, np.float32) for _ in range(4)]
        for step in range(steps):
            if step == pause_at:
                worker.barrier()            # as above: no sum half-delivered when it stops
                if worker.rank == 0:
                    os.kill(victim.pid, signal.SIGSTOP)
            exact_integer_step(worker, grads, step)
            if step == pause_at + 2 and worker.rank == 0:
                os.kill(victim.pid, signal.SIGCONT)     # it was lost at least a step ago
        return step

    try:
        results = run_job(cluster, 2, 3, body, partition_bytes=64 * KiB,
                          heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        assert results == [steps - 1, steps - 1]
        wait_until(lambda: gone(victim.pid), 10, "the fenced server to exit")
        said = log.read_text()
        assert "was declared lost" in said and "it is fenced" in said, said[-2000:]
    finally:
        if not gone(victim.pid):
            os.kill(victim.pid, signal.SIGCONT)


def test_a_lost_server_that_registers_again_on_a_new_connection_is_fenced(cluster):
    """A server cut off past the heartbeat timeout is declared lost; its old connection went
    with the cut, so once the link is back it registers again on a new one (as with a
    restarted scheduler). It is told it was declared lost, fenced, not taken back: its
    partitions live elsewhere now. Spoken by hand, the server's side."""
    scheduler = next(p for p in cluster.processes if p.role == "scheduler")
    [said] = api.log_files(cluster.state_dir, "scheduler")
    ctx = zmq.Context()

    def register(peer: Peer, **again) -> tuple[int, dict]:
        peer.prove(cluster.secret)
        peer.send(P.REGISTER, {"role": "server", "host": "127.0.0.1", "port": 1,
                               "pid": os.getpid(), "version": bpsctl.__version__, **again})
        while True:
            assert peer.sock.poll(5000), "the scheduler did not answer within 5 s"
            kind, body = P.parse_control(peer.sock.recv_multipart())
            if kind != P.CLOCK:
                return kind, body

    try:
        old = Peer(ctx, f"{scheduler.host}:{scheduler.port}")
        kind, body = register(old)
        assert kind == P.REGISTERED, body
        rank = body["rank"]
        old.close()                     # cut off: no heartbeat from here on
        wait_until(lambda: f"lost server {rank} " in said.read_text(), 10,
                   "the scheduler to declare the silent server lost")
        kind, body = register(Peer(ctx, f"{scheduler.host}:{scheduler.port}"),
                              reregister=True, rank=rank)
        assert kind == P.ERROR and body.get("fenced") is True, body
        assert f"server {rank} " in body["message"] and "was declared lost" in body["message"]
        assert "registered again after it was declared lost: fenced" in said.read_text()
    finally:
        ctx.destroy(linger=0)


def test_a_push_the_lost_server_had_summed_is_not_counted_twice(cluster):
    """Ranks 0 and 1 push a partition, the server that holds it acknowledges both and is
    killed before rank 2 pushes: after the move all three push again to the new server, and
    the sum is 1 + 2 + 3, not 1 + 2 + 1 + 2 + 3."""
    acked = threading.Barrier(3, timeout=30)
    killed = threading.Event()

    def body(worker):
        grad = np.full(1024, worker.rank + 1, np.float32)
        worker.push_pull(np.zeros(4, np.float32), name="warm-up", average=False)
        if worker.rank < 2:
            handle = worker.push_pull_async(grad, name="grad", average=False, out=grad)
            # acknowledged: the server holds this worker's contribution
            wait_until(lambda: _acknowledged(worker, "grad"), 10,
                       f"rank {worker.rank}'s push to be acknowledged")
            acked.wait()
        else:
            acked.wait()
            wait_until(lambda: all(w["port"] for w in worker._servers), 1, "the address book")
            victim = _server(cluster, worker, _part_of(worker, "grad"))
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: gone(victim.pid), 5, "the server to die")
            killed.set()
            handle = worker.push_pull_async(grad, name="grad", average=False, out=grad)
        worker.synchronize(handle)
        return grad.copy()

    results = run_job(cluster, 3, 3, body, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert killed.is_set()
    for result in results:
        assert np.all(result == 6), result[:4]


def test_a_push_of_zeros_is_pushed_again_to_the_server_that_takes_over(cluster):
    """A broadcast from rank 0 in one partition: rank 0 pushes the bytes, rank 1 a PUSH_ZERO
    naming the root, both acknowledged by the partition's server, which is killed before rank
    2 pushes its own: after the move all three push again as they did (a header again from
    ranks 1 and 2, the new server learning the partition's size from whichever comes first),
    and every rank gets rank 0's values, neither lost nor counted twice."""
    acked = threading.Barrier(3, timeout=30)
    workers = {}

    def body(worker):
        workers[worker.rank] = worker
        grad = np.full(1024, worker.rank + 1, np.float32)
        worker.push_pull(np.zeros(4, np.float32), name="warm-up", average=False)
        if worker.rank < 2:
            handle = worker.push_pull_async(grad, name="grad", average=False, out=grad, root=0)
            wait_until(lambda: _acknowledged(worker, "grad"), 10,
                       f"rank {worker.rank}'s push to be acknowledged")
            acked.wait()
        else:
            acked.wait()
            wait_until(lambda: all(w["port"] for w in worker._servers), 1, "the address book")
            # (rank 0 declared it a broadcast: asked here as a sum, the ranks would disagree)
            victim = _server(cluster, workers[0], _part_of(workers[0], "grad"))
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: gone(victim.pid), 5, "the server to die")
            handle = worker.push_pull_async(grad, name="grad", average=False, out=grad, root=0)
        worker.synchronize(handle)
        return grad.copy(), sum(s["pushed_bytes"] for s in worker.stats()["servers"])

    results = run_job(cluster, 3, 3, body, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    for rank, (result, pushed) in enumerate(results):
        assert np.all(result == 1), (rank, result[:4])
        # (the warm-up's 16 bytes, then the root's 4 KiB once or twice, the headers none)
        assert pushed == 16 if rank else pushed in (16 + 4096, 16 + 2 * 4096), (rank, pushed)


def _part_of(worker, name: str) -> int:
    """The id of tensor ``name``'s one partition, declared by any rank (ask the scheduler)."""
    if name not in worker._tensors:
        worker.declare(name, (1024,), np.float32)
        wait_until(lambda: name in worker._tensors, 10, f"{name} to be declared")
    [part] = worker._tensors[name]["parts"]
    return part[0]


def _acknowledged(worker, name: str) -> bool:
    """Whether ``worker`` has sent tensor ``name``'s partition and its server acknowledged it
    (``_active`` is filled after ``_unacked`` when a push leaves; an ACK empties the latter)."""
    info = worker._tensors.get(name)
    if info is None:
        return False
    part_id = info["parts"][0][0]
    return part_id in worker._active and part_id not in worker._unacked


# --------------------------------------------------------------------------- emulated hosts

EMULATED_HEARTBEAT_TIMEOUT_S = 2.0
STEPS = 150
HOLD_AT = 20                    # the workers hold after this step; the fault strikes then


def _cli(state_dir: Path, *args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    env = {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": str(EMULATED_HEARTBEAT_TIMEOUT_S)}
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def test_a_link_cut_between_a_worker_and_a_server_heals_and_nothing_moves(tmp_path):
    """Emulated 2 workers x 3 server hosts at 1 Gbit: mid-run, only the link between one
    worker's host and a server's (not the one beside the scheduler) is cut, until that
    worker's connection drops; healed then, the connection comes back, the worker pushes
    again what was not answered and nothing moves (the server never stopped answering the
    scheduler). `bpsctl run` exits 0 after every step, every sum exact, its output says what
    happened, and no step waited more than the heartbeat timeout + 2 s longer than usual. (A
    server killed or cut off from every host: test_fault_recovery.py.)

    The cut comes between steps (the workers hold after step 20), so the next step's
    pushes meet it. A fault between one sum's deliveries to two workers (one has it, the
    other not) is the documented case that cannot go on; striking at a random instant would
    hit it now and then."""
    state_dir, reports = tmp_path / "state", tmp_path / "reports"
    reports.mkdir()
    up = _cli(state_dir, "up", "--emulate", "--workers", "2", "--servers", "3", "--nic", "1gbit")
    assert up.returncode == 0, up.stderr
    state = api.load_state(state_dir)
    try:
        # not the server beside the scheduler (servers take their ranks in the order they
        # register): cutting that host's link would cut the scheduler off too
        scheduler_host = next(p.host for p in state.processes if p.role == "scheduler")
        victim = min((p for p in state.processes if p.role == "server"
                      and p.host != scheduler_host), key=lambda p: p.rank)
        worker_script = Path(__file__).with_name("fault_worker.py")
        env = {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "200",
               "BPSCTL_HEARTBEAT_TIMEOUT": str(EMULATED_HEARTBEAT_TIMEOUT_S)}
        output = tmp_path / "run.out"
        with open(output, "w") as out:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "bpsctl.cli", "run", "-np", "2", "--", sys.executable,
                 str(worker_script), str(reports), str(STEPS), str(HOLD_AT)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            seen: dict[int, float] = {}         # step -> when rank 0 first reported it

            def progress() -> int:
                step = _step(reports)
                if step >= 0:
                    seen.setdefault(step, time.monotonic())
                return step

            wait_until(lambda: all((reports / f"held-{r}").exists() for r in (0, 1)), 60,
                       f"both workers holding after step {HOLD_AT}, before the fault")
            name = next(h["name"] for h in state.emulation["servers"]
                        if h["address"] == victim.host)
            plan = emulate.plan_network(2, 3, "1gbit", cluster_id=state.emulation["cluster_id"])
            heal = partition(plan, plan.host(state.emulation["workers"][1]["name"]), [name])
            (reports / "go").write_text("go")
            seen[progress()] = time.monotonic()     # the hold is not a slow step
            dropped = f"lost the connection to server {victim.rank} at"
            wait_until(lambda: dropped in output.read_text(), 30,
                       "a worker's connection to the server cut off from it to drop")
            heal()
            deadline = time.monotonic() + 90
            while launcher.poll() is None and time.monotonic() < deadline:
                progress()
                time.sleep(0.005)
            code = launcher.wait(5)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        text = output.read_text()
        assert code == 0, text
        assert text.count(f"{STEPS} steps, sums exact") == 2, text
        assert f"the connection to server {victim.rank} at" in text and "came back" in text, \
            text
        assert "partitions moved" not in text, text
        times = [seen[s] for s in sorted(seen)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        usual = statistics.median(gaps)
        assert max(gaps) <= usual + EMULATED_HEARTBEAT_TIMEOUT_S + 2, (max(gaps), usual)
    finally:
        down = _cli(state_dir, "down")
        assert down.returncode == 0, down.stderr


def _step(reports: Path) -> int:
    try:
        return int((reports / "step-0").read_text())
    except (FileNotFoundError, ValueError):
        return -1


# --------------------------------------------------------------------------- lost workers

LOST_WORKER_SCRIPT = '''
import os, signal, sys, time
import numpy as np
import bpsctl.engine as bps

def pushed_and_acknowledged(worker, names, timeout_s=20):
    """Until every partition of the push_pulls ``names`` has left and been acknowledged (the
    engine's own records, read from here; a change under our feet is simply read again).
    Each name must be among the tasks first: the I/O thread takes them up one by one, and
    the pushes of those it has taken up may all be acknowledged before it takes up the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            tasks = list(worker._tasks)
            if {t.name for t in tasks} >= set(names) and \
                    all(t.parts and all(p[0] in worker._active for p in t.parts)
                        for t in tasks) and not worker._unacked:
                return
        except RuntimeError:
            pass
        time.sleep(0.001)
    sys.exit("rank 2's pushes were never acknowledged")

out_dir, steps, die_at, when = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gather = sys.argv[5:] == ["gather"]     # a third of each tensor each, the rest zeros (mine=)
bps.init()
rank = bps.rank()
grads = [np.zeros(n, np.float32) for n in (10, 70_000, 300_000)]   # 1, 2 and 5 partitions
for step in range(steps):
    if rank == 2 and step == die_at and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank < 2 and step == die_at and when == "after":
        time.sleep(1.0)                          # rank 2 pushes first, and dies
    for i, g in enumerate(grads):
        g[:] = 6 * (rank + 1) + step + i         # integers: every mean below is exact
    if gather:
        thirds = [(len(g) * rank // 3, len(g) * (rank + 1) // 3) for g in grads]
        for g, (a, b) in zip(grads, thirds):
            g[:a] = 0
            g[b:] = 0
        handles = [bps._w().push_pull_async(g, name=f"g{i}", average=False, out=g,
                                            mine=(4 * a, 4 * b))
                   for i, (g, (a, b)) in enumerate(zip(grads, thirds))]
    else:
        handles = [bps.push_pull_async(g, name=f"g{i}", average=True, out=g)
                   for i, g in enumerate(grads)]
    if rank == 2 and step == die_at and when == "after":
        pushed_and_acknowledged(bps._w(), [f"g{i}" for i in range(len(grads))])
        os.kill(os.getpid(), signal.SIGKILL)
    for h in handles:
        bps.synchronize(h)
    np.save(os.path.join(out_dir, f"r{rank}-s{step}.npy"), np.concatenate(grads))
    with open(os.path.join(out_dir, f"size-{rank}"), "a") as f:
        f.write(f"{bps.size()}\\n")
bps.shutdown()
print(f"rank {rank}: {steps} steps", flush=True)
'''


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_killed_worker_leaves_the_job_going_with_averages_over_the_rest(tmp_path, when):
    """`bpsctl run -np 3 --min-workers 2`, worker 2 killed with SIGKILL at step 5, before it
    pushes or after its pushes reached the servers: the run exits 0; workers 0 and 1 finish
    every step bitwise equal to each other; each average is over 3 workers before, over 2
    after (in the round the loss hit: over 2 if it had not pushed, over 3 if it had); size()
    says 2 once the loss is known; the output says who was lost."""
    steps, die_at = 16, 5
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(LOST_WORKER_SCRIPT)
    out.mkdir()
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": "1", "BPSCTL_HEARTBEAT_INTERVAL": "0.2",
           "BPSCTL_PARTITION_BYTES": "262144"}
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "run", "-np", "3",
                           "--min-workers", "2", "--", sys.executable, str(script), str(out),
                           str(steps), str(die_at), when],
                          env=env, capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "worker 2" in text and "the job goes on with 2 workers" in text, text
    assert "membership changed: the job went on without worker 2" in text, text
    offsets = np.concatenate([np.full(n, i, np.float32) for i, n in
                              enumerate((10, 70_000, 300_000))])
    for step in range(steps):
        got = [np.load(out / f"r{rank}-s{step}.npy") for rank in (0, 1)]
        assert np.array_equal(got[0], got[1]), f"step {step}: survivors differ"
        of_three = (6 + 12 + 18) / 3 + step + offsets
        of_two = (6 + 12) / 2 + step + offsets
        if step < die_at:
            assert np.array_equal(got[0], of_three), step
        elif step > die_at:
            assert np.array_equal(got[0], of_two), step
        else:       # its pushes are in this round's sums, or it is not
            assert np.array_equal(got[0], of_three if when == "after" else of_two), step
    for rank in (0, 1):
        sizes = (out / f"size-{rank}").read_text().split()
        assert sizes[0] == "3" and sizes[-1] == "2", sizes


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_killed_worker_leaves_a_gathers_rounds_of_zeros_going(tmp_path, when):
    """As above, each rank's third of each tensor pushed with ``mine`` (PUSH_ZERO for the
    partitions without it: the last partition of the largest is rank 2's alone, the first
    rank 0's): a round in which the lost worker had pushed nothing completes without it,
    rounds of headers alone included, and its third comes back as zeros from then on."""
    steps, die_at = 8, 3
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(LOST_WORKER_SCRIPT)
    out.mkdir()
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": "1", "BPSCTL_HEARTBEAT_INTERVAL": "0.2",
           "BPSCTL_PARTITION_BYTES": "262144"}
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "run", "-np", "3",
                           "--min-workers", "2", "--", sys.executable, str(script), str(out),
                           str(steps), str(die_at), when, "gather"],
                          env=env, capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    sizes = (10, 70_000, 300_000)
    for step in range(steps):
        got = [np.load(out / f"r{rank}-s{step}.npy") for rank in (0, 1)]
        assert np.array_equal(got[0], got[1]), f"step {step}: survivors differ"
        with_rank_2 = step < die_at or (step == die_at and when == "after")
        want = np.concatenate([np.concatenate([
            np.full(n * (r + 1) // 3 - n * r // 3,
                    6 * (r + 1) + step + i if r < 2 or with_rank_2 else 0, np.float32)
            for r in range(3)]) for i, n in enumerate(sizes)])
        assert np.array_equal(got[0], want), step


TORCH_SCRIPT = '''
import os, signal, sys
import torch
import bpsctl.engine.torch as bps

out_dir, steps, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bps.init()
rank = bps.rank()
told = []
bps.add_membership_callback(lambda live: told.append(live))
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(steps):
    if rank == 2 and step == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.randn(16, 32)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(flat, os.path.join(out_dir, f"r{rank}-s{step}.pt"))
with open(os.path.join(out_dir, f"told-{rank}"), "w") as f:
    f.write(repr(told))
bps.shutdown()
'''


def test_torch_training_goes_on_without_a_lost_worker_and_says_so(tmp_path):
    """DistributedOptimizer under `bpsctl run -np 3 --min-workers 2`, worker 2 killed at step
    4: workers 0 and 1 train all 12 steps with parameters bitwise equal after every step, and
    the membership callback is called once with the live ranks."""
    steps, die_at = 12, 4
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(TORCH_SCRIPT)
    out.mkdir()
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "BPSCTL_HEARTBEAT_TIMEOUT": "1", "BPSCTL_HEARTBEAT_INTERVAL": "0.2"}
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "run", "-np", "3",
                           "--min-workers", "2", "--", sys.executable, str(script), str(out),
                           str(steps), str(die_at)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    for step in range(steps):
        first, second = (torch.load(out / f"r{rank}-s{step}.pt") for rank in (0, 1))
        assert torch.equal(first, second), f"step {step}: survivors differ"
    for rank in (0, 1):
        assert (out / f"told-{rank}").read_text() == "[[0, 1]]"
