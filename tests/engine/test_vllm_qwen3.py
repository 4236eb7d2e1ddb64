"""--engine vllm on a tiny Qwen3, a layers cache (embeddings, a middle layer, the last layer before and after the
final norm, which vLLM does not return and speccache applies with the model's own norm): as --engine hf, 1e-4."""

from __future__ import annotations

import pytest
from enginelib import assert_caches_close, require_vllm

from speccache.cli import main
from speccache.demo import demo_data_path

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")

FLAGS = ["--method", "layers", "--layers=-1,0", "--last-hidden", "--last-prenorm", "--limit", "10",
         "--max-length", "128", "--batch-size", "5", "--shard-size", "5", "--dtype", "fp32", "--model-dtype", "fp32",
         "--quiet"]  # fmt: skip


def test_layers_features_match_the_hf_engine(vllm_models, tmp_path):
    model = vllm_models("qwen3")
    outs = {engine: str(tmp_path / engine) for engine in ("hf", "vllm")}
    for engine, out in outs.items():
        argv = ["precompute", "--model", model, "--data", demo_data_path("openai"), "--out", out, *FLAGS]
        assert main([*argv, "--engine", engine]) == 0
    assert_caches_close(outs["hf"], outs["vllm"])
