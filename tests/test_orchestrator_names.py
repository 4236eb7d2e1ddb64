"""The precompute orchestrator names neither a method nor an engine (docs/architecture.md, "The seam").

``precompute/``'s run, plan, report, token and command modules reach a method or an engine only through the
registries and the protocols: their code (every identifier, import and string but docstrings and ``--help``
texts) holds no name of a registered method or engine, of the module or class that implements one, or of a flag
an engine adds itself. The names are read from the registries, so a new method or engine is covered as it lands.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from speccache.engines.base import EngineSettings
from speccache.engines.registry import ENGINES
from speccache.methods.base import MethodSettings
from speccache.methods.registry import METHODS

PRECOMPUTE = Path(__file__).resolve().parents[1] / "src" / "speccache" / "precompute"
ORCHESTRATOR = ("run.py", "report.py", "_tokens.py", "command.py", "config.py")

GENERIC_SETTINGS = {"model", "method", "encodings", "no_vision_inputs"}
"""The settings of :class:`MethodSettings` that every method reads: not a method's own."""


def _engine_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    for engine in ENGINES.values():
        engine.add_arguments(parser)  # type: ignore[attr-defined]
    return {a.dest for a in parser._actions} - {"help"}


def specific_words() -> set[str]:
    """Words that name one method or engine: registry names, their modules' and classes' names (lower case)."""
    implementations = [type(m) for m in METHODS.values()] + list(ENGINES.values())
    words = set(METHODS) | set(ENGINES)
    words |= {cls.__module__.rsplit(".", 1)[1] for cls in implementations}
    words |= {cls.__name__.lower() for cls in implementations}
    return {w.replace("-", "_") for w in words}


def specific_settings() -> set[str]:
    """The settings only some methods or engines take: each method's own flags and each engine's own flags."""
    return (set(MethodSettings.__annotations__) - GENERIC_SETTINGS) | _engine_flags()


# Where the orchestrator still carries a method's or an engine's names, and why.
ALLOWED = {
    # PrecomputeConfig parses --aux-layers and --layers with methods/layers.py's parse_layer_ids
    "config.py": {"speccache.methods.layers"},
}
FIELDS = {"config.py": {*MethodSettings.__annotations__, *EngineSettings.__annotations__}}
"""Settings a module may declare as class fields and name nowhere else: PrecomputeConfig's, which implement the
method and engine protocols' settings (it checks none of them itself)."""


def _code_names(source: str, fields: set[str]) -> set[str]:
    """Every identifier, imported module and string of ``source`` but docstrings, ``help=`` texts and the
    declarations of class fields named in ``fields``."""
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            skipped.update(
                id(f.target)
                for f in node.body
                if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name) and f.target.id in fields
            )
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skipped.add(id(node.value))  # a docstring (of a module, class, function or attribute)
        elif isinstance(node, ast.keyword) and node.arg == "help":
            skipped.update(id(n) for n in ast.walk(node.value))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in skipped:
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.name for a in node.names)
            names.update([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            names.add(node.value)
    return names


def violations(source: str, allowed: set[str] = frozenset(), fields: set[str] = frozenset()) -> list[str]:
    """The names of ``source``'s code that name one method or engine, but those ``allowed`` and the declarations
    of class fields named in ``fields``."""
    words, settings = specific_words(), specific_settings()
    found = []
    for name in sorted(_code_names(source, fields)):
        # "--tensor-parallel-size" is the setting tensor_parallel_size; "speccache.engines.vllm" holds "vllm"
        tokens = {t for t in re.split(r"[^a-z0-9]+", name.lower()) if t}
        setting = name.lstrip("-").replace("-", "_")
        if setting in allowed:
            continue
        if tokens & words or setting in settings or name.lower() in words:
            found.append(name)
    return found


@pytest.mark.parametrize("module", ORCHESTRATOR)
def test_the_orchestrator_names_no_method_or_engine(module):
    source = (PRECOMPUTE / module).read_text()
    found = violations(source, ALLOWED.get(module, set()), FIELDS.get(module, set()))
    assert found == [], f"precompute/{module} names a method or engine"


def test_a_method_or_engine_name_is_caught():
    """The check above can fail: each kind of name it looks for is found."""
    source = '''
"""A docstring may say vllm and eagle3."""
from speccache.engines.vllm import something
from speccache.methods import eagle3
def f(cfg, p):
    p.add_argument("--tensor-parallel-size", help="--engine vllm only")
    if cfg.engine == "vllm" or cfg.draft_vocab_size:
        return Eagle3Method().padded_token_bytes
    return cfg.gpu_memory_utilization
'''
    assert violations(source) == [
        "--tensor-parallel-size",
        "Eagle3Method",
        "draft_vocab_size",
        "eagle3",
        "gpu_memory_utilization",
        "speccache.engines.vllm",
        "vllm",
    ]
    # a declared field is let pass, not its use
    fields = "class C:\n    tp_size: int = 1\n\n    def check(self):\n        return self.tp_size\n"
    assert violations(fields, fields={"tp_size"}) == ["tp_size"]
    assert violations(fields.split("\n\n")[0], fields={"tp_size"}) == []
    assert specific_words() >= {"eagle3", "layers", "hf", "vllm"}
    assert specific_settings() >= {"draft_vocab_size", "aux_layers", "tensor_parallel_size", "shard_target"}
