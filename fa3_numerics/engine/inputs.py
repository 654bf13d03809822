"""What a task computes on: Q, K, V drawn from a distribution or read from a capture, checked.

Exposed: ``DistInputs``, ``CaptureInputs``, ``TensorInputs``, ``check_inputs``, ``input_histogram``,
``input_summary``, ``InputSummary``, ``HIST_EDGES``.

Inputs are small picklable descriptions (a dask worker draws them itself), each with
``draw(device) -> (q, k, v)`` in float64 on that device, laid out (batch, heads, seqlen,
head_dim).

``check_inputs`` refuses inputs the attention cannot be measured on: a NaN or Inf in Q, K or V
(an Inf in K makes the FP8 descale fall back to 1 and the cast saturate, so every FP8 output
would look finite while the reference is NaN), and magnitudes whose float64 scores or outputs
overflow. Refusing names the data, the cell and the seed: a distribution whose parameters
produce them needs other parameters, not a silently finite result.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..errors import UsageError

# Log-spaced bin edges for the histogram of |Q|, |K|, |V| entries kept in every dataset.
HIST_EDGES = np.concatenate([[0.0], np.logspace(-3, 3, 61)])
# Largest float64 score or output the reference may meet (a margin below DBL_MAX ~ 1.8e308).
_F64_SAFE = 1e300


@dataclasses.dataclass(frozen=True)
class DistInputs:
    """Q, K, V from a registered distribution (``fa3_numerics.data.distributions``)."""

    dist: str
    params: tuple  # ((name, value), ...)
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    seed: int

    def draw(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from ..data import distributions

        shape = distributions.AttnShape(self.batch, self.heads, self.seqlen, self.head_dim, kv_heads=self.kv_heads)
        # On a GPU the family draws there (seconds of CPU float64 sampling saved at paper size).
        return distributions.generate(self.dist, shape, self.seed, device=device, **dict(self.params))

    def describe(self) -> str:
        p = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params)
        return f"{self.dist}({p})" if p else self.dist


@dataclasses.dataclass(frozen=True)
class CaptureInputs:
    """One layer of a capture file as it was recorded: (1, heads, tokens, d), K/V with kv_heads."""

    path: str
    layer: int

    def draw(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from ..data.distributions.capture_file import _capture  # one load per file and process

        q, k, v = _capture(self.path).qkv(self.layer)
        return tuple(t.unsqueeze(0).to(device=device, dtype=torch.float64) for t in (q, k, v))

    def describe(self) -> str:
        return f"capture {self.path} layer {self.layer}"


@dataclasses.dataclass(frozen=True, eq=False)
class TensorInputs:
    """Tensors already in memory (a capture that was never written to a file)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "TensorInputs":
        """From (heads, seq, d) or (batch, heads, seq, d) tensors."""
        return cls(*(t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v)))

    def draw(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.to(device=device, dtype=torch.float64) for t in (self.q, self.k, self.v))

    def describe(self) -> str:
        return "tensors in memory"


@dataclasses.dataclass(frozen=True)
class InputSummary:
    """What one pass over Q, K and V gives: the |x| histogram ([3, bins], as ``input_histogram``)
    and each tensor's (non-finite count, amax of the finite |x|), as ``check_inputs`` needs."""

    hist: np.ndarray
    checks: tuple[tuple[int, float], ...]


def input_summary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> InputSummary | None:
    """The histogram and the checks' numbers in one C pass per tensor (CPU float64); None where
    the compiled pass does not apply (then ``check_inputs`` and ``input_histogram`` each read)."""
    from ..numerics import native

    rows, checks = [], []
    for t in (q, k, v):
        fast = native.abs_stats(t, HIST_EDGES) if t.numel() else None
        if fast is None:
            return None
        rows.append(fast[0].numpy().astype(np.float64))
        checks.append((fast[2], fast[1]))
    return InputSummary(np.stack(rows), tuple(checks))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, where: str,
                 summary: InputSummary | None = None) -> None:
    """Refuse non-finite inputs, and inputs whose float64 attention overflows (see module docstring).
    ``summary``: the same tensors' ``input_summary``, so that they are not read again."""
    amaxes = []
    for i, (name, t) in enumerate((("Q", q), ("K", k), ("V", v))):
        bad, amax = summary.checks[i] if summary is not None else _nonfinite_and_amax(t)
        if bad:
            raise UsageError(f"{where}: {bad} non-finite value(s) in {name}; FP8 casts would saturate them into "
                             "finite results, so they are refused: fix the data or the distribution's parameters")
        amaxes.append(amax)
    d, n = q.shape[-1], k.shape[-2]
    aq, ak, av = amaxes
    if aq * ak * d * scale > _F64_SAFE or av * n > _F64_SAFE:
        raise UsageError(f"{where}: |Q| up to {aq:.3g}, |K| up to {ak:.3g}, |V| up to {av:.3g} overflow float64 "
                         "attention (the reference itself would be Inf/NaN); use smaller parameters")


def _nonfinite_and_amax(t: torch.Tensor) -> tuple[int, float]:
    from ..numerics import native

    if t.numel() == 0:
        return 0, 0.0
    fast = native.abs_stats(t, [0.0])  # one pass in C on the CPU
    if fast is not None:
        return fast[2], fast[1]
    return int((~torch.isfinite(t)).sum()), float(t.abs().max())


def input_histogram(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """Counts of |x| per HIST_EDGES bin for Q, K, V -> [3, bins]; the last bin counts |x| >= 1000.
    Computed where the tensors are (a GPU never copies them back); one C pass per tensor on
    the CPU, the same counts as ``torch.bucketize(|x|, edges, right=True) - 1``."""
    from ..numerics import native

    rows = []
    for t in (q, k, v):
        fast = native.abs_stats(t, HIST_EDGES)
        if fast is not None:
            rows.append(fast[0].numpy().astype(np.float64))
            continue
        edges = torch.tensor(HIST_EDGES, dtype=torch.float64, device=t.device)
        idx = torch.bucketize(t.abs().flatten(), edges, right=True) - 1
        rows.append(torch.bincount(idx, minlength=len(HIST_EDGES)).cpu().numpy().astype(np.float64))
    return np.stack(rows)


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
