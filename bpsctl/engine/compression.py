"""Gradient compression between machines: onebit, top-k, random-k, dithering, fp16 and bf16,
each optionally with error feedback, compressed both ways through the servers.

A compressor turns ``n`` float32 values into a body of bytes and back. What travels is
``[compression header, body]``: the 16-byte header (:data:`COMP_HEADER`: kind, options, the
kind's parameter, ``n``, seed) says everything a server needs to decompress the push, so a
partition that moves to another server mid-job (failover) is understood there at once.
Wire sizes, header included (``k`` = ``ratio·n`` rounded half up, at least 1, at most ``n``;
``b`` = bits per dithered value, ``ceil(log2(2·levels + 1))``):

=============  ==========================  ===========================================
compressor     bytes on the wire           what is sent
=============  ==========================  ===========================================
onebit         16 + 4 + ceil(n/8)          scale (mean |g|, or 1 without scaling), signs
topk:R         16 + 8k                     k indices (uint32, ascending), k values
randomk:R      16 + 4k                     k values; indices from a seed shared by all
dithering:L    16 + 4 + ceil(n·b/8)        norm, a b-bit signed level per value
fp16, bf16     16 + 2n                     every value, rounded
=============  ==========================  ===========================================

Workers compress each partition of a push (:class:`WorkerCodec`); a server decompresses
every worker's push into one float32 sum, compresses the sum again with the same compressor
and sends that to every worker (:class:`ServerCodec`). Error feedback (``ef``) keeps, on
workers and on servers, the part of each tensor the compression dropped (``g + residual -
decompress(compress(g + residual))``) and adds it to the next round's values, so nothing is
lost, only late.

Randomness is derived from ``(seed, partition, round)``: random-k picks the same indices on
every worker and on the server (so they are not sent, and the server's recompression keeps
the sum exactly); dithering's stochastic rounding adds the sender (worker rank, or the server)
so that workers round independently, and any run is reproducible.
"""
from __future__ import annotations

import functools
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import protocol as P

#: kind, options, reserved, the kind's parameter (k or levels), n (values), seed
COMP_HEADER = struct.Struct("<BBHIII")
HEADER_BYTES = COMP_HEADER.size

KIND_FP16, KIND_BF16, KIND_ONEBIT, KIND_TOPK, KIND_RANDOMK, KIND_DITHERING = range(1, 7)
OPT_SCALING, OPT_NATURAL, OPT_L2, OPT_EF = 1, 2, 4, 8

#: dithering levels: at most 8 bits per value on the wire
MAX_LEVELS = 127
#: the stream of the server's own stochastic rounding (workers use their rank)
SERVER_STREAM = 0xFFFFFFFF
#: the most values of one compressed partition a server accepts (1 GiB of float32, far above
#: any partition size): its buffers are a few times the values' size, whatever the push's
MAX_VALUES = 2**28

Key = tuple[int, int, int, int]     # seed, partition id, round, stream


_workspace = threading.local()


def _work(slot: str, n: int, dtype: Any) -> np.ndarray:
    """``n`` elements of this thread's buffer ``slot``, reused from call to call.

    Compressors run on the caller's, the I/O and the summation threads, one partition at a
    time, so each thread keeps one buffer per slot, as large as the largest partition it has
    compressed: no temporary the size of a partition is allocated (and page-faulted) per call.
    """
    buffers = _workspace.__dict__.setdefault("buffers", {})
    buffer = buffers.get(slot)
    if buffer is None or len(buffer) < n:
        buffer = buffers[slot] = np.empty(n, dtype)
    return buffer[:n]


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(words))))


def _ratio(ratio: Any, kind: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or \
            not math.isfinite(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"{kind} ratio: expected a number in (0, 1], such as 0.01, "
                         f"got {ratio!r}")
    return float(ratio)


def _count(ratio: float, n: int) -> int:
    """k for ``n`` values: ratio·n rounded half up, at least 1, at most n."""
    return max(1, min(n, int(ratio * n + 0.5)))


@dataclass(frozen=True)
class Compressor:
    """What turns ``n`` float32 values into bytes and back; subclasses say how."""

    ef: bool = True

    kind = 0
    name = "none"

    def body_bytes(self, n: int) -> int:
        raise NotImplementedError

    def wire_bytes(self, n: int) -> int:
        """Bytes on the wire for ``n`` values, header included."""
        return HEADER_BYTES + self.body_bytes(n)

    def options(self) -> int:
        return OPT_EF if self.ef else 0

    def param(self, n: int) -> int:
        return 0

    def seed_word(self) -> int:
        return 0

    def header(self, n: int) -> bytes:
        return COMP_HEADER.pack(self.kind, self.options(), 0, self.param(n), n, self.seed_word())

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        """Compress float32 ``values`` into ``body`` (uint8, ``body_bytes(len(values))``)."""
        raise NotImplementedError

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        """Decompress ``body`` into float32 ``out`` (added to it with ``add``)."""
        raise NotImplementedError

    def spec(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.spec() + ("" if self.ef else " (no error feedback)")


def _put(out: np.ndarray, values: np.ndarray, add: bool) -> None:
    if add:
        np.add(out, values, out=out)
    else:
        np.copyto(out, values)


@dataclass(frozen=True)
class FP16(Compressor):
    """Every value as float16 (2 bytes)."""

    ef: bool = False
    kind = KIND_FP16
    name = "fp16"

    def body_bytes(self, n: int) -> int:
        return 2 * n

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        np.copyto(body.view(np.float16), values, casting="unsafe")

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        _put(out, body.view(np.float16), add)


@dataclass(frozen=True)
class BF16(Compressor):
    """Every value as bfloat16 (2 bytes), rounded to nearest-even."""

    ef: bool = False
    kind = KIND_BF16
    name = "bf16"

    def body_bytes(self, n: int) -> int:
        return 2 * n

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        P.bf16_round(values.copy(), np.empty(len(values), np.uint32), body.view(np.uint16))

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        wide = P.bf16_widen(body.view(np.uint16), np.empty(len(out), np.float32))
        _put(out, wide, add)


@dataclass(frozen=True)
class OneBit(Compressor):
    """The sign of every value, 8 to a byte (bit set: negative; 0 and NaN count as positive),
    times one scale per partition: mean |g| with ``scaling``, else 1."""

    scaling: bool = True
    kind = KIND_ONEBIT
    name = "onebit"

    def body_bytes(self, n: int) -> int:
        return 4 + (n + 7) // 8

    def options(self) -> int:
        return super().options() | (OPT_SCALING if self.scaling else 0)

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        # float32 pairwise summation: about 1e-7 relative, at a fraction of float64's cost
        n = len(values)
        scale = 1.0
        if self.scaling:
            scale = float(np.abs(values, out=_work("f32", n, np.float32)).sum() / max(1, n))
        body[:4].view(np.float32)[0] = scale
        body[4:] = np.packbits(np.less(values, 0, out=_work("bool", n, np.bool_)),
                               bitorder="little")

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        scale = body[:4].view(np.float32)[0]
        bits = np.unpackbits(body[4:], count=len(out), bitorder="little")
        # scale - 2·scale·bit, in arithmetic: a table lookup per value is several times slower
        values = out if not add else _work("f32", len(out), np.float32)
        np.multiply(bits, np.float32(-2 * scale), out=values)
        np.add(values, scale, out=values)
        if add:
            np.add(out, values, out=out)


def _check_indices(indices: np.ndarray, n: int) -> None:
    if len(indices) and int(indices.max()) >= n:
        raise P.ProtocolError(f"compressed push has an index {int(indices.max())} beyond its "
                              f"{n} values")


@dataclass(frozen=True)
class TopK(Compressor):
    """The ``k`` values of largest magnitude and their indices (ascending). Ties at the k-th
    magnitude go to the lowest indices; NaNs count as the largest."""

    ratio: float = 0.01
    kind = KIND_TOPK
    name = "topk"

    def __post_init__(self) -> None:
        _ratio(self.ratio, "topk")

    def param(self, n: int) -> int:
        return _count(self.ratio, n)

    def body_bytes(self, n: int) -> int:
        return 8 * self.param(n)

    def spec(self) -> str:
        return f"topk:{self.ratio:g}"

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        n = len(values)
        k = self.param(n)
        magnitude = np.abs(values)
        if k == n:
            chosen = np.arange(n)
        else:
            threshold = np.partition(magnitude, n - k)[n - k]
            above = np.flatnonzero(magnitude > threshold)
            ties = np.flatnonzero(magnitude == threshold)[:k - len(above)]
            chosen = np.concatenate((above, ties))
            if len(chosen) != k:            # NaNs: they sort as the largest
                chosen = np.argpartition(magnitude, n - k)[n - k:]
            chosen.sort()
        body[:4 * k].view(np.uint32)[:] = chosen
        np.take(values, chosen, out=body[4 * k:].view(np.float32))

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        k = len(body) // 8
        indices = body[:4 * k].view(np.uint32)
        if not add:
            out.fill(0)
        out[indices] += body[4 * k:].view(np.float32)


@functools.lru_cache(maxsize=256)
def _random_indices(n: int, k: int, seed: int, part: int, round_: int) -> np.ndarray:
    chosen = _rng(seed, part, round_).choice(n, k, replace=False, shuffle=False)
    chosen.sort()
    chosen.flags.writeable = False
    return chosen


@dataclass(frozen=True)
class RandomK(Compressor):
    """``k`` values at indices drawn without replacement from ``(seed, partition, round)``:
    every worker and the server draw the same ones, so only the values travel."""

    ratio: float = 0.01
    seed: int = 0
    kind = KIND_RANDOMK
    name = "randomk"

    def __post_init__(self) -> None:
        _ratio(self.ratio, "randomk")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**32:
            raise ValueError(f"randomk seed: expected an integer in 0..{2**32 - 1}, "
                             f"got {self.seed!r}")

    def param(self, n: int) -> int:
        return _count(self.ratio, n)

    def seed_word(self) -> int:
        return self.seed

    def body_bytes(self, n: int) -> int:
        return 4 * self.param(n)

    def spec(self) -> str:
        return f"randomk:{self.ratio:g}"

    def indices(self, n: int, key: Key) -> np.ndarray:
        """The indices of round ``key[2]`` of partition ``key[1]`` (the same everywhere)."""
        return _random_indices(n, self.param(n), self.seed, key[1], key[2])

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        np.take(values, self.indices(len(values), key), out=body.view(np.float32))

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        if not add:
            out.fill(0)
        out[self.indices(len(out), key)] += body.view(np.float32)


def _pack_codes(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    """``bits``-bit codes, consecutive and little-endian, into ``out`` (ceil(n·bits/8) bytes):
    8 codes make ``bits`` whole bytes, assembled in a uint64 per 8 codes."""
    groups = -(-len(codes) // 8)
    lanes = _work("pack.lanes", 8 * groups, np.uint8)
    lanes[:len(codes)] = codes
    lanes[len(codes):] = 0
    lanes = lanes.reshape(groups, 8)
    word, shifted = _work("pack.word", groups, np.uint64), _work("pack.shifted", groups, np.uint64)
    np.copyto(word, lanes[:, 0])
    for j in range(1, 8):
        np.left_shift(lanes[:, j], np.uint64(j * bits), out=shifted, dtype=np.uint64)
        np.bitwise_or(word, shifted, out=word)
    packed = _work("pack.bytes", groups * bits, np.uint8).reshape(groups, bits)
    packed[:] = word.view(np.uint8).reshape(groups, 8)[:, :bits]
    out[:] = packed.reshape(-1)[:len(out)]


def _unpack_codes(body: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The inverse of :func:`_pack_codes`: ``n`` codes of ``bits`` bits (a view of this
    thread's workspace, valid until its next call)."""
    groups = -(-n // 8)
    padded = _work("unpack.padded", groups * bits, np.uint8)
    padded[:len(body)] = body
    padded[len(body):] = 0
    raw = _work("unpack.raw", 8 * groups, np.uint8).reshape(groups, 8)
    raw[:, :bits] = padded.reshape(groups, bits)
    raw[:, bits:] = 0
    word = raw.view(np.uint64).reshape(groups)
    shifted = _work("unpack.shifted", groups, np.uint64)
    mask = np.uint64((1 << bits) - 1)
    codes = _work("unpack.codes", 8 * groups, np.uint8).reshape(groups, 8)
    for j in range(8):
        np.right_shift(word, np.uint64(j * bits), out=shifted)
        np.bitwise_and(shifted, mask, out=shifted)
        np.copyto(codes[:, j], shifted, casting="unsafe")
    return codes.reshape(-1)[:n]


@dataclass(frozen=True)
class Dithering(Compressor):
    """Stochastic quantisation: each |value| / norm rounded up or down at random (unbiased) to
    one of ``levels`` magnitudes above 0 — evenly spaced (``natural=False``) or powers of two
    down to 2^(1-levels) (``natural=True``) — sent with its sign as a ``b``-bit code, after
    the norm (max |g|, or the L2 norm with ``norm="l2"``)."""

    levels: int = 2
    natural: bool = False
    norm: str = "max"
    seed: int = 0
    kind = KIND_DITHERING
    name = "dithering"

    def __post_init__(self) -> None:
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or \
                not 1 <= self.levels <= MAX_LEVELS:
            raise ValueError(f"dithering levels: expected an integer in 1..{MAX_LEVELS}, "
                             f"got {self.levels!r}")
        if self.norm not in ("max", "l2"):
            raise ValueError(f"dithering norm: expected max or l2, got {self.norm!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**32:
            raise ValueError(f"dithering seed: expected an integer in 0..{2**32 - 1}, "
                             f"got {self.seed!r}")

    @property
    def bits(self) -> int:
        return (2 * self.levels).bit_length()       # codes 0..2·levels

    def param(self, n: int) -> int:
        return self.levels

    def seed_word(self) -> int:
        return self.seed

    def options(self) -> int:
        return (super().options() | (OPT_NATURAL if self.natural else 0)
                | (OPT_L2 if self.norm == "l2" else 0))

    def body_bytes(self, n: int) -> int:
        return 4 + (n * self.bits + 7) // 8

    def spec(self) -> str:
        return f"dithering:{self.levels}" + (":natural" if self.natural else "") + \
            (":l2" if self.norm == "l2" else "")

    def magnitudes(self) -> np.ndarray:
        """The levels' magnitudes as fractions of the norm, 0 first."""
        s = self.levels
        if self.natural:
            return np.concatenate(([0.0], 2.0 ** np.arange(1 - s, 1))).astype(np.float32)
        return (np.arange(s + 1) / s).astype(np.float32)

    def encode(self, values: np.ndarray, body: np.ndarray, key: Key) -> None:
        s, n = self.levels, len(values)
        ratio = np.abs(values, out=_work("f32", n, np.float32))
        norm = float(np.max(ratio)) if self.norm == "max" and n else \
            math.sqrt(float(np.einsum("i,i->", values, values, dtype=np.float64))) if n else 0.0
        body[:4].view(np.float32)[0] = norm
        codes = _work("dither.codes", n, np.uint8)      # the level first, then the code
        chance = _work("bool", n, np.bool_)
        if norm > 0 and math.isfinite(norm):
            np.divide(ratio, np.float32(norm), out=ratio)
            np.clip(ratio, 0, 1, out=ratio)
            mags = self.magnitudes()
            # the level at or below each ratio, then up with probability (r - low) / gap
            low = _work("dither.low", n, np.int32)
            if self.natural:        # r = m·2^e, m in [0.5, 1): level e - 1 + s, or 0
                np.frexp(ratio, out=(_work("f32.b", n, np.float32), low))
                np.add(low, s - 1, out=low)
                np.multiply(low, np.greater(ratio, 0, out=chance), out=low)
            else:
                np.copyto(low, np.multiply(ratio, s, out=_work("f32.b", n, np.float32)),
                          casting="unsafe")         # truncation: the floor of r·s >= 0
            np.clip(low, 0, s, out=low)
            gaps = np.append(np.diff(mags), np.inf).astype(np.float32)
            below = np.take(mags, low, out=_work("f32.b", n, np.float32))
            up = np.subtract(ratio, below, out=ratio)
            np.divide(up, np.take(gaps, low, out=below), out=up)
            dice = _rng(*key).random(n, dtype=np.float32, out=_work("f32.b", n, np.float32))
            np.copyto(codes, low, casting="unsafe")
            np.add(codes, np.less(dice, up, out=chance), out=codes, casting="unsafe")
        else:
            codes.fill(0)
        # the code: s + level for values >= 0, s - level for negative ones
        negative = _work("dither.negative", n, np.uint8)
        np.multiply(codes, np.less(values, 0, out=chance), out=negative, casting="unsafe")
        np.add(codes, s, out=codes, casting="unsafe")
        np.subtract(codes, negative, out=codes)
        np.subtract(codes, negative, out=codes)
        _pack_codes(codes, self.bits, body[4:])

    def decode(self, body: np.ndarray, out: np.ndarray, key: Key, add: bool = False) -> None:
        n = len(out)
        norm = body[:4].view(np.float32)[0]
        mags = self.magnitudes()
        table = (np.concatenate((-mags[:0:-1], mags)) * norm).astype(np.float32)
        codes = _unpack_codes(body[4:], self.bits, n)
        np.minimum(codes, 2 * self.levels, out=codes)       # b bits can say more than 2·levels
        if add:
            np.add(out, np.take(table, codes, out=_work("f32", n, np.float32)), out=out)
        else:
            np.take(table, codes, out=out)


# --------------------------------------------------------------------------- specs

NAMES = ("onebit", "topk", "randomk", "dithering", "fp16", "bf16")
#: the kinds that drop information and so keep error feedback (on unless switched off)
LOSSY = ("onebit", "topk", "randomk", "dithering")


def parse(spec: str, ef: bool = True) -> Compressor | None:
    """A compressor from a spec as the CLI takes it: ``onebit``, ``topk:0.01``,
    ``randomk:0.01``, ``dithering:2`` (``:natural``, ``:l2`` may follow), ``fp16``, ``bf16``
    or ``none`` (None). The lossy kinds (onebit, topk, randomk, dithering) take a ``:noef``
    modifier that switches their error feedback off (``onebit:noef``, ``topk:0.01:noef``), as
    ``ef=False`` does. Raises ValueError naming the part at fault and what is allowed."""
    name, _, rest = spec.strip().partition(":")
    args = rest.split(":") if rest else []
    if "noef" in args:
        if name not in LOSSY:
            raise ValueError(f"compression {spec!r}: noef is for the kinds with error feedback "
                             f"({', '.join(LOSSY)}); {name} has none to switch off")
        args.remove("noef")
        ef = False
    try:
        if name == "none" and not args:
            return None
        if name == "onebit" and set(args) <= {"noscale"}:
            return OneBit(ef=ef, scaling="noscale" not in args)
        if name in ("topk", "randomk") and len(args) == 1:
            ratio = float(args[0])
            return TopK(ratio=ratio, ef=ef) if name == "topk" else RandomK(ratio=ratio, ef=ef)
        if name == "dithering" and args and set(args[1:]) <= {"natural", "l2"}:
            return Dithering(levels=int(args[0]), ef=ef, natural="natural" in args[1:],
                             norm="l2" if "l2" in args[1:] else "max")
        if name in ("fp16", "bf16") and not args:
            return FP16(ef=False) if name == "fp16" else BF16(ef=False)
    except ValueError as exc:
        if "expected" in str(exc):
            raise
        raise ValueError(f"compression {spec!r}: {name} needs a number after the colon, "
                         f"such as {name}:{'2' if name == 'dithering' else '0.01'}") from None
    raise ValueError(f"compression: expected one of onebit, topk:RATIO, randomk:RATIO, "
                     f"dithering:LEVELS (each with :noef for no error feedback), fp16, bf16 "
                     f"or none, got {spec!r}")


def spec_of(compressor: Compressor | None) -> str:
    """The spec :func:`parse` turns back into ``compressor``: its kind and parameters, with
    ``:noef`` when a lossy kind runs without error feedback (``none`` for None)."""
    if compressor is None:
        return "none"
    noscale = isinstance(compressor, OneBit) and not compressor.scaling
    return compressor.spec() + (":noscale" if noscale else "") + \
        (":noef" if compressor.name in LOSSY and not compressor.ef else "")


def from_params(params: dict[str, Any]) -> Compressor:
    """A compressor from BytePS's MXNet ``compression_params``: ``compressor`` (onebit, topk,
    randomk, dithering), ``ef`` ("vanilla" or None), ``scaling`` (onebit), ``k`` (the ratio
    for topk/randomk, the levels for dithering), ``seed``, ``partition`` (linear or natural)
    and ``normalize`` (max or l2)."""
    allowed = {"compressor", "ef", "scaling", "k", "seed", "partition", "normalize"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"compression_params: unknown key(s) {unknown}; expected some of "
                         f"{sorted(allowed)}")
    name = params.get("compressor")
    ef_mode = params.get("ef")
    if ef_mode not in (None, "vanilla"):
        raise ValueError(f"compression_params ef: expected 'vanilla' or None, got {ef_mode!r}")
    ef = ef_mode == "vanilla"
    seed = params.get("seed", 0)
    if name == "onebit":
        return OneBit(ef=ef, scaling=bool(params.get("scaling", True)))
    if name in ("topk", "randomk"):
        ratio = params.get("k", 0.01)
        return TopK(ratio=ratio, ef=ef) if name == "topk" else \
            RandomK(ratio=ratio, ef=ef, seed=seed)
    if name == "dithering":
        partition = params.get("partition", "linear")
        if partition not in ("linear", "natural"):
            raise ValueError(f"compression_params partition: expected linear or natural, "
                             f"got {partition!r}")
        return Dithering(levels=params.get("k", 2), ef=ef, natural=partition == "natural",
                         norm=params.get("normalize", "max"), seed=seed)
    raise ValueError(f"compression_params compressor: expected onebit, topk, randomk or "
                     f"dithering, got {name!r}")


def from_header(header: bytes | memoryview) -> Compressor:
    """The compressor a push's header names; ProtocolError when it names none."""
    kind, options, _, param, n, seed = COMP_HEADER.unpack(header)
    ef = bool(options & OPT_EF)
    try:
        if kind == KIND_FP16:
            return FP16(ef=ef)
        if kind == KIND_BF16:
            return BF16(ef=ef)
        if kind == KIND_ONEBIT:
            return OneBit(ef=ef, scaling=bool(options & OPT_SCALING))
        if kind in (KIND_TOPK, KIND_RANDOMK):
            if not 1 <= param <= n:
                raise ValueError(f"k {param} for {n} values")
            ratio = param / n
            return TopK(ratio=ratio, ef=ef) if kind == KIND_TOPK else \
                RandomK(ratio=ratio, ef=ef, seed=seed)
        if kind == KIND_DITHERING:
            return Dithering(levels=param, ef=ef, natural=bool(options & OPT_NATURAL),
                             norm="l2" if options & OPT_L2 else "max", seed=seed)
    except ValueError as exc:
        raise P.ProtocolError(f"compressed push with a bad parameter: {exc}") from None
    raise P.ProtocolError(f"compressed push of an unknown kind {kind}")


def check_tensor(compressor: Compressor, dtype: np.dtype, name: str) -> None:
    """Compression needs float16, float32 or float64 values (bfloat16 has its own: bf16)."""
    if np.dtype(dtype).kind != "f":
        raise ValueError(f"compression: {compressor.spec()} needs a floating-point tensor "
                         f"(float16, float32 or float64), got {np.dtype(dtype)} for {name!r}; "
                         "push it without compression")


# --------------------------------------------------------------------------- stateful codecs

def _encode(compressor: Compressor, corrected: np.ndarray, residual: np.ndarray | None,
            scratch: np.ndarray, body: np.ndarray, key: Key) -> None:
    """Compress ``corrected`` (the values plus last round's residual) into ``body``; with
    error feedback, the residual becomes what the compression dropped."""
    compressor.encode(corrected, body, key)
    if residual is not None:
        compressor.decode(body, scratch, key)
        np.subtract(corrected, scratch, out=residual)


class WorkerCodec:
    """One tensor's compression on a worker: its residual (error feedback) and, per
    partition, one wire buffer (header written once) reused every round."""

    def __init__(self, compressor: Compressor, dtype: np.dtype, count: int, rank: int):
        self.compressor, self.dtype, self.rank = compressor, np.dtype(dtype), rank
        self.residual = np.zeros(count, np.float32) if compressor.ef else None
        self.wire: dict[int, np.ndarray] = {}          # part id -> header + body
        self.encoded: dict[int, int] = {}              # part id -> round in its wire buffer
        self.scratch = np.empty(0, np.float32)          # encode's, grown to a partition
        self.corrected = np.empty(0, np.float32)
        self.decoded = np.empty(0, np.float32)          # decode's (another thread may encode)
        self.handle: Any = None        # the tensor's latest push_pull (the worker's Handle)

    def wire_bytes(self, length: int) -> int:
        return self.compressor.wire_bytes(length // self.dtype.itemsize)

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.scratch) < n:
            self.scratch = np.empty(n, np.float32)
            self.corrected = np.empty(n, np.float32)
        return self.corrected[:n], self.scratch[:n]

    def encode(self, src: np.ndarray, part_id: int, offset: int, length: int,
               round_: int) -> np.ndarray:
        """The wire bytes of round ``round_`` of a partition (``src``: the tensor's bytes).
        A partition pushed again in the same round (to another server, after failover) sends
        the same bytes: its residual is not charged twice."""
        wire = self.wire.get(part_id)
        if wire is not None and self.encoded.get(part_id) == round_:
            return wire
        itemsize = self.dtype.itemsize
        start, n = offset // itemsize, length // itemsize
        if wire is None:
            wire = self.wire[part_id] = np.empty(self.compressor.wire_bytes(n), np.uint8)
            wire[:HEADER_BYTES] = np.frombuffer(self.compressor.header(n), np.uint8)
        corrected, scratch = self._scratch(n)
        values = src.view(self.dtype)[start:start + n]
        residual = None
        if self.residual is not None:
            residual = self.residual[start:start + n]
            np.add(values, residual, out=corrected, casting="unsafe")
        else:
            np.copyto(corrected, values, casting="unsafe")
        _encode(self.compressor, corrected, residual, scratch, wire[HEADER_BYTES:],
                (self.compressor.seed_word(), part_id, round_, self.rank))
        self.encoded[part_id] = round_
        return wire

    def decode(self, payload: Any, part_id: int, round_: int, dst: np.ndarray,
               divisor: int | None) -> None:
        """The server's compressed sum of a partition into ``dst`` (divided when averaging)."""
        body = np.frombuffer(payload, np.uint8)[HEADER_BYTES:]
        if len(body) != self.compressor.body_bytes(len(dst)):
            raise P.ProtocolError(f"a compressed sum of {len(body)} bytes for {len(dst)} "
                                  f"values; {self.compressor} sends "
                                  f"{self.compressor.body_bytes(len(dst))}")
        key = (self.compressor.seed_word(), part_id, round_, SERVER_STREAM)
        if dst.dtype == np.float32:         # straight into the output, divided in place
            self.compressor.decode(body, dst, key)
            if divisor is not None:
                np.divide(dst, np.float32(divisor), out=dst)
            return
        if len(self.decoded) < len(dst):
            self.decoded = np.empty(len(dst), np.float32)
        values = self.decoded[:len(dst)]
        self.compressor.decode(body, values, key)
        if divisor is None:
            np.copyto(dst, values, casting="unsafe")
        else:
            np.divide(values, divisor, out=dst, casting="unsafe")


class ServerCodec:
    """One partition's compression on a server: every push decompressed into a float32 sum,
    the sum compressed again for the pull, with the server's own residual (error feedback)
    when the workers use it. Built from the first push it sees, so a partition created
    mid-job (moved here from a lost server) starts with an empty residual."""

    def __init__(self, header: bytes, nbytes: int, rotation: int = 2):
        self.header = header
        self.compressor = from_header(header)
        _, _, _, param, n, _ = COMP_HEADER.unpack(header)
        if n > MAX_VALUES:
            raise P.ProtocolError(f"compressed push of {n} values; a server takes at most "
                                  f"{MAX_VALUES} per partition (lower BPSCTL_PARTITION_BYTES)")
        if param != self.compressor.param(n) or self.compressor.wire_bytes(n) != nbytes:
            raise P.ProtocolError(f"compressed push of {nbytes} bytes, but its header "
                                  f"({self.compressor.spec()} of {n} values) needs "
                                  f"{self.compressor.wire_bytes(n)}")
        self.count = n
        self.total = np.empty(n, np.float32)
        self.scratch = np.empty(n, np.float32) if self.compressor.ef else self.total
        self.residual = np.zeros(n, np.float32) if self.compressor.ef else None
        self.out: list[np.ndarray] = []
        for _ in range(rotation):   # rounds take turns, as the uncompressed sums do
            buffer = np.empty(nbytes, np.uint8)
            buffer[:HEADER_BYTES] = np.frombuffer(header, np.uint8)
            self.out.append(buffer)

    @staticmethod
    def open(payload: Any, nbytes: int, rotation: int = 2) -> ServerCodec:
        if nbytes < HEADER_BYTES:
            raise P.ProtocolError(f"compressed push of {nbytes} bytes, shorter than its "
                                  f"{HEADER_BYTES}-byte header")
        return ServerCodec(bytes(memoryview(payload)[:HEADER_BYTES]), nbytes, rotation)

    def check(self, payload: Any, part: int) -> None:
        """Refuse a push that is not compressed as the partition's first was, or whose
        indices point outside it (on the I/O thread, before it reaches a summation thread)."""
        raw = np.frombuffer(payload, np.uint8)
        if raw[:HEADER_BYTES].tobytes() != self.header:
            try:
                other = str(from_header(raw[:HEADER_BYTES].tobytes()))
            except P.ProtocolError as exc:
                other = f"an unknown compressor ({exc})"
            raise P.ProtocolError(f"partition {part}: a push compressed with {other}, the "
                                  f"first with {self.compressor}; every worker must compress "
                                  "a tensor alike")
        if isinstance(self.compressor, TopK):
            k = self.compressor.param(self.count)
            _check_indices(raw[HEADER_BYTES:HEADER_BYTES + 4 * k].view(np.uint32), self.count)

    def add(self, payload: Any, first: bool, part: int, round_: int) -> None:
        """Decompress one worker's push into the round's sum."""
        raw = np.frombuffer(payload, np.uint8)
        seed = self.compressor.seed_word()
        self.compressor.decode(raw[HEADER_BYTES:], self.total, (seed, part, round_, 0),
                               add=not first)

    def finish(self, part: int, round_: int) -> np.ndarray:
        """The round's sum, compressed (with error feedback) for every worker's pull."""
        wire = self.out[round_ % len(self.out)]
        if self.residual is not None:
            np.add(self.total, self.residual, out=self.total)
        _encode(self.compressor, self.total, self.residual, self.scratch, wire[HEADER_BYTES:],
                (self.compressor.seed_word(), part, round_, SERVER_STREAM))
        return wire
