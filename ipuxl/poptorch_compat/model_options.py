"""What wrapping a model does with its ``poptorch.Options`` (upstream's ``PoplarExecutor``).

Upstream's ``PoplarExecutor.__init__`` (``python/_poplar_executor.py``) and its optimiser
conversion (``python/_optimizer_attributes.py``) treat the options they are given so:

1. the user's ``Options`` are frozen (changing them afterwards raises) and the model
   works on an unfrozen clone (``model.options``), so that what it resolves below does
   not show in the user's object;
2. ``OutputMode.Default`` becomes ``Final`` (training) or ``All`` (inference) in the
   clone;
3. an inference model refuses ``Training.gradientAccumulation`` other than 1 when it is
   wrapped (``Options.check_inference_accumulation``: upstream's message);
4. each optimiser a training model is given (at wrap time and by ``setOptimizer``) with
   ``accum_type=torch.float16``, and not ``use_combined_accum``, sets
   ``Training.meanAccumulationAndReplicationReductionStrategy`` to ``Running``; once
   compiled, an optimiser that would need that change with the strategy not already
   ``Running`` is refused (``resolve_mean_reduction_strategy``).

:func:`model_options` does steps 1-3 and returns the frozen clone;
:func:`resolve_mean_reduction_strategy` step 4.
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.errors import ExecutorError, OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.enums import MeanReductionStrategy
from ipuxl.poptorch_compat.options import Options, OutputMode

__all__ = ["model_options", "resolve_mean_reduction_strategy"]


def model_options(options: Options | None, training: bool, optimizer: Any = None) -> Options:
    """The options a model wrapped with ``options`` keeps (see the module docstring).

    Raises:
        ExecutorError: (a ``poptorch.Error``, as upstream's) ``options`` is not a ``poptorch.Options``.
        InferenceOptionsError: inference with ``Training.gradientAccumulation`` other than 1.
    """
    if options is not None and not isinstance(options, Options):
        raise ExecutorError(f"Invalid type: 'options' is of type {type(options)} (Expected poptorch.Options)",
                                   where=user_source_line(), fix="pass poptorch.Options()")
    if options is None:
        resolved = Options()
    else:
        options.freeze()  # the user's object: later changes are refused, as upstream
        resolved = options.clone()
    if resolved.output_mode is OutputMode.Default:
        resolved.outputMode(OutputMode.Final if training else OutputMode.All)
    if not training:
        resolved.check_inference_accumulation()
    elif optimizer is not None:
        resolve_mean_reduction_strategy(resolved, optimizer, compiled=False)
    resolved.freeze()
    return resolved


def resolve_mean_reduction_strategy(options: Options, optimizer: Any, *, compiled: bool) -> None:
    """Upstream's implicit mean-reduction strategy for ``optimizer``: ``Running`` when its
    ``accum_type`` is ``torch.float16`` and it has no combined accumulator (``Post``, the
    default, otherwise; an explicit choice stays unless float16 needs ``Running``).

    Raises:
        OptionsError: (a ValueError, as upstream) ``compiled`` and the strategy would have
            to change to ``Running``.
    """
    if getattr(optimizer, "accum_type", None) != torch.float16 or getattr(optimizer, "use_combined_accum", False):
        return
    training = options.Training
    if not compiled:
        frozen = options.frozen
        options.unfreeze()
        try:
            training.setMeanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running)
        finally:
            if frozen:
                options.freeze()
    elif training.meanAccumulationAndReplicationReductionStrategy is not MeanReductionStrategy.Running:
        raise OptionsError(
            "Invalid optimizer: the new optimizer would require changing options.Training."
            "meanAccumulationAndReplicationReductionStrategy to poptorch.MeanReductionStrategy.Running but the "
            "executable is already compiled.", where=user_source_line(),
            fix="keep the compiled model's accum_type, or wrap the model again (a new trainingModel) to use a "
                "float16 accum_type")
