"""An emulated cluster network on this one machine (root only).

Each emulated host is a network namespace with one veth (``eth0``) into a bridge that lives in
a "switch" namespace of its own. Addresses are on a private /24 that exists only inside those
namespaces: nothing is routed to or from this machine's own network. Each host's NIC is shaped
full duplex to a rate R with htb, one class per peer (``rate R/(P-1) ceil R`` under a parent
class of ``rate R``): the host side's egress classifies by destination (what the host sends),
the switch side's egress by source (what the host receives), so incast is fair and both
directions are capped (docs/benchmarks.md has the measurements).

Namespaces are named ``bps-<cluster id>-<host>`` (hosts ``w0..``, ``s0..``, switch ``sw``), so
a crashed run's leftovers can be found (:func:`find_leftovers`) and removed
(:func:`remove_leftovers`). Use :func:`emulated_network` to have teardown always happen.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from bpsctl.config import ConfigError, parse_rate_mbit
from bpsctl.launch.types import LaunchError

NAMESPACE_PREFIX = "bps-"
SUBNET = ipaddress.IPv4Network("10.77.0.0/24")   # exists only inside the namespaces
HOST_INTERFACE = "eth0"                          # each host's NIC, inside its namespace
BRIDGE = "br0"                                   # in the switch namespace
SWITCH_HOST = "sw"
CGROUP_ROOT = Path("/sys/fs/cgroup")              # cgroup v2, or v1's controllers below it
CPU_PERIOD_US = 100_000                           # the CPU limit's accounting period
NETNS_ETC = Path("/etc/netns")                   # `ip netns exec` bind-mounts files from here
NETNS_RUN = Path("/run/netns")                    # where `ip netns add` names namespaces
COMMAND_TIMEOUT_S = 10.0
ACK_SHARE = 0.02                                 # of R, guaranteed to pure ACKs (no data)
GSO_BYTES = 262144                               # TCP segments handed to each NIC (see _set_gso)
MAX_WORKERS = 120                                # addresses .10-.129
MAX_SERVERS = 120                                # addresses .130-.249
_WORKER_BASE = 10
_SERVER_BASE = 130
_CLUSTER_ID_RE = re.compile(r"^[a-z0-9]{1,12}$")
_NAMESPACE_RE = re.compile(r"^" + re.escape(NAMESPACE_PREFIX) + r"([a-z0-9]{1,12})-([a-z0-9]+)$")
_ROOT_HINT = ("network emulation (--emulate) needs root: it creates network namespaces and "
              "shapes them with tc. Run it as root (e.g. `sudo bpsctl ...`), or leave out "
              "--emulate to use the embedded local cluster on loopback")


class EmulationUnavailable(ConfigError):
    """Emulation cannot run here as asked (not root, no iproute2, cluster id in use)."""


class EmulationError(LaunchError):
    """An ``ip``/``tc`` command failed while building or removing the emulated network."""


# --------------------------------------------------------------------------- plan (pure)

@dataclass(frozen=True)
class EmulatedHost:
    """One emulated host: its namespace, address and NIC."""

    name: str                   # w0, w1, ..., s0, s1, ...
    role: str                   # worker | server
    rank: int                   # worker rank or server rank
    namespace: str              # bps-<id>-<name>
    address: str                # on SUBNET
    interface: str              # the NIC inside the namespace (GLOO_SOCKET_IFNAME)
    switch_port: str            # the veth's other end, in the switch namespace
    runs_scheduler: bool        # the scheduler lives beside the first server
    nic_mbit: float | None = None   # this host's own rate (a straggler's), else the plan's
    cpu_factor: float | None = None     # its worker processes' share of one CPU (a straggler's)


@dataclass(frozen=True)
class NetworkPlan:
    """What :func:`create` builds; a pure function of its arguments (:func:`plan_network`)."""

    cluster_id: str
    hosts: tuple[EmulatedHost, ...]
    nic_mbit: float | None      # None: unshaped
    switch_namespace: str
    hostname: str               # this machine's hostname, mapped per namespace in /etc/netns
    subnet: str = str(SUBNET)

    @property
    def workers(self) -> tuple[EmulatedHost, ...]:
        return tuple(h for h in self.hosts if h.role == "worker")

    @property
    def servers(self) -> tuple[EmulatedHost, ...]:
        return tuple(h for h in self.hosts if h.role == "server")

    @property
    def scheduler_host(self) -> EmulatedHost:
        return next(h for h in self.hosts if h.runs_scheduler)

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of the cluster, hosts first, the switch last."""
        return tuple(h.namespace for h in self.hosts) + (self.switch_namespace,)

    def host(self, name: str) -> EmulatedHost:
        """The host named ``w0``/``s1``/..., or by its namespace or address."""
        for h in self.hosts:
            if name in (h.name, h.namespace, h.address):
                return h
        raise KeyError(f"no emulated host {name!r} in cluster {self.cluster_id} "
                       f"(hosts: {', '.join(h.name for h in self.hosts)})")

    def per_peer_mbit(self) -> float | None:
        """Each peer's guaranteed share of the NIC, R/(P-1)."""
        if self.nic_mbit is None:
            return None
        return self.nic_mbit / max(1, len(self.hosts) - 1)


def namespace_name(cluster_id: str, host: str) -> str:
    return f"{NAMESPACE_PREFIX}{cluster_id}-{host}"


def new_cluster_id() -> str:
    return secrets.token_hex(3)


def plan_network(workers: int, servers: int, nic: str | float | None = None, *,
                 cluster_id: str | None = None, hostname: str | None = None,
                 slow: dict[int, float] | None = None,
                 slow_cpu: dict[int, float] | None = None,
                 host_cpu: float | None = None) -> NetworkPlan:
    """Plan N worker hosts and K server hosts; the scheduler lives beside server 0 (or
    worker 0 when K = 0). ``nic`` is a rate such as ``"500mbit"`` (or Mbit/s), None: unshaped.
    ``slow`` maps worker ranks to a factor of ``nic`` their host's NIC runs at (stragglers),
    ``slow_cpu`` to the share of one CPU their host's worker processes get; ``host_cpu``
    (a share of one CPU) limits every worker host, a ``slow_cpu`` rank's to its factor of it.

    Workers get addresses .10, .11, ... and servers .130, .131, ... of 10.77.0.0/24, so an
    address does not depend on how many hosts of the other role there are.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) \
            or not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"--workers: expected 1 to {MAX_WORKERS} emulated worker hosts, "
                          f"got {workers!r}")
    if isinstance(servers, bool) or not isinstance(servers, int) \
            or not 0 <= servers <= MAX_SERVERS:
        raise ConfigError(f"--servers: expected 0 to {MAX_SERVERS} emulated server hosts, "
                          f"got {servers!r}")
    if nic is None:
        nic_mbit = None
    elif isinstance(nic, (int, float)) and not isinstance(nic, bool):
        if nic <= 0:
            raise ConfigError(f"--nic: expected a rate such as 500mbit or 1gbit, got {nic!r}")
        nic_mbit = float(nic)
    else:
        nic_mbit = parse_rate_mbit(str(nic), "--nic")
    slow = slow or {}
    if slow and nic_mbit is None:
        raise ConfigError("--straggler: a slow NIC is a factor of --nic; give --nic as well")
    slow_cpu = slow_cpu or {}
    beyond = sorted(rank for rank in (*slow, *slow_cpu) if not 0 <= rank < workers)
    if beyond:
        raise ConfigError(f"--straggler: worker {beyond[0]} does not exist (workers 0 to "
                          f"{workers - 1})")
    cluster_id = new_cluster_id() if cluster_id is None else cluster_id
    if not _CLUSTER_ID_RE.match(cluster_id):
        raise ConfigError(f"emulated cluster id: expected 1-12 lowercase letters or digits, "
                          f"got {cluster_id!r}")
    hosts = []
    for role, count, base, letter in (("worker", workers, _WORKER_BASE, "w"),
                                      ("server", servers, _SERVER_BASE, "s")):
        for rank in range(count):
            name = f"{letter}{rank}"
            hosts.append(EmulatedHost(
                name=name, role=role, rank=rank, namespace=namespace_name(cluster_id, name),
                address=str(SUBNET.network_address + base + rank), interface=HOST_INTERFACE,
                switch_port=name,
                runs_scheduler=(role == "server" and rank == 0) or (servers == 0 and name == "w0"),
                nic_mbit=nic_mbit * slow[rank] if role == "worker" and rank in slow and nic_mbit
                else None,
                cpu_factor=_cpu_factor(host_cpu, slow_cpu.get(rank)) if role == "worker"
                else None))
    return NetworkPlan(cluster_id=cluster_id, hosts=tuple(hosts), nic_mbit=nic_mbit,
                       switch_namespace=namespace_name(cluster_id, SWITCH_HOST),
                       hostname=hostname if hostname is not None else socket.gethostname())


def _cpu_factor(host_cpu: float | None, straggler: float | None) -> float | None:
    """A worker host's share of one CPU: ``host_cpu`` (every host's), times a CPU straggler's
    factor; None: not limited."""
    if not host_cpu:
        return straggler
    return host_cpu * (1.0 if straggler is None else straggler)


def netns_command(namespace: str | EmulatedHost, argv: Sequence[str]) -> list[str]:
    """The argument list that runs ``argv`` inside a host's namespace."""
    ns = namespace.namespace if isinstance(namespace, EmulatedHost) else namespace
    return ["ip", "netns", "exec", ns, *argv]


def run_in_root(argv: Sequence[str]) -> str:
    """Run ``argv`` (``ip netns add``, ...) in this machine's namespace; its output, or an
    :class:`EmulationError` naming the command."""
    return _run(argv)


def run_in(namespace: str | EmulatedHost, argv: Sequence[str], *, stdin: str | None = None) -> str:
    """Run ``argv`` inside a host's namespace and return its output; an
    :class:`EmulationError` naming the command (and a failed ``tc -batch`` line) if it fails."""
    return _run(netns_command(namespace, argv), stdin=stdin)


def hosts_file_text(plan: NetworkPlan, host: EmulatedHost) -> str:
    """``/etc/hosts`` as the host's processes see it: this machine's hostname is the host's
    own address (gloo and Horovod resolve it), and every emulated host has its name."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{host.address}\t{plan.hostname}"]
    lines += [f"{h.address}\t{h.namespace}" for h in plan.hosts]
    return "\n".join(lines) + "\n"


def shaping_batch(plan: NetworkPlan, host: EmulatedHost, side: str) -> str:
    """``tc -batch`` lines shaping one side of a host's NIC: ``side="host"`` is what the host
    sends (its eth0, classified by destination), ``"switch"`` what it receives (its switch
    port, classified by source)."""
    if plan.nic_mbit is None:
        return ""
    if side == "host":
        dev, match = host.interface, "dst"
    elif side == "switch":
        dev, match = host.switch_port, "src"
    else:
        raise ValueError(f"side: expected 'host' or 'switch', got {side!r}")
    total_kbit = max(1, round((host.nic_mbit or plan.nic_mbit) * 1000))
    peers = [h for h in plan.hosts if h is not host]
    # TCP's ACKs go first, in a class of their own: behind a peer's queue of full-size (GSO)
    # packets they would wait many milliseconds, and the flows in the other direction stall
    ack_kbit = max(1, round(total_kbit * ACK_SHARE))
    share_kbit = max(1, round((total_kbit - ack_kbit) / max(1, len(peers))))
    lines = [f"qdisc add dev {dev} root handle 1: htb",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {total_kbit}kbit "
             f"ceil {total_kbit}kbit quantum {_quantum(total_kbit)}",
             f"class add dev {dev} parent 1:1 classid 1:2 htb rate {ack_kbit}kbit "
             f"ceil {total_kbit}kbit prio 0 quantum {_quantum(ack_kbit)}"]
    # a pure ACK is a TCP packet that carries no data: its IP total length is the 20-byte IP
    # header (the namespaces send no IP options) plus the TCP header, whose length is the data
    # offset, in words, at byte 32. A small packet that carries data must stay in its peer's
    # class: ZeroMQ sends small messages alone (TCP_NODELAY), and one that overtook its own
    # flow's bulk data would reach the receiver out of order and be retransmitted for nothing.
    # A GSO packet over 64 KiB carries total length 0 (IPv4 BIG TCP) and never matches. (Filter
    # priority 1 is left for chaos/faults.py's partitions, which must come before the ACKs.)
    for words in range(5, 16):
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip protocol 6 "
                     f"0xff match u8 0x45 0xff at 0 match u16 0x{20 + 4 * words:04x} 0xffff at 2 "
                     f"match u8 0x{words << 4:02x} 0xf0 at 32 flowid 1:2")
    for index, peer in enumerate(peers):
        classid = f"1:{0x10 + index:x}"
        lines.append(f"class add dev {dev} parent 1:1 classid {classid} htb rate {share_kbit}kbit "
                     f"ceil {total_kbit}kbit prio 1 quantum {_quantum(share_kbit)}")
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio 3 u32 "
                     f"match ip {match} {peer.address}/32 flowid {classid}")
    return "\n".join(lines) + "\n"


def _quantum(rate_kbit: int) -> int:
    # htb's own r2q=10 rule, kept within the range it does not warn about
    return int(min(200_000, max(1514, rate_kbit * 1000 / 8 / 10)))


# --------------------------------------------------------------------------- running commands

def _run(argv: Sequence[str], *, stdin: str | None = None,
         timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise EmulationError(f"`{' '.join(argv)}` did not finish within {timeout_s:g} s") from None
    except FileNotFoundError:
        raise EmulationUnavailable(f"{argv[0]}: not found; network emulation needs iproute2 "
                                   f"(Debian/Ubuntu: apt-get install iproute2)") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        if stdin:
            detail += _failed_batch_line(detail, stdin)
        raise EmulationError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {detail}")
    return done.stdout


def _failed_batch_line(stderr: str, batch: str) -> str:
    m = re.search(r"Command failed -:(\d+)", stderr)
    lines = batch.splitlines()
    if m and 1 <= int(m.group(1)) <= len(lines):
        return f" [batch line: {lines[int(m.group(1)) - 1]}]"
    return ""


def check_prerequisites() -> None:
    """Raise :class:`EmulationUnavailable` unless this process is root and has ip and tc."""
    if os.geteuid() != 0:
        raise EmulationUnavailable(_ROOT_HINT)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationUnavailable(f"{' and '.join(missing)}: not found; network emulation needs "
                                   f"iproute2 (Debian/Ubuntu: apt-get install iproute2)")


def list_namespaces() -> list[str]:
    """Every named network namespace on this machine."""
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# --------------------------------------------------------------------------- create / destroy

@dataclass(frozen=True)
class EmulatedNetwork:
    """A built emulated network: its plan and how long building it took."""

    plan: NetworkPlan
    setup_s: float

    @property
    def cluster_id(self) -> str:
        return self.plan.cluster_id

    @property
    def hosts(self) -> tuple[EmulatedHost, ...]:
        return self.plan.hosts

    def host(self, name: str) -> EmulatedHost:
        return self.plan.host(name)

    def address(self, name: str) -> str:
        return self.plan.host(name).address

    def interface(self, name: str) -> str:
        return self.plan.host(name).interface

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """The argument list that runs ``argv`` on emulated host ``name``."""
        return netns_command(self.plan.host(name), argv)


def create(plan: NetworkPlan) -> EmulatedNetwork:
    """Build the namespaces, bridge, veths, addresses, shaping and hosts files of ``plan``.

    On any failure (or interrupt) what was built is removed before the error propagates.
    """
    check_prerequisites()
    existing = [ns for ns in list_namespaces()
                if ns.startswith(namespace_name(plan.cluster_id, ""))]
    if existing:
        raise EmulationUnavailable(
            f"emulated cluster {plan.cluster_id} already exists "
            f"(namespaces: {', '.join(existing)}); tear it down first (bpsctl down), or "
            f"remove leftovers of a crashed run with remove_leftovers()")
    started = time.monotonic()
    try:
        _build(plan)
        for host in plan.hosts:
            if host.cpu_factor is not None:
                _limit_cpu(cpu_cgroup(plan.cluster_id, host.name), host.cpu_factor)
    except BaseException:
        with _signals_deferred():
            with contextlib.suppress(EmulationError):
                _remove_cluster(plan.cluster_id)
        raise
    return EmulatedNetwork(plan=plan, setup_s=time.monotonic() - started)


_OWNER_FILE = "owner"       # in the switch's /etc/netns dir: "PID START_TIME" of the builder


def _build(plan: NetworkPlan) -> None:
    sw = plan.switch_namespace
    # who is building it, so that another `bpsctl down` does not take a network whose
    # processes have not started yet for a crashed run's leftovers (see owner_alive)
    owner = NETNS_ETC / sw
    owner.mkdir(parents=True, exist_ok=True)
    (owner / _OWNER_FILE).write_text(f"{os.getpid()} {psutil.Process().create_time()}")
    _run(["ip", "netns", "add", sw])
    _run(["ip", "-n", sw, "link", "set", "lo", "up"])
    _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
    prefix = SUBNET.prefixlen
    for h in plan.hosts:
        # the hosts file must exist before anything runs in the namespace
        etc = NETNS_ETC / h.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file_text(plan, h))
        _run(["ip", "netns", "add", h.namespace])
        # both ends created straight in their namespaces: nothing appears in this machine's
        _run(["ip", "-n", sw, "link", "add", h.switch_port, "type", "veth",
              "peer", "name", h.interface, "netns", h.namespace])
        _run(["ip", "-n", sw, "link", "set", h.switch_port, "master", BRIDGE, "up"])
        # no IPv6 link-local address: all traffic is IPv4 and goes through the shaped classes
        _run(["ip", "-n", h.namespace, "link", "set", h.interface, "addrgenmode", "none"])
        _run(["ip", "-n", h.namespace, "addr", "add", f"{h.address}/{prefix}", "dev", h.interface])
        _run(["ip", "-n", h.namespace, "link", "set", h.interface, "up"])
        _run(["ip", "-n", h.namespace, "link", "set", "lo", "up"])
    _set_gso(sw, [BRIDGE] + [h.switch_port for h in plan.hosts])
    for h in plan.hosts:
        _set_gso(h.namespace, [h.interface])
        _cap_tcp_backoff(h.namespace)
    if plan.nic_mbit is not None and len(plan.hosts) > 1:
        for h in plan.hosts:
            _run(["tc", "-n", h.namespace, "-batch", "-"], stdin=shaping_batch(plan, h, "host"))
            _run(["tc", "-n", sw, "-batch", "-"], stdin=shaping_batch(plan, h, "switch"))


# netlink constants (linux/rtnetlink.h, linux/if_link.h); the two IPv4 sizes are Linux 6.3+
_CLONE_NEWNET = 0x40000000
_RTM_NEWLINK = 16
_NLM_F_REQUEST_ACK = 0x1 | 0x4
_NLMSG_ERROR = 2
_IFLA_GSO_IPV4_MAX_SIZE = 63
_IFLA_GRO_IPV4_MAX_SIZE = 64
# success (0), or a kernel without BIG TCP: its default size stays and the network works
_GSO_OK_ANSWERS = (0, errno.EINVAL, errno.ERANGE, errno.EOPNOTSUPP)


def _set_gso(namespace: str, devices: Sequence[str], size: int = GSO_BYTES) -> None:
    """Let TCP hand ``size``-byte segments to ``devices`` of ``namespace`` (IPv4 BIG TCP).

    A veth passes a segment through whole and never splits it into packets, so the size sets
    how many times per byte the kernel runs the stack, the bridge and both htb qdiscs; and
    on one machine every emulated host's kernel work is paid by the same few cores. Larger
    segments cost fewer core-seconds per byte (docs/benchmarks.md), which is closer to a real
    host, whose NIC segments in hardware. The wire's MTU stays 1500 and htb counts every byte,
    so rates are unchanged.

    iproute2 before 6.3 cannot set these sizes, so this speaks netlink itself, from a thread
    that enters the namespace. A kernel without BIG TCP rejects or ignores the sizes: the
    network then works as before, only at a higher CPU cost per byte.
    """
    def configure() -> None:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
            nl.settimeout(COMMAND_TIMEOUT_S)
            for seq, device in enumerate(devices, 1):
                body = struct.pack("BxHiII", socket.AF_UNSPEC, 0,
                                   socket.if_nametoindex(device), 0, 0)
                for attribute in (_IFLA_GSO_IPV4_MAX_SIZE, _IFLA_GRO_IPV4_MAX_SIZE):
                    body += struct.pack("HHI", 8, attribute, size)
                nl.send(struct.pack("IHHII", 16 + len(body), _RTM_NEWLINK,
                                    _NLM_F_REQUEST_ACK, seq, 0) + body)
                reply = nl.recv(4096)
                kind, = struct.unpack_from("H", reply, 4)
                code = -struct.unpack_from("i", reply, 16)[0]      # 0: done
                if kind == _NLMSG_ERROR and code not in _GSO_OK_ANSWERS:
                    raise OSError(code, f"{device}: gso_ipv4_max_size {size}: "
                                        f"{os.strerror(code)}")

    _in_namespace(namespace, "setting the segment size", configure)


#: the longest TCP waits between retransmissions in an emulated host (Linux 6.15+;
#: net.ipv4.tcp_rto_max_ms, 120 s by default). After a cut of c seconds a connection's next
#: retransmission comes up to about c later (the wait doubles: 0.2, 0.4, ... 3.2 s), so a cut
#: shorter than the heartbeat timeout still silenced it past the timeout, and a machine that
#: was only cut off briefly was declared lost. With the cap, a cut that heals is crossed again
#: within 1 s, as in a datacenter tuned for failover; docs/chaos.md says how to set it on
#: real hosts.
TCP_RTO_MAX_MS = 1000
TCP_RTO_MAX_SYSCTL = Path("/proc/sys/net/ipv4/tcp_rto_max_ms")


def tcp_rto_max_capped() -> bool:
    """Whether this kernel lets an emulated host cap TCP's retransmission backoff."""
    return TCP_RTO_MAX_SYSCTL.exists()


def _cap_tcp_backoff(namespace: str) -> None:
    """Set ``TCP_RTO_MAX_MS`` in ``namespace`` (a per-namespace sysctl); on an older kernel,
    which has no such setting, nothing."""
    if not tcp_rto_max_capped():
        return

    def configure() -> None:
        # /proc/sys/net is the namespace of the thread that opens it: this thread's
        TCP_RTO_MAX_SYSCTL.write_text(str(TCP_RTO_MAX_MS))

    _in_namespace(namespace, "capping TCP's retransmission backoff", configure)


def _in_namespace(namespace: str, what: str, configure: Callable[[], None]) -> None:
    """Run ``configure`` in a thread that has entered ``namespace``'s network (setns moves the
    calling thread only, so this process stays where it is); its error, as EmulationError."""
    failure: list[BaseException] = []

    def enter_and_configure() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{namespace}") as ns:
                if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:    # this thread only
                    raise OSError(ctypes.get_errno(), f"setns into {namespace}")
            configure()
        except BaseException as exc:       # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=enter_and_configure, name=f"netns-{namespace}",
                              daemon=True)
    worker.start()
    worker.join(COMMAND_TIMEOUT_S)
    if worker.is_alive():
        raise EmulationError(f"{what} in {namespace} did not finish within "
                             f"{COMMAND_TIMEOUT_S:g} s")
    if failure:
        raise EmulationError(f"{what} in {namespace} failed: {failure[0]}") from failure[0]


def destroy(network: EmulatedNetwork | NetworkPlan | str, *, stop_processes: bool = True) -> None:
    """Remove every namespace and hosts file of the cluster (a network, plan or cluster id).

    Processes still running inside its namespaces are killed first when ``stop_processes``
    (otherwise they keep the namespace's interfaces alive after its name is gone). Always
    tries every step; raises :class:`EmulationError` naming what could not be removed.
    """
    if isinstance(network, EmulatedNetwork):
        cluster_id = network.cluster_id
    elif isinstance(network, NetworkPlan):
        cluster_id = network.cluster_id
    else:
        cluster_id = network
    with _signals_deferred():
        _remove_cluster(cluster_id, stop_processes=stop_processes)


def _remove_cluster(cluster_id: str, *, stop_processes: bool = True) -> None:
    if not _CLUSTER_ID_RE.match(cluster_id):
        raise ConfigError(f"emulated cluster id: expected 1-12 lowercase letters or digits, "
                          f"got {cluster_id!r}")
    prefix = namespace_name(cluster_id, "")
    switch = namespace_name(cluster_id, SWITCH_HOST)
    names = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    # hosts before the switch: deleting a host namespace deletes its veth pair
    names.sort(key=lambda ns: ns == switch)
    failures = []
    if stop_processes:
        for ns in names:
            with contextlib.suppress(EmulationError):
                _kill_namespace_processes(ns)
    # another process (`bpsctl down`'s sweep of abandoned clusters) may remove the same
    # cluster meanwhile: what is gone already is not a failure
    for ns in names:
        try:
            _run(["ip", "netns", "del", ns])
        except EmulationError as exc:
            if (NETNS_RUN / ns).exists():
                failures.append(str(exc))
    failures += _remove_cpu_cgroups(cluster_id)
    if NETNS_ETC.is_dir():
        for etc in NETNS_ETC.iterdir():
            if etc.name.startswith(prefix):
                try:
                    shutil.rmtree(etc)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failures.append(f"{etc}: {exc}")
    if failures:
        raise EmulationError(f"could not fully remove emulated cluster {cluster_id}: "
                             + "; ".join(failures))


# --------------------------------------------------------------------------- CPU limits

def _cpu_hierarchy() -> tuple[Path, bool]:
    """Where CPU-limited cgroups go and whether that is cgroup v2 (``cpu.max``); else v1's
    cpu controller (``cpu.cfs_quota_us``). EmulationUnavailable when neither is writable."""
    if (CGROUP_ROOT / "cgroup.controllers").is_file():
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        if "cpu" in controllers and os.access(CGROUP_ROOT, os.W_OK):
            return CGROUP_ROOT, True
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").is_file() and os.access(v1, os.W_OK):
        return v1, False
    raise EmulationUnavailable(
        f"--straggler RANK:cpu=FACTOR needs a writable cgroup cpu controller: {CGROUP_ROOT} "
        "is neither cgroup v2 with the cpu controller nor has v1's cpu hierarchy (run as root "
        "on a machine that delegates cgroups, or drop the cpu= form)")


def cpu_cgroup(cluster_id: str, host: str) -> Path:
    """The cgroup that limits emulated host ``host``'s worker processes' CPU."""
    base, _ = _cpu_hierarchy()
    return base / f"{NAMESPACE_PREFIX}{cluster_id}-{host}"


def _limit_cpu(cgroup: Path, factor: float) -> None:
    base, v2 = _cpu_hierarchy()
    quota = max(1000, round(factor * CPU_PERIOD_US))
    try:
        if v2:
            subtree = base / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                subtree.write_text("+cpu")
        cgroup.mkdir(exist_ok=True)
        if v2:
            (cgroup / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        else:
            (cgroup / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (cgroup / "cpu.cfs_quota_us").write_text(str(quota))
    except OSError as exc:
        raise EmulationError(f"cannot limit {cgroup} to {factor:g} CPU: {exc}") from None


def cgroup_command(cgroup: str | Path) -> list[str]:
    """The prefix that runs a command inside ``cgroup`` (it joins, then execs the command)."""
    return [sys.executable, "-m", "bpsctl.launch.cgexec", str(Path(cgroup) / "cgroup.procs"),
            "--"]


def _remove_cpu_cgroups(cluster_id: str) -> list[str]:
    """Remove the cluster's CPU cgroups (their processes were stopped); the failures."""
    try:
        base, _ = _cpu_hierarchy()
    except EmulationUnavailable:
        return []
    failures = []
    for cgroup in base.glob(f"{NAMESPACE_PREFIX}{cluster_id}-*"):
        deadline = time.monotonic() + 5      # killed processes leave their cgroup as they exit
        while True:
            try:
                cgroup.rmdir()
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    failures.append(f"{cgroup}: {exc}")
                    break
                for pid in (cgroup / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.05)
    return failures


def namespace_pids(namespace: str) -> list[int]:
    """Processes running inside a namespace (none once it is gone: another process may remove
    a cluster while this one looks at it)."""
    if not (NETNS_RUN / namespace).exists():
        return []
    try:
        return [int(p) for p in _run(["ip", "netns", "pids", namespace]).split() if p.isdigit()]
    except EmulationError:
        if (NETNS_RUN / namespace).exists():
            raise
        return []                       # removed between the check and `ip netns pids`


def _kill_namespace_processes(namespace: str) -> None:
    for pid in namespace_pids(namespace):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def emulated_network(plan: NetworkPlan) -> Iterator[EmulatedNetwork]:
    """Build ``plan``'s network for the duration of the block; it is removed on the way out,
    whatever happens in the block (exceptions, KeyboardInterrupt)."""
    network = create(plan)
    try:
        yield network
    finally:
        destroy(network)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold off SIGINT/SIGTERM while tearing down, so a second Ctrl-C cannot leave half a
    network behind; a signal that arrived meanwhile is delivered afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda s, _frame: received.append(s))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for pending in received[:1]:
            os.kill(os.getpid(), pending)


# --------------------------------------------------------------------------- leftovers

@dataclass(frozen=True)
class Leftover:
    """An emulated cluster's namespaces and hosts files still on this machine."""

    cluster_id: str
    namespaces: tuple[str, ...]
    netns_dirs: tuple[str, ...]


def find_leftovers(cluster_ids: Sequence[str] | None = None) -> list[Leftover]:
    """Emulated clusters whose namespaces (or /etc/netns entries) exist on this machine,
    all of them or those of ``cluster_ids``. A running cluster is listed as well: the caller
    knows which cluster ids it still uses."""
    check_prerequisites()
    found: dict[str, tuple[list[str], list[str]]] = {}
    for ns in list_namespaces():
        m = _NAMESPACE_RE.match(ns)
        if m:
            found.setdefault(m.group(1), ([], []))[0].append(ns)
    if NETNS_ETC.is_dir():
        for etc in NETNS_ETC.iterdir():
            m = _NAMESPACE_RE.match(etc.name)
            if m:
                found.setdefault(m.group(1), ([], []))[1].append(str(etc))
    return [Leftover(cluster_id=cid, namespaces=tuple(sorted(ns)), netns_dirs=tuple(sorted(dirs)))
            for cid, (ns, dirs) in sorted(found.items())
            if cluster_ids is None or cid in cluster_ids]


def owner_alive(cluster_id: str) -> bool:
    """True while the process that built ``cluster_id``'s network still runs (it may be
    about to start the cluster's processes, or be a test or tool that holds the network)."""
    try:
        owner = NETNS_ETC / namespace_name(cluster_id, SWITCH_HOST) / _OWNER_FILE
        pid, started = owner.read_text().split()
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 0.01
    except (OSError, ValueError, psutil.Error):
        return False


def remove_leftovers(cluster_ids: Sequence[str] | None = None) -> list[Leftover]:
    """Remove what :func:`find_leftovers` finds (processes inside them are killed); returns
    what was removed."""
    leftovers = find_leftovers(cluster_ids)
    failures = []
    for leftover in leftovers:
        try:
            destroy(leftover.cluster_id)
        except EmulationError as exc:
            failures.append(str(exc))
    if failures:
        raise EmulationError("; ".join(failures))
    return leftovers


__all__ = ["EmulatedHost", "EmulatedNetwork", "EmulationError", "EmulationUnavailable",
           "Leftover", "NetworkPlan", "check_prerequisites", "create", "destroy",
           "emulated_network", "find_leftovers", "cgroup_command", "cpu_cgroup",
           "hosts_file_text", "namespace_name",
           "netns_command", "new_cluster_id", "plan_network", "remove_leftovers",
           "shaping_batch"]
