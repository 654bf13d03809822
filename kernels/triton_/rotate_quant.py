"""Fused random-Hadamard rotation + scaled FP8 quantization: which kernel runs a call, with which
launch (the tuning tables measured on the H200), and the calls the backends make.

Exposed: ``QuantOut``, ``rotate_quantize``, ``quantize_qkv``, ``GRAN_CODES``, ``min_bytes``,
``smem_candidate``, ``fit_per_sm``.

Reads Q, K or V once in their own dtype and layout (BF16 (batch, seqlen, heads, dim) as a
model produces them, or the toolkit's float64 (batch, heads, seqlen, dim)), applies
``diag(signs) H_d / sqrt(d)`` along head_dim in registers, reduces the amax at the recipe's
granularity, and writes the saturated FP8 values in the layout the attention kernel reads,
plus float32 descales.

Granularity and passes over the input:

- ``block`` (rows per block, e.g. the kernel's tile) and ``token``: one pass. In the fast
  path's persistent kernel a block of up to 64 rows (at head_dim 128) is one tile; a longer
  block (the FA3 FP8 tiles: 128 rows of Q, 224 of K/V) is walked as 64-row sub-tiles, one per
  pipelined loop step (``quant_blocks``). Two sub-tiles (128 rows) stay in registers, rotated,
  until the second gives the block's amax, and are then cast and stored; longer blocks load
  theirs a second time (L2 hits) after the amax steps; blocks written transposed (V) load them
  a second time one block later, in the same loop steps as the next block's first loads. In
  the tiled kernel (float64 path) the block's amax is likewise taken over sub-tiles and the
  sub-tiles are rotated again to quantize. Either way HBM sees each element once.
- ``head`` (one descale per (batch, kv-head), shared by the heads of a GQA group as the FA3
  kernel's q_descale is) and ``tensor``: a first pass reduces the amax with atomics, a second
  quantizes. No kernel can avoid this second read: every element's scale depends on every
  other element of the head.

Kernels, one module each: ``quant_persistent`` (float32 path, default: a fixed grid of programs,
as many per SM as the compiled kernel's registers and shared memory allow, at most 3, or 4
under a register cap, walks the tiles with software-pipelined loads, ``cp.async`` into shared
memory, ``num_stages``, the +-1 matrix loaded once per program), its block walkers
(``quant_blocks``), ``quant_tiled`` (float64 path, ``persistent=False``: one program per
tile); on Hopper the shared-memory kernels ``rotate_quant_smem`` (K) and ``vquant_smem`` (V)
take the long blocks. What they share: ``quant_device`` (Triton functions) and
``quant_launch`` (``QuantOut``, layouts, grids). Measured on the H200 against a
device-to-device copy: reports/h200/triton/report.md.

Arithmetic, two modes:

- ``exact=True``: float64 throughout with the emulator's order of operations (the same
  butterflies, the division by sqrt(d), amax / fmt.max in float64 rounded to float32, x /
  descale in float64, round-to-odd to float32, one RNE cast). The bytes equal ``prepare()``'s.
- ``exact=False`` (the fast path): float32, the rotation as a butterfly or as one tensor-core
  dot with the +-1 matrix diag(signs) H (products exact for BF16/FP16 inputs, float32 sums).
  Rounding differs from the float64 emulator in rare near-ties; ``tests`` and the device run
  measure how often. Both kernels compute the same bytes (the persistent one divides through
  the reciprocal and a Markstein correction, which is the IEEE division's result).

Rotation implementations: ``butterfly`` (fast Walsh-Hadamard transform, log2(d) stages of
reshape/split/join in registers) and ``dot`` (x @ (diag(s) H) on the tensor cores).
"""

from __future__ import annotations

import math

import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerToken

from ._common import fp8_params, interpreting, tl_fp8, triton
from .quant_launch import (GRAN_CODES, LAYOUTS, SMEM_PER_SM, QuantOut, descale_buffer, dims, fit_per_sm,
                           programs, rotation_constants, strides)
from .quant_persistent import resident_programs

if triton is not None:
    from .quant_persistent import rq_persistent
    from .quant_tiled import rq_tiled


def rotate_quantize(x: torch.Tensor, *, layout: str = "bshd", fmt: str = "e4m3", gran=None, block_rows: int = 0,
                    group: int = 1, pow2: bool = False, rot: str = "none", seed: int = 0, exact: bool = False,
                    out_layout: str = "bhsd", impl: str = "auto", soft_cast: bool | None = None, tile: int = 0,
                    num_warps: int = 0, recip: bool = False, persistent: bool | None = None, stages: int = 0,
                    progs_per_sm: int = 0, head_fast: bool | None = None, sub_tile: int = 0,
                    reread: bool | str | None = None, max_regs: int = 0, keep_last: bool = False,
                    parts: int = 2, stage_in_ring: bool = True, pow2_div: bool = False) -> QuantOut:
    """Rotate (Hadamard or none) and quantize ``x`` into FP8 in one fused kernel (see module doc).

    ``gran``: a granularity object (``PerHead()`` default); ``block_rows`` fills ``PerBlock(0)``;
    ``group``: heads sharing one per-head descale (Q under GQA: heads // kv_heads). ``tile`` (rows
    per tile for token/head/tensor), ``num_warps`` and ``recip`` (multiply by 1/descale, one more
    rounding) tune the fast path. ``persistent`` (default: the fast path) runs the persistent,
    software-pipelined kernel with ``stages`` pipeline stages and ``progs_per_sm`` programs per
    multiprocessor (default: as many as fit, at most 3, or 4 under ``max_regs``; ``head_fast``:
    the order of the work items, default heads first for a (b, s, h, d) input); ``max_regs`` caps
    the registers a thread (Triton's ``maxnreg``) so that more programs fit an SM; ``False`` the
    one-program-per-tile kernel (``quant_tiled``). Blocks there are walked in sub-tiles of
    ``sub_tile`` rows (default 64 at head_dim 128, i.e. 8192 // head_dim; a sub-tile of at least
    the block's rows: one tile per block), kept in registers until the block's amax is known
    (default for two sub-tiles written row by row), or loaded again from L2 (``reread``: True as
    more pipelined steps, the default for longer blocks written row by row; ``"skewed"`` one
    block later, in the steps of the next block's first loads, the default for blocks written
    transposed; ``"sync"`` at the block's last step, outside the pipeline), or their inputs kept
    in registers and rotated again (``"inputs"``), or held in shared memory and rotated twice there
    (``"smem"``: the Gluon kernel of ``rotate_quant_smem``, Hopper, BF16, the split rotation;
    ``keep_last``: the last sub-tile kept in registers between its passes instead of rotated
    twice; ``parts``: column parts of its split rotation, 2 or 4; ``stage_in_ring``: the FP8
    staging tiles in the short last sub-tile's ring units). "smem" is the default for blocks of
    more than 128 rows written row by row where it runs (``_smem_default``; FA3's 224-row K tile:
    76-83% of a copy on the H200 against the tl kernel's 54-56%, reports/h200/triton/report.md);
    ``persistent=True`` or any launch setting keeps the tl kernel. ``pow2_div``: with
    power-of-two descales, divide (the corrected division of other descales) instead of the
    default one multiply by the reciprocal, which is exact for them: the same bytes, kept to
    measure the difference. Without ``stages``, ``num_warps`` and ``progs_per_sm``,
    blocks take the launch measured fastest for their mode (_SUB_LAUNCH, a register cap
    included). The launch chosen is in the result's ``launch``.
    """
    gran = PerHead() if gran is None else gran
    fp8 = fp8_params(fmt)
    if layout not in LAYOUTS or out_layout not in LAYOUTS:
        raise UsageError(f"layouts must be among {', '.join(LAYOUTS)}")
    if rot not in ("none", "hadamard"):
        raise UsageError(f"rot={rot}: the fused kernel applies the random Hadamard rotation only "
                         "(use the emulator's prepare() for rot=orthogonal)")
    b, h, n, d = dims(x, layout)
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
    gran_code = GRAN_CODES[type(gran)]
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
    signs, hadamard, sqrt_d = rotation_constants(d, seed, dev, exact, x.dtype if rot_code == 2 else None)

    out_shape = {"bshd": (b, n, h, d), "bhsd": (b, h, n, d), "bhds": (b, h, d, n)}[out_layout]
    y = torch.empty(out_shape, dtype=fp8.torch_dtype, device=dev)
    desc = descale_buffer(gran_code, b, h, n, rows, group, dev)
    if smem_candidate(gran_code, rows, rot, reread, persistent, exact, fmt,
                      (tile, num_warps, recip, stages, progs_per_sm, sub_tile, max_regs, soft_cast)) \
            and _smem_default(x, layout, out_layout, rows, d, n, rot, impl):
        reread = "smem"
    if persistent is None:
        # Blocks written transposed (V, (b, h, d, s)) too: read again one block behind, they move
        # 70% of a copy at 128 rows on the H200 against the tiled kernel's 57-59% (57% at 224
        # against 11%).
        persistent = not exact
    if reread == "smem" and rot == "none":
        from .vquant_smem import quantize_v_smem, vsmem_problem

        why = "per-block scales only" if gran_code != 2 else vsmem_problem(x, layout, out_layout, rows, d, n)
        if why or exact or fmt != "e4m3" or recip or soft or max_regs:
            raise UsageError(f"reread='smem' (V, no rotation): {why or _SMEM_ONLY}")
        how = quantize_v_smem(x, y, desc, layout=layout, rows=rows, pow2=pow2, fmt_max=fp8.max,
                              progs_per_sm=progs_per_sm, head_fast=head_fast, pow2_mul=not pow2_div)
        return QuantOut(y, desc, out_layout, rows, group, gran_code, how)
    if reread == "smem":
        from .rotate_quant_smem import rotate_quantize_smem, smem_problem

        why = "per-block scales only" if gran_code != 2 else smem_problem(x, layout, out_layout, rows, d, rot)
        if why or exact or fmt != "e4m3" or impl != "dot" or recip or soft:
            raise UsageError(f"reread='smem': {why or _SMEM_ONLY + ', impl=dot'}")
        how = rotate_quantize_smem(x, y, desc, sqrt_d, layout=layout, out_layout=out_layout, rows=rows, pow2=pow2,
                                   seed=seed, fmt_max=fp8.max, keep_last=keep_last, parts=parts,
                                   stage_in_ring=stage_in_ring, progs_per_sm=progs_per_sm, head_fast=head_fast,
                                   max_regs=max_regs, pow2_mul=not pow2_div)
        return QuantOut(y, desc, out_layout, rows, group, gran_code, how)
    if persistent and not exact:
        if gran_code == 2 and _v_short_subtiles(rows, d, rot_code, out_layout, reread,
                                                (sub_tile, stages, num_warps, progs_per_sm, max_regs)):
            sub_tile, stages = 32, 6
        if gran_code == 2:
            ptile, nsub, rr = _block_split(rows, d, sub_tile, reread, out_layout == "bhds")
        else:
            ptile, nsub, rr = _pow2_at_least(tile or _PERSIST_TILE, 16), 1, False
        if ptile * d <= 256 * 128:
            return _launch_persistent(x, y, desc, signs, hadamard, sqrt_d, layout, out_layout, fp8, fmt, gran_code,
                                      rows, group, pow2, rot_code, soft, ptile, num_warps, recip, stages,
                                      progs_per_sm, b, h, n, d, head_fast, nsub, rr, max_regs, pow2_div)
    # The fast path keeps a whole tile (up to 256 rows x d in float32) in registers and reads the
    # input once; the float64 path works in sub-tiles of 32 rows (registers) and re-reads a block.
    if gran_code == 2:
        per_prog = rows
        tile = tile or (32 if exact else max(16, 1 << (rows - 1).bit_length()))
        if tile * d > 256 * 128:
            tile = max(16, (256 * 128) // d)
    else:
        # 64 rows, 4 warps: fastest of 32/64/128 rows measured on the H200 for per-token and per-head
        # (reports/h200/triton/quant.csv): more programs per SM hide the loads' latency.
        tile = tile or (32 if exact else 64)
        per_prog = tile if not exact else 8 * tile
    single = per_prog <= tile
    grid = (-(-n // per_prog), b * h)
    amax = torch.zeros(max(1, b * (h // group)) if gran_code == 1 else 1,
                       dtype=torch.int64 if exact else torch.int32, device=dev)
    common = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, SINGLE=single, ROT=rot_code, GRAN=gran_code, EXACT=exact,
                  POW2=bool(pow2), MBITS=fp8.mbits, EMIN=fp8.emin, FMT_MAX=fp8.max, OUT=tl_fp8(fmt), SOFT_CAST=soft,
                  RECIP=bool(recip) and not exact)
    if not interpreting():
        common["num_warps"] = num_warps or (8 if tile * d >= 128 * 128 else 4)
    args = [x, y, signs, hadamard, sqrt_d, amax, desc, *strides(x, layout), *strides(y, out_layout),
            desc.stride(0), desc.stride(1), desc.stride(2), h, n, group]
    if gran_code <= 1:
        rq_tiled[grid](*args, per_prog, PASS=1, **common)
        rq_tiled[grid](*args, per_prog, PASS=2, **common)
    else:
        rq_tiled[grid](*args, per_prog, PASS=0, **common)
    return QuantOut(y, desc, out_layout, rows, group, gran_code,
                    f"tiled tile{tile} w{common.get('num_warps', '-')} {'recip' if common['RECIP'] else 'div'}")


# Launch defaults of the persistent kernel: rows per tile for token/head/tensor; pipeline stages
# by (rotation on the tensor cores, tile over 64 x 128 elements); at most this many programs
# per SM (fewer where their shared memory or registers do not fit). The fastest of the H200
# sweeps (reports/h200/triton/quant_sweep.csv): 4 stages for 64-row tiles with the dot, 3
# without (4 were slower there), 2 for blocks of 128 rows in one tile.
_PERSIST_TILE = 64
_PERSIST_STAGES = {(True, False): 4, (True, True): 2, (False, False): 3, (False, True): 2}
# Blocks in sub-tiles: (rotation on the tensor cores, mode, two sub-tiles) -> (stages, register cap;
# 0: none). Modes: 0 kept, 1 reread, 2 reread-sync, 3 kept inputs, 4 reread skewed. Two kept
# sub-tiles (4 warps, ~240 registers) fit 2 programs per SM like the per-token tiles; 3 stages
# measured faster than 4 there (0.058 against 0.062 ms). Three kept (8 warps) fit one
# program per SM, so more stages keep loads in flight (still slower). Read again (K at 224 rows):
# 168 registers and 2 stages fit 3 programs per SM (0.086 ms, 57-58% of a copy, against
# 0.097-0.099 ms at 4 stages and 2 programs). Skewed, without rotation (V): 3 programs at 168
# registers and 3 stages for 128 rows (0.070 ms against 0.074 uncapped); 2 programs and 4
# stages for 224 (0.086 ms against 0.087-0.091 for the others). With the dot, the skewed kernel's
# two tiles a stage and the +-1 matrix leave room for 2 stages.
_SUB_LAUNCH = {(True, 0, True): (3, 0), (True, 0, False): (8, 0), (True, 1, True): (2, 168), (True, 1, False): (2, 168),
               (True, 2, True): (4, 0), (True, 2, False): (4, 0), (True, 3, True): (4, 0), (True, 3, False): (4, 0),
               (True, 4, True): (2, 0), (True, 4, False): (2, 0),
               (False, 0, True): (3, 0), (False, 0, False): (8, 0), (False, 1, True): (4, 0), (False, 1, False): (4, 0),
               (False, 2, True): (4, 0), (False, 2, False): (4, 0), (False, 3, True): (4, 0), (False, 3, False): (4, 0),
               (False, 4, True): (3, 168), (False, 4, False): (4, 0)}
_PERSIST_PPS = 3


_SMEM_ONLY = ("the fast path (exact=False) to e4m3 only, with the hardware cast and the exact division "
              "(no soft_cast, no recip)")


def smem_candidate(gran_code: int, rows: int, rot: str, reread, persistent, exact: bool, fmt: str, tuning) -> bool:
    """Whether a call leaves the launch to the library and asks what a shared-memory kernel does:
    per-block scales of more than 128 rows (of at least 128 without rotation: V blocks of 128
    rows moved at 87% of a copy there against the tl kernel's 70%; rotated 128-row blocks stay
    in the tl kernel, 89% either way), the fast path to e4m3, no reread mode, no
    ``persistent`` and no launch setting (those keep the tl kernel)."""
    return (gran_code == 2 and (rows >= 128 if rot == "none" else rows > 128) and reread is None and persistent is None
            and not exact and fmt == "e4m3" and not any(tuning))


def _smem_default(x, layout: str, out_layout: str, rows: int, d: int, n: int, rot: str, impl: str) -> bool:
    """Blocks of more than 128 rows (FA3's 224-row K and V tiles at head_dim 128) that a
    shared-memory kernel can run (Hopper, BF16) go there by default. On the H200 a 224-row K tile
    (Hadamard rotation on the tensor cores, rows written (b, h, s, d)) took 0.057 ms
    (83% of a copy) with power-of-two descales and 0.062 ms (76%) with amax descales, against the
    tl kernel's 0.085-0.089 ms (54-56%), and 0.195-0.238 ms a call with the host's launch against
    0.153-0.236; V (no rotation, written (b, h, d, s)): ``vquant_smem``."""
    if interpreting() or not x.is_cuda:
        return False
    if rot == "none":
        from .vquant_smem import vsmem_problem

        return vsmem_problem(x, layout, out_layout, rows, d, n) is None
    from .rotate_quant_smem import smem_problem

    return impl == "dot" and smem_problem(x, layout, out_layout, rows, d, rot) is None


def _v_short_subtiles(rows: int, d: int, rot_code: int, out_layout: str, reread, tuning) -> bool:
    """V blocks of more than 128 rows at head_dim 128 (no rotation, written (b, h, d, s)) go in
    32-row sub-tiles with 6 pipeline stages, read again one block behind: FA3's 224-row V tile
    took 0.075 ms on the H200 (64% of a copy, bytes identical to the tiled kernel)
    against 0.086 ms (56%) in 64-row sub-tiles with 4 stages; 32-row sub-tiles with 4 stages took
    0.087 ms. Only where no launch was asked for, and where the shared-memory V kernel does not
    run (``vquant_smem``: 79-81% at 224 rows)."""
    return (d == 128 and rows > 128 and rot_code == 0 and out_layout == "bhds" and reread is None
            and not any(tuning))


def _block_split(rows: int, d: int, sub_tile: int, reread, transposed: bool = False) -> tuple[int, int, int]:
    """(tile rows, sub-tiles per block, reread mode) for blocks of ``rows`` rows: sub-tiles of
    8192 // d rows (64 at d 128) by default; a block that fits one such tile is one tile. (On
    Hopper, K blocks of more than 128 rows and V blocks of at least 128 go to the shared-memory
    kernels instead where they run: ``smem_candidate``.)

    Default: two sub-tiles (Q's 128-row tile) stay in registers; longer blocks (K's 224 rows) are
    read again from L2 as more pipelined steps; blocks written transposed (V, (b, h, d, s)) are
    read again one block behind, in the first pass's steps ("skewed"). On the H200 (% of a
    device-to-device copy; reports/h200/triton/report.md): 128 rows kept 83-85%, read again 56%,
    skewed 45%, inputs kept 64%; 224 rows read again 50% (57-58% at 3 programs per SM: the
    defaults of _SUB_LAUNCH), skewed 40%, inputs kept 41-42%, 3 sub-tiles kept (8 warps, one
    program per SM by registers) 41-44%, one 256-row tile 47%, read again at the block's end 17%.
    V of 128 rows: skewed 70%, inputs kept 66%, read again 42%, kept 26% (spills); V of 224:
    skewed 56-57% (64% in 32-row sub-tiles with 6 stages: _v_short_subtiles), inputs kept 45%
    (8 warps), read again 37-39%."""
    cap = max(16, 8192 // d)
    t = _pow2_at_least(sub_tile or min(rows, cap), 16)
    nsub = -(-rows // t)
    if nsub == 1:
        return t, 1, 0
    if reread is None:
        rr = 4 if transposed else (1 if nsub > 2 else 0)
    else:
        rr = {"sync": 2, "inputs": 3, "skewed": 4}.get(reread, None) if isinstance(reread, str) else int(bool(reread))
        if rr is None:
            raise UsageError(f"reread={reread!r}: True, False, 'sync', 'inputs' or 'skewed'")
    if nsub > 4 and rr in (0, 3):  # at most 3 sub-tiles kept
        rr = 1
    return t, nsub, rr


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << (max(1, v) - 1).bit_length())


def _launch_persistent(x, y, desc, signs, hadamard, sqrt_d, layout, out_layout, fp8, fmt, gran_code, rows, group,
                       pow2, rot_code, soft, tile, num_warps, recip, stages, progs_per_sm, b, h, n, d,
                       head_fast=None, nsub=1, reread=False, max_regs=0, pow2_div=False) -> QuantOut:
    """The persistent kernel: work items of ``r`` rows (a block, or ``tile`` rows), each in one tile,
    or a block in ``nsub`` sub-tiles of ``tile`` rows."""
    r = rows if gran_code == 2 else tile
    nblk = -(-n // r)
    total = b * h * nblk
    big = tile * d > 64 * 128
    if gran_code <= 1:
        amax = torch.zeros(max(1, b * (h // group)) if gran_code == 1 else 1, dtype=torch.int32, device=x.device)
    else:
        amax = desc  # unused
    kept = 0 if (reread or nsub == 1) else (1 if nsub == 2 else 3)  # sub-tiles held in registers: 1, or up to 3
    reread = int(reread)
    # Shared memory: one input tile per pipeline stage (two for the skewed mode), the +-1 matrix
    # (dot), the FP8 tile's layout change for the store. Stages beyond what fits in ~200 KB are
    # dropped (d = 256 keeps one).
    if nsub > 1:
        st_def, regs_def = _SUB_LAUNCH[(rot_code == 2, reread, nsub == 2)]
        if not (stages or num_warps or progs_per_sm):  # the register cap belongs to its measured launch
            max_regs = max_regs or regs_def
    else:
        st_def = _PERSIST_STAGES[(rot_code == 2, big)]
    st = stages or st_def
    fixed = (d * d * 2 if rot_code == 2 else 0) + tile * d
    loads = 2 if reread == 4 else 1
    while st > 1 and fixed + st * loads * tile * d * x.element_size() > 200 * 1024:
        st -= 1
    common = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, ROT=rot_code, GRAN=gran_code, POW2=bool(pow2),
                  MBITS=fp8.mbits, EMIN=fp8.emin, FMT_MAX=fp8.max, OUT=tl_fp8(fmt), SOFT_CAST=soft,
                  DIV=1 if (recip or (pow2 and not pow2_div)) else (0 if interpreting() else 2), STAGES=st)
    if nsub > 1:
        common["SUB"] = nsub
        common["REREAD"] = reread
    if head_fast is None:  # heads first where a head's rows are strided by the other heads (bshd)
        sb, sh, ss, sd = strides(x, layout)
        head_fast = sh < ss
    common["HEAD_FAST"] = bool(head_fast)
    if not interpreting():
        if nsub > 1:
            common["num_warps"] = num_warps or (8 if kept == 3 else 4)
        else:
            common["num_warps"] = num_warps or (8 if tile * d >= 128 * 128 else 4)
        if max_regs:
            common["maxnreg"] = max_regs
    args = [x, y, signs, hadamard, sqrt_d, amax, desc, *strides(x, layout), *strides(y, out_layout),
            desc.stride(0), desc.stride(1), desc.stride(2), h, n, group, r, nblk, total]
    passes = (1, 2) if gran_code <= 1 else (0,)
    how_pps = ""
    if progs_per_sm:
        pps = progs_per_sm
    elif interpreting() or x.device.type != "cuda":
        pps = 1
    else:
        try:
            pps = resident_programs(args, common, passes, x, y, _PERSIST_PPS + (1 if max_regs else 0))
        except Exception:  # noqa: BLE001 - no compiled kernel's resources: the shared-memory estimate
            pps = max(1, min(_PERSIST_PPS, SMEM_PER_SM // (fixed + st * tile * d * x.element_size() + 1024)))
            how_pps = " (estimated)"
    grid = (programs(x.device, total, pps),)
    for p in passes:
        rq_persistent[grid](*args, PASS=p, **common)
    mode = ("kept", "reread", "reread-sync", "kept-inputs", "reread-skewed")[reread]
    how = (f"persistent tile{tile}" + (f" x{nsub} {mode}" if nsub > 1 else "") + f" w{common.get('num_warps', '-')}"
           + (f" r{max_regs}" if max_regs else "") + f" s{st} pps{pps}{how_pps}" + ("" if head_fast else " seq-first")
           + (" recip" if recip else (" pow2-mul" if common["DIV"] == 1 else "")))
    return QuantOut(y, desc, out_layout, rows, group, gran_code, how)


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
    b, h, n, d = dims(q, layout)
    hkv = dims(k, layout)[1]
    bm, bn = recipe.tiles(d, causal)
    g = recipe.gran
    kw = dict(layout=layout, pow2=recipe.pow2, exact=exact, impl=impl, soft_cast=soft_cast)
    qo = rotate_quantize(q, fmt=recipe.qk, gran=g, block_rows=bm, group=h // hkv, rot=recipe.rot, seed=rotation_seed,
                         out_layout=qk_layout, **kw)
    ko = rotate_quantize(k, fmt=recipe.qk, gran=g, block_rows=bn, rot=recipe.rot, seed=rotation_seed,
                         out_layout=qk_layout, **kw)
    vo = rotate_quantize(v, fmt=recipe.v, gran=g, block_rows=bn, rot="none", out_layout=v_layout, **kw)
    return qo, ko, vo

__all__ = ["QuantOut", "rotate_quantize", "quantize_qkv", "GRAN_CODES", "min_bytes", "smem_candidate", "fit_per_sm"]
