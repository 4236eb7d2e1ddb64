"""Fields a row carries that its rendering lacks: found on real templates, counted, reported, and acted on by
``--on-dropped`` (warn, skip, fail) through ``speccache precompute``."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from speccache.cli import main
from speccache.data import ChatFormat, load_samples, merge_parts
from speccache.data._dropped import INLINE_REASONING, dropped_fields
from speccache.format import DROPPED_FIELDS_FILE, load_manifest_json, manifest_path
from test_chat_templates import (
    CALL,
    HARMONY_TOOLS_LIKE,
    LLAMA31_TOOLS_LIKE,
    MISTRAL_V3_LIKE,
    QWEN3_FIELD_LIKE,
    QWEN25_TOOLS_LIKE,
    R1_LIKE,
    TOOL_ROW,
    TOOLS,
    _apply,
    qwen3_tok,  # noqa: F401  (a fixture)
    tool_tok,  # noqa: F401  (a fixture)
)

pytestmark = pytest.mark.usefixtures("offline_single_thread")

# Qwen3's tool and reasoning rendering: Qwen2.5's tools, plus reasoning_content in <think> after the header.
QWEN3_TOOLS_LIKE = QWEN25_TOOLS_LIKE.replace(
    "{{- '<|im_start|>assistant' -}}{%- if m.content -%}",
    "{{- '<|im_start|>assistant' -}}{%- if m.reasoning_content is string -%}"
    "{{- '\\n<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n' -}}{%- endif -%}{%- if m.content -%}",
)
# arguments whose values a template escapes: quotes, a newline, non-ASCII, a number, a boolean, a nested list
ODD_CALL = {
    "type": "function",
    "id": "call00002",
    "function": {
        "name": "get_weather",
        "arguments": {"city": 'Zürich "old town"\nnorth', "days": 3, "metric": True, "spots": ["lake", "Üetliberg"]},
    },
}


def _tool_row(call: dict, **assistant) -> list[dict]:
    return [TOOL_ROW[0], {"role": "assistant", "content": "", "tool_calls": [call], **assistant}, *TOOL_ROW[2:]]


def _dropped(tokenizer, template: str, messages: list[dict], tools=None) -> list[tuple[int, str]]:
    """What load_samples reports dropped from the row, checked to be what apply_chat_template's text lacks."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "r.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"messages": messages, **({"tools": tools} if tools else {})}) + "\n")
        _, stats = load_samples(path, tokenizer, 8192, fmt=ChatFormat.for_tokenizer(tokenizer, template))
    found = [(d.message, d.field) for d in stats.dropped_rows]
    assert found == dropped_fields(messages, tools, tokenizer.decode(_apply(tokenizer, template, messages, tools)))
    assert stats.dropped == {name: 1 for _, name in found}
    return found


@pytest.mark.parametrize("call", [CALL, ODD_CALL], ids=["plain", "escaped"])
def test_templates_that_render_everything_report_nothing_dropped(qwen3_tok, tool_tok, call):  # noqa: F811
    thought = {"reasoning_content": "  I should look it up.\n"}  # Qwen3 strips the reasoning's newlines
    qwen3 = _tool_row(call, **thought) + [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "ok"}]
    assert _dropped(qwen3_tok, QWEN3_TOOLS_LIKE, qwen3, TOOLS) == []
    single = [TOOL_ROW[0], {"role": "assistant", "content": " Four. ", "reasoning_content": "\nTwo and two.\n"}]
    assert _dropped(qwen3_tok, QWEN3_FIELD_LIKE, single) == []
    assert _dropped(tool_tok, LLAMA31_TOOLS_LIKE, _tool_row(call), TOOLS) == []
    harmony = _tool_row(call, thinking="I should look it up.")
    assert _dropped(tool_tok, HARMONY_TOOLS_LIKE, harmony, TOOLS) == []
    # a tool result written through tojson (Mistral v0.3's [TOOL_RESULTS]) has its quotes escaped
    result = {**TOOL_ROW[2], "content": '{"sky": "sunny",\n "temp": 21}'}
    assert _dropped(tool_tok, MISTRAL_V3_LIKE, [*_tool_row(call)[:2], result, TOOL_ROW[3]], TOOLS) == []


def test_what_a_template_leaves_out_is_reported_per_message_and_field(qwen3_tok, tool_tok):  # noqa: F811
    # Qwen3 renders reasoning only after the last user turn: the first turn's is dropped, the last's is not.
    turns = [TOOL_ROW[0], {"role": "assistant", "content": "A.", "reasoning_content": "first thought"}]
    turns += [
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "B.", "reasoning_content": "second"},
    ]
    assert _dropped(qwen3_tok, QWEN3_FIELD_LIKE, turns) == [(1, "reasoning_content")]
    # Llama 3.1-like drops the system message; R1-like strips inline reasoning from every turn
    system = [{"role": "system", "content": "You are terse."}, *_tool_row(CALL)]
    assert _dropped(tool_tok, LLAMA31_TOOLS_LIKE, system, TOOLS) == [(0, "content")]
    inline = [TOOL_ROW[0], {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\nSunny."}]
    assert _dropped(tool_tok, R1_LIKE, inline) == [(1, INLINE_REASONING)]
    # a call rendered without its argument values is not rendered (a value the user's text holds would count as
    # rendered: the check is that each value appears somewhere)
    lyon = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}
    changed = QWEN25_TOOLS_LIKE.replace("(f.arguments | tojson)", "'{}'")
    assert _dropped(tool_tok, changed, _tool_row(lyon), TOOLS) == [(1, "tool_calls")]
    assert _dropped(tool_tok, QWEN25_TOOLS_LIKE, _tool_row(lyon), TOOLS) == []


# --- the real target's ChatML template (SmolLM2-135M-Instruct), which renders only role and content ------------


def _write_rows(tmp_path) -> str:
    rows = [
        {  # OpenAI's form: a null content beside the call, reasoning in its own field, the tool schemas
            "messages": [
                TOOL_ROW[0],
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                TOOL_ROW[2],
                {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": "The tool said so."},
            ],
            "tools": TOOLS,
        },
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]},
        {
            "messages": [
                {"role": "user", "content": "Count."},
                {"role": "assistant", "content": "1 2 3", "thinking": "x"},
            ]
        },
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _argv(real_model, data, out, *flags) -> list[str]:
    return ["precompute", "--model", real_model, "--data", data, "--out", str(out), "--max-length", "128",
            "--batch-size", "1", "--shard-size", "1", "--device", "cpu", "--model-dtype", "fp32", *flags]  # fmt: skip


def test_chatml_drops_are_counted_reported_and_recorded_by_precompute(real_model, tmp_path, capsys):
    data = _write_rows(tmp_path)
    out = tmp_path / "warn"
    assert main(_argv(real_model, data, out)) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    counts = "reasoning_content in 1 row, thinking in 1 row, tool_calls in 1 row, tools in 1 row"
    assert summary.startswith("speccache: 3 samples (0 rows skipped; the chat template drops") and counts in summary
    manifest = load_manifest_json(manifest_path(str(out)))
    assert manifest["stats"]["dropped_fields"] == {"reasoning_content": 1, "thinking": 1, "tool_calls": 1, "tools": 1}
    assert "on_dropped" not in manifest["config"] and DROPPED_FIELDS_FILE in manifest["side_files"]
    lines = [json.loads(line) for line in (out / DROPPED_FIELDS_FILE).read_text().splitlines()]
    assert [(d["where"], d["message"], d["field"]) for d in lines] == [
        (f"{data}:1", -1, "tools"), (f"{data}:1", 1, "tool_calls"), (f"{data}:1", 3, "reasoning_content"),
        (f"{data}:3", 1, "thinking"),
    ]  # fmt: skip
    assert {d["row"] for d in lines} == {0, 2} and {d["data"] for d in lines} == {data}
    assert main(["verify", str(out)]) == 0

    assert main(_argv(real_model, data, tmp_path / "fail", "--on-dropped", "fail")) == 1
    error = capsys.readouterr().err
    assert f"{data}:1: the chat template drops tools, messages[1].tool_calls, messages[3].reasoning_content" in error
    assert "--on-dropped fail" in error

    skip = tmp_path / "skip"
    assert main(_argv(real_model, data, skip, "--on-dropped", "skip")) == 0
    manifest = load_manifest_json(manifest_path(str(skip)))
    assert manifest["num_samples"] == 1 and manifest["stats"]["skipped_rows"] == {"dropped_fields": 2}
    assert manifest["config"]["on_dropped"] == "skip" and "dropped_fields" not in manifest["stats"]
    skipped = [json.loads(line) for line in (skip / "skipped_rows.jsonl").read_text().splitlines()]
    assert [(s["row"], s["reason"]) for s in skipped] == [(0, "dropped_fields"), (2, "dropped_fields")]
    assert not os.path.exists(skip / DROPPED_FIELDS_FILE)
    # --on-dropped changes what the cache holds: a resume under another mode is refused
    assert main([*_argv(real_model, data, skip, "--on-dropped", "warn"), "--resume"]) == 1


def test_dropped_counts_are_the_same_read_in_parts_and_with_workers(real_model, tmp_path):
    from speccache.data import chat_format, load_chat_tokenizer

    data = _write_rows(tmp_path)
    tok = load_chat_tokenizer(real_model)
    fmt = chat_format(tok)
    _, whole = load_samples(data, tok, 128, fmt=fmt)
    _, merged = merge_parts([load_samples(data, tok, 128, fmt=fmt, part=(r, 2)) for r in range(2)])
    _, pooled = load_samples(data, tok, 128, fmt=fmt, num_proc=2)
    assert (
        whole.dropped
        == merged.dropped
        == pooled.dropped
        == {"reasoning_content": 1, "thinking": 1, "tool_calls": 1, "tools": 1}
    )
    assert whole.dropped_rows == merged.dropped_rows == pooled.dropped_rows
    assert whole.dropped_rows_jsonl("d") == merged.dropped_rows_jsonl("d")


def test_every_row_error_names_its_cause_and_the_flag_that_skips(tool_tok, tmp_path):  # noqa: F811
    from speccache.data import ChatFormat
    from speccache.errors import DataError

    rows = {
        "{": "invalid JSON",
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}): "got NoneType",
        json.dumps({"messages": TOOL_ROW, "tools": TOOLS}): "'dict object' has no attribute 'nope'",
    }
    fmt = ChatFormat.for_tokenizer(tool_tok, QWEN25_TOOLS_LIKE.replace("f.name", "f.nope.name"))
    for line, cause in rows.items():
        (tmp_path / "r.jsonl").write_text(line + "\n")
        with pytest.raises(DataError) as failure:
            load_samples(str(tmp_path / "r.jsonl"), tool_tok, 256, fmt=fmt)
        assert cause in str(failure.value) and str(failure.value).count("--skip-bad-rows") == 1
        _, stats = load_samples(str(tmp_path / "r.jsonl"), tool_tok, 256, fmt=fmt, skip_bad_rows=True)
        assert stats.rows_skipped == 1 and cause in stats.skipped_rows[0].detail


def test_an_append_lists_its_dropped_fields_after_the_cache_s_once_even_when_killed_and_rerun(
    real_model, tmp_path, monkeypatch
):
    from speccache.methods import finite

    first = _write_rows(tmp_path)
    second = tmp_path / "e.jsonl"
    second.write_text(json.dumps({"messages": _tool_row(CALL)}) + "\n" + json.dumps({"messages": TOOL_ROW}) + "\n")
    out = tmp_path / "cache"
    assert main(_argv(real_model, first, out, "--quiet")) == 0
    real = finite.ClearedCounter.write_shard
    calls = []

    def dies_after_one(self, output_dir, index, rows):
        if calls:
            raise KeyboardInterrupt  # after the append rewrote the side files and one shard
        calls.append(index)
        return real(self, output_dir, index, rows)

    monkeypatch.setattr(finite.ClearedCounter, "write_shard", dies_after_one)
    assert main(_argv(real_model, str(second), out, "--quiet", "--append")) == 130  # Ctrl-C's exit code
    monkeypatch.setattr(finite.ClearedCounter, "write_shard", real)
    assert main(_argv(real_model, str(second), out, "--quiet", "--append")) == 0
    lines = [json.loads(line) for line in (out / DROPPED_FIELDS_FILE).read_text().splitlines()]
    assert [(d["data"], d["row"], d["field"]) for d in lines] == [
        (first, 0, "tools"), (first, 0, "tool_calls"), (first, 0, "reasoning_content"), (first, 2, "thinking"),
        (str(second), 0, "tool_calls"), (str(second), 1, "thinking"), (str(second), 1, "tool_calls"),
    ]  # fmt: skip
    stats = load_manifest_json(manifest_path(str(out)))["stats"]
    assert stats["dropped_fields"] == {"reasoning_content": 1, "thinking": 2, "tool_calls": 3, "tools": 1}
    assert main(["verify", str(out)]) == 0


def test_a_mistral_common_target_reports_only_what_mistral_common_leaves_out(tmp_path):
    mistral_common = pytest.importorskip("mistral_common")
    from transformers.tokenization_mistral_common import MistralCommonBackend

    from speccache.data import chat_format
    from test_chat_templates import MISTRAL_V3_MODEL, ROWS

    backend = MistralCommonBackend(os.path.join(os.path.dirname(mistral_common.__file__), "data", MISTRAL_V3_MODEL))
    odd = {**ODD_CALL, "id": "abcdefghi", "function": {**ODD_CALL["function"], "arguments": {"city": 'Zürich "x"'}}}
    result = {"role": "tool", "tool_call_id": "abcdefghi", "content": '{"sky": "sunny"}'}
    rows = [
        {"messages": TOOL_ROW, "tools": TOOLS},  # its assistant's "thinking" is not a field mistral-common reads
        {"messages": ROWS["system_prompt"]},
        {"messages": [TOOL_ROW[0], {"role": "assistant", "tool_calls": [odd]}, result, TOOL_ROW[3]], "tools": TOOLS},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, stats = load_samples(str(path), backend, 4096, fmt=chat_format(backend))
    assert len(samples) == 3 and [(d.row, d.message, d.field) for d in stats.dropped_rows] == [(0, 1, "thinking")]
