"""The retrieval metric: 1 where the needle arrives, low where a recipe drops it."""

from __future__ import annotations

import torch

from fa3_numerics.data.distributions import AttnShape
from fa3_numerics.data.distributions.needle import PARAMS, plant
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.metrics.retrieval import retrieval
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.reference import reference_attention

DEFAULTS = {k: v[0] for k, v in PARAMS.items()}


def _score(p, o):
    ref = reference_attention(p.q, p.k, p.v, causal=True)
    return retrieval(o, ref, p.u, p.decoy_u, p.v_norm, p.weight, p.decoy_weight)


def test_exact_output_scores_one():
    p = plant(AttnShape(1, 2, 3, 64, seqlen_k=1500), 0, **DEFAULTS)
    m = _score(p, reference_attention(p.q, p.k, p.v, causal=True))
    assert torch.allclose(m.share, torch.ones_like(m.share)) and torch.allclose(m.margin, torch.ones_like(m.margin))
    assert bool((m.top == 1).all()) and bool((m.rank == 1).all()) and float(m.row_rel_rmse.max()) == 0.0


def test_output_without_the_needle_scores_zero_and_a_decoy_wins():
    p = plant(AttnShape(1, 2, 1, 64, seqlen_k=1500), 0, **DEFAULTS)
    v = p.v.clone()
    v[:, :, p.needle] -= p.v_norm * p.u  # the needle's value gone, its attention kept
    o = reference_attention(p.q, p.k, v, causal=True)
    m = _score(p, o)
    assert float(m.share.abs().max()) < 1e-6 and bool((m.top == 0).all()) and bool((m.rank > 1).all())


def test_negative_control_a_recipe_whose_p_underflows_drops_the_needle():
    """A small needle behind a sink, KV tiles visited first to last so that the sink has set the
    running max when the needle's tile arrives: with FA3's offset (P~ up to 2^8) the needle's P
    survives the e4m3 cast; with no offset (P~ in [0, 1]) it is below e4m3's smallest subnormal and
    the needle is lost, which the metric must show."""
    p = plant(AttnShape(1, 2, 1, 128, seqlen_k=4096), 0,
              **(DEFAULTS | dict(weight=8e-4, sink=0.95, sink_v=0.0, vmean=0.0, decoys=2, decoy_ratio=0.5)))
    kept = _score(p, emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32,order=forward"), p.q, p.k, p.v, causal=True))
    lost = _score(p, emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32,order=forward,poff=0"), p.q, p.k, p.v, causal=True))
    assert float(kept.share.min()) > 0.8 and bool((kept.top == 1).all())
    assert float(lost.share.abs().max()) < 0.05 and bool((lost.top == 0).all())


def test_nonfinite_output_is_nan_not_a_score():
    p = plant(AttnShape(1, 1, 2, 64, seqlen_k=600), 0, **DEFAULTS)
    o = reference_attention(p.q, p.k, p.v, causal=True)
    o[0, 0, 1, 3] = float("nan")
    m = _score(p, o)
    assert torch.isnan(m.share[0, 0, 1]) and not torch.isnan(m.share[0, 0, 0]) and float(m.top[0, 0, 1]) == 0
