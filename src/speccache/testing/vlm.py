"""Tiny random-weight vision-language targets, saved like released checkpoints (test support, never imported by
the package).

Four families: ``qwen2_5_vl`` (Qwen2.5-VL), ``qwen3_vl`` (Qwen3-VL), ``gemma3`` (Gemma 3) and ``llava``
(LLaVA-1.5). Each directory holds the model weights and config, the tokenizer, the processor's files and the
chat template, as ``save_pretrained`` writes them, and loads offline. The tokenizer is the offline SmolLM2 one
(the directory :func:`speccache.demo.real_target.ensure_real_target` builds, passed in: test support imports no
demo) with the family's special tokens added; the language
model is tiny (hidden 64, 2 layers) with seeded random weights.

The processor settings are the released checkpoints' (their ``preprocessor_config.json`` /
``processor_config.json``):

* Qwen2.5-VL: Qwen/Qwen2.5-VL-7B-Instruct (``min_pixels`` 3136, ``max_pixels`` 12845056, patch 14, merge 2,
  temporal patch 2, CLIP mean/std); chat template: the released Qwen2-VL/Qwen2.5-VL one (also in transformers'
  tests/models/qwen2_vl/test_processing_qwen2_vl.py).
* Qwen3-VL: Qwen/Qwen3-VL-*-Instruct (``size`` shortest_edge 65536 / longest_edge 16777216, patch 16, merge 2,
  mean/std 0.5); chat template: Qwen3-VL-style (the released ``render_content`` macro with plain turns; the
  tool branches are left out).
* Gemma 3: google/gemma-3-4b-it (resample 2, mean/std 0.5, no pan-and-scan), except the image size: 56x56 and
  4 tokens per image instead of 896x896 and 256 (the vision tower must match both; tiny keeps tests fast);
  chat template: the released one.
* LLaVA-1.5: llava-hf/llava-1.5-7b-hf (CLIP image processor, bicubic, center crop, CLIP mean/std, patch 14,
  ``vision_feature_select_strategy`` default, one CLS token), except the image size: 28 (4 tokens per image)
  instead of 336 (576); chat template: the released one.

Builds are cached by content (:func:`ensure_vlm_target`), so tests build each family once per machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from speccache.data import tokenizer_hash
from speccache.data._processor import image_only

__all__ = ["FAMILIES", "build_vlm_target", "draw_image", "ensure_vlm_target"]

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava")
VLM_VERSION = 3  # 2: four decoder layers (EAGLE-3 reads three distinct ones); 3: Gemma 3's projector not zero
_MARKER = "speccache_vlm_target.json"
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
_VISION = {"hidden_size": 32, "intermediate_size": 64}
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

_QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
_QWEN3_VL_TEMPLATE = """{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                <|vision_start|><|image_pad|><|vision_end|>
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                <|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, false) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, True) %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
_GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
_LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'ASSISTANT:' }}{% endif %}"
)
_QWEN_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
_GEMMA_TOKENS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}


def _tokenizer(source: str, extra: dict[str, str], turns: tuple[str, ...] = ()) -> Any:
    from transformers import AutoTokenizer

    # extra_special_tokens adds the tokens and the attributes processors read (tokenizer.image_token, ...).
    tokenizer = AutoTokenizer.from_pretrained(source, extra_special_tokens=extra)
    if turns:
        tokenizer.add_special_tokens({"additional_special_tokens": list(turns)}, replace_extra_special_tokens=False)
    return tokenizer


def _text_config(tokenizer: Any, end_token: str, **extra: Any) -> dict:
    return {
        **_TEXT,
        "vocab_size": len(tokenizer),
        "num_key_value_heads": 2,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids(end_token),
        "pad_token_id": tokenizer.pad_token_id,
        **extra,
    }


def _qwen2_5_vl(source: str) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(source, _QWEN_TOKENS)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2,
        image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
    )  # fmt: skip
    processor = image_only(Qwen2_5_VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=_QWEN2_5_VL_TEMPLATE
    )
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer, "<|im_end|>", rope_parameters=rope),
        vision_config={
            **_VISION, "depth": 2, "num_heads": 2, "out_hidden_size": _TEXT["hidden_size"], "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
        },
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config), processor


def _qwen3_vl(source: str) -> tuple[Any, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(source, _QWEN_TOKENS)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    processor = image_only(Qwen3VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=_QWEN3_VL_TEMPLATE
    )
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config=_text_config(tokenizer, "<|im_end|>", head_dim=16, rope_parameters=rope),
        vision_config={
            **_VISION, "depth": 2, "num_heads": 2, "out_hidden_size": _TEXT["hidden_size"], "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=processor.vision_start_token_id,
        vision_end_token_id=processor.vision_end_token_id,
    )  # fmt: skip
    return Qwen3VLForConditionalGeneration(config), processor


def _gemma3(source: str, image_size: int = 56, tokens_per_image: int = 4) -> tuple[Any, Any]:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer(source, _GEMMA_TOKENS, ("<start_of_turn>", "<end_of_turn>"))
    image_processor = Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size}, resample=2, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=[0.5] * 3, image_std=[0.5] * 3, do_convert_rgb=None, do_pan_and_scan=None,
    )  # fmt: skip
    # image_seq_length must equal mm_tokens_per_image: a square whose side divides image_size / patch_size.
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=_GEMMA3_TEMPLATE,
        image_seq_length=tokens_per_image,
    )
    config = Gemma3Config(
        text_config=_text_config(tokenizer, "<end_of_turn>", head_dim=16, sliding_window=16),
        vision_config={
            **_VISION, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": image_size, "patch_size": 14,
            "vision_use_head": False,
        },
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config)
    # transformers initialises the projector's weight to zeros: no image would reach the language model
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.1)
    return model, processor


def _llava(source: str, image_size: int = 28) -> tuple[Any, Any]:
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = _tokenizer(source, {"image_token": "<image>"})
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        do_center_crop=True, resample=3, image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
    )  # fmt: skip
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=_LLAVA_TEMPLATE,
    )  # fmt: skip
    text = {key: value for key, value in _text_config(tokenizer, "<|im_end|>").items() if key != "eos_token_id"}
    config = LlavaConfig(
        text_config={"model_type": "llama", **text},
        vision_config={
            **_VISION, "model_type": "clip_vision_model", "num_hidden_layers": 2, "num_attention_heads": 2,
            "image_size": image_size, "patch_size": 14, "projection_dim": 32,
        },
        image_token_index=processor.image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )  # fmt: skip
    return LlavaForConditionalGeneration(config), processor


_BUILDERS = {"qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "gemma3": _gemma3, "llava": _llava}


def _marker(family: str, seed: int, tokenizer: str) -> dict:
    return {
        "vlm_version": VLM_VERSION,
        "family": family,
        "seed": seed,
        "tokenizer_hash": tokenizer_hash(_tokenizer(tokenizer, {})),
    }


def build_vlm_target(path: str, family: str, tokenizer: str, seed: int = 0) -> str:
    """Build (or reuse) the tiny ``family`` target in directory ``path``.

    Written to a temporary sibling and renamed into place, as :func:`speccache.demo.build_tiny_model_dir`.

    Args:
        path: Target directory; must not exist, be empty, or hold this same build.
        family: One of :data:`FAMILIES`.
        tokenizer: The model directory whose tokenizer the target extends (the SmolLM2 one:
            ``speccache.demo.real_target.ensure_real_target()``).
        seed: Torch seed of the random weights.

    Returns:
        ``path`` as an absolute string.

    Raises:
        ValueError: unknown ``family``.
        FileExistsError: ``path`` holds something else.
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown VLM family {family!r}; use one of {', '.join(FAMILIES)}")
    final = Path(path).expanduser().resolve()
    wanted = _marker(family, seed, tokenizer)
    try:
        if json.loads((final / _MARKER).read_text(encoding="utf-8")) == wanted:
            return str(final)
    except (OSError, ValueError):
        pass
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"{final} exists but does not hold the tiny {family} target; delete it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, processor = _BUILDERS[family](tokenizer)
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(wanted, indent=2) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def ensure_vlm_target(family: str, tokenizer: str, root: str | None = None) -> str:
    """The tiny ``family`` target's directory, built on first use.

    Args:
        family: One of :data:`FAMILIES`.
        tokenizer: As :func:`build_vlm_target`'s.
        root: The folder of the targets (default ``$SPECCACHE_VLM_TARGETS`` or ``~/.cache/speccache``).

    Returns:
        The directory ``<root>/vlm-<family>-v<version>``.

    Raises:
        FileExistsError: the directory holds another build (e.g. from another tokenizer); delete it.
    """
    root = root or os.environ.get("SPECCACHE_VLM_TARGETS") or os.path.join("~", ".cache", "speccache")
    return build_vlm_target(os.path.join(root, f"vlm-{family}-v{VLM_VERSION}"), family, tokenizer)


def draw_image(path: str, width: int = 56, height: int = 84, seed: int = 0) -> str:
    """Draw a small deterministic picture (a square and a diagonal on a coloured ground) to ``path``.

    The format follows the suffix (``.png``, ``.jpg``...).

    Returns:
        ``path``.
    """
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), ((20 + 40 * seed) % 256, 120, 200))
    draw = ImageDraw.Draw(image)
    draw.rectangle([width // 4, height // 4, 3 * width // 4, 3 * height // 4], fill=(250, 30, 30))
    draw.line([0, 0, width, height], fill=(0, 255, 0), width=3)
    image.save(path)
    return path
