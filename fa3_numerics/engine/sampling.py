"""How a study picks query rows and seeds, and the matmul settings every computation runs under.

Exposed: ``ROWS_SEED``, ``ROWS_SAMPLING``, ``SEED_MAX``, ``rows_seed``, ``query_rows``,
``effective_rows``, ``check_seed`` (from ``fa3_numerics.data.sampling``, where the data layer
uses them too), ``deterministic_matmuls``.
"""

from __future__ import annotations

import torch

from ..data.sampling import ROWS_SAMPLING, ROWS_SEED, SEED_MAX, check_seed, effective_rows, query_rows, rows_seed


def deterministic_matmuls() -> None:
    """float32 matmuls in full precision (no TF32), on every device, in this process."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


__all__ = ["ROWS_SEED", "ROWS_SAMPLING", "SEED_MAX", "rows_seed", "query_rows", "effective_rows", "check_seed",
           "deterministic_matmuls"]
