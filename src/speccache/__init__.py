"""speccache: an offline cache of a frozen target model's features for training speculative-decoding drafts.

The public API, by layer (docs/architecture.md draws the layout):

* format: :class:`KeySpec`, :class:`Manifest`, :data:`FORMAT_VERSION`;
* writing: :class:`CacheWriter` (one producer run: lock, resume, overlapped writes, seal), imported on first use, so
  that a reader's ``import speccache`` loads no producer code (``speccache.write``, ``speccache.data``,
  ``speccache.precompute``);
* reading: :class:`CacheDataset`, :class:`PadCollator`, :class:`PackCollator`,
  :class:`LocalityShuffleSampler`, :func:`verify_cache`, :func:`inspect_cache`, :class:`Follow` (settings of a
  reader that trains while the cache is written);
* EAGLE-3: :class:`Eagle3CacheDataset`, :func:`build_eagle3_dataloader`, :class:`TargetHead`;
* the exceptions of :mod:`speccache.errors`.

The NeMo AutoModel-compatible names (``CachedTensorDataset``, ``write_cache_shards``...)
live in :mod:`speccache.offline_cache` only.
"""

from typing import TYPE_CHECKING, Any

from speccache._version import __version__
from speccache.errors import (
    AuditError,
    CacheCorruptError,
    CacheExistsError,
    CacheFormatError,
    CacheIncompleteError,
    CacheLockedError,
    ConfigMismatchError,
    DataError,
    DistributedError,
    FollowTimeoutError,
    NonFiniteFeatureError,
    OutputError,
    ShardWriteError,
    SpeccacheError,
    UsageError,
)
from speccache.format import FORMAT_VERSION, KeySpec, Manifest
from speccache.methods.eagle3 import Eagle3CacheDataset, TargetHead, build_eagle3_dataloader
from speccache.read import CacheDataset, LocalityShuffleSampler, PackCollator, PadCollator, inspect_cache, verify_cache
from speccache.read.follow import Follow

if TYPE_CHECKING:
    from speccache.write import CacheWriter

__all__ = [
    "FORMAT_VERSION",
    "AuditError",
    "CacheCorruptError",
    "CacheDataset",
    "CacheExistsError",
    "CacheFormatError",
    "CacheIncompleteError",
    "CacheLockedError",
    "CacheWriter",
    "ConfigMismatchError",
    "DataError",
    "DistributedError",
    "Eagle3CacheDataset",
    "Follow",
    "FollowTimeoutError",
    "KeySpec",
    "LocalityShuffleSampler",
    "Manifest",
    "NonFiniteFeatureError",
    "OutputError",
    "PackCollator",
    "PadCollator",
    "ShardWriteError",
    "SpeccacheError",
    "TargetHead",
    "UsageError",
    "__version__",
    "build_eagle3_dataloader",
    "inspect_cache",
    "verify_cache",
]


def __getattr__(name: str) -> Any:
    """``CacheWriter``, imported from :mod:`speccache.write` on first use (PEP 562)."""
    if name == "CacheWriter":
        from speccache.write import CacheWriter

        return CacheWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
