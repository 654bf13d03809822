"""Non-finite results are never silent: counted, warned about, flagged in every
summary and report, shown as "non-finite (k of n samples)", and exit code 3 unless allowed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xarray as xr

from fa3_numerics.engine.dataset import read
from fa3_numerics.kernels.fa3 import MockFa3Backend
from fa3_numerics.numerics.metrics import bootstrap_ci, nonfinite_samples, per_sample, pooled
from fa3_numerics.testing import run_cli

# FP16 S overflows: sigma 300 outliers make |q.k| beyond 65504 (the legitimate example).
OVERFLOW = ["--p", "0.01", "--sigma", "300", "--variants", "baseline-fp16,sscale=after;fa3-fp8", "--seqlen", "256",
            "--batch", "1", "--heads", "2", "--rows", "32"]


# -- metrics ---------------------------------------------------------------------------------

def test_per_sample_counts_a_non_finite_reference_and_output():
    ref = torch.zeros(1, 3, 2, 2, dtype=torch.float64)
    out = ref.clone()
    out[0, 0, 0, 0] = math.inf
    ref[0, 1, 1, 1] = math.nan
    m = per_sample(out, ref)
    assert m["nonfinite"].tolist() == [[1.0, 1.0, 0.0]]
    assert np.isnan(m["rmse"][0, :2]).all() and m["rmse"][0, 2] == 0.0


def test_pooled_and_bootstrap_never_drop_a_nan_sample():
    v = np.array([1.0, 2.0, np.nan, 3.0])
    assert math.isnan(pooled("rmse", v)) and math.isnan(pooled("max_abs", v)) and math.isnan(pooled("rel_l2", v))
    assert all(map(math.isnan, bootstrap_ci("rmse", v)))
    assert nonfinite_samples(v) == (1, 4)
    # the finite samples alone still pool as before
    assert pooled("rmse", v[~np.isnan(v)]) == pytest.approx(math.sqrt((1 + 4 + 9) / 3))


# -- run outliers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory):
    """The issue's example run once for the module: (out folder, exit code, stderr)."""
    import contextlib
    import io

    from fa3_numerics.cli import main

    out = tmp_path_factory.mktemp("nf") / "o"
    err = io.StringIO()  # pytest's capsys is per test
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(err):
        main(["run", "outliers", *OVERFLOW, "--out", str(out)])
    return out, exc.value.code, err.getvalue()


@pytest.mark.slow
def test_run_warns_names_the_cell_and_exits_3(overflow_run):
    out, code, err = overflow_run
    assert code == 3
    warn = [line for line in err.splitlines() if line.startswith("warning: non-finite results")]
    assert len(warn) == 1 and "variant 'baseline-fp16,sscale=after', single cell, seed 0:" in warn[0], err
    assert "in 2 of 2 samples" in warn[0]
    assert err.strip().splitlines()[-1].startswith("error: 1 result(s) of 1 variant(s) (baseline-fp16,sscale=after)")
    assert "--allow-nonfinite" in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_run_writes_everything_and_flags_it(overflow_run):
    out, _, _ = overflow_run
    ds = read(out / "outliers.nc")
    bad = ds["nonfinite"].sel(variant="baseline-fp16,sscale=after")
    assert (bad > 0).all() and (ds["nonfinite"].sel(variant="fa3-fp8") == 0).all()
    summary = (out / "summary.md").read_text()
    assert "**Non-finite results.**" in summary
    assert "| `baseline-fp16,sscale=after` | **non-finite (2 of 2 samples)** |" in summary
    fa3_row = next(line for line in summary.splitlines() if line.startswith("| `fa3-fp8` |"))
    assert "non-finite" not in fa3_row  # the finite variant is reported as usual
    for f in ("report.md", "report.html"):
        text = (out / f).read_text()
        assert "Non-finite results" in text and "non-finite (2 of 2 samples)" in text, f


@pytest.mark.slow
def test_allow_nonfinite_exits_0_but_still_warns(tmp_path, capsys):
    code, _, err = run_cli(["run", "outliers", *OVERFLOW, "--out", str(tmp_path / "o"), "--allow-nonfinite"],
                           capsys)
    assert code == 0 and "warning: non-finite results: variant 'baseline-fp16,sscale=after'" in err


@pytest.mark.slow
def test_compare_shows_non_finite_sides_and_exits_3(overflow_run, tmp_path, capsys):
    out, _, _ = overflow_run
    nc = out / "outliers.nc"
    code, stdout, err = run_cli(["compare", str(nc), str(nc)], capsys)
    assert code == 3
    row = next(line for line in stdout.splitlines() if line.startswith("baseline-fp16,sscale=after"))
    assert "non-finite (2 of 2 samples)" in row and "NON-FINITE" in stdout
    assert "warning: non-finite results in A: variant 'baseline-fp16,sscale=after'" in err
    code, _, _ = run_cli(["compare", str(nc), str(nc), "--allow-nonfinite"], capsys)
    assert code == 0


# -- ablation ----------------------------------------------------------------------------------

TOML = """
description = "non-finite ablation"
[[data]]
dist = "outliers"
params = { p = [0.01], sigma = [300.0] }
[shape]
seqlen = [192]
head_dim = [64]
heads = 2
rows = 16
[run]
seeds = [0]
attribution = false
[[design]]
name = "s16"
s16 = ["fp32", "fp16"]
"""


@pytest.fixture()
def fp16_factor(monkeypatch):
    """A factor whose fp16 level is standard attention with FP16 S: it overflows on this data."""
    from fa3_numerics.numerics import keys

    monkeypatch.setitem(keys._FACTORS, "s16", keys.Factor(
        "s16", "fp32", "S format of standard attention",
        {"fp32": "", "fp16": "algo=standard,qk=fp16,v=fp16,p=fp16,s=fp16,softmax=fp16,out=fp16"}))


@pytest.mark.slow
def test_ablation_reports_and_exits_3(fp16_factor, tmp_path, capsys):
    toml = tmp_path / "nf.toml"
    toml.write_text(TOML)
    code, _, err = run_cli(["run", "ablation", "--experiment", str(toml), "--workers", "0", "--out",
                            str(tmp_path / "res"), "--report", str(tmp_path / "rep")], capsys)
    assert code == 3, err
    # a factor registered after the original six is labelled name=level (studies.ablation.variant_label)
    assert "warning: non-finite results: variant 'head|none|offset8|fp32|e4m3|amax|s16=fp16'" in err
    assert "data=outliers p=0.01,sigma=300, seqlen=192, head_dim=64, causal=False, seed 0" in err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "**Non-finite results.**" in md and "1 cell(s) are left out of the effects" in md


def test_ablation_refuses_non_finite_inputs(tmp_path, cli, inf_k, ablation_toml):
    """Issue 15: on the ablation path too, an Inf in K is refused (exit 2, one line naming the
    cell) rather than measured as FP8 outputs that a saturating cast made finite."""
    toml = ablation_toml(data=((inf_k, None),), run={"attribution": False},
                         designs=[{"name": "core", "gran": ["head"], "rot": ["none", "hadamard"]}])
    code, _, err = cli("run", "ablation", "--experiment", toml, "--workers", "0", "--out", tmp_path / "res")
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "1 non-finite value(s) in K" in last and "seqlen=128" in last, err
    assert not (tmp_path / "res" / "tiny.nc").exists()


# -- audit -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_audit_ranks_a_non_finite_head_first_and_exits_3(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from fa3_numerics.studies.audit import audit, rank, recommend
    from fa3_numerics.testing import write_capture

    path = tmp_path / "c.safetensors"
    write_capture(path, layers=(0,), k_scale=3000.0, tokens=64)  # FP16 S overflows
    variants = "baseline-fp16,sscale=after;fa3-fp8"
    ds = audit(path, variants=variants, rows=0, progress=lambda m: None)
    assert np.isnan(ds["rmse"].sel(variant="baseline-fp16,sscale=after")).any()
    top = rank(ds, top=1)[0]
    assert math.isnan(top["score"]) and top["worst_variant"] == "baseline-fp16,sscale=after"
    rec = recommend(ds, 1e9)
    assert rec["layers"][0]["recommended"] == "fa3-fp8"  # the non-finite variant meets no budget
    code, stdout, err = run_cli(["audit", str(path), "--variants", variants, "--rows", "0", "--out",
                                 str(tmp_path / "a")], capsys)
    assert code == 3, err
    assert "warning: non-finite results: variant 'baseline-fp16,sscale=after', layer=0, seed 0" in err
    first = [line for line in stdout.split("riskiest")[1].splitlines() if line.lstrip().startswith("#1")]
    assert first and "non-finite" in first[0]  # the ranking's first row
    md = (tmp_path / "a" / "audit.md").read_text()
    assert "**Non-finite results.**" in md


# -- validate ----------------------------------------------------------------------------------

class NanKernel(MockFa3Backend):
    """The stand-in kernel with one NaN output per call."""

    name = "nan-kernel"

    def attention(self, recipe, q, k, v, **kw):
        o = super().attention(recipe, q, k, v, **kw)
        o[0, 0, 0, 0] = math.nan
        return o


@pytest.mark.slow
def test_validate_counts_kernel_and_emulator_non_finite_apart(tmp_path, capsys, monkeypatch):
    """A stand-in kernel that returns NaN for one output: counted as the kernel's, not the
    emulator's; F stays defined over the outputs finite in both; exit 3 unless allowed."""
    from fa3_numerics.engine import backends

    monkeypatch.setitem(backends.BACKENDS, "nan-kernel", (None, f"{__name__}:NanKernel"))
    code, stdout, err = run_cli(["validate", "--grid", "tiny", "--backend", "nan-kernel", "--device", "cpu", "--acc",
                                 "fp32", "--out", str(tmp_path / "v")], capsys)
    assert code == 3, err
    ds = xr.load_dataset(tmp_path / "v" / "validation.nc", engine="h5netcdf")
    assert (ds["nonfinite_kernel"] == 1).all() and (ds["nonfinite_emulator_only"] == 0).all()
    assert np.isfinite(ds["fidelity"]).all()
    assert "**Non-finite outputs**" in (tmp_path / "v" / "validation.md").read_text()
    assert err.count("warning: non-finite outputs in case") == ds.sizes["case"]
