"""The import rules hold: the import-linter contracts in pyproject.toml (omnirt/pipeline/'s and omnirt/app/'s floors,
app imports only `omnirt.pipeline.api` of the engine, only omnirt/pipeline/models/ knows a model, nothing imports
`loadtest`), and no import loop in omnirt/app/ or omnirt/pipeline/, deferred and `TYPE_CHECKING` imports included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.fast


def test_the_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


def loops(graph: grimp.ImportGraph, package: str) -> list[set[str]]:
    """The strongly connected components of more than one module among `package`'s modules (Tarjan)."""
    modules = sorted(graph.find_descendants(package) | {package})
    edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for x in edges[m]:
            if x not in index:
                visit(x)
                low[m] = min(low[m], low[x])
            elif x in on_stack:
                low[m] = min(low[m], index[x])
        if low[m] == index[m]:
            component = set()
            while True:
                x = stack.pop()
                on_stack.discard(x)
                component.add(x)
                if x == m:
                    break
            if len(component) > 1:
                found.append(component)

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_loops_are_found():
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.d", imported="p.a")
    assert loops(graph, "p") == [{"p.a", "p.b", "p.c"}]


@pytest.mark.parametrize("package", ["omnirt.app", "omnirt.pipeline"])
def test_no_import_loop(package):
    graph = grimp.build_graph("omnirt", cache_dir=None)  # every import: deferred and TYPE_CHECKING ones too
    assert loops(graph, package) == []
