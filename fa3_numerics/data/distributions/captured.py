"""Captured distributions: synthetic Q, K, V at any seqlen with a real model's statistics.

``--dist captured:FILE`` (FILE: a capture from ``fa3-numerics capture``) fits one layer of the
capture and generates float64 Q, K, V that keep what drives FP8 attention error in that model:
its per-channel scales, its outlier channels, its attention-sink tokens and its RoPE structure,
at any sequence length. A 2K-token capture can thus be studied at 32K tokens.

Parameters (registry params, or a suffix on the name: ``captured:FILE@layer=12,block=128``;
``captured:FILE@12`` is short for ``@layer=12``; a suffix wins over the params):

- ``layer`` (default -1): which captured layer to fit; -1 picks the most outlier-heavy layer,
  the one with the largest max|x| / rms(x) over its Q and K heads (``outlier_layer``).
- ``sinks`` (default 4): the first ``sinks`` tokens are kept verbatim at positions 0..sinks-1
  (attention sinks: the first tokens collect much of the attention and have their own K/V
  norms, so they are a fixed template, not resampled).
- ``block`` (default 64): tokens after the sinks are built from blocks of ``block`` consecutive
  captured tokens in random order (a block bootstrap). Blocks keep local structure (a token's
  Q, K, V together, and the short-range patterns of local attention); each block is used once
  per pass over the capture, so at the captured length every token appears exactly once, and
  longer sequences are several independent passes.
- ``rope`` (default 1): 1 un-applies the model's RoPE from Q and K at the captured positions
  and re-applies it at the generated positions, so every token's rotation matches where it
  now sits. Outlier channels of Llama-style models are low-frequency RoPE pairs with a large
  mean, which rotate between the two channels of a pair as positions grow: at 32K tokens
  the generated amax profile shows that rotation, which a 2K capture cannot. Needs the
  capture's ``rope`` metadata with ``rope_type`` default (rotate_half convention, channel c
  paired with c + head_dim/2, as transformers' Llama ``apply_rotary_pos_emb``). 0 moves the
  post-RoPE rows as they are (any model; relative positions are then not consistent).

Why resampling and not a parametric fit: a per-channel Gaussian (mean, std) misses the heavy
tails and the cross-channel structure that set the amax, and the amax sets the FP8 scale. The
fit (``fit_capture``) still reports the parametric summary (per (head, channel) mean and std
of the position-free Q, K and V, outlier channels, sink norms); ``Fit.describe()`` prints it.

Checked (tests/data/test_distributions_captured.py and the audit report): at the captured length,
the per-channel amax profile of Q and K per head is within 10% (relative L2 over channels,
mean over heads) and the audit error of the generated tensors is within 25% of the capture's.

The shape must match the capture (heads, kv_heads, head_dim), and seqlen_k must equal seqlen
(self-attention, as captured). Generation is seeded (``torch.Generator``) and float64 on the
CPU; each batch element is an independent draw.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from . import AttnShape, generator, register
from ...errors import UsageError, require

PARAMS = {
    "layer": (-1.0, "captured layer to fit (-1: the most outlier-heavy layer, by max|x|/rms of Q and K)"),
    "sinks": (4.0, "first tokens kept verbatim at positions 0..sinks-1 (attention sinks)"),
    "block": (64.0, "tokens per resampled block of consecutive captured tokens"),
    "rope": (1.0, "1: un-apply and re-apply RoPE at the generated positions; 0: move post-RoPE rows as they are"),
}

# An outlier channel: |mean| > OUTLIER_Z * std (a rotating bias) or amax > OUTLIER_AMAX x median amax.
OUTLIER_Z = 3.0
OUTLIER_AMAX = 3.0


def _validate(params: dict) -> None:
    for k in ("layer", "sinks", "block", "rope"):
        v = params[k]
        require(math.isfinite(float(v)) and float(v) == int(v), f"captured: {k}={v} must be an integer")
    require(int(params["layer"]) >= -1, f"captured: layer={params['layer']} must be >= 0 (or -1 for automatic)")
    require(int(params["sinks"]) >= 0, f"captured: sinks={params['sinks']} must be >= 0")
    require(int(params["block"]) >= 1, f"captured: block={params['block']} must be >= 1")
    require(int(params["rope"]) in (0, 1), f"captured: rope={params['rope']} must be 0 or 1")


def parse_arg(arg: str) -> tuple[str, dict[str, int]]:
    """``FILE`` or ``FILE@12`` or ``FILE@layer=12,block=128`` -> (FILE, overrides)."""
    require(bool(arg and arg.strip()), "captured: needs a capture file, e.g. --dist captured:capture.safetensors "
            "(make one with `fa3-numerics capture`)")
    path, sep, suffix = arg.rpartition("@")
    if not sep or Path(arg).exists():
        return arg, {}
    over: dict[str, int] = {}
    bad = (f"captured: suffix @{suffix} is not understood; write e.g. captured:FILE@layer=12,block=64 "
           f"(keys: {', '.join(PARAMS)})")
    for part in suffix.split(","):
        part = part.strip()
        key, eq, val = part.partition("=")
        if not eq:
            key, val = "layer", part
        key = key.strip()
        require(key in PARAMS, bad)
        try:
            over[key] = int(val.strip())
        except ValueError:
            raise UsageError(bad) from None
    return path, over


# --------------------------------------------------------------------------------------------
# RoPE (transformers' Llama convention: rotate_half, channel c paired with c + d/2)
# --------------------------------------------------------------------------------------------

def rope_theta(meta: dict) -> float | None:
    """The capture's RoPE base when it is plain (rope_type default), else None."""
    try:
        info = json.loads(meta.get("rope") or "{}")
    except json.JSONDecodeError:
        return None
    if info.get("rope_type", "default") != "default" or "rope_theta" not in info:
        return None
    return float(info["rope_theta"])


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (len(positions), head_dim) in float64, as LlamaRotaryEmbedding lays them out."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos - _rotate_half(x) * sin


# --------------------------------------------------------------------------------------------
# fitting
# --------------------------------------------------------------------------------------------

def outlier_layer(cap) -> int:
    """The layer whose Q or K head has the largest max|x| / rms(x)."""
    best, best_layer = -1.0, cap.layers[0]
    for i in cap.layers:
        for t in (cap.q(i), cap.k(i)):
            r = (t.abs().amax(dim=(1, 2)) / t.pow(2).mean(dim=(1, 2)).sqrt()).max().item()
            if r > best:
                best, best_layer = r, i
    return best_layer


@dataclasses.dataclass
class Fit:
    """One layer of a capture, ready to generate from."""

    path: str
    layer: int
    model: str
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    theta: float | None        # RoPE base used to re-position (None: rows moved as they are)
    sinks: int
    q: torch.Tensor            # (heads, tokens, d): position-free (RoPE un-applied) when theta
    k: torch.Tensor            # (kv_heads, tokens, d)
    v: torch.Tensor            # (kv_heads, tokens, d)
    # parametric summary over non-sink tokens: per (head, channel) mean and std
    mean: dict[str, torch.Tensor]
    std: dict[str, torch.Tensor]
    outliers: dict[str, list[tuple[int, int]]]   # tensor -> [(head, channel)]
    sink_norm_ratio: dict[str, torch.Tensor]     # tensor -> (heads,) mean sink-token norm / median token norm
    # (heads, tokens, d): dL/dO as recorded by `capture --grads` (None without); O is not rotated, so
    # dO rows move with their tokens unchanged
    do: torch.Tensor | None = None
    loss: str = ""                               # what the loss was, for the dataset's do_source

    def describe(self) -> str:
        lines = [f"captured layer {self.layer} of {self.model} ({self.tokens} tokens, {self.heads} heads, "
                 f"{self.kv_heads} KV heads, head dim {self.head_dim}); "
                 + (f"RoPE theta {self.theta:g} re-applied" if self.theta else "post-RoPE rows moved as they are")
                 + f"; {self.sinks} sink tokens kept"]
        for name in ("q", "k", "v"):
            outs = self.outliers[name]
            shown = ", ".join(f"h{h}:c{c}" for h, c in outs[:8]) + (" ..." if len(outs) > 8 else "")
            lines.append(f"  {name.upper()}: {len(outs)} outlier channels ({shown or 'none'}); sink/median norm "
                         + ", ".join(f"{x:.2f}" for x in self.sink_norm_ratio[name].tolist()))
        return "\n".join(lines)


_FITS: dict[tuple, Fit] = {}
_FITS_SIZE = 4


def fit_capture(path: str | os.PathLike, layer: int = -1, sinks: int = 4, rope: bool = True, cap=None) -> Fit:
    """Fit one layer of a capture (cached per file version and parameters)."""
    from ..capture import load_capture

    p = Path(path)
    require(not p.is_dir(), f"captured: capture file {path} is a folder; pass a .safetensors file from "
            "`fa3-numerics capture`")
    require(p.is_file(), f"captured: capture file {path} not found; make one with "
            f"`fa3-numerics capture --out {path}`")
    st = p.stat()
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size, int(layer), int(sinks), bool(rope))
    if key in _FITS:
        return _FITS[key]
    cap = cap if cap is not None else load_capture(p)
    if layer < 0:
        layer = outlier_layer(cap)
    require(layer in cap.layers, f"captured: layer {layer} is not in {path} (layers "
            f"{_ranges(cap.layers)}); pass one of those, e.g. captured:{path}@{cap.layers[0]}")
    q, k, v = cap.qkv(layer)
    n, d = cap.tokens, cap.head_dim
    theta = None
    if rope:
        theta = rope_theta(cap.meta)
        require(theta is not None, f"captured: {path} has RoPE metadata {cap.meta.get('rope')!r}, not plain "
                f"rotate_half RoPE with rope_theta; use captured:{path}@rope=0 to move post-RoPE rows as they are")
        require(d % 2 == 0, f"captured: head dim {d} is odd, RoPE needs an even head dim; use @rope=0")
        cos, sin = rope_tables(torch.arange(n), d, theta)
        q, k = unapply_rope(q, cos, sin), unapply_rope(k, cos, sin)
    require(int(sinks) <= n, f"captured: sinks={int(sinks)} exceeds the capture's {n} tokens; use @sinks={n} or fewer")
    s = int(sinks)
    mean, std, outliers, sink_ratio = {}, {}, {}, {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        body = t[:, s:] if n - s >= 2 else t
        mean[name], std[name] = body.mean(dim=1), body.std(dim=1)
        amax = body.abs().amax(dim=1)
        z = mean[name].abs() / std[name].clamp_min(1e-30)
        hot = (z > OUTLIER_Z) | (amax > OUTLIER_AMAX * amax.median(dim=1, keepdim=True).values)
        outliers[name] = [tuple(x) for x in hot.nonzero().tolist()]
        norms = t.norm(dim=-1)
        sink_ratio[name] = (norms[:, :s].mean(dim=1) / norms.median(dim=1).values) if s else torch.ones(t.shape[0])
    do = cap.do(layer) if cap.has_grads else None
    loss = f"{cap.grads.get('loss', '')} (loss {cap.grads.get('loss_value')})" if cap.has_grads else ""
    fit = Fit(str(p), layer, cap.meta.get("model", "?"), n, cap.heads, cap.kv_heads, d, theta, s, q, k, v,
              mean, std, outliers, sink_ratio, do, loss)
    while len(_FITS) >= _FITS_SIZE:
        _FITS.pop(next(iter(_FITS)))
    _FITS[key] = fit
    return fit


def _ranges(layers: list[int]) -> str:
    from ..capture import layer_ranges

    return layer_ranges(layers)


# --------------------------------------------------------------------------------------------
# generating
# --------------------------------------------------------------------------------------------

def source_index(n_cap: int, n_out: int, sinks: int, block: int, g: torch.Generator) -> torch.Tensor:
    """Captured token index for each generated position: sinks verbatim, then shuffled blocks."""
    s = min(sinks, n_cap, n_out)
    parts = [torch.arange(s)]
    need = n_out - s
    pool = n_cap - s
    if need > 0:
        require(pool > 0, f"captured: the capture has only {n_cap} tokens, all sinks; use fewer sinks (@sinks=0)")
        nb = -(-pool // block)
        got = 0
        while got < need:
            for b in torch.randperm(nb, generator=g).tolist():
                s0 = s + b * block
                s1 = min(n_cap, s0 + block)
                parts.append(torch.arange(s0, s1))
                got += s1 - s0
                if got >= need:
                    break
    return torch.cat(parts)[:n_out]


def generate_from_fit(fit: Fit, shape: AttnShape, seed: int, block: int = 64, with_do: bool = False):
    """(Q, K, V) at ``shape`` from the fit; ``with_do``: (Q, K, V, dO), dO the recorded rows of the same
    tokens (the fit must hold dO)."""
    need = f"--heads {fit.heads} --kv-heads {fit.kv_heads} --head-dim {fit.head_dim}"
    require((shape.heads, shape.kv_heads, shape.head_dim) == (fit.heads, fit.kv_heads, fit.head_dim),
            f"captured: {Path(fit.path).name} has {fit.heads} heads, {fit.kv_heads} KV heads, head dim "
            f"{fit.head_dim}; the run asks for {shape.heads}, {shape.kv_heads}, {shape.head_dim}: pass {need}")
    require(shape.seqlen_k == shape.seqlen, "captured: seqlen_k must equal seqlen (self-attention, as captured)")
    g = generator(seed)
    n = shape.seqlen
    if fit.theta is not None:
        cos, sin = rope_tables(torch.arange(n), fit.head_dim, fit.theta)
    require(not with_do or fit.do is not None, f"captured: {Path(fit.path).name} holds no gradients; recapture "
            "it with `fa3-numerics capture --grads`")
    qs, ks, vs, dos = [], [], [], []
    for _ in range(shape.batch):
        idx = source_index(fit.tokens, n, fit.sinks, int(block), g)
        q, k, v = fit.q[:, idx], fit.k[:, idx], fit.v[:, idx]
        if fit.theta is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        if with_do:
            dos.append(fit.do[:, idx])
    out = (torch.stack(qs).contiguous(), torch.stack(ks).contiguous(), torch.stack(vs).contiguous())
    return out + (torch.stack(dos).contiguous(),) if with_do else out


def _fit_for(shape: AttnShape, layer, sinks, block, rope, arg) -> tuple[Fit, int]:
    path, over = parse_arg(arg)
    params = {"layer": layer, "sinks": sinks, "block": block, "rope": rope} | over
    _validate(params)
    # Sinks beyond the sequence would be cut silently: the recorded sinks= would not be the one used.
    require(int(params["sinks"]) <= shape.seqlen, f"captured: sinks={int(params['sinks'])} exceeds seqlen "
            f"{shape.seqlen}; use @sinks={shape.seqlen} or fewer")
    fit = fit_capture(path, layer=int(params["layer"]), sinks=int(params["sinks"]), rope=bool(int(params["rope"])))
    return fit, int(params["block"])


def captured_do(shape: AttnShape, seed: int, *, layer: float, sinks: float, block: float, rope: float, arg: str = ""):
    """The recorded dO rows of the tokens ``captured`` places at each position (a capture made with
    --grads), or None. At the captured length in captured order they are the gradient itself; resampled,
    each row is a real gradient moved with its token, not the gradient at its new position."""
    fit, blk = _fit_for(shape, layer, sinks, block, rope, arg)
    if fit.do is None:
        return None
    do = generate_from_fit(fit, shape, seed, block=blk, with_do=True)[3]
    return do, (f"captured: dL/dO of {fit.loss} recorded by `capture --grads`, rows moved with their tokens "
                "(sinks kept, blocks resampled)")


@register(
    "captured:",
    description="a real model's Q, K, V at any seqlen: one layer of a capture (captured:FILE), sink tokens "
                "kept, blocks of tokens resampled, RoPE re-applied at the new positions",
    params=PARAMS,
    validate=_validate,
    grads=captured_do,
)
def captured(shape: AttnShape, seed: int, *, layer: float, sinks: float, block: float, rope: float, arg: str = ""):
    fit, blk = _fit_for(shape, layer, sinks, block, rope, arg)
    return generate_from_fit(fit, shape, seed, block=blk)


# --------------------------------------------------------------------------------------------
# checking a fit against its capture
# --------------------------------------------------------------------------------------------

def amax_profile_distance(want: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(heads, seq, d) tensors -> (relative L2 distance of the per-channel amax profiles, mean over
    heads; largest relative deviation of a head's hottest channel)."""
    a, b = want.abs().amax(dim=1), got.abs().amax(dim=1)
    dist = ((b - a).norm(dim=1) / a.norm(dim=1)).mean().item()
    hot = a.argmax(dim=1, keepdim=True)
    hot_dev = ((b.gather(1, hot) - a.gather(1, hot)).abs() / a.gather(1, hot)).max().item()
    return dist, hot_dev


def check_against_capture(path: str | os.PathLike, layer: int, *, seed: int = 1, block: int = 64, sinks: int = 4,
                          variants=("baseline-fp8", "fa3-fp8", "fa3-fp8-no-block-quant", "fa3-fp8-no-incoherent"),
                          rows: int = 0) -> dict:
    """Generate one draw at the captured length and compare it with the captured layer: amax profiles
    of Q and K, and the RMSE (pooled over heads) of each variant against float64 on both."""
    from ..capture import load_capture
    from ..sampling import query_rows
    from ...numerics.emulator import emulate
    from ...numerics.metrics import per_sample, pooled
    from ...numerics.recipe import parse_recipes
    from ...numerics.reference import reference_attention

    cap = load_capture(path)
    fit = fit_capture(path, layer=layer, sinks=sinks, rope=True, cap=cap)
    shape = AttnShape(1, cap.heads, cap.tokens, cap.head_dim, kv_heads=cap.kv_heads)
    gq, gk, gv = generate_from_fit(fit, shape, seed, block=block)
    real = tuple(t.unsqueeze(0) for t in cap.qkv(fit.layer))
    n = cap.tokens
    q_index = query_rows(n, rows, seed)
    recipes = parse_recipes(";".join(variants))

    def rmse(q, k, v):
        ref = reference_attention(q, k, v, causal=cap.causal, softmax_scale=cap.scale, q_index=q_index)
        cache: dict = {}
        return {lab: pooled("rmse", per_sample(emulate(r, q, k, v, causal=cap.causal, softmax_scale=cap.scale,
                                                      q_index=q_index, rotation_seed=seed, cache=cache), ref)["rmse"])
                for lab, r in recipes}

    q_dist, q_hot = amax_profile_distance(real[0][0], gq[0])
    k_dist, k_hot = amax_profile_distance(real[1][0], gk[0])
    want, got = rmse(*real), rmse(gq, gk, gv)
    return {"layer": fit.layer, "seed": seed, "block": block, "sinks": sinks, "tokens": n, "rows": int(q_index.numel()),
            "q_profile": q_dist, "k_profile": k_dist, "q_hot_dev": q_hot, "k_hot_dev": k_hot,
            "rmse_capture": want, "rmse_generated": got,
            "ratio": {lab: got[lab] / want[lab] for lab in want}}
