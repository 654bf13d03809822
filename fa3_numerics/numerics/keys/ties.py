"""Recipe key ``ties``: how integer quantization of Q and K rounds ties (``qk=int8``/``int4``).

``away`` (round half away from zero) is what SageAttention's Triton quantizers compute (add
0.5 sign(x), truncate), used by every default entry point; ``even`` is the CUDA quantizers'
``cvt.rni.sat.s8.f32`` (``fa3_numerics.numerics.intformats``). Continuous data almost never
hits a tie; dyadic data does. No effect on float or microscaling formats.
"""

from __future__ import annotations

from ..intformats import TIES
from . import RecipeKey, register_key

register_key(RecipeKey(
    "ties", "away", "tie rule of integer Q/K quantization: away (SageAttention's Triton quantizers), even (its "
    "CUDA quantizers, cvt.rni)",
    choices=TIES, stages=("qk",), tensors=("q", "k"), cost=lambda v: 0, backends=("sage1",),
))
