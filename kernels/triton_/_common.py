"""Triton device helpers shared by the fused quantizer and the attention kernel.

Exposed: ``FP8``, ``fp8_params``, ``round_fp8`` (also used for BF16/FP16 outputs, which the
interpreter truncates instead of rounding: 50% of N(0, 1) values land one BF16 ulp low),
``f64_to_f32_odd``, ``pow2_ceil32``, ``pow2_ceil64``, ``triton_problem``, ``interpreting``.

Two casts to FP8 exist on purpose. The hardware cast (``x.to(tl.float8e4nv)``, which Triton
lowers to ``cvt.rn.satfinite`` on sm_89+) is what the kernels use on a GPU. Triton's CPU
interpreter (``TRITON_INTERPRET=1``) casts float32 to FP8 wrongly (measured with triton 3.6:
500 -> 256, 464 -> NaN, and 94 of 4096 values of N(0, 100) rounded differently from
round-to-nearest-even), but converts values already on the FP8 grid exactly. ``round_fp8``
rounds to the grid in float32 arithmetic (RNE, saturating), so with ``SOFT_CAST`` the kernels
compute the same bytes on the interpreter as on the GPU; the device tests check that the two
casts agree on the hardware.
"""

from __future__ import annotations

import dataclasses
import os

import torch

try:  # the kernels' module imports without triton so that `supports()` works everywhere
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


@dataclasses.dataclass(frozen=True)
class FP8:
    name: str
    mbits: int
    emin: int
    max: float
    torch_dtype: torch.dtype


FP8_FORMATS = {"e4m3": FP8("e4m3", 3, -6, 448.0, torch.float8_e4m3fn),
               "e5m2": FP8("e5m2", 2, -14, 57344.0, torch.float8_e5m2)}


def fp8_params(name: str) -> FP8:
    return FP8_FORMATS[name]


def tl_fp8(name: str):
    return {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}[name]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter turns scalar tensors into ints with ``int(ndarray)``, which numpy
    >= 2.4 refuses for 1-element arrays of rank 1 (every runtime loop bound fails). Index the one
    element instead. Only ever active under TRITON_INTERPRET."""
    from triton.runtime import interpreter as it

    orig = getattr(it, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fa3_compat", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._fa3_compat = True
    it._patch_lang_tensor = patched


if triton is not None and interpreting():
    _interpreter_numpy_compat()


def triton_problem(device: str = "cuda") -> str | None:
    """None when the Triton kernels can run on ``device``, else what is missing and the fix."""
    if triton is None:
        return "the triton package is not installed (pip install triton; it ships with CUDA builds of torch)"
    if interpreting():
        return None  # the CPU interpreter runs them (slowly), with SOFT_CAST
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible (the Triton FP8 kernels need an FP8 tensor core: sm_89 or newer, "
                "validated on H200)")
    if not str(device).startswith("cuda"):
        return f"--device {device}: the Triton kernels run on the GPU; pass --device cuda"
    idx = torch.device(device).index
    cap = torch.cuda.get_device_capability(idx)
    if cap < (8, 9):
        return (f"{torch.cuda.get_device_name(idx)} is sm_{cap[0]}{cap[1]}: FP8 tensor-core dots need sm_89+ "
                f"(validated on Hopper, sm_90)")
    return None


if triton is not None:

    @triton.jit
    def round_fp8(x, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr, ECAP: tl.constexpr = 20):
        """float32 -> float32 on a narrow format's grid (MBITS mantissa bits, smallest normal
        exponent EMIN): round to nearest even, saturating at MAXV (as cvt.rn.satfinite). ECAP
        bounds the exponent used for the rounding constant: above the format's range only
        saturation matters (keep ECAP > log2(MAXV) and <= 104 + MBITS)."""
        a = tl.abs(x)
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        # Below the normal range the quantum stays at the subnormal step; above the format's
        # range every value saturates, so capping e keeps the magic constant finite.
        e = tl.minimum(tl.maximum(e, EMIN), ECAP)
        # Adding 2^(e - MBITS + 23) leaves exactly the bits of a multiple of the quantum
        # 2^(e - MBITS) in the float32 sum, rounded to nearest even by the FP unit.
        magic = ((e - MBITS + 23 + 127) << 23).to(tl.float32, bitcast=True)
        r = (a + magic) - magic
        r = tl.minimum(r, MAXV)
        # The sign from the bits, so that -0.0 stays -0.0 as the hardware cast keeps it.
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def f64_to_f32_odd(x):
        """float64 -> float32 rounding to odd, so that a later RNE cast to FP8 rounds once
        (the emulator's ``to_float32_round_odd``)."""
        y = x.to(tl.float32)
        back = y.to(tl.float64)
        bits = y.to(tl.int32, bitcast=True)
        fix = (back != x) & ((bits & 1) == 0) & (tl.abs(back) < float("inf"))
        step = tl.where(tl.abs(back) > tl.abs(x), -1, 1)
        return tl.where(fix, bits + step, bits).to(tl.float32, bitcast=True)

    @triton.jit
    def pow2_ceil64(s):
        """2^ceil(log2 s) for finite s > 0, from the bits (exact; torch's log2 agrees except within
        one float64 ulp above a power of two)."""
        bits = s.to(tl.int64, bitcast=True)
        mant = bits & 0xFFFFFFFFFFFFF
        expo = (bits >> 52) & 0x7FF
        expo = tl.where(mant != 0, expo + 1, expo)
        return (expo << 52).to(tl.float64, bitcast=True)

    @triton.jit
    def pow2_ceil32(s):
        bits = s.to(tl.int32, bitcast=True)
        mant = bits & 0x7FFFFF
        expo = (bits >> 23) & 0xFF
        expo = tl.where(mant != 0, expo + 1, expo)
        return (expo << 23).to(tl.float32, bitcast=True)

else:  # pragma: no cover
    round_fp8 = f64_to_f32_odd = pow2_ceil64 = pow2_ceil32 = None
