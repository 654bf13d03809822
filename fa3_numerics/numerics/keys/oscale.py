"""Recipe key ``oscale``: how O is scaled into a narrow output format (``out=e4m3``/``e5m2``).

- ``none`` (default): O is cast to ``out`` as it is (saturating), as every kernel with a 16-bit
  output writes it.
- ``amax``: O is written in FP8 with one scale for the whole tensor, taken from O's own amax:
  descale_o = amax(O) / fmt.max (float32), O8 = cast(O / descale_o), read back as O8 * descale_o.
  cuDNN's ``sdpa_fp8`` on Hopper writes O in FP8 only (a BF16/FP16 O from FP8 inputs needs
  Blackwell and cuDNN 9.13: vllm-project/vllm #45251) as ``O * scale_o`` and reports ``Amax_O``,
  the amax of O before ``scale_o`` (cudnn-frontend ``node/matmul_fp8.h``: the amax reduction
  reads the descaled product, the ``scale_c`` multiply writes C); TransformerEngine sets
  scale_o = 448 / amax_o. The amax is over every query row, as the kernel's: the emulator
  computes the float32 O of every row even when fewer rows are asked for. Needs the flash loop.
"""

from __future__ import annotations

from ..formats import get_format
from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "oscale", "none", "O into a narrow output format: none (cast as is) or amax (FP8 O with one scale per tensor "
    "from O's amax, as cuDNN's sdpa_fp8 writes it on Hopper with TransformerEngine's scale_o = 448/amax_o)",
    choices=("none", "amax"), stages=("out",), exact="none", backends=("cudnn-fp8",), cost=lambda v: 0,
))


@register_check
def _oscale(r) -> str | None:
    if r.oscale == "none":
        return None
    f = get_format(r.out)
    if (f.dtype is None and f.storage is None) or f.name == "fp32" or not f.saturate:
        return f"oscale={r.oscale} scales O into an FP8 output; set out=e4m3 (or e5m2), or drop oscale"
    if r.algo != "flash" or r.loop != "fa3":
        return f"oscale={r.oscale} is modelled on the flash loop only (algo=flash, loop=fa3)"
    return None
