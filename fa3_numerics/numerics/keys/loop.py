"""Recipe key ``loop``: whose online-softmax loop the flash algorithm follows.

- ``fa3`` (default): the FA3 forward kernel's (``numerics/emulator.py``): the softmax scale in
  the exp2 FMA, P~ offset by ``poff``, four partial row sums per row kept across tiles, FTZ.
- ``triton``: the loop of Triton's fused-attention tutorial as SageAttention 1 writes it
  (``sageattention/attn_qk_int8_per_block*.py``, ``_attn_fwd_inner``; ``numerics/sage_loop.py``):
  S = float32(int32 dot) * q_scale * k_scale, in log2 units (``iquant=triton`` folded the
  softmax scale into q_scale; with another quantizer the loop folds it into Q's descale);
  m_new = max(m, rowmax S); P~ = exp2(S - m_new); the tile's row sum reduced at once and
  l = l alpha + rowsum with alpha = exp2(m - m_new); O = O alpha + P~ V; at the end O / l,
  rounded to the output format. Causal: tiles past a query block's diagonal are not visited,
  masked scores get -1e6 (exp2 gives 0, as -inf does).
- ``sage2``: the loop of SageAttention2's Hopper CUDA kernel (``csrc/qattn/qk_int_sv_f8_cuda_sm90.cu``;
  ``numerics/sage2_loop.py``): S = float32(int32 dot), P~ = exp2(fma(S, sm_scale log2(e) q_scale
  k_scale, -(m - poff))) with the offset in the running max, the row sum from float32 P~ in the
  kernel's thread order, P V from a zero accumulator per 128-key tile then O = fma(O, alpha, P V),
  at the end O times rcp(l) times V's per-channel descale. Causal needs seqlen_q = seqlen_k (the
  kernel's mask is top-left aligned).
- ``fa2``: FlashAttention-2's forward as PyTorch SDPA's flash kernel runs it on Hopper
  (``numerics/fa2_loop.py``): FA3's tile step on FA2's tiles (128 x 64 at head dim 128, 128 x 128
  at 64), tiles last to first, and FA2's split-KV (its heuristic, the split kernel's tiles, the
  float32 combine) when the call has too few query tiles to fill the GPU; the backward takes FA2's
  backward tiles.
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "loop", "fa3", "online-softmax loop of the flash algorithm: fa3 (the FA3 kernel's), triton (Triton's "
    "tutorial loop as SageAttention 1 writes it), sage2 (SageAttention2's Hopper CUDA kernel) or fa2 "
    "(FlashAttention-2 as torch SDPA's flash kernel runs it: its tiles, split-KV and combine)",
    choices=("fa3", "triton", "sage2", "fa2"), backends=("sage1", "sage2", "sdpa-flash"), cost=lambda v: 0,
))


@register_check
def _loop(r) -> str | None:
    if r.loop != "fa3" and r.algo != "flash":
        return f"loop={r.loop} is a flash loop; it needs algo=flash"
    if r.loop != "fa3" and r.norm != "deferred":
        return f"loop={r.loop} divides by the row sum once at the end (norm=deferred)"
    if r.loop == "sage2":
        if r.acc not in ("two-level", "fp32"):
            return (f"acc={r.acc}: loop=sage2 adds each tile's P V into O with an FMA (the kernel's "
                    "fp32+fp32 buffer); use acc=two-level (its FP22 wgmma per tile) or acc=fp32")
        if r.bn and r.bn % 16:
            return f"bn={r.bn}: loop=sage2 sums P~ in 16-key slabs (the kernel's K tile is 128); use a multiple of 16"
    return None
