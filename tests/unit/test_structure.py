"""The shape of the code, checked on every run: no import circles, no hidden imports, small modules.

* **No import circles** among ``stofc`` modules. The graph is built from the ``import``
  statements a module runs when it is imported (module level, class bodies, ``try`` /
  ``if`` blocks; not function bodies, not ``if TYPE_CHECKING:`` blocks). Importing
  ``a.b.c`` also runs the ``__init__`` of every package on the way that the importer is
  not already inside, so those count as edges too: a package that re-exports a module
  which imports back into the package is a circle Python resolves by luck of order.
* **Function-level imports only for optional dependencies** (:data:`OPTIONAL`: CuPy,
  ONNX Runtime, matplotlib, ...), each with a comment on its line or the line above
  saying why; any other import inside a function hides a dependency (and usually a
  circle) and fails here.
* **Modules stay small**: at most :data:`MAX_LINES` lines.

``python tests/unit/test_structure.py`` prints the import graph's circles, the
function-level imports and the largest modules.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "stofc"
MAX_LINES = 400
# Top-level packages an import inside a function may name: optional at install time
# (the GPU extras, ONNX Runtime, plotting) or platform-specific.
OPTIONAL = ("cupy", "cupy_backends", "cuda", "onnxruntime", "torch", "matplotlib", "fcntl")


@dataclass(frozen=True)
class Import:
    module: str        # the importing module
    target: str        # what it imports (a module, or a package's attribute's module)
    line: int
    function_level: bool
    commented: bool


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _comment_lines(source: str) -> set[int]:
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    return lines


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import statement of one module (see the module doc for what counts where)."""
    source = path.read_text()
    tree = ast.parse(source)
    comments = _comment_lines(source)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets: list[str] = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                else:
                    base = _resolve(name, is_package, child)
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        targets.append(sub if sub in known else base)
                commented = bool({child.lineno, child.lineno - 1} & comments)
                found.extend(Import(name, t, child.lineno, in_function, commented)
                             for t in targets)
                continue
            visit(child, in_function)

    visit(tree, False)
    return found


def import_graph(*, with_functions: bool = False) -> tuple[dict[str, set[str]], list[Import]]:
    """Edges between stofc modules run at import time (``with_functions``: also those a
    function body imports), and every function-level import."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    function_level: list[Import] = []
    for name, path in known.items():
        own = name.split(".")
        own_packages = {".".join(own[:i]) for i in range(1, len(own) + 1)}
        for imp in imports(name, path, known):
            if imp.function_level:
                function_level.append(imp)
                if not with_functions:
                    continue
            if not imp.target.startswith("stofc"):
                continue
            parts = imp.target.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in known and target != name and (
                        i == len(parts) or target not in own_packages):
                    graph[name].add(target)
    return graph, function_level


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_circles():
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_function_level_imports_are_optional_dependencies_and_say_so():
    _, function_level = import_graph()
    hidden = [f"{i.module}:{i.line} imports {i.target}" for i in function_level
              if i.target.split(".")[0] not in OPTIONAL]
    assert not hidden, "function-level imports of required modules: " + "; ".join(hidden)
    silent = [f"{i.module}:{i.line} imports {i.target}" for i in function_level
              if not i.commented]
    assert not silent, "function-level imports without a comment saying why: " + \
        "; ".join(silent)


def test_modules_are_small():
    big = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = {name: n for name, n in big.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_the_checker_sees_a_circle_and_a_hidden_import(tmp_path):
    """The checks themselves: a two-module circle and a function-level import are found."""
    graph = {"stofc.a": {"stofc.b"}, "stofc.b": {"stofc.a"}, "stofc.c": {"stofc.a"}}
    assert cycles(graph) == [["stofc.a", "stofc.b"]]
    mod = tmp_path / "m.py"
    mod.write_text("import os\n\ndef f():\n    import json\n    # optional\n    import cupy\n")
    found = imports("stofc.m", mod, {})
    assert [(i.target, i.function_level, i.commented) for i in found] == [
        ("os", False, False), ("json", True, False), ("cupy", True, True)]


if __name__ == "__main__":
    g, fl = import_graph()
    print("circles:", cycles(g) or "none")
    print("circles counting function-level imports:",
          cycles(import_graph(with_functions=True)[0]) or "none")
    print(f"function-level imports: {len(fl)}")
    for imp in fl:
        print(f"  {imp.module}:{imp.line} {imp.target}{'' if imp.commented else '  (no comment)'}")
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in modules().items()),
                   reverse=True)[:10]
    print("largest modules:", ", ".join(f"{n} ({k})" for k, n in sizes))
