"""How long compression takes, per MiB of float32 gradient, on one core of this machine.

    python -m bpsctl.bench.codec [--size 16MiB] [--repeats 5] [--compression onebit,topk:0.01]

For each compressor (with error feedback): a worker's compress of one partition (its residual
added, the push encoded, the residual updated), a worker's decompress of the server's sum, and
the server's work per round of ``--workers`` pushes (each decompressed into the sum, the sum
compressed again with the server's residual). Medians of ``--repeats`` runs, as JSON on
stdout, with the bytes each compressor states it sends.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from ..config import parse_size
from ..engine import compression as C

DEFAULT = ("onebit", "topk:0.01", "randomk:0.01", "dithering:2", "fp16")


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for round_ in range(repeats):
        start = time.perf_counter()
        fn(round_)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(spec: str, size_bytes: int, repeats: int, workers: int) -> dict[str, Any]:
    compressor = C.parse(spec)
    if compressor is None:
        raise ValueError("compression: none has nothing to measure")
    n = size_bytes // 4
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    codec = C.WorkerCodec(compressor, np.dtype(np.float32), n, rank=0)
    wire = codec.encode(grad.view(np.uint8), 0, 0, 4 * n, 0).copy()
    server = C.ServerCodec.open(wire, len(wire))
    out = np.empty(n, np.float32)
    mib = size_bytes / 2**20

    def server_round(round_: int) -> None:
        for rank in range(workers):
            server.add(wire, rank == 0, 0, round_)
        server.finish(0, round_)

    compress_s = _median_s(lambda r: codec.encode(grad.view(np.uint8), 0, 0, 4 * n, r + 1),
                           repeats)
    server_s = _median_s(server_round, repeats)
    pulled = server.finish(0, 0).copy()
    decompress_s = _median_s(lambda r: codec.decode(pulled, 0, 0, out, None), repeats)
    return {"compression": compressor.spec(), "ef": compressor.ef, "values": n,
            "raw_bytes": 4 * n, "wire_bytes": compressor.wire_bytes(n),
            "ratio": 4 * n / compressor.wire_bytes(n),
            "compress_ms_per_MiB": 1000 * compress_s / mib,
            "decompress_ms_per_MiB": 1000 * decompress_s / mib,
            "server_ms_per_MiB": 1000 * server_s / mib, "server_pushes": workers}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bpsctl.bench.codec")
    parser.add_argument("--size", default="16MiB", help="bytes of float32 per partition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4, help="pushes per server round")
    parser.add_argument("--compression", default=",".join(DEFAULT))
    args = parser.parse_args(argv)
    try:
        size = parse_size(args.size, "--size")
        specs = [s for s in args.compression.split(",") if s]
        results = [measure(spec, size, max(1, args.repeats), max(1, args.workers))
                   for spec in specs]
    except ValueError as exc:
        print(f"python -m bpsctl.bench.codec: {exc}", file=sys.stderr)
        sys.exit(2)
    json.dump({"kind": "codec", "size_bytes": size, "repeats": args.repeats,
               "results": results}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
