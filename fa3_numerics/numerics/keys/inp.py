"""Recipe key ``in``: the format a caller hands the kernel Q, K and V in.

- ``none`` (default): the kernel's operands are made from the float64 inputs directly (FA3's
  backend quantizes them itself; the emulator rounds each operand once).
- ``fp16`` / ``bf16`` / ``fp32``: Q, K and V are first rounded to this format (after the
  rotation, which a user applies to their own tensors before the call), and every step before
  the kernel's own quantization runs in it. SageAttention 1 (``sageattn``) takes FP16, BF16 or
  FP32 tensors: K smoothing is computed in that format (``km = k.mean(dim=seq)`` rounded to it,
  ``k -= km`` rounded again), the integer quantizer reads it, and V is converted to FP16 from it
  (``v.to(torch.float16)``: a second rounding for BF16 inputs).

torchao's low-precision attention quantizes the model's BF16 tensors (``torchao-fp8``).

The emulator applies the rounding in ``prepare``; a backend that takes 16-bit tensors lists
itself here.
"""

from __future__ import annotations

from . import RecipeKey, register_key

INPUT_FORMATS = ("none", "fp16", "bf16", "fp32")

register_key(RecipeKey(
    "in", "none", "format Q, K and V are handed to the kernel in, before its own quantization: none (the "
    "float64 inputs), fp16, bf16, fp32 (SageAttention: K smoothing in that format, V converted from it)",
    field="inp", choices=INPUT_FORMATS, stages=("qk", "v"), exact="none", tensors=("q", "k", "v"),
    backends=("sage1", "sage2", "torchao-fp8"), cost=lambda v: 0,
))
