"""The FA3 paper's ``outliers`` distribution: X = Z + W B with Z ~ N(0, 1), W ~ N(0, sigma^2),
B ~ Bernoulli(p), all independent, for every entry of Q, K and V.

Its moments follow from that definition: E X = 0, Var X = 1 + p sigma^2,
E X^4 = 3 + 6 p sigma^2 + 3 p sigma^4 (Z and W B independent, E Z^4 = 3, E (WB)^2 = p sigma^2,
E (WB)^4 = 3 p sigma^4), and the tail P(|X| > t) = (1 - p) erfc(t / sqrt 2) +
p erfc(t / sqrt(2 (1 + sigma^2))) (Z + W ~ N(0, 1 + sigma^2)). Every tolerance below is 5
standard errors of the estimate from n draws (a false alarm once in ~1.7 million runs):
se(mean) = sqrt(Var / n), se(variance) = sqrt((E X^4 - Var^2) / n), se(rate) = sqrt(r (1 - r) / n)."""

import math

import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.data.distributions.paper import bernoulli_positions, outliers_like

N = 1 << 21  # draws per case


def _moments(p, sigma):
    var = 1 + p * sigma ** 2
    m4 = 3 + 6 * p * sigma ** 2 + 3 * p * sigma ** 4
    return var, m4


def _tail(p, sigma, t):
    return (1 - p) * math.erfc(t / math.sqrt(2)) + p * math.erfc(t / math.sqrt(2 * (1 + sigma ** 2)))


@pytest.mark.parametrize("p,sigma", [(0.0, 10.0), (0.001, 10.0), (0.01, 10.0), (0.01, 30.0), (0.1, 3.0), (1.0, 2.0)])
def test_mean_variance_and_tail_follow_the_definition(p, sigma):
    x = outliers_like((N,), torch.Generator().manual_seed(int(p * 1e4) + int(sigma)), p, sigma)
    var, m4 = _moments(p, sigma)
    assert abs(x.mean().item()) <= 5 * math.sqrt(var / N)
    assert abs(x.var().item() - var) <= 5 * math.sqrt((m4 - var ** 2) / N)
    t = 5.0  # a normal entry exceeds 5 with probability 5.7e-7: what is beyond is the outlier term
    r = _tail(p, sigma, t)
    rate = (x.abs() > t).double().mean().item()
    assert abs(rate - r) <= 5 * math.sqrt(r * (1 - r) / N) + 1 / N


def test_outlier_rate_grows_linearly_with_p():
    """Beyond t = 5 the rate is p * erfc(5 / sqrt(2 (1 + sigma^2))) + 5.7e-7: for sigma 10,
    0.619 p. Measured over a decade of p, each within 5 standard errors."""
    sigma, t = 10.0, 5.0
    slope = math.erfc(t / math.sqrt(2 * (1 + sigma ** 2)))
    assert slope == pytest.approx(0.6188, abs=1e-4)
    for i, p in enumerate((0.0005, 0.002, 0.008, 0.032)):
        x = outliers_like((N,), torch.Generator().manual_seed(100 + i), p, sigma)
        rate = (x.abs() > t).double().mean().item()
        r = _tail(p, sigma, t)
        assert abs(rate - r) <= 5 * math.sqrt(r * (1 - r) / N)


def test_q_k_v_are_independent_draws_with_the_given_shapes():
    """Q, K and V come from one seeded stream but are independent: sample correlations within
    5 / sqrt(n) of 0 (correlation of independent variables has standard error ~1 / sqrt(n),
    heavy tails aside: p = 0.001 adds a kurtosis that the 5 sigma covers). The same seed gives
    the same tensors; K and V have the KV heads."""
    shape = AttnShape(2, 4, 1024, 64, kv_heads=2)
    q, k, v = generate("outliers", shape, 3, p=0.001, sigma=10.0)
    assert q.shape == (2, 4, 1024, 64) and k.shape == v.shape == (2, 2, 1024, 64) and q.dtype == torch.float64
    n = k.numel()
    flat = torch.stack([q[:, :2].flatten(), k.flatten(), v.flatten()])
    c = torch.corrcoef(flat)
    assert (c - torch.eye(3, dtype=torch.float64)).abs().max() <= 5 / math.sqrt(n)
    again = generate("outliers", shape, 3, p=0.001, sigma=10.0)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = generate("outliers", shape, 4, p=0.001, sigma=10.0)
    assert not torch.equal(q, other[0])


def test_p_zero_is_the_standard_normal_stream():
    """p = 0: no outlier term is ever added, so the tensor is exactly the generator's randn."""
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(outliers_like((3, 100), g1, 0.0, 10.0), torch.randn((3, 100), generator=g2, dtype=torch.float64))


@pytest.mark.parametrize("p,chunk", [(1e-4, 0), (0.01, 0), (0.3, 0), (0.01, 7)])
def test_bernoulli_positions_follow_the_bernoulli_law(p, chunk):
    """The outlier positions are i.i.d. Bernoulli(p) per entry: ascending, unique, in range; the
    count within 5 standard errors of n p, in each eighth of the range too (the gaps neither
    drift nor cluster), and as often on even as on odd entries. chunk=7 forces many rounds of
    the gap-drawing loop, where an off-by-one at a chunk boundary would show."""
    n = 1 << 20
    w = bernoulli_positions(n, p, torch.Generator().manual_seed(11), chunk=chunk)
    assert w.dtype == torch.int64 and w.numel() > 0
    assert int(w[0]) >= 0 and int(w[-1]) < n and bool((w[1:] > w[:-1]).all())
    for m, cnt in ((n, w.numel()), (n // 8, int(((w >= 3 * n // 8) & (w < 4 * n // 8)).sum())),
                   (n // 2, int((w % 2 == 0).sum())), (n // 2, int((w % 2 == 1).sum()))):
        assert abs(cnt - m * p) <= 5 * math.sqrt(m * p * (1 - p)) + 1, (m, cnt)
    counts = torch.bincount(w * 8 // n, minlength=8)
    assert (counts - n / 8 * p).abs().max() <= 5 * math.sqrt(n / 8 * p * (1 - p)) + 1


def test_bernoulli_positions_edges():
    g = torch.Generator().manual_seed(0)
    assert bernoulli_positions(1000, 0.0, g).numel() == 0
    assert torch.equal(bernoulli_positions(1000, 1.0, g), torch.arange(1000))
    assert bernoulli_positions(0, 0.5, g).numel() == 0
    assert bernoulli_positions(1000, 1e-300, g).numel() == 0  # a gap far beyond n ends the draw
