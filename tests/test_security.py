"""Who can join a cluster: the security modes against real scheduler and server processes.

By default (``hmac``) a process without the cluster's secret can neither register, ask for
status, say HELLO, push nor pull, and the secret never crosses the wire; ``curve`` also hides
every byte; ``none`` lets anyone in (and `up` says so).
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import JobFailed, cluster_config, run_job, wait_until
from zmq.utils.monitor import parse_monitor_message

import bpsctl
from bpsctl.config import DEFAULT_SECURITY, Config
from bpsctl.engine import EngineError, Worker
from bpsctl.engine import protocol as P
from bpsctl.engine.client import scheduler_status
from bpsctl.engine.security import Security, handshake_failed
from bpsctl.launch import api

pytestmark = pytest.mark.timeout(60)

REPLY_TIMEOUT_MS = 3000
#: generous: these wait for an event that comes in milliseconds, and fail only if it never does
REFUSAL_TIMEOUT_S = 20.0
NO_JOB_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def hmac_cluster():
    with api.local_cluster(cluster_config(), servers=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def curve_cluster():
    with api.local_cluster(cluster_config(security="curve"), servers=1) as cluster:
        yield cluster


class Intruder:
    """A raw DEALER speaking the wire protocol, as a process without the secret would.

    ``watch``: it connects once (no reconnection) and :meth:`refused` waits for its peer to
    refuse the security handshake, as ZeroMQ's socket monitor reports it."""

    def __init__(self, address: str, configure=None, watch: bool = False):
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.events = None
        if configure is not None:
            configure(self.sock)
        if watch:
            self.sock.setsockopt(zmq.RECONNECT_IVL, -1)
            self.events = self.sock.get_monitor_socket()
        self.sock.connect(f"tcp://{address}")

    def refused(self, timeout_s: float = REFUSAL_TIMEOUT_S) -> int:
        """The monitor event by which the peer refused the handshake (security.handshake_failed)."""
        deadline = time.monotonic() + timeout_s
        seen = []
        while (left_s := deadline - time.monotonic()) > 0:
            if self.events.poll(max(1, int(left_s * 1000))):
                seen.append(parse_monitor_message(self.events.recv_multipart())["event"])
                if handshake_failed(seen[-1:]):
                    return seen[-1]
        raise AssertionError(f"{self.address} did not refuse the handshake within {timeout_s:g} s "
                             f"(monitor events: {seen})")

    def send(self, msg_type: int, body: dict) -> None:
        if self.events is None:
            self.sock.send_multipart(P.control(msg_type, body))
            return
        try:        # refused already: its one connection is gone, and a DEALER without one
            self.sock.send_multipart(P.control(msg_type, body), zmq.NOBLOCK)    # would block
        except zmq.Again:
            pass

    def reply(self, timeout_ms: int = REPLY_TIMEOUT_MS) -> tuple[int, dict] | None:
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        body = P.parse_control(frames)[1] if len(frames) == 2 else {}
        return P.unpack_header(frames[0])[0], body

    def close(self) -> None:
        if self.events is not None:
            self.events.close(0)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def intruder():
    made: list[Intruder] = []

    def make(address: str, configure=None, watch: bool = False) -> Intruder:
        made.append(Intruder(address, configure, watch))
        return made[-1]
    yield make
    for one in made:
        one.close()


def _server(cluster: api.ClusterState):
    server = next(p for p in cluster.processes if p.role == "server")
    return f"{server.host}:{server.port}"


def _worker_config(cluster: api.ClusterState, **knobs) -> Config:
    return Config(**{"rank": 0, "world_size": 1, "job_id": uuid.uuid4().hex,
                     "scheduler": cluster.scheduler, "secret": cluster.secret,
                     "security": cluster.security, "start_timeout_s": 5.0, **knobs})


def _scheduler_log_tail(cluster: api.ClusterState, lines: int = 20) -> str:
    log = Path(next(p.log_path for p in cluster.processes if p.role == "scheduler"))
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _exact_sum_still_served(cluster: api.ClusterState) -> None:
    # The module's cluster is shared with earlier tests: start only once the scheduler holds
    # no job (one still ending, e.g. a LEAVE not yet read, would have these workers queued
    # behind it or told the cluster is busy).
    wait_until(lambda: scheduler_status(cluster.scheduler, cluster.secret,
                                        security=cluster.security)["job"] is None,
               NO_JOB_TIMEOUT_S, "the scheduler to end the previous job")
    try:
        summed = run_job(cluster, 2, 1, lambda w: w.push_pull(np.full(5, w.rank + 1.0),
                                                              name="x", average=False).tolist(),
                         security=cluster.security)
    except JobFailed as exc:
        raise JobFailed(f"{exc}\nthe scheduler's log ends:\n{_scheduler_log_tail(cluster)}"
                        ) from exc
    assert summed == [[3.0] * 5] * 2


# --------------------------------------------------------------------------- hmac (default)

def test_the_default_mode_is_hmac_and_up_records_a_256_bit_secret(hmac_cluster):
    assert DEFAULT_SECURITY == "hmac" and hmac_cluster.security == "hmac"
    assert len(bytes.fromhex(hmac_cluster.secret)) == 32
    state = api.state_file(hmac_cluster.state_dir)
    assert state.stat().st_mode & 0o777 == 0o600


def test_a_worker_with_the_wrong_secret_cannot_register(hmac_cluster):
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"rank 0: the scheduler at .* did not prove it knows "
                                          r"this cluster's secret: BPSCTL_SECRET differs"):
        Worker(_worker_config(hmac_cluster, secret="not-the-secret"))
    assert time.monotonic() - started < 2
    assert scheduler_status(hmac_cluster.scheduler, hmac_cluster.secret)["job"] is None


def test_register_and_status_without_the_handshake_are_refused(hmac_cluster, intruder):
    raw = intruder(hmac_cluster.scheduler)
    raw.send(P.REGISTER, {"role": "server", "host": "10.6.6.6", "port": 6666, "pid": 1,
                          "version": bpsctl.__version__})
    msg_type, body = raw.reply()
    assert msg_type == P.ERROR
    assert "refused a connection that has not proven the cluster secret" in body["message"]
    raw.send(P.STATUS, {})
    assert raw.reply()[0] == P.ERROR
    view = scheduler_status(hmac_cluster.scheduler, hmac_cluster.secret)
    assert [s["host"] for s in view["servers"]] == ["127.0.0.1"]     # no intruder registered


def test_status_with_the_wrong_secret_is_refused(hmac_cluster):
    with pytest.raises(EngineError, match="did not prove it knows this cluster's secret"):
        scheduler_status(hmac_cluster.scheduler, "wrong")


def test_a_replayed_proof_is_refused(hmac_cluster, intruder):
    """A sniffer that saw a whole handshake cannot replay it: the scheduler's nonce is new."""
    genuine = Security("hmac", hmac_cluster.secret)
    nonce = secrets.token_hex(16)
    first = intruder(hmac_cluster.scheduler)
    first.send(P.AUTH, {"version": bpsctl.__version__, "nonce": nonce})
    _, challenge = first.reply()
    seen_proof = genuine._proof(b"connecting", bytes.fromhex(challenge["nonce"]),
                                bytes.fromhex(nonce))
    replay = intruder(hmac_cluster.scheduler)
    replay.send(P.AUTH, {"version": bpsctl.__version__, "nonce": nonce})
    msg_type, second = replay.reply()
    assert msg_type == P.CHALLENGE and second["nonce"] != challenge["nonce"]
    replay.send(P.PROOF, {"proof": seen_proof})
    msg_type, body = replay.reply()
    assert msg_type == P.ERROR and "wrong cluster secret" in body["message"]
    replay.send(P.STATUS, {})
    assert replay.reply()[0] == P.ERROR
    # the genuine side of the first handshake is admitted
    first.send(P.PROOF, {"proof": seen_proof})
    first.send(P.STATUS, {})
    assert first.reply()[0] == P.STATUS_REPLY


def test_a_server_gives_an_intruder_no_gradients_and_takes_none_from_it(hmac_cluster, intruder):
    raw = intruder(_server(hmac_cluster))
    raw.send(P.HELLO, {"job": "intruder", "rank": 0, "world_size": 1, "hosts": 1,
                       "version": bpsctl.__version__})
    msg_type, body = raw.reply()
    assert msg_type == P.ERROR and "has not proven the cluster secret" in body["message"]
    poison = np.full(5, 1000.0).tobytes()
    for part in range(4):
        raw.sock.send_multipart([P.pack_header(P.PUSH, dtype=P.DTYPE_CODES[np.dtype("float64")],
                                               part=part, nbytes=len(poison)), poison])
    # the legitimate job on the same server sums exactly: nothing of the intruder's counted
    _exact_sum_still_served(hmac_cluster)
    replies = []
    while (reply := raw.reply(200)) is not None:
        replies.append(reply)
    assert [t for t, _ in replies] == [P.ERROR] * 4           # no ACK, no RESULT
    assert all("has not said HELLO" in body["message"] for _, body in replies)


class Sniffer:
    """A TCP relay that records every byte between a client and ``upstream``."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("mode", ["hmac", "curve"])
def test_a_sniffer_never_sees_the_secret_and_under_curve_sees_nothing(mode, hmac_cluster,
                                                                        curve_cluster):
    cluster = hmac_cluster if mode == "hmac" else curve_cluster
    sniffer = Sniffer(cluster.scheduler)
    try:
        config = _worker_config(cluster, scheduler=sniffer.address)
        worker = Worker(config)
        try:
            worker.barrier(timeout_s=10)
        finally:
            worker.shutdown()
    finally:
        sniffer.close()
    seen = bytes(sniffer.seen)
    assert len(seen) > 100                                    # it did relay the conversation
    assert cluster.secret.encode() not in seen
    assert bytes.fromhex(cluster.secret) not in seen
    # the job id travels in REGISTER: readable under hmac, encrypted under curve
    assert (config.job_id.encode() in seen) == (mode == "hmac")


# --------------------------------------------------------------------------- curve

def test_curve_runs_a_job_with_exact_sums(curve_cluster):
    _exact_sum_still_served(curve_cluster)
    assert scheduler_status(curve_cluster.scheduler, curve_cluster.secret,
                            security="curve")["job"] is None


@pytest.mark.parametrize("who", ["plain socket", "curve with a key of its own"])
def test_curve_answers_no_message_of_a_process_without_the_cluster_key(who, curve_cluster,
                                                                      intruder):
    def outsider(sock: zmq.Socket) -> None:
        # it even knows the servers' public key; its own key pair is not the cluster's
        sock.curve_serverkey = Security("curve", curve_cluster.secret).curve_keys().server_public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()

    outsider = None if who == "plain socket" else outsider
    for address in (curve_cluster.scheduler, _server(curve_cluster)):
        raw = intruder(address, outsider, watch=True)
        raw.send(P.STATUS, {})
        raw.send(P.HELLO, {"job": "x", "rank": 0, "world_size": 1, "hosts": 1,
                           "version": bpsctl.__version__})
        event = raw.refused()
        # a foreign key is refused by the ZAP handler (which logs it before it answers); a
        # plain socket offers another mechanism and is cut off at the greeting
        assert outsider is None or event == zmq.EVENT_HANDSHAKE_FAILED_AUTH, event
        assert raw.reply(0) is None         # its only connection is closed: nothing ever came
    if outsider is not None:
        log = Path(next(p.log_path for p in curve_cluster.processes if p.role == "scheduler"))
        wait_until(lambda: "refused a CURVE connection from 127.0.0.1: not the cluster's key"
                   in log.read_text(errors="replace"), REFUSAL_TIMEOUT_S,
                   "the scheduler to log the refused key")
    _exact_sum_still_served(curve_cluster)


@pytest.mark.parametrize("secret, mode", [("wrong", "curve"), (None, "hmac")])
def test_curve_refuses_a_worker_without_its_keys_or_mode_at_once(secret, mode, curve_cluster):
    started = time.monotonic()
    config = _worker_config(curve_cluster, security=mode, secret=secret or curve_cluster.secret)
    with pytest.raises(EngineError, match=r"rank 0: the scheduler at .* refused this process's "
                                          rf"security handshake \(BPSCTL_SECURITY={mode}\)"):
        Worker(config)
    assert time.monotonic() - started < 3


def test_a_login_on_a_connection_already_refused_returns_at_once(curve_cluster, intruder):
    """A worker of another mode may see its handshake refused before its first message is
    sent. ZeroMQ may then close the connection for good (as it always does for an intruder that
    does not reconnect), and a send waiting for a connection would wait forever."""
    raw = intruder(curve_cluster.scheduler, watch=True)     # hmac's plain socket, curve's
    raw.refused()
    returned = threading.Event()

    def login() -> None:
        try:
            Security("hmac", curve_cluster.secret).login(raw.sock, P.control(P.STATUS), "it")
            returned.set()
        except zmq.ContextTerminated:   # the send still waited when the test ended it
            raw.sock.close(0)
    thread = threading.Thread(target=login, daemon=True)
    thread.start()
    returned.wait(5)
    if not returned.is_set():
        raw.events.close(0)
        raw.ctx.term()                  # ends the waiting send; returns once it is closed
        thread.join(5)
    assert returned.is_set(), "the login's first send waits for a connection it never gets"

def test_a_worker_in_another_mode_than_an_hmac_cluster_is_told_so(hmac_cluster):
    with pytest.raises(EngineError,
                       match="refused a connection that has not proven the cluster "
                             r"secret \(security mode hmac; BPSCTL_SECURITY must match"):
        Worker(_worker_config(hmac_cluster, security="none"))


# --------------------------------------------------------------------------- cost

def test_bench_comm_measures_the_modes_in_interleaved_passes_each_on_its_cluster(monkeypatch):
    """`bench comm --security hmac,curve,none`: one private cluster per mode, all up together,
    passes that take the modes in turn, the baselines once, a median per mode and its cost."""
    import contextlib

    from bpsctl.bench import api as bench
    calls = []

    @contextlib.contextmanager
    def fake_cluster(config, workers, servers, own_cluster_for="", workers_per_host=1):
        assert own_cluster_for == "--security"
        yield config, None

    def fake_point(config, settings, size, nic, output):
        calls.append((config.security, settings.repeats, settings.compare, settings.raw))
        seconds = {"hmac": 1.0, "curve": 4.0, "none": 1.0}[config.security]
        rows = [{"system": "bpsctl", "seconds_all": [seconds] * settings.repeats}]
        rows += [{"system": "allreduce", "seconds": 3.0}] if settings.compare else []
        return {"workers": 2, "servers": 2, "worker_hosts": [2], "size_bytes": size,
                "nic_mbit": None, "tensors": 8, "layout": {"model_seconds": None},
                "results": rows, "speedup": {"allreduce": 0.0} if settings.compare else {}}

    monkeypatch.setattr(bench, "bench_cluster", fake_cluster)
    monkeypatch.setattr(bench, "comm_point", fake_point)
    settings = bench.CommSettings(workers=2, servers=2, sizes=(1 << 20,), repeats=6,
                                  compare=("allreduce",), raw=False,
                                  security=("hmac", "curve", "none"))
    report = bench.run_comm(Config(), settings)
    assert [c[0] for c in calls] == ["hmac", "curve", "none"] * 3
    assert calls[0] == ("hmac", 6, ("allreduce",), False)          # baselines once, in full
    assert all(c[1:] == (2, (), False) for c in calls[1:])
    assert [(r["system"], r.get("security"), len(r.get("seconds_all", [])))
            for r in report["results"]] == [("bpsctl", "hmac", 6), ("bpsctl", "curve", 6),
                                            ("bpsctl", "none", 6), ("allreduce", None, 0)]
    assert report["security_cost"] == {"hmac": 1.0, "curve": 4.0, "none": 1.0}
    assert report["speedup"]["allreduce"] == 3.0 and report["repeats"] == 6


# --------------------------------------------------------------------------- bad modes

def test_a_bad_security_mode_is_refused_naming_the_choices(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from bpsctl.cli import app
    from bpsctl.config import ConfigError
    with pytest.raises(ConfigError, match=r"^BPSCTL_SECURITY: expected hmac or curve or none, "
                                          r"got 'tls'$"):
        Config.from_env({"BPSCTL_SECURITY": "tls"})
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path))
    for args, message in (
            (["up", "--security", "tls"],
             "--security / BPSCTL_SECURITY: expected hmac or curve or none, got 'tls'"),
            (["bench", "comm", "--security", "curve,tls"],
             "--security: expected distinct modes among hmac, curve, none, got curve,tls"),
            (["bench", "comm", "--security", "none,none"], "--security: expected distinct modes")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "cluster.json").exists()


# --------------------------------------------------------------------------- none

def test_none_lets_anyone_in_and_up_warns_about_it(tmp_path):
    env = {**os.environ, "BPSCTL_SECURITY": "none"}
    up = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                         "up", "--servers", "1"], capture_output=True, text=True, env=env,
                        timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        warning = " ".join(up.stderr.split())
        assert "warning: --security none: anyone who can reach the cluster's ports can join it" \
            in warning
        cluster = api.load_state(tmp_path)
        assert cluster.security == "none"
        log = Path(next(p.log_path for p in cluster.processes if p.role == "scheduler"))
        assert "security none: anyone who can reach" in log.read_text()
        # a job runs; without any check, a wrong secret joins too
        _exact_sum_still_served(cluster)
        stranger = Worker(_worker_config(cluster, secret="anything"))
        stranger.shutdown()
    finally:
        subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path), "down"],
                       capture_output=True, timeout=60)
