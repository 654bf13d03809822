"""The SDPA backends' inputs: the kernel must read the BF16 values the emulator reads.

torch's float64 -> BF16 conversion rounds through float32 (two roundings); the emulator rounds once.
One input rounded the other way moves a whole row of S, so ``validate --backward`` on float64 draws
compared the emulator with a kernel that read other inputs (the H200's sdpa-flash small grid: F up to
0.06 on every gradient before the backend cast with the library's single rounding, <= 0.005 after).
"""

from __future__ import annotations

import math

import pytest
import torch

from fa3_numerics.engine.backends import get_backend
from fa3_numerics.numerics.formats import cast
from fa3_numerics.numerics.recipe import get_recipe


def test_torchs_float64_to_bf16_rounds_twice_and_the_library_once():
    # 1 + 2^-8 + 2^-30 lies above the midpoint of 1 and 1 + 2^-7: the nearest BF16 is 1 + 2^-7; float32
    # first drops 2^-30, leaving the exact midpoint, which ties to even (1.0)
    x = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -30], dtype=torch.float64)
    assert float(cast(x, "bf16").double()) == 1.0 + 2.0 ** -7
    assert float(x.to(torch.bfloat16).double()) == 1.0


def test_library_cast_is_the_nearest_bf16():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200_000, generator=g, dtype=torch.float64) * 3
    y = cast(x, "bf16").double()
    # independent reference: the two BF16 neighbours of each x from its float64 bits truncated to 8 mantissa bits
    bits = x.abs().view(torch.int64)
    lo = (bits & ~((1 << 45) - 1)).view(torch.float64)
    hi = (lo.view(torch.int64) + (1 << 45)).view(torch.float64)
    a = x.abs()
    even = ((lo.view(torch.int64) >> 45) & 1) == 0
    near = torch.where((a - lo < hi - a) | ((a - lo == hi - a) & even), lo, hi) * x.sign()
    assert torch.equal(y, near)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's flash kernel needs a CUDA GPU")
def test_flash_gradients_read_the_single_rounded_inputs():
    be = get_backend("sdpa-flash")
    r = get_recipe("sdpa-flash-bf16").recipe
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 256, 64, generator=g, dtype=torch.float64).cuda() * 3 for _ in range(4))
    kw = dict(causal=True, rotation_seed=0, cache={}, softmax_scale=1 / math.sqrt(64))
    a = be.gradients(r, q, k, v, do, **kw)
    b = be.gradients(r, *(cast(t, "bf16").double() for t in (q, k, v, do)), **kw)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.equal(a[name], b[name]), name
