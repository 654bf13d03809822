"""Every study renders to the same self-contained HTML and to Markdown (jinja2 templates, one
document model): the ablation, the audit, the validation, several datasets on one page, and
datasets written before the current conventions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fa3_numerics.testing import run_cli

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "reports" / "h200"


pytestmark = pytest.mark.slow  # rendered reports of every study


def _self_contained(html: str) -> None:
    assert html.startswith("<!DOCTYPE html>") and "</html>" in html
    assert not re.search(r"<script|<link|<iframe|https?://", html, flags=re.I)
    for src in re.findall(r'<img [^>]*src="([^"]*)"', html):
        assert src.startswith("data:image/png;base64,")


def test_ablation_report_is_html_with_figures_before_the_long_tables(tmp_path, synthetic_ablation):
    from fa3_numerics.report import ablation as R

    ds = synthetic_ablation(noise=0.02)
    ds.attrs.update({"description": "synthetic", "designs": "{}", "base_recipe": "fa3-fp8-kernel"})
    ds = ds.assign_coords(heads=4, batch_size=1, rows=16)
    md = R.render_report(ds, tmp_path, n_boot=100).read_text()
    html = (tmp_path / "report.html").read_text()
    _self_contained(html)
    assert html.count("<img ") == md.count("![") >= 5
    # the findings lead; the figures come before the tables of effects
    assert md.index("## Findings") < md.index("## Figures") < md.index("## Main effects") < md.index("## Provenance")
    assert html.index("<img ") < html.index("Main effects</h2>")
    for stem in ("main_effects", "interactions", "seqlen", "block_quant", "effects_per_data"):
        assert (tmp_path / f"{stem}.png").is_file() and (tmp_path / f"{stem}.svg").is_file(), stem
    assert (tmp_path / "effects.csv").read_text().startswith("factor,level,effect_log10,ratio,lo,hi")


@pytest.fixture(scope="module")
def audit_run(tmp_path_factory):
    pytest.importorskip("safetensors")
    from fa3_numerics.cli import main
    from fa3_numerics.testing import write_capture

    d = tmp_path_factory.mktemp("audit")
    write_capture(d / "c.safetensors", layers=(0, 1), tokens=96)
    with pytest.raises(SystemExit) as exc:
        main(["audit", str(d / "c.safetensors"), "--rows", "32", "--budget", "0.05", "--variants",
              "fa3-fp8,fa3-fp8-no-block-quant", "--out", str(d / "out")])
    assert (exc.value.code or 0) == 0
    return d / "out"


def test_report_on_an_audit_dataset_renders_the_audit_report(audit_run, tmp_path, capsys):
    code, out, err = run_cli(["report", str(audit_run / "audit.nc"), "--out", str(tmp_path)], capsys)
    assert code == 0, err
    for name in ("audit.md", "audit.html", "heatmap_rel_l2.png", "heatmap_rel_l2.svg", "channel_amax.png"):
        # the same bytes as the audit wrote: the report depends on the dataset alone
        assert (tmp_path / name).read_bytes() == (audit_run / name).read_bytes(), name
    html = (tmp_path / "audit.html").read_text()
    _self_contained(html)
    assert "Recommendation per layer</h2>" in html and "Riskiest layers and heads</h2>" in html
    assert html.index("<img ") < html.index("Riskiest layers and heads</h2>")  # figures before the long tables
    assert not (tmp_path / "report.md").exists()


def test_validation_report_has_a_figure_and_the_same_text_from_report(tmp_path, capsys):
    code, out, err = run_cli(["validate", "--grid", "tiny", "--backend", "fa3-mock", "--device", "cpu", "--acc",
                              "fp32,fp22", "--out", str(tmp_path / "v")], capsys)
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("wrote ")
    html = (tmp_path / "v" / "validation.html").read_text()
    _self_contained(html)
    assert html.count("<img ") == 1 and (tmp_path / "v" / "fidelity.svg").is_file()
    assert html.index("Which accumulator model") < html.index("<img ") < html.index("Every case</h2>")
    code, _, err = run_cli(["report", str(tmp_path / "v" / "validation.nc"), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    assert (tmp_path / "r" / "validation.html").read_text() == html


@pytest.mark.skipif(not (H200 / "validation.nc").is_file(), reason="the committed H200 datasets are not here")
def test_h200_datasets_render_on_one_page(tmp_path, capsys):
    """Datasets written before the current conventions (the H200 run's) render, several on one page."""
    code, out, err = run_cli(["report", str(H200 / "table3_hardware.nc"), str(H200 / "validation.nc"),
                              "--out", str(tmp_path)], capsys)
    assert code == 0, err
    html = (tmp_path / "report.html").read_text()
    _self_contained(html)
    assert "table3_hardware.nc: outliers" in html and "validation.nc: Validation" in html
    assert "fa3:fa3-fp8-no-block-quant" in html and "fp22" in html
    figures = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    assert figures == ["p1_inputs_hist.png", "p1_variants.png", "p2_fidelity.png"]
