"""BytePS's optimal layout: servers on the worker hosts and on CPU-only hosts at once, each
summing its share of the bytes. The rule (pure), the hosts files and launchers that plan it,
the scheduler that places by it, and an emulated 4 + 2 cluster that runs it (root)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, kill_pids, run_job, wait_until
from typer.testing import CliRunner

from bpsctl.cli import app
from bpsctl.config import Config, ConfigError
from bpsctl.launch import api
from bpsctl.launch.hosts import load_hosts, parse_hosts_yaml
from bpsctl.launch.k8s import K8sJob, render_manifests
from bpsctl.launch.plan import layout, plan
from bpsctl.launch.slurm import Allocation, allocation_hosts
from bpsctl.model import (
    Layout,
    goodput_bytes_s,
    job_shares,
    optimal_shares,
    plan_layout,
    pure_round_factor,
    round_seconds,
    summation_split,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


# --------------------------------------------------------------------------- the rule

def _factor(workers: list[str], servers: list[str], shares: list[float],
            rates: dict[str, float] | None = None) -> float:
    """The modelled round in units of S/R (R = 1000 Mbit, the default rate)."""
    return round_seconds(goodput_bytes_s(1000), workers, servers, 1000, shares, rates)


@pytest.mark.parametrize("n, k", [(n, k) for n in range(1, 9) for k in range(0, 10)])
def test_the_computed_shares_are_bytepss_formula_and_no_split_is_faster(n, k):
    workers, cpus = [f"w{i}" for i in range(n)], [f"c{i}" for i in range(k)]
    model = plan_layout(workers, cpus + workers)
    x, y, factor = summation_split(n, k)
    if 1 < n and k <= n:        # the closed form of the issue: x = 2(n-1)/(n²+kn-2k) ...
        assert x == pytest.approx(2 * (n - 1) / (n * n + k * n - 2 * k))
        assert y == pytest.approx((n - k) / (n * n + k * n - 2 * k))
        assert factor == pytest.approx(n * x)
    assert model.shares == pytest.approx([x] * k + [y] * n)
    assert sum(model.shares) == pytest.approx(1)
    assert model.round_factor() == pytest.approx(factor)
    # a brute-force search over every split (each CPU host x, each worker host y, the rest
    # uneven among the worker hosts) finds nothing faster
    best = min(
        _factor(workers, cpus + workers,
                [cpu] * k + [(1 - k * cpu) * (1 + lean) / n] * (n - 1)
                + [(1 - k * cpu) * (1 - (n - 1) * lean) / n])
        for cpu in np.linspace(0, 1 / k if k else 0, 41)
        for lean in np.linspace(0, 1 / (n - 1) if n > 1 else 0, 6))
    assert model.round_factor() <= best + 1e-9


def test_the_pure_layouts_and_the_issues_example():
    model = plan_layout([f"w{i}" for i in range(4)], ["c0", "c1"] + [f"w{i}" for i in range(4)])
    assert model.shares == pytest.approx([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    assert model.round_factor() == pytest.approx(1.2)
    assert pure_round_factor(4, 0) == pytest.approx(1.5)       # colocated only, allreduce's
    assert pure_round_factor(4, 2) == pytest.approx(2.0)       # the CPU hosts alone
    assert pure_round_factor(4, 4) == pytest.approx(1.0)
    assert "1.20 S/R" in model.describe()


@pytest.mark.parametrize("seed", range(12))
def test_at_unequal_nic_rates_no_split_beats_the_solved_one(seed):
    rng = random.Random(seed)
    n, k = rng.randint(2, 6), rng.randint(0, 4)
    workers, cpus = [f"w{i}" for i in range(n)], [f"c{i}" for i in range(k)]
    colocated = [rng.random() < 0.8 for _ in range(n)]
    if not k and not any(colocated):
        colocated[0] = True
    servers = cpus + [w for w, c in zip(workers, colocated, strict=True) if c]
    rates = {host: rng.choice([1000.0, 2500.0, 10_000.0]) for host in workers + cpus}
    worker_shares, cpu_shares, per_byte = optimal_shares(
        [rates[w] for w in workers], colocated, [rates[c] for c in cpus])
    shares = cpu_shares + [s for s, c in zip(worker_shares, colocated, strict=True) if c]
    assert sum(shares) == pytest.approx(1)
    size = goodput_bytes_s(1)           # rates in Mbit/s: per_byte·S is the round in seconds
    solved = round_seconds(size, workers, servers, 1, shares, rates)
    assert solved == pytest.approx(per_byte)
    for _ in range(400):
        guess = [rng.random() ** 3 for _ in servers]
        total = sum(guess)
        assert solved <= round_seconds(size, workers, servers, 1,
                                       [g / total for g in guess], rates) + 1e-9


def test_a_hosts_servers_split_its_share_and_the_knob_and_given_shares_win():
    model = plan_layout(["w0", "w1", "w2"], ["c0", "c0", "w0", "w1", "w2"])
    x, y, _ = summation_split(3, 1)
    assert model.shares == pytest.approx([x / 2, x / 2, y, y, y])
    knob = plan_layout(["w0", "w1"], ["c0", "w0", "w1"], cpu_share=0.5)
    assert knob.shares == pytest.approx([0.5, 0.25, 0.25]) and knob.source == "BPSCTL_CPU_SHARE"
    given = plan_layout(["w0", "w1"], ["c0", "w0", "w1"], given=[0.2, 0.2, 0.6])
    assert given.shares == pytest.approx([0.2, 0.2, 0.6]) and given.source == "hosts file"
    assert Layout.from_json(json.loads(json.dumps(model.to_json()))) == model


def test_a_jobs_shares_the_knob_then_the_registered_ones_then_even():
    colocated = [False, False, True, True]
    assert job_shares([0.3, 0.3, 0.2, 0.2], colocated, None) == pytest.approx(
        [0.3, 0.3, 0.2, 0.2])
    assert job_shares([0.3, 0.3, 0.2, 0.2], colocated, 1.0) == pytest.approx([0.5, 0.5, 0, 0])
    assert job_shares([0.3, 0.3, 0.2, 0.2], colocated, 0.0) == pytest.approx([0, 0, 0.5, 0.5])
    # a job using 3 of them rescales what they registered; one without a share: even
    assert job_shares([0.3, 0.3, 0.2], colocated[:3], None) == pytest.approx([0.375, 0.375, 0.25])
    assert job_shares([0.3, None, 0.2], colocated[:3], None) == pytest.approx([1 / 3] * 3)
    # servers of one kind only: the knob has nothing to split
    assert job_shares([None, None], [True, True], 0.7) == pytest.approx([0.5, 0.5])


def test_a_bad_cpu_share_is_refused_naming_the_knob():
    for bad in ("1.5", "-0.1", "half", "nan"):
        with pytest.raises(ConfigError, match="BPSCTL_CPU_SHARE: expected auto or the share"):
            Config.from_env({"BPSCTL_CPU_SHARE": bad})
    assert Config.from_env({"BPSCTL_CPU_SHARE": "0.6"}).cpu_share_value == 0.6
    assert Config().cpu_share_value is None


# --------------------------------------------------------------------------- hosts and plans

MIXED = """\
workers:
  - {host: g0, slots: 2}
  - {host: g1, slots: 2}
  - {host: g2, slots: 2}
  - {host: g3, slots: 2}
servers:
  - {host: c0}
  - {host: c1}
  - {host: g0}
  - {host: g1}
  - {host: g2}
  - {host: g3}
  - {host: c2, spare: true}
"""


def test_a_hosts_file_with_servers_on_worker_and_cpu_hosts_plans_the_optimum():
    the_plan = plan(parse_hosts_yaml(MIXED, "hosts.yaml"), secret="s")
    servers = the_plan.servers
    assert [(a.host, a.colocated) for a in servers] == [
        ("c0", False), ("c1", False), ("g0", True), ("g1", True), ("g2", True), ("g3", True),
        ("c2", False)]
    assert [a.share for a in servers] == pytest.approx([0.3, 0.3, 0.1, 0.1, 0.1, 0.1, None])
    env = servers[0].to_env(Config(), the_plan)
    assert (env["BPSCTL_SERVER_SHARE"], env["BPSCTL_SERVER_COLOCATED"]) == ("0.3", "False")
    assert servers[2].to_env(Config(), the_plan)["BPSCTL_SERVER_COLOCATED"] == "True"
    assert servers[6].to_env(Config(), the_plan)["BPSCTL_SERVER_SHARE"] == "-1.0"   # a spare
    assert the_plan.layout is not None and the_plan.layout.round_factor() == pytest.approx(1.2)
    # the knob overrides the model
    knob = plan(parse_hosts_yaml(MIXED, "hosts.yaml"), Config(cpu_share="0.4"), secret="s")
    assert [a.share for a in knob.servers][:6] == pytest.approx([0.2, 0.2, 0.15, 0.15, 0.15,
                                                                 0.15])


def test_the_mixed_example_plans_bytepss_split():
    hosts = load_hosts(REPO_ROOT / "examples" / "hosts-mixed.yaml")
    assert layout(hosts).shares == pytest.approx([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    assert layout(hosts).round_factor() == pytest.approx(1.2)


def test_nic_rates_and_shares_of_the_hosts_file_are_used():
    text = textwrap.dedent("""\
        workers:
          - {host: g0, nic: 10gbit}
          - {host: g1, nic: 10gbit}
          - {host: g2, nic: 10gbit}
        servers:
          - {host: c0, nic: 25gbit}
          - {host: g0}
          - {host: g1}
          - {host: g2}
    """)
    hosts = parse_hosts_yaml(text, "hosts.yaml")
    model = layout(hosts)
    worker_shares, cpu_shares, _ = optimal_shares([10_000.0] * 3, [True] * 3, [25_000.0])
    assert model.shares == pytest.approx(cpu_shares + worker_shares)
    given = text.replace("nic: 25gbit}", "nic: 25gbit, share: 0.4}").replace(
        "{host: g0}", "{host: g0, share: 0.2}").replace(
        "{host: g1}", "{host: g1, share: 0.2}").replace("{host: g2}", "{host: g2, share: 0.2}")
    assert layout(parse_hosts_yaml(given, "hosts.yaml")).shares == pytest.approx(
        [0.4, 0.2, 0.2, 0.2])
    # two servers of one entry split its share
    two = "workers: [{host: g0}, {host: g1}]\nservers:\n  - {host: c0, count: 2, share: 0.5}\n" \
          "  - {host: g0, share: 0.25}\n  - {host: g1, share: 0.25}\n"
    assert [a.share for a in plan(parse_hosts_yaml(two, "h.yaml")).servers] == pytest.approx(
        [0.25, 0.25, 0.25, 0.25])


@pytest.mark.parametrize("text, message", [
    ("workers: [{host: a}, {host: b}]\nservers:\n  - {host: a, share: -0.5}\n",
     "hosts.yaml:3: servers[0].share: expected at least 0.0, got -0.5"),
    ("workers: [{host: a}]\nservers:\n  - {host: a, share: 1.5}\n",
     "hosts.yaml:3: servers[0].share: expected at most 1.0, got 1.5"),
    ("workers: [{host: a}]\nservers:\n  - {host: a, share: lots}\n",
     "hosts.yaml:3: servers[0].share: expected a number, got 'lots'"),
    ("workers: [{host: a}, {host: b}]\nservers:\n  - {host: a, share: 0.5}\n  - {host: c}\n",
     "hosts.yaml:4: servers[1].share: missing; give every server entry but the spares a share:"),
    ("workers: [{host: a}, {host: b}]\nservers:\n  - {host: a, share: 0.5}\n"
     "  - {host: c, share: 0.2}\n",
     "hosts.yaml:2: servers: the shares sum to 0.7; expected 1"),
    ("workers: [{host: a}]\nservers:\n  - {host: a, share: 1}\n"
     "  - {host: c, spare: true, share: 0.2}\n",
     "hosts.yaml:4: servers[1].share: a spare takes the share of the server it replaces"),
    ("workers: [{host: a, nic: 1gbit}, {host: b}]\nservers:\n  - {host: c}\n",
     "hosts.yaml:1: workers[1].nic: missing for b; the layout model needs every worker and "
     "server host's NIC rate"),
    ("workers: [{host: a, nic: fast}]\n",
     "hosts.yaml:1: workers[0].nic: expected a rate such as 500mbit or 1gbit, got 'fast'"),
    ("workers:\n  - {host: a, nic: 1gbit}\nservers:\n  - {host: a, nic: 10gbit}\n",
     "hosts.yaml:4: servers[0].nic: 10gbit for a, whose NIC workers[0].nic already gives 1000"),
])
def test_bad_shares_and_rates_in_a_hosts_file_name_the_line_and_the_fix(text, message):
    with pytest.raises(ConfigError) as caught:
        parse_hosts_yaml(text, "hosts.yaml")
    assert message in str(caught.value)


def test_slurm_server_nodes_with_colocated_servers_plan_the_mixed_layout():
    allocation = Allocation(job_id="7", nodes=("n0", "n1", "n2", "n3", "n4", "n5"),
                            cpus_per_node=(4,) * 6, tasks_per_node=(1,) * 6)
    hosts = allocation_hosts(allocation, servers_per_node=None, server_nodes=2, port=9000,
                             addresses={}, state_dir="/tmp", colocated=True)
    the_plan = plan(hosts, secret="s")
    assert [a.host for a in the_plan.servers] == ["n0", "n1", "n2", "n3", "n4", "n5"]
    assert [a.share for a in the_plan.servers] == pytest.approx([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    dedicated = plan(allocation_hosts(allocation, servers_per_node=None, server_nodes=2,
                                      port=9000, addresses={}, state_dir="/tmp"), secret="s")
    assert [a.share for a in dedicated.servers] == pytest.approx([0.5, 0.5])


def test_k8s_render_puts_a_server_in_every_worker_pod_with_the_models_shares():
    job = K8sJob(workers=4, servers=2, image="img", command=("python3", "train.py"),
                 colocated_servers=True)
    rendered = render_manifests(job, secret="s", job_id="j")
    manifests = {(m["kind"], m["metadata"]["name"]): m for m in rendered}
    worker_pod = manifests[("Job", "bpsctl-workers")]["spec"]["template"]["spec"]
    [sidecar] = worker_pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and sidecar["args"] == ["bpsctl.engine.server"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert float(env["BPSCTL_SERVER_SHARE"]) == pytest.approx(0.1)
    assert env["BPSCTL_SERVER_COLOCATED"] == "1"
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for document in rendered:               # the sidecar too, against the schemas offline
        kubernetes_validate.validate(document, "1.37.0", strict=True)
    server_pod = manifests[("Deployment", "bpsctl-servers")]["spec"]["template"]["spec"][
        "containers"][0]
    server_env = {e["name"]: e.get("value") for e in server_pod["env"]}
    assert float(server_env["BPSCTL_SERVER_SHARE"]) == pytest.approx(0.3)
    # no server pods: the worker pods' own servers, evenly
    alone = render_manifests(K8sJob(workers=4, servers=0, image="img", command=("x",),
                                    colocated_servers=True), secret="s", job_id="j")
    assert "bpsctl-servers" not in {m["metadata"]["name"] for m in alone}
    with pytest.raises(ConfigError, match="--servers: expected a whole number of at least 1"):
        render_manifests(K8sJob(workers=4, servers=0, image="img", command=("x",)))


def test_the_cli_refuses_colocated_servers_where_it_means_nothing_and_a_bad_share():
    runner = CliRunner()
    result = runner.invoke(app, ["up", "--colocated-servers"])
    assert result.exit_code == 2
    assert "--colocated-servers / BPSCTL_COLOCATED_SERVERS: puts a server on each" in \
        result.output
    result = runner.invoke(app, ["bench", "comm", "--cpu-share", "2"])
    assert result.exit_code == 2 and "--cpu-share" in result.output
    result = runner.invoke(app, ["bench", "comm", "--servers", "0"])
    assert result.exit_code == 2 and "0 only with --emulate --colocated-servers" in result.output


# --------------------------------------------------------------------------- the scheduler

def _start_servers(cluster: api.ClusterState, config: Config, count: int) -> list[int]:
    """Start ``count`` more servers of ``cluster`` by hand (planned on CPU hosts, share
    0.4 each); the caller stops them by PID."""
    env = {**os.environ, **config.replace(
        role="server", scheduler=cluster.scheduler, secret=cluster.secret, port=0,
        security=cluster.security, server_share=0.4, server_colocated=False).to_env(),
        "PYTHONPATH": str(REPO_ROOT)}
    return [subprocess.Popen([sys.executable, "-m", "bpsctl.engine.server"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
            for _ in range(count)]


@pytest.mark.timeout(120)
def test_the_scheduler_places_by_the_servers_shares_the_same_for_every_worker():
    """Two servers registered on worker hosts (0.1 each) and two on CPU hosts (0.4 each):
    three workers declaring their tensors in different orders get the same placement, each
    server carries its share within one partition, and the sums are exact; a job's
    BPSCTL_CPU_SHARE splits the same servers its own way."""
    config = cluster_config(server_share=0.1, server_colocated=True)
    with api.local_cluster(config, servers=2) as cluster:
        pids = _start_servers(cluster, config, 2)
        try:
            wait_until(lambda: sum(p["role"] == "server" and p["state"] == "running"
                                   for p in api.status(cluster.state_dir)["processes"]) == 4,
                       20, "the hand-started servers to register")
            sizes = [4096 * 37, 4096 * 200, 12, 4096 * 3, 4096 * 1000]

            def body(worker):
                order = list(range(len(sizes)))
                random.Random(worker.rank).shuffle(order)       # each declares in its order
                data = {i: np.full(sizes[i] // 4, worker.rank + 1.0 + i, np.float32)
                        for i in order}
                handles = {i: worker.push_pull_async(data[i], name=f"t{i}", average=False,
                                                     out=data[i]) for i in order}
                for i in order:
                    worker.synchronize(handles[i])
                    assert (data[i] == 6.0 + 3 * i).all(), (worker.rank, i, data[i][:3])
                return ({name: info["parts"] for name, info in worker._tensors.items()},
                        worker.stats()["servers"])

            for knob, expected in ((None, [0.1, 0.1, 0.4, 0.4]),
                                   ("0.5", [0.25, 0.25, 0.25, 0.25]),
                                   ("1", [0.0, 0.0, 0.5, 0.5])):
                results = run_job(cluster, 3, 4, body, partition_bytes=4096, partition_depth=0,
                                  **({} if knob is None else {"cpu_share": knob}))
                parts, book = results[0]
                assert all(r[0] == parts for r in results)
                assert [s["share"] for s in book] == pytest.approx(expected)
                carried = [0] * 4
                for tensor in parts.values():
                    for _, server, _, length in tensor:
                        carried[server] += length
                total = sum(carried)
                for load, share in zip(carried, expected, strict=True):
                    assert abs(load - share * total) <= 4096, (knob, carried)
                pushed = [s["pushed_bytes"] for s in book]     # what went on the wire
                assert pushed == carried
        finally:
            kill_pids(pids)


# --------------------------------------------------------------------------- emulated 4 + 2

JOB = textwrap.dedent("""
    import json, numpy as np
    import bpsctl.engine as bps
    bps.init()
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 400_000, 12)] + [2_000_000]
    for step in range(2):
        for i, n in enumerate(sizes):
            out = bps.push_pull(np.full(n, (bps.rank() + 1) * (step + 1) + i, np.float32),
                                name=f"t{i}", average=False)
            want = 10 * (step + 1) + 4 * i          # ranks 0..3: (1+2+3+4)(step+1) + 4i
            assert out[0] == out[-1] == want and (out == want).all(), (step, i, out[:3])
    print("STATS " + json.dumps(bps._worker.stats()["servers"]), flush=True)
    bps.shutdown()
""")


@pytest.mark.timeout(300)
def test_an_emulated_4_plus_2_cluster_sums_exactly_and_each_server_carries_its_share(tmp_path):
    """`up --emulate --workers 4 --servers 2 --colocated-servers`: 2 CPU hosts sum 0.3 of the
    bytes each, the 4 worker hosts' own servers 0.1 each; a job's sums are exact and every
    worker pushed each server its share within one partition; `bench comm` on it reports the
    layout with the model's 1.2 S/R against the pure layouts' 1.5 and 2."""
    config = Config.from_env({}, state_dir=tmp_path / "state", emulate=True, nic="500mbit",
                             colocated_servers=True, start_timeout_s=30)
    cluster = api.up_emulated(config, workers=4, servers=2)
    try:
        rows = [p for p in api.status(config.state_dir)["processes"] if p["role"] == "server"]
        worker_hosts = {h["address"] for h in cluster.emulation["workers"]}
        rows.sort(key=lambda p: (p["colocated"], p["share"]))
        assert [p["colocated"] for p in rows] == [False, False, True, True, True, True]
        assert [p["share"] for p in rows] == pytest.approx([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
        assert {p["host"] for p in rows if p["colocated"]} == worker_hosts
        assert cluster.layout is not None and cluster.layout["shares"] == pytest.approx(
            [0.3, 0.3, 0.1, 0.1, 0.1, 0.1])

        script = tmp_path / "job.py"
        script.write_text(JOB)
        out = tmp_path / "out.txt"
        with open(out, "w") as sink:
            result = api.run_local([sys.executable, str(script)], 4, config,
                                   stdout=sink, stderr=sink)
        text = out.read_text()
        assert result.exit_code == 0, text
        books = [json.loads(line.split("STATS ", 1)[1]) for line in text.splitlines()
                 if "STATS " in line]
        assert len(books) == 4
        for book in books:
            total = sum(s["pushed_bytes"] for s in book)
            for server in book:
                # 2 MiB partitions at most (BPSCTL_PARTITION_BYTES's default), each pushed twice
                assert abs(server["pushed_bytes"] - server["share"] * total) <= 2 * 2 * MIB, book

        from bpsctl.bench.api import CommSettings, run_comm
        report = run_comm(config.replace(emulate=False, colocated_servers=False), CommSettings(
            workers=4, servers=6, sizes=(8 * MIB,), tensors=4, warmup=1, repeats=2, raw=False),
            output=open(os.devnull, "w"))
        layout_json = report["layout"]
        assert (layout_json["worker_hosts"], layout_json["cpu_hosts"]) == (4, 2)
        assert sorted(layout_json["shares"]) == pytest.approx([0.1] * 4 + [0.3] * 2)
        unit = 8 * MIB / goodput_bytes_s(500)
        assert layout_json["model_seconds"] == pytest.approx(1.2 * unit)
        assert layout_json["colocated_only_seconds"] == pytest.approx(1.5 * unit)
        assert layout_json["cpu_hosts_only_seconds"] == pytest.approx(2.0 * unit)
        assert layout_json["measured_over_model"] == pytest.approx(
            report["results"][0]["seconds"] / layout_json["model_seconds"])
        assert report["theory_speedup"] == pytest.approx(1.25)
    finally:
        api.down(config.state_dir)
