"""Attention whose forward and backward are a recipe's emulation, as a differentiable function.

Exposed: ``RecipeAttention``, ``recipe_attention``.

``recipe_attention(recipe, q, k, v, causal=, softmax_scale=, rotation_seed=, observe=)`` returns
O [B, H, N, Dv] and, under autograd, the gradients of Q [B, H, N, D], K, V [B, Hkv, N_k, D]:

- forward: ``backward.run_forward`` (the recipe's emulated forward over every query row, with
  the log-sum-exp the kernel saves) on float64 copies of the inputs;
- backward: ``backward.backward_from`` (the recipe's ``bwd.*`` keys) from that forward's own O
  and LSE, so an FP8 forward + BF16 backward reads the FP8 forward's O and LSE, as FA3 users'
  training does.

Inputs of any float dtype on any device; O and each gradient come back in their input's dtype
(rounded once from the emulator's float64, which holds the output formats' values). ``observe``
(optional) is called in the backward as ``observe(q, k, v, do, gradients)`` with the float64
tensors and the ``backward.Gradients``: how a study measures the per-call gradient error against
float64 autograd without a second backward pass.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import backward as bwd
from .recipe import Recipe


class RecipeAttention(torch.autograd.Function):
    """``torch.autograd.Function`` of the module docstring (call ``recipe_attention``)."""

    @staticmethod
    def forward(ctx, q, k, v, recipe: Recipe, causal: bool, softmax_scale: float | None, rotation_seed: int,
                observe: Callable | None):
        q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
        fwd = bwd.run_forward(recipe, q64, k64, v64, causal=causal, softmax_scale=softmax_scale,
                              rotation_seed=rotation_seed)
        ctx.save_for_backward(q64, k64, v64, fwd.o, fwd.lse)
        ctx.recipe, ctx.causal, ctx.scale, ctx.seed, ctx.observe = recipe, causal, softmax_scale, rotation_seed, observe
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return fwd.o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q64, k64, v64, o, lse = ctx.saved_tensors
        do64 = grad_out.to(torch.float64)
        g = bwd.backward_from(ctx.recipe, q64, k64, v64, bwd.Forward(o, lse), do64, causal=ctx.causal,
                              softmax_scale=ctx.scale, rotation_seed=ctx.seed)
        if ctx.observe is not None:
            ctx.observe(q64, k64, v64, do64, g)
        dq, dk, dv = (x.to(dt) for x, dt in zip((g.dq, g.dk, g.dv), ctx.dtypes))
        return dq, dk, dv, None, None, None, None, None


def recipe_attention(recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                     softmax_scale: float | None = None, rotation_seed: int = 0,
                     observe: Callable | None = None) -> torch.Tensor:
    """O of ``recipe`` on Q, K, V, differentiable through the recipe's emulated backward."""
    return RecipeAttention.apply(q, k, v, recipe, causal, softmax_scale, rotation_seed, observe)


__all__ = ["RecipeAttention", "recipe_attention"]
