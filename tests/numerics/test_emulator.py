"""The emulator against the float64 reference and against independent implementations.

Two independent models are written here, from the kernel's description rather than from the
emulator's code:

- ``fa3_fp8_forward``: FA3's FP8 forward step by step (per-head descales,
  KV tiles last to first, running max, P~ = exp2(S scale_log2 - (m scale_log2 - 8)) as one
  FFMA, row sums over float32 P~ in the quad's order, P~ cast to e4m3 RNE saturating, O
  rescaled in float32 with the fast-math flush, BF16 output), one row at a time in numpy with
  ml_dtypes' casts. It agrees with the emulator bit for bit on almost every output, so it pins
  the P offset, the tile order, the tile size, the output format, the causal alignment and
  the head layout (GQA/MQA), through the compiled paths and the PyTorch ones.
- ``attention_by_rows``: float64 attention one query row at a time over the visible keys
  (causal aligned bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q), for every
  algorithm x {MHA, GQA, MQA} x {causal, not} with unquantized recipes.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.data.distributions.paper import outliers_like
from fa3_numerics.numerics.emulator import emulate, prepare
from fa3_numerics.numerics.formats import quantize_dequantize
from fa3_numerics.numerics.granularity import PerHead
from fa3_numerics.numerics.metrics import per_sample
from fa3_numerics.numerics.quant import quantize
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.numerics.reference import expand_kv, reference_attention

U32 = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module")
def qkv():
    return generate("outliers", AttnShape(1, 4, 600, 64, kv_heads=2), 0, p=0.01, sigma=10.0)


def _draw(h, hkv, n, nk, d, seed, p=0.01, sigma=10.0):
    """Q [1, h, n, d], K and V [1, hkv, nk, d] of the paper's distribution (seqlen_q != seqlen_k allowed)."""
    g = torch.Generator().manual_seed(seed)
    return (outliers_like((1, h, n, d), g, p, sigma), outliers_like((1, hkv, nk, d), g, p, sigma),
            outliers_like((1, hkv, nk, d), g, p, sigma))


EXACT = PRESETS["exact"].recipe
KERNEL32 = "fa3-fp8-kernel,acc=fp32"  # the public kernel's recipe with an ideal float32 accumulator

# KV tiles (kBlockN) of FA3's FP8 forward per head dim, transcribed from Dao-AILab/flash-attention
# hopper/tile_size.h (tile_size_fwd_sm90, element_size 1, two MMA warpgroups, not paged/local).
FA3_FP8_BLOCK_N = {64: 160, 96: 128, 128: 224, 192: 160, 256: 128}


# -- model 1: FA3's FP8 forward, from its description -------------------------------------------

F32 = np.float32
FLT_MIN = F32(2.0 ** -126)


def _flush(x):
    """The fast-math flush of float32 subnormal results to a zero of the same sign."""
    x = np.asarray(x, dtype=F32)
    return np.where(np.abs(x) < FLT_MIN, F32(0) * x, x).astype(F32)


def _e4m3(x):
    """cvt.rn.satfinite.e4m3: ml_dtypes rounds to nearest even but does not saturate, so clip first."""
    return np.clip(np.asarray(x, np.float64), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _exp2_rz(x) -> np.float32:
    r = np.exp2(np.float64(x))
    y = F32(r)
    return F32(np.nextafter(y, F32(0))) if abs(np.float64(y)) > abs(r) else y


def _per_head(x, group):
    """x [H, N, D] float64 -> (e4m3 values as float64, float32 descale per head); consecutive heads
    in groups of ``group`` share a descale (the kernel's q_descale is per (batch, kv-head))."""
    h = x.shape[0]
    amax = np.abs(x).reshape(h // group, -1).max(axis=1).repeat(group)
    d = np.where(amax > 0, amax / 448.0, 1.0).astype(F32)
    return _e4m3(x / d.astype(np.float64)[:, None, None]), d


def fa3_fp8_forward(q, k, v, rows, *, causal=False, bn=160, offset=8.0, fp8=True):
    """FA3's FP8 forward (batch 1) for the query ``rows``: [H, R, Dv] float64 holding BF16 values.
    Rows are independent; they are vectorised here, each row's arithmetic is float32 as the
    kernel's threads do it. S and P.V are formed exactly (float64) and rounded once to float32:
    the kernel's float32 accumulation order is not modelled (see the bound in the test).
    ``fp8=False``: the same softmax arithmetic on float32 Q, K, V, P~ left in float32 and a
    float32 output (the recipe qk=fp32,v=fp32,p=fp32,out=fp32)."""
    q, k, v = (np.asarray(t[0], np.float64) for t in (q, k, v))
    h, n, d = q.shape
    hkv, nk = k.shape[:2]
    g = h // hkv
    rows = np.asarray(rows)
    if fp8:
        q8, qd = _per_head(q, g)
        k8, kd = _per_head(k, 1)
        v8, vd = _per_head(v, 1)
    else:
        (q8, qd), (k8, kd), (v8, vd) = ((t.astype(F32).astype(np.float64), np.ones(t.shape[0], F32)) for t in (q, k, v))
    cast_p = _e4m3 if fp8 else (lambda x: x.astype(np.float64))
    # the host rounds softmax_scale * log2(e) to float32; the device multiplies by q_descale * k_descale
    base = F32(np.float64(F32(1 / math.sqrt(d))) * math.log2(math.e))
    tiles = [(s0, min(nk, s0 + bn)) for s0 in range(0, nk, bn)][::-1]  # the last KV tile first
    out = np.zeros((h, len(rows), v.shape[-1]))
    for hi in range(h):
        j = hi // g  # the KV head of this query head
        sl2 = F32(base * F32(qd[hi] * kd[j]))
        m = np.full(len(rows), -np.inf, F32)
        rs4 = np.zeros((len(rows), 4), F32)
        acc = np.zeros((len(rows), v.shape[-1]), F32)
        for s0, s1 in tiles:
            s = (q8[hi, rows] @ k8[j, s0:s1].T).astype(F32)  # [R, keys]
            if causal:  # bottom-right: query i sees keys up to i + nk - n
                vis = np.arange(s0, s1)[None, :] <= (rows + nk - n)[:, None]
                s = np.where(vis, s, F32(-np.inf)).astype(F32)
            m_new = np.maximum(m, s.max(axis=1))
            live = np.isfinite(m_new)
            m_cur = np.where(live, m_new, F32(0)).astype(F32)  # the kernel uses 0 for a max of -inf
            rescale = _flush([_exp2_rz(x) for x in ((m - m_cur).astype(F32) * sl2).astype(F32)])
            # FFMA: m * scale_log2 - offset with one rounding
            max_scaled = np.where(live, (m_cur.astype(np.float64) * np.float64(sl2) - offset).astype(F32), F32(0))
            x = (s.astype(np.float64) * np.float64(sl2) - max_scaled.astype(np.float64)[:, None]).astype(F32)  # FFMA
            p = _flush(np.exp2(x.astype(np.float64)).astype(F32))
            padded = np.zeros((len(rows), -(-p.shape[1] // 8) * 8), F32)
            padded[:, :p.shape[1]] = p
            for t in range(4):  # thread t of the quad adds columns 8c + 2t, 8c + 2t + 1 in order
                cols = padded.reshape(len(rows), -1, 4, 2)[:, :, t, :].reshape(len(rows), -1)
                start = _flush(rs4[:, t] * rescale)[:, None]
                rs4[:, t] = np.cumsum(np.concatenate([start, cols], axis=1), axis=1, dtype=F32)[:, -1]  # sequential
            acc = (_flush(acc * rescale[:, None]) + (cast_p(p) @ v8[j, s0:s1]).astype(F32)).astype(F32)
            m = m_new
        row_sum = ((rs4[:, 0] + rs4[:, 2]).astype(F32) + (rs4[:, 1] + rs4[:, 3]).astype(F32)).astype(F32)
        inv = np.where(row_sum > 0, F32(1) / np.where(row_sum > 0, row_sum, F32(1)), F32(0)).astype(F32)
        o = (acc * (inv * vd[j]).astype(F32)[:, None]).astype(F32)
        out[hi] = o.astype(ml_dtypes.bfloat16 if fp8 else F32).astype(np.float64)
    return out


# The model rounds S and each tile's P.V once from exact sums; the emulator sums in float32 in
# BLAS order, which differs by ~sqrt(n) 2^-24 relative (n <= 224 terms). A BF16 output (ulp
# 2^-8 relative) then rounds the other way with probability ~2 sqrt(n) 2^-24 / 2^-8 < 5e-4,
# by one ulp. Measured: 0 to 2 outputs of 12032. Allowed: 0.1%, each within one BF16 ulp.
MODEL_MISMATCH = 1e-3


def _agree(o, want):
    """(fraction of outputs that differ, largest difference in BF16 ulps of the model's value)."""
    o = o[0].numpy() if isinstance(o, torch.Tensor) else o
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - 7)
    return float((o != want).mean()), float((np.abs(o - want) / ulp).max())


FAITHFUL_CASES = [
    # (heads, kv_heads, seqlen_q, seqlen_k, head_dim): MHA, GQA, MQA; seqlen_q below and above
    # seqlen_k (bottom-right causal alignment, fully masked rows); head dims 96, 192 and 256 (the
    # kernel's FP8 KV tiles 128, 160 and 128; 128 is the H200 fixture's, test_mma.py)
    (4, 4, 300, 300, 64),
    (4, 2, 500, 500, 64),
    (4, 1, 50, 300, 64),
    (4, 2, 300, 120, 64),
    (2, 2, 200, 333, 96),
    (2, 1, 200, 333, 192),
    (2, 2, 100, 300, 256),
]


def _check_faithful(h, hkv, n, nk, d, causal):
    q, k, v = _draw(h, hkv, n, nk, d, seed=d + n)
    rows = torch.arange(0, n, 9)
    want = fa3_fp8_forward(q, k, v, rows.tolist(), causal=causal, bn=FA3_FP8_BLOCK_N[d])
    o = emulate(Recipe.from_str(KERNEL32), q, k, v, q_index=rows, causal=causal)
    differ, ulps = _agree(o, want)
    assert differ <= MODEL_MISMATCH and ulps <= 1, (differ, ulps)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hkv,n,nk,d", FAITHFUL_CASES)
def test_fp8_flash_matches_the_kernel_description(h, hkv, n, nk, d, causal):
    """The emulator's fa3-fp8-kernel (float32 accumulator) against ``fa3_fp8_forward``, through
    the compiled paths: every sampled output identical but for the allowance above."""
    _check_faithful(h, hkv, n, nk, d, causal)


@pytest.mark.parametrize("h,hkv,n,nk,d", [FAITHFUL_CASES[2], FAITHFUL_CASES[4]])
def test_fp8_flash_matches_the_kernel_description_through_pytorch_paths(torch_paths, h, hkv, n, nk, d):
    """The same through the PyTorch references of the compiled softmax step, casts and rescale
    (what runs with FA3N_NATIVE=0 or on a GPU): MQA with seqlen_q < seqlen_k, head dim 96."""
    with torch_paths():
        _check_faithful(h, hkv, n, nk, d, causal=True)


@pytest.mark.parametrize("spec,at_least", [  # measured fraction of outputs that differ in brackets
    ("poff=7", 0.01),          # (0.027) P~ in [0, 128]: P~ below e4m3's normals rounds differently
    ("poff=4", 0.05),          # (0.17)
    ("order=forward", 0.3),    # (0.61) the running max meets the tiles in another order
    ("bn=128", 0.1),           # (0.23) not the kernel's tile at head dim 64
    ("out=fp32", 0.99),        # (1.0)
    ("gran=tensor", 0.3),      # (0.49)
])
def test_the_model_tells_wrong_settings_apart(qkv, spec, at_least):
    """Negative controls: with any of these the emulator leaves the model on far more than the
    allowed 0.1% of outputs, so agreement above means the settings are the kernel's."""
    q, k, v = qkv
    rows = torch.arange(0, 600, 13)
    want = fa3_fp8_forward(q, k, v, rows.tolist(), bn=160)
    o = emulate(Recipe.from_str(KERNEL32 + "," + spec), q, k, v, q_index=rows)
    assert _agree(o, want)[0] >= at_least


def test_softmax_arithmetic_is_the_kernels_to_the_last_float32_bit(paths):
    """The online softmax alone, bit for bit: integer Q and K (every S exact in float32, whatever
    the summation order) and V = I (each output column is one key's P~ times 1 / row sum, so the
    P.V sums have a single term). What remains is the kernel's float32 arithmetic: scale_log2 =
    fl32(fl32(scale) log2 e) (head dim 192: 1/sqrt(192) is not a power of two), the two FFMAs,
    exp2 rounded to nearest for P~ and toward zero for the tile rescale, the quad's row sums and
    the final division; two KV tiles of FP16-size (112 keys at head dim 192) and causal rows."""
    g = torch.Generator().manual_seed(12)
    d = nk = 192
    q = torch.randint(-3, 4, (1, 2, 40, d), generator=g).double()
    k = torch.randint(-3, 4, (1, 2, nk, d), generator=g).double()
    v = torch.eye(d, dtype=torch.float64).expand(1, 2, nk, d).contiguous()
    r = Recipe.from_str("qk=fp32,v=fp32,p=fp32,out=fp32")
    assert r.tiles(d) == (128, 112) and r.p_offset == 8
    rows = list(range(40))
    for causal in (False, True):
        want = fa3_fp8_forward(q, k, v, rows, causal=causal, bn=112, fp8=False)
        o = emulate(r, q, k, v, causal=causal)[0].numpy()
        assert np.array_equal(o, want), (causal, int((o != want).sum()))


# -- model 2: float64 attention row by row --------------------------------------------------------

def attention_by_rows(q, k, v, *, causal, scale=None):
    """softmax over the visible keys of each query row, one row at a time, in float64.
    Causal: query i (of n) sees keys j <= i + nk - n (bottom-right); a row with no visible key is 0."""
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh, vh = k[bi, hi // (h // hkv)], v[bi, hi // (h // hkv)]
            for i in range(n):
                last = i + nk - n if causal else nk - 1
                if last < 0:
                    continue
                s = (kh[:last + 1] @ q[bi, hi, i]) * scale
                w = torch.exp(s - s.max())
                out[bi, hi, i] = (w / w.sum()) @ vh[:last + 1]
    return out


@pytest.mark.parametrize("n,nk", [(12, 40), (40, 12), (33, 33)])
def test_reference_causal_alignment_is_bottom_right(n, nk):
    """FlashAttention aligns the causal mask bottom-right: with fewer queries than keys (decoding
    against a cache) the last query sees every key; with more, the first n - nk rows see none."""
    q, k, v = _draw(4, 2, n, nk, 64, seed=n * nk)
    for causal in (False, True):
        want = attention_by_rows(q, k, v, causal=causal)
        got = reference_attention(q, k, v, causal=causal)
        # same float64 arithmetic in another order: a few float64 ulps of the largest output
        assert (got - want).abs().max() <= 1e-13 * want.abs().max()
    if n > nk:
        assert torch.equal(reference_attention(q, k, v, causal=True)[:, :, :n - nk], torch.zeros(1, 4, n - nk, 64,
                                                                                                  dtype=torch.float64))


# Unquantized recipes of every algorithm: float32 arithmetic only. Bound: the row sum and the
# P.V sums run over at most nk = 96 terms and S over d = 64 products, each float32 sum
# accurate to (terms) * 2^-24 relative; 4 * (nk + d) * 2^-24 = 3.8e-5 of the largest output
# covers S, exp, the sums and the final division with room; an error of the mask or of the
# head mapping moves outputs by O(1).
ALGORITHMS = {
    "flash": "exact",
    "flash-forward": "exact,order=forward,bn=32",
    "flash-fa1": "qk=fp32,v=fp32,p=fp32,out=fp32,poff=0,norm=tile,bn=32",
    "standard": "algo=standard,qk=fp32,v=fp32,p=fp32,s=fp32,softmax=fp32,out=fp32,poff=0",
}
LAYOUTS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_algorithm_and_head_layout_is_attention(algo, layout, torch_paths):
    """Through the compiled paths; the flash algorithms also through the PyTorch ones."""
    h, hkv = LAYOUTS[layout]
    _check_algorithm(ALGORITHMS[algo], h, hkv)
    if algo.startswith("flash") and layout == "GQA":
        with torch_paths():
            _check_algorithm(ALGORITHMS[algo], h, hkv)


def _check_algorithm(spec, h, hkv):
    for n, nk, causal in ((48, 48, False), (30, 96, True), (96, 30, True)):
        q, k, v = _draw(h, hkv, n, nk, 64, seed=n + nk)
        want = attention_by_rows(q, k, v, causal=causal)
        o = emulate(Recipe.from_str(spec), q, k, v, causal=causal)
        assert o.shape == want.shape
        assert (o - want).abs().max() <= 4 * (nk + 64) * U32 * want.abs().max(), (n, nk, causal)
        if causal and n > nk:  # rows that see no key are 0, not NaN
            assert torch.equal(o[:, :, :n - nk], torch.zeros_like(o[:, :, :n - nk]))


def test_no_quantization_equals_reference_to_float32_rounding(qkv):
    q, k, v = qkv
    for causal in (False, True):
        ref = reference_attention(q, k, v, causal=causal)
        out = emulate(EXACT, q, k, v, causal=causal)
        # bound as above with nk = 600: 4 * 664 * 2^-24 = 1.6e-4; measured 1e-6
        assert (out - ref).abs().max() <= 4 * (600 + 64) * U32 * ref.abs().max()
        # the FP8 emulation is far from it, so the comparison can tell them apart
        fp8 = emulate(Recipe.from_str(KERNEL32), q, k, v, causal=causal)
        assert (fp8 - ref).abs().max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize("bn", [32, 100, 1000])
def test_tile_size_and_order_do_not_change_exact_attention(qkv, bn):
    q, k, v = qkv
    base = emulate(EXACT, q, k, v)
    # Tiles change only the float32 rounding: the row sum is four sequential float32 sums of
    # nk/4 positive terms each (relative error <= nk/4 * 2^-24 per sum, the worst case), and O
    # is a sum of rescaled partial products with the same bound; two emulations can differ by
    # twice that.
    bound = 2 * (k.shape[2] / 4) * U32
    for order in ("reverse", "forward"):
        r = Recipe.from_str(f"exact,bn={bn},order={order}")
        assert (emulate(r, q, k, v) - base).abs().max() < bound * base.abs().max()


def test_query_subset_gives_same_rows():
    """Query rows are independent given the quantized K and V: a sample of rows is bit for bit
    the same rows of a full run, for every preset. (baseline-fp8's per-tensor P scale is the
    amax of P over the evaluated rows: 1.0 in both row sets here, as rows with one dominant key
    give all of the FP16 softmax to it; checked below.)"""
    q, k, v = generate("outliers", AttnShape(1, 2, 300, 64, kv_heads=1), 0, p=0.01, sigma=10.0)
    idx = torch.tensor([0, 17, 150, 299])
    s = q[:, :, idx] @ k.transpose(-1, -2) / 8
    assert (torch.softmax(s, -1).amax() > 1 - 2.0 ** -12).item()  # rounds to 1.0 in FP16
    for name in PRESETS:
        r = Recipe.from_str(name)
        full = emulate(r, q, k, v, causal=True)
        part = emulate(r, q, k, v, causal=True, q_index=idx)
        assert torch.equal(part, full[:, :, idx]), name


def test_output_is_the_bf16_rounding_of_the_float32_result(qkv, paths):
    """out=bf16 (FP8 in) rounds the float32 O once to BF16 (ml_dtypes: round to nearest even);
    out=fp16 to FP16. The float32 O is the out=fp32 run of the same recipe."""
    q, k, v = qkv
    rows = torch.arange(0, 600, 11)
    o32 = emulate(Recipe.from_str(KERNEL32 + ",out=fp32"), q, k, v, q_index=rows)
    for out, dt in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)):
        o = emulate(Recipe.from_str(KERNEL32 + f",out={out}"), q, k, v, q_index=rows)
        assert np.array_equal(o.numpy(), o32.numpy().astype(np.float32).astype(dt).astype(np.float64))
    assert PRESETS["fa3-fp8"].recipe.out == "bf16" and PRESETS["fa3-fp8-kernel"].recipe.out == "bf16"


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
    # (P |V|) / l: the size of the terms an output sums, which bounds its float32 summation error
    return (p8 @ vd) / pt.sum(-1, keepdim=True), s.argmax(-1), (p8 @ vd.abs()) / pt.sum(-1, keepdim=True)


def test_fp8_emulation_close_to_a_single_pass_model(qkv):
    """The single-pass model rounds P~ against the row's global max. Rows whose max lies in the
    last KV tile (visited first) meet that max in the emulator's first tile too, so their P~ are
    the same numbers: the two agree to float32 rounding there (bound 2 * nk * 2^-24 = 7e-5 of
    the summed terms' size (P |V|) / l, the float32 dot product's error bound: sums of <= 600
    terms; median 2e-7), except where a P~ lies so near an e4m3 rounding midpoint that float32
    and float64 S round it apart (one e4m3 step, <= 2^-4 of the size: 2 of 468 rows, 0.4%;
    bound 1%). A forward tile order or another P offset moves most of those rows by e4m3
    roundings (measured 91% and 46% of them; bounds 50% and 20%). Over all rows the error budget is the
    same: measured ratio 1 - 3e-4 (BF16 output rounding adds (1.5%)^2 / 2 in quadrature, the rest
    is P rounded under running maxima); bound 0.5%, which v=e5m2 (one mantissa bit less on V)
    does not meet."""
    q, k, v = qkv
    ref = reference_attention(q, k, v)
    ind, argmax, size = naive_fp8_per_head(q, k, v, 1 / 8)
    last = argmax >= 480  # KV tiles of 160: the last holds keys 480..599
    assert 100 < int(last.sum()) < 2300

    def rel_rows(spec):
        o = emulate(Recipe.from_str(KERNEL32 + ",out=fp32" + spec), q, k, v)
        return ((o - ind).abs() / size).amax(-1)

    bound = 2 * 600 * U32
    same = rel_rows("")
    assert (same[last] > bound).double().mean() <= 0.01 and same[last].max() <= 2 ** -4
    assert same[~last].median() > 10 * bound  # elsewhere P~ is rounded against other maxima
    assert (rel_rows(",order=forward")[last] > bound).double().mean() > 0.5
    assert (rel_rows(",poff=7")[last] > bound).double().mean() > 0.2

    def budget(spec):
        emu = emulate(Recipe.from_str(KERNEL32 + spec), q, k, v)
        return per_sample(emu, ref)["rmse"].mean() / per_sample(ind, ref)["rmse"].mean()

    assert abs(budget("") - 1) < 0.005
    assert abs(budget(",v=e5m2") - 1) > 0.005


def test_p_offset_protects_against_p_collapse():
    """An attention sink 8 nats above every other key: P in [0, 1] underflows in e4m3 for the
    other keys (P-collapse, arXiv 2606.06521), FA3's P~ in [0, 256] keeps them. With the offset
    the other keys' P~ (~256 e^-8 = 0.09) are e4m3 normals (relative rounding <= 2^-4); without
    it (3e-4) they sit below e4m3's smallest subnormal step 2^-9 and round to 0 or 2^-9
    (relative error ~1 on the non-sink mass). Measured ratio 7.6; bound 3."""
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
    """The paper's finding (Table 3): incoherent processing spreads the outliers of Q and K, so
    per-head FP8 of rotated inputs has a lower error (paper: 2.4e-2 -> 9.1e-3 with block scales;
    H200 kernel per head at seqlen 1024: 1.41e-2 -> 8.40e-3, ratio 0.60). Bound 0.8."""
    q, k, v = generate("outliers", AttnShape(1, 4, 1024, 128), 1, p=0.001, sigma=10.0)
    idx = torch.arange(0, 1024, 2)
    ref = reference_attention(q, k, v, q_index=idx)
    e = {n: per_sample(emulate(Recipe.from_str(n + ",acc=fp32"), q, k, v, q_index=idx), ref)["rmse"].mean()
         for n in ("fa3-fp8-kernel", "fa3-fp8-kernel-hadamard")}
    assert e["fa3-fp8-kernel-hadamard"] < 0.8 * e["fa3-fp8-kernel"]


def test_fully_masked_rows_are_zero_not_nan(paths):
    """Causal with more queries than keys: the first rows see no key (FlashAttention gives 0)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 20, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 10, 64, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 10, 64, generator=g, dtype=torch.float64)
    for name in ("fa3-fp8-kernel", KERNEL32, "exact", "baseline-fp8", "fa1-fp16"):
        o = emulate(Recipe.from_str(name), q, k, v, causal=True)
        assert torch.isfinite(o).all(), name
        assert torch.equal(o[0, 0, :10], torch.zeros_like(o[0, 0, :10])), name
        assert (o[0, 0, 10:] != 0).any(), name


def test_standard_fp16_matches_pytorch_math_sdpa():
    """baseline-fp16 emulates PyTorch's math SDPA in half precision (sqrt(scale) on Q and K,
    S and P in FP16): an independent implementation, run here on the CPU. The emulator does
    not follow torch's CPU kernels' float32 accumulation order inside the FP16 softmax and
    P.V, which moves an FP16 rounding now and then: measured 89 of 21888 outputs (0.41%).
    Bound 1%; the negative control (the scale applied after Q K^T) differs on 59%."""
    from fa3_numerics.engine.backends import get_backend

    q, k, v = generate("outliers", AttnShape(1, 2, 512, 64), 5, p=0.01, sigma=10.0)
    idx = torch.arange(0, 512, 3)
    sdpa = get_backend("sdpa-math")
    if sdpa.check("cpu") is not None:
        pytest.skip(sdpa.check("cpu"))
    recipe = PRESETS["baseline-fp16"].recipe
    hw = sdpa.attention(recipe, q, k, v, causal=False, q_index=idx, rotation_seed=0, cache={})
    differ = (emulate(recipe, q, k, v, q_index=idx) != hw).double().mean().item()
    assert differ < 0.01, differ
    after = (emulate(Recipe.from_str("baseline-fp16,sscale=after"), q, k, v, q_index=idx) != hw).double().mean().item()
    assert after > 0.3, after


# -- heavy outliers, flush to zero, every head layout -----------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_per_tensor_p_scale_keeps_or_recomputes_the_softmax_alike(qkv, causal, monkeypatch):
    """baseline-fp8's per-tensor P scale needs P's amax before P V: the softmax rows of the
    amax pass are kept (FP16, exact) or, past the memory cap, recomputed. All, some or none kept
    give the same bits; rows kept under the wrong (batch, head, chunk) would not."""
    from fa3_numerics.numerics import emulator as em

    q, k, v = qkv
    recipe = PRESETS["baseline-fp8"].recipe
    monkeypatch.setattr(em, "_STD_CHUNK_ELEMS", 70 * 600)  # 3 row chunks per head
    rows = torch.arange(0, 600, 3)
    kept = emulate(recipe, q, k, v, causal=causal, q_index=rows)
    monkeypatch.setattr(em, "_P_KEEP_BYTES", 5 * 70 * 600 * 2)  # 5 of the 12 blocks kept, 7 recomputed
    some = emulate(recipe, q, k, v, causal=causal, q_index=rows)
    monkeypatch.setattr(em, "_P_KEEP_BYTES", 0)
    again = emulate(recipe, q, k, v, causal=causal, q_index=rows)
    assert torch.equal(kept, again) and torch.equal(some, again) and kept.isfinite().all()
    swapped = emulate(recipe, q, k, v.flip(1), causal=causal, q_index=rows)
    assert not torch.equal(kept, swapped)


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


def test_flush_to_zero_drops_a_row_rescaled_below_float32_normals(paths):
    """At 95 nats the rescale factor exp2(-137) is a float32 subnormal: the kernel (built with
    --use_fast_math) flushes it to 0, so O is exactly 0; IEEE arithmetic (ftz=0) leaves a
    subnormal O. At 60 nats (2^-87, normal) both keep the same tiny O, which is the ordinary
    keys' mean V times the rescale factor and the sink's share."""
    base = "qk=fp32,v=fp32,p=fp32,out=fp32,poff=0,bn=64"
    q, k, v = _sink_then_rest(95.0)
    ftz = emulate(Recipe.from_str(base), q, k, v)
    ieee = emulate(Recipe.from_str(base + ",ftz=0"), q, k, v)
    assert torch.equal(ftz, torch.zeros_like(ftz))
    assert (ieee != 0).any() and ieee.abs().max() < 2.0 ** -126
    q, k, v = _sink_then_rest(60.0)
    ftz, ieee = (emulate(Recipe.from_str(base + s), q, k, v) for s in ("", ",ftz=0"))
    assert torch.equal(ftz, ieee) and (ftz != 0).any()
    want = reference_attention(q, k, v)
    assert ((ftz - want).abs().max() / want.abs().max()).item() < 1e-4


def test_a_key_100_nats_above_the_rest_keeps_every_output_finite(paths):
    """Issue 15: with one key ~100 nats above the rest, the Hopper MMA model met a float32
    subnormal accumulator (O rescaled by e^-100 with ftz=0) in a k-step whose products were all
    zero (the sink's V is 0, the keys beside it underflow), and gave NaN for every output.
    With or without the kernel's flush the output is 0: the true O, ~e^-100 = 2^-144 times the
    ordinary keys' values, lies below BF16's smallest subnormal (2^-133)."""
    q, k, v = _sink_then_rest(100.0)
    assert reference_attention(q, k, v).abs().max() < 2.0 ** -133
    for spec in ("fa3-fp8-kernel,bn=64", "fa3-fp8-kernel,bn=64,ftz=0", "fa3-fp8-kernel,bn=64,ftz=0,acc=two-level"):
        o = emulate(Recipe.from_str(spec), q, k, v)
        assert torch.equal(o, torch.zeros_like(o)), spec


def _preset_bound(r: Recipe) -> float:
    """Relative RMSE a preset may reach on the toy outlier data below. 16-bit operands: 4 units
    of FP16 roundoff (4 * 2^-11 = 2e-3; measured up to 1.1e-3), of BF16's for BF16 (1.6e-2; measured
    5.4e-3). FP8/INT8: the e4m3 roundoff 2^-4
    amplified by amax-scaled outliers (sigma 10 puts a scale group's amax ~30x above its typical
    entry); on these 9 rows x 4 heads it varies with the draw: measured up to 0.15 over the 30
    shapes (0.087 with the stream before the outlier positions were drawn as geometric gaps):
    bound 0.25, under the ~1.4 of an output unrelated to the reference. 4-bit Q/K/V (INT4, NVFP4)
    keep 3 levels or fewer for typical entries next to an outlier: error of the order of the
    output (measured up to 1.08): bound 1.5, which checks only that they run and stay finite."""
    ops = (r.qk, r.v, r.p)
    if all(f == "fp32" for f in ops):
        return 1e-5
    if all(f == "fp16" for f in ops):
        return 2e-3
    if all(f in ("fp16", "bf16") for f in ops):  # BF16: 4 units of its roundoff, 4 * 2^-8
        return 1.6e-2
    if any(f in ("int4", "nvfp4") for f in ops):
        return 1.5
    return 0.25


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, pytest.param(96, marks=pytest.mark.slow), pytest.param(128, marks=pytest.mark.slow),
                               pytest.param(192, marks=pytest.mark.slow), pytest.param(256, marks=pytest.mark.slow)])
def test_every_preset_runs_every_head_layout(heads, kv_heads, causal, d):
    """Every preset x {MHA, GQA, MQA} x {causal, not} x every supported head dim, at toy size:
    outputs of the right shape, finite, and within the preset's error bound of float64
    attention (``_preset_bound``). (MQA crashed the standard algorithm with a shape error before.)"""
    q, k, v = generate("outliers", AttnShape(1, heads, 80, d, kv_heads=kv_heads), 1, p=0.01, sigma=10.0)
    idx = torch.arange(0, 80, 9)
    ref = reference_attention(q, k, v, causal=causal, q_index=idx)
    cache = {}
    for name in PRESETS:
        r = Recipe.from_str(name + ",acc=fp32" if "kernel" in name else name)
        o = emulate(r, q, k, v, causal=causal, q_index=idx, cache=cache)
        assert o.shape == ref.shape, name
        assert torch.isfinite(o).all(), name
        rel = ((o - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
        assert rel < _preset_bound(r), (name, rel)


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


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_block_scales_follow_the_kernel_tiles(d):
    """The paper's block quantization is aligned to the kernel's tiles: one Q descale per kBlockM
    rows and one K (and V) descale per kBlockN keys (kBlockN from FA3's table above), each the
    smallest power of two >= the block's amax / 448 (fa3-fp8-no-incoherent: no rotation, so the
    amax is the input's)."""
    n = 400
    q, k, v = generate("outliers", AttnShape(1, 2, n, d), 3, p=0.01, sigma=10.0)
    r = PRESETS["fa3-fp8-no-incoherent"].recipe
    bm, bn = r.tiles(d)
    assert bn == FA3_FP8_BLOCK_N[d]
    pre = prepare(r, q, k, v, q_index=torch.arange(n))
    for x, t, block in ((q, pre.q, bm), (k, pre.k, bn), (v, pre.v, bn)):
        dsc = t.descale[0, 0, :, 0].double()
        assert dsc.shape == (n,)
        for s0 in range(0, n, block):
            amax = x[0, 0, s0:s0 + block].abs().max().item()
            want = 2.0 ** math.ceil(math.log2(amax / 448))
            assert (dsc[s0:s0 + block] == want).all(), (s0, block)


# -- the quad's row sums, in the kernel's order ------------------------------------------------------

def test_quad_row_sum_columns_and_order():
    """Thread t of the quad holding a row adds columns 8j + 2t and 8j + 2t + 1, in that order, to
    its own float32 sum (FA3's reduce_sum over the wgmma accumulator layout). Pinned by where a
    lone 1 lands, and by rounding: 1 + 2^-24 rounds to 1 (a tie, to even) and then + 2^-23 gives
    1 + 2^-23; adding 2^-23 first would give 1 + 2^-23 + 2^-24, a tie that rounds up to 1 + 2^-22."""
    from fa3_numerics.numerics.emulator import _quad_row_sum

    for c in range(20):
        p = torch.zeros(1, 20)
        p[0, c] = 1.0
        want = torch.zeros(1, 4)
        want[0, (c % 8) // 2] = 1.0
        assert torch.equal(_quad_row_sum(torch.zeros(1, 4), p), want), c
    p = torch.zeros(1, 8)
    p[0, 0], p[0, 1] = 2.0 ** -24, 2.0 ** -23
    got = _quad_row_sum(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), p)
    assert got[0, 0].item() == 1.0 + 2.0 ** -23


def test_quad_total_adds_the_partial_sums_as_the_shuffles_do():
    """The final reduction: shuffle-xor by 2 pairs threads (0, 2) and (1, 3), then by 1:
    (s0 + s2) + (s1 + s3). With s = (2^24, 1, 0, 1) that is 2^24 + 2 exactly; a sequential sum
    would lose both 1s (2^24 + 1 is a tie that rounds to 2^24)."""
    from fa3_numerics.numerics.emulator import _quad_total

    rs4 = torch.tensor([[2.0 ** 24, 1.0, 0.0, 1.0]])
    assert _quad_total(rs4).item() == 2.0 ** 24 + 2


def test_prepare_cache_shares_unscaled_kv_across_tile_sizes():
    """FP16 K and V are a plain cast, the same for every tile size: recipes that differ only in bn
    share them in the prepare cache (the Table 3 FP16 rows), and every output equals the one
    computed without a cache. Scaled FP8 per-block operands depend on bn and are not shared."""
    from fa3_numerics.numerics.emulator import prepare

    q, k, v = generate("outliers", AttnShape(1, 2, 256, 64), 3, p=0.01, sigma=10.0)
    idx = torch.arange(0, 256, 7)
    cache = {}
    names = ("baseline-fp16", "fa2-fp16", "fa3-fp16", "fa3-fp8", "fa3-fp8,bn=64")
    pre = {n: prepare(Recipe.from_str(n), q, k, v, q_index=idx, cache=cache) for n in names}
    assert pre["fa2-fp16"].k.values is pre["fa3-fp16"].k.values is pre["baseline-fp16"].k.values
    assert pre["fa2-fp16"].v.values is pre["fa3-fp16"].v.values
    assert pre["fa3-fp8"].k.values is not pre["fa3-fp8,bn=64"].k.values  # per-block descales of other rows
    assert not torch.equal(pre["fa3-fp8"].k.descale.expand(1, 2, 256, 1), pre["fa3-fp8,bn=64"].k.descale.expand(1, 2, 256, 1))
    shared = {}
    for n in names:
        r = Recipe.from_str(n)
        with_cache = emulate(r, q, k, v, q_index=idx, cache=shared)
        assert torch.equal(with_cache.view(torch.int64), emulate(r, q, k, v, q_index=idx).view(torch.int64)), n
