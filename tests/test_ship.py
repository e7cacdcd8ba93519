"""``--ship``'s pieces without SSH: which dependencies a host lacks and where each comes from,
the wheels repacked from this Python's installation, the download for another Python, and
how a host's import failure is told apart from a missing bpsctl.

tests/test_ssh_cluster.py ships for real, to emulated hosts with no route to any index.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import zmq
from packaging import tags as packaging_tags
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

from bpsctl.launch import ship
from bpsctl.launch.transport import HostFailure, Hosts

CORE = ["numpy>=1.21", "pyzmq>=25", "rich>=13", "typer>=0.12", "psutil>=5.9",
        'tomli>=1.1; python_version < "3.11"']


def this_python(installed: dict[str, str] | None = None) -> ship.HostPython:
    """A host whose Python is this one, with ``installed`` (default: nothing)."""
    return ship.HostPython(python="/h/python", version="3.11.7", platform="linux-x86_64",
                           installed=installed or {},
                           tags=[str(t) for t in packaging_tags.sys_tags()],
                           markers=default_environment())


def python_310() -> ship.HostPython:
    """A host with CPython 3.10 on manylinux x86_64."""
    platforms = ["manylinux_2_35_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "linux_x86_64"]
    tags = [*packaging_tags.cpython_tags((3, 10), platforms=platforms),
            *packaging_tags.compatible_tags((3, 10), "cp310", platforms)]
    return ship.HostPython(python="/h/python3.10", version="3.10.13", platform="linux-x86_64",
                           installed={}, tags=[str(t) for t in tags],
                           markers={**default_environment(), "python_version": "3.10",
                                    "python_full_version": "3.10.13"})


def test_the_wheel_requires_only_the_core_dependencies(tmp_path):
    wheel = ship.build_wheel(tmp_path)
    requirements = ship.wheel_requirements(wheel)
    names = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0] for r in requirements}
    assert names == {"numpy", "pyzmq", "rich", "typer", "psutil", "tomli"}, requirements


def _wheel_contents(wheel: Path) -> tuple[list[str], set[str], str]:
    from packaging.requirements import Requirement
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if not n.endswith("/RECORD"))
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        metadata = archive.read(f"{info}/METADATA").decode().split("\n\n")[0]
        requires = {str(Requirement(line.split(":", 1)[1])) for line in metadata.splitlines()
                    if line.startswith("Requires-Dist:")}
        head = [line for line in metadata.splitlines() if line.split(":")[0] in
                ("Name", "Version", "Requires-Python", "Provides-Extra")]
        entry_points = archive.read(f"{info}/entry_points.txt").decode().strip()
    return names, requires | set(head), entry_points


def _setuptools_wheel(root: Path, out_dir: Path) -> Path:
    """The wheel setuptools builds, from a clean copy of the source (in the tree it would add
    stale modules from build/lib): with this Python's setuptools if it can, else in pip's build
    isolation (which needs an index)."""
    source = out_dir / "source"
    shutil.copytree(root / "bpsctl", source / "bpsctl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    isolation = []
    if importlib.util.find_spec("setuptools") is not None:     # not imported: it would put
        version = importlib.metadata.version("setuptools")      # its vendored copies on the path
        can_build = (Version(version) >= Version("70.1")                # its own bdist_wheel
                     or importlib.util.find_spec("wheel") is not None)
        isolation = ["--no-build-isolation"] if can_build else []
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--disable-pip-version-check", *isolation, "-w", str(out_dir),
                           str(source)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"setuptools cannot build the wheel to compare with here: "
                    f"{done.stderr.strip()[-300:]}")
    return next(out_dir.glob("bpsctl-*.whl"))


def test_the_packed_wheel_is_the_one_setuptools_builds(tmp_path):
    """--ship packs the wheel itself: a launcher's Python may lack setuptools or an index."""
    root = Path(ship.bpsctl.__file__).resolve().parents[1]
    (tmp_path / "built").mkdir()
    (tmp_path / "packed").mkdir()
    packed = ship.build_wheel(tmp_path / "packed")
    names, requires, entry_points = _wheel_contents(packed)
    assert "bpsctl/launch/remote.py" in names
    assert {"bpsctl = bpsctl.cli:main", "bpslaunch = bpsctl.launch.dmlc:main"} <= \
        set(entry_points.splitlines()), entry_points
    target = tmp_path / "target"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--disable-pip-version-check", "--target", str(target),
                           str(packed)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (target / "bin" / "bpsctl").is_file() and (target / "bin" / "bpslaunch").is_file()
    built = _setuptools_wheel(root, tmp_path / "built")
    assert packed.name == built.name
    assert (names, requires, entry_points) == _wheel_contents(built)


def test_a_host_with_everything_needs_nothing():
    installed = {ship.canonical(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions()}
    assert not ship.plan_dependencies(CORE, this_python(installed))


def test_a_bare_python_gets_this_pythons_versions_repacked():
    needs = ship.plan_dependencies(CORE, this_python())
    assert not needs.download and not needs.unpinned
    assert {"numpy", "pyzmq", "rich", "typer", "psutil"} <= set(needs.repack)
    assert needs.repack["numpy"].version == numpy.__version__
    assert needs.repack["pyzmq"].version == zmq.__version__
    # what they need too, never torch or an extra's packages
    assert "markdown-it-py" in needs.repack and "torch" not in needs.repack
    assert "tomli" not in needs.repack              # python_version < "3.11" only


def test_what_the_host_has_is_kept_and_what_is_too_old_replaced():
    needs = ship.plan_dependencies(CORE, this_python({"numpy": "1.20.0", "pyzmq": "26.0.0",
                                                      "rich": "14.0.0"}))
    assert "numpy" in needs.repack                  # 1.20 < 1.21
    assert "pyzmq" not in needs.repack and "rich" not in needs.repack
    assert "markdown-it-py" not in needs.repack     # rich's: the host's rich has them


def test_what_the_host_has_is_checked_against_every_requirement_naming_it():
    typer = importlib.metadata.distribution("typer")
    wanted = next(r for r in typer.requires if r.startswith("rich"))     # rich>=13.8.0 here
    needs = ship.plan_dependencies(CORE, this_python({"rich": "13.0.0", "numpy": "1.23.5",
                                                      "pyzmq": "27.3.0", "psutil": "7.2.2"}))
    assert "typer" in needs.repack
    assert ("rich" in needs.repack) == (not Requirement(wanted).specifier.contains("13.0.0"))


def test_another_python_gets_the_same_versions_downloaded_for_it():
    def local(name):
        return None if name == "tomli" else ship._local(name)

    needs = ship.plan_dependencies(CORE, python_310(), local)
    assert needs.download["numpy"] == f"numpy=={numpy.__version__}"
    assert needs.download["pyzmq"] == f"pyzmq=={zmq.__version__}"
    assert "rich" in needs.repack                   # py3-none-any suits any Python 3
    assert needs.unpinned == {"tomli": "tomli>=1.1"}   # not installed here: downloaded


def test_download_asks_pip_for_the_hosts_python_and_platform(tmp_path, monkeypatch):
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: Could not find a version "
                                                        "that satisfies the requirement")

    monkeypatch.setattr(ship.subprocess, "run", fake_run)
    host = python_310()
    needs = ship.Needs(download={"numpy": "numpy==1.23.5"})
    with pytest.raises(HostFailure) as failure:
        ship.wheelhouse(needs, host, tmp_path / "cache", tmp_path / "download")
    argv = calls[0]
    assert argv[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--only-binary=:all:" in argv and "--no-deps" in argv
    assert argv[argv.index("--python-version") + 1] == "3.10"
    assert argv[argv.index("--implementation") + 1] == "cp"
    assert {argv[i + 1] for i, a in enumerate(argv) if a == "--abi"} >= {"cp310", "abi3"}
    assert {argv[i + 1] for i, a in enumerate(argv) if a == "--platform"} >= {
        "manylinux_2_17_x86_64", "linux_x86_64"}
    assert argv[-1] == "numpy==1.23.5"
    message = str(failure.value)
    assert message.startswith("--ship: /h/python3.10 (Python 3.10.13, linux-x86_64) lacks "
                              "numpy==1.23.5")
    assert "could not download" in message and "install them there" in message


@pytest.mark.parametrize("name", ["mdurl", "psutil"])
def test_a_repacked_wheel_installs_as_the_original(name, tmp_path):
    dist = importlib.metadata.distribution(name)
    wheel = ship.repack(dist, tmp_path / "cache")
    assert wheel.name.startswith(f"{name}-{dist.version}-")
    assert ship.repack(dist, tmp_path / "cache") == wheel          # cached
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert not [n for n in names if n.endswith(".pyc") or n.startswith("..")]
        record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD")))
        for line in record.decode().splitlines():
            path, digest, size = line.rsplit(",", 2)
            if digest:
                data = archive.read(path)
                assert len(data) == int(size)
                assert digest == "sha256=" + base64.urlsafe_b64encode(
                    hashlib.sha256(data).digest()).rstrip(b"=").decode()
    target = tmp_path / "target"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--disable-pip-version-check", "--target", str(target),
                           str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, "
                            f"{str(target)!r}); import {name}; print({name}.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert found.stdout.strip().startswith(str(target)), found.stderr


# --------------------------------------------------------------------------- preflight's words

def explain(code: int, stderr: str) -> str:
    fake = SimpleNamespace(spec=SimpleNamespace(python="/h/python", source="hosts.yaml"))
    return Hosts._explain_failure(fake, code, stderr)


def traceback_ending(last: str) -> str:
    return ("Traceback (most recent call last):\n"
            '  File "/h/site-packages/bpsctl/engine/__init__.py", line 17, in <module>\n'
            f"    import numpy as np\n{last}\n")


def test_a_missing_bpsctl_is_told_apart_from_a_missing_dependency():
    assert explain(1, "/h/python: Error while finding module specification for "
                      "'bpsctl.launch.remote' (ModuleNotFoundError: No module named 'bpsctl')"
                   ).startswith("bpsctl is not installed for /h/python on this host")
    assert explain(1, traceback_ending("ModuleNotFoundError: No module named 'zmq'")) == (
        "bpsctl is installed for /h/python on this host but cannot be imported: "
        "ModuleNotFoundError: No module named 'zmq'; use --ship (it installs bpsctl's "
        "dependencies too) or install pyzmq there (/h/python -m pip install pyzmq)")
    broken = explain(1, traceback_ending("ImportError: numpy.core.multiarray failed to import"))
    assert broken == ("bpsctl is installed for /h/python on this host but cannot be imported: "
                      "ImportError: numpy.core.multiarray failed to import; use --ship (it "
                      "installs bpsctl's dependencies too)")
    assert explain(127, "").startswith("/h/python: not found on this host")


def test_the_agent_check_says_what_the_roles_cannot_import(monkeypatch):
    """bpsctl.launch imports lazily, so the agent runs where numpy or pyzmq are missing; its
    check imports what the scheduler and servers will, and preflight reports what failed."""
    from bpsctl.launch import remote
    assert remote.cmd_check({"address": "127.0.0.1", "ports": []})["import_error"] is None
    monkeypatch.setattr(remote, "_ROLE_MODULES", ("bpsctl.engine.server", "no_such_dependency"))
    failed = remote.cmd_check({"address": "127.0.0.1", "ports": []})["import_error"]
    assert failed == {"error": "ModuleNotFoundError: No module named 'no_such_dependency'",
                      "module": "no_such_dependency"}
