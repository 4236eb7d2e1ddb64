"""--engine vllm on a tiny Llama, EAGLE-3: the same cache as --engine hf within 1e-4 (fp32); the refusals."""

from __future__ import annotations

import pytest
from enginelib import assert_caches_close, engine_record, require_vllm

from speccache.cli import main
from speccache.demo import demo_data_path

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")

FLAGS = ["--limit", "12", "--max-length", "96", "--batch-size", "4", "--shard-size", "4", "--dtype", "fp32",
         "--model-dtype", "fp32", "--draft-vocab-size", "300", "--quiet"]  # fmt: skip


def _precompute(model: str, out: str, *extra: str) -> None:
    argv = ["precompute", "--model", model, "--data", demo_data_path("sharegpt"), "--out", out, *FLAGS, *extra]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def caches(vllm_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("llama")
    model = vllm_models("llama")
    _precompute(model, str(base / "hf"), "--aux-layers", "0,1,2")
    _precompute(model, str(base / "vllm"), "--aux-layers", "0,1,2", "--engine", "vllm")
    return str(base / "hf"), str(base / "vllm")


def test_eagle3_features_match_the_hf_engine(caches):
    assert_caches_close(*caches)


def test_manifest_records_the_engine(caches):
    import vllm

    record = engine_record(caches[1])
    assert record["engine"] == "vllm" and record["tensor_parallel_size"] == 1
    assert record["version"].split("+")[0] == vllm.__version__.split("+")[0]
    assert engine_record(caches[0]) == {"engine": "hf"}


def test_computed_tokens_count_no_padding_under_vllm(caches):
    from speccache.format import Manifest

    hf, vllm = (Manifest.read(c) for c in caches)
    assert vllm.stats["computed_tokens"] == vllm.stats["tokens"] < hf.stats["computed_tokens"]


def test_an_architecture_vllm_cannot_extract_is_refused_before_any_work(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from speccache.demo import build_demo_tokenizer

    model = tmp_path / "gpt2"
    config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1024, n_positions=256)
    GPT2LMHeadModel(config).save_pretrained(model)
    build_demo_tokenizer().save_pretrained(model)
    out = tmp_path / "out"
    argv = ["precompute", "--model", str(model), "--data", demo_data_path("sharegpt"), "--out", str(out)]
    assert main([*argv, "--engine", "vllm", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "--engine hf" in err, err
    assert not out.exists()  # nothing written, no engine started


def test_the_hf_engine_sharding_modes_are_refused(vllm_models, tmp_path, capsys):
    argv = ["precompute", "--model", vllm_models("llama"), "--data", demo_data_path("sharegpt")]
    assert main([*argv, "--out", str(tmp_path / "o"), "--engine", "vllm", "--shard-target", "fsdp"]) != 0
    assert "--tensor-parallel-size" in capsys.readouterr().err


def test_a_head_size_vllm_cpu_has_no_kernel_for_is_refused_before_any_work(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--out", str(out)]
    assert main([*argv, "--engine", "vllm", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "head sizes" in err and "is 16" in err and "--engine hf" in err, err
    assert not out.exists()
