"""Shared memory page-locked for CUDA, so that the GPU copies a gradient straight into the push
slot the server sums from, and a sum straight out of the slot or sum buffer it arrived in
(engine/shmlink.py; ``Worker.lend`` and ``lend_results``), with no copy by the CPU.

:class:`CudaPinning` is the :class:`~bpsctl.engine.shmlink.Pinning` the torch plugin hands the
engine at its first CUDA tensor staged through host memory: ``cudaHostRegister`` (through
torch's ``torch.cuda.cudart()``) of each segment as the engine makes or maps it, portable
(every device of the process may copy with it) and read-only for the servers' sum buffers,
which the worker maps read-only. Where registration is refused (a driver without read-only
registration, a container's limits) the segment stays pageable: the copies still land, the
CUDA runtime stages them, and the log says so once.

Unpinning must not pull memory from under a copy: the stager queues every copy into or out of
pinned shared memory while holding :attr:`CudaPinning.lock`, and :meth:`CudaPinning.unpin`
takes the lock and waits for the device before ``cudaHostUnregister``.
"""
from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import numpy as np
import torch

#: cudaHostRegister's flags (cuda_runtime_api.h)
PORTABLE = 0x01
READ_ONLY = 0x08

log = logging.getLogger("bpsctl.worker")

# the servers' sum buffers are mapped read-only and only ever read here: torch's (one-time)
# warning that it cannot mark a tensor read-only says nothing a user could act on
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning, module=r"bpsctl\.engine\.torch\.pinning$")


def host_bytes(view: np.ndarray) -> torch.Tensor:
    """A uint8 CPU tensor over ``view``'s memory, without a copy (a read-only view's tensor
    is only ever copied from)."""
    return torch.from_numpy(view)


class CudaPinning:
    """Page-locks the engine's shared memory for ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        #: held while copies into or out of pinned shared memory are queued
        self.lock = threading.Lock()
        self.refused = False        # said once

    def pin(self, view: np.ndarray, writable: bool) -> Any:
        cudart = torch.cuda.cudart()
        flags = PORTABLE | (0 if writable else READ_ONLY)
        pointer = view.ctypes.data
        with torch.cuda.device(self.device):
            error = cudart.cudaHostRegister(pointer, view.nbytes, flags)
        if error != cudart.cudaError.success:
            if not self.refused:
                self.refused = True
                log.warning("CUDA would not page-lock %d MiB of shared memory with the servers "
                            "on this host (%s); copies between the GPU and it go through "
                            "pageable memory, slower", view.nbytes >> 20,
                            cudart.cudaGetErrorString(error))
            return None
        return pointer, view            # the view keeps the mapping while it is pinned

    def unpin(self, token: Any) -> None:
        pointer, _ = token
        with self.lock:             # no copy is being queued ...
            torch.cuda.synchronize(self.device)     # ... and none queued is still running
            torch.cuda.cudart().cudaHostUnregister(pointer)
