"""Views: a manifest (``view.json``) that selects samples of other caches' shards by relative path and checksum.

A view rewrites no shard. It records, per source cache, its directory relative
to the view, the checksum of its ``manifest.json`` and the size and checksum of
every shard it reads from, then the selected samples as runs ``[source, start,
end)`` of source sample indices, in view order, and optional per-source
mixture weights. Opening a view re-checks the recorded facts that are cheap to
check (each source manifest's checksum, each shard's presence and size) and
refuses, naming the path and the reason, a source that changed or vanished;
``speccache verify VIEW`` also re-hashes every referenced shard.

Written with one atomic rename, a view is either absent or whole, whenever its
writer is killed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speccache.errors import CacheCorruptError, CacheExistsError, CacheFormatError
from speccache.format.durable import atomic_write, file_checksum, remove_temp_files, writes_to
from speccache.format.manifest import Manifest
from speccache.format.names import (
    MANIFEST_NAME,
    check_no_foreign_files,
    existing_shard_indices,
    manifest_path,
    shard_path,
)
from speccache.format.schema import Schema, schema_from_json, schema_to_json

__all__ = [
    "MAX_EPOCH_SAMPLES",
    "VIEW_NAME",
    "VIEW_VERSION",
    "SourceRecord",
    "View",
    "is_view",
    "new_view_dir",
    "source_record",
]

VIEW_NAME = "view.json"
VIEW_VERSION = 1
MAX_EPOCH_SAMPLES = 1 << 28
"""Bound on the samples one epoch of a view expands to under its weights: a sampler holds an index per position
(2 GiB of them here), and ``--weights 1e9,1`` would otherwise fail only when a trainer builds its loader."""


def new_view_dir(out: str) -> None:
    """Make sure a new view can be written at ``out``: a new or empty directory, or one a killed view writer left
    (its temporary file is removed). Every view writer calls this first, so no view lands inside a cache.

    Raises:
        CacheExistsError: ``out`` is a file, holds a view or a cache, or holds files of its own (nothing there is
            touched).
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise CacheExistsError(f"--out {out} is a file; choose a new directory for the view")
    if os.path.isdir(out):
        if any(os.path.exists(os.path.join(out, n)) for n in (VIEW_NAME, MANIFEST_NAME)) or existing_shard_indices(out):
            raise CacheExistsError(f"--out {out} already holds a view or a cache; choose a new directory for the view")
        check_no_foreign_files(out)
        remove_temp_files(out)


def is_view(path: str) -> bool:
    """Whether ``path`` is a view directory (holds ``view.json``)."""
    return os.path.isfile(os.path.join(path, VIEW_NAME))


@dataclass
class SourceRecord:
    """One source cache of a view.

    Attributes:
        path: the source directory, relative to the view directory.
        manifest_xxh3: the checksum of its ``manifest.json`` when the view was made.
        shards: shard index -> ``(bytes, xxh3_128)`` of each shard the view reads.
        weight: its mixture weight (samples of this source are drawn ``weight`` times as often per sample).
    """

    path: str
    manifest_xxh3: str
    shards: dict[int, tuple[int, str]]
    weight: float = 1.0

    def to_json(self) -> dict[str, Any]:
        """The ``sources`` entry."""
        return {
            "path": self.path,
            "manifest_xxh3": self.manifest_xxh3,
            "shards": [[i, b, c] for i, (b, c) in sorted(self.shards.items())],
            "weight": self.weight,
        }


@dataclass
class View:
    """A parsed ``view.json``.

    Attributes:
        cache_name: the sources' kind of cache.
        schema: their key schema.
        sources: the source caches.
        runs: ``(source, start, end)`` runs of source sample indices, in view order.
        selection: how the view was made (informational).
        path: the view directory.
    """

    cache_name: str
    schema: Schema
    sources: list[SourceRecord]
    runs: list[tuple[int, int, int]]
    selection: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    def __post_init__(self) -> None:
        """Refuse runs that name no source and weights a sampler could not expand (whoever made the view).

        Raises:
            CacheFormatError: names the view, the weights and the bound.
        """
        if any(not 0 <= s < len(self.sources) or not 0 <= a <= b for s, a, b in self.runs):
            raise CacheFormatError(f"view {self.path}: a sample run names no source or is reversed; re-create the view")
        weights = [source.weight for source in self.sources]
        epoch = sum((end - start) * weights[s] for s, start, end in self.runs)
        if not all(math.isfinite(w) and w > 0 for w in weights) or not epoch <= MAX_EPOCH_SAMPLES:
            raise CacheFormatError(
                f"view {self.path}: weights {weights} (--weights of speccache merge) must be finite and > 0 and "
                f"expand one epoch to at most {MAX_EPOCH_SAMPLES} samples (these give {epoch:.4g}); "
                "choose smaller weights and re-create the view"
            )

    @property
    def num_samples(self) -> int:
        """Samples in the view."""
        return sum(end - start for _, start, end in self.runs)

    def source_dir(self, source: int) -> str:
        """The absolute directory of source ``source``."""
        # from the view's real directory, as source_record measured it: any symlinked path to the view opens it
        return os.path.normpath(os.path.join(os.path.realpath(self.path), self.sources[source].path))

    def to_json(self) -> dict[str, Any]:
        """The ``view.json`` object."""
        return {
            "speccache_view": VIEW_VERSION,
            "cache_name": self.cache_name,
            "keys": schema_to_json(self.schema),
            "num_samples": self.num_samples,
            "sources": [s.to_json() for s in self.sources],
            "samples": [list(r) for r in self.runs],
            "selection": self.selection,
        }

    def write(self, view_dir: str) -> str:
        """Write ``view_dir/view.json`` atomically (creating the directory); returns its path.

        Raises:
            OutputError: the operating system refused (read-only, no permission, name too long, disk full).
        """
        text = json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

        def _write(tmp: str) -> None:
            with open(tmp, "w") as f:
                f.write(text)

        with writes_to(view_dir):
            os.makedirs(view_dir, exist_ok=True)
            return atomic_write(os.path.join(view_dir, VIEW_NAME), _write)

    @classmethod
    def read(cls, view_dir: str, check: bool = True) -> View:
        """Parse ``view_dir/view.json`` and (``check``) confirm every source is as recorded.

        Raises:
            CacheFormatError: not a valid view file.
            CacheCorruptError: a source manifest or shard changed or vanished (the path and the reason are named).
        """
        path = os.path.join(view_dir, VIEW_NAME)
        try:
            with open(path) as f:
                body = json.load(f)
            if body.get("speccache_view") != VIEW_VERSION:
                raise CacheFormatError(
                    f"{path}: speccache_view={body.get('speccache_view')!r}, this speccache reads version "
                    f"{VIEW_VERSION}; use the speccache that made the view"
                )
            sources = [
                SourceRecord(
                    str(s["path"]),
                    str(s["manifest_xxh3"]),
                    {int(i): (int(b), str(c)) for i, b, c in s["shards"]},
                    float(s.get("weight", 1.0)),
                )
                for s in body["sources"]
            ]
            runs = [(int(s), int(a), int(b)) for s, a, b in body["samples"]]
            view = cls(
                str(body["cache_name"]),
                schema_from_json(body["keys"], path),
                sources,
                runs,
                dict(body.get("selection") or {}),
                view_dir,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, CacheFormatError):
                raise
            raise CacheFormatError(
                f"{path}: not a readable view ({exc}); re-create it with speccache merge/subset"
            ) from None
        if check:
            view.check_sources()
        return view

    def check_sources(self) -> None:
        """Refuse a source whose manifest changed or whose shard changed size or vanished.

        Raises:
            CacheCorruptError: names the path and the reason.
        """
        for number, source in enumerate(self.sources):
            where = self.source_dir(number)
            try:
                found = file_checksum(manifest_path(where))
            except OSError as exc:
                raise CacheCorruptError(
                    f"{manifest_path(where)}: a source of view {self.path} vanished ({exc.strerror or exc}); "
                    "restore the source cache or re-create the view"
                ) from None
            if found != source.manifest_xxh3:
                raise CacheCorruptError(
                    f"{manifest_path(where)}: a source of view {self.path} changed since the view was made "
                    f"(its {MANIFEST_NAME} has another checksum: rewritten, resumed or appended to); "
                    "re-create the view"
                )
            for index, (size, _) in source.shards.items():
                shard = shard_path(where, index)
                try:
                    actual = os.stat(shard).st_size
                except OSError as exc:
                    raise CacheCorruptError(
                        f"{shard}: a shard of view {self.path} vanished ({exc.strerror or exc}); "
                        "restore it (speccache precompute --resume on its cache) or re-create the view"
                    ) from None
                if actual != size:
                    raise CacheCorruptError(
                        f"{shard}: a shard of view {self.path} changed: {actual} bytes, the view records {size}; "
                        "restore it or re-create the view"
                    )


def source_record(
    view_dir: str, cache_dir: str, manifest: Manifest, shards: Sequence[int], weight: float
) -> SourceRecord:
    """The record of ``cache_dir`` as a source of a view made in ``view_dir`` (from its sealed manifest)."""
    table: Mapping[int, Any] = manifest.shards
    return SourceRecord(
        # between real paths: a path with ".." through a symlink means another directory to the kernel
        os.path.relpath(os.path.realpath(cache_dir), os.path.realpath(view_dir)),
        file_checksum(manifest_path(cache_dir)),
        {i: (table[i].bytes, table[i].checksum) for i in sorted(set(shards))},
        weight,
    )
