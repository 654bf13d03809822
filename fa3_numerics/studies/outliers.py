"""`run outliers` and any single-distribution experiment: the definition (experiments/*.toml plus
command-line overrides), its tasks, and its dataset.

Exposed: ``Experiment``, ``load_experiment``, ``list_experiments``, ``read_toml``, ``run_experiment``,
``SHAPE_SWEEPABLE``.

An experiment is a distribution, its parameters, a shape, variants and seeds. Every parameter
of the distribution and every shape parameter in ``SHAPE_SWEEPABLE`` is a list; the cells of a
run are the product of those lists, and every cell uses the same seed stream, so differences
between cells are not seed noise. Each (cell, seed) is one engine task
(``fa3_numerics.engine.runner``); every variant of the task runs on the same inputs.

Dataset (``fa3_numerics.engine.dataset``): one variable per metric with dims (*swept
parameters, variant, seed, batch, head); the unswept parameters as scalar coordinates; ``spec``
and ``paper_rmse`` per variant; ``rows`` the query rows evaluated (per seqlen when a sweep holds
seqlens shorter than ``--rows``); the inputs' |x| histogram; provenance attrs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import itertools
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Callable

import numpy as np

from ..data.dist_spec import parse_dist
from ..engine.cache import cache_key
from ..engine.checks import check_backend, check_distinct, check_shape
from ..engine.inputs import HIST_EDGES, DistInputs
from ..engine.provenance import provenance
from ..engine.runner import Job, Task, run_tasks
from ..engine.sampling import ROWS_SAMPLING, effective_rows
from ..engine.study import Study
from .stored import StoredFindings
from ..errors import UsageError, require
from ..numerics.metrics import METRICS
from ..numerics.recipe import PRESETS, parse_recipes

# Shape parameters that may sweep, besides the distribution's own parameters.
SHAPE_SWEEPABLE = ("seqlen", "head_dim", "causal")


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Experiment:
    name: str
    description: str
    dist: str
    variants: list[str]
    params: dict[str, list[float]]  # distribution parameters, each a list
    seqlen: list[int]
    head_dim: list[int]
    causal: list[bool]
    # Left out: Table 3's (experiments/outliers.toml), the one place the defaults are written.
    batch: int = dataclasses.field(default_factory=lambda: table3()["shape"]["batch"])
    heads: int = dataclasses.field(default_factory=lambda: table3()["shape"]["heads"])
    kv_heads: int = dataclasses.field(default_factory=lambda: table3()["shape"]["kv_heads"])
    rows: int = dataclasses.field(default_factory=lambda: table3()["shape"]["rows"])
    seeds: list[int] = dataclasses.field(default_factory=lambda: list(table3()["run"]["seeds"]))
    backend: str = "emulate"
    device: str = "cpu"

    def __post_init__(self):
        spec = parse_dist(self.dist)
        for k, v in spec.params.items():  # NAME:k=v and FILE@k=v are recorded like --k v
            require(k not in self.params, f"parameter {k} is given both in --dist and as --{k}; give it once")
            self.params[k] = [v]
        self.dist = spec.name
        entry = spec.entry
        unknown = set(self.params) - set(entry.params)
        require(not unknown, f"distribution {entry.name!r} takes parameters {sorted(entry.params)}, not "
                             f"{sorted(unknown)}")
        self.params = {k: [v[0]] for k, v in entry.params.items()} | self.params
        for name, values in self.sweeps().items():
            require(len(values) > 0, f"--{name.replace('_', '-')} got an empty list; give at least one value")
            check_distinct(name, values)
        for values in itertools.product(*self.params.values()):
            if entry.validate:
                entry.validate(dict(zip(self.params, values)))
        check_shape(self.seqlen, self.head_dim, self.batch, self.heads, self.kv_heads, self.rows, self.seeds,
                    self.device)
        self.recipes = parse_recipes(";".join(self.variants))
        check_backend(self.backend, self.device, self.recipes)

    def sweeps(self) -> dict[str, list]:
        """Every sweepable parameter with its values (distribution params first)."""
        return {**self.params, "seqlen": self.seqlen, "head_dim": self.head_dim, "causal": self.causal}

    def swept_dims(self) -> list[str]:
        return [k for k, v in self.sweeps().items() if len(v) > 1]

    def cells(self) -> list[dict]:
        sw = self.sweeps()
        return [dict(zip(sw, combo)) for combo in itertools.product(*sw.values())]


@functools.lru_cache(maxsize=1)
def _table3_cached() -> str:
    return json.dumps(_read_table3())


def _read_table3() -> dict:
    """experiments/outliers.toml, checked: the FA3 paper's Table 3 and every default."""
    path, spec = read_toml("outliers")
    shape = dict(spec.get("shape", {}))
    for key in ("seqlen", "head_dim", "causal", "batch", "heads", "kv_heads", "rows"):
        require(key in shape, f"{path}: [shape] must set {key} (it is every experiment's default)")
    require("seeds" in spec.get("run", {}), f"{path}: [run] must set seeds (it is every experiment's default)")
    for key in ("batch", "heads", "kv_heads", "rows"):
        shape[key] = toml_values(shape[key], int, key, path.name)[0]
    return {"shape": shape, "run": dict(spec["run"]), "params": dict(spec.get("params", {})),
            "variants": list(spec.get("variants", [])), "dist": spec.get("dist", "outliers")}


def table3() -> dict:
    """The Table 3 definition (experiments/outliers.toml): shape, run, params, variants, dist; a
    fresh copy each call."""
    return json.loads(_table3_cached())


def table3_variants() -> tuple[str, ...]:
    """The paper's Table 3 rows, in order, as experiments/outliers.toml lists them."""
    return tuple(table3()["variants"])


def list_experiments() -> dict[str, Path]:
    root = importlib.resources.files("fa3_numerics.experiments")
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".toml")}


def read_toml(name: str) -> tuple[Path, dict]:
    """experiments/NAME.toml (or a path to a .toml) -> (path, parsed dict); one-line errors."""
    known = list_experiments()
    path = Path(name) if name.endswith(".toml") else known.get(name)
    if path is None or not path.is_file():
        raise UsageError(f"unknown experiment {name!r}; choose one of: {', '.join(sorted(known))} or give a .toml path")
    try:
        return path, tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a UTF-8 text file; give an experiment TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {str(exc).splitlines()[0]}") from None


_KINDS = {bool: "true or false", int: "an integer", float: "a finite number"}


def toml_values(value, kind: type, key: str, source: str) -> list:
    """``value`` (one or a list, as a TOML gives it) as a list of ``kind``: bool only from
    true/false (the string "false" is not False), int from integers (1024.0 too), float from finite
    numbers; a one-line error naming ``source`` and ``key`` otherwise. Values typed already pass."""
    import math

    out = []
    for x in _as_list(value):
        number = isinstance(x, (int, float)) and not isinstance(x, bool)
        ok = (isinstance(x, bool) if kind is bool else
              number and (isinstance(x, int) or x.is_integer()) if kind is int else
              number and math.isfinite(x))
        require(ok, f"{source}: {key} = {str(x)[:40]!r} is not {_KINDS[kind]}; write "
                    f"{'true or false' if kind is bool else 'a number'} without quotes")
        out.append(kind(x))
    return out


def load_experiment(name: str, overrides: dict | None = None) -> Experiment:
    """Read experiments/NAME.toml (or a path to a .toml) and apply CLI overrides.

    Overrides: any field of ``Experiment`` and any parameter of the distribution (a list
    sweeps). ``dist`` may pick another family (``--dist``), whose parameters then come from the
    overrides and its defaults, not from the TOML.
    """
    path, spec = read_toml(name)
    shape = spec.get("shape", {})
    src = path.name
    for key, kind in (("seqlen", int), ("head_dim", int), ("causal", bool), ("batch", int), ("heads", int),
                      ("kv_heads", int), ("rows", int)):
        if key in shape:
            shape[key] = toml_values(shape[key], kind, key, src)
            if key in ("batch", "heads", "kv_heads", "rows"):
                require(len(shape[key]) == 1, f"{src}: {key} takes one value, not a list")
                shape[key] = shape[key][0]
    if "seeds" in spec.get("run", {}):
        spec["run"]["seeds"] = toml_values(spec["run"]["seeds"], int, "seeds", src)
    for k, v in spec.get("params", {}).items():
        spec["params"][k] = toml_values(v, float, k, src)
    # A key an experiment leaves out takes Table 3's value: experiments/outliers.toml is the one
    # definition of the defaults.
    base = table3() if Path(name).stem != "outliers" else {"shape": {}, "run": {}, "params": {}}
    shape = {**base["shape"], **shape}
    run = {**base.get("run", {}), **spec.get("run", {})}
    kw = dict(
        name=Path(name).stem, description=spec.get("description", ""), dist=spec.get("dist", "outliers"),
        variants=list(spec.get("variants", list(PRESETS))), params={k: _as_list(v) for k, v in spec.get("params", {}).items()},
        seqlen=_as_list(shape["seqlen"]), head_dim=_as_list(shape["head_dim"]), causal=_as_list(shape["causal"]),
        batch=shape["batch"], heads=shape["heads"], kv_heads=shape["kv_heads"], rows=shape["rows"],
        seeds=_as_list(run["seeds"]),
    )
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    family = parse_dist(overrides.get("dist") or kw["dist"]).entry
    if family.name != parse_dist(kw["dist"]).entry.name:
        # --dist picks another family: the TOML's parameters belong to its own family.
        kw["params"] = {k: v for k, v in kw["params"].items() if k in family.params}
    if "dist" in overrides:
        # NAME:k=v on the command line sets k over the TOML's default; only --k as well is a conflict.
        for k in parse_dist(overrides["dist"]).params:
            kw["params"].pop(k, None)
    fields = {f.name for f in dataclasses.fields(Experiment)}
    for k, v in overrides.items():
        if k in family.params:
            kw["params"][k] = _as_list(v)
        elif k in fields and k != "params":
            kw[k] = v
        else:
            raise UsageError(f"--{k.replace('_', '-')} is not a parameter of distribution {family.name!r}; "
                             f"it takes {', '.join(sorted(family.params)) or 'none'}")
    return Experiment(**kw)


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _key(exp: Experiment, cell: dict, seed: int, spec: str) -> str:
    return cache_key(exp.dist, cell, seed, spec, batch=exp.batch, heads=exp.heads, kv_heads=exp.kv_heads,
                     rows=exp.rows, backend=exp.backend, device=exp.device, study=(__name__,))


def tasks(exp: Experiment) -> list[Task]:
    """One engine task per (cell, seed), cells in sweep order, seeds inner."""
    dims_sw = exp.swept_dims()
    out = []
    for cell in exp.cells():
        params = tuple((k, cell[k]) for k in exp.params)
        where = ", ".join(f"{k}={cell[k]}" for k in dims_sw) or "single cell"
        for seed in exp.seeds:
            inputs = DistInputs(exp.dist, params, exp.batch, exp.heads, exp.kv_heads or exp.heads, cell["seqlen"],
                                cell["head_dim"], seed)
            jobs = [Job(i, r, _key(exp, cell, seed, r.spec())) for i, (_, r) in enumerate(exp.recipes)]
            out.append(Task(inputs, cell["causal"], seed, exp.rows, exp.backend, exp.device, jobs,
                            _key(exp, cell, seed, "hist"), where))
    return out


@dataclasses.dataclass
class Results:
    """An experiment's numbers before they become a dataset: picklable, and built without xarray,
    so that the dataset and report can be made in another process (``engine.report_process``).
    ``attrs`` (provenance) is taken where the runs ran: it names their device."""

    exp: Experiment
    out: dict
    hist: np.ndarray
    wall: float
    reused: int
    attrs: dict

    def dataset(self) -> "xarray.Dataset":  # noqa: F821
        return _assemble(self)


def run_experiment(exp: Experiment, *, cache_dir: Path | None = None,
                   progress: Callable[[str], None] = _progress, workers: int = 0,
                   scheduler: str | None = None) -> "xarray.Dataset":  # noqa: F821
    """Run every (cell, seed, variant) not already cached and return the dataset."""
    return compute_experiment(exp, cache_dir=cache_dir, progress=progress, workers=workers,
                              scheduler=scheduler).dataset()


def compute_experiment(exp: Experiment, *, cache_dir: Path | None = None,
                       progress: Callable[[str], None] = _progress, workers: int = 0,
                       scheduler: str | None = None) -> Results:
    """Run every (cell, seed, variant) not already cached and return the numbers (``Results``)."""
    cells = exp.cells()
    short = sorted({n for n in exp.seqlen if exp.rows >= n})
    if exp.rows and short:
        progress(f"note: --rows {exp.rows} >= seqlen {', '.join(map(str, short))}: every query row is evaluated "
                 "there (the dataset records the rows evaluated)")
    t0 = time.perf_counter()
    run = run_tasks(tasks(exp), cache_dir=cache_dir, workers=workers, scheduler=scheduler, progress=progress)
    out = {m: np.full((len(cells), len(exp.recipes), len(exp.seeds), exp.batch, exp.heads), np.nan) for m in METRICS}
    hist = np.zeros((len(cells), len(exp.seeds), 3, len(HIST_EDGES)), dtype=np.float64)
    for t, (ci, si) in enumerate(itertools.product(range(len(cells)), range(len(exp.seeds)))):
        hist[ci, si] = run.hists[t]
        for i, vals in run.results[t].items():
            for m in METRICS:
                out[m][ci, i, si] = vals[m]
    return Results(exp, out, hist, time.perf_counter() - t0, run.reused, provenance(exp.device))


def _assemble(res: Results):
    exp, out, hist = res.exp, res.out, res.hist
    sw = exp.sweeps()
    dims_sw = exp.swept_dims()
    # [cell, variant, seed, batch, head] -> [*swept, variant, seed, batch, head]
    shape_sw = [len(sw[d]) for d in dims_sw]
    metrics = {m: a.reshape(shape_sw + list(a.shape[1:])) for m, a in out.items()}
    dims = dims_sw + ["variant", "seed", "batch", "head"]
    labels = [l for l, _ in exp.recipes]
    coords = {d: sw[d] for d in dims_sw}
    coords.update({
        "variant": labels, "seed": exp.seeds, "batch": np.arange(exp.batch), "head": np.arange(exp.heads),
        "spec": ("variant", [r.spec() for _, r in exp.recipes]),
        "paper_rmse": ("variant", [PRESETS[l].paper_rmse if l in PRESETS and PRESETS[l].paper_rmse else np.nan
                                   for l in labels]),
    })
    for k, v in sw.items():
        if k not in dims_sw:
            coords[k] = v[0]
    rows = [effective_rows(n, exp.rows) for n in exp.seqlen]
    coords.update({"heads": exp.heads, "kv_heads": exp.kv_heads or exp.heads, "batch_size": exp.batch,
                   "rows": rows[0] if len(set(rows)) == 1 else ("seqlen", rows)})
    attrs = dict(res.attrs)
    attrs.update({
        "experiment": exp.name, "description": exp.description, "dist": exp.dist, "backend": exp.backend,
        "seeds": json.dumps(exp.seeds), "rows_sampling": ROWS_SAMPLING,
        "rotation_seed": "seed", "data_seed": "seed (torch.Generator on CPU, float64)",
        "wall_seconds": round(res.wall, 3), "cells_reused": res.reused,
        "reference": "float64 attention, chunked over queries",
    })
    from ..engine.dataset import results_dataset  # xarray: imported beside the runs (engine.prefetch)
    from .run_findings import with_findings

    return with_findings(results_dataset(metrics, dims=dims, coords=coords, attrs=attrs,
                                         hist=hist.reshape(shape_sw + list(hist.shape[1:])), hist_dims=dims_sw + ["seed"]))


class OutliersStudy(StoredFindings, Study):
    """An experiment TOML's run (``run outliers`` and any other ``experiments/NAME.toml``) on the
    ``engine.study`` protocol: its tasks go through ``run_tasks`` and the one cache."""

    kind = "run"

    def __init__(self, exp: Experiment):
        self.exp = exp
        self.stem = exp.name

    @classmethod
    def load(cls, name: str = "outliers", overrides: dict | None = None) -> "OutliersStudy":
        return cls(load_experiment(name, overrides))  # every check before the folder is touched

    def describe(self) -> str:
        exp = self.exp
        return (f"{exp.name}: {len(exp.cells())} cell(s) x {len(exp.seeds)} seed(s) x {len(exp.recipes)} "
                f"variant(s), backend {exp.backend} on {exp.device}")

    def tasks(self) -> list[Task]:
        return tasks(self.exp)

    def run(self, ctx) -> Results:
        return compute_experiment(self.exp, cache_dir=ctx.cache, workers=ctx.workers, scheduler=ctx.scheduler,
                                  progress=ctx.progress)

    def assemble(self, results: Results):
        return results.dataset()


__all__ = ["Experiment", "Results", "load_experiment", "list_experiments", "read_toml", "run_experiment",
           "compute_experiment", "tasks", "SHAPE_SWEEPABLE", "OutliersStudy", "table3",
           "table3_variants"]
