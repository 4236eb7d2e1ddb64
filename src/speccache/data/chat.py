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
  with ``input_ids`` is read as pre-tokenized whatever chat text it also holds (regenerate's rows hold both).

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
``dropped_fields`` (its rendering lacks a field it carries, with ``on_dropped="skip"``). The first three are
errors unless ``skip_bad_rows``; the next two are always skipped and counted.

Dropped fields: a chat row's rendering is checked for every field the row carries (:func:`dropped_fields`);
``on_dropped`` keeps such a row and counts it (``DataStats.dropped``, ``warn``), skips it, or fails.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import heapq
import io
import itertools
import json
import os
import signal
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from speccache.data.regenerated import is_regenerated, regenerated_rows
from speccache.data.template import (
    REASONING_FIELDS,
    ChatFormat,
    MistralCommonFormat,
    RowFailure,
    chat_format,
    dropped_fields,
    samples_and_text,
    tokenizer_template,
    tool_list,
)
from speccache.errors import DataError, UsageError
from speccache.format import SOURCE_ROW_KEY, KeySpec, file_checksum

__all__ = [
    "DROPPED_FIELDS_FILE",
    "DROPPED_MODES",
    "SAMPLE_TURN_KEY",
    "SKIPPED_ROWS_FILE",
    "SOURCE_ROW_KEY",
    "DataStats",
    "DroppedField",
    "SkippedRow",
    "TokenizedSample",
    "TokenizedSamples",
    "chat_messages",
    "chat_template_of",
    "check_dropped_mode",
    "data_root",
    "dropped_summary",
    "file_content_hash",
    "iter_rows",
    "load_samples",
    "merge_parts",
    "sample_turn_spec",
    "source_row_spec",
    "tokenize_row",
    "tokenizer_hash",
]

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
_OPENAI_ROLES = {r: r for r in ("system", "user", "assistant", "tool", "ipython")}
_CHAT_KEYS = ("conversations", "messages")
_LINE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_DATASET_SUFFIXES = (".parquet",)
_CHUNK = 4096
SAMPLE_TURN_KEY = "sample_turn"
SKIPPED_ROWS_FILE = "skipped_rows.jsonl"
DROPPED_FIELDS_FILE = "dropped_fields.jsonl"
DROPPED_MODES = ("warn", "skip", "fail")
DROPPED = "dropped_fields"
NO_ASSISTANT = "no_assistant_token"
BEYOND_MAX_LENGTH = "no_assistant_within_max_length"


def _row_error(message: str) -> RowFailure:
    return RowFailure(message, "malformed")


@dataclass(frozen=True)
class TokenizedSample:
    """One usable row, tokenized.

    Attributes:
        input_ids: Token ids, at most ``max_length`` of them.
        loss_mask: 1 where the token is assistant output, else 0; same length as ``input_ids``.
        source_row: 0-based row number of the row in the data file.
        turn: with --expand-turns, the 0-based assistant turn the sample supervises; else -1.
    """

    input_ids: list[int]
    loss_mask: list[int]
    source_row: int
    turn: int = -1


class TokenizedSamples(Sequence[TokenizedSample]):
    """Tokenized samples stored compactly: all ids in one int32 array, masks in one uint8 array.

    Planning memory is then a few bytes per token, not a Python list per token.

    Attributes:
        input_ids: int32 ``[tokens]``; ``loss_mask``: uint8 ``[tokens]``; ``offsets``: int64 ``[n + 1]``;
        source_rows: int64 ``[n]``; ``turns``: int64 ``[n]`` (-1 unless --expand-turns).
    """

    def __init__(
        self,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        offsets: np.ndarray,
        source_rows: np.ndarray,
        turns: np.ndarray | None = None,
    ):
        self.input_ids, self.loss_mask, self.offsets, self.source_rows = input_ids, loss_mask, offsets, source_rows
        self.turns = np.full(len(source_rows), -1, dtype=np.int64) if turns is None else turns

    @classmethod
    def empty(cls) -> TokenizedSamples:
        """No samples."""
        z = np.zeros(0, dtype=np.int64)
        return cls(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64), z, z)

    def __len__(self) -> int:
        return len(self.source_rows)

    def arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, loss_mask)`` of sample ``index`` as array views."""
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        ids, mask = self.arrays(index)
        return TokenizedSample(ids.tolist(), mask.tolist(), int(self.source_rows[index]), int(self.turns[index]))

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample, int64 ``[n]``."""
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        """Tokens in all samples."""
        return int(self.offsets[-1])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class _SampleBuilder:
    """Appends samples into chunked arrays, so that no per-sample Python object outlives its chunk."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.pending: list[tuple[np.ndarray, np.ndarray, int, int]] = []

    def __len__(self) -> int:
        return sum(len(c[3]) for c in self.chunks) + len(self.pending)

    def add(self, ids: np.ndarray, mask: np.ndarray, source_row: int, turn: int = -1) -> None:
        self.pending.append((ids, mask, source_row, turn))
        if len(self.pending) >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        ids = np.concatenate([p[0] for p in self.pending]).astype(np.int32, copy=False)
        mask = np.concatenate([p[1] for p in self.pending]).astype(np.uint8, copy=False)
        lengths = np.fromiter((len(p[0]) for p in self.pending), dtype=np.int64, count=len(self.pending))
        rows = np.fromiter((p[2] for p in self.pending), dtype=np.int64, count=len(self.pending))
        turns = np.fromiter((p[3] for p in self.pending), dtype=np.int64, count=len(self.pending))
        self.chunks.append((ids, mask, lengths, rows, turns))
        self.pending = []

    def build(self) -> TokenizedSamples:
        self._flush()
        if not self.chunks:
            return TokenizedSamples.empty()
        lengths = np.concatenate([c[2] for c in self.chunks])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return TokenizedSamples(
            np.concatenate([c[0] for c in self.chunks]),
            np.concatenate([c[1] for c in self.chunks]),
            offsets,
            np.concatenate([c[3] for c in self.chunks]),
            np.concatenate([c[4] for c in self.chunks]),
        )


def source_row_spec() -> KeySpec:
    """The fixed int64 key under which every sample records its 0-based row in the data file.

    Every method's schema adds it, and its ``compute_batch`` copies the batch's ``source_row`` column.
    """
    return KeySpec(SOURCE_ROW_KEY, torch.int64, ())


def sample_turn_spec() -> KeySpec:
    """The fixed int64 key under which an --expand-turns cache records each sample's 0-based assistant turn."""
    return KeySpec(SAMPLE_TURN_KEY, torch.int64, ())


@dataclass(frozen=True)
class SkippedRow:
    """A row left out of the cache (one line of ``skipped_rows.jsonl``).

    Attributes:
        row: 0-based row number in the data file.
        reason: the skip reason (see the module docstring).
        detail: the error message, or a short explanation.
    """

    row: int
    reason: str
    detail: str

    def where(self, path: str) -> str:
        """The row as messages name rows of the data file ``path``: ``file:line`` (1-based) in JSON lines,
        ``file[index]`` (0-based) otherwise."""
        return f"{path}:{self.row + 1}" if _data_kind(path) == "lines" else f"{path}[{self.row}]"


@dataclass(frozen=True)
class DroppedField:
    """A field of a kept row that its rendering lacks (one line of ``dropped_fields.jsonl``).

    Attributes:
        row: 0-based row number in the data file.
        where: the row as messages name it (``file:line``).
        message: 0-based index of the message in the row's messages (-1: the row's ``tools``).
        field: ``content``, ``tool_calls``, ``tools``, the reasoning field's name, or ``<think> in content``.
    """

    row: int
    where: str
    message: int
    field: str


@dataclass
class DataStats:
    """What :func:`load_samples` read and dropped.

    Attributes:
        rows_read: Rows looked at, including skipped ones (blank lines are not rows).
        rows_truncated: Kept samples that were cut to ``max_length``.
        skipped: ``{reason: count}`` of the rows left out.
        skipped_rows: every row left out, in file order.
        dropped: ``{field: rows}``: kept rows whose rendering lacks that field (``--on-dropped warn``).
        dropped_rows: every such field, in file order.
    """

    rows_read: int = 0
    rows_truncated: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_rows: list[SkippedRow] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_rows: list[DroppedField] = field(default_factory=list)

    def skip(self, row: int, reason: str, detail: str) -> None:
        """Record one skipped row."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.skipped_rows.append(SkippedRow(row, reason, detail))

    def drop(self, fields: Sequence[DroppedField]) -> None:
        """Record the dropped fields of one kept row (a row counts once per field name)."""
        for name in dict.fromkeys(f.field for f in fields):
            self.dropped[name] = self.dropped.get(name, 0) + 1
        self.dropped_rows.extend(fields)

    def dropped_rows_jsonl(self, data: str) -> bytes:
        """The lines of ``dropped_fields.jsonl`` for data file ``data``: one ``{"row", "where", "message", "field",
        "data"}`` object per dropped field."""
        lines = (
            json.dumps({"row": d.row, "where": d.where, "message": d.message, "field": d.field, "data": data}) + "\n"
            for d in self.dropped_rows
        )
        return "".join(lines).encode("utf-8")

    @property
    def rows_skipped(self) -> int:
        """Rows left out for any reason."""
        return sum(self.skipped.values())

    def skipped_rows_jsonl(self, data: str) -> bytes:
        """The lines of ``skipped_rows.jsonl`` for data file ``data``: one ``{"row", "reason", "detail", "data"}``
        object per line (``data`` as the manifest's ``config.data`` names the file)."""
        lines = (
            json.dumps({"row": r.row, "reason": r.reason, "detail": r.detail, "data": data}) + "\n"
            for r in self.skipped_rows
        )
        return "".join(lines).encode("utf-8")


def is_hub_id(path: str) -> bool:
    """Whether ``--data`` names a Hugging Face hub dataset (``name`` or ``org/name``) rather than a local path."""
    if os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        return False
    return not path.lower().endswith((".json", *_LINE_SUFFIXES, *_DATASET_SUFFIXES))


def _data_kind(path: str) -> str:
    """``lines``, ``json``, ``parquet``, ``dataset`` (a saved one, read through ``datasets``), ``regenerated``
    (a directory ``speccache regenerate`` wrote) or ``hub``."""
    if is_hub_id(path):
        return "hub"
    if os.path.isdir(path):
        if is_regenerated(path):
            return "regenerated"
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            return "dataset"
        raise DataError(
            f"data path is a directory but not a saved Hugging Face dataset: {path}; pass a directory written "
            "by datasets' save_to_disk, or a data file"
        )
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}; check the path")
    if not os.path.isfile(path):
        raise DataError(f"data path is not a file: {path}; pass a .jsonl or .json file")
    lower = path.lower()
    if lower.endswith(_LINE_SUFFIXES):
        return "lines"
    if lower.endswith(".json"):
        return "json"
    if lower.endswith(_DATASET_SUFFIXES):
        return "parquet"
    ext = os.path.splitext(path)[1].lower()
    raise DataError(
        f"unsupported data file extension {ext or '(none)'!r}: {path}; use .jsonl (one JSON object "
        "per line) or .json (a JSON list of objects), or .jsonl.gz, .jsonl.zst, .parquet, or a save_to_disk directory"
    )


_READ_SIZE = 1 << 16


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame in a file, refusing a file that ends inside a frame.

    ``zstandard``'s ``stream_reader`` returns end-of-file for a frame cut anywhere, so a truncated file
    would read as a shorter whole one. A frame is complete only when the decoder says so (its end mark,
    and its content size and checksum where the header has them, which the ``zstd`` CLI and
    ``ZstdCompressor`` write by default). A file of several frames cut exactly between two frames still
    looks whole: nothing in a frame says that another one follows.
    """

    def __init__(self, path: str) -> None:
        import zstandard

        self.path, self._file, self._error = path, open(path, "rb"), zstandard.ZstdError
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame, self._frames = False, 0
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at == len(self._out):
            chunk = self._file.read(_READ_SIZE)
            if not chunk:
                if self._in_frame or not self._frames:
                    raise DataError(
                        f"{self.path}: the zstd file is truncated (it ends inside a frame, or holds none); "
                        "it was cut short (an interrupted download or copy): fetch or write it again"
                    )
                return 0
            self._out, self._at = self._decompress(chunk), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at : self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            try:
                out.append(self._frame.decompress(data))
            except self._error as e:
                raise _damaged(self.path, "zstd", e) from e
            self._in_frame = not self._frame.eof
            if self._in_frame:
                break
            self._frames += 1
            data, self._frame = self._frame.unused_data, self._decompressor.decompressobj()
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _damaged(path: str, kind: str, error: BaseException) -> DataError:
    return DataError(
        f"{path}: not a valid {kind} file ({error}); it is damaged or in another format: "
        f"compress the .jsonl with {kind} again, or name the file for what it holds"
    )


def _lines(path: str) -> Iterator[bytes]:
    """The raw lines of a JSON-lines file, decompressed; a damaged or truncated file is a ``DataError``."""
    lower = path.lower()
    if lower.endswith(".zst"):
        with io.BufferedReader(_ZstdFrames(path)) as f:
            yield from f
        return
    if not lower.endswith(".gz"):
        with open(path, "rb") as f:
            yield from f
        return
    try:
        with gzip.open(path, "rb") as f:
            yield from f
    except EOFError as e:
        raise DataError(
            f"{path}: the gzip file is truncated ({e}); it was cut short (an interrupted download or copy): "
            "fetch or write it again"
        ) from e
    except (gzip.BadGzipFile, zlib.error) as e:
        raise _damaged(path, "gzip", e) from e


def _saved_splits(path: str) -> list[str] | None:
    """The splits a saved ``DatasetDict`` directory lists in its ``dataset_dict.json``; None for a saved ``Dataset``."""
    listing = os.path.join(path, "dataset_dict.json")
    if not os.path.exists(listing):
        return None
    body, problem = None, ""
    try:
        with open(listing, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = f" ({e})"
    splits = body.get("splits") if isinstance(body, dict) else None
    if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
        raise DataError(
            f"{listing}: not a valid dataset_dict.json{problem}; it must be JSON like "
            '{"splits": ["train", ...]}: save the DatasetDict again, or pass the directory of one split'
        )
    return splits


def data_root(path: str, split: str | None = None) -> str:
    """The file or directory that holds the rows of local data ``path`` with ``--data-split split``.

    It is what the data's hash covers: a saved ``DatasetDict``'s split is its own directory.

    Raises:
        DataError: a ``DatasetDict`` without a known ``split``, or a ``split`` of data that has no splits.
    """
    splits = _saved_splits(path) if os.path.isdir(path) else None
    if splits is None:
        if split is not None:
            raise DataError(
                f"--data-split {split}: {path} has no splits (only a directory saved from a DatasetDict has); "
                "drop --data-split"
            )
        return path
    if split is None:
        raise DataError(
            f"{path}: a saved DatasetDict holds several splits ({', '.join(splits)}); choose one with "
            f"--data-split (or pass the directory of one split, e.g. {os.path.join(path, splits[0])})"
        )
    if split not in splits:
        raise DataError(f"{path}: no split {split!r}; --data-split must be one of {', '.join(splits)}")
    return os.path.join(path, split)


def _load_dataset(path: str, split: str | None) -> Any:
    """The ``datasets.Dataset`` of a saved dataset or a hub id (``split`` chooses among splits)."""
    import datasets

    if _data_kind(path) != "hub":
        return datasets.load_from_disk(data_root(path, split))
    try:
        return datasets.load_dataset(path, split=split or "train")
    except Exception as exc:
        raise DataError(
            f"--data {path}: cannot load it as a Hugging Face hub dataset (split {split or 'train'!r}): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. Check the id, the split "
            "and the network, or pass a local file"
        ) from exc


def _dataset_rows(path: str, split: str | None) -> Iterator[tuple[int, str, Any]]:
    ds = _load_dataset(path, split)
    for index in range(len(ds)):
        yield index, f"{path}[{index}]", _without_nulls(ds[index])


def _parquet_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    # Read in place: datasets would copy the file into its Arrow cache, which it keys on the file's mtime, and a
    # file rewritten with its mtime kept (cp -p, rsync -t) would then be read as its old rows.
    import pyarrow
    import pyarrow.parquet

    index = 0
    try:
        for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=_CHUNK):
            for row in batch.to_pylist():
                yield index, f"{path}[{index}]", _without_nulls(row)
                index += 1
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(
            f"{path}: not a readable Parquet file ({e}); it is truncated, damaged or in another format: "
            "write it again, or name the file for what it holds"
        ) from e


def _without_nulls(value: Any) -> Any:
    # Arrow gives every struct the union of all fields, None where a row lacks one; JSON rows lack them instead.
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _raw_rows(path: str, split: str | None = None) -> Iterator[tuple[int, str, Any]]:
    """Yield ``(0-based row number, where, parsed value)``; an unparsable line yields a ``RowFailure`` value."""
    kind = _data_kind(path)
    if kind in ("dataset", "hub"):
        yield from _dataset_rows(path, split)
        return
    data_root(path, split)  # refuses a --data-split of a data file or a regenerated directory
    if kind == "regenerated":
        for row_no, where, raw in regenerated_rows(path):
            value = _parse_line(raw, where, False)
            if value is not _BLANK:
                yield row_no, where, value
        return
    if kind == "parquet":
        yield from _parquet_rows(path)
        return
    if kind == "json":
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
    for line_no, raw in enumerate(_lines(path), start=1):
        value = _parse_line(raw, f"{path}:{line_no}", line_no == 1)
        if value is not _BLANK:
            yield line_no - 1, f"{path}:{line_no}", value


_BLANK = object()


def _parse_line(raw: bytes, where: str, first: bool) -> Any:
    """One JSON line's value, ``_BLANK`` for a blank line, or the ``RowFailure`` that names why it is not a row."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        return _row_error(f"{where}: not valid UTF-8 ({e.reason}); re-encode the line as UTF-8")
    if not text.strip():
        return _BLANK
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return _row_error(f"{where}: invalid JSON ({e.msg}, column {e.colno}); fix or remove the line")


def _not_an_object(where: str, value: Any) -> RowFailure:
    return _row_error(f"{where}: expected a JSON object per row, got {type(value).__name__}; fix or remove the row")


def iter_rows(path: str, split: str | None = None) -> Iterator[tuple[int, dict]]:
    """Iterate over the row objects of a data file.

    Args:
        path: A data file, saved dataset or hub id (see the module docstring).
        split: The split of a saved ``DatasetDict`` or hub dataset (default: a hub dataset's ``train``).

    Returns:
        An iterator of ``(0-based row number, row)``.

    Raises:
        DataError: The file is missing or not a file, has another extension, holds
            invalid JSON or UTF-8, or a row is not a JSON object.
    """
    for row_no, where, value in _raw_rows(path, split):
        if isinstance(value, DataError):
            raise value
        if not isinstance(value, dict):
            raise _not_an_object(where, value)
        yield row_no, value


def _message_list(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str], where: str) -> list[dict]:
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise _row_error(f"{where}: {key!r} must be a non-empty list of messages; fix the row")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _row_error(f"{where}: {key}[{i}] must be an object with {role_key!r} and {text_key!r}; fix the row")
        role = turn.get(role_key)
        if not isinstance(role, str) or role not in roles:
            raise _row_error(
                f"{where}: {key}[{i}].{role_key} must be one of {', '.join(roles)}, got {role!r}; fix the row"
            )
        name = f"{where}: {key}[{i}]"
        if key == "conversations":
            messages.append(_sharegpt_message(roles[role], turn[text_key] if text_key in turn else None, name, role))
        else:
            messages.append(_openai_message(turn, name))
    system = row.get("system")
    if key == "conversations" and system is not None and system != "":
        if not isinstance(system, str):
            raise _row_error(f"{where}: 'system' must be a string, got {type(system).__name__}; fix the row")
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is not None and first["role"] == "assistant":
        raise _row_error(f"{where}: the conversation starts with an assistant message; add the prompt before it")
    return messages


def _sharegpt_message(role: str, value: Any, name: str, given: str) -> dict:
    if given != "function_call":
        return {"role": role, "content": _text(value, f"{name}.value")}
    # The call (or a list of parallel calls) is a JSON string {"name", "arguments"}, as function-calling sets store it.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _row_error(
                f'{name}.value: a function_call must be a JSON object {{"name", "arguments"}} or a list of '
                f"them ({e.msg}); fix the row"
            ) from e
    return {"role": "assistant", "content": "", "tool_calls": _tool_calls(value, f"{name}.value")}


def _openai_message(turn: dict, name: str) -> dict:
    # Every field is kept (tool_call_id, name, reasoning_content...): templates read them.
    message = dict(turn)
    if turn["role"] == "assistant" and turn.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(turn["tool_calls"], f"{name}.tool_calls")
    if turn.get("content") is None and message.get("tool_calls"):
        # OpenAI's tool-call turn; "" as serving engines pass it, since most templates concatenate the content.
        message["content"] = ""
    else:
        message["content"] = _text(turn.get("content"), f"{name}.content")
    for key in REASONING_FIELDS:
        if turn.get(key) is not None and not isinstance(turn[key], str):
            raise _row_error(f"{name}.{key} must be a string, got {type(turn[key]).__name__}; fix the row")
    return message


def _text(content: Any, name: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts joined by newlines (as serving engines do)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _row_error(f"{name} must be a string or a list of text parts, got {type(content).__name__}; fix the row")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and not isinstance(part.get("text"), str):
            raise _row_error(f"{name}[{j}] is a text part without a string 'text'; fix the row")
        if kind != "text":
            raise _row_error(
                f'{name}[{j}] is a {kind!r} part; only text parts ({{"type": "text", "text": str}}) can be '
                "cached: drop the row, or its other parts"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, name: str) -> list[dict]:
    """OpenAI tool calls, each ``{"type": "function", "function": {"name", "arguments": object}}``.

    Arguments given as a JSON string are decoded, as serving engines do before they render a template.
    """
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _row_error(
                f'{name}[{j}] must be a tool call {{"type": "function", "function": {{"name": str, '
                '"arguments": object or JSON string}}; fix the row'
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise _row_error(
                    f"{name}[{j}]: the arguments string is not JSON ({e.msg}); give an object or its JSON text"
                ) from e
        if not isinstance(arguments, dict):
            raise _row_error(
                f"{name}[{j}]: the arguments must be an object, got {type(arguments).__name__}; fix the row"
            )
        function = {**function, "arguments": arguments}
        out.append({**call, "function": function} if "function" in call else {"type": "function", "function": function})
    return out


def _pretokenized(row: dict, tokenizer: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = row["input_ids"], row.get("loss_mask")
    vocab = len(tokenizer)
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise _row_error(
            f"{where}: 'input_ids' must be a non-empty list of integer ids in [0, {vocab}); "
            "re-tokenize the row with the target's tokenizer"
        )
    if not isinstance(mask, list) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise _row_error(f"{where}: a pre-tokenized row needs 'loss_mask', a list of 0/1 integers; fix the row")
    if len(mask) != len(ids):
        raise _row_error(
            f"{where}: 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}; they must match"
        )
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template, or None when it has none or cannot give one (``MistralCommonBackend``)."""
    return tokenizer_template(tokenizer)


_Sample = tuple[int, np.ndarray, np.ndarray]  # (turn, input_ids, loss_mask); turn -1: the whole row


def _pretokenized_turns(
    ids: np.ndarray, mask: np.ndarray, fmt: ChatFormat | MistralCommonFormat | None
) -> list[_Sample]:
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


def _encode(
    row: Any, tokenizer: Any, fmt: ChatFormat | MistralCommonFormat | None, where: str
) -> tuple[list[_Sample] | None, list[tuple[int, str]]]:
    """Full-length samples of a row (one, or one per assistant turn; None when it has no assistant message), and
    the ``(message, field)`` pairs the row carries but its samples' text lacks (see :func:`dropped_fields`)."""
    if not isinstance(row, dict):
        raise _not_an_object(where, row)
    if "input_ids" in row:
        # The ids win over any chat text beside them: they are exactly what the model saw and wrote (rows of
        # speccache regenerate carry both), and its text re-tokenized may differ.
        ids, mask = _pretokenized(row, tokenizer, where)
        return _pretokenized_turns(ids, mask, fmt), []
    messages, tools = chat_messages(row, where)
    if not any(m["role"] == "assistant" for m in messages):
        return None, []
    if fmt is None:
        raise DataError(
            f"{where}: chat rows need a tokenizer with a chat template, and this tokenizer has none; "
            "pass --chat-template FILE, use a target whose tokenizer defines chat_template, or pre-tokenized rows"
        )
    samples, text = samples_and_text(tokenizer, fmt, messages, where, tools)
    if fmt.expand_turns:  # its samples end with the last assistant turn
        messages = messages[: max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1]
    return samples, dropped_fields(messages, fmt.tools if tools is None else tools, text)


def chat_messages(row: dict, where: str) -> tuple[list[dict], list[dict] | None]:
    """The OpenAI-form messages and the tool schemas (None: the row has none) of a ShareGPT or OpenAI row.

    Its ``input_ids``, if any, are not looked at (a pre-tokenized row's ids win only where rows are tokenized).

    Raises:
        RowFailure: the row is not one chat row (the message starts with ``where``).
    """
    kinds = [key for key in _CHAT_KEYS if key in row]
    if len(kinds) != 1:
        found = ", ".join(repr(k) for k in kinds) if kinds else "none of them"
        raise _row_error(
            f"{where}: a row needs exactly one of 'conversations' (ShareGPT), 'messages' (OpenAI) or "
            f"'input_ids' with 'loss_mask' (pre-tokenized); found {found}; fix the row"
        )
    if kinds[0] == "conversations":
        messages = _message_list(row, "conversations", "from", "value", _SHAREGPT_ROLES, where)
    else:
        messages = _message_list(row, "messages", "role", "content", _OPENAI_ROLES, where)
    return messages, None if row.get("tools") is None else tool_list(row["tools"], f"{where}: 'tools'")


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
    encoded, _ = _encode(row, tokenizer, fmt or _default_format(tokenizer), where)
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
    builder = _SampleBuilder()
    stats = DataStats()
    if limit == 0:
        return builder.build(), stats
    fmt = fmt or _default_format(tokenizer)
    rows = (r for i, r in enumerate(_raw_rows(path, split)) if i % world == rank)
    with _Encoder(tokenizer, fmt, num_proc) as encoder:
        for row_no, where, encoded, error, dropped in encoder.encode(rows):
            stats.rows_read += 1
            if error is None and dropped and on_dropped != "warn":
                error = _dropped_error(where, dropped, on_dropped)
            if error is not None:
                if not isinstance(error, RowFailure) or not (skip_bad_rows or error.reason == DROPPED):
                    error.row = row_no  # type: ignore[attr-defined]  # which rank's error comes first
                    if isinstance(error, RowFailure) and "--skip-bad-rows" not in str(error):
                        error.args = (f"{error} (or skip such rows with --skip-bad-rows)",)
                    raise error
                stats.skip(row_no, error.reason, str(error))
                continue
            if _keep(builder, stats, row_no, encoded, max_length):
                stats.drop([DroppedField(row_no, where, message, name) for message, name in dropped])
                if limit is not None and len(builder) >= limit:
                    break
    return builder.build(), stats


def merge_parts(parts: Sequence[tuple[TokenizedSamples, DataStats]]) -> tuple[TokenizedSamples, DataStats]:
    """Join what ``load_samples(part=(rank, world))`` read on each rank, for ``rank`` in ``range(world)``.

    Returns:
        Exactly what one ``load_samples`` over the whole file returns: samples and skipped rows in row order.
    """
    builder, stats = _SampleBuilder(), DataStats()
    rows = [
        [(int(r), k, i) for i, r in enumerate(samples.source_rows.tolist())] for k, (samples, _) in enumerate(parts)
    ]
    for row, k, i in heapq.merge(*rows):
        ids, mask = parts[k][0].arrays(i)
        builder.add(ids, mask, row, int(parts[k][0].turns[i]))
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


def check_dropped_mode(mode: str) -> None:
    """Refuse an unknown ``--on-dropped`` mode.

    Raises:
        ValueError: ``mode`` is not one of :data:`DROPPED_MODES`.
    """
    if mode not in DROPPED_MODES:
        raise UsageError(f"--on-dropped {mode!r} is unknown; choose one of {', '.join(DROPPED_MODES)}")


def _dropped_error(where: str, dropped: list[tuple[int, str]], mode: str) -> DataError:
    """The error of a row whose rendering drops fields: a ``RowFailure`` counted under ``dropped_fields`` when
    ``mode`` skips such rows, else a ``DataError`` that ``--skip-bad-rows`` does not skip."""
    fields = ", ".join(("tools" if i < 0 else f"messages[{i}].{name}") for i, name in dropped)
    if mode == "skip":
        return RowFailure(f"{where}: the chat template drops {fields} from the rendering (--on-dropped skip)", DROPPED)
    return DataError(
        f"{where}: the chat template drops {fields} from the rendering, so the draft would never see it "
        "(--on-dropped fail); pass a --chat-template that renders it, or keep such rows with --on-dropped warn, "
        "or leave them out with --on-dropped skip"
    )


def dropped_summary(dropped: Mapping[str, int]) -> str:
    """The summary's words on the fields the chat template drops from kept rows, per field (``DataStats.dropped``
    or the manifest's ``stats["dropped_fields"]``); "" when it drops none."""
    if not dropped:
        return ""
    counts = ", ".join(f"{name} in {n} row{'s' * (n != 1)}" for name, n in sorted(dropped.items()))
    return (
        f"the chat template drops what rows carry, unseen by the draft: {counts}, listed in {DROPPED_FIELDS_FILE} "
        "(--on-dropped skip|fail)"
    )


def _keep(
    builder: _SampleBuilder, stats: DataStats, row_no: int, encoded: list[_Sample] | None, max_length: int
) -> bool:
    """Add one row's samples to ``builder`` (truncated), or count why it is skipped; returns whether any was added.

    With --expand-turns, a turn with nothing to train on within ``max_length`` gives no sample.
    """
    if not encoded or not any(mask.any() for _, _, mask in encoded):
        stats.skip(row_no, NO_ASSISTANT, "the row has no assistant token to train on")
        return False
    kept = [(turn, ids, mask) for turn, ids, mask in encoded if mask[:max_length].any()]
    if not kept:
        stats.skip(row_no, BEYOND_MAX_LENGTH, f"its first assistant token lies beyond --max-length {max_length}")
        return False
    for turn, ids, mask in kept:
        if len(ids) > max_length:
            stats.rows_truncated += 1
        builder.add(ids[:max_length], mask[:max_length], row_no, turn)
    return True


# (row, where, samples or None, error or None, dropped (message, field) pairs)
_Encoded = tuple[int, str, "list[_Sample] | None", "DataError | None", "list[tuple[int, str]]"]
_WORKER: dict[str, Any] = {}
_ROWS_PER_TASK = 64


def _encode_rows(rows: list[tuple[int, str, Any]]) -> list[_Encoded]:
    """``(row, where, encoded or None, error or None, dropped)`` for each row; in a worker process or in this one."""
    out: list[_Encoded] = []
    for row_no, where, value in rows:
        try:
            if isinstance(value, DataError):
                raise value
            encoded, dropped = _encode(value, _WORKER["tokenizer"], _WORKER["fmt"], where)
            out.append((row_no, where, encoded, None, dropped))
        except DataError as e:
            out.append((row_no, where, None, e, []))
    return out


def _init_worker(tokenizer: Any, fmt: ChatFormat | MistralCommonFormat | None) -> None:
    _WORKER.update(tokenizer=tokenizer, fmt=fmt)


def _init_pool_worker(tokenizer: Any, fmt: ChatFormat | None) -> None:
    # Ctrl-C signals the whole process group. A worker interrupted inside a task loses it (or dies holding the task
    # queue's lock), and the pool then waits for that result forever; only the parent stops on Ctrl-C, and the
    # workers finish the tasks in flight as on any other early exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer, fmt)


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Holds back Ctrl-C (SIGINT) in the main thread until the block ends, then delivers it.

    ``multiprocessing.Pool()`` interrupted half-way leaves forked workers that nothing closes: they wait on the
    task queue forever after the run has ended. A worker forked inside the block also inherits the holding
    handler, so a Ctrl-C that reaches it before its initializer ignores SIGINT does not kill it (the pool would
    fork a replacement behind the run's back).
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # Ctrl-C interrupts only the main thread; a handler set outside Python cannot be restored
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # to the run's own handler, whatever it is (it may ignore it)


class _Encoder:
    """Encodes rows in order, in ``num_proc`` forked worker processes when ``num_proc > 1``."""

    def __init__(self, tokenizer: Any, fmt: ChatFormat | MistralCommonFormat | None, num_proc: int) -> None:
        self.tokenizer, self.fmt, self.num_proc = tokenizer, fmt, num_proc
        self.pool: Any = None
        self.in_flight: collections.deque[Any] = collections.deque()

    def __enter__(self) -> _Encoder:
        _init_worker(self.tokenizer, self.fmt)
        if self.num_proc > 1:
            import multiprocessing

            # The workers inherit the tokenizer by fork; its own thread pool must not be live across the fork.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            context = multiprocessing.get_context("fork")
            try:
                with _ctrl_c_held():
                    self.pool = context.Pool(self.num_proc, _init_pool_worker, (self.tokenizer, self.fmt))
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            # Never Pool.terminate(): a worker killed while it writes a result holds the result queue's lock,
            # and the pool's own shutdown then waits on that lock forever. The few tasks still in flight (a
            # --limit reached, an error) finish instead; then the workers exit on their own.
            for task in self.in_flight:
                task.wait()
            self.pool.close()
            self.pool.join()

    def encode(self, rows: Iterator[tuple[int, str, Any]]) -> Iterator[_Encoded]:
        if self.pool is None:
            for row in rows:
                yield from _encode_rows([row])
            return
        # In order, with at most two tasks per worker in flight: rows are read only as fast as they are encoded.
        for task in iter(lambda: list(itertools.islice(rows, _ROWS_PER_TASK)), []):
            self.in_flight.append(self.pool.apply_async(_encode_rows, (task,)))
            if len(self.in_flight) >= 2 * self.num_proc:
                yield from self.in_flight.popleft().get()
        while self.in_flight:
            yield from self.in_flight.popleft().get()


def file_content_hash(path: str, split: str | None = None) -> str:
    """The xxh3-128 of a data file's bytes (recorded in the manifest, so a resume refuses changed data).

    For a saved dataset directory: the xxh3-128 of every file's relative path and checksum, in path order; for
    a split of a saved ``DatasetDict``, those of the split's directory (:func:`data_root`), so that two splits are
    two data and a split hashes as its directory passed alone. For a hub dataset: its ``datasets`` fingerprint
    (which follows the files it was built from, and the split).

    Raises:
        DataError: the file is missing, or ``split`` does not fit the data (see :func:`data_root`).
    """
    if _data_kind(path) == "hub":
        return xxhash.xxh3_128_hexdigest(str(_load_dataset(path, split)._fingerprint).encode("utf-8"))
    path = data_root(path, split)
    try:
        if not os.path.isdir(path):
            return file_checksum(path)
        listing = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                listing.append(f"{os.path.relpath(full, path)}\0{file_checksum(full)}")
        return xxhash.xxh3_128_hexdigest("\n".join(listing).encode("utf-8"))
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
    template = chat_template_of(tokenizer)
    payload: dict[str, Any] = {
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
