"""Attention in float64: the reference every error is measured against.

Exposed: ``reference_attention``, ``causal_mask``, ``expand_kv``.

Sliding windows, soft-capping and sink logits (``window_size``, ``softcap``, ``sinks``) follow
``numerics/masking.py``; without them the arithmetic is unchanged.

Chunked over queries so memory per (batch, head) is O(chunk x seqlen_k), never
O(seqlen^2). Causal masking is aligned bottom-right (query i sees keys j <= i +
seqlen_k - seqlen_q), as FlashAttention aligns it. K and V may have fewer heads than Q
(grouped-query attention): each K/V head serves ``heads // kv_heads`` consecutive Q heads.
"""

from __future__ import annotations

import math

import torch

# Elements of one S chunk (one head); bounds the reference's memory (64 MiB in float64).
_CHUNK_ELEMS = 1 << 23
# On a GPU a chunk holds this many (512 MiB in float64): with the CPU's chunks the paper's Table 3
# with every query row is ~5000 launches, and the launches, not the GPU, set its time.
_CHUNK_ELEMS_GPU = 1 << 26


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
                        chunk: int | None = None, window_size: tuple[int, int] | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V in float64 for the query rows ``q_index`` (all rows if None).

    Returns [B, H, R, D]. Rows with no visible key (causal with seqlen_q > seqlen_k, or a
    window) are 0, as FlashAttention returns. ``window_size`` (left, right), ``softcap`` and
    ``sinks`` ([H] logits joining each row's denominator) as in ``numerics/masking.py``.
    """
    from .masking import masking, softcap64, visible

    mk = masking(causal, window_size, softcap, sinks, heads=q.shape[1])
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if q_index is None:
        q_index = torch.arange(n, device=q.device)
    r = q_index.numel()
    g = h // hkv
    # One (batch, head) at a time with as many query rows as fit a chunk of S: large GEMMs
    # (a [rows, d] x [d, seqlen_k] product runs near the machine's float64 peak, a batched one
    # of 16 rows does not), in-place softmax, and no expanded copies of K and V for GQA.
    elems = _CHUNK_ELEMS if q.device.type == "cpu" else max(_CHUNK_ELEMS, _CHUNK_ELEMS_GPU)
    chunk = chunk or max(1, elems // max(1, nk))
    out = torch.empty(b, h, r, v.shape[-1], dtype=torch.float64, device=q.device)
    for bi in range(b):
        for hi in range(h):
            qh = q[bi, hi].to(torch.float64).index_select(0, q_index)
            kt = k[bi, hi // g].to(torch.float64).transpose(0, 1)
            vh = v[bi, hi // g].to(torch.float64)
            for s in range(0, r, chunk):
                e = min(r, s + chunk)
                scores = torch.matmul(qh[s:e], kt).mul_(scale)
                if mk.softcap:
                    scores = softcap64(scores, mk.softcap)
                if causal:
                    vis = causal_mask(q_index[s:e], 0, nk, n, nk)
                    scores.masked_fill_(~vis, -math.inf)
                if mk.windowed:
                    scores.masked_fill_(~visible(mk, q_index[s:e], 0, nk, n, nk), -math.inf)
                m = scores.amax(dim=-1, keepdim=True)
                if mk.sinks is not None:  # the sink joins the max (for range) and the denominator only
                    m = torch.maximum(m, mk.sinks[hi].to(m.device).expand_as(m))
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                p = scores.sub_(m).exp_()
                den = p.sum(dim=-1, keepdim=True)
                if mk.sinks is not None:
                    den = den + torch.exp(mk.sinks[hi].to(m.device) - m)
                out[bi, hi, s:e] = torch.matmul(p, vh) / torch.where(den > 0, den, torch.ones_like(den))
    return out
