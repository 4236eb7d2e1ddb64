"""--enable-expert-parallel reaches vllm.LLM and the manifest's engine record.

Only the pass-through is tested here: a real expert-parallel run needs a mixture of experts and GPUs (vLLM spreads
the experts over an engine's --tensor-parallel-size workers); benchmarks/engine_gpu.sh is where to run one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from enginelib import require_vllm

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.engines.vllm import VllmPrecomputeEngine
from speccache.write import LocalComm

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")


def test_the_flag_reaches_the_llm_arguments(vllm_models, tmp_path, monkeypatch, capsys):
    import vllm

    given: dict = {}

    def llm(**kwargs):
        given.update(kwargs)
        raise ValueError("stopped before vLLM starts")

    monkeypatch.setattr(vllm, "LLM", llm)
    argv = ["precompute", "--model", vllm_models("llama"), "--data", demo_data_path("sharegpt"), "--limit", "2",
            "--out", str(tmp_path / "o"), "--engine", "vllm", "--tensor-parallel-size", "2",
            "--enable-expert-parallel", "--quiet"]  # fmt: skip
    assert main(argv) == 2
    assert "stopped before vLLM starts" in capsys.readouterr().err
    assert given["enable_expert_parallel"] is True and given["tensor_parallel_size"] == 2


def test_the_manifest_records_expert_parallelism():
    cfg = SimpleNamespace(tensor_parallel_size=2, enable_expert_parallel=True)
    record = VllmPrecomputeEngine(cfg, LocalComm()).record()["engine"]
    assert record["enable_expert_parallel"] is True and record["data_parallel_size"] == 1
