"""Which way a job's gradients travel: pure decisions, taken alike on every worker.

- :func:`solo_job`: a job of one worker has nothing to sum; its push_pulls complete at once
  without any traffic (``BPSCTL_FORCE_DISTRIBUTED=1`` sends them through the servers anyway).
- :func:`nccl_veto` and :func:`nccl_within_hosts`: whether the intra-node stage may sum a
  host's CUDA tensors with NCCL. NCCL refuses two ranks on one device ("Duplicate GPU
  detected"), and every rank must make the same NCCL groups in the same order (a host that
  chose differently would push other tensor names), so the answer is one for the whole job:
  a cheap veto at start (no NCCL in torch, no GPU, fewer GPUs on a host than its workers), and
  the exact check at the first CUDA push_pull, from the devices the tensors are really on
  (scripts call ``torch.cuda.set_device`` after ``init``).
- :func:`gradient_path`: the name of the path, as ``bench`` reports it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: what :func:`gradient_path` returns, and what each means
GRADIENT_PATHS = {
    "none": "one worker: nothing to sum, no communication",
    "nccl-local": "one host: an NCCL all-reduce on the GPUs, no servers, no host copies",
    "nccl+servers": "NCCL reduce-scatter within each host, the host's sum of each chunk through "
                    "the servers, NCCL all-gather",
    "host-staged": "CUDA tensors copied to host memory, summed by the host path, copied back",
    "shm-local": "one host: summed in shared memory, no servers",
    "servers": "through the servers, after a shared-memory stage on hosts of several workers",
}

#: the paths of :data:`GRADIENT_PATHS` on which no gradient reaches a server
LOCAL_PATHS = ("none", "nccl-local", "shm-local")


def solo_job(config: Any, size: int, joined_running: bool) -> bool:
    """True when a job of ``size`` workers has nothing to sum and never will: one worker, no
    ``BPSCTL_FORCE_DISTRIBUTED``, no room to grow (``--max-workers``), not asynchronous
    (there the servers hold the parameters), and not a worker that joined a running job."""
    return (size == 1 and not config.force_distributed and not config.async_mode
            and config.max_workers <= 1 and not joined_running)


def nccl_veto(nccl_available: bool, cuda_available: bool, device_count: int,
              local_size: int) -> str | None:
    """Why this rank's host cannot sum CUDA tensors with NCCL, known before any tensor is
    pushed (None: it may, once the devices are known)."""
    if not nccl_available:
        return "this torch has no NCCL"
    if not cuda_available or device_count == 0:
        return "no CUDA device is visible"
    if device_count < local_size:
        return (f"{local_size} workers share this host's {device_count} "
                f"GPU{'s' if device_count != 1 else ''} (NCCL needs one GPU per worker)")
    return None


def nccl_within_hosts(devices: Sequence[str | None], local_size: int) -> tuple[bool, str]:
    """Whether every host's ranks are on distinct GPUs, from ``devices[rank]`` (the UUID of
    the GPU rank's first CUDA tensor is on; None: no CUDA tensor there), ranks in contiguous
    blocks of ``local_size`` per host; and why, in words."""
    for first in range(0, len(devices), local_size):
        seen: dict[str, int] = {}
        for rank in range(first, min(first + local_size, len(devices))):
            device = devices[rank]
            if device is None:
                return False, f"rank {rank} pushes no CUDA tensor"
            if device in seen:
                return False, (f"ranks {seen[device]} and {rank} share one GPU ({device}); NCCL "
                               "needs one GPU per worker")
            seen[device] = rank
    return True, f"each host's {local_size} workers are on distinct GPUs"


def gradient_path(*, solo: bool, cuda: bool, stage: bool, nccl: bool,
                  local_only: bool) -> str:
    """The path of :data:`GRADIENT_PATHS` a job's gradients take: ``solo`` (one worker),
    ``cuda`` (CUDA tensors), ``stage`` (an intra-node stage: several workers share a host),
    ``nccl`` (that stage sums CUDA tensors with NCCL), ``local_only`` (every worker is on one
    host, and the stage finishes there)."""
    if solo:
        return "none"
    if cuda:
        if stage and nccl:
            return "nccl-local" if local_only else "nccl+servers"
        return "host-staged"
    return "shm-local" if stage and local_only else "servers"
