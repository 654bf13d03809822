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
