"""Gradient compression of the torch plugin (Horovod's ``horovod.torch.compression``): casts
done by the plugin (fp16, bf16) and the engine's lossy compressors between machines."""
from __future__ import annotations

from typing import Any

import torch

from .. import compression as C


class Compressor:
    """Turns a tensor into what travels, and back (Horovod's interface)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    pass


def _cast_compressor(wire_dtype: torch.dtype) -> type[Compressor]:
    class CastCompressor(Compressor):
        """Floating-point tensors travel as ``wire_dtype``; others as they are."""

        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            if tensor.dtype.is_floating_point and tensor.dtype != wire_dtype:
                return tensor.to(wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
            return tensor if ctx is None else tensor.to(ctx)
    return CastCompressor


FP16Compressor = _cast_compressor(torch.float16)
BF16Compressor = _cast_compressor(torch.bfloat16)


class EngineCompressor(Compressor):
    """Compression done by the engine between machines (:mod:`bpsctl.engine.compression`):
    the tensor enters the engine as it is, workers compress each partition they push,
    servers decompress, sum and compress the sum again for the pull. Tensors smaller than
    ``BPSCTL_MIN_COMPRESS_BYTES`` and broadcasts travel uncompressed; the intra-node stage
    keeps full precision."""

    def __init__(self, engine: C.Compressor):
        self.engine = engine

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return tensor

    def __repr__(self) -> str:
        return f"Compression({self.engine})"


class Compression:
    """``none``, ``fp16`` (float16 on the wire), ``bf16`` (bfloat16, summed in float32), and
    the engine's compressors between machines, with error feedback (``ef``) by default:
    ``onebit(scaling=True)``, ``topk(ratio)``, ``randomk(ratio)``, ``dithering(levels)``."""

    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor] = FP16Compressor
    bf16: type[Compressor] = BF16Compressor

    @staticmethod
    def onebit(scaling: bool = True, ef: bool = True) -> EngineCompressor:
        """Signs, 8 to a byte, times mean |g| per partition (``scaling``), else ±1."""
        return EngineCompressor(C.OneBit(ef=ef, scaling=scaling))

    @staticmethod
    def topk(ratio: float, ef: bool = True) -> EngineCompressor:
        """The ``ratio`` of values of largest magnitude, with their indices."""
        return EngineCompressor(C.TopK(ratio=ratio, ef=ef))

    @staticmethod
    def randomk(ratio: float, ef: bool = True, seed: int = 0) -> EngineCompressor:
        """A ``ratio`` of values at random indices that every worker and server draw alike."""
        return EngineCompressor(C.RandomK(ratio=ratio, ef=ef, seed=seed))

    @staticmethod
    def dithering(levels: int, ef: bool = True, natural: bool = False,
                  norm: str = "max") -> EngineCompressor:
        """Stochastic rounding to ``levels`` magnitudes (linear, or powers of two with
        ``natural``) of the max or L2 ``norm``."""
        return EngineCompressor(C.Dithering(levels=levels, ef=ef, natural=natural, norm=norm))

    @staticmethod
    def from_spec(spec: str) -> CompressionArg:
        """The compression a CLI spec names (:func:`bpsctl.engine.compression.parse`, such as
        ``onebit:noef``): fp16 and bf16 as the plugin's casts (half the bytes, summed as they
        travel), the lossy kinds as the engine's, ``none`` or an empty spec as none."""
        if spec in ("fp16", "bf16"):
            return Compression.fp16 if spec == "fp16" else Compression.bf16
        engine = C.parse(spec) if spec else None
        return Compression.none if engine is None else EngineCompressor(engine)


#: what ``compression=`` takes: a class above (Horovod's interface) or an engine compressor
CompressionArg = type[Compressor] | Compressor
