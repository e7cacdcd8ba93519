"""The synthetic training loop of `bpsctl bench vgg16|resnet50`, for bpsctl and its baselines.

Runs inside each worker process (``python -m bpsctl.bench.train --system bpsctl|horovod|ddp``),
started by the same launcher on the same hosts for every system, reading the standard RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. The loop is Horovod's
``pytorch_synthetic_benchmark.py``: random images and labels made once, ``--warmup`` untimed
batches (which also declare every gradient tensor with the system, so nothing is declared
while timing), then ``--iters`` timed iterations of ``--batches-per-iter`` batches each. Rank 0
writes each iteration's img/sec (its own; steps are synchronous, so every worker's is the same)
as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from .common import (
    add_horovod_arguments,
    dilated_horovod_cycle,
    print_result,
    use_horovod_env,
)
from .gpu import add_device_arguments, use_gpu
from .report import shm_shares

SYSTEMS = ("bpsctl", "horovod", "ddp", "ddp-powersgd", "plain")


def throughput(img_secs: list[float], workers: int, batch_size: int) -> dict[str, Any]:
    """The result keys of img/sec per worker measured once per timed iteration: mean and
    ± 1.96σ per worker and for the whole job, and the seconds per batch that mean gives."""
    mean, std = statistics.fmean(img_secs), statistics.pstdev(img_secs)
    return {"workers": workers, "img_secs_per_worker": img_secs,
            "img_per_sec_per_worker": mean, "img_per_sec_per_worker_ci95": 1.96 * std,
            "img_per_sec": workers * mean, "img_per_sec_ci95": workers * 1.96 * std,
            "step_seconds": batch_size / mean}


def _rates_by_rank(args: argparse.Namespace, rank: int, size: int, mine: float
                   ) -> list[float] | None:
    """Each worker's img/sec over its timed window, when bpsctl's workers do not move in
    step (staleness, asynchronous training): a fast worker's rate times the workers would
    overstate the job. None when every worker goes at the same pace (one sum at the end)."""
    if args.system != "bpsctl":
        return None
    import torch

    import bpsctl.engine.torch as bps
    config = bps._p().config
    if not (config.staleness or config.async_mode):
        return None
    rates = torch.zeros(size, dtype=torch.float64)
    rates[rank] = mine
    return [float(r) for r in bps.push_pull(rates, average=False, name="bench.rates")]


def _shm_share(args: argparse.Namespace) -> dict[str, float]:
    """bpsctl: where its pushes went (:func:`~bpsctl.bench.report.shm_shares`); empty for the
    baselines."""
    if args.system != "bpsctl":
        return {}
    import bpsctl.engine.torch as bps
    return shm_shares(bps._p().worker.stats())


def _gradient_path(args: argparse.Namespace, cuda: bool) -> str | None:
    """bpsctl's path for the gradients (:data:`bpsctl.engine.paths.GRADIENT_PATHS`), known
    after the warm-up pushed them; None for the other systems."""
    if args.system != "bpsctl":
        return None
    import bpsctl.engine.torch as bps
    return bps.gradient_path(cuda)


def _host_nic() -> str | None:
    """This worker's host NIC (the interface holding its address): its byte counters are what
    the step really put on the wire. None on loopback, where every process of the machine,
    servers included, counts on ``lo``."""
    from ..config import Config
    from ..engine.trace import interface_of
    name = interface_of(Config.from_env(role="worker").host)
    return None if name in (None, "lo") else name


def _setup(system: str, args: argparse.Namespace, model: Any, optimizer: Any
           ) -> tuple[Any, Any, int, int, str, Callable[[], None]]:
    """Initialise ``system``; returns (model, optimizer, rank, size, version, shutdown)."""
    import torch

    if system == "bpsctl":
        import bpsctl
        import bpsctl.engine.torch as bps
        bps.init()
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = bps.Compression.from_spec(args.compression)
        version = f"bpsctl {bpsctl.__version__}"
        if args.cross_barrier:
            from ..engine.torch.cross_barrier import CrossBarrier
            # no last step that waits for every update: main() waits once the timing is over
            optimizer = CrossBarrier(model, optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)
            version += " CrossBarrier"
        else:
            optimizer = bps.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), compression=compression)
        return model, optimizer, bps.rank(), bps.size(), version, bps.shutdown
    if system == "plain":
        return model, optimizer, 0, 1, f"torch {torch.__version__}, no communication", \
            lambda: None
    if system in ("ddp", "ddp-powersgd"):
        import torch.distributed as dist
        backend = args.backend
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=args.timeout))
        # PowerSGD chains its collectives from completion callbacks; over gloo, with several
        # buckets in flight, ranks then issue them in different orders and gloo aborts on a
        # size mismatch. One bucket keeps every rank's order the same (and gives up overlap)
        bucket_mb = args.bucket_mb if system == "ddp" or backend == "nccl" else 1e6
        device_ids = [torch.cuda.current_device()] if args.device == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                          bucket_cap_mb=bucket_mb)
        version = (f"torch {torch.__version__} DDP {backend} (bucket {bucket_mb:g} MB)"
                   if bucket_mb < 1e6 else f"torch {torch.__version__} DDP {backend} (one bucket)")
        if system == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
            # rank 4 with error feedback; PowerSGD allreduces whole gradients for its first
            # steps (it needs at least 2), so with the default 2 warm-up steps every timed
            # step is compressed
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                           start_powerSGD_iter=2)
            model.register_comm_hook(state, powersgd.powerSGD_hook)
            version += ", PowerSGD rank 4"
        return (model, optimizer, dist.get_rank(), dist.get_world_size(), version,
                dist.destroy_process_group)
    if system == "horovod":
        use_horovod_env(args, args.timeout)
        os.environ.update(dilated_horovod_cycle(os.environ, args.dilation))
        import horovod
        import horovod.torch as hvd
        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        # CUDA tensors go over NCCL where Horovod was built with it (bench checks first)
        ops = "NCCL" if args.device == "cuda" else "gloo"
        return (model, optimizer, hvd.rank(), hvd.size(), f"horovod {horovod.__version__} {ops}",
                hvd.shutdown)
    raise ValueError(f"unknown system {system!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.train")
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--batches-per-iter", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--compression", default="",
                        help="bpsctl's gradient compression, e.g. onebit or topk:0.01")
    parser.add_argument("--cross-barrier", action="store_true",
                        help="bpsctl: CrossBarrier instead of DistributedOptimizer")
    parser.add_argument("--replay", default="",
                        help="a shipped profile's name or a profile's file: train the stand-in "
                             "of bench/replay.py, which replays its recorded step times")
    parser.add_argument("--dilation", type=float, default=1.0,
                        help="with --replay: every recorded time multiplied by this")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole run may take; a hung worker exits after it")
    add_horovod_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="DDP's torch.distributed backend")
    args = parser.parse_args(argv)

    if args.system == "plain" and int(os.environ.get("RANK", "0")) != 0:
        return          # the plain row is one worker's (rank 0's) training alone
    # a hang (a peer gone, a rendezvous never answered) ends in a traceback and exit, not forever
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    import torch
    import torch.nn.functional as F

    from .models import build

    cuda = args.device == "cuda"
    if cuda:
        use_gpu(args.gpu_by)       # before NCCL, the plugin or DDP initialise
    else:
        # several workers share this machine's cores (Horovod's and DDP's runs alike)
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    if args.replay:
        # the stand-in's steps wait on the clock; its input is only a batch's row count
        from .profile import load
        from .replay import ReplayModel, ReplayOptimizer
        model = ReplayModel(load(args.replay), args.dilation)
        optimizer = ReplayOptimizer(model.parameters(), step_s=model.schedule.optimizer_s,
                                    busy=model.busy)
        data = torch.zeros(args.batch_size, 1)
        args.num_classes = model.num_classes        # the profile's, for the labels
    else:
        model = build(args.model, args.num_classes).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    model, optimizer, rank, size, version, shutdown = _setup(args.system, args, model, optimizer)

    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    # where a step's time goes (the profile behind a shortfall): forward + backward (DDP's
    # allreduce runs inside backward; with --cross-barrier the forward pass waits for each
    # layer's update), then optimizer.step() (bpsctl and Horovod wait there for the gradients
    # still in flight). On CUDA the host runs ahead of the GPU: the phases are read from CUDA
    # events after each timed iteration's synchronize, and no step waits for them
    phases = {"backward_seconds": 0.0, "step_seconds": 0.0}
    marks: list[tuple[Any, Any, Any]] = []

    def step() -> None:
        start = time.perf_counter()
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                      torch.cuda.Event(enable_timing=True))
            events[0].record()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        middle = time.perf_counter()
        if cuda:
            events[1].record()
        optimizer.step()
        if cuda:
            events[2].record()
            marks.append(events)
        else:
            phases["backward_seconds"] += middle - start
            phases["step_seconds"] += time.perf_counter() - middle

    def timed(batches: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batches):
            step()
        if cuda:
            torch.cuda.synchronize()        # the GPU's work is the step's, not the launch's
            for begin, middle, end in marks:
                phases["backward_seconds"] += begin.elapsed_time(middle) / 1e3
                phases["step_seconds"] += middle.elapsed_time(end) / 1e3
            marks.clear()
        return time.perf_counter() - start

    timed(args.warmup)
    phases.update(backward_seconds=0.0, step_seconds=0.0)
    path = _gradient_path(args, cuda)
    from ..engine.trace import read_nic  # here: the command line imports this module too
    nic = _host_nic() if rank == 0 else None
    nic_before = read_nic(nic) if nic else None
    img_secs = []
    window = 0.0
    for i in range(args.iters):
        seconds = timed(args.batches_per_iter)
        window += seconds
        img_secs.append(args.batch_size * args.batches_per_iter / seconds)
        if rank == 0:
            print(f"{args.system} iter {i + 1}/{args.iters}: {img_secs[-1]:.2f} img/sec per worker "
                  f"({seconds / args.batches_per_iter:.3f} s/step)", flush=True)
    timed_batches = args.iters * args.batches_per_iter
    nic_after = read_nic(nic) if nic else None
    if args.cross_barrier and args.system == "bpsctl":
        # each timed step carried the updates of the step before (the warmup's into the
        # first), as every step of a longer run does; the last one's land after the window
        optimizer.synchronize()  # type: ignore[attr-defined]  # a CrossBarrier
    wire: dict[str, Any] = {}
    if nic_before and nic_after:
        wire = {"nic": nic,
                "nic_tx_bytes_per_step": (nic_after[0] - nic_before[0]) / timed_batches,
                "nic_rx_bytes_per_step": (nic_after[1] - nic_before[1]) / timed_batches}
    by_rank = _rates_by_rank(args, rank, size, args.batch_size * timed_batches / window)
    if rank == 0:
        print_result({
            "system": args.system, "version": version,
            **throughput(img_secs, size, args.batch_size),
            # workers not in step (staleness, async): the job's rate is the sum of each one's
            **({"img_per_sec": sum(by_rank), "img_per_sec_by_rank": by_rank} if by_rank else {}),
            "phase_seconds_per_step": {
                "forward_backward": phases["backward_seconds"] / timed_batches,
                "optimizer_step": phases["step_seconds"] / timed_batches},
            # what rank 0's host NIC really carried per timed step (all its processes)
            **wire, **({"gradient_path": path} if path else {}), **_shm_share(args)})
    shutdown()
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
