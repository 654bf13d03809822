"""The compiled FlashAttention-3 forward kernel as a backend (``--backend fa3``).

Exposed: ``KERNEL_MODULES``, ``Fa3Backend``, ``kernel_problem``, ``load_kernel``,
``kernel_inputs``, ``flash_attn``, ``fast_quantize``.

The kernel is the public FA3 Hopper forward (Dao-AILab/flash-attention, hopper/), packaged
as the ``fa3-fwd`` wheel (module ``fa3_fwd_interface``; BF16 and FP8 e4m3, FP16 compiled
out) or an upstream build (module ``flash_attn_interface``). Its FP8 path takes one float32
descale per (batch, kv-head) for each of Q, K and V and writes BF16. It has neither block
scales nor a Hadamard rotation: as a user would, this backend rotates and quantizes first
(with the emulator's own ``prepare``, so emulator and kernel see the very same FP8 bytes and
descales) and then calls the kernel on every query row, returning the rows asked for.

Sliding windows and soft-capping pass through as ``window_size`` and ``softcap`` where the build
has them: ``kernel_features`` reads the build's flags (``fa3_fwd_config.CONFIG`` or
``flash_attn_config.CONFIG``; the fa3-fwd 0.0.3 wheel is built with FLASHATTENTION_DISABLE_LOCAL,
so it has soft-capping but no local windows: a window past the sequence, which FA3 rewrites as
unbounded, still runs). No public FA3 ``flash_attn_func`` takes sink logits.
"""

from __future__ import annotations

import importlib
import importlib.util
import math

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerHead, PerTensor
from fa3_numerics.numerics.recipe import Recipe
from .availability import gpu_problem, load_problem, refusal

# Module names the kernel imports as, in order of preference, and the build-flag module of each.
KERNEL_MODULES = ("fa3_fwd_interface", "flash_attn_interface")
CONFIG_MODULES = {"fa3_fwd_interface": "fa3_fwd_config", "flash_attn_interface": "flash_attn_config"}
INSTALL_HINT = ("pip install fa3-fwd==0.0.3 (FA3 forward for sm_90a, needs torch with a CUDA 13 runtime), "
                "or build flash-attention's hopper/ (flash_attn_interface)")

_KERNEL: dict = {}


def find_kernel_module() -> str | None:
    for name in KERNEL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def kernel_problem(device: str = "cuda") -> str | None:
    """None when the FA3 kernel can run on ``device``; else every missing piece and its fix, one line."""
    gpu = gpu_problem(device, lambda cap: cap == (9, 0),
                      no_gpu="the FA3 kernel needs a Hopper GPU: H100/H200, sm_90",
                      wrong_gpu=", not Hopper (the FA3 kernel is built for sm_90a: H100/H200)", kernel="the FA3 kernel")
    problems = [gpu] if gpu else []
    if find_kernel_module() is None:
        problems.append(f"kernel module missing ({' or '.join(KERNEL_MODULES)}): {INSTALL_HINT}")
    return refusal(problems) or load_problem(load_kernel, "the FA3 kernel module is installed but does not import",
                                             INSTALL_HINT)


def load_kernel():
    """(flash_attn_func, module name, distribution version); imported once."""
    if not _KERNEL:
        name = find_kernel_module()
        if name is None:
            raise UsageError(f"the FA3 kernel is not installed: {INSTALL_HINT}")
        mod = importlib.import_module(name)
        version = "unknown"
        try:
            from importlib.metadata import version as _v

            version = f"fa3-fwd {_v('fa3-fwd')}" if name == "fa3_fwd_interface" else f"flash-attn {_v('flash_attn_3')}"
        except Exception:  # noqa: BLE001 - best effort provenance
            pass
        _KERNEL.update(fn=mod.flash_attn_func, module=name, version=version)
    return _KERNEL["fn"], _KERNEL["module"], _KERNEL["version"]


def kernel_features(module: str | None = None) -> dict:
    """{"window": bool, "softcap": bool, "sinks": False, "source": str} from the installed build's
    flags, read without importing the compiled module (no GPU needed). Unknown flags: both off."""
    module = module or find_kernel_module()
    cfg_name = CONFIG_MODULES.get(module or "", "")
    flags: dict = {}
    try:
        if cfg_name and importlib.util.find_spec(cfg_name) is not None:
            flags = dict(getattr(importlib.import_module(cfg_name), "CONFIG", {}).get("build_flags", {}))
    except (ImportError, ValueError, AttributeError):
        flags = {}
    if not flags:
        return {"window": False, "softcap": False, "sinks": False, "source": "no build flags found"}
    return {"window": not flags.get("FLASHATTENTION_DISABLE_LOCAL", True),
            "softcap": not flags.get("FLASHATTENTION_DISABLE_SOFTCAP", True),
            "sinks": False, "source": f"{cfg_name}.CONFIG"}


def masking_problem(mk, features: dict) -> str | None:
    """Why the kernel build cannot compute ``mk`` (a ``numerics.masking.Masking``), or None."""
    if mk.sinks is not None:
        return "FA3's flash_attn_func takes no sink logits; use --backend emulate"
    if mk.windowed and not features["window"]:
        return (f"this FA3 build has no sliding windows ({features['source']}: FLASHATTENTION_DISABLE_LOCAL); "
                "build flash-attention's hopper/ with local attention, or use --backend emulate")
    if mk.softcap and not features["softcap"]:
        return (f"this FA3 build has no softcap ({features['source']}: FLASHATTENTION_DISABLE_SOFTCAP); "
                "use --backend emulate")
    return None


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float, causal: bool,
               descales: tuple | None = None, fn=None, window_size: tuple[int, int] = (-1, -1),
               softcap: float = 0.0, num_splits: int = 1) -> torch.Tensor:
    """Call the kernel on (batch, seqlen, heads, dim) tensors; returns the output only. A window,
    softcap or split count is passed only when set, so plain calls are the calls made before they
    existed. ``num_splits`` > 1 takes FA3's split-KV path (float32 partials and its combine
    kernel); 0 lets the kernel's heuristic choose (``numerics.split_kv.fa3_num_splits``)."""
    fn = fn or load_kernel()[0]
    kw = dict(softmax_scale=softmax_scale, causal=causal)
    if num_splits != 1:
        kw["num_splits"] = int(num_splits)
    if tuple(window_size) != (-1, -1):
        kw["window_size"] = tuple(window_size)
    if softcap:
        kw["softcap"] = float(softcap)
    if descales is not None:
        kw.update(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    out = fn(q, k, v, **kw)
    return out[0] if isinstance(out, (tuple, list)) else out


def _kv_descale(d: torch.Tensor, b: int, h: int, group: int) -> torch.Tensor:
    """A descale broadcasting against [B, H, N, D] (uniform per (batch, head)) -> (B, H // group)."""
    return d.to(torch.float32).expand(b, h, 1, 1)[:, ::group, 0, 0].contiguous()


def kernel_inputs(pre, recipe: Recipe, kv_heads: int) -> dict:
    """Kernel-layout tensors and descales from the emulator's ``Prepared`` (all query rows).

    Returns {"q", "k", "v"}: contiguous (batch, seqlen, heads, dim) in float8_e4m3fn or
    bfloat16, and "descales": (q, k, v) float32 (batch, kv_heads) for FP8, else None. The
    values are exactly the emulator's (the float32 copies of K/V convert back losslessly).
    """
    b, h = pre.q.values.shape[:2]
    g = h // kv_heads
    dtype = torch.float8_e4m3fn if recipe.fp8 else torch.bfloat16
    lay = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    q = lay(pre.q.values.to(dtype))
    k = lay(pre.k.values[:, ::g].to(dtype))
    v = lay(pre.v.values[:, ::g].to(dtype))
    ds = None
    if recipe.fp8:
        for t in (pre.q.descale, pre.k.descale, pre.v.descale):
            if t.shape[2] != 1:
                raise UsageError("the FA3 kernel takes one descale per (batch, kv-head); use gran=head or gran=tensor")
        ds = tuple(_kv_descale(t, b, h, g) for t in (pre.q.descale, pre.k.descale, pre.v.descale))
    return {"q": q, "k": k, "v": v, "descales": ds}


class Fa3Backend(Backend):
    """The compiled kernel. ``kernel_fn`` (None = the installed kernel) lets a stand-in replace it."""

    name = "fa3"
    label = "fa3"
    kernel_fn = None
    description = ("compiled FA3 forward kernel (fa3_fwd_interface / flash_attn_interface) on a Hopper GPU: "
                   "FP8 e4m3 with per-(batch, kv-head) or per-tensor descales, or BF16; rotation and "
                   "quantization applied before the call")
    hardware = True

    def check(self, device: str) -> str | None:
        return kernel_problem(device)

    def provenance(self) -> dict[str, str]:
        _, module, version = load_kernel()
        return {"kernel_module": module, "kernel_version": version}

    def masking_refusal(self, mk) -> str | None:
        return None if mk.plain else masking_problem(mk, kernel_features())

    def supports(self, recipe: Recipe) -> str | None:
        alt = "--backend emulate"
        if recipe.algo != "flash":
            return (f"algo={recipe.algo}: the FA3 kernel computes tile by tile (algo=flash) only; "
                    f"for materialised S and P use --backend sdpa-math or {alt}")
        fmts = {recipe.qk, recipe.v}
        if fmts == {"bf16"}:
            if recipe.p != "bf16" or recipe.out != "bf16":
                return "the FA3 BF16 path casts P to BF16 and writes BF16; set p=bf16,out=bf16"
        elif fmts == {"e4m3"}:
            if recipe.p != "e4m3":
                return f"the FA3 FP8 path casts P to e4m3, not {recipe.p}; set p=e4m3"
            if recipe.out != "bf16":
                return f"the FA3 kernel writes BF16 for FP8 inputs, not {recipe.out}; set out=bf16"
            if recipe.p_scale != "offset" or recipe.p_offset != 8.0:
                return "the FA3 FP8 kernel scales P by the fixed offset 2^8 (pscale=offset,poff=8)"
            if not isinstance(recipe.gran, (PerHead, PerTensor)):
                return (f"gran={recipe.gran.short_str()}: per-block (and per-token) scales are not in the public FA3 "
                        f"kernel; use gran=head or gran=tensor, or use {alt}")
        elif "fp16" in fmts:
            return ("FP16 is compiled out of the fa3-fwd wheel (BF16 and FP8 only); use qk=bf16,v=bf16,p=bf16,out=bf16, "
                    f"--backend sdpa-flash for FP16, or use {alt}")
        else:
            return (f"qk={recipe.qk}, v={recipe.v}: the FA3 kernel takes e4m3 or bf16 for Q, K and V alike; use {alt}")
        if recipe.bm or recipe.bn:
            return f"bm/bn set: the kernel's tiles are fixed by its build; drop bm=/bn= or use {alt}"
        if recipe.order != "reverse":
            return f"order={recipe.order}: the kernel visits KV tiles last to first; use {alt}"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None,
                  window_size=None, softcap=None, sinks=None):
        from fa3_numerics.numerics.emulator import prepare
        from fa3_numerics.numerics.masking import masking

        mk = masking(causal, window_size, softcap, sinks, heads=q.shape[1], seqlen_q=q.shape[2], seqlen_k=k.shape[2])
        why = self.masking_refusal(mk)
        if why is not None:
            raise UsageError(f"{mk.describe()} cannot run on the FA3 kernel: {why}")
        causal = mk.causal
        why = self.supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on the FA3 kernel: {why}")
        if self.kernel_fn is None and not q.is_cuda:
            raise UsageError("the FA3 kernel needs the inputs on a CUDA device; pass --device cuda")
        n, d = q.shape[2], q.shape[3]
        every = torch.arange(n, device=q.device)
        pre = prepare(recipe, q, k, v, q_index=every, rotation_seed=rotation_seed, causal=causal, cache=cache,
                      mk=None if mk.plain else mk)
        ins = kernel_inputs(pre, recipe, k.shape[1])
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        o = flash_attn(ins["q"], ins["k"], ins["v"], softmax_scale=scale, causal=causal,
                       descales=ins["descales"], fn=self.kernel_fn, window_size=mk.window if mk.windowed else (-1, -1),
                       softcap=mk.softcap)
        o = o.transpose(1, 2)
        if q_index.numel() != n:
            o = o.index_select(2, q_index.to(o.device))
        return o.to(torch.float64)


def mock_flash_attn(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), softcap=0.0, **_):
    """A float32 stand-in with the kernel's signature and layouts, for CPU dry runs and tests.

    Not the kernel's arithmetic: dequantizes, computes softmax attention in float32 and
    writes BF16 (for FP8 and BF16 inputs alike). Bottom-right causal alignment; FA3's window_size
    and softcap meaning.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk

    def deq(x, ds, heads_per):
        x = x.to(torch.float32)
        if ds is not None:
            x = x * ds.to(torch.float32).repeat_interleave(heads_per, dim=1)[:, None, :, None]
        return x

    qf = deq(q, q_descale, g)
    kf = deq(k, k_descale, 1).repeat_interleave(g, dim=2)
    vf = deq(v, v_descale, 1).repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * (softmax_scale or 1.0 / math.sqrt(d))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    right = 0 if causal else right
    rel = torch.arange(sk, device=q.device)[None, :] - (torch.arange(sq, device=q.device)[:, None] + sk - sq)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, vf).to(torch.bfloat16)


class MockFa3Backend(Fa3Backend):
    """``fa3`` with ``mock_flash_attn`` in place of the kernel: exercises every step but the
    kernel itself (rotation, quantization, layouts, descales) on any device. Never hardware."""

    name = "fa3-mock"
    label = "fa3-mock (float32 stand-in, NOT the kernel)"
    hardware = False
    kernel_fn = staticmethod(mock_flash_attn)
    description = "stand-in for the FA3 kernel (float32 attention on the kernel's inputs) for dry runs and tests"

    def check(self, device: str) -> str | None:
        return None

    def provenance(self) -> dict[str, str]:
        return {}

    def masking_refusal(self, mk) -> str | None:
        return None if mk.plain else masking_problem(mk, {"window": True, "softcap": True, "sinks": False,
                                                          "source": "mock"})


# -- the fast path a user would run, for throughput ----------------------------------------

def fast_quantize(x: torch.Tensor, *, kv_heads: int, gran: str = "head", rot: str = "none", seed: int = 0):
    """(batch, seqlen, heads, dim) BF16/FP16/FP32 -> (e4m3 tensor, float32 (batch, kv_heads) descale).

    What a user would run in PyTorch before calling the kernel, and what the throughput
    measurement times as "our pre-processing": float32 arithmetic on the input's device; the
    rotation (the emulator's own matrix, e.g. diag(signs) H / sqrt(d)) as one float32 matmul
    (TF32 off); amax per (batch, kv-head group) or per tensor; scale; saturating e4m3 cast.
    """
    from fa3_numerics.numerics.rotation import make_rotation

    b, n, h, d = x.shape
    xf = x.to(torch.float32)
    if rot != "none":
        m = make_rotation(rot, d, seed).matrix().to(device=x.device, dtype=torch.float32)
        xf = torch.matmul(xf, m)
    g = h // kv_heads  # Q: one descale per group of heads sharing a KV head; K, V: g = 1
    if gran == "tensor":
        amax = xf.abs().amax().reshape(1, 1).expand(b, kv_heads)
    else:
        amax = xf.abs().reshape(b, n, kv_heads, g * d).amax(dim=(1, 3))
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).to(torch.float32).contiguous()
    scale = (1.0 / descale).repeat_interleave(g, dim=1)[:, None, :, None]
    x8 = (xf * scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return x8, descale
