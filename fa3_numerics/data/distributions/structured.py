"""Structured synthetic families: the outlier shapes real models show, one knob each.

Exposed (registry names): ``channel-outliers``, ``sink-tokens``, ``student-t``, ``k-bias``.

- ``channel-outliers``: every entry N(0,1), and in each (batch, kv-head) a few fixed
  channels of K multiplied by ``scale`` for every token (the per-channel outliers of
  post-RoPE keys, QuaRot/SmoothQuant); the same channels of Q are multiplied by
  ``q_scale`` (1 = Q plain). The channels are drawn per head from the seed; a query head
  uses the channels of its K/V head under GQA.
- ``sink-tokens``: every entry N(0,1), and the first ``sinks`` tokens' K multiplied by
  ``scale`` (attention sinks: a few early tokens with large keys draw much of the
  attention). Q and V stay plain.
- ``student-t``: every entry of Q, K and V Student-t with ``df`` degrees of freedom (unit
  scale, variance df/(df-2) for df > 2): heavy tails without structure. Drawn by inverse
  CDF (scipy's ``stdtrit``) from seeded uniforms, so any df > 0 is exact and seeded.
- ``k-bias``: every entry N(0,1), and in each (batch, kv-head) a few fixed channels of K
  get a constant offset ``+-bias`` shared by every token (sign drawn per channel): a
  per-channel mean of K, the failure SageAttention's K smoothing removes exactly
  (``channel-outliers`` scales a channel instead, which smoothing cannot remove). Q and V
  stay plain. Default (2 channels, bias 8) from the SmolLM2-135M K cache: over its 30
  layers x 3 KV heads (``capture --tokens 1024``, pydoc prose, the first 4 tokens left
  out), the largest |channel mean| is a median 7.6 times the typical per-channel standard
  deviation (2nd largest 3.1, 4th 2.0), and the channel means carry 0.27-0.75 (median
  0.60) of K's energy; two channels at 8 in unit-variance noise carry 2/3. Real K also
  varies in scale per channel and has RoPE pairs; this family isolates the mean.

All draw from one ``torch.Generator`` per seed, in float64 on the CPU, in a fixed order
(Q, K, V, then any structure), so (family, params, seed) gives the same tensors anywhere.
"""

from __future__ import annotations

import math

import torch

from . import AttnShape, generator, register
from ...numerics.native import randn
from ...errors import require


def _positive(name: str, value: float, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if integer:
        ok = ok and float(value).is_integer()
    kind = "integer" if integer else "number"
    require(ok, f"--{name} must be a finite {kind} {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_channels(params: dict) -> None:
    _positive("channels", params["channels"], integer=True, allow_zero=True)
    _positive("scale", params["scale"])
    _positive("q_scale", params["q_scale"])


def _check_sinks(params: dict) -> None:
    _positive("sinks", params["sinks"], integer=True, allow_zero=True)
    _positive("scale", params["scale"])


def _check_t(params: dict) -> None:
    _positive("df", params["df"])


def outlier_channels(batch: int, kv_heads: int, head_dim: int, channels: int, g: torch.Generator) -> torch.Tensor:
    """Boolean [B, Hkv, 1, D]: the outlier channels of each (batch, kv-head)."""
    require(channels <= head_dim, f"--channels ({channels}) must not exceed the head dim ({head_dim})")
    keys = torch.rand((batch, kv_heads, head_dim), generator=g, dtype=torch.float64)
    pick = keys.argsort(dim=-1)[..., :channels]
    mask = torch.zeros((batch, kv_heads, head_dim), dtype=torch.bool)
    mask.scatter_(-1, pick, True)
    return mask[:, :, None, :]


@register(
    "channel-outliers",
    description="N(0,1) with a few fixed channels of K (and optionally Q) scaled up in every token",
    params={"channels": (4, "outlier channels per head"),
            "scale": (10.0, "multiplier of K's outlier channels"),
            "q_scale": (1.0, "multiplier of the same channels of Q (1 = Q plain)")},
    validate=_check_channels,
)
def channel_outliers(shape: AttnShape, seed: int, *, channels: float, scale: float, q_scale: float):
    g = generator(seed)
    q = randn(shape.q_shape, g)
    k = randn(shape.kv_shape, g)
    v = randn(shape.kv_shape, g)
    mask = outlier_channels(shape.batch, shape.kv_heads, shape.head_dim, int(channels), g)
    k = torch.where(mask, k * scale, k)
    qmask = mask.repeat_interleave(shape.heads // shape.kv_heads, dim=1)
    q = torch.where(qmask, q * q_scale, q)
    return q, k, v


@register(
    "sink-tokens",
    description="N(0,1) with the first few tokens' K scaled up (attention sinks)",
    params={"sinks": (4, "number of sink tokens at the start of the sequence"),
            "scale": (10.0, "multiplier of the sink tokens' K")},
    validate=_check_sinks,
)
def sink_tokens(shape: AttnShape, seed: int, *, sinks: float, scale: float):
    g = generator(seed)
    q = randn(shape.q_shape, g)
    k = randn(shape.kv_shape, g)
    v = randn(shape.kv_shape, g)
    n = min(int(sinks), shape.seqlen_k)
    k[:, :, :n] *= scale
    return q, k, v


def student_t_like(shape: tuple[int, ...], g: torch.Generator, df: float) -> torch.Tensor:
    from scipy.special import stdtrit

    tiny = 2.0 ** -60
    u = torch.rand(shape, generator=g, dtype=torch.float64).clamp_(tiny, 1 - tiny)
    return torch.from_numpy(stdtrit(float(df), u.numpy()))


@register(
    "student-t",
    description="every entry of Q, K and V Student-t with df degrees of freedom (heavy tails)",
    params={"df": (3.0, "degrees of freedom (smaller = heavier tails; large = Gaussian)")},
    validate=_check_t,
)
def student_t(shape: AttnShape, seed: int, *, df: float):
    g = generator(seed)
    q = student_t_like(shape.q_shape, g, df)
    k = student_t_like(shape.kv_shape, g, df)
    v = student_t_like(shape.kv_shape, g, df)
    return q, k, v


def _check_bias(params: dict) -> None:
    _positive("channels", params["channels"], integer=True, allow_zero=True)
    require(math.isfinite(params["bias"]), f"--bias must be a finite number, got {params['bias']}")


@register(
    "k-bias",
    description="N(0,1) with a constant offset (a mean shared by every token) on a few channels of K",
    params={"channels": (2, "biased channels of K per head"),
            "bias": (8.0, "offset added to those channels in every token (sign drawn per channel); "
                          "0 = plain; SmolLM2-135M's largest K channel mean is ~8 std")},
    validate=_check_bias,
)
def k_bias(shape: AttnShape, seed: int, *, channels: float, bias: float):
    g = generator(seed)
    q = randn(shape.q_shape, g)
    k = randn(shape.kv_shape, g)
    v = randn(shape.kv_shape, g)
    mask = outlier_channels(shape.batch, shape.kv_heads, shape.head_dim, int(channels), g)
    sign = torch.where(torch.rand(mask.shape, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    k = k + torch.where(mask, sign * float(bias), torch.zeros((), dtype=torch.float64))
    return q, k, v
