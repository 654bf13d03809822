"""Statistics that explain a captured layer's FP8 error, computed from its float64 tensors.

Exposed: ``STAT_DEFINITIONS``, ``SINK_TOKENS``, ``tensor_stats``, ``attention_stats``, ``probe``.

``probe`` is the audit's engine probe (``fa3_numerics.engine.runner``): for one layer it returns
the float64 reference output of the evaluated rows (from the same pass as the attention
statistics, so the reference is computed once) and every statistic below, per head:

- per-channel amax of Q, K and V, the hottest channel and its RoPE partner (transformers'
  Llama ``apply_rotary_pos_emb`` uses ``rotate_half``: channel c rotates with c + d/2 mod d),
  hot/median channel amax;
- kurtosis and max/rms of Q, K, V; incoherence mu = max|x| sqrt(d) / ||x|| per token (QuaRot),
  mean and max over tokens, before and after the random Hadamard rotation the FP8 recipes use;
- attention-sink mass (weight on the first ``SINK_TOKENS`` tokens) and the fraction of FA3's
  offset-8 P~ that rounds to zero in e4m3, both from float64 probabilities;
- per-block amax of Q and K at the FP8 kernel's tiles (kBlockM rows of Q, kBlockN rows of K).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..numerics.reference import causal_mask, expand_kv
from ..numerics.rotation import make_rotation
from ..numerics.tiles import fa3_tiles

SINK_TOKENS = 4
# e4m3's smallest subnormal is 2^-9; round-to-nearest-even sends anything <= half of it to 0.
E4M3_HALF_MIN_SUBNORMAL = 2.0 ** -10
P_OFFSET = 8.0
# Elements of one float64 score chunk in the statistics pass.
_CHUNK_ELEMS = 1 << 22
LOG2E = math.log2(math.e)

STAT_DEFINITIONS = {
    "amax": "max over tokens of |x| per channel",
    "hot_channel": "channel with the largest amax in the head",
    "hot_pair": "RoPE partner of the hot channel: (c + d/2) mod d (rotate_half, transformers Llama)",
    "hot_ratio": "amax of the hot channel / median channel amax",
    "kurtosis": "Pearson kurtosis E[(x-mean)^4]/var^2 over all entries of the head (Gaussian: 3)",
    "max_over_rms": "max|x| / sqrt(mean x^2) over all entries of the head",
    "mu_mean": "incoherence mu = max|x| sqrt(d) / ||x|| per token (QuaRot), mean over tokens",
    "mu_max": "incoherence mu per token, max over tokens",
    "mu_rot_mean": "mu after the random Hadamard rotation (seed = rotation seed), mean over tokens",
    "mu_rot_max": "mu after the random Hadamard rotation, max over tokens",
    "block_amax": "amax per block of tokens at the FP8 kernel's tiles (kBlockM for Q, kBlockN for K)",
    "block_ratio": "max block amax / median block amax",
    "sink_mass": f"mean over evaluated queries of the float64 attention weight on the first {SINK_TOKENS} tokens",
    "p_underflow": ("fraction of the causally visible P~ = 2^((s - m) log2 e + 8) of the evaluated query rows "
                    "that rounds to 0 in e4m3 "
                    "(P~ <= 2^-10), m the kernel's running max: KV tiles of kBlockN visited last to first, "
                    "s the exact float64 scores"),
    "p_underflow_final": "as p_underflow, but against the final row max (a single-pass softmax)",
}


# --------------------------------------------------------------------------------------------

def tensor_stats(x: torch.Tensor, rotated: torch.Tensor | None, block_rows: int) -> dict[str, np.ndarray]:
    """x: (heads, seq, d) float64 (and x rotated, or None) -> per-head statistics (see STAT_DEFINITIONS)."""
    h, n, d = x.shape
    a = x.abs()
    amax = a.amax(dim=1)                                   # (h, d)
    hot = amax.argmax(dim=1)
    med = amax.median(dim=1).values
    flat = x.reshape(h, -1)
    mean = flat.mean(dim=1, keepdim=True)
    var = ((flat - mean) ** 2).mean(dim=1)
    kurt = ((flat - mean) ** 4).mean(dim=1) / var.clamp_min(1e-300) ** 2
    rms = flat.pow(2).mean(dim=1).sqrt()

    def mu(t):
        nrm = t.norm(dim=-1)
        m = t.abs().amax(dim=-1) * math.sqrt(d) / nrm.clamp_min(1e-300)
        m = torch.where(nrm > 0, m, torch.ones_like(m))
        return m.mean(dim=1), m.amax(dim=1)

    mu_mean, mu_max = mu(x)
    mu_rot_mean, mu_rot_max = mu(rotated) if rotated is not None else (mu_mean, mu_max)
    nblk = -(-n // block_rows)
    tok = a.amax(dim=2)
    pad = nblk * block_rows - n
    if pad:
        tok = torch.nn.functional.pad(tok, (0, pad))
    blk = tok.reshape(h, nblk, block_rows).amax(dim=2)     # (h, nblk)
    out = {
        "amax": amax, "hot_channel": hot, "hot_pair": (hot + d // 2) % d,
        "hot_ratio": amax.gather(1, hot[:, None])[:, 0] / med.clamp_min(1e-300),
        "kurtosis": kurt, "max_over_rms": a.amax(dim=(1, 2)) / rms.clamp_min(1e-300),
        "mu_mean": mu_mean, "mu_max": mu_max, "mu_rot_mean": mu_rot_mean, "mu_rot_max": mu_rot_max,
        "block_amax": blk, "block_ratio": blk.amax(dim=1) / blk.median(dim=1).values.clamp_min(1e-300),
    }
    return {k: v.detach().cpu().numpy() for k, v in out.items()}


def attention_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, scale: float, causal: bool,
                     q_index: torch.Tensor, block_n: int) -> dict:
    """Sink mass and P~ underflow per head from float64 scores. q: (1, H, n, d), k, v: (1, Hkv, n, d).

    With ``v`` the same pass also returns the float64 reference output of the rows ``q_index`` under
    "out" ([1, H, R, Dv]): softmax(QK^T scale) V computed as ``reference_attention`` computes it.
    """
    _, h, n, d = q.shape
    nk = k.shape[2]
    kk = expand_kv(k.to(torch.float64), h)[0]               # (H, nk, d)
    vv = expand_kv(v.to(torch.float64), h)[0] if v is not None else None
    qs = q.to(torch.float64)[0].index_select(1, q_index)    # (H, r, d)
    r = qs.shape[1]
    chunk = max(1, _CHUNK_ELEMS // max(1, h * nk))
    n_tiles = -(-nk // block_n)
    pad = n_tiles * block_n - nk
    sink = torch.zeros(h, dtype=torch.float64)
    under = torch.zeros(h, dtype=torch.float64)
    under_final = torch.zeros(h, dtype=torch.float64)
    visible = torch.zeros(h, dtype=torch.float64)
    out = torch.empty(h, r, vv.shape[-1], dtype=torch.float64) if vv is not None else None
    # P~ = 2^((s - m) log2 e + 8) <= 2^-10  <=>  s - m <= (log2(2^-10) - 8) / log2 e  (natural units)
    thresh = (math.log2(E4M3_HALF_MIN_SUBNORMAL) - P_OFFSET) / LOG2E
    for c0 in range(0, r, chunk):
        idx = q_index[c0:c0 + chunk]
        rc = idx.numel()
        s = torch.matmul(qs[:, c0:c0 + chunk], kk.transpose(-1, -2)) * scale   # (H, rc, nk)
        if causal:
            vis = causal_mask(idx, 0, nk, n, nk)
            s += torch.zeros(vis.shape, dtype=s.dtype).masked_fill_(~vis, -math.inf)  # cheaper than masked_fill
            n_vis = float(vis.sum()) * h
        else:
            n_vis = float(rc * nk * h)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        # Masked (and padding) entries are -inf and always pass "<= thresh": count all, subtract them.
        under_final += torch.count_nonzero(s <= m + thresh, dim=(1, 2)).to(torch.float64)
        p = torch.sub(s, m).exp_()
        den = p.sum(dim=-1)
        sink += (p[..., :SINK_TOKENS].sum(dim=-1) / den).sum(dim=-1)
        if out is not None:
            out[:, c0:c0 + rc] = torch.matmul(p, vv) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        del p
        # The kernel's running max when it reaches KV tile t (tiles visited last to first) is the
        # max over tiles t..last of the row.
        sp = torch.nn.functional.pad(s, (0, pad), value=-math.inf) if pad else s
        sp = sp.reshape(h, rc, n_tiles, block_n)
        tmax = sp.amax(dim=-1)
        run = torch.flip(torch.cummax(torch.flip(tmax, [-1]), dim=-1).values, [-1])
        run = torch.where(torch.isfinite(run), run, torch.zeros_like(run))
        under += torch.count_nonzero(sp <= (run + thresh)[..., None], dim=(1, 2, 3)).to(torch.float64)
        masked = h * rc * nk - n_vis
        under -= (masked + h * rc * pad) / h
        under_final -= masked / h
        visible += n_vis / h
    res = {"sink_mass": (sink / r).numpy(), "p_underflow": (under / visible).numpy(),
           "p_underflow_final": (under_final / visible).numpy()}
    if out is not None:
        res["out"] = out.unsqueeze(0)
    return res


def probe(task, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: torch.Tensor) -> dict:
    """The audit's statistics of one layer (``q`` (1, H, n, d), ``k``, ``v`` (1, Hkv, n, d)) and
    its float64 reference output under "reference" (on ``q``'s device)."""
    d = q.shape[-1]
    bm, bn = fa3_tiles(d, fp8=True)
    q3, k3, v3 = (t[0].to("cpu", torch.float64) for t in (q, k, v))
    att = attention_stats(q3[None], k3[None], v3[None], scale=task.softmax_scale, causal=task.causal,
                          q_index=q_index.cpu(), block_n=bn)
    ref = att.pop("out")
    out = dict(att)
    out["out_rms"] = ref[0].pow(2).mean(dim=(1, 2)).sqrt().numpy()
    rot = make_rotation("hadamard", d, task.seed)
    for name, t, rows in (("q", q3, bm), ("k", k3, bn), ("v", v3, bn)):
        rotated = rot.apply(t) if name != "v" else None
        for key, val in tensor_stats(t, rotated, rows).items():
            if name == "v" and key.startswith("mu_rot"):
                continue
            out[f"{name}_{key}"] = val
    out["reference"] = ref.to(q.device)
    return out


__all__ = ["STAT_DEFINITIONS", "SINK_TOKENS", "tensor_stats", "attention_stats", "probe"]
