"""The role plan: a pure function from hosts to ranks, ports and environment."""
from __future__ import annotations

from bpsctl.config import Config
from bpsctl.launch.hosts import parse_hosts_yaml
from bpsctl.launch.plan import plan

HOSTS = parse_hosts_yaml("""
scheduler: {host: s, port: 7000}
servers:
  - {host: s, count: 2}
  - {host: t}
workers:
  - {host: b, slots: 3}
  - {host: a, slots: 1}
  - {host: c, slots: 2, address: 10.0.0.3}
""", "h.yaml")


def test_ranks_follow_the_file_with_several_slots_per_host():
    p = plan(HOSTS)
    assert [(w.host, w.rank, w.local_rank, w.local_size) for w in p.workers] == [
        ("b", 0, 0, 3), ("b", 1, 1, 3), ("b", 2, 2, 3), ("a", 3, 0, 1),
        ("c", 4, 0, 2), ("c", 5, 1, 2)]
    assert p.world_size == 6


def test_ports_and_addresses():
    p = plan(HOSTS, addresses={"b": "10.0.0.2"})
    assert (p.scheduler.host, p.scheduler.port) == ("s", 7000)
    assert p.scheduler_address == "s:7000"
    assert [(s.host, s.port) for s in p.servers] == [("s", 7001), ("s", 7002), ("t", 7001)]
    assert [w.address for w in p.workers] == ["10.0.0.2"] * 3 + ["a", "10.0.0.3", "10.0.0.3"]
    assert p.master_addr == "10.0.0.2"


def test_worker_environment_has_bpsctl_and_torch_variables():
    p = plan(HOSTS, Config(partition_bytes=1 << 20), secret="s3cret", job_id="j1",
             addresses={"b": "10.0.0.2"})
    env = p.workers[4].to_env(Config(partition_bytes=1 << 20), p)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    assert env["BPSCTL_SCHEDULER"] == "s:7000" and env["BPSCTL_SECRET"] == "s3cret"
    assert env["BPSCTL_HOST"] == "10.0.0.3" and env["BPSCTL_JOB_ID"] == "j1"
    assert env["BPSCTL_PARTITION_BYTES"] == str(1 << 20)
    # what a worker process reads back is exactly its place in the job
    seen = Config.from_env(env)
    assert (seen.rank, seen.world_size, seen.local_rank, seen.local_size) == (4, 6, 0, 2)


def test_server_environment_binds_its_planned_port():
    p = plan(HOSTS, secret="x")
    env = p.servers[1].to_env(Config(), p)
    seen = Config.from_env(env)
    assert (seen.role, seen.port, seen.host, seen.scheduler) == ("server", 7002, "s", "s:7000")
    assert "RANK" not in env


def test_plan_is_pure():
    assert plan(HOSTS, secret="x") == plan(HOSTS, secret="x")


def test_a_spare_entry_starts_spare_servers():
    hosts = parse_hosts_yaml("""
scheduler: {host: s, port: 7000}
servers:
  - {host: s, count: 2}
  - {host: t, spare: true}
workers: [{host: b}]
""", "h.yaml")
    p = plan(hosts, secret="x")
    seen = [Config.from_env(s.to_env(Config(), p)) for s in p.servers]
    assert [(s.host, s.port, s.spare) for s in seen] == [
        ("s", 7001, False), ("s", 7002, False), ("t", 7001, True)]
