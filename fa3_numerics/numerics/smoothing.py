"""Smoothing of Q and K before quantization (SageAttention's "smooth K" and "smooth Q").

Exposed: ``SMOOTHINGS``, ``smooth_k``, ``smooth_q``, ``qk_smoothing_bias``, ``bias_rows``.

- ``k`` (SageAttention, arXiv 2410.02367, "smooth K"): K minus its mean over tokens, per
  (batch, kv-head, channel): K' = K - 1 mu^T with mu = mean_j K_j. Then
  Q K'^T = Q K^T - (Q mu) 1^T: every score of a query row moves by the same Q_i . mu, and
  softmax is invariant to a per-row shift, so the attention output is unchanged in exact
  arithmetic. This holds under a causal mask (the shift is the same for every visible key
  of a row) and under grouped-query attention (every query head of a group sees the same K
  and mu). What smoothing changes is the quantization: a channel mean shared by all tokens
  (the failure SageAttention's K smoothing was made for) no longer sets K's amax.
  thu-ml/SageAttention ``sageattention/core.py``: ``km = k.mean(dim=seq_dim, keepdim=True)``,
  subtracted inside the quantizer (``quant_per_block_int8_fuse_sub_mean_cuda``); only the
  returned log-sum-exp is corrected (``lse + q . km * sm_scale``).
- ``qk`` (SageAttention2, arXiv 2411.10958, "smooth Q"; kept in SageAttention3): K is
  smoothed as above, and Q minus its mean over each block of ``block`` query tokens:
  Q' = Q - q_b (q_b the mean of the block holding the row). Now
  Q K'^T = Q' K'^T + q_b K'^T: the second term, ``delta_s`` = q_b K'^T [B, H, n_blocks, N_k],
  differs per key, so it must be added back to S: it is a bias per (query block, key),
  computed in higher precision than the quantized GEMM. The public SageAttention2 kernels
  (``sageattention/core.py``) smooth only K; SageAttention3 smooths both
  (``sageattention3_blackwell/sageattn3/api.py`` ``preprocess_qkv``: ``triton_group_mean``
  with GROUP_SIZE 128 = the kernel's kBlockM, ``delta_s = matmul(qm, k^T)`` taken in the
  input dtype (BF16/FP16) and then converted to float32, and loaded as the initial value
  of the S accumulator before the FP4 MMA, ``mainloop_tma_ws.h`` ``add_delta_s``).
  ``qk_smoothing_bias`` computes delta_s in float64 and rounds it once to ``fmt``: float32
  by default, ``bf16``/``fp16`` to model SageAttention3's input-dtype matmul.

Means and differences are taken in float64 on the float64 inputs, so smoothing itself adds
no rounding; SageAttention computes the means in the input dtype and subtracts in float32,
an input-precision effect not modelled here.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .formats import get_format, round_to_format

SMOOTHINGS = ("none", "k", "qk")


def smooth_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, Hkv, N, D] -> (K - mu, mu [B, Hkv, 1, D]), mu the mean over tokens, in float64."""
    k64 = k.to(torch.float64)
    mu = k64.mean(dim=2, keepdim=True)
    return k64 - mu, mu


def smooth_q(q: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, N, D] -> (Q - q_b, q_mean [B, H, ceil(N / block), D]), q_b the mean of the
    ``block``-token run holding each row (the last run may be short and averages only its
    own rows), in float64."""
    if block <= 0:
        raise UsageError(f"Q smoothing block must be positive, got {block}")
    q64 = q.to(torch.float64)
    b, h, n, d = q64.shape
    nb = -(-n // block)
    pad = nb * block - n
    padded = torch.nn.functional.pad(q64, (0, 0, 0, pad)) if pad else q64
    sums = padded.reshape(b, h, nb, block, d).sum(dim=3)
    counts = torch.full((nb,), float(block), dtype=torch.float64, device=q.device)
    counts[-1] = n - (nb - 1) * block
    mean = sums / counts[:, None]
    return q64 - mean.repeat_interleave(block, dim=2)[:, :, :n], mean


def qk_smoothing_bias(q_mean: torch.Tensor, k_smoothed: torch.Tensor, fmt: str = "fp32") -> torch.Tensor:
    """delta_s = q_mean (K - mu)^T: [B, H, n_blocks, D] x [B, Hkv, N_k, D] -> [B, H, n_blocks, N_k].

    The bias to add to S = Q' K'^T for the rows of each query block (before the softmax
    scale, like S). Computed in float64 and rounded once to ``fmt``; K/V heads are repeated
    for grouped-query attention."""
    h, hkv = q_mean.shape[1], k_smoothed.shape[1]
    if h % hkv:
        raise UsageError(f"query heads ({h}) must be a multiple of K heads ({hkv})")
    k64 = k_smoothed.to(torch.float64)
    if hkv != h:
        k64 = k64.repeat_interleave(h // hkv, dim=1)
    ds = torch.matmul(q_mean.to(torch.float64), k64.transpose(-1, -2))
    return round_to_format(ds, get_format(fmt)) if get_format(fmt).name != "fp64" else ds


def bias_rows(delta_s: torch.Tensor, q_index: torch.Tensor, block: int) -> torch.Tensor:
    """delta_s [B, H, n_blocks, N_k] -> [B, H, R, N_k], the bias of the query rows ``q_index``
    (the emulator evaluates a sample of rows)."""
    return delta_s.index_select(2, torch.div(q_index, block, rounding_mode="floor"))
