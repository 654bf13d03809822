"""MXFP8, NVFP4 and SageAttention3's two-level P against independent references.

The references round by searching the table of every encoding that ml_dtypes decodes (nearest
value, ties to the even code, saturating), and choose scales with Python's exact ``math.frexp``;
they share no code with the package's rounding.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.formats import encode_e8m0
from fa3_numerics.numerics.granularity import PerHead, PerToken
from fa3_numerics.numerics.microscaling import (P_ROW_OFFSET, P_ROW_TARGET, mx_quantize, nvfp4_quantize,
                                                quantize_p_two_level)


def table_round(x: np.ndarray, np_type) -> np.ndarray:
    """Nearest finite value of ``np_type`` (ties to the even code), saturating; NaN stays NaN."""
    nbits = 4 if np_type is ml_dtypes.float4_e2m1fn else 8
    codes = np.arange(2 ** (nbits - 1), dtype=np.uint8)  # non-negative half
    vals = codes.view(np_type).astype(np.float64)
    keep = np.isfinite(vals)
    codes, vals = codes[keep], vals[keep]
    order = np.argsort(vals)
    codes, vals = codes[order], vals[order]
    a = np.abs(np.asarray(x, dtype=np.float64))
    hi = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(codes[lo] % 2 == 0, lo, hi)))
    out = np.where(a >= vals[-1], vals[-1], vals[pick])
    out = np.where(np.isnan(a), np.nan, out)
    return np.copysign(out, x)


E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


@pytest.fixture
def x():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 3, 24, 80, generator=g, dtype=torch.float64)
    t[0, 0, 3, 5] = 300.0  # an outlier in one block
    t[1, 2, 7, 70:] *= 1e-3  # a quiet short block (80 = 2 x 32 + 16)
    return t


def _mx_reference(x: torch.Tensor, block: int, emax: int, np_type, rule: str):
    a = x.numpy()
    n = a.shape[-1]
    vals = np.empty_like(a)
    nb = -(-n // block)
    scales = np.empty(a.shape[:-1] + (nb,))
    for idx in np.ndindex(a.shape[:-1]):
        for b in range(nb):
            blk = a[idx][b * block:(b + 1) * block]
            amax = float(np.abs(blk).max())
            if amax == 0:
                e = -127
            elif rule == "floor":
                e = math.frexp(amax)[1] - 1 - emax
            else:
                m, ex = math.frexp(amax / (1.75 * 2 ** emax))
                e = ex - 1 if m == 0.5 else ex
            e = max(e, -127)
            scales[idx + (b,)] = 2.0 ** e
            vals[idx][b * block:(b + 1) * block] = table_round(blk / 2.0 ** e, np_type)
    return vals, scales


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp8_matches_independent_reference(x, rule):
    q = mx_quantize(x, "e4m3", block=32, axis=-1, scale_rounding=rule)
    vals, scales = _mx_reference(x, 32, 8, E4M3, rule)
    assert q.scale.shape == (2, 3, 24, 3) and q.values.shape == x.shape
    assert np.array_equal(q.values.double().numpy(), vals)
    assert np.array_equal(q.scale.double().numpy(), scales)
    # the scale bytes are the E8M0 encodings ml_dtypes gives those powers of two
    assert np.array_equal(encode_e8m0(q.scale).numpy(), q.scale.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))


def test_mxfp8_floor_saturates_and_ceil_does_not():
    blk = torch.full((1, 32), 1.0, dtype=torch.float64)
    blk[0, 0] = 1.9 * 2 ** 4  # amax/2^(4-8) = 486 > 448: the OCP floor rule saturates it
    fl = mx_quantize(blk, scale_rounding="floor")
    assert fl.scale.item() == 2.0 ** -4 and fl.values[0, 0].item() == 448.0
    ce = mx_quantize(blk, scale_rounding="ceil")
    assert ce.scale.item() == 2.0 ** -3 and ce.values[0, 0].item() == table_round(np.array([1.9 * 2 ** 7]), E4M3)[0]
    g = torch.Generator().manual_seed(1)
    r = torch.randn(64, 256, generator=g, dtype=torch.float64) * 50
    q = mx_quantize(r, scale_rounding="ceil")
    ratio = r.abs().reshape(64, 8, 32).amax(-1) / q.scale.double()
    assert torch.all(ratio <= 448) and torch.all(ratio > 224)


def test_mx_special_blocks():
    t = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t[0, :32] = 0
    t[1, 40] = torch.nan
    t[2, 3] = torch.inf
    q = mx_quantize(t)
    assert q.scale[0, 0].item() == 2.0 ** -127 and torch.all(q.values[0, :32] == 0)
    assert encode_e8m0(q.scale)[0, 0].item() == 0
    assert torch.isnan(q.scale[1, 1]) and torch.isnan(q.values[1, 32:]).all() and not torch.isnan(q.values[1, :32]).any()
    assert torch.isnan(q.scale[2, 0]) and encode_e8m0(q.scale)[2, 0].item() == 255


@pytest.mark.parametrize("elem,emax,np_type", [("e5m2", 15, ml_dtypes.float8_e5m2), ("e2m1", 2, E2M1)])
def test_mx_other_element_formats(x, elem, emax, np_type):
    """MXFP8 with e5m2 elements (emax 15) and MXFP4 (e2m1 elements, emax 2), OCP floor rule."""
    q = mx_quantize(x, elem, scale_rounding="floor")
    vals, scales = _mx_reference(x, 32, emax, np_type, "floor")
    assert np.array_equal(q.values.double().numpy(), vals) and np.array_equal(q.scale.double().numpy(), scales)


def test_mx_operand_is_exact_in_float32_and_axis_along_tokens(x):
    q = mx_quantize(x * 1e3)
    assert torch.equal(q.operand().double(), q.values.double() * q.expanded_scale().double())
    assert torch.equal(q.operand().double(), q.dequantize())
    v = mx_quantize(x, axis=2, block=8)  # V: blocks of 8 tokens
    vt = mx_quantize(x.transpose(2, 3), axis=-1, block=8)
    assert v.scale.shape == (2, 3, 3, 80)
    assert torch.equal(v.values, vt.values.transpose(2, 3)) and torch.equal(v.scale, vt.scale.transpose(2, 3))
    with pytest.raises(UsageError):
        mx_quantize(x, "fp16")
    with pytest.raises(UsageError):
        mx_quantize(x, scale_rounding="nearest")


def test_nvfp4_without_tensor_scale_is_sageattention3s_quantizer(x):
    """fp4_quantization_4d.cu: SF = e4m3(amax16 / 6), elements e2m1(x / SF), no tensor scale."""
    q = nvfp4_quantize(x, tensor_scale=None)
    assert q.tensor_scale is None and q.scale.shape == (2, 3, 24, 5)
    a = x.abs().reshape(2, 3, 24, 5, 16).amax(-1).numpy()
    sf = table_round(a / 6, E4M3)
    assert np.array_equal(q.scale.double().numpy(), sf)
    sfe = np.repeat(sf, 16, axis=-1)
    ref = np.where(sfe > 0, table_round(x.numpy() / np.where(sfe > 0, sfe, 1), E2M1), 0.0)
    assert np.array_equal(q.values.double().numpy(), ref)
    assert torch.equal(q.operand().double(), q.dequantize())  # e2m1 x e4m3: exact in float32


def test_nvfp4_tensor_scale_and_zero_blocks(x):
    y = x.clone()
    y[0, 0, 0, :16] = 1e-9  # a block far below the tensor's range: its e4m3 scale underflows to 0
    q = nvfp4_quantize(y)
    t = q.tensor_scale.double()
    assert q.tensor_scale.shape == (1, 1, 1, 1) and q.tensor_scale.item() == np.float32(300.0 / P_ROW_TARGET)
    a = y.abs().reshape(2, 3, 24, 5, 16).amax(-1).numpy()
    assert np.array_equal(q.scale.double().numpy(), table_round(a / (6 * t.item()), E4M3))
    assert q.scale.max().item() <= 448 and q.scale[0, 0, 0, 0].item() == 0
    assert torch.all(q.values[0, 0, 0, :16] == 0) and torch.isfinite(q.dequantize()).all()
    rel = ((q.dequantize() - y).norm() / y.norm()).item()
    assert 0.02 < rel < 0.2  # FP4: about 10% of the signal
    flat = nvfp4_quantize(y[0, 0], block=16)  # any rank with a per-tensor scale
    assert flat.values.shape == (24, 80) and flat.tensor_scale.shape == (1, 1)
    ph = nvfp4_quantize(y, tensor_scale=PerHead())
    assert ph.tensor_scale.shape == (2, 3, 1, 1)
    with pytest.raises(UsageError):
        nvfp4_quantize(y, axis=2, tensor_scale=PerToken())  # a tensor scale varying along the block axis


def test_two_level_p_row_scale_then_e4m3_block_scales():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 4, 8, 96, generator=g, dtype=torch.float64) * 4
    p = torch.exp(s - s.amax(-1, keepdim=True))  # normalised by the row max: in (0, 1]
    p[0, 0, 0, 16:48] = 0  # two masked blocks
    q = quantize_p_two_level(p, row_scale="amax")
    r = q.tensor_scale.double()
    assert q.tensor_scale.shape == (2, 4, 8, 1)
    assert torch.equal(q.tensor_scale, (p.amax(-1, keepdim=True) / P_ROW_TARGET).to(torch.float32))
    p1 = (p / r).to(torch.float32).double()
    assert p1.amax().item() <= P_ROW_TARGET
    sf = (p1.reshape(2, 4, 8, 6, 16).amax(-1) / 6).to(torch.float32).double()
    assert np.array_equal(q.scale.double().numpy(), table_round(sf.numpy(), E4M3))  # never saturates: sf <= 448
    assert q.scale.max().item() <= 448 and torch.all(q.scale[0, 0, 0, 1:3] == 0) and torch.all(q.values[0, 0, 0, 16:48] == 0)
    # kernel: elements divided by the float32 scale, so every block's max becomes exactly 6 and
    # dequantizes to 6 x e4m3(sf): a per-block bias of e4m3(sf) / sf
    sfe = sf.repeat_interleave(16, -1)
    live = sfe > 0
    ref = table_round(((p1 / torch.where(live, sfe, 1)).to(torch.float32)).double().numpy(), E2M1)
    assert np.array_equal(q.values.double().numpy(), np.where(live.numpy(), ref, 0.0))
    blockmax = q.values.double().reshape(2, 4, 8, 6, 16).amax(-1)
    assert torch.all((blockmax == 6) | (sf == 0))
    deq_max = q.dequantize().reshape(2, 4, 8, 6, 16).amax(-1) / r
    assert torch.allclose(deq_max, 6 * q.scale.double(), rtol=0, atol=0)
    bias = (q.scale.double() / sf)[sf > 0]
    assert (bias - 1).abs().max().item() <= 2 ** -4 and (bias != 1).any()


def test_two_level_p_scale_match_and_kernel_form():
    g = torch.Generator().manual_seed(3)
    p = torch.rand(3, 64, generator=g, dtype=torch.float64)
    p[:, 0] = 1.0  # the row max
    tilde = (p * P_ROW_TARGET).to(torch.float32)  # the kernel's P~: exp2 offset log2(2688)
    k = quantize_p_two_level(tilde, row_scale="none")
    a = quantize_p_two_level(p, row_scale="amax")
    assert k.tensor_scale is None
    assert torch.equal(k.values, a.values) and torch.equal(k.scale, a.scale)  # row max 1: the same P~
    m = quantize_p_two_level(tilde, row_scale="none", match="scale")
    s8 = m.scale.double().repeat_interleave(16, -1)
    assert np.array_equal(m.values.double().numpy(), table_round(tilde.double().numpy() / s8.numpy(), E2M1))
    assert math.isclose(2 ** P_ROW_OFFSET, 2688.0, rel_tol=1e-15)
    with pytest.raises(UsageError):
        quantize_p_two_level(p, row_scale="tensor")
