"""The sage2 backend (SageAttention2's sm90 CUDA kernel) and the emulator's model of it (sage2-sm90).

CPU: the refusal without a GPU or a built package (and with a bad FA3N_SAGE2_PATH), the listing,
the recipe per validation case and the shape skips, the backend's call with a stand-in kernel;
the per-thread INT8 quantizer against an independent NumPy model on one tile, and the whole
emulator against an independent NumPy transcription of the kernel's loop (the P V product of each
tile through the package's FP8 MMA model, everything else in NumPy). GPU (skipped here): the
backend against the emulator, and the kernel's NaN on an all-zero V channel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fa3_numerics.engine.backends import backend_table, get_backend, refusal
from fa3_numerics.errors import UsageError
from fa3_numerics.kernels import sage2 as sage2_mod
from fa3_numerics.kernels.sage2 import HEAD_DIM_MAX, PATH_ENV, kernel_problem
from fa3_numerics.numerics import sage_quant
from fa3_numerics.numerics.emulator import emulate, prepare
from fa3_numerics.numerics.granularity import PerThread
from fa3_numerics.numerics.recipe import Recipe, get_recipe
from fa3_numerics.studies.validate import case_recipe, grid, skips

SAGE2 = get_recipe("sage2-sm90").recipe
f16, f32, f64 = np.float16, np.float32, np.float64


def _kernel_ok() -> bool:
    try:
        return kernel_problem("cuda") is None
    except UsageError:
        return False


# -- refusals, listing, recipes -------------------------------------------------------------

@pytest.mark.skipif(_kernel_ok(), reason="the SageAttention2 kernel can run here")
def test_refusal_names_what_is_missing_and_the_fix(monkeypatch):
    monkeypatch.delenv(PATH_ENV, raising=False)
    why = get_backend("sage2").check("cuda")
    assert why is not None and "\n" not in why
    assert why.endswith("meanwhile use --backend emulate")
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in why
    import importlib.util

    if importlib.util.find_spec("sageattention") is None:
        assert "tools/device/sage2_build.sh" in why and PATH_ENV in why


def test_a_bad_path_is_refused_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "nowhere"))
    why = kernel_problem("cuda")
    assert f"{PATH_ENV}={tmp_path / 'nowhere'} holds no sageattention package" in why
    assert "sage2_build.sh" in why
    # a package without its built extension
    pkg = tmp_path / "sageattention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("")
    monkeypatch.setenv(PATH_ENV, str(tmp_path))
    assert sage2_mod.find_package() == pkg
    assert f"{pkg} has no _qattn_sm90 extension" in kernel_problem("cuda")


def test_backends_lists_sage2_with_its_reason():
    rows = {r["name"]: r for r in backend_table("cpu")}
    assert rows["sage2"]["hardware"]
    assert rows["sage2"]["usable"] == _kernel_ok() or rows["sage2"]["why"]


def test_recipe_per_case_and_skips():
    b = get_backend("sage2")
    for name in ("small", "stress"):
        cases = grid(name)
        why = skips(cases, b)
        assert any(why) and not all(why)
        for c, w in zip(cases, why):
            if c.head_dim > HEAD_DIM_MAX:
                assert w.startswith(f"head dim {c.head_dim}")
            elif not w:
                r = case_recipe(c, backend=b)
                assert refusal(b, r) is None
                assert r.inp == r.out == ("bf16" if c.dtype == "bf16" else "fp16")
                assert r.rot == c.rot
    # FA3's recipe and the paper's SageAttention2 are refused, each with the reason
    assert "the sm90 kernel computes" in refusal(b, case_recipe(grid("small")[0]))
    assert "smooths K only" in b.supports(Recipe.from_str("sage2-sm90,smooth=qk"))
    assert "gran=thread,bm=64,bn=128" in b.supports(Recipe.from_str("sage2-sm90,bm=128,bn=64"))
    with pytest.raises(UsageError, match="loop=sage2 adds each tile"):
        Recipe.from_str("sage2-sm90,acc=fp22")


def test_attention_with_a_stand_in_kernel():
    """The backend hands the kernel FP16 [B, H, N, D] tensors, asks for the per-thread fp32+fp32
    path with K smoothing, and returns the asked rows in float64."""
    calls = []

    def stand_in(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=kw["is_causal"], scale=kw["sm_scale"]).to(q.dtype)

    b = get_backend("sage2")
    b.kernel_fn = stand_in
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 96, 64, generator=g, dtype=torch.float64) for _ in range(3))
    rows = torch.tensor([0, 17, 95])
    o = b.attention(SAGE2, q, k, v, causal=True, q_index=rows, rotation_seed=0, cache={})
    qi, ki, vi, kw = calls[0]
    assert qi.dtype == torch.float16 and qi.shape == (1, 2, 96, 64)
    assert torch.equal(qi.double(), sage_quant.input_round(q.double(), "fp16"))  # one rounding, as the emulator's
    assert kw == {"tensor_layout": "HND", "is_causal": True, "qk_quant_gran": "per_thread",
                  "sm_scale": 1 / math.sqrt(64), "pv_accum_dtype": "fp32+fp32", "smooth_k": True,
                  "return_lse": False}
    assert o.dtype == torch.float64 and o.shape == (1, 2, 3, 64)
    full = stand_in(qi, ki, vi, **kw).double()
    assert torch.equal(o, full[:, :, rows])
    b2 = get_backend("sage2")
    b2.kernel_fn = stand_in
    b2.attention(Recipe.from_str("sage2-sm90,smooth=none"), q, k, v, causal=False, q_index=torch.arange(96),
                 rotation_seed=0, cache={})
    assert calls[-1][3]["smooth_k"] is False


def test_attention_refuses_what_the_kernel_cannot_do():
    b = get_backend("sage2")
    x = torch.zeros(1, 1, 64, 256, dtype=torch.float64)
    with pytest.raises(UsageError, match="head dim 256"):
        b.attention(SAGE2, x, x, x, causal=False, q_index=torch.arange(64), rotation_seed=0, cache={})
    q = torch.zeros(1, 1, 64, 64, dtype=torch.float64)
    with pytest.raises(UsageError, match="seqlen_q 64 != seqlen_k 128"):
        b.attention(SAGE2, q, torch.zeros(1, 1, 128, 64), torch.zeros(1, 1, 128, 64), causal=True,
                    q_index=torch.arange(64), rotation_seed=0, cache={})
    with pytest.raises(UsageError, match="CUDA device"):
        b.attention(SAGE2, q, q, q, causal=False, q_index=torch.arange(64), rotation_seed=0, cache={})


# -- independent NumPy models ---------------------------------------------------------------

def _rn32(x):
    """The float32 nearest to the rational ``x``, ties to even."""
    from fractions import Fraction

    y = f32(float(x))
    cands = [np.nextafter(y, f32(-np.inf)), y, np.nextafter(y, f32(np.inf))]
    dist = [abs(Fraction(float(c)) - x) for c in cands]
    near = [c for c, e in zip(cands, dist) if e == min(dist)]
    return near[0] if len(near) == 1 else next(c for c in near if int(np.array(c).view(np.int32)) % 2 == 0)


def _np_thread_quant(x32, block, width):
    """quant_per_thread.py in float32: within each run of ``block`` tokens, the tokens whose index
    mod 8 has the same // width share scale = fma(max|x|, f32(1/127), f32(1e-7)), one rounding
    (exact in rationals, then float32); code = trunc(x * f32(1/scale) + 0.5 sign). Returns codes
    and the per-token scale [.., N, 1]."""
    from fractions import Fraction
    n = x32.shape[-2]
    codes = np.zeros(x32.shape, np.int8)
    scale = np.zeros(x32.shape[:-1] + (1,), f32)
    inv127 = f32(1 / 127.0)
    for s0 in range(0, n, block):
        for grp in range(8 // width):
            toks = [i for i in range(s0, min(n, s0 + block)) if (i % 8) // width == grp]
            if not toks:
                continue
            xb = x32[..., toks, :]
            am = np.abs(xb).max(axis=(-2, -1), keepdims=True)
            exact = [Fraction(float(a)) * Fraction(float(inv127)) + Fraction(float(f32(1e-7))) for a in am.ravel()]
            sc = np.array([_rn32(e) for e in exact], f32).reshape(am.shape)
            y = (xb * (1.0 / sc.astype(f64)).astype(f32)).astype(f32)
            y = (y + np.where(y >= 0, f32(0.5), f32(-0.5))).astype(f32)
            codes[..., toks, :] = np.clip(np.trunc(y), -127, 127).astype(np.int8)
            scale[..., toks, :] = sc
    return codes, scale


def test_per_thread_quantizer_matches_a_numpy_model_on_one_tile(monkeypatch):
    """One 64-query CTA and one 128-key tile of the preset: Q rows {r, r+8} of each 16-row warp slice
    share a scale, K keys with (k mod 8) // 2 equal share one per 128 keys, scales carry the 1e-7."""
    monkeypatch.setattr(sage_quant, "_RCP", {"cpu": None})  # the model rounds 1/y to nearest
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, 64, 128, generator=g, dtype=torch.float64) * 0.3
    k = torch.randn(1, 1, 128, 128, generator=g, dtype=torch.float64) + 2.0
    v = torch.randn(1, 1, 128, 128, generator=g, dtype=torch.float64)
    pre = prepare(SAGE2, q, k, v, q_index=torch.arange(64), softmax_scale=1 / math.sqrt(128))
    q16, k16 = q.numpy().astype(f16), k.numpy().astype(f16)
    km = k16.astype(f64).mean(axis=2, keepdims=True).astype(f16)
    ks = (k16.astype(f64) - km.astype(f64)).astype(f16)
    qc, qs = _np_thread_quant(q16.astype(f32), 16, 1)
    kc, kss = _np_thread_quant(ks.astype(f32), 128, 2)
    assert np.array_equal(pre.q.values.numpy().astype(np.int8), qc)
    assert np.array_equal(pre.q.descale.numpy(), qs)
    assert np.array_equal(pre.k.values.numpy().astype(np.int8), kc)
    assert np.array_equal(pre.k.descale.numpy(), kss)
    assert len(np.unique(qs)) == 32 and len(np.unique(kss)) == 4  # 8 groups per 16 rows; 4 per 128 keys
    # negative control: without the 1e-7 the scales and some codes move
    no_eps = sage_quant.triton_quantize_int(torch.from_numpy(q16.astype(f64)), "int8", PerThread(16, 1),
                                            block_rows=64, scale=1.0)
    assert not np.array_equal(no_eps.descale.numpy(), qs)


def _e4m3(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=f32)).to(torch.float8_e4m3fn).to(torch.float32).numpy()


def _exp2_rz(x):
    r = np.exp2(x.astype(f64))
    y = r.astype(f32)
    return np.where(np.abs(y.astype(f64)) > np.abs(r), np.nextafter(y, f32(0)), y).astype(f32)


def _ftz(x):
    return np.where(np.abs(x) < np.finfo(f32).tiny, f32(0), x).astype(f32)


def _fma(a, b, c):
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(f32)


def _np_sage2(q16, k16, v16, causal, sm, acc):
    """qk_int8_sv_f8_attn_kernel (fuse_v_scale, per-thread) CTA by CTA, tile by tile, thread by thread
    in NumPy; each tile's P V product through ``acc`` (the package's model of the FP8 wgmma)."""
    from fa3_numerics.numerics.formats import get_format
    from fa3_numerics.numerics.mma import hopper_mma

    km = k16.astype(f64).mean(axis=2, keepdims=True).astype(f16)
    ks = (k16.astype(f64) - km.astype(f64)).astype(f16)
    qc, qs = _np_thread_quant(q16.astype(f32), 16, 1)
    kc, kss = _np_thread_quant(ks.astype(f32), 128, 2)
    v32 = v16.astype(f32)
    amax = np.abs(v32).max(axis=2, keepdims=True)
    vscale = (f32(448) * (1.0 / amax.astype(f64)).astype(f32)).astype(f32)
    vdesc = (amax * (1.0 / f64(448)).astype(f32)).astype(f32)
    v8 = _e4m3((v32 * vscale).astype(f32))
    sl = f32(f32(sm) * f32(1.44269504088896340736))
    off = f32(8.807)
    b, h, n, d = q16.shape
    nk = k16.shape[2]
    grp = h // k16.shape[1]
    e4m3 = get_format("e4m3")
    out = np.zeros((b, h, n, d), f16)
    for bi in range(b):
        for hi in range(h):
            kh = hi // grp
            for m0 in range(0, n, 64):
                rows = np.arange(m0, min(n, m0 + 64))
                n_it = -(-min(nk, m0 + 64) // 128) if causal else -(-nk // 128)
                m = np.full((len(rows), 1), f32(-5e6), f32)
                dd = np.ones((len(rows), 4), f32)
                o = np.zeros((len(rows), d), f32)
                for t in range(n_it):
                    s0, s1 = t * 128, min(nk, (t + 1) * 128)
                    s = (qc[bi, hi, rows].astype(f64) @ kc[bi, kh, s0:s1].astype(f64).T).astype(f32)
                    dq = (qs[bi, hi, rows] * kss[bi, kh, s0:s1, 0][None, :]).astype(f32)
                    if t < n_it - 1:
                        c = (sl * dq).astype(f32)
                        mt = _fma(s, c, np.full_like(s, -off)).max(axis=1, keepdims=True)
                        mn = np.maximum(m, mt)
                        x = _fma(s, c, np.broadcast_to(-mn, s.shape))
                    else:
                        sf = (s * dq).astype(f32)
                        if causal:
                            sf = np.where(np.arange(s0, s1)[None, :] > rows[:, None], f32(-5e6), sf)
                        slv = np.full_like(sf, sl)
                        mt = _fma(sf, slv, np.full_like(sf, -off)).max(axis=1, keepdims=True)
                        mn = np.maximum(m, mt)
                        x = _fma(sf, slv, np.broadcast_to(-mn, sf.shape))
                    alpha = _ftz(_exp2_rz((m - mn).astype(f32)))
                    p = _ftz(np.exp2(x.astype(f64)).astype(f32))
                    pp = np.pad(p, ((0, 0), (0, 128 - p.shape[1])))
                    for lane in range(4):
                        slabs = [(((pp[:, 16 * j + 2 * lane] + pp[:, 16 * j + 2 * lane + 1]).astype(f32)
                                   + pp[:, 16 * j + 8 + 2 * lane]).astype(f32) + pp[:, 16 * j + 9 + 2 * lane]).astype(f32)
                                 for j in range(8)]
                        acc_d = _fma(dd[:, lane:lane + 1], alpha, slabs[0][:, None])
                        for j in range(1, 8):
                            acc_d = (acc_d + slabs[j][:, None]).astype(f32)
                        dd[:, lane:lane + 1] = acc_d
                    p8 = torch.from_numpy(_e4m3(p))
                    vt = torch.from_numpy(v8[bi, kh, s0:s1].copy())
                    if acc == "two-level":
                        pv = hopper_mma(p8, vt, None, a_fmt=e4m3, b_fmt=e4m3).numpy()
                    else:
                        pv = torch.matmul(p8, vt).numpy()
                    o = _fma(o, alpha, pv)
                    m = mn
                tot = ((dd[:, 0] + dd[:, 1]).astype(f32) + (dd[:, 2] + dd[:, 3]).astype(f32)).astype(f32)[:, None]
                inv = (1.0 / tot.astype(f64)).astype(f32)
                out[bi, hi, rows] = ((o * inv).astype(f32) * vdesc[bi, kh]).astype(f32).astype(f16)
    return out


@pytest.mark.parametrize("causal,n,h,hkv,acc", [(False, 200, 2, 1, "two-level"), (True, 300, 2, 2, "two-level"),
                                                (False, 130, 1, 1, "fp32")])
def test_emulator_is_the_numpy_transcription(monkeypatch, causal, n, h, hkv, acc):
    monkeypatch.setattr(sage_quant, "_RCP", {"cpu": None})  # the transcription rounds 1/y to nearest
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, h, n, 64, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, hkv, n, 64, generator=g, dtype=torch.float64) + 3  # a K bias: smoothing matters
    v = torch.randn(1, hkv, n, 64, generator=g, dtype=torch.float64)
    sm = 1 / math.sqrt(64)
    want = _np_sage2(q.numpy().astype(f16), k.numpy().astype(f16), v.numpy().astype(f16), causal, sm, acc)
    got = emulate(Recipe.from_str(f"sage2-sm90,acc={acc}"), q, k, v, causal=causal, softmax_scale=sm).numpy()
    assert np.array_equal(got, want.astype(f64))
    # negative control: FA3's loop on the same quantized operands rounds differently somewhere
    fa3_loop = emulate(Recipe.from_str(f"sage2-sm90,acc={acc},loop=fa3"), q, k, v, causal=causal,
                       softmax_scale=sm).numpy()
    assert not np.array_equal(fa3_loop, want.astype(f64))


def test_preset_error_is_that_of_int8_and_fp8():
    """Against float64 attention of the FP16 inputs the preset's RMSE is a few percent of the output's
    RMS (INT8 Q/K, FP8 P and V), far above FP16 SDPA's and far below a wrong scale's."""
    from fa3_numerics.numerics.reference import reference_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 512, 128, generator=g, dtype=torch.float64) for _ in range(3))
    r16 = [x.half().double() for x in (q, k, v)]
    ref = reference_attention(*r16)
    o = emulate(SAGE2, q, k, v)
    rel = float(((o - ref) ** 2).mean().sqrt() / (ref ** 2).mean().sqrt())
    assert 0.005 < rel < 0.1
    wrong = emulate(SAGE2, q, k, v, softmax_scale=1.0)
    assert float(((wrong - ref) ** 2).mean().sqrt() / (ref ** 2).mean().sqrt()) > 0.3


@pytest.mark.slow
def test_validate_runs_the_grid_through_the_backend(monkeypatch):
    """``validate``'s whole path on the tiny grid with a stand-in kernel that is the emulator itself
    (fed the tensors the backend hands the kernel): F = 0 and every output identical for the
    preset's accumulator, and F > 0 for float32 accumulation (the validation tells them apart)."""
    import dataclasses

    from fa3_numerics.kernels.sage2 import Sage2Backend
    from fa3_numerics.studies.validate import run_validation

    def stand_in(q, k, v, *, tensor_layout, is_causal, qk_quant_gran, sm_scale, pv_accum_dtype, smooth_k,
                 return_lse):
        fmt = "fp16" if q.dtype == torch.float16 else "bf16"
        r = dataclasses.replace(SAGE2, inp=fmt, out=fmt, smooth="k" if smooth_k else "none")
        return emulate(r, q.double(), k.double(), v.double(), causal=is_causal, softmax_scale=sm_scale).to(q.dtype)

    # the runner builds the backend by name, so the stand-in goes on the class
    monkeypatch.setattr(Sage2Backend, "kernel_fn", staticmethod(stand_in))
    monkeypatch.setattr(Sage2Backend, "check", lambda self, device: None)
    monkeypatch.setattr(Sage2Backend, "provenance", lambda self: {"kernel_module": "stand-in"})
    ds = run_validation(grid("tiny"), device="cpu", backend="sage2", progress=lambda s: None)
    f = ds["fidelity"]
    assert list(ds["acc"].values) == ["two-level", "fp32"]
    assert float(f.sel(acc="two-level").max()) == 0.0
    assert float(ds["identical"].sel(acc="two-level").min()) == 1.0
    assert float(f.sel(acc="fp32").min()) > 0.0


# -- on a GPU with the kernel ---------------------------------------------------------------

needs_kernel = pytest.mark.skipif(not _kernel_ok(), reason="SageAttention2's sm90 kernel cannot run here "
                                  "(tools/device/sage2_build.sh, FA3N_SAGE2_PATH)")


@needs_kernel
@pytest.mark.parametrize("causal,n,d", [(False, 1000, 128), (True, 1000, 64), (False, 777, 96)])
def test_kernel_matches_the_emulator_on_the_gpu(causal, n, d):
    from fa3_numerics.numerics.reference import reference_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, n, d, generator=g, dtype=torch.float64).cuda() for _ in range(3))
    rows = torch.arange(n, device="cuda")
    o = get_backend("sage2").attention(SAGE2, q, k, v, causal=causal, q_index=rows, rotation_seed=0, cache={})
    e = emulate(SAGE2, q, k, v, causal=causal)
    ref = reference_attention(*(x.half().double() for x in (q, k, v)), causal=causal)
    assert float(((o - e) ** 2).mean().sqrt() / ((o - ref) ** 2).mean().sqrt()) <= 0.01


@needs_kernel
def test_kernel_writes_nan_for_an_all_zero_v_channel():
    """per_channel_fp8 scales a V channel by 448 / amax: 448 / 0 * 0 is NaN, in that channel only
    (the preset's description says the emulator writes 0 there)."""
    fn = sage2_mod.load_kernel()[0]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 256, 128, generator=g).half().cuda() for _ in range(3))
    v[..., 5] = 0
    o = fn(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp32")
    bad = torch.nonzero(~torch.isfinite(o))[:, 3].unique().tolist()
    assert bad == [5]
