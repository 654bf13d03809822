"""The statistics ``recommend``'s diagnosis reads, one value per layer from its Q, K, V.

Exposed: ``STATS``, ``layer_stats``.

Each is the worst head's value, from float64 tensors (``audit_stats`` computes the parts):

- ``k_mean_ratio``: max over kv-heads and channels of |mean over tokens of K| / the RMS of K minus
  that mean (a K mean shared by every token, in units of K's own spread: 0 for zero-mean K);
- ``incoherence_gain``: max over Q and K heads of mu_max before / after the random Hadamard
  rotation (mu = max|x| sqrt(d) / ||x|| per token, QuaRot): how much the rotation spreads the
  outliers of the worst token;
- ``sink_or_underflow``: max over heads of max(sink mass / 0.3, P~ underflow fraction / 0.5): the
  attention weight on the first tokens, and the offset-8 P~ that rounds to 0 in e4m3;
- ``v_hot_ratio``: max over kv-heads of V's largest channel RMS / its median channel RMS (RMS, not
  amax: a whole channel far above the others, which a per-channel scale fixes, and not one
  outlier entry, which raises a channel's amax alone).
"""

from __future__ import annotations

import torch

from ..numerics.rotation import make_rotation
from ..numerics.tiles import fa3_tiles
from .audit_stats import attention_stats, tensor_stats

STATS = {
    "k_mean_ratio": "max over kv-heads and channels of |token mean of K| / RMS of (K - mean)",
    "incoherence_gain": "max over Q and K heads of the worst token's incoherence mu before / after the Hadamard "
                        "rotation",
    "sink_or_underflow": "max over heads of max(sink mass / 0.3, fraction of offset-8 P~ that is 0 in e4m3 / 0.5)",
    "v_hot_ratio": "max over kv-heads of V's largest channel RMS / median channel RMS",
    "sink_mass": "max over heads of the float64 attention weight on the first 4 tokens (mean over queries)",
    "p_underflow": "max over heads of the fraction of visible offset-8 P~ that rounds to 0 in e4m3",
}


def layer_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
                seed: int = 0, rows: torch.Tensor | None = None) -> dict[str, float]:
    """``STATS`` of one layer: q [1, H, n, d], k and v [1, Hkv, n, d] (any float dtype)."""
    q3, k3, v3 = (t[0].to("cpu", torch.float64) for t in (q, k, v))
    d, n = q3.shape[-1], q3.shape[1]
    bm, bn = fa3_tiles(d, fp8=True)
    rot = make_rotation("hadamard", d, seed)
    mean = k3.mean(dim=1, keepdim=True)
    spread = (k3 - mean).pow(2).mean(dim=(1, 2)).sqrt().clamp_min(1e-300)     # (Hkv,)
    k_mean_ratio = float((mean[:, 0].abs() / spread[:, None]).max())
    gain = 0.0
    for t, rows_ in ((q3, bm), (k3, bn)):
        s = tensor_stats(t, rot.apply(t), rows_)
        gain = max(gain, float((s["mu_max"] / s["mu_rot_max"]).max()))
    crms = v3.pow(2).mean(dim=1).sqrt()                                          # (Hkv, d)
    v_hot = float((crms.amax(dim=1) / crms.median(dim=1).values.clamp_min(1e-300)).max())
    idx = torch.arange(n) if rows is None else rows
    att = attention_stats(q3[None], k3[None], None, scale=scale, causal=causal, q_index=idx, block_n=bn)
    sink, under = float(att["sink_mass"].max()), float(att["p_underflow"].max())
    return {"k_mean_ratio": k_mean_ratio, "incoherence_gain": gain,
            "sink_or_underflow": max(sink / 0.3, under / 0.5), "v_hot_ratio": v_hot,
            "sink_mass": sink, "p_underflow": under}


__all__ = ["STATS", "layer_stats"]
