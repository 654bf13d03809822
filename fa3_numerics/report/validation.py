"""The validation report: the emulator against the kernel, case by case, as Markdown.

Exposed: ``markdown_validation``, ``write_validation``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..engine.files import atomic_write
from .format import fmt_f


def _nonfinite_cell(ds, i: int, accs: list[str]) -> str:
    k = ds["nonfinite_kernel"].values[i]
    only = [ds["nonfinite_emulator_only"].sel(acc=a).values[i] for a in accs]
    if not np.isfinite(k):
        return "-"
    if k == 0 and not np.nansum(only):
        return "0"
    return f"**kernel {int(k)}; emulator-only " + "/".join(str(int(x)) if np.isfinite(x) else "-" for x in only) + "**"


def markdown_validation(ds) -> str:
    from ..studies.validate import F_LIMIT, accumulator_ranking, findings

    accs = [str(a) for a in ds["acc"].values]
    label = ds.attrs.get("kernel_label", ds.attrs.get("backend", "?"))
    lines = [f"Kernel: `{label}` ({ds.attrs.get('kernel_version', ds.attrs.get('kernel_module', ''))}) on "
             f"{ds.attrs.get('device_name', ds.attrs.get('device', '?'))}; emulator default acc "
             f"`{ds.attrs.get('recipe_default_acc')}`. F = RMSE(emulator, kernel) / RMSE(kernel, float64) over the "
             f"outputs finite in both; **bold** F > {F_LIMIT} (FP8 cases must stay below it). Every query row unless "
             "the case name ends in rowsN (N sampled rows). Non-finite: the kernel's outputs, and the emulator's "
             "where the kernel's are finite, per accumulator (the target is 0).", ""]
    bad = findings(ds)
    if bad:
        lines += ["**Non-finite outputs** (F and the identical share are over the outputs finite in both):", ""]
        lines += [f"- {b}" for b in bad] + [""]
    head = ["case", "n", "causal", "h/kv", "d", "data", "descale", "rot", "RMSE(kernel)"]
    head += [f"F {a}" for a in accs] + [f"identical {a}" for a in accs] + ["non-finite"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i in range(ds.sizes["case"]):
        c = ds.isel(case=i)
        fp8 = str(c["dtype"].values) == "fp8"
        ran = np.isfinite(float(c["seconds"]))
        fs = []
        for a in accs:
            f = float(c["fidelity"].sel(acc=a))
            if not ran:
                fs.append("not run")
            elif not np.isfinite(f):
                fs.append("**non-finite**")
            else:
                fs.append(f"**{fmt_f(f)}**" if fp8 and f > F_LIMIT else fmt_f(f))
        idn = [("-" if not np.isfinite(float(c["identical"].sel(acc=a))) else f"{float(c['identical'].sel(acc=a)):.1%}")
               for a in accs]
        rk = float(c["rmse_kernel"])
        dist = str(c["dist"].values)
        data = (f"p {float(c['p']):g}, σ {float(c['sigma']):g}" if dist == "outliers" else
                f"layer {c['params'].values}".replace("layer=", "") if dist.startswith("capture-file:") else
                f"{dist} {c['params'].values}")
        row = [str(c["dtype"].values), str(int(c["seqlen"])), "yes" if int(c["causal"]) else "no",
               f"{int(c['heads'])}/{int(c['kv_heads'])}", str(int(c["head_dim"])), data,
               str(c["gran"].values) if fp8 else "-", str(c["rot"].values),
               "-" if not np.isfinite(rk) else f"{rk:.3e}"] + fs + idn + [_nonfinite_cell(ds, i, accs)]
        lines.append("| " + " | ".join(row) + " |")
    lines += _per_head(ds, accs)
    rank = accumulator_ranking(ds)
    if rank:
        lines += ["", "Accumulator models over the FP8 cases (best first):", "",
                  "| acc | max F | median F | mean bit-identical | cases | non-finite where the kernel's are finite "
                  "| F <= 0.01 everywhere, all finite |", "|---|---|---|---|---|---|---|"]
        for r in rank:
            lines.append(f"| `{r['acc']}` | {fmt_f(r['max_F'])} | {fmt_f(r['median_F'])} | {r['mean_identical']:.1%} | "
                         f"{r['cases']} | {r['nonfinite_only']} | {'yes' if r['pass'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _per_head(ds, accs: list[str]) -> list[str]:
    """For cases on a capture: F and the identical share per layer x head (the worst heads)."""
    if "fidelity_sample" not in ds:
        return []
    cap = [i for i, d in enumerate(ds["dist"].values) if str(d).startswith("capture-file:")]
    if not cap:
        return []
    rows = []
    for i in cap:
        layer = str(ds["params"].values[i]).replace("layer=", "")
        heads = int(ds["heads"].values[i])
        for j, a in enumerate(accs):
            for h in range(heads):
                rows.append((float(ds["fidelity_sample"].values[i, j, h]), str(ds["case"].values[i]), layer, h, a,
                             float(ds["identical_sample"].values[i, j, h])))
    rows.sort(key=lambda r: -r[0] if np.isfinite(r[0]) else -np.inf)
    lines = ["", f"Per layer x head on the capture ({len(rows)} layer x head x accumulator values; the 15 with the "
             "largest F, all in `fidelity_sample` and `identical_sample` of the dataset):", "",
             "| case | layer | head | acc | F | identical |", "|---|---|---|---|---|---|"]
    for f, case, layer, h, a, idn in rows[:15]:
        lines.append(f"| {case} | {layer} | {h} | `{a}` | {fmt_f(f)} | {idn:.1%} |")
    return lines


def write_validation(ds, out: Path) -> Path:
    """``out/validation.md``, whole or not at all."""
    return atomic_write(Path(out) / "validation.md", markdown_validation(ds))


__all__ = ["markdown_validation", "write_validation"]
