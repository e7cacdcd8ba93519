"""The emulated cluster network: the plan as a pure function, and (as root) the namespaces,
their reachability, teardown, leftovers, and the shaped NICs measured with real TCP traffic."""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from bpsctl.config import ConfigError, parse_stragglers
from bpsctl.launch import emulate

IS_ROOT = os.geteuid() == 0

#: TCP goodput through a shaped NIC, as a fraction of the configured rate (docs/benchmarks.md)
GOODPUT_FRACTION = 0.957

# One script for every namespace: it listens on its address and counts what each peer sends
# in the measurement window; it sends to the peers named by --send-to as fast as TCP lets it.
# With --echo it only answers one message per connection and reports which peers it reached.
TRAFFIC_SCRIPT = textwrap.dedent('''
    import argparse, json, socket, sys, threading, time

    p = argparse.ArgumentParser()
    p.add_argument("--me"); p.add_argument("--port", type=int)
    p.add_argument("--peers", default=""); p.add_argument("--send-to", default="")
    p.add_argument("--start-at", type=float); p.add_argument("--warmup-s", type=float)
    p.add_argument("--duration-s", type=float); p.add_argument("--echo", action="store_true")
    a = p.parse_args()
    peers = [x for x in a.peers.split(",") if x]
    send_to = [x for x in a.send_to.split(",") if x]
    window_start = a.start_at + a.warmup_s
    stop_at = window_start + a.duration_s
    received = {}
    lock = threading.Lock()

    listener = socket.create_server((a.me, a.port), backlog=64)
    listener.settimeout(0.1)

    def serve(conn, peer):
        conn.settimeout(0.5)
        buf = bytearray(1 << 20)
        with conn:
            while time.time() < stop_at + 0.5:
                try:
                    n = conn.recv_into(buf)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not n:
                    return
                if a.echo:
                    conn.sendall(buf[:n]); return
                with lock:
                    received[peer] = received.get(peer, 0) + n

    def accept():
        while time.time() < stop_at + 0.5:
            try:
                conn, (peer, _) = listener.accept()
            except socket.timeout:
                continue
            threading.Thread(target=serve, args=(conn, peer), daemon=True).start()

    def connect(peer):
        while True:
            try:
                s = socket.create_connection((peer, a.port), timeout=1.0)
                s.settimeout(10.0)      # a blocked send is shaping at work, not a failure
                return s
            except OSError:
                if time.time() > a.start_at + 5:
                    raise
                time.sleep(0.05)

    reached = []
    def send(peer):
        s = connect(peer)
        payload = bytes(256 << 10) if not a.echo else b"ping"
        with s:
            if a.echo:
                s.sendall(payload)
                if s.recv(4) == b"ping":
                    reached.append(peer)
                return
            try:
                while time.time() < stop_at + 0.2:
                    s.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass        # the receiver finished first: after the window, so harmless

    threading.Thread(target=accept, daemon=True).start()
    time.sleep(max(0.0, a.start_at - time.time()))
    senders = [threading.Thread(target=send, args=(peer,), daemon=True) for peer in send_to]
    for t in senders:
        t.start()
    time.sleep(max(0.0, window_start - time.time()))
    with lock:
        before = dict(received)
    time.sleep(max(0.0, stop_at - time.time()))
    with lock:
        after = dict(received)
    for t in senders:
        t.join(timeout=5)
    window = {peer: after.get(peer, 0) - before.get(peer, 0) for peer in after}
    print(json.dumps({"received": window, "reached": sorted(reached)}))
''')


def run_everywhere(network, script, plan_of_sends, *, warmup_s, duration_s, echo=False,
                   port=5201):
    """Start the script on every host at once; returns {host name: its JSON report}."""
    start_at = time.time() + 0.8      # interpreters up and listening before anyone sends
    procs = {}
    try:
        for host in network.hosts:
            peers = [h.address for h in network.hosts if h is not host]
            send_to = [network.address(name) for name in plan_of_sends.get(host.name, [])]
            argv = [sys.executable, str(script), "--me", host.address, "--port", str(port),
                    "--peers", ",".join(peers), "--send-to", ",".join(send_to),
                    "--start-at", repr(start_at), "--warmup-s", str(warmup_s),
                    "--duration-s", str(duration_s)] + (["--echo"] if echo else [])
            procs[host.name] = subprocess.Popen(network.command(host.name, argv),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True)
        reports = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=warmup_s + duration_s + 15)
            assert proc.returncode == 0, f"{name}: traffic script failed: {err}"
            reports[name] = json.loads(out)
        return reports
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def rates_mbit(network, reports, duration_s):
    """Per host: (sent, received) Mbit/s in the window, from what the receivers counted."""
    by_address = {h.address: h.name for h in network.hosts}
    sent = {h.name: 0 for h in network.hosts}
    received = {h.name: 0 for h in network.hosts}
    for receiver, report in reports.items():
        for source, nbytes in report["received"].items():
            sent[by_address[source]] += nbytes
            received[receiver] += nbytes
    to_mbit = 8 / duration_s / 1e6
    return {name: (sent[name] * to_mbit, received[name] * to_mbit) for name in sent}


def our_namespaces(cluster_id):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=10, check=True).stdout
    return [line.split()[0] for line in listed.splitlines()
            if line.startswith(emulate.namespace_name(cluster_id, ""))]


@pytest.fixture
def cluster_id():
    # unique per test so concurrent runs on one machine never touch each other's namespaces
    cid = "t" + uuid.uuid4().hex[:8]
    yield cid
    if IS_ROOT:     # whatever the test left behind
        emulate.remove_leftovers([cid])


# --------------------------------------------------------------------------- pure plan

def test_plan_names_addresses_ranks():
    plan = emulate.plan_network(3, 2, "500mbit", cluster_id="abc123", hostname="box")
    assert [h.name for h in plan.hosts] == ["w0", "w1", "w2", "s0", "s1"]
    assert [(h.role, h.rank) for h in plan.hosts] == [
        ("worker", 0), ("worker", 1), ("worker", 2), ("server", 0), ("server", 1)]
    assert [h.namespace for h in plan.hosts] == [
        "bps-abc123-w0", "bps-abc123-w1", "bps-abc123-w2", "bps-abc123-s0", "bps-abc123-s1"]
    assert plan.switch_namespace == "bps-abc123-sw"
    assert plan.namespaces[-1] == "bps-abc123-sw"
    assert [h.address for h in plan.workers] == ["10.77.0.10", "10.77.0.11", "10.77.0.12"]
    assert [h.address for h in plan.servers] == ["10.77.0.130", "10.77.0.131"]
    assert plan.scheduler_host.name == "s0"
    assert {h.interface for h in plan.hosts} == {"eth0"}
    assert plan.nic_mbit == 500.0 and plan.per_peer_mbit() == pytest.approx(125.0)
    # a pure function: same inputs, same plan; a server's address does not move with N
    assert plan == emulate.plan_network(3, 2, "500mbit", cluster_id="abc123", hostname="box")
    assert emulate.plan_network(7, 2, None, cluster_id="abc123").host("s1").address == "10.77.0.131"
    assert plan.host("10.77.0.11").name == "w1" and plan.host("bps-abc123-s1").name == "s1"
    assert emulate.netns_command(plan.host("w1"), ["python", "-V"]) == [
        "ip", "netns", "exec", "bps-abc123-w1", "python", "-V"]
    hosts = emulate.hosts_file_text(plan, plan.host("w1"))
    assert "10.77.0.11\tbox" in hosts.splitlines() and "10.77.0.10\tbox" not in hosts
    assert emulate.plan_network(2, 0, "1gbit", cluster_id="x").scheduler_host.name == "w0"


def test_plan_shaping_one_class_per_peer():
    plan = emulate.plan_network(2, 1, "300mbit", cluster_id="abc", hostname="box")
    host_side = emulate.shaping_batch(plan, plan.host("w0"), "host")
    switch_side = emulate.shaping_batch(plan, plan.host("w0"), "switch")
    assert "dev eth0" in host_side and "dev w0" in switch_side
    assert host_side.count("match ip dst") == 2 and switch_side.count("match ip src") == 2
    # the ACK class: TCP packets whose IP total length is 20 + the TCP header (data offset
    # 5-15 words), i.e. without data; not 0 (a BIG TCP segment)
    assert host_side.count("match ip protocol 6") == 11
    assert "match u16 0x0034 0xffff at 2 match u8 0x80 0xf0 at 32 flowid 1:2" in host_side
    assert "match u16 0x0028 0xffff at 2 match u8 0x50 0xf0 at 32 flowid 1:2" in host_side
    assert "match ip dst 10.77.0.11/32" in host_side
    assert "match ip src 10.77.0.130/32" in switch_side
    # each peer R/(P-1) ceil R, after the 2% that TCP's ACKs get first
    assert host_side.count("rate 147000kbit ceil 300000kbit prio 1") == 2
    assert "rate 6000kbit ceil 300000kbit prio 0" in host_side
    assert "classid 1:1 htb rate 300000kbit ceil 300000kbit" in host_side
    assert emulate.shaping_batch(emulate.plan_network(2, 1, None, cluster_id="a"),
                                 plan.host("w0"), "host") == ""


def test_a_straggler_host_gets_its_factor_of_the_nic_both_ways():
    plan = emulate.plan_network(3, 1, "400mbit", cluster_id="abc", slow={1: 0.25})
    slow, normal = plan.host("w1"), plan.host("w0")
    for side in ("host", "switch"):
        assert "classid 1:1 htb rate 100000kbit ceil 100000kbit" in \
            emulate.shaping_batch(plan, slow, side)
        assert "classid 1:1 htb rate 400000kbit ceil 400000kbit" in \
            emulate.shaping_batch(plan, normal, side)


@pytest.mark.parametrize("slow, nic, message", [
    ({1: 0.5}, None, "give --nic as well"), ({3: 0.5}, "1gbit", "worker 3 does not exist")])
def test_a_straggler_needs_a_nic_rate_and_an_existing_worker(slow, nic, message):
    with pytest.raises(ConfigError, match=message):
        emulate.plan_network(3, 1, nic, cluster_id="abc", slow=slow)


@pytest.mark.parametrize("text", ["1", "1:0", "1:1.5", "a:0.5", "1:0.5,1:0.25", "-1:0.5",
                                  "1:cpu=0", "1:cpu=half"])
def test_a_straggler_flag_that_is_not_rank_colon_factor_is_refused(text):
    with pytest.raises(ConfigError, match="--straggler"):
        parse_stragglers(text)


@pytest.mark.parametrize("args, flag", [
    ((0, 1, None), "--workers"), ((1, -1, None), "--servers"), ((2, 1, "fast"), "--nic"),
    ((2, 1, -5), "--nic"), ((True, 1, None), "--workers")])
def test_plan_rejects_bad_sizes(args, flag):
    with pytest.raises(ConfigError, match=flag):
        emulate.plan_network(*args, cluster_id="abc")


def test_plan_rejects_bad_cluster_id():
    with pytest.raises(ConfigError, match="cluster id"):
        emulate.plan_network(1, 1, cluster_id="Bad-Id!")


def test_not_root_is_a_config_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    with pytest.raises(emulate.EmulationUnavailable, match="needs root") as info:
        emulate.create(emulate.plan_network(1, 1, cluster_id="abc"))
    assert isinstance(info.value, ConfigError)      # the CLI's exit 2
    assert "--emulate" in str(info.value) and "sudo" in str(info.value)


def test_missing_iproute2_names_the_package(monkeypatch):
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 0)
    monkeypatch.setattr(emulate.shutil, "which", lambda tool: None)
    with pytest.raises(emulate.EmulationUnavailable, match="iproute2"):
        emulate.check_prerequisites()


@pytest.mark.timeout(20)
def test_command_errors_carry_command_and_stderr():
    if emulate.shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed")
    with pytest.raises(emulate.EmulationError) as info:
        emulate._run(["ip", "link", "show", "dev", "bps-no-such-dev"])
    assert "ip link show dev bps-no-such-dev" in str(info.value)
    assert "bps-no-such-dev" in str(info.value).split("failed", 1)[1]     # ip's own stderr


# --------------------------------------------------------------------------- as root

@pytest.mark.timeout(30)
def test_create_reach_destroy(cluster_id, tmp_path):
    script = tmp_path / "traffic.py"
    script.write_text(TRAFFIC_SCRIPT)
    plan = emulate.plan_network(2, 2, "500mbit", cluster_id=cluster_id)
    with emulate.emulated_network(plan) as network:
        assert sorted(our_namespaces(cluster_id)) == sorted(plan.namespaces)
        # a second cluster with the same id is refused, and does not harm the first
        with pytest.raises(emulate.EmulationUnavailable, match="already exists"):
            emulate.create(plan)
        assert sorted(our_namespaces(cluster_id)) == sorted(plan.namespaces)
        # every host reaches every other host over TCP
        everyone = {h.name: [p.name for p in plan.hosts if p is not h] for h in plan.hosts}
        reports = run_everywhere(network, script, everyone, warmup_s=0, duration_s=1.5, echo=True)
        for h in plan.hosts:
            expected = sorted(p.address for p in plan.hosts if p is not h)
            assert reports[h.name]["reached"] == expected, f"{h.name} did not reach all peers"
        # this machine's hostname is the host's own address inside its namespace (gloo needs it)
        lookup = "import socket; print(socket.gethostbyname(socket.gethostname()))"
        resolved = subprocess.run(
            network.command("s1", [sys.executable, "-c", lookup]),
            capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        assert resolved == network.address("s1")
        # nothing of the emulated network shows up in this machine's own namespace
        own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        assert "10.77.0." not in own
    assert our_namespaces(cluster_id) == []
    assert not any((emulate.NETNS_ETC / ns).exists() for ns in plan.namespaces)


@pytest.mark.timeout(30)
def test_teardown_on_keyboard_interrupt(cluster_id):
    plan = emulate.plan_network(1, 1, "100mbit", cluster_id=cluster_id)
    with pytest.raises(KeyboardInterrupt):
        with emulate.emulated_network(plan):
            raise KeyboardInterrupt
    assert our_namespaces(cluster_id) == []


@pytest.mark.timeout(30)
def test_leftovers_of_a_crashed_run_are_found_and_removed(cluster_id):
    plan = emulate.plan_network(2, 1, "100mbit", cluster_id=cluster_id)
    network = emulate.create(plan)     # and never destroyed: a crashed run
    # a process still running inside is no obstacle (and does not survive the removal)
    sleeper = subprocess.Popen(network.command("w0", ["sleep", "60"]))
    try:
        found = emulate.find_leftovers([cluster_id])
        assert [f.cluster_id for f in found] == [cluster_id]
        assert sorted(found[0].namespaces) == sorted(plan.namespaces)
        assert len(found[0].netns_dirs) == len(plan.hosts) + 1     # + the switch's owner record
        assert cluster_id in [f.cluster_id for f in emulate.find_leftovers()]
        removed = emulate.remove_leftovers([cluster_id])
        assert [r.cluster_id for r in removed] == [cluster_id]
        assert sleeper.wait(timeout=5) != 0
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    assert our_namespaces(cluster_id) == []
    assert emulate.find_leftovers([cluster_id]) == []
    assert not any((emulate.NETNS_ETC / ns).exists() for ns in plan.namespaces)


def best_of(tries, measure, level):
    """Run ``measure()`` up to ``tries`` times, stopping at the first result whose ``level()`` is
    within 10% of the goal (>= 0.9); returns every result, best level last.

    A shaped NIC caps and shares; how close a flow comes to the cap also depends on the
    machine. On a shared 2-core VM the whole machine is sometimes descheduled for a fraction of
    a second (CI once saw all four hosts at 76% of the goodput in one 2-s window, still fair),
    so a level check takes the best of a few windows, while the shape checks hold for each."""
    results = []
    for _ in range(tries):
        results.append(measure())
        if level(results[-1]) >= 0.9:
            break
    return sorted(results, key=level)


@pytest.mark.timeout(90)
def test_shaped_nics_full_duplex_fair_and_capped(cluster_id, tmp_path):
    """The emulator itself: all-to-all traffic gets every host R in and R out (TCP goodput,
    ~95.7% of R), and one flow alone still gets all of R (the per-peer classes borrow)."""
    script = tmp_path / "traffic.py"
    script.write_text(TRAFFIC_SCRIPT)
    nic_mbit = 200.0
    expected = GOODPUT_FRACTION * nic_mbit
    duration_s = 2.0
    plan = emulate.plan_network(2, 2, f"{nic_mbit:g}mbit", cluster_id=cluster_id)
    ports = iter(range(5201, 5220))
    with emulate.emulated_network(plan) as network:
        everyone = {h.name: [p.name for p in plan.hosts if p is not h] for h in plan.hosts}

        def all_to_all():
            reports = run_everywhere(network, script, everyone, warmup_s=0.7,
                                     duration_s=duration_s, port=next(ports))
            return reports, rates_mbit(network, reports, duration_s)

        def mean_level(result):
            _, rates = result
            return sum(sent for sent, _ in rates.values()) / len(rates) / expected

        tries = best_of(3, all_to_all, mean_level)
        print(f"\nall-to-all at R = {nic_mbit:g} Mbit/s (goodput limit {expected:.0f}):")
        for n, (_reports, rates) in enumerate(tries, 1):
            print(f" window {n} of {len(tries)}:")
            for name, (sent, received) in rates.items():
                print(f"  {name}: sent {sent:.1f} Mbit/s, received {received:.1f} Mbit/s")
        for reports, rates in tries:
            # capped, full duplex and fair in every window: each host sends and receives as
            # much as the others, and every pair's flow gets a third of what its receiver got
            mean = mean_level((reports, rates)) * expected
            for name, (sent, received) in rates.items():
                assert sent <= 1.10 * expected, f"{name} sent {sent:.1f} Mbit/s, over the cap"
                assert received <= 1.10 * expected, f"{name} got {received:.1f}, over the cap"
                assert sent == pytest.approx(mean, rel=0.10), f"{name} sent {sent:.1f} Mbit/s"
                assert received == pytest.approx(mean, rel=0.10), f"{name} got {received:.1f}"
            for receiver, report in reports.items():
                for source, nbytes in report["received"].items():
                    pair = nbytes * 8 / duration_s / 1e6
                    assert pair == pytest.approx(mean / 3, rel=0.25), \
                        f"{source} -> {receiver}: {pair:.1f} Mbit/s"
        # and in the best window every host gets R in and R out
        assert mean_level(tries[-1]) == pytest.approx(1.0, abs=0.10)

        # one flow alone borrows far beyond its per-peer share (R/3) up to the ceil R. A lone
        # TCP flow is at the mercy of a busy 2-core machine's scheduling (seen: 135-191 Mbit/s
        # at R = 200), so this check asks for 3/4 of the goodput: without borrowing it would
        # get a third.
        def one_flow():
            reports = run_everywhere(network, script, {"w0": ["s0"]}, warmup_s=0.7,
                                     duration_s=1.5, port=next(ports))
            return rates_mbit(network, reports, 1.5)["w0"][0]

        tries = best_of(3, one_flow, lambda mbit: mbit / expected)
        print("one flow w0 -> s0: " + ", ".join(f"{mbit:.1f}" for mbit in tries) + " Mbit/s")
        assert all(mbit <= 1.10 * expected for mbit in tries)
        assert tries[-1] >= 0.75 * expected

        # incast: three senders into one receiver share its R evenly
        def incast():
            reports = run_everywhere(network, script,
                                     {"w0": ["s0"], "w1": ["s0"], "s1": ["s0"]},
                                     warmup_s=0.5, duration_s=1.5, port=next(ports))
            return {source: nbytes * 8 / 1.5 / 1e6
                    for source, nbytes in reports["s0"]["received"].items()}

        tries = best_of(3, incast, lambda flows: sum(flows.values()) / expected)
        for flows in tries:
            print("incast into s0: " + ", ".join(f"{mbit:.1f}" for mbit in flows.values())
                  + " Mbit/s")
            total = sum(flows.values())
            assert total <= 1.10 * expected
            for source, mbit in flows.items():
                assert mbit == pytest.approx(total / 3, rel=0.15), f"{source} -> s0: {mbit:.1f}"
        assert sum(tries[-1].values()) == pytest.approx(expected, rel=0.10)


PING_PONG_SCRIPT = textwrap.dedent('''
    import socket, sys
    role, address, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "serve":
        listener = socket.create_server((address, 5301))
        listener.settimeout(20)
        print("ready", flush=True)
        conn, _ = listener.accept()
        conn.settimeout(20)
        for _ in range(count):
            got = b""
            while len(got) < 50:
                chunk = conn.recv(50 - len(got))
                if not chunk:
                    sys.exit("the client closed the connection early")
                got += chunk
            conn.sendall(b"k")
    else:
        conn = socket.create_connection((address, 5301), timeout=20)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            conn.sendall(b"m" * 50)
            assert conn.recv(1) == b"k"
        print("done", flush=True)
''')


@pytest.mark.timeout(60)
def test_small_data_packets_stay_in_their_peers_class_and_only_pure_acks_go_first(
        cluster_id, tmp_path):
    """Small messages sent alone (TCP_NODELAY, as ZeroMQ sends them) travel in their peer's
    class, behind their flow's earlier data: were they taken for ACKs and sent first, they would
    overtake it and reach the receiver out of order, and TCP would retransmit for nothing."""
    script = tmp_path / "ping_pong.py"
    script.write_text(PING_PONG_SCRIPT)
    count = 200
    plan = emulate.plan_network(1, 1, "100mbit", cluster_id=cluster_id)
    with emulate.emulated_network(plan) as network:
        server = subprocess.Popen(
            network.command("s0", [sys.executable, str(script), "serve",
                                   network.address("s0"), str(count)]),
            stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            client = subprocess.run(
                network.command("w0", [sys.executable, str(script), "ping",
                                       network.address("s0"), str(count)]),
                capture_output=True, text=True, timeout=30)
            assert client.stdout.strip() == "done", client.stderr
            server.wait(timeout=20)
        finally:
            server.kill()
            server.wait(timeout=10)
        shown = subprocess.run(
            network.command("w0", ["tc", "-s", "class", "show", "dev", "eth0"]),
            capture_output=True, text=True, timeout=10, check=True).stdout
    # "class htb 1:10 parent 1:1 ... \n Sent 5200 bytes 100 pkt ..." (tc has no JSON for htb)
    packets = {handle: int(sent) for handle, sent in re.findall(
        r"^class htb (\S+) .*\n\s*Sent \d+ bytes (\d+) pkt", shown, re.MULTILINE)}
    print(f"\nw0's classes after {count} pings of 50 bytes: {packets}")
    # 1:10 is w0's class for its one peer, s0: every ping went there, none ahead as an ACK
    assert packets["1:10"] >= count
    assert packets["1:2"] < count


def _kernel_at_least(major, minor):
    release = platform.release().split("-")[0].split(".")
    return tuple(int(x) for x in release[:2] if x.isdigit()) >= (major, minor)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _kernel_at_least(6, 3), reason="IPv4 BIG TCP needs Linux 6.3 or newer; "
                    "older kernels emulate the same rates at a higher CPU cost per byte")
def test_tcp_hands_the_shaped_nic_segments_over_64_kib(cluster_id, tmp_path):
    """What keeps the emulation's CPU cost per byte down (emulate._set_gso): at 1 Gbit the
    sender's htb sees TCP segments above the 64 KiB default, and still caps the rate."""
    script = tmp_path / "traffic.py"
    script.write_text(TRAFFIC_SCRIPT)
    plan = emulate.plan_network(1, 1, "1gbit", cluster_id=cluster_id)
    with emulate.emulated_network(plan) as network:
        reports = run_everywhere(network, script, {"w0": ["s0"]}, warmup_s=0.5, duration_s=1.5)
        mbit = rates_mbit(network, reports, 1.5)["w0"][0]
        # a veth counts what it passes on (tc counts wire packets)
        link, = json.loads(subprocess.run(
            network.command("w0", ["ip", "-s", "-j", "link", "show", "dev", "eth0"]),
            capture_output=True, text=True, timeout=10, check=True).stdout)
    sent = link["stats64"]["tx"]
    mean_bytes = sent["bytes"] / max(1, sent["packets"])
    print(f"\nw0 -> s0 at 1 Gbit: {mbit:.0f} Mbit/s, {sent['packets']} segments of "
          f"{mean_bytes / 1024:.0f} KiB on average")
    assert mbit <= 1.10 * GOODPUT_FRACTION * 1000
    assert mean_bytes > 65536, "segments no larger than without BIG TCP: gso_ipv4_max_size unset?"


@pytest.mark.timeout(30)
def test_failed_create_removes_what_it_built(cluster_id, monkeypatch):
    real_run = emulate._run

    def failing_tc(argv, **kwargs):
        if argv[0] == "tc":
            raise emulate.EmulationError(f"`{' '.join(argv)}` failed (exit 2): injected")
        return real_run(argv, **kwargs)

    monkeypatch.setattr(emulate, "_run", failing_tc)
    plan = emulate.plan_network(2, 1, "100mbit", cluster_id=cluster_id)
    with pytest.raises(emulate.EmulationError, match="injected"):
        emulate.create(plan)
    assert our_namespaces(cluster_id) == []
    assert not any((emulate.NETNS_ETC / ns).exists() for ns in plan.namespaces)
