"""`run backward`: the error of dQ, dK, dV under a recipe's forward and backward, and which product causes it.

Exposed: ``STAGES``, ``stage_recipe``, ``exact_backward``, ``BackwardStudy``, ``load_study``, ``compute``,
``GRADS``, ``DO_SEED``, ``incoming``, ``SYNTHETIC_DO``, ``check_gradient_backend``.

Definition: a distribution of the registry, a shape (every query row: dK and dV sum over all of
them), variants (default: the backward presets, ``recipe.BACKWARD_PRESETS``) and seeds, as
``run outliers`` defines them (``studies.outliers.Experiment``). The incoming gradient dO is the
distribution's own where it has one (a capture made with ``capture --grads``, through
``capture-file:`` or ``captured:``: the real gradient of a next-token loss), else drawn N(0, 1)
from its own generator (``DO_SEED``); the dataset's ``do_source`` says which. Per (cell, seed,
variant): the recipe's forward over every row, its backward from that forward's O and LSE
(``numerics.backward``, or ``--backend``'s ``gradients``: a kernel with a backward, such as
``cudnn-fp8``), and every registered metric of O, dQ, dK, dV against float64 autograd of exact
attention (``numerics.backward_reference``).

Attribution (``STAGES``): the same inputs through recipes that keep one part of the variant in low
precision and everything else exact: ``fwd`` (the forward's O and LSE, the backward exact),
one stage per backward product (its two operands in the variant's formats, at the variant's scale
granularity, accumulator, tiles and rotation; the forward and every other product exact), ``out``
(the gradients' output format alone), and ``exact`` (the emulator's float32 floor). A stage's share
of a gradient's error is its MSE over the sum of the stage MSEs (``stage_shares``). ``fwd`` and
``s`` alone each pair a log-sum-exp with scores it was not computed from (P then does not sum to
1); a recipe whose forward and backward quantize Q and K alike cancels that, which ``fwd+s``
(both together) measures and the additivity ratio (full MSE / sum of stage MSEs below 1) shows.

Dataset: variables ``{grad}_{metric}`` for grad in o, dq, dk, dv, dims (*swept, variant, stage,
seed, batch, head) (``kv_head`` for dk, dv), stage ``full`` being the variant itself; ``spec``
per variant and ``stage_spec`` per (variant, stage); provenance attrs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time

import numpy as np
import torch

from ..engine.cache import dist_key
from ..engine.inputs import DistInputs, check_inputs
from ..engine.provenance import provenance
from ..engine.sampling import deterministic_matmuls
from ..engine.study import Study, StudyContext, StudyOption
from ..numerics.backward_reference import reference_gradients
from ..numerics.keys.backward import PRODUCTS
from ..numerics.metrics import METRICS, per_sample
from ..numerics.recipe import BACKWARD_PRESETS, Recipe
from .stored import StoredFindings
from .attribution import exact_recipe
from .outliers import Experiment

GRADS = ("o", "dq", "dk", "dv")
GRAD_NAMES = {"o": "O (forward)", "dq": "dQ", "dk": "dK", "dv": "dV"}
DO_SEED = "seed * 1000003 + 29"
_PRODUCT_FIELDS = {k.split(".", 1)[1]: k.replace(".", "_") for k in PRODUCTS}
STAGES = {
    "fwd": "the forward's O and LSE (backward exact)",
    **{name: f"{PRODUCTS[f'bwd.{name}'][0]} alone" for name in _PRODUCT_FIELDS},
    "out": "gradients written in bwd.out alone",
    # the forward's LSE and the recomputed S together: consistent when both quantize Q and K alike
    "fwd+s": "the forward and the S recompute together (the rest of the backward exact)",
}
# stages whose MSEs are summed for the shares: each part of the recipe exactly once
SHARE_STAGES = tuple(s for s in STAGES if s != "fwd+s")
_EXACT_BWD = {**{f: "fp32" for f in _PRODUCT_FIELDS.values()}, "bwd_out": "fp32", "bwd_acc": "fp32", "bwd_rot": "none"}


def do_seed(seed: int) -> int:
    return seed * 1000003 + 29


def exact_backward(r: Recipe) -> Recipe:
    """R's forward with the exact (float32) backward."""
    return dataclasses.replace(r, **_EXACT_BWD)


def stage_recipe(r: Recipe, stage: str) -> Recipe:
    """R with only ``stage`` in low precision (module docstring); ``exact``: nothing."""
    base = exact_backward(exact_recipe(r))
    if stage == "exact":
        return base
    if stage == "fwd":
        return exact_backward(r)
    if stage == "out":
        return dataclasses.replace(base, bwd_out=r.bwd_out)
    if stage == "fwd+s":
        return dataclasses.replace(exact_backward(r), bwd_s=r.bwd_s, bwd_acc=r.bwd_acc, bwd_rot=r.bwd_rot)
    if stage not in _PRODUCT_FIELDS:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}, exact")
    f = _PRODUCT_FIELDS[stage]
    return dataclasses.replace(base, **{f: getattr(r, f)}, bwd_acc=r.bwd_acc, bwd_rot=r.bwd_rot)


SHAPE = dict(seqlen=[1024], head_dim=[128], causal=[False], batch=1, heads=4, kv_heads=0, seeds=[0])
STUDY_MODULES = ("fa3_numerics.studies.backward", "fa3_numerics.studies.attribution",
                 "fa3_numerics.studies.outliers")


class BackwardStudy(StoredFindings, Study):
    """The study (module docstring) on the ``engine.study`` protocol. Its command (``run
    backward``) is made from ``options`` by the command line; each (cell, seed) is one cached
    unit, so an interrupted run resumes."""

    kind = "backward"
    stem = "backward"
    command = "run backward"
    help = ("Gradient error (dQ, dK, dV, beside the forward's O) of backward presets against float64 autograd, "
            "with the error of each backward product measured alone. Every query row is computed (dK and dV sum "
            "over all of them); dO is drawn N(0, 1) from the seed. Writes OUT/backward.nc and OUT/report.md; "
            "finished (cell, seed) units are kept in OUT/.cells, so a rerun resumes.")
    dist_options = True
    options = (
        StudyOption("seqlen", int, "sequence length (queries = keys); a comma list sweeps", 1024, many=True),
        StudyOption("head_dim", int, "head dim: 64, 96, 128, 192 or 256; a comma list sweeps", 128, many=True),
        StudyOption("batch", int, "batch size (samples)", 1),
        StudyOption("heads", int, "query heads (samples)", 4),
        StudyOption("kv_heads", int, "K/V heads for grouped-query attention (0 = same as heads)", 0),
        StudyOption("seeds", int, "seeds, comma separated; each is one draw of Q, K, V and dO", 0, many=True),
        StudyOption("causal", bool, "causal masking; 'true,false' sweeps", False, many=True),
        StudyOption("variants", str, "presets or recipe specs with bwd.* keys: comma-separated presets, ';' "
                    "between specs", ", ".join(BACKWARD_PRESETS)),
        StudyOption("dist", str, "input distribution (see `fa3-numerics run outliers --help`)", "outliers"),
        StudyOption("attribution", bool, "also run each stage alone in low precision (fwd, s, dv, dp, ds, dq, dk, "
                    "out, fwd+s, exact): about 10x the runs", True),
        StudyOption("backend", str, "what computes each variant's forward and backward: emulate, or a backend "
                    "`fa3-numerics backends` marks fwd+bwd (a kernel: with --no-attribution)", "emulate"),
        StudyOption("device", str, "cpu or cuda[:N] (where the backend runs; the reference is float64 on the CPU)",
                    "cpu"),
        StudyOption("do", str, "incoming gradient: auto (the distribution's own where it has one, a capture made "
                    "with --grads; else synthetic) or synthetic (N(0, 1) from the seed, always)", "auto"),
    )
    examples = (
        "fa3-numerics run backward                                    # backward presets, outliers, seqlen 1024",
        "fa3-numerics run backward --dist k-bias --causal true,false --out results/bwd-kbias",
        "fa3-numerics run backward --variants 'fa3-fp8-bwd-bf16;cudnn-fp8,bwd.gran=head' --no-attribution",
        "fa3-numerics run backward --dist capture-file:grads.safetensors --layer 3 --seqlen 256 --head-dim 64 "
        "--heads 9 --kv-heads 3      # real dO (capture --grads)",
    )

    def __init__(self, exp: Experiment, attribution: bool = True, backend: str = "emulate", device: str = "cpu",
                 do: str = "auto"):
        self.exp = exp
        self.attribution = attribution
        self.backend = backend
        self.device = device
        self.do = do

    @classmethod
    def from_options(cls, attribution: bool | None = True, **values) -> "BackwardStudy":
        if values.get("variants") is not None:
            values["variants"] = [values["variants"]]
        return load_study(values, True if attribution is None else attribution)

    def stages(self) -> list[str]:
        return ["full", *STAGES, "exact"] if self.attribution else ["full"]

    def describe(self) -> str:
        exp = self.exp
        return (f"backward: {len(exp.cells())} cell(s) x {len(exp.seeds)} seed(s) x {len(exp.recipes)} variant(s) "
                f"x {len(self.stages())} stage(s)")

    def run(self, ctx: StudyContext | None) -> "Results":
        store = None
        if ctx is not None:
            store = ctx.cells({"study": "backward", "dist": self.exp.dist, "batch": self.exp.batch,
                               "heads": self.exp.heads, "kv_heads": self.exp.kv_heads,
                               "inputs": dist_key(self.exp.dist), "do": self.do}, STUDY_MODULES,
                              backend=self.backend,
                              device=self.device)
        return compute(self, progress=ctx.echo if ctx is not None else (lambda m: None), store=store)

    def assemble(self, results: "Results"):
        return results.dataset()

    def nonfinite(self, ds) -> list:
        from ..engine.nonfinite import scan_counts

        found = []
        for g in GRADS:
            counts = ds[f"{g}_nonfinite"].sel(stage="full")
            found += [f"{g}: {f.line()}" for f in scan_counts(counts, ("batch", "head", "kv_head"))]
        return found


def load_study(overrides: dict, attribution: bool = True) -> BackwardStudy:
    """An ``Experiment`` (every check of ``run outliers``) over every query row."""
    kw = {k: v for k, v in overrides.items() if v is not None}
    backend = kw.pop("backend", None) or "emulate"
    device = kw.pop("device", None) or "cpu"
    do = kw.pop("do", None) or "auto"
    from ..errors import require

    require(do in ("auto", "synthetic"), f"--do {do!r}: use auto (a capture's own dO where it has one) or synthetic")
    dist = kw.pop("dist", None) or "outliers"
    variants = kw.pop("variants", None) or [",".join(BACKWARD_PRESETS)]
    from ..data.dist_spec import parse_dist

    family = parse_dist(dist).entry
    params = {k: kw.pop(k) for k in list(kw) if k in family.params}
    shape = dict(SHAPE)
    shape.update({k: v for k, v in kw.items() if k in shape})
    exp = Experiment(name="backward", description="gradient error of low-precision attention backward passes",
                     dist=dist, variants=variants, params={k: list(v) for k, v in params.items()}, rows=0,
                     **shape)
    check_gradient_backend(backend, device, exp.recipes, attribution)
    return BackwardStudy(exp, attribution, backend, device, do)


def check_gradient_backend(name: str, device: str, recipes, attribution: bool) -> None:
    """UsageError (one line with the fix) unless backend ``name`` computes every recipe's backward on
    ``device``; a kernel computes the variants themselves, not the attribution's emulated stages."""
    from ..engine.backends import backward_refusal, check_device, get_backend
    from ..errors import require

    check_device(device)
    b = get_backend(name)
    why = b.check(device)
    require(why is None, f"backend {name!r} cannot run: {why}")
    require(getattr(b, "backward", False), f"backend {name!r} computes the forward only; `fa3-numerics backends` marks the fwd+bwd "
            "ones (emulate, cudnn-fp8)")
    require(name == "emulate" or not attribution, f"--backend {name} computes the variants, not the attribution's "
            "emulated stages: add --no-attribution (or run the attribution with --backend emulate)")
    for label, r in recipes:
        why = backward_refusal(b, r)
        require(why is None, f"variant {label!r} cannot run on backend {name!r}: {why}")


@dataclasses.dataclass
class Results:
    study: BackwardStudy
    out: dict  # "{grad}_{metric}" -> [cell, variant, stage, seed, batch, heads or kv_heads]
    stage_specs: list  # [variant][stage] -> spec
    wall: float
    attrs: dict
    reused: int = 0

    def dataset(self):
        return _assemble(self)


def compute(study: BackwardStudy, progress=lambda m: None, store=None) -> Results:
    """Every (cell, seed, variant, stage) of the study (identical stage recipes run once per input);
    with ``store`` (an ``engine.cache.CellStore``) each finished (cell, seed) is kept and reused."""
    deterministic_matmuls()
    exp = study.exp
    cells, stages = exp.cells(), study.stages()
    hkv = exp.kv_heads or exp.heads
    heads = {"o": exp.heads, "dq": exp.heads, "dk": hkv, "dv": hkv}
    out = {f"{g}_{m}": np.full((len(cells), len(exp.recipes), len(stages), len(exp.seeds), exp.batch, heads[g]),
                               np.nan) for g in GRADS for m in METRICS}
    specs = [[(r if s == "full" else stage_recipe(r, s)).spec() for s in stages] for _, r in exp.recipes]
    t0 = time.perf_counter()
    reused = 0
    sources: set = set()
    for ci, si in itertools.product(range(len(cells)), range(len(exp.seeds))):
        cell, seed = cells[ci], exp.seeds[si]
        where = ", ".join(f"{kk}={cell[kk]}" for kk in exp.swept_dims()) or "single cell"
        key = store.key({"cell": cell, "seed": seed, "specs": specs, "metrics": sorted(METRICS)}) if store else None
        got = store.get(key) if store is not None else None
        if got is not None and all(name in got and got[name].shape == out[name][ci, :, :, si].shape for name in out):
            for name in out:
                out[name][ci, :, :, si] = got[name]
            reused += 1
            progress(f"{where}, seed {seed}: from cache")
            continue
        sources.add(_compute_cell(study, cell, seed, stages, specs, ci, si, out, progress, where))
        if store is not None:
            store.put(key, {name: out[name][ci, :, :, si] for name in out})
    attrs = provenance(study.device)
    if study.backend != "emulate":
        from ..engine.backends import get_backend

        attrs.update(get_backend(study.backend).provenance())
    attrs["do_source"] = "; ".join(sorted(sources)) if sources else do_source(study.exp, study.do)
    return Results(study, out, specs, time.perf_counter() - t0, attrs, reused)


SYNTHETIC_DO = f"synthetic: N(0, 1) from torch.Generator().manual_seed({DO_SEED}), float64"


def incoming(inp: DistInputs, seed: int, shape, do: str = "auto") -> tuple[torch.Tensor, str]:
    """dO for the inputs ``inp`` draws: with ``do="auto"`` the distribution's own (a capture with
    gradients), else (or with ``"synthetic"``) N(0, 1) from ``do_seed(seed)``; and where it comes from."""
    from ..data import distributions

    dims = distributions.AttnShape(inp.batch, inp.heads, inp.seqlen, inp.head_dim, kv_heads=inp.kv_heads)
    real = None if do == "synthetic" else distributions.incoming_gradient(inp.dist, dims, seed, **dict(inp.params))
    if real is not None:
        do, source = real
        if tuple(do.shape) != tuple(shape):
            raise ValueError(f"{inp.describe()}: dO {tuple(do.shape)} does not match Q {tuple(shape)}")
        return do.to(torch.float64), source
    g = torch.Generator().manual_seed(do_seed(seed))
    return torch.randn(shape, generator=g, dtype=torch.float64), SYNTHETIC_DO


def do_source(exp, do: str = "auto") -> str:
    """Where a study's dO comes from, without drawing anything (cached runs): the first cell's answer."""
    hkv = exp.kv_heads or exp.heads
    cell = exp.cells()[0]
    inp = DistInputs(exp.dist, tuple((k, cell[k]) for k in exp.params), exp.batch, exp.heads, hkv, cell["seqlen"],
                     cell["head_dim"], exp.seeds[0])
    return incoming(inp, exp.seeds[0], (exp.batch, exp.heads, cell["seqlen"], cell["head_dim"]), do)[1]


def _compute_cell(study, cell, seed, stages, specs, ci, si, out, progress, where) -> str:
    from ..engine.backends import get_backend

    exp = study.exp
    hkv = exp.kv_heads or exp.heads
    params = tuple((k, cell[k]) for k in exp.params)
    inp = DistInputs(exp.dist, params, exp.batch, exp.heads, hkv, cell["seqlen"], cell["head_dim"], seed)
    q, k, v = inp.draw("cpu")
    scale = 1.0 / math.sqrt(cell["head_dim"])
    check_inputs(q, k, v, scale=scale, where=f"{inp.describe()}, {where}, seed {seed}")
    do, source = incoming(inp, seed, q.shape, study.do)
    ref = dict(zip(GRADS, reference_gradients(q, k, v, do, causal=cell["causal"], softmax_scale=scale)))
    backend = get_backend(study.backend)
    dev = study.device
    on = (lambda t: t.to(dev)) if dev != "cpu" else (lambda t: t)  # noqa: E731
    done: dict = {}
    cache: dict = {}
    for vi, (label, r) in enumerate(exp.recipes):
        for sti, stage in enumerate(stages):
            spec = specs[vi][sti]
            if spec not in done:
                rr = r if stage == "full" else stage_recipe(r, stage)
                got = backend.gradients(rr, on(q), on(k), on(v), on(do), causal=cell["causal"], softmax_scale=scale,
                                        rotation_seed=seed, cache=cache)
                done[spec] = {gname: per_sample(got[gname].cpu(), ref[gname]) for gname in GRADS}
            for gname in GRADS:
                for m, val in done[spec][gname].items():
                    out[f"{gname}_{m}"][ci, vi, sti, si] = val
        progress(f"{where}, seed {seed}: {label} ({len(done)} backward runs so far)")
    return source


def _assemble(res: Results):
    import xarray as xr

    from ..engine.conventions import apply_conventions

    study, exp = res.study, res.study.exp
    sw = exp.sweeps()
    dims_sw = exp.swept_dims()
    shape_sw = [len(sw[d]) for d in dims_sw]
    hkv = exp.kv_heads or exp.heads
    data = {}
    for name, arr in res.out.items():
        g, m = name.split("_", 1)
        head_dim_name = "kv_head" if g in ("dk", "dv") else "head"
        dims = dims_sw + ["variant", "stage", "seed", "batch", head_dim_name]
        data[name] = (dims, arr.reshape(shape_sw + list(arr.shape[1:])),
                      {"description": f"{METRICS.get(m, m)}, of {GRAD_NAMES[g]} against float64 autograd"})
    coords = {d: sw[d] for d in dims_sw}
    coords.update({
        "variant": [l for l, _ in exp.recipes], "stage": study.stages(), "seed": exp.seeds,
        "batch": np.arange(exp.batch), "head": np.arange(exp.heads), "kv_head": np.arange(hkv),
        "spec": ("variant", [r.spec() for _, r in exp.recipes]),
        "stage_spec": (("variant", "stage"), np.array(res.stage_specs, dtype=object).astype(str)),
    })
    for k, v in sw.items():
        if k not in dims_sw:
            coords[k] = v[0]
    coords.update({"heads": exp.heads, "kv_heads": hkv, "batch_size": exp.batch})
    attrs = dict(res.attrs)
    attrs.update({
        "format": "fa3-numerics-backward/1", "kind": "backward", "experiment": "backward", "dist": exp.dist,
        "description": exp.description, "backend": study.backend, "seeds": json.dumps(exp.seeds),
        "rows_sampling": "every query row", "rotation_seed": "seed",
        "do_seed": (f"torch.randn from manual_seed({DO_SEED})" if res.attrs.get("do_source") == SYNTHETIC_DO
                    else "none: dO is the distribution's own (do_source)"),
        "data_seed": "seed (torch.Generator on CPU, float64)", "wall_seconds": round(res.wall, 3),
        "cells_reused": res.reused,
        "reference": "float64 autograd of exact attention (numerics.backward_reference)",
        "stages": json.dumps({"full": "the variant", **STAGES, "exact": "every part exact (float32 floor)"}),
    })
    ds = xr.Dataset(data, coords=coords, attrs={k: (v if isinstance(v, (str, int, float)) else json.dumps(v))
                                                 for k, v in attrs.items()})
    from .backward_findings import with_findings

    return with_findings(apply_conventions(ds))


def stage_shares(ds, grad: str, variant: str) -> dict[str, float]:
    """Share of ``grad``'s summed stage MSE per stage (pooled over samples and cells), and the
    additivity ratio (full MSE / sum of stage MSEs) under key ``"additivity"``."""
    rmse = ds[f"{grad}_rmse"].sel(variant=variant)
    mse = {s: float(np.nanmean(rmse.sel(stage=s).values ** 2)) for s in SHARE_STAGES}
    total = sum(mse.values())
    out = {s: (m / total if total > 0 else math.nan) for s, m in mse.items()}
    out["additivity"] = float(np.nanmean(rmse.sel(stage="full").values ** 2)) / total if total > 0 else math.nan
    return out


__all__ = ["STAGES", "stage_recipe", "exact_backward", "BackwardStudy", "load_study", "compute", "Results", "GRADS",
           "DO_SEED", "stage_shares", "SHARE_STAGES", "incoming", "SYNTHETIC_DO", "check_gradient_backend"]
