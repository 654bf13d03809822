"""Models of the P.V accumulator of the flash algorithm.

Exposed: ``ACCUMULATORS``, ``register_accumulator``, ``get_accumulator``, ``truncate_mantissa``.

An accumulator is ``fn(acc, rescale, p, v) -> acc``: ``acc`` [.., R, Dv] float32 holds the
running output, ``rescale`` [.., R, 1] is the online-softmax correction for this KV tile,
``p`` [.., R, bn] and ``v`` [.., bn, Dv] are the tile's P (already cast) and V, as float32.

- ``fp32``: acc * rescale + P V with an FP32 sum (an ideal tensor core).
- ``fp22``: Hopper FP8 tensor cores are reported to keep about 13 mantissa bits while they
  accumulate (SageAttention2, arXiv 2411.10958; DeepSeek-V3 "around 14 bits"). Modelled as:
  the running accumulator is truncated to 13 mantissa bits after every k-step of 32 keys
  (the K of one FP8 wgmma), the products of a step being summed exactly first.
- ``two-level``: FP22 inside a KV tile starting from zero, then added into an FP32
  accumulator across tiles (the fix proposed upstream and in vLLM's fork).
"""

from __future__ import annotations

from typing import Callable

import torch

Accumulator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

K_STEP = 32  # keys per FP8 wgmma instruction (m64nNk32)
FP22_MANTISSA = 13

_REGISTRY: dict[str, tuple[Accumulator, str]] = {}


def register_accumulator(name: str, description: str):
    def deco(fn: Accumulator) -> Accumulator:
        _REGISTRY[name] = (fn, description)
        return fn

    return deco


def get_accumulator(name: str) -> Accumulator:
    from .errors import UsageError

    if name not in _REGISTRY:
        raise UsageError(f"unknown accumulator {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return _REGISTRY[name][0]


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Drop all but ``bits`` mantissa bits of float32 ``x`` (round toward zero)."""
    drop = 23 - bits
    if drop <= 0:
        return x
    mask = ~((1 << drop) - 1)
    return (x.contiguous().view(torch.int32) & mask).view(torch.float32)


def _steps(p: torch.Tensor, v: torch.Tensor):
    n = p.shape[-1]
    for s in range(0, n, K_STEP):
        yield torch.matmul(p[..., s:s + K_STEP].double(), v[..., s:s + K_STEP, :].double())


@register_accumulator("fp32", "FP32 accumulation (ideal tensor core)")
def fp32(acc, rescale, p, v):
    return acc * rescale + torch.matmul(p, v)


@register_accumulator("fp22", "13-bit-mantissa accumulator, truncated per 32-key k-step, chained across tiles")
def fp22(acc, rescale, p, v):
    acc = acc * rescale
    for part in _steps(p, v):
        acc = truncate_mantissa((acc.double() + part).float(), FP22_MANTISSA)
    return acc


@register_accumulator("two-level", "FP22 within a KV tile, FP32 across tiles")
def two_level(acc, rescale, p, v):
    tile = torch.zeros_like(acc)
    for part in _steps(p, v):
        tile = truncate_mantissa((tile.double() + part).float(), FP22_MANTISSA)
    return acc * rescale + tile


ACCUMULATORS = {name: desc for name, (_, desc) in _REGISTRY.items()}
