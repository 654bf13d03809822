"""``bwd.dqcast`` (numerics/backward.py): how dS reaches its FP8 format for dQ = dS K.

cuDNN's Hopper FP8 backward rounds dQ's dS to FP16 before the FP8 cast and casts dK's directly
(reports/h200/backward/cudnn.md). Checked here:

- the key changes dQ only: dK and dV bit-identical, dQ not (the negative control), by a small amount;
- an independent numpy model of one tile (ml_dtypes' casts, no code of the package): dS scaled in
  float32, rounded to float16, cast to E4M3, matches the emulator's dQ; the model's direct cast does
  not (the two differ where FP16's rounding carries a value across an FP8 rounding boundary);
- the key changes nothing where dS is not FP8, and refuses an unknown value.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.backward import backward_from, run_forward
from fa3_numerics.numerics.recipe import PRESETS, Recipe


def _inputs(h=2, hkv=1, n=160, d=64, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
    do = torch.randn(1, h, n, d, generator=g, dtype=torch.float64)
    return q, k, v, do


@pytest.mark.parametrize("acc", ["fp32", "fp22"])
def test_dqcast_changes_dq_only(acc):
    # GQA, two KV tiles of 128 keys (dQ summed across them), causal; the cuDNN kernel preset's formats
    q, k, v, do = _inputs()
    base = dataclasses.replace(PRESETS["cudnn-fp8-kernel"].recipe, acc="fp32", bwd_acc=acc)
    assert base.bwd_dqcast == "fp16"
    fwd = run_forward(base, q, k, v, causal=True)
    via16 = backward_from(base, q, k, v, fwd, do, causal=True)
    direct = backward_from(dataclasses.replace(base, bwd_dqcast="direct"), q, k, v, fwd, do, causal=True)
    assert torch.equal(via16.dk, direct.dk) and torch.equal(via16.dv, direct.dv)
    differ = float((via16.dq != direct.dq).double().mean())
    # some FP8 codes of dQ move (FP16's rounding moved a few dS codes), most do not
    assert 0.001 < differ < 0.3, differ
    rel = float((via16.dq - direct.dq).norm() / direct.dq.norm())
    assert 0 < rel < 0.05, rel


def test_the_default_leaves_every_other_preset_unchanged():
    assert all(p.recipe.bwd_dqcast == "direct" for name, p in PRESETS.items() if name != "cudnn-fp8-kernel")
    assert "bwd.dqcast" not in Recipe.from_str("exact").short_str()


def _np_tile_dq(q, k, v, do, o, lse, scale, via16: bool):
    """dQ of one (batch, head) and one KV tile from the description: S = Q K^T, P = exp2(S scale log2e
    - LSE log2e), dP = dO V^T, D = rowsum(dO O), dS = P (dP - D), all float32; dS per tensor in E4M3
    (descale = float32(amax / 448), dS / descale in float32), through float16 first when ``via16``;
    dQ = (dS8 K) descale scale."""
    f32 = np.float32
    l2e = math.log2(math.e)
    s = q @ k.T
    p = np.exp2(s * f32(scale * l2e) - (lse * f32(l2e))[:, None]).astype(f32)
    dp = do @ v.T
    dsum = (do * o).sum(-1, keepdims=True, dtype=f32)
    ds = (p * (dp - dsum)).astype(f32)
    descale = f32(np.float64(np.abs(ds).max()) / 448.0)
    scaled = (ds / descale).astype(f32)
    if via16:
        scaled = scaled.astype(np.float16)
    ds8 = scaled.astype(ml_dtypes.float8_e4m3fn).astype(f32)
    return (ds8 @ k) * descale * f32(scale)


def test_one_tile_matches_an_independent_numpy_model():
    q, k, v, do = _inputs(h=1, hkv=1, n=128, d=64, seed=11)
    fwd = run_forward(PRESETS["exact"].recipe, q, k, v)
    scale = 64 ** -0.5
    args = [t[0, 0].numpy().astype(np.float32) for t in (q, k, v, do, fwd.o)] + [fwd.lse[0, 0].numpy(), scale]
    want16, want_direct = (_np_tile_dq(*args, via16=w) for w in (True, False))
    got = {}
    for cast in ("fp16", "direct"):
        r = Recipe.from_str(f"exact,bwd.dq=e4m3:fp32,bwd.dqcast={cast}")
        got[cast] = backward_from(r, q, k, v, fwd, do, softmax_scale=scale).dq[0, 0].numpy()
    err = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    # the emulator and the model differ in float32 summation order only (~1e-7)
    assert err(got["fp16"], want16) < 1e-5
    assert err(got["direct"], want_direct) < 1e-5
    # negative control: the two casts give dQs far apart next to that (FP16 moved some dS codes)
    assert err(want16, want_direct) > 100 * err(got["fp16"], want16)
    assert err(got["fp16"], want_direct) > 1e-4


def test_dqcast_is_a_no_op_on_a_ds_that_is_not_fp8():
    # per-product attribution sets bwd.dq's formats to fp32 around a preset with bwd.dqcast=fp16
    q, k, v, do = _inputs(h=1, hkv=1, n=64, d=64)
    fwd = run_forward(PRESETS["exact"].recipe, q, k, v)
    for fmt in ("fp32", "bf16"):
        plain, via16 = (backward_from(Recipe.from_str(f"exact,bwd.dq={fmt}{c}"), q, k, v, fwd, do).dq
                        for c in ("", ",bwd.dqcast=fp16"))
        assert torch.equal(plain, via16)
    with pytest.raises(UsageError):
        Recipe.from_str("exact,bwd.dq=e4m3:fp32,bwd.dqcast=bf16")
