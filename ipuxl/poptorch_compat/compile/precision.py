"""``Options.Precision`` as the capture's float16 rules (``capture.mode.Precision``).

* ``halfFloatCasting(FloatDowncastToHalf)``: an op mixing float16 and float32
  operands computes in float16 (its float32 operands are cast), so float32 weights
  used with float16 activations are cast at their use and updated in float32.
  ``HalfUpcastToFloat`` and ``Default`` (PopTorch 3's dispatcher: PyTorch's casting
  rules) cast the float16 operands of such an op to float32, for every op, as
  PopTorch does: a float16 model fed float32 data computes in float32 where eager
  PyTorch refuses the mix (a matmul, a convolution).
* ``runningStatisticsAlwaysFloat(True)`` (the default): batch norm running statistics
  of a float16 model are kept and updated in float32 on the device; the host
  module's buffers stay float16 and show the device values rounded to float16.
  With False they are kept in float16, as eager PyTorch keeps them.
"""
from __future__ import annotations

from ipuxl.capture.mode import Precision
from ipuxl.poptorch_compat.enums import HalfFloatCastingBehavior
from ipuxl.poptorch_compat.options import Options

__all__ = ["precision_rules"]


def precision_rules(options: Options) -> Precision:
    """The capture rules ``options.Precision`` asks for."""
    precision = options.Precision
    return Precision(
        downcast_to_half=precision.half_float_casting == HalfFloatCastingBehavior.FloatDowncastToHalf,
        upcast_to_float=precision.half_float_casting != HalfFloatCastingBehavior.FloatDowncastToHalf,
        float_statistics=bool(precision.running_statistics_always_float))
