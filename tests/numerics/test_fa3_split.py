"""splitkv=fa3: FA3's num_splits=0 split-KV for every query row (numerics/fa3_split.py)."""

from __future__ import annotations

import math

import torch

from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.reference import reference_attention
from fa3_numerics.numerics.split_kv import fa3_num_splits


def _qkv(h, hkv, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, h, n, d, generator=g, dtype=torch.float64),
            torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64),
            torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64))


def test_the_shapes_split():
    # torchao's failing shapes on the H200: 8 heads at seqlen 1000 (d 128) and 2048 (d 64); 333 does not split
    assert fa3_num_splits(batch=1, kv_heads=8, heads=8, seqlen_q=1000, seqlen_k=1000, block_m=128, block_n=224,
                          head_dim=128, fp8=True, causal=False) > 1
    assert fa3_num_splits(batch=1, kv_heads=8, heads=8, seqlen_q=2048, seqlen_k=2048, block_m=192, block_n=160,
                          head_dim=64, fp8=True, causal=False) > 1
    assert fa3_num_splits(batch=1, kv_heads=8, heads=8, seqlen_q=333, seqlen_k=333, block_m=128, block_n=224,
                          head_dim=128, fp8=True, causal=False) == 1


def test_split_rows_are_attention_in_exact_formats():
    # per-query-tile causal ranges, PackGQA and the combine: exact attention with float32 operands
    for h, hkv in ((1, 1), (4, 2)):
        q, k, v = _qkv(h, hkv, 1000, 128)
        for causal in (False, True):
            stats: dict = {}
            o = emulate(Recipe.from_str("exact,splitkv=fa3"), q, k, v, causal=causal, stats=stats)
            assert (o - reference_attention(q, k, v, causal=causal)).abs().max() < 1e-5, (h, causal)
            s = (q @ k.repeat_interleave(h // hkv, 1).transpose(-1, -2)) / math.sqrt(128)
            if causal:
                s = s.masked_fill(~torch.ones(1000, 1000, dtype=torch.bool).tril(), -math.inf)
            assert (stats["lse"].double() - torch.logsumexp(s, -1)).abs().max() < 1e-4


def test_splits_change_fp8_bits_only_where_fa3_splits():
    q, k, v = _qkv(1, 1, 1000, 128, seed=1)
    base = "fa3-fp8-kernel,acc=fp32"
    none = emulate(Recipe.from_str(base), q, k, v)
    split = emulate(Recipe.from_str(base + ",splitkv=fa3"), q, k, v)
    assert (none != split).double().mean() > 0.1  # each split quantizes P~ against its own running max
    ref = reference_attention(q, k, v)
    assert (split - ref).pow(2).mean().sqrt() < 1.2 * (none - ref).pow(2).mean().sqrt()
    q, k, v = _qkv(1, 1, 333, 128, seed=1)  # two KV tiles: FA3 does not split
    assert torch.equal(emulate(Recipe.from_str(base), q, k, v), emulate(Recipe.from_str(base + ",splitkv=fa3"), q, k, v))
