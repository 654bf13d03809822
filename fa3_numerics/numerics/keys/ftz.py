"""Recipe key ``ftz``: flush float32 subnormals to zero in the kernel's softmax arithmetic.

FA3 is built with ``--use_fast_math``, so its float32 multiplies, adds and ``ex2.approx.ftz``
flush subnormal inputs and results to zero; ``ftz=0`` keeps IEEE subnormals instead (what a
float32 emulator does by default). The emulator reads ``recipe.ftz``. No other backend can
switch its build flags, so ``ftz=0`` is refused on them (``backends`` is empty).

This module is also the worked example of adding a key: one ``RecipeKey`` and nothing else.
"""

from __future__ import annotations

from . import RecipeKey, parse_bool, register_key

register_key(RecipeKey(
    "ftz", True,
    "flush float32 subnormals to zero in the softmax arithmetic, as the FA3 build (--use_fast_math); 0 = IEEE",
    parse=parse_bool, normalize=bool,
))
