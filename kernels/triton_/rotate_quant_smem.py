"""Per-block rotate-and-quantize with the block's inputs resident in shared memory (Gluon, sm_90).

Exposed: ``rotate_quantize_smem`` (``rotate_quant.rotate_quantize(..., reread="smem")``),
``smem_problem``, ``split_matrices``.

Why a second kernel: in ``quant_persistent.rq_persistent`` a block longer than two 64-row sub-tiles
(FA3's FP8 K tile: 224 rows at head_dim 128) must wait for its amax before any row can be cast.
Triton's ``tl`` gives no hold on the pipeline's shared-memory buffers, so the block's rows are
either kept rotated in registers (one program per SM fits) or loaded a second time from L2 (half
the pipeline's slots spent on the second pass): 56-57% of a copy on the H200. Here the block's
BF16 inputs are loaded by TMA into a ring of shared memory that this kernel owns, rotated once for
the amax and again from the same buffers for the cast; a sub-tile's buffers take the next block's
TMA load as soon as its second rotation has read them. HBM reads each element once, L2 nothing
twice. With the last sub-tile rotated twice (168 registers: 3 programs per SM) and power-of-two
descales cast with one multiply, a 224-row K tile moves at 83% of a copy on the H200 (76% with
amax descales; probe p13, reports/h200/triton/report.md): ``rotate_quantize``'s default for
blocks of more than 128 rows where this kernel runs.

The rotation is split (Sylvester order, as ``rotation.hadamard_matrix``): H_d = H_P' kron H_P with
P = d / parts, so for column parts x_i and their signs S_i

    x diag(s) H_d = [sum_i H_parts[i, c] x_i (S_i H_P)  for c = 0 .. parts - 1]

and each pass is ``parts`` tensor-core products of K = N = P plus a butterfly in float32 (2 parts:
half the multiply-adds of one d x d product and 16 KB of +-1 matrices at d 128, not 32). The
products are exact (BF16 inputs, +-1 entries), the sums float32, so the values differ from the
one-product kernel (and from the float64 emulator) only where a float32 rounding of another
summation order moves a value across an FP8 rounding boundary: on the H200 as often as the
one-product kernel's (the device run counts them).

Rows: sub-tiles of 64 rows (one warpgroup's MMA); a block whose last sub-tile has 32 rows (224 =
3 x 64 + 32) keeps that one in 32-row buffers; pass 2 casts it first (rotated again, or kept in
registers from pass 1 with ``keep_last``: 230 registers, 2 programs per SM), after which those
buffers stage the FP8 tiles of the other sub-tiles (72 KB of shared memory at 224 rows). Rows past the sequence's end
are zero-filled by the TMA loads, masked out of the amax and clipped by the TMA stores.
"""

from __future__ import annotations

import torch

from fa3_numerics.errors import UsageError

from .quant_launch import dims, fit_per_sm, programs

try:  # Gluon ships with triton >= 3.5; absent, smem_problem says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - exercised where triton is absent or older
    gluon = gl = None


if gluon is not None:
    from .quant_device import work_item  # work item -> (batch, head, block): the tl kernel's, scalar arithmetic

    @gluon.jit
    def _unit(J: gl.constexpr, C: gl.constexpr, SUB: gl.constexpr, NP: gl.constexpr, SHORT: gl.constexpr):
        """First ring unit (U = TILE / 2 rows of one PART-column part) of part C of the block's
        sub-tile J; a part of a full sub-tile is two units. With SHORT (the block's last sub-tile
        has U rows, e.g. 224 = 3 x 64 + 32) its parts are one unit each, units 0 .. NP - 1; its
        products still read TILE rows from there, the rows past U being the next unit's (finite
        or not, they only reach output rows that are masked off and never stored: each row of
        x H depends on that row of x alone)."""
        if SHORT:
            if J == SUB - 1:
                return C
            else:
                return NP + 2 * (NP * J + C)
        else:
            return 2 * (NP * J + C)

    @gluon.jit
    def _issue(x_desc, xl_desc, xs, bars, t, pred, H, NBLK, R, XOB, XOH, XCH, J: gl.constexpr, TILE: gl.constexpr,
               PART: gl.constexpr, NP: gl.constexpr, SUB: gl.constexpr, SHORT: gl.constexpr,
               HEAD_FAST: gl.constexpr):
        """TMA loads of the NP column parts of sub-tile J of item t into its units; barrier J."""
        b, h, blk = work_item(t, H, NBLK, HEAD_FAST)
        r0 = blk * R + J * TILE
        o = b * XOB + h * XOH
        c_ = h * XCH
        bar = bars.index(J)
        if SHORT and J == SUB - 1:
            mbarrier.expect(bar, NP * xl_desc.block_type.nbytes, pred)
            for c in gl.static_range(NP):
                tma.async_copy_global_to_shared(xl_desc, [o, r0, c_ + c * PART], bar,
                                                xs.index(_unit(J, c, SUB, NP, SHORT)), pred)
        else:
            mbarrier.expect(bar, NP * x_desc.block_type.nbytes, pred)
            for c in gl.static_range(NP):
                dst = xs.index(_unit(J, c, SUB, NP, SHORT))._reinterpret(gl.bfloat16, [1, TILE, PART], x_desc.layout)
                tma.async_copy_global_to_shared(x_desc, [o, r0, c_ + c * PART], bar, dst, pred)

    @gluon.jit
    def _mma(xs, hs, zero, J: gl.constexpr, C: gl.constexpr, X2: gl.constexpr, SUB: gl.constexpr,
             NP: gl.constexpr, SHORT: gl.constexpr):
        a = xs.index(_unit(J, C, SUB, NP, SHORT))._reinterpret(gl.bfloat16, zero.shape, X2)
        return warpgroup_mma(a, hs.index(C), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _rotate(xs, hs, zero, J: gl.constexpr, X2: gl.constexpr, SUB: gl.constexpr, NP: gl.constexpr,
                SHORT: gl.constexpr):
        """Sub-tile J rotated: the NP products p_i = x_i (S_i H_PART) on the tensor cores, then the
        output column blocks out_c = sum_i H_NP[i, c] p_i in float32 (a butterfly). A 4-tuple:
        with NP 2 its last two are unused."""
        p0 = _mma(xs, hs, zero, J, 0, X2, SUB, NP, SHORT)
        p1 = _mma(xs, hs, zero, J, 1, X2, SUB, NP, SHORT)
        if NP == 4:
            p2 = _mma(xs, hs, zero, J, 2, X2, SUB, NP, SHORT)
            p3 = _mma(xs, hs, zero, J, 3, X2, SUB, NP, SHORT)
            p0, p1, p2, p3 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1, p2, p3))
            a = p0 + p1
            b = p0 - p1
            c = p2 + p3
            d = p2 - p3
            return a + c, b + d, a - c, b - d
        else:
            p0, p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1))
            return p0 + p1, p0 - p1, p0, p1

    @gluon.jit
    def _row_max(run, o, rows, lim, NP: gl.constexpr):
        """Running row maxima of |out_c| over the rows below ``lim``."""
        m = gl.max(gl.abs(o[0]), axis=1)
        for c in gl.static_range(1, NP):
            m = gl.maximum(m, gl.max(gl.abs(o[c]), axis=1))
        return gl.maximum(run, gl.where(rows < lim, m, 0.0))

    @gluon.jit
    def _block_descale(am, FMT_MAX: gl.constexpr, POW2: gl.constexpr):
        """A block's amax -> (descale, its float32 reciprocal), as quant.amax_to_scale: amax / max,
        1 where that is 0 or not finite, with POW2 rounded up to a power of two (as
        quant_device.tile_descale)."""
        s = gl.div_rn(am, am * 0.0 + FMT_MAX)
        s = gl.where((s > 0) & (s < float("inf")), s, 1.0)
        if POW2:
            bits = s.to(gl.int32, bitcast=True)
            ex = (bits >> 23) & 0xFF
            ex = gl.where((bits & 0x7FFFFF) != 0, ex + 1, ex)
            s = (ex << 23).to(gl.float32, bitcast=True)
        return s, gl.div_rn(s * 0.0 + 1.0, s)

    @gluon.jit
    def _scale_cast(y, d32, r, OUT: gl.constexpr):
        """y / descale correctly rounded (reciprocal and one Markstein correction, as
        quant_device.scale_cast DIV 2), then the saturating FP8 cast (cvt.rn.satfinite)."""
        v = y * r
        lay: gl.constexpr = y.type.layout
        rt = gl.full(y.shape, r, gl.float32, lay)  # splats (registers), not v * 0 + r per element
        nd = gl.full(y.shape, 0.0 - d32, gl.float32, lay)
        v = gl.fma(rt, gl.fma(v, nd, y), v)
        return v.to(OUT)

    @gluon.jit
    def _cast_store(o, inv, s, r, m, ys, y_desc, yl_desc, yo, yc, r0, J: gl.constexpr, TILE: gl.constexpr,
                    PART: gl.constexpr, NP: gl.constexpr, SUB: gl.constexpr, SHORT: gl.constexpr,
                    IN_RING: gl.constexpr, MUL: gl.constexpr):
        """out_c / sqrt(d) / descale to FP8 through a staging tile per part and TMA stores; a short last
        sub-tile stores its first U rows. IN_RING: ``ys`` is the ring, whose units 0 .. NP - 1 (the
        short last sub-tile's, free during pass 2 once it is cast: U rows of BF16 are the bytes of
        TILE rows of FP8) are the staging tiles. MUL: one multiply by ``m`` = (1/sqrt(d)) / descale,
        exact for a power-of-two descale (see the caller)."""
        Y2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, PART], y_desc.dtype)
        tma.store_wait(pendings=0)  # the previous sub-tile's stores have read the staging tiles
        gl.thread_barrier()
        for c in gl.static_range(NP):
            if MUL:
                q = (o[c] * m).to(y_desc.dtype)
            else:
                q = _scale_cast(o[c] * inv, s, r, y_desc.dtype)
            ys.index(c)._reinterpret(y_desc.dtype, [TILE, PART], Y2).store(q)
        fence_async_shared()
        gl.thread_barrier()
        for c in gl.static_range(NP):
            if IN_RING:
                st = ys.index(c)._reinterpret(y_desc.dtype, [1, TILE, PART], y_desc.layout)
            else:
                st = ys.index(c)
            if SHORT and J == SUB - 1:
                tma.async_copy_shared_to_global(yl_desc, [yo, r0, yc + c * PART], st.slice(0, TILE // 2, dim=1))
            else:
                tma.async_copy_shared_to_global(y_desc, [yo, r0, yc + c * PART], st)

    @gluon.jit
    def _rq_block_smem(x_desc, xl_desc, y_desc, yl_desc, h_desc, SQRT_D, DESC, sdb, sdh, sdn,
                       H, N, R, NBLK, TOTAL, XOB, XOH, XCH, YOB, YOH, YCH,
                       TILE: gl.constexpr, PART: gl.constexpr, NP: gl.constexpr, SUB: gl.constexpr,
                       SHORT: gl.constexpr, KEEP_LAST: gl.constexpr, STAGE_IN_RING: gl.constexpr,
                       POW2: gl.constexpr, MUL: gl.constexpr, FMT_MAX: gl.constexpr, HEAD_FAST: gl.constexpr,
                       num_warps: gl.constexpr):
        """Persistent: program pid takes items pid, pid + programs, ... (a block of R rows of one
        (batch, head)). The ring holds one block, sub-tile J in its units with mbarrier J.

        Per block: pass 1 waits for each sub-tile, rotates it, and takes the row maxima; the amax
        gives the descale. Pass 2 rotates each sub-tile again from the same units, hands the
        units to the next block's sub-tile (TMA load) at once, and casts and stores the values
        through staging tiles. KEEP_LAST: the last sub-tile's rotation stays in registers from
        pass 1 and is cast first, without a second rotation; its units are refilled at once, or,
        with STAGE_IN_RING and a 32-row last sub-tile, serve as the staging tiles of pass 2 and are
        refilled at its end (no staging buffer: 72 KB at 224 rows)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        nb = gl.cdiv(TOTAL - pid, nprog)
        X2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, PART], gl.bfloat16)
        NU: gl.constexpr = NP + 2 * NP * (SUB - 1) if SHORT else 2 * NP * SUB
        xs = gl.allocate_shared_memory(gl.bfloat16, [NU] + xl_desc.block_type.shape, xl_desc.layout)
        IN_RING: gl.constexpr = SHORT and STAGE_IN_RING  # FP8 staged in the short last sub-tile's units
        FIRST: gl.constexpr = 1 if (KEEP_LAST or IN_RING) else 0  # the last sub-tile is cast first in pass 2
        if IN_RING:
            ys = xs
        else:
            ys = gl.allocate_shared_memory(y_desc.dtype, [NP] + y_desc.block_type.shape, y_desc.layout)
        hs = gl.allocate_shared_memory(gl.bfloat16, [NP] + h_desc.block_type.shape, h_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SUB + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SUB + 1):
            mbarrier.init(bars.index(i), count=1)
        hb = bars.index(SUB)
        mbarrier.expect(hb, NP * h_desc.block_type.nbytes)
        for c in gl.static_range(NP):
            tma.async_copy_global_to_shared(h_desc, [c * PART, 0], hb, hs.index(c))
        for j in gl.static_range(SUB):
            _issue(x_desc, xl_desc, xs, bars, pid, nb > 0, H, NBLK, R, XOB, XOH, XCH, j, TILE, PART, NP, SUB, SHORT,
                   HEAD_FAST)
        mbarrier.wait(hb, 0)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, PART, 16])
        zero = gl.zeros([TILE, PART], gl.float32, mma)
        rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, mma))
        inv = gl.load(SQRT_D + 1)  # 1/sqrt(d) in float32
        for k in range(nb):
            t = pid + k * nprog
            b, h, blk = work_item(t, H, NBLK, HEAD_FAST)
            b0 = blk * R
            lim = gl.minimum(R, N - b0)  # rows of this block (fewer at the sequence's end)
            # pass 1: the block's amax. Row maxima before the multiply by 1/sqrt(d): rounding is
            # monotonic, so fl(max|a| s) = max fl(|a| s), one multiply per block.
            run = gl.zeros([TILE], gl.float32, gl.SliceLayout(1, mma))
            for j in gl.static_range(SUB):
                mbarrier.wait(bars.index(j), k & 1)
                o = _rotate(xs, hs, zero, j, X2, SUB, NP, SHORT)
                run = _row_max(run, o, rows, lim - j * TILE, NP)
            am = gl.max(run, axis=0) * inv
            s, r = _block_descale(am, FMT_MAX, POW2)
            gl.store(DESC + b * sdb + h * sdh + blk * sdn, s)
            # MUL (power-of-two descales only): r = 2^-e exactly, so inv * r is exact and o * (inv r)
            # rounds the same real number as (o * inv) / s, once: the corrected division's bytes
            # for one multiply an element instead of six
            m = inv * r
            yo = b * YOB + h * YOH
            yc = h * YCH
            more = k + 1 < nb
            if FIRST:  # the last sub-tile first: kept in registers (o) or rotated again
                if not KEEP_LAST:
                    o = _rotate(xs, hs, zero, SUB - 1, X2, SUB, NP, SHORT)
                if not IN_RING:  # its units take the next block's sub-tile now
                    _issue(x_desc, xl_desc, xs, bars, t + nprog, more, H, NBLK, R, XOB, XOH, XCH, SUB - 1, TILE, PART,
                           NP, SUB, SHORT, HEAD_FAST)
                _cast_store(o, inv, s, r, m, ys, y_desc, yl_desc, yo, yc, b0 + (SUB - 1) * TILE, SUB - 1, TILE,
                            PART, NP, SUB, SHORT, IN_RING, MUL)
            # pass 2: rotate again, refill the units with the next block's sub-tile, cast, store
            for j in gl.static_range(SUB - FIRST):
                o = _rotate(xs, hs, zero, j, X2, SUB, NP, SHORT)
                _issue(x_desc, xl_desc, xs, bars, t + nprog, more, H, NBLK, R, XOB, XOH, XCH, j, TILE, PART, NP, SUB,
                       SHORT, HEAD_FAST)
                _cast_store(o, inv, s, r, m, ys, y_desc, yl_desc, yo, yc, b0 + j * TILE, j, TILE, PART, NP, SUB,
                            SHORT, IN_RING, MUL)
            if IN_RING:  # the staging units take the next block's short sub-tile once its stores have read them
                tma.store_wait(pendings=0)
                gl.thread_barrier()
                _issue(x_desc, xl_desc, xs, bars, t + nprog, more, H, NBLK, R, XOB, XOH, XCH, SUB - 1, TILE, PART, NP,
                       SUB, SHORT, HEAD_FAST)
        tma.store_wait(pendings=0)
        for i in gl.static_range(SUB + 1):
            mbarrier.invalidate(bars.index(i))


_TILE = 64  # rows of a sub-tile: one warpgroup's MMA (M = 64)
_MAX_ROWS = 512  # 128 KB of ring; a Hopper program has at most 227 KB of shared memory
_SPLIT_CACHE: dict = {}


def split_matrices(d: int, seed: int, device, parts: int = 2) -> torch.Tensor:
    """[S_0 H_P; S_1 H_P; ...] (P = d / parts, S_i the signs of column part i) as a (d, P) BF16
    tensor: the factors of the split rotation diag(s) H_d = diag(s) (H_parts kron H_P)."""
    key = (d, seed, str(device), parts)
    if key not in _SPLIT_CACHE:
        from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

        s = random_signs(d, seed)
        pw = d // parts
        h = hadamard_matrix(pw)
        m = torch.cat([s[i * pw:(i + 1) * pw, None] * h for i in range(parts)], 0)
        _SPLIT_CACHE[key] = m.to(torch.bfloat16).contiguous().to(device)
    return _SPLIT_CACHE[key]


def hopper_bf16_problem(x: torch.Tensor, kernel: str, units: str) -> str | None:
    """The checks every shared-memory (Gluon) kernel shares: Gluon present, a Hopper GPU (its
    ``units``), BF16 inputs; ``kernel`` names it in the reason."""
    if gluon is None:
        return f"{kernel} needs Gluon (triton >= 3.5)"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return f"{kernel} is written for Hopper (sm_90: {units})"
    if x.dtype != torch.bfloat16:
        return f"{kernel} reads BF16 inputs"
    return None


def smem_problem(x: torch.Tensor, layout: str, out_layout: str, rows: int, d: int, rot: str) -> str | None:
    """Why this kernel cannot run a case, or None."""
    why = hopper_bf16_problem(x, "the shared-memory kernel", "TMA and wgmma")
    if why:
        return why
    if rot != "hadamard":
        return "the shared-memory kernel applies the split Hadamard rotation (rot=hadamard)"
    if layout not in ("bshd", "bhsd") or out_layout not in ("bshd", "bhsd"):
        return "the shared-memory kernel reads and writes rows of head_dim ((b, s, h, d) or (b, h, s, d))"
    if d != 128:
        return "the shared-memory kernel is built for head_dim 128"
    if not x.is_contiguous():
        return "the shared-memory kernel needs a contiguous input (TMA descriptor)"
    if rows > _MAX_ROWS:
        return f"the shared-memory kernel holds a block in shared memory: at most {_MAX_ROWS} rows"
    if rows % (_TILE // 2) or rows < _TILE:
        # a 32-row last sub-tile's product reads on into the next sub-tile's buffers: there must be one
        return f"the shared-memory kernel needs blocks of a multiple of {_TILE // 2} rows, at least {_TILE}"
    return None


_RESIDENT: dict = {}


def resident(kernel, args, kw: dict, estimate: int) -> int:
    """Programs of the compiled Gluon ``kernel`` that fit one SM by its registers and shared
    memory (a persistent grid of more would run a second wave), at most 4; compiled once per
    kernel and configuration. ``estimate``: the caller's count where no compiled kernel's
    resources can be read."""
    key = (kernel.fn.__name__, tuple(sorted(kw.items())))
    if key not in _RESIDENT:
        try:
            fit = fit_per_sm(kernel.warmup(*args, grid=(1,), **kw), kw["num_warps"])
        except Exception:  # noqa: BLE001 - no compiled kernel's resources
            fit = estimate
        _RESIDENT[key] = max(1, min(4, fit))
    return _RESIDENT[key]


def _view3(t: torch.Tensor, layout: str) -> tuple[torch.Tensor, int, int, int]:
    """A (outer, seqlen, inner) view for the TMA descriptor and the coordinate rule
    outer = b * OB + h * OH, inner = h * CH (+ the column half)."""
    if layout == "bshd":
        b, n, h, d = t.shape
        return t.view(b, n, h * d), 1, 0, d
    b, h, n, d = t.shape
    return t.view(b * h, n, d), h, 1, 0


def rotate_quantize_smem(x: torch.Tensor, y: torch.Tensor, desc: torch.Tensor, sqrt_d: torch.Tensor, *,
                         layout: str, out_layout: str, rows: int, pow2: bool, seed: int, fmt_max: float,
                         keep_last: bool = False, parts: int = 2, stage_in_ring: bool = True, progs_per_sm: int = 0,
                         head_fast: bool | None = None, max_regs: int = 0, pow2_mul: bool = True) -> str:
    """Fill ``y`` (FP8, ``out_layout``) and ``desc`` (float32 (b, h, blocks)) for per-block scales of
    ``rows`` rows (a multiple of 32); ``sqrt_d``: [sqrt(d), 1/sqrt(d)] in float32 on the device (as
    ``quant_launch.rotation_constants`` makes it); returns the launch description. ``parts``:
    column parts of the split rotation (2 or 4); ``keep_last``: the last sub-tile stays rotated in
    registers between the passes (230 registers at 224 rows: 2 programs per SM) instead of rotated
    twice (168: 3 per SM, faster on the H200); ``stage_in_ring``: with a 32-row last sub-tile, cast
    first in pass 2, its buffers stage the FP8 tiles (no staging buffer: 72 KB at 224 rows
    instead of 80). ``pow2_mul``: power-of-two descales cast with one multiply by
    (1/sqrt(d)) / descale (exact) instead of the corrected division. ``progs_per_sm`` defaults to
    what the compiled kernel's registers and shared memory fit."""
    b, h, n, d = dims(x, layout)
    if parts not in (2, 4):
        raise UsageError(f"parts={parts}: the split rotation takes 2 or 4 column parts")
    tile, pw = _TILE, d // parts
    unit = tile // 2
    if rows % unit:
        raise UsageError(f"block of {rows} rows: the shared-memory kernel needs a multiple of {unit}")
    sub = -(-rows // tile)
    short = rows - (sub - 1) * tile == unit
    nblk = -(-n // rows)
    total = b * h * nblk
    x3, xob, xoh, xch = _view3(x, layout)
    y3, yob, yoh, ych = _view3(y, out_layout)
    # Host-side TMA descriptors, made per call: a cache of them would hold the tensors alive.
    xd, xld, yd, yld = (TensorDescriptor.from_tensor(t3, [1, r_, pw],
                                                     gl.NVMMASharedLayout.get_default_for([1, r_, pw], dt))
                        for t3, dt, r_ in ((x3, gl.bfloat16, tile), (x3, gl.bfloat16, unit),
                                           (y3, gl.float8e4nv, tile), (y3, gl.float8e4nv, unit)))
    hkey = ("h", d, seed, parts, str(x.device))
    if hkey not in _SPLIT_CACHE:
        lh = gl.NVMMASharedLayout.get_default_for([pw, pw], gl.bfloat16)
        _SPLIT_CACHE[hkey] = TensorDescriptor.from_tensor(split_matrices(d, seed, x.device, parts), [pw, pw], lh)
    hd = _SPLIT_CACHE[hkey]
    if head_fast is None:
        head_fast = layout == "bshd"
    args = (xd, xld, yd, yld, hd, sqrt_d, desc, desc.stride(0), desc.stride(1), desc.stride(2),
            h, n, rows, nblk, total, xob, xoh, xch, yob, yoh, ych)
    kw = dict(TILE=tile, PART=pw, NP=parts, SUB=sub, SHORT=bool(short), KEEP_LAST=bool(keep_last),
              STAGE_IN_RING=bool(stage_in_ring), POW2=bool(pow2), MUL=bool(pow2 and pow2_mul),
              FMT_MAX=float(fmt_max), HEAD_FAST=bool(head_fast), num_warps=4)
    if max_regs:
        kw["maxnreg"] = max_regs
    nu = parts + 2 * parts * (sub - 1) if short else 2 * parts * sub
    in_ring = short and stage_in_ring  # the FP8 staging tiles in the short last sub-tile's units
    smem = nu * unit * pw * 2 + (0 if in_ring else parts * tile * pw) + parts * pw * pw * 2 + 1024
    # without a compiled kernel's resources: 255 registers a thread and the shared memory above
    est = min(65536 // (256 * 32 * kw["num_warps"]), (228 * 1024) // (smem + 1024))
    pps = progs_per_sm or resident(_rq_block_smem, args, kw, est)
    grid = (programs(x.device, total, pps),)
    _rq_block_smem[grid](*args, **kw)
    return (f"gluon smem tile{tile} x{sub}{' short-last' if short else ''}{' keep-last' if keep_last else ''}"
            f"{' staged-in-ring' if in_ring else ''} "
            f"split-rotation {parts} parts w4{f' r{max_regs}' if max_regs else ''} pps{pps}{' pow2-mul' if kw['MUL'] else ''}"
            + ("" if head_fast else " seq-first"))


__all__ = ["rotate_quantize_smem", "smem_problem", "split_matrices"]
