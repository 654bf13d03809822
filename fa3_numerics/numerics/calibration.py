"""Static scales and K means: what a deployment fixes on calibration text before it meets other text.

Exposed: ``DSCALES``, ``VLLM_SCALE_CONSTANTS``, ``Calibration``, ``register``, ``lookup``,
``static_for``, ``StaticInputs``.

A kernel called with dynamic descales (``dscale=amax``, the default) computes them from the very
tensors it quantizes, so nothing saturates. A serving engine writing an FP8 KV cache cannot: it
fixes q/k/v scales once, and the text it serves later may exceed them. The rules of ``dscale``:

- ``unit``: every descale 1.0 (vLLM's and SGLang's default when the checkpoint has no scales);
- ``static``: amax over the calibration text / the format's max, per tensor or per (kv-)head at
  ``gran`` (llm-compressor's and TensorRT-LLM ModelOpt's calibrated scales);
- ``calc``: amax over the calibration text / a fixed constant per tensor, Q 200, K 200, V 100
  (vLLM's ``calculate_kv_scales``: ``calc_kv_scales`` divides the first batch's amax by
  ``Q_SCALE_CONSTANT``, ``K_SCALE_CONSTANT``, ``V_SCALE_CONSTANT``; vllm-project/vllm
  vllm/envs.py and vllm/attention/layer.py).

``kmean=static`` subtracts a K mean per (kv-head, channel) taken over the calibration text
instead of over the call's own tokens: the form of K smoothing a decode step writing an FP8 KV
cache can deploy, since it cannot know the mean of tokens not yet generated.

A ``Calibration`` holds the float64 Q, K, V of each calibrated layer, recorded on the
calibration text, registered in this process under a hash of its contents; a recipe names one
layer of it as ``calib=<id>@<layer>``; ``calib=none`` calibrates on the call's own tensors
(optimistic: nothing saturates; what ``impact``'s static decode modes assume too). The static
descales are computed from those tensors after the recipe's own pre-pass (rotation, K smoothing)
at the recipe's granularity, so a rotated or smoothed recipe is calibrated on what its kernel sees.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from ..errors import UsageError, require
from .formats import get_format
from .granularity import PerHead, PerTensor, amax
from .quant import amax_to_scale

DSCALES = ("amax", "unit", "static", "calc")
# vllm-project/vllm vllm/envs.py: Q_SCALE_CONSTANT 200, K_SCALE_CONSTANT 200, V_SCALE_CONSTANT 100.
VLLM_SCALE_CONSTANTS = {"q": 200.0, "k": 200.0, "v": 100.0}

_REGISTRY: dict[str, "Calibration"] = {}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Q, K, V per layer (float64 [1, H, n, d] and [1, Hkv, n, d]) of the calibration text."""

    layers: dict
    source: str = ""

    def digest(self) -> str:
        h = hashlib.sha256()
        for layer in sorted(self.layers):
            h.update(str(layer).encode())
            for t in self.layers[layer]:
                h.update(t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def register(cal: Calibration) -> str:
    """Keep ``cal`` for this process and return its id (a hash of its tensors)."""
    cid = cal.digest()
    _REGISTRY[cid] = cal
    return cid


def spec(cid: str, layer: int) -> str:
    """The ``calib`` value naming layer ``layer`` of calibration ``cid``."""
    return f"{cid}@{int(layer)}"


def lookup(value: str) -> tuple[Calibration, int]:
    cid, _, layer = value.partition("@")
    require(cid in _REGISTRY, f"calibration {cid!r} is not known in this process; static scales are "
            "calibrated by `fa3-numerics recommend` (--calib-text)")
    cal = _REGISTRY[cid]
    require(layer.isdigit() and int(layer) in cal.layers, f"calibration {cid} has no layer {layer!r}")
    return cal, int(layer)


def uses_calibration(recipe) -> bool:
    return recipe.dscale in ("static", "calc") or recipe.kmean == "static"


@dataclasses.dataclass
class StaticInputs:
    """What a calibrated recipe fixes for one layer: descales per tensor (shaped as ``amax`` at the
    recipe's granularity, None = dynamic) and the static K mean ([1, Hkv, 1, d], in the rotated
    basis, or None)."""

    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    k_mean: torch.Tensor | None


def static_for(recipe, rot, *, group: int, device, own=None) -> StaticInputs | None:
    """The static descales and K mean of ``recipe`` (None when it fixes nothing). ``rot`` is the
    recipe's rotation; ``group`` query heads share Q's per-head descale (the kernel's shape).

    With ``calib=none`` the calibration text is the call's own (q, k, v) ``own``: the optimistic
    calibration (no entry saturates) that lets a calibrated preset run anywhere; ``recommend``
    always names a calibration of other text."""
    if recipe.dscale == "amax" and recipe.kmean != "static":
        return None
    cal_q = cal_k = cal_v = None
    if uses_calibration(recipe):
        if recipe.calib == "none":
            require(own is not None, f"recipe {recipe.short_str()} needs calibrated scales or a calibrated K mean "
                    "(calib=ID@LAYER); `fa3-numerics recommend` calibrates them on --calib-text")
            cal_q, cal_k, cal_v = (t.to(device, torch.float64) for t in own)
        else:
            cal, layer = lookup(recipe.calib)
            cal_q, cal_k, cal_v = (t.to(device, torch.float64) for t in cal.layers[layer])
    k_mean = None
    if cal_k is not None:
        rk = rot.apply(cal_k)
        if recipe.kmean == "static" or recipe.smooth == "k":
            # the calibration text's own mean: for smooth=k the mean the call takes, on that text
            k_mean = rk.mean(dim=2, keepdim=True)
            rk = rk - k_mean
        if recipe.kmean != "static":
            k_mean = None
    if recipe.dscale == "amax":
        return StaticInputs(None, None, None, k_mean)
    gran = recipe.gran
    if not isinstance(gran, (PerTensor, PerHead)):
        raise UsageError(f"dscale={recipe.dscale} fixes one descale per tensor or per head; set gran=tensor or "
                         f"gran=head (got gran={gran.short_str()})")
    out = {}
    for name, fmt_name in (("q", recipe.qk), ("k", recipe.qk), ("v", recipe.v)):
        f = get_format(fmt_name)
        if recipe.dscale == "unit":
            out[name] = torch.ones((1, 1, 1, 1), dtype=torch.float32, device=device)
            continue
        x = {"q": lambda: rot.apply(cal_q), "k": lambda: rk, "v": lambda: cal_v}[name]()
        a = amax(x, gran, group=group if name == "q" else 1)
        if recipe.dscale == "calc":
            a = a * (f.max / VLLM_SCALE_CONSTANTS[name])  # descale = amax / constant
        out[name] = amax_to_scale(a, f, pow2=recipe.pow2)
    return StaticInputs(out["q"], out["k"], out["v"], k_mean)


__all__ = ["DSCALES", "VLLM_SCALE_CONSTANTS", "Calibration", "register", "spec", "lookup", "uses_calibration",
           "static_for", "StaticInputs"]
