"""popxl.addons' ``TaskSession``: a ``Session`` that knows its streams and its model's
variables, and saves, loads and copies those variables by name."""
from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Literal, Mapping

import numpy as np

from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.streams import InputStreams, OutputStreams
from ipuxl.device import Session
from ipuxl.errors import CheckpointError, InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor

__all__ = ["TaskSession"]

ReportMissingMethods = Literal["none", "warn", "error"]
logger = logging.getLogger(__name__)


class TaskSession(Session):
    """A ``Session`` with its ``inputs``/``outputs`` streams by name and its ``model`` variables.

    Args:
        inputs: ``InputStreams``, or host-to-device streams (named by their names).
        outputs: ``OutputStreams``, or device-to-host streams.
        model: the variables that make the model (saved and loaded by name).
        *args, **kwargs: ``Session``'s (``ir``, ``device_desc``).

    Checkpoints are ``np.savez`` files holding ``{name: array}`` under the key ``ckpt``,
    as upstream writes them. Upstream's ``wandb://`` paths are not supported.
    """

    def __init__(self, inputs: InputStreams | Iterable[Any], outputs: OutputStreams | Iterable[Any],
                 model: NamedTensors, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.inputs = inputs if isinstance(inputs, InputStreams) else InputStreams.from_streams(inputs)
        self.outputs = outputs if isinstance(outputs, OutputStreams) else OutputStreams.from_streams(outputs)
        self.model = model

    def save_checkpoint(self, file_path: str) -> None:
        """Write the model's variables, by name, to ``file_path`` (``.npz``)."""
        _no_wandb(file_path)
        data = self.get_tensors_data(self.model.tensors)
        ckpt = {name: data[t] for name, t in self.model.to_dict().items()}
        os.makedirs(os.path.dirname(file_path) or ".", exist_ok=True)
        np.savez(file_path, ckpt=np.array(ckpt, dtype=object))

    def load_checkpoint(self, file_path: str, report_missing: ReportMissingMethods = "warn") -> None:
        """Write the variables saved by ``save_checkpoint`` to the model's variables of the same names."""
        _no_wandb(file_path)
        ckpt = np.load(file_path, allow_pickle=True)["ckpt"].item()
        variables = self.model.to_dict()
        _report_missing(ckpt.keys(), variables.keys(), report_missing)
        values: dict[Any, np.ndarray] = {variables[n]: ckpt[n] for n in variables.keys() & ckpt.keys()}
        self.write_variables_data(values)

    def load_from_session(self, src: "TaskSession", report_missing: ReportMissingMethods = "none") -> None:
        """Copy the values of ``src``'s model variables to this session's variables of the same names."""
        self.load_from_tensors(src.model, src.get_tensors_data(src.model.tensors), report_missing)

    def load_from_tensors(self, src: NamedTensors, loaded: Mapping[Tensor, np.ndarray],
                          report_missing: ReportMissingMethods = "none") -> None:
        """Write ``loaded`` (values of ``src``'s tensors) to this model's variables of the same names."""
        _report_missing(src.to_dict().keys(), self.model.to_dict().keys(), report_missing)
        src_to_dst = src.to_mapping(self.model)
        values: dict[Any, np.ndarray] = {src_to_dst[t]: value for t, value in loaded.items() if t in src_to_dst}
        self.write_variables_data(values)


def _no_wandb(file_path: str) -> None:
    if file_path.startswith("wandb://"):
        raise InvalidArgumentError(f"TaskSession: '{file_path}': Weights & Biases checkpoints are not supported",
                                   where=user_source_line(), fix="save to a local file path")


def _report_missing(ckpt_keys: Iterable[str], model_keys: Iterable[str], method: ReportMissingMethods) -> None:
    """Say which names are only in the checkpoint and which only in the model (log, raise or nothing)."""
    if method == "none":
        return
    ckpt, model = set(ckpt_keys), set(model_keys)
    lines = []
    if ckpt - model:
        lines.append(f"Checkpoint Tensors not in model: {sorted(ckpt - model)}")
    if model - ckpt:
        lines.append(f"Model Tensors not in checkpoint: {sorted(model - ckpt)}")
    if lines and method == "error":
        raise CheckpointError("; ".join(lines), where=user_source_line(),
                              fix="load a checkpoint of this model, or pass report_missing='warn' or 'none'")
    if lines:
        logger.warning("\n".join(lines))
