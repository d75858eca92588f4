"""``POPTORCH_DEFAULT_OPTIONS``: defaults for every new ``poptorch.Options``, from the environment.

As upstream (``tests/options_test.py::TestSetOptionsFromEnvironment``), the variable holds
a JSON object applied at the end of ``Options.__init__``, one setter call per key:

* the key names a setter of ``Options``, dotted for a sub-object's
  (``"deviceIterations"``, ``"Precision.enableFloatingPointExceptions"``,
  ``"_Popart.set"``);
* the value is the setter's argument, or a JSON list of its arguments
  (``{"_Popart.set": ["saveInitializersToFile", "my_file.onnx"]}``);
* a string ``"<Enum>.<Member>"`` naming one of PopTorch's enums is that member
  (``{"connectionType": "ConnectionType.OnDemand"}``).

So ``POPTORCH_DEFAULT_OPTIONS='{"deviceIterations": 2}'`` makes ``Options()`` equal to
``Options().deviceIterations(2)``. A value the setter refuses raises its usual error.
"""
from __future__ import annotations

import enum
import json
import os
import threading
from typing import TYPE_CHECKING, Any

from ipuxl.errors import OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat import enums
from ipuxl.poptorch_compat.poptorch_logging import logger

if TYPE_CHECKING:
    from ipuxl.poptorch_compat.options import Options

__all__ = ["ENV_VAR", "apply_env_defaults", "pristine_options"]

#: the environment variable upstream reads
ENV_VAR = "POPTORCH_DEFAULT_OPTIONS"

_ignored = threading.local()  # ``on``: ``pristine_options`` is building Options without the variable


def pristine_options() -> Options:
    """A new ``Options()`` with upstream's defaults, whatever ``POPTORCH_DEFAULT_OPTIONS`` says
    (what ``Options.__repr__`` compares with)."""
    from ipuxl.poptorch_compat.options import Options  # (options imports this module)

    _ignored.on = True
    try:
        return Options()
    finally:
        _ignored.on = False


def apply_env_defaults(options: Options) -> None:
    """Call the setters ``POPTORCH_DEFAULT_OPTIONS`` lists on ``options`` (nothing when unset or empty)."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw or getattr(_ignored, "on", False):
        return
    try:
        settings = json.loads(raw)
    except json.JSONDecodeError as error:
        raise OptionsError(f"{ENV_VAR} is not valid JSON ({error.msg} at character {error.pos}): {raw!r}",
                           where=user_source_line(),
                           fix=f"""set {ENV_VAR} to a JSON object such as '{{"deviceIterations": 2}}'""") from None
    if not isinstance(settings, dict):
        raise OptionsError(f"{ENV_VAR} must hold a JSON object of setter -> argument(s), got {raw!r}",
                           where=user_source_line(),
                           fix=f"""set {ENV_VAR} to a JSON object such as '{{"deviceIterations": 2}}'""")
    logger.debug("%s is set: applying %s", ENV_VAR, raw)
    for key, value in settings.items():
        setter = _setter(options, key)
        arguments = value if isinstance(value, list) else [value]
        setter(*[_converted(argument) for argument in arguments])


def _setter(options: Options, key: str) -> Any:
    target: Any = options
    for part in key.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            target = None
        if target is None:
            break
    if not callable(target):
        raise OptionsError(f"{ENV_VAR}: {key!r} is not a setter of poptorch.Options",
                           where=user_source_line(),
                           fix="use a setter's name, dotted for a sub-object's: \"deviceIterations\", "
                               "\"Training.gradientAccumulation\", \"_Popart.set\"")
    return target


def _enum_types() -> dict[str, type[enum.Enum]]:
    from ipuxl.poptorch_compat.options import OutputMode  # (options imports this module)

    found = {name: value for name, value in vars(enums).items()
             if isinstance(value, type) and issubclass(value, enum.Enum) and value.__module__ == enums.__name__}
    found["OutputMode"] = found["AnchorMode"] = OutputMode
    return found


def _converted(value: Any) -> Any:
    """``"ConnectionType.OnDemand"`` -> that enum member; any other value unchanged."""
    if not isinstance(value, str) or value.count(".") != 1:
        return value
    type_name, member = value.split(".")
    kind = _enum_types().get(type_name)
    if kind is None or member not in kind.__members__:
        return value
    return kind[member]
