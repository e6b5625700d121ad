"""The layout keeps its promises (issue 21): imports run one way, no module reaches into another's private names,
and no file grows past about 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ragen_pl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name taken from it or "") for every ragen_pl import, lazy ones inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith("ragen_pl")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ragen_pl"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, "") if sub in modules else (node.module, alias.name))
    return found


def find_circle(graph: dict[str, list[str]]) -> list[str] | None:
    """A circle of the import graph (depth-first search for a back edge), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name)):
            return circle
    return None


def test_no_import_circle_in_the_package():
    modules = _modules()
    graph = {name: sorted({m for m, _ in _imports(path, modules) if m in modules and m != name})
             for name, path in modules.items()}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_no_module_imports_another_modules_private_name():
    modules = _modules()
    private = [f"{_module_name(path)} imports {module}.{name}"
               for path in modules.values() for module, name in _imports(path, modules)
               if name.startswith("_") and not name.startswith("__")]
    assert not private, private


def test_no_file_over_about_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


def test_the_checker_sees_a_circle(tmp_path):
    """The circle search is not vacuous: the old layout's module -> models -> sft -> module is found."""
    modules = {"ragen_pl.module": None, "ragen_pl.models": None, "ragen_pl.sft": None}
    src = {"ragen_pl.module": "from ragen_pl.models import resolve_model",
           "ragen_pl.models": "def f():\n    from ragen_pl.sft import sft",
           "ragen_pl.sft": "from ragen_pl.module import scored_logits"}
    edges = {}
    for name, text in src.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        edges[name] = [m for m, _ in _imports(path, modules) if m in modules]
    assert edges == {"ragen_pl.module": ["ragen_pl.models"], "ragen_pl.models": ["ragen_pl.sft"],
                     "ragen_pl.sft": ["ragen_pl.module"]}
    assert find_circle(edges) == ["ragen_pl.models", "ragen_pl.sft", "ragen_pl.module", "ragen_pl.models"]
