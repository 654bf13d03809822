"""Recipe key ``fquant``: the arithmetic of the scaled cast of Q, K, V into a float format (FP8).

- ``exact`` (default): descale = float32(amax / fmt.max) from a float64 amax, code =
  cast(x / descale) in float64 (``numerics/quant.py``), as the fa3 backend's own pre-pass.
- ``torchao``: torchao 0.18's low-precision attention quantizer
  (``prototype/attention/quantization/triton_qkv_quantization.py``): in float32, scale = 448 / amax
  and descale = amax / 448 with Triton's ``div.full.f32`` (modelled as in ``sage_quant``), both 1
  where amax <= 1e-12, code = e4m3(float32(x * scale)). On BF16 inputs x * scale often lands on
  (or an ulp off) an E4M3 tie, where multiplying by a rounded 448 / amax and dividing by a rounded
  amax / 448 round apart: on random BF16 inputs 0.15-0.56% of the Q, K, V codes differ from
  ``exact``'s, and 25-75% of the descales by an ulp (Triton's division against IEEE's).
  No effect on static descales (``dscale``), ``pow2``, integer or microscaling formats.
"""

from __future__ import annotations

from . import RecipeKey, register_key

register_key(RecipeKey(
    "fquant", "exact", "float Q/K/V quantizer arithmetic: exact (x / descale in float64) or torchao (float32 x * "
    "(448 / amax), torchao 0.18's Triton quantizer)", choices=("exact", "torchao"), stages=("qk", "v"),
    exact="exact", tensors=("q", "k", "v"), backends=("torchao-fp8", "sage2"), cost=lambda v: 0,
))
