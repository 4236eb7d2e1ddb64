"""The native shard layout: turning a batch of samples into shard tensors and back.

A shard of ``n`` samples holds, per key, the parts its encoding produces from
the key's rows (``[n, *shape]`` for a fixed key, ``[tokens, *shape]`` for a
ragged key) and, when any key is ragged, ``__offsets__`` (int64 ``[n + 1]``)
so that sample ``i`` owns rows ``offsets[i]:offsets[i+1]`` of every ragged key.
The safetensors metadata makes each shard self-describing (see
:func:`speccache.format.shard_metadata`).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Mapping

import torch

from speccache.encoding import get_encoding, part_name
from speccache.errors import CacheCorruptError, CacheFormatError
from speccache.format import (
    FORMAT_VERSION,
    LENGTHS_KEY,
    OFFSETS_KEY,
    SHARD_META_CHECKSUMS,
    SHARD_META_FORMAT,
    SHARD_META_INDEX,
    SHARD_META_SAMPLES,
    KeySpec,
    Schema,
    ShardFile,
    WrittenFile,
    expected_parts,
    shard_metadata,
    tensor_checksum,
    write_safetensors,
)


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
    meta = shard_metadata(shard_index, n, tokens, tensors, errors)
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
        verify: also check every tensor's xxh3-128 against the shard metadata.

    Raises:
        CacheCorruptError: truncated or damaged file, or (with ``verify``) checksum mismatch.
        CacheFormatError: the shard does not match the schema or the manifest.
    """

    def __init__(self, path: str, schema: Schema, shard_index: int, num_samples: int | None, verify: bool = False) -> None:
        self.path = path
        self.file = ShardFile(path)
        meta = self.file.metadata
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
        want = expected_parts(schema)
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
                f"{path}: shard metadata {SHARD_META_SAMPLES}={meta.get(SHARD_META_SAMPLES)!r} is not a count (damaged header)"
            ) from None
        if num_samples is not None and self.num_samples != num_samples:
            raise CacheFormatError(
                f"{path}: holds {self.num_samples} samples, the manifest expects {num_samples}. "
                "Delete the shard and re-run the producer with --resume."
            )
        if verify:
            verify_tensor_checksums(self.file)
        self.schema = schema
        self.fixed_offsets = torch.arange(self.num_samples + 1, dtype=torch.int64)
        self.offsets = self.file.tensor(OFFSETS_KEY) if OFFSETS_KEY in have else self.fixed_offsets
        self._check_structure()
        self.row_offsets: list[int] = self.offsets.tolist()
        self.parts = {
            name: {sfx: self.file.tensor(part_name(name, sfx)) for sfx in _suffixes(have, name)} for name in schema
        }

    def _check_structure(self) -> None:
        offsets = self.offsets
        if offsets.dtype != torch.int64 or offsets.shape != (self.num_samples + 1,):
            raise CacheCorruptError(f"{self.path}: {OFFSETS_KEY} must be int64 [{self.num_samples + 1}]")
        if self.num_samples and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())):
            raise CacheCorruptError(f"{self.path}: {OFFSETS_KEY} are not non-decreasing from 0 (damaged shard)")
        for name, spec in self.schema.items():
            if spec.encoding != "raw":
                for suffix, (dtype, trailing) in _part_layout(spec).items():
                    part = part_name(name, suffix)
                    found_dtype, shape, _, _ = self.file.entries[part]
                    if found_dtype != dtype or len(shape) != 1 + len(trailing) or shape[1:] != trailing:
                        raise CacheFormatError(
                            f"{self.path}: part {part!r} is {found_dtype} {list(shape)}, but key {name!r} of the manifest "
                            f"({spec.encoding} {spec.dtype} {list(spec.shape)}) needs {dtype} [rows, {', '.join(map(str, trailing))}]. "
                            "Delete the shard and re-run the producer with --resume."
                        )
                continue
            t = self.file.tensor(name)
            rows = int(offsets[-1]) if spec.ragged else self.num_samples
            if t.dtype != spec.dtype or tuple(t.shape) != (rows, *spec.shape):
                raise CacheFormatError(
                    f"{self.path}: key {name!r} is {t.dtype} {list(t.shape)}, the manifest says {spec.dtype} "
                    f"[{rows}, {', '.join(map(str, spec.shape))}]. Delete the shard and re-run the producer with --resume."
                )

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows of samples ``[start, end)`` of key ``name``; may be a view of the mapping."""
        spec = self.schema[name]
        if spec.encoding == "raw":
            # The raw decode with Python offsets: indexing the offsets tensor costs more than the slice.
            part = self.parts[name][""]
            return part[self.row_offsets[start] : self.row_offsets[end]] if spec.ragged else part[start:end]
        offsets = self.offsets if spec.ragged else self.fixed_offsets
        try:
            return get_encoding(spec.encoding).decode(self.parts[name], offsets, start, end, spec.dtype)
        except ValueError as exc:  # an encoding's parts disagree with each other: damaged data
            raise CacheCorruptError(
                f"{self.path}: key {name!r} cannot be decoded ({exc}). Delete the shard and re-run the producer with --resume."
            ) from exc


@functools.lru_cache(maxsize=None)
def _part_layout(spec: KeySpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and trailing shape (after the first dimension) of each part of ``spec``'s encoding, from encoding no rows."""
    rows = torch.empty((0, *spec.shape), dtype=spec.dtype)
    parts = get_encoding(spec.encoding).encode(rows, torch.zeros(2, dtype=torch.int64))
    return {suffix: (part.dtype, tuple(part.shape[1:])) for suffix, part in parts.items()}


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


def verify_tensor_checksums(file: ShardFile) -> None:
    """Check every tensor of ``file`` against the xxh3-128 recorded in its metadata.

    Raises:
        CacheCorruptError: a mismatch or missing checksum; names the tensor.
    """
    try:
        recorded = json.loads(file.metadata[SHARD_META_CHECKSUMS])
    except (KeyError, ValueError):
        raise CacheCorruptError(f"{file.path}: shard metadata has no readable tensor checksums") from None
    for name in file.keys():
        if recorded.get(name) != tensor_checksum(file.tensor(name)):
            raise CacheCorruptError(
                f"{file.path}: tensor {name!r} does not match its checksum (damaged data). "
                "Delete the shard and re-run the producer with --resume."
            )
