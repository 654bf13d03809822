"""Recipe key ``smath``: the float32 softmax arithmetic of the flash loop (``loop=fa3``).

- ``fa3`` (default): FA3's tile step: P~ = exp2(fma(S, scale_log2, -(m scale_log2 - poff))), one
  FFMA, exp2 correctly rounded (the tile rescale rounded toward zero), O = acc / l.
- ``cudnn``: cuDNN 9.19's FP8 SDPA forward on Hopper, fitted to the H200's bytes on constructed
  one-key rows (tools/device/dump_field.py part cudnn-tie, reports/h200/field/README.md): S is
  scaled first, S' = fl(S scale_log2), the running max is taken over S', the offset is
  L = lg2.approx(scale_s) with scale_s the float32 2^poff the backend passes (the unit rounds log2
  toward zero: 8.80734921, one float32 ulp below log2(scale_s)), the scale S' = fl(S scale_log2) with
  scale_log2 = fl(fl(fl(attn_scale descale_q) descale_k) log2e) (float32 products left to right: validate's
  causal n 2048 case, where FA3's fl(attn_scale log2e) fl(descale_q descale_k) is one ulp above it, 26 -> 1
  O codes differing of 2,097,152; the tie probes, descale_q = descale_k = 1, cannot tell the two apart), P~ = ex2.approx(fl(S' - fl(m' - L)))
  (two float32 subtractions, no FMA), the tile rescale ex2.approx(fl(m'_old - m'_new)), and O written
  as acc * fl(rcp.approx(l) * fl(descale_v * scale_o)): the scale_o multiply folded into the row's
  factor (``numerics/sfu.py``: the unit's ex2/lg2/rcp, bit-exact).
"""

from __future__ import annotations

from . import RecipeKey, register_check, register_key

register_key(RecipeKey(
    "smath", "fa3", "float32 softmax arithmetic of the flash loop: fa3 (one FFMA per P~, exp2 correctly rounded) or "
    "cudnn (cuDNN's FP8 forward: S scaled first, offset lg2.approx(scale_s), two subtractions, ex2.approx, O = acc "
    "rcp.approx(l) (descale_v scale_o))",
    choices=("fa3", "cudnn"), backends=("cudnn-fp8",), cost=lambda v: 0,
))


@register_check
def _smath(r) -> str | None:
    if r.smath == "fa3":
        return None
    if r.algo != "flash" or r.loop != "fa3" or r.norm != "deferred" or r.splitkv != "none":
        return "smath=cudnn is cuDNN's loop: the flash algorithm, loop=fa3, deferred normalisation, no split-KV"
    if r.smooth == "qk":
        return "smath=cudnn has no smoothing bias (smooth=qk)"
    return None
