"""Experiments: definitions as data (experiments/*.toml), cells, and the resumable runner.

Exposed: ``Experiment``, ``load_experiment``, ``list_experiments``, ``run_experiment``,
``SWEEPABLE``.

An experiment is a distribution, its parameters, a shape, variants and seeds. Every
parameter in ``SWEEPABLE`` is a list; the cells of a run are the product of those lists,
and every cell uses the same seed stream, so differences between cells are not seed
noise. Each finished (cell, seed, variant) is cached on disk keyed by everything that
determines it, so an interrupted run resumes without recomputing finished work.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

from . import distributions
from .backends import get_backend
from .dataset import to_dataset
from .errors import UsageError, require
from .metrics import METRICS, per_sample
from .provenance import provenance
from .recipe import PRESETS, parse_recipes
from .reference import reference_attention
from .tiles import check_head_dim

# Shape parameters that may sweep, besides the distribution's own parameters.
SHAPE_SWEEPABLE = ("seqlen", "head_dim", "causal")
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
        for d in self.head_dim:
            check_head_dim(d)
        for n in self.seqlen:
            require(n >= 1, f"--seqlen must be >= 1, got {n}")
        require(self.batch >= 1 and self.heads >= 1, "--batch and --heads must be >= 1")
        require(self.kv_heads >= 0 and (self.kv_heads == 0 or self.heads % self.kv_heads == 0),
                f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})")
        require(self.rows >= 0, "--rows must be >= 0 (0 = every query row)")
        require(len(self.seeds) > 0 and len(set(self.seeds)) == len(self.seeds), "--seeds must be distinct integers")
        require(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "--device must be cpu or cuda")
        self.recipes = parse_recipes(";".join(self.variants))
        backend = get_backend(self.backend)
        why = backend.check(self.device)
        require(why is None, f"backend {self.backend!r} cannot run: {why}")
        for label, recipe in self.recipes:
            why = backend.supports(recipe)
            require(why is None, f"variant {label!r} cannot run on backend {self.backend!r}: {why}")

    def sweeps(self) -> dict[str, list]:
        """Every sweepable parameter with its values (distribution params first)."""
        return {**self.params, "seqlen": self.seqlen, "head_dim": self.head_dim, "causal": self.causal}

    def swept_dims(self) -> list[str]:
        return [k for k, v in self.sweeps().items() if len(v) > 1]

    def cells(self) -> list[dict]:
        sw = self.sweeps()
        return [dict(zip(sw, combo)) for combo in itertools.product(*sw.values())]


def list_experiments() -> dict[str, Path]:
    root = importlib.resources.files("fa3_numerics.experiments")
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".toml")}


def load_experiment(name: str, overrides: dict | None = None) -> Experiment:
    """Read experiments/NAME.toml (or a path to a .toml) and apply CLI overrides."""
    known = list_experiments()
    path = Path(name) if name.endswith(".toml") else known.get(name)
    if path is None or not path.is_file():
        raise UsageError(f"unknown experiment {name!r}; choose one of: {', '.join(sorted(known))} or give a .toml path")
    try:
        spec = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from None
    shape = spec.get("shape", {})
    kw = dict(
        name=Path(name).stem, description=spec.get("description", ""), dist=spec.get("dist", "outliers"),
        variants=list(spec.get("variants", list(PRESETS))), params={k: _as_list(v) for k, v in spec.get("params", {}).items()},
        seqlen=_as_list(shape.get("seqlen", [8192])), head_dim=_as_list(shape.get("head_dim", [128])),
        causal=_as_list(shape.get("causal", False)), batch=shape.get("batch", 1), heads=shape.get("heads", 16),
        kv_heads=shape.get("kv_heads", 0), rows=shape.get("rows", 1024), seeds=_as_list(spec.get("run", {}).get("seeds", [0])),
    )
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k in kw["params"] or k in distributions.get(kw["dist"] if "dist" not in overrides or overrides["dist"] is None
                                                       else overrides["dist"]).params:
            kw["params"][k] = _as_list(v)
        else:
            kw[k] = v
    return Experiment(**kw)


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


# -- running -----------------------------------------------------------------------------

def _cell_key(exp: Experiment, cell: dict, seed: int, label: str, spec: str) -> str:
    payload = {"dist": exp.dist, "cell": cell, "seed": seed, "spec": spec, "batch": exp.batch, "heads": exp.heads,
               "kv_heads": exp.kv_heads, "rows": exp.rows, "backend": exp.backend, "device": exp.device.split(":")[0],
               "v": 1}
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _save_npz(path: Path, arrays: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".cell.", suffix=".npz", dir=path.parent)
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_experiment(exp: Experiment, *, cache_dir: Path | None = None,
                   progress: Callable[[str], None] = _progress) -> "xarray.Dataset":  # noqa: F821
    """Run every (cell, seed, variant) not already cached and return the dataset."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    backend = get_backend(exp.backend)
    dims_sw = exp.swept_dims()
    cells = exp.cells()
    b, hkv = exp.batch, exp.kv_heads or exp.heads
    out = {m: np.full((len(cells), len(exp.recipes), len(exp.seeds), b, exp.heads), np.nan) for m in METRICS}
    hist = np.zeros((len(cells), len(exp.seeds), 3, len(HIST_EDGES)), dtype=np.float64)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    total = len(cells) * len(exp.seeds)
    t0 = time.perf_counter()
    done = 0
    reused = 0
    for ci, cell in enumerate(cells):
        dist_params = {k: cell[k] for k in exp.params}
        for si, seed in enumerate(exp.seeds):
            keys = [_cell_key(exp, cell, seed, label, r.spec()) for label, r in exp.recipes]
            paths = [cache_dir / f"{k}.npz" if cache_dir else None for k in keys]
            hpath = cache_dir / (_cell_key(exp, cell, seed, "inputs", "hist") + ".npz") if cache_dir else None
            todo = [i for i, p in enumerate(paths) if p is None or not p.is_file()]
            if hpath is not None and hpath.is_file():
                with np.load(hpath) as z:
                    hist[ci, si] = z["hist"]
            elif not todo:
                todo = [0]  # inputs' histogram missing: recompute one variant to regenerate them
            for i, p in enumerate(paths):
                if i not in todo:
                    with np.load(p) as z:
                        for m in METRICS:
                            out[m][ci, i, si] = z[m]
                    reused += 1
            if todo:
                shape = distributions.AttnShape(b, exp.heads, cell["seqlen"], cell["head_dim"], kv_heads=hkv)
                q, k, v = distributions.generate(exp.dist, shape, seed, **dist_params)
                hist[ci, si] = input_histogram(q, k, v)
                if hpath is not None:
                    _save_npz(hpath, {"hist": hist[ci, si]})
                q, k, v = (t.to(exp.device) for t in (q, k, v))
                n = cell["seqlen"]
                if exp.rows and exp.rows < n:
                    g = torch.Generator().manual_seed(_rows_seed(seed))
                    q_index = torch.randperm(n, generator=g)[: exp.rows].sort().values
                else:
                    q_index = torch.arange(n)
                q_index = q_index.to(exp.device)
                ref = reference_attention(q, k, v, causal=cell["causal"], q_index=q_index)
                cache: dict = {}
                for i in todo:
                    label, recipe = exp.recipes[i]
                    o = backend.attention(recipe, q, k, v, causal=cell["causal"], q_index=q_index,
                                          rotation_seed=seed, cache=cache)
                    vals = per_sample(o, ref)
                    for m in METRICS:
                        out[m][ci, i, si] = vals[m]
                    if paths[i] is not None:
                        _save_npz(paths[i], vals)
                del q, k, v, ref, cache
            done += 1
            el = time.perf_counter() - t0
            where = ", ".join(f"{k}={cell[k]}" for k in dims_sw) or "single cell"
            progress(f"[{done}/{total}] {where}, seed {seed}: {len(todo)} computed, "
                     f"{len(exp.recipes) - len(todo)} from cache; {el:.1f} s elapsed, "
                     f"~{el / done * (total - done):.0f} s left")
    return _assemble(exp, out, hist, cells, dims_sw, time.perf_counter() - t0, reused)


def input_histogram(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """Counts of |x| per HIST_EDGES bin for Q, K, V -> [3, bins]; the last bin counts |x| >= 1000."""
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    rows = []
    for t in (q, k, v):
        idx = torch.bucketize(t.abs().flatten(), edges, right=True) - 1
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
