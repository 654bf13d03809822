"""Recipe key ``vgran``: V's scale granularity, apart from Q's and K's; and the granularity checks.

- ``same``: V is scaled at ``gran`` like Q and K (the FA3 recipes);
- ``channel``: one scale per (batch, kv-head, channel) over all tokens (SageAttention2's
  ``per_channel_fp8``). V's contraction in P V runs over tokens, so a per-channel scale is
  constant along it and multiplies O once at the end, as a per-head descale does.

Checks registered here:

- ``gran=channel`` is refused: Q's and K's channels are the contraction of Q K^T, so their
  scales cannot be taken out of the product (use ``vgran=channel`` for V, or a microscaling
  format for block scales along head_dim);
- ``gran=thread`` needs ``vgran=channel`` (or a V format without scales: FP16/BF16/FP32 or
  microscaling): its groups are the Q K^T accumulator's fragments, which V does not share.
"""

from __future__ import annotations

from ..families import family
from ..formats import get_format
from ..granularity import PerChannel, PerThread
from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "vgran", "same", "scale granularity of V: same (as gran) or channel (one scale per channel over all tokens: "
    "SageAttention2)",
    choices=("same", "channel"), stages=("v",), exact="same", tensors=("v",), backends=("sage2",),
    # a per-channel descale multiplies O per column at the end instead of once per row
    cost=lambda v: 1 if v == "channel" else 0,
))


def _v_scaled(r) -> bool:
    # V formats quantized with a float32 descale at ``gran`` (FP8); wide and MX formats are not
    return family(r.v) == "float" and get_format(r.v).saturate


@register_check
def _granularities(r) -> str | None:
    if isinstance(r.gran, PerChannel):
        return ("gran=channel would scale Q and K per channel, the contraction of Q K^T, which no kernel can take out "
                "of the product; use vgran=channel for V, or qk=mxfp8/nvfp4 for block scales along head_dim")
    if isinstance(r.gran, PerThread) and r.vgran == "same" and _v_scaled(r):
        return ("gran=thread groups follow the Q K^T accumulator fragments, which V does not share; add vgran=channel "
                "(SageAttention2) or give V a format without scales")
    return None
