"""A server's allocator: jemalloc when it is installed (with glibc's malloc a server's heap kept
the worst burst of pushes it had seen, the load run's RSS growth; see engine/common.py
``exec_with_jemalloc``), glibc's malloc when BPSCTL_SERVER_MALLOC=glibc asks for it."""
from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, run_job

from bpsctl.config import Config, ConfigError
from bpsctl.engine import Worker
from bpsctl.launch import api

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


@pytest.fixture
def jemalloc_installed():
    """Skips without jemalloc, except under CI, whose .ci/run installs libjemalloc2."""
    if ctypes.util.find_library("jemalloc") is None:
        message = "libjemalloc.so.2 is not installed (apt-get install libjemalloc2)"
        if IN_CI:
            pytest.fail(f"{message} under CI: .ci/run installs it")
        pytest.skip(message)


def test_the_allocator_choice_is_checked():
    assert Config(server_malloc="glibc").server_malloc == "glibc"
    with pytest.raises(ConfigError, match="BPSCTL_SERVER_MALLOC: expected auto or glibc"):
        Config(server_malloc="tcmalloc")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_a_server_runs_on_jemalloc_unless_told_to_use_glibc(jemalloc_installed, choice):
    with api.local_cluster(cluster_config(server_malloc=choice), servers=1) as cluster:
        server, = [p for p in cluster.processes if p.role == "server"]
        # the launcher's recorded pid is the process that serves: the server re-executes itself
        # in place (same pid) with jemalloc preloaded
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        assert ("libjemalloc" in maps) == (choice == "auto"), choice

        def body(w: Worker):
            return w.push_pull(np.full(300_000, w.rank + 1, np.float32), name="x", average=False)

        for result in run_job(cluster, 2, 1, body):
            np.testing.assert_array_equal(result, np.full(300_000, 3, np.float32))
        log = (Path(cluster.state_dir) / "logs" / "server-0.log").read_text()
    expected = ("allocator: jemalloc" if choice == "auto"
                else "allocator: glibc's malloc (BPSCTL_SERVER_MALLOC=glibc)")
    assert expected in log, log
