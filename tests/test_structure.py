"""The package's imports form no cycle, function-level imports included (grimp sees those too).  The layers
themselves are import-linter contracts in pyproject.toml, checked by `lint-imports` in CI."""

from __future__ import annotations

import grimp

PACKAGES = ("harness", "reports", "suites", "reference", "distributed_impl")


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


def test_no_import_cycle_anywhere():
    graph = grimp.build_graph(*PACKAGES)
    assert len(graph.modules) > 40
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
