"""Host keys without sshd: the known_hosts file trust-on-first-use writes, and the hosts file's
``ssh.known_hosts``."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import paramiko
import pytest

from bpsctl.config import ConfigError
from bpsctl.launch import hostkeys
from bpsctl.launch.hosts import parse_hosts_yaml
from bpsctl.launch.transport import check_keys
from bpsctl.launch.types import ClusterState, HostsSpec


def _key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


def test_parallel_records_lose_no_entry_and_keep_the_rest_of_the_file(tmp_path):
    path = tmp_path / "ssh" / "known_hosts"
    path.parent.mkdir()
    path.write_text("# the user's own comment\n")
    path.chmod(0o644)
    keys = {hostkeys.known_name(f"10.0.0.{i}", 22 if i % 2 else 2222): _key() for i in range(24)}
    barrier = threading.Barrier(len(keys))

    def add(name: str) -> None:
        barrier.wait()
        hostkeys.record(path, name, keys[name])

    threads = [threading.Thread(target=add, args=(name,)) for name in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_text().startswith("# the user's own comment\n")
    assert path.stat().st_mode & 0o777 == 0o644            # an existing file keeps its mode
    known = paramiko.HostKeys(str(path))
    for name, key in keys.items():
        assert known.check(name, key), name
    assert "[10.0.0.0]:2222 ecdsa-sha2-nistp256 " in path.read_text()
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_new_file_is_private_a_known_key_is_kept_and_a_changed_one_refused(tmp_path):
    path = tmp_path / "state" / "known_hosts"
    key, other = _key(), _key()
    hostkeys.record(path, "[h1]:2222", key)
    assert path.stat().st_mode & 0o777 == 0o600
    hostkeys.record(path, "[h1]:2222", key)                # already there: unchanged
    assert len(path.read_text().splitlines()) == 1
    with pytest.raises(paramiko.BadHostKeyException) as refused:
        hostkeys.record(path, "[h1]:2222", other)
    assert paramiko.HostKeys(str(path)).check("[h1]:2222", key)
    message = hostkeys.changed_key_message(refused.value, "h1", 2222, str(path))
    assert f"the host key of [h1]:2222 has changed: {path} has ecdsa-sha2-nistp256 SHA256:" \
        in message
    assert f"`ssh-keygen -R '[h1]:2222' -f {path}`" in message


def test_an_unreadable_known_hosts_line_is_named(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("h1 ssh-ed25519 not*base64\n")
    client = paramiko.SSHClient()
    with pytest.raises(hostkeys.KnownHostsError, match="not a valid known_hosts line"):
        hostkeys.load(client, path)


HOSTS = """\
ssh: {user: u, known_hosts: ~/.ssh/known_hosts}
scheduler: {host: a, ssh: {known_hosts: /etc/ssh/ssh_known_hosts}}
workers:
  - {host: b, slots: 2, ssh: {port: 2222}}
"""


def test_known_hosts_setting_default_and_per_host_override(tmp_path):
    hosts = parse_hosts_yaml(HOSTS, "h.yaml")
    assert hosts.scheduler.ssh.known_hosts == "/etc/ssh/ssh_known_hosts"
    assert hosts.workers[0].ssh.known_hosts == str(Path.home() / ".ssh" / "known_hosts")
    assert hosts.workers[0].ssh.port == 2222
    # without the setting, `up` fills in the state dir's file, and the record keeps it
    plain = parse_hosts_yaml("workers: [{host: b}]\n", "h.yaml")
    assert plain.workers[0].ssh.known_hosts is None
    filled = plain.with_known_hosts(str(tmp_path / "known_hosts"))
    assert {e.ssh.known_hosts for e in filled.entries} == {str(tmp_path / "known_hosts")}
    assert HostsSpec.from_json(json.loads(json.dumps(filled.to_json()))) == filled
    assert hosts.with_known_hosts("/x") == hosts           # named files are kept


def test_a_cluster_recorded_before_the_setting_uses_the_state_dirs_file(tmp_path):
    spec = parse_hosts_yaml("workers: [{host: b}]\n", "h.yaml").to_json()
    for entry in (spec["scheduler"], *spec["servers"], *spec["workers"]):
        del entry["ssh"]["known_hosts"]
    record = {"name": "ssh-1", "scheduler": "b:9000", "secret": "s", "state_dir": str(tmp_path),
              "processes": [], "created": 0.0, "kind": "ssh", "hosts": spec}
    cluster = ClusterState.from_json(record)
    assert cluster.hosts is not None
    assert cluster.hosts.workers[0].ssh.known_hosts == str(tmp_path / "known_hosts")


@pytest.mark.parametrize("text, expected", [
    ("ssh: {known_hosts: 5}\nworkers: [{host: b}]\n",
     "h.yaml:1: ssh.known_hosts: expected text, got 5"),
    ("ssh: {known_hosts: ''}\nworkers: [{host: b}]\n",
     "h.yaml:1: ssh.known_hosts: must not be empty"),
    ("workers:\n  - {host: b, ssh: {known_host: x}}\n",
     ("h.yaml:2: workers[0].ssh.known_host: unknown key (expected one of: user, port, key, "
      "connect_timeout_s, retries, known_hosts)")),
])
def test_bad_known_hosts_setting_names_file_line_and_key(text, expected):
    with pytest.raises(ConfigError) as failure:
        parse_hosts_yaml(text, "h.yaml")
    assert expected in str(failure.value), str(failure.value)


def test_a_known_hosts_directory_is_a_config_error(tmp_path):
    hosts = parse_hosts_yaml(f"ssh: {{known_hosts: {tmp_path}}}\nworkers: [{{host: b}}]\n",
                             "h.yaml")
    with pytest.raises(ConfigError, match=r"h.yaml: ssh.known_hosts for b: .*: not a file") as e:
        check_keys(hosts)
    assert e.value.exit_code == 2
