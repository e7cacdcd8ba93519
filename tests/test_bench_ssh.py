"""`bpsctl bench` and `bpsctl tune` on the SSH cluster `bpsctl up --hosts` started (root only).

The hosts are tests/test_ssh_cluster.py's: one network namespace and one real sshd each, the
launcher in a namespace of its own. Worker w0 has 2 slots and w1 one, so the 3 workers the
benchmarks report come from the hosts file (the default without it is 2), and a worker that ran
anywhere but on its host could not bind its host's address (DDP's MASTER_ADDR is w0's).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import pytest
from test_ssh_cluster import ssh_hosts


def _horovod_loads() -> bool:
    from bpsctl.bench.horovod import installed_version
    return installed_version() is not None


@pytest.fixture(scope="module")
def emulated_hosts(tmp_path_factory):
    with ssh_hosts(tmp_path_factory.mktemp("benchssh")) as hosts:
        yield hosts


@contextlib.contextmanager
def ssh_cluster_up(hosts, directory: Path, slots_w0: int, port: int):
    """`bpsctl up --hosts`: w0 with ``slots_w0`` worker slots, w1 with one, s0 the scheduler
    (at ``port``) and 2 servers; brought down on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    hosts_file = hosts.hosts_yaml(directory / "hosts.yaml", slots=1, port=port)
    w0 = hosts.address("w0")
    hosts_file.write_text(hosts_file.read_text().replace(
        f"{{host: {w0}, slots: 1,", f"{{host: {w0}, slots: {slots_w0},"))
    state = ["--state-dir", str(directory / "state")]
    up = hosts.bpsctl(*state, "up", "--hosts", str(hosts_file))
    assert up.returncode == 0, up.stderr
    try:
        yield state, hosts_file
    finally:
        hosts.bpsctl(*state, "down")


@pytest.fixture(scope="module")
def cluster(emulated_hosts, tmp_path_factory):
    """3 workers (w0: 2 slots, w1: 1), up once for the cheap tests."""
    with ssh_cluster_up(emulated_hosts, tmp_path_factory.mktemp("three"), 2, 9000) as (
            state, hosts_file):
        yield emulated_hosts, state, hosts_file


def _ran_on_the_cluster(hosts, report: dict, stderr: str, state: list[str]) -> None:
    """The report names the SSH cluster, and rank 0's result came relayed from w0 (only rank 0
    prints; the other ranks bind their own host's address, which exists only there): its
    record is in w0's rank-0 log, kept off the user's terminal."""
    assert report["cluster"] == "ssh" and report["hosts_file"].endswith("hosts.yaml")
    assert "BPSCTL_RESULT" not in stderr, stderr[-3000:]
    assert "BPSCTL_RESULT " in (Path(state[1]) / "logs" / "worker-0.log").read_text()
    said = " ".join(stderr.split())
    assert "SSH cluster of hosts.yaml" in said and "loopback" not in stderr
    # the path may be cut over two lines of the terminal's width
    assert f"ontheSSHclusterof{report['hosts_file']}" in "".join(stderr.split())


@pytest.mark.timeout(90)
def test_bench_comm_runs_on_the_ssh_cluster(cluster):
    hosts, state, _ = cluster
    done = hosts.bpsctl(*state, "bench", "comm", "--size", "1MiB", "--repeats", "2",
                        "--warmup", "1", "--json", "-")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["kind"], report["workers"], report["servers"]) == ("comm", 3, 2)
    assert report["nic_mbit"] is None
    assert report["size_bytes"] == 1024 * 1024
    ours = report["results"][0]
    assert ours["system"] == "bpsctl" and len(ours["seconds_all"]) == 2 and ours["seconds"] > 0
    assert ours["nic_fraction"] is None
    # raw ZeroMQ is this machine's loopback: not a figure of an SSH cluster
    assert [r["system"] for r in report["results"]] == ["bpsctl"]
    _ran_on_the_cluster(hosts, report, done.stderr, state)

    # --nic on an SSH cluster only sets the ideal that nic_fraction is measured against
    done = hosts.bpsctl(*state, "bench", "comm", "--size", "1MiB", "--repeats", "1",
                        "--warmup", "1", "--nic", "1gbit", "--json", "-")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["nic_mbit"] == 1000 and 0 < report["results"][0]["nic_fraction"]


@pytest.mark.timeout(200)
def test_bench_resnet50_compares_on_the_ssh_cluster(emulated_hosts, tmp_path):
    """One worker on each of w0 and w1 (ResNet50 on this machine's 2 cores: about 25 s a
    system), a cluster of its own beside the module's. One baseline: Horovod, whose workers
    reach the rendezvous the bench serves from outside the hosts (DDP, which needs nothing
    of the bench, is compared across hosts on the emulated cluster's test)."""
    hosts = emulated_hosts
    systems = ["horovod"] if _horovod_loads() else ["ddp"]
    with ssh_cluster_up(hosts, tmp_path, 1, 9100) as (state, _):
        started = time.monotonic()
        done = hosts.bpsctl(*state, "bench", "resnet50", "--batch-size", "2", "--warmup", "1",
                            "--iters", "1", "--compare", ",".join(systems), "--json", "-",
                            timeout_s=180)
        seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["kind"], report["model"], report["workers"]) == ("train", "resnet50", 2)
    rows = {row["system"]: row for row in report["results"]}
    assert sorted(rows) == sorted(["bpsctl", *systems, "plain"])
    assert rows.pop("plain")["workers"] == 1             # rank 0 alone on w0
    for row in rows.values():
        assert row["workers"] == 2 and row["img_per_sec"] > 0, row
    assert set(report["speedup"]) == set(systems)
    _ran_on_the_cluster(hosts, report, done.stderr, state)
    assert f"[{hosts.address('w0')}:0] bpsctl iter 1/1:" in done.stderr   # rank 0 ran on w0
    print(f"bench resnet50 on 2 SSH workers, bpsctl + {', '.join(systems)}: {seconds:.0f} s",
          file=sys.stderr)


@pytest.mark.timeout(60)
def test_flags_that_conflict_with_the_ssh_cluster_are_usage_errors(cluster):
    hosts, state, hosts_file = cluster
    done = hosts.bpsctl(*state, "bench", "comm", "--workers", "5", "--size", "1MiB")
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "--workers: the SSH cluster up in" in message and "has 3 worker slots" in message
    assert str(hosts_file) in message and "drop --workers (or give --workers 3)" in message

    done = hosts.bpsctl(*state, "bench", "resnet50", "--servers", "3")
    assert done.returncode == 2 and "has 2 servers; give at most 2" in " ".join(done.stderr.split())

    for flags, flag in ((["--emulate"], "--emulate"), (["--sweep", "workers=2,4"], "--sweep"),
                        (["--security", "none,hmac"], "--security")):
        done = hosts.bpsctl(*state, "bench", "comm", *flags, "--size", "1MiB")
        assert done.returncode == 2, (flags, done.stderr)
        assert f"drop {flag}" in " ".join(done.stderr.split()), (flags, done.stderr)


@pytest.mark.timeout(90)
def test_tune_runs_on_the_ssh_cluster(cluster, tmp_path):
    hosts, state, hosts_file = cluster
    out = tmp_path / "tuned.toml"
    done = hosts.bpsctl(*state, "tune", "--partition-bytes", "--trials", "1", "--final-passes",
                        "1", "--finalists", "1", "--size", "1MiB", "--repeats", "1", "--warmup",
                        "1", "--out", str(out), "--json", "-")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kind"] == "tune" and report["trials"] and out.exists()
    assert str(hosts_file) in json.dumps(report)     # the cluster it describes is the SSH one
