"""Model families with sliding windows, logit soft-capping and sink logits through ``impact``.

Tiny random-weight models built offline from transformers configs of each family (Gemma 2:
alternating sliding/global layers and a softcap; Gemma 3 text: sliding layers; Mistral: a sliding
window on every layer; gpt-oss: sliding layers and learned sinks), 2 layers, head dim 64, a window
of 8 keys on 40 tokens so that it bites. Two checks per family: the model's own eager attention
(transformers' code, float32) equals our float64 reference pass to float32 rounding, an
independent check of how we read the window, softcap and sinks (with a negative control: the same
reference without them is far off), and ``impact --variants exact`` gives KL <= 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'fa3-numerics[capture]'")
pytest.importorskip("safetensors", reason="needs safetensors: pip install 'fa3-numerics[capture]'")

from fa3_numerics.data import capture as cap  # noqa: E402
from fa3_numerics.engine.backends import get_backend  # noqa: E402
from fa3_numerics.errors import UsageError  # noqa: E402
from fa3_numerics.studies.impact import impact  # noqa: E402
from fa3_numerics.studies.impact_model import ModelRunner, score  # noqa: E402

pytestmark = pytest.mark.slow

TOKENS = 40
WINDOW = 8
QUIET = lambda _msg: None  # noqa: E731


def _config(family: str, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                  initializer_range=0.15, sliding_window=WINDOW)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, query_pre_attn_scalar=64, attn_logit_softcapping=3.0,
                                         final_logit_softcapping=None,
                                         layer_types=["sliding_attention", "full_attention"])
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=64,
                                             layer_types=["sliding_attention", "full_attention"])
    if family == "mistral":
        return transformers.MistralConfig(**common)
    if family == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1,
                                        layer_types=["sliding_attention", "full_attention"])
        return cfg
    raise ValueError(family)


def _model_class(family: str):
    return {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}[family]


FAMILIES = []
for _f in ("gemma2", "gemma3", "mistral", "gpt_oss"):
    _have = hasattr(transformers, _model_class(_f))
    FAMILIES.append(pytest.param(_f, marks=pytest.mark.skipif(
        not _have, reason=f"transformers {transformers.__version__} has no {_model_class(_f)}")))


def _build(family: str, folder: Path, word_tokenizer) -> Path:
    tok = word_tokenizer(499, by_frequency=False, scan=5000)
    torch.manual_seed(0)
    model = getattr(transformers, _model_class(family))(_config(family, len(tok.get_vocab())))
    if family == "gpt_oss":  # sinks large enough to matter (their init is small)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.tensor([1.5, -0.5]))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, tiny_tokenizer):
    folder = _build(request.param, tmp_path_factory.mktemp("coverage") / f"tiny-{request.param}", tiny_tokenizer)
    return request.param, folder


def _runner(folder):
    m, tok, _ = cap.load_model(str(folder))
    text, source = cap.default_text()
    r = ModelRunner(m, cap.tokenize(tok, text, TOKENS, source), backend=get_backend("emulate"))
    r.reference()
    return r


def test_model_eager_attention_equals_our_reference(family, monkeypatch):
    name, folder = family
    r = _runner(folder)
    # the layers really carry what we model
    want = {"gemma2": {"window_size", "softcap"}, "gemma3": {"window_size"}, "mistral": {"window_size"},
            "gpt_oss": {"window_size", "sinks"}}[name]
    got = set().union(*(set(o) for o in r.ref.record.options.values()))
    assert got == want, got
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        stock = eager.eval()(input_ids=r.ids, use_cache=False).logits[0]
    kl = score(r.ref, stock)["kl"]
    assert kl.max() < 1e-8, kl.max()
    # negative controls: a reference that drops the softcap or the sinks is far from the model, and
    # one that drops the window is refused (the model's mask is then not the layer's own)
    orig = cap.attention_options
    for dropped in ({"softcap"}, {"sinks"}, {"window_size"}):
        if not dropped & want:
            continue
        monkeypatch.setattr(cap, "attention_options",
                            lambda m, kw, d=dropped: {k: v for k, v in orig(m, kw).items() if k not in d})
        other = ModelRunner(r.model, r.ids, backend=get_backend("emulate"))
        if dropped == {"window_size"}:
            with pytest.raises(UsageError, match="sliding window"):
                other.reference()
        else:
            assert score(r.ref, other.reference().p.log())["kl"].max() > 1e-4, dropped
    monkeypatch.setattr(cap, "attention_options", orig)


def test_impact_exact_recipe_kl_below_1e_6(family, tmp_path):
    name, folder = family
    ds = impact(model=str(folder), tokens=TOKENS, variants="exact,fa3-fp8-kernel", out=tmp_path / "out",
                progress=QUIET)
    exact = ds.sel(variant="exact", mask="all")
    assert float(exact.kl_max) <= 1e-6 and float(exact.top1_agree) == 1.0
    assert float(ds.kl_mean.sel(variant="fa3-fp8-kernel", mask="all")) > 1e3 * max(float(exact.kl_mean), 1e-15)
    import json

    opts = json.loads(ds.attrs["attention_options"])
    assert opts["0"]["window_size"] == [WINDOW - 1, 0]


def test_recommend_runs_and_picks_exact_under_a_tight_budget(family, tmp_path, capsys):
    import json

    from fa3_numerics.testing import run_cli

    _, folder = family
    out = tmp_path / "r"
    code, stdout, err = run_cli(["recommend", "--model", str(folder), "--tokens", str(TOKENS), "--target", "torchao",
                                 "--add", "exact", "--budget-kl", "1e-6", "--verify", "2", "--out", str(out)], capsys)
    assert code == 0, stdout + err
    art = json.loads((out / "recommend.json").read_text())
    assert art["choice"]["label"] == "exact" and art["choice"]["kl_mean"] <= 1e-6


def test_capture_file_keeps_the_options_and_audit_uses_them(family, tmp_path):
    """A capture file carries each layer's window, softcap and sinks; the audit's exact recipe then
    matches its reference to float32 rounding on every layer (had either side dropped them, the
    error would be of order 1), and the FP8 kernel recipe is measurably worse."""
    from fa3_numerics.data.capture import capture, load_capture
    from fa3_numerics.studies.audit import audit

    name, folder = family
    path = tmp_path / "c.safetensors"
    capture(model=str(folder), out=path, tokens=TOKENS)
    c = load_capture(path)
    opts = c.attention_options(0)
    assert opts["window_size"] == (WINDOW - 1, 0)
    assert ("softcap" in opts) == (name == "gemma2") and ("sinks" in opts) == (name == "gpt_oss")
    ds = audit(c, variants="exact;fa3-fp8-kernel", rows=0, progress=QUIET)
    err = ds["rel_l2"]
    exact = float(err.sel(variant=err["variant"].values[0]).max())
    assert exact < 1e-5, exact
    assert float(err.sel(variant=err["variant"].values[1]).median()) > 10 * exact
