"""Shared memory between a worker and a server on one host (BPSCTL_SHM_SERVER; engine/shmlink.py):
exact sums of every dtype through it with 1-4 workers and 1-2 servers, the same sums over TCP
with the knob at 0, proof that the path is taken (every push and result counted as going
through shared memory), a bound too low for the job (TCP for what does not fit) and a
/dev/shm too small (an error naming both knobs), the segments' names and modes, what is left
when the job ends, and a worker killed mid-step (named within 10 s; nothing left after down).

Workers are threads of this process against real server processes (``run_job``), or real
processes when one must die.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, gone, kill_pids, run_job, run_worker_scripts, wait_until

from bpsctl.config import Config, ConfigError
from bpsctl.engine import EngineError, Worker, shm, shmlink
from bpsctl.engine import protocol as P
from bpsctl.launch import api

REPO_ROOT = Path(__file__).resolve().parent.parent
#: empty, one element, less than a partition, a 2-D one and one of several partitions (the
#: tests' partitions are 64 KiB)
SHAPES = [(0,), (), (1,), (1001,), (37, 129), (70000,)]
PARTITION_BYTES = 65536


def values(rank: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Small integers (exact in every dtype, summed over 4 workers), different per rank."""
    count = int(np.prod(shape))
    ints = (np.arange(count) % 7 + rank).reshape(shape)
    if dtype == P.BFLOAT16:     # the top half of float32: exact for small integers
        bits = (ints.reshape(-1).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(P.BFLOAT16).reshape(shape)
    return ints.astype(dtype)


def expected(workers: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return values(0, shape, np.dtype(np.int64)) * workers + sum(range(workers))


def as_ints(array: np.ndarray) -> np.ndarray:
    if array.dtype == P.BFLOAT16:
        wide = array.reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return wide.view(np.float32).astype(np.int64).reshape(array.shape)
    return array.astype(np.int64)


def sums_of_every_dtype(worker: Worker) -> dict[str, int]:
    """Push_pull every dtype in every shape twice (the second round reuses the slots and the
    other sum buffer) and check the sums; averages of the floating types too. Returns how
    many partitions this worker pushed, and its stats."""
    parts = 0
    for dtype in P.DTYPES:
        for shape in SHAPES:
            name = f"{dtype.str}.{shape}"
            for round_ in range(2):
                got = worker.push_pull(values(worker.rank + round_, shape, dtype), name=name,
                                       average=False)
                want = expected(worker.size, shape, dtype) + round_ * worker.size
                assert got.dtype == dtype and got.shape == shape, (name, got.dtype, got.shape)
                assert (as_ints(got) == want).all(), (name, round_, got.ravel()[:5])
                parts += max(1, -(-int(np.prod(shape)) * dtype.itemsize // PARTITION_BYTES))
    for dtype in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        got = worker.push_pull(values(worker.rank, (1001,), dtype) * worker.size,
                               name=f"avg{dtype}")
        assert (got == expected(worker.size, (1001,), dtype)).all(), got[:5]
        parts += 1
    return {"parts": parts, **worker.stats()}


@pytest.fixture(scope="module")
def cluster(engine_cluster):
    """The module's scheduler and servers (conftest's engine_cluster: its jobs use one or two
    of them)."""
    return engine_cluster


def job_names(cluster: api.ClusterState) -> list[str]:
    """The cluster's segments named in /dev/shm now."""
    return [p.name for p in shm.leftovers(shm.cluster_tag(cluster.scheduler, cluster.secret))]


@pytest.mark.parametrize("workers,servers", [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)])
def test_sums_of_every_dtype_are_exact_through_shared_memory(cluster, workers, servers):
    results = run_job(cluster, workers, servers, sums_of_every_dtype,
                      partition_bytes=PARTITION_BYTES, force_distributed=True)
    for rank, result in enumerate(results):
        # every push and every result went through shared memory: none over TCP (one worker
        # alone is sent through the servers too, BPSCTL_FORCE_DISTRIBUTED)
        assert result["shm_pushes"] == result["parts"] > 0, (rank, result)
        assert result["shm_results"] == result["parts"], (rank, result)
        # every byte: what it pushed to its servers
        assert result["shm_pushed_bytes"] == sum(s["pushed_bytes"] for s in result["servers"])
    wait_until(lambda: job_names(cluster) == [], 10, "the job's segments to be removed")


def test_the_knob_at_0_sends_everything_over_tcp_with_the_same_sums(cluster):
    results = run_job(cluster, 2, 2, sums_of_every_dtype, partition_bytes=PARTITION_BYTES,
                      shm_server="0")
    for result in results:
        assert result["shm_pushes"] == result["shm_results"] == 0, result
    assert job_names(cluster) == []


def test_segments_are_0600_and_named_for_the_cluster_job_and_server(cluster):
    def body(worker: Worker) -> list[tuple[str, int]]:
        worker.push_pull(np.ones(5000, np.float32), name="x")
        worker.barrier()    # both have pushed: the server's sum buffers exist, and are named
        named = [(p.name, p.stat().st_mode & 0o777)
                 for p in shm.leftovers(shm.cluster_tag(cluster.scheduler, cluster.secret))]
        worker.barrier()
        return named
    named = run_job(cluster, 2, 1, body)[0]
    tag = shm.cluster_tag(cluster.scheduler, cluster.secret)
    assert named, "no segment of the server's sums"
    for name, mode in named:
        # the workers' push slots are unnamed once the server mapped them
        assert re.fullmatch(rf"bpsctl-{tag}-test_[0-9a-f]{{12}}-s0-\d+", name), name
        assert mode == 0o600, (name, oct(mode))
    wait_until(lambda: job_names(cluster) == [], 10, "the job's segments to be removed")


def test_partitions_beyond_the_bound_go_over_tcp_exactly_and_leave_nothing(cluster):
    def body(worker: Worker) -> dict[str, int]:
        # 8 partitions of 40 KiB: one fits in this worker's 64 KiB, the others do not
        for step in range(2):
            handles = [worker.push_pull_async(np.full(10240, worker.rank + i + step, np.float32),
                                              name=f"b{i}", average=False) for i in range(8)]
            for i, handle in enumerate(handles):
                want = sum(r + i + step for r in range(worker.size))
                assert (worker.synchronize(handle) == want).all(), (i, step)
        return worker.stats()
    for stats in run_job(cluster, 2, 1, body, shm_server_bytes="64KiB",
                         partition_bytes=PARTITION_BYTES):
        assert 0 < stats["shm_pushes"] < 16, stats
        assert stats["shm_pushed_bytes"] == stats["shm_pushes"] * 40960, stats
    wait_until(lambda: job_names(cluster) == [], 10, "the job's segments to be removed")


def test_segments_grow_within_their_budget_and_leave_no_name(tmp_path):
    budget = shmlink.Budget(3 << 20, tmp_path)
    segments = shmlink.Segments("bpsctl-1-abc-job-w0.0-s0", budget, tmp_path)
    first = segments.allocate(100)
    assert first is not None and first[:2] == (0, 0) and len(first[2]) == 100
    second = segments.allocate(1 << 20)              # past the first 1 MiB chunk: a second
    assert second is not None and second[:2] == (1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpsctl-1-abc-job-w0.0-s0-0",
                                                          "bpsctl-1-abc-job-w0.0-s0-1"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tmp_path.iterdir())
    assert segments.allocate(2 << 20) is None       # past BPSCTL_SHM_SERVER_BYTES: TCP
    second[2][:] = 7
    peer = shmlink.Mapped("bpsctl-1-abc-job-w0.0-s0", writable=False, unlink=True,
                          directory=tmp_path)
    assert (peer.view(1, 0, 1 << 20) == 7).all()
    assert not (tmp_path / "bpsctl-1-abc-job-w0.0-s0-1").exists()    # unnamed once mapped
    with pytest.raises(ValueError, match="past the end"):
        peer.view(1, 1 << 20, 2 << 20)      # the second chunk is 2 MiB
    segments.close()
    assert list(tmp_path.iterdir()) == [] and budget.reserved == 0


def test_a_callers_copies_go_by_runs_of_consecutive_slots_within_a_segment(tmp_path):
    """merge_runs joins partitions that follow one another in the tensor and in one
    segment's memory with the same tag (one GPU copy each run); never across segments, gaps,
    or different divisors; the joined views are the slots' own memory, read-only if they
    were."""
    segments = shmlink.Segments("bpsctl-1-abc-job-w0.0-s0", shmlink.Budget(None, tmp_path),
                                tmp_path)
    quarter = 1 << 18
    slots = [segments.allocate(quarter) for _ in range(6)]     # 4 in chunk 0, 2 in chunk 1
    assert [slot[:2] for slot in slots if slot] == [
        (0, 0), (0, quarter), (0, 2 * quarter), (0, 3 * quarter), (1, 0), (1, quarter)]
    views = [slot[2] for slot in slots if slot]
    entries = [(i * quarter, view, None) for i, view in enumerate(views)]
    runs = shmlink.merge_runs(entries[::-1])                   # any order in, offset order out
    assert [(offset, len(view)) for offset, view, _ in runs] == [(0, 4 * quarter),
                                                                 (4 * quarter, 2 * quarter)]
    runs[0][1][:] = 3                                          # the slots' own memory
    assert all((view == 3).all() for view in views[:4]) and not views[4].any()
    # a gap in the tensor, or another divisor: apart
    assert len(shmlink.merge_runs([(0, views[0], None), (2 * quarter, views[1], None)])) == 2
    assert len(shmlink.merge_runs([(0, views[0], 2), (quarter, views[1], None)])) == 2
    # read-only sums (a worker's view of a server's buffers) stay read-only when joined
    peer = shmlink.Mapped("bpsctl-1-abc-job-w0.0-s0", writable=False, unlink=True,
                          directory=tmp_path)
    [(_, joined, divisor)] = shmlink.merge_runs([(0, peer.view(0, 0, quarter), 4),
                                                 (quarter, peer.view(0, quarter, quarter), 4)])
    assert (len(joined), divisor, joined.flags.writeable) == (2 * quarter, 4, False)
    assert (joined == 3).all()
    peer.close()
    segments.close()


def test_a_broadcast_takes_no_slot_so_the_gradient_still_gets_one(cluster):
    """Pushed once (``once=True``, as the plugins' broadcasts are), a name reaches the server
    over TCP: a bound with room for one partition keeps it for the gradient pushed every
    step (a slot, once placed, is kept for the job)."""
    def body(worker: Worker) -> dict[str, int]:
        params = np.full(10240, float(worker.rank == 0) * 3, np.float32)    # 40 KiB
        worker.synchronize(worker.push_pull_async(params, name="Parameter.w", average=False,
                                                  out=params, once=True))
        assert (params == 3).all()
        for step in range(3):
            grad = np.full(10240, worker.rank + step, np.float32)
            want = sum(r + step for r in range(worker.size))
            assert (worker.push_pull(grad, name="g", average=False) == want).all(), step
        return worker.stats()
    for stats in run_job(cluster, 2, 1, body, shm_server_bytes="64KiB",
                         partition_bytes=PARTITION_BYTES):
        assert stats["shm_pushes"] == 3, stats
    wait_until(lambda: job_names(cluster) == [], 10, "the job's segments to be removed")


def test_a_gather_pushes_its_rows_through_shared_memory_and_headers_for_the_rest(cluster):
    """A 3-rank gather of 40 KiB per rank in 16 KiB partitions, ``mine`` naming each rank's
    rows: ranks 0 and 2 push the partitions holding their rows through their slots in shared
    memory, rank 1 (``shm_server=0``, as a worker of another host) over TCP, and every other
    partition goes as a PUSH_ZERO header. A partition of rank 0's rows alone is its slot plus
    zeros: the others read a copy of it, not the slot, which rank 0 rewrites at its next step
    while that answer may still be on its way; four steps, each checked exactly."""
    count, part = 10240, 16384          # float32: 40 KiB per rank

    def body(worker: Worker) -> dict[str, int]:
        me = worker.rank
        for step in range(4):
            buffer = np.zeros(3 * count, np.float32)
            buffer[me * count:(me + 1) * count] = np.arange(count) % 7 + me + 10 * step
            got = worker.push_pull(buffer, name="rows", average=False, out=buffer,
                                   mine=(me * count * 4, (me + 1) * count * 4))
            want = np.concatenate([np.arange(count) % 7 + r + 10 * step for r in range(3)])
            assert (got == want).all(), (me, step)
        return worker.stats()

    results = run_job(cluster, 3, 2, body, partition_bytes=part,
                      rank_knobs={1: {"shm_server": "0"}})
    for rank, stats in enumerate(results):
        a, b = rank * count * 4, (rank + 1) * count * 4
        touched = min(-(-b // part) * part, 3 * count * 4) - a // part * part
        assert sum(s["pushed_bytes"] for s in stats["servers"]) == 4 * touched, (rank, stats)
        if rank == 1:
            assert stats["shm_pushes"] == 0, stats
        else:       # (its data partitions through shared memory, the rest none)
            assert stats["shm_pushed_bytes"] == 4 * touched, (rank, stats)
    wait_until(lambda: job_names(cluster) == [], 10, "the job's segments to be removed")


@pytest.fixture
def small_tmpfs(tmp_path, request):
    """A tmpfs of ``request.param`` (1 MiB unless parametrized), as a /dev/shm too small for
    the job (root: a real mount)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    size = getattr(request, "param", "1m")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_dev_shm_too_small_is_an_error_naming_the_bound_and_the_knob(small_tmpfs):
    segments = shmlink.Segments("bpsctl-1-abc-job-s0", shmlink.Budget(64 << 20, small_tmpfs),
                                small_tmpfs)
    with pytest.raises(EngineError) as error:
        segments.allocate(4 << 20)
    message = str(error.value)
    assert "BPSCTL_SHM_SERVER_BYTES=67108864" in message and "BPSCTL_SHM_SERVER=0" in message, \
        message
    assert f"{small_tmpfs} more room" in message, message
    assert list(small_tmpfs.iterdir()) == []
    assert segments.budget.reserved == 0


@pytest.mark.parametrize("small_tmpfs", ["8m"], indirect=True)
def test_by_default_a_process_takes_what_the_model_needs_while_a_quarter_stays_free(
        small_tmpfs):
    """BPSCTL_SHM_SERVER_BYTES=auto on an 8 MiB /dev/shm: a 4 MiB partition fits (a fixed
    bound of less would have sent it over TCP); one that would leave less than 2 MiB free
    takes TCP, without an error; what still fits goes on fitting."""
    budget = shmlink.Budget(Config.from_env({}).shm_server_limit, small_tmpfs)
    segments = shmlink.Segments("bpsctl-1-abc-job-s0", budget, small_tmpfs)
    assert segments.allocate(4 << 20) is not None
    assert segments.allocate(3 << 20) is None           # 1 MiB would be left: TCP
    small = segments.allocate(1 << 20)                  # 2 MiB would be left: fits
    assert small is not None
    small[2][:] = 3                                     # reserved: no SIGBUS
    assert shm.free_bytes(small_tmpfs) >= 2 << 20
    assert "BPSCTL_SHM_SERVER_BYTES=auto" in budget.describe()
    segments.close()
    assert list(small_tmpfs.iterdir()) == [] and budget.reserved == 0


@pytest.mark.parametrize("text", ["lots", "1KiB", "-1"])
def test_a_bound_that_is_not_auto_or_a_size_is_refused_naming_the_knob(text):
    with pytest.raises(ConfigError, match=r"BPSCTL_SHM_SERVER_BYTES: expected auto or a size of "
                                          r"at least 65536 bytes \(64KiB\), such as 2GiB, got"):
        Config.from_env({"BPSCTL_SHM_SERVER_BYTES": text})
    assert Config.from_env({"BPSCTL_SHM_SERVER_BYTES": "2GiB"}).shm_server_limit == 2 << 30


def test_a_process_in_another_network_namespace_is_on_another_host():
    here = shm.host_id()
    assert re.fullmatch(r"[0-9a-f]{16}", here)
    # a process in another network namespace (an emulated host) is another host
    other = subprocess.run(
        ["unshare", "--net", sys.executable, "-c",
         "from bpsctl.engine import shm; print(shm.host_id())"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
        check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", other) and other != here


KILL_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import numpy as np
    from bpsctl.engine import EngineError, Worker
    out = sys.argv[1]
    worker = Worker()
    x = np.ones(300000, np.float32)
    try:
        for step in range(1000):
            handles = [worker.push_pull_async(x, average=False, name=f"t{i}") for i in range(4)]
            if worker.rank == 0 and step == 3:
                with open(os.path.join(out, "killed"), "w") as f:
                    f.write(f"{os.getpid()} {time.monotonic()} {worker.stats()['shm_pushes']}")
                os.kill(os.getpid(), signal.SIGKILL)        # mid-step, pushes in flight
            for h in handles:
                assert (worker.synchronize(h) == worker.size).all()
        print("finished without noticing", flush=True)
    except EngineError as exc:
        print(f"ERROR at {time.monotonic()}: {exc}", flush=True)
        sys.exit(1)
''')


@pytest.mark.timeout(120)
def test_a_killed_worker_is_named_within_10_s_and_down_leaves_no_segment(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    config = cluster_config(state_dir=tmp_path / "state", heartbeat_timeout_s=5.0,
                            op_timeout_s=60.0)
    with api.local_cluster(config, servers=2) as cluster:
        tag = shm.cluster_tag(cluster.scheduler, cluster.secret)
        processes, outputs = run_worker_scripts(cluster, config, 2, script, str(out))
        assert (out / "killed").exists(), "\n".join(o[-1500:] for o in outputs)
        killed_pid, killed_at, shm_pushes = (out / "killed").read_text().split()
        assert int(shm_pushes) > 0, "the killed worker never pushed through shared memory"
        assert processes[0].returncode == -9
        output = outputs[1]
        assert processes[1].returncode == 1, output[-2000:]
        match = re.search(r"ERROR at ([\d.]+): (.*)", output)
        assert match, output[-2000:]
        assert float(match.group(1)) - float(killed_at) < 10, output[-2000:]
        assert "worker 0" in match.group(2), match.group(2)
    assert all(gone(p.pid) for p in processes)
    assert shm.leftovers(tag) == [], "left after down"


def test_a_killed_server_leaves_its_sum_buffers_until_down(tmp_path):
    config = cluster_config(state_dir=tmp_path / "state")
    with api.local_cluster(config, servers=1) as cluster:
        server_pid = next(p.pid for p in cluster.processes if p.role == "server")
        seen: list[list[str]] = []

        def body(worker: Worker) -> None:
            worker.push_pull(np.ones(5000, np.float32), name="x")
            worker.barrier()
            if worker.rank == 0:
                seen.append(job_names(cluster))
                kill_pids([server_pid])             # mid-job: nobody removes its segments
            wait_until(lambda: gone(server_pid), 10, "the server to die")
            worker.push_pull(np.ones(5000, np.float32), name="x")

        with pytest.raises(AssertionError, match="server 0"):
            run_job(cluster, 2, 1, body, timeout_s=30)
        assert seen[0] and job_names(cluster) == seen[0], (seen, job_names(cluster))
    assert job_names(cluster) == [], "left after down"


def test_a_bad_knob_value_is_refused_naming_it():
    with pytest.raises(ConfigError, match="BPSCTL_SHM_SERVER: expected auto or 0, got 'on'"):
        Config.from_env({"BPSCTL_SHM_SERVER": "on"})
    assert Config.from_env({"BPSCTL_SHM_SERVER": "0"}).shm_server == "0"


def test_local_and_tcp_peers_of_one_server_get_the_same_exact_sums(cluster):
    """Rank 1 sends over TCP (as a worker of another host would), ranks 0 and 2 through
    shared memory, to the same servers: the sums are the same everywhere, and rank 1's
    results, read from the servers' shared buffers, come over TCP."""
    results = run_job(cluster, 3, 2, sums_of_every_dtype, partition_bytes=PARTITION_BYTES,
                      rank_knobs={1: {"shm_server": "0"}})
    assert results[1]["shm_pushes"] == results[1]["shm_results"] == 0, results[1]
    for rank in (0, 2):
        assert results[rank]["shm_pushes"] == results[rank]["parts"], results[rank]
        # a partition whose sum buffers were made on rank 1's pushes answers over TCP
        assert 0 < results[rank]["shm_results"] <= results[rank]["parts"], results[rank]
    wait_until(lambda: job_names(cluster) == [], 10, "the job's segments to be removed")


def test_a_late_worker_under_backup_workers_reads_the_sum_not_a_rewritten_slot(cluster):
    """2 workers, 1 backup: each round is rank 0's push alone. Rank 1 pushes each round only
    after rank 0 has its result and has pushed the next round into the same slot; rank 1's
    answer (the held result) must still be rank 0's value of that round, not of the next."""
    steps = 6
    answered = [threading.Event() for _ in range(steps)]

    def body(worker: Worker) -> list[float]:
        seen = []
        grad = np.zeros(20000, np.float32)
        for step in range(steps):
            if worker.rank == 1:
                assert answered[step].wait(30), f"rank 0's result of step {step}"
            grad[:] = 10 * step + worker.rank + 1
            handle = worker.push_pull_async(grad, name="g", out=grad)
            if worker.rank == 0 and step:
                answered[step - 1].set()        # its push of this round is out: slot rewritten
            worker.synchronize(handle, 30)
            assert (grad == grad[0]).all()
            seen.append(float(grad[0]))
        if worker.rank == 0:
            answered[-1].set()
        return [*seen, worker.stats()["shm_pushes"], worker.stats()["late_pushes"]]

    results = run_job(cluster, 2, 1, body, backup_workers=1)
    want = [10.0 * step + 1 for step in range(steps)]
    assert results[0][:steps] == want and results[1][:steps] == want, results
    assert results[1][-1] == steps and results[0][-2] == results[1][-2] == steps, results


STATS_SCRIPT = textwrap.dedent('''
    import json
    import numpy as np
    import bpsctl.engine as bps
    bps.init()
    x = np.ones(100000, np.float32)
    for _ in range(3):
        assert (bps.push_pull(x, name="x", average=False) == bps.size()).all()
    print("STATS " + json.dumps(bps._worker.stats()), flush=True)
    bps.shutdown()
''')


@pytest.mark.timeout(180)
def test_emulated_hosts_keep_their_traffic_on_the_shaped_nics(tmp_path):
    """Workers and servers of an emulated cluster are on hosts of their own (one network
    namespace each): nothing goes through shared memory, so the emulation is not bypassed."""
    script = tmp_path / "stats.py"
    script.write_text(STATS_SCRIPT)
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH")]))}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    up = cli("up", "--emulate", "--workers", "2", "--servers", "2", "--nic", "1gbit")
    assert up.returncode == 0, up.stderr
    try:
        run = cli("run", "-np", "2", "--", sys.executable, str(script))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        stats = [json.loads(line.partition("STATS ")[2])
                 for line in run.stdout.splitlines() if "STATS " in line]
        assert len(stats) == 2, run.stdout[-2000:]
        assert all(s["shm_pushes"] == s["shm_results"] == 0 for s in stats), stats
    finally:
        down = cli("down")
        assert down.returncode == 0, down.stderr
