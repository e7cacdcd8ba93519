"""The newest dependency versions that pyproject.toml allows still pass a smoke subset.

A newcomer's ``pip install`` takes the newest release inside each bound, so a release that
breaks bpsctl reaches users before anyone upgrades by hand. This test makes a throwaway
virtualenv, installs bpsctl's own dependencies (the core, the ``[ssh]`` extra and the test
runner from ``[test]``) as pip resolves them today, within pyproject.toml's bounds, and runs
the tests of the parts they carry: configuration, hosts files, planning, the engine on NumPy
and ZeroMQ, and the CLI. torch and MXNet are left out: the README's commands pin torch, and
MXNet pins NumPy below 1.24, so the CI virtualenv tests those versions already; this one
tests the NumPy 2, pyzmq, typer, rich, pytest ... that a user without MXNet gets.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:         # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
#: what the tests below need from the [test] extra: the runner and its plugins
RUNNER = ("pytest", "pytest-timeout", "pytest-xdist")
SMOKE = ["tests/test_config.py", "tests/test_hosts.py", "tests/test_plan.py",
         "tests/test_partition.py", "tests/test_engine.py", "tests/test_cli.py"]
INSTALL_TIMEOUT_S = 400
SMOKE_TIMEOUT_S = 400
#: what pip says when no index can be reached (then the test skips, saying so)
UNREACHABLE = ("Network is unreachable", "NewConnectionError", "Temporary failure in name "
               "resolution", "Name or service not known")


def requirements() -> list[str]:
    """bpsctl's core and [ssh] requirements and the test runner's, as pyproject.toml bounds
    them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runner = [req for req in extras["test"] if Requirement(req).name in RUNNER]
    return [*project["dependencies"], *extras["ssh"], *runner]


def test_every_requirement_is_bounded_above_and_the_runner_is_among_them():
    reqs = [Requirement(req) for req in requirements()]
    assert {req.name for req in reqs} >= {"numpy", "pyzmq", "typer", "rich", *RUNNER}
    for req in reqs:
        if req.name != "tomli":         # a backport, for Python 3.10 only
            assert any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier), \
                f"{req}: bound it below its next major release"


def test_the_newest_allowed_dependencies_pass_a_smoke_subset(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    try:
        install = subprocess.run([python, "-m", "pip", "install", "-q", *requirements()],
                                 env=env, capture_output=True, text=True,
                                 timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip install of the newest allowed versions took over "
                    f"{INSTALL_TIMEOUT_S} s")
    if install.returncode and any(sign in install.stderr for sign in UNREACHABLE):
        pytest.skip(f"no package index reachable: {install.stderr.strip()[-300:]}")
    assert install.returncode == 0, install.stderr[-3000:]
    versions = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], env=env,
                              capture_output=True, text=True, check=True, timeout=60).stdout
    # the bpsctl under test is this checkout's, found through PYTHONPATH
    smoke = subprocess.run([python, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            "-m", "not slow and not root", *SMOKE], cwd=ROOT,
                           env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                           timeout=SMOKE_TIMEOUT_S)
    assert smoke.returncode == 0, (f"with the newest allowed versions:\n{versions}\n"
                                   f"{smoke.stdout[-6000:]}{smoke.stderr[-2000:]}")
    assert " passed" in smoke.stdout.splitlines()[-1], smoke.stdout[-2000:]
