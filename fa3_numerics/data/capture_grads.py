"""dO for ``capture --grads``: the gradient of a next-token-prediction loss on the captured text with
respect to each attention call's output, from one real backward pass of the model.

Exposed: ``record_grads``, ``LOSS``, ``WRT``.

The pass is the capture's own (float32, the model loaded with ``attn_implementation="fa3n_capture"``),
with autograd on: the token embeddings' output is the leaf (the weights are frozen for the pass, so no
weight gradient is kept), every layer runs (the loss needs the logits), the loss is the mean
cross-entropy of the logits at positions 0..N-2 against the tokens 1..N-1, and ``loss.backward()``
fills, through a hook the recorder puts on each attention call's output (``_Recorder.watch``), dL/dO
in the layout of O as the attention function returns it, (batch, seq, heads, head_dim), stored as
(heads, seq, head_dim) like Q. This dO is what a training step's attention backward receives.
"""

from __future__ import annotations

import math

import torch

from ..errors import require

LOSS = "next-token cross-entropy of the model's logits, mean over the N - 1 predicted tokens (float32)"
WRT = ("each attention call's output O, as transformers' attention function returns it (before o_proj), "
       "stored (heads, seq, head_dim)")


def record_grads(model, input_ids: torch.Tensor, layers: list[int] | None = None):
    """One forward and backward pass over ``input_ids`` (batch 1, at least 2 tokens): (the recorder,
    with Q, K, V and ``grads`` {layer: dL/dO (batch, heads, seq, head_dim)}, and the loss's provenance
    {"loss", "wrt", "loss_value", "predicted_tokens", "tokens"})."""
    from .capture import ATTN_NAME, _Recorder, recording

    impl = getattr(model.config, "_attn_implementation", None)
    require(impl == ATTN_NAME, f"the model uses attn_implementation={impl!r}; load it with "
            f"fa3_numerics.data.capture.load_model (attn_implementation={ATTN_NAME!r})")
    n = int(input_ids.shape[1])
    require(input_ids.shape[0] == 1 and n >= 2, f"--grads needs a loss on next-token prediction: at least 2 "
            f"tokens (got {n}); use --tokens 2 or more")
    rec = _Recorder(layers=None if layers is None else set(layers), grads={})
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        with recording(rec), torch.enable_grad():
            x = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), input_ids[0, 1:], reduction="mean")
            value = float(loss.detach())
            require(math.isfinite(value), f"the loss is {value}: the model overflowed in float32; "
                    "capture without --grads or fewer --tokens")
            loss.backward()
    finally:
        for p in params:
            p.requires_grad_(True)
    want = set(rec.q)
    require(set(rec.grads) == want, f"no gradient reached the attention output of layers "
            f"{sorted(want - set(rec.grads))}; their output does not feed the loss")
    prov = {"loss": LOSS, "wrt": WRT, "loss_value": value, "predicted_tokens": n - 1, "tokens": n}
    return rec, prov


__all__ = ["record_grads", "LOSS", "WRT"]
