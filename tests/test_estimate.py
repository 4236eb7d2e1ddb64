"""``speccache estimate`` agrees with ``speccache precompute``: the same flags, the bytes the run writes (shards and
side files) within 3%, and the same rows skipped for the same reasons, named by file:line."""

from __future__ import annotations

import json
import os
import random

import pytest

from speccache.cli import build_parser, main
from speccache.demo import demo_data_path, ensure_demo_target
from speccache.format import load_manifest_json, manifest_path
from support.cachecmp import written_bytes

pytestmark = pytest.mark.usefixtures("offline_single_thread")

# precompute's flags that estimate does not take, each because it changes how a run computes or where it writes,
# never the bytes of the cache. A new precompute flag fails test_estimate_takes_every_flag_that_changes_the_bytes
# until it is added to the shared flags (add_precompute_arguments) or here.
RUN_ONLY = {
    "--out",  # where, not what
    "--resume",  # finishes the same cache
    "--append",  # adds another data file's rows: estimate that file on its own
    "--device",
    "--threads",
    "--timeout",
    "--shard-target",  # how the target is spread over ranks; the shards are those of one rank
    "--tp-size",
    "--nonfinite",  # a skipped sample keeps its slot, cleared to zeros of the same size
    "--engine",  # the engine computes the states the method asks for, stored the same way
    "--tensor-parallel-size",
    "--enable-expert-parallel",
    "--gpu-memory-utilization",
    "--max-cache-bytes",  # pauses the run; the cache is the same
    "--max-cache-shards",
    "--quiet",
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {o for a in sub.choices[command]._actions for o in a.option_strings if o.startswith("--")}


def test_estimate_takes_every_flag_that_changes_the_bytes():
    precompute, estimate = _options("precompute"), _options("estimate")
    assert precompute - estimate == RUN_ONLY
    assert estimate - precompute == {"--json"}


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def _tool_row(city: str) -> dict:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return {
        "messages": [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "Let me look it up.", "tool_calls": [call]},
            {"role": "tool", "content": json.dumps({"city": city, "celsius": 21})},
            {"role": "assistant", "content": f"It is 21 degrees in {city}."},
        ],
        "tools": TOOLS,
    }


def write_rows(path, rows: list) -> str:
    """One line per row; a str row is written as it is (a malformed line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def run_both(argv: list[str], out: str, capsys) -> tuple[dict, str, int]:
    """``estimate --json`` and ``estimate`` (text) with ``argv``, then ``precompute`` with the same ``argv``: the
    estimate, its text report, and the bytes the run wrote."""
    assert main(["estimate", *argv, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main(["estimate", *argv]) == 0
    text = capsys.readouterr().out
    assert main(["precompute", *argv, "--out", out, "--device", "cpu", "--quiet"]) == 0
    return est, text, written_bytes(out)


def assert_same_rows(est: dict, cache: str) -> None:
    """The samples, tokens and skipped rows (per reason, and each row with its reason and detail) of the run."""
    manifest = load_manifest_json(manifest_path(cache))
    stats = manifest["stats"]
    assert (est["samples"], est["tokens"]) == (manifest["num_samples"], manifest["num_tokens"])
    assert est["data_stats"]["skipped"] == stats["skipped_rows"]
    assert est["data_stats"]["rows_read"] == stats["rows_read"]
    assert est["data_stats"]["rows_truncated"] == stats["rows_truncated"]
    listed = os.path.join(cache, "skipped_rows.jsonl")
    written = [json.loads(line) for line in open(listed)] if os.path.exists(listed) else []
    assert [{k: r[k] for k in ("row", "reason", "detail")} for r in est["skipped_rows"]] == [
        {k: r[k] for k in ("row", "reason", "detail")} for r in written
    ]
    assert est["data_stats"]["dropped"] == stats.get("dropped_fields", {})
    assert sorted(est["side_files"]) == sorted(manifest["side_files"])
    for name, size in est["side_files"].items():
        assert size == manifest["side_files"][name]["bytes"], name


# --- the demo target (tiny Llama): every encoding, --model-dtype, skipped rows ----------------------------------


@pytest.fixture(scope="module")
def demo_target() -> str:
    return ensure_demo_target()


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> str:
    """Eight demo conversations, a row with no assistant turn, one whose answer lies beyond --max-length 128 and a
    malformed line."""
    rows = [json.loads(line) for line in open(demo_data_path("openai"))][:8]
    rows[2:2] = [{"messages": [{"role": "user", "content": "hello?"}]}]
    rows[5:5] = [_chat(_words(300, 1), "Greek letters."), '{"messages": [']
    return write_rows(tmp_path_factory.mktemp("demo-data") / "rows.jsonl", rows)


DEMO_ARGS = ["--max-length", "128", "--shard-size", "4", "--batch-size", "2", "--skip-bad-rows", "--num-proc", "1"]


@pytest.mark.parametrize(
    "encode, model_dtype, extra",
    [
        ("", "fp32", []),
        ("aux_hidden_states=fp8,last_hidden_state=fp8", "bf16", ["--draft-vocab-size", "512"]),
        ("aux_hidden_states=fp8", "auto", ["--expand-turns", "--supervision", "topk:4", "--dtype", "fp16"]),
    ],
)
def test_estimate_is_within_3_percent_of_the_demo_run(
    demo_target, demo_data, tmp_path, capsys, encode, model_dtype, extra
):
    argv = ["--model", demo_target, "--data", demo_data, *DEMO_ARGS, "--encode", encode, "--model-dtype", model_dtype,
            *extra]  # fmt: skip
    est, text, written = run_both(argv, str(tmp_path / "cache"), capsys)
    assert est["exact"] and est["total_bytes_low"] == est["total_bytes_high"]
    assert abs(est["total_bytes_low"] - written) <= 0.03 * written
    # in fact exact but for the digits of measured floats in the shard headers, a few bytes per sample
    assert abs(est["total_bytes_low"] - written) <= 8 * est["samples"]
    assert est["weight_dtype"] == {"fp32": "float32", "bf16": "bfloat16", "auto": "float32"}[model_dtype]
    assert_same_rows(est, str(tmp_path / "cache"))
    assert est["data_stats"]["skipped"] == {
        "malformed": 1,
        "no_assistant_token": 1,
        "no_assistant_within_max_length": 1,
    }
    assert f"skipped    malformed 1: {demo_data}:7\n" in text
    assert f"skipped    no_assistant_token 1: {demo_data}:3\n" in text
    assert f"skipped    no_assistant_within_max_length 1: {demo_data}:6\n" in text
    assert "rows       11 read: " in text and "3 skipped (precompute lists them in skipped_rows.jsonl)" in text


def test_zbf16_estimate_is_a_labelled_bound_around_the_run(demo_target, demo_data, tmp_path, capsys):
    encode = "aux_hidden_states=zbf16,last_hidden_state=zbf16"
    argv = ["--model", demo_target, "--data", demo_data, *DEMO_ARGS, "--encode", encode]
    est, text, written = run_both(argv, str(tmp_path / "cache"), capsys)
    assert not est["exact"] and est["total_bytes_low"] < written < est["total_bytes_high"]
    assert [k for k, v in est["keys"].items() if not v["exact"]] == ["aux_hidden_states", "last_hidden_state"]
    assert "total      " in text and ": a bound, not a prediction: a zbf16 key's size depends on its values" in text
    assert text.count("(a bound)") == 2
    assert_same_rows(est, str(tmp_path / "cache"))


def test_model_dtype_changes_the_estimated_side_file(demo_target, capsys):
    sizes = {}
    for dtype in ("fp32", "bf16"):
        argv = ["--model", demo_target, "--data", demo_data_path(), "--limit", "2", "--max-length", "64"]
        assert main(["estimate", *argv, "--model-dtype", dtype, "--json"]) == 0
        sizes[dtype] = json.loads(capsys.readouterr().out)["side_file_bytes"]
    # the demo target's embeddings and LM head (1024 x 64 each) in 4 bytes, then 2 (the headers differ a little)
    assert abs(sizes["fp32"] - sizes["bf16"] - 2 * 1024 * 64 * 2) <= 64


def test_many_skipped_rows_are_listed_up_to_ten_per_reason(demo_target, tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(12)]
    data = write_rows(tmp_path / "rows.jsonl", [*rows, _chat("Hi.", "Hello.")])
    assert main(["estimate", "--model", demo_target, "--data", data, "--max-length", "64"]) == 0
    text = capsys.readouterr().out
    line = next(li for li in text.splitlines() if li.startswith("skipped    no_assistant_token 12: "))
    assert line.endswith(f"{data}:10, ... (12 in all; --json lists every row)") and f"{data}:11" not in line


def test_skipped_rows_of_a_json_list_are_named_by_index(demo_target, tmp_path, capsys):
    data = tmp_path / "rows.json"
    data.write_text(json.dumps([_chat("Hi.", "Hello."), {"messages": [{"role": "user", "content": "hi"}]}]))
    assert main(["estimate", "--model", demo_target, "--data", str(data), "--max-length", "64"]) == 0
    assert f"\nskipped    no_assistant_token 1: {data}[1]\n" in capsys.readouterr().out


def test_every_count_of_the_data_stats_is_reported(demo_target, monkeypatch, capsys):
    """A count the data statistics gain shows in both reports unasked."""
    import dataclasses

    from speccache.data import chat

    @dataclasses.dataclass
    class MoreStats(chat.DataStats):
        renamed: dict[str, int] = dataclasses.field(default_factory=lambda: {"human": 2, "gpt": 1})

    monkeypatch.setattr(chat, "DataStats", MoreStats)
    argv = ["estimate", "--model", demo_target, "--data", demo_data_path(), "--limit", "2", "--max-length", "64"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data_stats"]["renamed"] == {"gpt": 1, "human": 2}
    assert main(argv) == 0
    assert "\nrenamed    gpt 1, human 2\n" in capsys.readouterr().out


# --- the real target (SmolLM2-135M-Instruct): tool calls, a long row, a row too long, bf16 and fp32 -----------------


@pytest.fixture(scope="module")
def real_data(tmp_path_factory) -> str:
    """Tool-call rows, a row of about 3,700 tokens, one whose answer lies beyond --max-length 4096, a row with no
    assistant turn and a malformed line."""
    rows = [
        _chat("What is 2 + 2?", "4."),
        _tool_row("Paris"),
        {"messages": [{"role": "user", "content": "hi"}]},
        _chat("Summarize: " + _words(2720, 2), "A list of Greek letters."),
        _chat("Summarize: " + _words(3400, 3), "Greek letters."),
        _tool_row("Oslo"),
        "{not json",
        _chat("Name a colour.", "Blue."),
    ]
    return write_rows(tmp_path_factory.mktemp("real-data") / "rows.jsonl", rows)


@pytest.mark.slow
def test_real_target_long_and_tool_rows_fp32(real_model, real_data, tmp_path, capsys):
    argv = ["--model", real_model, "--data", real_data, "--max-length", "4096", "--batch-size", "1",
            "--skip-bad-rows", "--num-proc", "1", "--model-dtype", "fp32"]  # fmt: skip
    est, text, written = run_both(argv, str(tmp_path / "cache"), capsys)
    assert abs(est["total_bytes_low"] - written) <= 0.03 * written
    assert abs(est["total_bytes_low"] - written) <= 8 * est["samples"]
    assert_same_rows(est, str(tmp_path / "cache"))
    assert 3600 <= est["longest_sample"] <= 4096 and est["samples"] == 5
    assert est["data_stats"]["skipped"] == {
        "malformed": 1,
        "no_assistant_token": 1,
        "no_assistant_within_max_length": 1,
    }
    assert f"skipped    no_assistant_within_max_length 1: {real_data}:5\n" in text
    # SmolLM2's ChatML template renders neither tool calls nor tools: estimate says so as precompute does
    assert est["data_stats"]["dropped"]["tool_calls"] >= 1 and "dropped_fields.jsonl" in est["side_files"]
    assert "\ndropped    the chat template drops what rows carry" in text
    assert "(weights in float32, --model-dtype fp32)" in text


def test_real_target_tool_rows_bf16_fp8(real_model, real_data, tmp_path, capsys):
    argv = ["--model", real_model, "--data", real_data, "--max-length", "256", "--limit", "3", "--skip-bad-rows",
            "--num-proc", "1", "--model-dtype", "bf16", "--encode", "aux_hidden_states=fp8"]  # fmt: skip
    est, _, written = run_both(argv, str(tmp_path / "cache"), capsys)
    assert abs(est["total_bytes_low"] - written) <= 0.03 * written
    assert_same_rows(est, str(tmp_path / "cache"))
    # the user's report: an estimate that took the checkpoint's fp32 for the side file was 1.7x the bf16 run
    assert est["weight_dtype"] == "bfloat16" and est["side_file_bytes"] < 0.6 * 4 * 49152 * 576
