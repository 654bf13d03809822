"""FlashAttention-2's forward as PyTorch SDPA's flash kernel runs it on Hopper (``loop=fa2``).

Exposed: ``FA2_FWD_TILES``, ``FA2_BWD_TILES``, ``fa2_tiles``, ``fa2_bwd_tiles``, ``fa2_num_splits``,
``split_block_n``, ``flash_fa2``.

torch's ``_scaled_dot_product_flash_attention`` is FlashAttention-2 (aten/src/ATen/native/transformers/
cuda/flash_attn/), compiled for sm80 and run as mma.sync on an H100/H200. What it computes, from its
source:

- tiles (flash_fwd_launch_template.h, sm90 is not ``is_sm8x``): kBlockM x kBlockN = 128 x 128 at head
  dim 64, 128 x 64 at 96, 128 and 192, 64 x 64 at 256 (an H200's 228 KB per SM takes the 2-CTA
  branch); the KV tiles visited last to first (``for (; n_block >= n_block_min; --n_block)``);
- the online softmax of FA3's model (exp2 of an FFMA with the max scaled by scale log2(e), per-thread
  partial row sums in the mma accumulator layout, a quad reduction at the end, O times 1 / l), so
  the tile step is ``emulator._flash``'s;
- split-KV (flash_api.cpp ``set_params_splitkv``, called by ``mha_fwd`` with num_splits = 0): when
  batch x heads x ceil(seqlen_q / 64) is below 0.8 x 2 x SMs, ``num_splits_heuristic`` picks the
  smallest split count within 85% of the best wave efficiency (at most 128 splits, at most the KV
  tiles). The split kernel (``run_mha_fwd_splitkv_dispatch``) has its own tiles, kBlockM 64 and
  kBlockN 256 / 128 / 64 for head dims <= 64 / <= 128 / larger; split s takes KV tiles
  [s ceil(T / S), (s + 1) ceil(T / S)), writes its O normalised by its own row sum and its LSE in
  float32 (-inf where it saw no key), and ``flash_fwd_splitkv_combine_kernel`` adds them:
  m = max_s lse_s (0 if all are -inf), lse = log(sum_s exp(lse_s - m)) + m,
  O = sum_s exp(lse_s - lse) O_s (one FFMA per split, in split order), then O in BF16/FP16;
- backward tiles (flash_bwd_launch_template.h, >= 144 KB shared memory per block): 128 x 128 at 64,
  64 x 128 at 96 and 128, 64 x 64 at 192 and 256.

Modelling choices, stated: the combine's exp and log are correctly rounded float32 (the kernel's
``expf``/``logf`` under fast math are within a few ulp); the split count assumes an H200's 132 SMs.
"""

from __future__ import annotations

import dataclasses
import math

import torch

H200_SMS = 132
# head_dim -> (kBlockM, kBlockN), forward and backward, on sm90 with no dropout
FA2_FWD_TILES = {64: (128, 128), 96: (128, 64), 128: (128, 64), 192: (128, 64), 256: (64, 64)}
FA2_BWD_TILES = {64: (128, 128), 96: (64, 128), 128: (64, 128), 192: (64, 64), 256: (64, 64)}
_SPLIT_BLOCK_M = 64


def _table(table: dict, head_dim: int) -> tuple[int, int]:
    d = min((k for k in table if k >= head_dim), default=max(table))
    return table[d]


def fa2_tiles(head_dim: int) -> tuple[int, int]:
    """(kBlockM, kBlockN) of FA2's (unsplit) forward on sm90."""
    return _table(FA2_FWD_TILES, head_dim)


def fa2_bwd_tiles(head_dim: int) -> tuple[int, int]:
    """(kBlockM, kBlockN) of FA2's backward on sm90."""
    return _table(FA2_BWD_TILES, head_dim)


def split_block_n(head_dim: int) -> int:
    return 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)


def fa2_num_splits(*, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   num_sms: int = H200_SMS) -> int:
    """FA2's split count for ``mha_fwd`` (flash_api.cpp ``num_splits_heuristic`` with 2 x SMs)."""
    n_blocks = -(-seqlen_k // split_block_n(head_dim))
    work = batch * heads * -(-seqlen_q // _SPLIT_BLOCK_M)
    sms = 2 * num_sms
    if work >= 0.8 * sms:
        return 1
    most = min(128, sms, n_blocks)
    eligible = lambda s: s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))  # noqa: E731
    eff = [0.0] * (most + 1)
    for s in range(1, most + 1):
        if eligible(s):
            waves = work * s / sms
            eff[s] = waves / math.ceil(waves)
    best = max(eff)
    return next((s for s in range(1, most + 1) if eligible(s) and eff[s] >= 0.85 * best), 1)


def flash_fa2(recipe, pre, q_index: torch.Tensor, causal: bool, scale: float, stats: dict | None = None,
              *, num_sms: int = H200_SMS) -> torch.Tensor:
    """The forward of torch's FA2 (module docstring) on the emulator's prepared inputs: [B, H, R, Dv]
    float64 holding values of the output format; ``stats["lse"]`` the LSE its backward reads."""
    from .emulator import _flash, write_out

    b, h = pre.q.values.shape[:2]
    d = pre.q.values.shape[-1]
    nk = pre.seqlen_k
    rev = dataclasses.replace(recipe, order="reverse")
    splits = fa2_num_splits(batch=b, heads=h, seqlen_q=pre.seqlen_q, seqlen_k=nk, head_dim=d, num_sms=num_sms)
    if splits <= 1:
        return _flash(rev, pre, q_index, causal, scale, stats)
    bn = split_block_n(d)
    ps = dataclasses.replace(pre, block_m=_SPLIT_BLOCK_M, block_n=bn)
    n_tiles = -(-nk // bn)
    per = -(-n_tiles // splits)
    part = dataclasses.replace(rev, out="fp32")
    f32 = torch.float32
    o_parts, lse_parts = [], []
    for s in range(splits):
        t0, t1 = s * per, min(n_tiles, (s + 1) * per)
        if t1 <= t0:
            continue  # an empty split writes O = 0 and lse = -inf: it adds nothing
        st: dict = {}
        o_parts.append(_flash(part, ps, q_index, causal, scale, st, tile_range=(t0, t1)).to(f32))
        lse = st["lse"]
        lse_parts.append(torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -math.inf)))
    lse_all = torch.stack(lse_parts)  # [S, B, H, R]
    m = lse_all.amax(dim=0)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    total = torch.zeros_like(m)
    for x in lse_all:
        total = total + torch.exp((x - m).double()).to(f32)
    lse = torch.where((total == 0) | torch.isnan(total), torch.full_like(total, math.inf),
                      (torch.log(total.double()).to(f32) + m).to(f32))
    out = torch.zeros_like(o_parts[0])
    for x, o_s in zip(lse_all, o_parts):
        w = torch.exp((x - lse).double()).to(f32).unsqueeze(-1)
        out = (w.double() * o_s.double() + out.double()).to(f32)
    if stats is not None:
        stats["lse"] = lse
    return write_out(out, recipe)


__all__ = ["FA2_FWD_TILES", "FA2_BWD_TILES", "fa2_tiles", "fa2_bwd_tiles", "fa2_num_splits", "split_block_n",
           "flash_fa2"]
