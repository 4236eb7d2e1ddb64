"""``--engine``: the name of each engine and its class (:class:`speccache.engines.base.Engine`), and of each
generator of ``speccache regenerate`` (:class:`speccache.engines.generation.Generator`)."""

from __future__ import annotations

from speccache.engines.base import Engine
from speccache.engines.generation import Generator
from speccache.engines.hf import HfEngine
from speccache.engines.hf_generate import HfGenerator
from speccache.engines.vllm import VllmPrecomputeEngine
from speccache.engines.vllm_generate import VllmGenerator
from speccache.errors import UsageError

__all__ = ["DEFAULT_ENGINE", "ENGINES", "GENERATORS", "engine_class", "generator_class"]

ENGINES: dict[str, type[Engine]] = {"hf": HfEngine, "vllm": VllmPrecomputeEngine}
"""What ``--engine`` accepts: transformers (the default) or vLLM. A new engine is a module of this room and an
entry here."""

DEFAULT_ENGINE = "hf"
"""What ``precompute --engine`` runs when it is not given."""

GENERATORS: dict[str, type[Generator]] = {"hf": HfGenerator, "vllm": VllmGenerator}
"""What ``speccache regenerate --engine`` accepts: transformers' loop (the default) or vLLM."""


def engine_class(name: str) -> type[Engine]:
    """The engine ``--engine name`` runs.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    return _choose(ENGINES, name)


def generator_class(name: str) -> type[Generator]:
    """The generator ``speccache regenerate --engine name`` runs.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    return _choose(GENERATORS, name)


def _choose(table: dict, name: str) -> type:
    if name not in table:
        raise UsageError(f"--engine {name!r} is unknown; choose one of {', '.join(table)}")
    return table[name]
