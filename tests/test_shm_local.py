"""The intra-node stage on shared memory (bpsctl/engine/shm.py, intranode.py): exact sums and
averages through one arena per host, with and without the servers (one host), the gloo path
when it is off, a local peer killed mid-step, and the arena's name, mode, bound and cleanup.

Workers are real processes: ``run_script`` of test_torch_plugin (``run_local`` on a private
cluster), or started here from the cluster's own worker plan when a test must watch them die.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import (  # noqa: E402
    cluster_config,
    gone,
    kill_pids,
    run_worker_scripts,
    wait_until,
)
from test_torch_plugin import run_script  # noqa: E402

from bpsctl.config import Config  # noqa: E402
from bpsctl.engine import EngineError, shm  # noqa: E402
from bpsctl.launch import api  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
ARENA_BYTES = 2 * 1024 * 1024           # small: the ring wraps within one check

RECORD = '''
from bpsctl.engine import shm as _shm
_w = bps._p().worker
_stage = bps._p().stage
EXTRA = {"tag": _shm.cluster_tag(_w.scheduler_address, _w.security.secret),
         "shm": _stage is not None and _stage._arena is not None,
         "local_only": _stage is not None and _stage.local_only}
'''

SUMS_SCRIPT = RECORD + '''
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SHAPES = [(), (0,), (1,), (3,), (1001,), (257, 129)]    # fewer elements than ranks too

def ranked(r, shape, dtype):
    base = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.int64)
    return ((base[:torch.Size(shape).numel()].reshape(shape) % 5) + r).to(dtype)

def total(shape):
    return sum(ranked(r, shape, torch.int64) for r in range(N))

@check
def exact_sums():
    for dtype in DTYPES:
        for shape in SHAPES:
            got = bps.push_pull(ranked(R, shape, dtype), average=False, name=f"s.{dtype}.{shape}")
            assert got.dtype == dtype and got.shape == shape, (dtype, shape)
            assert torch.equal(got, total(shape).to(dtype)), (dtype, shape)
            x = ranked(R, shape, dtype)
            bps.push_pull_inplace(x, average=False, name=f"s.{dtype}.{shape}")
            assert torch.equal(x, total(shape).to(dtype)), (dtype, shape, "in place")

@check
def exact_averages():
    for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
        for shape in [(7, 9), (1001,)]:
            got = bps.push_pull(ranked(R, shape, dtype), average=True, name=f"a.{dtype}.{shape}")
            want = (total(shape).double() / N).to(dtype)
            assert torch.equal(got, want), (dtype, shape, (got - want).abs().max())

@check
def averaging_integers_is_refused_as_the_engine_refuses_it():
    try:
        bps.push_pull(torch.ones(5, dtype=torch.int32), average=True, name="int.avg")
        raise AssertionError("no error")
    except TypeError as exc:
        assert "average=True needs a floating-point tensor" in str(exc), str(exc)
    # and the stage goes on
    assert torch.equal(bps.push_pull(torch.ones(5), average=False, name="after.int.avg"),
                       torch.full((5,), float(N)))

@check
def many_in_flight_past_the_arena():
    # 24 x 256 KiB in flight through a 2 MiB arena: regions are reused as the ranks finish
    handles = [bps.push_pull_async(torch.full((65536,), float(R + i)), average=False,
                                   name=f"ring.{i}", priority=i % 3) for i in range(24)]
    for i, h in enumerate(handles):
        want = float(sum(r + i for r in range(N)))
        assert torch.equal(bps.synchronize(h), torch.full((65536,), want)), i

@check
def a_training_step_matches_one_process():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 1))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    torch.manual_seed(1)
    data = torch.randint(-3, 4, (4 * N, 20)).float()
    model(data[4 * R:4 * R + 4]).sum().backward()
    opt.step()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(),
                                    torch.nn.Linear(30, 1))
    for r in range(N):
        reference(data[4 * r:4 * r + 4]).sum().backward()
    for got, p in zip(grads, reference.parameters()):
        assert torch.allclose(got, p.grad / N, atol=1e-5), (got - p.grad / N).abs().max()

EXTRA["declared"] = len(_w._tensors)         # names the servers were told about
'''

#: (workers, mode): ``local`` one host without servers (BPSCTL_LOCAL_ONLY=auto), ``servers``
#: shared memory then the servers (BPSCTL_LOCAL_ONLY=off), ``gloo`` BPSCTL_LOCAL_SHM=0. Each
#: mode once, and each count from 1 to 4 once (an odd count through the servers, where a
#: share of uneven size is summed): every case is a job of torch processes, each costing
#: seconds of CPU to start
CASES = [(1, "local"), (2, "gloo"), (3, "servers"), (4, "local")]
MODE_KNOBS = {"local": {}, "servers": {"local_only": "off"}, "gloo": {"local_shm": False}}


def run_records(tmp_path: Path, body: str, np: int, **knobs) -> list[dict]:
    """run_script with each rank's EXTRA kept beside its check results."""
    body = body + '\nRESULTS["extra"] = EXTRA\n'
    return run_script(tmp_path, body, np=np, shm_bytes=ARENA_BYTES, **knobs)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_sums_and_averages_are_exact(tmp_path, workers, mode):
    records = run_records(tmp_path, SUMS_SCRIPT, workers, **MODE_KNOBS[mode])
    for rank, record in enumerate(records):
        extra = record["results"].pop("extra")
        for check, outcome in record["results"].items():
            assert outcome == "ok", f"rank {rank}, {check}: {outcome}"
        staged = workers > 1
        assert extra["shm"] is (staged and mode != "gloo"), f"rank {rank}"
        assert extra["local_only"] is (staged and mode == "local"), f"rank {rank}"
        if staged and mode == "local":
            assert extra["declared"] == 0, "one host: no tensor should reach the servers"
        elif workers == 1:
            assert extra["declared"] == 0, "a job of one worker has nothing to send"
        else:
            assert extra["declared"] > 0
        assert shm.leftovers(extra["tag"]) == [], "the job left shared memory behind"


BOUND_SCRIPT = RECORD + '''
@check
def tensors_larger_than_the_arena_go_in_pieces():
    x = torch.arange(300000, dtype=torch.float64) % 7 + R       # 2.4 MB through 64 KiB
    want = sum(torch.arange(300000, dtype=torch.float64) % 7 + r for r in range(N))
    assert torch.equal(bps.push_pull(x, average=False, name="big"), want)
    handles = [bps.push_pull_async(torch.full((40000,), float(R + i)), average=True,
                                   name=f"big.{i}") for i in range(3)]
    for i, h in enumerate(handles):
        assert torch.equal(bps.synchronize(h), torch.full((40000,), (N - 1) / 2 + i))
'''


@pytest.mark.timeout(120)
def test_tensors_larger_than_the_arena_bound_sum_exactly_in_pieces(tmp_path):
    body = BOUND_SCRIPT + '\nRESULTS["extra"] = EXTRA\n'
    records = run_script(tmp_path, body, np=2, shm_bytes=65536)
    for rank, record in enumerate(records):
        extra = record["results"].pop("extra")
        assert extra["shm"], f"rank {rank}"
        assert record["results"]["tensors_larger_than_the_arena_go_in_pieces"] == "ok", \
            f"rank {rank}: {record['results']}"
        assert shm.leftovers(extra["tag"]) == []


def test_a_bound_below_the_minimum_is_refused_naming_the_knob():
    from bpsctl.config import ConfigError
    with pytest.raises(ConfigError, match="BPSCTL_SHM_BYTES: expected at least 65536 bytes"):
        Config.from_env({"BPSCTL_SHM_BYTES": "1KiB"})


@pytest.mark.timeout(120)
def test_an_arena_larger_than_dev_shm_is_refused_at_init_naming_the_knob(tmp_path):
    free = os.statvfs(shm.SHM_DIR).f_bavail * os.statvfs(shm.SHM_DIR).f_frsize
    script = tmp_path / "init.py"
    script.write_text("import bpsctl.engine.torch as bps\nbps.init()\n")
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                    start_timeout_s=20.0, op_timeout_s=20.0, shm_bytes=free + 2**40)
    log = io.StringIO()
    with api.local_cluster(config, servers=1) as cluster:
        result = api.run([sys.executable, str(script)], config.replace(
            state_dir=cluster.state_dir), workers=2, stdout=log, stderr=log)
        assert result.exit_code != 0
        assert f"(BPSCTL_SHM_BYTES={free + 2**40})" in log.getvalue(), log.getvalue()[-3000:]
        assert "/dev/shm has" in log.getvalue()
        assert shm.leftovers(shm.cluster_tag(cluster.scheduler, cluster.secret)) == []


KILL_SCRIPT = '''
import os, signal, sys, time
import torch
import bpsctl.engine.torch as bps
from bpsctl.engine import EngineError
torch.set_num_threads(1)
out = sys.argv[1]
bps.init()
R, N = bps.rank(), bps.size()
x = torch.ones(300000)
try:
    for step in range(1000):
        if R == 0 and step == 3:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(f"{os.getpid()} {time.monotonic()}")
            os.kill(os.getpid(), signal.SIGKILL)            # the arena's creator, mid-step
        handles = [bps.push_pull_async(x, average=False, name=f"t{i}") for i in range(4)]
        for h in handles:
            assert torch.equal(bps.synchronize(h), torch.full((300000,), float(N)))
    print("finished without noticing", flush=True)
except EngineError as exc:
    print(f"ERROR at {time.monotonic()}: {exc}", flush=True)
    sys.exit(1)
'''


@pytest.mark.timeout(120)
def test_a_killed_local_worker_is_named_within_10_s_and_its_shared_memory_is_gone(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    config = cluster_config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                            heartbeat_timeout_s=5.0, start_timeout_s=20.0, op_timeout_s=60.0,
                            shm_bytes=ARENA_BYTES, local_only="off")
    with api.local_cluster(config, servers=1) as cluster:
        tag = shm.cluster_tag(cluster.scheduler, cluster.secret)
        processes, outputs = run_worker_scripts(cluster, config, 3, script, str(out))
        assert (out / "killed").exists(), "\n".join(o[-1500:] for o in outputs)
        killed_pid, killed_at = (out / "killed").read_text().split()
        assert processes[0].returncode == -9
        for rank in (1, 2):
            output = outputs[rank]
            assert processes[rank].returncode == 1, output[-2000:]
            match = re.search(r"ERROR at ([\d.]+): (.*)", output)
            assert match, output[-2000:]
            assert float(match.group(1)) - float(killed_at) < 10, output[-2000:]
            message = match.group(2)
            assert "worker 0" in message and f"pid {killed_pid}" in message, message
        assert shm.leftovers(tag) == [], "the killed creator's arena is still in /dev/shm"
    assert all(gone(p.pid) for p in processes)


def test_an_arena_is_0600_named_for_its_cluster_and_job_and_gone_once_all_attached(tmp_path):
    tag = shm.cluster_tag("127.0.0.1:9123", "s3cret")
    assert re.fullmatch(r"9123-[0-9a-f]{8}", tag)
    assert shm.cluster_tag("127.0.0.1:9123", "other") != tag     # another cluster
    name = shm.segment_name(tag, "job/1", 0)
    assert name == f"bpsctl-{tag}-job_1-h0"
    path = tmp_path / name
    arena = shm.Arena.create(path, 1 << 20, 2)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.stat().st_size == 1 << 20
        peer = shm.Arena.attach(path, 1 << 20, 1, 2, time.monotonic() + 5, lambda: None)
        arena.wait_attached(time.monotonic() + 5, lambda: None)
        assert not path.exists()                # named only until every local rank attached
        assert peer.peer_alive(0) and arena.peer_alive(1)
        peer.release()
    finally:
        arena.release()
    # a second job with the same name while the first's creator lives is refused
    arena = shm.Arena.create(path, 1 << 20, 2)
    try:
        with pytest.raises(EngineError, match=f"in use by pid {os.getpid()}"):
            shm.Arena.create(path, 1 << 20, 2)
    finally:
        arena.release()
    assert not path.exists()


def test_attach_gives_up_at_its_deadline_naming_the_knob(tmp_path):
    started = time.monotonic()
    with pytest.raises(EngineError, match="BPSCTL_START_TIMEOUT"):
        shm.Arena.attach(tmp_path / "bpsctl-never", 1 << 20, 1, 2, started + 0.3, lambda: None)
    assert time.monotonic() - started < 5


LEFTOVER_SCRIPT = textwrap.dedent('''
    import sys
    from pathlib import Path
    from bpsctl.engine import shm
    shm.Arena.create(Path(sys.argv[1]), 1 << 20, 2)     # then dies before anyone attached
    import os
    os._exit(0)
''')


@pytest.mark.timeout(60)
def test_down_removes_what_a_crashed_job_of_its_cluster_left_and_nothing_else(tmp_path):
    config = cluster_config(state_dir=tmp_path / "state")
    cluster = api.up_local(config, servers=1)
    pids = [p.pid for p in cluster.processes]
    other = shm.SHM_DIR / shm.segment_name(shm.cluster_tag("127.0.0.1:1", "another"), "j", 0)
    try:
        ours = shm.SHM_DIR / shm.segment_name(shm.cluster_tag(cluster.scheduler, cluster.secret),
                                              "crashed-job", 0)
        for path in (ours, other):
            subprocess.run([sys.executable, "-c", LEFTOVER_SCRIPT, str(path)], check=True,
                           timeout=30, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            assert path.exists()
        report = api.down(tmp_path / "state")
        assert report.removed_segments == (ours.name,)
        assert not ours.exists() and other.exists()
    finally:
        other.unlink(missing_ok=True)
        kill_pids(pid for pid in pids if not gone(pid))
    wait_until(lambda: all(gone(pid) for pid in pids), 5, "the cluster to stop")
