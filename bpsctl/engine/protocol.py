"""Wire format shared by scheduler, servers and workers.

Every message is a ZeroMQ multipart message ``[header, body]``:

* ``header`` is a fixed 24-byte struct (:data:`HEADER`): magic, protocol version, message
  type, dtype code, flags, sender rank, partition id, round, payload bytes.
* ``body`` is the raw partition bytes for data messages (PUSH, RESULT), sent and
  received without copies (or, between a worker and a server on one host, where those bytes
  are in shared memory: :data:`FLAG_SHM`), or a small JSON object for control messages.

Data messages never touch JSON; control messages (registration, declaration, barrier,
status, errors) are rare and readable.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

MAGIC = b"BP"
PROTOCOL_VERSION = 1

#: magic, version, type, dtype code, flags, rank, partition id, round, nbytes
HEADER = struct.Struct("<2sBBBBHIIQ")
HEADER_SIZE = HEADER.size
#: where the flags byte sits in a packed header (after magic, version, type and dtype code)
FLAGS_OFFSET = 5


def with_flag(header: bytes, flag: int) -> bytes:
    """A packed header with ``flag`` set as well."""
    return header[:FLAGS_OFFSET] + bytes((header[FLAGS_OFFSET] | flag,)) + \
        header[FLAGS_OFFSET + 1:]

# --- scheduler plane (JSON bodies)
REGISTER = 1        # any -> scheduler: {role, rank, world_size, job, host, port, pid, version,
                    #   clock_ns (the sender's monotonic clock as it sent), ...}; a worker's also
                    #   max_workers, and rejoin or attach to join a running job
REGISTERED = 2      # scheduler -> any: {rank, servers: [{rank, host, port}], clock: [clock_ns,
                    #   arrival, answer] (the scheduler's readings), ...}
HEARTBEAT = 3       # any -> scheduler: {}
DECLARE = 4         # worker -> scheduler: {tensors: [{name, dtype, shape, nbytes}]}
DECLARED = 5        # scheduler -> worker: {tensors: [{name, key, parts}]},
                    #   parts: [[pid, server, offset, length]]
BARRIER = 6         # worker -> scheduler: {name}
BARRIER_DONE = 7    # scheduler -> workers: {name}
STATUS = 8          # client -> scheduler: {}
STATUS_REPLY = 9    # scheduler -> client: {servers: [...], workers: [...], job: {...}|null}
MEMBER_LOST = 10    # scheduler -> members: {role, rank, host, port, pid, reason}
LEAVE = 11          # worker -> scheduler: {} (clean shutdown)
JOB_END = 12        # scheduler -> servers: {job}
ERROR = 13          # anyone -> anyone: {message, name?}; a server's with part and round
                    #   answers that partition's round (the pushes of it fail, nothing else)
MEMBER_LEFT = 14    # scheduler -> workers: {rank, message} (a peer shut down while others run)
WORKER_LOST = 30    # scheduler -> job's workers and servers: {rank, message, live: [ranks]}
                    #   (the job goes on without it: BPSCTL_MIN_WORKERS)
SERVER_MOVED = 19   # scheduler -> workers: {index, rank, message, moves: [[part id, new index]],
                    #   spare?: rank} (a lost server's partitions now live on the job's other
                    #   servers; ``spare``: all on that spare server, which took over)
# --- a restarted worker rejoins a running job, or a new one joins it (`bpsctl run --attach`;
# docs/design.md, "Keeping going")
WORKER_JOINING = 31  # scheduler -> the donor (a live worker): {rank, incarnation}
JOIN_DONE = 32      # donor -> scheduler: {rank} (servers admitted it, its state is on its way)
WORKER_JOINED = 33  # scheduler -> job's workers: {rank, message, live: [ranks]}
# --- Horovod's join (hvd.join(); docs/horovod-api.md): a rank out of data adds zeros to the
# others' rounds until every rank has joined
HVD_JOIN = 34       # worker -> scheduler: {rounds: {part id: round}, op_timeout_s} (this rank
                    #   joined, with nothing in flight)
JOINED = 35         # scheduler -> job's workers, once all acked -> its servers: {job, epoch,
                    #   ranks: [joined]}; at the end -> servers {job, epoch, done: true}, once all
                    #   acked -> workers {job, epoch, done: true, last, rounds: {part id: round}}
JOINED_ACK = 36     # worker or server -> scheduler: {epoch} (JOINED taken in)
# --- the hmac handshake that opens every connection (see security.py); the secret never travels
AUTH = 15           # connecting -> bound: {version, nonce}
CHALLENGE = 16      # bound -> connecting: {nonce, proof}
PROOF = 17          # connecting -> bound: {proof}
CLOCK = 18          # any -> scheduler: {clock_ns}; scheduler -> any: {clock: [clock_ns,
                    #   arrival, answer]} (a clock exchange, repeated a few times per connection)

# --- data plane
HELLO = 20          # worker -> server: {job, rank, world_size, hosts, version, incarnation,
                    #   backup_workers, max_workers}
PUSH = 21           # worker -> server: header + partition bytes
ACK = 22            # server -> worker: header (push received; credit may be released)
RESULT = 23         # server -> worker: header + summed partition bytes; the header's rank
                    #   field says how many workers' pushes it sums (0: 65536); under
                    #   FLAG_ASYNC the partition's parameters on the server
ADMIT = 24          # donor -> each server: {rank, rounds: {part id: round}} (count rank's
                    #   pushes from these rounds on: it rejoins at the donor's step boundary)
STATE = 25          # donor -> a server -> the joiner: header (rank = the joiner, round = its
                    #   incarnation), the rounds {part id: round} as JSON, then the model and
                    #   optimizer state the joiner starts from (the server only relays them)
LAST_SUM = 27       # worker -> the server a lost one's partition moved to, before pushing it
                    #   there: header (dtype, part, round, nbytes, rank = its count) + the sum
                    #   of that round the lost server sent it, for workers it did not reach
SCOPE = 40          # worker -> server, before its first push of these partitions on that
                    #   connection: {parts: [part ids], ranks: [ranks]} (the partitions of a
                    #   process set's tensor: a round completes once those ranks pushed it)
PUSH_ZERO = 26      # worker -> server: a PUSH header alone: the pusher's contribution to the
                    #   partition's round is all zeros (a sum's identity): counted as a push
                    #   (ACK, RESULT) but nothing is folded in. nbytes: the partition's size;
                    #   rank: under REDUCE_BROADCAST the root the pusher names, else its own.
                    #   Uncompressed, not host-reduced, not asynchronous; sums and broadcasts only

#: in a PUSH's or PUSH_ZERO's rank field (below the ranks, which are < MAX_WORKERS): the
#: pusher reads nothing of this partition's sum (an alltoall's rows sent to other ranks), so
#: its RESULT comes as the header alone, saying the round is complete
RESULT_HEADER_ONLY = 0x8000

TYPE_NAMES = {v: k for k, v in dict(globals()).items() if isinstance(v, int) and k.isupper()
              and k not in ("PROTOCOL_VERSION", "HEADER_SIZE", "RESULT_HEADER_ONLY")}

#: bfloat16, which NumPy lacks: two opaque bytes per element (``|V2``; view a bf16 tensor's
#: bits as this). Servers sum it by widening to float32 and rounding back to nearest-even.
BFLOAT16 = np.dtype("V2")

#: dtype codes on the wire; summation is done in the dtype itself (as BytePS does), except
#: bfloat16 (see above)
DTYPES: list[np.dtype] = [np.dtype(name) for name in (
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64")] + [BFLOAT16]
DTYPE_CODES: dict[np.dtype, int] = {dt: code for code, dt in enumerate(DTYPES)}
BFLOAT16_CODE = DTYPE_CODES[BFLOAT16]
NO_DTYPE = 255

#: a PUSH's dtype byte: the dtype code in the low 4 bits, how the server combines the round's
#: pushes in the high 4 (0, a sum, is what every push without one means). The partition is
#: bound to its first push's reduction, as to its dtype: a push with another is refused.
REDUCE_SHIFT = 4
REDUCE_SUM, REDUCE_MIN, REDUCE_MAX, REDUCE_PRODUCT = range(4)
#: a broadcast: a sum in which one push per round carries data (its pusher is the root) and
#: every other is a PUSH_ZERO naming the root its pusher believes; the server answers every
#: pusher with an ERROR naming the partition when those roots disagree or the root pushed
#: nothing, so ranks that call a broadcast with different roots all fail
REDUCE_BROADCAST = 4
REDUCTIONS: dict[int, str] = {REDUCE_SUM: "sum", REDUCE_MIN: "min", REDUCE_MAX: "max",
                              REDUCE_PRODUCT: "product", REDUCE_BROADCAST: "broadcast"}
#: how a server folds one push into the round's result, by reduction
REDUCE_UFUNCS: dict[int, np.ufunc] = {REDUCE_SUM: np.add, REDUCE_MIN: np.minimum,
                                      REDUCE_MAX: np.maximum, REDUCE_PRODUCT: np.multiply,
                                      REDUCE_BROADCAST: np.add}
#: the reductions a PUSH_ZERO may take part in: those of which zeros are the identity
ZERO_REDUCTIONS = (REDUCE_SUM, REDUCE_BROADCAST)


def push_dtype(code: int, reduction: int = REDUCE_SUM) -> int:
    """The dtype byte of a PUSH of dtype ``code`` combined by ``reduction``."""
    return code | reduction << REDUCE_SHIFT


def split_push_dtype(byte: int) -> tuple[int, int]:
    """(dtype code, reduction) of a PUSH's dtype byte."""
    return byte & ((1 << REDUCE_SHIFT) - 1), byte >> REDUCE_SHIFT

#: control messages (JSON) larger than this are refused: the biggest real one, a DECLARE of
#: every tensor of a large model, is a few hundred KiB
MAX_CONTROL_BYTES = 4 * 1024 * 1024
#: workers in one job, tensors in one DECLARE, partitions of one tensor: far above any real job,
#: low enough that a hostile number cannot make the scheduler loop or allocate for long
MAX_WORKERS = 1 << 16
MAX_TENSORS_PER_DECLARE = 1 << 16
MAX_PARTITIONS_PER_DECLARE = 1 << 20

#: PUSH flag: the payload is already summed over the pusher's host (intra-node stage), so the
#: round completes after one push per host instead of one per worker
FLAG_HOST_REDUCED = 1
#: a push inside a worker's traced window: the server traces its round too (engine/trace.py)
FLAG_TRACED = 2
#: PUSH and RESULT flag: the payload is compressed (engine/compression.py): a 16-byte header
#: naming the compressor and the partition's values, then the compressed bytes; the dtype
#: code is the tensor's own
FLAG_COMPRESSED = 4
#: PUSH flag: the push of an averaged push_pull; with backup workers (BPSCTL_BACKUP_WORKERS)
#: its round may complete without that many pushes. Sums (broadcasts, integers) never carry it
FLAG_BACKUP = 8
#: RESULT flag: the answer to a push that came after its round was complete (backup
#: workers): the push is not in the sum, and the result is the one everyone else received
FLAG_LATE = 16
#: PUSH and RESULT flag: asynchronous training (BPSCTL_ASYNC; docs/design.md §5). The server
#: holds the partition's parameters and applies each push at once as one SGD step; a PUSH
#: carries a gradient and a third frame, the optimizer's hyperparameters (:data:`ASYNC_HYPER`),
#: and its round is the pusher's own sequence number of the partition (a round the server has
#: applied for that rank already is answered, not applied again). The RESULT holds the
#: partition's parameters after the update
FLAG_ASYNC = 32
#: PUSH flag, with FLAG_ASYNC: a worker's first push of the partition, carrying its parameter
#: values and no hyperparameters. The first such push of a partition sets the server's
#: parameters; every one is answered with them
FLAG_ASYNC_INIT = 64
#: PUSH and RESULT flag: a worker and a server on one host (BPSCTL_SHM_SERVER; engine/shmlink.py).
#: The body is not the partition's bytes but a reference (``shmlink.REF``: owner, chunk,
#: offset) to where they are in shared memory: a PUSH names the pusher's slot of the
#: partition, a RESULT one of the server's sum buffers or the receiver's own slot. nbytes is
#: the partition's size, as without it
FLAG_SHM = 128
#: an async PUSH's third frame: lr, momentum, weight_decay, dampening (float64) and nesterov
#: (0 or 1), as torch.optim.SGD's param group holds them when the gradient is pushed
ASYNC_HYPER = struct.Struct("<ddddB")


class ProtocolError(ValueError):
    """Bytes on the wire that are not a valid bpsctl message."""


def dtype_code(dtype: np.dtype) -> int:
    try:
        return DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(str(d) if d != BFLOAT16 else "bfloat16 (as |V2)" for d in DTYPES)
        raise TypeError(f"dtype {np.dtype(dtype)} is not supported by push_pull; "
                        f"use one of: {supported}") from None


def bf16_widen(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 ``out``, exactly, without allocating a buffer."""
    halves = out.view(np.uint16)        # little-endian: [low, high] per float32
    halves[0::2] = 0
    halves[1::2] = bits
    return out


def bf16_round(values: np.ndarray, scratch: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float32 ``values`` -> bfloat16 bits in ``out`` (uint16), rounding to nearest-even as
    torch does; ``values`` is overwritten and ``scratch`` is a uint32 array of the same length.

    NaNs need no special case here: sums and quotients of widened bfloat16 values are NaNs
    whose low 16 bits are zero (x86 keeps the operand's payload, or makes the default NaN),
    so rounding cannot carry into their high half.
    """
    bits = values.view(np.uint32)
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.add(bits, scratch, out=bits)
    np.right_shift(bits, 16, out=scratch)
    np.copyto(out, scratch, casting="unsafe")
    return out


def pack_header(msg_type: int, *, dtype: int = NO_DTYPE, flags: int = 0, rank: int = 0,
                part: int = 0, round: int = 0, nbytes: int = 0) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, dtype, flags, rank, part, round, nbytes)


def unpack_header(frame: Any) -> tuple[int, int, int, int, int, int, int]:
    """Return (type, dtype, flags, rank, part, round, nbytes); raise ProtocolError on bad bytes."""
    buf = memoryview(frame)
    if buf.nbytes != HEADER_SIZE:
        raise ProtocolError(f"header of {buf.nbytes} bytes, expected {HEADER_SIZE}")
    magic, version, msg_type, dtype, flags, rank, part, round_, nbytes = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a bpsctl peer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks bpsctl protocol version {version}, "
                            f"this process speaks {PROTOCOL_VERSION}: install the same bpsctl "
                            "version everywhere")
    return msg_type, dtype, flags, rank, part, round_, nbytes


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def int_field(msg: dict[str, Any], key: str, low: int, high: int, default: Any = None) -> int:
    """``msg[key]`` as an int in ``low..high`` (``default`` when absent); else ProtocolError."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{key}: expected an integer in {low}..{high}, got {shown(value)}")
    return value


def float_field(msg: dict[str, Any], key: str, low: float, high: float) -> float:
    """``msg[key]`` as a finite number in ``low..high`` (exclusive of ``low``)."""
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not low < value <= high:
        raise ProtocolError(f"{key}: expected a number above {low:g} up to {high:g}, "
                            f"got {shown(value)}")
    return float(value)


def share_field(msg: dict[str, Any], key: str) -> float | None:
    """``msg[key]``: a share of the bytes, a number in 0..1, or None when absent or null."""
    value = msg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not 0 <= value <= 1:
        raise ProtocolError(f"{key}: expected a share of the bytes from 0 to 1, or null, "
                            f"got {shown(value)}")
    return float(value)


def str_field(msg: dict[str, Any], key: str, max_len: int = 256, default: Any = None) -> str:
    value = msg.get(key, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"{key}: expected a string of at most {max_len} characters, "
                            f"got {shown(value)}")
    return value


def control(msg_type: int, body: dict[str, Any] | None = None) -> list[bytes]:
    """A control message: header + JSON body."""
    return [pack_header(msg_type), json.dumps(body or {}).encode()]


def parse_control(frames: list[Any]) -> tuple[int, dict[str, Any]]:
    """Parse ``[header, json]``; raise ProtocolError on anything else."""
    if len(frames) != 2:
        raise ProtocolError(f"control message with {len(frames)} frames, expected 2")
    msg_type = unpack_header(frames[0])[0]
    size = memoryview(frames[1]).nbytes
    if size > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message body of {size} bytes, at most {MAX_CONTROL_BYTES}")
    try:
        body = json.loads(bytes(frames[1]))
    except ValueError as exc:       # not UTF-8, not JSON, or an integer of 4300+ digits
        raise ProtocolError(f"control message body is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("control message body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise ProtocolError("control message body is not a JSON object")
    return msg_type, body
