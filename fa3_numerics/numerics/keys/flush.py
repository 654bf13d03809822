"""Recipe key ``flush``: add the FP8 tensor core's P V chain into float32 every N KV tiles.

Hopper's FP8 MMA accumulates in about 13 bits (``acc=fp22``); FA3 chains one accumulator through
every KV tile, so a long context is summed at that precision. vLLM's fork of FA3 restarts the
chain and adds it into a float32 accumulator every tile (vllm-project/flash-attention #104, the
``two-level`` model) or every N tiles (#122: N = 4 by default, "best accuracy/perf ratio"; their
128K niah_multikey_2 with Llama-3.1-8B: 0.89 every tile, 0.88 every 4, 0.856 every 64).
``acc=fp22,flush=N`` models that (``accumulators.FlushEvery``); ``flush=1`` equals
``acc=two-level``; 0 (default) is the FA3 kernel's unbroken chain. Only the emulator computes it
(no public kernel build has it), so other backends refuse a non-zero value.
"""

from __future__ import annotations

from ...errors import UsageError
from . import RecipeKey, parse_int, register_check, register_key


def _tiles(value) -> int:
    value = int(value)
    if value < 0:
        raise UsageError(f"flush={value}: use 0 (never: the kernel's chain) or N >= 1 KV tiles")
    return value


register_key(RecipeKey(
    "flush", 0,
    "with acc=fp22: add the MMA chain into a float32 accumulator every N KV tiles (vLLM's fix; 1 = two-level, "
    "0 = never, as the FA3 kernel)",
    parse=parse_int, normalize=_tiles, stages=("acc",), exact=0,
    # a second float32 accumulator in registers and an add every N tiles
    cost=lambda v: 1 if v else 0,
))


@register_check
def _needs_the_chain(r) -> str | None:
    if r.flush and r.acc != "fp22":
        return (f"flush={r.flush} flushes the FP22 MMA chain (acc=fp22) into float32; with acc={r.acc} there is no "
                "chain to flush (acc=two-level is flush=1): set acc=fp22 or drop flush")
    if r.flush and (r.algo != "flash" or r.norm != "deferred" or r.loop != "fa3"):
        return "flush=N models FA3's loop (algo=flash, norm=deferred, loop=fa3)"
    return None
