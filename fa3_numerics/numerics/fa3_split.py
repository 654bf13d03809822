"""FA3's split-KV forward for every query row (``splitkv=fa3``): what a caller of ``flash_attn_func``
with ``num_splits=0`` gets, as torch's ``_scaled_dot_product_attention_quantized`` (torchao's FP8
attention) calls it.

Exposed: ``flash_fa3_split``.

With ``num_splits=0`` FA3 picks a split count itself (``split_kv.fa3_num_splits``: when batch x
kv-heads x packed query tiles leave the GPU under-filled and there are more than four KV tiles). Each
query tile (``kBlockM`` rows, the heads of a KV group packed into it: PackGQA is on for splits) cuts
its own KV range -- every tile up to its causal limit (hopper/block.h ``get_n_block_min_max``) -- into
``num_splits`` runs of ceil(range / num_splits) tiles; each run is the plain forward loop (tiles last
to first) writing O normalised by its own row sum and its LSE in float32, and the combine kernel
adds them (``split_kv.combine``). Measured (reports/h200/field/): the kernel on torchao's own FP8
bytes with num_splits=0 differs from num_splits=1 at seqlen 1000 and at head dim 64 (8 heads), and
this model of it is what closes the torchao-fp8 preset's gap there.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .split_kv import combine, fa3_num_splits


def _row_limits(n: int, nk: int, h: int, hkv: int, bm: int, bn: int, causal: bool, q_index: torch.Tensor,
                device) -> torch.Tensor:
    """n_block_max of the query tile holding each (head, row) [H, R]: the tiles its tile visits."""
    n_tiles = -(-nk // bn)
    rows = q_index.to(device)
    if not causal:
        return torch.full((h, rows.numel()), n_tiles, dtype=torch.long, device=device)
    g = h // hkv
    hg = (torch.arange(h, device=device) % g)[:, None]
    packed = rows[None, :] * g + hg  # PackGQA: row-major (row, head in group) along M
    m_block = torch.div(packed, bm, rounding_mode="floor")
    m_idx_max = torch.div((m_block + 1) * bm - 1, g, rounding_mode="floor") + 1
    lim = torch.div(m_idx_max + nk - n + bn - 1, bn, rounding_mode="floor")
    return lim.clamp(max=n_tiles, min=0)


def _rows_of(pre, sel: torch.Tensor):
    """The prepared inputs with only the query rows ``sel`` (indices into the rows ``pre`` holds)."""
    r = pre.q.values.shape[2]
    pick = lambda t: t.index_select(2, sel) if t.shape[2] == r and r > 1 else t  # noqa: E731
    return dataclasses.replace(pre, q=dataclasses.replace(pre.q, values=pick(pre.q.values), descale=pick(pre.q.descale)))


def flash_fa3_split(recipe, pre, q_index: torch.Tensor, causal: bool, scale: float, kv_heads: int,
                    stats: dict | None = None) -> torch.Tensor:
    """The FA3 forward with its num_splits=0 heuristic (module docstring): [B, H, R, Dv] float64
    holding values of the output format."""
    from .emulator import _flash, write_out

    b, h, _, d = pre.q.values.shape
    n, nk, bm, bn = pre.seqlen_q, pre.seqlen_k, pre.block_m, pre.block_n
    splits = fa3_num_splits(batch=b, kv_heads=kv_heads, heads=h, seqlen_q=n, seqlen_k=nk, block_m=bm, block_n=bn,
                            head_dim=d, fp8=recipe.narrow, causal=causal)
    if splits <= 1:
        return _flash(recipe, pre, q_index, causal, scale, stats)
    part = dataclasses.replace(recipe, out="fp32")
    limits = _row_limits(n, nk, h, kv_heads, bm, bn, causal, q_index, pre.q.values.device)
    out = torch.zeros((b, h, q_index.numel(), pre.v.values.shape[-1]), dtype=torch.float32,
                      device=pre.q.values.device)
    lse_out = torch.full((b, h, q_index.numel()), math.inf, dtype=torch.float32, device=out.device)
    # Rows whose query tile visits the same KV tiles share their split ranges: one combine per limit,
    # over the rows (of any head) that have it.
    for lim in torch.unique(limits).tolist():
        if lim <= 0:
            continue  # a row that sees no key: O = 0
        sel = (limits == lim).any(dim=0).nonzero().squeeze(1)
        sub, sub_index = _rows_of(pre, sel), q_index.index_select(0, sel.to(q_index.device))
        per = -(-lim // splits)
        o_parts, lse_parts = [], []
        for s in range(splits):
            t0, t1 = s * per, min(lim, (s + 1) * per)
            if t1 <= t0:
                continue  # an empty split writes O = 0, lse = -inf: the combine skips it
            st: dict = {}
            o_parts.append(_flash(part, sub, sub_index, causal, scale, st, tile_range=(t0, t1)).to(torch.float32))
            lse = st["lse"]
            lse_parts.append(torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -math.inf)))
        o = torch.zeros_like(out).index_copy_(2, sel, combine(torch.stack(o_parts), torch.stack(lse_parts)))
        pick = (limits == lim)[None, :, :]  # [1, H, R]
        out = torch.where(pick.unsqueeze(-1), o, out)
        if stats is not None:
            lse_s = torch.stack(lse_parts)
            m = lse_s.amax(dim=0)
            m = torch.where(m == -math.inf, torch.zeros_like(m), m)
            tot = torch.exp((lse_s - m).double()).sum(dim=0)
            lse_c = torch.where(tot > 0, (torch.log(tot) + m.double()).to(torch.float32),
                                torch.full_like(m, math.inf))
            lse_out = torch.where(pick, torch.full_like(lse_out, math.inf).index_copy_(2, sel, lse_c), lse_out)
    if stats is not None:
        stats["lse"] = lse_out
    return write_out(out, recipe)


__all__ = ["flash_fa3_split"]
