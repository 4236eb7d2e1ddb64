"""Reading caches: the lazy dataset, the collators, the locality sampler, verification and inspection."""

from speccache.read.collate import PackCollator, PadCollator
from speccache.read.dataset import CacheDataset, Sample, SampleView
from speccache.read.sampler import LocalityShuffleSampler, default_sampler, distributed_position
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
    "verify_cache",
]
