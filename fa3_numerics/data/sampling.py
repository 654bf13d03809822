"""How a study picks query rows and checks seeds.

Exposed: ``ROWS_SEED``, ``ROWS_SAMPLING``, ``SEED_MAX``, ``rows_seed``, ``query_rows``,
``effective_rows``, ``check_seed``.

Query rows of attention are independent given K and V, so a study may evaluate a seeded random
sample of ``rows`` rows per (batch, head) over the full key length: exact outputs for those rows
at a fraction of the cost. The sample derives from the seed that also draws the inputs and the
rotation, by the rule recorded in every dataset (``ROWS_SAMPLING``). It lives with the data
(below the engine) because the distributions that fit themselves to a capture measure their
fit on the same rows the studies use.
"""

from __future__ import annotations

import torch

from ..errors import require

ROWS_SEED = "seed * 1000003 + 17"
ROWS_SAMPLING = f"torch.randperm(seqlen, generator=manual_seed({ROWS_SEED}))[:rows]"
# Seeds are 32-bit: seed * 1000003 + 17 then fits the 64-bit generator state with room to spare.
SEED_MAX = 2 ** 32 - 1


def rows_seed(seed: int) -> int:
    return seed * 1000003 + 17


def check_seed(seed: int, option: str = "--seeds") -> None:
    require(isinstance(seed, int) and 0 <= seed <= SEED_MAX,
            f"{option} must be integers in [0, {SEED_MAX}], got {seed}")


def effective_rows(seqlen: int, rows: int) -> int:
    """Rows actually evaluated: ``rows``, or every row when 0 or at least ``seqlen``."""
    return seqlen if not rows or rows >= seqlen else rows


def query_rows(seqlen: int, rows: int, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Sorted indices of the query rows to evaluate (every row when ``rows`` is 0 or >= seqlen)."""
    if rows and rows < seqlen:
        g = torch.Generator().manual_seed(rows_seed(seed))
        idx = torch.randperm(seqlen, generator=g)[:rows].sort().values
    else:
        idx = torch.arange(seqlen)
    return idx.to(device)
