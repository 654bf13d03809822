"""``bwd.dsform=cudnn-ffma`` and ``bwd.dqscale=end``: dS formed as cuDNN's Hopper FP8 backward does (D from the FP8 codes' products
times descale_dO then descale_O; dS = FFMA(dP', descale_dO descale_V, -D) P attn_scale on the MMA's raw dP';
cast as the float32 product with scale_dP = max / amax) and dQ's raw products summed over KV tiles in float32,
then descaled once (cuDNN's matmul_fp8 epilogue), held to bytes the H200 wrote:
tests/fixtures/cudnn_bwd_dsform_h200.npz, cut by tools/cut_cudnn_dsform_fixture.py from the causal outliers
case (n 1024, seed 0, E5M2 arm, head 0): the first 300 query and key rows (causal: their dQ reads no other
row), a pin row holding every tensor's max code with an infinite LSE, and the kernel's dQ codes of those rows.
The cut holds the argmax of |dS|, so its scale_dP is the kernel's."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fa3_numerics.numerics.backward import Forward, backward_from
from fa3_numerics.numerics.recipe import Recipe, get_recipe

ROOT = Path(__file__).resolve().parent.parent.parent
FIX = ROOT / "tests" / "fixtures" / "cudnn_bwd_dsform_h200.npz"
sys.path.insert(0, str(ROOT / "tools"))


def _differ(dsform: str, dqscale: str) -> int:
    from cut_cudnn_dsform_fixture import decode, dq_codes

    z = np.load(FIX)
    meta = json.loads(str(z["meta"]))
    do_fmt, grad_fmt = meta["arm"].split(":")
    n = meta["rows"]
    mine = dq_codes(decode(z, meta["scalars"], do_fmt), meta["scalars"], do_fmt, grad_fmt, dsform, dqscale)
    ker = torch.from_numpy(z["dq"])
    assert mine[:, :, :n].shape == ker.shape
    return int((mine[:, :, :n] != ker).sum())


def test_cudnn_ffma_dsform_and_end_dqscale_give_the_kernels_dq_codes():
    assert _differ("cudnn-ffma", "end") == 0


@pytest.mark.parametrize("form,where", [("fa3", "end"), ("cudnn", "end"), ("cudnn-ffma", "tile")])
def test_either_fact_alone_misses_some(form, where):
    # the rows hold dQ codes each other form gets wrong (7, 9 and 3 when cut): if they matched, the test
    # above proves nothing
    assert _differ(form, where) >= 3


def test_preset_sets_both_and_defaults_are_fa3s():
    r = get_recipe("cudnn-fp8-kernel").recipe
    assert (r.bwd_dsform, r.bwd_dqscale) == ("cudnn-ffma", "end")
    assert (Recipe().bwd_dsform, Recipe().bwd_dqscale) == ("fa3", "tile")
    assert "bwd.dqscale" not in Recipe.from_str("exact").short_str()


def test_cudnn_ffma_differs_from_cudnn_only_at_float32_level(monkeypatch):
    # the fused subtraction changes dS in its last float32 bits (a moved FP8 code is rare on a random draw:
    # the fixture tests above are the ones that see it); dV (from P) is untouched
    from fa3_numerics.kernels.cudnn import bwd_formats
    from fa3_numerics.numerics import backward as bw

    torch.manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 256, 64, dtype=torch.float64) for _ in range(4))
    r = dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, acc="fp32", bwd_acc="fp32",
                            **{**bwd_formats("e4m3", "e4m3"), "bwd_out": "fp32"})
    fwd = bw.run_forward(r, q, k, v)
    seen, cast0 = [], bw._cast_by_scale

    def spy(x, *a, **kw):
        seen.append(x.clone())
        return cast0(x, *a, **kw)

    monkeypatch.setattr(bw, "_cast_by_scale", spy)
    a = backward_from(dataclasses.replace(r, bwd_dsform="cudnn"), q, k, v, fwd, do)
    n = len(seen)
    b = backward_from(dataclasses.replace(r, bwd_dsform="cudnn-ffma"), q, k, v, fwd, do)
    ds_a, ds_b = torch.cat(seen[:n], -1), torch.cat(seen[n:], -1)
    assert ds_a.shape == ds_b.shape and not torch.equal(ds_a, ds_b)
    assert float((ds_a - ds_b).abs().max()) <= float(ds_a.abs().max()) * 2 ** -20
    assert torch.equal(a.dv, b.dv)
    for x, y in ((a.dq, b.dq), (a.dk, b.dk)):
        assert float((x - y).norm() / x.norm()) < 0.02


def test_dqscale_end_moves_dq_only():
    # dQ's descales once on the float32 sum of raw products: dK and dV are untouched, dQ moves at float32 level
    torch.manual_seed(6)
    q, k, v, do = (torch.randn(1, 2, 384, 64, dtype=torch.float64) for _ in range(4))
    from fa3_numerics.kernels.cudnn import bwd_formats
    from fa3_numerics.numerics.backward import run_forward

    r = dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, acc="fp32", bwd_acc="fp32",
                            **{**bwd_formats("e4m3", "e4m3"), "bwd_out": "fp32"})
    fwd = run_forward(r, q, k, v)
    a = backward_from(dataclasses.replace(r, bwd_dqscale="tile"), q, k, v, fwd, do)
    b = backward_from(dataclasses.replace(r, bwd_dqscale="end"), q, k, v, fwd, do)
    assert torch.equal(a.dk, b.dk) and torch.equal(a.dv, b.dv)
    assert not torch.equal(a.dq, b.dq)
    assert float((a.dq - b.dq).abs().max()) <= float(a.dq.abs().max()) * 2 ** -18
