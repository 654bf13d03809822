"""Check for ``acc=fp16`` (SageAttention v1's FP16 accumulation of P V; ``accumulators.fp16``).

The FP16 MMA (``mma.sync ... f16.f16.f16.f16``) takes FP16 operands only, so the recipe
must cast P and V to FP16. No key of its own: the value is one of ``acc``'s.
"""

from __future__ import annotations

from . import register_check


@register_check
def _fp16_operands(r) -> str | None:
    if r.acc == "fp16" and (r.p != "fp16" or r.v != "fp16"):
        return f"acc=fp16 is an FP16 MMA, whose operands are FP16: set p=fp16 and v=fp16 (got p={r.p}, v={r.v})"
    return None
