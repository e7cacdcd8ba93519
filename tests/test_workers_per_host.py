"""Several workers per emulated host (`bench ... --workers-per-host K`): a torch job of 2 ranks
on each of 2 worker hosts sums exactly through the intra-node shared-memory stage and the
servers, `bench comm` runs N x K workers and judges them against the NIC limit per host, and
the flag is refused where bench does not build the hosts. The emulated tests need root."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import namespaces_left_behind

from bpsctl.bench.api import GOODPUT_SHARE, ideal_seconds, ideal_step_seconds
from bpsctl.config import Config
from bpsctl.engine import shm
from bpsctl.launch import api, emulate

MIB = 1024 * 1024


def _bpsctl(args: list[str], state_dir, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "BPSCTL_STATE_DIR": str(state_dir)})


def test_the_nic_ideal_counts_the_workers_of_each_host():
    rate = 200 * 1e6 / 8 * GOODPUT_SHARE            # bytes/s through a 200 Mbit NIC
    # comm: every worker pushes its own S, so a host of 2 carries 2S; 4 workers' 4S spread over
    # 2 servers is 2S each as well
    assert ideal_seconds("bpsctl", 4 * MIB, [2, 2], 2, 200) == pytest.approx(2 * 4 * MIB / rate)
    assert ideal_seconds("bpsctl", 4 * MIB, [2, 2], 4, 200) == pytest.approx(2 * 4 * MIB / rate)
    assert ideal_seconds("bpsctl", 4 * MIB, [1, 1, 1, 1], 4, 200) == \
        pytest.approx(4 * MIB / rate)
    # allreduce: 2(N-1)/N between N hosts, however many ranks each holds
    assert ideal_seconds("allreduce", 4 * MIB, [2, 2], 2, 200) == pytest.approx(4 * MIB / rate)
    # training: the intra-node stage sends each host's gradient once (streams [1, 1])
    assert ideal_step_seconds("bpsctl", 4 * MIB, [2, 2], 2, 200, [1, 1]) == \
        pytest.approx(4 * MIB / rate)
    assert ideal_step_seconds("ddp", 4 * MIB, [2, 2], 2, 200) == pytest.approx(4 * MIB / rate)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["bench", "comm", "--workers-per-host", "2"], "only with --emulate"),
    (["bench", "vgg16", "--workers", "2", "--workers-per-host", "2"], "only with --emulate"),
    (["bench", "resnet50", "--workers-per-host", "2"], "only with --emulate"),
    (["bench", "comm", "--emulate", "--workers-per-host", "0"], "expected at least 1"),
])
def test_workers_per_host_without_emulated_hosts_exits_2_saying_what_to_do(tmp_path, args,
                                                                           message):
    result = _bpsctl(args, tmp_path / "state")
    assert result.returncode == 2, result.stderr
    text = " ".join(result.stderr.split())        # rich wraps long lines
    assert "--workers-per-host" in text and message in text, text
    if message == "only with --emulate":
        assert "give --workers as the number of worker processes" in text, text


JOB = textwrap.dedent('''
    import json, os, torch
    import bpsctl.engine.torch as bps
    from bpsctl.engine import shm

    bps.init()
    N, R = bps.size(), bps.rank()
    plugin = bps._p()
    stage, worker = plugin.stage, plugin.worker
    SHAPES = [(1,), (3,), (7, 9), (1001,), (33, 17)]         # odd lengths: padded chunks

    def ranked(r, shape, dtype):
        count = torch.Size(shape).numel()
        return ((torch.arange(count) % 5 - 2 + r).reshape(shape)).to(dtype)

    def total(shape):
        return sum(ranked(r, shape, torch.int64) for r in range(N))

    checked = 0
    for dtype in (torch.float32, torch.float64, torch.int32, torch.float16, torch.bfloat16):
        for shape in SHAPES:
            got = bps.push_pull(ranked(R, shape, dtype), average=False, name=f"s.{dtype}.{shape}")
            assert got.dtype == dtype and torch.equal(got, total(shape).to(dtype)), (dtype, shape)
            checked += 1
            if dtype.is_floating_point:
                got = bps.push_pull(ranked(R, shape, dtype), average=True,
                                    name=f"a.{dtype}.{shape}")
                want = (total(shape).double() / N).to(dtype)
                assert torch.equal(got, want), (dtype, shape, (got - want).abs().max())
                checked += 1
    print("WPH " + json.dumps({
        "rank": R, "local_rank": bps.local_rank(), "local_size": bps.local_size(),
        "host": os.environ["BPSCTL_HOST"], "checked": checked,
        "shm_stage": stage is not None and stage._arena is not None,
        "local_only": stage is not None and stage.local_only,
        "tag": shm.cluster_tag(worker.scheduler_address, worker.security.secret)}), flush=True)
    bps.shutdown()
''')


@pytest.mark.timeout(240)
def test_two_ranks_per_emulated_host_sum_exactly_through_the_shared_memory_stage(tmp_path):
    pytest.importorskip("torch")
    config = Config.from_env({}, state_dir=tmp_path / "state", emulate=True, nic="1gbit",
                             start_timeout_s=60, op_timeout_s=60, shm_bytes=2 * MIB)
    cluster = api.up_emulated(config, workers=2, servers=2)
    try:
        script = tmp_path / "job.py"
        script.write_text(JOB)
        log = io.StringIO()
        result = api.run_local([sys.executable, str(script)], 4, config, stdout=log, stderr=log)
        text = log.getvalue()
        assert result.exit_code == 0, text[-4000:]
        records = {int(m.group(1)): json.loads(m.group(2))
                   for m in re.finditer(r"\[(\d+)\] WPH (.*)", text)}
        assert sorted(records) == [0, 1, 2, 3], text[-4000:]
        hosts = [h["address"] for h in cluster.emulation["workers"]]
        for rank, record in records.items():
            assert (record["local_rank"], record["local_size"]) == (rank % 2, 2), record
            assert record["host"] == hosts[rank // 2], record        # contiguous blocks
            assert record["shm_stage"] and not record["local_only"], record
            assert record["checked"] == 5 * 4 * 2 + 5, record
        # the worker hosts' arenas are gone once the job is over
        assert shm.leftovers(records[0]["tag"]) == []
    finally:
        api.down(config.state_dir)
    assert not [ns for ns in emulate.list_namespaces()
                if ns.startswith(f"bps-{cluster.emulation['cluster_id']}-")]


@pytest.mark.timeout(150)
def test_bench_comm_runs_n_times_k_workers_judged_per_host(tmp_path):
    out = tmp_path / "comm.json"
    before = set(emulate.list_namespaces())
    result = _bpsctl(["bench", "comm", "--emulate", "--nic", "200mbit", "--workers", "2",
                      "--workers-per-host", "2", "--servers", "2", "--size", "4MiB",
                      "--tensors", "2", "--warmup", "1", "--repeats", "2", "--json", str(out)],
                     tmp_path / "state", timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert (report["workers"], report["workers_per_host"], report["worker_hosts"]) == \
        (4, 2, [2, 2])
    assert "4 workers (2 per host on 2 hosts) x 2 servers" in " ".join(result.stderr.split())
    ours = report["results"][0]
    assert ours["system"] == "bpsctl"
    # each host's NIC carries its 2 workers' 4 MiB each way: at 200 Mbit at least ~0.35 s
    assert ours["nic_fraction"] == pytest.approx(
        ideal_seconds("bpsctl", report["size_bytes"], [2, 2], 2, 200) / ours["seconds"])
    assert 0 < ours["nic_fraction"] <= 1.1
    # 2(n-1)/n is the theory of one worker per host only
    assert "theory_speedup" not in report
    assert not namespaces_left_behind(before)               # its hosts are torn down
