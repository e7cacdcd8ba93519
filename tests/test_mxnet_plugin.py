"""bpsctl.engine.mxnet (the byteps.mxnet drop-in), on real worker processes.

Each script runs once as real workers (``run_local`` on a private cluster, 2 servers); every
rank records each check's outcome or its final parameters, and the tests assert them. MXNet
takes seconds to import on a busy 2-core machine, so there are few launches: the API
checks on 3 workers, Gluon training on 2, 3 and 4 workers (each variant against one
process on the concatenated batch), a traced run, and asynchronous training (BPSCTL_ASYNC) on 2
workers and on 1 (against MXNet's own SGD).
"""
from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import CHECK_HELPER

from bpsctl.config import Config
from bpsctl.launch.api import run_local

try:
    import mxnet as mx
    MXNET_MISSING = ""
except Exception as exc:        # noqa: BLE001 - ImportError, or AttributeError under numpy>=1.24
    mx, MXNET_MISSING = None, f"cannot import mxnet: {exc!r}"


@pytest.fixture(scope="module", autouse=True)
def _needs_mxnet():
    """Skips without mxnet, except under CI, which installs the ``[mxnet]`` extra (README)."""
    if MXNET_MISSING:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{MXNET_MISSING} under CI: the README's test command installs "
                        "'.[test,mxnet]' (mxnet 1.9.1 with numpy<1.24)")
        pytest.skip(MXNET_MISSING)

PRELUDE = textwrap.dedent('''
    import os
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")
    import json, sys, traceback
    import numpy as np
    import mxnet as mx
    import bpsctl.engine.mxnet as bps
    bps.init()
    R, N = bps.rank(), bps.size()
    OUT = sys.argv[1]
    RESULTS = {}

''') + CHECK_HELPER

EPILOGUE = textwrap.dedent('''
    with open(os.path.join(OUT, f"rank{R}.json"), "w") as f:
        json.dump(RESULTS, f)
    bps.shutdown()
''')


def run_script(tmp_path: Path, body: str, np_: int, *args: str, **knobs) -> list[dict]:
    """Run PRELUDE + body on ``np_`` workers (with config ``knobs``); return each rank's
    RESULTS."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + EPILOGUE)
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2, start_timeout_s=60.0,
                    op_timeout_s=30.0, **knobs)
    log = io.StringIO()
    result = run_local([sys.executable, str(script), str(out_dir), *args], np_, config,
                       servers=2, stdout=log, stderr=log)
    assert result.exit_code == 0, f"workers failed:\n{log.getvalue()[-4000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(np_)]


API_SCRIPT = '''
def ranked(r, shape, dtype):
    count = int(np.prod(shape))
    return ((np.arange(count, dtype=np.int64).reshape(shape) % 11) + r).astype(dtype)

def expected(shape, dtype):
    return sum(ranked(r, shape, np.int64) for r in range(N)).astype(dtype)

SHAPES = [(), (17,), (3, 4), (2, 3, 5), (0,)]

@check
def sums_across_dtypes_and_shapes():
    for dtype in [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8]:
        for shape in SHAPES:
            x = mx.nd.array(ranked(R, shape, dtype), dtype=dtype)
            assert bps.byteps_push_pull(x, name=f"sum.{np.dtype(dtype).name}.{shape}",
                                        is_average=False) is None
            assert x.dtype == dtype and x.shape == shape, (dtype, shape, x.dtype, x.shape)
            assert np.array_equal(x.asnumpy(), expected(shape, dtype)), (dtype, shape)

@check
def averages_across_float_dtypes_and_shapes():
    for dtype, rtol in [(np.float16, 1e-3), (np.float32, 1e-6), (np.float64, 1e-12)]:
        for shape in SHAPES:
            x = mx.nd.array(ranked(R, shape, dtype), dtype=dtype)
            bps.byteps_push_pull(x, name=f"avg.{np.dtype(dtype).name}.{shape}")
            assert x.dtype == dtype and x.shape == shape, (dtype, shape)
            want = expected(shape, np.float64) / N
            np.testing.assert_allclose(x.asnumpy().astype(np.float64), want, rtol=rtol,
                                       err_msg=str((dtype, shape)))

@check
def mxnet_numpy_arrays_and_views():
    with mx.util.np_shape(True), mx.util.np_array(True):
        x = mx.np.array(float(R + 1), dtype="float32")          # a 0-d mx.np.ndarray
        bps.byteps_push_pull(x, name="np.scalar", is_average=False)
        assert float(x) == N * (N + 1) / 2, float(x)
    whole = mx.nd.zeros((4, 5))
    rows = whole[1:3]                                         # shares memory, at an offset
    rows[:] = R + 1
    bps.byteps_push_pull(rows, name="rows", is_average=False)
    got = whole.asnumpy()
    assert np.all(got[1:3] == N * (N + 1) / 2) and np.all(got[[0, 3]] == 0), got

@check
def pending_mxnet_work_is_waited_for():
    x = mx.nd.ones((300, 300))
    for _ in range(5):
        x = mx.nd.dot(x, mx.nd.ones((300, 300))) / 300       # queued on MXNet's engine
    x += R
    bps.byteps_push_pull(x, name="pending", is_average=False)
    np.testing.assert_allclose(x.asnumpy(), np.full((300, 300), N + N * (N - 1) / 2), rtol=1e-5)

@check
def noname_and_declare():
    bps.byteps_declare_tensor("declared")
    for _ in range(3):
        x = mx.nd.ones((3,))
        bps.byteps_push_pull(x, is_average=False)
        assert np.array_equal(x.asnumpy(), np.full(3, N, np.float32))
    assert (bps.local_rank(), bps.local_size()) == (R, N)

@check
def rejects_what_it_cannot_push():
    for bad, error in [(np.ones(3, np.float32), TypeError),
                       (mx.nd.sparse.zeros("row_sparse", (4, 2)), TypeError)]:
        try:
            bps.byteps_push_pull(bad, name="bad")
            raise AssertionError(f"no {error.__name__} for {type(bad).__name__}")
        except error:
            pass
    try:
        bps.byteps_push_pull(mx.nd.ones((2,), dtype="int32"), name="bad.avg")
        raise AssertionError("averaging integers did not raise")
    except TypeError as exc:
        assert "average" in str(exc)

@check
def broadcast_dict_of_ndarrays():
    params = {"b": mx.nd.full((2, 3), 10 * R + 2), "a": mx.nd.full((4,), 10 * R + 1),
              "c": mx.nd.array(np.full((), np.nan if R != 1 else 5.0))}   # NaN is not summed
    bps.broadcast_parameters(params, root_rank=1)
    assert np.all(params["a"].asnumpy() == 11) and np.all(params["b"].asnumpy() == 12), params
    assert float(params["c"].asnumpy()) == 5.0

@check
def broadcast_gluon_parameters():
    mx.random.seed(100 + R)
    net = mx.gluon.nn.HybridSequential(prefix="bcast_")
    with net.name_scope():
        net.add(mx.gluon.nn.Dense(4, in_units=5), mx.gluon.nn.Dense(2, in_units=4))
    net.initialize()
    params = net.collect_params()
    bps.broadcast_parameters(params, root_rank=2 % N)
    for name, param in params.items():
        mine = param.data().astype("float64")
        total = mine.copy()
        bps.byteps_push_pull(total, name=f"check.{name}", is_average=False)
        assert np.array_equal(total.asnumpy(), N * mine.asnumpy()), name   # same on all ranks
    # a parameter whose shape is known at the first forward pass: broadcast then (Horovod's)
    deferred = mx.gluon.nn.Dense(3, prefix="late_", weight_initializer=mx.init.Constant(R))
    deferred.initialize()
    bps.broadcast_parameters(deferred.collect_params(), root_rank=2 % N)
    deferred(mx.nd.ones((1, 2)))
    assert np.all(deferred.weight.data().asnumpy() == 2 % N)
    never = mx.gluon.Parameter("never_initialized", shape=(2,))
    try:
        bps.broadcast_parameters({"never": never})
        raise AssertionError("broadcast of a parameter never initialized did not raise")
    except ValueError as exc:
        assert "'never'" in str(exc) and "not initialized" in str(exc)

@check
def trainer_parameter_order():
    # layers added in another order on odd ranks, each rank with its own values: every rank
    # ends with the root's value for each name
    layers = [("ones_", 1.0), ("twos_", 2.0), ("threes_", 3.0)]
    if R % 2:
        layers.reverse()
    net = mx.gluon.nn.Sequential()
    for prefix, value in layers:
        net.add(mx.gluon.nn.Dense(6, in_units=6, use_bias=False, prefix=prefix,
                                  weight_initializer=mx.init.Constant(value + 10 * R)))
    # and one layer whose shape is known only after the first forward pass
    net.add(mx.gluon.nn.Dense(2, use_bias=False, prefix="deferred_",
                              weight_initializer=mx.init.Constant(4.0 + 10 * R)))
    params = net.collect_params()
    net.initialize()
    trainer = bps.DistributedTrainer(params, "sgd", {"learning_rate": 0.0}, root_rank=0)
    assert [p.name for p in trainer._params] == sorted(params.keys())
    for prefix, value in layers:        # broadcast when the trainer is built
        weight = params[prefix + "weight"].data().asnumpy()
        assert np.all(weight == value), (prefix, weight)
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 6))).sum()
    loss.backward()
    trainer.step(2)                     # the deferred one: at the first step
    for prefix, value in layers + [("deferred_", 4.0)]:
        weight = params[prefix + "weight"].data().asnumpy()
        assert np.all(weight == value), (prefix, weight)

@check
def trainer_on_two_contexts():
    # each worker holds its parameter on two CPU contexts: broadcast reaches both copies, and
    # a gradient is the sum over both contexts and all workers
    param = mx.gluon.Parameter("two_ctx_weight", shape=(3,), init=mx.init.Constant(R + 1.0))
    param.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = bps.DistributedTrainer([param], "sgd", {"learning_rate": 0.0})
    for data in param.list_data():
        assert np.all(data.asnumpy() == 1.0), data
    for i, grad in enumerate(param.list_grad()):
        grad[:] = 10 * R + i
    trainer.allreduce_grads()
    want = sum(10 * r + i for r in range(N) for i in range(2))
    for grad in param.list_grad():
        assert np.all(grad.asnumpy() == want), (grad, want)

@check
def distributed_optimizer_updates_with_the_average():
    sgd = mx.optimizer.SGD(learning_rate=0.1)
    opt = bps.DistributedOptimizer(sgd)
    opt.rescale_grad = 0.5                      # written through to the wrapped optimizer
    assert sgd.rescale_grad == 0.5 and opt.learning_rate == 0.1
    opt.rescale_grad = 1.0
    updater = mx.optimizer.get_updater(opt)
    weight, grad = mx.nd.ones((3,)), mx.nd.full((3,), R + 1.0)
    updater(0, grad, weight)
    np.testing.assert_allclose(weight.asnumpy(), 1 - 0.1 * (N + 1) / 2, rtol=1e-6)
    # several indices at once (the aggregated path)
    weights = [mx.nd.ones((2,)), mx.nd.ones((4,))]
    grads = [mx.nd.full((2,), R + 1.0), mx.nd.full((4,), 2.0 * R)]
    opt.update([1, 2], weights, grads, [None, None])
    np.testing.assert_allclose(weights[0].asnumpy(), 1 - 0.1 * (N + 1) / 2, rtol=1e-6)
    np.testing.assert_allclose(weights[1].asnumpy(), 1 - 0.1 * (N - 1), rtol=1e-6)
'''


@pytest.fixture(scope="module")
def api_results(tmp_path_factory) -> list[dict]:
    return run_script(tmp_path_factory.mktemp("mxnet_api"), API_SCRIPT, 3)


CHECKS = ["sums_across_dtypes_and_shapes", "averages_across_float_dtypes_and_shapes",
          "mxnet_numpy_arrays_and_views", "pending_mxnet_work_is_waited_for",
          "noname_and_declare", "rejects_what_it_cannot_push", "broadcast_dict_of_ndarrays",
          "broadcast_gluon_parameters", "trainer_parameter_order", "trainer_on_two_contexts",
          "distributed_optimizer_updates_with_the_average"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS)
def test_api_on_three_workers(api_results, check):
    for rank, results in enumerate(api_results):
        assert results.get(check) == "ok", f"rank {rank}, {check}:\n{results.get(check)}"


# --------------------------------------------------------------------------- training

STEPS, LOCAL_BATCH = 5, 4

COMMON = textwrap.dedent('''
    def make_net(seed):
        mx.random.seed(seed)
        net = mx.gluon.nn.HybridSequential(prefix="net_")
        with net.name_scope():
            net.add(mx.gluon.nn.Dense(16, activation="relu", in_units=8),
                    mx.gluon.nn.Dense(4, in_units=16))
        net.initialize(mx.init.Xavier())
        return net

    def global_batch(step, workers):
        rng = np.random.RandomState(1000 + step)
        x = rng.randn(workers * LOCAL_BATCH, 8).astype(np.float32)
        y = rng.randint(0, 4, workers * LOCAL_BATCH).astype(np.float32)
        return mx.nd.array(x), mx.nd.array(y)

    OPTIMIZER = ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3})

    def train(net, trainer, workers, rank, batch_size):
        loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        for step in range(STEPS):
            x, y = global_batch(step, workers)
            lo, hi = rank * batch_size, (rank + 1) * batch_size
            with mx.autograd.record():
                loss = loss_fn(net(x[lo:hi]), y[lo:hi])
            loss.backward()
            trainer.step(batch_size)
        return {name: p.data().asnumpy().tolist() for name, p in net.collect_params().items()}
''')

# a training script's arguments: run_script(..., str(LOCAL_BATCH), str(STEPS))
SCRIPT_ARGS = '''
LOCAL_BATCH = int(sys.argv[2])
STEPS = int(sys.argv[3])
'''

TRAIN_SCRIPT = COMMON + SCRIPT_ARGS + '''
# every rank starts from its own random parameters: the root's are broadcast
net = make_net(seed=R)
trainer = bps.DistributedTrainer(net.collect_params(), *OPTIMIZER)
RESULTS["plain"] = train(net, trainer, N, R, LOCAL_BATCH)

net = make_net(seed=R)
trainer = bps.DistributedTrainer(net.collect_params(), *OPTIMIZER,
                                 compression=bps.Compression.fp16)
RESULTS["fp16"] = train(net, trainer, N, R, LOCAL_BATCH)

# BytePS's compression_params: onebit with error feedback, both ways through the servers
net = make_net(seed=R)
trainer = bps.DistributedTrainer(net.collect_params(), *OPTIMIZER, compression_params={
    "compressor": "onebit", "ef": "vanilla", "scaling": True})
RESULTS["onebit"] = train(net, trainer, N, R, LOCAL_BATCH)

# the optimizer wrapper under a plain Gluon trainer, after an explicit broadcast
net = make_net(seed=R)
bps.broadcast_parameters(net.collect_params(), root_rank=0)
opt = bps.DistributedOptimizer(mx.optimizer.create(OPTIMIZER[0], **OPTIMIZER[1]))
trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=None)
RESULTS["optimizer"] = train(net, trainer, N, R, LOCAL_BATCH)
'''


def _reference(workers: int) -> dict[str, np.ndarray]:
    scope = {"mx": mx, "np": np, "LOCAL_BATCH": LOCAL_BATCH, "STEPS": STEPS}
    exec(COMMON, scope)
    net = scope["make_net"](seed=0)
    trainer = mx.gluon.Trainer(net.collect_params(), *scope["OPTIMIZER"], kvstore=None)
    params = scope["train"](net, trainer, workers, 0, workers * LOCAL_BATCH)
    return {name: np.array(value) for name, value in params.items()}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_gluon_training_on_n_workers_matches_one_process_on_the_whole_batch(tmp_path, workers):
    results = run_script(tmp_path, TRAIN_SCRIPT, workers, str(LOCAL_BATCH), str(STEPS),
                         min_compress_bytes=0)
    reference = _reference(workers)
    for rank, result in enumerate(results):
        # onebit: every worker gets the same compressed sums, so holds the same parameters,
        # which are not the uncompressed ones
        for name, ref in reference.items():
            got = np.array(result["onebit"][name])
            assert np.array_equal(got, np.array(results[0]["onebit"][name])), (rank, name)
            assert np.isfinite(got).all() and not np.allclose(got, ref, atol=1e-6), name
    for variant, tolerance in [
        ("plain", 1e-6),          # float32 sums in another order: rounding only (seen: 3e-8)
        ("optimizer", 1e-6),      # averaged by DistributedOptimizer instead (seen: 3e-8)
        ("fp16", 1e-3),           # gradients rounded to float16 on the wire (seen: 1e-4)
    ]:
        first = results[0][variant]
        for rank, result in enumerate(results):
            params = result[variant]
            assert params.keys() == reference.keys()
            for name, ref in reference.items():
                got = np.array(params[name])
                # every worker holds exactly the same parameters
                assert np.array_equal(got, np.array(first[name])), f"rank {rank}: {name}"
                assert np.allclose(got, ref, rtol=tolerance, atol=tolerance), \
                    f"{variant} {name}: max |diff| {np.abs(got - ref).max():.2e} > {tolerance}"


TRACED_SCRIPT = COMMON + SCRIPT_ARGS + """
net = make_net(seed=R)
trainer = bps.DistributedTrainer(net.collect_params(), *OPTIMIZER)
RESULTS["params"] = train(net, trainer, N, R, LOCAL_BATCH)
"""


def test_a_traced_trainer_marks_its_steps_and_its_wait_for_the_gradients(tmp_path):
    """With BPSCTL_TRACE_DIR, each DistributedTrainer.step() is a step of the timeline (the
    traced window counts them) and its wait for the summed gradients a synchronize span."""
    traces = tmp_path / "traces"
    run_script(tmp_path, TRACED_SCRIPT, 2, str(LOCAL_BATCH), str(STEPS), trace_dir=str(traces))
    for rank in range(2):
        events = json.loads((traces / f"worker-{rank}" / "comm.json").read_text())["traceEvents"]
        begun = [e for e in events if e.get("ph") == "b"]
        steps = [e for e in begun if e["cat"] == "step"]
        waits = [e for e in begun if e["cat"] == "synchronize"]
        # the first step() starts the count: STEPS - 1 whole steps, each after its wait
        assert len(steps) == STEPS - 1
        assert len(waits) == STEPS and {e["name"] for e in waits} == {"DistributedTrainer.grad"}


# --------------------------------------------------------------------------- asynchronous

ASYNC_SCRIPT = '''
rng = np.random.RandomState(0)
X = rng.randn(256, 8).astype(np.float32)
inputs, targets = mx.nd.array(X), mx.nd.array(X @ rng.randn(8, 2).astype(np.float32))
mx.random.seed(100 + R)             # each rank its own initial parameters: rank 0's are broadcast
net = mx.gluon.nn.HybridSequential(prefix="async_")
with net.name_scope():
    net.add(mx.gluon.nn.Dense(16, activation="tanh", in_units=8),
            mx.gluon.nn.Dense(2, in_units=16))
net.initialize(mx.init.Xavier())
trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                 {"learning_rate": 0.05, "momentum": 0.9})
l2 = mx.gluon.loss.L2Loss()

def full_loss():
    return float(l2(net(inputs), targets).mean().asscalar())

def backward(lo):
    with mx.autograd.record():
        loss = l2(net(inputs[lo:lo + 16]), targets[lo:lo + 16])
    loss.backward()

losses = [full_loss()]
for step in range(40):
    backward((step * 2 + R) * 16 % 256)
    if step % 2:
        trainer.step(16)
    else:
        trainer.update(16)          # the allreduce_grads() + update() split, without the first
    losses.append(full_loss())
# a sum (synchronous in an async job) waits for both ranks: both have pushed their last gradient
done = mx.nd.ones((1,))
bps.byteps_push_pull(done, name="trained", is_average=False)
trainer.set_learning_rate(0.0)      # a last push that changes nothing: reads the servers' values
backward(0)
trainer.step(16)
RESULTS["losses"] = losses
RESULTS["sum"] = float(done.asscalar())
RESULTS["final"] = {name: p.data().asnumpy().tolist()
                    for name, p in sorted(net.collect_params().items())}

def refused(error, words, build):
    try:
        build()
    except error as exc:
        assert all(word in str(exc) for word in words), (words, str(exc))
    else:
        raise AssertionError(f"no {error.__name__}")

@check
def adam_is_refused():
    refused(ValueError, ["BPSCTL_ASYNC", "Adam", "mx.optimizer.SGD"],
            lambda: bps.DistributedTrainer(net.collect_params(), "adam"))

@check
def clip_gradient_is_refused():
    refused(ValueError, ["BPSCTL_ASYNC", "clip_gradient=1"],
            lambda: bps.DistributedTrainer(net.collect_params(), "sgd", {"clip_gradient": 1.0}))

@check
def compression_is_refused():
    refused(ValueError, ["BPSCTL_ASYNC", "compression=FP16Compressor"],
            lambda: bps.DistributedTrainer(net.collect_params(), "sgd",
                                           compression=bps.Compression.fp16))
    refused(ValueError, ["BPSCTL_ASYNC", "compression_params={'compressor': 'onebit'}"],
            lambda: bps.DistributedTrainer(net.collect_params(), "sgd",
                                           compression_params={"compressor": "onebit"}))
    refused(ValueError, ["BPSCTL_ASYNC", "gradient_predivide_factor=2: there is no sum"],
            lambda: bps.DistributedTrainer(net.collect_params(), "sgd",
                                           gradient_predivide_factor=2.0))

@check
def allreduce_grads_is_refused():
    backward(0)
    refused(bps.EngineError, ["allreduce_grads()", "BPSCTL_ASYNC", "update()"],
            trainer.allreduce_grads)

@check
def distributed_optimizer_is_refused():
    refused(bps.EngineError, ["DistributedOptimizer", "BPSCTL_ASYNC", "DistributedTrainer"],
            lambda: bps.DistributedOptimizer(mx.optimizer.SGD()))

@check
def two_contexts_hold_the_servers_parameters():
    # each worker holds the parameter on two CPU contexts: its gradient is their sum, and both
    # copies end with the servers' parameters: 1 - lr * sum / size, once per worker
    param = mx.gluon.Parameter("two_ctx_async_weight", shape=(3,), init=mx.init.Constant(1.0))
    param.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    two = bps.DistributedTrainer([param], "sgd", {"learning_rate": 1.0})

    def step():
        for i, ctx in enumerate([mx.cpu(0), mx.cpu(1)]):
            with mx.autograd.record():
                loss = (param.data(ctx) * (i + 1)).sum()
            loss.backward()
        two.step(1)

    step()
    bps.byteps_push_pull(mx.nd.ones((1,)), name="two_ctx.stepped", is_average=False)
    two.set_learning_rate(0.0)
    step()
    for data in param.list_data():
        assert np.all(data.asnumpy() == 1.0 - N * 3 / N), data

@check
def float16_parameters_are_refused():
    half = mx.gluon.nn.Dense(2, in_units=2, prefix="half_")
    half.initialize()
    half.cast("float16")
    half_trainer = bps.DistributedTrainer(half.collect_params(), "sgd",
                                          {"multi_precision": True})
    refused(ValueError, ["BPSCTL_ASYNC", "'half_bias' is float16", "float32"],
            lambda: half_trainer.update(1))
'''

ASYNC_CHECKS = ["adam_is_refused", "clip_gradient_is_refused", "compression_is_refused",
                "allreduce_grads_is_refused", "distributed_optimizer_is_refused",
                "two_contexts_hold_the_servers_parameters", "float16_parameters_are_refused"]


@pytest.mark.timeout(150)
def test_asynchronous_gluon_training_with_server_held_parameters(tmp_path):
    """Two workers train with DistributedTrainer("sgd", momentum 0.9) under BPSCTL_ASYNC: the
    loss falls, both end with the servers' parameters (every context's copy), sums still work,
    and what the servers do not run is refused."""
    results = run_script(tmp_path, ASYNC_SCRIPT, 2, async_mode=True)
    for rank, result in enumerate(results):
        assert {check: result.get(check) for check in ASYNC_CHECKS} == \
            dict.fromkeys(ASYNC_CHECKS, "ok"), f"rank {rank}"
        losses = result["losses"]
        assert losses[-1] < 0.5 * losses[0], (rank, losses[0], losses[-1])
        assert result["sum"] == 2.0
    assert results[0]["final"] == results[1]["final"]


SOLO = textwrap.dedent('''
    def solo_train(make_trainer):
        """6 steps of a Dense layer whose gradients do not depend on its parameters."""
        mx.random.seed(7)
        net = mx.gluon.nn.Dense(3, in_units=4, prefix="solo_")
        net.initialize(mx.init.Xavier())
        net.collect_params(".*bias").setattr("lr_mult", 0.5)
        net.collect_params(".*bias").setattr("wd_mult", 0.0)
        trainer = make_trainer(net.collect_params(), "sgd",
                               {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01})
        rng = np.random.RandomState(3)
        for _ in range(6):
            x, c = mx.nd.array(rng.randn(8, 4)), mx.nd.array(rng.randn(8, 3))
            with mx.autograd.record():
                loss = (net(x) * c).sum()
            loss.backward()
            trainer.step(8)
        return {name: p.data().asnumpy().tolist() for name, p in net.collect_params().items()}
''')


@pytest.mark.timeout(120)
def test_asynchronous_sgd_of_one_worker_is_mxnets_own_sgd(tmp_path):
    """The servers' SGD steps, fed rescaled gradients with the optimizer's learning rate (a
    parameter's lr_mult included), momentum and weight decay (wd_mult included), end where
    MXNet's own SGD does."""
    result, = run_script(tmp_path, SOLO + 'RESULTS["params"] = solo_train(bps.DistributedTrainer)',
                         1, async_mode=True)
    scope = {"mx": mx, "np": np}
    exec(SOLO, scope)
    reference = scope["solo_train"](lambda *args: mx.gluon.Trainer(*args, kvstore=None))
    assert result["params"].keys() == reference.keys()
    for name, ref in reference.items():
        got = np.array(result["params"][name])
        np.testing.assert_allclose(got, np.array(ref), rtol=1e-5, atol=1e-7, err_msg=name)
