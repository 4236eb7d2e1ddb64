"""``--prefill-chunk`` where ranks compute together, padding on either side, sliding windows, vLLM's step size.

Under ``--shard-target fsdp`` every decoder forward is a collective of all ranks, and a batch's chunk count
follows its length: ranks whose batches have different chunk counts agree on the most and the others join
with one-token forwards, so the cache equals a one-process chunked cache byte for byte (without the agreement
the ranks' all-gathers pair up wrongly and the run aborts). ``tp`` groups compute one batch together and need
none (``SPECCACHE_SOAK=1``). ``forward_capturing`` in chunks equals the unchunked forward for left-padded
batches and for a sliding window shorter than the sample too. vLLM gets a ``max_num_seqs`` it accepts beside
the chunk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.engines.hf import HfEngine
from speccache.engines.vllm import VllmPrecomputeEngine, chunked_prefill_sequences
from speccache.methods.base import CaptureRequest
from speccache.methods.decoder import decoder_calls, decoder_layers, forward_capturing
from speccache.precompute import PrecomputeConfig
from speccache.read import CacheDataset
from speccache.write import LocalComm
from speccache.write.loops import shard_batches

pytestmark = pytest.mark.soak_suite  # `make soak` runs the whole module, its soak test and the others

CHUNK = 64
# 6 samples of 47-215 tokens in shards of 4 (4 + 2) over 2 ranks: rank 0's two batches take 4 and 2 chunks of 64,
# rank 1's batch and its lockstep dummy 2 and 4; --draft-vocab-size runs the (separately sharded) LM head too.
ARGS = ["--limit", "6", "--max-length", "400", "--batch-size", "2", "--shard-size", "4", "--draft-vocab-size", "300"]
ARGS += ["--device", "cpu", "--quiet", "--dtype", "fp32", "--prefill-chunk", str(CHUNK)]


def _precompute(model: str, out: Path, nproc: int, *extra: str) -> None:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        extra = (*extra, "--timeout", "60")
    cmd = [*launcher, "-m", "speccache", "precompute", "--model", model, "--data", demo_data_path("sharegpt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECCACHE_FAULT", None)
    proc = subprocess.run([*cmd, "--out", str(out), *ARGS, *extra], env=env, timeout=240, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]


def _shards(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.endswith(".safetensors"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("models") / "llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "chunked"
    _precompute(model_dir, out, 1)
    return out


def _chunk_counts_per_step(cache: Path) -> list[list[int]]:
    """Each rank's decoder forwards per step (its shard's sorted batches, then lockstep dummies of sample 0)."""
    lengths = CacheDataset(str(cache)).sample_lengths()
    ranks = [[lengths[i] for i in range(s, min(s + 4, len(lengths)))] for s in (0, 4)]
    steps = [[decoder_calls(max(shard[i] for i in b), CHUNK) for b in shard_batches(shard, 2)] for shard in ranks]
    most = max(len(s) for s in steps)
    return [s + [decoder_calls(lengths[0], CHUNK)] * (most - len(s)) for s in steps]


@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_fsdp_ranks_with_different_chunk_counts_write_the_one_process_cache(model_dir, reference, tmp_path) -> None:
    rank0, rank1 = _chunk_counts_per_step(reference)
    assert rank0 != rank1  # some step's forwards differ in number between the ranks: the case to join
    out = tmp_path / "fsdp"
    _precompute(model_dir, out, 2, "--shard-target", "fsdp")
    assert _shards(out) == _shards(reference)
    for name in _shards(reference):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.soak(reason="another torchrun run (10 s on 2 cores)")
@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_a_tensor_parallel_group_in_chunks_agrees_with_one_process(model_dir, reference, tmp_path) -> None:
    out = tmp_path / "tp"
    _precompute(model_dir, out, 2, "--shard-target", "tp")
    assert _shards(out) == _shards(reference)
    for name in _shards(reference):
        got, want = load_file(out / name), load_file(reference / name)
        for key, value in want.items():
            if value.is_floating_point():  # a layer's sums reduced in another order across the group
                assert float((got[key] - value).abs().max() / value.abs().max()) <= 1e-5, (name, key)
            else:
                assert torch.equal(got[key], value), (name, key)


class _MostChunks:
    """A comm of two ranks whose other rank always has ``extra`` more chunks than this one."""

    rank, world_size = 0, 2

    def __init__(self, extra: int) -> None:
        self.extra, self.asked = extra, []

    def max_int(self, value: int) -> int:
        self.asked.append(value)
        return value + self.extra


def _llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
    )  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()


@pytest.mark.parametrize("mode,joined", [("fsdp", 2), ("replicate", 0)])
def test_a_rank_with_fewer_chunks_joins_the_others_forwards(mode, joined) -> None:
    model = _llama()
    comm = _MostChunks(extra=2)
    cfg = SimpleNamespace(prefill_chunk=8, shard_target=mode, tp_size=None)
    engine = HfEngine(cfg, comm)
    engine.model = model
    calls = []
    handle = decoder_layers(model)[0].register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[1]))
    ids = torch.randint(0, 300, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    try:
        last, captured = engine.capture(ids, mask, {"a": 1}, "embed")
    finally:
        handle.remove()
    assert comm.asked == ([3] if mode == "fsdp" else [])  # 20 tokens in chunks of 8: 3 forwards
    assert calls == [8, 8, 4] + [1] * joined  # the joining forwards come after the sample's own, one token each
    want_last, want = forward_capturing(model, ids, mask, {"a": 1}, "embed", chunk=8)
    assert torch.equal(last, want_last) and all(torch.equal(captured[k], want[k]) for k in want)


def _assert_chunked_equals_unchunked(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
    outputs = {f"layer{i}": i for i in range(len(decoder_layers(model)))}
    last, captured = forward_capturing(model, ids, mask, outputs, "embed")
    chunked_last, chunked = forward_capturing(model, ids, mask, outputs, "embed", chunk=chunk)
    assert set(chunked) == set(captured)
    for key, want, got in [("last", last, chunked_last), *((k, captured[k], chunked[k]) for k in captured)]:
        real = mask.bool()  # padding rows are never read
        err = float((want[real] - got[real]).abs().max() / want[real].abs().max().clamp(min=1.0))
        assert err <= 1e-5, (key, err)


def test_chunks_of_a_left_padded_batch_equal_its_unchunked_forward() -> None:
    """Positions count from the first column with a cache as without one, so left padding shifts them alike."""
    ids = torch.randint(0, 300, (3, 61))
    mask = torch.zeros_like(ids)
    for i, n in enumerate((61, 23, 40)):
        mask[i, 61 - n :] = 1
    _assert_chunked_equals_unchunked(_llama(), ids, mask, chunk=7)


def test_chunks_under_a_sliding_window_shorter_than_the_sample_equal_its_unchunked_forward() -> None:
    """The cache of a sliding-window layer keeps the window's last tokens; each chunk's mask reaches only them."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=16,
    )  # fmt: skip
    ids = torch.randint(0, 300, (2, 61))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    _assert_chunked_equals_unchunked(MistralForCausalLM(config).eval(), ids, mask, chunk=7)


def test_vllm_steps_hold_no_more_sequences_than_the_chunk_has_tokens(tiny_models) -> None:
    assert chunked_prefill_sequences(None) == {}
    assert chunked_prefill_sequences(64) == {"max_num_seqs": 64}  # vLLM refuses fewer tokens than sequences per step
    assert chunked_prefill_sequences(8192) == {"max_num_seqs": 256}
    cfg = PrecomputeConfig(model=tiny_models("llama"), data=demo_data_path("sharegpt"), out="", engine="vllm",
                           prefill_chunk=128)  # fmt: skip
    engine = VllmPrecomputeEngine(cfg, LocalComm())
    engine.open(CaptureRequest(layers=(0, 1)), None, 4096)  # vLLM itself starts at the first batch
    assert engine.engine is not None and engine.engine.engine_args["max_num_seqs"] == 128
    assert engine.engine.engine_args["max_num_batched_tokens"] == 128
