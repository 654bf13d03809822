"""Fused random-Hadamard rotation + scaled FP8 quantization in one Triton kernel.

Exposed: ``QuantOut``, ``rotate_quantize``, ``quantize_qkv``, ``GRAN_CODES``, ``min_bytes``.

Reads Q, K or V once in their own dtype and layout (BF16 (batch, seqlen, heads, dim) as a
model produces them, or the toolkit's float64 (batch, heads, seqlen, dim)), applies
``diag(signs) H_d / sqrt(d)`` along head_dim in registers, reduces the amax at the recipe's
granularity, and writes the saturated FP8 values in the layout the attention kernel reads,
plus float32 descales.

Granularity and passes over the input:

- ``block`` (rows per block, e.g. the kernel's tile) and ``token``: one program per block
  (or per group of rows); the block's amax is taken over sub-tiles and the sub-tiles are
  rotated again to quantize, so HBM sees each element once (the second read hits L2).
- ``head`` (one descale per (batch, kv-head), shared by the heads of a GQA group as the FA3
  kernel's q_descale is) and ``tensor``: a first pass reduces the amax with atomics, a second
  quantizes. No kernel can avoid this second read: every element's scale depends on every
  other element of the head.

Arithmetic, two modes:

- ``exact=True``: float64 throughout with the emulator's order of operations (the same
  butterflies, the division by sqrt(d), amax / fmt.max in float64 rounded to float32, x /
  descale in float64, round-to-odd to float32, one RNE cast). The bytes equal ``prepare()``'s.
- ``exact=False`` (the fast path): float32, the rotation as a butterfly or as one tensor-core
  dot with the +-1 matrix diag(signs) H (products exact for BF16/FP16 inputs, float32 sums).
  Rounding differs from the float64 emulator in rare near-ties; ``tests`` and the device run
  measure how often.

Rotation implementations: ``butterfly`` (fast Walsh-Hadamard transform, log2(d) stages of
reshape/split/join in registers) and ``dot`` (x @ (diag(s) H) on the tensor cores).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken

from ._common import f64_to_f32_odd, fp8_params, interpreting, pow2_ceil32, pow2_ceil64, round_fp8, tl, tl_fp8, triton

GRAN_CODES = {PerTensor: 0, PerHead: 1, PerBlock: 2, PerToken: 3}
_LAYOUTS = ("bshd", "bhsd", "bhds")


if triton is not None:

    @triton.jit
    def _stage(y, TILE: tl.constexpr, D: tl.constexpr, HH: tl.constexpr):
        """One butterfly stage: pairs (i, i + HH) inside blocks of 2 HH become (a + b, a - b), the
        emulator's fwht order, so float64 results are bit-identical to it."""
        z = tl.permute(tl.reshape(y, (TILE, D // (2 * HH), 2, HH)), (0, 1, 3, 2))
        a, b = tl.split(z)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (TILE, D))

    @triton.jit
    def _rotate(x, SIGNS, hm, scal_ptr, TILE: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr,
                ROT: tl.constexpr, EXACT: tl.constexpr):
        """x [TILE, D] (input dtype) -> rotated [TILE, D] in float64 (EXACT) or float32. ``hm``: the
        +-1 matrix diag(signs) H, loaded once per program (ROT 2)."""
        cols = tl.arange(0, D)
        if ROT == 2:
            # +-1 entries and BF16/FP16 inputs: every product is exact, the tensor core sums in float32.
            y = tl.dot(x.to(hm.dtype), hm, out_dtype=tl.float32) * tl.load(scal_ptr + 1)
        else:
            if EXACT:
                y = x.to(tl.float64)
            else:
                y = x.to(tl.float32)
            if ROT == 1:
                y = y * tl.load(SIGNS + cols)[None, :].to(y.dtype)
                # Stages h = 1, 2, 4, ... written out: a loop variable is not a constexpr in
                # Triton's interpreter, and the reshapes need constant shapes.
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
                if EXACT:
                    y = y / tl.load(scal_ptr)  # x / sqrt(d), as rotation.fwht divides
                else:
                    y = y * tl.load(scal_ptr + 1)
        return y

    @triton.jit
    def _descale(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr):
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
    def _cast(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
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
    def _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE: tl.constexpr, D: tl.constexpr,
                  LOG2D: tl.constexpr, ROT: tl.constexpr, EXACT: tl.constexpr):
        x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
        return _rotate(x, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)

    @triton.jit
    def _quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN: tl.constexpr,
                     MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                     POW2: tl.constexpr, EXACT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        if GRAN == 3:
            dt = _descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, EXACT)
            tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
            q = _cast(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, RECIP)
        else:
            q = _cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, RECIP)
        tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])

    @triton.jit
    def _rq_kernel(X, Y, SIGNS, HMAT, SCAL, AMAX, DESC,
                   sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                   H, N, GROUP, ROWS_PER_PROG,
                   D: tl.constexpr, LOG2D: tl.constexpr, TILE: tl.constexpr, SINGLE: tl.constexpr,
                   ROT: tl.constexpr, GRAN: tl.constexpr, PASS: tl.constexpr, EXACT: tl.constexpr,
                   POW2: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr,
                   OUT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        # PASS 0: block/token in one pass; 1: amax of a head/tensor (atomics); 2: quantize with it.
        # SINGLE: the program's rows fit one tile, which stays in registers between the amax and
        # the cast (one read of the input); otherwise sub-tiles are read again for the cast.
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
        if ROT == 2:
            hm = tl.load(HMAT + cols[:, None] * D + cols[None, :])
        else:
            hm = 0
        ai = 0
        if GRAN == 1:
            ai = b * (H // GROUP) + h // GROUP
        if SINGLE:
            rows = r0 + sub
            m = (rows < r_end) & (rows < N)
            y = _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)
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
                    y = _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)
                    run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
            amax = tl.max(run, axis=0)
        if PASS == 1:
            # Non-negative IEEE floats order like their bit patterns: integer atomics suffice.
            if EXACT:
                tl.atomic_max(AMAX + ai, amax.to(tl.int64, bitcast=True))
            else:
                tl.atomic_max(AMAX + ai, amax.to(tl.int32, bitcast=True))
        else:
            if GRAN <= 1:
                if EXACT:
                    amax = tl.load(AMAX + ai).to(tl.float64, bitcast=True)
                else:
                    amax = tl.load(AMAX + ai).to(tl.float32, bitcast=True)
            d32 = _descale(amax, FMT_MAX, POW2, EXACT)
            if GRAN == 2:
                tl.store(DESC + b * sdb + h * sdh + pid_t * sdn, d32)
            elif GRAN == 1:
                if (pid_t == 0) & (h % GROUP == 0):
                    tl.store(DESC + b * sdb + (h // GROUP) * sdh, d32)
            elif GRAN == 0:
                if (pid_t == 0) & (pid_bh == 0):
                    tl.store(DESC, d32)
            if SINGLE:
                _quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN, MBITS, EMIN,
                             FMT_MAX, OUT, POW2, EXACT, SOFT_CAST, RECIP)
            else:
                for i in range(0, ROWS_PER_PROG, TILE):
                    rows = r0 + i + sub
                    m = (rows < r_end) & (rows < N)
                    y = _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)
                    _quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN, MBITS,
                                 EMIN, FMT_MAX, OUT, POW2, EXACT, SOFT_CAST, RECIP)


@dataclasses.dataclass
class QuantOut:
    """FP8 values and float32 descales as the attention kernels read them.

    ``values``: FP8 in ``layout`` (bhsd: (batch, heads, seqlen, dim); bshd: (batch, seqlen,
    heads, dim), FA3's; bhds: (batch, heads, dim, seqlen), V transposed for K-major FP8 MMAs).
    ``descale``: float32 (b, h // group, n_desc) for block (n_desc = blocks of ``rows``) and token
    (rows = 1); (b, h // group, 1) for head; (1, 1, 1) for tensor. ``rows``: tokens per descale.
    """

    values: torch.Tensor
    descale: torch.Tensor
    layout: str
    rows: int  # tokens per descale along seqlen
    group: int  # heads per descale
    gran: int  # GRAN_CODES value

    def values_bhsd(self) -> torch.Tensor:
        v = self.values
        if self.layout == "bshd":
            return v.transpose(1, 2)
        if self.layout == "bhds":
            return v.transpose(2, 3)
        return v

    def descale_like_prepare(self, heads: int, seqlen: int) -> torch.Tensor:
        """The emulator's broadcast form: [b, heads, 1 or seqlen, 1], or [1, 1, 1, 1] per tensor."""
        d = self.descale
        if self.gran == 0:
            return d.reshape(1, 1, 1, 1)
        if self.gran == 1:
            return d.repeat_interleave(self.group, dim=1).unsqueeze(-1)
        return d.repeat_interleave(self.rows, dim=2)[:, :, :seqlen].unsqueeze(-1)


def _strides(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides of a 4-d tensor in ``layout``."""
    s = x.stride()
    if layout == "bshd":
        return s[0], s[2], s[1], s[3]
    if layout == "bhsd":
        return s[0], s[1], s[2], s[3]
    if layout == "bhds":
        return s[0], s[1], s[3], s[2]
    raise UsageError(f"unknown layout {layout!r}; one of {', '.join(_LAYOUTS)}")


def _dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    if layout == "bshd":
        b, n, h, d = x.shape
    elif layout == "bhsd":
        b, h, n, d = x.shape
    else:
        b, h, d, n = x.shape
    return b, h, n, d


_CONST_CACHE: dict = {}


def _constants(d: int, seed: int, device, exact: bool, dot_dtype):
    key = (d, seed, str(device), exact, dot_dtype)
    if key not in _CONST_CACHE:
        from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

        signs = random_signs(d, seed)
        hm = (signs[:, None] * hadamard_matrix(d)).to(dot_dtype or torch.bfloat16)
        scal = torch.tensor([d ** 0.5, 1.0 / d ** 0.5], dtype=torch.float64)
        ct = torch.float64 if exact else torch.float32
        _CONST_CACHE[key] = (signs.to(device=device, dtype=ct), hm.contiguous().to(device),
                             scal.to(device=device, dtype=ct))
    return _CONST_CACHE[key]


def rotate_quantize(x: torch.Tensor, *, layout: str = "bshd", fmt: str = "e4m3", gran=None, block_rows: int = 0,
                    group: int = 1, pow2: bool = False, rot: str = "none", seed: int = 0, exact: bool = False,
                    out_layout: str = "bhsd", impl: str = "auto", soft_cast: bool | None = None, tile: int = 0,
                    num_warps: int = 0, recip: bool = False) -> QuantOut:
    """Rotate (Hadamard or none) and quantize ``x`` into FP8 in one fused kernel (see module doc).

    ``gran``: a granularity object (``PerHead()`` default); ``block_rows`` fills ``PerBlock(0)``;
    ``group``: heads sharing one per-head descale (Q under GQA: heads // kv_heads). ``tile`` (rows
    per sub-tile), ``num_warps`` and ``recip`` (multiply by 1/descale) tune the fast path.
    """
    gran = PerHead() if gran is None else gran
    f = fp8_params(fmt)
    if layout not in _LAYOUTS or out_layout not in _LAYOUTS:
        raise UsageError(f"layouts must be among {', '.join(_LAYOUTS)}")
    if rot not in ("none", "hadamard"):
        raise UsageError(f"rot={rot}: the fused kernel applies the random Hadamard rotation only "
                         "(use the emulator's prepare() for rot=orthogonal)")
    b, h, n, d = _dims(x, layout)
    if d & (d - 1) or not 16 <= d <= 256:
        raise UsageError(f"head_dim {d}: the fused kernel needs a power of two in [16, 256] (Triton tiles)")
    if h % group:
        raise UsageError(f"{h} heads are not a multiple of the descale group {group}")
    if isinstance(gran, PerBlock):
        rows = gran.rows or block_rows
        if not rows:
            raise UsageError("block granularity needs block_rows (the kernel's tile)")
    elif isinstance(gran, PerToken):
        rows = 1
    else:
        rows = n
    code = GRAN_CODES[type(gran)]
    if not isinstance(gran, PerHead):
        group = 1
    if impl == "auto":
        narrow = x.dtype in (torch.bfloat16, torch.float16)
        impl = "dot" if (not exact and narrow and not interpreting()) else "butterfly"
    if impl == "dot" and (exact or x.dtype not in (torch.bfloat16, torch.float16)):
        raise UsageError("impl=dot multiplies on the tensor cores: BF16/FP16 inputs and exact=False only")
    rot_code = 0 if rot == "none" else (2 if impl == "dot" else 1)
    soft = interpreting() if soft_cast is None else soft_cast
    dev = x.device
    signs, hm, scal = _constants(d, seed, dev, exact, x.dtype if rot_code == 2 else None)

    out_shape = {"bshd": (b, n, h, d), "bhsd": (b, h, n, d), "bhds": (b, h, d, n)}[out_layout]
    y = torch.empty(out_shape, dtype=f.torch_dtype, device=dev)
    if code == 2:
        nd = -(-n // rows)
        desc = torch.empty((b, h, nd), dtype=torch.float32, device=dev)
    elif code == 3:
        desc = torch.empty((b, h, n), dtype=torch.float32, device=dev)
    elif code == 1:
        desc = torch.empty((b, h // group, 1), dtype=torch.float32, device=dev)
    else:
        desc = torch.empty((1, 1, 1), dtype=torch.float32, device=dev)
    # The fast path keeps a whole tile (up to 256 rows x d in float32) in registers and reads the
    # input once; the float64 path works in sub-tiles of 32 rows (registers) and re-reads a block.
    if code == 2:
        per_prog = rows
        tile = tile or (32 if exact else max(16, 1 << (rows - 1).bit_length()))
        if tile * d > 256 * 128:
            tile = max(16, (256 * 128) // d)
    else:
        # 64 rows, 4 warps: fastest of 32/64/128 rows measured on the H200 for per-token and per-head
        # (reports/h200/triton/quant.csv, run 3): more programs per SM hide the loads' latency.
        tile = tile or (32 if exact else 64)
        per_prog = tile if not exact else 8 * tile
    single = per_prog <= tile
    grid = (-(-n // per_prog), b * h)
    amax = torch.zeros(max(1, b * (h // group)) if code == 1 else 1,
                       dtype=torch.int64 if exact else torch.int32, device=dev)
    common = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, SINGLE=single, ROT=rot_code, GRAN=code, EXACT=exact,
                  POW2=bool(pow2), MBITS=f.mbits, EMIN=f.emin, FMT_MAX=f.max, OUT=tl_fp8(fmt), SOFT_CAST=soft,
                  RECIP=bool(recip) and not exact)
    if not interpreting():
        common["num_warps"] = num_warps or (8 if tile * d >= 128 * 128 else 4)
    args = [x, y, signs, hm, scal, amax, desc, *_strides(x, layout), *_strides(y, out_layout),
            desc.stride(0), desc.stride(1), desc.stride(2), h, n, group]
    if code <= 1:
        _rq_kernel[grid](*args, per_prog, PASS=1, **common)
        _rq_kernel[grid](*args, per_prog, PASS=2, **common)
    else:
        _rq_kernel[grid](*args, per_prog, PASS=0, **common)
    return QuantOut(y, desc, out_layout, rows, group, code)


def min_bytes(x: torch.Tensor, out: QuantOut) -> int:
    """Bytes a quantizer must move at least: the input read once, values and descales written once."""
    return x.numel() * x.element_size() + out.values.numel() * out.values.element_size() + out.descale.numel() * 4


def quantize_qkv(recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bshd",
                 rotation_seed: int = 0, causal: bool = False, exact: bool = False, impl: str = "auto",
                 v_layout: str = "bhds", qk_layout: str = "bhsd", soft_cast: bool | None = None):
    """Q, K, V of one recipe through the fused kernel, with the emulator's tiles for block scales.

    Returns (q, k, v) ``QuantOut``s: Q and K rotated per the recipe, V not rotated (as
    ``prepare``), V written in ``v_layout`` (default transposed for the attention kernel).
    """
    b, h, n, d = _dims(q, layout)
    hkv = _dims(k, layout)[1]
    bm, bn = recipe.tiles(d, causal)
    g = recipe.gran
    kw = dict(layout=layout, pow2=recipe.pow2, exact=exact, impl=impl, soft_cast=soft_cast)
    qo = rotate_quantize(q, fmt=recipe.qk, gran=g, block_rows=bm, group=h // hkv, rot=recipe.rot, seed=rotation_seed,
                         out_layout=qk_layout, **kw)
    ko = rotate_quantize(k, fmt=recipe.qk, gran=g, block_rows=bn, rot=recipe.rot, seed=rotation_seed,
                         out_layout=qk_layout, **kw)
    vo = rotate_quantize(v, fmt=recipe.v, gran=g, block_rows=bn, rot="none", out_layout=v_layout, **kw)
    return qo, ko, vo
