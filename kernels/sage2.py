"""SageAttention2's Hopper CUDA kernel as a backend (``--backend sage2``).

Exposed: ``Sage2Backend``, ``kernel_problem``, ``load_kernel``, ``find_package``, ``HEAD_DIM_MAX``,
``PATH_ENV``, ``BUILD_HINT``.

The kernel is ``sageattn_qk_int8_pv_fp8_cuda_sm90`` of thu-ml/SageAttention 2.x (what ``sageattn``
picks on sm90): INT8 Q and K per thread from its Triton quantizer, K smoothed, V in FP8 per
channel, FP8 P V with a float32 buffer flushed after every 128-key tile
(``pv_accum_dtype="fp32+fp32"``); CUDA extensions ``_qattn_sm90`` and ``_fused``, built for
sm_90a. The package index has no wheel: ``tools/device/sage2_build.sh`` builds the two
extensions and packs an importable package; ``FA3N_SAGE2_PATH`` names the folder that holds its
``sageattention/`` (or that folder itself). Without the variable an installed ``sageattention``
2.x is used. The package from the path is imported under the name ``sageattention2``, so that
SageAttention 1's wheel (``--backend sage1``, also named ``sageattention``) can sit beside it.

As for sage1, the backend rotates the float64 inputs when the recipe says so, rounds Q, K and V
to the recipe's input format and hands them over [B, H, N, D] ("HND"); the kernel smooths,
quantizes and computes attention itself. The ``sage2-sm90`` preset is the emulator's model of it.
The kernel takes head dims up to 128 (64 and 128 natively, others zero-padded by ``core.py``)
and, causal, only seqlen_q = seqlen_k.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.recipe import Recipe
from .availability import gpu_problem, load_problem, package_version, refusal
from .sage import kernel_inputs

HEAD_DIM_MAX = 128
PATH_ENV = "FA3N_SAGE2_PATH"
BUILD_HINT = (f"build it on an sm90 machine with tools/device/sage2_build.sh (sources from thu-ml/SageAttention) "
              f"and set {PATH_ENV} to the folder holding the built sageattention/")
_MODULE = "sageattention2"  # the name the package from FA3N_SAGE2_PATH is imported under
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# P V models the recipe may name: the kernel's two-level buffer, float32 for contrast
KERNEL_ACCS = ("two-level", "fp32")

_KERNEL: dict = {}


def find_package() -> Path | None:
    """The ``sageattention`` folder ``FA3N_SAGE2_PATH`` points at (the folder itself or its
    ``sageattention/`` child), or None when the variable is unset. UsageError when it is set to a
    folder without the package."""
    raw = os.environ.get(PATH_ENV, "").strip()
    if not raw:
        return None
    p = Path(raw).expanduser()
    for cand in (p / "sageattention", p):
        if (cand / "__init__.py").is_file() and (cand / "core.py").is_file():
            return cand
    raise UsageError(f"{PATH_ENV}={raw} holds no sageattention package (sageattention/__init__.py and core.py); "
                     f"{BUILD_HINT}")


def _import_from(pkg: Path):
    """The package at ``pkg`` imported as ``sageattention2`` (its relative imports resolve inside it)."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    spec = importlib.util.spec_from_file_location(_MODULE, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(_MODULE, None)
        raise
    return mod


def _installed_version() -> str | None:
    return package_version("sageattention")


def load_kernel():
    """(sageattn_qk_int8_pv_fp8_cuda_sm90, version string, package module); imported once.
    UsageError when the package lacks its sm90 extension."""
    if not _KERNEL:
        pkg = find_package()
        if pkg is not None:
            mod = _import_from(pkg)
            src = (pkg / "SOURCE").read_text().strip() if (pkg / "SOURCE").is_file() else "unknown source"
            version = f"sageattention (built, {src}) from {pkg}"
        else:
            ver = _installed_version()
            if importlib.util.find_spec("sageattention") is None:
                raise UsageError(f"SageAttention 2 is not available: {BUILD_HINT}")
            if ver is not None and not ver.startswith("2."):
                raise UsageError(f"sageattention {ver} is installed, not SageAttention 2: {BUILD_HINT}")
            mod = importlib.import_module("sageattention")
            version = f"sageattention {ver or 'unknown'}"
        core = importlib.import_module(mod.__name__ + ".core")
        if not getattr(core, "SM90_ENABLED", False):
            try:  # the import error of the extension, which core.py swallows
                importlib.import_module(mod.__name__ + "._qattn_sm90")
                why = "sm90_compile did not import"
            except Exception as exc:  # noqa: BLE001 - a compiled extension fails in many ways
                why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            raise UsageError(f"the sageattention package has no working _qattn_sm90 extension ({why}); {BUILD_HINT}")
        _KERNEL.update(fn=mod.sageattn_qk_int8_pv_fp8_cuda_sm90, version=version, module=mod)
    return _KERNEL["fn"], _KERNEL["version"], _KERNEL["module"]


def kernel_problem(device: str = "cuda") -> str | None:
    """None when SageAttention2's sm90 kernel can run on ``device``; else every missing piece and its
    fix, one line."""
    gpu = gpu_problem(device, lambda cap: cap == (9, 0),
                      no_gpu="SageAttention2's sm90 kernel needs an NVIDIA Hopper GPU",
                      wrong_gpu="; this backend runs SageAttention2's sm_90a kernel (wgmma) only",
                      kernel="the SageAttention2 kernel")
    problems = [gpu] if gpu else []
    if importlib.util.find_spec("triton") is None:
        problems.append("triton is not installed (its per-thread quantizer is a Triton kernel: pip install triton)")
    try:
        pkg = find_package()
    except UsageError as exc:
        problems.append(str(exc))
        return refusal(problems)
    if pkg is None:
        ver = _installed_version()
        if importlib.util.find_spec("sageattention") is None:
            problems.append(f"SageAttention 2 is not available: {BUILD_HINT}")
        elif ver is not None and not ver.startswith("2."):
            problems.append(f"sageattention {ver} is installed (SageAttention 1's, --backend sage1), not 2.x: "
                            f"{BUILD_HINT}")
    elif not any(pkg.glob("_qattn_sm90*.so")):
        problems.append(f"{pkg} has no _qattn_sm90 extension: {BUILD_HINT}")
    if problems:
        return refusal(problems)
    return load_problem(load_kernel, "SageAttention 2 is present but does not import", BUILD_HINT)


class Sage2Backend(Backend):
    """``sageattn_qk_int8_pv_fp8_cuda_sm90`` of SageAttention 2. ``kernel_fn`` (None = the built or
    installed kernel) lets a stand-in with its signature replace it (tests)."""

    name = "sage2"
    label = "sage2 (SageAttention2 sm90 CUDA kernel)"
    kernel_fn = None
    description = ("SageAttention2's Hopper CUDA kernel (sageattn_qk_int8_pv_fp8_cuda_sm90, fp32+fp32): INT8 Q/K "
                   "per thread, K smoothed, FP8 P and per-channel V, P V flushed to float32 every 128-key tile; "
                   "FP16/BF16 in and out, head dims <= 128; built from source (tools/device/sage2_build.sh)")
    hardware = True

    def check(self, device: str) -> str | None:
        return kernel_problem(device)

    def provenance(self) -> dict[str, str]:
        return {"kernel_module": "sageattention (sm90)", "kernel_version": load_kernel()[1]}

    def supports(self, recipe: Recipe) -> str | None:
        alt = "use --backend emulate"
        want = {"algo": "flash", "qk": "int8", "p": "e4m3", "v": "e4m3", "ties": "away", "order": "forward",
                "iquant": "triton-eps", "loop": "sage2", "vgran": "channel", "fquant": "torchao", "kpad": "mask",
                "pscale": "offset"}
        for key, val in want.items():
            if recipe.get(key) != val:
                return f"{key}={recipe.get(key)}: the sm90 kernel computes {key}={val} (see the sage2-sm90 preset); {alt}"
        if abs(recipe.p_offset - 8.807) > 1e-9:
            return f"poff={recipe.p_offset:g}: the kernel offsets P~ by 8.807 (S_FP8_OFFSET); {alt}"
        if recipe.gran.short_str() != "thread" or recipe.bm not in (0, 64) or recipe.bn not in (0, 128):
            return (f"gran={recipe.gran.short_str()},bm={recipe.bm},bn={recipe.bn}: the sm90 kernel quantizes Q and K "
                    f"per thread in 64x128 tiles (gran=thread,bm=64,bn=128); {alt}")
        if recipe.smooth not in ("none", "k"):
            return f"smooth={recipe.smooth}: the kernel smooths K only (smooth_k=True) or nothing (smooth=none); {alt}"
        if recipe.inp not in _DTYPES:
            return f"in={recipe.inp}: this backend hands the kernel FP16 or BF16 tensors (in=fp16 or in=bf16); {alt}"
        if recipe.out != recipe.inp:
            return f"out={recipe.out}: the kernel writes its input dtype (out={recipe.inp}); {alt}"
        if recipe.acc not in KERNEL_ACCS:
            return (f"acc={recipe.acc}: the kernel adds each tile's FP8 P V into a float32 buffer "
                    f"(acc={KERNEL_ACCS[0]}); {alt}")
        return None

    # -- validation hooks (read by fa3_numerics.studies.validate) ------------------------------
    #: P V models the validation runs against this kernel: the preset's (FP22 wgmma per tile into a
    #: float32 buffer) and float32 for contrast.
    validation_accs: tuple = KERNEL_ACCS

    def validation_recipe(self, case) -> Recipe:
        """The sage2-sm90 preset, FP16 in and out (BF16 for the grid's BF16 cases), with the case's
        rotation applied before the call."""
        from fa3_numerics.numerics.recipe import get_recipe

        r = get_recipe("sage2-sm90").recipe
        fmt = "bf16" if case.dtype == "bf16" else "fp16"
        return dataclasses.replace(r, inp=fmt, out=fmt, rot=case.rot)

    def validation_skip(self, case) -> str | None:
        """Why the kernel refuses a validation case's shape (None: it runs)."""
        if case.head_dim > HEAD_DIM_MAX:
            return f"head dim {case.head_dim}: the sm90 kernel takes head dims up to {HEAD_DIM_MAX}"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        why = self.supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on SageAttention2's sm90 kernel: {why}")
        d, n, nk = q.shape[-1], q.shape[2], k.shape[2]
        if d > HEAD_DIM_MAX:
            raise UsageError(f"head dim {d}: the sm90 kernel takes head dims up to {HEAD_DIM_MAX}; use --backend "
                             "emulate")
        if causal and n != nk:
            raise UsageError(f"causal with seqlen_q {n} != seqlen_k {nk}: the kernel's causal mask needs them equal")
        if self.kernel_fn is None and not q.is_cuda:
            raise UsageError("the SageAttention2 kernel needs the inputs on a CUDA device; pass --device cuda")
        fn = self.kernel_fn or load_kernel()[0]
        qi, ki, vi = kernel_inputs(recipe, q, k, v, rotation_seed)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        o = fn(qi, ki, vi, tensor_layout="HND", is_causal=causal, qk_quant_gran="per_thread", sm_scale=scale,
               pv_accum_dtype="fp32+fp32", smooth_k=recipe.smooth == "k", return_lse=False)
        if q_index.numel() != n:
            o = o.index_select(2, q_index.to(o.device))
        return o.to(torch.float64)
