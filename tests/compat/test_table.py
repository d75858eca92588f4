"""ipuxl.compat: Graphcore's import paths resolve to ipuxl's modules, module by module.

Upstream's layout (graphcore/popart python/popxl, graphcore/popxl-addons,
graphcore/poptorch) is the contract: every path listed in ``ipuxl.compat.table``
either imports the ipuxl module standing for it or fails with an ImportError naming it.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.compat as compat
from ipuxl.compat import table
from ipuxl.errors import CompatImportError


@pytest.fixture
def installed():
    compat.install()
    yield
    compat.uninstall()


def test_the_aliases_are_ipuxls_module_objects(installed):
    import popxl
    import popxl.ops as ops
    import popxl.transforms
    import popxl_addons as addons
    import poptorch

    assert popxl is ipuxl and ops is ipuxl.ops and popxl.transforms is importlib.import_module("ipuxl.transforms")
    assert addons is importlib.import_module("ipuxl.addons_compat")
    assert poptorch is importlib.import_module("ipuxl.poptorch_compat")  # PopTorch's namespace, not PopXL's
    # ipuxl's own identity is kept: the import system does not rename the module it aliases
    assert ipuxl.__spec__.name == "ipuxl" and ipuxl.ops.__spec__.name == "ipuxl.ops"
    assert poptorch.trainingModel is ipuxl.trainingModel


def test_the_reference_programs_imports_resolve(installed):
    from popxl_addons.graph import GraphWithNamedArgs
    from popxl_addons.named_tensors import NamedTensors
    from popxl_addons.variable_factory import NamedVariableFactories
    import popxl_addons as addons

    assert (GraphWithNamedArgs, NamedTensors, NamedVariableFactories) == (
        addons.GraphWithNamedArgs, addons.NamedTensors, addons.NamedVariableFactories)


@pytest.mark.parametrize("upstream", sorted(n for t in (table.POPXL, table.POPXL_ADDONS, table.POPTORCH)
                                            for n, target in t.items() if target))
def test_every_listed_path_imports_its_ipuxl_module(installed, upstream):
    target = table.POPXL.get(upstream) or table.POPXL_ADDONS.get(upstream) or table.POPTORCH[upstream]
    if importlib.util.find_spec(target) is None:
        pytest.skip(f"{target} is not written yet")
    assert importlib.import_module(upstream) is importlib.import_module(target)


def test_op_files_resolve_to_the_module_defining_the_op_and_keep_the_op(installed):
    from popxl.ops.gelu import gelu
    from popxl.ops.host_load import host_load
    from popxl.ops.collectives.replicated_all_reduce import replicated_all_reduce_
    from popxl.transforms.autodiff import autodiff

    assert gelu is ipuxl.ops.gelu and host_load is ipuxl.ops.host_load
    assert replicated_all_reduce_ is ipuxl.ops.collectives.replicated_all_reduce_
    assert autodiff is ipuxl.transforms.autodiff
    # loading the alias ``popxl.ops.gelu`` must not replace the op ``ops.gelu`` by a module
    import popxl.ops.gelu  # noqa: F401
    assert callable(ipuxl.ops.gelu) and not isinstance(ipuxl.ops.gelu, type(np))


def _ipuxl_namespaces() -> dict[str, dict[str, int]]:
    return {name: {k: id(v) for k, v in vars(module).items()}
            for name, module in list(sys.modules.items()) if name == "ipuxl" or name.startswith("ipuxl.")}


def _submodule_aliases() -> list[str]:
    """Every upstream path under ``popxl.ops``, ``popxl``, ``popxl_addons`` (and their packages) ipuxl maps."""
    import pkgutil

    names = [f"popxl.ops.{f}" for f in table.OP_FILES] + [n for t in table.TABLES for n in t if t[n]]
    for alias, package in (("popxl", "ipuxl"), ("popxl_addons", "ipuxl.addons_compat")):
        root = importlib.import_module(package)
        names += [alias + info.name[len(package):] for info in pkgutil.walk_packages(root.__path__, package + ".")
                  if ".compat" not in info.name and "poptorch_compat" not in info.name]
    return sorted(set(names))


def test_importing_any_upstream_submodule_never_rebinds_a_name_of_an_ipuxl_module(installed):
    # ``popxl.ops.call`` (a module upstream) has the same name as the op ``ipuxl.ops.call``:
    # the import system would set the loaded module on the parent, which *is* ipuxl.ops
    import popxl.ops as ops

    before = _ipuxl_namespaces()
    imported = []
    for alias in _submodule_aliases():
        try:
            importlib.import_module(alias)
        except ImportError:
            continue  # upstream's modules ipuxl lacks are tested below
        imported.append(alias)
    after = _ipuxl_namespaces()
    changed = sorted(f"{m}.{k}" for m, names in before.items() for k, v in names.items() if after[m].get(k) != v)
    assert changed == [] and {"popxl.ops.call", "popxl.ops.conv", "popxl_addons.transforms.autodiff"} <= set(imported)
    for op in ("call", "conditional", "conv", "ipu_copy"):
        assert callable(getattr(ops, op)) and not isinstance(getattr(ops, op), type(np)), op


def test_the_popxl_mnist_programs_callsiteinfo_import_keeps_ops_call(installed):
    import popxl
    import popxl.ops as ops
    from popxl.ops.call import CallSiteInfo  # PopXL's MNIST user-guide program does this

    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.arange(3, dtype=np.float32), name="x")
        graph = ir.create_graph(lambda t: t * 2, x.spec)
        y, = ops.call(graph, x)
        info = ops.call_with_info(graph, x)
        y_stream = popxl.d2h_stream(y.shape, popxl.float32, "y")
        ops.host_store(y_stream, y)
    assert isinstance(info, CallSiteInfo)
    with popxl.Session(ir, "ipu_model") as session:
        assert_close(torch.from_numpy(session.run()[y_stream]), torch.arange(3.0) * 2)


def test_a_renamed_module_reads_as_an_attribute_and_is_removed_by_uninstall():
    compat.install()
    import popxl.context as context
    import popxl_addons.layers.linear as linear

    assert context is importlib.import_module("ipuxl.ir.context")
    assert linear.Linear is importlib.import_module("ipuxl.addons_compat").Linear
    compat.uninstall()
    assert not hasattr(ipuxl, "context")
    assert [m for m in sys.modules if m.partition(".")[0] in table.ROOTS] == []
    assert not compat.is_installed()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("popxl")


@pytest.mark.parametrize("upstream, fragment", [
    ("popxl_addons.ops.static_sparse_ops", "'popxl_addons.ops.static_sparse_ops' is part of popxl.addons but ipuxl "
                                           "does not provide it"),  # popxl_addons.ops exists
    ("popxl_addons.input_factory", "'popxl_addons.input_factory' is part of popxl.addons"),  # rts exists
    ("poptorch.profiling", "'poptorch.profiling' is part of PopTorch"),
    ("popxl.not_a_module", "No module named 'popxl.not_a_module'"),
    ("poptorch.not_a_module", "No module named 'poptorch.not_a_module'"),
])
def test_a_module_ipuxl_lacks_is_an_import_error_naming_it(installed, upstream, fragment):
    with pytest.raises(ImportError, match=fragment) as info:
        importlib.import_module(upstream)
    assert isinstance(info.value, (CompatImportError, ModuleNotFoundError)) and info.value.name == upstream
    assert "test_table.py" in str(info.value)  # where: the importing line


def test_an_op_file_whose_op_ipuxl_lacks_is_an_import_error_naming_the_op(installed):
    missing = [(f, op) for f, op in table.OP_FILES.items() if not hasattr(ipuxl.ops, op)]
    if not missing:
        pytest.skip("ipuxl.ops has every op of PopXL's op files")
    file, op = missing[0]
    with pytest.raises(CompatImportError, match=f"'popxl.ops.{file}' is part of PopXL .* has no '{op}'"):
        importlib.import_module(f"popxl.ops.{file}")


def test_a_missing_name_is_pythons_import_error_naming_it(installed):
    with pytest.raises(ImportError, match="cannot import name 'no_such_op' from 'ipuxl.ops'"):
        from popxl.ops import no_such_op  # noqa: F401


def test_install_is_idempotent_and_refuses_a_package_imported_before(monkeypatch):
    compat.install()
    compat.install()
    assert sys.meta_path.count(sys.meta_path[0]) == 1 and compat.is_installed()
    compat.uninstall()
    monkeypatch.setitem(sys.modules, "popxl", type(sys)("popxl"))
    with pytest.raises(ImportError, match=r"\['popxl'\] already imported"):
        compat.install()
    assert not compat.is_installed()


def test_a_popxl_program_through_the_aliases_matches_eager_torch(installed):
    import popxl
    import popxl.ops as ops

    x_np = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    w_np = np.random.default_rng(1).standard_normal((3, 2)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        x_stream = popxl.h2d_stream((4, 3), popxl.float32, "x")
        w = popxl.variable(w_np, name="w")
        y = ops.gelu(ops.host_load(x_stream) @ w)
        y_stream = popxl.d2h_stream(y.shape, popxl.float32, "y")
        ops.host_store(y_stream, y)
    ir.num_host_transfers = 1
    with popxl.Session(ir, "ipu_model") as session:
        y_out = session.run({x_stream: x_np})[y_stream]
    expected = torch.nn.functional.gelu(torch.from_numpy(x_np) @ torch.from_numpy(w_np), approximate="tanh")
    assert_close(torch.from_numpy(y_out), expected, rtol=1e-5, atol=1e-6)  # PopXL's gelu: the tanh form


def _run_compat(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    program = tmp_path / "program.py"
    program.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "ipuxl.compat", str(program), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_main_runs_a_program_as_main_with_its_argv(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    proc = _run_compat(tmp_path, """
        import sys
        import helper  # the program's folder is on sys.path, as with `python program.py`
        import popxl, popxl_addons, poptorch
        print(__name__, sys.argv[1:], helper.VALUE, popxl.__name__, popxl_addons.__name__)
    """, "--epochs", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["__main__", "['--epochs',", "'2']", "7", "ipuxl", "ipuxl.addons_compat"]


def test_main_reports_a_missing_module_and_usage(tmp_path):
    proc = _run_compat(tmp_path, "import popxl_addons.ops.linear_layout\n")
    assert proc.returncode == 1
    assert "CompatImportError: 'popxl_addons.ops.linear_layout' is part of popxl.addons" in proc.stderr
    assert "program.py:1" in proc.stderr
    usage = subprocess.run([sys.executable, "-m", "ipuxl.compat"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: python -m ipuxl.compat PROGRAM.py" in usage.stderr
    missing = subprocess.run([sys.executable, "-m", "ipuxl.compat", str(tmp_path / "absent.py")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "absent.py" in missing.stderr


def test_main_runs_a_module_with_dash_m(tmp_path):
    (tmp_path / "prog_module.py").write_text("import sys, popxl\nprint(__name__, sys.argv[1:], popxl.Ir.__name__)\n")
    proc = subprocess.run([sys.executable, "-m", "ipuxl.compat", "-m", "prog_module", "a"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["__main__", "['a']", "Ir"]
