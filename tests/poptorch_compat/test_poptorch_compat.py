"""``import poptorch`` through ``ipuxl.compat`` gives PopTorch's namespace
(``ipuxl.poptorch_compat``), not PopXL's, with upstream's submodules."""
from __future__ import annotations

import importlib
import sys

import pytest

import ipuxl
import ipuxl.compat as compat
from ipuxl.compat import table
from ipuxl.errors import CompatImportError


@pytest.fixture
def installed():
    compat.install()
    yield
    compat.uninstall()


def test_poptorch_is_poptorch_compat_not_popxl(installed):
    import popxl
    import poptorch

    assert poptorch is importlib.import_module("ipuxl.poptorch_compat") and popxl is ipuxl
    assert not hasattr(poptorch, "Ir") and not hasattr(poptorch, "h2d_stream")  # PopXL's names stay in popxl
    assert poptorch.trainingModel is ipuxl.trainingModel and poptorch.Options is ipuxl.Options


def test_upstream_submodules_resolve_to_the_modules_defining_their_names(installed):
    import poptorch
    import poptorch.enums
    import poptorch.logging
    import poptorch.optim
    import poptorch.options
    from poptorch._logging import logger
    from poptorch.enums import ReductionType
    from poptorch.options import _TrainingOptions

    assert poptorch.enums is importlib.import_module("ipuxl.poptorch_compat.enums")
    assert poptorch.options is importlib.import_module("ipuxl.poptorch_compat.options")
    assert poptorch.optim is importlib.import_module("ipuxl.poptorch_compat.optim")
    assert poptorch.logging is importlib.import_module("ipuxl.poptorch_compat.poptorch_logging")
    assert sys.modules["poptorch.logging"] is poptorch.logging and logger is poptorch.logger
    assert ReductionType is poptorch.ReductionType and poptorch.enums.OutputMode is poptorch.OutputMode
    assert type(poptorch.Options().Training) is _TrainingOptions
    assert poptorch.optim.SGD.__module__ == "ipuxl.poptorch_compat.optim"


def test_star_import_gives_upstreams_top_level_names(installed):
    namespace: dict = {}
    exec("from poptorch import *", namespace)
    for name in ("trainingModel", "inferenceModel", "Options", "DataLoader", "OutputMode", "ReductionType",
                 "CommGroupType", "Error", "RecoverableError", "setLogLevel", "ipuHardwareIsAvailable",
                 "TensorLocationSettings"):
        assert name in namespace, name
    assert namespace["Error"] is importlib.import_module("ipuxl.errors").PoptorchError


@pytest.mark.parametrize("upstream", sorted(n for n, target in table.POPTORCH.items() if target is None))
def test_modules_ipuxl_lacks_raise_an_import_error_naming_them(installed, upstream):
    with pytest.raises(CompatImportError, match=f"'{upstream}' is part of PopTorch") as info:
        importlib.import_module(upstream)
    assert info.value.name == upstream and isinstance(info.value, ModuleNotFoundError)
    assert "test_poptorch_compat.py" in str(info.value)


def test_unknown_names_are_import_and_attribute_errors(installed):
    import poptorch

    with pytest.raises(ImportError, match="No module named 'poptorch.no_such_module'"):
        importlib.import_module("poptorch.no_such_module")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        poptorch.no_such_name  # noqa: B018


def test_a_poptorch_program_through_the_alias(installed, tmp_path):
    import torch

    import poptorch

    model = torch.nn.Linear(3, 2)
    opts = poptorch.Options().deviceIterations(2)
    opts.Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat)
    inference = poptorch.inferenceModel(model, opts)
    x = torch.randn(4, 3)
    torch.testing.assert_close(inference(x), model(x))
    assert opts.frozen
    with pytest.raises(AttributeError, match="frozen"):
        opts.deviceIterations(4)


def test_uninstall_removes_every_poptorch_alias():
    compat.install()
    import poptorch.logging  # noqa: F401

    compat.uninstall()
    assert [m for m in sys.modules if m.partition(".")[0] == "poptorch"] == []
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("poptorch")


def _documented_names(status_filter) -> list[str]:
    """Top-level names in docs/poptorch.md's first table whose status passes ``status_filter``."""
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "poptorch.md")
    text = open(path, encoding="utf-8").read()
    section = text.split("## Top-level names", 1)[1].split("\n## ", 1)[0]
    names = []
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("name", "---") or not status_filter(cells[1]) \
                or cells[0].startswith(("capture:", "random ops", "module ")):  # behaviours, submodules
            continue
        for code in re.findall(r"`([^`]+)`", cells[0]):
            name = re.match(r"[A-Za-z_]\w*", code)
            if name and " " not in code.split("(")[0]:
                names.append(name.group(0))
    return names


def test_every_name_documented_as_working_exists_in_the_namespace():
    """docs/poptorch.md stays true: a top-level name marked supported/simulated/accepted exists."""
    import ipuxl.poptorch_compat as poptorch

    names = _documented_names(lambda status: not status.startswith(("not", "refused", "removed")))
    assert len(names) > 40
    import torch

    # top level, optimisers, executor methods (``parameters()``... are the user's module's)
    homes = (poptorch, poptorch.optim, poptorch.PoplarExecutor, torch.nn.Module)
    missing = [n for n in names if not any(n in dir(home) for home in homes)]
    assert missing == []
