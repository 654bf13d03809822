"""Recipe key ``sbias``: the precision of the Q-smoothing correction added back to S (``smooth=qk``).

With ``smooth=qk`` the scores are S = Q' K'^T + delta_s, delta_s = mean(Q_block) K'^T per
(query block, key). The emulator computes delta_s in float64 and rounds it once to this
format (``smoothing.qk_smoothing_bias``): ``fp32`` is the ideal; ``bf16``/``fp16`` model
SageAttention3's ``preprocess_qkv``, which takes ``torch.matmul(qm, k^T)`` in the input dtype
(BF16 or FP16) before converting it to float32 for the kernel. No effect without
``smooth=qk``.
"""

from __future__ import annotations

from . import RecipeKey, register_key

register_key(RecipeKey(
    "sbias", "fp32",
    "format the smooth=qk correction q_mean K^T is rounded to before it is added to S (SageAttention3: the "
    "input dtype, bf16 or fp16)",
    choices=("fp32", "bf16", "fp16"), stages=("qk",), exact="fp32",
    # the bias is prepared with Q (one row per query block): Q's caches keep it apart
    tensors=("q",), cost=lambda v: 0,
))
