"""The native shard layout: turning a batch of samples into shard tensors and back.

A shard of ``n`` samples holds, per key, the parts its encoding produces from
the key's rows (``[n, *shape]`` for a fixed key, ``[tokens, *shape]`` for a
ragged key) and, when any key is ragged, ``__offsets__`` (int64 ``[n + 1]``)
so that sample ``i`` owns rows ``offsets[i]:offsets[i+1]`` of every ragged key.
The safetensors metadata makes each shard self-describing: format version,
index, counts and per-tensor checksums (:func:`shard_metadata`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import operator
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from speccache.errors import CacheCorruptError, CacheFormatError
from speccache.format.durable import tensor_checksum
from speccache.format.encoding import get_encoding, part_name
from speccache.format.names import FORMAT_VERSION, LENGTHS_KEY, OFFSETS_KEY, STAT_PREFIX
from speccache.format.safetensors_file import ShardFile, WrittenFile, write_safetensors
from speccache.format.schema import KeySpec, Schema

__all__ = [
    "SHARD_META_CHECKSUMS",
    "SHARD_META_ROWS",
    "SHARD_META_SAMPLES",
    "NativeShard",
    "checksum_mismatch",
    "count_unsupervised",
    "encoding_error_sums",
    "expected_parts",
    "recorded_checksums",
    "sample_stats",
    "shard_metadata",
    "verify_tensor_checksums",
    "write_shard_file",
]

SHARD_META_FORMAT = "speccache_format"
SHARD_META_INDEX = "shard_index"
SHARD_META_SAMPLES = "num_samples"
SHARD_META_ROWS = "num_rows"
SHARD_META_CHECKSUMS = "xxh3_128"
SHARD_META_ERROR = "encoding_error"
"""Optional: JSON ``{key: {"sq_err", "sq_ref", "max"}}`` of each lossy key, so a resumed run still reports it."""
SHARD_META_STATS = "sample_stats"
"""Optional JSON ``{name: [one value per sample]}``: the producer's ``__stat__.NAME`` entries and ``tokens``
(``null`` where a float statistic is not finite)."""


def shard_metadata(
    shard_index: int,
    num_samples: int,
    num_rows: int,
    parts: Mapping[str, torch.Tensor],
    encoding_error: Mapping[str, Mapping[str, float]] | None = None,
    stats: Mapping[str, list[Any]] | None = None,
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
    if stats:
        meta[SHARD_META_STATS] = json.dumps(stats, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return meta


def sample_stats(samples: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """Per-sample statistics of a shard's samples (see :data:`SHARD_META_STATS`).

    Only a producer that computes statistics (``__stat__.NAME`` entries) gets them, with ``tokens`` added from
    ``__lengths__``; without any, the shard's bytes are those of a cache written before statistics existed.
    """
    named = {k[len(STAT_PREFIX) :]: v for k, v in samples.items() if k.startswith(STAT_PREFIX)}
    if not named:
        return {}
    stats: dict[str, list[Any]] = {}
    if LENGTHS_KEY in samples:
        stats["tokens"] = samples[LENGTHS_KEY].to(torch.int64).tolist()
    for name, value in named.items():
        if value.is_floating_point():
            stats[name] = [v if math.isfinite(v) else None for v in value.double().tolist()]
        else:
            stats[name] = value.to(torch.int64).tolist()
    return stats


def count_unsupervised(lengths: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """Samples with no supervised token: ``loss_mask`` rows (one per token) all false, ``lengths`` rows each."""
    lengths = lengths.to(torch.int64)
    if not lengths.numel():
        return 0
    sample_of_row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    supervised = torch.zeros(lengths.numel(), dtype=torch.int64).index_add_(0, sample_of_row, loss_mask.to(torch.int64))
    return int((supervised == 0).sum())


def expected_parts(schema: Schema) -> frozenset[str]:
    """Names of every tensor a native shard of ``schema`` holds (offsets included when any key is ragged)."""
    return _expected_parts(tuple(schema.values()))


@functools.lru_cache(maxsize=64)
def _expected_parts(specs: tuple[KeySpec, ...]) -> frozenset[str]:
    # Cached: every shard a reader opens asks again for the same schema.
    names = {OFFSETS_KEY} if any(s.ragged for s in specs) else set()
    for spec in specs:
        names.update(part_name(spec.name, sfx) for sfx in get_encoding(spec.encoding).parts(spec.dtype, spec.shape))
    return frozenset(names)


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``[n + 1]`` cumulative offsets of per-sample lengths."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64).reshape(-1), 0, out=offsets[1:])
    return offsets


def encode_shard(samples: Mapping[str, torch.Tensor], schema: Schema) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Encode a shard's samples into its tensors.

    Args:
        samples: fixed keys stacked ``[n, *shape]``; ragged keys concatenated
            ``[tokens, *shape]`` with ``__lengths__`` (``[n]``) giving each sample's rows.
        schema: the cache's key schema.

    Returns:
        ``(num_samples, num_tokens, tensors)``; ``num_tokens`` is 0 without ragged keys.

    Raises:
        ValueError: a key is missing or has the wrong dtype, shape or row count.
    """
    missing = [k for k in schema if k not in samples]
    if missing:
        raise ValueError(f"shard is missing keys {missing}; every sample must carry {sorted(schema)}")
    ragged = any(spec.ragged for spec in schema.values())
    if ragged and LENGTHS_KEY not in samples:
        raise ValueError(f"ragged keys need per-sample lengths under {LENGTHS_KEY!r}")
    n = int(samples[LENGTHS_KEY].shape[0]) if ragged else int(samples[next(iter(schema))].shape[0])
    offsets = lengths_to_offsets(samples[LENGTHS_KEY]) if ragged else torch.arange(n + 1, dtype=torch.int64)
    num_rows = int(offsets[-1])
    tensors: dict[str, torch.Tensor] = {OFFSETS_KEY: offsets} if ragged else {}
    for name, spec in schema.items():
        rows = samples[name]
        want_rows = num_rows if spec.ragged else n
        if rows.dtype != spec.dtype or tuple(rows.shape) != (want_rows, *spec.shape):
            raise ValueError(
                f"key {name!r}: got {rows.dtype} {list(rows.shape)}, schema says {spec.dtype} "
                f"[{want_rows}, {', '.join(map(str, spec.shape))}]"
            )
        key_offsets = offsets if spec.ragged else torch.arange(n + 1, dtype=torch.int64)
        for suffix, part in get_encoding(spec.encoding).encode(rows.detach().cpu(), key_offsets).items():
            tensors[part_name(name, suffix)] = part
    return n, (num_rows if ragged else 0), tensors


def write_shard_file(
    path: str, shard_index: int, samples: Mapping[str, torch.Tensor], schema: Schema
) -> tuple[WrittenFile, int, int, dict[str, dict[str, float]]]:
    """Encode and write one native shard atomically.

    Returns:
        ``(written file, num_samples, num_tokens, encoding error sums of its lossy keys)``
        (see :func:`encoding_error_sums`).
    """
    n, tokens, tensors = encode_shard(samples, schema)
    errors = encoding_error_sums(samples, schema, tensors)
    meta = shard_metadata(shard_index, n, tokens, tensors, errors, sample_stats(samples))
    return write_safetensors(path, tensors, meta), n, tokens, errors


_ERROR_BLOCK_VALUES = 1 << 20


def encoding_error_sums(
    samples: Mapping[str, torch.Tensor], schema: Schema, tensors: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, float]]:
    """Measure what a lossy key's readers will get against what was computed, for one shard.

    Decodes the shard's parts once (a block of samples at a time, so a large shard
    needs no second full-size copy) and compares with the original rows.

    Args:
        samples: the shard's input to :func:`encode_shard`.
        schema: the key schema.
        tensors: :func:`encode_shard`'s tensors of those samples.

    Returns:
        For each key with a lossy encoding: ``sq_err`` (sum of squared errors), ``sq_ref``
        (sum of squared values) and ``max`` (largest ``|error| / amax(|row|)``, rows of
        zeros counting against 1), the parts of :func:`speccache.encoding.fp8.fp8_error`
        that add up across shards.
    """
    lossy = {name: spec for name, spec in schema.items() if not get_encoding(spec.encoding).lossless}
    if not lossy:
        return {}
    n = int(samples[LENGTHS_KEY].shape[0]) if OFFSETS_KEY in tensors else int(samples[next(iter(schema))].shape[0])
    names = set(tensors)
    out: dict[str, dict[str, float]] = {}
    for name, spec in lossy.items():
        offsets = tensors[OFFSETS_KEY] if spec.ragged else torch.arange(n + 1, dtype=torch.int64)
        parts = {sfx: tensors[part_name(name, sfx)] for sfx in _suffixes(names, name)}
        rows = samples[name].detach().cpu()
        width = max(1, math.prod(spec.shape))
        sq_err = sq_ref = worst = 0.0
        a = 0
        while a < n:
            b = a + 1
            while b < n and int(offsets[b + 1] - offsets[a]) * width <= _ERROR_BLOCK_VALUES:
                b += 1
            r0, r1 = int(offsets[a]), int(offsets[b])
            if r1 > r0:
                decoded = get_encoding(spec.encoding).decode(parts, offsets, a, b, spec.dtype)
                block = _block_error(rows[r0:r1].reshape(r1 - r0, -1), decoded.reshape(r1 - r0, -1), torch.float32)
                if not (math.isfinite(block[0]) and 1e-30 < block[1] < math.inf):  # squares outside fp32's range
                    block = _block_error(rows[r0:r1].reshape(r1 - r0, -1), decoded.reshape(r1 - r0, -1), torch.float64)
                sq_err, sq_ref, worst = sq_err + block[0], sq_ref + block[1], max(worst, block[2])
            a = b
        out[name] = {"sq_err": sq_err, "sq_ref": sq_ref, "max": worst}
    return out


class NativeShard:
    """An open native shard, checked against the schema; decodes runs of samples.

    Args:
        path: the shard file.
        schema: the cache's key schema.
        shard_index: the index the shard must record.
        num_samples: the sample count the manifest expects, or ``None`` to accept the shard's own.
        verify: also check every tensor's xxh3-128 against the shard metadata (``True``), or only these tensors'.
        expected_bytes: the file size the manifest's shard table records, or ``None`` (an unsealed cache).

    Raises:
        CacheCorruptError: truncated or damaged file, or (with ``verify``) checksum mismatch.
        CacheFormatError: the shard does not match the schema or the manifest (another cache's shard).
    """

    def __init__(
        self,
        path: str,
        schema: Schema,
        shard_index: int,
        num_samples: int | None,
        verify: bool | Collection[str] = False,
        expected_bytes: int | None = None,
    ) -> None:
        self.path = path
        self.schema = schema
        self.file = ShardFile(path)
        try:
            self._check_identity(shard_index, num_samples)
            if verify:
                verify_tensor_checksums(self.file, None if verify is True else verify)
            have = set(self.file.keys())
            self.fixed_offsets = torch.arange(self.num_samples + 1, dtype=torch.int64)
            # a copy (n + 1 integers): no tensor of a refused shard may keep its mapping (and descriptor) alive
            self.offsets = self.file.tensor(OFFSETS_KEY).clone() if OFFSETS_KEY in have else self.fixed_offsets
            self.row_offsets: list[int] = self.offsets.tolist()
            self._check_structure()
            if expected_bytes is not None and self.file.size != expected_bytes:
                raise CacheCorruptError(
                    f"{path}: is {self.file.size} bytes, the manifest's shard table records {expected_bytes}: the file "
                    "was replaced or changed after the cache was sealed (a cache regenerated in place, or a restored "
                    "backup). Restart the reader on the new cache, or restore the shard."
                )
        except BaseException:
            self.file.close()  # a refused shard keeps no descriptor while its exception lives
            raise
        self.parts = {
            name: {sfx: self.file.tensor(part_name(name, sfx)) for sfx in _suffixes(have, name)} for name in schema
        }

    @property
    def num_rows(self) -> int:
        """Rows of the ragged keys in this shard (its sample count when no key is ragged)."""
        return self.row_offsets[-1]

    def sample_stats(self) -> dict[str, list[Any]]:
        """The per-sample statistics the shard's metadata records (empty for a shard written without them)."""
        return json.loads(self.file.metadata.get(SHARD_META_STATS, "{}"))

    def encoding_error(self) -> dict[str, dict[str, float]]:
        """The measured error sums of the shard's lossy keys, as its metadata records them (empty when none)."""
        return json.loads(self.file.metadata.get(SHARD_META_ERROR, "{}"))

    def unsupervised_samples(self) -> int:
        """Samples whose ``loss_mask`` is all false (0 without a ``loss_mask`` key): the ones a producer's
        ``--nonfinite skip`` cleared, since every planned sample has a supervised token (docs/format.md §7a)."""
        if "loss_mask" not in self.schema:
            return 0
        mask = self.rows("loss_mask", 0, self.num_samples)
        return count_unsupervised(self.offsets.diff(), mask)

    def close(self) -> None:
        """Close the shard's file (tensors already handed out stay valid)."""
        self.file.close()

    def _check_identity(self, shard_index: int, num_samples: int | None) -> None:
        """That this file is shard ``shard_index`` of this cache: version, index, tensors and counts."""
        path, meta = self.path, self.file.metadata
        if meta.get(SHARD_META_FORMAT) != str(FORMAT_VERSION):
            raise CacheFormatError(
                f"{path}: shard format {meta.get(SHARD_META_FORMAT)!r}, expected {FORMAT_VERSION}; "
                "the shard is not from this cache or from another speccache version. Re-run the producer."
            )
        if meta.get(SHARD_META_INDEX) != str(shard_index):
            raise CacheFormatError(
                f"{path}: records shard index {meta.get(SHARD_META_INDEX)}, but its name says {shard_index} "
                "(a copied or renamed shard). Delete it and re-run the producer with --resume."
            )
        want = expected_parts(self.schema)
        have = set(self.file.keys())
        if have != want:
            raise CacheFormatError(
                f"{path}: holds tensors {sorted(have)}, the schema needs {sorted(want)} "
                f"(missing {sorted(want - have)}, unexpected {sorted(have - want)}). "
                "Delete the shard and re-run the producer with --resume."
            )
        try:
            self.num_samples = int(meta.get(SHARD_META_SAMPLES, "-1"))
        except ValueError:
            raise CacheCorruptError(
                f"{path}: shard metadata {SHARD_META_SAMPLES}={meta.get(SHARD_META_SAMPLES)!r} "
                "is not a count (damaged header)"
            ) from None
        if num_samples is not None and self.num_samples != num_samples:
            raise CacheFormatError(
                f"{path}: holds {self.num_samples} samples, the manifest expects {num_samples}. "
                "Delete the shard and re-run the producer with --resume."
            )

    def _check_structure(self) -> None:
        offsets = self.row_offsets  # checked as Python ints: a shard is opened once per reader, often per epoch
        if self.offsets.dtype != torch.int64 or self.offsets.shape != (self.num_samples + 1,):
            raise CacheCorruptError(f"{self.path}: {OFFSETS_KEY} must be int64 [{self.num_samples + 1}]")
        if self.num_samples and (offsets[0] != 0 or not all(map(operator.le, offsets, offsets[1:]))):
            raise CacheCorruptError(f"{self.path}: {OFFSETS_KEY} are not non-decreasing from 0 (damaged shard)")
        for name, spec in self.schema.items():
            rows = offsets[-1] if spec.ragged else self.num_samples
            for suffix, layout in get_encoding(spec.encoding).parts(spec.dtype, spec.shape).items():
                part = part_name(name, suffix)
                found_dtype, shape, _, _ = self.file.entries[part]
                want = layout.shape(rows, self.num_samples, shape[0] if shape else 0)
                if found_dtype != layout.dtype or shape != want:
                    raise CacheFormatError(
                        f"{self.path}: key {name!r} is {found_dtype} {list(shape)}, the manifest says {spec.dtype} "
                        f"{list(want)}. Delete the shard and re-run the producer with --resume."
                        if not suffix
                        else f"{self.path}: part {part!r} is {found_dtype} {list(shape)}"
                        f", but key {name!r} of the manifest "
                        f"({spec.encoding} {spec.dtype} {list(spec.shape)}) needs {layout.dtype} {list(want)}. "
                        "Delete the shard and re-run the producer with --resume."
                    )

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows of samples ``[start, end)`` of key ``name``; may be a view of the mapping."""
        spec = self.schema[name]
        encoding = get_encoding(spec.encoding)
        if encoding.zero_copy:
            # The rows as stored, sliced with Python offsets: indexing the offsets tensor costs more than the slice.
            part = self.parts[name][""]
            return part[self.row_offsets[start] : self.row_offsets[end]] if spec.ragged else part[start:end]
        offsets = self.offsets if spec.ragged else self.fixed_offsets
        with self._decoding(name):
            return encoding.decode(self.parts[name], offsets, start, end, spec.dtype)

    def sample_rows(self, name: str, local: int, first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` (token positions, within its length) of sample ``local`` of ragged key ``name``,
        touching only the bytes the encoding needs for them; may be a view of the mapping."""
        spec = self.schema[name]
        encoding = get_encoding(spec.encoding)
        if encoding.zero_copy:
            base = self.row_offsets[local]
            return self.parts[name][""][base + first : base + last]
        with self._decoding(name):
            return encoding.decode_rows(self.parts[name], self.offsets, local, first, last, spec.dtype)

    @contextlib.contextmanager
    def _decoding(self, name: str) -> Iterator[None]:
        """Report an encoding's parts that disagree with each other (damaged data) as this shard's corruption."""
        try:
            yield
        except ValueError as exc:
            raise CacheCorruptError(
                f"{self.path}: key {name!r} cannot be decoded ({exc}). "
                "Delete the shard and re-run the producer with --resume."
            ) from exc


def _block_error(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, float]:
    """``(sum of squared errors, sum of squared values, max |error| / row amax)`` of 2-D ``x`` against ``y``."""
    # Per-row fp32 norms summed in float64: within ~1e-6 of a float64 pass at a fraction of its cost,
    # where one fp32 norm over millions of values drifts by ~1e-3.
    x = x.to(dtype, copy=True)
    sq_ref = float(torch.linalg.vector_norm(x, dim=1).double().square().sum())
    amax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_()) if x.shape[1] else torch.zeros(x.shape[0], dtype=dtype)
    diff = x.sub_(y.to(dtype))
    sq_err = float(torch.linalg.vector_norm(diff, dim=1).double().square().sum())
    if not x.shape[1]:
        return sq_err, sq_ref, 0.0
    row_err = torch.maximum(diff.amax(dim=1), diff.amin(dim=1).neg_())
    return sq_err, sq_ref, float((row_err / torch.where(amax > 0, amax, torch.ones_like(amax))).max())


def _suffixes(names: set[str], key: str) -> list[str]:
    prefix = key + "."
    return [""] * (key in names) + [n[len(prefix) :] for n in names if n.startswith(prefix)]


def verify_tensor_checksums(file: ShardFile, names: Collection[str] | None = None) -> None:
    """Check the tensors ``names`` of ``file`` (default: every one) against the xxh3-128 recorded in its metadata.

    Raises:
        CacheCorruptError: a mismatch or missing checksum; names the tensor.
    """
    recorded = recorded_checksums(file)
    for name in file.keys() if names is None else names:
        if recorded.get(name) != tensor_checksum(file.tensor(name)):
            raise checksum_mismatch(file.path, name)


def recorded_checksums(file: ShardFile) -> dict[str, str]:
    """The xxh3-128 of each tensor of ``file``, as its metadata records them.

    Raises:
        CacheCorruptError: the metadata holds no readable checksums.
    """
    try:
        recorded = json.loads(file.metadata[SHARD_META_CHECKSUMS])
    except (KeyError, ValueError):
        raise CacheCorruptError(f"{file.path}: shard metadata has no readable tensor checksums") from None
    if not isinstance(recorded, dict):
        raise CacheCorruptError(f"{file.path}: shard metadata has no readable tensor checksums")
    return recorded


def checksum_mismatch(path: str, name: str) -> CacheCorruptError:
    """The error for tensor ``name`` of shard ``path``, whose bytes differ from its recorded checksum."""
    return CacheCorruptError(
        f"{path}: tensor {name!r} does not match its checksum (damaged data). "
        "Delete the shard and re-run the producer with --resume."
    )
