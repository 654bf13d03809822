"""Tests of ``fa3-numerics audit``: statistics, errors, ranking, recommendation, report, bad input.

Everything runs on small synthetic capture files (no model needed; torch and safetensors only).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors", reason="capture files need safetensors: pip install 'fa3-numerics[capture]'")

from fa3_numerics.studies import audit as au  # noqa: E402
from fa3_numerics.studies import audit_stats as stats  # noqa: E402
from fa3_numerics.data import capture as cap  # noqa: E402
from fa3_numerics.errors import UsageError  # noqa: E402
from fa3_numerics.numerics.recipe import PRESETS  # noqa: E402
from fa3_numerics.testing import run_cli  # noqa: E402

# The synthetic capture of conftest's ``write_audit_capture``: what these tests know about it.
D = 64
HEADS, KV = 4, 2
TOKENS = 200          # > one K tile (160) and one Q tile (192): two blocks each
HOT_K = (5, 9.0)      # (channel, scale) planted in K of KV head 0, layer 1


@pytest.fixture(scope="module")
def write_capture(write_audit_capture, audit_shape):
    assert audit_shape == {"D": D, "HEADS": HEADS, "KV": KV, "TOKENS": TOKENS, "HOT_K": HOT_K}
    return write_audit_capture


@pytest.fixture(scope="module")
def small(tmp_path_factory, write_capture):
    path = tmp_path_factory.mktemp("audit") / "c.safetensors"
    tensors = write_capture(path)
    ds = au.audit(path, rows=0, progress=lambda m: None)
    return path, tensors, ds


# ------------------------------------------------------------------------------------------
# the dataset
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_dataset_layout(small):
    _, _, ds = small
    assert ds.attrs["kind"] == "audit"
    assert ds["rmse"].dims == ("layer", "head", "variant")
    assert list(ds["variant"].values) == list(au.DEFAULT_VARIANTS)
    assert ds.sizes == {"layer": 2, "head": HEADS, "variant": len(au.DEFAULT_VARIANTS), "kv_head": KV, "channel": D,
                        "q_block": 2,
                        "k_block": 2} | {k: v for k, v in ds.sizes.items() if k not in
                                         ("layer", "head", "variant", "kv_head", "channel", "q_block", "k_block")}
    assert ds["q_amax"].dims == ("layer", "head", "channel")
    assert ds["k_amax"].dims == ("layer", "kv_head", "channel")
    assert ds.attrs["rows_evaluated"] == TOKENS and ds.attrs["rows_sampling"] == "all query rows"
    assert list(ds["kv_head_of"].values) == [0, 0, 1, 1]
    for m in ("rmse", "rel_l2", "sink_mass", "p_underflow", "q_mu_max", "k_mu_rot_max"):
        assert np.isfinite(ds[m].values).all(), m
    # every variable says what it is
    for name in ds.data_vars:
        assert ds[name].attrs.get("description"), name


@pytest.mark.slow
def test_errors_match_a_direct_computation(small):
    """The audit's error of a (layer, head) is the RMSE of the emulated output against float64
    attention of that head. The expectation here is built apart from the audit's code: the
    tensors read with safetensors itself, each query head paired with KV head h // 2 by hand,
    the causal mask and the softmax scale (from the file's metadata) written out, the RMSE as a
    formula; only the emulated output (what is being measured) comes from the package. The
    exact (float32) variant pins the plumbing: any mix-up of heads, scale or mask gives O(0.1)."""
    from safetensors import safe_open

    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe

    path, _, ds = small
    with safe_open(str(path), "pt") as f:
        scale = float(f.metadata()["softmax_scale"])
        q, k, v = (f.get_tensor(f"layers.1.{n}").double() for n in ("q", "k", "v"))
    assert scale == D ** -0.5
    kh, vh = k.repeat_interleave(HEADS // KV, dim=0), v.repeat_interleave(HEADS // KV, dim=0)
    s = (q @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.softmax(s, dim=-1) @ vh  # [HEADS, TOKENS, D]
    o = emulate(Recipe.from_str("fa3-fp8"), q[None], k[None], v[None], causal=True, softmax_scale=scale)[0]
    want = ((o - ref) ** 2).mean(dim=(1, 2)).sqrt().numpy()
    np.testing.assert_allclose(ds["rmse"].sel(layer=1, variant="fa3-fp8").values, want, rtol=1e-9)
    exact = au.audit(path, rows=0, layers=[1], variants="exact", progress=lambda m: None)
    assert float(exact["rmse"].max()) < 1e-6 * float(ref.abs().max())


@pytest.mark.slow
def test_channel_statistics(small):
    _, tensors, ds = small
    k = tensors["layers.1.k"].double()
    np.testing.assert_allclose(ds["k_amax"].sel(layer=1).values, k.abs().amax(dim=1).numpy())
    assert int(ds["k_hot_channel"].sel(layer=1, kv_head=0)) == HOT_K[0]
    assert int(ds["k_hot_pair"].sel(layer=1, kv_head=0)) == HOT_K[0] + D // 2   # rotate_half partner
    assert float(ds["k_hot_ratio"].sel(layer=1, kv_head=0)) > 5
    # The Hadamard rotation spreads the hot channel: mu drops; Gaussian heads are already incoherent.
    assert float(ds["k_mu_rot_max"].sel(layer=1, kv_head=0)) < 0.6 * float(ds["k_mu_max"].sel(layer=1, kv_head=0))
    assert (ds["q_mu_mean"].values >= 1).all() and (ds["q_mu_max"].values <= math.sqrt(D) + 1e-9).all()
    # Gaussian entries: kurtosis ~3, max/rms ~4
    kq = ds["q_kurtosis"].sel(layer=0).values
    assert np.all(np.abs(kq - 3) < 0.3), kq
    # per-block amax at the FP8 tiles (192 rows of Q, 160 rows of K)
    bm, bn = 192, 160
    np.testing.assert_allclose(ds["k_block_amax"].sel(layer=1, k_block=1).values,
                               k[:, bn:].abs().amax(dim=(1, 2)).numpy())
    q = tensors["layers.0.q"].double()
    np.testing.assert_allclose(ds["q_block_amax"].sel(layer=0, q_block=0).values,
                               q[:, :bm].abs().amax(dim=(1, 2)).numpy())


@pytest.mark.slow
def test_sink_mass_is_the_reference_weight_on_first_tokens(small):
    _, tensors, ds = small
    q = tensors["layers.1.q"].double()
    k = tensors["layers.1.k"].double().repeat_interleave(HEADS // KV, dim=0)
    s = q @ k.transpose(-1, -2) * D ** -0.5
    s = s.masked_fill(torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, dim=-1)
    want = p[..., :stats.SINK_TOKENS].sum(-1).mean(-1)
    np.testing.assert_allclose(ds["sink_mass"].sel(layer=1).values, want.numpy(), rtol=1e-10)
    # the planted sink (first key of KV head 1, heads 2 and 3) shows
    assert ds["sink_mass"].sel(layer=1, head=[2, 3]).min() > ds["sink_mass"].sel(layer=0, head=[2, 3]).max()


def test_p_underflow_running_max_versus_final_max():
    """One huge score on key 0: against the final max (a single-pass softmax) every other P~ rounds
    to 0 in e4m3; the kernel visits the last KV tile first, whose running max is small, so the
    keys in later tiles keep their P~ (the reverse order avoids P collapsing to 0)."""
    n, bn = 400, 160
    q = torch.zeros(1, 1, n, D, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, D, dtype=torch.float64)
    k[0, 0, 0, 0] = 40.0           # s = 40 * scale on key 0 for every query, 0 elsewhere
    st = stats.attention_stats(q, k, scale=1.0, causal=False, q_index=torch.arange(4), block_n=bn)
    # final max: all n - 1 non-sink keys underflow (40 nats below the max is 2^-57.7 * 2^8)
    assert st["p_underflow_final"][0] == pytest.approx((n - 1) / n)
    # running max: only the keys of tile 0 (visited last, with the huge key) underflow
    assert st["p_underflow"][0] == pytest.approx((bn - 1) / n)
    assert st["sink_mass"][0] == pytest.approx(1.0)


def test_reference_output_of_the_statistics_pass():
    from fa3_numerics.numerics.reference import reference_attention

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, HEADS, 300, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, KV, 300, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, KV, 300, D, generator=g, dtype=torch.float64)
    idx = torch.tensor([0, 1, 7, 150, 299])
    for causal in (True, False):
        st = stats.attention_stats(q, k, v, scale=0.125, causal=causal, q_index=idx, block_n=160)
        want = reference_attention(q, k, v, causal=causal, softmax_scale=0.125, q_index=idx)
        torch.testing.assert_close(st["out"], want, rtol=1e-13, atol=1e-15)


@pytest.mark.slow
def test_rows_sampling_is_recorded_and_exact(small):
    path, _, ds_all = small
    ds = au.audit(path, rows=50, layers=[1], variants="fa3-fp8", progress=lambda m: None)
    assert ds.attrs["rows_evaluated"] == 50 and "randperm" in ds.attrs["rows_sampling"]
    # same statistics that do not depend on rows
    np.testing.assert_array_equal(ds["k_amax"].values, ds_all["k_amax"].sel(layer=[1]).values)
    # a 50-row sample estimates the all-rows error
    a = float(ds["rmse"].sel(layer=1, variant="fa3-fp8").mean())
    b = float(ds_all["rmse"].sel(layer=1, variant="fa3-fp8").mean())
    assert a == pytest.approx(b, rel=0.3)


# ------------------------------------------------------------------------------------------
# ranking and recommendation
# ------------------------------------------------------------------------------------------

def test_recipe_cost_order():
    cost = {name: au.recipe_cost(PRESETS[name].recipe) for name in PRESETS}
    assert cost["fa3-fp8-kernel"] < cost["fa3-fp8-no-block-quant"] < cost["fa3-fp8-no-incoherent"] \
        < cost["fa3-fp8"] < cost["baseline-fp8"]
    assert cost["fa3-fp8-kernel"] < cost["fa3-fp8-kernel-hadamard"]


@pytest.mark.slow
def test_rank_orders_by_score(small):
    _, _, ds = small
    rows = au.rank(ds, top=None)
    scores = [r["score"] for r in rows]
    assert len(rows) == 2 * HEADS and scores == sorted(scores, reverse=True)
    assert scores[0] == pytest.approx(float(ds["rel_l2"].max()))
    by = au.rank(ds, by="fa3-fp8", metric="rmse", top=3)
    assert by[0]["score"] == pytest.approx(float(ds["rmse"].sel(variant="fa3-fp8").max()))
    with pytest.raises(UsageError, match="not an audited variant"):
        au.rank(ds, by="nope")


@pytest.mark.slow
def test_recommendation_agrees_with_measured_errors(small):
    _, _, ds = small
    worst = ds["rmse"].max("head")
    order = au.cost_order(ds)
    # costs (recipe_cost): 2, 2, 3, 3, 5, 6, 7, 8; ties keep the order given
    assert order == ["fa3-fp8-no-block-quant", "fa3-fp8-kernel,smooth=k", "fa3-fp8-no-incoherent", "fa3-mxfp8",
                     "fa3-fp8", "baseline-fp8", "sage2-int8", "sage3-nvfp4"]
    for budget in (float(worst.min()) * 0.5, float(worst.median()), float(worst.max()) * 2):
        rec = au.recommend(ds, budget)
        assert au.check_recommendations(ds, rec) == []
        for row in rec["layers"]:
            measured = worst.sel(layer=row["layer"])
            ok = [lab for lab in order if float(measured.sel(variant=lab)) <= budget]
            assert row["recommended"] == (ok[0] if ok else None)
    assert au.recommend(ds, float(worst.max()) * 2)["overall"] == order[0]
    assert au.recommend(ds, float(worst.min()) * 0.5)["overall"] is None
    with pytest.raises(UsageError, match="--budget must be a positive number"):
        au.recommend(ds, -1.0)


# ------------------------------------------------------------------------------------------
# CLI and report
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_writes_dataset_and_report(small, tmp_path, capsys):
    import xarray as xr

    path, _, _ = small
    out = tmp_path / "rep"
    code, stdout, stderr = run_cli(["audit", str(path), "--rows", "64", "--budget", "0.05", "--out", str(out),
                                     "--variants", "fa3-fp8,fa3-fp8-no-block-quant", "--layers", "1"], capsys)
    assert code == 0, stderr
    assert "riskiest (layer, head)" in stdout and "whole model:" in stdout
    assert "[1/1] layer 1, seed 0" in stderr               # progress per layer (one engine task each)
    for f in ("audit.nc", "audit.md", "heatmap_rel_l2.png", "heatmap_rmse.png", "stats_heatmap.png",
              "channel_amax.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    ds = xr.load_dataset(out / "audit.nc", engine="h5netcdf")
    assert ds.attrs["kind"] == "audit" and list(ds["variant"].values) == ["fa3-fp8", "fa3-fp8-no-block-quant"]
    md = (out / "audit.md").read_text()
    for words in ("## Riskiest layers and heads", "## Recommendation per layer", "checked: in every layer",
                  "## Provenance", "rotate_half", "![channel amax](channel_amax.png)"):
        assert words in md, words
    assert not list(out.glob(".*.tmp")), "temp file left behind"


@pytest.mark.parametrize("make, words", [
    ("text", "is not an fa3-numerics capture; make one with `fa3-numerics capture`"),
    ("nan", "layer 1 K has 3 non-finite values"),
    ("missing", "not found; make one with `fa3-numerics capture"),
])
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, make, words, write_capture):
    path = tmp_path / "bad.safetensors"
    if make == "text":
        path.write_text("this is not a capture\n")
    elif make == "nan":
        k = torch.randn(KV, 40, D, generator=torch.Generator().manual_seed(0))
        k.view(-1)[:2] = float("nan")
        k.view(-1)[2] = float("inf")
        write_capture(path, tokens=40, tensor_over={"layers.1.k": k})
    code, stdout, stderr = run_cli(["audit", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--rank-by", "nope"], "--rank-by 'nope' is not an audited variant"),
    (["--budget", "-1"], "--budget must be a positive number"),
    (["--layers", "7"], "not in the capture"),
    (["--variants", "no-such-preset"], "unknown variant 'no-such-preset'"),
    (["--rank-metric", "cosine"], "--rank-metric must be one of"),
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--rows", "-3"], "--rows must be >= 0"),
])
def test_cli_bad_options(small, tmp_path, capsys, args, words):
    path, _, _ = small
    code, _, stderr = run_cli(["audit", str(path), "--out", str(tmp_path / "o")] + args, capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and words in stderr, stderr
