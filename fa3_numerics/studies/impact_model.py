"""A causal LM whose attention layers each follow a chosen rule, and the scores of its predictions.

Exposed: ``causal_call``, ``Attn``, ``REF``, ``SDPA_FP32``, ``SDPA_BF16``, ``recipe_attn``, ``ModelRunner``,
``Reference``, ``score``, ``causal_attention64``.

The model is loaded by ``fa3_numerics.data.capture.load_model`` (float32, its attention routed
through the ``fa3n_capture`` function). ``ModelRunner.run(plan)`` runs one forward pass in which
layer ``i`` computes its attention by ``plan[i]``:

- ``REF``: float64 ``softmax(Q K^T * scale) V`` with the causal mask, rounded once to the model's
  float32: the reference every variant is compared with;
- ``SDPA_FP32`` / ``SDPA_BF16``: the model's own SDPA, on float32 inputs (the model as shipped)
  or on Q, K, V cast to BF16 (a BF16 deployment's attention);
- ``recipe_attn(label, recipe)``: the recipe through a backend (``emulate``, ``fa3``, ``sdpa-*``):
  float64 Q, K, V in, the backend's rows out, rounded to float32.

Everything but attention (embeddings, norms, MLPs, the LM head) is the model's own float32
code and is identical in every run, so differences between runs come from attention alone.

Prefix reuse: when layers ``0..L-1`` follow ``REF``, their outputs are exactly the reference
run's (same code, same inputs, same shapes), so ``run(plan, start=L)`` skips them and feeds the
reference's input of layer ``L`` straight in. This is not an approximation: ``impact`` checks
on full runs that the logits are bit-identical (``check_prefix``).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, contextmanager

import numpy as np
import torch

from ..errors import UsageError, require
from ..numerics.metrics import per_sample
from ..numerics.recipe import Recipe
from ..numerics.reference import reference_attention

# Rows of the [rows, vocab] float64 blocks in which next-token distributions are compared
# (bounds memory at 64 x vocab x 8 bytes per temporary, ~25 MB for a 49k vocabulary).
_SCORE_ROWS = 64
# Query rows per block of the float64 reference attention (keys up to the block's end only).
_REF_ROWS = 128


def _allowed(mk, n_q: int, n_k: int, device) -> torch.Tensor:
    """Boolean [n_q, n_k]: the keys each query sees under causal masking and ``mk``'s window."""
    from ..numerics.masking import visible

    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)
    win = visible(mk, torch.arange(n_q, device=device), 0, n_k, n_q, n_k) if mk is not None else None
    return allowed if win is None else allowed & win


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n_q, n_k] additive mask of ``allowed`` as eager attention adds it."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[None, None]


def _plain_causal(mask: torch.Tensor, n_q: int, n_k: int, mk=None) -> bool:
    """Whether an explicit mask is the layer's own causal one (queries aligned to the last keys),
    which transformers releases before 5 pass where later ones pass None, with the layer's sliding
    window when ``mk`` has one: a boolean mask True exactly where a key is visible, or an additive
    one that is 0 there and hugely negative elsewhere."""
    if mask.shape[-2:] != (n_q, n_k) or any(s != 1 for s in mask.shape[:-2]):
        return False
    allowed = _allowed(mk, n_q, n_k, mask.device)
    m = mask.reshape(n_q, n_k)
    if m.dtype == torch.bool:
        return bool(torch.equal(m, allowed))
    blocked = m <= torch.finfo(m.dtype).min / 2 if m.is_floating_point() else torch.zeros_like(allowed)
    return bool(torch.equal(m == 0, allowed) and torch.equal(blocked, ~allowed))


def causal_call(module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict,
                study: str, mk=None) -> tuple[int, float]:
    """(layer index, softmax scale) of one ``fa3n_capture`` attention call, which must be causal
    over unpadded sequences, with the layer's own sliding window where ``mk`` (its
    ``numerics.masking.Masking``) has one (every study that replaces a layer's attention checks this)."""
    idx = int(module.layer_idx)
    if attention_mask is not None and not all(_plain_causal(m[None], query.shape[-2], key.shape[-2], mk)
                                              for m in attention_mask.reshape(-1, *attention_mask.shape[-2:])):
        raise UsageError(f"layer {idx} got an explicit attention mask that is neither causal nor the layer's "
                         f"causal sliding window (padding or a non-causal model); {study} runs unpadded causal "
                         "sequences")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    require(bool(causal), f"layer {idx} is not causal; {study} supports causal language models")
    scale = kwargs.get("scaling")
    scale = float(getattr(module, "scaling", query.shape[-1] ** -0.5) if scale is None else scale)
    return idx, scale


def thread_count() -> tuple[int, str]:
    """(torch intra-op threads for a study on the CPU, why): ``FA3N_THREADS`` when set, else torch's
    default (every core). Never chosen from the machine's load: the model's float32 GEMMs sum in
    another order on another thread count (an ``impact`` run on 1 thread and on 2 differ in the
    last bits of every logit), so a count that followed the load would make one command give other
    numbers on a busy machine. The count is recorded in the dataset (``torch_threads``) and in the
    cells' cache key. On a machine other processes keep busy, ``FA3N_THREADS=1`` is several times
    faster (each small op's OpenMP region waits for a descheduled thread: a float64 reference pass
    of SmolLM2 took 5-15 s with 2 threads and 1.1-2.6 s with 1 at load 2-5 on 2 cores)."""
    from ..env import env_number

    asked = env_number("FA3N_THREADS", 0, integer=True)
    if asked:
        return int(asked), "FA3N_THREADS"
    return torch.get_num_threads(), "torch's default; FA3N_THREADS=1 is faster on a busy machine"


@contextmanager
def cpu_threads(device: str, log=None):
    """Within the block, torch uses ``thread_count()`` threads when ``device`` is the CPU (said to
    ``log``); the caller's count is restored after."""
    if device != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    threads, why = thread_count()
    torch.set_num_threads(threads)
    if log is not None:
        log(f"{threads} CPU thread(s) ({why})")
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@dataclasses.dataclass(frozen=True)
class Attn:
    """How one layer computes its attention."""

    kind: str                      # "ref", "sdpa" or "recipe"
    label: str                     # what reports call it
    recipe: Recipe | None = None   # kind "recipe"
    dtype: str = ""                # kind "sdpa": "fp32" or "bf16"

    def key(self) -> str:
        """Canonical string for cache keys: the full recipe spec, never the label."""
        if self.kind == "recipe":
            return "recipe:" + self.recipe.spec()
        return self.kind + (":" + self.dtype if self.dtype else "")


REF = Attn("ref", "float64 reference")
SDPA_FP32 = Attn("sdpa", "model-sdpa-fp32", dtype="fp32")
SDPA_BF16 = Attn("sdpa", "model-sdpa-bf16", dtype="bf16")


def recipe_attn(label: str, recipe: Recipe) -> Attn:
    return Attn("recipe", label, recipe=recipe)


def causal_attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention for prefill (seqlen_q == seqlen_k): [1, H, n, d] from Q and
    [1, Hkv, n, d] K, V. Same arithmetic as ``numerics.reference.reference_attention`` (the tests
    compare the two) but cheaper, since the model calls it in every layer of most passes: each
    block of query rows multiplies only the keys up to its last row (masked keys contribute exact
    zeros anyway), and the query heads that share a KV head are stacked into one matrix, so K and
    V are never expanded."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    q = q.to(torch.float64).reshape(b, hkv, g, n, d)
    k, v = k.to(torch.float64), v.to(torch.float64)
    out = torch.empty(b, hkv, g, n, v.shape[-1], dtype=torch.float64, device=q.device)
    for a in range(0, n, _REF_ROWS):
        e = min(n, a + _REF_ROWS)
        r = e - a
        qa = q[:, :, :, a:e].reshape(b, hkv, g * r, d)
        s = torch.matmul(qa, k[:, :, :e].transpose(-1, -2)).mul_(scale)           # [b, hkv, g*r, e]
        upper = torch.ones(r, r, dtype=torch.bool, device=q.device).triu_(1)
        s.view(b, hkv, g, r, e)[..., a:e].masked_fill_(upper, float("-inf"))
        p = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()
        o = torch.matmul(p, v[:, :, :e]).div_(p.sum(dim=-1, keepdim=True))
        out[:, :, :, a:e] = o.view(b, hkv, g, r, -1)
    return out.reshape(b, h, n, v.shape[-1])


def _lse_dot(x: torch.Tensor, p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """float64 logsumexp of logits rows ``x`` and their dot product with ``p``. One helper for the
    reference and every pass, so identical logits give bit-identical results (a KL of exactly 0)."""
    x64 = x.to(torch.float64)
    lse = torch.logsumexp(x64, dim=-1)
    dot = (p * x64).sum(dim=-1) if p is not None else None
    return lse, dot, x64


@dataclasses.dataclass
class Reference:
    """The reference run: its next-token distributions and what later runs reuse."""

    p: torch.Tensor               # [n, vocab] float64 probabilities
    lse: torch.Tensor             # [n] float64 logsumexp of the logits
    dot: torch.Tensor             # [n] float64 sum_v p x (x: the logits)
    pred: np.ndarray              # [n] argmax token ids
    nll: np.ndarray               # [n] -log p(next token); NaN at the last position (no target)
    entropy: np.ndarray           # [n] entropy of the distribution, nats
    targets: torch.Tensor         # [n - 1] the next tokens
    hidden: dict = dataclasses.field(default_factory=dict)   # layer -> its input hidden states
    attn: dict = dataclasses.field(default_factory=dict)     # layer -> float64 attention output [1, H, n, d]
    record: object = None         # the capture recorder: Q, K, V of every layer
    scale: float = float("nan")   # the layers' softmax scale
    nonfinite: dict = dataclasses.field(default_factory=dict)  # as in ``score``

    @classmethod
    def from_logits(cls, logits: torch.Tensor, targets: torch.Tensor | None = None) -> "Reference":
        """Distributions of logits [n, vocab] (float64 throughout); ``targets`` the next tokens."""
        n, vocab = logits.shape
        p = torch.empty(n, vocab, dtype=torch.float64, device=logits.device)
        lse = torch.empty(n, dtype=torch.float64, device=logits.device)
        for a in range(0, n, _SCORE_ROWS):
            e = min(n, a + _SCORE_ROWS)
            lse[a:e], _, x64 = _lse_dot(logits[a:e], None)
            p[a:e] = torch.exp(x64 - lse[a:e, None])
        dot = torch.empty_like(lse)
        for a in range(0, n, _SCORE_ROWS):  # the same helper and rows as ``score`` uses
            e = min(n, a + _SCORE_ROWS)
            _, dot[a:e], _ = _lse_dot(logits[a:e], p[a:e])
        nll = np.full(n, np.nan)
        if targets is None:
            targets = torch.zeros(n - 1, dtype=torch.long, device=logits.device)
        else:
            x_t = logits[:-1].gather(1, targets[:, None])[:, 0].to(torch.float64)
            nll[:-1] = (lse[:-1] - x_t).cpu().numpy()
        return cls(p=p, lse=lse, dot=dot, pred=logits.argmax(dim=-1).cpu().numpy(), nll=nll,
                   entropy=(lse - dot).cpu().numpy(), targets=targets,
                   nonfinite={"logits": int((~torch.isfinite(logits)).sum())})


def score(ref: Reference, logits: torch.Tensor) -> dict:
    """Per-token comparison of ``logits`` [n, vocab] with the reference, in float64.

    kl[t] = sum_v p_ref (log p_ref - log p) (nats), evaluated as (lse - lse_ref) - sum_v p_ref
    (x - x_ref): two passes over the vocabulary instead of four, exactly 0 when the logits are
    identical, and accurate to ~1e-14 absolute. nll[t] = -log p(token t+1) (NaN at the last
    position), pred[t] = argmax, top1[t] = pred agrees with the reference's argmax. Non-finite
    logits are counted, never dropped: their tokens get a non-finite KL and the count says where."""
    n = logits.shape[0]
    kl = torch.empty(n, dtype=torch.float64, device=logits.device)
    nll = torch.full((n,), float("nan"), dtype=torch.float64, device=logits.device)
    pred = torch.empty(n, dtype=torch.int64, device=logits.device)
    bad_tok = torch.zeros(n, dtype=torch.int64, device=logits.device)
    for a in range(0, n, _SCORE_ROWS):
        e = min(n, a + _SCORE_ROWS)
        x = logits[a:e]
        lse, dot, x64 = _lse_dot(x, ref.p[a:e])
        kl[a:e] = (lse - ref.lse[a:e]) - (dot - ref.dot[a:e])
        pred[a:e] = x.argmax(dim=-1)
        t_end = min(e, n - 1)
        if t_end > a:
            nll[a:t_end] = lse[: t_end - a] - x64[: t_end - a].gather(1, ref.targets[a:t_end, None])[:, 0]
        # A non-finite logit always makes that token's KL non-finite (p_ref > 0 everywhere), so
        # the full count, a pass over every logit, is needed only then.
        if not bool(torch.isfinite(kl[a:e]).all()):
            bad_tok[a:e] = (~torch.isfinite(x)).sum(dim=-1)
    pred_np = pred.cpu().numpy()
    return {"kl": kl.cpu().numpy(), "nll": nll.cpu().numpy(), "pred": pred_np.astype(np.int32),
            "top1": (pred_np == ref.pred).astype(np.int8), "nonfinite_logits": bad_tok.cpu().numpy()}


class _Skip(torch.nn.Module):
    """Stands in for a decoder layer whose output is already known: passes its input through."""

    def __init__(self, as_tuple: bool):
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.as_tuple else hidden_states


class ModelRunner:
    """One model, one token sequence; ``run`` a plan (one ``Attn`` per layer), ``score`` it."""

    def __init__(self, model, input_ids: torch.Tensor, *, backend=None, device: str = "cpu",
                 seed: int = 0):
        from ..data import capture as cap

        impl = getattr(model.config, "_attn_implementation", None)
        require(impl == cap.ATTN_NAME, f"the model uses attn_implementation={impl!r}; load it with "
                "fa3_numerics.data.capture.load_model")
        base = getattr(model, "base_model", model)
        layers = getattr(base, "layers", None)
        self.num_layers = int(model.config.num_hidden_layers)
        require(isinstance(layers, torch.nn.ModuleList) and len(layers) >= self.num_layers,
                f"{type(model).__name__} keeps no decoder layers in base_model.layers; impact supports "
                "decoder-only models laid out as Llama, Mistral and Qwen2 are")
        self.model, self.base, self.layers = model, base, layers
        # the embedding's device: ``device``, or the first layer's under a --device-map
        self.ids = input_ids.to(model.get_input_embeddings().weight.device)
        self.n = int(input_ids.shape[1])
        self.device = device
        self.backend = backend
        self.seed = seed
        self.plan: list[Attn] | None = None
        self.keep: set[int] = set()
        self.kept: dict[int, torch.Tensor] = {}
        self.nonfinite_attn = np.zeros(self.num_layers, dtype=np.int64)
        self.ref: Reference | None = None
        self._layer_tuple: bool | None = None
        self._masking: dict[int, tuple] = {}  # layer -> (Masking or None, its keyword arguments)
        self._cap = cap

    # -- attention ---------------------------------------------------------------------------
    def _layer_masking(self, idx: int, module, query, key, kwargs):
        """(Masking or None when plain, its keyword arguments) of layer ``idx``, found once."""
        key_ = (idx, query.shape[-2], key.shape[-2])
        if key_ not in self._masking:
            from ..numerics.masking import masking

            opts = self._cap.attention_options(module, kwargs)
            mk = masking(True, heads=query.shape[1], seqlen_q=query.shape[-2], seqlen_k=key.shape[-2], **opts)
            self._masking[key_] = (None, {}) if mk.plain else (mk, {k: v for k, v in {
                "window_size": mk.window if mk.windowed else None, "softcap": mk.softcap or None,
                "sinks": mk.sinks}.items() if v is not None})
        return self._masking[key_]

    def _attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        mk, mkw = self._layer_masking(int(module.layer_idx), module, query, key, kwargs) if causal else (None, {})
        idx, scale = causal_call(module, query, key, attention_mask, kwargs, "impact", mk=mk)
        rule = self.plan[idx]
        require(query.shape[0] == 1, "impact runs batch 1")
        if rule.kind == "sdpa":
            q, k, v = (query, key, value)
            if rule.dtype == "bf16":
                q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
            if mk is not None and (mk.softcap or mk.sinks is not None):
                # SDPA has no softcap or sinks: the model's own eager attention in that dtype stands in
                eager = self._cap.eager_attention(module)
                out, _ = eager(module, q, k, v, _additive(_allowed(mk, q.shape[-2], k.shape[-2], q.device), q.dtype),
                               *args, **kwargs)
            else:
                mask = None if mk is None else (attention_mask if attention_mask is not None else
                                                 _allowed(mk, q.shape[-2], k.shape[-2], q.device)[None, None])
                out, _ = self._cap.sdpa_attention(module, q, k, v, mask, *args, **kwargs)
            o64 = out.transpose(1, 2).to(torch.float64) if idx in self.keep else None
        else:
            q, k, v = (t.to(torch.float64) for t in (query, key, value))
            if rule.kind == "ref":
                o = causal_attention64(q, k, v, scale) if mk is None else reference_attention(
                    q, k, v, causal=True, softmax_scale=scale, **mkw)
            else:
                if mk is not None:
                    why = self.backend.masking_refusal(mk)
                    if why is not None:
                        raise UsageError(f"layer {idx} ({mk.describe()}): {why}")
                o = self.backend.attention(rule.recipe, q, k, v, causal=True,
                                           q_index=torch.arange(self.n, device=q.device),
                                           rotation_seed=self.seed, cache={}, softmax_scale=scale, **mkw)
            o64 = o
            out = o.transpose(1, 2)
        # One reduction finds any NaN/Inf (they propagate through a sum); count only then.
        if not bool(torch.isfinite(out.sum())):
            self.nonfinite_attn[idx] += int((~torch.isfinite(out)).sum())
        if idx in self.keep:
            self.kept[idx] = o64
        return out.to(query.dtype).contiguous(), None

    # -- passes ------------------------------------------------------------------------------
    @contextmanager
    def _from_layer(self, start: int):
        """Skip layers 0..start-1 and feed the reference's input of layer ``start``."""
        if start == 0:
            yield
            return
        require(self.ref is not None and start in self.ref.hidden, "prefix reuse needs the reference run first")
        h = self.ref.hidden[start]
        saved = [self.layers[i] for i in range(start)]

        def inject(module, args, kwargs):
            if args:
                return (h,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        hook = self.layers[start].register_forward_pre_hook(inject, with_kwargs=True)
        try:
            for i in range(start):
                self.layers[i] = _Skip(bool(self._layer_tuple))
            yield
        finally:
            for i, layer in enumerate(saved):
                self.layers[i] = layer
            hook.remove()

    def run(self, plan: list[Attn], *, start: int = 0, keep=()) -> tuple[torch.Tensor, np.ndarray]:
        """Logits [n, vocab] (float32) of one pass under ``plan``, and the count of non-finite
        attention outputs per layer. ``start`` > 0 reuses the reference's layers 0..start-1,
        which must follow ``REF``; ``keep`` names layers whose float64 attention output is kept
        in ``self.kept``."""
        require(len(plan) == self.num_layers, f"a plan needs {self.num_layers} layers, got {len(plan)}")
        require(all(plan[i].kind == "ref" for i in range(start)), "layers before start must follow REF")
        self.plan, self.keep, self.kept = list(plan), set(keep), {}
        self.nonfinite_attn = np.zeros(self.num_layers, dtype=np.int64)
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self._cap.attention_override(self._attend))
            stack.enter_context(self._from_layer(start))
            logits = self.model(input_ids=self.ids, use_cache=False).logits[0]
        return logits, self.nonfinite_attn.copy()

    def reference(self) -> Reference:
        """The all-REF pass: distributions, each layer's input and attention output, Q/K/V."""
        hidden: dict[int, torch.Tensor] = {}
        hooks = []

        def save_input(i):
            def hook(module, args, kwargs):
                hidden[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
            return hook

        def out_type(module, args, output):
            self._layer_tuple = isinstance(output, tuple)

        for i in range(self.num_layers):
            hooks.append(self.layers[i].register_forward_pre_hook(save_input(i), with_kwargs=True))
        hooks.append(self.layers[0].register_forward_hook(out_type))
        try:
            with self._cap.recording() as rec:
                logits, bad_attn = self.run([REF] * self.num_layers, keep=range(self.num_layers))
        finally:
            for h in hooks:
                h.remove()
        scales = {rec.scale[i] for i in rec.q}
        ref = Reference.from_logits(logits, self.ids[0, 1:].to(logits.device))
        ref.hidden, ref.attn, ref.record = hidden, dict(self.kept), rec
        ref.scale = scales.pop() if len(scales) == 1 else float("nan")
        ref.nonfinite["attn"] = bad_attn
        self.ref = ref
        return self.ref

    def layer_rel_l2(self, layer: int) -> np.ndarray:
        """rel_l2 per head of the kept attention output of ``layer`` against the reference's
        (the audit's metric, ``numerics.metrics.per_sample``), from the last run."""
        return per_sample(self.kept[layer], self.ref.attn[layer])["rel_l2"][0]


__all__ = ["causal_call", "thread_count", "cpu_threads", "Attn", "REF", "SDPA_FP32", "SDPA_BF16", "recipe_attn", "ModelRunner", "Reference", "score",
           "causal_attention64"]
