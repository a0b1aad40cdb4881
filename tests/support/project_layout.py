"""The project's packages and where their sources live, read from pyproject.toml (packages and
package-dir), and the import graph of those sources built with ast (every import, also those inside
functions and under TYPE_CHECKING: each states a dependency)."""

from __future__ import annotations

import ast
import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))  # tests/support: the helpers
TESTS = os.path.dirname(SUPPORT)
REPO = os.path.dirname(TESTS)


def pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            import pytest

            pytest.skip("reading pyproject.toml needs Python 3.11's tomllib or the tomli package")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def package_dirs() -> dict[str, str]:
    """Each package -> its source directory (vllm_tap.tools.bench -> REPO/tools/bench)."""
    setup = pyproject()["tool"]["setuptools"]
    mapped = setup.get("package-dir", {})
    out = {}
    for pkg in setup["packages"]:
        parts = pkg.split(".")
        for i in range(len(parts), 0, -1):  # the nearest mapped ancestor gives the directory
            head = ".".join(parts[:i])
            if head in mapped:
                out[pkg] = os.path.join(REPO, mapped[head], *parts[i:])
                break
        else:
            out[pkg] = os.path.join(REPO, *parts)
    return out


def modules() -> dict[str, str]:
    """Every module of the project -> its file."""
    out = {}
    for pkg, d in package_dirs().items():
        for name in sorted(os.listdir(d)):
            if name.endswith(".py"):
                out[pkg if name == "__init__.py" else f"{pkg}.{name[:-3]}"] = os.path.join(d, name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (`from pkg import mod` counts as importing pkg.mod)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    edges.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[mod] = {e for e in edges if e in mods and e != mod}
    return graph
