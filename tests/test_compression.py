"""Gradient compression: each compressor's bytes and round trip on known vectors, error
feedback, compression both ways through real servers, the minimum size, and bad input."""
from __future__ import annotations

import io
import json
import math
import os
import signal
import threading

import numpy as np
import pytest
import zmq
from conftest import gone, private_cluster, run_job, wait_until
from typer.testing import CliRunner

from bpsctl.bench.training import ConvergenceSettings, run_convergence
from bpsctl.cli import app
from bpsctl.config import Config, ConfigError
from bpsctl.engine import compression as C
from bpsctl.engine.partition import split

KEY = (0, 7, 3, 1)          # seed, partition, round, sender


def roundtrip(comp: C.Compressor, x, key=KEY):
    x = np.asarray(x, np.float32)
    body = np.zeros(comp.body_bytes(len(x)), np.uint8)
    comp.encode(x, body, key)
    out = np.full(len(x), np.nan, np.float32)
    comp.decode(body, out, key)
    return body, out


# --------------------------------------------------------------------------- wire sizes

@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 1000, 4097])
def test_each_compressor_sends_exactly_its_stated_size(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    k = max(1, min(n, int(0.01 * n + 0.5)))
    stated = {
        C.OneBit(): 16 + 4 + math.ceil(n / 8),
        C.TopK(ratio=0.01): 16 + 8 * k,
        C.RandomK(ratio=0.01): 16 + 4 * k,
        C.Dithering(levels=2): 16 + 4 + math.ceil(3 * n / 8),       # 5 codes: 3 bits
        C.Dithering(levels=1): 16 + 4 + math.ceil(2 * n / 8),       # 3 codes: 2 bits
        C.Dithering(levels=127): 16 + 4 + n,                        # 255 codes: 8 bits
        C.FP16(): 16 + 2 * n,
        C.BF16(): 16 + 2 * n,
    }
    for comp, size in stated.items():
        assert comp.wire_bytes(n) == size, comp
        body, out = roundtrip(comp, x)
        assert len(body) + C.HEADER_BYTES == size
        assert np.isfinite(out).all()


# --------------------------------------------------------------------------- known vectors

def test_onebit_packs_signs_8_to_a_byte_with_the_mean_magnitude_as_scale():
    x = [1.0, -2.0, 0.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0]        # mean |x| = 4
    body, out = roundtrip(C.OneBit(), x)
    assert body[:4].view(np.float32)[0] == 4.0
    # bit set = negative, little bit order: bits 1, 4, 6 of the first byte, bit 0 of the next
    assert body[4:].tolist() == [0b01010010, 0b00000001]
    assert out.tolist() == [4, -4, 4, 4, -4, 4, -4, 4, -4]         # 0 counts as positive
    _, unscaled = roundtrip(C.OneBit(scaling=False), x)
    assert unscaled.tolist() == [1, -1, 1, 1, -1, 1, -1, 1, -1]


def test_topk_keeps_the_largest_magnitudes_with_their_indices():
    x = [0.1, -5.0, 3.0, 0.2, 4.0, -0.3]
    body, out = roundtrip(C.TopK(ratio=0.5), x)                    # k = 3
    assert body[:12].view(np.uint32).tolist() == [1, 2, 4]         # ascending indices
    assert body[12:].view(np.float32).tolist() == [-5.0, 3.0, 4.0]
    assert out.tolist() == [0, -5, 3, 0, 4, 0]


def test_topk_ties_go_to_the_lowest_indices():
    _, out = roundtrip(C.TopK(ratio=0.5), [1.0, -2.0, 1.0, -1.0])    # k = 2; 1.0 three times
    assert out.tolist() == [1, -2, 0, 0]
    _, out = roundtrip(C.TopK(ratio=0.5), [3.0, 3.0, -3.0, 3.0])
    assert out.tolist() == [3, 3, 0, 0]


def test_k_is_the_ratio_of_n_rounded_half_up_at_least_one():
    assert C.TopK(ratio=0.01).param(49) == 1
    assert C.TopK(ratio=0.01).param(150) == 2
    assert C.TopK(ratio=0.07).param(100) == 7
    assert C.RandomK(ratio=1.0).param(5) == 5


def test_randomk_indices_are_the_same_on_every_worker_and_server_and_not_sent():
    n, comp = 1000, C.RandomK(ratio=0.05, seed=11)
    grads = [np.random.default_rng(rank).standard_normal(n).astype(np.float32)
             for rank in range(3)]
    codecs = [C.WorkerCodec(comp, np.dtype(np.float32), n, rank) for rank in range(3)]
    wires = [codec.encode(g.view(np.uint8), 5, 0, 4 * n, 2).copy()
             for codec, g in zip(codecs, grads, strict=True)]
    assert all(len(w) == 16 + 4 * 50 for w in wires)                  # values only
    idx = comp.indices(n, (11, 5, 2, 0))
    assert len(set(idx.tolist())) == 50
    for g, wire in zip(grads, wires, strict=True):
        # each worker sent its own values at the shared indices
        assert np.array_equal(wire[16:].view(np.float32), g[idx])
    server = C.ServerCodec.open(wires[0], len(wires[0]))
    for i, wire in enumerate(wires):
        server.check(wire, 5)
        server.add(wire, i == 0, 5, 2)
    total = np.zeros(n, np.float32)
    total[idx] = sum(g[idx] for g in grads)
    pulled = np.empty(n, np.float32)
    codecs[0].decode(server.finish(5, 2), 5, 2, pulled, None)
    assert np.allclose(pulled, total, rtol=1e-6)                # the sum survives exactly
    other_round = comp.indices(n, (11, 5, 3, 0))
    other_part = comp.indices(n, (11, 6, 2, 0))
    assert not np.array_equal(idx, other_round) and not np.array_equal(idx, other_part)


def test_dithering_values_on_a_level_come_back_exactly():
    x = [1.0, -0.5, 0.0, 0.5, -1.0]
    body, out = roundtrip(C.Dithering(levels=2), x)                 # levels 0, 1/2, 1 of max
    assert out.tolist() == x
    assert body[:4].view(np.float32)[0] == 1.0
    _, out = roundtrip(C.Dithering(levels=3, natural=True), [2.0, -1.0, 0.5, 0.0])
    assert out.tolist() == [2.0, -1.0, 0.5, 0.0]                     # 0, 1/4, 1/2, 1 of max
    x2 = [3.0, 4.0]                                                 # L2 norm 5
    body, _ = roundtrip(C.Dithering(levels=4, norm="l2"), x2)
    assert body[:4].view(np.float32)[0] == 5.0


@pytest.mark.parametrize("comp", [C.Dithering(levels=2), C.Dithering(levels=3, natural=True),
                                  C.Dithering(levels=4, norm="l2")], ids=str)
def test_dithering_rounds_stochastically_without_bias(comp):
    x = np.array([0.3, -0.7, 0.05, 1.0, -0.12, 0.0], np.float32)
    mean = np.zeros(len(x))
    rounds = 4000
    for r in range(rounds):
        _, out = roundtrip(comp, x, key=(0, 1, r, 0))
        mags = np.abs(out) / np.abs(x).max() if comp.norm == "max" else None
        if mags is not None:
            assert np.isin(np.round(mags, 6), np.round(comp.magnitudes(), 6)).all()
        mean += out
    assert np.allclose(mean / rounds, x, atol=0.03)


def test_fp16_and_bf16_round_each_value():
    _, out = roundtrip(C.FP16(), [1.0, 1 / 3, -65504.0])
    assert out.tolist() == [1.0, np.float32(np.float16(1 / 3)), -65504.0]
    _, out = roundtrip(C.BF16(), [1.0, 1 / 3, -3.0])
    assert out[0] == 1.0 and out[2] == -3.0 and abs(out[1] - 1 / 3) < 2e-3


# --------------------------------------------------------------------------- error feedback

@pytest.mark.parametrize("comp", [C.OneBit(), C.OneBit(scaling=False), C.TopK(ratio=0.05),
                                  C.RandomK(ratio=0.05), C.Dithering(levels=2),
                                  C.Dithering(levels=3, natural=True)], ids=str)
def test_error_feedback_loses_nothing(comp):
    """Over any number of steps, what was sent plus the residual left is what was pushed."""
    n, steps = 1000, 25
    codec = C.WorkerCodec(comp, np.dtype(np.float32), n, rank=2)
    pushed = np.zeros(n, np.float64)
    sent = np.zeros(n, np.float64)
    out = np.empty(n, np.float32)
    for step in range(steps):
        g = np.random.default_rng(step).standard_normal(n).astype(np.float32)
        pushed += g
        wire = codec.encode(g.view(np.uint8), 3, 0, 4 * n, step)
        comp.decode(wire[16:], out, (comp.seed_word(), 3, step, 2))
        sent += out
        # the same round pushed again (failover) sends the same bytes, charging nothing twice
        assert codec.encode(g.view(np.uint8), 3, 0, 4 * n, step) is wire
    assert codec.residual is not None and np.abs(codec.residual).max() > 0
    assert np.allclose(sent + codec.residual, pushed, rtol=0, atol=1e-4 * steps)


def test_without_error_feedback_the_dropped_part_is_gone():
    codec = C.WorkerCodec(C.TopK(ratio=0.1, ef=False), np.dtype(np.float32), 100, 0)
    assert codec.residual is None


# --------------------------------------------------------------------------- through servers

def reference(comp: C.Compressor, grads: list[np.ndarray], parts: list[list[int]],
              rounds: int) -> list[np.ndarray]:
    """What every worker should get each round: per partition, each worker's push (with its
    own error feedback) decompressed and summed, the sum (with the server's) recompressed,
    decompressed and averaged."""
    n_workers = len(grads[0])
    seed = comp.seed_word()
    results = []
    worker_res = {(w, p[0]): None for w in range(n_workers) for p in parts}
    server_res: dict[int, np.ndarray | None] = {p[0]: None for p in parts}
    for r in range(rounds):
        out = np.empty(len(grads[r][0]), np.float32)
        for pid, _, offset, length in parts:
            lo, n = offset // 4, length // 4
            total = np.zeros(n, np.float32)
            for w in range(n_workers):
                g = grads[r][w][lo:lo + n].astype(np.float32)
                if comp.ef and worker_res[(w, pid)] is not None:
                    g = g + worker_res[(w, pid)]
                body = np.empty(comp.body_bytes(n), np.uint8)
                comp.encode(g, body, (seed, pid, r, w))
                pushed = np.empty(n, np.float32)
                comp.decode(body, pushed, (seed, pid, r, w))
                worker_res[(w, pid)] = g - pushed
                total += pushed
            if comp.ef and server_res[pid] is not None:
                total = total + server_res[pid]
            body = np.empty(comp.body_bytes(n), np.uint8)
            comp.encode(total, body, (seed, pid, r, C.SERVER_STREAM))
            pulled = np.empty(n, np.float32)
            comp.decode(body, pulled, (seed, pid, r, C.SERVER_STREAM))
            server_res[pid] = total - pulled
            out[lo:lo + n] = pulled / n_workers
        results.append(out)
    return results


COMPRESSORS = [C.OneBit(), C.TopK(ratio=0.05), C.RandomK(ratio=0.05, seed=3),
               C.Dithering(levels=2), C.FP16(ef=True)]
ROUNDS, N = 3, 3000          # 12000 bytes: three partitions of at most 4096 bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 3), (3, 2), (4, 4), (4, 1), (1, 4)])
def test_two_way_compression_through_real_servers(job, workers, servers):
    grads = [[np.random.default_rng(1000 * r + w).standard_normal(N).astype(np.float32)
              for w in range(workers)] for r in range(ROUNDS)]

    def body(worker):
        got = {}
        for r in range(ROUNDS):
            for comp in COMPRESSORS:
                name = f"grad.{comp.spec()}"
                out = worker.push_pull(grads[r][worker.rank], name=name, compression=comp)
                got.setdefault(name, []).append(out)
        parts = {name: [list(p) for p in worker._tensors[name]["parts"]] for name in got}
        return got, parts

    # one worker too goes through the servers (BPSCTL_FORCE_DISTRIBUTED): they compress
    results = job(workers, servers, body, partition_bytes=4096, min_compress_bytes=0,
                  force_distributed=True)
    for comp in COMPRESSORS:
        name = f"grad.{comp.spec()}"
        parts = results[0][1][name]
        assert [(p[2], p[3]) for p in parts] == split(4 * N, 4, 4096)
        assert len({p[1] for p in parts}) == min(servers, 3)        # spread over the servers
        want = reference(comp, grads, parts, ROUNDS)
        for rank, (got, _) in enumerate(results):
            for r in range(ROUNDS):
                assert np.allclose(got[name][r], want[r], rtol=1e-4, atol=1e-5), \
                    (comp, rank, r, np.abs(got[name][r] - want[r]).max())


def test_onebit_through_servers_is_the_sign_of_the_sum_times_its_mean_magnitude(job):
    grads = [np.random.default_rng(w).standard_normal(1000).astype(np.float32)
             for w in range(3)]

    def body(worker):
        return worker.push_pull(grads[worker.rank], name="onebit", average=False,
                                compression=C.OneBit())

    total = sum(np.abs(g).mean() * np.where(g < 0, -1.0, 1.0) for g in grads)
    want = np.abs(total).mean() * np.where(total < 0, -1.0, 1.0)
    for got in job(3, 2, body, min_compress_bytes=0):
        assert np.allclose(got, want, rtol=1e-5)


def test_a_tensor_under_the_minimum_size_is_sent_as_it_is(job):
    small = np.arange(100, dtype=np.float32)            # 400 bytes
    large = np.arange(2000, dtype=np.float32)           # 8000 bytes

    def body(worker):
        return (worker.push_pull(small * (worker.rank + 1), name="small", average=False,
                                 compression=C.OneBit()),
                worker.push_pull(large * (worker.rank + 1), name="large", average=False,
                                 compression=C.OneBit()))

    for got_small, got_large in job(2, 2, body, min_compress_bytes=4096):
        assert np.array_equal(got_small, small * 3)                  # exact: not compressed
        assert len(np.unique(np.abs(got_large))) == 1                # onebit: one magnitude


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_a_finished_compressed_push_pull_is_complete_even_if_its_name_is_pushed_again(
        job, dtype):
    # the waiter decompresses results; one never waited for is decompressed before its name's
    # next push_pull, so no sum is lost or overwritten by the next
    x = np.arange(3000).astype(dtype) % 100             # fp16-exact, as are the sums

    def body(worker):
        scale = worker.rank + 1
        first = worker.push_pull_async(x * scale, name="g", average=False,
                                       compression=C.FP16(ef=True))
        wait_until(first.done, 30, "the first push_pull's sums")
        second = worker.push_pull_async(x * 10 * scale, name="g", average=True,
                                        out=np.zeros_like(x), compression=C.FP16(ef=True))
        averaged = worker.synchronize(second).copy()
        return first.output.copy(), worker.synchronize(first), averaged

    for unwaited, waited, averaged in job(2, 2, body, partition_bytes=2048,
                                          min_compress_bytes=0):
        assert np.array_equal(unwaited, x * 3)
        assert np.array_equal(waited, x * 3)
        assert np.array_equal(averaged, x * 15)


def test_a_compressed_push_pull_whose_last_sum_is_taken_as_it_finishes_returns():
    # The waiter decompresses each sum as it arrives. The I/O thread queues the last sum and
    # then marks the op done; a waiter that took that sum in between must still be woken by
    # the finish, not sleep until its deadline. Here the finish comes while the waiter is
    # decompressing the last sum, the one interleaving that hung a 3-worker training job.
    from bpsctl.engine.worker import Handle

    decoding, finished = threading.Event(), threading.Event()

    class SlowCodec:
        def decode(self, payload, part_id, round_, dst, divisor):
            decoding.set()
            assert finished.wait(10), "the test's finish never came"
            dst[:] = 1

    out = np.zeros(4, np.float32)
    handle = Handle("g", out)
    handle._compressed()
    handle._result_arrived((SlowCodec(), zmq.Frame(b""), 0, 0, out, None))
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(handle.wait(5.0)), daemon=True)
    waiter.start()
    assert decoding.wait(10), "the waiter never decompressed the sum"
    handle._set_done()              # as the I/O thread finishes the op
    finished.set()
    waiter.join(10)
    assert not waiter.is_alive() and result, "wait() slept past the op's end"
    assert np.array_equal(result[0], np.ones(4, np.float32))


# --------------------------------------------------------------------------- convergence

def train(comp: C.Compressor | None, steps: int = 400, workers: int = 4) -> float:
    """Least squares on a synthetic linear task, each worker with its own data, full-batch
    gradients averaged through the real worker and server codecs (two partitions); returns
    the final loss."""
    rng = np.random.default_rng(0)
    d = 128
    truth = rng.standard_normal(d).astype(np.float32)
    xs = [rng.standard_normal((256, d)).astype(np.float32) for _ in range(workers)]
    ys = [x @ truth for x in xs]
    w = np.zeros(d, np.float32)
    codecs = [C.WorkerCodec(comp, np.dtype(np.float32), d, rank) for rank in range(workers)] \
        if comp else []
    servers: dict[int, C.ServerCodec] = {}
    halves = [(0, 0, 4 * d // 2), (1, 4 * d // 2, 4 * d // 2)]     # part id, offset, bytes
    for step in range(steps):
        grads = [(x.T @ (x @ w - y) / len(x)).astype(np.float32)
                 for x, y in zip(xs, ys, strict=True)]
        if comp is None:
            avg = sum(grads) / workers
        else:
            avg = np.empty(d, np.float32)
            for pid, offset, length in halves:
                for rank, codec in enumerate(codecs):
                    wire = codec.encode(grads[rank].view(np.uint8), pid, offset, length, step)
                    server = servers.get(pid)
                    if server is None:
                        server = servers[pid] = C.ServerCodec.open(wire, len(wire))
                    server.add(wire, rank == 0, pid, step)
                lo = offset // 4
                codecs[0].decode(server.finish(pid, step), pid, step, avg[lo:lo + length // 4],
                                 workers)
        w -= 0.1 * avg
    return float(np.mean([np.mean((x @ w - y) ** 2) for x, y in zip(xs, ys, strict=True)]))


def test_compressors_with_error_feedback_train_close_to_uncompressed():
    start, plain = train(None, steps=0), train(None)
    assert plain < 1e-6 * start
    for comp in [C.OneBit(), C.TopK(ratio=0.1), C.RandomK(ratio=0.25), C.Dithering(levels=2)]:
        loss = train(comp)
        assert loss < 1e-3 * start, (comp, loss, plain, start)
    # without error feedback the signs alone stall far from the optimum
    assert train(C.OneBit(ef=False)) > 10 * train(C.OneBit())


def test_bench_convergence_shows_what_error_feedback_is_for(tmp_path, monkeypatch):
    """`bench convergence --compare sync --compression onebit,onebit:noef --steps 200`: every
    row trains exactly 200 steps; onebit with error feedback ends within a point of the
    uncompressed sync row and onebit without it well behind, each sending 189 bytes a step
    (16 + 4 + 1348/8) where sync sends 5392. At lr 0.01 this holds on every seed 0..7 (sync
    minus onebit at most 0.006, minus onebit:noef at least 0.069)."""
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BPSCTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    report_file = tmp_path / "report.json"
    result = CliRunner().invoke(app, [
        "bench", "convergence", "--workers", "2", "--servers", "1", "--compare", "sync",
        "--compression", "onebit,onebit:noef", "--steps", "200", "--lr", "0.01",
        "--target", "0.75", "--train-samples", "1024", "--batch-size", "16",
        "--json", str(report_file)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_file.read_text())
    rows = {row["system"]: row for row in report["results"]}
    assert list(rows) == ["sync", "sync+onebit", "sync+onebit:noef"]
    for row in rows.values():
        assert row["steps"] == 200 and row["curve"][-1]["step"] == 200, row
        assert row["curve"][-1]["accuracy"] == row["final_accuracy"]
    sync, ef, noef = (rows[name]["final_accuracy"] for name in rows)
    assert sync >= 0.8, rows
    assert abs(ef - sync) <= 0.01, (sync, ef)
    assert noef <= sync - 0.05, (sync, noef)
    # sync passes the target early and trains on past it
    assert rows["sync"]["reached"] and rows["sync"]["target_step"] < 200
    assert report["steps"] == 200 and report["compression"] == ["onebit", "onebit:noef"]
    assert report["gradient_bytes_per_step"] == 5392
    for name in ("sync+onebit", "sync+onebit:noef"):
        assert rows[name]["wire_bytes_per_step"] == 189
        assert rows[name]["min_compress_bytes"] == 0
    assert "(no error feedback)" in rows["sync+onebit:noef"]["version"]
    table = " ".join(result.output.split())
    assert "sync+onebit:noef" in table and "189 B (4%)" in table


def test_bench_convergence_without_steps_stops_at_the_target(tmp_path):
    """Without --steps a row stops at its first measurement at the target, as before."""
    settings = ConvergenceSettings(workers=1, servers=1, compare=("sync",), target=0.6,
                                   lr=0.05, train=512, test=256, batch_size=16, timeout_s=120)
    report = run_convergence(Config(start_timeout_s=60), settings, output=io.StringIO())
    row = report["results"][0]
    assert row["reached"] and row["steps"] == row["target_step"] < settings.max_steps, row
    assert row["steps"] % settings.eval_every == 0 and report["steps"] is None


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("make, message", [
    (lambda: C.TopK(ratio=0), "topk ratio: expected a number in (0, 1]"),
    (lambda: C.TopK(ratio=1.5), "topk ratio: expected a number in (0, 1]"),
    (lambda: C.RandomK(ratio=-0.1), "randomk ratio: expected a number in (0, 1]"),
    (lambda: C.Dithering(levels=0), "dithering levels: expected an integer in 1..127"),
    (lambda: C.Dithering(levels=200), "dithering levels: expected an integer in 1..127"),
    (lambda: C.Dithering(levels=2, norm="l1"), "dithering norm: expected max or l2"),
    (lambda: C.parse("zip"), "compression: expected one of onebit, topk:RATIO"),
    (lambda: C.parse("topk:0"), "topk ratio: expected a number in (0, 1]"),
    (lambda: C.parse("topk:lots"), "topk needs a number after the colon"),
    (lambda: C.parse("dithering:0"), "dithering levels: expected an integer in 1..127"),
    (lambda: C.parse("fp16:noef"), "compression 'fp16:noef': noef is for the kinds with error "
                                   "feedback (onebit, topk, randomk, dithering); fp16 has none"),
    (lambda: C.parse("topk:noef"), "compression: expected one of onebit, topk:RATIO"),
    (lambda: C.from_params({"compressor": "zip"}), "compression_params compressor: expected"),
    (lambda: C.from_params({"compressor": "onebit", "momentum": "nesterov"}),
     "compression_params: unknown key(s) ['momentum']"),
    (lambda: C.from_params({"compressor": "onebit", "ef": "corrected"}),
     "compression_params ef: expected 'vanilla' or None"),
], ids=["topk-0", "topk-1.5", "randomk-neg", "levels-0", "levels-200", "norm", "unknown",
        "spec-ratio", "spec-nan", "spec-levels", "spec-fp16-noef",
        "spec-noef-no-ratio", "params-unknown", "params-key", "params-ef"])
def test_bad_compressor_parameters_name_the_parameter_and_the_range(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


def test_compression_of_an_integer_tensor_is_refused(job):
    def body(worker):
        with pytest.raises(ValueError, match=r"compression: onebit needs a floating-point "
                                             r"tensor \(float16, float32 or float64\), got int32"):
            worker.push_pull(np.ones(100000, np.int32), name="ints", average=False,
                             compression=C.OneBit())
        # the name is free again and the job goes on
        return worker.push_pull(np.ones(3, np.int32), name="ints", average=False)

    for got in job(2, 1, body):
        assert got.tolist() == [2, 2, 2]


def test_a_negative_minimum_compress_size_is_refused():
    with pytest.raises(ConfigError, match="BPSCTL_MIN_COMPRESS_BYTES: expected 0 or more bytes"):
        Config(min_compress_bytes=-1)
    env = {"BYTEPS_MIN_COMPRESS_BYTES": "1024"}
    assert Config.from_env(env).min_compress_bytes == 1024


@pytest.mark.parametrize("spec, expected", [
    ("onebit", C.OneBit()), ("onebit:noef", C.OneBit(ef=False)),
    ("onebit:noscale:noef", C.OneBit(ef=False, scaling=False)),
    ("topk:0.010:noef", C.TopK(ratio=0.01, ef=False)),
    ("randomk:0.5:noef", C.RandomK(ratio=0.5, ef=False)),
    ("dithering:4:natural:noef", C.Dithering(levels=4, natural=True, ef=False)),
    ("fp16", C.FP16()), ("none", None)])
def test_noef_switches_error_feedback_off_and_specs_read_back(spec, expected):
    got = C.parse(spec)
    assert got == expected
    assert C.parse(C.spec_of(got)) == got
    assert C.spec_of(got) == spec.replace("0.010", "0.01")


def test_a_torch_compression_from_a_spec_is_what_the_benches_train_with():
    """fp16/bf16 as the plugin's casts, the lossy kinds as the engine's, noef kept."""
    bps = pytest.importorskip("bpsctl.engine.torch")
    assert bps.Compression.from_spec("") is bps.Compression.none
    assert bps.Compression.from_spec("none") is bps.Compression.none
    assert bps.Compression.from_spec("fp16") is bps.Compression.fp16
    assert bps.Compression.from_spec("bf16") is bps.Compression.bf16
    assert bps.Compression.from_spec("onebit:noef").engine == C.OneBit(ef=False)
    with pytest.raises(ValueError, match="compression: expected one of onebit"):
        bps.Compression.from_spec("zip")


@pytest.mark.parametrize("args, message", [
    (["--compression", "onebit,zip"], "--compression: compression: expected one of onebit, "
                                      "topk:RATIO, randomk:RATIO, dithering:LEVELS (each with "
                                      ":noef for no error feedback), fp16, bf16 or none, got "
                                      "'zip'"),
    (["--compression", "topk:2:noef"], "--compression: topk ratio: expected a number in (0, 1], "
                                       "such as 0.01, got 2.0"),
    (["--compression", "bf16:noef"], "--compression: compression 'bf16:noef': noef is for the "
                                     "kinds with error feedback"),
    (["--compression", "onebit,onebit:noef,onebit"], "--compression: 'onebit' is given twice "
                                                     "(as onebit); give each compressor once"),
    (["--compression", "none"], "--compression: none is the uncompressed sync row"),
    (["--steps", "0"], "Invalid value for '--steps'"),
], ids=["unknown", "ratio", "fp16-noef", "twice", "none", "steps-0"])
def test_bad_convergence_compression_or_steps_exit_2_naming_it(tmp_path, monkeypatch, args,
                                                               message):
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BPSCTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    result = CliRunner().invoke(app, ["bench", "convergence", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_an_unknown_compressor_on_the_bench_exits_2(tmp_path, monkeypatch):
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    result = CliRunner().invoke(app, ["bench", "vgg16", "--compression", "topk:2"])
    assert result.exit_code == 2, result.output
    assert "topk ratio: expected a number in (0, 1], such as 0.01, got 2.0" in result.output


def test_a_name_pushed_with_another_compressor_is_refused(job):
    def body(worker):
        x = np.ones(1000, np.float32)
        worker.push_pull(x, name="x", compression=C.OneBit())
        with pytest.raises(ValueError, match=r"compression: tensor 'x' was pushed with onebit, "
                                             r"now with topk:0.01; use another name"):
            worker.push_pull(x, name="x", compression=C.TopK(ratio=0.01))
        return worker.push_pull(x, name="x", compression=C.OneBit())

    for got in job(1, 1, body, min_compress_bytes=0):
        assert got.tolist() == [1.0] * 1000


def test_a_bad_compressed_push_is_refused_naming_what_is_wrong():
    comp = C.TopK(ratio=0.1)
    wire = np.zeros(comp.wire_bytes(100), np.uint8)
    wire[:16] = np.frombuffer(comp.header(100), np.uint8)
    server = C.ServerCodec.open(wire, len(wire))
    unknown = wire.copy()
    unknown[0] = 99
    with pytest.raises(C.P.ProtocolError, match="compressed push of an unknown kind 99"):
        C.ServerCodec.open(unknown, len(unknown))
    with pytest.raises(C.P.ProtocolError, match=r"compressed push of 95 bytes, but its header "
                                                r"\(topk:0.1 of 100 values\) needs 96"):
        C.ServerCodec.open(wire[:95], 95)
    with pytest.raises(C.P.ProtocolError, match="shorter than its 16-byte header"):
        C.ServerCodec.open(wire[:8], 8)
    huge = C.OneBit().header(2**29)             # would need gigabytes of server buffers
    with pytest.raises(C.P.ProtocolError, match=f"compressed push of {2**29} values; a server "
                                                f"takes at most {2**28} per partition"):
        C.ServerCodec.open(huge, C.OneBit().wire_bytes(2**29))
    other = np.zeros(C.OneBit().wire_bytes(100), np.uint8)
    other[:16] = np.frombuffer(C.OneBit().header(100), np.uint8)
    with pytest.raises(C.P.ProtocolError, match="a push compressed with onebit, the first with "
                                                "topk:0.1; every worker must compress"):
        server.check(other, 3)
    beyond = wire.copy()
    beyond[16:20] = np.frombuffer(np.uint32(100).tobytes(), np.uint8)
    with pytest.raises(C.P.ProtocolError, match="an index 100 beyond its 100 values"):
        server.check(beyond, 3)


# --------------------------------------------------------------------------- failover

@pytest.fixture
def three_servers():
    """A private cluster of three servers that declares a silent one lost within 1 s."""
    with private_cluster(3, heartbeat_timeout_s=1.0) as state:
        yield state


def _compress_decompress(comp: C.Compressor, values: np.ndarray, key: C.Key) -> np.ndarray:
    body = np.empty(comp.body_bytes(len(values)), np.uint8)
    comp.encode(values.astype(np.float32), body, key)
    out = np.empty(len(values), np.float32)
    comp.decode(body, out, key)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("comp", [C.OneBit(), C.RandomK(ratio=0.1, seed=5)], ids=str)
def test_a_compressed_partition_moved_off_a_lost_server_starts_its_error_feedback_empty(
        three_servers, comp):
    """Round 0 completes; in round 1 ranks 0 and 1 have pushed when the partition's server is
    killed. All three push round 1 again, the same bytes, to the new server, which starts the
    partition at round 1 with no residual of its own: the sum is that of the compressed
    pushes (each worker's residual carried over from round 0), compressed once."""
    n = 1024
    grads = [[np.random.default_rng(10 * r + w).standard_normal(n).astype(np.float32)
              for w in range(3)] for r in range(2)]
    acked = threading.Barrier(3, timeout=30)

    def body(worker):
        first = worker.push_pull(grads[0][worker.rank], name="grad", average=False,
                                 compression=comp)
        part_id, index = worker._tensors["grad"]["parts"][0][:2]
        out = np.empty(n, np.float32)
        if worker.rank < 2:
            handle = worker.push_pull_async(grads[1][worker.rank], name="grad", average=False,
                                            out=out, compression=comp)
            wait_until(lambda: part_id in worker._active and part_id not in worker._unacked,
                       10, f"rank {worker.rank}'s push to be acknowledged")
            acked.wait()
        else:
            acked.wait()
            port = worker._servers[index]["port"]
            victim = next(p for p in three_servers.processes
                          if p.role == "server" and p.port == port)
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: gone(victim.pid), 5, "the server to die")
            handle = worker.push_pull_async(grads[1][worker.rank], name="grad", average=False,
                                            out=out, compression=comp)
        worker.synchronize(handle)
        return first, out, part_id, worker._tensors["grad"]["parts"][0][1] != index

    results = run_job(three_servers, 3, 3, body, min_compress_bytes=0,
                      heartbeat_timeout_s=1.0)
    part_id = results[0][2]
    assert all(moved for *_, moved in results)
    seed = comp.seed_word()
    # round 0 on the first server; each worker's residual goes on to round 1
    pushed0 = [_compress_decompress(comp, grads[0][w], (seed, part_id, 0, w)) for w in range(3)]
    total0 = np.sum(pushed0, axis=0, dtype=np.float32)
    want0 = _compress_decompress(comp, total0, (seed, part_id, 0, C.SERVER_STREAM))
    corrected = [grads[1][w] + (grads[0][w] - pushed0[w]) for w in range(3)]
    total1 = np.sum([_compress_decompress(comp, corrected[w], (seed, part_id, 1, w))
                     for w in range(3)], axis=0, dtype=np.float32)
    want1 = _compress_decompress(comp, total1, (seed, part_id, 1, C.SERVER_STREAM))
    for first, second, *_ in results:
        assert np.allclose(first, want0, rtol=1e-5, atol=1e-6)
        assert np.allclose(second, want1, rtol=1e-5, atol=1e-6)
    if isinstance(comp, C.OneBit):
        # the lost server's residual would have changed the sum: it is gone with it
        carried = _compress_decompress(comp, total1 + (total0 - want0),
                                       (seed, part_id, 1, C.SERVER_STREAM))
        assert not np.allclose(carried, want1, rtol=1e-5, atol=1e-6)
