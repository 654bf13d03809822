"""Findings live in the dataset: each study computes them (the recipe to use, what to avoid,
pass/fail, per-layer recommendations), a dataset from before is upgraded when read, and the
reports import no study code (nor the studies report code)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fa3_numerics"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text())
    here = path.relative_to(ROOT).with_suffix("").parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(here[:len(here) - node.level]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [(mod, node.lineno)] + [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def test_no_study_imports_report_code_and_reports_import_no_study():
    studies = [(p, m, ln) for p in (PKG / "studies").glob("*.py") for m, ln in _imports(p)
               if m.startswith("fa3_numerics.report")]
    assert not studies, f"studies import report code: {studies}"
    reports = [(p.name, m, ln) for p in (PKG / "report").glob("*.py") for m, ln in _imports(p)
               if m.startswith("fa3_numerics.studies")]
    # the one bridge: a dataset written before findings were stored is upgraded through its study
    assert {(name, mod) for name, mod, _ in reports} <= {("stored.py", "fa3_numerics.studies.findings"),
                                                         ("stored.py", "fa3_numerics.studies.findings.upgrade")}, \
        f"report modules import study code: {reports}"


def test_the_import_check_sees_a_relative_study_import(tmp_path):
    """Negative control: ``from ..studies.x import y`` inside report/ resolves to the studies package."""
    fake = ROOT / "fa3_numerics" / "report" / "_probe_for_test.py"
    try:
        fake.write_text("from ..studies.audit import rank\n")
        assert ("fa3_numerics.studies.audit.rank", 1) in _imports(fake)
    finally:
        fake.unlink()


def test_a_dataset_from_before_is_upgraded_on_read_and_the_file_left_alone():
    from fa3_numerics.studies.findings import read

    path = ROOT / "reports/outliers/default/outliers.nc"
    before = path.read_bytes()
    import xarray as xr

    assert "findings" not in xr.load_dataset(path, engine="h5netcdf").attrs  # written before findings
    ds = read(path)
    f = json.loads(ds.attrs["findings"])
    assert f["kind"] == "run" and f["verdict"]["lines"]
    assert path.read_bytes() == before


def _pooled_rms(x) -> float:
    return float(np.sqrt(np.mean(np.asarray(x, dtype=float) ** 2)))


def test_the_run_verdict_is_the_best_low_precision_recipe_and_its_ratio_to_fp16():
    from fa3_numerics.studies.findings import read

    ds = read(ROOT / "reports/outliers/default/outliers.nc")
    v = json.loads(ds.attrs["findings"])["verdict"]
    rms = {str(k): _pooled_rms(ds["rmse"].sel(variant=k).values) for k in ds["variant"].values}
    low = {k: x for k, x in rms.items() if "fp16" not in k}
    sixteen = {k: x for k, x in rms.items() if "fp16" in k}
    assert v["use"]["variant"] == min(low, key=low.get)  # an FP8 recipe, never the FP16 one
    assert v["reference"]["variant"] == min(sixteen, key=sixteen.get)
    ratio = low[v["use"]["variant"]] / sixteen[v["reference"]["variant"]]  # an independent reference
    assert v["ratio"]["value"] == pytest.approx(ratio, rel=1e-9)
    assert v["ratio"]["lo"] < ratio < v["ratio"]["hi"]
    assert v["avoid"][0]["variant"] == max(low, key=low.get)


def test_validation_fails_outside_the_fidelity_band():
    from fa3_numerics.studies.validate_findings import findings
    from fa3_numerics.studies.findings import read

    ds = read(ROOT / "reports/h200/validation.nc")
    ok = findings(ds)["verdict"]
    assert ok["pass"] and ok["lines"][0].startswith("**PASS**")
    worse = ds.copy(deep=True)
    worse["fidelity"] = worse["fidelity"] * 100  # every model now misses the band
    bad = findings(worse)["verdict"]
    assert not bad["pass"] and bad["lines"][0].startswith("**FAIL**")


def test_audit_names_the_closest_variant_where_none_meets_the_budget():
    from fa3_numerics.studies.audit_findings import findings, settings_of
    from fa3_numerics.studies.findings import read

    ds = read(ROOT / "reports/audit-smollm2/audit.nc")
    tight = {**settings_of(ds), "budget": 1e-9}
    f = findings(ds, tight)
    worst = ds["rmse"].max("head")
    none = f["verdict"]["none_meet"]
    assert sum(len(g["layers"]) for g in none) == ds.sizes["layer"]  # no layer meets 1e-9
    for g in none:
        for layer in g["layers"]:
            w = worst.sel(layer=layer)
            assert float(w.sel(variant=g["closest"])) == float(w.min())  # the smallest worst-head error
            ties = [str(v) for v in w["variant"].values if float(w.sel(variant=v)) == float(w.min())]
            cost = {str(v): int(c) for v, c in zip(ds["variant"].values, ds["cost"].values)}
            assert cost[g["closest"]] == min(cost[t] for t in ties)  # and the cheapest of equals
    assert "No audited variant meets the budget in 30 of 30 layers" in " ".join(f["verdict"]["lines"])
    loose = findings(ds, {**settings_of(ds), "budget": 10.0})
    # cheapest first, ties in the dataset's order
    cheapest = min((int(c), i, str(v)) for i, (c, v) in enumerate(zip(ds["cost"].values, ds["variant"].values)))[2]
    assert loose["verdict"]["use"] == cheapest and not loose["verdict"]["none_meet"]
