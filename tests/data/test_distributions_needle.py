"""The needle family: exact planted masses in float64, deterministic, clean V directions."""

from __future__ import annotations

import math

import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.data.distributions.needle import PARAMS, plant
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.reference import reference_attention

DEFAULTS = {k: v[0] for k, v in PARAMS.items()}


def _probs(p, rows):
    n = p.k.shape[2]
    s = torch.matmul(p.q, p.k.transpose(-1, -2)) / math.sqrt(p.q.shape[-1])
    hidden = torch.arange(n)[None, :] > torch.arange(n - rows, n)[:, None]
    return torch.softmax(s.masked_fill(hidden, -math.inf), dim=-1)


@pytest.mark.parametrize("rows, sink, depth", [(1, 0.0, 0.1), (6, 0.4, 0.9), (3, 0.2, 0.5)])
def test_planted_masses_are_what_was_asked(rows, sink, depth):
    p = plant(AttnShape(2, 2, rows, 64, seqlen_k=3000), 5, **(DEFAULTS | dict(weight=0.2, sink=sink, depth=depth)))
    pr = _probs(p, rows)
    assert torch.allclose(pr[..., p.needle], torch.full_like(pr[..., 0], 0.2), rtol=1e-12, atol=0)
    for j in p.decoys:
        assert torch.allclose(pr[..., j], torch.full_like(pr[..., 0], 0.1), rtol=1e-12, atol=0)
    if sink:
        assert torch.allclose(pr[..., 0], torch.full_like(pr[..., 0], sink), rtol=1e-12, atol=0)
    assert p.needle == round(depth * (3000 - rows)) or p.needle == 1


def test_output_projection_on_u_is_the_needle_mass_exactly():
    p = plant(AttnShape(1, 2, 4, 128, seqlen_k=2048), 1, **DEFAULTS)
    o = reference_attention(p.q, p.k, p.v, causal=True)
    proj = torch.einsum("bhrd,bhd->bhr", o, p.u) / p.v_norm
    assert torch.allclose(proj, torch.full_like(proj, p.weight), rtol=1e-10)
    dec = torch.einsum("bhrd,bhkd->bhrk", o, p.decoy_u) / p.v_norm
    assert torch.allclose(dec, torch.full_like(dec, p.decoy_weight), rtol=1e-10)


def test_deterministic_and_registered():
    shape = AttnShape(1, 1, 2, 64, seqlen_k=512)
    a = generate("needle", shape, 3, weight=0.3)
    b = generate("needle", shape, 3, weight=0.3)
    c = generate("needle", shape, 4, weight=0.3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])
    assert a[0].shape == (1, 1, 2, 64) and a[1].shape == (1, 1, 512, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_masses_hold_too():
    p = plant(AttnShape(1, 2, 1, 128, seqlen_k=4096), 0, device="cuda", **DEFAULTS)
    pr = _probs(type(p)(*(x.cpu() if torch.is_tensor(x) else x for x in p.__dict__.values())), 1)
    assert torch.allclose(pr[..., p.needle], torch.full_like(pr[..., 0], p.weight), rtol=1e-12)


@pytest.mark.parametrize("bad, words", [(dict(weight=0.0), "--weight"), (dict(depth=1.5), "--depth"),
                                        (dict(weight=0.4, decoys=3, decoy_ratio=0.5, sink=0.5), "lower --weight")])
def test_bad_parameters_are_refused_in_one_line(bad, words):
    with pytest.raises(UsageError, match=words):
        generate("needle", AttnShape(1, 1, 1, 64, seqlen_k=512), 0, **bad)
