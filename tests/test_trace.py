"""Timelines: the trace files workers and servers write, and `bpsctl trace` reading them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import run_job, wait_until

from bpsctl.config import Config
from bpsctl.engine import EngineError, Worker
from bpsctl.engine.client import measure_clock
from bpsctl.engine.security import Security
from bpsctl.engine.trace import STAGE, Trace
from bpsctl.trace.api import NO_COMMUNICATION, load, summarize

STEPS = 5
MiB = 1 << 20


def _traced_job(cluster, trace_dir: Path, workers: int = 2, servers_trace: bool = True,
                **knobs) -> None:
    """``STEPS`` steps of three 2 MiB tensors, the first (pushed first, lowest priority) of
    which counts the steps; the last pushed has the highest priority."""
    def body(worker: Worker) -> None:
        grads = [np.full(MiB // 2, worker.rank + 1, np.float32) for _ in range(3)]
        for _ in range(STEPS):
            handles = [worker.push_pull_async(g, name=f"layer{i}", priority=i, average=False)
                       for i, g in enumerate(grads)]
            for handle in handles:
                worker.synchronize(handle)
    run_job(cluster, workers, 2, body, trace_dir=str(trace_dir), partition_bytes=MiB,
            credit_bytes=MiB, **knobs)
    for rank in range(2 if servers_trace else 0):
        wait_until(lambda r=rank: (trace_dir / f"server-{r}" / "comm.json").exists(), 20,
                   f"server {rank}'s trace (written when the job ends)")


def _spans(path: Path) -> list[dict]:
    """A file's spans: each begin event with the end's ts as "end"."""
    events = json.loads(path.read_text())["traceEvents"]
    begins = {}
    spans = []
    for event in events:
        assert {"ph", "pid", "tid", "name"} <= set(event)
        key = (event.get("cat"), event.get("id"))
        if event["ph"] == "b":
            begins[key] = event
        elif event["ph"] == "e":
            spans.append({**begins.pop(key), "end": event["ts"]})
    assert not begins, "every span that begins ends"
    return spans


def _check_causal_order(workers: dict[int, list[dict]], servers: list[dict],
                        slack_us: float = 0.0) -> None:
    """Every traced push has its sum on a server and its result back, in causal order (within
    ``slack_us``, the clock alignment's error bound)."""
    sums = {(s["args"]["part"], s["args"]["round"], s["args"]["worker"]): s
            for s in servers if s["cat"] == "sum"}
    sent = {(s["args"]["part"], s["args"]["round"]): s
            for s in servers if s["cat"] == "send_result"}
    checked = 0
    for rank, spans in workers.items():
        results = {(s["args"]["part"], s["args"]["round"]): s
                   for s in spans if s["cat"] == "wait_result"}
        for push in (s for s in spans if s["cat"] == "push"):
            key = (push["args"]["part"], push["args"]["round"])
            summed, answered, result = sums[(*key, rank)], sent[key], results[key]
            assert push["ts"] <= summed["ts"] + slack_us
            assert summed["ts"] <= summed["end"] <= answered["ts"]
            assert answered["ts"] <= result["end"] + slack_us
            checked += 1
    # 3 tensors of 2 partitions, steps 0..STEPS-2 complete in the window (the last step has
    # no following push of the first tensor to close it), on each of 2 workers
    assert checked >= 2 * 3 * 2 * (STEPS - 1)


def test_every_traced_push_has_its_sum_and_result_in_causal_order(engine_cluster, tmp_path):
    _traced_job(engine_cluster, tmp_path)
    workers = {r: _spans(tmp_path / f"worker-{r}" / "comm.json") for r in range(2)}
    servers = [s for r in range(2) for s in _spans(tmp_path / f"server-{r}" / "comm.json")]
    _check_causal_order(workers, servers)


def test_a_clock_exchange_needs_the_secret_and_bounds_the_true_offset(engine_cluster):
    ctx = zmq.Context.instance()
    clock = measure_clock(ctx, engine_cluster.scheduler,
                          Security(engine_cluster.security, engine_cluster.secret))
    # the scheduler shares this machine's clock: the true offset, 0, is within the bound
    assert clock is not None and abs(clock["offset_ns"]) <= clock["error_ns"] < 50e6
    refused = measure_clock(ctx, engine_cluster.scheduler,
                            Security(engine_cluster.security, "not-the-secret"), timeout_s=1)
    assert refused is None


def test_processes_on_several_machines_are_put_on_the_schedulers_clock(engine_cluster,
                                                                       tmp_path):
    _traced_job(engine_cluster, tmp_path)
    files = sorted(tmp_path.glob("*/comm.json"))
    for index, path in enumerate(files):
        data = json.loads(path.read_text())
        clock = data["otherData"]["scheduler_clock"]
        # these processes share the scheduler's clock: the true offset, 0, is within the bound
        assert abs(clock["offset_ns"]) <= clock["error_ns"] < 0.1e9, clock
        # as if each process ran on a machine of its own, whose clock is an hour off
        data["otherData"]["boot_id"] = f"machine-{index}"
        data["otherData"]["scheduler_clock"]["offset_ns"] += 3600 * 10**9 * (index + 1)
        for event in data["traceEvents"]:
            if "ts" in event:
                event["ts"] -= 3600 * 10**6 * (index + 1)
        path.write_text(json.dumps(data))
    timeline = load(tmp_path)
    assert timeline.clock["method"] == "handshake"
    slack_us = timeline.clock["error_bound_s"] * 1e6
    spans = {(p.role, p.rank): [{"cat": s.stage, "ts": s.start_us, "end": s.end_us,
                                 "args": s.args} for stage in p.spans.values() for s in stage]
             for p in timeline.processes}
    _check_causal_order({r: spans[("worker", r)] for r in range(2)},
                        spans[("server", 0)] + spans[("server", 1)], slack_us)


def test_a_high_priority_tensor_leaves_before_one_queued_behind_the_credit(engine_cluster,
                                                                           tmp_path):
    _traced_job(engine_cluster, tmp_path)
    queued = [s for s in _spans(tmp_path / "worker-0" / "comm.json") if s["cat"] == "queued"]
    # of two partitions waiting at the same moment (each queued before the other left), the
    # one of higher priority leaves first; when each tensor's push_pull reaches the I/O thread
    # varies, so the pairs that waited together are found in the trace, not assumed
    together = 0
    for a in queued:
        for b in queued:
            prio_a, prio_b = a["args"].get("priority", 0), b["args"].get("priority", 0)
            if prio_a > prio_b and a["ts"] < b["end"] and b["ts"] < a["end"]:
                together += 1
                assert a["end"] <= b["end"], (a, b)
    assert together > 0, "the credit of one partition made partitions of two tensors wait"


def test_a_traced_gather_shows_the_bytes_each_rank_pushed_and_the_servers_summed(
        engine_cluster, tmp_path):
    """PUSH_ZERO in a trace: a 2-rank gather of 1 MiB each (1 MiB partitions), each rank
    pushing its own partition and a header for the other. A worker's push spans carry its
    partition's bytes and none for the header; the servers sum (and trace) the data pushes
    alone, so what they summed is what the workers pushed."""
    def body(worker: Worker) -> None:
        buffer = np.zeros(MiB // 2, np.float32)
        half = MiB // 4
        for step in range(STEPS):
            buffer[:] = 0
            buffer[worker.rank * half:(worker.rank + 1) * half] = worker.rank + step + 1
            got = worker.push_pull(buffer, name="rows", average=False,
                                   mine=(worker.rank * MiB, (worker.rank + 1) * MiB))
            assert (got[:half] == step + 1).all() and (got[half:] == step + 2).all()
    run_job(engine_cluster, 2, 2, body, trace_dir=str(tmp_path), partition_bytes=MiB)
    for rank in range(2):
        wait_until(lambda r=rank: (tmp_path / f"server-{r}" / "comm.json").exists(), 20,
                   f"server {rank}'s trace (written when the job ends)")
    summary = summarize(load(tmp_path))
    for rank in range(2):
        pushes = [s for s in _spans(tmp_path / f"worker-{rank}" / "comm.json")
                  if s["cat"] == "push"]
        sizes = sorted({int(s["args"].get("bytes", 0)) for s in pushes})
        assert sizes == [0, MiB], (rank, sizes)
        data = sum(1 for s in pushes if s["args"].get("bytes"))
        assert 2 * data == len(pushes) >= 2, (rank, len(pushes))
    pushed = sum(w["bytes_pushed"] for w in summary["workers"])
    assert pushed > 0 and sum(s["bytes_summed"] for s in summary["servers"]) == pushed


def test_bpsctl_trace_merges_and_summarises(engine_cluster, tmp_path):
    _traced_job(engine_cluster, tmp_path)
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "trace", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {"worker 0", "worker 1", "server 0",
                                                         "server 1"}
    summary = json.loads(out.read_text())
    assert [w["rank"] for w in summary["workers"]] == [0, 1]
    # every process here shares loopback: one NIC, sampled from the window's start to its end
    [nic] = summary["nics"]
    assert nic["interface"] == "lo"
    samples = json.loads((tmp_path / "worker-0" / "comm.json").read_text()
                         )["otherData"]["nic"]["samples"]
    assert len(samples) >= 2 and samples[-1][1] > samples[0][1]
    assert all(w["steps"] == STEPS - 1 for w in summary["workers"])
    assert sum(s["bytes_summed"] for s in summary["servers"]) > 0


def test_a_window_that_never_opens_writes_nothing_and_says_so(engine_cluster, tmp_path, caplog):
    _traced_job(engine_cluster, tmp_path, servers_trace=False, trace_start_step=STEPS + 10)
    assert not list(tmp_path.glob("*/comm.json"))
    assert "BPSCTL_TRACE_START_STEP=15: the traced window never opened" in caplog.text


def test_an_unwritable_trace_dir_is_named_before_anything_is_pushed(engine_cluster, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = Config(rank=0, world_size=1, job_id="unwritable", trace_dir=str(blocker),
                    scheduler=engine_cluster.scheduler, secret=engine_cluster.secret)
    with pytest.raises(EngineError, match="BPSCTL_TRACE_DIR: cannot write traces under .*a-file"):
        Worker(config)


@pytest.mark.parametrize("damage, expected", [
    (None, "no traces"),
    ("truncated", "not JSON, or cut short"),
    ("version", "written by bpsctl 0.0.1"),
    ("other", "not a bpsctl trace"),
])
def test_bpsctl_trace_refuses_what_is_not_a_trace_naming_the_file(tmp_path, damage, expected):
    if damage is not None:
        trace = Trace(tmp_path / "worker-0" / "comm.json", "worker", 0)
        trace.write()
        path = trace.path
        text = path.read_text()
        if damage == "truncated":
            path.write_text(text[: len(text) // 2])
        elif damage == "version":
            data = json.loads(text)
            data["otherData"]["version"] = "0.0.1"
            path.write_text(json.dumps(data))
        else:
            path.write_text(json.dumps({"traceEvents": []}))
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert expected in done.stderr
    if damage is not None:
        assert "worker-0/comm.json" in done.stderr


def test_the_slowest_worker_is_the_one_that_completes_the_rounds(tmp_path):
    """The summary names the straggler from the servers' view alone (unit level; the root
    test with a slow emulated NIC is in test_emulated_cluster.py)."""
    for rank in range(2):
        trace = Trace(tmp_path / f"worker-{rank}" / "comm.json", "worker", rank)
        trace.write()
    server = Trace(tmp_path / "server-0" / "comm.json", "server", 0)
    name = server.name_id("part 0")
    for round_ in range(10):
        server.span(5, name, round_ * 1000, round_ * 1000 + 500, 0, round_, 64, 1)
    server.write()
    summary = summarize(load(tmp_path))
    assert summary["slowest_worker"]["rank"] == 1
    assert "worker 1 was the slowest" in summary["sentences"][0]


def test_the_rounds_before_the_traced_steps_name_no_straggler(tmp_path):
    """A broadcast before the steps (``broadcast_parameters``) ends every round with its root's
    push, the only one carrying data: the rounds the steps waited on name the straggler."""
    for rank in range(2):
        trace = Trace(tmp_path / f"worker-{rank}" / "comm.json", "worker", rank)
        trace.span(STAGE["step"], trace.name_id("step"), 10_000_000, 100_000_000, round_=0)
        trace.write()
    server = Trace(tmp_path / "server-0" / "comm.json", "server", 0)
    name = server.name_id("part 0")
    for round_ in range(20):                # the broadcast: worker 0 completes each round
        server.span(STAGE["wait_workers"], name, round_ * 100_000, round_ * 100_000 + 50_000,
                    0, round_, 64, 0)
    for round_ in range(20, 25):            # the step: worker 1 does
        start = 20_000_000 + round_ * 1_000_000
        server.span(STAGE["wait_workers"], name, start, start + 500_000, 0, round_, 64, 1)
    server.write()
    summary = summarize(load(tmp_path))
    assert summary["slowest_worker"]["rank"] == 1, summary["slowest_worker"]
    assert summary["slowest_worker"]["rounds"] == 5
    assert summary["servers"][0]["rounds"] == 25        # the servers' table counts them all


def test_steps_that_pushed_nothing_are_said_to_have_no_communication(tmp_path):
    """Workers whose traced steps pushed nothing (one host summing in shared memory, the
    embedded default's path): the summary says so instead of naming the idle uplink as a
    stall, the servers' table (what they summed before the steps: a broadcast) is left
    out, and `trace --plot` draws no empty lanes."""
    for rank in range(2):
        trace = Trace(tmp_path / f"worker-{rank}" / "comm.json", "worker", rank)
        grad = trace.name_id("grad")
        trace.span(STAGE["push"], grad, 0, 1_000_000, 0, 0, 64)     # before the steps
        for step in range(3):
            start = 10_000_000 + step * 100_000_000
            trace.span(STAGE["step"], trace.name_id("step"), start, start + 90_000_000,
                       round_=step)
        trace.write()
    server = Trace(tmp_path / "server-0" / "comm.json", "server", 0)
    server.span(STAGE["sum"], server.name_id("part 0"), 100_000, 900_000, 0, 0, 64, 1)
    server.write()
    summary = summarize(load(tmp_path))
    assert summary["communication"] is False and summary["stalls"] == []
    assert summary["sentences"] == [NO_COMMUNICATION]
    plot = tmp_path / "step.png"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "trace", str(tmp_path), "--plot",
                           str(plot)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert "no gradient left its host in the traced steps" in said
    assert f"did not draw {plot}" in said and not plot.exists()
    assert "uplink of worker" not in said and "MiB summed" not in said


def test_each_servers_flow_says_how_long_it_was_fed_and_the_most_in_flight(tmp_path):
    """From the workers' push spans: server 0 has a push in flight from some worker for the
    whole traced step (fed 100%), server 1 for its first half; the most one worker had in
    flight at a server counts its overlapping pushes, not another worker's."""
    for rank in range(2):
        trace = Trace(tmp_path / f"worker-{rank}" / "comm.json", "worker", rank)
        grad = trace.name_id("grad")
        trace.span(STAGE["step"], trace.name_id("step"), 0, 100_000_000, round_=0)
        if rank == 0:           # two overlapping pushes to server 0, then one to server 1
            trace.span(STAGE["push"], grad, 0, 60_000_000, 0, 0, 1000, 0)
            trace.span(STAGE["push"], grad, 10_000_000, 70_000_000, 1, 0, 3000, 0)
            trace.span(STAGE["push"], grad, 0, 50_000_000, 2, 0, 500, 1)
        else:                   # server 0 for the rest of the step
            trace.span(STAGE["push"], grad, 60_000_000, 100_000_000, 0, 0, 2000, 0)
        trace.write()
    flows = {f["server"]: f for f in summarize(load(tmp_path))["flows"]}
    assert flows[0]["fed"] == pytest.approx(1.0) and flows[1]["fed"] == pytest.approx(0.5)
    assert flows[0]["most_bytes_in_flight"] == 4000      # rank 0's two, not rank 1's after
    assert flows[1]["most_bytes_in_flight"] == 500


def test_the_staged_cuda_path_has_its_own_medians_per_worker(tmp_path):
    """A worker that staged CUDA tensors (to_host, to_device spans from the torch plugin's
    stager) gets their medians in the summary; one that did not gets none (unit level: the
    stager's spans come from a GPU run)."""
    staged = Trace(tmp_path / "worker-0" / "comm.json", "worker", 0)
    name = staged.name_id("grad")
    for i, (out_us, back_us) in enumerate([(100, 40), (300, 60), (200, 50)]):
        start = i * 10_000_000
        staged.span(STAGE["to_host"], name, start, start + out_us * 1000)
        staged.span(STAGE["to_device"], name, start + 5_000_000,
                    start + 5_000_000 + back_us * 1000)
    staged.write()
    Trace(tmp_path / "worker-1" / "comm.json", "worker", 1).write()
    rows = {w["rank"]: w for w in summarize(load(tmp_path))["workers"]}
    assert (rows[0]["to_host_s"], rows[0]["to_device_s"]) == pytest.approx((200e-6, 50e-6))
    assert (rows[1]["to_host_s"], rows[1]["to_device_s"]) == (None, None)


def test_bench_trace_writes_bpsctls_timeline_and_not_the_baselines(tmp_path):
    traces = tmp_path / "traces"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "bench", "comm", "--workers", "2", "--servers", "2", "--size", "1MiB",
                           "--tensors", "2", "--warmup", "1", "--repeats", "3", "--no-raw",
                           "--compare", "allreduce", "--trace", str(traces)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"bpsctl trace {traces}" in done.stderr
    files = sorted(str(p.relative_to(traces)) for p in traces.glob("*/comm.json"))
    assert files == ["server-0/comm.json", "server-1/comm.json", "worker-0/comm.json",
                     "worker-1/comm.json"]
    summary = summarize(load(traces))
    assert all(w["steps"] >= 3 for w in summary["workers"])


def test_bench_trace_into_an_unwritable_place_exits_2_before_anything_runs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "bench", "comm", "--trace", str(blocker / "traces")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--trace / BPSCTL_TRACE_DIR: cannot write to" in done.stderr and "a-file" in done.stderr
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())


def test_the_torch_optimizer_waiting_for_its_gradients_is_on_the_timeline(tmp_path):
    """DistributedOptimizer.step() waiting in synchronize is a span of its own, beside the
    engine's, in every worker's trace (the README's hello world, traced)."""
    traces = tmp_path / "traces"
    script = Path(__file__).resolve().parents[1] / "examples" / "train.py"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "run", "-np", "2", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path,
                          env={**os.environ, "BPSCTL_TRACE_DIR": str(traces),
                               "BPSCTL_TRACE_START_STEP": "5", "BPSCTL_TRACE_END_STEP": "15"})
    assert done.returncode == 0, done.stderr + done.stdout
    for rank in range(2):
        spans = _spans(traces / f"worker-{rank}" / "comm.json")
        waits = [s for s in spans if s["cat"] == "synchronize"]
        steps = [s for s in spans if s["cat"] == "step"]
        assert len(steps) == 10 and 9 <= len(waits) <= 11
        assert all(s["name"] == "DistributedOptimizer.grad" for s in waits)
        assert 9 <= len([s for s in spans if s["cat"] == "backward"]) <= 11
    # each step split into forward, backward, wait and optimizer, which fit inside it
    rows = summarize(load(traces))["steps"]
    assert len(rows) == 10
    for row in rows:
        phases = [row[k] for k in ("forward_s", "backward_s", "wait_s", "optimizer_s")]
        assert all(p >= 0 for p in phases), row
        assert sum(phases) <= row["step_s"] + 1e-6, row


def test_a_slow_host_is_named_and_the_nic_tracks_count_the_bytes_sent(tmp_path):
    """On an emulated cluster (root) whose worker 1 has a NIC at a quarter of the others'
    rate, `bpsctl trace` names worker 1 as the slowest, and each worker host's NIC counter
    track shows the bytes the engine sent and received, within 5%."""
    traces = tmp_path / "traces"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "bench", "comm", "--emulate", "--workers", "3", "--servers", "1",
                           "--nic", "200mbit", "--straggler", "1:0.25", "--size", "4MiB",
                           "--tensors", "4", "--warmup", "1", "--repeats", "3", "--no-raw",
                           "--trace", str(traces)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "worker 1's at 0.25x" in done.stdout + done.stderr      # said beside the figures
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "trace", str(traces), "--json",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    assert summary["slowest_worker"]["rank"] == 1
    assert "worker 1 was the slowest" in done.stderr
    for rank in range(3):
        data = json.loads((traces / f"worker-{rank}" / "comm.json").read_text())
        samples = data["otherData"]["nic"]["samples"]
        tx, rx = (samples[-1][i] - samples[0][i] for i in (1, 2))
        engine = {stage: sum(e["args"].get("bytes", 0) for e in data["traceEvents"]
                             if e.get("cat") == stage and e["ph"] == "b")
                  for stage in ("push", "wait_result")}
        assert engine["push"] == 4 * 4 * MiB        # 4 rounds of 4 MiB, all in the window
        assert abs(tx / engine["push"] - 1) < 0.05, (rank, tx, engine)
        assert abs(rx / engine["wait_result"] - 1) < 0.05, (rank, rx, engine)


def test_one_big_tensor_of_many_workers_completes_in_the_order_it_is_pushed(engine_cluster,
                                                                            tmp_path):
    """The pattern flow control must serve: every worker pushes one large tensor at once. Its
    rounds complete on a server only when every worker has pushed that partition, so the
    tensor is cut finely for its servers (BPSCTL_PARTITION_DEPTH), every worker pushes the
    pieces in the same order, and sums come back in that order: the first pieces' sums are
    not held back behind the rest of the tensor."""
    workers, depth, size = 4, 16, 32 * MiB

    def body(worker: Worker) -> None:
        grad = np.full(size // 4, worker.rank + 1, np.float32)
        for _ in range(3):
            out = worker.push_pull(grad, name="big", average=False)
            assert out[0] == out[-1] == workers * (workers + 1) // 2

    # a credit of a quarter of the tensor: pieces wait in the queue and leave as ACKs come
    run_job(engine_cluster, workers, 2, body, trace_dir=str(tmp_path), credit_bytes=size // 4,
            partition_depth=depth)
    orders = {}
    for rank in range(workers):
        spans = _spans(tmp_path / f"worker-{rank}" / "comm.json")
        last_round = max(s["args"]["round"] for s in spans if s["cat"] == "queued")
        sent = sorted((s["end"], s["args"]["part"], s["args"]["server"]) for s in spans
                      if s["cat"] == "queued" and s["args"]["round"] == last_round)
        arrived = {s["args"]["part"]: s["end"] for s in spans
                   if s["cat"] == "wait_result" and s["args"]["round"] == last_round}
        orders[rank] = [part for _, part, _ in sent]
        for server in (0, 1):
            order = [part for _, part, to in sent if to == server]
            assert len(order) >= depth, f"rank {rank}, server {server}: {len(order)} pieces"
            # a server's sums come back in the order its pieces were pushed: the first
            # quarter's all arrived before any of the last quarter's (the I/O thread reads
            # one server's socket at a time, so across servers arrivals interleave)
            quarter = len(order) // 4
            assert max(arrived[p] for p in order[:quarter]) < \
                min(arrived[p] for p in order[-quarter:]), f"rank {rank}, server {server}"
    assert all(order == orders[0] for order in orders.values()), orders


def test_the_summary_prints_the_first_and_last_steps_of_a_long_trace():
    """49 traced steps print as 10 rows and one that says how many were left out (every step
    is in --json)."""
    from bpsctl.trace.cli import STEPS_SHOWN, shown_steps
    rows = [{"step": i} for i in range(49)]
    shown = shown_steps(rows)
    assert len(shown) == STEPS_SHOWN + 1 and shown[3] is None
    assert [r["step"] for r in shown if r is not None] == [0, 1, 2, *range(42, 49)]
    assert shown_steps(rows[:STEPS_SHOWN]) == rows[:STEPS_SHOWN]


def test_a_callers_spans_after_the_closing_step_mark_are_left_out(tmp_path):
    """A plugin records its spans directly while the I/O thread hears of step marks later:
    the spans of steps that ran after the window's last step mark (before the I/O thread
    heard of it) are not in the trace, and those of the window's steps are."""
    trace = Trace(tmp_path / "worker-0" / "comm.json", "worker", 0, start_step=1, end_step=3)
    wait = trace.name_id("DistributedOptimizer.grad")
    marks = [1_000 * (step + 1) for step in range(6)]       # step k ends at marks[k]
    for step in range(6):           # the plugin runs six steps before the I/O thread hears
        trace.span(STAGE["synchronize"], wait, marks[step] - 100, marks[step] - 10)
    for step in range(6):           # ... then hears of all six marks
        trace.next_step(at_ns=marks[step])
        if trace.written:
            break
    spans = _spans(tmp_path / "worker-0" / "comm.json")
    waits = sorted(s["ts"] for s in spans if s["cat"] == "synchronize")
    assert waits == [(marks[1] - 100) / 1000, (marks[2] - 100) / 1000]
    assert len([s for s in spans if s["cat"] == "step"]) == 2
