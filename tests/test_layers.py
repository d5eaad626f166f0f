"""The package's layering, read from the source with ``ast`` (nothing is imported).

Layers, lowest first (docs/architecture.md): the vocabulary modules ``errors`` and ``defaults`` and the
crash-safe file writes of ``atomic`` (0), ``data`` (1), ``memory`` (2), ``io`` (3), ``engine`` (4), ``jobs``
(5), the front ends ``cli``, ``serve``, ``ray`` and ``training`` (6), and ``memfit/__init__.py`` /
``__main__.py`` on top. A module may import from its own layer and the layers below it, never from above; no
two modules import each other, directly or round a longer circle (imports under ``if TYPE_CHECKING:`` are left
out of that check only); and no module imports another module's private (``_name``) names.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "memfit"

LAYERS = {
    "errors": 0,
    "defaults": 0,
    "atomic": 0,
    "data": 1,
    "memory": 2,
    "io": 3,
    "engine": 4,
    "jobs": 5,
    "cli": 6,
    "serve": 6,
    "ray": 6,
    "training": 6,
}
TOP = 7  # memfit/__init__.py and memfit/__main__.py


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    target: str  # dotted module name imported from
    names: tuple[str, ...]  # the names a ``from ... import`` takes (empty for ``import memfit.x``)
    file: Path
    line: int
    type_checking: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path): path for path in sorted(root.rglob("*.py"))}


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return TOP
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module}: not in any layer; add its subpackage to LAYERS and docs/architecture.md")
    return LAYERS[parts[1]]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every ``memfit`` import in one file, at any depth (functions, classes, ``if`` blocks)."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "memfit" or alias.name.startswith("memfit."):
                    found.append(Import(importer, alias.name, (), path, node.lineno, type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base == "memfit" or base.startswith("memfit."):
                plain: list[str] = []
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:  # ``from memfit.x import module``: an import of that module
                        found.append(Import(importer, submodule, (), path, node.lineno, type_checking))
                    else:
                        plain.append(alias.name)
                if plain:
                    found.append(Import(importer, base, tuple(plain), path, node.lineno, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), False)
    return found


def all_imports(root: Path = PACKAGE) -> list[Import]:
    modules = all_modules(root)
    return [imp for path in modules.values() for imp in imports_of(path, modules)]


def where(imp: Import) -> str:
    return f"{imp.file.relative_to(SRC.parent)}:{imp.line}"


def upward_imports(imports: list[Import]) -> list[str]:
    return [
        f"{where(imp)}: {imp.importer} (layer {layer(imp.importer)}) imports {imp.target} (layer {layer(imp.target)})"
        for imp in imports
        if layer(imp.target) > layer(imp.importer)
    ]


def private_imports(imports: list[Import]) -> list[str]:
    return [
        f"{where(imp)}: {imp.importer} imports private {name} from {imp.target}"
        for imp in imports
        if imp.target != imp.importer
        for name in imp.names
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    ]


def import_cycles(imports: list[Import]) -> list[str]:
    """Strongly connected components of the module graph (Tarjan), each with the imports that close it."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if not imp.type_checking:
            edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, {}):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, {}):
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    problems = []
    for component in components:
        members = set(component)
        links = [
            f"{where(imp)}: {imp.importer} imports {imp.target}"
            for source in component
            for target, imp in sorted(edges.get(source, {}).items())
            if target in members
        ]
        problems.append("import circle " + " <-> ".join(component) + ":\n    " + "\n    ".join(links))
    return problems


def test_every_module_has_a_layer():
    for module in all_modules():
        layer(module)


def test_no_module_imports_from_a_higher_layer():
    problems = upward_imports(all_imports())
    assert not problems, "imports from a higher layer:\n" + "\n".join(problems)


def test_no_import_circles():
    problems = import_cycles(all_imports())
    assert not problems, "\n".join(problems)


def test_no_private_names_imported_across_modules():
    problems = private_imports(all_imports())
    assert not problems, "private names imported across modules:\n" + "\n".join(problems)


def test_the_checks_see_function_level_imports_and_circles(tmp_path):
    """The checks find what they are for, in a throwaway tree laid out like src/memfit."""
    global SRC
    root = tmp_path / "src" / "memfit"
    for package in ("", "data", "memory", "serve"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "data" / "sources.py").write_text("def f():\n    from memfit.memory.planner import plan\n")
    (root / "memory" / "planner.py").write_text("from memfit.data.sources import _records\nplan = 1\n")
    (root / "serve" / "app.py").write_text("def f():\n    from memfit.serve import routes\n")
    (root / "serve" / "routes.py").write_text(
        "from typing import TYPE_CHECKING\nfrom memfit.serve.app import f\n"
        "if TYPE_CHECKING:\n    from memfit import Encoder\n"
    )
    saved, SRC = SRC, tmp_path / "src"
    try:
        imports = all_imports(root)
        assert upward_imports(imports) == [
            "src/memfit/data/sources.py:2: memfit.data.sources (layer 1) imports memfit.memory.planner (layer 2)",
            "src/memfit/serve/routes.py:4: memfit.serve.routes (layer 6) imports memfit (layer 7)",
        ]
        assert private_imports(imports) == [
            "src/memfit/memory/planner.py:1: memfit.memory.planner imports private _records from memfit.data.sources"
        ]
        cycles = import_cycles(imports)
        assert [c.splitlines()[0] for c in cycles] == [
            "import circle memfit.data.sources <-> memfit.memory.planner:",
            "import circle memfit.serve.app <-> memfit.serve.routes:",
        ]
    finally:
        SRC = saved
