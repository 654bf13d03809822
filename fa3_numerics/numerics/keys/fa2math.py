"""Recipe key ``fa2math``: the float32 arithmetic of ``loop=fa2``'s softmax, forward and backward.

- ``fa3`` (default): FA3's tile step on FA2's tiles (``emulator._flash``): P~ = exp2 of one FFMA,
  exp2 and log correctly rounded.
- ``torch``: FlashAttention-2 as PyTorch builds it (``numerics/fa2_loop.py``, fitted to SDPA's flash
  kernel on an H200, reports/h200/backward/): torch compiles FA2 with ``UNFUSE_FMA``, so P~ =
  exp2f(__fmul_rn(S, scale log2 e) - m scale log2 e), a multiply and a subtract, in the forward and
  (against the LSE) in the backward; exp2f's result rounded toward zero (the special-function unit
  lands low: the backward from the kernel's own O and LSE goes from 99.94-99.98% to 99.99-100% of dV
  identical); the LSE as FA2's ``row_max * softmax_scale + __logf(row_sum)``, one FFMA with __logf's
  lg2 rounded toward zero times float32 ln 2 (the dumped LSE of the split kernel: 83% identical with
  a correctly rounded log, 90% with this); the split-KV combine's sum over splits in its butterfly
  order; the rescaled row sum as one FFMA with the tile's first P~ (nvcc's contraction). With
  ``sfu=h200`` also the combine's libdevice expf/logf bit for bit (numerics/libdevice.py).
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "fa2math", "fa3", "float32 softmax arithmetic of loop=fa2: fa3 (FA3's tile step: one FFMA, exp2 and log "
    "correctly rounded) or torch (PyTorch's FA2 build: unfused scale multiply, exp2f and __logf's lg2 "
    "rounded toward zero, LSE = fma(m, scale, __logf(l)), the rescaled row sum as one FFMA, the combine's "
    "butterfly sum and, with sfu=h200, its libdevice expf/logf; P the same way in the backward)",
    choices=("fa3", "torch"), backends=("sdpa-flash",), cost=lambda v: 0,
))


@register_check
def _fa2math(r) -> str | None:
    if r.fa2math != "fa3" and r.loop != "fa2":
        return f"fa2math={r.fa2math} is the arithmetic of FA2's loop; it needs loop=fa2"
    return None
