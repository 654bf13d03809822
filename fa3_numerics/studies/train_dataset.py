"""The dataset of a ``train`` study and its findings.

Exposed: ``assemble``, ``findings``, ``nonfinite``, ``summary``, ``TAIL_STEPS``, ``GAP_TOL``.

Variables: ``loss`` (step, variant), ``loss_gap`` (step, candidate: a variant's loss minus the
baseline's on the same batch), ``grad_norm`` (step, variant, layer), ``grad_norm_total`` (step,
variant), ``grad_cos`` (probe_step, candidate, layer) and ``grad_cos_total`` (on the baseline's
weights), ``attn_rel_l2`` (probe_step, variant, layer, grad), ``step_seconds`` (step).

Findings, per candidate (variables over ``candidate`` and ``attrs["findings"]``, JSON):

- the final gap: the mean of ``loss_gap`` over the last ``tail`` steps (``TAIL_STEPS``, at most a
  fifth of the run), with the standard error of batch means (blocks of 5 steps, since
  consecutive steps' gaps are correlated through the weights) and a 95% interval from
  Student's t on the blocks;
- where it diverges: the first step from which the gap's mean over every later window of
  ``window`` steps stays beyond ``GAP_TOL`` nats in magnitude (-1: it never does); the first
  non-finite loss (-1: none);
- whether the per-call error predicts the gradient error and the gap: Spearman's rho between
  the per-call rel_l2 of dQ, dK, dV (their mean) and 1 - grad_cos over every (probe step, layer),
  and over the probe steps between the per-call error (mean over layers) and |loss_gap|; across
  candidates (three or more), between the mean per-call error and the final gap.
"""

from __future__ import annotations

import json
import math

import numpy as np

from .impact_analysis import spearman

TAIL_STEPS = 50
GAP_TOL = 0.01  # nats: 1% in perplexity
_BLOCK = 5


def _tail(gap: np.ndarray, tail: int) -> dict:
    from scipy.stats import t as student

    x = gap[-tail:]
    nb = max(1, len(x) // _BLOCK)
    blocks = x[len(x) - nb * _BLOCK:].reshape(nb, -1).mean(axis=1) if len(x) >= _BLOCK else x
    mean = float(np.mean(x))
    if len(blocks) >= 2:
        se = float(np.std(blocks, ddof=1) / math.sqrt(len(blocks)))
        h = float(student.ppf(0.975, len(blocks) - 1)) * se
    else:
        se = h = math.nan
    return {"mean": mean, "std": float(np.std(x, ddof=1)) if len(x) > 1 else math.nan, "se": se,
            "lo": mean - h, "hi": mean + h, "steps": int(len(x)), "blocks": int(len(blocks))}


def _diverges(gap: np.ndarray, window: int) -> int:
    """First step from which every window's mean |gap| stays beyond GAP_TOL (-1: never)."""
    if len(gap) < window:
        return -1
    means = np.convolve(gap, np.ones(window) / window, mode="valid")
    beyond = np.abs(means) > GAP_TOL
    if not beyond[-1]:
        return -1
    last_in = np.flatnonzero(~beyond)
    return int(last_in[-1] + 1) if last_in.size else 0


def findings(loss, gap, cos, attn, probe_steps, baseline: str, candidates: list[str]) -> dict:
    steps = loss.shape[0]
    tail = max(1, min(TAIL_STEPS, steps // 5 or 1))
    window = max(1, min(20, steps // 10 or 1))
    out = {"baseline": baseline, "tail_steps": tail, "window": window, "gap_tol_nats": GAP_TOL,
           "baseline_final_loss": float(np.mean(loss[-tail:, 0])), "candidates": {}}
    err = np.nanmean(attn[:, :, :, 1:], axis=-1)  # dQ, dK, dV: [probe, run, layer]
    for c, name in enumerate(candidates):
        g = gap[:, c]
        bad = np.flatnonzero(~np.isfinite(loss[:, c + 1]))
        f = {"final_gap": _tail(g, tail) if np.isfinite(g[-tail:]).all() else None,
             "first_nonfinite_step": int(bad[0]) if bad.size else -1,
             "diverges_at": _diverges(g, window) if np.isfinite(g).all() else (int(bad[0]) if bad.size else -1),
             "gap_at_step0": float(g[0]),
             "max_abs_gap": float(np.nanmax(np.abs(g))) if np.isfinite(g).any() else math.nan,
             "per_call_rel_l2": float(np.nanmean(err[:, c + 1])),
             "grad_cos_min": float(np.nanmin(cos[:, c])) if np.isfinite(cos[:, c]).any() else math.nan}
        rho, p, n = spearman(err[:, c + 1], 1 - cos[:, c])
        f["spearman_err_vs_cos_deficit"] = {"rho": rho, "p": p, "n": n}
        rho, p, n = spearman(np.nanmean(err[:, c + 1], axis=-1), np.abs(g[probe_steps]))
        f["spearman_err_vs_gap"] = {"rho": rho, "p": p, "n": n}
        out["candidates"][name] = f
    finals = [out["candidates"][c]["final_gap"] for c in candidates]
    if len(candidates) >= 3 and all(f is not None for f in finals):
        rho, p, n = spearman([out["candidates"][c]["per_call_rel_l2"] for c in candidates],
                              [f["mean"] for f in finals])
        out["spearman_across_variants"] = {"rho": rho, "p": p, "n": n}
    return out


def assemble(info: dict, m: dict):
    import xarray as xr

    from ..engine.conventions import apply_conventions
    from ..engine.provenance import provenance
    from .train import GRADS, TRAIN_FORMAT

    study = info["study"]
    labels = [lab for lab, _ in study.runs]
    cands = labels[1:]
    steps = study.steps
    probe_steps = np.arange(0, steps, study.probe_every)
    loss = m["loss"][:steps]
    gap = loss[:, 1:] - loss[:, :1]
    attn = m["attn_rel_l2"][:len(probe_steps)]
    cos = m["grad_cos"][:len(probe_steps)]
    f = findings(loss, gap, cos, attn, probe_steps, labels[0], cands)
    data = {
        "loss": (("step", "variant"), loss, {"long_name": "training loss (mean next-token cross-entropy)",
                                             "units": "nat", "description": "on the step's batch, before the update"}),
        "loss_gap": (("step", "candidate"), gap, {"long_name": "loss minus the baseline's on the same batch",
                                                  "units": "nat"}),
        "grad_norm": (("step", "variant", "layer"), m["grad_norm"][:steps],
                      {"long_name": "L2 norm of the decoder layer's parameter gradient", "units": "1"}),
        "grad_norm_total": (("step", "variant"), m["grad_norm_total"][:steps],
                            {"long_name": "L2 norm of the whole gradient", "units": "1"}),
        "grad_cos": (("probe_step", "candidate", "layer"), cos,
                     {"long_name": "cosine of the variant's layer gradient with the baseline's", "units": "1",
                      "description": "the variant's recipe on the baseline's weights and batch of that step"}),
        "grad_cos_total": (("probe_step", "candidate"), m["grad_cos_total"][:len(probe_steps)],
                           {"long_name": "cosine of the whole gradient with the baseline's", "units": "1"}),
        "attn_rel_l2": (("probe_step", "variant", "layer", "grad"), attn,
                        {"long_name": "per-call rel_l2 against float64 autograd of exact attention", "units": "1",
                         "description": "mean over batch and heads, in the run's own training pass"}),
        "step_seconds": (("step",), m["step_seconds"][:steps], {"long_name": "wall time of the step (every run)",
                                                                "units": "s"}),
    }
    for key, desc in (("mean", "final loss gap (mean over the last tail steps)"),
                      ("se", "standard error of the final gap (batch means)"),
                      ("lo", "95% interval of the final gap, low"), ("hi", "95% interval of the final gap, high")):
        vals = [f["candidates"][c]["final_gap"][key] if f["candidates"][c]["final_gap"] else math.nan for c in cands]
        data[f"final_gap_{key}"] = (("candidate",), np.array(vals), {"long_name": desc, "units": "nat"})
    data["diverges_at"] = (("candidate",), np.array([f["candidates"][c]["diverges_at"] for c in cands]),
                           {"long_name": f"first step after which |gap| stays above {GAP_TOL} nats (-1: never)"})
    coords = {"step": np.arange(steps), "variant": labels, "candidate": cands,
              "layer": np.arange(info["layers"]), "probe_step": probe_steps, "grad": list(GRADS),
              "spec": ("variant", [r.spec() for _, r in study.runs])}
    attrs = dict(provenance(study.device))
    attrs.update({
        "format": TRAIN_FORMAT, "kind": "train", "model": info["src"].label, "model_sha256": info["model_sha256"],
        "architecture": ",".join(getattr(info["config"], "architectures", None) or []),
        "text_source": study.text_source, "text_tokens": info["n_tokens"], "tokens": study.tokens,
        "batch_size": study.batch, "steps": steps, "lr": study.lr, "seed": study.seed, "device": study.device,
        "baseline": labels[0], "checkpoint_every": study.checkpoint_every, "probe_every": study.probe_every,
        "optimizer": "AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0, constant lr, no clipping",
        "batches": "step t: windows of tokens + 1 from numpy.random.default_rng([seed, t])",
        "rotation_seed": "seed", "model_mode": "eval (no dropout), float32 weights, TF32 off",
        "grad_cos_weights": "the baseline's weights at each probe step, on that step's batch",
        "reference": "float64 autograd of exact attention (numerics.backward_reference)",
        "resumed_from_step": info["resumed_from"], "wall_seconds": round(info["times"]["total"], 3),
        "seconds": json.dumps({k: round(v, 3) for k, v in info["times"].items()}),
        "findings": json.dumps(f, allow_nan=True),
    })
    ds = xr.Dataset(data, coords=coords, attrs=attrs)
    return apply_conventions(ds)


def nonfinite(ds) -> list[str]:
    """A NaN or Inf in a loss, a gradient norm or a per-call error of a step that ran."""
    out = []
    for name in ("loss", "grad_norm", "grad_norm_total", "attn_rel_l2"):
        a = ds[name]
        bad = ~np.isfinite(a.values)
        if bad.any():
            first = ds["step" if "step" in a.dims else "probe_step"].values[np.argwhere(bad)[0][0]]
            out.append(f"{name}: {int(bad.sum())} non-finite value(s), first at step {int(first)}")
    return out


def summary(ds) -> str:
    f = json.loads(ds.attrs["findings"])
    lines = []
    for c, x in f["candidates"].items():
        g = x["final_gap"]
        gap = "non-finite" if g is None else f"{g['mean']:+.4g} nats" + (
            f" (95% {g['lo']:+.3g} .. {g['hi']:+.3g})" if math.isfinite(g["se"]) else " (too few steps for an interval)")
        lines.append(f"{c}: final loss gap to {f['baseline']} over the last {f['tail_steps']} steps {gap}; "
                     + ("never diverges" if x["diverges_at"] < 0 else f"beyond {f['gap_tol_nats']} nats from step "
                        f"{x['diverges_at']}"))
    return "\n".join(lines)


__all__ = ["assemble", "findings", "nonfinite", "summary", "TAIL_STEPS", "GAP_TOL"]
