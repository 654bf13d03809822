"""The Hopper tensor-core MMA model (``fa3_numerics.numerics.mma``) as a Triton kernel, for CUDA.

Exposed: ``available``, ``for_device``, ``mma``, ``mma_raw``, ``Tile``, ``STATS``.

``mma(a, b, c, a_min_exp=, b_min_exp=, model=)`` computes exactly what
``mma.hopper_fp8_mma_reference`` computes (D = C + A @ B, aligned truncating sums per k-step),
bit for bit, for finite operands; it returns None for a non-finite operand or accumulator, and
for a sum that overflows float32 mid-chain, so that the caller runs the reference, which
propagates those as it always has. ``numerics/mma.py`` calls it for CUDA tensors when triton
imports (``FA3N_TRITON_MMA=0`` turns it off). tests/kernels/test_mma_triton.py compares the two.

Why floats rather than the docstring's integer significands. The model's term for one product is
trunc(a b 2^(bits - emax)), with emax the largest E(a) + E(b) of the step (or E(C)). On the GPU
the fused multiply-add pipe issues twice as many lanes per clock as the integer pipe, and every
step of the term has an exact floating-point form there:

- emax: the maximum of 2^E(a) * 2^E(b) (a multiply and a max; powers of two multiply exactly);
- the product: |a| * b is exact in float32 for FP8 values (at most 4 + 4 significant bits,
  |E| <= 16: no underflow);
- the truncation: fma.rz(|a| b, 2^(bits - emax), copysign(2^23, b)) adds a magic number of the
  product's own sign and rounds toward zero, so that the sum is sign(b) (2^23 + floor(|a b| s))
  exactly; subtracting the magic number leaves trunc(|a| b s), and a multiply-add by sign(a)
  (+-1, one per row and k, not per product) accumulates the signed term. |term| < 2^(bits + 2)
  (|a b| < 2^(E(a) + E(b) + 2) <= 2^(emax + 2)), so 32 terms sum exactly in float32 (< 2^20).

That is six instructions per product (two for emax, four for the term: the sign of a, |a| and
the magic number come precomputed from ``_prep_kernel``, which also zero-pads every operand to
whole tiles and k-steps so that the inner loops load without masks), against about twelve
integer ones (the C code's). Per output and step the rest is integer and float64 bit work, as in
``_native.c``: C's term from its bits (C may be a float32 subnormal, or far below emax: its term
truncates to 0; or far above: the products' terms do), the sum truncated to ``final_bits`` + 1
significant bits by masking a float64, scaled by 2^(emax - bits) built from bits, and rounded to
float32 by the hardware's cvt.rn (subnormal results round as ``.to(torch.float32)`` does in the
reference).

The float32 form needs operands whose products are exact in float32 and whose powers 2^E stay
normal: at most 12 significant bits and -50 <= E <= 60, which every FP8 value satisfies. The
prepare pass flags any other operand, and the call then runs the same kernels in float64, where
every finite float32 operand multiplies exactly; the 16-bit model (``BF16_MMA``: terms up to
2^27, 16 of them) always runs in float64.

Two kernels share the tile body (``_mma_tile``): a Gluon one (the default on a GPU), whose
explicit layout gives each thread 8 x 4 contiguous outputs (three 16-byte loads feed 32
products), and a plain Triton one, whose layout the compiler picks (a third of the Gluon
kernel's speed: it gives a thread one row and 32 columns, or routes loads through shared
memory) and which runs under Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests).
There the fma.rz is replaced by a truncating conversion of the exact scaled product (same
integers; the interpreter has no libdevice); ``mma_raw(..., trunc_cvt=True)`` runs that variant
on the GPU too, so the device tests check every combination.

Speed on the H200 (tools/device/h200.py --parts mma; reports/h200/): one call at the
emulator's shapes (32 heads x 1024 rows, K or N = 224, 0.94e9 products) takes about 1.0 ms,
~1e12 products/s, and ``fa3-fp8-kernel`` with the model costs 1.5-2.5x the ``acc=fp32``
emulator (it was 36.8x with the PyTorch reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch

try:  # importable without triton: ``available`` then says no
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
gluon = gl = None  # set below where triton has Gluon

from ._common import interpreting

ZERO_EXP = -4096  # as numerics/mma.py: below every live exponent
# Flag bits written by the kernels (one int32 per call, read once after the main kernel):
BAD_VALUE = 1  # a non-finite operand or C, or a float32 overflow mid-chain: the reference runs
NEEDS_F64 = 2  # an operand outside the float32 form's exact range: rerun in float64
STATS = {"calls": 0, "f64_reruns": 0, "fallbacks": 0}  # counters, for the device report


def available(device) -> bool:
    """True when ``mma`` can run for tensors on ``device``: a CUDA device of compute capability
    8.0 or newer (validated on 9.0; older ones keep the reference), triton importable, the
    interpreter off, and FA3N_TRITON_MMA not "0"."""
    device = torch.device(device)
    return (triton is not None and device.type == "cuda" and not interpreting()
            and os.environ.get("FA3N_TRITON_MMA", "1") != "0" and torch.cuda.get_device_capability(device) >= (8, 0))


if triton is not None:
    from triton.language.extra import libdevice

    # The kernels read module globals only as constexprs.
    _ZERO_EXP = tl.constexpr(ZERO_EXP)
    _BAD_VALUE = tl.constexpr(BAD_VALUE)
    _NEEDS_F64 = tl.constexpr(NEEDS_F64)

    @triton.jit(do_not_specialize=["R", "C", "s_xl", "s_xr", "s_xc"])
    def _prep_kernel(x_ptr, v_ptr, w_ptr, p_ptr, flag_ptr, R, C, RP, CP, s_xl, s_xr, s_xc, s_ol, s_or, s_oc,
                     min_exp, SIDE_B: tl.constexpr, F64: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """One operand [L, R, C] (any strides) -> three arrays in the compute type at
        out[l, r, c] = l*s_ol + r*s_or + c*s_oc, zero-padded to [L, RP, CP] (so that the main
        kernel's loads need no masks): p = 2^max(E, min_exp) (0 for zeros), and for A (SIDE_B
        false) v = |x|, w = sign(x) as +-1, for B v = x, w = the magic number with x's sign: what
        the main kernel's inner loop reads, so that it spends no logic op per element there. Sets
        BAD_VALUE for non-finite inputs and, in float32, NEEDS_F64 for inputs outside its exact
        range."""
        pid_l = tl.program_id(0).to(tl.int64)
        rr = tl.program_id(1) * BR + tl.arange(0, BR)
        cc = tl.program_id(2) * BC + tl.arange(0, BC)
        mask = (rr[:, None] < R) & (cc[None, :] < C)
        x = tl.load(x_ptr + pid_l * s_xl + rr[:, None] * s_xr + cc[None, :] * s_xc, mask=mask, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        # floor(log2|x|): the exponent field, or for a float32 subnormal the exponent of its
        # mantissa converted to float32 (exact below 2^24) minus 149.
        sub_e = ((mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 149
        e_true = tl.where(field == 0, sub_e, field - 127)
        e = tl.maximum(e_true, min_exp)
        nonzero = (bits & 0x7FFFFFFF) != 0
        neg = bits < 0
        bad = tl.where(mask & (field == 0xFF), _BAD_VALUE, 0)
        if F64:
            p = tl.where(nonzero, ((e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True), 0.0)
            xv = x.to(tl.float64)
            magic = 4503599627370496.0  # 2^52: ulp 1
        else:
            # Exact float32 form: <= 12 significant bits (the low 12 mantissa bits clear; a
            # subnormal fails the range test anyway) and 2^E, 2^(E(a) + E(b)) and the scale
            # 2^(bits - emax) all normal floats.
            unsafe = nonzero & (((bits & 0xFFF) != 0) | (e_true < -50) | (e > 60) | (e < -50))
            bad = bad | tl.where(mask & unsafe, _NEEDS_F64, 0)
            p = tl.where(nonzero, ((tl.minimum(tl.maximum(e, -50), 60) + 127) << 23).to(tl.float32, bitcast=True),
                         0.0)
            xv = x
            magic = 8388608.0  # 2^23: ulp 1
        if SIDE_B:
            v = xv
            w = tl.where(neg, -magic, magic).to(xv.dtype)
        else:
            v = tl.abs(xv)
            w = tl.where(neg, -1.0, 1.0).to(xv.dtype)
        off = pid_l * s_ol + rr[:, None] * s_or + cc[None, :] * s_oc
        pad = (rr[:, None] < RP) & (cc[None, :] < CP)
        tl.store(v_ptr + off, v, mask=pad)
        tl.store(w_ptr + off, w, mask=pad)
        tl.store(p_ptr + off, p, mask=pad)
        tl.atomic_or(flag_ptr, tl.max(tl.max(bad, axis=1), axis=0))

    @triton.jit
    def _exp_c(acc):
        """(bits, exponent field, mantissa, E) of float32 acc: E = floor(log2|acc|) (ZERO_EXP for
        +-0), for a subnormal the exponent of its mantissa converted to float32 (exact below
        2^24) minus 149."""
        cb = acc.to(tl.int32, bitcast=True)
        field = (cb >> 23) & 0xFF
        mant = cb & 0x7FFFFF
        sub_e = ((mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 149
        e_c = tl.where(field == 0, sub_e, field - 127)
        return cb, field, mant, tl.where((cb & 0x7FFFFFFF) == 0, _ZERO_EXP, e_c)

    @triton.jit
    def _mma_tile(a_ptr, sa_ptr, pa_ptr, b_ptr, mb_ptr, pb_ptr, rm, rn, acc, bad, mask, pid_l, MP, NP, KP,
                  K_STEP: tl.constexpr, BITS: tl.constexpr, FINAL_BITS: tl.constexpr, F64: tl.constexpr,
                  TRUNC_CVT: tl.constexpr, KC: tl.constexpr):
        """The model over all of K for one tile: acc [BM, BN] float32 (C, or zeros) -> D, and the
        flags ``bad``. Shared by both kernels: it creates no tensor of its own (every tile derives
        from ``acc``, every vector from ``rm``/``rn``), so it takes their layouts (Gluon's explicit
        one, or the one Triton's compiler picks). Between the passes only acc, the scale s and
        the sum stay live (emax is read back from s), to leave registers for the loads."""
        cdt = tl.float64 if F64 else tl.float32
        a_base = a_ptr + pid_l * KP * MP + rm
        sa_base = sa_ptr + pid_l * KP * MP + rm
        pa_base = pa_ptr + pid_l * KP * MP + rm
        b_base = b_ptr + pid_l * KP * NP + rn
        mb_base = mb_ptr + pid_l * KP * NP + rn
        pb_base = pb_ptr + pid_l * KP * NP + rn
        for k0 in range(0, KP, K_STEP):
            # Pass 1: the step's largest 2^(E(a) + E(b)) over non-zero products (zeros carry p = 0).
            em = (acc * 0.0).to(cdt)  # a zero tile in acc's layout
            # Chunks of KC unrolled k (a run-time loop between them), so that the compiler does
            # not hoist all of a step's loads at once and spill.
            for kc in range(k0, k0 + K_STEP, KC):
                for kk in tl.static_range(KC):
                    pa = tl.load(pa_base + (kc + kk) * MP)
                    pb = tl.load(pb_base + (kc + kk) * NP)
                    em = tl.maximum(em, pa[:, None] * pb[None, :])
            # s = 2^(bits - emax), emax = max(E(a) + E(b), E(C)), where there are products; 0
            # where there are none (every x is then 0, and so is every term).
            e_c = _exp_c(acc)[3]
            if F64:
                e_prod = ((em.to(tl.int64, bitcast=True) >> 52) - 1023).to(tl.int32)
                emax = tl.maximum(e_prod, e_c)
                s = tl.where(em > 0, ((1023 + BITS - emax).to(tl.int64) << 52).to(tl.float64, bitcast=True), 0.0)
            else:
                e_prod = (em.to(tl.int32, bitcast=True) >> 23) - 127
                emax = tl.maximum(e_prod, e_c)
                s = tl.where(em > 0, ((127 + BITS - emax) << 23).to(tl.float32, bitcast=True), 0.0)
            # Pass 2: the truncated terms trunc(a b s), summed exactly.
            tot = (acc * 0.0).to(cdt)
            for kc in range(k0, k0 + K_STEP, KC):
                for kk in tl.static_range(KC):
                    a = tl.load(a_base + (kc + kk) * MP)  # |a|
                    sa = tl.load(sa_base + (kc + kk) * MP)  # sign(a), +-1
                    b = tl.load(b_base + (kc + kk) * NP)
                    x = a[:, None] * b[None, :]  # exact, with b's sign
                    if TRUNC_CVT:
                        if F64:
                            t = (x * s).to(tl.int64).to(tl.float64)
                        else:
                            t = (x * s).to(tl.int32).to(tl.float32)
                    else:
                        # mb: 2^23 (2^52 in float64), whose ulp is 1, with b's sign (x's): adding
                        # it and rounding toward zero leaves floor(|x s|) in the low bits.
                        mb = tl.load(mb_base + (kc + kk) * NP)
                        t = libdevice.fma_rz(x, s, mb[None, :]) - mb[None, :]
                    tot = tot + sa[:, None] * t
            # emax back from s (or E(C) alone), then C's term, trunc(C 2^(bits - emax)), from its
            # bits: sig 2^sh with sh <= bits + 1 - nb.
            cb, field, mant, e_c = _exp_c(acc)
            if F64:
                emax = tl.where(s > 0, 1023 + BITS - (s.to(tl.int64, bitcast=True) >> 52).to(tl.int32), e_c)
            else:
                emax = tl.where(s > 0, 127 + BITS - (s.to(tl.int32, bitcast=True) >> 23), e_c)
            live = emax > _ZERO_EXP
            sig = tl.where(field > 0, mant | 0x800000, mant)
            sh = tl.where(field > 0, field - 150, -149) + BITS - emax
            sh = tl.where(live, sh, -31)
            mag = tl.where(sh >= 0, sig << tl.minimum(tl.maximum(sh, 0), 31),
                           sig >> tl.minimum(-tl.minimum(sh, 0), 31))
            c_term = tl.where(cb < 0, -mag, mag)
            total = (tot + c_term.to(cdt)).to(tl.float64)  # exact: |total| < 2^32
            # Truncate toward zero to FINAL_BITS bits after the leading bit (float64 is
            # sign-magnitude: masking the mantissa truncates toward zero), then scale by
            # 2^(emax - bits) and round to float32 (RNE, subnormals and overflow as the reference).
            tb = total.to(tl.int64, bitcast=True) & ~((1 << (52 - FINAL_BITS)) - 1)
            e_out = tl.where(live, emax, BITS)
            scale = ((1023 - BITS + e_out).to(tl.int64) << 52).to(tl.float64, bitcast=True)
            acc = tl.where(live, (tb.to(tl.float64, bitcast=True) * scale).to(tl.float32), 0.0)
            bad = bad | tl.where(mask & (tl.abs(acc) == float("inf")), _BAD_VALUE, 0)
        return acc, bad

    @triton.jit(do_not_specialize=["M", "N", "s_cl", "s_cm", "has_c"])
    def _mma_kernel(a_ptr, sa_ptr, pa_ptr, b_ptr, mb_ptr, pb_ptr, c_ptr, out_ptr, flag_ptr, M, N, MP, NP, KP,
                    s_cl, s_cm, s_cn, has_c, K_STEP: tl.constexpr, BITS: tl.constexpr, FINAL_BITS: tl.constexpr,
                    F64: tl.constexpr, TRUNC_CVT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    KC: tl.constexpr):
        """D[l] = C[l] + A[l] @ B[l] under the model; A given as |a|, sign(a), 2^E(a) [L, KP, MP],
        B as b, magic, 2^E(b) [L, KP, NP] (``_prep_kernel``'s zero-padded outputs: KP a multiple
        of K_STEP, MP of BM, NP of BN), C [L, M, N] with strides (has_c = 0: none, and c_ptr is D,
        never read: the masked load stays in the code, with D's strides, so that both cases
        compile to one kernel), D [L, M, N] contiguous. One program: a BM x BN tile of one l, all
        of K; Triton picks the layout."""
        pid_l = tl.program_id(0).to(tl.int64)
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        rn = tl.program_id(2) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        acc = tl.load(c_ptr + pid_l * s_cl + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=mask & (has_c != 0),
                      other=0.0)
        bad = tl.where(mask & ((acc.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000), _BAD_VALUE, 0)
        acc, bad = _mma_tile(a_ptr, sa_ptr, pa_ptr, b_ptr, mb_ptr, pb_ptr, rm, rn, acc, bad, mask, pid_l, MP, NP, KP,
                             K_STEP, BITS, FINAL_BITS, F64, TRUNC_CVT, KC)
        tl.store(out_ptr + pid_l * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
        tl.atomic_or(flag_ptr, tl.max(tl.max(bad, axis=1), axis=0))

    try:  # Gluon (triton >= 3.5): the same tile body with a layout chosen here, not by the compiler
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
    except ImportError:  # pragma: no cover - older triton: the plain kernel runs
        pass

    if gluon is not None:
        _mma_tile_gl = gluon.jit(_mma_tile.fn)

        @gluon.jit(do_not_specialize=["M", "N", "s_cl", "s_cm", "has_c"])
        def _mma_kernel_gl(a_ptr, sa_ptr, pa_ptr, b_ptr, mb_ptr, pb_ptr, c_ptr, out_ptr, flag_ptr, M, N, MP, NP,
                           KP, s_cl, s_cm, s_cn, has_c, K_STEP: gl.constexpr, BITS: gl.constexpr,
                           FINAL_BITS: gl.constexpr, F64: gl.constexpr, TRUNC_CVT: gl.constexpr, BM: gl.constexpr,
                           BN: gl.constexpr, KC: gl.constexpr, LAYOUT: gl.constexpr):
            """``_mma_kernel`` with an explicit blocked LAYOUT: each thread holds a TM x TN block
            of contiguous rows and columns, so that one k loads TM values of A and TN of B as
            16-byte vectors for TM * TN products (the compiler's own choice for BM = 128 routed
            the A vectors through shared memory, and for BM = BN = 64 gave each thread 8 rows
            8 apart: 9 loads for 32 products)."""
            pid_l = gl.program_id(0).to(gl.int64)
            rm = gl.program_id(1) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT))
            rn = gl.program_id(2) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, LAYOUT))
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            acc = gl.load(c_ptr + pid_l * s_cl + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=mask & (has_c != 0),
                          other=0.0)
            bad = gl.where(mask & ((acc.to(gl.int32, bitcast=True) & 0x7F800000) == 0x7F800000), _BAD_VALUE, 0)
            acc, bad = _mma_tile_gl(a_ptr, sa_ptr, pa_ptr, b_ptr, mb_ptr, pb_ptr, rm, rn, acc, bad, mask, pid_l, MP,
                                    NP, KP, K_STEP, BITS, FINAL_BITS, F64, TRUNC_CVT, KC)
            gl.store(out_ptr + pid_l * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
            gl.atomic_or(flag_ptr, gl.max(gl.max(bad, axis=1), axis=0))


@dataclasses.dataclass(frozen=True)
class Tile:
    """Launch shape: a BM x BN output tile per program, TM x TN of it per thread (Gluon; the
    plain kernel lets Triton choose, with ``warps`` warps), k unrolled in chunks of KC."""

    bm: int
    bn: int
    tm: int = 8
    tn: int = 4
    kc: int = 8
    warps: int = 4  # the plain kernel's; Gluon's follows from the layout

    def layout(self):
        """(Gluon BlockedLayout, its number of warps)."""
        tpn = min(32, self.bn // self.tn)
        tpm = 32 // tpn
        wm, wn = self.bm // (self.tm * tpm), self.bn // (self.tn * tpn)
        if min(wm, wn) < 1 or wm * self.tm * tpm != self.bm or wn * self.tn * tpn != self.bn:
            raise ValueError(f"{self}: the tile does not split into whole warps")
        return gl.BlockedLayout([self.tm, self.tn], [tpm, tpn], [wm, wn], [1, 0]), wm * wn


# Swept on the H200 at the emulator's shapes (QK: [32, 1024, 128] x [32, 128, 224]; PV with C):
# 128x32 8x4 ran 1.03 + 0.91 ms, 64x64 1.04 + 0.91, 256x32 0.96 + 0.90, 64x32 4x4 1.08 + 1.01, KC = 4
# 1.13 + 0.93, the truncating conversion 1.05 + 1.01, the plain-Triton kernel 3.2 + 2.8. 128x32
# pads N = 224 (the FA3 key tile) not at all and small M less than 256 rows.
TILE_F32 = Tile(128, 32, 8, 4, 8)
TILE_F64 = Tile(64, 32, 4, 4, 4)


def _flat3(x: torch.Tensor, lead, r: int, c: int) -> torch.Tensor:
    """x broadcast to lead + (r, c) as a float32 [L, r, c] (a view where strides allow)."""
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return x.expand(*lead, r, c).reshape(math.prod(lead), r, c)


def mma_raw(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, *, a_min_exp: int, b_min_exp: int,
            k_step: int, bits: int, final_bits: int, f64: bool, trunc_cvt: bool = False, tile: Tile | None = None,
            impl: str | None = None) -> tuple[torch.Tensor, int]:
    """(D, flags) for one variant of the kernels, without the fallbacks of ``mma``: the flag bits
    BAD_VALUE and NEEDS_F64 say whether D is to be trusted. ``impl``: "gluon" (the default where
    Gluon imports and the interpreter is off) or "triton". For tests and measurements."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"mma: A is [.., {m}, {k}] but B is [.., {b.shape[-2]}, {n}]")
    if impl is None:
        impl = "gluon" if gluon is not None and not interpreting() else "triton"
    tile = tile or (TILE_F64 if f64 else TILE_F32)
    if k_step % tile.kc:
        tile = dataclasses.replace(tile, kc=math.gcd(k_step, tile.kc))
    big_l = math.prod(lead) if lead else 1
    dev = a.device
    out = torch.empty(big_l, m, n, dtype=torch.float32, device=dev)
    flags = torch.zeros(1, dtype=torch.int32, device=dev)
    if big_l == 0 or m == 0 or n == 0:
        return out.reshape(*lead, m, n), 0
    a3, b3 = _flat3(a, lead, m, k), _flat3(b, lead, k, n)
    c3 = None if c is None else _flat3(c, lead, m, n)
    # triton launches on the current CUDA device: make it the tensors' one
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        return _launch(a3, b3, c3, out, flags, lead, m, k, n, a_min_exp, b_min_exp, k_step, bits, final_bits, f64,
                       trunc_cvt, tile, impl)


def _launch(a3, b3, c3, out, flags, lead, m, k, n, a_min_exp, b_min_exp, k_step, bits, final_bits, f64, trunc_cvt,
            tile, impl):
    """The prepare passes and the main kernel of ``mma_raw`` on [L, ., .] operands."""
    big_l, dev = a3.shape[0], a3.device
    cdt = torch.float64 if f64 else torch.float32
    bm, bn = tile.bm, tile.bn
    kp, mp, np_ = triton.cdiv(k, k_step) * k_step, triton.cdiv(m, bm) * bm, triton.cdiv(n, bn) * bn
    # A is stored k-major ([L, K, M]) so that one k of a row block is one contiguous load; both
    # are zero-padded to whole tiles and k-steps (zeros never set emax nor add a term).
    pa3 = torch.empty(3, big_l, kp, mp, dtype=cdt, device=dev)  # |a|, sign(a), 2^E(a)
    pb3 = torch.empty(3, big_l, kp, np_, dtype=cdt, device=dev)  # b, magic with b's sign, 2^E(b)
    if kp > 0:
        br, bc = 32, 32
        _prep_kernel[(big_l, triton.cdiv(mp, br), triton.cdiv(kp, bc))](
            a3, pa3[0], pa3[1], pa3[2], flags, m, k, mp, kp, *a3.stride(), kp * mp, 1, mp, int(a_min_exp),
            SIDE_B=False, F64=f64, BR=br, BC=bc)
        _prep_kernel[(big_l, triton.cdiv(kp, br), triton.cdiv(np_, bc))](
            b3, pb3[0], pb3[1], pb3[2], flags, k, n, kp, np_, *b3.stride(), kp * np_, np_, 1, int(b_min_exp),
            SIDE_B=True, F64=f64, BR=br, BC=bc)
    # Without C the kernels read nothing (has_c = 0 masks the load) but still get D's strides.
    cc, cs = (c3, c3.stride()) if c3 is not None else (out, (m * n, n, 1))
    grid = (big_l, mp // bm, np_ // bn)
    args = (*pa3, *pb3, cc, out, flags, m, n, mp, np_, kp, *cs, int(c3 is not None))
    consts = dict(K_STEP=k_step, BITS=bits, FINAL_BITS=final_bits, F64=f64, TRUNC_CVT=trunc_cvt or interpreting(),
                  BM=bm, BN=bn, KC=tile.kc)
    if impl == "gluon":
        layout, warps = tile.layout()
        _mma_kernel_gl[grid](*args, **consts, LAYOUT=layout, num_warps=warps)
    else:
        _mma_kernel[grid](*args, **consts, num_warps=tile.warps)
    return out.reshape(*lead, m, n), int(flags.item())  # the one host sync of a call


def mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *, a_min_exp: int, b_min_exp: int,
        model) -> torch.Tensor | None:
    """D = C + A @ B under ``model`` (an ``mma.MmaModel``), bit-identical to
    ``mma.hopper_fp8_mma_reference``; None where the reference must run (a non-finite operand or
    accumulator, a float32 overflow mid-chain, or operands that are not float tensors)."""
    for t in (a, b) if c is None else (a, b, c):
        if not t.is_floating_point() or t.dtype == torch.float64:
            return None  # float64 operands may hold values float32 cannot: the reference takes them
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    # In-kernel offsets within one l are int32 (padded sizes: tiles of at most 256, k-steps of
    # at most 32); 2^(E(a) + E(b)) must stay a normal float64.
    if max((k + 32) * (max(m, n) + 256), m * n) >= 2**31 or min(a_min_exp, b_min_exp) < -500:
        return None
    STATS["calls"] += 1
    # The float32 form for the FP8 model; float64 when an operand needs it, and always for the
    # 16-bit model (its terms reach 2^27: 16 of them do not sum exactly in float32).
    f64 = model.bits > 13 or min(a_min_exp, b_min_exp) < -50
    while True:
        d, flags = mma_raw(a, b, c, a_min_exp=a_min_exp, b_min_exp=b_min_exp, k_step=model.k_step, bits=model.bits,
                           final_bits=model.final_bits, f64=f64)
        if flags & BAD_VALUE:
            STATS["fallbacks"] += 1
            return None
        if flags & NEEDS_F64 and not f64:
            STATS["f64_reruns"] += 1
            f64 = True
            continue
        return d


def for_device(device):
    """``mma`` where it runs on ``device`` (``available``), else None: the entry registered in
    ``fa3_numerics.numerics.mma.DEVICE_MMA`` (pyproject's ``fa3_numerics.device_mma`` group)."""
    return mma if available(device) else None
