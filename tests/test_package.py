"""The package's structure: each backend implements the one interface the ops call, no module
of jax_ep imports itself through others (an import cycle), the library never imports its tools,
and the tools' old names still lead to them."""

from __future__ import annotations

import ast
import inspect
import json
import pathlib
import subprocess
import sys

import pytest

from jax_ep import backends
from jax_ep.backends import cuda, interface, xla

PACKAGE = pathlib.Path(backends.__file__).parent.parent  # jax_ep/


def interface_functions() -> dict[str, inspect.Signature]:
    """The functions of `Backend`, with their signatures less `self`."""
    out = {}
    for name, member in vars(interface.Backend).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            signature = inspect.signature(member)
            out[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return out


@pytest.mark.parametrize("module", [xla, cuda], ids=lambda m: m.NAME)
def test_each_backend_implements_the_interface(module):
    """Every function of the interface: its positional parameters in order, its keyword
    parameters by name; a backend may add keyword parameters of its own only with defaults."""
    assert isinstance(module.NAME, str)
    functions = interface_functions()
    assert len(functions) == 9, sorted(functions)
    for name, wanted in functions.items():
        got = inspect.signature(getattr(module, name))

        def split(signature):
            params = list(signature.parameters.values())
            return ([(p.name, p.kind) for p in params if p.kind != p.KEYWORD_ONLY],
                    {p.name: p for p in params if p.kind == p.KEYWORD_ONLY})

        (positional, keywords), (want_positional, want_keywords) = split(got), split(wanted)
        where = f"{module.NAME}.{name}{got} against {name}{wanted}"
        assert positional == want_positional, where
        assert set(want_keywords) <= set(keywords), where
        extra = [p for n, p in keywords.items() if n not in want_keywords and p.default is p.empty]
        assert not extra, f"{where}: {extra} beyond the interface's, without defaults"


def test_get_returns_the_named_backend():
    assert backends.get("xla") is xla and backends.get("cuda") is cuda


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The jax_ep modules `path` imports, wherever in it (functions too): `from a import b`
    counts a.b when that is a module, else a; a package's own __init__ is not counted for
    importing one of its modules (Python runs it first, but it is not what the module uses)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m not in (name, "jax_ep")}


def import_graph() -> dict[str, set[str]]:
    """Each module of jax_ep -> the jax_ep modules it imports."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def test_no_import_cycle():
    graph = import_graph()
    done, path = set(), []

    def visit(module):
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        path.append(module)
        for dependency in sorted(graph[module]):
            visit(dependency)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_library_never_imports_a_tool():
    """Tools build on the library, never the other way: no module outside jax_ep.tools imports
    one inside (the package's __init__, which only names them, is allowed)."""
    graph = import_graph()
    for module, dependencies in graph.items():
        if not module.startswith("jax_ep.tools"):
            tools = sorted(d for d in dependencies if d.startswith("jax_ep.tools."))
            assert not tools, f"{module} imports {tools}"


def test_tools_names_each_of_its_modules():
    from jax_ep import tools

    folder = PACKAGE / "tools"
    found = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    found |= {p.parent.name for p in folder.glob("*/__init__.py")}
    assert set(tools.MODULES) == found


OLD_NAMES = r"""
import importlib, json, sys, warnings
import jax_ep
from jax_ep import _moved
loaded = sorted(m for m in sys.modules if m.startswith("jax_ep.tools."))
out = {"loaded_by_import": loaded, "names": {}}
for name in _moved.MOVED:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # both ways in: an attribute of the package, and an import of the old name
        old = getattr(jax_ep, name) if name == "reference" else importlib.import_module(
            "jax_ep." + name)
    new = importlib.import_module("jax_ep.tools." + name)
    out["names"][name] = {
        "same": old is new, "spec": new.__spec__.name,
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught]}
from jax_ep.bench import suite
import jax_ep.tools.bench.suite as new_suite
out["submodule_same"] = suite is new_suite
print(json.dumps(out))
"""


def test_old_names_are_the_moved_modules_with_a_warning(tmp_path):
    """`jax_ep.account` and the other tools' old homes import the very module at the new name,
    with a DeprecationWarning naming it that points at the importing line; `import jax_ep`
    loads no tool."""
    script = tmp_path / "old_names.py"
    script.write_text(OLD_NAMES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["loaded_by_import"] == [] and out["submodule_same"]
    assert "account" in out["names"] and "copy_rate" not in out["names"]  # new since
    for name, seen in out["names"].items():
        assert seen["same"] and seen["spec"] == f"jax_ep.tools.{name}", (name, seen)
        assert [(c, f) for c, _, f in seen["warnings"]] == [("DeprecationWarning", str(script))]
        assert f"jax_ep.{name} moved to jax_ep.tools.{name}" in seen["warnings"][0][1]


@pytest.mark.parametrize("old", ["account", "bench"])
def test_old_command_lines_run_the_moved_ones(old, tmp_path):
    done = subprocess.run([sys.executable, "-m", f"jax_ep.{old}", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m jax_ep.tools.{old}")
    assert (f"FutureWarning: python -m jax_ep.{old} is now python -m jax_ep.tools.{old}"
            in done.stderr)
