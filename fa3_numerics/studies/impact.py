"""Impact on the model: what an attention recipe does to a real model's next-token predictions.

Exposed: ``DEFAULT_VARIANTS``, ``DECODE_MODES``, ``BUDGET_STATS``, ``IMPACT_FORMAT``, ``impact``.

``impact(...)`` loads a causal LM (as ``capture`` does), takes the first ``tokens`` tokens of a
text and runs the model many times, each pass with every attention layer following a rule
(``fa3_numerics.studies.impact_model``). The reference is the model with float64 attention in
every layer. Every other pass is scored against it token by token: KL(reference || pass) of the
next-token distribution, the NLL of the text's next token, and top-1 agreement. The passes:

- ``none``: no layer uses a recipe (a control: its KL is exactly 0);
- per recipe, ``all``: every layer runs the recipe (prefill: every query row at once);
- per recipe and per layer L of ``layers``: only L runs it (the sensitivity sweep; each pass
  starts at L from the reference's hidden states, which the study checks to be bit-identical to
  a full pass, ``check_prefix``). With ``sweep_acc`` "auto" on a CPU, recipes with the Hopper MMA
  accumulator model (``acc=fp22``, ~40x a float32 GEMM there) run the sweep and its audit with
  ``acc=fp32`` instead; the study reruns the check layers with the recipe as given and records
  how much the per-layer KL moves (``sweep_recipe``);
- the model's own SDPA in float32 and BF16 (``baselines``);
- decode (``decode``): one query row per step against a KV cache of all earlier tokens in FP8
  with per-token (``token``), per-head (``head``) or per-tensor (``tensor``) scales. See
  ``decode_recipe`` for what is modelled and why one causal pass computes it exactly;
- per ``--recipe-map``: that per-layer assignment in every layer;
- with ``budget_kl``: the cheapest assignment whose measured KL meets the budget
  (``fa3_numerics.studies.impact_budget.search``), each candidate a full pass.

The audit (``fa3_numerics.studies.audit``) runs on the Q, K, V the reference pass recorded, which
are exactly what the sweep's layer-L pass feeds the recipe; its per-layer rel_l2 is correlated
with the per-layer KL (Spearman) and checked against the rel_l2 the sweep measured in passing.

Every pass is cached in ``out/.cells`` as it finishes (``engine.cache.CellStore``, through the ``engine.study`` protocol): a rerun resumes. The
dataset is assembled by ``fa3_numerics.studies.impact_dataset``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..engine.study import Study, StudyContext
from ..errors import UsageError, require
from ..numerics.granularity import PerHead, PerTensor, PerToken
from ..numerics.recipe import Recipe, parse_recipes
from .stored import StoredFindings
from .impact_model import REF, SDPA_BF16, SDPA_FP32, Attn, ModelRunner, recipe_attn, score

DEFAULT_VARIANTS = ("exact", "fa3-fp16", "baseline-fp8", "fa3-fp8", "fa3-fp8-kernel", "fa3-fp8-kernel-hadamard")
DECODE_MODES = {"token": PerToken(), "head": PerHead(), "tensor": PerTensor()}
DEFAULT_DECODE = ("head", "token")
BUDGET_STATS = ("mean", "p99", "max")
IMPACT_FORMAT = "fa3-numerics-impact/1"
DEFAULT_TOKENS = 512
SWEEP_ACC = ("auto", "given", "fp32")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def decode_recipe(recipe: Recipe, mode: str) -> Recipe | None:
    """The recipe a decode step runs with a KV cache scaled per ``mode``; None where decode does not apply.

    What is modelled: step t computes one query row against the cached K, V of tokens 0..t,
    stored in FP8 (the recipe's formats) with their scales, and all other arithmetic (rotation,
    P handling, accumulator, tiles, KV tiles from the last to the first) as the recipe says.

    - ``token``: each token's K and V (per KV head) carry their own scale, set when the token is
      written; Q gets its own per-token scale too, because a decode step has one query row and a
      dynamic scale computed from it is per token (and per KV-head group: the shape of the
      kernel's q_descale).
    - ``head`` / ``tensor``: static scales, one per (KV) head or per tensor for Q, K and V alike,
      calibrated once, as vLLM's FP8 KV cache with FA3 does (q/k/v scales per tensor or per
      attention head, from calibration). Here the calibration set is the text itself (amax over
      its tokens), which is optimistic: no token exceeds its scale.

    Why one causal pass is exact: with these scales no query row's arithmetic depends on another
    row or on later tokens (per-token scales depend on their own token, static scales on nothing
    that changes), and the causal mask with KV tiles counted from token 0 gives row t exactly the
    tiles a one-row call over t+1 keys visits. So the causal pass computes, row for row, the N
    decode steps of a teacher-forced generation of the text (the tests check this against one-row
    calls). Not applicable: recipes whose Q/K are not FP8 (no FP8 KV cache), and recipes that scale
    P per tensor (``pscale=tensor``: that scale spans all rows, which a decode step never sees).
    """
    if not recipe.fp8 or recipe.p_scale == "tensor":
        return None
    return dataclasses.replace(recipe, gran=DECODE_MODES[mode])


def sweep_recipe(recipe: Recipe, sweep_acc: str, device: str, backend: str) -> Recipe:
    """The recipe the per-layer sweep runs: ``acc=fp22`` becomes ``acc=fp32`` under "fp32", and under
    "auto" on a CPU with the emulator (where the Hopper MMA model costs ~40x a float32 GEMM; the
    README measures the two within ~0.1% in RMSE). Full passes always run the recipe as given."""
    swap = sweep_acc == "fp32" or (sweep_acc == "auto" and device == "cpu" and backend == "emulate")
    return dataclasses.replace(recipe, acc="fp32") if swap and recipe.acc == "fp22" else recipe


@dataclasses.dataclass
class Cell:
    """One model pass: where its result goes, its plan, where it starts, what it reports."""

    group: str               # "none", "full", "layer", "base", "decode", "map", "budget", "check"
    index: tuple
    plan: list[Attn]
    start: int = 0
    keep: int | None = None  # layer whose attention output is compared with the reference's
    what: str = ""

    def weight(self, num_layers: int) -> float:
        # LM head + scoring cost about a third of a full pass; layers before ``start`` are free.
        return 0.35 + (num_layers - self.start) / num_layers


def _backend(name: str, device: str, recipes: list[tuple[str, Recipe]]):
    from ..engine.backends import get_backend

    be = get_backend(name)
    why = be.check(device)
    require(why is None, f"backend {name!r} cannot run on {device}: {why}")
    for label, r in recipes:
        why = be.supports(r)
        require(why is None, f"variant {label!r} cannot run on backend {name!r}: {why}")
    params = inspect.signature(be.attention).parameters
    takes = "softmax_scale" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    require(takes, f"backend {name!r} takes no softmax scale; update fa3-numerics (its attention() needs softmax_scale=)")
    return be


def _parse_decode(decode) -> list[str]:
    if decode is None:
        return []
    items = [d.strip().lower() for d in (decode.split(",") if isinstance(decode, str) else decode) if d.strip()]
    if items in (["none"], []):
        return []
    bad = [d for d in items if d not in DECODE_MODES]
    if bad:
        raise UsageError(f"--decode {','.join(items)}: unknown KV-cache scaling {bad[0]!r}; use token, head, tensor "
                         "(comma-separated) or none")
    require(len(set(items)) == len(items), f"--decode repeats a mode: {','.join(items)}")
    return items


STUDY_MODULES = ("fa3_numerics.studies.impact", "fa3_numerics.studies.impact_model",
                 "fa3_numerics.studies.impact_budget")


class ImpactStudy(StoredFindings, Study):
    """The study (module docstring) on the ``engine.study`` protocol: every input is checked when
    it is made, before the folder is touched or the model loads; ``run`` loads the model and
    computes the passes (each cached in OUT/.cells as it finishes); ``assemble`` builds the dataset."""

    kind = "impact"
    stem = "impact"

    def __init__(self, *, model: str = "smollm2", text: str | Path | None = None, tokens: int = DEFAULT_TOKENS,
                 variants: str | list[str] | None = None, backend: str = "emulate", device: str = "cpu",
                 layers: str | list[int] | None = None, sweep: bool = True, recipe_maps=(),
                 budget_kl: float | None = None, budget_stat: str = "mean", budget_runs: int = 4,
                 decode=DEFAULT_DECODE, baselines: bool = True, audit: bool = True, check_prefix: int = 2,
                 sweep_acc: str = "auto", seed: int = 0, device_map: str | None = None,
                 progress: Callable[[str], None] = _stderr):
        from ..data import capture as cap
        from ..engine.sampling import check_seed
        from .impact_budget import check_map_layers, parse_recipe_map

        self.t_start = time.perf_counter()
        require(isinstance(tokens, int) and tokens >= 2, f"--tokens must be at least 2 (one next token to "
                f"predict), got {tokens}; e.g. --tokens {DEFAULT_TOKENS}")
        require(device == "cpu" or device.startswith("cuda"), f"--device must be cpu or cuda, got {device!r}")
        require(budget_stat in BUDGET_STATS, f"--budget-stat must be one of {', '.join(BUDGET_STATS)}, got "
                f"{budget_stat!r}")
        if budget_kl is not None:
            require(math.isfinite(budget_kl) and budget_kl > 0, f"--budget-kl must be a positive number, got "
                    f"{budget_kl}")
            require(sweep, "--budget-kl needs the per-layer sweep; drop --no-sweep")
        require(sweep or layers is None, "--layers picks the sweep's layers; drop --no-sweep or --layers")
        require(sweep_acc in SWEEP_ACC, f"--sweep-acc must be one of {', '.join(SWEEP_ACC)}, got {sweep_acc!r}")
        require(isinstance(check_prefix, int) and check_prefix >= 0, f"--check-prefix must be >= 0, got "
                f"{check_prefix}")
        require(isinstance(budget_runs, int) and budget_runs >= 1, f"--budget-runs must be >= 1, got {budget_runs}")
        recipes = parse_recipes(variants if isinstance(variants, str) else ";".join(variants or DEFAULT_VARIANTS))
        modes = _parse_decode(decode)
        maps = [(m, parse_recipe_map(m)) for m in (recipe_maps or ())]
        layer_spec = layers if isinstance(layers, (str, type(None))) else ",".join(map(str, layers))
        cap.parse_layers(layer_spec)  # syntax now, range once the model is known
        dec = [(lab, mode, decode_recipe(r, mode)) for lab, r in recipes for mode in modes]
        dec = [(lab, mode, r) for lab, mode, r in dec if r is not None]
        swept = [(lab, sweep_recipe(r, sweep_acc, device, backend)) for lab, r in recipes]
        specs = [r.spec() for _, r in swept]
        if len(set(specs)) != len(specs):
            raise UsageError("--sweep-acc fp32 makes two variants identical in the sweep (they differ only in acc); "
                             "pass --sweep-acc given")
        every = recipes + swept + [(f"{lab} [decode {mode}]", r) for lab, mode, r in dec] + \
            [(lab, r) for _, parsed in maps for lab, r, _ in parsed]
        self.be = _backend(backend, device, every)
        self.src_text, self.text_source = cap.read_text(text) if text is not None else cap.default_text()
        self.src = cap.resolve_model(model)
        cap.require_capture_deps(gguf=self.src.gguf_file is not None)
        check_seed(seed, "--seed")
        num_layers, _ = cap.preflight(self.src, layer_spec, tokens, self.src_text, self.text_source)  # no weights
        for name, parsed in maps:
            check_map_layers(name, parsed, num_layers)
        if device_map is not None:
            from ..data.placement import parse_device_map

            parse_device_map(device_map, num_layers)  # syntax, layer range and GPUs, before the folder is held
        self.text, self.tokens, self.backend, self.device, self.seed = text, tokens, backend, device, seed
        self.recipes, self.modes, self.maps, self.layer_spec, self.dec, self.swept = \
            recipes, modes, maps, layer_spec, dec, swept
        self.sweep, self.budget_kl, self.budget_stat, self.budget_runs = sweep, budget_kl, budget_stat, budget_runs
        self.baselines, self.audit, self.check_prefix, self.sweep_acc = baselines, audit, check_prefix, sweep_acc
        self.progress = progress
        self.device_map = device_map

    def describe(self) -> str:
        return (f"impact: {self.src.label}, {self.tokens} tokens, {len(self.recipes)} variant(s), backend "
                f"{self.backend} on {self.device}")

    def run(self, ctx: StudyContext | None):
        """Load the model, take the reference pass and every cell (cached under ``ctx``: None keeps none)."""
        from .impact_model import cpu_threads

        with cpu_threads(self.device, lambda m: self.progress(f"impact: {m}")):
            return self._run(ctx)

    def _run(self, ctx: StudyContext | None):
        from ..data import capture as cap
        from ..engine.cache import study_cells
        from .impact_budget import check_map_layers

        progress, device, backend, seed, tokens = self.progress, self.device, self.backend, self.seed, self.tokens
        src, recipes = self.src, self.recipes
        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = False  # the model's float32 matmuls stay float32
            torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        progress(f"impact: loading {src.label} (float32, {device})")
        t0 = time.perf_counter()
        m, tok, src = cap.load_model(src, log=progress, device=device, device_map=self.device_map)
        t_load = time.perf_counter() - t0
        num_layers = int(m.config.num_hidden_layers)
        cap.check_context(m, tokens)
        sweep_layers = cap.parse_layers(self.layer_spec, num_layers) if self.sweep else []
        map_layers = [(name, check_map_layers(name, parsed, num_layers)) for name, parsed in self.maps]
        input_ids = cap.tokenize(tok, self.src_text, tokens, self.text_source)
        budget_recipes = [(lab, r) for lab, r in recipes if r.qk != "fp32"]  # FP32 attention is no deployment option
        if self.budget_kl is not None:
            require(sweep_layers == list(range(num_layers)), "--budget-kl needs every layer in the sweep; drop "
                    "--layers")
            require(budget_recipes, "--budget-kl needs at least one variant that is not FP32 attention")

        context = {"model_sha256": cap.model_sha256(src), "token_ids_sha256": cap.token_ids_sha256(input_ids),
                   "backend": backend, "device": device.split(":")[0], "seed": seed,
                   "torch_threads": torch.get_num_threads() if device == "cpu" else None,
                   "torch": torch.__version__, "transformers": __import__("transformers").__version__}
        store = study_cells(ctx.out if ctx is not None else None, context, STUDY_MODULES, warn=progress,
                            backend=backend, device=device, inputs=[self.text] if self.text is not None else [])
        runner = ModelRunner(m, input_ids, backend=self.be, device=device, seed=seed)
        progress(f"reference pass: {num_layers} layers of float64 attention over {tokens} tokens")
        t0 = time.perf_counter()
        ref = runner.reference()
        t_ref = time.perf_counter() - t0
        require(math.isfinite(ref.scale), "the layers use different softmax scales; impact needs one")
        ref_ppl = float(np.exp(ref.nll[:-1].mean()))
        progress(f"reference: ppl {ref_ppl:.4g}, {t_ref:.1f} s")

        cells = _plan_cells(recipes, self.swept, self.dec, map_layers, sweep_layers, self.baselines,
                            self.check_prefix, num_layers)
        results = _Executor(runner, ref, store, cells, num_layers, progress).run_all()

        audit_ds = None
        if self.audit and sweep_layers:
            audit_ds = _run_audit(runner, ref, m, src, input_ids, self.src_text, self.text_source, self.swept,
                                  sweep_layers, backend, device, seed, progress)
        budget = None
        if self.budget_kl is not None:
            budget = _budget(runner, ref, store, recipes, budget_recipes, results, num_layers, self.budget_kl,
                             self.budget_stat, self.budget_runs, progress)
        info = {"model": src, "model_sha256": context["model_sha256"], "text": self.src_text,
                "text_source": self.text_source, "input_ids": input_ids, "tokenizer": tok, "backend": backend,
                "device": device, "seed": seed, "sweep_layers": sweep_layers, "modes": self.modes,
                "num_layers": num_layers, "ref_ppl": ref_ppl,
                "times": {"load": t_load, "reference": t_ref, "total": time.perf_counter() - self.t_start},
                "check_prefix": self.check_prefix, "code": store.context["code"], "config": m.config,
                "architecture": ",".join(getattr(m.config, "architectures", None) or [type(m).__name__])}
        info["sweep_acc"] = self.sweep_acc
        if self.device_map is not None:  # where each layer ran (results equal the one-device run's)
            from ..data.placement import devices_of

            info["device_map"] = {"spec": self.device_map, "layers": devices_of(m)}
        return info, ref, recipes, self.dec, map_layers, results, audit_ds, budget, self.swept

    def assemble(self, results):
        from .impact_dataset import assemble

        return assemble(*results)

    def nonfinite(self, ds) -> list:
        bad = int(ds.attrs.get("nonfinite_total", 0))
        return [f"{bad} non-finite values (see the report's first section and attrs['nonfinite_where'])"] if bad else []


def impact(*, out: str | Path | None = None, **options):
    """Run the study (module docstring) from Python and return its xarray Dataset. With ``out``,
    through ``engine.study.run_study``: the folder held, finished passes kept in OUT/.cells
    (a rerun resumes), OUT/impact.nc written (no report: ``fa3-numerics report`` renders it)."""
    study = ImpactStudy(**options)
    if out is None:
        return study.assemble(study.run(None))
    from ..engine.study import run_study

    return run_study(study, out, echo=study.progress).dataset


def _plan_cells(recipes, swept, dec, map_layers, sweep_layers, baselines, check_prefix, num_layers) -> list[Cell]:
    """Every pass of the study, cheapest-to-explain first: controls, full runs, then the sweep."""
    cells = [Cell("none", (), [REF] * num_layers, what="control: no layer uses a recipe")]
    for vi, (lab, r) in enumerate(recipes):
        cells.append(Cell("full", (vi,), [recipe_attn(lab, r)] * num_layers, what=f"{lab}, every layer"))
    if baselines:
        for bi, rule in enumerate((SDPA_FP32, SDPA_BF16)):
            cells.append(Cell("base", (bi,), [rule] * num_layers, what=f"{rule.label}, every layer"))
    for di, (lab, mode, r) in enumerate(dec):
        cells.append(Cell("decode", (di,), [recipe_attn(lab, r)] * num_layers, what=f"{lab} decode, KV {mode}"))
    for mi, (name, per) in enumerate(map_layers):
        cells.append(Cell("map", (mi,), [recipe_attn(lab, r) for lab, r in per], what=f"map {name}"))
    for li, layer in enumerate(sweep_layers):
        for vi, (lab, r) in enumerate(swept):
            tag = "" if r == recipes[vi][1] else f" (sweep: acc={r.acc})"
            plan = [REF] * num_layers
            plan[layer] = recipe_attn(lab, r)
            cells.append(Cell("layer", (vi, li), plan, start=layer, keep=layer, what=f"layer {layer} only, {lab}{tag}"))
    # Prefix reuse checked on full passes (start 0) of a few sweep layers spread over the depth; a
    # layer-0 pass starts at 0 anyway, so it checks nothing. The same layers rerun every recipe
    # whose sweep changed its accumulator, as given, to measure what the substitution moves.
    pool = [layer for layer in sweep_layers if layer > 0]
    if pool and check_prefix:
        pick = [pool[i] for i in np.unique(np.round(np.linspace(0, len(pool) - 1, min(check_prefix, len(pool))))
                                           .astype(int))]
        vi = next((i for i, (_, r) in enumerate(recipes) if r.fp8), 0)  # one that perturbs the model
        for layer in pick:
            plan = [REF] * num_layers
            plan[layer] = recipe_attn(swept[vi][0], swept[vi][1])
            cells.append(Cell("check", (layer, vi), plan, start=0, what=f"layer {layer} only, {swept[vi][0]}, full "
                                                                        "pass (prefix-reuse check)"))
        for layer in pick:
            for vi, (lab, r) in enumerate(recipes):
                if r != swept[vi][1]:
                    plan = [REF] * num_layers
                    plan[layer] = recipe_attn(lab, r)
                    cells.append(Cell("acc", (layer, vi), plan, start=layer, what=f"layer {layer} only, {lab} as "
                                                                                    f"given (acc={r.acc})"))
    return cells


class _Executor:
    """Runs cells in order with the cache and progress lines; results by (group, index)."""

    def __init__(self, runner: ModelRunner, ref, store, cells: list[Cell], num_layers: int, progress):
        self.runner, self.ref, self.store, self.cells = runner, ref, store, cells
        self.num_layers, self.progress = num_layers, progress
        self.results: dict[tuple, dict] = {}

    def key(self, cell: Cell) -> str:
        return self.store.key({"plan": [a.key() for a in cell.plan], "start": cell.start, "keep": cell.keep})

    def compute(self, cell: Cell) -> dict:
        logits, bad_attn = self.runner.run(cell.plan, start=cell.start,
                                           keep=() if cell.keep is None else (cell.keep,))
        res = score(self.ref, logits)
        res["nonfinite_attn"] = bad_attn
        if cell.keep is not None:
            res["attn_rel_l2"] = self.runner.layer_rel_l2(cell.keep)
        return res

    def run_one(self, cell: Cell) -> tuple[dict, bool]:
        key = self.key(cell)
        got = self.store.get(key)
        if got is not None:
            return got, True
        t0 = time.perf_counter()
        res = self.compute(cell)
        res["seconds"] = np.float64(time.perf_counter() - t0)
        self.store.put(key, res)
        return res, False

    def run_all(self) -> dict:
        n = len(self.cells)
        total_w = sum(c.weight(self.num_layers) for c in self.cells)
        done_w = spent_w = spent_s = 0.0
        cached = 0
        t0 = time.perf_counter()
        for i, cell in enumerate(self.cells, 1):
            tc = time.perf_counter()
            res, hit = self.run_one(cell)
            dt = time.perf_counter() - tc
            w = cell.weight(self.num_layers)
            done_w += w
            if hit:
                cached += 1
            else:
                spent_w, spent_s = spent_w + w, spent_s + dt
            self.results[(cell.group,) + cell.index] = res
            left = (total_w - done_w) * (spent_s / spent_w) if spent_w else 0.0
            bad = int(res["nonfinite_logits"].sum()) + int(res["nonfinite_attn"].sum())
            self.progress(
                f"[{i:4d}/{n}] {cell.what}: KL mean {float(np.mean(res['kl'])):.3g}, top-1 "
                f"{100 * float(np.mean(res['top1'])):.1f}%" + (f", {bad} NON-FINITE" if bad else "")
                + (" (cached)" if hit else f" ({dt:.1f} s)")
                + f"; {time.perf_counter() - t0:.0f} s elapsed, ~{left:.0f} s left"
                + (f", {cached} cached" if cached else ""))
        return self.results


def _run_audit(runner, ref, m, src, input_ids, text, text_source, recipes, layers, backend, device, seed, progress):
    """The audit of the Q, K, V the reference pass recorded (what the sweep's layer-L passes see)."""
    from ..data.capture import capture_from_record
    from .audit import audit

    capt = capture_from_record(ref.record, m, src, input_ids, text, text_source, list(range(runner.num_layers)),
                               attn_note="records, then float64 reference attention: impact's reference pass")
    progress(f"audit of the reference pass's Q, K, V: {len(layers)} layers, every query row")
    # Specs, not labels: the sweep may run a recipe with another accumulator than its label's preset.
    return audit(capt, variants=";".join(r.short_str() for _, r in recipes), backend=backend, rows=0, layers=layers,
                 seed=seed, device=device, progress=progress)


def _budget(runner, ref, store, recipes, budget_recipes, results, num_layers, budget_kl, stat, runs, progress):
    """The cheapest assignment whose measured KL statistic meets ``budget_kl`` (impact_budget.search)."""
    from .audit import recipe_cost
    from .impact_budget import assignment_label, search

    idx = [i for i, (lab, _) in enumerate(recipes) if any(lab == b for b, _ in budget_recipes)]
    fn = {"mean": np.mean, "p99": lambda a: np.percentile(a, 99), "max": np.max}[stat]
    per_layer = np.array([[fn(results[("layer", vi, li)]["kl"]) for li in range(num_layers)] for vi in idx])
    costs = [recipe_cost(recipes[vi][1]) for vi in idx]
    ex = _Executor(runner, ref, store, [], num_layers, progress)
    found: list[dict] = []

    def measure(choice):
        labels = [recipes[idx[c]][0] for c in choice]
        cell = Cell("budget", (len(found),), [recipe_attn(recipes[idx[c]][0], recipes[idx[c]][1]) for c in choice],
                    what=f"budget candidate {assignment_label(labels)}")
        res, hit = ex.run_one(cell)
        found.append({"labels": labels, "result": res})
        val = float(fn(res["kl"]))
        progress(f"budget KL {stat} <= {budget_kl:g}: {cell.what} (cost {sum(costs[c] for c in choice)}) measures "
                 f"{val:.3g}" + (" (cached)" if hit else ""))
        return val

    attempts = search(per_layer, costs, budget_kl, measure, max_runs=runs)
    for a, f in zip(attempts, found):
        a.update(labels=f["labels"], result=f["result"], label=assignment_label(f["labels"]))
    uniform = []
    for j, vi in enumerate(idx):
        val = float(fn(results[("full", vi)]["kl"]))
        uniform.append({"label": recipes[vi][0], "cost": costs[j] * num_layers, "measured": val,
                        "meets": bool(val <= budget_kl)})
    passing = [("assignment", a) for a in attempts if a["meets"]] + [("uniform", u) for u in uniform if u["meets"]]
    best = min(passing, key=lambda p: (p[1]["cost"], p[1]["measured"]), default=None)
    return {"budget": budget_kl, "stat": stat, "attempts": attempts, "uniform": uniform,
            "candidates": [recipes[vi][0] for vi in idx], "costs": costs,
            "best": None if best is None else {"kind": best[0], **{k: v for k, v in best[1].items() if k != "result"}}}


__all__ = ["DEFAULT_VARIANTS", "DECODE_MODES", "DEFAULT_DECODE", "BUDGET_STATS", "IMPACT_FORMAT", "impact",
           "decode_recipe"]
