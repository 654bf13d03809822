import pytest
import torch

from fa3_numerics.numerics.formats import get_format, round_to_format
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken, amax, parse_granularity
from fa3_numerics.numerics.quant import amax_to_scale, quantize


@pytest.fixture
def x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 300, 64, generator=g, dtype=torch.float64) * 3


def _amax_by_loops(x, gran):
    """amax of |x| at ``gran`` per (batch, head, token), by explicit loops over the groups of
    tokens that share a scale: no broadcasting tricks."""
    b, h, n, _ = x.shape
    rows = {PerTensor: n, PerHead: n, PerToken: 1}.get(type(gran)) or gran.rows
    out = torch.empty(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for s0 in range(0, n, rows):
                grp = x if isinstance(gran, PerTensor) else x[bi, hi, s0:s0 + rows]
                out[bi, hi, s0:s0 + rows] = grp.abs().max()
    return out


@pytest.mark.parametrize("gran,shape", [(PerTensor(), (1, 1, 1, 1)), (PerHead(), (2, 4, 1, 1)),
                                        (PerToken(), (2, 4, 300, 1)), (PerBlock(128), (2, 4, 300, 1))])
def test_amax_shapes_and_values(x, gran, shape):
    """The documented shape of each granularity, and its values against explicit loops (the
    last block of 300 tokens in blocks of 128 is 44 long)."""
    a = amax(x, gran)
    assert a.shape == shape
    assert torch.equal(a.expand(2, 4, 300, 1)[..., 0], _amax_by_loops(x[:, :, :, :], gran))


def test_block_amax_is_blockwise(x):
    a = amax(x, PerBlock(128))
    for s in (0, 128, 256):
        blk = x[:, :, s:s + 128].abs().amax(dim=(2, 3))
        assert torch.equal(a[:, :, s, 0], blk)
        assert torch.equal(a[:, :, min(s + 127, 299), 0], blk)  # constant across the block, last block short


def test_grouped_head_amax(x):
    a = amax(x, PerHead(), group=2)
    assert torch.equal(a[:, 0], a[:, 1]) and torch.equal(a[:, 2], a[:, 3])
    assert torch.equal(a[:, 0, 0, 0], x[:, :2].abs().amax(dim=(1, 2, 3)))


@pytest.mark.parametrize("gran", [PerTensor(), PerHead(), PerToken(), PerBlock(64)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_is_independent_rounding_of_scaled_values(x, gran, fmt):
    q = quantize(x, fmt, gran)
    f = get_format(fmt)
    d = q.descale.double()
    assert q.descale.dtype == torch.float32
    # amax maps exactly to the format's max (up to the float32 descale) and nothing saturates beyond it
    assert torch.all(q.values.double().abs() <= f.max)
    assert torch.equal(q.values.double(), round_to_format(x / d, fmt))
    rel = ((q.dequantize() - x).abs() / x.abs().clamp_min(1e-3)).median()
    assert rel < 2.0 ** -(f.mbits + 1)


@pytest.mark.parametrize("gran", [PerTensor(), PerHead(), PerBlock(64), PerToken()])
def test_pow2_scales_are_the_smallest_power_of_two_that_fits(x, gran):
    """pow2 descales are 2^ceil(log2(amax / 448)): a power of two, at least amax / 448 (so no
    value saturates) and less than twice it (so no range is wasted: the largest |value| of each
    group lies in (224, 448]). Rounding the exponent down would saturate; up twice, waste a bit."""
    q = quantize(x, "e4m3", gran, pow2=True)
    d = q.descale.double().expand(2, 4, 300, 1)[..., 0]
    need = _amax_by_loops(x, gran) / 448
    m, _ = torch.frexp(d)
    assert torch.all(m == 0.5)  # powers of two
    assert torch.all(d >= need) and torch.all(d / 2 < need)
    assert torch.all(q.values.double().abs() <= 448)
    if isinstance(gran, PerToken):  # each token's largest value, rounded to e4m3, is in [224, 448]
        assert torch.all(q.values.double().abs().amax(dim=-1) >= 224)


@pytest.mark.parametrize("case,amax,want", [
    ("amax / 448 exactly a power of two", 448 * 2.0 ** -5, 2.0 ** -5),
    ("a hair above: the next power", 448 * 2.0 ** -5 * (1 + 2.0 ** -20), 2.0 ** -4),
    ("a hair below: the same power", 448 * 2.0 ** -5 * (1 - 2.0 ** -20), 2.0 ** -5),
    ("amax 448: descale 1", 448.0, 1.0),
    ("tiny amax", 448 * 2.0 ** -100 * 1.5, 2.0 ** -99),
])
def test_pow2_scale_rounds_up_at_the_edges(case, amax, want):
    got = amax_to_scale(torch.tensor([amax], dtype=torch.float64), get_format("e4m3"), pow2=True)
    assert got.dtype == torch.float32 and got.item() == want, case


def test_amax_scales_map_each_groups_amax_to_the_format_max(x):
    """Without pow2 the descale is amax / 448 rounded once to float32 (torchao's amax_to_scale):
    each group's largest |value| lands on 448 up to that rounding."""
    q = quantize(x, "e4m3", PerHead())
    assert torch.equal(q.descale, (x.abs().amax(dim=(2, 3), keepdim=True) / 448).to(torch.float32))
    assert torch.equal(q.values.double().abs().amax(dim=(2, 3)), torch.full((2, 4), 448.0, dtype=torch.float64))


def test_zero_tensor_scale_is_one():
    assert amax_to_scale(torch.zeros(1), get_format("e4m3")).item() == 1.0


def test_rows_quantize_equals_full_then_select(x):
    rows = torch.tensor([0, 5, 127, 128, 299])
    for gran in (PerTensor(), PerHead(), PerBlock(128), PerToken()):
        full = quantize(x, "e4m3", gran)
        part = quantize(x, "e4m3", gran, rows=rows)
        assert torch.equal(part.values.double(), full.values.double()[:, :, rows])


def test_parse_granularity():
    assert parse_granularity("block64") == PerBlock(64)
    assert parse_granularity("block") == PerBlock()
    with pytest.raises(ValueError):
        parse_granularity("row")


# -- Integer quantization (SageAttention's INT8 / INT4 Q and K) --------------------------------

import numpy as np  # noqa: E402

from fa3_numerics.errors import UsageError  # noqa: E402
from fa3_numerics.numerics.formats import E2M1  # noqa: E402
from fa3_numerics.numerics.granularity import PerChannel, PerThread, sage2_thread_granularities  # noqa: E402
from fa3_numerics.numerics.intformats import (INT_FORMATS, float32_gemm_is_exact, get_int_format, int_matmul,  # noqa: E402
                                              round_to_int)
from fa3_numerics.numerics.quant import quantize_int  # noqa: E402


@pytest.mark.parametrize("case,x,away,even", [
    ("0.5", 0.5, 1, 0), ("1.5", 1.5, 2, 2), ("2.5", 2.5, 3, 2), ("-0.5", -0.5, -1, 0), ("-2.5", -2.5, -3, -2),
    ("largest double below 0.5", 0.49999999999999994, 0, 0), ("126.5", 126.5, 127, 126),
    ("2.4999", 2.4999, 2, 2), ("2.5001", 2.5001, 3, 3), ("above qmax clamps", 127.6, 127, 127),
    ("below -qmax clamps to the symmetric -127", -130.0, -127, -127),
])
def test_int8_round_to_nearest_tie_rules(case, x, away, even):
    t = torch.tensor([x], dtype=torch.float64)
    assert round_to_int(t, "int8", "away").item() == away, case
    assert round_to_int(t, "int8", "even").item() == even, case


def test_int_formats_are_symmetric():
    assert get_int_format("int8").qmax == 127 and get_int_format("INT4").qmax == 7 and set(INT_FORMATS) == {"int8", "int4"}
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    r = round_to_int(x, "int4")
    assert r.min().item() == -7 and r.max().item() == 7
    with pytest.raises(UsageError):
        round_to_int(x, "int4", "up")
    with pytest.raises(UsageError):
        get_int_format("int2")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("gran", [PerBlock(128), PerBlock(64), PerThread(32, 1), PerThread(64, 2), PerToken(), PerHead()])
def test_quantize_int_codes_and_scales(x, fmt, gran):
    f = get_int_format(fmt)
    q = quantize_int(x, fmt, gran)
    assert q.values.dtype == torch.int8 and q.descale.dtype == torch.float32
    assert q.descale.shape == amax(x, gran).shape
    d = q.descale.double()
    # descale = amax / qmax computed in float64, rounded once to float32
    assert torch.equal(q.descale, (amax(x, gran) / f.qmax).to(torch.float32))
    # codes: round half away from zero of x / descale, clamped
    assert torch.equal(q.values.double(), round_to_int(x / d, fmt, "away"))
    assert q.values.abs().max().item() == f.qmax  # each group's amax maps to +-qmax
    # error at most half a step (plus the float32 rounding of the descale at the amax)
    assert torch.all((q.dequantize() - x).abs() <= d * 0.5 * (1 + 1e-6))


def test_quantize_int_zero_group_and_rows(x):
    z = x.clone()
    z[:, :, :128] = 0
    q = quantize_int(z, "int8", PerBlock(128))
    assert torch.all(q.descale[:, :, :128] == 1) and torch.all(q.values[:, :, :128] == 0)
    rows = torch.tensor([0, 5, 127, 128, 299])
    for gran in (PerBlock(128), PerThread(32, 1), PerHead()):
        full = quantize_int(x, "int8", gran)
        part = quantize_int(x, "int8", gran, rows=rows)
        assert torch.equal(part.values, full.values[:, :, rows])


def test_quantize_int_ties_follow_the_chosen_rule():
    # dyadic data: x / descale hits k + 1/2 exactly (amax 127 -> descale 1)
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -3.5], dtype=torch.float64).reshape(1, 1, 1, 6)
    assert quantize_int(x, "int8", PerToken(), ties="away").values.flatten().tolist() == [127, 1, 2, 3, -1, -4]
    assert quantize_int(x, "int8", PerToken(), ties="even").values.flatten().tolist() == [127, 0, 2, 2, 0, -4]


def _int64_reference(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    return np.einsum("...mk,...kn->...mn", a.numpy().astype(np.int64), b.numpy().astype(np.int64))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int_gemm_is_exact_and_float32_accumulation_of_codes_is_too(x, fmt):
    qmax = get_int_format(fmt).qmax
    g = torch.Generator().manual_seed(5)
    d = 128
    a = torch.randint(-qmax, qmax + 1, (3, 64, d), generator=g)
    b = torch.randint(-qmax, qmax + 1, (3, d, 80), generator=g)
    worst_a = torch.full((1, 4, d), qmax)  # |sum| reaches d * qmax^2
    worst_b = torch.cat([torch.full((1, d, 1), qmax), torch.full((1, d, 1), -qmax)], dim=2)
    for aa, bb in ((a, b), (worst_a, worst_b)):
        ref = _int64_reference(aa, bb)
        got = int_matmul(aa.to(torch.int8), bb.to(torch.int8))
        assert got.dtype == torch.int32 and np.array_equal(got.numpy().astype(np.int64), ref)
        # what the emulator does: a float32 matmul of the codes
        f32 = torch.matmul(aa.to(torch.float32), bb.to(torch.float32))
        assert np.array_equal(f32.numpy().astype(np.int64), ref)
    assert float32_gemm_is_exact(d, fmt, fmt)


def test_float32_exactness_bound_and_int32_overflow_refusal():
    assert float32_gemm_is_exact(1040, "int8", "int8") and not float32_gemm_is_exact(1041, "int8", "int8")
    # past the bound a float32 sum of codes really can round: a running float32 sum, one product
    # at a time (a BLAS is free to block or pair its sums, and some do this one exactly)
    k = 2048
    prods = np.full(k, 127 * 127, dtype=np.float32)
    prods[-1] = 127
    exact = 127 * 127 * (k - 1) + 127
    assert np.cumsum(prods, dtype=np.float32)[-1] != exact
    assert np.cumsum(prods[:1040], dtype=np.float32)[-1] == 127 * 127 * 1040  # within the bound: exact
    big = torch.full((1, 200_000), 127, dtype=torch.int64)
    with pytest.raises(UsageError, match="overflow"):
        int_matmul(big, big.T)


def test_quantized_int8_attention_scores_equal_exact_scaled_products():
    """S = (q_scale * k_scale) * (codes_q . codes_k): the integer product is exact, so the only
    error of the scores is the quantization of Q and K (SageAttention v1: Q per 128-token block,
    K per 64-token block)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 256, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 256, 64, generator=g, dtype=torch.float64)
    qq, kq = quantize_int(q, "int8", PerBlock(128)), quantize_int(k, "int8", PerBlock(64))
    s_int = int_matmul(qq.values, kq.values.transpose(-1, -2)).double()
    s = s_int * qq.descale.double() * kq.descale.double().transpose(-1, -2)
    assert torch.allclose(s, qq.dequantize() @ kq.dequantize().transpose(-1, -2), rtol=0, atol=1e-12)
    exact = q @ k.transpose(-1, -2)
    assert ((s - exact).norm() / exact.norm()).item() < 0.02  # INT8 per-block: about 1% of S


# -- FP8 and FP4 at the new granularities ---------------------------------------------------------

def test_fp8_per_channel_v_scales(x):
    """SageAttention2's V: e4m3 with one scale per (batch, head, channel) over all tokens."""
    q = quantize(x, "e4m3", PerChannel())
    assert q.descale.shape == (2, 4, 1, 64)
    assert torch.equal(q.descale, (x.abs().amax(dim=2, keepdim=True) / 448).to(torch.float32))
    assert torch.equal(q.values.double(), round_to_format(x / q.descale.double(), "e4m3"))
    assert torch.equal(q.values.double().abs().amax(dim=2), torch.full((2, 4, 64), 448.0, dtype=torch.float64))


def test_scaled_e2m1_goes_through_the_scaled_path(x):
    q = quantize(x, E2M1, PerBlock(16))
    assert q.values.dtype == torch.float32 and q.values.abs().max().item() == 6.0
    assert torch.equal(q.values.double(), round_to_format(x / q.descale.double(), E2M1))


def test_sage2_thread_granularities_quantize(x):
    qg, kg = sage2_thread_granularities()
    qq, kq = quantize_int(x, "int4", qg), quantize_int(x, "int4", kg)
    assert qq.descale[0, 0, :32].unique().numel() == 8 and kq.descale[0, 0, :64].unique().numel() == 4
