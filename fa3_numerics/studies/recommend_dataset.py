"""``recommend``'s findings: the choice, the verdict, the diagnosis and what the target takes, as one
xarray Dataset (the report reads only it) and the ``recommend.json`` artifact.

Exposed: ``assemble``, ``read_recommend``, ``findings``.

Layout: ``rel_l2`` (candidate, layer, head) and ``rel_l2_pooled`` (candidate, layer) from the
screen; ``predicted_layer_kl`` (candidate, layer) and ``predicted_kl`` (candidate); ``saturated``
and ``saturated_head`` (candidate, layer, tensor): entries a calibrated recipe clamps on the
held-out text and the head with most of them (-1: none); one variable per ``recommend_stats``
statistic (layer); ``layer_kl`` and ``gain`` (layer); the verified passes (verified) with their
measured summaries and ``verified_recipe`` (verified, layer). ``attrs["findings"]`` (JSON) holds
the verdict, the choice per layer, the diagnosis and the deployment (``findings(ds)`` reads it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import xarray as xr

from ..errors import UsageError
from ..numerics import calibration as calib
from ..numerics.granularity import PerHead
from ..numerics.rotation import make_rotation
from .recommend_stats import STATS
from .recommend_targets import TARGETS, deploy_kind, diagnose, implements

MEASURED = ("kl_mean", "kl_p99", "kl_max", "top1_agree", "ppl", "ppl_delta")
# Where each engine reads its scales and its per-layer switch, from the sources cited.
ENGINE_LAYOUT = {
    "vllm": {"scales": "model.layers.{i}.self_attn.q_scale / k_scale / v_scale (vLLM's loader maps "
                       "'...self_attn.k_scale' onto the attention layer's k_scale: maybe_remap_kv_scale_name, "
                       "vllm-project/vllm vllm/model_executor/model_loader/weight_utils.py): shape [1] per tensor, or "
                       "q_scale [num_heads] and k_scale/v_scale [num_kv_heads] per attention head (vllm-project/vllm "
                       "docs/features/quantization/quantized_kvcache.md); each is the descale: x_fp8 = x / scale",
             "skip_layers": "--kv-cache-dtype-skip-layers (CacheConfig.kv_cache_dtype_skip_layers: layer indices or "
                            "'sliding_window'; vllm-project/vllm vllm/config/cache.py)"},
    "sglang": {"scales": "per-tensor k_scale/v_scale per layer in the checkpoint; 1.0 when absent "
                         "(sgl-project/sglang #6518)",
               "skip_layers": "none found in the sources checked: no per-layer KV-cache dtype switch"},
    "trtllm": {"scales": "ModelOpt's per-tensor FP8 scales per attention layer (calibration amax / 448)",
               "skip_layers": "none found in the sources checked: exclude layers at ModelOpt export instead"},
}


def _choice(verified: list[dict]) -> dict | None:
    passing = [v for v in verified if v["meets"]]
    return min(passing, key=lambda v: (v["cost"], v["kl_mean"])) if passing else None


def _deploy(info, choice_labels: list[str], recipes: list) -> dict:
    """What the target takes, per layer, for the chosen recipe(s)."""
    target, L, cid = info["target"], info["num_layers"], info["cid"]
    from .recommend import resolve

    layers = []
    kinds = set()
    for i, (lab, r) in enumerate(zip(choice_labels, recipes)):
        kind = deploy_kind(target, r)
        kinds.add(kind)
        row = {"layer": i, "recipe": lab, "spec": r.short_str()}
        rot = make_rotation(r.rot, info["head_dim"], info["seed"])
        group = info["heads"] // info["kv_heads"] if isinstance(r.gran, PerHead) else 1
        st = calib.static_for(resolve(r, cid, i), rot, group=group, device="cpu")
        if kind in ("fa3", "kernel"):
            row.update({"rotation": r.rot, "rotation_seed": info["seed"] if r.rot != "none" else None,
                        "smoothing": r.smooth, "descale": {"head": "per (batch, kv-head)", "tensor": "per tensor"}
                        .get(r.gran.short_str(), r.gran.short_str()), "format": r.qk})
        if st is not None and st.k_mean is not None:
            # the mean is stored in the basis the kernel sees (after the rotation, if any)
            row["k_mean"] = st.k_mean[0, :, 0].tolist()
        if st is not None and st.q is not None:
            for t in ("q", "k", "v"):
                d = getattr(st, t).reshape(-1)
                if t == "q" and d.numel() > 1:
                    d = d.reshape(info["heads"])
                row[f"{t}_scale"] = [float(x) for x in d]
        if r.qk in ("bf16", "fp16", "fp32"):
            row["fp8"] = False
        layers.append(row)
    out = {"target": target, "layers": layers}
    if target in ENGINE_LAYOUT:
        out["layout"] = ENGINE_LAYOUT[target]
        # float32 tensors to add to the checkpoint, by the names the layout gives
        out["checkpoint_tensors"] = {f"model.layers.{row['layer']}.self_attn.{t}_scale": row[f"{t}_scale"]
                                     for row in layers for t in ("q", "k", "v") if f"{t}_scale" in row}
        out["keep_bf16_layers"] = [row["layer"] for row in layers if row.get("fp8") is False]
    if target in ("fa3", "torchao"):
        out["how"] = ("per layer: rotate Q and K by the seeded random Hadamard where rotation is hadamard, subtract "
                      "k_mean (per kv-head, channel; after the rotation) from every key where given, then call the "
                      "FA3 FP8 kernel with q/k/v descales at the granularity named (amax / 448 of the call's "
                      "tensors)")
    return out


def _diagnosis(info) -> list[dict]:
    """Per layer where the first candidate alone spends more than its share of the budget."""
    L, kl_budget = info["num_layers"], info["kl_budget"]
    labels = [lab for lab, _ in info["cands"]]
    out = []
    for i in range(L):
        if not (info["layer_kl"][i] > kl_budget / L):
            continue
        st = {k: float(v[i]) for k, v in info["stats"].items()}
        ranked = diagnose(st)
        top = ranked[0]
        fixes = [{"candidate": labels[c], "rel_l2": float(info["pooled"][c, i]),
                  "gain": float(info["pooled"][0, i] / info["pooled"][c, i]) if info["pooled"][c, i] > 0 else math.inf}
                 for c, (_, r) in enumerate(info["cands"]) if c and implements(top["remedy"], r)]
        # Beside the statistic, the measurement: of the remedies whose statistic is over its threshold,
        # the one whose best candidate lowers this layer's rel_l2 the most.
        best = None
        for rr in ranked:
            if not rr["indicated"]:
                continue
            gains = [info["pooled"][0, i] / info["pooled"][c, i] for c, (_, r) in enumerate(info["cands"])
                     if c and info["pooled"][c, i] > 0 and implements(rr["remedy"], r)]
            if gains and (best is None or max(gains) > best["gain"]):
                best = {"remedy": rr["remedy"], "gain": float(max(gains))}
        out.append({"layer": i, "layer_kl": float(info["layer_kl"][i]), "share": float(info["layer_kl"][i] / kl_budget),
                    "first_candidate": labels[0], "diagnosis": top, "ranked": ranked, "remedy_measured": fixes,
                    "measured_best": best})
    return out


def _diagnosis_summary(diag: list[dict]) -> dict:
    """How many failing layers each remedy explains: by the statistic, and by the measurement."""
    by_stat: dict[str, int] = {}
    by_measure: dict[str, int] = {}
    for d in diag:
        if d["diagnosis"]["indicated"]:
            by_stat[d["diagnosis"]["remedy"]] = by_stat.get(d["diagnosis"]["remedy"], 0) + 1
        if d.get("measured_best"):
            name = d["measured_best"]["remedy"]
            by_measure[name] = by_measure.get(name, 0) + 1
    return {"failing_layers": len(diag), "by_statistic": by_stat, "by_measurement": by_measure}


def _saturation(info) -> list[dict]:
    rows = []
    for c, (lab, r) in enumerate(info["cands"]):
        for t in ("q", "k", "v"):
            counts = info["sat"][t][c]
            if counts.sum():
                worst = int(np.argmax(counts))
                rows.append({"candidate": lab, "tensor": t, "count": int(counts.sum()),
                             "layers": [int(i) for i in np.nonzero(counts)[0]], "worst_layer": worst,
                             "worst_head": int(info["sat_head"][t][c, worst]), "worst_count": int(counts[worst])})
    return rows


def _avoid(info, verified, choice) -> list[dict]:
    """Candidates that miss the budget, worst first, each with why: where its KL goes (the layer
    with the largest predicted share and that layer's diagnosis) and any saturation."""
    labels = [lab for lab, _ in info["cands"]]
    measured = {v["label"]: v for v in verified if v["kind"] == "uniform"}
    sat = _saturation(info)
    rows = []
    for c, lab in enumerate(labels):
        m = measured.get(lab)
        kl = m["kl_mean"] if m else float(info["predicted"][c])
        if kl <= info["kl_budget"] and (m is None or m["meets"]):
            continue
        worst = int(np.nanargmax(info["pred_layer"][c])) if np.isfinite(info["pred_layer"][c]).any() else 0
        st = {k: float(v[worst]) for k, v in info["stats"].items()}
        rows.append({"candidate": lab, "kl_mean": kl, "measured": m is not None,
                     "bf16_multiple": kl / info["bf16"]["kl_mean"] if info["bf16"]["kl_mean"] > 0 else math.inf,
                     "worst_layer": worst, "worst_layer_share": float(info["pred_layer"][c, worst] /
                                                                     max(1e-300, info["predicted"][c])),
                     "worst_layer_diagnosis": diagnose(st)[0]["remedy"],
                     "worst_layer_indicated": diagnose(st)[0]["indicated"],
                     "saturation": [s for s in sat if s["candidate"] == lab]})
    return sorted(rows, key=lambda r: -r["kl_mean"] if math.isfinite(r["kl_mean"]) else -math.inf)


def _measured_with(backend: str, device: str) -> dict:
    from ..engine.backends import get_backend

    be = get_backend(backend)
    return {"backend": backend, "device": device, "what": getattr(be, "label", None) or be.description,
            "hardware_kernel": bool(getattr(be, "hardware", False))}


def assemble(info) -> tuple[xr.Dataset, dict]:
    from ..data.capture import token_ids_sha256
    from ..engine.provenance import provenance
    from .recommend import RECOMMEND_FORMAT

    labels = [lab for lab, _ in info["cands"]]
    L, H = info["num_layers"], info["heads"]
    verified = info["verified"]
    choice = _choice(verified)
    closest = None
    if choice is None and verified:
        closest = min(verified, key=lambda v: info["budget"].distance(v, info["kl_budget"]))
    chosen = choice or closest
    choice_labels = [labels[c] for c in chosen["choice"]] if chosen else []
    choice_recipes = [info["cands"][c][1] for c in chosen["choice"]] if chosen else []
    majority = max(set(choice_labels), key=choice_labels.count) if choice_labels else None
    exceptions = [{"layer": i, "recipe": lab} for i, lab in enumerate(choice_labels) if lab != majority]
    strip = lambda v: {k: val for k, val in v.items() if k != "choice"}  # noqa: E731
    budget = info["budget"]
    fnd = {
        "format": RECOMMEND_FORMAT, "model": info["model"].name, "model_sha256": info["model_sha256"],
        "target": info["target"], "target_description": TARGETS[info["target"]].description
        if info["target"] in TARGETS else "every target's candidates",
        "texts": info["texts"], "tokens": info["tokens"], "calibration_id": info["cid"],
        "budget": {"kl_mean": info["kl_budget"], "source": "--budget-kl" if budget.kl is not None else
                   f"{budget.factor:g} x BF16 SDPA's KL mean on the held-out text", "ppl_delta": budget.ppl,
                   "top1": budget.top1},
        "bf16_sdpa": {k: info["bf16"][k] for k in MEASURED}, "reference_ppl": info["ref_ppl"],
        "choice": None if choice is None else {**strip(choice), "per_layer": choice_labels,
                                              "majority": majority, "exceptions": exceptions},
        "closest": None if closest is None else strip(closest),
        "verified": [strip(v) for v in verified],
        "avoid": _avoid(info, verified, choice),
        "diagnosis": (diag := _diagnosis(info)),
        "diagnosis_summary": _diagnosis_summary(diag),
        "saturation": _saturation(info),
        "deploy": _deploy(info, choice_labels, choice_recipes) if chosen else None,
        "decode": ("Static scales and static K means make each decode step compute what its prefill row computes, "
                   "so the held-out pass is also its teacher-forced decode against the FP8 KV cache; recipes with "
                   "dynamic descales are evaluated as prefill calls"),
        "accumulator": ("acc=fp22 ran as acc=fp32 (emulator on a CPU)" if any(
            r.acc != r2.acc for (_, r), (_, r2) in zip(info["cands"], info["run_recipes"])) else "as given"),
        # which attention computed every measured figure: the emulator, the FA3 kernel, or a stand-in
        "measured_with": _measured_with(info["backend"], info["device"]),
        "seconds": round(info["seconds"], 1),
    }
    coords = {"candidate": labels, "layer": np.arange(L), "head": np.arange(H), "tensor": ["q", "k", "v"],
              "spec": ("candidate", [r.short_str() for _, r in info["cands"]]),
              "cost": ("candidate", np.asarray(info["costs"], dtype=np.int64))}
    sat = np.stack([info["sat"][t] for t in ("q", "k", "v")], axis=-1)
    sat_head = np.stack([info["sat_head"][t] for t in ("q", "k", "v")], axis=-1)
    data = {
        "rel_l2": (["candidate", "layer", "head"], info["rel"], {"description": "screen: rel_l2 of the candidate's "
                   "attention output against float64 on the held-out Q, K, V, every query row"}),
        "rel_l2_pooled": (["candidate", "layer"], info["pooled"], {"description": "rel_l2, heads pooled by reference "
                          "output energy"}),
        "predicted_layer_kl": (["candidate", "layer"], info["pred_layer"], {"description": "gain x rel_l2_pooled^2"}),
        "predicted_kl": (["candidate"], info["predicted"], {"description": "sum over layers of predicted_layer_kl"}),
        "saturated": (["candidate", "layer", "tensor"], sat, {"description": "held-out entries the candidate's fixed "
                      "descales clamp to the format's max"}),
        "saturated_head": (["candidate", "layer", "tensor"], sat_head, {"description": "head with most saturated "
                           "entries (-1: none)"}),
        "layer_kl": (["layer"], info["layer_kl"], {"description": f"KL mean when only that layer runs {labels[0]}"}),
        "gain": (["layer"], info["gain"], {"description": "layer_kl / rel_l2_pooled(first candidate)^2"}),
    }
    for name, arr in info["stats"].items():
        data[f"stat_{name}"] = (["layer"], arr, {"description": STATS[name]})
    if verified:
        coords["verified"] = [v["label"] for v in verified]
        coords["verified_kind"] = ("verified", [v["kind"] for v in verified])
        coords["verified_recipe"] = (["verified", "layer"], [[labels[c] for c in v["choice"]] for v in verified])
        for k in MEASURED + ("predicted", "bf16_multiple"):
            data[f"v_{k}"] = (["verified"], np.asarray([v[k] for v in verified], dtype=np.float64), {})
        data["v_cost"] = (["verified"], np.asarray([v["cost"] for v in verified], dtype=np.int64), {})
        data["v_meets"] = (["verified"], np.asarray([v["meets"] for v in verified], dtype=np.int8), {})
        data["v_nonfinite"] = (["verified"], np.asarray([v["nonfinite"] for v in verified], dtype=np.int64), {})
    ds = xr.Dataset(data, coords=coords)
    ds.attrs.update(provenance(info["device"]))
    nonfinite = int(sum(v["nonfinite"] for v in verified)) + int(info["bf16"]["nonfinite"]) + int(
        (~np.isfinite(info["rel"])).sum())
    ds.attrs.update({
        "kind": "recommend", "format": fnd["format"], "experiment": "recommend", "model": info["model"].name,
        "target": info["target"], "backend": info["backend"], "seeds": json.dumps([info["seed"]]),
        "softmax_scale": repr(info["scale"]), "tokens": info["tokens"],
        "calib_token_ids_sha256": token_ids_sha256(info["calib_ids"]),
        "token_ids_sha256": token_ids_sha256(info["held_ids"]),
        "nonfinite_total": nonfinite, "findings": json.dumps(fnd, default=_json_default),
        "wall_seconds": round(info["seconds"], 2),
    })
    return ds, fnd


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def findings(ds) -> dict:
    return json.loads(ds.attrs["findings"])


def read_recommend(path: str | Path) -> xr.Dataset:
    from ..engine.dataset import open_netcdf
    from .recommend import RECOMMEND_FORMAT

    ds = open_netcdf(Path(path), "give the recommend.nc written by `fa3-numerics recommend`")
    if ds.attrs.get("format") != RECOMMEND_FORMAT:
        raise UsageError(f"{path} is not a recommend dataset; give the recommend.nc written by `fa3-numerics "
                         "recommend`")
    return ds


__all__ = ["assemble", "findings", "read_recommend", "ENGINE_LAYOUT"]
