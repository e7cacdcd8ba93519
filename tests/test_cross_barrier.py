"""CrossBarrier (bpsctl.engine.torch.cross_barrier) on 2 real workers: the same parameters as
DistributedOptimizer bit for bit (SGD with momentum and weight decay under a learning-rate
schedule, Adam, AdamW, accumulated backward passes); the next forward pass starts while the
last layer's update of the step before is still held; bad use is refused; a lost peer fails
the next forward pass with a clear error instead of hanging it.

One launch runs every check of a script (starting torch costs more than the training); each
rank records each check's outcome and its parameters, and the tests assert them.
"""
from __future__ import annotations

import io
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import CHECK_HELPER  # noqa: E402

from bpsctl.config import Config  # noqa: E402
from bpsctl.launch.api import run_local  # noqa: E402

PRELUDE = textwrap.dedent('''
    import json, os, sys, threading, time, traceback
    import torch
    import bpsctl.engine.torch as bps
    from bpsctl.engine.torch.cross_barrier import CrossBarrier
    torch.set_num_threads(1)
    bps.init()
    R, N = bps.rank(), bps.size()
    OUT = sys.argv[1]
    RESULTS = {}

''') + CHECK_HELPER + textwrap.dedent('''

    def make_model():
        # at BPSCTL_FUSION_BYTES=1024 each weight travels alone and the LayerNorm's parameters
        # share a bucket with the first bias: fused buckets spanning two modules, and single ones
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
            torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(2 * N, 16, generator=g)[2 * R:2 * R + 2] * (R + 1)
        y = torch.randint(0, 10, (2 * N,), generator=g)[2 * R:2 * R + 2]
        return x, y

    def save():
        with open(os.path.join(OUT, f"rank{R}.json"), "w") as f:
            json.dump(RESULTS, f)
''')

TRAIN_SCRIPT = '''
STEPS = 8
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05, foreach=False),
}

def train(kind, cross, passes=1):
    model = make_model()
    if cross:
        opt = CrossBarrier(model, OPTIMIZERS[kind](model.parameters()),
                           named_parameters=model.named_parameters(),
                           backward_passes_per_step=passes, num_steps=STEPS)
    else:
        opt = bps.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            (torch.nn.functional.cross_entropy(model(xs), ys) / passes).backward()
        opt.step()
        schedule.step()
    state = opt.state_dict()       # the last step waited for every update
    return model, opt, state

@check
def equal_to_distributed_optimizer():
    for kind, passes in [("sgd", 1), ("adam", 1), ("adamw", 1), ("sgd", 2)]:
        plain, _, plain_state = train(kind, cross=False, passes=passes)
        crossed, opt, crossed_state = train(kind, cross=True, passes=passes)
        for (name, a), b in zip(plain.named_parameters(), crossed.parameters()):
            assert torch.equal(a, b), (kind, passes, name, (a - b).abs().max().item())
        for i, want in plain_state["state"].items():
            for key, value in want.items():
                assert torch.equal(value, crossed_state["state"][i][key]), (kind, i, key)
        assert crossed_state["param_groups"][0]["lr"] == plain_state["param_groups"][0]["lr"]
        assert bps.step_count() > 0
        flat = torch.cat([p.detach().reshape(-1) for p in crossed.parameters()])
        torch.save(flat, os.path.join(OUT, f"{kind}{passes}.rank{R}.pt"))
        # state_dict/load_state_dict round trip into a fresh CrossBarrier
        again = make_model()
        opt2 = CrossBarrier(again, OPTIMIZERS[kind](again.parameters()),
                            named_parameters=again.named_parameters())
        opt2.load_state_dict(crossed_state)
        assert opt2.state_dict()["param_groups"][0]["lr"] == crossed_state["param_groups"][0]["lr"]

@check
def next_forward_starts_before_the_last_update():
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    # the update of the last layer's weight in step HELD is held (on the update thread) until
    # the first layer's forward pass of the next step has started: with a barrier between
    # steps, that forward pass could not start and the hold runs out
    HELD = 3
    model = make_model()
    first, last = model[0], model[5]
    opt = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       named_parameters=model.named_parameters())
    forward_started = {}                    # step -> event, set when model[0]'s forward starts
    times = {}
    current = [0]
    last_updates = [0]

    def on_first_forward(module, args):    # registered after CrossBarrier's own pre-hook
        times.setdefault(("forward", current[0]), time.monotonic_ns())
        forward_started.setdefault(current[0], threading.Event()).set()

    def before_update(optimizer, args, kwargs):
        if optimizer.param_groups[0]["params"][0] is last.weight:
            last_updates[0] += 1
            if last_updates[0] == HELD:
                event = forward_started.setdefault(HELD + 1, threading.Event())
                times["held_released"] = event.wait(30)

    def after_update(optimizer, args, kwargs):
        if optimizer.param_groups[0]["params"][0] is last.weight:
            times[("last_updated", last_updates[0])] = time.monotonic_ns()

    first.register_forward_pre_hook(on_first_forward)
    hooks = [register_optimizer_step_pre_hook(before_update),
             register_optimizer_step_post_hook(after_update)]
    try:
        for step in range(1, HELD + 3):
            current[0] = step
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    assert times.get("held_released") is True, "the forward pass of the next step never started"
    assert times[("forward", HELD + 1)] < times[("last_updated", HELD)]
    assert last_updates[0] == HELD + 2

@check
def zero_grad_between_backward_and_step_is_refused():
    model = make_model()
    opt = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       named_parameters=model.named_parameters())
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for call in (opt.zero_grad, opt.synchronize):
        try:
            call()
            raise RuntimeError(f"{call.__name__} between backward and step was accepted")
        except AssertionError as exc:
            assert "before optimizer.step()" in str(exc) or "between loss.backward()" in str(exc)
    opt.step()
    opt.synchronize()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

@check
def bad_arguments_are_refused():
    model, other = make_model(), torch.nn.Linear(3, 3)
    for args, kwargs, words in [
            ((model, torch.optim.SGD(other.parameters(), lr=0.1)), {}, "not parameters of"),
            ((model, torch.optim.SGD(model.parameters(), lr=0.1)), {"num_steps": 0}, "num_steps"),
            (("model", torch.optim.SGD(model.parameters(), lr=0.1)), {}, "torch.nn.Module")]:
        try:
            CrossBarrier(*args, **kwargs)
            raise RuntimeError(f"accepted {kwargs or args}")
        except (TypeError, ValueError) as exc:
            assert words in str(exc), str(exc)
'''

TRAIN_CHECKS = ["equal_to_distributed_optimizer", "next_forward_starts_before_the_last_update",
                "zero_grad_between_backward_and_step_is_refused", "bad_arguments_are_refused"]


def run_script(tmp_path: Path, body: str, np: int = 2, **knobs) -> tuple[list[dict], str, float]:
    """Run PRELUDE + body on ``np`` workers; return each rank's record, the output, seconds."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + "\nsave()\nbps.shutdown()\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    config = Config(**{"state_dir": tmp_path / "state", "heartbeat_interval_s": 0.2,
                       "start_timeout_s": 30.0, "op_timeout_s": 30.0, "local_reduce": "off",
                       "fusion_bytes": 1024, **knobs})
    log = io.StringIO()
    started = time.monotonic()
    result = run_local([sys.executable, str(script), str(out_dir)], np, config, servers=2,
                       stdout=log, stderr=log)
    seconds = time.monotonic() - started
    assert result.exit_code == 0, f"workers failed:\n{log.getvalue()[-4000:]}"
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(np)]
    return records, log.getvalue(), seconds


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cross")
    records, _, _ = run_script(tmp, TRAIN_SCRIPT)
    return records, tmp / "out"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", TRAIN_CHECKS)
def test_cross_barrier(train_run, check):
    records, _ = train_run
    for rank, record in enumerate(records):
        outcome = record.get(check, "not run")
        assert outcome == "ok", f"rank {rank}: {outcome}"


@pytest.mark.timeout(240)
def test_both_workers_end_with_the_same_parameters(train_run):
    records, out = train_run
    for variant in ("sgd1", "adam1", "adamw1", "sgd2"):
        first, second = (torch.load(out / f"{variant}.rank{r}.pt") for r in (0, 1))
        assert torch.equal(first, second), variant


LOST_PEER_SCRIPT = '''
model = make_model()
opt = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   named_parameters=model.named_parameters())
for step in range(3):
    if R == 1 and step == 2:
        save()
        bps.shutdown()               # leaves the job before pushing the step's gradients
        sys.exit(0)
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

@check
def the_next_forward_pass_fails_naming_the_update():
    started = time.monotonic()
    try:
        model(batch(3)[0])
        raise RuntimeError("the forward pass ran on parameters never updated")
    except bps.EngineError as exc:
        assert "CrossBarrier: the update of" in str(exc) and "in step 3 failed" in str(exc), exc
    RESULTS["waited_s"] = time.monotonic() - started
'''


@pytest.mark.timeout(120)
def test_a_lost_peer_fails_the_next_forward_pass_instead_of_hanging_it(tmp_path):
    """Worker 1 leaves before pushing its third step: worker 0's update thread fails when the
    engine gives up on those push_pulls, and its next forward pass raises that (within the
    heartbeat timeout, not the op deadline); both exit, nothing is left running."""
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    records, output, seconds = run_script(tmp_path, LOST_PEER_SCRIPT, heartbeat_timeout_s=2.0,
                                          op_timeout_s=10.0)
    outcome = records[0].get("the_next_forward_pass_fails_naming_the_update", "not run")
    assert outcome == "ok", f"rank 0: {outcome}\n{output[-3000:]}"
    assert records[0]["waited_s"] < 10.0
    assert seconds < 60, output[-3000:]
    # a process still exiting when run_local returned (or exited and not yet reaped) is given
    # 10 s: under a loaded full run one was seen here a moment after the job ended
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(new, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


@pytest.mark.timeout(300)
def test_a_restarted_worker_rejoins_a_cross_barrier_job_bitwise_equal(tmp_path):
    """test_rejoin's job (`bpsctl run -np 3 --max-restarts 1`, worker 2 killed at step 4)
    with CrossBarrier: the donor hands the model over once its own updates are applied, and
    after each step all three workers hold the same parameters (read after synchronize())."""
    from test_rejoin import SCRIPT, _run
    plain = '''optimizer = bps.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4),
    named_parameters=model.named_parameters())'''
    crossed = '''from bpsctl.engine.torch.cross_barrier import CrossBarrier
optimizer = CrossBarrier(model,
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4),
    named_parameters=model.named_parameters(), num_steps=steps)'''
    assert plain in SCRIPT and "    optimizer.step()\n" in SCRIPT
    script = SCRIPT.replace(plain, crossed).replace(
        "    optimizer.step()\n", "    optimizer.step()\n    optimizer.synchronize()\n")
    # the live two must not finish before the restarted process has started (torch's import
    # alone takes seconds on a loaded machine)
    steps, die_at = 200, 4
    done, out = _run(tmp_path, script, str(steps), str(die_at), "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rejoined the job" in done.stderr, done.stdout + done.stderr
    start = int((out / "start-2").read_text())
    assert die_at <= start < steps, f"the restarted worker resumed at step {start}"
    for step in [*range(die_at), *range(start, steps)]:
        first, *others = (torch.load(out / f"r{rank}-s{step}.pt") for rank in range(3))
        assert all(torch.equal(first, other) for other in others), f"step {step} differs"


@pytest.mark.timeout(300)
def test_the_training_bench_runs_bpsctl_with_cross_barrier(tmp_path):
    """`bpsctl bench resnet50 --cross-barrier` (tiny scale, embedded default): bpsctl's row
    trains with CrossBarrier and the JSON says so; nothing is left running."""
    import psutil
    from test_bench_train import _bpsctl
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "train.json"
    result = _bpsctl(["bench", "resnet50", "--workers", "2", "--servers", "1", "--batch-size",
                      "2", "--warmup", "1", "--iters", "2", "--cross-barrier",
                      "--json", str(out)], tmp_path / "state", 280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cross_barrier"] is True
    row, plain = report["results"]
    assert plain["system"] == "plain"
    assert row["system"] == "bpsctl" and row["version"].endswith("CrossBarrier")
    assert row["img_per_sec"] > 0
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before
