"""The sage1 backend (SageAttention 1's Triton kernel) and the emulator's model of it.

CPU: the refusal without a GPU or the package, the recipe per validation case and the shape
skips; the emulator against an independent NumPy transcription of ``sageattn``; the emulator's
quantizer, FP16 wgmma model and whole output against the kernel's own outputs from an H200
(tests/fixtures/sage1_h200.npz, from tools/device/sage_h200.py: probes, Q codes of the paper-shape
case, the n-333 case at 128 rows). GPU (skipped here): the backend against the emulator.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fa3_numerics.engine.backends import backend_table, get_backend, refusal
from fa3_numerics.errors import UsageError
from fa3_numerics.kernels.sage import HEAD_DIMS, kernel_problem
from fa3_numerics.numerics import sage_quant
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import Recipe, get_recipe
from fa3_numerics.studies.validate import Case, case_recipe, grid, skips

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "sage1_h200.npz"
SAGE = get_recipe("sage1").recipe


def _kernel_ok() -> bool:
    return kernel_problem("cuda") is None


# -- refusals, listing, recipes -------------------------------------------------------------

@pytest.mark.skipif(_kernel_ok(), reason="the SageAttention kernel can run here")
def test_refusal_names_what_is_missing_and_the_fix():
    why = get_backend("sage1").check("cuda")
    assert why is not None and "\n" not in why
    assert "--backend emulate" in why
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in why
    import importlib.util

    if importlib.util.find_spec("sageattention") is None:
        assert "pip install sageattention==1.0.6" in why


def test_backends_lists_sage1_with_its_reason():
    rows = {r["name"]: r for r in backend_table("cpu")}
    assert rows["sage1"]["hardware"]
    assert rows["sage1"]["usable"] == _kernel_ok() or rows["sage1"]["why"]


def test_recipe_per_case_and_skips():
    b = get_backend("sage1")
    cases = grid("small")
    why = skips(cases, b)
    for c, w in zip(cases, why):
        if c.head_dim not in HEAD_DIMS:
            assert "head dim" in w
        if not w:
            r = case_recipe(c, backend=b)
            assert refusal(b, r) is None
            assert r.inp == r.out == ("bf16" if c.dtype == "bf16" else "fp16")
    # the gran=tensor twin of the base case repeats it on this kernel
    assert why[2].startswith("same recipe and inputs as case " + cases[0].name)
    # FA3's recipe for the same case is refused, with the reason
    assert "sageattn computes" in refusal(b, case_recipe(cases[0]))
    assert "accumulates P V in FP16" in b.supports(Recipe.from_str("sage1,acc=fp32"))


def test_attention_refuses_on_the_cpu():
    b = get_backend("sage1")
    q = torch.zeros(1, 1, 64, 64, dtype=torch.float64)
    with pytest.raises(UsageError, match="head dim 256"):
        b.attention(SAGE, torch.zeros(1, 1, 64, 256), torch.zeros(1, 1, 64, 256), torch.zeros(1, 1, 64, 256),
                    causal=False, q_index=torch.arange(64), rotation_seed=0, cache={})
    with pytest.raises(UsageError, match="CUDA device"):
        b.attention(SAGE, q, q, q, causal=False, q_index=torch.arange(64), rotation_seed=0, cache={})


def test_iquant_and_loop_go_together():
    with pytest.raises(UsageError, match="iquant=triton"):
        Recipe.from_str("sage1,loop=fa3,kpad=mask")
    # the loop itself takes any quantizer (the attribution's float32 recipe keeps loop=triton)
    q = torch.randn(1, 1, 100, 64, dtype=torch.float64)
    exact = emulate(Recipe.from_str("qk=fp32,v=fp32,p=fp32,out=fp32,loop=triton,order=forward,bn=64,bm=128,poff=0"),
                    q, q, q)
    from fa3_numerics.numerics.reference import reference_attention

    assert float((exact - reference_attention(q, q, q)).abs().max()) < 1e-5


# -- an independent transcription of sageattn (NumPy) ---------------------------------------

f16, f32, f64 = np.float16, np.float32, np.float64


def _np_quant(x16, blk, c):
    x = x16.astype(f32) * f32(c)
    b, h, n, d = x.shape
    nb = -(-n // blk)
    codes = np.zeros(x.shape, np.int8)
    scales = np.zeros((b, h, nb, 1), f32)
    for i in range(nb):
        xb = x[:, :, i * blk:(i + 1) * blk]
        s = (np.abs(xb).max(axis=(2, 3), keepdims=True) * f32(1 / 127.0)).astype(f32)
        r = (1.0 / s.astype(f64)).astype(f32)
        y = (xb * r).astype(f32)
        y = (y + np.where(y >= 0, f32(0.5), f32(-0.5))).astype(f32)
        codes[:, :, i * blk:(i + 1) * blk] = np.trunc(y).astype(np.int8)
        scales[:, :, i] = s[..., 0]
    return codes, scales


def _exp2_rz(x):
    r = np.exp2(x.astype(f64))
    y = r.astype(f32)
    return np.where(np.abs(y.astype(f64)) > np.abs(r), np.nextafter(y, f32(0)), y).astype(f32)


def _np_sageattn(q16, k16, v16, causal, sm):
    """sageattn (smooth_k=True) line by line in NumPy float32/float16, one FP16 rounding of the
    exact sum per 16 keys (acc=fp16)."""
    km = k16.astype(f64).mean(axis=2, keepdims=True).astype(f16)
    ks = (k16.astype(f64) - km.astype(f64)).astype(f16)
    qc, qs = _np_quant(q16, 128, sm * 1.44269504)
    kc, kscale = _np_quant(ks, 64, 1.0)
    b, h, n, d = q16.shape
    g = h // k16.shape[1]
    out = np.zeros((b, h, n, d), f16)
    for bi in range(b):
        for hi in range(h):
            kh = hi // g
            for m0 in range(0, n, 128):
                rows = np.arange(m0, min(n, m0 + 128))
                q = qc[bi, hi, rows].astype(f64)
                mi = np.full((len(rows), 1), -np.inf, f32)
                li = np.ones((len(rows), 1), f32)
                acc = np.zeros((len(rows), d), f32)
                hi_key = min(n, m0 + 128) if causal else n
                for s0 in range(0, hi_key, 64):
                    s1 = min(n, s0 + 64)
                    sint = q @ kc[bi, kh, s0:s1].astype(f64).T
                    t = (sint * qs[bi, hi, m0 // 128, 0]).astype(f32)
                    ksc = kscale[bi, kh, s0 // 64, 0]
                    qk = (t * ksc).astype(f32)
                    tt, kk = t, np.full_like(t, ksc)
                    if not causal and s1 - s0 < 64:  # keys past the end: score 0, V 0
                        pad = 64 - (s1 - s0)
                        qk, tt = np.pad(qk, ((0, 0), (0, pad))), np.pad(t, ((0, 0), (0, pad)))
                        kk = np.pad(kk, ((0, 0), (0, pad)), constant_values=1)
                    vis = np.ones(qk.shape, bool)
                    if causal:
                        vis = np.arange(s0, s1)[None, :] <= rows[:, None]
                    mnew = np.maximum(mi, np.where(vis, qk, -np.inf).max(axis=1, keepdims=True))
                    if causal and s0 >= m0:
                        x = (qk - mnew).astype(f32)
                    else:
                        x = (tt.astype(f64) * kk.astype(f64) - mnew.astype(f64)).astype(f32)
                    p = np.where(vis, np.exp2(x.astype(f64)).astype(f32), f32(0))
                    alpha = _exp2_rz((mi - mnew).astype(f32))
                    part = np.pad(p, ((0, 0), (0, 64 - p.shape[1]))).reshape(len(rows), -1, 4, 2)
                    rs = np.zeros((len(rows), 4), f32)
                    for j in range(part.shape[1]):
                        rs = (rs + part[:, j, :, 0]).astype(f32)
                        rs = (rs + part[:, j, :, 1]).astype(f32)
                    row = ((rs[:, 0] + rs[:, 2]).astype(f32) + (rs[:, 1] + rs[:, 3]).astype(f32)).astype(f32)[:, None]
                    li = (li.astype(f64) * alpha.astype(f64) + row.astype(f64)).astype(f32)
                    p16 = p[:, :s1 - s0].astype(f16).astype(f64)
                    vt = v16[bi, kh, s0:s1].astype(f64)
                    d16 = np.zeros((len(rows), d), f64)
                    for k0 in range(0, s1 - s0, 16):
                        d16 = (d16 + p16[:, k0:k0 + 16] @ vt[k0:k0 + 16]).astype(f16).astype(f64)
                    acc = (acc.astype(f64) * alpha.astype(f64) + d16).astype(f32)
                    mi = mnew
                inv = (1.0 / li.astype(f64)).astype(f32)
                out[bi, hi, rows] = (acc * inv).astype(f32).astype(f16)
    return out


@pytest.mark.parametrize("causal,n,h,hkv", [(False, 200, 2, 1), (True, 300, 2, 2)])
def test_emulator_is_the_numpy_transcription(monkeypatch, causal, n, h, hkv):
    monkeypatch.setattr(sage_quant, "_RCP", {"cpu": None})  # the transcription rounds 1/y to nearest
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, h, n, 64, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, hkv, n, 64, generator=g, dtype=torch.float64) + 3  # a K bias: smoothing matters
    v = torch.randn(1, hkv, n, 64, generator=g, dtype=torch.float64)
    sm = 1 / math.sqrt(64)
    want = _np_sageattn(q.numpy().astype(f16), k.numpy().astype(f16), v.numpy().astype(f16), causal, sm)
    # sfu=rz: the transcription takes exp2 as the stand-in does (the preset's sfu=h200 models the
    # instruction's own bits, tests/numerics/test_sfu.py)
    got = emulate(Recipe.from_str("sage1,acc=fp16,sfu=rz"), q, k, v, causal=causal, softmax_scale=sm).numpy()
    assert np.array_equal(got, want.astype(f64))
    # negative control: the padding keys masked instead changes the non-causal outputs
    if not causal:
        other = emulate(Recipe.from_str("sage1,acc=fp16,kpad=mask"), q, k, v, softmax_scale=sm).numpy()
        assert not np.array_equal(other, want.astype(f64))


# -- against the kernel's outputs from an H200 ----------------------------------------------

@pytest.fixture(scope="module")
def h200():
    with np.load(DATA) as z:
        return {k: z[k] for k in z.files}


def test_quantizer_matches_the_kernel_codes(h200):
    """Head 1 of the paper-shape case: the scales exactly, all but at most 63 of 262,144 codes
    (one block's hardware reciprocal differs from the rounded one; the table fixes it), and
    far fewer misses than IEEE division gives for the scales."""
    c = Case()
    from fa3_numerics.engine.inputs import DistInputs

    dist, params = c.data()
    q = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim, c.seed).draw()[0]
    q16 = q[:, 1:2].to(torch.float16).to(torch.float64)
    from fa3_numerics.numerics.granularity import PerBlock

    got = sage_quant.triton_quantize_int(q16, "int8", PerBlock(), block_rows=128,
                                         scale=(1 / math.sqrt(128)) * sage_quant.LOG2E_SAGE)
    scales = got.descale[0, 0, ::128, 0].numpy()
    assert np.array_equal(scales, h200["q_head1_scale"][0, 0, :, 0])
    miss = int((got.values.numpy() != h200["q_head1_codes"]).sum())
    assert miss <= 63
    x32 = q16.to(torch.float32) * torch.tensor((1 / math.sqrt(128)) * sage_quant.LOG2E_SAGE, dtype=torch.float32)
    ieee = (x32[0, 0].reshape(16, 128, 128).abs().amax(dim=(1, 2)).double() / 127).float().numpy()
    assert (ieee != h200["q_head1_scale"][0, 0, :, 0]).any()  # IEEE division misses some scales


def _probe_tiles(h200, kind):
    q8 = torch.from_numpy(h200[f"{kind}_q8"]).double()[0]
    k8 = torch.from_numpy(h200[f"{kind}_k8"]).double()[0]
    s = (q8 @ k8.transpose(-1, -2) * float(h200[f"{kind}_qs"].ravel()[0])).float().double()
    p32 = torch.exp2(s - s.amax(-1, keepdim=True)).float()
    l = p32.double().sum(-1, keepdim=True)
    d_kernel = (torch.from_numpy(h200[f"{kind}_o"]).double()[0] * l).to(torch.float16).double()
    return p32.to(torch.float16).float(), torch.from_numpy(h200[f"{kind}_v16"]).float()[0], d_kernel


@pytest.mark.parametrize("kind", ["pow2", "gen"])
def test_fp16_wgmma_model_matches_the_kernel(h200, kind):
    from fa3_numerics.numerics.accumulators import fp16_hopper_mma

    p, v, want = _probe_tiles(h200, kind)
    got = fp16_hopper_mma(p, v).double()
    same = (got == want) | (~torch.isfinite(got) & ~torch.isfinite(want))
    assert same.double().mean() >= 0.9995
    assert (~torch.isfinite(want)).any()  # head 3 overflows FP16, as the model does
    # negative control: a float32 sum rounded once to FP16 misses about a third
    once = (p.double() @ v.double()).to(torch.float16).double()
    assert ((once == want) | (~torch.isfinite(once) & ~torch.isfinite(want))).double().mean() < 0.8


def test_emulator_matches_the_kernel_on_a_ragged_case(h200):
    """Small grid's n-333 case (5 full tiles and 13 keys): F <= 0.01 with the preset; masking the
    padding keys (kpad=mask) misses by far, the kernel's padding finding."""
    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.numerics.reference import reference_attention

    c = Case(seqlen=333)
    dist, params = c.data()
    q, k, v = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                         c.seed).draw()
    rows = torch.from_numpy(h200["n333_rows"])
    kern = torch.from_numpy(h200["n333_o"].astype(np.float64))
    ref = reference_attention(q, k, v, q_index=rows)
    rk = ((kern - ref) ** 2).mean().sqrt()

    def fidelity(spec):
        o = emulate(Recipe.from_str(spec), q, k, v, q_index=rows, rotation_seed=c.seed)
        return float(((o - kern) ** 2).mean().sqrt() / rk)

    assert fidelity("sage1") <= 0.01
    assert fidelity("sage1,kpad=mask") > 0.1


# -- on a GPU with the kernel ---------------------------------------------------------------

needs_kernel = pytest.mark.skipif(not _kernel_ok(), reason=f"sageattn cannot run here: {kernel_problem('cuda')}")


@needs_kernel
@pytest.mark.parametrize("causal,n,d", [(False, 1000, 128), (True, 1000, 64), (False, 777, 96)])
def test_kernel_matches_the_emulator_on_the_gpu(causal, n, d):
    from fa3_numerics.numerics.reference import reference_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, n, d, generator=g, dtype=torch.float64).cuda() for _ in range(3))
    rows = torch.arange(n, device="cuda")
    o = get_backend("sage1").attention(SAGE, q, k, v, causal=causal, q_index=rows, rotation_seed=0, cache={})
    e = emulate(SAGE, q, k, v, causal=causal)
    ref = reference_attention(q, k, v, causal=causal)
    assert float(((o - e) ** 2).mean().sqrt() / ((o - ref) ** 2).mean().sqrt()) <= 0.01


@needs_kernel
def test_kernel_refuses_head_dim_256_as_the_backend_says():
    from sageattention import sageattn

    x = torch.zeros(1, 1, 64, 256, dtype=torch.float16, device="cuda")
    with pytest.raises(AssertionError, match="headdim"):
        sageattn(x, x.clone(), x)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_kernel_inputs_are_the_emulators_once_rounded_values(fmt):
    # The kernel must be handed exactly the values the emulator quantizes: one rounding of the float64
    # input (torch's float64 -> FP16 cast rounds twice, through float32: a negative control).
    import dataclasses

    from fa3_numerics.kernels.sage import kernel_inputs
    from fa3_numerics.numerics.recipe import get_recipe
    from fa3_numerics.numerics.sage_quant import input_round

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4096, 64, generator=g, dtype=torch.float64) * 30 for _ in range(3))
    r = dataclasses.replace(get_recipe("sage1").recipe, inp=fmt, out=fmt)
    for x, got in zip((q, k, v), kernel_inputs(r, q, k, v, 0)):
        assert torch.equal(got.to(torch.float64), input_round(x, fmt))
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    assert not torch.equal(q.to(dtype).to(torch.float64), input_round(q, fmt))  # the double rounding it avoids
