"""Cut tests/fixtures/sfu_h200.npz from the probe's random samples (tools/device/mufu_probe.py on an
H200; read and SHA-checked by tools/mufu_tables.py): per instruction a few thousand (input bits,
output bits) pairs of the device's own outputs, chosen to hold the hard cases (where the emulator's
old stand-ins, float32 exp2/log2 rounded toward zero, differ from the unit; NaN, +-inf, zeros,
subnormals, flushed and saturated results, lg2 near 1, large exponents) and a uniform draw of the
rest. Seeded (numpy PCG64), written whole::

    python3 tools/sfu_fixture.py MUFU_DIR [--out tests/fixtures/sfu_h200.npz] [--per 1000]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mufu_tables import load  # noqa: E402

SEED = 20261202


def rz32(v: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        r = v.astype(np.float32)
        over = np.abs(r.astype(np.float64)) > np.abs(v)
        return np.where(over & np.isfinite(v), np.nextafter(r, np.float32(0)), r)


def hard_masks(op: str, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    with np.errstate(all="ignore"):
        x64 = x.astype(np.float64)
        if op == "ex2":
            old = rz32(np.exp2(x64))
            old = np.where(np.abs(old) < 2.0 ** -126, np.float32(0), old)
            return {"old_differs": old.view(np.uint32) != y, "nonfinite_in": ~np.isfinite(x),
                    "flushed": (x < -126) & np.isfinite(x), "saturated": x >= 127, "tiny": np.abs(x) < 2.0 ** -20,
                    "above_1": (x > 1) & (x < 127)}
        if op == "lg2":
            old = rz32(np.log2(x64))
            return {"old_differs": old.view(np.uint32) != y, "nonfinite_in": ~np.isfinite(x),
                    "near_1": np.abs(x64 - 1) < 2.0 ** -7, "subnormal_or_zero": np.abs(x) < 2.0 ** -126,
                    "negative": x < 0, "large": np.abs(np.log2(np.abs(x64))) > 100}
        old = (1.0 / x64).astype(np.float32)
        return {"old_differs": old.view(np.uint32) != y, "nonfinite_in": ~np.isfinite(x),
                "subnormal_or_zero": np.abs(x) < 2.0 ** -126, "flushed": np.abs(x) > 2.0 ** 126,
                "negative": x < 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/sfu_h200.npz")
    ap.add_argument("--per", type=int, default=1000, help="pairs per hard-case class (and for the uniform draw)")
    a = ap.parse_args(argv)
    if not (a.folder / "mufu.json").is_file():
        print(f"error: no mufu.json in {a.folder}", file=sys.stderr)
        return 2
    meta, _, samples = load(a.folder)
    rng = np.random.Generator(np.random.PCG64(SEED))
    arrays, prov = {}, {"source": str(a.folder), "device": meta["device"].get("gpu"), "driver": meta["device"].get("driver"),
                        "probe": "tools/device/mufu_probe.py", "cut_by": "tools/sfu_fixture.py", "seed": SEED, "classes": {}}
    for op in ("ex2", "lg2", "rcp"):
        s = samples[op]
        ib, ob = s["in"], s["out"]
        x = ib.view(np.float32)
        pick = [rng.choice(len(ib), a.per, replace=False)]
        counts = {}
        for name, m in hard_masks(op, x, ob).items():
            idx = np.flatnonzero(m)
            counts[name] = int(len(idx))
            if len(idx):
                pick.append(rng.choice(idx, min(a.per, len(idx)), replace=False))
        sel = np.unique(np.concatenate(pick))
        arrays[f"{op}/in"], arrays[f"{op}/out"] = ib[sel], ob[sel]
        prov["classes"][op] = {"of_samples": int(len(ib)), "kept": int(len(sel)), "class_sizes_in_samples": counts}
    arrays["provenance"] = np.frombuffer(json.dumps(prov).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, a.out)
    print(json.dumps(prov["classes"]), f"\nwrote {a.out} ({a.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
