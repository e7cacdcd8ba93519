"""Slurm and Kubernetes without a cluster: the allocation as bpsctl plans it, the flags it
refuses (exit 2), and Kubernetes manifests validated against the Kubernetes 1.37 schemas
(``kubernetes-validate``, offline). The Slurm backend on a real Slurm is in test_slurm.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


# --------------------------------------------------------------------------- several per pod

_IMAGES = ("--image", "registry.example/bpsctl-worker:0.1")


def _worker_job(documents: list[dict]) -> dict:
    return next(d for d in documents if d["kind"] == "Job")


@pytest.mark.parametrize("workers, servers", [(2, 2), (8, 4)])
def test_hosts_per_node_runs_that_many_ranks_in_each_worker_pod(workers, servers):
    code, out, err = _render("--workers", str(workers), "--servers", str(servers), *_IMAGES,
                             "--hosts-per-node", "2", "--gpus-per-worker", "2",
                             "--", "python3", "train.py")
    assert code == 0, err
    documents = list(yaml.safe_load_all(out))
    _validate(documents)
    job = _worker_job(documents)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == workers    # pods
    pod = job["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["args"] == ["python3", "-m", "bpsctl.launch.pod", "--node-rank",
                              "$(NODE_RANK)", "--local-size", "2", "--world-size",
                              str(2 * workers), "--", "python3", "train.py"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith(
        "['batch.kubernetes.io/job-completion-index']")
    assert (env["WORLD_SIZE"]["value"], env["LOCAL_WORLD_SIZE"]["value"]) == \
        (str(2 * workers), "2")
    assert "RANK" not in env and "LOCAL_RANK" not in env      # each process gets its own
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    # the intra-node stage's arena needs more than the runtime's 64 MiB /dev/shm
    assert pod["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    assert worker["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]


def test_one_rank_per_pod_stays_as_it_was():
    code, out, err = _render("--workers", "2", "--servers", "1", *_IMAGES, "--hosts-per-node",
                             "1", "--", "python3", "train.py")
    assert code == 0, err
    pod = _worker_job(list(yaml.safe_load_all(out)))["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert pod["containers"][0]["args"] == ["python3", "train.py"] and "volumes" not in pod
    assert (env["LOCAL_RANK"]["value"], env["WORLD_SIZE"]["value"]) == ("0", "2")


@pytest.mark.parametrize("value", ["0", "-1", "-4"])
def test_a_bad_hosts_per_node_exits_2_before_anything_is_rendered(value):
    code, out, err = _render("--workers", "2", "--servers", "1", *_IMAGES,
                             "--hosts-per-node", value, "--", "python3", "train.py")
    assert code == 2, err
    assert "--hosts-per-node: expected a whole number of at least 1" in err, err
    assert value in err and out == ""


PUSH_PULL = """
import os
import numpy as np
from bpsctl import engine
engine.init()
total = engine.push_pull(np.full(8, float(engine.rank() + 1), dtype=np.float32), name="t",
                         average=False)
print(f"rank {engine.rank()} of {engine.size()} local {os.environ['LOCAL_RANK']} of "
      f"{os.environ['LOCAL_WORLD_SIZE']} sum {total[0]:g}", flush=True)
engine.shutdown()
"""


@pytest.mark.timeout(60)
def test_a_pod_runs_its_ranks_as_kubernetes_would_start_it(tmp_path):
    """The rendered worker pod of a 2-pod job with --hosts-per-node 2, run here as the kubelet
    would run pod 1: its env (the Secret, the pod IP and the index filled in, the Services'
    names replaced by a local cluster's addresses) and its args with $(NODE_RANK) expanded.
    Pod 1's two ranks are 2 and 3 of 4; two more workers stand for pod 0."""
    from conftest import cluster_config

    from bpsctl.launch import api
    from bpsctl.launch.local import free_port
    script = tmp_path / "push_pull.py"
    script.write_text(PUSH_PULL)
    with api.local_cluster(cluster_config(), servers=1) as cluster:
        documents = render_manifests(K8sJob(workers=2, servers=1, image="img",
                                            command=("python3", str(script)),
                                            hosts_per_node=2, security=cluster.security),
                                     secret=cluster.secret)
        container = _worker_job(documents)["spec"]["template"]["spec"]["containers"][0]
        master_port = str(free_port())
        filled = {"BPSCTL_SECRET": cluster.secret, "BPSCTL_HOST": "127.0.0.1", "NODE_RANK": "1",
                  "BPSCTL_SCHEDULER": cluster.scheduler, "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": master_port}
        env = {e["name"]: filled.get(e["name"], e.get("value")) for e in container["env"]}
        args = [sys.executable if a == "python3" else a.replace("$(NODE_RANK)", env["NODE_RANK"])
                for a in container["args"]]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("BPSCTL_", "RANK"))}
        pod = subprocess.Popen(args, env={**base, **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        # pod 0's two ranks, started directly, on another "host" so that each pod's pair
        # meets on its own
        others = [subprocess.Popen(
            [sys.executable, str(script)], env={**base, **env, "RANK": str(rank),
                                                "LOCAL_RANK": str(rank),
                                                "BPSCTL_HOST": "127.0.0.2"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        try:
            out, _ = pod.communicate(timeout=45)
            for other in others:
                other.communicate(timeout=15)
        finally:
            for process in (pod, *others):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert pod.returncode == 0, out
    assert sorted(line for line in out.splitlines() if " sum " in line) == [
        "[2] rank 2 of 4 local 0 of 2 sum 10", "[3] rank 3 of 4 local 1 of 2 sum 10"], out


@pytest.mark.timeout(40)
def test_the_first_failing_rank_ends_the_pod_with_its_code():
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "bpsctl.launch.pod", "--node-rank", "0", "--local-size", "2",
         "--world-size", "2", "--", sys.executable, "-c",
         "import os, sys, time\nif os.environ['LOCAL_RANK'] == '1': sys.exit(3)\n"
         "time.sleep(60)"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 3, result.stderr
    assert "rank 1 exited 3" in result.stderr
    assert time.monotonic() - started < 15        # rank 0 was stopped, not waited for


@pytest.mark.timeout(30)
def test_sigterm_to_the_pod_stops_every_rank():
    """The kubelet stops a pod with SIGTERM: every rank is stopped (no orphan keeps the
    pod's resources), and the pod exits 128 + 15."""
    import psutil
    pod = subprocess.Popen(
        [sys.executable, "-m", "bpsctl.launch.pod", "--node-rank", "0", "--local-size", "2",
         "--world-size", "2", "--", sys.executable, "-c",
         "import os, time\nprint('ready', os.getpid(), flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert pod.stdout is not None
        ranks = [int(pod.stdout.readline().split()[-1]) for _ in range(2)]
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(timeout=15) == 128 + signal.SIGTERM
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                       for pid in ranks)
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
        pod.stdout.close()
        pod.stderr.close()
