"""Triton device functions every quantizer kernel of ``rotate_quant`` shares: the Hadamard rotation
of a tile, the descale from an amax, the scaled saturating cast to FP8, and the work-item order.

Exposed (Triton functions, where triton imports): ``butterfly_stage``, ``rotate_tile``,
``tile_descale``, ``cast_fp8``, ``scale_div``, ``scale_cast``, ``encode_fp8``, ``work_item``, ``opaque``, ``store_subtile``.

``rotate_tile`` takes the rotation as ``ROT`` (0 none, 1 the butterfly, 2 one tensor-core dot with
``hadamard``, the +-1 matrix diag(signs) H loaded once per program) and ``SQRT_D``, a pointer to
[sqrt(d), 1/sqrt(d)] in the working precision: the float64 path divides by sqrt(d) as
``numerics.rotation.fwht`` does, the float32 path multiplies by 1/sqrt(d).
"""

from __future__ import annotations

from ._common import f64_to_f32_odd, pow2_ceil32, pow2_ceil64, round_fp8, tl, triton

if triton is not None:

    @triton.jit
    def butterfly_stage(y, TILE: tl.constexpr, D: tl.constexpr, HH: tl.constexpr):
        """One butterfly stage: pairs (i, i + HH) inside blocks of 2 HH become (a + b, a - b), the
        emulator's fwht order, so float64 results are bit-identical to it."""
        z = tl.permute(tl.reshape(y, (TILE, D // (2 * HH), 2, HH)), (0, 1, 3, 2))
        a, b = tl.split(z)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (TILE, D))

    @triton.jit
    def rotate_tile(x, SIGNS, hadamard, SQRT_D, TILE: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr,
                    ROT: tl.constexpr, EXACT: tl.constexpr, RAW: tl.constexpr = False):
        """x [TILE, D] (input dtype) -> rotated [TILE, D] in float64 (EXACT) or float32. ``hadamard``: the
        +-1 matrix diag(signs) H, loaded once per program (ROT 2). RAW (float32 only): without the
        final multiply by 1/sqrt(d), which the caller applies."""
        cols = tl.arange(0, D)
        if ROT == 2:
            # +-1 entries and BF16/FP16 inputs: every product is exact, the tensor core sums in float32.
            y = tl.dot(x.to(hadamard.dtype), hadamard, out_dtype=tl.float32)
            if not RAW:
                y = y * tl.load(SQRT_D + 1)

        else:
            if EXACT:
                y = x.to(tl.float64)
            else:
                y = x.to(tl.float32)
            if ROT == 1:
                y = y * tl.load(SIGNS + cols)[None, :].to(y.dtype)
                # Stages h = 1, 2, 4, ... written out: a loop variable is not a constexpr in
                # Triton's interpreter, and the reshapes need constant shapes.
                y = butterfly_stage(y, TILE, D, 1)
                y = butterfly_stage(y, TILE, D, 2)
                y = butterfly_stage(y, TILE, D, 4)
                y = butterfly_stage(y, TILE, D, 8)
                if LOG2D > 4:
                    y = butterfly_stage(y, TILE, D, 16)
                if LOG2D > 5:
                    y = butterfly_stage(y, TILE, D, 32)
                if LOG2D > 6:
                    y = butterfly_stage(y, TILE, D, 64)
                if LOG2D > 7:
                    y = butterfly_stage(y, TILE, D, 128)
                if EXACT:
                    y = y / tl.load(SQRT_D)  # x / sqrt(d), as rotation.fwht divides
                elif not RAW:
                    y = y * tl.load(SQRT_D + 1)
        return y

    @triton.jit
    def tile_descale(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr):
        """amax -> float32 descale, as quant.amax_to_scale: amax / max in the working precision,
        1 where it is 0 or not finite, optionally rounded up to a power of two."""
        if EXACT:
            s = amax / FMT_MAX
        else:
            s = tl.math.div_rn(amax, tl.full(amax.shape, FMT_MAX, tl.float32))
        ok = (s > 0) & (s < float("inf"))
        s = tl.where(ok, s, 1.0)
        if POW2:
            if EXACT:
                s = pow2_ceil64(s)
            else:
                s = pow2_ceil32(s)
        return s.to(tl.float32)

    @triton.jit
    def cast_fp8(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                 EXACT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        """y / descale, saturating RNE cast to FP8. ``d32`` broadcasts against y. RECIP multiplies
        by the float32 reciprocal instead of dividing (one FMUL instead of an IEEE division; one
        more rounding)."""
        if EXACT:
            v = f64_to_f32_odd(y / d32.to(tl.float64))
        elif RECIP:
            v = y * tl.math.div_rn(d32 * 0.0 + 1.0, d32)
        else:
            v = tl.math.div_rn(y, d32 + tl.zeros(y.shape, tl.float32))
        if SOFT_CAST:
            v = round_fp8(v, MBITS, EMIN, FMT_MAX)
        else:
            v = tl.minimum(tl.maximum(v, -FMT_MAX), FMT_MAX)
        return v.to(OUT)

    @triton.jit
    def scale_div(y, d32, DIV: tl.constexpr):
        """Fast path's y / descale; ``d32`` (float32) broadcasts against y.

        DIV 0: IEEE division (div_rn). 1: y * (1/descale), one more rounding. 2: y / descale
        correctly rounded from the reciprocal with one Markstein correction (q0 = y r,
        e = fma(q0, -d, y) exact, q = fma(e, r, q0)): the bytes of DIV 0 for three FP32
        instructions per element instead of an IEEE division. Needs a fused multiply-add,
        which Triton's CPU interpreter does not have (it rounds the product), so the
        interpreter takes DIV 0."""
        if DIV == 0:
            v = tl.math.div_rn(y, tl.broadcast_to(d32, y.shape))
        else:
            r = tl.math.div_rn(d32 * 0.0 + 1.0, d32)
            v = y * r
            if DIV == 2:
                # -d per row, not -q0 per element: Triton's negation is 0 - x, one more instruction
                v = tl.fma(tl.broadcast_to(r, y.shape), tl.fma(v, tl.broadcast_to(0.0 - d32, y.shape), y), v)
        return v

    @triton.jit
    def scale_cast(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                   SOFT_CAST: tl.constexpr, DIV: tl.constexpr):
        """``scale_div`` and the saturating cast. No clamp before the cast: cvt.rn.satfinite (and
        round_fp8) saturate by themselves, and NaN stays NaN as in the emulator's cast."""
        v = scale_div(y, d32, DIV)
        if SOFT_CAST:
            v = round_fp8(v, MBITS, EMIN, FMT_MAX)
        return v.to(OUT)

    @triton.jit
    def encode_fp8(v, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, SUBQ: tl.constexpr,
                   NAN: tl.constexpr):
        """float32 already on the FP8 grid (``round_fp8``) -> its byte, by hand: the interpreter's
        cast drops the sign of -0, which the hardware cast keeps. SUBQ = 2^(MBITS - EMIN) scales a
        subnormal to its code; NAN is the format's NaN byte."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        a = tl.abs(v)
        ab = a.to(tl.int32, bitcast=True)
        e = ((ab >> 23) & 0xFF) - 127
        normal = ((e + BIAS) << MBITS) | ((ab >> (23 - MBITS)) & ((1 << MBITS) - 1))
        sub = (a * SUBQ).to(tl.int32)
        code = tl.where(e >= EMIN, normal, sub) | (sign << 7)
        return tl.where(v != v, NAN, code).to(tl.uint8)

    @triton.jit
    def work_item(t, H, NBLK, HEAD_FAST: tl.constexpr):
        """Work item t -> (batch, head, block), heads first or sequence first."""
        if HEAD_FAST:
            bk = t // H
            h = t - bk * H
            b = bk // NBLK
            blk = bk - b * NBLK
        else:
            bh = t // NBLK
            blk = t - bh * NBLK
            b = bh // H
            h = bh - b * H
        return b, h, blk

    @triton.jit
    def opaque(x):
        """x unchanged, through an identity the compiler cannot see through: a tensor that does not
        come from a load or a loop-carried value is the A operand of wgmma in registers (Triton keeps
        the others in shared memory)."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=True, pack=2)

    @triton.jit
    def store_subtile(y, d32, yr, offy, r0, sub, end, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr,
                      OUT: tl.constexpr, SOFT_CAST: tl.constexpr, DIV: tl.constexpr):
        """Cast a sub-tile whose first row is r0 and store it at ``yr`` (that row's address) +
        ``offy``; rows r0 + sub < end only."""
        q = scale_cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
        tl.store(yr + offy, q, mask=((r0 + sub) < end)[:, None])
