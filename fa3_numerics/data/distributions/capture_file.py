"""``capture-file:PATH``: a capture file's recorded post-RoPE Q, K, V as data, unchanged.

Unlike ``captured:`` (a generator fitted to a capture, at any length), this returns the
recorded tensors themselves: the first ``seqlen`` tokens of layer ``layer``.

- K/V with one head per query head (``kv_heads == heads``): batch element b of seed s takes
  the query heads starting at ((s * batch + b) * heads) mod H, wrapping, each with its own K/V
  head expanded (the ablation samples heads this way);
- the capture's own layout (``heads`` and ``kv_heads`` as captured, batch 1): every head as
  recorded, K/V keeping their KV heads (GQA), as the kernel saw them (``validate``).
"""

from __future__ import annotations

import functools

import torch

from ...errors import require
from . import AttnShape, register


@functools.lru_cache(maxsize=4)
def _capture(path: str):
    from ..capture import load_capture

    return load_capture(path)


def capture_info(path: str) -> tuple[int, int]:
    """(tokens, head_dim) of a capture file."""
    cap = _capture(path)
    return cap.tokens, cap.head_dim


def _heads(shape: AttnShape, seed: int, h: int, hkv: int) -> list[tuple[list[int], list[int]]] | None:
    """Per batch element, (query heads, their K/V heads) that ``capture_file`` takes; None: the
    capture's own layout (every head as recorded)."""
    if shape.kv_heads != shape.heads:
        return None
    group = h // hkv
    out = []
    for b in range(shape.batch):
        start = (seed * shape.batch + b) * shape.heads
        idx = [(start + i) % h for i in range(shape.heads)]
        out.append((idx, [i // group for i in idx]))
    return out


def capture_file_do(shape: AttnShape, seed: int, *, layer: float, arg: str):
    """The recorded dO of the heads and tokens ``capture_file`` takes (a capture made with --grads), or None."""
    cap = _capture(arg)
    if not cap.has_grads:
        return None
    do = cap.do(int(layer))
    picks = _heads(shape, seed, cap.heads, cap.kv_heads)
    if picks is None:
        out = do[None, :, : shape.seqlen]
    else:
        out = torch.stack([do[idx, : shape.seqlen] for idx, _ in picks])
    g = cap.grads
    return out.to(torch.float64), (f"captured: dL/dO of {g.get('loss', 'the loss')} (loss {g.get('loss_value')}), "
                                   f"recorded by `capture --grads` for these tokens")


@register(
    "capture-file:",
    description="a capture file's recorded post-RoPE Q, K, V (capture-file:PATH); seed and batch pick the heads",
    params={"layer": (0, "layer of the capture file")},
    grads=capture_file_do,
)
def capture_file(shape: AttnShape, seed: int, *, layer: float, arg: str):
    cap = _capture(arg)
    require(int(layer) in cap.layers, f"capture-file: layer {int(layer)} is not in {arg} (layers {cap.layers})")
    q, k, v = cap.qkv(int(layer))
    h, n, d = q.shape
    hkv = k.shape[0]
    require(shape.seqlen <= n and shape.head_dim == d,
            f"capture {arg} has {n} tokens of head dim {d}; the cell asks for seqlen {shape.seqlen}, "
            f"head dim {shape.head_dim}")
    if shape.kv_heads != shape.heads:
        require((shape.heads, shape.kv_heads, shape.batch) == (h, hkv, 1),
                f"capture-file: with grouped K/V heads give the capture's own layout: batch 1, {h} heads, "
                f"{hkv} KV heads")
        return tuple(t[None, :, : shape.seqlen].to(torch.float64) for t in (q, k, v))
    qs, ks, vs = [], [], []
    for idx, kv_idx in _heads(shape, seed, h, hkv):
        qs.append(q[idx, : shape.seqlen])
        ks.append(k[kv_idx, : shape.seqlen])
        vs.append(v[kv_idx, : shape.seqlen])
    return tuple(torch.stack(t).to(torch.float64) for t in (qs, ks, vs))
