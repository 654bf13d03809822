"""Kernel-faithful emulation of the backward pass of tiled (flash) attention.

Exposed: ``Forward``, ``Gradients``, ``backward_tiles``, ``run_forward``, ``emulate_backward``,
``backward_from``.

The backward reads what its forward saved: O and the log-sum-exp (LSE, natural log of
sum exp(scale S), ``emulator.emulate(stats=)``). So an FP8 forward followed by a BF16 backward
(what FA3 users run: FA3 has no FP8 backward) recomputes P from BF16 Q and K against the FP8
forward's LSE, and forms D from the FP8 forward's O. It follows FA3's backward
(hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp and its pre/post-processing kernels):

- D = rowsum(dO O) in float32, from dO and O in the ``bwd.ds`` formats (FA3's preprocess kernel);
- per KV tile of ``bn`` keys: S = Q K^T (``bwd.s``), P = exp2(S scale log2e - LSE log2e) as one
  fused multiply-add in float32, 0 where masked (bottom-right causal, as the forward);
  dP = dO V^T (``bwd.dp``); dS = P (dP - D) in float32; dV += P^T dO (``bwd.dv``, P cast
  to its format); dQ += dS K (``bwd.dq``, dS cast; under ``bwd.dqcast=fp16`` through FP16 first, as
  cuDNN's Hopper kernel; under ``bwd.dqscale=end`` the raw products are summed over KV tiles and
  descaled once, as cuDNN's); dK += dS^T Q (``bwd.dk``);
- dQ accumulates across KV tiles in float32 (FA3's dQaccum, atomics in float32) and is multiplied
  by the softmax scale at the end (its postprocess kernel); dK is multiplied by the scale, dV not;
- grouped-query attention: dK and dV of every query head of a KV head are summed in float32 (FA3's
  dKaccum / dVaccum for GQA), then written in ``bwd.out``.

All query rows of a KV tile are processed at once: the query tiles (``bwd.bm`` rows) matter only
where the recipe makes them matter, in per-block scales and in the MMA model's chaining of dK and
dV over query rows, which one product over every row in order reproduces (the k-steps are
visited in the same order). Every query row is computed: dK and dV sum over all of them.

Operands: float formats are ``quant.quantize``'d (16-bit and float32 unscaled, FP8 at
``bwd.gran``), int8 by ``quant.quantize_int``; P and dS, made inside the kernel, are cast per tile
with the same saturating ``formats.cast`` (``tensor``/``head`` scales from their amax over the
whole call, found in a first pass: current scaling, where TransformerEngine's delayed scaling
would use an earlier step's amax; ``block``: one scale per bm x bn tile; ``token``: one per row
of the tile). With ``bwd.acc=fp32`` the GEMM is float32 with TF32 off on the formats' values, a
descale uniform per (batch, head) multiplying its result; descales that vary along a tensor (block,
token) are multiplied into the operand in float32 first (one rounding, 2^-24 relative, far below any
format's own), integer codes likewise (where an INT32 accumulator would be exact: the float32 sum
differs by ~2^-24 relative, against INT8's 2^-8). With ``bwd.acc=fp22`` FP8/BF16 operands go to the
Hopper MMA model (``mma.hopper_mma``) as their own values and the uniform descales multiply the result.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import UsageError
from .emulator import emulate, exp2_rz
from . import sfu
from .families import family
from .formats import cast, get_format, quantize_dequantize
from .granularity import PerBlock, PerHead, PerTensor, PerToken
from .intformats import get_int_format, round_to_int
from .keys.backward import backward_pairs
from .mma import hopper_mma
from .accumulators import hopper_mma_on
from .quant import amax_to_scale, quantize, quantize_int
from .recipe import Recipe
from .reference import causal_mask
from .rotation import make_rotation

LOG2E = math.log2(math.e)
# P and dS tiles the amax pass of per-tensor/per-head scales keeps for the main pass
_KEEP_BYTES = 256 << 20

# FA3's backward tiles on sm90 (kBlockM, kBlockN) by head dim, from hopper/flash_bwd_launch_template.h;
# hdim 128 uses 80-row query tiles without a causal mask and 64 with one.
_FA3_BWD_TILES = {64: (128, 128), 96: (64, 128), 128: (80, 128), 192: (64, 96), 256: (64, 80)}


@dataclasses.dataclass
class Forward:
    """What a forward saved for its backward: O [B, H, N, Dv] (float64 holding the output format's
    values) and the LSE [B, H, N] (float32)."""

    o: torch.Tensor
    lse: torch.Tensor


@dataclasses.dataclass
class Gradients:
    """dQ [B, H, N, D], dK and dV [B, Hkv, N_k, D] (float64 holding ``bwd.out``'s values) and the
    forward they were computed from."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    forward: Forward


def backward_tiles(recipe: Recipe, head_dim: int, causal: bool) -> tuple[int, int]:
    """(kBlockM, kBlockN) of the backward: ``bwd.bm``/``bwd.bn``, zeros from FA3's table (FA2's under
    ``loop=fa2``)."""
    if recipe.loop == "fa2":
        from .fa2_loop import fa2_bwd_tiles

        m, n = fa2_bwd_tiles(head_dim)
        return recipe.bwd_bm or m, recipe.bwd_bn or n
    d = min((k for k in _FA3_BWD_TILES if k >= head_dim), default=256)
    m, n = _FA3_BWD_TILES[d]
    if d == 128 and causal:
        m = 64
    return recipe.bwd_bm or m, recipe.bwd_bn or n


def run_forward(recipe: Recipe, q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                rotation_seed: int = 0, cache: dict | None = None) -> Forward:
    """The recipe's forward over every query row, with the LSE it saves (``emulator.emulate``)."""
    stats: dict = {}
    o = emulate(recipe, q, k, v, causal=causal, softmax_scale=softmax_scale, rotation_seed=rotation_seed,
                cache=cache, stats=stats)
    return Forward(o, stats["lse"])


def emulate_backward(recipe: Recipe, q, k, v, do, *, causal: bool = False, softmax_scale: float | None = None,
                     rotation_seed: int = 0, forward: Forward | None = None, cache: dict | None = None) -> Gradients:
    """Forward (unless given) then backward of ``recipe`` on float64 Q [B, H, N, D], K, V
    [B, Hkv, N_k, D] and the incoming gradient dO [B, H, N, Dv]."""
    fwd = forward or run_forward(recipe, q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 rotation_seed=rotation_seed, cache=cache)
    return backward_from(recipe, q, k, v, fwd, do, causal=causal, softmax_scale=softmax_scale,
                         rotation_seed=rotation_seed)


# -- operands ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Operand:
    """One GEMM operand: ``x`` the dequantized value, or (for a descale uniform per (batch, head))
    the format's own values ``raw`` and that descale ``d``, which the product takes out of the GEMM
    (the MMA model needs the format's values; the float32 path saves a pass over the operand)."""

    x: torch.Tensor | None
    fmt: str
    raw: torch.Tensor | None = None
    d: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self.x is None:
            self.x = (self.raw * self.d).to(self.raw.dtype)
        return self.x


def _scaled_fmt(fmt: str) -> bool:
    return family(fmt) == "int" or get_format(fmt).saturate


def _quantize(x: torch.Tensor, fmt: str, gran, rows: int, wd: torch.dtype) -> _Operand:
    """A tensor the kernel reads from memory (Q, K, V, O, dO), [B, H, N, D] float64; ``wd`` the
    working precision (float32; float64 under ``bwd.acc=fp64``)."""
    if family(fmt) == "int":
        qt = quantize_int(x, fmt, gran, block_rows=rows, ties="even")
        return _Operand((qt.values.to(wd) * qt.descale).to(wd), fmt)
    qt = quantize(x, fmt, gran, block_rows=rows)
    vals = qt.values.to(wd)
    if not _scaled_fmt(fmt):
        return _Operand(vals, fmt, vals, None)
    if qt.descale.shape[2] == 1 and qt.descale.shape[3] == 1:
        return _Operand(None, fmt, vals, qt.descale)
    return _Operand((vals * qt.descale).to(wd), fmt)


def _cast_tile(x: torch.Tensor, fmt: str, descale: torch.Tensor | None, wd: torch.dtype,
               via: torch.dtype | None = None, scale: torch.Tensor | None = None) -> _Operand:
    """P or dS of one KV tile ([B, H, N, bn] float32) cast to ``fmt``; ``descale`` broadcasts
    against it (None: the format is used unscaled). ``via``: the scaled value is first rounded to
    that dtype (float16 under ``bwd.dqcast=fp16``), then cast: two roundings. ``scale``: the tile is
    multiplied by it (float32) instead of divided by ``descale`` (cuDNN's scale_S on P)."""
    if descale is None:
        vals = cast(x if via is None else x.to(via).to(x.dtype), fmt).to(wd)
        return _Operand(vals, fmt, vals, None)
    if family(fmt) == "int":
        codes = round_to_int(x / descale.to(x.dtype), get_int_format(fmt), "even")
        return _Operand((codes * descale).to(wd), fmt)
    # the kernel scales the float32 tile in float32 and casts it (cvt.rn.satfinite): one rounding each
    scaled = x / descale.to(x.dtype) if scale is None else x * scale.to(x.dtype)
    if via is not None:
        # beyond FP16's range the value becomes inf, which the saturating cast takes to the format's max
        scaled = scaled.to(via).to(x.dtype)
    vals = quantize_dequantize(scaled, fmt, wd)
    if descale.shape[2] == 1 and descale.shape[3] == 1:
        return _Operand(None, fmt, vals, descale)
    return _Operand((vals * descale).to(wd), fmt)


def _cast_by_scale(x: torch.Tensor, fmt: str, amax: torch.Tensor, wd: torch.dtype,
                   via: torch.dtype | None = None) -> _Operand:
    """dS of one KV tile cast as cuDNN does (``bwd.dsform=cudnn``): scale_dP = max / amax rounded to
    float32, the cast of the float32 product x scale_dP (``via``: through that dtype first), and
    descale_dP = 1 / scale_dP rounded to float32 for the products (kernels/cudnn.py forms both so)."""
    f = get_format(fmt)
    a = float(amax.max())
    s = torch.tensor(f.max / a if 0 < a < math.inf else 1.0, dtype=torch.float64).to(torch.float32)
    scaled = x * s.to(x.dtype)
    if via is not None:
        scaled = scaled.to(via).to(x.dtype)
    vals = quantize_dequantize(scaled, fmt, wd)
    d = torch.tensor(1.0 / float(s), dtype=torch.float64).to(torch.float32).reshape(1, 1, 1, 1)
    return _Operand(None, fmt, vals, d.to(x.device))


def _fmt_max(fmt: str) -> object:
    return get_int_format(fmt) if family(fmt) == "int" else get_format(fmt)


def _tile_descale(x: torch.Tensor, fmt: str, gran, bm: int, whole: torch.Tensor | None) -> torch.Tensor | None:
    """Descale of P or dS in one KV tile: from the whole call's amax (``whole``, tensor/head),
    per bm-row block of the tile, or per row of the tile."""
    if not _scaled_fmt(fmt):
        return None
    f = _fmt_max(fmt)
    if isinstance(gran, (PerTensor, PerHead)):
        return amax_to_scale(whole, f)
    if isinstance(gran, PerToken):
        return amax_to_scale(_absmax(x, (-1,)), f)
    b, h, n, bn = x.shape
    nb = -(-n // bm)
    pad = torch.nn.functional.pad(x, (0, 0, 0, nb * bm - n)) if nb * bm != n else x
    blk = _absmax(pad.reshape(b, h, nb, bm, bn), (3, 4))
    return amax_to_scale(blk.reshape(b, h, nb).repeat_interleave(bm, dim=2)[:, :, :n].unsqueeze(-1), f)


def _absmax(x: torch.Tensor, dims: tuple) -> torch.Tensor:
    """max |x| over ``dims`` (kept) as the larger of max and -min: two reductions, no |x| copy."""
    return torch.maximum(x.amax(dim=dims, keepdim=True), -x.amin(dim=dims, keepdim=True))


def _mm(a: _Operand, b: _Operand, acc: str, *, ta: bool = False, tb: bool = False) -> torch.Tensor:
    """a @ b (``ta``/``tb``: transpose the last two dims first) under the accumulator model, as
    float32 (float64 under ``bwd.acc=fp64``)."""
    def t(x, flag):
        return x.transpose(-1, -2) if flag else x

    fa, fb = a.fmt, b.fmt
    if acc == "fp64":
        return torch.matmul(t(a.value().to(torch.float64), ta), t(b.value().to(torch.float64), tb))
    mma = acc == "fp22" and family(fa) == "float" and family(fb) == "float" and \
        hopper_mma_on("fp22", get_format(fa), get_format(fb))
    if a.raw is None or b.raw is None or (acc == "fp22" and not mma):
        return torch.matmul(t(a.value(), ta), t(b.value(), tb))
    if mma:
        out = hopper_mma(t(a.raw, ta).contiguous(), t(b.raw, tb).contiguous(), a_fmt=get_format(fa),
                         b_fmt=get_format(fb))
    else:
        out = torch.matmul(t(a.raw, ta), t(b.raw, tb))
    scale = a.d if b.d is None else (b.d if a.d is None else a.d * b.d)
    return out if scale is None else out.mul_(scale.to(out.dtype))


def _expand(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, H, ...] (a view); descales of size 1 on the head axis stay."""
    if x.shape[1] in (1, h):
        return x
    g = h // x.shape[1]
    return x[:, :, None].expand(x.shape[0], x.shape[1], g, *x.shape[2:]).reshape(x.shape[0], h, *x.shape[2:])


def _expand_op(op: _Operand, h: int) -> _Operand:
    ex = lambda t: None if t is None else _expand(t, h)  # noqa: E731
    return _Operand(ex(op.x), op.fmt, ex(op.raw), ex(op.d))


def _take_rows(op: _Operand, idx: torch.Tensor | None) -> _Operand:
    """The operand's rows (sequence axis) in the order ``idx`` (None: as they are); a descale that
    varies along the rows follows them."""
    if idx is None:
        return op
    tk = lambda t: None if t is None else (t.index_select(2, idx) if t.shape[2] > 1 else t)  # noqa: E731
    return _Operand(tk(op.x), op.fmt, tk(op.raw), tk(op.d))


def _query_order(recipe: Recipe, n: int, bm: int, device) -> torch.Tensor | None:
    """Row order of the dK/dV contraction: None (first to last) or the query tiles last to first,
    each tile's rows in order (``bwd.order=reverse``, FA2's loop over m_block)."""
    if recipe.bwd_order != "reverse" or n <= bm:
        return None
    blocks = [torch.arange(s0, min(n, s0 + bm), device=device) for s0 in range(0, n, bm)]
    return torch.cat(blocks[::-1])


def _fa2_dot_do_o(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO O) in FA2's preprocess order (flash_bwd_preprocess_kernel.h ``dot_do_o``): 8
    threads per row, thread t takes columns 8t..8t+7 of every 64-column block and chains them with
    FFMAs (block by block), then a butterfly sum over the 8 threads (xor 4, 2, 1). Float32 [.., N, 1]."""
    n, d = do.shape[-2:]
    blocks = -(-d // 64)
    pad = blocks * 64 - d
    a, b = (torch.nn.functional.pad(x.to(torch.float32), (0, pad)) if pad else x.to(torch.float32) for x in (do, o))
    a = a.reshape(*a.shape[:-1], blocks, 8, 8)  # [.., N, block, thread, element]
    b = b.reshape(*b.shape[:-1], blocks, 8, 8)
    part = None
    for blk in range(blocks):
        for e in range(8):
            prod = a[..., blk, :, e].double() * b[..., blk, :, e].double()
            part = prod.to(torch.float32) if part is None else (prod + part.double()).to(torch.float32)
    for off in (4, 2, 1):
        part = part + part[..., torch.arange(8, device=part.device) ^ off]
    return part[..., :1]


def _rows(op: _Operand, s0: int, s1: int) -> _Operand:
    """Rows s0:s1 along the sequence axis of an operand."""
    sl = lambda t: None if t is None else t[:, :, s0:s1]  # noqa: E731
    return _Operand(sl(op.x), op.fmt, sl(op.raw), op.d)


def _group_sum(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, H, ...] -> [B, Hkv, ...]: float32 sum over the query heads of each KV head."""
    b, h = x.shape[:2]
    if h == hkv:
        return x
    return x.reshape(b, hkv, h // hkv, *x.shape[2:]).sum(dim=2, dtype=x.dtype)


def _write(x: torch.Tensor, fmt: str, outscale: str = "descale") -> torch.Tensor:
    """A gradient in ``bwd.out``: FP8 with one scale per tensor (cuDNN's scale_dQ/dK/dV from the
    amax), wider formats as they are; float64 holding the values. ``outscale=scale``: the code is the
    cast of the float32 product x scale with scale = max / amax rounded to float32, the value code /
    scale (cuDNN: its epilogue multiplies by scale_dX, which the caller forms so); ``descale``: the
    cast of x / (amax / max) in float64, the value code descale."""
    f = get_format(fmt)
    if not f.saturate:
        return cast(x, f).to(torch.float64) if f.dtype is not None else x.to(torch.float64)
    if outscale == "scale":
        a = float(x.abs().amax())
        s = torch.tensor(f.max / a if 0 < a < math.inf else 1.0, dtype=torch.float64).to(torch.float32)
        return cast(x.to(torch.float32) * s, f).to(torch.float64) / s.to(torch.float64)
    d = amax_to_scale(x.abs().amax(), f).to(torch.float64)
    return cast(x.to(torch.float64) / d, f).to(torch.float64) * d


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a b + c rounded once (FFMA): the product of two float32 is exact in float64, the sum is
    rounded to float64 and then to float32; that double rounding differs from FFMA's single one only
    when the float64 sum lands on a float32 midpoint (about 2^-29 of inputs)."""
    return (a.double() * b.double() + c.double()).to(torch.float32)


def _cudnn_p(q_s: _Operand, k_t: _Operand, acc: str, scale: float, lse: torch.Tensor) -> torch.Tensor:
    """P of one KV tile as cuDNN's Hopper FP8 backward forms it (``bwd.pexp=cudnn``), float32 (its cast then multiplies by scale_s): the
    graph's S descale_Q descale_K attn_scale - Stats, then exp, compiled as x = FFMA(S', c, -LSE) on
    the MMA's raw S' with c = (attn_scale descale_Q) descale_K in float32, then __expf(x) =
    ex2.approx.ftz(x log2e) (the product rounded to float32; MUFU.EX2 bit for bit, ``sfu.ex2``).
    Fitted on the kernel's bytes: every differing dV code of 12 saved case-arms goes
    (reports/h200/backward/cudnn.md). Descales that vary along the contraction leave no raw S': then
    S is the descaled product and c the softmax scale alone."""
    from .sfu import ex2

    one = torch.tensor(1.0, dtype=torch.float32)
    if q_s.raw is not None and k_t.raw is not None:
        s = _mm(_Operand(None, q_s.fmt, q_s.raw, None), _Operand(None, k_t.fmt, k_t.raw, None), acc, tb=True)
        dq = q_s.d if q_s.d is not None else one
        dk = k_t.d if k_t.d is not None else one
        c = (torch.tensor(scale, dtype=torch.float32) * dq.to(torch.float32)) * dk.to(torch.float32)
    else:
        s = _mm(q_s, k_t, acc, tb=True)
        c = torch.tensor(scale, dtype=torch.float32)
    x = _fma32(s, c, -lse.to(torch.float32).unsqueeze(-1))
    return ex2(x * torch.tensor(LOG2E, dtype=torch.float32))


# -- the backward --------------------------------------------------------------------------------

def backward_from(recipe: Recipe, q, k, v, fwd: Forward, do, *, causal: bool = False,
                  softmax_scale: float | None = None, rotation_seed: int = 0) -> Gradients:
    """dQ, dK, dV of attention from the forward's saved O and LSE (module docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if h % hkv:
        raise UsageError(f"heads ({h}) must be a multiple of kv_heads ({hkv})")
    if do.shape != fwd.o.shape or fwd.lse.shape != (b, h, n):
        raise UsageError(f"dO {tuple(do.shape)}, O {tuple(fwd.o.shape)} and LSE {tuple(fwd.lse.shape)} do not match "
                         f"Q {tuple(q.shape)}: the backward needs every query row of the forward")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    bm, bn = backward_tiles(recipe, d, causal)
    pairs = backward_pairs(recipe)
    gran, acc = recipe.bwd_gran, recipe.bwd_acc
    rows_q, rows_k = (bm, bn) if isinstance(gran, PerBlock) else (0, 0)

    rot = make_rotation(recipe.bwd_rot, d, rotation_seed) if recipe.bwd_rot != "none" else None
    q64, k64, v64, do64 = (t.to(torch.float64) for t in (q, k, v, do))
    o64 = fwd.o.to(torch.float64)
    if rot is not None:
        # (Q M)(K M)^T = Q K^T and (dO M)(V M)^T = dO V^T: rotating along head_dim changes no product
        # in exact arithmetic, only what the casts see; D = rowsum(dO O) is rotation-invariant too.
        q64, k64, v64, do64, o64 = (rot.apply(t) for t in (q64, k64, v64, do64, o64))

    # float64 throughout under bwd.acc=fp64: the algorithm checked against autograd, no rounding
    wd = torch.float64 if acc == "fp64" else torch.float32

    memo: dict = {}

    def op(x, key, side, rows):
        # a tensor read by several products in one format is quantized once
        at = (id(x), pairs[key][side])
        if at not in memo:
            memo[at] = _quantize(x, pairs[key][side], gran, rows, wd)
        return memo[at]

    q_s, k_s = op(q64, "bwd.s", 0, rows_q), _expand_op(op(k64, "bwd.s", 1, rows_k), h)
    do_dv = op(do64, "bwd.dv", 1, rows_q)
    do_dp, v_dp = op(do64, "bwd.dp", 0, rows_q), _expand_op(op(v64, "bwd.dp", 1, rows_k), h)
    k_dq = _expand_op(op(k64, "bwd.dq", 1, rows_k), h)
    q_dk = op(q64, "bwd.dk", 1, rows_q)
    # D: FA3's preprocess reads dO and O as stored and sums their product in float32.
    do_d, o_d = op(do64, "bwd.ds", 0, rows_q), op(o64, "bwd.ds", 1, rows_q)
    # bwd.dsform=cudnn: cuDNN's graph, dS = (dP - D) P attn_scale times scale_dP = max / amax of that, with
    # D = rowsum of the FP8 codes' products times descale_dO, then descale_O; FP8 dS at one scale per tensor only
    ds_cudnn = (recipe.bwd_dsform in ("cudnn", "cudnn-ffma") and wd == torch.float32 and isinstance(gran, PerTensor)
                and all(f in ("e4m3", "e5m2") for f in (pairs["bwd.dq"][0], pairs["bwd.dk"][0]))
                and do_d.raw is not None and o_d.raw is not None)
    # the fused form needs dO and V as raw FP8 values with one descale each (per-tensor, checked above)
    ds_ffma = (ds_cudnn and recipe.bwd_dsform == "cudnn-ffma" and do_dp.raw is not None and v_dp.raw is not None
               and do_dp.d is not None and v_dp.d is not None)
    if ds_cudnn:
        dsum = (do_d.raw * o_d.raw).sum(dim=-1, keepdim=True, dtype=wd)
        for t in (do_d.d, o_d.d):
            dsum = dsum if t is None else dsum * t.to(wd)
    elif recipe.loop == "fa2" and wd == torch.float32:
        dsum = _fa2_dot_do_o(do_d.value(), o_d.value())
    else:
        dsum = (do_d.value() * o_d.value()).sum(dim=-1, keepdim=True, dtype=wd)

    sl2 = torch.tensor(scale * LOG2E, dtype=wd)
    scale_t = torch.tensor(scale, dtype=wd)
    lse2 = (fwd.lse.to(wd) * torch.tensor(LOG2E, dtype=wd)).unsqueeze(-1)
    q_pos = torch.arange(n, device=q.device)
    p_fmt, ds_fmt_q, ds_fmt_k = pairs["bwd.dv"][0], pairs["bwd.dq"][0], pairs["bwd.dk"][0]
    tiles = [(s0, min(nk, s0 + bn)) for s0 in range(0, nk, bn)]
    torch_exp2 = getattr(recipe, "fa2math", "fa3") == "torch" and wd == torch.float32
    hw_exp2 = sfu.wanted(recipe) and wd == torch.float32  # sfu=h200: the measured ex2.approx.ftz
    # bwd.pexp=cudnn: cuDNN's natural-log FFMA and __expf (ex2.approx); float32 arithmetic only
    cudnn_exp = recipe.bwd_pexp == "cudnn" and wd == torch.float32

    def p_and_ds(s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_t = _rows(k_s, s0, s1)
        if cudnn_exp:
            p = _cudnn_p(q_s, k_t, acc, scale, fwd.lse)
        else:
            s = _mm(q_s, k_t, acc, tb=True)
            # FA3: exp2f(S * scale_log2 - lse_log2), an FFMA then ex2.approx. Here a float32 multiply and
            # subtract (two roundings where FFMA has one: both are ~|x| 2^-24 in the exponent) and torch's
            # exp2, in place; an infinite LSE (a row that saw no key) gives 0
            if hw_exp2:
                p = sfu.ex2(s.mul_(sl2).sub_(lse2))
            elif torch_exp2:
                p = exp2_rz(s.mul_(sl2).sub_(lse2))  # fa2math=torch: exp2f as the forward's
            else:
                p = torch.exp2(s.mul_(sl2).sub_(lse2), out=s)
        if causal:
            vis = causal_mask(q_pos, s0, s1, n, nk)
            p = p.masked_fill(~vis, 0.0)
        v_t = _rows(v_dp, s0, s1)
        if ds_ffma:
            # bwd.dsform=cudnn-ffma: the graph's descale_dO, descale_V and "- D" compiled as one FFMA on the
            # MMA's raw dP', FFMA(dP', descale_dO descale_V, -D), as P's exponent (bwd.pexp=cudnn)
            dpr = _mm(_Operand(None, do_dp.fmt, do_dp.raw, None), _Operand(None, v_t.fmt, v_t.raw, None), acc, tb=True)
            c = do_dp.d.to(wd) * v_t.d.to(wd)
            ds = (p * _fma32(dpr, c, -dsum)).to(wd)
        else:
            dp = _mm(do_dp, v_t, acc, tb=True)
            ds = (p * (dp - dsum)).to(wd)
        return p, ds

    # tensor/head scales of P and dS need their amax over the whole call first; the first pass keeps
    # its tiles (up to _KEEP_BYTES) so that the second does not recompute them
    whole, kept = {}, {}
    # bwd.pscale=offset: P cast with the forward's fixed scale 2^poff (cuDNN's scale_s), not an amax
    p_fixed = None
    if recipe.bwd_pscale == "offset" and _scaled_fmt(p_fmt):
        p_fixed = torch.tensor(2.0 ** -recipe.p_offset, dtype=torch.float32, device=q.device).reshape(1, 1, 1, 1)
        p_scale_s = torch.tensor(2.0 ** recipe.p_offset, dtype=torch.float32, device=q.device)
    needs = [fmt for fmt in (p_fmt, ds_fmt_q, ds_fmt_k) if _scaled_fmt(fmt)]
    if needs and isinstance(gran, (PerTensor, PerHead)):
        dims = (0, 1, 2, 3) if isinstance(gran, PerTensor) else (2, 3)
        amax = {"p": None, "ds": None, "dsf": None}
        room = _KEEP_BYTES
        for s0, s1 in tiles:
            p, ds = p_and_ds(s0, s1)
            for name, t in (("p", p), ("ds", ds)) + ((("dsf", ds * scale_t),) if ds_cudnn else ()):
                a = _absmax(t, dims).to(torch.float64)
                amax[name] = a if amax[name] is None else torch.maximum(amax[name], a)
            size = 2 * p.numel() * p.element_size()
            if size <= room:
                kept[s0], room = (p, ds), room - size
        whole = {"p": amax["p"], "dsq": amax["ds"], "dsk": amax["ds"], "dsf": amax["dsf"]}

    # bwd.dqcast=fp16: dQ's FP8 dS is rounded to FP16 before its cast (cuDNN's Hopper kernel); dK's is cast
    # directly. Other dS formats have no such step (the key then changes nothing)
    via_q = torch.float16 if recipe.bwd_dqcast == "fp16" and ds_fmt_q in ("e4m3", "e5m2") else None
    order = _query_order(recipe, n, bm, q.device)
    do_dv_o, q_dk_o = _take_rows(do_dv, order), _take_rows(q_dk, order)
    # bwd.dqscale=end (cuDNN's matmul_fp8 epilogue): dQ's descales multiply the float32 sum over KV tiles once;
    # only where dS and K are FP8 with one descale each (per-tensor), in float32 arithmetic
    dq_end = recipe.bwd_dqscale == "end" and wd == torch.float32 and isinstance(gran, PerTensor)
    dq_d, dq_mixed = None, False
    dq = torch.zeros((b, h, n, d), dtype=wd, device=q.device)
    dk = torch.zeros((b, h, nk, d), dtype=wd, device=q.device)
    dv = torch.zeros((b, h, nk, v.shape[-1]), dtype=wd, device=q.device)
    for s0, s1 in tiles:
        p, ds = kept.pop(s0) if s0 in kept else p_and_ds(s0, s1)
        # bwd.pexp=cudnn: the graph's scale_S, P times scale_s = float32(2^poff) for its cast
        p_op = _cast_tile(p, p_fmt, p_fixed if p_fixed is not None else _tile_descale(p, p_fmt, gran, bm,
                                                                                      whole.get("p")), wd,
                          scale=p_scale_s if cudnn_exp and p_fixed is not None else None)
        dv[:, :, s0:s1] = _mm(_take_rows(p_op, order), do_dv_o, acc, ta=True)
        if ds_cudnn:
            # attn_scale folded into dS before its cast (the graph's mul_dS_attn_scale)
            dsf = ds * scale_t
            dsq = _cast_by_scale(dsf, ds_fmt_q, whole["dsf"], wd, via_q)
            dsk = dsq if ds_fmt_k == ds_fmt_q and via_q is None else _cast_by_scale(dsf, ds_fmt_k, whole["dsf"], wd)
        else:
            dsq = _cast_tile(ds, ds_fmt_q, _tile_descale(ds, ds_fmt_q, gran, bm, whole.get("dsq")), wd, via_q)
            dsk = dsq if ds_fmt_k == ds_fmt_q and via_q is None else \
                _cast_tile(ds, ds_fmt_k, _tile_descale(ds, ds_fmt_k, gran, bm, whole.get("dsk")), wd)
        k_t = _rows(k_dq, s0, s1)
        if dq_end and dsq.raw is not None and dsq.d is not None and k_t.raw is not None:
            # bwd.dqscale=end: the raw products summed in float32 across KV tiles, descaled once below
            dq += _mm(_Operand(None, dsq.fmt, dsq.raw, None), _Operand(None, k_t.fmt, k_t.raw, None), acc)
            dq_d = dsq.d if k_t.d is None else dsq.d * k_t.d
        else:
            dq += _mm(dsq, k_t, acc)  # float32 across KV tiles (FA3's dQaccum)
            dq_mixed = True
        dk[:, :, s0:s1] = _mm(_take_rows(dsk, order), q_dk_o, acc, ta=True)
    if dq_d is not None:
        if dq_mixed:
            raise AssertionError("bwd.dqscale=end: some KV tiles were descaled per tile")
        dq = dq * dq_d.to(wd)  # one multiply by descale_dS descale_K (their float32 product)
    scale_w = torch.tensor(scale, dtype=wd)
    if not ds_cudnn:  # bwd.dsform=cudnn folded the softmax scale into dS
        dq, dk = dq * scale_w, dk * scale_w
    if recipe.bwd_gqa == "expand" and h != hkv:
        # every query head's gradient is written first; their sum is then rounded again below
        dk, dv = (_write(g, recipe.bwd_out, recipe.bwd_outscale).to(wd) for g in (dk, dv))
    dk = _group_sum(dk, hkv)
    dv = _group_sum(dv, hkv)
    dq, dk, dv = (_write(g, recipe.bwd_out, recipe.bwd_outscale) for g in (dq, dk, dv))
    if rot is not None:
        mt = rot.matrix().to(dq.device).transpose(0, 1)
        dq, dk, dv = (torch.matmul(g, mt) for g in (dq, dk, dv))
    return Gradients(dq, dk, dv, fwd)


__all__ = ["Forward", "Gradients", "backward_tiles", "run_forward", "emulate_backward", "backward_from"]
