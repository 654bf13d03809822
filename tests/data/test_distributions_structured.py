"""The structured synthetic families: registered, seeded, shaped, and structured as documented."""

import math

import pytest
import torch

from fa3_numerics.data import distributions
from fa3_numerics.errors import UsageError

SHAPE = distributions.AttnShape(2, 4, 64, 32, kv_heads=2)


@pytest.mark.parametrize("name", ["channel-outliers", "sink-tokens", "student-t", "k-bias"])
def test_registered_seeded_and_shaped(name):
    assert name in distributions.available()
    q, k, v = distributions.generate(name, SHAPE, 3)
    assert q.shape == SHAPE.q_shape and k.shape == SHAPE.kv_shape and v.shape == SHAPE.kv_shape
    assert q.dtype == k.dtype == v.dtype == torch.float64
    again = distributions.generate(name, SHAPE, 3)
    other = distributions.generate(name, SHAPE, 4)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    assert not torch.equal(q, other[0])


def test_channel_outliers_scale_fixed_channels_of_k_and_q():
    shape = distributions.AttnShape(1, 4, 2048, 64, kv_heads=2)
    q, k, v = distributions.generate("channel-outliers", shape, 0, channels=3, scale=20.0, q_scale=5.0)
    kstd = k.std(dim=2)  # [B, Hkv, D]
    big = kstd > 5
    assert (big.sum(dim=-1) == 3).all()  # exactly 3 outlier channels per K/V head
    assert torch.allclose(kstd[big], torch.full_like(kstd[big], 20.0), rtol=0.1)
    qbig = q.std(dim=2) > 2.5
    # Q heads 0,1 share K/V head 0; their outlier channels are K's.
    assert torch.equal(qbig[:, 0], big[:, 0]) and torch.equal(qbig[:, 1], big[:, 0]) and torch.equal(qbig[:, 3], big[:, 1])
    assert v.std().item() == pytest.approx(1.0, rel=0.05)


def test_sink_tokens_scale_only_the_first_keys():
    base = distributions.generate("sink-tokens", SHAPE, 1, sinks=0, scale=10.0)
    q, k, v = distributions.generate("sink-tokens", SHAPE, 1, sinks=2, scale=10.0)
    assert torch.equal(k[:, :, :2], 10.0 * base[1][:, :, :2])
    assert torch.equal(k[:, :, 2:], base[1][:, :, 2:])
    assert torch.equal(q, base[0]) and torch.equal(v, base[2])


@pytest.mark.slow
def test_student_t_has_the_tails_of_its_df():
    from scipy.stats import t

    shape = distributions.AttnShape(1, 4, 4096, 64)
    q, _, _ = distributions.generate("student-t", shape, 0, df=5.0)
    assert q.var().item() == pytest.approx(5.0 / 3.0, rel=0.05)  # df / (df - 2)
    # Heavy tails: P(|x| > 6) is 2 t.sf(6, 3) = 9.3e-3 for df=3 (2e-9 for a Gaussian).
    q3, _, _ = distributions.generate("student-t", shape, 0, df=3.0)
    assert (q3.abs() > 6).double().mean().item() == pytest.approx(2 * t.sf(6, 3), rel=0.1)
    assert math.isfinite(q3.abs().max().item())


@pytest.mark.parametrize("name,params", [
    ("channel-outliers", {"channels": -1}), ("channel-outliers", {"channels": 1.5}), ("channel-outliers", {"scale": 0}),
    ("sink-tokens", {"sinks": -2}), ("sink-tokens", {"scale": math.inf}), ("student-t", {"df": 0}),
    ("student-t", {"df": math.nan}), ("k-bias", {"channels": -1}), ("k-bias", {"channels": 2.5}),
    ("k-bias", {"bias": math.inf}), ("k-bias", {"bias": math.nan}),
])
def test_bad_parameters_are_refused_in_one_line(name, params):
    with pytest.raises(UsageError) as exc:
        distributions.generate(name, SHAPE, 0, **params)
    assert "\n" not in str(exc.value)


def test_more_channels_than_head_dim_is_refused():
    with pytest.raises(UsageError, match="head dim"):
        distributions.generate("channel-outliers", SHAPE, 0, channels=33)


def test_k_bias_adds_a_token_shared_offset_on_fixed_channels_of_k():
    shape = distributions.AttnShape(2, 4, 512, 64, kv_heads=2)
    base = distributions.generate("k-bias", shape, 5, channels=3, bias=0.0)
    q, k, v = distributions.generate("k-bias", shape, 5, channels=3, bias=6.0)
    assert torch.equal(q, base[0]) and torch.equal(v, base[2])  # Q and V plain, same draws
    off = k - base[1]  # the offset, up to the rounding of k + offset
    assert torch.allclose(off, off[:, :, :1].expand_as(off), rtol=0, atol=1e-13)  # the same for every token
    per_channel = off.mean(dim=2)  # [B, Hkv, D]
    assert ((per_channel != 0).sum(-1) == 3).all()  # 3 channels per K head, the others untouched
    assert torch.allclose(per_channel[per_channel != 0].abs(), torch.tensor(6.0, dtype=torch.float64), atol=1e-13)
    assert (per_channel > 0).any() and (per_channel < 0).any()  # signs drawn per channel
    masks = (per_channel != 0).reshape(-1, 64)
    assert len({tuple(m.tolist()) for m in masks}) > 1  # channels drawn per (batch, kv-head)
    # the offset is a mean over tokens, the rest of K stays N(0, 1)
    assert k.std(dim=2).mean().item() == pytest.approx(1.0, rel=0.05)


def test_k_bias_defaults_and_parameters_are_registered_with_help():
    entry = distributions.available()["k-bias"]
    assert {k: v[0] for k, v in entry.params.items()} == {"channels": 2, "bias": 8.0}
    assert all(help_ for _, help_ in entry.params.values())
    shape = distributions.AttnShape(1, 2, 1024, 64)
    _, k, _ = distributions.generate("k-bias", shape, 0)
    mu = k.mean(dim=2)
    assert ((mu.abs() > 4).sum(-1) == 2).all()  # two channels at |mean| ~ 8
    with pytest.raises(UsageError, match="head dim"):
        distributions.generate("k-bias", SHAPE, 0, channels=33)
