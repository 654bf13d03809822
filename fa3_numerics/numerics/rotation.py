"""Rotations applied to Q and K along head_dim before quantization (incoherent processing).

Exposed: ``hadamard_matrix``, ``fwht``, ``random_signs``, ``Rotation``, ``make_rotation``,
``ROTATIONS``.

The random Hadamard rotation is M = diag(s) H_d / sqrt(d) with s a seeded random +-1
vector, so (QM)(KM)^T = QK^T in exact arithmetic while outliers of Q and K are spread over
all d channels. It is applied by a fast Walsh-Hadamard transform in O(d log d).

Head dims that are not powers of two (96 = 12 * 8, 192 = 12 * 16) use H_d = H_12 (x) H_2^k,
with H_12 the Paley construction over GF(11) (11 = 3 mod 4, so the Paley type-I matrix has
order 12); the transform applies H_12 densely and H_2^k by butterflies. Other dims whose
odd part is not 1 or 3 (times a power of two >= 4 for the 12 case) are refused.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import UsageError


@functools.lru_cache(maxsize=None)
def _paley12() -> torch.Tensor:
    q = 11
    residues = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if a in residues else -1 for a in range(1, q)]
    jac = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    # Paley I: H = I + S with S = [[0, 1^T], [-1, Q]] skew-symmetric, Q the Jacobsthal matrix.
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return torch.eye(q + 1, dtype=torch.float64) + s


def _split(d: int) -> tuple[int, int]:
    """d = odd_part_factor * 2^k with factor 1 or 12."""
    if d >= 1 and d & (d - 1) == 0:
        return 1, d
    if d % 12 == 0 and (d // 12) & (d // 12 - 1) == 0:
        return 12, d // 12
    raise UsageError(f"no Hadamard construction for head_dim {d}; use a power of two or 12 * 2^k (64, 96, 128, 192, 256)")


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(d: int) -> torch.Tensor:
    """Unnormalised +-1 Hadamard matrix of order d (float64): H H^T = d I."""
    f, p = _split(d)
    base = _sylvester(p)
    return torch.kron(_paley12(), base) if f == 12 else base


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x @ H_d / sqrt(d) along the last dim, by butterflies (plus a dense 12x12 factor)."""
    d = x.shape[-1]
    f, p = _split(d)
    lead = x.shape[:-1]
    y = x.reshape(*lead, f, p)
    h = 1
    while h < p:
        y = y.reshape(*lead, f, p // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    y = y.reshape(*lead, f, p)
    if f == 12:
        # kron(H12, Hp): row index (i, j) -> H12[i, i'] Hp[j, j']; x @ kron = H12^T applied on axis f.
        y = torch.einsum("...ij,ik->...kj", y, _paley12().to(y.dtype).to(y.device))
    return y.reshape(*lead, d) / (d ** 0.5)


def random_signs(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (d,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1


@dataclasses.dataclass(frozen=True)
class Rotation:
    """An orthogonal d x d matrix M applied as x -> x M, on Q and K alike."""

    name: str
    d: int
    seed: int

    def matrix(self) -> torch.Tensor:
        return _matrix(self.name, self.d, self.seed)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "none":
            return x
        if self.name == "hadamard":
            from . import native

            s = random_signs(self.d, self.seed).to(x.device, x.dtype)
            fast = native.fwht(x, s)
            return fast if fast is not None else fwht(x * s)
        return x @ self.matrix().to(x.device, x.dtype)


@functools.lru_cache(maxsize=32)
def _matrix(name: str, d: int, seed: int) -> torch.Tensor:
    if name == "none":
        return torch.eye(d, dtype=torch.float64)
    if name == "hadamard":
        return random_signs(d, seed)[:, None] * hadamard_matrix(d) / d ** 0.5
    if name == "orthogonal":
        g = torch.Generator().manual_seed(int(seed))
        a = torch.randn(d, d, generator=g, dtype=torch.float64)
        qm, r = torch.linalg.qr(a)
        # Sign fix makes the draw Haar-distributed rather than biased by QR's convention.
        return qm * torch.sign(torch.diagonal(r))[None, :]
    raise UsageError(f"unknown rotation {name!r}; choose one of: {', '.join(ROTATIONS)}")


ROTATIONS = {
    "none": "identity: Q and K as they are",
    "hadamard": "random Hadamard diag(+-1) H / sqrt(d) by fast Walsh-Hadamard transform (FA3 paper, QuaRot)",
    "orthogonal": "Haar-random orthogonal matrix (QR of a Gaussian), dense O(d^2) per row, for comparison",
}


def make_rotation(name: str, d: int, seed: int) -> Rotation:
    if name not in ROTATIONS:
        raise UsageError(f"unknown rotation {name!r}; choose one of: {', '.join(ROTATIONS)}")
    if name == "hadamard":
        _split(d)
    return Rotation(name, d, seed)
