"""Effects in an ablation dataset: main effects, two-way interactions, paired contrasts.

Exposed: ``Frame``, ``CELL_DIMS``, ``cell_frame``, ``dataset_factors``, ``main_effects``,
``interactions``, ``interaction_means``, ``per_data_effects``, ``ratio``, ``growth``, ``paper_finding``,
``block_quant_effect``, ``base_shape``, ``seqlen_table``, ``NAMED``, ``named_variants``.

The response is log10 of the pooled RMSE of a (data, seqlen, head_dim, causal, variant)
cell, pooled over its (seed, batch, head) samples as sqrt(mean(rmse^2)). Effects use
matched sets: for a factor F, a set is all cells that agree on every other factor and
differ only in F; only sets holding every level of F's largest complete level set count
(the designs are unions of factorials, so e.g. the accumulator's effect comes from the
accumulator design alone). A level's main effect is the mean over sets of (cell - set
mean), reported as a factor on RMSE (10^effect); a factor's size is max - min over its
levels. A two-way interaction F x G uses sets complete in F x G; its size is the RMS of
the residual cell - row mean - column mean + set mean, in log10 units.

The factors are the dataset's own (``dataset_factors``: recorded when it was made, so a factor
registered since does not change how an old dataset reads). Cells that ran with non-finite
samples cannot enter a log-RMSE: they are left out and listed in ``Frame.nonfinite``, which the
report prints; they are never dropped silently.

Intervals: BCa bootstrap (``scipy.stats.bootstrap`` through
``fa3_numerics.numerics.metrics.bootstrap.bca``) of each effect as a statistic of the per-sample
RMSEs of the cells it involves. The (seed, batch, head) samples are resampled jointly for every
cell (the same samples index every cell, so paired contrasts keep their pairing), ``n_boot``
resamples with a fixed seed; ``fa3_numerics.numerics.metrics.bootstrap_ci`` for single cells.
Every statistic below is written over the rows of ``Frame.x`` and keeps any trailing axes, which
is how scipy evaluates it on all resamples at once. The prose and figures of the report are
``fa3_numerics.report.ablation``.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import xarray as xr

CELL_DIMS = ("data", "seqlen", "head_dim", "causal")
LEVEL = 0.95


def dataset_factors(ds: xr.Dataset) -> list[str]:
    """The ablation factors of ``ds``, in its label order."""
    if "factors" in ds.attrs:
        from ..engine.conventions import attr_list

        return [f for f in attr_list(ds, "factors") if f in ds.coords]
    from ..numerics.keys import factors

    return [f for f in factors() if f in ds.coords]


def _defaults(fr) -> dict:
    from ..numerics.keys import factors

    reg = factors()
    return {f: reg[f].default for f in fr.factors if f in reg}



class Frame:
    """Cells as rows: ``df`` (factor columns, string-valued), ``x`` [rows, samples] (each
    sample's RMSE) and ``y`` [rows] (log10 of the RMSE pooled over the samples);
    ``nonfinite``: the cells that ran but hold non-finite samples (row dicts), left out of ``df``.
    ``n_boot`` and ``seed`` are those of every interval computed from it."""

    def __init__(self, df, x, order, factors, nonfinite=(), n_boot: int = 1000, seed: int = 0):
        self.df, self.x, self.order, self.factors = df, np.asarray(x, dtype=np.float64), order, list(factors)
        self.y = _log_rms(self.x)
        self.nonfinite = list(nonfinite)
        self.n_boot, self.seed = n_boot, seed

    @property
    def analysis_factors(self) -> tuple[str, ...]:
        return tuple(self.factors) + CELL_DIMS

    @property
    def samples(self) -> int:
        return self.x.shape[-1]

    def subset(self, mask) -> "Frame":
        mask = np.asarray(mask)
        return Frame(self.df[mask].reset_index(drop=True), self.x[mask], self.order, self.factors,
                     n_boot=self.n_boot, seed=self.seed)

    def interval(self, mask, stat):
        """(estimate, lo, hi) of ``stat(y)``, ``y`` the log10 pooled RMSE of the rows in ``mask``
        (its first axis; ``stat`` keeps any trailing ones), by BCa over the samples."""
        from ..numerics.metrics.bootstrap import bca

        x = self.x[np.asarray(mask)]
        return bca(lambda xs, axis=-1: stat(_log_rms(xs, axis=axis)), (x,), level=LEVEL, n_boot=self.n_boot,
                   seed=self.seed)


def _log_rms(x: np.ndarray, axis: int = -1) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log10(np.sqrt(np.mean(np.asarray(x) ** 2, axis=axis)))


def cell_frame(ds: xr.Dataset, *, n_boot: int = 1000, seed: int = 0) -> Frame:
    """Every full-recipe cell that ran, with its per-sample RMSEs (``n_boot``: resamples of the
    intervals computed from the frame)."""
    import pandas as pd

    factors = dataset_factors(ds)
    full = [str(v) for v, s in zip(ds["variant"].values, ds["stage"].values) if s == "full"]
    da = ds["rmse"].sel(variant=full).stack(sample=("seed", "batch", "head"))
    da = da.transpose(*CELL_DIMS, "variant", "sample")
    x = da.values
    if "nonfinite" in ds:  # a cell ran when its count is not NaN
        ran = ds["nonfinite"].sel(variant=full).stack(sample=("seed", "batch", "head")) \
            .transpose(*CELL_DIMS, "variant", "sample").notnull().values.any(axis=-1)
    else:
        ran = np.isfinite(x).any(axis=-1)
    x = x.reshape(-1, x.shape[-1])
    grid = list(itertools.product(*(range(da.shape[i]) for i in range(len(CELL_DIMS) + 1))))
    rows = []
    for ci in grid:
        row = {d: str(da.coords[d].values[i]) for d, i in zip(CELL_DIMS, ci)}
        v = full[ci[-1]]
        for f in factors:
            row[f] = str(ds[f].sel(variant=v).item())
        row["variant"] = v
        rows.append(row)
    df = pd.DataFrame(rows)
    finite = np.isfinite(x).all(axis=1)
    ok = finite & (x > 0).all(axis=1)  # a zero RMSE has no logarithm (an exact recipe)
    bad = ran.reshape(-1) & ~finite
    order = {f: list(dict.fromkeys(str(ds[f].sel(variant=v).item()) for v in full)) for f in factors}
    for d in CELL_DIMS:
        order[d] = [str(v) for v in ds[d].values]
    return Frame(df[ok].reset_index(drop=True), x[ok], order, factors,
                 [rows[i] for i in np.flatnonzero(bad)], n_boot=n_boot, seed=seed)


def _active(fr: Frame, factors) -> list[str]:
    return [f for f in factors if fr.df[f].nunique() > 1]


def _complete_sets(fr: Frame, on: list[str]):
    """Matched sets complete in the factors ``on``: (mask of rows used, group ids, levels per factor)."""
    others = [f for f in fr.analysis_factors if f not in on]
    key = fr.df[others].astype(str).agg("|".join, axis=1) if others else fr.df[on[0]].map(lambda _: "all")
    sig = {}
    for g, sub in fr.df.groupby(key, sort=False):
        levels = tuple(tuple(sorted(sub[f].unique(), key=fr.order[f].index)) for f in on)
        if any(len(lv) < 2 for lv in levels) or len(sub) != math.prod(len(lv) for lv in levels):
            continue
        sig.setdefault(levels, []).append(g)
    if not sig:
        return None
    levels = max(sig, key=lambda s: (math.prod(len(lv) for lv in s), len(sig[s])))
    groups = set(sig[levels])
    mask = key.isin(groups).to_numpy()
    codes = key[mask].astype("category").cat.codes.to_numpy()
    return mask, codes, levels, len(groups)


def _group_mean(y: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Mean of ``y`` (first axis: rows) over the rows of each group, put back on every row."""
    n = codes.max() + 1
    flat = y.reshape(y.shape[0], -1)
    s = np.zeros((n, flat.shape[1]))
    np.add.at(s, codes, flat)
    c = np.bincount(codes, minlength=n)[:, None]
    return (s / c)[codes].reshape(y.shape)


def main_effects(fr: Frame, factors=None) -> "pandas.DataFrame":  # noqa: F821
    """One row per (factor, level): effect on log10 RMSE, as a factor on RMSE, with CI."""
    import pandas as pd

    rows = []
    for f in _active(fr, factors or fr.analysis_factors):
        got = _complete_sets(fr, [f])
        if got is None:
            continue
        mask, codes, (levels,), n_sets = got
        lv = fr.df[f][mask].to_numpy()
        pick = [lv == level for level in levels]

        def stat(y, codes=codes, pick=pick):
            dev = y - _group_mean(y, codes)
            eff = np.stack([dev[p].mean(axis=0) for p in pick])  # [levels, ...]
            return np.concatenate([eff, (eff.max(axis=0) - eff.min(axis=0))[None]])

        est, lo, hi = fr.interval(mask, stat)
        for k, level in enumerate(levels):
            rows.append({"factor": f, "level": level, "effect_log10": est[k], "ratio": 10 ** est[k],
                         "lo": 10 ** lo[k], "hi": 10 ** hi[k], "sets": n_sets, "size": 10 ** est[-1],
                         "size_lo": 10 ** lo[-1], "size_hi": 10 ** hi[-1]})
    return pd.DataFrame(rows)


def interaction_means(fr: Frame, f: str, g: str):
    """Mean log10 RMSE per (f level, g level) over sets complete in f x g, with BCa intervals;
    None when no such set exists. Returns (levels_f, levels_g, mean, lo, hi [Lf, Lg], sets)."""
    got = _complete_sets(fr, [f, g])
    if got is None:
        return None
    mask, codes, (lf, lg), n_sets = got
    a, b = fr.df[f][mask].to_numpy(), fr.df[g][mask].to_numpy()
    picks = [[(a == x) & (b == z) for z in lg] for x in lf]

    def stat(y):
        return np.stack([np.stack([y[p].mean(axis=0) for p in row]) for row in picks])

    est, lo, hi = fr.interval(mask, stat)
    return lf, lg, est, lo, hi, n_sets


def interactions(fr: Frame, factors=None) -> "pandas.DataFrame":  # noqa: F821
    """One row per factor pair: RMS interaction residual (log10) with CI, as x-fold."""
    import pandas as pd

    rows = []
    for f, g in itertools.combinations(_active(fr, factors or fr.analysis_factors), 2):
        got = _complete_sets(fr, [f, g])
        if got is None:
            continue
        mask, codes, (lf, lg), n_sets = got
        a, b = fr.df[f][mask].to_numpy(), fr.df[g][mask].to_numpy()
        picks = [[(a == x) & (b == z) for z in lg] for x in lf]

        def stat(y, picks=picks):
            m = np.stack([np.stack([y[p].mean(axis=0) for p in row]) for row in picks])  # [Lf, Lg, ...]
            r = m - m.mean(axis=1, keepdims=True) - m.mean(axis=0, keepdims=True) + m.mean(axis=(0, 1), keepdims=True)
            return np.sqrt((r ** 2).mean(axis=(0, 1)))

        est, lo, hi = fr.interval(mask, stat)
        rows.append({"f": f, "g": g, "levels": f"{len(lf)}x{len(lg)}", "sets": n_sets, "rms_log10": float(est),
                     "fold": 10 ** float(est), "fold_lo": 10 ** float(lo), "fold_hi": 10 ** float(hi)})
    out = pd.DataFrame(rows)
    return out.sort_values("rms_log10", ascending=False).reset_index(drop=True) if len(out) else out


def per_data_effects(fr: Frame) -> "pandas.DataFrame":  # noqa: F821
    """Main-effect size (x-fold, max/min level) of every factor within each data."""
    import pandas as pd

    parts = []
    for d in fr.order["data"]:
        sub = fr.subset(fr.df["data"] == d)
        if len(sub.df) == 0:
            continue
        me = main_effects(sub, [f for f in fr.analysis_factors if f != "data"])
        if len(me):
            parts.append(me.assign(data=d))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


# -- paired contrasts -----------------------------------------------------------------------

def _lookup(fr: Frame, **fix) -> np.ndarray:
    m = np.ones(len(fr.df), dtype=bool)
    for k, v in fix.items():
        m &= (fr.df[k] == str(v)).to_numpy()
    return m


def ratio(fr: Frame, a: dict, b: dict, where: dict) -> tuple[float, float, float] | None:
    """RMSE(a) / RMSE(b) at the cells ``where`` (geometric mean over the cells that match
    both), with CI; a and b fix factor levels, unfixed factors default to the base recipe."""
    base = {**_defaults(fr), **where}
    ma, mb = _lookup(fr, **{**base, **a}), _lookup(fr, **{**base, **b})
    if not ma.any() or not mb.any():
        return None
    keys = [k for k in CELL_DIMS if k not in where]
    ka = fr.df[ma][keys].astype(str).agg("|".join, axis=1).to_numpy() if keys else np.array(["x"] * ma.sum())
    kb = fr.df[mb][keys].astype(str).agg("|".join, axis=1).to_numpy() if keys else np.array(["x"] * mb.sum())
    common = sorted(set(ka) & set(kb))
    if not common:
        return None
    ia, ib = np.flatnonzero(ma), np.flatnonzero(mb)
    rows_a = [ia[np.flatnonzero(ka == c)[0]] for c in common]
    rows_b = [ib[np.flatnonzero(kb == c)[0]] for c in common]
    n = len(common)
    est, lo, hi = fr.interval(np.array(rows_a + rows_b), lambda y: (y[:n] - y[n:]).mean(axis=0))
    return 10 ** float(est), 10 ** float(lo), 10 ** float(hi)


def growth(fr: Frame, variant: str, data: str, frm, to, where: dict | None = None) -> tuple[float, float, float] | None:
    """RMSE at seqlen ``to`` / at seqlen ``frm`` of one variant on one data (at ``where``: the
    base shape), with CI; None when either cell is missing."""
    fix = {"variant": variant, "data": data, **(where or {})}
    hi, lo = _lookup(fr, seqlen=to, **fix), _lookup(fr, seqlen=frm, **fix)
    if not hi.any() or not lo.any():
        return None
    idx = np.array([np.flatnonzero(hi)[0], np.flatnonzero(lo)[0]])
    est, lo_, hi_ = fr.interval(idx, lambda y: y[0] - y[1])
    return 10 ** float(est), 10 ** float(lo_), 10 ** float(hi_)


def paper_finding(fr: Frame, data: str, base: dict | None = None, scale: str | None = None) -> dict:
    """Table 3's two ablations on one data, per seqlen and over all: rotation's gain
    RMSE(block, none) / RMSE(block, hadamard) and block quantization's gain
    RMSE(tensor, hadamard) / RMSE(block, hadamard), P offset 8, FP32, e4m3, with ``scale``
    (amax or pow2 descales) at the base shape (head_dim, causal) when given."""
    out = {}
    base = {k: str(v) for k, v in (base or {}).items()}
    seqlens = [s for s in fr.order["seqlen"] if ((fr.df["data"] == data) & (fr.df["seqlen"] == s)).any()]
    scale = scale or "amax"
    for s in seqlens + ["all"]:
        where = {"data": data, **base} if s == "all" else {"data": data, "seqlen": s, **base}
        where["scale"] = scale
        rot = ratio(fr, {"gran": "block", "rot": "none"}, {"gran": "block", "rot": "hadamard"}, where)
        blk = ratio(fr, {"gran": "tensor", "rot": "hadamard"}, {"gran": "block", "rot": "hadamard"}, where)
        if rot and blk:
            out[s] = {"rotation_gain": rot, "block_gain": blk}
    return out


def block_quant_effect(fr: Frame, base: dict | None = None) -> "pandas.DataFrame":  # noqa: F821
    """RMSE(block) / RMSE(tensor) and RMSE(block) / RMSE(head) for every data, seqlen,
    rotation and P handling of the core design (FP32, e4m3) at the base shape, with CIs."""
    import pandas as pd

    rows = []
    if "block" not in fr.order["gran"]:
        return pd.DataFrame()
    base = {k: str(v) for k, v in (base or {}).items()}
    for d, s, rot, p, sc in itertools.product(fr.order["data"], fr.order["seqlen"], fr.order["rot"], fr.order["p"],
                                              fr.order["scale"]):
        where = {"data": d, "seqlen": s, "rot": rot, "p": p, "scale": sc, **base}
        for ref in ("tensor", "head"):
            r = ratio(fr, {"gran": "block"}, {"gran": ref}, where)
            if r:
                rows.append({"data": d, "seqlen": int(s), "rot": rot, "p": p, "scale": sc, "vs": ref, "ratio": r[0],
                             "lo": r[1], "hi": r[2]})
    return pd.DataFrame(rows)


def base_shape(ds: xr.Dataset) -> dict:
    """The head dim and causal flag of the run's main shape (designs may add others)."""
    if "base_shape" in ds.attrs:
        b = json.loads(ds.attrs["base_shape"])
        return {"head_dim": int(b["head_dim"]), "causal": bool(b["causal"])}
    return {"head_dim": int(ds["head_dim"].values[0]), "causal": bool(ds["causal"].values[0])}


def seqlen_table(ds: xr.Dataset, variants: list[str]) -> "pandas.DataFrame":  # noqa: F821
    """Pooled RMSE per (data, seqlen, variant) at the base shape, with metrics.bootstrap_ci intervals."""
    import pandas as pd

    from ..numerics.metrics import bootstrap_ci, pooled

    rows = []
    base = base_shape(ds)
    for d in ds["data"].values:
        for v in variants:
            for s in ds["seqlen"].values:
                vals = ds["rmse"].sel(data=d, seqlen=s, variant=v, **base).values
                if not np.isfinite(vals).any():
                    continue
                lo, hi = bootstrap_ci("rmse", vals)
                rows.append({"data": str(d), "variant": v, "seqlen": int(s), "rmse": pooled("rmse", vals),
                             "lo": lo, "hi": hi})
    return pd.DataFrame(rows)


# Named recipes of the ablation's factor space: their levels; every other factor at its default.
NAMED = {
    "kernel (per-head, no rotation)": {"gran": "head", "rot": "none"},
    "FA3 (block + Hadamard, pow2 scales)": {"gran": "block", "rot": "hadamard", "scale": "pow2"},
    "FA3 without rotation": {"gran": "block", "rot": "none", "scale": "pow2"},
    "FA3 without block quant": {"gran": "tensor", "rot": "hadamard", "scale": "pow2"},
    "per-tensor, no rotation (amax)": {"gran": "tensor", "rot": "none"},
    "block + Hadamard (amax scales)": {"gran": "block", "rot": "hadamard"},
    "per-token + orthogonal (amax)": {"gran": "token", "rot": "orthogonal"},
}


def named_variants(ds: xr.Dataset) -> dict[str, str]:
    """name -> variant label of each named recipe the dataset holds."""
    from .ablation import variant_label

    order = dataset_factors(ds)
    have = {str(v) for v in ds["variant"].values}
    out = {}
    for name, levels in NAMED.items():
        label = variant_label(levels, order)
        if label in have:
            out[name] = label
    return out
