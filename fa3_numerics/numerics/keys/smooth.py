"""Recipe key ``smooth``: SageAttention's smoothing of K (and Q) before quantization.

- ``none``: Q and K quantized as they are.
- ``k`` (SageAttention, arXiv 2410.02367, section 4.2 "smooth K"): K minus its mean over tokens,
  per (batch, kv-head, channel). Exact for softmax: every score of a query row moves by the
  same Q_i . mean(K). Removes a per-channel bias shared by every token (``--dist k-bias``) from
  K's scale.
- ``qk`` (SageAttention2, arXiv 2411.10958, section 3.2 "smooth Q"; kept in SageAttention3):
  additionally Q minus its mean over each query tile of ``bm`` rows, with the term
  mean(Q_block) (K - mean K)^T added back to S before the softmax scale, held in the
  precision ``sbias`` names. The public SageAttention2 kernels smooth K only; SageAttention3's
  ``preprocess_qkv`` smooths both (128-row groups = its kBlockM).

The means are taken in float64 on the inputs after the rotation (rotation and smoothing
commute: both are linear per row), so smoothing itself adds no rounding
(``fa3_numerics.numerics.smoothing``); with an input format (``in=fp16``) they are taken in that
format, as ``sageattn`` does (``numerics/sage_quant.py``). Backends: ``sage1`` (sageattn smooths
K itself; it refuses ``qk``, which needs the bias inside the kernel). The FA3 kernel could take
smoothed K, but the registry lists backends per key, not per value.
"""

from __future__ import annotations

from ..smoothing import SMOOTHINGS
from . import Factor, RecipeKey, register_factor, register_key

# k: one pass over K (its mean; SageAttention fuses the subtraction into the quantizer);
# qk: also Q's block means, the bias GEMM q_mean K^T and one bias tile loaded per KV tile.
_COST = {"none": 0, "k": 1, "qk": 3}

register_key(RecipeKey(
    "smooth", "none",
    "smoothing before quantization: none, k (K minus its token mean: SageAttention), qk (also Q minus its "
    "bm-row block mean, the q_mean K^T bias added back to S: SageAttention2/3)",
    choices=SMOOTHINGS, stages=("qk",), exact="none", tensors=("q", "k"), cost=lambda v: _COST[v],
    # sageattn smooths K itself (smooth_k=True); the sage1 backend refuses smooth=qk
    backends=("sage1", "sage2"),
))
register_factor(Factor("smooth", "none", "smoothing: none, k (K minus its token mean), qk (and Q minus its block "
                                         "mean, bias added back)"))
