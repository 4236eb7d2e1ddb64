"""docs/architecture.md stays true to the tree: everything it names exists, and every module is named in it.

What the doc names, in backticks: dotted names (``speccache.read.follow``, ``speccache.methods.finite.guard_nonfinite``:
the longest prefix that is a module must exist, and the next part must be a name that module binds), and paths
(``src/...``, ``tests/...``, ``benchmarks/...``, ``docs/...``, ``tools/...``, or relative to ``src/speccache``:
``format/names.py``, ``engines/``, ``cli.py``). Its Markdown links to other files must exist too. Every module
under ``src/speccache`` (not ``_private`` ones or ``__init__``) must be named at least once, so a new module needs
a line in the doc.
The names "Where each rule lives" gives a module must be defined there, and "Modules over 600 lines" must list
exactly the modules over 600 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "speccache"
DOC = ROOT / "docs" / "architecture.md"

REPO_DIRS = ("src/", "tests/", "benchmarks/", "docs/", "tools/")
"""A path in backticks starting with one of these is relative to the repository; any other, to ``src/speccache``."""

_SPAN = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"\bspeccache(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"[\w.\-]+(?:/[\w.\-]+)*/?")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def module_file(dotted: str) -> Path | None:
    """The file of module ``dotted`` (a package's ``__init__.py``), or None where there is none."""
    base = SRC.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def bound_names(path: Path) -> set[str]:
    """The names a module binds at its top level: definitions, assignments and imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def resolve_dotted(dotted: str) -> tuple[Path | None, str | None]:
    """``(module file, attribute or None)`` of a dotted name: its longest prefix that is a module, and the part
    after it; ``(None, None)`` where not even ``speccache`` is a prefix that resolves."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:n]))
        if path is not None:
            return path, (parts[n] if n < len(parts) else None)
    return None, None


def resolve_path(span: str) -> Path:
    """Where a path the doc names lies: in the repository for ``src/``, ``tests/``... paths, else in the package."""
    return ROOT / span if span.startswith(REPO_DIRS) else PACKAGE / span


def is_path(span: str) -> bool:
    """Whether a backticked span is a path: one word of path characters with a ``/`` or a ``.py`` suffix (a cache's
    file names, such as ``view.json``, are neither)."""
    return bool(_PATH.fullmatch(span)) and ("/" in span or span.endswith(".py")) and not span.startswith("-")


def references(text: str) -> tuple[list[str], list[str], list[str]]:
    """``(dotted names, paths, link targets)`` named in a Markdown text."""
    spans = _SPAN.findall(text)
    dotted = [m for span in spans for m in _DOTTED.findall(span)]
    paths = [span for span in spans if is_path(span) and not _DOTTED.fullmatch(span)]
    links = [target for target in _LINK.findall(text) if "://" not in target]
    return dotted, paths, links


def missing(text: str, doc_dir: Path = DOC.parent) -> list[str]:
    """What a text names that does not exist, one line each."""
    dotted, paths, links = references(text)
    wrong = []
    for name in dotted:
        path, attribute = resolve_dotted(name)
        if path is None:
            wrong.append(f"`{name}`: no such module under src/")
        elif attribute is not None and attribute not in bound_names(path):
            wrong.append(f"`{name}`: {path.relative_to(ROOT)} binds no `{attribute}`")
    wrong += [
        f"`{span}`: no {resolve_path(span).relative_to(ROOT)}" for span in paths if not resolve_path(span).exists()
    ]
    wrong += [f"]({target}): no {target} beside the doc" for target in links if not (doc_dir / target).exists()]
    return wrong


def documented_modules() -> list[str]:
    """Every module under ``src/speccache`` that the doc must name: not ``__init__``, none of a ``_private`` name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if not any(part.startswith("_") for part in parts):
            found.append(".".join(parts))
    return found


def unmentioned(text: str, modules: list[str]) -> list[str]:
    """The modules of ``modules`` that a text names neither as a dotted name nor as a path."""
    dotted, paths, _ = references(text)
    named = {resolve_dotted(name)[0] for name in dotted}
    named |= {resolve_path(span).resolve() for span in paths}
    return [m for m in modules if SRC.joinpath(*m.split(".")).with_suffix(".py") not in named]


def test_everything_the_doc_names_exists():
    wrong = missing(DOC.read_text())
    assert not wrong, "docs/architecture.md names what is not there (fix the doc):\n" + "\n".join(wrong)


def test_the_doc_names_every_module():
    absent = unmentioned(DOC.read_text(), documented_modules())
    assert not absent, "docs/architecture.md does not name these modules; give each a line:\n" + "\n".join(absent)


def test_the_checker_catches_a_moved_module_and_a_new_one():
    """The checks themselves, on a scratch copy of the doc: a module renamed in every mention is reported as
    missing and as unmentioned, a dotted name whose module lost it as missing, and a module the tree gains as
    unmentioned."""
    text = DOC.read_text()
    assert "format/names.py" in references(text)[1] and "speccache.testing.faults" in references(text)[0]
    scratch = text.replace("format/names.py", "format/naming.py").replace(
        "speccache.testing.faults", "speccache.testing.fault"
    )
    wrong = missing(scratch)
    assert "`format/naming.py`: no src/speccache/format/naming.py" in wrong
    assert "`speccache.testing.fault`: src/speccache/testing/__init__.py binds no `fault`" in wrong
    assert unmentioned(scratch, documented_modules()) == ["speccache.format.names"]
    assert unmentioned(text, [*documented_modules(), "speccache.format.newcomer"]) == ["speccache.format.newcomer"]


_HOME = re.compile(r"`([\w/.]+\.py)` \(([^()]*)\)")
_NAME = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")


def class_members(path: Path, name: str) -> set[str]:
    """What class ``name`` of a module defines in its body (methods and class attributes)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    found.update(t.id for t in item.targets if isinstance(t, ast.Name))
            return found
    return set()


def missing_homes(text: str) -> list[str]:
    """Names the "Where each rule lives" table gives a module (`` `format/names.py` (`shard_path`, ...) ``) that it
    does not define: a top-level name, or ``Class.member``."""
    section = text.split("## Where each rule lives", 1)[1].split("\n## ", 1)[0]
    wrong = []
    for module, inside in _HOME.findall(section):
        path = resolve_path(module)
        if not path.is_file():
            continue  # missing() reports it
        for name in _NAME.findall(inside):
            owner, _, member = name.partition(".")
            if owner not in bound_names(path) or (member and member not in class_members(path, owner)):
                wrong.append(f"`{module}` (`{name}`): not defined there")
    return wrong


def test_every_rule_home_defines_what_the_doc_says():
    wrong = missing_homes(DOC.read_text())
    assert not wrong, "docs/architecture.md's 'Where each rule lives' names what is not there:\n" + "\n".join(wrong)


def test_the_home_check_sees_a_renamed_function():
    text = DOC.read_text()
    assert "(`shard_path`," in text
    assert missing_homes(text.replace("(`shard_path`,", "(`shard_file`,")) == [
        "`format/names.py` (`shard_file`): not defined there"
    ]
    assert missing_homes(text.replace("`CacheWriter.writing`", "`CacheWriter.write`")) == [
        "`write/cache_writer.py` (`CacheWriter.write`): not defined there"
    ]


LARGE = 600
"""Lines past which a module needs a row, and a reason, in the doc's "Modules over 600 lines"."""


def large_modules(limit: int = LARGE) -> set[str]:
    """The modules under ``src/speccache`` of more than ``limit`` lines, as paths relative to it."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > limit}


def listed_large(text: str) -> set[str]:
    """The modules the doc's "Modules over 600 lines" table lists (each row's first backticked path)."""
    section = text.split("## Modules over 600 lines", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.MULTILINE)}


def test_the_doc_lists_exactly_the_modules_over_600_lines():
    text = DOC.read_text()
    listed, large = listed_large(text), large_modules()
    assert listed == large, (
        f"docs/architecture.md's 'Modules over 600 lines' lists {sorted(listed - large)} that are no longer "
        f"large and misses {sorted(large - listed)}: give each large module a row and its reason"
    )


def test_the_large_module_check_sees_a_missing_row():
    """The check itself: at a lower limit, modules that pass it are found and the table lacks them; a row added to
    a scratch copy of the table is listed."""
    text = DOC.read_text()
    larger_than_400 = large_modules(limit=400)
    assert larger_than_400 and not larger_than_400 <= listed_large(text)
    module = sorted(larger_than_400)[0]
    head, section = text.split("## Modules over 600 lines", 1)
    section = section.replace("|---|---|---|\n", f"|---|---|---|\n| `{module}` | ~{LARGE} | a reason |\n", 1)
    scratch = head + "## Modules over 600 lines" + section
    assert listed_large(scratch) == listed_large(text) | {module}
