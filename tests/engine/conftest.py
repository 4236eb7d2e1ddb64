"""The vllm engine's tests: they run in the engine's own environment (``make test-engine``, ``.venv-vllm``).

``make test`` collects this directory too, and every module here skips, saying why, where vLLM is not importable.
Each module starts vLLM once or twice (about 25 s each on 2 cores).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from speccache.demo import build_tiny_model_dir

# vLLM-CPU keeps a core for its engine process by default; on a 2-core machine that leaves one for the model.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``get(arch)``: the bundled tiny target of that architecture with heads of 32 (vLLM's CPU attention has no
    kernel for the demo's 16), built once."""
    base = tmp_path_factory.mktemp("vllm-models")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_model_dir(str(base / arch), arch, seed=0, head_dim=32)
        return built[arch]

    return get
