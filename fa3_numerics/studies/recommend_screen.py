"""Screening one layer: each candidate's attention error on the layer's recorded Q, K, V, and the
entries a calibrated recipe's fixed scales saturate.

Exposed: ``screen_layer``, ``saturation``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..numerics.calibration import static_for
from ..numerics.formats import get_format
from ..numerics.granularity import PerHead
from ..numerics.metrics import per_sample
from ..numerics.rotation import make_rotation
from ..numerics.smoothing import smooth_k


def screen_layer(backend, recipes, q, k, v, reference: torch.Tensor, *, scale: float, seed: int,
                 masking: dict | None = None) -> np.ndarray:
    """rel_l2 per (recipe, head) of every query row, causal, against the float64 ``reference``
    ([1, H, n, d]); one prepare cache per layer, so recipes that agree on V share it. ``masking``:
    the layer's window_size / softcap / sinks (``numerics/masking.py``), as the reference had them."""
    n = q.shape[2]
    idx = torch.arange(n, device=q.device)
    if masking:
        from ..errors import UsageError
        from ..numerics.masking import masking as make_masking

        why = backend.masking_refusal(make_masking(True, heads=q.shape[1], seqlen_q=n, seqlen_k=k.shape[2], **masking))
        if why is not None:
            raise UsageError(why)
    cache: dict = {}
    out = np.full((len(recipes), q.shape[1]), np.nan)
    for i, r in enumerate(recipes):
        o = backend.attention(r, q, k, v, causal=True, q_index=idx, rotation_seed=seed, cache=cache,
                              softmax_scale=scale, **(masking or {}))
        out[i] = per_sample(o, reference.to(o.device))["rel_l2"][0]
    return out


def saturation(recipe, q, k, v, *, seed: int) -> dict[str, np.ndarray]:
    """Per tensor ("q", "k", "v"), the count per head (Q: query heads; K, V: kv-heads) of entries
    that a recipe with fixed descales (``dscale`` not ``amax``) clamps to the format's max on these
    tensors, after its own pre-pass. Zeros for recipes whose descales come from the tensors."""
    h, hkv = q.shape[1], k.shape[1]
    zeros = {"q": np.zeros(h, dtype=np.int64), "k": np.zeros(hkv, dtype=np.int64), "v": np.zeros(hkv, dtype=np.int64)}
    if recipe.dscale == "amax":
        return zeros
    rot = make_rotation(recipe.rot, q.shape[-1], seed)
    group = h // hkv if isinstance(recipe.gran, PerHead) else 1
    st = static_for(recipe, rot, group=group, device=q.device, own=(q, k, v))
    rq, rk = rot.apply(q.to(torch.float64)), rot.apply(k.to(torch.float64))
    if recipe.smooth != "none":
        rk = rk - st.k_mean if st.k_mean is not None else smooth_k(rk)[0]
    out = {}
    for name, x, d, fmt in (("q", rq, st.q, recipe.qk), ("k", rk, st.k, recipe.qk), ("v", v.to(torch.float64), st.v,
                                                                                     recipe.v)):
        over = x.abs() > get_format(fmt).max * d.to(torch.float64)
        out[name] = over.sum(dim=(0, 2, 3)).cpu().numpy().astype(np.int64)
    return out


__all__ = ["screen_layer", "saturation"]
