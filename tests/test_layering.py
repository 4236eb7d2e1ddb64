"""The package's layering (docs/architecture.md): a lower room never imports a higher one, siblings stay apart.

Every import statement of every module is read with ``ast`` (function-level imports included), so the
contract holds for lazy imports too; read the same way, no module imports itself through others (no cycle).
``import speccache`` and ``speccache --help`` must not load the
test support of :mod:`speccache.testing`. Every public module names its API in ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# room -> rank; a module may import rooms of a lower rank, and its own room.
RANKS = {
    "speccache._version": 0,
    "speccache.errors": -1,  # below every room: each raises its errors, units and devices included
    "speccache.units": 0,
    "speccache.devices": 0,
    "speccache.dist": 0,  # where a process stands in its torch.distributed world: read/ and write/ both ask it
    "speccache.format": 1,
    "speccache.write": 2,
    "speccache.read": 2,
    "speccache.data": 2,
    "speccache.methods": 3,
    "speccache.engines": 4,
    "speccache.precompute": 5,
    "speccache.compat": 4,
    "speccache.testing": 4,
    "speccache.train": 4,
    "speccache.cli": 6,
    "speccache.offline_cache": 6,
    "speccache.regenerate": 6,
    "speccache.demo": 7,
    "speccache.__main__": 7,
    "speccache": 8,
}
IMPORTED_BY_NOTHING = {"speccache.testing"}
"""Test support: shipped with the package, imported only by tests, benchmarks and its own modules."""


def room(module: str) -> str:
    """The room of a dotted module name: the longest key of :data:`RANKS` it lies in."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in RANKS:
            return name
    raise AssertionError(f"{module} lies in no room of the layering contract; add it to RANKS")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(name: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every speccache import in module ``name``'s ``source`` (an ``__init__.py``
    where ``is_package``), relative ones resolved."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                # ``from speccache import cli`` imports speccache.cli; ``from speccache import X`` the root's X
                submodule = f"{base}.{alias.name}"
                is_module = (SRC / Path(*submodule.split("."))).is_dir() or (
                    SRC / f"{Path(*submodule.split('.'))}.py"
                ).exists()
                found.append((node.lineno, submodule if is_module else base))
    return [(line, m) for line, m in found if m == "speccache" or m.startswith("speccache.")]


def layering_violations(name: str, source: str, where: str, is_package: bool = False) -> list[str]:
    """What module ``name`` (its ``source``, read from ``where``) imports against the contract, one line each."""
    me = room(name)
    wrong = []
    for line, target in imports(name, source, is_package):
        other = room(target)
        if other == me:
            continue
        if other in IMPORTED_BY_NOTHING or RANKS[other] >= RANKS[me]:
            wrong.append(f"{where}:{line} imports {target} ({other}, rank {RANKS[other]} >= {RANKS[me]})")
    return wrong


MODULES = sorted((SRC / "speccache").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_imports_a_higher_or_sibling_room(path):
    wrong = layering_violations(
        module_name(path), path.read_text(), str(path.relative_to(SRC)), path.name == "__init__.py"
    )
    assert not wrong, "\n".join(wrong)


def import_cycles() -> list[list[str]]:
    """The import cycles among the modules of ``src/``: each strongly connected group of two or more modules
    (or one that imports itself), read with :func:`imports`, function-level imports included."""
    graph = {
        module_name(p): {m for _, m in imports(module_name(p), p.read_text(), p.name == "__init__.py")} for p in MODULES
    }
    for edges in graph.values():
        edges &= graph.keys()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_itself_through_others():
    cycles = import_cycles()
    assert not cycles, "import cycles (break each, e.g. by moving what both need into a lower module):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_contract_names_every_room_that_exists():
    rooms = {room(module_name(p)) for p in MODULES}
    assert rooms == set(RANKS), sorted(set(RANKS) ^ rooms)


def test_a_violation_is_caught(tmp_path):
    """The checker itself: a format module importing the reader is reported (the probe lies outside ``src/``)."""
    bad = tmp_path / "_layering_probe.py"
    bad.write_text("from speccache.read import CacheDataset\n")
    wrong = layering_violations("speccache.format._layering_probe", bad.read_text(), str(bad))
    assert wrong == [f"{bad}:1 imports speccache.read (speccache.read, rank 2 >= 1)"]


HELP = "import sys\nfrom speccache.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"


@pytest.mark.parametrize("code", ["import speccache", HELP], ids=["import", "help"])
def test_import_and_help_load_no_test_support(code):
    report = "\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith('speccache.testing')))"
    out = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def curates_names(path: Path) -> bool:
    """Whether a module must define ``__all__``: a public module (no ``_private`` part), or a package whose
    ``__init__.py`` binds names (one holding only its docstring has none to curate)."""
    parts = path.relative_to(SRC).with_suffix("").parts
    if path.name == "__init__.py":
        body = ast.parse(path.read_text()).body
        return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)
    return not any(part.startswith("_") for part in parts)


@pytest.mark.parametrize("path", [p for p in MODULES if curates_names(p)], ids=lambda p: module_name(p))
def test_every_public_module_names_its_api_in_all(path):
    module = importlib.import_module(module_name(path))
    assert hasattr(module, "__all__"), f"{path.relative_to(SRC)} defines no __all__: list the names others import"
    unbound = [name for name in module.__all__ if not hasattr(module, name)]
    assert not unbound, f"{path.relative_to(SRC)}: __all__ names what it does not bind: {unbound}"
