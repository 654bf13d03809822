"""The backward's reference: float64 autograd of exact attention.

Exposed: ``reference_gradients``.

softmax(Q K^T scale) V in float64, differentiated by torch.autograd, one (batch, KV head) group
at a time so memory stays O(group x N x N_k): causal masks aligned bottom-right as FlashAttention
(``reference.causal_mask``); grouped-query attention by expanding K and V inside the graph, so
autograd itself sums dK and dV over the query heads of each KV head. A row that sees no key has
output 0 and gradient 0 (its softmax is defined as 0, as the flash algorithm returns). It shares
no code with the emulated backward (``numerics.backward``) beyond the mask.
"""

from __future__ import annotations

import math

import torch

from .reference import causal_mask


def reference_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                        causal: bool = False, softmax_scale: float | None = None):
    """(O, dQ, dK, dV) in float64 for Q [B, H, N, D], K, V [B, Hkv, N_k, D], dO [B, H, N, Dv]."""
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = h // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = [torch.empty(b, h, n, v.shape[-1], dtype=torch.float64, device=q.device),
           torch.empty(b, h, n, d, dtype=torch.float64, device=q.device),
           torch.empty(b, hkv, nk, d, dtype=torch.float64, device=q.device),
           torch.empty(b, hkv, nk, v.shape[-1], dtype=torch.float64, device=q.device)]
    vis = causal_mask(torch.arange(n, device=q.device), 0, nk, n, nk) if causal else None
    with torch.enable_grad():
        for bi in range(b):
            for j in range(hkv):
                qh = q[bi, j * g:(j + 1) * g].detach().to(torch.float64).requires_grad_(True)
                kh = k[bi, j].detach().to(torch.float64).requires_grad_(True)
                vh = v[bi, j].detach().to(torch.float64).requires_grad_(True)
                s = torch.matmul(qh, kh.expand(g, nk, d).transpose(-1, -2)) * scale
                if vis is not None:
                    s = s.masked_fill(~vis, -math.inf)
                m = s.detach().amax(dim=-1, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                e = torch.exp(s - m)
                den = e.sum(dim=-1, keepdim=True)
                p = e / torch.where(den > 0, den, torch.ones_like(den))
                o = torch.matmul(p, vh.expand(g, nk, vh.shape[-1]))
                dq, dk, dv = torch.autograd.grad(o, (qh, kh, vh), do[bi, j * g:(j + 1) * g].to(torch.float64))
                out[0][bi, j * g:(j + 1) * g] = o.detach()
                out[1][bi, j * g:(j + 1) * g] = dq
                out[2][bi, j] = dk
                out[3][bi, j] = dv
    return tuple(out)


__all__ = ["reference_gradients"]
