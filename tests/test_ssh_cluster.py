"""`bpsctl up/run/status/logs/down --hosts` on emulated hosts, each with a real sshd (root only).

One network namespace per host (bpsctl.launch.emulate), one ``sshd -D`` per namespace started
by PID and stopped by PID, a throw-away client key and host key. The launcher runs inside the
``launcher`` host's namespace (the "laptop"), so it reaches the hosts only over the emulated
network, as on a real cluster.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from conftest import SSHD

from bpsctl.launch import emulate

OTHER_SSH_PORT = 2222           # every sshd listens on 22 and on this port
SSHD_READY_TIMEOUT_S = 10.0


@dataclass
class SshHosts:
    network: emulate.EmulatedNetwork
    directory: Path
    key: Path
    sshd: dict[str, subprocess.Popen] = field(default_factory=dict)
    launcher: str = ""
    host_keys: dict[str, Path] = field(default_factory=dict)    # else the shared host_key

    def address(self, name: str) -> str:
        return self.network.address(name)

    def namespace(self, name: str) -> str:
        return self.network.host(name).namespace

    def start_sshd(self, name: str) -> None:
        host = self.network.host(name)
        conf = self.directory / f"sshd-{name}.conf"
        log = self.directory / f"sshd-{name}.log"
        conf.write_text(textwrap.dedent(f"""\
            Port 22
            Port {OTHER_SSH_PORT}
            ListenAddress {host.address}
            HostKey {self.host_keys.get(name, self.directory / 'host_key')}
            PidFile {self.directory / f'sshd-{name}.pid'}
            AuthorizedKeysFile {self.directory / 'authorized_keys'}
            PermitRootLogin prohibit-password
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            UsePAM no
            StrictModes no
            Subsystem sftp internal-sftp
            """))
        log.write_text("")
        process = subprocess.Popen(self.network.command(name, [SSHD, "-D", "-e", "-f", str(conf),
                                                                "-E", str(log)]),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        self.sshd[name] = process
        deadline = time.monotonic() + SSHD_READY_TIMEOUT_S
        while "Server listening" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {name} did not start: {log.read_text()}")
            time.sleep(0.02)

    def stop_sshd(self, name: str) -> None:
        process = self.sshd.pop(name, None)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        if process is not None:
            process.wait()

    def replace_host_key(self, name: str) -> None:
        """Give ``name``'s sshd a new host key of its own, and restart it (by PID)."""
        key = self.directory / f"host_key-{name}"
        for path in (key, Path(f"{key}.pub")):
            path.unlink(missing_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
        self.stop_sshd(name)
        self.host_keys[name] = key
        self.start_sshd(name)

    def restore_host_key(self, name: str) -> None:
        """Back to the shared host key."""
        if self.host_keys.pop(name, None) is not None:
            self.stop_sshd(name)
            self.start_sshd(name)

    def pids(self, name: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespace(name)], capture_output=True,
                             text=True, check=True).stdout
        return [int(p) for p in out.split()]

    def foreign_pids(self, name: str) -> list[tuple[int, str]]:
        """Processes in the host's namespace other than its sshd (zombies do not count)."""
        sshd = self.sshd.get(name)
        found = []
        for pid in self.pids(name):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] == "Z" or (sshd and pid == sshd.pid):
                continue
            if cmdline.startswith("sshd:"):     # a session that is closing
                continue
            found.append((pid, cmdline))
        return found

    def bpsctl(self, *args: str, timeout_s: float = 90, cwd: str | None = None
               ) -> subprocess.CompletedProcess:
        """``bpsctl ARGS`` run on the launcher host."""
        argv = self.network.command(self.launcher, [sys.executable, "-m", "bpsctl.cli", *args])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)

    def hosts_yaml(self, path: Path, *, python: str | None = None, key: str | None = None,
                   servers_on: str = "s0", servers: int = 2,
                   workers: tuple[str, ...] = ("w0", "w1"), slots: int = 2, extra: str = "",
                   port: int = 9000) -> Path:
        lines = [f"ssh: {{user: root, key: {key or self.key}, connect_timeout_s: 3, retries: 1}}",
                 f"python: {python or sys.executable}",
                 f"workdir: {self.directory / 'remote'}",
                 f"scheduler: {{host: {self.address(servers_on)}, port: {port}}}",
                 "servers:",
                 f"  - {{host: {self.address(servers_on)}, count: {servers}}}",
                 "workers:"]
        lines += [f"  - {{host: {self.address(w)}, slots: {slots}, interface: eth0}}"
                  for w in workers]
        path.write_text("\n".join(lines) + "\n" + extra)
        return path


@contextlib.contextmanager
def ssh_hosts(directory: Path, workers: int = 3, servers: int = 1) -> Iterator[SshHosts]:
    """Hosts w0..w{N-1} and s0..; the last worker host is the launcher. Always torn down:
    sshds by PID, then the namespaces (which kills anything left in them)."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    str(directory / "host_key")], check=True)
    shutil.copy(directory / "id_ed25519.pub", directory / "authorized_keys")
    os.chmod(directory, 0o755)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    plan = emulate.plan_network(workers, servers)
    with emulate.emulated_network(plan) as network:
        hosts = SshHosts(network=network, directory=directory, key=key,
                         launcher=f"w{workers - 1}")
        try:
            for host in network.hosts:
                hosts.start_sshd(host.name)
            yield hosts
        finally:
            for name in list(hosts.sshd):
                hosts.stop_sshd(name)


# --------------------------------------------------------------------------- tests

import json  # noqa: E402

import pytest  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HOSTS_WITH_BPSCTL = ("w0", "w1", "s0")


@pytest.fixture(scope="module")
def cluster_hosts(tmp_path_factory):
    """w0, w1 (workers, 2 slots each), s0 (scheduler + 2 servers), w2 (the launcher)."""
    with ssh_hosts(tmp_path_factory.mktemp("sshhosts")) as hosts:
        yield hosts


@pytest.fixture
def state(tmp_path, cluster_hosts):
    """A state dir for one test; whatever the test left up is brought down afterwards."""
    state_dir = tmp_path / "state"
    yield ["--state-dir", str(state_dir)]
    if (state_dir / "cluster.json").exists():
        cluster_hosts.bpsctl("--state-dir", str(state_dir), "down")


def _nothing_left(hosts: SshHosts) -> None:
    deadline = time.monotonic() + 5
    while True:
        left = {name: hosts.foreign_pids(name) for name in HOSTS_WITH_BPSCTL}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not any(left.values()), f"left behind: {left}"


@pytest.mark.timeout(150)
def test_up_run_status_logs_down_on_three_hosts(cluster_hosts, state, tmp_path):
    hosts = cluster_hosts
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    assert up.returncode == 0, up.stderr
    assert "is up" in up.stderr

    run = hosts.bpsctl(*state, "run", "--", sys.executable, str(EXAMPLES / "push_pull.py"))
    assert run.returncode == 0, run.stderr + run.stdout
    lines = run.stdout.splitlines()
    w0, w1 = hosts.address("w0"), hosts.address("w1")
    for rank, host in enumerate([w0, w0, w1, w1]):
        assert any(line.startswith(f"[{host}:{rank}] rank {rank} of 4") and "sum 10, expected 10"
                   in line for line in lines), run.stdout

    status = hosts.bpsctl(*state, "status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    # the scheduler ranks servers in the order they register: two started together on one
    # host may take either rank, and status reports the ranks they got
    assert [(p["role"], p["host"], p["port"], p["state"]) for p in info["processes"]] == [
        ("scheduler", hosts.address("s0"), 9000, "running"),
        ("server", hosts.address("s0"), 9001, "running"),
        ("server", hosts.address("s0"), 9002, "running")]
    assert sorted(p["rank"] for p in info["processes"] if p["role"] == "server") == [0, 1]
    table = hosts.bpsctl(*state, "status")
    assert table.returncode == 0 and "running" in table.stderr

    logs = hosts.bpsctl(*state, "logs", "scheduler")
    assert logs.returncode == 0 and "serving on" in logs.stdout, logs.stderr
    worker_log = hosts.bpsctl(*state, "logs", "worker:3")
    assert "rank 3 of 4" in worker_log.stdout

    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr
    assert "stopped cluster" in down.stderr and "3 processes" in down.stderr
    _nothing_left(hosts)
    again = hosts.bpsctl(*state, "down")
    assert again.returncode == 0 and "nothing to stop" in " ".join(again.stderr.split())


@pytest.mark.timeout(150)
def test_a_spare_server_of_the_hosts_file_starts_last_and_holds_nothing(cluster_hosts, state,
                                                                        tmp_path):
    """A `servers:` entry with `spare: true`: `up` starts it after the others (so it has the
    highest rank), `status` shows it as spare, and a job runs on the other two: the spare's
    log says it freed no partition when the job ended."""
    hosts = cluster_hosts
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    s0 = hosts.address("s0")
    hosts_file.write_text(hosts_file.read_text().replace(
        "workers:", f"  - {{host: {s0}, spare: true}}\nworkers:"))
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    assert up.returncode == 0, up.stderr
    status = hosts.bpsctl(*state, "status", "--json")
    assert status.returncode == 0, status.stderr
    processes = json.loads(status.stdout)["processes"]
    assert [(p["role"], p["port"], p["state"]) for p in processes] == [
        ("scheduler", 9000, "running"), ("server", 9001, "running"),
        ("server", 9002, "running"), ("server", 9003, "spare")]
    # the spare registers after the others, so it is last; those two in either order
    assert [sorted(p["rank"] for p in processes[1:3]), processes[3]["rank"]] == [[0, 1], 2]
    run = hosts.bpsctl(*state, "run", "--", sys.executable, str(EXAMPLES / "push_pull.py"))
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.count("sum 10, expected 10") == 4, run.stdout
    deadline = time.monotonic() + 20         # the job's end reaches the servers after the run's
    while "ended; freeing" not in (logs := hosts.bpsctl(*state, "logs", "server:2").stdout):
        assert time.monotonic() < deadline, logs
        time.sleep(0.5)
    assert "freeing its 0 partitions" in logs, logs
    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr
    _nothing_left(hosts)


@pytest.mark.timeout(150)
def test_a_killed_scheduler_is_restarted_on_its_host(cluster_hosts, state, tmp_path):
    """kill -9 the scheduler of an SSH cluster: its supervisor on s0 restarts it on the same
    port, the servers register again, status shows the new pid, and a job runs."""
    hosts = cluster_hosts
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts.hosts_yaml(tmp_path / "hosts.yaml")))
    assert up.returncode == 0, up.stderr

    def scheduler() -> dict:
        info = json.loads(hosts.bpsctl(*state, "status", "--json").stdout)
        return next(p for p in info["processes"] if p["role"] == "scheduler")

    before = scheduler()
    assert before["restarts"] == 0 and before["pid"] != before["supervisor_pid"], before
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (after := scheduler())["restarts"] != 1 or after["state"] != "running":
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["pid"] != before["pid"] and after["port"] == 9000, after
    run = hosts.bpsctl(*state, "run", "--", sys.executable, str(EXAMPLES / "push_pull.py"))
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.count("sum 10, expected 10") == 4, run.stdout
    logs = hosts.bpsctl(*state, "logs", "server").stdout
    assert logs.count("registered again with the restarted scheduler") == 2, logs
    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr
    _nothing_left(hosts)


JOB_UNTIL_STOPPED = """
import os, sys, time, numpy as np, bpsctl.engine as bps
bps.init()
open(os.path.join(sys.argv[1], str(bps.rank())), "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    bps.push_pull(np.ones(1000, dtype=np.float32), name="x")
    time.sleep(0.01)
"""


@pytest.mark.timeout(150)
def test_a_server_killed_during_run_fails_it_fast_naming_the_server(cluster_hosts, state,
                                                                      tmp_path, monkeypatch):
    # fail-fast, as BPSCTL_SERVER_FAILOVER=0 asks (by default the job goes on through a lost
    # server: test_resilience.py)
    monkeypatch.setenv("BPSCTL_SERVER_FAILOVER", "0")
    hosts = cluster_hosts
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    assert up.returncode == 0, up.stderr
    cluster = json.loads((Path(state[1]) / "cluster.json").read_text())
    server = next(p for p in cluster["processes"] if p["role"] == "server" and p["rank"] == 1)
    script = tmp_path / "job.py"
    script.write_text(JOB_UNTIL_STOPPED)
    joined = tmp_path / "joined"
    joined.mkdir()
    argv = hosts.network.command(hosts.launcher, [sys.executable, "-m", "bpsctl.cli", *state,
                                                  "run", "--", sys.executable, str(script),
                                                  str(joined)])
    runner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(joined.iterdir())) < 4 and time.monotonic() < deadline:
            assert runner.poll() is None, runner.communicate()
            time.sleep(0.05)
        assert len(list(joined.iterdir())) == 4
        os.kill(server["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = runner.communicate(timeout=60)
        took_s = time.monotonic() - killed_at
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode not in (0, None)
    assert took_s < 20, f"run took {took_s:.1f} s to notice"
    assert "server 1" in err and f"{hosts.address('s0')}:{server['port']}" in err, err
    assert "root cause" in err
    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr
    _nothing_left(hosts)


@pytest.mark.timeout(150)
def test_curve_keys_reach_the_hosts_only_inside_ssh_and_private_files(cluster_hosts, state,
                                                                      tmp_path):
    """Every process derives the cluster's CURVE keys from its secret, which travels only inside
    the SSH channel (the agent's stdin JSON) into the processes' environments: never on a
    command line, never into a file on a host; the launcher keeps it in a 0600 file."""
    hosts = cluster_hosts
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file), "--security", "curve")
    assert up.returncode == 0, up.stderr
    state_dir = Path(state[1])
    state_path = state_dir / "cluster.json"
    cluster = json.loads(state_path.read_text())
    secret = cluster["secret"].encode()
    assert cluster["security"] == "curve" and len(secret) == 64
    assert state_path.stat().st_mode & 0o777 == 0o600
    assert state_dir.stat().st_mode & 0o777 == 0o700

    run = hosts.bpsctl(*state, "run", "--", sys.executable, str(EXAMPLES / "push_pull.py"))
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.count("sum 10, expected 10") == 4, run.stdout
    status = hosts.bpsctl(*state, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert {p["state"] for p in json.loads(status.stdout)["processes"]} == {"running"}

    remote = hosts.directory / "remote"
    assert [p for p in remote.rglob("*") if p.is_file() and secret in p.read_bytes()] == []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                assert secret not in (entry / "cmdline").read_bytes(), entry
    for process in cluster["processes"]:
        environ = Path(f"/proc/{process['pid']}/environ")
        assert environ.stat().st_mode & 0o777 == 0o400          # its owner's eyes only
        variables = environ.read_bytes().split(b"\0")
        assert b"BPSCTL_SECRET=" + secret in variables and b"BPSCTL_SECURITY=curve" in variables
    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr
    _nothing_left(hosts)


@pytest.mark.timeout(120)
def test_preflight_reports_a_stopped_sshd_and_a_cut_scheduler_port_together(
        cluster_hosts, state, tmp_path):
    hosts = cluster_hosts
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    w0_ns, scheduler = hosts.namespace("w0"), hosts.address("s0")
    hosts.stop_sshd("w1")
    # policy routing: only w0's traffic to the scheduler's port goes into a blackhole
    # (no netem/gact drop here); SSH to every host still works
    ip = ["ip", "-n", w0_ns]
    try:
        subprocess.run([*ip, "route", "add", "blackhole", f"{scheduler}/32", "table", "77"],
                       check=True)
        subprocess.run([*ip, "rule", "add", "to", f"{scheduler}/32", "ipproto", "tcp", "dport",
                        "9000", "table", "77"], check=True)
        up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    finally:
        subprocess.run([*ip, "rule", "del", "to", f"{scheduler}/32", "ipproto", "tcp", "dport",
                        "9000", "table", "77"])
        subprocess.run([*ip, "route", "flush", "table", "77"])
        hosts.start_sshd("w1")
    assert up.returncode == 1, up.stderr
    message = " ".join(up.stderr.split())
    assert "preflight failed on 2 host(s), nothing was started" in message
    assert (f"{hosts.address('w1')}: cannot connect over SSH to root@{hosts.address('w1')}:22"
            in message)
    assert (f"{hosts.address('w0')}: cannot open a TCP connection to the scheduler "
            f"({scheduler}) at {scheduler}:9000" in message)
    assert not (Path(state[1]) / "cluster.json").exists()
    _nothing_left(hosts)


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.mark.timeout(150)
def test_remote_python_problems_are_named_per_host(cluster_hosts, state, tmp_path):
    hosts = cluster_hosts
    s0 = hosts.address("s0")
    # -S: no site-packages, so no bpsctl; run from / so the source tree is not on the path
    no_bpsctl = _script(tmp_path / "python-without-bpsctl",
                        f"#!/bin/sh\ncd /\nexec {sys.executable} -S \"$@\"\n")
    other_version = _script(tmp_path / "python-other-version", f"""#!{sys.executable}
import runpy, sys
import bpsctl
bpsctl.__version__ = "0.0.9"
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
""")
    # bpsctl's source on the path of a Python without its dependencies
    no_deps, _ = _venv(tmp_path / "no-deps", pip=False,
                       packages=(Path(emulate.__file__).parents[1],))
    cases = [
        (no_bpsctl, "bpsctl is not installed for"),
        (no_deps, f"bpsctl is installed for {no_deps} on this host but cannot be imported: "
                  "ModuleNotFoundError: No module named '"),
        (other_version, "bpsctl 0.0.9 for"),
        ("/nonexistent/python", "/nonexistent/python: not found on this host"),
    ]
    for python, expected in cases:
        hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml", python=python)
        up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
        message = " ".join(up.stderr.split())
        assert up.returncode == 1, message
        assert f"{s0}: {expected}" in message, message
        assert "preflight failed on 3 host(s)" in message
        if python == no_deps:
            assert re.search(r"No module named '(\w+)'; use --ship \(it installs bpsctl's "
                             r"dependencies too\) or install \S+ there", message), message
    _nothing_left(hosts)


@pytest.mark.timeout(120)
def test_wrong_key_and_port_in_use(cluster_hosts, state, tmp_path):
    hosts = cluster_hosts
    s0 = hosts.address("s0")
    missing = hosts.hosts_yaml(tmp_path / "hosts.yaml", key=str(tmp_path / "no-such-key"))
    up = hosts.bpsctl(*state, "up", "--hosts", str(missing))
    assert up.returncode == 2, up.stderr
    assert "no-such-key: no such file" in " ".join(up.stderr.split())

    other_key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)],
                   check=True)
    wrong = hosts.hosts_yaml(tmp_path / "hosts.yaml", key=str(other_key))
    up = hosts.bpsctl(*state, "up", "--hosts", str(wrong))
    assert up.returncode == 1, up.stderr
    assert f"{s0}: SSH authentication failed for root@{s0}:22 with key {other_key}" in \
        " ".join(up.stderr.split())

    listener = subprocess.Popen(hosts.network.command("s0", [
        sys.executable, "-c", f"import socket, time; s = socket.create_server(('{s0}', 9001)); "
                              "print('ok', flush=True); time.sleep(60)"]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ok"
        up = hosts.bpsctl(*state, "up", "--hosts", str(hosts.hosts_yaml(tmp_path / "h.yaml")))
    finally:
        listener.kill()
        listener.wait()
    assert up.returncode == 1, up.stderr
    assert f"{s0}: port 9001 is in use on {s0}" in " ".join(up.stderr.split())
    _nothing_left(hosts)


SHIPPED_JOB = """
import runpy, sys
import bpsctl
print("bpsctl from", bpsctl.__file__, flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _base_python() -> str:
    """The interpreter this suite's Python was made from (itself, unless it is a venv's)."""
    base = getattr(sys, "_base_executable", None)
    if base and Path(base).exists():
        return base
    major, minor = sys.version_info[:2]
    return str(Path(sys.base_prefix) / "bin" / f"python{major}.{minor}")


def _venv(path: Path, *, pip: bool, packages: tuple[Path, ...] = ()) -> tuple[str, Path]:
    """A throw-away venv made from the base interpreter, however this suite's Python was
    installed (a venv's Python would base it on the system's, without the packages of either):
    the standard library only, no numpy, pyzmq or bpsctl. Its python, and its site-packages.
    --without-pip (ensurepip takes ~40 s on a loaded machine): with ``pip``, this Python's pip
    is put on its path instead, like ``packages``, by a .pth file."""
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(path)], check=True)
    python = str(path / "bin" / "python")
    site = Path(subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True, cwd="/").stdout.strip())
    if pip:
        import pip as this_pip
        packages = (*packages, Path(this_pip.__file__).parent)
    if packages:
        links = path / "linked"
        links.mkdir()
        for package in packages:
            (links / package.name).symlink_to(package)
        (site / "linked.pth").write_text(f"{links}\n")
    return python, site


def _imports(python: str, *modules: str) -> dict[str, str | None]:
    """Each module's version in ``python``, None where it cannot be imported."""
    code = ("import importlib, json, sys\nfound = {}\nfor m in sys.argv[1:]:\n"
            "    try:\n        found[m] = importlib.import_module(m).__version__\n"
            "    except ImportError:\n        found[m] = None\nprint(json.dumps(found))")
    return json.loads(subprocess.run([python, "-I", "-c", code, *modules], capture_output=True,
                                     text=True, check=True, cwd="/").stdout)


@pytest.mark.timeout(180)
def test_ship_installs_this_bpsctl_into_the_hosts_python(cluster_hosts, state, tmp_path):
    """--ship into a Python with pip and nothing else, on hosts with no route to any index:
    bpsctl and its dependencies arrive, at the versions this launcher runs."""
    import numpy
    import zmq
    hosts = cluster_hosts
    python, site = _venv(tmp_path / "venv", pip=True)
    assert _imports(python, "bpsctl", "numpy", "zmq") == {"bpsctl": None, "numpy": None,
                                                          "zmq": None}
    for name in HOSTS_WITH_BPSCTL:
        assert subprocess.run(["ip", "-n", hosts.namespace(name), "route", "show", "default"],
                              capture_output=True, text=True, check=True).stdout == ""
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml", python=python)
    # cwd tmp_path: the workers' cwd, so the source tree is not on their path
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file), "--ship", cwd=str(tmp_path),
                      timeout_s=150)
    assert up.returncode == 0, up.stderr
    assert "is up" in up.stderr, up.stderr
    # the shipped wheel, not an editable install, in the venv's own site-packages
    assert (site / "bpsctl" / "engine" / "server.py").is_file()
    dist_info = site / "bpsctl-0.1.0.dist-info"
    direct_url = json.loads((dist_info / "direct_url.json").read_text())
    assert direct_url["url"].endswith(".whl") and "dir_info" not in direct_url, direct_url
    assert not list(site.glob("__editable__*"))
    assert _imports(python, "numpy", "zmq") == {"numpy": numpy.__version__,
                                                "zmq": zmq.__version__}
    assert (site / "numpy").is_dir() and (site / "zmq").is_dir()
    assert not (site / "torch").exists()

    job = tmp_path / "job.py"
    job.write_text(SHIPPED_JOB)
    run = hosts.bpsctl(*state, "run", "--", python, str(job), str(EXAMPLES / "push_pull.py"),
                       cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr + run.stdout
    lines = run.stdout.splitlines()
    w0, w1 = hosts.address("w0"), hosts.address("w1")
    for rank, host in enumerate([w0, w0, w1, w1]):
        assert f"[{host}:{rank}] bpsctl from {site / 'bpsctl' / '__init__.py'}" in lines, \
            run.stdout
        assert any(line.startswith(f"[{host}:{rank}] rank {rank} of 4") and "sum 10, expected 10"
                   in line for line in lines), run.stdout

    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr
    _nothing_left(hosts)


@pytest.mark.timeout(120)
def test_ship_into_a_python_without_pip_fails_naming_each_host(cluster_hosts, state, tmp_path):
    hosts = cluster_hosts
    python, _ = _venv(tmp_path / "bare", pip=False)
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml", python=python)
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file), "--ship", cwd=str(tmp_path),
                      timeout_s=100)
    message = " ".join(up.stderr.split())
    assert up.returncode == 1, message
    for name in HOSTS_WITH_BPSCTL:
        assert (f"{hosts.address(name)}: --ship: pip install of bpsctl-0.1.0-py3-none-any.whl "
                f"into {python} failed (exit 1)" in message), message
    assert f"{python}: No module named pip (pip is needed for --ship)" in message, message
    assert not (Path(state[1]) / "cluster.json").exists()
    _nothing_left(hosts)


# --------------------------------------------------------------------------- host keys

def _known_keys(path: Path) -> dict[str, set[str]]:
    """known_hosts name -> the base64 keys recorded for it."""
    import paramiko
    return {name: {key.get_base64() for key in keys.values()}
            for name, keys in paramiko.HostKeys(str(path)).items()}


def _public_key(path: Path) -> str:
    return Path(f"{path}.pub").read_text().split()[1]


def _fix_from(message: str) -> list[str]:
    """The command the error says to run to accept a host's new key."""
    import re
    import shlex
    found = re.search(r"remove the old key with `(ssh-keygen -R [^`]+)`", message)
    assert found, message
    return shlex.split(found.group(1))


@pytest.mark.timeout(150)
def test_host_keys_are_trusted_on_first_use_and_a_changed_one_is_refused(cluster_hosts, state,
                                                                         tmp_path):
    hosts = cluster_hosts
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    state_dir = Path(state[1])
    known_hosts = state_dir / "known_hosts"
    w1 = hosts.address("w1")
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    assert up.returncode == 0, up.stderr
    assert known_hosts.stat().st_mode & 0o777 == 0o600
    shared = _public_key(hosts.directory / "host_key")
    assert _known_keys(known_hosts) == {hosts.address(n): {shared} for n in HOSTS_WITH_BPSCTL}
    cluster = json.loads((state_dir / "cluster.json").read_text())
    assert {w["ssh"]["known_hosts"] for w in cluster["hosts"]["workers"]} == {str(known_hosts)}
    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr

    hosts.replace_host_key("w1")
    try:
        up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
        message = " ".join(up.stderr.split())
        assert up.returncode == 1, message
        assert "preflight failed on 1 host(s), nothing was started" in message
        assert (f"{w1}: the host key of {w1} has changed: {known_hosts} has ssh-ed25519 SHA256:"
                in message), message
        fix = _fix_from(message)
        assert fix == ["ssh-keygen", "-R", w1, "-f", str(known_hosts)]
        assert not (state_dir / "cluster.json").exists()
        _nothing_left(hosts)
        assert _known_keys(known_hosts)[w1] == {shared}            # never replaced silently

        subprocess.run(fix, check=True, capture_output=True)
        up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
        assert up.returncode == 0, up.stderr
        assert _known_keys(known_hosts)[w1] == {_public_key(hosts.directory / "host_key-w1")}
        down = hosts.bpsctl(*state, "down")
        assert down.returncode == 0, down.stderr
    finally:
        hosts.restore_host_key("w1")
    _nothing_left(hosts)


@pytest.mark.timeout(120)
def test_known_hosts_of_the_hosts_file_and_another_port(cluster_hosts, state, tmp_path):
    """`ssh.known_hosts` names the user's file (kept as it was, keys added); a host on another
    port is `[host]:port` there, and a changed key's fix says so."""
    hosts = cluster_hosts
    w1 = hosts.address("w1")
    users = tmp_path / "dot-ssh" / "known_hosts"
    users.parent.mkdir()
    users.write_text("# the user's own\n")
    hosts_file = hosts.hosts_yaml(tmp_path / "hosts.yaml")
    text = hosts_file.read_text().replace("retries: 1}", f"retries: 1, known_hosts: {users}}}")
    text = text.replace(
        f"{{host: {w1}, slots: 2, interface: eth0}}",
        f"{{host: {w1}, slots: 2, interface: eth0, ssh: {{port: {OTHER_SSH_PORT}}}}}")
    hosts_file.write_text(text)
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    assert up.returncode == 0, up.stderr
    shared = _public_key(hosts.directory / "host_key")
    assert users.read_text().startswith("# the user's own\n")
    assert _known_keys(users) == {hosts.address("s0"): {shared}, hosts.address("w0"): {shared},
                                  f"[{w1}]:{OTHER_SSH_PORT}": {shared}}
    assert not (Path(state[1]) / "known_hosts").exists()
    down = hosts.bpsctl(*state, "down")
    assert down.returncode == 0, down.stderr

    hosts.replace_host_key("w1")
    try:
        up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    finally:
        hosts.restore_host_key("w1")
    message = " ".join(up.stderr.split())
    assert up.returncode == 1, message
    assert f"{w1}: the host key of [{w1}]:{OTHER_SSH_PORT} has changed: {users}" in message
    assert _fix_from(message) == ["ssh-keygen", "-R", f"[{w1}]:{OTHER_SSH_PORT}", "-f",
                                  str(users)]
    assert not (Path(state[1]) / "cluster.json").exists()
    _nothing_left(hosts)
