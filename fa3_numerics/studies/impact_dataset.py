"""The impact study's results as one xarray Dataset.

Exposed: ``assemble``, ``read_impact``, ``VARIABLES``.

Layout (every per-token variable has a ``token`` dim, position t predicting token t+1):

- reference: ``ref_nll``, ``ref_pred``, ``ref_entropy`` (token); coords ``token_id``, ``target_id``.
- prefill, recipes: ``kl``, ``nll``, ``top1``, ``pred`` (variant, mask, token) and their summaries
  (``SUMMARY_DEFINITIONS``) over (variant, mask). ``mask`` is ``none`` (no layer runs the recipe:
  a control), ``all`` (every layer) or ``L<i>`` (only layer i); ``mask_layer`` gives i (-1 none,
  -2 all). ``nonfinite_logits`` (variant, mask) and ``nonfinite_attn`` (variant, mask, model_layer)
  count non-finite values.
- the sweep as (variant, layer): ``layer_kl_mean``, ``layer_kl_p99``, ``layer_top1_agree``, and
  ``attn_rel_l2`` (variant, layer, head): the recipe's attention error measured in that pass.
- ``kl_mean_sum_of_layers`` (variant): the sum over swept layers of ``layer_kl_mean``, beside
  ``kl_mean`` at ``all``: how additive the layers' effects are.
- model baselines: ``base_*`` (baseline, token) and summaries (baseline).
- decode: ``dec_*`` (dvariant, kv, token) and summaries (dvariant, kv); ``dspec`` the decode recipe.
- assignments (``--recipe-map`` and the budget's candidates): ``asg_*`` (assignment, token),
  summaries (assignment); ``asg_recipe`` (assignment, model_layer), ``asg_cost``, ``asg_source``.
- the audit link: ``audit_rel_l2`` (heads pooled) and ``audit_rel_l2_max`` (variant, layer),
  ``audit_sink_mass``, ``audit_p_underflow`` (layer, head), ``spearman_rho``, ``spearman_p``,
  ``spearman_rho_max`` (variant).

Attributes: provenance (``engine.provenance``), the model file's and text's sha256, the token
ids' sha256, seed, backend, timings, the prefix-reuse check, the budget search (JSON), the
mapping from audit rel_l2 to KL (``power_fit``), non-finite findings (``nonfinite_total``,
``nonfinite_where``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import xarray as xr

from ..errors import UsageError
from .impact_analysis import SUMMARY_DEFINITIONS, layer_rel_l2, power_fit, spearman, summarize

VARIABLES = {
    "kl": "KL(reference || variant) of the next-token distribution at each position, nats",
    "nll": "-log p(next token of the text); NaN at the last position (no next token)",
    "top1": "1 where the argmax next token equals the reference's",
    "pred": "argmax next-token id",
    "attn_rel_l2": "rel_l2 of the recipe's attention output against float64 in the pass where only that layer "
                   "runs it (same Q, K, V as the audit's)",
}

# Long names of the coordinates (the writer adds units: "1" for numbers, none for labels).
COORD_NAMES = {
    "token": "position in the text (predicting the token at position + 1)",
    "token_id": "token id at the position", "target_id": "next token id (-1 at the last position)",
    "fp8": "1 where the recipe runs FP8 matmuls", "sweep_spec": "recipe spec the layer sweep ran",
    "mask": "layers that run the recipe (none, all, or L<i>: only layer i)",
    "mask_layer": "layer of the mask (-1: none, -2: all)", "model_layer": "model layer index",
    "baseline": "model baseline (SDPA in float32 or bfloat16)", "dvariant": "decode recipe label",
    "kv": "KV-cache mode of the decode pass", "dspec": "canonical spec of the decode recipe",
    "assignment": "per-layer recipe assignment", "asg_source": "where the assignment comes from (--recipe-map, budget)",
    "asg_recipe": "recipe label the assignment gives the layer", "asg_cost": "summed recipe cost of the assignment",
}


def _stack(results: dict, keys: list[tuple], name: str, dtype=np.float64) -> np.ndarray:
    return np.stack([np.asarray(results[k][name], dtype=dtype) for k in keys])


def _group(results, keys, shape, prefix, dims, ref_ppl) -> dict:
    """Per-token arrays and summaries of the passes ``keys`` laid out as ``shape`` + (token,)."""
    if not keys:
        return {}
    out = {}
    arrs = {name: _stack(results, keys, name, dt).reshape(shape + (-1,))
            for name, dt in (("kl", np.float64), ("nll", np.float64), ("top1", np.int8), ("pred", np.int32))}
    for name, arr in arrs.items():
        out[f"{prefix}{name}"] = (dims + ["token"], arr, {"description": VARIABLES[name]})
    for name, arr in summarize(arrs["kl"], arrs["nll"], arrs["top1"], ref_ppl).items():
        out[f"{prefix}{name}"] = (dims, arr, {"description": SUMMARY_DEFINITIONS[name]})
    bad = _stack(results, keys, "nonfinite_logits").sum(axis=-1).reshape(shape).astype(np.int64)
    out[f"{prefix}nonfinite_logits"] = (dims, bad, {"description": "count of non-finite logits"})
    att = _stack(results, keys, "nonfinite_attn").reshape(shape + (-1,)).astype(np.int64)
    out[f"{prefix}nonfinite_attn"] = (dims + ["model_layer"], att,
                                      {"description": "count of non-finite attention outputs per layer"})
    return out


def assemble(info: dict, ref, recipes, dec, map_layers, results: dict, audit_ds, budget, swept=None) -> xr.Dataset:
    from ..data.capture import token_ids_sha256
    from ..engine.provenance import provenance
    from .audit import recipe_cost
    from .impact import IMPACT_FORMAT

    n_layers = info["num_layers"]
    sweep = info["sweep_layers"]
    labels = [lab for lab, _ in recipes]
    ids = info["input_ids"][0].tolist()
    n = len(ids)
    ref_ppl = info["ref_ppl"]
    masks = ["none", "all"] + [f"L{i}" for i in sweep]
    coords = {
        "token": np.arange(n), "token_id": ("token", np.asarray(ids, dtype=np.int64)),
        "target_id": ("token", np.asarray(ids[1:] + [-1], dtype=np.int64)),
        "variant": labels, "spec": ("variant", [r.spec() for _, r in recipes]),
        "cost": ("variant", [recipe_cost(r) for _, r in recipes]),
        "fp8": ("variant", np.asarray([r.fp8 for _, r in recipes], dtype=np.int8)),
        "sweep_spec": ("variant", [r.spec() for _, r in (swept or recipes)]),
        "mask": masks, "mask_layer": ("mask", np.asarray([-1, -2] + list(sweep), dtype=np.int64)),
        "layer": np.asarray(sweep, dtype=np.int64), "model_layer": np.arange(n_layers),
    }
    data = {
        "ref_nll": (["token"], ref.nll, {"description": "reference -log p(next token); NaN at the last position"}),
        "ref_pred": (["token"], ref.pred.astype(np.int32), {"description": "reference argmax next-token id"}),
        "ref_entropy": (["token"], ref.entropy, {"description": "entropy of the reference distribution, nats"}),
    }
    V = len(recipes)
    keys = [("none",) if mk == "none" else ("full", vi) if mk == "all" else ("layer", vi, sweep.index(int(mk[1:])))
            for vi in range(V) for mk in masks]
    data.update(_group(results, keys, (V, len(masks)), "", ["variant", "mask"], ref_ppl))
    if sweep:
        for name in ("kl_mean", "kl_p99", "top1_agree"):
            data[f"layer_{name}"] = (["variant", "layer"], data[name][1][:, 2:],
                                     {"description": f"{SUMMARY_DEFINITIONS[name]}; only that layer runs the recipe"})
        rel = np.stack([[results[("layer", vi, li)]["attn_rel_l2"] for li in range(len(sweep))] for vi in range(V)])
        coords["head"] = np.arange(rel.shape[-1])
        data["attn_rel_l2"] = (["variant", "layer", "head"], rel, {"description": VARIABLES["attn_rel_l2"]})
        data["kl_mean_sum_of_layers"] = (["variant"], data["kl_mean"][1][:, 2:].sum(axis=1),
                                         {"description": "sum over swept layers of layer_kl_mean (additive prediction "
                                                         "of kl_mean at mask 'all' when every layer is swept)"})
    base_keys = [k for k in (("base", 0), ("base", 1)) if k in results]
    if base_keys:
        coords["baseline"] = ["model-sdpa-fp32", "model-sdpa-bf16"][:len(base_keys)]
        data.update(_group(results, base_keys, (len(base_keys),), "base_", ["baseline"], ref_ppl))
    if dec:
        dlabels = list(dict.fromkeys(lab for lab, _, _ in dec))
        modes = list(dict.fromkeys(mode for _, mode, _ in dec))
        pos = {(lab, mode): di for di, (lab, mode, _) in enumerate(dec)}
        coords.update({"dvariant": dlabels, "kv": modes})
        coords["dspec"] = (["dvariant", "kv"], [[dec[pos[(lab, mode)]][2].spec() for mode in modes] for lab in dlabels])
        dkeys = [("decode", pos[(lab, mode)]) for lab in dlabels for mode in modes]
        data.update(_group(results, dkeys, (len(dlabels), len(modes)), "dec_", ["dvariant", "kv"], ref_ppl))
    asg = [(name, [lab for lab, _ in per], [r for _, r in per], "--recipe-map", ("map", mi))
           for mi, (name, per) in enumerate(map_layers)]
    if budget is not None:
        asg += [(a["label"], a["labels"], None, "budget", ("budget", ai)) for ai, a in enumerate(budget["attempts"])]
        for ai, a in enumerate(budget["attempts"]):
            results[("budget", ai)] = a["result"]
    if asg:
        lut = dict(recipes)
        n_maps = len(map_layers)
        coords.update({"assignment": [f"{a[0]}" if a[3] != "budget" else f"budget #{i - n_maps + 1}: {a[0]}"
                                      for i, a in enumerate(asg)],
                       "asg_source": ("assignment", [a[3] for a in asg])})
        coords["asg_recipe"] = (["assignment", "model_layer"], [list(a[1]) for a in asg])
        coords["asg_cost"] = ("assignment", [sum(recipe_cost(r) for r in (a[2] or [lut[x] for x in a[1]]))
                                             for a in asg])
        data.update(_group(results, [a[4] for a in asg], (len(asg),), "asg_", ["assignment"], ref_ppl))
    attrs = _attrs(info, ref, results, data, labels, sweep, budget)
    opts = getattr(ref.record, "options", None)
    if opts:  # sliding windows, softcaps, sinks: what every pass computed in those layers
        attrs["attention_options"] = {str(i): {k: ([float(x) for x in v] if k == "sinks" else v) for k, v in o.items()}
                                      for i, o in sorted(opts.items())}
    if audit_ds is not None:
        _audit_link(audit_ds, recipes, sweep, data, coords, attrs)
    ds = xr.Dataset(data, coords=coords)
    for name, long in COORD_NAMES.items():
        if name in ds.coords:
            ds[name].attrs.setdefault("long_name", long)
    attrs.update(provenance(info["device"]))
    if "device_map" in info:
        attrs["device_map"] = info["device_map"]
    attrs.update({"format": IMPACT_FORMAT, "kind": "impact", "token_ids_sha256": token_ids_sha256(info["input_ids"])})
    ds.attrs.update({k: (v if isinstance(v, (str, int, float)) else json.dumps(v)) for k, v in attrs.items()})
    from .impact_findings import with_findings

    return with_findings(ds)


def _attrs(info, ref, results, data, labels, sweep, budget) -> dict:
    src, cfg = info["model"], info["config"]
    import hashlib

    where = []
    for key, res in results.items():
        bl, ba = int(np.sum(res["nonfinite_logits"])), np.asarray(res["nonfinite_attn"])
        if bl or ba.sum():
            where.append({"pass": "/".join(map(str, key)), "logits": bl,
                          "attn_layers": {int(i): int(c) for i, c in enumerate(ba) if c}})
    nf_ref = int(ref.nonfinite["logits"]) + int(np.sum(ref.nonfinite["attn"]))
    if nf_ref:
        where.insert(0, {"pass": "reference", "logits": int(ref.nonfinite["logits"]),
                         "attn_layers": {int(i): int(c) for i, c in enumerate(ref.nonfinite["attn"]) if c}})
    checks = {}
    for key, res in results.items():
        if key[0] == "check":  # ("check", layer, variant index): the same plan as a sweep pass, run in full
            layer, vi = key[1], key[2]
            other = results[("layer", vi, sweep.index(layer))]
            same = bool(np.array_equal(res["kl"], other["kl"]) and np.array_equal(res["pred"], other["pred"])
                        and np.array_equal(res["nll"], other["nll"], equal_nan=True))
            checks[str(layer)] = {"variant": labels[vi], "bit_identical": same,
                                  "max_abs_kl_diff": float(np.max(np.abs(res["kl"] - other["kl"])))}
    acc = {}
    for key, res in results.items():
        if key[0] == "acc":  # ("acc", layer, variant index): the one-layer pass with the recipe as given
            layer, vi = key[1], key[2]
            given = float(np.mean(res["kl"]))
            sw = float(np.mean(results[("layer", vi, sweep.index(layer))]["kl"]))
            acc.setdefault(labels[vi], {})[str(layer)] = {"kl_mean_given": given, "kl_mean_sweep": sw,
                                                          "ratio": sw / given if given > 0 else math.nan}
    t = info["times"]
    return {
        "experiment": "impact", "description": f"FP8 attention impact on {src.name}'s next-token predictions",
        "model": src.name, "model_file": src.gguf_file or Path(src.folder).name, "model_origin": src.origin,
        "model_sha256": info["model_sha256"], "architecture": info.get("architecture", ""),
        "num_layers": info["num_layers"], "heads": int(cfg.num_attention_heads),
        "kv_heads": int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)),
        "softmax_scale": repr(ref.scale), "vocab_size": int(ref.p.shape[-1]),
        "text_source": info["text_source"], "text_sha256": hashlib.sha256(info["text"].encode("utf-8")).hexdigest(),
        "tokens": int(info["input_ids"].shape[1]), "first_tokens_text": _plain(info["tokenizer"].decode(
            info["input_ids"][0, :48].tolist())),
        "backend": info["backend"], "seeds": json.dumps([info["seed"]]), "rotation_seed": info["seed"],
        "reference": "the same model (float32) with every layer's attention in float64, rounded once to float32",
        "ref_ppl": info["ref_ppl"], "sweep_layers": json.dumps(sweep), "decode_modes": json.dumps(info["modes"]),
        "prefix_reuse": "sweep passes start at their layer from the reference's hidden states; checked on full passes",
        "prefix_checks": json.dumps(checks),
        "prefix_bit_identical": int(all(c["bit_identical"] for c in checks.values())) if checks else -1,
        "sweep_acc": info.get("sweep_acc", "given"), "sweep_acc_checks": json.dumps(acc),
        "code_version": info["code"],
        "wall_seconds": round(t["total"], 2), "load_seconds": round(t["load"], 2),
        "reference_seconds": round(t["reference"], 2),
        "compute_seconds": round(float(sum(float(r.get("seconds", 0.0)) for r in results.values())), 2),
        "nonfinite_total": int(sum(w["logits"] + sum(w["attn_layers"].values()) for w in where)),
        "nonfinite_where": json.dumps(where),
        "budget": json.dumps(_budget_attr(budget)) if budget is not None else "",
    }


def _plain(text: str, limit: int = 160) -> str:
    """One line of the text for reports: whitespace collapsed, Markdown markup characters dropped."""
    flat = " ".join(text.split())
    flat = "".join(c for c in flat if c not in "*`_#|<>[]")
    return flat[:limit] + ("..." if len(flat) > limit else "")


def _budget_attr(budget: dict) -> dict:
    strip = lambda a: {k: (list(v) if isinstance(v, tuple) else v) for k, v in a.items() if k != "result"}  # noqa: E731
    return {**{k: v for k, v in budget.items() if k != "attempts"}, "attempts": [strip(a) for a in budget["attempts"]]}


def _audit_link(audit_ds, recipes, sweep, data, coords, attrs) -> None:
    """Audit errors per layer, the Spearman correlation with the per-layer KL, and a KL(rel_l2) fit."""
    labels = [lab for lab, _ in recipes]
    rel = audit_ds["rel_l2"].transpose("layer", "head", "variant").values      # (L, H, V)
    rms = audit_ds["out_rms"].transpose("layer", "head").values                # (L, H)
    pooled = np.stack([layer_rel_l2(rel[:, :, v], rms) for v in range(len(labels))])  # (V, L)
    worst = rel.max(axis=1).T                                                   # (V, L)
    data["audit_rel_l2"] = (["variant", "layer"], pooled, {"description": "audit rel_l2 of the layer, heads pooled "
                                                                          "(weighted by reference output energy)"})
    data["audit_rel_l2_max"] = (["variant", "layer"], worst, {"description": "audit rel_l2, max over heads"})
    for name in ("sink_mass", "p_underflow"):
        data[f"audit_{name}"] = (["layer", "head"], audit_ds[name].transpose("layer", "head").values,
                                 {"description": audit_ds[name].attrs.get("description", "")})
    kl = data["layer_kl_mean"][1]
    rho = [spearman(pooled[v], kl[v]) for v in range(len(labels))]
    rho_max = [spearman(worst[v], kl[v]) for v in range(len(labels))]
    data["spearman_rho"] = (["variant"], np.array([r[0] for r in rho]),
                            {"description": "Spearman rho over layers: audit_rel_l2 vs layer_kl_mean"})
    data["spearman_p"] = (["variant"], np.array([r[1] for r in rho]), {"description": "its two-sided p-value"})
    data["spearman_rho_max"] = (["variant"], np.array([r[0] for r in rho_max]),
                                {"description": "Spearman rho over layers: audit_rel_l2_max vs layer_kl_mean"})
    # Across recipes: FP8/16-bit recipes only (FP32 attention's ~1e-7 errors would stretch the fit).
    keep = [v for v, (_, r) in enumerate(recipes) if r.qk != "fp32"]
    if keep:
        x, y = pooled[keep].ravel(), kl[keep].ravel()
        r, p, nn = spearman(x, y)
        attrs["spearman_pooled"] = json.dumps({"rho": r, "p": p, "n": nn, "variants": [labels[v] for v in keep]})
        attrs["kl_from_rel_l2_fit"] = json.dumps(power_fit(x, y))
    # Per-layer gain g = KL / rel_l2^2 (second order: KL ~ g rel_l2^2). It is a property of the layer
    # (how much the model amplifies an attention error there), so one recipe's sweep calibrates it
    # and the audit's rel_l2 of any other recipe then predicts that recipe's per-layer KL.
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(pooled > 0, kl / pooled ** 2, np.nan)
    data["layer_gain"] = (["variant", "layer"], gain, {"description": "layer_kl_mean / audit_rel_l2^2: how much the "
                                                                       "model amplifies that layer's attention error"})
    cal = next((v for v, (_, r) in enumerate(recipes) if r.qk in ("fp16", "bf16")), None)
    if cal is not None:
        rho_g, ratio_g, spread_g = [], [], []
        for v in range(len(labels)):
            pred = gain[cal] * pooled[v] ** 2
            rho_g.append(spearman(pred, kl[v])[0])
            with np.errstate(divide="ignore", invalid="ignore"):
                lr = np.log10(kl[v] / pred)
            lr = lr[np.isfinite(lr)]
            med = float(np.median(lr)) if lr.size else math.nan
            ratio_g.append(10 ** med)
            spread_g.append(10 ** float(np.percentile(np.abs(lr - med), 90)) if lr.size else math.nan)
        attrs["gain_calibration"] = labels[cal]
        data["gain_pred_rho"] = (["variant"], np.array(rho_g), {"description": f"Spearman over layers of the per-layer "
                                 f"KL predicted as gain({labels[cal]}) x audit_rel_l2^2 against the measured one"})
        data["gain_pred_ratio"] = (["variant"], np.array(ratio_g), {"description": "median measured / predicted"})
        data["gain_pred_spread"] = (["variant"], np.array(spread_g),
                                    {"description": "factor around the median ratio that covers 90% of the layers"})
    # The sweep measured the same errors in passing: they must agree with the audit's.
    mine = data["attn_rel_l2"][1]                                               # (V, L, H)
    aud = np.transpose(rel, (2, 0, 1))
    diff = np.abs(mine - aud) / np.maximum(np.abs(aud), 1e-300)
    attrs["audit_vs_sweep_rel_l2_max_rel_diff"] = float(np.nanmax(diff)) if diff.size else math.nan
    attrs["audit_rows"] = "every query row"


def read_impact(path: str | Path) -> xr.Dataset:
    """Open an impact dataset; one-line errors for anything else."""
    from ..engine.dataset import open_netcdf
    from .impact import IMPACT_FORMAT

    path = Path(path)
    ds = open_netcdf(path, "give the impact.nc written by `fa3-numerics impact`")

    if ds.attrs.get("format") != IMPACT_FORMAT or "kl" not in ds:
        raise UsageError(f"{path} is not an impact dataset (no '{IMPACT_FORMAT}' marker); give the impact.nc "
                         "written by `fa3-numerics impact`")
    return ds


__all__ = ["assemble", "read_impact", "VARIABLES"]
