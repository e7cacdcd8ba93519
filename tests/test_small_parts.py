"""Parts whose main tests take minutes (SSH clusters, emulated stragglers, restarted workers,
stale training), tested here on their own in a second or two, so that the fast tier still
runs every module of bpsctl (see test_tiers.py): the SSH launcher's plan of a recorded
cluster, the preflight's ports per host, the cgroup runner, the engine's microbenchmarks,
and bounded staleness, Horovod's elastic API and its collectives on a job of one worker."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from bpsctl.config import Config
from bpsctl.launch import ssh
from bpsctl.launch.hosts import load_hosts
from bpsctl.launch.preflight import _host_entries
from bpsctl.launch.types import ClusterState

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# --------------------------------------------------------------------------- SSH clusters

def _ssh_cluster(tmp_path: Path) -> ClusterState:
    hosts = load_hosts(EXAMPLES / "hosts.yaml")
    return ClusterState(name="ssh-test", scheduler="10.0.0.5:9000", secret="s3", kind="ssh",
                        state_dir=str(tmp_path), processes=(), created=0.0, hosts=hosts,
                        addresses={entry.host: entry.host for entry in hosts.entries})


def test_a_recorded_ssh_cluster_plans_a_worker_per_slot_with_its_workdir(tmp_path):
    cluster = _ssh_cluster(tmp_path)
    plan = ssh.worker_plan(cluster, Config(), "job-1")
    assert [w.rank for w in plan.workers] == list(range(cluster.hosts.world_size))
    assert {w.host for w in plan.workers} == {e.host for e in cluster.hosts.workers}
    assert plan.workdir == ssh.remote_dir(cluster.hosts, "ssh-test")
    env = plan.workers[0].to_env(Config(), plan)
    assert env["BPSCTL_SCHEDULER"] == "10.0.0.5:9000" and env["BPSCTL_JOB_ID"] == "job-1"


def test_preflight_knows_each_hosts_ports_and_nic():
    hosts = load_hosts(EXAMPLES / "hosts.yaml")
    entries = _host_entries(hosts)
    scheduler = hosts.scheduler
    assert scheduler is not None and scheduler.port in entries[scheduler.host]["ports"]
    for server in hosts.servers:
        assert server.port in entries[server.host]["ports"]
    named = [entry for entry in hosts.workers if entry.interface]
    assert all(entries[entry.host]["interface"] == entry.interface for entry in named)


# --------------------------------------------------------------------------- cgroups

def test_cgexec_joins_the_group_then_becomes_the_command_with_the_same_pid(tmp_path):
    procs = tmp_path / "cgroup.procs"            # a plain file stands in for the kernel's
    done = subprocess.run([sys.executable, "-m", "bpsctl.launch.cgexec", str(procs), "--",
                           sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert procs.read_text() == done.stdout.strip()      # the same process, exec'd
    usage = subprocess.run([sys.executable, "-m", "bpsctl.launch.cgexec", str(procs)],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    missing = subprocess.run([sys.executable, "-m", "bpsctl.launch.cgexec",
                              str(tmp_path / "none" / "procs"), "--", "true"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "cannot join the cgroup" in missing.stderr


# --------------------------------------------------------------------------- microbenchmarks

def test_the_codec_benchmark_states_each_compressors_bytes():
    from bpsctl.bench import codec
    from bpsctl.engine.compression import parse
    out = io.StringIO()
    with redirect_stdout(out):
        codec.main(["--size", "64KiB", "--repeats", "1", "--workers", "2"])
    report = json.loads(out.getvalue())
    assert report["kind"] == "codec" and report["size_bytes"] == 64 * 1024
    assert {row["compression"] for row in report["results"]} >= {"onebit", "fp16"}
    for row in report["results"]:
        n = report["size_bytes"] // 4
        assert row["wire_bytes"] == parse(row["compression"]).wire_bytes(n), row
        assert row["compress_ms_per_MiB"] > 0 and row["server_ms_per_MiB"] > 0


@pytest.mark.timeout(120)
def test_the_per_tensor_benchmark_pushes_resnet50s_tensors():
    # torchvision's resnet50: 161 parameter tensors, 25,557,032 values
    from bpsctl.bench.shapes import resnet50_shapes
    shapes = resnet50_shapes()
    assert len(shapes) == 161 and sum(math.prod(s) for s in shapes) == 25_557_032
    assert shapes[0] == (64, 3, 7, 7) and shapes[-2:] == [(1000, 2048), (1000,)]


@pytest.mark.parametrize("name, classes", [("vgg16", 1000), ("resnet50", 1000),
                                           ("resnet50", 2)])
def test_the_benchs_shapes_are_its_models_and_fuse_into_the_same_pushes(name, classes):
    """The bench's own process counts values and pushes from bench.shapes, without torch:
    the same shapes, in the same order, as the models its workers build, and the same buckets
    (names, members, priorities) as the torch plugin makes of the real parameters."""
    from bpsctl.bench.models import build
    from bpsctl.bench.shapes import parameters
    from bpsctl.engine.fusion import buckets
    real = list(build(name, classes).parameters())
    shaped = parameters(name, classes)
    assert [tuple(p.shape) for p in real] == [p.shape for p in shaped]
    assert [p.numel() for p in real] == [p.numel() for p in shaped]

    def fused(params):
        names = {p: f"grad.{i}" for i, p in enumerate(params)}
        return [(b.name, len(b.params), b.priority) for b in buckets(params, names, 4 << 20, "g")]
    assert fused(real) == fused(shaped) and len(fused(real)) < len(real)


def test_the_per_tensor_overhead_benchmark_checks_its_sums_and_reports(tmp_path):
    out = tmp_path / "grads.json"
    done = subprocess.run([sys.executable, "-m", "bpsctl.bench.grads", "--workers", "2",
                           "--servers", "1", "--repeats", "1", "--warmup", "0",
                           "--json", str(out)], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["kind"], report["tensors"]) == ("grads", 161)
    assert report["many_tensors_s"] > 0 and report["one_tensor_s"] > 0


# --------------------------------------------------------------------------- one worker

@pytest.fixture
def one_worker(engine_cluster):
    """The torch plugin in this process, as the one worker of a job on the module's cluster."""
    import bpsctl.engine.torch as bps

    def start(**knobs):
        from conftest import WORKER_DEADLINES
        bps.init(Config(rank=0, world_size=1, job_id=f"one-{os.getpid()}-{len(knobs)}",
                        scheduler=engine_cluster.scheduler, secret=engine_cluster.secret,
                        **WORKER_DEADLINES, **knobs))
        return bps
    yield start
    bps.shutdown()


def test_staleness_applies_the_gradient_of_s_steps_ago_and_flush_the_rest(one_worker):
    import torch
    bps = one_worker(staleness=2)
    w = torch.nn.Parameter(torch.zeros(4))
    optimizer = bps.DistributedOptimizer(torch.optim.SGD([w], lr=1.0),
                                         named_parameters=[("w", w)])
    seen = []
    for t in range(5):
        optimizer.zero_grad()
        (w * float(t + 1)).sum().backward()          # the gradient of step t is t + 1
        optimizer.step()
        seen.append(w[0].item())
    # nothing for the first s steps, then the gradients of steps 0, 1, 2 one by one
    assert seen == [0.0, 0.0, -1.0, -3.0, -6.0]
    assert optimizer.flush() == 2 and w[0].item() == -15.0


def test_an_elastic_training_function_commits_and_resumes_from_its_state(one_worker):
    import torch
    bps = one_worker()
    model = torch.nn.Linear(3, 1)
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    state = bps.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])

    @bps.elastic.run
    def train(state):
        while state.epoch < 3:
            optimizer.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            state.epoch += 1
            state.commit()
        return state.epoch

    assert train(state) == 3 and resets == []
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)              # not committed: restore() brings the commit back
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_cross_barrier_of_one_worker_is_the_wrapped_optimizer(one_worker):
    """CrossBarrier updates each layer as its sum arrives; alone, that is SGD itself."""
    import torch

    from bpsctl.engine.torch.cross_barrier import CrossBarrier
    bps = one_worker()

    def model_and_batches():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 1))
        return model, [torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
                       for i in range(4)]

    model, batches = model_and_batches()
    optimizer = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=False),
                             named_parameters=model.named_parameters(), num_steps=len(batches))
    for x in batches:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    optimizer.synchronize()
    plain, batches = model_and_batches()
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1, foreach=False)
    for x in batches:
        sgd.zero_grad()
        plain(x).pow(2).mean().backward()
        sgd.step()
    assert all(torch.equal(a, b)
               for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    bps.shutdown()


def test_horovods_collectives_of_one_worker_give_its_own_tensors(one_worker, tmp_path):
    """Horovod's API on a job of one worker (the multi-worker checks are in
    test_horovod_api.py, in the slow tier): each collective gives what one rank has."""
    import torch
    hvd = one_worker()
    x = torch.arange(6.0).reshape(3, 2)
    for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
        assert torch.equal(hvd.allreduce(x, op=op, postscale_factor=2.0), x * 2)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, root_rank=0), x)
    out, received = hvd.alltoall(x, splits=[3])
    assert torch.equal(out, x) and received.tolist() == [3]
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.mpi_built()) == (0, 1, False)
    with pytest.raises(ValueError, match=r"ranks \[1\] are not ranks of this job \(0..0\)"):
        hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set([0])            # every rank: the global set's
    hvd.start_timeline(str(tmp_path / "timeline.json"))
    hvd.allreduce(x, name="traced")
    hvd.stop_timeline()
    assert "allreduce.traced" in (tmp_path / "timeline.json").read_text()
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), op=hvd.Sum,
                                         groups=1)
    model(x).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="use op=hvd.Average instead"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    # the statistics path of SyncBatchNorm (a job of one takes torch's own): torch's numbers
    sync, plain = hvd.SyncBatchNorm(2), torch.nn.BatchNorm1d(2)
    y = x.clone().requires_grad_()
    sync._synchronized(y).pow(2).sum().backward()
    z = x.clone().requires_grad_()
    plain(z).pow(2).sum().backward()
    assert torch.allclose(y.grad, z.grad, atol=1e-6)
    assert torch.allclose(sync.running_var, plain.running_var)


# --------------------------------------------------------------------------- CLI parts

def test_bpsctl_trace_draws_a_step_picture(engine_cluster, tmp_path):
    from test_trace import _traced_job
    _traced_job(engine_cluster, tmp_path / "t")
    png = tmp_path / "step.png"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "trace", str(tmp_path / "t"),
                           "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "flag"), [
    (["--trials", "0"], "--trials"), (["--model", "alexnet"], "--model"),
    (["--replay", "h200-resnet50"], "--replay"),
    # a dilated replay needs an emulated NIC rate: said before any cluster is built
    (["--emulate", "--model", "resnet50", "--replay", "h200-resnet50", "--target-nic", "25gbit"],
     "--emulate --nic RATE")])
def test_tune_flag_mistakes_exit_2_naming_the_flag(tmp_path, args, flag):
    from typer.testing import CliRunner

    from bpsctl.cli import app
    result = CliRunner().invoke(app, ["--state-dir", str(tmp_path), "tune", *args],
                                env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_install_horovod_says_what_it_builds():
    from typer.testing import CliRunner

    from bpsctl.cli import app
    result = CliRunner().invoke(app, ["install", "horovod", "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "PyTorch and Gloo" in said and "--force" in said


def test_a_cuda_array_is_told_apart_and_without_cupy_the_error_says_how_to_get_it():
    import numpy as np

    from bpsctl.engine import cuda
    from bpsctl.engine.common import EngineError

    class OnAGpu:                   # what CuPy, torch and others offer for GPU memory
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    assert cuda.is_cuda_array(OnAGpu()) and not cuda.is_cuda_array(np.zeros(4))
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(EngineError, match=r"needs CuPy: pip install cupy-cuda12x"):
            cuda.push_pull_async(None, cuda.CudaStaging(), OnAGpu(), "g", True, 0)


# --------------------------------------------------------------------------- allreduce baseline

def test_the_allreduce_baseline_checks_its_sum_and_reports_its_rounds(monkeypatch, capsys):
    """`bench comm --compare allreduce`'s per-worker program, as the one rank of a gloo group in
    this process: it allreduces, checks the sum, and rank 0 prints the line bench reads."""
    pytest.importorskip("torch")
    from bpsctl.bench.allreduce import main
    from bpsctl.bench.common import RESULT_MARKER
    from bpsctl.launch.local import free_port
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    main(["--size", "64KiB", "--warmup", "1", "--repeats", "3", "--timeout", "30"])
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RESULT_MARKER)]
    result = json.loads(line[len(RESULT_MARKER):])
    assert result["size_bytes"] == 64 * 1024 and len(result["seconds"]) == 3
    assert result["version"].endswith(" gloo")


def test_the_collectives_program_checks_every_result_and_a_wrong_one_fails_it(
        engine_cluster, monkeypatch, capsys):
    """`bench comm --op`'s per-worker program as the one worker of a job in this process,
    through the module's servers: every op is timed and rank 0 prints the line bench reads;
    fed data its check does not expect (as a wrong collective would give), it exits naming
    the op, the tensor and the element."""
    pytest.importorskip("torch")
    import bpsctl.engine.torch as bps
    from bpsctl.bench import collectives
    from bpsctl.bench.common import RESULT_MARKER
    for key, value in {"BPSCTL_SCHEDULER": engine_cluster.scheduler,
                       "BPSCTL_SECRET": engine_cluster.secret, "BPSCTL_RANK": "0",
                       "BPSCTL_WORLD_SIZE": "1", "BPSCTL_FORCE_DISTRIBUTED": "1"}.items():
        monkeypatch.setenv(key, value)
    args = ["--system", "bpsctl", "--ops", "allreduce,push_pull,allgather,alltoall,reducescatter",
            "--size", "64KiB", "--tensors", "2", "--warmup", "0", "--repeats", "2",
            "--timeout", "60"]
    monkeypatch.setenv("BPSCTL_JOB_ID", f"ops-{os.getpid()}")
    collectives.main(args)
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RESULT_MARKER)]
    result = json.loads(line[len(RESULT_MARKER):])
    assert list(result["ops"]) == ["allreduce", "push_pull", "allgather", "alltoall",
                                   "reducescatter"]
    for op in result["ops"].values():
        assert op == {"seconds": op["seconds"], "bytes": 64 * 1024, "checked": True}
        assert len(op["seconds"]) == 2 and min(op["seconds"]) > 0
    assert result["version"].startswith("bpsctl ") and result["reduce"] == "average"

    real = collectives.inputs
    monkeypatch.setattr(collectives, "inputs",
                        lambda op, *a: [t + 1 for t in real(op, *a)])
    monkeypatch.setenv("BPSCTL_JOB_ID", f"ops-wrong-{os.getpid()}")
    try:
        with pytest.raises(SystemExit, match=r"^rank 0: bpsctl allreduce: rank 0's tensor 0 is "
                                             r"wrong at element 0: 2\.0, expected 1\.0$"):
            collectives.main(args)
    finally:
        bps.shutdown()
