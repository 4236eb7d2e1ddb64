"""The non-finite guard: a target whose layers produce NaN on certain inputs is caught with --nonfinite fail and skip.

The NaN target is the tiny demo Llama with the embedding row of one token set
to +Inf: the first decoder layer's RMSNorm turns it into NaN at that token and
attention carries it to every later position, so exactly the samples that hold
the token have non-finite features. Samples without it have the clean target's
features (the row is never read), which the skip test checks tensor for tensor.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speccache.cli import main
from speccache.data import load_samples
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.errors import NonFiniteFeatureError
from speccache.format import load_manifest_json, manifest_path, shard_path
from speccache.methods.eagle3 import Supervision
from speccache.methods.eagle3_producer import Eagle3Target
from speccache.methods.finite import count_cleared, guard_nonfinite
from speccache.precompute._tokens import pad_tokens
from support.cachecmp import all_samples

DATA = demo_data_path("sharegpt")
LIMIT = 8
MAX_LENGTH = 96
COMMON = ["--data", DATA, "--limit", str(LIMIT), "--max-length", str(MAX_LENGTH), "--model-dtype", "fp32",
          "--dtype", "fp32", "--batch-size", "2", "--shard-size", "2", "--quiet"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(clean model dir, NaN model dir, the poisoned token, samples, which samples hold the token)."""
    base = tmp_path_factory.mktemp("nonfinite")
    clean = build_tiny_model_dir(str(base / "clean"), "llama", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(clean)
    samples, _ = load_samples(DATA, tokenizer, MAX_LENGTH, limit=LIMIT)
    holders = Counter(t for s in samples for t in set(s.input_ids))
    # a token held by some samples but not all, in more than one shard of 2
    token = min(t for t, n in holders.items() if 2 <= n <= LIMIT // 2)
    poisoned = [i for i, s in enumerate(samples) if token in s.input_ids]
    nan_dir = str(base / "nan")
    shutil.copytree(clean, nan_dir)
    model = AutoModelForCausalLM.from_pretrained(clean, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("inf")
    model.save_pretrained(nan_dir)
    return clean, nan_dir, token, samples, poisoned


def _precompute(model: str, out: str, *extra: str) -> int:
    return main(["precompute", "--model", model, "--out", out, *COMMON, *extra])


def test_fail_names_sample_row_key_and_layer(setup, tmp_path, capsys):
    _, nan_dir, _, samples, poisoned = setup
    out = str(tmp_path / "c")
    assert _precompute(nan_dir, out) == 1
    first = poisoned[0]
    message = capsys.readouterr().err
    assert f"sample {first} (data row {samples[first].source_row})" in message
    assert "aux_hidden_states" in message and "decoder layer 1 (aux layer 0 of 3)" in message
    assert "--nonfinite skip" in message
    assert not os.path.exists(shard_path(out, first // 2))  # nothing of the failing batch was written


def test_skip_clears_exactly_the_poisoned_samples_and_counts_them(setup, tmp_path):
    clean_dir, nan_dir, _, samples, poisoned = setup
    assert _precompute(clean_dir, str(tmp_path / "clean")) == 0
    assert _precompute(nan_dir, str(tmp_path / "skip"), "--nonfinite", "skip") == 0
    stats = load_manifest_json(manifest_path(str(tmp_path / "skip")))["stats"]
    assert stats["skipped_rows"]["nonfinite"] == len(poisoned)
    assert stats["samples"] == len(samples)  # every slot kept: shard i still holds samples [2i, 2i + 2)
    clean, skipped = all_samples(str(tmp_path / "clean")), all_samples(str(tmp_path / "skip"))
    for i, (a, b) in enumerate(zip(clean, skipped, strict=True)):
        assert torch.equal(a["input_ids"], b["input_ids"])
        if i in poisoned:
            assert not b["loss_mask"].any()
            assert not b["aux_hidden_states"].any() and not b["last_hidden_state"].any()
        else:
            assert all(torch.equal(a[k], b[k]) for k in a), i

    # A resume that recomputes some shards and keeps others (cleared samples among both) counts the same.
    out = str(tmp_path / "skip")
    for index in {poisoned[0] // 2, 0}:
        os.remove(shard_path(out, index))
    assert _precompute(nan_dir, out, "--nonfinite", "skip", "--resume") == 0
    assert load_manifest_json(manifest_path(out))["stats"]["skipped_rows"]["nonfinite"] == len(poisoned)
    assert all(all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(skipped, all_samples(out), strict=True))


def test_a_resume_may_turn_fail_into_skip_but_not_back(setup, tmp_path, capsys):
    _, nan_dir, _, _, poisoned = setup
    out = str(tmp_path / "c")
    assert _precompute(nan_dir, out) == 1  # stops at the first poisoned sample, leaving an unsealed cache
    assert _precompute(nan_dir, out, "--nonfinite", "skip", "--resume") == 0  # what the error advises
    manifest = load_manifest_json(manifest_path(out))
    assert manifest["config"]["nonfinite"] == "skip"
    assert manifest["stats"]["skipped_rows"]["nonfinite"] == len(poisoned)
    os.remove(shard_path(out, poisoned[0] // 2))
    before = open(manifest_path(out), "rb").read()
    capsys.readouterr()
    assert _precompute(nan_dir, out, "--resume") == 1  # would stop at the poisoned samples it recomputes
    assert "config.nonfinite: cache has 'skip', this run has 'fail'" in capsys.readouterr().err
    assert open(manifest_path(out), "rb").read() == before


def test_layer_named_for_a_mid_layer_and_guard_units(setup):
    """A hook makes decoder layer 4 (the mid aux layer) emit NaN on samples holding the token: the error names it."""
    clean_dir, _, token, samples, poisoned = setup
    model = AutoModelForCausalLM.from_pretrained(clean_dir, dtype=torch.float32)
    seen: dict[str, torch.Tensor] = {}
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: seen.update(ids=args[0]))

    def poison(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[(seen["ids"] == token).any(1)] = float("nan")

    model.model.layers[4].register_forward_hook(poison)
    items = [
        {"input_ids": torch.tensor(s.input_ids), "loss_mask": torch.tensor(s.loss_mask, dtype=torch.bool),
         "sample_index": torch.tensor(i), "source_row": torch.tensor(s.source_row)}
        for i, s in enumerate(samples)
    ]  # fmt: skip
    batch = pad_tokens(items)
    selected = torch.arange(model.config.vocab_size)
    target = Eagle3Target(model, [1, 4, 6], Supervision("hidden"), selected, torch.float32)
    with pytest.raises(NonFiniteFeatureError, match=rf"sample {poisoned[0]} .*decoder layer 4 \(aux layer 1 of 3\)"):
        target.compute_batch(batch)
    target.nonfinite = "skip"
    rows = target.compute_batch(batch)
    assert count_cleared(rows) == len(poisoned)
    assert all(torch.isfinite(rows[k]).all() for k in ("aux_hidden_states", "last_hidden_state"))


def test_guard_fixed_keys_inf_and_finite_batches():
    lengths = torch.tensor([2, 3])
    rows = {
        "__lengths__": lengths,
        "loss_mask": torch.ones(5, dtype=torch.bool),
        "input_ids": torch.arange(5),
        "feat": torch.ones(5, 4),
        "per_sample": torch.ones(2, 3),
        "source_row": torch.tensor([7, 9]),
    }
    assert guard_nonfinite(dict(rows), "fail", lambda k, c: "x") == 0
    rows["per_sample"][1, 2] = -float("inf")
    with pytest.raises(NonFiniteFeatureError, match=r"batch item 1: per_sample .* token 0, column 2, from L"):
        guard_nonfinite(rows, "fail", lambda k, c: "L")
    assert guard_nonfinite(rows, "skip", lambda k, c: "L") == 1
    assert rows["loss_mask"].tolist() == [True, True, False, False, False]
    assert rows["feat"][2:].eq(0).all() and rows["feat"][:2].eq(1).all() and rows["per_sample"][1].eq(0).all()
    assert rows["input_ids"].tolist() == [0, 1, 2, 3, 4] and rows["source_row"].tolist() == [7, 9]
    assert count_cleared(rows) == 1


def test_a_resume_counts_the_cleared_samples_of_shards_a_trainer_reclaimed(setup, tmp_path):
    from speccache.read import CacheDataset
    from speccache.read.follow import Follow

    _, nan_dir, _, _, poisoned = setup
    out = str(tmp_path / "skip")
    assert _precompute(nan_dir, out, "--nonfinite", "skip") == 0
    list(CacheDataset(out, follow=Follow(reclaim=True, poll=0.01, timeout=60)))  # every shard read, then deleted
    assert not any(os.path.exists(shard_path(out, i)) for i in range(LIMIT // 2))
    assert _precompute(nan_dir, out, "--nonfinite", "skip", "--resume") == 0
    manifest = load_manifest_json(manifest_path(out))
    assert manifest["stats"]["skipped_rows"]["nonfinite"] == len(poisoned)
    assert manifest["reclaimed"] == list(range(LIMIT // 2))
