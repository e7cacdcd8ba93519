"""Keeping going through a lost scheduler: `bpsctl up`'s supervisor restarts it on the same
address, servers and workers register again with it, and a job that only push_pulls declared
tensors trains on meanwhile; with no scheduler coming back, what needs one fails in time,
naming it (docs/design.md, "Keeping going through a lost machine", item 4)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, exact_integer_step, gone, kill_pids, run_job, wait_until

from bpsctl.engine.common import SchedulerGone
from bpsctl.launch import api, state

HERE = Path(__file__).resolve().parent
HEARTBEAT = {"BPSCTL_HEARTBEAT_INTERVAL": "0.2", "BPSCTL_HEARTBEAT_TIMEOUT": "2",
             "BPSCTL_START_TIMEOUT": "20", "BPSCTL_SCHEDULER_TIMEOUT": "10"}


def _cli(state_dir: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(state_dir),
                           *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **HEARTBEAT})


def _status(state_dir: Path) -> dict:
    return json.loads(_cli(state_dir, "status", "--json").stdout)


def _scheduler_row(info: dict) -> dict:
    return next(p for p in info["processes"] if p["role"] == "scheduler")


def test_a_job_trains_through_a_killed_scheduler_and_status_shows_the_new_one(tmp_path):
    """kill -9 the scheduler mid-job: both workers finish every step with exact sums (some
    steps while no scheduler ran), tensors first used while it was gone and after its restart
    work, the run exits 0, `bpsctl status` shows the new scheduler restarted once, the next
    job runs, and `down` leaves nothing."""
    state_dir, report = tmp_path / "state", tmp_path / "report"
    report.mkdir()
    up = _cli(state_dir, "up", "--servers", "2")
    assert up.returncode == 0, up.stderr
    pids: list[int] = []
    try:
        before = _status(state_dir)
        pids = [p["pid"] for p in before["processes"]]
        row = _scheduler_row(before)
        pids.append(row["supervisor_pid"])
        old_pid = row["pid"]
        assert row["state"] == "running" and row["restarts"] == 0
        run = _cli(state_dir, "run", "-np", "2", "--", sys.executable,
                   str(HERE / "sched_restart_worker.py"), str(report), "150", "20", str(old_pid),
                   timeout_s=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert gone(old_pid)
        for rank in (0, 1):
            result = json.loads((report / f"{rank}.json").read_text())
            assert result["gone_steps"] >= 3, result      # trained on without a scheduler
            assert max(result["step_s"]) < 1.5, result["step_s"]
            assert result["new_tensor_s"] < 10, result
        after = _status(state_dir)
        row = _scheduler_row(after)
        pids.append(row["pid"])
        assert row["pid"] != old_pid and row["restarts"] == 1 and row["state"] == "running", row
        assert all(p["state"] == "running" for p in after["processes"] if p["role"] == "server")
        text = _cli(state_dir, "status").stderr
        assert "restarted 1 time" in text and str(row["pid"]) in text, text
        logs = _cli(state_dir, "logs", "server").stdout
        assert logs.count("registered again with the restarted scheduler") == 2, logs
        # the job ended at the restarted scheduler: the cluster takes the next one
        (tmp_path / "again").mkdir()
        again = _cli(state_dir, "run", "-np", "2", "--", sys.executable,
                     str(HERE / "sched_restart_worker.py"), str(tmp_path / "again"), "10",
                     "1000", "0", timeout_s=60)
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        down = _cli(state_dir, "down")
    assert down.returncode == 0, down.stderr
    wait_until(lambda: all(gone(pid) for pid in pids), 10, "every cluster process to exit")
    assert not state.supervision_file(state_dir).exists()


def test_without_a_restart_a_new_tensor_fails_in_time_naming_the_scheduler():
    """Restarts off: kill -9 the scheduler; push_pulls of declared tensors go on, and a new
    tensor fails within BPSCTL_SCHEDULER_TIMEOUT (+ a heartbeat) with SchedulerGone, not a
    hang; the supervisor exits with it, and `status` says so."""
    timeout_s = 2.0
    config = cluster_config(heartbeat_timeout_s=1.0, scheduler_restarts=0)
    with api.local_cluster(config, servers=1) as cluster:
        pids = [p.pid for p in cluster.processes]
        scheduler_pid = state.load_supervision(cluster.state_dir)["pid"]

        def body(worker):
            grad = np.full(1000, worker.rank + 1, np.float32)
            assert np.all(worker.push_pull(grad, name="a", average=False) == 3)
            worker.barrier()
            # a push_pull through the server completes only once both ranks have left the
            # barrier: killed earlier, the scheduler may take rank 1's release down with it
            assert np.all(worker.push_pull(grad, name="a", average=False) == 3)
            if worker.rank == 0:
                os.kill(scheduler_pid, signal.SIGKILL)
            wait_until(lambda: worker._sched_gone is not None, 5, "the scheduler's loss")
            for _ in range(5):
                assert np.all(worker.push_pull(grad, name="a", average=False) == 3)
            started = time.monotonic()
            with pytest.raises(SchedulerGone) as raised:
                worker.push_pull(grad, name="b", average=False)
            return time.monotonic() - started, str(raised.value)

        results = run_job(cluster, 2, 1, body, heartbeat_timeout_s=1.0,
                          scheduler_timeout_s=timeout_s)
        for seconds, message in results:
            assert seconds < timeout_s + 1.5, seconds
            assert f"the scheduler at {cluster.scheduler} has been gone for" in message, message
            assert "tensor 'b' cannot be declared" in message, message
        wait_until(lambda: gone(cluster.scheduler_record.pid), 5, "the supervisor to give up")
        info = api.status(cluster.state_dir)
        assert _scheduler_row(info)["state"] == "exited"
    kill_pids(pid for pid in pids if not gone(pid))
    wait_until(lambda: all(gone(pid) for pid in [*pids, scheduler_pid]), 5,
               "the cluster's processes to exit")


@pytest.mark.parametrize("spares", [0, 1])
def test_a_server_lost_while_the_scheduler_restarts_moves_once_it_is_back(spares):
    """kill -9 the scheduler and a server at once: the workers wait for a verdict on the
    server while no scheduler runs; the restarted one, not hearing from that server within
    the heartbeat timeout, moves its partitions (to the spare, with one: the workers told the
    restarted scheduler which server is spare), and every sum stays exact."""
    config = cluster_config(heartbeat_timeout_s=1.0, spare_servers=spares)
    with api.local_cluster(config, servers=3) as cluster:
        pids = [p.pid for p in cluster.processes]
        scheduler_pid = state.load_supervision(cluster.state_dir)["pid"]
        victim = next(p.pid for p in cluster.processes if p.role == "server" and p.rank == 1)

        def body(worker):
            grads = [np.zeros(16 * 1024, np.float32) for _ in range(6)]
            for step in range(30):
                if step == 10:
                    # both ranks hold every sum of step 9 first: a server killed while its last
                    # sum had reached one worker but not the other fails the job by design
                    # (docs/design.md, "Keeping going through a lost machine", item 1)
                    worker.barrier()
                    if worker.rank == 0:
                        os.kill(scheduler_pid, signal.SIGKILL)
                        os.kill(victim, signal.SIGKILL)
                exact_integer_step(worker, grads, step, prefix="g")
            return worker._servers_lost, worker._spare_servers

        results = run_job(cluster, 2, 3, body, partition_bytes=16 * 1024,
                          heartbeat_timeout_s=1.0, scheduler_timeout_s=10.0)
        assert all(result == ({1}, set()) for result in results), results
        info = api.status(cluster.state_dir)
        assert _scheduler_row(info)["restarts"] == 1
        if spares:          # the spare (rank 3) took over from server 1
            row = next(p for p in info["processes"] if p["role"] == "server" and p["rank"] == 3)
            assert row.get("took_over") == 1, info["processes"]
    kill_pids(pid for pid in [*pids, scheduler_pid] if not gone(pid))
