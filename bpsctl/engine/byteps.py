"""BytePS's knobs, one table: what bpsctl does with each variable of BytePS's docs/env.md.

A BytePS deployment sets ``BYTEPS_*`` (and a few ``DMLC_*``/``PS_*``) variables that change how
BytePS runs. Each one is either *honoured*, mapped onto the ``BPSCTL_*`` knob that means the
same (a ``BPSCTL_*`` value wins when both are set, and the conflict is said), or *ignored*
because it has no meaning here (RDMA, NUMA pinning, NCCL rings, GDB), and then named once.
A ``BYTEPS_*`` variable missing from the table is named too: nothing a user set is passed
over in silence, and nothing here raises but a value that cannot be parsed (named).

:func:`translate` is pure: a mapping of variables in, the ``BPSCTL_*`` variables to add and
the lines to log out. ``bpslaunch`` (:mod:`bpsctl.launch.dmlc`) applies it before it starts
any role, so every process it starts sees the translated knobs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from bpsctl.config import _PARSERS, Config, ConfigError


@dataclass(frozen=True)
class Knob:
    """One BytePS variable: the ``BPSCTL_*`` knob it becomes (``target``), or why it is
    ignored (``ignored``). ``note`` says what bpsctl does with it, for the docs."""

    target: str = ""
    ignored: str = ""
    note: str = ""


_NO_NCCL = ("bpsctl's intra-node stage is shared memory (CPU tensors) or NCCL picked by "
            "the torch plugin itself; it has no NCCL rings, groups or PCIe-switch layout to tune")
_NO_PINNING = "bpsctl pins no process to cores or NUMA nodes; the operating system places them"

#: every variable of BytePS's docs/env.md (and the BYTEPS_* names bpsctl already read)
BYTEPS_KNOBS: dict[str, Knob] = {
    "BYTEPS_PARTITION_BYTES": Knob(target="BPSCTL_PARTITION_BYTES"),
    "BYTEPS_SERVER_ENGINE_THREAD": Knob(target="BPSCTL_SERVER_THREADS"),
    "BYTEPS_ENABLE_ASYNC": Knob(target="BPSCTL_ASYNC"),
    "BYTEPS_FORCE_DISTRIBUTED": Knob(target="BPSCTL_FORCE_DISTRIBUTED"),
    "BYTEPS_MIN_COMPRESS_BYTES": Knob(target="BPSCTL_MIN_COMPRESS_BYTES"),
    "BYTEPS_TRACE_START_STEP": Knob(target="BPSCTL_TRACE_START_STEP"),
    "BYTEPS_TRACE_END_STEP": Knob(target="BPSCTL_TRACE_END_STEP"),
    "BYTEPS_TRACE_ON": Knob(target="BPSCTL_TRACE_DIR",
                            note="1: traces go to BYTEPS_TRACE_DIR, else ./traces"),
    "BYTEPS_TRACE_DIR": Knob(target="BPSCTL_TRACE_DIR", note="read with BYTEPS_TRACE_ON=1"),
    "BYTEPS_LOCAL_RANK": Knob(target="BPSCTL_LOCAL_RANK",
                              note="bpslaunch sets it on each worker process it starts"),
    "BYTEPS_LOCAL_SIZE": Knob(target="BPSCTL_LOCAL_SIZE",
                              note="bpslaunch sets it on each worker process it starts"),
    "BYTEPS_LOG_LEVEL": Knob(ignored="bpsctl's processes log at INFO; warnings and errors "
                                     "always show"),
    "PS_VERBOSE": Knob(ignored="bpsctl has no ps-lite; its processes log at INFO"),
    "BYTEPS_SERVER_ENABLE_SCHEDULE": Knob(
        ignored="bpsctl's servers sum partitions as they arrive; workers already push them "
                "in the order the gradients become ready"),
    "BYTEPS_PCIE_SWITCH_SIZE": Knob(ignored=_NO_NCCL),
    "BYTEPS_NCCL_NUM_RINGS": Knob(ignored=_NO_NCCL),
    "BYTEPS_NCCL_GROUP_SIZE": Knob(ignored=_NO_NCCL),
    "BYTEPS_NUMA_ON": Knob(ignored=_NO_PINNING),
    "BYTEPS_NUMA_DEFAULT_QUOTA": Knob(ignored=_NO_PINNING),
    "BYTEPS_CPU_BLACKLIST": Knob(ignored=_NO_PINNING),
    "BYTEPS_VISIBLE_CPU_CORES": Knob(ignored=_NO_PINNING),
    "BYTEPS_MULTITHREADED_CPU": Knob(ignored=_NO_PINNING),
    "BYTEPS_ENABLE_GDB": Knob(ignored="bpslaunch runs the command as it is, not under gdb; "
                                      "a failed worker's last lines are reported"),
    "BYTEPS_DEBUG_SAMPLE_TENSOR": Knob(ignored="bpsctl does not print sampled tensors; "
                                               "`bpsctl trace` shows each tensor's timeline"),
    "DMLC_ENABLE_RDMA": Knob(ignored="bpsctl runs over TCP (ZeroMQ); there is no RDMA "
                                     "transport, so the job runs over TCP whatever this says"),
}


@dataclass(frozen=True)
class Translation:
    """What :func:`translate` found: the ``BPSCTL_*`` variables to add, and what to log."""

    env: dict[str, str]
    notes: list[str]


def _field_of(env: str) -> dataclasses.Field:
    for f in dataclasses.fields(Config):
        if f.metadata["env"] == env:
            return f
    raise KeyError(env)


def _parse(env: str, text: str, what: str) -> object:
    """``text`` as the knob ``env`` reads it; ConfigError naming ``what`` if it cannot be."""
    return _PARSERS[_field_of(env).metadata["kind"]](text, what)


def translate(environ: Mapping[str, str]) -> Translation:
    """The ``BPSCTL_*`` variables the BytePS variables of ``environ`` stand for, and one line
    for each variable ignored, unknown, or in conflict with a ``BPSCTL_*`` value (which wins).
    Raises ConfigError naming the variable whose value cannot be parsed."""
    env: dict[str, str] = {}
    notes: list[str] = []
    given = {name: value for name, value in environ.items() if value != "" and (
        name.startswith("BYTEPS_") or name in BYTEPS_KNOBS)}
    wanted: dict[str, tuple[str, str]] = {}       # BPSCTL_* -> (BytePS name, value)
    for name in sorted(given):
        value = given[name]
        knob = BYTEPS_KNOBS.get(name)
        if knob is None:
            notes.append(f"{name}={value} is not a BytePS knob bpsctl knows (BytePS's "
                         "docs/env.md); ignored")
        elif knob.ignored:
            notes.append(f"{name}={value} is ignored: {knob.ignored}")
        elif name == "BYTEPS_TRACE_ON":
            if value == "1":
                wanted["BPSCTL_TRACE_DIR"] = (name, given.get("BYTEPS_TRACE_DIR", "./traces"))
        elif name == "BYTEPS_TRACE_DIR":
            if given.get("BYTEPS_TRACE_ON") != "1":
                notes.append(f"{name}={value} is ignored: BytePS and bpsctl trace only with "
                             "BYTEPS_TRACE_ON=1 (or BPSCTL_TRACE_DIR)")
        else:
            _parse(knob.target, value, name)
            wanted[knob.target] = (name, value)
    for target, (name, value) in wanted.items():
        mine = environ.get(target, "")
        if mine == "":
            env[target] = value
            continue
        same = _parse(target, mine, target) == _parse(target, value, name) \
            if target != "BPSCTL_TRACE_DIR" else mine == value
        if not same:
            notes.append(f"{name}={value} and {target}={mine} are both set and differ: "
                         f"{target} wins")
    return Translation(env=env, notes=notes)


def honoured() -> dict[str, str]:
    """BytePS name -> the ``BPSCTL_*`` knob it becomes (for docs and tests)."""
    return {name: knob.target for name, knob in BYTEPS_KNOBS.items() if knob.target}


__all__ = ["BYTEPS_KNOBS", "ConfigError", "Knob", "Translation", "honoured", "translate"]
