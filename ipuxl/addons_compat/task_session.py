"""popxl.addons' ``TaskSession``: a ``Session`` that knows its streams and its state (the
variables a task saves and loads), with checkpoints as upstream writes them.

A checkpoint is a directory::

    CHECKPOINT_DIR/model/<name>.npz   one file per state variable, holding {name: array}
    CHECKPOINT_DIR/dataloader.bin     the data loader's state (when one is set)
    CHECKPOINT_DIR/session_info.json  ``session_state`` (the step count and what the task adds)

Only instance 0 of a multi-process program (torchrun) writes it, after every instance
has read the variables back, as upstream does with popdist. At most ``max_checkpoints``
are kept: saving one more deletes the oldest this session saved.

Differences from upstream: ``wandb://`` checkpoints are refused (ipuxl never reaches the
network); variables backed by ``np.memmap`` files (``init(memmap_dir=...)``) are saved like any
other array.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from collections import deque
from typing import Any, Iterable, Literal, Mapping, cast

import numpy as np

from ipuxl.addons_compat.named_tensors import NamedTensorData, NamedTensors
from ipuxl.addons_compat.streams import InputStreams, OutputStreams
from ipuxl.addons_compat.utils import timer
from ipuxl.device import Session
from ipuxl.errors import CheckpointError, InvalidArgumentError, InvalidValueError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor, Variable
from ipuxl.ir.world import world

__all__ = ["TaskSession"]

ReportMissingMethods = Literal["none", "warn", "error"]
logger = logging.getLogger(__name__)

_SESSION_FILE = "session_info.json"
_DATALOADER_FILE = "dataloader.bin"


class TaskSession(Session):
    """A ``Session`` with its ``inputs``/``outputs`` streams by name and its ``state`` variables.

    Args:
        inputs: ``InputStreams``, or host-to-device streams (named by their names).
        outputs: ``OutputStreams``, or device-to-host streams.
        state: the variables the task saves and loads, by name.
        max_checkpoints: checkpoints kept on disk by ``save_checkpoint``.
        *args, **kwargs: ``Session``'s (``ir``, ``device_desc``).

    Example:
        >>> session = TaskSession(inputs, outputs, state=variables, ir=ir, device_desc="ipu_hw")
        >>> with session:
        ...     session.run(data)
        ...     session.save_checkpoint("ckpt/step_1")
    """

    def __init__(self, inputs: InputStreams | Iterable[Any], outputs: OutputStreams | Iterable[Any],
                 state: NamedTensors, max_checkpoints: int = 1, *args: Any, **kwargs: Any):
        with timer("PopXL compilation"):
            super().__init__(*args, **kwargs)
        self.inputs = inputs if isinstance(inputs, InputStreams) else InputStreams.from_streams(inputs)
        self.outputs = outputs if isinstance(outputs, OutputStreams) else OutputStreams.from_streams(outputs)
        self.state = state
        self.session_state: dict[str, Any] = {"steps": 0}
        self._dataloader: Any = None
        self._checkpoints: deque[str] = deque()
        self._max_checkpoints = max_checkpoints

    # -- what a checkpoint holds besides the variables ---------------------------------------
    @property
    def dataloader(self) -> Any:
        """The data loader whose state checkpoints hold (it has ``save`` and ``resume``)."""
        if self._dataloader is None:
            logger.warning("No dataloader set. Checkpoint support is incomplete. You won't be able to resume training.")
        return self._dataloader

    @dataloader.setter
    def dataloader(self, dl: Any) -> None:
        if not (hasattr(dl, "save") and hasattr(dl, "resume")):
            raise InvalidValueError("TaskSession.dataloader: the data loader must implement save and resume methods",
                                    where=user_source_line(), fix="set a loader with save(filename) and "
                                                                  "resume(filename), e.g. a StatefulDataLoader")
        self._dataloader = dl

    def add_session_state_info(self, info: Mapping[str, Any]) -> None:
        """Add entries (JSON values) to ``session_state``, which checkpoints save."""
        self.session_state.update(info)

    def run(self, inputs: Any = None, downcast_inputs: bool = True) -> Any:
        """``Session.run``, counting the runs in ``session_state["steps"]``."""
        self.session_state["steps"] += 1
        return super().run(inputs, downcast_inputs)

    # -- variables by name --------------------------------------------------------------------
    def get_named_tensors_data(self) -> NamedTensorData:
        """The state variables' values (read from the device first when attached), by name."""
        data = self.get_tensors_data(self.state.tensors)
        return NamedTensorData.from_dict({name: data[t] for name, t in self.state.to_dict().items()})

    def load_from_session(self, src: "TaskSession", report_missing: ReportMissingMethods = "none") -> None:
        """Copy ``src``'s state variables to this session's variables of the same names."""
        self._load_from_tensors(src.state, src.get_tensors_data(src.state.tensors), report_missing)

    def _load_from_tensors(self, src: NamedTensors, loaded: Mapping[Tensor, np.ndarray],
                           report_missing: ReportMissingMethods = "none") -> None:
        _report_missing(src.to_dict().keys(), self.state.to_dict().keys(), report_missing)
        src_to_dst = src.to_mapping(self.state)
        self.write_variables_data({cast(Variable, src_to_dst[t]): value for t, value in loaded.items()
                                   if t in src_to_dst})

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Save the state variables, the data loader's state and ``session_state`` to
        ``checkpoint_dir`` (see the module docstring). Every instance must call it."""
        _no_wandb(checkpoint_dir)
        with timer("Get tensor data from IPU ... "):
            state = self.get_named_tensors_data().to_dict()  # every instance takes part in reading back
        if world()[1] != 0:
            return
        with timer(f"Saving checkpoint {checkpoint_dir} ... "):
            checkpoint_dir = os.path.relpath(os.path.expanduser(checkpoint_dir))
            os.makedirs(os.path.join(checkpoint_dir, "model"), exist_ok=True)
            if len(self._checkpoints) >= self._max_checkpoints:
                oldest = self._checkpoints.popleft()
                logger.info(f"\t Deleting old checkpoint {oldest} ... ")
                shutil.rmtree(oldest, ignore_errors=True)
            self._write_checkpoint(checkpoint_dir, state)
            self._checkpoints.append(checkpoint_dir)

    def load_checkpoint(self, checkpoint_dir: str, report_missing: ReportMissingMethods = "warn",
                        skip_memmap: bool = False) -> None:
        """Load a checkpoint written by ``save_checkpoint``: the state variables present in
        it, the data loader's state (when a loader is set) and ``session_state``.

        Args:
            checkpoint_dir: the checkpoint directory.
            report_missing: what to do about names only in the checkpoint or only in the
                state: ``"none"``, ``"warn"`` (log) or ``"error"``.
            skip_memmap: leave out the variables whose host value is a memory-mapped file
                (``init(memmap_dir=...)``): they keep the values of their files.

        Raises:
            CheckpointError: (a ValueError, as upstream) ``report_missing="error"`` and the
                names differ, or no checkpoint at ``checkpoint_dir``.
        """
        _no_wandb(checkpoint_dir)
        with timer(f"Loading checkpoint {checkpoint_dir} ... "):
            session_file = os.path.join(checkpoint_dir, _SESSION_FILE)
            if not os.path.isfile(session_file):
                raise CheckpointError(f"load_checkpoint: no checkpoint in '{checkpoint_dir}' (no {_SESSION_FILE})",
                                      where=user_source_line(),
                                      fix="give a directory written by TaskSession.save_checkpoint")
            variables = self.state.to_dict()
            saved = glob.glob(os.path.join(checkpoint_dir, "model", "*.npz"))
            files = {os.path.basename(f)[:-len(".npz")] for f in saved}
            _report_missing(files, variables.keys(), report_missing)
            data: dict[Variable, np.ndarray] = {}
            names = files & variables.keys()
            if skip_memmap:
                host = self.get_tensors_data([variables[n] for n in names])
                names = {n for n in names if not isinstance(host[variables[n]], np.memmap)}
            for name in sorted(names):
                with np.load(os.path.join(checkpoint_dir, "model", f"{name}.npz"), allow_pickle=False) as loaded:
                    data[cast(Variable, variables[name])] = loaded[name]
            self.write_variables_data(data)
            logger.info("\t Loaded model state")
            if self._dataloader is not None:
                self._dataloader.resume(filename=os.path.join(checkpoint_dir, _DATALOADER_FILE))
            with open(session_file) as f:
                loaded_state = json.load(f)
            _report_missing(loaded_state.keys(), self.session_state.keys(), report_missing)
            self.session_state = loaded_state

    def _write_checkpoint(self, checkpoint_dir: str, state: Mapping[str, np.ndarray]) -> None:
        for name, value in state.items():
            arrays: dict[str, Any] = {name: value}  # one file per variable, the array under its name
            np.savez(os.path.join(checkpoint_dir, "model", f"{name}.npz"), **arrays)
        if self._dataloader is not None:
            self._dataloader.save(os.path.join(checkpoint_dir, _DATALOADER_FILE))
        with open(os.path.join(checkpoint_dir, _SESSION_FILE), "w") as f:
            json.dump(self.session_state, f)


def _no_wandb(path: str) -> None:
    if path.startswith("wandb://"):
        raise InvalidArgumentError(f"TaskSession: '{path}': Weights & Biases checkpoints are not supported",
                                   where=user_source_line(), fix="save to a local directory")


def _report_missing(ckpt_keys: Iterable[str], state_keys: Iterable[str], method: ReportMissingMethods) -> None:
    """Say which names are only in the checkpoint and which only in the state (log, raise or nothing)."""
    if method == "none":
        return
    ckpt, state = set(ckpt_keys), set(state_keys)
    lines = []
    if ckpt - state:
        lines.append(f"Checkpoint keys not in state: {sorted(ckpt - state)}")
    if state - ckpt:
        lines.append(f"state keys not in checkpoint: {sorted(state - ckpt)}")
    if lines and method == "error":
        raise CheckpointError("; ".join(lines), where=user_source_line(),
                              fix="load a checkpoint of this task, or pass report_missing='warn' or 'none'")
    if lines:
        logger.warning("\n".join(lines))
