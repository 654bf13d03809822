"""The flash loop of SageAttention 1's Triton kernel (recipe key ``loop=triton``).

Exposed: ``flash_triton``.

``sageattention/attn_qk_int8_per_block*.py`` (``_attn_fwd_inner``), step by step as Triton 3.6
compiles it for sm_90a (the PTX of every variant is in reports/h200/sage1/; instruction counts
per thread of the d-128 kernel: 64 ``mul.f32``, 98 ``fma.rn.f32``, 34 ``ex2.approx.ftz.f32``,
64 ``div.full.f32``):

- S: ``wgmma ... s32.s8.s8`` of the INT8 codes (exact), ``cvt.rn.f32.s32``, then
  t = float32(S * q_scale) and qk = float32(t * k_scale), in log2 units (``iquant=triton``
  folded sm_scale * log2(e) into Q's scale);
- m_new = max(m, rowmax qk) (float32 compare, exact);
- outside a causal query block's diagonal: P~ = exp2(fma(t, k_scale, -m_new)) -- the compiler
  fuses the second multiply into the subtraction (``fma.rn.f32``), so qk - m_new is rounded once;
  on the two diagonal tiles of a causal block the masked form qk + where(mask, 0, -1e6) is the
  fused one and qk - m_new is a plain ``sub.f32``;
- the tile's row sum of float32 P~ at once: each thread adds its 16 values in order, then
  shuffle-xor by 2 and by 1 (the same order as FA3's, ``emulator._quad_row_sum``), and
  l = fma(l, alpha, rowsum) with alpha = exp2(m - m_new) (``sub.f32``, ``ex2.approx.ftz``);
- P~ rounded to FP16 (``cvt.rn.f16x2.f32``); the tile's P V from a zero FP16 accumulator
  (the recipe's ``acc``: ``fp16-hopper`` is the fitted wgmma), O = fma(O, alpha, P V);
- at the end O / l (``div.full.f32``: O times the float32 reciprocal of l, the model that
  ``sage_quant`` found for Triton's division) rounded to the output format.

``ex2.approx.ftz.f32`` is modelled as the emulator's FA3 model of the same instruction: P~
correctly rounded, alpha rounded toward zero, subnormals flushed. ``kpad=zero``: the keys past
seqlen_k in the last tile score 0 (the non-causal kernel never masks them, K loads as 0) and
add exp2(-m_new) each to the row sum; causal attention masks them.
"""

from __future__ import annotations

import math

import torch

from .accumulators import get_accumulator
from . import sfu
from .emulator import PROGRESS, Prepared, _fma32, _quad_row_sum, _quad_total, exp2_rn, exp2_rz, flush_subnormals
from .families import family, mma_format
from .formats import quantize_dequantize
from .reference import causal_mask
from .sage_quant import LOG2E_SAGE, recip32


def flash_triton(recipe, pre: Prepared, q_index: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Output rows ``q_index`` ([B, H, R, Dv], float64 holding values of ``recipe.out``).

    With ``iquant=triton`` (integer Q/K) Q's descale already holds ``scale`` * log2(e); otherwise (any other
    quantizer: the attribution's float32 recipes) the loop folds float32(scale * log2(e)) into
    Q's descale itself, so that S is in log2 units either way."""
    dev = pre.q.values.device
    qv = pre.q.values.to(torch.float32)  # INT8 codes: their float32 GEMM is exact
    qd = pre.q.descale.to(torch.float32)
    if not (recipe.iquant == "triton" and family(recipe.qk) == "int"):
        qd = (qd * torch.tensor(scale * LOG2E_SAGE, dtype=torch.float32)).to(torch.float32)
    kn, kd = pre.k.values, pre.k.descale.to(torch.float32)
    vn = pre.v.values
    b, h, r, _ = qv.shape
    dv = vn.shape[-1]
    nk, bn, bm = pre.seqlen_k, pre.block_n, pre.block_m
    accumulate = get_accumulator(recipe.acc)
    fmts = (mma_format(recipe.p), mma_format(recipe.v))
    pad_zero = recipe.kpad == "zero" and not causal
    # sfu=h200 (keys/sfu.py): the measured ex2.approx.ftz for P~ and the rescale, else the stand-ins
    ex2_p, ex2_a = (sfu.ex2, sfu.ex2) if sfu.wanted(recipe) else (exp2_rn, exp2_rz)
    # First key of each row's query block: tiles from there on are the causal kernel's stage 2.
    block_start = torch.div(q_index, bm, rounding_mode="floor") * bm

    m = torch.full((b, h, r, 1), -math.inf, dtype=torch.float32, device=dev)
    l = torch.ones((b, h, r, 1), dtype=torch.float32, device=dev)  # the kernel starts l at 1; alpha = 0 clears it
    acc = torch.zeros((b, h, r, dv), dtype=torch.float32, device=dev)
    n_tiles = -(-nk // bn)
    tick = PROGRESS.get()  # progress hook
    for t in range(n_tiles):
        if tick is not None:
            tick(t, n_tiles, "KV tiles")
        s0, s1 = t * bn, min(nk, (t + 1) * bn)
        k_t = kn[:, :, s0:s1].to(torch.float32).transpose(-1, -2)
        ks = kd[:, :, s0:s1].transpose(-1, -2) if kd.shape[2] > 1 else kd
        tq = (torch.matmul(qv, k_t) * qd).to(torch.float32)
        ks_b = ks.expand(b, h, 1, s1 - s0)
        qk = (tq * ks_b).to(torch.float32)
        width = s1 - s0
        if pad_zero and width < bn:
            # keys past seqlen_k: K loads as zeros, so t = 0 and qk = 0, never masked
            pad = bn - width
            tq = torch.nn.functional.pad(tq, (0, pad))
            qk = torch.nn.functional.pad(qk, (0, pad))
            ks_b = torch.nn.functional.pad(ks_b, (0, pad), value=1.0)
        if causal:
            vis = causal_mask(q_index, s0, s1, pre.seqlen_q, nk)
            qk_m = qk.masked_fill(~vis, -math.inf)
        else:
            vis, qk_m = None, qk
        m_new = torch.maximum(m, qk_m.amax(dim=-1, keepdim=True))
        x = _fma32(tq, ks_b, -m_new)  # stage 1: the subtraction fused with the multiply by k_scale
        if causal:
            stage2 = (s0 >= block_start)[:, None]  # [R, 1]
            x = torch.where(stage2, (qk - m_new).to(torch.float32), x)
        p = flush_subnormals(ex2_p(x))
        if vis is not None:
            p = p.masked_fill(~vis, 0.0)
        alpha = flush_subnormals(ex2_a((m - m_new).to(torch.float32)))
        row = _quad_total(_quad_row_sum(torch.zeros((b, h, r, 4), dtype=torch.float32, device=dev), p))
        l = _fma32(l, alpha, row)
        p16 = quantize_dequantize(p[..., :width], recipe.p)  # cvt.rn.f16x2.f32 for p=fp16
        v_t = vn[:, :, s0:s1].to(torch.float32)
        d = accumulate(torch.zeros_like(acc), p16, v_t, fmts)
        acc = _fma32(acc, alpha, d)
        m = m_new
    if tick is not None:
        tick(n_tiles, n_tiles, "KV tiles")
    inv = recip32(l)
    return quantize_dequantize((acc * inv).to(torch.float32), recipe.out, torch.float64)


__all__ = ["flash_triton"]
