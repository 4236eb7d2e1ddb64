"""A sample over 2^31 bytes (an 8B target's 128K-token sample holds ~4 GB of features): the layer readers, token-range
reads and the SpecForge and speculators exports keep every byte past the 2 GiB mark.

The target is as wide as a large model's (16,384) but cheap to run (two heads of 32, an MLP of 64), so that
12,000 tokens give one tensor of 2.36 GB and a sample of 3.9 GB. ``SPECCACHE_SOAK=1`` (``make soak``) runs it:
minutes on 2 cores and about 12 GB of memory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from speccache.cli import main
from speccache.demo import build_demo_tokenizer, build_tiny_model_dir
from speccache.format import ShardFile, shard_path
from speccache.methods.layers import LayerFeatureDataset
from speccache.read import CacheDataset

WIDTH = 16_384
LAYERS = [0, 1, 2]  # below the last layer (4), whose id the exports read before the final norm
TOKENS = 12_000  # about: the demo tokenizer's words
GIB2 = 1 << 31

pytestmark = [
    pytest.mark.soak(reason="a 3 GB sample takes minutes and ~12 GB"),
    pytest.mark.soak_suite,
    pytest.mark.usefixtures("offline_single_thread"),
]


def _wide_target(path: str, tiny: str) -> str:
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {
            "hidden_size": WIDTH,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_hidden_layers": 4,
            "max_position_embeddings": 16_384,
        }  # fmt: skip
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(os.path.join(tiny, name), path)
    return path


def _long_row(path: str) -> str:
    vocab = [w for w in build_demo_tokenizer().get_vocab() if w.isalpha() and len(w) > 3][:200]
    words = " ".join(vocab[(i * 7) % len(vocab)] for i in range(TOKENS))
    row = {"messages": [{"role": "user", "content": "Repeat the list."}, {"role": "assistant", "content": words}]}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    base = tmp_path_factory.mktemp("huge")
    tiny = build_tiny_model_dir(str(base / "tiny"), "llama")
    model = _wide_target(str(base / "wide"), tiny)
    cache = str(base / "cache")
    argv = ["precompute", "--model", model, "--data", _long_row(str(base / "long.jsonl")), "--out", cache,
            "--method", "layers", "--layers", ",".join(map(str, LAYERS)), "--last-hidden", "--last-prenorm",
            "--dtype", "fp32", "--max-length", "16384", "--batch-size", "1", "--prefill-chunk", "2048",
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    return cache


def _layer(cache: str, key: str) -> torch.Tensor:
    return CacheDataset(cache, keys=[key]).read(0, keys=[key])[key]


def test_the_sample_is_over_2_gib_and_range_reads_past_the_mark_equal_its_rows(huge):
    ds = CacheDataset(huge)
    length = ds.sample_length(0)
    layer_keys = [k for k in ds.schema if ds.schema[k].ragged and ds.schema[k].shape == (WIDTH,)]
    assert len(layer_keys) == len(LAYERS) + 2 and length > 10_000  # and the last, before and after the norm
    assert length * WIDTH * 4 * len(layer_keys) > GIB2
    tail = slice(length - 300, length)
    file = ShardFile(shard_path(huge, 0))
    past_the_mark = 0
    for key in layer_keys:
        whole = _layer(huge, key)
        assert whole.shape == (length, WIDTH) and torch.isfinite(whole[-1]).all() and whole[-1].abs().sum() > 0
        assert torch.equal(ds.read(0, rows=tail, keys=[key])[key], whole[tail])
        end = file.data_start + file.entries[key][3]  # the key's last row, read from the file by hand
        with open(file.path, "rb") as f:
            f.seek(end - WIDTH * 4)
            assert f.read(WIDTH * 4) == whole[-1].numpy().tobytes()
        past_the_mark += end > GIB2
        del whole
    assert past_the_mark  # some of the rows compared lie past byte 2^31 of the shard


def test_the_layer_reader_concatenates_a_tensor_over_2_gib(huge):
    got = LayerFeatureDataset(huge, {"aux": LAYERS})[0]["aux"]
    assert got.numel() * 4 > GIB2
    offset = 0
    for key in (f"layer_{i:02d}" for i in LAYERS):
        assert torch.equal(got[:, offset : offset + WIDTH], _layer(huge, key))
        offset += WIDTH
    assert offset == got.shape[1]


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None, reason="speculators is not installed")
def test_the_speculators_export_keeps_a_tensor_over_2_gib(huge, tmp_path, capsys):
    from speculators.train.data import ArrowDataset

    out = tmp_path / "sp"
    assert main(["export", "--to", "speculators", "--layers", ",".join(map(str, LAYERS)), huge, str(out)]) == 0
    capsys.readouterr()
    want = LayerFeatureDataset(huge, {"aux": LAYERS, "pre": [3]}, prenorm=True)[0]
    got = ArrowDataset(max_len=16_384, datapath=str(out), on_missing="raise")[0]
    assert got["hidden_states"].numel() * got["hidden_states"].element_size() > GIB2
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["hidden_states"], want["aux"])
    assert torch.equal(got["verifier_last_hidden_states"], want["pre"])


@pytest.mark.skipif(importlib.util.find_spec("specforge") is None, reason="specforge is not installed")
def test_the_specforge_export_keeps_a_tensor_over_2_gib(huge, tmp_path, capsys):
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    out = tmp_path / "sf"
    assert main(["export", "--to", "specforge", "--layers", ",".join(map(str, LAYERS)), huge, str(out)]) == 0
    capsys.readouterr()
    want = LayerFeatureDataset(huge, {"aux": LAYERS, "last": ["last"]})[0]
    (path,) = list_feature_files(str(out))
    raw = load_feature_file(path)
    assert raw["aux_hidden_state"].numel() * 4 > GIB2
    assert torch.equal(raw["aux_hidden_state"][0], want["aux"])
    assert torch.equal(raw["hidden_state"][0], want["last"])
