"""speccache: an offline cache of a frozen target model's features for training speculative-decoding drafts.

The format is in :mod:`speccache.format` (and docs/format.md), writing in
:mod:`speccache.write` and :mod:`speccache.cache_writer`, reading in
:mod:`speccache.read`; :mod:`speccache.offline_cache` is the drop-in for NeMo
AutoModel's offline-cache module, whose public names are also exported here.
"""

__version__ = "0.1.0"

from speccache.errors import *  # noqa: E402,F401,F403
from speccache.format import FORMAT_VERSION, KeySpec  # noqa: E402,F401
from speccache.offline_cache import (  # noqa: E402,F401
    MANIFEST_NAME,
    SHARD_RE,
    CachedTensorDataset,
    atomic_write,
    build_cached_dataloader,
    collate_cached,
    dataloader_from_sample,
    ensure_supervision_options_match,
    existing_shard_indices,
    load_safetensors,
    manifest_path,
    partition_cache_shards,
    read_manifest,
    resume_start_sample,
    shard_path,
    validate_contiguous_shards,
    write_cache_shards,
    write_cache_shards_distributed,
    write_manifest,
    write_tensor_shard,
)
from speccache.read import CacheDataset, PackCollator, PadCollator  # noqa: E402,F401
