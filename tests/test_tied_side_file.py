"""A tied target's side file (EAGLE-3's and the layer methods') stores its embedding once; readers see the same.

A tied tiny llama (``tie_word_embeddings``, the head *is* the embedding) and its untied twin (the same weights,
the head a copy) give caches with the same shards; the tied one's side file has no ``lm_head`` and records the
tying, the twin's is the layout every earlier cache has (both matrices). The readers (``TargetHead``, the
trainer's draft, the NeMo and SpecForge exports, verify, inspect, audit, estimate) return identical tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from speccache.cli import build_parser, main
from speccache.demo import demo_data_path
from speccache.format import ShardFile
from speccache.methods.eagle3 import SIDE_FILE, Eagle3CacheDataset, TargetHead, read_side_file
from speccache.methods.layers import SIDE_FILE as LAYERS_SIDE
from speccache.precompute import PrecomputeConfig
from speccache.precompute.estimate import estimate_cache
from speccache.train.trainer import draft_for_cache

pytestmark = pytest.mark.usefixtures("offline_single_thread")

ARGS = ["--data", demo_data_path("sharegpt"), "--limit", "12", "--max-length", "64", "--draft-vocab-size", "300",
        "--dtype", "fp32", "--batch-size", "4", "--shard-size", "8"]  # fmt: skip


def _save_twin(src: str, out: Path, tied: bool) -> str:
    """``src``'s model with its embedding as the LM head: tied (one parameter) or as an untied copy."""
    shutil.copytree(src, out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    embed = model.get_input_embeddings().weight
    model.config.tie_word_embeddings = tied
    model.get_output_embeddings().weight = embed if tied else torch.nn.Parameter(embed.detach().clone())
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def caches(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("tied")
    out = {}
    for name in ("tied", "untied"):
        model = _save_twin(tiny_models("llama"), base / f"{name}-model", tied=name == "tied")
        out[name], out[f"{name}-model"] = str(base / name), model
        assert main(["precompute", "--model", model, "--out", out[name], *ARGS, "--quiet"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out["tied-model"])
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight, "the fixture is tied"
    return out


def _side(cache: str) -> ShardFile:
    return ShardFile(str(Path(cache) / SIDE_FILE))


def test_a_tied_target_stores_its_embedding_once(caches):
    tied, untied = _side(caches["tied"]), _side(caches["untied"])
    assert "lm_head" not in tied.keys() and tied.metadata["tie_word_embeddings"] == "true"
    assert "lm_head" in untied.keys() and "tie_word_embeddings" not in untied.metadata
    head_bytes = 300 * 64 * 4
    assert untied.size - tied.size >= head_bytes
    for key in ("embed_tokens", "selected_token_ids", "d2t", "t2d"):
        assert torch.equal(tied.tensor(key), untied.tensor(key)), key


def test_the_readers_return_the_untied_tensors(caches):
    assert read_side_file(str(Path(caches["tied"]) / SIDE_FILE)).keys() == _side(caches["untied"]).keys()
    for key, value in read_side_file(str(Path(caches["untied"]) / SIDE_FILE)).items():
        assert torch.equal(read_side_file(str(Path(caches["tied"]) / SIDE_FILE))[key], value), key
    tied_head, untied_head = TargetHead.from_cache(caches["tied"]), TargetHead.from_cache(caches["untied"])
    assert torch.equal(tied_head.weight, untied_head.weight)
    assert torch.equal(tied_head.selected_token_ids, untied_head.selected_token_ids)
    drafts = []
    for name in ("tied", "untied"):
        torch.manual_seed(0)
        drafts.append(draft_for_cache(caches[name])[0].state_dict())
    assert drafts[0].keys() == drafts[1].keys()
    assert all(torch.equal(value, drafts[1][key]) for key, value in drafts[0].items())
    tied_ds, untied_ds = Eagle3CacheDataset(caches["tied"]), Eagle3CacheDataset(caches["untied"])
    for i in range(len(tied_ds)):
        assert all(torch.equal(v, untied_ds[i][k]) for k, v in tied_ds[i].items())


def _tensors(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.suffix == ".safetensors":
            out[str(path.relative_to(root))] = load_file(path)
        elif path.suffix == ".pt":
            out[str(path.relative_to(root))] = torch.load(path, weights_only=True)
    return out


@pytest.mark.parametrize("to", ["nemo-eagle3", "specforge"])
def test_exports_of_the_tied_cache_equal_the_untied(caches, tmp_path, to):
    exported = []
    for name in ("tied", "untied"):
        assert main(["export", "--to", to, caches[name], str(tmp_path / name)]) == 0
        exported.append(_tensors(tmp_path / name))
    assert exported[0].keys() == exported[1].keys() and exported[0]
    for file, tensors in exported[0].items():
        other = exported[1][file]
        assert tensors.keys() == other.keys(), file
        assert all(torch.equal(v, other[k]) for k, v in tensors.items()), file
    if to == "nemo-eagle3":  # the embedding the NeMo reader initialises its draft from
        with safe_open(str(tmp_path / "tied" / "target_embeddings.safetensors"), "pt") as f:
            assert f.get_tensor("weight").shape == (1024, 64)


def test_verify_inspect_audit_and_estimate_of_a_tied_cache(caches, capsys):
    cache = caches["tied"]
    assert main(["verify", cache]) == 0
    assert main(["inspect", cache]) == 0
    assert main(["audit", cache, "--samples", "2"]) == 0, capsys.readouterr()
    args = build_parser().parse_args(["estimate", "--model", caches["tied-model"], *ARGS])
    est = estimate_cache(PrecomputeConfig.from_args(args))
    assert est["side_file_bytes"] == Path(cache, SIDE_FILE).stat().st_size


# The layer methods' side file holds the whole head: stored once for a tied target too.
LAYERS_ARGS = ["--method", "dspark", *ARGS[: ARGS.index("--draft-vocab-size")], *ARGS[-6:]]


@pytest.fixture(scope="module")
def layer_caches(caches, tmp_path_factory):
    base = tmp_path_factory.mktemp("tied-layers")
    out = {}
    for name in ("tied", "untied"):
        out[name] = str(base / name)
        assert (
            main(["precompute", "--model", caches[f"{name}-model"], "--out", out[name], *LAYERS_ARGS, "--quiet"]) == 0
        )
    return out


def test_a_tied_target_stores_its_layers_side_file_head_once(caches, layer_caches, tmp_path):
    tied, untied = (ShardFile(str(Path(layer_caches[n]) / LAYERS_SIDE)) for n in ("tied", "untied"))
    assert "lm_head" not in tied.keys() and tied.metadata["tie_word_embeddings"] == "true"
    assert "lm_head" in untied.keys() and "tie_word_embeddings" not in untied.metadata
    assert untied.size - tied.size >= 1024 * 64 * 4
    got, want = (read_side_file(str(Path(layer_caches[n]) / LAYERS_SIDE)) for n in ("tied", "untied"))
    assert got.keys() == want.keys() == {"embed_tokens", "lm_head"}
    assert all(torch.equal(got[k], want[k]) for k in want)
    exported = []
    for name in ("tied", "untied"):
        assert main(["export", "--to", "nemo-dspark", layer_caches[name], str(tmp_path / name)]) == 0
        exported.append(_tensors(tmp_path / name))
    assert exported[0].keys() == exported[1].keys() and exported[0]
    for file, tensors in exported[0].items():
        assert all(torch.equal(v, exported[1][file][k]) for k, v in tensors.items()), file
    assert main(["verify", layer_caches["tied"]]) == 0
    args = build_parser().parse_args(["estimate", "--model", caches["tied-model"], *LAYERS_ARGS])
    est = estimate_cache(PrecomputeConfig.from_args(args))
    assert est["side_file_bytes"] == Path(layer_caches["tied"], LAYERS_SIDE).stat().st_size
