"""The package's structure: each backend implements the one interface the ops call, and no
module of jax_ep imports itself through others (an import cycle)."""

from __future__ import annotations

import ast
import inspect
import pathlib

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


def test_no_import_cycle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) for p in paths}
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
