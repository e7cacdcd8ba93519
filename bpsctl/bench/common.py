"""What the benchmarks' worker programs and the bench that starts them both use: the result
line a worker prints and bench reads back, the environment each Horovod worker gets, and what
to do about a Horovod built without NCCL.

The worker programs (comm, collectives, train, allreduce, convergence), the device checks (gpu)
and the Horovod baseline (horovod) all import from here and not from each other, so no
benchmark module has to import the one that imports it.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping

#: the Horovod release `bpsctl install horovod` builds
HOROVOD_VERSION = "0.28.1"
#: the command that builds it
INSTALL_COMMAND = "bpsctl install horovod"

#: starts the one stdout line of rank 0 that holds a benchmark worker's result as JSON
RESULT_MARKER = "BPSCTL_RESULT "


def print_result(result: dict) -> None:
    """Rank 0's result, as the line :func:`bpsctl.bench.api` looks for in the relayed output
    (and takes out of it: the user sees the table, not this line)."""
    print(RESULT_MARKER + json.dumps(result), flush=True)


def horovod_env(rank: int, hosts: list[tuple[str, int]], rendezvous_addr: str,
                rendezvous_port: int, iface: str, timeout_s: float) -> dict[str, str]:
    """What horovodrun's gloo launcher (horovod/runner/gloo_run.py: ``create_slot_env_vars``
    and ``create_run_env_vars``) gives the worker of ``rank``; ``hosts`` lists (host, slots)
    in rank order, ranks filling each host in turn, as ``get_host_assignments`` does."""
    size = sum(count for _, count in hosts)
    first = 0
    for index, (host, count) in enumerate(hosts):
        if rank < first + count:
            local_rank = rank - first
            # cross ranks: the hosts that have a slot at this local rank, in host order
            crossing = [i for i, (_, c) in enumerate(hosts) if c > local_rank]
            return {
                "HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(count),
                "HOROVOD_CROSS_RANK": str(crossing.index(index)),
                "HOROVOD_CROSS_SIZE": str(len(crossing)),
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": iface, "NCCL_SOCKET_IFNAME": iface,
                "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout_s)),
            }
        first += count
    raise ValueError(f"rank {rank} is not in the host plan {hosts} ({size} slots)")


def add_horovod_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags by which bench tells a Horovod worker its host plan and rendezvous server
    (:func:`bpsctl.bench.horovod.worker_args` writes them)."""
    parser.add_argument("--horovod-hosts", default="", help="addr:slots,... in rank order")
    parser.add_argument("--rendezvous-addr", default="")
    parser.add_argument("--rendezvous-port", type=int, default=0)


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``addr:slots,addr:slots`` (Horovod's -H) into [(addr, slots)]."""
    hosts = []
    for part in text.split(","):
        host, _, count = part.rpartition(":")
        hosts.append((host, int(count)))
    return hosts


#: Horovod's cycle (HOROVOD_CYCLE_TIME, ms): its background thread fuses and starts what is
#: ready once a cycle (the default since Horovod 0.21)
HOROVOD_CYCLE_MS = 1.0


def dilated_horovod_cycle(environ: Mapping[str, str], dilation: float) -> dict[str, str]:
    """The HOROVOD_CYCLE_TIME of a replay ``dilation`` times slower than recorded (the given
    one, else Horovod's default, times ``dilation``): a cycle lasts what it lasts on the
    cluster the replay stands for, so Horovod fuses as much per cycle as there and its thread
    wakes as often per step. Nothing to set without dilation."""
    if dilation == 1.0:
        return {}
    cycle_ms = float(environ.get("HOROVOD_CYCLE_TIME") or HOROVOD_CYCLE_MS)
    return {"HOROVOD_CYCLE_TIME": f"{cycle_ms * dilation:g}"}


def use_horovod_env(args: argparse.Namespace, timeout_s: float) -> None:
    """Give this worker process (rank ``$RANK`` of bpsctl's launcher) the environment
    horovodrun's gloo launcher would (:func:`horovod_env`), from the flags of
    :func:`add_horovod_arguments`; Gloo binds the interface the launcher named for this host
    (``GLOO_SOCKET_IFNAME``; loopback on the embedded default). Call before ``hvd.init()``."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME") or "lo"
    os.environ.update(horovod_env(int(os.environ["RANK"]), parse_hosts(args.horovod_hosts),
                                  args.rendezvous_addr, args.rendezvous_port, iface, timeout_s))


def rebuild_for_gpus_message() -> str:
    """Why `--compare horovod` on GPUs cannot use this Horovod, and how to rebuild it."""
    return (f"--compare horovod on GPUs: this Horovod was built without NCCL, so it cannot "
            f"allreduce CUDA tensors as its GPU users do. Rebuild it on a machine with a CUDA "
            f"toolkit (nvcc) and NCCL: `{INSTALL_COMMAND} --force` builds with "
            "HOROVOD_GPU_OPERATIONS=NCCL when it finds both (set CUDA_HOME and NCCL_HOME if "
            "they are not in the usual places); or drop horovod from --compare, or use "
            "--device cpu")
