"""The training loop of `bpsctl bench convergence`: time to a target accuracy, per system.

Runs inside each worker process (``python -m bpsctl.bench.convergence --system sync|ddp|...``),
started by the same launcher on the same hosts for every system. The task is a real one that
needs no download: a fixed *teacher* network (seeded) labels Gaussian inputs with the class of
its largest output; a smaller *student* learns them with SGD. Every worker builds the same
data, trains on its own shard of the training set, and measures the student on the held-out
test set every ``--eval-every`` steps. Models stay identical on every worker (synchronous
systems; a late worker under backup workers gets the same averaged gradient; under staleness
every worker applies the same averages, s steps late), so every worker
reaches the target at the same step and all stop together. Asynchronous workers hold the
parameters they last pulled from the servers: each measures those and stops on its own once
they reach the target (rank 0's time is the system's). With ``--steps N`` every worker trains
exactly N steps instead, and the result is the accuracy then (and the step at which the target
was first measured, if it was): how compressors compare at equal work. ``--compression SPEC``
sends the gradients of a bpsctl system through that compressor. Rank 0 prints the result as
JSON.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class System:
    """One way of training that `bench convergence --compare` can name."""

    name: str
    engine: str             # "bpsctl" or "ddp"
    description: str


#: what --compare accepts; each runs on the same cluster with the same task and seed
SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("sync", "bpsctl", "bpsctl, every worker in every step"),
    System("backup", "bpsctl", "bpsctl with backup workers (--backup-workers, default 1)"),
    System("stale", "bpsctl", "bpsctl with bounded staleness (--staleness, default 2)"),
    System("async", "bpsctl", "bpsctl asynchronous: servers apply each worker's gradient as "
                              "it comes, at --lr divided by the workers"),
    System("ddp", "ddp", "torch DDP over gloo"),
)}


def make_task(seed: int, features: int, classes: int, train: int, test: int
              ) -> tuple[Any, Any, Any, Any]:
    """(train inputs, train labels, test inputs, test labels), the same on every worker: the
    teacher's argmax over Gaussian inputs, all drawn from one seeded generator."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    hidden = 4 * features
    w1 = torch.randn(features, hidden, generator=gen) / features ** 0.5
    w2 = torch.randn(hidden, classes, generator=gen) / hidden ** 0.5
    inputs = torch.randn(train + test, features, generator=gen)
    labels = (torch.tanh(inputs @ w1) @ w2).argmax(dim=1)
    return inputs[:train], labels[:train], inputs[train:], labels[train:]


def student(features: int, classes: int, hidden: int) -> Any:
    import torch
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


def _setup(system: System, args: argparse.Namespace, model: Any, optimizer: Any
           ) -> tuple[Any, Any, int, int, str, Callable[[], None]]:
    """Initialise ``system`` (with ``args.compression`` on bpsctl's gradients); returns
    (model, optimizer, rank, size, version, shutdown)."""
    import torch
    if system.engine == "bpsctl":
        import bpsctl
        import bpsctl.engine.torch as bps
        bps.init()
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        config = bps._p().config
        if config.async_mode:
            # each worker's gradient is one update of its own, where a synchronous step
            # applies their mean once: the same learning per sample at lr / workers
            for group in optimizer.param_groups:
                group["lr"] /= bps.size()
        optimizer = bps.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=bps.Compression.from_spec(args.compression))
        version = f"bpsctl {bpsctl.__version__}" + (
            f", {config.backup_workers} backup workers" if config.backup_workers else
            f", staleness {config.staleness}" if config.staleness else
            ", asynchronous" if config.async_mode else "") + (
            f", {_compressor(args.compression)} compression" if args.compression else "")
        return model, optimizer, bps.rank(), bps.size(), version, bps.shutdown
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = torch.nn.parallel.DistributedDataParallel(model)
    return (model, optimizer, dist.get_rank(), dist.get_world_size(),
            f"torch {torch.__version__} DDP gloo", dist.destroy_process_group)


def _compressor(spec: str) -> str:
    """How the version line names a compression spec: onebit, onebit (no error feedback)."""
    from ..engine.compression import parse
    return str(parse(spec))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.convergence")
    parser.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=0,
                        help="train exactly this many steps, past the target (0: stop at it)")
    parser.add_argument("--compression", default="",
                        help="bpsctl's gradient compression, e.g. onebit or onebit:noef")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--train", type=int, default=4096)
    parser.add_argument("--test", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole run may take; a hung worker exits after it")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    import torch
    import torch.nn.functional as F

    from .common import print_result

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = make_task(args.seed, args.features, args.classes,
                                                 args.train, args.test)
    model = student(args.features, args.classes, args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    system = SYSTEMS[args.system]
    model, optimizer, rank, size, version, shutdown = _setup(system, args, model, optimizer)
    shard_x, shard_y = train_x[rank::size], train_y[rank::size]
    order = torch.Generator().manual_seed(args.seed + 1 + rank)

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(test_x).argmax(dim=1) == test_y).float().mean())

    curve = [(0, 0.0, accuracy())]
    target_step = 0 if curve[0][2] >= args.target else None
    limit = args.steps or args.max_steps
    start = time.perf_counter()
    steps = 0
    # without --steps every worker stops at the first measurement at the target (all see the
    # same accuracy, so all stop together); with it, all train the same N steps
    while steps < limit and (args.steps or target_step is None):
        batch = torch.randint(0, len(shard_x), (args.batch_size,), generator=order)
        optimizer.zero_grad()
        F.cross_entropy(model(shard_x[batch]), shard_y[batch]).backward()
        optimizer.step()
        steps += 1
        if steps % args.eval_every == 0 or steps == limit:
            curve.append((steps, time.perf_counter() - start, accuracy()))
            if target_step is None and curve[-1][2] >= args.target:
                target_step = steps
    seconds = time.perf_counter() - start
    if rank == 0:
        name = f"{args.system}+{args.compression}" if args.compression else args.system
        print(f"{name}: {curve[-1][2]:.3f} accuracy after {steps} steps, {seconds:.2f} s",
              flush=True)
        print_result({"system": name, "version": version, "workers": size,
                      "reached": target_step is not None, "target_step": target_step,
                      "steps": steps, "seconds": seconds, "final_accuracy": curve[-1][2],
                      "curve": [{"step": s, "seconds": t, "accuracy": a} for s, t, a in curve]})
    shutdown()
    # the result is out and the system shut down: leave now. Once in a dozen or so DDP runs
    # a worker hung after this point (interpreter exit, after the watchdog was cancelled)
    # and the bench waited for it until its own deadline
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
