"""Scale granularities for quantizing Q, K and V laid out (batch, heads, seqlen, head_dim).

Exposed: ``PerTensor``, ``PerHead``, ``PerBlock``, ``PerToken``, ``PerChannel``,
``PerThread``, ``PerGroup``, ``Granularity``, ``parse_granularity``, ``amax``, ``group_amax``,
``expand_groups``, ``sage2_thread_granularities``, ``thread_granularities``.

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
- ``PerChannel``: x [B, H, N, D] -> amax [B, H, 1, D]: one scale per channel over all
  tokens (SageAttention2's V, whose contraction in P V runs over tokens)
- ``PerThread(block, width)``: x [B, H, N, D] -> amax [B, H, N, 1], shared by the tokens of
  a ``block`` whose index mod 8 has the same ``// width`` (SageAttention2's per-thread Q and
  K scales; see the class). Compact scale shape [B, H, ceil(N / block) * 8 / width].
- ``PerGroup(size, axis)``: microscaling blocks of ``size`` consecutive elements along
  ``axis`` (head_dim for Q and K, tokens for V). ``amax`` returns it expanded to x's shape;
  ``group_amax`` gives the compact shape, e.g. axis -1: [B, H, N, D] -> [B, H, N, ceil(D / size)].

``parse_granularity`` reads the first four, ``thread`` (``PerThread(0)``: SageAttention2's
per-thread groups at the recipe's tiles, Q ``PerThread(bm / 4, 1)`` and K ``PerThread(bn, 2)``,
resolved by ``thread_granularities``) and ``channel`` (recipes refuse it for Q and K, whose
scales would vary along the contraction of Q K^T; V takes it through the ``vgran`` key).
``PerGroup`` stays out of recipe strings: the microscaling formats (``qk=mxfp8`` ...) carry it.
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


@dataclasses.dataclass(frozen=True)
class PerChannel:
    """One scale per (batch, head, channel) over all tokens: x [B, H, N, D] -> [B, H, 1, D].

    SageAttention2's V (``per_channel_fp8`` in thu-ml/SageAttention ``sageattention/quant.py``:
    scale shape [batch, kv_heads, head_dim], amax over all kv_len tokens / scale_max)."""

    def short_str(self) -> str:
        return "channel"


@dataclasses.dataclass(frozen=True)
class PerThread:
    """SageAttention2's per-thread token groups: x [B, H, N, D] -> amax [B, H, N, 1].

    Within each run of ``block`` tokens, token t belongs to group ``(t % 8) // width``; a
    group shares one scale, so there are ``8 // width`` scales per block (compact shape
    [B, H, ceil(N / block) * 8 // width]).

    Why these groups: the scale is applied to the S accumulator, so a thread can use one
    scale only if every S element it holds shares it. In the m16n8 accumulator fragment of
    ``mma.m16n8k32`` (INT8) and ``mma.m16n8k64`` (INT4), the same for both, lane l holds
    rows l/4 and l/4 + 8 of each 16-row tile and columns 2(l%4), 2(l%4)+1 of each 8-column
    tile. So one thread's query rows are the rows of a warp's tiles with the same index
    mod 8 (``width`` 1), and its key columns are the pairs {2j, 2j+1} mod 8 of the block
    (``width`` 2). Facts from thu-ml/SageAttention ``sageattention/triton/quant_per_thread.py``
    (Q: ``offs_n = blk * WARPQ + arange(WARPQ // 8) * 8 + tid``, 8 scales per WARPQ tokens;
    K: tokens ``arange(WARPK // 8) * 8 + 2 * tid + {0, 1}``, 4 scales per WARPK tokens) and
    ``sageattention/core.py`` (WARPQ 32, WARPK 64 = the K block on sm80/sm89; WARPQ 16,
    WARPK 128 on sm90). ``sage2_thread_granularities`` returns the pairs.
    """

    block: int = 32  # 0: "at the recipe's tiles" (``gran=thread``), see ``thread_granularities``
    width: int = 1

    def __post_init__(self):
        if self.block < 0 or self.block % 8 or self.width not in (1, 2, 4, 8):
            raise UsageError(f"PerThread(block={self.block}, width={self.width}): block must be a positive "
                             "multiple of 8 (or 0: the recipe's tiles) and width one of 1, 2, 4, 8")

    def short_str(self) -> str:
        if self.block == 0:
            return "thread"
        return f"thread{self.block}" + ("" if self.width == 1 else f"x{self.width}")


@dataclasses.dataclass(frozen=True)
class PerGroup:
    """Microscaling blocks: ``size`` consecutive elements along ``axis`` share one scale.

    x [B, H, N, D], axis -1 -> compact scale [B, H, N, ceil(D / size)] (Q and K: the block
    runs along head_dim, the contraction of Q K^T); axis 2 -> [B, H, ceil(N / size), D] (V:
    along tokens, the contraction of P V). MXFP8 uses size 32, NVFP4 size 16."""

    size: int = 32
    axis: int = -1

    def __post_init__(self):
        if self.size <= 0:
            raise UsageError(f"PerGroup size must be positive, got {self.size}")

    def short_str(self) -> str:
        return f"group{self.size}" + ("" if self.axis == -1 else f"@{self.axis}")


Granularity = PerTensor | PerHead | PerBlock | PerToken | PerChannel | PerThread | PerGroup


def sage2_thread_granularities(arch: str = "sm89") -> tuple[PerThread, PerThread]:
    """(Q, K) per-thread granularities of SageAttention2's kernels: WARPQ = 32 and
    WARPK = 64 on sm80/sm89 (one K block of 64 tokens), WARPQ = 16 and WARPK = 128 on sm90
    (``sageattention/core.py``, calls of ``per_thread_int8_triton``)."""
    if arch in ("sm80", "sm86", "sm89", "sm120"):
        return PerThread(32, 1), PerThread(64, 2)
    if arch == "sm90":
        return PerThread(16, 1), PerThread(128, 2)
    raise UsageError(f"unknown architecture {arch!r}; use sm80, sm89, sm90 or sm120")


def thread_granularities(block_m: int, block_n: int) -> tuple[PerThread, PerThread]:
    """(Q, K) granularities of ``gran=thread`` at query tile ``block_m`` and key tile ``block_n``:
    Q ``PerThread(block_m / 4, 1)`` (four warps split a query tile: WARPQ = BLKQ / 4, 32 of 128
    on sm80/sm89, 16 of 64 on sm90) and K ``PerThread(block_n, 2)`` (WARPK = BLKK). UsageError
    when the tiles do not split into MMA fragments (block_m a multiple of 32, block_n of 8)."""
    if block_m % 32 or block_n % 8 or block_m <= 0 or block_n <= 0:
        raise UsageError(f"gran=thread needs bm a multiple of 32 and bn a multiple of 8 (the MMA fragments of "
                         f"four warps); got bm={block_m}, bn={block_n}")
    return PerThread(block_m // 4, 1), PerThread(block_n, 2)


def parse_granularity(text: str) -> Granularity:
    t = text.strip().lower()
    if t == "tensor":
        return PerTensor()
    if t == "head":
        return PerHead()
    if t == "token":
        return PerToken()
    if t == "thread":
        return PerThread(0)
    if t == "channel":
        return PerChannel()
    if t.startswith("block"):
        rest = t[len("block"):]
        if rest == "":
            return PerBlock()
        if rest.isdigit() and int(rest) > 0:
            return PerBlock(int(rest))
    raise UsageError(f"unknown scale granularity {text!r}; use tensor, head, block, blockN (e.g. block64), token, "
                     "thread or channel")


def amax(x: torch.Tensor, gran: Granularity, *, block_rows: int | None = None, group: int = 1) -> torch.Tensor:
    """amax of |x| at ``gran``, shaped to broadcast against ``x`` (see module docstring)."""
    if isinstance(gran, PerTensor):
        return _absmax(x, None).reshape(1, 1, 1, 1)
    if isinstance(gran, PerHead):
        m = _absmax(x, (2, 3), keepdim=True)
        if group > 1:
            b, h = m.shape[:2]
            m = m.reshape(b, h // group, group, 1, 1).amax(dim=2, keepdim=True)
            m = m.expand(b, h // group, group, 1, 1).reshape(b, h, 1, 1)
        return m
    if isinstance(gran, PerToken):
        return _absmax(x, 3, keepdim=True)
    if isinstance(gran, PerBlock):
        rows = gran.rows or block_rows
        if not rows:
            raise UsageError("block granularity needs a tile size; give blockN or set the recipe's tiles")
        b, h, n, _ = x.shape
        nblk = -(-n // rows)
        pad = nblk * rows - n
        tok = _absmax(x, 3)
        if pad:
            tok = torch.nn.functional.pad(tok, (0, pad))
        blk = tok.reshape(b, h, nblk, rows).amax(dim=3)
        return blk.repeat_interleave(rows, dim=2)[:, :, :n].unsqueeze(-1)
    if isinstance(gran, PerChannel):
        return _absmax(x, 2, keepdim=True)
    if isinstance(gran, PerThread):
        if gran.block == 0:
            raise UsageError("PerThread(0) stands for the recipe's tiles; resolve it with thread_granularities")
        b, h, n, _ = x.shape
        nblk = -(-n // gran.block)
        tok = torch.nn.functional.pad(_absmax(x, 3), (0, nblk * gran.block - n))  # zeros never raise an amax
        # token t = blk * block + r * 8 + c; its group is c // width
        g = tok.reshape(b, h, nblk, gran.block // 8, 8 // gran.width, gran.width).amax(dim=(3, 5), keepdim=True)
        g = g.expand(b, h, nblk, gran.block // 8, 8 // gran.width, gran.width)
        return g.reshape(b, h, nblk * gran.block)[:, :, :n].unsqueeze(-1)
    if isinstance(gran, PerGroup):
        return expand_groups(group_amax(x, gran.size, gran.axis), gran.size, gran.axis, x.shape[gran.axis])
    raise TypeError(f"not a granularity: {gran!r}")


def _absmax(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """max |x| over ``dim`` (all of x for None) without a materialised |x| (a whole float64 K at
    the paper's shape is 268 MB): the infinity norm reduces |x| on the fly. Exact (a max of
    absolute values), and NaN propagates as in ``x.abs().amax()``."""
    if x.numel() == 0 or not x.is_floating_point():
        a = x.abs()
        return a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)
    from . import native  # one pass per row in C (torch's inner-dim reduction reads 0.7 GB/s here)

    last = (x.dim() - 1, -1)
    if x.dim() >= 2 and (dim is None or dim in last or (isinstance(dim, tuple) and len(dim) == 2
                                                       and {d % x.dim() for d in dim} == {x.dim() - 2, x.dim() - 1})):
        rows = native.row_absmax(x)
        if rows is not None:
            if dim is None:
                return rows.amax()
            if isinstance(dim, tuple):
                return rows.amax(dim=-1, keepdim=keepdim).unsqueeze(-1) if keepdim else rows.amax(dim=-1)
            return rows.unsqueeze(-1) if keepdim else rows
    return torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, keepdim=keepdim)


def group_amax(x: torch.Tensor, size: int, axis: int = -1) -> torch.Tensor:
    """amax of |x| over runs of ``size`` elements along ``axis`` (the last run may be short):
    the compact shape, x's with ``axis`` of length ceil(n / size). NaN propagates."""
    ax = axis % x.dim()
    n = x.shape[ax]
    ng = -(-n // size)
    a = x.abs().movedim(ax, -1)
    if ng * size != n:
        a = torch.nn.functional.pad(a, (0, ng * size - n))
    return a.reshape(*a.shape[:-1], ng, size).amax(dim=-1).movedim(-1, ax)


def expand_groups(t: torch.Tensor, size: int, axis: int, n: int) -> torch.Tensor:
    """Inverse of the grouping: repeat each entry of ``t`` ``size`` times along ``axis`` and
    trim to ``n``."""
    ax = axis % t.dim()
    return t.repeat_interleave(size, dim=ax).narrow(ax, 0, n)
