"""Needle in a haystack: one key far back that the measured queries retrieve with a chosen weight.

Exposed: ``Needle``, ``plant``, ``PARAMS``, ``needle_position``, ``validate_params``.

Q holds only the query rows that are measured: the last ``seqlen`` rows of a causal prefill over
``seqlen_k`` keys (bottom-right aligned, as FA3 aligns ``seqlen_q < seqlen_k``), or one row for
decode. Every row is independent given K and V, so these rows compute exactly what they compute
in the full prefill, at a fraction of the memory (128K keys x 128 dims x 2 heads is 268 MB per
float64 tensor; a full Q would double it for rows nobody reads).

For every (batch, head) and every measured row, in float64:

- distractor keys K_i ~ N(0, I); query rows of norm ``spread`` sqrt(d), correlated with one
  another (``qcorr``: neighbouring queries ask about the same thing), so a distractor's logit
  scale q.k_i is about N(0, spread^2);
- planted keys: the needle at ``depth`` of the visible context (0 = the oldest key, 1 = the
  newest one every measured row sees), ``decoys`` decoy keys at random positions, and with
  ``sink`` > 0 an attention sink at position 0. Each gets the logit that gives it exactly its
  softmax mass in every measured row: the needle ``weight``, each decoy ``decoy_ratio`` x
  ``weight``, the sink ``sink`` (solved per row against that row's visible distractors, and
  realised by a minimum-norm key in the span of the query rows plus a random part orthogonal to
  them, so the key looks like a key and its dot products are exact);
- V rows: a shared mean of norm ``vmean`` sqrt(d) (real models' values have one) plus N(0, I)
  noise; each planted key's V row is the mean plus sqrt(d) times its own unit direction (the
  needle's ``u``, the decoys' ``u_k``; orthonormal with the mean's direction), and every other row
  has its components along those directions removed. So in exact arithmetic the output's
  projection on ``u`` is exactly weight x sqrt(d): retrieval can be read off the output
  (``numerics/metrics/retrieval.py``). The sink's V row is ``sink_v`` times a noise row (sinks
  carry little value).

Deterministic from the seed on each kind of device (``distributions.generate``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import AttnShape, generator, register
from ...errors import require

PARAMS = {
    "depth": (0.5, "where the needle sits in the visible context: 0 = the oldest key, 1 = the newest"),
    "weight": (0.1, "the needle's softmax mass in every measured query row (exact, float64)"),
    "spread": (1.5, "standard deviation of the distractors' logits (softmax-scaled)"),
    "decoys": (3.0, "number of decoy keys, each with its own V direction"),
    "decoy_ratio": (0.5, "each decoy's softmax mass as a fraction of the needle's"),
    "sink": (0.0, "softmax mass of an attention sink at position 0 (0 = none)"),
    "sink_v": (0.25, "norm of the sink's V row relative to a distractor's"),
    "vmean": (0.5, "norm of the V rows' shared mean relative to their noise"),
    "qcorr": (0.9, "correlation between the measured query rows"),
}


@dataclasses.dataclass
class Needle:
    """The tensors and what was planted in them (shared by every (batch, head) unless noted)."""

    q: torch.Tensor  # [B, H, R, d] float64, the measured rows
    k: torch.Tensor  # [B, H, N, d]
    v: torch.Tensor  # [B, H, N, d]
    needle: int  # the needle's key index
    decoys: list[int]
    sink: int | None
    u: torch.Tensor  # [B, H, d] the needle's V direction (unit)
    decoy_u: torch.Tensor  # [B, H, D, d] the decoys' V directions (unit)
    weight: float  # the needle's exact softmax mass
    decoy_weight: float
    sink_weight: float
    v_norm: float  # the planted V rows' norm along their direction: sqrt(d)


def validate_params(p: dict) -> None:
    require(0.0 <= p["depth"] <= 1.0, f"--depth {p['depth']:g} must lie in [0, 1] (0 = oldest key, 1 = newest)")
    require(0.0 < p["weight"] < 1.0, f"--weight {p['weight']:g} must lie in (0, 1): a softmax mass")
    require(p["spread"] > 0 and math.isfinite(p["spread"]), f"--spread {p['spread']:g} must be a positive number")
    require(p["decoys"] >= 0 and float(p["decoys"]).is_integer(), f"--decoys {p['decoys']:g} must be a whole number")
    require(p["decoy_ratio"] >= 0, f"--decoy-ratio {p['decoy_ratio']:g} must be >= 0")
    require(0.0 <= p["sink"] < 1.0, f"--sink {p['sink']:g} must lie in [0, 1)")
    require(p["sink_v"] >= 0 and p["vmean"] >= 0, "--sink-v and --vmean must be >= 0")
    require(0.0 <= p["qcorr"] < 1.0, f"--qcorr {p['qcorr']:g} must lie in [0, 1)")
    total = p["weight"] * (1 + p["decoys"] * p["decoy_ratio"]) + p["sink"]
    require(total < 0.999, f"needle, decoys and sink take {total:g} of the softmax mass; lower --weight, --decoys, "
                           "--decoy-ratio or --sink so that the distractors keep some")


def needle_position(seqlen_k: int, rows: int, depth: float) -> int:
    """The needle's key index: ``depth`` of the way through the keys every measured row sees
    (0 .. seqlen_k - rows), kept off position 0 (the sink's)."""
    last = seqlen_k - rows
    return int(min(max(round(depth * last), 1), last))


def plant(shape: AttnShape, seed: int, *, depth: float, weight: float, spread: float, decoys: float,
          decoy_ratio: float, sink: float, sink_v: float, vmean: float, qcorr: float,
          device: str = "cpu") -> Needle:
    """Draw the needle problem (module docstring); parameters as ``PARAMS``."""
    validate_params(dict(depth=depth, weight=weight, spread=spread, decoys=decoys, decoy_ratio=decoy_ratio, sink=sink,
                   sink_v=sink_v, vmean=vmean, qcorr=qcorr))
    b, h, r, n, d = shape.batch, shape.heads, shape.seqlen, shape.seqlen_k, shape.head_dim
    require(shape.kv_heads == h, "the needle family draws one K/V head per query head (kv_heads = heads)")
    nd = int(decoys)
    require(n - r >= nd + 2, f"seqlen_k {n} leaves too few keys before the {r} measured rows for the needle, "
                             f"{nd} decoys and a sink; use more keys or fewer rows")
    require(nd + 2 <= d, f"{nd} decoys need {nd + 2} orthogonal V directions; head_dim {d} has too few")
    g = generator(seed, device)
    f64 = dict(dtype=torch.float64, device=device)
    # Positions from a CPU stream of the same seed: identical on every device.
    pos_n = needle_position(n, r, depth)
    cpu = torch.Generator().manual_seed(int(seed) + 7919)
    free = torch.randperm(n - r, generator=cpu) + 1  # 1 .. n - r
    free = free[free != pos_n][:nd]
    pos_d = sorted(int(i) for i in free)
    pos_s = 0 if sink > 0 else None

    # Queries: correlated rows, each of norm spread * sqrt(d).
    qc = torch.randn(b, h, 1, d, generator=g, **f64)
    q = math.sqrt(qcorr) * qc + math.sqrt(1 - qcorr) * torch.randn(b, h, r, d, generator=g, **f64)
    q = q * (spread * math.sqrt(d) / q.norm(dim=-1, keepdim=True))
    k = torch.randn(b, h, n, d, generator=g, **f64)
    # V directions: needle u, decoys u_k, the mean's direction, orthonormal per (batch, head).
    basis = torch.linalg.qr(torch.randn(b, h, d, nd + 2, generator=g, **f64)).Q.transpose(-1, -2)  # [B,H,nd+2,d]
    u, u_dec, mu_dir = basis[:, :, 0], basis[:, :, 1:1 + nd], basis[:, :, 1 + nd]
    v = torch.randn(b, h, n, d, generator=g, **f64)
    dirs = basis[:, :, :1 + nd]  # [B,H,1+nd,d]
    v = v - torch.einsum("bhnj,bhjd->bhnd", torch.einsum("bhnd,bhjd->bhnj", v, dirs), dirs)
    if pos_s is not None:
        v[:, :, pos_s] *= sink_v
    v = v + (vmean * math.sqrt(d)) * mu_dir[:, :, None, :]
    planted = [pos_n, *pos_d]
    v[:, :, planted] = (vmean * math.sqrt(d)) * mu_dir[:, :, None, :] + math.sqrt(d) * dirs

    # Logits the planted keys need, per row, against that row's visible distractors.
    scale = 1.0 / math.sqrt(d)
    special = planted + ([pos_s] if pos_s is not None else [])
    masses = [weight] + [weight * decoy_ratio] * nd + ([sink] if pos_s is not None else [])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B,H,R,N]
    row_end = torch.arange(n - r, n, device=device)  # the last key each measured row sees
    hidden = torch.arange(n, device=device)[None, :] > row_end[:, None]
    s = s.masked_fill(hidden, -math.inf)
    s[..., special] = -math.inf
    log_d = torch.logsumexp(s, dim=-1)  # [B,H,R]
    rest = 1.0 - sum(masses)
    t = torch.stack([math.log(m) + log_d - math.log(rest) for m in masses], dim=-1)  # [B,H,R,P]
    # Keys with exactly these logits: minimum-norm solution in the span of the rows plus a random
    # key's part orthogonal to them.
    gram = torch.matmul(q, q.transpose(-1, -2))  # [B,H,R,R]
    rand = torch.randn(b, h, len(special), d, generator=g, **f64)
    coef = torch.linalg.solve(gram, t / scale - torch.matmul(q, rand.transpose(-1, -2)))  # [B,H,R,P]
    k[:, :, special] = rand + torch.matmul(coef.transpose(-1, -2), q)
    return Needle(q, k, v, pos_n, pos_d, pos_s, u, u_dec, weight, weight * decoy_ratio, sink, math.sqrt(d))


@register(
    "needle",
    description="needle in a haystack for the last query rows of a causal prefill or a decode row: one key at a "
                "chosen depth with an exact softmax mass and its own V direction, decoys, an optional sink",
    params=PARAMS,
    validate=validate_params,
    on_device=True,
    labels={"depth": ("depth", "needle depth in the visible context (0 = oldest)", "needle depth"),
            "weight": ("w", "needle softmax mass (exact)", "needle weight w"),
            "sink": ("sink", "attention sink softmax mass", "sink mass")},
)
def needle(shape: AttnShape, seed: int, *, device: str = "cpu", **params):
    p = plant(shape, seed, device=device, **params)
    return p.q, p.k, p.v
