"""The project's packages import in one direction: no import circle between modules, and no
package imports a package above it (LAYERS). Read from the source with ast (nothing imported), so
an import inside a function body counts like one at module level: a function-level import hides
a circle from Python's import machinery, not from this graph.

Layers (lowest first), as the code has them: runtime (process set-up before jax, the mesh
context) < pallas_kernels (kernels, usable without the model) < model < sandbox (which imports
neither model nor rl) < rl (the engine) < train (the drivers and the run-config schema) <
configs (run configs built on train's schema and model's presets) < scripts < benchmarks (which
reuse scripts' and each other's pieces).

Not covered: imports built at run time (importlib.import_module, __import__ with a computed
name) and scripts/' own `import _common` (a path-relative import inside scripts/).
"""

from __future__ import annotations

import ast
import functools
import os

from tests.sandbox.test_sandbox_imports import cycles as graph_cycles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = ("runtime", "pallas_kernels", "model", "sandbox", "rl", "train", "configs", "scripts",
          "benchmarks")

def project_modules(root: str = ROOT) -> dict[str, str]:
    """{dotted module name: path relative to root} of every .py file under LAYERS' packages."""
    mods = {}
    for pkg in LAYERS:
        for d, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__pycache__")))
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), root)
                    name = rel[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = rel
    return mods


def import_edges(mods: dict[str, str], root: str = ROOT) -> dict[tuple[str, str], list[int]]:
    """{(importer, imported): [line, ...]} between project modules, every import statement of
    a file counted wherever it stands (module level, function body, class body)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], list[int]] = {}
    for mod, rel in mods.items():
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), rel)
        package = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods
                           else resolve(base) for a in node.names]
            for t in targets:
                if t is not None and t != mod:
                    edges.setdefault((mod, t), []).append(node.lineno)
    return edges


def cycles(edges) -> list[list[str]]:
    """The import circles of a graph given by its edges: its strongly connected components of
    more than one module, each sorted (the sandbox import test's Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return graph_cycles(graph)


def upward_imports(edges, mods) -> list[str]:
    """'file:line importer -> imported' for each import of a higher layer's module."""
    rank = {p: i for i, p in enumerate(LAYERS)}
    out = []
    for (a, b), lines in sorted(edges.items()):
        if rank[b.split(".")[0]] > rank[a.split(".")[0]]:
            out += [f"{mods[a]}:{n} {a} -> {b}" for n in lines]
    return out


@functools.cache
def _repository_graph():
    mods = project_modules()
    return mods, import_edges(mods)


def test_no_import_circle_between_modules():
    _, edges = _repository_graph()
    found = cycles(edges)
    assert not found, ("import circles (move the shared piece down to a module both can "
                       f"import): {found}")


def test_no_package_imports_a_higher_layer():
    mods, edges = _repository_graph()
    found = upward_imports(edges, mods)
    assert not found, (f"imports of a higher layer (layers, lowest first: {LAYERS}); move the "
                       f"piece both need down: {found}")

