"""Recipe key ``sfu``: how the emulators compute the kernel's special-function instructions.

- ``rz`` (default): the float64 stand-ins each call site has used so far (exp2 rounded toward zero
  for the rescale factors and FA2's P~, correctly rounded exp2 for FA3's P~ and the backward's P,
  log2 rounded toward zero for FA2's ``__logf``, a correctly rounded ln for FA3's LSE).
- ``h200``: the bit-exact models of the H200's ``ex2.approx.ftz.f32`` and ``lg2.approx.ftz.f32``
  (``numerics/sfu.py``, measured exhaustively by tools/device/mufu_probe.py) at those call sites;
  FA3's LSE takes ``__logf`` as the fast-math build forms it, lg2.approx times float32 ln 2. The
  C softmax step (``native.softmax_step``) has its own exp2, so ``h200`` runs the PyTorch step.
  ``recip32`` (div.full.f32's reciprocal) already equals ``rcp.approx.ftz.f32`` on its domain.

The model is the ``.ftz`` instruction, so ``ftz=0`` with ``sfu=h200`` is refused. Emulator only.
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "sfu", "rz", "special functions of the softmax: rz (float64 stand-ins: exp2 rounded toward zero or to "
    "nearest as each call site had it, log2 toward zero, ln rounded once) or h200 (bit-exact models of the "
    "H200's ex2/lg2.approx.ftz.f32, numerics/sfu.py)",
    choices=("rz", "h200"), cost=lambda v: 0,
    # a GPU kernel runs the instructions themselves: h200 names what those backends compute, so a
    # kernel preset carrying it still runs on its kernel (the CPU stand-in fa3-mock does not)
    backends=("fa3", "sage1", "sage2", "cudnn-fp8", "torchao-fp8", "sdpa", "sdpa-flash", "sdpa-cudnn",
              "sdpa-efficient", "sdpa-math", "triton", "triton-two-level", "triton-fused"),
))


@register_check
def _sfu(r) -> str | None:
    if r.sfu == "h200" and not r.ftz:
        return "sfu=h200 models the .ftz instructions the kernels run; it needs ftz=1"
    return None
