"""Validation of the emulator against a hardware backend (the compiled FA3 kernel).

Exposed: ``Case``, ``GRIDS``, ``grid``, ``case_recipe``, ``with_dist``, ``captured_cases``,
``run_validation``, ``accumulator_ranking``, ``findings``, ``F_LIMIT``,
``F_AIM``.

For each case the same float64 inputs go through the kernel and through the emulator, on the
same query rows, and we report

- the fidelity ``F = RMSE(emulator, kernel) / RMSE(kernel, float64)``: how much of the
  kernel's own error the emulator fails to reproduce (0 = the emulator is the kernel; the bar is
  F <= 0.01 for every FP8 case, aim 0.001), over the outputs finite in both;
- the fraction of outputs that are bit-identical;
- both RMSEs against the float64 reference;
- non-finite outputs, counted apart: the kernel's, the emulator's, and the emulator's where the
  kernel's are finite (the target is zero);
- per (batch, head) sample, F and the bit-identical share (``fidelity_sample``,
  ``identical_sample``; sample = batch * heads + head), so a capture's cases give them per
  layer x head.

The emulator runs once per accumulator model (``acc=fp32``, ``fp22``, ``two-level``) on the same
quantized inputs (the backends share ``prepare``'s cache), so the grid answers which model
matches the hardware. Each case is one task of the engine (``fa3_numerics.engine.runner``): the
kernel job first, each emulator job compared against it output for output.

Grids (``GRIDS``): ``tiny`` (CPU dry runs and tests, with the ``fa3-mock`` stand-in), ``small``
(17 cases, the everyday check), ``stress`` (the regimes the kernel must survive: sigma up to
300, p up to 0.05, all five head dims, MQA, ragged and long sequences, BF16 at 8192), ``full``.
``with_dist`` puts a grid's shapes on another distribution (``--dist``); ``captured_cases``
checks the emulator on a capture's recorded tensors, per layer, with the capture's softmax
scale and causal flag (``--dist captured:FILE``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from typing import Callable

import numpy as np

from ..engine.study import Study
from .stored import StoredFindings
from ..errors import UsageError, require

F_LIMIT = 0.01  # the bar for every FP8 case
F_AIM = 0.001
DTYPES = ("fp8", "bf16")
GRANS = ("head", "tensor")  # the descales the public kernel takes


def _defaults(dist: str) -> dict[str, float]:
    """The registry's default parameters of family ``dist`` ({} for one the registry cannot name)."""
    from ..data.dist_spec import parse_dist

    try:
        entry = parse_dist(dist).entry
    except UsageError:
        return {}
    return {k: v for k, (v, _) in entry.params.items()}


@dataclasses.dataclass(frozen=True)
class Case:
    seqlen: int = 2048
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    causal: bool = False
    gran: str = "head"  # descales: head = one per (batch, kv-head), tensor = one for all
    rot: str = "none"  # none or hadamard (applied to Q and K before quantizing)
    dtype: str = "fp8"  # fp8 (e4m3 in, BF16 out) or bf16
    batch: int = 1
    seed: int = 0
    rows: int = 0  # query rows compared per (batch, head), drawn at random (0 = every row)
    dist: str = "outliers"  # any registered distribution (generate name, e.g. capture-file:PATH)
    # the family's parameters that differ from its registry defaults, as (name, value) pairs
    # (``with_data`` sets them; the registry's entry says which names a family takes)
    params: tuple[tuple[str, float], ...] = ()
    scale: float = 0.0  # softmax scale; 0 = 1/sqrt(head_dim)

    def __post_init__(self):
        from ..numerics.rotation import ROTATIONS
        from ..numerics.tiles import check_head_dim

        require(self.dtype in DTYPES, f"validation case dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        require(self.gran in GRANS, f"validation case gran {self.gran!r} is not one of {', '.join(GRANS)} "
                "(the descales the kernel takes)")
        require(self.rot in ROTATIONS, f"validation case rot {self.rot!r} is not one of {', '.join(ROTATIONS)}")
        check_head_dim(self.head_dim)
        require(self.heads % self.kv_heads == 0, f"validation case: heads {self.heads} is not a multiple of "
                f"kv_heads {self.kv_heads}")
        known = _defaults(self.dist)
        bad = [k for k, _ in self.params if known and k not in known]
        require(not bad, f"validation case: distribution {self.dist!r} takes {', '.join(sorted(known))}, not "
                f"{', '.join(bad)}")

    def data(self) -> tuple[str, dict]:
        """(distribution, parameters) of the case's inputs: the family's registry defaults with the
        case's own values over them (the paper's outliers: p 0.001, sigma 10)."""
        return self.dist, {**_defaults(self.dist), **dict(self.params)}

    def with_data(self, **params: float) -> "Case":
        """The case with these distribution parameters set (the others kept)."""
        return dataclasses.replace(self, params=tuple(sorted({**dict(self.params), **params}.items())))

    @property
    def name(self) -> str:
        parts = [self.dtype, f"n{self.seqlen}", f"d{self.head_dim}", f"h{self.heads}"]
        if self.kv_heads != self.heads:
            parts.append(f"kv{self.kv_heads}")
        if self.causal:
            parts.append("causal")
        data = self.data()[1]
        if self.dist == "outliers":
            parts.append(f"p{data['p']:g}s{data['sigma']:g}")
        elif self.dist.startswith("capture-file:"):
            parts.append(f"layer{int(data.get('layer', 0))}")
        else:
            given = ",".join(f"{k}={v:g}" for k, v in self.params)
            parts.append(self.dist + ("[" + given + "]" if given else ""))
        if self.dtype == "fp8":
            parts.append(self.gran)
        if self.rot != "none":
            parts.append(self.rot)
        if self.rows and self.rows < self.seqlen:
            parts.append(f"rows{self.rows}")
        return "-".join(parts)


def case_recipe(case: Case, acc: str | None = None, backend=None):
    """The recipe the kernel computes for ``case`` (``acc`` only changes the emulator): the FA3
    kernel's, or the backend's own where it has a ``validation_recipe(case)`` (another kernel
    maps the case's shape, data, rotation and 16-bit format onto its fixed recipe)."""
    from ..numerics.recipe import Recipe

    own = getattr(backend, "validation_recipe", None)
    if own is not None:
        r = own(case)
    elif case.dtype == "fp8":
        r = Recipe(qk="e4m3", v="e4m3", p="e4m3", gran=case.gran, rot=case.rot, out="bf16")
    else:
        r = Recipe(qk="bf16", v="bf16", p="bf16", out="bf16", rot=case.rot, p_offset=0.0)
    return dataclasses.replace(r, acc=acc) if acc is not None else r


_BASE = Case()


def _small() -> list[Case]:
    b = _BASE
    r = dataclasses.replace
    # Most informative first: a run stopped by a deadline keeps these.
    return [
        b,
        r(b, rot="hadamard"),
        r(b, gran="tensor"),
        r(b, causal=True, seqlen=1000),  # causal, and not a multiple of any tile
        r(b, kv_heads=2),  # GQA 4:1
        r(b, head_dim=64),
        r(b, head_dim=256),
        r(b, dtype="bf16"),
        r(b, gran="tensor", rot="hadamard"),
        r(b, seqlen=1000),
        r(b, seqlen=333),  # shorter than two tiles, ragged
        r(b, causal=True),
        b.with_data(p=0.0),
        b.with_data(p=0.01, sigma=10.0),
        b.with_data(p=0.001, sigma=3.0),
        r(b, kv_heads=2, causal=True, rot="hadamard", seqlen=1000),
        r(b, dtype="bf16", causal=True, seqlen=1000),
    ]


def _stress() -> list[Case]:
    """The regimes where the Hopper MMA model once gave NaN: heavy outliers, every head
    dim, MQA, ragged and long sequences, and BF16 up to 8192. Sized so that the grid (kernel and
    three accumulator models) takes a few minutes on one H200: 4-8 heads, every row up to
    seqlen 4097, sampled rows beyond."""
    c = Case(seqlen=2048, heads=8, kv_heads=8).with_data(p=0.01, sigma=30.0)
    r = dataclasses.replace
    return [
        c,                                                                  # heavy outliers, the baseline shape
        c.with_data(p=0.05),                                                # dense outliers
        c.with_data(sigma=100.0),
        c.with_data(p=0.002, sigma=300.0),                                  # rare, huge outliers
        r(c.with_data(sigma=300.0), rot="hadamard"),
        r(c, head_dim=64, seqlen=1000, causal=True),                        # ragged, causal
        r(c, head_dim=96, seqlen=1500),                                     # Paley-12 head dim
        r(c, head_dim=192, seqlen=777, rot="hadamard"),
        r(c, head_dim=256, seqlen=1000, causal=True),
        r(c, head_dim=96, gran="tensor", rot="hadamard"),
        r(c, kv_heads=1),                                                   # MQA
        r(c, kv_heads=1, head_dim=64, seqlen=1000, causal=True, rot="hadamard"),
        r(c, kv_heads=2, head_dim=192, gran="tensor"),                      # GQA 4:1
        r(c, seqlen=16384, heads=4, kv_heads=4, rows=256),                  # long, sampled rows
        r(c, seqlen=16384, heads=4, kv_heads=4, rows=256, causal=True, rot="hadamard"),
        r(c.with_data(p=0.05, sigma=300.0), seqlen=333),                    # short, ragged, extreme
        r(c.with_data(p=0.02, sigma=100.0), gran="tensor", causal=True),
        r(c.with_data(p=0.001, sigma=15.0), seqlen=4097, heads=4, kv_heads=4),  # one key past a tile
        r(c.with_data(p=0.05, sigma=300.0), head_dim=64, kv_heads=1, gran="tensor", rot="hadamard"),
        r(c, dtype="bf16", seqlen=8192, heads=4, kv_heads=4, rows=1024),    # BF16 at the paper's length
        r(c, dtype="bf16", seqlen=8192, heads=4, kv_heads=4, rows=1024, causal=True),
        r(c.with_data(p=0.05, sigma=300.0), dtype="bf16", head_dim=96, seqlen=1000),
        r(c, dtype="bf16", head_dim=256, kv_heads=1, seqlen=1500, causal=True),
        r(c.with_data(sigma=100.0), dtype="bf16", head_dim=192),
    ]


def _full() -> list[Case]:
    out = []
    for n, causal, d, (h, hkv), gran, rot, (p, sigma) in itertools.product(
            (1000, 2048), (False, True), (64, 128, 256), ((8, 8), (8, 2)), ("head", "tensor"),
            ("none", "hadamard"), ((0.001, 10.0), (0.01, 3.0))):
        out.append(Case(seqlen=n, causal=causal, head_dim=d, heads=h, kv_heads=hkv, gran=gran,
                        rot=rot).with_data(p=p, sigma=sigma))
    for n, causal, d in itertools.product((1000, 2048), (False, True), (64, 128, 256)):
        out.append(Case(seqlen=n, causal=causal, head_dim=d, dtype="bf16"))
    return out


def _tiny() -> list[Case]:
    """CPU dry runs and tests: the small grid's variety at toy sizes."""
    r = dataclasses.replace
    b = Case(seqlen=300, heads=2, kv_heads=2, batch=1)
    return [b, r(b, causal=True), r(b, heads=4, kv_heads=2, rot="hadamard"), r(b, head_dim=64, gran="tensor"),
            r(b, dtype="bf16")]


GRIDS: dict[str, Callable[[], list[Case]]] = {"small": _small, "stress": _stress, "full": _full, "tiny": _tiny}


def grid(name: str) -> list[Case]:
    if name not in GRIDS:
        raise UsageError(f"unknown grid {name!r}; choose one of: {', '.join(GRIDS)}")
    return GRIDS[name]()


def with_dist(cases: list[Case], spec: str) -> list[Case]:
    """The grid's shapes, descales and rotations on the data of ``spec`` (``--dist`` syntax; not
    ``captured:``, see ``captured_cases``): outliers parameters replace the cases' p and sigma
    where given; another family replaces the data of every case."""
    from ..data.dist_spec import parse_dist

    ds = parse_dist(spec)
    entry = ds.entry
    full = {k: v for k, (v, _) in entry.params.items()} | ds.params
    if entry.validate:
        entry.validate(full)
    if ds.family == "outliers":
        return [c.with_data(**ds.params) for c in cases]
    return [dataclasses.replace(c, dist=ds.name, params=tuple(sorted(ds.params.items()))) for c in cases]


def captured_cases(path: str, *, layers: str | None = None, rows: int = 0) -> list[Case]:
    """Per captured layer: FP8 with per-head descales, without and with the Hadamard rotation,
    and BF16, on the recorded Q, K, V with the capture's heads, softmax scale and causal flag."""
    from ..data.capture import load_capture, parse_layers
    from ..engine.checks import check_rows

    check_rows(rows)
    cap = load_capture(path)
    sel = parse_layers(layers) if layers else cap.layers
    missing = [i for i in sel if i not in cap.layers]
    require(not missing, f"--layers asks for {missing}, not in {path} (layers {','.join(map(str, cap.layers))})")
    base = Case(seqlen=cap.tokens, heads=cap.heads, kv_heads=cap.kv_heads, head_dim=cap.head_dim,
                causal=cap.causal, dist=f"capture-file:{path}", scale=cap.scale, rows=rows)
    out = []
    for layer in sel:
        c = dataclasses.replace(base, params=(("layer", float(layer)),))
        out += [c, dataclasses.replace(c, rot="hadamard"), dataclasses.replace(c, dtype="bf16")]
    return out


def skips(cases: list[Case], backend=None) -> list[str]:
    """Per case, why it is not run on ``backend`` ("" = it runs): a shape the kernel refuses (its
    ``validation_skip(case)``), or the same recipe and inputs as an earlier case (another
    kernel's recipe may ignore what tells two FA3 cases apart, e.g. the descale granularity)."""
    own = getattr(backend, "validation_skip", None)
    if own is None:
        return [""] * len(cases)
    return repeats(cases, [own(c) for c in cases], lambda c: case_recipe(c, backend=backend))


def repeats(cases: list[Case], whys: list, recipe_of: Callable, ignore=("gran", "dtype")) -> list[str]:
    """``whys`` (None or "" = the case runs) with each case that runs the same recipe (``recipe_of``) on
    the same inputs as an earlier running case marked as its repeat. The fields in ``ignore`` are set to
    their defaults before cases are compared: the granularity and dtype tell two cases apart only through
    the recipe (and, for a backward, which rows are compared does not matter: it runs them all)."""
    seen: dict = {}
    out = []
    for c, why in zip(cases, whys):
        if not why:
            key = (recipe_of(c), dataclasses.replace(c, **{f: getattr(_BASE, f) for f in ignore}))
            if key in seen:
                why = f"same recipe and inputs as case {seen[key]} on this kernel"
            seen.setdefault(key, c.name)
        out.append(why or "")
    return out


def tasks(cases: list[Case], kernel: str, accs: list[str], device: str, backend=None) -> list:
    """One engine task per case: the kernel (slot 0), then the emulator per accumulator (slots
    1.., each compared against slot 0)."""
    from ..engine.inputs import DistInputs
    from ..engine.runner import Job, Task

    out = []
    for c in cases:
        dist, params = c.data()
        inputs = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim, c.seed)
        jobs = [Job(0, case_recipe(c, backend=backend), backend=kernel)]
        jobs += [Job(1 + j, case_recipe(c, a, backend), backend="emulate", against=0) for j, a in enumerate(accs)]
        out.append(Task(inputs, c.causal, c.seed, c.rows, kernel, device, jobs, hist_key=None, where=c.name,
                        softmax_scale=c.scale or None))
    return out


def check_accs(accs: list[str] | None) -> list[str]:
    """The accumulator models of ``--acc`` (the FA3 kernel's when None): registered, each once."""
    from ..engine.checks import check_distinct
    from ..numerics.accumulators import ACCUMULATORS, accumulator_names

    accs = list(accs or ACCUMULATORS)
    for a in accs:
        require(a in accumulator_names(), f"unknown accumulator {a!r}; choose from {', '.join(accumulator_names())}")
    check_distinct("acc", accs)
    return accs


def run_validation(cases: list[Case], *, device: str = "cuda", backend: str = "fa3", accs: list[str] | None = None,
                   kernel=None, progress: Callable[[str], None] = print, deadline: float | None = None):
    """Run every case through the kernel backend and the emulator (once per accumulator).

    ``kernel``: a backend object to use in place of ``backend`` (its registered name is used);
    ``deadline`` (a ``time.perf_counter()`` value) stops before a case that would start after
    it, leaving NaN for the cases not run. Returns an xarray Dataset (dims case, acc, sample).
    """
    import xarray as xr

    from ..engine.backends import get_backend, refusal
    from ..engine.provenance import provenance
    from ..engine.runner import run_tasks
    from ..engine.sampling import effective_rows
    from ..numerics.accumulators import ACCUMULATORS
    from ..numerics.recipe import Recipe

    require(len(cases) > 0, "the validation grid is empty")
    name = getattr(kernel, "name", None) or backend
    kernel = kernel or get_backend(name)
    # A kernel of its own recipe names the accumulator models worth running against it.
    accs = check_accs(list(accs or getattr(kernel, "validation_accs", None) or ACCUMULATORS))
    why = kernel.check(device)
    require(why is None, f"backend {name!r} cannot run: {why}")
    skipped = skips(cases, kernel)
    for c, skip in zip(cases, skipped):
        if skip:
            progress(f"[validate] {c.name}: skipped on {name}: {skip}")
            continue
        why = refusal(kernel, case_recipe(c, backend=kernel))
        require(why is None, f"case {c.name} cannot run on backend {name!r}: {why}")
    t_start = time.perf_counter()
    todo = [c for c, skip in zip(cases, skipped) if not skip]
    require(len(todo) > 0, f"every case of the grid is skipped on backend {name!r}: {skipped[0]}")
    ran = run_tasks(tasks(todo, name, accs, device, kernel), progress=progress, deadline=deadline)
    it = iter(ran.results)
    results = [{} if skip else next(it) for skip in skipped]
    it = iter(ran.seconds)
    seconds = [math.nan if skip else next(it) for skip in skipped]
    run = dataclasses.replace(ran, results=results, seconds=seconds)
    nc, na = len(cases), len(accs)
    ns = max(c.batch * c.heads for c in cases)
    nan = lambda *shape: np.full(shape, np.nan)  # noqa: E731
    v = {k: nan(nc, na) for k in ("fidelity", "identical", "rmse_emulator", "max_rel_diff", "nonfinite_emulator",
                                  "nonfinite_emulator_only")}
    v.update({k: nan(nc) for k in ("rmse_kernel", "nonfinite_kernel", "seconds")})
    fs, ids = nan(nc, na, ns), nan(nc, na, ns)
    for i, (c, res) in enumerate(zip(cases, run.results)):
        if 0 not in res:
            continue  # not run (deadline)
        ker = res[0]
        k_rmse = ker["rmse"].ravel()
        positions = effective_rows(c.seqlen, c.rows) * c.head_dim  # outputs per (batch, head) sample
        v["rmse_kernel"][i] = _rms_pool(k_rmse)
        v["nonfinite_kernel"][i] = float(ker["nonfinite"].sum())
        v["seconds"][i] = run.seconds[i]
        for j in range(na):
            e = res[1 + j]
            se, n, ref_se = e["vs_se"].ravel(), e["vs_n"].ravel(), e["vs_ref_se"].ravel()
            # F over the outputs finite in both: a NaN counted below does not hide the rest
            rms_diff = math.sqrt(se.sum() / n.sum()) if n.sum() else math.nan
            rms_kernel = math.sqrt(ref_se.sum() / n.sum()) if n.sum() else math.nan
            v["fidelity"][i, j] = _ratio(rms_diff, rms_kernel)
            v["identical"][i, j] = float(e["vs_identical"].sum()) / (positions * k_rmse.size)
            v["rmse_emulator"][i, j] = _rms_pool(e["rmse"].ravel())
            v["max_rel_diff"][i, j] = float(e["vs_max_rel"].max())
            v["nonfinite_emulator"][i, j] = float(e["nonfinite"].sum())
            v["nonfinite_emulator_only"][i, j] = float(e["vs_nonfinite_here"].sum())
            with np.errstate(divide="ignore", invalid="ignore"):
                nn = np.where(n > 0, n, np.nan)
                fs[i, j, :k_rmse.size] = [_ratio(a, b) for a, b in zip(np.sqrt(se / nn), np.sqrt(ref_se / nn))]
            ids[i, j, :k_rmse.size] = e["vs_identical"].ravel() / positions
        progress(f"[validate {i + 1}/{nc}] {c.name}: rmse(kernel) {v['rmse_kernel'][i]:.3e}; "
                 + ", ".join(f"F[{a}] {v['fidelity'][i, j]:.4f} ident {v['identical'][i, j]:.1%}"
                             for j, a in enumerate(accs))
                 + (f"; NON-FINITE kernel {int(v['nonfinite_kernel'][i])}, emulator-only "
                    f"{[int(x) for x in v['nonfinite_emulator_only'][i]]}"
                    if v["nonfinite_kernel"][i] or np.nansum(v["nonfinite_emulator"][i]) else ""))
    coords = {"case": [c.name for c in cases], "acc": accs, "sample": np.arange(ns)}
    for f in dataclasses.fields(Case):
        if f.name == "params":
            continue
        vals = [getattr(c, f.name) for c in cases]
        coords[f.name] = ("case", [int(x) for x in vals] if isinstance(vals[0], bool) else vals)
    # the data of each case as the datasets have always held it: p and sigma of the paper's
    # outliers (for a case of another family, the outliers' defaults, as before: the dataset's
    # dist and params coordinates say what it drew), and the parameters given to any other
    # family as k=v,k=v
    paper = _defaults("outliers")
    datas = [c.data()[1] if c.dist == "outliers" else paper for c in cases]
    coords["p"] = ("case", [float(d["p"]) for d in datas])
    coords["sigma"] = ("case", [float(d["sigma"]) for d in datas])
    coords["params"] = ("case", [",".join(f"{k}={v:g}" for k, v in c.params) if c.dist != "outliers" else ""
                                 for c in cases])
    coords["spec"] = ("case", [case_recipe(c, backend=kernel).short_str() for c in cases])
    coords["skipped"] = ("case", skipped)
    # The F bar applies to every FP8 case of the FA3 kernel, and to every case of a kernel that
    # brings its own recipe (its 16-bit cases are its own arithmetic too).
    own = getattr(kernel, "validation_recipe", None) is not None
    coords["bar"] = ("case", [int(own or c.dtype == "fp8") for c in cases])
    desc = {
        "fidelity": "RMSE(emulator, kernel) / RMSE(kernel, float64), over outputs finite in both",
        "identical": "fraction of outputs bit-identical to the kernel's",
        "rmse_emulator": "RMSE(emulator, float64)",
        "max_rel_diff": "max |emulator - kernel| / |kernel| over outputs finite in both",
        "nonfinite_emulator": "count of non-finite emulator outputs (or reference values)",
        "nonfinite_emulator_only": "count of outputs non-finite in the emulator where the kernel's are finite",
        "rmse_kernel": "RMSE(kernel, float64)",
        "nonfinite_kernel": "count of non-finite kernel outputs (or reference values)",
        "seconds": "wall time of the case (inputs, reference, kernel, emulator)",
        "fidelity_sample": "F per (batch, head) sample; sample = batch * heads + head",
        "identical_sample": "bit-identical share per (batch, head) sample",
    }
    data = {k: (("case", "acc") if a.ndim == 2 else ("case",), a) for k, a in v.items()}
    data.update({"fidelity_sample": (("case", "acc", "sample"), fs), "identical_sample": (("case", "acc", "sample"), ids)})
    ds = xr.Dataset({k: (dims, a, {"description": desc[k]}) for k, (dims, a) in data.items()}, coords=coords)
    from ..engine.dataset import VALIDATION_FORMAT
    from ..engine.sampling import ROWS_SAMPLING

    attrs = provenance(device)
    attrs.update({"format": VALIDATION_FORMAT, "kind": "validation", "backend": name,
                  "kernel_hardware": int(bool(getattr(kernel, "hardware", False))),
                  "kernel_label": getattr(kernel, "label", name),
                  "recipe_default_acc": Recipe().acc, "f_limit": F_LIMIT, "f_aim": F_AIM,
                  "wall_seconds": round(time.perf_counter() - t_start, 3), "cases_not_run": run.not_run,
                  "cases_skipped": sum(bool(x) for x in skipped),
                  "dist": ", ".join(sorted({c.data()[0] for c in cases})),
                  "rows": f"all query rows, or the case's `rows`: {ROWS_SAMPLING}",
                  "rotation_seed": "case seed", "data_seed": "case seed (torch.Generator on CPU, float64)"})
    try:  # provenance only: the kernel module and version, from the backend itself
        attrs.update(getattr(kernel, "provenance", dict)())
    except Exception:  # noqa: BLE001
        pass
    ds.attrs.update({k: (v if isinstance(v, (str, int, float)) else json.dumps(v)) for k, v in attrs.items()})
    from .validate_findings import with_findings

    return with_findings(ds)


def _rms_pool(per_sample_rmse: np.ndarray) -> float:
    """RMSE over every position from per-sample RMSEs of equal size (NaN if any is)."""
    return float(np.sqrt(np.mean(per_sample_rmse ** 2))) if per_sample_rmse.size else math.nan


def _ratio(num: float, den: float) -> float:
    if not (math.isfinite(num) and math.isfinite(den)):
        return math.nan
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def findings(ds) -> list[str]:
    """One line per case with non-finite outputs: the kernel's, and the emulator's per accumulator."""
    out = []
    for i, c in enumerate(ds["case"].values):
        k = ds["nonfinite_kernel"].values[i]
        e = ds["nonfinite_emulator"].values[i]
        only = ds["nonfinite_emulator_only"].values[i]
        if (np.isfinite(k) and k > 0) or np.nansum(e) > 0:
            per = ", ".join(f"{a} {int(x)} ({int(o)} where the kernel's are finite)"
                            for a, x, o in zip(ds["acc"].values, e, only) if np.isfinite(x))
            out.append(f"non-finite outputs in case {c!r}, seed {int(ds['seed'].values[i])}: kernel {int(k)}; "
                       f"emulator {per}")
    return out


def accumulator_ranking(ds) -> list[dict]:
    """Per accumulator over the FP8 cases run: max F, median F, mean bit-identical, non-finite
    outputs where the kernel's are finite; best first."""
    fp8 = ds["bar"].values.astype(bool) if "bar" in ds.coords else ds["dtype"].values == "fp8"
    out = []
    for a in ds["acc"].values:
        f = ds["fidelity"].sel(acc=a).values[fp8]
        f = f[np.isfinite(f)]
        idn = ds["identical"].sel(acc=a).values[fp8]
        idn = idn[np.isfinite(idn)]
        if f.size == 0:
            continue
        only = ds["nonfinite_emulator_only"].sel(acc=a).values[fp8] if "nonfinite_emulator_only" in ds else np.zeros(1)
        out.append({"acc": str(a), "max_F": float(f.max()), "median_F": float(np.median(f)),
                    "mean_identical": float(idn.mean()), "cases": int(f.size),
                    "nonfinite_only": int(np.nansum(only)),
                    "pass": bool(f.max() <= F_LIMIT and np.nansum(only) == 0)})
    return sorted(out, key=lambda r: (r["nonfinite_only"] > 0, r["max_F"], r["median_F"]))


class ValidationStudy(StoredFindings, Study):
    """Emulator against kernel on the ``engine.study`` protocol (``fa3-numerics validate``): the
    cases and the backend are checked when it is made; the dataset is ``validation.nc``."""

    kind = "validation"
    stem = "validation"

    def __init__(self, cases: list[Case], *, device: str, backend: str, accs: list[str] | None, kernel):
        self.cases, self.device, self.backend, self.accs, self.kernel = cases, device, backend, accs, kernel

    def describe(self) -> str:
        return f"validate: {len(self.cases)} case(s), backend {self.backend} on {self.device}"

    def run(self, ctx):
        return run_validation(self.cases, device=self.device, backend=self.backend, accs=self.accs,
                              kernel=self.kernel, progress=ctx.progress)

    def assemble(self, ds):
        return ds

    def nonfinite(self, ds) -> list:
        return findings(ds)


__all__ = ["ValidationStudy", "Case", "GRIDS", "grid", "case_recipe", "with_dist", "captured_cases", "skips", "repeats", "tasks",
           "run_validation", "accumulator_ranking", "findings", "F_LIMIT", "F_AIM"]
