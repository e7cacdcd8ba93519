"""Kubernetes manifests for a bpsctl job: ``bpsctl k8s render`` (pure: nothing is applied).

What it writes, and how the roles find each other:

- a Secret ``<name>-secret`` holding the cluster's secret (``BPSCTL_SECRET``), read by every
  container through ``secretKeyRef`` (never on a command line);
- the scheduler: a Deployment of one pod (image ``--server-image``, ``bpsctl.engine.scheduler``)
  and a Service ``<name>-scheduler``: everyone reaches it at ``<name>-scheduler:<port>``;
- the servers: a Deployment of ``--servers`` pods (``bpsctl.engine.server``), each binding and
  advertising its pod IP (downward API), so workers connect to them directly once the scheduler
  has told them where they are; with ``--colocated-servers`` every worker pod also runs a
  server beside its workers (a native sidecar: an init container with ``restartPolicy:
  Always``, which Kubernetes stops once the workers exit), BytePS's mixed layout. Each server
  gets its share of the bytes (``BPSCTL_SERVER_SHARE``) as :func:`bpsctl.launch.plan.layout`
  plans it: the traffic model's optimum at equal NIC rates, or ``--cpu-share``;
- the workers: an Indexed Job of ``--workers`` pods (image ``--image``, the user's command),
  ``RANK`` from the job completion index, ``WORLD_SIZE`` the number of workers, and a headless
  Service ``<name>-workers`` that gives pod 0 the DNS name ``MASTER_ADDR``
  (``<name>-workers-0.<name>-workers``) for torch's rendezvous.
- with ``--hosts-per-node K`` (a hosts file's ``slots:``), each worker pod stands for one
  machine and runs K worker processes, as BytePS runs one process per GPU of a machine: the
  pod's command is :mod:`bpsctl.launch.pod`, which starts K copies of the user's command with
  ``RANK = index·K + LOCAL_RANK``, ``LOCAL_RANK`` 0..K-1, ``LOCAL_WORLD_SIZE = K`` and
  ``WORLD_SIZE = workers·K``. The K processes share the pod's network address and its
  ``/dev/shm`` (a memory-backed volume, since the container's default 64 MiB is less than the
  intra-node stage's arena), so their sums meet in shared memory before one of them talks to
  the servers, which K pods of one process each could not do.

The images are the project's own (``dockerfiles/server.Dockerfile``, whose entrypoint is
``python -m``, and ``dockerfiles/worker.Dockerfile``). Every flag is checked before anything is
rendered: a bad value raises :class:`ConfigError` naming the flag.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bpsctl.config import SECURITY_MODES, ConfigError
from bpsctl.engine.security import new_secret
from bpsctl.model import plan_layout

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# Kubernetes resource quantities: 500m, 2, 1.5, 4Gi, 512Mi, 1e3 ...
_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([numkMGTPE]|[KMGTPE]i|e\d+)?")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
DEFAULT_PORT = 9000
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class K8sJob:
    """What ``bpsctl k8s render`` is asked for; :meth:`check` says what is wrong with it."""

    workers: int
    servers: int
    image: str
    command: tuple[str, ...]
    server_image: str = ""              # default: ``image``
    name: str = "bpsctl"
    namespace: str | None = None
    port: int = DEFAULT_PORT
    security: str = "hmac"
    worker_cpu: str | None = None
    worker_memory: str | None = None
    gpus_per_worker: int = 0
    server_cpu: str | None = None
    server_memory: str | None = None
    worker_nodes: tuple[str, ...] = field(default=())    # key=value: node affinity
    server_nodes: tuple[str, ...] = field(default=())
    hosts_per_node: int = 1             # worker processes in each worker pod
    colocated_servers: bool = False     # a server beside the workers in every worker pod
    cpu_share: float | None = None      # the server pods' share of the bytes (None: the model's)
    dmlc: bool = False                  # BytePS's way: every role is bpslaunch with DMLC_*

    @property
    def world_size(self) -> int:
        """Worker processes in the job: ``hosts_per_node`` in each of ``workers`` pods."""
        return self.workers * self.hosts_per_node

    def check(self) -> None:
        """Every problem with the flags, at once, as one :class:`ConfigError`."""
        problems = []
        for flag, value, what, least in (
                ("--workers", self.workers, "the replicas to run", 1),
                ("--servers", self.servers, "the replicas to run"
                 + ("; 0: the worker pods' own servers only" if self.colocated_servers else ""),
                 0 if self.colocated_servers else 1),
                ("--hosts-per-node", self.hosts_per_node, "worker processes in each worker pod",
                 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(f"{flag}: expected a whole number of at least {least} ({what}), "
                                f"got {value!r}")
        if self.cpu_share is not None and not 0 <= self.cpu_share <= 1:
            problems.append(f"--cpu-share: expected the server pods' share of the bytes from 0 "
                            f"to 1, got {self.cpu_share!r}")
        if not self.image.strip():
            problems.append("--image: expected the worker image (built from "
                            "dockerfiles/worker.Dockerfile), got nothing")
        if not self.command:
            problems.append("CMD: expected the worker command after `--`, e.g. "
                            "`-- python3 train.py`")
        if not _DNS_LABEL.fullmatch(self.name) or len(self.name) > 40:
            problems.append(f"--name: expected lowercase letters, digits and '-', starting "
                            f"with a letter, at most 40 characters, got {self.name!r}")
        if self.namespace is not None and (not _DNS_LABEL.fullmatch(self.namespace)
                                           or len(self.namespace) > 63):
            problems.append(f"--namespace: expected a DNS label (lowercase letters, digits, "
                            f"'-'), got {self.namespace!r}")
        if not 1 <= self.port <= 65535 - 1:
            problems.append(f"--port: expected 1..65534, got {self.port}")
        if self.security not in SECURITY_MODES:
            problems.append(f"--security: expected one of {', '.join(SECURITY_MODES)}, got "
                            f"{self.security!r}")
        if self.gpus_per_worker < 0:
            problems.append(f"--gpus-per-worker: expected 0 or more, got {self.gpus_per_worker}")
        for flag, quantity in (("--worker-cpu", self.worker_cpu),
                               ("--worker-memory", self.worker_memory),
                               ("--server-cpu", self.server_cpu),
                               ("--server-memory", self.server_memory)):
            if quantity is not None and not _QUANTITY.fullmatch(quantity):
                problems.append(f"{flag}: expected a Kubernetes quantity such as 4, 500m, "
                                f"16Gi, got {quantity!r}")
        for flag, pairs in (("--worker-node", self.worker_nodes),
                            ("--server-node", self.server_nodes)):
            for pair in pairs:
                key, sep, label = pair.partition("=")
                if not sep or not _LABEL_KEY.fullmatch(key) or len(label) > 63 \
                        or not _LABEL_VALUE.fullmatch(label):
                    problems.append(f"{flag}: expected a node label as key=value (e.g. "
                                    f"node.kubernetes.io/instance-type=p4d.24xlarge), got "
                                    f"{pair!r}")
        if self.dmlc and self.hosts_per_node != 1:
            problems.append("--hosts-per-node with --dmlc: bpslaunch runs one worker process "
                            "per GPU the pod sees (--gpus-per-worker), as BytePS does")
        if self.dmlc and self.colocated_servers:
            problems.append("--colocated-servers with --dmlc: a DMLC deployment runs its "
                            "servers as pods of their own (--servers)")
        if problems:
            raise ConfigError("; ".join(problems))


def _resources(cpu: str | None, memory: str | None, gpus: int = 0) -> dict[str, Any]:
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    limits: dict[str, Any] = {"memory": memory} if memory is not None else {}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _affinity(pairs: Sequence[str]) -> dict[str, Any] | None:
    if not pairs:
        return None
    expressions = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        expressions.append({"key": key, "operator": "In", "values": [value]})
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": expressions}]}}}


def _naming(job: K8sJob) -> tuple[Callable[[str, str], dict[str, Any]],
                                   Callable[[str], dict[str, str]]]:
    """``meta(suffix, component)``: a manifest's metadata (name ``<job>-<suffix>``, the job's
    labels and namespace); ``selector(component)``: the labels that pick a component's pods."""
    labels = {"app.kubernetes.io/name": "bpsctl", "app.kubernetes.io/instance": job.name}

    def meta(suffix: str, component: str) -> dict[str, Any]:
        data: dict[str, Any] = {"name": f"{job.name}-{suffix}",
                                "labels": {**labels, "app.kubernetes.io/component": component}}
        if job.namespace:
            data["namespace"] = job.namespace
        return data

    def selector(component: str) -> dict[str, str]:
        return {**labels, "app.kubernetes.io/component": component}

    return meta, selector


def render_manifests(job: K8sJob, *, secret: str | None = None,
                     job_id: str | None = None) -> list[dict[str, Any]]:
    """Every manifest of ``job``, in the order to apply them (checked first)."""
    job.check()
    if job.dmlc:
        return render_dmlc_manifests(job, secret=secret)
    name = job.name
    scheduler_address = f"{name}-scheduler:{job.port}"
    server_image = job.server_image or job.image
    meta, selector = _naming(job)

    secret_ref = {"secretKeyRef": {"name": f"{name}-secret", "key": "BPSCTL_SECRET"}}
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    common_env = [{"name": "BPSCTL_SECRET", "valueFrom": secret_ref},
                  {"name": "BPSCTL_SECURITY", "value": job.security},
                  {"name": "BPSCTL_HOST", "valueFrom": pod_ip}]

    def role_pod(component: str, image: str, args: list[str], env: list[dict[str, Any]],
                 resources: dict[str, Any], affinity: dict[str, Any] | None,
                 ports: list[dict[str, Any]]) -> dict[str, Any]:
        container: dict[str, Any] = {"name": component, "image": image, "args": args,
                                     "env": [*common_env, *env]}
        if ports:
            container["ports"] = ports
        if resources:
            container["resources"] = resources
        spec: dict[str, Any] = {"containers": [container]}
        if affinity:
            spec["affinity"] = affinity
        return {"metadata": {"labels": selector(component)}, "spec": spec}

    secret_manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": meta("secret", "secret"),
                       "type": "Opaque", "stringData": {"BPSCTL_SECRET": secret or new_secret()}}
    scheduler_pod = role_pod("scheduler", server_image, ["bpsctl.engine.scheduler"],
                             [{"name": "BPSCTL_PORT", "value": str(job.port)}],
                             _resources(job.server_cpu, job.server_memory),
                             _affinity(job.server_nodes),
                             [{"name": "scheduler", "containerPort": job.port}])
    scheduler = {"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": meta("scheduler", "scheduler"),
                 "spec": {"replicas": 1, "selector": {"matchLabels": selector("scheduler")},
                          "template": scheduler_pod}}
    scheduler_service = {"apiVersion": "v1", "kind": "Service",
                         "metadata": meta("scheduler", "scheduler"),
                         "spec": {"selector": selector("scheduler"),
                                  "ports": [{"name": "scheduler", "port": job.port,
                                             "targetPort": job.port}]}}
    server_pod = role_pod("server", server_image, ["bpsctl.engine.server"],
                          [{"name": "BPSCTL_SCHEDULER", "value": scheduler_address},
                           {"name": "BPSCTL_PORT", "value": str(job.port + 1)}],
                          _resources(job.server_cpu, job.server_memory),
                          _affinity(job.server_nodes),
                          [{"name": "server", "containerPort": job.port + 1}])
    servers = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": meta("servers", "server"),
               "spec": {"replicas": job.servers, "selector": {"matchLabels": selector("server")},
                        "template": server_pod}}
    cpu_share, colocated_share = layout_shares(job)
    if job.colocated_servers:       # (alone, the server pods share evenly)
        server_pod["spec"]["containers"][0]["env"].append(
            {"name": "BPSCTL_SERVER_SHARE", "value": repr(cpu_share)})
    workers_service = {"apiVersion": "v1", "kind": "Service",
                       "metadata": meta("workers", "worker"),
                       "spec": {"clusterIP": "None", "selector": selector("worker"),
                                "ports": [{"name": "master", "port": DEFAULT_MASTER_PORT}]}}
    index_ref = {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    per_pod = job.hosts_per_node
    rank_env: list[dict[str, Any]]
    if per_pod == 1:
        worker_args = list(job.command)
        rank_env = [{"name": "RANK", "valueFrom": index_ref},
                    {"name": "WORLD_SIZE", "value": str(job.world_size)},
                    {"name": "LOCAL_RANK", "value": "0"},
                    {"name": "LOCAL_WORLD_SIZE", "value": "1"}]
    else:
        # each process's RANK and LOCAL_RANK are set by bpsctl.launch.pod from the pod's index,
        # which Kubernetes puts into its arguments ($(NODE_RANK))
        worker_args = ["python3", "-m", "bpsctl.launch.pod", "--node-rank", "$(NODE_RANK)",
                       "--local-size", str(per_pod), "--world-size", str(job.world_size),
                       "--", *job.command]
        rank_env = [{"name": "NODE_RANK", "valueFrom": index_ref},
                    {"name": "WORLD_SIZE", "value": str(job.world_size)},
                    {"name": "LOCAL_WORLD_SIZE", "value": str(per_pod)}]
    worker_pod = role_pod(
        "worker", job.image, worker_args,
        [{"name": "BPSCTL_SCHEDULER", "value": scheduler_address},
         {"name": "BPSCTL_JOB_ID", "value": job_id or uuid.uuid4().hex},
         *rank_env,
         {"name": "MASTER_ADDR", "value": f"{name}-workers-0.{name}-workers"},
         {"name": "MASTER_PORT", "value": str(DEFAULT_MASTER_PORT)},
         {"name": "PYTHONUNBUFFERED", "value": "1"}],
        _resources(job.worker_cpu, job.worker_memory, job.gpus_per_worker),
        _affinity(job.worker_nodes), [{"name": "master", "containerPort": DEFAULT_MASTER_PORT}])
    worker_pod["spec"].update({"subdomain": f"{name}-workers", "restartPolicy": "Never"})
    if per_pod > 1:
        # the intra-node stage's arena (BPSCTL_SHM_BYTES, 512 MiB) is larger than the
        # container runtime's default /dev/shm (64 MiB)
        worker_pod["spec"]["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
        worker_pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "shm",
                                                                "mountPath": "/dev/shm"}]
    if job.colocated_servers:
        sidecar: dict[str, Any] = {
            "name": "server", "image": server_image, "args": ["bpsctl.engine.server"],
            "restartPolicy": "Always",
            "env": [*common_env,
                    {"name": "BPSCTL_SCHEDULER", "value": scheduler_address},
                    {"name": "BPSCTL_PORT", "value": str(job.port + 1)},
                    {"name": "BPSCTL_SERVER_SHARE", "value": repr(colocated_share)},
                    {"name": "BPSCTL_SERVER_COLOCATED", "value": "1"}],
            "ports": [{"name": "server", "containerPort": job.port + 1}]}
        resources = _resources(job.server_cpu, job.server_memory)
        if resources:
            sidecar["resources"] = resources
        if per_pod > 1:     # the workers' /dev/shm: partitions to it go through shared memory
            sidecar["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        worker_pod["spec"]["initContainers"] = [sidecar]
    workers = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta("workers", "worker"),
               "spec": {"completionMode": "Indexed", "completions": job.workers,
                        "parallelism": job.workers, "backoffLimit": 0,
                        "template": worker_pod}}
    return [secret_manifest, scheduler, scheduler_service,
            *([servers] if job.servers else []), workers_service, workers]


def render_dmlc_manifests(job: K8sJob, *, secret: str | None = None) -> list[dict[str, Any]]:
    """The manifests of a BytePS-style job (``--dmlc``): every role runs ``bpslaunch``
    (:mod:`bpsctl.launch.dmlc`) from the ``DMLC_*`` variables BytePS's docs/running.md sets,
    so a deployment that sets them by hand runs the same. Each role is a Job that ends with
    the training job (bpslaunch's scheduler and servers exit once it finished):

    - the scheduler: a Job of one pod binding its pod IP (``DMLC_PS_ROOT_URI`` there) and a
      Service ``<name>-scheduler``, the ``DMLC_PS_ROOT_URI`` of every other role;
    - the servers: a Job of ``--servers`` pods; the workers: an Indexed Job of ``--workers``
      pods, ``DMLC_WORKER_ID`` the completion index, one process per GPU each pod sees;
    - every role advertises its pod IP (``DMLC_NODE_HOST``) and, unless ``--security none``,
      proves the Secret's ``BPSCTL_SECRET`` (bpslaunch's HMAC; without it the job would run
      unauthenticated, as BytePS's did).
    """
    name = job.name
    server_image = job.server_image or job.image
    meta, selector = _naming(job)

    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    keyed = job.security != "none"
    common: list[dict[str, Any]] = [
        {"name": "DMLC_PS_ROOT_URI", "value": f"{name}-scheduler"},
        {"name": "DMLC_PS_ROOT_PORT", "value": str(job.port)},
        {"name": "DMLC_NUM_WORKER", "value": str(job.workers)},
        {"name": "DMLC_NUM_SERVER", "value": str(job.servers)},
        {"name": "DMLC_NODE_HOST", "valueFrom": pod_ip},
        {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if keyed:
        common += [{"name": "BPSCTL_SECRET", "valueFrom": {"secretKeyRef": {
                        "name": f"{name}-secret", "key": "BPSCTL_SECRET"}}},
                   {"name": "BPSCTL_SECURITY", "value": job.security}]

    def role_job(component: str, suffix: str, image: str, args: list[str],
                 env: list[dict[str, Any]], resources: dict[str, Any],
                 affinity: dict[str, Any] | None, count: int,
                 indexed: bool = False) -> dict[str, Any]:
        overridden = {e["name"] for e in env}
        container: dict[str, Any] = {
            "name": component, "image": image, "args": args,
            "env": [*(e for e in common if e["name"] not in overridden), *env]}
        if component == "scheduler":
            container["ports"] = [{"name": "scheduler", "containerPort": job.port}]
        if resources:
            container["resources"] = resources
        pod_spec: dict[str, Any] = {"containers": [container], "restartPolicy": "Never"}
        if affinity:
            pod_spec["affinity"] = affinity
        spec: dict[str, Any] = {"completions": count, "parallelism": count, "backoffLimit": 0,
                                "template": {"metadata": {"labels": selector(component)},
                                             "spec": pod_spec}}
        if indexed:
            spec = {"completionMode": "Indexed", **spec}
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(suffix, component),
                "spec": spec}

    index_ref = {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    server_resources = _resources(job.server_cpu, job.server_memory)
    scheduler = role_job("scheduler", "scheduler", server_image, ["bpsctl.launch.dmlc"],
                         [{"name": "DMLC_ROLE", "value": "scheduler"},
                          {"name": "DMLC_PS_ROOT_URI", "valueFrom": pod_ip}],
                         server_resources, _affinity(job.server_nodes), 1)
    scheduler_service = {"apiVersion": "v1", "kind": "Service",
                         "metadata": meta("scheduler", "scheduler"),
                         "spec": {"selector": selector("scheduler"),
                                  "ports": [{"name": "scheduler", "port": job.port,
                                             "targetPort": job.port}]}}
    servers = role_job("server", "servers", server_image, ["bpsctl.launch.dmlc"],
                       [{"name": "DMLC_ROLE", "value": "server"}], server_resources,
                       _affinity(job.server_nodes), job.servers)
    workers = role_job("worker", "workers", job.image,
                       ["python3", "-m", "bpsctl.launch.dmlc", *job.command],
                       [{"name": "DMLC_ROLE", "value": "worker"},
                        {"name": "DMLC_WORKER_ID", "valueFrom": index_ref}],
                       _resources(job.worker_cpu, job.worker_memory, job.gpus_per_worker),
                       _affinity(job.worker_nodes), job.workers, indexed=True)
    secret_manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": meta("secret", "secret"),
                       "type": "Opaque", "stringData": {"BPSCTL_SECRET": secret or new_secret()}}
    return [*([secret_manifest] if keyed else []), scheduler_service, scheduler, servers,
            workers]


def layout_shares(job: K8sJob) -> tuple[float, float]:
    """(share of each server pod, share of each worker pod's server): one server per pod, each
    pod a host of its own, so the layout rule of launch.plan at equal NIC rates."""
    workers = [f"worker-{i}" for i in range(job.workers)]
    cpu = [f"server-{i}" for i in range(job.servers)]
    layout = plan_layout(workers, cpu + (workers if job.colocated_servers else []),
                         cpu_share=job.cpu_share)
    shares = dict(zip(layout.server_hosts, layout.shares, strict=True))
    return (shares[cpu[0]] if cpu else 0.0,
            shares[workers[0]] if job.colocated_servers else 0.0)


def to_yaml(manifests: Sequence[dict[str, Any]]) -> str:
    """Several YAML documents (PyYAML when installed; otherwise JSON, which is YAML too)."""
    try:
        import yaml
    except ImportError:
        return "".join(f"---\n{json.dumps(m, indent=2)}\n" for m in manifests)
    return yaml.safe_dump_all(list(manifests), sort_keys=False, explicit_start=True)


__all__ = ["K8sJob", "render_dmlc_manifests", "render_manifests", "to_yaml"]
