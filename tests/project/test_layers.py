"""Layers point one way (docs/development.md, "Layers"): the formats and the core at the bottom; the
hooks, the daemon and the client each on the core alone; tools on those; the command line on top.
Checked on the import graph built from the sources (tests/support/project_layout.py), every import counted,
also those inside functions; and the graph has no cycle. The suite's own split too: every test
module that can start vLLM is marked `vllm`, so `./run test-fast` (-m "not vllm") starts none."""

from __future__ import annotations

import ast
import os

import pytest

from project_layout import REPO, import_graph

PARTS = ("hooks", "daemon", "client", "tools", "cli")  # vllm_tap.<part>; every other module is the core
MAY_IMPORT = {
    "core": set(),
    "hooks": {"core"},
    "daemon": {"core"},
    "client": {"core"},
    "tools": {"core", "hooks", "daemon", "client"},
    "cli": {"core", "hooks", "daemon", "client", "tools"},
}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PARTS else "core"


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in graph.items() for t in targets
                  if layer(t) != layer(m) and layer(t) not in MAY_IMPORT[layer(m)])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    g = import_graph()
    assert {"vllm_tap.ring_writer", "vllm_tap.ring_reader", "vllm_tap.cli", "vllm_tap.daemon.server", "vllm_tap.client.stream"} <= set(g)
    return g


def test_every_import_points_down(graph):
    assert upward(graph) == []


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_the_checks_see_what_they_forbid():
    """The imports the command line and the ring once had, fed to the checks, are found."""
    old = {
        "vllm_tap.dataset_cli": {"vllm_tap.client.record"},  # a command inside the core
        "vllm_tap.client.stream": {"vllm_tap.daemon.config"},
        "vllm_tap.daemon.config": {"vllm_tap.ring"},
        "vllm_tap.ring": {"vllm_tap.ring_schema"},
        "vllm_tap.ring_schema": {"vllm_tap.spec"},
        "vllm_tap.spec": {"vllm_tap.ring"},
    }
    assert upward(old) == ["vllm_tap.client.stream (client) imports vllm_tap.daemon.config (daemon)",
                           "vllm_tap.dataset_cli (core) imports vllm_tap.client.record (client)"]
    assert cycles(old) == [["vllm_tap.ring", "vllm_tap.ring_schema", "vllm_tap.spec"]]


# Importing any of these is how a test module starts vLLM (an engine, a server or the demo).
STARTS_VLLM = {"vllm", "vllm_tap.tools.launch", "vllm_tap.tools.demo", "parallel_engine", "server_stack"}


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _marked_vllm(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "vllm" for n in ast.walk(node.value))
    return False


def _test_files() -> list[tuple[str, ast.Module]]:
    """(path relative to tests/, parsed tree) of every Python file under tests/."""
    tests = os.path.join(REPO, "tests")
    out = []
    for d, _, files in sorted(os.walk(tests)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(d, name)
                with open(path) as f:
                    out.append((os.path.relpath(path, tests), ast.parse(f.read(), path)))
    return out


def _is_test_module(rel: str) -> bool:
    return os.path.basename(rel).startswith("test_")


def test_every_test_module_that_starts_vllm_is_marked():
    unmarked, marked = [], []
    for rel, tree in _test_files():  # tests/<part>/test_*.py
        if not _is_test_module(rel):
            continue
        starts = any(m == s or m.startswith(s + ".") for m in _imports(tree) for s in STARTS_VLLM)
        (marked if _marked_vllm(tree) else unmarked if starts else []).append(rel)
    assert unmarked == []
    assert "e2e/test_server_e2e.py" in marked and "hooks/test_hook_offline.py" in marked


def test_no_test_module_imports_one_of_another_folder():
    """Shared test helpers live in tests/support: a test module of another folder is importable only
    when pytest collected that folder first, so the importing module fails when run alone."""
    files = _test_files()
    where = {os.path.basename(rel)[:-3]: os.path.dirname(rel) for rel, _ in files if _is_test_module(rel)}
    found = [f"{rel} imports {m}" for rel, tree in files for m in sorted(_imports(tree) & set(where))
             if where[m] != os.path.dirname(rel)]
    assert found == []
