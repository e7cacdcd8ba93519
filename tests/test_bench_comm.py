"""`bpsctl bench comm` end to end on the embedded default, and its bad input."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from test_bench_output import assert_table_fits_80, sentence


def _bpsctl(args: list[str], state_dir, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout_s)


@pytest.mark.timeout(180)
def test_comm_bench_reports_design_keys_and_leaves_nothing(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "comm.json"
    result = _bpsctl(["bench", "comm", "--workers", "2", "--servers", "2", "--size", "2MiB",
                      "--tensors", "3", "--warmup", "1", "--repeats", "3", "--partition-bytes",
                      "256KiB", "--json", str(out)], tmp_path / "state")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["kind"] == "comm"
    assert (report["workers"], report["servers"]) == (2, 2)
    assert report["nic_mbit"] is None
    assert report["size_bytes"] == 2 * 1024 * 1024
    assert report["partition_bytes"] == 256 * 1024
    systems = {r["system"]: r for r in report["results"]}
    assert set(systems) == {"bpsctl", "zmq_raw"}
    ours = systems["bpsctl"]
    assert len(ours["seconds_all"]) == 3
    assert ours["seconds"] > 0
    assert ours["algbw_MBps"] == pytest.approx(report["size_bytes"] / ours["seconds"] / 1e6)
    assert ours["busbw_MBps"] == pytest.approx(ours["algbw_MBps"])   # 2(n-1)/n = 1 at n = 2
    assert ours["nic_fraction"] is None
    assert 0 < report["fraction_of_raw"] == pytest.approx(
        ours["algbw_MBps"] / systems["zmq_raw"]["algbw_MBps"])
    assert "bpsctl" in result.stderr and "zmq_raw" in result.stderr   # the table
    assert result.stdout == ""                                        # JSON went to the file
    assert "BPSCTL_RESULT" not in result.stderr
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers


@pytest.mark.timeout(180)
def test_comm_bench_against_allreduce_shows_a_table_and_what_it_means(tmp_path):
    """What a user sees at 80 columns: the table whole, one sentence under it, and none of the
    workers' result records."""
    result = _bpsctl(["bench", "comm", "--workers", "2", "--servers", "2", "--size", "1MiB",
                      "--tensors", "2", "--warmup", "1", "--repeats", "2", "--compare",
                      "allreduce"], tmp_path / "state")
    assert result.returncode == 0, result.stderr
    assert "BPSCTL_RESULT" not in result.stdout + result.stderr
    assert_table_fits_80(result.stderr, rows=3)                    # bpsctl, allreduce, zmq_raw
    assert re.search(r"│ allreduce .*│ bpsctl \d+\.\d\dx │", result.stderr), result.stderr
    said = sentence(result.stderr)
    assert re.search(r"bpsctl's push_pull of 1\.0 MiB with 2 workers was (faster than|slower "
                     r"than|as fast as) ring allreduce \(\d+\.\d\d×; theory 2\(n-1\)/n = 1\.00×\) "
                     r"on loopback, where there is no network bottleneck", said), said


@pytest.mark.timeout(120)
def test_comm_bench_json_to_stdout_is_only_json(tmp_path):
    result = _bpsctl(["bench", "comm", "--workers", "1", "--size", "64KiB", "--tensors", "2",
                      "--warmup", "0", "--repeats", "2", "--no-raw", "--json", "-"],
                     tmp_path / "state")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["system"] for r in report["results"]] == ["bpsctl"]
    assert "fraction_of_raw" not in report


@pytest.mark.parametrize("args, flag", [
    (["--size", "lots"], "--size"),
    (["--partition-bytes", "4QB"], "--partition-bytes"),
    (["--workers", "0"], "--workers"),
    (["--tensors", "abc"], "--tensors"),
    (["--bogus"], "--bogus"),
])
@pytest.mark.timeout(60)
def test_comm_bench_bad_flags_exit_2_naming_the_flag(tmp_path, args, flag):
    result = _bpsctl(["bench", "comm", *args], tmp_path / "state")
    assert result.returncode == 2
    assert flag in result.stderr


@pytest.mark.timeout(150)
def test_a_lost_server_fails_the_bench_and_its_logs_are_kept(tmp_path):
    """kill -9 a server of the bench's private cluster mid-run: the bench exits 1 naming the
    lost server, and says where a copy of the cluster's logs is (its state dir is gone)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    env = {**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state")}
    bench = subprocess.Popen([sys.executable, "-m", "bpsctl.cli", "bench", "comm", "--workers", "2",
                              "--servers", "2", "--size", "16MiB", "--repeats", "2000"],
                             env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            family = psutil.Process(bench.pid).children(recursive=True)
            servers = [p for p in family if "bpsctl.engine.server" in " ".join(p.cmdline())]
            timing = any("bpsctl.bench.comm" in " ".join(p.cmdline()) for p in family)
            if timing and len(servers) == 2:
                time.sleep(3)                       # well into the timed rounds
                victim = servers[1]
            time.sleep(0.2)
        assert victim is not None, "the bench never started its workers"
        victim.send_signal(signal.SIGKILL)
        _, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 1, stderr[-2000:]
    assert "lost server" in stderr
    found = re.search(r"logs at that moment: (\S+)", stderr.replace("\n", ""))
    assert found, stderr[-2000:]
    kept = found.group(1)
    try:
        names = sorted(os.listdir(kept))
        assert "scheduler-0.log" in names
        assert len([n for n in names if n.startswith("server-")]) == 2
        assert "started: 2 workers, 2 servers" in open(os.path.join(kept, "scheduler-0.log")).read()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers
