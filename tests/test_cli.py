"""The ``bpsctl`` command as users run it: a process of its own, with the real engine.

Usage errors are checked in-process with typer's CliRunner (no cluster is started).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from bpsctl.cli import app
from bpsctl.cliutil import missing_python_script
from bpsctl.launch import api
from bpsctl.tune.cli import switch_given_a_value

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMAND_TIMEOUT_S = 30


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: PID 1 here does not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """A private BPSCTL_STATE_DIR; whatever cluster a test leaves in it is stopped by PID."""
    path = tmp_path / "state"
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(path))
    yield path
    cluster = api.load_state(path)
    if cluster is not None:
        api.down(path)
        for record in cluster.processes:
            if not gone(record.pid):
                os.kill(record.pid, signal.SIGKILL)


def bpsctl(*args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout_s)


def test_up_status_down(state_dir):
    up = bpsctl("up", "--servers", "2")
    assert up.returncode == 0, up.stderr
    assert "is up" in up.stderr

    status = bpsctl("status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)                     # nothing but JSON on stdout
    processes = info["processes"]
    assert info["cluster"] and info["scheduler"].startswith("127.0.0.1:")
    assert [(p["role"], p["rank"], p["state"]) for p in processes] == [
        ("scheduler", 0, "running"), ("server", 0, "running"), ("server", 1, "running")]
    assert all(p["pid"] > 0 and p["port"] > 0 and p["host"] == "127.0.0.1" for p in processes)
    # servers beside the workers on one machine: the colocated layout, and status says so
    assert [p["colocated"] for p in processes if p["role"] == "server"] == [True, True]

    human = bpsctl("status")
    assert human.returncode == 0 and human.stdout == "" and "running" in human.stderr

    logs = bpsctl("logs", "scheduler")
    assert logs.returncode == 0 and "serving on" in logs.stdout

    again = bpsctl("up")
    assert again.returncode == 1 and "bpsctl down" in again.stderr

    down = bpsctl("down")
    assert down.returncode == 0, down.stderr
    assert all(gone(p["pid"]) for p in processes)
    second_down = bpsctl("down")
    assert second_down.returncode == 0 and "no cluster" in second_down.stderr

    after = bpsctl("status", "--json")
    assert after.returncode == 0 and json.loads(after.stdout)["processes"] == []


def test_run_prefixes_each_ranks_output(state_dir):
    run = bpsctl("run", "-np", "3", "--", sys.executable, "-c",
                 "import os; print('hello from', os.environ['RANK'])")
    assert run.returncode == 0, run.stderr
    lines = sorted(run.stdout.splitlines())
    assert lines == ["[0] hello from 0", "[1] hello from 1", "[2] hello from 2"]
    assert "hello from 2" in bpsctl("logs", "worker:2").stdout


def test_run_says_what_it_starts_on_a_terminal_until_the_workers_speak(state_dir):
    """On a terminal, `run` shows a status line while the cluster and workers start, gone
    before the first worker's line; piped, it adds nothing to stdout or stderr."""
    import pty
    import select
    cmd = [sys.executable, "-m", "bpsctl.cli", "run", "-np", "2", "--", sys.executable, "-c",
           "print('hi from', __import__('os').environ['RANK'])"]
    env = {**os.environ, "COLUMNS": "150", "PYTHONPATH": str(REPO_ROOT)}
    pid, fd = pty.fork()
    if pid == 0:                                        # the child: bpsctl on a terminal
        os.execvpe(cmd[0], cmd, env)
    screen, deadline = b"", time.monotonic() + COMMAND_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:                         # the child closed the terminal
                    break
                if not data:
                    break
                screen += data
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, code = os.waitpid(pid, 0)
        os.close(fd)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    assert os.waitstatus_to_exitcode(code) == 0, text
    said = text.find("starting 2 workers of")
    assert 0 <= said < text.find("[0] hi from 0"), text
    assert "private cluster (scheduler, 1 server)" in text, text
    piped = bpsctl(*cmd[3:])
    assert piped.returncode == 0 and "starting" not in piped.stdout + piped.stderr, piped


def test_a_missing_script_is_a_usage_error_before_anything_starts(state_dir, tmp_path):
    """`run -- python nosuch.py` exits 2 (a usage error) naming the file, starting nothing;
    python's own options, -m and -c are understood, and other commands are left to run."""
    run = bpsctl("run", "-np", "2", "--", sys.executable, "-u", "nosuch.py")
    assert run.returncode == 2, run.stderr
    assert "cannot open 'nosuch.py': no such file" in run.stderr, run.stderr
    assert not (state_dir / "logs").exists()          # no cluster was started for it
    script = tmp_path / "here.py"
    script.write_text("")
    assert missing_python_script(["python3", "-X", "dev", "nosuch.py"], tmp_path) == "nosuch.py"
    assert missing_python_script(["python3", "-X", "dev", "here.py"], tmp_path) is None
    assert missing_python_script(["python", "-m", "nosuch"], tmp_path) is None
    assert missing_python_script(["python", "-c", "pass"], tmp_path) is None
    assert missing_python_script(["torchrun", "nosuch.py"], tmp_path) is None


def test_run_exits_with_the_first_failure_and_stops_the_others(state_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    worker = (
        "import os, sys, time\n"
        "rank = os.environ['RANK']\n"
        f"open(os.path.join({str(pid_dir)!r}, rank), 'w').write(str(os.getpid()))\n"
        "if rank == '1':\n"
        f"    while len(os.listdir({str(pid_dir)!r})) < 2: time.sleep(0.01)\n"
        "    print('rank 1 fails', flush=True); sys.exit(3)\n"
        "time.sleep(60)\n")
    try:
        started = time.monotonic()
        run = bpsctl("run", "-np", "2", "--", sys.executable, "-c", worker)
        assert time.monotonic() - started < 20
        assert run.returncode == 3, run.stderr
        assert "root cause" in run.stderr and "rank 1 fails" in run.stderr
        sleeper = int((pid_dir / "0").read_text())
        assert gone(sleeper)
    finally:
        for pid_file in pid_dir.iterdir():
            pid = int(pid_file.read_text())
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_stops_every_worker(state_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # each pid file appears whole (written aside, then renamed)
    worker = ("import os, time\n"
              f"path = os.path.join({str(pid_dir)!r}, os.environ['RANK'])\n"
              "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
              "os.replace(path + '.tmp', path)\n"
              "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen([sys.executable, "-m", "bpsctl.cli", "run", "-np", "2", "--",
                                 sys.executable, "-c", worker], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        def pid_files():
            return [p for p in pid_dir.iterdir() if not p.name.endswith(".tmp")]
        while len(pid_files()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pid_files()]
        assert len(pids) == 2
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=15) == 128 + signal.SIGINT
        assert all(gone(pid) for pid in pids)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid_file in pid_dir.iterdir():
            pid = int(pid_file.read_text())
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("args, flag", [
    (["up", "--bogus"], "--bogus"),
    (["run", "-np", "0", "--", "true"], "-np"),
    (["up", "--servers", "abc"], "--servers"),
    (["run", "--servers", "0", "--", "true"], "--servers"),
    (["up", "--start-timeout", "-1"], "--start-timeout"),
    (["up", "--port", "70000"], "--port"),
    (["run", "-np", "2", "--min-workers", "3", "--", "true"], "--min-workers 3"),
    (["run", "-np", "2", "--max-workers", "1", "--", "true"], "--max-workers"),
    (["logs", "servers"], "ROLE"),
])
def test_usage_errors_exit_2_and_name_the_flag(state_dir, args, flag):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert flag in result.output
    assert api.load_state(state_dir) is None


def test_bad_environment_is_a_config_error(state_dir, monkeypatch):
    monkeypatch.setenv("BPSCTL_HEARTBEAT_INTERVAL", "soon")
    result = CliRunner().invoke(app, ["up"])
    assert result.exit_code == 2 and "BPSCTL_HEARTBEAT_INTERVAL" in result.output


def test_status_without_a_cluster(state_dir):
    result = CliRunner().invoke(app, ["status", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["cluster"] is None


@pytest.mark.parametrize("error, exit_code", [
    ("bpsctl.config:ConfigError", 2), ("bpsctl.launch.emulate:EmulationUnavailable", 2),
    ("bpsctl.launch.api:LaunchError", 1), ("bpsctl.engine:EngineError", 1),
    ("bpsctl.bench.api:BenchError", 1), ("bpsctl.bench.load:LoadError", 1),
    ("bpsctl.bench.horovod:HorovodError", 1), ("bpsctl.launch.emulate:EmulationError", 1),
])
def test_every_bpsctl_error_exits_with_its_code_and_its_message_verbatim(error, exit_code, capsys):
    """One error family: the CLI catches its base once, prints the message as written (rich
    markup in it is not interpreted) and exits 2 for usage/config errors, 1 at run time."""
    import importlib

    import typer

    from bpsctl.cliutil import cli_errors
    from bpsctl.errors import BpsctlError
    module, name = error.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BpsctlError)
    with pytest.raises(typer.Exit) as exited, cli_errors():
        raise cls("worker 1 at [bold]10.0.0.1[/bold] failed")
    assert exited.value.exit_code == exit_code
    assert "worker 1 at [bold]10.0.0.1[/bold] failed" in capsys.readouterr().err


def test_a_host_that_does_not_speak_ssh_fails_preflight_in_one_message_without_tracebacks(
        tmp_path):
    """paramiko's transport thread logs a traceback when a host's port does not answer with
    an SSH banner; the user sees bpsctl's one error naming the host, and the library's record
    goes to the state dir's log (printed with --debug)."""
    import socket
    import threading
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_not_ssh() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return              # closed: the test is over
            conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=answer_not_ssh, daemon=True).start()
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"ssh: {{user: root, port: {port}, retries: 0, connect_timeout_s: 5}}\n"
                     "scheduler: {host: 127.0.0.1}\nservers:\n  - {host: 127.0.0.1}\n"
                     "workers:\n  - {host: 127.0.0.1, slots: 1}\n")
    state = tmp_path / "state"
    try:
        done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(state),
                               "up", "--hosts", str(hosts)], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, env={**os.environ, "COLUMNS": "200"})
        debug = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(state),
                                "--debug", "up", "--hosts", str(hosts)], capture_output=True,
                               text=True, timeout=COMMAND_TIMEOUT_S)
    finally:
        listener.close()
    assert done.returncode == 1, done.stderr
    assert "preflight failed on 1 host(s)" in done.stderr and "127.0.0.1" in done.stderr
    assert "Traceback" not in done.stderr and "Exception (client)" not in done.stderr, \
        done.stderr
    assert "Error reading SSH protocol banner" in (state / "bpsctl-libraries.log").read_text()
    assert debug.returncode == 1 and "Traceback" in debug.stderr, debug.stderr


def test_version_and_short_help():
    runner = CliRunner()
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("bpsctl "), version.output
    for args in (["-h"], ["bench", "comm", "-h"], ["run", "-h"]):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 0 and "Usage:" in shown.output, (args, shown.output)


# (its own deadlines, 90 s for the workers to start on a loaded machine and 60 s to stop, are
# the bounds: the module's 60 s would cut them short)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("bench", [["comm", "--workers", "2", "--size", "64MiB",
                                    "--repeats", "100000"],
                                   ["resnet50", "--iters", "100000", "--compare", "ddp"]],
                         ids=["comm", "resnet50"])
def test_ctrl_c_on_a_benchmark_stops_it_as_an_interruption_not_a_crash(tmp_path, bench):
    """A real SIGINT while a benchmark's workers run: one line saying so, exit 130, every
    process it started gone, and no folder of kept logs (nothing failed)."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "200",
           "BPSCTL_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([sys.executable, "-m", "bpsctl.cli", "bench", *bench], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started: list[psutil.Process] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            started = psutil.Process(proc.pid).children(recursive=True)
            workers = [p for p in started if _is_bench_worker(p)]
            if len(workers) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the benchmark's workers never started: {proc.communicate()}")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _stop(started)          # its private cluster runs in sessions of its own
    assert proc.returncode == 130, (out, err)
    assert "interrupted (SIGINT); stopped what was started" in err, err
    assert "failed" not in err, err
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(gone(p.pid) for p in started):
        time.sleep(0.1)
    assert all(gone(p.pid) for p in started), [p.pid for p in started if not gone(p.pid)]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("bpsctl")], \
        list(tmp_path.iterdir())


@pytest.mark.timeout(180)       # as above: its own deadlines are the bounds
def test_ctrl_c_in_a_terminal_stops_bench_load_with_one_line_and_no_traceback(tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group, so `bench load`'s
    worker processes get SIGINT too: the parent's one line, exit 130, no worker's traceback,
    nothing left running."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "200",
           "BPSCTL_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([sys.executable, "-m", "bpsctl.cli", "bench", "load", "--workers",
                             "2", "--servers", "1", "--steps", "100000", "--warmup", "10",
                             "--scale", "0.001"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        started: list[psutil.Process] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            started = psutil.Process(proc.pid).children(recursive=True)
            if len([p for p in started if _is_load_worker(p)]) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the load's workers never started: {proc.communicate()}")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _stop(started)          # its private cluster runs in sessions of its own
    assert proc.returncode == 130, (out, err)
    assert "interrupted (SIGINT); stopped what was started" in err, err
    assert "Traceback" not in out + err, err
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(gone(p.pid) for p in started):
        time.sleep(0.1)
    assert all(gone(p.pid) for p in started), [p.pid for p in started if not gone(p.pid)]


def _stop(processes: list[psutil.Process]) -> None:
    """SIGKILL to each of ``processes`` still running (a test that had to kill the command
    itself: what it started in sessions of its own outlives it)."""
    for process in processes:
        try:
            process.kill()          # psutil checks that the pid is still this process
        except psutil.Error:
            pass


def _is_load_worker(process: psutil.Process) -> bool:
    try:
        return "multiprocessing.spawn" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _is_bench_worker(process: psutil.Process) -> bool:
    try:
        return any(arg.startswith("bpsctl.bench.") for arg in process.cmdline())
    except psutil.Error:
        return False


def test_global_options_are_taken_after_the_command_too():
    from bpsctl.cli import hoist_global_options
    assert hoist_global_options(["status", "--state-dir", "/x", "--json"]) == \
        ["--state-dir", "/x", "status", "--json"]
    assert hoist_global_options(["run", "--debug", "-np", "2", "--", "python", "t.py",
                                 "--state-dir", "y"]) == \
        ["--debug", "run", "-np", "2", "--", "python", "t.py", "--state-dir", "y"]
    assert hoist_global_options(["logs", "--state-dir=/x"]) == ["--state-dir=/x", "logs"]


def test_status_takes_the_state_dir_after_the_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "status", "--state-dir",
                           str(tmp_path / "s"), "--json"], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert str(tmp_path / "s") in done.stdout + done.stderr


def _commands(command, path=()):
    """Every (path, click command) under ``command``, groups included."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_fits_80_columns_with_each_variable_name_whole():
    """At 80 columns every command's --help keeps its lines within 80 characters and shows
    each option's environment variable whole (rich's panels cut them to fit)."""
    import typer.main

    from bpsctl.cli import RICH_HELP_MIN_COLUMNS, fit_help_to
    fit_help_to(80)
    try:
        runner = CliRunner()
        checked = 0
        for path, command in _commands(typer.main.get_command(app)):
            shown = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
            assert shown.exit_code == 0, (path, shown.output)
            too_wide = [line for line in shown.output.splitlines() if len(line) > 80]
            assert not too_wide, (path, too_wide)
            flat = " ".join(shown.output.split())
            for param in command.params:
                if getattr(param, "show_envvar", False) and param.envvar and not param.hidden:
                    assert f"env var: {param.envvar}" in flat, (path, param.envvar)
                    checked += 1
        assert checked > 20
    finally:
        fit_help_to(RICH_HELP_MIN_COLUMNS)


def test_every_value_option_says_what_it_takes_and_switches_take_none():
    """No help shows typer's ``<int range>``/``<str>`` (read as if the option took a range)
    or ``()`` for an empty default; a switch shows no value; sizes are SIZE everywhere."""
    import typer.main
    runner = CliRunner()
    sizes = 0
    for path, command in _commands(typer.main.get_command(app)):
        shown = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).output
        assert not re.search(r"--[a-z-]+ <", shown), (path, shown)
        assert "default: ()" not in shown, (path, shown)
        for param in command.params:
            if getattr(param, "is_flag", False):
                assert param.metavar is None, (path, param.name)
            elif param.name in ("partition_bytes", "credit_bytes", "size"):
                assert param.metavar == "SIZE", (path, param.name)
                sizes += 1
    assert sizes >= 4


def test_a_value_after_a_tune_switch_says_why_it_is_refused():
    """`tune --partition-bytes 4MiB` (bench's --partition-bytes takes a size) exits 2 saying
    the switch names a knob to tune and how to hold it at that value instead."""
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "tune", "--partition-bytes",
                           "4MiB"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.split())
    assert "tune --partition-bytes takes no value ('4MiB')" in said, said
    assert "BPSCTL_PARTITION_BYTES=4MiB" in said, said
    assert switch_given_a_value(["tune", "--credit", "--grid"]) is None
    # the command decides: a worker script of `run` called tune is left alone
    from bpsctl.cli import tune_switch_problem
    assert tune_switch_problem(["--state-dir", "x", "tune", "--credit", "8"]) is not None
    assert tune_switch_problem(["run", "-np", "1", "--", "tune", "--credit", "8"]) is None
    assert "BPSCTL_NUM_SERVERS" in switch_given_a_value(["tune", "--server-count", "2"])


def test_the_command_line_and_the_schedulers_supervisor_start_without_numpy():
    """Every `bpsctl` call and every scheduler's supervisor is a new process: they load neither
    NumPy (and its BLAS threads) nor asyncio, which only the engine's workers and servers use.
    The engine's API still loads on first use."""
    code = ("import sys, bpsctl.cli, bpsctl.engine.supervise, bpsctl.engine as bps\n"
            "print(sorted(m for m in ('numpy', 'asyncio', 'torch') if m in sys.modules))\n"
            "assert bps._worker is None and not bps.is_initialized()\n"
            "print('numpy' in sys.modules, bps.push_pull.__module__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "True bpsctl.engine.api"]
