"""make acceptance's parts: the bundled prompt set (speccache.demo.prompts)."""

from __future__ import annotations

import json

import pytest

from speccache.demo.prompts import prompt_rows, write_prompts


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
