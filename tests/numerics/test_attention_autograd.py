"""The recipe's attention as a torch.autograd.Function (numerics/attention_autograd.py).

- against float64 autograd of exact attention (numerics/backward_reference.py): with the forward
  exact in float64 and the float64 backward spec, rel error <= 1e-10 through the Function (causal,
  GQA, a softmax scale), as test_backward.py holds the backward alone; the ``exact`` preset end to
  end at its float32 floor;
- the gradients reach the inputs in their dtype (float32 in, float32 out) and equal the emulated
  backward from the same forward bit for bit;
- negative control: an FP8 recipe moves the gradient measurably; ``observe`` sees the call.
"""

from __future__ import annotations

import math

import torch

from fa3_numerics.numerics import attention_autograd as aa
from fa3_numerics.numerics import backward as bwd
from fa3_numerics.numerics.backward_reference import reference_gradients
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.numerics.reference import causal_mask

FP64 = "exact," + ",".join(f"bwd.{p}=fp64" for p in ("s", "dv", "dp", "ds", "dq", "dk", "out")) + ",bwd.acc=fp64"


def _inputs(dtype=torch.float64, h=4, hkv=2, n=80, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, n, d, generator=g, dtype=torch.float64)
    do = torch.randn(2, h, n, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]


def _exact_forward(recipe, q, k, v, *, causal, softmax_scale, rotation_seed=0, cache=None):
    """float64 O and LSE of exact attention (what run_forward gives, without float32 rounding)."""
    h, hkv = q.shape[1], k.shape[1]
    s = torch.einsum("bhnd,bhmd->bhnm", q, k.repeat_interleave(h // hkv, 1)) * softmax_scale
    if causal:
        s = s.masked_fill(~causal_mask(torch.arange(q.shape[2]), 0, k.shape[2], q.shape[2], k.shape[2]), -math.inf)
    lse = torch.logsumexp(s, -1)
    return bwd.Forward(torch.softmax(s, -1) @ v.repeat_interleave(h // hkv, 1), lse)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _grads(recipe, q, k, v, do, causal=True, scale=0.23, **kw):
    o = aa.recipe_attention(recipe, q, k, v, causal=causal, softmax_scale=scale, **kw)
    o.backward(do)
    return o, q.grad, k.grad, v.grad


def test_float64_path_matches_autograd_to_1e_10(monkeypatch):
    monkeypatch.setattr(bwd, "run_forward", _exact_forward)
    for causal in (False, True):
        q, k, v, do = _inputs()
        ref = reference_gradients(q.detach(), k.detach(), v.detach(), do, causal=causal, softmax_scale=0.23)
        got = _grads(Recipe.from_str(FP64), q, k, v, do, causal=causal)
        for a, b in zip(got, ref):
            assert a.dtype == torch.float64
            assert _rel(a.detach(), b) <= 1e-10


def test_exact_preset_float32_floor_and_dtype():
    q, k, v, do = _inputs(torch.float32)
    ref = reference_gradients(q.detach().double(), k.detach().double(), v.detach().double(), do.double(),
                              causal=True, softmax_scale=0.23)
    got = _grads(PRESETS["exact"].recipe, q, k, v, do)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        assert _rel(a.detach().double(), b) < 1e-5
    # the Function is the emulated forward and backward, nothing else
    r = PRESETS["exact"].recipe
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    g = bwd.emulate_backward(r, q64, k64, v64, do.double(), causal=True, softmax_scale=0.23)
    for a, b in zip(got[1:], (g.dq, g.dk, g.dv)):
        assert torch.equal(a, b.float())


def test_fp8_recipe_moves_the_gradient_and_observe_sees_the_call():
    q, k, v, do = _inputs(torch.float32)
    exact = [t.detach() for t in _grads(PRESETS["exact"].recipe, q, k, v, do)]
    seen = []
    q2, k2, v2, _ = _inputs(torch.float32)
    fp8 = _grads(Recipe.from_str("cudnn-fp8"), q2, k2, v2, do,
                 observe=lambda q_, k_, v_, do_, g: seen.append((q_.dtype, g.dq.shape)))
    for a, b in zip(fp8, exact):
        assert _rel(a.detach(), b) > 1e-3
    assert seen == [(torch.float64, q.shape)]
