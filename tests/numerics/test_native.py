"""The compiled fast paths (fa3_numerics/numerics/native.py) against their PyTorch references.

Every fast path must compute what its reference computes, bit for bit: the emulator's results
may not depend on whether a C compiler was present. The references are the PyTorch code paths
that run when ``FA3N_NATIVE=0`` (and always on CUDA)."""

import math
import os
import warnings

import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.numerics import native
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.formats import get_format, quantize_dequantize, round_to_format
from fa3_numerics.numerics.mma import hopper_fp8_mma_reference
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.rotation import fwht, make_rotation, random_signs

pytestmark = pytest.mark.skipif(native._lib() is None, reason=f"compiled paths unavailable: {native.status()}")


@pytest.fixture
def torch_only(monkeypatch):
    """Run a block with the compiled paths switched off (the PyTorch references)."""
    def run(fn):
        monkeypatch.setenv("FA3N_NATIVE", "0")
        saved = dict(native._STATE)
        native._STATE.clear()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn()
        finally:
            native._STATE.clear()
            native._STATE.update(saved)
            monkeypatch.delenv("FA3N_NATIVE")
    return run


def _fp8(shape, gen, scale=1.0, fmt="e4m3", zeros=0.1):
    x = torch.randn(shape, generator=gen) * scale * torch.exp(torch.randn(shape, generator=gen) * 2)
    x[torch.rand(shape, generator=gen) < zeros] = 0
    return quantize_dequantize(x, fmt)


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2")])
def test_mma_matches_reference(fmts):
    g = torch.Generator().manual_seed(0)
    fa, fb = (get_format(f) for f in fmts)
    a = _fp8((3, 37, 70), g, 10, fa.name)
    b = _fp8((3, 70, 29), g, 0.1, fb.name)
    # accumulators across the whole float32 range: large, tiny normal, subnormal and zero
    c = torch.randn(3, 37, 29, generator=g) * torch.exp2(torch.randint(-150, 10, (3, 37, 29), generator=g).float())
    c[torch.rand(3, 37, 29, generator=g) < 0.2] = 0
    fast = native.mma(torch.device("cpu"))
    for cc in (None, c):
        ref = hopper_fp8_mma_reference(a, b, cc, a_min_exp=fa.emin, b_min_exp=fb.emin)
        got = fast(a, b, cc, a_min_exp=fa.emin, b_min_exp=fb.emin)
        assert torch.isfinite(ref).all()
        assert torch.equal(got, ref)


def test_mma_broadcasts_lead_dims_like_reference():
    g = torch.Generator().manual_seed(1)
    a = _fp8((2, 4, 5, 64), g)
    b = _fp8((2, 1, 64, 6), g)  # one KV head shared by four query heads
    fast = native.mma(torch.device("cpu"))
    assert torch.equal(fast(a, b, None, a_min_exp=-6, b_min_exp=-6), hopper_fp8_mma_reference(a, b))


# -- the compiled MMA model, bit for bit (the float form of _native.c) -----------------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 encodings: equal bits means equal values, the same sign of zero, the same NaN."""
    return x.contiguous().view(torch.int32)


def _mma_runs(a, b, c, ea, eb):
    """Every way the compiled model can run here: its AVX2 step (where the CPU has one) and its
    plain C step (what a CPU without AVX2 runs), with one thread, and with two (per-l work for
    L >= 4, the shared-B split otherwise). None where it declined the operands."""
    fast = native.mma(torch.device("cpu"))
    out = {}
    saved = torch.get_num_threads()
    try:
        for portable in (False, True):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out[(portable, threads)] = fast(a, b, c, a_min_exp=ea, b_min_exp=eb, portable=portable)
    finally:
        torch.set_num_threads(saved)
    return out


def _outliers_fp8(shape, g, fmt, scale, p=0.02, sigma=30.0):
    """N(0, 1) + N(0, sigma^2) Bernoulli(p) times ``scale`` in ``fmt`` (saturated at its max, so
    that e5m2 gives no inf), with zeros, negative zeros and whole k-steps of zeros."""
    f = get_format(fmt)
    x = (torch.randn(shape, generator=g) + torch.randn(shape, generator=g) * sigma
         * (torch.rand(shape, generator=g) < p)) * scale
    x = x.clamp(-f.max, f.max).to(f.dtype).float()
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    x[torch.rand(shape, generator=g) < 0.05] = -0.0
    return x


@pytest.mark.parametrize("fa,fb,L", [("e4m3", "e4m3", 5), ("e4m3", "e4m3", 1), ("e5m2", "e5m2", 5),
                                     ("e4m3", "e5m2", 2)])
def test_mma_outliers_bit_identical_on_every_path(fa, fb, L):
    """Operands with outliers (p 0.02, sigma 30) in every magnitude the formats hold, subnormals
    and saturated values included; K = 200 (six k-steps and a partial one), M = 37 and N = 70 (no
    whole tiles), B also as a transposed view (the emulator's K^T), steps whose products are all
    zero, accumulators from 3e38 down to float32 subnormals and signed zeros. Every path of the
    compiled model gives the reference's bits."""
    g = torch.Generator().manual_seed(20)
    ea, eb = get_format(fa).emin, get_format(fb).emin
    m, k, n = 37, 200, 70
    a = _outliers_fp8((L, m, k), g, fa, 4.0)
    bt = _outliers_fp8((L, n, k), g, fb, 0.05)
    a[:, 3, 32:64] = 0.0  # a row whose second k-step has no product
    bt[:, 5, 64:96] = -0.0  # a column whose third one has none
    c = torch.randn(L, m, n, generator=g) * torch.exp2(torch.randint(-160, 127, (L, m, n), generator=g).float())
    c[torch.rand(L, m, n, generator=g) < 0.1] = 0.0
    c[torch.rand(L, m, n, generator=g) < 0.1] = -0.0
    c[:, 3, :4] = torch.tensor([2.0 ** -149, -1.2345 * 2.0 ** -110, 3e38, -0.0])
    b_views = {"contiguous": bt.transpose(-1, -2).contiguous(), "transposed view": bt.transpose(-1, -2)}
    for cc in (None, c):
        ref = hopper_fp8_mma_reference(a, b_views["contiguous"], cc, a_min_exp=ea, b_min_exp=eb)
        assert torch.isfinite(ref).all()
        for view, b in b_views.items():
            for how, got in _mma_runs(a, b, cc, ea, eb).items():
                assert got is not None, (view, how)
                assert torch.equal(_bits(got), _bits(ref)), (view, how, int((got != ref).sum()))


def test_mma_outliers_tell_wrong_models_apart():
    """Negative control for the test above: on the same kind of data a k-step of 16, 12-bit
    terms, a 15-bit step sum or a float32 sum each move many outputs, so matching the reference
    bit for bit there is not something a wrong model could do by chance."""
    from fa3_numerics.numerics.mma import MmaModel

    g = torch.Generator().manual_seed(20)
    a = _outliers_fp8((5, 37, 200), g, "e4m3", 4.0)
    b = _outliers_fp8((5, 200, 70), g, "e4m3", 0.05)
    got = native.mma(torch.device("cpu"))(a, b, None, a_min_exp=-6, b_min_exp=-6)
    for model in (MmaModel(16, 13, 13), MmaModel(32, 12, 13), MmaModel(32, 13, 14)):
        other = hopper_fp8_mma_reference(a, b, a_min_exp=-6, b_min_exp=-6, model=model)
        assert int((other != got).sum()) > 500, model
    assert int((torch.matmul(a, b) != got).sum()) > 5000


@pytest.mark.parametrize("portable", [False, True])
def test_mma_accumulator_edge_cases(portable):
    """Hand-made steps. Row 0: every step without a product, so D is C cut to 14 significant
    bits, from C's bits where C is below 2^-100 (subnormal, tiny normal), a +0 for C = -0 (as the
    reference), C itself where it has 14 bits or fewer. Row 1: one product 1 x 1 in the second
    step beside the same C's: a C far below it is cut away, 3e38 cuts the product away. Columns
    beyond 32 run the vector path too (one whole tile and a partial one)."""
    cs = [2.0 ** -149, -3 * 2.0 ** -140, (1 + 2.0 ** -20) * 2.0 ** -126, 1.2345 * 2.0 ** -110, -1.2345 * 2.0 ** -101,
          1.2345 * 2.0 ** -100, -0.0, 0.0, 3e38, -3e38, 1.0 + 2.0 ** -13, -(2.0 ** -13)]
    n = 40
    c = torch.tensor(cs + [0.5] * (n - len(cs)), dtype=torch.float32).expand(2, n).clone()
    a, b = torch.zeros(2, 64), torch.zeros(64, n)
    a[1, 40], b[40, :] = 1.0, 1.0
    fast = native.mma(torch.device("cpu"))
    got = fast(a, b, c, a_min_exp=-6, b_min_exp=-6, portable=portable)
    ref = hopper_fp8_mma_reference(a, b, c)
    assert torch.equal(_bits(got), _bits(ref))
    want0 = [2.0 ** -149, -3 * 2.0 ** -140, 2.0 ** -126, math.trunc(1.2345 * 2.0 ** 13) * 2.0 ** -123,
             -math.trunc(1.2345 * 2.0 ** 13) * 2.0 ** -114, math.trunc(1.2345 * 2.0 ** 13) * 2.0 ** -113, 0.0, 0.0,
             math.trunc(3e38 * 2.0 ** -114) * 2.0 ** 114, -math.trunc(3e38 * 2.0 ** -114) * 2.0 ** 114,
             1.0 + 2.0 ** -13, -(2.0 ** -13)]
    assert got[0, :len(cs)].tolist() == [float(torch.tensor(w, dtype=torch.float32)) for w in want0]
    assert not torch.signbit(got[0, 6:8]).any()  # -0 without a product: +0, as the reference
    assert got[1, :6].tolist() == [1.0] * 6 and got[1, 8].item() == got[0, 8].item()
    # K = 0: C is the result, -0 included
    d = fast(torch.zeros(2, 0), torch.zeros(0, n), c, a_min_exp=-6, b_min_exp=-6, portable=portable)
    assert torch.equal(_bits(d), _bits(c))


def test_mma_declines_what_its_float_form_cannot_hold():
    """Operands outside the float form's exact range (more than 12 significant bits, exponents
    beyond [-38, 31] or a clamp below -30, float64 values float32 cannot hold) and non-finite
    values: the compiled model returns None, and ``hopper_fp8_mma`` then gives the reference's
    bits (NaN and inf where the reference has them). FP8 values are inside: computed."""
    from fa3_numerics.numerics.mma import hopper_fp8_mma

    g = torch.Generator().manual_seed(21)
    a, b = _fp8((3, 40), g), _fp8((40, 33), g)
    fast = native.mma(torch.device("cpu"))
    assert fast(a, b, None, a_min_exp=-6, b_min_exp=-6) is not None
    assert fast(a.double(), b, None, a_min_exp=-6, b_min_exp=-6) is not None  # float32-exact float64
    cases = {"13 bits": (0, 1, 1.0 + 2.0 ** -12), "2^40": (0, 1, 2.0 ** 40), "2^-40": (1, 2, 2.0 ** -40),
             "inf": (2, 3, float("inf")), "nan": (0, 0, float("nan"))}
    for name, (i, j, x) in cases.items():
        a2, b2 = a.clone(), b.clone()
        a2[i, j], b2[j + 5, i + 20] = x, x
        for portable in (False, True):  # the AVX2 and the plain split of the operands
            assert fast(a2, b, None, a_min_exp=-6, b_min_exp=-6, portable=portable) is None, name
            assert fast(a, b2, None, a_min_exp=-6, b_min_exp=-6, portable=portable) is None, name
        for aa, bb, cc in ((a2, b, None), (a2, b, torch.ones(3, 33)), (a, b2, None)):
            assert torch.equal(_bits(hopper_fp8_mma(aa, bb, cc)), _bits(hopper_fp8_mma_reference(aa, bb, cc))), name
    a64 = a.double()
    a64[0, 0] = 1.0 + 2.0 ** -40
    assert fast(a64, b, None, a_min_exp=-6, b_min_exp=-6) is None
    assert fast(a, b, None, a_min_exp=-31, b_min_exp=-6) is None
    c = torch.zeros(3, 33)
    c[1, 1] = float("nan")
    assert fast(a, b, c, a_min_exp=-6, b_min_exp=-6) is None
    assert torch.equal(_bits(hopper_fp8_mma(a, b, c)), _bits(hopper_fp8_mma_reference(a, b, c)))



@pytest.mark.parametrize("model_name, mins", [("FP8_MMA", (-6, -6)), ("FP8_MMA", (-14, -6)), ("BF16_MMA", (-126, -126))])
def test_mma_general_operands_match_reference(model_name, mins):
    """The double-precision compiled model (operands of any precision: FP8 V times a per-token descale,
    the decode pass's PV product) against the PyTorch reference, bit for bit (float32 bits, so the
    sign of a zero counts): zeros, negative zeros, tiny and subnormal values, an accumulator of zeros
    and of tiny values, partial k-steps, broadcast lead dimensions. The float form declines these
    operands (the case this path exists for)."""
    from fa3_numerics.numerics import mma

    model = getattr(mma, model_name)
    gen = native.mma_general(torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        m, k, n = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (24, 90, 24))
        a = torch.randn(3, m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (3, m, k), generator=g).float())
        b = torch.randn(1 if trial % 4 == 3 else 3, k, n, generator=g) * torch.exp2(
            torch.randint(-20, 20, (1, k, n), generator=g).float())
        a[torch.rand(a.shape, generator=g) < 0.2] = 0
        b[torch.rand(b.shape, generator=g) < 0.2] = 0
        a[torch.rand(a.shape, generator=g) < 0.05] *= -0.0
        if trial % 3 == 0:
            a = a * 1e-38  # float32 subnormals and products far below the accumulator
        c = None if trial % 2 else torch.randn(3, m, n, generator=g) * (1e-30 if trial % 4 == 1 else 1.0)
        if c is not None:
            c[0, 0] = 0.0
        ref = hopper_fp8_mma_reference(a, b, c, a_min_exp=mins[0], b_min_exp=mins[1], model=model)
        got = gen(a, b, c, a_min_exp=mins[0], b_min_exp=mins[1], model=model)
        assert torch.equal(ref.view(torch.int32), got.view(torch.int32)), trial
    # rows of zeros and of negative zeros (a causal P row before its keys) with zero, -0 and non-zero C
    z = torch.randn(2, 30, 70, generator=g)
    z[:, ::2] = 0.0
    z[:, 1::4] = -0.0
    w = torch.randn(2, 70, 20, generator=g) * 3
    cz = torch.randn(2, 30, 20, generator=g)
    cz[:, ::3] = 0.0
    cz[:, 1::6] = -0.0
    for cc in (None, cz):
        ref = hopper_fp8_mma_reference(z, w, cc, a_min_exp=mins[0], b_min_exp=mins[1], model=model)
        got = gen(z, w, cc, a_min_exp=mins[0], b_min_exp=mins[1], model=model)
        assert torch.equal(ref.view(torch.int32), got.view(torch.int32))
    assert native.mma(torch.device("cpu"))(a, b, c, a_min_exp=-6, b_min_exp=-6) is None
    a[0, 0, 0] = math.inf
    assert gen(a, b, c, a_min_exp=mins[0], b_min_exp=mins[1], model=model) is None  # the reference takes it


def test_per_token_decode_uses_the_compiled_model_same_numbers(torch_only):
    """A per-token FP8 KV-cache decode (V times its per-token descale into the FP8 tensor-core model)
    computes the same bits with the compiled path as with the PyTorch reference."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 200, 64, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    r = Recipe.from_str("fa3-fp8-kernel,gran=token")  # the decode pass of impact's --decode token
    fast = emulate(r, q, k, v, causal=True, softmax_scale=0.125)
    ref = torch_only(lambda: emulate(r, q, k, v, causal=True, softmax_scale=0.125))
    assert torch.equal(fast.view(torch.int64), ref.view(torch.int64))


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "fp16", "bf16"])
def test_casts_match_reference_rounding(name):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200_000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-40, 40, (200_000,), generator=g).double())
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e300], dtype=torch.float64)
    f = get_format(name)
    ref64 = round_to_format(x, f)
    got64 = native.round_f64(x, f).double()
    assert torch.equal(torch.nan_to_num(got64, nan=7.0), torch.nan_to_num(ref64, nan=7.0))
    # the sign of zero survives (-0.0 is a distinct encoding)
    assert torch.equal(torch.signbit(got64[3:5]), torch.tensor([False, True]))
    x32 = x.float()
    ref32 = round_to_format(x32.double(), f)
    got32 = native.round_f32(x32, f).double()
    assert torch.equal(torch.nan_to_num(got32, nan=7.0), torch.nan_to_num(ref32, nan=7.0))


@pytest.mark.parametrize("gran", ["tensor", "head", "block", "token"])
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("slice_elems", [1 << 22, 1000])
def test_fp8_quantize_matches_reference(torch_only, monkeypatch, gran, name, slice_elems):
    """The fused amax and scaled cast (row_absmax, scaled_round_f64) give quantize's codes and
    descales bit for bit, outliers, zeros, subnormal-range values and a saturating row included,
    in one slice of rows and in many (with a short last one)."""
    from fa3_numerics.numerics.granularity import parse_granularity
    from fa3_numerics.numerics.quant import quantize

    monkeypatch.setattr(native, "_ROUND_SLICE", slice_elems)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 300, 64, generator=g, dtype=torch.float64)
    x.view(-1)[torch.randint(0, x.numel(), (500,), generator=g)] *= 40.0
    x[0, 0, 5] = 0.0
    x[1, 2, 7] *= 1e-12
    x[1, 1, 299, 3] = -0.0
    descale = torch.full((1, 1, 1, 1), 1e-3)  # a static descale: most values saturate
    for kw in ({}, {"descale": descale}, {"rows": torch.tensor([3, 0, 299, 150])}):
        if "descale" in kw and gran != "tensor":
            continue
        fast = quantize(x, name, parse_granularity(gran), block_rows=128, **kw)
        ref = torch_only(lambda: quantize(x, name, parse_granularity(gran), block_rows=128, **kw))
        assert torch.equal(fast.descale.view(torch.int32), ref.descale.view(torch.int32))
        assert torch.equal(fast.values.view(torch.uint8), ref.values.view(torch.uint8))
    # negative control: another descale gives other codes
    other = quantize(x, name, parse_granularity("tensor"), descale=descale * 2)
    assert not torch.equal(other.values.view(torch.uint8),
                           quantize(x, name, parse_granularity("tensor"), descale=descale).values.view(torch.uint8))


def test_row_absmax_propagates_nan_as_the_norm():
    x = torch.randn(7, 33, dtype=torch.float64)
    x[2, 5] = float("nan")
    x[4, 0] = -float("inf")
    x[6] = -0.0
    got = native.row_absmax(x)
    ref = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1)
    assert torch.equal(torch.nan_to_num(got, nan=-1.0), torch.nan_to_num(ref, nan=-1.0))
    assert got[2].isnan() and got[4] == math.inf and not got[6].signbit()


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "fp16", "bf16"])
def test_float32_casts_on_random_bit_patterns(name):
    """round_f32 (float32 arithmetic for e4m3/e5m2/fp16, double for bf16) against the reference
    rounding on 2^20 random float32 bit patterns (every exponent, subnormals, NaN and inf
    payloads) and on every midpoint between neighbouring values of the format near 1 and at the
    top of its range (the ties)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-2 ** 31, 2 ** 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    f = get_format(name)
    grid = round_to_format(torch.linspace(0.5, 2.0, 4000, dtype=torch.float64), f).unique()
    top = round_to_format(torch.linspace(f.max / 4, f.max, 4000, dtype=torch.float64), f).unique()
    ties = torch.cat([(grid[1:] + grid[:-1]) / 2, (top[1:] + top[:-1]) / 2, top[-1:] * 1.0625]).float()
    x = torch.cat([x, ties, -ties, torch.tensor([f.max, -f.max, 2.0 ** -149, 2.0 ** -126], dtype=torch.float32)])
    got = native.round_f32(x, f).double()
    ref = round_to_format(x.double(), f)
    assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(ref, nan=7.0))
    assert torch.equal(torch.signbit(got), torch.signbit(ref))


@pytest.mark.parametrize("edges", ["hist", "dense"])
def test_abs_stats_bins_match_bucketize_at_and_beside_every_edge(edges):
    """abs_stats' table binning against torch.bucketize: every edge, its float64 neighbours on both
    sides, random values over 40 decades, zeros, subnormals, huge values; the input histogram's
    log-spaced edges (at most one edge per table range) and edges 1e-9 apart (the search path)."""
    from fa3_numerics.engine.inputs import HIST_EDGES

    e = torch.as_tensor(HIST_EDGES, dtype=torch.float64)
    if edges == "dense":
        e = torch.cat([torch.zeros(1, dtype=torch.float64), 1.0 + torch.arange(40, dtype=torch.float64) * 1e-9,
                       torch.tensor([3.0, 1e300], dtype=torch.float64)])
    g = torch.Generator().manual_seed(8)
    pos = e[1:]
    x = torch.cat([pos, torch.nextafter(pos, torch.zeros_like(pos)), torch.nextafter(pos, torch.full_like(pos, 1e308)),
                   torch.exp(torch.empty(300_000, dtype=torch.float64).uniform_(-46, 46, generator=g)),
                   torch.tensor([0.0, -0.0, 5e-324, 2.2e-308, 1.7e308, -3.0, -1e-3])])
    x = x * torch.where(torch.rand(x.numel(), generator=g) < 0.5, -1.0, 1.0).double()
    x[-3:] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    counts, amax, nonfinite = native.abs_stats(x, e)
    fin = x[torch.isfinite(x)].abs()
    ref = torch.bincount(torch.bucketize(fin, e, right=True) - 1, minlength=e.numel())
    assert torch.equal(counts, ref)
    assert amax == float(fin.max()) and nonfinite == 3
    # negative control: one value moved across an edge changes two bins
    moved = x.clone()
    moved[0] = torch.nextafter(moved[0].abs(), torch.zeros((), dtype=torch.float64))
    assert not torch.equal(native.abs_stats(moved, e)[0], counts)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_butterflies_bit_identical(d):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 3, d, generator=g, dtype=torch.float64)
    s = random_signs(d, 11)
    assert torch.equal(native.fwht(x, s), fwht(x * s))
    assert torch.equal(make_rotation("hadamard", d, 11).apply(x), fwht(x * s))


def test_fp8_decode_is_exact():
    codes = torch.arange(256, dtype=torch.uint8)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = codes.view(dt)
        a, b = native.to_float32(x), x.to(torch.float32)
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


@pytest.mark.parametrize("ftz", [True, False])
def test_rescale_rows_matches_flush_of_the_product(ftz):
    """O's rescale in place against flush(acc * scale): rows with scale 1 (skipped unless they hold
    a subnormal), scales below 1, and rows with subnormals, NaN, inf and -0 in each."""
    from fa3_numerics.numerics.emulator import flush_subnormals

    g = torch.Generator().manual_seed(6)
    acc = torch.randn(2, 3, 40, 32, generator=g) * torch.exp2(torch.randint(-140, 20, (2, 3, 40, 32), generator=g).float())
    acc[0, 0, 1, 3], acc[0, 1, 2, 0], acc[1, 2, 5, 7], acc[1, 0, 9, 1] = float("nan"), -0.0, float("inf"), 1e-40
    scale = torch.where(torch.rand(2, 3, 40, 1, generator=g) < 0.7, 1.0, 0.5 ** torch.randint(0, 30, (2, 3, 40, 1),
                                                                                        generator=g).float())
    scale[1, 0, 9] = 1.0  # a unit row that holds a subnormal
    ref = flush_subnormals(acc * scale) if ftz else acc * scale
    got = acc.clone()
    assert native.rescale_rows(got, scale, ftz) is got
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert (got[1, 0, 9, 1] == 0) == ftz  # the unit row's subnormal: flushed only with ftz


CASES = [
    # (heads, kv_heads, seqlen, head_dim, causal, recipe)
    (4, 2, 600, 64, False, "fa3-fp8"),
    (4, 2, 400, 64, True, "fa3-fp8"),
    (2, 1, 333, 128, True, "fa3-fp8-kernel"),
    (2, 2, 500, 128, False, "fa3-fp8-kernel,acc=fp32"),
    (2, 2, 500, 96, True, "fa3-fp16"),
    (2, 1, 300, 256, False, "fa3-fp8,gran=token"),
    (2, 2, 300, 64, True, "fa3-fp8-kernel,p=e5m2,v=e5m2"),
    (2, 2, 200, 128, False, "qk=bf16,v=bf16,p=bf16,poff=0,acc=fp22"),
    (2, 2, 400, 128, False, "exact"),
    (2, 2, 400, 64, True, "fa3-fp8,order=forward,bn=64"),
    (2, 2, 300, 64, False, "fa3-fp8-kernel,ftz=0"),
    (4, 1, 256, 64, True, "baseline-fp8"),
    (2, 2, 256, 64, False, "baseline-fp16"),
    # Recipes of the field: integer, microscaling and two-level P after the C step,
    # the smooth=qk bias before it, FlashAttention's per-tile normalisation around it.
    (2, 2, 300, 64, True, "fa1-fp16"),
    (4, 2, 300, 64, False, "sage1"),
    (4, 2, 333, 128, True, "sage2-int8"),
    (2, 2, 256, 64, False, "sage2-int4,acc=fp32"),
    (4, 2, 300, 128, True, "sage3-nvfp4"),
    (2, 1, 300, 64, False, "fa3-mxfp8,p=mxfp8,mxscale=floor"),
    (2, 2, 256, 64, True, "fa3-fp8-kernel,acc=fp32,smooth=qk,sbias=bf16,norm=tile,bn=64"),
    (2, 2, 200, 64, False, "sage3-nvfp4,algo=standard,order=reverse,nvts=head,pmatch=scale"),
]


@pytest.mark.parametrize("h,hkv,n,d,causal,spec", CASES)
def test_emulator_identical_with_and_without_compiled_paths(torch_only, h, hkv, n, d, causal, spec):
    """Heavy outliers (p 0.02, sigma 30): the fused C softmax step, casts, MMA model and
    rotation give the PyTorch path's outputs exactly, causal and GQA/MQA included."""
    q, k, v = generate("outliers", AttnShape(1, h, n, d, kv_heads=hkv), 3, p=0.02, sigma=30.0)
    r = Recipe.from_str(spec)
    fast = emulate(r, q, k, v, causal=causal)
    ref = torch_only(lambda: emulate(r, q, k, v, causal=causal))
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, ref)


def test_native_status_names_the_path(monkeypatch):
    assert native.status().startswith("native")
    monkeypatch.setenv("FA3N_NATIVE", "0")
    saved = dict(native._STATE)
    native._STATE.clear()
    try:
        assert "FA3N_NATIVE=0" in native.status()
        assert native.mma(torch.device("cpu")) is None
    finally:
        native._STATE.clear()
        native._STATE.update(saved)


@pytest.mark.parametrize("name", ["e2m1", "e4m3", "e5m2"])
def test_round_fast_is_the_reference_rounding(name):
    """``formats.round_fast`` (the compiled rounding, E2M1 included, used by the microscaling
    quantizers) against ``round_to_format``, float64 and float32 inputs, specials included."""
    from fa3_numerics.numerics.formats import element_format, round_fast

    g = torch.Generator().manual_seed(4)
    x = torch.randn(100_000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 20, (100_000,), generator=g).double())
    x[:5] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 2.5], dtype=torch.float64)  # 2.5: an E2M1 tie
    f = element_format(name)
    for t in (x, x.float()):
        got, ref = round_fast(t, f), round_to_format(t, f)
        assert got.dtype == t.dtype and torch.equal(got, ref)
        assert torch.equal(torch.signbit(got[2:4]), torch.tensor([False, True]))
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert torch.equal(torch.nan_to_num(round_fast(nan, f), nan=7.0), torch.nan_to_num(round_to_format(nan, f), nan=7.0))


def test_softmax_step_row_sums_in_the_kernels_order():
    """The compiled softmax step on a hand-made tile: scale_log2 1, offset 0 and integer scores
    make every P~ = 2^s exact. Thread 0 of the quad starts at 1 (the max does not move, so the
    rescale factor is exactly 1) and adds columns 0 then 1: 1 + 2^-24 rounds to 1 (a tie, to
    even), + 2^-23 gives 1 + 2^-23 (in the other order: 1 + 2^-22). Column 2 belongs to thread 1,
    and the flush makes 2^-200 a zero."""
    step = native.softmax_step(torch.device("cpu"))
    s = torch.tensor([[[[-24.0, -23.0, 0.0, -200.0, -200.0, -200.0, -200.0, -200.0]]]])
    m = torch.zeros(1, 1, 1, 1)
    rs4 = torch.tensor([[[[1.0, 0.0, 0.0, 0.0]]]])
    p, rescale = step(s.clone(), sl2=torch.ones(1, 1, 1, 1), qd=None, kd=None, base=1.0, lim=None, m=m, rs4=rs4,
                      offset=0.0, ftz=True, fmt=None)
    assert rescale.item() == 1.0 and m.item() == 0.0
    assert p.flatten().tolist() == [2.0 ** -24, 2.0 ** -23, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert rs4.flatten().tolist() == [1.0 + 2.0 ** -23, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 1000, 4099, 1 << 16])
def test_randn_gives_torch_randn_bits_and_generator_state(n):
    """The compiled map from uniforms to normals is torch.randn's, bit for bit, including its
    rule for a size that is not a multiple of 16 (16 fresh uniforms for the last 16 values),
    and it leaves the generator where torch.randn leaves it (the next draws agree too)."""
    g_ref, g = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
    ref = torch.randn(n, generator=g_ref, dtype=torch.float64)
    out = native.randn((n,), g)
    assert torch.equal(out.view(torch.int64), ref.view(torch.int64))
    assert torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=g_ref))


def test_randn_map_is_the_one_checked_and_shapes_are_kept():
    if native._lib() is None:
        pytest.skip("no compiled fast paths here")
    assert native._randn_matches_torch()
    g_ref, g = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    out = native.randn((2, 3, 64, 8), g)
    assert out.shape == (2, 3, 64, 8) and out.dtype == torch.float64
    assert torch.equal(out, torch.randn((2, 3, 64, 8), generator=g_ref, dtype=torch.float64))
    # a negative control: the same uniforms through another (textbook, unpaired) Box-Muller differ
    u = torch.rand(32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    other = torch.sqrt(-2 * torch.log(1 - u[0::2])) * torch.cos(2 * math.pi * u[1::2])
    assert not torch.equal(other, out.flatten()[:16])


@pytest.mark.parametrize("skip32,n", [(0, 1), (0, 311), (0, 312), (0, 313), (1, 312), (1, 5001), (623, 7),
                                      (5, 1 << 17)])
def test_uniforms_are_torch_rand_bits_and_leave_the_generator_where_torch_does(skip32, n):
    """The compiled MT19937 draws torch.rand's float64 uniforms from the generator's own state,
    whatever its position (``skip32`` single 32-bit draws first, so that a double's two words
    straddle the 624-word refresh), and sets the state where torch's draws leave it: the next
    draws of every kind agree too."""
    if native._lib() is None:
        pytest.skip("no compiled fast paths here")
    g_ref, g = torch.Generator().manual_seed(1000 + n), torch.Generator().manual_seed(1000 + n)
    for gen in (g_ref, g):
        torch.rand(skip32, generator=gen, dtype=torch.float32)  # one 32-bit word per value
    ref = torch.rand(n, generator=g_ref, dtype=torch.float64)
    out = native._rand_fast(n, g)
    assert torch.equal(out.view(torch.int64), ref.view(torch.int64))
    assert torch.equal(g.get_state(), g_ref.get_state())
    assert torch.equal(torch.randn(40, generator=g), torch.randn(40, generator=g_ref))
    # negative control: a generator one word further on gives other uniforms
    g_off = torch.Generator().manual_seed(1000 + n)
    torch.rand(skip32 + 1, generator=g_off, dtype=torch.float32)
    assert not torch.equal(native._rand_fast(n, g_off), ref)
