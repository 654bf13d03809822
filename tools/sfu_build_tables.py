"""Build fa3_numerics/numerics/sfu_h200.npz, the packed tables of the bit-exact models of the
H200's ``ex2/lg2/rcp.approx.ftz.f32`` (fa3_numerics/numerics/sfu.py), from the probe's exhaustive
grids (tools/device/mufu_probe.py, read and SHA-checked by tools/mufu_tables.py).

Each model needs one 2^23-entry float32 table over a 23-bit mantissa/fraction (the reductions are
in sfu.py). A table is stored as a smooth base (per 64 segments a cubic in float64, fitted to the
table itself, evaluated with basic IEEE operations so it rebuilds the same on every machine) plus
the exact distance of each entry from that base in float32 ulps (int8, larger ones listed apart);
deflate packs the mostly-zero distances. sfu.py rebuilds each table and checks its SHA-256::

    python3 tools/sfu_build_tables.py MUFU_DIR [--out fa3_numerics/numerics/sfu_h200.npz]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mufu_tables import load  # noqa: E402

from fa3_numerics.numerics.sfu import SEG_BITS, DEG, base_table, ordered_np  # noqa: E402


def tables(folder: Path) -> dict[str, np.ndarray]:
    """name -> uint32[2^23] float32 bits: ex2 at k/2^23 (k < 2^23), lg2 at 1 + k/2^23 and at
    (1 + k/2^23)/2, rcp at 1 + k/2^23."""
    meta, grids, _ = load(folder)
    if meta["grid_bits"] != 24:
        raise SystemExit("error: the tables need the probe's 2^24 grids")
    pos = grids["ex2_pos"]["out"]
    if not np.array_equal(pos[0::2], pos[1::2]):
        raise SystemExit("error: ex2 grid depends on the 24th fraction bit; the F=23 reduction does not hold")
    return {"ex2": pos[0::2].copy(), "lg2_hi": grids["lg2_hi"]["out"].copy(),
            "lg2_lo": grids["lg2_lo"]["out"].copy(), "rcp": grids["rcp"]["out"].copy()}


def fit(t: np.ndarray) -> np.ndarray:
    v = t.view(np.float32).astype(np.float64)
    n = len(v) >> SEG_BITS
    u = np.arange(n, dtype=np.float64) / n
    A = np.stack([u ** p for p in range(DEG + 1)], 1)
    return np.stack([np.linalg.lstsq(A, v[s * n:(s + 1) * n], rcond=None)[0] for s in range(1 << SEG_BITS)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "fa3_numerics/numerics/sfu_h200.npz")
    a = ap.parse_args(argv)
    if not (a.folder / "mufu.json").is_file():
        print(f"error: no mufu.json in {a.folder}", file=sys.stderr)
        return 2
    arrays = {}
    for name, t in tables(a.folder).items():
        coef = fit(t)
        base = base_table(coef, len(t))
        d = ordered_np(t) - ordered_np(base)
        big = np.abs(d) > 127
        arrays[f"{name}/coef"] = coef
        arrays[f"{name}/code"] = np.where(big, -128, d).astype(np.int8)
        arrays[f"{name}/exc_idx"] = np.flatnonzero(big).astype(np.uint32)
        arrays[f"{name}/exc_val"] = d[big].astype(np.int32)
        arrays[f"{name}/sha256"] = np.frombuffer(hashlib.sha256(t.tobytes()).digest(), dtype=np.uint8)
        vals, cnt = np.unique(np.where(big, 999, d), return_counts=True)
        print(f"{name}: distances {dict(zip(vals.tolist(), cnt.tolist()))}")
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
