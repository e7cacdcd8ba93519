"""Hostile bytes against a real scheduler and server process, through real sockets.

Hypothesis generates messages (truncated, oversized and random frames, wrong magic, wrong
protocol versions, random and deeply nested JSON, bodies with every field of every message
set to wrong types and out-of-range values, wrong frame counts), sent both by a stranger and by
a process that holds the secret. After each batch the process must still run, must have
logged no bug, and must still sum a legitimate job exactly. Examples are derandomized and
bounded, so a run costs seconds and finds the same things every time.
"""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import Peer, cluster_config, run_job
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bpsctl
from bpsctl.engine import compression as C
from bpsctl.engine import protocol as P
from bpsctl.launch import api
from bpsctl.launch.processes import is_running

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
REPLY_MS = 3000


@pytest.fixture(scope="module")
def cluster():
    # a short heartbeat timeout: a job some example registered by chance ends quickly
    with api.local_cluster(cluster_config(heartbeat_timeout_s=2.0), servers=1) as cluster:
        yield cluster


def _process(cluster: api.ClusterState, role: str) -> api.ProcessRecord:
    return next(p for p in cluster.processes if p.role == role)


def _address(cluster: api.ClusterState, role: str) -> str:
    record = _process(cluster, role)
    return f"{record.host}:{record.port}"


def _alive(cluster: api.ClusterState, role: str) -> None:
    """Checked after every example, so that the example that killed it is the one reported."""
    record = _process(cluster, role)
    for _ in range(3):              # a crash takes a moment to end the process
        assert is_running(record.identity), \
            f"the {role} died:\n{Path(record.log_path).read_text()[-2000:]}"
        time.sleep(0.002)


def _still_serving(cluster: api.ClusterState) -> None:
    """Both processes run, logged no bug, and a legitimate job sums exactly."""
    for role in ("scheduler", "server"):
        record = _process(cluster, role)
        assert is_running(record.identity), f"the {role} died"
        log = Path(record.log_path).read_text()
        assert "bug:" not in log and "Traceback" not in log, log[-3000:]
    summed = run_job(cluster, 2, 1, lambda w: w.push_pull(np.full(7, w.rank + 1, np.int64),
                                                          name="canary", average=False).tolist(),
                     start_timeout_s=20.0)
    assert summed == [[3] * 7] * 2


# --------------------------------------------------------------------------- strategies

FIELDS = ("role", "rank", "world_size", "job", "host", "port", "pid", "version", "num_servers",
          "partition_bytes", "start_timeout_s", "tensors", "name", "nonce", "proof", "hosts",
          "secret", "message", "parts", "ranks")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=10)
plausible = st.one_of(
    json_values, st.integers(-2, 70000), st.integers(1 << 40, 1 << 70),
    st.sampled_from(["worker", "server", "scheduler", bpsctl.__version__, "0.0.1", "float32",
                     "|V2", "bfloat16", secrets.token_hex(16), "", "x" * 300]),
    st.floats(allow_nan=True, allow_infinity=True))
tensor_spec = st.fixed_dictionaries({}, optional={
    "name": plausible,
    "dtype": st.sampled_from(["float32", "int8", "|V2", "complex64", "O"]) | plausible,
    "shape": st.lists(st.integers(-3, 1 << 62), max_size=4) | plausible})
bodies = st.one_of(
    st.fixed_dictionaries({}, optional={f: plausible for f in FIELDS}),
    st.fixed_dictionaries({"tensors": st.lists(tensor_spec, max_size=3) | plausible}),
    json_values)
header = st.builds(P.HEADER.pack, st.just(P.MAGIC), st.just(P.PROTOCOL_VERSION),
                   st.sampled_from(sorted(P.TYPE_NAMES)) | st.integers(0, 255),
                   st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535),
                   st.integers(0, 8) | st.integers(0, 2**32 - 1),
                   st.integers(0, 2) | st.integers(0, 2**32 - 1),
                   st.integers(0, 64) | st.integers(0, 2**64 - 1))
broken_header = st.one_of(
    header.flatmap(lambda h: st.integers(0, len(h) - 1).map(lambda k: h[:k])),      # truncated
    header.map(lambda h: b"XX" + h[2:]),                                              # magic
    st.builds(lambda h, v: h[:2] + bytes([v]) + h[3:], header,                        # version
              st.integers(0, 255).filter(lambda v: v != P.PROTOCOL_VERSION)),
    header.map(lambda h: h + b"\0"),                                                  # too long
    st.binary(max_size=40))
body_frame = st.one_of(bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64),
                       st.sampled_from([2, 999, 5000, 100000]).map(lambda n: b"[" * n),  # deep
                       st.just(b"1" * 5000))                                        # huge integer
messages = st.tuples(header | broken_header, st.lists(body_frame, max_size=3)).map(
    lambda t: [t[0], *t[1]])
batches = st.lists(messages, min_size=1, max_size=4)


# --------------------------------------------------------------------------- connections

@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# --------------------------------------------------------------------------- strangers

@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_a_stranger_gets_nothing_but_refusals_and_the_process_goes_on(role, cluster, ctx):
    stranger = Peer(ctx, _address(cluster, role))
    seen: list[int] = []

    @FUZZ
    @given(batches)
    @example([[P.pack_header(P.PUSH, dtype=9, nbytes=4), b"\0" * 4]])
    @example([[P.pack_header(P.STATUS), b"{}"], [P.pack_header(P.AUTH), b"[" * 100000]])
    @example([[P.pack_header(P.AUTH), b"1" * 5000]])
    def fuzz(batch):
        for frames in batch:
            stranger.sock.send_multipart(frames)
        seen.extend(stranger.replies(2))
        _alive(cluster, role)

    fuzz()
    seen.extend(stranger.replies(500))
    # a handshake begun gets a CHALLENGE; nothing else ever answers with data or membership
    assert set(seen) <= {P.ERROR, P.CHALLENGE}, {P.TYPE_NAMES.get(t, t) for t in seen}
    assert P.ERROR in seen
    stranger.close()
    _still_serving(cluster)


# --------------------------------------------------------------------------- members

REGISTER_WORKER = {"role": "worker", "rank": 0, "world_size": 1, "host": "127.0.0.1", "pid": 1,
                   "version": bpsctl.__version__, "num_servers": 1, "partition_bytes": 4096,
                   "start_timeout_s": 5.0}
HELLO_WORKER = {"job": "fuzz", "rank": 0, "world_size": 1, "hosts": 1,
                "version": bpsctl.__version__}


def logins(valid: dict) -> st.SearchStrategy:
    """What a member logs in with: the valid message, or a hostile one (a fuzzed body, or the
    valid one with one of its fields broken)."""
    return st.one_of(st.none(), bodies, st.sampled_from(sorted(valid)).flatmap(
        lambda key: plausible.map(lambda value: {key: value})))


def _login_body(login, valid: dict) -> bytes:
    if login is None:
        return json.dumps(valid).encode()
    return json.dumps({**valid, **login} if isinstance(login, dict) and len(login) == 1
                      else login).encode()


def test_a_member_sending_garbage_is_refused_and_the_scheduler_goes_on(cluster, ctx):
    """A process that holds the secret registers (with a valid or a hostile REGISTER) and
    sends hostile messages."""
    address = _address(cluster, "scheduler")

    @FUZZ
    @given(logins(REGISTER_WORKER), batches)
    @example(None, [[P.pack_header(P.DECLARE), json.dumps(
        {"tensors": [{"name": "big", "dtype": "float32", "shape": [1 << 40, 1 << 20]}]}).encode()]])
    @example({"world_size": 0}, [])
    @example({"role": "server"}, [])
    def fuzz(login, batch):
        body = _login_body(login, {**REGISTER_WORKER, "job": f"fuzz-{uuid.uuid4().hex}"})
        deadline = time.monotonic() + 10
        while True:
            member = Peer(ctx, address)
            member.prove(cluster.secret)
            member.sock.send_multipart([P.pack_header(P.REGISTER), body])
            if login is not None:
                break
            assert member.sock.poll(REPLY_MS), "the scheduler did not answer"
            msg_type, reply = P.parse_control(member.sock.recv_multipart())
            if msg_type == P.REGISTERED:
                break
            # a job an earlier example registered by chance keeps the cluster busy until
            # the heartbeat timeout: not a bug, try again
            assert "is busy with job" in reply["message"] and time.monotonic() < deadline, reply
            member.close()
            time.sleep(0.2)
        try:
            for frames in batch:
                member.sock.send_multipart(frames)
            member.replies(2)
        finally:
            member.send(P.LEAVE, {})
            member.close()
        _alive(cluster, "scheduler")

    fuzz()
    _still_serving(cluster)


def _compressed(part: int, header: bytes, words: list[int]) -> list[bytes]:
    """A compressed PUSH: its compression header, then ``words`` as uint32."""
    payload = header + np.array(words, np.uint32).tobytes()
    return [P.pack_header(P.PUSH, dtype=9, part=part, flags=P.FLAG_COMPRESSED,
                          nbytes=len(payload)), payload]


def test_a_hello_d_worker_sending_garbage_is_refused_and_the_server_goes_on(cluster, ctx):
    """A process that holds the secret says HELLO (valid or hostile) and sends hostile
    messages and pushes."""
    address = _address(cluster, "server")
    payload = np.arange(4, dtype=np.float32).tobytes()

    @FUZZ
    @given(logins(HELLO_WORKER), batches)
    @example(None, [[P.pack_header(P.PUSH, dtype=9, part=0, nbytes=len(payload)), payload]])
    @example(None, [[P.pack_header(P.PUSH, dtype=P.BFLOAT16_CODE, part=1, nbytes=3), b"abc"]])
    @example({"hosts": 0}, [[P.pack_header(P.PUSH, dtype=9, part=2, flags=P.FLAG_HOST_REDUCED,
                                           nbytes=len(payload)), payload]])
    @example({"world_size": "2"}, [])
    # compressed pushes: a top-k index past the partition, an unknown compressor, then a
    # partition's first push onebit and its second top-k
    @example(None, [_compressed(3, C.TopK(ratio=0.5).header(4), [0, 0, 99, 0, 0, 0, 0, 0])])
    @example(None, [_compressed(4, bytes([99]) + bytes(15), [0, 0, 0, 0])])
    @example(None, [_compressed(5, C.OneBit().header(4), [0, 0]),
                    _compressed(5, C.TopK(ratio=0.5).header(4), [0, 1, 0, 0, 0, 0, 0, 0])])
    def fuzz(login, batch):
        worker = Peer(ctx, address)
        try:
            worker.prove(cluster.secret)
            worker.sock.send_multipart([P.pack_header(P.HELLO), _login_body(login, HELLO_WORKER)])
            for frames in batch:
                worker.sock.send_multipart(frames)
            worker.replies(2)
        finally:
            worker.close()
        _alive(cluster, "server")

    fuzz()
    _still_serving(cluster)


# --------------------------------------------------------------------------- sizes and versions

def test_oversized_frames_are_refused_without_harm(cluster, ctx):
    scheduler = Peer(ctx, _address(cluster, "scheduler"))
    scheduler.sock.send_multipart([P.pack_header(P.STATUS), b" " * (P.MAX_CONTROL_BYTES + 1)])
    assert scheduler.replies(500) == []            # disconnected before the frame is buffered
    server = Peer(ctx, _address(cluster, "server"))
    server.sock.send_multipart([P.pack_header(P.HELLO), b" " * (P.MAX_CONTROL_BYTES + 1)])
    server.sock.send_multipart([P.pack_header(P.PUSH, dtype=0, nbytes=1 << 63),
                                bytes(64 * 1024 * 1024)])
    server.sock.send_multipart([bytes(64 * 1024 * 1024)])
    assert server.replies(REPLY_MS, want=3) == [P.ERROR] * 3
    scheduler.close()
    server.close()
    _still_serving(cluster)


@pytest.mark.parametrize("role, who", [("scheduler", "the scheduler"), ("server", "server 0")])
def test_another_bpsctl_version_is_refused_naming_both(role, who, cluster, ctx):
    peer = Peer(ctx, _address(cluster, role))
    peer.send(P.AUTH, {"version": "9.9.9", "nonce": secrets.token_hex(16)})
    assert peer.expect(P.ERROR)["message"] == (
        f"version mismatch: this process runs bpsctl 9.9.9, {who} runs bpsctl "
        f"{bpsctl.__version__}; install the same bpsctl version on every host")
    # a peer of another protocol version gets an answer it can read naming both
    peer.sock.send_multipart([P.HEADER.pack(P.MAGIC, 7, P.AUTH, 255, 0, 0, 0, 0, 0), b"{}"])
    message = peer.expect(P.ERROR)["message"]
    assert "peer speaks bpsctl protocol version 7, this process speaks 1" in message
    peer.close()


def test_a_worker_process_of_another_version_exits_naming_both_versions(cluster):
    script = ("import bpsctl; bpsctl.__version__ = '9.9.9'\n"
              "from bpsctl.engine import Worker\n"
              "Worker()\n")
    env = {"BPSCTL_SCHEDULER": cluster.scheduler, "BPSCTL_SECRET": cluster.secret,
           "BPSCTL_START_TIMEOUT": "5", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=30, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0
    assert (f"version mismatch: this process runs bpsctl 9.9.9, the scheduler runs bpsctl "
            f"{bpsctl.__version__}") in done.stderr, done.stderr
