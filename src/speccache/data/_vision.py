"""Rows rendered for a vision-language target: ids as its processor gives them, the loss mask carried over.

The ids of a row are ``processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]``,
which expands each image's placeholder into the image's tokens. The loss mask is the one
:mod:`speccache.data.template` builds on the unexpanded rendering (the same template, the images as bare
placeholders), carried onto the expanded ids by aligning the two id sequences: tokens the expansion leaves alone
keep their mask, tokens it writes (the image tokens) are never supervised, and an assistant token the expansion
changes, or a difference wider than 64 tokens (each image's run of image tokens counted as one), is a row error
(``mask_unplaceable``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from speccache.data._dropped import dropped_fields
from speccache.data._failure import RowFailure, row_error, unplaceable
from speccache.data._images import RowImage, has_images, image_messages
from speccache.data._mistral import MistralCommonFormat
from speccache.data._samples import Sample
from speccache.data.template import ChatFormat, masked_text
from speccache.errors import DataError

__all__ = [
    "MODALITY_KEYS",
    "Vision",
    "bare_images",
    "encode_images",
    "image_count",
    "image_token_id",
    "pretokenized_sources",
    "processor_inputs",
]


@dataclass(frozen=True)
class Vision:
    """What rendering rows for a vision-language target needs.

    Attributes:
        processor: the target's processor (:func:`speccache.data._processor.load_processor`).
        image_root: the folder relative image paths resolve against (``--image-root``).
    """

    processor: Any
    image_root: str


def image_token_id(processor: Any) -> int:
    """The id of the token each image is expanded into (``<|image_pad|>``, ``<image_soft_token>``, ``<image>``)."""
    tokenizer = processor.tokenizer
    token = getattr(tokenizer, "image_token", None) or processor.image_token
    return int(tokenizer.convert_tokens_to_ids(token))


MODALITY_KEYS = ("mm_token_type_ids", "token_type_ids")
"""The processor outputs given per token (Qwen's, Gemma 3's); its other image outputs are per image."""
_PIXEL_KEYS = ("pixel_values", "image_grid_thw")


def image_count(ids: Sequence[int] | np.ndarray, image_token: int) -> int:
    """How many images ``ids`` hold: the runs of ``image_token`` (every family writes text between two images'
    tokens: Qwen's vision start and end, Gemma 3's start and end of image, LLaVA's newline)."""
    at = np.asarray(ids) == image_token
    return int(at[0]) + int((at[1:] & ~at[:-1]).sum()) if len(at) else 0


def processor_inputs(processor: Any, ids: Sequence[int], images: list[Any], where: str) -> dict[str, Any]:
    """What the target's forward takes for ``ids`` besides them: the processor's per-token modality ids for
    ``ids`` and, for ``images`` (PIL images, in order; none for a text sample), the pixels and grids its chat
    rendering made for them (torch tensors).

    Raises:
        DataError: the processor expands ``images`` into another number of image tokens than ``ids`` hold (the
            images or the pixel settings changed since ``ids`` were made); ``where`` names the row.
    """
    import torch

    out: dict[str, Any] = {}
    modality = next((k for k in MODALITY_KEYS if k in processor.model_input_names), None)
    if modality is not None:
        out[modality] = torch.tensor(processor.create_mm_token_type_ids([list(ids)])[0], dtype=torch.int64)
    if not images:
        return out
    # the processor's own call on its placeholders: the pixels (and grids) its chat rendering made
    made = processor(text=[processor.image_token * len(images)], images=images, return_tensors="pt")
    token = image_token_id(processor)
    want, have = int((made["input_ids"] == token).sum()), int((np.asarray(ids) == token).sum())
    if want != have:
        raise DataError(
            f"{where}: its {len(images)} image(s) now make {want} image tokens but the sample holds {have}: the "
            "images or the processor changed since the row was read; rerun on unchanged images with the same "
            "--min-pixels/--max-pixels"
        )
    out.update((k, v) for k, v in made.items() if k in _PIXEL_KEYS)
    return out


_ANCHOR = 4  # tokens that must agree for the two renderings to be back in step after an image
_WINDOW = 64  # how far (in tokens, each image's run of image tokens counted as one) an image may shift them


def _resync(a: list[int], b: list[int], i: int, j: int) -> tuple[int, int] | None:
    """The least ``(di, dj)`` (by their sum) after which ``a[i + di:]`` and ``b[j + dj:]`` agree again for
    :data:`_ANCHOR` tokens, or both end; None if none lies within :data:`_WINDOW`."""
    for total in range(1, 2 * _WINDOW + 1):
        for di in range(max(0, total - _WINDOW), min(total, _WINDOW) + 1):
            x, y = i + di, j + total - di
            if x <= len(a) and y <= len(b) and a[x : x + _ANCHOR] == b[y : y + _ANCHOR]:
                return di, total - di
    return None


def _carry(unexpanded: np.ndarray, mask: np.ndarray, expanded: np.ndarray, image_token: int, where: str) -> np.ndarray:
    """``mask`` (of ``unexpanded``) moved onto ``expanded``; 0 on every token the expansion wrote.

    The two agree but where an image's placeholder was expanded (the image's tokens, and whatever the
    processor writes and re-tokenizes around them), so they are walked together, getting back in step past each
    difference; each run of image tokens counts as one token, so the walk is linear in the length.
    """
    keep = np.ones(len(expanded), dtype=bool)
    keep[1:] = (expanded[1:] != image_token) | (expanded[:-1] != image_token)
    a, b, m = unexpanded.tolist(), expanded[keep].tolist(), mask.tolist()
    carried = [0] * len(b)
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            carried[j] = m[i]
            i, j = i + 1, j + 1
            continue
        step = _resync(a, b, i, j)
        if step is None or any(m[i : i + step[0]]):
            raise unplaceable(where, "the processor's image expansion changes assistant tokens")
        i, j = i + step[0], j + step[1]
    if any(m[i:]) or sum(carried) != sum(m):
        raise unplaceable(where, "the processor's rendering differs from the chat template's")
    out = np.zeros(len(expanded), dtype=np.uint8)
    out[keep] = carried
    return out


def _processor_ids(vision: Vision, fmt: ChatFormat, messages: list[dict], tools: Any, where: str) -> np.ndarray:
    try:
        out = vision.processor.apply_chat_template(
            fmt.with_system_prompt(messages),
            chat_template=fmt.template,
            tools=tools,
            tokenize=True,
            return_dict=True,
        )
    except (ValueError, TypeError, OSError) as e:
        raise RowFailure(
            f"{where}: the processor cannot render the row ({type(e).__name__}: {e}); fix the row or skip such rows "
            "with --skip-bad-rows",
            "template_error",
        ) from e
    return np.asarray(out["input_ids"][0], dtype=np.int32)


def encode_images(
    row: dict, tokenizer: Any, fmt: ChatFormat | MistralCommonFormat, vision: Vision, where: str
) -> tuple[list[Sample] | None, list[tuple[int, str]], list[tuple[str, ...]]]:
    """A chat row's samples for a vision-language target, its dropped fields (as :func:`encode`'s) and, per
    sample, the sources of the images in it (:attr:`RowImage.source`, in order).

    Raises:
        RowFailure: the row is not valid, its images cannot be loaded or placed, or its mask cannot be carried.
        DataError: the target's chat format is mistral-common's.
    """
    if isinstance(fmt, MistralCommonFormat):
        raise DataError(f"{where}: mistral-common tokenizers are not read with images; use a chat-template target")
    messages, tools, images = image_messages(row, where, vision.image_root)
    if not any(m["role"] == "assistant" for m in messages):
        return None, [], []
    tools = fmt.tools if tools is None else tools
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prefixes = [(k, ends[k] + 1, "last", f"{where} (turn {k})") for k in range(len(ends))]
    samples, sources, texts = [], [], []
    for turn, end, turns, name in prefixes if fmt.expand_turns else [(-1, len(messages), None, where)]:
        part = messages[:end]
        ids, mask, text = masked_text(tokenizer, fmt, bare_images(part), name, tools, turns)
        expanded = _processor_ids(vision, fmt, part, tools, name)
        samples.append((turn, expanded, _carry(ids, mask, expanded, image_token_id(vision.processor), name)))
        sources.append(_sources(part, images))
        texts.append(text)
    kept = messages[: ends[-1] + 1] if fmt.expand_turns else messages
    return samples, dropped_fields(_as_text(kept), tools, "\n".join(texts)), sources


def bare_images(messages: list[dict]) -> list[dict]:
    """The messages with each image part a bare placeholder, as the template sees it (no pixels)."""
    return [
        {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def _sources(messages: list[dict], images: list[RowImage]) -> tuple[str, ...]:
    count = sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image")
    return tuple(image.source for image in images[:count])


def _as_text(messages: list[dict]) -> list[dict]:
    """The messages with each list of parts as its text, as :func:`dropped_fields` reads them."""
    return [
        {**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def pretokenized_sources(row: dict, samples: list[Sample], vision: Vision, where: str) -> list[tuple[str, ...]]:
    """Per sample of a pre-tokenized row, the sources of the images its ids hold: the row's images in order (a row
    ``speccache regenerate`` wrote keeps its input's images beside the ids), as many as the sample's image runs.

    Raises:
        RowFailure: the row's images cannot be loaded, or are fewer than its ids hold.
    """
    images = image_messages(row, where, vision.image_root)[2] if has_images(row) else []
    token = image_token_id(vision.processor)
    out = []
    for _, ids, _ in samples:
        count = image_count(ids, token)
        if count > len(images):
            raise row_error(f"{where}: its input_ids hold {count} image(s) but the row gives {len(images)}; "
                            "give the row's images beside its ids")  # fmt: skip
        out.append(tuple(image.source for image in images[:count]))
    return out
