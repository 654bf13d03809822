"""Validation of the emulated backward against a kernel's backward (``fa3-numerics validate --backward``).

Exposed: ``MODES``, ``backward_recipe``, ``backward_skips``, ``case_tensors``, ``run_backward_validation``,
``BackwardValidationStudy``, ``findings``.

The forward's validation (``studies.validate``) asks whether the emulator computes the kernel's O;
this asks the same of dQ, dK and dV, on the same grids (``small``, ``stress``, a capture's layers)
and with the same fidelity ``F = RMSE(emulator, kernel) / RMSE(kernel, float64)``, bar 0.01. Per
case: float64 Q, K, V drawn as the forward's validation draws them, dO the case's own (a capture
made with ``capture --grads``: the real gradient of a next-token loss) or N(0, 1) from
``backward.do_seed(seed)``; the kernel's forward and backward (the backend's ``gradients``); the
reference, float64 autograd of exact attention; and the emulator two ways (``MODES``):

- ``kernel-fwd``: the emulated backward from the kernel's own O and log-sum-exp (where the backend
  returns its LSE): the backward's arithmetic alone, what a backward preset claims;
- ``end-to-end``: the emulator's own forward, then its backward: what a user of the preset gets,
  the forward's misses carried into the gradients.

The backward needs every query row (dK and dV sum over them), so a case's ``rows`` is ignored.
Which recipe the kernel computes is the backend's ``validation_backward_recipe(case)``; shapes it
declines (``validation_backward_skip``, or a refusal raised by the kernel itself) are recorded as
skipped with the kernel's reason, as are cases that repeat another's recipe and inputs on this
kernel and cases with a rotation (a Hadamard pre-pass has no backward in these kernels' paths).
Each finished case is kept in ``OUT/.cells``, so an interrupted run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable

import numpy as np

from ..engine.study import Study, StudyContext
from ..errors import KernelDeclined, UsageError, require
from .stored import StoredFindings
from .validate import F_AIM, F_LIMIT, Case, repeats

MODES = {"kernel-fwd": "the emulated backward from the kernel's own O and LSE",
         "end-to-end": "the emulator's own forward, then its backward"}
GRADS = ("o", "dq", "dk", "dv")
STUDY_MODULES = ("fa3_numerics.studies.validate_backward", "fa3_numerics.numerics.backward",
                 "fa3_numerics.numerics.emulator")


def backward_recipe(case: Case, backend):
    """The recipe ``backend`` computes forward and backward for ``case`` (its
    ``validation_backward_recipe``; a backend without one cannot be validated here)."""
    own = getattr(backend, "validation_backward_recipe", None)
    if own is None:
        raise UsageError(f"backend {backend.name!r} has no backward to validate; backends with one: "
                         "cudnn-fp8, sdpa-flash (fa3-numerics backends)")
    return own(case)


def backward_skips(cases: list[Case], backend, max_seqlen: int = 0) -> list[str]:
    """Per case, why it is not run ("" = it runs): a rotation, a length past ``max_seqlen``, the
    backend's ``validation_backward_skip``, or the same recipe and inputs as an earlier case."""
    own = getattr(backend, "validation_backward_skip", None)
    whys = []
    for c in cases:
        why = None
        if c.rot != "none":
            why = f"rot={c.rot}: the rotation is a forward pre-pass; this kernel's backward takes no rotation"
        elif max_seqlen and c.seqlen > max_seqlen:
            why = f"seqlen {c.seqlen} > --max-seqlen {max_seqlen} (the backward runs every query row)"
        elif own is not None:
            why = own(c)
        whys.append(why)
    return repeats(cases, whys, lambda c: backward_recipe(c, backend), ignore=("gran", "dtype", "rows"))


def _per_sample(emu, ker, ref) -> np.ndarray:
    """F per (batch, head) sample of a [B, H, N, D] gradient (dK, dV: per KV head)."""
    from ..numerics.metrics import fidelity

    b, h = ker.shape[:2]
    return np.array([fidelity(emu[i, j], ker[i, j], ref[i, j])["F"] for i in range(b) for j in range(h)])


def case_tensors(c: Case) -> dict:
    """One case's float64 inputs on the CPU as this validation draws them (bit for bit on any machine,
    so device dumps can be re-read offline): {"q", "k", "v", "do", "do_source", "scale", "ref"}, ``ref``
    the float64 autograd reference {"o", "dq", "dk", "dv"}."""
    from ..engine.inputs import DistInputs, check_inputs
    from ..numerics.backward_reference import reference_gradients
    from .backward import incoming

    dist, params = c.data()
    inp = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim, c.seed)
    q, k, v = inp.draw("cpu")
    scale = c.scale or 1.0 / math.sqrt(c.head_dim)
    check_inputs(q, k, v, scale=scale, where=f"validation case {c.name}")
    do, source = incoming(inp, c.seed, q.shape)
    ref = dict(zip(GRADS, reference_gradients(q, k, v, do, causal=c.causal, softmax_scale=scale)))
    return {"q": q, "k": k, "v": v, "do": do, "do_source": source, "scale": scale, "ref": ref}


def _case(c: Case, backend, device: str) -> dict:
    """Every number of one case: {name: array}, for the cell cache."""
    import torch

    from ..numerics.backward import Forward, backward_from, emulate_backward
    from ..numerics.metrics import fidelity

    drawn = case_tensors(c)
    q, k, v, do, source, scale, ref = (drawn[x] for x in ("q", "k", "v", "do", "do_source", "scale", "ref"))
    r = backward_recipe(c, backend)
    on = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)  # noqa: E731
    qd, kd, vd, dod = on(q), on(k), on(v), on(do)
    t0 = time.perf_counter()
    cache: dict = {}  # prepare's quantized inputs, shared by the kernel's path and the emulator's
    ker = backend.gradients(r, qd, kd, vd, dod, causal=c.causal, softmax_scale=scale, rotation_seed=c.seed,
                            cache=cache)
    t_kernel = time.perf_counter() - t0
    emus = {}
    if ker.get("lse") is not None:
        fwd = Forward(ker["o"].to(torch.float64), ker["lse"].to(torch.float32))
        gr = backward_from(r, qd, kd, vd, fwd, dod, causal=c.causal, softmax_scale=scale, rotation_seed=c.seed)
        emus["kernel-fwd"] = {"o": ker["o"], "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
    gr = emulate_backward(r, qd, kd, vd, dod, causal=c.causal, softmax_scale=scale, rotation_seed=c.seed,
                          cache=cache)
    emus["end-to-end"] = {"o": gr.forward.o, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
    nm, ng, ns = len(MODES), len(GRADS), c.batch * c.heads
    out = {k: np.full((nm, ng), np.nan) for k in ("fidelity", "identical", "rmse_emulator", "nonfinite_emulator")}
    out["fidelity_sample"] = np.full((nm, ng, ns), np.nan)
    out["rmse_kernel"], out["nonfinite_kernel"] = np.full(ng, np.nan), np.full(ng, np.nan)
    for gi, g in enumerate(GRADS):
        kg = ker[g].to(torch.float64).cpu()
        out["rmse_kernel"][gi] = float((kg - ref[g]).pow(2).mean().sqrt())
        out["nonfinite_kernel"][gi] = float((~torch.isfinite(kg)).sum())
        for mi, m in enumerate(MODES):
            if m not in emus:
                continue
            eg = emus[m][g].to(torch.float64).cpu()
            fid = fidelity(eg, kg, ref[g])
            out["fidelity"][mi, gi] = fid["F"]
            out["identical"][mi, gi] = fid["identical"]
            out["rmse_emulator"][mi, gi] = float((eg - ref[g]).pow(2).mean().sqrt())
            out["nonfinite_emulator"][mi, gi] = float((~torch.isfinite(eg)).sum())
            per = _per_sample(eg, kg, ref[g])
            out["fidelity_sample"][mi, gi, :per.size] = per
    out["seconds_kernel"] = np.array(t_kernel)
    out["do_source"] = np.array(source)
    out["spec"] = np.array(r.short_str())
    return out


def run_backward_validation(cases: list[Case], *, device: str = "cuda", backend: str = "cudnn-fp8", kernel=None,
                            max_seqlen: int = 0, progress: Callable[[str], None] = print, ctx: StudyContext | None = None):
    """Every case through the kernel's forward and backward and the emulator's (module docstring).
    Returns an xarray Dataset (dims case, mode, grad, sample)."""
    import xarray as xr

    from ..engine.backends import get_backend
    from ..engine.provenance import provenance

    require(len(cases) > 0, "the validation grid is empty")
    name = getattr(kernel, "name", None) or backend
    kernel = kernel or get_backend(name)
    require(getattr(kernel, "backward", False), f"backend {name!r} computes the forward only; backends with a "
            "backward: cudnn-fp8, sdpa-flash (fa3-numerics backends)")
    why = kernel.check(device)
    require(why is None, f"backend {name!r} cannot run: {why}")
    skipped = backward_skips(cases, kernel, max_seqlen)
    for c, skip in zip(cases, skipped):
        if not skip:
            why = kernel.backward_supports(backward_recipe(c, kernel))
            require(why is None, f"case {c.name} cannot run on backend {name!r}: {why}")
    todo = [i for i, s in enumerate(skipped) if not s]
    require(todo, f"every case of the grid is skipped on backend {name!r}: {skipped[0]}")
    store = ctx.cells({"study": "validation-backward", "backend": name}, STUDY_MODULES, backend=name,
                      device=device) if ctx is not None else None
    nc, nm, ng = len(cases), len(MODES), len(GRADS)
    ns = max(c.batch * c.heads for c in cases)
    res: dict[int, dict] = {}
    t_start = time.perf_counter()
    for step, i in enumerate(todo):
        c = cases[i]
        key = store.key({"case": dataclasses.asdict(c)}) if store is not None else None
        got = store.get(key) if store is not None else None
        t = time.perf_counter()
        if got is None:
            try:
                got = _case(c, kernel, device)
            except KernelDeclined as exc:  # the kernel declines this shape: recorded, the others still run
                skipped[i] = f"the kernel declines it: {str(exc).splitlines()[0]}"
                progress(f"[validate --backward {step + 1}/{len(todo)}] {c.name}: skipped: {skipped[i]}")
                continue
            if store is not None:
                store.put(key, got)
        res[i] = got
        f = got["fidelity"]
        progress(f"[validate --backward {step + 1}/{len(todo)}] {c.name} ({time.perf_counter() - t:.1f} s): "
                 + "; ".join(f"{m} F " + " ".join(f"{g} {f[mi, gi]:.4f}" for gi, g in enumerate(GRADS))
                             for mi, m in enumerate(MODES) if np.isfinite(f[mi]).any()))
    nan = lambda *shape: np.full(shape, np.nan)  # noqa: E731
    v = {k: nan(nc, nm, ng) for k in ("fidelity", "identical", "rmse_emulator", "nonfinite_emulator")}
    v["fidelity_sample"] = nan(nc, nm, ng, ns)
    v.update({k: nan(nc, ng) for k in ("rmse_kernel", "nonfinite_kernel")})
    v["seconds_kernel"] = nan(nc)
    do_source, spec = [""] * nc, [""] * nc
    for i, got in res.items():
        for k in ("fidelity", "identical", "rmse_emulator", "nonfinite_emulator", "rmse_kernel", "nonfinite_kernel",
                  "seconds_kernel"):
            v[k][i] = got[k]
        v["fidelity_sample"][i, :, :, :got["fidelity_sample"].shape[-1]] = got["fidelity_sample"]
        do_source[i], spec[i] = str(got["do_source"]), str(got["spec"])
    desc = {
        "fidelity": "RMSE(emulator, kernel) / RMSE(kernel, float64), over outputs finite in all three",
        "identical": "fraction of outputs bit-identical to the kernel's",
        "rmse_emulator": "RMSE(emulator, float64)",
        "nonfinite_emulator": "count of non-finite emulator outputs",
        "fidelity_sample": "F per (batch, head) sample (dK, dV: per KV head); sample = batch * heads + head",
        "rmse_kernel": "RMSE(kernel, float64)",
        "nonfinite_kernel": "count of non-finite kernel outputs",
        "seconds_kernel": "wall time of the kernel's forward and backward for the case",
    }
    dims = {"fidelity": ("case", "mode", "grad"), "identical": ("case", "mode", "grad"),
            "rmse_emulator": ("case", "mode", "grad"), "nonfinite_emulator": ("case", "mode", "grad"),
            "fidelity_sample": ("case", "mode", "grad", "sample"), "rmse_kernel": ("case", "grad"),
            "nonfinite_kernel": ("case", "grad"), "seconds_kernel": ("case",)}
    coords = {"case": [c.name for c in cases], "mode": list(MODES), "grad": list(GRADS), "sample": np.arange(ns)}
    for fld in dataclasses.fields(Case):
        if fld.name in ("params", "rows"):
            continue
        vals = [getattr(c, fld.name) for c in cases]
        coords[fld.name] = ("case", [int(x) for x in vals] if isinstance(vals[0], bool) else vals)
    coords["params"] = ("case", [",".join(f"{k}={x:g}" for k, x in c.params) for c in cases])
    coords["skipped"] = ("case", skipped)
    coords["spec"] = ("case", spec)
    coords["do_source"] = ("case", do_source)
    ds = xr.Dataset({k: (dims[k], a, {"description": desc[k]}) for k, a in v.items()}, coords=coords)
    attrs = provenance(device)
    attrs.update({"kind": "validation-backward", "backend": name,
                  "kernel_hardware": int(bool(getattr(kernel, "hardware", False))),
                  "f_limit": F_LIMIT, "f_aim": F_AIM, "modes": json.dumps(MODES),
                  "wall_seconds": round(time.perf_counter() - t_start, 3),
                  "cases_skipped": sum(bool(x) for x in skipped), "max_seqlen": int(max_seqlen),
                  "rows": "every query row (the backward needs them all; a case's rows is ignored)",
                  "rotation_seed": "case seed", "data_seed": "case seed (torch.Generator on CPU, float64)",
                  "do_seed": "seed * 1000003 + 29 (N(0, 1)) unless the case's data holds dO (do_source)"})
    try:  # provenance only: the kernel module and version, from the backend itself
        attrs.update(getattr(kernel, "provenance", dict)())
    except Exception:  # noqa: BLE001
        pass
    ds.attrs.update({k: (x if isinstance(x, (str, int, float)) else json.dumps(x)) for k, x in attrs.items()})
    ds.attrs["findings"] = json.dumps(summary(ds))
    return ds


def summary(ds) -> dict:
    """Per mode and gradient over the cases run: max and median F, the cases above the bar."""
    out = {}
    for m in ds["mode"].values:
        row = {}
        for g in ds["grad"].values:
            f = ds["fidelity"].sel(mode=m, grad=g).values
            run = np.isfinite(f)
            if not run.any():
                continue
            above = [str(c) for c, x in zip(ds["case"].values, f) if np.isfinite(x) and x > F_LIMIT]
            row[str(g)] = {"max": float(f[run].max()), "median": float(np.median(f[run])), "cases": int(run.sum()),
                           "above": above, "worst": str(ds["case"].values[int(np.nanargmax(f))])}
        if row:
            out[str(m)] = row
    return out


def findings(ds) -> list[str]:
    """One line per case and mode with non-finite outputs, the kernel's or the emulator's."""
    out = []
    for i, c in enumerate(ds["case"].values):
        k = ds["nonfinite_kernel"].values[i]
        if np.nansum(k) > 0:
            out.append(f"non-finite kernel outputs in case {c!r}: "
                       + ", ".join(f"{g} {int(x)}" for g, x in zip(ds["grad"].values, k) if x > 0))
        for mi, m in enumerate(ds["mode"].values):
            e = ds["nonfinite_emulator"].values[i, mi]
            if np.nansum(e) > 0:
                out.append(f"non-finite emulator outputs ({m}) in case {c!r}: "
                           + ", ".join(f"{g} {int(x)}" for g, x in zip(ds["grad"].values, e) if x > 0))
    return out


class BackwardValidationStudy(Study):
    """``fa3-numerics validate --backward`` on the ``engine.study`` protocol; the dataset is
    ``validation_backward.nc``."""

    kind = "validation-backward"
    stem = "validation_backward"

    def __init__(self, cases: list[Case], *, device: str, backend: str, kernel, max_seqlen: int = 0):
        self.cases, self.device, self.backend, self.kernel, self.max_seqlen = cases, device, backend, kernel, max_seqlen

    def describe(self) -> str:
        return f"validate --backward: {len(self.cases)} case(s), backend {self.backend} on {self.device}"

    def run(self, ctx):
        return run_backward_validation(self.cases, device=self.device, backend=self.backend, kernel=self.kernel,
                                       max_seqlen=self.max_seqlen, progress=ctx.echo, ctx=ctx)

    def assemble(self, ds):
        return ds

    def nonfinite(self, ds) -> list:
        return findings(ds)


__all__ = ["MODES", "backward_recipe", "backward_skips", "run_backward_validation", "summary", "findings",
           "BackwardValidationStudy"]
