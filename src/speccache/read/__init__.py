"""Reading caches: the lazy dataset, the collators, the locality sampler, verification and inspection."""

from speccache.dist import distributed_position
from speccache.read._shard import Sample, SampleView
from speccache.read.collate import PackCollator, PadCollator
from speccache.read.dataset import CacheDataset
from speccache.read.sampler import LocalityShuffleSampler, default_sampler
from speccache.read.source import open_dataset
from speccache.read.verify import Problem, VerifyReport, inspect_cache, verify_cache

__all__ = [
    "CacheDataset",
    "LocalityShuffleSampler",
    "PackCollator",
    "PadCollator",
    "Problem",
    "Sample",
    "SampleView",
    "VerifyReport",
    "default_sampler",
    "distributed_position",
    "inspect_cache",
    "open_dataset",
    "verify_cache",
]
