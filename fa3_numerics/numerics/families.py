"""Operand format families: what a recipe's ``qk``, ``v`` and ``p`` names can be, and what they cost.

Exposed: ``MxFormat``, ``MX_FORMATS``, ``FAMILIES``, ``family``, ``operand_name``, ``element_format``,
``mma_format``, ``bits_per_element``, ``is_narrow``, ``all_names``.

Three families, each quantized by its own module:

- ``float``: the sign/exponent/mantissa formats of ``formats.FORMATS`` (e4m3, e5m2, fp16, bf16,
  fp32), one float32 descale per scale group (``quant.quantize``);
- ``int``: symmetric INT8 / INT4 of ``intformats`` (SageAttention's Q and K), one float32
  descale per group, codes multiplied exactly (``quant.quantize_int``);
- ``mx``: block-scaled microscaling formats (``microscaling``), whose scales are themselves
  narrow formats and run along the contraction dimension:

  ============  =========  ==========  ==============  ===========================================
  name          elements   block       block scale     extra
  ============  =========  ==========  ==============  ===========================================
  ``mxfp8``     e4m3       32          E8M0 (2^k)      OCP MX v1.0; rounding by ``mxscale``
  ``nvfp4``     E2M1       16          E4M3            FP32 tensor scale by ``nvts`` (NVIDIA's)
  ============  =========  ==========  ==============  ===========================================

Which family each tensor may use: Q and K any (INT only there: the integer Q K^T product is
exact, while P and V would need a float scale inside the P V product, which no kernel of the
field does); V and P float or microscaling.

``bits_per_element`` is the storage cost of one element, block scales included (MXFP8:
8 + 8/32 = 8.25 bits; NVFP4: 4 + 8/16 = 4.5; per-head or per-block float32 descales add
less than 0.01 bit at the block sizes used here and are left out). It is the x axis of the
recipe study's error-against-bits figure (``reports/recipes/``).
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from .formats import E2M1, FORMATS, Format, get_format
from .intformats import INT_FORMATS

FAMILIES = ("float", "int", "mx")


@dataclasses.dataclass(frozen=True)
class MxFormat:
    """A microscaling operand format: ``block`` elements of ``element`` share one ``scale`` value."""

    name: str
    element: Format
    block: int
    scale: str  # "e8m0" or "e4m3"
    scale_bits: int = 8

    @property
    def bits(self) -> float:
        return (1 + self.element.ebits + self.element.mbits) + self.scale_bits / self.block


MX_FORMATS: dict[str, MxFormat] = {
    "mxfp8": MxFormat("mxfp8", get_format("e4m3"), 32, "e8m0"),
    "nvfp4": MxFormat("nvfp4", E2M1, 16, "e4m3"),
}
_FAMILY_NAMES = {"float": tuple(FORMATS), "int": tuple(INT_FORMATS), "mx": tuple(MX_FORMATS)}


def all_names(families: tuple[str, ...] = FAMILIES) -> tuple[str, ...]:
    return tuple(n for f in families for n in _FAMILY_NAMES[f])


def family(name: str) -> str:
    """"float", "int" or "mx" for a canonical format name."""
    if name in INT_FORMATS:
        return "int"
    if name in MX_FORMATS:
        return "mx"
    get_format(name)  # UsageError for unknown names
    return "float"


def operand_name(value, families: tuple[str, ...], what: str) -> str:
    """The canonical name of ``value`` if its family is allowed for ``what``; else UsageError.

    Float aliases (float16, e4m3fn, ...) map to their names as ``formats.get_format`` does."""
    if isinstance(value, Format):
        value = value.name
    text = str(value).strip().lower()
    for fam in ("int", "mx"):
        if text in _FAMILY_NAMES[fam]:
            if fam not in families:
                raise UsageError(f"{what} cannot be {text}: {_why_not(fam, what)}; choose one of "
                                 f"{', '.join(all_names(families))}")
            return text
    try:
        name = get_format(text).name
    except UsageError:
        raise UsageError(f"unknown number format {value!r} for {what}; choose one of "
                         f"{', '.join(all_names(families))}") from None
    return name


def _why_not(fam: str, what: str) -> str:
    if fam == "int":
        return ("integer codes are exact only in the Q K^T product; P and V need a float scale inside P V, "
                "which no kernel of the field uses")
    return f"microscaling is not offered for {what}"


def element_format(name: str) -> Format | None:
    """The element format the tensor core multiplies: the float format itself, the MX element
    (e4m3, E2M1), or None for integers (exact integer products)."""
    fam = family(name)
    if fam == "int":
        return None
    return MX_FORMATS[name].element if fam == "mx" else get_format(name)


def mma_format(name: str) -> Format:
    """The format handed to the accumulator models (``accumulators``): a float format as is;
    microscaling and integer operands as fp32, for which no Hopper tensor-core model applies
    (block-scaled MMAs are Blackwell's, and no model of their accumulation is fitted)."""
    return get_format(name) if family(name) == "float" else get_format("fp32")


def bits_per_element(name: str) -> float:
    """Storage bits of one element, block scales included (see the module docstring)."""
    fam = family(name)
    if fam == "int":
        return float(INT_FORMATS[name].bits)
    if fam == "mx":
        return MX_FORMATS[name].bits
    f = get_format(name)
    return float(1 + f.ebits + f.mbits)


def is_narrow(name: str) -> bool:
    """One byte or less per element: the FA3 kernel's FP8 tiles apply (``Recipe.tiles``)."""
    return bits_per_element(name) < 9


__all__ = ["MxFormat", "MX_FORMATS", "FAMILIES", "family", "operand_name", "element_format", "mma_format",
           "bits_per_element", "is_narrow", "all_names"]
