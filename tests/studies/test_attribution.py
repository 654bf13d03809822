"""Error attribution: single-stage recipes, and shares computed from an ablation dataset."""

import numpy as np
import pytest
import torch

from fa3_numerics.data import distributions
from fa3_numerics.studies.attribution import STAGES, attribution_table, exact_recipe, stage_recipe
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.granularity import PerBlock, PerHead
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.reference import reference_attention

FA3 = Recipe.from_str("fa3-fp8,acc=fp22")


def test_exact_recipe_is_float32_everywhere():
    e = exact_recipe(FA3)
    assert (e.qk, e.v, e.p, e.acc, e.out, e.rot) == ("fp32", "fp32", "fp32", "fp32", "fp32", "none")
    assert (e.algo, e.order, e.bm, e.bn) == (FA3.algo, FA3.order, FA3.bm, FA3.bn)


@pytest.mark.parametrize("stage,low", [
    ("qk", {"qk": "e4m3", "gran": PerBlock(), "rot": "hadamard"}),
    ("v", {"v": "e4m3", "gran": PerBlock()}),
    ("p", {"p": "e4m3", "p_offset": 8.0}),
    ("out", {"out": "bf16"}),
])
def test_each_stage_recipe_keeps_only_its_stage_low(stage, low):
    r = stage_recipe(FA3, stage)
    for field, value in low.items():
        assert getattr(r, field) == value
    narrow = {f for f in ("qk", "v", "p", "out") if getattr(r, f) != "fp32"} | ({"acc"} if r.acc != "fp32" else set())
    assert narrow == ({stage} if stage != "qk" else {"qk"})
    if stage not in ("qk",):
        assert r.rot == "none"


def test_accumulator_stage_is_the_floor_or_the_fp32_baseline():
    r = Recipe.from_str("fa3-fp8")
    assert stage_recipe(r, "acc") == exact_recipe(r)
    # The MMA model needs FP8 operands: its stage is measured against the same recipe at acc=fp32.
    assert stage_recipe(FA3, "acc") == Recipe.from_str("fa3-fp8")
    with pytest.raises(ValueError):
        stage_recipe(r, "softmax")


def test_stage_errors_on_outlier_data_add_up_to_the_full_error():
    shape = distributions.AttnShape(1, 2, 512, 64)
    q, k, v = distributions.generate("outliers", shape, 0)
    qi = torch.arange(0, 512, 8)
    ref = reference_attention(q, k, v, q_index=qi)
    r = Recipe.from_str("fa3-fp8,bm=192,bn=160")
    mse = lambda rec: float(((emulate(rec, q, k, v, q_index=qi, cache={}) - ref) ** 2).mean())  # noqa: E731
    floor = mse(exact_recipe(r))
    stages = {s: mse(stage_recipe(r, s)) for s in STAGES}
    assert floor < 1e-12
    assert all(stages[s] > 100 * floor for s in ("qk", "v", "p", "out"))
    assert 0.5 < mse(r) / sum(stages.values()) < 2.0


def test_attribution_table_shares_sum_to_one(tiny_ablation_ds):
    att = attribution_table(tiny_ablation_ds, n_boot=100)
    assert set(att["stage"]) == set(STAGES)
    sums = att.groupby(["data", "seqlen", "variant"])["share"].sum()
    assert np.allclose(sums.values, 1.0)
    assert ((att["share_lo"] <= att["share"] + 1e-12) & (att["share"] <= att["share_hi"] + 1e-12)).mean() > 0.9
    full = att[att["stage"] == "qk"]
    assert (full["additivity"] > 0.3).all() and (full["additivity"] < 3).all()
    assert set(att["variant"]) == {str(v) for v, s in zip(tiny_ablation_ds["variant"].values,
                                                          tiny_ablation_ds["stage"].values) if s == "full"}


@pytest.fixture(scope="module")
def tiny_ablation_ds(ablation_toml, threads):
    """The core design (gran x rot) on the paper's outliers at seqlen 192, seeds 0 and 1, run
    in-process on one thread."""
    from fa3_numerics.studies.ablation import load_ablation, run_ablation

    path = ablation_toml(description="tiny", shape={"seqlen": [192]}, run={"seeds": [0, 1]})
    with threads(1):
        return run_ablation(load_ablation(str(path)), workers=0, progress=lambda m: None)


__all__ = ["PerHead"]
