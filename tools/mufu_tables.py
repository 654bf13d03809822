"""The GPU's special-function outputs recorded by tools/device/mufu_probe.py, decoded and checked
against candidate bit-exact models (phase 1 of modelling ``ex2/lg2/rcp.approx.ftz.f32``).

The probe stores each exhaustive grid as the signed distance in float32 ulps (on the ordered
integer line of float32 bit patterns, so it is exact for any pattern) from a reference: float64
exp2/log2/reciprocal rounded to float32 to nearest. Decoding recomputes that reference here with
numpy, patches the few inputs whose float64 value lies so near a float32 rounding midpoint that two
float64 libraries could round it differently (the probe stores their reference bits), and checks
the decoded outputs against the probe's SHA-256 of them: a table that does not decode exactly is an
error, never a silent approximation. Random samples are stored as raw input and output bits.

Printed: per grid, the ulp-error histogram; for ex2, whether the grid's outputs depend only on the
input truncated or rounded to F fraction bits; for the random samples, how many outputs equal the
grid's value under each candidate reduction (ex2: x -> integer part + F-bit fraction by floor,
truncation or round-to-nearest; lg2: exponent + the mantissa's grid value, rounded to float32 by
RN or RZ, with the mantissa re-centred at c; rcp: the mantissa's grid value scaled by 2^-e)::

    python3 tools/mufu_tables.py DIR      # DIR: the probe's --out folder (mufu.json and its .npz)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ESC = -128  # int8 code of "the distance is in the exceptions list"
TIE_REL = 2.0 ** -40  # float64 values this near a float32 rounding midpoint: reference bits stored


# -- exact codecs ---------------------------------------------------------------------------------

def ordered(bits: np.ndarray) -> np.ndarray:
    """uint32 float32 patterns -> int64 on a line where adjacent floats differ by 1 (+0 -> 0,
    -0 -> -1): a bijection of all 2^32 patterns, NaNs included, so distances decode exactly."""
    i = np.ascontiguousarray(bits, dtype=np.uint32).view(np.int32)
    return (i ^ ((i >> 31) & 0x7FFFFFFF)).astype(np.int64)  # negative: -1 - magnitude


def unordered(o: np.ndarray) -> np.ndarray:
    """The inverse of ``ordered`` (values outside int32 are not float32 patterns: an error)."""
    o = np.asarray(o, dtype=np.int64)
    if o.size and (o.min() < -(2 ** 31) or o.max() >= 2 ** 31):
        raise ValueError("ordered value outside the float32 patterns")
    i = o.astype(np.int32)
    return (i ^ ((i >> 31) & 0x7FFFFFFF)).view(np.uint32)


def encode_ulps(out_bits: np.ndarray, ref_bits: np.ndarray) -> dict[str, np.ndarray]:
    """Distances out - ref in ulps: int8, with ESC marking those stored in (exc_idx, exc_val)."""
    d = ordered(out_bits) - ordered(ref_bits)
    big = np.abs(d) > 127
    code = np.where(big, ESC, d).astype(np.int8)
    idx = np.flatnonzero(big)
    return {"code": code, "exc_idx": idx.astype(np.uint32), "exc_val": d[idx].astype(np.int64)}


def decode_ulps(rec: dict, ref_bits: np.ndarray) -> np.ndarray:
    d = np.asarray(rec["code"]).astype(np.int64)
    if np.count_nonzero(d == ESC) != len(rec["exc_idx"]):
        raise ValueError("escape codes and exception list disagree")
    d[np.asarray(rec["exc_idx"], dtype=np.int64)] = rec["exc_val"]
    return unordered(ordered(ref_bits) + d)


def sha(bits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(bits, dtype=np.uint32).tobytes()).hexdigest()


def f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits_of(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


# -- grids: inputs and references (the probe and this reader build them with the same code) -------

REF_FN = {"ex2": np.exp2, "lg2": np.log2, "rcp": lambda x: 1.0 / x}
REF_METHOD = ("float64 value (numpy exp2 / log2 / 1.0/x on float32 inputs widened exactly; on the device "
              "torch float64 on CUDA), rounded to float32 to nearest-even; inputs within 2^-40 relative "
              "of a float32 rounding midpoint have their reference bits stored")


def grid_inputs(name: str, g: int) -> np.ndarray:
    """uint32 input bits of grid ``name`` at resolution g (24 on the device): ex2_pos k/2^g for k in
    [0, 2^g), ex2_neg -k/2^g for k in (0, 2^g], and the float32 values of [1, 2) (lg2_hi, rcp) or
    [0.5, 1) (lg2_lo) at mantissa step 2^max(0, 23 - g): all of them when g >= 23."""
    if name in ("ex2_pos", "ex2_neg"):
        k = np.arange(2 ** g, dtype=np.int64) + (name == "ex2_neg")
        x = (k.astype(np.float64) / 2.0 ** g).astype(np.float32)  # exact: k < 2^24
        return bits_of(-x if name == "ex2_neg" else x)
    step = 2 ** max(0, 23 - g)
    base = {"lg2_hi": 0x3F800000, "rcp": 0x3F800000, "lg2_lo": 0x3F000000}[name]
    return (base + np.arange(0, 2 ** 23, step, dtype=np.int64)).astype(np.uint32)


def ref_float64_to_bits(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 RN of float64 values, and the mask of those near a float32 rounding midpoint (the
    RN of r(1 - 2^-40) and r(1 + 2^-40) differ)."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = r.astype(np.float32)
        near = (r * (1 - TIE_REL)).astype(np.float32) != (r * (1 + TIE_REL)).astype(np.float32)
    return bits_of(y), near & np.isfinite(r)


def grid_reference(op: str, in_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(divide="ignore"):
        return ref_float64_to_bits(REF_FN[op](f32(in_bits).astype(np.float64)))


# -- loading ----------------------------------------------------------------------------------------

def load(folder: Path) -> tuple[dict, dict[str, dict], dict[str, dict]]:
    """(meta, grids name -> {in, out, ...}, samples name -> {in, out, variants}) with every grid
    decoded and checked against the probe's SHA-256."""
    folder = Path(folder)
    meta = json.loads((folder / "mufu.json").read_text())
    arrays: dict[str, np.ndarray] = {}
    for f in meta["files"]:
        with np.load(folder / f) as z:
            arrays.update({k: z[k] for k in z.files})
    g = meta["grid_bits"]
    grids = {}
    for name, gm in meta["grids"].items():
        ib = grid_inputs(name, g)
        ref, _ = grid_reference(gm["op"], ib)
        ti = arrays[f"{name}/tie_idx"].astype(np.int64)
        ref[ti] = arrays[f"{name}/tie_ref"]
        rec = {k: arrays[f"{name}/{k}"] for k in ("code", "exc_idx", "exc_val")}
        out = decode_ulps(rec, ref)
        if sha(out) != gm["out_sha256"]:
            raise SystemExit(f"error: grid {name} does not decode to the recorded outputs (SHA-256 differs; "
                             f"{len(ti)} near-tie references patched): this machine's float64 {gm['op']} "
                             "disagrees with the device's beyond the tie margin")
        entry = {"in": ib, "out": out, "ref": ref, "op": gm["op"], "variants": {}}
        for vname in gm.get("variants", {}):
            vrec = {k: arrays[f"{name}/{vname}/{k}"] for k in ("code", "exc_idx", "exc_val")}
            entry["variants"][vname] = decode_ulps(vrec, out)
        grids[name] = entry
    samples = {}
    for name, sm in meta["samples"].items():
        ib, ob = arrays[f"samples_{name}/in"], arrays[f"samples_{name}/out"]
        if sha(ob) != sm["out_sha256"]:
            raise SystemExit(f"error: samples {name}: stored outputs do not match the recorded SHA-256")
        var = {}
        for vname in sm.get("variants", {}):
            rec = {k: arrays[f"samples_{name}/{vname}/{k}"] for k in ("code", "exc_idx", "exc_val")}
            var[vname] = decode_ulps(rec, ob)
        samples[name] = {"in": ib, "out": ob, "op": sm["op"], "variants": var}
    return meta, grids, samples


# -- summaries and model checks --------------------------------------------------------------------

def histogram(d: np.ndarray, top: int = 9) -> str:
    vals, counts = np.unique(d, return_counts=True)
    order = np.argsort(-counts)[:top]
    body = ", ".join(f"{int(vals[i]):+d}: {int(counts[i])}" for i in sorted(order, key=lambda i: vals[i]))
    return f"[{int(d.min()):+d}, {int(d.max()):+d}] {body}"


def ldexp_ftz(y: np.ndarray, e: np.ndarray, mode: str = "rn") -> np.ndarray:
    """float32 y * 2^e (float64 exact, then to float32 by ``mode``), subnormal results flushed to
    zero as the .ftz instructions do."""
    v = np.ldexp(y.astype(np.float64), e.astype(np.int64))
    r = to_f32(v, mode)
    return np.where(np.abs(r) < np.float32(2.0 ** -126), np.float32(0) * r, r)


def to_f32(v: np.ndarray, mode: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        r = v.astype(np.float32)
        if mode == "rz":
            over = np.abs(r.astype(np.float64)) > np.abs(v)
            r = np.where(over, np.nextafter(r, np.float32(0)), r)
    return r


def ex2_model(x: np.ndarray, pos: np.ndarray, neg: np.ndarray, g: int, f: int, rule: str) -> np.ndarray:
    """ex2 of float32 x from the grids: n = x * 2^f made an integer by ``rule`` (floor, trunc toward
    zero, rn), then 2^(n >> f) times the grid value at the f-bit fraction (negative fractions from
    the ex2_neg grid, which trunc produces for x < 0)."""
    v = x.astype(np.float64) * 2.0 ** f
    with np.errstate(invalid="ignore", over="ignore"):
        n = {"floor": np.floor, "trunc": np.trunc, "rn": np.rint}[rule](np.nan_to_num(v, posinf=2 ** 40,
                                                                                      neginf=-2 ** 40))
    n = np.clip(n, -(2 ** 40), 2 ** 40).astype(np.int64)
    i = np.where(n >= 0, n >> f, -((-n) >> f))  # trunc: integer part toward zero
    if rule != "trunc":
        i = n >> f  # floor division: fraction in [0, 1)
    frac = n - (i << f)  # in [0, 2^f) or, for trunc of x < 0, in (-2^f, 0]
    k = frac << (g - f)
    table = np.where(k >= 0, pos[np.clip(k, 0, len(pos) - 1)], neg[np.clip(-k - 1, 0, len(neg) - 1)])
    table = np.where(k == 0, np.float32(1.0), table)
    return ldexp_ftz(table, i)


def check_ex2(grids, samples, g, out=print) -> None:
    pos, neg = f32(grids["ex2_pos"]["out"]), f32(grids["ex2_neg"]["out"])
    po = grids["ex2_pos"]["out"]
    k = np.arange(len(po), dtype=np.int64)
    out("ex2 grid: does the output depend only on k/2^g cut to F fraction bits? (share of grid points equal)")
    for f in range(max(1, g - 4), g + 1):
        s = g - f
        kt = (k >> s) << s
        kr = (k + (1 << s >> 1)) >> s << s  # half up; k = 2^g is ex2(1) = 2 ex2(0)
        ext = np.append(po, bits_of(np.float32(2) * pos[:1]))
        out(f"  F={f}: truncate {np.mean(po[kt] == po):.6f}, round {np.mean(ext[kr] == po):.6f}")
    floor_pred = pos[::-1] / np.float32(2)  # ex2(-j/2^g) = ex2(1 - j/2^g) / 2, j = 1 .. 2^g
    out(f"  ex2_neg equals ex2_pos shifted (floor reduction): "
        f"{np.mean(bits_of(floor_pred) == grids['ex2_neg']['out']):.6f}")
    s = samples.get("ex2")
    if s is None:
        return
    x, y = f32(s["in"]), s["out"]
    ok = np.isfinite(x)
    regions = {"all": ok, "x<0": ok & (x < 0), "x>=0": ok & (x >= 0), "|x|<2^-20": ok & (np.abs(x) < 2.0 ** -20),
               "x<-126": ok & (x < -126)}
    out(f"ex2 random samples ({len(x)}): outputs equal to the grid model, by region " +
        " ".join(f"{r}={int(m.sum())}" for r, m in regions.items()))
    for f in range(max(1, g - 4), g + 1):
        for rule in ("floor", "trunc", "rn"):
            eq = bits_of(ex2_model(x, pos, neg, g, f, rule)) == y
            out(f"  F={f} {rule:5s}: " + " ".join(f"{r} {np.mean(eq[m]) if m.any() else float('nan'):.6f}"
                                                  for r, m in regions.items()))


def check_lg2(grids, samples, out=print) -> None:
    s = samples.get("lg2")
    if s is None:
        return
    hi, lo = f32(grids["lg2_hi"]["out"]), f32(grids["lg2_lo"]["out"])
    step = 2 ** 23 // len(hi)
    b = s["in"].astype(np.int64)
    e = ((b >> 23) & 0xFF) - 127
    m_idx = (b & 0x7FFFFF) // step
    on_grid = ((b & 0x7FFFFF) % step == 0) & (e > -127) & (e < 128) & (b >> 31 == 0)
    mant = 1.0 + (b & 0x7FFFFF) / 2.0 ** 23
    out(f"lg2 random samples ({len(b)}, {int(on_grid.sum())} normal positive on the grid's mantissas): "
        "outputs equal to round(e + grid value), mantissa re-centred at c")
    for c in (2.0, 1.5, float(np.sqrt(2)), 4 / 3):
        hi_side = mant < c
        table = np.where(hi_side, hi[np.clip(m_idx, 0, len(hi) - 1)], lo[np.clip(m_idx, 0, len(lo) - 1)])
        ee = np.where(hi_side, e, e + 1)
        v = ee.astype(np.float64) + table.astype(np.float64)
        for mode in ("rn", "rz"):
            eq = bits_of(to_f32(v, mode)) == s["out"]
            out(f"  c={c:.4f} {mode}: {np.mean(eq[on_grid]):.6f}")
    # The grid's own consistency: lg2(m/2) = -1 + lg2(m)?
    for mode in ("rn", "rz"):
        pred = to_f32(hi.astype(np.float64) - 1.0, mode)
        out(f"  lg2_lo == {mode}(lg2_hi - 1): {np.mean(bits_of(pred) == grids['lg2_lo']['out']):.6f}")


def check_rcp(grids, samples, out=print) -> None:
    s = samples.get("rcp")
    if s is None or "rcp" not in grids:
        return
    t = f32(grids["rcp"]["out"])
    step = 2 ** 23 // len(t)
    b = s["in"].astype(np.int64)
    e = ((b >> 23) & 0xFF) - 127
    m = b & 0x7FFFFF
    ok = (m % step == 0) & (e > -127) & (e < 128)
    sign = np.where(b >> 31 == 1, np.float32(-1), np.float32(1))
    pred = ldexp_ftz(sign * t[np.clip(m // step, 0, len(t) - 1)], -e)
    eq = bits_of(pred) == s["out"]
    out(f"rcp random samples ({len(b)}, {int(ok.sum())} normal on the grid's mantissas): equal to "
        f"sign * grid(mantissa) * 2^-e (ftz): {np.mean(eq[ok]) if ok.any() else float('nan'):.6f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="the probe's --out folder")
    args = ap.parse_args(argv)
    if not (args.folder / "mufu.json").is_file():
        print(f"error: no mufu.json in {args.folder}", file=sys.stderr)
        return 2
    np.seterr(all="ignore")  # the models meet inf/NaN inputs on purpose; the comparisons count them
    meta, grids, samples = load(args.folder)
    print(f"{args.folder}: {'DRY (CPU stand-in, not the GPU)' if meta['dry'] else meta['device'].get('gpu')}, "
          f"grid 2^{meta['grid_bits']}; reference: {meta['reference']}")
    for name, gr in grids.items():
        d = ordered(gr["out"]) - ordered(gr["ref"])
        print(f"grid {name} ({gr['op']}, {len(d)}): ulps vs RN reference {histogram(d)}")
        for vname, vo in gr["variants"].items():
            print(f"  {vname}: differs from the ftz output at {int(np.count_nonzero(vo != gr['out']))}")
    for name, s in samples.items():
        for vname, vo in s["variants"].items():
            dv = ordered(vo) - ordered(s["out"])
            print(f"samples {name}: {vname} vs ftz, {int(np.count_nonzero(dv))} differ, ulps {histogram(dv, 5)}")
    check_ex2(grids, samples, meta["grid_bits"])
    check_lg2(grids, samples)
    check_rcp(grids, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
