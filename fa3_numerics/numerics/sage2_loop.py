"""The flash loop of SageAttention2's Hopper kernel (recipe key ``loop=sage2``).

Exposed: ``flash_sage2``, ``LOG2E_F32``, ``S_FP8_OFFSET``.

``qk_int8_sv_f8_attn_kernel`` of thu-ml/SageAttention ``csrc/qattn/qk_int_sv_f8_cuda_sm90.cu``
(the kernel ``sageattn`` runs on sm90, ``pv_accum_dtype="fp32+fp32"``, ``fuse_v_scale``), step by
step as nvcc 13.0 compiles it for sm_90a with setup.py's flags (``--use_fast_math``; PTX of the
d-128 FP16 instance in reports/h200/sage2/): per thread of the d-128 kernel, 264 ``fma.rn.ftz.f32``,
196 ``mul.ftz.f32``, 132 ``ex2.approx.ftz.f32``, 128 ``add.ftz.f32``, 2 ``rcp.approx.ftz.f32``.

- CTA of 64 queries (4 warps of 16 rows), K/V tiles of 128 keys visited first to last; causal
  stops after tile ceil(min(N_k, 64 (bx + 1)) / 128) - 1 (cu:252-256) and masks only that last
  tile (cu:407-437); the non-causal last tile masks the keys past N_k (-5e6, cu:428-433).
- S: ``wgmma m64n128k32 s32.s8.s8`` of the INT8 codes (exact), ``cvt.rz.f32.s32`` (exact below
  2^24, cu:303). c = float32(float32(sm_scale * log2e) * float32(q_scale * k_scale)) (cu:153,
  263-264: the softmax scale in log2 units times the dequantization, one constant per thread).
- every tile but the last: m_tile = fma(rowmax S, c, -8.807) per thread, max over the quad's 4
  threads (each its own K scale group) (attn_utils.cuh:366-392); m_new = max(m, m_tile);
  P~ = ex2.approx.ftz(fma(S, c, -m_new)) -- the offset log2(448) is in m, so P~ <= 448 (cu:308,
  attn_utils.cuh:379, 437-449).
- the last tile: S_f = float32(S * q_scale * k_scale) first (cu:402), masked, then the same with
  sm_scale * log2e alone: m_tile = fma(rowmax S_f, sl, -8.807), P~ = ex2(fma(S_f, sl, -m_new)).
- o_scale = ex2.approx.ftz(m - m_new) (``sub.f32``, attn_utils.cuh:396).
- row sum in float32 from P~ *before* its FP8 rounding (cu:310-320): per thread, per 16-key slab,
  ((p0 + p1) + p8) + p9 over its columns {2t, 2t+1, 8+2t, 9+2t}, the first slab fused with the
  rescale d = fma(d, o_scale, slab0) (nvcc contracts ``d *= o_scale`` into it), then the 7 others
  added in order; at the end (d0 + d1) + (d2 + d3) (shfl xor 1, then 2; attn_utils.cuh:731-740).
- P~ to e4m3 (``cvt.rn.satfinite.e4m3x2.f32``, attn_utils.cuh:479, numeric_conversion.cuh:53).
- P V: ``wgmma m64nDk32 f32.e4m3.e4m3``, 4 k-steps of 32 keys from a zero accumulator (RO_temp,
  cu:328-342: the FP22 accumulation spans one 128-key tile), then O = fma(O, o_scale, RO_temp) in
  float32 every tile (``RO *= o_scale`` contracted with ``RO += RO_temp``, cu:344-356): the
  "two-level" flush happens after every tile (``acc=two-level``; ``fp32`` for contrast).
- end: O times rcp.approx.ftz(d) (attn_utils.cuh:742-775), then times V's per-channel scale
  (cu:492-515), rounded to the output type (``cvt.rn.f16x2.f32`` / bf16x2, cu:528-549).

``ex2.approx.ftz.f32`` is modelled as the emulator's FA3 model of the same instruction (P~
correctly rounded, the rescale rounded toward zero, subnormals flushed); ``rcp.approx.ftz.f32`` as
``sage_quant.recip32`` (the reciprocal measured on the H200 inside Triton's division).
"""

from __future__ import annotations

import math

import torch

from .accumulators import get_accumulator
from . import sfu
from .emulator import PROGRESS, Prepared, _fma32, exp2_rn, exp2_rz, flush_subnormals
from .families import mma_format
from .formats import quantize_dequantize
from .reference import causal_mask
from .sage_quant import recip32
from ..errors import UsageError

# math::log2e of csrc/math.cuh as the float32 constant in the PTX (0f3FB8AA3B)
LOG2E_F32 = float(torch.tensor(1.44269504088896340736, dtype=torch.float32))
# S_FP8_OFFSET of csrc/qattn/attn_utils.cuh: log2(448) to 3 decimals, float32 0fC10CE979 negated
S_FP8_OFFSET = 8.807
# the kernel's "minus infinity" for m and masked scores (cu:203, 433)
_NEG = -5000000.0
# the kernel's K/V tile and the slab of the S accumulator a thread sums at once
CTA_K = 128
_SLAB = 16

ACCS = ("two-level", "fp32")


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def iterations(q_index: torch.Tensor, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> torch.Tensor:
    """K/V tiles each query row's CTA visits ([R] int64): all of them, or with ``causal`` those up to
    the tile holding the CTA's last query (cu:252-256)."""
    if not causal:
        return torch.full_like(q_index, -(-seqlen_k // block_n))
    ends = torch.clamp((torch.div(q_index, block_m, rounding_mode="floor") + 1) * block_m, max=seqlen_k)
    return torch.div(ends + block_n - 1, block_n, rounding_mode="floor")


def slab_sums(p: torch.Tensor) -> torch.Tensor:
    """A tile's P~ [.., R, 128] as the four threads of a quad sum it: [.., R, 8 slabs, 4 threads],
    slab j of thread t = ((p[16j+2t] + p[16j+2t+1]) + p[16j+8+2t]) + p[16j+9+2t], in float32."""
    x = p.reshape(*p.shape[:-1], p.shape[-1] // _SLAB, 2, 4, 2)
    return ((x[..., 0, :, 0] + x[..., 0, :, 1]) + x[..., 1, :, 0]) + x[..., 1, :, 1]


def flash_sage2(recipe, pre: Prepared, q_index: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Output rows ``q_index`` ([B, H, R, Dv], float64 holding values of ``recipe.out``): Q and K
    as INT8 codes with per-thread float32 descales (``iquant=triton-eps``), V as FP8 codes with a
    per-channel descale (``vgran=channel``)."""
    dev = pre.q.values.device
    qv = pre.q.values.to(torch.float32)  # INT8 codes: their float32 GEMM is exact
    qd = pre.q.descale.to(torch.float32)
    kn, kd = pre.k.values, pre.k.descale.to(torch.float32)
    vn, vd = pre.v.values, pre.v.descale.to(torch.float32)
    b, h, r, _ = qv.shape
    dv = vn.shape[-1]
    nk, bn, bm = pre.seqlen_k, pre.block_n, pre.block_m
    if vd.shape[2] != 1:
        raise UsageError(f"recipe {recipe.short_str()}: loop=sage2 multiplies O by V's descale at the end, which "
                         "needs one V scale over all tokens (vgran=channel, or gran=head/tensor)")
    if causal and pre.seqlen_q != nk:
        raise UsageError(f"recipe {recipe.short_str()}: loop=sage2 models sageattn's causal kernel, whose mask "
                         f"needs seqlen_q = seqlen_k (got {pre.seqlen_q} and {nk})")
    accumulate = get_accumulator(recipe.acc)
    fmts = (mma_format(recipe.p), mma_format(recipe.v))
    sl = torch.tensor(_f32(_f32(scale) * LOG2E_F32), dtype=torch.float32, device=dev)
    off = -_f32(float(recipe.p_offset))
    # sfu=h200 (keys/sfu.py): the measured ex2.approx.ftz for P~ and the rescale, else the stand-ins
    ex2_p, ex2_a = (sfu.ex2, sfu.ex2) if sfu.wanted(recipe) else (exp2_rn, exp2_rz)
    n_it = iterations(q_index, nk, bm, bn, causal).to(dev)

    m = torch.full((b, h, r, 1), _NEG, dtype=torch.float32, device=dev)
    d4 = torch.ones((b, h, r, 4), dtype=torch.float32, device=dev)  # d starts at 1; o_scale 0 clears it
    acc = torch.zeros((b, h, r, dv), dtype=torch.float32, device=dev)
    n_tiles = int(n_it.max()) if r else 0
    tick = PROGRESS.get()  # progress hook
    for t in range(n_tiles):
        if tick is not None:
            tick(t, n_tiles, "KV tiles")
        s0, s1 = t * bn, min(nk, (t + 1) * bn)
        width = s1 - s0
        active = (n_it > t)[:, None]  # [R, 1]: the row's CTA visits this tile
        last = (n_it == t + 1)[:, None]
        k_t = kn[:, :, s0:s1].to(torch.float32).transpose(-1, -2)
        s = torch.matmul(qv, k_t)
        dq = (qd * kd[:, :, s0:s1].transpose(-1, -2)).to(torch.float32)  # q_scale * K_scale
        c = (sl * dq).to(torch.float32)
        s_last = (s * dq).to(torch.float32)
        if causal:
            s_last = s_last.masked_fill(~causal_mask(q_index, s0, s1, pre.seqlen_q, nk), _NEG)
        m_tile = torch.where(last, _fma32(s_last, sl, off), _fma32(s, c, off)).amax(dim=-1, keepdim=True)
        m_new = torch.where(active, torch.maximum(m, m_tile), m)
        o_scale = flush_subnormals(ex2_a((m - m_new).to(torch.float32)))
        x = torch.where(last, _fma32(s_last, sl, -m_new), _fma32(s, c, -m_new))
        p = flush_subnormals(ex2_p(x))
        p = torch.where(active, p, torch.zeros_like(p))
        if width < bn:  # keys past N_k: masked to 0 (and V padded with zeros: core.py)
            p = torch.nn.functional.pad(p, (0, bn - width))
        slabs = slab_sums(p)
        d_new = _fma32(d4, o_scale, slabs[..., 0, :])
        for j in range(1, slabs.shape[-2]):
            d_new = d_new + slabs[..., j, :]
        d4 = torch.where(active, d_new, d4)
        p8 = quantize_dequantize(p[..., :width], recipe.p)
        pv = accumulate(torch.zeros_like(acc), p8, vn[:, :, s0:s1].to(torch.float32), fmts)
        acc = torch.where(active, _fma32(acc, o_scale, pv), acc)
        m = m_new
    if tick is not None:
        tick(n_tiles, n_tiles, "KV tiles")
    d = ((d4[..., 0] + d4[..., 1]) + (d4[..., 2] + d4[..., 3])).unsqueeze(-1)
    o = ((acc * recip32(d)).to(torch.float32) * vd).to(torch.float32)
    return quantize_dequantize(o, recipe.out, torch.float64)


__all__ = ["flash_sage2", "iterations", "slab_sums", "LOG2E_F32", "S_FP8_OFFSET", "ACCS", "CTA_K"]
