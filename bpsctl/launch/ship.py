"""``--ship``: install the bpsctl this launcher runs on every host, as a wheel built here."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import bpsctl
from bpsctl.launch.transport import HostFailure, Hosts, parallel, remote_argv
from bpsctl.launch.types import LaunchError


def build_wheel(out_dir: Path) -> Path:
    """A wheel of the bpsctl this launcher runs (from its source tree)."""
    root = Path(bpsctl.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").exists():
        raise LaunchError(f"--ship: bpsctl at {root} is not a source tree (no pyproject.toml); "
                          "install the same bpsctl version on every host instead")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out_dir), str(root)],
                          capture_output=True, text=True)
    wheels = sorted(out_dir.glob("bpsctl-*.whl"))
    if done.returncode != 0 or not wheels:
        raise LaunchError(f"--ship: building the bpsctl wheel failed: {done.stderr.strip()[-500:]}")
    return wheels[-1]


# Run by the hosts' python: pip install, holding a lock file in the target site-packages.
# Hosts may share one installation (a venv on NFS, one machine under two names); concurrent
# --force-reinstalls into it delete each other's files. No index: the wheel has no deps to find.
_SHIP_INSTALL = """\
import fcntl, os, runpy, sys, sysconfig
try:
    lock = open(os.path.join(sysconfig.get_paths()["purelib"], ".bpsctl-ship.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
except OSError:
    pass                # not writable: pip says so
sys.argv = ["pip", "install", "-q", "--force-reinstall", "--no-deps", "--no-index",
            "--disable-pip-version-check", sys.argv[1]]
try:
    runpy.run_module("pip", run_name="__main__", alter_sys=True)
except ImportError as exc:
    sys.exit(f"{sys.executable}: {exc} (pip is needed for --ship)")
"""


def _pip_error(stderr: str) -> str:
    """pip's ERROR lines (its warnings and notices left out), else the last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return " | ".join(errors or [line for line in lines if not line.startswith(
        ("[notice]", "WARNING"))][-3:] or lines[-3:])[-500:]


def ship(session: Hosts, targets: Sequence[str]) -> dict[str, str]:
    """Copy a wheel of this bpsctl to every target and install it into ``python:``."""
    with tempfile.TemporaryDirectory(prefix="bpsctl-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))

        def install(host: str) -> None:
            conn = session.connections[host]
            remote_dir = conn.run("mktemp -d", hide=True, in_stream=False).stdout.strip()
            remote_wheel = f"{remote_dir}/{wheel.name}"
            conn.put(str(wheel), remote_wheel)
            result = conn.run(remote_argv([session.spec.python, "-c", _SHIP_INSTALL,
                                            remote_wheel]),
                              hide=True, warn=True, timeout=600, in_stream=False)
            conn.run(remote_argv(["rm", "-rf", remote_dir]), hide=True, warn=True,
                     in_stream=False)
            if result.exited != 0:
                raise HostFailure(f"--ship: pip install of {wheel.name} into "
                                   f"{session.spec.python} failed (exit {result.exited}): "
                                   f"{_pip_error(result.stderr)}")

        return {h: msg for h, (ok, msg) in parallel(targets, install).items() if not ok}


