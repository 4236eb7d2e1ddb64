"""--enable-expert-parallel reaches vllm.LLM and the manifest's engine record; --gpu-memory-utilization reaches
vllm.LLM from precompute and regenerate, over a torchrun rank's own share.

Only the pass-through is tested here: a real expert-parallel run needs a mixture of experts and GPUs (vLLM spreads
the experts over an engine's --tensor-parallel-size workers); benchmarks/engine_gpu.sh is where to run one.
"""

from __future__ import annotations

import pytest
from enginelib import require_vllm

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.engines.vllm import VllmPrecomputeEngine
from speccache.methods.base import CaptureRequest
from speccache.precompute import PrecomputeConfig
from speccache.write import LocalComm

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")


def test_the_flag_reaches_the_llm_arguments(vllm_models, tmp_path, monkeypatch, capsys):
    import vllm

    given: dict = {}

    def llm(**kwargs):
        given.update(kwargs)
        raise ValueError("stopped before vLLM starts")  # a library's ValueError: exit 1, one line

    monkeypatch.setattr(vllm, "LLM", llm)
    argv = ["precompute", "--model", vllm_models("llama"), "--data", demo_data_path("sharegpt"), "--limit", "2",
            "--out", str(tmp_path / "o"), "--engine", "vllm", "--tensor-parallel-size", "2",
            "--enable-expert-parallel", "--quiet"]  # fmt: skip
    assert main(argv) == 1
    assert "stopped before vLLM starts" in capsys.readouterr().err
    assert given["enable_expert_parallel"] is True and given["tensor_parallel_size"] == 2


@pytest.mark.parametrize("command", ["precompute", "regenerate"])
def test_the_memory_share_reaches_the_llm_arguments(vllm_models, tmp_path, monkeypatch, capsys, command):
    import vllm

    given: dict = {}

    def llm(**kwargs):
        given.update(kwargs)
        raise ValueError("stopped before vLLM starts")  # a library's ValueError: exit 1, one line

    monkeypatch.setattr(vllm, "LLM", llm)
    argv = [command, "--model", vllm_models("llama"), "--data", demo_data_path("sharegpt"), "--limit", "2",
            "--out", str(tmp_path / "o"), "--engine", "vllm", "--gpu-memory-utilization", "0.3"]  # fmt: skip
    assert main(argv) == 1
    assert "stopped before vLLM starts" in capsys.readouterr().err
    assert given["gpu_memory_utilization"] == 0.3
    given.clear()
    assert main([*argv[:-2], "--out", str(tmp_path / "p")]) == 1
    assert "gpu_memory_utilization" not in given  # vLLM's own default


def test_a_given_memory_share_replaces_a_ranks_share(vllm_models, monkeypatch):
    # the real settings, so that a field precompute adds reaches this test too
    cfg = PrecomputeConfig(model=vllm_models("llama"), data="", out="", model_dtype="fp32", engine="vllm",
                           gpu_memory_utilization=0.2)  # fmt: skip
    engine = VllmPrecomputeEngine(cfg, LocalComm())
    engine.engine_args = {"gpu_memory_utilization": 0.45}  # what rank_environment gives each of two CPU ranks
    engine.environment = {}
    engine.open(CaptureRequest(layers=(1,)), None, 64)
    assert engine.engine.engine_args["gpu_memory_utilization"] == 0.2


def test_the_manifest_records_expert_parallelism():
    cfg = PrecomputeConfig(model="", data="", out="", engine="vllm", tensor_parallel_size=2,
                           enable_expert_parallel=True)  # fmt: skip
    record = VllmPrecomputeEngine(cfg, LocalComm()).record()["engine"]
    assert record["enable_expert_parallel"] is True and record["data_parallel_size"] == 1
