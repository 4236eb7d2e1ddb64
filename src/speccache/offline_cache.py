"""Drop-in replacement for NeMo AutoModel's offline-cache helper module.

Code written against ``nemo_automodel.components.datasets.llm.offline_cache``
runs unchanged after switching its import to ``speccache.offline_cache``: the
same names, signatures (keywords and the same positional order), and the same
fixed-shape behaviour. Underneath, writes are durable (unique temp file, fsync,
rename, directory fsync), shards carry checksums in their metadata, and the
dataset is the lazy, LRU-bounded :class:`speccache.read.CacheDataset`, which
also reads native speccache caches (ragged keys at their true length).
"""

from __future__ import annotations

# The seed module's own imports are part of its namespace; keep them importable from here.
import json  # noqa: F401
import logging  # noqa: F401
import os  # noqa: F401
import re  # noqa: F401
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, Subset  # noqa: F401
from torch.utils.data.distributed import DistributedSampler

from speccache.format import (
    MANIFEST_NAME,
    SHARD_RE,
    ShardFile,
    atomic_write,
    existing_shard_indices,
    manifest_path,
    num_shards,
    read_manifest,
    shard_path,
    validate_contiguous_shards,
    write_manifest,
)
from speccache.read import CacheDataset
from speccache.write import (
    _sequential_subset_loader,
    _ShardAccumulator,
    dataloader_from_sample,
    partition_cache_shards,
    resume_start_sample,
    write_cache_shards,
    write_cache_shards_distributed,
    write_tensor_shard,
)

__all__ = [
    "MANIFEST_NAME",
    "SHARD_RE",
    "load_safetensors",
    "atomic_write",
    "shard_path",
    "manifest_path",
    "existing_shard_indices",
    "write_manifest",
    "read_manifest",
    "ensure_supervision_options_match",
    "validate_contiguous_shards",
    "write_tensor_shard",
    "CachedTensorDataset",
    "collate_cached",
    "build_cached_dataloader",
    "resume_start_sample",
    "_sequential_subset_loader",
    "dataloader_from_sample",
    "_ShardAccumulator",
    "write_cache_shards",
    "partition_cache_shards",
    "write_cache_shards_distributed",
]


def load_safetensors(cache_name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return ``(save_file, safe_open)`` from the ``safetensors`` package.

    Raises:
        ImportError: ``safetensors`` is not installed; the message says how to install it.
    """
    try:
        from safetensors import safe_open
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError(
            f"The {cache_name} offline cache requires the 'safetensors' package ({exc}). "
            "Install it with `pip install safetensors` and re-run."
        ) from None
    return save_file, safe_open


def ensure_supervision_options_match(
    manifest: dict[str, Any], expected: dict[str, bool], cache_name: str, cache_dir: str, producer_name: str
) -> None:
    """Refuse a cache whose supervision was built under other dataset options than the run's.

    Args:
        manifest: the cache manifest.
        expected: option name -> the run's value.

    Raises:
        ValueError: the manifest lacks an option or records another value; names each one.
    """
    missing = [k for k in expected if k not in manifest]
    if missing:
        raise ValueError(
            f"{cache_name} cache at {cache_dir} does not record {', '.join(missing)}, so the options its loss "
            f"masks were built with cannot be verified. Rebuild the cache with the current {producer_name}."
        )
    mismatched = {k: bool(manifest[k]) for k, v in expected.items() if bool(manifest[k]) != bool(v)}
    if mismatched:
        recorded = ", ".join(f"{k}={v}" for k, v in mismatched.items())
        configured = ", ".join(f"{k}={bool(expected[k])}" for k in mismatched)
        raise ValueError(
            f"{cache_name} cache at {cache_dir} was built with {recorded}, but the run sets {configured}. "
            f"The cached loss masks are used as stored, so rebuild the cache with {producer_name} under the "
            "run's settings or match them in the run."
        )


class CachedTensorDataset(CacheDataset):
    """Lazily read fixed-key safetensors shards by sample index (the seed's dataset).

    Args:
        cache_dir: the cache directory.
        cache_name: name used in messages.
        format_version: the manifest version expected.
        disk_keys: keys each sample returns.
    """

    def __init__(self, cache_dir: str, cache_name: str, format_version: int, disk_keys: tuple[str, ...]) -> None:
        super().__init__(cache_dir, keys=tuple(disk_keys), cache_name=cache_name, format_version=format_version)
        # The seed's attributes, which its subclasses (e.g. the EAGLE-3 reader) build on.
        self._disk_keys = tuple(disk_keys)
        self._shard_indices = list(range(num_shards(self.num_samples, self.shard_size)))

    def _handle(self, shard_index: int) -> "_ShardHandle":
        """The open shard ``shard_index`` with the read interface of a ``safetensors.safe_open`` handle (the seed's)."""
        return _ShardHandle(self._shard(shard_index).file)


class _ShardHandle:
    """What seed subclasses use of a ``safe_open`` handle; every tensor returned is a copy the caller owns."""

    def __init__(self, file: ShardFile) -> None:
        self._file = file

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def metadata(self) -> dict[str, str]:
        return dict(self._file.metadata)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._file.tensor(name).clone()

    def get_slice(self, name: str) -> "_TensorSlice":
        return _TensorSlice(self._file.tensor(name))


class _TensorSlice:
    """``handle.get_slice(name)``: index it to read part of a tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._tensor[index].clone()

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)


def collate_cached(features: list[dict[str, torch.Tensor]], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Stack per-sample cache dicts into a batch."""
    return {key: torch.stack([feature[key] for feature in features], dim=0) for key in keys}


def build_cached_dataloader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    collate_fn: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    num_workers: int = 0,
    distributed: bool = False,
) -> DataLoader:
    """A DataLoader over a cache dataset (``DistributedSampler`` when ``distributed``; never drops the last batch)."""
    sampler = DistributedSampler(dataset, shuffle=shuffle) if distributed else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=shuffle and sampler is None,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate_fn,
        drop_last=False,
    )
