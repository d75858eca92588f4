"""popxl.addons' float formats, as ``FpDef`` records the float8 scale ops read
(``fp8_amax_scale``, ``fp8_mse_scale``).

Each record holds a format's exponent and mantissa widths, its fixed exponent bias,
whether denormals and NaN codes count, its largest finite value and its exponent range
(``min_exp`` includes the denormals where ``include_denorm``). The float8 records are
Graphcore's formats (``ipuxl.float8_143``, ``ipuxl.float8_152``: torch's fnuz types).
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["FpDef", "ieee_fp32_no_denorms", "ieee_fp16_denorms", "float8_152_def", "float8_143_def"]


class FpDef(NamedTuple):
    """A floating-point format, as popxl.addons defines it."""

    num_exp_bits: int  #: exponent bits
    num_mantissa_bits: int  #: mantissa bits
    fix_exponent_bias: int  #: the bias added to the exponent
    include_denorm: bool  #: whether denormalised values count in the format
    has_nans: bool  #: whether a whole exponent code stands for NaN
    max_value: float  #: the largest finite value
    max_exp: int  #: the largest exponent
    min_exp: int  #: the smallest exponent (of a denormal, where they count)


ieee_fp32_no_denorms = FpDef(8, 23, 127, False, True, 3.4028235e38, 127, -126)
ieee_fp16_denorms = FpDef(5, 10, 15, True, True, 65504, 15, -14)
float8_152_def = FpDef(5, 2, 16, True, False, 57344, 15, -17)
float8_143_def = FpDef(4, 3, 8, True, False, 240, 7, -10)
