"""Communication microbenchmark: push_pull of S bytes, and the raw ZeroMQ limit beside it.

Two halves:

* :func:`worker_main` runs inside each worker process (``python -m bpsctl.bench.comm``):
  declares the tensors, warms up, then times rounds of push_pull of every tensor,
  each round started together after a barrier. Rank 0 prints the round times as one
  :data:`~bpsctl.bench.common.RESULT_MARKER` line (the launcher relays it from any host: no
  shared filesystem; bench reads it from the relayed output and keeps it off the user's
  terminal).
* :func:`zmq_pair_seconds` measures what this machine's ZeroMQ moves between two processes
  for the same bytes in the same message size: the limit the engine is judged against.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from ..config import parse_size
from .common import print_result
from .gpu import add_device_arguments, use_gpu
from .report import shm_shares

# ----------------------------------------------------------------------------- worker side

def tensor_sizes(size_bytes: int, tensors: int, itemsize: int = 4) -> list[int]:
    """Element counts of ``tensors`` float32 tensors adding up to ``size_bytes`` (near enough)."""
    total = max(1, size_bytes // itemsize)
    base, extra = divmod(total, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def worker_main(argv: list[str] | None = None) -> None:
    import bpsctl.engine as bps

    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.comm")
    parser.add_argument("--size", default="64MiB")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    add_device_arguments(parser)
    args = parser.parse_args(argv)

    if args.device == "cuda":
        cuda_main(args)
        return
    bps.init()
    rank, size = bps.rank(), bps.size()
    counts = tensor_sizes(parse_size(args.size), args.tensors)
    # integer-valued data, so the sum can be checked exactly
    arrays = [np.full(n, rank + 1, dtype=np.float32) for n in counts]
    outputs = [np.empty_like(a) for a in arrays]
    names = [f"bench.t{i}" for i in range(len(arrays))]
    for name, a in zip(names, arrays, strict=True):
        bps.declare(name, a.shape, a.dtype)
    expected = size * (size + 1) / 2

    def one_round() -> float:
        bps.barrier()
        start = time.perf_counter()
        # earlier tensors first, as a training step's next forward pass would want
        handles = [bps.push_pull_async(a, name=name, average=False, priority=-i, out=o)
                   for i, (a, name, o) in enumerate(zip(arrays, names, outputs, strict=True))]
        for h in handles:
            bps.synchronize(h)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        one_round()
    seconds = [one_round() for _ in range(args.repeats)]
    for o in outputs:
        if o.size and not (o[0] == expected and o[-1] == expected):
            raise SystemExit(f"rank {rank}: wrong sum {o[0]} (expected {expected})")
    if rank == 0:
        print_result({"seconds": seconds, "tensors": len(arrays),
                      "size_bytes": int(sum(counts) * 4)})
    bps.shutdown()


def cuda_main(args: argparse.Namespace) -> None:
    """The same rounds on CUDA tensors through the torch plugin: the copies between the GPU
    and the host (or the intra-node stage's NCCL) are part of each round, which ends once
    every result is back on the GPU."""
    import torch

    import bpsctl.engine.torch as bps

    use_gpu(args.gpu_by)
    bps.init()
    rank, size = bps.rank(), bps.size()
    counts = tensor_sizes(parse_size(args.size), args.tensors)
    tensors = [torch.empty(n, dtype=torch.float32, device="cuda") for n in counts]
    names = [f"bench.t{i}" for i in range(len(tensors))]
    expected = size * (size + 1) / 2

    def one_round() -> float:
        for t in tensors:           # in place: each round starts from this worker's values
            t.fill_(rank + 1)
        torch.cuda.synchronize()
        bps._p().worker.barrier()
        start = time.perf_counter()
        handles = [bps.push_pull_async_inplace(t, average=False, name=name, priority=-i)
                   for i, (t, name) in enumerate(zip(tensors, names, strict=True))]
        for h in handles:
            bps.synchronize(h)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        one_round()
    seconds = [one_round() for _ in range(args.repeats)]
    for t in tensors:
        if t.numel() and not (float(t[0]) == expected and float(t[-1]) == expected):
            raise SystemExit(f"rank {rank}: wrong sum {float(t[0])} (expected {expected})")
    if rank == 0:
        print_result({"seconds": seconds, "tensors": len(tensors),
                      "size_bytes": int(sum(counts) * 4),
                      "gradient_path": bps.gradient_path(cuda=True),
                      **shm_shares(bps._p().worker.stats())})
    bps.shutdown()


# ----------------------------------------------------------------------------- raw ZeroMQ

def _zmq_sink(port_file: str) -> None:
    """Receive batches of messages and acknowledge each batch (runs in its own process)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack = ctx.socket(zmq.PUSH)
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file + ".tmp").write_text(json.dumps([port, ack_port]))
    os.replace(port_file + ".tmp", port_file)
    while True:
        count = int(pull.recv())
        if count < 0:
            return
        for _ in range(count):
            pull.recv(copy=False)
        ack.send(b"")


def zmq_pair_seconds(size_bytes: int, message_bytes: int, repeats: int = 5, warmup: int = 2,
                     timeout_s: float = 60.0) -> list[float]:
    """Seconds to move ``size_bytes`` in ``message_bytes`` frames, zero-copy, PUSH->PULL over
    loopback TCP between this process and a fresh one; one figure per repeat."""
    import tempfile

    message_bytes = max(1, min(message_bytes, size_bytes))
    count, tail = divmod(size_bytes, message_bytes)
    payload = np.ones(message_bytes, dtype=np.uint8).data
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "ports")
        sink = subprocess.Popen([sys.executable, "-c", "from bpsctl.bench.comm import _zmq_sink; "
                                 f"_zmq_sink({port_file!r})"], start_new_session=True)
        ctx = zmq.Context()
        try:
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(port_file):
                if time.monotonic() > deadline or sink.poll() is not None:
                    raise RuntimeError("the ZeroMQ sink process did not start")
                time.sleep(0.02)
            port, ack_port = json.loads(Path(port_file).read_text())
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://127.0.0.1:{port}")
            ack = ctx.socket(zmq.PULL)
            ack.setsockopt(zmq.LINGER, 0)
            ack.connect(f"tcp://127.0.0.1:{ack_port}")
            seconds = []
            for i in range(warmup + repeats):
                start = time.perf_counter()
                push.send(str(count + (1 if tail else 0)).encode())
                for _ in range(count):
                    push.send(payload, copy=False)
                if tail:
                    push.send(payload[:tail], copy=False)
                if not ack.poll(int(timeout_s * 1000)):
                    raise RuntimeError("the ZeroMQ sink did not acknowledge in time")
                ack.recv()
                if i >= warmup:
                    seconds.append(time.perf_counter() - start)
            push.send(b"-1")
            sink.wait(timeout=10)
            return seconds
        finally:
            ctx.destroy(linger=0)
            if sink.poll() is None:
                sink.kill()
                sink.wait()


def median(values: list[float]) -> float:
    return statistics.median(values)


if __name__ == "__main__":
    worker_main()
