"""Split-KV decoding as FA3 computes it: the keys cut into splits, one flash pass per split, the
partial outputs combined in float32.

Exposed: ``fa3_num_splits``, ``split_ranges``, ``combine``, ``emulate_split``.

Decode (one query row against a long KV cache) gives the GPU too few query tiles to fill it, so
FA3 cuts the keys into ``num_splits`` ranges of whole KV tiles (hopper/block.h,
``get_n_block_min_max`` with ``Split``: ceil(n_blocks / num_splits) tiles per split, the last
splits shorter or empty), runs the forward loop on each (tiles last to first, its own running
max, row sum and P.V accumulator), writes each split's O normalised by its own row sum (times
the v descale) in float32 with its log-sum-exp, and a combine kernel
(hopper/flash_fwd_combine_kernel.h) adds them:

    lse_max = max_s lse_s (0 if every split is empty); scale_s = exp(lse_s - lse_max);
    sum = sum_s scale_s; lse = log(sum) + lse_max; scale_s /= sum; O = sum_s scale_s O_s

in float32, then rounds O to BF16. Each split's P.V chain is only that split's keys long, so
splitting is itself a bound on how many keys one FP22 accumulator sums. ``num_splits <= 0`` asks
FA3's own heuristic (hopper/heuristics.h ``num_splits_heuristic``, called by flash_api.cpp when
the caller passes 0): it depends on batch x kv-heads x query tiles against the SM count, so a
single decode request splits into dozens while a large serving batch does not split at all.

Modelling choices, stated: the combine's float32 sums run in split order (the kernel spreads
splits over threads and reduces with shuffles), ``exp`` and ``log`` are correctly rounded float32
(the kernel's ``expf``/``logf`` under fast-math are approximations within a few ulp).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import require
from .recipe import Recipe

H200_SMS = 132  # streaming multiprocessors of an H200 (and an H100 SXM)


def fa3_num_splits(*, batch: int, kv_heads: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
                   block_n: int, head_dim: int, fp8: bool = True, causal: bool = True,
                   num_sms: int = H200_SMS) -> int:
    """FA3's choice of splits for a forward call with ``num_splits=0`` (flash_api.cpp
    ``get_num_splits``, ``num_splits_heuristic``, max 128), with PackGQA (always on for splits)."""
    n_blocks = -(-seqlen_k // block_n)
    m_blocks = -(-(seqlen_q * (heads // kv_heads)) // block_m)
    total = batch * kv_heads * m_blocks
    if total >= 0.8 * num_sms:
        one_head = seqlen_k * (head_dim * 2) * (1 if fp8 else 2)
        l2 = 50 * 1024 * 1024
        if one_head > l2 and m_blocks >= num_sms * 2 and not causal:
            return min(-(-one_head // l2), 128)
        return 1
    if n_blocks <= 4:
        return 1
    most = min(128, num_sms, n_blocks)
    eff = []
    for s in range(1, most + 1):
        waves = total * s / num_sms
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(s for s in range(1, most + 1) if eff[s - 1] >= 0.85 * best)


def split_ranges(seqlen_k: int, block_n: int, num_splits: int) -> list[tuple[int, int]]:
    """[(first key, end key)] of each split (end <= first for an empty split), as block.h cuts them."""
    require(num_splits >= 1, f"num_splits {num_splits} must be >= 1")
    n_blocks = -(-seqlen_k // block_n)
    per = -(-n_blocks // num_splits)
    out = []
    for s in range(num_splits):
        b0, b1 = s * per, min(s * per + per, n_blocks)
        out.append((b0 * block_n, min(b1 * block_n, seqlen_k)) if b1 > b0 else (0, 0))
    return out


def combine(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> torch.Tensor:
    """FA3's combine: o_parts [S, .., R, D] float32, lse_parts [S, .., R] float32 (-inf: empty)
    -> O [.., R, D] float32 (module docstring)."""
    f32 = torch.float32
    lse = lse_parts.to(f32)
    lse_max = lse.amax(dim=0)
    lse_cur = torch.where(lse_max == -math.inf, torch.zeros_like(lse_max), lse_max)
    scale = torch.exp((lse - lse_cur).double()).to(f32)
    total = torch.zeros_like(lse_max)
    for s in range(scale.shape[0]):
        total = total + scale[s]
    inv = torch.where((total == 0) | torch.isnan(total), torch.zeros_like(total), (1.0 / total.double()).to(f32))
    scale = scale * inv
    out = torch.zeros_like(o_parts[0], dtype=f32)
    for s in range(scale.shape[0]):
        w = scale[s].unsqueeze(-1)
        # one FFMA per element, skipped where the scale is 0 (the kernel's `scale(m) > 0.f`)
        fma = (w.double() * o_parts[s].double() + out.double()).to(f32)
        out = torch.where(w > 0, fma, out)
    return out


def emulate_split(recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_splits: int,
                  softmax_scale: float | None = None, rotation_seed: int = 0, cache: dict | None = None) -> torch.Tensor:
    """Decode rows (every query row sees every key: one row, bottom-right causal, or no mask)
    through FA3's split-KV path: [B, H, R, Dv] float64 holding values of the output format.
    ``num_splits`` 1 is the plain flash pass (``emulate``)."""
    from .emulator import _flash, _no_tf32, prepare, write_out

    _no_tf32()
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    rows = torch.arange(q.shape[2], device=q.device)
    require(q.shape[2] == 1, "split-KV decode is modelled for one query row per head (seqlen_q = 1)")
    pre = prepare(recipe, q, k, v, q_index=rows, rotation_seed=rotation_seed, causal=True, cache=cache,
                  softmax_scale=scale)
    part = dataclasses.replace(recipe, out="fp32")
    o_parts, lse_parts = [], []
    for k0, k1 in split_ranges(pre.seqlen_k, pre.block_n, num_splits):
        if k1 <= k0:
            o_parts.append(torch.zeros((*pre.q.values.shape[:3], pre.v.values.shape[-1]), dtype=torch.float32,
                                       device=q.device))
            lse_parts.append(torch.full(pre.q.values.shape[:3], -math.inf, dtype=torch.float32, device=q.device))
            continue
        sl = lambda t: t[:, :, k0:k1] if t.shape[2] > 1 else t  # noqa: E731
        pk = dataclasses.replace(pre.k, values=sl(pre.k.values), descale=sl(pre.k.descale))
        pv = dataclasses.replace(pre.v, values=sl(pre.v.values), descale=sl(pre.v.descale))
        ps = dataclasses.replace(pre, k=pk, v=pv, seqlen_k=k1 - k0)
        stats: dict = {}
        o_parts.append(_flash(part, ps, rows, False, scale, stats).to(torch.float32))
        lse = stats["lse"]
        lse_parts.append(torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -math.inf)))
    if num_splits == 1:  # no combine: the kernel rounds its own O
        return _flash(recipe, pre, rows, True, scale)
    return write_out(combine(torch.stack(o_parts), torch.stack(lse_parts)), recipe)
