"""make acceptance's parts: the bundled prompt set (speccache.demo.prompts) and the training recipe (the
learning-rate schedule, length-grouped batches, the weighting of training-time-test steps, the train flags)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.demo.prompts import prompt_rows, write_prompts
from speccache.methods.eagle3 import build_eagle3_dataloader
from speccache.train.draft import draft_record
from speccache.train.trainer import LengthGroupedSampler, draft_for_cache, draft_loss, lr_factor


def _first_turn(row: dict) -> str:
    return row["messages"][0]["content"]


def test_prompt_set_is_large_varied_and_split_by_a_stable_hash():
    train, held_out = prompt_rows("train"), prompt_rows("eval")
    assert len(train) >= 1000 and 0.05 < len(held_out) / (len(train) + len(held_out)) < 0.15
    firsts = [_first_turn(r) for r in train + held_out]
    assert len(set(firsts)) == len(firsts)  # no request is asked twice, in one split or across both
    openings = {" ".join(text.split()[:2]) for text in firsts}
    assert len(openings) > 150
    assert sum(len(r["messages"]) > 2 for r in train) > len(train) // 5  # follow-up turns
    assert prompt_rows("train") == train and prompt_rows("eval") == held_out  # the same rows, in the same order


def test_prompt_rows_are_user_turns_each_followed_by_an_empty_assistant_turn():
    for row in prompt_rows("train") + prompt_rows("eval"):
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        assert all(m["content"] == "" for m in messages[1::2])
        assert all(m["content"].strip() for m in messages[0::2])


def test_write_prompts_writes_the_split_as_json_lines(tmp_path):
    path = tmp_path / "held_out.jsonl"
    assert write_prompts(str(path), "eval", limit=5) == 5
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == prompt_rows("eval")[:5]


def test_unknown_split_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown prompt split 'test'"):
        prompt_rows("test")


# --- the training recipe (speccache.train.trainer) ---------------------------------------------------------------

COMMON = ["--model-dtype", "fp32", "--dtype", "fp32", "--max-length", "128", "--quiet", "--draft-vocab-size", "300"]


@pytest.fixture(scope="module")
def cache(tiny_models, tmp_path_factory, offline_single_thread):
    """An EAGLE-3 cache of the first 40 demo rows from the tiny llama target."""
    out = str(tmp_path_factory.mktemp("recipe") / "cache")
    args = ["--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--out", out, "--limit", "40"]
    assert main(["precompute", *args, *COMMON, "--shard-size", "16", "--batch-size", "8"]) == 0
    return out


def test_learning_rate_warms_up_then_decays_to_zero_on_a_cosine():
    total, warmup = 100, 0.1
    factors = [lr_factor(step, total, warmup) for step in range(total)]
    assert factors[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))  # never rises after the warm-up
    assert factors[55] == pytest.approx(0.5, abs=0.02) and factors[-1] < 0.001
    assert lr_factor(0, 10, 0.0) == 1.0  # no warm-up: the first step runs at the full rate


class _Shuffled:
    """A stand-in for the reader's epoch order: a seeded permutation per epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())


def _padded_tokens(order: list[int], lengths: list[int], batch: int) -> int:
    return sum(
        max(lengths[i] for i in order[s : s + batch]) * len(order[s : s + batch]) for s in range(0, len(order), batch)
    )


def test_length_grouped_batches_hold_every_sample_once_with_little_padding():
    lengths = torch.randint(10, 1000, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    base = _Shuffled(len(lengths))
    sampler = LengthGroupedSampler(base, lengths, batch_size=8, seed=3)
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(len(lengths))) and len(sampler) == len(lengths)
        base.set_epoch(epoch)
        assert _padded_tokens(order, lengths, 8) < 0.7 * _padded_tokens(list(base), lengths, 8)
        sampler.set_epoch(epoch)
        assert list(sampler) == order  # the same epoch, the same order
        orders.append(order)
    assert orders[0] != orders[1]


def test_step_decay_weights_later_steps_less(cache):
    torch.manual_seed(0)
    draft, head = draft_for_cache(cache)
    batch = next(iter(build_eagle3_dataloader(cache, batch_size=4, shuffle=False)))
    with torch.no_grad():
        first = draft_loss(draft, batch, head, 1)
        plain, decayed = (draft_loss(draft, batch, head, 3, step_decay=d) for d in (1.0, 0.5))
        only_first = draft_loss(draft, batch, head, 3, step_decay=1e-9)
    assert only_first == pytest.approx(float(first), rel=1e-5)  # a vanishing ratio leaves step 0 alone
    assert float(decayed) != pytest.approx(float(plain))


def test_supervise_all_grades_every_row_whatever_the_loss_mask(cache):
    torch.manual_seed(0)
    draft, head = draft_for_cache(cache)
    batch = next(iter(build_eagle3_dataloader(cache, batch_size=4, shuffle=False)))
    unmasked = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    with torch.no_grad():
        generated, every = (draft_loss(draft, batch, head, 2, supervise=s) for s in ("generated", "all"))
        assert float(draft_loss(draft, unmasked, head, 2)) == 0.0  # nothing generated: nothing graded
        assert float(draft_loss(draft, unmasked, head, 2, supervise="all")) == pytest.approx(float(every), rel=1e-6)
    assert float(every) != pytest.approx(float(generated))


def test_train_cli_takes_the_recipe_flags_and_records_them(cache, tmp_path, capsys):
    out = str(tmp_path / "draft")
    argv = ["train", cache, "--out", out, "--epochs", "2", "--ttt-steps", "2", "--warmup", "0.2"]
    argv += ["--compute-dtype", "bfloat16"]  # torch's name is taken, the short one recorded
    assert main([*argv, "--step-decay", "0.8", "--intermediate-size", "24", "--lr", "3e-3", "--supervise", "all"]) == 0
    assert "loss" in capsys.readouterr().out
    record = draft_record(out)
    assert record["training"]["warmup"] == 0.2 and record["training"]["step_decay"] == 0.8
    assert record["training"]["supervise"] == "all" and record["training"]["compute_dtype"] == "bf16"
    assert record["training"]["steps"] == 2 * 5  # 40 samples in batches of 8, every sample once per epoch
    assert record["draft_config"]["intermediate_size"] == 24


def test_an_unknown_supervise_is_refused_by_name(cache, tmp_path, capsys):
    out = tmp_path / "draft"
    assert main(["train", cache, "--out", str(out), "--supervise", "prompts"]) != 0
    assert (
        "speccache train: error: --supervise 'prompts' is unknown; choose one of generated, all"
        in capsys.readouterr().err
    )
    assert not out.exists()


# --- benchmarks/acceptance.py: finished stages are skipped on a rerun -----------------------------------------------


def test_acceptance_stages_skip_what_finished_and_refuse_a_changed_command(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    acceptance = importlib.import_module("acceptance")
    ran = []

    def run(argv, env):  # stands in for the speccache subprocess: an unknown command fails
        ran.append(argv[3:])
        return subprocess.CompletedProcess(argv, 2 if argv[3] == "no-such-command" else 0)

    monkeypatch.setattr(acceptance.subprocess, "run", run)
    out = str(tmp_path / "regen")
    acceptance.Stages(str(tmp_path)).run("regen", ["regenerate", "--out", out], out, {})
    with pytest.raises(SystemExit, match="stage bad failed"):
        acceptance.Stages(str(tmp_path)).run("bad", ["no-such-command"], out, {})
    rerun = acceptance.Stages(str(tmp_path))
    assert set(rerun.done) == {"regen"}  # a failed stage is not recorded
    assert rerun.run("regen", ["regenerate", "--out", out], out, {}) == rerun.done["regen"]["seconds"]
    assert ran == [["regenerate", "--out", out], ["no-such-command"]]  # the finished stage did not run again
    with pytest.raises(SystemExit, match="stage regen .* ran another command"):
        rerun.run("regen", ["regenerate", "--out", out, "--max-new-tokens", "8"], out, {})
    os.makedirs(out)
    acceptance.Stages(str(tmp_path)).run("again", ["regenerate", "--out", out], out, {})
    assert ran[-1] == ["regenerate", "--out", out, "--resume"]  # an interrupted run's output is continued
