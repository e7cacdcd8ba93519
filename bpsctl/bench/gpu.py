"""GPUs for the training and comm benchmarks: what each worker host has, which device a run
uses, and which backend each baseline can take. Every decision is a pure function of what the
probes found, so that the choices are tested where there is no GPU.

The probe runs ``python -c PROBE`` where the workers will run (on this machine for the
embedded default and emulated clusters, whose hosts share its GPUs; over SSH on each worker
host of an SSH cluster; as one Slurm step per worker node) and reads the one JSON line it
prints. It imports torch and counts devices without creating a CUDA context.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from .common import rebuild_for_gpus_message

DEVICES = ("auto", "cuda", "cpu")
#: what a training benchmark defaults to on each device: Horovod's and BytePS's published
#: GPU figures are batch 64 of 224x224 images per GPU; a CPU takes seconds per step at that
TRAIN_DEFAULTS = {"cuda": {"batch_size": 64, "image_size": 224},
                  "cpu": {"batch_size": 4, "image_size": 32}}

PROBE = """\
import json, os
answer = {"node": os.environ.get("SLURMD_NODENAME")}
try:
    import torch
    answer["torch"] = torch.__version__
    answer["cuda"] = torch.version.cuda
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    answer["count"] = count
    answer["name"] = torch.cuda.get_device_name(0) if count else None
    nccl = torch.cuda.nccl.version() if count and hasattr(torch.cuda, "nccl") else None
    answer["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
except Exception as exc:
    answer["error"] = f"{type(exc).__name__}: {exc}"
"""
#: added to :data:`PROBE` when Horovod is compared: whether it takes CUDA tensors over NCCL
HOROVOD_PROBE = """\
try:
    import horovod.torch
    answer["horovod_nccl"] = bool(horovod.torch.nccl_built())
except Exception as exc:
    answer["horovod_error"] = f"{type(exc).__name__}: {exc}"
"""


def probe_code(horovod: bool = False) -> str:
    """The probe's Python: GPUs, and with ``horovod`` Horovod's NCCL; prints one JSON line."""
    return PROBE + (HOROVOD_PROBE if horovod else "") + "print(json.dumps(answer))\n"


@dataclass(frozen=True)
class HostGPUs:
    """What one worker host has: ``count`` CUDA devices (0: none, or torch cannot use them)."""

    host: str
    count: int = 0
    name: str | None = None
    torch: str | None = None
    cuda: str | None = None         # torch's CUDA version (None: a CPU build)
    nccl: str | None = None
    error: str | None = None        # why the probe found nothing there
    horovod_nccl: bool | None = None    # Horovod there allreduces CUDA tensors over NCCL

    @classmethod
    def from_answer(cls, host: str, answer: dict[str, Any]) -> HostGPUs:
        return cls(host=host, count=int(answer.get("count") or 0), name=answer.get("name"),
                   torch=answer.get("torch"), cuda=answer.get("cuda"),
                   nccl=None if answer.get("nccl") is None else str(answer["nccl"]),
                   error=answer.get("error"), horovod_nccl=answer.get("horovod_nccl"))

    def why_none(self) -> str:
        """Why this host has no usable GPU, in words."""
        if self.error:
            return f"torch does not load there ({self.error})"
        if self.cuda is None:
            return f"torch {self.torch} there is a CPU build"
        return f"torch {self.torch} (CUDA {self.cuda}) there sees no CUDA device"


def probe_here(host: str = "this machine", code: str | None = None,
               timeout_s: float = 120.0) -> HostGPUs:
    """This machine's GPUs, from a fresh interpreter (the bench process stays CUDA-free)."""
    try:
        done = subprocess.run([sys.executable, "-c", code or probe_code()], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return HostGPUs(host=host, error=str(exc))
    return HostGPUs.from_answer(host, last_json(done.stdout) or {
        "error": (done.stderr.strip().splitlines() or ["no answer"])[-1]})


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that is a JSON object (a probe's answer), or None."""
    for line in reversed(text.strip().splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict):
            return answer
    return None


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--gpu-by`` of the benchmarks' worker scripts."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu-by", choices=("local_rank", "rank"), default="local_rank",
                        help="which rank picks the GPU (rank %% GPUs): local_rank where each "
                             "host has GPUs of its own, rank where emulated hosts share one "
                             "machine's")


def use_gpu(gpu_by: str) -> int:
    """Put this worker on its GPU (its local rank's or rank's, modulo the GPUs) before
    anything initialises, as Horovod's and BytePS's examples do; returns the index."""
    import torch
    which = int(os.environ.get("LOCAL_RANK" if gpu_by == "local_rank" else "RANK", "0"))
    index = which % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return index


def resolve_device(requested: str, hosts: Sequence[HostGPUs]) -> str:
    """The device a benchmark trains on: ``cuda`` or ``cpu``. ``auto`` is CUDA where every
    worker host has a GPU; ``cuda`` where one has none is a ConfigError naming the host and
    why."""
    if requested not in DEVICES:
        raise ConfigError(f"--device: expected one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    without = [host for host in hosts if host.count == 0]
    if requested == "auto":
        return "cpu" if without or not hosts else "cuda"
    if without:
        host = without[0]
        raise ConfigError(f"--device cuda: {host.host} has no CUDA device: {host.why_none()}. "
                          "Install a CUDA build of torch where the workers run, or use "
                          "--device cpu (or auto)")
    return "cuda"


def baseline_backend(device: str, host_workers: Sequence[int],
                     host_gpus: Sequence[int]) -> tuple[str, str]:
    """The backend of the NCCL baselines (DDP, PowerSGD, the allreduce of bench comm) and why:
    ``nccl`` on CUDA where every host has a GPU per worker; else ``gloo`` (on CUDA: NCCL
    refuses two ranks on one GPU, while bpsctl stages through host memory and still runs).
    ``host_workers[h]`` and ``host_gpus[h]``: the workers and GPUs of each physical host."""
    if device != "cuda":
        return "gloo", "CPU tensors"
    crowded = [(workers, gpus) for workers, gpus in zip(host_workers, host_gpus, strict=True)
               if workers > gpus]
    if crowded:
        workers, gpus = crowded[0]
        return "gloo", (f"{workers} workers share {gpus} GPU{'s' if gpus != 1 else ''} on a "
                        "host: NCCL needs one GPU per worker, so the baselines run over gloo")
    return "nccl", "one GPU per worker"


def check_horovod_nccl(hosts: Sequence[HostGPUs]) -> None:
    """Horovod on GPUs must allreduce CUDA tensors over NCCL, as its users run it: a
    ConfigError saying how to rebuild it where it does not."""
    without = [host.host for host in hosts if host.horovod_nccl is not True]
    if without:
        raise ConfigError(f"{rebuild_for_gpus_message()} (on {', '.join(without)})")


def gpu_keys(hosts: Sequence[HostGPUs]) -> dict[str, Any]:
    """The report keys that say which GPUs the figures come from."""
    first = hosts[0] if hosts else HostGPUs(host="")
    return {"gpus": [{"host": h.host, "name": h.name, "count": h.count} for h in hosts],
            "cuda_version": first.cuda, "nccl_version": first.nccl}
