"""Checking and describing a cache directory (``speccache verify`` / ``speccache inspect``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from speccache.errors import CacheCorruptError, CacheFormatError, SpeccacheError
from speccache.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARD_META_SAMPLES,
    ShardFile,
    existing_shard_indices,
    file_checksum,
    load_manifest_json,
    manifest_counts,
    manifest_path,
    num_shards,
    schema_from_json,
    shard_path,
    shard_table,
)
from speccache.shard import NativeShard

__all__ = ["Problem", "VerifyReport", "verify_cache", "inspect_cache"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a cache: the file and why."""

    file: str
    reason: str


@dataclass
class VerifyReport:
    """What :func:`verify_cache` found."""

    cache_dir: str
    problems: list[Problem] = field(default_factory=list)
    shards: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the cache is sound."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """A JSON-able summary."""
        return {
            "cache_dir": self.cache_dir,
            "ok": self.ok,
            "problems": [{"file": p.file, "reason": p.reason} for p in self.problems],
            "shards": self.shards,
        }


def verify_cache(cache_dir: str, progress: Iterable[int] | None = None) -> VerifyReport:
    """Check every file of a cache: manifest, shard set, each shard's header, counts, shapes and checksums.

    Args:
        cache_dir: the cache directory.
        progress: optional wrapper for the shard loop (e.g. a tqdm bar); gets the shard indices.

    Returns:
        The report; ``report.ok`` when nothing is wrong.
    """
    report = VerifyReport(cache_dir)
    mpath = manifest_path(cache_dir)
    try:
        manifest = load_manifest_json(mpath)
    except (FileNotFoundError, SpeccacheError) as exc:
        report.problems.append(Problem(MANIFEST_NAME, str(exc)))
        return report
    if "keys" not in manifest:
        report.problems.append(
            Problem(MANIFEST_NAME, f"format_version {manifest.get('format_version')!r} with no speccache key schema: "
                    f"not a speccache v{FORMAT_VERSION} cache (seed-layout caches can be read but not verified)")
        )
        return report
    if manifest.get("format_version") != FORMAT_VERSION:
        report.problems.append(
            Problem(MANIFEST_NAME, f"format_version {manifest.get('format_version')!r}, this speccache reads version "
                    f"{FORMAT_VERSION}: regenerate the cache with this version (or verify it with the version that wrote it)")
        )
        return report
    try:
        schema = schema_from_json(manifest["keys"], mpath)
        shard_size, num_samples = manifest_counts(manifest, mpath)
        expected_count = num_shards(num_samples, shard_size)
        table = shard_table(manifest, mpath)
        side_files = manifest.get("side_files") or {}
        if not isinstance(side_files, dict) or not all(isinstance(row, dict) for row in side_files.values()):
            raise CacheFormatError(f"{mpath}: 'side_files' must map file names to objects")
    except SpeccacheError as exc:
        report.problems.append(Problem(MANIFEST_NAME, f"malformed manifest: {exc}"))
        return report
    complete = manifest.get("complete") is True
    if not complete:
        report.problems.append(
            Problem(MANIFEST_NAME, "cache is not complete (still being written or interrupted); re-run the precompute with --resume")
        )
    if complete and sorted(table) != list(range(expected_count)):
        report.problems.append(Problem(MANIFEST_NAME, f"shard table lists {sorted(table)}, expected 0..{expected_count - 1}"))
    present = existing_shard_indices(cache_dir)
    for extra in sorted(present - set(range(expected_count))):
        report.problems.append(Problem(os.path.basename(shard_path(cache_dir, extra)), "unexpected shard: not part of this cache"))
    tokens = 0
    indices = range(expected_count)
    for index in progress(indices) if progress is not None else indices:
        name = os.path.basename(shard_path(cache_dir, index))
        if index not in present:
            report.problems.append(Problem(name, "missing shard"))
            continue
        expected = min(shard_size, num_samples - index * shard_size)
        try:
            shard = NativeShard(shard_path(cache_dir, index), schema, index, expected, verify=True)
            checksum = file_checksum(shard.path)
        except (SpeccacheError, OSError) as exc:
            report.problems.append(Problem(name, str(exc)))
            continue
        shard_tokens = shard.row_offsets[-1] if any(s.ragged for s in schema.values()) else 0
        tokens += shard_tokens
        row = table.get(index)
        if row is not None:
            for key, value in (("samples", shard.num_samples), ("tokens", shard_tokens), ("bytes", shard.file.size), ("xxh3_128", checksum)):
                if row.get(key) != value:
                    report.problems.append(Problem(name, f"{key} is {value!r} but the manifest's shard table says {row.get(key)!r}"))
        report.shards.append({"name": name, "samples": shard.num_samples, "tokens": shard_tokens, "bytes": shard.file.size, "xxh3_128": checksum})
    if complete and manifest.get("num_tokens") not in (None, tokens) and len(report.shards) == expected_count:
        report.problems.append(Problem(MANIFEST_NAME, f"num_tokens says {manifest.get('num_tokens')} but the shards hold {tokens}"))
    for side, row in side_files.items():
        path = os.path.join(cache_dir, side)
        if not os.path.exists(path):
            report.problems.append(Problem(side, "missing side file"))
            continue
        try:
            checksum = file_checksum(path)
        except OSError as exc:
            report.problems.append(Problem(side, f"cannot read side file: {exc}"))
            continue
        if checksum != row.get("xxh3_128"):
            report.problems.append(Problem(side, "side file does not match its checksum in the manifest"))
    return report


def inspect_cache(cache_dir: str) -> dict[str, Any]:
    """Describe a cache: schema, counts, bytes per key and per token, completeness.

    Reads the manifest and every shard's header (not its data).

    Raises:
        FileNotFoundError, CacheFormatError: no or malformed manifest.
    """
    manifest = load_manifest_json(manifest_path(cache_dir))
    schema = schema_from_json(manifest.get("keys"), manifest_path(cache_dir))
    key_bytes = {name: 0 for name in schema}
    other = 0
    tokens = 0
    indices = sorted(existing_shard_indices(cache_dir))
    for index in indices:
        shard = ShardFile(shard_path(cache_dir, index))
        for tensor, (_, _, begin, end) in shard.entries.items():
            owner = tensor.split(".", 1)[0]
            if owner in key_bytes:
                key_bytes[owner] += end - begin
            else:
                other += end - begin
        other += shard.data_start
        try:
            tokens += int(shard.metadata.get("num_rows", 0)) if shard.metadata.get(SHARD_META_SAMPLES) else 0
        except ValueError:
            raise CacheCorruptError(f"{shard.path}: shard metadata num_rows={shard.metadata['num_rows']!r} is not a count") from None
    total = sum(key_bytes.values()) + other
    per_token = (lambda b: b / tokens) if tokens else (lambda b: None)
    side_files = manifest.get("side_files") or {}
    side = {name: row.get("bytes") for name, row in side_files.items() if isinstance(row, dict)} if isinstance(side_files, dict) else {}
    return {
        "cache_dir": cache_dir,
        "cache_name": manifest.get("cache_name"),
        "format_version": manifest.get("format_version"),
        "complete": manifest.get("complete") is True,
        "num_samples": manifest.get("num_samples"),
        "num_tokens": tokens,
        "shard_size": manifest.get("shard_size"),
        "num_shards": len(indices),
        "keys": {
            name: {**spec.to_json(), "bytes": key_bytes[name], "bytes_per_token": per_token(key_bytes[name])}
            for name, spec in schema.items()
        },
        "overhead_bytes": other,
        "shard_bytes": total,
        "side_file_bytes": side,
        "bytes_per_token": per_token(total),
        "config": manifest.get("config"),
        "stats": manifest.get("stats"),
    }
