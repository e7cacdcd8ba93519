"""``python -m bpsctl.launch.cgexec PROCS -- CMD ...``: join the cgroup whose
``cgroup.procs`` file is PROCS, then become CMD (same pid, so its process group and identity
are what the launcher recorded). Emulated stragglers' worker hosts run their processes
through this, so every process they start is CPU-limited from its first instruction."""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m bpsctl.launch.cgexec PROCS -- CMD ...", file=sys.stderr)
        sys.exit(2)
    procs, cmd = args[0], args[2:]
    try:
        with open(procs, "w") as file:
            file.write(str(os.getpid()))
    except OSError as exc:
        print(f"bpsctl: cannot join the cgroup of {procs}: {exc}", file=sys.stderr)
        sys.exit(1)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"bpsctl: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
