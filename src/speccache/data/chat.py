"""Chat data loading and tokenisation for the feature precompute.

Input files are ``.jsonl`` (one JSON object per line, blank lines ignored), ``.jsonl.gz`` / ``.jsonl.zst``
(the same, compressed; a file that ends inside a gzip member or zstd frame is an error, not a shorter file),
``.json`` (one JSON list of objects), ``.parquet`` (read in place with ``pyarrow``, never copied into a cache),
or a directory written by Hugging Face ``datasets``' ``save_to_disk`` (read through ``datasets``, memory-mapped
Arrow; ``--data-split`` chooses a ``DatasetDict``'s split, and is refused for data without splits), or a
directory ``speccache regenerate`` wrote (its parts' rows in order, once the run is complete). A row is one of:

* ShareGPT / FastChat: ``{"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant", "value": str},
  ...]}`` (``human`` means ``user`` and ``gpt`` means ``assistant``; ``function_call``, whose value is the JSON
  of a call ``{"name", "arguments"}`` or a list of them, is an assistant tool call, and ``observation`` a tool
  result), with an optional top-level ``"system"`` string that becomes the first message;
* OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool"|"ipython", "content": str}, ...]}``, an
  assistant's ``tool_calls`` (arguments an object or its JSON text, decoded) and reasoning
  (``reasoning_content``, ``reasoning`` or ``thinking``), content as a list of text parts (joined by newlines),
  every other field kept for the template;
* either chat form with a top-level ``"tools"`` list of tool schemas (or its JSON text);
* pre-tokenized: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` of equal, non-zero length; a row
  with ``input_ids`` is read as pre-tokenized whatever chat text it also holds (regenerate's rows hold both);
* for a vision-language target (``processor``): chat rows with images, as :mod:`speccache.data._images` reads
  them, rendered by the processor (:mod:`speccache.data._vision`); a row with images is an error otherwise.

Other keys (``"id"``...) are ignored. Rows are named in messages as ``file:line`` (1-based line) for JSON
lines and ``file[index]`` (0-based) otherwise. A sample's ``source_row`` is its 0-based row number: the
0-based line of a JSON-lines file, the index in a ``.json`` list, a Parquet file or a dataset.

Loss mask: see :mod:`speccache.data.template` (what the model generates in each assistant turn, located in
one rendering of the whole conversation, for any template; docs/data.md). With ``--expand-turns`` a row gives
one sample per assistant turn, and each records its turn beside its ``source_row``. Samples are truncated to
``max_length`` tokens after masking; a row left without a masked token is skipped and counted, not an error.

Skip reasons (``DataStats.skipped``): ``malformed`` (not a valid row), ``template_error`` (the chat template
rejected it), ``mask_unplaceable`` (its assistant turns cannot be located), ``no_assistant_token`` (nothing
to train on), ``no_assistant_within_max_length`` (its assistant tokens all lie beyond ``max_length``),
``dropped_fields`` (its rendering lacks a field it carries, with ``on_dropped="skip"``), ``bad_image`` (an image
is missing or unreadable), ``image_row_beyond_max_length`` (an image row is longer than ``max_length``: never cut
inside an image, it is left out whole). ``malformed``, ``template_error``, ``mask_unplaceable`` and ``bad_image``
are errors unless ``skip_bad_rows``; ``no_assistant_token``, ``no_assistant_within_max_length`` and
``image_row_beyond_max_length`` are always skipped and counted.

Dropped fields: a chat row's rendering is checked for every field the row carries (:func:`dropped_fields`);
``on_dropped`` keeps such a row and counts it (``DataStats.dropped``, ``warn``), skips it, or fails.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from speccache.data._encode import encode
from speccache.data._failure import RowFailure
from speccache.data._files import raw_rows
from speccache.data._images import image_root_of
from speccache.data._mistral import MistralCommonFormat
from speccache.data._pool import Encoder
from speccache.data._samples import (
    DROPPED,
    DataStats,
    DroppedField,
    SampleBuilder,
    TokenizedSample,
    TokenizedSamples,
    check_dropped_mode,
    dropped_error,
    keep,
)
from speccache.data._vision import Vision
from speccache.data.template import ChatFormat, chat_format

__all__ = ["load_samples", "merge_parts", "tokenize_row"]


def _default_format(tokenizer: Any) -> ChatFormat | MistralCommonFormat | None:
    return chat_format(tokenizer)


def tokenize_row(
    row: dict,
    tokenizer: Any,
    max_length: int,
    *,
    where: str,
    source_row: int = -1,
    fmt: ChatFormat | MistralCommonFormat | None = None,
) -> TokenizedSample | None:
    """Tokenize one row and build its assistant-only loss mask (see the module docstring).

    With ``fmt.expand_turns`` the row gives one sample per assistant turn; this returns the first.

    Args:
        row: A ShareGPT, OpenAI or pre-tokenized row object.
        tokenizer: The target's fast Hugging Face tokenizer.
        max_length: Keep at most this many tokens (>= 1).
        where: How to name the row in error messages, e.g. ``"data.jsonl:12"``.
        source_row: Stored as ``TokenizedSample.source_row``.
        fmt: The chat format (default: the tokenizer's template, reasoning kept, today's date).

    Returns:
        The sample, or None when it has no assistant token (after truncation).

    Raises:
        DataError: The row is malformed or cannot be masked (message starts with ``where``), or the
            tokenizer has no chat template.
        ValueError: ``max_length`` < 1.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    encoded, _, _ = encode(row, tokenizer, fmt or _default_format(tokenizer), where)
    kept = [(turn, ids, mask) for turn, ids, mask in encoded or () if mask[:max_length].any()]
    if not kept:
        return None
    turn, ids, mask = kept[0]
    return TokenizedSample(ids[:max_length].tolist(), mask[:max_length].tolist(), source_row, turn)


def load_samples(
    path: str,
    tokenizer: Any,
    max_length: int,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    fmt: ChatFormat | MistralCommonFormat | None = None,
    num_proc: int = 1,
    part: tuple[int, int] = (0, 1),
    split: str | None = None,
    on_dropped: str = "warn",
    processor: Any = None,
    image_root: str | None = None,
) -> tuple[TokenizedSamples, DataStats]:
    """Read and tokenize a data file, in file order.

    Args:
        path: A data file or saved dataset (see the module docstring).
        tokenizer: The target's fast Hugging Face tokenizer.
        max_length: Truncate each sample to this many tokens (>= 1).
        limit: Stop after this many usable samples; None reads the whole file.
        skip_bad_rows: Count and skip rows that fail (malformed, template errors, unplaceable masks).
        fmt: The chat format (default: the tokenizer's template, reasoning kept, today's date).
        num_proc: Tokenize in this many worker processes (1: in this process).
        part: ``(rank, world)``: read only every ``world``-th row from the ``rank``-th (see :func:`merge_parts`).
        split: The split of a saved ``DatasetDict`` or hub dataset.
        on_dropped: A row whose rendering lacks a field it carries (:func:`dropped_fields`) is kept and counted
            in ``DataStats.dropped`` (``warn``), skipped as ``dropped_fields`` (``skip``), or an error (``fail``).
        processor: A vision-language target's processor (:mod:`speccache.data._processor`): chat rows, with
            images or without, are rendered by it (ids with each image's tokens; docs/vision.md). None: a
            text-only target, and a row with images is a row error.
        image_root: The folder relative image paths resolve against (default: the data file's folder).

    Returns:
        The usable samples (possibly none) and what was read, skipped and dropped.

    Raises:
        DataError: The file cannot be read or parsed as a whole; a row fails and ``skip_bad_rows``
            is false; a row's rendering drops a field under ``on_dropped="fail"``; chat rows but no chat template.
        ValueError: ``max_length`` < 1, ``limit`` < 0, ``num_proc`` < 1, a bad ``part`` or ``on_dropped``.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    check_dropped_mode(on_dropped)
    rank, world = part
    if not 0 <= rank < world or (world > 1 and limit is not None):
        raise ValueError(f"part must be (rank, world) with 0 <= rank < world, and no limit when world > 1; got {part}")
    builder = SampleBuilder()
    stats = DataStats()
    if limit == 0:
        return builder.build(), stats
    fmt = fmt or _default_format(tokenizer)
    rows = (r for i, r in enumerate(raw_rows(path, split)) if i % world == rank)
    root = image_root_of(path, image_root)
    vision = None if processor is None else Vision(processor, root)
    with Encoder(tokenizer, fmt, num_proc, vision) as encoder:
        for row_no, where, encoded, error, dropped, images in encoder.encode(rows):
            stats.rows_read += 1
            if error is None and dropped and on_dropped != "warn":
                error = dropped_error(where, dropped, on_dropped)
            if error is not None:
                if not isinstance(error, RowFailure) or not (skip_bad_rows or error.reason == DROPPED):
                    error.row = row_no  # type: ignore[attr-defined]  # which rank's error comes first
                    if isinstance(error, RowFailure) and "--skip-bad-rows" not in str(error):
                        error.args = (f"{error} (or skip such rows with --skip-bad-rows)",)
                    raise error
                stats.skip(row_no, error.reason, str(error))
                continue
            if keep(builder, stats, row_no, encoded, max_length, images):
                stats.drop([DroppedField(row_no, where, message, name) for message, name in dropped])
                if limit is not None and len(builder) >= limit:
                    break
    return builder.build(), stats


def merge_parts(parts: Sequence[tuple[TokenizedSamples, DataStats]]) -> tuple[TokenizedSamples, DataStats]:
    """Join what ``load_samples(part=(rank, world))`` read on each rank, for ``rank`` in ``range(world)``.

    Returns:
        Exactly what one ``load_samples`` over the whole file returns: samples and skipped rows in row order.
    """
    builder, stats = SampleBuilder(), DataStats()
    rows = [
        [(int(r), k, i) for i, r in enumerate(samples.source_rows.tolist())] for k, (samples, _) in enumerate(parts)
    ]
    for row, k, i in heapq.merge(*rows):
        ids, mask = parts[k][0].arrays(i)
        builder.add(ids, mask, row, int(parts[k][0].turns[i]), parts[k][0].images.get(i, ()))
    for _, part_stats in parts:
        stats.rows_read += part_stats.rows_read
        stats.rows_truncated += part_stats.rows_truncated
    for skipped in heapq.merge(*(s.skipped_rows for _, s in parts), key=lambda r: r.row):
        stats.skip(skipped.row, skipped.reason, skipped.detail)
    for _, fields in itertools.groupby(
        heapq.merge(*(s.dropped_rows for _, s in parts), key=lambda d: d.row), lambda d: d.row
    ):
        stats.drop(list(fields))
    return builder.build(), stats
