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
def test_fast_transform_equals_matrix(d):
    x = torch.randn(5, d, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ hadamard_matrix(d) / d ** 0.5, rtol=0, atol=1e-13)
    rot = make_rotation("hadamard", d, 3)
    assert torch.allclose(rot.apply(x), x @ rot.matrix(), rtol=0, atol=1e-13)


def test_hadamard_spreads_an_outlier():
    d = 128
    x = torch.zeros(1, d, dtype=torch.float64)
    x[0, 5] = 100.0
    y = make_rotation("hadamard", d, 0).apply(x)
    assert torch.allclose(y.abs(), torch.full_like(y, 100.0 / d ** 0.5))


def test_signs_are_seeded():
    assert torch.equal(random_signs(64, 1), random_signs(64, 1))
    assert not torch.equal(random_signs(64, 1), random_signs(64, 2))


def test_unsupported_dims_refused():
    with pytest.raises(UsageError, match="Hadamard"):
        make_rotation("hadamard", 80, 0)
    with pytest.raises(UsageError, match="unknown rotation"):
        make_rotation("spin", 64, 0)
