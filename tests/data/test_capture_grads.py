"""``capture --grads`` (data/capture_grads.py): dO per layer from a real backward pass.

Checked on a tiny random Llama (the studies' tiny model builders): the recorded dO of every layer
equals the gradient of the same next-token loss with respect to the attention output, computed
independently (autograd through the plain SDPA model, at the input of each layer's o_proj); the
forward's Q, K, V are those of a capture without --grads; the file round-trips with its provenance;
and bad requests are refused with the fix.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fa3_numerics.data import capture as cap  # noqa: E402
from fa3_numerics.errors import UsageError  # noqa: E402

TOKENS = 40


def _builders():
    # the tiny-model builders of tests/studies/conftest.py (a word tokenizer, save_pretrained)
    spec = importlib.util.spec_from_file_location("_tiny_models", Path(__file__).parents[1] / "studies" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    b = _builders()
    tok = b.word_tokenizer(400, by_frequency=True)
    cfg = LlamaConfig(vocab_size=len(tok.get_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                      initializer_range=0.15, rope_theta=10000.0)
    torch.manual_seed(0)
    return b.save_model(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("grads") / "tiny-llama")


@pytest.fixture(scope="module")
def grads_capture(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("gcap") / "g.safetensors"
    cap.capture(model=str(tiny), out=out, tokens=TOKENS, grads=True)
    return out


def _independent_do(folder, tokens):
    """dL/dO per layer by autograd through transformers' own SDPA model: the input of o_proj is O
    (batch, seq, heads * dim); the loss is the mean next-token cross-entropy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", torch_dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    text, source = cap.default_text()
    ids = cap.tokenize(tok, text, tokens, source)
    seen = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
             for i, layer in enumerate(model.model.layers)]
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        grads = torch.autograd.grad(loss, [seen[i] for i in sorted(seen)])
    finally:
        for h in hooks:
            h.remove()
    heads = model.config.num_attention_heads
    out = {i: g[0].reshape(tokens, heads, -1).transpose(0, 1).double() for i, g in zip(sorted(seen), grads)}
    return out, float(loss.detach())


def test_do_is_the_gradient_of_the_loss_wrt_each_attention_output(tiny, grads_capture):
    c = cap.load_capture(grads_capture)
    want, loss = _independent_do(tiny, TOKENS)
    assert c.has_grads and c.grads["loss_value"] == pytest.approx(loss, rel=1e-6)
    assert c.grads["predicted_tokens"] == TOKENS - 1 and c.grads["tokens"] == TOKENS
    for i in c.layers:
        got = c.do(i)
        assert got.shape == (c.heads, TOKENS, c.head_dim)
        scale = float(want[i].abs().max())
        assert scale > 0
        assert float((got - want[i]).abs().max()) <= 1e-5 * scale, i
    # negative control: the layers' gradients differ, so a mix-up of layers would be caught
    assert float((c.do(0) - want[1]).abs().max()) > 1e-2 * float(want[1].abs().max())


@pytest.mark.slow
def test_grads_leave_q_k_v_as_a_capture_without_them(tiny, grads_capture, tmp_path):
    plain = cap.capture(model=str(tiny), out=tmp_path / "p.safetensors", tokens=TOKENS)
    g = cap.load_capture(grads_capture)
    for i in plain.layers:
        for w in "qkv":
            assert torch.equal(getattr(g, w)(i), plain.tensors[f"layers.{i}.{w}"].double()), (i, w)
    assert not cap.load_capture(tmp_path / "p.safetensors").has_grads
    with pytest.raises(UsageError, match="capture --grads"):
        cap.load_capture(tmp_path / "p.safetensors").do(0)


@pytest.mark.slow
def test_grads_of_some_layers_only(tiny, grads_capture, tmp_path):
    c = cap.capture(model=str(tiny), out=tmp_path / "l.safetensors", tokens=TOKENS, layers="1", grads=True)
    assert c.layers == [1] and set(c.tensors) == {f"layers.1.{w}" for w in ("q", "k", "v", "do")}
    assert torch.equal(cap.load_capture(tmp_path / "l.safetensors").do(1), cap.load_capture(grads_capture).do(1))


def test_grads_need_two_tokens(tiny, tmp_path):
    with pytest.raises(UsageError, match="at least 2 tokens"):
        cap.capture(model=str(tiny), out=tmp_path / "one.safetensors", tokens=1, grads=True)
    assert not (tmp_path / "one.safetensors").exists()


def test_a_grads_file_missing_do_is_refused(grads_capture, tmp_path):
    c = cap.load_capture(grads_capture)
    tensors = {k: v for k, v in c.tensors.items() if k != "layers.0.do"}
    cap.save_capture(tmp_path / "bad.safetensors", tensors, c.meta)
    with pytest.raises(UsageError, match="layers.0.do"):
        cap.load_capture(tmp_path / "bad.safetensors")


@pytest.mark.slow
def test_cli_grads_flag(tiny, tmp_path, capsys):
    from fa3_numerics.cli import main

    out = tmp_path / "cli.safetensors"
    with pytest.raises(SystemExit) as exc:
        main(["capture", "--model", str(tiny), "--tokens", "16", "--grads", "--out", str(out)])
    assert exc.value.code in (0, None)
    assert "loss" in capsys.readouterr().out and cap.load_capture(out).has_grads
