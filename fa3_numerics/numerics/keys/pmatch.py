"""Recipe key ``pmatch``: which block scale NVFP4 P is divided by (``p=nvfp4``, SageAttention3's two-level P).

SageAttention3's kernel divides P~ by the float32 block scale sf = blockmax / 6 and converts the
same sf to E4M3 for the MMA, so elements are scaled by the unrounded scale and dequantized by
the rounded one: every block carries a common relative error of up to 2^-4 (``kernel``).
``scale`` divides by the rounded E4M3 scale, as the Q/K/V quantizer does
(``microscaling.quantize_p_two_level``). No effect unless ``p=nvfp4``.
"""

from __future__ import annotations

from . import RecipeKey, register_key

register_key(RecipeKey(
    "pmatch", "kernel", "NVFP4 P elements divided by the float32 block scale (kernel: SageAttention3) or by its E4M3 "
    "rounding (scale)",
    choices=("kernel", "scale"), stages=("p",), cost=lambda v: 0,
))
