"""The emulator against the float64 reference and against independent simple implementations."""

import math

import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.formats import quantize_dequantize
from fa3_numerics.numerics.metrics import per_sample
from fa3_numerics.numerics.quant import quantize
from fa3_numerics.numerics.granularity import PerHead
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.numerics.reference import expand_kv, reference_attention


@pytest.fixture(scope="module")
def qkv():
    return generate("outliers", AttnShape(1, 4, 600, 64, kv_heads=2), 0, p=0.01, sigma=10.0)


EXACT = PRESETS["exact"].recipe


@pytest.mark.parametrize("causal", [False, True])
def test_no_quantization_equals_reference_to_float32_rounding(qkv, causal):
    q, k, v = qkv
    ref = reference_attention(q, k, v, causal=causal)
    out = emulate(EXACT, q, k, v, causal=causal)
    # float32 inputs + float32 arithmetic: relative error a few float32 ulps
    rel = (out - ref).abs().max() / ref.abs().max()
    assert rel < 2e-6, rel
    # and the FP8 emulation is far from it, so the comparison can tell them apart
    fp8 = emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32"), q, k, v, causal=causal)
    assert (fp8 - ref).abs().max() / ref.abs().max() > 1e-3


@pytest.mark.parametrize("bn", [32, 64, 100, 600, 1000])
def test_tile_size_and_order_do_not_change_exact_attention(qkv, bn):
    q, k, v = qkv
    base = emulate(EXACT, q, k, v)
    # Tiles change only the float32 rounding: the row sum is four sequential float32 sums of
    # nk/4 positive terms each (relative error <= nk/4 * 2^-24 per sum, the worst case), and O
    # is a sum of rescaled partial products with the same bound; two emulations can differ by
    # twice that.
    bound = 2 * (k.shape[2] / 4) * 2.0 ** -24
    for order in ("reverse", "forward"):
        r = Recipe.from_str(f"exact,bn={bn},order={order}")
        assert (emulate(r, q, k, v) - base).abs().max() < bound * base.abs().max()


def test_query_subset_gives_same_rows(qkv):
    q, k, v = qkv
    idx = torch.tensor([0, 17, 300, 599])
    for name in ("fa3-fp8", "baseline-fp8", "baseline-fp16", "fa3-fp8-kernel,acc=fp32"):
        r = Recipe.from_str(name)
        full = emulate(r, q, k, v, causal=True)
        part = emulate(r, q, k, v, causal=True, q_index=idx)
        assert torch.allclose(part, full[:, :, idx], rtol=1e-2, atol=1e-3), name


def naive_fp8_per_head(q, k, v, scale):
    """Independent model: quantize per head, materialise S, softmax in float64, P with FA3's
    [0, 256] scaling cast to e4m3 against the *global* row max, float64 matmuls."""
    h = q.shape[1]
    qq = quantize(q, "e4m3", PerHead(), group=h // k.shape[1])
    kq = quantize(k, "e4m3", PerHead())
    vq = quantize(v, "e4m3", PerHead())
    kd, vd = expand_kv(kq.dequantize(), h), expand_kv(vq.dequantize(), h)
    s = qq.dequantize() @ kd.transpose(-1, -2) * scale
    m = s.amax(-1, keepdim=True)
    pt = torch.exp2((s - m) * math.log2(math.e) + 8)
    p8 = quantize_dequantize(pt.float(), "e4m3", torch.float64)
    return (p8 @ vd) / pt.sum(-1, keepdim=True)


def test_fp8_emulation_close_to_independent_model(qkv):
    q, k, v = qkv
    ref = reference_attention(q, k, v)
    emu = emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32"), q, k, v)
    ind = naive_fp8_per_head(q, k, v, 1 / 8)
    err_emu = per_sample(emu, ref)["rmse"]
    err_ind = per_sample(ind, ref)["rmse"]
    # same error budget (tiling and BF16 output differ, quantization does not)
    assert abs(err_emu.mean() / err_ind.mean() - 1) < 0.15
    assert per_sample(emu, ind)["rmse"].mean() < 0.6 * err_ind.mean()


def test_p_offset_protects_against_p_collapse():
    """An attention sink 8 nats above every other key: P in [0, 1] underflows in e4m3 for the
    other keys (P-collapse, arXiv 2606.06521), FA3's P~ in [0, 256] keeps them."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 512, 64, generator=g, dtype=torch.float64) for _ in range(3))
    q[..., 0] = 4.0
    k[..., 0] = 0.0
    k[:, :, 0, 0] = 16.0  # logit of the sink: +8 for every query (scale 1/8)
    ref = reference_attention(q, k, v)
    only_p = "qk=fp32,v=fp32,p=e4m3,out=fp32"
    e8 = per_sample(emulate(Recipe.from_str(only_p + ",poff=8"), q, k, v), ref)["rmse"].mean()
    e0 = per_sample(emulate(Recipe.from_str(only_p + ",poff=0"), q, k, v), ref)["rmse"].mean()
    assert e0 > 3 * e8, (e0, e8)


def test_hadamard_reduces_error_on_outliers():
    q, k, v = generate("outliers", AttnShape(1, 4, 1024, 128), 1, p=0.001, sigma=10.0)
    idx = torch.arange(0, 1024, 2)
    ref = reference_attention(q, k, v, q_index=idx)
    e = {n: per_sample(emulate(Recipe.from_str(n + ",acc=fp32"), q, k, v, q_index=idx), ref)["rmse"].mean()
         for n in ("fa3-fp8-kernel", "fa3-fp8-kernel-hadamard")}
    assert e["fa3-fp8-kernel-hadamard"] < 0.8 * e["fa3-fp8-kernel"]


def test_fully_masked_rows_are_zero_not_nan():
    """Causal with more queries than keys: the first rows see no key (FlashAttention gives 0)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 20, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 10, 64, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 10, 64, generator=g, dtype=torch.float64)
    for name in ("fa3-fp8-kernel", "fa3-fp8-kernel,acc=fp32", "exact"):
        o = emulate(Recipe.from_str(name), q, k, v, causal=True)
        assert torch.isfinite(o).all()
        assert torch.equal(o[0, 0, :10], torch.zeros_like(o[0, 0, :10]))


def test_standard_fp16_matches_pytorch_math_sdpa():
    """baseline-fp16 emulates PyTorch's math SDPA in half precision (sqrt(scale) on Q and K,
    S and P in FP16): an independent implementation, run here on the CPU."""
    from fa3_numerics.engine.backends import get_backend

    q, k, v = generate("outliers", AttnShape(1, 2, 512, 64), 5, p=0.01, sigma=10.0)
    idx = torch.arange(0, 512, 3)
    sdpa = get_backend("sdpa-math")
    if sdpa.check("cpu") is not None:
        pytest.skip(sdpa.check("cpu"))
    recipe = PRESETS["baseline-fp16"].recipe
    hw = sdpa.attention(recipe, q, k, v, causal=False, q_index=idx, rotation_seed=0, cache={})
    same = (emulate(recipe, q, k, v, q_index=idx) == hw).double().mean().item()
    assert same > 0.95, same
    after = (emulate(Recipe.from_str("baseline-fp16,sscale=after"), q, k, v, q_index=idx) == hw).double().mean().item()
    assert after < same


# -- issue 9: heavy outliers, flush to zero, every head layout ---------------------------------


def test_kernel_model_finite_on_heavy_outliers():
    """The scenario that returned NaN for every output: p 0.01, sigma 30 at head dim 64. The
    Hopper MMA model met a float32 subnormal accumulator (an old row rescaled by a tiny factor)
    with an all-zero k-step. The kernel's outputs on such data are finite (reports/h200/)."""
    q, k, v = generate("outliers", AttnShape(1, 2, 512, 64), 0, p=0.01, sigma=30.0)
    idx = torch.arange(0, 512, 8)
    for spec in ("fa3-fp8-kernel", "fa3-fp8-kernel,ftz=0", "fa3-fp8-kernel,acc=two-level"):
        o = emulate(Recipe.from_str(spec), q, k, v, q_index=idx)
        assert torch.isfinite(o).all(), spec


def _sink_then_rest(late: float):
    """One query; keys in two tiles of 64 (bn=64, visited last to first). The last tile holds
    ordinary keys (scores ~0); the first holds a sink ``late`` nats above them with V = 0, and
    keys far below everything (P = 0). The output is then the ordinary keys' O scaled by the
    rescale factor exp(-late), which FA3's flush to zero turns into exactly 0 once that
    factor is a float32 subnormal."""
    g = torch.Generator().manual_seed(9)
    q = torch.zeros(1, 1, 1, 64, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.randn(1, 1, 128, 64, generator=g, dtype=torch.float64) * 0.1
    v = torch.randn(1, 1, 128, 64, generator=g, dtype=torch.float64)
    k[0, 0, :64, 0] = -8000.0  # P = 0 in the first tile...
    k[0, 0, 0, 0] = late * 8.0  # ...but for the sink (softmax scale 1/8)
    v[0, 0, 0] = 0.0
    return q, k, v


def test_flush_to_zero_drops_a_row_rescaled_below_float32_normals():
    """At 95 nats the rescale factor exp2(-137) is a float32 subnormal: the kernel (built with
    --use_fast_math) flushes it to 0, so O is exactly 0; IEEE arithmetic (ftz=0) leaves a
    subnormal O. At 60 nats (2^-87, normal) both keep the same tiny O."""
    base = "qk=fp32,v=fp32,p=fp32,out=fp32,poff=0,bn=64"
    q, k, v = _sink_then_rest(95.0)
    ftz = emulate(Recipe.from_str(base), q, k, v)
    ieee = emulate(Recipe.from_str(base + ",ftz=0"), q, k, v)
    assert torch.equal(ftz, torch.zeros_like(ftz))
    assert (ieee != 0).any() and ieee.abs().max() < 2.0 ** -126
    q, k, v = _sink_then_rest(60.0)
    ftz, ieee = (emulate(Recipe.from_str(base + s), q, k, v) for s in ("", ",ftz=0"))
    assert torch.equal(ftz, ieee) and (ftz != 0).any()


LAYOUTS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_every_preset_runs_every_head_layout(heads, kv_heads, causal, d):
    """Every preset x {MHA, GQA, MQA} x {causal, not} x every supported head dim, at toy size:
    finite outputs of the right shape, and the unquantized preset matches float64 attention.
    (MQA crashed the standard algorithm with a shape error before.)"""
    q, k, v = generate("outliers", AttnShape(1, heads, 80, d, kv_heads=kv_heads), 1, p=0.01, sigma=10.0)
    idx = torch.arange(0, 80, 9)
    ref = reference_attention(q, k, v, causal=causal, q_index=idx)
    for name in PRESETS:
        spec = name + ",acc=fp32" if "kernel" in name else name
        o = emulate(Recipe.from_str(spec), q, k, v, causal=causal, q_index=idx)
        assert o.shape == ref.shape, name
        assert torch.isfinite(o).all(), name
    exact = emulate(EXACT, q, k, v, causal=causal, q_index=idx)
    assert (exact - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_gqa_equals_mha_with_repeated_kv():
    """Grouped heads are attention against the KV head of their group: emulating GQA equals
    emulating MHA with K and V repeated, for every granularity whose scales do not depend on
    the head grouping. (Per-head descales do: the kernel's q_descale is one per (batch,
    KV head), shared by the group's query heads, so GQA and MHA legitimately differ there.)"""
    q, k, v = generate("outliers", AttnShape(1, 4, 200, 64, kv_heads=1), 2, p=0.01, sigma=10.0)
    kk, vv = k.expand(1, 4, 200, 64).contiguous(), v.expand(1, 4, 200, 64).contiguous()
    for spec in ("baseline-fp8", "fa3-fp8-kernel,gran=tensor", "fa3-fp8", "fa3-fp8,gran=token", "exact",
                 "baseline-fp16"):
        r = Recipe.from_str(spec)
        assert torch.equal(emulate(r, q, k, v, causal=True), emulate(r, q, kk, vv, causal=True)), spec
