"""The layout keeps its promises (issues 21, 54): imports run one way in the whole repository (library, experiments,
benchmarks, tests), no module reaches into another's private names, and every library module says its one job.

The line-count rule that stood here is gone: a file is split when it takes a second job, never to pass a count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ragen_pl"
#: Where each importable tree of the repository lives: (the folder its module names count from, the tree).
TREES = [(ROOT, ROOT / "ragen_pl"), (ROOT / "experiments", ROOT / "experiments" / "ragen_pl_experiments"),
         (ROOT, ROOT / "benchmarks"), (ROOT, ROOT / "tests"), (ROOT / "experiments" / "tests", ROOT / "experiments" / "tests")]
#: Code whose private names stay its own (tests may reach into the module they test).
CODE = ("ragen_pl", "ragen_pl_experiments", "benchmarks")


def _module_name(path: Path, base: Path = ROOT) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(trees=None) -> dict[str, Path]:
    """Module name -> file, for every Python file of the trees (the library's alone by default)."""
    trees = trees if trees is not None else TREES[:1]
    return {_module_name(p, base): p for base, tree in trees for p in tree.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name taken from it or "") for every import of a module in ``modules``, lazy ones inside
    functions too."""
    roots = {name.split(".")[0] for name in modules}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] in roots]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in roots:
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


def test_no_import_circle_anywhere_in_the_repository():
    modules = _modules(TREES)
    assert {"ragen_pl.module", "ragen_pl_experiments.update", "benchmarks.findings", "tests.test_architecture",
            "test_readout"} <= set(modules)  # every tree is read
    graph = {name: sorted({m for m, _ in _imports(path, modules) if m in modules and m != name})
             for name, path in modules.items()}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_no_module_imports_another_modules_private_name():
    modules = _modules(TREES)
    private = [f"{name} imports {module}.{imported}"
               for name, path in modules.items() if name.split(".")[0] in CODE
               for module, imported in _imports(path, modules)
               if imported.startswith("_") and not imported.startswith("__")]
    assert not private, private


def test_code_never_puts_a_folder_on_sys_path_to_import_a_sibling():
    """Scripts import each other as modules of their package (``benchmarks.findings``), not through sys.path."""
    found = [str(p.relative_to(ROOT)) for _, tree in TREES[:3] for p in tree.rglob("*.py")
             if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    assert not found, found


def test_benchmarks_import_each_other_as_modules_of_their_package():
    """A benchmark importing a sibling by its bare name (``from echo_trap import ...``) works only with the folder on
    sys.path: it must be ``benchmarks.echo_trap``."""
    bare = []
    for folder in (ROOT / "benchmarks", ROOT / "experiments" / "ragen_pl_experiments" / "research"):
        bare += _bare_sibling_imports(folder)
    assert not bare, bare


def _bare_sibling_imports(folder: Path) -> list[str]:
    siblings = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    bare = []
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            bare += [f"{path.name}: {n}" for n in names if n.split(".")[0] in siblings]
    return bare


def test_every_library_module_says_its_job():
    """One job per file: each module of the library opens with a docstring that says what it is for."""
    missing = [name for name, path in _modules().items()
               if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert not missing, missing


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
