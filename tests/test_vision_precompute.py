"""``speccache precompute --method eagle3`` on vision-language targets (docs/vision.md): the cached features of a
batch mixing image and text rows equal a live forward of the target with the processor's own pixels, for the four
tiny families; M-RoPE positions are the target's own; Qwen3-VL's aux states are what vLLM's EAGLE-3 capture sees
(after the deepstack addition); a resume is byte-identical; what is not supported is refused up front."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from speccache.cli import main
from speccache.data import load_processor
from speccache.demo.real_target import ensure_real_target
from speccache.format import load_manifest_json, manifest_path, shard_path
from speccache.testing.vlm import FAMILIES, draw_image, ensure_vlm_target
from support.cachecmp import all_samples, file_tree, max_relative_error
from support.faults import crash_after_one_shard
from support.vision import rendered, write_image_data

AUX = (0, 1, 2)  # the tiny targets have 4 decoder layers; layer 3's output is the last hidden state (pre-norm)
FLAGS = ["--aux-layers", ",".join(map(str, AUX)), "--dtype", "fp32", "--model-dtype", "fp32"]
FLAGS += ["--batch-size", "2", "--shard-size", "2"]
RUN = ["--device", "cpu", "--quiet"]  # precompute's, not estimate's
ROWS = [  # (images, question, answer); batches of two: an image row with a text row, then two image rows
    (["a.png"], "What is red?", "A square."),
    ([], "Tell me a story, a longer one please.", "Once upon a time."),
    (["b.png as a data URI"], "And this?", "A line."),
    (["a.png", "b.png"], "Compare them.", "Two pictures."),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The :data:`ROWS`: images by path, and one the row holds (a data URI)."""
    return write_image_data(tmp_path_factory.mktemp("vision-data"), ROWS)


def _messages(root: Path, index: int) -> list[dict]:
    """Row ``index`` of :func:`data` as the processor renders it."""
    return rendered(root, ROWS[index])


@pytest.fixture(scope="module")
def caches(offline_single_thread, data, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each family's (target dir, cache dir), precomputed once through the CLI."""
    out = {}
    for family in FAMILIES:
        model = ensure_vlm_target(family, ensure_real_target())
        cache = str(tmp_path_factory.mktemp(family) / "cache")
        argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", cache, *FLAGS, *RUN]
        assert main(argv) == 0
        out[family] = (model, cache)
    return out


def _live(model_dir: str, messages: list[dict]) -> tuple[dict, dict[str, Any]]:
    """The processor's outputs for ``messages`` and a live forward of the target on them: its hidden states,
    and each decoder layer's input (forward pre-hooks: what vLLM's EAGLE-3 capture reads)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    layers = model.model.language_model.layers
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args, kw, k=k: seen.__setitem__(k, (args[0] if args else kw["hidden_states"])[0]),
            with_kwargs=True,
        )
        for k, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    live: dict[str, Any] = {"hidden": [h[0] for h in out.hidden_states], "inputs_of": seen, "model": model}
    return inputs, live


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_features_equal_a_live_forward_with_the_pixels(family, caches, data):
    model_dir, cache = caches[family]
    samples = all_samples(cache)
    assert [int(s["source_row"]) for s in samples] == [0, 1, 2, 3]
    for index, sample in enumerate(samples):
        inputs, live = _live(model_dir, _messages(data, index))
        ids = inputs["input_ids"][0]
        assert torch.equal(sample["input_ids"].long(), ids)
        config = live["model"].config
        image = ids == config.image_token_id
        assert bool(image.any()) == bool(ROWS[index][0])
        assert not sample["loss_mask"][image].any()  # image tokens are never supervised
        assert sample["loss_mask"].any()
        # aux layer k is the residual stream after decoder layer k: the input of layer k + 1
        want = torch.cat([live["inputs_of"][k + 1] for k in AUX], dim=-1)
        torch.testing.assert_close(sample["aux_hidden_states"], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(sample["last_hidden_state"], live["hidden"][-1], atol=1e-5, rtol=0)
        if family == "qwen3_vl" and image.any():
            # transformers' hidden_states[k + 1] precede the deepstack addition at image tokens; the cache follows it
            before = torch.cat([live["hidden"][k + 1] for k in AUX], dim=-1)
            assert (sample["aux_hidden_states"][image] - before[image]).abs().max() > 1e-3
        if family in ("qwen2_5_vl", "qwen3_vl"):
            positions, _ = live["model"].model.get_rope_index(
                inputs["input_ids"],
                mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"),
                attention_mask=inputs["attention_mask"],
            )
            assert sample["positions"].dtype == torch.int32
            assert torch.equal(sample["positions"].long(), positions[:, 0].T)
            if image.any():  # an image's tokens spread over height and width
                assert not torch.equal(sample["positions"][:, 1], sample["positions"][:, 0])
        else:
            assert "positions" not in sample


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_layer_methods_capture_the_same_streams_with_the_pixels(family, caches, data, tmp_path):
    """A layers cache of the same rows holds what the EAGLE-3 cache's aux states hold (checked against a live
    forward above), its embeddings are the merged input embeddings, and an M-RoPE target's positions come along."""
    model, eagle3 = caches[family]
    out = str(tmp_path / "layers")
    layers = ["--method", "layers", "--layers=-1,0,1,2", "--last-prenorm", "--last-hidden"]
    argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", out, *layers, *FLAGS[2:], *RUN]
    assert main(argv) == 0
    for index, (sample, ref) in enumerate(zip(all_samples(out), all_samples(eagle3), strict=True)):
        assert torch.equal(sample["input_ids"], ref["input_ids"]) and torch.equal(sample["loss_mask"], ref["loss_mask"])
        aux = torch.cat([sample[f"layer_{k:02d}"] for k in AUX], dim=-1)
        torch.testing.assert_close(aux, ref["aux_hidden_states"], atol=1e-6, rtol=0)
        torch.testing.assert_close(sample["last_hidden_state"], ref["last_hidden_state"], atol=1e-6, rtol=0)
        _, live = _live(model, _messages(data, index))
        torch.testing.assert_close(sample["layer_emb"], live["inputs_of"][0], atol=1e-6, rtol=0)
        with torch.no_grad():  # the last layer's output before the norm is what the norm turns into the last state
            normed = live["model"].model.language_model.norm(sample["layer_03_prenorm"])
        torch.testing.assert_close(normed, sample["last_hidden_state"], atol=1e-5, rtol=0)
        if family == "qwen3_vl":
            assert torch.equal(sample["positions"], ref["positions"])
        else:
            assert "positions" not in sample


def test_manifest_records_the_vision_settings_and_inspect_shows_positions(caches, capsys):
    _, cache = caches["qwen2_5_vl"]
    manifest = load_manifest_json(manifest_path(cache))
    assert manifest["config"]["vision"]["processor"] == "Qwen2_5_VLProcessor"
    assert manifest["keys"]["positions"]["shape"] == [3] and manifest["keys"]["positions"]["dtype"] == "int32"
    assert main(["inspect", cache]) == 0
    assert "positions" in capsys.readouterr().out
    _, llava = caches["llava"]
    assert "positions" not in load_manifest_json(manifest_path(llava))["keys"]


def test_estimate_equals_what_precompute_writes(caches, data, capsys):
    model, cache = caches["qwen3_vl"]
    argv = ["--model", model, "--data", str(data / "data.jsonl"), *FLAGS]
    assert main(["estimate", *argv, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    manifest = load_manifest_json(manifest_path(cache))
    assert (est["samples"], est["tokens"]) == (manifest["num_samples"], manifest["num_tokens"])
    assert est["images"]["image_rows"] == 3 and est["images"]["images"] == 4 and est["exact"]
    files = [shard_path(cache, s["index"]) for s in manifest["shards"]]
    files += [os.path.join(cache, name) for name in manifest["side_files"]]
    written = sum(os.path.getsize(f) for f in files)
    # exact but for the digits of measured floats in the shard headers, a few bytes per sample
    assert abs(est["total_bytes_low"] - written) <= 8 * est["samples"]
    assert est["keys"]["positions"]["bytes_low"] == 3 * 4 * manifest["num_tokens"]


def test_interrupted_run_resumes_byte_identical(caches, data, tmp_path, monkeypatch, capsys):
    model, reference = caches["qwen3_vl"]
    out = str(tmp_path / "cache")
    argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", out, *FLAGS, *RUN]
    with crash_after_one_shard(monkeypatch) as written:
        assert main(argv) == 1
    assert "simulated crash" in capsys.readouterr().err
    assert written == [0] and load_manifest_json(manifest_path(out))["complete"] is False
    assert main([*argv, "--resume"]) == 0

    def contents(path: str) -> dict[str, bytes]:
        files = file_tree(path)
        manifest = json.loads(files.pop("manifest.json"))
        manifest.pop("producer")  # each run's own command line
        return {**files, "manifest.json": json.dumps(manifest, sort_keys=True).encode()}

    assert contents(out) == contents(reference)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_chunked_prefill_of_an_mrope_target_equals_its_whole_forward(family, caches, data, tmp_path):
    """Chunks of 8 tokens cut images (Qwen3-VL's deepstack features are split with them), and the cache equals the
    unchunked one within 1e-5."""
    from transformers import AutoConfig

    model, want = caches[family]
    image = AutoConfig.from_pretrained(model).image_token_id
    cut = [
        p
        for s in all_samples(want)
        for p in range(7, len(s["input_ids"]) - 1, 8)
        if s["input_ids"][p : p + 2].eq(image).all()
    ]
    assert cut, "no chunk boundary falls inside an image"
    out = tmp_path / "chunked"
    argv = [
        "precompute",
        "--model",
        model,
        "--data",
        str(data / "data.jsonl"),
        "--out",
        str(out),
        "--prefill-chunk",
        "8",
    ]
    assert main([*argv, *FLAGS, *RUN]) == 0
    assert max_relative_error(out, want) <= 1e-5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "vllm"], "--engine vllm does not run it here (vLLM's vision-language modules need torchvision)"),
        (["--prefill-chunk", "8"], "its rows run whole, never chunked (a chunk that cuts an image is exact only"),
    ],
)
def test_what_is_not_supported_is_refused_up_front(flags, message, caches, data, tmp_path, capsys):
    model, _ = caches["gemma3"]
    out = tmp_path / "cache"
    argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", str(out), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--model {model} is a vision-language target (" in err and message in err
    assert not out.exists()


def test_append_is_refused_and_changes_nothing(caches, data, capsys):
    model, cache = caches["llava"]
    before = file_tree(cache)
    argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", cache, "--append"]
    assert main([*argv, *FLAGS, *RUN]) == 2
    assert "--append does not extend its caches yet; write a new cache (--out)" in capsys.readouterr().err
    assert file_tree(cache) == before


@pytest.mark.parametrize("change", ["image file", "row's own image"])
def test_images_that_change_while_the_run_reads_them_stop_it(change, caches, data, tmp_path, monkeypatch, capsys):
    """The pixels are rebuilt from the sources at the forward: a file redrawn at another size (another token
    count) or a row that no longer holds its image stops the run with a DataError naming the row."""
    import speccache.precompute.run as run

    model, _ = caches["qwen2_5_vl"]
    root = tmp_path / "data"
    shutil.copytree(data, root)
    real_plan = run.make_plan

    def plan_then_change(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        if change == "image file":
            draw_image(str(root / "a.png"), 112, 168, seed=0)  # four times the pixels: four times the tokens
        else:
            rows = (root / "data.jsonl").read_text().splitlines()
            other = base64.b64encode(Path(draw_image(str(root / "c.png"), 64, 40, seed=2)).read_bytes()).decode()
            rows[2] = rows[2].replace(base64.b64encode((root / "b.png").read_bytes()).decode(), other)
            (root / "data.jsonl").write_text("\n".join(rows) + "\n")
        return plan

    monkeypatch.setattr(run, "make_plan", plan_then_change)
    out = tmp_path / "cache"
    argv = ["precompute", "--model", model, "--data", str(root / "data.jsonl"), "--out", str(out), *FLAGS, *RUN]
    assert main(argv) == 1
    err = capsys.readouterr().err
    if change == "image file":
        assert "data.jsonl:1: its 1 image(s) now make 24 image tokens but the sample holds 6" in err
    else:
        assert "data.jsonl:3: its image xxh3:" in err and "is no longer in the row" in err


def test_a_png_with_a_damaged_chunk_is_a_bad_image_row(caches, data, tmp_path, capsys):
    model, _ = caches["llava"]
    encoded = base64.b64encode((data / "b.png").read_bytes()).decode()
    damaged = encoded[:-40] + "A" * 40  # PIL raises SyntaxError ("broken PNG file") for it
    rows = (data / "data.jsonl").read_text().splitlines()
    path = tmp_path / "damaged.jsonl"
    path.write_text("\n".join([*rows[:2], rows[2].replace(encoded, damaged)]) + "\n")
    argv = ["estimate", "--model", model, "--data", str(path), *FLAGS, "--image-root", str(data)]
    assert main([*argv, "--skip-bad-rows", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data_stats"]["skipped"] == {"bad_image": 1}
    assert main(argv) == 1
    assert f"{path}:3: image data URI: not a readable image (broken PNG file" in capsys.readouterr().err


def test_each_sample_pixels_are_built_once_per_run(caches, data, tmp_path, monkeypatch):
    """--batching sorted (the default) orders a shard's samples by their lengths without building their pixels."""
    from speccache.precompute._tokens import ImageInputs

    model, _ = caches["llava"]
    built: list[int] = []
    real_call = ImageInputs.__call__

    def counting(self, ids, sources, source_row):
        built.append(source_row)
        return real_call(self, ids, sources, source_row)

    monkeypatch.setattr(ImageInputs, "__call__", counting)
    out = tmp_path / "cache"
    argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", str(out), *FLAGS, *RUN]
    assert main(argv) == 0
    assert sorted(built) == [0, 1, 2, 3]


def test_the_audit_refuses_a_vision_language_cache_and_verify_passes_it(caches, capsys):
    _, cache = caches["gemma3"]
    assert main(["audit", cache]) == 2
    assert (
        "the audit does not rebuild the images' pixels yet: check it with speccache verify" in capsys.readouterr().err
    )
    assert main(["verify", cache]) == 0
