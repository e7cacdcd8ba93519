"""Which way gradients travel (engine/paths.py): a job of one worker sends nothing, NCCL only
where every host's workers have GPUs of their own, decided alike on every rank; and the
benchmarks' choice of device and baseline backend (bench/gpu.py). Pure decisions are tested
for every case here; the CUDA paths themselves are in test_torch_gpu.py (marked gpu)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from conftest import wait_until

from bpsctl.bench.gpu import (
    TRAIN_DEFAULTS,
    HostGPUs,
    baseline_backend,
    check_horovod_nccl,
    resolve_device,
)
from bpsctl.bench.horovod import build_env
from bpsctl.config import Config, ConfigError
from bpsctl.engine.intranode import _job_veto
from bpsctl.engine.paths import (
    GRADIENT_PATHS,
    gradient_path,
    nccl_veto,
    nccl_within_hosts,
    solo_job,
)
from bpsctl.trace.api import load, summarize

# --------------------------------------------------------------------------- one worker


@pytest.mark.parametrize(("knobs", "size", "joined", "solo"), [
    ({}, 1, False, True),
    ({}, 2, False, False),
    ({"force_distributed": True}, 1, False, False),
    ({"async_mode": True}, 1, False, False),            # the servers hold the parameters
    ({"max_workers": 4}, 1, False, False),              # the job may grow
    ({"max_workers": 1}, 1, False, True),
    ({}, 1, True, False),                               # joined a running job
])
def test_only_a_job_of_one_worker_that_stays_one_skips_the_servers(knobs, size, joined, solo):
    assert solo_job(Config(**knobs), size, joined) is solo


def _one_worker_job(cluster, trace_dir: Path, **knobs) -> list[np.ndarray]:
    from conftest import run_job

    def body(worker):
        results = []
        for step in range(3):
            grads = [np.arange(1000, dtype=np.float32) * (step + 1),
                     np.full((3, 7), 2.5, np.float64)]
            handles = [worker.push_pull_async(g, name=f"g{i}", average=i == 0)
                       for i, g in enumerate(grads)]
            results += [worker.synchronize(h).copy() for h in handles]
        # a name stays bound to its first shape, as in any job
        handle = worker.push_pull_async(np.zeros(5, np.float32), name="g0")
        with pytest.raises(ValueError, match=r"'g0' was declared as float32\(1000,\)"):
            worker.synchronize(handle)
        return results
    (results,) = run_job(cluster, 1, 2, body, trace_dir=str(trace_dir), **knobs)
    return results


def test_one_worker_sends_nothing_unless_forced_and_gets_the_same_sums(engine_cluster,
                                                                       tmp_path):
    alone = _one_worker_job(engine_cluster, tmp_path / "alone")
    forced = _one_worker_job(engine_cluster, tmp_path / "forced", force_distributed=True)
    for mine, theirs in zip(alone, forced, strict=True):
        assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs)
    # a server writes a job's trace when it ends, and only if it summed something: once the
    # second job's are there, the first job's servers have long said what they had
    for rank in range(2):
        wait_until(lambda r=rank: (tmp_path / "forced" / f"server-{r}" / "comm.json").exists(),
                   20, f"server {rank}'s trace (written when the job ends)")
    assert not list((tmp_path / "alone").glob("server-*/comm.json")), \
        "a job of one worker pushed to the servers"
    summed = sum(s["bytes_summed"] for s in summarize(load(tmp_path / "forced"))["servers"])
    assert summed >= 3 * (4000 + 168), summed


TORCH_SCRIPT = textwrap.dedent('''
    import sys, torch
    import bpsctl.engine.torch as bps
    torch.set_num_threads(1)

    HOOKS, SHM = [], []

    def train(distributed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            # a broadcast is pushed once: forced, it reaches the server on this host over TCP
            # and keeps no shared-memory slot; a push_pull of a name takes one
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
            SHM.append(bps._p().worker.stats()["shm_pushes"])
            bps.push_pull(torch.ones(10), name="probe")
            SHM.append(bps._p().worker.stats()["shm_pushes"])
            opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=bps.Compression.fp16)
            HOOKS.append(len(opt._sync.hooks))      # alone: backward runs as plain torch's
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model

    bps.init()
    mine, plain = train(True), train(False)
    same = all(torch.equal(a, b) for a, b in zip(mine.parameters(), plain.parameters()))
    print("SHM", *SHM, "HOOKS", HOOKS[0], "PATH", bps.gradient_path(cuda=False), "SAME", same,
          flush=True)
    bps.shutdown()
''')


@pytest.mark.parametrize("force", [False, True])
def test_one_torch_worker_trains_as_plain_torch_unless_forced(tmp_path, force):
    """Alone, DistributedOptimizer is the optimizer itself, bit for bit (fp16 compression
    included: nothing is compressed when nothing travels); forced through the servers, the
    fp16 round trip shows."""
    script = tmp_path / "train.py"
    script.write_text(TORCH_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "run", "-np", "1", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120, env=_env(force))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if "PATH" in line)
    assert line.endswith("SHM 0 1 HOOKS 4 PATH servers SAME False" if force
                         else "SHM 0 0 HOOKS 0 PATH none SAME True"), line


def _env(force: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BPSCTL_")}
    if force:
        env["BPSCTL_FORCE_DISTRIBUTED"] = "1"
    return env


# --------------------------------------------------------------------------- NCCL or not

def test_a_host_vetoes_nccl_before_any_tensor_for_what_it_lacks():
    assert nccl_veto(False, True, 8, 8) == "this torch has no NCCL"
    assert nccl_veto(True, False, 0, 2) == "no CUDA device is visible"
    assert nccl_veto(True, True, 1, 2) == ("2 workers share this host's 1 GPU (NCCL needs one "
                                           "GPU per worker)")
    assert nccl_veto(True, True, 8, 4) is None
    assert nccl_veto(True, True, 4, 4) is None


@pytest.mark.parametrize(("devices", "local_size", "distinct", "why"), [
    (["a", "b", "c", "d"], 4, True, "distinct GPUs"),
    (["a", "b", "a", "b"], 2, True, "distinct"),            # two hosts, each its own a and b
    (["a", "a"], 2, False, "ranks 0 and 1 share one GPU (a)"),
    (["a", "b", "c", "c"], 2, False, "ranks 2 and 3 share one GPU (c)"),   # the second host
    (["a", None, "c", "d"], 2, False, "rank 1 pushes no CUDA tensor"),     # mixed devices
    (["a"], 1, True, "distinct"),
])
def test_nccl_only_where_every_hosts_workers_have_gpus_of_their_own(devices, local_size,
                                                                     distinct, why):
    got, reason = nccl_within_hosts(devices, local_size)
    assert got is distinct and why in reason


def _agree(vetoes: list[str | None]) -> list[str | None]:
    store = dist.HashStore()
    answers: list[str | None] = [None] * len(vetoes)

    def one(rank: int) -> None:
        answers[rank] = _job_veto("k", rank, len(vetoes), vetoes[rank], 10.0, store)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(vetoes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads)
    return answers


def test_every_rank_takes_the_same_nccl_decision():
    assert _agree([None, None, None]) == [None, None, None]
    # one host without enough GPUs: every rank knows, and the ones that waited say which
    answers = _agree([None, "no CUDA device is visible", None])
    assert all(answer is not None for answer in answers)
    assert answers[0] == answers[2] == "rank 1: no CUDA device is visible"
    # a rank that has a veto answers at once, without waiting for the others
    store = dist.HashStore()
    assert _job_veto("k", 1, 4, "x", 10.0, store) == "rank 1: x"


@pytest.mark.parametrize(("case", "path"), [
    ({"solo": True, "cuda": True, "stage": False, "nccl": False, "local_only": False}, "none"),
    ({"solo": True, "cuda": False, "stage": False, "nccl": False, "local_only": False}, "none"),
    ({"solo": False, "cuda": True, "stage": True, "nccl": True, "local_only": True},
     "nccl-local"),
    ({"solo": False, "cuda": True, "stage": True, "nccl": True, "local_only": False},
     "nccl+servers"),
    ({"solo": False, "cuda": True, "stage": True, "nccl": False, "local_only": True},
     "host-staged"),                                     # a shared GPU
    ({"solo": False, "cuda": True, "stage": False, "nccl": False, "local_only": False},
     "host-staged"),                                     # one worker per host
    ({"solo": False, "cuda": False, "stage": True, "nccl": False, "local_only": True},
     "shm-local"),
    ({"solo": False, "cuda": False, "stage": False, "nccl": False, "local_only": False},
     "servers"),
])
def test_the_gradient_path_names_each_case(case, path):
    assert gradient_path(**case) == path
    assert path in GRADIENT_PATHS


# --------------------------------------------------------------------------- bench

def _gpus(count: int, host: str = "h", cuda: str | None = "13.0") -> HostGPUs:
    return HostGPUs(host=host, count=count, name="NVIDIA H200" if count else None,
                    torch="2.11.0", cuda=cuda)


def test_the_device_is_cuda_only_where_every_worker_host_has_a_gpu():
    assert resolve_device("auto", [_gpus(8), _gpus(8)]) == "cuda"
    assert resolve_device("auto", [_gpus(8), _gpus(0)]) == "cpu"
    assert resolve_device("auto", []) == "cpu"
    assert resolve_device("cpu", [_gpus(8)]) == "cpu"
    assert resolve_device("cuda", [_gpus(1)]) == "cuda"
    with pytest.raises(ConfigError, match=r"--device cuda: h2 has no CUDA device: torch 2.11.0 "
                                          r"there is a CPU build"):
        resolve_device("cuda", [_gpus(8), _gpus(0, "h2", cuda=None)])
    with pytest.raises(ConfigError, match="--device: expected one of auto, cuda, cpu"):
        resolve_device("gpu", [])
    assert TRAIN_DEFAULTS["cuda"] == {"batch_size": 64, "image_size": 224}


def test_the_nccl_baselines_fall_back_to_gloo_where_workers_share_a_gpu():
    assert baseline_backend("cuda", [8, 8], [8, 8]) == ("nccl", "one GPU per worker")
    backend, why = baseline_backend("cuda", [2], [1])
    assert backend == "gloo" and "2 workers share 1 GPU" in why
    assert baseline_backend("cpu", [2], [0])[0] == "gloo"


def test_horovod_without_nccl_is_refused_on_gpus_saying_how_to_rebuild():
    check_horovod_nccl([HostGPUs(host="h", count=1, horovod_nccl=True)])
    with pytest.raises(ConfigError, match=r"built without NCCL.*bpsctl install horovod --force"):
        check_horovod_nccl([HostGPUs(host="h", count=1, horovod_nccl=False)])


def test_horovod_is_built_with_nccl_only_where_cuda_and_nccl_are_found():
    assert "HOROVOD_GPU_OPERATIONS" not in build_env(None, None)
    assert "HOROVOD_GPU_OPERATIONS" not in build_env("/usr/local/cuda", None)
    env = build_env("/usr/local/cuda", "/opt/nccl")
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_NCCL_HOME"] == "/opt/nccl"
    assert env["HOROVOD_WITH_PYTORCH"] == "1" and env["HOROVOD_WITHOUT_MPI"] == "1"
