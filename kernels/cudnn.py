"""cuDNN's FP8 attention forward as a backend (``--backend cudnn-fp8``).

Exposed: ``CudnnFp8Backend``, ``kernel_problem``, ``load_kernel``, ``kernel_inputs``, ``out_descale``,
``p_scales``, ``INSTALL_HINT``.

The kernel is cuDNN's fused FP8 SDPA forward, reached through cudnn-frontend's Python graph API
(``nvidia-cudnn-frontend`` 1.32, module ``cudnn``: ``pygraph.sdpa_fp8``), the path
TransformerEngine's FP8 DotProductAttention takes. Its graph (``include/cudnn_frontend/node/
scaled_dot_product_flash_attention.h``, ``node/matmul_fp8.h``) is: S = Q K^T * attn_scale *
descale_q * descale_k; P = softmax(S) in float32; Amax_S = max P; P * scale_s cast to FP8; O =
(P V) * descale_s * descale_v; Amax_O = max |O| (before scale_o); O * scale_o written. Every
scale is one float32 per tensor, shape (1, 1, 1, 1).

As a user would (and as the ``fa3`` backend does), the Q, K, V bytes and their descales come from
the emulator's own ``prepare`` (per-tensor amax / 448), so emulator and kernel read the very same
FP8 inputs. scale_s is 2^poff (448 for the ``cudnn-fp8-fwd`` preset: P~ fills E4M3) and descale_s
its reciprocal. On Hopper cuDNN writes O in FP8 only; with ``oscale=amax`` the graph runs twice:
once to read Amax_O, once with TransformerEngine's scale_o = 448 / amax_o (the emulator's
descale rule, ``out_descale``), and O is read back as O8 * descale_o.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerTensor
from fa3_numerics.numerics.recipe import Recipe
from .availability import gpu_problem, load_problem, package_version, refusal

INSTALL_HINT = ("pip install nvidia-cudnn-frontend==1.32.0 (module cudnn; needs the cuDNN 9 library of torch's "
                "CUDA build, nvidia-cudnn-cu12/cu13)")
# O dtypes by the recipe's ``out``: FP8 on Hopper, BF16 where cuDNN takes it (Blackwell, cuDNN 9.13+).
_OUT = ("e4m3", "bf16")
_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
#: keys per KV tile of cuDNN 9.19's FP8 forward on Hopper (fitted: reports/h200/field/)
KERNEL_BLOCK_N = 256

_KERNEL: dict = {}
_GRAPHS: dict = {}
_HANDLES: dict = {}


def _version() -> str | None:
    return package_version("nvidia-cudnn-frontend")


def kernel_problem(device: str = "cuda") -> str | None:
    """None when cuDNN's FP8 SDPA can run on ``device``; else every missing piece and its fix, one line."""
    gpu = gpu_problem(device, lambda cap: cap >= (9, 0),
                      no_gpu="cuDNN's FP8 attention needs Hopper, sm90, or later",
                      wrong_gpu="; cuDNN's FP8 attention needs sm90 or later", kernel="cuDNN's attention")
    problems = [gpu] if gpu else []
    if importlib.util.find_spec("cudnn") is None:
        problems.append(f"module cudnn missing: {INSTALL_HINT}")
    # a compiled module that cannot find libcudnn fails to load in many ways
    return refusal(problems) or load_problem(load_kernel, "cudnn is installed but does not load", INSTALL_HINT)


def load_kernel():
    """(the cudnn module, version string); imported once."""
    if not _KERNEL:
        if importlib.util.find_spec("cudnn") is None:
            raise UsageError(f"cudnn-frontend is not installed: {INSTALL_HINT}")
        mod = importlib.import_module("cudnn")
        try:
            backend = f"cuDNN {mod.backend_version()}"
        except Exception:  # noqa: BLE001 - provenance only
            backend = "cuDNN unknown"
        _KERNEL.update(mod=mod, version=f"nvidia-cudnn-frontend {_version() or 'unknown'}, {backend}")
    return _KERNEL["mod"], _KERNEL["version"]


def p_scales(recipe: Recipe) -> tuple[float, float]:
    """(scale_s, descale_s) as float32 values: P~ = exp(S - max) in [0, 1] times 2^poff fills the
    emulator's offset (poff) and descale_s undoes it in O."""
    scale_s = float(torch.tensor(2.0 ** recipe.p_offset, dtype=torch.float32))
    return scale_s, float(torch.tensor(1.0 / scale_s, dtype=torch.float32))


def out_descale(amax_o: float, recipe: Recipe) -> float:
    """descale_o for an FP8 O from the kernel's Amax_O: the emulator's rule (``quant.amax_to_scale``:
    amax / fmt.max in float64, rounded to float32; 1 where amax is 0 or not finite)."""
    from fa3_numerics.numerics.formats import get_format
    from fa3_numerics.numerics.quant import amax_to_scale

    return float(amax_to_scale(torch.tensor(float(amax_o), dtype=torch.float64), get_format(recipe.out)))


def kernel_inputs(pre, recipe: Recipe, kv_heads: int) -> dict:
    """cuDNN-layout tensors from the emulator's ``Prepared``: "q", "k", "v" contiguous [B, H, N, D]
    float8_e4m3fn (K and V with ``kv_heads`` heads), and "descale_q/k/v", "descale_s", "scale_s"
    as float32 (1, 1, 1, 1) tensors on the values' device."""
    h = pre.q.values.shape[1]
    g = h // kv_heads
    e4m3 = torch.float8_e4m3fn
    out = {"q": pre.q.values.to(e4m3).contiguous(), "k": pre.k.values[:, ::g].to(e4m3).contiguous(),
           "v": pre.v.values[:, ::g].to(e4m3).contiguous()}
    dev = out["q"].device
    one = lambda x: torch.tensor(float(x), dtype=torch.float32, device=dev).reshape(1, 1, 1, 1)  # noqa: E731
    for name, t in (("descale_q", pre.q.descale), ("descale_k", pre.k.descale), ("descale_v", pre.v.descale)):
        if t.numel() != 1 and not bool((t == t.reshape(-1)[0]).all()):
            raise UsageError("cuDNN's sdpa_fp8 takes one descale per tensor; use gran=tensor")
        out[name] = one(t.reshape(-1)[0])
    out["scale_s"], out["descale_s"] = (one(x) for x in p_scales(recipe))
    return out


def _handle(dev: torch.device):
    cudnn = load_kernel()[0]
    key = str(dev)
    if key not in _HANDLES:
        _HANDLES[key] = cudnn.create_handle()
    cudnn.set_stream(handle=_HANDLES[key], stream=torch.cuda.current_stream(dev).cuda_stream)
    return _HANDLES[key]


def _stride(shape) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def build_graph(dev, b: int, h: int, hkv: int, n: int, nk: int, d: int, dv: int, causal: bool, scale: float,
                out: str) -> dict:
    """The planned sdpa_fp8 graph for one shape (cached): {"graph", "t" (name -> graph tensor),
    "workspace", "handle"}. cuDNN's refusal (check_support / build_plans) propagates."""
    key = (str(dev), b, h, hkv, n, nk, d, dv, bool(causal), float(scale), out)
    if key in _GRAPHS:
        return _GRAPHS[key]
    cudnn = load_kernel()[0]
    dt = cudnn.data_type
    handle = _handle(dev)
    graph = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=handle)
    t = {}
    for name, shape in (("q", [b, h, n, d]), ("k", [b, hkv, nk, d]), ("v", [b, hkv, nk, dv])):
        t[name] = graph.tensor(name=name, dim=shape, stride=_stride(shape), data_type=dt.FP8_E4M3)
    for name in _SCALARS:
        t[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
        descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"], is_inference=True,
        attn_scale=float(scale), use_causal_mask=bool(causal), name="sdpa_fp8")
    o_shape = [b, h, n, dv]
    o.set_output(True).set_dim(o_shape).set_stride(_stride(o_shape)).set_data_type(
        dt.FP8_E4M3 if out == "e4m3" else dt.BFLOAT16)
    for name, a in (("amax_s", amax_s), ("amax_o", amax_o)):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        t[name] = a
    t["o"] = o
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    ws = torch.empty(max(1, int(graph.get_workspace_size())), dtype=torch.uint8, device=dev)
    try:  # provenance: cudnn-frontend's own Python engines (none for FP8 on sm90) or the cuDNN library
        engine = graph.selected_engine
        engine = "cuDNN library" if engine is None else f"cudnn-frontend Python engine {engine!r}"
    except Exception:  # noqa: BLE001
        engine = "unknown"
    _GRAPHS[key] = entry = {"graph": graph, "t": t, "workspace": ws, "handle": handle, "engine": engine}
    return entry


def run_graph(entry: dict, ins: dict, scale_o: float, out: str) -> dict:
    """Execute once: {"o" (float8_e4m3fn or bfloat16 [B, H, N, Dv]), "amax_s", "amax_o" (floats)}."""
    t = entry["t"]
    q = ins["q"]
    dev = q.device
    b, h, n = q.shape[:3]
    dv = ins["v"].shape[-1]
    o = torch.empty((b, h, n, dv), dtype=torch.float8_e4m3fn if out == "e4m3" else torch.bfloat16, device=dev)
    amax_s = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev)
    amax_o = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev)
    so = torch.tensor(float(scale_o), dtype=torch.float32, device=dev).reshape(1, 1, 1, 1)
    pack = {t[k]: ins[k] for k in ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s")}
    pack.update({t["scale_o"]: so, t["o"]: o, t["amax_s"]: amax_s, t["amax_o"]: amax_o})
    entry["graph"].execute(pack, entry["workspace"], handle=_handle(dev))
    torch.cuda.synchronize(dev)
    return {"o": o, "amax_s": float(amax_s.item()), "amax_o": float(amax_o.item())}


class CudnnFp8Backend(Backend):
    """cuDNN's fused FP8 SDPA forward (cudnn-frontend ``sdpa_fp8``). ``kernel_fn`` (None = cuDNN)
    lets a stand-in replace the graph (tests): ``fn(ins, scale_o, out, causal, softmax_scale)`` ->
    ``run_graph``'s dict."""

    name = "cudnn-fp8"
    label = "cudnn-fp8 (cuDNN fused FP8 SDPA forward, cudnn-frontend sdpa_fp8)"
    description = ("cuDNN's FP8 SDPA forward (cudnn-frontend sdpa_fp8, TransformerEngine's FP8 attention): E4M3 "
                   "Q/K/V/P with one descale per tensor, O in E4M3 with scale_o = 448/amax_o on Hopper")
    hardware = True
    kernel_fn = None
    #: the last call's Amax_S and Amax_O, as the kernel reported them (what TE would scale by).
    last_amax: dict = {}
    #: which engine served the last call's graph
    last_engine: str = ""

    def check(self, device: str) -> str | None:
        return kernel_problem(device)

    def provenance(self) -> dict[str, str]:
        return {"kernel_module": "cudnn", "kernel_version": str(load_kernel()[1])}

    def supports(self, recipe: Recipe) -> str | None:
        alt = "use --backend emulate"
        if recipe.algo != "flash":
            return f"algo={recipe.algo}: cuDNN's fused kernel computes tile by tile (algo=flash); {alt}"
        if (recipe.qk, recipe.v, recipe.p) != ("e4m3", "e4m3", "e4m3"):
            return f"qk={recipe.qk},v={recipe.v},p={recipe.p}: this backend runs sdpa_fp8 with E4M3 Q, K, V and P; {alt}"
        if not isinstance(recipe.gran, PerTensor):
            return f"gran={recipe.gran.short_str()}: sdpa_fp8 takes one descale per tensor (gran=tensor); {alt}"
        if recipe.p_scale != "offset":
            return f"pscale={recipe.p_scale}: P is scaled by the fixed scale_s = 2^poff (pscale=offset); {alt}"
        if recipe.out not in _OUT:
            return f"out={recipe.out}: sdpa_fp8 writes O in E4M3 (Hopper) or BF16 (Blackwell); {alt}"
        if recipe.out == "bf16" and recipe.oscale != "none":
            return f"oscale={recipe.oscale} with out=bf16: a BF16 O takes no scale; drop oscale"
        if recipe.bm or recipe.bn not in (0, KERNEL_BLOCK_N):
            return (f"bm/bn set: cuDNN chooses its own tiles (KV tiles of {KERNEL_BLOCK_N} keys, as the cudnn-fp8-fwd "
                    f"preset has them); drop bm=/bn= or {alt}")
        return None

    # -- validation hooks (read by fa3_numerics.studies.validate) ------------------------------
    #: the accumulator models run against this kernel (its own is not published).
    validation_accs: tuple = ("fp22", "two-level", "fp32")

    def validation_recipe(self, case) -> Recipe:
        """The cudnn-fp8-fwd preset with the case's rotation (a pre-pass, as for FA3): cuDNN's
        descales are per tensor whatever the case's granularity, and its inputs FP8 in every case."""
        from fa3_numerics.numerics.recipe import get_recipe

        return dataclasses.replace(get_recipe("cudnn-fp8-fwd").recipe, rot=case.rot)

    def validation_skip(self, case) -> str | None:
        """Why this case is not run on cuDNN: a shape cuDNN declines (probed by planning the graph,
        when a GPU is here)."""
        r = self.validation_recipe(case)
        if case.head_dim % 16:
            return f"head dim {case.head_dim}: cuDNN's FP8 attention needs a multiple of 16"
        if kernel_problem("cuda") is not None:
            return None  # check() says why nothing runs
        scale = case.scale or 1.0 / math.sqrt(case.head_dim)
        try:
            build_graph(torch.device("cuda"), case.batch, case.heads, case.kv_heads, case.seqlen, case.seqlen,
                        case.head_dim, case.head_dim, case.causal, scale, r.out)
        except Exception as exc:  # noqa: BLE001 - cuDNN's refusals are its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            return f"cuDNN declines this shape ({type(exc).__name__}: {first})"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        from fa3_numerics.numerics.emulator import prepare

        why = self.supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on cuDNN's sdpa_fp8: {why}")
        if self.kernel_fn is None and not q.is_cuda:
            raise UsageError("cuDNN's attention needs the inputs on a CUDA device; pass --device cuda")
        b, h, n, d = q.shape
        hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
        if causal and n != nk:
            raise UsageError(f"causal with seqlen_q {n} != seqlen_k {nk}: this backend aligns the causal mask "
                             "top-left (use_causal_mask), which equals the emulator's only for equal lengths")
        every = torch.arange(n, device=q.device)
        pre = prepare(recipe, q, k, v, q_index=every, rotation_seed=rotation_seed, causal=causal, cache=cache)
        ins = kernel_inputs(pre, recipe, hkv)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        if self.kernel_fn is not None:
            run = lambda so: self.kernel_fn(ins, so, recipe.out, causal, scale)  # noqa: E731
        else:
            entry = self._graph(q.device, b, h, hkv, n, nk, d, dv, causal, scale, recipe.out)
            run = lambda so: run_graph(entry, ins, so, recipe.out)  # noqa: E731
            type(self).last_engine = entry["engine"]
        res = run(1.0)
        if recipe.oscale == "amax":
            descale_o = out_descale(res["amax_o"], recipe)
            scale_o = float(torch.tensor(1.0 / descale_o, dtype=torch.float32))
            first_amax = res["amax_o"]
            res = run(scale_o)
            res["amax_o_first"] = first_amax
            o = res["o"].to(torch.float32).to(torch.float64) * descale_o
        else:
            o = res["o"].to(torch.float32).to(torch.float64)
        type(self).last_amax = {k: res[k] for k in res if k.startswith("amax")}
        if q_index.numel() != n:
            o = o.index_select(2, q_index.to(o.device))
        return o

    @staticmethod
    def _graph(dev, b, h, hkv, n, nk, d, dv, causal, scale, out):
        try:
            return build_graph(dev, b, h, hkv, n, nk, d, dv, causal, scale, out)
        except Exception as exc:  # noqa: BLE001 - cuDNN's refusals are its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            hint = ("; on Hopper cuDNN writes FP8 O only: use out=e4m3,oscale=amax (the cudnn-fp8-fwd preset)"
                    if out == "bf16" else "")
            raise UsageError(f"cuDNN declines sdpa_fp8 for [B {b}, H {h}/{hkv}, N {n}/{nk}, D {d}] "
                             f"({type(exc).__name__}: {first}){hint}") from None
