"""The import graph of shmtree's own modules (issue 22, "No circle"; issue 36, the layers).

Every module under shmtree/ - the layer packages (shmtree/machine, groups, p2p, internode,
launching, torch, bench) included, and the Cython extensions (their `import` / `cimport` of
shmtree) - is a node; every `from . import X`, `from .X import ...`, `from ..X import ...`,
`import shmtree.X` and `from shmtree.X import ...`, at module level or inside a function, is an
edge.  The checks: no circle; each module has a layer (LAYERS, lowest first) and imports only
from its own layer or the layers below; no module is over MAX_LINES lines but those of
OVER_MAX (a list that only shrinks); no module imports an old path (shmtree._moved.MOVED).

Run as a script, it prints each module's layer and imports, and the graph's cycles (none).
"""
import ast
import importlib
import pathlib
import re
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "shmtree"

# The layers, lowest first: a module may import its own layer's modules and those below.  A
# package name stands for every module in it.
LAYERS = [
    ("leaves", ["shmtree._version", "shmtree.errors", "shmtree.codes", "shmtree.ops",
                "shmtree.arrays", "shmtree._kernels", "shmtree._moving", "shmtree._p2p",
                "shmtree._accum", "shmtree._rounding", "shmtree.accumulator"]),
    ("machine", ["shmtree.machine"]),
    ("front end", ["shmtree.frontend", "shmtree._engine"]),
    ("groups", ["shmtree.groups"]),
    ("p2p", ["shmtree.p2p"]),
    ("internode", ["shmtree.internode"]),
    ("communicators", ["shmtree.communicators"]),
    ("launching", ["shmtree.launching"]),
    ("api", ["shmtree.api", "shmtree", "shmtree._moved"]),
    ("torch", ["shmtree.torch"]),
    ("bench", ["shmtree.bench"]),
]

MAX_LINES = 600
# the modules over MAX_LINES today: three Cython sources whose classes (the Engine, the p2p
# channels, the kernels' templates) cannot be cut into includes (Cython allows no include in a
# class body).  Only shrinks: a module that gets under MAX_LINES leaves the list
# (test_the_over_max_list_only_shrinks).
OVER_MAX = set()
SOURCES = ("*.py", "*.pyx", "*.pxd", "*.pxi", "*.h")


def _moved_table():
    """shmtree._moved.MOVED (old path -> the modules that hold its names), read from the file."""
    tree = ast.parse((PKG / "_moved.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "MOVED" for t in n.targets))
    return ast.literal_eval(node.value)


MOVED = _moved_table()


def _module_name(path, pkg=PKG):
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(pkg=PKG):
    """{dotted module name: path} of every module under shmtree/ (.py and .pyx)."""
    found = {}
    for path in sorted(pkg.rglob("*.py")) + sorted(pkg.rglob("*.pyx")):
        if "__pycache__" not in path.parts:
            found[_module_name(path, pkg)] = path
    return found


def _is_package(name, mods):
    return mods.get(name) is not None and mods[name].name == "__init__.py"


def _target(name, mods):
    """The module an import of `name` loads last (a name in a module: that module)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


_PYX_IMPORT = re.compile(r"^\s*(?:from\s+(shmtree[\w.]*)\s+c?import\s+([\w, ]+)|"
                         r"c?import\s+(shmtree[\w.]*))", re.M)


def _edges(name, path, mods):
    """The modules that module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    if path.suffix == ".pyx":
        for m in _PYX_IMPORT.finditer(path.read_text()):
            base, names, plain = m.groups()
            if plain:
                found.add(_target(plain, mods))
            else:
                for n in names.split(","):
                    full = f"{base}.{n.strip()}"
                    found.add(full if full in mods else _target(base, mods))
        return found - {None, name}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base != "shmtree" and not base.startswith("shmtree."):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in mods else _target(base, mods))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "shmtree" or a.name.startswith("shmtree."):
                    found.add(_target(a.name, mods))
    return found - {None, name}


def import_graph(pkg=PKG):
    """{module: {modules it imports}} for every module under shmtree/ (dotted names)."""
    mods = modules(pkg)
    return {name: _edges(name, path, mods) for name, path in mods.items()}


def layer_of(name):
    """The index in LAYERS of module `name`'s layer (None: it has none)."""
    best, at = None, -1
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (name == m or name.startswith(m + ".")) and len(m) > at:
                best, at = i, len(m)
    return best


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


def upward(graph):
    """[(module, module it imports)] where the import goes to a higher layer."""
    return sorted((a, b) for a, bs in graph.items() for b in bs
                  if layer_of(b) is not None and layer_of(a) is not None
                  and layer_of(b) > layer_of(a))


def test_no_import_circle():
    found = cycles(import_graph())
    assert found == [], f"import circles among shmtree's modules: {found}"


def test_every_module_has_a_layer():
    graph = import_graph()
    assert "shmtree.machine.topology" in graph and "shmtree.torch.backend" in graph   # (walked)
    assert "shmtree._engine" in graph and graph["shmtree._engine"] >= {"shmtree.frontend.calls"}
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert missing == [], f"modules in no layer of LAYERS: {missing}"


def test_imports_go_down_the_layers():
    bad = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
           for a, b in upward(import_graph())]
    assert bad == [], "imports up the layers:\n" + "\n".join(bad)


def test_the_layer_packages_say_what_they_own_and_may_import():
    for _, members in LAYERS:
        for m in members:
            path = PKG.parent.joinpath(*m.split("."), "__init__.py")
            if path.exists() and m != "shmtree":
                doc = ast.get_docstring(ast.parse(path.read_text())) or ""
                assert "may import" in doc, f"{path}: its docstring says what it may import"


def test_group_and_session_import_nothing_above_them():
    """group.py admits members and imports nothing that makes communicators; session.py (the
    process's membership state) is a leaf: errors and the standard library only."""
    graph = import_graph()
    assert graph["shmtree.groups.session"] <= {"shmtree.errors", "shmtree.codes"}, \
        graph["shmtree.groups.session"]
    assert all(layer_of(m) <= layer_of("shmtree.groups.group")
               for m in graph["shmtree.groups.group"]), graph["shmtree.groups.group"]


def test_the_checker_sees_a_circle_and_an_import_upward():
    """(The checks themselves: an edge back from group to joining is a circle, and upward.)"""
    graph = import_graph()
    graph["shmtree.groups.group"] = graph["shmtree.groups.group"] | {"shmtree.launching.joining"}
    assert any({"shmtree.groups.group", "shmtree.launching.joining"} <= set(c)
               for c in cycles(graph))
    assert ("shmtree.groups.group", "shmtree.launching.joining") in upward(graph)


def test_no_module_over_max_lines():
    over = sorted(f"{p.relative_to(ROOT)} ({n} lines)" for pattern in SOURCES
                  for p in PKG.rglob(pattern)
                  if (n := len(p.read_text().splitlines())) > MAX_LINES
                  and str(p.relative_to(ROOT)) not in OVER_MAX)
    assert over == [], f"modules over {MAX_LINES} lines (split them): {over}"


def test_the_over_max_list_only_shrinks():
    for rel in sorted(OVER_MAX):
        lines = len((ROOT / rel).read_text().splitlines())
        assert lines > MAX_LINES, f"{rel} has {lines} lines now: take it off OVER_MAX"


def _imported_names(path, name):
    """The dotted names that the file at `path` (module `name`) imports: `from A import b` gives
    A.b (b may be a module or a name in A), `import A.B` gives A.B."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_nothing_imports_an_old_path():
    """Neither shmtree nor its tests, examples and bench scripts import an old path (no
    DeprecationWarning in the suite); the old paths have no files (shmtree/_moved.py)."""
    import shmtree._moved
    assert shmtree._moved.MOVED == MOVED
    mods = modules()
    assert not set(MOVED) & set(mods), "an old path is a file again: see shmtree/_moved.py"
    files = [(name, path) for name, path in mods.items() if path.suffix == ".py"]
    files += [(f"{path.parent.name}.{path.stem}", path) for folder in ("tests", "examples", "bench")
              for path in sorted((ROOT / folder).rglob("*.py"))]
    bad = sorted(f"{path.relative_to(ROOT)} imports {n}" for name, path in files
                 for n in _imported_names(path, name)
                 if n in MOVED or any(n.startswith(old + ".") for old in MOVED))
    assert bad == []


def _forget_old_paths():
    for old in MOVED:
        sys.modules.pop(old, None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_with_a_deprecation_warning_and_the_same_objects(old):
    _forget_old_paths()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(old)
    module = sys.modules[old]
    caught = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert old in str(caught[0].message) and MOVED[old][0] in str(caught[0].message)
    assert caught[0].filename == __file__              # (it names the line that imported it)
    new = [importlib.import_module(n) for n in MOVED[old]]
    names = {n for part in new for n in vars(part) if not n.startswith("__")}
    assert names, old
    for n in sorted(names):
        owner = next(part for part in new if n in vars(part))
        assert getattr(module, n) is getattr(owner, n), f"{old}.{n}"
    assert set(module.__all__) >= {n for part in new for n in getattr(part, "__all__", ())}
    assert set(dir(module)) >= names
    with pytest.raises(AttributeError, match="no attribute"):
        module.no_such_name
    with warnings.catch_warnings(record=True) as again:        # (imported: no second warning)
        warnings.simplefilter("always")
        exec(f"from {old} import {sorted(names)[0]}", {})
    assert again == []


def test_what_was_pickled_under_an_old_path_unpickles():
    """A Group pickled by the previous release names shmtree.group._rebuild_group, a Status
    shmtree.messages.Status: both load, through the old paths (and their warning)."""
    import pickle

    import shmtree
    from shmtree.groups import group
    from shmtree.p2p import records
    new = pickle.dumps(shmtree.Status(), protocol=2)      # (the GLOBAL opcode: names as text)
    old = new.replace(b"shmtree.p2p.records", b"shmtree.messages")
    assert old != new
    _forget_old_paths()
    with pytest.warns(DeprecationWarning, match="shmtree.messages"):
        assert type(pickle.loads(old)) is records.Status
    old = pickle.dumps(group._rebuild_group, protocol=2).replace(b"shmtree.groups.group",
                                                                 b"shmtree.group")
    with pytest.warns(DeprecationWarning, match="shmtree.group"):
        assert pickle.loads(old) is group._rebuild_group


def test_the_torch_package_keeps_the_modules_names():
    """shmtree.torch, a module until issue 36, a package since: every public name it had."""
    pytest.importorskip("torch", reason="shmtree.torch needs torch")
    import shmtree.torch as st
    had = ["ANY_SOURCE", "ArgumentError", "BACKEND", "CollectiveMismatchError", "Future", "Group",
           "INLINE_BYTES", "KIND_ALLTOALL", "ProcessGroupShmtree", "QUICK_BYTES",
           "QUICK_P2P_BYTES", "SUPPORTED", "Status", "annotations", "as_numpy", "atexit",
           "calls", "concurrent", "datetime", "dist", "np", "queue", "threading", "torch",
           "warnings", "weakref"]
    assert [n for n in had if not hasattr(st, n)] == []
    assert st.ProcessGroupShmtree.__module__ == "shmtree.torch.backend"
    assert st.BACKEND == "shmtree" and st.Group is __import__("shmtree").Group


if __name__ == "__main__":
    g = import_graph()
    for name in sorted(g, key=lambda n: (layer_of(n) if layer_of(n) is not None else 99, n)):
        layer = LAYERS[layer_of(name)][0] if layer_of(name) is not None else "?"
        print(f"{layer:12} {name:32} -> {', '.join(sorted(g[name])) or '-'}")
    print("cycles:", cycles(g) or "none")
    print("upward:", upward(g) or "none")
