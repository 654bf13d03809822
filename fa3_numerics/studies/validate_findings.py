"""What a validation (the emulator against a kernel) found, for its dataset.

Exposed: ``findings``, ``with_findings``.

``findings(ds)``: ``ranking`` (``studies.validate.accumulator_ranking``: per accumulator model,
max and median F over the cases under the bar, bit-identical share, pass), ``nonfinite`` (one
line per case with non-finite outputs), the bar (``f_limit``, ``f_aim``), and ``verdict``: pass or
fail of the emulator against the fidelity band, which accumulator model matches the kernel
best, and which fail the bar.
"""

from __future__ import annotations

import xarray as xr

from ..text import fmt_f, md_code
from .findings import store, stored


def findings(ds: xr.Dataset) -> dict:
    from .validate import F_AIM, F_LIMIT, accumulator_ranking, findings as nonfinite_lines

    limit = float(ds.attrs.get("f_limit", F_LIMIT))
    aim = float(ds.attrs.get("f_aim", F_AIM))
    rank = accumulator_ranking(ds)
    # datasets written before the non-finite counts hold none of them: nothing is known of those
    bad = nonfinite_lines(ds) if "nonfinite_kernel" in ds else []
    label = ds.attrs.get("kernel_label", ds.attrs.get("backend", "?"))
    lines = []
    if rank:
        best = rank[0]
        passed = [r for r in rank if r["pass"]]
        failed = [r for r in rank if not r["pass"]]
        word = "PASS" if best["pass"] else "FAIL"
        lines.append(f"**{word}**: the emulator with {md_code(best['acc'])} matches {md_code(label)} within the "
                     f"fidelity band (F ≤ {limit:g}) in {'every' if best['pass'] else 'not every'} one of the "
                     f"{best['cases']} case(s) under the bar: max F {fmt_f(best['max_F'])}, median "
                     f"{fmt_f(best['median_F'])}, {best['mean_identical']:.1%} of outputs bit-identical"
                     + (f" (aim F ≤ {aim:g}: {'met' if best['max_F'] <= aim else 'not met'})" if best["pass"] else "")
                     + ".")
        if len(passed) > 1:
            lines.append("Also within the band: " + ", ".join(f"{md_code(r['acc'])} (max F {fmt_f(r['max_F'])})"
                                                             for r in passed[1:]) + ".")
        if failed:
            lines.append("**Avoid** " + ", ".join(
                f"{md_code(r['acc'])} (max F {fmt_f(r['max_F'])}"
                + (f", {r['nonfinite_only']} non-finite outputs where the kernel's are finite" if r["nonfinite_only"]
                   else "") + ")" for r in failed) + f": outside the band F ≤ {limit:g}.")
    else:
        lines.append("No case under the bar ran: nothing to pass or fail.")
    if bad:
        lines.append(f"**Non-finite outputs** in {len(bad)} case(s): see the warning below.")
    return {"kind": "validation", "f_limit": limit, "f_aim": aim, "ranking": rank, "nonfinite": bad,
            "verdict": {"pass": bool(rank and rank[0]["pass"]), "best": rank[0]["acc"] if rank else None,
                        "lines": lines}}


def with_findings(ds: xr.Dataset) -> xr.Dataset:
    if stored(ds) is not None:
        return ds
    return store(ds, findings(ds))


__all__ = ["findings", "with_findings"]
