"""A vision-language target's cached vision inputs (docs/vision.md, docs/format.md §7d): ``image_embeds`` are the
merged input embeddings its language model receives, at image tokens, zero elsewhere, stored sparse; for the four
tiny families they equal a live forward's and the model's own ``get_image_features``. ``--no-vision-inputs``
leaves them and ``positions`` out; ``estimate`` predicts their bytes as ``precompute`` writes them, and ``inspect``
shows their share."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.data import load_processor
from speccache.demo.real_target import ensure_real_target
from speccache.format import load_manifest_json, manifest_path, shard_path
from speccache.testing.vlm import FAMILIES, ensure_vlm_target
from support.cachecmp import all_samples
from support.faults import crash_after_one_shard
from support.vision import rendered, write_image_data

FLAGS = ["--aux-layers", "0,1,2", "--dtype", "fp32", "--model-dtype", "fp32", "--batch-size", "2", "--shard-size", "2"]
RUN = ["--device", "cpu", "--quiet"]
ROWS = [  # (images, question, answer): a batch of an image row with a text row, then a row of two images
    (["a.png"], "What is red?", "A square."),
    ([], "Tell me a story, a longer one please.", "Once upon a time."),
    (["a.png", "b.png"], "Compare them.", "Two pictures."),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_data(tmp_path_factory.mktemp("embeds-data"), ROWS)


def _precompute(model: str, data: Path, out: str, *extra: str) -> int:
    return main(
        ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", out, *FLAGS, *RUN, *extra]
    )


@pytest.fixture(scope="module")
def caches(offline_single_thread, data, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each family's (target dir, cache dir), precomputed once through the CLI."""
    out = {}
    for family in FAMILIES:
        model = ensure_vlm_target(family, ensure_real_target())
        cache = str(tmp_path_factory.mktemp(family) / "cache")
        assert _precompute(model, data, cache) == 0
        out[family] = (model, cache)
    return out


def _merged_embeddings(model_dir: str, data: Path, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Row ``index``'s ids, the ``inputs_embeds`` the target's language model receives in a live forward of the
    whole ``ForConditionalGeneration`` on the processor's own outputs, its images' features as the model's own
    ``get_image_features`` computes them (one row per image token, in order), and the model's image token id."""
    from transformers import AutoModelForImageTextToText

    images = ROWS[index][0]
    messages = rendered(data, ROWS[index])
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = load_processor(model_dir).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt"
    )
    seen: dict[str, torch.Tensor] = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.__setitem__("embeds", kwargs["inputs_embeds"][0]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**inputs)
            pixels = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")}
            features = model.model.get_image_features(**pixels).pooler_output if images else []
    finally:
        hook.remove()
    hidden = seen["embeds"].shape[-1]
    rows = torch.cat([f.reshape(-1, hidden) for f in features]) if images else torch.zeros(0, hidden)
    return inputs["input_ids"][0], seen["embeds"], rows, int(model.config.image_token_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_embeds_are_the_merged_input_embeddings_at_image_tokens(family, caches, data):
    model_dir, cache = caches[family]
    manifest = load_manifest_json(manifest_path(cache))
    hidden = manifest["config"]["hidden_size"]
    assert manifest["keys"]["image_embeds"] == {
        "dtype": "float32", "shape": [hidden], "ragged": True, "encoding": "sparse"
    }  # fmt: skip
    for index, sample in enumerate(all_samples(cache)):
        ids, merged, features, token = _merged_embeddings(model_dir, data, index)
        assert manifest["config"]["vision"]["image_token_id"] == token
        assert torch.equal(sample["input_ids"].long(), ids)
        image = ids == token
        assert bool(image.any()) == bool(ROWS[index][0])
        torch.testing.assert_close(sample["image_embeds"][image], merged[image], atol=1e-5, rtol=0)
        torch.testing.assert_close(sample["image_embeds"][image], features, atol=1e-5, rtol=0)
        assert sample["image_embeds"][image].abs().amax(dim=1).gt(0).all()
        assert torch.equal(sample["image_embeds"][~image], torch.zeros(int((~image).sum()), hidden))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_only_image_rows_take_space_and_estimate_predicts_the_bytes(family, caches, data, capsys):
    model, cache = caches[family]
    manifest = load_manifest_json(manifest_path(cache))
    hidden, tokens = manifest["config"]["hidden_size"], manifest["num_tokens"]
    image_tokens = sum(int((s["input_ids"] == manifest["config"]["vision"]["image_token_id"]).sum())
                       for s in all_samples(cache))  # fmt: skip
    assert 0 < image_tokens < tokens
    assert main(["inspect", cache, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # the image rows in fp32, and an int32 index per token
    assert info["keys"]["image_embeds"]["bytes"] == image_tokens * hidden * 4 + tokens * 4
    assert info["keys"]["image_embeds"]["share"] == info["keys"]["image_embeds"]["bytes"] / info["shard_bytes"]
    assert main(["estimate", "--model", model, "--data", str(data / "data.jsonl"), *FLAGS, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["images"]["image_tokens"] == image_tokens
    for key in ("image_embeds", *(("positions",) if family == "qwen2_5_vl" else ())):
        k = est["keys"][key]
        assert k["bytes_low"] == k["bytes_high"] == info["keys"][key]["bytes"] and k["exact"], key
        assert k["share_low"] == pytest.approx(info["keys"][key]["share"], rel=1e-3)
    assert est["exact"]
    files = [shard_path(cache, s["index"]) for s in manifest["shards"]]
    files += [os.path.join(cache, name) for name in manifest["side_files"]]
    written = sum(os.path.getsize(f) for f in files)
    assert abs(est["total_bytes_low"] - written) <= 8 * est["samples"]  # the digits of measured floats in headers
    assert main(["estimate", "--model", model, "--data", str(data / "data.jsonl"), *FLAGS]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("image_embeds"))
    assert line.rstrip().endswith(f"{est['keys']['image_embeds']['share_low']:.1%}")
    assert main(["inspect", cache]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("image_embeds"))
    assert "sparse" in line and line.rstrip().endswith(f"{info['keys']['image_embeds']['share']:.1%}")


def test_no_vision_inputs_leaves_out_both_keys_and_a_resume_must_keep_it(caches, data, tmp_path, monkeypatch, capsys):
    model, full = caches["qwen2_5_vl"]
    out = str(tmp_path / "text-only-draft")
    assert _precompute(model, data, out, "--no-vision-inputs") == 0
    manifest = load_manifest_json(manifest_path(out))
    assert "image_embeds" not in manifest["keys"] and "positions" not in manifest["keys"]
    assert manifest["config"]["vision_inputs"] is False
    for left, kept in zip(all_samples(out), all_samples(full)):
        assert set(kept) - set(left) == {"image_embeds", "positions"}
        assert all(torch.equal(left[k], kept[k]) for k in left)
    assert main(["estimate", "--model", model, "--data", str(data / "data.jsonl"), *FLAGS, "--no-vision-inputs",
                 "--json"]) == 0  # fmt: skip
    assert set(json.loads(capsys.readouterr().out)["keys"]) == set(manifest["keys"])
    # an interrupted run resumes only with the flag it started with, either way round
    for first, then in ((["--no-vision-inputs"], []), ([], ["--no-vision-inputs"])):
        partial = str(tmp_path / f"partial{len(first)}")
        with crash_after_one_shard(monkeypatch):
            assert _precompute(model, data, partial, *first) == 1
        capsys.readouterr()
        assert _precompute(model, data, partial, *then, "--resume") != 0
        assert "vision_inputs" in capsys.readouterr().err
        assert _precompute(model, data, partial, *first, "--resume") == 0
    shutil.rmtree(out)


def test_no_vision_inputs_is_refused_for_a_text_target(offline_single_thread, tmp_path, capsys):
    rows = tmp_path / "text.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}) + "\n"
    )
    argv = ["--model", ensure_real_target(), "--data", str(rows), "--no-vision-inputs"]
    for method in (["--method", "eagle3"], ["--method", "layers", "--layers", "1"]):
        assert main(["estimate", *argv, *method]) == 2
        err = capsys.readouterr().err
        assert "--no-vision-inputs" in err and "text-only target" in err


def test_the_layer_methods_leave_out_positions_with_no_vision_inputs(caches, data, capsys):
    model, _ = caches["qwen2_5_vl"]
    argv = ["estimate", "--model", model, "--data", str(data / "data.jsonl"), "--method", "layers", "--layers", "1"]
    keys = {}
    for flags in ([], ["--no-vision-inputs"]):
        assert main([*argv, *flags, "--json"]) == 0
        keys[bool(flags)] = set(json.loads(capsys.readouterr().out)["keys"])
    assert keys[True] == keys[False] - {"positions"} and "positions" in keys[False]
