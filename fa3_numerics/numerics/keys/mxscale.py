"""Recipe key ``mxscale``: how MXFP8 block scales are rounded; and the microscaling formats' checks.

An MXFP8 block of 32 elements gets the E8M0 scale 2^e (``fa3_numerics.numerics.microscaling``):

- ``ceil`` (NVIDIA's rule: cuBLAS block scaling, TransformerEngine, torchao RCEIL): e =
  ceil(log2(amax / 448)), so no element saturates;
- ``floor`` (the OCP MX v1.0 specification and microxcaling): e = floor(log2 amax) - 8, so the
  largest elements of a block can saturate at 448.

Applies to every MXFP8 tensor of the recipe (Q, K, V, P).

Checks registered here (the format families): ``sscale=split`` needs a float Q/K format; the
Hopper tensor-core accumulator models (``acc=fp22``, ``two-level``) were fitted to the FA3 FP8
kernel on an H200, while MXFP8 and NVFP4 run on Blackwell's block-scaled MMA (sm100), whose
accumulation is not modelled, so a recipe with either format anywhere takes ``acc=fp32``. The
ablation factors ``qkfmt`` and ``vfmt`` vary the format family of Q/K and of V over the kernel's
recipe.
"""

from __future__ import annotations

from ..families import family
from . import Factor, RecipeKey, register_check, register_factor, register_key

register_key(RecipeKey(
    "mxscale", "ceil", "MXFP8 block-scale rounding: ceil (NVIDIA: 2^ceil(log2(amax/448)), nothing saturates) or "
    "floor (OCP MX spec: 2^(floor(log2 amax) - 8), a block's largest values may saturate)",
    choices=("ceil", "floor"), stages=("qk", "v", "p"), tensors=("q", "k", "v"), cost=lambda v: 0,
))


@register_check
def _mx_accumulator(r) -> str | None:
    mx = [k for k in ("qk", "v", "p") if family(getattr(r, k)) == "mx"]
    if mx and r.acc in ("fp22", "two-level"):
        return (f"acc={r.acc} models Hopper's FP8 tensor core; {', '.join(f'{k}={getattr(r, k)}' for k in mx)} "
                "runs on Blackwell's block-scaled MMA (sm100), which has no fitted model here: use acc=fp32")
    return None


register_factor(Factor("qkfmt", "e4m3", "format family of Q and K: e4m3 (FP8), int8, int4 (SageAttention), mxfp8, "
                                        "nvfp4 (microscaling along head_dim)",
                       {"e4m3": "", "int8": "qk=int8", "int4": "qk=int4", "mxfp8": "qk=mxfp8", "nvfp4": "qk=nvfp4"}))
register_factor(Factor("vfmt", "e4m3", "format family of V: e4m3, mxfp8, nvfp4 (microscaling along keys)",
                       {"e4m3": "", "mxfp8": "v=mxfp8", "nvfp4": "v=nvfp4"}))


@register_check
def _split_scale(r) -> str | None:
    # PyTorch's math SDPA rounds Q sqrt(scale) and K sqrt(scale) to their float format
    if r.sscale == "split" and family(r.qk) != "float":
        return (f"sscale=split rounds Q and K times sqrt(scale) to a float format; qk={r.qk} is quantized with "
                "scales instead: use sscale=after")
    return None
