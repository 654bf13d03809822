"""Retrieval of a planted needle from an attention output: what needle-in-a-haystack needs, which
RMSE does not show.

Exposed: ``Retrieval``, ``retrieval``, ``RETRIEVAL_VARS``.

With the needle family (``data/distributions/needle.py``) the needle's V row is the shared mean
plus sqrt(d) u, every decoy's the mean plus sqrt(d) u_k, and no other V row has a component along
u or u_k. The output's projection on a planted direction, divided by sqrt(d), is then the
attention mass that item received as the arithmetic delivered it (in exact arithmetic, its softmax
mass); this is the exact decomposition of O, so no P needs to be read out of a kernel. Per query
row:

- ``mass``: <O, u> / sqrt(d), the needle's effective attention mass;
- ``share``: <O, u> / <O_ref, u>, the needle value's share of the output relative to exact
  (1 = all of it arrives; 0 = the needle is lost);
- ``margin``: (mass - the largest decoy's mass) / (exact needle mass - exact decoy mass): 1 in exact
  arithmetic, <= 0 when a decoy is retrieved instead;
- ``top``: 1 when the needle's mass exceeds every decoy's (with no decoys: when it is positive);
- ``rank``: 1 + the number of decoys whose mass exceeds the needle's;
- ``row_rel_rmse``: RMSE(O - O_ref) / RMS(O_ref) over the row's head dim, the pooled view.

A NaN or Inf in O gives NaN everywhere in that row (and ``top`` 0), reported by the caller.
"""

from __future__ import annotations

import dataclasses

import torch

RETRIEVAL_VARS = {
    "mass": "needle's effective attention mass, <O, u> / sqrt(d)",
    "share": "needle value's share of the output relative to exact, <O, u> / <O_ref, u>",
    "margin": "needle mass minus the largest decoy's, relative to the exact gap",
    "top": "1 when the needle outweighs every decoy in the output",
    "rank": "needle's rank among needle and decoys (1 = retrieved)",
    "row_rel_rmse": "RMSE of the row relative to the reference row's RMS",
}


@dataclasses.dataclass
class Retrieval:
    """[B, H, R] float64 tensors, one value per (batch, head, query row); names as ``RETRIEVAL_VARS``."""

    mass: torch.Tensor
    share: torch.Tensor
    margin: torch.Tensor
    top: torch.Tensor
    rank: torch.Tensor
    row_rel_rmse: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def retrieval(out: torch.Tensor, ref: torch.Tensor, u: torch.Tensor, decoy_u: torch.Tensor, v_norm: float,
              weight: float, decoy_weight: float) -> Retrieval:
    """``out``, ``ref`` [B, H, R, d]; ``u`` [B, H, d] the needle's unit V direction, ``decoy_u``
    [B, H, D, d] the decoys'; ``v_norm`` the planted rows' norm along them; ``weight`` and
    ``decoy_weight`` their exact masses."""
    o, r = out.to(torch.float64), ref.to(torch.float64)
    bad = ~torch.isfinite(o).all(dim=-1)
    o = torch.where(bad[..., None], torch.zeros_like(o), o)
    proj = torch.einsum("bhrd,bhd->bhr", o, u.to(o))
    proj_ref = torch.einsum("bhrd,bhd->bhr", r, u.to(o))
    mass = proj / v_norm
    share = proj / proj_ref
    if decoy_u.shape[2]:
        dec = torch.einsum("bhrd,bhkd->bhrk", o, decoy_u.to(o)) / v_norm
        dmax = dec.amax(dim=-1)
        rank = 1.0 + (dec > mass[..., None]).sum(dim=-1).to(torch.float64)
    else:
        dmax = torch.zeros_like(mass)
        rank = torch.ones_like(mass)
    gap = weight - (decoy_weight if decoy_u.shape[2] else 0.0)
    margin = (mass - dmax) / gap
    top = (mass > dmax).to(torch.float64)
    rel = ((o - r) ** 2).mean(dim=-1).sqrt() / (r ** 2).mean(dim=-1).sqrt()
    nan = torch.full_like(mass, float("nan"))
    fix = lambda x: torch.where(bad, nan, x)  # noqa: E731
    return Retrieval(fix(mass), fix(share), fix(margin), torch.where(bad, torch.zeros_like(top), top), fix(rank),
                     fix(rel))
