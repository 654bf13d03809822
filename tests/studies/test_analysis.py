"""Analysis of an ablation dataset (studies.effects, studies.ablation_findings, report.ablation): effects,
interactions and findings recover known structure."""

import numpy as np
import pytest
import xarray as xr

from fa3_numerics.report import ablation as R
from fa3_numerics.studies import ablation_findings as F
from fa3_numerics.studies import effects as A

DATA = ["outliers p=0.001,sigma=10", "channel-outliers"]  # the data of conftest's synthetic_ablation


@pytest.fixture
def synthetic(synthetic_ablation):
    """The planted-effects dataset of conftest (``synthetic_ablation``)."""
    return synthetic_ablation


def test_main_effects_recover_the_planted_sizes(synthetic):
    fr = A.cell_frame(synthetic(), n_boot=50)
    me = A.main_effects(fr).set_index(["factor", "level"])
    # rot: 0.3 everywhere + 0.1 on half the data -> none vs hadamard differ by 0.35 in log10.
    assert me.loc[("rot", "none"), "size"] == pytest.approx(10 ** 0.35)
    assert me.loc[("gran", "tensor"), "size"] == pytest.approx(10 ** 0.03)
    assert me.loc[("seqlen", "512"), "ratio"] == pytest.approx(10 ** 0.025)
    assert me.loc[("rot", "none"), "sets"] == 2 * 2 * 2  # data x seqlen x gran
    assert me.loc[("rot", "none"), "lo"] == pytest.approx(me.loc[("rot", "none"), "ratio"])  # no sample noise


def test_interactions_find_the_planted_pair_only(synthetic):
    fr = A.cell_frame(synthetic(), n_boot=50)
    it = A.interactions(fr).set_index(["f", "g"])
    assert it.loc[("rot", "data"), "rms_log10"] == pytest.approx(0.1 / 4)
    assert it.loc[("gran", "rot"), "rms_log10"] == pytest.approx(0.0, abs=1e-12)
    assert it.index[0] == ("rot", "data")


def test_paper_finding_and_block_quant_statement(synthetic):
    ds = synthetic(gran_on_d2=0.1)
    fr = A.cell_frame(ds, n_boot=50)
    pf = A.paper_finding(fr, DATA[0])
    assert pf["all"]["rotation_gain"][0] == pytest.approx(10 ** 0.3)
    assert pf["all"]["block_gain"][0] == pytest.approx(10 ** 0.03)
    blk = A.block_quant_effect(fr)
    lines = F.summary_lines(ds, fr, A.main_effects(fr), A.per_data_effects(fr), blk, None)
    text = "\n".join(lines)
    assert "Paper finding reproduced" in text
    # Block vs tensor is 10^-0.03 (-7%) on the paper data and 10^-0.13 (-26%) on channel outliers.
    block_line = next(line for line in lines if line.startswith("- **Block quantization**"))
    assert "under: `channel-outliers`" in block_line and "nowhere else" in block_line and "-26%" in block_line
    assert "Every point estimate within 10%: `outliers p=0.001,sigma=10`" in block_line
    calm = F.summary_lines(synthetic(), fr, A.main_effects(fr), A.per_data_effects(fr),
                           A.block_quant_effect(A.cell_frame(synthetic(), n_boot=20)), None)
    assert any("nowhere in the grid" in line for line in calm)


def test_not_reproduced_when_block_beats_rotation(synthetic):
    ds = synthetic()
    ds["rmse"] = ds["rmse"] * xr.where((ds["gran"] == "tensor") & (ds["rot"] == "hadamard"), 10.0, 1.0)
    fr = A.cell_frame(ds, n_boot=20)
    lines = F.summary_lines(ds, fr, A.main_effects(fr), A.per_data_effects(fr), A.block_quant_effect(fr), None)
    assert any("Paper finding not reproduced" in line for line in lines)


def test_bootstrap_intervals_cover_the_point_with_noise(synthetic):
    fr = A.cell_frame(synthetic(noise=0.05), n_boot=200)
    me = A.main_effects(fr)
    assert ((me["lo"] <= me["ratio"]) & (me["ratio"] <= me["hi"])).all()
    assert (me["hi"] > me["lo"]).all()


@pytest.mark.slow
def test_report_renders_from_a_synthetic_dataset(tmp_path, synthetic):
    ds = synthetic(noise=0.02)
    ds.attrs.update({"description": "synthetic", "designs": "{}", "base_recipe": "fa3-fp8-kernel"})
    ds = ds.assign_coords(heads=4, batch_size=1, rows=16)
    md = R.render_report(ds, tmp_path, n_boot=50).read_text()
    assert "Paper finding reproduced" in md and "## Main effects" in md
    for png in ("main_effects.png", "interactions.png", "seqlen.png", "block_quant.png", "effects_per_data.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
