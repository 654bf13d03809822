"""The factorial ablation: recipe factors x data x shape, as data (experiments/ablation.toml).

Exposed: ``FACTORS``, ``DEFAULT_LEVEL`` (both read live from the factor registry,
``fa3_numerics.numerics.keys``), ``DataItem``, ``Design``, ``Ablation``, ``load_ablation``,
``run_ablation``, ``tasks``, ``factor_recipe``, ``variant_label``, ``with_tiles``,
``capture_item`` (a capture file's recorded Q, K, V as data, through the ``capture-file:``
distribution).

Recipe factors and their levels, as registered (each level is a recipe fragment over the public FA3 FP8
kernel's recipe ``fa3-fp8-kernel``: flash, e4m3, per-head scales, no rotation, P offset 8,
BF16 output; every variant sets every factor, so the accumulator is the ``acc`` level, fp32
unless a design crosses it):

- ``gran``: scale granularity of Q, K, V: tensor, head, block (the kernel's tiles), blockN
  (N-token tiles), token;
- ``rot``: none, hadamard (random Hadamard), orthogonal (Haar-random);
- ``p``: offset8 (P~ in [0, 2^8], as FA3), no-offset (P in [0, 1]), scale448 (offset
  log2(448) = 8.80735, so P~ fills the e4m3 range);
- ``acc``: fp32, fp22 (the Hopper FP8 MMA model on both GEMMs), two-level (MMA model within a
  tile, float32 across tiles); the MMA model costs ~100x a float32 GEMM on a CPU;
- ``fmt``: e4m3 (Q, K, V, P all e4m3), v-e5m2, p-e5m2, vp-e5m2;
- ``scale``: amax (descale = amax / fmt max, so each scale group's largest value is exact)
  or pow2 (descale rounded up to a power of two, as the paper's FA3 FP8 presets use).

A factor registered by a recipe-key module (``register_factor``) becomes an axis here, a
``run ablation`` option and a column of the report without touching this file.

A *design* is a full factorial over some factors (the others at their default level), on
a subset of the data and shapes (seqlen, head_dim, causal); the ablation is the union of its designs, so
costly factors (FP22 accumulators) can be crossed with fewer levels. The data are
distributions with parameters (lists expand), e.g. the paper's outliers over p and sigma
and the structured families, plus an optional capture file.

Dataset: dims (data, seqlen, head_dim, causal, variant, seed, batch, head); the variant
dim holds the full recipes (``stage`` = "full", with coords ``gran``, ``rot``, ``p``,
``acc``, ``fmt``, ``scale`` giving their levels) and the single-stage recipes of the error
attribution (``fa3_numerics.studies.attribution``; ``stage`` = qk, p, v, acc, out, exact), with
``stage_of_<s>`` mapping each full variant to its stage variant. A (data, cell, variant)
that no design asks for is NaN. Every recipe runs at the FP8 kernel's tiles for its head
dim (stage recipes too, so that blocks and tile order match the full recipe).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..data import distributions
from ..data.distributions.capture_file import _capture, capture_info
from ..engine.cache import cache_key
from ..engine.checks import check_backend, check_distinct, check_shape
from ..engine.dataset import results_dataset
from ..engine.distributed import default_workers
from ..engine.inputs import HIST_EDGES, DistInputs
from ..engine.provenance import provenance
from ..engine.runner import Job, Task, run_tasks
from ..engine.sampling import ROWS_SAMPLING
from ..engine.study import Study
from ..errors import require
from ..numerics.keys import factors
from ..numerics.metrics import METRICS
from ..numerics.recipe import Recipe
from ..numerics.tiles import fa3_tiles
from .stored import StoredFindings
from .attribution import STAGES, exact_recipe, stage_label, stage_recipe
from .outliers import _progress, read_toml, toml_values

BASE = "fa3-fp8-kernel"
# The FA3 paper's Table 3 data: outliers with p = 0.001, sigma = 10.
PAPER_DATA = {"dist": "outliers", "p": 0.001, "sigma": 10.0}
# Keys of a [[design]] table besides factor names.
DESIGN_KEYS = ("name", "data", "seqlen", "head_dim", "causal")


def __getattr__(name: str):
    # FACTORS and DEFAULT_LEVEL are views of the registry, read when used: a factor registered
    # after this module was imported is still an axis.
    if name == "FACTORS":
        return {n: f.levels for n, f in factors().items()}
    if name == "DEFAULT_LEVEL":
        return {n: f.default for n, f in factors().items()}
    raise AttributeError(name)


def factor_recipe(levels: dict[str, str]) -> Recipe:
    """The base recipe with each factor's level applied; factors must set disjoint keys."""
    reg = factors()
    parts = [BASE]
    owner: dict[str, str] = {}
    for f, lvl in levels.items():
        require(f in reg, f"unknown ablation factor {f!r}; factors: {', '.join(reg)}")
        frag = reg[f].fragment(lvl)
        for part in filter(None, frag.split(",")):
            key = part.split("=", 1)[0].strip()
            require(key not in owner, f"ablation factors {owner.get(key)} and {f} both set recipe key {key}; "
                    "a factor's levels must set keys no other factor sets")
            owner[key] = f
        if frag:
            parts.append(frag)
    return Recipe.from_str(",".join(parts))


# The original six factors are written positionally in variant labels; every factor registered
# later (smooth, qkfmt, vfmt, ...) is appended as ``name=level`` only when not at its default, so
# the labels of recipes that existed before a factor did, in datasets and reports, never change.
POSITIONAL = ("gran", "rot", "p", "acc", "fmt", "scale")


def variant_label(levels: dict[str, str], names: list[str] | None = None) -> str:
    """``gran|rot|p|acc|fmt|scale`` levels (defaults filled in), then ``|name=level`` for any other
    factor (of ``names``, default: the registry's) away from its default."""
    reg = factors()
    names = list(reg) if names is None else names
    fixed = [levels.get(n, reg[n].default if n in reg else "") for n in POSITIONAL if n in names]
    extra = [f"{n}={levels[n]}" for n in names if n not in POSITIONAL and n in levels and n in reg
             and levels[n] != reg[n].default]
    return "|".join(fixed + extra)


@dataclasses.dataclass(frozen=True)
class DataItem:
    label: str
    dist: str
    params: tuple  # ((name, value), ...) in the registry's order

    @property
    def paper(self) -> bool:
        p = dict(self.params)
        return (self.dist == PAPER_DATA["dist"] and np.isclose(p.get("p", -1), PAPER_DATA["p"])
                and np.isclose(p.get("sigma", -1), PAPER_DATA["sigma"]))

    def feasible(self, seqlen: int, head_dim: int) -> bool:
        if self.dist.startswith("capture-file:"):
            tokens, d = capture_info(self.dist.split(":", 1)[1])
            return seqlen <= tokens and head_dim == d
        return True


@dataclasses.dataclass
class Design:
    name: str
    levels: dict[str, list[str]]  # factor -> levels (every factor present)
    data: list[str] | None = None  # data labels; None = all
    seqlen: list[int] | None = None  # None = the run's
    head_dim: list[int] | None = None  # None = the run's
    causal: list[bool] | None = None  # None = the run's

    def variants(self) -> list[dict[str, str]]:
        return [dict(zip(self.levels, combo)) for combo in itertools.product(*self.levels.values())]


@dataclasses.dataclass
class Ablation:
    name: str
    description: str
    data: list[DataItem]
    designs: list[Design]
    seqlen: list[int]
    head_dim: list[int]
    causal: list[bool]
    batch: int = 1
    heads: int = 4
    rows: int = 256
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    attribution: bool = True
    backend: str = "emulate"
    device: str = "cpu"

    def __post_init__(self):
        check_shape(self.seqlen, self.head_dim, self.batch, self.heads, 0, self.rows, self.seeds, self.device)
        require(self.data, "the ablation has no data; give at least one [[data]] entry or --data")
        require(self.designs, "the ablation has no design; give at least one [[design]] entry")
        labels = [d.label for d in self.data]
        require(len(set(labels)) == len(labels), f"data labels repeat: {labels}")
        for des in self.designs:
            for lab in des.data or []:
                require(lab in labels, f"design {des.name!r} names data {lab!r}; data are: {', '.join(labels)}")
        self.full = self._full_variants()
        self.stage_variants, self.stage_of = self._stage_variants()
        check_backend(self.backend, self.device, [(v, r) for v, (r, _) in self.full.items()])

    # -- variants ---------------------------------------------------------------------------
    def _full_variants(self) -> dict[str, tuple[Recipe, dict[str, str]]]:
        out: dict[str, tuple[Recipe, dict[str, str]]] = {}
        for des in self.designs:
            for lv in des.variants():
                label = variant_label(lv)
                if label not in out:
                    out[label] = (factor_recipe(lv), lv)
        return out

    def _stage_variants(self) -> tuple[dict[str, tuple[Recipe, str]], dict[str, dict[str, str]]]:
        if not self.attribution:
            return {}, {}
        # Full recipes count too: the MMA accumulator's stage is measured against the same
        # recipe with a float32 accumulator, which is usually one of the full recipes.
        by_spec: dict[str, str] = {r.spec(): label for label, (r, _) in self.full.items()}
        stages: dict[str, tuple[Recipe, str]] = {}

        def add(stage: str, r: Recipe) -> str:
            spec = r.spec()
            if spec not in by_spec:
                label = stage_label(stage, r)
                by_spec[spec] = label
                stages[label] = (r, stage)
            return by_spec[spec]

        stage_of: dict[str, dict[str, str]] = {}
        for label, (r, _) in self.full.items():
            add("exact", exact_recipe(r))
            stage_of[label] = {s: add(s, stage_recipe(r, s)) for s in STAGES}
        return stages, stage_of

    def variant_labels(self) -> list[str]:
        return list(self.full) + list(self.stage_variants)

    def recipe(self, label: str) -> Recipe:
        return self.full[label][0] if label in self.full else self.stage_variants[label][0]

    def runs_on(self) -> dict[str, set[tuple[str, int, int, bool]]]:
        """variant label -> the (data label, seqlen, head_dim, causal) cells it runs on."""
        on: dict[str, set] = {v: set() for v in self.variant_labels()}
        for des in self.designs:
            shape = [[x for x in (getattr(des, k) or getattr(self, k)) if x in getattr(self, k)]
                     or getattr(self, k)[:1] for k in ("seqlen", "head_dim", "causal")]
            cells = set(itertools.product(des.data or [x.label for x in self.data], *shape))
            for lv in des.variants():
                on[variant_label(lv)] |= cells
        for _ in range(2):  # twice: an accumulator baseline may itself be a full recipe with stages
            for full, stages in self.stage_of.items():
                for s in stages.values():
                    on[s] |= on[full]
        exact = {lab for lab, (_, st) in self.stage_variants.items() if st == "exact"}
        for lab in exact:
            on[lab] = set().union(*on.values())
        return on

    def cells(self) -> list[tuple[DataItem, int, int, bool]]:
        return [c for c in itertools.product(self.data, self.seqlen, self.head_dim, self.causal)
                if c[0].feasible(c[1], c[2])]


def with_tiles(r: Recipe, head_dim: int, causal: bool) -> Recipe:
    """The recipe at the FP8 kernel's tiles for this head dim (explicit bm, bn)."""
    m, n = fa3_tiles(head_dim, fp8=True, causal=causal)
    return dataclasses.replace(r, bm=r.bm or m, bn=r.bn or n)


# -- loading -------------------------------------------------------------------------------

def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def data_items(entries: list[dict], source: str = "the experiment") -> list[DataItem]:
    items = []
    for e in entries:
        dist = e.get("dist")
        require(isinstance(dist, str) and dist, f"a [[data]] entry needs dist = NAME; got {str(e)[:80]}")
        entry = distributions.get(dist)
        params = e.get("params", {})
        require(isinstance(params, dict), f"{source}: params of {dist} must be a table, e.g. params = {{ p = [0.01] }}")
        given = {k: toml_values(v, float, f"params.{k}", source) for k, v in params.items()}
        for k, v in given.items():
            require(len(v) > 0, f"{source}: params.{k} of {dist} is an empty list; give at least one value")
            check_distinct(k, v)
        unknown = set(given) - set(entry.params)
        require(not unknown, f"distribution {dist!r} takes parameters {sorted(entry.params)}, not {sorted(unknown)}")
        for combo in itertools.product(*given.values()):
            explicit = dict(zip(given, combo))
            full = {k: explicit.get(k, default) for k, (default, _) in entry.params.items()}
            if entry.validate:
                entry.validate(full)
            name = e.get("label") or dist.split(":")[0]
            suffix = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in explicit.items())
            label = f"{name} {suffix}" if suffix else name
            items.append(DataItem(label, dist, tuple((k, full[k]) for k in entry.params)))
    return items


def _design_shape(d: dict, key: str, run: list, overridden: bool) -> list:
    """A design's own seqlen / head_dim / causal list. From the command line, the run's list
    wins: the design keeps the values in both, or the run's first value if none is."""
    if key not in d:
        return list(run)
    own = toml_values(d[key], bool if key == "causal" else int, f"design {d.get('name', '?')}: {key}", "design")
    require(len(own) > 0, f"design {d.get('name', '?')!r}: {key} is an empty list; give at least one value")
    return ([x for x in own if x in run] or run[:1]) if overridden else own


def load_ablation(name: str = "ablation", overrides: dict | None = None) -> Ablation:
    """Read experiments/NAME.toml (or a .toml path) and apply overrides.

    Overrides: seqlen, head_dim, causal, batch, heads, rows, seeds (lists or scalars as in
    the TOML); a factor name (gran, rot, p, acc, fmt, scale, or any registered factor) replaces
    that factor's levels in every design that varies it; ``designs`` keeps only the named
    designs; ``data`` keeps only data whose label starts with one of the given strings;
    ``capture`` adds a capture file as data; ``attribution``, ``backend``, ``device``.

    Shape: [shape] gives every design's seqlen, head_dim and causal lists; a design may set
    its own (e.g. a few head dims on one seqlen). A list given as an override replaces
    [shape]'s and is intersected with each design's own (the design falls back to the
    override's first value when nothing is left). The dataset's dims hold every value used.
    """
    path, spec = read_toml(name)
    reg = factors()
    ov = {k: v for k, v in (overrides or {}).items() if v is not None}
    shape = spec.get("shape", {})
    cast = {"seqlen": int, "head_dim": int, "causal": bool}
    run = {k: toml_values(ov.get(k, shape.get(k, default)), cast[k], k, path.name)
           for k, default in (("seqlen", [1024]), ("head_dim", [128]), ("causal", [False]))}
    for k in ("batch", "heads", "rows"):
        if k in shape and k not in ov:
            got = toml_values(shape[k], int, k, path.name)
            require(len(got) == 1, f"{path.name}: {k} takes one value, not a list")
            shape[k] = got[0]
    if "seeds" in spec.get("run", {}) and "seeds" not in ov:
        spec["run"]["seeds"] = toml_values(spec["run"]["seeds"], int, "seeds", path.name)
    data = data_items(spec.get("data", []), path.name)
    if "capture" in ov:
        data.append(capture_item(str(ov.pop("capture")), ov.pop("capture_layer", 0)))
    if "data" in ov:
        keep = _as_list(ov.pop("data"))
        data = [d for d in data if any(d.label.startswith(k) for k in keep)]
        require(data, f"--data {','.join(keep)} matches no data label")
    designs = []
    for i, d in enumerate(spec.get("design", [])):
        unknown = [k for k in d if k not in reg and k not in DESIGN_KEYS]
        require(not unknown, f"{path.name}: design {d.get('name', i)!r} sets {', '.join(unknown)}, which is no "
                f"factor; factors: {', '.join(reg)} (and {', '.join(DESIGN_KEYS)})")
        dname = d.get("name", f"design{i}")
        require(isinstance(dname, str) and dname.strip(), f"{path.name}: design {i} needs name = \"...\"")
        require(dname not in [x.name for x in designs], f"{path.name}: design name {dname!r} is used twice; "
                "give each design its own")
        levels = {}
        for f, fac in reg.items():
            given = _as_list(d.get(f, [fac.default]))
            if f in ov and len(given) > 1:
                given = _as_list(ov[f])
            require(len(given) > 0, f"{path.name}: design {dname!r} lists no level of {f}; give at least one")
            levels[f] = [str(x) for x in given]
            check_distinct(f"{f} (design {dname})", levels[f])
        designs.append(Design(dname, levels, d.get("data"),
                              *[_design_shape(d, k, run[k], k in ov) for k in ("seqlen", "head_dim", "causal")]))
    if "designs" in ov:
        keep = _as_list(ov.pop("designs"))
        designs = [d for d in designs if d.name in keep]
        require(designs, f"--designs {','.join(keep)} matches no design of {path.name}")
    labels = {x.label for x in data}
    for des in designs:
        if des.data is not None:
            des.data = [x for x in des.data if x in labels] or None
    kw = dict(
        name=Path(name).stem, description=spec.get("description", ""), data=data, designs=designs,
        # The dataset's shape dims: the run's lists, then any further values the designs add.
        **{k: run[k] + sorted({x for des in designs for x in (getattr(des, k) or [])} - set(run[k]))
           for k in ("seqlen", "head_dim", "causal")},
        batch=int(ov.get("batch", shape.get("batch", 1))), heads=int(ov.get("heads", shape.get("heads", 4))),
        rows=int(ov.get("rows", shape.get("rows", 256))),
        seeds=[int(x) for x in _as_list(ov.get("seeds", spec.get("run", {}).get("seeds", [0])))],
        attribution=bool(ov.get("attribution", spec.get("run", {}).get("attribution", True))),
        backend=ov.get("backend", "emulate"), device=ov.get("device", "cpu"),
    )
    return Ablation(**kw)


# -- running -------------------------------------------------------------------------------

def tasks(ab: Ablation) -> tuple[list[Task], list[tuple[int, int, int, int, int]]]:
    """One task per feasible (data, seqlen, head_dim, causal, seed), and each task's index
    (data, seqlen, head_dim, causal, seed) into the dataset."""
    labels = ab.variant_labels()
    on = ab.runs_on()
    out, where = [], []
    di = {d.label: i for i, d in enumerate(ab.data)}
    for data, n, d, causal in ab.cells():
        params = dict(data.params)
        cell = {**params, "seqlen": n, "head_dim": d, "causal": causal}
        todo = [(vi, with_tiles(ab.recipe(v), d, causal)) for vi, v in enumerate(labels)
                if (data.label, n, d, causal) in on[v]]
        if not todo:
            continue
        for si, seed in enumerate(ab.seeds):
            key = functools.partial(cache_key, data.dist, cell, seed, batch=ab.batch, heads=ab.heads,
                                    kv_heads=ab.heads, rows=ab.rows, backend=ab.backend, device=ab.device,
                                    study=(__name__,))
            inputs = DistInputs(data.dist, tuple(params.items()), ab.batch, ab.heads, ab.heads, n, d, seed)
            out.append(Task(inputs, causal, seed, ab.rows, ab.backend, ab.device,
                            [Job(vi, r, key(r.spec())) for vi, r in todo], key("hist"),
                            f"{data.label}, seqlen={n}, head_dim={d}, causal={causal}"))
            where.append((di[data.label], ab.seqlen.index(n), ab.head_dim.index(d), ab.causal.index(causal), si))
    return out, where


def run_ablation(ab: Ablation, *, cache_dir: Path | None = None, workers: int | None = None,
                 scheduler: str | None = None, progress: Callable[[str], None] = _progress):
    """Run (or resume) the ablation and return its dataset (see module docstring)."""
    if workers is None:
        workers = default_workers(ab.device)
    ts, where = tasks(ab)
    labels = ab.variant_labels()
    progress(f"{ab.name}: {len(ab.full)} recipe(s) + {len(ab.stage_variants)} attribution recipe(s), "
             f"{len(ts)} task(s) of (data, seqlen, head_dim, causal, seed), "
             f"{sum(len(t.jobs) for t in ts)} variant run(s); "
             f"{'scheduler ' + scheduler if scheduler else str(workers) + ' worker(s)'}")
    load0 = _loadavg()
    t0 = time.perf_counter()
    run = run_tasks(ts, cache_dir=cache_dir, workers=workers, scheduler=scheduler, progress=progress)
    wall = time.perf_counter() - t0
    load1 = _loadavg()
    shape = (len(ab.data), len(ab.seqlen), len(ab.head_dim), len(ab.causal))
    out = {m: np.full(shape + (len(labels), len(ab.seeds), ab.batch, ab.heads), np.nan) for m in METRICS}
    hist = np.full(shape + (len(ab.seeds), 3, len(HIST_EDGES)), np.nan)
    for (a, b, c, d, si), res, h in zip(where, run.results, run.hists):
        hist[a, b, c, d, si] = h
        for vi, vals in res.items():
            for m in METRICS:
                out[m][a, b, c, d, vi, si] = vals[m]
    dims = ["data", "seqlen", "head_dim", "causal", "variant", "seed", "batch", "head"]
    reg = factors()
    coords = {
        "data": [d.label for d in ab.data], "seqlen": ab.seqlen, "head_dim": ab.head_dim, "causal": ab.causal,
        "variant": labels, "seed": ab.seeds, "batch": np.arange(ab.batch), "head": np.arange(ab.heads),
        "dist": ("data", [d.dist for d in ab.data]),
        "data_params": ("data", [json.dumps(dict(d.params)) for d in ab.data]),
        "paper_data": ("data", [d.paper for d in ab.data]),
        "spec": ("variant", [ab.recipe(v).spec() for v in labels]),
        "paper_rmse": ("variant", [np.nan] * len(labels)),
        "stage": ("variant", ["full"] * len(ab.full) + [ab.stage_variants[v][1] for v in ab.stage_variants]),
        "heads": ab.heads, "kv_heads": ab.heads, "batch_size": ab.batch, "rows": ab.rows,
    }
    for f in reg:
        coords[f] = ("variant", [ab.full[v][1][f] if v in ab.full else "" for v in labels])
    for s in ("exact",) + tuple(STAGES):
        if ab.stage_of:
            coords[f"stage_of_{s}"] = ("variant", [_stage_of(ab, v, s) for v in labels])
    designs = {d.name: {"levels": d.levels, "data": d.data, "seqlen": d.seqlen, "head_dim": d.head_dim,
                        "causal": d.causal} for d in ab.designs}
    attrs = provenance(ab.device)
    attrs.update({
        "experiment": ab.name, "description": ab.description, "dist": "several (see coords dist, data_params)",
        "backend": ab.backend, "seeds": json.dumps(ab.seeds), "designs": json.dumps(designs),
        "factors": json.dumps(list(reg)),
        "rows_sampling": ROWS_SAMPLING,
        "rotation_seed": "seed", "data_seed": "seed (torch.Generator on CPU, float64)",
        "base_shape": json.dumps({"head_dim": ab.head_dim[0], "causal": ab.causal[0]}),
        "base_recipe": BASE, "tiles": "every recipe at the FP8 kernel's tiles for its head dim (bm, bn explicit)",
        "workers": scheduler or workers, "wall_seconds": round(wall, 3), "cells_reused": run.reused,
        "cpu_cores": os.cpu_count() or 0, "loadavg_start": load0, "loadavg_end": load1,
        "reference": "float64 attention, chunked over queries",
    })
    from .ablation_findings import with_findings

    return with_findings(results_dataset(out, dims=dims, coords=coords, attrs=attrs, hist=hist,
                                         hist_dims=dims[:4] + ["seed"]))


def _loadavg() -> str:
    """1-minute load average (other processes on the machine slow a sweep down)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def _stage_of(ab: Ablation, label: str, stage: str) -> str:
    if label not in ab.full:
        return ""
    if stage == "exact":
        spec = exact_recipe(ab.full[label][0]).spec()
        return next(v for v, (r, _) in ab.stage_variants.items() if r.spec() == spec)
    return ab.stage_of[label][stage]


def capture_item(path: str, layer: int = 0) -> DataItem:
    """A capture file's layer as ablation data (the ``capture-file:`` distribution)."""
    require(Path(path).is_file(), f"--capture {path}: no such file; write one with `fa3-numerics capture`")
    cap = _capture(path)
    require(int(layer) in cap.layers, f"--capture-layer {layer} is not in {path} (layers {cap.layers})")
    return DataItem(f"capture {Path(path).stem} layer {int(layer)}", f"capture-file:{path}", (("layer", int(layer)),))


class AblationStudy(StoredFindings, Study):
    """A factorial ablation (``load_ablation``) on the ``engine.study`` protocol: its cells go through
    ``run_tasks`` and the one cache; ``run_ablation`` assembles the dataset with its attribution."""

    kind = "ablation"

    def __init__(self, ab: "Ablation"):
        self.ab = ab
        self.stem = ab.name

    def describe(self) -> str:
        return f"{self.ab.name}: {len(self.ab.designs)} design(s), backend {self.ab.backend} on {self.ab.device}"

    def run(self, ctx):
        return run_ablation(self.ab, cache_dir=ctx.cache, workers=ctx.workers, scheduler=ctx.scheduler,
                            progress=ctx.progress)

    def assemble(self, results):
        return results


__all__ = ["AblationStudy", "FACTORS", "DEFAULT_LEVEL", "DataItem", "Design", "Ablation", "load_ablation", "run_ablation", "tasks",
           "factor_recipe", "variant_label", "with_tiles", "capture_item", "capture_info"]
