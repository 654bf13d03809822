"""Recipe keys ``dscale``, ``kmean`` and ``calib``: static (calibrated) scales and K means, as serving
engines fix them (``fa3_numerics.numerics.calibration`` says where each rule comes from).

- ``dscale``: ``amax`` (default: descales from the tensors of the call, as a caller of the FA3
  kernel computes them), ``unit`` (all 1.0), ``static`` (calibration amax / format max), ``calc``
  (calibration amax / vLLM's constants 200, 200, 100);
- ``kmean``: ``call`` (default: ``smooth=k`` takes the mean over the call's tokens) or ``static``
  (the calibration text's mean per kv-head and channel: deployable with an FP8 KV cache);
- ``calib``: ``none`` or ``<id>@<layer>``, the calibration and layer that ``static``/``calc``/
  ``kmean=static`` read (filled in per layer by ``fa3-numerics recommend``).

Emulator only: the descales are the kernel's inputs, but the backend registry lists backends per
key, and no kernel backend reads a calibration yet.
"""

from __future__ import annotations

from ..calibration import DSCALES
from ..families import family
from ..formats import get_format
from . import RecipeKey, register_check, register_key


def _calib(value) -> str:
    value = str(value).strip()
    cid, sep, layer = value.partition("@")
    if value != "none" and not (sep and cid and layer.isdigit()):
        from ...errors import UsageError

        raise UsageError(f"calib={value!r} must be none or ID@LAYER (set by `fa3-numerics recommend`)")
    return value


register_key(RecipeKey(
    "dscale", "amax", "descales of Q, K, V: amax (from the call's tensors), unit (1.0: vLLM/SGLang without "
    "checkpoint scales), static (calibration amax / format max), calc (calibration amax / 200, 200, 100: vLLM's "
    "calculate_kv_scales)", choices=DSCALES, stages=("qk", "v"), exact="amax", tensors=("q", "k", "v")))
register_key(RecipeKey(
    "kmean", "call", "mean smooth=k subtracts: call (over the call's tokens) or static (over the calibration text, "
    "per kv-head and channel: deployable with an FP8 KV cache)", choices=("call", "static"), stages=("qk",),
    exact="call", tensors=("k",)))
register_key(RecipeKey(
    "calib", "none", "calibration of dscale=static/calc and kmean=static: none or ID@LAYER (set by recommend)",
    normalize=_calib, stages=("qk", "v"), exact="none", tensors=("q", "k", "v")))


@register_check
def _static(r) -> str | None:
    if r.kmean == "static" and r.smooth != "k":
        return "kmean=static is a K mean for smooth=k; add smooth=k (smooth=qk keeps Q's block means per call)"
    if r.dscale != "amax":
        for name in (r.qk, r.v):
            if family(name) != "float" or not get_format(name).saturate:
                return (f"dscale={r.dscale} fixes the descales of FP8 operands; {name} is not an FP8 format "
                        "(use dscale=amax)")
    return None
