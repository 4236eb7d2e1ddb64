"""speccache: an offline cache of a frozen target model's features for training speculative-decoding drafts.

The public API, by layer (docs/architecture.md draws the layout):

* format: :class:`KeySpec`, :class:`Manifest`, :data:`FORMAT_VERSION`;
* writing: :class:`CacheWriter` (one producer run: lock, resume, overlapped writes, seal);
* reading: :class:`CacheDataset`, :class:`PadCollator`, :class:`PackCollator`,
  :class:`LocalityShuffleSampler`, :func:`verify_cache`, :func:`inspect_cache`;
* EAGLE-3: :class:`Eagle3CacheDataset`, :func:`build_eagle3_dataloader`, :class:`TargetHead`;
* the exceptions of :mod:`speccache.errors`.

The NeMo AutoModel-compatible names (``CachedTensorDataset``, ``write_cache_shards``...)
live in :mod:`speccache.offline_cache` only.
"""

from speccache._version import __version__
from speccache.errors import (
    CacheCorruptError,
    CacheExistsError,
    CacheFormatError,
    CacheIncompleteError,
    CacheLockedError,
    ConfigMismatchError,
    DataError,
    DistributedError,
    ShardWriteError,
    SpeccacheError,
)
from speccache.format import FORMAT_VERSION, KeySpec, Manifest
from speccache.methods.eagle3 import Eagle3CacheDataset, TargetHead, build_eagle3_dataloader
from speccache.read import CacheDataset, LocalityShuffleSampler, PackCollator, PadCollator, inspect_cache, verify_cache
from speccache.write import CacheWriter

__all__ = [
    "FORMAT_VERSION",
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
    "KeySpec",
    "LocalityShuffleSampler",
    "Manifest",
    "PackCollator",
    "PadCollator",
    "ShardWriteError",
    "SpeccacheError",
    "TargetHead",
    "__version__",
    "build_eagle3_dataloader",
    "inspect_cache",
    "verify_cache",
]
