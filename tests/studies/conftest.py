"""Tiny random models for the studies that run a real model (impact, recommend, train, model
coverage): a word-level tokenizer over the default text and a randomly initialised model,
saved as a Hugging Face folder, so the tests need transformers but no download."""

from __future__ import annotations

from pathlib import Path

import pytest


def word_tokenizer(words: int, *, by_frequency: bool, scan: int = 20000):
    """A whitespace word-level tokenizer of the default text's ``words`` most frequent words
    (``by_frequency``) or its first ``words`` distinct ones, with ``[UNK]`` at 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fa3_numerics.data import capture as cap

    text, _ = cap.default_text()
    seen = text.split()[:scan]
    if by_frequency:
        counts: dict[str, int] = {}
        for w in seen:
            counts[w] = counts.get(w, 0) + 1
        chosen = [w for w, _ in sorted(counts.items(), key=lambda x: (-x[1], x[0]))[:words]]
    else:
        chosen = list(dict.fromkeys(seen))[:words]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(chosen)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")


def save_model(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """``word_tokenizer``, for the tests that build other model families."""
    return word_tokenizer


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """``tiny_llama(name, layers=, hidden=, positions=, words=, by_frequency=)``: the folder of a
    random Llama (2 query heads sharing 1 KV head of dim 64, intermediate 2 x hidden), seed 0."""

    def build(name: str, *, layers: int, hidden: int, positions: int, words: int, by_frequency: bool) -> Path:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = word_tokenizer(words, by_frequency=by_frequency)
        cfg = LlamaConfig(vocab_size=len(tok.get_vocab()), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          max_position_embeddings=positions, initializer_range=0.15, rope_theta=10000.0)
        torch.manual_seed(0)
        return save_model(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp(name) / "tiny-llama")

    return build
