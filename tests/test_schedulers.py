"""Slurm and Kubernetes without a cluster: the allocation as bpsctl plans it, the flags it
refuses (exit 2), and Kubernetes manifests validated against the Kubernetes 1.37 schemas
(``kubernetes-validate``, offline). The Slurm backend on a real Slurm is in test_slurm.py."""
from __future__ import annotations

import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from bpsctl.cli import app
from bpsctl.config import Config, ConfigError
from bpsctl.launch.k8s import K8sJob, render_manifests
from bpsctl.launch.plan import plan
from bpsctl.launch.slurm import (
    Allocation,
    allocation_hosts,
    expand_counts,
    node_problem,
    parse_node_line,
)

K8S_VERSION = "1.37.0"


# --------------------------------------------------------------------------- Slurm

@pytest.mark.parametrize("text, counts", [("2(x3),1", (2, 2, 2, 1)), ("4", (4,)),
                                          ("1,2(x2)", (1, 2, 2))])
def test_per_node_counts_expand_as_slurm_writes_them(text, counts):
    assert expand_counts(text, "SLURM_TASKS_PER_NODE") == counts


def test_a_garbled_count_names_the_variable():
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE: expected .* got '2\\(3\\)'"):
        expand_counts("2(3)", "SLURM_TASKS_PER_NODE")


def test_node_records_and_states():
    record = parse_node_line("NodeName=w1 Arch=x86_64 NodeAddr=10.0.0.2 State=DOWN+DRAIN "
                             "Partitions=debug Reason=disk failed [root@2026-11-24T04:00:00]")
    assert record["NodeAddr"] == "10.0.0.2"
    assert record["Reason"] == "disk failed [root@2026-11-24T04:00:00]"
    assert "DOWN+DRAIN" in node_problem(record) and "disk failed" in node_problem(record)
    assert node_problem({"State": "IDLE*"}) is not None       # not responding
    assert node_problem({"State": "ALLOCATED"}) is None
    assert node_problem({"State": "MIXED"}) is None


ALLOCATION = Allocation(job_id="42", nodes=("n1", "n2", "n3"), tasks_per_node=(2, 2, 2),
                        cpus_per_node=(4, 4, 4))


def test_colocated_layout_ranks_follow_the_nodes():
    hosts = allocation_hosts(ALLOCATION, servers_per_node=2, server_nodes=0, port=9000,
                             addresses={"n1": "10.0.0.1"}, state_dir="/tmp/s")
    the_plan = plan(hosts)
    assert (the_plan.scheduler.host, the_plan.scheduler.address, the_plan.scheduler.port) == \
        ("n1", "10.0.0.1", 9000)
    assert [(s.host, s.port) for s in the_plan.servers] == [
        ("n1", 9001), ("n1", 9002), ("n2", 9003), ("n2", 9004), ("n3", 9005), ("n3", 9006)]
    assert [(w.rank, w.host, w.local_rank) for w in the_plan.workers] == [
        (0, "n1", 0), (1, "n1", 1), (2, "n2", 0), (3, "n2", 1), (4, "n3", 0), (5, "n3", 1)]
    env = the_plan.workers[3].to_env(Config(), the_plan)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == \
        ("3", "6", "1", "10.0.0.1")




def test_the_nic_preflight_found_is_the_one_gloo_binds():
    """DDP's and Horovod's gloo bind GLOO_SOCKET_IFNAME, the NIC holding the node's address
    (not whatever the node's hostname resolves to)."""
    hosts = allocation_hosts(ALLOCATION, servers_per_node=1, server_nodes=0, port=9000,
                             addresses={"n2": "10.0.0.2"}, interfaces={"n2": "ib0"},
                             state_dir="/tmp/s")
    the_plan = plan(hosts)
    on_n2 = [w for w in the_plan.workers if w.host == "n2"]
    assert [w.to_env(Config(), the_plan)["GLOO_SOCKET_IFNAME"] for w in on_n2] == ["ib0", "ib0"]
    assert "GLOO_SOCKET_IFNAME" not in the_plan.workers[0].to_env(Config(), the_plan)


def test_dedicated_server_nodes_take_no_workers():
    hosts = allocation_hosts(ALLOCATION, servers_per_node=None, server_nodes=1, port=9000,
                             addresses={}, state_dir="/tmp/s")
    the_plan = plan(hosts)
    assert [s.host for s in the_plan.servers] == ["n1"]
    assert {w.host for w in the_plan.workers} == {"n2", "n3"}
    assert the_plan.master_addr == "n2"


def test_more_servers_per_node_than_cpus_names_both_numbers():
    with pytest.raises(ConfigError, match=r"--servers-per-node 5: node n1 has 4 CPU\(s\)"):
        allocation_hosts(ALLOCATION, servers_per_node=5, server_nodes=0, port=9000,
                         addresses={}, state_dir="/tmp/s")
    with pytest.raises(ConfigError, match="--server-nodes 3: the allocation has 3 node"):
        allocation_hosts(ALLOCATION, servers_per_node=1, server_nodes=3, port=9000,
                         addresses={}, state_dir="/tmp/s")


def test_slurm_outside_an_allocation_exits_2_saying_how_to_get_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir",
                             str(tmp_path), "up", "--slurm"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "not inside a Slurm allocation" in result.stderr and "salloc" in result.stderr
    assert not (tmp_path / "cluster.json").exists()


def test_slurm_placement_flags_without_slurm_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["--state-dir", str(tmp_path), "up",
                                      "--servers-per-node", "2"])
    assert result.exit_code == 2
    assert "add --slurm" in result.output


# --------------------------------------------------------------------------- Kubernetes

def _render(*args: str) -> tuple[int, str, str]:
    result = subprocess.run([sys.executable, "-m", "bpsctl.cli", "k8s", "render", *args],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout, result.stderr


def _validate(documents: list[dict]) -> None:
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


@pytest.mark.parametrize("workers, servers", [(2, 2), (8, 4)])
def test_manifests_validate_against_the_kubernetes_schemas(workers, servers):
    code, out, err = _render("--workers", str(workers), "--servers", str(servers),
                             "--image", "registry.example/bpsctl-worker:0.1",
                             "--server-image", "registry.example/bpsctl-server:0.1",
                             "--worker-cpu", "8", "--worker-memory", "32Gi",
                             "--gpus-per-worker", "1", "--server-cpu", "4",
                             "--worker-node", "node.kubernetes.io/instance-type=p4d.24xlarge",
                             "--server-node", "pool=cpu", "--namespace", "training",
                             "--", "python3", "train.py", "--epochs", "3")
    assert code == 0, err
    documents = list(yaml.safe_load_all(out))
    _validate(documents)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    secret = by_kind[("Secret", "bpsctl-secret")]
    servers_deployment = by_kind[("Deployment", "bpsctl-servers")]
    job = by_kind[("Job", "bpsctl-workers")]
    assert servers_deployment["spec"]["replicas"] == servers
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == workers
    assert job["spec"]["completionMode"] == "Indexed"
    worker = job["spec"]["template"]["spec"]["containers"][0]
    assert worker["args"] == ["python3", "train.py", "--epochs", "3"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in worker["env"]}
    # how the roles find each other: the scheduler's Service, pod 0's DNS name, the Secret
    scheduler_service = by_kind[("Service", "bpsctl-scheduler")]
    port = scheduler_service["spec"]["ports"][0]["port"]
    assert env["BPSCTL_SCHEDULER"]["value"] == f"bpsctl-scheduler:{port}"
    assert env["MASTER_ADDR"]["value"] == "bpsctl-workers-0.bpsctl-workers"
    assert job["spec"]["template"]["spec"]["subdomain"] == "bpsctl-workers"
    assert env["WORLD_SIZE"]["value"] == str(workers)
    assert env["BPSCTL_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "bpsctl-secret"
    assert len(secret["stringData"]["BPSCTL_SECRET"]) >= 32
    assert secret["stringData"]["BPSCTL_SECRET"] not in str(worker["args"])


@pytest.mark.parametrize("args, message", [
    (["--workers", "-2", "--servers", "2"], "--workers: expected a whole number of at least 1"),
    (["--workers", "2", "--servers", "0"], "--servers: expected a whole number of at least 1"),
    (["--workers", "2", "--servers", "1", "--worker-cpu", "lots"], "--worker-cpu: expected"),
    (["--workers", "2", "--servers", "1", "--name", "Bad_Name"], "--name: expected"),
    (["--workers", "2", "--servers", "1", "--worker-node", "nolabel"], "--worker-node: expected"),
])
def test_a_bad_flag_exits_2_before_anything_is_rendered(args, message):
    code, out, err = _render(*args, "--image", "img", "--", "python3", "train.py")
    assert code == 2, err
    assert message in err
    assert out == ""


def test_negative_replicas_pass_the_schemas_so_the_cli_checks_them_itself():
    """The OpenAPI schemas set no minimum on replicas (the API server refuses them only when
    applied): the renderer's own check is what stops a bad count offline."""
    documents = render_manifests(K8sJob(workers=2, servers=2, image="img",
                                        command=("python3", "train.py")))
    documents[3]["spec"]["replicas"] = -1
    _validate(documents)
    with pytest.raises(ConfigError, match="--servers: expected a whole number"):
        render_manifests(K8sJob(workers=2, servers=-1, image="img", command=("python3",)))
