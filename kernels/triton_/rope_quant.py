"""Fused pre-pass in one Triton kernel: RoPE, random Hadamard rotation, K smoothing, FP8 quantization.

Exposed: ``ROPE_LAYOUTS``, ``rope_tables``, ``rope_quantize``, ``rope_bf16``, ``min_bytes``.

``rope_quantize`` reads Q (or K, or V with ``rope="none"``) once in the model's dtype and layout and
writes FP8 once, plus float32 descales, doing in registers what the model and the recipe do in
separate passes:

1. RoPE with the model's own frequencies: cos/sin tables (``[T, D/2]`` or ``[T, D]`` indexed by
   position, or ``[B, N, D/2 | D]`` per batch; ``rope_tables`` builds them from ``inv_freq`` and
   positions as the model does), layout ``interleaved`` (GPT-J: pairs 2i, 2i+1) or ``half``
   (GPT-NeoX / Llama: pairs i, i + D/2).
2. The recipe's random Hadamard rotation diag(s) H_d / sqrt(d) (``numerics/rotation.py``).
3. Optionally K smoothing's mean subtraction (``smooth=k``): the mean over tokens of the rotated K
   is an input (``k_mean``), because it needs every token before any can be cast.
4. The recipe's descales at its granularity (per block of rows, token, (batch, kv-head) or
   tensor; amax / fmt.max, optionally rounded up to a power of two) and the saturating cast.

Rounding, stated because the bytes depend on it:

- RoPE is float32 without fused multiply-adds: ``out[c] = fl(fl(x[c] cos[c]) -+ fl(x[p] sin[c]))``
  with p the partner of channel c and minus on the pair's first channel. The inputs (BF16/FP16/
  FP32) and the tables widen exactly to float32. The kernel is compiled with
  ``enable_fp_fusion=False`` so the GPU rounds the products as the interpreter and torch do.
- ``exact=True`` (default): everything after RoPE in float64 with the emulator's order (the same
  butterflies, division by sqrt(d), mean subtraction, amax / fmt.max in float64 rounded to float32,
  x / descale in float64, round-to-odd to float32 then one RNE cast). The bytes and descales equal
  ``prepare()`` applied to the float32 RoPE output (tests/kernels/test_kernels_rope.py checks them).
- ``exact=False``: float32 after RoPE; the rotation is three BF16 tensor-core dots with the +-1
  matrix (the float32 RoPE output split exactly into three BF16 parts, so every product is exact
  and only the float32 sums round). Near-ties can round the other way (the tests measure how
  often, and the device script reports it beside the speed). By default this path runs the
  persistent kernel of ``rope_persistent`` (pair halves, the rotation split along RoPE's pairs:
  half the tensor-core work, tables loaded once per row block for all heads, the hardware cast);
  ``impl="tiled"`` keeps this module's kernel (12-13% of a copy on the H200, reports/h200/rope).

Granularity and passes: per block and per token one pass (a block longer than a tile is read a
second time from L2 for its cast); per head and per tensor a first pass reduces the amax (atomics)
and a second quantizes, because every element's scale depends on every other element of the head.

``rope_bf16`` is the fair BF16 baseline's RoPE: the same rotation of pairs, rounded once to the
input dtype, at copy speed (one read, one write).
"""

from __future__ import annotations

import math

import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerHead

from ._common import f64_to_f32_odd, fp8_params, interpreting, round_fp8, tl, tl_fp8, triton
from .quant_launch import descale_buffer, dims, strides
from .rotate_quant import GRAN_CODES, QuantOut

ROPE_LAYOUTS = {"none": 0, "interleaved": 1, "half": 2}
_LAYOUTS = ("bshd", "bhsd")
_NO_TRITON = "the fused pre-pass needs the triton package (pip install triton; it ships with CUDA builds of torch)"


if triton is not None:
    # amax -> descale, as every quantizer of this package computes it; the soft cast's bytes
    from .quant_device import encode_fp8, tile_descale

    @triton.jit
    def _stage(y, TILE: tl.constexpr, D: tl.constexpr, HH: tl.constexpr):
        """One butterfly stage, the emulator's fwht order: pairs (i, i + HH) inside blocks of 2 HH
        become (a + b, a - b)."""
        z = tl.permute(tl.reshape(y, (TILE, D // (2 * HH), 2, HH)), (0, 1, 3, 2))
        a, b = tl.split(z)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (TILE, D))

    @triton.jit
    def _rope(xr, cr, sr, cols, m, sxd, std, D: tl.constexpr, ROPE: tl.constexpr, TABLE_FULL: tl.constexpr):
        """RoPE of a tile in float32. ``xr``, ``cr``, ``sr``: [TILE, 1] row addresses of x and of the
        cos and sin tables. The partner channel is a second load of the same rows (cache hits: HBM
        sees each element once)."""
        x = tl.load(xr + cols[None, :] * sxd, mask=m[:, None], other=0.0).to(tl.float32)
        if ROPE != 0:
            x = _pairs(x, xr, cr, sr, cols, m, sxd, std, D, ROPE, TABLE_FULL)
        return x

    @triton.jit
    def _pairs(x, xr, cr, sr, cols, m, sxd, std, D: tl.constexpr, ROPE: tl.constexpr, TABLE_FULL: tl.constexpr):
        HALF: tl.constexpr = D // 2
        if ROPE == 1:  # interleaved: (2i, 2i + 1)
            pc = cols ^ 1
            first = (cols & 1) == 0
            fi = cols // 2
        else:  # half-split: (i, i + D/2)
            first = cols < HALF
            pc = tl.where(first, cols + HALF, cols - HALF)
            fi = tl.where(first, cols, cols - HALF)
        if TABLE_FULL:
            tc = cols
        else:
            tc = fi
        xp = tl.load(xr + pc[None, :] * sxd, mask=m[:, None], other=0.0).to(tl.float32)
        c = tl.load(cr + tc[None, :] * std, mask=m[:, None], other=0.0).to(tl.float32)
        s = tl.load(sr + tc[None, :] * std, mask=m[:, None], other=0.0).to(tl.float32)
        a = x * c
        b = xp * s
        return tl.where(first[None, :], a - b, a + b)

    @triton.jit
    def _rot(r, SIGNS, hm, SCAL, mu, TILE: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, ROT: tl.constexpr,
             SMOOTH: tl.constexpr, EXACT: tl.constexpr, DOT_F32: tl.constexpr):
        """float32 RoPE output [TILE, D] -> rotated (and smoothed) values, float64 (EXACT) or float32."""
        cols = tl.arange(0, D)
        if EXACT:
            y = r.to(tl.float64)
            if ROT != 0:
                y = y * tl.load(SIGNS + cols)[None, :]
                # Stages written out: the interpreter needs constant shapes for the reshapes.
                y = _stage(y, TILE, D, 1)
                y = _stage(y, TILE, D, 2)
                y = _stage(y, TILE, D, 4)
                y = _stage(y, TILE, D, 8)
                if LOG2D > 4:
                    y = _stage(y, TILE, D, 16)
                if LOG2D > 5:
                    y = _stage(y, TILE, D, 32)
                if LOG2D > 6:
                    y = _stage(y, TILE, D, 64)
                if LOG2D > 7:
                    y = _stage(y, TILE, D, 128)
                y = y / tl.load(SCAL)  # x / sqrt(d), as rotation.fwht divides
        else:
            y = r
            if ROT != 0:
                # r = hi + mid + lo exactly (8 + 8 + 8 significant bits): three dots whose products
                # are exact, smallest part first, float32 sums.
                hi = r.to(tl.bfloat16).to(tl.float32)
                rest = r - hi
                mid = rest.to(tl.bfloat16).to(tl.float32)
                lo = rest - mid
                if DOT_F32:
                    # The interpreter's dot of BF16 operands is wrong; its float32 dot (numpy) of the
                    # same exact parts has the same exact products.
                    y = tl.dot(lo, hm, out_dtype=tl.float32)
                    y = tl.dot(mid, hm, y, out_dtype=tl.float32)
                    y = tl.dot(hi, hm, y, out_dtype=tl.float32)
                else:
                    y = tl.dot(lo.to(tl.bfloat16), hm, out_dtype=tl.float32)
                    y = tl.dot(mid.to(tl.bfloat16), hm, y, out_dtype=tl.float32)
                    y = tl.dot(hi.to(tl.bfloat16), hm, y, out_dtype=tl.float32)
                y = y * tl.load(SCAL + 1)
        if SMOOTH:
            y = y - mu[None, :]
        return y

    @triton.jit
    def _cast(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
              EXACT: tl.constexpr, SOFT_CAST: tl.constexpr, BIAS: tl.constexpr, SUBQ: tl.constexpr,
              NAN: tl.constexpr):
        """y / descale, saturating RNE cast. SOFT_CAST: rounded in float32 arithmetic and encoded by
        hand into bytes (the output pointer is then uint8)."""
        if EXACT:
            v = f64_to_f32_odd(y / d32.to(tl.float64))
        else:
            v = tl.math.div_rn(y, d32 + tl.zeros(y.shape, tl.float32))
        # One return: Triton's compiler refuses a return inside the constexpr branch beside another
        # of a different type (uint8 bytes against FP8), which the interpreter accepts.
        if SOFT_CAST:
            q = encode_fp8(round_fp8(v, MBITS, EMIN, FMT_MAX), MBITS, EMIN, BIAS, SUBQ, NAN)
        else:
            q = tl.minimum(tl.maximum(v, -FMT_MAX), FMT_MAX).to(OUT)
        return q

    @triton.jit
    def _tile(X, COS, SIN, POS, SIGNS, hm, SCAL, mu, b, xb, rows, m, cols, sxs, sxd, stb, stn, std, spb, spn,
              D: tl.constexpr, LOG2D: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
              TABLE_FULL: tl.constexpr, HAS_POS: tl.constexpr, ROT: tl.constexpr, SMOOTH: tl.constexpr,
              EXACT: tl.constexpr, DOT_F32: tl.constexpr):
        if HAS_POS:
            pos = tl.load(POS + b * spb + rows * spn, mask=m, other=0).to(tl.int64)
        else:
            pos = rows.to(tl.int64)
        toff = b.to(tl.int64) * stb + pos[:, None] * stn
        xr = xb + rows[:, None].to(tl.int64) * sxs
        r = _rope(xr, COS + toff, SIN + toff, cols, m, sxd, std, D, ROPE, TABLE_FULL)
        y = _rot(r, SIGNS, hm, SCAL, mu, TILE, D, LOG2D, ROT, SMOOTH, EXACT, DOT_F32)
        # Rows past the block or the sequence read as 0 but would be -mean after smoothing: no amax.
        return tl.where(m[:, None], y, 0.0)

    @triton.jit
    def _rope_quant_kernel(X, Y, COS, SIN, POS, SIGNS, HMAT, SCAL, MU, AMAX, DESC,
                           sxb, sxh, sxs, sxd, syb, syh, sys_, syd, stb, stn, std, spb, spn, smb, smh,
                           sdb, sdh, sdn, H, N, GROUP, ROWS_PER_PROG,
                           D: tl.constexpr, LOG2D: tl.constexpr, TILE: tl.constexpr, SINGLE: tl.constexpr,
                           ROPE: tl.constexpr, TABLE_FULL: tl.constexpr, HAS_POS: tl.constexpr,
                           ROT: tl.constexpr, SMOOTH: tl.constexpr, GRAN: tl.constexpr, PASS: tl.constexpr,
                           EXACT: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                           FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                           BIAS: tl.constexpr, SUBQ: tl.constexpr, NAN: tl.constexpr, DOT_F32: tl.constexpr):
        """One program: ROWS_PER_PROG rows of one (batch, head), in tiles of TILE rows.

        GRAN 0 tensor, 1 head, 2 block (ROWS_PER_PROG = the block), 3 token. PASS 0: block/token in
        one pass; 1: amax of a head/tensor (atomic max on the bits: non-negative IEEE floats order
        like their bit patterns); 2: quantize with it. SINGLE: the rows fit one tile, which stays in
        registers between its amax and its cast (one read); otherwise tiles are read again."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        r0 = pid_t * ROWS_PER_PROG
        r_end = r0 + ROWS_PER_PROG
        cols = tl.arange(0, D)
        sub = tl.arange(0, TILE)
        xb = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
        yb = Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh
        if ROT != 0 and not EXACT:
            hm = tl.load(HMAT + cols[:, None] * D + cols[None, :])
            if DOT_F32:
                hm = hm.to(tl.float32)
        else:
            hm = 0
        if SMOOTH:
            mu = tl.load(MU + b * smb + h * smh + cols)
        else:
            mu = 0
        ai = 0
        if GRAN == 1:
            ai = b * (H // GROUP) + h // GROUP
        if SINGLE:
            rows = r0 + sub
            m = (rows < r_end) & (rows < N)
            y = _tile(X, COS, SIN, POS, SIGNS, hm, SCAL, mu, b, xb, rows, m, cols, sxs, sxd, stb, stn, std, spb,
                      spn, D, LOG2D, TILE, ROPE, TABLE_FULL, HAS_POS, ROT, SMOOTH, EXACT, DOT_F32)
            amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
        else:
            if EXACT:
                run = tl.zeros((TILE,), tl.float64)
            else:
                run = tl.zeros((TILE,), tl.float32)
            if PASS == 1 or GRAN == 2:
                for i in range(0, ROWS_PER_PROG, TILE):
                    rows = r0 + i + sub
                    m = (rows < r_end) & (rows < N)
                    y = _tile(X, COS, SIN, POS, SIGNS, hm, SCAL, mu, b, xb, rows, m, cols, sxs, sxd, stb, stn, std,
                              spb, spn, D, LOG2D, TILE, ROPE, TABLE_FULL, HAS_POS, ROT, SMOOTH, EXACT, DOT_F32)
                    run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
            amax = tl.max(run, axis=0)
        if PASS == 1:
            if EXACT:
                tl.atomic_max(AMAX + ai, amax.to(tl.int64, bitcast=True))
            else:
                tl.atomic_max(AMAX + ai, amax.to(tl.int32, bitcast=True))
            return
        if GRAN <= 1:
            if EXACT:
                amax = tl.load(AMAX + ai).to(tl.float64, bitcast=True)
            else:
                amax = tl.load(AMAX + ai).to(tl.float32, bitcast=True)
        d32 = tile_descale(amax, FMT_MAX, POW2, EXACT)
        if GRAN == 2:
            tl.store(DESC + b * sdb + h * sdh + pid_t * sdn, d32)
        elif GRAN == 1:
            if (pid_t == 0) & (h % GROUP == 0):
                tl.store(DESC + b * sdb + (h // GROUP) * sdh, d32)
        elif GRAN == 0:
            if (pid_t == 0) & (pid_bh == 0):
                tl.store(DESC, d32)
        if SINGLE:
            if GRAN == 3:
                dt = tile_descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, EXACT)
                tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
                q = _cast(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, BIAS, SUBQ, NAN)
            else:
                q = _cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, BIAS, SUBQ, NAN)
            tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])
        else:
            for i in range(0, ROWS_PER_PROG, TILE):
                rows = r0 + i + sub
                m = (rows < r_end) & (rows < N)
                y = _tile(X, COS, SIN, POS, SIGNS, hm, SCAL, mu, b, xb, rows, m, cols, sxs, sxd, stb, stn, std,
                          spb, spn, D, LOG2D, TILE, ROPE, TABLE_FULL, HAS_POS, ROT, SMOOTH, EXACT, DOT_F32)
                if GRAN == 3:
                    dt = tile_descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, EXACT)
                    tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
                    q = _cast(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, BIAS, SUBQ, NAN)
                else:
                    q = _cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, BIAS, SUBQ, NAN)
                tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])

    @triton.jit
    def _rope_bf16_kernel(X, Y, COS, SIN, NROWS, S, H, stn, std, D: tl.constexpr, ROPE: tl.constexpr,
                          TABLE_FULL: tl.constexpr, BLOCK: tl.constexpr):
        """RoPE of contiguous (b, s, h, d) rows, rounded once to the output dtype: one read, one
        write (the partner channel's load hits the cache)."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = rows < NROWS
        cols = tl.arange(0, D)
        pos = ((rows // H) % S).to(tl.int64)
        toff = pos[:, None] * stn
        r = _rope(X + rows[:, None].to(tl.int64) * D, COS + toff, SIN + toff, cols, m, 1, std, D, ROPE, TABLE_FULL)
        tl.store(Y + rows[:, None].to(tl.int64) * D + cols[None, :], r.to(Y.dtype.element_ty), mask=m[:, None])


def _dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    if x.dim() != 4:
        raise UsageError(f"expected a 4-d tensor ({layout}), got shape {tuple(x.shape)}")
    return dims(x, layout)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor | int, *,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 ``[T, D/2]`` (or ``[B, N, D/2]`` for per-batch positions ``[B, N]``) as the
    model computes them: angle = fl32(position * inv_freq), then float32 cos and sin. ``positions``:
    an int (0 .. T-1) or a tensor of positions. The kernel reads the tables, never the angles, so
    its bytes depend on these values only."""
    inv = inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(int(positions), device=inv.device) if isinstance(positions, int) else positions.to(inv.device)
    ang = pos.to(torch.float32)[..., None] * inv
    return torch.cos(ang), torch.sin(ang)


_CONST: dict = {}


def _constants(d: int, seed: int, device, exact: bool):
    key = (d, seed, str(device), exact)
    if key not in _CONST:
        from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

        signs = random_signs(d, seed)
        hm = (signs[:, None] * hadamard_matrix(d)).to(torch.bfloat16).contiguous()
        ct = torch.float64 if exact else torch.float32
        scal = torch.tensor([d ** 0.5, 1.0 / d ** 0.5], dtype=torch.float64)
        _CONST[key] = (signs.to(device=device, dtype=ct), hm.to(device), scal.to(device=device, dtype=ct))
    return _CONST[key]


def _check_tables(cos, sin, b, n, d, positions):
    if cos is None or sin is None:
        raise UsageError("rope needs both cos and sin tables (rope_tables(inv_freq, positions) builds them)")
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-1] not in (d // 2, d):
        raise UsageError(f"cos/sin tables must share a shape [T, {d // 2} or {d}] or [B, N, {d // 2} or {d}]; "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 3 and (cos.shape[0] not in (1, b) or cos.shape[1] < n or positions is not None):
        raise UsageError(f"per-batch tables [B, N, W] need B = {b} (or 1) and N >= {n}, and no positions")


def rope_quantize(x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
                  rope: str = "half", positions: torch.Tensor | None = None, layout: str = "bshd",
                  rot: str = "hadamard", seed: int = 0, fmt: str = "e4m3", gran=None, block_rows: int = 0,
                  group: int = 1, pow2: bool = False, k_mean: torch.Tensor | None = None, exact: bool = True,
                  out_layout: str = "bhsd", soft_cast: bool | None = None, tile: int = 0,
                  num_warps: int = 0, impl: str = "auto", stages: int = 0, progs_per_sm: int = 0,
                  split: str = "bf16x3", table_per_head: bool = False) -> QuantOut:
    """RoPE + rotation + (smoothing) + FP8 quantization of ``x`` in one kernel (see the module doc).

    ``x``: (b, s, h, d) (``layout="bshd"``, a model's projection output) or (b, h, s, d), BF16/FP16/
    FP32. ``cos``, ``sin``: the model's tables (see ``rope_tables``), indexed by ``positions``
    (``[N]`` or ``[B, N]`` ints; default 0 .. N-1) unless per batch ``[B, N, W]``. ``rope``:
    ``half``, ``interleaved`` or ``none`` (V). ``rot``: ``hadamard`` (signs from ``seed``, as
    ``make_rotation``) or ``none``. ``gran``: a granularity (``PerHead()`` default; ``PerBlock(0)``
    takes ``block_rows``); ``group``: heads sharing a per-head descale (Q under GQA). ``k_mean``:
    the mean over tokens of the rotated K, ``[B, H, D]`` (float64 for ``exact``), subtracted
    after the rotation.

    ``impl``: ``persistent`` (``rope_persistent``: pair halves, the split rotation, the hardware
    cast; the float32 path only, blocks of at most 128 rows, head_dim >= 32 with the rotation),
    ``tiled`` (this module's kernel), or ``auto``: persistent where it applies, and for an operand
    with neither RoPE nor rotation (V) the plain quantizer (``rotate_quant.rotate_quantize``, the
    same bytes). ``tile``, ``num_warps``, ``stages`` and ``progs_per_sm`` tune the launch (0: the
    defaults). ``split`` (persistent kernel) chooses the rotation's products: ``bf16x3`` exact
    products (default), ``bf16x3t`` exact products of parts cut by truncation (integer operations,
    no conversions), ``bf16x2`` / ``bf16x1`` (inexact, to measure what the exact products
    cost), ``tf32x2`` (masked TF32 parts, no conversions; the tensor core drops u's last 2 bits).
    ``table_per_head`` reads the cos/sin rows again for every head instead of holding them in
    registers across the heads. Returns a ``QuantOut``
    (values in ``out_layout``, float32 descales; ``launch`` names the kernel and its launch)."""
    gran = PerHead() if gran is None else gran
    if fmt not in ("e4m3", "e5m2"):
        raise UsageError(f"fmt={fmt}: the fused pre-pass writes e4m3 or e5m2")
    f = fp8_params(fmt)
    if layout not in _LAYOUTS or out_layout not in _LAYOUTS:
        raise UsageError(f"layouts must be among {', '.join(_LAYOUTS)}")
    if rope not in ROPE_LAYOUTS:
        raise UsageError(f"rope={rope!r}; one of {', '.join(ROPE_LAYOUTS)}")
    if rot not in ("none", "hadamard"):
        raise UsageError(f"rot={rot}: the fused pre-pass applies the random Hadamard rotation or none")
    if type(gran) not in GRAN_CODES:
        raise UsageError(f"gran={gran}: the fused pre-pass takes tensor, head, block or token scales")
    b, h, n, d = _dims(x, layout)
    if d & (d - 1) or not 16 <= d <= 256:
        raise UsageError(f"head_dim {d}: the fused pre-pass needs a power of two in [16, 256] (Triton tiles)")
    if h % group:
        raise UsageError(f"{h} heads are not a multiple of the descale group {group}")
    code = GRAN_CODES[type(gran)]
    if code == 2:
        rows = gran.rows or block_rows
        if not rows:
            raise UsageError("block granularity needs block_rows (the attention kernel's tile)")
    else:
        rows = 1 if code == 3 else n
    if code != 1:
        group = 1
    dev = x.device
    rope_code = ROPE_LAYOUTS[rope]
    if rope_code:
        _check_tables(cos, sin, b, n, d, positions)
        cos, sin = cos.to(dev).contiguous(), sin.to(dev).contiguous()  # one set of strides for both
        full = cos.shape[-1] == d
        if cos.dim() == 3:
            stb, stn, std = (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1), cos.stride(2)
        else:
            stb, stn, std = 0, cos.stride(0), cos.stride(1)
    else:
        cos = sin = torch.zeros(1, dtype=torch.float32, device=dev)
        full, stb, stn, std = False, 0, 0, 0
    if positions is not None:
        pos = positions.to(device=dev, dtype=torch.int64)
        if pos.dim() == 1:
            pos = pos[None].expand(b, -1)
        if pos.shape != (b, n):
            raise UsageError(f"positions must be [{n}] or [{b}, {n}], got {tuple(positions.shape)}")
        if rope_code and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
            raise UsageError(f"positions must lie in [0, {cos.shape[0]}) (the tables' rows)")
        spb, spn = pos.stride(0), pos.stride(1)
    else:
        if rope_code and cos.dim() == 2 and cos.shape[0] < n:
            raise UsageError(f"the cos/sin tables have {cos.shape[0]} rows for {n} positions")
        pos = torch.zeros(1, dtype=torch.int64, device=dev)
        spb = spn = 0
    smooth = k_mean is not None
    if smooth:
        mu = k_mean.to(device=dev, dtype=torch.float64 if exact else torch.float32)
        if mu.dim() == 4:
            mu = mu.squeeze(2)
        if mu.shape != (b, h, d):
            raise UsageError(f"k_mean must be [{b}, {h}, {d}] (or [B, H, 1, D]), got {tuple(k_mean.shape)}")
        mu = mu.contiguous()
        smb, smh = mu.stride(0), mu.stride(1)
    else:
        mu = torch.zeros(1, dtype=torch.float64, device=dev)
        smb = smh = 0
    if triton is None:
        raise UsageError(_NO_TRITON)
    soft = interpreting() if soft_cast is None else soft_cast
    if impl not in ("auto", "persistent", "tiled"):
        raise UsageError(f"impl={impl!r}; auto, persistent or tiled")
    if split not in _SPLITS:
        raise UsageError(f"split={split!r}; one of {', '.join(_SPLITS)}")
    # The persistent kernel's products have K = d/2, and Triton's tensor-core dots need K >= 16.
    fits = not exact and (code != 2 or rows <= _PERSIST_MAX_ROWS) and (rot == "none" or d >= 32)
    if impl == "persistent" and not fits:
        raise UsageError("impl=persistent is the float32 path (exact=False) for blocks of at most "
                         f"{_PERSIST_MAX_ROWS} rows and, with the rotation, head_dim >= 32; use impl=tiled")
    if impl == "auto" and not exact and not rope_code and rot == "none" and not smooth:
        # V: no RoPE, no rotation, only the cast. The plain quantizer's persistent kernel moves it
        # at 89% of a copy on the H200 against this module's 71% (reports/h200/rope), same bytes;
        # it also takes blocks longer than 128 rows (its shared-memory kernels). The launch
        # settings given here go to it.
        from .rotate_quant import rotate_quantize

        return rotate_quantize(x, layout=layout, fmt=fmt, gran=gran, block_rows=block_rows, group=group, pow2=pow2,
                               rot="none", exact=False, out_layout=out_layout, soft_cast=soft_cast, tile=tile,
                               num_warps=num_warps, stages=stages, progs_per_sm=progs_per_sm)
    if impl != "tiled" and fits:
        return _launch_persistent(x, cos, sin, pos, mu, layout, out_layout, f, fmt, code, rows, group, pow2,
                                  rope_code, full, positions is not None, rot != "none", smooth, seed, soft,
                                  (b, h, n, d), (stb, stn, std, spb, spn, smb, smh), tile, num_warps, stages,
                                  progs_per_sm, split, table_per_head)
    signs, hm, scal = _constants(d, seed, dev, exact)

    out_shape = (b, n, h, d) if out_layout == "bshd" else (b, h, n, d)
    y = torch.empty(out_shape, dtype=f.torch_dtype, device=dev)
    desc = descale_buffer(code, b, h, n, rows, group, dev)
    # float64 tiles of 32 rows fit the registers; float32 tiles hold a whole Q block.
    if code == 2:
        per_prog = rows
        cap = 32 if exact else max(16, min(128, (128 * 128) // d))
        tile = tile or min(cap, max(16, 1 << (rows - 1).bit_length()))
    else:
        tile = tile or (32 if exact else 64)
        per_prog = tile if code == 3 or not exact else 8 * tile
    single = per_prog <= tile
    grid = (-(-n // per_prog), b * h)
    amax = torch.zeros(max(1, b * (h // group)) if code == 1 else 1,
                       dtype=torch.int64 if exact else torch.int32, device=dev)
    common = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, SINGLE=single, ROPE=rope_code, TABLE_FULL=full,
                  HAS_POS=positions is not None, ROT=0 if rot == "none" else 1, SMOOTH=smooth, GRAN=code,
                  EXACT=bool(exact), POW2=bool(pow2), MBITS=f.mbits, EMIN=f.emin, FMT_MAX=f.max, OUT=tl_fp8(fmt),
                  SOFT_CAST=soft, BIAS=(7 if fmt == "e4m3" else 15), SUBQ=2.0 ** (f.mbits - f.emin),
                  NAN=(0x7F if fmt == "e4m3" else 0x7E), DOT_F32=interpreting())
    if not interpreting():
        common["num_warps"] = num_warps or (8 if tile * d >= 128 * 128 else 4)
        common["enable_fp_fusion"] = False  # RoPE's products round before the sum (see module doc)
    ys = strides(y, out_layout)
    args = [x, y.view(torch.uint8) if soft else y, cos, sin, pos, signs, hm, scal, mu, amax, desc,
            *strides(x, layout), *ys, stb, stn, std, spb, spn, smb, smh,
            desc.stride(0), desc.stride(1), desc.stride(2), h, n, group, per_prog]
    if code <= 1:
        _rope_quant_kernel[grid](*args, PASS=1, **common)
        _rope_quant_kernel[grid](*args, PASS=2, **common)
    else:
        _rope_quant_kernel[grid](*args, PASS=0, **common)
    return QuantOut(y, desc, out_layout, rows, group, code,
                    f"rope-quant tile{tile} w{common.get('num_warps', '-')} {'f64' if exact else 'f32-dot3'}")


_PERSIST_MAX_ROWS = 128
_SPLITS = {"bf16x3": 3, "bf16x3t": 5, "bf16x2": 2, "bf16x1": 1, "tf32x2": 4}
_PERSIST_TILE = 64
_PERSIST_STAGES = 3
_PERSIST_PPS = 2  # 4 warps at ~255 registers a thread: two programs fill an SM's register file


def _launch_persistent(x, cos, sin, pos, mu, layout, out_layout, f, fmt, code, rows, group, pow2, rope_code, full,
                       has_pos, rot, smooth, seed, soft, shape, tstrides, tile, num_warps, stages,
                       progs_per_sm, split="bf16x3", table_per_head=False) -> QuantOut:
    """``rope_persistent.rp_persistent``: row blocks of ``r`` rows (the scale block, or a tile),
    each for all heads; two passes for head and tensor scales."""
    from .quant_launch import launch, programs
    from .rope_persistent import half_matrices, rp_persistent

    b, h, n, d = shape
    dev = x.device
    interleaved = rope_code == 1
    if code == 2:
        tile = max(16, 1 << (rows - 1).bit_length())
        r = rows
    else:
        tile = max(16, tile or _PERSIST_TILE)
        r = tile
    nblk = -(-n // r)
    total = b * nblk
    hmat, sqrt_d = half_matrices(d, seed, interleaved, dev)  # cached: no host-to-device copy (CUDA graphs)
    out_shape = (b, n, h, d) if out_layout == "bshd" else (b, h, n, d)
    y = torch.empty(out_shape, dtype=f.torch_dtype, device=dev)
    desc = descale_buffer(code, b, h, n, r, group, dev)
    amax = torch.zeros(max(1, b * (h // group)) if code == 1 else 1, dtype=torch.int32, device=dev)
    st = stages or _PERSIST_STAGES
    common = dict(HALF=d // 2, TILE=tile, INTERLEAVED=interleaved, ROPE=rope_code != 0, FULL=bool(full),
                  HAS_POS=has_pos, ROT=bool(rot), SMOOTH=bool(smooth), GRAN=code, POW2=bool(pow2), MBITS=f.mbits,
                  EMIN=f.emin, FMT_MAX=f.max, OUT=tl_fp8(fmt), SOFT_CAST=soft, DIV=0 if interpreting() else 2,
                  STAGES=st, BIAS=(7 if fmt == "e4m3" else 15), SUBQ=2.0 ** (f.mbits - f.emin),
                  NAN=(0x7F if fmt == "e4m3" else 0x7E), DOT_F32=interpreting(), SPLIT=_SPLITS[split],
                  TABLE_PER_HEAD=bool(table_per_head))
    warps = num_warps or (8 if tile * d > 64 * 128 else 4)
    if not interpreting():
        common["num_warps"] = warps
        common["enable_fp_fusion"] = False  # RoPE's products round before the sum (see the module doc)
    pps = progs_per_sm or _PERSIST_PPS
    grid = (programs(dev, total, pps),)
    args = [x, y.view(torch.uint8) if soft else y, cos, sin, pos, hmat, sqrt_d, mu, amax, desc, *strides(x, layout),
            *strides(y, out_layout), *tstrides, desc.stride(0), desc.stride(1), desc.stride(2), h, n, group, r, nblk,
            total]
    how = [launch(rp_persistent, grid, args, {**common, "PASS": p}) for p in ((1, 2) if code <= 1 else (0,))]
    return QuantOut(y, desc, out_layout, rows, group, code,
                    f"rope-persistent tile{tile} w{warps} st{st} {grid[0]} programs ({pps}/SM)"
                    + (f" split {split}" if rot else " no rotation") + (" tables per head" if table_per_head else "")
                    + f" ({how[-1]} launch)")


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rope: str = "half",
              block: int = 0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RoPE of a contiguous (b, s, h, d) tensor with tables ``[T >= s, D/2 | D]``, in float32 and
    rounded once to ``out_dtype`` (default x's: the BF16 baseline, one read, one write). With
    ``out_dtype=torch.float32`` it returns the fused pre-pass's own RoPE values (the same device
    function), which is how the tests check that rounding bit for bit."""
    if x.dim() != 4 or not x.is_contiguous():
        raise UsageError("rope_bf16 takes a contiguous (b, s, h, d) tensor")
    b, s, h, d = x.shape
    if rope not in ("half", "interleaved"):
        raise UsageError(f"rope={rope!r}; half or interleaved")
    if cos.dim() != 2 or cos.shape[0] < s or cos.shape[-1] not in (d // 2, d) or cos.shape != sin.shape:
        raise UsageError(f"rope_bf16 takes [T >= {s}, {d // 2} or {d}] tables")
    if triton is None:
        raise UsageError(_NO_TRITON)
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)
    rows = b * s * h
    block = block or max(16, 8192 // d)
    kw = {} if interpreting() else dict(num_warps=4, enable_fp_fusion=False)
    _rope_bf16_kernel[(-(-rows // block),)](x, y, cos, sin, rows, s, h, cos.stride(0), cos.stride(1), D=d,
                                            ROPE=ROPE_LAYOUTS[rope], TABLE_FULL=cos.shape[-1] == d, BLOCK=block,
                                            **kw)
    return y


def min_bytes(x: torch.Tensor, out: QuantOut) -> int:
    """Bytes the pre-pass must move at least: the input read once, values and descales written once."""
    return x.numel() * x.element_size() + out.values.numel() * out.values.element_size() + out.descale.numel() * 4
