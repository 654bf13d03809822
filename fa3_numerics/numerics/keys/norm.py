"""Recipe key ``norm``: when the flash algorithm divides by the softmax row sum.

- ``deferred`` (FlashAttention-2/3): O accumulates unnormalised P~ V across KV tiles, rescaled
  by exp2(m_old - m_new); one division by the row sum at the end.
- ``tile`` (FlashAttention, arXiv 2205.14135, Algorithm 1, line 12): O is kept normalised.
  Per KV tile, P~ is taken against the tile's own row max m~, and
  O <- (l_old e^(m_old - m_new) O + e^(m~ - m_new) P~ V) / l_new, with
  l_new = e^(m_old - m_new) l_old + e^(m~ - m_new) rowsum(P~): two more multiplies and a
  division per element per tile, each a float32 rounding.

Choices where Algorithm 1 leaves the arithmetic open (the emulator's, stated): O, l and m are
float32 between tiles (flash-attn 1.x kept O in a float32 buffer across KV blocks); exp is
exp2 of log2(e)-scaled scores as in every later kernel; the rescale factors use the same
float32 exp2 model as the FA3 emulation; P~ V of a tile starts from a zero accumulator.
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "norm", "deferred", "softmax normalisation of the flash algorithm: deferred (FA2/FA3: one division at the end) "
    "or tile (FA1: O normalised after every KV tile)",
    choices=("deferred", "tile"),
    # two extra multiplies and a division of O per tile
    cost=lambda v: 2 if v == "tile" else 0,
))


@register_check
def _flash_only(r) -> str | None:
    if r.norm == "tile" and r.algo != "flash":
        return "norm=tile is FlashAttention's per-tile normalisation; it needs algo=flash"
    return None
