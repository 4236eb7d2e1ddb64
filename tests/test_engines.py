"""The engine seam without vLLM: the layer-id mapping, the final norm read alone from the checkpoint, the
``--engine`` refusals. The vLLM runs themselves are tests/engine/ (``make test-engine``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.engines.hf import load_outer_modules
from speccache.engines.vllm import VllmEngine, rank_environment, vllm_layer_ids
from speccache.methods.decoder import final_norm, forward_capturing
from speccache.methods.eagle3 import Supervision
from speccache.methods.eagle3_producer import Eagle3Target
from speccache.methods.layers_producer import LayersTarget, preset_selection

pytestmark = pytest.mark.usefixtures("offline_single_thread")


class _TransformersAsVllm(VllmEngine):
    """An engine whose 'vLLM' is transformers: id 0 the embedding output, id k the output of decoder layer k - 1
    (before the final norm, also for the last layer, where transformers' ``hidden_states[L]`` is after it)."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]) -> None:
        super().__init__("unused", layer_ids, max_model_len=1)
        self.hf = model

    def hidden_states(self, sequences):
        out = []
        for s in sequences:
            ids = torch.tensor([list(s)])
            layers = {k: k - 1 for k in self.layer_ids if k > 0}
            _, states = forward_capturing(self.hf, ids, torch.ones_like(ids), layers, 0)
            out.append(torch.stack([states[k][0] for k in self.layer_ids], dim=1))
        return out


def test_vllm_ids_are_transformers_hidden_states_indices():
    # decoder layer l is id l + 1, the embeddings 0, the final norm's input (layer L - 1's output) L
    assert vllm_layer_ids([0, 3, 3], embeddings=True, num_layers=8) == [0, 1, 4, 8]
    assert vllm_layer_ids([7], embeddings=False, num_layers=8) == [8]


@pytest.fixture(scope="module")
def llama(tiny_models):
    path = tiny_models("llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _batch(model):
    ids = torch.randint(5, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.bool()}


@torch.no_grad()
def test_an_engine_capture_with_the_checkpoints_norm_gives_the_hf_features(llama):
    path, model = llama
    outer = load_outer_modules(path, "fp32").model  # decoder layers never read: the engine runs them
    assert all(p.is_meta for p in outer.get_decoder().layers.parameters())
    batch = _batch(model)
    selected = torch.arange(model.config.vocab_size)
    hf = Eagle3Target(model, [0, 3, 5], Supervision.parse("hidden"), selected, torch.float32)
    engine = _TransformersAsVllm(model, vllm_layer_ids([0, 3, 5], False, 8))
    via = Eagle3Target(
        outer,
        [0, 3, 5],
        Supervision.parse("hidden"),
        selected,
        torch.float32,
        capture=engine.capture(final_norm(outer), 8),
    )
    a, b = hf.compute_batch(batch), via.compute_batch(batch)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
    selection = preset_selection("layers", 8, [-1, 2, 7], True, True)
    engine = _TransformersAsVllm(model, vllm_layer_ids([2, 7], True, 8))
    a = LayersTarget(model, selection, torch.float32).compute_batch(batch)
    b = LayersTarget(outer, selection, torch.float32, capture=engine.capture(final_norm(outer), 8)).compute_batch(batch)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--engine", "sglang"], "--engine 'sglang' is unknown"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is vLLM's"),
        (["--engine", "vllm", "--shard-target", "fsdp"], "--engine vllm parallelises the target itself"),
        (["--engine", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
        (["--enable-expert-parallel"], "--enable-expert-parallel is vLLM's"),
        (["--engine", "vllm", "--enable-expert-parallel"], "--tensor-parallel-size 2 or more"),
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization is vLLM's"),
        (["--engine", "vllm", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization must lie in (0, 1]"),
    ],
)
def test_bad_engine_flags_are_refused_before_loading(tiny_models, tmp_path, capsys, extra, message):
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt")]
    assert main([*argv, "--out", str(tmp_path / "o"), "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_names_the_install_and_the_alternative(tiny_models, tmp_path, capsys):
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt")]
    assert main([*argv, "--out", str(tmp_path / "o"), "--quiet", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "pip install speccache[vllm]" in err and "--engine hf" in err
    assert not (tmp_path / "o").exists()


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"}  # fmt: skip


def test_a_rank_engine_starts_in_its_own_process_without_torchrun_variables():
    env, _ = rank_environment(1, 2, 1, TORCHRUN, gpus=0, cpus=[0, 1])
    assert {k for k, v in env.items() if v is None} == set(TORCHRUN) - {"PATH"}
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "VLLM_PORT" not in env
    env, _ = rank_environment(1, 2, 1, {**TORCHRUN, "VLLM_PORT": "30000"}, gpus=0, cpus=[0, 1])
    assert env["VLLM_PORT"] == "30050"  # ranks' engines starting at once scan ports of their own


def test_rank_r_takes_gpus_r_times_t_onwards():
    env, args = rank_environment(1, 2, 4, TORCHRUN, gpus=8, cpus=[0])
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and args == {}
    env, _ = rank_environment(1, 2, 2, {**TORCHRUN, "CUDA_VISIBLE_DEVICES": "7,6,5,4"}, gpus=4, cpus=[0])
    assert env["CUDA_VISIBLE_DEVICES"] == "5,4"
    # a rank already given exactly its T GPUs keeps them
    env, _ = rank_environment(1, 2, 2, {**TORCHRUN, "CUDA_VISIBLE_DEVICES": "2,3"}, gpus=2, cpus=[0])
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_too_few_gpus_for_the_ranks_engines_are_refused():
    with pytest.raises(ValueError, match="need 16 GPUs .* it has 8: launch torchrun --nproc-per-node 1"):
        rank_environment(0, 2, 8, TORCHRUN, gpus=8, cpus=[0])


def test_cpu_ranks_bind_their_workers_to_their_share_of_the_cores():
    env, args = rank_environment(1, 2, 2, TORCHRUN, gpus=0, cpus=list(range(8)))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    assert args == {"gpu_memory_utilization": 0.45}  # half of vLLM's 0.9 of the host memory each
    env, args = rank_environment(0, 2, 1, {**TORCHRUN, "VLLM_CPU_KVCACHE_SPACE": "1"}, gpus=0, cpus=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and args == {}
    env, _ = rank_environment(0, 2, 1, {**TORCHRUN, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, gpus=0, cpus=[0, 1])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # the user's binding stands
    with pytest.raises(ValueError, match="need 4 CPUs"):
        rank_environment(0, 2, 2, TORCHRUN, gpus=0, cpus=[0, 1])
