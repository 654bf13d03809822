"""The report of an impact study: findings, tables and figures, as Markdown and self-contained HTML.

Exposed: ``render_impact``, ``impact_document``, ``make_impact_figures``, ``build_blocks``.

Every finding (the checks, which layers matter, the verdict) is what the study stored in the
dataset (``studies.impact_findings``); this module renders it.

``render_impact(ds, out)`` writes ``report.md`` (figures in ``figures/`` beside it, PNG and SVG)
and ``report.html`` (figures embedded; opens offline), from the dataset alone (the layout is in
``fa3_numerics.studies.impact_dataset``), so a saved ``impact.nc`` always renders the same
report. It uses the shared report machinery: figures through ``report.plots`` (theme, no pyplot
state, no timestamps), the flat ``Block`` list turned into a ``Document`` and written by
``report.document.write_document`` (whole files or none). seaborn and matplotlib are imported
inside the functions.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import xarray as xr

from .document import Block, md_code, md_text
from ..engine.conventions import attr_json
from ..text import fmt_e, fmt_pct
from .plots import Figure, spread_labels
from .stored import findings_of, verdict_block
# KL values are plotted on log axes; exact zeros (a pass identical to the reference) sit here.
KL_FLOOR = 1e-16


def _f(x) -> str:
    return fmt_e(float(x))




def _sel(ds, name, **kw) -> float:
    return float(ds[name].sel(**kw))




# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------

def _theme():
    import seaborn as sns

    from .plots import theme

    theme(font_scale=0.9)
    return sns.color_palette("colorblind", 10)


def _new(w, h, nrows=1, ncols=1, **kw):
    from .plots import new_fig

    return new_fig(w, h, nrows, ncols, **kw)


def _done(fig, name, title, caption) -> Figure:
    from .plots import finish

    return finish(fig, name, title, caption)


def _ecdf(ax, vals, label, color, ls="-"):
    v = np.sort(np.maximum(np.asarray(vals, dtype=float), KL_FLOOR))
    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label, color=color, ls=ls, lw=1.6)


def fig_kl_distribution(ds) -> Figure:
    pal = _theme()
    fig, ax = _new(9.5, 4.6)
    ax = ax[0][0]
    for i, v in enumerate(ds["variant"].values):
        _ecdf(ax, ds["kl"].sel(variant=v, mask="all").values, f"{v}", pal[i % 10])
    if "baseline" in ds.dims:
        for j, b in enumerate(ds["baseline"].values):
            _ecdf(ax, ds["base_kl"].sel(baseline=b).values, f"{b} (model's own)", "0.35", ls=(":", "--")[j % 2])
    ax.set_xscale("log")
    ax.set_xlabel("KL(reference || variant) of the next-token distribution, nats (log)")
    ax.set_ylabel("fraction of tokens ≤ x")
    ax.legend(fontsize=8, loc="lower right")
    n = ds.sizes["token"]
    cap = (f"Empirical CDF over the {n} positions of the text; every layer runs the variant (prefill). The model's own "
           f"SDPA in float32 and BF16 (grey) give the scale of ordinary deployment noise. Values below {KL_FLOOR:g} "
           "(including exact zeros) are drawn at that floor.")
    return _done(fig, "kl_distribution", "Per-token KL against the float64 reference", cap)


def fig_layer_sensitivity(ds) -> Figure:
    pal = _theme()
    fig, axes = _new(10, 5.2, 2, 1, sharex=True, height_ratios=[2.2, 1])
    fig.get_layout_engine().set(hspace=0.06)  # the panels' end tick labels would touch
    layers = ds["layer"].values
    for i, v in enumerate(ds["variant"].values):
        y = np.maximum(ds["layer_kl_mean"].sel(variant=v).values, KL_FLOOR)
        axes[0][0].plot(layers, y, marker="o", ms=3, lw=1.3, color=pal[i % 10], label=str(v))
        axes[1][0].plot(layers, 100 * (1 - ds["layer_top1_agree"].sel(variant=v).values), marker="o", ms=3,
                        lw=1.0, color=pal[i % 10])
    axes[0][0].set_yscale("log")
    axes[0][0].set_ylabel("mean KL, nats (log)")
    axes[0][0].legend(fontsize=7, ncol=3)
    axes[1][0].set_ylabel("top-1\nchanged (%)")  # two lines: one would stand taller than the panel
    axes[1][0].set_xlabel("the one layer that runs the variant")
    cap = ("Each point is a full model pass in which only that layer computes attention with the variant and every "
           "other layer uses float64 attention. Top: mean KL over tokens; bottom: share of tokens whose most likely "
           "next token changed.")
    return _done(fig, "layer_sensitivity", "Which layers matter: one layer at a time", cap)


def fig_audit_vs_kl(ds) -> Figure:
    pal = _theme()
    fig, axes = _new(13, 5.0, 1, 2)
    ax, ax2 = axes[0]
    rho = ds["spearman_rho"]
    for i, v in enumerate(ds["variant"].values):
        x, y = ds["audit_rel_l2"].sel(variant=v).values, ds["layer_kl_mean"].sel(variant=v).values
        r = float(rho.sel(variant=v))
        ax.scatter(np.maximum(x, 1e-12), np.maximum(y, KL_FLOOR), s=18, color=pal[i % 10],
                   label=f"{v} (ρ = {r:+.2f})" if math.isfinite(r) else str(v))
        if "qk=fp32" not in str(ds["spec"].sel(variant=v).item()):
            ax2.plot(ds["layer"].values, ds["layer_gain"].sel(variant=v).values, marker="o", ms=3, lw=1.1,
                     color=pal[i % 10], label=str(v))
    fit = attr_json(ds, "kl_from_rel_l2_fit", {}) or {}
    if fit and math.isfinite(fit.get("a", math.nan)):
        vals = ds["audit_rel_l2"].values
        xs = np.logspace(np.log10(max(np.nanmin(vals[vals > 1e-6]), 1e-6)), np.log10(np.nanmax(vals)), 50)
        ax.plot(xs, 10 ** fit["a"] * xs ** fit["b"], color="0.3", lw=1, ls="--",
                label=f"fit: KL ≈ {10 ** fit['a']:.3g} · rel_l2^{fit['b']:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("audit rel_l2 of the layer (heads pooled), same tokens (log)")
    ax.set_ylabel("mean KL when only that layer runs the variant (log)")
    ax.legend(fontsize=7)
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("gain g = KL / rel_l2² (log)")
    ax2.legend(fontsize=7)
    ax2.set_title("per-layer gain: a property of the layer", fontsize=9)
    cap = ("Left: one point per (layer, variant); ρ is the Spearman rank correlation over layers for that variant; the "
           "dashed line a least-squares fit in log-log over the FP8 and 16-bit variants. Right: the gain "
           "KL / rel_l2² per layer, nearly the same profile for every recipe: how much the model amplifies an "
           "attention error in that layer.")
    return _done(fig, "audit_vs_kl", "Kernel-level error against model-level error", cap)


def _rolling(x, w):
    x = np.asarray(x, dtype=float)
    if x.size < w:
        return x
    c = np.convolve(x, np.ones(w) / w, mode="valid")
    return np.concatenate([np.full(w - 1, np.nan), c])


def fig_decode(ds) -> Figure:
    pal = _theme()
    dv = list(ds["dvariant"].values)
    cols = min(2, len(dv))
    rows = -(-len(dv) // cols)
    fig, axes = _new(5.2 * cols, 3.3 * rows, rows, cols, sharey=True)
    n = ds.sizes["token"]
    w = max(4, n // 16)
    t = ds["token"].values + 1
    for i, v in enumerate(dv):
        ax = axes[i // cols][i % cols]
        ax.plot(t, _rolling(ds["kl"].sel(variant=v, mask="all").values, w), color="0.2", lw=1.4,
                label="prefill (the recipe as given)")
        for j, kv in enumerate(ds["kv"].values):
            ax.plot(t, _rolling(ds["dec_kl"].sel(dvariant=v, kv=kv).values, w), color=pal[(j + 1) % 10], lw=1.2,
                    label=f"decode, KV cache per {kv}")
        ax.set_yscale("log")
        ax.set_title(str(v), fontsize=9)
        ax.set_xlabel("KV cache length (tokens)")
        if i % cols == 0:
            ax.set_ylabel(f"KL, rolling mean of {w}")
        ax.legend(fontsize=7)
    for j in range(len(dv), rows * cols):
        axes[j // cols][j % cols].axis("off")
    cap = ("Decode: one query row per step against an FP8 KV cache of every earlier token (teacher-forced over the "
           "text), per-token or static per-head/per-tensor scales; prefill: the recipe as given. x: the number of "
           "cached tokens the step attends to.")
    return _done(fig, "decode", "Prefill against decode, by KV-cache length", cap)


def fig_assignments(ds) -> Figure:
    pal = _theme()
    fig, ax = _new(8.5, 5.0)
    ax = ax[0][0]
    notes = []  # the point labels, spread apart once the axes are final
    n_layers = ds.sizes["model_layer"]
    for i, v in enumerate(ds["variant"].values):
        spec = str(ds["spec"].sel(variant=v).item())
        if "qk=fp32" in spec:
            continue  # FP32 attention is no deployment option (and its ~1e-11 would stretch the axis)
        x, y = int(ds["cost"].sel(variant=v)) * n_layers, float(ds["kl_mean"].sel(variant=v, mask="all"))
        ax.scatter([x], [max(y, KL_FLOOR)], color="0.45", marker="s", s=36, zorder=3)
        notes.append(ax.annotate(f"{v} everywhere", (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points"))
    budget = attr_json(ds, "budget", None)
    for k, a in enumerate(ds["assignment"].values):
        src = str(ds["asg_source"].sel(assignment=a).item())
        x, y = int(ds["asg_cost"].sel(assignment=a)), float(ds["asg_kl_mean"].sel(assignment=a))
        color = pal[0] if src == "--recipe-map" else pal[1]
        ax.scatter([x], [max(y, KL_FLOOR)], color=color, s=44, zorder=4,
                   label="--recipe-map" if src == "--recipe-map" else "budget candidates (verified)")
        notes.append(ax.annotate(_short_name(a, k), (x, y), fontsize=7, xytext=(4, -10 if k % 2 else 4),
                                 textcoords="offset points", color=color))
    if budget:
        ax.axhline(budget["budget"], color="crimson", ls="--", lw=1, label=f"budget KL {budget['stat']} {budget['budget']:g}")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("cost: sum over layers of the audit's recipe_cost")
    ax.set_ylabel("mean KL over tokens, nats (log)")
    spread_labels(fig, notes)
    cap = ("Cost against measured mean KL: one recipe in every layer (grey squares), `--recipe-map` assignments and "
           "the budget search's candidates, each a verified full pass. Labels A1.. and B1.. are the rows of the "
           "table above. FP32 attention (`exact`) is left out.")
    return _done(fig, "assignments", "Mixed per-layer assignments: cost against KL", cap)


def _short_name(assignment: str, index: int) -> str:
    return f"B{assignment.split(':', 1)[0].split('#')[-1]}" if assignment.startswith("budget #") else f"A{index + 1}"


def make_impact_figures(ds) -> list[Figure]:
    figs = [fig_kl_distribution(ds)]
    if "layer_kl_mean" in ds and ds.sizes.get("layer", 0) > 0:
        figs.append(fig_layer_sensitivity(ds))
    if "audit_rel_l2" in ds:
        figs.append(fig_audit_vs_kl(ds))
    if "dec_kl" in ds:
        figs.append(fig_decode(ds))
    if "asg_kl" in ds:
        figs.append(fig_assignments(ds))
    return figs


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------

def _row(name, kl_mean, p99, mx, top1, ppl, dppl, bad, cost="") -> str:
    return (f"| {name} | {cost} | {_f(kl_mean)} | {_f(p99)} | {_f(mx)} | {fmt_pct(top1)} | {ppl:.4f} | "
            f"{dppl:+.4f} | {bad} |")


def _prefill_table(ds) -> str:
    lines = ["| variant | cost | KL mean | KL p99 | KL max | top-1 agree | ppl | Δppl | non-finite |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in ds["variant"].values:
        s = {k: _sel(ds, k, variant=v, mask="all") for k in ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl",
                                                            "ppl_delta")}
        bad = int(ds["nonfinite_logits"].sel(variant=v, mask="all")) + \
            int(ds["nonfinite_attn"].sel(variant=v, mask="all").sum())
        lines.append(_row(md_code(v), *s.values(), bad, int(ds["cost"].sel(variant=v))))
    if "baseline" in ds.dims:
        for b in ds["baseline"].values:
            s = [_sel(ds, f"base_{k}", baseline=b) for k in ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl",
                                                              "ppl_delta")]
            bad = int(ds["base_nonfinite_logits"].sel(baseline=b)) + int(ds["base_nonfinite_attn"].sel(baseline=b).sum())
            lines.append(_row(f"{md_code(b)} (model's own SDPA)", *s, bad))
    return "\n".join(lines)


def _decode_table(ds) -> str:
    lines = ["| variant | cache | KL mean | KL p99 | KL max | top-1 agree | ppl | Δppl | prefill KL mean |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in ds["dvariant"].values:
        for kv in ds["kv"].values:
            s = [_sel(ds, f"dec_{k}", dvariant=v, kv=kv) for k in ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl",
                                                                    "ppl_delta")]
            lines.append(f"| {md_code(v)} | per {kv} | {_f(s[0])} | {_f(s[1])} | {_f(s[2])} | {fmt_pct(s[3])} | {s[4]:.4f} | "
                         f"{s[5]:+.4f} | {_f(_sel(ds, 'kl_mean', variant=v, mask='all'))} |")
    return "\n".join(lines)


TOP_LAYERS = 5  # layers named per variant: more stretched the table past the page


def _layer_table(f: dict) -> str:
    lines = ["| variant | layers by mean KL (largest first) | share of Σ layers in top 3 | Σ layers / all-layer KL |",
             "|---|---|---|---|"]
    for r in f["layers"]:
        share = r["top3_share"]
        ratio = r["sum_over_all"]
        lines.append(f"| {md_code(r['variant'])} | " + ", ".join(f"{layer} ({_f(k)})" for layer, k in r["top"][:TOP_LAYERS])
                     + f" | {fmt_pct(share if share is not None else math.nan)} | "
                     + (f"{ratio:.2f}" if ratio is not None else "- (not every layer swept)") + " |")
    return "\n".join(lines)


def _spearman_table(ds) -> str:
    lines = ["| variant | ρ (rel_l2 heads pooled) | p | ρ (rel_l2 worst head) | layers |", "|---|---|---|---|---|"]
    for v in ds["variant"].values:
        lines.append(f"| {md_code(v)} | {float(ds['spearman_rho'].sel(variant=v)):+.3f} | "
                     f"{fmt_e(float(ds['spearman_p'].sel(variant=v)))} | "
                     f"{float(ds['spearman_rho_max'].sel(variant=v)):+.3f} | {ds.sizes['layer']} |")
    return "\n".join(lines)


def _assignment_table(ds, budget, f: dict) -> str:
    # the maps themselves are listed under the table: one in a cell would stretch it past the page
    lines = ["| | source | cost | KL mean | predicted (Σ one-layer) | KL p99 | KL max | top-1 agree | Δppl | "
             "meets budget |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, (a, stored_) in enumerate(zip(ds["assignment"].values, f["assignments"])):
        s = [_sel(ds, f"asg_{k}", assignment=a) for k in ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl_delta")]
        meets = "-" if stored_["meets"] is None else ("yes" if stored_["meets"] else "no")
        pred = math.nan if stored_["predicted"] is None else stored_["predicted"]
        lines.append(f"| {_short_name(str(a), i)} | {ds['asg_source'].sel(assignment=a).item()} | "
                     f"{int(ds['asg_cost'].sel(assignment=a))} | "
                     f"{_f(s[0])} | {_f(pred)} | {_f(s[1])} | {_f(s[2])} | {fmt_pct(s[3])} | {s[4]:+.4f} | {meets} |")
    return "\n".join(lines)


def _assignment_list(ds) -> str:
    return "\n".join(f"- {_short_name(str(a), i)}: {md_code(a)}" for i, a in enumerate(ds["assignment"].values))


def _nonfinite(ds) -> list[Block]:
    total = int(ds.attrs.get("nonfinite_total", 0))
    if not total:
        return []
    where = attr_json(ds, "nonfinite_where", [])
    items = "\n".join(f"- pass {md_code(w['pass'])}: {w['logits']} non-finite logits; attention outputs per layer "
                      f"{w['attn_layers']}" for w in where[:30])
    return [Block("p", f"**NON-FINITE VALUES: {total}.** They are kept as NaN (summaries over them are NaN), "
                       "not dropped. Where:"), Block("list", items)]


def build_blocks(ds, figures: list[Figure]) -> list[Block]:
    a = ds.attrs
    f = findings_of(ds, kind="impact")
    figs = {f.name: f for f in figures}
    checks = attr_json(ds, "prefix_checks", {}) or {}
    blocks = [Block("h1", f"Impact of attention recipes on {md_text(a.get('model'))}'s predictions"),
              Block("p", f"**Where it ran:** {md_text(a.get('device_name', '?'))} (device {md_code(a.get('device'))}, backend "
                         f"{md_code(a.get('backend'))}, {md_text(a.get('platform', '?'))}). **Command:** {md_code(a.get('command', '?'))}. "
                         f"Wall time {md_text(a.get('wall_seconds'))} s.")]
    blocks += _nonfinite(ds)
    blocks.append(Block("p", f"{md_text(a.get('tokens'))} tokens of {md_text(a.get('text_source'))} (starting \"{md_text(a.get('first_tokens_text', ''))}\"), "
                             f"{md_text(a.get('num_layers'))} layers, {md_text(a.get('heads'))} query / {md_text(a.get('kv_heads'))} KV heads. "
                             f"Reference: {md_text(a.get('reference'))}; its perplexity is {float(a.get('ref_ppl')):.4f}. Every "
                             "number compares a full model pass with the reference, token by token: KL(reference || "
                             "variant) of the next-token distribution in nats, top-1 agreement, perplexity."))
    blocks += [Block("h2", "Findings"), Block("list", "\n".join(f"- {x}" for x in f["lines"]))]
    blocks.append(Block("p", "These recipes are the ones asked for. For the recipe to deploy, with the field's remedies "
                             "(K smoothing, SageAttention, engines' FP8 KV-cache scales) screened per layer, verified on "
                             "held-out text and diagnosed, run `fa3-numerics recommend --model "
                             f"{a.get('model', 'M')} --target fa3` (or vllm, sglang, trtllm, sage2, any)."))
    blocks += [Block("h2", "Every layer runs the recipe (prefill)"), Block("table", _prefill_table(ds)),
               Block("figure", figure=figs["kl_distribution"])]
    if "layer_sensitivity" in figs:
        blocks += [Block("h2", "Which layers matter"),
                   Block("p", "Only one layer runs the recipe; the rest use float64 attention. Each of these passes "
                              "starts at its layer from the reference's hidden states, because the layers before it are "
                              "identical to the reference's. Checked: full passes of layers "
                              + ", ".join(f"{k} ({md_code(c['variant'])}): " + ("bit-identical" if c["bit_identical"] else
                                                                         f"DIFFER by up to {c['max_abs_kl_diff']:.2g} nats")
                                          for k, c in checks.items()) + "."),
                   *_sweep_acc_blocks(ds),
                   Block("table", _layer_table(f)), Block("figure", figure=figs["layer_sensitivity"])]
    if "audit_vs_kl" in figs:
        diff = a.get("audit_vs_sweep_rel_l2_max_rel_diff")
        blocks += [Block("h2", "How kernel-level error maps to model-level error"),
                   Block("p", "The audit (`fa3-numerics audit`'s code) ran on the Q, K, V of the reference pass: the "
                              "very inputs each layer's one-layer pass feeds the recipe. Its per-(layer, head) rel_l2 "
                              f"matches the error measured inside those passes to a relative {fmt_e(float(diff))}."),
                   Block("table", _spearman_table(ds)), Block("figure", figure=figs["audit_vs_kl"])]
    if "decode" in figs:
        blocks += [Block("h2", "Prefill and decode"),
                   Block("p", "Decode computes one query row per step against a KV cache of all earlier tokens, stored "
                              "in FP8. `per token`: every cached token has its own scale (per KV head), and Q is scaled "
                              "per token (a decode step sees one query row, so a dynamic Q scale is per token). `per "
                              "head` / `per tensor`: static scales for Q, K and V calibrated on this text (vLLM's FP8 KV "
                              "cache with FA3 uses static per-tensor or per-head q/k/v scales). Each mode is one causal "
                              "pass, which computes every step of a teacher-forced generation exactly (rows are "
                              "independent under these scales). Not shown: recipes without FP8 Q/K (no FP8 cache) and "
                              "recipes that scale P per tensor."),
                   Block("table", _decode_table(ds)), Block("figure", figure=figs["decode"])]
    if "assignments" in figs:
        budget = attr_json(ds, "budget", None)
        text = "Per-layer recipe maps (`--recipe-map`)"
        if budget:
            text += (f" and the budget search: the cheapest assignment (costs from the audit's `recipe_cost`, summed "
                     f"over layers) predicted to meet KL {budget['stat']} <= {budget['budget']:g} by adding the one-layer "
                     "KLs, then run in full; the measured value decides, and the prediction is recalibrated by "
                     "measured / predicted before the next candidate. Candidates: "
                     + ", ".join(f"{md_code(c)} (cost {k})" for c, k in zip(budget["candidates"], budget["costs"])) + ".")
        blocks += [Block("h2", "Mixed assignments"), Block("p", text), Block("table", _assignment_table(ds, budget, f)),
                   Block("list", _assignment_list(ds)),
                   Block("figure", figure=figs["assignments"])]
    blocks += [Block("h2", "Provenance"), Block("list", _provenance(ds)),
               Block("h2", "Variants (full recipe specs)"),
               Block("list", "\n".join(f"- {md_code(v)}: {md_code(s)}" for v, s in zip(ds["variant"].values, ds["spec"].values)))]
    return blocks


def _sweep_acc_blocks(ds) -> list[Block]:
    """Where the sweep ran a recipe with another accumulator model, say so and what it moved."""
    changed = [(str(v), str(g), str(w)) for v, g, w in zip(ds["variant"].values, ds["spec"].values,
                                                           ds["sweep_spec"].values) if g != w]
    if not changed:
        return []
    checks = attr_json(ds, "sweep_acc_checks", {}) or {}
    parts = []
    for v, _, _ in changed:
        c = checks.get(v, {})
        if c:
            parts.append(f"{md_code(v)} " + ", ".join(f"layer {k}: {x['ratio']:.3f}" for k, x in c.items()))
    return [Block("p", "In this sweep (and the audit beside it) " + ", ".join(md_code(v) for v, _, _ in changed)
                  + " ran with `acc=fp32` instead of the Hopper MMA model `acc=fp22`, which costs ~40x a float32 "
                  "GEMM on a CPU (`--sweep-acc`); full passes, decode, maps and the budget's verification runs "
                  "use the recipes as given. Per-layer mean KL with fp32 / with fp22, rerun on the check layers: "
                  + ("; ".join(parts) if parts else "not checked") + ".")]


def _provenance(ds) -> str:
    a = ds.attrs
    return "\n".join([
        f"- command: {md_code(a.get('command'))}; created {md_text(a.get('created_utc'))}; git {md_code(a.get('git_commit'))}",
        f"- model {md_code(a.get('model'))}: file {md_code(a.get('model_file'))} ({md_text(a.get('model_origin'))}), sha256 "
        f"{md_code(a.get('model_sha256'))}, {md_text(a.get('architecture'))}",
        f"- text {md_text(a.get('text_source'))}, sha256 {md_code(a.get('text_sha256'))}; {md_text(a.get('tokens'))} token ids, sha256 "
        f"{md_code(a.get('token_ids_sha256'))}",
        f"- backend {md_code(a.get('backend'))} on {md_text(a.get('device'))} ({md_text(a.get('device_name'))}); seeds {md_text(a.get('seeds'))} "
        f"(Hadamard signs); TF32 {md_text(a.get('tf32'))}; all query rows",
        f"- versions: fa3-numerics {md_text(a.get('version_fa3_numerics'))}, torch {md_text(a.get('version_torch'))}, transformers "
        f"{md_text(a.get('version_transformers'))}, python {md_text(a.get('python'))}; code hash {md_code(a.get('code_version'))}",
        f"- times: load {md_text(a.get('load_seconds'))} s, reference {md_text(a.get('reference_seconds'))} s, passes "
        f"{md_text(a.get('compute_seconds'))} s (cached passes count their original time), total {md_text(a.get('wall_seconds'))} s",
    ])


def render_impact(ds: xr.Dataset, out_dir: str | Path, formats=("html", "md")) -> list[Path]:
    """Write report.md (+ figures/) and/or report.html for an impact dataset; the files written."""
    from .document import write_document

    return write_document(impact_document(ds), out_dir, formats=tuple(formats))


def impact_document(ds: xr.Dataset):
    """The report of an impact dataset as a Document, its verdict first (what ``report`` renders
    for kind ``impact``)."""
    from .document import from_blocks

    doc = from_blocks(build_blocks(ds, make_impact_figures(ds)))
    doc.lead = verdict_block(findings_of(ds, kind="impact")) + doc.lead
    return doc


__all__ = ["render_impact", "impact_document", "make_impact_figures", "build_blocks"]
