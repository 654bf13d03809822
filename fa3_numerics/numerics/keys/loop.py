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
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "loop", "fa3", "online-softmax loop of the flash algorithm: fa3 (the FA3 kernel's) or triton (Triton's "
    "tutorial loop as SageAttention 1 writes it)",
    choices=("fa3", "triton"), backends=("sage1",), cost=lambda v: 0,
))


@register_check
def _loop(r) -> str | None:
    if r.loop == "triton" and r.algo != "flash":
        return "loop=triton is a flash loop; it needs algo=flash"
    if r.loop == "triton" and r.norm != "deferred":
        return "loop=triton divides by the row sum once at the end (norm=deferred)"
    return None
