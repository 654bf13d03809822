"""Formats and casts against exact references and known values.

The judge of every rounding is an exact reference written from the format's definition (a
search of the table of representable values against their exactly representable midpoints,
or Python fractions). ml_dtypes is a second, independent implementation, compared only on
the input classes where every ml_dtypes release the project admits rounds correctly: before
0.7 it took float64 through float32 (two roundings) and rounded float32 subnormals to E8M0
away from nearest, so it is no judge there.
"""

from fractions import Fraction

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


# -- Microscaling formats: E2M1 (FP4) and E8M0 against exact references ------------------------

from fa3_numerics.numerics.formats import (E2M1, E8M0_MAX_EXP, E8M0_MIN_EXP, decode_e2m1, decode_e8m0,  # noqa: E402
                                           element_format, encode_e2m1, encode_e8m0, round_to_e8m0)
from fa3_numerics.errors import UsageError  # noqa: E402

F4 = ml_dtypes.float4_e2m1fn
E8 = ml_dtypes.float8_e8m0fnu


def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def e2m1_input_classes() -> np.ndarray:
    """float32 inputs covering every class: all 16 encodings, every midpoint (ties), one float32
    ulp either side of each value and midpoint, the subnormal range down to float32's
    subnormals, saturation up to inf, signed zeros, NaNs of both signs and several payloads,
    and random values at several scales."""
    mags = np.array(sorted({float(v) for v in np.arange(16, dtype=np.uint8).view(F4).astype(np.float32)}), np.float32)
    mids = (mags[1:] + mags[:-1]) / 2
    pts = np.concatenate([mags, mids, [6.0, 6.5, 7.0, 8.0, 1e6, 3.4e38, np.finfo(np.float32).max, np.inf],
                          [0.1, 0.2, 1e-10, 1e-30, 1e-45, np.finfo(np.float32).tiny]]).astype(np.float32)
    with np.errstate(over="ignore"):
        up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(0))
    base = np.concatenate([pts, up, down])
    rng = np.random.default_rng(0)
    rand = np.concatenate([rng.standard_normal(50_000) * s for s in (0.3, 1.0, 3.0, 100.0)]).astype(np.float32)
    nans = f32_from_bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF])
    return np.concatenate([base, -base, rand, np.float32([0.0, -0.0]), nans])


def test_e2m1_is_a_format_beside_the_table_not_in_it():
    # recipes cannot name it until the emulator handles its block scales
    assert "e2m1" not in FORMATS
    with pytest.raises(UsageError):
        get_format("e2m1")
    assert element_format("e2m1") is E2M1 and element_format("fp4") is E2M1
    assert E2M1.max == 6.0 and E2M1.min_normal == 1.0 and E2M1.min_subnormal == 0.5
    assert element_format("e4m3") is FORMATS["e4m3"]


def test_e2m1_all_encodings_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    ref = torch.from_numpy(np.arange(16, dtype=np.uint8).view(F4).astype(np.float32))
    vals = decode_e2m1(codes)
    assert torch.equal(vals.view(torch.int32), ref.view(torch.int32))  # bitwise, so -0.0 too
    assert torch.equal(encode_e2m1(vals), codes)
    assert torch.equal(encode_e2m1(cast(vals, E2M1)), codes)  # every encoding is a fixed point


E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest_e2m1(x: np.ndarray) -> np.ndarray:
    """The exact E2M1 cast by its definition: the nearest of the eight magnitudes (ties to the
    even code: an even mantissa bit), saturating at 6, the sign kept (-0.0 for negatives that
    round to zero). Float64 comparisons with the midpoints are exact, as are the midpoints."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    mids = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
    i = np.searchsorted(mids, a, side="left")  # mids[i-1] < a <= mids[i]
    tie = (i < len(mids)) & (a == mids[np.minimum(i, len(mids) - 1)])
    i = np.where(tie & (i % 2 == 1), i + 1, i)  # odd codes are 0.5, 1.5, 3, 6: a tie leaves them
    return np.copysign(E2M1_VALUES[np.minimum(i, 7)], x)


def test_nearest_e2m1_reference_against_fractions():
    """The judge itself, checked on named points against Python's exact rationals."""
    pts = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.9, 5.5, 6.0, 7.0, 1e30, math.nextafter(0.25, 1)]
    for v in pts:
        d = [abs(Fraction(v) - Fraction(c)) for c in E2M1_VALUES]
        best = min(d)
        cands = [c for c, dd in zip(E2M1_VALUES, d) if dd == best]
        want = cands[0] if len(cands) == 1 else [c for c in cands if list(E2M1_VALUES).index(c) % 2 == 0][0]
        assert nearest_e2m1(np.array([v]))[0] == min(want, 6.0), v


def test_e2m1_cast_is_exact_on_every_input_class():
    x = e2m1_input_classes()
    finite = ~np.isnan(x)
    want = nearest_e2m1(np.where(finite, x, 0.0))
    t = torch.from_numpy(x)
    for got in (cast(t, E2M1), round_to_format(t, E2M1), cast(t.double(), E2M1)):
        assert got.dtype in (torch.float32, torch.float64)
        g = got.double().numpy()
        assert np.array_equal(g[finite], want[finite])
        assert np.array_equal(np.signbit(g[finite]), np.signbit(want[finite]))  # -0.0 kept
        # NaN: a zero with the NaN's sign bit inverted, the convention of the module's docstring
        assert np.all(g[~finite] == 0) and np.array_equal(np.signbit(g[~finite]), ~np.signbit(x[~finite]))


def test_e2m1_cast_agrees_with_ml_dtypes_on_float32():
    """Float32 inputs, the class on which every admitted ml_dtypes rounds once."""
    x = e2m1_input_classes()
    with np.errstate(invalid="ignore"):
        ref_codes = torch.from_numpy(x.astype(F4).view(np.uint8).copy())
    finite = torch.from_numpy(~np.isnan(x))
    got = encode_e2m1(cast(torch.from_numpy(x), E2M1))
    assert torch.equal(got[finite], ref_codes[finite])


@pytest.mark.parametrize("case,x,expected", [
    ("0.25 ties to even 0", 0.25, 0.0),
    ("0.75 ties to even 1", 0.75, 1.0),
    ("1.25 ties to even 1", 1.25, 1.0),
    ("1.75 ties to even 2", 1.75, 2.0),
    ("2.5 ties to even 2", 2.5, 2.0),
    ("3.5 ties to even 4", 3.5, 4.0),
    ("5 ties to even 4", 5.0, 4.0),
    ("just above 5 rounds to 6", 5.0000005, 6.0),
    ("saturates above 6", 7.0, 6.0),
    ("+inf saturates", math.inf, 6.0),
    ("-inf saturates", -math.inf, -6.0),
])
def test_e2m1_named_edges(case, x, expected):
    assert cast(torch.tensor([x], dtype=torch.float32), E2M1).item() == expected, case


def test_e2m1_float64_inputs_round_once():
    """A float64 a hair off a tie rounds by its own value, not through float32 (where it would
    become the tie and go to even)."""
    x = torch.tensor([math.nextafter(0.25, 1), math.nextafter(5.0, 9), math.nextafter(0.75, 0)], dtype=torch.float64)
    assert cast(x, E2M1).tolist() == [0.5, 6.0, 0.5]
    g = torch.Generator().manual_seed(3)
    r = torch.randn(100_000, generator=g, dtype=torch.float64) * 3
    assert np.array_equal(cast(r, E2M1).double().numpy(), nearest_e2m1(r.numpy()))
    assert torch.equal(cast(r, E2M1).double(), round_to_format(r, E2M1))


def test_e8m0_all_codes_decode_as_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(codes.view(E8).astype(np.float32))
    got = decode_e8m0(torch.from_numpy(codes))
    assert torch.equal(got.view(torch.int32)[:255], ref.view(torch.int32)[:255])  # exact powers, 2^-127 included
    assert torch.isnan(got[255]) and torch.isnan(ref[255])
    assert torch.equal(encode_e8m0(got), torch.from_numpy(codes))


def e8m0_input_classes() -> np.ndarray:
    """float32 inputs: every power of two, every tie 1.5 * 2^k, one ulp either side of each,
    every float32 subnormal (2^23 - 1 of them), overflow, zeros, negatives, inf, NaNs, and
    random bit patterns over the whole positive range."""
    k = np.arange(-149, 128, dtype=np.float64)
    pts = np.concatenate([2.0 ** k, 1.5 * 2.0 ** k[k <= 126], 1.25 * 2.0 ** k[k <= 126], 1.75 * 2.0 ** k[k <= 126]])
    pts = pts[pts <= np.finfo(np.float32).max].astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    subnormals = np.arange(1, 2 ** 23, dtype=np.uint32).view(np.float32)
    rng = np.random.default_rng(1)
    rand = rng.integers(1, 0x7F800000, 500_000, dtype=np.uint32).view(np.float32)
    special = np.concatenate([np.float32([0.0, -0.0, -1.0, -2.0 ** -130, np.inf, -np.inf, np.finfo(np.float32).max]),
                              f32_from_bits([0x7FC00000, 0xFFC00000, 0x7F800001])])
    return np.concatenate([pts, subnormals, rand, special])


E8M0_VALUES = np.ldexp(1.0, np.arange(E8M0_MIN_EXP, E8M0_MAX_EXP + 1))  # the 255 values, exact


def nearest_e8m0(x: np.ndarray) -> np.ndarray:
    """Round to nearest E8M0 by its definition: search the 255 powers of two against the
    midpoints between neighbours (1.5 * 2^k, exact in float64), a tie going up; below the
    first midpoint is 2^-127 (no zero), from 1.5 * 2^127 on and for inf, NaN, 0 and negative
    inputs NaN."""
    with np.errstate(invalid="ignore"):  # signalling NaN payloads widen with a warning
        x = np.asarray(x, np.float64)
    mids = np.append(1.5 * E8M0_VALUES[:-1], 1.5 * E8M0_VALUES[-1])  # the last one is the overflow edge
    i = np.searchsorted(mids, x, side="right")  # mids[i-1] <= x < mids[i]
    with np.errstate(invalid="ignore"):
        ok = (x > 0) & np.isfinite(x) & (i < len(E8M0_VALUES))
    return np.where(ok, E8M0_VALUES[np.minimum(i, len(E8M0_VALUES) - 1)], np.nan)


def test_nearest_e8m0_reference_against_fractions():
    bits = [0x00400000, 0x00400001, 0x00500000, 0x005FFFFF, 0x00600000, 0x00600001, 0x007FFFFF, 0x00000001]
    pts = list(f32_from_bits(bits).astype(np.float64)) + [1.5, 3.0, 1.4999999, 2.0 ** -140, 1.49 * 2.0 ** 127,
                                                         math.nextafter(1.5, 1), math.nextafter(0.75, 1)]
    for v in pts:
        f = Fraction(v)
        d = [abs(f - Fraction(c)) for c in E8M0_VALUES.tolist()]
        best = min(d)
        want = max(c for c, dd in zip(E8M0_VALUES.tolist(), d) if dd == best)  # a tie goes up
        assert nearest_e8m0(np.array([v]))[0] == want, v


def test_e8m0_rn_is_round_to_nearest_on_every_input_class():
    x = e8m0_input_classes()
    want = nearest_e8m0(x)
    got = round_to_e8m0(torch.from_numpy(x), "rn").double().numpy()
    assert np.array_equal(got, want, equal_nan=True)
    # float64 inputs round once, by their own value
    g = torch.Generator().manual_seed(2)
    r = torch.exp2(torch.rand(100_000, generator=g, dtype=torch.float64) * 300 - 150)
    r = torch.cat([r, torch.tensor([math.nextafter(1.5, 1), math.nextafter(1.5 * 2.0 ** -127, 0)], dtype=torch.float64)])
    assert np.array_equal(round_to_e8m0(r, "rn").double().numpy(), nearest_e8m0(r.numpy()), equal_nan=True)


def test_e8m0_rn_agrees_with_ml_dtypes_on_normal_float32():
    """Normal float32 inputs that are not ties: the class on which every admitted ml_dtypes
    rounds to nearest alike (0.5 sends a tie 1.5 * 2^k to the even code, 0.6 and 0.7 up, as
    here; the exact reference above judges the ties)."""
    x = e8m0_input_classes()
    tie = (x.view(np.uint32) & 0x7FFFFF) == 0x400000
    x = x[((np.abs(x) >= np.finfo(np.float32).tiny) | ~np.isfinite(x)) & ~tie]
    with np.errstate(invalid="ignore", over="ignore"):
        ref = torch.from_numpy(x.astype(E8).view(np.uint8).copy())
    assert torch.equal(encode_e8m0(round_to_e8m0(torch.from_numpy(x), "rn")), ref)


@pytest.mark.parametrize("case,x,expected", [
    ("1.5 ties up", 1.5, 2.0),
    ("3 ties up", 3.0, 4.0),
    ("just below 1.5 rounds down", 1.4999999, 1.0),
    ("2^127 is the largest", 2.0 ** 127, 2.0 ** 127),
    ("1.5 * 2^127 overflows to NaN", 1.5 * 2.0 ** 127, math.nan),
    ("below 2^-127 gives 2^-127 (no zero)", 2.0 ** -140, 2.0 ** -127),
    ("float32 subnormal 1.25 * 2^-127 is nearer 2^-127", 1.25 * 2.0 ** -127, 2.0 ** -127),
    ("float32 subnormal 1.5 * 2^-127 ties up to 2^-126", 1.5 * 2.0 ** -127, 2.0 ** -126),
    ("float32 subnormal 1.75 * 2^-127 gives 2^-126", 1.75 * 2.0 ** -127, 2.0 ** -126),
    ("zero is NaN", 0.0, math.nan),
    ("negative is NaN", -4.0, math.nan),
])
def test_e8m0_rn_named_edges(case, x, expected):
    got = round_to_e8m0(torch.tensor([x], dtype=torch.float32), "rn").item()
    assert (math.isnan(got) and math.isnan(expected)) or got == expected, case


def test_e8m0_rz_rp_are_floor_and_ceil_of_log2_saturating():
    g = torch.Generator().manual_seed(4)
    x = torch.exp2(torch.rand(20_000, generator=g, dtype=torch.float64) * 250 - 125)
    x = torch.cat([x, torch.exp2(torch.arange(-127, 128, dtype=torch.float64))])
    fl = [math.frexp(v)[1] - 1 for v in x.tolist()]  # floor(log2 v), from Python's exact frexp
    ce = [f if math.frexp(v)[0] == 0.5 else f + 1 for f, v in zip(fl, x.tolist())]
    rz, rp = round_to_e8m0(x, "rz").double(), round_to_e8m0(x, "rp").double()
    assert rz.tolist() == [2.0 ** min(max(f, E8M0_MIN_EXP), E8M0_MAX_EXP) for f in fl]
    assert rp.tolist() == [2.0 ** min(max(c, E8M0_MIN_EXP), E8M0_MAX_EXP) for c in ce]
    edge = torch.tensor([2.0 ** -140, 2.0 ** 130, math.inf, 0.0, -1.0, math.nan], dtype=torch.float64)
    for mode in ("rz", "rp"):
        v = round_to_e8m0(edge, mode)
        assert v[:3].tolist() == [2.0 ** -127, 2.0 ** 127, 2.0 ** 127]  # satfinite
        assert torch.isnan(v[3:]).all()
    with pytest.raises(ValueError):
        round_to_e8m0(edge, "rne")
