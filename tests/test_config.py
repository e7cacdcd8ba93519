"""Every knob read once: sizes and rates as users write them, BPSCTL_* and torchrun's variables."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bpsctl.config import Config, ConfigError, parse_rate_mbit, parse_size

# --------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("text,expected", [
    ("64MiB", 64 * 1024**2),
    ("4MB", 4_000_000),
    ("4096000", 4_096_000),
    ("4mb", 4_000_000),
    ("4 MB", 4_000_000),
    (" 8k ", 8192),
    ("8K", 8192),
    ("1KB", 1000),
    ("1KiB", 1024),
    ("2G", 2 * 1024**3),
    ("2GB", 2_000_000_000),
    ("1TiB", 1024**4),
    ("1.5KiB", 1536),
    ("512B", 512),
    ("0", 0),
    (4096, 4096),
])
def test_sizes_as_users_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5", "4 parsecs", "1e6", "4MiBs", "MiB", "4 M B",
                                  "0x10", "4,096"])
def test_a_bad_size_names_the_setting_and_the_expected_form(text):
    expected = f"--partition-bytes: expected a size such as 4096000, 4MB or 64MiB, got {text!r}"
    with pytest.raises(ConfigError, match="^" + re.escape(expected) + "$"):
        parse_size(text, "--partition-bytes")


def test_a_negative_or_boolean_size_is_refused():
    with pytest.raises(ConfigError, match="^size: must not be negative, got -1$"):
        parse_size(-1)
    with pytest.raises(ConfigError, match="^size: expected a size"):
        parse_size(True)


# --------------------------------------------------------------------------- rates

@pytest.mark.parametrize("text,expected", [
    ("500mbit", 500.0),
    ("1gbit", 1000.0),
    ("1Gbit", 1000.0),
    ("1.5gbit", 1500.0),
    ("100kbit", 0.1),
    ("2tbit", 2e6),
    ("10mbps", 80.0),          # *bps forms are bytes per second
    ("1gbps", 8000.0),
    (" 1 gbit ", 1000.0),
])
def test_rates_in_megabits(text, expected):
    assert parse_rate_mbit(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "500", "0mbit", "-1mbit", "1 gigabit", "", "mbit"])
def test_a_bad_rate_names_the_setting_and_the_expected_form(text):
    with pytest.raises(ConfigError,
                       match=r"^--nic: expected a rate such as 500mbit or 1gbit, got "):
        parse_rate_mbit(text, "--nic")


# --------------------------------------------------------------------------- from the environment

def test_no_variables_give_the_defaults():
    assert Config.from_env({}) == Config()
    config = Config()
    assert (config.partition_bytes, config.credit_bytes, config.rank, config.world_size) == (
        2 * 2**20, 64 * 2**20, -1, 1)


def test_bpsctl_variables_are_parsed_by_kind(tmp_path):
    config = Config.from_env({
        "BPSCTL_PARTITION_BYTES": "64MiB", "BPSCTL_CREDIT_BYTES": "4MB",
        "BPSCTL_START_TIMEOUT": "2.5", "BPSCTL_SCHEDULER": "10.0.0.5:9000",
        "BPSCTL_NUM_SERVERS": "3", "BPSCTL_STATE_DIR": "~/clusters/a", "BPSCTL_ROLE": "server",
        "BPSCTL_RANK": "1", "BPSCTL_WORLD_SIZE": "4", "BPSCTL_JOB_ID": "job-7",
        "BPSCTL_HEARTBEAT_INTERVAL": "0.1", "BPSCTL_HEARTBEAT_TIMEOUT": "1"})
    assert config.partition_bytes == 64 * 1024**2 and config.credit_bytes == 4_000_000
    assert config.start_timeout_s == 2.5 and config.scheduler == "10.0.0.5:9000"
    assert config.num_servers == 3 and config.role == "server" and config.job_id == "job-7"
    assert (config.rank, config.world_size) == (1, 4)
    assert (config.heartbeat_interval_s, config.heartbeat_timeout_s) == (0.1, 1.0)
    assert config.state_dir == Path("~/clusters/a").expanduser()


def test_torchrun_variables_are_the_fallback():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    config = Config.from_env(env)
    assert (config.rank, config.world_size, config.local_rank, config.local_size) == (2, 4, 0, 2)
    # BPSCTL_* wins; an empty one counts as unset
    config = Config.from_env({**env, "BPSCTL_RANK": "3", "BPSCTL_WORLD_SIZE": ""})
    assert (config.rank, config.world_size) == (3, 4)


def test_overrides_win_over_the_environment():
    config = Config.from_env({"BPSCTL_WORLD_SIZE": "8", "BPSCTL_ROLE": "server"}, role="worker",
                             world_size=2)
    assert (config.role, config.world_size) == ("worker", 2)


def test_to_env_gives_a_child_the_same_config(tmp_path):
    config = Config(role="server", rank=1, world_size=3, partition_bytes=12345,
                    scheduler="127.0.0.1:9000", secret="s3", state_dir=tmp_path,
                    start_timeout_s=2.5, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    assert Config.from_env(config.to_env()) == config


def test_every_knob_has_its_own_variable():
    names = [env for _, env, _, _ in Config.describe()]
    # BPSCTL_*, except the rendezvous address every torchrun-style script already reads
    assert all(name.startswith("BPSCTL_") or name in ("MASTER_ADDR", "MASTER_PORT")
               for name in names), names
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("env,message", [
    ({"BPSCTL_WORLD_SIZE": "two"}, "BPSCTL_WORLD_SIZE: expected an integer, got 'two'"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE: expected an integer, got 'two'"),
    ({"RANK": "first"}, "RANK: expected an integer, got 'first'"),
    ({"BPSCTL_PARTITION_BYTES": "lots"}, "BPSCTL_PARTITION_BYTES: expected a size such as"),
    ({"BPSCTL_CREDIT_BYTES": "-1MB"}, "BPSCTL_CREDIT_BYTES: expected a size such as"),
    ({"BPSCTL_OP_TIMEOUT": "soon"}, "BPSCTL_OP_TIMEOUT: expected a number of seconds, got 'soon'"),
    ({"BPSCTL_PARTITION_BYTES": "4"}, "BPSCTL_PARTITION_BYTES: expected at least 8 bytes, got 4"),
    ({"BPSCTL_CREDIT_BYTES": "0"}, "BPSCTL_CREDIT_BYTES: expected at least 1 byte, got 0"),
    ({"BPSCTL_WORLD_SIZE": "0"}, "BPSCTL_WORLD_SIZE: expected at least 1, got 0"),
    ({"BPSCTL_RANK": "2", "BPSCTL_WORLD_SIZE": "2"},
     r"BPSCTL_RANK: expected -1 or 0\.\.1 \(world size 2\), got 2"),
    ({"BPSCTL_LOCAL_RANK": "1"}, r"BPSCTL_LOCAL_RANK: expected 0\.\.0, got 1"),
    ({"BPSCTL_SCHEDULER": "nohost"},
     "BPSCTL_SCHEDULER: expected host:port such as 127.0.0.1:9000, got 'nohost'"),
    ({"BPSCTL_SCHEDULER": "h:99999"}, "BPSCTL_SCHEDULER: expected host:port"),
    ({"BPSCTL_ROLE": "boss"}, "BPSCTL_ROLE: expected scheduler, server or worker, got 'boss'"),
    ({"BPSCTL_PORT": "70000"}, r"BPSCTL_PORT: expected 0\.\.65535, got 70000"),
    ({"BPSCTL_SERVER_THREADS": "0"}, r"BPSCTL_SERVER_THREADS: expected 1\.\.64, got 0"),
    ({"BPSCTL_IO_THREADS": "17"}, r"BPSCTL_IO_THREADS: expected 0 \(auto\) or 1\.\.16, got 17"),
    ({"BPSCTL_NUM_SERVERS": "-1"}, "BPSCTL_NUM_SERVERS: expected 0 \\(all\\) or more, got -1"),
    ({"BPSCTL_SERVER_MALLOC": "tcmalloc"},
     "BPSCTL_SERVER_MALLOC: expected auto or glibc, got 'tcmalloc'"),
    ({"BPSCTL_IDLE_RELEASE": "-1"},
     "BPSCTL_IDLE_RELEASE: expected 0 \\(never\\) or more seconds, got -1.0"),
    ({"BPSCTL_START_TIMEOUT": "0"}, "BPSCTL_START_TIMEOUT: expected more than 0 s, got 0.0"),
    ({"BPSCTL_OP_TIMEOUT": "-3"}, "BPSCTL_OP_TIMEOUT: expected more than 0 s, got -3.0"),
    ({"BPSCTL_HEARTBEAT_INTERVAL": "1", "BPSCTL_HEARTBEAT_TIMEOUT": "0.5"},
     "BPSCTL_HEARTBEAT_TIMEOUT: expected more than the heartbeat interval, got 0.5"),
])
def test_an_invalid_value_names_its_variable(env, message):
    with pytest.raises(ConfigError, match="^" + message):
        Config.from_env(env)


def test_a_config_error_is_a_value_error_and_the_config_is_frozen():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(AttributeError):
        Config().rank = 3          # type: ignore[misc]
