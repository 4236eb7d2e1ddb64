"""The manifest of a native cache: parsed once into a :class:`Manifest`, written whole.

Every field name of ``manifest.json`` is spelled in this module only; writers,
readers, ``verify``, ``inspect`` and the CLI ask a :class:`Manifest`.
docs/format.md §2 describes the same fields in prose.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from speccache._version import __version__
from speccache.errors import CacheFormatError
from speccache.format.durable import atomic_write
from speccache.format.names import FORMAT_VERSION, MAX_SHARDS, ceil_div, manifest_path, shard_samples
from speccache.format.schema import Schema, schema_from_json, schema_to_json

__all__ = ["Manifest", "ShardRecord", "SideFileRecord", "load_manifest_json", "manifest_text", "resume_identity"]

COMPARED_ON_RESUME = ("cache_name", "format_version", "keys", "shard_size", "num_samples", "config")
"""The fields a resumed run must match exactly (as JSON values)."""

CONFIG_DEFAULTS: Mapping[str, Any] = {
    "nonfinite": "fail",
    "batching": "ordered",
    "max_batch_tokens": None,
    "engine": "hf",
}
"""``config`` fields younger than some caches, with the value a manifest written before them stands for."""

CONFIG_CONTINUABLE: Mapping[str, tuple[Any, Any]] = {"nonfinite": ("fail", "skip")}
"""``config`` fields a resumed run may change, from the cache's value to the run's: what ``--nonfinite fail``
wrote holds no cleared sample, so it is what ``skip`` writes too (the reverse would keep cleared samples)."""


def load_manifest_json(path: str) -> dict[str, Any]:
    """Parse a manifest file into a JSON object (any layout, native or seed).

    Raises:
        FileNotFoundError: no such file, or its directory does not exist (the message names the path).
        CacheFormatError: not readable, not JSON, or not a JSON object.
    """
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):  # a mistyped path, not a cache its writer left unfinished
        what = "not a directory" if os.path.exists(directory) else "no such directory"
        raise FileNotFoundError(f"{what}: {directory} (no cache there); check the path")
    if not os.path.lexists(path):
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
    except OSError as exc:  # a directory, a dangling link, no permission
        raise CacheFormatError(f"cache manifest {path} cannot be read ({exc.strerror or exc}). Restore it.") from None
    if not isinstance(manifest, dict):
        raise CacheFormatError(f"cache manifest {path} must hold a JSON object, found {type(manifest).__name__}")
    return manifest


def resume_identity(body: Mapping[str, Any], run_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fields of manifest ``body`` a resumed run must match, as JSON values (tuples become lists).

    A :data:`CONFIG_DEFAULTS` field the manifest lacks reads as its default; given the run's ``run_config``, a
    :data:`CONFIG_CONTINUABLE` field reads as the run's value where the run may continue the cache's.
    """
    identity = json.loads(json.dumps({key: body.get(key) for key in COMPARED_ON_RESUME}))
    config = identity["config"]
    if isinstance(config, dict):
        config = identity["config"] = {**CONFIG_DEFAULTS, **config}
        for key, (found, run) in CONFIG_CONTINUABLE.items():
            if run_config is not None and config.get(key) == found and run_config.get(key) == run:
                config[key] = run
    return identity


def manifest_text(body: Mapping[str, Any]) -> str:
    """The manifest file's text: sorted keys, two-space indentation, a final newline."""
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def write_manifest_file(cache_dir: str, body: Mapping[str, Any]) -> str:
    """Write ``body`` as ``cache_dir``'s manifest, atomically and in one piece; returns the path."""
    text = manifest_text(body)

    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    return atomic_write(manifest_path(cache_dir), _write)


@dataclass(frozen=True)
class ShardRecord:
    """One row of the manifest's shard table.

    ``encoding_error`` holds the error sums of the shard's lossy keys
    (:func:`speccache.format.shard.encoding_error_sums`); empty when there are none.
    """

    index: int
    samples: int
    tokens: int
    bytes: int
    checksum: str
    encoding_error: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest entry."""
        row: dict[str, Any] = {
            "index": self.index,
            "samples": self.samples,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "xxh3_128": self.checksum,
        }
        if self.encoding_error:
            row["encoding_error"] = {k: dict(v) for k, v in self.encoding_error.items()}
        return row

    @classmethod
    def from_json(cls, row: Any, where: str) -> ShardRecord:
        """Parse a shard table row.

        Raises:
            CacheFormatError: not an object with integer counts and a checksum string.
        """
        try:
            if not isinstance(row, dict) or type(row["index"]) is not int:
                raise TypeError
            error = row.get("encoding_error") or {}
            if not isinstance(error, dict):
                raise TypeError
            return cls(
                row["index"],
                _count(row["samples"]),
                _count(row["tokens"]),
                _count(row["bytes"]),
                str(row["xxh3_128"]),
                error,
            )
        except (KeyError, TypeError, ValueError):
            raise CacheFormatError(
                f"{where}: 'shards' must be a list of objects with integer 'index', 'samples', 'tokens', 'bytes' "
                f"and a 'xxh3_128' checksum (found {row!r:.200}). Restore the manifest, or re-run the producer "
                "with --resume to rewrite it."
            ) from None


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(value)
    return value


@dataclass(frozen=True)
class SideFileRecord:
    """A side file listed in the manifest: its size and whole-file xxh3-128."""

    bytes: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        """The manifest entry."""
        return {"bytes": self.bytes, "xxh3_128": self.checksum}


@dataclass
class Manifest:
    """A native cache's manifest.

    Attributes:
        cache_name: the kind of cache (``"eagle3"``...).
        schema: the key schema.
        shard_size: samples per shard.
        num_samples: samples in the finished cache.
        config: the producer's configuration (a resume must match it).
        complete: whether the cache is sealed.
        shards: the shard table by index (written at seal).
        side_files: side files by name.
        stats: producer statistics (informational).
        num_tokens: recorded at seal: rows of the ragged keys in all shards.
        total_bytes: recorded at seal: bytes of all shards.
        producer: what wrote the cache.
        reclaimed: recorded at seal: the shards a following trainer had reclaimed by then (deleted or moved after
            use, each with its reclaim record; format/reclaim.py), in the shard table like the others.
        format_version: the layout version.
        path: where the manifest was read from (messages only).
    """

    cache_name: str
    schema: Schema
    shard_size: int
    num_samples: int
    config: dict[str, Any] = field(default_factory=dict)
    complete: bool = False
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    side_files: dict[str, SideFileRecord] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    num_tokens: int | None = None
    total_bytes: int | None = None
    producer: dict[str, Any] = field(default_factory=lambda: {"name": "speccache", "version": __version__})
    reclaimed: tuple[int, ...] = ()
    format_version: int = FORMAT_VERSION
    path: str = field(default="", compare=False)

    # -- reading

    @classmethod
    def read(cls, cache_dir: str, cache_name: str | None = None) -> Manifest:
        """Read and check ``cache_dir``'s manifest.

        Args:
            cache_dir: the cache directory.
            cache_name: the kind of cache the caller expects (``None``: any).

        Raises:
            FileNotFoundError: no manifest.
            CacheFormatError: unreadable or malformed, another format version, a seed-layout
                manifest (no key schema), or another kind of cache than ``cache_name``.
        """
        path = manifest_path(cache_dir)
        manifest = cls.from_json(load_manifest_json(path), path)
        if cache_name is not None and manifest.cache_name != cache_name:
            raise CacheFormatError(
                f"cache at {cache_dir} is a {manifest.cache_name!r} cache, not {cache_name!r}. "
                f"Point the reader at a {cache_name} cache or read it as {manifest.cache_name!r}."
            )
        return manifest

    @classmethod
    def from_json(cls, body: Mapping[str, Any], where: str) -> Manifest:
        """Parse a manifest's JSON object.

        Raises:
            CacheFormatError: as for :meth:`read`; the message names ``where``.
        """
        if "keys" not in body:
            raise CacheFormatError(
                f"{where}: format_version {body.get('format_version')!r} with no speccache key schema ('keys'): "
                "a seed-layout cache, not a native speccache cache. "
                "Read it with speccache.offline_cache.CachedTensorDataset."
            )
        version = body.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheFormatError(
                f"{where}: has format_version={version}, expected {FORMAT_VERSION}. "
                "Regenerate the cache with this speccache (or read it with the version that wrote it)."
            )
        schema = schema_from_json(body["keys"], where)
        shard_size, num_samples = _counts(body, where)
        rows = body.get("shards", [])
        if not isinstance(rows, list):
            raise CacheFormatError(
                f"{where}: 'shards' must be a list. Re-run the producer with --resume to rewrite it."
            )
        shards: dict[int, ShardRecord] = {}
        for row in rows:
            record = ShardRecord.from_json(row, where)
            if record.index in shards:
                raise CacheFormatError(
                    f"{where}: the shard table lists index {record.index} twice. "
                    "Re-run the producer with --resume to rewrite it."
                )
            shards[record.index] = record
        side = body.get("side_files") or {}
        if not isinstance(side, dict) or not all(
            isinstance(r, dict) and type(r.get("bytes")) is int and isinstance(r.get("xxh3_128"), str)
            for r in side.values()
        ):
            raise CacheFormatError(f"{where}: 'side_files' must map file names to {{'bytes': int, 'xxh3_128': str}}")
        producer = body.get("producer")
        reclaimed = body.get("reclaimed", [])
        if not isinstance(reclaimed, list) or not all(type(i) is int and i in shards for i in reclaimed):
            raise CacheFormatError(f"{where}: 'reclaimed' must list indices of the shard table")
        cache_name, config, stats = body.get("cache_name"), body.get("config", {}), body.get("stats", {})
        if not isinstance(cache_name, str) or not isinstance(config, dict) or not isinstance(stats, dict):
            raise CacheFormatError(f"{where}: 'cache_name' must be a string, 'config' and 'stats' objects")
        return cls(
            cache_name=cache_name,
            schema=schema,
            shard_size=shard_size,
            num_samples=num_samples,
            config=config,
            complete=body.get("complete") is True,
            shards=shards,
            side_files={name: SideFileRecord(r["bytes"], r["xxh3_128"]) for name, r in side.items()},
            stats=stats,
            num_tokens=_optional_count(body.get("num_tokens")),
            total_bytes=_optional_count(body.get("total_bytes")),
            producer=producer if isinstance(producer, dict) else {},
            reclaimed=tuple(reclaimed),
            format_version=version,
            path=where,
        )

    # -- writing

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object (optional fields only when set)."""
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "cache_name": self.cache_name,
            "producer": self.producer,
            "keys": schema_to_json(self.schema),
            "shard_size": self.shard_size,
            "num_samples": self.num_samples,
            "config": self.config,
            "complete": self.complete,
        }
        if self.shards or self.complete:
            body["shards"] = [self.shards[i].to_json() for i in sorted(self.shards)]
        if self.num_tokens is not None:
            body["num_tokens"] = self.num_tokens
        if self.total_bytes is not None:
            body["total_bytes"] = self.total_bytes
        if self.side_files:
            body["side_files"] = {name: r.to_json() for name, r in self.side_files.items()}
        if self.stats:
            body["stats"] = self.stats
        if self.reclaimed:
            body["reclaimed"] = list(self.reclaimed)
        return body

    def write(self, cache_dir: str) -> str:
        """Write this manifest into ``cache_dir`` atomically; returns the path."""
        return write_manifest_file(cache_dir, self.to_json())

    def sealed(
        self, shards: Iterable[ShardRecord], stats: Mapping[str, Any] | None = None, reclaimed: Iterable[int] = ()
    ) -> Manifest:
        """This manifest completed with its shard table, totals, the error summary of lossy keys and the shards
        reclaimed so far.

        Raises:
            CacheFormatError: the table does not hold exactly the shards ``0 .. num_shards - 1``.
        """
        table = {r.index: r for r in shards}
        if sorted(table) != list(range(self.num_shards)):
            raise CacheFormatError(
                f"cannot seal {self.path or 'the cache'}: shard table is incomplete ({len(table)} shards)"
            )
        merged = {**self.stats, **(stats or {})}
        error = encoding_error_summary(table[i] for i in sorted(table))  # a fixed order: the sums are floats
        if error:
            merged["encoding_error"] = error
        return replace(
            self,
            shards=table,
            num_tokens=sum(r.tokens for r in table.values()),
            total_bytes=sum(r.bytes for r in table.values()),
            stats=merged,
            reclaimed=tuple(sorted(reclaimed)),
            complete=True,
        )

    def resume_identity(self) -> dict[str, Any]:
        """The fields a resumed run must match, as JSON values (see :func:`resume_identity`)."""
        return resume_identity(self.to_json())

    # -- counts and checks

    @property
    def num_shards(self) -> int:
        """Shards of the finished cache."""
        return ceil_div(self.num_samples, self.shard_size)

    @property
    def ragged(self) -> bool:
        """Whether any key is ragged (then shards hold ``__offsets__`` and count tokens)."""
        return any(spec.ragged for spec in self.schema.values())

    def shard_samples(self, index: int) -> int:
        """Samples in shard ``index``."""
        return shard_samples(index, self.num_samples, self.shard_size)

    def problems(self) -> list[str]:
        """What is inconsistent within the manifest itself (empty when nothing): the shard table of a
        sealed cache against the counts, and the recorded totals against the table."""
        if not self.complete:
            return ["cache is not complete (still being written or interrupted); re-run the precompute with --resume"]
        found = []
        if sorted(self.shards) != list(range(self.num_shards)):
            found.append(f"shard table lists {sorted(self.shards)}, expected 0..{self.num_shards - 1}")
        for index, record in sorted(self.shards.items()):
            if index < self.num_shards and record.samples != self.shard_samples(index):
                found.append(
                    f"shard table says shard {index} holds {record.samples} samples, "
                    f"expected {self.shard_samples(index)}"
                )
        tokens = sum(r.tokens for r in self.shards.values())
        if self.num_tokens is not None and self.num_tokens != tokens:
            found.append(f"num_tokens says {self.num_tokens} but the shard table holds {tokens}")
        return found


def _counts(body: Mapping[str, Any], where: str) -> tuple[int, int]:
    try:
        shard_size, num_samples = body["shard_size"], body["num_samples"]
        if isinstance(shard_size, bool) or isinstance(num_samples, bool):
            raise TypeError
        shard_size, num_samples = int(shard_size), int(num_samples)
    except (KeyError, TypeError, ValueError, OverflowError):
        raise CacheFormatError(f"{where}: needs integer 'shard_size' and 'num_samples'") from None
    if shard_size < 1 or num_samples < 0:
        raise CacheFormatError(f"{where}: shard_size must be >= 1 and num_samples >= 0")
    if ceil_div(num_samples, shard_size) > MAX_SHARDS:
        raise CacheFormatError(
            f"{where}: {num_samples} samples in shards of {shard_size} need more than {MAX_SHARDS} shards"
        )
    return shard_size, num_samples


def _optional_count(value: Any) -> int | None:
    return value if type(value) is int else None


def encoding_error_summary(records: Iterable[ShardRecord]) -> dict[str, dict[str, float]]:
    """Whole-cache error of each lossy key from the shard table's per-shard sums.

    Returns:
        ``{key: {"rms": relative RMS error over every value, "max": largest error relative
        to its row's amax}}``, as :func:`speccache.format.encoding.fp8.fp8_error` defines them;
        empty when no shard recorded any.
    """
    totals: dict[str, list[float]] = {}
    for record in records:
        for key, sums in record.encoding_error.items():
            t = totals.setdefault(key, [0.0, 0.0, 0.0])
            t[0] += float(sums["sq_err"])
            t[1] += float(sums["sq_ref"])
            t[2] = max(t[2], float(sums["max"]))
    out = {}
    for key, (sq_err, sq_ref, worst) in totals.items():
        rms = math.sqrt(sq_err / sq_ref) if sq_ref > 0 else (0.0 if sq_err == 0 else math.inf)
        out[key] = {"rms": rms, "max": worst}
    return out
