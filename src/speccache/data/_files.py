"""Data files: which kind a ``--data`` path is, its raw rows in order, and the hash a resume checks.

The kinds and forms are those of :mod:`speccache.data.chat`'s docstring.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from typing import Any

import xxhash

from speccache.data._failure import not_an_object, row_error
from speccache.data.regenerated import is_regenerated, regenerated_rows
from speccache.errors import DataError
from speccache.format import file_checksum

__all__ = ["data_kind", "data_root", "file_content_hash", "is_hub_id", "iter_rows", "raw_rows"]

_LINE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_DATASET_SUFFIXES = (".parquet",)
_PARQUET_BATCH = 4096  # rows per Arrow record batch read


def is_hub_id(path: str) -> bool:
    """Whether ``--data`` names a Hugging Face hub dataset (``name`` or ``org/name``) rather than a local path."""
    if os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        return False
    return not path.lower().endswith((".json", *_LINE_SUFFIXES, *_DATASET_SUFFIXES))


def data_kind(path: str) -> str:
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

    if data_kind(path) != "hub":
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
        for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH):
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


def raw_rows(path: str, split: str | None = None) -> Iterator[tuple[int, str, Any]]:
    """Yield ``(0-based row number, where, parsed value)``; an unparsable line yields a ``RowFailure`` value."""
    kind = data_kind(path)
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
        return row_error(f"{where}: not valid UTF-8 ({e.reason}); re-encode the line as UTF-8")
    if not text.strip():
        return _BLANK
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return row_error(f"{where}: invalid JSON ({e.msg}, column {e.colno}); fix or remove the line")


def iter_rows(path: str, split: str | None = None) -> Iterator[tuple[int, dict]]:
    """Iterate over the row objects of a data file.

    Args:
        path: A data file, saved dataset or hub id (see :mod:`speccache.data.chat`).
        split: The split of a saved ``DatasetDict`` or hub dataset (default: a hub dataset's ``train``).

    Returns:
        An iterator of ``(0-based row number, row)``.

    Raises:
        DataError: The file is missing or not a file, has another extension, holds
            invalid JSON or UTF-8, or a row is not a JSON object.
    """
    for row_no, where, value in raw_rows(path, split):
        if isinstance(value, DataError):
            raise value
        if not isinstance(value, dict):
            raise not_an_object(where, value)
        yield row_no, value


def file_content_hash(path: str, split: str | None = None) -> str:
    """The xxh3-128 of a data file's bytes (recorded in the manifest, so a resume refuses changed data).

    For a saved dataset directory: the xxh3-128 of every file's relative path and checksum, in path order; for
    a split of a saved ``DatasetDict``, those of the split's directory (:func:`data_root`), so that two splits are
    two data and a split hashes as its directory passed alone. For a hub dataset: its ``datasets`` fingerprint
    (which follows the files it was built from, and the split).

    Raises:
        DataError: the file is missing, or ``split`` does not fit the data (see :func:`data_root`).
    """
    if data_kind(path) == "hub":
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
