"""Attention in float64: the reference every error is measured against.

Exposed: ``reference_attention``, ``causal_mask``, ``expand_kv``.

Chunked over queries so memory per (batch, head) is O(chunk x seqlen_k), never
O(seqlen^2). Causal masking is aligned bottom-right (query i sees keys j <= i +
seqlen_k - seqlen_q), as FlashAttention aligns it. K and V may have fewer heads than Q
(grouped-query attention): each K/V head serves ``heads // kv_heads`` consecutive Q heads.
"""

from __future__ import annotations

import math

import torch

# Elements of one S chunk (all batches and heads together); bounds the reference's memory.
_CHUNK_ELEMS = 1 << 22


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, N, D] -> [B, heads, N, D] without copying (a broadcast view)."""
    b, hkv, n, d = x.shape
    if hkv == heads:
        return x
    g = heads // hkv
    return x[:, :, None].expand(b, hkv, g, n, d).reshape(b, heads, n, d)


def causal_mask(q_pos: torch.Tensor, k_start: int, k_end: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Boolean [R, k_end - k_start]: True where the key is visible to the query."""
    k_pos = torch.arange(k_start, k_end, device=q_pos.device)
    return k_pos[None, :] <= (q_pos[:, None] + (seqlen_k - seqlen_q))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: float | None = None, q_index: torch.Tensor | None = None,
                        chunk: int | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V in float64 for the query rows ``q_index`` (all rows if None).

    Returns [B, H, R, D]. Rows with no visible key (possible only when causal and
    seqlen_q > seqlen_k) are 0, as FlashAttention returns.
    """
    b, h, n, d = q.shape
    nk = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if q_index is None:
        q_index = torch.arange(n, device=q.device)
    q = q.to(torch.float64).index_select(2, q_index)
    kk = expand_kv(k.to(torch.float64), h)
    vv = expand_kv(v.to(torch.float64), h)
    r = q.shape[2]
    chunk = chunk or max(1, _CHUNK_ELEMS // max(1, b * h * nk))
    out = torch.empty(b, h, r, v.shape[-1], dtype=torch.float64, device=q.device)
    for s in range(0, r, chunk):
        e = min(r, s + chunk)
        scores = torch.matmul(q[:, :, s:e], kk.transpose(-1, -2)) * scale
        if causal:
            vis = causal_mask(q_index[s:e], 0, nk, n, nk)
            scores = scores.masked_fill(~vis, -math.inf)
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        den = p.sum(dim=-1, keepdim=True)
        out[:, :, s:e] = torch.matmul(p, vv) / torch.where(den > 0, den, torch.ones_like(den))
    return out
