"""cuDNN's FP8 attention, forward and backward, as a backend (``--backend cudnn-fp8``; the backward through
``gradients``, which ``run backward --backend cudnn-fp8`` calls; its recipe is ``cudnn-fp8-kernel``).

Exposed: ``CudnnFp8Backend``, ``kernel_problem``, ``load_kernel``, ``kernel_inputs``, ``out_descale``,
``p_scales``, ``INSTALL_HINT``; the training path: ``build_train_forward``, ``run_train_forward``,
``build_backward``, ``run_backward``, ``fp8_fwd_bwd``, ``decode``, ``per_tensor_fp8``, ``bwd_formats``,
``EmulatedGraphs``, ``BWD_SCALARS``, ``FMT_MAX``.

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
from fa3_numerics.errors import KernelDeclined, UsageError
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


def _forward_graph(cudnn, handle, b: int, h: int, hkv: int, n: int, nk: int, d: int, dv: int, causal: bool,
                   scale: float, out: str, *, inference: bool):
    """(graph, t): the sdpa_fp8 forward graph, not yet planned; ``t`` names its tensors (q, k, v, the
    scalars, o, amax_s, amax_o and, for training, stats [B, H, N, 1] float32: what the backward reads)."""
    dt = cudnn.data_type
    graph = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=handle)
    t = {}
    for name, shape in (("q", [b, h, n, d]), ("k", [b, hkv, nk, d]), ("v", [b, hkv, nk, dv])):
        t[name] = graph.tensor(name=name, dim=shape, stride=_stride(shape), data_type=dt.FP8_E4M3)
    for name in _SCALARS:
        t[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
    o, stats, amax_s, amax_o = graph.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
        descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"], is_inference=inference,
        attn_scale=float(scale), use_causal_mask=bool(causal), name="sdpa_fp8" if inference else "sdpa_fp8_train")
    o_shape = [b, h, n, dv]
    o.set_output(True).set_dim(o_shape).set_stride(_stride(o_shape)).set_data_type(
        dt.FP8_E4M3 if out == "e4m3" else dt.BFLOAT16)
    if not inference:
        stats.set_output(True).set_dim([b, h, n, 1]).set_stride(_stride([b, h, n, 1])).set_data_type(dt.FLOAT)
        t["stats"] = stats
    for name, a in (("amax_s", amax_s), ("amax_o", amax_o)):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        t[name] = a
    t["o"] = o
    return graph, t


def build_graph(dev, b: int, h: int, hkv: int, n: int, nk: int, d: int, dv: int, causal: bool, scale: float,
                out: str) -> dict:
    """The planned sdpa_fp8 graph for one shape (cached): {"graph", "t" (name -> graph tensor),
    "workspace", "handle"}. cuDNN's refusal (check_support / build_plans) propagates."""
    key = (str(dev), b, h, hkv, n, nk, d, dv, bool(causal), float(scale), out)
    if key in _GRAPHS:
        return _GRAPHS[key]
    cudnn = load_kernel()[0]
    handle = _handle(dev)
    graph, t = _forward_graph(cudnn, handle, b, h, hkv, n, nk, d, dv, causal, scale, out, inference=True)
    _plan(cudnn, graph)
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
    """cuDNN's fused FP8 SDPA forward (cudnn-frontend ``sdpa_fp8``) and, through ``gradients``, its
    training forward + ``sdpa_fp8_backward`` (``fp8_fwd_bwd``). ``kernel_fn`` (None = cuDNN) lets a
    stand-in replace the forward graph (tests): ``fn(ins, scale_o, out, causal, softmax_scale)`` ->
    ``run_graph``'s dict; ``graphs`` the backward's (``EmulatedGraphs``)."""

    name = "cudnn-fp8"
    label = "cudnn-fp8 (cuDNN fused FP8 SDPA, cudnn-frontend sdpa_fp8 and sdpa_fp8_backward)"
    description = ("cuDNN's FP8 SDPA (cudnn-frontend sdpa_fp8 and sdpa_fp8_backward, TransformerEngine's FP8 "
                   "attention): E4M3 Q/K/V/P with one descale per tensor, O in E4M3 with scale_o = 448/amax_o on "
                   "Hopper; backward with dO and dS in E4M3 or E5M2, gradients E4M3, E5M2 or BF16")
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

    # -- the backward (``run backward --backend cudnn-fp8``) ------------------------------------
    backward = True
    #: None = cuDNN; an object with the four graph functions of ``fp8_fwd_bwd`` replaces them (tests:
    #: ``EmulatedGraphs``)
    graphs = None
    #: the last backward call's scales and amaxes, as ``fp8_fwd_bwd`` returned them
    last_backward: dict = {}

    def backward_supports(self, recipe: Recipe) -> str | None:
        """sdpa_fp8 (training) + sdpa_fp8_backward as this module runs them: the forward's checks, FP8 O
        scaled from Amax_O (Hopper's only O, which the backward reads), one scale per tensor, no rotation
        or tiles, and the ``bwd.*`` formats of ``bwd_formats`` for the recipe's dO format."""
        from fa3_numerics.numerics.keys.backward import backward_pairs

        why = self.supports(recipe)
        if why is not None:
            return why
        alt = "use --backend emulate"
        if (recipe.out, recipe.oscale) != ("e4m3", "amax"):
            return (f"out={recipe.out},oscale={recipe.oscale}: cuDNN's training forward writes O in E4M3 scaled "
                    "from its Amax_O, which its backward reads; set out=e4m3,oscale=amax")
        if not isinstance(recipe.bwd_gran, PerTensor):
            return f"bwd.gran={recipe.bwd_gran.short_str()}: sdpa_fp8_backward takes one scale per tensor; {alt}"
        if recipe.bwd_rot != "none" or recipe.bwd_bm or recipe.bwd_bn:
            return f"bwd.rot/bwd.bm/bwd.bn set: cuDNN's backward neither rotates nor takes tiles; {alt}"
        if recipe.bwd_pscale != "offset":
            return (f"bwd.pscale={recipe.bwd_pscale}: cuDNN casts P in the backward with the forward's fixed scale_s "
                    "= 2^poff; set bwd.pscale=offset (the cudnn-fp8-kernel preset)")
        if recipe.bwd_dqcast != "fp16":
            return (f"bwd.dqcast={recipe.bwd_dqcast}: cuDNN's Hopper backward rounds dQ's dS to FP16 before its FP8 "
                    "cast; set bwd.dqcast=fp16 (the cudnn-fp8-kernel preset)")
        # The kernel's arithmetic as fitted on its bytes (reports/h200/backward/cudnn.md): a recipe asking
        # for another form would be labelled with arithmetic the kernel does not do.
        fitted = {"bwd_pexp": "cudnn", "bwd_outscale": "scale", "bwd_dsform": "cudnn-ffma", "bwd_dqscale": "end"}
        off = [f"{f.replace('_', '.', 1)}={getattr(recipe, f)}" for f, want in fitted.items()
               if getattr(recipe, f) != want]
        if off:
            return (f"{', '.join(off)}: cuDNN's Hopper backward computes "
                    f"{', '.join(f.replace('_', '.', 1) + '=' + w for f, w in fitted.items())}; set those keys "
                    "(the cudnn-fp8-kernel preset)")
        do_fmt = backward_pairs(recipe)["bwd.dp"][0]
        if do_fmt not in FMT_MAX or recipe.bwd_out not in _TORCH_DT:
            return (f"dO in {do_fmt}, gradients in {recipe.bwd_out}: sdpa_fp8_backward takes dO in e4m3 or e5m2 "
                    f"and writes e4m3, e5m2 or bf16 gradients; {alt}")
        want = bwd_formats(do_fmt, recipe.bwd_out)
        off = [f"{k.replace('_', '.', 1)}={v}" for k, v in want.items() if getattr(recipe, k) != v]
        if off:
            return (f"with dO in {do_fmt}, cuDNN's FP8 backward computes {', '.join(off)} (Q, K, V, O, P in E4M3, "
                    f"dS in dO's format); set those keys or {alt}")
        return None

    def gradients(self, recipe, q, k, v, do, *, causal, rotation_seed, cache, softmax_scale=None):
        from fa3_numerics.numerics.emulator import prepare
        from fa3_numerics.numerics.keys.backward import backward_pairs

        why = self.backward_supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on cuDNN's sdpa_fp8_backward: {why}")
        if self.graphs is None and not q.is_cuda:
            raise UsageError("cuDNN's attention needs the inputs on a CUDA device; pass --device cuda")
        b, h, n, d = q.shape
        if k.shape[2] != n:
            raise UsageError(f"seqlen_q {n} != seqlen_k {k.shape[2]}: the backward runs self-attention shapes here")
        every = torch.arange(n, device=q.device)
        pre = prepare(recipe, q, k, v, q_index=every, rotation_seed=rotation_seed, causal=causal, cache=cache)
        kin = kernel_inputs(pre, recipe, k.shape[1])
        do_fmt = backward_pairs(recipe)["bwd.dp"][0]
        do8, descale_do = per_tensor_fp8(do, do_fmt)
        ins = {"q": kin["q"], "k": kin["k"], "v": kin["v"], "dO": do8.to(q.device), "descale_dO": descale_do}
        ins.update({name: float(kin[name].reshape(-1)[0]) for name in ("descale_q", "descale_k", "descale_v",
                                                                        "descale_s", "scale_s")})
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        try:
            res = fp8_fwd_bwd(ins, causal, scale, do_fmt, recipe.bwd_out, graphs=self.graphs)
        except (UsageError, TypeError):
            raise
        except Exception as exc:  # noqa: BLE001 - cuDNN's refusals are its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise KernelDeclined(f"cuDNN declines sdpa_fp8 training + sdpa_fp8_backward for [B {b}, H {h}/{k.shape[1]}, "
                             f"N {n}, D {d}] ({type(exc).__name__}: {first})") from None
        sc = res["scalars"]
        type(self).last_backward = {"scalars": sc, "amax": res["amax"]}
        if n % RAGGED_DQ_MULTIPLE and self.graphs is None:
            import warnings

            # the user gets what the kernel computes (that is what a run measures), told that it is a defect
            warnings.warn(ragged_dq_defect(n), RuntimeWarning, stacklevel=2)
        # lse: the Stats the backward read (natural-log LSE), so an emulated backward can start from the
        # kernel's own forward (validate --backward's kernel-fwd mode)
        return {"o": decode(res["o_raw"], sc["scale_o"]), "dq": decode(res["dq_raw"], sc["scale_dQ"]),
                "dk": decode(res["dk_raw"], sc["scale_dK"]), "dv": decode(res["dv_raw"], sc["scale_dV"]),
                "lse": res["stats"].reshape(b, h, n).to(torch.float32)}

    def validation_backward_recipe(self, case):
        """The cudnn-fp8-kernel preset as it stands (dO, dS and the gradients in E5M2, TransformerEngine's
        HYBRID format) for every case: per-tensor descales whatever the case's granularity, FP8
        whatever its dtype."""
        from fa3_numerics.numerics.recipe import get_recipe

        return get_recipe("cudnn-fp8-kernel").recipe

    def validation_backward_skip(self, case) -> str | None:
        if case.head_dim % 16:
            return f"head dim {case.head_dim}: cuDNN's FP8 attention needs a multiple of 16"
        if case.seqlen % RAGGED_DQ_MULTIPLE:
            return ragged_dq_defect(case.seqlen)
        return None

    @staticmethod
    def _graph(dev, b, h, hkv, n, nk, d, dv, causal, scale, out):
        try:
            return build_graph(dev, b, h, hkv, n, nk, d, dv, causal, scale, out)
        except Exception as exc:  # noqa: BLE001 - cuDNN's refusals are its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            hint = ("; on Hopper cuDNN writes FP8 O only: use out=e4m3,oscale=amax (the cudnn-fp8-fwd preset)"
                    if out == "bf16" else "")
            raise KernelDeclined(f"cuDNN declines sdpa_fp8 for [B {b}, H {h}/{hkv}, N {n}/{nk}, D {d}] "
                             f"({type(exc).__name__}: {first}){hint}") from None


# -- training: the forward that saves its stats, and sdpa_fp8_backward ------------------------------
#
# cudnn-frontend's sdpa_fp8_backward (python/pygraph/sdpa.cpp; include/cudnn_frontend/node/sdpa_fp8_bwd.h)
# reads Q, K, V, O and dO in FP8 with one float32 descale each (descale_q/k/v/o/dO), the forward's Stats
# (float32 [B, H, N, 1]: max + log(sum exp) of the scaled scores, the natural-log LSE), P's scale pair
# (scale_s/descale_s, as in the forward), the pair of dP (cuDNN's dP is the softmax gradient, our dS:
# scale_dP quantizes it, descale_dP undoes it in dQ and dK) and the scales dQ, dK, dV are written with
# (scale_dQ/dK/dV); it returns dQ, dK, dV and Amax_dQ/dK/dV/dP. cuDNN's own benchmark
# (benchmark/sdpa_benchmark_training) runs every FP8 tensor in E4M3; TransformerEngine's HYBRID format
# puts dO (and the gradients) in E5M2. Both are offered here: which one a kernel accepts is cuDNN's call.

_CUDNN_DT = {"e4m3": "FP8_E4M3", "e5m2": "FP8_E5M2", "bf16": "BFLOAT16"}
_TORCH_DT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}
BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
               "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
_FWD_TRAIN: dict = {}
_BWD: dict = {}


def _plan(cudnn, graph) -> None:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()


def build_train_forward(dev, b: int, h: int, hkv: int, n: int, d: int, causal: bool, scale: float) -> dict:
    """The planned sdpa_fp8 training forward (is_inference=False: Stats written) for one shape, O in
    E4M3 (Hopper's only FP8 O), cached: {"graph", "t", "workspace"}."""
    key = (str(dev), b, h, hkv, n, d, bool(causal), float(scale))
    if key in _FWD_TRAIN:
        return _FWD_TRAIN[key]
    cudnn = load_kernel()[0]
    graph, t = _forward_graph(cudnn, _handle(dev), b, h, hkv, n, n, d, d, causal, scale, "e4m3", inference=False)
    _plan(cudnn, graph)
    ws = torch.empty(max(1, int(graph.get_workspace_size())), dtype=torch.uint8, device=dev)
    _FWD_TRAIN[key] = entry = {"graph": graph, "t": t, "workspace": ws}
    return entry


def run_train_forward(entry: dict, ins: dict, scale_o: float) -> dict:
    """One training forward: {"o" (E4M3 [B, H, N, D]), "stats" (float32 [B, H, N, 1]), "amax_s",
    "amax_o"}; ``ins`` as ``kernel_inputs`` gives it."""
    t = entry["t"]
    q = ins["q"]
    dev = q.device
    b, h, n, d = q.shape
    out = {"o": torch.empty((b, h, n, d), dtype=torch.float8_e4m3fn, device=dev),
           "stats": torch.empty((b, h, n, 1), dtype=torch.float32, device=dev),
           "amax_s": torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev),
           "amax_o": torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev)}
    pack = {t[k]: ins[k] for k in ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s")}
    pack[t["scale_o"]] = torch.tensor(float(scale_o), dtype=torch.float32, device=dev).reshape(1, 1, 1, 1)
    pack.update({t[k]: out[k] for k in out})
    entry["graph"].execute(pack, entry["workspace"], handle=_handle(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"o": out["o"], "stats": out["stats"], "amax_s": float(out["amax_s"].item()),
            "amax_o": float(out["amax_o"].item())}


def build_backward(dev, b: int, h: int, hkv: int, n: int, d: int, causal: bool, scale: float, do_fmt: str,
                   grad_fmt: str) -> dict:
    """The planned sdpa_fp8_backward graph for one shape, dO in ``do_fmt`` (e4m3 / e5m2), dQ, dK, dV
    written in ``grad_fmt`` (e4m3 / e5m2 / bf16), cached. cuDNN's refusal propagates."""
    key = (str(dev), b, h, hkv, n, d, bool(causal), float(scale), do_fmt, grad_fmt)
    if key in _BWD:
        return _BWD[key]
    cudnn = load_kernel()[0]
    dt = cudnn.data_type
    graph = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=_handle(dev))
    t = {}
    shapes = {"q": [b, h, n, d], "k": [b, hkv, n, d], "v": [b, hkv, n, d], "o": [b, h, n, d], "dO": [b, h, n, d]}
    for name, shape in shapes.items():
        fmt = getattr(dt, _CUDNN_DT[do_fmt]) if name == "dO" else dt.FP8_E4M3
        t[name] = graph.tensor(name=name, dim=shape, stride=_stride(shape), data_type=fmt)
    t["stats"] = graph.tensor(name="stats", dim=[b, h, n, 1], stride=_stride([b, h, n, 1]), data_type=dt.FLOAT)
    for name in BWD_SCALARS:
        t[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
    outs = graph.sdpa_fp8_backward(
        q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
        **{name: t[name] for name in BWD_SCALARS}, attn_scale=float(scale), use_causal_mask=bool(causal),
        name="sdpa_fp8_backward")
    for name, x, shape in zip(("dq", "dk", "dv"), outs[:3], (shapes["q"], shapes["k"], shapes["v"])):
        x.set_output(True).set_dim(shape).set_stride(_stride(shape)).set_data_type(getattr(dt, _CUDNN_DT[grad_fmt]))
        t[name] = x
    for name, a in zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), outs[3:7]):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        t[name] = a
    _plan(cudnn, graph)
    ws = torch.empty(max(1, int(graph.get_workspace_size())), dtype=torch.uint8, device=dev)
    _BWD[key] = entry = {"graph": graph, "t": t, "workspace": ws, "grad_fmt": grad_fmt}
    return entry


def run_backward(entry: dict, ins: dict, scalars: dict) -> dict:
    """One sdpa_fp8_backward: {"dq", "dk", "dv" (as written, ``grad_fmt``), "amax_dQ", "amax_dK",
    "amax_dV", "amax_dP" (floats)}. ``ins``: "q", "k", "v", "o", "dO" (FP8), "stats"; ``scalars``:
    every name of ``BWD_SCALARS`` as a float."""
    t = entry["t"]
    dev = ins["q"].device
    dtype = _TORCH_DT[entry["grad_fmt"]]
    out = {name: torch.empty(tuple(ins[src].shape), dtype=dtype, device=dev)
           for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    amax = {name: torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev)
            for name in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")}
    pack = {t[k]: ins[k] for k in ("q", "k", "v", "o", "dO", "stats")}
    pack.update({t[k]: torch.tensor(float(scalars[k]), dtype=torch.float32, device=dev).reshape(1, 1, 1, 1)
                 for k in BWD_SCALARS})
    pack.update({t[k]: out[k] for k in out})
    pack.update({t[k]: amax[k] for k in amax})
    entry["graph"].execute(pack, entry["workspace"], handle=_handle(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {**out, **{k: float(v.item()) for k, v in amax.items()}}


FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _f32(x: float) -> float:
    return float(torch.tensor(float(x), dtype=torch.float32))


def _one(x: float, dev) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float32, device=dev).reshape(1, 1, 1, 1)


# Measured on the H200 (cuDNN 9.19, cudnn-frontend 1.32; tools/device/dump_backward_case.py, reports/h200/backward/
# README.md): at seqlen 333, 1000 (causal or not) and 4097 sdpa_fp8_backward writes 0 into dQ's columns 16-31,
# 48-63, 80-95 and 112-127 of the last rows (330-332 of 333; 992-999 of 1000; more rows in another call on the
# same inputs), every head, while every other dQ value and all of dK and dV equal the cudnn-fp8-kernel preset's
# bit for bit. Every length tried that is a multiple of 128 (512 to 16384) is clean; lengths that are multiples
# of 64 only were not tried, hence the conservative 128.
RAGGED_DQ_MULTIPLE = 128


def ragged_dq_defect(n: int) -> str:
    return (f"seqlen {n} is not a multiple of {RAGGED_DQ_MULTIPLE}: cuDNN 9.19's sdpa_fp8_backward zeroes half of dQ's "
            "columns in the last rows there (a kernel defect, measured; the emulator models the kernel, not the defect); "
            f"pad the sequence to a multiple of {RAGGED_DQ_MULTIPLE}")


def fp8_fwd_bwd(ins: dict, causal: bool, scale: float, do_fmt: str, grad_fmt: str, graphs=None) -> dict:
    """cuDNN's FP8 training step on FP8 inputs, with TransformerEngine's current scaling (every scale
    from this call's own amax): the training forward twice (scale_o = 1, then 1 / descale_o with
    descale_o = Amax_O / 448), then sdpa_fp8_backward with scale_dP = 1 (to read Amax_dP, taken
    before the scale), again with scale_dP = max / Amax_dP (the dO format's max; descale_dP its
    reciprocal) to read Amax_dQ/dK/dV, and, for FP8 gradients, once more with scale_dQ/dK/dV =
    max / Amax. ``ins``: "q", "k", "v" (E4M3 codes [B, H(kv), N, D]), "dO" (``do_fmt`` codes), and
    floats "descale_q/k/v/dO", "scale_s", "descale_s". ``graphs``: the module or object holding
    ``build_train_forward``, ``run_train_forward``, ``build_backward``, ``run_backward`` (None: this
    module, the cuDNN library; ``EmulatedGraphs`` in tests and dry runs).

    Returns {"o_raw", "stats", "dq_raw", "dk_raw", "dv_raw" (as written), "scalars" (every scale,
    with "scale_o"), "amax" (what each call reported)}; ``decode`` turns raw outputs into values."""
    kc = graphs if graphs is not None else __import__(__name__, fromlist=["_"])
    dev = ins["q"].device
    b, h, n, d = ins["q"].shape
    hkv = ins["k"].shape[1]
    fwd = kc.build_train_forward(dev, b, h, hkv, n, d, causal, scale)
    fins = {x: ins[x] for x in "qkv"}
    fins.update({name: _one(ins[name], dev) for name in ("descale_q", "descale_k", "descale_v", "descale_s",
                                                          "scale_s")})
    first = kc.run_train_forward(fwd, fins, 1.0)
    descale_o = _f32(first["amax_o"] / FMT_MAX["e4m3"]) if first["amax_o"] > 0 else 1.0
    scale_o = _f32(1.0 / descale_o)
    res = kc.run_train_forward(fwd, fins, scale_o)
    bwd = kc.build_backward(dev, b, h, hkv, n, d, causal, scale, do_fmt, grad_fmt)
    bins = {"q": ins["q"], "k": ins["k"], "v": ins["v"], "o": res["o"], "dO": ins["dO"], "stats": res["stats"]}
    sc = {"descale_q": ins["descale_q"], "descale_k": ins["descale_k"], "descale_v": ins["descale_v"],
          "descale_o": descale_o, "descale_dO": ins["descale_dO"], "descale_s": ins["descale_s"],
          "scale_s": ins["scale_s"], "descale_dP": 1.0, "scale_dP": 1.0, "scale_dQ": 1.0, "scale_dK": 1.0,
          "scale_dV": 1.0}
    calls = [kc.run_backward(bwd, bins, dict(sc))]
    amax_dp = calls[0]["amax_dP"]
    sc["scale_dP"] = _f32(FMT_MAX[do_fmt] / amax_dp) if amax_dp > 0 else 1.0
    sc["descale_dP"] = _f32(1.0 / sc["scale_dP"])
    calls.append(kc.run_backward(bwd, bins, dict(sc)))
    if grad_fmt != "bf16":
        for g in ("dQ", "dK", "dV"):
            a = calls[-1][f"amax_{g}"]
            sc[f"scale_{g}"] = _f32(FMT_MAX[grad_fmt] / a) if a > 0 else 1.0
        calls.append(kc.run_backward(bwd, bins, dict(sc)))
    last = calls[-1]
    return {"o_raw": res["o"], "stats": res["stats"], "dq_raw": last["dq"], "dk_raw": last["dk"],
            "dv_raw": last["dv"], "scalars": {**sc, "scale_o": scale_o},
            "amax": {"fwd_first": {"amax_s": first["amax_s"], "amax_o": first["amax_o"]},
                     "fwd": {"amax_s": res["amax_s"], "amax_o": res["amax_o"]},
                     "bwd": [{k: c[k] for k in c if k.startswith("amax")} for c in calls]}}


def decode(raw: torch.Tensor, scale: float) -> torch.Tensor:
    """A tensor cuDNN wrote (FP8 codes of x * ``scale``, or BF16 x unscaled) as float64 x."""
    x = raw.to(torch.float32).to(torch.float64)
    return x if raw.dtype == torch.bfloat16 else x / scale


def per_tensor_fp8(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, float]:
    """(codes in ``fmt``'s torch dtype, descale): descale = amax / max in float64 rounded to float32
    (``quant.amax_to_scale``, as the forward's Q, K, V), codes the saturating cast of x / descale."""
    from fa3_numerics.numerics.formats import cast, get_format
    from fa3_numerics.numerics.quant import amax_to_scale

    descale = amax_to_scale(x.abs().amax(), get_format(fmt))
    return cast(x.to(torch.float64) / descale.to(torch.float64), fmt), float(descale)


class EmulatedGraphs:
    """The four graph functions of ``fp8_fwd_bwd`` computed by the emulator (its forward, E4M3 O; its
    backward from the O and Stats it is handed, float32 accumulation, dS in the dO format), taking and
    writing what cuDNN takes and writes (FP8 codes, (1, 1, 1, 1) float32 forward descales, outputs times
    their scale, amaxes in true units). Never hardware: it lets the call sequence, the scales and the
    decoding run on a CPU (tests, ``tools/device/cudnn_bwd_h200.py --dry``)."""

    ENGINE = "stand-in (the emulator), not cuDNN"

    @staticmethod
    def recipe(do_fmt: str, grad_fmt: str):
        from fa3_numerics.numerics.recipe import get_recipe

        return dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, acc="fp32", **bwd_formats(do_fmt, grad_fmt),
                                   bwd_acc="fp32")

    @staticmethod
    def build_train_forward(dev, b, h, hkv, n, d, causal, scale):
        return {"causal": causal, "scale": scale}

    @staticmethod
    def run_train_forward(entry, ins, scale_o):
        from fa3_numerics.numerics.backward import run_forward
        from fa3_numerics.numerics.formats import cast

        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s"):
            t = ins[name]
            if not (torch.is_tensor(t) and t.shape == (1, 1, 1, 1) and t.dtype == torch.float32):
                raise TypeError(f"{name} must be a (1, 1, 1, 1) float32 tensor, as cuDNN's graph takes it")
        q, k, v = (ins[x].to(torch.float64) * float(ins[f"descale_{x}"]) for x in "qkv")
        fwd = run_forward(EmulatedGraphs.recipe("e4m3", "e4m3"), q, k, v, causal=entry["causal"],
                          softmax_scale=entry["scale"])
        return {"o": cast(fwd.o * scale_o, "e4m3"), "stats": fwd.lse.unsqueeze(-1).to(torch.float32),
                "amax_s": 1.0, "amax_o": float(fwd.o.abs().amax())}

    @staticmethod
    def build_backward(dev, b, h, hkv, n, d, causal, scale, do_fmt, grad_fmt):
        return {"causal": causal, "scale": scale, "do": do_fmt, "grad": grad_fmt}

    @staticmethod
    def run_backward(entry, ins, sc):
        from fa3_numerics.numerics.backward import Forward, backward_from
        from fa3_numerics.numerics.formats import cast

        q, k, v = (ins[x].to(torch.float64) * sc[f"descale_{x}"] for x in "qkv")
        o = ins["o"].to(torch.float64) * sc["descale_o"]
        do = ins["dO"].to(torch.float64) * sc["descale_dO"]
        r = dataclasses.replace(EmulatedGraphs.recipe(entry["do"], entry["grad"]), bwd_out="fp32")
        gr = backward_from(r, q, k, v, Forward(o, ins["stats"][..., 0]), do, causal=entry["causal"],
                           softmax_scale=entry["scale"])
        out = {"amax_dP": 1.0}
        for g, x in (("dQ", gr.dq), ("dK", gr.dk), ("dV", gr.dv)):
            out[g.lower()] = (x.to(torch.bfloat16) if entry["grad"] == "bf16"
                              else cast(x * sc[f"scale_{g}"], entry["grad"]))
            out[f"amax_{g}"] = float(x.abs().amax())
        return out


def bwd_formats(do_fmt: str, grad_fmt: str) -> dict:
    """The ``bwd.*`` operand formats of cuDNN's FP8 backward with dO (and dS) in ``do_fmt``: Q, K, V,
    O, P in E4M3, gradients written in ``grad_fmt``."""
    pair = lambda a, b: a if a == b else f"{a}:{b}"  # noqa: E731
    g = do_fmt
    return {"bwd_s": "e4m3", "bwd_dv": pair("e4m3", g), "bwd_dp": pair(g, "e4m3"), "bwd_ds": pair(g, "e4m3"),
            "bwd_dq": pair(g, "e4m3"), "bwd_dk": pair(g, "e4m3"), "bwd_out": grad_fmt}
