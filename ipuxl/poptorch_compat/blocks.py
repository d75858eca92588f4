"""PopTorch's model partitioning: blocks, stages, phases and the multi-IPU execution strategies.

Upstream (PopTorch 3.x ``poptorch/ops.py`` and ``poptorch/options.py``) a model is cut
into *blocks* (``with poptorch.Block("B1"):``, ``poptorch.BeginBlock(layer)``,
``@poptorch.BlockFunction(...)``); an execution strategy given to
``Options.setExecutionStrategy`` groups blocks into *stages* (``poptorch.Stage``), puts
each stage on an IPU (``Stage.ipu(n)``) and says how the stages run:

* ``PipelinedExecution`` (the default): the stages form a pipeline that micro-batches
  flow through; training needs ``gradientAccumulation`` of at least the number of
  pipeline stages PopART counts, ``2 * N - 1`` for N forward stages (the last forward
  stage is also the first backward one), inference ``deviceIterations >= N``;
* ``ShardedExecution``: the stages run one after the other, one micro-batch at a time;
* ``SerialPhasedExecution`` / ``ParallelPhasedExecution``: stages grouped into
  execution phases (``poptorch.Phase``).

This module is the user's side: the classes above, and each block start handed to the
capture running in this thread (a ``BlockListener``, see ``listening_to_blocks``);
outside a capture (the model run eagerly on the CPU) blocks do nothing. The compiler
does the rest, in order:

1. ``compile.placement``: while a model is captured, entering a block asks the
   strategy's stage manager (``stage_manager``) for the block's stage and IPU, as
   upstream's ``Block._stages_manager`` does; every op the trace records after a block
   starts, up to the next block start, gets that block's ``ipuxl.ir.meta.IPU`` and
   ``PIPELINE_STAGE``; ops before the first block belong to stage 0. ``with Block``
   ends nothing: as with ``BeginBlock``, ops stay in the last block started until
   another one starts. ``check_depth`` refuses a pipeline too shallow for its stages
   (PopART's message).
2. ``compile.placement_passes``: the grad graph's ops take the backward stage of the
   forward stage they differentiate; each parameter and buffer goes on the IPU of its
   first reader.
3. ``compile.pipelined``: a pipelined training step calls one subgraph per stage in
   pipeline order; ``compile.report`` adds the copies between stages and the schedule
   to ``report()``.

Differences from upstream: sharded and phased execution, and inference, run each
micro-batch's whole forward (and backward) in turn (an inference pipeline would span
device iterations); results equal those of the unsplit model, which is what upstream
guarantees too. Phased strategies are accepted and placed like sharded execution
(their ``Liveness`` and separate backward phase are recorded in ``backendOptions()``).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Protocol

import torch

from ipuxl.errors import InvalidArgumentError, OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat import enums

__all__ = ["Block", "BeginBlock", "BlockFunction", "removeBlocks", "Stage", "Phase", "PipelinedExecution",
           "ShardedExecution", "SerialPhasedExecution", "ParallelPhasedExecution", "BlockListener",
           "listening_to_blocks", "stage_manager"]

_state = threading.local()  # the BlockListener of the capture running in this thread (``listening_to_blocks``)

# -- stages and phases ---------------------------------------------------------------------------
class Stage:
    """One or more blocks running on one IPU (PopTorch's ``poptorch.Stage``).

    Args:
        block_ids: the ``user_id`` of each block in the stage.

    Example:
        >>> strategy = PipelinedExecution(Stage("B1", "B2").ipu(0), Stage("B3").ipu(1))
    """

    def __init__(self, *block_ids: str):
        if not all(isinstance(b, str) for b in block_ids):
            raise OptionsError(f"poptorch.Stage: Block IDs are supposed to be strings but got {block_ids}",
                               where=user_source_line(), fix='name blocks with strings, e.g. poptorch.Stage("B1")')
        self._blocks = tuple(block_ids)
        self._stage_id = -1
        self._phase_id = -1
        self._ipu: int | None = None

    @property
    def blocks(self) -> tuple[str, ...]:
        """The blocks this stage is made of."""
        return self._blocks

    def ipu(self, ipu: int) -> Stage:
        """Run this stage on IPU ``ipu`` (returns the stage)."""
        if not isinstance(ipu, int) or isinstance(ipu, bool) or ipu < 0:
            raise OptionsError(f"Stage.ipu: the IPU must be an int >= 0, got {ipu!r}", where=user_source_line(),
                               fix="pass the IPU's index in the multi-IPU device, e.g. .ipu(1)")
        self._ipu = ipu
        return self

    def _setStage(self, stage: int | None) -> Stage:  # noqa: N802 - upstream's name
        if stage is not None:
            self._stage_id = stage
        return self

    def __repr__(self) -> str:
        return f"Stage({', '.join(map(repr, self._blocks))}, stage={self._stage_id}, ipu={self._ipu})"


class Phase:
    """An execution phase: stages that run in parallel (PopTorch's ``poptorch.Phase``).

    Args:
        arg: one or more ``Stage`` (one stage each), or one or more block ids (one stage).
    """

    def __init__(self, *arg: Any):
        items: list[Any] = list(arg[0]) if len(arg) == 1 and isinstance(arg[0], (list, tuple)) else list(arg)
        if items and all(isinstance(e, Stage) for e in items):
            self.stages: list[Stage] = items
        elif items and all(isinstance(e, str) for e in items):
            self.stages = [Stage(*items)]
        else:
            raise OptionsError(f"poptorch.Phase: all arguments must either be strings or Stages, got {arg!r}",
                               where=user_source_line(), fix='e.g. poptorch.Phase(poptorch.Stage("A"), "B")')

    def stage(self, idx: int) -> Stage:
        """The phase's stage number ``idx``."""
        return self.stages[idx]

    def ipus(self, *ipus: int) -> Phase:
        """Put the phase's stages on these IPUs (one per stage)."""
        if len(ipus) != len(self.stages):
            raise OptionsError(f"Phase contains {len(self.stages)} stages but you provided {len(ipus)} ipus",
                               where=user_source_line(), fix="give one IPU per stage of the phase")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)
        return self


# -- stage managers: which stage and IPU a block gets ------------------------------------------------
class _StageManager:
    """Gives each block its ``Stage`` (upstream's ``IStageManager``)."""

    def __init__(self, block_map: dict[str, Stage] | None, auto_stage: enums.AutoStage):
        self._explicit = block_map is not None and len(block_map) > 0
        self._block_map: dict[str, Stage] = dict(block_map or {})
        self._auto_stage = auto_stage
        self._next_stage = 0
        self._next_auto_id = 0

    def nextAutoId(self) -> str:  # noqa: N802 - upstream's name
        """The next automatic block id (``Block.useAutoId``): "0", "1"..."""
        found = str(self._next_auto_id)
        self._next_auto_id += 1
        return found

    def resetAutoId(self) -> None:  # noqa: N802
        self._next_auto_id = 0

    def getStage(self, block_id: str, ipu_id: int | None) -> Stage:  # noqa: N802
        """The stage of block ``block_id`` (started with ``ipu_id``)."""
        if block_id in self._block_map:
            return self._block_map[block_id]
        if self._explicit:
            raise OptionsError(f"Unknown Block '{block_id}' list of expected Blocks: {list(self._block_map)}",
                               where=user_source_line(),
                               fix="name the block in one of the strategy's Stages, or rename the block")
        stage = Stage(block_id)
        if self._auto_stage == enums.AutoStage.SameAsIpu:
            if ipu_id is None:
                raise OptionsError(f"poptorch.AutoStage.SameAsIpu was selected but no IPU was specified for block "
                                   f"{block_id}", where=user_source_line(),
                                   fix=f'pass ipu_id=... to the block, or list the blocks in the execution strategy, '
                                       f'e.g. poptorch.PipelinedExecution("{block_id}", ...)')
            stage._setStage(ipu_id)
        else:
            stage._setStage(self._next_stage)
            self._next_stage += 1
        self._block_map[block_id] = stage
        return stage

    def place(self, block_id: str, ipu_id: int | None) -> tuple[int, int]:
        """The stage number and IPU of block ``block_id`` (started with ``ipu_id``): the
        stage's own IPU if it names one, else the block's, else the stage number."""
        stage = self.getStage(block_id, ipu_id)
        number = max(stage._stage_id, 0)
        return number, stage._ipu if stage._ipu is not None else ipu_id if ipu_id is not None else number


# -- execution strategies --------------------------------------------------------------------------
class _IExecutionStrategy:
    """What every execution strategy has: its blocks' stages and ``backendOptions()``."""

    kind = "pipelined"

    def __init__(self, block_map: dict[str, Stage], auto_stage: enums.AutoStage = enums.AutoStage.SameAsIpu):
        self._block_map = block_map
        self._auto_stage = auto_stage

    def stage(self, block_id: str) -> Stage:
        """The ``Stage`` block ``block_id`` belongs to."""
        if block_id not in self._block_map:
            raise OptionsError(f"Unknown block {block_id}", where=user_source_line(),
                               fix=f"use one of the strategy's blocks: {list(self._block_map)}")
        return self._block_map[block_id]

    def backendOptions(self) -> dict[str, Any]:  # noqa: N802 - upstream's name
        return {}

    def _new_manager(self) -> _StageManager:
        """A fresh stage manager for one capture (automatic stages start again from 0)."""
        return _StageManager(self._block_map, self._auto_stage)

    def __deepcopy__(self, memo: dict) -> _IExecutionStrategy:
        # Options.clone() deep-copies: stages are plain records, so a copy is cheap and independent
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        stages = {id(s): _copy_stage(s) for s in self._block_map.values()}
        for key, value in vars(self).items():
            if key == "_block_map":
                value = {b: stages[id(s)] for b, s in value.items()}
            elif key == "_phases":
                value = [_copy_phase(p, stages) for p in value]
            setattr(new, key, value)
        return new


def _copy_stage(stage: Stage) -> Stage:
    new = Stage(*stage.blocks)
    new._stage_id, new._phase_id, new._ipu = stage._stage_id, stage._phase_id, stage._ipu
    return new


def _copy_phase(phase: Phase, stages: dict[int, Stage]) -> Phase:
    new = Phase.__new__(Phase)
    new.stages = [stages.get(id(s), s) for s in phase.stages]
    return new


class PipelinedExecution(_IExecutionStrategy):
    """Pipeline the given stages (PopTorch's ``poptorch.PipelinedExecution``).

    Args:
        args: a ``poptorch.AutoStage`` (each new block gets its own stage: its IPU's
            number with ``SameAsIpu``, the default, or the next number with
            ``AutoIncrement``), or the stages in order: each a ``Stage``, a block id,
            or a list of block ids. A stage without ``.ipu(n)`` runs on the IPU of its
            blocks' ``ipu_id``, else on IPU number = its stage number.

    Example:
        >>> opts.setExecutionStrategy(PipelinedExecution(Stage("B1").ipu(0), Stage("B2").ipu(1)))
    """

    kind = "pipelined"

    def __init__(self, *args: Any):
        block_map: dict[str, Stage] = {}
        auto_stage = enums.AutoStage.SameAsIpu
        if len(args) == 1 and isinstance(args[0], enums.AutoStage):
            auto_stage = args[0]
        else:
            for stage_id, arg in enumerate(args):
                stage = _as_stage(arg)
                stage._setStage(stage_id)
                _add_blocks(block_map, stage)
        super().__init__(block_map, auto_stage)

    def backendOptions(self) -> dict[str, Any]:  # noqa: N802
        return {"execution_mode": 0}


class ShardedExecution(PipelinedExecution):
    """Run the stages one after the other, one micro-batch at a time (PopTorch's
    ``poptorch.ShardedExecution``; same arguments as ``PipelinedExecution``)."""

    kind = "sharded"

    def backendOptions(self) -> dict[str, Any]:  # noqa: N802
        return {"execution_mode": 1}


class _IPhasedExecution(_IExecutionStrategy):
    """What both phased strategies share: phases of stages."""

    kind = "phased"

    def __init__(self, *phases: Any):
        if len(phases) == 1 and isinstance(phases[0], list) and phases[0] and all(
                isinstance(p, Phase) for p in phases[0]):
            phases = tuple(phases[0])
        if not phases:
            raise OptionsError("There is currently no AutoStage for PhasedExecution, please explicitly specify "
                               "the phases", where=user_source_line(),
                               fix='e.g. poptorch.SerialPhasedExecution(poptorch.Phase("A"), poptorch.Phase("B"))')
        self._tensors_liveness = enums.Liveness.AlwaysLive
        self._separate_backward_phase = False
        self._phases: list[Phase] = []
        block_map: dict[str, Stage] = {}
        number = 0  # ipuxl places the stages of the phases in order, one stage number each
        for phase_id, args in enumerate(phases):
            phase = args if isinstance(args, Phase) else Phase(args)
            self._phases.append(phase)
            for stage in phase.stages:
                stage._phase_id = phase_id
                stage._setStage(number)
                number += 1
                _add_blocks(block_map, stage)
        super().__init__(block_map)

    def phase(self, phase: int) -> Phase:
        """The phase number ``phase``."""
        if not isinstance(phase, int) or phase < 0:
            raise OptionsError("Phases are identified by positive integers", where=user_source_line(),
                               fix="pass the phase's index")
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use: bool = True) -> _IPhasedExecution:  # noqa: N802
        """No phase shared between the forward and backward passes (recorded)."""
        self._separate_backward_phase = _flag(use, "useSeparateBackwardPhase")
        return self

    def backendOptions(self) -> dict[str, Any]:  # noqa: N802
        return {"execution_mode": 2, "separate_backward_phase": self._separate_backward_phase,
                "tensors_liveness": self._tensors_liveness.value}


class ParallelPhasedExecution(_IPhasedExecution):
    """Phases run in parallel, alternating between two groups of IPUs (PopTorch's
    ``poptorch.ParallelPhasedExecution``; placed and run as sharded here)."""

    def backendOptions(self) -> dict[str, Any]:  # noqa: N802
        return {**super().backendOptions(), "serial_phases_execution": False}

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> ParallelPhasedExecution:  # noqa: N802
        """Move tensors off chip after the forward pass (recorded as ``Liveness``)."""
        off = _flag(off_chip, "sendTensorsOffChipAfterFwd")
        self._tensors_liveness = enums.Liveness.OffChipAfterFwd if off else enums.Liveness.AlwaysLive
        return self


class SerialPhasedExecution(_IPhasedExecution):
    """All phases run one after the other on one group of IPUs (PopTorch's
    ``poptorch.SerialPhasedExecution``; placed and run as sharded here)."""

    def setTensorsLiveness(self, liveness: enums.Liveness) -> SerialPhasedExecution:  # noqa: N802
        """Where tensors live between phases (a ``poptorch.Liveness``; recorded)."""
        if not isinstance(liveness, enums.Liveness):
            raise OptionsError(f"setTensorsLiveness: expected a poptorch.Liveness, got {liveness!r}",
                               where=user_source_line(), fix="e.g. poptorch.Liveness.AlwaysLive")
        self._tensors_liveness = liveness
        return self

    def backendOptions(self) -> dict[str, Any]:  # noqa: N802
        return {**super().backendOptions(), "serial_phases_execution": True}


def _as_stage(arg: Any) -> Stage:
    if isinstance(arg, Stage):
        return arg
    if isinstance(arg, str):
        return Stage(arg)
    if isinstance(arg, (list, tuple)) and all(isinstance(e, str) for e in arg):
        return Stage(*arg)
    raise OptionsError(f"an execution strategy's stages must be poptorch.Stage, block ids or lists of block ids, "
                       f"got {arg!r}", where=user_source_line(), fix='e.g. poptorch.Stage("B1").ipu(0)')


def _add_blocks(block_map: dict[str, Stage], stage: Stage) -> None:
    for block in stage.blocks:
        if block in block_map:
            raise OptionsError(f"{block} associated with more than one stage", where=user_source_line(),
                               fix="put each block in one stage only")
        block_map[block] = stage


def _flag(value: Any, method: str) -> bool:
    if not isinstance(value, bool):
        raise OptionsError(f"{method}: expected a bool, got {value!r}", where=user_source_line(),
                           fix="pass True or False")
    return value


# -- blocks ----------------------------------------------------------------------------------------
class Block(torch.nn.Module):
    """A context manager starting a block of the model (PopTorch's ``poptorch.Block``).

    Args:
        user_id: the block's name; blocks with the same name are one block. Strategies
            group blocks into stages by name. None: an automatic id (``useAutoId``).
        ipu_id: the IPU to run on (unless the block's ``Stage`` names one).

    Example:
        >>> with poptorch.Block("B1", ipu_id=0):
        ...     x = self.layer1(x)
    """

    def __init__(self, user_id: str | None = None, ipu_id: int | None = None):
        super().__init__()
        self._user_id = user_id
        self._ipu_id = ipu_id

    @staticmethod
    def useAutoId() -> None:  # noqa: N802 - upstream's name
        """Number the following id-less blocks from "0" again (call it at the start of forward)."""
        active = _active()
        if active is not None:
            active.manager.resetAutoId()

    @staticmethod
    def start(user_id: str | None = None, ipu_id: int | None = None) -> None:
        """Start block ``user_id`` (what entering ``Block`` does)."""
        active = _active()
        if active is not None:
            active.begin(user_id, ipu_id)

    def __enter__(self) -> None:
        Block.start(self._user_id, self._ipu_id)

    def __exit__(self, *exc: Any) -> None:
        return None  # the ops that follow stay in this block until another one starts (as BeginBlock)


class LegacyBeginBlockFn(torch.nn.Module):
    """``BeginBlock`` of a plain callable (upstream keeps this for old code): calling it starts the block."""

    def __init__(self, layer_to_call: Callable[..., Any], user_id: str | None = None, ipu_id: int | None = None):
        super().__init__()
        self._user_id, self._layer_to_call, self._ipu_id = user_id, layer_to_call, ipu_id

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _active()
        if active is not None:
            if self._user_id is None:
                self._user_id = active.manager.nextAutoId()
            active.begin(self._user_id, self._ipu_id)
        return self._layer_to_call(*args, **kwargs)


class _BlockHook:
    """The forward pre-hook ``BeginBlock`` registers: running the module starts its block."""

    def __init__(self, user_id: str | None, ipu_id: int | None):
        self._user_id, self._ipu_id = user_id, ipu_id

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        active = _active()
        if active is not None:
            if self._user_id is None:
                self._user_id = active.manager.nextAutoId()
            active.begin(self._user_id, self._ipu_id)

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self._user_id}, ipu_id={self._ipu_id})"


def BeginBlock(layer_to_call: torch.nn.Module, user_id: str | None = None,  # noqa: N802 - PopTorch's name
               ipu_id: int | None = None) -> torch.nn.Module:
    """Start a block where ``layer_to_call`` runs (PopTorch's ``poptorch.BeginBlock``).

    The module, and every op after it, belong to the block until another block starts.
    The module is changed in place (a forward pre-hook) and returned.

    Raises:
        InvalidArgumentError: ``layer_to_call`` is not a module or callable, or is already in a block.

    Example:
        >>> poptorch.BeginBlock(model.layer2, "B2", ipu_id=1)
    """
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return LegacyBeginBlockFn(layer_to_call, user_id, ipu_id)
        raise InvalidArgumentError("BeginBlock: module is not an instance of torch.nn.Module or function.",
                                   where=user_source_line(), fix="pass the layer (an nn.Module) that starts the block")
    if any(isinstance(hook, _BlockHook) for hook in layer_to_call._forward_pre_hooks.values()):
        raise InvalidArgumentError("BeginBlock: module has already been assigned to a block.",
                                   where=user_source_line(), fix="call poptorch.removeBlocks(module) first")
    layer_to_call.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
    return layer_to_call


def BlockFunction(user_id: str | None = None, ipu_id: int | None = None  # noqa: N802 - PopTorch's name
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator running a function in a block (PopTorch's ``poptorch.BlockFunction``).

    Example:
        >>> @poptorch.BlockFunction("Decoder", ipu_id=1)
        ... def decoder(self, encoder_output): ...
    """
    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)
        return wrapper
    return decorator


def removeBlocks(module: torch.nn.Module) -> None:  # noqa: N802 - PopTorch's name
    """Remove the ``BeginBlock`` annotations of ``module`` and its submodules."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(f"removeBlocks: expected an nn.Module, got {type(module).__name__}",
                                   where=user_source_line(), fix="pass the model")
    for m in module.modules():
        m._forward_pre_hooks = OrderedDict((k, h) for k, h in m._forward_pre_hooks.items()
                                           if not isinstance(h, _BlockHook))


# -- the capture's side: who hears block starts -------------------------------------------------------
class BlockListener(Protocol):
    """What a capture gives the blocks it runs (``compile.placement.Placement``): the
    stage manager for automatic ids, and each block start."""

    manager: _StageManager

    def begin(self, user_id: str | None, ipu_id: int | None) -> None: ...


def stage_manager(strategy: Any) -> _StageManager:
    """A fresh stage manager for one capture under ``strategy`` (an execution strategy;
    anything else: PopTorch's default, ``AutoStage.SameAsIpu``)."""
    if isinstance(strategy, _IExecutionStrategy):
        return strategy._new_manager()
    return _StageManager(None, enums.AutoStage.SameAsIpu)


def _active() -> BlockListener | None:
    return getattr(_state, "listener", None)


@contextlib.contextmanager
def listening_to_blocks(listener: BlockListener) -> Iterator[BlockListener]:
    """Blocks started in this thread while the body runs go to ``listener`` (the one
    outside is restored afterwards)."""
    outer = _active()
    _state.listener = listener
    try:
        yield listener
    finally:
        _state.listener = outer
