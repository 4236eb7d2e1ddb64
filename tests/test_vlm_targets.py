"""The tiny VLM targets of speccache.testing.vlm, and loading a model directory's processor (data/_processor.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from speccache.data._processor import load_processor, processor_record
from speccache.demo import ensure_demo_target
from speccache.demo.real_target import ensure_real_target
from speccache.errors import UsageError
from speccache.testing.vlm import FAMILIES, build_vlm_target, draw_image, ensure_vlm_target


def vlm_target(family: str) -> str:
    return ensure_vlm_target(family, ensure_real_target())


_PROCESSOR = {
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLImageProcessorPil"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen2VLImageProcessorPil"),
    "gemma3": ("Gemma3Processor", "Gemma3ImageProcessorPil"),
    "llava": ("LlavaProcessor", "CLIPImageProcessorPil"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_target_loads_like_a_released_checkpoint_and_runs_on_its_processor_output(
    family: str, tmp_path, offline_single_thread
) -> None:
    from transformers import AutoModelForImageTextToText

    path = vlm_target(family)
    processor = load_processor(path)
    assert (type(processor).__name__, type(processor.image_processor).__name__) == _PROCESSOR[family]
    assert processor_record(processor).backend == "pil"
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert model.config.get_text_config().hidden_size == 64
    assert model.config.get_text_config().num_hidden_layers == 4
    image = draw_image(str(tmp_path / "a.png"))
    messages = [
        {"role": "user", "content": [{"type": "image", "path": image}, {"type": "text", "text": "What is red?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
    ]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    image_id = model.config.image_token_id
    assert int((inputs["input_ids"] == image_id).sum()) > 0
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    assert out.logits.shape[:2] == inputs["input_ids"].shape


def test_builds_are_deterministic_and_reused(tmp_path) -> None:
    a = build_vlm_target(str(tmp_path / "a"), "llava", ensure_real_target())
    b = build_vlm_target(str(tmp_path / "b"), "llava", ensure_real_target())
    with open(os.path.join(a, "model.safetensors"), "rb") as f, open(os.path.join(b, "model.safetensors"), "rb") as g:
        assert f.read() == g.read()
    stamp = os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns
    assert build_vlm_target(a, "llava", ensure_real_target()) == a
    assert os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="does not hold the tiny gemma3 target"):
        build_vlm_target(a, "gemma3", ensure_real_target())


def test_draw_image_is_deterministic(tmp_path) -> None:
    from PIL import Image

    for name in ("a.png", "b.jpg"):
        draw_image(str(tmp_path / name), 30, 20, seed=1)
        first = (tmp_path / name).read_bytes()
        draw_image(str(tmp_path / name), 30, 20, seed=1)
        assert (tmp_path / name).read_bytes() == first
        assert Image.open(tmp_path / name).size == (30, 20)


def test_text_only_model_has_no_processor() -> None:
    assert load_processor(ensure_demo_target()) is None
    with pytest.raises(UsageError, match="no image processor"):
        load_processor(ensure_demo_target(), max_pixels=1000)


def test_pixel_limits_set_the_qwen_size_and_are_refused_elsewhere(tmp_path) -> None:
    image = draw_image(str(tmp_path / "a.png"), 200, 150)
    messages = [{"role": "user", "content": [{"type": "image", "path": image}, {"type": "text", "text": "hi"}]}]
    lengths = []
    for limits in ({}, {"min_pixels": 1000, "max_pixels": 28 * 28 * 4}):
        processor = load_processor(vlm_target("qwen2_5_vl"), **limits)
        lengths.append(len(processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]))
    assert processor_record(processor).size == {"shortest_edge": 1000, "longest_edge": 28 * 28 * 4}
    assert lengths[1] < lengths[0]  # 200x150 keeps its size by default; within 3136 pixels it is one merged patch
    with pytest.raises(UsageError, match="min-pixels <= max-pixels"):
        load_processor(vlm_target("qwen3_vl"), min_pixels=5000, max_pixels=1000)
    with pytest.raises(UsageError, match="no pixel budget"):
        load_processor(vlm_target("gemma3"), max_pixels=1000)


def test_released_qwen_layout_loads_without_torchvision(tmp_path) -> None:
    # A released Qwen2.5-VL directory: preprocessor_config.json (processor_class inside), no processor_config.json.
    source = vlm_target("qwen2_5_vl")
    released = tmp_path / "released"
    released.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        (released / name).write_bytes(open(os.path.join(source, name), "rb").read())
    (released / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor",
            }
        )  # fmt: skip
    )
    record = processor_record(load_processor(str(released)))
    assert record.processor == "Qwen2_5_VLProcessor"
    assert record.size == {"shortest_edge": 3136, "longest_edge": 12845056}
