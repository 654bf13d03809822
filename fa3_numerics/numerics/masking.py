"""Which keys a query sees and how its scores are shaped: sliding windows, soft-capping, sinks.

Exposed: ``Masking``, ``masking``, ``visible``, ``any_visible``, ``softcap64``, ``softcap_constants``,
``softcap_tile``, ``softmax_rows32``, ``sink_row_sum``.

Three features of current model families, each as FlashAttention-3 (Dao-AILab/flash-attention,
hopper/) or the model's own code defines it:

- ``window=(left, right)``, FA3's ``window_size`` (-1 = unbounded): query i sees key j iff
  ``i + off - left <= j <= i + off + right`` with ``off = seqlen_k - seqlen_q`` (bottom-right
  aligned, as FA3's causal mask; hopper/mask.h, flash_attn_interface.py's docstring). Causal is
  ``right = 0``. Gemma 2/3, Mistral and gpt-oss use ``(sliding_window - 1, 0)`` in transformers'
  convention that a query sees itself and the ``sliding_window - 1`` keys before it.
- ``softcap`` (Gemma 2): scores become ``softcap * tanh(S * scale / softcap)`` before the mask and
  the softmax. FA3 folds the constants (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp,
  ``to_underlying_arguments``): the host rounds ``softmax_scale / softcap`` to float32 (times
  ``q_descale * k_descale`` on the device for FP8), the tile is ``tanh(S * that)`` in float32, and
  the softmax's ``scale_log2`` becomes ``softcap * log2(e)`` with no descale folded into it
  (hopper/flash_fwd_kernel_sm90.h, ``if constexpr (Is_FP8 && !Has_softcap)``).
- ``sinks`` (gpt-oss): one learned logit per query head, in the units of the scaled scores, that
  joins each row's softmax denominator and nothing else (transformers' gpt_oss
  ``eager_attention_forward``: concatenated to the scores, softmaxed, then dropped).

The default (no window beyond causal, no softcap, no sinks) is ``Masking.plain``: callers then take
their original code path, so plain causal and non-causal attention are bit-for-bit unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import UsageError

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, eq=False)
class Masking:
    """The masking and score shaping of one attention call."""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)   # (left, right), -1 unbounded; right = 0 when causal
    softcap: float = 0.0                 # 0: off
    sinks: torch.Tensor | None = None    # [H] float64 logits, or None

    @property
    def plain(self) -> bool:
        """True when only the causal flag is set (the path every caller had before these features)."""
        return self.window == (-1, -1 if not self.causal else 0) and self.softcap == 0.0 and self.sinks is None

    @property
    def windowed(self) -> bool:
        return self.window[0] >= 0 or (self.window[1] >= 0 and not self.causal)

    def describe(self) -> str:
        parts = ["causal" if self.causal else "non-causal"]
        if self.windowed:
            parts.append(f"window=({self.window[0]},{self.window[1]})")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)


def masking(causal: bool = False, window_size: tuple[int, int] | None = None, softcap: float | None = None,
            sinks: torch.Tensor | None = None, heads: int | None = None, seqlen_q: int | None = None,
            seqlen_k: int | None = None) -> Masking:
    """Validate and normalise the three options into a ``Masking`` (UsageError naming the fix).

    With the sequence lengths, a window side that reaches past the sequence becomes unbounded and
    ``(-1, 0)`` becomes causal, as FA3's ``mha_fwd`` rewrites them before it picks its tiles
    (hopper/flash_api.cpp); what each query sees does not change."""
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if left < -1 or right < -1:
        raise UsageError(f"window_size=({left}, {right}): each side is -1 (unbounded) or a key count >= 0")
    if causal and right > 0:
        raise UsageError(f"window_size=({left}, {right}) with causal: a causal window has right = 0 (or -1)")
    if seqlen_k is not None and left >= seqlen_k - 1:
        left = -1
    if seqlen_q is not None and right >= seqlen_q - 1:
        right = -1
    if causal:
        right = 0
    causal = left < 0 and right == 0 or bool(causal)
    cap = 0.0 if softcap is None else float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise UsageError(f"softcap={softcap}: pass a positive cap (e.g. 50.0 for Gemma 2) or 0 for none")
    if sinks is not None:
        sinks = sinks.detach().to(torch.float64).reshape(-1)
        if heads is not None and sinks.numel() != heads:
            raise UsageError(f"sinks has {sinks.numel()} values for {heads} query heads; pass one logit per head")
        if not bool(torch.isfinite(sinks).all()):
            raise UsageError("sinks holds a NaN or Inf; pass finite logits")
    return Masking(bool(causal), (left, right), cap, sinks)


def visible(mk: Masking, q_pos: torch.Tensor, k_start: int, k_end: int, seqlen_q: int,
            seqlen_k: int) -> torch.Tensor | None:
    """Boolean [R, k_end - k_start]: True where query ``q_pos[r]`` sees the key; None when all do."""
    left, right = mk.window
    if left < 0 and right < 0:
        return None
    k_pos = torch.arange(k_start, k_end, device=q_pos.device)
    diag = q_pos[:, None] + (seqlen_k - seqlen_q)
    vis = torch.ones(q_pos.numel(), k_end - k_start, dtype=torch.bool, device=q_pos.device)
    if right >= 0:
        vis &= k_pos[None, :] <= diag + right
    if left >= 0:
        vis &= k_pos[None, :] >= diag - left
    return vis


def any_visible(mk: Masking, q_pos: torch.Tensor, k_start: int, k_end: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether any of the rows sees any key of [k_start, k_end): FA3 visits only such KV tiles
    (``get_n_block_min_max``), and a tile no row sees changes nothing in the online softmax."""
    vis = visible(mk, q_pos, k_start, k_end, seqlen_q, seqlen_k)
    return True if vis is None else bool(vis.any())


# -- soft-capping ---------------------------------------------------------------------------

def softcap64(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """The reference: ``softcap * tanh(scores / softcap)`` of already scaled float64 scores."""
    return torch.tanh(scores / softcap).mul_(softcap)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def softcap_constants(scale: float, softcap: float) -> tuple[float, float]:
    """(``softmax_scale / softcap`` as the host rounds it to float32, ``softcap * log2(e)`` rounded
    to float32): FA3's ``softcap_val`` and ``softmax_scale_log2`` when soft-capping is on. Both
    operands are float32 kernel arguments; the quotient is a float division, the log2(e) product
    is formed in double (``M_LOG2E``) and narrowed once."""
    s32, c32 = _f32(scale), _f32(softcap)
    return _f32(s32 / c32), _f32(c32 * LOG2E)


def softcap_tile(s: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """float32 ``tanh(S * mult)`` of one tile of float32 S: the product rounds to float32, the
    tanh is computed in float64 and rounded once. The kernel's ``cutlass::fast_tanh``
    (``tanh.approx.f32``, relative error near 2^-11) is not reproduced bit for bit; a correctly
    rounded tanh is the closest deterministic stand-in."""
    return torch.tanh((s * mult).to(torch.float32).double()).to(torch.float32)


def softmax_rows32(s: torch.Tensor, mk: Masking, q_pos: torch.Tensor, head: int, seqlen_q: int,
                   seqlen_k: int) -> torch.Tensor:
    """A materialised softmax of scaled float32 scores [R, N] as the models' eager attention forms
    it (the standard algorithm): ``softcap * tanh(S / softcap)`` (transformers' Gemma 2), the mask,
    the sink as one more logit that is dropped after the softmax (gpt-oss), float32 throughout.
    A row that sees no key is 0."""
    from .reference import causal_mask

    if mk.softcap:
        s = torch.tanh(s / mk.softcap) * mk.softcap
    vis = causal_mask(q_pos, 0, seqlen_k, seqlen_q, seqlen_k) if mk.causal else None
    win = visible(mk, q_pos, 0, seqlen_k, seqlen_q, seqlen_k)
    if win is not None:
        vis = win if vis is None else vis & win
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    if mk.sinks is not None:
        sink = mk.sinks[head].to(device=s.device, dtype=s.dtype).expand(s.shape[0], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[:, :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return p if vis is None else p.masked_fill(~vis.any(dim=-1, keepdim=True), 0.0)


# -- sinks -----------------------------------------------------------------------------------

def sink_row_sum(row_sum: torch.Tensor, m: torch.Tensor, sl2: torch.Tensor, offset: float, mk: Masking,
                 heads: int) -> torch.Tensor:
    """A row's float32 sum with the sink's term added, in P~'s units: ``2^(sink * log2(e) -
    (m * scale_log2 - offset))``, formed as the other terms are (a fused multiply-add for the
    exponent, correctly rounded exp2) and added once after the last KV tile. The sink is never
    cast to P's format and multiplies no V, so it only shrinks the row's weights. ``m`` is the
    running max as the softmax held it (raw S, descaled or capped, matching ``sl2``); a row that
    saw no key keeps 0 as its max, as the kernel does, and its output stays 0."""
    dev = row_sum.device
    sink_l2 = (mk.sinks.to(device=dev, dtype=torch.float64) * LOG2E).to(torch.float32).reshape(1, heads, 1, 1)
    m_cur = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    max_scaled = (m_cur.double() * sl2.double() - offset).to(torch.float32)
    term = torch.exp2((sink_l2.double() - max_scaled.double())).to(torch.float32)
    return (row_sum + term).to(torch.float32)


__all__ = ["Masking", "masking", "visible", "any_visible", "softcap64", "softcap_constants", "softcap_tile",
           "softmax_rows32", "sink_row_sum"]
