"""Models of the P.V accumulator of the flash algorithm.

Exposed: ``ACCUMULATORS``, ``register_accumulator``, ``get_accumulator``, ``hopper_mma_on``.

An accumulator is ``fn(acc, rescale, p, v, fmts) -> acc``: ``acc`` [.., R, Dv] float32 holds
the running output, ``rescale`` [.., R, 1] is the online-softmax correction for this KV tile,
``p`` [.., R, bn] and ``v`` [.., bn, Dv] are the tile's P (already cast) and V as float32,
``fmts`` the (P, V) formats.

- ``fp32``: acc * rescale + P V with a float32 sum (an ideal tensor core).
- ``fp22``: Hopper's FP8 tensor core as fitted to the FA3 kernel (``fa3_numerics.numerics.mma``): the
  O registers are the MMA accumulator, rescaled in float32 and then chained through every
  k-step of 32 keys of every tile with 13-bit aligned, truncating accumulation. With this
  model the S = Q K^T product is modelled the same way (see the emulator).
- ``two-level``: the same MMA model inside a KV tile from a zero accumulator, then added into
  a float32 accumulator across tiles (the fix proposed upstream and in vLLM's fork).

The MMA model applies only to FP8 operands; with wider P or V it falls back to float32.
"""

from __future__ import annotations

from typing import Callable

import torch

from .formats import Format
from .mma import hopper_fp8_mma

Accumulator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple], torch.Tensor]

_REGISTRY: dict[str, tuple[Accumulator, str]] = {}


def register_accumulator(name: str, description: str):
    def deco(fn: Accumulator) -> Accumulator:
        _REGISTRY[name] = (fn, description)
        return fn

    return deco


def get_accumulator(name: str) -> Accumulator:
    from ..errors import UsageError

    if name not in _REGISTRY:
        raise UsageError(f"unknown accumulator {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return _REGISTRY[name][0]


def hopper_mma_on(acc: str, *fmts: Format) -> bool:
    """True when the Hopper FP8 MMA model applies: an MMA-modelling accumulator and FP8 operands."""
    return acc in ("fp22", "two-level") and all(f.saturate and f.mbits <= 3 for f in fmts)


def _mma(p, v, c, fmts):
    return hopper_fp8_mma(p, v, c, a_min_exp=fmts[0].emin, b_min_exp=fmts[1].emin)


@register_accumulator("fp32", "float32 accumulation (an ideal tensor core)")
def fp32(acc, rescale, p, v, fmts):
    return acc * rescale + torch.matmul(p, v)


@register_accumulator("fp22", "Hopper FP8 MMA model: 13-bit aligned truncating accumulation per 32-key k-step, "
                              "chained across tiles (matches the FA3 kernel)")
def fp22(acc, rescale, p, v, fmts):
    if not hopper_mma_on("fp22", *fmts):
        return fp32(acc, rescale, p, v, fmts)
    return _mma(p, v, acc * rescale, fmts)


@register_accumulator("two-level", "Hopper FP8 MMA model within a KV tile, float32 across tiles")
def two_level(acc, rescale, p, v, fmts):
    if not hopper_mma_on("two-level", *fmts):
        return fp32(acc, rescale, p, v, fmts)
    return acc * rescale + _mma(p, v, None, fmts)


ACCUMULATORS = {name: desc for name, (_, desc) in _REGISTRY.items()}
