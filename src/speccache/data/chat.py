"""Chat data loading and tokenisation for the feature precompute.

Input files are ``.jsonl`` (one JSON object per line, blank lines ignored) or
``.json`` (one JSON list of objects). A row is one of:

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant", "value": str}, ...]}``
  (``human`` means ``user`` and ``gpt`` means ``assistant``);
* OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``;
* pre-tokenized: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` of equal, non-zero length.

Other keys (``"id"``...) are ignored. Rows are named in messages as ``file:line``
(1-based line) for ``.jsonl`` and ``file[index]`` (0-based) for ``.json``.

Loss-mask convention: chat rows are rendered with the tokenizer's chat template
and the mask is 1 on the tokens the assistant produces, nothing else.

* If the template wraps assistant output in ``{% generation %}...{% endgeneration %}``
  (and the tokenizer is fast), the mask is transformers' ``assistant_masks``:
  every token overlapping a generation span. The demo template wraps each
  assistant ``content`` plus its closing ``<|end|>``, so the masked tokens decode
  to exactly ``content + "<|end|>"`` per assistant turn.
* Otherwise the mask is found by prefix difference: for each assistant message
  ``i``, the tokens of ``messages[:i]`` with ``add_generation_prompt=True`` must be a
  prefix of the tokens of ``messages[:i + 1]``, which must be a prefix of the whole
  conversation's tokens; the tokens in between (the turn minus its generation
  prompt, including whatever end-of-turn text the template appends) are masked.
  A template for which this prefix property fails raises :class:`DataError`.

A conversation must not start with an assistant message. Samples are truncated
to ``max_length`` tokens after masking; a sample whose mask is then all zero is
skipped and counted, not an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from speccache.errors import DataError
from speccache.format import file_checksum

__all__ = [
    "DataStats",
    "TokenizedSample",
    "file_content_hash",
    "iter_rows",
    "load_samples",
    "tokenize_row",
    "tokenizer_hash",
]

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
_ROW_KEYS = ("conversations", "messages", "input_ids")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MAX_BAD_ROW_MESSAGES = 5


class _RowError(DataError):
    """One row is malformed; ``load_samples(skip_bad_rows=True)`` skips these and only these."""


@dataclass(frozen=True)
class TokenizedSample:
    """One usable row, tokenized.

    Attributes:
        input_ids: Token ids, at most ``max_length`` of them.
        loss_mask: 1 where the token is assistant output, else 0; same length as ``input_ids``.
        source_row: 1-based line (``.jsonl``) or 0-based list index (``.json``) of the row.
    """

    input_ids: list[int]
    loss_mask: list[int]
    source_row: int


@dataclass
class DataStats:
    """What :func:`load_samples` read and dropped.

    Attributes:
        rows_read: Rows looked at, including skipped ones (blank lines are not rows).
        rows_skipped_no_assistant: Rows with no assistant token left after truncation.
        rows_skipped_bad: Malformed rows skipped because ``skip_bad_rows`` was set.
        rows_truncated: Kept samples that were cut to ``max_length``.
        bad_row_messages: The first few messages of skipped malformed rows.
    """

    rows_read: int = 0
    rows_skipped_no_assistant: int = 0
    rows_skipped_bad: int = 0
    rows_truncated: int = 0
    bad_row_messages: list[str] = field(default_factory=list)


def _check_file(path: str) -> str:
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}; check the path")
    if not os.path.isfile(path):
        raise DataError(f"data path is not a file: {path}; pass a .jsonl or .json file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".json"):
        raise DataError(
            f"unsupported data file extension {ext or '(none)'!r}: {path}; use .jsonl (one JSON object "
            "per line) or .json (a JSON list of objects)"
        )
    return ext


def _raw_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    """Yield ``(row number, where, parsed value)``; an unparsable ``.jsonl`` line yields a ``_RowError`` value."""
    if _check_file(path) == ".json":
        try:
            with open(path, encoding="utf-8-sig") as f:
                rows = json.load(f)
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
            ) from e
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); fix the file") from e
        if not isinstance(rows, list):
            raise DataError(
                f"{path}: a .json data file must hold a JSON list of row objects, got {type(rows).__name__}; "
                "wrap the rows in [...] or write one object per line to a .jsonl file"
            )
        for index, row in enumerate(rows):
            yield index, f"{path}[{index}]", row
        return
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield line_no, where, _RowError(f"{where}: not valid UTF-8 ({e.reason}); re-encode the line as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                yield line_no, where, json.loads(text)
            except json.JSONDecodeError as e:
                yield (
                    line_no,
                    where,
                    _RowError(
                        f"{where}: invalid JSON ({e.msg}, column {e.colno}); fix or remove the line, or skip bad rows"
                    ),
                )


def _not_an_object(where: str, value: Any) -> _RowError:
    return _RowError(f"{where}: expected a JSON object per row, got {type(value).__name__}; fix or remove the row")


def iter_rows(path: str) -> Iterator[tuple[int, dict]]:
    """Iterate over the row objects of a data file.

    Args:
        path: A ``.jsonl`` or ``.json`` file.

    Returns:
        An iterator of ``(row number, row)``: the 1-based line for ``.jsonl``, the
        0-based index for ``.json``.

    Raises:
        DataError: The file is missing or not a file, has another extension, holds
            invalid JSON or UTF-8, or a row is not a JSON object.
    """
    for row_no, where, value in _raw_rows(path):
        if isinstance(value, DataError):
            raise value
        if not isinstance(value, dict):
            raise _not_an_object(where, value)
        yield row_no, value


def _message_list(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str], where: str) -> list[dict]:
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise _RowError(f"{where}: {key!r} must be a non-empty list of messages; fix the row")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _RowError(f"{where}: {key}[{i}] must be an object with {role_key!r} and {text_key!r}; fix the row")
        role, text = turn.get(role_key), turn.get(text_key)
        if not isinstance(role, str) or role not in roles:
            raise _RowError(
                f"{where}: {key}[{i}].{role_key} must be one of {', '.join(roles)}, got {role!r}; fix the row"
            )
        if not isinstance(text, str):
            raise _RowError(
                f"{where}: {key}[{i}].{text_key} must be a string, got {type(text).__name__}; "
                "flatten multi-part content to plain text"
            )
        messages.append({"role": roles[role], "content": text})
    if messages[0]["role"] == "assistant":
        raise _RowError(f"{where}: the conversation starts with an assistant message; add the prompt before it")
    return messages


def _pretokenized(row: dict, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    ids, mask = row["input_ids"], row.get("loss_mask")
    vocab = len(tokenizer)
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise _RowError(
            f"{where}: 'input_ids' must be a non-empty list of integer ids in [0, {vocab}); "
            "re-tokenize the row with the target's tokenizer"
        )
    if not isinstance(mask, list) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise _RowError(f"{where}: a pre-tokenized row needs 'loss_mask', a list of 0/1 integers; fix the row")
    if len(mask) != len(ids):
        raise _RowError(f"{where}: 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}; they must match")
    return ids, mask


def _chat_template(tokenizer: Any, where: str) -> str:
    try:
        return tokenizer.get_chat_template()
    except ValueError as e:
        raise DataError(
            f"{where}: chat rows need a tokenizer with a chat template, and this tokenizer has none; "
            "use a target whose tokenizer defines chat_template, or pre-tokenized rows"
        ) from e


def _apply(tokenizer: Any, messages: list[dict], where: str, **kwargs: Any) -> Any:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except TemplateError as e:
        raise _RowError(
            f"{where}: the chat template rejected the conversation ({e}); fix the row's roles or order"
        ) from e


def _prefix_difference_mask(tokenizer: Any, messages: list[dict], ids: list[int], where: str) -> list[int]:
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = list(_apply(tokenizer, messages[:i], where, add_generation_prompt=True)["input_ids"])
        after = list(_apply(tokenizer, messages[: i + 1], where)["input_ids"])
        if after[: len(before)] != before or ids[: len(after)] != after:
            raise DataError(
                f"{where}: the chat template is not prefix-stable (rendering the conversation up to message {i} "
                "is not a prefix of rendering it further), so assistant tokens cannot be located; use a template "
                "that marks assistant output with {% generation %}, or pre-tokenized rows"
            )
        mask[len(before) : len(after)] = [1] * (len(after) - len(before))
    return mask


def _chat_tokens(tokenizer: Any, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    # transformers derives assistant_masks from character offsets, which only fast tokenizers report.
    if _GENERATION_TAG.search(_chat_template(tokenizer, where)) and tokenizer.is_fast:
        encoded = _apply(tokenizer, messages, where, return_assistant_tokens_mask=True)
        return list(encoded["input_ids"]), list(encoded["assistant_masks"])
    ids = list(_apply(tokenizer, messages, where)["input_ids"])
    return ids, _prefix_difference_mask(tokenizer, messages, ids, where)


def _encode(row: Any, tokenizer: Any, where: str) -> tuple[list[int], list[int]] | None:
    """Full-length ``(input_ids, loss_mask)`` of a row, or None for a conversation with no assistant message."""
    if not isinstance(row, dict):
        raise _not_an_object(where, row)
    kinds = [key for key in _ROW_KEYS if key in row]
    if len(kinds) != 1:
        found = ", ".join(repr(k) for k in kinds) if kinds else "none of them"
        raise _RowError(
            f"{where}: a row needs exactly one of 'conversations' (ShareGPT), 'messages' (OpenAI) or "
            f"'input_ids' with 'loss_mask' (pre-tokenized); found {found}; fix the row"
        )
    if kinds[0] == "input_ids":
        return _pretokenized(row, tokenizer, where)
    if kinds[0] == "conversations":
        messages = _message_list(row, "conversations", "from", "value", _SHAREGPT_ROLES, where)
    else:
        messages = _message_list(row, "messages", "role", "content", _OPENAI_ROLES, where)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return _chat_tokens(tokenizer, messages, where)


def _truncate(encoded: tuple[list[int], list[int]] | None, max_length: int, source_row: int) -> TokenizedSample | None:
    if encoded is None or not any(encoded[1][:max_length]):
        return None
    ids, mask = encoded
    return TokenizedSample(input_ids=ids[:max_length], loss_mask=mask[:max_length], source_row=source_row)


def tokenize_row(
    row: dict, tokenizer: Any, max_length: int, *, where: str, source_row: int = -1
) -> TokenizedSample | None:
    """Tokenize one row and build its assistant-only loss mask (see the module docstring).

    Args:
        row: A ShareGPT, OpenAI or pre-tokenized row object.
        tokenizer: The target's Hugging Face tokenizer.
        max_length: Keep at most this many tokens (>= 1).
        where: How to name the row in error messages, e.g. ``"data.jsonl:12"``.
        source_row: Stored as ``TokenizedSample.source_row``.

    Returns:
        The sample, or None when it has no assistant token (after truncation).

    Raises:
        DataError: The row is malformed (message starts with ``where``), the tokenizer
            has no chat template, or the template is not prefix-stable.
        ValueError: ``max_length`` < 1.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    return _truncate(_encode(row, tokenizer, where), max_length, source_row)


def load_samples(
    path: str,
    tokenizer: Any,
    max_length: int,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
) -> tuple[list[TokenizedSample], DataStats]:
    """Read and tokenize a data file, in file order.

    Args:
        path: A ``.jsonl`` or ``.json`` file.
        tokenizer: The target's Hugging Face tokenizer.
        max_length: Truncate each sample to this many tokens (>= 1).
        limit: Stop after this many usable samples; None reads the whole file.
        skip_bad_rows: Count and skip malformed rows instead of raising.

    Returns:
        The usable samples (possibly none) and what was read and skipped.

    Raises:
        DataError: The file cannot be read or parsed as a whole; a row is malformed
            and ``skip_bad_rows`` is false; the tokenizer has no chat template or
            its template is not prefix-stable.
        ValueError: ``max_length`` < 1 or ``limit`` < 0.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    samples: list[TokenizedSample] = []
    stats = DataStats()
    if limit == 0:
        return samples, stats
    for row_no, where, value in _raw_rows(path):
        stats.rows_read += 1
        try:
            if isinstance(value, DataError):
                raise value
            encoded = _encode(value, tokenizer, where)
        except _RowError as e:
            if not skip_bad_rows:
                raise
            stats.rows_skipped_bad += 1
            if len(stats.bad_row_messages) < _MAX_BAD_ROW_MESSAGES:
                stats.bad_row_messages.append(str(e))
            continue
        sample = _truncate(encoded, max_length, row_no)
        if sample is None:
            stats.rows_skipped_no_assistant += 1
            continue
        if len(encoded[0]) > max_length:
            stats.rows_truncated += 1
        samples.append(sample)
        if limit is not None and len(samples) >= limit:
            break
    return samples, stats


def file_content_hash(path: str) -> str:
    """The xxh3-128 of a data file's bytes (recorded in the manifest, so a resume refuses changed data).

    Raises:
        DataError: the file is missing.
    """
    try:
        return file_checksum(path)
    except FileNotFoundError as e:
        raise DataError(f"data file not found: {path}; check the path") from e


def tokenizer_hash(tokenizer: Any) -> str:
    """Fingerprint a tokenizer, stable across processes and save/load round trips.

    Covers the vocabulary (sorted by token), the special tokens, the chat
    template and, for a fast tokenizer, the backend's normalizer, pre-tokenizer
    and model settings (BPE merges...), which decide how text splits into that
    vocabulary. Padding and truncation settings, which transformers changes at
    run time, are left out.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        An xxh3_128 hex digest.
    """
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        template = None
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
        "all_special_tokens": sorted(str(t) for t in tokenizer.all_special_tokens),
        "chat_template": template,
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        model = {k: v for k, v in (pipeline.get("model") or {}).items() if k != "vocab"}
        payload["backend"] = {
            "normalizer": pipeline.get("normalizer"),
            "pre_tokenizer": pipeline.get("pre_tokenizer"),
            "model": model,
        }
    encoded = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(encoded.encode("utf-8"))
