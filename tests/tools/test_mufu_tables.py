"""The SFU tables' storage (tools/mufu_tables.py, written by tools/device/mufu_probe.py): the ulp
codec is exact on every float32 pattern, and a dry probe run decodes to exactly what it recorded,
while a corrupted table is refused."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def mods(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    monkeypatch.syspath_prepend(str(REPO / "tools" / "device"))
    import mufu_probe
    import mufu_tables

    yield mufu_tables, mufu_probe
    for name in ("mufu_tables", "mufu_probe"):
        sys.modules.pop(name, None)


EDGES = np.array([0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000,
                  0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x80800000], dtype=np.uint32)


def test_ordered_is_an_exact_bijection_in_float_order(mods):
    mt, _ = mods
    b = np.concatenate([np.random.default_rng(0).integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32),
                        EDGES])
    o = mt.ordered(b)
    assert (mt.unordered(o) == b).all()
    f = b.view(np.float32)
    fin = ~np.isnan(f)
    s = np.argsort(o[fin], kind="stable")
    assert (np.diff(f[fin][s].astype(np.float64)) >= 0).all()
    # adjacent floats are one apart (nextafter skips from -0 over +0, which the line keeps apart)
    x = f[np.isfinite(f) & (np.abs(f) < np.float32(3e38)) & (b != 0x80000000)]
    up = np.nextafter(x, np.float32(np.inf))
    assert (mt.ordered(mt.bits_of(up)) - mt.ordered(mt.bits_of(x)) == 1).all()
    assert list(mt.ordered(np.array([0x80000001, 0x80000000, 0, 1], dtype=np.uint32))) == [-2, -1, 0, 1]
    with pytest.raises(ValueError):
        mt.unordered(np.array([2 ** 31]))


def test_ulp_codec_round_trips_with_exceptions(mods):
    mt, _ = mods
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32)
    near = mt.unordered(np.clip(mt.ordered(ref) + rng.integers(-130, 131, ref.size), -(2 ** 31), 2 ** 31 - 1))
    far = rng.integers(0, 2 ** 32, ref.size, dtype=np.uint64).astype(np.uint32)
    out = np.where(rng.random(ref.size) < 0.9, near, far)
    out[:EDGES.size] = EDGES
    rec = mt.encode_ulps(out, ref)
    assert rec["code"].dtype == np.int8 and 0 < len(rec["exc_idx"]) < ref.size
    assert (mt.decode_ulps(rec, ref) == out).all()
    rec["code"][np.flatnonzero(rec["code"] != mt.ESC)[0]] = mt.ESC  # an escape with no exception listed
    with pytest.raises(ValueError):
        mt.decode_ulps(rec, ref)


def test_dry_probe_decodes_exactly_and_refuses_corruption(mods, tmp_path):
    mt, probe = mods
    assert probe.main(["--out", str(tmp_path), "--dry"]) == 0
    meta, grids, samples = mt.load(tmp_path)
    assert meta["dry"] and len(meta["files"]) <= probe.MAX_FILES
    # the stand-in recomputed here: the decoded grid is exactly its output
    run = probe.Runner(dry=True)
    for name, g in grids.items():
        assert (g["out"] == run(f"{g['op']}.ftz", g["in"])).all(), name
    s = samples["ex2"]
    assert (s["variants"]["ex2"] == run("ex2", s["in"])).all()
    assert int((s["variants"]["ex2"] != s["out"]).sum()) == meta["samples"]["ex2"]["variants"]["ex2"]["differs"] > 0
    # one grid code changed: the SHA-256 check must refuse the table
    fname = next(f for f, v in meta["files"].items() if "ex2_pos" in v["records"])
    with np.load(tmp_path / fname) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["ex2_pos/code"][5] += 1
    np.savez_compressed(tmp_path / fname, **arrays)
    with pytest.raises(SystemExit, match="ex2_pos"):
        mt.load(tmp_path)
    assert zipfile.is_zipfile(tmp_path / fname)
