"""Triton kernels beyond the public FA3 build, importable without triton or a GPU.

- ``rotate_quant``: fused random-Hadamard rotation + scaled FP8 quantization (per tensor, per
  (batch, kv-head), per block of tokens, per token), float64 path bit-identical to the
  emulator's ``prepare``, float32 fast path on the tensor cores: which kernel runs a call and
  with which launch (the tuning tables). One module per kernel: ``quant_persistent`` (the fast
  path) with its block walkers ``quant_blocks``, ``quant_tiled`` (the float64 path); what they
  share: ``quant_device`` (Triton functions), ``quant_launch`` (``QuantOut``, layouts, grids).
- ``rotate_quant_smem``, ``vquant_smem``: Gluon kernels (sm_90: TMA, wgmma) for per-block scales
  whose block is held in shared memory between its amax and its cast: FA3's 224-row K tile
  (rotated) and V tiles written (b, h, d, s); ``rotate_quant.rotate_quantize`` picks them where
  they run.
- ``attention``: FP8 attention forward with per-block Q/K descales folded into S, V per head or
  per KV tile, P offset, causal, GQA, head dims 64/128/256, any KV tile of up to three
  power-of-two chunks (the FA3 tiles), chained (= the ``fp22`` model) or two-level P.V.
- ``backend``: the toolkit backends ``triton``, ``triton-two-level``, ``triton-fused``.
- ``selfcheck``: correctness checks shared by the CPU tests (interpreter) and the device run.

The package is named ``triton_`` so that it never shadows the ``triton`` library.
"""
