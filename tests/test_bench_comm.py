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
    """In-process (typer's runner): a usage error starts nothing, so no process is needed."""
    from typer.testing import CliRunner

    from bpsctl.cli import app
    result = CliRunner().invoke(app, ["bench", "comm", *args],
                                env={"BPSCTL_STATE_DIR": str(tmp_path / "state"),
                                     "COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert flag in result.output


def _command_line(process: psutil.Process) -> str:
    """``process``'s command line, or "" if it exited since it was listed (a bench starts
    short-lived processes too)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


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
            servers = [p for p in family if "bpsctl.engine.server" in _command_line(p)]
            timing = any("bpsctl.bench.comm" in _command_line(p) for p in family)
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


# --------------------------------------------------------------------------- --op: collectives

OPS = ("allreduce", "allgather", "alltoall", "reducescatter")


def _collective(op, inputs, average):
    """What ``op`` gives each rank of ``inputs`` (one tensor per rank), by its definition."""
    import torch
    n = len(inputs)
    if op in ("allreduce", "push_pull"):
        total = sum(inputs)
        return [total / n if average else total for _ in inputs]
    if op == "allgather":
        return [torch.cat(inputs) for _ in inputs]
    blocks = [x.chunk(n) for x in inputs]
    if op == "alltoall":
        return [torch.cat([blocks[src][dst] for src in range(n)]) for dst in range(n)]
    total = sum(inputs)
    return [(total / n if average else total).chunk(n)[r] for r in range(n)]


@pytest.mark.parametrize("ranks", [1, 3])
def test_each_collectives_result_is_checked_against_what_each_rank_must_get(ranks):
    """`bench comm --op`'s check: every op's inputs, put through the op's definition, pass on
    every rank; what a wrong collective would give (the input back, blocks out of place, a
    sum for an average, a shape short) is refused naming the system, op, rank and element."""
    import torch

    from bpsctl.bench.collectives import bus_factor, check, element_counts, inputs
    counts = element_counts(1000, 2, ranks)
    assert all(c % ranks == 0 for c in counts) and 4 * sum(counts) <= 1000
    for op in ("push_pull", *OPS):
        for average in (False, True):
            given = [inputs(op, counts, rank, ranks) for rank in range(ranks)]
            per_tensor = [_collective(op, [g[i] for g in given], average)
                          for i in range(len(counts))]
            for rank in range(ranks):
                check(op, [results[rank] for results in per_tensor], counts, rank, ranks,
                      average)
    if ranks == 1:
        return
    rank = 1
    wrong = {
        "allreduce": inputs("allreduce", counts, rank, ranks),          # the input back
        "allgather": [torch.flip(t, [0]) for t in _collective(
            "allgather", [inputs("allgather", counts, r, ranks)[0] for r in range(ranks)],
            False)[:1]] + [torch.zeros(counts[1])],                     # blocks reversed
        "alltoall": inputs("alltoall", counts, rank, ranks),            # nothing exchanged
        "reducescatter": [t[:-1] for t in _collective(
            "reducescatter", [inputs("reducescatter", counts, r, ranks)[0]
                              for r in range(ranks)], False)[:1]] * 2,  # a shape short
    }
    for op, outputs in wrong.items():
        with pytest.raises(ValueError, match=rf"^horovod {op}: rank 1's tensor 0 "):
            check(op, outputs, counts, rank, ranks, False, "horovod")
    summed = _collective("allreduce", [inputs("allreduce", counts, r, ranks)[0]
                                       for r in range(ranks)], False)[rank]
    with pytest.raises(ValueError, match="wrong at element 0: 6.0, expected 2.0"):
        check("allreduce", [summed, summed], counts, rank, ranks, True)
    assert bus_factor("allreduce", 4) == 1.5 and bus_factor("allgather", 4) == 0.75
    assert bus_factor("alltoall", 1) == 1.0


def _cli(args, state_dir, monkeypatch):
    from typer.testing import CliRunner

    from bpsctl.cli import app
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(state_dir))
    return CliRunner().invoke(app, ["bench", "comm", *args])


@pytest.mark.parametrize("args, message", [
    (["--op", "allreduce,bogus"], "--op: bogus is not an op of bench comm; choose from "
                                  "push_pull, allreduce, allgather, alltoall, reducescatter"),
    (["--op", "allgather,allgather"], "--op: allgather is given twice"),
    (["--op", "allreduce", "--sweep", "workers=2,4"],
     "--sweep with --op allreduce: the sweep measures push_pull against ring allreduce"),
    (["--op", "alltoall", "--device", "cuda"],
     "--device cuda with --op alltoall: the collectives are measured on CPU float32 tensors"),
    (["--op", "allreduce", "--compare", "allreduce"],
     "--compare allreduce with --op allreduce: the gloo ring allreduce is push_pull's baseline"),
    (["--op", "allreduce", "--security", "hmac,none"], "--security with --op allreduce"),
    (["--compare", "horovod"], "--compare horovod: bench comm compares Horovod on Horovod's "
                               "collectives; add --op allreduce"),
    (["--op", "reducescatter", "--reduce", "max"], "--reduce: expected average or sum, got 'max'"),
    (["--reduce", "sum"], "--reduce: applies to --op's allreduce and reducescatter"),
])
def test_op_mistakes_exit_2_saying_what_to_do(tmp_path, monkeypatch, args, message):
    result = _cli(args, tmp_path / "state", monkeypatch)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "state" / "cluster.json").exists()


def test_op_against_horovod_without_horovod_says_how_to_install_it(tmp_path, monkeypatch):
    from bpsctl.bench import horovod as horovod_mod
    monkeypatch.setattr(horovod_mod, "installed_version", lambda *a, **k: None)
    result = _cli(["--op", "allreduce", "--compare", "horovod"], tmp_path / "state", monkeypatch)
    assert result.exit_code == 2, result.output
    assert " ".join(horovod_mod.missing_message().split()) in " ".join(result.output.split())
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def _horovod_or_skip():
    from bpsctl.bench import horovod as horovod_mod
    if horovod_mod.installed_version() is None:
        pytest.skip("horovod.torch does not import here (`bpsctl install horovod` builds it)")


def _assert_ops_report(report, ops, workers, size):
    assert report["kind"] == "comm" and report["ops"] == list(ops)
    assert (report["workers"], report["reduce"], report["size_bytes"]) == (workers, "average", size)
    rows = {(r["op"], r["system"]): r for r in report["results"]}
    expected = [(op, system) for op in ops for system in ("bpsctl", "horovod")]
    expected.insert(expected.index(("allreduce", "horovod")) + 1, ("push_pull", "bpsctl"))
    assert [(r["op"], r["system"]) for r in report["results"]] == expected
    for (op, system), row in rows.items():
        assert row["seconds"] > 0 and len(row["seconds_all"]) == report["repeats"], row
        assert row["checked"] is True and row["bytes"] == size
        assert row["bytes_of"] == ("output" if op == "allgather" else "input")
        assert row["algbw_MBps"] == pytest.approx(size / row["seconds"] / 1e6)
        assert row["version"].startswith(system)
    assert set(report["speedup"]) == set(ops)
    for op in ops:
        assert report["speedup"][op] == pytest.approx(
            rows[(op, "horovod")]["seconds"] / rows[(op, "bpsctl")]["seconds"])


@pytest.mark.timeout(300)
def test_every_collective_against_horovod_on_the_embedded_default(tmp_path):
    """The brief's small run: bpsctl's four collectives and push_pull beside Horovod's, every
    result checked by the workers, a positive time per (op, system), only JSON on stdout, the
    table at 80 columns on stderr, and nothing left running."""
    _horovod_or_skip()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = _bpsctl(["bench", "comm", "--op", ",".join(OPS), "--compare", "horovod",
                      "--workers", "2", "--size", "1MiB", "--repeats", "2", "--warmup", "1",
                      "--json", "-"], tmp_path / "state", timeout_s=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["repeats"] == 2 and report["tensors"] == 8
    _assert_ops_report(report, OPS, 2, 1024 * 1024)
    assert "BPSCTL_RESULT" not in result.stderr
    assert_table_fits_80(result.stderr, rows=9)
    said = sentence(result.stderr)
    assert re.search(r"bpsctl/Horovod for 1\.0 MiB with 2 workers on loopback, .*: allreduce "
                     r"\d+\.\d\d×, allgather \d+\.\d\d×, alltoall \d+\.\d\d×, reducescatter "
                     r"\d+\.\d\d× \(Horovod's time over bpsctl's", said), said
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers


@pytest.mark.timeout(300)
def test_collectives_against_horovod_on_two_emulated_hosts(tmp_path):
    """--op on an emulated cluster: Horovod's workers run in the worker hosts' namespaces,
    their rendezvous in the first one's, as the training benchmark runs them (no figures);
    the plot draws each (op, system)."""
    _horovod_or_skip()
    ops = ("allreduce", "allgather")
    result = _bpsctl(["bench", "comm", "--emulate", "--nic", "1gbit", "--workers", "2",
                      "--servers", "2", "--op", ",".join(ops), "--compare", "horovod",
                      "--size", "256KiB", "--tensors", "2", "--repeats", "1", "--warmup", "0",
                      "--json", "-", "--plot", str(tmp_path / "ops.png")], tmp_path / "state",
                     timeout_s=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["nic_mbit"] == 1000 and report["worker_hosts"] == [1, 1]
    _assert_ops_report(report, ops, 2, 256 * 1024)
    assert (tmp_path / "ops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
