"""The Triton FP8 attention kernel as toolkit backends (``--backend triton`` and variants).

Exposed: ``TritonBackend``, ``TritonTwoLevelBackend``, ``TritonFusedBackend``,
``kernel_inputs_from_prepared``, ``recipe_problem``, ``shape_problem``.

- ``triton``: Q, K, V rotated and quantized by the emulator's own ``prepare`` (the emulator and
  the kernel see the very same FP8 bytes and descales), then the Triton kernel. Its P.V
  accumulation follows the recipe: ``acc=two-level`` runs the two-level kernel, any other
  value the chained one (the MMA accumulator carried across tiles, as FA3 does).
- ``triton-two-level``: always the two-level kernel (so that validation grids, whose kernel
  recipes carry the default ``acc``, can check it).
- ``triton-fused``: the fused Triton rotate-and-quantize kernel (float32 fast path) in place of
  ``prepare``, then the chained kernel: what a deployment would run end to end.

The KV tile is the recipe's (``bn``; 0 = the FA3 kernel's tile for the head dim, which the
emulator uses too), so emulator and kernel visit the same tiles in the same order.
"""

from __future__ import annotations

import math

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken
from fa3_numerics.numerics.recipe import Recipe

from ._common import triton_problem
from .attention import kv_chunks

_FP8 = ("e4m3", "e5m2")
_OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def recipe_problem(recipe: Recipe, *, fused: bool = False) -> str | None:
    """Why the Triton kernel cannot compute ``recipe`` (None if it can), independent of shapes."""
    alt = "use --backend emulate"
    if recipe.algo != "flash":
        return f"algo={recipe.algo}: the Triton kernel computes tile by tile (algo=flash) only; {alt}"
    if recipe.qk not in _FP8 or recipe.v not in _FP8 or recipe.p not in _FP8:
        return (f"qk={recipe.qk}, v={recipe.v}, p={recipe.p}: this kernel is the FP8 forward (e4m3/e5m2 for Q, K, "
                f"V and P); for BF16 use --backend fa3 or sdpa-flash, else {alt}")
    if recipe.p != recipe.v:
        return f"p={recipe.p}, v={recipe.v}: P and V meet in one FP8 tensor-core dot and must share a format"
    if recipe.p_scale != "offset":
        return (f"pscale={recipe.p_scale}: a per-tensor P scale needs the amax of all of P before the P.V "
                f"product (a second pass over S); the kernel uses the fixed offset P~ = exp2(x - (max - poff)); {alt}")
    if recipe.out not in _OUT:
        return f"out={recipe.out}: the kernel writes bf16, fp16 or fp32"
    if not isinstance(recipe.gran, (PerTensor, PerHead, PerBlock, PerToken)):
        return (f"gran={recipe.gran.short_str()}: the kernel takes descales per tensor, per (batch, head) or per "
                f"block of tokens along the sequence; {alt}")
    if isinstance(recipe.gran, PerToken):
        return ("gran=token: a V descale per key cannot be applied to FP8 V inside the P.V product (it would have "
                f"to scale P before its FP8 cast, which is another recipe); Q/K per token with V per head is not "
                f"expressible as one recipe; {alt}")
    if recipe.bn and kv_chunks(recipe.bn) is None:
        return (f"bn={recipe.bn}: the KV tile must be a multiple of 32 made of at most three powers of two "
                f"(e.g. 128, 160, 192, 224)")
    if fused and recipe.rot not in ("none", "hadamard"):
        return f"rot={recipe.rot}: the fused quantizer applies the random Hadamard rotation only; use --backend triton"
    return None


def shape_problem(recipe: Recipe, head_dim: int, causal: bool) -> str | None:
    if head_dim not in (64, 128, 256):
        return f"head_dim {head_dim}: the Triton kernel takes 64, 128 or 256"
    bn = recipe.tiles(head_dim, causal)[1]
    if kv_chunks(bn) is None:
        return f"KV tile {bn} (head_dim {head_dim}) is not a multiple of 32 made of at most three powers of two"
    g = recipe.gran
    if isinstance(g, PerBlock) and g.rows and g.rows % bn:
        return (f"gran={g.short_str()}: V blocks of {g.rows} keys straddle KV tiles of {bn}; the kernel applies one "
                f"V descale per tile (use blocks that are multiples of {bn}, or bn={g.rows})")
    return None


def kernel_inputs_from_prepared(pre, recipe: Recipe, kv_heads: int) -> dict:
    """Kernel tensors from the emulator's ``Prepared`` (every query row): Q (b, h, n, d), K
    (b, hkv, n, d), V^T (b, hkv, d, n) in FP8, 3-d float32 descales and their rows per descale."""
    b, h, n, d = pre.q.values.shape
    g = h // kv_heads
    fq, fv = _TORCH_FP8[recipe.qk], _TORCH_FP8[recipe.v]
    q8 = pre.q.values.to(fq).contiguous()
    k8 = pre.k.values[:, ::g].to(fq).contiguous()
    vt8 = pre.v.values[:, ::g].to(fv).transpose(-1, -2).contiguous()

    def desc(t: torch.Tensor, heads_step: int, rows: int) -> tuple[torch.Tensor, int]:
        """[b, H, n or 1, 1] -> 3-d, compacted to one value per block of ``rows`` tokens where the
        descales are block-constant (checked), so the kernel loads one per tile instead of per row."""
        t = t[:, ::heads_step] if t.shape[1] > 1 else t
        t = t[..., 0].to(torch.float32)
        if t.shape[2] == 1:
            return t, 1 << 30
        if rows > 1:
            c = t[:, :, ::rows].contiguous()
            if torch.equal(c.repeat_interleave(rows, dim=2)[:, :, : t.shape[2]], t):
                return c, rows
        return t.contiguous(), 1

    g_rows = recipe.gran.rows if isinstance(recipe.gran, PerBlock) else 0
    is_block = isinstance(recipe.gran, PerBlock)
    qd, q_rows = desc(pre.q.descale, 1, (g_rows or pre.block_m) if is_block else 1)
    kd, k_rows = desc(pre.k.descale, g, (g_rows or pre.block_n) if is_block else 1)
    vd, v_rows = desc(pre.v.descale, g, (g_rows or pre.block_n) if is_block else 1)
    if vd.shape[2] > 1 and v_rows % pre.block_n:
        raise UsageError(f"V descales are not constant on KV tiles of {pre.block_n} keys; "
                         "the kernel applies one per tile")
    return dict(q=q8, k=k8, vt=vt8, qd=qd, kd=kd, vd=vd, q_rows=q_rows,
                k_rows=k_rows, v_rows=v_rows)


class TritonBackend(Backend):
    name = "triton"
    label = "triton"
    description = ("FP8 attention forward in Triton (kernels/triton_): per-block or per-head Q/K descales folded "
                   "into S, V per head or per KV tile, P offset, causal, GQA, d 64/128/256, the FA3 tiles")
    hardware = True
    #: None = from the recipe's acc (two-level -> two-level, else chained)
    pv: str | None = None
    fused = False

    def check(self, device: str) -> str | None:
        return triton_problem(device)

    def supports(self, recipe: Recipe) -> str | None:
        return recipe_problem(recipe, fused=self.fused)

    def pv_mode(self, recipe: Recipe) -> str:
        return self.pv or ("two-level" if recipe.acc == "two-level" else "chained")

    def _inputs(self, recipe, q, k, v, *, causal, rotation_seed, cache):
        from fa3_numerics.numerics.emulator import prepare

        every = torch.arange(q.shape[2], device=q.device)
        pre = prepare(recipe, q, k, v, q_index=every, rotation_seed=rotation_seed, causal=causal, cache=cache)
        return kernel_inputs_from_prepared(pre, recipe, k.shape[1])

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        from .attention import attention_fp8, plan_tiles

        why = self.supports(recipe) or shape_problem(recipe, q.shape[-1], causal)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on backend {self.name}: {why}")
        d = q.shape[-1]
        ins = self._inputs(recipe, q, k, v, causal=causal, rotation_seed=rotation_seed, cache=cache)
        o = attention_fp8(ins["q"], ins["k"], ins["vt"], ins["qd"], ins["kd"], ins["vd"], q_rows=ins["q_rows"],
                          k_rows=ins["k_rows"], v_rows=ins["v_rows"], causal=causal,
                          softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d),
                          p_fmt=recipe.p, p_offset=recipe.p_offset, pv=self.pv_mode(recipe),
                          reverse=recipe.order == "reverse", out_dtype=_OUT[recipe.out],
                          plan=plan_tiles(d, recipe.tiles(d, causal)[1]))
        if q_index.numel() != q.shape[2]:
            o = o.index_select(2, q_index.to(o.device))
        return o.to(torch.float64)


class TritonTwoLevelBackend(TritonBackend):
    name = "triton-two-level"
    label = "triton-two-level"
    description = "the Triton FP8 kernel with two-level P.V accumulation (each tile's MMA chain added in float32)"
    pv = "two-level"


class TritonFusedBackend(TritonBackend):
    name = "triton-fused"
    label = "triton-fused"
    description = ("the Triton FP8 kernel fed by the fused Triton rotate-and-quantize kernel (float32 fast path) "
                   "instead of the emulator's prepare")
    fused = True

    def _inputs(self, recipe, q, k, v, *, causal, rotation_seed, cache):
        from .rotate_quant import quantize_qkv

        h, hkv = q.shape[1], k.shape[1]
        qo, ko, vo = quantize_qkv(recipe, q, k, v, layout="bhsd", rotation_seed=rotation_seed, causal=causal,
                                  exact=False)

        def desc(o, heads):
            d = o.descale
            if o.gran == 1 and o.group > 1:
                d = d.repeat_interleave(o.group, dim=1)
            if d.shape[1] == 1 and heads > 1 and o.gran != 0:
                d = d.expand(d.shape[0], heads, d.shape[2])
            return d, (o.rows if o.gran >= 2 else 1 << 30)

        qd, q_rows = desc(qo, h)
        kd, k_rows = desc(ko, hkv)
        vd, v_rows = desc(vo, hkv)
        return dict(q=qo.values, k=ko.values, vt=vo.values, qd=qd, kd=kd, vd=vd, q_rows=q_rows, k_rows=k_rows,
                    v_rows=v_rows)
