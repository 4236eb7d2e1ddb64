"""Writing caches: the run lifecycle (:class:`CacheWriter`), the loops, the shard writers, the process group."""

from speccache.write.cache_writer import CacheWriter, SideFile, WriteRun
from speccache.write.cap import DiskCap
from speccache.write.dist import (
    Comm,
    DataParallelGroups,
    LocalComm,
    TorchComm,
    data_parallel_groups,
    init_from_env,
    shutdown,
)
from speccache.write.loops import ShardAccumulator, compute_shard_runs, partition_cache_shards
from speccache.write.writers import NativeShardWriter, OverlappedShardWriter

__all__ = [
    "CacheWriter",
    "Comm",
    "DataParallelGroups",
    "DiskCap",
    "LocalComm",
    "NativeShardWriter",
    "OverlappedShardWriter",
    "ShardAccumulator",
    "SideFile",
    "TorchComm",
    "WriteRun",
    "compute_shard_runs",
    "data_parallel_groups",
    "init_from_env",
    "partition_cache_shards",
    "shutdown",
]
