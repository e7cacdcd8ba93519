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
from bpsctl.bench.api import GOODPUT_SHARE, host_streams, ideal_step_seconds
from bpsctl.bench.common import dilated_horovod_cycle, horovod_env
from bpsctl.bench.models import build
from bpsctl.config import Config

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


#: a NIC whose TCP goodput is exactly 1e9 bytes/s each way, so that ideal times read as GB
NIC_1GB_S = 8000 / GOODPUT_SHARE
GB = 10**9


@pytest.mark.parametrize("host_workers, servers, streams, seconds", [
    ([1, 1, 1, 1], 2, None, 2.0),       # servers' NICs: 4 hosts' G over 2 servers
    ([1, 1, 1, 1], 4, None, 1.0),       # balanced: every NIC carries G
    ([1, 1, 1, 1], 8, None, 1.0),       # more servers than hosts: the worker NIC sets it
    ([2, 2], 1, [1, 1], 2.0),           # intra-node stage: each host pushes G once
    ([2, 2], 1, [2, 2], 4.0),           # without it each worker does: 4 G into one server
    ([2, 2], 4, [2, 2], 2.0),           # ... and a host's NIC carries 2 G
    ([3, 1], 4, [3, 1], 3.0),           # uneven hosts: the busiest host NIC
])
def test_ps_ideal_step_is_the_busiest_nics_bytes_over_its_goodput(host_workers, servers,
                                                                 streams, seconds):
    assert ideal_step_seconds("bpsctl", GB, host_workers, servers, NIC_1GB_S, streams) == \
        pytest.approx(seconds)


@pytest.mark.parametrize("host_workers, seconds", [
    ([1, 1], 1.0), ([1, 1, 1, 1], 1.5), ([1] * 8, 1.75),
    ([4, 4], 1.0),                      # n counts hosts: the least any allreduce sends between them
])
def test_ring_ideal_step_is_2_n_minus_1_over_n_of_the_gradient(host_workers, seconds):
    for system in ("ddp", "horovod"):
        assert ideal_step_seconds(system, GB, host_workers, 2, NIC_1GB_S) == \
            pytest.approx(seconds)


def test_no_ideal_without_a_nic_rate_or_a_byte_on_the_wire():
    assert ideal_step_seconds("bpsctl", GB, [1, 1], 2, None) is None
    assert ideal_step_seconds("ddp", GB, [1, 1], 2, None) is None
    assert ideal_step_seconds("ddp-powersgd", GB, [1, 1], 2, NIC_1GB_S) is None
    assert ideal_step_seconds("ddp", GB, [4], 2, NIC_1GB_S) is None          # one host
    assert ideal_step_seconds("bpsctl", GB, [4], 2, NIC_1GB_S, [0]) is None  # shared memory
    # a 1 Gbit/s NIC: 125 MB/s less TCP's share
    assert ideal_step_seconds("bpsctl", 125 * 10**6, [1, 1], 2, 1000) == \
        pytest.approx(1 / GOODPUT_SHARE)


def test_host_streams_follow_the_intra_node_stage():
    assert host_streams(Config(), [1, 1]) == [1, 1]
    assert host_streams(Config(), [2, 2]) == [1, 1]            # reduce-scatter first
    assert host_streams(Config(), [4]) == [0]                  # one host: shared memory only
    assert host_streams(Config(local_only="off"), [4]) == [1]
    assert host_streams(Config(local_shm=False), [4]) == [1]   # gloo stage, then the servers
    assert host_streams(Config(local_reduce="off"), [2, 2]) == [2, 2]
    assert host_streams(Config(staleness=1), [2, 2]) == [2, 2]  # every worker pushes its own
    assert host_streams(Config(), [3, 1]) == [3, 1]            # 3 does not divide 4 workers


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


def test_a_dilated_replay_gives_horovods_cycle_the_targets_length():
    """Horovod fuses what is ready once a cycle (1 ms by default): replayed x125 slower, a cycle
    must last 125 ms to be the target cluster's 1 ms; a cycle the user set is dilated alike."""
    assert dilated_horovod_cycle({}, 125) == {"HOROVOD_CYCLE_TIME": "125"}
    assert dilated_horovod_cycle({"HOROVOD_CYCLE_TIME": "3.5"}, 50) == \
        {"HOROVOD_CYCLE_TIME": "175"}
    assert dilated_horovod_cycle({"HOROVOD_CYCLE_TIME": "3.5"}, 1.0) == {}


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


@pytest.mark.parametrize("command", ["resnet50", "comm"])
def test_device_cuda_without_cuda_is_a_usage_error_naming_what_is_missing(tmp_path, command):
    result = _bpsctl(["bench", command, "--device", "cuda"], tmp_path / "state", 60)
    assert result.returncode == 2, result.stderr
    assert "--device cuda:" in result.stderr and "has no CUDA device" in result.stderr
    assert "CPU build" in result.stderr or "sees no CUDA device" in result.stderr


def test_unknown_baseline_is_a_usage_error(tmp_path):
    """In-process (typer's runner): a usage error starts nothing."""
    from typer.testing import CliRunner

    from bpsctl.cli import app
    result = CliRunner().invoke(app, ["bench", "vgg16", "--compare", "allreduce"],
                                env={"BPSCTL_STATE_DIR": str(tmp_path / "state"),
                                     "COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "horovod, ddp" in result.output


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
    assert systems == ["bpsctl", *compare.split(","), "plain"]
    assert report["device"] == "cpu" and "gpus" not in report
    for row in report["results"]:
        assert row["img_per_sec"] > 0 and row["img_per_sec_ci95"] >= 0
        assert len(row["img_secs_per_worker"]) == 2
        assert row["version"]
        assert row["scaling_efficiency"] == pytest.approx(
            row["img_per_sec_per_worker"] / report["results"][-1]["img_per_sec_per_worker"])
    plain = report["results"].pop()        # one worker alone: no NIC, no ideal, no speedup
    assert plain["workers"] == 1 and plain["ideal_step_s"] is None
    assert report["results"][0]["gradient_path"] == "servers"
    assert set(report["speedup"]) == set(compare.split(","))
    # the NIC-bound ideal step: 2 hosts of one worker and 2 servers, so bpsctl's busiest NIC
    # carries its wire bytes each way and the ring 2(2-1)/2 of the gradient
    assert report["worker_hosts"] == [1, 1]
    goodput_bytes_s = 1000e6 / 8 * GOODPUT_SHARE
    for row in report["results"]:
        step_bytes = report["wire_bytes_per_step" if row["system"] == "bpsctl"
                            else "gradient_bytes"]
        assert row["ideal_step_s"] == pytest.approx(step_bytes / goodput_bytes_s)
        assert row["nic_fraction"] == pytest.approx(row["ideal_step_s"] / row["step_seconds"])
    # rank 0's host NIC counted what really went through it: bpsctl pushes its gradient out and
    # pulls the sums back (plus headers, heartbeats, the ring's share for the baselines)
    for row in report["results"]:
        assert row["nic"] == "eth0"
        step_bytes = report["wire_bytes_per_step" if row["system"] == "bpsctl"
                            else "gradient_bytes"]
        for key in ("nic_tx_bytes_per_step", "nic_rx_bytes_per_step"):
            assert 0.95 * step_bytes < row[key] < 1.3 * step_bytes, (row["system"], key, row[key])
    assert "MB per step through rank 0's host NIC" in result.stderr
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
    assert order == ["bpsctl", "ddp", "plain", "ddp", "plain", "bpsctl"]
    report = json.loads(out.read_text())
    assert report["rounds"] == 2
    # --device auto on a machine without CUDA: the CPU, with its defaults
    assert report["device"] == "cpu" and report["image_size"] == 32
    assert report["results"][0]["gradient_path"] == "shm-local"     # 2 workers, one host
    plain = report["results"].pop()
    assert plain["system"] == "plain" and len(plain["img_secs_per_worker"]) == 4
    assert plain["scaling_efficiency"] == 1.0 and "plain" not in report["speedup"]
    for row in report["results"]:
        assert len(row["img_secs_per_worker"]) == 4                # 2 iterations x 2 rounds
        assert len(row["img_per_sec_by_round"]) == 2
        assert row["img_per_sec"] == pytest.approx(2 * sum(row["img_secs_per_worker"]) / 4)
    # no NIC rate on loopback: the keys are there, without an ideal
    assert report["worker_hosts"] == [2]
    assert all(row["ideal_step_s"] is None and row["nic_fraction"] is None
               for row in report["results"])
    assert not any("nic_tx_bytes_per_step" in row for row in report["results"])   # lo: all
    ours, theirs = (row["img_per_sec_by_round"] for row in report["results"])
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    assert report["speedup_by_round"]["ddp"] == pytest.approx(ratios)
    assert report["speedup"]["ddp"] == pytest.approx(sum(ratios) / 2)    # the median of two
    assert "round by round" in result.stderr
    # what the user sees: the records stay between the processes, the table fits 80 columns
    # with the speedup on one line, and a sentence says what it means
    assert "BPSCTL_RESULT" not in result.stdout + result.stderr
    assert_table_fits_80(result.stderr, rows=3)
    assert re.search(r"│ ddp .*│ bpsctl \d+\.\d\dx │", result.stderr), result.stderr
    assert "bench resnet50 on CPU:" in result.stderr and "scaling:" in result.stderr
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
