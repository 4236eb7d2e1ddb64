"""One row to its full-length samples: pre-tokenized ids, or chat messages rendered, tokenized and masked."""

from __future__ import annotations

from typing import Any

import numpy as np

from speccache.data._dropped import dropped_fields
from speccache.data._failure import not_an_object, row_error
from speccache.data._images import has_images
from speccache.data._messages import chat_messages
from speccache.data._mistral import MistralCommonFormat
from speccache.data._samples import Sample
from speccache.data._vision import Vision, encode_images, pretokenized_sources
from speccache.data.template import ChatFormat, samples_and_text
from speccache.errors import DataError

__all__ = ["encode"]


def _pretokenized(row: dict, tokenizer: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = row["input_ids"], row.get("loss_mask")
    vocab = len(tokenizer)
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise row_error(
            f"{where}: 'input_ids' must be a non-empty list of integer ids in [0, {vocab}); "
            "re-tokenize the row with the target's tokenizer"
        )
    if not isinstance(mask, list) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise row_error(f"{where}: a pre-tokenized row needs 'loss_mask', a list of 0/1 integers; fix the row")
    if len(mask) != len(ids):
        raise row_error(f"{where}: 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}; they must match")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def _pretokenized_turns(
    ids: np.ndarray, mask: np.ndarray, fmt: ChatFormat | MistralCommonFormat | None
) -> list[Sample]:
    """A pre-tokenized row's samples under ``--turns`` and ``--expand-turns``: its turns are the runs of 1 in
    its loss mask (an answer regenerate wrote is one run, and the template text between two answers is not)."""
    if fmt is None or (fmt.turns == "all" and not fmt.expand_turns):
        return [(-1, ids, mask)]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))

    def only(start: int, end: int) -> np.ndarray:
        kept = np.zeros(len(ids), dtype=np.uint8)
        kept[start:end] = 1
        return kept

    if fmt.expand_turns:
        return [(k, ids[:end], only(start, end)[:end]) for k, (start, end) in enumerate(runs)]
    return [(-1, ids, only(*runs[-1]) if runs else mask)]


def encode(
    row: Any, tokenizer: Any, fmt: ChatFormat | MistralCommonFormat | None, where: str, vision: Vision | None = None
) -> tuple[list[Sample] | None, list[tuple[int, str]], list[tuple[str, ...]]]:
    """Full-length samples of a row (one, or one per assistant turn; None when it has no assistant message), the
    ``(message, field)`` pairs the row carries but its samples' text lacks (see :func:`dropped_fields`), and per
    sample the sources of its images (empty for a text-only target).

    With ``vision`` (a vision-language target) chat rows, with images or without, are rendered by its processor
    (:mod:`speccache.data._vision`); without it, a row with images is an error."""
    if not isinstance(row, dict):
        raise not_an_object(where, row)
    if "input_ids" in row:
        # The ids win over any chat text beside them: they are exactly what the model saw and wrote (rows of
        # speccache regenerate carry both), and its text re-tokenized may differ.
        ids, mask = _pretokenized(row, tokenizer, where)
        samples = _pretokenized_turns(ids, mask, fmt)
        return samples, [], [] if vision is None else pretokenized_sources(row, samples, vision, where)
    if vision is None and has_images(row):
        raise row_error(
            f"{where}: the row has images, but the target has no image processor (a text-only model); "
            "use a vision-language target, or drop the images from the row"
        )
    if fmt is None:
        messages, _ = chat_messages(row, where)
        if not any(m["role"] == "assistant" for m in messages):
            return None, [], []
        raise DataError(
            f"{where}: chat rows need a tokenizer with a chat template, and this tokenizer has none; "
            "pass --chat-template FILE, use a target whose tokenizer defines chat_template, or pre-tokenized rows"
        )
    if vision is not None:
        return encode_images(row, tokenizer, fmt, vision, where)
    messages, tools = chat_messages(row, where)
    if not any(m["role"] == "assistant" for m in messages):
        return None, [], []
    samples, text = samples_and_text(tokenizer, fmt, messages, where, tools)
    if fmt.expand_turns:  # its samples end with the last assistant turn
        messages = messages[: max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1]
    return samples, dropped_fields(messages, fmt.tools if tools is None else tools, text), []
