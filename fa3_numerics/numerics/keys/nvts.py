"""Recipe key ``nvts``: the FP32 tensor scale of NVFP4 Q, K and V.

NVIDIA's NVFP4 scales twice: an FP32 scale t = amax / (448 x 6) per tensor, then one E4M3
scale per 16 elements of x / t, so that the block scales use E4M3's range whatever the
tensor's magnitude (``microscaling.nvfp4_quantize``). SageAttention3 quantizes Q, K and V
with the E4M3 block scales alone (``scaled_fp4_quant``: SF = amax16 / 6), which works while
every block's amax lies in about [6 x 2^-6, 6 x 448].

- ``tensor``: one FP32 scale per tensor (NVIDIA's NVFP4);
- ``head``: one per (batch, head), as the FA3 kernel's descales;
- ``none``: no tensor scale (SageAttention3).

The tensor scale multiplies S (Q, K: folded into the softmax scale) or O (V) once. No effect
without an ``nvfp4`` tensor; P's level-1 scale is the exp2 offset (``poff``) instead.
"""

from __future__ import annotations

from . import RecipeKey, register_key

register_key(RecipeKey(
    "nvts", "tensor", "FP32 tensor scale of NVFP4 Q, K, V: tensor (NVIDIA's NVFP4), head (per batch and head), none "
    "(SageAttention3: E4M3 block scales alone)",
    choices=("tensor", "head", "none"), stages=("qk", "v"), tensors=("q", "k", "v"), cost=lambda v: 0,
))
