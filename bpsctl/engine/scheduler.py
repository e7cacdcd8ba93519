"""The scheduler: registration, address book, tensor placement, barriers, heartbeats.

One ROUTER socket. Servers register once and stay for the life of the cluster; workers
register per job (one ``bpsctl run``). A job starts when all its ``world_size`` workers
have registered, and ends when they have all left or one of them is lost. Everything the
scheduler waits for has a deadline, and every failure is told to everyone it affects.
"""
from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

if __name__ == "__main__":
    # A scheduler uses NumPy for dtypes alone and never calls BLAS. One BLAS thread spares
    # the process the pool that OpenBLAS starts at import (a thread per core: most of the CPU
    # time of importing NumPy). Set before NumPy loads; a value the user gave wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import zmq

from .. import __version__
from ..config import Config
from ..model import job_shares
from . import protocol as P
from .client import CLOCK_EXCHANGES
from .common import bound_router, exit_on_sigterm, setup_process_logging, write_ready_file
from .partition import Placement
from .security import Security, version_mismatch

#: how many ended jobs the scheduler remembers (for workers restarted to rejoin one)
ENDED_JOBS_KEPT = 16


@dataclass
class Member:
    rid: bytes
    role: str
    rank: int
    host: str
    port: int | None
    pid: int
    last_seen: float
    state: str = "running"        # running | joining (a restarted worker) | lost | left
    clock: tuple[int, int] | None = None   # its clock when it sent REGISTER, ours on arrival
    incarnation: int = 0          # a worker's: how many times its rank was (re)started before
    spare: bool = False           # a spare server: holds nothing until a server is lost
    took_over: int | None = None  # a former spare: the rank of the lost server it replaced
    # a restarted scheduler's placeholder for a member others named when they registered
    # again, until it registers again itself (or its heartbeat timeout passes: then lost)
    awaited: bool = False
    # which machine it runs on, as processes there compute it (shm.host_id): a worker and a
    # server with the same id exchange partitions through shared memory (BPSCTL_SHM_SERVER)
    host_id: str = ""
    # a server's: the share of the bytes its launcher planned for it (None: none given, the
    # job's servers share evenly) and whether it sits on a worker host (BPSCTL_CPU_SHARE
    # tells the two groups apart)
    share: float | None = None
    colocated: bool = False
    # a worker's push_pulls completed, as its heartbeats say, and when that count last grew
    # (a join waits while the workers that have not joined make progress: HvdJoin)
    ops_done: int = 0
    progress_at: float = 0.0

    def take_over(self, lost_rank: int) -> None:
        """This spare server takes lost server ``lost_rank``'s place: a server like the others
        from now on, shown in status as having taken over."""
        self.spare, self.took_over = False, lost_rank

    def describe(self) -> str:
        where = f"{self.host}:{self.port}" if self.port else self.host
        return f"{self.role} {self.rank} ({where}, pid {self.pid})"

    def as_dict(self, now: float) -> dict[str, Any]:
        state = "spare" if self.spare and self.state == "running" else self.state
        row = {"role": self.role, "rank": self.rank, "host": self.host, "port": self.port,
               "pid": self.pid, "state": state, "last_seen_s": round(now - self.last_seen, 3)}
        if self.took_over is not None:
            row["took_over"] = self.took_over
        if self.role == "server":
            row["share"], row["colocated"] = self.share, self.colocated
        return row


def _address_book(servers: list[Member], shares: list[float]) -> list[dict[str, Any]]:
    """The job's servers as workers get them (REGISTERED): SERVER_MOVED and a spare's
    take-over name indices into this list, so each server's host id travels once, here, and
    so does each one's share of the bytes, which workers hand back to a restarted scheduler."""
    return [{"rank": s.rank, "host": s.host, "port": s.port, "host_id": s.host_id,
             "share": share} for s, share in zip(servers, shares, strict=True)]


def _job_shares(servers: list[Member], cpu_share: float | None) -> list[float]:
    """The share of the bytes each of a job's (non-spare) servers sums (bpsctl/model.py's
    job_shares rule: BPSCTL_CPU_SHARE, else the shares the servers registered with, else
    evenly)."""
    return job_shares([s.share for s in servers], [s.colocated for s in servers], cpu_share)


@dataclass
class HvdJoin:
    """Horovod's join in a job (hvd.join(); docs/horovod-api.md): the ranks that joined, in
    order, with the highest round of each partition any of them had (the last to join has
    them all: it never sat a round out); the latest announcement (``epoch``) and who has yet
    to acknowledge it: the job's workers that have not joined (then the servers are told to
    count zeros), or at the end its servers (then the workers go on); the largest op timeout
    of the joiners, and the last time a worker joined."""
    job_id: str
    order: list[int] = field(default_factory=list)
    rounds: dict[str, int] = field(default_factory=dict)
    epoch: int = 0
    pending: set[bytes] = field(default_factory=set)
    ending: bool = False
    op_timeout_s: float = 0.0
    since: float = 0.0


@dataclass
class Job:
    id: str
    world_size: int
    num_servers: int
    partition_bytes: int
    start_timeout_s: float
    first_seen: float
    cpu_share: float | None = None  # BPSCTL_CPU_SHARE of its first worker (None: auto)
    partition_depth: int = 0      # see partition.piece_bytes
    workers: dict[int, Member] = field(default_factory=dict)
    started: bool = False
    servers: list[Member] = field(default_factory=list)
    placement: Placement | None = None
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    barriers: dict[str, set[int]] = field(default_factory=dict)
    # a restarted scheduler: barriers some worker has already passed (its release reached that
    # worker before the old scheduler died, maybe not the others), by count
    barriers_passed: int = 0
    min_workers: int = 0          # go on while this many live (0: every worker)
    max_workers: int = 0          # ranks below this may join while it runs (`run --attach`)
    donors: dict[int, int] = field(default_factory=dict)    # joining rank -> its donor's rank
    # why the last worker to leave had failed (its engine broken), if it had: a job whose
    # last worker left that way did not finish (workers that fail and leave while others go
    # on do not make it so)
    failed: str = ""
    next_key: int = 0             # the key of the next tensor declared
    # a restarted scheduler: declarations held until every live worker has registered again
    # (one that has not may know tensors the others do not, and their partitions' ids)
    held: list[tuple[Member, dict[str, Any]]] = field(default_factory=list)
    # what the job's members were told of each loss it goes on without (WORKER_LOST by rank
    # until that rank is back in the rounds; SERVER_MOVED by server index), told again to a
    # member that registers again: its old connection may have taken the first telling with
    # it (see Scheduler._tell_again)
    worker_losses: dict[int, dict[str, Any]] = field(default_factory=dict)
    server_moves: dict[int, dict[str, Any]] = field(default_factory=dict)

    def awaiting(self) -> bool:
        return any(w.awaited and w.state == "running" for w in self.workers.values())

    def live(self) -> list[int]:
        """Ranks of the workers in the job's rounds (not lost, not still joining, whether
        or not they left)."""
        return sorted(rank for rank, w in self.workers.items()
                      if w.state not in ("lost", "joining"))


class Scheduler:
    def __init__(self, config: Config):
        self.config = config
        self.log = setup_process_logging("scheduler")
        self.ctx = zmq.Context()
        self.security = Security(config.security, config.secret)
        self.zap = self.security.start_zap(self.ctx, "the scheduler", self.log)
        self.gate = self.security.gate("the scheduler", self.log)
        # only control messages come here: a bigger frame is an attack or a mistake
        self.sock, self.port = bound_router(self.ctx, config.host, config.port, self.security,
                                            max_frame_bytes=P.MAX_CONTROL_BYTES)
        if config.control_socket:
            self.sock.bind(f"ipc://{config.control_socket}")
        self.members: dict[bytes, Member] = {}
        # connections of members declared lost: what they are told if they speak again (a
        # paused or cut-off process that comes back is fenced, not taken back)
        self.fenced: OrderedDict[bytes, str] = OrderedDict()
        self.isolated = False       # every member silent at once: this scheduler was cut off
        self.clock_peers: OrderedDict[bytes, int] = OrderedDict()   # clock exchanges left
        self.servers: list[Member] = []
        self.job: Job | None = None
        # registrations for a new job that came while another job held the cluster: (rid,
        # message, member fields, time to decide whether that job is ending, answer-by time)
        self.queued: list[tuple[bytes, dict[str, Any], dict[str, Any], float, float]] = []
        # the last jobs that ended, and how: a worker restarted to rejoin one of them learns
        # that there is nothing left to rejoin (instead of starting a job of its own)
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.hvd_join: HvdJoin | None = None      # Horovod's join in the job, while it lasts

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        write_ready_file(self.config.ready_file,
                         {"host": self.config.host, "port": self.port, "pid": os.getpid()})
        self.log.info("serving on %s (security %s)", self.address, self.security.mode)
        if self.security.mode == "none":
            self.log.warning("security none: anyone who can reach %s can join this cluster, "
                             "read and change its gradients; use it on trusted networks only",
                             self.address)
        poll_ms = int(self.config.heartbeat_interval_s * 1000)
        try:
            while True:
                if self.sock.poll(poll_ms, zmq.POLLIN):
                    self._drain()
                self._check_liveness()
                self._check_start_deadline()
                if self.hvd_join is not None:
                    self._check_join_progress()
                if self.queued:
                    self._start_queued()
        finally:
            self.sock.close(0)
            if self.zap is not None:
                self.zap.stop()
            self.ctx.term()

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            rid, body = frames[0], frames[1:]
            try:
                msg_type, msg = P.parse_control(body)
                self._handle(rid, msg_type, msg)
            except P.ProtocolError as exc:
                self.log.warning("rejected a malformed message: %s", exc)
                self._send(rid, P.ERROR, {"message": f"scheduler rejected message: {exc}"})
            except Exception:       # a bug: say so loudly, and go on serving everyone else
                self.log.exception("bug: failed on a message; the scheduler goes on")
                self._send(rid, P.ERROR, {"message": "the scheduler failed on this message (a "
                                          "bpsctl bug; its log has the details)"})

    def _send(self, rid: bytes, msg_type: int, body: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([rid, *P.control(msg_type, body)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass    # the peer is gone; liveness checks report it

    def _handle(self, rid: bytes, msg_type: int, msg: dict[str, Any]) -> None:
        member = self.members.get(rid)
        if member is not None:
            member.last_seen = time.monotonic()
        if msg_type in (P.AUTH, P.PROOF):
            reply = self.gate.handle(rid, msg_type, msg)
            if reply is not None:
                self._send(rid, *reply)
        elif msg_type == P.CLOCK:
            self._clock(rid, msg)
        elif msg_type in (P.REGISTER, P.STATUS) and not self.gate.admit(rid):
            self.log.warning("refused a %s from a connection that has not proven the cluster "
                             "secret", P.TYPE_NAMES[msg_type])
            self._send(rid, P.ERROR, self.gate.refusal())
        elif msg_type == P.REGISTER:
            self._register(rid, msg)
        elif msg_type == P.STATUS:
            self._status(rid, msg)
        elif rid in self.fenced and (member is None or member.state == "lost"):
            self._fence(rid, msg_type)
        elif member is None:
            if msg_type not in (P.HEARTBEAT, P.LEAVE):     # late words of an ended job's worker
                self._send(rid, P.ERROR, {"message": "not registered with the scheduler"})
        elif msg_type == P.HEARTBEAT:
            done = msg.get("done")
            if isinstance(done, int) and done != member.ops_done:
                member.ops_done, member.progress_at = done, time.monotonic()
        elif msg_type == P.DECLARE:
            self._declare(member, msg)
        elif msg_type == P.BARRIER:
            self._barrier(member, msg)
        elif msg_type == P.LEAVE:
            self._leave(member, str(msg.get("failed") or ""))
        elif msg_type == P.JOIN_DONE:
            self._join_done(member, msg)
        elif msg_type == P.HVD_JOIN:
            self._hvd_join(member, msg)
        elif msg_type == P.JOINED_ACK:
            self._joined_ack(member, msg)
        else:
            self._send(rid, P.ERROR, {"message": f"unexpected message type {msg_type}"})

    def _clock(self, rid: bytes, msg: dict[str, Any]) -> None:
        """A clock exchange: the sender's reading, ours on arrival, ours as we answer. A
        connection proves the secret once and then makes up to CLOCK_EXCHANGES of them."""
        arrived_ns = time.monotonic_ns()
        left = self.clock_peers.pop(rid, None)
        if left is None:
            if not self.gate.admit(rid):
                self._send(rid, P.ERROR, self.gate.refusal())
                return
            left = CLOCK_EXCHANGES
        if left > 1:
            self.clock_peers[rid] = left - 1
            while len(self.clock_peers) > 1024:          # connections that stopped early
                self.clock_peers.popitem(last=False)
        sent_ns = P.int_field(msg, "clock_ns", 0, 1 << 63)
        self._send(rid, P.CLOCK, {"clock": [sent_ns, arrived_ns, time.monotonic_ns()]})

    # ------------------------------------------------------------------ registration

    def _register(self, rid: bytes, msg: dict[str, Any]) -> None:
        if msg.get("version") != __version__:
            self._send(rid, P.ERROR,
                       {"message": version_mismatch(msg.get("version"), "the scheduler")})
            return
        if rid in self.members:
            raise P.ProtocolError(f"{self.members[rid].describe()} registered twice")
        role = msg.get("role")
        if role == "worker":
            _check_worker_registration(msg)
        arrived_ns = time.monotonic_ns()
        now = time.monotonic()
        sent_ns = P.int_field(msg, "clock_ns", 0, 1 << 63, default=0)
        common: dict[str, Any] = dict(rid=rid, role=role, host=P.str_field(msg, "host"),
                                      pid=P.int_field(msg, "pid", 0, 1 << 31, default=0),
                                      last_seen=now,
                                      clock=(sent_ns, arrived_ns) if sent_ns else None,
                                      host_id=P.str_field(msg, "host_id", 64, default=""))
        if role == "server":
            spare, colocated = msg.get("spare", False), msg.get("colocated", False)
            if not isinstance(spare, bool) or not isinstance(colocated, bool):
                raise P.ProtocolError("fields 'spare' and 'colocated' must be true or false")
            common.update(share=P.share_field(msg, "share"), colocated=colocated)
            port = P.int_field(msg, "port", 1, 65535)
            if msg.get("reregister"):
                self._reregister_server(rid, msg, common, port, spare)
                return
            member = Member(rank=max((s.rank for s in self.servers), default=-1) + 1, port=port,
                            spare=spare, **common)
            self.servers.append(member)
            self.members[rid] = member
            self.log.info("registered %s%s", member.describe(), " as a spare" if spare else "")
            self._send(rid, P.REGISTERED, {"rank": member.rank, **_clock(member)})
        elif role == "worker" and msg.get("reregister"):
            self._reregister_worker(rid, msg, common)
        elif role == "worker":
            self._register_worker(rid, msg, common)
        else:
            self._send(rid, P.ERROR, {"message": f"unknown role {role!r}"})

    def _register_worker(self, rid: bytes, msg: dict[str, Any], common: dict[str, Any]) -> None:
        job_id, world_size = str(msg.get("job")), int(msg.get("world_size", 0))
        job = self.job
        if msg.get("rejoin") and job_id in self.ended and (job is None or job.id != job_id):
            # restarted after the others had finished (the steps left took less time than
            # the restart): the job is over, whatever this process would have done
            how = self.ended[job_id]
            self._send(rid, P.ERROR, {"finished": how == "finished", "message": (
                f"job {job_id!r} finished before this restarted worker could rejoin it"
                if how == "finished" else f"job {job_id!r} ended ({how}) before this "
                "restarted worker could rejoin it")})
            return
        if job is not None and job.id != job_id:
            # e.g. `bpsctl run` again right after a crash: the crashed job is declared lost
            # within the heartbeat timeout, then this registration goes on. Workers that died a
            # moment ago still look alive, so a job that does not look like it is ending is
            # looked at again once they would have missed two heartbeats, and only then is
            # the cluster called busy (a healthy busy cluster answers within ~3 intervals).
            now, interval = time.monotonic(), self.config.heartbeat_interval_s
            self.queued.append((rid, msg, common, now + 3 * interval,
                                now + self.config.heartbeat_timeout_s + 2 * interval))
            return
        if job is None:
            live = [s for s in self.servers if s.state == "running" and not s.spare]
            wanted = int(msg.get("num_servers") or 0) or len(live)
            if not live:
                self._send(rid, P.ERROR, {"message": "no server has registered with the scheduler "
                                          f"at {self.address}; start the cluster with "
                                          "`bpsctl up --servers K`"})
                return
            if wanted > len(live):
                spares = sum(s.state == "running" and s.spare for s in self.servers)
                self._send(rid, P.ERROR, {"message": f"the job asks for {wanted} servers "
                                          f"(BPSCTL_NUM_SERVERS) but only {len(live)} are running"
                                          + (f" besides {spares} spare(s), which hold nothing "
                                             "until a server is lost" if spares else "")})
                return
            if msg.get("attach"):
                self._send(rid, P.ERROR, {"message": "no job is running on this cluster to "
                                          "attach to; start one with `bpsctl run --max-workers "
                                          "W -np N -- CMD`"})
                return
            job = self.job = Job(id=job_id, world_size=world_size, num_servers=wanted,
                                 cpu_share=P.share_field(msg, "cpu_share"),
                                 partition_bytes=int(msg["partition_bytes"]),
                                 partition_depth=int(msg.get("partition_depth", 0)),
                                 start_timeout_s=float(msg["start_timeout_s"]),
                                 first_seen=time.monotonic(),
                                 min_workers=int(msg.get("min_workers", 0)),
                                 max_workers=int(msg.get("max_workers") or 0) or world_size)
        if world_size != job.world_size:
            self._send(rid, P.ERROR, {"message": f"job {job.id!r}: this worker says world size "
                                      f"{world_size}, the first worker said {job.world_size}"})
            return
        rank = int(msg.get("rank", -1))
        if job.started:
            if msg.get("rejoin") and rank in job.workers:
                self._rejoin(job, rid, rank, common)
            elif msg.get("attach"):
                self._attach(job, rid, rank, common)
            else:
                self._send(rid, P.ERROR, {"message": f"job {job.id!r} has already started with "
                                          f"all {job.world_size} workers"})
            return
        if msg.get("attach") or rank >= job.world_size:
            self._send(rid, P.ERROR, {"message": f"job {job.id!r} has not started yet (it waits "
                                      f"for its {job.world_size} workers); a worker beyond them "
                                      "joins it once it runs (`bpsctl run --attach`)"})
            return
        if rank == -1:
            rank = min(set(range(job.world_size)) - set(job.workers))
        if rank in job.workers:
            other = job.workers[rank]
            self._send(rid, P.ERROR, {"message": f"job {job.id!r}: rank {rank} is already taken by "
                                      f"{other.describe()}"})
            return
        member = Member(rank=rank, port=None, **common)
        job.workers[rank] = member
        self.members[rid] = member
        if len(job.workers) == job.world_size:
            self._start_job(job)

    def _rejoin(self, job: Job, rid: bytes, rank: int, common: dict[str, Any]) -> None:
        """A restarted worker takes its rank back (`bpsctl run --max-restarts`): the process
        it replaces is lost from now on, if it was not already; a live worker (the donor)
        admits it to the servers at its next step boundary and hands it the model."""
        old = job.workers[rank]
        if not job.min_workers:
            self._send(rid, P.ERROR, {"message": f"job {job.id!r} stops at a lost worker "
                                      f"(BPSCTL_MIN_WORKERS unset), so rank {rank} cannot "
                                      "rejoin it; run it with `bpsctl run --max-restarts R`"})
            return
        if old.state == "left":
            self._send(rid, P.ERROR, {"message": f"job {job.id!r}: rank {rank} has finished "
                                      "and left; it cannot rejoin"})
            return
        if old.state in ("running", "joining"):
            self._lose(old, f"replaced by a restarted process (pid {common['pid']})")
            if self.job is not job:
                self._send(rid, P.ERROR, {"message": f"job {job.id!r} ended: too few workers "
                                          "were left to go on"})
                return
        self._join(job, rid, Member(rank=rank, port=None, **{
            **common, "state": "joining", "incarnation": old.incarnation + 1}))

    def _attach(self, job: Job, rid: bytes, rank: int, common: dict[str, Any]) -> None:
        """A new worker joins the running job (`bpsctl run --attach`): it gets the rank it
        asks for if that is unused and below ``max_workers``, else the lowest such rank
        (ranks are never reused, so the job never renumbers), and joins as a restarted
        worker rejoins."""
        free = sorted(set(range(job.max_workers)) - set(job.workers))
        if not free:
            self._send(rid, P.ERROR, {"message": f"job {job.id!r} has no room for another "
                                      f"worker: its ranks reach its --max-workers "
                                      f"{job.max_workers} (BPSCTL_MAX_WORKERS); start the job "
                                      "with a larger `bpsctl run --max-workers W`"})
            return
        self._join(job, rid, Member(rank=rank if rank in free else free[0], port=None,
                                    **{**common, "state": "joining"}))

    def _join(self, job: Job, rid: bytes, member: Member) -> None:
        """``member`` (joining) takes its rank in the running job: it is told the job's servers
        and live workers, and the lowest live worker is asked to admit it and hand it the
        model at its next step boundary."""
        rank = member.rank
        if not any(w.state == "running" for w in job.workers.values()):
            self._send(rid, P.ERROR, {"message": f"job {job.id!r} has no live worker to hand "
                                      f"rank {rank} the model"})
            return
        job.workers[rank] = member
        self.members[rid] = member
        placement = job.placement
        book = _address_book(job.servers, placement.shares if placement is not None
                             else [1 / len(job.servers)] * len(job.servers))
        self._send(rid, P.REGISTERED, {
            "rank": rank, "servers": book, "world_size": job.world_size, "joining": True,
            "incarnation": member.incarnation, "live": job.live(),
            "lost_servers": sorted(placement.lost) if placement is not None else [],
            "spares": sorted(placement.spare) if placement is not None else [],
            **_clock(member)})
        self._ask_donor(job, member)

    def _ask_donor(self, job: Job, joiner: Member) -> None:
        donor = min((w for w in job.workers.values() if w.state == "running"),
                    key=lambda w: w.rank, default=None)
        if donor is None:
            return          # nobody left: the job ends (the joiner's wait for the model fails)
        job.donors[joiner.rank] = donor.rank
        self.log.info("%s %s job %s; worker %d hands it the model at its next step",
                      joiner.describe(), "rejoins" if joiner.incarnation else "joins", job.id,
                      donor.rank)
        self._send(donor.rid, P.WORKER_JOINING,
                   {"rank": joiner.rank, "incarnation": joiner.incarnation})

    def _join_done(self, donor: Member, msg: dict[str, Any]) -> None:
        """The donor admitted the joiner to every server: it is in the job's rounds now."""
        job = self.job
        rank = P.int_field(msg, "rank", 0, P.MAX_WORKERS)
        if job is None or job.donors.get(rank) != donor.rank:
            return
        del job.donors[rank]
        joiner = job.workers.get(rank)
        if joiner is None or joiner.state != "joining":
            return          # lost meanwhile: WORKER_LOST told everyone
        joiner.state = "running"
        job.worker_losses.pop(rank, None)      # in the rounds again
        live = job.live()
        message = (f"{joiner.describe()} {'rejoined' if joiner.incarnation else 'joined'} the "
                   f"job (model from worker {donor.rank})")
        self.log.warning("%s; it goes on with %d workers", message, len(live))
        for worker in job.workers.values():
            if worker.state == "running":
                self._send(worker.rid, P.WORKER_JOINED,
                           {"rank": rank, "incarnation": joiner.incarnation,
                            "message": message, "live": live})

    # ------------------------------------------------------------------ Horovod's join

    def _hvd_join(self, member: Member, msg: dict[str, Any]) -> None:
        """Worker ``member`` joined (hvd.join(), with nothing in flight): the other workers
        hear it first, then the servers, which count it as zeros from then on; once every
        live worker has joined, the join ends (:meth:`_end_join`)."""
        job = self.job
        if job is None or not job.started or job.workers.get(member.rank) is not member:
            self._send(member.rid, P.ERROR, {"message": "join() outside a running job"})
            return
        rounds = msg.get("rounds", {})
        if not isinstance(rounds, dict) or len(rounds) > P.MAX_PARTITIONS_PER_DECLARE or \
                not all(isinstance(k, str) and k.isdigit() and isinstance(v, int)
                        and not isinstance(v, bool) and 0 <= v < 1 << 32
                        for k, v in rounds.items()):
            raise P.ProtocolError("rounds: expected {part id: round}")
        timeout = P.float_field(msg, "op_timeout_s", 0, 1e9)
        join = self.hvd_join
        if join is None or join.job_id != job.id:
            join = self.hvd_join = HvdJoin(job.id)
        if member.rank in join.order:
            raise P.ProtocolError(f"worker {member.rank} joined twice")
        join.order.append(member.rank)
        for part, round_ in rounds.items():
            join.rounds[part] = max(join.rounds.get(part, 0), round_)
        join.op_timeout_s = max(join.op_timeout_s, timeout)
        join.since = time.monotonic()
        self.log.info("worker %d joined (hvd.join()): %s of job %s joined", member.rank,
                      sorted(join.order), job.id)
        self._announce_join(job, join)

    def _not_joined(self, job: Job, join: HvdJoin) -> list[Member]:
        return [w for w in job.workers.values()
                if w.state == "running" and w.rank not in join.order]

    def _announce_join(self, job: Job, join: HvdJoin) -> None:
        """Tell the workers that have not joined who has; the servers once they all heard.
        With none left, the join ends instead."""
        others = self._not_joined(job, join)
        if not others:
            self._end_join(job, join)
            return
        join.epoch += 1
        join.pending = {w.rid for w in others}
        body = {"job": job.id, "epoch": join.epoch, "ranks": sorted(join.order)}
        for worker in others:
            self._send(worker.rid, P.JOINED, body)

    def _end_join(self, job: Job, join: HvdJoin) -> None:
        """Every live worker has joined: the servers count every rank again, and once they all
        said so the workers go on (:meth:`_joined_ack`)."""
        join.ending = True
        join.epoch += 1
        servers = [s for s in job.servers if s.state == "running"]
        join.pending = {s.rid for s in servers}
        for server in servers:
            self._send(server.rid, P.JOINED, {"job": job.id, "epoch": join.epoch, "done": True})
        if not join.pending:
            self._joined_ack(None, {"epoch": join.epoch})

    def _joined_ack(self, member: Member | None, msg: dict[str, Any]) -> None:
        """A worker or server took the latest JOINED in; when all have, the next step."""
        join, job = self.hvd_join, self.job
        if join is None or job is None or join.job_id != job.id or \
                msg.get("epoch") != join.epoch:
            return
        if member is not None:
            join.pending.discard(member.rid)
        if join.pending:
            return
        if not join.ending:
            body = {"job": job.id, "epoch": join.epoch, "ranks": sorted(join.order)}
            for server in job.servers:
                if server.state == "running":
                    self._send(server.rid, P.JOINED, body)
            return
        last = join.order[-1] if join.order else -1
        self.log.info("job %s: every worker joined (hvd.join()), the last %d; it goes on",
                      job.id, last)
        self.hvd_join = None
        body = {"job": job.id, "epoch": join.epoch, "done": True, "last": last,
                "rounds": join.rounds}
        for worker in job.workers.values():
            if worker.state == "running":
                self._send(worker.rid, P.JOINED, body)

    def _join_goes_on(self, member: Member) -> None:
        """A member lost, or a worker gone, during a join: nobody waits for it (a worker
        counts as joined)."""
        join, job = self.hvd_join, self.job
        if join is None or job is None or join.job_id != job.id:
            self.hvd_join = None
            return
        join.pending.discard(member.rid)
        if member.role == "worker" and not join.ending and not self._not_joined(job, join):
            self._end_join(job, join)
        elif not join.pending:
            self._joined_ack(None, {"epoch": join.epoch})

    def _check_join_progress(self) -> None:
        """A join waits while the workers that have not joined make progress: when none of them
        completed a push_pull for the joiners' op timeout (the deadline a push_pull waiting
        for them would have), the job fails, naming them."""
        join, job = self.hvd_join, self.job
        if join is None or job is None or join.job_id != job.id:
            self.hvd_join = None
            return
        if join.ending:
            return
        others = self._not_joined(job, join)
        if not others:          # the last ones left (shut down) without joining
            self._end_join(job, join)
            return
        now = time.monotonic()
        latest = max([join.since, *(w.progress_at for w in others)])
        if now - latest <= join.op_timeout_s:
            return
        message = (f"join(): worker(s) {sorted(w.rank for w in others)} of job {job.id!r} have "
                   f"not joined, and none of them completed a collective for {now - latest:.0f} "
                   f"s (BPSCTL_OP_TIMEOUT={join.op_timeout_s:g}), while {sorted(join.order)} "
                   "waited in join(); every rank must call join() once out of data")
        self.log.warning(message)
        self.hvd_join = None
        for worker in job.workers.values():
            if worker.state == "running":
                self._send(worker.rid, P.ERROR, {"message": message})

    # ------------------------------------------------------------------ a restarted scheduler

    def _server(self, rank: int) -> Member | None:
        return next((s for s in self.servers if s.rank == rank), None)

    def _await(self, role: str, rank: int, host: str, port: int | None,
               state: str = "running") -> Member:
        """A placeholder for a member named by another's re-registration (see Member)."""
        member = Member(rid=f"awaiting {role} {rank}".encode(), role=role, rank=rank, host=host,
                        port=port, pid=0, last_seen=time.monotonic(), state=state,
                        awaited=state == "running")
        if member.awaited:
            self.members[member.rid] = member       # lost, like anyone, when it stays silent
        return member

    def _adopt(self, member: Member, rid: bytes, common: dict[str, Any]) -> None:
        """``member`` (a placeholder) registered again on connection ``rid``."""
        self.members.pop(member.rid, None)
        member.rid, member.host, member.pid = rid, common["host"], common["pid"]
        member.last_seen, member.clock, member.awaited = common["last_seen"], common["clock"], False
        member.host_id = common["host_id"]
        if member.role == "server":
            member.share, member.colocated = common["share"], common["colocated"]
        self.members[rid] = member

    def _reregister_server(self, rid: bytes, msg: dict[str, Any], common: dict[str, Any],
                           port: int, spare: bool) -> None:
        """A server that lost the scheduler registers again with the one restarted in its
        place: it keeps its rank (workers know it by its place in the job's server list). One
        declared lost is fenced instead."""
        rank = P.int_field(msg, "rank", 0, 1 << 16)
        member = self._server(rank)
        # the same process again (its link dropped and came back): a new connection of it
        if member is not None and not member.awaited and member.state == "running" \
                and member.pid != common["pid"]:
            self._send(rid, P.ERROR, {"message": f"server rank {rank} is already taken by "
                                      f"{member.describe()}"})
            return
        if member is not None and member.state == "lost":
            # its partitions live elsewhere now (a pause or a cut long enough that its old
            # connection is gone too): fenced, as on the old connection (:meth:`_fence`)
            self.log.warning("%s registered again after it was declared lost: fenced",
                             member.describe())
            self._send(rid, P.ERROR, _fenced(f"{member.describe()} was declared lost"))
            return
        if member is None:      # (a placeholder knows from the workers whether it is spare)
            member = Member(rank=rank, port=port, spare=spare, **common)
            self.servers.append(member)
            self.servers.sort(key=lambda s: s.rank)
            self.members[rid] = member
        else:
            self._adopt(member, rid, common)
            member.port = port
        self.log.warning("%s registered again", member.describe())
        self._send(rid, P.REGISTERED, {"rank": rank, **_clock(member)})
        if self.job is not None and member in self.job.servers and member.state == "running":
            self._tell_again(self.job, member)

    def _reregister_worker(self, rid: bytes, msg: dict[str, Any],
                           common: dict[str, Any]) -> None:
        """A worker of a running job registers again with a restarted scheduler, saying what
        the scheduler had: the job, its own rank and incarnation, who was live, left or
        joining, the job's servers and which were lost, and its tensors with their partitions
        where they live now. The first such worker rebuilds the job; nothing is placed again
        and nobody is renumbered. Members it names that do not register again within the
        heartbeat timeout are lost, as if their heartbeats had stopped."""
        _check_worker_registration(msg)
        again = msg["reregister"]
        if not isinstance(again, dict):
            raise P.ProtocolError("reregister: expected an object")
        job_id, world_size = str(msg["job"]), int(msg["world_size"])
        rank = P.int_field(msg, "rank", 0, max(world_size, int(msg.get("max_workers") or 0)) - 1)
        job = self.job
        if job is None and job_id in self.ended:
            # this scheduler ended the job while the worker was cut off from it (it was not
            # restarted): nothing to rebuild
            self._send(rid, P.ERROR, {"message": f"job {job_id!r} ended ({self.ended[job_id]}) "
                                      "while this worker could not reach the scheduler"})
            return
        if job is None:
            job = self._rebuild_job(msg, again)
        elif job.id != job_id or job.world_size != world_size or not job.started:
            self._send(rid, P.ERROR, {"message": f"the restarted scheduler runs job {job.id!r} "
                                      f"of {job.world_size} workers, not this worker's job "
                                      f"{job_id!r}"})
            return
        self._merge(job, again, rank)
        member = job.workers.get(rank)
        if member is None:      # an attached rank the first worker did not know of
            member = job.workers[rank] = self._await("worker", rank, "", None, "lost")
        joining = again.get("joining") is True
        same = member.pid == common["pid"] and member.state in ("running", "joining")
        if not (member.awaited or same or
                (joining and member.state == "lost" and member.pid == 0)):
            self._send(rid, P.ERROR, {"message": f"job {job.id!r}: rank {rank} is "
                                      f"{member.state} ({member.describe()}) at the restarted "
                                      "scheduler"})
            return
        self._adopt(member, rid, common)
        member.incarnation = P.int_field(again, "incarnation", 0, 1 << 30, default=0)
        member.state = "joining" if joining else "running"
        donating = again.get("donating", [])
        if not isinstance(donating, list):
            raise P.ProtocolError("reregister.donating: expected [[rank, incarnation]]")
        for pair in donating:
            if isinstance(pair, list) and pair and isinstance(pair[0], int):
                job.donors[pair[0]] = rank
        self.log.warning("%s of job %s registered again", member.describe(), job.id)
        self._send(rid, P.REGISTERED, {"rank": rank, "world_size": job.world_size,
                                       "reregistered": True, **_clock(member)})
        self._tell_again(job, member)
        self._release_held(job)
        self._release_barriers(job)         # its count of barriers passed may release some

    def _tell_again(self, job: Job, member: Member) -> None:
        """``member`` registered again after losing this scheduler (a cut or a pause of either
        host past the heartbeat timeout): it opened a new connection, and what was sent on the
        old one while it was silent is gone with it. Tell it again of every loss the job goes
        on without: each lost worker, with the ranks live now (servers and workers), and each
        lost server's partitions' moves (workers). Each end ignores a loss it already knows,
        so telling twice changes nothing; a worker's rank back in the rounds is not told."""
        live = job.live()
        for body in job.worker_losses.values():
            self._send(member.rid, P.WORKER_LOST, {**body, "live": live})
        if member.role == "worker":
            for body in job.server_moves.values():
                self._send(member.rid, P.SERVER_MOVED, body)

    def _rebuild_job(self, msg: dict[str, Any], again: dict[str, Any]) -> Job:
        book = again.get("servers")
        if not isinstance(book, list) or not book or len(book) > 1 << 16 or not all(
                isinstance(s, dict) for s in book):
            raise P.ProtocolError("reregister.servers: expected the job's [{rank, host, port}]")
        world_size = int(msg["world_size"])
        max_workers = int(msg.get("max_workers") or 0) or world_size
        # everything checked before anything changes
        servers = [(P.int_field(entry, "rank", 0, 1 << 16), P.str_field(entry, "host"),
                    P.int_field(entry, "port", 1, 65535),
                    P.str_field(entry, "host_id", 64, default="")) for entry in book]
        # the shares the job placed by (a spare that took over carries the lost one's); a
        # book without them: even
        shares = [P.share_field(entry, "share") for entry in book]
        weights = [share or 0.0 for share in shares] if None not in shares else []
        lost_servers = set(_ints(again, "lost_servers", len(book) - 1))
        spares = set(_ints(again, "spares", len(book) - 1)) - lost_servers
        live = set(_ints(again, "live", max_workers - 1))
        left = set(_ints(again, "left", max_workers - 1))
        incarnations = again.get("incarnations", {})
        if not isinstance(incarnations, dict) or len(incarnations) > max_workers:
            raise P.ProtocolError("reregister.incarnations: expected {rank: incarnation}")
        # the job's ranks, and those that attached beyond them (`bpsctl run --attach`)
        ranks = sorted({*range(world_size), *live, *left,
                        *(int(r) for r in incarnations
                          if isinstance(r, str) and r.isdigit() and int(r) < max_workers)})
        restarts = {rank: P.int_field(incarnations, str(rank), 0, 1 << 30, default=0)
                    for rank in ranks}
        _checked_tensors({"tensors": again.get("tensors", [])}, int(msg["partition_bytes"]))

        job = Job(id=str(msg["job"]), world_size=world_size, num_servers=len(book),
                  partition_bytes=int(msg["partition_bytes"]),
                  partition_depth=int(msg.get("partition_depth", 0)),
                  start_timeout_s=float(msg["start_timeout_s"]), first_seen=time.monotonic(),
                  started=True, min_workers=int(msg.get("min_workers", 0)),
                  max_workers=max_workers)
        for index, (rank, host, port, host_id) in enumerate(servers):
            server = self._server(rank)
            if server is None:
                server = self._await("server", rank, host, port,
                                     "lost" if index in lost_servers else "running")
                server.host_id = host_id
                self.servers.append(server)
                self.servers.sort(key=lambda s: s.rank)
            server.spare = index in spares      # the job's view, not the server's own flag
            job.servers.append(server)
        job.placement = Placement(len(book), spare=spares, shares=weights)
        for rank in ranks:
            state = "left" if rank in left else "running" if rank in live else "lost"
            worker = job.workers[rank] = self._await("worker", rank, "", None, state)
            worker.incarnation = restarts[rank]
        self.job = job
        self.log.warning("job %s goes on with this restarted scheduler: %d workers (%d live), "
                         "%d servers (%d spare); waiting up to %g s for them to register again",
                         job.id, len(ranks), len(live), len(book), len(spares),
                         self.config.heartbeat_timeout_s)
        return job

    def _merge(self, job: Job, again: dict[str, Any], rank: int) -> None:
        """Take the tensors (and lost servers) a re-registering worker knows into the job."""
        placement = job.placement
        assert placement is not None
        job.barriers_passed = max(job.barriers_passed, P.int_field(
            again, "barriers_passed", 0, 1 << 40, default=0))
        lost_servers = _ints(again, "lost_servers", len(job.servers) - 1)
        specs = again.get("tensors", [])
        checked = _checked_tensors({"tensors": specs}, job.partition_bytes)
        for spec, (name, *_) in zip(specs, checked, strict=True):
            parts = spec.get("parts")
            P.int_field(spec, "key", 0, 1 << 40)
            if not isinstance(parts, list) or len(parts) > P.MAX_PARTITIONS_PER_DECLARE or \
                    not all(isinstance(p, list) and len(p) == 4 and all(
                        isinstance(x, int) and x >= 0 for x in p) and p[1] < len(job.servers)
                        for p in parts):
                raise P.ProtocolError(f"tensor {name!r}: parts are not [[id, server, offset, "
                                      "length]] of this job's servers")
        for spec, (name, dtype, shape, _, reduce) in zip(specs, checked, strict=True):
            if name not in job.tensors:
                job.tensors[name] = {"name": name, "key": spec["key"], "dtype": dtype,
                                     "shape": shape, "reduce": reduce, "rank": rank,
                                     "parts": spec["parts"]}
        placement.lost.update(lost_servers)
        # the loads and counters the placement had, from where the partitions live now
        loads = [0] * len(job.servers)
        next_part = 0
        for tensor in job.tensors.values():
            job.next_key = max(job.next_key, tensor["key"] + 1)
            for part in tensor["parts"]:
                loads[part[1]] += max(part[3], 1)
                next_part = max(next_part, part[0] + 1)
        placement.loads = [0 if i in placement.lost else load for i, load in enumerate(loads)]
        placement.next_part_id = max(placement.next_part_id, next_part)

    def _release_held(self, job: Job) -> None:
        """Declarations held while some live worker had not registered again: answer them."""
        if job.held and not job.awaiting() and self.job is job:
            held, job.held = job.held, []
            for member, msg in held:
                if member.state in ("running", "joining"):
                    self._declare(member, msg)

    def _ending(self, job: Job) -> bool:
        """True when some worker of ``job`` has left or gone quiet: it will end by itself."""
        quiet_s = 2 * self.config.heartbeat_interval_s
        now = time.monotonic()
        return any(w.state != "running" or now - w.last_seen > quiet_s
                   for w in job.workers.values())

    @staticmethod
    def _busy_message(job: Job) -> str:
        return (f"the cluster is busy with job {job.id!r} ({job.world_size} workers); wait for it "
                "to end or run `bpsctl down`")

    def _start_queued(self) -> None:
        """Registrations that waited for the previous job to end: go on, or give up in time."""
        queued, self.queued = self.queued, []
        now = time.monotonic()
        for entry in queued:
            rid, msg, common, decide_at, answer_by = entry
            job = self.job
            if job is None or job.id == str(msg.get("job")):
                self._register_worker(rid, msg, {**common, "last_seen": now})
            elif now > answer_by or (now >= decide_at and not self._ending(job)):
                self._send(rid, P.ERROR, {"message": self._busy_message(job)})
            else:
                self.queued.append(entry)

    def _start_job(self, job: Job) -> None:
        job.started = True
        running = [s for s in self.servers if s.state == "running"]
        # spares last: in the address book (workers connect to them), never placed on
        job.servers = [s for s in running if not s.spare][:job.num_servers]
        active = len(job.servers)
        job.servers += [s for s in running if s.spare]
        # a spare sums nothing until it takes over a lost server's place, and its share
        shares = _job_shares(job.servers[:active], job.cpu_share) + [0.0] * (len(job.servers)
                                                                             - active)
        job.placement = Placement(len(job.servers), spare=set(range(active, len(job.servers))),
                                  shares=shares)
        book = _address_book(job.servers, shares)
        hosts = _rank_hosts(job.workers)
        for rank, worker in job.workers.items():
            self._send(worker.rid, P.REGISTERED, {"rank": rank, "servers": book,
                                                  "world_size": job.world_size,
                                                  "spares": sorted(job.placement.spare),
                                                  "hosts": hosts, **_clock(worker)})
        self.log.info("job %s started: %d workers, %d servers (%d spare), sharing the bytes %s",
                      job.id, job.world_size, len(job.servers), len(job.servers) - active,
                      " ".join(f"{share:.3f}" for share in shares[:active]))

    def _check_start_deadline(self) -> None:
        job = self.job
        if job is None or job.started:
            return
        if time.monotonic() - job.first_seen > job.start_timeout_s:
            missing = sorted(set(range(job.world_size)) - set(job.workers))
            message = (f"job {job.id!r}: worker rank(s) {missing} never registered within "
                       f"{job.start_timeout_s:g} s (raise it with BPSCTL_START_TIMEOUT / "
                       "--start-timeout)")
            self.log.warning(message)
            self._end_job(message, notify=job.workers.values())

    # ------------------------------------------------------------------ tensors

    def _declare(self, member: Member, msg: dict[str, Any]) -> None:
        job = self.job
        if (job is None or not job.started or job.placement is None
                or job.workers.get(member.rank) is not member):
            self._send(member.rid, P.ERROR, {"message": "declare outside a running job"})
            return
        if job.awaiting():
            job.held.append((member, msg))
            return
        answers = []
        for name, dtype, shape, nbytes, reduce in _checked_tensors(msg, job.partition_bytes):
            known = job.tensors.get(name)
            if known is None:
                itemsize = np.dtype(dtype).itemsize
                parts = job.placement.place(nbytes, itemsize, job.partition_bytes,
                                            job.partition_depth)
                job.next_key += 1
                known = job.tensors[name] = {
                    "name": name, "key": job.next_key - 1, "dtype": dtype, "shape": shape,
                    "reduce": reduce, "rank": member.rank,
                    "parts": [[p.part_id, p.server, p.offset, p.length] for p in parts]}
            elif "conflict" in known:
                # a worker that reaches the tensor after the disagreement must not wait for
                # pushes that will never come
                self._send(member.rid, P.ERROR, {"message": known["conflict"], "name": name})
                continue
            elif (known["dtype"], known["shape"], known["reduce"]) != (dtype, shape, reduce):
                message = (f"workers disagree on tensor {name!r}: rank {known['rank']} has "
                           f"{_described(known['dtype'], known['shape'], known['reduce'])}, "
                           f"rank {member.rank} has {_described(dtype, shape, reduce)}")
                self.log.warning(message)
                known["conflict"] = message
                for worker in job.workers.values():
                    self._send(worker.rid, P.ERROR, {"message": message, "name": name})
                continue
            answers.append({k: known[k] for k in ("name", "key", "parts")})
        self._send(member.rid, P.DECLARED, {"tensors": answers})

    def _barrier(self, member: Member, msg: dict[str, Any]) -> None:
        job = self.job
        if job is None or not job.started:
            self._send(member.rid, P.ERROR, {"message": "barrier outside a running job"})
            return
        name = str(msg.get("name"))
        job.barriers.setdefault(name, set()).add(member.rank)
        self._release_barriers(job)

    def _release_barriers(self, job: Job) -> None:
        """Barriers every live worker has reached (lost workers are not waited for), and those
        a worker had passed before this scheduler restarted (every worker had reached them)."""
        live = set(job.live())
        for name, arrived in list(job.barriers.items()):
            if live <= arrived or _barrier_index(name) < job.barriers_passed:
                del job.barriers[name]
                for worker in job.workers.values():
                    if worker.state == "running" and (live <= arrived or worker.rank in arrived):
                        self._send(worker.rid, P.BARRIER_DONE, {"name": name})

    # ------------------------------------------------------------------ endings

    def _leave(self, member: Member, failed: str = "") -> None:
        """``member`` left the job (it shut down); ``failed``: why its engine had failed, if it
        had (a job all of whose workers left after failing did not finish)."""
        member.state = "left"
        self.members.pop(member.rid, None)
        job = self.job
        if job is None or job.workers.get(member.rank) is not member:
            return
        job.failed = failed             # the last to leave says how the job ended
        if member.rank in job.donors:   # before it was admitted: nobody waits for its pushes
            self._go_on_without(job, member, f"{member.describe()} left before it joined")
            return
        if all(w.state in ("left", "lost") for w in job.workers.values()) \
                and len(job.workers) >= job.world_size:
            if job.failed:
                self.log.warning("job %s ended: its workers left after it failed (%s)", job.id,
                                 job.failed)
                self._end_job(f"its workers failed: {job.failed}", notify=())
            else:
                self.log.info("job %s finished", job.id)
                self._end_job(None, notify=(), finished=True)
            return
        joiners = [w for w in job.workers.values() if w.state == "joining"]
        if joiners and all(w.state in ("left", "lost", "joining") for w in job.workers.values()):
            # the last live worker left at the end of the job before it could hand the model
            # to a worker restarted (or attached) meanwhile: the job is over without it
            # (or, the last of them having failed, ended as failed: not finished)
            ending = f"its workers failed: {job.failed}" if job.failed else None
            self.log.warning("job %s %s before %s joined", job.id,
                             f"ended ({ending})" if ending else "finished",
                             ", ".join(w.describe() for w in joiners))
            said = {"finished": True, "message": f"job {job.id!r} finished before this worker "
                    "could join it"} if ending is None else {
                "message": f"job {job.id!r} ended ({ending}) before this worker could join it"}
            for joiner in joiners:
                self._send(joiner.rid, P.ERROR, said)
            self._end_job(ending, notify=(), finished=ending is None)
            return
        # The others may still wait for this worker's pushes: they give in-flight results a
        # moment to arrive, then fail naming it instead of waiting out the op timeout.
        left = {"rank": member.rank, "message": f"{member.describe()} left the job (it shut "
                f"down) while this push_pull still needed its pushes"}
        for worker in job.workers.values():
            if worker.state == "running":
                self._send(worker.rid, P.MEMBER_LEFT, left)

    def _end_job(self, message: str | None, notify: Any, finished: bool = False) -> None:
        job = self.job
        self.job = None
        if job is None:
            return
        self.ended[job.id] = "finished" if finished else message or "a worker was lost"
        while len(self.ended) > ENDED_JOBS_KEPT:
            self.ended.popitem(last=False)
        for worker in notify:
            if worker.state == "running":
                self._send(worker.rid, P.ERROR, {"message": message})
        for worker in job.workers.values():
            self.members.pop(worker.rid, None)
        for server in self.servers:
            if server.state == "running":
                self._send(server.rid, P.JOB_END, {"job": job.id})

    def _check_liveness(self) -> None:
        now = time.monotonic()
        live = [m for m in self.members.values()
                if m.state in ("running", "joining") and not m.awaited]
        # members on other machines (a server beside this scheduler goes on talking to it
        # while their host is cut off from the rest); a cut silences them at once, but their
        # last heartbeats may be an interval apart: when the first has been silent for the
        # timeout, the others for two intervals less at least
        remote = [m for m in live if m.host != self.config.host]
        timeout = self.config.heartbeat_timeout_s
        quiet = timeout - 2 * self.config.heartbeat_interval_s
        if len(live) > 1 and all(now - m.last_seen > timeout for m in live) or \
                len({m.host for m in remote}) > 1 and \
                all(now - m.last_seen > quiet for m in remote) and \
                any(now - m.last_seen > timeout for m in remote):
            # every member silent at once, or every one on another machine: it is this
            # scheduler (or its host) that was cut off or paused, not all of them; nobody is
            # declared lost, and each is judged again once it is heard from (docs/chaos.md)
            if not self.isolated:
                self.isolated = True
                self.log.warning("heard from none of %d members for over %g s: this "
                                 "scheduler or its host was cut off or paused; declaring "
                                 "nobody lost", len(remote) or len(live), timeout)
            return
        if self.isolated:
            self.isolated = False
            for member in live:         # silent because this scheduler was: time from now
                member.last_seen = max(member.last_seen, now - self.config.heartbeat_interval_s)
        for member in list(self.members.values()):
            if (member.state not in ("running", "joining")
                    or now - member.last_seen <= self.config.heartbeat_timeout_s):
                continue
            if member.awaited:
                self._lose(member, f"it did not register again with the restarted scheduler "
                                   f"within {now - member.last_seen:.1f} s")
            else:
                self._lose(member, f"no heartbeat for {now - member.last_seen:.1f} s")
            if self.job is not None:
                self._release_held(self.job)

    def _fence(self, rid: bytes, msg_type: int) -> None:
        """A member declared lost spoke again (it was paused, or cut off, past its heartbeat
        timeout, and the job went on without it): it is told so, once, and its words are not
        acted on; it exits (docs/chaos.md, "A machine that comes back")."""
        message = self.fenced.pop(rid)
        self.log.warning("%s spoke again (%s) after it was declared lost: fenced", message,
                         P.TYPE_NAMES.get(msg_type, msg_type))
        self._send(rid, P.ERROR, _fenced(message))

    def _lose(self, member: Member, reason: str) -> None:
        """``member`` is lost: the job goes on without it where it can, else it ends."""
        member.state = "lost"
        self.log.warning("lost %s: %s", member.describe(), reason)
        self.fenced[member.rid] = f"{member.describe()} was declared lost ({reason})"
        while len(self.fenced) > 1024:
            self.fenced.popitem(last=False)
        if member.role == "server" and self.hvd_join is not None:
            self._join_goes_on(member)
        lost = {"role": member.role, "rank": member.rank, "host": member.host,
                "port": member.port, "pid": member.pid, "reason": reason,
                "message": f"lost {member.describe()}: {reason}"}
        job = self.job
        if member.role == "server" and not member.spare and (job is None or not job.started):
            self._promote_spare(member)         # no partitions yet: it takes the lost one's place
        if job is None:
            return
        if member.role == "server" and self._fail_over(
                job, member, f"lost {member.describe()}: {reason}"):
            return
        if member.role == "worker" and self._go_on_without(
                job, member, f"lost {member.describe()}: {reason}"):
            return
        others = [w for w in job.workers.values() if w is not member and w.state == "running"]
        for worker in others:
            self._send(worker.rid, P.MEMBER_LOST, lost)
        if member.role == "worker" and job.workers.get(member.rank) is member:
            self._end_job(None, notify=())

    def _go_on_without(self, job: Job, worker: Member, message: str) -> bool:
        """A lost worker of a job that keeps going while ``min_workers`` live: tell its servers
        (rounds complete without its pushes) and the other workers (``size()`` shrinks);
        False if the job cannot go on (fail-fast, or too few left)."""
        if job.workers.get(worker.rank) is not worker or not job.started:
            return False
        live = job.live()
        # a joiner lost before its donor admitted it was never in the rounds: the job goes
        # on as it was, whatever BPSCTL_MIN_WORKERS says
        if worker.rank not in job.donors and (
                not job.min_workers or len(live) < max(1, job.min_workers)):
            return False
        body = {"rank": worker.rank, "incarnation": worker.incarnation, "message": message,
                "live": live}
        job.worker_losses[worker.rank] = body
        self.log.warning("%s; job %s goes on with %d workers (min %d)", message, job.id,
                         len(live), job.min_workers)
        for member in [*job.servers, *job.workers.values()]:
            if member.state == "running":
                self._send(member.rid, P.WORKER_LOST, body)
        self.members.pop(worker.rid, None)
        self._release_barriers(job)
        if self.hvd_join is not None:
            self._join_goes_on(worker)      # it counts as joined: nobody waits for it
        job.donors.pop(worker.rank, None)
        for rank, donor in list(job.donors.items()):
            if donor == worker.rank:        # the donor is gone: another live worker hands it on
                self._ask_donor(job, job.workers[rank])
        if all(w.state in ("left", "lost") for w in job.workers.values()):
            self._end_job(None, notify=(), finished=any(
                w.state == "left" for w in job.workers.values()))
        return True

    def _promote_spare(self, lost: Member) -> Member | None:
        """The first live spare server takes lost server ``lost``'s place: it is a server like
        the others from now on (this job's placement is the caller's business)."""
        spare = next((s for s in self.servers if s.spare and s.state == "running"), None)
        if spare is not None:
            spare.take_over(lost.rank)
            self.log.warning("spare %s takes the place of lost server %d", spare.describe(),
                             lost.rank)
        return spare

    def _fail_over(self, job: Job, server: Member, message: str) -> bool:
        """Move a lost server's partitions to a spare server of the job (all of them to one,
        so loads stay as balanced as before), or with none left to the job's surviving servers,
        and tell the workers (see "Keeping going through a lost machine" in docs/design.md);
        False if the job cannot go on without it (failover off, not started, no server left)."""
        if server not in job.servers:
            return True                 # not one of this job's servers: nothing to move
        index = job.servers.index(server)
        placement = job.placement
        alive = [i for i, s in enumerate(job.servers)
                 if s.state == "running" and placement is not None and i not in placement.lost]
        if not self.config.server_failover or placement is None or not alive:
            return False
        parts = [part for tensor in job.tensors.values() for part in tensor["parts"]]
        was_spare = index in placement.spare
        spare = None if was_spare else next(
            (i for i in sorted(placement.spare) if job.servers[i].state == "running"), None)
        moves = placement.move_off(index, parts, to=spare)
        body = {"index": index, "rank": server.rank, "message": message, "moves": moves}
        if was_spare:
            self.log.warning("%s; it was a spare and held nothing; job %s goes on", message,
                             job.id)
        elif spare is not None:
            taker = job.servers[spare]
            taker.take_over(server.rank)
            body["spare"] = taker.rank
            self.log.warning("%s; job %s goes on: spare %s took over its %d partitions",
                             message, job.id, taker.describe(), len(moves))
        else:
            moved_to = sorted({job.servers[new].rank for _, new in moves})
            self.log.warning("%s; job %s goes on: %d partitions moved to server(s) %s", message,
                             job.id, len(moves), moved_to or "(none yet declared)")
        job.server_moves[index] = body
        for worker in job.workers.values():
            # a joiner too: it learnt the lost servers when it registered, not since
            if worker.state in ("running", "joining"):
                self._send(worker.rid, P.SERVER_MOVED, body)
        return True

    def _status(self, rid: bytes, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        job = self.job
        workers = sorted(job.workers.values(), key=lambda w: w.rank) if job else []
        self._send(rid, P.STATUS_REPLY, {
            "servers": [s.as_dict(now) for s in self.servers],
            "workers": [w.as_dict(now) for w in workers],
            "job": ({"id": job.id, "world_size": job.world_size, "started": job.started,
                     "max_workers": job.max_workers} if job else None),
            # the last jobs that ended: "finished", or why not (bpslaunch's scheduler and
            # servers end with their job, as BytePS's do)
            "ended": dict(self.ended),
        })


_DTYPE_NAMES = {str(dtype) for dtype in P.DTYPES}


def _fenced(why: str) -> dict[str, Any]:
    """The ERROR that tells a member declared lost that it is fenced (it exits)."""
    return {"message": f"{why}; it is fenced: the job does not wait for it, nothing it sends "
                       "is used, and it must exit", "fenced": True}


def _clock(member: Member) -> dict[str, Any]:
    """The clock exchange of a REGISTERED answer: the member's reading when it sent REGISTER,
    ours when it arrived and ours now (see bpsctl.engine.trace.clock_offset)."""
    if member.clock is None:
        return {}
    return {"clock": [*member.clock, time.monotonic_ns()]}


def _barrier_index(name: str) -> int:
    """The count of a worker's barrier (``barrier.<k>``: its k-th), -1 for another name."""
    prefix, _, index = name.rpartition(".")
    return int(index) if prefix == "barrier" and index.isdigit() else -1


def _ints(msg: dict[str, Any], key: str, high: int) -> list[int]:
    """``msg[key]``: a list of integers in ``0..high`` (absent: empty)."""
    values = msg.get(key, [])
    if not isinstance(values, list) or len(values) > P.MAX_WORKERS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= high for v in values):
        raise P.ProtocolError(f"{key}: expected a list of integers in 0..{high}")
    return values


def _check_worker_registration(msg: dict[str, Any]) -> None:
    """Raise ProtocolError unless a worker's REGISTER carries every field in range."""
    world_size = P.int_field(msg, "world_size", 1, P.MAX_WORKERS)
    max_workers = P.int_field(msg, "max_workers", 0, P.MAX_WORKERS, default=0)
    if 0 < max_workers < world_size:
        raise P.ProtocolError(f"max_workers: expected 0 or at least world_size {world_size}, "
                              f"got {max_workers}")
    P.int_field(msg, "rank", -1, max(world_size, max_workers) - 1, default=-1)
    P.str_field(msg, "job")
    P.int_field(msg, "num_servers", 0, 1 << 16, default=0)
    P.share_field(msg, "cpu_share")
    P.int_field(msg, "partition_bytes", 8, 1 << 40)
    P.int_field(msg, "partition_depth", 0, 1 << 16, default=0)
    P.float_field(msg, "start_timeout_s", 0, 1e6)
    P.int_field(msg, "min_workers", 0, world_size, default=0)
    for flag in ("rejoin", "attach"):
        if not isinstance(msg.get(flag, False), bool):
            raise P.ProtocolError(f"field {flag!r} must be true or false")


def _rank_hosts(workers: dict[int, Member]) -> list[int]:
    """Each rank's host, as an index (hosts numbered in the order of their first rank): what
    Horovod's cross rank and cross size are computed from, the same on every rank."""
    index: dict[tuple[str, str], int] = {}
    return [index.setdefault((workers[rank].host, workers[rank].host_id), len(index))
            for rank in sorted(workers)]


def _described(dtype: str, shape: list[int], reduce: str) -> str:
    """A declared tensor as a disagreement names it: ``float32(4, 2)``, ``... reduced by max``."""
    return f"{dtype}{tuple(shape)}" + ("" if reduce == "sum" else f" reduced by {reduce}")


def _checked_tensors(msg: dict[str, Any],
                     partition_bytes: int) -> list[tuple[str, str, list[int], int, str]]:
    """A DECLARE's tensors as (name, dtype, shape, nbytes, reduction: "sum" unless the spec's
    ``reduce`` says "min", "max" or "product"), all checked before any is placed."""
    specs = msg.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > P.MAX_TENSORS_PER_DECLARE:
        raise P.ProtocolError(f"tensors: expected a list of at most {P.MAX_TENSORS_PER_DECLARE} "
                              "tensor specs")
    checked, partitions = [], 0
    for spec in specs:
        if not isinstance(spec, dict):
            raise P.ProtocolError("tensors: expected {name, dtype, shape} objects")
        name = P.str_field(spec, "name", max_len=4096)
        dtype = spec.get("dtype")
        shape = spec.get("shape")
        if dtype not in _DTYPE_NAMES:
            raise P.ProtocolError(f"tensor {name!r}: dtype {P.shown(dtype)} is not one of "
                                  f"{', '.join(sorted(_DTYPE_NAMES))}")
        if not isinstance(shape, list) or len(shape) > 64 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise P.ProtocolError(f"tensor {name!r}: shape {P.shown(shape)} is not a list of "
                                  "non-negative integers")
        reduce = spec.get("reduce", "sum")
        if reduce not in P.REDUCTIONS.values():
            raise P.ProtocolError(f"tensor {name!r}: reduce {P.shown(reduce)} is not one of "
                                  f"{', '.join(P.REDUCTIONS.values())}")
        itemsize = np.dtype(dtype).itemsize
        nbytes = math.prod(shape) * itemsize
        partitions += max(1, -(-nbytes // max(itemsize, partition_bytes // itemsize * itemsize)))
        if partitions > P.MAX_PARTITIONS_PER_DECLARE:
            raise P.ProtocolError(f"tensor {name!r} of {nbytes} bytes takes this declaration "
                                  f"past {P.MAX_PARTITIONS_PER_DECLARE} partitions of "
                                  f"{partition_bytes} bytes (raise BPSCTL_PARTITION_BYTES)")
        checked.append((name, dtype, shape, nbytes, reduce))
    return checked


def main() -> None:
    exit_on_sigterm()
    config = Config.from_env(role="scheduler")
    scheduler = Scheduler(config)
    try:
        scheduler.serve_forever()
    except KeyboardInterrupt:
        scheduler.log.info("stopped")


if __name__ == "__main__":
    main()
