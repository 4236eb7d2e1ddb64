"""What the vllm engine's test modules share."""

from __future__ import annotations

import pytest
import torch

from speccache.format import Manifest
from speccache.read import CacheDataset

NEEDS_VLLM = "vLLM is not installed here: the vllm engine's tests run in its own environment (make test-engine)"


def require_vllm() -> None:
    """Skip the calling module where vLLM is not importable."""
    pytest.importorskip("vllm", reason=NEEDS_VLLM)


def assert_caches_close(hf_dir: str, vllm_dir: str, rtol: float = 1e-4) -> None:
    """The same samples, token ids and masks; every float feature within ``rtol`` of the row's largest value."""
    a, b = CacheDataset(hf_dir), CacheDataset(vllm_dir)
    assert len(a) == len(b) and a.manifest.schema.keys() == b.manifest.schema.keys()
    for i in range(len(a)):
        x, y = a[i], b[i]
        for key in x:
            if not torch.is_tensor(x[key]) or not x[key].is_floating_point():
                assert torch.equal(x[key], y[key]), (i, key)
                continue
            scale = x[key].abs().amax(-1, keepdim=True).clamp_min(1e-6)
            err = float(((x[key] - y[key]).abs() / scale).max())
            assert err <= rtol, f"sample {i} {key}: relative error {err:.2e} > {rtol:.0e}"


def engine_record(cache: str) -> dict:
    """The manifest's record of the engine that wrote ``cache``."""
    m = Manifest.read(cache)
    return {"engine": m.config["engine"], **m.stats.get("engine", {})}
