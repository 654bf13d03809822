"""Experiments: definitions as data (experiments/*.toml), cells, and the resumable runner.

Exposed: ``Experiment``, ``load_experiment``, ``list_experiments``, ``run_experiment``,
``SWEEPABLE``, and the engine shared with other sweeps (``fa3_numerics.studies.ablation``):
``Task``, ``cache_key``, ``run_tasks``, ``compute_task``, ``input_histogram``
(parallel execution lives in ``fa3_numerics.engine.distributed``).

An experiment is a distribution, its parameters, a shape, variants and seeds. Every
parameter in ``SWEEPABLE`` is a list; the cells of a run are the product of those lists,
and every cell uses the same seed stream, so differences between cells are not seed
noise. Each finished (cell, seed, variant) is cached on disk keyed by everything that
determines it, so an interrupted run resumes without recomputing finished work.

Engine: a sweep is a list of ``Task``s, one per (cell, seed): the inputs are drawn once,
the float64 reference is computed once, and every variant of the task runs on them.
Tasks are independent, so ``run_tasks`` runs them in this process (``workers=0``) or on
dask.distributed (a ``LocalCluster`` of ``workers`` single-threaded processes, or an
existing cluster at ``scheduler``). Workers write each finished variant's cache file
atomically (temp file + rename); the driver places every result at its fixed position,
so the dataset does not depend on the number of workers or the order tasks finish in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.resources
import itertools
import json
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..data import distributions
from .backends import get_backend
from .dataset import to_dataset
from ..errors import UsageError, require
from ..numerics.metrics import METRICS, per_sample
from .provenance import provenance
from ..numerics.recipe import PRESETS, Recipe, parse_recipes
from ..numerics.reference import reference_attention
from ..numerics.tiles import check_head_dim

# Shape parameters that may sweep, besides the distribution's own parameters.
SHAPE_SWEEPABLE = ("seqlen", "head_dim", "causal")
SWEEPABLE = SHAPE_SWEEPABLE
# Log-spaced bin edges for the histogram of |Q|, |K|, |V| entries kept in every dataset.
HIST_EDGES = np.concatenate([[0.0], np.logspace(-3, 3, 61)])
# How the query-row sample and the rotation derive from a seed (recorded in attrs).
ROWS_SEED = "seed * 1000003 + 17"


def _rows_seed(seed: int) -> int:
    return seed * 1000003 + 17


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
    batch: int = 1
    heads: int = 16
    kv_heads: int = 0
    rows: int = 1024
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    backend: str = "emulate"
    device: str = "cpu"

    def __post_init__(self):
        entry = distributions.get(self.dist)
        full = {k: [v[0]] for k, v in entry.params.items()} | self.params
        require(not (set(full) - set(entry.params)),
                f"distribution {entry.name!r} takes parameters {sorted(entry.params)}, not {sorted(set(full) - set(entry.params))}")
        self.params = full
        for name, values in self.sweeps().items():
            require(len(values) > 0, f"--{name.replace('_', '-')} got an empty list; give at least one value")
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


def check_shape(seqlen, head_dim, batch, heads, kv_heads, rows, seeds, device) -> None:
    """Refuse shapes and seeds no sweep can run, with the option to fix in the message."""
    for d in head_dim:
        check_head_dim(d)
    for n in seqlen:
        require(n >= 1, f"--seqlen must be >= 1, got {n}")
    require(batch >= 1 and heads >= 1, "--batch and --heads must be >= 1")
    require(kv_heads >= 0 and (kv_heads == 0 or heads % kv_heads == 0),
            f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    require(rows >= 0, "--rows must be >= 0 (0 = every query row)")
    require(len(seeds) > 0 and len(set(seeds)) == len(seeds), "--seeds must be distinct integers")
    require(device in ("cpu", "cuda") or device.startswith("cuda:"), "--device must be cpu or cuda")


def check_backend(name: str, device: str, recipes: list[tuple[str, Recipe]]) -> None:
    backend = get_backend(name)
    why = backend.check(device)
    require(why is None, f"backend {name!r} cannot run: {why}")
    for label, recipe in recipes:
        why = backend.supports(recipe)
        require(why is None, f"variant {label!r} cannot run on backend {name!r}: {why}")


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
        return path, tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from None


def load_experiment(name: str, overrides: dict | None = None) -> Experiment:
    """Read experiments/NAME.toml (or a path to a .toml) and apply CLI overrides."""
    path, spec = read_toml(name)
    shape = spec.get("shape", {})
    kw = dict(
        name=Path(name).stem, description=spec.get("description", ""), dist=spec.get("dist", "outliers"),
        variants=list(spec.get("variants", list(PRESETS))), params={k: _as_list(v) for k, v in spec.get("params", {}).items()},
        seqlen=_as_list(shape.get("seqlen", [8192])), head_dim=_as_list(shape.get("head_dim", [128])),
        causal=_as_list(shape.get("causal", False)), batch=shape.get("batch", 1), heads=shape.get("heads", 16),
        kv_heads=shape.get("kv_heads", 0), rows=shape.get("rows", 1024), seeds=_as_list(spec.get("run", {}).get("seeds", [0])),
    )
    overrides = overrides or {}
    entry = distributions.get(overrides.get("dist") or kw["dist"])
    if entry.name != distributions.get(kw["dist"]).name:
        # --dist picks another family: the TOML's parameters belong to its own family.
        kw["params"] = {k: v for k, v in kw["params"].items() if k in entry.params}
    fields = {f.name for f in dataclasses.fields(Experiment)}
    for k, v in overrides.items():
        if v is None:
            continue
        if k in entry.params:
            kw["params"][k] = _as_list(v)
        elif k in fields and k != "params":
            kw[k] = v
        else:
            raise UsageError(f"--{k.replace('_', '-')} is not a parameter of distribution {entry.name!r}; "
                             f"it takes {', '.join(sorted(entry.params)) or 'none'}")
    return Experiment(**kw)


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


# -- the engine: tasks, cache, execution --------------------------------------------------

@functools.lru_cache(maxsize=1)
def numerics_version() -> str:
    """Hash of the source of every module that decides a number, so a cache made by other
    numerics is never reused (editing a docstring also invalidates it, which is harmless)."""
    pkg = Path(__file__).resolve().parents[1]
    kernels = Path(importlib.import_module("fa3_numerics.kernels").__file__).parent
    files = sorted([*(pkg / "numerics").glob("*.py"), *(pkg / "data").rglob("*.py"), pkg / "engine" / "backends.py",
                    *kernels.glob("*.py")])
    h = hashlib.sha1()
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def cache_key(dist: str, cell: dict, seed: int, spec: str, *, batch: int, heads: int, kv_heads: int, rows: int,
              backend: str, device: str) -> str:
    """Hash of everything that determines one (cell, seed, variant) result."""
    payload = {"dist": dist, "cell": cell, "seed": seed, "spec": spec, "batch": batch, "heads": heads,
               "kv_heads": kv_heads, "rows": rows, "backend": backend, "device": device.split(":")[0], "v": 1,
               "code": numerics_version()}
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _cell_key(exp: Experiment, cell: dict, seed: int, label: str, spec: str) -> str:
    return cache_key(exp.dist, cell, seed, spec, batch=exp.batch, heads=exp.heads, kv_heads=exp.kv_heads,
                     rows=exp.rows, backend=exp.backend, device=exp.device)


@dataclasses.dataclass
class Task:
    """One (cell, seed): inputs drawn once, the reference once, then each recipe in ``recipes``.

    ``recipes`` holds (slot, recipe, cache key); ``slot`` is where the caller files the
    result, the key names the cache file ``<key>.npz``. ``hist_key`` names the file of the
    inputs' |x| histogram.
    """

    dist: str
    params: dict
    seqlen: int
    head_dim: int
    causal: bool
    seed: int
    batch: int
    heads: int
    kv_heads: int
    rows: int
    backend: str
    device: str
    recipes: list[tuple[int, Recipe, str]]
    hist_key: str
    where: str = ""
    modules: tuple[str, ...] = ()  # modules to import first (they register a distribution)


def _save_npz(path: Path, arrays: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cell.", suffix=".npz.tmp", dir=path.parent)
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_npz(path: Path, names) -> dict | None:
    """The arrays of a cache file, or None when it is missing or unreadable (then recomputed)."""
    try:
        with np.load(path) as z:
            return {m: z[m] for m in names}
    except (OSError, KeyError, ValueError, EOFError):
        return None


def compute_task(task: Task, cache_dir: str | None = None, threads: int = 0) -> tuple[dict[int, dict], np.ndarray]:
    """Run every recipe of ``task``; write each result to the cache as it finishes.

    Returns ({slot: {metric: [B, H] array}}, histogram [3, bins]). ``threads`` > 0 sets
    torch's intra-op threads (workers that share the CPU use 1).
    """
    if threads > 0:
        torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for mod in task.modules:
        importlib.import_module(mod)  # registers what the task's distribution needs
    device = task.device
    if device == "cuda":
        from .distributed import worker_device

        device = worker_device(device)
    backend = get_backend(task.backend)
    cdir = Path(cache_dir) if cache_dir else None
    shape = distributions.AttnShape(task.batch, task.heads, task.seqlen, task.head_dim,
                                    kv_heads=task.kv_heads or task.heads)
    q, k, v = distributions.generate(task.dist, shape, task.seed, **task.params)
    hist = input_histogram(q, k, v)
    if cdir is not None and task.hist_key:
        _save_npz(cdir / f"{task.hist_key}.npz", {"hist": hist})
    q, k, v = (t.to(device) for t in (q, k, v))
    n = task.seqlen
    if task.rows and task.rows < n:
        g = torch.Generator().manual_seed(_rows_seed(task.seed))
        q_index = torch.randperm(n, generator=g)[: task.rows].sort().values
    else:
        q_index = torch.arange(n)
    q_index = q_index.to(device)
    ref = reference_attention(q, k, v, causal=task.causal, q_index=q_index)
    cache: dict = {}
    results = {}
    for slot, recipe, key in task.recipes:
        o = backend.attention(recipe, q, k, v, causal=task.causal, q_index=q_index, rotation_seed=task.seed,
                              cache=cache)
        vals = per_sample(o, ref)
        results[slot] = vals
        if cdir is not None:
            _save_npz(cdir / f"{key}.npz", vals)
    return results, hist


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_tasks(tasks: list[Task], *, cache_dir: Path | None = None, workers: int = 0, scheduler: str | None = None,
              progress: Callable[[str], None] = _progress) -> tuple[list[dict[int, dict]], list[np.ndarray], int]:
    """Results of every task, in task order: ([{slot: metrics}], [hist], variants reused).

    Cached variants are read, not recomputed; a task whose every variant and histogram is
    cached is not submitted at all. ``workers=0`` (and no ``scheduler``) computes in this
    process; otherwise tasks go to dask.distributed.
    """
    results: list[dict[int, dict]] = [{} for _ in tasks]
    hists: list[np.ndarray | None] = [None] * len(tasks)
    todo: list[tuple[int, Task]] = []
    reused = 0
    for ti, task in enumerate(tasks):
        missing = []
        for slot, recipe, key in task.recipes:
            got = _load_npz(cache_dir / f"{key}.npz", METRICS) if cache_dir is not None else None
            if got is None:
                missing.append((slot, recipe, key))
            else:
                results[ti][slot] = got
                reused += 1
        h = _load_npz(cache_dir / f"{task.hist_key}.npz", ["hist"]) if cache_dir is not None else None
        if h is not None:
            hists[ti] = h["hist"]
        if missing or h is None:
            # A missing histogram alone recomputes one variant to regenerate the inputs.
            # A cached histogram is not rewritten (hist_key "" tells the task not to save it).
            todo.append((ti, dataclasses.replace(task, recipes=missing or task.recipes[:1],
                                                 hist_key=task.hist_key if h is None else "")))
    total = len(tasks)
    t0 = time.perf_counter()
    done = 0

    def finish(ti: int, sub: Task, res: dict, hist: np.ndarray) -> None:
        nonlocal done
        results[ti].update(res)
        hists[ti] = hist
        done += 1
        el = time.perf_counter() - t0
        progress(f"[{total - len(todo) + done}/{total}] {tasks[ti].where or 'single cell'}, seed {sub.seed}: "
                 f"{len(sub.recipes)} computed, {len(tasks[ti].recipes) - len(sub.recipes)} from cache; "
                 f"{el:.1f} s elapsed, ~{el / done * (len(todo) - done):.0f} s left")

    if len(todo) < total:
        progress(f"{total - len(todo)} of {total} task(s) fully cached; {reused} variant result(s) reused")
    if todo and (workers or scheduler):
        from .distributed import run_dask

        run_dask(todo, compute_task, cache_dir=cache_dir, workers=workers, scheduler=scheduler, finish=finish,
                 progress=progress)
    else:
        for ti, sub in todo:
            res, hist = compute_task(sub, str(cache_dir) if cache_dir else None)
            finish(ti, sub, res, hist)
    return results, hists, reused


# -- run outliers (and any single-distribution experiment) ---------------------------------

def run_experiment(exp: Experiment, *, cache_dir: Path | None = None,
                   progress: Callable[[str], None] = _progress, workers: int = 0,
                   scheduler: str | None = None) -> "xarray.Dataset":  # noqa: F821
    """Run every (cell, seed, variant) not already cached and return the dataset."""
    dims_sw = exp.swept_dims()
    cells = exp.cells()
    tasks = []
    for cell in cells:
        dist_params = {k: cell[k] for k in exp.params}
        where = ", ".join(f"{k}={cell[k]}" for k in dims_sw) or "single cell"
        for seed in exp.seeds:
            recipes = [(i, r, _cell_key(exp, cell, seed, label, r.spec())) for i, (label, r) in enumerate(exp.recipes)]
            tasks.append(Task(exp.dist, dist_params, cell["seqlen"], cell["head_dim"], cell["causal"], seed,
                              exp.batch, exp.heads, exp.kv_heads or exp.heads, exp.rows, exp.backend, exp.device,
                              recipes, _cell_key(exp, cell, seed, "inputs", "hist"), where))
    t0 = time.perf_counter()
    results, hists, reused = run_tasks(tasks, cache_dir=cache_dir, workers=workers, scheduler=scheduler,
                                       progress=progress)
    b = exp.batch
    out = {m: np.full((len(cells), len(exp.recipes), len(exp.seeds), b, exp.heads), np.nan) for m in METRICS}
    hist = np.zeros((len(cells), len(exp.seeds), 3, len(HIST_EDGES)), dtype=np.float64)
    for t, (ci, si) in enumerate(itertools.product(range(len(cells)), range(len(exp.seeds)))):
        hist[ci, si] = hists[t]
        for i, vals in results[t].items():
            for m in METRICS:
                out[m][ci, i, si] = vals[m]
    return _assemble(exp, out, hist, cells, dims_sw, time.perf_counter() - t0, reused)


def input_histogram(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """Counts of |x| per HIST_EDGES bin for Q, K, V -> [3, bins]; the last bin counts |x| >= 1000."""
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    rows = []
    for t in (q, k, v):
        idx = torch.bucketize(t.abs().flatten().cpu(), edges, right=True) - 1
        rows.append(torch.bincount(idx, minlength=len(HIST_EDGES)).numpy().astype(np.float64))
    return np.stack(rows)
def _assemble(exp: Experiment, out: dict, hist: np.ndarray, cells: list[dict], dims_sw: list[str], wall: float,
              reused: int):
    sw = exp.sweeps()
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
    coords.update({"heads": exp.heads, "kv_heads": exp.kv_heads or exp.heads, "batch_size": exp.batch,
                   "rows": exp.rows})
    attrs = provenance(exp.device)
    attrs.update({
        "experiment": exp.name, "description": exp.description, "dist": exp.dist, "backend": exp.backend,
        "seeds": json.dumps(exp.seeds), "rows_sampling": f"torch.randperm(seqlen, generator=manual_seed({ROWS_SEED}))[:rows]",
        "rotation_seed": "seed", "data_seed": "seed (torch.Generator on CPU, float64)",
        "wall_seconds": round(wall, 3), "cells_reused": reused,
        "reference": "float64 attention, chunked over queries",
    })
    ds = to_dataset(metrics, dims=dims, coords=coords, attrs=attrs)
    ds["abs_hist"] = (dims_sw + ["seed", "tensor", "abs_bin"], hist.reshape(shape_sw + list(hist.shape[1:])),
                      {"description": "count of entries with |x| in [abs_bin_lo, next abs_bin_lo) for Q, K, V"})
    ds = ds.assign_coords(tensor=["Q", "K", "V"], abs_bin_lo=("abs_bin", HIST_EDGES))
    return ds
