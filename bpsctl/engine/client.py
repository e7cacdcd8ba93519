"""Asking a running scheduler about its cluster (used by `bpsctl status` and launchers)."""
from __future__ import annotations

from typing import Any

import zmq

from . import protocol as P
from .common import EngineError, make_socket


def scheduler_status(address: str, secret: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """The scheduler's view: ``{"servers": [...], "workers": [...], "job": {...}|None}``.

    ``address`` is host:port, or a ZeroMQ endpoint such as the scheduler's control socket.

    Each member is ``{"role", "rank", "host", "port", "pid", "state", "last_seen_s"}``.
    """
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER)
    try:
        sock.connect(address if "://" in address else f"tcp://{address}")
        sock.send_multipart(P.control(P.STATUS, {"secret": secret}))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise EngineError(f"the scheduler at {address} did not answer within {timeout_s:g} s; "
                              "is the cluster up? (`bpsctl status`, `bpsctl up`)")
        msg_type, msg = P.parse_control(sock.recv_multipart())
    finally:
        sock.close(0)
    if msg_type != P.STATUS_REPLY:
        raise EngineError(f"the scheduler at {address} refused the status request: {msg.get('message')}")
    return msg
