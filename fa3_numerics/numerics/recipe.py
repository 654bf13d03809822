"""Recipes: one frozen spec object that drives every quantizer and the emulator.

Exposed: ``Recipe``, ``PRESETS``, ``TABLE3``, ``Preset``, ``get_recipe``, ``parse_recipes``.

A recipe is written as a preset name, a spec string, or a preset followed by overrides:

    fa3-fp8
    algo=flash,qk=e4m3,v=e4m3,p=e4m3,gran=block,rot=hadamard
    fa3-fp8,acc=fp22,bn=128

``short_str`` gives the canonical spec string (stored in datasets); ``from_str`` parses
it back, so a dataset's variant names always reproduce their numbers.

The keys themselves (names, defaults, parsing, help) are a registry,
``fa3_numerics.numerics.keys``: ``Recipe`` is a frozen dataclass built from it, so a new key is
one module there and this file does not change.
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from . import keys as _keys
from .families import family, is_narrow
from .formats import get_format
from .granularity import PerBlock, PerHead, PerTensor, parse_granularity
from .tiles import cudnn_tiles, fa3_tiles


class _RecipeMethods:
    """Methods of ``Recipe``; its fields come from the key registry (``fa3_numerics.numerics.keys``)."""

    def __post_init__(self):
        for k in _KEYS:
            object.__setattr__(self, k.field, k.check(getattr(self, k.field)))
        # Combinations no kernel computes (registered by the key modules), refused in one line.
        for check in _CHECKS:
            why = check(self)
            if why:
                raise UsageError(f"recipe {self.short_str()}: {why}")

    @property
    def fp8(self) -> bool:
        """Q and K in an FP8 float format (e4m3/e5m2): what the FA3 FP8 kernel and an FP8 KV cache take.
        Integer and microscaling Q/K are not FP8 in this sense (see ``narrow``)."""
        return family(self.qk) == "float" and get_format(self.qk).mbits <= 3

    @property
    def narrow(self) -> bool:
        """Q and K stored in one byte or less (FP8, INT8/INT4, MXFP8, NVFP4)."""
        return is_narrow(self.qk)

    def tiles(self, head_dim: int, causal: bool = False, *, local: bool = False,
              softcap: bool = False) -> tuple[int, int]:
        """(kBlockM, kBlockN) with zeros filled from the FA3 kernel's table (its 1-byte tiles for
        every narrow Q/K format, its 2-byte tiles otherwise); ``local``: a sliding window."""
        if self.loop == "fa2":
            from .fa2_loop import fa2_tiles

            m, n = fa2_tiles(head_dim)
        elif self.tile_table == "cudnn":
            m, n = cudnn_tiles(head_dim)
        else:
            m, n = fa3_tiles(head_dim, fp8=self.narrow, causal=causal, local=local, softcap=softcap)
        return (self.bm or m, self.bn or n)

    def get(self, key: str):
        """The value of recipe key ``key`` (as spelled in specs: ``poff``, not ``p_offset``)."""
        return getattr(self, _keys.key(key).field)

    def nondefault(self) -> list[tuple[_keys.RecipeKey, object]]:
        """(key, value) of every key that differs from its default, in key order."""
        return [(k, getattr(self, k.field)) for k in _KEYS if getattr(self, k.field) != k.default]

    def prepare_key(self, tensor: str) -> tuple:
        """Everything that decides the prepared (rotated, quantized) ``tensor`` ("q", "k", "v"):
        the values of the keys that declare it. A prepare cache keyed on this cannot hand one
        recipe another's tensors, whatever keys are added later."""
        return tuple((k.key, getattr(self, k.field)) for k in _KEYS if tensor in k.tensors)

    def cache_namespace(self) -> tuple:
        """Values of keys that change prepared tensors but that the emulator's own prepare cache
        does not key on (keys added after it): callers keep such recipes' caches apart."""
        return tuple((k.key, getattr(self, k.field)) for k in _KEYS
                     if k.tensors and not k.emulator_cache and getattr(self, k.field) != k.default)

    # -- strings -------------------------------------------------------------------------
    def short_str(self) -> str:
        """Canonical spec: every key that differs from its default, in key order."""
        return ",".join(f"{k.key}={_keys.fmt_value(v)}" for k, v in self.nondefault()) or "algo=flash"

    def spec(self) -> str:
        """Every original key, and newer keys where set: for provenance (stored in datasets)."""
        return ",".join(f"{k.key}={_keys.fmt_value(getattr(self, k.field))}" for k in _KEYS
                        if k.in_spec or getattr(self, k.field) != k.default)

    @classmethod
    def from_str(cls, text: str) -> "Recipe":
        text = text.strip()
        if not text:
            raise UsageError("empty recipe; give a preset name (see `fa3-numerics variants`) or key=value pairs")
        parts = [p.strip() for p in text.split(",") if p.strip()]
        base = Recipe()
        if "=" not in parts[0]:
            base = get_recipe(parts[0]).recipe
            parts = parts[1:]
        names = ", ".join(sorted(k.key for k in _KEYS))
        kw: dict = {}
        for part in parts:
            if "=" not in part:
                raise UsageError(f"recipe part {part!r} is not key=value; keys: {names}")
            name, value = (s.strip() for s in part.split("=", 1))
            k = next((k for k in _KEYS if k.key == name), None)
            if k is None:
                raise UsageError(f"unknown recipe key {name!r}; keys: {names}")
            if k.field in kw:
                raise UsageError(f"recipe key {name} is given twice in {text!r}; give each key once")
            kw[k.field] = k.from_text(value)
        return dataclasses.replace(base, **kw)


_KEYS = _keys.freeze()
_CHECKS = _keys.checks()
Recipe = dataclasses.make_dataclass(
    "Recipe", [(k.field, object, dataclasses.field(default=k.default)) for k in _KEYS],
    bases=(_RecipeMethods,), frozen=True)
Recipe.__module__ = __name__  # pickle (dask workers) finds it here
Recipe.__doc__ = ("A frozen attention recipe: one field per registered key (``fa3_numerics.numerics.keys``); "
                  "``fa3-numerics variants`` lists them.")


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    recipe: Recipe
    description: str
    paper_rmse: float | None = None  # FA3 paper, Table 3


# Standard attention in FP16 as PyTorch's math SDPA computes it in half precision.
_FP16_STD = Recipe(algo="standard", qk="fp16", v="fp16", p="fp16", s="fp16", softmax="fp16", out="fp16", sscale="split")
_FLASH16 = Recipe(algo="flash", qk="fp16", v="fp16", p="fp16", out="fp16", p_offset=0.0)
# The paper's FA3 FP8 recipes use power-of-two scales (shared exponents, as MX block formats
# do). With them, block quantization alone changes nothing but subnormals and saturation, which
# is the paper's finding (without incoherent processing FA3 FP8 is as bad as the baseline).
# With amax/448 scales each block's largest value becomes exact, and block quantization alone
# lowers the error on this data by ~15% (try `fa3-fp8-no-incoherent,pow2=0`).
_FA3_FP8 = Recipe(algo="flash", qk="e4m3", v="e4m3", p="e4m3", gran=PerBlock(), pow2=True, rot="hadamard", out="bf16")

# Recipes of the field beside FA3's. Each description cites what it follows, says
# what is not public and what was chosen, and which hardware runs it. Facts from the papers and
# from thu-ml/SageAttention (sageattention/core.py, csrc/qattn/, sageattention3_blackwell/).
_SAGE2 = Recipe(qk="int8", gran=parse_granularity("thread"), bm=64, bn=128, smooth="qk", p="e4m3", p_offset=8.807,
                v="e4m3", vgran="channel", acc="two-level", order="forward", out="bf16")
_FIELD = [
    Preset("fa1-fp16", Recipe(qk="fp16", v="fp16", p="fp16", p_offset=0.0, out="fp16", norm="tile", order="forward",
                              bm=128, bn=128),
           "FlashAttention (arXiv 2205.14135, Algorithm 1): O normalised after every KV tile (l e^(m-m_new) O + "
           "e^(m~-m_new) P~V) / l_new, tiles visited first to last, FP16 Q/K/V/P, float32 softmax. Chosen (Algorithm 1 "
           "leaves them open): 128x128 tiles, O float32 between tiles (flash-attn 1.x's o_tmp), exp2. "
           "Requires: sm75+ (FP16 tensor cores)"),
    Preset("sage1", Recipe(qk="int8", gran=PerBlock(), bm=128, bn=64, smooth="k", ties="away", p="fp16",
                           p_offset=0.0, v="fp16", acc="fp16-hopper", order="forward", out="fp16", inp="fp16",
                           iquant="triton", loop="triton", kpad="zero", sfu="h200"),
           "SageAttention 1 (arXiv 2410.02367; sageattention 1.0.6 sageattn, Triton) as the kernel computes it on an "
           "H200 (reports/h200/sage1/; validate --backend sage1, 2026-12-02 with sfu=h200: max F 0.0012 small grid, "
           "0.0001 stress, 0.0024 captured, 99.9-100% identical; 0.0022 / 0.0001 / 0.0027 with the exp2 stand-in; the "
           "first fit: 0.0064 small, 0.0039 captured, one MQA case 0.091). Findings, each with its evidence: (1) FP16/BF16 inputs (in=), K smoothed in them: "
           "mean rounded to FP16, k - mean rounded again (all 2,097,152 smoothed K values reproduced). (2) "
           "sm_scale*1.44269504 folded into Q in float32 before its INT8 quantization, so S is in log2 units "
           "(iquant=triton); scale = max|x|/127 and x/scale are Triton's div.full.f32 = x times the hardware "
           "reciprocal (1,108,522 of 2^23 mantissas one ulp off the rounded one, measured; x/y = x*rcp(y) on 4M "
           "pairs), code = trunc(x/scale + 0.5 sign) (cvt.rzi: ties away); Q per 128 rows, K per 64 keys: scales "
           "exact on every block, all but <64 of 2M codes. (3) Tiles of 128 queries x 64 keys, first to last, for head "
           "dims 64 (4 warps), 96 (padded to 128) and 128 (8 warps); causal stops at the diagonal 128-block (-1e6 "
           "mask). (4) The non-causal kernel never masks the keys past seqlen_k in the last tile: they score 0 "
           "(kpad=zero; masking them instead gives F 0.12 at seqlen 1000 and 0.71 at 333). (5) S = fp32(fp32(dot * "
           "q_scale) * k_scale), P~ = exp2(fma(t, k_scale, -max)) (fused by the compiler; plain subtraction on the "
           "causal diagonal), row sums per tile in the wgmma layout, l = fma(l, alpha, rowsum), O = fma(O, alpha, P V) "
           "(PTX: 64 mul, 98 fma, 34 ex2.approx.ftz per thread). (6) P~ to FP16; P V on wgmma m64nNk16.f16.f16.f16: "
           "per 16 keys the 16-bit MMA step (terms truncated at 2^(emax-25), sum to 23 bits) rounded to FP16, nearest "
           "even, inf past 65504 (acc=fp16-hopper; probes: 131,064 of 131,072 tile products exact; one float32 sum "
           "rounded once per tile: 67%), float32 across tiles. (7) O / l (div.full), written in the input dtype. Not "
           "modelled: the float32 reduction order of the kernel's K mean (one channel in 1024 rounds the other way). "
           "Validated on an H200 (reports/h200/sage1, 2026-12-02): max F 0.0022 small, 0.0001 stress, 0.0027 "
           "captured; the kernel must get the once-rounded FP16 inputs (torch's float64->FP16 cast rounds twice, "
           "and one ulp on 1e-4 of an MQA case's inputs gave F 0.09). Requires: sm80+ (INT8 mma); sageattn "
           "takes head dims 64, 96, 128"),
    Preset("sage2-int8", _SAGE2,
           "SageAttention2 (arXiv 2411.10958, sec. 3-4) on Hopper (qk_int_sv_f8_cuda_sm90.cu): INT8 Q/K per thread "
           "(Q 16-row warp slices of 64-query tiles, K 128-key tiles), Q and K smoothed (sec. 3.2; the public kernels "
           "smooth K only: add smooth=k for them), P~ = exp2(. - (max - 8.807)) in FP8 e4m3, V FP8 per channel, P V "
           "two-level (FP22 wgmma per tile into a zeroed buffer, float32 across), tiles first to last. The sm89 "
           "kernel uses 128x64 tiles (bm=128,bn=64). Both public kernels flush the FP8 accumulator into float32 "
           "after every K/V tile ('inst_buf': 4 k32 steps per 128 keys on sm90, cu:328-356; 2 per 64 keys on "
           "sm89, attn_utils.cuh:813-893). The public sm90 kernel as sageattn runs it, with its quantizer and "
           "loop: sage2-sm90. Requires: sm89/sm90 (FP8 mma)"),
    Preset("sage2-sm90", Recipe(qk="int8", gran=parse_granularity("thread"), bm=64, bn=128, smooth="k", ties="away",
                                iquant="triton-eps", p="e4m3", p_offset=8.807, v="e4m3", vgran="channel",
                                fquant="torchao", acc="two-level", loop="sage2", order="forward", inp="fp16",
                                out="fp16"),
           "SageAttention2's public Hopper kernel as sageattn runs it on sm90 (thu-ml/SageAttention 2.2.0, "
           "core.py:150-151 -> sageattn_qk_int8_pv_fp8_cuda_sm90(pv_accum_dtype='fp32+fp32'), kernel "
           "csrc/qattn/qk_int_sv_f8_cuda_sm90.cu, read with its PTX from nvcc 13.0 -arch=sm_90a --use_fast_math; "
           "numerics/sage2_loop.py). (1) FP16/BF16 in and out (in=, out=): K smoothed in the input dtype, "
           "km = k.mean(seq) then k - km, each rounded (core.py:949, quant_per_thread.py:159); Q not smoothed, "
           "no softmax scale folded into Q (smooth=k). (2) Q, K INT8 per thread from Triton "
           "(quant_per_thread.py:22-102, core.py:969 BLKQ=64 WARPQ=16 BLKK=128 WARPK=128): Q rows {r, r+8} of "
           "each 16-row warp slice share a scale, K keys with (k mod 8) // 2 = t of each 128-key tile; scale = "
           "max|x|/127 + 1e-7 (quant_per_thread.py:41, 89) rounded once, fma(max|x|, rcp(127), 1e-7): div.full's "
           "multiply fused with the add (read from the H200's outputs: rounding max|x|/127 before the add left 1 K "
           "code of stress causal-p0.02s100-tensor at 137.5/scale = 63.5, coded 64 where the kernel has 63, and sent "
           "rows 446 and 452 of head 3 to another key, head F 0.0744; fused: 0.0000, 99.99% identical; a third of "
           "the scales of the 8 dumped heads move one ulp), code = trunc(x/scale + 0.5 sign) (iquant=triton-eps; the "
           "kernel indexes the same groups, cu:179-193). (3) CTA 64 queries x 128 keys, "
           "first to last (cu:252-259); causal visits tiles up to ceil(min(N, 64(bx+1))/128) and masks only the "
           "last with -5e6 (cu:407-437), needs seqlen_q = seqlen_k; non-causal masks the keys past N_k. (4) S from "
           "wgmma s32.s8.s8, cvt.rz (cu:275, 303); c = fp32(fp32(sm_scale*log2e) * fp32(q_scale*k_scale)) "
           "(cu:153, 263-264); P~ = ex2.approx.ftz(fma(S, c, -m)) with m = max(m, fma(rowmax S, c, -8.807)): "
           "the offset log2(448) in the max, so P~ <= 447.9 (attn_utils.cuh:30, 354-458; poff=8.807); the last "
           "tile rounds S*q_scale*k_scale first and uses sm_scale*log2e alone (cu:369-402). (5) Row sum from "
           "float32 P~ before FP8 (cu:310-320): per thread ((p0+p1)+p8)+p9 per 16-key slab, d = fma(d, alpha, "
           "slab0) + slab1 + ... + slab7 (nvcc contracts d *= alpha, PTX), quad total (d0+d1)+(d2+d3) "
           "(attn_utils.cuh:731-740). (6) P~ to e4m3 by cvt.rn.satfinite (attn_utils.cuh:479-493, p=e4m3). (7) V "
           "zero-padded to a multiple of 128 keys (core.py:976-983), FP8 per channel over all tokens "
           "(per_channel_fp8, fused.cu:316-426): descale = amax/448, code = e4m3(v * (448/amax)), both divisions "
           "div.approx.ftz under --use_fast_math (vgran=channel, fquant=torchao: x times the measured "
           "reciprocal). (8) P V: wgmma m64nDk32 f32.e4m3.e4m3, 4 k-steps from a zero RO_temp per 128-key tile "
           "(the FP22 accumulation spans one tile), then O = fma(O, alpha, RO_temp) in float32 after every tile "
           "(cu:328-356; the 'inst_buf' flush is every iteration on sm90, not every few: acc=two-level). (9) "
           "O * rcp.approx(d) * v_scale, cvt.rn to FP16/BF16 (cu:490-549). Not modelled: ex2.approx and "
           "rcp.approx to the ulp (the emulator's FA3 models of the same instructions; visible where a P~ lands "
           "exactly on an E4M3 midpoint, ~1e-6 of P~, the rest of F in low-signal cases), the float32 reduction "
           "order of the K mean, and an all-zero V channel, which the kernel turns into NaN in that output "
           "channel (448/0 * 0; the emulator writes 0). Requires: sm90 (wgmma FP8/INT8); head dims <= 128 (64 "
           "and 128 native, others zero-padded: core.py:928-937)"),
    Preset("sage2-int4", dataclasses.replace(_SAGE2, qk="int4", bm=128, bn=64),
           "SageAttention2 with INT4 Q/K (arXiv 2411.10958, sec. 3; no public kernel): as sage2-int8 with the sm89 "
           "geometry (128x64 tiles, Q 32-row warp slices), the Hopper FP22 model assumed for Ada's FP8 MMA (the "
           "paper measured it on the RTX 4090). Requires: sm80/sm89 (INT4 mma.sync; Hopper's wgmma has no INT4)"),
    Preset("sage3-nvfp4", Recipe(qk="nvfp4", v="nvfp4", p="nvfp4", p_offset=11.3923, nvts="none", smooth="qk",
                                 sbias="bf16", acc="fp32", bm=128, bn=128, order="reverse", out="bf16"),
           "SageAttention3 (arXiv 2505.11594, sec. 3; sageattention3_blackwell/): NVFP4 Q/K/V (E2M1, E4M3 scale per "
           "16 along head_dim for Q/K and along keys for V, no tensor scale), Q (128-row blocks) and K smoothed with "
           "the bias q_mean K^T taken in BF16, two-level P (exp2 offset log2(2688), then E4M3 scales per 16 keys, "
           "elements divided by the unrounded scale), float32 accumulation, 128x128 tiles last to first (its "
           "mainloop, as FA3). Not modelled: the block scale of P from ex2 of the block's max score. "
           "Requires: sm100/sm120 (Blackwell FP4 block-scaled MMA); public kernel: head dims 64 and 128"),
    Preset("fa3-mxfp8", Recipe(qk="mxfp8", v="mxfp8", p="e4m3", p_offset=8.0, mxscale="ceil", acc="fp32", bm=128,
                               bn=128),
           "what-if, no public kernel: FA3's FP8 pipeline with OCP MXFP8 Q/K/V (e4m3 with an E8M0 scale per 32 "
           "elements along head_dim / keys, NVIDIA's ceil rounding), P e4m3 with the offset 2^8 (unit scales), "
           "float32 accumulation, 128x128 tiles last to first. Requires: sm100 (block-scaled MMA)"),
]

# Backward presets: a forward and the backward that reads its O and LSE, from public facts;
# each description says what is inferred. Forwards take acc=fp32 for CPU speed (add acc=fp22,bwd.acc=fp22
# for the Hopper MMA model in both passes).
_BF16_BWD = dict(bwd_s="bf16", bwd_dv="bf16", bwd_dp="bf16", bwd_ds="bf16", bwd_dq="bf16", bwd_dk="bf16",
                 bwd_out="bf16")
# cuDNN's sdpa_fp8_backward: every tensor FP8 with one descale per tensor; E4M3 for the forward's tensors
# and E5M2 for gradients is TransformerEngine's default HYBRID format.
_FP8_BWD = dict(bwd_s="e4m3", bwd_dv="e4m3:e5m2", bwd_dp="e5m2:e4m3", bwd_ds="e5m2:e4m3", bwd_dq="e5m2:e4m3",
                bwd_dk="e5m2:e4m3", bwd_out="e5m2", bwd_gran=PerTensor())
_CUDNN_FWD = Recipe(qk="e4m3", v="e4m3", p="e4m3", gran=PerTensor(), p_offset=8.80735, acc="fp32", out="bf16")
_BACKWARD = [
    Preset("fa3-fp8-bwd-bf16", Recipe(gran=PerHead(), rot="none", acc="fp32", **_BF16_BWD),
           "what FA3 users train with: FA3 has no FP8 backward (Dao-AILab/flash-attention #1069, #1420, #1490), so "
           "the public FP8 forward (fa3-fp8-kernel at acc=fp32: per-head descales, BF16 O) hands its O and LSE to "
           "FA3's BF16 backward (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp): Q, K, V and dO in BF16 as the caller "
           "holds them, P recomputed from the FP8 forward's LSE, P and dS cast to BF16, float32 accumulation, dQ "
           "summed in float32 across KV tiles, dQ/dK/dV written in BF16; tiles 80x128 (64x128 causal) at head dim "
           "128 (hopper/flash_bwd_launch_template.h). Requires: sm90"),
    Preset("fa3-bf16-bwd-bf16", dataclasses.replace(_FLASH16, qk="bf16", v="bf16", p="bf16", out="bf16",
                                                    **_BF16_BWD),
           "the BF16 training baseline: FA3's BF16 forward and BF16 backward (as fa3-fp8-bwd-bf16, with a BF16 "
           "forward). Requires: sm90"),
    Preset("sdpa-flash-bf16", dataclasses.replace(_FLASH16, qk="bf16", v="bf16", p="bf16", out="bf16", loop="fa2",
                                                  fa2math="torch", acc="fp22", **_BF16_BWD, bwd_acc="fp22",
                                                  bwd_order="reverse", bwd_gqa="expand", sfu="h200"),
           "PyTorch SDPA's flash kernel in BF16, forward and backward (FlashAttention-2 inside torch, "
           "aten/src/ATen/native/transformers/cuda/flash_attn/, mma.sync on Hopper), fitted to its outputs on an H200 "
           "(tools/device/dump_field.py, tools/fit_field.py; reports/h200/backward/): forward loop=fa2 (FA2's sm90 "
           "tiles 128x64 at head dim 128 and 128x128 at 64, KV tiles last to first, FA2's split-KV heuristic with the "
           "split kernel's tiles and float32 combine: batch 1, 4 heads, seqlen 512 splits 4 and 2 ways) and the "
           "16-bit tensor-core model (acc=fp22); O identical on 99.9-100.0% (F 0.011-0.05 against 0.54-0.81 with "
           "FA3's loop). Backward from the saved O and LSE: FA2's tiles (64x128 at 128, 128x128 at 64), P and dS cast "
           "to BF16, D = rowsum(dO O) in FA2's preprocess order, dK and dV chained over query tiles last to first "
           "(bwd.order=reverse) on the 16-bit MMA model (bwd.acc=fp22), dQ per KV tile added in float32 (the "
           "kernel's own atomicAdd order changes 1-7 of 65,536-131,072 dQ values between runs), grouped-query dK and "
           "dV written per query head in BF16 and summed (bwd.gqa=expand: torch's repeat_interleave and "
           "enable_gqa=True give the same bytes; summing in float32 first misses 40% of them, F 0.80-0.95). "
           "The softmax arithmetic is torch's build (fa2math=torch): P~ = exp2f(__fmul_rn(S, scale log2 e) - m scale "
           "log2 e) (UNFUSE_FMA: a multiply, then a subtract), exp2f rounded toward zero, LSE = fma(m, scale, "
           "__logf(l)) with lg2 rounded toward zero, the combine's butterfly sum over splits. "
           "Measured on 5 dumped cases (2 held out): end to end O F 0.005-0.015, dQ 0.001-0.016, dK 0.002-0.029, "
           "dV 0.006-0.016 (99.8-99.99% identical; F 0.008-0.035 with fa2math=fa3, 0.34-0.95 before the fit); the "
           "backward from the kernel's O and LSE F 0.000-0.008 (99.96-100%). What remains is the LSE: 86-90% of its "
           "values identical (the hardware's ex2 and lg2 are not bit-reproduced), and one differing P moves a "
           "row's dK/dV; dQ's atomicAdd order is not modelled. fa2math=torch is kept in both passes although on the "
           "H200 hold-out at n 768 causal it gave dQ F 0.051 and dK 0.069 (0.011 / 0.021 with fa2math=fa3): 99% of "
           "that is one row, whose LSE is an ulp below the kernel's and whose dS at its dominant key (P 0.23) flips a "
           "BF16 ulp (without that row 0.009 / 0.009; 12% of LSE rows an ulp off at random gives dQ/dK F 0.004-0.02 "
           "with everything else the kernel's); over 7 dumped cases torch in both passes misses the fewest values "
           "of every gradient (dQ 1235, dK 2046, dV 691 against 2767, 5079, 1797 with fa3; fa2math=torch in one "
           "pass only is in between) and has the lower F in 24 of 28 case-outputs "
           "(tools/fit_field.py DUMPS sdpa --table --fa2math). Since 2026-12-02 the preset takes sfu=h200, the H200's "
           "ex2/lg2.approx bit for bit (numerics/sfu.py, measured by tools/device/mufu_probe.py): that row's LSE "
           "is now the kernel's (the n 768 dump end to end: O/dQ/dK/dV F 0.0007/0.0003/0.0011/0.0031, LSE 97.8% "
           "identical), and on five unseen H200 cases end to end F <= 0.0076 on the three MHA cases, while the two "
           "GQA cases missed (O 0.0149, dK 0.0148-0.0176: reports/h200/backward/README.md). Two more fits close "
           "them: the split-KV combine calls libdevice's accurate expf/logf (torch builds FA2 without fast-math; "
           "numerics/libdevice.py, bit for bit from libdevice.10.bc, its ex2 the H200's), and nvcc contracts the "
           "rescaled row sum with the tile's first P~ into one FFMA (fa2_loop._rescaled_row_sum). Re-dumped on the "
           "H200 (tools/device/dump_field.py --parts sdpa-gqa; tools/fit_field.py DUMPS sdpa-gqa), end to end: "
           "GQA 8/2 n 1024 d 128 seed 2 (2 splits of 4 KV tiles) O/dQ/dK/dV F 0/0.0024/0/0 (was "
           "0.0149/0.0061/0.0148/0.0063), values differing 0/57/0/0 of 1,048,576/1,048,576/262,144/262,144 (was "
           "46/411/128/53), LSE 100% identical (96.0%); causal GQA 8/2 n 1536 d 64 seed 5 (6 splits of one tile) "
           "F 0/0.0005/0/0 (was 0.0035/0.0010/0.0176/0.0027), differing 0/35/0/0 (23/116/34/23), LSE 100% (97.1%); "
           "the n 768 fixture F 0/0.0001/0/0, LSE 100% (97.8%). What is left is dQ: the kernel's own atomicAdd "
           "order changes 44-59 dQ values between two identical calls and is not modelled. Requires: sm80+"),
    Preset("cudnn-fp8", dataclasses.replace(_CUDNN_FWD, **_FP8_BWD),
           "cuDNN's FP8 attention, forward and backward, as TransformerEngine runs it (TE #768, NVTE_FP8_DPA_BWD=1; "
           "cudnn-frontend sdpa_fp8 / sdpa_fp8_backward, docs/operations/Attention.md): Q, K, V, O, dO, S (= P) and "
           "dP (= our dS) FP8 with one descale per tensor ((1,1,1,1) in cuDNN's tables), S = Q K^T E4M3 x E4M3, "
           "dV = P^T dO E4M3 x E5M2, dP = dO V^T, dQ = dS K, dK = dS^T Q E5M2 x E4M3, D from FP8 dO and O, "
           "dQ/dK/dV written in E5M2 per tensor. Inferred: which of E4M3/E5M2 each tensor takes (cuDNN accepts "
           "either; TE's default HYBRID format: E4M3 forward, E5M2 gradients), scales from this call's amax "
           "(TE's delayed scaling uses earlier steps'), P in the forward as P~ filling E4M3 (poff=log2 448), the "
           "forward's O in BF16 (the backward reads it as per-tensor E4M3), FA3's tiles standing in for cuDNN's "
           "unpublished ones; float32 accumulation for CPU speed. The kernel as measured on an H200 is "
           "cudnn-fp8-kernel (FP8 O, Hopper MMA model, P at the forward's fixed scale, dQ's dS through FP16). "
           "Requires: sm90 (cuDNN 9)"),
    Preset("sagebwd", dataclasses.replace(Recipe(
               qk="int8", gran=PerBlock(), bm=128, bn=64, smooth="k", ties="away", p="fp16", p_offset=0.0, v="fp16",
               acc="fp32", order="forward", out="bf16"),
               bwd_s="int8", bwd_dv="int8", bwd_dp="fp16", bwd_ds="fp16", bwd_dq="int8", bwd_dk="int8",
               bwd_out="bf16", bwd_gran=PerBlock()),
           "SageBwd (SageAttention3, arXiv 2505.11594; arXiv 2603.02170): INT8 attention for training, six of the "
           "seven matmuls INT8 and dP = dO V^T kept in FP16 (the paper: dS is where the quantization error "
           "arises). Backward: S = Q K^T, dV = P^T dO, dQ = dS K, dK = dS^T Q INT8 with one scale per block of "
           "the backward's tiles, dP FP16, D from FP16 dO and O, BF16 gradients. Inferred or not modelled: the "
           "forward's P V in INT8 (the emulator's P and V take no integer format: sage1's FP16 P and V at float32 "
           "accumulation stand in), K smoothing in the backward (the forward smooths K), per-block granularity of P, "
           "dO and dS. "
           "Requires: sm80+ (INT8 mma)"),
    Preset("fp8-bwd-block", dataclasses.replace(_CUDNN_FWD, **{**_FP8_BWD, "bwd_gran": PerBlock(), "bwd_out": "bf16"}),
           "what-if, no public kernel: cuDNN's FP8 formats with one scale per block of the backward's tiles (Q, "
           "dO, O per bm rows, K, V per bn keys, P and dS per bm x bn tile) and BF16 gradients"),
    Preset("fp8-bwd-hadamard", dataclasses.replace(_CUDNN_FWD, **{**_FP8_BWD, "bwd_rot": "hadamard",
                                                                  "bwd_out": "bf16"}),
           "what-if, no public kernel: cuDNN's per-tensor FP8 backward after a random Hadamard along head_dim on "
           "Q, K, V and dO (every head_dim contraction keeps its value; the casts see spread-out channels), "
           "gradients rotated back in float64, BF16 gradients"),
]
BACKWARD_PRESETS = tuple(p.name for p in _BACKWARD)

# Forward recipes of the public FP8 kernels beside FA3's own (``validate --backend cudnn-fp8`` and
# ``--backend torchao-fp8`` check them against the kernels).
# cuDNN's Hopper FP8 forward as fitted (cudnn-fp8-fwd); cudnn-fp8-kernel's forward is this one, so that a
# refit of the forward reaches both
_CUDNN_HOPPER_FWD = dataclasses.replace(_CUDNN_FWD, acc="fp22", out="e4m3", oscale="amax", tile_table="cudnn",
                                        order="forward", smath="cudnn")
_KERNEL_FWD = [
    Preset("cudnn-fp8-fwd", _CUDNN_HOPPER_FWD,
           "cuDNN's FP8 SDPA forward as it runs on Hopper (cudnn-frontend 1.32 graph.sdpa_fp8, cuDNN 9.19; "
           "TransformerEngine's FP8 DotProductAttention), fitted to the kernel's bytes on an H200 "
           "(tools/device/dump_field.py, tools/fit_field.py; reports/h200/field/): Q, K, V E4M3 with one descale per "
           "tensor (descale_q/k/v, TE's scale = 448 / amax); S = Q K^T on the FP8 tensor core with the Hopper MMA "
           "model (acc=fp22: the seqlen_k = 1 probe's stats equal it to 4.7e-7 relative, float32 products miss by "
           "1.2e-4); online softmax over KV tiles visited first to last (order=forward) of 256 keys up to head dim 128 and "
           "128 keys at 256 (tiles=cudnn; at d 256 a 256-key tile leaves 16% of codes different, 128 none); P~ = "
           "exp(S - running max) in [0, 1] times scale_s cast to E4M3 (scale_s = 2^poff = 448: P~ fills E4M3; the "
           "graph's normalised P is only what Amax_S reports: 0.1306 = max 1/l on Gaussian data, 1/512 on the Q = 0 "
           "probe, while quantizing the normalised P matches 22-24% of O's float32 brackets); P V on the FP8 MMA "
           "chained across tiles (acc=fp22; a fresh accumulator per tile misses 1,479-2,657 codes per case); O = "
           "acc descale_s descale_v / l written in E4M3 times scale_o, scale_o = 448 / Amax_O (oscale=amax). On 5 "
           "cases (n 256-1024, d 64 and 128, causal and not, Gaussian and the paper's outliers) 99.99% of O's E4M3 "
           "codes equal the kernel's at its scale_o (0 of 65,536-262,144 differ on three cases; 49 and 51 on two, "
           "whole rows a tie apart, as FA3's ex2.approx leaves them); on 3 more (d 256, causal n 2048, sigma 3) 2, 47 "
           "and 1 of 262,144-524,288 (the 47 in 17 rows whose P is one key: O on an exact E4M3 tie). The softmax "
           "arithmetic is cuDNN's own (smath=cudnn, keys/smath.py, fitted on the H200's one-key tie probes: S scaled "
           "first, offset lg2.approx(scale_s), P~ = ex2.approx(S' - (m' - L)) in two subtractions, O = acc "
           "rcp.approx(l) (descale_v scale_o) with scale_o folded into the row's factor): on 6 probe runs (n 256-1024, "
           "attn_scale ln 2 and 1/sqrt(128), 16 scale_o on and beside ties) 5,326 of 9.4M codes differ against 280,916 "
           "with FA3's arithmetic, all in rows whose other keys' P~ sum to l's last bits (margins 26-32 log2 units). "
           "S is scaled into log2 units by fl(fl(fl(attn_scale descale_q) descale_k) log2e) (float32, left to right; "
           "FA3's fl(attn_scale log2e) fl(descale_q descale_k) is one ulp above it on validate's causal n 2048 case, "
           "the kernel's bytes dumped by tools/device/dump_cudnn_case.py: 26 of 2,097,152 O codes differ with it, 1 "
           "with this order; per-head F against the float64 reference of the dequantized inputs 0.0000-0.1125 -> "
           "0.0000-0.0004; tests/numerics/test_cudnn_causal_case.py). "
           "Not modelled: the row sum's last bit in those rows, head dims 96 and 192's tiles (not measured: their "
           "neighbours'). "
           "Requires: sm90, cuDNN 9"),
    Preset("cudnn-fp8-kernel", dataclasses.replace(_CUDNN_HOPPER_FWD, **{**_FP8_BWD, "bwd_acc": "fp22",
                                                                         "bwd_pscale": "offset",
                                                                         "bwd_dqcast": "fp16", "bwd_pexp": "cudnn",
                                                                         "bwd_outscale": "scale",
                                                                         "bwd_dsform": "cudnn-ffma",
                                                                         "bwd_dqscale": "end"}),
           "cuDNN's FP8 attention forward and backward as they run on Hopper (cudnn-frontend 1.32 sdpa_fp8 training "
           "forward + sdpa_fp8_backward, cuDNN 9.19 on an H200: reports/h200/backward/cudnn.md; --backend cudnn-fp8 "
           "runs it). The forward is cudnn-fp8-fwd's recipe (E4M3 O scaled from Amax_O: Hopper writes FP8 O only; KV "
           "tiles from cuDNN's measured table, tiles=cudnn; O's codes the kernel's but for tie rows, "
           "reports/h200/field/). The "
           "backward, fitted on the kernel's bytes with its own O and Stats: Q, K, V, O, P E4M3 and dO, dS (cuDNN's "
           "dP) and dQ, dK, dV in the dO format (E5M2, TransformerEngine's HYBRID; E4M3 fits the kernel equally: "
           "sdpa_fp8_backward takes either), one scale per tensor; dS = P (dP - D) with D = rowsum(dO O) from the FP8 "
           "dO and O, scaled by scale_dP = max / Amax_dP (Amax_dP is taken over dS with the softmax scale folded "
           "in, the cuDNN frontend's sm107 notes: 'dS in TRUE units, attn_scale folded'), P cast with the forward's "
           "fixed scale_s = 2^poff, not its amax (bwd.pscale=offset: with P's amax, F of dV 0.72-0.76 on the "
           "k-bias case whose largest P is 0.10, all of it explained: the emulator with either scale differs by the kernel's own discrepancy, 0.00258 RMSE; on the saved cases dV codes 100% equal), every product on Hopper's FP8 "
           "wgmma model (bwd.acc=fp22: dK and dV codes 99.8-100% equal to the kernel's, against 51-94% with "
           "float32 accumulation), and dS for dQ rounded to FP16 before its FP8 cast while dK's dS is cast directly "
           "(bwd.dqcast=fp16, fitted offline on the saved cases' bytes: dQ's FP8 codes from 91.5-96.3% to "
           "99.97-100.00% equal to the kernel's, F of dQ from 0.065-0.112 to 0.0007-0.0025, dK and dV unchanged; "
           "the dS codes the kernel rounds otherwise lie within FP16's half-ulp of an FP8 rounding boundary, "
           "tools/explain_cudnn_dq.py). Confirmed on the H200 on a re-run with this preset (7 cases x 2 arms, "
           "reports/h200/backward/cudnn.md), from the kernel's own O and Stats: dQ F 0.0000-0.0109, dK "
           "0.0001-0.0169, dV 0.0000-0.0245; above the 0.01 bar: the non-causal k-bias case (dQ 0.0109, dK "
           "0.0105 / 0.0169, dV 0.0189 / 0.0140 in the E4M3 / E5M2 arms) and outliers n 2048's E5M2 dV (0.0245). On "
           "the saved cases the few dK and dV codes that differ (3-67 of 262,144) sit in a few key rows; each of "
           "the 13 rows with 5 or more (74% of them) is explained by one P (dV) or dS (dK) code whose float32 "
           "value lies within 1.2e-5 of a code step of an FP8 rounding boundary (tools/explain_cudnn_dkdv.py): "
           "float32-level differences in P and dS at the casts' ties. P's are modelled since (bwd.pexp=cudnn: x = "
           "FFMA(S', (scale descale_Q) descale_K, -LSE) on the raw S', then __expf = ex2.approx.ftz(x log2e), the "
           "H200's MUFU.EX2 bit for bit, P cast as P times float32(2^poff)), with the outputs cast as the float32 "
           "product with scale = max / amax (bwd.outscale=scale): on 12 saved case-arms (6 cases, among them "
           "every case-arm that missed on the device) from the kernel's O and Stats, dV's codes all equal the "
           "kernel's, F of dQ 0.0000-0.0069 and dK 0.0000-0.0048, each at or below the exp2 form's. dS as cuDNN's graph forms it with its '- D' fused (bwd.dsform=cudnn-ffma: "
           "D = rowsum of the FP8 codes' products times descale_dO then descale_O, dS = FFMA(dP', descale_dO "
           "descale_V, -D) P attn_scale on the MMA's raw dP', cast as its float32 product with scale_dP = max / "
           "amax) gives the kernel's Amax_dP to the float32 bit on all 12 saved case-arms and takes dK to 0 codes off "
           "on all 12, dQ to 0-4 (from 0-45); dQ's raw products summed over KV tiles in float32 and descaled once "
           "(bwd.dqscale=end, cuDNN's matmul_fp8 epilogue) leave 1 dQ code of the 12 arms. With the emulator's own forward "
           "(validate --backward end to end on the H200, 2026-12-03, 15 cases of the small and stress grids at head dim 128: "
           "F of O <= 0.0026, dQ <= 0.0094, dV <= 0.0041, dK <= 0.0080 but 0.0102 on outliers sigma 3, whose forward "
           "differs from the kernel's in a few O codes and 1-ulp LSEs; kernel-fwd <= 0.0003 everywhere). Not validated: "
           "seqlens not a multiple of 128, where cuDNN 9.19 zeroes dQ column groups of the last rows (a kernel defect, "
           "skipped by validate, warned by the backend). Requires: sm90 with head dim 128 only (cuDNN "
           "9.19 declines 64: 'hidden_dim shoud be equal to 128'), FP8 gradients (BF16 ones need Blackwell and "
           "cuDNN >= 9.13)"),
    Preset("torchao-fp8", Recipe(gran=PerHead(), rot="none", acc="fp22", inp="bf16", fquant="torchao", splitkv="fa3"),
           "torchao 0.18's low-precision attention (apply_low_precision_attention, backend FP8_FA3, hadamard NONE; "
           "fp8_fa3_sdpa): the model's BF16 Q, K, V quantized by torchao's Triton kernels "
           "(prototype/attention/quantization/triton_qkv_quantization.py: amax per (batch, head), Q's per KV-head "
           "group, scale = 448 / amax and descale = amax / 448 in float32, 1 where amax <= 1e-12, q8 = e4m3(x * "
           "scale), saturating), then torch's _scaled_dot_product_attention_quantized on FA3 (per-(batch, kv-head) "
           "descales, BF16 O, cast to the input dtype). Its arithmetic is the public FA3 FP8 kernel's "
           "(fa3-fp8-kernel) on BF16-rounded inputs (in=bf16), with torchao's quantizer arithmetic (fquant=torchao: "
           "x times float32(448 / amax) with Triton's division; dividing by float32(amax / 448) instead changes "
           "0.15-0.56% of the codes on random BF16 inputs, which land on E4M3 ties, and most descales by an ulp), "
           "and FA3's split-KV as torch calls it with num_splits=0 (splitkv=fa3). Fitted on the H200 "
           "(tools/device/dump_field.py, tools/fit_field.py; reports/h200/field/): torchao's bytes equal the "
           "emulator's (0 of 1,024,000-1,048,576 codes, every descale); the kernel on them differs between "
           "num_splits=0 and 1 at seqlen 1000 and at head dim 64 (8 heads, batch 1), and with splitkv=fa3 the "
           "emulator reproduces 100.0% of the BF16 outputs there (F 0.0002; 0.0692 and 0.0504 without). Not "
           "modelled: HadamardMode.QKV (V rotated too, O rotated back). Requires: sm90, torch >= 2.11, FA3 "
           "(flash_attn_3 ops)"),
]

# Serving engines' FP8 attention with an FP8 KV cache: the FA3 kernel's arithmetic (Hopper MMA
# model) with the q/k/v scales each engine fixes before it serves text (``numerics/calibration.py``).
# ``dscale=static``/``calc`` read a calibration that ``fa3-numerics recommend`` fits on --calib-text.
_ENGINE = Recipe(gran=PerTensor(), rot="none", acc="fp22")
_VLLM_DOCS = ("vllm-project/vllm docs/features/quantization/quantized_kvcache.md: with the FA3 backend and an FP8 KV "
              "cache Q is quantized to FP8 too; scales per tensor (q/k/v_scale [1]) or per attention head (q_scale "
              "[num_heads], k/v_scale [num_kv_heads], FlashAttention backend, from llm-compressor)")
_SERVING = [
    Preset("vllm-fp8", dataclasses.replace(_ENGINE, dscale="unit"),
           "vLLM --kv-cache-dtype fp8 without checkpoint scales: q/k/v scales 1.0 (the default: vllm-project/vllm "
           "vllm/attention/layer.py, set_default_quant_scales when no quant weights load; Q quantized per tensor "
           "with _q_scale before the FA3 call; issues #5493, #12076). " + _VLLM_DOCS),
    Preset("vllm-fp8-calc", dataclasses.replace(_ENGINE, dscale="calc"),
           "vLLM --calculate-kv-scales: the first batch's amax / Q_SCALE_CONSTANT 200, K_SCALE_CONSTANT 200, "
           "V_SCALE_CONSTANT 100, per tensor, then fixed (vllm-project/vllm vllm/envs.py; calc_kv_scales in "
           "vllm/attention/layer.py); here the first batch is the calibration text"),
    Preset("vllm-fp8-static", dataclasses.replace(_ENGINE, dscale="static"),
           "vLLM with calibrated per-tensor q/k/v scales from the checkpoint (llm-compressor: calibration amax / "
           "448). " + _VLLM_DOCS),
    Preset("vllm-fp8-static-head", dataclasses.replace(_ENGINE, gran=PerHead(), dscale="static"),
           "vLLM with calibrated per-head scales (llm-compressor; q per query head is modelled per kv-head group, "
           "the FA3 kernel's q_descale shape (batch, kv_heads)). " + _VLLM_DOCS),
    Preset("sglang-fp8", dataclasses.replace(_ENGINE, dscale="unit"),
           "SGLang --kv-cache-dtype fp8_e4m3 without scales in the checkpoint: k/v scales fall back to 1.0 "
           "(sgl-project/sglang issue #6518); attention on the FA3 backend modelled as vLLM's"),
    Preset("sglang-fp8-static", dataclasses.replace(_ENGINE, dscale="static"),
           "SGLang with per-tensor k/v scales from the checkpoint (calibration amax / 448)"),
    Preset("trtllm-fp8", dataclasses.replace(_ENGINE, dscale="static"),
           "TensorRT-LLM FP8 attention and KV cache with NVIDIA ModelOpt's calibrated per-tensor scales "
           "(calibration amax / 448; Qwen2.5 failures: NVIDIA/TensorRT-LLM #4218); its own kernels modelled "
           "with the FA3 kernel's arithmetic"),
]

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("baseline-fp16", _FP16_STD,
           "standard attention in FP16 (as PyTorch's math SDPA): S = QK^T and P = softmax(S) materialised in FP16", 3.2e-4),
    Preset("fa2-fp16", dataclasses.replace(_FLASH16, bm=128, bn=64),
           "FlashAttention-2 FP16: 128x64 tiles, online softmax in FP32, P cast to FP16, FP32 accumulator", 1.9e-4),
    Preset("fa3-fp16", _FLASH16,
           "FlashAttention-3 FP16: the kernel's tiles, online softmax in FP32, P cast to FP16", 1.9e-4),
    Preset("baseline-fp8", Recipe(algo="standard", qk="e4m3", v="e4m3", p="e4m3", gran=PerTensor(), s="fp32",
                                  softmax="fp16", p_scale="tensor", out="fp16"),
           "per-tensor FP8 Q/K/V, FP32 accumulators, softmax kept in FP16, P cast to FP8 with a per-tensor scale", 2.4e-2),
    Preset("fa3-fp8", _FA3_FP8,
           "FA3 FP8: block quantization (power-of-two scales) at the kernel's tiles + random Hadamard on Q and K, P offset 2^8", 9.1e-3),
    Preset("fa3-fp8-no-block-quant", dataclasses.replace(_FA3_FP8, gran=PerTensor()),
           "FA3 FP8 with one scale per tensor instead of per block (rotation kept)", 9.3e-3),
    Preset("fa3-fp8-no-incoherent", dataclasses.replace(_FA3_FP8, rot="none"),
           "FA3 FP8 with block quantization but no Hadamard rotation", 2.4e-2),
    # The two presets below model the public FA3 FP8 kernel itself, so they use the Hopper MMA
    # model (acc=fp22) that makes 99.99% of its BF16 outputs bit-identical (reports/h200/). It
    # costs ~40-100x a float32 GEMM on a CPU: add acc=fp32 for speed. Against float64 the two
    # differ by ~3% of the error in quadrature, i.e. ~0.05% of the RMSE, which is why the
    # Table 3 presets keep fp32.
    Preset("fa3-fp8-kernel", Recipe(gran=PerHead(), rot="none", acc="fp22"),
           "what the public FA3 FP8 kernel computes: one descale per (batch, kv-head), no rotation, Hopper MMA model"),
    Preset("fa3-fp8-kernel-hadamard", Recipe(gran=PerHead(), rot="hadamard", acc="fp22"),
           "the public FA3 FP8 kernel with per-head descales after a random Hadamard on Q and K, Hopper MMA model"),
    Preset("fa3-bf16", Recipe(qk="bf16", v="bf16", p="bf16", out="bf16", p_offset=0.0),
           "FlashAttention-3 BF16: the kernel's tiles, online softmax in FP32, P cast to BF16 (a layer an engine "
           "keeps out of its FP8 KV cache)"),
    Preset("exact", Recipe(qk="fp32", v="fp32", p="fp32", out="fp32", p_offset=0.0),
           "tile-by-tile FP32 attention without quantization: checks the emulator itself"),
    *_FIELD,
    *_BACKWARD,
    *_KERNEL_FWD,
    *_SERVING,
]}



def __getattr__(name: str):
    # ``TABLE3``: the paper's rows as experiments/outliers.toml lists them (the one definition);
    # read from the TOML when first asked for, so the numerics never import a study.
    if name == "TABLE3":
        import importlib.resources
        import tomllib

        text = importlib.resources.files("fa3_numerics.experiments").joinpath("outliers.toml").read_text()
        return tuple(tomllib.loads(text)["variants"])
    raise AttributeError(name)


def get_recipe(name: str) -> Preset:
    if name in PRESETS:
        return PRESETS[name]
    raise UsageError(f"unknown variant {name!r}; presets: {', '.join(PRESETS)} (or a key=value spec)")


def parse_recipes(text: str) -> list[tuple[str, Recipe]]:
    """``a;b;c`` or preset names separated by commas -> [(label, recipe)].

    Preset names may be separated by commas; spec strings (which contain commas) are
    separated by semicolons.
    """
    items: list[str] = []
    chunks = [c.strip() for c in text.split(";")]
    if any(chunks) and not all(chunks):
        raise UsageError(f"variants {text!r} hold an empty spec between ';'; remove the extra ';'")
    for chunk in chunks:
        if not chunk:
            continue
        if "=" in chunk:
            items.append(chunk)
        else:
            names = [c.strip() for c in chunk.split(",")]
            if not all(names):
                raise UsageError(f"variants {chunk!r} hold an empty name between ','; remove the extra ','")
            items.extend(names)
    if not items:
        raise UsageError("no variants given; name presets (see `fa3-numerics variants`) or key=value specs")
    out = []
    for item in items:
        r = Recipe.from_str(item)
        out.append((item, r))
    labels = [l for l, _ in out]
    if len(set(labels)) != len(labels):
        raise UsageError(f"variants repeat: {', '.join(labels)}")
    # Two labels for one recipe would compute it twice and show one result as two.
    seen: dict[str, str] = {}
    for label, r in out:
        spec = r.spec()
        if spec in seen:
            raise UsageError(f"variants {seen[spec]!r} and {label!r} are the same recipe ({spec}); keep one")
        seen[spec] = label
    return out
