"""A model of Hopper's FP8 tensor-core matrix multiply-accumulate (wgmma, e4m3 inputs).

Exposed: ``hopper_fp8_mma``, ``K_STEP``, ``MANTISSA_BITS``.

Hopper's FP8 MMA does not accumulate in full float32 ("FP22": SageAttention2, arXiv
2411.10958; DeepSeek-V3 "around 14 bits"). The model below was fitted to the packaged FA3
forward kernel (fa3-fwd 0.0.3) on an H200 with probe inputs that isolate each GEMM (Q = 0
isolates P.V; seqlen_k = 1 exposes S through the log-sum-exp; V = I exposes P). Used for both
GEMMs of the FA3 FP8 forward, it makes 99.99% of the kernel's BF16 outputs bit-identical
(reports/h200/ holds the evidence). Per k-step of 32 products:

- E(x) = floor(log2|x|), with -6 for e4m3 subnormals; a product's exponent is taken as
  E(a) + E(b), the sum of the input exponents (not the product's true exponent);
- emax = max over non-zero products of E(a) + E(b), and E(C) when the accumulator C != 0;
- every product and C are truncated toward zero to multiples of ulp = 2^(emax - 13) and
  summed exactly;
- the sum is truncated toward zero to 13 bits after its own leading bit.

All of this is exact in float32: products of e4m3 values have at most 8 significant bits,
and the scaled terms are integers below 2^21.
"""

from __future__ import annotations

import torch

K_STEP = 32  # K of one FP8 wgmma instruction (m64nNk32)
MANTISSA_BITS = 13
E4M3_MIN_EXP = -6
# Elements of one [.., rows, N, K_STEP] product block; bounds the model's memory.
_BLOCK_ELEMS = 1 << 24


def _exponent(x: torch.Tensor, floor_exp: int | None = None) -> torch.Tensor:
    """floor(log2|x|) as float32 (garbage where x == 0; callers mask zeros)."""
    e = torch.frexp(x)[1].to(torch.float32) - 1
    return e.clamp_min(floor_exp) if floor_exp is not None else e


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e), e.to(torch.int32))


def _truncate_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Truncate toward zero to ``bits`` bits after the leading bit."""
    q = _pow2(_exponent(x) - bits)
    return torch.where(x == 0, x, torch.trunc(x / q) * q)


def hopper_fp8_mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *,
                   a_min_exp: int = E4M3_MIN_EXP, b_min_exp: int = E4M3_MIN_EXP) -> torch.Tensor:
    """D = C + A @ B under the model above. a [.., M, K], b [.., K, N] float32 holding FP8
    values (``*_min_exp``: the format's smallest normal exponent, -6 for e4m3, -14 for
    e5m2); c [.., M, N] float32 or None (a zero-initialised accumulator)."""
    k = a.shape[-1]
    m, n = a.shape[-2], b.shape[-1]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = torch.empty(*lead, m, n, dtype=torch.float32, device=a.device)
    ea_all = _exponent(a, a_min_exp)
    eb_all = _exponent(b, b_min_exp)
    per_row = (int(torch.tensor(lead).prod().item()) if lead else 1) * n * K_STEP
    rows = max(1, _BLOCK_ELEMS // per_row)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        acc = None if c is None else c[..., r0:r1, :].to(torch.float32)
        for k0 in range(0, k, K_STEP):
            k1 = min(k, k0 + K_STEP)
            av = a[..., r0:r1, None, k0:k1]  # [.., r, 1, s]
            bv = b[..., k0:k1, :].transpose(-1, -2).unsqueeze(-3)  # [.., 1, n, s]
            prod = av * bv
            e = ea_all[..., r0:r1, None, k0:k1] + eb_all[..., k0:k1, :].transpose(-1, -2).unsqueeze(-3)
            e = torch.where(prod != 0, e, torch.full_like(e, -1e9))
            emax = e.amax(dim=-1)
            if acc is not None:
                emax = torch.where(acc != 0, torch.maximum(emax, _exponent(acc)), emax)
            live = emax > -1e8
            emax = torch.where(live, emax, torch.zeros_like(emax))
            inv_ulp = _pow2(MANTISSA_BITS - emax)
            total = torch.trunc(prod * inv_ulp.unsqueeze(-1)).sum(dim=-1)
            if acc is not None:
                total = total + torch.trunc(acc * inv_ulp)
            d = torch.where(live, total / inv_ulp, torch.zeros_like(total))
            acc = _truncate_bits(d, MANTISSA_BITS)
        out[..., r0:r1, :] = acc if acc is not None else 0.0
    return out
