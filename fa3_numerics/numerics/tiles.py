"""Tile sizes (kBlockM x kBlockN) of the FA3 Hopper forward kernel, per head dim and dtype.

Exposed: ``SUPPORTED_HEAD_DIMS``, ``fa3_tiles``, ``cudnn_tiles``.

Facts from Dao-AILab/flash-attention hopper/tile_size.h (``tile_size_fwd_sm90``), for the
plain case (no paged KV, no local window, no softcap, two MMA warpgroups). The tile size
matters for the emulator twice: block quantization is aligned to it, and the order in
which the online softmax meets the KV tiles changes the rounding.
"""

from __future__ import annotations

from ..errors import UsageError

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)

# head_dim -> (kBlockM, kBlockN) for 1-byte (FP8) inputs.
_FP8 = {64: (192, 160), 96: (192, 128), 128: (128, 224), 192: (128, 160), 256: (128, 128)}
# head_dim -> (kBlockM, kBlockN non-causal, kBlockN causal) for 2-byte (FP16/BF16) inputs.
_FP16 = {64: (192, 192, 128), 96: (192, 144, 144), 128: (128, 176, 128), 192: (128, 112, 112), 256: (128, 80, 80)}


def check_head_dim(d: int) -> None:
    if d not in SUPPORTED_HEAD_DIMS:
        raise UsageError(f"head dim {d} is not supported by the FA3 kernel; use one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")


# kBlockN where a local (sliding) window, or a window with a softcap, changes it (same function of
# tile_size.h): head_dim -> kBlockN for 2-byte inputs with a window; for 1-byte inputs with a window
# (_FP8_LOCAL) and with a window and a softcap (_FP8_LOCAL_SOFTCAP).
_FP16_LOCAL = {64: 160, 96: 128, 128: 128, 192: 96, 256: 64}
_FP8_LOCAL = {256: 64}
_FP8_LOCAL_SOFTCAP = {128: 192, 192: 128, 256: 64}


def fa3_tiles(head_dim: int, *, fp8: bool, causal: bool = False, local: bool = False,
              softcap: bool = False) -> tuple[int, int]:
    check_head_dim(head_dim)
    if fp8:
        m, n = _FP8[head_dim]
        if local:
            n = (_FP8_LOCAL_SOFTCAP if softcap else _FP8_LOCAL).get(head_dim, n)
        return m, n
    m, n, n_causal = _FP16[head_dim]
    if local:
        return m, _FP16_LOCAL[head_dim]
    return m, (n_causal if causal else n)


# cuDNN 9.19's FP8 SDPA forward on Hopper (sdpa_fp8), KV tile per head dim, fitted to the kernel's
# O codes on an H200 (reports/h200/field/): 256 keys at head dims 64 and 128 (0-51 of 65,536-262,144
# codes differ), 128 at 256 (0.0% differ, against 16% with 256). 96 and 192 were not dumped: they
# take their neighbour's tile (the tile shrinks past 128 as the K/V tile's bytes double), a guess.
# The query tile does not change an output with per-tensor scales; 128 stands in for it.
_CUDNN_FP8_BN = {64: 256, 96: 256, 128: 256, 192: 128, 256: 128}
CUDNN_MEASURED_HEAD_DIMS = (64, 128, 256)


def cudnn_tiles(head_dim: int) -> tuple[int, int]:
    check_head_dim(head_dim)
    return 128, _CUDNN_FP8_BN[head_dim]
