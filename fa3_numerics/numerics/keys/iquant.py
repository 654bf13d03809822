"""Recipe key ``iquant``: the arithmetic of the integer quantizer of Q and K (``qk=int8``/``int4``).

- ``exact`` (default): descale = amax / qmax from a float64 amax, codes = round(x / descale) in
  float64 with the tie rule ``ties``; the softmax scale is applied to S in the softmax
  (``numerics/quant.py``).
- ``triton``: SageAttention 1's Triton quantizer (``sageattention/quant_per_block.py``,
  ``quant_per_block_int8_kernel``) step by step in float32: x = float32(input) *
  float32(sm_scale * 1.44269504) for Q (1.0 for K) -- the softmax scale and log2(e) are folded
  into Q *before* it is quantized, so Q's descale carries them and S = codes_q . codes_k *
  q_scale * k_scale comes out in log2 units --; scale = max|x| / 127; code =
  trunc(x / scale + 0.5 sign(x)) (``+= 0.5 * where(x >= 0, 1, -1)``, then ``.to(tl.int8)``,
  which truncates), each operation a float32 rounding (``numerics/sage_quant.py`` says how
  Triton's division is modelled). It needs ``loop=triton``, the loop that takes S in log2 units
  (that loop also runs other quantizers: it then folds the scale into Q's descale itself). No
  effect on float or microscaling Q/K (as ``ties``).
- ``triton-eps``: SageAttention2's Triton quantizer (``sageattention/triton/quant_per_thread.py``,
  ``quant_query_per_thread_int8_kernel`` and ``quant_key_per_thread_int8_kernel``): the same float32
  steps, with no softmax scale folded into Q (its kernels apply it to S) and scale =
  max|x| / 127. + 0.0000001 (the float32 constant 1e-7 added after the division; at a scale near
  0.01 that is ~100 ulps, enough to move codes that sit near a rounding boundary). Any loop.
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "iquant", "exact", "integer Q/K quantizer arithmetic: exact (float64, softmax scale on S) or triton "
    "(SageAttention 1's Triton quantizer in float32, sm_scale*log2(e) folded into Q before quantizing) or "
    "triton-eps (SageAttention2's: no scale folded, max|x|/127 + 1e-7)",
    choices=("exact", "triton", "triton-eps"), stages=("qk",), exact="exact", tensors=("q", "k"),
    backends=("sage1", "sage2"),
    cost=lambda v: 0,
))


@register_check
def _iquant(r) -> str | None:
    if r.iquant == "triton" and r.loop != "triton":
        return ("iquant=triton folds the softmax scale into Q, which only loop=triton expects (S in log2 units): "
                "set loop=triton too")
    return None
