"""Asynchronous training (BPSCTL_ASYNC): servers hold the parameters and apply each worker's
gradient as it arrives, as torch.optim.SGD would, exactly once, and answer with the parameters.

Engine tests run worker threads against the module's real scheduler and server processes; the
exactly-once test speaks the wire protocol to a server itself; the plugin test runs real
worker processes of a training script.
"""
from __future__ import annotations

import io
import json
import os
import secrets
import signal
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
import torch
import zmq
from conftest import CHECK_HELPER, cluster_config, gone, kill_pids, run_job, wait_until

import bpsctl
from bpsctl.config import Config, ConfigError, check_training_mode
from bpsctl.engine import EngineError, Worker
from bpsctl.engine import compression as C
from bpsctl.engine import protocol as P
from bpsctl.engine.security import Security
from bpsctl.launch import api
from bpsctl.launch.api import run_local

#: one partition summed inline, one on a summation thread, one tensor of two partitions (both
#: threaded): every way a server applies updates
SIZES = {"small": 1000, "large": 300_000, "two_parts": 600_000}
PLAIN_SGD = (1.0, 0.0, 0.0, 0.0, False)     # lr 1, no momentum: params -= gradient


def _gradient(rank: int, step: int, i: int, count: int) -> np.ndarray:
    """Integer-valued, different per rank, step and tensor: float32 sums of these are exact."""
    return ((np.arange(count) + 3 * rank + 5 * step + i) % 7 - 3).astype(np.float32)


def test_concurrent_updates_of_four_workers_are_each_applied_once(job):
    """4 workers push plain-SGD gradients as fast as they can: the parameters end as the
    init minus the sum of every gradient pushed (order does not matter: all exact), and every
    worker started from the same parameters, whichever init push came first."""
    steps = 25

    def body(w: Worker):
        params = {name: np.full(count, 1000.0 * (w.rank + 1), np.float32)
                  for name, count in SIZES.items()}
        for name, values in params.items():     # every rank's own values: one wins
            w.push_pull(values, name=name, out=values, async_init=True)
        start = {name: values.copy() for name, values in params.items()}
        w.barrier()         # else a fast rank's updates may be in a slower rank's start
        for step in range(steps):
            handles = [w.push_pull_async(_gradient(w.rank, step, i, len(values)), name=name,
                                         out=values, async_update=PLAIN_SGD)
                       for i, (name, values) in enumerate(params.items())]
            for handle in handles:
                w.synchronize(handle)
        w.barrier()                              # every gradient is in; read what is left
        for name, values in params.items():
            w.push_pull(np.zeros_like(values), name=name, out=values, async_update=PLAIN_SGD)
        return start, params

    results = job(4, 2, body, async_mode=True)
    for i, (name, count) in enumerate(SIZES.items()):
        # per partition, the first init push to arrive set the parameters, for everyone
        first = results[0][0][name]
        assert set(np.unique(first)) <= {1000.0, 2000.0, 3000.0, 4000.0}, np.unique(first)
        total = sum(_gradient(rank, step, i, count) for rank in range(4) for step in range(steps))
        for rank, (start, final) in enumerate(results):
            np.testing.assert_array_equal(start[name], first,
                                          err_msg=f"rank {rank} started elsewhere ({name})")
            np.testing.assert_array_equal(final[name], first - total,
                                          err_msg=f"rank {rank}'s final {name}")


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_the_server_steps_as_torch_sgd_does(job, nesterov):
    """One worker, momentum 0.9, weight decay and (without Nesterov) dampening, with a learning
    rate that changes every step: the server's parameters follow torch.optim.SGD's."""
    rng = np.random.default_rng(7)
    steps = 12
    dampening = 0.0 if nesterov else 0.1
    init = {name: rng.standard_normal(count).astype(np.float32)
            for name, count in SIZES.items() if name != "two_parts"}
    grads = [{name: rng.standard_normal(len(values)).astype(np.float32)
              for name, values in init.items()} for _ in range(steps)]
    lrs = [0.1 / (1 + step) for step in range(steps)]

    def body(w: Worker):
        params = {name: values.copy() for name, values in init.items()}
        for name, values in params.items():
            w.push_pull(values, name=name, out=values, async_init=True)
        for step in range(steps):
            for name, values in params.items():
                w.push_pull(grads[step][name], name=name, out=values,
                            async_update=(lrs[step], 0.9, 0.01, dampening, nesterov))
        return params

    [served] = job(1, 2, body, async_mode=True)
    local = {name: torch.tensor(values) for name, values in init.items()}
    sgd = torch.optim.SGD(list(local.values()), lr=lrs[0], momentum=0.9, weight_decay=0.01,
                          dampening=dampening, nesterov=nesterov)
    for step in range(steps):
        sgd.param_groups[0]["lr"] = lrs[step]
        for name, tensor in local.items():
            tensor.grad = torch.tensor(grads[step][name])
        sgd.step()
    for name, tensor in local.items():
        np.testing.assert_allclose(served[name], tensor.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        assert not np.array_equal(served[name], init[name])


def test_a_lost_server_ends_the_job_saying_its_parameters_are_gone():
    """kill -9 one of two servers mid-run: with failover on (the default), a synchronous job
    would go on; an asynchronous one fails at once, saying why."""
    with api.local_cluster(cluster_config(heartbeat_timeout_s=1.0), servers=2) as cluster:
        pids = [p.pid for p in cluster.processes]
        victim = next(p for p in cluster.processes if p.role == "server" and p.rank == 1)

        def body(w: Worker):
            # two tensors of two partitions each: both servers hold some
            params = [np.zeros(SIZES["two_parts"], np.float32) for _ in range(2)]
            for i, values in enumerate(params):
                w.push_pull(values, name=f"p{i}", out=values, async_init=True)
            os.kill(victim.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineError) as failed:
                while time.monotonic() < started + 20:
                    for i, values in enumerate(params):
                        w.push_pull(np.ones_like(values), name=f"p{i}", out=values,
                                    async_update=PLAIN_SGD)
            return str(failed.value), time.monotonic() - started

        try:
            [(message, seconds)] = run_job(cluster, 1, 2, body, async_mode=True)
        finally:
            kill_pids(pid for pid in pids if not gone(pid))
            wait_until(lambda: all(gone(pid) for pid in pids), 5, "the cluster to exit")
    assert f"server 1 at {victim.host}:{victim.port}" in message, message
    assert "under asynchronous training (BPSCTL_ASYNC) the servers hold the model's " \
           "parameters, and that server's are gone with it" in message, message
    assert seconds < 3, seconds         # at once, not after the failover's wait


# --------------------------------------------------------------------------- the wire

class _Peer:
    """A worker's connection to one server, spoken by hand: the hmac handshake, HELLO, pushes."""

    def __init__(self, ctx: zmq.Context, address: str, secret: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")
        ours = secrets.token_bytes(16)
        self.sock.send_multipart(P.control(P.AUTH, {"version": bpsctl.__version__,
                                                    "nonce": ours.hex()}))
        theirs = bytes.fromhex(self.expect(P.CHALLENGE)[1]["nonce"])
        self.sock.send_multipart(P.control(P.PROOF, {"proof": Security("hmac", secret)._proof(
            b"connecting", theirs, ours)}))
        self.sock.send_multipart(P.control(P.HELLO, {
            "job": f"test-{uuid.uuid4().hex[:12]}", "rank": 0, "world_size": 1,
            "version": bpsctl.__version__}))

    def expect(self, wanted: int) -> tuple[tuple[int, ...], object]:
        assert self.sock.poll(5000), "the server did not answer within 5 s"
        frames = self.sock.recv_multipart()
        header = P.unpack_header(frames[0])
        if header[0] != wanted:
            raise AssertionError(f"expected {P.TYPE_NAMES[wanted]}, got "
                                 f"{P.TYPE_NAMES.get(header[0])}: {frames[1:]!r}")
        if wanted in (P.CHALLENGE, P.ERROR):
            return header, json.loads(frames[1])
        return header, np.frombuffer(frames[1], np.float32) if len(frames) > 1 else None

    def push(self, values: np.ndarray, round_: int, init: bool = False) -> np.ndarray:
        """One async push and its answer: the parameters."""
        flags = P.FLAG_ASYNC | (P.FLAG_ASYNC_INIT if init else 0)
        frames = [P.pack_header(P.PUSH, dtype=P.DTYPE_CODES[values.dtype], flags=flags, part=0,
                                round=round_, nbytes=values.nbytes), values.tobytes()]
        if not init:
            frames.append(P.ASYNC_HYPER.pack(*PLAIN_SGD))
        self.sock.send_multipart(frames)
        self.expect(P.ACK)
        header, params = self.expect(P.RESULT)
        assert header[2] == P.FLAG_ASYNC and header[5] == round_, header
        assert isinstance(params, np.ndarray)
        return params


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_push_sent_twice_is_applied_once(engine_cluster, size):
    """The same header and payload twice (a retry after a lost answer): the server answers
    both with the parameters, applying the gradient once; an init push sent again later does
    not reset the parameters; the next round is applied."""
    count = SIZES[size]
    server = next(p for p in engine_cluster.processes if p.role == "server")
    ctx = zmq.Context()
    try:
        peer = _Peer(ctx, f"{server.host}:{server.port}", engine_cluster.secret)
        init = np.full(count, 10.0, np.float32)
        grad = np.ones(count, np.float32)
        np.testing.assert_array_equal(peer.push(init, 0, init=True), init)
        np.testing.assert_array_equal(peer.push(grad, 1), init - grad)
        np.testing.assert_array_equal(peer.push(grad, 1), init - grad)      # not applied again
        np.testing.assert_array_equal(peer.push(init * 3, 0, init=True), init - grad)
        np.testing.assert_array_equal(peer.push(grad, 2), init - 2 * grad)
        # a gradient of another size for the same parameters is refused, naming both
        peer.sock.send_multipart([P.pack_header(P.PUSH, dtype=9, flags=P.FLAG_ASYNC, part=0,
                                                round=3, nbytes=8), b"\0" * 8,
                                  P.ASYNC_HYPER.pack(*PLAIN_SGD)])
        _, error = peer.expect(P.ERROR)
        assert "pushed 8 bytes of float32, but its parameters are" in str(error), error
        # an update of parameters nobody has set is refused too
        peer.sock.send_multipart([P.pack_header(P.PUSH, dtype=9, flags=P.FLAG_ASYNC, part=1,
                                                round=1, nbytes=8), b"\0" * 8,
                                  P.ASYNC_HYPER.pack(*PLAIN_SGD)])
        _, error = peer.expect(P.ERROR)
        assert "partition 1: rank 0's async push came before any init push" in str(error), error
    finally:
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- bad input

def test_what_asynchronous_training_cannot_go_with_is_refused_naming_both():
    config = Config(async_mode=True, world_size=4)
    with pytest.raises(ConfigError, match=r"--async / BPSCTL_ASYNC with --compression onebit: "
                                          r"asynchronous training sends gradients and "
                                          r"parameters uncompressed"):
        check_training_mode(config, {"async_mode": "--async", "compression": "--compression"},
                            compression="onebit")
    with pytest.raises(ConfigError, match=r"BPSCTL_ASYNC with BPSCTL_MAX_RESTARTS 2: a "
                                          r"worker joins a running job at a step with no "
                                          r"push_pull in flight, which asynchronous training "
                                          r"never has"):
        check_training_mode(config.replace(max_restarts=2))
    with pytest.raises(ConfigError, match=r"BPSCTL_ASYNC with --max-workers / "
                                          r"BPSCTL_MAX_WORKERS 6: a worker joins"):
        check_training_mode(config.replace(max_workers=6), {"max_workers": "--max-workers"})
    check_training_mode(config.replace(max_workers=4))      # the job's own size: no growth


def test_an_engine_push_of_asynchronous_training_refuses_what_it_cannot_be(job):
    def body(w: Worker):
        grad = np.ones(4, np.float32)
        with pytest.raises(ValueError, match=r"asynchronous training \(BPSCTL_ASYNC\) of 'g' "
                                             r"with compression topk:0\.5: servers apply each "
                                             r"gradient as it comes"):
            w.push_pull(grad, name="g", compression=C.parse("topk:0.5"), async_update=PLAIN_SGD)
        with pytest.raises(TypeError, match=r"servers hold float32 or float64 parameters, got "
                                            r"float16"):
            w.push_pull(grad.astype(np.float16), name="h", async_init=True)
        with pytest.raises(ValueError, match=r"Nesterov momentum needs a momentum and zero "
                                             r"dampening"):
            w.push_pull(grad, name="g", async_update=(0.1, 0.0, 0.0, 0.0, True))
        # a tensor summed is not trained asynchronously under the same name, nor the reverse
        w.push_pull(grad, name="summed", average=False)
        with pytest.raises(EngineError, match=r"a tensor is either summed or trained "
                                            r"asynchronously; use another name"):
            w.push_pull(grad, name="summed", async_init=True)

    job(1, 1, body, async_mode=True)

    def not_async(w: Worker):
        with pytest.raises(ValueError, match=r"this worker's job is not asynchronous; set "
                                             r"BPSCTL_ASYNC=1"):
            w.push_pull(np.ones(4, np.float32), name="g", async_init=True)

    job(1, 1, not_async)


# --------------------------------------------------------------------------- the torch plugin

TRAIN_SCRIPT = textwrap.dedent('''
    import json, os, sys, traceback
    import torch
    import bpsctl.engine.torch as bps
    torch.set_num_threads(1)
    bps.init()
    R = bps.rank()
    RESULTS = {}
''') + CHECK_HELPER + textwrap.dedent('''
    torch.manual_seed(0)
    teacher = torch.nn.Linear(8, 2)
    inputs = torch.randn(256, 8)
    targets = teacher(inputs).detach()
    torch.manual_seed(100 + R)                  # each rank its own initial model
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 2))
    # with BPSCTL_FUSION_BYTES=512 the buckets are [4.bias, 4.weight, 2.bias] (fused),
    # [2.weight], and the first layer's two alone: it is another param group
    sgd = torch.optim.SGD([{"params": list(model[0].parameters()), "weight_decay": 0.0},
                           {"params": list(model[2].parameters()) + list(model[4].parameters())}],
                          lr=0.05, momentum=0.9, weight_decay=1e-4)
    opt = bps.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    # the broadcast model's loss: the same on both ranks (the first loss after a step is not:
    # asynchronous training lets one rank run ahead, and the other's first pull has its steps)
    initial = torch.nn.functional.mse_loss(model(inputs), targets).item()
    losses = []
    for step in range(40):
        batch = slice((step * 2 + R) * 16 % 256, (step * 2 + R) * 16 % 256 + 16)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        opt.step()
        losses.append(torch.nn.functional.mse_loss(model(inputs), targets).item())
    bps.broadcast_object("trained", root_rank=0)  # both have pushed their last gradient
    for group in opt.param_groups:                # a last push that changes nothing: read
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad.zero_()
    opt.step()
    final = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    final_loss = torch.nn.functional.mse_loss(model(inputs), targets).item()

    @check
    def other_optimizers_are_refused():
        try:
            bps.DistributedOptimizer(torch.optim.Adam(model.parameters()))
        except ValueError as exc:
            assert "BPSCTL_ASYNC" in str(exc) and "torch.optim.adam.Adam" in str(exc) and \\
                "wrap a torch.optim.SGD" in str(exc), exc
        else:
            raise AssertionError("Adam was accepted")

    @check
    def compression_is_refused():
        try:
            bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     compression=bps.Compression.fp16)
        except ValueError as exc:
            assert "BPSCTL_ASYNC" in str(exc) and "compression" in str(exc), exc
        else:
            raise AssertionError("compression was accepted")

    @check
    def cross_barrier_is_refused():
        from bpsctl.engine.torch.cross_barrier import CrossBarrier
        try:
            CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except bps.EngineError as exc:
            assert "BPSCTL_ASYNC" in str(exc) and "DistributedOptimizer" in str(exc), exc
        else:
            raise AssertionError("CrossBarrier was accepted")

    @check
    def ddp_is_refused():
        try:
            bps.DistributedDataParallel(torch.nn.Linear(2, 2))
        except bps.EngineError as exc:
            assert "BPSCTL_ASYNC" in str(exc) and "DistributedOptimizer" in str(exc), exc
        else:
            raise AssertionError("DistributedDataParallel was accepted")

    with open(os.path.join(sys.argv[1], f"rank{R}.json"), "w") as f:
        json.dump({"initial": initial, "losses": losses, "final": final, "final_loss": final_loss,
                   "results": RESULTS,
                   "buckets": [len(b.params) for b in opt._sync.buckets],
                   "stage": bps._p().stage is not None}, f)
    bps.shutdown()
''')


def test_torch_training_with_server_held_parameters(tmp_path):
    """Two workers train with bps.DistributedOptimizer(SGD) under BPSCTL_ASYNC: the loss
    falls, both end with the same parameters, and what async cannot do is refused."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                    start_timeout_s=30.0, op_timeout_s=30.0, async_mode=True, fusion_bytes=512)
    log = io.StringIO()
    result = run_local([sys.executable, str(script), str(out)], 2, config, servers=2,
                       stdout=log, stderr=log)
    assert result.exit_code == 0, f"workers failed:\n{log.getvalue()[-4000:]}"
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert record["results"] == {"other_optimizers_are_refused": "ok",
                                     "compression_is_refused": "ok",
                                     "cross_barrier_is_refused": "ok", "ddp_is_refused": "ok"}, \
            record["results"]
        assert not record["stage"]                      # every worker pushes on its own
        assert record["buckets"] == [3, 1, 1, 1], record["buckets"]
        # a rank's last own loss depends on how far the other had got when it last pulled:
        # the one that finishes first has seen fewer of the other's steps
        assert record["losses"][-1] < 0.2 * record["initial"], (rank, record["initial"],
                                                                record["losses"])
        # the trained model, every gradient of both ranks applied
        assert record["final_loss"] < 0.1 * record["initial"], (rank, record["initial"],
                                                                record["final_loss"])
    assert records[0]["final"] == records[1]["final"]

