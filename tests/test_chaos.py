"""Chaos (docs/chaos.md): the seeded schedule of faults, and each fault applied to a real
emulated host and undone (root)."""
from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import kill_pids, wait_until

from bpsctl.chaos.api import (
    FULL_DISK,
    LOST_LINES,
    FaultRecord,
    Lines,
    _full_disk_said,
    _keep,
    _stall_bound,
)
from bpsctl.chaos.faults import apply, netem_available
from bpsctl.chaos.schedule import DISK, KINDS, Fault, make_schedule, parse_kinds
from bpsctl.config import ConfigError
from bpsctl.launch import emulate

WORKERS, SERVERS = ("w0", "w1", "w2", "w3"), ("s0", "s1", "s2", "s3")


def test_a_seed_gives_the_same_schedule_and_every_schedule_keeps_its_rules():
    assert make_schedule(7, 120, WORKERS, SERVERS) == make_schedule(7, 120, WORKERS, SERVERS)
    assert make_schedule(7, 120, WORKERS, SERVERS) != make_schedule(8, 120, WORKERS, SERVERS)
    seen: set[str] = set()
    together = 0
    for seed in range(200):
        faults = make_schedule(seed, 120, WORKERS, SERVERS)
        assert 3 <= len(faults) <= 6
        assert faults == sorted(faults, key=lambda f: (f.start_s, f.target))
        for i, a in enumerate(faults):
            assert 0 < a.start_s < 120 and a.kind in KINDS
            assert (a.target == DISK) == (a.kind == "disk")     # the logs' disk, not a host
            span = KINDS[a.kind][0]
            assert (a.length_s is None) == (span is None)
            if span is not None:
                assert span[0] <= a.length_s <= span[1]
            for b in faults[i + 1:]:          # one fault at a time on a host
                assert a.target != b.target or a.end_s <= b.start_s or b.end_s <= a.start_s
        kills = [f.target for f in faults if f.kind == "kill"]
        assert len([k for k in kills if k in WORKERS]) <= 1
        assert len([k for k in kills if k in SERVERS]) < len(SERVERS)
        starts = [f.start_s for f in faults]
        together += len(starts) != len(set(starts))
        seen.update(f.kind for f in faults)
    assert seen == set(KINDS) and together > 0      # every kind, and two at once, happen


def test_the_kinds_asked_for_and_a_bad_one_named():
    assert parse_kinds("pause, partition") == ("pause", "partition")
    assert parse_kinds("all") == tuple(KINDS)
    faults = make_schedule(3, 60, WORKERS, SERVERS, kinds=("pause",))
    assert {f.kind for f in faults} == {"pause"}
    with pytest.raises(ConfigError, match="unknown kind.*pauze.*expected"):
        parse_kinds("pause,pauze")
    with pytest.raises(ConfigError, match="--duration"):
        make_schedule(1, 0, WORKERS, SERVERS)


def test_a_lone_server_is_never_killed():
    for seed in range(50):
        faults = make_schedule(seed, 60, WORKERS, ("s0",), kinds=("kill",))
        assert all(f.target != "s0" for f in faults)


def test_a_collapse_needs_a_shaped_nic_and_a_kind_is_checked():
    unshaped = emulate.plan_network(2, 1, None)
    with pytest.raises(ValueError, match="needs a shaped NIC .--nic.; w0's is not"):
        apply(unshaped, Fault("collapse", "w0", 0, 10, {"factor": 0.02}))
    with pytest.raises(ValueError, match="unknown fault kind 'flood'"):
        apply(unshaped, Fault("flood", "w0", 0, 10))
    with pytest.raises(KeyError, match="no emulated host 'w9'"):
        apply(unshaped, Fault("pause", "w9", 0, 10))


@pytest.fixture(scope="module")
def network():
    plan = emulate.plan_network(2, 1, "100mbit")
    with emulate.emulated_network(plan):
        yield plan


def _connects(plan, source: str, target: str) -> bool:
    """Whether a TCP connection from host ``source`` to the listener on ``target`` opens."""
    code = (f"import socket; socket.create_connection(('{plan.host(target).address}', 5555), "
            "timeout=1).close()")
    done = subprocess.run(emulate.netns_command(plan.host(source).namespace,
                                                [sys.executable, "-c", code]),
                          capture_output=True, timeout=10)
    return done.returncode == 0


def _start_in(plan, host: str, code: str) -> subprocess.Popen:
    return subprocess.Popen(emulate.netns_command(plan.host(host).namespace,
                                                  [sys.executable, "-c", code]))


LISTEN = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
          "socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5555)); s.listen(64)\n"
          "while True: s.accept()[0].close()")


def test_a_partition_cuts_a_host_off_both_ways_and_heals(network):
    listener = _start_in(network, "s0", LISTEN)
    try:
        wait_until(lambda: _connects(network, "w0", "s0"), 10, "the listener on s0")
        undo = apply(network, Fault("partition", "s0", 0, 5))
        assert not _connects(network, "w0", "s0") and not _connects(network, "w1", "s0")
        undo()
        assert _connects(network, "w0", "s0")
        # from some peers only: w0 cut off from s0, w1 not
        undo = apply(network, Fault("partition", "w0", 0, 5, {"peers": ("s0",)}))
        assert not _connects(network, "w0", "s0") and _connects(network, "w1", "s0")
        undo()
        undo()                                  # twice is once
        assert _connects(network, "w0", "s0")
    finally:
        kill_pids([listener.pid])
        listener.wait(10)


#: on s0: the arrival time of every byte on one connection, a line each
RECEIVE = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
           "socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5556)); s.listen(1)\n"
           "c = s.accept()[0]\n"
           "while c.recv(4096): print(time.time(), flush=True)")
#: on w0: a byte every 50 ms on one connection (once the receiver listens), for 20 s
SEND = ("import socket, sys, time\n"
        "for _ in range(100):\n"
        "    try: c = socket.create_connection((sys.argv[1], 5556), timeout=5); break\n"
        "    except OSError: time.sleep(0.1)\n"
        "for _ in range(400): c.send(b'x'); time.sleep(0.05)")


@pytest.mark.skipif(not emulate.tcp_rto_max_capped(),
                    reason="this kernel has no net.ipv4.tcp_rto_max_ms (Linux 6.15+)")
def test_a_connection_cut_for_4_s_carries_data_again_within_a_second_and_a_half_of_healing(
        network):
    """TCP's retransmissions back off while a cut lasts (0.2, 0.4, ... 3.2 s apart), so an
    emulated host caps the wait at TCP_RTO_MAX_MS: w0's segments, lost at s0 while it is cut
    off for 4 s, are sent again within 1 s of the cut healing, not 2.2 s after it (6.2 s of
    silence, past a 5 s heartbeat timeout). (A packet dropped by the sender's own NIC is
    retried every 0.5 s instead: the cut is s0's, the receiver's.)"""
    for host in network.hosts:
        assert emulate.run_in(host.namespace, ["cat", str(emulate.TCP_RTO_MAX_SYSCTL)]).strip() \
            == str(emulate.TCP_RTO_MAX_MS)
    processes = [subprocess.Popen(emulate.netns_command(network.host("s0").namespace,
                                                        [sys.executable, "-c", RECEIVE]),
                                  stdout=subprocess.PIPE, text=True)]
    arrivals: queue.SimpleQueue[float] = queue.SimpleQueue()

    def read(stream) -> None:
        for line in stream:
            arrivals.put(float(line))
    try:
        threading.Thread(target=read, args=(processes[0].stdout,), daemon=True).start()
        processes.append(subprocess.Popen(emulate.netns_command(
            network.host("w0").namespace,
            [sys.executable, "-c", SEND, network.host("s0").address])))
        arrivals.get(timeout=15)                        # the connection carries data
        undo = apply(network, Fault("partition", "s0", 0, 4))
        time.sleep(4)                                   # the cut's length, on the clock
        undo()
        healed = time.time()
        arrived = 0.0
        while arrived < healed:
            arrived = arrivals.get(timeout=10)          # queue.Empty: it never came back
        assert arrived - healed < 1.5, \
            f"data crossed again {arrived - healed:.2f} s after the cut healed"
    finally:
        kill_pids([p.pid for p in processes])
        for process in processes:
            process.wait(10)


def test_a_pause_stops_every_process_of_the_host_until_it_ends_and_a_kill_ends_them(network):
    sleeper = _start_in(network, "w1", "import time; time.sleep(60)")
    try:
        def inside() -> list[psutil.Process]:
            return [psutil.Process(p) for p in emulate.namespace_pids(network.host("w1").namespace)]
        wait_until(lambda: inside(), 10, "the process in w1's namespace")
        undo = apply(network, Fault("pause", "w1", 0, 5))
        # a signal is delivered after kill() returns: the process stops soon, not at once
        wait_until(lambda: all(p.status() == psutil.STATUS_STOPPED for p in inside()), 5,
                   "the processes to stop")
        undo()
        wait_until(lambda: all(p.status() != psutil.STATUS_STOPPED for p in inside()), 5,
                   "the processes to resume")
        apply(network, Fault("kill", "w1", 0, None))
        sleeper.wait(10)
        assert not emulate.namespace_pids(network.host("w1").namespace)
    finally:
        kill_pids([sleeper.pid])


def _tc(plan, host: str, *what: str) -> str:
    return emulate.run_in(plan.host(host).namespace, ["tc", *what, "show", "dev",
                                                      plan.host(host).interface])


#: on w1: counts the UDP datagrams that reach it, after "ready", until none came for 1 s
COUNT_DATAGRAMS = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                   "s.bind(('0.0.0.0', 5557)); s.settimeout(1.0); print('ready', flush=True)\n"
                   "n = 0\n"
                   "try:\n"
                   "    while True: s.recv(64); n += 1\n"
                   "except socket.timeout: print(n)")


def _datagrams_through(plan, sent: int) -> int:
    """How many of ``sent`` UDP datagrams from w0 reach w1 (paced: no queue overflows)."""
    counter = subprocess.Popen(emulate.netns_command(plan.host("w1").namespace,
                                                     [sys.executable, "-c", COUNT_DATAGRAMS]),
                               stdout=subprocess.PIPE, text=True)
    try:
        assert counter.stdout is not None and counter.stdout.readline() == "ready\n"
        send = ("import socket, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for i in range({sent}):\n"
                f"    s.sendto(b'x' * 32, ('{plan.host('w1').address}', 5557))\n"
                "    if i % 20 == 19: time.sleep(0.001)")
        emulate.run_in(plan.host("w0").namespace, [sys.executable, "-c", send])
        out, _ = counter.communicate(timeout=30)
        return int(out)
    finally:
        kill_pids([counter.pid])
        counter.wait(10)


def test_a_lossy_link_and_a_collapsed_one_are_shaped_then_restored(network):
    lossy = Fault("lossy", "w0", 0, 10, {"loss_percent": 3, "delay_ms": 40})
    if netem_available():
        undo = apply(network, lossy)
        shown = _tc(network, "w0", "qdisc")
        assert shown.count("netem") >= 3 and "loss 3%" in shown and "delay 40ms" in shown
        undo()
        assert "netem" not in _tc(network, "w0", "qdisc")
    elif not shutil.which("nft"):           # neither netem nor nftables: said, nothing done
        before = _tc(network, "w0", "qdisc")
        with pytest.raises(ValueError, match="needs the kernel's netem qdisc"):
            apply(network, lossy)
        assert _tc(network, "w0", "qdisc") == before
    else:       # a kernel built without netem (this VM's): loss alone, nftables dropping it
        assert _datagrams_through(network, 2000) >= 1990
        undo = apply(network, Fault("lossy", "w0", 0, 10, {"loss_percent": 30,
                                                            "delay_ms": 40}))
        # 1400 expected: 20 standard deviations either way
        assert 1000 < _datagrams_through(network, 2000) < 1800
        undo()
        undo()                                  # twice is once
        assert _datagrams_through(network, 2000) >= 1990
    before = _tc(network, "w0", "class")
    undo = apply(network, Fault("collapse", "w0", 0, 10, {"factor": 0.02}))
    assert "rate 2Mbit ceil 2Mbit" in _tc(network, "w0", "class")
    switch = emulate.run_in(network.switch_namespace, ["tc", "class", "show", "dev",
                                                       network.host("w0").switch_port])
    assert "rate 2Mbit ceil 2Mbit" in switch
    undo()
    assert _tc(network, "w0", "class") == before


def test_a_full_disk_is_every_byte_of_its_file_system_until_undone(tmp_path):
    import errno

    from bpsctl.chaos.faults import fill
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "chaos-test", str(disk)],
                   check=True, timeout=30)
    try:
        (disk / "a.log").write_text("room\n")
        undo = fill(disk)
        with pytest.raises(OSError) as full:
            with open(disk / "a.log", "a") as log:
                log.write("x" * 5000)
        assert full.value.errno == errno.ENOSPC
        undo()
        undo()                              # an undo may run twice
        with open(disk / "a.log", "a") as log:
            log.write("room again\n")
        assert os.listdir(disk) == ["a.log"]
    finally:
        subprocess.run(["umount", str(disk)], check=True, timeout=30)


#: the CI's seeded runs of `bpsctl chaos` (BPSCTL_CHAOS_SEEDS=1,2,... for others), one command:
#: every kind this kernel has without netem, on 2 + 2 emulated hosts, a 55-step job, faults
#: started within 5.5 s and a 2 s heartbeat timeout, so that a run takes seconds. Between them
#: they kill the scheduler's host and a worker, pause servers and workers (under and past the
#: timeout), start two faults at once, collapse links and fill the disk under the logs. Seed 4
#: pauses worker 0 and, 1.9 s later, cuts off the scheduler's host: the scheduler declares the
#: worker lost into the cut, and the server and worker that reconnect must be told again
SEEDS = os.environ.get("BPSCTL_CHAOS_SEEDS", "1,4,8,22,23")
CI_KINDS = "kill,pause,partition,collapse,disk"
#: and seed 3 of lossy links alone, in a 30-step job: every host of the four loses 1.5-4.7%
#: of what it sends from its first second to its end (loss alone where there is no netem)
RUNS = [(SEEDS, CI_KINDS), ("2", "disk"), ("3", "lossy")]
#: what a worker says when the job goes on without a member, or replaces one
LOSS_DECLARED = re.compile(r"lost (server|worker) \d|took over|moved to|restart|rejoin|fenc")

#: a training script of one's own, run by `bpsctl chaos -- python train.py`: it records its
#: steps for the checker with bpsctl.chaos.job.Recorder, and prints a line per step
OWN_SCRIPT = """\
import time

import torch
import torch.nn.functional as F

import bpsctl.engine.torch as bps
from bpsctl.chaos.job import Recorder, flat_parameters

torch.set_num_threads(1)
bps.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)
record = Recorder(bps.rank())
for step in range(bps.step_count(), 80):
    data = torch.Generator().manual_seed(1000 * bps.rank() + step)
    x, y = torch.randn(16, 256, generator=data), torch.randint(0, 10, (16,), generator=data)
    began = time.monotonic()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    took = time.monotonic() - began
    digest = record.step(step, flat_parameters(model), took)
    print(f"step {step} loss {loss.item():.4f} parameters {digest} {1000 * took:.1f} ms",
          flush=True)
    norm = sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5
    print(f"rank {bps.rank()} step {step}: lr 0.05, batch 16, gradient norm {norm:.4f}, "
          f"{16 / max(took, 1e-6):.0f} samples/s", flush=True)
record.final(flat_parameters(model))
bps.shutdown()
"""


@pytest.mark.parametrize("seeds, kinds", RUNS)
def test_bpsctl_chaos_trains_through_a_seeded_schedule_and_checks_it(tmp_path, seeds, kinds):
    """The command end to end, as a user runs it: a small job on 2 + 2 emulated hosts through
    the schedules of several seeds, each on a cluster of its own (every kind, two at once
    among them), or the disk under the logs filled, which must stop nothing and be said once,
    with a training script of one's own after --; every fault applied and undone, every
    invariant held or not applying, nothing left."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "chaos.json"
    if kinds == "disk":
        (tmp_path / "train.py").write_text(OWN_SCRIPT)
        job = ["--", sys.executable, "train.py"]
        env = {}
    else:           # lossy links alone: all of them from the first second, a shorter job
        job = ["--steps", "30", "--duration", "1"] if kinds == "lossy" else \
            ["--steps", "55", "--duration", "5.5"]
        env = {"BPSCTL_HEARTBEAT_TIMEOUT": "2"}
    command = subprocess.Popen(
        [sys.executable, "-m", "bpsctl.cli", "chaos", "--workers", "2", "--servers", "2",
         "--seed", seeds, "--faults", kinds, "--json", str(out), *job],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "100", "BPSCTL_STATE_DIR": str(tmp_path / "state"),
             **env})
    try:
        stdout, stderr = command.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        command.terminate()         # SIGTERM: the command tears its cluster down first
        stdout, stderr = command.communicate(timeout=60)
        pytest.fail(f"bpsctl chaos did not end within 300 s:\n{stderr[-3000:]}")
    result = subprocess.CompletedProcess(command.args, command.returncode, stdout, stderr)
    assert out.exists(), result.stderr[-3000:]
    summary = json.loads(out.read_text())
    reports = summary["runs"] if "," in seeds else [summary]
    assert [report["seed"] for report in reports] == [int(s) for s in seeds.split(",")]
    for report in reports:
        seed = report["seed"]
        assert report["kind"] == "chaos"
        assert report["tcp_rto_max_ms"] == (emulate.TCP_RTO_MAX_MS
                                            if emulate.tcp_rto_max_capped() else None)
        assert 1 <= len(report["faults"]) <= 6
        assert {r["fault"]["kind"] for r in report["faults"]} <= set(kinds.split(","))
        if kinds == "disk":
            # seed 2 fills the disk early and for longer than the job: the workers' logs
            # outgrow the pages they had (two lines a step, some 150 bytes: over 4 KiB once
            # the disk is full), the job goes on, and the terminal hears it once per log
            assert report["exit_code"] == 0
            assert report["command"] == job[1:] and report["steps"] is None
            # the script recorded its steps: the checks of steps applied, and held
            assert report["invariants"]["every step done"] is True
            assert report["invariants"]["ranks bitwise equal after every step"] is True
            assert report["final_rel_diff"] is not None
            assert report["invariants"][FULL_DISK] is True
            assert all(r["noticed_s"] is not None for r in report["faults"]), \
                _why(report, ["every full disk said"], result.stderr)
            assert any("cannot write" in line for line in report["said"]), \
                _why(report, ["a full disk said"], result.stderr)
        if kinds == "lossy":
            # slower steps, nothing else: no loss declared, no failover, no restart. A
            # connection that carried nothing for the heartbeat timeout may drop and come
            # back, which its worker says (seen once, under the full suite's load): nothing
            # moves for it
            assert report["exit_code"] == 0, _why(report, ["exit 0"], result.stderr)
            declared = [line for line in report["said"] if LOSS_DECLARED.search(line)]
            assert not declared, _why(report, ["no loss declared"], result.stderr)
        for record in report["faults"]:
            assert record["applied_s"] is not None and record["undone_s"] is not None, \
                (seed, record)
            assert not record["error"], (seed, record)
        failed = [name for name, held in report["invariants"].items() if held is False]
        assert not failed, _why(report, failed, result.stderr)
        if report["survivable"]:        # a way on was left: the job trains to its end
            assert report["exit_code"] == 0, _why(report, ["exit 0"], result.stderr)
        assert report["left_behind"] == []
        # the table says it: each fault, then each invariant
        assert f"bpsctl chaos, seed {seed}" in result.stderr
    if len(reports) > 1:        # between them, every kind, and two faults at once
        drawn = [r["fault"] for report in reports for r in report["faults"]]
        assert {fault["kind"] for fault in drawn} == set(kinds.split(","))
        assert any(len({f["fault"]["start_s"] for f in report["faults"]}) <
                   len(report["faults"]) for report in reports)
        assert summary["ok"] and set(summary["by_kind"]) == set(kinds.split(","))
    assert result.returncode == 0 and "held" in result.stderr
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before


def _why(report: dict, failed: list[str], stderr: str) -> str:
    """A failed run as text for the assertion (pytest shortens the repr of anything but a
    string to a few hundred characters): the invariants failed, the faults, what the workers
    said and printed last, every step each rank recorded (the digests show where the ranks
    parted), the end of each log its cluster kept, and the command's own last words."""
    kept = Path(report["kept"]) if report.get("kept") else None
    parts = [f"seed {report['seed']}: failed {failed}; unequal steps "
             f"{report['unequal_steps']}; workers left {report['workers_left']}",
             "faults:", *(json.dumps(r) for r in report["faults"]),
             "said:", *report["said"], "output, last lines:", *report["output_tail"]]
    for steps in sorted(kept.glob("steps-*")) if kept else []:
        parts += [f"{steps.name}:", steps.read_text()]
    for name, lines in _kept_logs(report).items():
        parts += [f"{name}, last lines:", *lines]
    return "\n".join([*parts, "stderr, last lines:", stderr[-3000:]])


def _kept_logs(report: dict) -> dict[str, list[str]]:
    """The end of each log of a failed run's cluster, kept by `bpsctl chaos`: what a failure
    in CI shows beside the workers' output (the servers' admits, losses and refusals)."""
    kept = report.get("kept")
    logs = sorted((Path(kept) / "logs").glob("*.log")) if kept else []
    return {log.name: log.read_text(errors="replace").splitlines()[-25:] for log in logs}


def test_ctrl_c_ends_a_sweep_of_seeds_and_leaves_nothing(tmp_path):
    """Ctrl-C while the job trains: the command takes its cluster down and ends, exit 130,
    saying it was interrupted, without going on to the next seed or writing a report."""
    def clusters() -> set[str]:
        return {leftover.cluster_id for leftover in emulate.find_leftovers()}

    out, others = tmp_path / "runs.json", clusters()
    command = subprocess.Popen(
        [sys.executable, "-m", "bpsctl.cli", "chaos", "--workers", "2", "--servers", "2",
         "--seed", "1,2", "--faults", "pause", "--steps", "2000", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "BPSCTL_STATE_DIR": str(tmp_path / "state")})
    try:
        def training() -> bool:
            for child in psutil.Process(command.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):     # one that exited meanwhile
                    if "bpsctl.chaos.job" in " ".join(child.cmdline()):
                        return True
            return False
        wait_until(training, 60, "the chaos job's workers to start")
        ours = clusters() - others
        command.send_signal(signal.SIGINT)
        stdout, stderr = command.communicate(timeout=60)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(30)
    assert command.returncode == 130, stderr[-2000:]
    assert "interrupted (SIGINT); stopped what was started" in stderr
    assert "seed 2" not in stderr and not out.exists()
    assert ours and not ours & clusters()


def test_a_failed_run_is_kept_with_its_logs_beside_the_report(tmp_path):
    """What a run that failed leaves to find the cause with: its output and steps, and its
    cluster's logs, copied out of the temporary directory before it goes; a second failure
    of the same seed is kept beside the first, not over it."""
    run, state = tmp_path / "tmp" / "chaos-4", tmp_path / "tmp" / "state"
    run.mkdir(parents=True)
    (run / "output.txt").write_text("   12.23 [1] step 31 loss 2.3035\n")
    (run / "steps-0").write_text("31 abc 0.1 1.0\n")
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "server-0.log").write_text("worker 0 (restart 1) joined\n")
    first = _keep(run, state, tmp_path / "bpsctl-chaos-seed-4")
    second = _keep(run, state, tmp_path / "bpsctl-chaos-seed-4")
    assert (first.name, second.name) == ("bpsctl-chaos-seed-4", "bpsctl-chaos-seed-4.2")
    for kept in (first, second):
        assert (kept / "output.txt").read_text().startswith("   12.23 [1] step 31")
        assert (kept / "steps-0").exists()
        assert (kept / "logs" / "server-0.log").read_text() == "worker 0 (restart 1) joined\n"
    assert _kept_logs({"kept": str(first)}) == {"server-0.log": ["worker 0 (restart 1) joined"]}


def _record(out, rank: int, rows: list[tuple[int, str, float, float]], pid: int = 100) -> None:
    """Rows of ``steps-RANK`` as process ``pid`` of that rank writes them."""
    out.mkdir(exist_ok=True)
    with open(out / f"steps-{rank}", "a") as f:
        for step, digest, seconds, wall in rows:
            f.write(f"{step} {digest} {seconds} {wall} {pid}\n")


def test_the_checker_finds_ranks_that_differ_stalls_and_a_drifted_model(tmp_path):
    import numpy as np

    from bpsctl.chaos.api import ChaosSettings, FaultRecord, _check
    from bpsctl.config import Config
    from bpsctl.launch.types import RunResult, WorkerFailure
    reference, chaos = tmp_path / "reference", tmp_path / "chaos"
    reference.mkdir()
    np.save(reference / "final-0.npy", np.ones(100, dtype=np.float32))
    settings, config = ChaosSettings(workers=2, servers=2, steps=4), Config()
    walls = [1000.0, 1001.0, 1002.0, 1003.0]
    _record(chaos, 0, [(s, f"h{s}", 0.1, walls[s]) for s in range(4)])
    _record(chaos, 1, [(s, f"h{s}", 0.1, walls[s]) for s in range(4)])
    (chaos / "start").write_text("1000.0")
    np.save(chaos / "final-0.npy", np.ones(100, dtype=np.float32))
    clean = _check(config, settings, reference, chaos, RunResult(0), [])
    assert all(clean["invariants"].values()) and clean["final_rel_diff"] == 0.0
    # ranks that differ at step 2, 20 s without progress before step 3, a model that drifted,
    # and a job that failed although the faults left it a way on
    _record(chaos, 1, [(2, "other", 0.1, 1002.0), (3, "h3", 0.1, 1023.0)])
    _record(chaos, 0, [(3, "h3", 0.1, 1023.0)])
    np.save(chaos / "final-0.npy", np.full(100, 1.01, dtype=np.float32))
    failed = RunResult(1, failures=(WorkerFailure(0, 1, 1, None, ()),))
    bad = _check(config, settings, reference, chaos, failed, [])
    assert bad["unequal_steps"] == [2] and bad["worst_stall_s"] == pytest.approx(20.0)
    assert [name for name, held in bad["invariants"].items() if held is False] == [
        "exit 0, or a named error where the faults left no way on",
        "ranks bitwise equal after every step",
        "final parameters within 0.001 of the fault-free run's",
        "worst stall within the heartbeat timeout + 2 s per loss"]
    # the scheduler's host cut off past the timeout: nothing moves until it is back, so the
    # 20 s stall is not held against the job
    cut = FaultRecord(Fault("partition", "s0", 0.0, 13.0), applied_s=0.0, undone_s=13.0)
    assert _check(config, settings, reference, chaos, RunResult(0), [cut])["invariants"][
        "worst stall within the heartbeat timeout + 2 s per loss"] is None
    # both servers paused at once: a failure naming the loss is the right ending
    both = [FaultRecord(Fault("pause", f"s{i}", 1.0, 9.0), applied_s=1.0, undone_s=10.0)
            for i in range(2)]
    assert _check(config, settings, reference, chaos, failed, both)["invariants"][
        "exit 0, or a named error where the faults left no way on"]
    # the stall under a collapsed link is allowed; a worker that left makes the model n/a
    collapsed = FaultRecord(Fault("collapse", "w1", 0.0, 30.0), applied_s=0.5, undone_s=30.0)
    left = RunResult(0, restarted=(WorkerFailure(1, 1, 137, "SIGKILL", ()),))
    lenient = _check(config, settings, reference, chaos, left, [collapsed])
    assert lenient["unequal_steps"] == [2]      # its last step before a restart, later on
    assert lenient["invariants"]["worst stall within the heartbeat timeout + 2 s per loss"]
    assert lenient["invariants"]["final parameters within 0.001 of the fault-free run's"] is None
    assert lenient["workers_left"] == [1]
    # a job that ended well without a worker that left it for good (restarted too late):
    # every step done by the rank that stayed; not so had that rank stayed too
    short = tmp_path / "short"
    _record(short, 0, [(s, f"h{s}", 0.1, walls[s]) for s in range(4)])
    _record(short, 1, [(s, f"h{s}", 0.1, walls[s]) for s in range(2)])
    (short / "start").write_text("1000.0")
    assert _check(config, settings, reference, short, left, [])["invariants"][
        "every step done"] is True
    assert _check(config, settings, reference, short, RunResult(0), [])["invariants"][
        "every step done"] is False
    # the last step of a worker that left, before it went, may hold a sum the others did
    # again without it (its server was lost too): not compared; its steps after a restart are
    _record(short, 1, [(1, "its-own", 0.1, walls[1])])      # rank 1 stopped after step 1
    assert _check(config, settings, reference, short, left, [])["unequal_steps"] == []
    assert _check(config, settings, reference, short, RunResult(0), [])["unequal_steps"] == [1]
    _record(short, 1, [(3, "after-rejoining", 0.1, walls[3])])
    assert _check(config, settings, reference, short, left, [])["unequal_steps"] == [3]
    # its restart may go on from the very next step (the donor had done that one): the dead
    # process's last step is still not compared, the restart's steps are
    rejoined = tmp_path / "rejoined"
    _record(rejoined, 0, [(s, f"h{s}", 0.1, walls[s]) for s in range(4)])
    _record(rejoined, 1, [(0, "h0", 0.1, walls[0]), (1, "its-own", 0.1, walls[1])], pid=100)
    _record(rejoined, 1, [(s, f"h{s}", 0.1, walls[s]) for s in (2, 3)], pid=200)
    assert _check(config, settings, reference, rejoined, left, [])["unequal_steps"] == []
    assert _check(config, settings, reference, rejoined, RunResult(0), [])[
        "unequal_steps"] == [1]
    _record(rejoined, 1, [(2, "after-rejoining", 0.1, walls[2])], pid=200)
    assert _check(config, settings, reference, rejoined, left, [])["unequal_steps"] == [2]


def test_silences_that_overlap_on_one_host_add_up_to_a_loss():
    """What the checker counts as a host down: its silence towards the scheduler, its own
    pauses and cuts merged with a short cut of the scheduler's host, for the heartbeat timeout
    less an interval and a margin (5, 0.5 and 0.5 s here). Seed 1 of `--faults
    partition,pause` on 2 + 2:
    worker 1 paused for 3.7 s inside a 4.4 s cut of the scheduler's host is silent for 4.5 s,
    and with worker 0 paused for good no worker is left: the job may end in an error."""
    from bpsctl.chaos.api import ChaosSettings, FaultRecord, _down_windows, _survivable

    def record(kind: str, target: str, start: float, length: float) -> FaultRecord:
        return FaultRecord(Fault(kind, target, start, length), applied_s=start,
                           undone_s=start + length)

    seed_1 = [record("pause", "w0", 0.4, 21.2), record("partition", "s0", 2.5, 4.4),
              record("pause", "s1", 3.2, 17.0), record("pause", "w1", 3.3, 3.7)]
    assert [(round(a, 1), round(b, 1), host) for a, b, host in
            sorted(_down_windows(seed_1, 5.0, 0.5))] == [
        (0.4, 21.6, "w0"), (2.5, 6.9, "s0"), (2.5, 7.0, "w1"), (2.5, 20.2, "s1")]
    settings = ChaosSettings(workers=2, servers=2)
    assert not _survivable(settings, _down_windows(seed_1, 5.0, 0.5), 1)
    # apart, neither silence is a loss; a cut of the scheduler's host past the timeout is its
    # own isolation (it declares nobody lost), so a pause inside it adds nothing
    apart = [record("partition", "s0", 2.5, 4.4), record("pause", "w1", 7.5, 3.7)]
    isolated = [record("partition", "s0", 2.0, 8.0), record("pause", "w1", 3.0, 3.7)]
    for faults in (apart, isolated):
        assert [w for w in _down_windows(faults, 5.0, 0.5) if w[2] != "s0"] == []
        assert _survivable(settings, _down_windows(faults, 5.0, 0.5), 1)
    # the scheduler's host cut off for longer than the workers wait for the scheduler (the
    # heartbeat timeout, then BPSCTL_SCHEDULER_TIMEOUT: 5 + 15 s): server 0's partitions
    # cannot move meanwhile, so the job may end in an error naming both (seed 19 on 4 + 4)
    long_cut = [record("partition", "s0", 7.7, 25.2)]
    assert not _survivable(settings, _down_windows(long_cut, 5.0, 0.5), 1, 20.0)
    assert _survivable(settings, _down_windows(long_cut, 5.0, 0.5), 1, 30.0)


def test_a_script_of_ones_own_that_records_no_steps_is_judged_by_how_it_ended(tmp_path):
    from bpsctl.chaos.api import ChaosSettings, _check
    from bpsctl.config import Config
    from bpsctl.launch.types import RunResult, WorkerFailure
    reference, chaos = tmp_path / "reference", tmp_path / "chaos"
    reference.mkdir()
    chaos.mkdir()
    settings = ChaosSettings(workers=2, servers=2, command=("python", "train.py"))
    report = _check(Config(), settings, reference, chaos, RunResult(0), [])
    assert report["command"] == ["python", "train.py"] and report["steps"] is None
    judged = {name: held for name, held in report["invariants"].items() if held is not None}
    assert judged == {"exit 0, or a named error where the faults left no way on": True,
                      "every fault applied and undone": True}
    failed = RunResult(1, failures=(WorkerFailure(0, 1, 1, None, ()),))
    assert not _check(Config(), settings, reference, chaos, failed, [])["invariants"][
        "exit 0, or a named error where the faults left no way on"]
    # the default job that recorded nothing did not run: that is a failure, not n/a
    default = _check(Config(), ChaosSettings(workers=2, servers=2), reference, chaos,
                     RunResult(0), [])
    assert default["invariants"]["every step done"] is False


def test_the_recorder_writes_what_the_checker_reads_only_under_bpsctl_chaos(tmp_path,
                                                                            monkeypatch):
    import numpy as np

    from bpsctl.chaos import CHAOS_DIR
    from bpsctl.chaos.api import _steps
    from bpsctl.chaos.job import Recorder
    monkeypatch.delenv(CHAOS_DIR, raising=False)
    outside = Recorder(0)
    assert outside.step(0, np.ones(4, np.float32), 0.5) and not list(tmp_path.iterdir())
    monkeypatch.setenv(CHAOS_DIR, str(tmp_path))
    record = Recorder(1)
    digests = [record.step(s, np.full(4, s, np.float32), 0.25) for s in range(3)]
    record.final(np.full(4, 2, np.float32))
    steps = _steps(tmp_path)
    assert [steps[1][s][0] for s in range(3)] == digests and len(set(digests)) == 3
    assert steps[1][2][1] == 0.25
    assert (np.load(tmp_path / "final-1.npy") == 2).all()


def test_chaos_refuses_steps_for_a_command_and_a_script_that_is_not_there(tmp_path,
                                                                           monkeypatch):
    from typer.testing import CliRunner

    from bpsctl.cli import app
    monkeypatch.chdir(tmp_path)
    for args, said in ((["--steps", "20", "--", "python", "x.py"], "--steps: the number of"),
                       (["--", sys.executable, "missing.py"], "cannot open 'missing.py'"),
                       (["--seed", "4-1"], "give a seed (7), seeds (1,4,9) or a range")):
        done = CliRunner().invoke(app, ["chaos", *args])
        assert done.exit_code == 2 and said in done.output, done.output
        assert done.exception is None or isinstance(done.exception, SystemExit)


def _printed(printer, report: dict, width: int = 100) -> str:
    """What ``printer`` (of bpsctl.chaos.cli) shows on the terminal for ``report``."""
    from rich.console import Console

    from bpsctl.chaos import cli
    console = Console(record=True, width=width)
    original, cli.err_console = cli.err_console, console
    try:
        printer(report)
    finally:
        cli.err_console = original
    return console.export_text()


def test_the_chaos_table_names_each_fault_and_each_invariant():

    from bpsctl.chaos import cli
    report = {"seed": 4, "duration_s": 12.0, "median_step_s": 0.05, "worst_stall_s": 0.4,
              "stall_bound_s": 7.0, "final_rel_diff": 3e-5,
              "faults": [{"fault": {"kind": "partition", "target": "s1", "start_s": 2.5,
                                    "length_s": 6.0}, "noticed_s": 7.6, "error": "",
                          "action": "[0] worker 0: server 1 lost; its partitions moved"}],
              "invariants": {"exit 0": True, "final parameters": None, "nothing left": False}}
    text = _printed(cli.print_chaos, report)
    assert "bpsctl chaos, seed 4: 1 faults over 12 s" in text
    assert "partition" in text and "server 1 lost" in text and "7.6" in text
    assert "held  exit 0" in text and "n/a   final parameters" in text
    assert "FAILED  nothing left" in text
    # where the failed run was kept, or why it could not be
    for kept, said in (({"kept": "/w/bpsctl-chaos-seed-4"}, "are kept in /w/bpsctl-chaos-seed-4"),
                       ({"kept": None, "kept_error": "No space left on device: /w"},
                        "could not be kept: No space left on device: /w")):
        assert said in _printed(cli.print_chaos, {**report, **kept}, width=200)


def test_seeds_are_one_a_list_or_a_range_and_the_summary_counts_each_kind():

    from bpsctl.chaos import cli
    from bpsctl.chaos.api import _by_kind, parse_seeds
    assert parse_seeds("7") == [7]
    assert parse_seeds("1,4, 9") == [1, 4, 9]
    assert parse_seeds("3-6,10") == [3, 4, 5, 6, 10]
    for bad, words in (("x", "give a seed (7)"), ("5-2", "a range (1-50)"),
                       ("1,2-3,3", "a seed is given twice")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            parse_seeds(bad)

    def record(kind: str, applied: float | None, noticed: float | None) -> dict:
        return {"fault": {"kind": kind}, "applied_s": applied, "noticed_s": noticed}
    runs = [{"seed": 1, "ok": True, "faults": [record("pause", 1.0, 6.2),
                                               record("partition", 2.0, None)]},
            {"seed": 2, "ok": False, "faults": [record("pause", 0.5, None),
                                                record("pause", None, None)]}]
    by_kind = _by_kind(runs)
    # a fault the job ended before its start was never injected
    assert by_kind == {"pause": {"injected": 2, "noticed": 1, "survived": 1},
                       "partition": {"injected": 1, "noticed": 0, "survived": 1}}
    text = _printed(cli.print_summary, {"runs": runs, "by_kind": by_kind})
    assert "bpsctl chaos, 2 seeded runs" in text
    assert re.search(r"pause\s+│\s+2\s+│\s+1\s+│\s+1", text), text
    assert "1 of 2 runs held every invariant; failed: seed 2" in text


def test_the_job_is_the_same_in_every_run_and_each_rank_gets_its_own_batches():
    from bpsctl.chaos.job import batch, make_model
    first, again = make_model(), make_model()
    assert all((a == b).all() for a, b in zip(first.parameters(), again.parameters(),
                                              strict=True))
    assert (batch(0, 3)[0] == batch(0, 3)[0]).all()
    assert not (batch(0, 3)[0] == batch(1, 3)[0]).all()


def test_what_bpsctl_said_is_matched_to_the_host_it_names():
    from bpsctl.chaos.api import _names
    assert _names("10.77.0.10", "[1] worker 1: lost worker 0 (10.77.0.10, pid 31266): no heartbeat")
    assert not _names("10.77.0.1", "[1] worker 1: lost worker 0 (10.77.0.10, pid 31266)")
    assert _names("10.77.0.130", "[0] worker 0: lost the scheduler at 10.77.0.130:45199: closed")


# ------------------------------------------------------------------ a full disk under the logs

def _on_full_disk(fd: int) -> int:
    """Point ``fd`` at /dev/full (every write fails: no space left); the saved original."""
    saved = os.dup(fd)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)
    return saved


def test_a_process_log_on_a_full_disk_drops_lines_then_says_how_many(tmp_path):
    """A server's or the scheduler's log (its stderr, a file): while the disk is full each
    line is dropped without an error or a traceback, and the first line written once there is
    room says how many were lost."""
    import logging

    from bpsctl.engine.common import FullDiskTolerantHandler
    log = tmp_path / "server.log"
    with open(log, "w") as stream:
        handler = FullDiskTolerantHandler(stream)
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        logger = logging.getLogger("chaos-test-full-disk")
        logger.propagate = False
        logger.addHandler(handler)
        try:
            logger.warning("before")
            saved = _on_full_disk(stream.fileno())
            try:
                for i in range(3):
                    logger.warning("lost %d", i)            # no exception, nothing printed
            finally:
                os.dup2(saved, stream.fileno())
                os.close(saved)
            logger.warning("after")
            logger.warning("later")
        finally:
            logger.removeHandler(handler)
    lines = log.read_text().splitlines()
    assert lines[0] == "[chaos-test-full-disk] WARNING before"
    assert "3 line(s) of this log were lost from" in lines[1] and "disk was full" in lines[1]
    assert lines[2:] == ["[chaos-test-full-disk] WARNING after",
                         "[chaos-test-full-disk] WARNING later"]


def test_a_workers_output_goes_on_when_its_log_disk_is_full(tmp_path):
    """`bpsctl run` relays each worker's output to the terminal and its log: on a full disk
    the terminal still gets every line (the worker never blocks on a pipe nobody drains),
    hears once that the log cannot be written, and once there is room the log says how many
    lines it misses."""
    import io

    from bpsctl.launch.output import OutputRelay
    read_out, write_out = os.pipe()
    read_err, write_err = os.pipe()
    terminal = io.StringIO()
    log = tmp_path / "worker-0.log"
    relay = OutputRelay(0, os.fdopen(read_out, "rb"), os.fdopen(read_err, "rb"), terminal,
                        terminal, log)
    saved = _on_full_disk(relay._log.fileno())
    lines = 2000        # 200 KB: more than a pipe holds, so a relay that stopped blocks us

    def relayed() -> list[str]:
        return [x for x in terminal.getvalue().splitlines() if x.startswith("[0] step ")]
    try:
        with os.fdopen(write_out, "wb") as out, os.fdopen(write_err, "wb") as err:
            for i in range(lines):
                out.write(f"step {i} ".encode() + b"." * 90 + b"\n")
            out.flush()
            err.write(b"a warning\n")
            err.flush()
            wait_until(lambda: len(relayed()) == lines and "a warning" in terminal.getvalue(),
                       30, "every line on the terminal")
            os.dup2(saved, relay._log.fileno())            # room again
            out.write(b"after\n")
    finally:
        relay.close(timeout_s=10)
        os.close(saved)
    said = terminal.getvalue().splitlines()
    told = [x for x in said if "[bpsctl] cannot write" in x]
    assert len(told) == 1 and "No space left on device" in told[0], told
    assert said[-1] == "[0] after"
    assert log.read_text().splitlines() == [
        f"[bpsctl] {lines + 1} line(s) of this log were lost: its disk was full", "after"]


def test_a_restarted_worker_may_say_the_full_disk_once_more_for_its_log(tmp_path):
    """The full disk is said once per process that writes a log: a worker restarted after
    the disk filled is a new process writing its rank's log, and says it once too; and once
    more where room came back (its log counts the lines it lost) and ran out again."""
    disk = FaultRecord(Fault("disk", DISK, 1.0, 20.0), applied_s=1.0, undone_s=21.0)
    output = Lines(0.0)
    line = ("[0] [bpsctl] cannot write /state/logs/worker-0.log: No space left on device; "
            "this worker's output goes on here only until there is room\n")
    output.write(line + "[0] step 3\n" + line)
    assert _full_disk_said([disk], output, tmp_path, collections.Counter({0: 1})) is True
    assert _full_disk_said([disk], output, tmp_path, collections.Counter()) is False
    assert _full_disk_said([disk], output, tmp_path, collections.Counter({1: 1})) is False
    assert _full_disk_said([], output, tmp_path, collections.Counter()) is None
    # room came back for a while (the log counted what it lost) and ran out again: said again
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "worker-0.log"
    output = Lines(0.0)
    output.write(line.replace("/state/logs/worker-0.log", str(log)) * 2)
    assert _full_disk_said([disk], output, tmp_path, collections.Counter()) is False
    log.write_text(f"step 2\n{LOST_LINES} ...\nstep 3\n")
    assert _full_disk_said([disk], output, tmp_path, collections.Counter()) is True


def test_losses_one_after_another_within_a_step_add_up_to_its_stall_bound():
    """A step may wait out a loss (the heartbeat timeout + 2 s), and then another that began
    while it waited: seed 36 on 4 + 4 lost worker 1 at 16.9 s and server 2 at 21.0 s, and
    its step stalled 9 s. Losses apart keep the bound of one."""
    assert _stall_bound([], 7.0) == 7.0
    assert _stall_bound([(16.9, 34.6, "w1"), (21.0, 47.8, "s2")], 7.0) == pytest.approx(11.1)
    assert _stall_bound([(2.0, 9.0, "w1"), (30.0, 40.0, "s2")], 7.0) == 7.0
    assert _stall_bound([(16.9, 34.6, "s0"), (21.0, 47.8, "s2")], 7.0) == 7.0
