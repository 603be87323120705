"""The import graph, read statically from every module's syntax: no circle among the project's
modules, and each package imports only what its room allows (docs/design.md, "Rooms").

An edge is an import at a module's top level (inside ``if``/``try`` blocks too, not inside
functions: a function's import runs when it is called, after every module has loaded, and is how
``moe/hf`` reaches transformers lazily). ``from .x import y`` is an edge to ``pkg.x``; ``from . import
x`` to ``pkg.x`` when that is a module, else to the package. Importing ``a.b.c`` runs ``a`` and
``a.b`` first, so an edge to a module is an edge to the packages above it as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "zero", "routing_kernels", "experiments", "conf")

# what each library package may import at all (top level or lazily), beyond the standard library
ALLOWED = {
    "routing_kernels": {"torch", "triton", "numpy"},
    # xxhash: a core dependency (checkpoint digests); yaml: the planner's profiles, read lazily
    "zero": {"torch", "triton", "numpy", "routing_kernels", "xxhash", "yaml"},
    # zero: the planner's cost types (moe.costs describes each block to zero.plan); never the reverse
    "moe": {
        "torch",
        "triton",
        "numpy",
        "routing_kernels",
        "zero",
        "transformers",
        "safetensors",
        "accelerate",
    },
}
# reached only inside functions, so that the libraries import on a box with torch and triton alone
LAZY_ONLY = {"transformers", "safetensors", "accelerate", "yaml", "xxhash"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            found[module_name(path) if root == ROOT else ".".join(path.relative_to(root).with_suffix("").parts)] = path
    return found


def _resolve(node: ast.ImportFrom, here: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, name: str, modules: dict, top_level_only: bool) -> set[str]:
    """The modules ``name`` (at ``path``) imports: project modules by full name, others by their top
    package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    nodes = []

    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for sub in getattr(node, field, []):
                        walk(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])
            elif not top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(node.body)
            elif not top_level_only and hasattr(node, "body") and isinstance(node.body, list):
                walk(node.body)

    walk(tree.body)
    if not top_level_only:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            mod = _resolve(node, name, is_pkg)
            if node.module is None or mod in modules:
                subs = [f"{mod}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in modules] or [mod]
            else:
                targets = [mod]
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                parts = t.split(".")
                # the packages above run first; a name that is no module is the nearest module above
                for i in range(1, len(parts) + 1):
                    if ".".join(parts[:i]) in modules:
                        out.add(".".join(parts[:i]))
            else:
                out.add(t.split(".")[0])
    out.discard(name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def graph_of(modules: dict[str, Path], top_level_only: bool = True) -> dict[str, set[str]]:
    return {
        n: {m for m in imports_of(p, n, modules, top_level_only) if m in modules and not _is_ancestor(m, n)}
        for n, p in modules.items()
    }


def _is_ancestor(pkg: str, mod: str) -> bool:
    # a module's own packages have run before it: an import of one is no edge back
    return mod.startswith(pkg + ".")


def test_no_import_circle():
    cycle = find_cycle(graph_of(project_modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_each_library_imports_only_what_its_room_allows(pkg):
    import sys

    modules = project_modules()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = {}
    for name, path in modules.items():
        if name.split(".")[0] != pkg:
            continue
        every = imports_of(path, name, modules, top_level_only=False)
        top = imports_of(path, name, modules, top_level_only=True)
        wrong = {m.split(".")[0] for m in every} - stdlib - ALLOWED[pkg] - {pkg}
        wrong |= top & LAZY_ONLY
        if wrong:
            bad[name] = sorted(wrong)
    assert not bad, f"{pkg} imports outside its room: {bad}"


def test_the_checks_see_a_planted_circle_and_a_planted_import(tmp_path):
    # the graph reader on a planted tree: a -> b -> a is a circle, and a lazy import is no edge
    pkg = tmp_path / "moe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n\ndef f():\n    import transformers\n")
    (pkg / "b.py").write_text("import torch\nfrom moe import a\nx = 1\n")
    modules = {"moe": pkg / "__init__.py", "moe.a": pkg / "a.py", "moe.b": pkg / "b.py"}
    graph = graph_of(modules)
    assert graph["moe.a"] == {"moe.b"} and graph["moe.b"] == {"moe.a"}
    assert find_cycle(graph) in (["moe.a", "moe.b", "moe.a"], ["moe.b", "moe.a", "moe.b"])
    assert "transformers" in imports_of(pkg / "a.py", "moe.a", modules, top_level_only=False)
    assert "transformers" not in imports_of(pkg / "a.py", "moe.a", modules, top_level_only=True)
    (pkg / "b.py").write_text("x = 1\n")
    assert find_cycle(graph_of(modules)) is None
