"""Kernel-faithful emulation of FP8 (and FP16) attention forward passes.

Exposed: ``emulate``, ``Prepared``, ``prepare``.

``prepare`` rotates and quantizes full Q, K, V (so that per-tensor and per-block scales see
every row, exactly as a caller of the kernel computes them); ``emulate`` then runs the
chosen algorithm for a subset of query rows. Every query row of attention is independent
given the quantized K and V, so evaluating a random subset of rows gives the exact outputs
of those rows at a fraction of the cost.

The ``flash`` algorithm follows the FA3 FP8 forward kernel (Dao-AILab/flash-attention,
hopper/): KV tiles of kBlockN keys visited last to first; the running max
is updated with the current tile before exponentiating; P~ = exp2(S * scale_log2 -
(m * scale_log2 - offset)) computed as one fused multiply-add, so P~ lies in [0, 2^offset];
the row sum is taken over FP32 P~ before P~ is cast (round to nearest even, saturating);
O is rescaled in FP32 between tiles; q and k descales fold into scale_log2 and the v
descale multiplies O once at the end; the output is rounded to BF16 (FP8 in) or FP16.

The ``standard`` algorithm materialises S and P as plain PyTorch attention does, in the
recipe's S and softmax formats (the Table 3 baselines).

All matmuls are float32 with TF32 off; where the kernel fuses a multiply and an add the
emulator evaluates it in float64 and rounds once.

Recipes of the field run through the same loop:

- formats by family (``numerics/operands.py``): INT8/INT4 Q and K multiply as exact integer
  codes (a float32 GEMM of codes is exact, ``intformats.float32_gemm_is_exact``) with their
  per-block/thread/token descales applied to S; MXFP8/NVFP4 operands carry their block scales
  folded in (exact in float32), and P is block-quantized per tile after the softmax step;
- smoothing (``smooth=k|qk``) after the rotation (the two commute); with ``qk`` the
  correction q_mean K'^T ([B, H, query blocks, N_k], held in ``sbias``'s format) is added to
  each tile's descaled S before the softmax scale, as SageAttention3 loads it into the S
  accumulator;
- ``norm=tile``: FlashAttention's Algorithm 1, O kept normalised after every tile (``keys/norm.py``);
- SageAttention 1 (``in``, ``iquant=triton``, ``loop=triton``, ``kpad``): the caller's 16-bit
  tensors, K smoothed in them, the Triton quantizer in float32 with the softmax scale folded into
  Q (``numerics/sage_quant.py``), and the Triton kernel's own loop (``numerics/sage_loop.py``);
  SageAttention2 on Hopper (``iquant=triton-eps``, ``loop=sage2``): its per-thread quantizer and
  its CUDA kernel's loop (``numerics/sage2_loop.py``).

Sliding windows, soft-capping and sink logits (``window_size``, ``softcap``, ``sinks``) follow
``numerics/masking.py``; without them every call takes the code path it took before they existed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import os

import torch

from .accumulators import accumulator_for, hopper_mma_on
from .families import element_format, family, mma_format
from .formats import get_format, quantize_dequantize
from . import native
from . import sfu as _sfu
from .intformats import float32_gemm_is_exact
from .mma import hopper_mma
from .granularity import PerHead
from .operands import cast_p, check_tiles, qk_granularity, quantize_qk, quantize_v
from .quant import Quantized
from .recipe import Recipe
from .reference import causal_mask, expand_kv
from . import masking as _mask
from .rotation import make_rotation
from .calibration import static_for
from .sage_quant import LOG2E_SAGE, input_round, smooth_k_in, triton_quantize_int
from .smoothing import qk_smoothing_bias, smooth_k, smooth_q
from ..errors import UsageError

LOG2E = math.log2(math.e)
FLT_MIN_NORMAL = float.fromhex("0x1p-126")  # smallest normal float32
# Elements of one materialised S chunk (one head) in the standard algorithm; bounds its memory.
_STD_CHUNK_ELEMS = 1 << 22
# Largest store of 16-bit softmax rows the standard algorithm keeps between the per-tensor P
# scale's amax pass and its P V pass (see _standard); FA3N_P_KEEP_MB overrides. On a GPU the
# cap is a quarter of the device's free memory instead (4.3 GB are needed at the paper's shape
# with every query row).
_P_KEEP_BYTES: int | None = None  # None: FA3N_P_KEEP_MB (default 128), read when first needed
# On a GPU a chunk of S is as large as this many elements (512 MB of float32): the CPU's
# cache-sized chunks would make the paper's Table 3 with every row thousands of small launches.
_STD_CHUNK_ELEMS_GPU = 1 << 27


def _std_chunk_elems(dev: torch.device) -> int:
    return _STD_CHUNK_ELEMS if dev.type == "cpu" else max(_STD_CHUNK_ELEMS, _STD_CHUNK_ELEMS_GPU)


def _p_keep_bytes(dev: torch.device) -> int:
    from ..env import env_number

    keep = _P_KEEP_BYTES if _P_KEEP_BYTES is not None else int(env_number("FA3N_P_KEEP_MB", 128.0) * 2 ** 20)
    if dev.type != "cuda" or os.environ.get("FA3N_P_KEEP_MB", "").strip() or keep <= 0:
        return keep
    free, _ = torch.cuda.mem_get_info(dev)
    return max(keep, free // 4)

# -- progress hook (read by fa3_numerics.engine.progress) ------------------------------------
# A caller that shows progress within one emulation sets PROGRESS to f(done, total, unit); it is
# called after each KV tile (flash) or block of query rows (standard) and never changes a number.
# A context variable, not a parameter, so that no backend's signature changes for it.
PROGRESS: contextvars.ContextVar = contextvars.ContextVar("fa3_numerics_emulator_progress", default=None)
# -- end of progress hook -----------------------------------------------------------------------


def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


@dataclasses.dataclass
class Prepared:
    """Q, K, V after rotation and quantization, with their descales; K/V already GQA-expanded."""

    q: Quantized
    k: Quantized
    v: Quantized
    heads: int
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    # smooth=qk: the correction added to S, [B, H, ceil(seqlen_q / block_m), seqlen_k] float32
    # holding values of the recipe's ``sbias`` format; row i of Q uses block i // block_m.
    bias: torch.Tensor | None = None


def prepare(recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_index: torch.Tensor,
            rotation_seed: int = 0, causal: bool = False, cache: dict | None = None,
            softmax_scale: float | None = None, mk: "_mask.Masking | None" = None) -> Prepared:
    """Rotate and quantize. Scales see every row of Q; only the rows in ``q_index`` are kept.

    ``cache`` (a dict the caller keeps for one set of inputs) shares rotated and quantized
    tensors between recipes that agree on them, e.g. V between all FP8 recipes.
    ``softmax_scale`` (None = 1/sqrt(head_dim)) matters only where a quantizer folds it into Q
    (``iquant=triton``).
    """
    cache = {} if cache is None else cache
    b, h, n, d = q.shape
    hkv = k.shape[1]
    bm, bn = recipe.tiles(d, causal) if mk is None else recipe.tiles(d, causal, local=mk.windowed,
                                                                      softcap=bool(mk.softcap))
    g = recipe.gran

    def memo(key, fn):
        if key in cache:
            cache[key] = cache.pop(key)  # most recently used last
            return cache[key]
        cache[key] = val = fn()
        _trim(cache, keep=key)
        return val

    # Rotated and smoothed Q and K are float64 copies of the whole inputs (268 MB each at the
    # paper's shape) needed only until they are quantized: they live for this call alone, not
    # in ``cache``. A second recipe with the same rotation recomputes it (a fraction of a second
    # with the compiled butterflies) instead of holding half a gigabyte through every variant.
    local: dict = {}

    def once(key, fn):
        if key not in local:
            local[key] = fn()
        return local[key]

    check_tiles(recipe, bm, bn)
    rot = make_rotation(recipe.rot, d, rotation_seed)
    # ``in``: the caller's tensors in the input format, after the caller's rotation (sage_quant).
    fmt_in = recipe.inp
    rq = lambda: once("rot-q", lambda: input_round(rot.apply(q.to(torch.float64)), fmt_in))  # noqa: E731
    rk = lambda: once("rot-k", lambda: input_round(rot.apply(k.to(torch.float64)), fmt_in))  # noqa: E731
    # Smoothing after the rotation: both are linear per row (mean(K M) = mean(K) M), so the order
    # does not matter in exact arithmetic. With an input format it is computed in that format.
    # One Q descale per (batch, kv-head) group: the shape the kernel's q_descale takes.
    group = h // hkv if isinstance(g, PerHead) else 1
    # Calibrated recipes (dscale=static/calc/unit, kmean=static) fix descales and the K mean.
    static = static_for(recipe, rot, group=group, device=q.device, own=(q, k, v))
    if recipe.smooth != "none" and static is not None and static.k_mean is not None:
        rk0 = rk
        rk = lambda: once("smooth-k", lambda: rk0() - static.k_mean)  # noqa: E731
    elif recipe.smooth != "none":
        rk0 = rk
        smooth = (lambda x: smooth_k(x)[0]) if fmt_in == "none" else (lambda x: smooth_k_in(x, fmt_in))
        rk = lambda: once("smooth-k", lambda: smooth(rk0()))  # noqa: E731
    if recipe.smooth == "qk":
        rq0 = rq
        sq = lambda: once("smooth-q", lambda: smooth_q(rq0(), bm))  # noqa: E731
        rq = lambda: sq()[0]  # noqa: E731

    def expand(t: Quantized) -> Quantized:
        # Values stay in their narrow storage dtype here (the cache holds a quarter of float32
        # for FP8); each algorithm widens them once per call.
        ex = lambda x: expand_kv(x, h) if x.shape[1] not in (1, h) else x  # noqa: E731
        return Quantized(ex(t.values), ex(t.descale), t.fmt)

    # Cache keys come from the recipe-key registry (every key that declares the tensor), plus
    # what the shapes decide here, so a newly registered key can never reuse another recipe's
    # tensors.
    rows_id = (q_index.numel(), int(q_index.sum()))
    sage_quant_on = recipe.iquant in ("triton", "triton-eps") and family(recipe.qk) == "int"
    if sage_quant_on:
        if static is not None:
            raise UsageError(f"recipe {recipe.short_str()}: SageAttention's quantizer (iquant={recipe.iquant}) takes "
                             "its scales from each block's amax; drop dscale/kmean/calib or use iquant=exact")
        # SageAttention's Triton quantizer in float32 (sage_quant): SageAttention 1 folds sm_scale * log2(e)
        # into Q; SageAttention2 folds nothing and adds 1e-7 to every scale (iquant=triton-eps)
        sm = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        fold, eps = (sm * LOG2E_SAGE, 0.0) if recipe.iquant == "triton" else (1.0, 1e-7)
        gq = qk_granularity(recipe, "q", bm, bn)
        qq = memo(("q", recipe.prepare_key("q"), rotation_seed, bm, bn, group, rows_id, fold),
                  lambda: triton_quantize_int(rq(), recipe.qk, gq, block_rows=bm, scale=fold, rows=q_index, eps=eps))
        kq = memo(("k", recipe.prepare_key("k"), rotation_seed, bm, bn),
                  lambda: expand(triton_quantize_int(rk(), recipe.qk, qk_granularity(recipe, "k", bm, bn),
                                                     block_rows=bn, scale=1.0, eps=eps)))
    else:
        qq = memo(("q", recipe.prepare_key("q"), rotation_seed, bm, bn, group, rows_id),
                  lambda: quantize_qk(rq(), recipe, "q", block_m=bm, block_n=bn, group=group, rows=q_index,
                                      descale=static.q if static else None))
    if recipe.smooth != "qk":  # the smoothing bias is the only later use of the rotated Q
        local.pop("rot-q", None)
    if not sage_quant_on:
        kq = memo(("k", _operand_key(recipe, "k", recipe.qk), rotation_seed) + _tiles_key(recipe.qk, bm, bn),
                  lambda: expand(quantize_qk(rk(), recipe, "k", block_m=bm, block_n=bn,
                                             descale=static.k if static else None)))
    vq = memo(("v", _operand_key(recipe, "v", recipe.v)) + _tiles_key(recipe.v, bn),
              lambda: expand(quantize_v(input_round(v.to(torch.float64), fmt_in) if fmt_in != "none" else v, recipe,
                                        block_n=bn, descale=static.v if static else None)))
    bias = None
    if recipe.smooth == "qk":
        # q_mean (K - mu)^T from the unquantized smoothed tensors, rounded once to ``sbias``
        bias = memo(("bias", recipe.prepare_key("q"), recipe.prepare_key("k"), rotation_seed, bm),
                    lambda: qk_smoothing_bias(sq()[1], rk(), recipe.sbias).to(torch.float32))
    return Prepared(qq, kq, vq, h, n, k.shape[2], bm, bn, bias)


def _unscaled(fmt: str) -> bool:
    """An operand format ``quant.quantize`` casts to without a scale (FP16/BF16/FP32), whatever
    the granularity and tile size."""
    return family(fmt) == "float" and not get_format(fmt).saturate


def _tiles_key(fmt: str, *tiles: int) -> tuple:
    """The tile sizes in a prepared K or V's cache key, where they decide it: an unscaled wide
    operand is the same for every tile size, so recipes that differ only in their tiles (FA2's
    and FA3's FP16 loops, the standard algorithm) share it; scaled and microscaled formats keep
    the tiles in their key."""
    return () if _unscaled(fmt) else tiles


def _operand_key(recipe: Recipe, tensor: str, fmt: str) -> tuple:
    """``recipe.prepare_key(tensor)`` less the tile keys (bm, bn) where the operand is unscaled."""
    key = recipe.prepare_key(tensor)
    return tuple(kv for kv in key if kv[0] not in ("bm", "bn")) if _unscaled(fmt) else key


def _nbytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, Quantized):
        return _nbytes(v.values) + _nbytes(v.descale)
    if isinstance(v, tuple):  # smooth_q's (Q - q_b, block means)
        return sum(_nbytes(x) for x in v)
    return 0


def _trim(cache: dict, keep) -> None:
    """Evict least recently used prepared tensors past the byte budget (``FA3N_PREP_CACHE_MB``,
    default 160, so that the FP16 K and V of the paper's shape, 134 MB, stay for the three FP16
    rows): a sweep of many recipes on paper-shape inputs would otherwise keep every rotation and
    quantization alive (4.4 GB for the seven Table 3 rows)."""
    from ..env import env_number

    budget = env_number("FA3N_PREP_CACHE_MB", 160, integer=True) << 20
    total = sum(_nbytes(v) for v in cache.values())
    for key in list(cache):
        if total <= budget:
            break
        if key != keep and _nbytes(cache[key]):
            total -= _nbytes(cache.pop(key))


def emulate(recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            softmax_scale: float | None = None, q_index: torch.Tensor | None = None, rotation_seed: int = 0,
            cache: dict | None = None, stats: dict | None = None, window_size: tuple[int, int] | None = None,
            softcap: float | None = None, sinks: torch.Tensor | None = None,
            scale_o: float | None = None) -> torch.Tensor:
    """Attention output for the query rows ``q_index``: [B, H, R, Dv], float64 holding values
    of the output format. Pass the same ``cache`` for several recipes on the same inputs.

    ``scale_o`` (``smath=cudnn`` only, with ``oscale=none``): the output is O * scale_o as cuDNN forms it
    before its FP8 cast, the scale folded into each row's factor (acc * fl(rcp(l) fl(descale_v
    scale_o))), so that O's codes at a given scale_o are the kernel's, ties included.

    ``stats``: a dict that receives ``"lse"``, the log-sum-exp the kernel saves for its
    backward ([B, H, R] float32, natural log of the sum of exp(softmax_scale * S); +inf for a
    row that sees no key), as FA3's ``softmax.finalize`` forms it (flash algorithm, deferred
    normalisation only), with K smoothing's row shift added back. It changes no output.

    ``window_size`` (left, right), ``softcap`` and ``sinks`` ([H] logits): ``numerics/masking.py``."""
    _no_tf32()
    mk = _mask.masking(causal, window_size, softcap, sinks, heads=q.shape[1], seqlen_q=q.shape[2], seqlen_k=k.shape[2])
    causal = mk.causal
    mk = None if mk.plain else mk  # the plain path stays exactly as it was
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if q_index is None:
        q_index = torch.arange(q.shape[2], device=q.device)
    if recipe.oscale == "amax":
        return _amax_scaled_out(recipe, q, k, v, causal=causal, softmax_scale=scale, q_index=q_index,
                                rotation_seed=rotation_seed, cache=cache, stats=stats)
    pre = prepare(recipe, q, k, v, q_index=q_index, rotation_seed=rotation_seed, causal=causal, cache=cache,
                  softmax_scale=scale, mk=mk)
    if stats is not None and (recipe.algo != "flash" or recipe.norm != "deferred"
                              or recipe.loop in ("triton", "sage2")):
        raise UsageError(f"recipe {recipe.short_str()}: only the flash algorithm with deferred normalisation saves the "
                         "log-sum-exp a backward reads (algo=flash, norm=deferred, loop=fa3 or fa2)")
    if mk is not None and (recipe.loop != "fa3" or (mk.sinks is not None and recipe.norm == "tile")):
        raise UsageError(f"recipe {recipe.short_str()}: {mk.describe()} is modelled for FA3's loop (loop=fa3) with "
                         f"deferred normalisation, and for algo=standard; drop loop={recipe.loop} / norm=tile")
    if recipe.loop == "triton":
        from .sage_loop import flash_triton

        return flash_triton(recipe, pre, q_index, causal, scale)
    if recipe.loop == "sage2":
        from .sage2_loop import flash_sage2

        return flash_sage2(recipe, pre, q_index, causal, scale)
    if recipe.loop == "fa2" and mk is None:
        from .fa2_loop import flash_fa2

        return flash_fa2(recipe, pre, q_index, causal, scale, stats)
    if recipe.algo != "flash":
        return _standard(recipe, pre, q_index, causal, scale, mk)
    if recipe.splitkv == "fa3":
        if mk is not None:
            raise UsageError(f"recipe {recipe.short_str()}: splitkv=fa3 is modelled without windows, softcap or sinks")
        from .fa3_split import flash_fa3_split

        return flash_fa3_split(recipe, pre, q_index, causal, scale, k.shape[1], stats)
    if scale_o is not None and (getattr(recipe, "smath", "fa3") != "cudnn" or recipe.oscale != "none"):
        raise UsageError(f"recipe {recipe.short_str()}: scale_o is cuDNN's epilogue (smath=cudnn, oscale=none)")
    out = _flash(recipe, pre, q_index, causal, scale, stats, mk, scale_o=scale_o)
    if stats is not None and recipe.smooth != "none":
        # Smoothing moves every score of row i by -scale Q_i . mean(K) (exact for the output, not for the
        # LSE): the LSE of the scores attention means is the smoothed one plus that shift, in float64
        # rounded once (rotation keeps dot products, so the inputs as given serve).
        mu = expand_kv(k.to(torch.float64).mean(dim=2, keepdim=True), q.shape[1])
        shift = (q.to(torch.float64).index_select(2, q_index) * mu).sum(dim=-1) * scale
        stats["lse"] = (stats["lse"].double() + shift).to(torch.float32)
    return out


def _uniform_per_head(t: torch.Tensor) -> bool:
    return t.shape[2] == 1


def exp2_rn(x: torch.Tensor) -> torch.Tensor:
    """float32 exp2, correctly rounded (computed in float64, rounded once)."""
    return torch.exp2(x.double()).to(torch.float32)


def exp2_rz(x: torch.Tensor) -> torch.Tensor:
    """float32 exp2 rounded toward zero. The kernel's ``ex2.approx.ftz.f32`` is not reproduced
    exactly; for the tile rescale factor it lands low more often than round-to-nearest does,
    so RZ matches it more often there (for P~, RN matches better)."""
    r = torch.exp2(x.double())
    y = r.to(torch.float32)
    over = y.double().abs() > r.abs()
    return torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y)


def flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """float32 subnormals to zero of the same sign (the GPU's .ftz modifier)."""
    return torch.where(x.abs() < FLT_MIN_NORMAL, x * 0.0, x)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """float32 a * b + c with one rounding, as the kernel's FFMA."""
    # The float64 product of two float32 values is exact, so one float64 addition rounds the
    # fused result once before the float32 rounding. A Python scalar c stays a scalar: turning
    # it into a device tensor is a host-to-device copy that stalls the GPU's queue every tile.
    prod = a.double() * b.double()
    return (prod + c.double() if isinstance(c, torch.Tensor) else prod.add_(c)).to(torch.float32)


def _flash(recipe: Recipe, pre: Prepared, q_index: torch.Tensor, causal: bool, scale: float,
           stats: dict | None = None, mk: "_mask.Masking | None" = None,
           tile_range: tuple[int, int] | None = None, scale_o: float | None = None) -> torch.Tensor:
    dev = pre.q.values.device
    qv = native.to_float32(pre.q.values)
    qd = pre.q.descale
    # K and V stay in their narrow storage and are widened one KV tile at a time: whole float32
    # copies would cost 2 x 134 MB at the paper's shape, the largest item of a run's peak memory.
    kn, kd = pre.k.values, pre.k.descale
    vn, vd = pre.v.values, pre.v.descale
    b, h, r, d = qv.shape
    nk = pre.seqlen_k
    accumulate = accumulator_for(recipe)  # flush=N: a fresh chain per call (accumulators.FlushEvery)
    chained = getattr(accumulate, "rescale", None)
    # FA3 is compiled with --use_fast_math, so its float32 softmax arithmetic flushes
    # subnormal results to zero (ex2.approx.ftz, FMUL.FTZ): the rescale factor, P~, and the
    # rescaled O and row sum. Without the flush an O row rescaled by a tiny factor becomes a
    # float32 subnormal that the kernel never holds.
    ftz = bool(getattr(recipe, "ftz", True))
    flush = flush_subnormals if ftz else (lambda x: x)
    # sfu=h200: the measured ex2.approx.ftz for the rescale factors and P~ (keys/sfu.py)
    hw = _sfu.wanted(recipe)
    ex2_resc, ex2_p = (_sfu.ex2, _sfu.ex2) if hw else (exp2_rz, exp2_rn)
    # The softmax step casts P~ to a float format itself; microscaling P is quantized after it
    # from float32 P~ (``operands.cast_p``), so the row sum stays over float32 P~ either way.
    p_float = family(recipe.p) == "float"
    p_fmt = get_format(recipe.p) if p_float else None
    acc_fmts = (mma_format(recipe.p), mma_format(recipe.v))
    # Integer codes multiply exactly (float32 sums of integers below 2^24); MX operands carry
    # their block scales and have no Hopper model (a recipe check keeps acc=fp32 for them).
    qk_elem = element_format(recipe.qk)
    mma_s = family(recipe.qk) == "float" and hopper_mma_on(recipe.acc, qk_elem)
    if family(recipe.qk) == "int" and not float32_gemm_is_exact(d, recipe.qk, recipe.qk):
        raise UsageError(f"head dim {d} is too large for an exact float32 GEMM of {recipe.qk} codes")
    offset = float(recipe.p_offset)
    # Per-(batch, head) descales fold into scale_log2 as the kernel does: the host rounds
    # softmax_scale * log2(e) to float32, the device multiplies it by (q_descale * k_descale).
    # Per-row or per-key descales (block, token, thread) multiply S element-wise before the max.
    # With a smoothing bias (smooth=qk) S is descaled and the bias added first, in float32, and
    # only the softmax scale remains (SageAttention3 starts the S accumulator at the bias).
    bias = pre.bias
    fold = _uniform_per_head(qd) and _uniform_per_head(kd)
    base = torch.tensor(float(torch.tensor(scale, dtype=torch.float32)) * LOG2E, dtype=torch.float32, device=dev)
    if bias is not None:
        sl2, scaled_s = base, True
        bias_blk = torch.div(q_index, pre.block_m, rounding_mode="floor")
    else:
        if fold and getattr(recipe, "smath", "fa3") == "cudnn":
            sl2 = _cudnn_scale_log2(scale, qd, kd)
        else:
            sl2 = (base * (qd * kd).to(torch.float32)).to(torch.float32) if fold else torch.ones((), device=dev)
        scaled_s = fold
    cap = None
    if mk is not None and mk.softcap:
        # FA3 with a softcap: S * (scale / softcap) [* q_descale * k_descale] goes through tanh, and
        # scale_log2 becomes softcap * log2(e) with no descale in it (numerics/masking.py).
        c_mult, c_l2 = _mask.softcap_constants(scale, mk.softcap)
        c_mult = torch.tensor(c_mult, dtype=torch.float32, device=dev)
        folded = fold and bias is None
        cap = (c_mult * (qd * kd).to(torch.float32)).to(torch.float32) if folded else c_mult
        sl2, scaled_s = torch.tensor(c_l2, dtype=torch.float32, device=dev), True
    v_end = vd if _uniform_per_head(vd) else None
    fa1 = recipe.norm == "tile"

    m = torch.full((b, h, r, 1), -math.inf, dtype=torch.float32, device=dev)
    # The kernel keeps a row's sum as four partial sums, one per thread of the quad that holds
    # the row, and adds them only at the end (see _quad_row_sum).
    rs4 = torch.zeros((b, h, r, 4), dtype=torch.float32, device=dev)
    l_fa1 = torch.zeros((b, h, r, 1), dtype=torch.float32, device=dev)  # norm=tile: the running row sum
    acc = torch.zeros((b, h, r, vn.shape[-1]), dtype=torch.float32, device=dev)
    cudnn_math = getattr(recipe, "smath", "fa3") == "cudnn"
    # the C step knows causal masking and FA3's arithmetic only, with its own exp2 (not the sfu=h200 model)
    step = native.softmax_step(dev) if mk is None and not hw and not cudnn_math else None
    if cudnn_math and mk is not None and (mk.sinks is not None or mk.softcap):
        raise UsageError(f"recipe {recipe.short_str()}: smath=cudnn is cuDNN's measured softmax; sinks and "
                         "softcap were not measured with it")
    if cudnn_math:
        # cuDNN takes scale_s (the float32 2^poff the backend passes) and forms its log2 on the unit,
        # which rounds toward zero: the offset inside the exponent is lg2.approx(scale_s)
        scale_s = torch.tensor(2.0 ** offset, dtype=torch.float32, device=dev)
        lg2_scale_s = _sfu.lg2(scale_s.reshape(1)).reshape(())
        # the row sum is kept in descaled units (l descale_s, what Stats and Amax_S read): see _cudnn_softmax
        descale_s = (1.0 / scale_s.double()).to(torch.float32)
    n_tiles = -(-nk // pre.block_n)
    t_lo, t_hi = tile_range if tile_range is not None else (0, n_tiles)  # a split-KV pass visits its own tiles
    tiles = range(t_hi - 1, t_lo - 1, -1) if recipe.order == "reverse" else range(t_lo, t_hi)

    def softmax(s, s0, s1, m_in, rs_in):
        """One tile's online softmax: (P~ cast to p_fmt, rescale, m_new, rs4_new); the C step
        updates m_in and rs_in in place, the PyTorch path returns new tensors (same numbers)."""
        if step is not None:
            # One fused pass per row in C; same numbers as the PyTorch path below.
            lim = (q_index + (nk - pre.seqlen_q) - s0) if causal else None
            kd_t = None if scaled_s else _rows_k(kd, s0, s1)
            p8, rescale = step(s, sl2=sl2 if scaled_s else None, qd=None if scaled_s else qd, kd=kd_t, base=base,
                               lim=lim, m=m_in, rs4=rs_in, offset=offset, ftz=ftz, fmt=p_fmt)
            return p8, rescale, m_in, rs_in
        if not scaled_s:
            s = s * (qd * _rows_k(kd, s0, s1).transpose(-1, -2) * base).to(torch.float32)
        if causal:
            vis = causal_mask(q_index, s0, s1, pre.seqlen_q, nk)
            s = s.masked_fill(~vis, -math.inf)
        if mk is not None and mk.windowed:
            s = s.masked_fill(~_mask.visible(mk, q_index, s0, s1, pre.seqlen_q, nk), -math.inf)
        if cudnn_math:
            return _cudnn_softmax(s, m_in, rs_in, sl2, scaled_s, lg2_scale_s, descale_s, flush, p_fmt)
        m_new = torch.maximum(m_in, s.amax(dim=-1, keepdim=True))
        # The kernel uses 0 in place of a -inf max, so fully masked rows give exp2(-inf) = 0.
        finite = torch.isfinite(m_new)
        m_cur = torch.where(finite, m_new, torch.zeros_like(m_new))
        rescale = flush(ex2_resc(((m_in - m_cur) * sl2).to(torch.float32)))
        max_scaled = torch.where(finite, _fma32(m_cur, sl2, -offset), torch.zeros_like(m_cur))
        p = flush(ex2_p(_fma32(s, sl2, -max_scaled)))
        rs_out = _quad_row_sum(flush(rs_in * rescale), p)
        p8 = quantize_dequantize(p, p_fmt) if p_fmt is not None else p
        return p8, rescale, m_new, rs_out

    tick = PROGRESS.get()  # progress hook
    for i_tile, t in enumerate(tiles):
        if tick is not None:  # progress hook
            tick(i_tile, n_tiles, "KV tiles")
        s0, s1 = t * pre.block_n, min(nk, (t + 1) * pre.block_n)
        if mk is not None and mk.windowed and not _mask.any_visible(mk, q_index, s0, s1, pre.seqlen_q, nk):
            continue  # FA3 never visits a KV tile outside every row's window
        k_t = native.to_float32(kn[:, :, s0:s1]).transpose(-1, -2)
        s = hopper_mma(qv, k_t, a_fmt=qk_elem, b_fmt=qk_elem) if mma_s else torch.matmul(qv, k_t)
        if bias is not None:
            desc = (qd * _rows_k(kd, s0, s1).transpose(-1, -2)).to(torch.float32)
            s = (s * desc).to(torch.float32) + bias[:, :, :, s0:s1].index_select(2, bias_blk)
        if cap is not None:  # before the mask, as FA3's scoremod_premask_fn
            if not folded and bias is None:
                s = (s * (qd * _rows_k(kd, s0, s1).transpose(-1, -2)).to(torch.float32)).to(torch.float32)
            s = _mask.softcap_tile(s, cap)
        v_t = native.to_float32(vn[:, :, s0:s1])
        if v_end is None:
            v_t = v_t * _rows_k(vd, s0, s1)
        if not fa1:
            p8, rescale, m, rs4 = softmax(s, s0, s1, m, rs4)
            if not p_float:
                p8 = cast_p(p8, recipe)
            scaled = native.rescale_rows(acc, rescale, ftz)  # in place, when compiled
            if chained is not None:
                chained(rescale)
            acc = accumulate(scaled if scaled is not None else flush(acc * rescale), p8, v_t, acc_fmts)
            continue
        # FlashAttention (Algorithm 1): P~ against the tile's own max m~, then
        # O <- (l e^(m - m_new) O + e^(m~ - m_new) P~ V) / l_new, every product a float32 rounding.
        m_loc = torch.full_like(m, -math.inf)
        rs_loc = torch.zeros_like(rs4)
        p8, _, m_loc, rs_loc = softmax(s, s0, s1, m_loc, rs_loc)
        if not p_float:
            p8 = cast_p(p8, recipe)
        m_new = torch.maximum(m, m_loc)
        m_cur = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = flush(ex2_resc(((m - m_cur) * sl2).to(torch.float32)))
        beta = flush(ex2_resc(((m_loc - m_cur) * sl2).to(torch.float32)))
        l_new = flush(alpha * l_fa1) + flush(beta * _quad_total(rs_loc))
        pv = accumulate(torch.zeros_like(acc), p8, v_t, acc_fmts)
        acc = flush(acc * flush(l_fa1 * alpha)) + flush(pv * beta)
        acc = torch.where(l_new > 0, acc / torch.where(l_new > 0, l_new, torch.ones_like(l_new)),
                          torch.zeros_like(acc))
        m, l_fa1 = m_new, l_new
    if tick is not None:  # progress hook
        tick(n_tiles, n_tiles, "KV tiles")
    if chained is not None:
        acc = accumulate.finish(acc)
    if fa1:
        o = acc * v_end.to(torch.float32) if v_end is not None else acc
        return write_out(o, recipe)
    # The kernel's final quad reduction (shuffle-xor by 2, then by 1).
    row_sum = _quad_total(rs4)
    if mk is not None and mk.sinks is not None:
        row_sum = _mask.sink_row_sum(row_sum, m, sl2, offset, mk, h)
    if cudnn_math:
        if stats is not None:
            # Stats as the H200's probes show it (one-tile runs: 94% / 90% of rows bit-equal; a float64 ln 44% / 36%):
            # fma(m', ln 2, fl(lg2.approx(fl(l descale_s)) ln 2)), m' the scaled max, descale_s = fl(1 / scale_s)
            ln2 = torch.tensor(math.log(2.0), dtype=torch.float32, device=dev)
            lg = _sfu.lg2(row_sum)  # row_sum is already fl(l descale_s) in the kernel's own units
            lse = _fma32(m, ln2, (lg * ln2).to(torch.float32))
            bad = (row_sum == 0) | torch.isnan(row_sum) | ~torch.isfinite(m)
            stats["lse"] = torch.where(bad, torch.full_like(lse, math.inf), lse).squeeze(-1)
        return write_out(_cudnn_epilogue(acc, row_sum, v_end, scale_o, descale_s), recipe)
    if scale_o is not None:
        raise UsageError(f"recipe {recipe.short_str()}: scale_o folds into the epilogue of smath=cudnn only")
    if stats is not None:
        stats["lse"] = _log_sum_exp(m, row_sum, sl2, offset, lg2=_sfu.lg2 if hw else None)
    inv = torch.where((row_sum > 0) & torch.isfinite(row_sum), 1.0 / row_sum, torch.zeros_like(row_sum))
    o = acc * (inv * v_end).to(torch.float32) if v_end is not None else acc * inv
    return write_out(o, recipe)


def _sub32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a - b, one rounding (FADD), -inf - -inf read as -inf (a row that has seen no key)."""
    d = (a.double() - b.double()).to(torch.float32)
    return torch.where(torch.isneginf(a) & torch.isneginf(b), a, d)


def _cudnn_scale_log2(scale: float, qd: torch.Tensor, kd: torch.Tensor) -> torch.Tensor:
    """cuDNN's scale of S into log2 units (``smath=cudnn``): fl(fl(fl(attn_scale descale_q) descale_k) log2e),
    three float32 multiplies left to right, log2e the float32 constant. FA3's host form, fl(attn_scale log2e)
    times fl(descale_q descale_k), is one ulp above it on validate's causal n 2048 case (0.00075888098 against
    0.00075888092) and leaves 26 of its 2,097,152 O codes on the wrong side; this form leaves 1. The case does
    not tell the orders apart that give the same float32 value (18 of the 27 products of the four factors do);
    this one is the graph's (S * attn_scale, then the descales), with log2e last. Where descale_q = descale_k =
    1 (the tie probes) or attn_scale is a power of two (the field dumps) both forms are the same number."""
    f32 = torch.float32
    x = (torch.tensor(scale, dtype=f32, device=qd.device) * qd.to(f32)).to(f32)
    x = (x * kd.to(f32)).to(f32)
    return (x * torch.tensor(LOG2E, dtype=f32, device=qd.device)).to(f32)


def _cudnn_softmax(s, m_in, rs_in, sl2, scaled_s, lg2_scale_s, descale_s, flush, p_fmt):
    """One tile of cuDNN's online softmax (``smath=cudnn``, keys/smath.py): S' = fl(S scale_log2), the
    running max m' over S', P~ = ex2.approx(fl(S' - fl(m' - L))) with L = lg2.approx(scale_s), the rescale
    ex2.approx(fl(m'_old - m'_new)). m is held scaled. The row sum: each thread's float32 sum of the tile's
    P~ (quad layout, from 0), then rs = fma(tile_sum, descale_s, fl(rs rescale)): rs holds l descale_s.
    On the H200's tie probes (multi-tile runs) only this form gives every code; P~ summed into a running
    rs (FA3's form) or the descale as its own FMUL leave 128-1446 codes per run."""
    if scaled_s:
        s = (s * sl2).to(torch.float32)  # FMUL: the scores scaled once, with their own rounding
    m_new = torch.maximum(m_in, s.amax(dim=-1, keepdim=True))
    finite = torch.isfinite(m_new)
    m_cur = torch.where(finite, m_new, torch.zeros_like(m_new))
    rescale = flush(_sfu.ex2(_sub32(m_in, m_cur)))
    max_scaled = torch.where(finite, _sub32(m_cur, lg2_scale_s.expand_as(m_cur)), torch.zeros_like(m_cur))
    p = flush(_sfu.ex2(_sub32(s, max_scaled.expand_as(s))))
    tile_sum = _quad_row_sum(torch.zeros_like(rs_in), p)
    rs_out = _fma32(tile_sum, descale_s.expand_as(tile_sum), flush(rs_in * rescale))
    p8 = quantize_dequantize(p, p_fmt) if p_fmt is not None else p
    return p8, rescale, m_new, rs_out


def _cudnn_epilogue(acc: torch.Tensor, row_sum: torch.Tensor, v_end, scale_o: float | None,
                    descale_s: torch.Tensor) -> torch.Tensor:
    """cuDNN's O (``smath=cudnn``): acc * fl(rcp.approx(l) * c), c = fl(descale_v * scale_o) folded per
    tensor (scale_s is inside l, so descale_s has no multiply of its own). On the H200's one-key rows
    only this order puts O on the kernel's side of every E4M3 tie: acc * fl(fl(rcp(l) descale_v) scale_o)
    does not. Without ``scale_o``: O itself, acc * fl(rcp(l) descale_v), what Amax_O reads.
    row_sum is l descale_s (``_cudnn_softmax``), so descale_s joins the factor: fl(fl(descale_v descale_s)
    scale_o) (the order the probes' rows fit best; fl(descale_v fl(descale_s scale_o)) does not fit)."""
    c = v_end.to(torch.float32) if v_end is not None else torch.ones((), device=acc.device)
    c = (c * descale_s.to(acc.device)).to(torch.float32)
    if scale_o is not None:
        c = (c * torch.tensor(scale_o, dtype=torch.float32, device=acc.device)).to(torch.float32)
    ok = (row_sum > 0) & torch.isfinite(row_sum)
    r = torch.where(ok, _sfu.rcp(torch.where(ok, row_sum, torch.ones_like(row_sum))), torch.zeros_like(row_sum))
    return acc * (r * c).to(torch.float32)


def write_out(o: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """float32 O rounded to the output format (float64 out); ``oscale`` is applied by ``emulate``."""
    return quantize_dequantize(o, recipe.out, torch.float64)


def _amax_scaled_out(recipe: Recipe, q, k, v, *, causal, softmax_scale, q_index, rotation_seed, cache, stats):
    """``oscale=amax``: O written in FP8 with one descale for the tensor, amax(O) / fmt.max, as
    cuDNN's sdpa_fp8 writes it on Hopper with TransformerEngine's scale_o = 448 / amax_o
    (``keys/oscale.py``). The amax is over every query row, as the kernel's Amax_O is, so the
    float32 O of every row is computed (once; the rows asked for are a slice of it)."""
    from .granularity import PerTensor
    from .quant import quantize

    plain = dataclasses.replace(recipe, out="fp32", oscale="none")
    o32 = emulate(plain, q, k, v, causal=causal, softmax_scale=softmax_scale, rotation_seed=rotation_seed,
                  cache=cache, stats=stats)
    full = quantize(o32, recipe.out, PerTensor())
    if stats is not None:
        stats["lse"] = stats["lse"].index_select(2, q_index.to(stats["lse"].device))
    if getattr(recipe, "smath", "fa3") == "cudnn":
        # cuDNN writes O * scale_o with scale_o folded into each row's factor (keys/smath.py), scale_o =
        # 1 / descale_o in float32 as the backend passes it: the codes are that product's, read back
        # as codes * descale_o
        so = float(torch.tensor(1.0 / float(full.descale.reshape(-1)[0]), dtype=torch.float32))
        y = emulate(plain, q, k, v, causal=causal, softmax_scale=softmax_scale, q_index=q_index,
                    rotation_seed=rotation_seed, cache=cache, scale_o=so)
        codes = quantize_dequantize(y.to(torch.float32), recipe.out, torch.float64)
        return codes * full.descale.reshape(-1)[0].to(torch.float64)
    return Quantized(full.values.index_select(2, q_index.to(o32.device)), full.descale,
                     full.fmt).dequantize(torch.float64)


def _log_sum_exp(m: torch.Tensor, row_sum: torch.Tensor, sl2: torch.Tensor, offset: float,
                 lg2=None) -> torch.Tensor:
    """The kernel's saved statistic (FA3 ``softmax.finalize``): m * (scale_log2 * ln 2) + ln(row_sum / 2^offset)
    in float32, [B, H, R]; +inf where the row sum is 0 or NaN (a row that sees no key), so that
    a backward's exp(S * scale - lse) is 0 there. ``m`` is the running max of S as the softmax
    step held it (raw or descaled, matching ``sl2``). ``lg2`` (sfu=h200): ln as the fast-math build's
    __logf, lg2.approx(s) times float32 ln 2, in place of ln in float64 rounded once."""
    ln2 = torch.tensor(math.log(2.0), dtype=torch.float32, device=m.device)
    sl = (sl2 * ln2).to(torch.float32)
    # the 2^-offset is exact; ln(row_sum) in float64 rounded once stands in for the kernel's __logf
    s = row_sum * float(2.0 ** -offset)
    ln_s = (lg2(s) * ln2).to(torch.float32) if lg2 is not None else torch.log(s.double()).to(torch.float32)
    lse = (m * sl).to(torch.float32) + ln_s
    bad = (s == 0) | torch.isnan(s) | ~torch.isfinite(m)
    return torch.where(bad, torch.full_like(lse, math.inf), lse).squeeze(-1)


def _quad_total(rs4: torch.Tensor) -> torch.Tensor:
    """The quad's four partial row sums added as the kernel adds them (shuffle-xor by 2, then 1)."""
    return ((rs4[..., 0] + rs4[..., 2]) + (rs4[..., 1] + rs4[..., 3])).unsqueeze(-1)


def _quad_row_sum(rs4: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Add a tile's P~ [.., R, N] into the quad's partial row sums rs4 [.., R, 4], in the
    kernel's order: in the wgmma accumulator layout thread t of a quad holds columns 8j + 2t and
    8j + 2t + 1, and adds them to its running float32 sum for j = 0, 1, ... (FA3's
    ``reduce_sum``, no cross-thread reduction per tile). Sums of non-negative normal numbers
    are never subnormal, so the flush needs no place here. Padding columns add +0."""
    n = p.shape[-1]
    pad = (-n) % 8
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    p = p.reshape(*p.shape[:-1], -1, 4, 2)
    for j in range(p.shape[-3]):
        rs4 = rs4 + p[..., j, :, 0]
        rs4 = rs4 + p[..., j, :, 1]
    return rs4


def _rows_k(d: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    return d[:, :, s0:s1] if d.shape[2] > 1 else d


def _standard(recipe: Recipe, pre: Prepared, q_index: torch.Tensor, causal: bool, scale: float,
              mk: "_mask.Masking | None" = None) -> torch.Tensor:
    dev = pre.q.values.device
    s_fmt, sm_fmt = get_format(recipe.s), get_format(recipe.softmax)
    p_fmt = get_format(recipe.p) if family(recipe.p) == "float" else None
    # Q decides the output's heads: K and V of one KV head (MQA) stay unexpanded and broadcast.
    b, h = pre.q.values.shape[:2]
    nk, dv = pre.seqlen_k, pre.v.values.shape[-1]
    r = q_index.numel()
    # One (batch, head) and as many query rows as fit a chunk of S at a time: large GEMMs and
    # cache-sized temporaries (the batched form multiplied 16-row blocks).
    chunk = max(1, _std_chunk_elems(dev) // max(1, nk))
    narrow_s = s_fmt.mbits < 23
    qv_all = pre.q.values
    qd_all = pre.q.descale.expand(b, h, -1, 1)
    kd_all = pre.k.descale.expand(b, h, -1, 1)
    vd_all = pre.v.descale.expand(b, h, -1, -1)

    def at(t: torch.Tensor, bi: int, hi: int) -> tuple[int, int]:
        """Index of (batch bi, head hi) in ``t``, whose batch or head axis may be broadcast (size 1)."""
        return bi if t.shape[0] > 1 else 0, hi if t.shape[1] > 1 else 0

    def head(t: torch.Tensor, bi: int, hi: int) -> torch.Tensor:
        return t[at(t, bi, hi)]

    unit_qk = bool((pre.q.descale == 1).all()) and bool((pre.k.descale == 1).all())
    split = recipe.sscale == "split"
    if split:
        # PyTorch's math SDPA: Q and K each times sqrt(scale), rounded to their format.
        root = math.sqrt(scale)
        qk_fmt = get_format(recipe.qk)
    widened: dict = {}

    def kv_head(bi: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K (as S = Q K^T sees it) and V of one head in float32, widened when first needed
        and kept while that head's row chunks run: whole float32 copies of K and V would hold
        268 MB at the paper's shape through the whole call."""
        key = at(pre.k.values, bi, hi)
        if key not in widened:
            widened.clear()
            k_h = native.to_float32(pre.k.values[key])
            if split:
                k_h = quantize_dequantize(k_h * root, qk_fmt)
            widened[key] = (k_h, native.to_float32(head(pre.v.values, bi, hi)))
        return widened[key]

    def softmax_rows(bi: int, hi: int, c: int) -> torch.Tensor:
        idx = q_index[c:c + chunk]
        qv = head(qv_all, bi, hi)[c:c + chunk].to(torch.float32)
        if split:
            qv = quantize_dequantize(qv * root, qk_fmt)
        qd = head(qd_all, bi, hi)
        qd = qd[c:c + chunk] if qd.shape[0] > 1 else qd
        # In place on the product's own buffer: each step the same float32 rounding as out of place
        # (x * 1 is x, so unit descales, those of unscaled FP16/BF16 operands, are skipped).
        s = torch.matmul(qv, kv_head(bi, hi)[0].transpose(-1, -2))
        if not unit_qk:
            s.mul_(qd * head(kd_all, bi, hi).transpose(-1, -2))
        if pre.bias is not None:  # smooth=qk: the correction joins S before S is rounded and scaled
            s = s + head(pre.bias, bi, hi).index_select(0, torch.div(idx, pre.block_m, rounding_mode="floor"))
        s = quantize_dequantize(s, s_fmt)
        if not split:
            # A narrow S is scaled after the matmul, in its own format (a second rounding).
            s = quantize_dequantize(s * scale, s_fmt) if narrow_s else s.mul_(scale)
        if mk is not None:
            return quantize_dequantize(_mask.softmax_rows32(s, mk, idx, hi, pre.seqlen_q, nk), sm_fmt)
        if not causal:
            return quantize_dequantize(torch.softmax(s, dim=-1), sm_fmt)
        vis = causal_mask(idx, 0, nk, pre.seqlen_q, nk)
        # A row that sees no key (causal, seqlen_q > seqlen_k) is 0, as in the reference, the flash
        # algorithm and PyTorch's math SDPA (its safe softmax); a plain softmax of -inf gives NaN.
        p = torch.softmax(s.masked_fill(~vis, -math.inf), dim=-1).masked_fill(~vis.any(dim=-1, keepdim=True), 0.0)
        return quantize_dequantize(p, sm_fmt)

    # P rounded to the softmax's format already holds values of P's format: a second rounding changes none.
    p_same = p_fmt is not None and p_fmt.name == sm_fmt.name and mk is None
    blocks = [(bi, hi, c) for bi in range(b) for hi in range(h) for c in range(0, r, chunk)]
    p_mult = 1.0
    kept: dict = {}  # block -> its softmax rows, from the amax pass below
    if family(recipe.p) == "mx":
        pass  # block scales give P its range; no multiplier
    elif recipe.p_scale == "tensor" and p_fmt.saturate:
        # Per-tensor P scale needs the amax of P over every evaluated row first. Softmax rows
        # already rounded to a 16-bit format are kept in that dtype (exact) for the second pass,
        # which then skips S = Q K^T and the softmax for them (a third of baseline-fp8's time),
        # up to _p_keep_bytes (the paper's shape needs 537 MB; the CPU keeps the first 128 MB
        # so that the run stays under 2 GB); the other blocks are recomputed.
        keep_dtype = sm_fmt.dtype if sm_fmt.dtype in (torch.float16, torch.bfloat16) else None
        room = _p_keep_bytes(dev) if keep_dtype is not None else 0
        # The running amax stays on the device: one read at the end, not a GPU sync per block (fmax
        # skips a NaN block max as Python's max did).
        p_amax_t = torch.zeros((), dtype=torch.float32, device=dev)
        for blk in blocks:
            p_rows = softmax_rows(*blk)
            p_amax_t = torch.fmax(p_amax_t, p_rows.amax().to(torch.float32))
            if p_rows.numel() * 2 <= room:  # the first blocks, as many as fit
                kept[blk] = p_rows.to(keep_dtype)
                room -= p_rows.numel() * 2
        p_amax = p_amax_t.item()
        p_mult = p_fmt.max / p_amax if p_amax > 0 else 1.0
    elif recipe.p_scale == "offset":
        p_mult = 2.0 ** recipe.p_offset if p_fmt.saturate else 1.0
    out = torch.empty((b, h, r, dv), dtype=torch.float64, device=dev)
    tick = PROGRESS.get()  # progress hook
    v_deq: dict = {}  # the current head's descaled V, computed once for its row chunks
    for i_blk, (bi, hi, c) in enumerate(blocks):
        p_rows = kept.pop((bi, hi, c)).to(torch.float32) if (bi, hi, c) in kept else softmax_rows(bi, hi, c)
        # p_rows is this block's own buffer; x * 1 and x / 1 are x, so a unit multiplier is skipped,
        # and so is P's cast where P's format is the softmax's own (rounding is idempotent).
        if p_mult == 1.0 and p_same:
            p8 = p_rows
        else:
            p8 = cast_p(p_rows.mul_(p_mult) if p_mult != 1.0 else p_rows, recipe, materialised=True)
        if (bi, hi) not in v_deq:
            v_deq.clear()
            v_deq[(bi, hi)] = kv_head(bi, hi)[1] * head(vd_all, bi, hi)
        o = torch.matmul(p8, v_deq[(bi, hi)])
        if p_mult != 1.0:
            o.div_(p_mult)
        out[bi, hi, c:c + chunk] = quantize_dequantize(o, recipe.out, torch.float64)
        if tick is not None:  # progress hook
            tick(i_blk + 1, len(blocks), "row blocks")
    return out
