"""libdevice's expf/logf models (fa3_numerics/numerics/libdevice.py) against independent references:
float64 exp/log within CUDA's documented bounds (expf 2 ulp, logf 1 ulp), exact values, the IEEE
special cases, and the structure of the algorithms (range reduction, scaling by powers of two)."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from fa3_numerics.numerics import libdevice as ld

F32 = torch.float32


def ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in float32 ulps at ref (the subnormal ulp below 2^-126)."""
    e = torch.floor(torch.log2(ref.abs())).clamp(min=-126)
    return (y.double() - ref).abs() / torch.pow(2.0, e - 23)


def test_fma32_rounds_once():
    # cases where the float64 sum's own rounding would make the float32 rounding wrong (a tie in
    # float64 that is not a tie exactly), checked against exact rational arithmetic
    g = torch.Generator().manual_seed(3)
    a = (torch.rand(200000, generator=g, dtype=torch.float64) * 2 - 1).float()
    b = (torch.rand(200000, generator=g, dtype=torch.float64) * 2 - 1).float()
    c = (torch.rand(200000, generator=g, dtype=torch.float64) * 2 - 1).float() * 2.0 ** -30
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a float32 midpoint; + 2^-60 lies above it, so the FFMA
    # rounds up, where the float64 sum drops the 2^-60 and the float32 rounding then ties to even (down)
    a_h = torch.tensor([1.0 + 2 ** -12, 1.0 + 2 ** -12], dtype=F32)
    b_h = a_h.clone()
    c_h = torch.tensor([2 ** -60, -(2 ** -60)], dtype=F32)
    a, b, c = torch.cat([a, a_h]), torch.cat([b, b_h]), torch.cat([c, c_h])
    got = ld.fma32(a, b, c)
    idx = torch.cat([torch.arange(0, 200000, 997), torch.tensor([200000, 200001])])
    for i in idx.tolist():
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert float(got[i]) == ld._rn32(exact), (i, float(a[i]), float(b[i]), float(c[i]))
    assert got[-2].item() == 1.0 + 2 ** -11 + 2 ** -23 and got[-1].item() == 1.0 + 2 ** -11
    plain = (a.double() * b.double() + c.double()).float()
    assert plain[-2].item() == 1.0 + 2 ** -11  # the double rounding the model avoids
    assert (plain != got).double().mean() < 1e-3  # elsewhere they agree (the fix changes only ties)


def test_expf_within_two_ulp_of_float64():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1_000_000, generator=g, dtype=torch.float64) * 190 - 102).float()
    ref = torch.exp(x.double())
    keep = ref < 3.4e38
    err = ulps(ld.expf(x), ref)[keep]
    assert err.max() <= 2.0, err.max()
    # not correctly rounded (an approximation: a model that rounded to nearest would be wrong)
    assert (err > 0.5).double().mean() > 0.05


def test_logf_within_one_ulp_of_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.exp(torch.rand(1_000_000, generator=g, dtype=torch.float64) * 176 - 88).float()
    x = torch.cat([x, 1.0 + (torch.rand(100000, generator=g, dtype=torch.float64) - 0.5).float() * 2 ** -10])
    ref = torch.log(x.double())
    keep = ref != 0
    err = ulps(ld.logf(x), ref)[keep]
    assert err.max() <= 1.0, err.max()


def test_exact_values_and_structure():
    one = torch.tensor([0.0, -0.0], dtype=F32)
    assert ld.expf(one).tolist() == [1.0, 1.0]
    assert ld.logf(torch.tensor([1.0], dtype=F32)).item() == 0.0
    # logf(2^k) = fma(k, float32 ln 2, 0): k ln2_f32 rounded once, for every normal power of two
    k = torch.arange(-126, 128, dtype=torch.float64)
    got = ld.logf(torch.pow(2.0, k).float())
    want = torch.tensor([ld._rn32(Fraction(int(kk)) * Fraction(ld.LN2_F32)) for kk in k.tolist()], dtype=F32)
    assert torch.equal(got, want)
    # subnormal inputs are scaled by 2^23, not flushed: logf(2^-140) = fma(-140, ln2_f32, 0)
    assert ld.logf(torch.tensor([2.0 ** -140], dtype=F32)).item() == ld._rn32(-140 * Fraction(ld.LN2_F32))
    # the range reduction: expf(x) = 2^n ex2(x log2e - n) with n = floor(x log2 e), n taken here from
    # float64 (away from the seams, where the kernel's rounded t may pick the neighbour)
    from fa3_numerics.numerics import sfu
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(200000, generator=g, dtype=torch.float64) * 170 - 85).float()
    y = x.double() / math.log(2)
    n = torch.floor(y)
    away = ((y - n) > 1e-3) & ((y - n) < 1 - 1e-3)
    f = ld.fma32(x, ld.LOG2E_LO, ld.fma32(x, ld.LOG2E_HI, (-n).float()))
    want = (sfu.ex2(f).double() * torch.pow(2.0, n)).float()
    assert away.double().mean() > 0.99 and torch.equal(ld.expf(x)[away], want[away])
    # monotone on a dense grid (the range reduction's seams included)
    xs = torch.arange(-2 ** 21, 2 ** 21, dtype=torch.float64).mul(2 ** -18).float()
    ys = ld.expf(xs)
    assert bool((ys[1:] >= ys[:-1]).all())
    ls = ld.logf(torch.linspace(0.5, 2.0, 1_000_001, dtype=torch.float64).float())
    assert bool((ls[1:] >= ls[:-1]).all())


def test_special_values():
    inf, nan = math.inf, math.nan
    e = ld.expf(torch.tensor([inf, -inf, nan, 89.0, -104.0, -87.5], dtype=F32))
    assert e[0] == inf and e[1] == 0 and math.isnan(e[2]) and e[3] == inf and e[4] == 0
    # a subnormal result, not flushed (the non-ftz build): exp(-87.5) ~ 1.0e-38 < 2^-126
    assert 0 < e[5] < 2.0 ** -126 and ulps(e[5:6], torch.exp(torch.tensor([-87.5], dtype=torch.float64))) <= 2
    lg = ld.logf(torch.tensor([0.0, -0.0, -1.0, inf, -inf, nan], dtype=F32))
    assert lg[0] == -inf and lg[1] == -inf and math.isnan(lg[2]) and lg[3] == inf
    assert math.isnan(lg[4]) and math.isnan(lg[5])


def test_constants_are_libdevices():
    # the float32 log2(e) split: hi + lo is log2(e) to ~2^-50, and 0x3FB8AA3B is RN(log2 e)
    assert struct.pack(">f", ld.LOG2E_HI) == bytes.fromhex("3FB8AA3B")
    assert abs(ld.LOG2E_HI + ld.LOG2E_LO - 1 / math.log(2)) < 2 ** -48
    assert ld.LOG2E_252 == ld._rn32(Fraction(ld.LOG2E_HI) / 252)
    assert ld.LN2_F32 == ld._rn32(Fraction(math.log(2)))
    # the polynomial is log1p's: its low coefficients are -1/2 and ~1/3
    assert ld.LOG_POLY[-1] == -0.5 and abs(ld.LOG_POLY[-2] - 1 / 3) < 1e-5


@pytest.mark.parametrize("fn", [ld.expf, ld.logf])
def test_rejects_float64(fn):
    with pytest.raises(TypeError):
        fn(torch.tensor([1.0], dtype=torch.float64))
