"""PopTorch's ``Options.TensorLocations`` in the resource model (``device.resources``).

``opts.TensorLocations.setWeightLocation(loc)`` / ``setOptimizerLocation(loc)`` with a
``TensorLocationSettings`` decide where the model's weights / optimiser state live. As in
PopART, a tensor goes off-chip (Streaming Memory) when the settings say
``useOnChipStorage(False)`` and it has at least ``minElementsForOffChip`` elements (2 by
default); it is sharded over the replicas (replicated tensor sharding) when
``useReplicatedTensorSharding(True)``, the program is replicated and it has at least
``minElementsForReplicatedTensorSharding`` elements (8192 by default).

The simulation keeps every value where it was (the host tensor is the device storage)
and only *accounts* the choice: ``resources.estimate`` counts an off-chip variable in
Streaming Memory instead of on-chip, a sharded one as its shard, and
``resources.remote_traffic`` counts loading it once per step (and storing it once per
step when the program updates it, as training does). Results are unchanged.

``setAccumulatorLocation`` and ``setActivationLocation`` are recorded but move nothing:
ipuxl's programs hold no gradient-accumulator variables (a step sums its micro-batches'
gradients as activations) and keep activations on-chip.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ipuxl.device.resources import StoredTensor, tensor_locations

if TYPE_CHECKING:
    from ipuxl.ir.tensor import Variable
    from ipuxl.poptorch_compat.options import Options
    from ipuxl.poptorch_compat.compile.program import Program

__all__ = ["apply_tensor_locations", "MIN_ELEMENTS_FOR_OFF_CHIP", "MIN_ELEMENTS_FOR_RTS"]

MIN_ELEMENTS_FOR_OFF_CHIP = 2
"""PopART's default ``minElementsForOffChip``."""
MIN_ELEMENTS_FOR_RTS = 8192
"""PopART's default ``minElementsForReplicatedTensorSharding``."""


def _settings(options: Options, key: str) -> dict[str, Any]:
    values = options.TensorLocations.toDict()
    found = values.get(key)
    return dict(found) if isinstance(found, dict) else {}


def _where(settings: dict[str, Any], kind: str, variable: Variable, replicas: int, written: bool
           ) -> StoredTensor | None:
    numel = 1
    for size in variable.shape:
        numel *= int(size)
    offchip = settings.get("onChip") == 0 and numel >= int(settings.get("minElementsForOffChip",
                                                                          MIN_ELEMENTS_FOR_OFF_CHIP))
    sharded = (bool(settings.get("useReplicatedTensorSharding")) and replicas > 1
               and numel >= int(settings.get("minElementsForReplicatedTensorSharding", MIN_ELEMENTS_FOR_RTS)))
    if not (offchip or sharded):
        return None
    return StoredTensor(kind, offchip, replicas if sharded else 1, written)


def apply_tensor_locations(program: Program, options: Options) -> dict[str, StoredTensor]:
    """Record where ``program``'s weights and optimiser state are stored (the module
    docstring); returns {variable name: location} of those not simply on-chip."""
    replicas = program.ir.replication_factor
    groups: list[tuple[str, str, list[tuple[Variable, bool]]]] = [
        ("weight", "location_weight",
         [(v, program.training and name in program.trained) for name, v in program.params.items()]),
        ("optimizer", "location_optimizer", [(v, program.training) for v in program.states.values()]),
    ]
    recorded = tensor_locations(program.ir)
    found: dict[str, StoredTensor] = {}
    for kind, key, variables in groups:
        settings = _settings(options, key)
        if not settings:
            continue
        for variable, written in variables:
            where = _where(settings, kind, variable, replicas, written)
            if where is not None:
                recorded[variable.node] = where
                found[variable.name] = where
    return found
