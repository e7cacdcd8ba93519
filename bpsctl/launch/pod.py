"""Several worker processes in one Kubernetes worker pod: what ``bpsctl k8s render
--hosts-per-node K`` runs as the pod's command.

``python -m bpsctl.launch.pod --node-rank R --local-size K --world-size W -- CMD...`` starts K
copies of CMD, local rank i with ``RANK = R·K + i``, ``LOCAL_RANK = i``, ``LOCAL_WORLD_SIZE =
K`` and ``WORLD_SIZE = W`` over the pod's environment (which holds everything else:
``BPSCTL_SCHEDULER``, ``BPSCTL_SECRET``, ``MASTER_ADDR``, ...). Their output goes to the pod's,
each line prefixed ``[rank] ``. As ``bpsctl run`` does: the first process to fail is the root
cause (the others are stopped and its exit code is the pod's), and SIGTERM (the kubelet
stopping the pod) stops every process, giving each ``STOP_GRACE_S``. It reads no environment
variable itself: Kubernetes puts the pod's index into the arguments (``$(NODE_RANK)``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from bpsctl.launch.output import OutputRelay
from bpsctl.launch.processes import Interrupted, start_process, stop_groups, stop_signals_recorded
from bpsctl.launch.runloop import STOP_GRACE_S

_POLL_INTERVAL_S = 0.05


def local_env(node_rank: int, local_rank: int, local_size: int,
              world_size: int) -> dict[str, str]:
    """The torch-style variables of local rank ``local_rank`` in pod ``node_rank`` (pure)."""
    return {"RANK": str(node_rank * local_size + local_rank), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "WORLD_SIZE": str(world_size)}


def run_pod(cmd: Sequence[str], node_rank: int, local_size: int, world_size: int, *,
            env_of: Callable[[int], Mapping[str, str]] | None = None,
            what: str = "pod", pids: list[int] | None = None) -> int:
    """Run the ``local_size`` processes of pod ``node_rank``; their exit code (see the
    module's docstring). ``env_of(local_rank)``: variables of that process over the torch-style
    ones (bpslaunch's worker machine adds its BPSCTL_* identity); ``what`` names the group of
    processes in messages; ``pids`` gets the PID of each process started."""
    if not cmd:
        raise ValueError("expected the worker command after --")
    if local_size < 1 or node_rank < 0 or (node_rank + 1) * local_size > world_size:
        raise ValueError(f"pod {node_rank} with {local_size} processes each does not fit in "
                         f"WORLD_SIZE {world_size}")
    started: list[tuple[int, subprocess.Popen, OutputRelay]] = []
    identities = []
    with stop_signals_recorded() as stop_signals:
        try:
            for local_rank in range(local_size):
                env = {**os.environ, **local_env(node_rank, local_rank, local_size, world_size),
                       **(env_of(local_rank) if env_of is not None else {})}
                rank = int(env["RANK"])
                try:
                    process, identity = start_process(list(cmd), env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE)
                except OSError as exc:
                    sys.stderr.write(f"cannot start local rank {local_rank}: {cmd[0]}: "
                                     f"{exc.strerror}\n")
                    return 127
                assert process.stdout is not None and process.stderr is not None     # PIPE
                started.append((rank, process, OutputRelay(
                    rank, process.stdout, process.stderr, sys.stdout, sys.stderr,
                    log_path=Path(os.devnull))))      # kubectl logs keeps the output
                identities.append(identity)
                if pids is not None:
                    pids.append(identity.pid)
            while True:
                stop_signals.check()
                codes = [process.poll() for _, process, _ in started]
                failed = [(rank, code) for (rank, _, _), code in zip(started, codes, strict=True)
                          if code]
                if failed:
                    rank, code = failed[0]
                    sys.stderr.write(f"rank {rank} exited {code}; stopping the {what}'s other "
                                     "ranks\n")
                    return code if code > 0 else 128 - code
                if all(code == 0 for code in codes):
                    return 0
                time.sleep(_POLL_INTERVAL_S)
        except Interrupted as interrupted:
            return 128 + interrupted.signum
        finally:
            stop_groups(identities, STOP_GRACE_S)
            for _, process, relay in started:
                process.wait()
                relay.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bpsctl.launch.pod",
                                     description="Several worker processes in one pod.")
    parser.add_argument("--node-rank", type=int, required=True, help="this pod's index")
    parser.add_argument("--local-size", type=int, required=True, help="processes in this pod")
    parser.add_argument("--world-size", type=int, required=True, help="processes in the job")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return run_pod(cmd, args.node_rank, args.local_size, args.world_size)
    except ValueError as exc:
        parser.error(str(exc))          # exit 2
        return 2


if __name__ == "__main__":
    sys.exit(main())
