"""The import graph of shmtree's own modules has no circle (issue 22, "No circle"): every
`from . import X`, `from .X import ...`, `import shmtree.X` and `from shmtree.X import ...`,
at module level or inside a function, is an edge.  Run as a script, it prints the graph's
cycles (none) and each module's imports of shmtree."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "shmtree"


def import_graph(pkg=PKG):
    """{module: {modules it imports}} for shmtree/*.py (module names without the package)."""
    mods = {p.stem: p for p in pkg.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in sorted(mods.items()):
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    targets = [node.module.split(".")[0]] if node.module else \
                        [a.name for a in node.names]
                elif node.level == 0 and (node.module or "").split(".")[0] == "shmtree":
                    parts = node.module.split(".")
                    targets = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1] for a in node.names
                           if a.name.startswith("shmtree.")]
            edges.update(t for t in targets if t in mods and t != name)
        graph[name] = edges
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    found = cycles(import_graph())
    assert found == [], f"import circles among shmtree's modules: {found}"


def test_group_and_session_import_nothing_above_them():
    """group.py admits members and imports nothing that makes communicators; session.py (the
    process's membership state) is a leaf: errors and the standard library only."""
    graph = import_graph()
    assert graph["session"] <= {"errors", "codes"}, graph["session"]
    above = {"communicator", "nodes", "multinode", "joining", "front", "calls", "collectives",
             "requests", "shared", "api", "launch", "pool", "torch", "session"}
    assert not graph["group"] & above, graph["group"] & above


def test_the_checker_sees_a_circle():
    """(The check itself: an edge back from group to joining is a circle it reports.)"""
    graph = import_graph()
    graph["group"] = graph["group"] | {"joining"}
    assert any({"group", "joining"} <= set(c) for c in cycles(graph))


if __name__ == "__main__":
    g = import_graph()
    for name in sorted(g):
        print(f"{name:13} -> {', '.join(sorted(g[name])) or '-'}")
    print("cycles:", cycles(g) or "none")
