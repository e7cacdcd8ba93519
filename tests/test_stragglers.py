"""A slow machine no longer sets the pace: with backup workers a round of an averaged
push_pull completes once all but b live workers pushed it, its average is exact over the
pushes it sums, and a late worker gets the same result as everyone else and goes on in step."""
from __future__ import annotations

import io
import itertools
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, gone, kill_pids, run_job, wait_until
from typer.testing import CliRunner

from bpsctl.bench.convergence import make_task
from bpsctl.bench.report import plot_convergence
from bpsctl.bench.training import ConvergenceSettings, run_convergence
from bpsctl.cli import app
from bpsctl.config import Config, ConfigError, parse_straggler_spec
from bpsctl.engine import protocol as P
from bpsctl.launch import api, emulate
from bpsctl.launch.local import host_command

KiB = 1024
WAIT_S = 30.0           # every wait on another rank has this deadline


@pytest.fixture(scope="module")
def cluster(engine_cluster):
    """The module's scheduler and servers (conftest's engine_cluster: its jobs use one or two
    of them)."""
    return engine_cluster


def _server_logs(cluster) -> str:
    return "".join(path.read_text(errors="replace")
                   for path in Path(cluster.state_dir).rglob("server*.log"))


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(WAIT_S):
        raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")


class _Arrivals:
    """Counts ranks that reached a point; an event is set once ``needed`` have."""

    def __init__(self, needed: int):
        self.needed, self.count, self.lock = needed, 0, threading.Lock()
        self.event = threading.Event()

    def arrive(self) -> None:
        with self.lock:
            self.count += 1
            if self.count == self.needed:
                self.event.set()


def test_a_delayed_worker_is_left_out_counted_and_gets_the_same_average(cluster):
    """4 workers, 1 backup: every round averages exactly 3 pushes. At steps 3 and 4 rank 3
    pushes only after the other three have their result: that result is their mean, rank 3
    gets the same bits, its push is counted late on it and on the server, and its next push
    is in step. Every other round's result is the exact mean of some 3 ranks' values (which 3
    may differ by partition), the same on every rank, and each round has exactly one push
    left out."""
    steps, slow_steps, slow_rank = 8, (3, 4), 3
    # rank 3 waits for each slow step explicitly: otherwise, after its late step 3 it may
    # push step 4 before a preempted rank of the others does, and be one of step 4's three
    others_done = {step: _Arrivals(3) for step in slow_steps}
    sizes = (48 * KiB // 4, 1000)           # several partitions, and a small one

    def body(worker):
        grads = [np.zeros(n, np.float32) for n in sizes]
        seen = []
        for step in range(steps):
            for grad in grads:
                grad[:] = float(2 ** worker.rank * (step + 1))     # rank r: 2^r (step + 1)
            if step in slow_steps and worker.rank == slow_rank:
                _wait(others_done[step].event, f"ranks 0-2 to receive step {step}'s result")
            handles = [worker.push_pull_async(g, name=f"grad{i}", out=g)
                       for i, g in enumerate(grads)]
            for handle in handles:
                worker.synchronize(handle, WAIT_S)
            seen.append([grad.copy() for grad in grads])
            if step in slow_steps and worker.rank != slow_rank:
                others_done[step].arrive()
        return seen, worker.stats(), len(worker._parts)

    results = run_job(cluster, 4, 2, body, partition_bytes=16 * KiB, backup_workers=1)
    parts = results[0][2]
    assert parts > len(sizes)
    three = np.float32(3)
    for step in range(steps):
        for rank in range(1, 4):
            for mine, theirs in zip(results[rank][0][step], results[0][0][step], strict=True):
                assert np.array_equal(mine, theirs), (rank, step)
        # each partition (its own round) holds the exact mean of some three ranks' values
        means = {np.float32(sum(2 ** r for r in chosen) * (step + 1)) / three
                 for chosen in itertools.combinations(range(4), 3)}
        for grad in results[0][0][step]:
            assert set(np.unique(grad).tolist()) <= {float(m) for m in means}, step
    for step in slow_steps:                     # the mean of ranks 0-2: 1 + 2 + 4
        expected = np.float32(7 * (step + 1)) / three
        assert all(np.all(grad == expected) for grad in results[slow_rank][0][step]), step
    late = [results[rank][1]["late_pushes"] for rank in range(4)]
    assert sum(late) == steps * parts, late        # 4 pushes a round, 3 summed
    assert late[slow_rank] >= 2 * parts
    wait_until(lambda: "pushes came after their round was complete" in _server_logs(cluster),
               10, "the servers to log the job's late pushes")


def test_a_sum_waits_for_every_worker_under_backup_workers(cluster):
    """average=False (broadcasts, integer sums) never completes without a worker: the other
    ranks' averaged push_pull completes without rank 2, their sum does not until it pushes,
    and then holds every rank's contribution."""
    averaged = _Arrivals(2)
    release = threading.Event()

    def body(worker):
        ints = np.full(1000, worker.rank + 1, np.int32)
        floats = np.full(1000, float(worker.rank + 1), np.float32)
        if worker.rank == 2:
            _wait(release, "the other ranks to check their sum is still open")
        total = worker.push_pull_async(ints, name="sum", average=False)
        mean = worker.push_pull(floats, name="mean")
        if worker.rank != 2:
            open_after_mean = not total.done()       # same server, pushed before the mean
            averaged.arrive()
            if worker.rank == 0:
                _wait(averaged.event, "ranks 0 and 1 to have their mean")
                release.set()
        else:
            open_after_mean = None
        return worker.synchronize(total, WAIT_S).copy(), mean.copy(), open_after_mean

    results = run_job(cluster, 3, 1, body, backup_workers=1)
    for rank in (0, 1):
        total, mean, open_after_mean = results[rank]
        assert open_after_mean, "the sum completed without rank 2"
        assert np.all(mean == np.float32(1.5))          # ranks 0 and 1 only
        assert np.all(total == 6)                        # 1 + 2 + 3
    assert np.all(results[2][0] == 6)
    assert np.all(results[2][1] == np.float32(1.5))     # late: the others' mean


def test_without_backup_workers_every_push_is_summed(cluster):
    """The default (0) waits for every worker: averages over all four, nothing counted late."""
    def body(worker):
        grad = np.full(3000, float(worker.rank), np.float32)
        out = [worker.push_pull(grad, name="g").copy() for _ in range(3)]
        return out, worker.stats()["late_pushes"]

    for out, late in run_job(cluster, 4, 2, body, partition_bytes=4 * KiB):
        assert late == 0
        assert all(np.all(o == np.float32(1.5)) for o in out)


def test_a_late_push_is_flagged_as_late_on_the_wire():
    """FLAG_LATE and FLAG_BACKUP are distinct bits of the header's flags."""
    flags = [P.FLAG_HOST_REDUCED, P.FLAG_TRACED, P.FLAG_COMPRESSED, P.FLAG_BACKUP, P.FLAG_LATE]
    assert len(set(flags)) == len(flags) and all(f & (f - 1) == 0 for f in flags)


@pytest.mark.parametrize("args, env, message", [
    (["run", "-np", "2", "--backup-workers", "2", "--", "true"], {},
     "--backup-workers / BPSCTL_BACKUP_WORKERS: expected 0..1 (fewer than the job's 2 "
     "workers), got 2"),
    (["run", "-np", "1", "--", "true"], {"BPSCTL_BACKUP_WORKERS": "1"},
     "--backup-workers / BPSCTL_BACKUP_WORKERS: expected 0 (a job of one worker has no "
     "backup), got 1"),
    (["run", "-np", "3", "--backup-workers", "-1", "--", "true"], {},
     "--backup-workers / BPSCTL_BACKUP_WORKERS: expected 0..2 (fewer than the job's 3 "
     "workers), got -1"),
    (["bench", "comm", "--workers", "2", "--backup-workers", "2"], {},
     "--backup-workers / BPSCTL_BACKUP_WORKERS: expected 0..1 (fewer than the job's 2 "
     "workers), got 2"),
    (["bench", "resnet50", "--workers", "3", "--backup-workers", "3"], {},
     "--backup-workers / BPSCTL_BACKUP_WORKERS: expected 0..2 (fewer than the job's 3 "
     "workers), got 3"),
])
def test_a_backup_worker_count_out_of_range_exits_2(tmp_path, monkeypatch, args, env, message):
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BPSCTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "state" / "cluster.json").exists()


# --------------------------------------------------------------------------- a slow CPU on purpose

def test_the_straggler_flag_takes_a_nic_and_a_cpu_factor_for_one_rank():
    assert parse_straggler_spec("1:0.25,1:cpu=0.5,2:cpu=1.5") == ({1: 0.25}, {1: 0.5, 2: 1.5})
    plan = emulate.plan_network(3, 1, "1gbit", cluster_id="plan1", hostname="h",
                                slow={1: 0.25}, slow_cpu={1: 0.5})
    assert plan.host("w1").nic_mbit == 250 and plan.host("w1").cpu_factor == 0.5
    assert plan.host("w0").cpu_factor is None and plan.host("s0").cpu_factor is None
    for text in ("1:cpu=0", "1:cpu=fast", "1:cpu=0.5,1:cpu=0.2", "-1:cpu=0.5"):
        with pytest.raises(ConfigError, match="--straggler"):
            parse_straggler_spec(text)
    with pytest.raises(ConfigError, match="worker 3 does not exist"):
        emulate.plan_network(3, 1, None, cluster_id="plan2", hostname="h", slow_cpu={3: 0.5})


def test_a_cpu_for_every_worker_host_takes_a_stragglers_factor_of_it():
    plan = emulate.plan_network(3, 1, "1gbit", cluster_id="plan3", hostname="h",
                                slow_cpu={1: 0.5}, host_cpu=0.25)
    assert [plan.host(f"w{r}").cpu_factor for r in range(3)] == [0.25, 0.125, 0.25]
    assert plan.host("s0").cpu_factor is None          # the servers' CPU hosts are not limited
    for value in (-1, 0.001, 100):
        with pytest.raises(ConfigError, match="BPSCTL_HOST_CPU: expected 0 .no limit. or 0.01 "
                                              "to 64 CPUs"):
            Config(host_cpu=value)


def test_every_emulated_worker_host_runs_in_a_cgroup_of_its_cpu():
    """BPSCTL_HOST_CPU (what `bench --replay --target-cpu` sets): each worker host's cgroup
    allows that share of one CPU, a CPU straggler's its factor of it; the CPU hosts of the
    servers are not limited, and the cgroups are gone after the cluster is."""
    config = cluster_config(emulate=True, host_cpu=0.8, straggler="1:cpu=0.25")
    with api.local_cluster(config, servers=1, workers=2) as cluster:
        pids = [p.pid for p in cluster.processes]
        hosts = cluster.emulation["workers"]
        assert [h["cpu"] for h in hosts] == [0.8, 0.2]
        cgroups = [Path(h["cgroup"]) for h in hosts]
        quotas = [(c / "cpu.max" if (c / "cpu.max").exists() else c / "cpu.cfs_quota_us")
                  .read_text().split()[0] for c in cgroups]      # cgroup v2, else v1
        assert quotas == ["80000", "20000"]
        assert not any("cgroup" in h for h in cluster.emulation["servers"])
    kill_pids(pid for pid in pids if not gone(pid))
    assert not any(c.exists() for c in cgroups)


def test_a_cpu_straggler_host_runs_its_processes_in_a_throttled_cgroup():
    """`--straggler 1:cpu=0.2` on an emulated cluster: what runs on worker 1's host is in a
    cgroup that allows a fifth of one CPU (a busy loop there is throttled), worker 0's host
    is not limited, and the cgroup is gone after the cluster is."""
    config = cluster_config(emulate=True, straggler="1:cpu=0.2")
    with api.local_cluster(config, servers=1, workers=2) as cluster:
        pids = [p.pid for p in cluster.processes]
        slow, fast = cluster.emulation["workers"][1], cluster.emulation["workers"][0]
        cgroup = Path(slow["cgroup"])
        assert "cgroup" not in fast and cgroup.is_dir()
        spin = [sys.executable, "-c", "import time\nt = time.monotonic()\n"
                "while time.monotonic() - t < 0.5: pass\n"
                "print(open('/proc/self/cgroup').read())"]
        done = subprocess.run([*host_command(cluster, slow["address"]), *spin],
                              capture_output=True, text=True, timeout=30, check=True)
        assert cgroup.name in done.stdout
        throttled = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
        assert int(throttled["nr_throttled"]) > 0, throttled
        free = subprocess.run([*host_command(cluster, fast["address"]), *spin],
                              capture_output=True, text=True, timeout=30, check=True)
        assert cgroup.name not in free.stdout
    kill_pids(pid for pid in pids if not gone(pid))
    assert not cgroup.exists()


# --------------------------------------------------------------------------- time to accuracy

@pytest.mark.parametrize("compare, message", [
    ("sync,horovod", "--compare: 'horovod' is not a system of bench convergence; choose from "
                     "sync, backup, stale, async, ddp"),
])
def test_convergence_refuses_systems_it_does_not_have(tmp_path, monkeypatch, compare, message):
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BPSCTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    result = CliRunner().invoke(app, ["bench", "convergence", "--compare", compare])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_the_convergence_task_is_the_same_everywhere_and_learnable():
    """The teacher's task is a pure function of its seed, and its classes are all used."""
    import torch
    first, again = make_task(3, 8, 4, 256, 64), make_task(3, 8, 4, 256, 64)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert len(torch.unique(first[1])) == 4
    assert not torch.equal(first[1], make_task(4, 8, 4, 256, 64)[1])


def test_every_system_reaches_its_target_accuracy(tmp_path):
    """`bench convergence --compare sync,backup,stale,async,ddp` on the embedded cluster,
    tiny sizes: every system reaches the target, and the report and plot say so."""
    settings = ConvergenceSettings(workers=2, servers=1, target=0.75, max_steps=600,
                                   compare=("sync", "backup", "stale", "async", "ddp"),
                                   train=1024, test=256, batch_size=16, timeout_s=240)
    report = run_convergence(Config(start_timeout_s=60), settings, output=io.StringIO())
    assert [row["system"] for row in report["results"]] == ["sync", "backup", "stale", "async",
                                                            "ddp"]
    for row in report["results"]:
        assert row["reached"] and row["final_accuracy"] >= 0.75, row
        assert 0 < row["steps"] <= 600 and row["seconds"] > 0
        assert row["curve"][-1]["accuracy"] == row["final_accuracy"]
    assert "backup workers" in report["results"][1]["version"]
    assert "staleness 2" in report["results"][2]["version"]
    assert "asynchronous" in report["results"][3]["version"]
    assert report["all_reached"] and report["backup_workers"] == 1 and report["staleness"] == 2
    plot_convergence(report, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
