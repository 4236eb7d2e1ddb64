"""Samples and what was left out: the compact :class:`TokenizedSamples`, skip reasons and dropped fields.

The skip reasons and ``--on-dropped`` modes are those of :mod:`speccache.data.chat`'s docstring.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speccache.data._failure import RowFailure
from speccache.data._files import data_kind
from speccache.errors import DataError, UsageError
from speccache.format import DROPPED_FIELDS_FILE

__all__ = [
    "BEYOND_MAX_LENGTH",
    "DROPPED",
    "DROPPED_MODES",
    "IMAGE_ROW_TOO_LONG",
    "NO_ASSISTANT",
    "DataStats",
    "DroppedField",
    "Sample",
    "SampleBuilder",
    "SkippedRow",
    "TokenizedSample",
    "TokenizedSamples",
    "check_dropped_mode",
    "dropped_error",
    "dropped_summary",
    "keep",
]

_CHUNK = 4096
DROPPED_MODES = ("warn", "skip", "fail")
DROPPED = "dropped_fields"
NO_ASSISTANT = "no_assistant_token"
BEYOND_MAX_LENGTH = "no_assistant_within_max_length"
IMAGE_ROW_TOO_LONG = "image_row_beyond_max_length"
Sample = tuple[int, np.ndarray, np.ndarray]  # (turn, input_ids, loss_mask); turn -1: the whole row


@dataclass(frozen=True)
class TokenizedSample:
    """One usable row, tokenized.

    Attributes:
        input_ids: Token ids, at most ``max_length`` of them.
        loss_mask: 1 where the token is assistant output, else 0; same length as ``input_ids``.
        source_row: 0-based row number of the row in the data file.
        turn: with --expand-turns, the 0-based assistant turn the sample supervises; else -1.
        images: the sources of the images in the sample, in order (a path, or ``xxh3:<digest>`` of bytes its
            source row holds); empty for a text sample.
    """

    input_ids: list[int]
    loss_mask: list[int]
    source_row: int
    turn: int = -1
    images: tuple[str, ...] = ()


class TokenizedSamples(Sequence[TokenizedSample]):
    """Tokenized samples stored compactly: all ids in one int32 array, masks in one uint8 array.

    Planning memory is then a few bytes per token, not a Python list per token.

    Attributes:
        input_ids: int32 ``[tokens]``; ``loss_mask``: uint8 ``[tokens]``; ``offsets``: int64 ``[n + 1]``;
        source_rows: int64 ``[n]``; ``turns``: int64 ``[n]`` (-1 unless --expand-turns);
        images: ``{sample index: image sources}`` of the samples that hold images (their pixels are not kept).
    """

    def __init__(
        self,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        offsets: np.ndarray,
        source_rows: np.ndarray,
        turns: np.ndarray | None = None,
        images: dict[int, tuple[str, ...]] | None = None,
    ):
        self.input_ids, self.loss_mask, self.offsets, self.source_rows = input_ids, loss_mask, offsets, source_rows
        self.turns = np.full(len(source_rows), -1, dtype=np.int64) if turns is None else turns
        self.images = images or {}

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
        return TokenizedSample(
            ids.tolist(),
            mask.tolist(),
            int(self.source_rows[index]),
            int(self.turns[index]),
            self.images.get(index, ()),
        )

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


class SampleBuilder:
    """Appends samples into chunked arrays, so that no per-sample Python object outlives its chunk."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.pending: list[tuple[np.ndarray, np.ndarray, int, int]] = []
        self.images: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return sum(len(c[3]) for c in self.chunks) + len(self.pending)

    def add(
        self, ids: np.ndarray, mask: np.ndarray, source_row: int, turn: int = -1, images: tuple[str, ...] = ()
    ) -> None:
        if images:
            self.images[len(self)] = images
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
            self.images,
        )


@dataclass(frozen=True)
class SkippedRow:
    """A row left out of the cache (one line of ``skipped_rows.jsonl``).

    Attributes:
        row: 0-based row number in the data file.
        reason: the skip reason (see :mod:`speccache.data.chat`).
        detail: the error message, or a short explanation.
    """

    row: int
    reason: str
    detail: str

    def where(self, path: str) -> str:
        """The row as messages name rows of the data file ``path``: ``file:line`` (1-based) in JSON lines,
        ``file[index]`` (0-based) otherwise."""
        return f"{path}:{self.row + 1}" if data_kind(path) == "lines" else f"{path}[{self.row}]"


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


def check_dropped_mode(mode: str) -> None:
    """Refuse an unknown ``--on-dropped`` mode.

    Raises:
        ValueError: ``mode`` is not one of :data:`DROPPED_MODES`.
    """
    if mode not in DROPPED_MODES:
        raise UsageError(f"--on-dropped {mode!r} is unknown; choose one of {', '.join(DROPPED_MODES)}")


def dropped_error(where: str, dropped: list[tuple[int, str]], mode: str) -> DataError:
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


def keep(
    builder: SampleBuilder,
    stats: DataStats,
    row_no: int,
    encoded: list[Sample] | None,
    max_length: int,
    images: list[tuple[str, ...]] | None = None,
) -> bool:
    """Add one row's samples to ``builder`` (truncated), or count why it is skipped; returns whether any was added.

    With --expand-turns, a turn with nothing to train on within ``max_length`` gives no sample. A sample with
    images (``images``: its image sources, per sample) is never cut: longer than ``max_length``, it is left out.
    """
    if not encoded or not any(mask.any() for _, _, mask in encoded):
        stats.skip(row_no, NO_ASSISTANT, "the row has no assistant token to train on")
        return False
    sources = images or [()] * len(encoded)
    whole = [(s, src) for s, src in zip(encoded, sources) if not src or len(s[1]) <= max_length]
    if not whole:
        longest = max(len(ids) for _, ids, _ in encoded)
        stats.skip(
            row_no,
            IMAGE_ROW_TOO_LONG,
            f"its {longest} tokens with their images exceed --max-length {max_length}, and an image row is never cut",
        )
        return False
    kept = [((turn, ids, mask), src) for (turn, ids, mask), src in whole if mask[:max_length].any()]
    if not kept:
        stats.skip(row_no, BEYOND_MAX_LENGTH, f"its first assistant token lies beyond --max-length {max_length}")
        return False
    for (turn, ids, mask), src in kept:
        if len(ids) > max_length:
            stats.rows_truncated += 1
        builder.add(ids[:max_length], mask[:max_length], row_no, turn, src)
    return True
