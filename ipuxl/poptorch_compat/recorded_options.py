"""The setters of PopTorch's ``Options`` that a simulated device only records.

``RecordedOptions`` is the base of ``options.Options``: each setter here takes upstream's
arguments and checks, stores its value under upstream's key (shown by ``toDict()``) or in
``_Popart``'s PopART options, and returns the options so that calls chain. None changes
what a model computes or how it runs on ipuxl's simulated device; ``docs/poptorch.md``
gives the reason for each:

* hardware, synchronisation and PopART settings: ``syncPattern``, ``useIpuId``,
  ``autoRoundNumIPUs``, ``broadcastBuffers``, ``enableExecutableCaching``,
  ``enableSyntheticData``, ``enableStableNorm``, ``logCycleCount``, ``enableProfiling``;
* Poplar planning hints: ``setAvailableMemoryProportion``, ``updatableNamedBuffers``;
* names in logs and reports: ``logDir``, ``modelName``, ``disableModuleNamescope``,
  ``sourceLocationExcludes``, ``appendToLocationExcludes``.

``maxRepeatLogs`` is the exception: it limits how often PopTorch's loggers print a
repeated message (in this process, from the call on).
"""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Self

from ipuxl.errors import OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.enums import SyncPattern
from ipuxl.poptorch_compat.poptorch_logging import set_max_repeats
from ipuxl.poptorch_compat.option_groups import OptionGroup, check_enum, check_flag, check_int, check_str, type_name

if TYPE_CHECKING:
    from ipuxl.poptorch_compat.option_groups import PopartOptions

__all__ = ["RecordedOptions"]


class RecordedOptions(OptionGroup):
    """``Options``' setters without effect on a simulated device (see the module docstring)."""

    _popart: PopartOptions  # set by ``Options.__init__``

    def setAvailableMemoryProportion(self, available_memory_proportion: dict[str, float]) -> Self:  # noqa: N802
        """Temporary memory per IPU for matmuls and convolutions, ``{"IPU0": 0.6}`` (each in
        [0, 1]); recorded as ``{ipu: proportion}``. No effect on the values computed."""
        method = "Options.setAvailableMemoryProportion"
        self._check_not_frozen("setAvailableMemoryProportion")
        if not isinstance(available_memory_proportion, dict):
            raise OptionsError(f"{method}: expected a dict such as {{'IPU0': 0.5}}, got "
                               f"{type_name(available_memory_proportion)}", where=user_source_line(),
                               fix='pass {"IPU<n>": proportion} for each IPU')
        per_ipu: dict[int, float] = {}
        for key, proportion in available_memory_proportion.items():
            if not (isinstance(key, str) and key.startswith("IPU") and key[3:].isdigit()):
                raise OptionsError(f"{method}: keys must be 'IPU<n>' such as 'IPU0', got {key!r}",
                                   where=user_source_line(), fix='pass e.g. {"IPU0": 0.5}')
            if isinstance(proportion, bool) or not isinstance(proportion, numbers.Real) \
                    or not 0.0 <= proportion <= 1.0:
                raise OptionsError(f"{method}: the proportion for {key} must be a number in [0, 1], "
                                   f"got {proportion!r}", where=user_source_line(), fix=f'pass e.g. {{"{key}": 0.6}}')
            per_ipu[int(key[3:])] = float(proportion)
        self._set("setAvailableMemoryProportion", available_memory_proportion=per_ipu)
        return self

    def updatableNamedBuffers(self, buffers: list[str]) -> Self:  # noqa: N802
        """Names of the buffers the host may update between runs. ipuxl sends every
        host write of a buffer to the device anyway; recorded."""
        self._check_not_frozen("updatableNamedBuffers")
        if not isinstance(buffers, (list, tuple)) or not all(isinstance(b, str) for b in buffers):
            raise OptionsError(f"Options.updatableNamedBuffers: buffers must be a list of buffer names, got "
                               f"{buffers!r}", where=user_source_line(),
                               fix='pass names from model.named_buffers(), e.g. ["bn.running_mean"]')
        self._set("updatableNamedBuffers", updatable_named_buffers=list(buffers))
        return self

    def _record_flag(self, method: str, key: str, value: object, arg: str) -> Self:
        self._check_not_frozen(method)
        self._set(method, **{key: check_flag(value, method=f"Options.{method}", arg=arg)})
        return self

    def syncPattern(self, sync_pattern: SyncPattern) -> Self:  # noqa: N802
        """How IPUs synchronise with the host (recorded; no effect on a simulated device)."""
        self._check_not_frozen("syncPattern")
        self._set("syncPattern", sync_pattern=check_enum(sync_pattern, SyncPattern, method="Options.syncPattern",
                                                         arg="sync_pattern"))
        return self

    def useIpuId(self, ipu_id: int) -> Self:  # noqa: N802
        """Which physical IPU device to use (recorded; no effect on a simulated device)."""
        self._check_not_frozen("useIpuId")
        self._set("useIpuId", ipu_id=check_int(ipu_id, method="Options.useIpuId", arg="ipu_id", example="0"))
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Self:  # noqa: N802
        """Round the IPUs reserved up to a power of 2 (no effect: nothing is reserved)."""
        return self._record_flag("autoRoundNumIPUs", "auto_round_num_ipus", auto_round_num_ipus,
                                 "auto_round_num_ipus")

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Self:  # noqa: N802
        """Broadcast buffers to every replica (recorded; no effect on a simulated device)."""
        return self._record_flag("broadcastBuffers", "broadcast_buffers", broadcast_buffers, "broadcast_buffers")

    def logDir(self, log_dir: str) -> Self:  # noqa: N802
        """Where PopTorch writes its logs (recorded; ipuxl writes none)."""
        self._check_not_frozen("logDir")
        self._set("logDir", log_dir=check_str(log_dir, method="Options.logDir", arg="log_dir", example='"logs"'))
        return self

    def modelName(self, name: str) -> Self:  # noqa: N802
        """The model's name in profiling reports (recorded; no effect on a simulated device)."""
        self._check_not_frozen("modelName")
        self._set("modelName", model_name=check_str(name, method="Options.modelName", arg="name", example='"bert"'))
        return self

    def enableExecutableCaching(self, path: str | None) -> Self:  # noqa: N802
        """Cache compiled executables in ``path`` (None disables); recorded in ``_Popart``
        (``cachePath``, ``enableEngineCaching``), no effect: ipuxl compiles in process."""
        self._check_not_frozen("enableExecutableCaching")
        if path is None:
            self._popart.set("enableEngineCaching", False)
            return self
        self._popart.set("cachePath", check_str(path, method="Options.enableExecutableCaching", arg="path",
                                                example='"./cache"'))
        self._popart.set("enableEngineCaching", True)
        return self

    def enableSyntheticData(self, enabled: bool) -> Self:  # noqa: N802
        """Generate inputs on the device instead of reading the host's (recorded in
        ``_Popart`` as ``syntheticDataMode``; no effect: the host's data is used)."""
        self._check_not_frozen("enableSyntheticData")
        enabled = check_flag(enabled, method="Options.enableSyntheticData", arg="enabled")
        self._popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def enableStableNorm(self, enabled: bool) -> Self:  # noqa: N802
        """The slower, more accurate norm kernels (recorded in ``_Popart``; ipuxl's norms
        are torch's, already the stable formulation)."""
        self._check_not_frozen("enableStableNorm")
        enabled = check_flag(enabled, method="Options.enableStableNorm", arg="enabled")
        self._popart.set("enableStableNorm", enabled)
        return self

    def logCycleCount(self, log_cycle_count: bool) -> Self:  # noqa: N802
        """Log IPU cycles per run (hardware only; recorded in ``_Popart``)."""
        self._check_not_frozen("logCycleCount")
        value = check_flag(log_cycle_count, method="Options.logCycleCount", arg="log_cycle_count")
        self._popart.set("instrumentWithHardwareCycleCounter", value)
        return self

    def enableProfiling(self, profile_dir: str | None = None) -> Self:  # noqa: N802
        """Write Poplar profiling reports to ``profile_dir`` (recorded as engine options; use
        ``report()`` on a compiled model for ipuxl's program report)."""
        self._check_not_frozen("enableProfiling")
        directory = "." if profile_dir is None else check_str(profile_dir, method="Options.enableProfiling",
                                                              arg="profile_dir", example='"./profile"')
        engine = dict(self._popart.options.get("engineOptions", {}))
        engine.update({"debug.allowOutOfMemory": "true", "autoReport.directory": directory, "autoReport.all": "true"})
        self._popart.setEngineOptions(engine)
        return self

    def disableModuleNamescope(self) -> Self:  # noqa: N802
        """Do not prefix op names with module names (recorded; no effect on results)."""
        self._check_not_frozen("disableModuleNamescope")
        self._set("disableModuleNamescope", module_namescope_enabled=False)
        return self

    def sourceLocationExcludes(self, excludes: list[str]) -> Self:  # noqa: N802
        """Replace the source-path fragments skipped when naming an op's user line (recorded;
        ipuxl's errors always skip torch's and ipuxl's own frames)."""
        self._check_not_frozen("sourceLocationExcludes")
        if not isinstance(excludes, (list, tuple)) or not all(isinstance(e, str) for e in excludes):
            raise OptionsError(f"Options.sourceLocationExcludes: excludes must be a list of strings, got {excludes!r}",
                               where=user_source_line(), fix='pass e.g. ["site-packages/transformers"]')
        self._set("sourceLocationExcludes", source_location_excludes=list(excludes))
        return self

    def maxRepeatLogs(self, number: int | None) -> Self:  # noqa: N802
        """Print an often-repeated log message at most ``number`` times (None: no limit).
        Applies to PopTorch's loggers (``poptorch::python``, ``poptorch:cpp``) in this
        process, from the call on."""
        self._check_not_frozen("maxRepeatLogs")
        if number is not None:
            number = check_int(number, method="Options.maxRepeatLogs", arg="number", example="4")
            if number < 0:
                raise OptionsError(f"Options.maxRepeatLogs: number must be >= 0 or None, got {number}",
                                   where=user_source_line(), fix="pass a count such as 4, or None for no limit")
        set_max_repeats(number)
        return self

    def appendToLocationExcludes(self, *excludes: str) -> Self:  # noqa: N802
        """Add source-path fragments to :meth:`sourceLocationExcludes`'s list."""
        return self.sourceLocationExcludes([*self._values["source_location_excludes"], *excludes])
