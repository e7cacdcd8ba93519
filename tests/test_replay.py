"""`bpsctl profile` and `bpsctl bench MODEL --replay PROFILE`: what a profile holds, the bad
files it refuses, the replay's schedule and time dilation, the stand-in's hooks firing at the
recorded times, and the whole replay against DDP and Horovod on emulated hosts."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from test_bench_output import assert_table_fits_80, render, sentence, train_report
from typer.testing import CliRunner

from bpsctl.bench import horovod as horovod_mod
from bpsctl.bench import profile as profile_mod
from bpsctl.bench.api import sweep_servers
from bpsctl.bench.models import build
from bpsctl.bench.profile import (
    ParameterTiming,
    Profile,
    ProfileError,
    StepTimes,
    cuda_step_times,
    dilated_host_cpu,
    dilation_factor,
    load,
    predicted_step_s,
    rate_flag,
    read,
    replay_fit_note,
    replay_label,
    replay_memory_mib,
    replay_memory_note,
    replay_nic_mbit,
    replay_schedule,
    round_latency_s,
    shipped_names,
    summarize,
    transfer_groups,
    undilate_row,
)
from bpsctl.bench.replay import GRADIENT_VALUE, ReplayModel, ReplayOptimizer, replays_busy
from bpsctl.bench.report import print_train, print_train_sweep
from bpsctl.cli import app
from bpsctl.config import Config, ConfigError


def _profile(ready: list[tuple[str, tuple[int, ...], float]], forward_s: float = 0.01,
             backward_s: float = 0.1, optimizer_s: float = 0.01, **keys) -> Profile:
    return Profile(model="resnet50", device="cpu", device_name="test", torch_version="2",
                   batch_size=2, image_size=32, forward_s=forward_s, backward_s=backward_s,
                   optimizer_s=optimizer_s, num_classes=10,
                   parameters=tuple(ParameterTiming(name, shape, "float32", offset)
                                    for name, shape, offset in ready), **keys)


def _invoke(args: list[str], tmp_path):
    return CliRunner().invoke(app, args, env={"BPSCTL_STATE_DIR": str(tmp_path / "state"),
                                              "COLUMNS": "200"})


# --------------------------------------------------------------------------- pure decisions

def test_the_schedule_orders_gradients_as_recorded_and_dilates_every_time():
    profile = _profile([("a.weight", (2,), 0.08), ("a.bias", (2,), 0.05),
                        ("b.weight", (2,), 0.02), ("b.bias", (2,), 0.02)],
                       forward_s=0.03, backward_s=0.07, optimizer_s=0.004)
    schedule = replay_schedule(profile, dilation=10)
    # by ready time; the two ready together in reverse registration order (backward's)
    assert [index for index, _ in schedule.ready] == [3, 2, 1, 0]
    assert [offset for _, offset in schedule.ready] == pytest.approx([0.2, 0.2, 0.5, 0.8])
    assert schedule.forward_s == pytest.approx(0.3)
    assert schedule.optimizer_s == pytest.approx(0.04)
    # backward lasts at least until its last gradient
    assert schedule.backward_s == pytest.approx(0.8)
    with pytest.raises(ValueError):
        replay_schedule(profile, dilation=0)


def test_the_dilation_is_the_targets_rate_over_the_emulated_nics_and_relabels_the_figures():
    assert dilation_factor(25_000, 500) == 50
    assert dilation_factor(None, 500) == 1.0 and dilation_factor(None, None) == 1.0
    with pytest.raises(ConfigError, match="--target-nic.*--emulate --nic"):
        dilation_factor(25_000, None)
    assert replay_label("h200-vgg16", 50, 25_000, 500) == \
        "replayed from h200-vgg16, x50 dilation: 25 Gbit emulated at 500 Mbit"
    assert replay_label("cpu-vgg16", 1.0, None, 500) == "replayed from cpu-vgg16, in real time"
    assert replay_label("h200-vgg16", 125, 25_000, 200, target_cpu=6) == \
        ("replayed from h200-vgg16, x125 dilation: 25 Gbit emulated at 200 Mbit, 6 cores a "
         "worker host at 0.048 of a CPU")
    # the systems' CPU work slowed as much as the rest: a target host's cores over the dilation
    assert dilated_host_cpu(6, 125) == pytest.approx(0.048)
    with pytest.raises(ConfigError, match="--target-cpu 1: at x125 dilation each worker host "
                                          "would get 0.008 of a CPU, under the 0.01"):
        dilated_host_cpu(1, 125)
    with pytest.raises(ConfigError, match="--target-cpu: expected the cores"):
        dilated_host_cpu(0, 25)
    row = {"system": "bpsctl", "img_per_sec": 10.0, "img_per_sec_ci95": 1.0,
           "img_per_sec_per_worker": 5.0, "img_per_sec_per_worker_ci95": 0.5,
           "img_secs_per_worker": [4.0, 6.0], "step_seconds": 2.0, "ideal_step_s": 1.0,
           "nic_fraction": 0.5, "scaling_efficiency": 0.9, "nic_tx_bytes_per_step": 1e6,
           "phase_seconds_per_step": {"forward_backward": 1.5, "optimizer_step": 0.5}}
    target = undilate_row(row, 50)
    assert target["img_per_sec"] == 500 and target["img_per_sec_per_worker_ci95"] == 25
    assert target["img_secs_per_worker"] == [200, 300]
    assert target["step_seconds"] == 0.04 and target["ideal_step_s"] == 0.02
    assert target["phase_seconds_per_step"] == {"forward_backward": 0.03,
                                                "optimizer_step": 0.01}
    # ratios and bytes are the same in either time; the emulated figures are kept
    for key in ("nic_fraction", "scaling_efficiency", "nic_tx_bytes_per_step", "system"):
        assert target[key] == row[key]
    assert target["emulated"]["img_per_sec"] == 10.0 and target["emulated"]["step_seconds"] == 2
    assert undilate_row(row, 1.0) == row


def test_a_replay_chooses_a_nic_its_emulated_hosts_fit_the_cores_at_and_says_when_not():
    # 3200 Mbit per core: 2 + 2 hosts run at 1 Gbit, 16 + 16 at 200 Mbit on 2 cores
    assert replay_nic_mbit(4, 2) == 1000 and replay_nic_mbit(16, 2) == 400
    assert replay_nic_mbit(32, 2) == 200 and replay_nic_mbit(32, 16) == 1000
    assert replay_nic_mbit(10_000, 1) == 10             # the slowest when none fits
    assert replay_fit_note(32, 2, 200, 25_000) == "" and replay_fit_note(4, 2, 1000, 25_000) == ""
    note = replay_fit_note(32, 2, 500, 25_000)
    assert note.startswith("32 emulated hosts at 500 Mbit each may move 16 Gbit/s through this "
                           "machine's 2 CPU cores, more than the 6.4 Gbit/s")
    assert note.endswith("--nic 200mbit (x125 for 25 Gbit) keeps them apart")
    assert (rate_flag(1000), rate_flag(25_000), rate_flag(250)) == ("1gbit", "25gbit", "250mbit")


def test_a_replay_says_when_its_workers_and_servers_would_not_fit_this_machines_memory():
    resnet50, vgg16 = load("h200-resnet50").nbytes, load("h200-vgg16").nbytes
    assert (resnet50, vgg16) == (102_228_128, 553_430_176)      # the models' parameters
    # 2 + 2 hosts measured 1.8 GiB (ResNet50) and 4.7 GiB (VGG16) at once, their processes'
    # peaks adding up to 5.7 GiB for VGG16: the estimate is of that order, not below it
    assert 1.0 < replay_memory_mib(resnet50, 2, 2) / 1819 < 1.15
    assert 0.98 < replay_memory_mib(vgg16, 2, 2) / 5800 < 1.05
    assert replay_memory_note(resnet50, 16, 16, 22 * 1024) == ""
    note = replay_memory_note(vgg16, 16, 16, 22 * 1024)
    assert note.startswith("16 workers and 16 servers replaying a model of 528 MiB need about "
                           "32.")
    assert "each worker about 1.8 GiB" in note and "22.0 GiB are available" in note
    assert note.endswith("the run may be killed for memory; run fewer workers")


@pytest.mark.parametrize("nic, expected", [
    (None, "note: --nic {rate} (x{dilation:g} dilation): the fastest emulated NIC at "
           "which 32 hosts fit this machine's {cores} CPU cores in a replay"),
    ("100gbit", "note: 32 emulated hosts at 100 Gbit each may move 3200 Gbit/s through this "
                "machine's {cores} CPU cores"),
], ids=["chosen", "too-fast"])
def test_a_replay_on_16_emulated_hosts_says_which_nic_fits_before_anything_starts(
        tmp_path, nic, expected):
    cores = len(os.sched_getaffinity(0))
    rate = replay_nic_mbit(32, cores)
    args = ["bench", "resnet50", "--replay", "h200-resnet50", "--emulate", "--workers", "16",
            "--servers", "16", "--target-nic", "25gbit", *(["--nic", nic] if nic else []),
            "--batch-size", "8"]       # refused after the note: nothing is built
    result = _invoke(args, tmp_path)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert expected.format(rate=rate_flag(rate), dilation=25_000 / rate, cores=cores) in said
    assert "recorded at batch 64" in said
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_a_replay_of_more_workers_than_this_machines_memory_holds_says_so_first(tmp_path):
    """64 workers replaying VGG16 on the embedded default (all on this machine): about 123 GiB,
    said before anything starts."""
    available = psutil.virtual_memory().available
    if available > 120 * 2**30:
        pytest.skip(f"this machine has {available / 2**30:.0f} GiB available: 64 VGG16 workers "
                    "fit")
    result = _invoke(["bench", "vgg16", "--replay", "h200-vgg16", "--workers", "64",
                      "--batch-size", "8"], tmp_path)       # refused after the note
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "note: 64 workers and 64 servers replaying a model of 528 MiB need about 12" in said
    assert "the run may be killed for memory; run fewer workers" in said
    assert "recorded at batch 64" in said


def test_medians_and_cuda_event_times_are_pure_and_need_no_gpu():
    steps = [StepTimes(0.1, 0.2, 0.01, [0.05, 0.19]), StepTimes(0.3, 0.4, 0.03, [0.07, 0.39]),
             StepTimes(0.2, 0.3, 0.02, [0.06, 0.29])]
    medians = summarize(steps)
    assert medians["forward_s"] == 0.2 and medians["backward_s"] == 0.3
    assert medians["optimizer_s"] == 0.02 and medians["ready_s"] == [0.06, 0.29]
    assert medians["step_s"] == pytest.approx(0.52)
    with pytest.raises(ValueError, match="parameter 1 got no gradient"):
        summarize([StepTimes(0.1, 0.2, 0.01, [0.05, None])])
    # CUDA events stand for their times in milliseconds; elapsed_time(a, b) is b - a
    marks = {"start": 0.0, "backward": 10.0, "backward_end": 30.0, "end": 31.0}
    times = cuda_step_times(lambda a, b: b - a, marks, [25.0, None, 12.0])
    assert (times.forward_s, times.backward_s, times.optimizer_s) == \
        pytest.approx((0.010, 0.020, 0.001))
    assert times.ready_s == pytest.approx([0.015, None, 0.002])


# --------------------------------------------------------------------------- files

def _good() -> dict:
    return _profile([("fc.weight", (3, 2), 0.01)]).to_json()


@pytest.mark.parametrize("content, expected", [
    (None, "no such file"),
    ('{"version": 1, "kind": "bpsctl-pro', "not JSON, or cut short"),
    (json.dumps([1, 2]), "not a bpsctl profile"),
    (json.dumps({**_good(), "version": 0}), "version: this bpsctl reads profiles of version 1, "
                                            "got 0"),
    (json.dumps({k: v for k, v in _good().items() if k != "forward_s"}),
     "forward_s: expected a number of seconds"),
    (json.dumps({**_good(), "parameters": [{"name": "w", "shape": [0], "dtype": "float32",
                                            "ready_s": 0.1}]}),
     "parameters[0] (w): shape: expected a list of positive whole numbers"),
    (json.dumps({**_good(), "model": "alexnet"}), "model: expected one of vgg16, resnet50"),
    (json.dumps({**_good(), "source": "derived"}), "must say what it was derived from"),
], ids=["missing", "truncated", "foreign", "old", "key", "shape", "model", "derived"])
def test_a_bad_profile_is_refused_naming_the_file_and_what_is_wrong(tmp_path, content,
                                                                    expected):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError) as caught:
        read(path)
    assert str(caught.value).startswith(f"{path}: ") and expected in str(caught.value)
    assert caught.value.exit_code == 2


def _derive_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "derive-profiles.py"
    spec = importlib.util.spec_from_file_location("derive_profiles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_profiles_are_the_models_and_the_derived_ones_say_so():
    assert shipped_names() == ["cpu-resnet50", "cpu-vgg16", "h200-resnet50", "h200-vgg16"]
    resnet = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
              for name, p in build("resnet50").named_parameters()]
    sizes = {"resnet50": (161, 25_557_032), "vgg16": (32, 138_357_544)}
    for name in shipped_names():
        profile = load(name)
        parameters = profile.parameters
        assert (len(parameters), sum(p.numel for p in parameters)) == sizes[profile.model]
        if profile.model == "resnet50":
            assert [(p.name, p.shape, p.dtype) for p in parameters] == resnet
        # backward reaches the classifier first and the first convolution last
        first = min(parameters, key=lambda p: p.ready_s)
        last = max(parameters, key=lambda p: p.ready_s)
        assert first.name.startswith(("fc.", "classifier.6.")), (name, first.name)
        assert last.name in ("conv1.weight", "features.0.weight", "features.0.bias"), name
        assert 0 < last.ready_s <= profile.backward_s
        if name.startswith("cpu-"):
            assert profile.source == "recorded" and profile.device == "cpu"
            assert profile.steps >= 3 and not profile.derived_from
        else:
            # never passed off as a recording: derived from the CPU's, scaled to the step
            # times an H200 measured for the model at batch 64 of 224x224
            assert profile.source == "derived" and profile.derived_from == f"cpu-{profile.model}"
            assert "not recorded on this device" in profile.note
            assert profile.device == "cuda" and profile.device_name == "NVIDIA H200"
            assert (profile.batch_size, profile.image_size) == (64, 224)
            step_ms, forward_backward_ms = {"resnet50": (32.1, 32.0),
                                            "vgg16": (47.4, 46.9)}[profile.model]
            assert profile.total_s * 1e3 == pytest.approx(step_ms)
            assert (profile.forward_s + profile.backward_s) * 1e3 == \
                pytest.approx(forward_backward_ms)
            base = load(profile.derived_from)
            assert profile.forward_s / profile.backward_s == \
                pytest.approx(base.forward_s / base.backward_s)
            # derived from the CPU profile shipped beside it (tools/derive-profiles.py ran
            # after the last recording)
            tool = _derive_tool()
            derived = profile_mod.derive(base, profile.derived_from, "NVIDIA H200",
                                         *tool.H200[profile.model], 64, 224, tool.MEASURED)
            assert derived.to_json() == profile.to_json()


def test_profile_list_shows_each_shipped_profile_recorded_or_derived(tmp_path):
    result = _invoke(["profile", "--list"], tmp_path)
    assert result.exit_code == 0, result.output
    for name in shipped_names():
        assert name in result.output
    # the source column may wrap on a narrow terminal: "derived from" and, below it, the name
    assert "derived from" in result.output and "NVIDIA H200" in result.output
    assert result.output.count("cpu-resnet50") == 2        # its own row, and h200-resnet50's
    assert result.output.count("recorded") == 2


@pytest.fixture
def one_thread():
    """torch on one thread, steadier beside other tests on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_records_every_parameter_in_registration_order(tmp_path, one_thread):
    """`bpsctl profile resnet50` on this CPU, at its smallest: every parameter's gradient
    timed, in the model's order, within the backward pass; the file loads back."""
    out = tmp_path / "r.json"
    result = _invoke(["profile", "resnet50", "--device", "cpu", "--batch-size", "2",
                      "--image-size", "32", "--steps", "1", "--warmup", "1", "-o", str(out)],
                     tmp_path)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in " ".join(result.output.split())
    profile = read(out)
    assert json.loads(out.read_text())["version"] == 1
    # the model's parameters as the shipped profile of it lists them (checked against the
    # model itself below)
    assert [(p.name, p.shape) for p in profile.parameters] == \
        [(p.name, p.shape) for p in load("cpu-resnet50").parameters]
    assert (profile.model, profile.device, profile.batch_size, profile.image_size) == \
        ("resnet50", "cpu", 2, 32)
    assert profile.torch_version == torch.__version__ and profile.source == "recorded"
    assert profile.steps == 1 and profile.forward_s > 0 and profile.optimizer_s > 0
    assert profile.threads == 1
    assert all(0 < p.ready_s <= profile.backward_s for p in profile.parameters)
    assert max(profile.parameters, key=lambda p: p.ready_s).name == "conv1.weight"
    assert profile.recorded_at.endswith("Z")


def test_profile_without_a_model_or_file_exits_2_saying_what_to_give(tmp_path, one_thread):
    result = _invoke(["profile", "resnet50"], tmp_path)
    assert result.exit_code == 2 and "-o FILE" in result.output
    # a batch torch cannot train: exit 2 with torch's reason, no traceback, no file
    out = tmp_path / "one.json"
    result = _invoke(["profile", "resnet50", "--batch-size", "1", "--image-size", "32",
                      "--steps", "1", "--warmup", "1", "-o", str(out)], tmp_path)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "batch 1 of 32x32 images cannot be trained on cpu" in said
    assert "Traceback" not in said and not out.exists()


# --------------------------------------------------------------------------- the stand-in

def test_the_stand_in_fires_each_hook_in_the_recorded_order_never_early():
    """Real hooks on the stand-in's parameters (as bpsctl, Horovod and DDP register them)
    fire in the order the profile recorded, each at its offset from the start of backward
    or a little later (the clock is slept on, never early); the forward pass and the
    optimizer step take their recorded times, and the gradients are the parameters' sizes."""
    profile = _profile([("layer.0.weight", (64, 32), 0.12), ("layer.0.bias", (64,), 0.09),
                        ("head.weight", (10, 64), 0.03), ("head.bias", (10,), 0.02)],
                       forward_s=0.05, backward_s=0.15, optimizer_s=0.04)
    model = ReplayModel(profile, busy=False)
    assert [name for name, _ in model.named_parameters()] == \
        ["layer.0.weight", "layer.0.bias", "head.weight", "head.bias"]
    fired: list[tuple[str, float]] = []
    start = {"backward": 0.0}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: fired.append((name, time.perf_counter() - start["backward"])))
    # the way bpsctl's and Horovod's DistributedOptimizer rebuild the optimizer
    plain = ReplayOptimizer(model.parameters(), step_s=model.schedule.optimizer_s)
    optimizer = type("SGD", (ReplayOptimizer,), {})(plain.param_groups)
    began = time.perf_counter()
    loss = F.cross_entropy(model(torch.zeros(2, 1)), torch.zeros(2, dtype=torch.long))
    start["backward"] = time.perf_counter()
    assert start["backward"] - began >= 0.05
    loss.backward()
    backward_s = time.perf_counter() - start["backward"]
    optimizer.step()
    assert time.perf_counter() - start["backward"] - backward_s >= 0.04
    assert [name for name, _ in fired] == ["head.bias", "head.weight", "layer.0.bias",
                                           "layer.0.weight"]
    for (name, at), recorded in zip(fired, (0.02, 0.03, 0.09, 0.12), strict=True):
        assert recorded <= at < recorded + 0.25, (name, at)
    assert backward_s >= 0.15
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.shape == param.shape, name
        assert torch.all(param.grad == GRADIENT_VALUE)


def test_the_forward_pass_is_split_over_the_layers_as_their_backward_time_is():
    """A profile times the forward pass whole; each parameter gets the share its gap in
    backward has (a bias ready with its weight: none), summing to the forward pass."""
    from bpsctl.bench.profile import forward_shares
    # ready order: head.bias 10 ms, head.weight with it, body.bias 40, body.weight 70
    profile = _profile([("body.weight", (8,), 0.07), ("body.bias", (8,), 0.04),
                        ("head.weight", (8,), 0.01), ("head.bias", (8,), 0.01)],
                       forward_s=0.035, backward_s=0.08)
    shares = replay_schedule(profile, dilation=2.0).forward_shares
    # gaps 30, 30, 0 and 10 ms of 70: the dilated 70 ms of forward alike
    assert shares == pytest.approx((0.030, 0.030, 0.0, 0.010))
    assert sum(shares) == pytest.approx(2 * profile.forward_s)
    assert forward_shares(((0, 0.0), (1, 0.0)), 0.01) == (0.005, 0.005)
    assert forward_shares((), 0.01) == ()


def test_the_stand_in_runs_each_layers_forward_after_its_pre_hook_as_a_cross_barrier_waits():
    """The stand-in's forward pass calls every module that owns parameters, in the profile's
    order, each taking its share of the recorded forward time: a forward pre-hook (where a
    CrossBarrier waits for the layer's update) runs where the recorded pass reached the
    layer, and its wait adds to the pass instead of eating into the layers after it. Under a
    CrossBarrier the optimizer steps one parameter at a time, each its share by size."""
    profile = _profile([("body.weight", (300,), 0.07), ("body.bias", (100,), 0.04),
                        ("head.weight", (50,), 0.01), ("head.bias", (50,), 0.01)],
                       forward_s=0.06, backward_s=0.08, optimizer_s=0.05)
    model = ReplayModel(profile, busy=False)
    reached: list[tuple[str, float]] = []
    began = {"at": 0.0}

    def pre_hook(name: str, wait_s: float):
        def hook(module: torch.nn.Module, args: object) -> None:
            reached.append((name, time.perf_counter() - began["at"]))
            time.sleep(wait_s)
        return hook

    model.body.register_forward_pre_hook(pre_hook("body", 0.0))
    model.head.register_forward_pre_hook(pre_hook("head", 0.05))    # an update still due
    began["at"] = time.perf_counter()
    model(torch.zeros(2, 1))
    took = time.perf_counter() - began["at"]
    # body: 60 of the 70 ms of backward gaps, head 10: 51.4 and 8.6 ms of the 60 of forward
    assert [name for name, _ in reached] == ["body", "head"]
    assert reached[0][1] < 0.02
    assert 0.0514 <= reached[1][1] < 0.0514 + 0.03
    assert 0.06 + 0.05 <= took < 0.06 + 0.05 + 0.04
    # the whole step, and one parameter's (a CrossBarrier's view of the optimizer)
    optimizer = ReplayOptimizer(model.parameters(), step_s=model.schedule.optimizer_s)
    rebuilt = type("SGD", (ReplayOptimizer,), {})(optimizer.param_groups)
    view = object.__new__(type(rebuilt))
    view.__dict__.update(rebuilt.__dict__)
    view.param_groups = [{**{k: v for k, v in rebuilt.param_groups[0].items() if k != "params"},
                          "params": [model.body.weight]}]
    for opt, expected in ((rebuilt, 0.05), (view, 0.05 * 300 / 500)):
        started = time.perf_counter()
        opt.step()
        assert expected <= time.perf_counter() - started < expected + 0.03


def test_the_stand_in_rewrites_the_same_gradient_memory_every_step():
    """Each step's gradients are written into the memory of the step before, as a GPU's
    caching allocator reuses its own: no new pages for the kernel to map and zero (a 64 MB
    gradient made fresh each step costs 16,384 page faults), which a replay's dilated CPU
    (--target-cpu) would pay for. Whatever a system wrote into a gradient is written over;
    gradients accumulated over two backward passes add up as autograd's do."""
    import resource
    profile = _profile([("big.weight", (4096, 4096), 0.002), ("big.bias", (4096,), 0.001)],
                       forward_s=0.0, backward_s=0.003, optimizer_s=0.0)
    model = ReplayModel(profile, busy=False)

    def average(param: torch.Tensor) -> None:    # a system's result, written over it
        param.grad.mul_(3.0)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(average)
    optimizer = ReplayOptimizer(model.parameters())

    def step(set_to_none: bool = True) -> tuple[list[int], int]:
        optimizer.zero_grad(set_to_none=set_to_none)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(torch.zeros(2, 1)).sum().backward()
        return ([p.grad.data_ptr() for p in model.parameters()],
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    first, _ = step()
    second, faults = step()
    assert second == first
    assert faults < 1000, faults
    for param in model.parameters():
        assert torch.all(param.grad == 3 * GRADIENT_VALUE)
    step(set_to_none=False)             # zeroed in place, then written
    assert all(torch.all(p.grad == 3 * GRADIENT_VALUE) for p in model.parameters())
    model(torch.zeros(2, 1)).sum().backward()       # a second pass adds to the first
    assert all(torch.all(p.grad == 3 * (3 + 1) * GRADIENT_VALUE) for p in model.parameters())


def test_a_cpus_profile_in_its_own_time_is_replayed_on_the_cpu_and_hooks_add_to_it():
    """A CPU's profile at dilation 1 computes through its gaps: the recorded seconds are
    spent on this thread's CPU (so a worker that loses its core is set back, as real compute
    is), and what a hook spends on that thread adds to the step instead of counting as
    compute. Dilated, or a GPU's profile, it sleeps."""
    profile = _profile([("a.weight", (256, 256), 0.06), ("a.bias", (256,), 0.03)],
                       forward_s=0.04, backward_s=0.08, optimizer_s=0.02)
    assert replays_busy(profile, 1.0)
    assert not replays_busy(profile, 25.0)
    assert not replays_busy(dataclasses.replace(profile, device="cuda"), 1.0)

    def step(model: ReplayModel, hook_s: float) -> tuple[float, float]:
        def hook(_: torch.Tensor) -> None:      # a hook's own work on the backward's thread
            end = time.thread_time() + hook_s
            while time.thread_time() < end:
                pass
        handle = model.a.bias.register_post_accumulate_grad_hook(hook)
        optimizer = ReplayOptimizer(model.parameters(), step_s=model.schedule.optimizer_s,
                                    busy=model.busy)
        cpu, wall = time.thread_time(), time.perf_counter()
        F.cross_entropy(model(torch.zeros(2, 1)), torch.zeros(2, dtype=torch.long)).backward()
        optimizer.step()
        handle.remove()
        return time.thread_time() - cpu, time.perf_counter() - wall

    busy = ReplayModel(profile)
    assert busy.busy
    cpu, wall = step(busy, hook_s=0.05)
    # forward 0.04 + backward 0.08 + optimizer 0.02 of compute, and the hook's 0.05 beside it
    assert cpu >= 0.14 + 0.05, (cpu, wall)
    asleep = ReplayModel(profile, dilation=2.0)
    cpu, wall = step(asleep, hook_s=0.0)
    assert not asleep.busy and wall >= 2 * 0.14 * 0.99 and cpu < 0.5 * wall


def test_the_step_model_overlaps_backward_with_the_transfer_of_what_is_ready():
    # two gradients of 1 MiB each, ready 10 and 20 ms into a 30 ms backward
    mib = (1 << 18,)                                   # float32: 1 MiB
    profile = _profile([("a", mib, 0.020), ("b", mib, 0.010)], forward_s=0.005,
                       backward_s=0.030, optimizer_s=0.002)
    assert transfer_groups(profile, "bpsctl") == [(0.010, 0.5), (0.020, 0.5)]
    # no network: the recorded step
    assert predicted_step_s(profile, "bpsctl", None) == pytest.approx(profile.total_s)
    # a step's bytes in 40 ms: b goes 10-30 ms, a 30-50 ms, the optimizer after that
    assert predicted_step_s(profile, "bpsctl", 0.040) == pytest.approx(0.005 + 0.050 + 0.002)
    # a fast network hides under backward entirely
    assert predicted_step_s(profile, "horovod", 0.010) == pytest.approx(profile.total_s)
    # DDP: a bucket leaves once its last gradient is ready; the first bucket is 1 MiB, so
    # b (registered last, bucketed first) goes alone at 10 ms, then a at 20 ms
    assert transfer_groups(profile, "ddp") == [(0.010, 0.5), (0.020, 0.5)]
    small = _profile([(f"p{i}", (1024,), 0.001 * (10 - i)) for i in range(10)])
    assert transfer_groups(small, "ddp") == [(0.010, 1.0)]       # 40 KiB: one bucket
    assert transfer_groups(small, "bpsctl")[0] == (0.001, 0.1)    # each as it is ready


def test_the_step_model_of_a_cross_barrier_runs_the_next_forward_pass_under_the_transfer():
    """With the cross barrier the next forward pass starts when backward ends: a
    network-bound step is the transfer (and the servers' rounds), then the optimizer step;
    a compute-bound one the recorded step."""
    mib = (1 << 18,)
    profile = _profile([("a", mib, 0.020), ("b", mib, 0.010)], forward_s=0.005,
                       backward_s=0.030, optimizer_s=0.002)
    barrier = predicted_step_s(profile, "bpsctl", 0.040, 0.004)
    crossed = predicted_step_s(profile, "bpsctl", 0.040, 0.004, cross_barrier=True)
    assert barrier == pytest.approx(0.005 + 0.054 + 0.002)
    assert crossed == pytest.approx(0.054 + 0.002)
    assert predicted_step_s(profile, "bpsctl", 0.001, cross_barrier=True) == \
        pytest.approx(profile.total_s)


def test_a_step_through_servers_waits_for_the_first_and_the_last_rounds():
    """The servers' rounds in the step model: the first sums come back after max(servers,
    workers) pieces' time on a NIC, the last reaches the workers a piece each through its
    server's NIC; a step through servers is that much longer once the network binds, and not
    when backward hides the transfer."""
    from bpsctl.bench.training import largest_piece_bytes
    mib = 1 << 20
    # 16 + 16 hosts, 1 MiB pieces at 25 Gbit: 32 pieces of 0.34 ms
    assert round_latency_s(mib, 16, 16, 25_000) == pytest.approx(32 * 8 * mib / 25e9)
    assert round_latency_s(mib, 8, 16, 25_000) == pytest.approx(24 * 8 * mib / 25e9)
    assert round_latency_s(mib, 16, 8, 25_000) == round_latency_s(mib, 16, 16, 25_000)
    assert round_latency_s(mib, 2, 2, 25_000) < round_latency_s(mib, 16, 16, 25_000) / 7
    profile = _profile([("a", (1 << 18,), 0.020), ("b", (1 << 18,), 0.010)], forward_s=0.005,
                       backward_s=0.030, optimizer_s=0.002)
    assert predicted_step_s(profile, "bpsctl", 0.040, 0.004) == \
        pytest.approx(0.005 + 0.054 + 0.002)
    assert predicted_step_s(profile, "bpsctl", 0.001, 0.004) == pytest.approx(profile.total_s)
    assert predicted_step_s(profile, "bpsctl", None, 0.004) == pytest.approx(profile.total_s)
    # the pieces the engine cuts: a 32 MiB tensor into 1 MiB ones for 16 servers (each gets
    # BPSCTL_PARTITION_DEPTH of them, not under 1 MiB), 2 MiB ones (the largest) for one
    big = [torch.nn.Parameter(torch.zeros(8 * mib)), torch.nn.Parameter(torch.zeros(4))]
    assert largest_piece_bytes(big, Config(), 16) == mib
    assert largest_piece_bytes(big, Config(), 1) == 2 * mib
    assert largest_piece_bytes(big, Config(partition_depth=0), 16) == 2 * mib


def test_a_sweep_point_has_a_server_per_worker_host_unless_told_and_colocated_adds_them():
    dedicated, colocated = Config(), Config(colocated_servers=True)
    assert [sweep_servers(dedicated, None, n) for n in (1, 4)] == [1, 4]
    assert [sweep_servers(dedicated, 2, n) for n in (1, 4)] == [2, 2]
    assert [sweep_servers(colocated, None, 4), sweep_servers(colocated, 2, 4)] == [4, 6]


def test_a_sweep_prints_each_worker_count_with_the_step_models_error_in_80_columns():
    points = []
    for workers, speedup in ((1, 1.0), (2, 1.3)):
        point = train_report({"ddp": speedup}, nic=1000)
        point["workers"], point["servers"] = workers, workers
        point["results"].append({**point["results"][0], "system": "plain", "workers": 1})
        for row in point["results"]:
            row.update(scaling_efficiency=0.9, model_step_s=0.05, model_error=0.12)
        point["replay"] = {"profile": "h200-resnet50", "source": "recorded", "dilation": 1.0,
                           "label": "replayed from h200-resnet50, in real time"}
        points.append(point)
    report = {"kind": "train_sweep", "model": "resnet50", "nic_mbit": 1000,
              "worker_counts": [1, 2], "points": points}
    text = render(print_train_sweep, report)
    assert_table_fits_80(text, rows=5)      # bpsctl, ddp, plain at 1; bpsctl, ddp at 2
    said = sentence(text)
    assert "replayed from h200-resnet50, in real time" in said
    assert "servers: 1 at 1, 2 at 2" in said and "+12%" in text
    assert "bpsctl 1.30x" in text
    # a row well above the model is named, with what the model leaves out
    assert "more than the network explains" not in said
    points[1]["results"][0]["model_error"] = 0.35
    said = sentence(render(print_train_sweep, report))
    assert ("more than the network explains: bpsctl at 2 (+35%); the step model leaves out "
            "the CPU time of each system's own workers and servers (here every emulated host "
            "shares this machine's CPU cores), each message's latency") in said
    assert "BPSCTL_CREDIT_BYTES" not in said             # no row went through servers
    points[1]["results"][0]["gradient_path"] = "servers"
    said = sentence(render(print_train_sweep, report))
    assert ("each message's latency, and, through servers, a credit (BPSCTL_CREDIT_BYTES) too "
            "small to keep the NICs busy or so large that the workers' flows drift apart (with "
            "many servers try --partition-bytes 256k --credit-bytes 8m, though a replay does not "
            "dilate what 4x as many messages cost the CPUs), servers given up to a "
            "partition more than their share, or the cost of many small partitions") in said


# --------------------------------------------------------------------------- the benchmark

def test_a_replayed_report_says_whose_time_its_figures_are_in():
    report = train_report({"horovod": 1.2, "ddp": 1.1}, nic=500)
    report["replay"] = {"profile": "h200-vgg16", "source": "derived",
                        "derived_from": "cpu-vgg16", "dilation": 50.0,
                        "target_nic_mbit": 25_000, "emulated_nic_mbit": 500,
                        "label": replay_label("h200-vgg16", 50, 25_000, 500)}
    text = render(print_train, report)
    assert_table_fits_80(text, rows=3)
    said = sentence(text)
    assert ("replayed from h200-vgg16, x50 dilation: 25 Gbit emulated at 500 Mbit (a derived "
            "profile: cpu-vgg16's fractions, not a recording); img/sec and s/step are given in "
            "the 25 Gbit cluster's time") in said
    assert "through emulated 500 Mbit/s NICs standing for 25000 Mbit/s ones" in said
    assert "fell behind" not in said
    # one worker alone well slower than the profile: the replay says it could not keep up
    report["results"].append({**report["results"][0], "system": "plain", "workers": 1,
                              "step_seconds": 0.0612})
    report["replay"]["profile_step_s"] = 0.0474
    said = sentence(render(print_train, report))
    assert ("The replay fell behind its profile: one worker alone took 61.2 ms a step against "
            "the recorded 47.4 ms") in said and "dilate more" in said


@pytest.mark.parametrize("args, expected", [
    (["resnet50", "--replay", "nosuch"], "neither a file nor a shipped profile"),
    (["vgg16", "--replay", "cpu-resnet50"], "a profile of resnet50, not vgg16"),
    (["resnet50", "--replay", "h200-resnet50", "--batch-size", "8"], "recorded at batch 64"),
    (["resnet50", "--replay", "h200-resnet50", "--target-nic", "25gbit"],
     "--target-nic: the replay is dilated"),
    (["resnet50", "--target-nic", "25gbit"], "--target-nic: only a replay"),
    (["resnet50", "--replay", "h200-resnet50", "--target-nic", "fast"],
     "--target-nic: expected a rate"),
    (["resnet50", "--replay", "h200-resnet50", "--sweep", "workers=0,2"],
     "--sweep: expected workers="),
    (["resnet50", "--replay", "h200-resnet50", "--target-cpu", "6"],
     "--target-cpu: the cores a replayed GPU host's communication has, dilated with its time "
     "on emulated hosts; it needs --replay, --target-nic and --emulate"),
    (["resnet50", "--replay", "h200-resnet50", "--target-cpu", "6", "--compare", "ddp,horovod"],
     "--target-cpu with --compare horovod: Horovod waits for each result by waking every "
     "millisecond"),
], ids=["unknown", "model", "batch", "no-nic", "no-replay", "rate", "sweep",
        "target-cpu", "target-cpu-horovod"])
def test_bad_replay_flags_exit_2_naming_the_flag_before_anything_starts(tmp_path, args,
                                                                      expected):
    result = _invoke(["bench", *args], tmp_path)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


@pytest.mark.parametrize("args, expected", [
    (["--replay", "h200-resnet50", "--target-cpu", "6"],
     "--target-cpu: the cores a replayed GPU host's communication has, dilated with its time "
     "on emulated hosts; it needs --replay, --target-nic and --emulate"),
    (["--replay", "h200-resnet50", "--emulate", "--nic", "200mbit", "--target-nic", "25gbit",
      "--target-cpu", "1"],
     "--target-cpu 1: at x125 dilation each worker host would get 0.008 of a CPU"),
], ids=["alone", "too-little"])
def test_tune_refuses_a_target_cpu_it_cannot_dilate_before_anything_starts(tmp_path, args,
                                                                          expected):
    result = _invoke(["tune", "--model", "resnet50", "--credit", *args], tmp_path)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def _bpsctl(args: list[str], state_dir, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout_s, check=False)


@pytest.mark.timeout(240)
def test_a_dilated_replay_against_the_baselines_on_emulated_hosts(tmp_path):
    """The H200's ResNet50 replayed by 2 emulated hosts at 1 Gbit standing for 25 Gbit:
    every system trains the stand-in through its own hooks, the figures are given in the
    25 Gbit cluster's time and say so, and one worker alone keeps the recorded pace."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    compare = "horovod,ddp" if horovod_mod.installed_version() else "ddp"
    out = tmp_path / "replay.json"
    result = _bpsctl(["bench", "resnet50", "--replay", "h200-resnet50", "--workers", "2",
                      "--servers", "2", "--emulate", "--nic", "1gbit", "--target-nic",
                      "25gbit", "--warmup", "1", "--iters", "2", "--compare", compare,
                      "--json", str(out)], tmp_path / "state", 220)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    replay = report["replay"]
    assert (replay["profile"], replay["source"], replay["dilation"]) == \
        ("h200-resnet50", "derived", 25)
    assert (replay["target_nic_mbit"], replay["emulated_nic_mbit"]) == (25_000, 1000)
    assert replay["target_cpu"] is None and "host_cpu" not in report
    assert (report["batch_size"], report["image_size"], report["gradient_tensors"]) == \
        (64, 224, 161)
    assert [row["system"] for row in report["results"]] == ["bpsctl", *compare.split(","),
                                                            "plain"]
    profile = load("h200-resnet50")
    for row in report["results"]:
        assert row["img_per_sec"] == pytest.approx(25 * row["emulated"]["img_per_sec"])
        assert row["step_seconds"] == pytest.approx(row["emulated"]["step_seconds"] / 25)
        # no system beats the recorded step: communication only adds to it
        assert row["step_seconds"] > 0.95 * profile.total_s, row["system"]
    plain = report["results"][-1]
    assert plain["step_seconds"] < 1.5 * profile.total_s
    # the step model beside each row: one worker alone is the recorded step
    for row in report["results"]:
        assert row["model_step_s"] >= profile.total_s * 0.999, row["system"]
        assert row["model_error"] == pytest.approx(row["step_seconds"] / row["model_step_s"] - 1)
    assert plain["model_step_s"] == pytest.approx(profile.total_s)
    said = sentence(result.stderr)
    assert "replayed from h200-resnet50, x25 dilation: 25 Gbit emulated at 1 Gbit" in said
    assert "in the 25 Gbit cluster's time" in said
    assert_table_fits_80(result.stderr, rows=len(report["results"]))
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers


def test_recording_on_a_gpu_times_every_parameter_with_cuda_events():
    """`bpsctl profile --device cuda`: the hooks record CUDA events, read after the step's
    synchronize; every gradient is ready within backward, the classifier's first."""
    from bpsctl.bench.profile import record
    profile = record("resnet50", "cuda", batch_size=8, image_size=64, steps=2, warmup=1)
    assert profile.device == "cuda" and profile.device_name == torch.cuda.get_device_name()
    assert all(0 < p.ready_s <= profile.backward_s for p in profile.parameters)
    assert min(profile.parameters, key=lambda p: p.ready_s).name.startswith("fc.")
    assert profile.forward_s > 0 and profile.optimizer_s > 0


@pytest.mark.timeout(180)
def test_a_replay_with_a_target_cpu_runs_its_worker_hosts_at_the_dilated_share(tmp_path):
    """`--target-cpu 25` at x25 (1 Gbit for 25 Gbit): every emulated worker host's processes
    run in a cgroup of one CPU, the job trains, and the report says so where it says whose
    time its figures are in."""
    small = tmp_path / "small.json"
    _profile([(f"layer{i}.weight", (64, 64), 0.002 * (4 - i)) for i in range(4)],
             forward_s=0.004, backward_s=0.010, optimizer_s=0.001).write(small)
    out = tmp_path / "cpu.json"
    result = _bpsctl(["bench", "resnet50", "--replay", str(small), "--emulate", "--workers", "2",
                      "--servers", "1", "--nic", "1gbit", "--target-nic", "25gbit",
                      "--target-cpu", "25", "--warmup", "1", "--iters", "2", "--json", str(out)],
                     tmp_path / "state", 160)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["replay"]["target_cpu"], report["replay"]["host_cpu"]) == (25, 1)
    assert report["host_cpu"] == 1
    said = sentence(result.stderr)
    assert "NIC 1000 Mbit/s, every worker host at 1 CPU" in said
    assert "x25 dilation: 25 Gbit emulated at 1 Gbit, 25 cores a worker host at 1 of a CPU" \
        in said


@pytest.mark.timeout(240)
def test_a_replay_sweep_runs_every_system_at_each_worker_count(tmp_path):
    """`--sweep workers=1,2` on the embedded default: a cluster per count, every system on
    each, img/sec per worker, the scaling and the step model's prediction in every row (the
    baselines' rows are the emulated replay's test's, above)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    small = tmp_path / "small.json"
    _profile([(f"layer{i}.weight", (64, 64), 0.002 * (4 - i)) for i in range(4)],
             forward_s=0.004, backward_s=0.010, optimizer_s=0.001).write(small)
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    result = _bpsctl(["bench", "resnet50", "--replay", str(small), "--sweep", "workers=1,2",
                      "--warmup", "1", "--iters", "2", "--json", str(out), "--plot", str(plot)],
                     tmp_path / "state", 220)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "train_sweep" and report["worker_counts"] == [1, 2]
    assert [(p["workers"], p["servers"]) for p in report["points"]] == [(1, 1), (2, 2)]
    for point in report["points"]:
        assert [row["system"] for row in point["results"]] == ["bpsctl", "plain"]
        for row in point["results"]:
            assert row["img_per_sec_per_worker"] > 0 and row["scaling_efficiency"] > 0
            assert row["model_step_s"] > 0 and "model_error" in row
    assert plot.stat().st_size > 0
    text = " ".join(result.stderr.split())
    assert "bench resnet50 --sweep on CPU: loopback" in text and "servers: 1 at 1, 2 at 2" in text
    assert_table_fits_80(result.stderr, rows=3)     # bpsctl and plain at 1; bpsctl at 2
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers


@pytest.mark.timeout(180)
def test_a_replay_trains_bpsctl_with_the_cross_barrier(tmp_path):
    """`--replay --cross-barrier` on the embedded default: bpsctl's row trains the stand-in
    with CrossBarrier (each layer's forward pass waits for its update of the step before),
    and the step model's line says it counts the next forward pass under the transfer."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    small = tmp_path / "small.json"
    _profile([(f"layer{i}.weight", (64, 64), 0.002 * (4 - i)) for i in range(4)],
             forward_s=0.004, backward_s=0.010, optimizer_s=0.001).write(small)
    out = tmp_path / "cross.json"
    result = _bpsctl(["bench", "resnet50", "--replay", str(small), "--workers", "2",
                      "--servers", "1", "--cross-barrier", "--warmup", "1", "--iters", "2",
                      "--json", str(out)], tmp_path / "state", 160)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cross_barrier"] is True
    row, plain = report["results"]
    assert row["system"] == "bpsctl" and row["version"].endswith("CrossBarrier")
    assert plain["system"] == "plain"
    assert row["img_per_sec"] > 0 and row["model_step_s"] > 0
    assert "with the cross barrier, bpsctl's next forward pass too" in sentence(result.stderr)
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before
