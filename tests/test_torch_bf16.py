"""The engine's bfloat16: the server sums in float32 and rounds to nearest-even as torch does."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bpsctl.engine import protocol as P  # noqa: E402
from bpsctl.engine.server import PartitionState  # noqa: E402


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_server_sums_bfloat16_in_float32_and_rounds_like_torch(workers):
    gen = torch.Generator().manual_seed(workers)
    pushes = [(torch.randn(4099, generator=gen) * 10 ** (k % 4)).to(torch.bfloat16)
              for k in range(workers)]
    pushes[0][:3] = torch.tensor([float("inf"), float("nan"), -0.0])
    state = PartitionState(part=0, dtype_code=P.BFLOAT16_CODE, nbytes=4099 * 2, thread=-1,
                           expected=workers)
    for _round in range(2):                          # buffers are reused across rounds
        done = [state.accumulate(bits(p).tobytes(), workers) for p in pushes]
        assert done == [False] * (workers - 1) + [True]
        want = sum(p.float() for p in pushes).to(torch.bfloat16)
        result = np.array(state.result, copy=True).view(np.int16)
        got = torch.from_numpy(result).view(torch.bfloat16)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()], want[~want.isnan()])
        state.summed, state.round = 0, state.round + 1


def test_round_and_widen_match_torch_conversions():
    values = torch.randn(100_000) * 1e3
    out = np.empty(values.numel(), np.uint16)
    P.bf16_round(values.numpy().copy(), np.empty(values.numel(), np.uint32), out)
    assert np.array_equal(out, bits(values.to(torch.bfloat16)))
    wide = P.bf16_widen(out, np.empty(values.numel(), np.float32))
    assert np.array_equal(wide, values.to(torch.bfloat16).float().numpy())
