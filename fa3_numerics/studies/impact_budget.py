"""Per-layer recipe assignments: the ``--recipe-map`` syntax, and the cheapest assignment that
meets a KL budget, found on the measured per-layer sensitivities and verified by full runs.

Exposed: ``Assignment``, ``parse_recipe_map``, ``check_map_layers``, ``assignment_label``,
``cheapest_under``, ``search``.

A map is ``LAYERS:RECIPE`` parts joined by ``;``: ``0-1:fa3-fp16;*:fa3-fp8``. LAYERS is a layer
list as in ``--layers`` (``0,3``, ``4-7``) or ``*`` for every layer no other part names;
RECIPE is a preset name or a recipe spec (``fa3-fp8,acc=fp32``). Every layer must get exactly
one recipe.

The budget search (``search``) predicts the end-to-end KL of an assignment as the sum over
layers of the KL measured when that layer alone runs its recipe (``impact``'s per-layer
sweep). Under that additive model the cheapest assignment (costs from
``fa3_numerics.studies.audit.recipe_cost``, summed over layers) is an exact multiple-choice
knapsack, solved by dynamic programming over the integer total cost. The prediction is only a
guide: each candidate is run in full and its *measured* KL decides. After each run the
prediction is recalibrated by measured / predicted and the knapsack solved again (a failing
candidate tightens the target, a passing one may allow a cheaper candidate), for at most
``max_runs`` full runs. The result is the cheapest candidate whose measured KL meets the budget.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from ..errors import UsageError, require
from ..numerics.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One recipe per layer (labels and recipes), where it came from, and its summed cost."""

    label: str
    labels: tuple[str, ...]
    recipes: tuple[Recipe, ...]
    source: str
    cost: int = 0


def _parts(text: str) -> list[tuple[str, str]]:
    example = "write LAYERS:RECIPE parts joined by ';', e.g. '0-1:fa3-fp16;*:fa3-fp8'"
    parts = [p.strip() for p in str(text).split(";") if p.strip()]
    require(parts, f"--recipe-map {text!r} is empty; {example}")
    out = []
    for part in parts:
        require(":" in part, f"--recipe-map part {part!r} has no ':'; {example}")
        layers, recipe = (s.strip() for s in part.split(":", 1))
        require(layers and recipe, f"--recipe-map part {part!r} lacks its layers or its recipe; {example}")
        out.append((layers, recipe))
    return out


def parse_recipe_map(text: str, num_layers: int | None = None) -> list[tuple[str, Recipe, list[int] | None]]:
    """[(recipe label, recipe, layers or None for '*')] in the order written; syntax and recipes are
    checked here, layer ranges and coverage too when ``num_layers`` is given."""
    from ..data.capture import parse_layers

    parsed = []
    stars = 0
    for layers, label in _parts(text):
        try:
            recipe = Recipe.from_str(label)
        except UsageError as exc:
            raise UsageError(f"--recipe-map part {layers}:{label}: {exc}") from None
        if layers == "*":
            stars += 1
            parsed.append((label, recipe, None))
        else:
            parsed.append((label, recipe, parse_layers(layers)))
    require(stars <= 1, f"--recipe-map {text!r} uses '*' {stars} times; one '*' covers every layer not named")
    if num_layers is not None:
        check_map_layers(text, parsed, num_layers)
    return parsed


def check_map_layers(text: str, parsed, num_layers: int) -> list[tuple[str, Recipe]]:
    """Per layer (label, recipe) of a parsed map; UsageError for layers out of range, given twice,
    or given none."""
    from ..data.capture import layer_ranges

    per: dict[int, tuple[str, Recipe]] = {}
    star = None
    for label, recipe, layers in parsed:
        if layers is None:
            star = (label, recipe)
            continue
        bad = [i for i in layers if i >= num_layers]
        if bad:
            raise UsageError(f"--recipe-map {text!r} names layer {bad[0]}, but the model has {num_layers} layers "
                             f"(0-{num_layers - 1})")
        twice = [i for i in layers if i in per]
        if twice:
            raise UsageError(f"--recipe-map {text!r} gives layer {twice[0]} two recipes; give each layer one")
        per.update({i: (label, recipe) for i in layers})
    missing = [i for i in range(num_layers) if i not in per]
    if missing:
        require(star is not None, f"--recipe-map {text!r} gives layers {layer_ranges(missing)} no recipe; "
                "add '*:RECIPE' for the rest")
        per.update({i: star for i in missing})
    return [per[i] for i in range(num_layers)]


def assignment_label(labels: list[str] | tuple[str, ...]) -> str:
    """'0-3:a;4:b;5-29:a' -> the canonical map string of a per-layer label list (runs of layers)."""
    from ..data.capture import layer_ranges

    groups: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        groups.setdefault(lab, []).append(i)
    if len(groups) == 1:
        return f"*:{labels[0]}"
    runs = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((start, i - 1, labels[start]))
            start = i
    return ";".join(f"{layer_ranges(list(range(a, b + 1)))}:{lab}" for a, b, lab in runs)


def cheapest_under(per_layer: np.ndarray, costs: list[int], target: float,
                   exclude: set[tuple[int, ...]] = frozenset()) -> tuple[tuple[int, ...], int, float] | None:
    """The cheapest choice (recipe index per layer) whose predicted KL, the sum of ``per_layer[r, l]``
    over layers, is at most ``target``; among equal cost the lowest prediction. None when no choice
    outside ``exclude`` fits. Exact under the additive model (dynamic programming over total cost)."""
    r_n, l_n = per_layer.shape
    vals = np.where(np.isfinite(per_layer), per_layer, np.inf)
    # best[c] = (lowest predicted sum at total cost c, the choice that reaches it)
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for layer in range(l_n):
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for c, (pred, choice) in best.items():
            for r in range(r_n):
                c2, p2 = c + costs[r], pred + float(vals[r, layer])
                if c2 not in nxt or p2 < nxt[c2][0]:
                    nxt[c2] = (p2, choice + (r,))
        best = nxt
    for c in sorted(best):
        pred, choice = best[c]
        if pred <= target and choice not in exclude:
            return choice, c, pred
    return None


def search(per_layer: np.ndarray, costs: list[int], budget: float, measure: Callable[[tuple[int, ...]], float],
           *, max_runs: int = 4) -> list[dict]:
    """Find the cheapest assignment whose measured KL is <= ``budget`` (see the module docstring).

    ``measure(choice)`` runs the model with that assignment and returns its measured statistic.
    Returns every attempt: choice, cost, predicted, target, measured, meets."""
    require(math.isfinite(budget) and budget > 0, f"--budget-kl must be a positive number, got {budget}")
    attempts: list[dict] = []
    tried: set[tuple[int, ...]] = set()
    target = budget
    for _ in range(max_runs):
        found = cheapest_under(per_layer, costs, target, exclude=tried)
        if found is None:
            break
        choice, cost, pred = found
        best_pass = min((a["cost"] for a in attempts if a["meets"]), default=None)
        if best_pass is not None and cost >= best_pass:
            break  # nothing cheaper than what already passed is left to try
        measured = float(measure(choice))
        tried.add(choice)
        meets = bool(measured <= budget)
        attempts.append({"choice": choice, "cost": cost, "predicted": pred, "target": target,
                         "measured": measured, "meets": meets})
        if not math.isfinite(measured) or pred <= 0:
            break
        ratio = measured / pred
        # Recalibrate the additive prediction; after a failure keep a 10% margin so that the next
        # candidate is not the same borderline one again.
        target = budget / ratio * (1.0 if meets else 0.9)
    return attempts


__all__ = ["Assignment", "parse_recipe_map", "check_map_layers", "assignment_label", "cheapest_under", "search"]
