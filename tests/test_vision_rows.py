"""Image rows read, rendered with a vision-language target's processor and masked (data/_images.py, _vision.py),
and `speccache estimate` / `precompute` on such a target."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from speccache.cli import main
from speccache.data import image_token_id, load_chat_tokenizer, load_processor, load_samples
from speccache.demo.real_target import ensure_real_target
from speccache.errors import DataError
from speccache.format import load_manifest_json, manifest_path
from speccache.testing.vlm import FAMILIES, draw_image, ensure_vlm_target
from support.cachecmp import written_bytes

# What the mask of an assistant answer decodes to: the answer and the token that ends the turn.
_ANSWER = {"qwen2_5_vl": "{}<|im_end|>", "qwen3_vl": "{}<|im_end|>", "gemma3": "{}<end_of_turn>"}


def _masked_text(family: str, answers: list[str]) -> str:
    if family != "llava":
        return "".join(_ANSWER[family].format(a) for a in answers)
    # LLaVA's template marks each answer and the space after it as generated, and writes the next "USER:" right
    # after that space: the token " US" starts inside the answer's span, so the text path's rule supervises it.
    return " US".join(f" {a}" for a in answers) + " "


@pytest.fixture(scope="module")
def targets(offline_single_thread) -> dict[str, tuple[str, Any, Any]]:
    """Each family's (model dir, tokenizer, processor), built once."""
    out = {}
    for family in FAMILIES:
        path = ensure_vlm_target(family, ensure_real_target())
        out[family] = (path, load_chat_tokenizer(path), load_processor(path))
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    (root / "sub").mkdir()
    draw_image(str(root / "a.png"), 56, 84, seed=0)
    draw_image(str(root / "sub" / "b.jpg"), 100, 60, seed=1)
    (root / "broken.png").write_bytes(b"not an image")
    return root


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _rows(root: Path) -> list[tuple[dict, list[dict], list[str]]]:
    """Each row form: (the row, the transformers messages it means, its assistant answers)."""
    a, b = str(root / "a.png"), str(root / "sub" / "b.jpg")

    def user(*parts: Any) -> dict:
        return {
            "role": "user",
            "content": [{"type": "image", "path": p} if p in (a, b) else {"type": "text", "text": p} for p in parts],
        }

    def reply(text: str) -> dict:
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    return [
        (  # ShareGPT4V / LLaVA: markers in the human turns, two turns
            {
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat is red?"},
                    {"from": "gpt", "value": "A square."},
                    {"from": "human", "value": "And here? <image>"},
                    {"from": "gpt", "value": "A line."},
                ],
                "image": ["a.png", "sub/b.jpg"],
            },
            [user(a, "What is red?"), reply("A square."), user("And here?", b), reply("A line.")],
            ["A square.", "A line."],
        ),
        (  # OpenAI parts: a relative path and a file:// URL
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "a.png"}},
                            {"type": "text", "text": "Compare them."},
                            {"type": "image_url", "image_url": {"url": "file://" + b}},
                        ],
                    },
                    {"role": "assistant", "content": "The first is taller."},
                ]
            },
            [user(a, "Compare them.", b), reply("The first is taller.")],
            ["The first is taller."],
        ),
        (  # OpenAI part with a data URI, transformers parts with an absolute path
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": _data_uri(root / "a.png")}}],
                    },
                    {"role": "assistant", "content": "A picture."},
                    {"role": "user", "content": [{"type": "text", "text": "This?"}, {"type": "image", "path": b}]},
                    {"role": "assistant", "content": "Another."},
                ]
            },
            [user(a), reply("A picture."), user("This?", b), reply("Another.")],
            ["A picture.", "Another."],
        ),
        (  # a text row, read for the VLM target through the same path
            {
                "messages": [
                    {"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": "Hi! How can I help?"},
                ]
            },
            [user("Hello there"), reply("Hi! How can I help?")],
            ["Hi! How can I help?"],
        ),
    ]


def _check(sample: Any, expected_ids: list[int], answers: list[str], family: str, tokenizer: Any, processor: Any):
    ids, mask = np.asarray(sample.input_ids), np.asarray(sample.loss_mask, dtype=bool)
    assert ids.tolist() == expected_ids
    assert tokenizer.decode(ids[mask]) == _masked_text(family, answers)
    assert not mask[ids == image_token_id(processor)].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_row_form_gives_the_processors_ids_and_masks_only_the_answers(family, targets, images, tmp_path):
    path, tokenizer, processor = targets[family]
    forms = _rows(images)
    data = _write(images / f"{family}.jsonl", [row for row, _, _ in forms])
    samples, stats = load_samples(data, tokenizer, 4096, processor=processor)
    assert len(samples) == len(forms) and not stats.skipped
    token = image_token_id(processor)
    for sample, (_, messages, answers) in zip(samples, forms):
        expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]
        _check(sample, list(expected), answers, family, tokenizer, processor)
        n_images = sum(p["type"] == "image" for m in messages for p in m["content"])
        assert (np.asarray(sample.input_ids) == token).sum() > 0 if n_images else True
    a, b = str(images / "a.png"), str(images / "sub" / "b.jpg")
    assert samples[0].images == (a, b) and samples[1].images == (a, b)
    assert samples[2].images[0].startswith("xxh3:") and samples[2].images[1] == b
    assert samples[3].images == ()


def test_datasets_image_columns_are_read(targets, images, tmp_path):
    import datasets
    from PIL import Image

    _, tokenizer, processor = targets["qwen2_5_vl"]
    rows = {
        "messages": [
            [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is red?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
            ]
        ],
        "images": [[Image.open(images / "a.png").convert("RGB")]],
    }
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_dict(rows).cast_column("images", datasets.Sequence(datasets.Image())).save_to_disk(saved)
    # a {"bytes", "path"} column, as Parquet files written from the Image feature hold it
    import pyarrow
    import pyarrow.parquet

    raw = {"bytes": (images / "sub" / "b.jpg").read_bytes(), "path": "b.jpg"}
    table = pyarrow.table(
        {
            "conversations": [[{"from": "human", "value": "<image> Here?"}, {"from": "gpt", "value": "Yes."}]],
            "image": [raw],
        }
    )
    pyarrow.parquet.write_table(table, tmp_path / "rows.parquet")
    (saved_sample,), _ = load_samples(saved, tokenizer, 4096, processor=processor)
    (parquet_sample,), _ = load_samples(str(tmp_path / "rows.parquet"), tokenizer, 4096, processor=processor)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "path": str(images / "a.png")}, {"type": "text", "text": "What is red?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
    ]
    expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]
    _check(saved_sample, list(expected), ["A square."], "qwen2_5_vl", tokenizer, processor)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "path": str(images / "sub" / "b.jpg")}, {"type": "text", "text": "Here?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
    ]
    expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]
    _check(parquet_sample, list(expected), ["Yes."], "qwen2_5_vl", tokenizer, processor)
    assert saved_sample.images[0].startswith("xxh3:") and parquet_sample.images[0].startswith("xxh3:")


def _bad_rows(root: Path) -> list[tuple[dict, str, str]]:
    """(row, what its error says, skip reason)."""

    def ask(*parts: dict) -> dict:
        return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "ok"}]}

    def url(u: str) -> dict:
        return {"type": "image_url", "image_url": {"url": u}}

    return [
        (ask(url("missing.png")), f"image {root / 'missing.png'}: cannot be read", "bad_image"),
        (ask(url("broken.png")), f"image {root / 'broken.png'}: not a readable image", "bad_image"),
        (ask(url("https://example.com/x.png")), "download the images and give their paths", "bad_image"),
        (ask({"type": "video", "path": "v.mp4"}), "is a video; only images are read", "malformed"),
        (
            {
                "conversations": [{"from": "human", "value": "<image> <image>"}, {"from": "gpt", "value": "ok"}],
                "image": "a.png",
            },
            "has an <image> marker but the row has only 1 image(s)",
            "malformed",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "ok"}],
                "image": ["a.png", "sub/b.jpg"],
            },
            "image sub/b.jpg: the row has 2 image(s) in 'image'/'images' but places only 1",
            "malformed",
        ),
    ]


def test_bad_image_rows_name_row_and_image_and_are_skippable(targets, images):
    _, tokenizer, processor = targets["gemma3"]
    bad = _bad_rows(images)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = _write(images / "bad.jsonl", [good] + [row for row, _, _ in bad])
    for line, (row, says, _) in enumerate(bad, start=2):
        one = _write(images / "one.jsonl", [good] * (line - 1) + [row])
        with pytest.raises(DataError) as info:
            load_samples(one, tokenizer, 4096, processor=processor)
        assert f"{one}:{line}: " in str(info.value) and says in str(info.value)
        assert "--skip-bad-rows" in str(info.value)
    samples, stats = load_samples(data, tokenizer, 4096, processor=processor, skip_bad_rows=True)
    assert len(samples) == 1
    assert [(s.row, s.reason) for s in stats.skipped_rows] == [(i + 1, reason) for i, (_, _, reason) in enumerate(bad)]


def test_image_rows_are_refused_by_a_text_only_target(images):
    from speccache.demo import ensure_demo_target

    tokenizer = load_chat_tokenizer(ensure_demo_target())
    row, _, _ = _rows(images)[0]
    with pytest.raises(DataError, match=r"bad\.jsonl:1: the row has images, but the target has no image processor"):
        load_samples(_write(images / "bad.jsonl", [row]), tokenizer, 4096)


def test_image_root_resolves_relative_paths(targets, images, tmp_path):
    _, tokenizer, processor = targets["llava"]
    row, _, _ = _rows(images)[1]
    data = _write(tmp_path / "elsewhere.jsonl", [row])
    with pytest.raises(DataError, match="check the path or --image-root"):
        load_samples(data, tokenizer, 4096, processor=processor)
    (sample,), _ = load_samples(data, tokenizer, 4096, processor=processor, image_root=str(images))
    assert sample.images[0] == str(images / "a.png")


def test_too_long_image_rows_are_skipped_whole_and_text_rows_truncated(targets, images):
    _, tokenizer, processor = targets["qwen3_vl"]
    forms = _rows(images)
    data = _write(images / "long.jsonl", [row for row, _, _ in forms])
    full, _ = load_samples(data, tokenizer, 4096, processor=processor)
    image_row, text_row = len(full[1].input_ids), len(full[3].input_ids)
    limit = text_row - 2
    assert limit < image_row
    samples, stats = load_samples(data, tokenizer, limit, processor=processor)
    assert stats.skipped == {"image_row_beyond_max_length": 3}
    assert [s.row for s in stats.skipped_rows] == [0, 1, 2]
    assert [s.source_row for s in samples] == [3] and len(samples[0].input_ids) == limit and stats.rows_truncated == 1


def test_expand_turns_gives_each_turn_its_images(targets, images):
    from speccache.data import chat_format

    _, tokenizer, processor = targets["qwen2_5_vl"]
    row, messages, answers = _rows(images)[0]
    fmt = chat_format(tokenizer, expand_turns=True)
    first, second = load_samples(_write(images / "turns.jsonl", [row]), tokenizer, 4096, fmt=fmt, processor=processor)[
        0
    ]
    assert first.images == (str(images / "a.png"),) and len(second.images) == 2
    expected = processor.apply_chat_template(messages[:2], tokenize=True, return_dict=True)["input_ids"][0]
    _check(first, list(expected), answers[:1], "qwen2_5_vl", tokenizer, processor)
    assert tokenizer.decode(np.asarray(second.input_ids)[np.asarray(second.loss_mask, bool)]) == "A line.<|im_end|>"


def test_estimate_counts_images_and_equals_the_layers_run(targets, images, tmp_path, capsys):
    path, _, _ = targets["llava"]
    data = _write(images / "est.jsonl", [row for row, _, _ in _rows(images)])
    args = ["--model", path, "--data", data, "--method", "layers", "--layers", "1", "--dtype", "fp32"]
    assert main(["estimate", *args, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    # LLaVA: 4 tokens per image (28 px, patch 14, CLS dropped); 3 image rows holding 6 images
    assert est["images"] == {"image_rows": 3, "images": 6, "image_tokens": 24}
    assert est["samples"] == 4
    assert main(["estimate", *args]) == 0
    assert "images     3 image rows, 6 images, 24 image tokens" in capsys.readouterr().out
    # the layer methods compute a vision-language target's rows too: what estimate predicted is what is written
    out = str(tmp_path / "cache")
    assert main(["precompute", *args, "--out", out, "--device", "cpu", "--quiet"]) == 0
    manifest = load_manifest_json(manifest_path(out))
    assert (manifest["num_samples"], manifest["num_tokens"]) == (est["samples"], est["tokens"])
    # exact but for the digits of measured floats in the shard headers, a few bytes per sample
    assert est["exact"] and abs(est["total_bytes_low"] - written_bytes(out)) <= 8 * est["samples"]


def test_pixel_flags_reach_the_processor_through_the_cli(targets, images, capsys):
    path, _, _ = targets["qwen2_5_vl"]
    data = _write(images / "pix.jsonl", [_rows(images)[1][0]])
    args = ["estimate", "--model", path, "--data", data, "--method", "layers", "--layers", "1", "--json"]
    counts = []
    for flags in ([], ["--min-pixels", "256", "--max-pixels", str(28 * 28)]):
        assert main([*args, *flags]) == 0
        counts.append(json.loads(capsys.readouterr().out)["images"]["image_tokens"])
    assert counts[1] < counts[0]
    assert main([*args, "--max-pixels", "10", "--min-pixels", "20"]) == 2
    assert "need 0 < min-pixels <= max-pixels" in capsys.readouterr().err


def test_the_plan_records_what_makes_the_pixels(targets, images, tmp_path):
    from speccache.precompute.config import PrecomputeConfig
    from speccache.precompute.run import make_plan

    path, _, _ = targets["qwen2_5_vl"]
    data = _write(tmp_path / "rows.jsonl", [_rows(images)[3][0]])
    cfg = PrecomputeConfig(
        model=path, data=data, out="", method="layers", layers=[1], image_root=str(images), max_pixels=50000
    )
    plan = make_plan(cfg)
    assert plan.manifest_config["vision"] == {
        "processor": "Qwen2_5_VLProcessor",
        "image_processor": "Qwen2VLImageProcessorPil",
        "backend": "pil",
        "size": {"shortest_edge": 3136, "longest_edge": 50000},
        "image_root": str(images),
        "image_token_id": plan.model_config.image_token_id,  # the model's, which finds its image tokens
    }
    text_only = PrecomputeConfig(model=ensure_real_target(), data=data, out="", method="layers", layers=[1])
    assert "vision" not in make_plan(text_only).manifest_config


def test_the_mask_is_carried_past_expansions_and_refused_where_they_touch_an_answer():
    from speccache.data import RowFailure
    from speccache.data._vision import _carry

    ids = np.array([1, 2, 9, 3, 4, 5, 6, 8])  # 9: an image placeholder; 5, 6: the answer
    mask = np.array([0, 0, 0, 0, 0, 1, 1, 0], dtype=np.uint8)
    # the placeholder became a newline token, the image's tokens (7) and another token; a BOS came first
    expanded = np.array([0, 1, 2, 11, 7, 7, 7, 7, 12, 3, 4, 5, 6, 8])
    assert _carry(ids, mask, expanded, 7, "r:1").tolist() == [0] * 11 + [1, 1, 0]
    with pytest.raises(RowFailure, match="r:1: .*the processor's image expansion changes assistant tokens") as info:
        _carry(ids, np.array([0, 0, 1, 0, 0, 1, 1, 0], dtype=np.uint8), expanded, 7, "r:1")
    assert info.value.reason == "mask_unplaceable"
    with pytest.raises(RowFailure, match="changes assistant tokens"):  # no way back in step
        _carry(ids, mask, np.array([1, 2, 7, 7, 13, 14, 15, 16]), 7, "r:1")


def test_ranks_read_image_rows_as_one_reader_does(targets, images):
    from speccache.data import merge_parts

    _, tokenizer, processor = targets["gemma3"]
    data = _write(images / "ranks.jsonl", [row for row, _, _ in _rows(images)])
    whole = load_samples(data, tokenizer, 4096, processor=processor)[0]
    parts = [load_samples(data, tokenizer, 4096, processor=processor, part=(r, 2)) for r in range(2)]
    merged = merge_parts(parts)[0]
    assert merged == whole and [s.images for s in merged] == [s.images for s in whole]
    assert sum(bool(s.images) for s in merged) == 3
