"""bpsctl.engine.torch, API by API, in the spirit of Horovod's test_torch.py.

Each script runs once as real worker processes (``run_local`` on a private cluster); every
rank records each check's outcome, and the tests below assert them one by one.
"""
from __future__ import annotations

import io
import json
import resource
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import CHECK_HELPER  # noqa: E402

from bpsctl.config import Config  # noqa: E402
from bpsctl.launch.api import run_local  # noqa: E402

PRELUDE = textwrap.dedent('''
    import json, os, sys, time, traceback
    import torch
    import bpsctl.engine.torch as bps
    torch.set_num_threads(1)
    bps.init()
    R, N = bps.rank(), bps.size()
    RESULTS = {}

''') + CHECK_HELPER + textwrap.dedent('''

    def save():
        out = os.path.join(sys.argv[1], f"rank{R}.json")
        with open(out, "w") as f:
            json.dump({"stage": bps._p().stage is not None, "local_size": bps.local_size(),
                       "results": RESULTS}, f)
''')


def run_script(tmp_path: Path, body: str, np: int, ranks: list[int] | None = None,
               **knobs) -> list[dict]:
    """Run PRELUDE + body on ``np`` workers; return each rank's record (of ``ranks`` only,
    if given: a worker that leaves early writes none)."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + "\nsave()\nbps.shutdown()\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2, start_timeout_s=30.0,
                    op_timeout_s=30.0, **knobs)
    log = io.StringIO()
    result = run_local([sys.executable, str(script), str(out_dir)], np, config, servers=2,
                       stdout=log, stderr=log)
    assert result.exit_code == 0, f"workers failed:\n{log.getvalue()[-4000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text())
            for r in (range(np) if ranks is None else ranks)]


def assert_ok(records: list[dict], check: str) -> None:
    """Every rank ran ``check`` (a check of a script of :func:`run_script`) and it passed."""
    for rank, record in enumerate(records):
        outcome = record["results"].get(check, "not run")
        assert outcome == "ok", f"rank {rank}: {outcome}"


API_SCRIPT = '''
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int16, torch.int8, torch.uint8]
SHAPES = [(), (17,), (3, 4, 5), (0,), (1000, 33)]

def ranked(r, shape, dtype):
    count = 1
    for d in shape:
        count *= d
    base = torch.arange(count, dtype=torch.int64).reshape(shape) % 11
    return (base + r).to(dtype)

def expected(shape, dtype):
    return sum(ranked(r, shape, torch.int64) for r in range(N)).to(dtype)

@check
def sums_across_dtypes_and_shapes():
    for dtype in DTYPES:
        for shape in SHAPES:
            got = bps.push_pull(ranked(R, shape, dtype), average=False, name=f"sum.{dtype}.{shape}")
            assert got.dtype == dtype and got.shape == shape, (dtype, shape, got.dtype, got.shape)
            assert torch.equal(got, expected(shape, dtype)), (dtype, shape)

@check
def averages_across_float_dtypes():
    for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
        got = bps.push_pull(ranked(R, (7, 9), dtype), average=True, name=f"avg.{dtype}")
        want = expected((7, 9), torch.float64) / N
        assert torch.equal(got, want.to(dtype)), dtype

@check
def async_poll_synchronize():
    x = ranked(R, (50000,), torch.float32)
    handles = [bps.push_pull_async(x, average=False, name=f"async.{i}") for i in range(5)]
    deadline = time.monotonic() + 20
    while not all(bps.poll(h) for h in handles):
        assert time.monotonic() < deadline, "poll never became True"
        time.sleep(0.01)
    for h in handles:
        got = bps.synchronize(h)
        assert torch.equal(got, expected((50000,), torch.float32))
        assert got.data_ptr() != x.data_ptr()          # a new tensor
    try:
        bps.synchronize(handles[0])
        raise AssertionError("synchronize of a finished handle did not raise")
    except ValueError as exc:
        assert "already synchronized" in str(exc)

@check
def in_place():
    x = ranked(R, (4, 5), torch.float32)
    ptr = x.data_ptr()
    out = bps.push_pull_inplace(x, average=False, name="inplace")
    assert out is x and x.data_ptr() == ptr and torch.equal(x, expected((4, 5), torch.float32))
    y = ranked(R, (4, 5), torch.float64).t()            # not contiguous
    h = bps.push_pull_async_inplace(y, average=False, name="inplace.async")
    assert bps.synchronize(h) is y and torch.equal(y, expected((4, 5), torch.float64).t())

@check
def compression_fp16_and_bf16():
    x = torch.linspace(-3, 3, 1001) * (R + 1)
    exact = sum(torch.linspace(-3, 3, 1001) * (r + 1) for r in range(N)) / N
    for name, comp, tol in [("fp16", bps.Compression.fp16, 1e-2),
                            ("bf16", bps.Compression.bf16, 5e-2)]:
        got = bps.push_pull(x, name=f"compressed.{name}", compression=comp)
        assert got.dtype == torch.float32
        assert torch.allclose(got, exact, atol=tol, rtol=tol), (name, (got - exact).abs().max())
    ints = bps.push_pull(torch.ones(3, dtype=torch.int32), average=False, name="compressed.int",
                         compression=bps.Compression.fp16)   # integers travel as they are
    assert torch.equal(ints, torch.full((3,), N, dtype=torch.int32))

@check
def engine_compression_both_ways():
    x = torch.linspace(-1, 1, 20000) * (R + 1)          # 80 kB: above the 64 KiB minimum
    got = bps.push_pull(x, name="engine.onebit", compression=bps.Compression.onebit())
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert len(got.abs().unique()) == 1                 # onebit: one magnitude per partition
    assert torch.equal(torch.sign(got), torch.sign(x))
    # under BPSCTL_MIN_COMPRESS_BYTES the tensor travels as it is: an exact sum
    small = bps.push_pull(torch.ones(10) * (R + 1), average=False, name="engine.small",
                          compression=bps.Compression.topk(0.01))
    assert torch.equal(small, torch.full((10,), N * (N + 1) / 2))
    try:
        bps.push_pull(torch.ones(20000, dtype=torch.int32), average=False, name="engine.ints",
                      compression=bps.Compression.onebit())
        raise AssertionError("compressing an integer tensor was accepted")
    except ValueError as exc:
        assert "compression: onebit needs a float16, float32 or float64 tensor" in str(exc)

@check
def distributed_optimizer_with_onebit_and_error_feedback():
    torch.manual_seed(0)
    # one 80 kB weight (compressed), its own bucket: no name shared with the other checks
    model = torch.nn.Linear(200, 100, bias=False)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[("onebit.weight", model.weight)],
                                   compression=bps.Compression.onebit(scaling=True, ef=True))
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(8, 200) * (R + 1)).pow(2).mean().backward()
        opt.step()
    # every worker took the same steps: its parameters are the workers' average
    for name, p in model.named_parameters():
        mean = bps.push_pull(p.detach().clone(), name=f"check.{name}")
        assert torch.allclose(mean, p.detach(), atol=1e-6), name
    assert torch.isfinite(model.weight).all()

@check
def noname_push_pulls():
    for _ in range(3):
        assert torch.equal(bps.push_pull(torch.ones(3), average=False), torch.full((3,), float(N)))

@check
def broadcast_parameters_from_root():
    torch.manual_seed(100 + R)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 5))                                  # running stats differ per rank
    bps.broadcast_parameters(model.state_dict(), root_rank=1)
    for name, t in model.state_dict().items():
        total = bps.push_pull(t.double(), average=False, name=f"check.{name}")
        assert torch.equal(total, t.double() * N), name       # identical on every rank
    torch.manual_seed(7)
    reference = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    bps.broadcast_parameters(reference.named_parameters(), root_rank=0)

@check
def broadcast_optimizer_state_from_root():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1))
    if R == 0:                                                 # only the root has state
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    bps.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    state = opt.state_dict()["state"]
    assert len(state) == 2
    avg = bps.push_pull(state[0]["exp_avg"].double(), average=False, name="check.exp_avg")
    assert torch.equal(avg, state[0]["exp_avg"].double() * N)

@check
def broadcast_objects():
    obj = {"epoch": 3, "rank": R, "blob": list(range(R * 10))}
    got = bps.broadcast_object(obj, root_rank=N - 1)
    assert got == {"epoch": 3, "rank": N - 1, "blob": list(range((N - 1) * 10))}
    assert bps.broadcast_object(None if R else "x" * 100000, root_rank=0) == "x" * 100000

@check
def a_bad_root_is_refused():
    try:
        bps.broadcast_object(1, root_rank=N)
        raise AssertionError("no error")
    except ValueError as exc:
        assert f"root_rank {N} is not a rank" in str(exc)

@check
def duplicate_names_in_flight_are_refused():
    # each rank checks a name the other has not pushed yet (so its round cannot be complete):
    # rank 0 "dup" before the other pushes it after "go.0", rank 1 "dup.1" before rank 0
    # pushes it after "go.1"
    x = torch.ones(10)

    def refused(name):
        try:
            bps.push_pull_async(x, average=False, name=name)
            raise AssertionError("no error")
        except ValueError as exc:
            assert "already in flight" in str(exc)

    def go(name):
        bps.push_pull(torch.zeros(1), average=False, name=name)
    if R == 0:
        h = bps.push_pull_async(x, average=False, name="dup")
        refused("dup")
        go("go.0")
        go("go.1")
        h1 = bps.push_pull_async(x, average=False, name="dup.1")
    else:
        go("go.0")
        h1 = bps.push_pull_async(x, average=False, name="dup.1")
        refused("dup.1")
        h = bps.push_pull_async(x, average=False, name="dup")
        go("go.1")
    assert torch.equal(bps.synchronize(h), torch.full((10,), float(N)))
    assert torch.equal(bps.synchronize(h1), torch.full((10,), float(N)))
    # once synchronized, the name is free again
    assert torch.equal(bps.push_pull(x, average=False, name="dup"), torch.full((10,), float(N)))

@check
def mismatched_shapes_fail_on_every_rank():
    x = torch.ones(3 + R)
    started = time.monotonic()
    try:
        bps.push_pull(x, average=False, name="mismatch")
        raise AssertionError("no error")
    except Exception as exc:                                  # noqa: BLE001
        assert "disagree on tensor 'mismatch'" in str(exc), str(exc)
    assert time.monotonic() - started < 10

@check
def optimizer_zero_grad_before_step_is_refused():
    model = torch.nn.Linear(3, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()
    try:
        opt.zero_grad()
        raise AssertionError("no error")
    except AssertionError as exc:
        assert "before optimizer.step()" in str(exc), str(exc)
    opt.step()
    opt.zero_grad()
    # synchronize() then step() under skip_synchronize(), as Horovod's gradient clipping recipe
    model(torch.ones(2, 3) * (R + 1)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    with opt.skip_synchronize():
        opt.step()
    mean = 2.0 * sum(range(1, N + 1)) / N                    # d(sum)/dw = 2 (R + 1), averaged
    assert torch.allclose(model.weight.grad, torch.full((1, 3), mean)), model.weight.grad

@check
def ddp_wrapper_averages_and_no_sync_accumulates():
    torch.manual_seed(R)                   # different init: the wrapper broadcasts rank 0's
    module = torch.nn.Linear(4, 1, bias=False)
    ddp = bps.DistributedDataParallel(module)
    torch.manual_seed(0)
    w0 = torch.nn.Linear(4, 1, bias=False).weight.detach().clone()
    assert torch.equal(module.weight.detach(), w0)
    x = torch.ones(1, 4) * (R + 1)
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert torch.equal(module.weight.grad, x)                 # local only
    ddp(x).sum().backward()                                   # averaged, both passes
    mean = sum(2.0 * (r + 1) for r in range(N)) / N
    assert torch.allclose(module.weight.grad, torch.full((1, 4), mean)), module.weight.grad
'''

API_CHECKS = ["sums_across_dtypes_and_shapes", "averages_across_float_dtypes",
              "async_poll_synchronize", "in_place", "compression_fp16_and_bf16",
              "engine_compression_both_ways",
              "distributed_optimizer_with_onebit_and_error_feedback",
              "noname_push_pulls", "broadcast_parameters_from_root",
              "broadcast_optimizer_state_from_root", "broadcast_objects", "a_bad_root_is_refused",
              "duplicate_names_in_flight_are_refused", "mismatched_shapes_fail_on_every_rank",
              "optimizer_zero_grad_before_step_is_refused",
              "ddp_wrapper_averages_and_no_sync_accumulates"]


@pytest.fixture(scope="module")
def api_results(tmp_path_factory):
    # the intra-node stage off: this is the engine path; test_intranode covers the stage
    return run_script(tmp_path_factory.mktemp("api"), API_SCRIPT, np=2, local_reduce="off")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", API_CHECKS)
def test_api(api_results, check):
    assert_ok(api_results, check)


@pytest.mark.timeout(60)
def test_init_without_a_cluster_fails_clearly(tmp_path, monkeypatch):
    import bpsctl.engine.torch as bps
    from bpsctl.engine import EngineError
    with pytest.raises(EngineError, match="not initialized"):
        bps.size()
    with pytest.raises(EngineError, match="no scheduler to connect to"):
        bps.init(Config(state_dir=tmp_path))
    assert not bps.is_initialized()


INTRANODE_SCRIPT = '''
@check
def exact_sums():
    for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]:
        for shape in [(), (1,), (3,), (1001,), (257, 129)]:     # fewer elements than ranks too
            count = 1
            for d in shape:
                count *= d
            base = torch.arange(count, dtype=torch.int64).reshape(shape) % 5
            x = (base + R).to(dtype)
            want = sum(base + r for r in range(N)).to(dtype)
            got = bps.push_pull(x, average=False, name=f"s.{dtype}.{shape}")
            assert torch.equal(got, want), (dtype, shape)
            got = bps.push_pull_inplace(x, average=False, name=f"s.{dtype}.{shape}")
            assert torch.equal(x, want), (dtype, shape)
    handles = [bps.push_pull_async(torch.full((3000,), float(R)), name=f"a.{i}", priority=i)
               for i in range(8)]
    for h in handles:
        assert torch.equal(bps.synchronize(h), torch.full((3000,), (N - 1) / 2))
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("local_reduce", ["auto", "off"])
def test_intranode_stage_gives_exact_sums(tmp_path, local_reduce):
    records = run_script(tmp_path, INTRANODE_SCRIPT, np=4, local_reduce=local_reduce,
                         partition_bytes=1024)
    for rank, record in enumerate(records):
        assert record["local_size"] == 4
        assert record["stage"] is (local_reduce == "auto"), f"rank {rank}"
        assert record["results"]["exact_sums"] == "ok", f"rank {rank}: {record['results']}"


PAGE_FAULT_SCRIPT = '''
import resource

# one layer with a 64 MiB gradient: beyond anything glibc would keep on its own (its mmap
# threshold stops adapting at 32 MiB), so by default every backward pass maps it afresh
model = torch.nn.Linear(4096, 4096, bias=False)
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
x = torch.randn(2, 4096)


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@check
def backward_faults():
    # the first steps grow the heap until a freed gradient's memory fits the next one; small
    # allocations split the holes, so with a model that is one big layer the heap still grows
    # by a gradient now and then (rarely after 30 steps, but not never)
    RESULTS["faults"] = 0
    for step in range(40):
        opt.zero_grad()
        loss = model(x).sum()
        before = faults()
        loss.backward()
        if step >= 30:
            RESULTS["faults"] += faults() - before
        opt.step()
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuse", [True, False])
def test_a_big_gradient_is_not_page_faulted_in_anew_every_step(tmp_path, reuse):
    """With BPSCTL_REUSE_MEMORY (the default) the plugin's workers reuse a freed gradient's
    memory; with it off, glibc maps the 64 MiB gradient afresh in every backward pass."""
    records = run_script(tmp_path, PAGE_FAULT_SCRIPT, np=1, reuse_memory=reuse)
    results = records[0]["results"]
    assert results["backward_faults"] == "ok", results
    pages = 64 * 1024 * 1024 // resource.getpagesize()     # one gradient's
    # over ten backward passes: without reuse every one faults its gradient in; with it, a
    # fresh gradient's worth now and then at most (fewer than half of them)
    if reuse:
        assert results["faults"] < 5 * pages, results
    else:
        assert results["faults"] >= 9 * pages, results
