"""The float32 P V accumulator: the fused acc + P V is the separate product and add, bit for bit."""

from __future__ import annotations

import pytest
import torch

from fa3_numerics.numerics import accumulators
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import PRESETS


@pytest.mark.parametrize("keys", [1, 64, 176, 224, 700])
def test_fp32_accumulator_gives_the_bits_of_product_then_add(keys):
    """Whatever the tile width, the result is acc.add_(P @ V)'s: the fused call where the BLAS
    agrees on a probe, else the two steps (wide tiles, where MKL adds C inside its k loop)."""
    g = torch.Generator().manual_seed(keys)
    p = torch.rand(2, 3, 96, keys, generator=g)
    v = torch.randn(2, 3, keys, 64, generator=g)
    acc = torch.randn(2, 3, 96, 64, generator=g) * 100
    want = acc.clone().add_(torch.matmul(p, v))
    got = accumulators.fp32(acc.clone(), p, v, None)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got.shape == acc.shape


def test_flash_emulation_is_the_same_with_and_without_the_fused_accumulator(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 640, 128, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 0, 5, 7] = 40.0  # an outlier: rescales between tiles matter
    rows = torch.arange(0, 640, 5)
    for name in ("fa3-fp8", "fa3-fp16", "fa2-fp16"):
        fused = emulate(PRESETS[name].recipe, q, k, v, q_index=rows)
        monkeypatch.setattr(accumulators, "_fused_add_same", lambda *a: False)
        plain = emulate(PRESETS[name].recipe, q, k, v, q_index=rows)
        monkeypatch.undo()
        assert torch.equal(fused.view(torch.int64), plain.view(torch.int64)), name
