"""Faults applied to one host of an emulated cluster, each undone at its end (docs/chaos.md).

Everything happens inside the cluster's own namespaces (root): signals to the processes in a
host's namespace, and ``tc`` on the host's NIC. A fault is applied by :func:`apply`, which
returns the function that undoes it (a no-op for ``kill``); an undo may be called twice.

- ``pause``: SIGSTOP to every process in the host's namespace, SIGCONT at the end;
- ``partition``: the host's switch port down, or, from some ``peers`` only, what goes between
  them classified into an htb class whose queue holds nothing (this needs neither tc
  actions nor netem, which some VM kernels lack);
- ``lossy``: ``netem`` loss with delay and jitter, reordering and duplication under each of
  the NIC's htb classes (on an unshaped NIC: as its root qdisc), where the kernel has netem;
  elsewhere loss alone: an nftables rule drops a share of what the host sends, at random;
- ``collapse``: the NIC's htb rate and ceiling, both ways, at ``factor`` of its rate;
- ``kill``: SIGKILL to every process in the host's namespace but the scheduler's supervisor,
  which restarts the scheduler (a scheduler host's kill is the scheduler's crash);
- ``disk``: the cluster's state and log directory, a small tmpfs of its own, filled to the
  last byte by one file, removed at the end.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from ..launch import emulate
from ..launch.emulate import EmulatedHost, NetworkPlan
from .schedule import Fault

Undo = Callable[[], None]
#: the htb class (and its filters' priority) a partial partition sends a peer's packets to
BLACKHOLE, BLACKHOLE_PRIO = 0xfff, 1


def apply(plan: NetworkPlan, fault: Fault, disk: Path | None = None) -> Undo:
    """Apply ``fault`` to its host of the cluster ``plan`` built (a ``disk`` fault: to the
    directory ``disk``); the function that undoes it."""
    if fault.kind == "disk":
        if disk is None:
            raise ValueError("a full-disk fault needs the state directory on a small file "
                             "system of its own (bpsctl chaos mounts one when --faults has disk)")
        return fill(disk)
    host = plan.host(fault.target)
    if fault.kind == "kill":
        _signal(_killable(emulate.namespace_pids(host.namespace)), signal.SIGKILL)
        return lambda: None
    if fault.kind == "pause":
        return pause(host)
    if fault.kind == "partition":
        return partition(plan, host, fault.params.get("peers", ()))
    if fault.kind == "lossy":
        return lossy(plan, host, float(fault.params.get("loss_percent", 2.0)),
                     float(fault.params.get("delay_ms", 50.0)))
    if fault.kind == "collapse":
        return collapse(plan, host, float(fault.params.get("factor", 0.02)))
    raise ValueError(f"unknown fault kind {fault.kind!r}")


def fill(directory: Path) -> Undo:
    """Fill the file system under ``directory`` to its last byte with one file (a log disk
    that filled up) until the undo, which removes it."""
    filler = directory / ".chaos-full-disk"
    with open(filler, "wb", buffering=0) as out:
        for size in (1 << 20, 4096, 1):       # whole pages, then what a page has left
            chunk = bytes(size)
            try:
                while out.write(chunk):
                    pass
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    filler.unlink(missing_ok=True)
                    raise
    return _once(lambda: filler.unlink(missing_ok=True))


def pause(host: EmulatedHost) -> Undo:
    """Stop every process of the host (a VM frozen by its hypervisor) until the undo."""
    pids = emulate.namespace_pids(host.namespace)
    _signal(pids, signal.SIGSTOP)
    return _once(lambda: _signal(pids, signal.SIGCONT))


def partition(plan: NetworkPlan, host: EmulatedHost, peers: Sequence[str] = ()) -> Undo:
    """The host cut off from every other (its switch port down: packets to and from it
    vanish, its own interface keeps its address), or only from ``peers`` (host names: what
    goes between them is dropped), until the undo. A partition from some peers needs
    a shaped NIC (``--nic``)."""
    if not peers:
        def port(state: str) -> None:
            emulate.run_in(plan.switch_namespace, ["ip", "link", "set", host.switch_port, state])
        port("down")
        return _once(lambda: port("up"))
    if (host.nic_mbit or plan.nic_mbit) is None:
        raise ValueError(f"a partition of {host.name} from some peers needs a shaped NIC "
                         "(--nic)")
    # a class whose queue holds no packet: what is classified there is dropped;
    # on the host's NIC by destination (what it sends them), on its switch port by source
    # (what they send it)
    sides = ((host.namespace, host.interface, "dst"),
             (plan.switch_namespace, host.switch_port, "src"))
    for namespace, dev, match in sides:
        lines = [f"class add dev {dev} parent 1: classid 1:{BLACKHOLE:x} htb rate 8bit",
                 f"qdisc add dev {dev} parent 1:{BLACKHOLE:x} handle {BLACKHOLE:x}: pfifo limit 0"]
        lines += [f"filter add dev {dev} parent 1: protocol ip prio {BLACKHOLE_PRIO} u32 match "
                  f"ip {match} {plan.host(name).address}/32 flowid 1:{BLACKHOLE:x}"
                  for name in peers]
        _tc(namespace, lines)

    def heal() -> None:
        for namespace, dev, _ in sides:
            _tc(namespace, [f"filter del dev {dev} parent 1: prio {BLACKHOLE_PRIO}",
                            f"class del dev {dev} classid 1:{BLACKHOLE:x}"])
    return _once(heal)


def netem_available() -> bool:
    """Whether this kernel has netem (``lossy`` needs it; some VM kernels are built without
    it): tried on the loopback of a namespace of its own."""
    probe = f"netem-probe-{os.getpid()}"      # not bps-...: no emulated cluster's name
    try:
        emulate.run_in_root(["ip", "netns", "add", probe])
    except emulate.EmulationError:
        return False
    try:
        emulate.run_in(probe, ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                               "1ms"])
        return True
    except emulate.EmulationError:
        return False
    finally:
        with contextlib.suppress(emulate.EmulationError):
            emulate.run_in_root(["ip", "netns", "del", probe])


def lossy_support() -> str:
    """How this machine makes a link lossy: ``"netem"`` (loss, delay, reordering and
    duplication), ``"nft"`` (nftables: loss alone, on kernels built without netem), or ``""``
    (neither: no lossy links)."""
    if netem_available():
        return "netem"
    return "nft" if shutil.which("nft") else ""


def lossy(plan: NetworkPlan, host: EmulatedHost, loss_percent: float,
          delay_ms: float) -> Undo:
    """What the host sends is lost at ``loss_percent``, delayed ``delay_ms`` (+/- a quarter of
    it), reordered and duplicated a little, until the undo (netem: see
    :func:`netem_available`); on a kernel without netem, only lost (:func:`drop`)."""
    dev = host.interface
    netem = (f"netem loss {loss_percent:g}% delay {delay_ms:g}ms {delay_ms / 4:g}ms "
             f"reorder 1% duplicate 0.5%")
    leaves = _htb_leaves(host.namespace, dev)
    try:
        if not leaves:          # an unshaped NIC: netem is its root qdisc
            _tc(host.namespace, [f"qdisc add dev {dev} root handle 1: {netem}"])
            return _once(lambda: _tc(host.namespace, [f"qdisc del dev {dev} root"]))
        _tc(host.namespace, [f"qdisc add dev {dev} parent {leaf} handle {0x100 + i:x}: {netem}"
                             for i, leaf in enumerate(leaves)])
    except emulate.EmulationError as exc:
        if "qdisc kind is unknown" not in str(exc):
            raise
        if not shutil.which("nft"):
            raise ValueError("a lossy link needs the kernel's netem qdisc (sch_netem), which "
                             "this kernel does not have, or nftables (the nft command: "
                             "apt-get install nftables); leave lossy out of --faults") from None
        return drop(plan, host, loss_percent)
    return _once(lambda: _tc(host.namespace, [f"qdisc del dev {dev} parent {leaf}"
                                              for leaf in leaves]))


def drop(plan: NetworkPlan, host: EmulatedHost, loss_percent: float) -> Undo:
    """What the host sends is dropped at random, ``loss_percent`` of its packets, until the
    undo: lost on the wire, as the host's stack sees it (its TCP retransmits; nothing fails
    to send), by an nftables rule on its switch port's ingress (a table of its own)."""
    table = f"bpsctl_lossy_{host.name}"
    per_10k = max(1, round(loss_percent * 100))
    emulate.run_in(plan.switch_namespace, ["nft", "-f", "-"], stdin=(
        f"table netdev {table} {{\n"
        "  chain lossy {\n"
        f'    type filter hook ingress device "{host.switch_port}" priority 0; policy accept;\n'
        f"    numgen random mod 10000 < {per_10k} drop\n"
        "  }\n"
        "}\n"))

    def heal() -> None:
        emulate.run_in(plan.switch_namespace, ["nft", "delete", "table", "netdev", table])
    return _once(heal)


def collapse(plan: NetworkPlan, host: EmulatedHost, factor: float) -> Undo:
    """The host's NIC, both ways, at ``factor`` of its rate until the undo (a shaped NIC only:
    ``--nic``)."""
    mbit = host.nic_mbit or plan.nic_mbit
    if mbit is None:
        raise ValueError(f"a bandwidth collapse needs a shaped NIC (--nic); {host.name}'s is not")
    total_kbit = max(1, round(mbit * 1000))
    low_kbit = max(8, round(total_kbit * factor))
    sides = ((host.namespace, host.interface), (plan.switch_namespace, host.switch_port))

    def rate(kbit: int) -> None:
        for namespace, dev in sides:
            _tc(namespace, [f"class change dev {dev} parent 1: classid 1:1 htb rate {kbit}kbit "
                            f"ceil {kbit}kbit"])
    rate(low_kbit)
    return _once(lambda: rate(total_kbit))


def _htb_leaves(namespace: str, dev: str) -> list[str]:
    """The class ids of the htb classes under 1:1 on ``dev`` (a shaped NIC's peers and ACKs)."""
    text = emulate.run_in(namespace, ["tc", "class", "show", "dev", dev])
    return re.findall(r"class htb (1:[0-9a-f]+) parent 1:1 ", text)


def _tc(namespace: str, lines: list[str]) -> None:
    emulate.run_in(namespace, ["tc", "-batch", "-"], stdin="\n".join(lines) + "\n")


def _killable(pids: Sequence[int]) -> list[int]:
    """The processes a ``kill`` ends: all but the scheduler's supervisor (which restarts the
    scheduler, as it would after the scheduler's own crash)."""
    keep = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if "bpsctl.engine.supervise" in psutil.Process(pid).cmdline():
                keep.add(pid)
    return [pid for pid in pids if pid not in keep]


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _once(undo: Undo) -> Undo:
    done: list[Any] = []

    def run() -> None:
        if not done:
            done.append(True)
            undo()
    return run
