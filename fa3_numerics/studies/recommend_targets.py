"""What ``recommend`` may choose from: targets (a kernel or an engine, and the candidates of the field
it can run) and the remedies its diagnosis points to.

Exposed: ``Target``, ``TARGETS``, ``target_names``, ``candidates``, ``Remedy``, ``REMEDIES``, ``diagnose``,
``implements``.

The FA3 and engine targets also hold ``fa3-bf16``, the per-layer fallback: a layer the mix gives it
runs the BF16 kernel (an engine keeps it out of its FP8 KV cache: vLLM's
``--kv-cache-dtype-skip-layers``); it is verified alone only when nothing else is left.

A target is data: its candidate presets or specs, what it deploys (``deploy``: the FA3 kernel's
pre-pass and descales, an engine's checkpoint scales, or a kernel's own recipe), and why. ``any``
is the union of all. The user edits a target's set with ``--add SPEC`` and ``--drop NAME``.

A remedy names the statistic of a layer's Q, K, V that calls for it (``audit_stats`` and
``recommend_stats``), the threshold above which the statistic is large, and the recipe keys that
implement it. ``diagnose`` scores each remedy as statistic / threshold and ranks them: the first is
the diagnosis of a failing layer, with the remedies over their thresholds beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..errors import UsageError, require
from ..numerics.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    description: str
    candidates: tuple[str, ...]
    deploy: str  # "fa3": pre-pass + descales; "engine": q/k/v checkpoint scales; "kernel": the recipe itself


FALLBACK = "fa3-bf16"
_FA3 = ("fa3-fp8-kernel", "fa3-fp8-kernel,gran=tensor", "fa3-fp8-kernel-hadamard",
        "fa3-fp8-kernel,smooth=k,kmean=static", "fa3-fp8-kernel-hadamard,smooth=k,kmean=static", "fa3-bf16")
TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("fa3", "the public FA3 FP8 kernel: one descale per (batch, kv-head) or per tensor; a Hadamard rotation "
           "and K smoothing (a static per-kv-head K mean) are pre-passes on Q and K before the call", _FA3, "fa3"),
    Target("triton", "fa3-numerics' per-block Triton kernel: one scale per kBlockM rows of Q and kBlockN rows of "
           "K and V, Hadamard optional",
           ("fa3-fp8-kernel,gran=block", "fa3-fp8,pow2=0", "fa3-fp8-kernel,gran=block,smooth=k,kmean=static"),
           "kernel"),
    Target("sage2", "SageAttention2 (INT8 Q/K per thread, FP8 P and V per channel); the public kernels smooth K only",
           ("sage2-int8,smooth=k", "sage2-int8"), "kernel"),
    Target("torchao", "torchao's apply_low_precision_attention: SDPA swapped for per-head FP8 FA3 attention "
           "(pytorch/ao #3959, #3857)", ("fa3-fp8-kernel",), "fa3"),
    Target("vllm", "vLLM's FP8 attention with an FP8 KV cache on the FA3 backend: scales 1.0, "
           "calculate_kv_scales, or calibrated per-tensor / per-head checkpoint scales",
           ("vllm-fp8", "vllm-fp8-calc", "vllm-fp8-static", "vllm-fp8-static-head", "fa3-bf16"), "engine"),
    Target("sglang", "SGLang's FP8 KV cache: scales 1.0 without checkpoint scales, or per-tensor checkpoint scales",
           ("sglang-fp8", "sglang-fp8-static", "fa3-bf16"), "engine"),
    Target("trtllm", "TensorRT-LLM's FP8 attention with ModelOpt's calibrated per-tensor scales",
           ("trtllm-fp8", "fa3-bf16"), "engine"),
]}


def target_names() -> tuple[str, ...]:
    return tuple(TARGETS) + ("any",)


def candidates(target: str, add=(), drop=()) -> list[tuple[str, Recipe]]:
    """(label, recipe) of ``target``'s set, with ``add`` specs appended and ``drop`` labels removed;
    recipes equal to an earlier one (another engine's name for the same arithmetic) are kept once."""
    require(target in target_names(), f"unknown --target {target!r}; choose one of {', '.join(target_names())}")
    names = [n for t in TARGETS.values() for n in t.candidates] if target == "any" else list(TARGETS[target].candidates)
    for spec in add or ():
        Recipe.from_str(spec)  # a bad spec fails here, naming the key
        names.append(spec)
    for name in drop or ():
        require(name in names, f"--drop {name!r} is not a candidate of --target {target}; candidates: "
                f"{', '.join(names)}")
        names = [n for n in names if n != name]
    require(names, f"--target {target} has no candidates left after --drop; --add a recipe (e.g. --add fa3-fp8-kernel)")
    out, seen = [], set()
    for label in dict.fromkeys(names):
        r = Recipe.from_str(label)
        if r.spec() in seen:
            continue
        seen.add(r.spec())
        out.append((label, r))
    return out


def mix_pool(target: str, labels: list[str], anchor: str) -> list[int]:
    """Indices of ``labels`` a per-layer mix may combine: every candidate for one target; for ``any``
    the candidates of the first target holding ``anchor`` (a mix must deploy on one kernel or engine),
    with candidates added by --add kept in."""
    if target != "any":
        return list(range(len(labels)))
    known = {n for t in TARGETS.values() for n in t.candidates}
    home = next((t for t in TARGETS.values() if anchor in t.candidates), None)
    keep = set(home.candidates) if home else known
    return [i for i, lab in enumerate(labels) if lab in keep or lab not in known]


def deploy_kind(target: str, recipe: Recipe) -> str:
    if target != "any":
        return TARGETS[target].deploy
    return "engine" if recipe.dscale != "amax" else "fa3" if recipe.gran.short_str() in ("head", "tensor") else "kernel"


# -- remedies ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Remedy:
    name: str
    statistic: str      # a per-layer statistic of ``recommend_stats.layer_stats``
    threshold: float
    remedy: str         # what to do, in the field's words
    why: str
    implements: Callable[[Recipe], bool]


REMEDIES: tuple[Remedy, ...] = (
    Remedy("smoothing", "k_mean_ratio", 1.0, "K smoothing (subtract a static per-kv-head K mean)",
           "a K channel mean shared by every token sets K's amax; subtracting it shifts each row of S by a constant",
           lambda r: r.smooth in ("k", "qk")),
    Remedy("hadamard", "incoherence_gain", 2.0, "a random Hadamard rotation of Q and K",
           "incoherent outliers: a few entries far above the rest of their token, spread by the rotation",
           lambda r: r.rot != "none"),
    Remedy("p-handling", "sink_or_underflow", 1.0, "a P offset that fills e4m3 or two-level P accumulation",
           "attention sinks concentrate P on a few keys, and most of P~ underflows in e4m3",
           lambda r: r.p_offset > 8.0 or r.acc == "two-level" or r.p in ("nvfp4", "mxfp8")),
    Remedy("per-channel-v", "v_hot_ratio", 4.0, "per-channel V scales (vgran=channel)",
           "a few V channels far above the others set V's per-head scale", lambda r: r.vgran == "channel"),
)


def remedy(name: str) -> Remedy:
    for r in REMEDIES:
        if r.name == name:
            return r
    raise UsageError(f"unknown remedy {name!r}")


def diagnose(stats: dict[str, float]) -> list[dict]:
    """Remedies ranked by statistic / threshold (largest first), each with its value and score."""
    rows = []
    for r in REMEDIES:
        val = float(stats[r.statistic])
        rows.append({"remedy": r.name, "statistic": r.statistic, "value": val, "threshold": r.threshold,
                     "score": val / r.threshold, "indicated": bool(val >= r.threshold), "what": r.remedy,
                     "why": r.why})
    return sorted(rows, key=lambda x: -x["score"] if x["score"] == x["score"] else 0.0)


def implements(name: str, recipe: Recipe) -> bool:
    return remedy(name).implements(recipe)


__all__ = ["FALLBACK", "Target", "TARGETS", "target_names", "candidates", "mix_pool", "deploy_kind", "Remedy", "REMEDIES",
           "diagnose",
           "implements", "remedy"]
