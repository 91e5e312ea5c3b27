"""The package's import graph: no circles, and the engine imports downward only
(docs/design.md §3). Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fuseloop"
# What the engine may not import: the public layer above it.
ABOVE_ENGINE = (
    "fuseloop._loop",
    "fuseloop._factories",
    "fuseloop.handlers",
    "fuseloop.diagnostics",
    "fuseloop.data",
    "fuseloop.cli",
    "fuseloop.bench",
    "fuseloop._demo",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                candidates = _resolve(name, path.name == "__init__.py", node)
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in files and c != name)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None. A package's `__init__` importing its own submodules is
    not a circle (Python runs those imports after the submodule finished)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target.startswith(node + "."):  # a package importing its own submodule
                continue
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_engine_imports_nothing_above_it() -> None:
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("fuseloop.engine"):
            bad = sorted(t for t in targets if t.startswith(ABOVE_ENGINE))
            assert not bad, f"{module} imports {bad}"


def test_handlers_do_not_import_the_loop_builder() -> None:
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("fuseloop.handlers"):
            assert "fuseloop._loop" not in targets, module


# Small modules with one job, and no long functions (docs/design.md §3).
MODULE_LINES, FUNCTION_LINES = 400, 60


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, its docstring left out."""
    first = function.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    lines = (function.end_lineno or function.lineno) - function.lineno + 1
    return lines - ((first.end_lineno or first.lineno) - first.lineno + 1 if docstring else 0)


def test_modules_and_functions_stay_small() -> None:
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MODULE_LINES:
            long_modules.append((path.name, text.count("\n")))
        functions = [
            node
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        long_functions += [
            (path.name, f.name, n) for f in functions if (n := _code_lines(f)) > FUNCTION_LINES
        ]
    assert not long_modules, f"modules over {MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {FUNCTION_LINES} lines: {long_functions}"


def test_the_cycle_finder_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


if __name__ == "__main__":  # prints the graph and any circle in the whole package
    g = import_graph()
    for m in sorted(g):
        print(f"{m:40s} -> {', '.join(sorted(t.removeprefix('fuseloop.') for t in g[m]))}")
    print("circle in the whole package:", find_cycle(g))
