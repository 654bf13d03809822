"""Scale granularities for quantizing Q, K and V laid out (batch, heads, seqlen, head_dim).

Exposed: ``PerTensor``, ``PerHead``, ``PerBlock``, ``PerToken``, ``Granularity``,
``parse_granularity``, ``amax``.

Each granularity reduces |x| to an amax tensor that broadcasts against x:

- ``PerTensor``: x [B, H, N, D] -> amax [1, 1, 1, 1]
- ``PerHead``:   x [B, H, N, D] -> amax [B, H, 1, 1]; with ``group`` g > 1 the amax is
  shared by g consecutive heads, which is what a kernel with one Q descale per
  (batch, kv-head) needs under grouped-query attention
- ``PerBlock(rows)``: x [B, H, N, D] -> amax [B, H, N, 1] constant over each run of
  ``rows`` tokens (the last block may be shorter). FA3's paper quantizes B_r x d blocks of
  Q and B_c x d blocks of K and V, so ``rows`` is the kernel's tile size; ``rows=0`` means
  "the kernel's tile", filled in by the recipe
- ``PerToken``:  x [B, H, N, D] -> amax [B, H, N, 1]
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UsageError


@dataclasses.dataclass(frozen=True)
class PerTensor:
    def short_str(self) -> str:
        return "tensor"


@dataclasses.dataclass(frozen=True)
class PerHead:
    def short_str(self) -> str:
        return "head"


@dataclasses.dataclass(frozen=True)
class PerBlock:
    rows: int = 0  # 0: the kernel's tile size for this tensor

    def short_str(self) -> str:
        return "block" if self.rows == 0 else f"block{self.rows}"


@dataclasses.dataclass(frozen=True)
class PerToken:
    def short_str(self) -> str:
        return "token"


Granularity = PerTensor | PerHead | PerBlock | PerToken


def parse_granularity(text: str) -> Granularity:
    t = text.strip().lower()
    if t == "tensor":
        return PerTensor()
    if t == "head":
        return PerHead()
    if t == "token":
        return PerToken()
    if t.startswith("block"):
        rest = t[len("block"):]
        if rest == "":
            return PerBlock()
        if rest.isdigit() and int(rest) > 0:
            return PerBlock(int(rest))
    raise UsageError(f"unknown scale granularity {text!r}; use tensor, head, block, blockN (e.g. block64) or token")


def amax(x: torch.Tensor, gran: Granularity, *, block_rows: int | None = None, group: int = 1) -> torch.Tensor:
    """amax of |x| at ``gran``, shaped to broadcast against ``x`` (see module docstring)."""
    a = x.abs()
    if isinstance(gran, PerTensor):
        return a.amax().reshape(1, 1, 1, 1)
    if isinstance(gran, PerHead):
        m = a.amax(dim=(2, 3), keepdim=True)
        if group > 1:
            b, h = m.shape[:2]
            m = m.reshape(b, h // group, group, 1, 1).amax(dim=2, keepdim=True)
            m = m.expand(b, h // group, group, 1, 1).reshape(b, h, 1, 1)
        return m
    if isinstance(gran, PerToken):
        return a.amax(dim=3, keepdim=True)
    if isinstance(gran, PerBlock):
        rows = gran.rows or block_rows
        if not rows:
            raise UsageError("block granularity needs a tile size; give blockN or set the recipe's tiles")
        b, h, n, _ = x.shape
        nblk = -(-n // rows)
        pad = nblk * rows - n
        tok = a.amax(dim=3)
        if pad:
            tok = torch.nn.functional.pad(tok, (0, pad))
        blk = tok.reshape(b, h, nblk, rows).amax(dim=3)
        return blk.repeat_interleave(rows, dim=2)[:, :, :n].unsqueeze(-1)
    raise TypeError(f"not a granularity: {gran!r}")
