"""The report of a ``train`` study: the verdict (the final loss gap with its interval) first, then
the loss curves with their gap, the gradient cosine per layer over steps, and the per-call error.
Reads the dataset only (its variables and ``attrs["findings"]``).

Exposed: ``train_document``, ``render_train``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .document import Document, Fig, Para, Section, Table, write_document
from ..text import fmt_e


def _gap(g) -> str:
    if g is None:
        return "non-finite"
    ci = "" if not np.isfinite(g["se"]) else f" (95% {g['lo']:+.3g} to {g['hi']:+.3g}, {g['blocks']} blocks of steps)"
    return f"{g['mean']:+.4g} nats{ci}"


def _rho(s: dict) -> str:
    if not np.isfinite(s["rho"]):
        return f"undefined (n {s['n']}: too few points or one of them constant)"
    return f"{s['rho']:+.2f} (p {fmt_e(s['p'])}, n {s['n']})"


def _verdict(ds, f: dict) -> list:
    lines = []
    for c, x in f["candidates"].items():
        g = x["final_gap"]
        where = ("it never stays beyond" if x["diverges_at"] < 0 else
                 f"from step {x['diverges_at']} its windowed mean stays beyond")
        sig = ""
        if g is not None and np.isfinite(g["se"]):
            sig = (" — distinguishable from zero" if g["lo"] > 0 or g["hi"] < 0 else " — not distinguishable from zero")
        lines.append(f"**`{c}`**: final loss gap to `{f['baseline']}` {_gap(g)}, mean over the last {f['tail_steps']} "
                     f"steps{sig} (baseline loss {f['baseline_final_loss']:.4g}); {where} {f['gap_tol_nats']} nats"
                     + (f"; first non-finite loss at step {x['first_nonfinite_step']}" if x["first_nonfinite_step"] >= 0
                        else "") + ".")
    a = ds.attrs
    lines = [Para(line, role="headline") for line in lines]
    lines.append(Para(f"{a['model']}, {a['steps']} steps of {a['batch_size']} x {a['tokens']} tokens of "
                      f"{a['text_source']}, lr {a['lr']:g}, seed {a['seed']}, {a['device']}; {a['optimizer']}; "
                      f"{float(a['wall_seconds']):.0f} s.", role="where"))
    return lines


def _curves(ds):
    from matplotlib import rc_context

    from .plots import finish, new_fig, theme

    with rc_context():
        theme()
        fig, axes = new_fig(10, 6.4, 2, 1, sharex=True)
        steps = ds["step"].values
        for v in ds["variant"].values:
            axes[0, 0].plot(steps, ds["loss"].sel(variant=v).values, label=str(v), lw=1.2)
        axes[0, 0].set_ylabel("loss (nats)")
        axes[0, 0].legend()
        for c in ds["candidate"].values:
            axes[1, 0].plot(steps, ds["loss_gap"].sel(candidate=c).values, label=str(c), lw=1.0)
        axes[1, 0].axhline(0, color="k", lw=0.8)
        axes[1, 0].set_ylabel("gap to baseline (nats)")
        axes[1, 0].set_xlabel("step")
        return finish(fig, "loss", "Loss curves and their gap",
                      "Training loss of every run on the same batches (top) and each variant's loss minus the "
                      "baseline's (bottom).")


def _cosines(ds):
    from matplotlib import rc_context

    from .plots import finish, new_fig, theme

    cands = list(ds["candidate"].values)
    with rc_context():
        theme()
        fig, axes = new_fig(10, 3.2 * len(cands), len(cands), 1, sharex=True)
        for i, c in enumerate(cands):
            ax = axes[i, 0]
            deficit = 1 - ds["grad_cos"].sel(candidate=c).transpose("layer", "probe_step").values
            with np.errstate(divide="ignore"):
                img = ax.imshow(np.log10(np.clip(deficit, 1e-12, None)), aspect="auto", origin="lower",
                                extent=[float(ds.probe_step.values[0]) - 0.5, float(ds.probe_step.values[-1]) + 0.5,
                                        -0.5, ds.sizes["layer"] - 0.5], cmap="viridis")
            ax.set_ylabel(f"{c}\nlayer")
            fig.colorbar(img, ax=ax, label="log10(1 - cosine)")
        axes[-1, 0].set_xlabel("step")
        return finish(fig, "grad_cos", "Gradient cosine per layer over steps",
                      "1 - cosine of each decoder layer's gradient under the variant with the baseline's, both on "
                      "the baseline's weights and batch of the probe step (log scale; lower is closer).")


def train_document(ds) -> Document:
    f = json.loads(ds.attrs["findings"])
    doc = Document(f"train: {ds.attrs['model']}")
    doc.lead = _verdict(ds, f)
    rows = []
    for c, x in f["candidates"].items():
        s1, s2 = x["spearman_err_vs_cos_deficit"], x["spearman_err_vs_gap"]
        rows.append([c, _gap(x["final_gap"]), f"{x['gap_at_step0']:+.3g}", f"{x['max_abs_gap']:.3g}",
                     fmt_e(x["per_call_rel_l2"]), f"{x['grad_cos_min']:.6f}",
                     _rho(s1), _rho(s2)])
    table = Table(["variant", "final gap", "gap at step 0", "max |gap|", "per-call rel_l2 (dQ, dK, dV)",
                   "min layer cosine", "Spearman: per-call error vs 1 - cosine", "Spearman: per-call error vs |gap|"],
                  rows, numeric=[False] + [True] * 7)
    across = f.get("spearman_across_variants")
    predict = [Para("Does the per-call gradient error predict the damage? Per variant, Spearman's rho between the "
                    "per-call rel_l2 of dQ, dK, dV (in the run's own pass, against float64 autograd) and 1 - cosine "
                    "of that layer's gradient, over every (probe step, layer); and between the per-call error "
                    "(mean over layers) and |loss gap| over the probe steps."), table]
    if across:
        predict.append(Para(f"Across the {len(f['candidates'])} variants, mean per-call error against final gap: "
                            f"rho {_rho(across)}."))
    err_rows = []
    for v in ds["variant"].values:
        a = ds["attn_rel_l2"].sel(variant=v)
        err_rows.append([str(v)] + [fmt_e(float(np.nanmean(a.sel(grad=g).values))) for g in ds["grad"].values])
    errors = Section("Per-call attention error", [
        Para("rel_l2 against float64 autograd of exact attention on each call's own Q, K, V and dO, mean over "
             "layers, probe steps, batch and heads."),
        Table(["variant"] + [f"{str(g).upper() if g == 'o' else 'd' + str(g)[1:].upper()}" for g in ds["grad"].values],
              err_rows, numeric=[False] + [True] * ds.sizes["grad"])])
    secs = json.loads(ds.attrs.get("seconds", "{}"))
    per = ds["step_seconds"].values
    timing = Para(f"Time: load {secs.get('load', float('nan')):.1f} s, training {secs.get('train', float('nan')):.1f} s "
                  f"(median step {np.nanmedian(per):.2f} s over {int(np.isfinite(per).sum())} steps computed in this "
                  f"or an earlier run); " + ("not resumed" if int(ds.attrs["resumed_from_step"]) < 0 else
                                        f"resumed from the checkpoint after step {ds.attrs['resumed_from_step']}")
                  + ".", role="note")
    return Document(doc.title, doc.lead, [
        Section("Loss", [Fig(_curves(ds))]),
        Section("Gradient cosine per layer", [Fig(_cosines(ds))]),
        Section("Does the per-call error predict it", predict),
        errors, Section("Run", [timing])])


def render_train(ds, out_dir: str | Path, formats=("html", "md")) -> list[Path]:
    return write_document(train_document(ds), out_dir, stem="report", formats=tuple(formats))


__all__ = ["train_document", "render_train"]
