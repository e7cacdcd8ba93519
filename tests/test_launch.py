"""The embedded local cluster through its Python API, with the real engine processes."""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import gone, kill_pids, wait_until

from bpsctl.config import Config, ConfigError
from bpsctl.launch import api

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """A private BPSCTL_STATE_DIR; whatever cluster a test leaves in it is stopped by PID."""
    path = tmp_path / "state"
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(path))
    # workers inherit our environment: let them import this bpsctl even if it is not installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    yield path
    cluster = api.load_state(path)
    if cluster is not None:
        api.down(path)
        kill_pids(p.pid for p in cluster.processes)


@pytest.fixture
def config(state_dir) -> Config:
    return Config.from_env()


@pytest.fixture
def worker_pids(tmp_path):
    """Workers of the tests below write their PID here; any left running is killed."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    yield pid_dir
    kill_pids(int(p.read_text()) for p in pid_dir.iterdir())


def script(tmp_path: Path, source: str) -> list[str]:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(source))
    return [sys.executable, str(path)]


def test_up_status_down_leaves_nothing(config, state_dir):
    cluster = api.up_local(config, servers=2)
    pids = [p.pid for p in cluster.processes]
    assert [p.role for p in cluster.processes] == ["scheduler", "server", "server"]
    assert oct(api.state_file(state_dir).stat().st_mode & 0o777) == "0o600"

    info = api.status(state_dir)
    assert info["cluster"] == cluster.name and info["scheduler"] == cluster.scheduler
    assert [(p["role"], p["rank"], p["state"]) for p in info["processes"]] == [
        ("scheduler", 0, "running"), ("server", 0, "running"), ("server", 1, "running")]
    # the scheduler runs under the supervisor that `up` records in its place
    scheduler = info["processes"][0]
    assert scheduler["supervisor_pid"] == pids[0] and scheduler["restarts"] == 0
    assert psutil.Process(scheduler["pid"]).ppid() == pids[0]
    pids.append(scheduler["pid"])
    assert all(p["pid"] in pids and p["port"] > 0 for p in info["processes"])
    assert "serving on" in api.logs(state_dir, "scheduler")
    assert "server-1.log" in api.logs(state_dir, "server")

    report = api.down(state_dir)
    assert report.cluster == cluster.name and not report.survivors
    assert all(gone(pid) for pid in pids)
    assert api.load_state(state_dir) is None
    assert api.down(state_dir).cluster is None           # idempotent
    assert "serving on" in api.logs(state_dir, "scheduler")     # logs outlive the cluster


def test_up_refuses_a_second_cluster(config, state_dir):
    cluster = api.up_local(config, servers=1)
    with pytest.raises(api.LaunchError, match="bpsctl down"):
        api.up_local(config, servers=1)
    assert api.load_state(state_dir) == cluster
    assert all(not gone(p.pid) for p in cluster.processes)


def test_up_replaces_a_stale_state_file(config, state_dir):
    cluster = api.up_local(config, servers=1)
    kill_pids(p.pid for p in cluster.processes)
    wait_until(lambda: all(gone(p.pid) for p in cluster.processes), 5, "the cluster to die")
    assert [p["state"] for p in api.status(state_dir)["processes"]] == ["exited", "exited"]
    assert api.up_local(config, servers=1).name != cluster.name


def test_up_failure_names_the_process_and_stops_everything(config, state_dir):
    children_before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(api.LaunchError, match=r"scheduler .*start-timeout") as failure:
        api.up_local(config.replace(start_timeout_s=0.001), servers=1)
    assert "last lines of" in str(failure.value)
    left = [c for c in psutil.Process().children(recursive=True)
            if c.pid not in children_before and not gone(c.pid)]
    assert left == []
    assert api.load_state(state_dir) is None


def test_status_reports_a_dead_server_and_the_workers_of_a_job(config, state_dir, tmp_path):
    cluster = api.up_local(config, servers=2)
    # A job whose workers join the engine, then wait for the test to say "go".
    go_file, joined_dir = tmp_path / "go", tmp_path / "joined"
    joined_dir.mkdir()
    cmd = script(tmp_path, f"""
        import os, time, numpy as np, bpsctl.engine as bps
        bps.init()
        total = bps.push_pull(np.full(4, bps.rank() + 1.0), name="x", average=False)
        print("sum", total.tolist(), flush=True)
        open(os.path.join({str(joined_dir)!r}, str(bps.rank())), "w").close()
        deadline = time.monotonic() + 20
        while not os.path.exists({str(go_file)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        bps.shutdown()
    """)
    output = io.StringIO()
    results = []
    runner = threading.Thread(target=lambda: results.append(
        api.run_local(cmd, 2, config, stdout=output, stderr=output)))
    runner.start()
    try:
        wait_until(lambda: len(list(joined_dir.iterdir())) == 2, 20, "both workers to join")
        processes = api.status(state_dir)["processes"]
        workers = [p for p in processes if p["role"] == "worker"]
        assert [(w["rank"], w["state"]) for w in workers] == [(0, "running"), (1, "running")]
    finally:
        go_file.touch()
        runner.join(25)
    assert results and results[0].exit_code == 0, output.getvalue()
    assert "[0] sum [3.0, 3.0, 3.0, 3.0]" in output.getvalue()
    assert "[1] sum [3.0, 3.0, 3.0, 3.0]" in output.getvalue()

    server = cluster.processes[2]
    os.kill(server.pid, signal.SIGKILL)
    wait_until(lambda: gone(server.pid), 5, "the server to die")
    states = {(p["role"], p["rank"]): p["state"] for p in api.status(state_dir)["processes"]}
    assert states == {("scheduler", 0): "running", ("server", 0): "running",
                      ("server", 1): "exited"}


def test_status_reports_a_silent_server_lost(config, state_dir):
    fast_heartbeats = config.replace(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    cluster = api.up_local(fast_heartbeats, servers=1)
    server = cluster.processes[1]
    os.kill(server.pid, signal.SIGSTOP)       # alive to the OS, silent to the scheduler

    def server_state() -> str:
        return api.status(state_dir)["processes"][1]["state"]
    wait_until(lambda: server_state() == "lost", 10, "the scheduler to declare the server lost")
    started = time.monotonic()
    assert not api.down(state_dir).survivors
    assert time.monotonic() - started < 3       # a stopped process is not waited for in vain
    assert gone(server.pid)


def test_run_on_a_private_cluster_streams_prefixed_output(config, state_dir, tmp_path):
    cmd = script(tmp_path, """
        import os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "BPSCTL_RANK", "BPSCTL_WORLD_SIZE", "BPSCTL_ROLE"]
        print(" ".join(os.environ[k] for k in keys))
        print("job", os.environ["BPSCTL_JOB_ID"], os.environ["MASTER_PORT"])
        print("to stderr", file=sys.stderr)
    """)
    out, err = io.StringIO(), io.StringIO()
    result = api.run_local(cmd, 3, config, stdout=out, stderr=err)
    assert result == api.RunResult(exit_code=0)
    for rank in range(3):
        assert f"[{rank}] {rank} 3 {rank} 3 127.0.0.1 {rank} 3 worker\n" in out.getvalue()
        assert f"[{rank}] to stderr\n" in err.getvalue()
        assert "to stderr" in (state_dir / "logs" / f"worker-{rank}.log").read_text()
    job_lines = {line.split(" ", 1)[1] for line in out.getvalue().splitlines() if " job " in line}
    assert len(job_lines) == 1                          # one job id and master port for all
    assert api.load_state(state_dir) is None            # the private cluster is gone again


def test_first_failure_stops_the_others(config, state_dir, tmp_path, worker_pids):
    cmd = script(tmp_path, f"""
        import os, sys, time
        rank = int(os.environ["RANK"])
        open(os.path.join({str(worker_pids)!r}, str(rank)), "w").write(str(os.getpid()))
        if rank == 1:
            while len(os.listdir({str(worker_pids)!r})) < 3:    # everyone is running
                time.sleep(0.01)
            print("rank 1 gives up", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(60)
    """)
    api.up_local(config, servers=1)
    started = time.monotonic()
    result = api.run_local(cmd, 3, config, stdout=io.StringIO(), stderr=io.StringIO(),
                           stop_grace_s=2)
    assert time.monotonic() - started < 15
    assert result.exit_code == 3
    root_cause = result.failures[0]
    assert (root_cause.rank, root_cause.exit_code) == (1, 3)
    assert root_cause.last_lines[-1] == "rank 1 gives up"
    assert len(result.failures) == 1                    # the ranks we stopped are not failures
    for pid_file in worker_pids.iterdir():
        assert gone(int(pid_file.read_text()))


def test_a_worker_killed_by_a_signal_exits_128_plus_n(config, state_dir, tmp_path):
    cmd = script(tmp_path, """
        import os, signal
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = api.run_local(cmd, 2, config, stdout=io.StringIO(), stderr=io.StringIO())
    assert result.exit_code == 128 + signal.SIGKILL
    assert result.failures[0].signal_name == "SIGKILL"


def test_run_rejects_bad_arguments(config):
    with pytest.raises(ConfigError, match="-np"):
        api.run_local(["true"], 0, config)
    with pytest.raises(api.LaunchError, match="no-such-program"):
        api.run_local(["no-such-program"], 1, config)


def test_local_cluster_is_private_and_always_stopped(config, state_dir):
    with pytest.raises(RuntimeError, match="inside"):
        with api.local_cluster(config, servers=1) as cluster:
            assert Path(cluster.state_dir) != state_dir
            pids = [p.pid for p in cluster.processes]
            assert json.loads(api.state_file(cluster.state_dir).read_text())["name"] == cluster.name
            raise RuntimeError("inside")
    assert all(gone(pid) for pid in pids)
    assert not Path(cluster.state_dir).exists()
    assert api.load_state(state_dir) is None


def test_logs_roles(config, state_dir):
    with pytest.raises(ConfigError, match="ROLE"):
        api.logs(state_dir, "servers")
    with pytest.raises(api.LaunchError, match="no scheduler logs"):
        api.logs(state_dir, "scheduler")
    api.up_local(config, servers=2)
    assert [p.name for p in api.log_files(state_dir)] == [
        "scheduler-0.log", "server-0.log", "server-1.log"]
    assert [p.name for p in api.log_files(state_dir, "server:1")] == ["server-1.log"]


def test_logs_of_the_last_cluster_stay_readable_after_a_failed_up(config, state_dir):
    """A failed `up` (a host unreachable at preflight, say) has already moved the last
    cluster's logs aside to start its own: `bpsctl logs` still prints them, saying whose they
    are; a role that has no log names the ones that exist."""
    api.up_local(config, servers=2)
    api.down(state_dir)
    from bpsctl.launch import state
    state.rotate_logs(state_dir)            # what `up` does first, before its preflight
    assert not api.log_files(state_dir)
    text = api.logs(state_dir, "server:1")
    assert text.startswith("(the previous cluster's logs, last written ")
    assert "logs.previous/server-1.log" in text
    with pytest.raises(api.LaunchError) as failed:
        api.logs(state_dir, "server:5")
    assert "logs there: scheduler, server:0, server:1" in str(failed.value)


def test_a_state_dir_too_deep_for_a_socket_gets_one_in_tmp_named_after_it(tmp_path):
    """A Unix socket path holds at most 107 bytes: under a deep TMPDIR the scheduler's control
    socket goes to /tmp, named after the state dir, so every command finds the same one."""
    from bpsctl.launch import state
    short = tmp_path / "s"
    assert state.control_socket(short) == short / "scheduler.sock" or \
        len(str(short / "scheduler.sock")) > state.SOCKET_PATH_MAX
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = state.control_socket(deep)
    assert path.parent == Path("/tmp") and len(str(path)) <= state.SOCKET_PATH_MAX
    assert state.control_socket(deep) == path != state.control_socket(deep / "other")
