"""Every top-level name of PopTorch 3.3 has a row in docs/poptorch.md's first table, and
the names documented as working exist (``tests/compat/test_poptorch_namespace.py``)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

#: PopTorch 3.3's top-level names (``poptorch/__init__.py``, its ``enums``, ``ops`` and
#: ``options`` star imports, and its public submodules)
UPSTREAM_NAMES = (
    # poptorch/__init__.py
    "trainingModel", "inferenceModel", "PoplarExecutor", "load", "DataLoader", "AsynchronousDataAccessor",
    "ipuHardwareIsAvailable", "ipuHardwareVersion", "setLogLevel", "logger", "isRunningOnIpu",
    "createPoptorchError", "accessAttributes", "hasMlirSupportOnPlatform", "Error", "RecoverableError",
    "UnrecoverableError", "enableEagerMode", "registerPreCompileHook", "registerPostCompileHook",
    "ICustomArgParser", "registerCustomArgParser", "__version__",
    # enums
    "OutputMode", "AnchorMode", "ConnectionType", "HalfFloatCastingBehavior", "ReductionType", "SyncPattern",
    "MatMulSerializationMode", "OverlapMode", "MeanReductionStrategy", "Liveness", "AutoStage", "CommGroupType",
    "VariableRetrievalMode", "MultiConvPlanType", "SharingStrategy", "DataLoaderMode",
    # ops
    "ctc_beam_search_decoder", "ipu_print_tensor", "for_loop", "cond", "nop", "dynamic_slice", "dynamic_update",
    "recomputationCheckpoint", "serializedMatMul", "set_available_memory", "set_overlap_for_input",
    "set_overlap_for_output", "identity_loss", "MultiConv", "CPU", "NameScope", "Attribute", "custom_op", "fps",
    "nearest", "BeginBlock", "Block", "BlockFunction", "removeBlocks",
    # options
    "Options", "TensorLocationSettings", "Stage", "Phase", "PipelinedExecution", "ShardedExecution",
    "SerialPhasedExecution", "ParallelPhasedExecution", "ConfigFileError",
    # submodules
    "optim", "enums", "options", "logging", "poptorch_core", "profiling", "experimental", "autocasting", "testing",
    "distributed", "eager",
)


def _first_table() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "poptorch.md").read_text(encoding="utf-8")
    return text.split("## Top-level names", 1)[1].split("\n## ", 1)[0]


def _documented() -> set[str]:
    names = set()
    for row in _first_table().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 2:
            for code in re.findall(r"`([^`]+)`", cells[0]):
                path = code.split("(")[0]  # `cond(...)`, `PoplarExecutor.getTensorNames`
                found = re.match(r"[A-Za-z_]\w*", path.split(".")[-1])
                if found:
                    names.add(found.group(0))
    return names


@pytest.mark.parametrize("name", UPSTREAM_NAMES)
def test_every_upstream_name_has_a_row(name):
    assert name in _documented(), f"docs/poptorch.md's first table has no row for poptorch.{name}"


def test_the_rows_have_a_known_status():
    statuses = ("supported", "simulated", "accepted without effect", "not applicable", "recorded", "removed upstream",
                "refused")
    for row in _first_table().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] not in ("name", "---"):
            assert cells[1].startswith(statuses), row
