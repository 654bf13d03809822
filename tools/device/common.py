"""What every device script shares: the log line, the report and numbers written after every part,
the sizes of a run, GPU timing, and the paper's inputs drawn by the library.

Exposed: ``T0``, ``REPO``, ``log``, ``Out``, ``Sizes``, ``MOCK_SIZES``, ``ensure_package``, ``sync``,
``event_times``, ``graph_times``, ``median_seconds``, ``quantile``, ``write_csv``, ``versions``,
``paper_qkv``, ``to_bshd``.

The scripts here run on the device machine (``bash tools/device/h200.sh``) against the installed
package; they sit outside it (tools/ is not packaged) and import only its public names. A timeout
on the device returns what is under $OUT, so ``Out`` rewrites the report and the numbers after
every part, each file whole (``fa3_numerics.files``).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def ensure_package() -> None:
    """The project must be installed (``pip install -e .``; setup_device.sh does it): kernels/ and
    experiments/ resolve as fa3_numerics.kernels and fa3_numerics.experiments only through
    pyproject's package-dir mapping."""
    try:
        import fa3_numerics.kernels.fa3  # noqa: F401
    except ModuleNotFoundError as exc:
        sys.exit(f"error: {exc}; install the project first: source tools/device/setup_device.sh "
                 "(pip install --no-deps -e . after the wheels)")


class Out:
    """Report sections (``report.md``, in ``order``, then any others) and a JSON of numbers
    (``numbers``), both rewritten whole after every change."""

    def __init__(self, folder: Path, order: list[str], numbers: str = "timings.json"):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.order = list(order)
        self.numbers = numbers
        self.sections: dict[str, str] = {}
        self.timings: dict = {}

    def section(self, key: str, text: str) -> None:
        self.sections[key] = text
        keys = self.order + [k for k in self.sections if k not in self.order]
        self._write("report.md", "\n\n".join(self.sections[k] for k in keys if k in self.sections) + "\n")

    def save_timings(self) -> None:
        self._write(self.numbers, json.dumps(self.timings, indent=1, default=str))

    def _write(self, name: str, text: str) -> None:
        from fa3_numerics.files import atomic_write

        atomic_write(self.dir / name, text)

    def error(self, part: str, exc: BaseException) -> None:
        """A part failed: the traceback to the log, one line to the report's errors, the rest kept."""
        log(f"{part} FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        prev = self.sections.get("errors", "## Errors\n")
        first = str(exc).splitlines()[0] if str(exc) else ""
        self.section("errors", prev + f"\n- {part}: `{type(exc).__name__}: {first[:300]}`")
        self.timings.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"[:2000]
        self.save_timings()


@dataclasses.dataclass
class Sizes:
    """Shapes of one device run: Table 3 (``t3_*``), throughput (``tp_*``), validation grids."""

    t3_batch: int = 2
    t3_heads: int = 16
    t3_seqlen: int = 8192
    t3_rows: int = 1024
    tp_batch: int = 4
    tp_heads: int = 16
    tp_seqlen: int = 8192
    tp_rows: int = 1024
    tp_reps: int = 20
    grids: tuple = ("small", "stress", "captured")
    paper_cases: bool = True


MOCK_SIZES = Sizes(t3_batch=1, t3_heads=2, t3_seqlen=512, t3_rows=64, tp_batch=1, tp_heads=2, tp_seqlen=512,
                   tp_rows=64, tp_reps=2, grids=("tiny",), paper_cases=False)


# -- timing -------------------------------------------------------------------------------------


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def event_times(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()`` after ``warmup`` calls: CUDA events around
    each call on a GPU, the wall clock elsewhere (a CPU dry run)."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    if not torch.cuda.is_available():
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out
    torch.cuda.synchronize()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def graph_times(fn, calls: int = 10, reps: int = 10) -> list[float]:
    """Seconds per ``fn()`` with the host's launch cost taken out: ``calls`` calls captured in one
    CUDA graph, the graph replayed ``reps`` times (CUDA events around each replay). This is the
    device time a pipeline sees when the host runs ahead of the GPU."""
    import torch

    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return out


def quantile(xs: list[float], f: float) -> float:
    """The ``f`` quantile of ``xs`` (nearest rank): 0.5 the median, 0.1 and 0.9 the spread."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(f * (len(s) - 1)))))]


def median_seconds(fn, reps: int) -> float:
    """Median of ``event_times(fn, reps)``."""
    return quantile(event_times(fn, reps), 0.5)


# -- files and provenance -----------------------------------------------------------------------


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as one CSV (the union of their keys as columns), written whole; nothing for no rows."""
    if not rows:
        return
    from fa3_numerics.files import atomic_write

    keys = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each distribution (``"absent"`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


# -- inputs -------------------------------------------------------------------------------------


def paper_qkv(batch: int, heads: int, seqlen: int, head_dim: int, seed: int, *, device: str = "cpu",
              kv_heads: int | None = None, p: float = 0.001, sigma: float = 10.0):
    """Q, K, V of the FA3 paper's outlier distribution (``fa3_numerics.data.distributions``,
    family ``outliers``), float64 (batch, heads, seqlen, head_dim), drawn on ``device`` with the
    library's stream for it (``rng_stream``)."""
    from fa3_numerics.data import distributions

    shape = distributions.AttnShape(batch, heads, seqlen, head_dim, kv_heads=kv_heads)
    return distributions.generate("outliers", shape, seed, device=device, p=p, sigma=sigma)


def to_bshd(x, dtype):
    """(batch, heads, seqlen, dim) -> contiguous (batch, seqlen, heads, dim) in ``dtype``: the FA3
    kernel's layout, as a model hands Q, K and V over."""
    return x.transpose(1, 2).to(dtype).contiguous()
