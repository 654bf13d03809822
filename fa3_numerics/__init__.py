"""fa3-numerics: numerical accuracy toolkit for FP8 attention, built around FlashAttention-3."""

__version__ = "0.1.0"
