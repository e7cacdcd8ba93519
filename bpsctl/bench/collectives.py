"""`bench comm --op`: Horovod's collectives, bpsctl's and Horovod's own, timed the same way.

Runs inside each worker process (``python -m bpsctl.bench.collectives --system bpsctl|horovod
--ops allreduce,allgather,...``), started by bench's launcher on the same hosts for both
systems (Horovod's workers get the environment horovodrun's gloo launcher gives, from
:func:`bpsctl.bench.common.use_horovod_env`). bpsctl's side is the torch plugin
(``bpsctl.engine.torch``), called through its public Horovod API only; Horovod's is
``horovod.torch`` over Gloo. For each op in turn: CPU float32 tensors holding ``--size`` bytes
over ``--tensors`` tensors, ``--warmup`` untimed rounds, then ``--repeats`` timed ones, each
round started together after a barrier and ended when every tensor's result is back. The
first round's results are checked on every rank against what that rank must get (the data are
integer-valued, so every sum is exact, an average within float32's rounding); a wrong result
ends the worker with an error, so the run fails rather than report a fast wrong collective.
Rank 0 prints the round times (:func:`~bpsctl.bench.common.print_result`).

The bytes of an op are nccl-tests': allreduce, reducescatter and alltoall move ``--size`` bytes
of input per rank; allgather gathers ``--size`` bytes of output per rank (each rank
contributes ``--size``/N). Every tensor's element count is a multiple of the N ranks, so
each splits evenly; the bytes reported are those (within N elements a tensor of ``--size``).
"""
from __future__ import annotations

import argparse
import faulthandler
import time
from collections.abc import Callable
from typing import Any

from ..config import parse_size
from .common import add_horovod_arguments, print_result, use_horovod_env

#: what `bench comm --op` measures; push_pull (bpsctl only) is the default, today's bench comm
OPS = ("push_pull", "allreduce", "allgather", "alltoall", "reducescatter")
#: the reductions of allreduce, reducescatter and push_pull (Horovod's default is average)
REDUCES = ("average", "sum")
#: how each op's bytes per rank are counted (nccl-tests' convention), for the docs and reports
BYTES_OF = {"push_pull": "input", "allreduce": "input", "allgather": "output",
            "alltoall": "input", "reducescatter": "input"}


def element_counts(size_bytes: int, tensors: int, ranks: int) -> list[int]:
    """Element counts of ``tensors`` float32 tensors holding ``size_bytes`` (near enough), each
    a multiple of ``ranks`` (at least ``ranks``), so that every rank's share is whole."""
    total = max(1, size_bytes // 4)
    base, extra = divmod(total, tensors)
    counts = [base + (1 if i < extra else 0) for i in range(tensors)]
    return [max(ranks, count - count % ranks) for count in counts]


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' busbw over algbw: 2(n-1)/n for allreduce (and push_pull), (n-1)/n for
    allgather, alltoall and reducescatter; 1 for one rank."""
    if ranks < 2:
        return 1.0
    return (2.0 if op in ("allreduce", "push_pull") else 1.0) * (ranks - 1) / ranks


def inputs(op: str, counts: list[int], rank: int, ranks: int) -> list[Any]:
    """This rank's input tensors for ``op``. Integer values, different per rank and (for the
    ops that split a tensor into N blocks) per block, so that a result with a block of the
    wrong rank, in the wrong place, or missing, does not match :func:`expected`:

    * push_pull, allreduce: ``rank + 1`` everywhere;
    * allgather: ``count / N`` elements of ``rank + 1``;
    * alltoall: block ``j`` (for rank ``j``) holds ``rank * N + j + 1``;
    * reducescatter: block ``j`` holds ``(rank + 1) * (j + 1)``."""
    import torch
    blocks = torch.arange(ranks, dtype=torch.float32)
    made = []
    for count in counts:
        block = count // ranks
        if op in ("push_pull", "allreduce"):
            made.append(torch.full((count,), float(rank + 1)))
        elif op == "allgather":
            made.append(torch.full((block,), float(rank + 1)))
        elif op == "alltoall":
            made.append((rank * ranks + blocks + 1).repeat_interleave(block))
        elif op == "reducescatter":
            made.append(((rank + 1) * (blocks + 1)).repeat_interleave(block))
        else:
            raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    return made


def expected(op: str, counts: list[int], rank: int, ranks: int, average: bool) -> list[Any]:
    """What ``op`` must give this rank when every rank passed :func:`inputs` (``average``: of
    allreduce, reducescatter and push_pull)."""
    import torch
    blocks = torch.arange(ranks, dtype=torch.float32)
    total = ranks * (ranks + 1) / 2                   # the sum of rank + 1 over the ranks
    scale = total / ranks if average else total
    made = []
    for count in counts:
        block = count // ranks
        if op in ("push_pull", "allreduce"):
            made.append(torch.full((count,), scale))
        elif op == "allgather":
            made.append((blocks + 1).repeat_interleave(block))
        elif op == "alltoall":
            made.append((blocks * ranks + rank + 1).repeat_interleave(block))
        elif op == "reducescatter":
            made.append(torch.full((block,), scale * (rank + 1)))
        else:
            raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    return made


def check(op: str, outputs: list[Any], counts: list[int], rank: int, ranks: int,
          average: bool, system: str = "bpsctl") -> None:
    """A ValueError naming the op, the tensor and the first wrong element unless ``outputs``
    are what :func:`expected` says (to float32's rounding of an average: Horovod scales by
    1/N after summing)."""
    import torch
    for index, (got, want) in enumerate(zip(outputs, expected(op, counts, rank, ranks, average),
                                            strict=True)):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise ValueError(f"{system} {op}: rank {rank}'s tensor {index} came back with shape "
                             f"{tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} "
                             f"{want.dtype}")
        close = torch.isclose(got, want, rtol=1e-6, atol=0.0)
        if not bool(close.all()):
            where = int((~close).nonzero()[0, 0])
            raise ValueError(f"{system} {op}: rank {rank}'s tensor {index} is wrong at element "
                             f"{where}: {float(got[where])}, expected {float(want[where])}")


class _System:
    """One system's collectives as Horovod's API has them (``api``: bpsctl.engine.torch or
    horovod.torch, initialised), started asynchronously and waited for."""

    def __init__(self, api: Any, version: str, average: bool):
        self.api, self.version = api, version
        self.op = api.Average if average else api.Sum
        self.average = average

    def start(self, op: str, tensor: Any, name: str, priority: int) -> Any:
        api = self.api
        if op == "push_pull":
            return api.push_pull_async(tensor, average=self.average, name=name, priority=priority)
        if op == "allreduce":
            return api.allreduce_async(tensor, name=name, op=self.op)
        if op == "allgather":
            return api.allgather_async(tensor, name=name)
        if op == "alltoall":
            return api.alltoall_async(tensor, name=name)
        return api.reducescatter_async(tensor, name=name, op=self.op)

    def wait(self, handle: Any) -> Any:
        result = self.api.synchronize(handle)
        return result[0] if isinstance(result, tuple) else result    # alltoall: (out, splits)

    def round(self, op: str, tensors: list[Any]) -> tuple[float, list[Any]]:
        """One round of ``op`` on every tensor, started together after a barrier; its
        seconds (until every result is back) and the results."""
        names = [f"bench.{op}.{i}" for i in range(len(tensors))]
        self.api.barrier()
        start = time.perf_counter()
        # earlier tensors first (push_pull's priority), as a training step would want
        handles = [self.start(op, t, name, -i)
                   for i, (t, name) in enumerate(zip(tensors, names, strict=True))]
        outputs = [self.wait(h) for h in handles]
        return time.perf_counter() - start, outputs


def _setup(args: argparse.Namespace, average: bool) -> tuple[_System, int, int, Callable[[], None]]:
    """Initialise ``args.system``; returns (its collectives, rank, size, shutdown)."""
    if args.system == "bpsctl":
        import bpsctl
        import bpsctl.engine.torch as bps
        bps.init()
        return _System(bps, f"bpsctl {bpsctl.__version__}", average), bps.rank(), bps.size(), \
            bps.shutdown
    use_horovod_env(args, args.timeout)
    import horovod
    import horovod.torch as hvd
    hvd.init()
    return _System(hvd, f"horovod {horovod.__version__} gloo", average), hvd.rank(), hvd.size(), \
        hvd.shutdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.collectives")
    parser.add_argument("--system", choices=("bpsctl", "horovod"), required=True)
    parser.add_argument("--ops", default="allreduce",
                        help=f"comma-separated, among {', '.join(OPS)} (push_pull: bpsctl only)")
    parser.add_argument("--reduce", choices=REDUCES, default="average")
    parser.add_argument("--size", default="64MiB")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds the whole run may take; a hung worker exits after it")
    add_horovod_arguments(parser)
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]
    unknown = [op for op in ops if op not in OPS or (op == "push_pull" and args.system != "bpsctl")]
    if unknown:
        parser.error(f"--ops: {', '.join(unknown)} is not an op of {args.system}")

    # a hang (a peer gone, a rendezvous never answered) ends in a traceback and exit
    faulthandler.dump_traceback_later(args.timeout, exit=True, file=2)     # fd 2: stderr
    try:
        _run(args, ops)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(args: argparse.Namespace, ops: list[str]) -> None:
    """Every op of ``ops`` in turn on ``args.system`` (see the module's docstring)."""
    import torch
    torch.set_num_threads(1)        # several workers share this machine's cores (both systems)
    average = args.reduce == "average"
    system, rank, size, shutdown = _setup(args, average)
    counts = element_counts(parse_size(args.size), args.tensors, size)
    results: dict[str, Any] = {}
    for op in ops:
        tensors = inputs(op, counts, rank, size)
        seconds = []
        for done in range(args.warmup + args.repeats):
            took, outputs = system.round(op, tensors)
            if done == 0:       # every rank checks its own results; a wrong one ends the run
                try:
                    check(op, outputs, counts, rank, size, average, args.system)
                except ValueError as exc:
                    raise SystemExit(f"rank {rank}: {exc}") from None
            if done >= args.warmup:
                seconds.append(took)
        results[op] = {"seconds": seconds, "bytes": 4 * sum(counts), "checked": True}
    if rank == 0:
        print_result({"system": args.system, "version": system.version, "workers": size,
                      "tensors": len(counts), "reduce": args.reduce, "ops": results})
    shutdown()

if __name__ == "__main__":
    main()
