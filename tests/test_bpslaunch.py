"""bpslaunch: a BytePS deployment's DMLC variables start bpsctl's roles, in any order.

Every role is a real ``bpslaunch`` process (``python -m bpsctl.launch.dmlc``, what the console
script runs) on loopback; each multi-process test has a deadline and stops what it started
by PID.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bpsctl.config import ConfigError
from bpsctl.engine import byteps
from bpsctl.launch import dmlc

if sys.version_info >= (3, 11):
    import tomllib
else:                                   # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: every variable BytePS's docs/env.md names, besides the DMLC_* role variables bpslaunch reads
ENV_MD = ["DMLC_ENABLE_RDMA", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BYTEPS_ENABLE_GDB",
          "BYTEPS_LOG_LEVEL", "BYTEPS_DEBUG_SAMPLE_TENSOR", "BYTEPS_FORCE_DISTRIBUTED",
          "PS_VERBOSE", "BYTEPS_PCIE_SWITCH_SIZE", "BYTEPS_PARTITION_BYTES",
          "BYTEPS_NCCL_NUM_RINGS", "BYTEPS_NCCL_GROUP_SIZE", "BYTEPS_SERVER_ENGINE_THREAD",
          "BYTEPS_SERVER_ENABLE_SCHEDULE", "BYTEPS_ENABLE_ASYNC", "BYTEPS_NUMA_ON",
          "BYTEPS_NUMA_DEFAULT_QUOTA", "BYTEPS_CPU_BLACKLIST", "BYTEPS_VISIBLE_CPU_CORES",
          "BYTEPS_MULTITHREADED_CPU"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _clean_env(**variables: str) -> dict[str, str]:
    """This environment without any BPSCTL_/DMLC_/BYTEPS_ variable, plus ``variables``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BPSCTL_", "DMLC_", "BYTEPS_", "PS_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["BPSCTL_STATE_DIR"] = env.get("TMPDIR", "/tmp")
    return {**env, **variables}


class Roles:
    """bpslaunch processes started by a test, each with its own log; all stopped by PID."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, name: str, env: dict[str, str], *cmd: str) -> subprocess.Popen:
        """``bpslaunch CMD`` with ``env``."""
        return self.start_argv(name, env, [sys.executable, "-m", "bpsctl.launch.dmlc", *cmd])

    def start_argv(self, name: str, env: dict[str, str], argv: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=self.workdir)
        self.started[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()

    def wait_all(self, timeout_s: float) -> dict[str, int]:
        """Every process's exit code; fails naming those still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        for name, process in self.started.items():
            try:
                codes[name] = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        hung = [name for name in self.started if name not in codes]
        assert not hung, f"still running after {timeout_s} s: {hung}\n" + "\n".join(
            f"--- {name}\n{self.log(name)}" for name in self.started)
        return codes

    def stop(self) -> None:
        pids: list[int] = []
        for process in self.started.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.started.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def roles(tmp_path: Path) -> Iterator[Roles]:
    started = Roles(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def _dmlc(port: int, role: str, **more: str) -> dict[str, str]:
    return _clean_env(DMLC_ROLE=role, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
                      DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", **more)


# --------------------------------------------------------------------------- fast


def test_each_bad_dmlc_variable_is_named_with_what_it_should_be():
    good = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "1"}
    spec = dmlc.parse_dmlc(good)
    assert (spec.role, spec.root, spec.worker_id) == ("worker", "10.0.0.1:9000", 1)
    cases = {"DMLC_ROLE": ("master", "expected scheduler, server or worker, got 'master'"),
             "DMLC_PS_ROOT_URI": ("", "DMLC_PS_ROOT_URI is not set"),
             "DMLC_PS_ROOT_PORT": ("70000", "DMLC_PS_ROOT_PORT: expected the scheduler's port"),
             "DMLC_NUM_WORKER": ("two", "DMLC_NUM_WORKER: expected the number of worker"),
             "DMLC_NUM_SERVER": ("0", "DMLC_NUM_SERVER: expected the number of servers"),
             "DMLC_WORKER_ID": ("2", "DMLC_WORKER_ID: expected this worker machine's index, "
                                     "0..1 (DMLC_NUM_WORKER=2), got 2")}
    for name, (value, message) in cases.items():
        with pytest.raises(dmlc.DmlcError, match=message.replace("(", r"\(").replace(")", r"\)")):
            dmlc.parse_dmlc({**good, name: value})
    with pytest.raises(dmlc.DmlcError, match="DMLC_ROLE: .* it is not set"):
        dmlc.parse_dmlc({k: v for k, v in good.items() if k != "DMLC_ROLE"})
    # a server needs no worker id
    assert dmlc.parse_dmlc({**good, "DMLC_ROLE": "server", "DMLC_WORKER_ID": ""}).worker_id == -1


def test_a_worker_machine_runs_one_process_per_visible_gpu_with_its_ranks():
    assert dmlc.local_gpus({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3"}) == 4
    assert dmlc.local_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}) == 2
    assert dmlc.local_gpus({"NVIDIA_VISIBLE_DEVICES": "none", "CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert dmlc.local_gpus({}) == 1
    spec = dmlc.parse_dmlc({"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1",
                            "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "3",
                            "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "1"})
    config, _ = dmlc.role_config(spec, {})
    env = dmlc._local_env(spec, config, 2, 1)
    assert env["BPSCTL_RANK"] == "3"
    assert (env["BPSCTL_WORLD_SIZE"], env["BPSCTL_LOCAL_RANK"], env["BPSCTL_LOCAL_SIZE"]) == \
        ("6", "1", "2")
    assert (env["BYTEPS_LOCAL_RANK"], env["BYTEPS_LOCAL_SIZE"]) == ("1", "2")


def test_several_processes_of_a_machine_sum_together_only_where_their_rendezvous_is_known(
        capsys):
    """The intra-node stage's rendezvous: a port bpslaunch picks on a job of one worker
    machine; MASTER_ADDR/MASTER_PORT where given; else each process pushes on its own, said
    once (the job end to end with MASTER_*: the 2 x 2 test below)."""
    from bpsctl.engine.dmlc import _intranode
    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "0"}
    one = dmlc.parse_dmlc({**base, "DMLC_NUM_WORKER": "1"})
    two = dmlc.parse_dmlc({**base, "DMLC_NUM_WORKER": "2"})
    config, _ = dmlc.role_config(two, {})
    assert _intranode(two, config, 1) is config                  # one process: no stage
    alone = _intranode(one, config, 2)
    assert alone.master_addr == "127.0.0.1" and alone.master_port > 0
    given = config.replace(master_addr="10.0.0.1", master_port=29500)
    assert _intranode(two, given, 2) is given
    capsys.readouterr()
    assert _intranode(two, config, 2).local_reduce == "off"
    said = capsys.readouterr().err
    assert said.count("its 2 processes push on their own (BPSCTL_LOCAL_REDUCE=off)") == 1


def test_every_byteps_knob_of_env_md_is_honoured_or_named_as_ignored():
    assert set(ENV_MD) <= set(byteps.BYTEPS_KNOBS)
    honoured = byteps.honoured()
    assert honoured["BYTEPS_PARTITION_BYTES"] == "BPSCTL_PARTITION_BYTES"
    assert honoured["BYTEPS_SERVER_ENGINE_THREAD"] == "BPSCTL_SERVER_THREADS"
    assert honoured["BYTEPS_ENABLE_ASYNC"] == "BPSCTL_ASYNC"
    every = {name: "1" for name in byteps.BYTEPS_KNOBS}
    found = byteps.translate({**every, "BYTEPS_PARTITION_BYTES": "4096000",
                              "BYTEPS_SERVER_ENGINE_THREAD": "4", "BYTEPS_TRACE_DIR": "/t"})
    assert found.env["BPSCTL_PARTITION_BYTES"] == "4096000"
    assert found.env["BPSCTL_SERVER_THREADS"] == "4"
    assert found.env["BPSCTL_TRACE_DIR"] == "/t"
    for name, knob in byteps.BYTEPS_KNOBS.items():
        if knob.ignored:        # each named once, as ignored
            assert sum(note.startswith(f"{name}=1 is ignored") for note in found.notes) == 1
    # BPSCTL_* wins, and the conflict is said; the same value is no conflict
    clash = byteps.translate({"BYTEPS_PARTITION_BYTES": "4096000",
                              "BPSCTL_PARTITION_BYTES": "1MiB", "BYTEPS_ENABLE_ASYNC": "1",
                              "BPSCTL_ASYNC": "true"})
    assert clash.env == {}
    assert clash.notes == ["BYTEPS_PARTITION_BYTES=4096000 and BPSCTL_PARTITION_BYTES=1MiB "
                           "are both set and differ: BPSCTL_PARTITION_BYTES wins"]
    unknown = byteps.translate({"BYTEPS_COMPRESSOR_TYPE": "x"})
    assert "BYTEPS_COMPRESSOR_TYPE=x is not a BytePS knob bpsctl knows" in unknown.notes[0]
    with pytest.raises(ConfigError, match="BYTEPS_SERVER_ENGINE_THREAD: expected an integer"):
        byteps.translate({"BYTEPS_SERVER_ENGINE_THREAD": "many"})


def test_a_key_turns_on_hmac_and_without_one_the_job_says_it_is_unauthenticated(tmp_path):
    spec = dmlc.parse_dmlc({"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1",
                            "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "1",
                            "DMLC_NUM_SERVER": "1"})
    config, _ = dmlc.role_config(spec, {"BPSCTL_SECRET": "s3"})
    assert (config.security, config.secret) == ("hmac", "s3")
    key = tmp_path / "key"
    key.write_text("from-a-file\n")
    config, notes = dmlc.role_config(spec, {"BPSCTL_SECRET_FILE": str(key)})
    assert (config.security, config.secret) == ("hmac", "from-a-file")
    assert any("BPSCTL_SECRET_FILE" in note for note in notes)
    config, _ = dmlc.role_config(spec, {})
    assert config.security == "none"
    with pytest.raises(dmlc.DmlcError, match="BPSCTL_SECURITY=hmac needs the job's secret"):
        dmlc.role_config(spec, {"BPSCTL_SECURITY": "hmac"})
    # what a user sees: one loud line, then the named error of a bad role
    done = subprocess.run([sys.executable, "-m", "bpsctl.launch.dmlc"], capture_output=True,
                          text=True, timeout=30, env=_clean_env(DMLC_ROLE="master"))
    assert done.returncode == 2
    assert "DMLC_ROLE: expected scheduler, server or worker, got 'master'" in done.stderr


def test_pyproject_installs_bpslaunch_beside_bpsctl():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["bpslaunch"] == "bpsctl.launch.dmlc:main"
    assert scripts["bpsctl"] == "bpsctl.cli:main"


# --------------------------------------------------------------------------- processes


def test_bad_variables_and_an_unreachable_root_end_each_role_by_its_deadline(roles):
    port = _free_port()         # nothing listens there
    started = time.monotonic()
    roles.start("late-id", _dmlc(port, "worker", DMLC_WORKER_ID="2"), "true")
    roles.start("worker", _dmlc(port, "worker", DMLC_WORKER_ID="0",
                                BPSCTL_START_TIMEOUT="1"), "true")
    roles.start("server", _dmlc(port, "server", BPSCTL_START_TIMEOUT="1"))
    codes = roles.wait_all(timeout_s=20)
    assert time.monotonic() - started < 20
    assert codes == {"late-id": 2, "worker": 1, "server": 1}
    assert "DMLC_WORKER_ID: expected this worker machine's index, 0..1" in roles.log("late-id")
    for name in ("worker", "server"):
        assert f"no scheduler answered at DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT = 127.0.0.1:{port} " \
               "within 1 s" in roles.log(name)
        assert "UNAUTHENTICATED" in roles.log(name)


def test_a_scheduler_and_a_server_no_worker_comes_to_end_naming_dmlc_num_worker(roles):
    port = _free_port()
    roles.start("scheduler", _dmlc(port, "scheduler", BPSCTL_START_TIMEOUT="2"))
    roles.start("server", _dmlc(port, "server", BPSCTL_START_TIMEOUT="2"))
    assert roles.wait_all(timeout_s=20) == {"scheduler": 1, "server": 1}
    for name in ("scheduler", "server"):
        assert "no worker of job 'dmlc' registered within 4 s (twice BPSCTL_START_TIMEOUT); " \
               "start the DMLC_NUM_WORKER=2 worker machines" in roles.log(name)


def test_two_workers_with_one_id_get_a_named_error_and_nothing_hangs(roles):
    port = _free_port()
    deadlines = {"BPSCTL_START_TIMEOUT": "6"}
    script = str(EXAMPLES / "push_pull.py")
    roles.start("scheduler", _dmlc(port, "scheduler", **deadlines))
    roles.start("server", _dmlc(port, "server", **deadlines))
    roles.start("worker-a", _dmlc(port, "worker", DMLC_WORKER_ID="0", **deadlines),
                sys.executable, script)
    roles.start("worker-b", _dmlc(port, "worker", DMLC_WORKER_ID="0", **deadlines),
                sys.executable, script)
    codes = roles.wait_all(timeout_s=45)
    assert all(codes.values()), codes
    logs = {name: roles.log(name) for name in codes}
    named = [name for name in ("worker-a", "worker-b")
             if "DMLC_WORKER_ID=0: rank 0 is already held by another worker" in logs[name]]
    assert len(named) == 1, logs
    assert "job 'dmlc' ended without finishing" in logs["scheduler"]
    assert "job 'dmlc' ended without finishing" in logs["server"]


def _losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[0] step")]


def _bpsctl_run(tmp_path: Path, *cmd: str) -> str:
    """What `bpsctl run -np 2 -- CMD` prints, for the same job started by bpslaunch."""
    done = subprocess.run(
        [sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path / "run"), "run", "-np",
         "2", "--", *cmd], capture_output=True, text=True, timeout=150, cwd=tmp_path,
        env=_clean_env())
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def _recipe(roles: Roles, common: dict[str, str], *cmd: str) -> dict[str, str]:
    """BytePS's docs/running.md: a scheduler, one server and two workers, each its own
    bpslaunch, started in a shuffled order; every log, once all have exited 0."""
    port = _free_port()
    order = [("scheduler", ()), ("server", ()), ("worker-0", cmd), ("worker-1", cmd)]
    random.shuffle(order)
    for name, args in order:
        role, _, worker_id = name.partition("-")
        more = {"DMLC_WORKER_ID": worker_id} if worker_id else {}
        roles.start(name, _dmlc(port, role, **common, **more), *args)
    codes = roles.wait_all(timeout_s=150)
    logs = {name: roles.log(name) for name in codes}
    assert codes == dict.fromkeys(codes, 0), (order, logs)
    assert "job 'dmlc' finished" in logs["scheduler"]
    assert "job 'dmlc' finished" in logs["server"]
    return logs


def test_bytepss_recipe_trains_the_example_in_any_start_order_as_bpsctl_run_does(
        roles, tmp_path):
    train = str(EXAMPLES / "train.py")
    reference = _bpsctl_run(tmp_path, sys.executable, train)
    key = tmp_path / "job.key"
    key.write_text("a-secret-every-machine-holds\n")
    logs = _recipe(roles, {"BPSCTL_SECRET_FILE": str(key), "BYTEPS_NUMA_ON": "1",
                           "BYTEPS_SERVER_ENGINE_THREAD": "3"}, sys.executable, train)
    assert _losses(logs["worker-0"]) == _losses(reference)
    assert len(_losses(logs["worker-0"])) == 5
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} of 2: weights match rank 0's" in logs[f"worker-{rank}"]
    for log in logs.values():
        assert "UNAUTHENTICATED" not in log
        assert log.count("BYTEPS_NUMA_ON=1 is ignored") == 1
    assert "with 3 summation threads" in logs["server"]
    assert "security hmac" in logs["scheduler"]


#: a BytePS Gluon script (BytePS's example/mxnet style) after the import swap
BYTEPS_MXNET_SCRIPT = """
import mxnet as mx
import numpy as np

import bpsctl.engine.mxnet as bps       # was: import byteps.mxnet as bps

bps.init()
mx.random.seed(42 + bps.rank())         # each rank its own initial weights: rank 0's win
net = mx.gluon.nn.Dense(4, in_units=8)
net.initialize(mx.init.Xavier(), ctx=mx.cpu())
params = net.collect_params()
bps.broadcast_parameters(params, root_rank=0)
trainer = bps.DistributedTrainer(params, "sgd", {"learning_rate": 0.1})
loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
rng = np.random.RandomState(7 + bps.rank())
for step in range(5):
    x = mx.nd.array(rng.randn(16, 8).astype(np.float32))
    y = mx.nd.array(rng.randint(0, 4, 16).astype(np.float32))
    with mx.autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(16)
total = sum(float(p.data().asnumpy().astype(np.float64).sum()) for p in params.values())
print(f"rank {bps.rank()} of {bps.size()}: parameters sum to {total!r}", flush=True)
bps.shutdown()
"""


def test_bytepss_recipe_trains_a_byteps_mxnet_script_as_bpsctl_run_does(roles, tmp_path):
    pytest.importorskip("mxnet")
    script = tmp_path / "train_gluon_byteps.py"
    script.write_text(BYTEPS_MXNET_SCRIPT)
    reference = _bpsctl_run(tmp_path, sys.executable, str(script))
    logs = _recipe(roles, {"BYTEPS_PARTITION_BYTES": "4096000"}, sys.executable, str(script))
    for rank in (0, 1):
        line = [x for x in reference.splitlines() if x.startswith(f"[{rank}] rank {rank} of 2")]
        assert len(line) == 1 and line[0] in logs[f"worker-{rank}"], (reference, logs)
        assert "UNAUTHENTICATED" in logs[f"worker-{rank}"]


@pytest.mark.parametrize("script", ["train", "mxnet"])
def test_bytepss_recipe_on_emulated_hosts_each_role_in_its_own_namespace(roles, tmp_path,
                                                                          script):
    """The recipe with each role on a host of its own: a network namespace of an emulated
    cluster (root), the scheduler's address that of its host, as on real machines; every line
    the workers print under `bpsctl run` they print the same."""
    from bpsctl.launch import emulate

    if script == "mxnet":
        pytest.importorskip("mxnet")
        path = tmp_path / "train_gluon_byteps.py"
        path.write_text(BYTEPS_MXNET_SCRIPT)
    else:
        path = EXAMPLES / "train.py"
    reference = _bpsctl_run(tmp_path, sys.executable, str(path))
    plan = emulate.plan_network(2, 2, None)
    with emulate.emulated_network(plan):
        root = plan.host("s0").address
        where = {"scheduler": "s0", "server": "s1", "worker-0": "w0", "worker-1": "w1"}
        order = list(where)
        random.shuffle(order)
        for name in order:
            role, _, worker_id = name.partition("-")
            env = {**_dmlc(9000, role, BPSCTL_SECRET="k"), "DMLC_PS_ROOT_URI": root}
            if worker_id:
                env["DMLC_WORKER_ID"] = worker_id
            cmd = [sys.executable, str(path)] if worker_id else []
            roles.start_argv(name, env, emulate.netns_command(
                plan.host(where[name]), [sys.executable, "-m", "bpsctl.launch.dmlc", *cmd]))
        codes = roles.wait_all(timeout_s=150)
    logs = {name: roles.log(name) for name in codes}
    assert codes == dict.fromkeys(codes, 0), (order, logs)
    printed = [line for line in reference.splitlines() if line.startswith("[")]
    assert len(printed) >= 2
    workers = (logs["worker-0"] + logs["worker-1"]).splitlines()
    assert [line for line in printed if line not in workers] == [], (reference, logs)
    assert f"serving on {root}:9000" in logs["scheduler"]
    assert f"serving on {plan.host('s1').address}:" in logs["server"]
    assert "job 'dmlc' finished" in logs["server"]


def test_two_machines_of_two_gpus_each_train_as_four_workers_of_bpsctl_run(roles, tmp_path):
    """NVIDIA_VISIBLE_DEVICES=0,1 on each of two worker machines: two processes each, ranks
    0-3, their intra-node stage meeting at MASTER_ADDR/MASTER_PORT (without them each process
    pushes on its own: the unit test above). The losses are bpsctl run -np 4's."""
    train = str(EXAMPLES / "train.py")
    reference = subprocess.run(
        [sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path / "run"), "run", "-np",
         "4", "--", sys.executable, train], capture_output=True, text=True, timeout=150,
        cwd=tmp_path, env=_clean_env())
    assert reference.returncode == 0, reference.stderr
    gpus = {"NVIDIA_VISIBLE_DEVICES": "0,1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port())}
    logs = _recipe(roles, gpus, sys.executable, train)
    assert _losses(logs["worker-0"]) == _losses(reference.stdout)
    for rank in range(4):
        assert f"[{rank}] rank {rank} of 4: weights match rank 0's" in logs[f"worker-{rank // 2}"]
    assert "push on their own" not in logs["worker-0"] + logs["worker-1"]


def test_workers_started_without_bpslaunch_join_as_bytepss_own_tests_start_them(roles):
    """BytePS's tests start the scheduler and server with bpslaunch and run the worker as a
    plain process with DMLC_ROLE=worker and BYTEPS_LOCAL_RANK/SIZE; here the workers start
    first and wait for the others."""
    port = _free_port()
    script = str(EXAMPLES / "push_pull.py")
    byteps_test = {"BYTEPS_LOCAL_RANK": "0", "BYTEPS_LOCAL_SIZE": "1",
                   "BYTEPS_FORCE_DISTRIBUTED": "1", "BYTEPS_THREADPOOL_SIZE": "4",
                   "BYTEPS_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    for worker_id in ("1", "0"):
        roles.start_argv(f"worker-{worker_id}",
                         _dmlc(port, "worker", DMLC_WORKER_ID=worker_id, **byteps_test),
                         [sys.executable, script])
    roles.start("server", _dmlc(port, "server"))
    roles.start("scheduler", _dmlc(port, "scheduler"))
    codes = roles.wait_all(timeout_s=60)
    logs = {name: roles.log(name) for name in codes}
    assert codes == dict.fromkeys(codes, 0), logs
    for rank in (0, 1):
        log = logs[f"worker-{rank}"]
        assert f"rank {rank} of 2 (local None of None): sum 3, expected 3" in log
        assert "BYTEPS_THREADPOOL_SIZE=4 is not a BytePS knob bpsctl knows" in log
        assert log.count("UNAUTHENTICATED") == 1
    assert "job 'dmlc' finished" in logs["scheduler"]


# --------------------------------------------------------------------------- host files


def test_bytepss_hostfile_pair_plans_the_cluster_its_hosts_yaml_would(tmp_path):
    from bpsctl.launch.hosts import load_byteps_hostfiles, parse_hosts_yaml
    from bpsctl.launch.plan import plan

    (tmp_path / "worker_hosts").write_text("10.0.0.1\n10.0.0.2:2222\n\n10.0.0.2:2222\n")
    (tmp_path / "server_hosts").write_text("# servers\n10.0.0.9\n10.0.0.9\n")
    pair = load_byteps_hostfiles(tmp_path / "worker_hosts", tmp_path / "server_hosts")
    yaml_form = parse_hosts_yaml(
        "scheduler: {host: 10.0.0.9}\nservers: [{host: 10.0.0.9, count: 2}]\n"
        "workers: [{host: 10.0.0.1}, {host: 10.0.0.2, slots: 2, ssh: {port: 2222}}]\n")

    def roles(spec):
        the_plan = plan(spec)
        return [(a.role, a.rank, a.host, a.port, a.local_rank, a.entry.ssh.port)
                for a in the_plan.assignments]

    assert roles(pair) == roles(yaml_form)
    (tmp_path / "bad").write_text("10.0.0.1\n10.0.0.2:ssh\n")
    with pytest.raises(ConfigError, match=r"--worker-hostfile .*bad:2: expected `host` or "
                                          r"`host:ssh_port` \(BytePS's dist_launcher.py"):
        load_byteps_hostfiles(tmp_path / "bad", tmp_path / "server_hosts")
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "up", "--worker-hostfile", str(tmp_path / "worker_hosts")],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert done.returncode == 2
    assert "--server-hostfile: BytePS's hostfiles come as a pair" in done.stderr


# --------------------------------------------------------------------------- Kubernetes


def _dmlc_manifests(**flags):
    from bpsctl.launch.k8s import K8sJob, render_manifests
    job = K8sJob(**{"workers": 2, "servers": 1, "image": "registry.example/bpsctl-worker:0.1",
                    "server_image": "registry.example/bpsctl-server:0.1",
                    "command": ("python3", "train.py"), "dmlc": True, **flags})
    return {(d["kind"], d["metadata"]["name"]): d for d in render_manifests(job, secret="k")}


def _container(manifests, job: str) -> dict:
    return manifests[("Job", job)]["spec"]["template"]["spec"]["containers"][0]


def test_k8s_render_dmlc_sets_bytepss_variables_and_validates_offline():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    yaml = pytest.importorskip("yaml")
    from typer.testing import CliRunner

    from bpsctl.cli import app
    runner = CliRunner()
    done = runner.invoke(app, ["k8s", "render", "--dmlc", "--workers", "3", "--servers", "2",
                               "--image", "img:1", "--gpus-per-worker", "8", "--namespace",
                               "training", "--", "python3", "train.py"])
    assert done.exit_code == 0, done.output
    documents = list(yaml.safe_load_all(done.stdout))
    for document in documents:
        kubernetes_validate.validate(document, "1.37.0", strict=True)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    worker = _container(by_name, "bpsctl-workers")
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in worker["env"]}
    assert worker["args"] == ["python3", "-m", "bpsctl.launch.dmlc", "python3", "train.py"]
    assert (env["DMLC_ROLE"], env["DMLC_NUM_WORKER"], env["DMLC_NUM_SERVER"]) == \
        ("worker", "3", "2")
    assert (env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"]) == ("bpsctl-scheduler", "9000")
    assert "job-completion-index" in str(env["DMLC_WORKER_ID"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert by_name[("Job", "bpsctl-servers")]["spec"]["completions"] == 2
    scheduler = {e["name"]: e for e in _container(by_name, "bpsctl-scheduler")["env"]}
    assert scheduler["DMLC_PS_ROOT_URI"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert by_name[("Service", "bpsctl-scheduler")]["spec"]["ports"][0]["port"] == 9000
    assert env["BPSCTL_SECRET"]["secretKeyRef"]["name"] == "bpsctl-secret"
    refused = runner.invoke(app, ["k8s", "render", "--dmlc", "--workers", "2", "--servers",
                                  "1", "--image", "i", "--hosts-per-node", "2", "--", "python3",
                                  "t.py"])
    assert refused.exit_code == 2
    assert "--hosts-per-node with --dmlc: bpslaunch runs one worker process per GPU" in \
        " ".join(refused.output.split())


def test_k8s_render_dmlc_pods_run_the_job_as_the_kubelet_would_start_them(roles):
    """Each rendered pod run here as the kubelet would: its env (the Secret, the pod IP and
    the completion index filled in, the scheduler Service's name standing for loopback) and
    its args (the server image's entrypoint is `python -m`), in a shuffled order."""
    port = _free_port()
    manifests = _dmlc_manifests(port=port, command=("python3", str(EXAMPLES / "push_pull.py")))
    pods = [("scheduler", "bpsctl-scheduler", None), ("server", "bpsctl-servers", None),
            ("worker-0", "bpsctl-workers", "0"), ("worker-1", "bpsctl-workers", "1")]
    random.shuffle(pods)
    for name, job, index in pods:
        container = _container(manifests, job)
        env = _clean_env()
        for variable in container["env"]:
            value = variable.get("value")
            source = str(variable.get("valueFrom", ""))
            if "secretKeyRef" in source:
                value = "k"
            elif "status.podIP" in source:
                value = "127.0.0.1"
            elif "job-completion-index" in source:
                value = index
            env[variable["name"]] = "127.0.0.1" if value == "bpsctl-scheduler" else value
        args = container["args"]
        argv = [sys.executable, *args[1:]] if args[0] == "python3" else \
            [sys.executable, "-m", *args]
        argv = [sys.executable if a == "python3" else a for a in argv]
        roles.start_argv(name, env, argv)
    codes = roles.wait_all(timeout_s=90)
    logs = {name: roles.log(name) for name in codes}
    assert codes == dict.fromkeys(codes, 0), (pods, logs)
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} of 2 (local 0 of 1): sum 3, expected 3" in \
            logs[f"worker-{rank}"]
    assert "security hmac" in logs["scheduler"]
    assert "job 'dmlc' finished" in logs["server"]
