"""``precompute --draft-vocab-from TRAIN_CACHE``: a held-out cache whose draft vocabulary is the training cache's.

Counted over its own samples, an evaluation cache's draft vocabulary differs from the training cache's (and an
evaluation split cut from one cache leaks into it); with the flag it takes the training cache's ``d2t``/``t2d``,
its ``in_draft`` and ``target_probs`` use them, the manifest records the source, a resume completes it, and a
cache of another target is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.format import Manifest, shard_path
from speccache.methods.eagle3 import SIDE_FILE, Eagle3CacheDataset, read_side_file, row_position_mask

pytestmark = pytest.mark.usefixtures("offline_single_thread")

DATA = demo_data_path("sharegpt")
COMMON = ["--model-dtype", "fp32", "--dtype", "fp32", "--max-length", "64", "--quiet", "--batch-size", "1",
          "--shard-size", "4", "--draft-vocab-size", "200"]  # fmt: skip
EVAL = ["--supervision", "probs"]


def _side(cache: str) -> dict[str, torch.Tensor]:
    return read_side_file(os.path.join(cache, SIDE_FILE))


@pytest.fixture(scope="module")
def caches(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("vocab-from")
    rows = Path(DATA).read_text(encoding="utf-8").splitlines(keepends=True)
    held_out = base / "held_out.jsonl"
    held_out.write_text("".join(rows[-10:]), encoding="utf-8")
    model = tiny_models("llama")
    out = {"model": model, "held_out": str(held_out), "base": base}
    for name, data, extra in (
        ("train", DATA, ["--limit", "24"]),
        ("counted", str(held_out), EVAL),
        ("eval", str(held_out), [*EVAL, "--draft-vocab-from", str(base / "train")]),
    ):
        out[name] = str(base / name)
        assert main(["precompute", "--model", model, "--data", data, "--out", out[name], *COMMON, *extra]) == 0
    return out


def test_the_eval_cache_takes_the_training_caches_vocabulary(caches):
    train, evaluation = _side(caches["train"]), _side(caches["eval"])
    for key in ("selected_token_ids", "d2t", "t2d"):
        assert torch.equal(evaluation[key], train[key]), key
    assert not torch.equal(_side(caches["counted"])["t2d"], train["t2d"]), "counting its own data gives another"
    config = Manifest.read(caches["eval"]).config
    assert config["draft_vocab_size"] == 200
    assert config["draft_vocab_from"]["cache"] == os.path.abspath(caches["train"])


def test_in_draft_and_target_probs_use_the_borrowed_vocabulary(caches):
    selected, t2d = _side(caches["train"])["selected_token_ids"], _side(caches["train"])["t2d"]
    model = AutoModelForCausalLM.from_pretrained(caches["model"], dtype=torch.float32)
    ds = Eagle3CacheDataset(caches["eval"], keys=["input_ids", "target_probs", "loss_mask"])
    outside = 0
    for i in range(len(ds)):
        sample = ds[i]
        with torch.no_grad():
            logits = model(sample["input_ids"].long()[None]).logits[0]
        in_draft = t2d[logits.argmax(-1)]  # row t counts only where the target's argmax is a draft token
        assert torch.equal(sample["position_mask"], row_position_mask(sample["loss_mask"], in_draft))
        outside += int((~in_draft).sum())
        torch.testing.assert_close(sample["target_probs"], torch.softmax(logits[:, selected], -1))
    assert outside, "some argmax lies outside the draft vocabulary, so in_draft matters"


def test_a_resume_completes_the_eval_cache(caches):
    cache = caches["eval"]
    before = Eagle3CacheDataset(cache)
    want = [before[i] for i in range(len(before))]
    os.unlink(shard_path(cache, 1))
    argv = ["precompute", "--model", caches["model"], "--data", caches["held_out"], "--out", cache, *COMMON, *EVAL]
    assert main([*argv, "--draft-vocab-from", caches["train"], "--resume"]) == 0
    after = Eagle3CacheDataset(cache)
    for i, sample in enumerate(want):
        assert all(torch.equal(v, after[i][k]) for k, v in sample.items()), i
    # another vocabulary source (the counted cache) is a different configuration: refused
    assert main([*argv, "--draft-vocab-from", caches["counted"], "--resume"]) == 1


def test_a_cache_of_another_target_is_refused_naming_both(caches, tiny_models, capsys):
    other = str(caches["base"] / "other")
    args = ["--data", caches["held_out"], *COMMON, "--limit", "4"]
    assert main(["precompute", "--model", tiny_models("qwen2"), "--out", other, *args]) == 0
    out = str(caches["base"] / "refused")
    assert main(["precompute", "--model", caches["model"], "--out", out, *args, "--draft-vocab-from", other]) == 1
    err = capsys.readouterr().err
    assert f"--draft-vocab-from {other} was written from another target than --model {caches['model']}" in err
    assert "model_config_hash" in err and not os.path.exists(out)


def test_the_flag_is_refused_where_it_cannot_apply(caches, capsys):
    args = ["precompute", "--model", caches["model"], "--data", caches["held_out"], *COMMON]
    out = str(caches["base"] / "never")
    assert main([*args, "--out", out, "--method", "dspark", "--draft-vocab-from", caches["train"]]) == 2
    assert "as is --draft-vocab-from" in capsys.readouterr().err
    bad = [*args, "--out", out, "--draft-vocab-from", caches["train"], "--draft-vocab-size", "300"]
    assert main(bad) == 2
    assert f"--draft-vocab-size 300 differs from --draft-vocab-from {caches['train']}'s 200" in capsys.readouterr().err
    assert not os.path.exists(out)
