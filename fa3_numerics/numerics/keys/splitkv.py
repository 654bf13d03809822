"""Recipe key ``splitkv``: whether the FA3 loop cuts the keys into split-KV runs.

- ``none`` (default): one pass over every KV tile (``flash_attn_func``'s default ``num_splits=1``,
  what the fa3 backend calls).
- ``fa3``: FA3's own choice with ``num_splits=0`` (hopper/heuristics.h; ``numerics/fa3_split.py``):
  under-filled calls split each query tile's KV range into runs combined in float32. torch's
  ``_scaled_dot_product_attention_quantized`` passes 0, so torchao's FP8 attention runs it: on the
  H200 it decides the output bits at seqlen 1000 and head dim 64 (8 heads, batch 1).
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "splitkv", "none", "split-KV of the FA3 loop: none (num_splits=1) or fa3 (FA3's num_splits=0 heuristic, "
    "partial O combined in float32, as torch's quantized SDPA calls FA3)",
    choices=("none", "fa3"), exact="none", backends=("torchao-fp8",), cost=lambda v: 0,
))


@register_check
def _splitkv(r) -> str | None:
    if r.splitkv == "fa3" and (r.algo != "flash" or r.loop != "fa3" or r.norm != "deferred"):
        return "splitkv=fa3 is FA3's split-KV of its own flash loop (algo=flash, loop=fa3, norm=deferred)"
    return None
