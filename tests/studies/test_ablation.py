"""The factorial ablation: definition, overrides, dataset layout, caching and the CLI."""

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fa3_numerics.studies.ablation import FACTORS, factor_recipe, load_ablation, run_ablation, variant_label
from fa3_numerics.cli import app
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerToken
from fa3_numerics.numerics.recipe import Recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # cells in-process, as one single-threaded dask worker runs them


@pytest.fixture()
def tiny(ablation_toml):
    """Two data (the paper's outliers, sink tokens), seqlen 128 and 192; the core design
    (gran x rot) and an accumulator design on sink tokens at seqlen 128 only."""
    return str(ablation_toml(
        data=(("outliers", {"p": [0.001], "sigma": [10.0]}), ("sink-tokens", None)),
        shape={"seqlen": [128, 192]},
        designs=[{"name": "core", "gran": ["tensor", "block"], "rot": ["none", "hadamard"]},
                 {"name": "accumulator", "gran": ["block"], "acc": ["fp32", "fp22"], "seqlen": [128],
                  "data": ["sink-tokens"]}]))


def test_factor_levels_are_recipe_fragments():
    r = factor_recipe({"gran": "block32", "rot": "orthogonal", "p": "scale448", "acc": "two-level", "fmt": "vp-e5m2"})
    assert (r.gran, r.rot, r.acc, r.v, r.p, r.qk) == (PerBlock(32), "orthogonal", "two-level", "e5m2", "e5m2", "e4m3")
    assert 2 ** r.p_offset == pytest.approx(448, rel=1e-5)
    assert factor_recipe({"p": "no-offset"}).p_offset == 0 and factor_recipe({"p": "offset8"}).p_offset == 8
    assert factor_recipe({"gran": "token"}).gran == PerToken()
    assert factor_recipe({}) == Recipe.from_str("fa3-fp8-kernel")
    with pytest.raises(UsageError):
        factor_recipe({"p": "offset9"})
    with pytest.raises(UsageError):
        factor_recipe({"gran": "blocky"})


def test_default_definition_loads():
    ab = load_ablation("ablation")
    assert [d.name for d in ab.designs] == ["core", "scale", "accumulator", "format", "shape", "field"]
    assert ab.head_dim[0] == 128 and ab.causal[0] is False and {64, 128} <= set(ab.head_dim)
    assert sum(d.paper for d in ab.data) == 1
    assert {d.dist for d in ab.data} >= {"outliers", "channel-outliers", "sink-tokens", "student-t"}
    core = ab.designs[0]
    assert len(core.variants()) == 45
    assert "block|hadamard|offset8|fp32|e4m3|pow2" in ab.full and "head|none|offset8|fp22|e4m3|amax" in ab.full
    assert len(ab.seqlen) >= 3  # the seqlen trend needs several
    # the field design runs on k-bias data; the designs before it keep their data
    field = ab.designs[-1]
    assert len(field.variants()) == 48 and {"k-bias bias=8", "k-bias bias=20"} <= set(field.data)
    assert all(not any(x.startswith("k-bias") for x in d.data or []) and d.data for d in ab.designs[:-1])
    assert "block|hadamard|offset8|fp32|e4m3|amax|qkfmt=int8|smooth=k" in ab.full


def test_overrides_replace_levels_and_select(tiny):
    ab = load_ablation(tiny, {"gran": ["head", "token"], "seqlen": [128], "data": ["sink"]})
    assert [d.label for d in ab.data] == ["sink-tokens"]
    assert ab.designs[0].levels["gran"] == ["head", "token"]
    assert ab.designs[1].levels["gran"] == ["block"]  # a design that does not vary gran keeps its level
    assert ab.seqlen == [128]
    assert len(load_ablation(tiny, {"designs": ["core"]}).designs) == 1
    with pytest.raises(UsageError, match="matches no data"):
        load_ablation(tiny, {"data": ["nothing"]})
    with pytest.raises(UsageError):
        load_ablation(tiny, {"rot": ["none", "spin"]})
    with pytest.raises(UsageError, match="unknown experiment"):
        load_ablation("no-such-experiment")


@pytest.mark.slow
def test_dataset_layout_and_cache(tiny, tmp_path):
    ab = load_ablation(tiny)
    msgs = []
    ds = run_ablation(ab, cache_dir=tmp_path / "cells", workers=0, progress=msgs.append)
    assert ds["rmse"].dims == ("data", "seqlen", "head_dim", "causal", "variant", "seed", "batch", "head")
    assert ds["abs_hist"].dims == ("data", "seqlen", "head_dim", "causal", "seed", "tensor", "abs_bin")
    full = [str(v) for v, s in zip(ds["variant"].values, ds["stage"].values) if s == "full"]
    assert len(full) == 5 and set(ds["stage"].values) == {"full", "qk", "v", "p", "out", "exact"}
    for f in FACTORS:
        assert f in ds.coords
    for v in full:
        levels = {f: str(ds[f].sel(variant=v).item()) for f in FACTORS}
        assert variant_label(levels) == v
        assert Recipe.from_str(str(ds["spec"].sel(variant=v).item())) == factor_recipe(levels)
    # The accumulator design asked for sink-tokens at seqlen 128 only.
    fp22 = ds["rmse"].sel(variant="block|none|offset8|fp22|e4m3|amax")
    assert np.isfinite(fp22.sel(data="sink-tokens", seqlen=128)).all()
    assert np.isnan(fp22.sel(data="sink-tokens", seqlen=192)).all() and np.isnan(fp22.sel(data=ds["data"][0])).all()
    assert np.isfinite(ds["rmse"].sel(variant=full[:4])).all()
    assert bool(ds["paper_data"][0]) and not bool(ds["paper_data"][1])
    # The MMA accumulator's attribution is measured against the same recipe at acc=fp32.
    from fa3_numerics.studies.attribution import attribution_table

    assert str(ds["stage_of_acc"].sel(variant="block|none|offset8|fp22|e4m3|amax").item()) == "block|none|offset8|fp32|e4m3|amax"
    att = attribution_table(ds, n_boot=20)
    acc = att[(att["stage"] == "acc")].set_index("variant")
    assert acc.loc["block|none|offset8|fp22|e4m3|amax", "measured"] == "difference"
    assert (acc["mse"] >= 0).all() and (acc.drop("block|none|offset8|fp22|e4m3|amax")["measured"] == "alone").all()
    # Every finished cell is cached: a rerun computes nothing and gives the same numbers.
    again = run_ablation(ab, cache_dir=tmp_path / "cells", workers=0, progress=msgs.append)
    assert again.attrs["cells_reused"] == sum(np.isfinite(ds["rmse"].isel(batch=0, head=0)).values.ravel())
    for m in ds.data_vars:
        np.testing.assert_array_equal(ds[m].values, again[m].values)


@pytest.mark.slow
def test_cli_run_ablation_writes_dataset_and_report(tiny, tmp_path):
    res = CliRunner().invoke(app, ["run", "ablation", "--experiment", tiny, "--workers", "0", "--designs", "core",
                                   "--seqlen", "128,192", "--out", str(tmp_path / "res"), "--report",
                                   str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "res" / "tiny.nc").is_file()
    md = (tmp_path / "rep" / "report.md").read_text()
    for needle in ("Paper finding", "Block quantization", "## Main effects", "## Two-way interactions",
                   "Attribution", "seqlen.png", "interactions.png", "attribution_", "## Provenance"):
        assert needle in md, needle
    assert (tmp_path / "rep" / "attribution.csv").is_file()


def test_cli_refuses_bad_options_in_one_line(tiny):
    from fa3_numerics.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "ablation", "--experiment", tiny, "--workers", "-1"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_capture_file_as_data(tiny, tmp_path):
    pytest.importorskip("safetensors")
    from fa3_numerics.data import distributions
    from fa3_numerics.data.capture import FORMAT, REQUIRED_META, save_capture

    g = torch.Generator().manual_seed(0)
    tensors = {"layers.0.q": torch.randn(4, 160, 64, generator=g), "layers.0.k": torch.randn(2, 160, 64, generator=g),
               "layers.0.v": torch.randn(2, 160, 64, generator=g)}
    meta = {k: "x" for k in REQUIRED_META} | {"format": FORMAT, "layers": "0", "num_layers": "1", "heads": "4",
                                             "kv_heads": "2", "head_dim": "64", "tokens": "160", "causal": "true",
                                             "softmax_scale": repr(0.125)}
    path = tmp_path / "cap.safetensors"
    save_capture(path, tensors, meta)
    ab = load_ablation(tiny, {"capture": str(path), "designs": ["core"], "attribution": False})
    item = ab.data[-1]
    assert item.dist == f"capture-file:{path}" and item.feasible(128, 64) and not item.feasible(192, 64)
    q, k, v = distributions.generate(item.dist, distributions.AttnShape(1, 2, 128, 64), 1, layer=0)
    # Seed 1 with 2 heads per draw takes query heads 2 and 3, which share K/V head 1.
    assert torch.equal(q[0], tensors["layers.0.q"][2:4, :128].double())
    assert torch.equal(k[0, 0], tensors["layers.0.k"][1, :128].double()) and torch.equal(k[0, 0], k[0, 1])
    ds = run_ablation(ab, workers=0, progress=lambda m: None)
    cap = ds["rmse"].sel(data=item.label)
    assert np.isfinite(cap.sel(seqlen=128)).all() and np.isnan(cap.sel(seqlen=192)).all()
