"""Granularities: which elements share a scale, checked against loop references and the MMA
fragment layout they come from."""

import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import (PerBlock, PerChannel, PerGroup, PerHead, PerTensor, PerThread, PerToken,
                                               amax, expand_groups, group_amax, parse_granularity,
                                               sage2_thread_granularities, thread_granularities)


@pytest.fixture
def x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 150, 40, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("gran,shape", [
    (PerTensor(), (1, 1, 1, 1)), (PerHead(), (2, 3, 1, 1)), (PerToken(), (2, 3, 150, 1)),
    (PerBlock(64), (2, 3, 150, 1)), (PerChannel(), (2, 3, 1, 40)), (PerThread(32, 1), (2, 3, 150, 1)),
    (PerThread(64, 2), (2, 3, 150, 1)), (PerGroup(16), (2, 3, 150, 40)), (PerGroup(32, 2), (2, 3, 150, 40)),
])
def test_amax_broadcasts_against_x(x, gran, shape):
    a = amax(x, gran)
    assert a.shape == shape
    assert torch.all(a >= 0) and torch.all(x.abs() <= a)  # every element is within its group's amax


def _thread_ref(x: torch.Tensor, block: int, width: int) -> torch.Tensor:
    """Loop reference: token t's group is (t // block, (t % 8) // width)."""
    n = x.shape[2]
    key = [(t // block, (t % 8) // width) for t in range(n)]
    out = torch.empty(x.shape[:3] + (1,), dtype=x.dtype)
    tok = x.abs().amax(dim=3)
    for t in range(n):
        members = [s for s in range(n) if key[s] == key[t]]
        out[:, :, t, 0] = tok[:, :, members].amax(dim=2)
    return out


@pytest.mark.parametrize("block,width", [(32, 1), (16, 1), (64, 2), (128, 2), (64, 4)])
def test_per_thread_matches_loop_reference(x, block, width):
    assert torch.equal(amax(x, PerThread(block, width)), _thread_ref(x, block, width))


def test_per_thread_scale_counts_match_sageattention_scale_shapes():
    # quant_per_thread.py: Q scales per (blk, 8 lanes) -> ceil(L / BLKQ) * (BLKQ / WARPQ) * 8 values;
    # K scales -> ceil(L / BLKK) * (BLKK / WARPK) * 4 values
    n = 256
    x = torch.arange(1, n + 1, dtype=torch.float64).reshape(1, 1, n, 1)  # distinct amax per token
    qg, kg = sage2_thread_granularities("sm89")
    assert (qg, kg) == (PerThread(32, 1), PerThread(64, 2))
    assert amax(x, qg).unique().numel() == (n // 128) * (128 // 32) * 8
    assert amax(x, kg).unique().numel() == (n // 64) * (64 // 64) * 4
    assert sage2_thread_granularities("sm90") == (PerThread(16, 1), PerThread(128, 2))


def test_per_thread_groups_are_the_mma_accumulator_fragments():
    """The m16n8 accumulator fragment (mma.m16n8k32 INT8 and m16n8k64 INT4 share it): lane l holds
    rows l//4 and l//4 + 8 of each 16-row tile, columns 2(l%4) and 2(l%4)+1 of each 8-column tile.
    A warp of SageAttention2 covers WARPQ = 32 query rows (two m-tiles) and a 64-key block (eight
    n-tiles). The rows (keys) one lane holds must be exactly one Q (K) scale group."""
    qg, kg = PerThread(32, 1), PerThread(64, 2)
    tokens = torch.arange(64, dtype=torch.float64).reshape(1, 1, 64, 1) + 1
    qgroup = amax(tokens[:, :, :32], qg).flatten().tolist()  # the amax names the group (distinct per group)
    kgroup = amax(tokens, kg).flatten().tolist()
    for lane in range(32):
        rows = [lane // 4 + 8 * i + 16 * m for m in range(2) for i in range(2)]
        cols = [2 * (lane % 4) + j + 8 * nt for nt in range(8) for j in range(2)]
        assert len({qgroup[r] for r in rows}) == 1
        assert len({kgroup[c] for c in cols}) == 1
        # and nothing else is in the lane's groups
        assert sorted(r for r in range(32) if qgroup[r] == qgroup[rows[0]]) == sorted(rows)
        assert sorted(c for c in range(64) if kgroup[c] == kgroup[cols[0]]) == sorted(cols)


@pytest.mark.parametrize("size,axis", [(16, -1), (32, -1), (7, -1), (32, 2), (64, 2)])
def test_group_amax_matches_loop_reference(x, size, axis):
    c = group_amax(x, size, axis)
    ax = axis % 4
    n = x.shape[ax]
    assert c.shape[ax] == -(-n // size)
    for gi in range(c.shape[ax]):
        chunk = x.narrow(ax, gi * size, min(size, n - gi * size)).abs().amax(dim=ax)
        assert torch.equal(c.select(ax, gi), chunk)
    full = amax(x, PerGroup(size, axis))
    assert torch.equal(full, expand_groups(c, size, axis, n))


def test_per_channel_is_amax_over_tokens(x):
    assert torch.equal(amax(x, PerChannel()), x.abs().amax(dim=2, keepdim=True))


def test_recipe_strings_name_thread_and_channel_but_not_explicit_groups():
    # ``thread`` is SageAttention2's layout at the recipe's tiles (Q and K groups differ, so an
    # explicit size would be ambiguous); microscaling groups come with the formats (qk=mxfp8)
    assert parse_granularity("thread") == PerThread(0) and PerThread(0).short_str() == "thread"
    assert parse_granularity("channel") == PerChannel()
    for text in ("thread32", "group32"):
        with pytest.raises(UsageError):
            parse_granularity(text)
    assert PerThread(64, 2).short_str() == "thread64x2" and PerGroup(32, 2).short_str() == "group32@2"
    with pytest.raises(UsageError, match="thread_granularities"):
        amax(torch.ones(1, 1, 8, 4), PerThread(0))


def test_thread_granularities_follow_the_tiles():
    assert thread_granularities(128, 64) == sage2_thread_granularities("sm89")
    assert thread_granularities(64, 128) == sage2_thread_granularities("sm90")
    for bm, bn in ((48, 64), (128, 60)):
        with pytest.raises(UsageError, match="gran=thread"):
            thread_granularities(bm, bn)


@pytest.mark.parametrize("bad", [lambda: PerThread(12), lambda: PerThread(32, 3), lambda: PerGroup(0),
                                 lambda: sage2_thread_granularities("sm70")])
def test_bad_granularities_are_refused(bad):
    with pytest.raises(UsageError):
        bad()


def test_nan_propagates_through_group_amax():
    t = torch.zeros(1, 1, 4, 32, dtype=torch.float64)
    t[0, 0, 1, 3] = torch.nan
    c = group_amax(t, 16, -1)
    assert torch.isnan(c[0, 0, 1, 0]) and not torch.isnan(c[0, 0, 1, 1]) and not torch.isnan(c[0, 0, 0]).any()
    assert c.shape == (1, 1, 4, 2)
