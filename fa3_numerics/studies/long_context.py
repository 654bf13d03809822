"""`run long-context`: does FP22 accumulation lose a needle in a long context, prefill or decode?

Exposed: ``LongContextStudy``, ``RECIPES``, ``findings``, ``LOST_SHARE``, ``LOST_TOP``.

A needle (``data/distributions/needle.py``: one key at a chosen depth with an exact softmax mass,
decoys, an optional sink, V rows with a shared mean) is retrieved by:

- ``prefill``: the last ``rows`` query rows of a causal prefill, one flash pass (no split);
- ``decode``: one query row against the whole FP8 cache in one split (what FA3 does when a
  serving batch fills the GPU: its heuristic then never splits);
- ``split``: one query row through FA3's split-KV path with ``splits`` splits (0 = the number
  FA3's heuristic picks for a lone request: 57 at 128K with 2 KV heads on an H200), partials
  combined in float32 (``numerics/split_kv.py``).

Recipes: the FA3 kernel's (``fa3-fp8-kernel``: per-head descales, ``acc=fp22``), the same with a
float32 accumulator, ``two-level`` (vLLM's per-tile flush) and ``flush=N`` for each N in
``flush``, all through the emulator; with ``kernel fa3`` the compiled kernel beside them (a
Hopper GPU, the same FP8 bytes and descales), with ``kernel_match`` the fraction of its outputs
the ``fp22`` emulation reproduces bit for bit. Per (length, mode, sink, weight, depth, seed, head)
the metrics of ``numerics/metrics/retrieval.py``, averaged over the query rows.

The answer the report opens with comes from ``findings``: per recipe, mode, sink and weight, the
shortest length at which the accumulator loses the needle (its mass relative to the fp32
accumulator's on the same FP8 inputs, ``acc_share``, has a 95% BCa upper bound below ``LOST_SHARE``,
or the rate at which it stays above the decoys falls 1 - ``LOST_TOP`` below fp32's), over
depth x seed x head samples. ``share`` against the float64 reference includes the FP8 Q/K
quantization's own noise on the needle's logit. One cached cell per (length, mode, sink, batch of configurations): an interrupted run
resumes, and a rerun with more lengths computes only those.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch
import xarray as xr

from ..engine.study import Study, StudyContext, StudyOption
from ..errors import UsageError, require

STUDY_MODULES = ["fa3_numerics.studies.long_context", "fa3_numerics.data.distributions.needle",
                 "fa3_numerics.numerics.metrics.retrieval", "fa3_numerics.numerics.split_kv"]
KERNEL_RECIPE = "fa3-fp8-kernel"
# label -> recipe: the kernel's model and the fixes beside it (``flush`` adds acc=fp22,flush=N)
RECIPES = {"fp22": "fa3-fp8-kernel", "fp32": "fa3-fp8-kernel,acc=fp32", "two-level": "fa3-fp8-kernel,acc=two-level"}
MODES = ("prefill", "decode", "split")
VARS = ("share", "mass", "margin", "top", "rank", "row_rel_rmse")
# The needle counts as lost by the accumulator when more than 10% of its mass is gone against the
# fp32 accumulator on the same inputs (95% upper bound), or when it stays above every decoy in 10%
# fewer samples than with fp32.
LOST_SHARE = 0.9
LOST_TOP = 0.9


class LongContextStudy(Study):
    """The study (module docstring) on the ``engine.study`` protocol."""

    kind = "long-context"
    stem = "long_context"
    command = "run long-context"
    help = ("Needle retrieval at long context under FA3's FP8 recipe: the needle value's share of the output, "
            "its attention mass and whether it stays above the decoys, for the FP22 accumulator, float32, "
            "two-level and flush-every-N, in prefill, decode and split-KV decode. Writes OUT/long_context.nc and "
            "OUT/report.md; finished cells are kept in OUT/.cells, so a rerun resumes.")
    options = (
        StudyOption("lengths", int, "context lengths (keys), a comma list", (4096, 16384), many=True),
        StudyOption("weights", float, "needle softmax masses (exact), a comma list", (0.05, 0.2), many=True),
        StudyOption("depths", float, "needle depths in the context (0 = oldest key)", (0.1, 0.5, 0.9), many=True),
        StudyOption("modes", str, "prefill, decode (one row, no split), split (one row, FA3's split-KV)",
                    MODES, many=True),
        StudyOption("sinks", float, "attention-sink masses (0 = no sink), a comma list", (0.0,), many=True),
        StudyOption("flush", int, "N of the acc=fp22,flush=N recipes, a comma list (empty: none)", (2, 4, 16),
                    many=True),
        StudyOption("kernel", str, "also run a kernel: none, fa3 (a Hopper GPU) or fa3-mock (a stand-in)", "none"),
        StudyOption("splits", int, "splits of mode split (0 = FA3's heuristic for one request)", 0),
        StudyOption("rows", int, "query rows measured in prefill (the last ones)", 8),
        StudyOption("heads", int, "heads (independent samples)", 2),
        StudyOption("head_dim", int, "head dim", 128),
        StudyOption("seeds", int, "seeds, a comma list", (0, 1), many=True),
        StudyOption("spread", float, "std of the distractors' logits", 1.5),
        StudyOption("vmean", float, "norm of the V rows' shared mean relative to their noise", 0.5),
        StudyOption("decoys", int, "decoy keys, each with its own V direction", 3),
        StudyOption("device", str, "cpu or cuda[:N]", "cpu"),
        StudyOption("batch_keys", int, "most batch x keys held at once (memory)", 1 << 22),
    )
    examples = (
        "fa3-numerics run long-context --out lc                                      # CPU, 4K and 16K",
        "fa3-numerics run long-context --device cuda --kernel fa3 --lengths 8192,32768,131072 --sinks 0,0.5",
    )

    def __init__(self, lengths=None, weights=None, depths=None, modes=None, sinks=None, flush=None, kernel=None,
                 splits=None, rows=None, heads=None, head_dim=None, seeds=None, spread=None, vmean=None,
                 decoys=None, device=None, batch_keys=None):
        from ..data.distributions.needle import PARAMS, validate_params
        from ..engine.backends import check_device
        from ..numerics.recipe import Recipe

        self.lengths = sorted(set(lengths or [4096, 16384]))
        self.weights = list(weights or [0.05, 0.2])
        self.depths = list(depths or [0.1, 0.5, 0.9])
        self.modes = list(modes or MODES)
        self.sinks = list(sinks if sinks is not None else [0.0])
        self.flush = list(flush if flush is not None else [2, 4, 16])
        self.kernel = kernel or "none"
        self.splits = 0 if splits is None else int(splits)
        self.rows = rows or 8
        self.heads = heads or 2
        self.head_dim = head_dim or 128
        self.seeds = list(seeds if seeds is not None else [0, 1])
        self.spread = 1.5 if spread is None else spread
        self.vmean = 0.5 if vmean is None else vmean
        self.decoys = 3 if decoys is None else decoys
        self.device = check_device(device or "cpu")
        self.batch_keys = batch_keys or (1 << 22)
        bad = set(self.modes) - set(MODES)
        require(not bad, f"--modes {','.join(sorted(bad))}: choose from {', '.join(MODES)}")
        require(self.kernel in ("none", "fa3", "fa3-mock"), f"--kernel {self.kernel}: choose none, fa3 or fa3-mock")
        require(all(f >= 1 for f in self.flush), "--flush values are N >= 1 KV tiles")
        require(self.splits >= 0, "--splits must be >= 0 (0 = FA3's heuristic)")
        require(all(n > self.rows + self.decoys + 2 for n in self.lengths), "--lengths must exceed --rows + --decoys + 2")
        require(self.seeds and self.depths and self.weights and self.sinks, "give at least one seed, depth, weight, sink")
        for w in self.weights:
            for s in self.sinks:
                for dp in self.depths:
                    validate_params({k: v[0] for k, v in PARAMS.items()} | dict(
                        weight=w, sink=s, depth=dp, spread=self.spread, vmean=self.vmean, decoys=float(self.decoys)))
        self.recipes = dict(RECIPES) | {f"flush{n}": f"fa3-fp8-kernel,acc=fp22,flush={n}" for n in self.flush}
        self.parsed = {k: Recipe.from_str(v) for k, v in self.recipes.items()}
        self.tiles = self.parsed["fp22"].tiles(self.head_dim, True)
        if self.kernel != "none":
            from ..engine.backends import get_backend

            why = get_backend(self.kernel).check(self.device)
            if why:
                raise UsageError(f"--kernel {self.kernel}: {why}")

    def labels(self) -> list[str]:
        return ([self.kernel] if self.kernel != "none" else []) + list(self.recipes)

    def describe(self) -> str:
        return (f"long-context: {len(self.lengths)} length(s) x {len(self.modes)} mode(s) x {len(self.sinks)} sink(s) "
                f"x {len(self.weights)} weight(s) x {len(self.depths)} depth(s) x {len(self.seeds)} seed(s), "
                f"recipes {', '.join(self.labels())} on {self.device}")

    def num_splits(self, n: int) -> int:
        from ..numerics.split_kv import fa3_num_splits

        if self.splits:
            return self.splits
        return fa3_num_splits(batch=1, kv_heads=self.heads, heads=self.heads, seqlen_q=1, seqlen_k=n,
                              block_m=self.tiles[0], block_n=self.tiles[1], head_dim=self.head_dim)

    def _configs(self) -> list[tuple[float, float, int]]:
        return [(w, dp, s) for w in self.weights for dp in self.depths for s in self.seeds]

    def run(self, ctx: StudyContext):
        store = ctx.cells({"study": "long-context", "heads": self.heads, "head_dim": self.head_dim,
                           "rows": self.rows, "spread": self.spread, "vmean": self.vmean, "decoys": self.decoys,
                           "recipes": self.recipes, "kernel": self.kernel}, STUDY_MODULES,
                          backend=self.kernel if self.kernel != "none" else "emulate", device=self.device)
        cfgs = self._configs()
        jobs = []
        for n in self.lengths:
            per = max(1, self.batch_keys // n)
            for mode in self.modes:
                for sink in self.sinks:
                    for c0 in range(0, len(cfgs), per):
                        jobs.append((n, mode, sink, cfgs[c0:c0 + per]))
        total_keys = sum(n * len(c) for n, _, _, c in jobs)
        done_keys, t0, out = 0, time.perf_counter(), {}
        for i, (n, mode, sink, chunk) in enumerate(jobs):
            payload = {"length": n, "mode": mode, "sink": sink, "configs": chunk,
                       "splits": self.num_splits(n) if mode == "split" else 1}
            key = store.key(payload)
            got = store.get(key)
            t = time.perf_counter()
            if got is None:
                got = self._cell(n, mode, sink, chunk, payload["splits"])
                store.put(key, got)
                how = f"{time.perf_counter() - t:.1f} s"
            else:
                how = "cached"
            done_keys += n * len(chunk)
            rate = (time.perf_counter() - t0) / max(done_keys, 1)
            left = rate * (total_keys - done_keys)
            ctx.echo(f"[{i + 1}/{len(jobs)}] length {n}, {mode}"
                     + (f" ({payload['splits']} splits)" if mode == "split" else "")
                     + f", sink {sink:g}, {len(chunk)} configs: {how}; about {left:.0f} s left")
            for j, cfg in enumerate(chunk):
                out[(n, mode, sink, *cfg)] = {k: v[:, j] for k, v in got.items()}
        return out

    def _cell(self, n: int, mode: str, sink: float, chunk, splits: int) -> dict:
        """Every recipe on one batch of configurations: {var/label: [labels..., configs, heads]}."""
        from ..data.distributions import AttnShape
        from ..data.distributions.needle import plant
        from ..numerics.metrics.retrieval import retrieval
        from ..numerics.reference import reference_attention

        rows = self.rows if mode == "prefill" else 1
        shape = AttnShape(1, self.heads, rows, self.head_dim, seqlen_k=n)
        parts = [plant(shape, seed, depth=dp, weight=w, spread=self.spread, decoys=float(self.decoys),
                       decoy_ratio=0.5, sink=sink, sink_v=0.25, vmean=self.vmean, qcorr=0.9, device=self.device)
                 for w, dp, seed in chunk]
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        q, k, v, u, du = cat("q"), cat("k"), cat("v"), cat("u"), cat("decoy_u")
        del parts[1:]
        w = torch.tensor([c[0] for c in chunk], dtype=torch.float64, device=q.device)[:, None, None]
        ref = reference_attention(q, k, v, causal=True)
        outs = {}
        cache: dict = {}  # every recipe here quantizes Q, K, V alike: prepared once per cell
        if self.kernel != "none":
            outs[self.kernel] = self._kernel(q, k, v, splits, cache)
        for label, recipe in self.parsed.items():
            outs[label] = self._emulate(recipe, q, k, v, mode, splits, cache)
        res: dict[str, list] = {}
        for label, o in outs.items():
            m = retrieval(o, ref, u, du, parts[0].v_norm, w, 0.5 * w).as_dict()
            for var in VARS:
                res.setdefault(var, []).append(m[var].mean(dim=-1).cpu().numpy())  # [configs, heads]
        got = {var: np.stack(vals) for var, vals in res.items()}
        if self.kernel != "none":
            same = (outs[self.kernel] == outs["fp22"]).to(torch.float64).mean(dim=(-1, -2))
            got["kernel_match"] = same.cpu().numpy()[None]
        return got

    def _emulate(self, recipe, q, k, v, mode: str, splits: int, cache: dict) -> torch.Tensor:
        from ..numerics.emulator import emulate
        from ..numerics.split_kv import emulate_split

        if mode == "prefill":
            return emulate(recipe, q, k, v, causal=True, cache=cache)
        return emulate_split(recipe, q, k, v, num_splits=splits if mode == "split" else 1, cache=cache)

    def _kernel(self, q, k, v, splits: int, cache: dict) -> torch.Tensor:
        """The kernel on the emulator's FP8 bytes and descales (``kernels/fa3.py``), with ``splits``."""
        from ..engine.backends import get_backend
        from ..kernels.fa3 import flash_attn, kernel_inputs
        from ..numerics.emulator import prepare
        from ..numerics.recipe import Recipe

        recipe = Recipe.from_str(KERNEL_RECIPE)
        backend = get_backend(self.kernel)
        pre = prepare(recipe, q, k, v, q_index=torch.arange(q.shape[2], device=q.device), causal=True, cache=cache)
        ins = kernel_inputs(pre, recipe, k.shape[1])
        o = flash_attn(ins["q"], ins["k"], ins["v"], softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=True,
                       descales=ins["descales"], fn=backend.kernel_fn, num_splits=splits)
        return o.transpose(1, 2).to(torch.float64)

    def assemble(self, results: dict) -> xr.Dataset:
        labels = self.labels()
        dims = ("recipe", "length", "mode", "sink", "weight", "depth", "seed", "head")
        shape = (len(labels), len(self.lengths), len(self.modes), len(self.sinks), len(self.weights),
                 len(self.depths), len(self.seeds), self.heads)
        names = list(VARS) + (["kernel_match"] if self.kernel != "none" else [])
        arrays = {name: np.full(shape if name != "kernel_match" else shape[1:], np.nan) for name in names}
        for (n, mode, sink, w, dp, seed), got in results.items():
            at = (self.lengths.index(n), self.modes.index(mode), self.sinks.index(sink), self.weights.index(w),
                  self.depths.index(dp), self.seeds.index(seed))
            for name in names:
                if name == "kernel_match":
                    arrays[name][at] = got[name][0]
                else:
                    arrays[name][(slice(None), *at)] = got[name]
        from ..data.distributions import rng_stream
        from ..numerics.metrics.retrieval import RETRIEVAL_VARS

        data = {name: (dims if name != "kernel_match" else dims[1:], arr,
                       {"long_name": RETRIEVAL_VARS.get(name, "fraction of the kernel's outputs the fp22 emulation "
                                                               "reproduces bit for bit")})
                for name, arr in arrays.items()}
        ds = xr.Dataset(data, coords={
            "recipe": labels, "length": self.lengths, "mode": self.modes, "sink": self.sinks, "weight": self.weights,
            "depth": self.depths, "seed": self.seeds, "head": list(range(self.heads)),
            "spec": ("recipe", [self.recipes.get(x, KERNEL_RECIPE + " (compiled kernel)") for x in labels]),
            "num_splits": ("length", [self.num_splits(n) for n in self.lengths])})
        # The accumulator's own effect: the same FP8 Q, K, V and P as the fp32 recipe, so the ratio of
        # needle masses removes the Q/K quantization's logit noise (which moves a large needle logit by
        # tenths of a nat) and leaves what the accumulation did.
        ds["acc_share"] = (ds["mass"] / ds["mass"].sel(recipe="fp32")).assign_attrs(
            long_name="needle mass relative to the fp32-accumulator recipe on the same FP8 inputs")
        from ..engine.provenance import provenance

        ds.attrs.update(provenance(self.device))  # versions (torch, fa3-numerics), host, commit, command, time
        ds.attrs.update({
            "backend": "emulate" if self.kernel == "none" else f"emulate + {self.kernel}",
            "title": "long-context needle retrieval under FP8 attention", "dist": "needle",
            "rows": self.rows, "head_dim": self.head_dim, "spread": self.spread, "vmean": self.vmean,
            "decoys": self.decoys, "decoy_ratio": 0.5, "sink_v": 0.25, "qcorr": 0.9, "device": self.device,
            "kv_tile": f"{self.tiles[0]}x{self.tiles[1]}", "reference": "float64 softmax attention",
            "rng_stream": rng_stream("needle", self.device),
            "lost_rule": f"acc_share 95% upper bound < {LOST_SHARE} or top rate {1 - LOST_TOP:g} below fp32's"})
        if self.kernel != "none":
            from ..engine.backends import get_backend

            ds.attrs.update(get_backend(self.kernel).provenance())
        ds.attrs["findings"] = json.dumps(findings(ds))
        return ds


def _ci(values: np.ndarray) -> tuple[float, float, float]:
    from ..numerics.metrics.bootstrap import bca, pool_fn

    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size < 2 or np.ptp(v) == 0:
        m = float(v.mean()) if v.size else math.nan
        return m, m, m
    est, lo, hi = bca(pool_fn("mean"), (v,))
    return float(est), float(lo), float(hi)


def findings(ds: xr.Dataset) -> dict:
    """Per (recipe, mode, sink, weight, length): share and top rate with 95% BCa intervals over the
    depth x seed x head samples, whether the needle is lost there; and per (recipe, mode, sink,
    weight) the shortest length at which it is lost (None: kept at every length)."""
    cells, first = [], []
    for r in ds.recipe.values:
        for mode in ds["mode"].values:
            for sink in ds.sink.values:
                for w in ds.weight.values:
                    lost_at = None
                    for n in ds.length.values:
                        sel = dict(recipe=r, mode=mode, sink=sink, weight=w, length=n)
                        share = _ci(ds["share"].sel(sel).values)
                        acc = _ci(ds["acc_share"].sel(sel).values)
                        top = _ci(ds["top"].sel(sel).values)
                        top32 = float(ds["top"].sel(sel | {"recipe": "fp32"}).mean())
                        rmse = _ci(ds["row_rel_rmse"].sel(sel).values)
                        lost = bool(acc[2] < LOST_SHARE or top[0] < top32 - (1 - LOST_TOP))
                        if lost and lost_at is None:
                            lost_at = int(n)
                        cells.append({"recipe": str(r), "mode": str(mode), "sink": float(sink), "weight": float(w),
                                      "length": int(n), "share": share, "acc_share": acc, "top": top, "row_rel_rmse": rmse,
                                      "lost": lost, "n": int(ds["share"].sel(sel).size)})
                    first.append({"recipe": str(r), "mode": str(mode), "sink": float(sink), "weight": float(w),
                                  "lost_at": lost_at, "longest": int(ds.length.values[-1])})
    return {"cells": cells, "first_loss": first, "lost_share": LOST_SHARE, "lost_top": LOST_TOP}
