"""The public Python API as a user calls it: ``import fa3_numerics as fa3n`` on their own tensors.

Layouts (bshd and bhsd give the same numbers, transposed), every way of naming a recipe, the
refusals (one line each, before any computation), and ``evaluate``'s metrics against an
independent float64 computation written here."""

from __future__ import annotations

import json
import math
import pydoc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fa3_numerics as fa3n
from fa3_numerics.errors import NonFiniteError, UsageError

ROOT = Path(__file__).resolve().parent.parent


def _qkv(b=1, h=4, hkv=2, n=96, nk=None, d=64, seed=0, outliers=True):
    """bhsd float32 Q, K, V: N(0,1) with N(0,100) outliers on 1% of entries."""
    g = torch.Generator().manual_seed(seed)

    def draw(heads, length):
        x = torch.randn(b, heads, length, d, generator=g, dtype=torch.float64)
        if outliers:
            x += 10 * torch.randn(x.shape, generator=g, dtype=torch.float64) * (torch.rand(x.shape, generator=g) < 0.01)
        return x.float()

    nk = nk or n
    return draw(h, n), draw(hkv, nk), draw(hkv, nk)


def _naive(q, k, v, *, causal=False, scale=None):
    """softmax(Q K^T scale) V in float64, K/V heads repeated for GQA, causal bottom-right."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        n, nk = q.shape[2], k.shape[2]
        seen = torch.arange(nk)[None, :] <= torch.arange(n)[:, None] + (nk - n)
        s = s.masked_fill(~seen, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def _bshd(*ts):
    return tuple(t.transpose(1, 2).contiguous() for t in ts)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text, text
    return text


# -- layouts and recipes ----------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["fa3-fp8", "fa3-fp16"])
def test_bshd_and_bhsd_give_the_same_numbers_transposed(recipe):
    q, k, v = _qkv()
    o = fa3n.emulate(q, k, v, recipe, layout="bhsd")
    o_s = fa3n.emulate(*_bshd(q, k, v), recipe, layout="bshd")
    assert o.shape == q.shape and o_s.shape == (1, 96, 4, 64)
    assert torch.equal(o_s, o.transpose(1, 2))
    r_s = fa3n.reference(*_bshd(q, k, v), layout="bshd", causal=True)
    assert torch.equal(r_s, fa3n.reference(q, k, v, causal=True).transpose(1, 2))
    # negative control: the same bshd tensors read as bhsd are another attention (and say so)
    with pytest.warns(UserWarning, match="layout='bshd'"):
        wrong = fa3n.emulate(*_bshd(q, k, v), recipe)
    assert wrong.shape == o_s.shape and not torch.allclose(wrong, o_s, atol=1e-2)


def test_every_way_of_naming_a_recipe_is_the_same_recipe():
    """A preset name, its Preset (which raised AttributeError in the emulator), its Recipe, and a
    spec string of preset + override give one output; another recipe gives another."""
    q, k, v = _qkv()
    by_name = fa3n.emulate(q, k, v, "fa3-fp8")
    for same in (fa3n.get_recipe("fa3-fp8"), fa3n.get_recipe("fa3-fp8").recipe, fa3n.PRESETS["fa3-fp8"].recipe.spec()):
        assert torch.equal(fa3n.emulate(q, k, v, same), by_name)
    assert torch.equal(fa3n.emulate(q, k, v, "fa3-fp8,rot=none"),
                       fa3n.emulate(q, k, v, fa3n.get_recipe("fa3-fp8-no-incoherent")))
    assert not torch.equal(fa3n.emulate(q, k, v, "fa3-fp8,rot=none"), by_name)


def test_outputs_are_close_to_an_independent_float64_attention():
    q, k, v = _qkv(nk=160)
    for causal in (False, True):
        want = _naive(q, k, v, causal=causal, scale=0.1)
        assert torch.allclose(fa3n.reference(q, k, v, causal=causal, softmax_scale=0.1), want, atol=1e-12)
        got = fa3n.emulate(q, k, v, "fa3-fp16", causal=causal, softmax_scale=0.1)
        err = (got - want).pow(2).mean().sqrt()
        assert 0 < err < 1e-3  # FP16 rounding, not another attention
        # the FP8 output holds BF16 values exactly, as the kernel returns
        o8 = fa3n.emulate(q, k, v, "fa3-fp8", causal=causal)
        assert torch.equal(o8.to(torch.bfloat16).double(), o8)


def test_gqa_heads_read_the_kv_head_they_belong_to():
    """Q head i reads K/V head i // (heads / kv_heads): the same as K, V expanded that way, and
    not as K, V tiled (head i reads i % kv_heads)."""
    q, k, v = _qkv(h=4, hkv=2)
    o = fa3n.emulate(q, k, v, "fa3-fp8")
    assert torch.equal(o, fa3n.emulate(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), "fa3-fp8"))
    assert not torch.equal(o, fa3n.emulate(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), "fa3-fp8"))


def test_tensors_that_require_grad_are_read_not_differentiated():
    q, k, v = _qkv()
    want = fa3n.evaluate(q, k, v, ["fa3-fp8"])["rmse"].values
    got = fa3n.evaluate(q.requires_grad_(), k, v, ["fa3-fp8"])["rmse"].values
    assert np.array_equal(got, want)
    assert not fa3n.emulate(q, k, v).requires_grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, "numpy"])
def test_any_float_dtype_is_widened_exactly(dtype):
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())  # values every dtype below holds exactly
    want = fa3n.emulate(q.double(), k.double(), v.double(), "fa3-fp8")
    if dtype == "numpy":
        got = fa3n.emulate(*(t.double().numpy() for t in (q, k, v)), "fa3-fp8")
    else:
        got = fa3n.emulate(*(t.to(dtype) for t in (q, k, v)), "fa3-fp8")
    assert torch.equal(got, want)


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_nonfinite_input_is_refused_in_one_line(bad, which):
    qkv = list(_qkv())
    qkv[which] = qkv[which].clone()
    qkv[which][0, 1, 2, 3] = bad
    for fn in (lambda: fa3n.emulate(*qkv), lambda: fa3n.reference(*qkv), lambda: fa3n.evaluate(*qkv)):
        with pytest.raises(UsageError) as exc:
            fn()
        assert f"1 non-finite value(s) in {'QKV'[which]}" in _one_line(exc)


def _shape_cases():
    q, k, v = _qkv()
    return {
        "batch": ((q, k[:, :, :, :].repeat(2, 1, 1, 1), v), "batch sizes differ"),
        "head_dim": ((q, k, v[..., :32]), "head dims differ"),
        "kv_seqlen": ((q, k, v[:, :, :50]), "K and V differ"),
        "gqa": ((q[:, :3], k, v), "not a multiple"),
        "rank": ((q[0], k[0], v[0]), "give 4-D tensors"),
        "unsupported_head_dim": ((q[..., :48], k[..., :48], v[..., :48]), "head dim 48 is not supported"),
        "int": ((q.long(), k, v), "floating-point"),
        "list": (([1.0], k, v), "give 4-D tensors"),
    }


@pytest.mark.parametrize("case", list(_shape_cases()))
def test_mismatched_shapes_are_refused_in_one_line(case):
    args, words = _shape_cases()[case]
    for fn in (fa3n.emulate, fa3n.reference, fa3n.evaluate):
        with pytest.raises(UsageError) as exc:
            fn(*args)
        assert words in _one_line(exc)


def test_bad_arguments_are_refused_in_one_line():
    q, k, v = _qkv()
    calls = {
        "layout must be one of": lambda: fa3n.emulate(q, k, v, layout="bsdh"),
        "recipe must be a preset name": lambda: fa3n.emulate(q, k, v, recipe=3),
        "unknown variant 'fa3-fp9'": lambda: fa3n.emulate(q, k, v, recipe="fa3-fp9"),
        "softmax_scale must be a positive finite": lambda: fa3n.reference(q, k, v, softmax_scale=math.nan),
        "causal must be True or False": lambda: fa3n.reference(q, k, v, causal="maybe"),
        "rows must be an integer >= 0": lambda: fa3n.evaluate(q, k, v, ["fa3-fp8"], rows=-1),
        "variants repeat": lambda: fa3n.evaluate(q, k, v, ["fa3-fp8", fa3n.get_recipe("fa3-fp8")]),
        "unknown backend": lambda: fa3n.evaluate(q, k, v, ["fa3-fp8"], backend="nope"),
        "seed must be integers": lambda: fa3n.emulate(q, k, v, seed=-1),
    }
    for words, call in calls.items():
        with pytest.raises(UsageError) as exc:
            call()
        assert words in _one_line(exc), words


# -- evaluate -------------------------------------------------------------------------------------

def _rmse(o, ref):
    return (o - ref).pow(2).mean(dim=(2, 3)).sqrt().numpy()  # per (batch, head)


@pytest.mark.parametrize("rows", [0, 40])
def test_evaluate_rmse_equals_an_independent_float64_computation(rows):
    q, k, v = _qkv(b=2, h=4, hkv=2, n=96, seed=3)
    variants = ["fa3-fp8", "fa3-fp16", "baseline-fp8"]
    ds = fa3n.evaluate(*_bshd(q, k, v), variants, layout="bshd", causal=True, rows=rows, seed=5)
    assert ds["rmse"].dims == ("variant", "seed", "batch", "head") and ds["rmse"].shape == (3, 1, 2, 4)
    ref = _naive(q, k, v, causal=True)
    # the rows the dataset says it evaluated, by its own recorded rule
    assert ds.attrs["rows_sampling"] == "torch.randperm(seqlen, generator=manual_seed(seed * 1000003 + 17))[:rows]"
    idx = (torch.randperm(96, generator=torch.Generator().manual_seed(5 * 1000003 + 17))[:rows].sort().values
           if rows else torch.arange(96))
    assert int(ds["rows"]) == len(idx)
    for name in variants:
        o = fa3n.emulate(q, k, v, name, causal=True, seed=5)
        want = _rmse(o[:, :, idx], ref[:, :, idx])
        np.testing.assert_allclose(ds["rmse"].sel(variant=name, seed=5).values, want, rtol=1e-9)
    table = fa3n.summary(ds).set_index("variant")
    for name in variants:
        per = ds["rmse"].sel(variant=name).values.ravel()
        assert table.loc[name, "value"] == pytest.approx(float(np.sqrt(np.mean(per ** 2))), rel=1e-12)
        assert table.loc[name, "lo"] <= table.loc[name, "value"] <= table.loc[name, "hi"]
        assert table.loc[name, "n"] == 8
    # outliers: the rotation and block scales of fa3-fp8 beat per-tensor FP8; FP16 beats both
    assert table.loc["fa3-fp16", "value"] < table.loc["fa3-fp8", "value"] < table.loc["baseline-fp8", "value"]


def test_evaluate_dataset_is_a_run_dataset_with_provenance(tmp_path):
    from fa3_numerics.engine.dataset import dataset_kind, write
    from fa3_numerics.numerics.metrics import METRICS

    q, k, v = _qkv()
    ds = fa3n.evaluate(q, k, v, [fa3n.get_recipe("fa3-fp8"), "fa3-fp8,bn=128"])
    assert list(ds["variant"].values) == ["fa3-fp8", "fa3-fp8,bn=128"]
    assert set(METRICS) <= set(ds.data_vars) and dataset_kind(ds) == "run"
    a = ds.attrs
    for key in ("git_commit", "device_name", "version_torch", "created_utc", "inputs_sha256", "command"):
        assert a[key], key
    assert a["layout"] == "bhsd" and a["seqlen_k"] == 96 and "fa3_numerics.evaluate(" in a["command"]
    assert list(ds["spec"].values) == [fa3n.get_recipe("fa3-fp8").recipe.spec(),
                                       fa3n.Recipe.from_str("fa3-fp8,bn=128").spec()]
    # the |x| histogram counts every entry of Q, K and V
    assert ds["abs_hist"].sel(seed=0).sum("abs_bin").values.tolist() == [q.numel(), k.numel(), v.numel()]
    # the inputs' fingerprint tells other tensors apart
    assert fa3n.evaluate(q, k, v * 2, ["fa3-fp8"]).attrs["inputs_sha256"] != a["inputs_sha256"]
    back = fa3n.open_dataset(write(ds, tmp_path / "e.nc"))
    assert float(back["rmse"].sum()) == pytest.approx(float(ds["rmse"].sum()), rel=1e-15)
    res = fa3n.compare(back, ds)
    assert res["paired"] and all(r["ratio"] == pytest.approx(1.0) for r in res["rows"])


def test_nonfinite_outputs_raise_with_the_dataset_or_warn():
    """FP16 has no 1e5: the output overflows to Inf while the float64 reference is finite."""
    q, k, v = _qkv(outliers=False)
    v = v * 0 + 1e5
    with pytest.raises(NonFiniteError) as exc:
        fa3n.evaluate(q, k, v, ["fa3-fp16", "exact"])
    assert "variant 'fa3-fp16'" in _one_line(exc)
    ds = exc.value.dataset
    assert int(ds["nonfinite"].sel(variant="fa3-fp16").sum()) == q.numel()
    assert int(ds["nonfinite"].sel(variant="exact").sum()) == 0
    with pytest.warns(RuntimeWarning, match="non-finite results: variant 'fa3-fp16'"):
        fa3n.evaluate(q, k, v, ["fa3-fp16"], allow_nonfinite=True)


def test_open_dataset_refuses_other_files_in_one_line(tmp_path):
    junk = tmp_path / "junk.nc"
    junk.write_text("not a dataset")
    for path, words in ((junk, "is not a netCDF dataset"), (tmp_path / "missing.nc", "no such file")):
        with pytest.raises(UsageError) as exc:
            fa3n.open_dataset(path)
        assert words in _one_line(exc)


@pytest.mark.parametrize("rel, kind", [("reports/impact-smollm2/impact.nc", "impact"),
                                       ("reports/recommend-smollm2/recommend.nc", "recommend"),
                                       ("reports/backward/k-bias/backward.nc", "backward"),
                                       ("reports/train-smollm2-cpu/train.nc", "train"),
                                       ("reports/h200/validation.nc", "validation")])
def test_open_dataset_reads_every_study_s_dataset_with_its_findings(rel, kind):
    from fa3_numerics.engine.dataset import dataset_kind

    ds = fa3n.open_dataset(ROOT / rel)
    assert dataset_kind(ds) == kind and ds.attrs["findings"]


def test_validate_runs_the_whole_path_with_the_stand_in():
    ds = fa3n.validate("tiny", backend="fa3-mock", device="cpu", accs=["fp32"])
    assert ds.sizes["case"] == 5 and list(ds["acc"].values) == ["fp32"]
    assert np.isfinite(ds["fidelity"].values).all()


# -- the package --------------------------------------------------------------------------------

def test_help_lists_the_api_and_import_stays_light():
    text = pydoc.render_doc(fa3n, renderer=pydoc.plaintext)
    for name in ("emulate", "reference", "evaluate", "summary", "validate", "compare", "open_dataset",
                 "read_impact", "load_capture", "recommend"):
        assert f"    {name}(" in text, name
    assert set(fa3n.__all__) <= set(dir(fa3n))
    code = "import sys, fa3_numerics; print(json.dumps(sorted(m for m in ('torch', 'xarray', 'numpy') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []  # the names import their modules on first use
    from fa3_numerics.studies.recommend import recommend as study

    assert fa3n.recommend.__module__ == "fa3_numerics.api" and callable(study)


def test_recommend_from_python_refuses_bad_input_in_one_line():
    with pytest.raises(fa3n.UsageError, match="unknown --target .no-such-engine.; choose one of fa3"):
        fa3n.recommend("smollm2", target="no-such-engine")


def test_the_example_notebook_runs_and_finds_what_it_says():
    """docs/example.ipynb's code cells in order, in a fresh namespace (no Jupyter needed)."""
    nb = json.loads((ROOT / "docs" / "example.ipynb").read_text())
    assert nb["nbformat"] == 4
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(cells) >= 4
    ns: dict = {"__name__": "__main__"}
    for cell in cells:
        exec(compile("".join(cell["source"]), "example.ipynb", "exec"), ns)  # noqa: S102
    table = ns["table"].set_index("variant")
    # what the notebook's text claims: FA3's FP8 recipe beats per-tensor FP8 on outliers, and the
    # RMSE it computes by hand from emulate/reference is evaluate's
    assert table.loc["fa3-fp8", "hi"] < table.loc["baseline-fp8", "lo"]
    assert ns["by_hand"] == pytest.approx(table.loc["fa3-fp8", "value"], rel=1e-9)
    per_head = ns["ds"]["rmse"].sel(seed=0, batch=0)
    assert (per_head.sel(variant="fa3-fp8") < per_head.sel(variant="fa3-fp8-no-incoherent")).all()
    # the stored outputs are this code's: the notebook was executed as committed
    printed = "".join(t for c in cells for o in c["outputs"] if o["output_type"] == "stream" for t in o["text"])
    assert f"{ns['by_hand']:.3e}" in printed
