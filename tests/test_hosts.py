"""hosts.yaml, hostfiles and Horovod's -H: what is accepted, and errors naming file, line, key."""
from __future__ import annotations

from pathlib import Path

import pytest

from bpsctl.config import ConfigError
from bpsctl.launch.hosts import load_hosts, parse_hosts_yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["hosts.yaml", "hosts-full.yaml", "hosts-horovod.yaml",
                                  "hostfile", "hosts-mixed.yaml"])
def test_every_example_loads(name):
    hosts = load_hosts(EXAMPLES / name)
    assert hosts.workers and hosts.servers and hosts.scheduler.port == 9000


def test_design_example_roles_ports_and_order():
    hosts = load_hosts(EXAMPLES / "hosts.yaml")
    assert hosts.python == "/opt/venv/bin/python"
    assert (hosts.scheduler.host, hosts.scheduler.port, hosts.scheduler.line) == (
        "10.0.0.5", 9000, 4)
    assert [(s.host, s.count, s.port) for s in hosts.servers] == [("10.0.0.5", 2, 9001),
                                                                 ("10.0.0.6", 1, 9001)]
    assert [(w.host, w.count, w.interface) for w in hosts.workers] == [
        ("10.0.0.1", 8, "eth0"), ("10.0.0.2", 8, None)]
    assert hosts.workers[0].ssh.user == "ubuntu" and hosts.workers[0].ssh.key.endswith("id_ed25519")
    assert hosts.world_size == 16


def test_per_host_ssh_overrides_and_explicit_ports():
    hosts = load_hosts(EXAMPLES / "hosts-full.yaml")
    by_host = {s.host: s for s in hosts.servers}
    assert by_host["cpu-2"].ssh.port == 2222 and by_host["cpu-2"].ssh.user == "ubuntu"
    assert by_host["cpu-1"].port == 9100
    assert dict(hosts.env) == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_horovod_string_and_hostfile_give_colocated_defaults(tmp_path):
    hosts = load_hosts("h1:4,h2:2")
    assert [(w.host, w.count) for w in hosts.workers] == [("h1", 4), ("h2", 2)]
    assert hosts.scheduler.host == "h1" and [s.host for s in hosts.servers] == ["h1", "h2"]
    assert hosts.servers[0].port == 9001           # beside the scheduler's 9000
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# comment\n\nh1 slots=4\nh2   # one slot\n")
    hosts = load_hosts(hostfile)
    assert [(w.host, w.count, w.line) for w in hosts.workers] == [("h1", 4, 3), ("h2", 1, 4)]


def test_hostfile_referenced_from_yaml(tmp_path):
    (tmp_path / "hostfile").write_text("h1 slots=2\nh2 slots=3\n")
    (tmp_path / "hosts.yaml").write_text("python: /usr/bin/python3\n"
                                         "workers: {hostfile: hostfile}\n")
    hosts = load_hosts(tmp_path / "hosts.yaml")
    assert [(w.host, w.count) for w in hosts.workers] == [("h1", 2), ("h2", 3)]


def _error(text: str, tmp_path: Path) -> str:
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as failure:
        load_hosts(path)
    return str(failure.value)


BASE = "scheduler: {host: a}\nworkers:\n  - {host: b, slots: 2}\n"


@pytest.mark.parametrize("text, expected", [
    # missing key
    ("scheduler: {host: a}\n", "hosts.yaml: workers: missing (required)"),
    ("workers:\n  - {slots: 2}\n", ":2: workers[0].host: missing (required)"),
    # wrong type
    ("workers:\n  - {host: b, slots: four}\n",
     ":2: workers[0].slots: expected a whole number, got 'four'"),
    ("ssh: {port: '22'}\nworkers: [{host: b}]\n",
     ":1: ssh.port: expected a whole number, got '22'"),
    ("scheduler: [a]\nworkers: [{host: b}]\n", ":1: scheduler: expected a mapping such as"),
    # unknown key
    ("workers:\n  - {host: b, slot: 2}\n",
     ":2: workers[0].slot: unknown key (expected one of: host, slots"),
    ("pyhton: /usr/bin/python3\nworkers: [{host: b}]\n", ":1: pyhton: unknown key"),
    # slots: 0
    ("workers:\n  - {host: b, slots: 0}\n", ":2: workers[0].slots: expected at least 1, got 0"),
    # duplicate host and port
    (BASE + "servers:\n  - {host: a, port: 9000}\n",
     ":5: servers[0]: duplicate host and port a:9000 (also scheduler.port)"),
    (BASE + "servers:\n  - {host: c, count: 2}\n  - {host: c, port: 9002}\n",
     ":6: servers[1]: duplicate host and port c:9002 (also servers[0])"),
    (BASE + "  - {host: b}\n", ":4: workers[1].host: duplicate host b (also workers[0])"),
    # spares only
    (BASE + "servers:\n  - {host: c, spare: true}\n",
     ":4: servers: expected at least one server that is not a spare"),
    # duplicate YAML key, bad YAML, bad Horovod list
    ("workers: [{host: b}]\nworkers: [{host: c}]\n", ":2: workers: duplicate key"),
    ("workers: [{host: b}\n", "not valid YAML"),
    ("workers: 'h1:0,h2:2'\n", ":1: workers: expected Horovod's host:slots list"),
])
def test_bad_hosts_yaml_names_file_line_and_key(tmp_path, text, expected):
    message = _error(text, tmp_path)
    assert str(tmp_path / "hosts.yaml") in message
    assert expected in message, message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as failure:
        parse_hosts_yaml("ssh: {prot: 22}\nworkers:\n  - {host: b, slots: 0}\n  - {slots: 1}\n",
                         "h.yaml")
    lines = str(failure.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == ["h.yaml:1", "h.yaml:3", "h.yaml:4"]


def test_bad_hostfile_and_missing_file(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=4\nh2 slots=0\n")
    with pytest.raises(ConfigError,
                       match=r"hostfile:2: slots: expected a whole number of at least 1"):
        load_hosts(hostfile)
    hostfile.write_text("h1 cpus=4\n")
    with pytest.raises(ConfigError, match=r"hostfile:1: expected `host slots=N`"):
        load_hosts(hostfile)
    with pytest.raises(ConfigError, match="no such file"):
        load_hosts(tmp_path / "nope.yaml")


def test_spec_round_trips_through_json():
    from bpsctl.launch.hosts import HostsSpec
    hosts = load_hosts(EXAMPLES / "hosts-full.yaml")
    assert HostsSpec.from_json(hosts.to_json()) == hosts
