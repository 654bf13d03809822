"""Recipe key ``kpad``: what the keys past the end of the sequence in the last KV tile score.

- ``mask`` (default): they are masked out (score -inf), as FA3 and the reference do.
- ``zero``: they enter the softmax with score 0 and V = 0. SageAttention 1's non-causal Triton
  kernel (``attn_qk_int8_per_block.py``) loads the last tile's K and V with a mask (zeros past
  ``kv_len``) but never masks S, so each padding key adds exp2(0 - m) to the row sum and nothing
  to P V: outputs shrink when seqlen_k is not a multiple of the 64-key tile. Its causal kernel
  masks them (they lie past every query row's diagonal). Needs ``loop=triton``.
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "kpad", "mask", "keys past seqlen_k in the last KV tile: mask (-inf) or zero (score 0, V 0: SageAttention 1's "
    "non-causal kernel)", choices=("mask", "zero"), backends=("sage1",), cost=lambda v: 0,
))


@register_check
def _kpad(r) -> str | None:
    if r.kpad == "zero" and r.loop != "triton":
        return "kpad=zero models SageAttention 1's Triton loop; it needs loop=triton"
    return None
