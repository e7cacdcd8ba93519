"""`bpsctl bench vgg16|resnet50`: the models' shapes, the whole benchmark on emulated hosts at
tiny scale against DDP (and Horovod when it is installed), and a missing baseline."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import psutil
import pytest
from test_bench_output import assert_table_fits_80, sentence

from bpsctl.bench import horovod as horovod_mod
from bpsctl.bench.models import build
from bpsctl.bench.train import horovod_env

HOROVOD = horovod_mod.installed_version()


def _bpsctl(args: list[str], state_dir, timeout_s: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout_s, check=False)


@pytest.mark.parametrize("name, parameters, tensors", [("vgg16", 138_357_544, 32),
                                                       ("resnet50", 25_557_032, 161)])
def test_models_have_torchvisions_parameter_shapes(name, parameters, tensors):
    params = list(build(name).parameters())
    assert sum(p.numel() for p in params) == parameters
    assert len(params) == tensors


def test_horovod_env_follows_horovodruns_gloo_launcher():
    hosts = [("10.77.0.1", 2), ("10.77.0.2", 1)]
    env = horovod_env(2, hosts, "10.77.0.1", 1234, "eth0", 30)
    assert env["HOROVOD_HOSTNAME"] == "10.77.0.2"
    assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"]) == ("2", "3")
    assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == ("0", "1")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("1", "2")
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert env["HOROVOD_GLOO_IFACE"] == "eth0"
    second_slot = horovod_env(1, hosts, "10.77.0.1", 1234, "eth0", 30)
    assert (second_slot["HOROVOD_CROSS_RANK"], second_slot["HOROVOD_CROSS_SIZE"]) == ("0", "1")


def test_patch_raises_the_cxx_standard(tmp_path):
    (tmp_path / "horovod" / "torch").mkdir(parents=True)
    for relative in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        (tmp_path / relative).write_text("x\nset(CMAKE_CXX_STANDARD 14)\ny\n")
    assert len(horovod_mod.patch_cxx_standard(tmp_path)) == 2
    assert "set(CMAKE_CXX_STANDARD 17)" in (tmp_path / "CMakeLists.txt").read_text()
    assert horovod_mod.patch_cxx_standard(tmp_path) == []


def test_missing_horovod_says_how_to_install_and_exits_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from bpsctl.cli import app
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(horovod_mod, "installed_version", lambda *a, **k: None)
    result = CliRunner().invoke(app, ["bench", "resnet50", "--compare", "horovod,ddp"])
    assert result.exit_code == 2, result.output
    assert "bpsctl install horovod" in result.output
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_unknown_baseline_is_a_usage_error(tmp_path):
    result = _bpsctl(["bench", "vgg16", "--compare", "allreduce"], tmp_path / "state", 60)
    assert result.returncode == 2
    assert "horovod, ddp" in result.stderr


@pytest.mark.timeout(170)
def test_train_bench_on_emulated_hosts_against_the_baselines(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    compare = "horovod,ddp" if HOROVOD else "ddp"
    out, plot = tmp_path / "train.json", tmp_path / "train.png"
    result = _bpsctl(["bench", "resnet50", "--workers", "2", "--servers", "2", "--emulate",
                      "--nic", "1gbit", "--batch-size", "2", "--image-size", "32",
                      "--warmup", "1", "--iters", "2", "--compare", compare,
                      "--json", str(out), "--plot", str(plot)], tmp_path / "state")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "train" and report["model"] == "resnet50"
    assert (report["workers"], report["servers"], report["batch_size"]) == (2, 2, 2)
    assert report["nic_mbit"] == 1000
    systems = [r["system"] for r in report["results"]]
    assert systems == ["bpsctl", *compare.split(",")]
    for row in report["results"]:
        assert row["img_per_sec"] > 0 and row["img_per_sec_ci95"] >= 0
        assert len(row["img_secs_per_worker"]) == 2
        assert row["version"]
    assert set(report["speedup"]) == set(compare.split(","))
    ours = report["results"][0]["img_per_sec"]
    for row in report["results"][1:]:
        assert report["speedup"][row["system"]] == pytest.approx(ours / row["img_per_sec"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "BPSCTL_RESULT" not in result.stdout + result.stderr
    assert_table_fits_80(result.stderr, rows=len(systems))
    said = sentence(result.stderr)
    assert re.search(r"bpsctl (was (faster|slower): it )?trained at \d+\.\d\d× "
                     r"(Horovod|DDP)'s speed", said), said
    assert "through emulated 1000 Mbit/s NICs" in said
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers


@pytest.mark.timeout(300)
def test_rounds_rotate_the_order_and_pair_the_ratios(tmp_path):
    """--rounds 2 on the embedded default: every system runs twice, the second round led by
    the baseline; the speedup is the median of the two rounds' own ratios."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "train.json"
    result = _bpsctl(["bench", "resnet50", "--workers", "2", "--servers", "1", "--batch-size", "2",
                      "--warmup", "1", "--iters", "2", "--rounds", "2", "--compare", "ddp",
                      "--json", str(out)], tmp_path / "state", 280)
    assert result.returncode == 0, result.stderr[-3000:]
    order = [line.split()[1] for line in result.stderr.splitlines()
             if line.startswith("[0] ") and " iter 1/2:" in line]
    assert order == ["bpsctl", "ddp", "ddp", "bpsctl"]
    report = json.loads(out.read_text())
    assert report["rounds"] == 2
    for row in report["results"]:
        assert len(row["img_secs_per_worker"]) == 4                # 2 iterations x 2 rounds
        assert len(row["img_per_sec_by_round"]) == 2
        assert row["img_per_sec"] == pytest.approx(2 * sum(row["img_secs_per_worker"]) / 4)
    ours, theirs = (row["img_per_sec_by_round"] for row in report["results"])
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    assert report["speedup_by_round"]["ddp"] == pytest.approx(ratios)
    assert report["speedup"]["ddp"] == pytest.approx(sum(ratios) / 2)    # the median of two
    assert "round by round" in result.stderr
    # what the user sees: the records stay between the processes, the table fits 80 columns
    # with the speedup on one line, and a sentence says what it means
    assert "BPSCTL_RESULT" not in result.stdout + result.stderr
    assert_table_fits_80(result.stderr, rows=2)
    assert re.search(r"│ ddp .*│ bpsctl \d+\.\d\dx │", result.stderr), result.stderr
    said = sentence(result.stderr)
    assert re.search(r"bpsctl (was (faster|slower): it )?trained at \d+\.\d\d× DDP's speed on "
                     r"loopback, where there is no network bottleneck", said), said
    assert "try --emulate --nic 1gbit or --hosts." in said
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers


@pytest.mark.timeout(300)
def test_async_training_reports_the_sum_of_each_workers_rate(tmp_path):
    """`bench resnet50 --async`: workers do not move in step, so the job's img/sec is the sum
    of each worker's own rate (not rank 0's times the workers), and each is reported."""
    out = tmp_path / "train.json"
    result = _bpsctl(["bench", "resnet50", "--async", "--workers", "2", "--servers", "1",
                      "--batch-size", "2", "--image-size", "32", "--warmup", "1", "--iters", "2",
                      "--json", str(out)], tmp_path / "state", 280)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(out.read_text())["results"][0]
    assert len(row["img_per_sec_by_rank"]) == 2 and min(row["img_per_sec_by_rank"]) > 0
    assert row["img_per_sec"] == pytest.approx(sum(row["img_per_sec_by_rank"]))
