"""hosts.yaml (docs/design.md), Horovod's ``-H h1:4,h2:4`` and ``host slots=N`` hostfiles.

:func:`load_hosts` turns any of them into a validated, frozen :class:`HostsSpec`. The YAML form
is checked with pydantic models (unknown keys, wrong types, ``slots: 0``); every error names
the file, the line, the key and the form expected, as a :class:`~bpsctl.config.ConfigError`.
"""
from __future__ import annotations

import getpass
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bpsctl.config import ConfigError, parse_rate_mbit
from bpsctl.launch.types import DEFAULT_MASTER_PORT, HostSpec, HostsSpec, SshOptions

DEFAULT_SCHEDULER_PORT = 9000
DEFAULT_PYTHON = "python3"
DEFAULT_WORKDIR = "~/.bpsctl/remote"

_HOROVOD_RE = re.compile(r"^\s*[^\s,:]+(:\d+)?(\s*,\s*[^\s,:]+(:\d+)?)*\s*$")


# --------------------------------------------------------------------------- schema (pydantic)

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_Port = Field(ge=1, le=65535)


class _SshModel(_Model):
    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    key: str | None = None
    connect_timeout_s: float | int | None = Field(default=None, gt=0)
    retries: int | None = Field(default=None, ge=0, le=20)
    known_hosts: str | None = Field(default=None, min_length=1)


class _SchedulerModel(_Model):
    host: str = Field(min_length=1)
    port: int = Field(default=DEFAULT_SCHEDULER_PORT, ge=1, le=65535)
    interface: str | None = None
    address: str | None = None
    ssh: _SshModel | None = None


class _ServerModel(_Model):
    host: str = Field(min_length=1)
    count: int = Field(default=1, ge=1, le=256)
    port: int | None = Field(default=None, ge=1, le=65535)
    interface: str | None = None
    address: str | None = None
    ssh: _SshModel | None = None
    spare: bool = False
    share: float | None = Field(default=None, ge=0, le=1)
    nic: str | None = None


class _WorkerModel(_Model):
    host: str = Field(min_length=1)
    slots: int = Field(default=1, ge=1, le=1024)
    interface: str | None = None
    address: str | None = None
    ssh: _SshModel | None = None
    nic: str | None = None


class _HostsModel(_Model):
    ssh: _SshModel | None = None
    python: str = Field(default=DEFAULT_PYTHON, min_length=1)
    workdir: str = Field(default=DEFAULT_WORKDIR, min_length=1)
    master_port: int = Field(default=DEFAULT_MASTER_PORT, ge=1, le=65535)
    env: dict[str, str] = Field(default_factory=dict)
    scheduler: _SchedulerModel | None = None
    servers: list[_ServerModel] | None = None
    workers: list[_WorkerModel]


_EXPECTED = {
    "ssh": "a mapping such as {user: ubuntu, port: 22, key: ~/.ssh/id_ed25519}",
    "scheduler": "a mapping such as {host: 10.0.0.5, port: 9000}",
    "servers": "a list such as [{host: 10.0.0.5, count: 2}]",
    "workers": "a list such as [{host: 10.0.0.1, slots: 8}], a Horovod list \"h1:4,h2:4\" "
               "or {hostfile: path}",
    "env": "a mapping of variable names to strings",
}


# --------------------------------------------------------------------------- loading

def load_hosts(source: str | Path) -> HostsSpec:
    """A :class:`HostsSpec` from a hosts.yaml, a ``host slots=N`` hostfile, or ``h1:4,h2:4``.

    Files ending in .yaml/.yml (or starting with a YAML mapping) are hosts.yaml; other files
    are hostfiles; text that is not a file and looks like ``h1:4,h2:4`` is Horovod's ``-H``.
    Raises :class:`ConfigError` naming the file, line, key and expected form.
    """
    path = Path(str(source)).expanduser()
    if not path.exists():
        if isinstance(source, str) and _HOROVOD_RE.match(source) and "/" not in source \
                and not source.endswith((".yaml", ".yml")):
            return _from_workers(str(source), _parse_horovod(str(source), str(source)))
        raise ConfigError(f"--hosts: {source}: no such file (expected a hosts.yaml, a hostfile "
                          "of `host slots=N` lines, or Horovod's h1:4,h2:4)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--hosts: {path}: cannot read it ({exc.strerror})") from None
    if path.suffix in (".yaml", ".yml") or _looks_like_yaml_mapping(text):
        return parse_hosts_yaml(text, str(path))
    return _from_workers(str(path), parse_hostfile(text, str(path)))


def parse_byteps_hostfile(text: str, where: str) -> list[tuple[str, int | None, int]]:
    """A hostfile of BytePS's dist_launcher.py: one ``host`` or ``host:ssh_port`` a line ->
    [(host, ssh port or None, line)]; blank lines and ``#`` comments are skipped."""
    found: list[tuple[str, int | None, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, port = line.partition(":")
        if not host or " " in line or (sep and not (port.isdigit() and 0 < int(port) < 65536)):
            raise ConfigError(f"{where}:{number}: expected `host` or `host:ssh_port` (BytePS's "
                              f"dist_launcher.py hostfile), got {raw.strip()!r}")
        found.append((host, int(port) if sep else None, number))
    if not found:
        raise ConfigError(f"{where}: no hosts (expected one `host` or `host:ssh_port` a line)")
    return found


def load_byteps_hostfiles(worker_file: str | Path, server_file: str | Path) -> HostsSpec:
    """The hosts of BytePS's dist_launcher.py pair (``--worker-hostfile``,
    ``--server-hostfile``): a worker slot for each line of the first (one worker machine, as
    DMLC_WORKER_ID counts them; a host on several lines gets as many slots), a server for each
    line of the second (likewise), the scheduler on the first server host; ``:port`` is the
    line's SSH port, as dist_launcher.py reads it."""
    parsed = {}
    for role, flag, path in (("workers", "--worker-hostfile", worker_file),
                             ("servers", "--server-hostfile", server_file)):
        path = Path(path).expanduser()
        try:
            parsed[role] = parse_byteps_hostfile(path.read_text(), f"{flag} {path}")
        except OSError as exc:
            raise ConfigError(f"{flag}: {path}: cannot read it ({exc.strerror})") from None

    def entries(lines: list[tuple[str, int | None, int]], many: str) -> list[dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for host, port, _ in lines:
            if host in merged:
                merged[host][many] += 1
            else:
                merged[host] = {"host": host, many: 1,
                                **({"ssh": {"port": port}} if port is not None else {})}
        return list(merged.values())

    servers = entries(parsed["servers"], "count")
    raw = {"scheduler": {k: v for k, v in servers[0].items() if k != "count"},
           "servers": servers, "workers": entries(parsed["workers"], "slots")}
    return _build(_HostsModel.model_validate(raw), f"{worker_file} + {server_file}", {}, None)


def _looks_like_yaml_mapping(text: str) -> bool:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return bool(re.match(r"^[A-Za-z_]+\s*:(\s|$)", stripped))
    return False


def parse_hostfile(text: str, where: str) -> list[tuple[str, int, int]]:
    """``host slots=N`` lines (MPI/DeepSpeed) -> [(host, slots, line)]; comments and blank
    lines are skipped; a host without ``slots=`` has 1."""
    found = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = 1
        for option in parts[1:]:
            key, sep, value = option.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep:
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(f"{where}:{number}: slots: expected a whole number of at "
                                      f"least 1, as in `{parts[0]} slots=4`, got {value!r}")
                if key == "slots":
                    slots = int(value)
            else:
                raise ConfigError(f"{where}:{number}: expected `host slots=N`, got {raw.strip()!r}")
        found.append((parts[0], slots, number))
    if not found:
        raise ConfigError(f"{where}: no hosts (expected lines such as `10.0.0.1 slots=4`)")
    return found


def _parse_horovod(text: str, where: str, line: int | None = None) -> list[tuple[str, int, int]]:
    found = []
    for item in text.split(","):
        host, sep, slots = item.strip().partition(":")
        if not host or (sep and (not slots.isdigit() or int(slots) < 1)):
            at = f"{where}:{line}" if line else where
            raise ConfigError(f"{at}: workers: expected Horovod's host:slots list such as "
                              f"h1:4,h2:4 (slots at least 1), got {item.strip()!r}")
        found.append((host, int(slots) if sep else 1, line or 0))
    return found


def _from_workers(source: str, workers: list[tuple[str, int, int]]) -> HostsSpec:
    """Only workers given: the scheduler on the first host, one server on each worker host."""
    ssh = SshOptions(user=getpass.getuser())
    raw = {"workers": [{"host": h, "slots": s} for h, s, _ in workers]}
    lines = {("workers", i): ln for i, (_, _, ln) in enumerate(workers) if ln}
    return _build(_HostsModel.model_validate(raw), source, lines, ssh)


class _LineLoader(yaml.SafeLoader):
    pass


def _yaml_tree(text: str, where: str) -> tuple[Any, dict[tuple, int]]:
    """The YAML document, and the 1-based line of every key and list item by path."""
    try:
        loader = _LineLoader(text)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark else where
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{at}: not valid YAML ({problem})") from None
    lines: dict[tuple, int] = {}

    def walk(n: Any, path: tuple) -> Any:
        if isinstance(n, yaml.MappingNode):
            result = {}
            for key_node, value_node in n.value:
                key = walk(key_node, path)
                if not isinstance(key, str):
                    raise ConfigError(f"{where}:{key_node.start_mark.line + 1}: expected a text "
                                      f"key, got {key!r}")
                if key in result:
                    raise ConfigError(f"{where}:{key_node.start_mark.line + 1}: "
                                      f"{_dotted(path + (key,))}: duplicate key")
                lines[path + (key,)] = key_node.start_mark.line + 1
                result[key] = walk(value_node, path + (key,))
            return result
        if isinstance(n, yaml.SequenceNode):
            items = []
            for index, item in enumerate(n.value):
                lines[path + (index,)] = item.start_mark.line + 1
                items.append(walk(item, path + (index,)))
            return items
        return yaml.SafeLoader.construct_object(_scalar_loader, n)

    if node is None:
        raise ConfigError(f"{where}: empty (expected a hosts.yaml mapping with at least "
                          "`workers:`)")
    return walk(node, ()), lines


_scalar_loader = yaml.SafeLoader("")


def _dotted(path: tuple) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _line_of(lines: dict[tuple, int], path: tuple) -> int | None:
    for end in range(len(path), -1, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None


def _where(where: str, lines: dict[tuple, int], path: tuple) -> str:
    line = _line_of(lines, path)
    return f"{where}:{line}" if line else where


def parse_hosts_yaml(text: str, where: str = "hosts.yaml") -> HostsSpec:
    """Validate hosts.yaml text; ``where`` names it in errors."""
    data, lines = _yaml_tree(text, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}:1: expected a mapping with at least `workers:` "
                          f"(see examples/hosts.yaml), got {type(data).__name__}")
    if "workers" in data:
        data = {**data, "workers": _expand_workers(data["workers"], where, lines)}
    try:
        model = _HostsModel.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, data, where, lines)) from None
    return _build(model, where, lines, None)


def _expand_workers(value: Any, where: str, lines: dict[tuple, int]) -> Any:
    """``workers: "h1:4,h2:4"`` and ``workers: {hostfile: path}`` as the list form."""
    line = _line_of(lines, ("workers",))
    if isinstance(value, str):
        parsed = _parse_horovod(value, where, line)
    elif (isinstance(value, dict) and set(value) == {"hostfile"}
          and isinstance(value["hostfile"], str)):
        hostfile = Path(value["hostfile"]).expanduser()
        if not hostfile.is_absolute():
            hostfile = Path(where).resolve().parent / hostfile
        try:
            parsed = parse_hostfile(hostfile.read_text(), str(hostfile))
        except OSError as exc:
            raise ConfigError(f"{where}:{line}: workers.hostfile: cannot read {hostfile} "
                              f"({exc.strerror})") from None
    else:
        return value
    for index in range(len(parsed)):
        lines[("workers", index)] = line or 0
    return [{"host": h, "slots": s} for h, s, _ in parsed]


def _explain(exc: ValidationError, data: dict[str, Any], where: str,
             lines: dict[tuple, int]) -> str:
    messages = []
    seen = set()
    for error in exc.errors():
        loc = tuple(error["loc"])
        key = _dotted(loc)
        kind = error["type"]
        value = error.get("input")
        if kind == "missing":
            text = f"{key}: missing (required)"
            if len(loc) == 1 and loc[0] == "workers":
                text += "; expected " + _EXPECTED["workers"]
        elif kind == "extra_forbidden":
            text = f"{key}: unknown key{_did_you_mean(loc)}"
        elif kind in ("int_type", "int_parsing"):
            text = f"{key}: expected a whole number, got {value!r}"
        elif kind in ("string_type",):
            text = f"{key}: expected text, got {value!r}"
        elif kind in ("float_type",):
            text = f"{key}: expected a number, got {value!r}"
        elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            bound = {"greater_than_equal": "at least", "greater_than": "more than",
                     "less_than_equal": "at most", "less_than": "less than"}[kind]
            limit = next(iter(error.get("ctx", {}).values()), "")
            text = f"{key}: expected {bound} {limit}, got {value!r}"
        elif kind in ("dict_type", "model_type", "list_type", "model_attributes_type"):
            name = next((p for p in reversed(loc) if isinstance(p, str)), "")
            expected = _EXPECTED.get(name, "a mapping" if kind != "list_type" else "a list")
            text = f"{key}: expected {expected}, got {value!r}"
        elif kind == "string_too_short":
            text = f"{key}: must not be empty"
        else:
            text = f"{key}: {error['msg']}, got {value!r}"
        message = f"{_where(where, lines, loc)}: {text}"
        if message not in seen:
            seen.add(message)
            messages.append(message)
    return "\n".join(messages)


def _did_you_mean(loc: tuple) -> str:
    models: dict[str, type[BaseModel]] = {"ssh": _SshModel, "scheduler": _SchedulerModel,
                                          "servers": _ServerModel, "workers": _WorkerModel}
    parent = [p for p in loc[:-1] if isinstance(p, str)]
    model: type[BaseModel] = _HostsModel
    if parent:
        model = _SshModel if parent[-1] == "ssh" else models.get(parent[0], _HostsModel)
    return f" (expected one of: {', '.join(model.model_fields)})"


def _ssh(model: _SshModel | None, base: SshOptions) -> SshOptions:
    if model is None:
        return base
    return SshOptions(
        user=model.user if model.user is not None else base.user,
        port=model.port if model.port is not None else base.port,
        key=str(Path(model.key).expanduser()) if model.key is not None else base.key,
        connect_timeout_s=float(model.connect_timeout_s) if model.connect_timeout_s is not None
        else base.connect_timeout_s,
        retries=model.retries if model.retries is not None else base.retries,
        known_hosts=os.path.abspath(os.path.expanduser(model.known_hosts))
        if model.known_hosts is not None else base.known_hosts)


def _build(model: _HostsModel, where: str, lines: dict[tuple, int],
           base: SshOptions | None) -> HostsSpec:
    base = _ssh(model.ssh, base or SshOptions(user=getpass.getuser()))
    workers_models = model.workers
    if not workers_models:
        raise ConfigError(f"{_where(where, lines, ('workers',))}: workers: expected at least one "
                          "worker host")
    rates = _nic_rates(model, where, lines)
    workers = tuple(HostSpec(role="worker", host=w.host, count=w.slots, ssh=_ssh(w.ssh, base),
                             interface=w.interface, address=w.address,
                             line=_line_of(lines, ("workers", i)), nic_mbit=rates.get(w.host))
                    for i, w in enumerate(workers_models))
    sched_model = model.scheduler or _SchedulerModel(host=workers[0].host)
    scheduler = HostSpec(role="scheduler", host=sched_model.host, count=1,
                         ssh=_ssh(sched_model.ssh, base), port=sched_model.port,
                         interface=sched_model.interface, address=sched_model.address,
                         line=_line_of(lines, ("scheduler",)))
    if model.servers is None:
        # BytePS's colocated default: one server on each worker host
        server_models = [_ServerModel(host=w.host, interface=w.interface, address=w.address)
                         for w in workers]
    else:
        server_models = model.servers
    if not [s for s in server_models if not s.spare]:
        raise ConfigError(f"{_where(where, lines, ('servers',))}: servers: expected at least "
                          "one server that is not a spare (leave `servers:` out for one on each "
                          "worker host)")
    # Ports: each host's servers take consecutive ports after the scheduler's (or after the
    # entry's own `port:`), so nothing collides unless the file says so.
    next_port: dict[str, int] = {scheduler.host: sched_model.port + 1}
    default_first = sched_model.port + 1
    servers = []
    used: dict[tuple[str, int], str] = {(scheduler.host, sched_model.port): "scheduler.port"}
    for i, s in enumerate(server_models):
        first = s.port if s.port is not None else next_port.get(s.host, default_first)
        if first + s.count - 1 > 65535:
            raise ConfigError(f"{_where(where, lines, ('servers', i))}: servers[{i}].port: "
                              f"{s.count} ports from {first} go past 65535")
        for port in range(first, first + s.count):
            clash = used.get((s.host, port))
            if clash:
                raise ConfigError(f"{_where(where, lines, ('servers', i))}: servers[{i}]: "
                                  f"duplicate host and port {s.host}:{port} (also {clash}); "
                                  "expected a distinct `port:` for each entry on one host")
            used[(s.host, port)] = f"servers[{i}]"
        next_port[s.host] = first + s.count
        servers.append(HostSpec(role="server", host=s.host, count=s.count, ssh=_ssh(s.ssh, base),
                                port=first, interface=s.interface, address=s.address,
                                line=_line_of(lines, ("servers", i)), spare=s.spare,
                                share=None if s.share is None else float(s.share),
                                nic_mbit=rates.get(s.host)))
    _check_shares(server_models, model.servers is not None, where, lines)
    seen_workers: dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.host in seen_workers:
            raise ConfigError(f"{_where(where, lines, ('workers', i))}: workers[{i}].host: "
                              f"duplicate host {w.host} (also workers[{seen_workers[w.host]}]); "
                              "expected each worker host once, with `slots:` for more processes")
        seen_workers[w.host] = i
    for (host, port), owner in used.items():
        if port == model.master_port and host == workers[0].host:
            raise ConfigError(f"{where}: master_port {port} is also {owner} on {host}; expected "
                              "a port of its own")
    for name in model.env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ConfigError(f"{_where(where, lines, ('env', name))}: env.{name}: expected a "
                              "variable name (letters, digits, _)")
    return HostsSpec(source=where, python=model.python, workdir=model.workdir,
                     scheduler=scheduler, servers=tuple(servers), workers=workers,
                     master_port=model.master_port, env=tuple(sorted(model.env.items())))


def _nic_rates(model: _HostsModel, where: str, lines: dict[tuple, int]) -> dict[str, float]:
    """Each host's NIC rate in Mbit/s from the entries' ``nic:`` (the layout model's input):
    none, or one for every worker host and every host of servers, agreeing where a host has
    several entries."""
    rates: dict[str, float] = {}
    given: dict[str, str] = {}
    entries = [("workers", i, w.host, w.nic) for i, w in enumerate(model.workers or [])]
    entries += [("servers", i, s.host, s.nic) for i, s in enumerate(model.servers or [])
                if not s.spare]
    for kind, i, host, nic in entries:
        if nic is None:
            continue
        path = (kind, i, "nic")
        rate = parse_rate_mbit(nic, f"{_where(where, lines, path)}: {kind}[{i}].nic")
        if host in rates and rates[host] != rate:
            raise ConfigError(f"{_where(where, lines, path)}: {kind}[{i}].nic: {nic} for "
                              f"{host}, whose NIC {given[host]} already gives "
                              f"{rates[host]:g} Mbit/s; expected one rate per host")
        rates[host] = rate
        given[host] = f"{kind}[{i}].nic"
    if rates:
        for kind, i, host, _ in entries:
            if host not in rates:
                raise ConfigError(f"{_where(where, lines, (kind, i))}: {kind}[{i}].nic: missing "
                                  f"for {host}; the layout model needs every worker and server "
                                  "host's NIC rate once one is given (e.g. nic: 10gbit), or none "
                                  "(equal rates)")
    return rates


def _check_shares(servers: list[_ServerModel], explicit: bool, where: str,
                  lines: dict[tuple, int]) -> None:
    """``share:`` is on every server entry but the spares, or on none, and the shares sum
    to 1; a spare takes the share of the server it replaces."""
    if not explicit:
        return
    shared = [(i, s) for i, s in enumerate(servers) if not s.spare]
    for i, s in enumerate(servers):
        if s.spare and s.share is not None:
            raise ConfigError(f"{_where(where, lines, ('servers', i, 'share'))}: servers[{i}]."
                              "share: a spare takes the share of the server it replaces; drop "
                              "share: from the spare entry")
    if all(s.share is None for _, s in shared):
        return
    for i, s in shared:
        if s.share is None:
            raise ConfigError(f"{_where(where, lines, ('servers', i))}: servers[{i}].share: "
                              "missing; give every server entry but the spares a share: (the "
                              "entry's servers together sum that share of the bytes), or none "
                              "for the layout model's")
    total = sum(float(s.share or 0) for _, s in shared)
    if abs(total - 1) > 1e-6:
        raise ConfigError(f"{_where(where, lines, ('servers',))}: servers: the shares sum to "
                          f"{total:g}; expected 1 (each entry's share: is the part of the bytes "
                          "its servers sum together)")


__all__ = ["HostSpec", "HostsSpec", "SshOptions", "load_byteps_hostfiles", "load_hosts",
           "parse_byteps_hostfile", "parse_hostfile", "parse_hosts_yaml"]
