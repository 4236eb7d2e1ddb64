"""``--engine``: the name of each engine and its class (:class:`speccache.engines.base.Engine`)."""

from __future__ import annotations

from speccache.engines.base import Engine
from speccache.engines.hf import HfEngine
from speccache.engines.vllm import VllmPrecomputeEngine

__all__ = ["ENGINES", "engine_class"]

ENGINES: dict[str, type[Engine]] = {"hf": HfEngine, "vllm": VllmPrecomputeEngine}
"""What ``--engine`` accepts: transformers (the default) or vLLM. A new engine is a module of this room and an
entry here."""


def engine_class(name: str) -> type[Engine]:
    """The engine ``--engine name`` runs.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name not in ENGINES:
        raise ValueError(f"--engine {name!r} is unknown; choose one of {', '.join(ENGINES)}")
    return ENGINES[name]
