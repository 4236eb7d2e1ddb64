"""Fixtures several test modules share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import huggingface_hub.constants
import pytest
import torch

from speccache.demo import build_tiny_model_dir


@pytest.fixture(scope="module")
def offline_single_thread() -> Iterator[None]:
    """No hub access (a hub-id-looking --model must not try the network), and one torch thread: the tiny
    models run fastest single-threaded on a shared machine."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    # huggingface_hub reads the variables at import
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``get(arch)``: the directory of the bundled tiny target of that architecture (seed 0), built once."""
    base = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_model_dir(str(base / arch), arch, seed=0)
        return built[arch]

    return get
