"""Cut tests/fixtures/cudnn_causal_n2048_h200.npz from a dump of tools/device/dump_cudnn_case.py: one head of
validate's causal n 2048 case (fp8-n2048-d128-h8-causal-p0.001s10-head, H200, cuDNN 9.19), the query rows
named, the keys and values they see (0 .. max row), the kernel's O codes on those rows, and the descales.

    python tools/cut_cudnn_case_fixture.py DUMP.npz --head 1 --rows 100,438,700,893,900,922
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

CASE = "fp8-n2048-d128-h8-causal-p0.001s10-head"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--head", type=int, default=1)
    ap.add_argument("--rows", default="100,438,700,893,900,922")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"
                                        / "cudnn_causal_n2048_h200.npz"))
    a = ap.parse_args(argv)
    z = np.load(a.dump)
    p = CASE + "/"
    rows = np.array(sorted(int(r) for r in a.rows.split(",")))
    nk = int(rows.max()) + 1  # causal: row r sees keys 0..r
    h = a.head
    meta = json.loads(str(z[p + "meta"]))
    out = {
        "q8": z[p + "q8"][0, h, rows], "k8": z[p + "k8"][0, h, :nk], "v8": z[p + "v8"][0, h, :nk],
        "o8_kernel": z[p + "o8_kernel"][0, h, rows], "rows": rows, "descales": z[p + "descales"],
        "meta": np.array(json.dumps({"case": CASE, "head": h, "seqlen": meta["shape"][3],
                                     "softmax_scale": meta["softmax_scale"],
                                     "descales_order": meta["descales_order"]})),
    }
    np.savez_compressed(a.out, **out)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
