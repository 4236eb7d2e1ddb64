"""Tests of speccache.data: row forms, loss masks, truncation, skipping and errors."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import multiprocessing.pool
import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest
import xxhash
import zstandard

from speccache.data import (
    DataStats,
    TokenizedSample,
    file_content_hash,
    iter_rows,
    load_samples,
    merge_parts,
    tokenize_row,
    tokenizer_hash,
)
from speccache.demo import CHAT_TEMPLATE, build_demo_tokenizer, demo_data_path
from speccache.errors import DataError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "3 + 3 = 6."},
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def openai_row(messages=CONVERSATION):
    return {"messages": messages}


def sharegpt_row(messages=CONVERSATION):
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]}


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


@pytest.fixture(scope="module")
def prefix_tok():
    """The demo tokenizer with the generation markers removed, so the prefix-difference path runs."""
    tokenizer = build_demo_tokenizer()
    tokenizer.chat_template = re.sub(r"\{% (end)?generation %\}", "", CHAT_TEMPLATE)
    assert "{% generation" not in tokenizer.chat_template
    return tokenizer


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def masked_runs(tokenizer, sample):
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def test_both_forms_of_demo_data_give_identical_samples(tok):
    openai, openai_stats = load_samples(demo_data_path("openai"), tok, 4096)
    sharegpt, sharegpt_stats = load_samples(demo_data_path("sharegpt"), tok, 4096)
    assert len(openai) >= 200
    assert openai == sharegpt
    assert openai_stats == sharegpt_stats == DataStats(rows_read=len(openai))
    assert [s.source_row for s in openai] == list(range(len(openai)))


def test_mask_covers_assistant_content_plus_end_marker(tok):
    samples, _ = load_samples(demo_data_path("openai"), tok, 4096)
    for (_, row), sample in zip(iter_rows(demo_data_path("openai")), samples):
        assistant = [m["content"] + "<|end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert masked_runs(tok, sample) == assistant
        rendered = tok.apply_chat_template(row["messages"], tokenize=False)
        assert tok.decode(sample.input_ids, skip_special_tokens=False) == rendered
        assert len(sample.input_ids) == len(sample.loss_mask)


def test_prefix_difference_path_matches_generation_marker_path(tok, prefix_tok):
    path = demo_data_path("sharegpt")
    assert load_samples(path, prefix_tok, 4096, limit=80) == load_samples(path, tok, 4096, limit=80)


def test_template_that_is_not_prefix_stable_still_masks_the_assistant_turns(tmp_path, tok):
    tokenizer = build_demo_tokenizer()
    tokenizer.chat_template = (
        CHAT_TEMPLATE.replace(
            "{%- if add_generation_prompt -%}<|assistant|>", "{%- if add_generation_prompt -%}<|assistant|>Answer:"
        )
        .replace("{% generation %}", "")
        .replace("{% endgeneration %}", "")
    )
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row()])
    samples, _ = load_samples(path, tokenizer, 256)
    assert masked_runs(tokenizer, samples[0]) == ["2 + 2 = 4.<|end|>", "3 + 3 = 6.<|end|>"]
    assert samples == load_samples(path, tok, 256)[0]


def test_tokenizer_without_chat_template_is_an_error_even_when_skipping(tmp_path):
    tokenizer = build_demo_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row()])
    pattern = r"d\.jsonl:1: chat rows need a tokenizer with a chat template.*pre-tokenized rows"
    with pytest.raises(DataError, match=pattern):
        load_samples(path, tokenizer, 256, skip_bad_rows=True)


def test_template_rejecting_a_row_is_a_bad_row(tmp_path):
    tokenizer = build_demo_tokenizer()
    guard = "{% if messages | length > 2 %}{{ raise_exception('two messages at most') }}{% endif %}"
    tokenizer.chat_template = guard + CHAT_TEMPLATE
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(), openai_row(CONVERSATION[1:3])])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the chat template rejected .*two messages at most"):
        load_samples(path, tokenizer, 256)
    samples, stats = load_samples(path, tokenizer, 256, skip_bad_rows=True)
    assert [s.source_row for s in samples] == [1]
    assert stats.skipped == {"template_error": 1}


def test_sharegpt_roles_map_to_openai_roles(tok):
    a = tokenize_row(openai_row(), tok, 256, where="x")
    b = tokenize_row(sharegpt_row(), tok, 256, where="x")
    c = tokenize_row(
        {"conversations": [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]}, tok, 256, where="x"
    )
    assert a == b == c
    assert masked_runs(tok, a) == ["2 + 2 = 4.<|end|>", "3 + 3 = 6.<|end|>"]


def test_tokenize_row_passes_source_row_and_ignores_extra_keys(tok):
    sample = tokenize_row({"id": "q1", **openai_row()}, tok, 256, where="x", source_row=7)
    assert sample is not None and sample.source_row == 7
    assert sample == tokenize_row(openai_row(), tok, 256, where="x", source_row=7)


def test_truncation_keeps_the_first_tokens_and_counts(tmp_path, tok):
    full = tokenize_row(openai_row(), tok, 4096, where="x")
    second_turn = full.loss_mask.index(1) + full.loss_mask[full.loss_mask.index(1) :].index(0)
    cut = second_turn + 2
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row()])
    samples, stats = load_samples(path, tok, cut)
    assert samples == [TokenizedSample(full.input_ids[:cut], full.loss_mask[:cut], 0)]
    assert stats.rows_truncated == 1
    samples, stats = load_samples(path, tok, len(full.input_ids))
    assert samples[0].input_ids == full.input_ids and stats.rows_truncated == 0


def test_row_whose_assistant_tokens_are_all_truncated_is_skipped(tmp_path, tok):
    full = tokenize_row(openai_row(), tok, 4096, where="x")
    first_assistant = full.loss_mask.index(1)
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row()])
    samples, stats = load_samples(path, tok, first_assistant)
    assert samples == []
    assert stats.rows_read == 1 and stats.skipped == {"no_assistant_within_max_length": 1}
    assert tokenize_row(openai_row(), tok, first_assistant, where="x") is None


def test_rows_without_assistant_are_skipped_and_counted(tmp_path, tok):
    no_assistant = openai_row([{"role": "system", "content": "Hi."}, {"role": "user", "content": "Hello?"}])
    path = write_jsonl(tmp_path / "d.jsonl", [no_assistant, sharegpt_row(), "", "   ", no_assistant])
    samples, stats = load_samples(path, tok, 256)
    assert [s.source_row for s in samples] == [1]
    assert stats.rows_read == 3 and stats.skipped == {"no_assistant_token": 2}
    assert [(r.row, r.reason) for r in stats.skipped_rows] == [(0, "no_assistant_token"), (4, "no_assistant_token")]


def test_file_with_no_usable_row_gives_empty_list(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONVERSATION[:2])])
    samples, stats = load_samples(path, tok, 256)
    assert samples == [] and stats.rows_read == 1 and stats.skipped == {"no_assistant_token": 1}
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    assert load_samples(str(empty), tok, 256) == ([], DataStats())


BAD_ROWS = [
    ('{"messages": [', "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"text": "hello"}, "exactly one of 'conversations'.*found none"),
    ({**openai_row(), **sharegpt_row()}, "found 'conversations', 'messages'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]\.role must be one of system, user, assistant"),
    ({"conversations": [{"from": "human", "value": 3}]}, r"conversations\[0\]\.value must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, r"content\[0\] is a text part without"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "'input_audio' part; only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "has images, but the target has no image"),
    ({"messages": [{"role": "user", "content": 3}]}, "string or a list of text parts"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"x": 1}]}]}, "tool call"),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            ]
        },
        "not JSON",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]},
            ]
        },
        "must be an object",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 1}]},
        "reasoning_content must be a string",
    ),
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{"}]},
        "function_call must be a JSON",
    ),
    ({"messages": [{"role": "user", "content": "q"}], "tools": "{"}, "'tools' is a string but not JSON"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [1]}, "list of tool schema objects"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "starts with an assistant message"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "'loss_mask' has 2 entries but 'input_ids' has 3"),
    ({"input_ids": [1, 2, 3]}, "needs 'loss_mask'"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}, "0/1"),
    ({"input_ids": [1, True, 3], "loss_mask": [0, 1, 1]}, "integer ids"),
    ({"input_ids": [1, 99999, 3], "loss_mask": [0, 1, 1]}, r"in \[0, 1024\)"),
    ({"input_ids": [], "loss_mask": []}, "non-empty"),
]


@pytest.mark.parametrize(("bad", "pattern"), BAD_ROWS)
def test_malformed_row_raises_with_file_and_line(tmp_path, tok, bad, pattern):
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(), "", bad, openai_row()])
    with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + ".*" + pattern):
        load_samples(path, tok, 256)


def test_malformed_row_in_json_file_names_the_list_index(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([openai_row(), {"messages": "nope"}]))
    with pytest.raises(DataError, match=re.escape(f"{path}[1]: 'messages' must be a non-empty list")):
        load_samples(str(path), tok, 256)


def test_skip_bad_rows_counts_and_keeps_first_messages(tmp_path, tok):
    lines = [openai_row()] + [bad for bad, _ in BAD_ROWS] + [sharegpt_row()]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    samples, stats = load_samples(path, tok, 256, skip_bad_rows=True)
    assert [s.source_row for s in samples] == [0, len(lines) - 1]
    assert stats.rows_read == len(lines)
    assert stats.skipped == {"malformed": len(BAD_ROWS)}
    assert [r.row for r in stats.skipped_rows] == list(range(1, len(lines) - 1))
    assert stats.skipped_rows[0].detail.startswith(f"{path}:2: invalid JSON")
    assert stats.skipped_rows[4].detail.startswith(f"{path}:6: ")


def test_json_file_gives_same_samples_as_jsonl(tmp_path, tok):
    rows = [openai_row(), sharegpt_row(CONVERSATION[1:3])]
    json_path = tmp_path / "d.json"
    json_path.write_text(json.dumps(rows, indent=2))
    from_json, _ = load_samples(str(json_path), tok, 256)
    from_jsonl, _ = load_samples(write_jsonl(tmp_path / "d.jsonl", rows), tok, 256)
    assert [s.source_row for s in from_json] == [0, 1]
    assert [s.input_ids for s in from_json] == [s.input_ids for s in from_jsonl]
    assert [s.loss_mask for s in from_json] == [s.loss_mask for s in from_jsonl]


def test_pretokenized_rows_are_used_as_given(tmp_path, tok):
    rows = [
        {"input_ids": [1, 10, 11, 12, 13], "loss_mask": [0, 0, 1, 1, 0]},
        {"input_ids": [1, 10, 11], "loss_mask": [0, 0, 0]},
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 1]},
    ]
    samples, stats = load_samples(write_jsonl(tmp_path / "d.jsonl", rows), tok, 3)
    assert samples == [TokenizedSample([1, 10, 11], [0, 0, 1], 0)]
    assert stats.rows_read == 3 and stats.rows_truncated == 1
    assert stats.skipped == {"no_assistant_token": 1, "no_assistant_within_max_length": 1}


def test_limit_keeps_first_usable_rows_and_stops_reading(tmp_path, tok):
    no_assistant = openai_row(CONVERSATION[:2])
    lines = [no_assistant, openai_row(), no_assistant, sharegpt_row(), openai_row(), "not json"]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    samples, stats = load_samples(path, tok, 256, limit=2)
    assert [s.source_row for s in samples] == [1, 3]
    assert stats.rows_read == 4
    assert load_samples(path, tok, 256, limit=0) == ([], DataStats())
    with pytest.raises(ValueError, match="limit"):
        load_samples(path, tok, 256, limit=-1)
    with pytest.raises(ValueError, match="max_length"):
        load_samples(path, tok, 0)


def test_iter_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", {"a": 1}, "  ", {"b": 2}])
    assert list(iter_rows(path)) == [(1, {"a": 1}), (3, {"b": 2})]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"a": 1}\n')
    assert list(iter_rows(str(bom))) == [(0, {"a": 1})]
    json_path = tmp_path / "d.json"
    json_path.write_text('[{"a": 1}, {"b": 2}]')
    assert list(iter_rows(str(json_path))) == [(0, {"a": 1}), (1, {"b": 2})]


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("missing.jsonl", None, "data file not found"),
        ("d.csv", "a,b\n", "unsupported data file extension '.csv'.*use .jsonl"),
        ("d.jsonl", '{"a": 1}\n{"a": \n', r"d\.jsonl:2: invalid JSON"),
        ("d.jsonl", "[1]\n", r"d\.jsonl:1: expected a JSON object"),
        ("d.json", '[{"a": 1},', r"d\.json:1: invalid JSON"),
        ("d.json", '{"a": 1}', "must hold a JSON list"),
        ("d.json", b"\xff\xfe[]", "not valid UTF-8"),
    ],
)
def test_iter_rows_errors(tmp_path, name, content, pattern):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=pattern):
        list(iter_rows(str(path)))


def test_unparsable_json_file_is_an_error_even_when_skipping(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text("[{")
    with pytest.raises(DataError, match="invalid JSON"):
        load_samples(str(path), tok, 256, skip_bad_rows=True)


def test_file_content_hash_streams_and_matches_one_shot(tmp_path):
    data = os.urandom((1 << 20) * 2 + 12345)
    path = tmp_path / "blob.jsonl"
    path.write_bytes(data)
    assert file_content_hash(str(path)) == xxhash.xxh3_128_hexdigest(data)
    path.write_bytes(data[:-1])
    assert file_content_hash(str(path)) != xxhash.xxh3_128_hexdigest(data)
    with pytest.raises(DataError, match="not found"):
        file_content_hash(str(tmp_path / "nope.jsonl"))


def test_tokenizer_hash_is_stable_and_sensitive(tok):
    again = build_demo_tokenizer()
    assert tokenizer_hash(again) == tokenizer_hash(tok)
    assert re.fullmatch(r"[0-9a-f]{32}", tokenizer_hash(tok))
    again.chat_template = CHAT_TEMPLATE + " "
    assert tokenizer_hash(again) != tokenizer_hash(tok)
    other = build_demo_tokenizer()
    other.add_tokens(["<|extra|>"])
    assert tokenizer_hash(other) != tokenizer_hash(tok)


def _mixed_file(tmp_path):
    lines = [openai_row(), "not json", sharegpt_row(CONVERSATION[1:3]), "", openai_row(CONVERSATION[:2])] * 7
    return write_jsonl(tmp_path / "mixed.jsonl", lines)


def test_worker_processes_give_the_samples_and_stats_of_one_process(tmp_path, tok):
    path = _mixed_file(tmp_path)
    one = load_samples(path, tok, 40, skip_bad_rows=True)
    two = load_samples(path, tok, 40, skip_bad_rows=True, num_proc=2)
    assert one[0] == two[0] and one[1] == two[1] and len(one[0]) == 14
    assert one[1].skipped == {"malformed": 7, "no_assistant_token": 7}
    with pytest.raises(DataError, match=re.escape(f"{path}:2: invalid JSON")):
        load_samples(path, tok, 40, num_proc=2)
    assert load_samples(path, tok, 40, skip_bad_rows=True, num_proc=2, limit=3)[0] == one[0][:3]


def _ctrl_c_as_the_pool_starts(monkeypatch) -> None:
    """Sends this process a Ctrl-C inside ``Pool()``, once its workers are forked and before it can be closed.

    That is where a terminal's Ctrl-C most often lands when it comes early in a run; ``Pool.__init__`` forks the
    workers in ``_repopulate_pool`` and registers the finalizer that would terminate them only at its end.
    """
    fork_workers = multiprocessing.pool.Pool._repopulate_pool

    def interrupted(self):
        fork_workers(self)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(multiprocessing.pool.Pool, "_repopulate_pool", interrupted)


def test_ctrl_c_while_the_worker_pool_starts_closes_its_workers(tmp_path, tok, monkeypatch):
    # Interrupted inside Pool(), the run used to lose the pool: its forked workers waited on the task queue forever.
    _ctrl_c_as_the_pool_starts(monkeypatch)
    # Ctrl-C as at a terminal, even where the tests run with SIGINT ignored (a background job of a shell)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_samples(_mixed_file(tmp_path), tok, 40, skip_bad_rows=True, num_proc=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert multiprocessing.active_children() == []


def test_a_run_that_ignores_ctrl_c_keeps_ignoring_it_while_the_worker_pool_starts(tmp_path, tok, monkeypatch):
    path = _mixed_file(tmp_path)
    _ctrl_c_as_the_pool_starts(monkeypatch)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
    try:
        samples, _ = load_samples(path, tok, 40, skip_bad_rows=True, num_proc=2)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert samples == load_samples(path, tok, 40, skip_bad_rows=True)[0]


def test_rows_split_across_ranks_merge_into_the_whole(tmp_path, tok):
    path = _mixed_file(tmp_path)
    whole = load_samples(path, tok, 40, skip_bad_rows=True)
    parts = [load_samples(path, tok, 40, skip_bad_rows=True, part=(r, 3)) for r in range(3)]
    assert sum(p[1].rows_read for p in parts) == whole[1].rows_read
    merged = merge_parts(parts)
    assert merged[0] == whole[0] and merged[1] == whole[1]
    assert np.array_equal(merged[0].input_ids, whole[0].input_ids)
    with pytest.raises(DataError) as first:
        load_samples(path, tok, 40, part=(1, 3))
    assert first.value.row == 1  # the rank's first bad row, so ranks can agree on the file's first


# compressed files cut short, or not what their name says


def _lines_text(n: int = 3000) -> bytes:
    return "".join(json.dumps(sharegpt_row()) + "\n" for _ in range(n)).encode()


@pytest.mark.parametrize("cut", ["half", "last byte", "its checksum"])
def test_a_truncated_zstd_file_is_an_error_naming_it(tmp_path, cut):
    # What the zstd CLI writes too: one frame with its content size and a checksum.
    packed = zstandard.ZstdCompressor(write_checksum=True).compress(_lines_text())
    path = tmp_path / "rows.jsonl.zst"
    path.write_bytes(packed[: {"half": len(packed) // 2, "last byte": -1, "its checksum": -4}[cut]])
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: the zstd file is truncated"):
        list(iter_rows(str(path)))


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command")
def test_a_truncated_file_of_the_zstd_command_is_an_error(tmp_path):
    plain = tmp_path / "rows.jsonl"
    plain.write_bytes(_lines_text())
    subprocess.run(["zstd", "-q", str(plain), "-o", str(tmp_path / "whole.jsonl.zst")], check=True)
    packed = (tmp_path / "whole.jsonl.zst").read_bytes()
    assert len(list(iter_rows(str(tmp_path / "whole.jsonl.zst")))) == 3000
    (tmp_path / "cut.jsonl.zst").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match="the zstd file is truncated"):
        list(iter_rows(str(tmp_path / "cut.jsonl.zst")))


def test_every_frame_of_a_zstd_file_is_read_and_a_cut_in_the_last_one_is_refused(tmp_path):
    frames = [zstandard.ZstdCompressor().compress(_lines_text(n)) for n in (5, 7)]
    path = tmp_path / "rows.jsonl.zst"
    path.write_bytes(b"".join(frames))
    assert [i for i, _ in iter_rows(str(path))] == list(range(12))
    path.write_bytes(b"".join(frames)[:-3])
    with pytest.raises(DataError, match="truncated"):
        list(iter_rows(str(path)))


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("rows.jsonl.gz", gzip.compress(_lines_text(300))[:-100], "the gzip file is truncated"),
        ("rows.jsonl.gz", _lines_text(3), "not a valid gzip file"),
        ("rows.jsonl.zst", _lines_text(3), "not a valid zstd file"),
    ],
)
def test_a_damaged_or_misnamed_compressed_file_is_an_error_even_when_skipping(tmp_path, tok, name, content, pattern):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: {pattern}"):
        load_samples(str(path), tok, 64, skip_bad_rows=True)


# parquet files, read in place


def test_a_parquet_rewritten_with_its_mtime_kept_is_read_anew_and_never_cached(tmp_path, tok, monkeypatch):
    import datasets
    import pyarrow
    import pyarrow.parquet

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    path = str(tmp_path / "rows.parquet")
    short, long = (openai_row(CONVERSATION[:3]), openai_row(CONVERSATION))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([short] * 3), path)
    stamp = os.stat(path)
    first, _ = load_samples(path, tok, 256)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([long] * 4), path)  # what cp -p or rsync -t leave
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    second, _ = load_samples(path, tok, 256)
    assert len(first) == 3 and len(second) == 4
    assert second[0] == tokenize_row(long, tok, 256, where="x", source_row=0)
    assert not cache.exists() or not any(cache.iterdir())


def test_a_damaged_parquet_file_is_an_error_naming_it(tmp_path, tok):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: not a readable Parquet file"):
        load_samples(str(path), tok, 64, skip_bad_rows=True)
