"""``--ship``: give every host a working bpsctl: a wheel of the bpsctl this launcher runs and,
for whatever the host's Python lacks of bpsctl's core runtime dependencies, the wheels of the
versions installed here, all installed offline (``pip --no-index --find-links``).

Per host: a probe (stdlib and the host's pip only: bpsctl may not be there yet) reports the
host Python's version, the wheel tags it accepts, its environment markers and what it has
installed. The launcher walks bpsctl's requirements (only the core ones: numpy, pyzmq, rich,
typer, psutil and what they need; no extras, no torch) with that host's markers and keeps what
the host does not already satisfy. Each such package comes, by preference, from this
launcher's own installation, repacked into a wheel (no network, and the hosts get exactly the
versions the launcher runs, e.g. the numpy its mxnet needs) when its tags suit the host; else
the same version is downloaded for the host's Python and platform (``pip download``, from the
launcher's configured index). Repacked wheels are cached in ``<state dir>/wheelhouse``.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bpsctl
from bpsctl.launch.transport import HostFailure, Hosts, parallel, remote_argv
from bpsctl.launch.types import LaunchError

SHIP_TIMEOUT_S = 600


def build_wheel(out_dir: Path) -> Path:
    """A wheel of the bpsctl this launcher runs, packed from its source tree (see
    :func:`pack_wheel`): no setuptools, no build isolation, no index needed, whatever Python
    (a venv of Python 3.12+ has no setuptools, one of 3.11 no ``wheel`` for its bdist_wheel)."""
    root = Path(bpsctl.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").exists():
        raise LaunchError(f"--ship: bpsctl at {root} is not a source tree (no pyproject.toml); "
                          "install the same bpsctl version on every host instead")
    return pack_wheel(root, out_dir)


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def pack_wheel(root: Path, out_dir: Path) -> Path:
    """The wheel setuptools builds of this pure-Python project, packed from ``pyproject.toml``
    and the package's files (tests/test_ship.py checks that the two agree)."""
    try:
        import tomllib
    except ImportError:                 # Python 3.10: tomli is one of bpsctl's requirements
        import tomli as tomllib  # type: ignore[no-redef, import-not-found]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                f"Summary: {project.get('description', '')}"]
    if "requires-python" in project:
        metadata.append(f"Requires-Python: {project['requires-python']}")
    metadata += [f"Requires-Dist: {r}" for r in project.get("dependencies", [])]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        metadata.append(f"Provides-Extra: {extra}")
        for r in requirements:
            requirement, _, marker = (part.strip() for part in r.partition(";"))
            marker = f"({marker}) and " if marker else ""
            metadata.append(f'Requires-Dist: {requirement}; {marker}extra == "{extra}"')
    info = f"{name}-{version}.dist-info"
    files: dict[str, bytes] = {}
    package = root / "bpsctl"
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files[path.relative_to(package.parent).as_posix()] = path.read_bytes()
    files[f"{info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: bpsctl {bpsctl.__version__}\n"
                              "Root-Is-Purelib: true\nTag: py3-none-any\n").encode()
    scripts = project.get("scripts", {})
    if scripts:
        files[f"{info}/entry_points.txt"] = ("[console_scripts]\n" + "".join(
            f"{script} = {target}\n" for script, target in scripts.items())).encode()
    files[f"{info}/top_level.txt"] = f"{package.name}\n".encode()
    wheel = out_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for arcname, data in files.items():
            archive.writestr(arcname, data)
        record = [_record_line(arcname, data) for arcname, data in files.items()]
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return wheel


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's core ``Requires-Dist`` (those of extras left out), markers kept."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    requirements = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                    if line.startswith("Requires-Dist:")]
    return [r for r in requirements if not re.search(r"\bextra\b", r.partition(";")[2])]


# --------------------------------------------------------------------------- what a host needs

def _packaging() -> Any:
    """``packaging`` (its requirements and markers), or the copy pip vendors."""
    try:
        import packaging.markers
        import packaging.requirements
        return packaging
    except ImportError:             # pragma: no cover - pip always carries it
        import pip._vendor.packaging.markers  # noqa: F401
        import pip._vendor.packaging.requirements  # noqa: F401
        from pip._vendor import packaging as vendored
        return vendored


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Run by each host's python before anything is copied: stdlib and its pip only.
_PROBE = """\
import importlib.metadata as m, json, platform, re, sys, sysconfig
out = {"python": sys.executable, "version": platform.python_version(),
       "platform": sysconfig.get_platform(), "installed": {}, "tags": None, "markers": None}
for d in m.distributions():
    name = d.metadata["Name"]
    if name:
        out["installed"].setdefault(re.sub(r"[-_.]+", "-", name).lower(), d.version)
try:
    from pip._vendor.packaging import markers, tags
    out["tags"] = [str(t) for t in tags.sys_tags()]
    out["markers"] = markers.default_environment()
except Exception as exc:
    out["pip"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@dataclass
class HostPython:
    """What the probe found: the host Python's version, platform, tags, markers, packages."""

    python: str
    version: str
    platform: str
    installed: dict[str, str]
    tags: list[str] | None              # None: no pip there (the install says so)
    markers: dict[str, str] | None

    @classmethod
    def from_probe(cls, data: dict[str, Any]) -> HostPython:
        return cls(python=data["python"], version=data["version"], platform=data["platform"],
                   installed=dict(data.get("installed") or {}), tags=data.get("tags"),
                   markers=data.get("markers"))

    def key(self) -> str:
        """Hosts with the same key accept the same wheels."""
        return hashlib.sha256(json.dumps([self.tags, self.markers], sort_keys=True)
                              .encode()).hexdigest()[:16]


@dataclass
class Needs:
    """A host's missing dependencies: local distributions to repack, and pins to download."""

    repack: dict[str, importlib.metadata.Distribution] = field(default_factory=dict)
    download: dict[str, str] = field(default_factory=dict)     # name -> requirement
    unpinned: dict[str, str] = field(default_factory=dict)     # not installed here

    def __bool__(self) -> bool:
        return bool(self.repack or self.download or self.unpinned)


def wheel_tags(dist: importlib.metadata.Distribution) -> list[str]:
    """The tags an installed distribution's wheel had (its ``WHEEL`` file)."""
    text = dist.read_text("WHEEL") or ""
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Tag:")]


def _local(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def plan_dependencies(requirements: Sequence[str], host: HostPython,
                      local: Callable[[str], importlib.metadata.Distribution | None] = _local
                      ) -> Needs:
    """Which of ``requirements`` (and their requirements) ``host`` lacks, and where each comes
    from: this launcher's installed version when its wheel suits the host, else that version
    (or, if not installed here, the requirement) downloaded for the host's Python."""
    pk = _packaging()
    environment = {**(host.markers or {}), "extra": ""}
    accepted = set(host.tags or ())
    needs = Needs()
    decided: set[str] = set()
    todo = list(requirements)
    while todo:
        req = pk.requirements.Requirement(todo.pop(0))
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        name = canonical(req.name)
        if name in decided:
            continue
        have = host.installed.get(name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue        # for this requirement; every other one naming it is checked too
        decided.add(name)
        dist = local(name)
        if dist is None or not req.specifier.contains(dist.version, prereleases=True):
            needs.unpinned[name] = str(req.name) + str(req.specifier)
            continue
        if accepted.intersection(wheel_tags(dist)) and _repackable(dist) is None:
            needs.repack[name] = dist
        else:
            needs.download[name] = f"{name}=={dist.version}"
        todo.extend(dist.requires or [])
    return needs


# --------------------------------------------------------------------------- the wheelhouse

def _info_dir(dist: importlib.metadata.Distribution) -> str | None:
    for path in dist.files or ():
        if path.name == "METADATA" and path.parent.name.endswith(".dist-info"):
            return str(path.parent)
    return None


def _repackable(dist: importlib.metadata.Distribution) -> str | None:
    """None if ``dist`` can be repacked into its wheel, else why not."""
    if not dist.files or _info_dir(dist) is None:
        return "no RECORD of its files"
    if not wheel_tags(dist):
        return "not installed from a wheel (no WHEEL file)"
    direct_url = dist.read_text("direct_url.json")
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
        return "an editable install"
    return None


def _wheel_name(dist: importlib.metadata.Distribution) -> str:
    tags = [tag.split("-") for tag in wheel_tags(dist)]
    parts = [".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3)]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    return f"{name}-{dist.version}-{'-'.join(parts)}.whl"


_SKIPPED_INFO = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def repack(dist: importlib.metadata.Distribution, cache_dir: Path) -> Path:
    """The wheel ``dist`` was installed from, rebuilt from its installed files (``RECORD``).

    Left out: compiled ``.pyc`` files, and files outside site-packages (console scripts, which
    pip writes anew from ``entry_points.txt``). Cached under ``cache_dir`` by the hash of the
    installation's RECORD."""
    why = _repackable(dist)
    if why is not None:
        raise LaunchError(f"--ship: cannot repack {dist.metadata['Name']} {dist.version}: {why}")
    info = _info_dir(dist)
    record = dist.read_text("RECORD") or ""
    out_dir = cache_dir / hashlib.sha256(record.encode()).hexdigest()[:16]
    wheel = out_dir / _wheel_name(dist)
    if wheel.is_file():
        return wheel
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = wheel.with_name(wheel.name + f".{os.getpid()}.partial")
    lines = []
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in dist.files or ():
            parts = path.parts
            if (parts[0] == ".." or "__pycache__" in parts or path.suffix == ".pyc"
                    or (str(path.parent) == info and path.name in _SKIPPED_INFO)):
                continue
            source = Path(str(dist.locate_file(path)))
            if not source.is_file():
                continue
            archive.write(source, path.as_posix())
            lines.append(_record_line(path.as_posix(), source.read_bytes()))
        lines.append(f"{info}/RECORD,,")
        archive.writestr(f"{info}/RECORD", "\n".join(lines) + "\n")
    os.replace(partial, wheel)
    return wheel


def download(requirements: Sequence[str], host: HostPython, out_dir: Path, *,
             deps: bool) -> list[Path]:
    """``pip download`` of ``requirements`` as wheels for the host's Python and platform."""
    assert host.tags and host.markers
    tags = [t.split("-") for t in host.tags]
    argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
            "--only-binary=:all:", "--dest", str(out_dir),
            "--python-version", host.markers["python_version"],
            "--implementation", tags[0][0][:2]]
    argv += [a for abi in dict.fromkeys(t[1] for t in tags if t[1] != "none")
             for a in ("--abi", abi)]
    argv += [a for plat in dict.fromkeys(t[2] for t in tags if t[2] != "any")
             for a in ("--platform", plat)]
    if not deps:
        argv.append("--no-deps")
    before = set(out_dir.glob("*.whl"))
    done = subprocess.run([*argv, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise LaunchError(f"pip download failed: {_pip_error(done.stderr)}")
    return sorted(set(out_dir.glob("*.whl")) - before) or sorted(out_dir.glob("*.whl"))


def wheelhouse(needs: Needs, host: HostPython, cache_dir: Path, download_dir: Path
               ) -> list[Path]:
    """The wheels of a host's missing dependencies: repacked here, or downloaded for it."""
    wheels = [repack(dist, cache_dir) for dist in needs.repack.values()]
    download_dir.mkdir(parents=True, exist_ok=True)
    try:
        if needs.download:
            wheels += download(list(needs.download.values()), host, download_dir, deps=False)
        if needs.unpinned:
            wheels += download(list(needs.unpinned.values()), host, download_dir, deps=True)
    except LaunchError as exc:
        wanted = ", ".join([*needs.download.values(), *needs.unpinned.values()])
        raise HostFailure(
            f"--ship: {host.python} (Python {host.version}, {host.platform}) lacks {wanted}, "
            f"whose wheels this launcher (Python {sys.version.split()[0]}) does not have and "
            f"could not download ({exc}); install them there, or ship from a launcher with "
            "the hosts' Python version") from None
    return list(dict.fromkeys(wheels))


# --------------------------------------------------------------------------- install

# Run by the hosts' python: pip install, holding a lock file in the target site-packages.
# Hosts may share one installation (a venv on NFS, one machine under two names); concurrent
# --force-reinstalls into it delete each other's files. No index, ever, and none of the host's
# pip configuration (its indexes, find-links, --user): first what is missing of bpsctl's
# requirements, from the wheelhouse shipped beside it (argv[2], when there is one), then bpsctl.
_SHIP_INSTALL = """\
import fcntl, importlib.util, os, subprocess, sys, sysconfig
try:
    lock = open(os.path.join(sysconfig.get_paths()["purelib"], ".bpsctl-ship.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
except OSError:
    pass                # not writable: pip says so
if importlib.util.find_spec("pip") is None:
    sys.exit(f"{sys.executable}: No module named pip (pip is needed for --ship)")
env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
env["PIP_CONFIG_FILE"] = os.devnull
pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index"]
wheel, links, requirements = sys.argv[1], sys.argv[2], sys.argv[3:]
if links and requirements:
    done = subprocess.run([*pip, "--find-links", links, *requirements], env=env)
    if done.returncode:
        sys.exit(done.returncode)
sys.exit(subprocess.run([*pip, "--force-reinstall", "--no-deps", wheel], env=env).returncode)
"""


def _pip_error(stderr: str) -> str:
    """pip's ERROR lines (its warnings and notices left out), else the last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return " | ".join(errors or [line for line in lines if not line.startswith(
        ("[notice]", "WARNING"))][-3:] or lines[-3:])[-500:]


def _size_mb(paths: Sequence[Path]) -> float:
    return sum(p.stat().st_size for p in paths) / 1e6


def ship(session: Hosts, targets: Sequence[str], cache_dir: Path | None = None,
         progress: Callable[[str], None] | None = None) -> dict[str, str]:
    """Install this bpsctl, and what each target's ``python:`` lacks of its dependencies, into
    that Python; returns the failures by host."""
    say = progress or (lambda text: None)
    python = session.spec.python
    with tempfile.TemporaryDirectory(prefix="bpsctl-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        requirements = wheel_requirements(wheel)
        cache = cache_dir or Path(tmp) / "wheelhouse"

        def probe(host: str) -> HostPython:
            done = session.connections[host].run(remote_argv([python, "-c", _PROBE]), hide=True,
                                                 warn=True, timeout=60, in_stream=False)
            if done.exited != 0:
                raise HostFailure(f"--ship: {session._explain_failure(done.exited, done.stderr)}")
            try:
                return HostPython.from_probe(json.loads(done.stdout.strip().splitlines()[-1]))
            except (ValueError, IndexError, KeyError):
                raise HostFailure(f"--ship: {python} could not describe itself: "
                                   f"{done.stderr.strip()[-300:]}") from None

        failures: dict[str, str] = {}
        found: dict[str, HostPython] = {}
        for host, (ok, value) in parallel(targets, probe).items():
            if ok:
                found[host] = value
            else:
                failures[host] = value
        shipped: dict[str, list[Path]] = {}
        built: dict[str, list[Path]] = {}           # by host Python and what it lacks
        unbuilt: dict[str, str] = {}
        for host, found_python in found.items():
            needs = plan_dependencies(requirements, found_python) if found_python.tags else Needs()
            key = found_python.key() + ":" + ",".join(sorted([*needs.repack, *needs.download,
                                                              *needs.unpinned]))
            if needs and key not in built and key not in unbuilt:
                try:
                    built[key] = wheelhouse(needs, found_python, cache,
                                            Path(tmp) / "download" / found_python.key())
                except (HostFailure, LaunchError) as exc:
                    unbuilt[key] = str(exc)
            if key in unbuilt:
                failures[host] = unbuilt[key]
            else:
                shipped[host] = built.get(key, [])
        every = {w for wheels in shipped.values() for w in wheels}
        if every:
            say(f"installing this bpsctl and {len(every)} missing dependencies "
                f"({_size_mb(sorted(every)):.0f} MB) on the hosts (--ship)")

        def install(host: str) -> None:
            conn = session.connections[host]
            remote_dir = conn.run("mktemp -d", hide=True, in_stream=False).stdout.strip()
            conn.put(str(wheel), f"{remote_dir}/{wheel.name}")
            links = ""
            if shipped[host]:
                links = f"{remote_dir}/wheelhouse"
                conn.run(remote_argv(["mkdir", links]), hide=True, in_stream=False)
                for dep in shipped[host]:
                    conn.put(str(dep), f"{links}/{dep.name}")
            result = conn.run(remote_argv([python, "-c", _SHIP_INSTALL,
                                           f"{remote_dir}/{wheel.name}", links,
                                           *requirements]),
                              hide=True, warn=True, timeout=SHIP_TIMEOUT_S, in_stream=False)
            conn.run(remote_argv(["rm", "-rf", remote_dir]), hide=True, warn=True,
                     in_stream=False)
            if result.exited != 0:
                what = wheel.name + (f" and {len(shipped[host])} dependencies"
                                     if shipped[host] else "")
                raise HostFailure(f"--ship: pip install of {what} into {python} failed "
                                  f"(exit {result.exited}): {_pip_error(result.stderr)}")

        for host, (ok, message) in parallel(list(shipped), install).items():
            if not ok:
                failures[host] = message
    return {host: failures[host] for host in targets if host in failures}
