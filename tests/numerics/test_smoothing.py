"""Smoothing of K (and Q) is exact in float64: the attention it feeds is unchanged, and the
qk correction term reconstructs S."""

import math

import pytest
import torch

from fa3_numerics.data import distributions
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.formats import round_to_format
from fa3_numerics.numerics.reference import expand_kv, reference_attention
from fa3_numerics.numerics.smoothing import SMOOTHINGS, bias_rows, qk_smoothing_bias, smooth_k, smooth_q


@pytest.fixture
def qkv():
    # K with a large per-channel mean (the failure K smoothing is for), GQA 4 query heads on 2 K heads
    shape = distributions.AttnShape(2, 4, 200, 64, kv_heads=2)
    q, k, v = distributions.generate("k-bias", shape, 0, channels=3, bias=20.0)
    return q, k, v


def test_smooth_k_removes_the_token_mean_per_kv_head_and_channel(qkv):
    _, k, _ = qkv
    ks, mu = smooth_k(k)
    assert mu.shape == (2, 2, 1, 64)
    assert torch.equal(mu, k.mean(dim=2, keepdim=True))
    assert ks.mean(dim=2).abs().max().item() < 1e-13
    assert torch.allclose(ks + mu, k, rtol=0, atol=1e-13)
    assert ks.abs().amax().item() < 0.5 * k.abs().amax().item()  # the shared offset no longer sets the amax


@pytest.mark.parametrize("causal", [False, True])
def test_k_smoothing_leaves_softmax_and_attention_unchanged_in_float64(qkv, causal):
    q, k, v = qkv
    ks, mu = smooth_k(k)
    scale = 1 / math.sqrt(64)
    s = q @ expand_kv(k, 4).transpose(-1, -2) * scale
    s2 = q @ expand_kv(ks, 4).transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(200, 200, dtype=torch.bool).tril()
        s, s2 = s.masked_fill(~mask, -math.inf), s2.masked_fill(~mask, -math.inf)
    # the shift is one constant per query row, q . mu, over the visible keys
    row = q @ expand_kv(mu, 4).transpose(-1, -2) * scale
    vis = torch.isfinite(s)
    assert torch.allclose((s - s2)[vis], row.expand_as(s)[vis], rtol=0, atol=1e-11)
    assert row.abs().max().item() > 10  # a large shift, removed exactly
    p, p2 = torch.softmax(s, -1), torch.softmax(s2, -1)
    assert (p - p2).abs().max().item() < 1e-14
    o = reference_attention(q, k, v, causal=causal)
    o2 = reference_attention(q, ks, v, causal=causal)
    assert (o - o2).abs().max().item() < 1e-13


def test_smooth_q_per_block_means(qkv):
    q, _, _ = qkv
    qs, qm = smooth_q(q, 64)  # 200 rows: blocks of 64, 64, 64 and a short 8
    assert qm.shape == (2, 4, 4, 64)
    for b, (s0, s1) in enumerate([(0, 64), (64, 128), (128, 192), (192, 200)]):
        assert torch.allclose(qm[:, :, b], q[:, :, s0:s1].mean(dim=2), rtol=0, atol=1e-15)
        assert qs[:, :, s0:s1].mean(dim=2).abs().max().item() < 1e-14
    with pytest.raises(UsageError):
        smooth_q(q, 0)


def test_qk_correction_reconstructs_s_exactly_on_dyadic_data():
    """Integer Q, K and power-of-two blocks: every mean and product is exact in float64, so
    Q' K'^T + delta_s equals Q K'^T bit for bit."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-50, 51, (1, 2, 256, 32), generator=g).double()
    k = torch.randint(-50, 51, (1, 2, 128, 32), generator=g).double() + 7
    ks = k - k.mean(dim=2, keepdim=True)  # mean of 128 integers: exact (a multiple of 2^-7)
    qs, qm = smooth_q(q, 128)
    ds = qk_smoothing_bias(qm, ks, "fp64")
    assert ds.shape == (1, 2, 2, 128)
    s = qs @ ks.transpose(-1, -2) + bias_rows(ds, torch.arange(256), 128)
    assert torch.equal(s, q @ ks.transpose(-1, -2))


def test_qk_correction_reconstructs_s_to_rounding_with_gqa(qkv):
    q, k, _ = qkv
    ks, _ = smooth_k(k)
    qs, qm = smooth_q(q, 128)
    ds = qk_smoothing_bias(qm, ks, "fp64")
    assert ds.shape == (2, 4, 2, 200)
    ke = expand_kv(ks, 4)
    full = q @ ke.transpose(-1, -2)
    rec = qs @ ke.transpose(-1, -2) + bias_rows(ds, torch.arange(200), 128)
    assert (rec - full).abs().max().item() <= 1e-12 * full.abs().max().item()
    rows = torch.tensor([0, 127, 128, 199])
    assert torch.equal(bias_rows(ds, rows, 128), ds[:, :, [0, 0, 1, 1]])
    # attention with the correction is attention without smoothing
    sc = 1 / 8
    p_ref = torch.softmax(q @ expand_kv(k, 4).transpose(-1, -2) * sc, -1)
    assert (torch.softmax(rec * sc, -1) - p_ref).abs().max().item() < 1e-14


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_correction_is_rounded_once_to_its_format(qkv, fmt):
    q, k, _ = qkv
    ks, _ = smooth_k(k)
    _, qm = smooth_q(q, 128)
    exact = qk_smoothing_bias(qm, ks, "fp64")
    assert torch.equal(qk_smoothing_bias(qm, ks, fmt), round_to_format(exact, fmt))


def test_smoothing_names_and_gqa_check():
    assert SMOOTHINGS == ("none", "k", "qk")
    with pytest.raises(UsageError):
        qk_smoothing_bias(torch.zeros(1, 3, 1, 8), torch.zeros(1, 2, 4, 8))
