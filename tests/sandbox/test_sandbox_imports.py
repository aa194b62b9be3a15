"""The sandbox package's import graph has no cycle (task domains and scoring methods
each in one place; the Task record knows no scoring method, so schema <-> verifiers is gone).

Edges: every `import` / `from ... import` statement of a module, at any depth (a function-level
import is still a dependency), resolved to sandbox modules; importing a.b.c also runs the package
inits a and a.b, so those count too (except the importer's own enclosing packages, which are
already running). Static only: imports by string (importlib) are not followed.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules(root: str, package: str) -> dict[str, str]:
    """{dotted name: path} of every .py under root/package (package inits by the package name)."""
    out = {}
    for dirpath, dirnames, files in os.walk(os.path.join(root, package)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                dotted = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    mods = modules(root, package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        here = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t not in mods or t == name:
                    continue
                graph[name].add(t)
                parent = t
                while "." in parent:
                    parent = parent.rpartition(".")[0]
                    if parent in mods and not (name == parent or name.startswith(parent + ".")):
                        graph[name].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
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
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_no_import_cycle_among_sandbox_modules():
    graph = import_graph(ROOT, "sandbox")
    assert "sandbox.tasks.schema" in graph and "sandbox.verifiers" in graph
    assert "sandbox.tasks.schema" in graph["sandbox.verifiers"]
    assert not graph["sandbox.tasks.schema"], graph["sandbox.tasks.schema"]  # the record: a leaf
    bad = cycles(graph)
    assert not bad, f"import cycles among sandbox modules: {bad}"


def test_the_cycle_check_sees_lazy_and_package_init_cycles(tmp_path):
    # the shape of the old schema <-> verifiers circle (a function-level import), and a cycle
    # through a package init that re-exports a module importing back into the package
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.rec import R\n")
    (pkg / "sub" / "__init__.py").write_text("from .load import load\n")
    (pkg / "sub" / "rec.py").write_text("class R:\n    pass\n")
    (pkg / "sub" / "load.py").write_text("def load():\n    from ..a import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from .b import f\n")
    found = cycles(import_graph(str(tmp_path), "p"))
    assert ["p.b", "p.c"] in found
    assert ["p.a", "p.sub", "p.sub.load"] in found
    (pkg / "sub" / "__init__.py").write_text("")  # a lazy package init breaks the second one
    assert cycles(import_graph(str(tmp_path), "p")) == [["p.b", "p.c"]]
