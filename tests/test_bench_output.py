"""What `bpsctl bench` (and `bpsctl tune`) shows a user: the workers' result records kept off
the terminal, results tables that fit 80 columns, and one sentence saying what a result means.
The end-to-end runs are in test_bench_comm.py and test_bench_train.py; they use the helpers
here."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from bpsctl.bench.api import _ResultCatcher
from bpsctl.bench.report import print_comm, print_train
from bpsctl.tune.report import print_tune

MiB = 1024 * 1024

# --------------------------------------------------------------------------- helpers


def table_rows(text: str) -> list[str]:
    """The body lines of the results table(s) in a command's output."""
    return [line for line in text.splitlines() if line.startswith("│")]


def assert_table_fits_80(text: str, rows: int) -> None:
    """Every table line fits 80 columns, no cell was cut short, and each of the ``rows`` rows
    is one line (a wrapped cell, such as "bpsctl" over "0.61x", would add lines)."""
    table = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert table, text
    assert all(len(line) <= 80 for line in table), "\n".join(table)
    assert "…" not in "\n".join(table)
    assert len(table_rows(text)) == rows, "\n".join(table)


def sentence(text: str) -> str:
    """The output with its line breaks undone, to look for the summary sentence in."""
    return " ".join(text.split())


def render(print_fn, report: dict) -> str:
    console = Console(width=80, record=True, file=io.StringIO())
    print_fn(console, report)
    return console.export_text()


# --------------------------------------------------------------------------- result records


@pytest.mark.parametrize("prefix", ["[0] ", "[10.77.0.2:0] ", "[fe80::2:0] ",
                                    "[w0.example.com:0] ", ""])
def test_rank_0s_record_is_read_and_no_record_reaches_the_terminal(prefix):
    out = io.StringIO()
    catcher = _ResultCatcher(out)
    catcher.write(prefix.replace("0]", "1]") + 'BPSCTL_RESULT {"rank": 1}\n')
    catcher.write(prefix + "bpsctl iter 1/2: 3.5 img/sec per worker\n")
    catcher.write(prefix + 'BPSCTL_RESULT {"rank": 0}\n')
    catcher.write(prefix.replace("0]", "1]") + "done\n")
    assert catcher.result == {"rank": 0}
    assert out.getvalue() == (prefix + "bpsctl iter 1/2: 3.5 img/sec per worker\n"
                              + prefix.replace("0]", "1]") + "done\n")


def test_a_record_cut_over_writes_is_read_whole():
    out = io.StringIO()
    catcher = _ResultCatcher(out)
    catcher.write("[0] BPSCTL_RES")
    catcher.write('ULT {"seconds": [0.5]}\n[0] after')
    assert catcher.result == {"seconds": [0.5]}
    catcher.write(" it\n[0] BPSCTL_RESULT {\"last\": true}")      # no newline at the end
    assert catcher.result == {"last": True}
    assert out.getvalue() == "[0] after it\n"


def test_lines_that_only_mention_the_marker_are_shown():
    out = io.StringIO()
    catcher = _ResultCatcher(out)
    lines = ["[0] print BPSCTL_RESULT {}\n", "[0] BPSCTL_RESULT not json\n"]
    for line in lines:
        catcher.write(line)
    assert catcher.result is None
    assert out.getvalue() == "".join(lines)


# --------------------------------------------------------------------------- reports


def _comm_row(system: str, seconds: float, nic_fraction: float | None = None, **extra) -> dict:
    algbw = 64 * MiB / seconds / 1e6
    return {"system": system, "version": "v", "seconds": seconds, "seconds_all": [seconds],
            "algbw_MBps": algbw, "busbw_MBps": algbw, "nic_fraction": nic_fraction, **extra}


def comm_report(workers: int = 2, nic: float | None = None, allreduce: float | None = 0.57,
                size: int = 64 * MiB, security: bool = False, hosts_file: str = "") -> dict:
    ours = [_comm_row("bpsctl", 0.9, 0.9 if nic else None)]
    if security:
        ours = [dict(_comm_row("bpsctl", 0.9), security=mode) for mode in ("none", "curve", "hmac")]
    results = [*ours, *([_comm_row("allreduce", 0.9 * allreduce, 0.8 if nic else None)]
                        if allreduce else []),
               *([_comm_row("zmq_raw", 0.03)] if not nic and not hosts_file else [])]
    report = {"kind": "comm", "workers": workers, "servers": workers, "nic_mbit": nic,
              "size_bytes": size, "tensors": 8, "warmup": 3, "repeats": 10, "results": results,
              "speedup": {"allreduce": allreduce} if allreduce else {},
              "theory_speedup": 2 * (workers - 1) / workers}
    if security:
        report["security_cost"] = {"none": 1.0, "curve": 1.3, "hmac": 1.1}
    if hosts_file:
        report.update(cluster="ssh", hosts_file=hosts_file)
    return report


def train_report(speedup: dict[str, float], nic: float | None = None,
                 hosts_file: str = "") -> dict:
    versions = {"bpsctl": "bpsctl 0.1.0", "horovod": "horovod 0.28.1 gloo",
                "ddp": "torch 2.13.0+cpu DDP gloo (bucket 25 MB)",
                "ddp-powersgd": "torch 2.13.0+cpu DDP gloo (one bucket), PowerSGD rank 4"}
    ours = 123.45

    def row(system: str, img_per_sec: float) -> dict:
        step_s = 32 / (img_per_sec / 2)
        # a NIC-bound ideal of 0.2 s per step (none for PowerSGD, none without a NIC rate)
        ideal = 0.2 if nic and system != "ddp-powersgd" else None
        return {"system": system, "version": versions[system], "workers": 2,
                "img_secs_per_worker": [img_per_sec / 2] * 2,
                "img_per_sec_per_worker": img_per_sec / 2, "img_per_sec_per_worker_ci95": 1.5,
                "img_per_sec": img_per_sec, "img_per_sec_ci95": 3.0, "step_seconds": step_s,
                "ideal_step_s": ideal, "nic_fraction": ideal and ideal / step_s}
    report = {"kind": "train", "model": "resnet50", "workers": 2, "servers": 2,
              "batch_size": 32, "nic_mbit": nic, "image_size": 224, "num_classes": 1000,
              "warmup": 2, "iters": 5, "batches_per_iter": 1, "rounds": 1,
              "results": [row("bpsctl", ours)] + [row(s, ours / r) for s, r in speedup.items()],
              "speedup": speedup}
    if hosts_file:
        report.update(cluster="ssh", hosts_file=hosts_file)
    return report


def test_train_table_fits_80_columns_and_says_slower_on_loopback():
    text = render(print_train, train_report({"horovod": 0.83, "ddp": 0.61}))
    assert_table_fits_80(text, rows=3)
    assert any("bpsctl 0.83x" in line for line in table_rows(text))
    assert any("bpsctl 0.61x" in line for line in table_rows(text))
    said = sentence(text)
    assert ("bpsctl was slower: it trained at 0.83× Horovod's speed and 0.61× DDP's on "
            "loopback, where there is no network bottleneck") in said
    assert "try --emulate --nic 1gbit or --hosts." in said
    assert "torch 2.13.0+cpu DDP gloo (bucket 25 MB)" in said        # versions, under the table


def test_one_timed_iteration_shows_no_interval_and_says_how_to_get_one():
    report = train_report({"ddp": 0.9})
    report["iters"] = 1
    for row in report["results"]:
        row["img_per_sec_ci95"] = row["img_per_sec_per_worker_ci95"] = 0.0
    text = render(print_train, report)
    assert "0.00" not in "".join(table_rows(text))
    assert "needs two timed iterations or more (--iters 2)" in text
    assert "--iters 2" not in render(print_train, train_report({"ddp": 0.9}))


def test_a_run_whose_gradients_stayed_on_one_host_says_the_servers_were_unused():
    """The embedded default's path (shm-local): the title says the servers were unused and
    the sentence does not blame them for sharing the workers' cores."""
    report = train_report({"ddp": 0.61})
    report["results"][0]["gradient_path"] = "shm-local"
    text = render(print_train, report)
    assert "2 servers (unused)" in text
    said = sentence(text)
    assert "bpsctl's sums share the workers' CPU cores" in said, said
    assert "the servers share" not in said
    assert "(unused)" not in render(print_train, train_report({"ddp": 0.61}))


def test_train_sentence_on_emulated_nics_and_on_an_ssh_cluster():
    said = sentence(render(print_train, train_report({"horovod": 1.65, "ddp": 1.31}, nic=1000)))
    assert ("bpsctl was faster: it trained at 1.65× Horovod's speed and 1.31× DDP's through "
            "emulated 1000 Mbit/s NICs.") in said
    assert "--emulate" not in said

    said = sentence(render(print_train, train_report({"ddp": 1.0}, hosts_file="/etc/h.yaml")))
    assert "bpsctl trained at 1.00× DDP's speed on the SSH cluster of /etc/h.yaml." in said

    text = render(print_train, train_report({}))
    assert_table_fits_80(text, rows=1)
    assert "add --compare horovod,ddp to see the baselines" in sentence(text)


def test_train_table_shows_the_nic_bound_ideal_beside_each_step_when_the_rate_is_known():
    text = render(print_train, train_report({"horovod": 1.65, "ddp": 1.31, "ddp-powersgd": 2.5},
                                            nic=1000))
    assert_table_fits_80(text, rows=4)
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in table_rows(text)}
    # img/sec, ± 1.96σ, s/step, ideal s/step, NIC frac, speedup
    assert rows["bpsctl"] == ["123.45", "3.00", "0.518", "0.200", "0.39", ""]
    assert rows["ddp"][3:] == ["0.200", "0.29", "bpsctl 1.31x"]
    assert rows["ddp-powersgd"][3:] == ["", "", "bpsctl 2.50x"]        # no ideal for PowerSGD
    assert "ideal" in text and "NIC" in text

    loopback = render(print_train, train_report({"ddp": 0.61}))
    assert "ideal" not in loopback and "per worker" in loopback


@pytest.mark.parametrize("report, rows", [
    (comm_report(), 3),
    (comm_report(security=True), 5),
    ({"kind": "comm", "workers": 2, "servers": 2, "nic_mbit": None,            # several sizes
      "sizes": [comm_report(size=s, security=True) for s in (MiB, 256 * MiB)]}, 10),
    ({"kind": "comm_sweep", "nic_mbit": 1000, "size_bytes": 64 * MiB,          # the widest
      "points": [comm_report(workers=n, nic=1000, allreduce=1.4) for n in (2, 4, 8, 16)]}, 8),
])
def test_comm_tables_fit_80_columns(report, rows):
    assert_table_fits_80(render(print_comm, report), rows)


def test_comm_sentence_says_what_the_point_means():
    said = sentence(render(print_comm, comm_report()))
    assert ("bpsctl's push_pull of 64.0 MiB with 2 workers was slower than ring allreduce "
            "(0.57×; theory 2(n-1)/n = 1.00×) on loopback") in said
    assert "try --emulate --nic 1gbit or --hosts." in said

    sweep = {"kind": "comm_sweep", "nic_mbit": 1000, "size_bytes": 64 * MiB,
             "points": [comm_report(workers=n, nic=1000, allreduce=1.4) for n in (2, 8)]}
    said = sentence(render(print_comm, sweep))
    assert ("with 8 workers was faster than ring allreduce (1.40×; theory 2(n-1)/n = 1.75×) "
            "through emulated 1000 Mbit/s NICs.") in said

    said = sentence(render(print_comm, comm_report(allreduce=None, hosts_file="/etc/h.yaml")))
    assert "MB/s algbw) on the SSH cluster of /etc/h.yaml — add --compare allreduce." in said


def test_tune_table_fits_80_columns_when_the_choice_is_the_current_config():
    point = {"partition_bytes": 512 * 1024, "servers": 2, "credit": 64 * MiB, "score": 1234.5}
    other = dict(point, partition_bytes=4 * MiB, score=1100.0)
    report = {"mode": "tpe", "measurements": 24, "space_points": 120,
              "benchmark": "bench comm: push_pull of 67108864 bytes in 8 tensors, algbw of the "
                           "median of 5 rounds after 2 warm-up",
              "score_unit": "algbw MB/s", "finalists": [point, other], "best": point,
              "baseline": point, "model_guess": None, "model_note": "no traffic model"}
    text = render(print_tune, report)
    assert_table_fits_80(text, rows=2)
    assert "chosen + current" in text
    # with the layout searched, a column of the CPU hosts' share
    point = dict(point, cpu_share=0.6)
    other = dict(other, cpu_share=0.3)
    text = render(print_tune, dict(report, knobs=["partition_bytes", "credit", "layout"],
                                   finalists=[point, other], best=point, baseline=point,
                                   model_layout={"cpu_share": 0.6, "round_factor": 1.2,
                                                 "round_seconds": None, "why": "4 worker hosts"}))
    assert_table_fits_80(text, rows=2)
    assert "0.6" in text and "traffic model 0.600" in text
    assert "pacing" not in text
    # a mixed layout chosen: its round paced by share beside the same point unpaced
    text = render(print_tune, dict(report, knobs=["partition_bytes", "credit", "layout"],
                                   finalists=[point, other], best=point, baseline=point,
                                   model_layout={"cpu_share": 0.6, "round_factor": 1.2,
                                                 "round_seconds": None, "why": "4 worker hosts"},
                                   unpaced={"score": point["score"] / 1.1, "passes": [1.0]}))
    assert "paced by share" in text and "1.10x" in text


def test_top_level_help_describes_all_of_bpsctl():
    from typer.testing import CliRunner

    from bpsctl.cli import app
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    said = sentence(result.output)
    assert "Everything runs on this machine" not in said
    for words in ("local processes", "--emulate", "--hosts", "over SSH", "Horovod", "DDP",
                  "bpsctl tune"):
        assert words in said, words


def test_comm_says_the_layout_it_ran_on_beside_the_pure_layouts():
    report = comm_report(workers=4, nic=500.0, allreduce=1.3)
    unit = 1.122
    report["theory_speedup"] = 1.25
    report["layout"] = {"worker_hosts": 4, "cpu_hosts": 2, "shares": [0.3, 0.3] + [0.1] * 4,
                        "server_hosts": ["c0", "c1", "w0", "w1", "w2", "w3"],
                        "colocated": [False, False, True, True, True, True],
                        "model_seconds": 1.2 * unit, "colocated_only_seconds": 1.5 * unit,
                        "cpu_hosts_only_seconds": 2.0 * unit, "measured_over_model": 1.05}
    text = render(print_comm, report)
    said = sentence(text)
    assert "layout: 4 worker host(s) sum 0.100, 2 CPU host(s) sum 0.300 of the bytes each" in said
    assert "modelled round 1.346 s (servers on the 4 worker hosts only 1.683 s, on the 2 CPU " \
           "hosts only 2.244 s); measured 1.05x the model" in said
    assert "theory t_allreduce/t_layout = 1.25×" in said


def ops_report(size: int = 64 * MiB, nic: float | None = None, horovod: bool = True) -> dict:
    """A `bench comm --op` report of the four collectives (and push_pull beside allreduce)."""
    rows = []
    speedup = {}
    for op, ratio in (("allreduce", 1.25), ("push_pull", None), ("allgather", 0.5),
                      ("alltoall", 0.4), ("reducescatter", 1.1)):
        for system in ("bpsctl", "horovod") if horovod and ratio else ("bpsctl",):
            seconds = 0.5 * (ratio if system == "horovod" else 1.0)
            rows.append({"op": op, "system": system, "version": system, "seconds": seconds,
                         "seconds_all": [seconds], "bytes": size,
                         "bytes_of": "output" if op == "allgather" else "input",
                         "algbw_MBps": size / seconds / 1e6,
                         "busbw_MBps": size / seconds / 1e6 * 1.5, "checked": True})
        if horovod and ratio:
            speedup[op] = ratio
    return {"kind": "comm", "ops": ["allreduce", "allgather", "alltoall", "reducescatter"],
            "reduce": "average", "workers": 4, "servers": 4, "nic_mbit": nic,
            "size_bytes": size, "workers_per_host": 1, "worker_hosts": [1, 1, 1, 1],
            "tensors": 8, "warmup": 3, "repeats": 10, "host": "h", "device": "cpu",
            "results": rows, "speedup": speedup}


def test_ops_table_has_a_row_per_op_and_system_and_says_the_ratio_bpsctl_over_horovod():
    several = {"kind": "comm", "ops": ["allreduce"], "workers": 4, "servers": 4,
               "nic_mbit": 1000, "sizes": [ops_report(s, nic=1000) for s in (MiB, 256 * MiB)]}
    assert_table_fits_80(render(print_comm, several), rows=18)            # the widest
    text = render(print_comm, ops_report(nic=1000))
    assert_table_fits_80(text, rows=9)
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in table_rows(text)]
    assert [row[:2] for row in rows[:3]] == [["allreduce", "bpsctl"], ["allreduce", "horovod"],
                                             ["push_pull", "bpsctl"]]
    assert rows[1][-1] == "1.25x" and rows[0][-1] == "" and rows[4][-1] == "0.50x"
    said = sentence(text)
    assert ("bpsctl/Horovod for 64.0 MiB with 4 workers through emulated 1000 Mbit/s NICs, on "
            "hosts that share this machine's CPU cores: allreduce 1.25×, allgather 0.50×, "
            "alltoall 0.40×, reducescatter 1.10× (Horovod's time over bpsctl's; above 1, bpsctl "
            "is faster).") in said
    assert "allgather: each rank's gathered output" in said
    alone = sentence(render(print_comm, ops_report(horovod=False)))
    assert "bpsctl's collectives of 64.0 MiB with 4 workers on loopback" in alone
    assert "add --compare horovod" in alone
