"""`bpsctl up --slurm` / `run` / `status` / `down` inside real Slurm jobs (root only).

A real Slurm 22.05 (tests/slurm_cluster.py): slurmctld on host s0, one slurmd on each of the
emulated hosts w0 and w1 (2 CPUs each). Jobs are submitted with ``sbatch`` and ``salloc`` from
s0, exactly as a user would; the tests read what the user would see (the job's output, exit
codes, a benchmark's JSON) and what is left running on every node.
"""
from __future__ import annotations

import json
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
from conftest import wait_until
from slurm_cluster import SlurmCluster, slurm_cluster

PUSH_PULL = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    import numpy as np
    from bpsctl import engine

    engine.init()
    rank, size = engine.rank(), engine.size()
    total = engine.push_pull(np.full(1000, float(rank + 1), dtype=np.float32), name="t",
                             average=False)
    ok = bool(np.all(total == size * (size + 1) / 2))
    print(f"rank {rank} of {size} on {os.environ.get('SLURMD_NODENAME')} "
          f"local {os.environ['LOCAL_RANK']} sum {total[0]:g} ok {ok}", flush=True)
    if len(sys.argv) > 1:       # then wait: for a checkpoint signal, or to be cancelled
        checkpointed = []
        signal.signal(signal.SIGUSR1, lambda *_: checkpointed.append(1))
        Path(sys.argv[1], f"ready-{rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not checkpointed and time.monotonic() < deadline:
            time.sleep(0.05)
        if checkpointed:
            print(f"rank {rank} checkpointed", flush=True)
    engine.shutdown()
''')


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def job_dir(tmp_path, slurm):
    tmp_path.chmod(0o755)
    (tmp_path / "push_pull.py").write_text(PUSH_PULL)
    yield tmp_path
    for job in slurm.jobs():
        slurm.client("scancel", job, check=False)
    slurm.wait_no_jobs()


def _script(directory: Path, body: str) -> Path:
    path = directory / "job.sh"
    path.write_text("#!/bin/bash\nB=\"python -m bpsctl.cli --state-dir "
                    f"{directory / 'state'}\"\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def _nothing_left(slurm: SlurmCluster, timeout_s: float = 30) -> None:
    """No process of the job on any node, nor on the submitting host (beyond the daemons)."""
    hosts = (*slurm.nodes, slurm.controller)
    left: dict[str, list] = {}

    def clean() -> bool:
        left.update({h: slurm.foreign_pids(h) for h in hosts})
        return not any(left.values())
    try:
        wait_until(clean, timeout_s, "every process of the job to end")
    except AssertionError:
        raise AssertionError(f"left behind: {left}") from None


@pytest.mark.timeout(180)
def test_sbatch_up_run_status_down_across_two_nodes(slurm, job_dir):
    script = _script(job_dir, f"""
        $B up --slurm || exit 3
        $B status --json > {job_dir / 'status.json'}
        $B run -- python {job_dir / 'push_pull.py'}
        echo "run exit code $?"
        $B down
        echo "down exit code $?"
        """)
    started = time.monotonic()
    result = slurm.client("sbatch", "--wait", "-N2", "--ntasks-per-node=2", "-o",
                          str(job_dir / "out.txt"), str(script), check=False, timeout_s=150)
    output = (job_dir / "out.txt").read_text()
    assert result.returncode == 0, output
    lines = [line for line in output.splitlines() if line.startswith("[") and " sum " in line]
    assert len(lines) == 4, output
    assert all(line.endswith("sum 10 ok True") for line in lines), output
    # one worker per task: two on each node, local ranks 0 and 1
    places = sorted(re.search(r"on (\w+) local (\d)", line).groups() for line in lines)
    assert places == [("w0", "0"), ("w0", "1"), ("w1", "0"), ("w1", "1")], output
    assert "run exit code 0" in output and "down exit code 0" in output, output
    status = json.loads((job_dir / "status.json").read_text())
    assert status["kind"] == "slurm"
    by_role = {(p["role"], p["node"]) for p in status["processes"]}
    assert by_role == {("scheduler", "w0"), ("server", "w0"), ("server", "w1")}
    assert all(p["state"] == "running" for p in status["processes"])
    _nothing_left(slurm)
    print(f"sbatch job: {time.monotonic() - started:.1f} s; Slurm set up in {slurm.setup_s:.1f} s")


@pytest.mark.timeout(120)
def test_scancel_mid_run_leaves_no_process_on_any_node(slurm, job_dir):
    script = _script(job_dir, f"""
        $B up --slurm --servers-per-node 2 || exit 3
        $B run -- python {job_dir / 'push_pull.py'} {job_dir}
        """)
    # two CPUs per task, so that two servers per node fit beside the worker
    salloc = slurm.popen("salloc", "-N2", "--ntasks-per-node=1", "-c2", "-J", "cancelled",
                         str(script), out=job_dir / "out.txt")
    try:
        wait_until(lambda: all((job_dir / f"ready-{r}").exists() for r in range(2))
                   or salloc.poll() is not None, 60, "both workers to be ready")
        assert salloc.poll() is None, (job_dir / "out.txt").read_text()
        (job_id,) = slurm.jobs()
        slurm.client("scancel", job_id)
        salloc.wait(timeout=30)
    finally:
        if salloc.poll() is None:
            salloc.send_signal(signal.SIGKILL)
            salloc.wait()
    _nothing_left(slurm)
    assert "checkpointed" not in (job_dir / "out.txt").read_text()


@pytest.mark.timeout(120)
def test_sigusr1_before_the_time_limit_reaches_every_worker(slurm, job_dir):
    # docs/slurm-kubernetes.md's recipe: the batch shell traps Slurm's warning and passes it
    # to `bpsctl run`
    script = _script(job_dir, f"""
        $B up --slurm || exit 3
        trap 'kill -USR1 $run' USR1
        $B run -- python {job_dir / 'push_pull.py'} {job_dir} &
        run=$!
        wait $run; code=$?
        while kill -0 $run 2>/dev/null; do wait $run; code=$?; done
        echo "run exit code $code"
        $B status --json > {job_dir / 'status.json'}
        $B down
        """)
    result = slurm.client("sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "-o",
                          str(job_dir / "out.txt"), str(script))
    job_id = result.stdout.strip().split(";")[0]
    wait_until(lambda: all((job_dir / f"ready-{r}").exists() for r in range(2))
               or job_id not in slurm.jobs(), 60, "both workers to be ready")
    slurm.client("scancel", "--signal=USR1", "--batch", job_id)
    slurm.wait_no_jobs(60)
    output = (job_dir / "out.txt").read_text()
    assert "rank 0 checkpointed" in output and "rank 1 checkpointed" in output, output
    assert "run exit code 0" in output, output
    # the scheduler and servers ignore the signal meant for the workers
    status = json.loads((job_dir / "status.json").read_text())
    assert all(p["state"] == "running" for p in status["processes"]
               if p["role"] != "worker"), status
    _nothing_left(slurm)


@pytest.mark.timeout(120)
def test_bad_flags_and_an_unavailable_node_are_named(slurm, job_dir):
    script = _script(job_dir, """
        $B up --slurm --servers-per-node 3
        echo "too many servers: exit code $?"
        scontrol update NodeName=w1 State=DRAIN Reason=bpsctl-test
        $B up --slurm
        echo "drained node: exit code $?"
        """)
    try:
        salloc = slurm.client("salloc", "-N2", "--ntasks-per-node=2", "--no-kill", str(script),
                              check=False, timeout_s=90)
    finally:
        slurm.resume("w1")
        slurm.wait_idle()
    output = salloc.stdout + salloc.stderr
    assert "too many servers: exit code 2" in output, output
    assert "--servers-per-node 3" in output and "2 CPU(s)" in output, output
    # drained, not DOWN: Slurm may revoke an allocation one of whose nodes goes DOWN (seen
    # under load), and then every node fails preflight; a drained node keeps the allocation
    assert "drained node: exit code 1" in output, output
    assert re.search(r"w1: Slurm says it is \S*DRAIN\S* \(reason: bpsctl-test", output), output
    assert "w0:" not in output, output         # the healthy node is not blamed
    _nothing_left(slurm)


def test_nodelists_are_expanded_by_scontrol(slurm, job_dir):
    result = slurm.client("salloc", "-N2", "python", "-c",
                          "from bpsctl.launch.slurm import expand_nodelist as e; "
                          "print(e('w[0-1]'), e('w0,w1'))", check=False)
    assert "('w0', 'w1') ('w0', 'w1')" in result.stdout, result.stdout + result.stderr


# --------------------------------------------------------------------------- bench

def _systems(report: dict) -> list[str]:
    return [row["system"] for row in report["results"]]


@pytest.mark.timeout(150)
def test_bench_comm_in_an_sbatch_job_measures_bpsctl_and_allreduce_on_the_nodes(slurm, job_dir):
    script = _script(job_dir, f"""
        $B up --slurm || exit 3
        $B bench comm --workers 3
        echo "3 workers: exit code $?"
        COLUMNS=80 $B bench comm --size 1MiB --warmup 1 --repeats 2 --compare allreduce \\
            --json {job_dir / 'comm.json'}
        echo "bench exit code $?"
        $B down
        """)
    started = time.monotonic()
    result = slurm.client("sbatch", "--wait", "-N2", "--ntasks-per-node=1", "-o",
                          str(job_dir / "out.txt"), str(script), check=False, timeout_s=130)
    output = (job_dir / "out.txt").read_text()
    assert result.returncode == 0 and "bench exit code 0" in output, output[-3000:]
    # the allocation says how many workers: one per task
    assert "3 workers: exit code 2" in output, output[-3000:]
    assert re.search(r"--workers: the Slurm cluster up in \S+ \(Slurm job \d+\) has 2 worker "
                     r"slots", " ".join(output.split())), output[-3000:]
    report = json.loads((job_dir / "comm.json").read_text())
    # one worker per task and one server per node: 2 x 2, on the job's nodes
    assert (report["kind"], report["workers"], report["servers"]) == ("comm", 2, 2)
    assert (report["cluster"], report["nodes"]) == ("slurm", ["w0", "w1"])
    # raw ZeroMQ would be the batch host's loopback: not a figure of the allocation
    assert _systems(report) == ["bpsctl", "allreduce"]
    for row in report["results"]:
        assert len(row["seconds_all"]) == 2 and row["seconds"] > 0, row
    assert report["speedup"]["allreduce"] > 0
    said = " ".join(output.split())
    assert f"Slurm job {report['slurm_job']} (w0, w1)" in said, output[-3000:]
    assert "loopback" not in output and "BPSCTL_RESULT" not in output, output[-3000:]
    _nothing_left(slurm)
    print(f"sbatch bench comm: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(420)
def test_bench_resnet50_in_salloc_trains_bpsctl_and_the_baselines_on_the_nodes(slurm, job_dir):
    """salloc runs the bench on s0, outside the allocation's nodes: every worker is a job step
    on w0 or w1, and Horovod's rendezvous, served by the bench on s0, is reached from them.
    One baseline (DDP, which needs nothing of the bench, where Horovod is not installed)."""
    from bpsctl.bench.horovod import installed_version
    baselines = ["horovod"] if installed_version() else ["ddp"]
    script = _script(job_dir, f"""
        $B up --slurm || exit 3
        COLUMNS=80 $B bench resnet50 --batch-size 2 --num-classes 2 --warmup 1 --iters 1 \\
            --compare {','.join(baselines)} --json {job_dir / 'train.json'}
        echo "bench exit code $?"
        $B down
        """)
    started = time.monotonic()
    result = slurm.client("salloc", "-N2", "--ntasks-per-node=1", "-J", "bench", str(script),
                          check=False, timeout_s=400)
    output = result.stdout + result.stderr
    assert "bench exit code 0" in output, output[-3000:]
    report = json.loads((job_dir / "train.json").read_text())
    assert (report["kind"], report["model"], report["workers"]) == ("train", "resnet50", 2)
    assert (report["cluster"], report["nodes"]) == ("slurm", ["w0", "w1"])
    assert _systems(report) == ["bpsctl", *baselines, "plain"]
    assert report["results"].pop()["workers"] == 1      # rank 0 alone, on w0
    for row in report["results"]:
        assert row["workers"] == 2 and row["img_per_sec"] > 0 and row["version"], row
    assert set(report["speedup"]) == set(baselines)
    said = " ".join(output.split())
    assert f"on the nodes of Slurm job {report['slurm_job']}" in said, output[-3000:]
    _nothing_left(slurm)
    print(f"salloc bench resnet50, bpsctl + {', '.join(baselines)}: "
          f"{time.monotonic() - started:.1f} s")
