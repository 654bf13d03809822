"""``bwd.pexp=cudnn``: P recomputed as cuDNN's Hopper FP8 backward does (FFMA of the raw S with
(scale descale_Q) descale_K minus the natural-log LSE, then ex2.approx.ftz of it times log2e), held to
bytes the H200 wrote: tests/fixtures/cudnn_bwd_pexp_h200.npz, cut by tools/cut_cudnn_pexp_fixture.py from
the non-causal k-bias case (n 1024, seed 0, E4M3 arm, head 0): every query row, the key rows whose dV codes
the fa3 form gets wrong, and the kernel's dV codes of those rows."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from fa3_numerics.kernels.cudnn import bwd_formats
from fa3_numerics.numerics.backward import Forward, backward_from
from fa3_numerics.numerics.formats import cast
from fa3_numerics.numerics.recipe import Recipe, get_recipe

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "cudnn_bwd_pexp_h200.npz"
_DT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _load():
    z = np.load(FIX)
    meta = json.loads(str(z["meta"]))
    sc = meta["scalars"]
    do_fmt, grad_fmt = meta["arm"].split(":")
    dec = lambda a, f, s: torch.from_numpy(np.ascontiguousarray(a)).view(_DT[f]).double() * s  # noqa: E731
    q = dec(z["q"], "e4m3", sc["descale_q"])
    k = dec(z["k"], "e4m3", sc["descale_k"])
    do = dec(z["do"], do_fmt, sc["descale_dO"])
    lse = torch.from_numpy(z["lse"])
    return meta, q, k, do, lse, torch.from_numpy(z["dv"]), do_fmt, grad_fmt


def _dv_codes(pexp: str):
    # the fixture's dV codes at bwd.pexp through the cutting tool's own dv_codes (one copy of that call)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tools"))
    from cut_cudnn_pexp_fixture import dv_codes

    meta, q, k, do, lse, ker, do_fmt, grad_fmt = _load()
    return dv_codes(q, k, do, lse, meta["scalars"], do_fmt, grad_fmt, pexp), ker


def test_cudnn_pexp_gives_the_kernels_dv_codes():
    mine, ker = _dv_codes("cudnn")
    assert mine.shape == ker.shape
    assert int((mine != ker).sum()) == 0


def test_fa3_pexp_misses_those_rows():
    # the fixture's rows are the ones the exp2 form gets wrong: if it matched, the test above proves nothing
    mine, ker = _dv_codes("fa3")
    assert int((mine != ker).sum()) >= 10


def test_preset_sets_cudnn_pexp_and_default_is_fa3():
    assert get_recipe("cudnn-fp8-kernel").recipe.bwd_pexp == "cudnn"
    assert Recipe().bwd_pexp == "fa3"


def test_cudnn_pexp_row_without_keys_is_zero():
    # an infinite LSE (a row that saw no key): FFMA gives -inf, ex2(-inf) = +0, no NaN
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, 8, 16, dtype=torch.float64) for _ in range(4))
    lse = torch.full((1, 1, 8), float("inf"), dtype=torch.float32)
    r = Recipe.from_str("bwd.s=e4m3,bwd.dv=e4m3,bwd.dp=e4m3,bwd.ds=e4m3,bwd.dq=e4m3,bwd.dk=e4m3,bwd.pexp=cudnn")
    gr = backward_from(r, q, k, v, Forward(torch.zeros_like(do), lse), do)
    for g in (gr.dq, gr.dk, gr.dv):
        assert torch.isfinite(g).all()
    assert float(gr.dv.abs().max()) == 0.0


def test_cudnn_pexp_reads_fp64_as_fa3():
    # float64 arithmetic (bwd.acc=fp64) is the exact algorithm: the key does not apply there
    torch.manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(4))
    lse = torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(8), -1).float()
    o = torch.zeros_like(do)
    a = backward_from(Recipe.from_str("bwd.acc=fp64"), q, k, v, Forward(o, lse), do)
    b = backward_from(Recipe.from_str("bwd.acc=fp64,bwd.pexp=cudnn"), q, k, v, Forward(o, lse), do)
    assert torch.equal(a.dv, b.dv) and torch.equal(a.dk, b.dk)


def test_outscale_scale_writes_codes_as_the_kernel_scales_them():
    # cuDNN writes code = cast(x * scale_dX), scale_dX = float32(max / amax) (kernels/cudnn.py forms it so);
    # x / float32(amax / max) lands on the other side of some FP8 ties
    from fa3_numerics.numerics.backward import _write

    torch.manual_seed(3)
    x = (torch.randn(1, 2, 512, 64) * 0.37).to(torch.float32)
    s = torch.tensor(448.0 / float(x.abs().amax()), dtype=torch.float64).to(torch.float32)
    want = cast(x * s, "e4m3").to(torch.float64) / float(s)
    got = _write(x, "e4m3", "scale")
    assert torch.equal(got, want)
    old = _write(x, "e4m3", "descale")
    assert not torch.equal(old, got)  # the two rules differ somewhere: the key matters
    assert float((old - got).abs().max()) <= float(x.abs().amax()) * 2 ** -3


def test_dsform_cudnn_moves_dq_dk_only_and_stays_close():
    # dS formed in cuDNN's graph order: float32-level changes at the dS casts' ties, dV untouched
    # 4 heads x 512 rows: enough dS values that the graph order moves some cast (at 2 x 256, with the
    # forward's own arithmetic as fitted, a draw can have none on a tie)
    torch.manual_seed(4)
    q, k, v, do = (torch.randn(1, 4, 512, 64, dtype=torch.float64) for _ in range(4))
    r = dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, acc="fp32", bwd_acc="fp32",
                            **bwd_formats("e4m3", "e4m3"))
    from fa3_numerics.numerics.backward import run_forward

    fwd = run_forward(r, q, k, v)
    a = backward_from(r, q, k, v, fwd, do)
    b = backward_from(dataclasses.replace(r, bwd_dsform="cudnn"), q, k, v, fwd, do)
    assert torch.equal(a.dv, b.dv)
    assert not torch.equal(a.dk, b.dk)
    for x, y in ((a.dq, b.dq), (a.dk, b.dk)):
        assert float((x - y).norm() / x.norm()) < 0.02
