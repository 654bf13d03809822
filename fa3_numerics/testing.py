"""Helpers shared by the test suite.

Exposed: ``run_cli``, ``write_capture``.
"""

from __future__ import annotations


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr). ``capsys`` is pytest's fixture."""
    import pytest

    from .cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else (0 if exc.value.code is None else 1)
    return code, out.out, out.err


def write_capture(path, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, tokens: int = 200,
                  layers=(0, 1), seed: int = 0, k_scale: float = 1.0, causal: bool = True) -> dict:
    """A synthetic capture file (N(0,1) Q, K, V; K times ``k_scale``) with the metadata of a real
    one, written with the capture module's own writer. Returns the tensors."""
    import torch

    from .data import capture as cap

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        tensors[f"layers.{i}.q"] = torch.randn(heads, tokens, head_dim, generator=g)
        tensors[f"layers.{i}.k"] = torch.randn(kv_heads, tokens, head_dim, generator=g) * k_scale
        tensors[f"layers.{i}.v"] = torch.randn(kv_heads, tokens, head_dim, generator=g)
    meta = {
        "format": cap.FORMAT, "model": "synthetic", "architecture": "none", "num_layers": str(max(layers) + 1),
        "layers": ",".join(map(str, layers)), "heads": str(heads), "kv_heads": str(kv_heads),
        "head_dim": str(head_dim), "tokens": str(tokens), "causal": "true" if causal else "false",
        "dtype": "float32", "softmax_scale": repr(head_dim ** -0.5), "text_source": "none", "text_sha256": "0" * 64,
        "transformers_version": "none", "torch_version": torch.__version__,
        "rope": '{"rope_theta": 10000.0, "rope_type": "default"}',
    }
    cap.save_capture(path, tensors, meta)
    return tensors
