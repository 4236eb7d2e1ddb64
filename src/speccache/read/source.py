"""A cache or a view, opened for whatever reads it: the one place where the two are told apart.

Readers that need more than samples (a method's configuration before its
dataset is built, a side file, the shard size a sampler groups by, a view's
mixture weights) ask :func:`open_source`, which opens either kind of directory
and answers alike. A view's sources share the kind of cache, the schema, the
settings other than their data and their side files (``speccache merge``
refuses caches that differ), so what one of them records holds for all; the
side files are checked again here, by the checksums their manifests record,
because a ``view.json`` need not come from ``merge``, and one source's head
must never be paired with another's features. The datasets
themselves resolve here too: :func:`open_dataset` opens a view as a
:class:`speccache.read.view.ViewDataset`, and a cache read while it is written as a
:class:`speccache.read.follow.FollowDataset`; ``CacheDataset(path)`` (and every subclass)
asks it for both, so the old spelling opens the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Sampler

from speccache.errors import CacheFormatError
from speccache.format import Manifest, Schema
from speccache.format.view import View, is_view
from speccache.read.dataset import _OPENER, CacheDataset
from speccache.read.follow import Follow, FollowDataset
from speccache.read.sampler import default_sampler
from speccache.read.view import ViewDataset

__all__ = ["CacheSource", "open_dataset", "open_source", "reader_sampler"]


@dataclass(frozen=True)
class CacheSource:
    """A cache directory or a view, as its readers see it.

    Attributes:
        path: the directory given.
        dirs: the cache directories read: the cache itself, or a view's sources in order.
        manifests: their manifests, in the same order.
        view: the parsed view, or ``None`` for a cache.
    """

    path: str
    dirs: tuple[str, ...]
    manifests: tuple[Manifest, ...]
    view: View | None = None

    @property
    def manifest(self) -> Manifest:
        """The first cache's manifest: its kind, schema, settings and side files are every source's."""
        return self.manifests[0]

    @property
    def cache_name(self) -> str:
        """The kind of cache."""
        return self.manifest.cache_name

    @property
    def schema(self) -> Schema:
        """The key schema."""
        return self.manifest.schema

    @property
    def config(self) -> dict[str, Any]:
        """The producer's configuration (for a view, its first source's: the sources differ only in their data)."""
        return self.manifest.config

    @property
    def shard_size(self) -> int:
        """Samples per shard of the (first) cache: the run length a locality sampler groups by."""
        return self.manifest.shard_size

    @property
    def num_samples(self) -> int:
        """Samples a reader yields: the cache's, or those the view selects."""
        return self.view.num_samples if self.view is not None else self.manifest.num_samples

    def side_file(self, name: str) -> str:
        """The path of side file ``name`` (for a view, its first source's, which every source's equals).

        Raises:
            CacheFormatError: a cache that records no such side file, or sources of a view whose side files
                differ (they were not written from one target).
        """
        for where, manifest in zip(self.dirs, self.manifests):
            if name not in manifest.side_files:
                recorded = sorted(manifest.side_files) or "none"
                raise CacheFormatError(
                    f"{where}: the cache records no side file {name} (it records {recorded}); read a cache of "
                    "the method that writes it, or re-run its precompute"
                )
        checksums = {m.side_files[name].checksum for m in self.manifests}
        if len(checksums) > 1:
            raise CacheFormatError(
                f"{self.path}: the sources of this view hold different side files {name} (checksums "
                f"{', '.join(m.side_files[name].checksum for m in self.manifests)}), so their features come from "
                "different targets or draft vocabularies; re-create the view from caches of one target"
            )
        return os.path.join(self.dirs[0], name)


def open_source(path: str, cache_name: str | None = None) -> CacheSource:
    """Open the cache or view at ``path`` (a view's sources are checked as :meth:`View.read` checks them).

    Args:
        path: a cache directory or a view directory (``speccache merge``/``subset``).
        cache_name: the kind of cache the caller reads (``None``: any).

    Raises:
        FileNotFoundError: neither a manifest nor a view file at ``path``.
        CacheFormatError: a malformed manifest or view, or another kind of cache than ``cache_name``.
        CacheCorruptError: a source of the view changed or vanished.
    """
    if not is_view(path):
        return CacheSource(path, (path,), (Manifest.read(path, cache_name),))
    view = View.read(path)
    if cache_name is not None and view.cache_name != cache_name:
        raise CacheFormatError(
            f"view at {path} selects samples of {view.cache_name!r} caches, not {cache_name!r}. "
            f"Point the reader at a view of {cache_name} caches or read it as {view.cache_name!r}."
        )
    dirs = tuple(view.source_dir(i) for i in range(len(view.sources)))
    return CacheSource(path, dirs, tuple(Manifest.read(d, view.cache_name) for d in dirs), view)


def open_dataset(
    path: str,
    *args: Any,
    dataset_cls: type[CacheDataset] = CacheDataset,
    follow: Follow | bool = False,
    **kwargs: Any,
) -> CacheDataset | ViewDataset | FollowDataset:
    """The reader of the cache or view at ``path``: ``dataset_cls`` itself for a cache, a
    :class:`speccache.read.view.ViewDataset` whose sources ``dataset_cls`` reads for a view, and with ``follow`` a
    :class:`speccache.read.follow.FollowDataset` of ``dataset_cls``'s samples.

    ``dataset_cls(path, ...)`` opens the same (its ``__new__`` asks this function), though what it returns for a
    view or a follower is then no ``dataset_cls``; this function's return type says so.

    Args:
        path: a cache directory, or a view directory (``speccache merge``/``subset``).
        *args: passed to the reader after the directory (``keys``, or a layer reader's ``fields``).
        dataset_cls: the reader of the cache, or of each of a view's sources (``CacheDataset`` or a subclass).
        follow: read the cache while it is written (``True`` or :class:`speccache.read.follow.Follow` settings).
        **kwargs: passed to the reader (``verify``, ``max_open_shards``...).

    Raises:
        CacheFormatError: ``follow`` on a view; what the reader raises.
    """
    if follow is not False:
        if is_view(path):
            raise CacheFormatError(
                f"{path} is a view, which selects samples of sealed caches: follow the cache being "
                "written itself, or read the view once its sources are sealed"
            )
        return FollowDataset(dataset_cls, path, *args, follow=follow, **kwargs)
    if is_view(path):
        return ViewDataset(path, *args, dataset_cls=dataset_cls, **kwargs)
    return dataset_cls(path, *args, **kwargs)


_OPENER[:] = [open_dataset]


def reader_sampler(
    dataset: CacheDataset | ViewDataset, *, shuffle: bool, distributed: bool, seed: int = 0
) -> Sampler[int] | None:
    """:func:`speccache.read.default_sampler` for a cache reader or a view: its shard size, its ``prefetch`` hook,
    and a view's ``--weights`` (when any differs from 1).

    Raises:
        RuntimeError: ``distributed`` without an initialised process group.
    """
    weights = dataset.sample_weights() if isinstance(dataset, ViewDataset) else None
    return default_sampler(
        dataset,
        dataset.shard_size,
        shuffle=shuffle,
        distributed=distributed,
        seed=seed,
        prefetch=dataset.prefetch,
        weights=weights if weights is not None and any(w != 1.0 for w in weights) else None,
    )
