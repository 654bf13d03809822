"""The device scripts (tools/device/, outside the package): each imports and parses its arguments
on a CPU, the shell wrappers name files that exist, and the shared helpers (tools/device/common.py)
and the dump tooling do what the scripts rely on."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools" / "device"
SCRIPTS = sorted(p.stem for p in TOOLS.glob("*.py"))


@pytest.fixture(autouse=True)
def _on_path(monkeypatch):
    # The scripts run as ``python3 tools/device/X.py``: their folder is first on sys.path.
    monkeypatch.syspath_prepend(str(TOOLS))


@pytest.fixture(autouse=True, scope="module")
def _forget_scripts():
    # Their plain module names (common, h200, ...) must not stay importable for other tests.
    yield
    for name in SCRIPTS:
        mod = sys.modules.get(name)
        if mod is not None and Path(getattr(mod, "__file__", "") or "").parent == TOOLS:
            del sys.modules[name]


def _load(name: str):
    return importlib.import_module(name)


def test_every_script_is_listed():
    assert {"common", "h200", "triton_h200", "impact_h200", "sage_h200", "sage_diag", "backward_h200", "dump_fa3",
            "dump_stress", "fidelity_from_dumps"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_without_a_gpu(name):
    mod = _load(name)
    assert mod.__file__ and Path(mod.__file__).parent == TOOLS


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s != "common"])
def test_script_parses_help(name, capsys):
    mod = _load(name)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s != "common"])
def test_scripts_import_no_private_names(name):
    # Public names only: ``from X import _y`` or ``X._y`` of another module would break silently
    # when the library renames its internals.
    text = (TOOLS / f"{name}.py").read_text()
    assert not re.search(r"^\s*from\s+\S+\s+import\s+.*\b_[a-z]\w*", text, re.M), name
    assert not re.search(r"\b(?:mma|sdpa|fa3|rq|rs|impact_model|validate)\._[a-z]\w*", text), name


@pytest.mark.parametrize("sh", sorted(p.name for p in TOOLS.glob("*.sh")))
def test_shell_wrappers_parse_and_name_existing_files(sh):
    path = TOOLS / sh
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    for ref in re.findall(r"(?:tools|kernels)/device/[\w.]+", path.read_text()):
        assert (REPO / ref).is_file(), f"{sh} names {ref}, which does not exist"


# -- common.py ------------------------------------------------------------------------------------

def test_quantile_is_the_nearest_rank():
    common = _load("common")
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert common.quantile(xs, 0.5) == 3.0 and common.quantile(xs, 0.0) == 1.0 and common.quantile(xs, 1.0) == 5.0
    assert common.quantile(xs, 0.9) == 5.0 and common.quantile(xs, 0.1) == 1.0


def test_event_times_on_the_cpu_times_each_call(monkeypatch):
    common = _load("common")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    ts = common.event_times(lambda: calls.append(1), 4, warmup=2)
    assert len(ts) == 4 and len(calls) == 6 and all(t >= 0 for t in ts)


def test_out_writes_sections_in_order_and_the_numbers(tmp_path):
    common = _load("common")
    out = common.Out(tmp_path / "o", ["head", "b", "a"], numbers="results.json")
    out.section("a", "A")
    out.section("extra", "X")
    out.section("head", "H")
    assert (tmp_path / "o" / "report.md").read_text() == "H\n\nA\n\nX\n"
    out.timings["x"] = 1
    try:
        raise ValueError("bad part\nsecond line")
    except ValueError as exc:
        out.error("part", exc)
    assert json.loads((tmp_path / "o" / "results.json").read_text())["errors"]["part"].startswith("ValueError")
    assert "- part: `ValueError: bad part`" in (tmp_path / "o" / "report.md").read_text()
    assert not [p for p in (tmp_path / "o").iterdir() if p.name.startswith(".")]  # no temp files left


def test_write_csv_keeps_every_column(tmp_path):
    import csv

    common = _load("common")
    common.write_csv(tmp_path / "t.csv", [{"a": 1}, {"a": 2, "b": 3}])
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert rows == [{"a": "1", "b": ""}, {"a": "2", "b": "3"}]


def test_paper_inputs_are_the_library_distribution():
    from fa3_numerics.data import distributions

    common = _load("common")
    q, k, v = common.paper_qkv(1, 4, 64, 32, 3, kv_heads=2, p=0.01, sigma=5.0)
    ref = distributions.generate("outliers", distributions.AttnShape(1, 4, 64, 32, kv_heads=2), 3, p=0.01, sigma=5.0)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), ref))
    assert q.shape == (1, 4, 64, 32) and k.shape == (1, 2, 64, 32) and q.dtype == torch.float64
    b = common.to_bshd(q, torch.bfloat16)
    assert b.shape == (1, 64, 4, 32) and b.is_contiguous() and torch.equal(b[0, 5, 2], q[0, 2, 5].to(torch.bfloat16))


# -- the dump tooling -------------------------------------------------------------------------------

def _mock_dump(tmp_path, cfg):
    from safetensors.torch import save_file

    dump = _load("dump_fa3")
    tensors, meta, _ = dump.run_config(cfg, dump.mock_attn, torch.device("cpu"))
    path = tmp_path / f"fa3_{cfg.name}.safetensors"
    save_file({k: x.contiguous() for k, x in tensors.items()}, str(path), metadata=meta)
    return path, tensors, meta


def test_fidelity_from_dumps_regenerates_the_inputs_of_a_dump(tmp_path):
    dump = _load("dump_fa3")
    fid = _load("fidelity_from_dumps")
    cfg = dump.Config("tiny", seqlen=96, heads=4, kv_heads=2, dim=64, p=0.01)
    path, tensors, meta = _mock_dump(tmp_path, cfg)
    assert meta["inputs"] == dump.INPUTS
    q, k, v = fid._paper_inputs(json.loads(meta["config"]), tensors, path)
    assert torch.equal(q, dump.make_qkv(cfg)[0]) and k.shape == (1, 2, 96, 64)


def test_fidelity_from_dumps_refuses_a_dump_drawn_another_way(tmp_path):
    # The committed H200 fixture was drawn by the script's former draw order: its regenerated
    # inputs do not give its bytes, so the reference would be of other tensors.
    from safetensors import safe_open
    from safetensors.torch import load_file

    fixture = REPO / "tests" / "fixtures" / "fa3_h200_s1000_h4_d128.safetensors"
    if not fixture.is_file():
        pytest.skip("kernel fixture not present")
    fid = _load("fidelity_from_dumps")
    cfg = json.loads(safe_open(str(fixture), "pt").metadata()["config"])
    with pytest.raises(SystemExit, match="drawn another way"):
        fid._paper_inputs(cfg, load_file(str(fixture)), fixture)


def test_fidelity_from_dumps_says_when_there_is_nothing_to_read(tmp_path, capsys):
    fid = _load("fidelity_from_dumps")
    assert fid.main([str(tmp_path)]) == 2
    assert "no fa3_s*.safetensors dumps" in capsys.readouterr().err


def test_backward_script_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load("backward_h200").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_scripts_use_the_library_not_copies():
    # One timing helper, one Out/Sizes/log, the library's distribution and F.
    for name in SCRIPTS:
        if name == "common":
            continue
        text = (TOOLS / f"{name}.py").read_text()
        for copy in ("def log(", "class Out", "class Sizes", "Event(enable_timing", "def _bench", "def paper_tensor",
                     "spike = torch.randn"):
            assert copy not in text, f"{name}.py defines its own {copy!r}"


def test_cudnn_backward_script_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load("cudnn_bwd_h200").main(["--out", "."]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cudnn_backward_dry_run_decodes_what_the_stand_in_wrote(tmp_path):
    # The stand-in kernel is the emulator encoded as cuDNN writes (FP8 times its scale): decoding it and
    # running the same emulator must give F ~ 0, and the .npz must hold the FP8 bytes and the scales.
    import numpy as np

    mod = _load("cudnn_bwd_h200")
    args = ["--dry", "--out", str(tmp_path), "--cases", "1", "--arms", "e4m3:e4m3", "--variants", "kfwd/fp32"]
    assert mod.main(args) == 0
    rows = json.loads((tmp_path / "cudnn_bwd_h200.json").read_text())["rows"]
    fid = rows[0]["arms"]["e4m3:e4m3"]["variants"]["kfwd/fp32"]["fidelity"]
    assert max(fid[g]["F"] for g in ("dq", "dk", "dv")) < 0.01
    with np.load(tmp_path / "cudnn_bwd_cases.npz") as z:
        name = rows[0]["case"]
        assert z[f"{name}/q"].dtype == np.uint8 and z[f"{name}/e4m3:e4m3/dq_raw"].dtype == np.uint8
        assert "scale_dQ" in json.loads(str(z[f"{name}/e4m3:e4m3/scalars"]))


def test_cudnn_backward_saves_exactly_the_chosen_case_arms(tmp_path, monkeypatch):
    # --only/--seeds/--save-cases: each chosen case at each seed in its own .npz with only the chosen arms;
    # past the size limit the arms go to one file each, none dropped
    import numpy as np

    mod = _load("cudnn_bwd_h200")
    args = ["--dry", "--out", str(tmp_path), "--only", "k-bias-n1024-d128-full", "--seeds", "0,3", "--arms",
            "e4m3:e4m3,e5m2:e5m2", "--variants", "kfwd/fp32", "--save-cases", "k-bias-n1024-d128-full@e5m2:e5m2"]
    assert mod.main(args) == 0
    rows = json.loads((tmp_path / "cudnn_bwd_h200.json").read_text())["rows"]
    assert [(r["family"], r["causal"], r["seed"]) for r in rows] == [("k-bias", False, 0), ("k-bias", False, 3)]
    for r in rows:
        with np.load(tmp_path / f"cudnn_bwd_{mod.file_slug(r['case'])}.npz") as z:
            meta = json.loads(str(z["meta"]))
            assert [c["seed"] for c in meta["cases"]] == [r["seed"]]
            arms = {k.split("/")[-2] for k in z.files if ":" in k}
            assert arms == {"e5m2:e5m2"}
    monkeypatch.setattr(mod, "NPZ_LIMIT", 600_000)  # one arm fits, two do not
    split = tmp_path / "split"
    args[args.index("--out") + 1] = str(split)
    args[args.index("--save-cases") + 1] = "all"
    assert mod.main(args[:args.index("--seeds")] + args[args.index("--arms"):]) == 0
    names = sorted(f.name for f in split.glob("*.npz"))
    assert len(names) == 2 and all(n.endswith(("_e4m3-e4m3.npz", "_e5m2-e5m2.npz")) for n in names)
    assert mod.main(["--dry", "--out", str(tmp_path), "--only", "no-such-case"]) == 2
    assert mod.main(["--dry", "--out", str(tmp_path), "--only", "k-bias-n1024-d128-full", "--save-cases",
                     "outliers-n1024-d128-full"]) == 2


def test_cudnn_backward_dry_run_fails_when_decoding_is_wrong(tmp_path, monkeypatch):
    # negative control: a decoder that forgets the kernel's scale moves F far from 0
    from fa3_numerics.kernels import cudnn as kc

    mod = _load("cudnn_bwd_h200")
    monkeypatch.setattr(kc, "decode", lambda raw, scale: raw.to(torch.float64))
    args = ["--dry", "--out", str(tmp_path), "--cases", "1", "--arms", "e4m3:e4m3", "--variants", "kfwd/fp32"]
    assert mod.main(args) == 1


def test_fit_script_reads_the_saved_cases_and_scores_the_stand_in(tmp_path, capsys):
    # tools/fit_cudnn_bwd.py on a dry run's .npz: the stand-in kernel is the float32 emulator (cudnn-fp8-kernel's
    # formats and P scale), so that candidate gives the kernel's codes back through the .npz round trip
    sys.path.insert(0, str(REPO / "tools"))
    try:
        fit = importlib.import_module("fit_cudnn_bwd")
        mod = _load("cudnn_bwd_h200")
        assert mod.main(["--dry", "--out", str(tmp_path), "--cases", "1", "--arms", "e4m3:e4m3", "--variants",
                         "kfwd/fp32"]) == 0
        (name, arm, d), = list(fit.cases(str(tmp_path / "cudnn_bwd_cases.npz")))
        good = fit.score(d, "bwd.acc=fp32")
        assert min(good[g]["codes_equal"] for g in ("dq", "dk", "dv")) > 0.99
        assert max(good[g]["F_q"] for g in ("dq", "dk", "dv")) < 0.01
        assert fit.main([str(tmp_path / "missing.npz")]) == 2
    finally:
        sys.path.remove(str(REPO / "tools"))
        sys.modules.pop("fit_cudnn_bwd", None)


def test_explain_cudnn_dq_refuses_a_missing_file_and_an_arm_the_file_lacks(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        explain = importlib.import_module("explain_cudnn_dq")
        assert explain.main([str(tmp_path / "missing.npz")]) == 2
        mod = _load("cudnn_bwd_h200")
        assert mod.main(["--dry", "--out", str(tmp_path), "--cases", "1", "--arms", "e4m3:e4m3", "--variants",
                         "kfwd/fp32"]) == 0
        assert explain.main([str(tmp_path / "cudnn_bwd_cases.npz"), "--arm", "1"]) == 2
        assert "arms 0-0" in capsys.readouterr().err
    finally:
        sys.path.remove(str(REPO / "tools"))
        sys.modules.pop("explain_cudnn_dq", None)
        sys.modules.pop("fit_cudnn_bwd", None)


def test_explain_cudnn_dkdv_finds_the_code_it_was_given(tmp_path, capsys):
    # The stand-in kernel is the float32 emulator: at --acc fp32 the tool finds its codes equal, and one dV
    # byte moved by the test comes out as the one differing code, in its row; a missing file is refused.
    import numpy as np

    sys.path.insert(0, str(REPO / "tools"))
    try:
        explain = importlib.import_module("explain_cudnn_dkdv")
        assert explain.main([str(tmp_path / "missing.npz")]) == 2
        mod = _load("cudnn_bwd_h200")
        assert mod.main(["--dry", "--out", str(tmp_path), "--cases", "1", "--arms", "e4m3:e4m3", "--variants",
                         "kfwd/fp32"]) == 0
        path = tmp_path / "cudnn_bwd_cases.npz"
        capsys.readouterr()
        assert explain.main([str(path), "--acc", "fp32"]) == 0
        assert capsys.readouterr().out.count("as the preset casts: 0 of ") == 2
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        key = next(k for k in arrays if k.endswith("/dv_raw"))
        arrays[key] = arrays[key].copy()
        arrays[key][0, 1, 5, 7] ^= 1
        np.savez_compressed(path, **arrays)
        assert explain.main([str(path), "--acc", "fp32"]) == 0
        out = capsys.readouterr().out
        assert "as the preset casts: 1 of " in out and "h1 key 5: 1 differ" in out
    finally:
        sys.path.remove(str(REPO / "tools"))
        sys.modules.pop("explain_cudnn_dkdv", None)
        sys.modules.pop("fit_cudnn_bwd", None)


def test_triton_attn_table_names_the_fastest_plan_and_every_failure():
    mod = _load("triton_attn_h200")
    env = {"device": "H200", "when": "now", "torch": "t", "shape": [4, 16, 8192, 128], "reps": 30}
    rows = [{"variant": "triton fa3-fp8", "causal": False, "plan": p, "ms": ms, "ms_p10": ms, "ms_p90": ms,
             "tflops": 1.0, "x_fa3": x, "same_bytes_as_default": same}
            for p, ms, x, same in (((64, 128, 4, 3, 0), 3.4, 0.73, None), ((64, 128, 4, 2, 168), 3.3, 0.76, True),
                                   ((128, 128, 8, 2, 0), 4.5, 0.56, False))]
    text = "\n".join(mod._table({"env": env, "rows": rows, "failures": ["plan X: output bytes differ"]}))
    assert "| no | **0.760x** | (64, 128, 4, 2, 168) | 0.730x |" in text
    assert "plan X: output bytes differ" in text


def test_triton_attn_refuses_bad_arguments_with_exit_2(capsys):
    mod = _load("triton_attn_h200")
    assert mod.main(["--seqlen", "100"]) == 2
    assert "--seqlen" in capsys.readouterr().err
