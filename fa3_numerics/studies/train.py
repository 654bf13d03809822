"""`train`: fine-tuning a causal LM with every attention layer's forward and backward by a recipe.

Exposed: ``TrainStudy``, ``DEFAULT_VARIANTS``, ``BASELINE``, ``TRAIN_FORMAT``, ``batch_starts``.

The model is loaded as ``capture`` loads it (float32, its attention routed through ``fa3n_capture``;
``data.capture.load_model``) and copied once per run: the baseline (default ``exact``: float32
tile-by-tile attention, forward and backward) and each variant. Every run starts from the same
weights and sees the same batches (step ``t``'s windows of ``tokens + 1`` tokens of the text drawn
from ``numpy.random.default_rng([seed, t])``, so a resumed run draws what an uninterrupted one
draws). Each attention call of every layer goes through ``numerics.attention_autograd`` (the
recipe's emulated forward, and its emulated backward from that forward's O and LSE) under
``data.capture.attention_override``; everything else is the model's own float32 code, with TF32
off. The model stays in eval mode (no dropout: its attention dropout is 0 and nothing else
draws random numbers), AdamW (betas 0.9/0.95, eps 1e-8, no weight decay) at a constant ``lr``,
no gradient clipping (clipping would hide a gradient that grows), the loss the mean next-token
cross-entropy of the batch.

Per step, per run: the loss (before the update) and the gradient norm of each decoder layer's
parameters (and of all). Every ``probe_every`` steps (step 0 included), the probes:

- gradient cosine: each variant's recipe run on the baseline's weights and batch (an extra
  forward and backward that updates nothing), its gradient compared layer by layer with the
  baseline's own, so the cosine measures the recipe's gradient error and not the drift
  between two trajectories;
- per-call attention error: in each run's own training pass, every layer's call is compared
  with float64 autograd of exact attention on that call's Q, K, V and dO
  (``numerics.backward_reference``): rel_l2 of O, dQ, dK, dV (``metrics.per_sample``, mean over
  batch and heads).

Checkpoints: every ``checkpoint_every`` steps and at the end, the weights, AdamW's state and the
metrics so far of every run go into one ``engine.cache.CellStore`` cell (npz, no pickle), keyed
by everything that decides the numbers but the step count; the previous checkpoint is dropped
once the next is whole. A rerun resumes from the latest (more steps continue it, fewer read the
metrics from it) and gives bit-identical metrics. The dataset and its findings are assembled by
``studies.train_dataset``.
"""

from __future__ import annotations

import copy
import math
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..engine.study import Study, StudyContext, StudyOption
from .stored import StoredFindings
from ..errors import require
from ..numerics.recipe import Recipe, parse_recipes

DEFAULT_VARIANTS = ("fa3-fp8-bwd-bf16",)
BASELINE = "exact"
TRAIN_FORMAT = "fa3-numerics-train/1"
GRADS = ("o", "dq", "dk", "dv")
STUDY_MODULES = ("fa3_numerics.studies.train", "fa3_numerics.numerics.attention_autograd",
                 "fa3_numerics.studies.impact_model")
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batch_starts(seed: int, step: int, batch: int, n_tokens: int, window: int) -> np.ndarray:
    """Start offsets of step ``step``'s ``batch`` windows of ``window`` tokens in a text of
    ``n_tokens``: a function of (seed, step) alone, so a resumed run draws the same batches."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - window + 1, size=batch)


class _Runs:
    """The runs' weights, optimizers and metrics; one checkpoint cell holds all of it."""

    def __init__(self, models: list, lr: float, steps: int, probes: int, layers: int, candidates: int):
        self.models = models
        self.opts = [torch.optim.AdamW(m.parameters(), lr=lr, **ADAMW) for m in models]
        nv = len(models)
        self.m = {
            "loss": np.full((steps, nv), np.nan),
            "grad_norm": np.full((steps, nv, layers), np.nan),
            "grad_norm_total": np.full((steps, nv), np.nan),
            "grad_cos": np.full((probes, candidates, layers), np.nan),
            "grad_cos_total": np.full((probes, candidates), np.nan),
            "attn_rel_l2": np.full((probes, nv, layers, len(GRADS)), np.nan),
            "step_seconds": np.full(steps, np.nan),
        }

    def arrays(self, done: int, probe_every: int) -> dict:
        """Everything a checkpoint after ``done`` steps holds, as numpy arrays."""
        out = {"done": np.array(done)}
        probes = -(-done // probe_every)
        for k, a in self.m.items():
            out[f"m.{k}"] = a[:probes] if k in ("grad_cos", "grad_cos_total", "attn_rel_l2") else a[:done]
        for i, (model, opt) in enumerate(zip(self.models, self.opts)):
            for name, p in model.named_parameters():
                out[f"r{i}.w.{name}"] = p.detach().cpu().numpy()
                st = opt.state.get(p)
                if st:
                    out[f"r{i}.avg.{name}"] = st["exp_avg"].cpu().numpy()
                    out[f"r{i}.sq.{name}"] = st["exp_avg_sq"].cpu().numpy()
                    out[f"r{i}.n.{name}"] = np.array(float(st["step"]))
        return out

    def restore(self, got: dict, weights: bool) -> int:
        """Load a checkpoint (``weights``: the models and optimizers too); the steps it holds."""
        done = int(got["done"])
        for k, a in self.m.items():
            src = got[f"m.{k}"]
            n = min(len(src), len(a))
            a[:n] = src[:n]
        if weights:
            for i, (model, opt) in enumerate(zip(self.models, self.opts)):
                for name, p in model.named_parameters():
                    with torch.no_grad():
                        p.copy_(torch.from_numpy(got[f"r{i}.w.{name}"]))
                    if f"r{i}.avg.{name}" in got:
                        opt.state[p] = {"step": torch.tensor(float(got[f"r{i}.n.{name}"]), dtype=torch.float32),
                                        "exp_avg": torch.from_numpy(got[f"r{i}.avg.{name}"]).to(p.device),
                                        "exp_avg_sq": torch.from_numpy(got[f"r{i}.sq.{name}"]).to(p.device)}
        return done


class TrainStudy(StoredFindings, Study):
    """The study (module docstring) on the ``engine.study`` protocol: options checked when made
    (before the folder is touched or the weights load); ``run`` trains with checkpoints in
    OUT/.cells; ``assemble`` builds the dataset with its findings."""

    kind = "train"
    stem = "train"
    command = "train"
    help = ("Fine-tune a causal LM with every attention layer's forward and backward computed by a recipe "
            "(emulated, through torch.autograd), beside the same run with the baseline recipe from the same "
            "seed: loss curves and their gap, gradient norm and cosine per layer, and the per-call attention "
            "gradient error against float64 autograd. Writes OUT/train.nc and OUT/report.md; checkpoints "
            "in OUT/.cells, so a killed run resumes with bit-identical metrics.")
    options = (
        StudyOption("model", str, "a local HF model folder, a .gguf file, or smollm2 (the packaged GGUF)", "smollm2"),
        StudyOption("text", str, "UTF-8 text file to train on (default: the built-in prose, pydoc topics)",
                    "built-in"),
        StudyOption("tokens", int, "tokens per sequence (the sequence length of every attention call)", 256),
        StudyOption("batch", int, "sequences per step", 4),
        StudyOption("steps", int, "optimizer steps", 300),
        StudyOption("lr", float, "AdamW learning rate (constant)", 1e-4),
        StudyOption("variants", str, "recipes to train with: presets or specs with bwd.* keys, comma-separated "
                    "presets, ';' between specs", ",".join(DEFAULT_VARIANTS)),
        StudyOption("baseline", str, "the recipe every variant is compared with, from the same seed", BASELINE),
        StudyOption("seed", int, "seed of the batches and of the recipes' rotations", 0),
        StudyOption("device", str, "cpu or cuda[:N]", "cpu"),
        StudyOption("checkpoint_every", int, "steps between checkpoints (a killed run resumes from the last)", 50),
        StudyOption("probe_every", int, "steps between probes (gradient cosine on the baseline's weights, per-call "
                    "attention error against float64)", 10),
    )
    examples = (
        "fa3-numerics train                                   # SmolLM2, fa3-fp8-bwd-bf16 against exact, 300 steps",
        "fa3-numerics train --device cuda --variants fa3-fp8-bwd-bf16,cudnn-fp8 --out results/train-smollm2",
        "fa3-numerics train --model tiny-llama/ --tokens 64 --steps 20 --variants sagebwd --device cpu",
    )

    def __init__(self, *, model: str = "smollm2", text: str | Path | None = None, tokens: int = 256, batch: int = 4,
                 steps: int = 300, lr: float = 1e-4, variants: str | None = None, baseline: str = BASELINE,
                 seed: int = 0, device: str = "cpu", checkpoint_every: int = 50, probe_every: int = 10,
                 progress=_stderr, fail_after: int | None = None):
        from ..data import capture as cap
        from ..engine.sampling import check_seed

        for name, val, least in (("tokens", tokens, 2), ("batch", batch, 1), ("steps", steps, 1),
                                 ("checkpoint-every", checkpoint_every, 1), ("probe-every", probe_every, 1)):
            require(isinstance(val, int) and val >= least, f"--{name} must be an integer >= {least}, got {val}")
        require(isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0, f"--lr must be a positive number, got "
                f"{lr}")
        require(device == "cpu" or device.startswith("cuda"), f"--device must be cpu or cuda[:N], got {device!r}")
        if device.startswith("cuda"):
            require(torch.cuda.is_available(), "--device cuda: no CUDA GPU is visible; pass --device cpu")
        check_seed(seed, "--seed")
        base = parse_recipes(baseline or BASELINE)
        require(len(base) == 1, f"--baseline takes one recipe, got {len(base)}")
        runs = base + parse_recipes(variants if variants is not None else ",".join(DEFAULT_VARIANTS))
        require(len(runs) >= 2, "--variants is empty; pass at least one recipe to train with")
        labels = []
        for label, _ in runs:  # the baseline may be a variant too (exact against exact: a zero gap)
            n = sum(1 for x in labels if x == label or x.startswith(label + "#"))
            labels.append(label if n == 0 else f"{label}#{n + 1}")
        self.runs = [(lab, r) for lab, (_, r) in zip(labels, runs)]
        self.src_text, self.text_source = cap.read_text(text) if text not in (None, "built-in") else cap.default_text()
        self.src = cap.resolve_model(model)
        cap.require_capture_deps(gguf=self.src.gguf_file is not None)
        cap.preflight(self.src, None, tokens + 1, self.src_text, self.text_source)  # no weights
        self.text = None if text in (None, "built-in") else text
        self.tokens, self.batch, self.steps, self.lr, self.seed, self.device = tokens, batch, steps, float(lr), seed, device
        self.checkpoint_every, self.probe_every = checkpoint_every, probe_every
        self.progress = progress
        self.fail_after = fail_after  # tests: raise after this many steps (a killed run)

    @classmethod
    def from_options(cls, **values) -> "TrainStudy":
        return cls(**{k: v for k, v in values.items() if v is not None})

    def describe(self) -> str:
        return (f"train: {self.src.label}, {self.steps} steps of {self.batch} x {self.tokens} tokens, "
                f"{', '.join(lab for lab, _ in self.runs[1:])} against {self.runs[0][0]} on {self.device}")

    # -- the model's attention -------------------------------------------------------------------
    @contextmanager
    def _attention(self, recipe: Recipe, observe=None):
        """Within the block every attention call of the model runs ``recipe`` through the autograd
        Function; ``observe(layer, scale, q, k, v, do, gradients)`` is called from each backward."""
        from ..data import capture as cap
        from ..numerics.attention_autograd import recipe_attention
        from .impact_model import causal_call

        def attend(module, query, key, value, attention_mask, *args, **kwargs):
            idx, scale = causal_call(module, query, key, attention_mask, kwargs, "train")
            require(not kwargs.get("dropout"), f"layer {idx} asks for attention dropout; train runs without it")
            obs = None if observe is None else (lambda *a, _i=idx, _s=scale: observe(_i, _s, *a))
            o = recipe_attention(recipe, query, key, value, causal=True, softmax_scale=scale,
                                 rotation_seed=self.seed, observe=obs)
            return o.transpose(1, 2).contiguous(), None

        with cap.attention_override(attend):
            yield

    def _loss(self, model, recipe: Recipe, ids: torch.Tensor, observe=None) -> torch.Tensor:
        with self._attention(recipe, observe):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    # -- the run -----------------------------------------------------------------------------------
    def run(self, ctx: StudyContext | None):
        from ..data import capture as cap
        from ..engine.sampling import deterministic_matmuls

        t_start = time.perf_counter()
        deterministic_matmuls()
        progress, device = self.progress, self.device
        m0, tok, src = cap.load_model(self.src, log=progress, device=device)
        t_load = time.perf_counter() - t_start
        stream = torch.tensor(tok(self.src_text)["input_ids"], dtype=torch.long)
        window = self.tokens + 1
        require(len(stream) >= window, f"the text ({self.text_source}) has {len(stream)} tokens, fewer than --tokens "
                f"{self.tokens} + 1; pass a longer --text file or a smaller --tokens")
        cap.check_context(m0, self.tokens)
        layers = int(m0.config.num_hidden_layers)
        groups = self._layer_groups(m0, layers)
        steps, pe = self.steps, self.probe_every
        probes = -(-steps // pe)
        context = {"study": "train", "model_sha256": cap.model_sha256(src),
                   "text_sha256": __import__("hashlib").sha256(self.src_text.encode()).hexdigest(),
                   "tokens": self.tokens, "batch": self.batch, "lr": self.lr, "adamw": str(ADAMW), "seed": self.seed,
                   "runs": [r.spec() for _, r in self.runs], "probe_every": pe, "device": device.split(":")[0],
                   "torch": torch.__version__, "transformers": __import__("transformers").__version__}
        store = (ctx.cells(context, STUDY_MODULES, device=device) if ctx is not None else None)
        runs = _Runs([copy.deepcopy(m0) for _ in self.runs], self.lr, steps, probes, layers, len(self.runs) - 1)
        start, resumed = 0, None
        index_key = store.key({"latest": True}) if store is not None else None
        latest = store.get(index_key) if store is not None else None
        if latest is not None:
            got = store.get(store.key({"checkpoint": int(latest["done"])}))
            if got is not None:
                start = runs.restore(got, weights=int(got["done"]) < steps)
                start = min(start, steps)
                resumed = int(got["done"])
                progress(f"resumed from the checkpoint after step {resumed}" + (
                    f" (holds {resumed} steps: the first {steps} are read from it)" if resumed >= steps else ""))
        t_train = time.perf_counter()
        for step in range(start, steps):
            t0 = time.perf_counter()
            starts = batch_starts(self.seed, step, self.batch, len(stream), window)
            ids = torch.stack([stream[s:s + window] for s in starts]).to(device)
            self._step(runs, step, ids, groups)
            runs.m["step_seconds"][step] = time.perf_counter() - t0
            done = step + 1
            line = ", ".join(f"{lab} {runs.m['loss'][step, i]:.4f}" for i, (lab, _) in enumerate(self.runs))
            progress(f"step {done}/{steps}: loss {line} ({runs.m['step_seconds'][step]:.2f} s)")
            if store is not None and (done % self.checkpoint_every == 0 or done == steps):
                self._checkpoint(store, index_key, runs, done, resumed)
                resumed = done
            if self.fail_after is not None and done >= self.fail_after:
                raise RuntimeError(f"killed after step {done} (test)")
        times = {"load": t_load, "train": time.perf_counter() - t_train, "total": time.perf_counter() - t_start}
        info = {"study": self, "src": src, "model_sha256": context["model_sha256"], "layers": layers,
                "n_tokens": len(stream), "resumed_from": -1 if start == 0 else start, "times": times,
                "config": m0.config}
        return info, runs.m

    @staticmethod
    def _layer_groups(model, layers: int) -> list[int]:
        """The decoder layer of each parameter (named_parameters order), -1 for the rest."""
        out = []
        for name, _ in model.named_parameters():
            m = _LAYER.search(name)
            out.append(int(m.group(1)) if m and int(m.group(1)) < layers else -1)
        require(any(g >= 0 for g in out), "the model has no parameters under layers.N; train supports decoder-only "
                "models laid out as Llama, Mistral and Qwen2 are")
        return out

    def _step(self, runs: _Runs, step: int, ids: torch.Tensor, groups: list[int]) -> None:
        from ..numerics.backward_reference import reference_gradients
        from ..numerics.metrics import per_sample

        probe = step % self.probe_every == 0
        pi = step // self.probe_every
        layers = runs.m["grad_norm"].shape[2]
        for i, ((_, recipe), model, opt) in enumerate(zip(self.runs, runs.models, runs.opts)):
            observe = None
            if probe:
                def observe(layer, scale, q, k, v, do, g, _i=i):
                    ref = reference_gradients(q, k, v, do, causal=True, softmax_scale=scale)
                    got = (g.forward.o, g.dq, g.dk, g.dv)
                    for j, (a, b) in enumerate(zip(got, ref)):
                        runs.m["attn_rel_l2"][pi, _i, layer, j] = float(np.mean(per_sample(a, b)["rel_l2"]))
            opt.zero_grad(set_to_none=True)
            loss = self._loss(model, recipe, ids, observe)
            loss.backward()
            runs.m["loss"][step, i] = float(loss.detach())
            params = [p for p in model.parameters()]
            sq = _group_sq(params, groups, layers)
            runs.m["grad_norm"][step, i] = np.sqrt(sq[:layers])
            runs.m["grad_norm_total"][step, i] = math.sqrt(sum(sq))
            if i == 0 and probe and len(self.runs) > 1:
                self._cosine(runs, model, ids, params, groups, layers, pi)
            opt.step()

    def _cosine(self, runs: _Runs, model, ids, params, groups, layers, pi) -> None:
        """Each variant's gradient on the baseline's weights and batch against the baseline's own,
        per layer; the baseline's gradient is put back untouched before its update."""
        base = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        for c, (_, recipe) in enumerate(self.runs[1:]):
            for p in params:
                p.grad = None
            self._loss(model, recipe, ids).backward()
            dot = np.zeros(layers + 1)
            na = np.zeros(layers + 1)
            nb = np.zeros(layers + 1)
            for p, g0, grp in zip(params, base, groups):
                if p.grad is None or g0 is None:
                    continue
                a, b = p.grad.detach().double(), g0.double()
                j = grp if grp >= 0 else layers
                dot[j] += float((a * b).sum())
                na[j] += float((a * a).sum())
                nb[j] += float((b * b).sum())
            with np.errstate(invalid="ignore", divide="ignore"):
                runs.m["grad_cos"][pi, c] = dot[:layers] / np.sqrt(na[:layers] * nb[:layers])
                runs.m["grad_cos_total"][pi, c] = dot.sum() / math.sqrt(na.sum() * nb.sum())
        for p, g0 in zip(params, base):
            p.grad = g0

    def _checkpoint(self, store, index_key, runs: _Runs, done: int, previous: int | None) -> None:
        t0 = time.perf_counter()
        store.put(store.key({"checkpoint": done}), runs.arrays(done, self.probe_every))
        store.put(index_key, {"done": np.array(done)})
        if previous is not None and previous != done:
            store.drop(store.key({"checkpoint": previous}))
        self.progress(f"checkpoint after step {done} ({time.perf_counter() - t0:.1f} s)")

    def assemble(self, results):
        from .train_dataset import assemble

        return assemble(*results)

    def nonfinite(self, ds) -> list:
        from .train_dataset import nonfinite

        return nonfinite(ds)

    def summary(self, ds) -> str:
        from .train_dataset import summary

        return summary(ds)


def _group_sq(params, groups: list[int], layers: int) -> list[float]:
    """Sum of squared gradient entries per decoder layer, then of the rest (float64)."""
    sq = [0.0] * (layers + 1)
    for p, g in zip(params, groups):
        if p.grad is not None:
            sq[g if g >= 0 else layers] += float(p.grad.detach().double().pow(2).sum())
    return sq


__all__ = ["TrainStudy", "DEFAULT_VARIANTS", "BASELINE", "TRAIN_FORMAT", "batch_starts", "GRADS"]
