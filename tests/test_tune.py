"""`bpsctl tune` and the tuned config file: the traffic model, the file's format and errors,
precedence (flags > BPSCTL_* > file > defaults), the engine using a tuned file, and a small
tuning run end to end on emulated hosts (root)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bpsctl.config import (
    Config,
    ConfigError,
    default_config_file,
    find_config_file,
    read_config_file,
    tomllib,
)
from bpsctl.model import guess_servers, round_seconds, summation_split
from bpsctl.tune.api import PARTITION_SIZES, Point, Space, TuneSettings, rank_finalists
from bpsctl.tune.report import tuned_file_text

REPO_ROOT = Path(__file__).resolve().parents[1]
KiB = 1024


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private config home and state dir: no tuned file of the machine leaks in."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    for name in ("BPSCTL_CONFIG", "BPSCTL_PARTITION_BYTES", "BPSCTL_CREDIT_BYTES",
                 "BPSCTL_NUM_SERVERS"):
        monkeypatch.delenv(name, raising=False)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def bpsctl(env, *args: str, timeout_s: float = 120,
           **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bpsctl.cli", *args], env={**env, **extra_env},
                          text=True, capture_output=True, timeout=timeout_s)


def tuned_file(path: Path, knobs: str,
               header: str = '[bpsctl]\nformat = "tuned-config"\nversion = 1\n') -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n[knobs]\n" + textwrap.dedent(knobs))
    return path


# --------------------------------------------------------------------------- the traffic model

def test_model_dedicated_servers_match_the_workers_bandwidth():
    workers = [f"w{i}" for i in range(4)]
    servers = [f"s{i}" for i in range(6)]
    guess = guess_servers(workers, servers, nic_mbit=1000, size_bytes=32 * 2**20)
    assert guess.servers == 4                       # k >= n at equal NIC rates, no more
    one = round_seconds(32 * 2**20, workers, servers[:1], 1000)
    assert one == pytest.approx(4 * guess.round_seconds)     # one server carries n·S
    assert guess_servers(workers, servers[:2], 1000, 1e6).servers == 2   # fewer hosts: all


def test_the_model_keeps_its_documented_name():
    """bpsctl.model is the traffic model; bpsctl.tune.model, the name the design notes list
    among the stable interfaces, gives the same objects."""
    import bpsctl.model
    import bpsctl.tune.model
    for name in bpsctl.tune.model.__all__:
        assert getattr(bpsctl.tune.model, name) is getattr(bpsctl.model, name), name
    documented = {"optimal_shares", "plan_layout", "job_shares", "Layout"}
    assert documented <= set(bpsctl.tune.model.__all__)


def test_model_colocated_split_is_bytepss_optimum():
    n, k = 4, 2
    x, y, factor = summation_split(n, k)
    assert (x, y, factor) == pytest.approx((0.3, 0.1, 1.2))
    assert summation_split(n, 0)[2] == pytest.approx(2 * (n - 1) / n)    # allreduce's cost
    assert summation_split(n, n)[2] == pytest.approx(1.0)                # PS with k = n
    workers, cpus = [f"w{i}" for i in range(n)], [f"c{i}" for i in range(k)]
    rate_bytes = 1000e6 / 8 * 0.957
    # the per-host traffic model agrees with the closed form at the optimal shares ...
    assert round_seconds(rate_bytes, workers, cpus + workers, 1000,
                         [x] * k + [y] * n) == pytest.approx(factor)
    # ... and an even split over the same servers is slower
    assert round_seconds(rate_bytes, workers, cpus + workers, 1000) > factor * 1.01


# --------------------------------------------------------------------------- search space

def test_space_covers_the_knobs_asked_for_and_keeps_the_rest():
    config = Config(partition_bytes=4096000, credit_bytes=16384000, num_servers=2)
    full = Space.build(config, TuneSettings(), cluster_servers=4)
    assert len(full) == 6 * 4 * 3
    assert full.partitions[0] == 64 * KiB and full.partitions[-1] == 64 * 2**20
    assert {p.credit_bytes // p.partition_bytes for p in full} == {2, 8, 32}
    only_credit = Space.build(config, TuneSettings(knobs=("credit",)), cluster_servers=4)
    assert {(p.partition_bytes, p.servers) for p in only_credit} == {(4096000, 2)}
    assert len(only_credit) == 3
    only_partition = Space.build(config, TuneSettings(knobs=("partition_bytes",)), 4)
    assert {p.credit_bytes for p in only_partition} == {16384000}
    assert full.nearest(4096000, 2, 16384000) == {"partition": 3, "servers": 1, "credit": 0,
                                                  "layout": 0}
    assert PARTITION_SIZES == full.partitions


def test_the_current_config_is_kept_when_no_leader_of_the_search_beats_it():
    """The finalists' re-measured medians decide, the current config's among them: a leader
    of the search that then does no better than the current config is not chosen (a tuned
    file would otherwise change the knobs for nothing), and one that does better is."""
    current, big, small = Point(2 << 20, 16, 64 << 20), Point(64 << 20, 16, 512 << 20), \
        Point(256 << 10, 16, 8 << 20)
    search = {big: 16628.5, small: 16500.0}
    ranked = rank_finalists({big: [16506.2, 16690.3], current: [16446.8, 16874.7]}, current,
                            search)
    assert ranked[0]["current"] and ranked[0]["score"] == pytest.approx(16660.75)
    assert ranked[1]["partition_bytes"] == 64 << 20 and ranked[1]["search_score"] == 16628.5
    ranked = rank_finalists({big: [16506.2, 16690.3], small: [19100.0, 19700.0, 19500.0],
                             current: [16446.8, 16874.7]}, current, search)
    assert [(f["partition_bytes"], f["credit"], f["current"]) for f in ranked] == [
        (256 << 10, 8 << 20, False), (2 << 20, 64 << 20, True), (64 << 20, 512 << 20, False)]
    assert ranked[0]["score"] == 19500.0 and ranked[1]["search_score"] is None


@pytest.mark.parametrize("kwargs,message", [
    ({"knobs": ("bytes",)}, "knobs to tune are partition_bytes, servers, credit"),
    ({"trials": 0}, "--trials: expected at least 1"),
    ({"size_bytes": 16, "tensors": 8}, "--size: 16 bytes is too small"),
    ({"replay": "h200-resnet50"}, "--replay: tune scores a replay by training; add --model"),
    ({"model": "vgg16", "replay": "h200-resnet50"}, "a profile of resnet50, not vgg16"),
    ({"model": "resnet50", "replay": "no-such-profile"}, "neither a file nor a shipped profile"),
    ({"model": "resnet50", "target_nic_mbit": 25000.0}, "--target-nic: only a replay can be"),
])
def test_bad_tune_settings_say_what_is_expected(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TuneSettings(**kwargs)


# --------------------------------------------------------------------------- the file

def test_the_file_tune_writes_reads_back_as_the_chosen_knobs(tmp_path):
    report = {"knobs": ["partition_bytes", "servers", "credit"],
              "best": {"partition_bytes": 512 * KiB, "servers": 3, "credit": 4 * 2**20,
                       "score": 111.5},
              "baseline": {"score": 55.0}, "cluster": "emulated cluster: \"quoted\" hosts",
              "nic_mbit": 1000.0, "workers": 4, "servers": 4, "benchmark": "bench comm",
              "score_unit": "algbw MB/s", "mode": "tpe", "measurements": 21}
    path = tmp_path / "tuned.toml"
    path.write_text(tuned_file_text(report, "bpsctl tune --emulate"))
    assert read_config_file(path) == {"partition_bytes": 512 * KiB, "num_servers": 3,
                                      "credit_bytes": 4 * 2**20}
    provenance = tomllib.loads(path.read_text())["tuned"]
    assert provenance["cluster"] == 'emulated cluster: "quoted" hosts'
    assert {"command", "nic_mbit", "date", "bpsctl_version", "score"} <= set(provenance)


def test_precedence_flags_then_environment_then_file_then_defaults(tmp_path):
    path = tuned_file(tmp_path / "t.toml", """\
        partition_bytes = "512KiB"
        credit_bytes = 2097152
        num_servers = 3
        """)
    from_file = Config.from_env({}, file=path)
    assert (from_file.partition_bytes, from_file.credit_bytes, from_file.num_servers) == (
        512 * KiB, 2 * 2**20, 3)
    assert from_file.server_threads == Config().server_threads          # not in the file
    environ = {"BPSCTL_PARTITION_BYTES": "1MiB"}
    assert Config.from_env(environ, file=path).partition_bytes == 2**20
    assert Config.from_env(environ, file=path, partition_bytes=64 * KiB).partition_bytes == 64 * KiB
    assert Config.from_env(environ, file=path).credit_bytes == 2 * 2**20
    assert Config.from_env({}).partition_bytes == 2 * 2**20              # no file: the default


def test_where_the_file_is_looked_for(tmp_path):
    xdg = tmp_path / "xdg"
    environ = {"XDG_CONFIG_HOME": str(xdg)}
    assert default_config_file(environ) == xdg / "bpsctl" / "tuned.toml"
    assert default_config_file({"XDG_CONFIG_HOME": "relative"}) == \
        Path("~/.config/bpsctl/tuned.toml").expanduser()
    assert find_config_file(None, environ) is None                      # nothing there: none
    default = tuned_file(xdg / "bpsctl" / "tuned.toml", "num_servers = 2\n")
    assert find_config_file(None, environ) == default
    other = tuned_file(tmp_path / "other.toml", "num_servers = 1\n")
    assert find_config_file(None, {**environ, "BPSCTL_CONFIG": str(other)}) == other
    assert find_config_file(default, {**environ, "BPSCTL_CONFIG": str(other)}) == default
    with pytest.raises(ConfigError, match=r"^--config: .*missing.toml is not a file$"):
        find_config_file(tmp_path / "missing.toml", environ)
    with pytest.raises(ConfigError, match=r"^BPSCTL_CONFIG: .*gone.toml is not a file$"):
        find_config_file(None, {"BPSCTL_CONFIG": str(tmp_path / "gone.toml")})


HEADER = '[bpsctl]\nformat = "tuned-config"\nversion = 1\n'


@pytest.mark.parametrize("text,message", [
    (HEADER + "[knobs]\npartition_bytes = 512KiB\n", r"not valid TOML: .*line 5"),
    (HEADER + "[knobs]\npartiton_bytes = 1\n",
     r"\[knobs\] partiton_bytes: not a knob a config file sets; expected one of partition_bytes, "),
    (HEADER + "[knobs]\npartition_bytes = \"lots\"\n",
     r"\[knobs\] partition_bytes: expected a size such as 4096000, 4MB or 64MiB, got 'lots'"),
    (HEADER + "[knobs]\npartition_bytes = 4\n",
     r"\[knobs\] partition_bytes: expected at least 8 bytes, got 4"),
    (HEADER + "[knobs]\nnum_servers = 1.5\n", r"\[knobs\] num_servers: expected an integer"),
    (HEADER + "[knobs]\nnum_servers = [1, 2]\n",
     r"\[knobs\] num_servers: expected an integer, got \[1, 2\]"),
    (HEADER + "[knobs]\nrole = \"server\"\n", r"\[knobs\] role: not a knob a config file sets"),
    (HEADER + "[extra]\na = 1\n",
     r"extra: expected only the tables \[bpsctl\], \[knobs\], \[tuned\]"),
    ('[project]\nname = "bpsctl"\n', r"not a bpsctl tuned config: expected a \[bpsctl\] table "
                                     r"with format = 'tuned-config'"),
    ('[bpsctl]\nformat = "tuned-config"\nversion = 2\n',
     r"\[bpsctl\] version: this bpsctl reads version 1, got 2"),
    ("\xff\xfe binary", r"not valid TOML"),
])
def test_a_malformed_or_foreign_file_names_the_file_the_key_and_the_expected(tmp_path, text,
                                                                             message):
    path = tmp_path / "bad.toml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match="^" + str(path) + ": " + message):
        read_config_file(path)


def test_commands_refuse_a_bad_file_with_exit_2_but_down_still_works(env, tmp_path):
    bad = tuned_file(tmp_path / "xdg" / "bpsctl" / "tuned.toml", "partition_bytes = 4\n")
    for args in (["run", "-np", "1", "--", "true"], ["up"], ["bench", "comm", "--workers", "1"],
                 ["tune", "--trials", "1"]):
        result = bpsctl(env, *args)         # 120 s: the CLI starts slowly on a loaded machine
        assert result.returncode == 2, (args, result.stderr)
        assert f"{bad}: [knobs] partition_bytes: expected at least 8 bytes, got 4" in \
            " ".join(result.stderr.split()), result.stderr
    explicit = bpsctl(env, "run", "--config", str(tmp_path / "none.toml"), "--", "true")
    assert explicit.returncode == 2 and "none.toml is not a file" in explicit.stderr
    # the file only concerns the commands that start engine processes
    assert bpsctl(env, "down").returncode == 0
    assert bpsctl(env, "status").returncode == 0


# --------------------------------------------------------------------------- the engine uses it

# what the engine made of a 4 MiB tensor: its partitions and the servers they went to
PARTS_SCRIPT = textwrap.dedent("""
    import numpy as np, bpsctl.engine as bps
    bps.init()
    bps.push_pull(np.ones(1 << 20, dtype=np.float32), name="g")
    parts = bps._w()._tensors["g"]["parts"]
    print("PARTS", len(parts), len({p[1] for p in parts}), bps._w().config.credit_bytes,
          flush=True)
    bps.shutdown()
""")


def _parts(result: subprocess.CompletedProcess) -> tuple[int, int, int]:
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "PARTS" in line)
    return tuple(int(v) for v in line.split("PARTS")[1].split())


@pytest.mark.timeout(240)
def test_run_and_up_use_the_tuned_file_unless_overridden(env, tmp_path):
    script = tmp_path / "parts.py"
    script.write_text(PARTS_SCRIPT)
    path = tuned_file(tmp_path / "t.toml", """\
        partition_bytes = "256KiB"
        credit_bytes = "1MiB"
        num_servers = 3
        """)
    run = ["run", "-np", "2", "--config", str(path), "--", sys.executable, str(script)]
    # 4 MiB in 256 KiB partitions over 3 servers (the private cluster starts 3 of them)
    assert _parts(bpsctl(env, *run)) == (16, 3, 2**20)
    # BPSCTL_* beats the file; --servers beats num_servers for the private cluster's size
    assert _parts(bpsctl(env, *run, BPSCTL_PARTITION_BYTES="1MiB", BPSCTL_NUM_SERVERS="2")) == \
        (4, 2, 2**20)
    # the default location, without --config
    tuned_file(tmp_path / "xdg" / "bpsctl" / "tuned.toml",
               "partition_bytes = 2097152\npartition_depth = 0\n")
    # (one worker through the servers all the same: a job of one sends nothing otherwise)
    assert _parts(bpsctl(env, "run", "-np", "1", "--", sys.executable, str(script),
                         BPSCTL_FORCE_DISTRIBUTED="1"))[0] == 2
    # up starts as many servers as the file's num_servers, unless --servers says otherwise
    up = bpsctl(env, "up", "--config", str(path))
    try:
        assert up.returncode == 0, up.stderr
        status = json.loads(bpsctl(env, "status", "--json").stdout)
        assert sum(p["role"] == "server" for p in status["processes"]) == 3
    finally:
        assert bpsctl(env, "down").returncode == 0


@pytest.mark.timeout(180)
def test_bench_reads_the_file_and_its_flags_win(env, tmp_path):
    path = tuned_file(tmp_path / "t.toml", """\
        partition_bytes = "256KiB"
        credit_bytes = "1MiB"
        """)
    common = ["bench", "comm", "--workers", "1", "--servers", "1", "--size", "1MiB",
              "--tensors", "1", "--warmup", "0", "--repeats", "1", "--no-raw", "--json", "-",
              "--config", str(path)]
    report = json.loads(bpsctl(env, *common).stdout)
    assert (report["partition_bytes"], report["credit_bytes"]) == (256 * KiB, 2**20)
    report = json.loads(bpsctl(env, *common, "--partition-bytes", "128KiB").stdout)
    assert (report["partition_bytes"], report["credit_bytes"]) == (128 * KiB, 2**20)


# --------------------------------------------------------------------------- end to end

@pytest.mark.timeout(300)
def test_tuning_for_a_replayed_gpu_cluster_scores_in_the_target_nics_time(env, tmp_path):
    """`tune --model M --replay PROFILE --target-nic RATE` tunes for a recorded GPU step's
    compute-to-network ratio: every point trains the replay's stand-in on the emulated hosts,
    dilated, and is scored in the target cluster's img/sec (25 Gbit here: an H200 step of
    ResNet50 is ~32 ms, so 2 workers of batch 64 train thousands of images a second, where the
    dilated run itself counts some 25 times fewer). `--target-cpu 25` dilates the worker hosts'
    CPU with it: one CPU each at x25."""
    out, report_file = tmp_path / "tuned.toml", tmp_path / "tune.json"
    result = bpsctl(env, "tune", "--emulate", "--workers", "2", "--servers", "2", "--nic", "1gbit",
                    "--model", "resnet50", "--replay", "h200-resnet50", "--target-nic", "25gbit",
                    "--target-cpu", "25",
                    "--credit", "--trials", "1", "--warmup", "1", "--repeats", "1",
                    "--finalists", "1", "--final-passes", "1", "--out", str(out),
                    "--json", str(report_file), timeout_s=280)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    assert report["benchmark"].startswith("bench resnet50 replaying h200-resnet50 (img/sec in "
                                          "the time of a 25gbit NIC, 25 cores a worker host at "
                                          "1 of a CPU)"), report["benchmark"]
    assert report["host_cpu"] == 1
    assert report["score_unit"] == "img/sec" and report["knobs"] == ["credit"]
    for trial in report["trials"]:
        # 128 images a step of at least the profile's 32 ms: at most 4,000 img/sec; undilated
        # (the emulated hosts' own time, x25 slower) it would be under 160
        assert 1000 < trial["score"] < 4000, trial
        assert trial["credit"] // trial["partition_bytes"] in (2, 8, 32)
    assert read_config_file(out)["credit_bytes"] == report["best"]["credit"]


@pytest.mark.timeout(300)
def test_a_small_tuning_run_on_emulated_hosts(env, tmp_path):
    out, report_file = tmp_path / "tuned.toml", tmp_path / "tune.json"
    plot, table = tmp_path / "tune.png", tmp_path / "trials.csv"
    result = bpsctl(env, "tune", "--emulate", "--workers", "2", "--servers", "2", "--nic", "1gbit",
                    "--size", "4MiB", "--trials", "4", "--warmup", "1", "--repeats", "2",
                    "--finalists", "2", "--final-passes", "2", "--out", str(out),
                    "--json", str(report_file), "--plot", str(plot), "--csv", str(table),
                    timeout_s=280)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    assert report["kind"] == "tune" and report["config"] == str(out)
    assert report["nic_mbit"] == 1000 and report["workers"] == 2 and report["servers"] == 2
    stages = [t["stage"] for t in report["trials"]]
    assert stages[0] == "baseline" and stages.count("search") == 4
    # the 2 leaders, and the current config unless it leads, twice each, interleaved
    contenders = report["finalists"]
    assert len(contenders) in (2, 3) and stages.count("final") == 2 * len(contenders)
    assert sum(f["current"] for f in contenders) == 1
    best = report["best"]
    assert best["score"] >= max(f["score"] for f in contenders if not f["current"])
    assert best["score"] == pytest.approx(sum(best["passes"]) / 2)      # median of 2 passes
    assert report["improvement"] == pytest.approx(best["score"] / report["baseline"]["score"])
    for trial in report["trials"]:
        assert {"partition_bytes", "servers", "credit", "score"} <= set(trial)
        assert trial["score"] > 0 and 1 <= trial["servers"] <= 2
    if best["current"]:         # no leader beat the current config: the tuned file keeps it
        first = report["trials"][0]                     # measured at the current config
        assert (best["partition_bytes"], best["servers"], best["credit"]) == \
            (first["partition_bytes"], first["servers"], first["credit"])
    else:
        assert best["partition_bytes"] in PARTITION_SIZES
        assert best["credit"] // best["partition_bytes"] in (2, 8, 32)
    assert report["model_guess"]["servers"] == 2      # 2 dedicated server hosts for 2 workers
    assert "traffic model 2" in result.stderr          # shown beside the measured answer
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(report["trials"])
    assert float(rows[1]["score"]) == pytest.approx(report["trials"][1]["score"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_config_file(out) == {"partition_bytes": best["partition_bytes"],
                                     "num_servers": best["servers"], "credit_bytes": best["credit"]}
    provenance = tomllib.loads(out.read_text())["tuned"]
    assert provenance["nic_mbit"] == 1000 and "emulated cluster: 2 worker hosts" in \
        provenance["cluster"]
    assert provenance["command"].startswith("bpsctl tune --emulate")
    assert provenance["score"] == pytest.approx(best["score"])
