"""Audit a captured model: FP8 attention error per layer x head, and the statistics that explain it.

Exposed: ``DEFAULT_VARIANTS``, ``audit``, ``recipe_cost``, ``rank``, ``recommend``,
``check_recommendations``, ``STAT_DEFINITIONS``.

``audit(capture)`` runs every variant on every (layer, head) of a capture (``fa3_numerics.data.capture``)
against the float64 reference, causal as the model is and with the model's softmax scale, and
computes per (layer, head):

- errors: every metric of ``fa3_numerics.numerics.metrics`` (dims layer, head, variant);
- per-channel amax of Q, K and V (dims layer, head|kv_head, channel), the hottest channel and its
  RoPE partner (transformers' Llama ``apply_rotary_pos_emb`` uses ``rotate_half``: channel c
  rotates with c + d/2 mod d), hot/median channel amax;
- kurtosis and max/rms of Q, K, V; incoherence mu = max|x| sqrt(d) / ||x|| per token (QuaRot),
  mean and max over tokens, before and after the random Hadamard rotation the FP8 recipes use;
- attention-sink mass (weight on the first ``SINK_TOKENS`` tokens) and the fraction of FA3's
  offset-8 P~ that rounds to zero in e4m3, both from float64 probabilities;
- per-block amax of Q and K at the FP8 kernel's tiles (kBlockM rows of Q, kBlockN rows of K).

Every definition is in ``STAT_DEFINITIONS`` and in the dataset's variable attributes.

Heads of a layer are evaluated together as one [1, heads, seq, dim] problem (K, V with kv_heads:
GQA). Query rows are independent given K and V, so ``rows`` > 0 evaluates a seeded random
subset of rows (the same for every layer), exact for those rows; 0 evaluates all.

``rank`` orders (layer, head) by risk; ``recommend`` picks per layer the cheapest variant (by
``recipe_cost``) whose error, max over the layer's heads, meets a budget. Both are read off the
measured table, so the recommendation agrees with the measured errors by construction;
``check_recommendations`` verifies that on the dataset.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import require
from ..numerics.granularity import PerBlock, PerHead, PerTensor, PerToken
from ..numerics.metrics import METRICS, per_sample
from ..numerics.recipe import PRESETS, Recipe, parse_recipes
from ..numerics.reference import causal_mask, expand_kv
from ..numerics.rotation import make_rotation
from ..numerics.tiles import check_head_dim, fa3_tiles

DEFAULT_VARIANTS = ("baseline-fp8", "fa3-fp8", "fa3-fp8-no-block-quant", "fa3-fp8-no-incoherent")
SINK_TOKENS = 4
# e4m3's smallest subnormal is 2^-9; round-to-nearest-even sends anything <= half of it to 0.
E4M3_HALF_MIN_SUBNORMAL = 2.0 ** -10
P_OFFSET = 8.0
ROWS_SEED = "seed * 1000003 + 17"
AUDIT_FORMAT = "fa3-numerics-audit/1"
RANK_METRICS = ("rel_l2", "rmse", "rel_l1", "max_abs")
# Elements of one float64 score chunk in the statistics pass.
_CHUNK_ELEMS = 1 << 22
LOG2E = math.log2(math.e)

STAT_DEFINITIONS = {
    "amax": "max over tokens of |x| per channel",
    "hot_channel": "channel with the largest amax in the head",
    "hot_pair": "RoPE partner of the hot channel: (c + d/2) mod d (rotate_half, transformers Llama)",
    "hot_ratio": "amax of the hot channel / median channel amax",
    "kurtosis": "Pearson kurtosis E[(x-mean)^4]/var^2 over all entries of the head (Gaussian: 3)",
    "max_over_rms": "max|x| / sqrt(mean x^2) over all entries of the head",
    "mu_mean": "incoherence mu = max|x| sqrt(d) / ||x|| per token (QuaRot), mean over tokens",
    "mu_max": "incoherence mu per token, max over tokens",
    "mu_rot_mean": "mu after the random Hadamard rotation (seed = rotation seed), mean over tokens",
    "mu_rot_max": "mu after the random Hadamard rotation, max over tokens",
    "block_amax": "amax per block of tokens at the FP8 kernel's tiles (kBlockM for Q, kBlockN for K)",
    "block_ratio": "max block amax / median block amax",
    "sink_mass": f"mean over evaluated queries of the float64 attention weight on the first {SINK_TOKENS} tokens",
    "p_underflow": ("fraction of the causally visible P~ = 2^((s - m) log2 e + 8) of the evaluated query rows "
                    "that rounds to 0 in e4m3 "
                    "(P~ <= 2^-10), m the kernel's running max: KV tiles of kBlockN visited last to first, "
                    "s the exact float64 scores"),
    "p_underflow_final": "as p_underflow, but against the final row max (a single-pass softmax)",
}


# --------------------------------------------------------------------------------------------
# cost order
# --------------------------------------------------------------------------------------------

_GRAN_COST = {PerTensor: 0, PerHead: 1, PerBlock: 3, PerToken: 4}
_ROT_COST = {"none": 0, "hadamard": 2, "orthogonal": 4}


def recipe_cost(recipe: Recipe) -> int:
    """Relative cost of a recipe over the public FA3 FP8 kernel with one descale per tensor.

    Scales: per tensor 0, per (kv-)head 1 (the kernel's descale shape), per block 3 (needs a
    kernel change: the public kernel has no per-block descales), per token 4. Rotation: a
    random Hadamard on Q and K costs 2 (an extra O(d log d) pass over Q and K), a dense
    orthogonal rotation 4. ``algo=standard`` (S and P materialised in memory) adds 6, 16-bit
    Q/K instead of FP8 adds 8 (half the tensor-core throughput). Ties keep the order given.
    """
    cost = _GRAN_COST.get(type(recipe.gran), 2) + _ROT_COST.get(recipe.rot, 2)
    if recipe.algo == "standard":
        cost += 6
    if not recipe.fp8:
        cost += 8
    return cost


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------

def _tensor_stats(x: torch.Tensor, rotated: torch.Tensor | None, block_rows: int) -> dict[str, np.ndarray]:
    """x: (heads, seq, d) float64 (and x rotated, or None) -> per-head statistics (see STAT_DEFINITIONS)."""
    h, n, d = x.shape
    a = x.abs()
    amax = a.amax(dim=1)                                   # (h, d)
    hot = amax.argmax(dim=1)
    med = amax.median(dim=1).values
    flat = x.reshape(h, -1)
    mean = flat.mean(dim=1, keepdim=True)
    var = ((flat - mean) ** 2).mean(dim=1)
    kurt = ((flat - mean) ** 4).mean(dim=1) / var.clamp_min(1e-300) ** 2
    rms = flat.pow(2).mean(dim=1).sqrt()

    def mu(t):
        nrm = t.norm(dim=-1)
        m = t.abs().amax(dim=-1) * math.sqrt(d) / nrm.clamp_min(1e-300)
        m = torch.where(nrm > 0, m, torch.ones_like(m))
        return m.mean(dim=1), m.amax(dim=1)

    mu_mean, mu_max = mu(x)
    mu_rot_mean, mu_rot_max = mu(rotated) if rotated is not None else (mu_mean, mu_max)
    nblk = -(-n // block_rows)
    tok = a.amax(dim=2)
    pad = nblk * block_rows - n
    if pad:
        tok = torch.nn.functional.pad(tok, (0, pad))
    blk = tok.reshape(h, nblk, block_rows).amax(dim=2)     # (h, nblk)
    out = {
        "amax": amax, "hot_channel": hot, "hot_pair": (hot + d // 2) % d,
        "hot_ratio": amax.gather(1, hot[:, None])[:, 0] / med.clamp_min(1e-300),
        "kurtosis": kurt, "max_over_rms": a.amax(dim=(1, 2)) / rms.clamp_min(1e-300),
        "mu_mean": mu_mean, "mu_max": mu_max, "mu_rot_mean": mu_rot_mean, "mu_rot_max": mu_rot_max,
        "block_amax": blk, "block_ratio": blk.amax(dim=1) / blk.median(dim=1).values.clamp_min(1e-300),
    }
    return {k: v.detach().cpu().numpy() for k, v in out.items()}


def _attention_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, scale: float, causal: bool,
                     q_index: torch.Tensor, block_n: int) -> dict:
    """Sink mass and P~ underflow per head from float64 scores. q: (1, H, n, d), k, v: (1, Hkv, n, d).

    With ``v`` the same pass also returns the float64 reference output of the rows ``q_index`` under
    "out" ([1, H, R, Dv]): softmax(QK^T scale) V computed as ``reference_attention`` computes it.
    """
    _, h, n, d = q.shape
    nk = k.shape[2]
    kk = expand_kv(k.to(torch.float64), h)[0]               # (H, nk, d)
    vv = expand_kv(v.to(torch.float64), h)[0] if v is not None else None
    qs = q.to(torch.float64)[0].index_select(1, q_index)    # (H, r, d)
    r = qs.shape[1]
    chunk = max(1, _CHUNK_ELEMS // max(1, h * nk))
    n_tiles = -(-nk // block_n)
    pad = n_tiles * block_n - nk
    sink = torch.zeros(h, dtype=torch.float64)
    under = torch.zeros(h, dtype=torch.float64)
    under_final = torch.zeros(h, dtype=torch.float64)
    visible = torch.zeros(h, dtype=torch.float64)
    out = torch.empty(h, r, vv.shape[-1], dtype=torch.float64) if vv is not None else None
    # P~ = 2^((s - m) log2 e + 8) <= 2^-10  <=>  s - m <= (log2(2^-10) - 8) / log2 e  (natural units)
    thresh = (math.log2(E4M3_HALF_MIN_SUBNORMAL) - P_OFFSET) / LOG2E
    for c0 in range(0, r, chunk):
        idx = q_index[c0:c0 + chunk]
        rc = idx.numel()
        s = torch.matmul(qs[:, c0:c0 + chunk], kk.transpose(-1, -2)) * scale   # (H, rc, nk)
        if causal:
            vis = causal_mask(idx, 0, nk, n, nk)
            s += torch.zeros(vis.shape, dtype=s.dtype).masked_fill_(~vis, -math.inf)  # cheaper than masked_fill
            n_vis = float(vis.sum()) * h
        else:
            n_vis = float(rc * nk * h)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        # Masked (and padding) entries are -inf and always pass "<= thresh": count all, subtract them.
        under_final += torch.count_nonzero(s <= m + thresh, dim=(1, 2)).to(torch.float64)
        p = torch.sub(s, m).exp_()
        den = p.sum(dim=-1)
        sink += (p[..., :SINK_TOKENS].sum(dim=-1) / den).sum(dim=-1)
        if out is not None:
            out[:, c0:c0 + rc] = torch.matmul(p, vv) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        del p
        # The kernel's running max when it reaches KV tile t (tiles visited last to first) is the
        # max over tiles t..last of the row.
        sp = torch.nn.functional.pad(s, (0, pad), value=-math.inf) if pad else s
        sp = sp.reshape(h, rc, n_tiles, block_n)
        tmax = sp.amax(dim=-1)
        run = torch.flip(torch.cummax(torch.flip(tmax, [-1]), dim=-1).values, [-1])
        run = torch.where(torch.isfinite(run), run, torch.zeros_like(run))
        under += torch.count_nonzero(sp <= (run + thresh)[..., None], dim=(1, 2, 3)).to(torch.float64)
        masked = h * rc * nk - n_vis
        under -= (masked + h * rc * pad) / h
        under_final -= masked / h
        visible += n_vis / h
    res = {"sink_mass": (sink / r).numpy(), "p_underflow": (under / visible).numpy(),
           "p_underflow_final": (under_final / visible).numpy()}
    if out is not None:
        res["out"] = out.unsqueeze(0)
    return res


# --------------------------------------------------------------------------------------------
# the audit
# --------------------------------------------------------------------------------------------

def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _attention_fn(backend_name: str, scale: float, head_dim: int, device: str):
    """(recipe, q, k, v, causal, q_index, seed, cache) -> output, with the capture's softmax scale."""
    if backend_name == "emulate":
        from ..numerics.emulator import emulate

        def run(recipe, q, k, v, causal, q_index, seed, cache):
            return emulate(recipe, q, k, v, causal=causal, softmax_scale=scale, q_index=q_index,
                           rotation_seed=seed, cache=cache)

        return run, None
    from ..engine.backends import get_backend

    backend = get_backend(backend_name)
    why = backend.check(device)
    require(why is None, f"backend {backend_name!r} cannot run: {why}")
    takes_scale = "softmax_scale" in inspect.signature(backend.attention).parameters
    if not takes_scale:
        require(math.isclose(scale, head_dim ** -0.5, rel_tol=1e-12),
                f"backend {backend_name!r} takes no softmax scale and the capture's is {scale:g}, not "
                f"1/sqrt({head_dim}); use --backend emulate")

    def run(recipe, q, k, v, causal, q_index, seed, cache):
        kw = {"softmax_scale": scale} if takes_scale else {}
        return backend.attention(recipe, q, k, v, causal=causal, q_index=q_index, rotation_seed=seed,
                                 cache=cache, **kw)

    return run, backend


def audit(capture, *, variants: str | list[str] | None = None, backend: str = "emulate", rows: int = 256,
          layers: str | list[int] | None = None, seed: int = 0, device: str = "cpu",
          progress: Callable[[str], None] = _progress) -> "xarray.Dataset":  # noqa: F821
    """Audit ``capture`` (a ``Capture`` or a path) and return the dataset (see module docstring)."""
    from ..data.capture import Capture, load_capture, parse_layers
    from ..engine.dataset import to_dataset
    from ..engine.provenance import provenance

    t_start = time.perf_counter()
    cap: Capture = capture if isinstance(capture, Capture) else load_capture(capture)
    if variants is None:
        variants = list(DEFAULT_VARIANTS)
    recipes = parse_recipes(variants if isinstance(variants, str) else ";".join(variants))
    require(isinstance(rows, int) and rows >= 0, f"--rows must be >= 0 (0 = every query row), got {rows}")
    require(device in ("cpu", "cuda") or device.startswith("cuda:"), f"--device must be cpu or cuda, got {device}")
    if device.startswith("cuda"):
        require(torch.cuda.is_available(), "no CUDA GPU is visible; use --device cpu")
    d, n, H, Hkv = cap.head_dim, cap.tokens, cap.heads, cap.kv_heads
    check_head_dim(d)
    if layers is None or isinstance(layers, str):
        sel = parse_layers(layers) if layers is not None else None
        sel = cap.layers if sel is None else sel
    else:
        sel = sorted(set(int(i) for i in layers))
    missing = [i for i in sel if i not in cap.layers]
    require(not missing, f"--layers asks for {missing}, not in the capture (layers "
            f"{','.join(map(str, cap.layers))}); pick from those")
    run, be = _attention_fn(backend, cap.scale, d, device)
    if be is not None:
        for label, r in recipes:
            why = be.supports(r)
            require(why is None, f"variant {label!r} cannot run on backend {backend!r}: {why}")
    bm, bn = fa3_tiles(d, fp8=True)
    rot = make_rotation("hadamard", d, seed)
    if rows and rows < n:
        g = torch.Generator().manual_seed(seed * 1000003 + 17)
        q_index = torch.randperm(n, generator=g)[:rows].sort().values
    else:
        q_index = torch.arange(n)
    r_eval = q_index.numel()

    L, V = len(sel), len(recipes)
    err = {m: np.full((L, H, V), np.nan) for m in METRICS}
    stats: dict[str, np.ndarray] = {}

    def put(name, li, val):
        if name not in stats:
            stats[name] = np.full((L,) + np.shape(val), np.nan)
        stats[name][li] = val

    progress(f"audit of {cap.path or 'capture'}: {L} layers x {H} heads ({Hkv} KV heads), seq {n}, "
             f"{r_eval} query rows, {V} variants, backend {backend} on {device}")
    t0 = time.perf_counter()
    for li, layer in enumerate(sel):
        tl = time.perf_counter()
        q3, k3, v3 = cap.qkv(layer)
        q, k, v = (t.unsqueeze(0).to(device) for t in (q3, k3, v3))
        qi = q_index.to(device)
        # One float64 pass gives the reference output and the attention statistics.
        att = _attention_stats(q3.unsqueeze(0), k3.unsqueeze(0), v3.unsqueeze(0), scale=cap.scale,
                               causal=cap.causal, q_index=q_index, block_n=bn)
        ref = att.pop("out").to(device)
        for key, val in att.items():
            put(key, li, val)
        put("out_rms", li, ref[0].pow(2).mean(dim=(1, 2)).sqrt().cpu().numpy())
        cache: dict = {}
        for vi, (label, recipe) in enumerate(recipes):
            o = run(recipe, q, k, v, cap.causal, qi, seed, cache)
            vals = per_sample(o, ref)
            for m in METRICS:
                err[m][li, :, vi] = vals[m][0]
        for name, t, br in (("q", q3, bm), ("k", k3, bn), ("v", v3, bn)):
            rotated = None
            if name != "v":
                # The emulator's cache may already hold this rotation of the tensor (same seed): reuse it.
                hit = cache.get(("rot", name, "hadamard", seed))
                rotated = hit[0].to("cpu", torch.float64) if isinstance(hit, torch.Tensor) and \
                    tuple(hit.shape[1:]) == tuple(t.shape) else rot.apply(t)
            for key, val in _tensor_stats(t, rotated, br).items():
                if name == "v" and key.startswith("mu_rot"):
                    continue
                put(f"{name}_{key}", li, val)
        del cache, ref, q, k, v
        el = time.perf_counter() - t0
        worst = np.nanmax(err["rel_l2"][li])
        progress(f"[layer {layer}: {li + 1}/{L}] {time.perf_counter() - tl:.1f} s; worst rel_l2 {worst:.3g}; "
                 f"{el:.0f} s elapsed, ~{el / (li + 1) * (L - li - 1):.0f} s left")

    labels = [lab for lab, _ in recipes]
    coords = {
        "layer": sel, "head": np.arange(H), "variant": labels, "kv_head": np.arange(Hkv), "channel": np.arange(d),
        "spec": ("variant", [r.spec() for _, r in recipes]),
        "cost": ("variant", [recipe_cost(r) for _, r in recipes]),
        "paper_rmse": ("variant", [PRESETS[lab].paper_rmse if lab in PRESETS and PRESETS[lab].paper_rmse
                                   else np.nan for lab in labels]),
        "kv_head_of": ("head", np.arange(H) // (H // Hkv)),
    }
    attrs = provenance(device)
    cap_path = cap.path or ""
    attrs.update({
        "kind": "audit", "audit_format": AUDIT_FORMAT, "experiment": "audit",
        "description": f"FP8 attention audit of {cap.meta.get('model', '?')}",
        "dist": f"capture of {cap.meta.get('model', '?')} ({cap.meta.get('text_source', '?')}, {n} tokens)",
        "backend": backend, "seeds": json.dumps([seed]), "rotation_seed": seed,
        "rows": rows, "rows_evaluated": r_eval,
        "rows_sampling": ("all query rows" if r_eval == n else
                          f"{r_eval} of {n} rows: torch.randperm({n}, generator=manual_seed({ROWS_SEED}))[:{rows}], "
                          "the same rows in every layer"),
        "capture_path": str(Path(cap_path).resolve()) if cap_path else "",
        "capture_sha256": _sha256(cap_path) if cap_path and Path(cap_path).is_file() else "",
        "capture_meta": json.dumps(cap.meta, sort_keys=True),
        "model": cap.meta.get("model", ""), "tokens": n, "heads": H, "kv_heads": Hkv, "head_dim": d,
        "causal": str(cap.causal).lower(), "softmax_scale": repr(cap.scale),
        "tiles_fp8": json.dumps([bm, bn]), "sink_tokens": SINK_TOKENS,
        "reference": "float64 attention, chunked over queries, causal as captured, the capture's softmax scale",
        "stat_definitions": json.dumps(STAT_DEFINITIONS),
    })
    ds = to_dataset(err, dims=["layer", "head", "variant"], coords=coords, attrs=attrs)
    ds = ds.assign_coords(q_block=np.arange(stats["q_block_amax"].shape[-1]),
                          k_block=np.arange(stats["k_block_amax"].shape[-1]))
    for name, arr in stats.items():
        tensor, _, key = name.partition("_")
        if name in ("sink_mass", "p_underflow", "p_underflow_final", "out_rms"):
            dims, key = ["layer", "head"], name
        else:
            hd = "head" if tensor == "q" else "kv_head"
            dims = ["layer", hd] + (["channel"] if key == "amax" else
                                    [f"{'q' if tensor == 'q' else 'k'}_block"] if key == "block_amax" else [])
        desc = STAT_DEFINITIONS.get(key, "RMS of the float64 reference output" if name == "out_rms" else "")
        if tensor == "v" and key == "block_amax":
            dims = ["layer", "kv_head", "k_block"]
        ds[name] = (dims, arr, {"description": (f"{tensor.upper()}: " if name != key else "") + desc})
    ds.attrs["wall_seconds"] = round(time.perf_counter() - t_start, 3)
    return ds


# --------------------------------------------------------------------------------------------
# ranking and recommendation (read off the measured table)
# --------------------------------------------------------------------------------------------

def rank(ds, *, by: str = "worst", metric: str = "rel_l2", top: int | None = 10) -> list[dict]:
    """(layer, head) pairs, riskiest first: the ``metric`` of variant ``by`` (or the worst variant)."""
    require(metric in RANK_METRICS, f"--rank-metric must be one of {', '.join(RANK_METRICS)}, got {metric!r}")
    labels = [str(v) for v in ds["variant"].values]
    err = ds[metric]
    if by == "worst":
        score = err.max("variant")
    else:
        require(by in labels, f"--rank-by {by!r} is not an audited variant; use worst or one of {', '.join(labels)}")
        score = err.sel(variant=by)
    flat = score.stack(lh=("layer", "head"))
    order = np.argsort(-np.nan_to_num(flat.values, nan=-np.inf), kind="stable")
    if top:
        order = order[:top]
    rows = []
    for rnk, i in enumerate(order, 1):
        layer, head = (int(x) for x in flat["lh"].values[i])
        kvh = int(ds["kv_head_of"].sel(head=head))
        sel, ksel = dict(layer=layer, head=head), dict(layer=layer, kv_head=kvh)
        worst_variant = str(err.sel(**sel).idxmax("variant").values)
        rows.append({
            "rank": rnk, "layer": layer, "head": head, "kv_head": kvh, "score": float(flat.values[i]),
            "worst_variant": worst_variant,
            "errors": {lab: float(err.sel(**sel, variant=lab)) for lab in labels},
            "rmse": {lab: float(ds["rmse"].sel(**sel, variant=lab)) for lab in labels},
            "q_hot": int(ds["q_hot_channel"].sel(**sel)), "q_hot_pair": int(ds["q_hot_pair"].sel(**sel)),
            "q_hot_ratio": float(ds["q_hot_ratio"].sel(**sel)),
            "k_hot": int(ds["k_hot_channel"].sel(**ksel)), "k_hot_pair": int(ds["k_hot_pair"].sel(**ksel)),
            "k_hot_ratio": float(ds["k_hot_ratio"].sel(**ksel)),
            "q_max_over_rms": float(ds["q_max_over_rms"].sel(**sel)),
            "k_max_over_rms": float(ds["k_max_over_rms"].sel(**ksel)),
            "v_max_over_rms": float(ds["v_max_over_rms"].sel(**ksel)),
            "k_mu_max": float(ds["k_mu_max"].sel(**ksel)), "k_mu_rot_max": float(ds["k_mu_rot_max"].sel(**ksel)),
            "q_kurtosis": float(ds["q_kurtosis"].sel(**sel)), "k_kurtosis": float(ds["k_kurtosis"].sel(**ksel)),
            "sink_mass": float(ds["sink_mass"].sel(**sel)), "p_underflow": float(ds["p_underflow"].sel(**sel)),
            "k_block_ratio": float(ds["k_block_ratio"].sel(**ksel)),
        })
    return rows


def cost_order(ds) -> list[str]:
    """Variants cheapest first: by ``cost``, ties in the order given."""
    labels = [str(v) for v in ds["variant"].values]
    costs = [int(c) for c in ds["cost"].values]
    return [lab for _, _, lab in sorted(zip(costs, range(len(labels)), labels))]


def recommend(ds, budget: float, *, metric: str = "rmse") -> dict:
    """Per layer, the cheapest variant whose ``metric`` (max over the layer's heads) is <= ``budget``.

    Returns {"layers": [row per layer], "overall": the cheapest variant meeting the budget in every
    layer (or None), "order": cost order, "metric", "budget"}.
    """
    require(metric in RANK_METRICS, f"--budget-metric must be one of {', '.join(RANK_METRICS)}, got {metric!r}")
    require(math.isfinite(budget) and budget > 0, f"--budget must be a positive number, got {budget}")
    order = cost_order(ds)
    worst = ds[metric].max("head")           # (layer, variant)
    rows = []
    for layer in ds["layer"].values:
        vals = {lab: float(worst.sel(layer=layer, variant=lab)) for lab in order}
        ok = [lab for lab in order if vals[lab] <= budget]
        best = min(vals, key=lambda lab: vals[lab])
        rows.append({"layer": int(layer), "recommended": ok[0] if ok else None, "best": best, "values": vals,
                     "meets": {lab: vals[lab] <= budget for lab in order}})
    overall = None
    for lab in order:
        if all(r["meets"][lab] for r in rows):
            overall = lab
            break
    return {"layers": rows, "overall": overall, "order": order, "metric": metric, "budget": budget}


def check_recommendations(ds, rec: dict) -> list[str]:
    """Problems (empty when consistent): each recommendation meets the budget in the measured
    table and every cheaper variant does not."""
    problems = []
    worst = ds[rec["metric"]].max("head")
    for row in rec["layers"]:
        pick = row["recommended"]
        measured = {lab: float(worst.sel(layer=row["layer"], variant=lab)) for lab in rec["order"]}
        if pick is None:
            if any(v <= rec["budget"] for v in measured.values()):
                problems.append(f"layer {row['layer']}: none recommended but a variant meets the budget")
            continue
        if not measured[pick] <= rec["budget"]:
            problems.append(f"layer {row['layer']}: {pick} measures {measured[pick]:.3g} > budget")
        for lab in rec["order"][:rec["order"].index(pick)]:
            if measured[lab] <= rec["budget"]:
                problems.append(f"layer {row['layer']}: cheaper {lab} also meets the budget")
    return problems


__all__ = ["DEFAULT_VARIANTS", "STAT_DEFINITIONS", "audit", "recipe_cost", "rank", "recommend", "cost_order",
           "check_recommendations"]
