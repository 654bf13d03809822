"""Fixtures and markers shared by the whole suite (no test module imports another).

- ``cli``: run the CLI in-process, ``code, out, err = cli("run", "outliers", ...)``.
- ``one_thread`` (autouse where requested) and ``threads(n)``: one way of limiting torch's threads.
- ``ablation_toml(...)``: a tiny ablation definition written to a temp folder (one builder for
  every test that runs an ablation).
- ``paths``: parametrises a test over the compiled (C) fast paths and the PyTorch references,
  so that a change in one of them cannot hide behind the other (``FA3N_NATIVE=0`` is how a
  user gets the PyTorch paths; ``torch_paths()`` does the same inside a test).
- ``write_audit_capture``: the synthetic capture file of the audit tests.
- ``synthetic_ablation``: an ablation dataset with planted effects (analysis and report tests).
- ``inf_k``: registers the distribution ``inf-k`` (N(0, 1) inputs with one Inf in K) for a test.
- markers: ``slow`` (left out of the fast numerics subset, ``-m "not slow"``), ``no_hopper``
  (the refusal paths, skipped on a machine with a Hopper GPU).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

# OpenMP threads (torch's and the compiled paths') sleep instead of spinning while they wait:
# on a loaded 2-core machine spinning threads fight the other process for the cores and the
# suite runs 5-10x slower (measured: test_recipes_field.py 22 s -> 4.7 s beside two busy
# processes); on an idle machine it costs ~10%. Results do not depend on it. Set before torch
# loads libgomp; a value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("no_hopper")
    if mark is not None and HOPPER:
        pytest.skip(mark.kwargs.get("reason", "the refusal path is for machines without a Hopper GPU"))


@pytest.fixture(autouse=True)
def _no_tf32():
    """Every float32 matmul of the suite in full float32 (the emulator sets this itself; tests
    that multiply float32 tensors directly must not depend on who ran first)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


# -- the CLI -------------------------------------------------------------------------------------

@pytest.fixture
def cli(capsys):
    """Run the CLI in-process on ``args`` (converted to str); returns (exit code, stdout, stderr)."""
    from fa3_numerics.testing import run_cli

    def run(*args) -> tuple[int, str, str]:
        return run_cli([str(a) for a in args], capsys)

    return run


@pytest.fixture(scope="session")
def no_hopper() -> bool:
    return not HOPPER


# -- threads -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def threads():
    """``with threads(1): ...``: torch's intra-op threads limited for a block (module fixtures)."""
    return _threads


@pytest.fixture
def one_thread():
    """One torch thread for the test: ablation cells run in-process, as one dask worker runs
    them, so results do not depend on the thread count of the machine running the suite."""
    with _threads(1):
        yield


# -- compiled paths ------------------------------------------------------------------------------

@contextlib.contextmanager
def _torch_paths():
    """The PyTorch reference of every compiled fast path, for a block (as ``FA3N_NATIVE=0``)."""
    from fa3_numerics.numerics import native

    saved_state, saved_env = dict(native._STATE), os.environ.get("FA3N_NATIVE")
    os.environ["FA3N_NATIVE"] = "0"
    native._STATE.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        native._STATE.clear()
        native._STATE.update(saved_state)
        if saved_env is None:
            os.environ.pop("FA3N_NATIVE", None)
        else:
            os.environ["FA3N_NATIVE"] = saved_env


@pytest.fixture(scope="session")
def torch_paths():
    return _torch_paths


@pytest.fixture(params=["native", "torch"])
def paths(request):
    """Run the test once through the compiled fast paths and once through the PyTorch
    references; yields the name. The native run is skipped where nothing compiled."""
    from fa3_numerics.numerics import native

    if request.param == "native":
        if native._lib() is None:
            pytest.skip(f"compiled paths unavailable: {native.status()}")
        yield "native"
    else:
        with _torch_paths():
            yield "torch"


# -- a tiny ablation definition --------------------------------------------------------------

def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def ablation_text(*, description: str = "tiny ablation", data=(("outliers", {"p": [0.001], "sigma": [10.0]}),),
                  shape: dict | None = None, run: dict | None = None, designs=None) -> str:
    """The TOML of a small ablation: ``data`` as (dist, params or None), ``shape`` and ``run``
    merged over the defaults (seqlen 128, head dim 64, 2 heads, 16 rows; seed 0), ``designs`` as
    dicts with a ``name`` (default: the core design over gran x rot)."""
    shape = {"seqlen": [128], "head_dim": [64], "heads": 2, "rows": 16} | (shape or {})
    run = {"seeds": [0]} | (run or {})
    designs = designs or [{"name": "core", "gran": ["tensor", "block"], "rot": ["none", "hadamard"]}]
    lines = [f"description = {_toml_value(description)}"]
    for dist, params in data:
        lines += ["[[data]]", f"dist = {_toml_value(dist)}"] + ([f"params = {_toml_value(params)}"] if params else [])
    lines += ["[shape]"] + [f"{k} = {_toml_value(v)}" for k, v in shape.items()]
    lines += ["[run]"] + [f"{k} = {_toml_value(v)}" for k, v in run.items()]
    for d in designs:
        lines += ["[[design]]"] + [f"{k} = {_toml_value(v)}" for k, v in d.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def ablation_toml(tmp_path_factory):
    """``ablation_toml(**kw) -> Path``: ``ablation_text(**kw)`` written to a fresh temp folder."""
    def write(name: str = "tiny", **kw) -> Path:
        path = tmp_path_factory.mktemp("ablation") / f"{name}.toml"
        path.write_text(ablation_text(**kw))
        return path

    return write


# -- the audit's synthetic capture ---------------------------------------------------------------

AUDIT = {"D": 64, "HEADS": 4, "KV": 2, "TOKENS": 200, "HOT_K": (5, 9.0)}


@pytest.fixture(scope="session")
def audit_shape() -> dict:
    """Head dim, heads, KV heads, tokens (> one K tile of 160 and one Q tile of 192 at head dim
    64: two blocks each) and the (channel, scale) planted in K of KV head 0, layer 1."""
    return dict(AUDIT)


@pytest.fixture(scope="session")
def write_audit_capture():
    """``write(path, layers=(0, 1), tokens=200, seed=0, tensor_over=None, meta_over=None) -> tensors``:
    N(0,1) Q, K, V per layer; in layer 1 K channel 5 of KV head 0 is scaled by 9 and shifted by 2,
    and the first key of KV head 1 is 4x (an attention sink)."""
    def write(path: Path, layers=(0, 1), tokens=AUDIT["TOKENS"], seed=0, tensor_over=None, meta_over=None) -> dict:
        from fa3_numerics.data import capture as cap

        d, heads, kv = AUDIT["D"], AUDIT["HEADS"], AUDIT["KV"]
        ch, scale = AUDIT["HOT_K"]
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for i in layers:
            q = torch.randn(heads, tokens, d, generator=g)
            k = torch.randn(kv, tokens, d, generator=g)
            v = torch.randn(kv, tokens, d, generator=g)
            if i == 1:
                k[0, :, ch] = k[0, :, ch] * scale + 2.0
                k[1, 0] *= 4.0  # a strong first key: attention sink for KV head 1
            tensors.update({f"layers.{i}.q": q, f"layers.{i}.k": k, f"layers.{i}.v": v})
        tensors.update(tensor_over or {})
        meta = {
            "format": cap.FORMAT, "model": "synthetic", "architecture": "none", "num_layers": str(max(layers) + 1),
            "layers": ",".join(map(str, layers)), "heads": str(heads), "kv_heads": str(kv), "head_dim": str(d),
            "tokens": str(tokens), "causal": "true", "dtype": "float32", "softmax_scale": repr(d ** -0.5),
            "text_source": "none", "text_sha256": "0" * 64, "transformers_version": "none",
            "torch_version": torch.__version__, "rope": '{"rope_theta": 10000.0, "rope_type": "default"}',
        }
        meta.update(meta_over or {})
        cap.save_capture(path, tensors, meta)
        return tensors

    return write


# -- an ablation dataset with planted effects ----------------------------------------------------

SYNTH = {"DATA": ["outliers p=0.001,sigma=10", "channel-outliers"], "GRAN": ["tensor", "block"],
         "ROT": ["none", "hadamard"], "SEQ": [256, 512]}


def _synthetic_ablation(gran_on_d2: float = 0.0, noise: float = 0.0):
    """log10 RMSE = -2 + 0.3 [rot=none] + 0.03 [gran=tensor] + 0.1 [rot=none, data 2]
    + gran_on_d2 [gran=tensor, data 2] + 0.05 [seqlen 512], equal in all 8 samples (plus
    ``noise`` x N(0, 1), seeded)."""
    import itertools

    import numpy as np
    import xarray as xr

    data, gran, rot, seq = SYNTH["DATA"], SYNTH["GRAN"], SYNTH["ROT"], SYNTH["SEQ"]
    variants = [f"{g}|{r}|offset8|fp32|e4m3|amax" for g, r in itertools.product(gran, rot)]
    y = np.zeros((len(data), len(seq), 1, 1, len(variants), 2, 1, 4))
    rng = np.random.default_rng(0)
    for (di, d), (si, s), (vi, (g, r)) in itertools.product(enumerate(data), enumerate(seq),
                                                             enumerate(itertools.product(gran, rot))):
        val = -2 + 0.3 * (r == "none") + 0.03 * (g == "tensor") + 0.1 * (r == "none" and di == 1)
        val += gran_on_d2 * (g == "tensor" and di == 1) + 0.05 * (s == 512)
        y[di, si, 0, 0, vi] = val + noise * rng.standard_normal((2, 1, 4))
    dims = ["data", "seqlen", "head_dim", "causal", "variant", "seed", "batch", "head"]
    coords = {"data": data, "seqlen": seq, "head_dim": [128], "causal": [False], "variant": variants,
              "seed": [0, 1], "batch": [0], "head": np.arange(4), "paper_data": ("data", [True, False]),
              "stage": ("variant", ["full"] * 4), "spec": ("variant", variants)}
    for f, lv in zip(("gran", "rot", "p", "acc", "fmt", "scale"), zip(*[v.split("|") for v in variants])):
        coords[f] = ("variant", list(lv))
    return xr.Dataset({"rmse": (dims, 10 ** y)}, coords=coords, attrs={"seeds": "[0, 1]"})


@pytest.fixture(scope="session")
def synthetic_ablation():
    """``synthetic_ablation(gran_on_d2=0.0, noise=0.0) -> xr.Dataset`` (see ``_synthetic_ablation``)."""
    return _synthetic_ablation


# -- inputs with an Inf ---------------------------------------------------------------------------

@pytest.fixture
def inf_k(monkeypatch):
    """The distribution ``inf-k`` (parameter ``where``: flat index of the Inf in K), registered for
    the test only (in this process: run it with --workers 0)."""
    from fa3_numerics.data import distributions

    def draw(shape, seed, *, where: float):
        g = distributions.generator(seed)
        q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape.q_shape, shape.kv_shape,
                                                                           shape.kv_shape))
        k.view(-1)[int(where)] = float("inf")
        return q, k, v

    monkeypatch.setitem(distributions._REGISTRY, "inf-k", distributions.Entry(
        "inf-k", draw, "K with one Inf", {"where": (0.0, "flat index of the Inf")}))
    return "inf-k"
