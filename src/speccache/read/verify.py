"""Checking and describing a cache directory (``speccache verify`` / ``speccache inspect``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from speccache.errors import CacheCorruptError, CacheFormatError, SpeccacheError
from speccache.format import (
    MANIFEST_NAME,
    Manifest,
    NativeShard,
    ShardFile,
    existing_shard_indices,
    file_checksum,
    shard_path,
)
from speccache.format.reclaim import read_reclaims
from speccache.format.shard import SHARD_META_ROWS, SHARD_META_SAMPLES

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
    reclaimed: list[dict[str, Any]] = field(default_factory=list)
    """Shards a following trainer deleted (or moved) after use, as their reclaim records describe them."""

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
            "reclaimed": self.reclaimed,
        }


def verify_cache(cache_dir: str, progress: Callable[[Iterable[int]], Iterable[int]] | None = None) -> VerifyReport:
    """Check every file of a cache: manifest, shard set, each shard's header, counts, shapes and checksums.

    Args:
        cache_dir: the cache directory.
        progress: optional wrapper for the shard loop (e.g. a tqdm bar); gets the shard indices.

    Returns:
        The report; ``report.ok`` when nothing is wrong.

    Raises:
        FileNotFoundError: ``cache_dir`` is not a directory (a wrong path rather than a broken cache).
    """
    report = VerifyReport(cache_dir)
    try:
        manifest = Manifest.read(cache_dir)
    except FileNotFoundError as exc:
        if not os.path.isdir(cache_dir):  # not a cache at all: there is nothing to report on
            raise
        report.problems.append(Problem(MANIFEST_NAME, str(exc)))
        return report
    except SpeccacheError as exc:
        report.problems.append(Problem(MANIFEST_NAME, f"malformed manifest: {exc}"))
        return report
    report.problems.extend(Problem(MANIFEST_NAME, reason) for reason in manifest.problems())
    expected_count = manifest.num_shards
    present = existing_shard_indices(cache_dir)
    for extra in sorted(present - set(range(expected_count))):
        report.problems.append(
            Problem(os.path.basename(shard_path(cache_dir, extra)), "unexpected shard: not part of this cache")
        )
    tokens = 0
    try:
        reclaims = read_reclaims(cache_dir)
    except CacheFormatError as exc:
        report.problems.append(Problem("reclaim records", str(exc)))
        reclaims = {}
    indices = range(expected_count)
    for index in progress(indices) if progress is not None else indices:
        name = os.path.basename(shard_path(cache_dir, index))
        if index not in present and index in reclaims:
            record = reclaims[index].record
            tokens += record.tokens
            report.reclaimed.append(
                {"name": name, "samples": record.samples, "tokens": record.tokens, "bytes": record.bytes,
                 "xxh3_128": record.checksum, "moved_to": reclaims[index].moved_to}
            )  # fmt: skip
            continue
        if index not in present:
            reason = "missing shard"
            if index in manifest.reclaimed:
                reason += " (the manifest lists it as reclaimed, but its reclaim record is gone)"
            report.problems.append(Problem(name, reason))
            continue
        try:
            shard = NativeShard(
                shard_path(cache_dir, index), manifest.schema, index, manifest.shard_samples(index), verify=True
            )
            try:
                shard_tokens = shard.num_rows if manifest.ragged else 0
                found: dict[str, int | str] = {
                    "samples": shard.num_samples,
                    "tokens": shard_tokens,
                    "bytes": shard.file.size,
                }
            finally:
                shard.close()
            found["xxh3_128"] = file_checksum(shard.path)
        except (SpeccacheError, OSError) as exc:
            report.problems.append(Problem(name, str(exc)))
            continue
        tokens += shard_tokens
        table_row = manifest.shards.get(index)
        if table_row is not None:
            recorded = {
                "samples": table_row.samples,
                "tokens": table_row.tokens,
                "bytes": table_row.bytes,
                "xxh3_128": table_row.checksum,
            }
            for key, value in found.items():
                if recorded[key] != value:
                    report.problems.append(
                        Problem(name, f"{key} is {value!r} but the manifest's shard table says {recorded[key]!r}")
                    )
        report.shards.append({"name": name, **found})
    checked = len(report.shards) + len(report.reclaimed)
    if manifest.complete and manifest.num_tokens not in (None, tokens) and checked == expected_count:
        report.problems.append(
            Problem(MANIFEST_NAME, f"num_tokens says {manifest.num_tokens} but the shards hold {tokens}")
        )
    for side, side_record in manifest.side_files.items():
        path = os.path.join(cache_dir, side)
        try:
            checksum = file_checksum(path)
        except FileNotFoundError:
            report.problems.append(Problem(side, "missing side file"))
            continue
        except OSError as exc:
            report.problems.append(Problem(side, f"cannot read side file: {exc}"))
            continue
        if checksum != side_record.checksum:
            report.problems.append(Problem(side, "side file does not match its checksum in the manifest"))
    return report


def inspect_cache(cache_dir: str) -> dict[str, Any]:
    """Describe a cache: schema, counts, bytes per key and per token, completeness.

    Reads the manifest and every shard's header (not its data).

    Raises:
        FileNotFoundError, CacheFormatError: no or malformed manifest.
    """
    manifest = Manifest.read(cache_dir)
    key_bytes = {name: 0 for name in manifest.schema}
    other = 0
    tokens = 0
    indices = sorted(existing_shard_indices(cache_dir))
    for index in indices:
        path = shard_path(cache_dir, index)
        try:
            shard = ShardFile(path)
        except OSError as exc:
            raise CacheFormatError(
                f"{path}: cannot be read ({exc.strerror or exc}); `speccache verify` lists every problem"
            ) from None
        try:
            for tensor, (_, _, begin, end) in shard.entries.items():
                owner = tensor.split(".", 1)[0]
                if owner in key_bytes:
                    key_bytes[owner] += end - begin
                else:
                    other += end - begin
            other += shard.data_start
            rows = shard.metadata.get(SHARD_META_ROWS, "0") if shard.metadata.get(SHARD_META_SAMPLES) else "0"
            try:
                tokens += int(rows)
            except ValueError:
                raise CacheCorruptError(f"{path}: shard metadata num_rows={rows!r} is not a count") from None
        finally:
            shard.close()
    total = sum(key_bytes.values()) + other
    per_token = (lambda b: b / tokens) if tokens else (lambda b: None)
    return {
        "cache_dir": cache_dir,
        "cache_name": manifest.cache_name,
        "format_version": manifest.format_version,
        "complete": manifest.complete,
        "num_samples": manifest.num_samples,
        "num_tokens": tokens,
        "shard_size": manifest.shard_size,
        "num_shards": len(indices),
        "keys": {
            name: {
                **spec.to_json(),
                "bytes": key_bytes[name],
                "bytes_per_token": per_token(key_bytes[name]),
                "share": key_bytes[name] / total if total else None,
            }
            for name, spec in manifest.schema.items()
        },
        "overhead_bytes": other,
        "shard_bytes": total,
        "side_file_bytes": {name: record.bytes for name, record in manifest.side_files.items()},
        "bytes_per_token": per_token(total),
        "config": manifest.config,
        "producer": manifest.producer,
        "stats": manifest.stats or None,
        "reclaimed": sorted(set(read_reclaims(cache_dir)) - set(indices)),
    }
