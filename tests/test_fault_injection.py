"""Seeded fault injection on emulated clusters (root): kill -9 a worker, a server or the
scheduler, or cut a host's link, at random points of a training run.

These are fail-fast runs (``BPSCTL_SERVER_FAILOVER=0``); test_resilience.py has the default,
where a job goes on through a lost server.

Every run goes through the CLI as a user would: `bpsctl up --emulate` (2 worker hosts, 2 server
hosts, the scheduler beside server 0, 1 Gbit NICs), `bpsctl run -np 2 -- python
fault_worker.py`, then the fault, then `bpsctl down`. For each run it asserts:

- every process that cannot go on (the run's workers and launcher) is gone within
  ``EXIT_WITHIN_S`` of the fault, and the cluster processes that can go on are still running
  (servers go on without the scheduler: a killed one is killed with its supervisor here, so
  that nothing restarts it);
- the launcher exits non-zero and its output names the lost role and its host;
- after `bpsctl down`, no recorded process (cluster, launcher, workers) and no namespace is left.

Worker kills share one cluster (a rerun right after a crash must work, so they run at least
twice); every other fault brings up a fresh one. ``BPSCTL_FAULT_RUNS`` runs of each kind
(default 1, within the README's test command's time; 20 for a longer soak), seeded by
``BPSCTL_FAULT_SEED``; with
``BPSCTL_FAULT_REPORT=FILE`` the per-run figures are written there as JSON.
"""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
from conftest import gone, kill_pids

from bpsctl.launch import api, emulate
from bpsctl.launch.state import load_supervision

RUNS = int(os.environ.get("BPSCTL_FAULT_RUNS", "1"))
SEED = int(os.environ.get("BPSCTL_FAULT_SEED", "8"))
REPORT_FILE = os.environ.get("BPSCTL_FAULT_REPORT")
EXIT_WITHIN_S = 15.0            # every remaining process exits within 15 s
STEPS = 600                     # far more than a run lasts: every run ends by its fault
RUN_BOUND_S = 60.0              # a run that has not ended by then has hung
WORKER_SCRIPT = Path(__file__).resolve().parent / "fault_worker.py"
LINK_TARGETS = ("w1", "s1", "s0", "w0-alone")   # w0-alone: the only worker's host is cut off

@dataclass
class Outcome:
    """One run's figures, as the closing note reports them."""

    kind: str                   # worker | server | scheduler | link
    target: str                 # worker:1, server:0, scheduler, link:s1, ...
    seed: str
    phase: str                  # startup, or step N (+ offset)
    exit_s: float               # fault -> every process that must exit is gone
    exit_code: int
    named: str                  # the text that names the lost role and host


OUTCOMES: list[Outcome] = []


@dataclass
class Cluster:
    """An emulated cluster brought up with the CLI, and every PID it ever involved."""

    state_dir: Path
    state: api.ClusterState | None = None
    pids: set[int] = field(default_factory=set)

    def cli(self, *args: str, timeout_s: float = 90, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], check=False,
                              env=cli_env(self.state_dir), capture_output=True, text=True,
                              timeout=timeout_s, **kwargs)

    def up(self) -> None:
        result = self.cli("up", "--emulate", "--workers", "2", "--servers", "2", "--nic", "1gbit")
        assert result.returncode == 0, result.stderr
        self.state = api.load_state(self.state_dir)
        self.pids |= {p.pid for p in self.state.processes}

    def record(self, name: str) -> api.ProcessRecord:
        return next(p for p in self.state.processes if p.name == name)

    def namespace(self, host: str) -> str:
        return emulate.namespace_name(self.state.emulation["cluster_id"], host)

    def down(self) -> None:
        """`bpsctl down`; then no recorded process and no namespace may be left."""
        if self.state is None:
            return
        cluster_id, self.state = self.state.emulation["cluster_id"], None
        result = self.cli("down")
        assert result.returncode == 0, result.stderr
        left = [pid for pid in self.pids if not gone(pid)]
        kill_pids(left)
        assert not left, f"processes left after `bpsctl down`: {left}"
        namespaces = [ns for ns in emulate.list_namespaces() if ns.startswith(f"bps-{cluster_id}-")]
        assert not namespaces, f"namespaces left after `bpsctl down`: {namespaces}"


def cli_env(state_dir: Path) -> dict[str, str]:
    # wide lines: rich wraps at 80 columns when not on a terminal. Fail-fast is what these runs
    # check: with failover (the default) a lost server's job goes on (test_resilience.py). A
    # job of one worker (w0-alone) pushes through the servers too: its link to them is cut
    return {**os.environ, "BPSCTL_STATE_DIR": str(state_dir), "COLUMNS": "200",
            "BPSCTL_SERVER_FAILOVER": "0", "BPSCTL_FORCE_DISTRIBUTED": "1"}


@pytest.fixture
def cluster(tmp_path):
    cluster = Cluster(tmp_path / "state")
    try:
        yield cluster
    finally:
        cluster.down()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


def files(directory: Path, prefix: str) -> dict[int, int]:
    """rank -> the number in ``<prefix>-<rank>`` (a pid or the last step done)."""
    found = {}
    for path in directory.glob(f"{prefix}-*"):
        try:
            found[int(path.name.rpartition("-")[2])] = int(path.read_text())
        except ValueError:
            pass                # being written
    return found


def strike_run(cluster: Cluster, tmp_path: Path, kind: str, index: int) -> Outcome:
    """One run with one fault; returns its figures after asserting what it must."""
    seed = f"{SEED}-{kind}-{index}"
    rng = random.Random(seed)
    state = cluster.state
    np_workers = 2
    if kind == "worker":
        rank = rng.randrange(2)
        target = f"worker:{rank}"
    elif kind == "server":
        target = f"server:{rng.randrange(2)}"
    elif kind == "scheduler":
        target = "scheduler"
    else:
        host = LINK_TARGETS[index % len(LINK_TARGETS)]
        if host == "w0-alone":
            host, np_workers = "w0", 1
        target = f"link:{host}"
    report_dir = tmp_path / f"run-{seed}"
    report_dir.mkdir()
    output_path = report_dir / "output.txt"
    with open(output_path, "w") as output:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "bpsctl.cli", "run", "-np", str(np_workers), "--",
             sys.executable, str(WORKER_SCRIPT), str(report_dir), str(STEPS)],
            env=cli_env(cluster.state_dir), stdout=output, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    cluster.pids.add(launcher.pid)
    try:
        # a random point: while joining, or some steps in, part-way through a step
        if rng.random() < 0.2:
            phase = "startup"
            wait_for(lambda: len(files(report_dir, "pid")) == np_workers, 30,
                     "the workers to start")
        else:
            step = rng.randrange(4)
            phase = f"step {step}"
            wait_for(lambda: sum(s >= step for s in files(report_dir, "step").values())
                     == np_workers, 30, f"every worker to finish step {step}")
        offset_s = rng.uniform(0, 0.15)
        time.sleep(offset_s)
        phase += f" +{offset_s * 1000:.0f} ms"
        workers = files(report_dir, "pid")
        assert launcher.poll() is None, output_path.read_text()
        cluster.pids |= set(workers.values())
        slots = {slot.rank: slot.host for slot in api.worker_slots(state, np_workers)}

        must_exit = set(workers.values()) | {launcher.pid}
        stay = {p.pid for p in state.processes}
        if kind == "worker":
            victim = workers[rank]
            names = [f"worker {rank} on {slots[rank]}"]
        elif kind in ("server", "scheduler"):
            record = cluster.record(target if kind == "server" else "scheduler:0")
            victim = record.pid
            role = "the scheduler" if kind == "scheduler" else f"server {record.rank}"
            names = [f"{role} at {record.host}:{record.port}"]
            if kind == "scheduler":     # and its supervisor: nothing restarts it; servers go on
                also_killed = load_supervision(state.state_dir)["pid"]
                cluster.pids.add(also_killed)
                os.kill(also_killed, signal.SIGKILL)
            stay.discard(victim)
        else:
            victim = None
            address = host_address(cluster, host)
            names = link_names(cluster, address, slots)
            # servers cut off from the scheduler wait for it to come back (it may not); those
            # beside it go on
            scheduler_host = cluster.record("scheduler:0").host
            cut_off = {p.pid for p in state.processes if p.role == "server" and (
                p.host != scheduler_host if address == scheduler_host else p.host == address)}
            stay -= cut_off
        must_exit.discard(victim)

        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        else:
            subprocess.run(["ip", "-n", cluster.namespace(host), "link", "set",
                            emulate.HOST_INTERFACE, "down"], check=True, timeout=10)
        struck = time.monotonic()
        wait_for(lambda: all(gone(pid) for pid in must_exit), RUN_BOUND_S,
                 f"{target} ({phase}): every process to exit; output:\n{output_path.read_text()}")
        exit_s = time.monotonic() - struck
        exit_code = launcher.wait(10)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    text = " ".join(output_path.read_text().split())
    where = f"seed {seed}, {target} at {phase}"
    assert exit_s <= EXIT_WITHIN_S, f"{where}: took {exit_s:.1f} s to exit:\n{text}"
    assert exit_code != 0, f"{where}: `bpsctl run` exited 0:\n{text}"
    named = next((name for name in names if name in text), None)
    assert named is not None, f"{where}: no error names any of {names}:\n{text}"
    still = [pid for pid in stay if gone(pid)]
    assert not still, f"{where}: cluster processes {still} exited though they could go on"
    outcome = Outcome(kind, target, seed, phase, round(exit_s, 3), exit_code, named)
    OUTCOMES.append(outcome)
    return outcome


def host_address(cluster: Cluster, host: str) -> str:
    return next(h["address"] for role in ("workers", "servers")
                for h in cluster.state.emulation[role] if h["name"] == host)


def link_names(cluster: Cluster, address: str, slots: dict[int, str]) -> list[str]:
    """Texts that name what a cut of the host at ``address`` lost: its worker, its server, or
    the scheduler (as the launcher's root cause, the scheduler's verdict or a worker's error)."""
    names = []
    for rank, where in slots.items():
        if where == address:
            names += [f"worker {rank} on {address}", f"worker {rank} ({address},"]
    for p in cluster.state.processes:
        if p.host == address:
            role = "the scheduler" if p.role == "scheduler" else f"server {p.rank}"
            names += [f"{role} at {p.host}:{p.port}", f"{role} ({p.host}:{p.port},"]
    return names


@pytest.mark.timeout(60 + 90 * max(RUNS, 2))
def test_worker_kills_on_one_cluster(cluster, tmp_path):
    """A worker killed at a random point; the next run on the same cluster starts at once."""
    cluster.up()
    for index in range(max(RUNS, 2)):
        strike_run(cluster, tmp_path, "worker", index)


@pytest.mark.timeout(60 + 120 * RUNS)
@pytest.mark.parametrize("kind", ["server", "scheduler", "link"])
def test_server_scheduler_kills_and_link_cuts(cluster, tmp_path, kind):
    for index in range(RUNS):
        cluster.up()
        strike_run(cluster, tmp_path, kind, index)
        cluster.down()


@pytest.fixture(scope="module", autouse=True)
def figures():
    """Per kind: runs, max and median fault-to-exit time (printed with -s; JSON to a file)."""
    yield
    summary = {}
    for kind in ("worker", "server", "scheduler", "link"):
        times = [o.exit_s for o in OUTCOMES if o.kind == kind]
        if times:
            summary[kind] = {"runs": len(times), "max_exit_s": max(times),
                             "median_exit_s": round(statistics.median(times), 3)}
    print(f"\nfault injection (seed {SEED}): {json.dumps(summary)}")
    if REPORT_FILE:
        Path(REPORT_FILE).write_text(json.dumps(
            {"seed": SEED, "summary": summary, "runs": [asdict(o) for o in OUTCOMES]}, indent=2))
