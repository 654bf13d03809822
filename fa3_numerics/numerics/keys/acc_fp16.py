"""Check for ``acc=fp16`` and ``acc=fp16-hopper`` (SageAttention v1's FP16 accumulation of P V;
``accumulators.fp16``, ``accumulators.fp16_hopper``).

The FP16 MMA (``mma.sync ... f16.f16.f16.f16``) takes FP16 operands only, so the recipe
must cast P and V to FP16. No key of its own: the value is one of ``acc``'s.
"""

from __future__ import annotations

from . import register_check


@register_check
def _fp16_operands(r) -> str | None:
    if r.acc in ("fp16", "fp16-hopper") and (r.p != "fp16" or r.v != "fp16"):
        return (f"acc=fp16 is an FP16 MMA (acc=fp16-hopper too), whose operands are FP16: set p=fp16 and v=fp16 "
                f"(got acc={r.acc}, p={r.p}, v={r.v})")
    return None
