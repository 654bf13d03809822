"""Recommend: pick, explain and verify the attention recipe for a model and a deployment target.

Exposed: ``recommend``, ``RECOMMEND_FORMAT``, ``DEFAULT_TOKENS``, ``BUDGET_FACTOR``, ``BudgetNotMet``.

Steps (``impact`` and ``audit`` give the parts):

1. **Text.** Calibration text and held-out text: the two halves of ``2 x tokens`` tokens of the
   default text, or ``calib_text`` and ``text``. Scales and K means a target fixes
   (``dscale=static|calc``, ``kmean=static``: ``numerics/calibration.py``) are fitted on the
   calibration text's Q, K, V, recorded by a float64 reference pass; everything below runs on the
   held-out text.
2. **Reference and noise.** The model with float64 attention on the held-out text, and with its
   own BF16 SDPA: the budget defaults to ``BUDGET_FACTOR`` x BF16 SDPA's KL mean.
3. **Screen.** Every candidate of the target (``recommend_targets``), per layer, on the held-out
   Q, K, V the reference pass recorded: rel_l2 of its attention output against float64 (heads
   pooled by output energy, as ``impact``), and for calibrated recipes the entries that saturate.
4. **Predict.** One layer at a time (prefix reuse), the target's first candidate gives each
   layer's KL; the gain g_l = KL_l / rel_l2_l^2 then predicts any candidate's per-layer KL as
   g_l rel_l2^2 (``impact_dataset``'s gain model) and the model's as their sum.
5. **Verify.** Full end-to-end passes of the best predicted candidates and of the cheapest
   per-layer mix predicted to meet the budget (``impact_budget.search``, recalibrated after each
   run). Only measured results are recommended: the cheapest (summed ``recipe_cost``) that meets
   every budget, ties to the lower KL; none meeting it raises ``BudgetNotMet`` naming the closest.
6. **Diagnose.** Each layer where the first candidate alone costs more than its share of the
   budget (KL_l > budget / layers) gets the statistics of ``recommend_stats`` ranked by
   ``recommend_targets.diagnose``, and the measured rel_l2 of every candidate that implements
   the remedy in that layer.

Static scales and means make a step of decode compute what the prefill row computes (nothing
depends on other rows), so the one causal pass over the held-out text is also its teacher-forced
decode against the FP8 KV cache (``impact.decode_recipe`` gives the argument). Recipes with
dynamic descales are evaluated as prefill calls.

On a CPU with the emulator, recipes with the Hopper MMA accumulator model (``acc=fp22``, ~40x a
float32 GEMM there) run with ``acc=fp32`` (``impact.sweep_recipe``); the dataset says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..engine.study import Study
from ..errors import UsageError, require
from ..numerics import calibration as calib
from ..numerics.recipe import Recipe
from .stored import StoredFindings
from .impact_analysis import layer_rel_l2, summarize
from .impact_model import REF, SDPA_BF16, ModelRunner, cpu_threads, recipe_attn, score
from .recommend_targets import candidates as target_candidates
from .recommend_targets import FALLBACK, mix_pool

RECOMMEND_FORMAT = "fa3-numerics-recommend/1"
DEFAULT_TOKENS = 256
BUDGET_FACTOR = 10.0
DEFAULT_VERIFY = 3


class BudgetNotMet(UsageError):
    """No measured candidate meets the budget (exit 4); the dataset is still complete."""

    exit_code = 4

    def __init__(self, message: str, dataset=None, artifact=None):
        super().__init__(message)
        self.dataset, self.artifact = dataset, artifact


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Budget:
    kl: float | None
    ppl: float | None
    top1: float | None
    factor: float

    def resolve(self, bf16_kl: float) -> float:
        return self.kl if self.kl is not None else self.factor * bf16_kl

    def meets(self, m: dict, kl_budget: float) -> bool:
        ok = math.isfinite(m["kl_mean"]) and m["kl_mean"] <= kl_budget
        if self.ppl is not None:
            ok = ok and abs(m["ppl_delta"]) <= self.ppl
        if self.top1 is not None:
            ok = ok and m["top1_agree"] >= self.top1
        return bool(ok)

    def distance(self, m: dict, kl_budget: float) -> float:
        """How far a measured result is from the budget (1 = on it): the worst of its ratios."""
        r = [m["kl_mean"] / kl_budget if math.isfinite(m["kl_mean"]) else math.inf]
        if self.ppl is not None:
            r.append(abs(m["ppl_delta"]) / self.ppl)
        if self.top1 is not None:
            r.append((1 - m["top1_agree"]) / max(1e-12, 1 - self.top1))
        return max(r)


def _check_budget(kl, ppl, top1, factor) -> Budget:
    for name, val in (("--budget-kl", kl), ("--budget-ppl", ppl)):
        require(val is None or (math.isfinite(val) and val > 0), f"{name} must be a positive number, got {val}")
    require(top1 is None or (0 < top1 <= 1), f"--budget-top1 must lie in (0, 1] (a fraction, e.g. 0.99), got {top1}")
    require(math.isfinite(factor) and factor > 0, f"--budget-factor must be a positive number, got {factor}")
    return Budget(kl, ppl, top1, factor)


def resolve(recipe: Recipe, cid: str, layer: int) -> Recipe:
    """``recipe`` for one layer: its calibration named when it reads one."""
    if calib.uses_calibration(recipe):
        return dataclasses.replace(recipe, calib=calib.spec(cid, layer))
    return recipe


def recommend(*, model: str = "smollm2", text: str | Path | None = None, calib_text: str | Path | None = None,
              tokens: int = DEFAULT_TOKENS, target: str = "fa3", add=(), drop=(), budget_kl: float | None = None,
              budget_ppl: float | None = None, budget_top1: float | None = None, budget_factor: float = BUDGET_FACTOR,
              verify: int = DEFAULT_VERIFY, mix_runs: int = 2, backend: str = "emulate", device: str = "cpu",
              seed: int = 0, device_map: str | None = None, progress: Callable[[str], None] = _stderr):
    """Run the study (module docstring); returns (dataset, artifact dict). Raises ``BudgetNotMet``
    (carrying both) when no measured candidate meets the budget."""
    return run_prepared(prepare(model=model, text=text, calib_text=calib_text, tokens=tokens, target=target, add=add,
                                drop=drop, budget_kl=budget_kl, budget_ppl=budget_ppl, budget_top1=budget_top1,
                                budget_factor=budget_factor, verify=verify, mix_runs=mix_runs, backend=backend,
                                device=device, seed=seed, device_map=device_map), progress)


def prepare(*, model: str = "smollm2", text: str | Path | None = None, calib_text: str | Path | None = None,
            tokens: int = DEFAULT_TOKENS, target: str = "fa3", add=(), drop=(), budget_kl: float | None = None,
            budget_ppl: float | None = None, budget_top1: float | None = None, budget_factor: float = BUDGET_FACTOR,
            verify: int = DEFAULT_VERIFY, mix_runs: int = 2, backend: str = "emulate", device: str = "cpu",
            seed: int = 0, device_map: str | None = None) -> dict:
    """Every check that needs no model (exit 2 before anything loads); what ``run_prepared`` takes."""
    from ..data import capture as cap
    from .impact import _backend, sweep_recipe

    t_start = time.perf_counter()
    require(isinstance(tokens, int) and tokens >= 16, f"--tokens must be at least 16, got {tokens}; e.g. --tokens "
            f"{DEFAULT_TOKENS}")
    require(isinstance(verify, int) and verify >= 1, f"--verify must be >= 1 (full runs of uniform candidates), "
            f"got {verify}")
    require(isinstance(mix_runs, int) and mix_runs >= 0, f"--mix-runs must be >= 0, got {mix_runs}")
    require(device == "cpu" or device.startswith("cuda"), f"--device must be cpu or cuda, got {device!r}")
    budget = _check_budget(budget_kl, budget_ppl, budget_top1, budget_factor)
    cands = target_candidates(target, add, drop)
    run_recipes = [(lab, sweep_recipe(r, "auto", device, backend)) for lab, r in cands]
    be = _backend(backend, device, run_recipes)
    if calib_text is not None:
        require(text is not None, "--calib-text needs --text (the held-out text the choice is verified on)")
    src = cap.resolve_model(model)
    cap.require_capture_deps(gguf=src.gguf_file is not None)
    return {"model": model, "text": text, "calib_text": calib_text, "tokens": tokens, "target": target, "add": add, "drop": drop, "budget_kl": budget_kl, "budget_ppl": budget_ppl, "budget_top1": budget_top1, "budget_factor": budget_factor, "verify": verify, "mix_runs": mix_runs, "backend": backend, "device": device, "seed": seed, "t_start": t_start, "budget": budget, "cands": cands, "run_recipes": run_recipes, "be": be, "src": src, "device_map": device_map}


def run_prepared(prep: dict, progress: Callable[[str], None] = _stderr):
    """Load the model and run the study from ``prepare``'s checked options."""
    with cpu_threads(prep["device"], lambda m: progress(f"recommend: {m}")):
        return _run_prepared(prep, progress)


def _run_prepared(prep: dict, progress: Callable[[str], None]):
    from ..data import capture as cap

    text, calib_text, tokens, target = prep["text"], prep["calib_text"], prep["tokens"], prep["target"]
    verify, mix_runs, backend, device, seed = prep["verify"], prep["mix_runs"], prep["backend"], prep["device"], prep["seed"]
    t_start, budget, cands, run_recipes, be, src = (prep[k] for k in ("t_start", "budget", "cands", "run_recipes",
                                                                      "be", "src"))

    # -- model, texts -------------------------------------------------------------------------
    torch.set_float32_matmul_precision("highest")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    progress(f"recommend: loading {src.label}")
    m, tok, src = cap.load_model(src, log=progress, device=device, device_map=prep.get("device_map"))
    L = int(m.config.num_hidden_layers)
    if calib_text is None:
        body, source = cap.read_text(text) if text is not None else cap.default_text()
        cap.check_context(m, 2 * tokens)
        ids = cap.tokenize(tok, body, 2 * tokens, source)
        calib_ids, held_ids = ids[:, :tokens], ids[:, tokens:]
        texts = {"calibration": f"{source}, tokens 0-{tokens - 1}",
                 "held_out": f"{source}, tokens {tokens}-{2 * tokens - 1}"}
    else:
        cbody, csource = cap.read_text(calib_text)
        hbody, hsource = cap.read_text(text)
        cap.check_context(m, tokens)
        calib_ids = cap.tokenize(tok, cbody, tokens, csource)
        held_ids = cap.tokenize(tok, hbody, tokens, hsource)
        texts = {"calibration": f"{csource}, first {tokens} tokens", "held_out": f"{hsource}, first {tokens} tokens"}

    # -- calibration --------------------------------------------------------------------------
    t0 = time.perf_counter()
    crun = ModelRunner(m, calib_ids, backend=be, device=device, seed=seed)
    cref = crun.reference()
    rec = cref.record
    cid = calib.register(calib.Calibration({i: (rec.q[i].to(torch.float64), rec.k[i].to(torch.float64),
                                                rec.v[i].to(torch.float64)) for i in range(L)},
                                           source=texts["calibration"]))
    progress(f"calibration: {tokens} tokens, id {cid} ({time.perf_counter() - t0:.1f} s)")
    del crun, cref

    # -- held-out reference and BF16 noise ------------------------------------------------------
    runner = ModelRunner(m, held_ids, backend=be, device=device, seed=seed)
    ref = runner.reference()
    require(math.isfinite(ref.scale), "the layers use different softmax scales; recommend needs one")
    ref_ppl = float(np.exp(ref.nll[:-1].mean()))

    def measure(plan) -> dict:
        logits, bad_attn = runner.run(plan)
        res = score(ref, logits)
        s = {k: float(v) for k, v in summarize(res["kl"], res["nll"], res["top1"], ref_ppl).items()}
        s["nonfinite"] = int(res["nonfinite_logits"].sum()) + int(bad_attn.sum())
        return s

    bf16 = measure([SDPA_BF16] * L)
    kl_budget = budget.resolve(bf16["kl_mean"])
    require(math.isfinite(kl_budget) and kl_budget > 0, f"BF16 SDPA's KL on the held-out text is {bf16['kl_mean']:g}, "
            "so a relative budget is undefined; give --budget-kl")
    progress(f"held-out reference: ppl {ref_ppl:.4g}; BF16 SDPA KL mean {bf16['kl_mean']:.3g}; budget KL mean <= "
             f"{kl_budget:.3g}")

    # -- screen ---------------------------------------------------------------------------------
    from .recommend_screen import saturation, screen_layer
    from .recommend_stats import layer_stats

    n, H = int(held_ids.shape[1]), int(rec.q[0].shape[1])
    C = len(cands)
    rel = np.full((C, L, H), np.nan)
    sat = {t: np.zeros((C, L), dtype=np.int64) for t in ("q", "k", "v")}
    sat_head = {t: np.full((C, L), -1, dtype=np.int64) for t in ("q", "k", "v")}
    stats: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    hrec = ref.record
    for layer in range(L):
        q, k, v = (x[layer].to(torch.float64) for x in (hrec.q, hrec.k, hrec.v))
        rel[:, layer] = screen_layer(be, [resolve(r, cid, layer) for _, r in run_recipes], q, k, v,
                                     ref.attn[layer], scale=ref.scale, seed=seed, masking=hrec.options.get(layer))
        for ci, (_, r) in enumerate(run_recipes):
            counts = saturation(resolve(r, cid, layer), q, k, v, seed=seed)
            for t, c in counts.items():
                sat[t][ci, layer] = int(c.sum())
                sat_head[t][ci, layer] = int(c.argmax()) if c.sum() else -1
        for name, val in layer_stats(q, k, v, scale=ref.scale, seed=seed).items():
            stats.setdefault(name, np.full(L, np.nan))[layer] = val
    rms = np.stack([ref.attn[i][0].pow(2).mean(dim=(1, 2)).sqrt().cpu().numpy() for i in range(L)])   # (L, H)
    pooled = np.stack([layer_rel_l2(rel[c], rms) for c in range(C)])                                  # (C, L)
    progress(f"screen: {C} candidates x {L} layers ({time.perf_counter() - t0:.1f} s)")

    # -- gains: the first candidate one layer at a time ------------------------------------------
    t0 = time.perf_counter()
    lab0, r0 = run_recipes[0]
    layer_kl = np.full(L, np.nan)
    for layer in range(L):
        plan = [REF] * L
        plan[layer] = recipe_attn(lab0, resolve(r0, cid, layer))
        logits, _ = runner.run(plan, start=layer)
        layer_kl[layer] = float(np.mean(score(ref, logits)["kl"]))
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(pooled[0] > 0, layer_kl / pooled[0] ** 2, np.nan)
    gain = np.where(np.isfinite(gain), gain, np.nanmedian(gain) if np.isfinite(gain).any() else 0.0)
    pred_layer = gain[None, :] * pooled ** 2                                                          # (C, L)
    predicted = pred_layer.sum(axis=1)
    progress(f"gains: {L} one-layer passes of {lab0} ({time.perf_counter() - t0:.1f} s)")

    # -- verify -----------------------------------------------------------------------------------
    from .audit import recipe_cost
    from .impact_budget import assignment_label, search

    costs = [recipe_cost(r) for _, r in cands]
    order = sorted(range(C), key=lambda c: (predicted[c] if math.isfinite(predicted[c]) else math.inf, costs[c]))
    meeting = sorted((c for c in range(C) if predicted[c] <= kl_budget), key=lambda c: (costs[c], predicted[c]))
    # the targets' 16-bit fallback serves the per-layer mix; verified alone only when nothing else is left
    narrow = [c for c in order if cands[c][0] != FALLBACK] or order
    meeting = [c for c in meeting if c in narrow]
    pick = ([meeting[0]] if meeting else []) + [c for c in narrow if not meeting or c != meeting[0]]
    pick = pick[:verify]
    verified = []
    t0 = time.perf_counter()
    for c in pick:
        lab, r = run_recipes[c]
        got = measure([recipe_attn(lab, resolve(r, cid, i)) for i in range(L)])
        verified.append({"kind": "uniform", "label": cands[c][0], "choice": [c] * L, "cost": costs[c] * L,
                         "predicted": float(predicted[c]), **got})
        progress(f"verify {cands[c][0]}: KL mean {got['kl_mean']:.3g} (predicted {predicted[c]:.3g}), top-1 "
                 f"{100 * got['top1_agree']:.2f}%, dppl {got['ppl_delta']:+.4f}")
    mix_attempts = []
    # a mix deploys on one target: for --target any, that of the best verified candidate
    pool = mix_pool(target, [lab for lab, _ in cands], min(verified, key=lambda v: v["kl_mean"])["label"]) \
        if verified else list(range(C))
    if mix_runs and len(pool) > 1:
        def run_mix(sub):
            choice = tuple(pool[c] for c in sub)
            same = next((v for v in verified if v["choice"] == list(choice)), None)
            if same is not None:  # a uniform candidate already measured: no second pass
                return same["kl_mean"]
            got = measure([recipe_attn(run_recipes[c][0], resolve(run_recipes[c][1], cid, i))
                           for i, c in enumerate(choice)])
            labels = [cands[c][0] for c in choice]
            uniform = len(set(choice)) == 1
            verified.append({"kind": "uniform" if uniform else "mix",
                             "label": labels[0] if uniform else assignment_label(labels), "choice": list(choice),
                             "cost": int(sum(costs[c] for c in choice)), "predicted": float(sum(
                                 pred_layer[c, i] for i, c in enumerate(choice))), **got})
            progress(f"verify mix {verified[-1]['label']}: KL mean {got['kl_mean']:.3g}")
            return got["kl_mean"]

        mix_attempts = search(pred_layer[pool], [costs[c] for c in pool], kl_budget, run_mix, max_runs=mix_runs)
        for a in mix_attempts:
            a["choice"] = [pool[c] for c in a["choice"]]
    progress(f"verify: {len(verified)} full passes ({time.perf_counter() - t0:.1f} s)")
    for v in verified:
        v["meets"] = budget.meets(v, kl_budget)
        v["bf16_multiple"] = v["kl_mean"] / bf16["kl_mean"] if bf16["kl_mean"] > 0 else math.inf

    from .recommend_dataset import assemble

    info = {"model": src, "model_sha256": cap.model_sha256(src), "target": target, "cands": cands,
            "run_recipes": run_recipes, "cid": cid, "texts": texts, "tokens": tokens, "num_layers": L,
            "heads": H, "kv_heads": int(rec.k[0].shape[1]), "head_dim": int(rec.q[0].shape[-1]), "ref_ppl": ref_ppl,
            "bf16": bf16, "budget": budget, "kl_budget": kl_budget, "rel": rel, "pooled": pooled, "sat": sat,
            "sat_head": sat_head, "stats": stats, "layer_kl": layer_kl, "gain": gain, "predicted": predicted,
            "pred_layer": pred_layer, "costs": costs, "verified": verified, "mix_attempts": mix_attempts,
            "backend": backend, "device": device, "seed": seed, "calib_ids": calib_ids, "held_ids": held_ids,
            "scale": ref.scale, "seconds": time.perf_counter() - t_start}
    ds, artifact = assemble(info)
    if artifact["choice"] is None:
        closest = artifact["closest"]
        raise BudgetNotMet(f"no verified candidate meets the budget (KL mean <= {kl_budget:.3g}"
                           + (f", |dppl| <= {budget.ppl:g}" if budget.ppl is not None else "")
                           + (f", top-1 >= {budget.top1:g}" if budget.top1 is not None else "")
                           + f"); closest: {closest['label']} (KL mean {closest['kl_mean']:.3g}, top-1 "
                           f"{100 * closest['top1_agree']:.2f}%); loosen the budget or --add a recipe",
                           dataset=ds, artifact=artifact)
    return ds, artifact


class RecommendStudy(StoredFindings, Study):
    """``fa3-numerics recommend`` on the ``engine.study`` protocol: checked when made (before the
    model loads), the folder held while it runs, ``recommend.json`` beside the dataset, exit 4
    when no verified candidate meets the budget (every file still written)."""

    kind = "recommend"
    stem = "recommend"

    def __init__(self, progress: Callable[[str], None] = _stderr, **options):
        self.prep = prepare(**options)
        self.progress = progress

    def describe(self) -> str:
        p = self.prep
        return (f"recommend: {p['src'].label} on target {p['target']}, {len(p['cands'])} candidate(s), backend "
                f"{p['backend']} on {p['device']}")

    def run(self, ctx):
        try:
            return run_prepared(self.prep, self.progress) + ("",)
        except BudgetNotMet as exc:
            return exc.dataset, exc.artifact, str(exc)

    def assemble(self, results):
        ds, artifact, message = results
        ds.attrs["artifact"] = json.dumps(artifact, default=str)
        ds.attrs["budget_not_met"] = message
        return ds

    def nonfinite(self, ds) -> list:
        bad = int(ds.attrs.get("nonfinite_total", 0))
        return [f"{bad} non-finite values (see the report)"] if bad else []

    def extra_files(self, ds, path) -> list:
        from ..engine.files import atomic_write

        artifact = json.loads(ds.attrs["artifact"])
        return [atomic_write(path / "recommend.json", json.dumps(artifact, indent=1, default=str) + "\n")]

    def failure(self, ds) -> tuple[int, str] | None:
        message = ds.attrs.get("budget_not_met", "")
        return (BudgetNotMet.exit_code, message) if message else None


__all__ = ["recommend", "prepare", "run_prepared", "RecommendStudy", "RECOMMEND_FORMAT", "DEFAULT_TOKENS", "BUDGET_FACTOR", "BudgetNotMet", "resolve"]
