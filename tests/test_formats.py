"""Formats and casts against an independent implementation (ml_dtypes) and known values."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fa3_numerics.numerics.formats import FORMATS, cast, get_format, round_to_format, to_float32_round_odd

NP_TYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "fp16": np.float16,
            "bf16": ml_dtypes.bfloat16}


def all_encodings(name):
    """Every finite value of an FP8 format, from its 256 bit patterns."""
    vals = torch.arange(256, dtype=torch.uint8).view(FORMATS[name].dtype).to(torch.float64)
    return vals[torch.isfinite(vals)]


def ml_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    f = get_format(name)
    xn = x.numpy()
    if f.saturate:  # ml_dtypes' cast does not saturate; the kernel's satfinite cast does
        xn = np.clip(xn, -f.max, f.max)
    return torch.from_numpy(xn.astype(NP_TYPES[name]).astype(np.float64))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_all_encodings_are_fixed_points(name):
    v = all_encodings(name)
    assert torch.equal(round_to_format(v, name), v)
    assert torch.equal(cast(v.float(), name).double(), v)
    assert torch.equal(cast(v, name).double(), v)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "fp16", "bf16"])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 30.0, 1e4])
def test_cast_matches_ml_dtypes_on_random_float32(name, scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(200_000, generator=g) * scale).float()
    ref = ml_reference(x, name)
    assert torch.equal(cast(x, name).double(), ref)
    assert torch.equal(round_to_format(x, name).double(), ref)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "fp16"])
def test_ties_round_to_even(name):
    """Midpoints between neighbours (and values a hair either side) in float64."""
    f = get_format(name)
    if name == "fp16":
        v = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
        v = v[torch.isfinite(v)].unique()
    else:
        v = all_encodings(name).unique()
    mid = (v[1:] + v[:-1]) / 2
    for x in (mid, torch.nextafter(mid, torch.full_like(mid, math.inf)), torch.nextafter(mid, -torch.full_like(mid, math.inf))):
        ref = ml_reference(x.float(), name) if name != "fp16" else torch.from_numpy(x.numpy().astype(np.float16).astype(np.float64))
        if x is mid:
            # exact ties are representable in float32, so ml_dtypes sees the true tie
            assert torch.equal(round_to_format(x, name), ref)
        assert torch.equal(cast(x, name).double(), round_to_format(x, name))
    # an exact tie goes to the neighbour with an even mantissa
    lo, hi = v[:-1], v[1:]
    r = round_to_format(mid, name)
    picked_lo = r == lo
    lo_bits = torch.tensor(np.asarray(lo.numpy().astype(NP_TYPES[name])).view(np.uint8 if f.ebits + f.mbits < 8 else np.uint16).astype(np.int64))
    finite = torch.isfinite(r) & (r.abs() <= f.max)
    assert torch.all((lo_bits[finite] % 2 == 0) == picked_lo[finite])


@pytest.mark.parametrize("name,edge", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_fp8_casts_saturate(name, edge):
    x = torch.tensor([edge, 449.0 if name == "e4m3" else 57345.0, 1e6, -1e6, math.inf, -math.inf, 464.0, 479.9])
    y = cast(x, name).double()
    assert torch.all(torch.isfinite(y))
    assert torch.equal(y.abs()[:6], torch.full((6,), edge, dtype=torch.float64))
    # torch's plain cast does not saturate e5m2 (overflow gives inf; older torch gave NaN
    # for e4m3fn too): that is why cast() clamps first, whatever the torch version does
    if name == "e5m2":
        assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()


@pytest.mark.parametrize("case,x,expected", [
    ("smallest e4m3 subnormal", 2.0 ** -9, 2.0 ** -9),
    ("half the smallest subnormal ties to zero", 2.0 ** -10, 0.0),
    ("just above half the smallest subnormal", 2.0 ** -10 * 1.0001, 2.0 ** -9),
    ("smallest e4m3 normal", 2.0 ** -6, 2.0 ** -6),
    ("1 + 1/16 ties to 1", 1.0625, 1.0),
    ("1 + 3/16 ties to 1.25", 1.1875, 1.25),
])
def test_e4m3_named_edges(case, x, expected):
    assert round_to_format(torch.tensor([x], dtype=torch.float64), "e4m3").item() == expected, case
    assert cast(torch.tensor([x], dtype=torch.float64), "e4m3").float().item() == expected, case


def test_fp16_overflows_to_inf():
    x = torch.tensor([65504.0, 65519.0, 65520.0, -70000.0], dtype=torch.float64)
    assert round_to_format(x, "fp16").tolist() == [65504.0, 65504.0, math.inf, -math.inf]


def test_round_to_odd_gives_single_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, generator=g, dtype=torch.float64) * 100
    for name in ("e4m3", "e5m2", "bf16", "fp16"):
        assert torch.equal(cast(x, name).double(), round_to_format(x, name))
    # the intermediate is within one float32 ulp and its last bit is odd wherever inexact
    y = to_float32_round_odd(x)
    inexact = y.double() != x
    assert torch.all((y.view(torch.int32)[inexact] & 1) == 1)
    assert torch.all((y.double() - x).abs() <= x.abs() * 2.0 ** -23)
