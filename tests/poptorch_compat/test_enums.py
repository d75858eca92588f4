"""PopTorch's enums (``ipuxl.poptorch_compat.enums``): upstream's members and values.

Upstream's ``python/enums.py`` (PopTorch 3.x) is the contract for member names and values.
"""
from __future__ import annotations

import enum

import pytest

import ipuxl.poptorch_compat as poptorch
from ipuxl.poptorch_compat import enums

# upstream's members and values, enum by enum (PopTorch 3.x python/enums.py)
UPSTREAM = {
    "MeanReductionStrategy": {"Running": 0, "Post": 1, "PostAndLoss": 2},
    "DataLoaderMode": {"Sync": 0, "Async": 1, "AsyncRebatched": 2},
    "SharingStrategy": {"SharedMemory": 0, "FileSystem": 1, "Fork": 2, "ForkServer": 3},
    "OutputMode": {"Final": 0, "EveryN": 1, "All": 2, "Sum": 3, "Default": 4},
    "ConnectionType": {"Always": 0, "OnDemand": 1, "Never": 2},
    "HalfFloatCastingBehavior": {"FloatDowncastToHalf": 0, "HalfUpcastToFloat": 1, "Default": 2},
    "ReductionType": {"Sum": 0, "Mean": 1, "NoReduction": 2},
    "SyncPattern": {"Full": 0, "SinglePipeline": 1, "ReplicaAndLadder": 2},
    "MatMulSerializationMode": {"InputChannels": "input_channels", "ReducingDim": "reducing_dim",
                                "OutputChannels": "output_channels", "Disabled": "none"},
    "Liveness": {"AlwaysLive": 0, "OffChipAfterFwd": 1, "OffChipAfterFwdNoOverlap": 2, "OffChipAfterEachPhase": 3},
    "OverlapMode": {"NoOverlap": "no_overlap", "OverlapAccumulationLoop": "overlap_accumulation_loop",
                    "OverlapDeviceIterationLoop": "overlap_device_iteration_loop"},
    "AutoStage": {"SameAsIpu": 0, "AutoIncrement": 1},
    "MultiConvPlanType": {"Parallel": 0, "Serial": 1},
    "CommGroupType": {"All": 0, "Consecutive": 1, "Orthogonal": 2, "NoGrouping": 3},
    "VariableRetrievalMode": {"OnePerGroup": 0, "AllReplicas": 2},
}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_every_upstream_enum_has_upstreams_members_and_values(name):
    cls = getattr(enums, name)
    assert {m.name: m.value for m in cls} == UPSTREAM[name]
    assert getattr(poptorch, name) is cls  # exported at PopTorch's top level too
    assert name in enums.__all__


def test_int_enums_compare_as_ints_and_string_enums_as_strings():
    assert enums.ReductionType.Mean == 1 and isinstance(enums.ReductionType.Mean, int)
    assert enums.MatMulSerializationMode("reducing_dim") is enums.MatMulSerializationMode.ReducingDim
    assert not issubclass(enums.OverlapMode, int) and issubclass(enums.OverlapMode, enum.Enum)


def test_output_mode_and_data_loader_mode_are_the_ones_the_front_end_uses():
    from ipuxl.poptorch_compat.dataloader import DataLoaderMode
    from ipuxl.poptorch_compat.options import AnchorMode, OutputMode

    assert enums.OutputMode is OutputMode and enums.AnchorMode is AnchorMode is OutputMode
    assert enums.DataLoaderMode is DataLoaderMode is poptorch.DataLoaderMode
    from ipuxl.poptorch_compat.enums import OutputMode as Imported  # ``from poptorch.enums import ...``
    assert Imported is OutputMode
    with pytest.raises(AttributeError, match="poptorch.enums"):
        enums.NotAnEnum  # noqa: B018
