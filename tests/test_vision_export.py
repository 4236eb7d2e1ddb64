"""Exports of a vision-language target's cache (docs/vision.md "Exports"): speculators' layout holds its rows, read
back by speculators' own ``ArrowDataset`` as speccache reads them (image tokens included); the layouts whose
trainers have no vision-language path refuse it, naming why and what to use."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors import safe_open

from speccache.cli import main
from speccache.compat.speculators import speculators_hs_path
from speccache.demo.real_target import ensure_real_target
from speccache.format import load_manifest_json, manifest_path
from speccache.methods.layers import LayerFeatureDataset
from speccache.testing.vlm import ensure_vlm_target
from support.vision import write_image_data

pytestmark = pytest.mark.usefixtures("offline_single_thread")

AUX = [0, 1, 2]  # the tiny targets have 4 decoder layers
FLAGS = ["--dtype", "fp32", "--model-dtype", "fp32", "--batch-size", "2", "--shard-size", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def vlm_caches(offline_single_thread, tmp_path_factory) -> dict[str, str]:
    """A Qwen2.5-VL target's layers cache (aux layers and the last one before the norm) and EAGLE-3 cache of three
    rows, two with images."""
    rows = [(["a.png"], "What is red?", "A square."), ([], "Hello.", "Hi."), (["a.png", "b.png"], "Two?", "Yes.")]
    root = write_image_data(tmp_path_factory.mktemp("vision-export"), rows)
    model = ensure_vlm_target("qwen2_5_vl", ensure_real_target())
    argv = ["precompute", "--model", model, "--data", str(root / "data.jsonl"), *FLAGS, "--quiet"]
    out = {"layers": str(root / "layers"), "eagle3": str(root / "eagle3")}
    layers = ["--method", "layers", "--layers", ",".join(map(str, AUX)), "--last-prenorm"]
    assert main([*argv, "--out", out["layers"], *layers]) == 0
    assert main([*argv, "--out", out["eagle3"], "--aux-layers", ",".join(map(str, AUX))]) == 0
    return out


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None, reason="speculators is not installed")
def test_speculators_export_of_image_rows_is_read_by_speculators_as_speccache_reads_them(vlm_caches, tmp_path):
    from speculators.train.data import ArrowDataset

    cache, out = vlm_caches["layers"], tmp_path / "sp"
    assert main(["export", "--to", "speculators", "--layers", ",".join(map(str, AUX)), cache, str(out)]) == 0
    ours = LayerFeatureDataset(cache, {"aux": AUX, "pre": [3]}, prenorm=True)
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(ds) == 3
    manifest = load_manifest_json(manifest_path(cache))
    assert "vision" in manifest["config"] and "positions" in manifest["keys"]
    for i in range(3):
        got, want = ds[i], ours[i]
        assert got["input_ids"].tolist() == want["input_ids"].tolist()  # the image tokens included
        assert got["loss_mask"].tolist() == want["loss_mask"].long().tolist()
        assert torch.equal(got["hidden_states"], want["aux"])
        assert torch.equal(got["verifier_last_hidden_states"], want["pre"])
        # what its layout cannot hold (its trainer rotates by arange): the target's 3-D positions
        with safe_open(str(speculators_hs_path(str(out), i)), "pt") as f:
            assert sorted(f.keys()) == ["hidden_states", "token_ids"]


@pytest.mark.parametrize(("to", "why"), [("specforge", "SpecForge #678"), ("nemo-eagle3", "NeMo AutoModel")])
def test_layouts_without_a_vision_language_path_refuse_the_cache(to, why, vlm_caches, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "--to", to, vlm_caches["eagle3"], str(out)]) == 1
    err = capsys.readouterr().err
    assert "a vision-language target's cache" in err and why in err and "--to speculators" in err
    assert not out.exists()
