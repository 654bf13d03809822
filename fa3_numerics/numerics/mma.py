"""A model of Hopper's FP8 tensor-core matrix multiply-accumulate (wgmma, e4m3/e5m2 inputs).

Exposed: ``MmaModel``, ``FP8_MMA``, ``BF16_MMA``, ``model_for``, ``hopper_mma``,
``hopper_fp8_mma``, ``hopper_fp8_mma_reference``, ``operand_parts``, ``K_STEP``, ``MANTISSA_BITS``,
``DEVICE_MMA``, ``register_device_mma``, ``device_mma``.

Hopper's FP8 MMA does not accumulate in full float32 ("FP22": SageAttention2, arXiv
2411.10958; DeepSeek-V3 "around 14 bits"). The model below was fitted to the packaged FA3
forward kernel (fa3-fwd 0.0.3) on an H200 with probe inputs that isolate each GEMM (Q = 0
isolates P.V; seqlen_k = 1 exposes S through the log-sum-exp; V = I exposes P). Used for both
GEMMs of the FA3 FP8 forward, it makes 99.99% of the kernel's BF16 outputs bit-identical
(reports/h200/ holds the evidence). Per k-step of 32 products:

- E(x) = floor(log2|x|), clamped below at the format's smallest normal exponent (-6 for
  e4m3 subnormals); a product's exponent is taken as E(a) + E(b), the sum of the input
  exponents (not the product's true exponent);
- emax = max over non-zero products of E(a) + E(b), and E(C) when the accumulator C != 0;
- every product and C are truncated toward zero to multiples of ulp = 2^(emax - 13) and
  summed exactly;
- the sum is truncated toward zero to 13 bits after its own leading bit.

Exact integer form (the fast paths compute the same integers in floats: a b 2^(13 - emax) is exact in
float32 for FP8 operands and truncates by one conversion). Write each operand as x = S(x) 2^(E(x) - 7)
with S(x) an integer of at most 8 bits (|S| < 256 for every format with <= 7 mantissa bits,
subnormals included, because E is clamped at the smallest normal exponent). A product is then
S(a) S(b) 2^(E(a) + E(b) - 14) and, in units of the step's ulp,

    term = trunc(S(a) S(b) / 2^(1 + emax - E(a) - E(b)))

an integer below 2^15 in magnitude, so a step's sum (32 terms and C) fits in an int32.

Three implementations compute the same numbers bit for bit (tests/numerics/test_mma.py enumerates edge
cases and random draws): ``hopper_fp8_mma_reference`` in plain PyTorch (any device, float64
where exponents would leave the float32 range), a compiled fast path
(``fa3_numerics.numerics.native``: C with OpenMP on the CPU, built on first use) that
``hopper_fp8_mma`` uses when it is available, and a Triton kernel for CUDA tensors
(``kernels/triton_/mma_model.py``; tests/kernels/test_mma_triton.py), which ``hopper_fp8_mma`` and
``hopper_mma`` (both models) use when triton imports. The core does not import it: it is found
through the ``DEVICE_MMA`` registry (``device_mma``), where the kernels package registers it. Each fast path hands non-finite operands
to the reference.

The 16-bit tensor core (BF16/FP16 operands, wgmma k16) follows the same scheme with other
constants, fitted to the FA3 BF16 kernel on an H200 (tools/device/dump_stress.py probes:
Sk = 1 exposes S = q.k in float32 through the log-sum-exp): k-steps of 16 products, terms
truncated at 2^(emax - 25), the sum truncated to 23 bits after its leading bit (the float32
precision, truncated rather than rounded). It reproduces 85% of those float32 S values
exactly (exact float32 rounding of the true dot product: 10%) and the rest within one ulp,
and it brings the emulator of the BF16 kernel from F = 0.046 to 0.0045 at seqlen 8192
(reports/h200/). ``MmaModel`` holds the constants; ``model_for`` picks them by format.

Subnormal accumulators: the FA3 kernel is compiled with ``--use_fast_math`` and so flushes
float32 subnormals to zero in the multiply that rescales O between KV tiles; the emulator
models that flush before calling this function (``recipe.ftz``). The model itself is finite
for any finite C, subnormal or not.
"""

from __future__ import annotations

import dataclasses

import torch

from .formats import Format

K_STEP = 32  # K of one FP8 wgmma instruction (m64nNk32)
MANTISSA_BITS = 13
E4M3_MIN_EXP = -6
# Exponent given to zeros: below any E(a) + E(b) of non-zero operands, so they never set emax.
ZERO_EXP = -4096
# Elements of one [.., rows, N, K_STEP] product block in the reference; bounds its memory. Each
# float64 temporary of a block is 2 MB: below glibc's mmap threshold, so the allocator reuses it
# instead of mapping and zeroing fresh pages per operation (at 1 << 24, 128 MB temporaries made a
# per-token decode pass spend most of its time in the kernel: 5.8 s system of 13 s wall). Rows of
# a block are independent, so the results do not depend on it.
_BLOCK_ELEMS = 1 << 18


def operand_parts(x: torch.Tensor, min_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, S) as int32 with x = S * 2^(E - 7) exactly: E = floor(log2|x|) clamped at
    ``min_exp`` (ZERO_EXP for zeros), S a signed integer with |S| < 256."""
    if x.dtype != torch.float32 or min_exp < -126:
        e = (torch.frexp(x)[1] - 1).clamp_min(min_exp)
        zero = x == 0
        s = torch.ldexp(x.to(torch.float64), (7 - e).to(torch.float64))
        e = torch.where(zero, torch.full_like(e, ZERO_EXP), e)
        return e.to(torch.int32), torch.where(zero, torch.zeros_like(s), s).to(torch.int32)
    # float32 holding FP8 values: every non-zero one is a normal float32, so E and the 24-bit
    # significand come straight from the bits (10x faster than frexp/ldexp in float64).
    bits = x.contiguous().view(torch.int32)
    field = (bits >> 23) & 0xFF
    e_true = field - 127
    e = e_true.clamp_min(min_exp)
    sig = (bits & 0x7FFFFF) | 0x800000
    mag = sig >> (16 + e - e_true).clamp_max(31)
    s = torch.where(bits < 0, -mag, mag)
    zero = field == 0  # +-0 (no FP8 value is a float32 subnormal)
    return torch.where(zero, ZERO_EXP, e), torch.where(zero, 0, s)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) as float64 (garbage where x == 0; callers mask zeros)."""
    return (torch.frexp(x)[1] - 1).to(torch.float64)


def _truncate_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Truncate (float64) toward zero to ``bits`` bits after the leading bit."""
    q = torch.exp2(_exponent(x) - bits)
    return torch.where(x == 0, x, torch.trunc(x / q) * q)


@dataclasses.dataclass(frozen=True)
class MmaModel:
    """Constants of one tensor-core accumulation model (see the module docstring)."""

    k_step: int  # products per aligned step (the K of one MMA instruction)
    bits: int  # terms are truncated at 2^(emax - bits)
    final_bits: int  # the step's sum is truncated to this many bits after its leading bit


FP8_MMA = MmaModel(K_STEP, MANTISSA_BITS, MANTISSA_BITS)  # e4m3/e5m2 wgmma (FP22)
BF16_MMA = MmaModel(16, 25, 23)  # bf16/fp16 wgmma


def model_for(*fmts) -> MmaModel | None:
    """The fitted model for these operand formats (``Format`` objects), or None when the
    formats have no tensor-core model (e.g. float32 operands: an ideal product)."""
    # Only the FP8 and 16-bit float formats were fitted; integer formats (exact products) and
    # microscaling elements (E2M1: Blackwell's block-scaled MMA) have no model here.
    if not all(isinstance(f, Format) for f in fmts):
        return None
    if all(f.name in ("e4m3", "e5m2") for f in fmts):
        return FP8_MMA
    if all(f.name in ("bf16", "fp16") for f in fmts):
        return BF16_MMA
    return None


def hopper_fp8_mma_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *,
                             a_min_exp: int = E4M3_MIN_EXP, b_min_exp: int = E4M3_MIN_EXP,
                             model: MmaModel = FP8_MMA) -> torch.Tensor:
    """D = C + A @ B under the model, in plain PyTorch. a [.., M, K], b [.., K, N] float32
    holding FP8 values (``*_min_exp``: the format's smallest normal exponent, -6 for e4m3,
    -14 for e5m2; -126 for bf16 with ``model=BF16_MMA``); c [.., M, N] float32 or None (a
    zero-initialised accumulator).

    The aligned terms are formed in float64: 2^(13 - emax) leaves the float32 range once
    E(C) < -114, which a small accumulator reaches (it did, as NaN = inf / inf, before).
    Products of two 16-bit values (at most 22 significant bits) are exact there too."""
    k = a.shape[-1]
    m, n = a.shape[-2], b.shape[-1]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = torch.empty(*lead, m, n, dtype=torch.float32, device=a.device)
    ea_all = _exponent(a).clamp_min(a_min_exp)
    eb_all = _exponent(b).clamp_min(b_min_exp)
    step = model.k_step
    per_row = (int(torch.tensor(lead).prod().item()) if lead else 1) * n * step
    rows = max(1, _BLOCK_ELEMS // per_row)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        acc = None if c is None else c[..., r0:r1, :].to(torch.float32)
        for k0 in range(0, k, step):
            k1 = min(k, k0 + step)
            av = a[..., r0:r1, None, k0:k1].to(torch.float64)  # [.., r, 1, s]
            bv = b[..., k0:k1, :].transpose(-1, -2).unsqueeze(-3).to(torch.float64)  # [.., 1, n, s]
            prod = av * bv  # exact: two values of at most 8 significant bits
            e = ea_all[..., r0:r1, None, k0:k1] + eb_all[..., k0:k1, :].transpose(-1, -2).unsqueeze(-3)
            e = torch.where(prod != 0, e, torch.full_like(e, float(ZERO_EXP)))
            emax = e.amax(dim=-1)
            if acc is not None:
                emax = torch.where(acc != 0, torch.maximum(emax, _exponent(acc)), emax)
            live = emax > ZERO_EXP
            emax = torch.where(live, emax, torch.zeros_like(emax))
            inv_ulp = torch.exp2(model.bits - emax)
            total = torch.trunc(prod * inv_ulp.unsqueeze(-1)).sum(dim=-1)
            if acc is not None:
                total = total + torch.trunc(acc.to(torch.float64) * inv_ulp)
            d = torch.where(live, total / inv_ulp, torch.zeros_like(total))
            acc = _truncate_bits(d, model.final_bits).to(torch.float32)
        out[..., r0:r1, :] = acc if acc is not None else 0.0
    return out


def hopper_mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *, a_fmt, b_fmt) -> torch.Tensor:
    """D = C + A @ B under the tensor-core model of the operand formats (``Format`` objects;
    see ``model_for``), with float32 products and sum when there is none."""
    model = model_for(a_fmt, b_fmt)
    if model is None:
        d = torch.matmul(a, b)
        return d if c is None else c + d
    if model == FP8_MMA:
        return hopper_fp8_mma(a, b, c, a_min_exp=a_fmt.emin, b_min_exp=b_fmt.emin)
    fast = _device_fast(a.device)
    if fast is not None:
        d = fast(a, b, c, a_min_exp=a_fmt.emin, b_min_exp=b_fmt.emin, model=model)
        if d is not None:
            return d
    return _general_or_reference(a, b, c, a_fmt.emin, b_fmt.emin, model)


#: name -> "module:function" of a fast implementation of the model on a device: the function
#: takes a torch.device and returns the implementation (``mma(a, b, c, a_min_exp=, b_min_exp=,
#: model=)``, same numbers as the reference, None for operands it hands back) or None where it
#: cannot run. The core names no implementation: plug-ins register one here or through an entry
#: point of the group ``DEVICE_MMA_GROUP`` (the Triton kernel of kernels/triton_/mma_model.py is
#: registered that way in pyproject.toml), read on the first CUDA call.
DEVICE_MMA: dict[str, str] = {}
DEVICE_MMA_GROUP = "fa3_numerics.device_mma"
_device_mma_loaded = False


def register_device_mma(name: str, target: str) -> None:
    """Register a device implementation of the model: ``target`` is "module:function" (see
    ``DEVICE_MMA``); it is imported on first use."""
    DEVICE_MMA[name] = target


def device_mma_names() -> list[str]:
    """Every registered device implementation, entry points included."""
    global _device_mma_loaded
    if not _device_mma_loaded:
        _device_mma_loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=DEVICE_MMA_GROUP):
            DEVICE_MMA.setdefault(ep.name, ep.value)
    return list(DEVICE_MMA)


def device_mma(device) -> tuple[str, object] | None:
    """(name, implementation) of the first registered device implementation that runs on
    ``device``, else None (then the compiled C or the reference computes the model). CPU
    tensors never ask: the registered implementations (and triton's import, a second) are for
    CUDA only."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    import importlib

    for name in device_mma_names():
        mod, fn = DEVICE_MMA[name].split(":")
        try:
            impl = getattr(importlib.import_module(mod), fn)(device)
        except ImportError:
            continue
        if impl is not None:
            return name, impl
    return None


def _device_fast(device):
    found = device_mma(device)
    return found[1] if found is not None else None


def hopper_fp8_mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *,
                   a_min_exp: int = E4M3_MIN_EXP, b_min_exp: int = E4M3_MIN_EXP) -> torch.Tensor:
    """D = C + A @ B under the model (see the module docstring); same arguments and results
    as ``hopper_fp8_mma_reference``, through the fastest exact implementation available."""
    from . import native

    fast = native.mma(a.device)
    if fast is not None:
        d = fast(a, b, c, a_min_exp=a_min_exp, b_min_exp=b_min_exp)
        if d is not None:  # None: a non-finite operand, which only the reference propagates
            return d
    gpu = _device_fast(a.device)
    if gpu is not None:
        d = gpu(a, b, c, a_min_exp=a_min_exp, b_min_exp=b_min_exp, model=FP8_MMA)
        if d is not None:  # None: a non-finite operand or a float32 overflow mid-chain
            return d
    return _general_or_reference(a, b, c, a_min_exp, b_min_exp, FP8_MMA)


def _general_or_reference(a, b, c, a_min_exp, b_min_exp, model):
    """The compiled double-precision form of the reference (any finite float32 operands: FP8 V times
    a per-token descale, 16-bit operands) where it runs, else the reference itself; same numbers."""
    from . import native

    general = native.mma_general(a.device)
    if general is not None:
        d = general(a, b, c, a_min_exp=a_min_exp, b_min_exp=b_min_exp, model=model)
        if d is not None:  # None: a non-finite or float64 operand, which only the reference takes
            return d
    return hopper_fp8_mma_reference(a, b, c, a_min_exp=a_min_exp, b_min_exp=b_min_exp, model=model)
