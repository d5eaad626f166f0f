"""The package's layering, read from the source with ``ast`` (nothing is imported).

Layers, lowest first (docs/architecture.md): the vocabulary modules ``errors`` and ``defaults`` and the
crash-safe file writes of ``atomic`` (0), ``data`` (1), ``memory`` (2), ``io`` (3), ``engine`` (4), ``jobs``
(5), the front ends ``cli``, ``serve``, ``ray`` and ``training`` (6), and ``memfit/__init__.py`` /
``__main__.py`` on top. A module may import from its own layer and the layers below it, never from above; no
two modules import each other, directly or round a longer circle (imports under ``if TYPE_CHECKING:`` are left
out of that check only); and no module takes another module's private (``_name``) names, by
``from ... import _name`` or as an attribute (``module._name``, ``alias._name``).
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
        if _private(name)
    ]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_bindings(path: Path, modules: dict[str, Path]) -> dict[str, str]:
    """The local names one file binds to memfit modules (at any depth): ``import memfit.x as m`` and
    ``from memfit import x`` bind ``m`` / ``x`` to the module; a plain ``import memfit.x.y`` binds ``memfit``."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    bound: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "memfit" or alias.name.startswith("memfit."):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.partition(".")[0]] = "memfit"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def _module_of(node: ast.expr, bound: dict[str, str], modules: dict[str, Path]) -> str | None:
    """The memfit module an expression names (``m``, ``memfit.x.y``), or None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_of(node.value, bound, modules)
        if parent is not None and f"{parent}.{node.attr}" in modules:
            return f"{parent}.{node.attr}"
    return None


def private_attribute_uses(root: Path = PACKAGE) -> list[str]:
    """``module._name`` (``alias._name``, ``memfit.x.y._name``) where ``module`` is another memfit module."""
    modules = all_modules(root)
    problems = []
    for importer, path in modules.items():
        bound = module_bindings(path, modules)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = _module_of(node.value, bound, modules)
                if target is not None and target != importer:
                    line = f"{path.relative_to(SRC.parent)}:{node.lineno}"
                    problems.append((node.lineno, f"{line}: {importer} uses private {node.attr} of {target}"))
    return [problem for _, problem in sorted(problems)]


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


def test_no_private_names_of_other_modules_used_as_attributes():
    problems = private_attribute_uses()
    assert not problems, "private names of other modules used as attributes:\n" + "\n".join(problems)


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
    (root / "serve" / "jobs.py").write_text(
        "import memfit.memory.planner\nfrom memfit.data import sources as src\nsrc._records()\ndef f():\n"
        "    from memfit.data import sources\n    return sources._records, sources.__name__, src.records\n"
        "memfit.memory.planner._plan\nclass C:\n    _own = 1\nC._own\n"
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
        assert private_attribute_uses(root) == [
            "src/memfit/serve/jobs.py:3: memfit.serve.jobs uses private _records of memfit.data.sources",
            "src/memfit/serve/jobs.py:6: memfit.serve.jobs uses private _records of memfit.data.sources",
            "src/memfit/serve/jobs.py:7: memfit.serve.jobs uses private _plan of memfit.memory.planner",
        ]
        cycles = import_cycles(imports)
        assert [c.splitlines()[0] for c in cycles] == [
            "import circle memfit.data.sources <-> memfit.memory.planner:",
            "import circle memfit.serve.app <-> memfit.serve.routes:",
        ]
    finally:
        SRC = saved


def test_the_tests_mirror_the_packages():
    """Each layer's tests live in a folder named after its package (tests/serve/ for src/memfit/serve/); only
    this whole-package check, the shared helpers and the tests of the repository's benchmark tools (benchmarks/,
    no package of memfit's) sit at the top of tests/."""
    tests = Path(__file__).resolve().parent
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    folders = {path.parent.name for path in tests.glob("*/test_*.py")}
    assert folders <= packages, folders - packages
    assert sorted(path.name for path in tests.glob("test_*.py")) == ["test_benchmarks.py", "test_layers.py"]
