"""The emulated backward (numerics/backward.py) against independent references.

- float64 autograd of exact attention (numerics/backward_reference.py, itself checked against
  torch's SDPA backward) for the algorithm in float64: rel error <= 1e-10 (causal, GQA, N != N_k,
  softmax scale);
- an independent numpy model of one quantized backward tile, written from the description of
  FA3's backward with ml_dtypes' casts (no code of the package), matching the emulator;
- known values and negative controls: a shifted LSE scales every gradient by exp(-shift) (so the
  saved LSE is what P is recomputed from), D from another O moves dQ and dK, the numpy model
  with D = 0 does not match;
- the forward is unchanged: emulate() with and without ``stats``, and a backward preset's forward
  against the same recipe without its backward keys, are bit-identical.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.backward import Forward, backward_from, emulate_backward, run_forward
from fa3_numerics.numerics.backward_reference import reference_gradients
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import BACKWARD_PRESETS, PRESETS, Recipe
from fa3_numerics.numerics.reference import causal_mask

FP64 = "exact," + ",".join(f"bwd.{p}=fp64" for p in ("s", "dv", "dp", "ds", "dq", "dk", "out")) + ",bwd.acc=fp64"


def _inputs(b=1, h=4, hkv=2, n=96, nk=96, d=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _exact_forward(q, k, v, causal, scale):
    """O and LSE in float64, LSE = +inf for a row that sees no key (the kernel's convention)."""
    h, hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(h // hkv, 1)
    s = torch.einsum("bhnd,bhmd->bhnm", q, kk) * scale
    if causal:
        s = s.masked_fill(~causal_mask(torch.arange(q.shape[2]), 0, k.shape[2], q.shape[2], k.shape[2]), -math.inf)
    lse = torch.logsumexp(s, -1)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))
    o = reference_gradients(q, k, v, torch.zeros_like(q[..., :v.shape[-1]]), causal=causal, softmax_scale=scale)[0]
    return Forward(o, lse)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_reference_matches_torch_sdpa_backward():
    q, k, v, do = _inputs(h=2, hkv=2, n=40, nk=40, d=16)
    for causal in (False, True):
        o, dq, dk, dv = reference_gradients(q, k, v, do, causal=causal, softmax_scale=0.3)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=0.3)
        oo.backward(do)
        for a, b in ((o, oo), (dq, qq.grad), (dk, kk.grad), (dv, vv.grad)):
            assert _rel(a, b.detach()) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [dict(h=4, hkv=2, n=96, nk=96), dict(h=3, hkv=1, n=70, nk=150),
                                   dict(h=2, hkv=2, n=150, nk=90)])
def test_exact_backward_matches_autograd(causal, shape):
    q, k, v, do = _inputs(**shape, d=32)
    scale = 0.21
    _, dq, dk, dv = reference_gradients(q, k, v, do, causal=causal, softmax_scale=scale)
    g = backward_from(Recipe.from_str(FP64 + ",bwd.bm=32,bwd.bn=40"), q, k, v, _exact_forward(q, k, v, causal, scale),
                      do, causal=causal, softmax_scale=scale)
    for a, b in ((g.dq, dq), (g.dk, dk), (g.dv, dv)):
        assert torch.isfinite(a).all()
        assert _rel(a, b) <= 1e-10


def test_exact_preset_end_to_end_float32_floor():
    """The `exact` preset (float32 forward and backward) from its own forward: float32 roundoff only."""
    q, k, v, do = _inputs()
    _, dq, dk, dv = reference_gradients(q, k, v, do, causal=True)
    g = emulate_backward(PRESETS["exact"].recipe, q, k, v, do, causal=True)
    for a, b in ((g.dq, dq), (g.dk, dk), (g.dv, dv)):
        assert _rel(a, b) < 1e-5


def test_saved_lse_is_what_p_is_recomputed_from():
    """Known value: LSE + c makes P exp(-c) times smaller, so dV, dS, dQ and dK all scale by exp(-c)
    (D comes from O, which is unchanged: dS = P (dP - D) scales with P). A backward that recomputed
    the softmax in forward order instead of reading the LSE would not move."""
    q, k, v, do = _inputs()
    r = Recipe.from_str(FP64)
    fwd = _exact_forward(q, k, v, False, 0.2)
    base = backward_from(r, q, k, v, fwd, do, softmax_scale=0.2)
    c = 0.3
    moved = backward_from(r, q, k, v, Forward(fwd.o, fwd.lse + c), do, softmax_scale=0.2)
    for a, b in ((moved.dq, base.dq), (moved.dk, base.dk), (moved.dv, base.dv)):
        assert _rel(a, b * math.exp(-c)) < 1e-12
        assert _rel(a, b) > 0.2


def test_d_comes_from_the_saved_o():
    """Negative control: O from another forward changes D, and with it dQ and dK, not dV."""
    q, k, v, do = _inputs()
    r = Recipe.from_str(FP64)
    fwd = _exact_forward(q, k, v, False, 0.2)
    base = backward_from(r, q, k, v, fwd, do, softmax_scale=0.2)
    other = backward_from(r, q, k, v, Forward(fwd.o * 1.05, fwd.lse), do, softmax_scale=0.2)
    assert _rel(other.dq, base.dq) > 1e-3 and _rel(other.dk, base.dk) > 1e-3
    assert _rel(other.dv, base.dv) < 1e-14


def test_fp8_forward_bf16_backward_reads_the_fp8_forward():
    """fa3-fp8-bwd-bf16's gradients depend on its FP8 forward: the same backward from an exact
    forward is several times closer to the reference."""
    q, k, v, do = _inputs(n=128, nk=128, d=64)
    _, dq, dk, dv = reference_gradients(q, k, v, do)
    r = Recipe.from_str("fa3-fp8-bwd-bf16")
    own = emulate_backward(r, q, k, v, do)
    exact_fwd = backward_from(r, q, k, v, run_forward(PRESETS["exact"].recipe, q, k, v), do)
    assert _rel(own.dq, dq) > 3 * _rel(exact_fwd.dq, dq)


# -- one quantized tile, modelled independently -----------------------------------------------------

_TILE = ("exact,bwd.s=bf16,bwd.dv=e4m3:e5m2,bwd.dp=e5m2:e4m3,bwd.ds=bf16,bwd.dq=e5m2:e4m3,bwd.dk=e5m2:e4m3,"
         "bwd.gran=tensor,bwd.out=fp32,bwd.bm=64,bwd.bn=64")


def _np_cast(x, dtype, top):
    return np.clip(x, -top, top).astype(dtype).astype(np.float64)


def _np_scaled(x, dtype, top):
    """Per-tensor scaling: descale = float32(amax / top), values cast saturating, operand in float32."""
    d = np.float32(np.abs(x).max() / top)
    return np.float32(_np_cast(x / np.float64(d), dtype, top) * np.float64(d))


E4M3, E5M2 = (ml_dtypes.float8_e4m3fn, 448.0), (ml_dtypes.float8_e5m2, 57344.0)


def _np_tile_backward(q, k, v, do, o, lse, scale, zero_d=False):
    """One (batch, head), one KV tile, FA3's backward from its description: S from BF16 Q, K; P =
    exp2(S scale log2e - LSE log2e); dP from E5M2 dO and E4M3 V; D = rowsum(dO O) in BF16 operands;
    dS = P (dP - D); dV = P^T dO with P E4M3, dO E5M2; dQ = dS K, dK = dS^T Q with dS E5M2, K/Q E4M3;
    every scale per tensor; float32 arithmetic."""
    bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    s = bf(q) @ bf(k).T
    l2e = math.log2(math.e)
    p = np.exp2((s.astype(np.float64) * np.float64(np.float32(scale * l2e))
                 - np.float64(np.float32(lse * np.float32(l2e))[:, None])).astype(np.float32)).astype(np.float32)
    dp = _np_scaled(do, *E5M2) @ _np_scaled(v, *E4M3).T
    dsum = np.zeros((q.shape[0], 1), np.float32) if zero_d else (bf(do) * bf(o)).sum(-1, keepdims=True,
                                                                                   dtype=np.float32)
    ds = (p * (dp - dsum)).astype(np.float32)
    dv = _np_scaled(p, *E4M3).T @ _np_scaled(do, *E5M2)
    ds8 = _np_scaled(ds, *E5M2)
    dq = (ds8 @ _np_scaled(k, *E4M3)) * np.float32(scale)
    dk = (ds8.T @ _np_scaled(q, *E4M3)) * np.float32(scale)
    return dq, dk, dv


def test_one_quantized_tile_matches_an_independent_numpy_model():
    q, k, v, do = _inputs(h=1, hkv=1, n=64, nk=64, d=64, seed=3)
    fwd = run_forward(PRESETS["exact"].recipe, q, k, v)
    r = Recipe.from_str(_TILE)
    g = backward_from(r, q, k, v, fwd, do)
    args = [t[0, 0].numpy() for t in (q, k, v, do, fwd.o)] + [fwd.lse[0, 0].numpy().astype(np.float32), 64 ** -0.5]
    want = _np_tile_backward(*args)
    _, dq, dk, dv = reference_gradients(q, k, v, do)
    for got, w, ref in zip((g.dq, g.dk, g.dv), want, (dq, dk, dv)):
        got = got[0, 0].numpy()
        ref = ref[0, 0].numpy()
        err_model = np.linalg.norm(got - w) / np.linalg.norm(w)
        err_fp8 = np.linalg.norm(w - ref) / np.linalg.norm(ref)
        # the emulator and the model differ only in float32 summation order (an ulp that can flip an FP8
        # rounding now and then); both are ~100x farther from the exact gradients
        assert err_model < 2e-3, err_model
        assert err_fp8 > 30 * err_model, (err_fp8, err_model)
    # negative control: the model without D is far from the emulator
    bad = _np_tile_backward(*args, zero_d=True)
    assert np.linalg.norm(g.dq[0, 0].numpy() - bad[0]) / np.linalg.norm(bad[0]) > 0.05


# -- the forward is unchanged ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fa3-fp8", "fa3-fp8-kernel,acc=fp32", "sage2-int8", "fa3-fp16", "cudnn-fp8"])
def test_forward_with_lse_is_bit_identical(name):
    q, k, v, _ = _inputs(n=200, nk=200, d=64)
    r = Recipe.from_str(name)
    for causal in (False, True):
        plain = emulate(r, q, k, v, causal=causal)
        stats = {}
        with_lse = emulate(r, q, k, v, causal=causal, stats=stats)
        assert torch.equal(plain, with_lse)
        assert stats["lse"].shape == q.shape[:3] and stats["lse"].dtype == torch.float32


@pytest.mark.parametrize("name", BACKWARD_PRESETS)
def test_backward_keys_do_not_touch_the_forward(name):
    q, k, v, _ = _inputs(n=130, nk=130, d=64)
    r = PRESETS[name].recipe
    fwd_only = dataclasses.replace(r, **{f: Recipe().__getattribute__(f) for f in vars(r) if f.startswith("bwd_")})
    assert torch.equal(emulate(r, q, k, v, causal=True), emulate(fwd_only, q, k, v, causal=True))


def test_lse_of_the_exact_forward():
    q, k, v, _ = _inputs(n=100, nk=60, d=64)
    for causal in (False, True):
        stats = {}
        emulate(PRESETS["exact"].recipe, q, k, v, causal=causal, stats=stats)
        want = _exact_forward(q, k, v, causal, 64 ** -0.5).lse
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(stats["lse"]))  # rows that see no key: +inf in both
        assert (stats["lse"][fin].double() - want[fin]).abs().max() < 1e-5


# -- keys -------------------------------------------------------------------------------------------

def test_backward_keys_parse_and_refuse():
    r = Recipe.from_str("exact,bwd.dv=e4m3:e5m2,bwd.dp=float16")
    assert r.bwd_dv == "e4m3:e5m2" and r.bwd_dp == "fp16"
    assert Recipe.from_str(r.short_str()) == r
    assert PRESETS["exact"].recipe.short_str() == "qk=fp32,v=fp32,p=fp32,poff=0,out=fp32"  # existing specs unchanged
    for bad in ("bwd.dp=int4", "bwd.dv=e4m3:e5m2:fp16", "bwd.gran=channel", "bwd.dq=nvfp4",
                "bwd.acc=fp22,bwd.gran=block,bwd.dv=e4m3"):
        with pytest.raises(UsageError):
            Recipe.from_str("exact," + bad)


def test_every_backward_preset_runs_finite_and_beats_noise():
    q, k, v, do = _inputs(n=80, nk=80, d=64)
    _, dq, dk, dv = reference_gradients(q, k, v, do, causal=True)
    for name in BACKWARD_PRESETS:
        g = emulate_backward(PRESETS[name].recipe, q, k, v, do, causal=True)
        for a, b in ((g.dq, dq), (g.dk, dk), (g.dv, dv)):
            assert torch.isfinite(a).all(), name
            assert _rel(a, b) < 0.5, (name, _rel(a, b))  # an unrelated gradient is ~1.4


# -- the study and its command ----------------------------------------------------------------------

def test_stage_recipes_isolate_one_product():
    from fa3_numerics.studies.backward import STAGES, stage_recipe

    r = PRESETS["cudnn-fp8"].recipe
    exact = stage_recipe(r, "exact")
    assert exact.bwd_dq == "fp32" and exact.qk == "fp32"
    for stage in STAGES:
        s = stage_recipe(r, stage)
        if stage in ("dv", "dp", "ds", "dq", "dk", "s"):
            diff = {f for f in vars(s) if getattr(s, f) != getattr(exact, f)}
            assert diff == {f"bwd_{stage}"}, (stage, diff)
    assert stage_recipe(r, "fwd").qk == "e4m3" and stage_recipe(r, "fwd").bwd_dq == "fp32"


def test_run_backward_command(tmp_path):
    import xarray as xr

    from fa3_numerics.cli import main

    out = tmp_path / "bwd"
    with pytest.raises(SystemExit) as exc:
        main(["run", "backward", "--seqlen", "64", "--head-dim", "64", "--heads", "2", "--kv-heads", "1",
              "--variants", "fa3-fp8-bwd-bf16", "--out", str(out)])
    assert exc.value.code in (0, None)
    ds = xr.load_dataset(out / "backward.nc", engine="h5netcdf")
    assert ds["dk_rel_l2"].dims[-1] == "kv_head" and ds.sizes["kv_head"] == 1
    assert "fwd" in ds["stage"].values and ds.attrs["kind"] == "backward"
    full = float(ds["dq_rel_l2"].sel(stage="full").mean())
    floor = float(ds["dq_rel_l2"].sel(stage="exact").mean())
    assert 0 < floor < 1e-5 < full < 0.5
    assert "Attribution" in (out / "report.md").read_text()


def test_lse_of_a_smoothed_forward_is_the_lse_of_the_scores():
    """K smoothing shifts a row's scores by -Q_i . mean(K); the saved LSE adds it back, so the
    float32 forward with smooth=k gives the same LSE as without (negative control: the shift itself
    is far larger than the difference)."""
    q, k, v, _ = _inputs(n=100, nk=100, d=64)
    k = k + 0.7  # a bias shared by every token: the case smoothing is for
    plain, smooth = {}, {}
    emulate(PRESETS["exact"].recipe, q, k, v, stats=plain)
    emulate(Recipe.from_str("exact,smooth=k"), q, k, v, stats=smooth)
    diff = (plain["lse"] - smooth["lse"]).abs().max()
    shift = (q * k.mean(dim=2, keepdim=True).repeat_interleave(2, 1)).sum(-1).abs().max() / 8
    assert diff < 1e-4 < shift


# -- real dO from a capture (capture --grads), and the backend that computes the gradients ----------

@pytest.mark.slow
def test_run_backward_on_a_capture_reads_its_real_do(tiny_llama, tmp_path):
    import xarray as xr

    from fa3_numerics.cli import main
    from fa3_numerics.data import capture as cap
    from fa3_numerics.numerics.metrics import per_sample

    folder = tiny_llama("bwd-grads", layers=2, hidden=64, positions=128, words=300, by_frequency=True)
    path = tmp_path / "g.safetensors"
    c = cap.capture(model=str(folder), out=path, tokens=64, grads=True)
    out = tmp_path / "bwd"
    with pytest.raises(SystemExit) as exc:
        main(["run", "backward", "--dist", f"capture-file:{path}", "--layer", "1", "--seqlen", "64", "--head-dim",
              "64", "--heads", "2", "--kv-heads", "1", "--causal", "true", "--variants", "fa3-fp8-bwd-bf16",
              "--no-attribution", "--out", str(out)])
    assert exc.value.code in (0, None)
    ds = xr.load_dataset(out / "backward.nc", engine="h5netcdf")
    assert ds.attrs["do_source"].startswith("captured: dL/dO") and ds.attrs["do_seed"].startswith("none")
    # independently: the capture's own Q, K, V, dO through the emulator give the dataset's figures
    q, k, v = (t[None] for t in c.qkv(1))
    r = PRESETS["fa3-fp8-bwd-bf16"].recipe
    got = ds["dq_rmse"].sel(stage="full", variant="fa3-fp8-bwd-bf16").values.reshape(-1)

    def rmse(do):
        gr = emulate_backward(r, q, k, v, do, causal=True, softmax_scale=c.scale, rotation_seed=0)
        ref = reference_gradients(q, k, v, do, causal=True, softmax_scale=c.scale)
        return np.asarray(per_sample(gr.dq, ref[1])["rmse"]).reshape(-1)

    np.testing.assert_allclose(got, rmse(c.do(1)[None]), rtol=1e-9)
    # negative control: the synthetic dO (--do synthetic, what the study draws without a capture's own)
    # gives other figures, and those are what --do synthetic records
    synthetic = torch.randn(q.shape, generator=torch.Generator().manual_seed(29), dtype=torch.float64)
    assert not np.allclose(got, rmse(synthetic), rtol=0.1)
    out2 = tmp_path / "bwd-synthetic"
    with pytest.raises(SystemExit):
        main(["run", "backward", "--dist", f"capture-file:{path}", "--layer", "1", "--seqlen", "64", "--head-dim",
              "64", "--heads", "2", "--kv-heads", "1", "--causal", "true", "--variants", "fa3-fp8-bwd-bf16",
              "--no-attribution", "--do", "synthetic", "--out", str(out2)])
    ds2 = xr.load_dataset(out2 / "backward.nc", engine="h5netcdf")
    assert ds2.attrs["do_source"].startswith("synthetic")
    np.testing.assert_allclose(ds2["dq_rmse"].sel(stage="full").values.reshape(-1), rmse(synthetic), rtol=1e-9)


def test_synthetic_do_is_said_so():
    from fa3_numerics.studies.backward import SYNTHETIC_DO, load_study

    study = load_study({"seqlen": [32], "head_dim": [64], "heads": 1, "variants": ["exact"]}, attribution=False)
    res = study.run(None)
    assert res.attrs["do_source"] == SYNTHETIC_DO and res.dataset().attrs["do_seed"].startswith("torch.randn")


def test_gradient_backends_are_checked_with_the_fix():
    from fa3_numerics.studies.backward import load_study

    base = {"seqlen": [32], "head_dim": [64], "heads": 1, "variants": ["fa3-fp8-bwd-bf16"]}
    with pytest.raises(UsageError, match="forward only"):
        load_study({**base, "backend": "fa3-mock"}, attribution=False)
    with pytest.raises(UsageError, match="cannot run"):
        load_study({**base, "backend": "cudnn-fp8"}, attribution=False)  # no GPU here
    with pytest.raises(UsageError, match="not a device"):
        load_study({**base, "device": "tpu"}, attribution=False)
    assert load_study({**base, "backend": "emulate"}).backend == "emulate"


def test_bwd_pscale_offset_casts_p_at_the_forwards_fixed_scale():
    """bwd.pscale=offset (cuDNN's scale_s): dV = P^T dO with P cast as e4m3(P * 2^poff) whatever P's amax,
    checked against a hand computation on rows whose largest P is far below 1 (where amax scaling differs)."""
    from fa3_numerics.numerics.formats import cast

    q, k, v, do = _inputs(h=2, hkv=2, n=64, nk=64, d=64, scale=0.05)  # flat scores: max P ~ 1/64 * e
    base = Recipe.from_str("exact,bwd.dv=e4m3:fp32")
    lse_fwd = _exact_forward(q, k, v, False, 0.125)
    fixed = backward_from(Recipe.from_str("exact,bwd.dv=e4m3:fp32,bwd.pscale=offset,poff=8"), q, k, v, lse_fwd, do,
                          softmax_scale=0.125)
    amax = backward_from(base, q, k, v, lse_fwd, do, softmax_scale=0.125)
    s = (q @ k.transpose(-1, -2)).float() * torch.tensor(0.125 * math.log2(math.e), dtype=torch.float32)
    p = torch.exp2(s - (lse_fwd.lse.float() * torch.tensor(math.log2(math.e), dtype=torch.float32)).unsqueeze(-1))
    assert float(p.max()) < 0.2
    want = (cast(p / torch.tensor(2.0 ** -8, dtype=torch.float32), "e4m3").float().transpose(-1, -2) @ do.float()) * 2.0 ** -8
    torch.testing.assert_close(fixed.dv, want.double(), rtol=1e-6, atol=1e-7)
    # negative control: P's amax scale gives other dV values
    assert float((amax.dv - fixed.dv).abs().max()) > 1e-3 * float(fixed.dv.abs().max())
    with pytest.raises(UsageError):
        Recipe.from_str("exact,bwd.pscale=block")
