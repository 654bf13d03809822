"""A few rows of a dumped SageAttention2 head as a small regression fixture for the sage2-sm90 preset.

A causal query row r of the sm90 kernel sees only the keys of the tiles its 64-query CTA visits
(up to 128 ceil(64 (r // 64 + 1) / 128)); the keys past them reach it through two whole-sequence
statistics alone: K's token mean (smoothing) and V's per-channel amax (its FP8 scale). So the rows'
output is kept exactly when those keys are replaced by a stand-in that preserves both: K by one
FP16 vector repeated and a last one that makes the FP16 mean of all keys the original's in every channel,
V by one row holding, per channel, the largest-magnitude value of the keys replaced, then zeros.
Q rows outside the kept warp slices are zero (their per-thread scales are their own).

Reads a dump of ``tools/device/dump_sage.py`` (``NAME/hH/q,k,v,o_kernel,meta``), writes
``q`` (the kept rows), ``k``/``v`` (the visited keys), ``k_rest`` (the repeated key, the last key),
``v_rest``, ``o_kernel`` (the
kept rows), ``rows`` and ``meta``. It checks, before writing, that the preset's emulation of the
kept rows on the rebuilt inputs equals its emulation on the whole dumped head bit for bit::

    python3 tools/sage2_fixture.py DUMP.npz NAME/hH FIRST_ROW LAST_ROW OUT.npz
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch


def rebuild(fx: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixture's whole-sequence Q, K, V ([1, 1, N, D] float64 holding FP16 values)."""
    n = int(json.loads(str(fx["meta"]))["seqlen"])
    rows = fx["rows"].astype(np.int64)
    nk = fx["k"].shape[0]
    d = fx["q"].shape[1]
    q = np.zeros((n, d), np.float16)
    q[rows] = fx["q"]
    c1, c2 = fx["k_rest"]
    k = np.concatenate([fx["k"], np.repeat(c1[None], n - nk - 1, 0), c2[None]])
    v = np.zeros((n, d), np.float16)
    v[:nk] = fx["v"]
    v[nk] = fx["v_rest"]
    t = lambda x: torch.from_numpy(x.astype(np.float64))[None, None]  # noqa: E731
    return t(q), t(k), t(v)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 5:
        print("usage: sage2_fixture.py DUMP.npz NAME/hH FIRST_ROW LAST_ROW OUT.npz", file=sys.stderr)
        return 2
    dump, head, r0, r1, out = argv[0], argv[1], int(argv[2]), int(argv[3]), Path(argv[4])
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe
    from fa3_numerics.numerics.sage_quant import input_round

    z = np.load(dump)
    meta = json.loads(str(z[head + "/meta"]))
    if not meta["causal"] or meta["inp"] != "fp16":
        print("error: the stand-in keys need a causal FP16 case", file=sys.stderr)
        return 2
    q, k, v = (z[f"{head}/{x}"] for x in ("q", "k", "v"))
    n = q.shape[0]
    rows = np.arange(r0 // 16 * 16, (r1 // 16 + 1) * 16)  # whole warp slices: their Q scale groups
    nk = min(n, -(-min(n, 64 * (r1 // 64 + 1)) // 128) * 128)
    rest = k[nk:].astype(np.float64)
    km = input_round(torch.from_numpy(k.astype(np.float64)).mean(0), "fp16")
    # all but the last replaced key take the mean of those keys; the last absorbs what FP16 loses
    c1 = rest.mean(0).astype(np.float16)
    c2 = torch.from_numpy(rest.sum(0) - (n - nk - 1) * c1.astype(np.float64)).to(torch.float16)
    for _ in range(64):  # nudge the last key by FP16 ulps until every channel's mean rounds alike
        stand = np.concatenate([np.repeat(c1[None], n - nk - 1, 0), c2.numpy()[None]])
        diff = input_round(torch.from_numpy(np.concatenate([k[:nk], stand]).astype(np.float64)).mean(0), "fp16") - km
        if not bool(diff.any()):
            break
        c2 = torch.where(diff > 0, torch.nextafter(c2, torch.tensor(-np.inf, dtype=torch.float16)),
                         torch.where(diff < 0, torch.nextafter(c2, torch.tensor(np.inf, dtype=torch.float16)), c2))
    else:
        print("error: no FP16 stand-in keeps the K mean", file=sys.stderr)
        return 1
    vr = v[nk:]
    v_rest = vr[np.abs(vr.astype(np.float64)).argmax(0), np.arange(v.shape[1])]
    fx = {"q": q[rows], "k": k[:nk], "v": v[:nk], "k_rest": np.stack([c1, c2.numpy()]), "v_rest": v_rest,
          "o_kernel": z[head + "/o_kernel"][rows], "rows": rows.astype(np.int32),
          "meta": np.array(json.dumps({**meta, "source": f"{Path(dump).name}:{head}"}))}
    r = Recipe.from_str(meta["spec"].replace(",rot=hadamard", ""))
    idx = torch.from_numpy(rows)
    whole = [torch.from_numpy(z[f"{head}/{x}"].astype(np.float64))[None, None] for x in ("q", "k", "v")]
    a = emulate(r, *whole, causal=True, softmax_scale=meta["softmax_scale"], q_index=idx)
    b = emulate(r, *rebuild(fx), causal=True, softmax_scale=meta["softmax_scale"], q_index=idx)
    if not torch.equal(a, b):
        print("error: the rebuilt inputs change the emulated rows", file=sys.stderr)
        return 1
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **fx)
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size} bytes): rows {rows[0]}-{rows[-1]}, keys 0-{nk - 1} of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
