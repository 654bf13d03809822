"""Split-KV decode: FA3's split ranges, heuristic and combine."""

from __future__ import annotations

import math

import torch

from fa3_numerics.data.distributions import AttnShape
from fa3_numerics.data.distributions.needle import PARAMS, plant
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.split_kv import combine, emulate_split, fa3_num_splits, split_ranges


def test_split_ranges_cut_whole_tiles_as_block_h():
    assert split_ranges(1000, 224, 2) == [(0, 672), (672, 1000)]
    assert split_ranges(5 * 224, 224, 4) == [(0, 448), (448, 896), (896, 1120), (0, 0)]  # the last one empty
    assert split_ranges(300, 224, 1) == [(0, 300)]


def test_heuristic_splits_a_lone_decode_and_not_a_full_batch():
    kw = dict(heads=2, seqlen_q=1, seqlen_k=131072, block_m=128, block_n=224, head_dim=128)
    assert fa3_num_splits(batch=1, kv_heads=2, **kw) == 57  # ceil(0.85 * 132 / 2)
    assert fa3_num_splits(batch=128, kv_heads=2, **kw) == 1
    assert fa3_num_splits(batch=1, kv_heads=2, **(kw | dict(seqlen_k=800))) == 1  # <= 4 KV tiles


def test_combine_of_exact_partials_is_exact():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 1, 1, 900, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 1, 900, 16, generator=g, dtype=torch.float64)
    want = torch.matmul(torch.softmax(s, -1), v)
    parts, lses = [], []
    for k0, k1 in ((0, 300), (300, 800), (800, 900)):
        parts.append(torch.matmul(torch.softmax(s[..., k0:k1], -1), v[:, :, k0:k1]).float())
        lses.append(torch.logsumexp(s[..., k0:k1], -1).float())
    parts.append(torch.zeros_like(parts[0]))
    lses.append(torch.full_like(lses[0], -math.inf))  # an empty split adds nothing
    got = combine(torch.stack(parts), torch.stack(lses))
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def _needle(n=3000):
    return plant(AttnShape(2, 2, 1, 128, seqlen_k=n), 0, **({k: v[0] for k, v in PARAMS.items()} | dict(vmean=2.0)))


def test_one_split_is_the_plain_pass_and_fp32_splits_agree_with_it():
    p = _needle()
    r = Recipe.from_str("fa3-fp8-kernel")
    assert torch.equal(emulate_split(r, p.q, p.k, p.v, num_splits=1), emulate(r, p.q, p.k, p.v, causal=True))
    r32 = Recipe.from_str("fa3-fp8-kernel,acc=fp32")
    a = emulate(r32, p.q, p.k, p.v, causal=True)
    b = emulate_split(r32, p.q, p.k, p.v, num_splits=5)
    assert not torch.equal(a, b)  # the combine rounds differently...
    assert float((a - b).abs().max()) < 2e-2 * float(a.abs().max())  # ...by BF16 ulps only


def test_splits_shorten_the_fp22_chain():
    """With a V mean the unbroken FP22 chain drops small increments; splits bound its length."""
    p = _needle(6000)
    ref = emulate(Recipe.from_str("exact"), p.q, p.k, p.v, causal=True)
    err = lambda o: float(((o - ref) ** 2).mean().sqrt())  # noqa: E731
    r = Recipe.from_str("fa3-fp8-kernel")
    assert err(emulate_split(r, p.q, p.k, p.v, num_splits=8)) < 0.7 * err(emulate_split(r, p.q, p.k, p.v, num_splits=1))
