"""The package as a wheel lays it out: its import-linter contracts hold (the layers of pyproject.toml, the same
check as `lint-imports` in CI) and no import forms a cycle, function-level imports included (grimp sees those too).

The repository keeps the product's folders at its root and setuptools maps them under `shardcheck`
([tool.setuptools.package-dir]); grimp reads a package from one folder, so the tests copy the mapped folders into
the layout the wheel installs and read that."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib

import grimp
import pytest
from helpers import ROOT


@pytest.fixture(scope="module")
def wheel_layout(tmp_path_factory):
    """A folder holding `shardcheck/` as the wheel installs it (copies of the mapped folders)."""
    staged = tmp_path_factory.mktemp("wheel")
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        shutil.copytree(
            ROOT / folder,
            staged / package.replace(".", "/"),
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return staged


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative), each sorted."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def lint_imports(folder) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("lint-imports") or "lint-imports", "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_hold(wheel_layout):
    proc = lint_imports(wheel_layout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 7 kept, 0 broken." in proc.stdout, proc.stdout[-2000:]


def test_an_upward_import_breaks_the_layers(wheel_layout, tmp_path):
    staged = tmp_path / "wheel"
    shutil.copytree(wheel_layout, staged)
    topology = staged / "shardcheck" / "harness" / "core" / "topology.py"
    topology.write_text(topology.read_text() + "\nimport shardcheck.harness.driver.launch  # noqa\n")
    proc = lint_imports(staged)
    assert proc.returncode == 1
    assert "shardcheck.harness.core.topology -> shardcheck.harness.driver.launch" in proc.stdout, proc.stdout[-2000:]


def test_no_import_cycle_anywhere(wheel_layout):
    # In a process of its own, started in the staged folder: this one imported `shardcheck` from the checkout.
    code = (
        "import grimp, json; g = grimp.build_graph('shardcheck'); "
        "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=wheel_layout, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    graph = grimp.ImportGraph()
    edges = json.loads(proc.stdout)
    for module in edges:
        graph.add_module(module)
    for importer, imported in edges.items():
        for module in imported:
            graph.add_import(importer=importer, imported=module)
    assert len(graph.modules) > 40
    assert {m.split(".")[1] for m in graph.modules if "." in m} >= {
        "harness",
        "reports",
        "suites",
        "reference",
        "distributed_impl",
    }
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
