"""The on-disk format: names, manifest, key schema, checksums, shard files.

This module is the contract between writers and readers (docs/format.md says
the same in prose). It knows nothing of models, data loaders or methods.

A cache directory holds ``manifest.json``, shards ``shard-NNNNNN.safetensors``
and optional side files. Shards are plain safetensors files written and read
here directly (header + one ``mmap``) rather than through ``safetensors.torch``
so that a shard is hashed while it is written (no second pass) and a batch of
rows is a zero-copy slice of the mapping; tests check both directions against
the ``safetensors`` library.
"""

from __future__ import annotations

import json
import math
import numbers
import mmap
import os
import re
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Mapping

import torch
import xxhash

from speccache.encoding import get_encoding, part_name
from speccache.errors import CacheCorruptError, CacheFormatError
from speccache.faults import fault_point

FORMAT_VERSION = 1
"""Version of the native layout (key schema, offsets, shard table). See docs/format.md."""

MANIFEST_NAME = "manifest.json"
SHARD_RE = re.compile(r"^shard-([0-9]{6})\.safetensors\Z")
r"""Shard file names: exactly six ASCII digits (``\Z``, not ``$``, so a trailing newline is no match)."""
TMP_MARK = ".tmp-"
"""Temporary files are ``<final name>.tmp-<host>-<pid>-<random>``; no reader matches them."""
OFFSETS_KEY = "__offsets__"
"""Shard tensor: int64 ``[n + 1]`` row offsets shared by every ragged key."""
LENGTHS_KEY = "__lengths__"
"""In-memory batch entry: int64 ``[n]`` per-sample lengths of the ragged keys."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_ELEMENTS = 2**62
"""Bound on a tensor's element count (of its non-zero dimensions): beyond it torch's strides overflow."""
MAX_SHARDS = 1_000_000
"""Shard names have six digits."""

_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
_BY_TORCH = {dt: name for name, (dt, _) in _DTYPES.items()}
_BY_ST = {st: dt for _, (dt, st) in _DTYPES.items()}
_ST_OF = {dt: st for _, (dt, st) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise CacheFormatError(f"dtype {dtype} cannot be stored; use one of {sorted(_DTYPES)}") from None


def _storable(dtype: torch.dtype) -> torch.dtype:
    dtype_name(dtype)
    return dtype


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype of a manifest dtype name."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise CacheFormatError(f"unknown dtype {name!r} in key schema; known: {sorted(_DTYPES)}") from None


# ---------------------------------------------------------------------------
# names and paths


def shard_path(cache_dir: str, shard_index: int) -> str:
    """Return the path of shard ``shard_index`` inside ``cache_dir``."""
    return os.path.join(cache_dir, f"shard-{shard_index:06d}.safetensors")


def manifest_path(cache_dir: str) -> str:
    """Return the manifest path inside ``cache_dir``."""
    return os.path.join(cache_dir, MANIFEST_NAME)


def existing_shard_indices(cache_dir: str) -> set[int]:
    """Return the indices of the shards present in ``cache_dir`` (empty if it does not exist)."""
    if not os.path.isdir(cache_dir):
        return set()
    return {int(m.group(1)) for m in map(SHARD_RE.match, os.listdir(cache_dir)) if m is not None}


def num_shards(num_samples: int, shard_size: int) -> int:
    """Number of shards ``num_samples`` samples fill at ``shard_size`` per shard."""
    check_shard_size(shard_size)
    return -(-num_samples // shard_size)


def check_shard_size(shard_size: int) -> None:
    """Raise ``ValueError`` unless ``shard_size >= 1``."""
    if not isinstance(shard_size, numbers.Integral) or shard_size < 1:
        raise ValueError(f"shard_size must be an integer >= 1, got {shard_size!r}")


def validate_contiguous_shards(cache_dir: str, cache_name: str, num_samples: int, shard_size: int) -> list[int]:
    """Return ``[0..N-1]`` for ``N = ceil(num_samples / shard_size)`` shards, checking they are all there.

    Raises:
        CacheFormatError: shards are missing, extra or not contiguous; the message lists them.
    """
    indices = sorted(existing_shard_indices(cache_dir))
    expected = num_shards(num_samples, shard_size)
    if indices != list(range(expected)):
        present = set(indices)
        missing = sorted(set(range(expected)) - present)
        extra = sorted(present - set(range(expected)))
        raise CacheFormatError(
            f"{cache_name} cache at {cache_dir} declares {num_samples} samples ({expected} shards of {shard_size}) "
            f"but found shard indices {_short(indices)} (missing {_short(missing)}, unexpected {_short(extra)}). "
            "Re-run the producer with --resume to write missing shards; remove unexpected shards only if they are "
            "not from this cache."
        )
    return indices


def _short(items: list[int], limit: int = 20) -> str:
    if len(items) <= limit:
        return str(items)
    return f"[{', '.join(map(str, items[:limit]))}, ... ({len(items)} in all)]"


# ---------------------------------------------------------------------------
# durable writes


def temp_path(path: str) -> str:
    """A sibling temporary name unique to this writer (host, process, random)."""
    return f"{path}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write_fn: Callable[[str], Any]) -> str:
    """Write ``path`` through a unique sibling temporary file and an atomic rename.

    ``write_fn(tmp_path)`` writes the temporary file; it is fsynced, renamed over
    ``path`` and the directory fsynced, so a crash leaves either the old file or
    the new one. If ``write_fn`` fails, the temporary file is removed and
    ``path`` is untouched.

    Returns:
        ``path``.
    """
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path(path)
    try:
        write_fn(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(parent)
    return path


def remove_temp_files(cache_dir: str) -> list[str]:
    """Delete temporary files left by interrupted writers; return their names.

    Only the lock holder may call this: another live writer's temp files would go too.
    """
    if not os.path.isdir(cache_dir):
        return []
    removed = [name for name in os.listdir(cache_dir) if TMP_MARK in name or name.endswith(".tmp")]
    for name in removed:
        try:
            os.unlink(os.path.join(cache_dir, name))
        except (FileNotFoundError, IsADirectoryError):
            pass
    return removed


# ---------------------------------------------------------------------------
# manifest


def write_manifest(cache_dir: str, manifest: dict[str, Any], format_version: int) -> str:
    """Write ``manifest.json`` atomically; ``format_version`` overrides any such key in ``manifest``.

    Returns:
        The manifest path.
    """
    body = {**manifest, "format_version": format_version}
    text = json.dumps(body, indent=2, sort_keys=True) + "\n"

    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text[: len(text) // 2])
            fault_point("mid_manifest_write", f)
            f.write(text[len(text) // 2 :])

    return atomic_write(manifest_path(cache_dir), _write)


def load_manifest_json(path: str) -> dict[str, Any]:
    """Parse a manifest file.

    Raises:
        FileNotFoundError: no such file (the message names the path).
        CacheFormatError: not JSON, or not a JSON object.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"cache manifest not found at {path}. Was the cache fully written? "
            "Run the producer (with --resume if it was interrupted)."
        )
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CacheFormatError(
            f"cache manifest {path} is not valid JSON ({exc}). Restore it or re-run the producer with --resume."
        ) from None
    if not isinstance(manifest, dict):
        raise CacheFormatError(f"cache manifest {path} must hold a JSON object, found {type(manifest).__name__}")
    return manifest


def manifest_counts(manifest: Mapping[str, Any], where: str) -> tuple[int, int]:
    """A manifest's ``(shard_size, num_samples)``, checked.

    Raises:
        CacheFormatError: missing or not integers, out of range, or more shards than six-digit names allow.
    """
    try:
        shard_size, num_samples = int(manifest["shard_size"]), int(manifest["num_samples"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise CacheFormatError(f"{where}: needs integer 'shard_size' and 'num_samples'") from None
    if shard_size < 1 or num_samples < 0:
        raise CacheFormatError(f"{where}: shard_size must be >= 1 and num_samples >= 0")
    if -(-num_samples // shard_size) > MAX_SHARDS:
        raise CacheFormatError(f"{where}: {num_samples} samples in shards of {shard_size} need more than {MAX_SHARDS} shards")
    return shard_size, num_samples


def shard_table(manifest: Mapping[str, Any], where: str) -> dict[int, dict[str, Any]]:
    """A native manifest's shard table by index (empty when it has none yet).

    Raises:
        CacheFormatError: ``shards`` is not a list of objects with distinct integer ``index`` values.
    """
    rows = manifest.get("shards", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) and type(r.get("index")) is int for r in rows):
        raise CacheFormatError(
            f"{where}: 'shards' must be a list of objects with an integer 'index'. "
            "Restore the manifest, or re-run the producer with --resume to rewrite it."
        )
    table = {r["index"]: r for r in rows}
    if len(table) != len(rows):
        raise CacheFormatError(f"{where}: the shard table lists an index twice. Re-run the producer with --resume to rewrite it.")
    return table


def default_producer_name(cache_name: str) -> str:
    """The seed's name for the tool that writes ``cache_name`` caches."""
    return f"precompute_{cache_name.lower().replace('-', '')}"


def read_manifest(
    cache_dir: str,
    cache_name: str,
    format_version: int,
    producer_name: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load and check a manifest's version.

    Args:
        cache_dir: the cache directory.
        cache_name: name used in messages.
        format_version: the version the caller reads.
        producer_name: the tool to re-run named in the version message.
        defaults: values for fields a manifest may predate; the manifest's own values win.

    Raises:
        FileNotFoundError: no manifest.
        CacheFormatError: invalid JSON or another version.
    """
    manifest = load_manifest_json(manifest_path(cache_dir))
    check_format_version(manifest, cache_dir, cache_name, format_version, producer_name)
    return {**(defaults or {}), **manifest}


def check_format_version(
    manifest: Mapping[str, Any], cache_dir: str, cache_name: str, format_version: int, producer_name: str | None = None
) -> None:
    """Refuse a manifest of another ``format_version``, naming the producer to re-run.

    Raises:
        CacheFormatError: the versions differ.
    """
    version = manifest.get("format_version")
    if version != format_version:
        producer = producer_name or default_producer_name(cache_name)
        raise CacheFormatError(
            f"{cache_name} cache at {cache_dir} has format_version={version}, expected {format_version}. "
            f"Regenerate the cache with the current {producer}."
        )


def check_cache_name(manifest: Mapping[str, Any], cache_dir: str, cache_name: str) -> None:
    """Refuse a native manifest written for another kind of cache.

    Raises:
        CacheFormatError: the manifest records another ``cache_name``.
    """
    found = manifest.get("cache_name")
    if found is not None and found != cache_name:
        raise CacheFormatError(
            f"cache at {cache_dir} is a {found!r} cache, not {cache_name!r}. "
            f"Point the reader at a {cache_name} cache or read it as {found!r}."
        )


# ---------------------------------------------------------------------------
# key schema


@dataclass(frozen=True)
class KeySpec:
    """One stored key.

    Attributes:
        name: tensor name.
        dtype: dtype the reader returns.
        shape: per-sample shape of a fixed key; per-row trailing shape of a ragged key.
        ragged: whether each sample has its own number of rows (concatenated, with offsets).
        encoding: storage encoding (``raw``, ``fp8``, ``zbf16``).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False
    encoding: str = "raw"

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("__") or "." in self.name:
            raise ValueError(f"key name {self.name!r} is reserved or invalid: use a non-empty name without '.' or '__'")
        dtype_name(self.dtype)
        get_encoding(self.encoding).check_dtype(self.name, self.dtype)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"key {self.name!r}: shape {self.shape} must be non-negative integers")
        if math.prod(self.shape) >= MAX_ELEMENTS:
            raise ValueError(f"key {self.name!r}: shape {self.shape} has too many elements per row")

    def to_json(self) -> dict[str, Any]:
        """The key's manifest entry."""
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape), "ragged": self.ragged, "encoding": self.encoding}

    @classmethod
    def from_json(cls, name: str, entry: Mapping[str, Any]) -> "KeySpec":
        """Parse a manifest entry.

        Raises:
            CacheFormatError: a malformed entry.
        """
        try:
            return cls(
                name=name,
                dtype=dtype_from_name(entry["dtype"]),
                shape=tuple(int(d) for d in entry["shape"]),
                ragged=bool(entry["ragged"]),
                encoding=str(entry.get("encoding", "raw")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CacheFormatError(f"malformed key schema entry for {name!r}: {entry!r} ({exc})") from None


Schema = dict[str, KeySpec]


def schema_to_json(schema: Schema) -> dict[str, Any]:
    """The manifest's ``keys`` object."""
    return {name: spec.to_json() for name, spec in schema.items()}


def schema_from_json(keys: Any, where: str) -> Schema:
    """Parse a manifest's ``keys`` object.

    Raises:
        CacheFormatError: not an object or a malformed entry (message names ``where``).
    """
    if not isinstance(keys, dict) or not keys:
        raise CacheFormatError(f"{where}: 'keys' must be a non-empty object mapping key names to their schema")
    try:
        return {name: KeySpec.from_json(name, entry) for name, entry in keys.items()}
    except CacheFormatError as exc:
        raise CacheFormatError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------------
# checksums


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3-128 hex digest of a contiguous tensor's bytes."""
    return xxhash.xxh3_128_hexdigest(bytes_view(tensor))


def file_checksum(path: str, chunk_bytes: int = 16 << 20) -> str:
    """xxh3-128 hex digest of a file, streamed."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        # no bigger than the file: zeroing a 16 MiB buffer costs more than hashing a small shard
        buf = bytearray(max(1, min(chunk_bytes, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


# ---------------------------------------------------------------------------
# safetensors files


@dataclass(frozen=True)
class WrittenFile:
    """What writing a safetensors file produced."""

    path: str
    bytes: int
    checksum: str


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> WrittenFile:
    """Write ``tensors`` as a safetensors file at ``path`` (atomically), hashing it as it goes.

    Tensors are laid out by element size (largest first), then name, so every
    tensor starts aligned to its element size and reads back as a zero-copy view;
    each must be a CPU tensor of a storable dtype.

    Returns:
        The path, the file size and the xxh3-128 of the whole file.
    """
    prefix, names = safetensors_prefix({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata)
    offset = 0
    views = []
    for name in names:
        t = tensors[name]
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().to("cpu").contiguous()
        view = bytes_view(t)
        offset += view.nbytes
        views.append(view)
    hasher = xxhash.xxh3_128()

    def _write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            _write_hashed(f, hasher, prefix)
            for i, view in enumerate(views):
                if i == len(views) // 2:
                    fault_point("mid_shard_write", f)
                _write_hashed(f, hasher, view)

    atomic_write(path, _write)
    return WrittenFile(path=path, bytes=len(prefix) + offset, checksum=hasher.hexdigest())


def safetensors_prefix(
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The bytes :func:`write_safetensors` puts before the data of tensors of these dtypes and shapes.

    Size estimates build it from shapes alone, so it must stay the one place the header is made.

    Returns:
        ``(length field + JSON header, tensor names in data order)``.
    """
    names = sorted(layout, key=lambda n: (-_itemsize(layout[n][0]), n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in names:
        dtype, shape = layout[name]
        nbytes = math.prod(shape) * _itemsize(dtype)
        header[name] = {"dtype": _ST_OF[_storable(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, names


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _write_hashed(f: BinaryIO, hasher: "xxhash.xxh3_128", data: bytes | memoryview) -> None:
    hasher.update(data)
    f.write(data)


class ShardFile:
    """A safetensors file opened for reading: parsed header and one read-only mapping.

    Tensors are zero-copy views of the mapping. The header is checked against the
    file size, so a truncated or padded file fails here with :class:`CacheCorruptError`
    rather than returning short data.

    Args:
        path: the file.

    Raises:
        FileNotFoundError: no such file.
        CacheCorruptError: the header is unreadable or does not match the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        # The file stays open (closed with this object) so that readers pread through the same file the
        # mapping shows, instead of opening it a second time and checking it is still the same file.
        f = self.handle = open(path, "rb")
        try:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CacheCorruptError(f"{path}: file is {size} bytes, too short for a safetensors header (truncated?)")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise CacheCorruptError(
                    f"{path}: header length {header_len} exceeds the file size {size} (truncated or not a safetensors file)"
                )
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise CacheCorruptError(f"{path}: safetensors header is not valid JSON ({exc})") from None
            if not isinstance(header, dict):
                raise CacheCorruptError(f"{path}: safetensors header is not a JSON object")
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise CacheCorruptError(f"{path}: safetensors __metadata__ must map strings to strings")
            self.metadata: dict[str, str] = meta
            self.data_start = 8 + header_len
            self.entries = _check_entries(path, header, size - self.data_start)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > self.data_start else None
        except BaseException:
            f.close()
            raise
        self.size = size
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8) if self._mm is not None else torch.empty(0, dtype=torch.uint8)
        self._views: dict[str, torch.Tensor] = {}

    def keys(self) -> Iterable[str]:
        """Tensor names in the file."""
        return self.entries.keys()

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of tensor ``name``.

        Raises:
            KeyError: no such tensor.
        """
        view = self._views.get(name)
        if view is None:
            dtype, shape, begin, end = self.entries[name]
            raw = self._buf[self.data_start + begin : self.data_start + end]
            if (self.data_start + begin) % raw.new_empty((), dtype=dtype).element_size():
                raw = raw.clone()  # valid safetensors need not be aligned (speccache's own files are): copy
            view = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
            self._views[name] = view
        return view

    def __getstate__(self) -> None:
        raise TypeError("ShardFile holds a memory mapping and cannot be pickled; reopen it by path")


def _check_entries(path: str, header: dict[str, Any], data_len: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    spans = []
    for name, info in header.items():
        try:
            dtype = _BY_ST[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise CacheCorruptError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from None
        if math.prod(d for d in shape if d) >= MAX_ELEMENTS:  # an empty tensor's other dimensions still make strides
            raise CacheCorruptError(f"{path}: tensor {name!r} header says shape {list(shape)}, which no tensor can have")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes:
            raise CacheCorruptError(f"{path}: tensor {name!r} header says shape {list(shape)} but spans bytes [{begin}, {end})")
        entries[name] = (dtype, shape, begin, end)
        spans.append((begin, end))
    spans.sort()
    position = 0
    for begin, end in spans:
        if begin != position:
            raise CacheCorruptError(f"{path}: tensor data is not contiguous at byte {position} (damaged header)")
        position = end
    if position != data_len:
        state = "truncated" if position > data_len else "longer than its header says"
        raise CacheCorruptError(
            f"{path}: file is {state} (header covers {position} data bytes, file has {data_len}). "
            "Delete the shard and re-run the producer with --resume."
        )
    return entries


# ---------------------------------------------------------------------------
# shards of the native layout


SHARD_META_FORMAT = "speccache_format"
SHARD_META_INDEX = "shard_index"
SHARD_META_SAMPLES = "num_samples"
SHARD_META_ROWS = "num_rows"
SHARD_META_CHECKSUMS = "xxh3_128"
SHARD_META_ERROR = "encoding_error"
"""Optional: JSON ``{key: {"sq_err", "sq_ref", "max"}}`` of each lossy key, so a resumed run still reports it."""


def shard_metadata(
    shard_index: int,
    num_samples: int,
    num_rows: int,
    parts: Mapping[str, torch.Tensor],
    encoding_error: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, str]:
    """Safetensors metadata that makes a shard self-describing (version, index, counts, per-tensor checksums,
    and the measured error of lossy keys when there are any)."""
    checksums = {name: tensor_checksum(t) for name, t in sorted(parts.items())}
    meta = {
        SHARD_META_FORMAT: str(FORMAT_VERSION),
        SHARD_META_INDEX: str(shard_index),
        SHARD_META_SAMPLES: str(num_samples),
        SHARD_META_ROWS: str(num_rows),
        SHARD_META_CHECKSUMS: json.dumps(checksums, sort_keys=True, separators=(",", ":")),
    }
    if encoding_error:
        meta[SHARD_META_ERROR] = json.dumps(encoding_error, sort_keys=True, separators=(",", ":"))
    return meta


def expected_parts(schema: Schema) -> set[str]:
    """Names of every tensor a native shard of ``schema`` holds (offsets included when any key is ragged)."""
    names = {OFFSETS_KEY} if any(s.ragged for s in schema.values()) else set()
    for spec in schema.values():
        names.update(part_name(spec.name, sfx) for sfx in encoding_suffixes(spec))
    return names


def encoding_suffixes(spec: KeySpec) -> tuple[str, ...]:
    """Part suffixes ``spec``'s encoding produces (found by encoding one empty sample)."""
    rows = torch.empty((0, *spec.shape), dtype=spec.dtype)
    return tuple(sorted(get_encoding(spec.encoding).encode(rows, torch.zeros(2, dtype=torch.int64))))
