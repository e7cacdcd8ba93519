"""The ring-allreduce baseline of `bench comm --compare allreduce`: torch.distributed with gloo
(NCCL on CUDA tensors with `--device cuda`, where every worker has a GPU of its own).

Runs inside each worker process (``python -m bpsctl.bench.allreduce``), started by the same
launcher on the same hosts as the bpsctl workers, reading the standard RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. It allreduces one flat float32 buffer of the same bytes — the
baseline's best case (no per-tensor calls) — and rank 0 prints the round times (``print_result``).
"""
from __future__ import annotations

import argparse
import datetime
import time

from ..config import parse_size
from .common import print_result
from .gpu import add_device_arguments, use_gpu


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.allreduce")
    parser.add_argument("--size", default="64MiB")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0)
    add_device_arguments(parser)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    if cuda:
        use_gpu(args.gpu_by)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    numel = max(1, parse_size(args.size) // 4)
    buffer = torch.full((numel,), float(rank + 1), dtype=torch.float32,
                        device="cuda" if cuda else "cpu")

    def one_round() -> float:
        buffer.fill_(float(rank + 1))
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        one_round()
    seconds = [one_round() for _ in range(args.repeats)]
    expected = size * (size + 1) / 2          # integer-valued: exact in float32
    if float(buffer[0]) != expected or float(buffer[-1]) != expected:
        raise SystemExit(f"rank {rank}: allreduce gave {float(buffer[0])}, expected {expected}")
    if rank == 0:
        print_result({"seconds": seconds, "size_bytes": numel * 4,
                      "version": f"torch {torch.__version__} {args.backend}"})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
