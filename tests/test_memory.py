"""Memory. A server's allocator: jemalloc when it is installed (with glibc's malloc a server's
heap kept the worst burst of pushes it had seen, the load run's RSS growth; see engine/common.py
``exec_with_jemalloc``), glibc's malloc when BPSCTL_SERVER_MALLOC=glibc asks for it. And what
servers and workers give back once quiet for BPSCTL_IDLE_RELEASE seconds (release_free_memory)."""
from __future__ import annotations

import ctypes.util
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cluster_config, run_job

from bpsctl.config import Config, ConfigError
from bpsctl.engine import Worker
from bpsctl.engine.common import jemalloc_preload, rss_bytes
from bpsctl.launch import api


def test_the_allocator_choice_is_checked():
    assert Config(server_malloc="glibc").server_malloc == "glibc"
    with pytest.raises(ConfigError, match="BPSCTL_SERVER_MALLOC: expected auto or glibc"):
        Config(server_malloc="tcmalloc")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_a_server_runs_on_jemalloc_unless_told_to_use_glibc(choice):
    with api.local_cluster(cluster_config(server_malloc=choice), servers=1) as cluster:
        server, = [p for p in cluster.processes if p.role == "server"]
        # the launcher starts it with jemalloc preloaded, so the recorded pid is the process
        # that serves, from its first instruction (one interpreter, not one re-executed)
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        assert ("libjemalloc" in maps) == (choice == "auto"), choice
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert any(v.startswith(b"LD_PRELOAD=") and b"libjemalloc" in v
                   for v in environ) == (choice == "auto"), choice

        def body(w: Worker):
            return w.push_pull(np.full(300_000, w.rank + 1, np.float32), name="x", average=False)

        for result in run_job(cluster, 2, 1, body):
            np.testing.assert_array_equal(result, np.full(300_000, 3, np.float32))
        log = (Path(cluster.state_dir) / "logs" / "server-0.log").read_text()
    expected = ("allocator: jemalloc" if choice == "auto"
                else "allocator: glibc's malloc (BPSCTL_SERVER_MALLOC=glibc)")
    assert expected in log, log


def test_what_a_launcher_preloads_for_a_server():
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        assert jemalloc_preload("auto", {}) == {}
        return
    assert jemalloc_preload("auto", {}) == {"BPSCTL_MALLOC_REEXEC": "1", "LD_PRELOAD": library}
    # what the user preloads stays, before jemalloc; preloaded already, nothing is added twice
    assert jemalloc_preload("auto", {"LD_PRELOAD": "libx.so"})["LD_PRELOAD"] == \
        f"libx.so {library}"
    assert "LD_PRELOAD" not in jemalloc_preload("auto", {"LD_PRELOAD": library})
    assert jemalloc_preload("glibc", {}) == {}


# ------------------------------------------------------------------ giving memory back when quiet

BURST = textwrap.dedent('''
    import os, threading, time
    import numpy as np
    from bpsctl.engine.common import release_free_memory, rss_bytes
    np.ones(1 << 20, np.float32)                # freed at once: glibc raises its mmap threshold
    held = []
    def burst():                                # allocated in one thread, freed in another,
        held.extend(np.ones(1 << 20, np.float32) for _ in range(60))   # like ZeroMQ's messages
    tasks = len(os.listdir("/proc/self/task"))
    thread = threading.Thread(target=burst)
    thread.start()
    thread.join()
    # join() returns before the OS thread has run its exit handlers, the allocator's among
    # them; on a loaded machine those then gave memory back while the release was measured
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/task")) > tasks and time.monotonic() < deadline:
        time.sleep(0.001)
    del held[::2]                               # 120 MiB freed, between blocks still held
    before = rss_bytes()
    released = release_free_memory()
    print(before, released, rss_bytes())
''')


@pytest.mark.timeout(60)
@pytest.mark.parametrize("allocator", ["glibc", "jemalloc"])
def test_release_gives_back_what_a_burst_freed_and_keeps_what_is_held(allocator):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if allocator == "jemalloc":
        env["LD_PRELOAD"] = ctypes.util.find_library("jemalloc")
        # its own decay off, so that what the burst freed waits for the release (the release
        # is what is tested); no muzzy stage, so that its purge returns the pages at once (a
        # lazy MADV_FREE stays in RSS until the kernel wants the memory)
        env["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:0"
    out = subprocess.run([sys.executable, "-c", BURST], env=env, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    before, released, after = (int(x) / 2**20 for x in out.split())
    assert 100 <= released <= 135, (before, released, after)    # 120 MiB were free
    assert before - after == pytest.approx(released, abs=1)
    assert after > 120                            # the 120 MiB still held stay


def _peak_rss_bytes(pid: int) -> int:
    """The most resident memory process ``pid`` has had (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_a_server_quiet_for_idle_release_seconds_gives_back_what_the_pushes_left(choice):
    with api.local_cluster(cluster_config(server_malloc=choice, idle_release_s=1.0),
                           servers=1) as cluster:
        server, = [p for p in cluster.processes if p.role == "server"]
        log = Path(cluster.state_dir) / "logs" / "server-0.log"

        def releases() -> list[str]:
            return [line for line in log.read_text().splitlines() if "quiet for 1 s" in line]

        def body(w: Worker):
            grad = np.full(16 << 20, w.rank + 1, np.float32)           # 64 MiB: 32 partitions
            return [w.push_pull(grad, name="g", average=False)[-1] for _ in range(3)]

        # over TCP (BPSCTL_SHM_SERVER=0): pushes through shared memory leave nothing on a
        # server's heap to give back
        for result in run_job(cluster, 4, 1, body, shm_server="0"):
            assert result == [10.0, 10.0, 10.0]
        # a loaded machine may pause the job for a quiet spell of its own: the release that
        # counts is the one after the job
        during = len(releases())
        # the server's peak (VmHWM): on a loaded machine the quiet spell may be over before
        # its memory could be read here
        busy = _peak_rss_bytes(server.pid)
        deadline = time.monotonic() + 10
        while len(releases()) == during and time.monotonic() < deadline:
            time.sleep(0.1)
        quiet = rss_bytes(server.pid)       # the page tables' count, not the lagging counter
        after_job = releases()[during:]
        time.sleep(2.5)                     # two more spells' worth of quiet: no new release
        again = releases()[during + len(after_job):]
    assert len(after_job) == 1 and not again, \
        "one release per quiet spell:\n" + "\n".join(after_job + again)
    released = float(re.search(r"gave ([\d.]+) MiB", after_job[0]).group(1))
    # four workers' 64 MiB pushes went through it; once the job ended it freed its sums too
    assert released >= 16, after_job[0]
    assert busy - quiet >= 16 * 2**20, (busy / 2**20, quiet / 2**20)


@pytest.mark.timeout(60)
def test_a_server_told_never_to_release_keeps_quiet():
    with api.local_cluster(cluster_config(idle_release_s=0), servers=1) as cluster:
        def body(w: Worker):
            return w.push_pull(np.ones(1 << 20, np.float32), name="g", average=False)[0]

        assert run_job(cluster, 2, 1, body) == [2.0, 2.0]
        time.sleep(1.0)
        log = (Path(cluster.state_dir) / "logs" / "server-0.log").read_text()
    assert "quiet for" not in log, log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("release_s", [0.4, 0])
def test_a_worker_releases_once_per_quiet_spell_not_between_busy_steps(release_s, caplog):
    caplog.set_level(logging.DEBUG, logger="bpsctl.worker")
    with api.local_cluster(cluster_config(), servers=1) as cluster:
        def body(w: Worker):
            grad = np.ones(1 << 20, np.float32)
            for _ in range(6):              # steps 0.1 s apart: busy, never quiet for long
                w.push_pull(grad, name="g", average=False)
                time.sleep(0.1)
            time.sleep(1.5)                 # quiet spell 1
            w.push_pull(grad, name="g", average=False)
            time.sleep(1.5)                 # quiet spell 2
            return w.rank

        assert run_job(cluster, 2, 1, body, idle_release_s=release_s) == [0, 1]
    quiet = [r.getMessage() for r in caplog.records if "quiet for" in r.getMessage()]
    expected = 2 if release_s else 0
    for rank in (0, 1):
        assert sum(m.startswith(f"worker {rank}: ") for m in quiet) == expected, quiet
