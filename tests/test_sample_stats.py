"""Per-sample statistics stored with each shard equal the values recomputed from the stored tensors."""

from __future__ import annotations

import json

import pytest
import torch

from speccache.cli import main
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.format import NativeShard, load_manifest_json, manifest_path, shard_path
from speccache.format.shard import sample_stats
from speccache.read import CacheDataset
from speccache.read.stats import cache_sample_stats, histogram

DATA = demo_data_path("sharegpt")
COMMON = ["--data", DATA, "--limit", "6", "--max-length", "96", "--model-dtype", "fp32", "--dtype", "fp32",
          "--batch-size", "2", "--shard-size", "4", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    base = tmp_path_factory.mktemp("stats")
    model = build_tiny_model_dir(str(base / "model"), "llama", seed=0)
    out = {}
    for name, extra in {"probs": ["--supervision", "probs"], "hidden": []}.items():
        out[name] = str(base / name)
        assert main(["precompute", "--model", model, "--out", out[name], *COMMON, *extra]) == 0
    mp.undo()
    return out


def test_statistics_equal_values_recomputed_from_stored_tensors(caches):
    stats = cache_sample_stats(caches["probs"])
    samples = CacheDataset(caches["probs"])
    assert set(stats) == {"tokens", "supervised_tokens", "mean_entropy", "mean_top1"}
    assert len(stats["tokens"]) == len(samples) == 6
    for i in range(len(samples)):
        s = samples[i]
        assert stats["tokens"][i] == s["input_ids"].numel()
        assert stats["supervised_tokens"][i] == int(s["loss_mask"].sum())
        # row t is the target's distribution for token t + 1: it counts when token t + 1 is supervised
        predicts = torch.zeros_like(s["loss_mask"])
        predicts[:-1] = s["loss_mask"][1:]
        probs = s["target_probs"][predicts].double()  # full vocabulary: the stored probs are the target's
        entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean()
        assert stats["mean_entropy"][i] == pytest.approx(float(entropy), rel=1e-5)
        assert stats["mean_top1"][i] == pytest.approx(float(probs.max(-1).values.mean()), rel=1e-5)


def test_logit_statistics_only_where_the_logits_are_at_hand(caches):
    stats = cache_sample_stats(caches["hidden"])
    assert set(stats) == {"tokens", "supervised_tokens"}
    samples = CacheDataset(caches["hidden"])
    assert stats["supervised_tokens"] == [int(samples[i]["loss_mask"].sum()) for i in range(len(samples))]
    # stored with the shard, one list per shard, in the shard's sample order
    shard = NativeShard(shard_path(caches["hidden"], 1), samples.manifest.schema, 1, 2)
    assert shard.sample_stats()["tokens"] == stats["tokens"][4:]
    shard.close()


def test_sample_stats_units():
    rows = {
        "__lengths__": torch.tensor([2, 1]),
        "loss_mask": torch.tensor([True, False, False]),
        "__stat__.x": torch.tensor([0.5, float("nan")]),
        "__stat__.n": torch.tensor([3, 4]),
    }
    assert sample_stats(rows) == {"tokens": [2, 1], "x": [0.5, None], "n": [3, 4]}
    assert sample_stats({"__lengths__": torch.tensor([2])}) == {}  # no producer statistics: no metadata
    lines = histogram([1, 2, 2, 3, None], bins=2, width=4)
    assert lines[0].split()[-2:] == ["1", "##"] and lines[1].split()[-2:] == ["3", "####"]
    assert lines[-1].endswith("1")


def test_inspect_stats(caches, capsys):
    assert main(["inspect", caches["probs"], "--stats"]) == 0
    out = capsys.readouterr().out
    assert "stats      mean_entropy: 6 samples" in out and "supervised_tokens" in out and "#" in out
    assert main(["inspect", caches["probs"], "--stats", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sample_stats"] == cache_sample_stats(caches["probs"])
    assert load_manifest_json(manifest_path(caches["probs"]))["complete"]
