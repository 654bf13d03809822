import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.rotation import fwht, hadamard_matrix, make_rotation, random_signs

DIMS = [64, 96, 128, 192, 256]


@pytest.mark.parametrize("d", DIMS)
def test_hadamard_is_hadamard(d):
    h = hadamard_matrix(d)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ["hadamard", "orthogonal"])
def test_rotation_orthogonal_and_preserves_scores(d, name):
    rot = make_rotation(name, d, seed=7)
    m = rot.matrix()
    assert (m @ m.T - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-12
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 50, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 40, d, generator=g, dtype=torch.float64)
    s = q @ k.transpose(-1, -2)
    s_rot = rot.apply(q) @ rot.apply(k).transpose(-1, -2)
    assert (s_rot - s).abs().max() < 1e-11 * s.abs().max()


@pytest.mark.parametrize("d", DIMS)
def test_fast_transform_equals_matrix(d, paths):
    """The butterflies (compiled and PyTorch) equal the dense matrix; the rotation is
    x -> (x * s) H / sqrt(d): the signs act on the input channels, before H."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, d, generator=g, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ hadamard_matrix(d) / d ** 0.5, rtol=0, atol=1e-13)
    rot = make_rotation("hadamard", d, 3)
    assert torch.allclose(rot.apply(x), x @ rot.matrix(), rtol=0, atol=1e-13)
    s = random_signs(d, 3)
    assert torch.allclose(rot.apply(x), (x * s) @ hadamard_matrix(d) / d ** 0.5, rtol=0, atol=1e-13)
    assert torch.allclose(rot.matrix(), s[:, None] * hadamard_matrix(d) / d ** 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_sylvester_hadamard_has_its_closed_form(d):
    """H[i, j] = (-1)^popcount(i & j) for the Sylvester construction: an independent formula,
    so the order of the butterflies (which output is which) is pinned, not only H H^T = d I."""
    pc = torch.tensor([[bin(a & b).count("1") for b in range(d)] for a in range(d)])
    want = torch.where(pc % 2 == 0, 1.0, -1.0).double()
    assert torch.equal(hadamard_matrix(d), want)
    assert torch.allclose(fwht(torch.eye(d, dtype=torch.float64)), want / d ** 0.5, rtol=0, atol=1e-15)


@pytest.mark.parametrize("d", [96, 192])
def test_paley_times_sylvester_for_dims_12_times_a_power_of_two(d):
    """96 = 12 * 8 and 192 = 12 * 16: H_12 (Paley I over GF(11): first row all +1, skew part
    from the quadratic residues mod 11) Kronecker H_(d/12)."""
    h = hadamard_matrix(d)
    p = d // 12
    h12 = h[::p, ::p]  # every p-th row and column of the Kronecker product is H_12 itself
    assert torch.equal(h12 @ h12.T, 12 * torch.eye(12, dtype=torch.float64))
    assert torch.equal(h, torch.kron(h12, hadamard_matrix(p)))
    residues = {(i * i) % 11 for i in range(1, 11)}
    assert residues == {1, 3, 4, 5, 9}
    assert h12[0].tolist() == [1.0] * 12
    # row 1 (index 0 of GF(11)): +1 on the diagonal, chi(j) for j = 1..10 beyond it
    assert h12[1, 2:].tolist() == [1.0 if j in residues else -1.0 for j in range(1, 11)]


def test_hadamard_spreads_an_outlier():
    d = 128
    x = torch.zeros(1, d, dtype=torch.float64)
    x[0, 5] = 100.0
    y = make_rotation("hadamard", d, 0).apply(x)
    assert torch.allclose(y.abs(), torch.full_like(y, 100.0 / d ** 0.5))


def test_signs_are_seeded_and_random():
    """Seeded: the same seed gives the same signs, another seed others; random: both signs,
    about half each (a binomial count of 4096 lies within 4 standard deviations = 128 of 2048)."""
    assert torch.equal(random_signs(64, 1), random_signs(64, 1))
    assert not torch.equal(random_signs(64, 1), random_signs(64, 2))
    s = torch.cat([random_signs(256, seed) for seed in range(16)])
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert abs(int((s > 0).sum()) - 2048) <= 128


def test_unsupported_dims_refused():
    with pytest.raises(UsageError, match="Hadamard"):
        make_rotation("hadamard", 80, 0)
    with pytest.raises(UsageError, match="unknown rotation"):
        make_rotation("spin", 64, 0)
