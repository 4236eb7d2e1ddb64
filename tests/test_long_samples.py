"""Long samples in chunks (``--prefill-chunk``): a KV cache carried across chunks gives the unchunked features.

``forward_capturing(..., chunk=N)`` equals the unchunked forward (fp32, within 1e-5) on every bundled
architecture, for right-padded batches and a chunk that does not divide the length; a whole precompute in
chunks equals one without; a long sample's chunked forward stays under a stated memory bound, and on a target
with a real target's proportion of MLP to attention holds a fraction of the unchunked forward's memory.
``SPECCACHE_SOAK=1`` (``make soak``) runs a 131,072-token sample too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.demo import ARCHITECTURES, demo_data_path
from speccache.engines.vllm import VllmPrecomputeEngine, chunked_prefill_args
from speccache.methods.base import CaptureRequest
from speccache.methods.decoder import decoder_layers, forward_capturing
from speccache.precompute import PrecomputeConfig
from speccache.read import CacheDataset
from speccache.testing.long import forward_peak_bytes, long_target, memory_bound, right_padded
from speccache.write import LocalComm

pytestmark = pytest.mark.soak_suite  # `make soak` runs the whole module, its soak test and the others


def _assert_close(a: torch.Tensor, b: torch.Tensor, lengths: list[int], what: str) -> None:
    for i, n in enumerate(lengths):
        x, y = a[i, :n], b[i, :n]
        err = float((x - y).abs().max()) / max(1.0, float(x.abs().max()))
        assert err <= 1e-5, f"{what}, sample {i}: {err:.2e}"


def _compare(model: torch.nn.Module, lengths: list[int], chunk: int) -> None:
    num_layers = len(decoder_layers(model))
    outputs = {f"layer{i}": i for i in range(num_layers)}
    ids, mask = right_padded(lengths, model.config.vocab_size)
    last, captured = forward_capturing(model, ids, mask, outputs, "embed")
    chunked_last, chunked = forward_capturing(model, ids, mask, outputs, "embed", chunk=chunk)
    assert set(chunked) == set(captured) == {*outputs, "embed"}
    assert chunked_last.shape == last.shape
    _assert_close(last, chunked_last, lengths, "last hidden state")
    for key in captured:
        assert chunked[key].shape == captured[key].shape
        _assert_close(captured[key], chunked[key], lengths, key)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_chunked_forward_equals_the_unchunked_one_on_every_bundled_architecture(tiny_models, arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models(arch), dtype=torch.float32).eval()
    _compare(model, [61, 23, 40, 1], chunk=7)  # right-padded; 7 divides none of the lengths


def test_a_chunk_as_long_as_the_sequence_or_longer_is_one_forward(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama"), dtype=torch.float32).eval()
    ids, mask = right_padded([30, 12], model.config.vocab_size)
    last, captured = forward_capturing(model, ids, mask, {"a": 1})
    for chunk in (30, 31, 4096):
        same_last, same = forward_capturing(model, ids, mask, {"a": 1}, chunk=chunk)
        assert torch.equal(same_last, last) and torch.equal(same["a"], captured["a"])


def test_a_long_sample_in_chunks_equals_its_unchunked_forward():
    _compare(long_target(), [8192, 5000], chunk=1000)


def test_a_long_sample_in_chunks_stays_under_the_memory_bound():
    length, chunk = 16_384, 512
    bound = memory_bound(length, chunk)
    assert bound < length * length * 4  # an attention that holds its T x T scores (eager, masked) would not fit
    peak = forward_peak_bytes(length, chunk)
    assert peak <= bound, f"{peak / 2**20:.0f} MiB over the bound of {bound / 2**20:.0f} MiB"


@pytest.mark.slow
def test_chunks_cut_the_memory_of_a_wide_mlp_targets_forward():
    length = 16_384
    whole = forward_peak_bytes(length, None, "wide-mlp")
    chunked = forward_peak_bytes(length, 512, "wide-mlp")
    assert chunked * 3 < whole, f"chunked {chunked / 2**20:.0f} MiB, unchunked {whole / 2**20:.0f} MiB"


@pytest.mark.soak(reason="a 131,072-token sample takes minutes on 2 cores")
def test_a_131072_token_sample_in_chunks():
    """At 131,072 tokens the unchunked forward (64 GiB of scores per head) cannot run; the chunked one's rows of a
    prefix equal the unchunked forward of that prefix (a causal row reads only the tokens before it), two chunk
    sizes agree on every row, and its memory stays under the bound."""
    length = 131_072
    model = long_target()
    ids, mask = right_padded([length], model.config.vocab_size)
    last, captured = forward_capturing(model, ids, mask, {"a": 0}, "embed", chunk=4096)
    other_last, other = forward_capturing(model, ids, mask, {"a": 0}, "embed", chunk=3000)
    _assert_close(last, other_last, [length], "last hidden state, chunks of 4096 and 3000")
    _assert_close(captured["a"], other["a"], [length], "layer 0, chunks of 4096 and 3000")
    prefix = 8192
    prefix_last, prefix_captured = forward_capturing(model, ids[:, :prefix], mask[:, :prefix], {"a": 0}, "embed")
    _assert_close(last[:, :prefix], prefix_last, [prefix], "last hidden state of the prefix")
    _assert_close(captured["a"][:, :prefix], prefix_captured["a"], [prefix], "layer 0 of the prefix")
    del last, captured, other_last, other
    peak = forward_peak_bytes(length, 1024)
    assert peak <= memory_bound(length, 1024), f"{peak / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------
# the precompute


RUNS = {"whole": ("llama", ["--dtype", "fp32"]), "chunked": ("llama", ["--dtype", "fp32", "--prefill-chunk", "24"])}


def test_a_precompute_in_chunks_equals_one_without(precompute_runs, offline_single_thread):
    get = precompute_runs(RUNS, demo_data_path("sharegpt"), 24, 160)
    whole, chunked = CacheDataset(get("whole")), CacheDataset(get("chunked"))
    assert chunked.manifest.config["prefill_chunk"] == 24 and "prefill_chunk" not in whole.manifest.config
    assert len(whole) == len(chunked) == 24
    assert max(whole.sample_lengths()) > 2 * 24  # samples of several chunks
    for index in range(len(whole)):
        a, b = whole[index], chunked[index]
        assert set(a) == set(b)
        for key, value in a.items():
            if value.is_floating_point():
                scale = max(1.0, float(value.abs().max()))
                assert float((value - b[key]).abs().max()) <= 1e-5 * scale, (index, key)
            else:
                assert torch.equal(value, b[key]), (index, key)


def test_a_resume_with_another_chunk_is_refused(precompute_runs, offline_single_thread, tiny_models, capsys):
    from speccache.cli import main

    get = precompute_runs(RUNS, demo_data_path("sharegpt"), 24, 160)
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--out",
            get("chunked"), "--limit", "24", "--max-length", "160", "--model-dtype", "fp32", "--quiet", "--device",
            "cpu", "--dtype", "fp32", "--resume"]  # fmt: skip
    assert main([*argv, "--prefill-chunk", "32"]) == 1  # ConfigMismatchError, printed
    assert "config.prefill_chunk: cache has 24, this run has 32" in capsys.readouterr().err
    assert main([*argv, "--prefill-chunk", "24"]) == 0  # the same chunk resumes (nothing left to do)


def test_the_prefill_chunk_is_checked(tiny_models):
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 1 tokens, got 0"):
        PrecomputeConfig(model=tiny_models("llama"), data=demo_data_path("sharegpt"), out="", prefill_chunk=0).check()


def test_vllm_gets_the_chunk_as_its_chunked_prefill(tiny_models):
    assert chunked_prefill_args(None) == {}
    assert chunked_prefill_args(512) == {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}
    cfg = PrecomputeConfig(model=tiny_models("llama"), data=demo_data_path("sharegpt"), out="", engine="vllm",
                           prefill_chunk=512)  # fmt: skip
    engine = VllmPrecomputeEngine(cfg, LocalComm())
    engine.open(CaptureRequest(layers=(0, 1)), None, 4096)  # vLLM itself starts at the first batch
    assert engine.engine is not None
    assert engine.engine.engine_args["enable_chunked_prefill"] is True
    assert engine.engine.engine_args["max_num_batched_tokens"] == 512


def test_the_eagle3_head_in_runs_of_rows_gives_the_whole_batchs_features(tiny_models, tmp_path, monkeypatch):
    """A long sample's logits are computed in runs of rows (``HEAD_VALUES``): the features are the same."""
    from speccache.cli import main
    from speccache.methods import eagle3_producer

    def run(out: str) -> CacheDataset:
        argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--out", out,
                "--limit", "16", "--max-length", "160", "--model-dtype", "fp32", "--dtype", "fp32", "--quiet",
                "--device", "cpu", "--supervision", "topk:4", "--draft-vocab-size", "300", "--batch-size", "8",
                "--shard-size", "8"]  # fmt: skip
        assert main(argv) == 0
        return CacheDataset(out)

    whole = run(str(tmp_path / "whole"))
    monkeypatch.setattr(eagle3_producer, "HEAD_VALUES", 8 * 1000)  # a few rows per run of the head (a batch of 8)
    runs = run(str(tmp_path / "runs"))
    assert len(whole) == len(runs) == 16
    for index in range(len(whole)):
        a, b = whole[index], runs[index]
        assert set(a) == set(b) and "topk_probs" in a and "in_draft" in a
        for key, value in a.items():
            if value.is_floating_point():
                assert float((value - b[key]).abs().max()) <= 1e-5 * max(1.0, float(value.abs().max())), key
            else:
                assert torch.equal(value, b[key]), (index, key)
