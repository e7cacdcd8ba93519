"""CUDA tensors through the torch plugin, and the pure pieces of the intra-node stage's NCCL path.

The tests marked ``gpu`` need CUDA; the ones through the NCCL intra-node stage need a GPU per
local rank (two), since NCCL refuses two ranks on one device. Without them they skip, saying
why. The rest (chunk layout, the GPU division's rounding, no CUDA touched by CPU users) runs
everywhere: they test real code, not a stand-in for a GPU. The decisions (which path, NCCL or
not, agreed job-wide) are tested on CPU in test_paths.py.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import CHECK_HELPER  # noqa: E402

from bpsctl.config import Config  # noqa: E402
from bpsctl.engine.intranode import chunk_layout, divide_exactly  # noqa: E402
from bpsctl.engine.worker import _divide_bf16  # noqa: E402
from bpsctl.launch.api import run_local  # noqa: E402

CUDA = torch.cuda.is_available()

PRELUDE = textwrap.dedent('''
    import json, os, sys, traceback
    import torch
    import bpsctl.engine.torch as bps
    torch.set_num_threads(1)
    bps.init()
    R, N = bps.rank(), bps.size()
    RESULTS, EXTRA = {}, {}
    DEV = None
    if torch.cuda.is_available():
        DEV = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(DEV)
        torch.backends.cuda.matmul.allow_tf32 = False

''') + CHECK_HELPER + textwrap.dedent('''

    def save():
        stage = bps._p().stage
        with open(os.path.join(sys.argv[1], f"rank{R}.json"), "w") as f:
            json.dump({"stage": stage is not None,
                       "nccl": stage is not None and stage.handles_cuda,
                       "path": bps.gradient_path(cuda=DEV is not None),
                       "cuda_initialized": torch.cuda.is_initialized(),
                       "results": RESULTS, "extra": EXTRA}, f)
''')


def run_script(tmp_path: Path, body: str, np_: int, *args: str, logs: list[str] | None = None,
               **knobs) -> list[dict]:
    """Run PRELUDE + body on ``np_`` worker processes of one host; each rank's record (and
    the job's output appended to ``logs``)."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + "\nsave()\nbps.shutdown()\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2, start_timeout_s=60.0,
                    op_timeout_s=60.0, **knobs)
    log = io.StringIO()
    result = run_local([sys.executable, str(script), str(out_dir), *args], np_, config,
                       servers=2, stdout=log, stderr=log)
    assert result.exit_code == 0, f"workers failed:\n{log.getvalue()[-4000:]}"
    if logs is not None:
        logs.append(log.getvalue())
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(np_)]


def assert_all_ok(records: list[dict]) -> None:
    for rank, record in enumerate(records):
        for check, outcome in record["results"].items():
            assert outcome == "ok", f"rank {rank}, {check}: {outcome}"


# --------------------------------------------------------------------------- on a GPU

SUMS_SCRIPT = '''
SHAPES = [(), (1,), (3,), (1001,), (257, 129), (4, 256), (0,)]   # fewer elements than ranks too
FLOATS = [torch.float32, torch.float16, torch.bfloat16]

def ranked(r, shape, dtype):
    count = 1
    for d in shape:
        count *= d
    return ((torch.arange(count, dtype=torch.int64).reshape(shape) % 5) + r).to(dtype)

def total(shape, dtype):
    return sum(ranked(r, shape, torch.int64) for r in range(N)).to(dtype)

@check
def exact_sums():
    for dtype in FLOATS:
        for shape in SHAPES:
            x = ranked(R, shape, dtype).to(DEV)
            got = bps.push_pull(x, average=False, name=f"s.{dtype}.{shape}")
            assert got.device == DEV and got.dtype == dtype and got.shape == shape, got
            assert torch.equal(got.cpu(), total(shape, dtype)), (dtype, shape)
            assert torch.equal(x.cpu(), ranked(R, shape, dtype)), "the input changed"
            y = x.clone()
            assert bps.push_pull_inplace(y, average=False, name=f"s.{dtype}.{shape}") is y
            assert torch.equal(y.cpu(), total(shape, dtype)), (dtype, shape)

@check
def exact_averages():
    for dtype in FLOATS:
        got = bps.push_pull(ranked(R, (33, 65), dtype).to(DEV), average=True, name=f"avg.{dtype}")
        want = (total((33, 65), torch.float64) / N).to(dtype)
        assert torch.equal(got.cpu(), want), dtype
    # every rank pushes the same values: the average gives them back, bit for bit
    x = torch.linspace(-1, 1, 10007, dtype=torch.float64).to(DEV)
    for dtype in FLOATS:
        got = bps.push_pull(x.to(dtype) * 3, average=True, name=f"same.{dtype}")
        assert torch.equal(got.cpu(), (x.to(dtype) * 3).cpu()), dtype

@check
def not_contiguous_and_async_with_priorities():
    y = ranked(R, (40, 30), torch.float32).to(DEV).t()
    h = bps.push_pull_async_inplace(y, average=False, name="t")
    assert bps.synchronize(h) is y and torch.equal(y.cpu(), total((40, 30), torch.float32).t())
    handles = [bps.push_pull_async(torch.full((3001,), float(R), device=DEV), name=f"a.{i}",
                                   priority=i) for i in range(8)]
    for h in handles:
        assert torch.equal(bps.synchronize(h).cpu(), torch.full((3001,), (N - 1) / 2))

@check
def produced_on_a_side_stream():
    # the stage must wait for the caller's stream, and the caller's stream for the stage
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device=DEV)
    with torch.cuda.stream(side):
        for _ in range(3):
            b = a @ a                                          # slow work before the value
        b = torch.full_like(b, float(R + 1))
        got = bps.push_pull(b, average=False, name="side")
        got.mul_(2)                                            # on the side stream, after
    side.synchronize()
    assert torch.equal(got.cpu(), torch.full((2048, 2048), float(N * (N + 1))))

@check
def repeated_pushes_of_a_name():
    # from a name's second push on, the staged path of a worker with its servers on this host
    # copies straight between the GPU and the engine's shared memory: sums, averages and
    # non-contiguous tensors stay exact
    shape = (1500, 1001)                                    # several partitions
    for dtype in FLOATS:
        for step in range(3):
            x = ranked(R, shape, dtype).to(DEV) + step
            got = bps.push_pull(x, average=False, name=f"rep.{dtype}")
            assert torch.equal(got.cpu(), (total(shape, torch.int64) + N * step).to(dtype))
            avg = bps.push_pull(x, average=True, name=f"rep.avg.{dtype}")
            want = ((total(shape, torch.float64) + N * step) / N).to(dtype)
            assert torch.equal(avg.cpu(), want), (dtype, step)
            y = (ranked(R, (64, 3001), dtype) + step).to(DEV).t()
            h = bps.push_pull_async_inplace(y, average=False, name=f"rep.t.{dtype}")
            assert bps.synchronize(h) is y
            assert torch.equal(y.cpu(), (total((64, 3001), torch.int64) + N * step).to(dtype).t())
    EXTRA["stats"] = bps._p().worker.stats()

@check
def fp16_compression_on_the_gpu():
    x = torch.linspace(-3, 3, 1001, device=DEV) * (R + 1)
    exact = sum(torch.linspace(-3, 3, 1001) * (r + 1) for r in range(N)) / N
    got = bps.push_pull(x, name="c.fp16", compression=bps.Compression.fp16)
    assert got.dtype == torch.float32 and got.device == DEV
    assert torch.allclose(got.cpu(), exact, atol=1e-2, rtol=1e-2)
'''

TRAIN_COMMON = textwrap.dedent('''
    import torch

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 10))

    def global_batch(step, workers, local_batch):
        g = torch.Generator().manual_seed(1000 + step)
        return (torch.randn(workers * local_batch, 32, generator=g),
                torch.randint(0, 10, (workers * local_batch,), generator=g))

    def make_optimizer(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
''')

TRAIN_SCRIPT = TRAIN_COMMON + '''
STEPS, LOCAL_BATCH = int(sys.argv[2]), int(sys.argv[3])

@check
def train():
    model = make_model().to(DEV)
    opt = bps.DistributedOptimizer(make_optimizer(model), model.named_parameters())
    for step in range(STEPS):
        x, y = global_batch(step, N, LOCAL_BATCH)
        x, y = x[R * LOCAL_BATCH:(R + 1) * LOCAL_BATCH], y[R * LOCAL_BATCH:(R + 1) * LOCAL_BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(DEV)), y.to(DEV)).backward()
        opt.step()
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               os.path.join(sys.argv[1], f"params.rank{R}.pt"))
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("force", [False, True])
def test_single_rank_cuda_push_pull(tmp_path, force):
    """One worker, one GPU: alone, nothing travels and nothing leaves the GPU; forced through
    the servers (BPSCTL_FORCE_DISTRIBUTED), CUDA tensors are staged through host memory."""
    logs: list[str] = []
    records = run_script(tmp_path, SUMS_SCRIPT, 1, logs=logs, force_distributed=force)
    assert records[0]["stage"] is False
    assert records[0]["path"] == ("host-staged" if force else "none")
    assert f"CUDA tensors: {records[0]['path']}" in logs[0]
    assert_all_ok(records)
    if force:
        # the repeated pushes went between the GPU and shared memory with no CPU copy
        stats = records[0]["extra"]["stats"]
        assert stats["filled_pushes"] > 0 and stats["lent_results"] > 0, stats


PINNED_SCRIPT = '''
from bpsctl.engine.torch.pinning import host_bytes

x = torch.ones(3 << 20, device=DEV)                         # 12 MiB: several partitions
for _ in range(3):
    assert torch.equal(bps.push_pull(x, average=False, name="x"), x)
worker = bps._p().worker
views = [view for family in worker._shm_slots.values() for _, _, view in family.chunks]
EXTRA["pinned"] = [bool(host_bytes(view).is_pinned()) for view in views]
EXTRA["stats"] = worker.stats()
save()
bps.shutdown()
EXTRA["after_shutdown"] = [bool(host_bytes(view).is_pinned()) for view in views]
path = os.path.join(sys.argv[1], f"rank{R}.json")
with open(path) as f:
    record = json.load(f)
record["extra"] = EXTRA
with open(path, "w") as f:
    json.dump(record, f)
save = lambda: None                                         # noqa: E731 - already saved
'''


@pytest.mark.timeout(180)
def test_a_staged_worker_page_locks_its_shared_memory_and_lets_go_at_shutdown(tmp_path):
    """A worker forced through a server on its host registers its push slots with CUDA (the
    GPU copies straight into them), and unregisters them when it shuts down."""
    [record] = run_script(tmp_path, PINNED_SCRIPT, 1, force_distributed=True)
    extra = record["extra"]
    assert extra["pinned"] and all(extra["pinned"]), extra
    assert not any(extra["after_shutdown"]), extra
    assert extra["stats"]["filled_pushes"] > 0, extra["stats"]


@pytest.mark.timeout(240)
def test_two_workers_on_one_gpu_stage_through_host_memory_and_say_so(tmp_path, monkeypatch):
    """Both on the same device (local_rank % 1): NCCL would refuse them ("Duplicate GPU
    detected"), so the job agrees on staging through host memory and the host's stage."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")         # one GPU, however many there are
    logs: list[str] = []
    records = run_script(tmp_path, SUMS_SCRIPT, 2, logs=logs)
    for rank, record in enumerate(records):
        assert record["stage"] and not record["nccl"], f"rank {rank}"
        assert record["path"] == "host-staged", f"rank {rank}"
    assert "CUDA tensors: host-staged" in logs[0] and "share" in logs[0]
    assert_all_ok(records)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("local_reduce", "local_only", "path"), [
    ("auto", "auto", "nccl-local"), ("auto", "off", "nccl+servers"),
    ("off", "auto", "host-staged")])
def test_cuda_sums_are_exact_on_every_path(tmp_path, local_reduce, local_only, path):
    records = run_script(tmp_path, SUMS_SCRIPT, 2, local_reduce=local_reduce,
                         local_only=local_only, partition_bytes=4096)
    for rank, record in enumerate(records):
        assert record["stage"] is (local_reduce == "auto"), f"rank {rank}"
        assert record["nccl"] is (local_reduce == "auto"), f"rank {rank}: NCCL groups"
        assert record["path"] == path, f"rank {rank}"
    assert_all_ok(records)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("local_reduce", ["auto", "off"])
def test_distributed_optimizer_on_a_cuda_model_matches_the_cpu(tmp_path, local_reduce):
    steps, local_batch, workers = 10, 8, 2
    records = run_script(tmp_path, TRAIN_SCRIPT, workers, str(steps), str(local_batch),
                         local_reduce=local_reduce)
    assert_all_ok(records)
    reference = _cpu_reference(steps, workers, local_batch)     # one CPU process
    rank0 = torch.load(tmp_path / "out" / "params.rank0.pt")
    for rank in range(workers):
        params = torch.load(tmp_path / "out" / f"params.rank{rank}.pt")
        for name, ref in reference.items():
            assert torch.equal(params[name], rank0[name]), f"rank {rank} differs in {name}"
            assert torch.allclose(params[name], ref, rtol=1e-4, atol=1e-5), \
                f"{name}: max |diff| {(params[name] - ref).abs().max():.2e}"


def _cpu_reference(steps: int, workers: int, local_batch: int) -> dict:
    """TRAIN_COMMON's model trained in this process on the CPU, on the whole global batch."""
    namespace: dict = {}
    exec(TRAIN_COMMON, namespace)
    model = namespace["make_model"]()
    opt = namespace["make_optimizer"](model)
    for step in range(steps):
        x, y = namespace["global_batch"](step, workers, local_batch)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["two ranks on one gpu", "one rank forced"])
def test_a_cuda_model_trained_through_the_host_staging_matches_the_cpu(tmp_path, monkeypatch,
                                                                        case):
    """The staged path of DistributedOptimizer on one GPU (the hooks hand each gradient to the
    copy streams, the results come back before the optimizer reads them): two ranks sharing
    the device, or one rank forced through the servers; the parameters those of CPU training
    on the global batch."""
    steps, local_batch = 10, 8
    workers = 2 if case == "two ranks on one gpu" else 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    records = run_script(tmp_path, TRAIN_SCRIPT, workers, str(steps), str(local_batch),
                         force_distributed=workers == 1)
    assert_all_ok(records)
    assert all(record["path"] == "host-staged" for record in records)
    reference = _cpu_reference(steps, workers, local_batch)
    for rank in range(workers):
        params = torch.load(tmp_path / "out" / f"params.rank{rank}.pt")
        for name, ref in reference.items():
            assert torch.allclose(params[name], ref, rtol=1e-4, atol=1e-5), \
                f"rank {rank}, {name}: max |diff| {(params[name] - ref).abs().max():.2e}"


DDP_SCRIPT = TRAIN_COMMON + '''
import torch.distributed as dist
STEPS, LOCAL_BATCH = int(sys.argv[2]), int(sys.argv[3])

@check
def ddp_train():
    # the reference: torch DDP over NCCL on the same GPUs (bpsctl's stage made the default
    # group; DDP uses it with the NCCL groups' device)
    group = dist.new_group(list(range(N)), backend="nccl")
    model = make_model().to(DEV)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEV.index],
                                                    process_group=group)
    opt = make_optimizer(ddp)
    for step in range(STEPS):
        x, y = global_batch(step, N, LOCAL_BATCH)
        x, y = x[R * LOCAL_BATCH:(R + 1) * LOCAL_BATCH], y[R * LOCAL_BATCH:(R + 1) * LOCAL_BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x.to(DEV)), y.to(DEV)).backward()
        opt.step()
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               os.path.join(sys.argv[1], f"ddp.rank{R}.pt"))
'''


@pytest.mark.timeout(300)
def test_a_one_host_gpu_job_sends_nothing_to_the_servers_and_trains_as_ddp(tmp_path):
    """Two GPUs of one host: one NCCL all-reduce per gradient on the GPUs, the servers' traces
    empty, and the parameters those of torch DDP over NCCL."""
    from bpsctl.trace.api import load, summarize
    steps, local_batch = 10, 8
    traces = tmp_path / "traces"
    records = run_script(tmp_path, TRAIN_SCRIPT + DDP_SCRIPT, 2, str(steps), str(local_batch),
                         trace_dir=str(traces))
    assert_all_ok(records)
    assert all(record["path"] == "nccl-local" for record in records)
    assert sum(s["bytes_summed"] for s in summarize(load(traces))["servers"]) == 0
    for rank in range(2):
        ours = torch.load(tmp_path / "out" / f"params.rank{rank}.pt")
        ddp = torch.load(tmp_path / "out" / f"ddp.rank{rank}.pt")
        for name, value in ddp.items():
            assert torch.allclose(ours[name], value, rtol=1e-5, atol=1e-6), \
                f"rank {rank}, {name}: max |diff| {(ours[name] - value).abs().max():.2e}"


@pytest.mark.timeout(600)
def test_bench_on_a_gpu_reports_the_device_and_a_plain_row(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "bench", "resnet50", "--device", "cuda", "--workers", "1",
                           "--batch-size", "16", "--image-size", "64", "--warmup", "2",
                           "--iters", "3", "--compare", "ddp", "--json", "-"],
                          capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["device"] == "cuda" and report["gpus"][0]["count"] >= 1
    assert report["cuda_version"] and report["gpus"][0]["name"]
    systems = [row["system"] for row in report["results"]]
    assert systems == ["bpsctl", "ddp", "plain"]
    assert report["results"][0]["gradient_path"] == "none"
    assert report["baseline_backend"] == "nccl"
    assert "on 1x " in done.stderr and "plain" in done.stderr


CUPY_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import cupy, numpy as np, torch
    import bpsctl.engine as bps
    bps.init()
    R, N = bps.rank(), bps.size()
    device = bps.local_rank() % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    results = {}
    for dtype in (cupy.float32, cupy.float16, cupy.int32):
        x = (cupy.arange(1001) % 7 + R).astype(dtype)
        got = bps.push_pull(x, name=f"c.{dtype.__name__}", average=False)
        want = bps.push_pull(cupy.asnumpy(x), name=f"n.{dtype.__name__}", average=False)
        results[dtype.__name__] = (isinstance(got, cupy.ndarray) and got.device.id == device
                                   and np.array_equal(cupy.asnumpy(got), want)
                                   and np.array_equal(cupy.asnumpy(x), cupy.asnumpy(
                                       (cupy.arange(1001) % 7 + R).astype(dtype))))
    avg = bps.push_pull(cupy.full(33, float(R), cupy.float32), name="avg")
    results["average"] = bool((avg == (N - 1) / 2).all())
    # the DLPack hand-off the MXNet plugin uses for GPU NDArrays: the result lands in the
    # memory of the tensor that handed itself over
    t = torch.full((257,), float(R + 1), device=f"cuda:{device}")
    d = cupy.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    bps.push_pull(d, name="dlpack", average=False, out=d)
    cupy.cuda.get_current_stream().synchronize()
    results["dlpack"] = torch.equal(t.cpu(), torch.full((257,), float(N * (N + 1) // 2)))
    with open(os.path.join(sys.argv[1], f"cupy{R}.json"), "w") as f:
        json.dump(results, f)
    bps.shutdown()
''')


@pytest.mark.timeout(240)
def test_cupy_arrays_through_the_engine_sum_as_numpy_ones(tmp_path):
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda12x)")
    script = tmp_path / "cupy_job.py"
    script.write_text(CUPY_SCRIPT)
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2, start_timeout_s=60.0,
                    op_timeout_s=60.0)
    log = io.StringIO()
    result = run_local([sys.executable, str(script), str(tmp_path)], 2, config, servers=2,
                       stdout=log, stderr=log)
    assert result.exit_code == 0, log.getvalue()[-4000:]
    for rank in range(2):
        outcome = json.loads((tmp_path / f"cupy{rank}.json").read_text())
        assert all(outcome.values()), (rank, outcome)


# --------------------------------------------------------------------------- everywhere

@pytest.mark.parametrize("local_size", [1, 2, 3, 4, 8])
def test_chunks_cover_the_tensor_once_in_rank_order(local_size):
    for n in range(70):
        covered, chunks = [], set()
        for local_rank in range(local_size):
            chunk, start, valid = chunk_layout(n, local_size, local_rank)
            chunks.add(chunk)
            assert 0 <= valid <= chunk
            assert start == local_rank * chunk
            covered.extend(range(start, start + valid))
        assert covered == list(range(n)), (n, local_size)
        (chunk,) = chunks                                     # one chunk size for all
        assert n <= chunk * local_size < n + local_size       # padding below one per rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divisor", [2, 3, 7, 12, 100, 1000])
def test_the_division_for_averaging_rounds_as_the_engine_does(dtype, divisor):
    """divide_exactly (run on the GPU after the all-gather) gives, bit for bit, what the
    engine's host division gives (run here on CPU tensors: the rounding rule, not CUDA's)."""
    gen = torch.Generator().manual_seed(divisor)
    values = (torch.randn(20011, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    got = values.clone()
    divide_exactly(got, divisor)
    if dtype == torch.bfloat16:
        bits = values.view(torch.int16).numpy().view(np.uint16)
        out = np.empty_like(bits)
        _divide_bf16(bits, divisor, out)
        want = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    else:
        # as the engine does it: into an output of the tensor's dtype (NumPy < 1.24, which
        # MXNet needs, would otherwise promote float16 / 1000 to a float32 result)
        quotient = np.empty_like(values.numpy())
        np.divide(values.numpy(), divisor, out=quotient)
        want = torch.from_numpy(quotient)
    assert got.dtype == dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_the_bench_knows_a_cpu_build_of_torch_without_importing_it():
    """The bench's GPU probe reads a CPU build from the package's metadata; what it says is
    what the imported torch says (this machine's torch, CPU or CUDA build)."""
    import torch

    from bpsctl.bench.training import cpu_torch_version
    said = cpu_torch_version()
    if said is None:
        assert torch.version.cuda is not None or "+cpu" not in torch.__version__
    else:
        assert said == torch.__version__ and torch.version.cuda is None


@pytest.mark.skipif(CUDA, reason="checks the CPU-only case; this machine has CUDA")
def test_cpu_users_touch_no_cuda(tmp_path):
    code = ("import torch, bpsctl.engine.torch, bpsctl.engine.intranode; "
            "assert not torch.cuda.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # a job with the stage on: no NCCL groups, host tensors through gloo, no CUDA touched
    records = run_script(tmp_path, '''
@check
def cpu_sums():
    got = bps.push_pull(torch.full((1001,), float(R)), average=False, name="cpu")
    assert torch.equal(got, torch.full((1001,), float(sum(range(N)))))
''', 2)
    for rank, record in enumerate(records):
        assert record["stage"] and not record["nccl"], f"rank {rank}"
        assert not record["cuda_initialized"], f"rank {rank}"
    assert_all_ok(records)


GATHERS_SCRIPT = '''
@check
def gathers_of_cuda_tensors_are_whole():
    # each rank's own rows (allgather) and the rows it sends itself (alltoall) come back on
    # the device too, though on the host they need not travel (push_pull's ``want``)
    x = torch.full((3 + R, 5), float(R + 1), device=DEV)
    got = bps.allgather(x, name="g")
    want = torch.cat([torch.full((3 + r, 5), float(r + 1)) for r in range(N)])
    assert got.device == DEV and torch.equal(got.cpu(), want), got[:, 0].tolist()
    rows = [4] * N
    y = torch.cat([torch.full((4, 3), float(10 * R + d)) for d in range(N)]).to(DEV)
    out, received = bps.alltoall(y, splits=rows, name="a")
    expect = torch.cat([torch.full((4, 3), float(10 * s + R)) for s in range(N)])
    assert out.device == DEV and torch.equal(out.cpu(), expect), out[:, 0].tolist()
'''


def test_gathers_of_cuda_tensors_keep_each_ranks_own_rows(tmp_path):
    assert_all_ok(run_script(tmp_path, GATHERS_SCRIPT, 2, partition_bytes=64,
                             local_reduce="off"))
