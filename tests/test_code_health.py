"""Static checks of the import graph and class names over libs/ and services/ (issue 13, items 4-6).

The checker reads the source with `ast` and imports nothing, so it runs in a fraction of a second:
- no import cycle between modules (imports inside functions count; `if TYPE_CHECKING:` imports do not);
- no `from module import _private` across modules;
- no module under services/<a> imports services/<b>, and libs/ imports services/ only under libs/kvmesh
  (the CLI, `kvmesh up` and the benchmarks drive whole services);
- the engine (engine_core, devices) imports nothing of the service layer but what it shares with the store: the KV
  block format (mesh.kv_blocks) and the eviction policies (mesh.eviction):
  the engine runs alone (`kvmesh generate`, the parity tests);
- no two classes share a name.
Generated protobuf code (libs/mesh/pb) is left out. The checker is tested on a tiny tree first, so the checks
on the real tree cannot pass vacuously.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# (folder, module prefix): libs/mesh/bus.py is module mesh.bus, services/kvcache/store.py is services.kvcache.store
ROOTS = ((REPO / "libs", ""), (REPO / "services", "services"))
EXCLUDED = ("mesh.pb",)
# libs/ may import services/ only here: the CLI, `kvmesh up` and the benchmarks start and drive services.
LIBS_MAY_IMPORT_SERVICES = ("kvmesh",)
ENGINE = ("engine_core", "devices")
ENGINE_MAY_IMPORT = ("mesh.kv_blocks", "mesh.pb", "mesh.eviction")  # what the engine shares with the store:
# the block format and the eviction policies (torch-free, so a store node needs no torch)


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (resolved to a module of the tree where one matches)
    names: tuple[str, ...]  # the names of a `from target import a, b`; empty for `import target`
    line: int


def collect_modules(roots: tuple[tuple[Path, str], ...], excluded: tuple[str, ...] = ()) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for folder, prefix in roots:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join(([prefix] if prefix else []) + parts)
            if not name or _within(name, excluded):
                continue
            modules[name] = Module(name, path, is_package)
    return modules


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, skipping the body of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _import_nodes(child)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect_imports(modules: dict[str, Module]) -> list[Import]:
    imports: list[Import] = []
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                imports.extend(Import(module.name, alias.name, (), node.lineno) for alias in node.names)
                continue
            target = _absolute(module, node)
            names = tuple(alias.name for alias in node.names)
            # `from package import submodule` imports the submodule; other names come from the package itself.
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            imports.extend(Import(module.name, sub, (), node.lineno) for sub in submodules)
            rest = tuple(n for n in names if f"{target}.{n}" not in modules)
            if rest or not submodules:
                imports.append(Import(module.name, target, rest, node.lineno))
    return imports


def _resolve(target: str, modules: dict[str, Module]) -> str | None:
    """The module of the tree that `import target` runs last (`a.b.c` may name an attribute of module a.b)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return None


def import_graph(modules: dict[str, Module], imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports:
        target = _resolve(imp.target, modules)
        if target is not None and target != imp.source:
            graph[imp.source].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def private_imports(modules: dict[str, Module], imports: list[Import]) -> list[str]:
    found = []
    for imp in imports:
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private and _resolve(imp.target, modules) not in (None, imp.source):
            found.append(f"{imp.source}:{imp.line} imports {', '.join(private)} from {imp.target}")
    return found


def _service(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" else None


def layer_violations(modules: dict[str, Module], imports: list[Import]) -> list[str]:
    found = []
    for imp in imports:
        target = _resolve(imp.target, modules)
        if target is None or _service(target) is None:
            continue
        source_service = _service(imp.source)
        if source_service is not None:
            bad = source_service != _service(target)
        else:
            bad = not _within(imp.source, LIBS_MAY_IMPORT_SERVICES)
        if bad:
            found.append(f"{imp.source}:{imp.line} imports {target}")
    return found


def engine_violations(modules: dict[str, Module], imports: list[Import]) -> list[str]:
    """Imports from the engine (ENGINE) into the service layer (mesh, kvmesh, services) beyond ENGINE_MAY_IMPORT."""
    found = []
    for imp in imports:
        target = _resolve(imp.target, modules)
        if target is None or not _within(imp.source, ENGINE) or _within(target, ENGINE):
            continue
        if not _within(target, ENGINE_MAY_IMPORT):
            found.append(f"{imp.source}:{imp.line} imports {target}")
    return found


def duplicate_classes(modules: dict[str, Module]) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module.name)
    return {name: sorted(found) for name, found in sorted(where.items()) if len(found) > 1}


# --- the checker on a tiny tree, so that the real checks cannot pass by finding nothing ---


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def tiny_tree(tmp_path: Path) -> dict[str, Module]:
    _write(
        tmp_path / "libs",
        {
            "core/__init__.py": "",
            # a cycle through an import inside a function: core.a -> core.b -> core.a
            "core/a.py": "from core.b import helper\n\nclass Thing:\n    pass\n",
            "core/b.py": "def helper():\n    from . import a\n    return a\n",
            # a cycle only under TYPE_CHECKING does not count
            "core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.d import X\n",
            "core/d.py": "import core.c\n\nclass X:\n    pass\n",
            "core/e.py": "from core.a import _secret, Thing\nfrom .e_local import _also_private\n",
            "core/e_local.py": "_also_private = 1\n",
            "tool/__init__.py": "",
            "tool/run.py": "import services.one.server\n",
            "other/__init__.py": "",
            "other/bad.py": "from services.one import server\n\nclass Thing:\n    pass\n",
        },
    )
    _write(
        tmp_path / "services",
        {
            "__init__.py": "",
            "one/__init__.py": "",
            "one/server.py": "from ..two.store import Store\nfrom . import helper\n",
            "one/helper.py": "",
            "two/__init__.py": "",
            "two/store.py": "class Store:\n    pass\n",
        },
    )
    return collect_modules(((tmp_path / "libs", ""), (tmp_path / "services", "services")))


def test_checker_finds_a_cycle_through_a_function_level_import(tiny_tree: dict[str, Module]) -> None:
    graph = import_graph(tiny_tree, collect_imports(tiny_tree))
    assert find_cycles(graph) == [["core.a", "core.b"]]
    assert graph["core.c"] == set()  # TYPE_CHECKING only
    assert graph["services.one.server"] == {"services.two.store", "services.one.helper"}


def test_checker_finds_a_private_import(tiny_tree: dict[str, Module]) -> None:
    assert private_imports(tiny_tree, collect_imports(tiny_tree)) == [
        "core.e:1 imports _secret from core.a",
        "core.e:2 imports _also_private from core.e_local",
    ]


def test_checker_finds_imports_across_services_and_from_libs(tiny_tree: dict[str, Module]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(f"{__name__}.LIBS_MAY_IMPORT_SERVICES", ("tool",))
        found = layer_violations(tiny_tree, collect_imports(tiny_tree))
    assert found == [
        "other.bad:1 imports services.one.server",
        "services.one.server:1 imports services.two.store",
    ]


def test_checker_finds_engine_imports_of_the_service_layer(tmp_path: Path) -> None:
    _write(
        tmp_path / "libs",
        {
            "engine_core/__init__.py": "",
            "engine_core/ok.py": "from mesh.kv_blocks import KVLayout\nfrom engine_core import bad\n",
            "engine_core/bad.py": "def f():\n    from mesh.bus import Bus\n    return Bus\n",
            "mesh/__init__.py": "",
            "mesh/kv_blocks.py": "class KVLayout:\n    pass\n",
            "mesh/bus.py": "class Bus:\n    pass\n",
        },
    )
    modules = collect_modules(((tmp_path / "libs", ""),))
    assert engine_violations(modules, collect_imports(modules)) == ["engine_core.bad:2 imports mesh.bus"]


def test_checker_finds_duplicate_class_names(tiny_tree: dict[str, Module]) -> None:
    assert duplicate_classes(tiny_tree) == {"Thing": ["core.a", "other.bad"]}


# --- the real tree ---


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Module], list[Import]]:
    modules = collect_modules(ROOTS, EXCLUDED)
    return modules, collect_imports(modules)


def test_tree_is_found(tree: tuple[dict[str, Module], list[Import]]) -> None:
    modules, imports = tree
    assert "services.prefill.prefiller" in modules
    assert not any(_within(name, EXCLUDED) for name in modules)
    assert len(imports) > 500


def test_no_import_cycles(tree: tuple[dict[str, Module], list[Import]]) -> None:
    modules, imports = tree
    cycles = find_cycles(import_graph(modules, imports))
    assert cycles == [], "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_private_imports_across_modules(tree: tuple[dict[str, Module], list[Import]]) -> None:
    modules, imports = tree
    found = private_imports(modules, imports)
    assert found == [], "\n".join(found)


def test_services_import_no_other_service(tree: tuple[dict[str, Module], list[Import]]) -> None:
    modules, imports = tree
    found = layer_violations(modules, imports)
    assert found == [], "\n".join(found)


def test_the_engine_stays_below_the_service_layer(tree: tuple[dict[str, Module], list[Import]]) -> None:
    modules, imports = tree
    found = engine_violations(modules, imports)
    assert found == [], "\n".join(found)


def test_no_two_classes_share_a_name(tree: tuple[dict[str, Module], list[Import]]) -> None:
    modules, _ = tree
    duplicates = duplicate_classes(modules)
    assert duplicates == {}, "\n".join(f"{name}: defined in {', '.join(where)}" for name, where in duplicates.items())
