"""Models of the P.V accumulator of the flash algorithm.

Exposed: ``ACCUMULATORS``, ``accumulator_names``, ``register_accumulator``, ``get_accumulator``,
``hopper_mma_on``, ``accumulator_for``, ``FlushEvery``.

An accumulator is ``fn(acc, p, v, fmts) -> acc``: ``acc`` [.., R, Dv] float32 holds the
running output already multiplied by this KV tile's online-softmax correction (the kernel's
``rescale_o``, a float32 multiply that the emulator performs, flush-to-zero included), ``p``
[.., R, bn] and ``v`` [.., bn, Dv] are the tile's P (already cast) and V as float32,
``fmts`` the (P, V) formats. It returns acc + P V under its model, and may update ``acc``
in place (the emulator's own buffer).

- ``fp32``: acc + P V with a float32 sum (an ideal tensor core).
- ``fp22``: Hopper's tensor core as fitted to the FA3 kernel (``fa3_numerics.numerics.mma``): the
  O registers are the MMA accumulator, chained through every k-step of every tile with
  aligned, truncating accumulation: 13 bits per 32 keys for FP8 operands (the "FP22" of
  SageAttention2), 25 bits per 16 keys for BF16/FP16. With this model the S = Q K^T product
  is modelled the same way (see the emulator).
- ``two-level``: the same MMA model inside a KV tile from a zero accumulator, then added into
  a float32 accumulator across tiles (the fix proposed upstream and in vLLM's fork).

The MMA models apply to FP8 and BF16/FP16 operands; with float32 P or V they fall back to
float32.

``flush=N`` with ``acc=fp22`` (``keys/flush.py``, ``FlushEvery``) keeps the MMA chain running for
N KV tiles and then adds it into a float32 accumulator: vLLM's fork of FA3 (``two-level``, one
tile, vllm-project/flash-attention #104; every N tiles, #122, merged and later reverted there).
``flush=1`` is ``two-level`` bit for bit. A stateful accumulator like this one has ``rescale``
(the emulator calls it with each tile's online-softmax factor, for the part it holds) and
``finish`` (after the last tile); ``accumulator_for`` gives a fresh one per emulation.
"""

from __future__ import annotations

from typing import Callable

import torch

from .formats import Format
from .mma import hopper_mma, model_for

Accumulator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple], torch.Tensor]

_REGISTRY: dict[str, tuple[Accumulator, str]] = {}


def register_accumulator(name: str, description: str):
    def deco(fn: Accumulator) -> Accumulator:
        _REGISTRY[name] = (fn, description)
        return fn

    return deco


def get_accumulator(name: str) -> Accumulator:
    from ..errors import UsageError

    if name not in _REGISTRY:
        raise UsageError(f"unknown accumulator {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return _REGISTRY[name][0]


def hopper_mma_on(acc: str, *fmts: Format) -> bool:
    """True when a Hopper tensor-core model applies: an MMA-modelling accumulator and operands
    with a fitted model (FP8, or BF16/FP16; see ``mma.model_for``)."""
    return acc in ("fp22", "two-level") and model_for(*fmts) is not None


def _mma(p, v, c, fmts):
    return hopper_mma(p, v, c, a_fmt=fmts[0], b_fmt=fmts[1])


@register_accumulator("fp32", "float32 accumulation (an ideal tensor core)")
def fp32(acc, p, v, fmts):
    # acc is the emulator's own buffer. acc + P V in one call (baddbmm, beta = 1) where the BLAS
    # adds acc to the finished float32 product, as the separate product and add do: then the
    # tile's product needs no buffer of its own and no second pass (the emulator's largest
    # temporaries on the CPU); elsewhere the product and the add.
    if _fused_add_same(acc, p, v):
        lead = acc.shape[:-2]
        acc.view(-1, *acc.shape[-2:]).baddbmm_(p.reshape(-1, *p.shape[-2:]), v.reshape(-1, *v.shape[-2:]))
        return acc.view(*lead, *acc.shape[-2:])
    return acc.add_(torch.matmul(p, v))


_FUSED_SAME: dict = {}


def _fused_add_same(acc: torch.Tensor, p: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``acc.baddbmm_(p, v)`` gives the bits of ``acc.add_(p @ v)`` here: CPU float32 tensors
    of one batch shape, and a probe of the same GEMM shape that agrees (a BLAS that adds C part-way
    through the k loop rounds otherwise: MKL does beyond ~400 keys; checked once per shape and
    thread count)."""
    if not (acc.device.type == "cpu" and acc.dtype == p.dtype == v.dtype == torch.float32 and acc.is_contiguous()
            and p.dim() >= 3 and p.shape[:-2] == v.shape[:-2] == acc.shape[:-2]):
        return False
    m, k, n = p.shape[-2], p.shape[-1], v.shape[-1]
    key = (m, k, n, torch.get_num_threads())
    if key not in _FUSED_SAME:
        g = torch.Generator().manual_seed(m * 7919 + k * 131 + n)
        pp, vv = torch.rand(2, m, k, generator=g), torch.randn(2, k, n, generator=g)
        c = torch.randn(2, m, n, generator=g)
        _FUSED_SAME[key] = torch.equal(c.clone().add_(torch.matmul(pp, vv)), c.clone().baddbmm_(pp, vv))
    return _FUSED_SAME[key]


@register_accumulator("fp22", "Hopper tensor-core model: aligned truncating accumulation (FP8: 13 bits per "
                              "32-key k-step; BF16/FP16: 25 bits per 16), chained across tiles (matches the FA3 "
                              "kernel)")
def fp22(acc, p, v, fmts):
    if not hopper_mma_on("fp22", *fmts):
        return fp32(acc, p, v, fmts)
    return _mma(p, v, acc, fmts)


@register_accumulator("two-level", "Hopper FP8 MMA model within a KV tile, float32 across tiles")
def two_level(acc, p, v, fmts):
    if not hopper_mma_on("two-level", *fmts):
        return fp32(acc, p, v, fmts)
    return acc + _mma(p, v, None, fmts)


ACCUMULATORS = {name: desc for name, (_, desc) in _REGISTRY.items()}


class FlushEvery:
    """P V in the Hopper MMA model (``fp22``) for ``tiles`` KV tiles, then added into the float32
    accumulator (the emulator's ``acc``), the chain restarting from zero.

    vllm-project/flash-attention #122 (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp, softmax.h) keeps
    the MMA accumulator ``tOrO`` rescaled every tile, a second float32 fragment ``tOrO_accum`` with
    a deferred scale (the product of the tiles' factors since the last merge), and merges every
    ``FLASHATTENTION_FP8_TWO_LEVEL_INTERVAL`` tiles (default 4) as
    ``accum = scale * accum + tOrO``, clearing ``tOrO``. This model rescales the float32 part every
    tile instead (the emulator's own float32 multiply, flush-to-zero included), so that ``tiles=1`` is
    ``two-level`` bit for bit; the two orders differ by float32 roundings (2^-24 relative), far
    below the chain's 13 bits. #104's per-tile version (``flash::gemm`` with a backup of C) is
    ``two-level``."""

    def __init__(self, tiles: int, ftz: bool = True):
        from ..errors import require

        require(tiles >= 1, f"flush={tiles}: the MMA chain is flushed every N >= 1 KV tiles")
        self.tiles, self.ftz = int(tiles), ftz
        self.chain: torch.Tensor | None = None  # the MMA accumulator (tOrO), None = cleared
        self.count = 0

    def rescale(self, rescale: torch.Tensor) -> None:
        """This tile's online-softmax factor applied to the chain, as the kernel's rescale_o."""
        if self.chain is not None:
            from .emulator import flush_subnormals

            scaled = self.chain * rescale
            self.chain = flush_subnormals(scaled) if self.ftz else scaled

    def __call__(self, acc, p, v, fmts):
        if not hopper_mma_on("fp22", *fmts):
            return fp32(acc, p, v, fmts)
        self.chain = _mma(p, v, self.chain, fmts)
        self.count += 1
        if self.count % self.tiles == 0:
            acc = acc + self.chain
            self.chain = None
        return acc

    def finish(self, acc: torch.Tensor) -> torch.Tensor:
        """The chain's remainder added in after the last tile (#122's ``final_merge_accum``)."""
        if self.chain is not None:
            acc = acc + self.chain
            self.chain = None
        return acc


def accumulator_for(recipe) -> Accumulator:
    """The accumulator one emulation of ``recipe`` uses: ``FlushEvery`` (fresh state) for
    ``acc=fp22`` with ``flush=N``, else the registered function of ``recipe.acc``."""
    n = int(getattr(recipe, "flush", 0) or 0)
    if n and recipe.acc == "fp22":
        return FlushEvery(n, ftz=bool(getattr(recipe, "ftz", True)))
    return get_accumulator(recipe.acc)


def accumulator_names() -> list[str]:
    """Every registered accumulator (the recipe's ``acc`` vocabulary); ``ACCUMULATORS`` is the
    snapshot of the FA3 kernel's models that ``validate`` runs."""
    return list(_REGISTRY)


# -- SageAttention v1: FP16 accumulation of P V ----------------------------------------------
# Registered after the ``ACCUMULATORS`` snapshot above on purpose: that dict is the list of
# models of the FA3 kernel's accumulator that ``validate`` runs by default, and FP16
# accumulation is not one (the FA3 FP8 kernel accumulates in FP22/FP32). ``get_accumulator``
# and the recipe's ``acc`` vocabulary (``accumulator_names``) include it; a recipe check
# (``keys/acc_fp16.py``) refuses it unless P and V are FP16, the only operands it takes.

FP16_K_STEP = 16  # K of the FP16 MMA (mma.sync m16n8k16 ... f16.f16.f16.f16)


def fp16_mma(p: torch.Tensor, v: torch.Tensor, k_step: int = FP16_K_STEP) -> torch.Tensor:
    """P V for one KV tile with an FP16 accumulator: p [.., R, n], v [.., n, Dv] holding FP16
    values -> float32 [.., R, Dv] holding FP16 values.

    The accumulator starts at zero and after every MMA of ``k_step`` keys holds
    fp16(C + sum of the k_step products), rounded to nearest even and overflowing to inf
    past 65504 as IEEE FP16 does. How the tensor core rounds an FP16 accumulation inside
    one instruction is not public; this model takes the exact sum and rounds once per
    instruction (the sum is formed in float64: FP16 products are exact there, and their
    sum is exact unless its terms span more than 53 bits, far below an FP16 ulp).
    """
    from .formats import round_to_format

    n = p.shape[-1]
    acc = None
    for k0 in range(0, n, k_step):
        part = torch.matmul(p[..., k0:k0 + k_step].to(torch.float64), v[..., k0:k0 + k_step, :].to(torch.float64))
        acc = round_to_format(part if acc is None else acc + part, "fp16")
    if acc is None:
        return torch.zeros((*p.shape[:-1], v.shape[-1]), dtype=torch.float32, device=p.device)
    return acc.to(torch.float32)


@register_accumulator("fp16", "SageAttention v1: P V of each KV tile accumulated in FP16 (rounded after every "
                              "16-key MMA), added into a float32 accumulator across tiles")
def fp16(acc, p, v, fmts):
    # thu-ml/SageAttention sageattention/triton/attn_qk_int8_per_block.py: ``acc = acc * alpha``
    # in float32 (the emulator's rescale, done before this call), then
    # ``acc += tl.dot(p.to(tl.float16), v, out_dtype=tl.float16)`` per 64-key block (BLOCK_N):
    # FP16 accumulation within a tile, float32 across tiles. The CUDA kernels'
    # pv_accum_dtype="fp16" mode (sageattention/core.py), which keeps O in FP16 across all
    # tiles, is not modelled.
    return acc + fp16_mma(p, v)


def fp16_hopper_mma(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P V for one KV tile on Hopper's FP16-accumulating wgmma (``m64nNk16.f16.f16.f16``, what
    Triton 3.6 emits for SageAttention 1's ``tl.dot(p, v, out_dtype=tl.float16)``): p [.., R, n],
    v [.., n, Dv] holding FP16 values -> float32 [.., R, Dv] holding FP16 values.

    From a zero accumulator, every 16 keys: D = the 16-bit tensor-core step of ``mma.BF16_MMA``
    on (C, 16 products) -- terms truncated at 2^(emax - 25), the sum truncated to 23 bits, as the
    FP32-accumulating form computes it -- then rounded to FP16, nearest even (inf past 65504).
    Fitted to sageattn on an H200 with probes whose P~ is known exactly (reports/h200/sage1/):
    it reproduces 131,064 of 131,072 tile products with P~ powers of two and 131,058 of 131,072
    with general P~ (one FP16 rounding of the exact sum per 16 keys, the ``fp16`` model: 14 and
    21 misses; a float32 sum rounded once: 32% and 33% misses)."""
    from .formats import get_format
    from .mma import BF16_MMA

    fp16 = get_format("fp16")
    acc = None
    for k0 in range(0, p.shape[-1], BF16_MMA.k_step):
        d = hopper_mma(p[..., k0:k0 + BF16_MMA.k_step], v[..., k0:k0 + BF16_MMA.k_step, :], acc, a_fmt=fp16,
                       b_fmt=fp16)
        acc = d.to(torch.float16).to(torch.float32)  # IEEE: nearest even, inf past 65504
    if acc is None:
        return torch.zeros((*p.shape[:-1], v.shape[-1]), dtype=torch.float32, device=p.device)
    return acc


@register_accumulator("fp16-hopper", "SageAttention v1 on Hopper: P V of each KV tile on the FP16-accumulating "
                                     "wgmma (16-bit MMA step, then FP16 rounding, every 16 keys), added into a "
                                     "float32 accumulator across tiles")
def fp16_hopper(acc, p, v, fmts):
    return acc + fp16_hopper_mma(p, v)
