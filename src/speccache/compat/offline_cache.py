"""Drop-in replacement for NeMo AutoModel's offline-cache helper module.

Code written against ``nemo_automodel.components.datasets.llm.offline_cache``
runs unchanged after switching its import to ``speccache.offline_cache``: the
same names (its imports included), signatures (keywords and the same positional
order) and fixed-shape behaviour. Like the original, every function here looks
up the helpers it uses in this module's namespace at call time, so tests that
patch ``offline_cache.DataLoader``, ``atomic_write``, ``safe_import_from``... see
their patch take effect. Underneath, writes are durable (unique temp file, fsync,
rename, directory fsync), shards carry per-tensor checksums in their metadata, and
the dataset keeps a bounded number of shards open; it also reads native
speccache caches (ragged keys at their true length).
"""

from __future__ import annotations

# The original module's own imports are part of its namespace; keep them importable from here.
import importlib
import json
import logging
import os  # noqa: F401
import re  # noqa: F401
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from speccache.errors import CacheCorruptError, CacheFormatError
from speccache.format import (
    MANIFEST_NAME,
    SHARD_RE,
    atomic_write,
    ceil_div,
    existing_shard_indices,
    load_manifest_json,
    manifest_path,
    shard_path,
    shard_samples,
    tensor_checksum,
    validate_contiguous_shards,
)
from speccache.format.manifest import manifest_text
from speccache.format.shard import SHARD_META_CHECKSUMS
from speccache.read import CacheDataset, SampleView
from speccache.read._batch import batch_rows, read_into, readable_layout
from speccache.read._shard import open_stacked_file
from speccache.read.collate import BufferPool, batch_tensor
from speccache.write.loops import ShardAccumulator, partition_cache_shards, subset_loader

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

_ShardAccumulator = ShardAccumulator


def safe_import_from(module: str, name: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """``(True, module.name)`` if it imports, else ``(False, None)`` (NeMo's ``import_utils`` helper of that name)."""
    try:
        return True, getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False, None


def load_safetensors(cache_name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return ``(save_file, safe_open)`` from the ``safetensors`` package.

    Raises:
        ImportError: ``safetensors`` is not installed; the message says how to install it.
    """
    has_save, save_file = safe_import_from("safetensors.torch", "save_file")
    has_open, safe_open = safe_import_from("safetensors", "safe_open")
    if not (has_save and has_open):
        raise ImportError(
            f"The {cache_name} offline cache requires the 'safetensors' package. "
            "Install it with `pip install safetensors` and re-run."
        )
    return save_file, safe_open


def write_manifest(cache_dir: str, manifest: dict[str, Any], format_version: int) -> str:
    """Write ``manifest.json`` atomically; ``format_version`` overrides any such key in ``manifest``.

    Returns:
        The manifest path.
    """
    text = manifest_text({**manifest, "format_version": format_version})

    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    return atomic_write(manifest_path(cache_dir), _write)


def read_manifest(
    cache_dir: str,
    cache_name: str,
    format_version: int,
    producer_name: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a manifest and check its version.

    Args:
        cache_dir: the cache directory.
        cache_name: name used in messages.
        format_version: the version the caller reads.
        producer_name: the tool to re-run named in the version message.
        defaults: values for fields a manifest may predate; the manifest's own values win.

    Raises:
        FileNotFoundError: no manifest.
        ValueError: invalid JSON or another version (:class:`speccache.errors.CacheFormatError`).
    """
    manifest = load_manifest_json(manifest_path(cache_dir))
    version = manifest.get("format_version")
    if version != format_version:
        producer = producer_name or f"precompute_{cache_name.lower().replace('-', '')}"
        raise CacheFormatError(
            f"{cache_name} cache at {cache_dir} has format_version={version}, expected {format_version}. "
            f"Regenerate the cache with the current {producer}."
        )
    return {**(defaults or {}), **manifest}


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


def write_tensor_shard(
    cache_dir: str, shard_index: int, samples: dict[str, torch.Tensor], keys: tuple[str, ...], cache_name: str
) -> str:
    """Write one fixed-shape shard holding exactly ``keys``, with each tensor's xxh3-128 in its metadata.

    Returns:
        The shard path.

    Raises:
        ValueError: a key in ``keys`` is missing from ``samples``.
    """
    missing = [key for key in keys if key not in samples]
    if missing:
        raise ValueError(f"write_shard is missing required {cache_name} cache fields: {missing}")
    save_file, _ = load_safetensors(cache_name)
    tensors = {key: samples[key].detach().cpu().contiguous() for key in keys}
    checksums = {key: tensor_checksum(t) for key, t in sorted(tensors.items())}
    metadata = {SHARD_META_CHECKSUMS: json.dumps(checksums, sort_keys=True, separators=(",", ":"))}
    return atomic_write(shard_path(cache_dir, shard_index), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def open_seed_shard(
    cache_dir: str, shard_index: int, keys: Sequence[str], num_samples: int, shard_size: int, cache_name: str
) -> Any:
    """Open seed-layout shard ``shard_index`` with ``safetensors.safe_open``, checked before any read: a whole
    safetensors file holding every key of ``keys`` with the sample count the manifest's counts give the shard.

    Raises:
        CacheCorruptError: the file is truncated or damaged (not a readable safetensors file).
        CacheFormatError: a key is missing, or holds another sample count.
    """
    _, safe_open = load_safetensors(cache_name)
    _, safetensor_error = safe_import_from("safetensors", "SafetensorError")
    path = shard_path(cache_dir, shard_index)
    try:
        handle = safe_open(path, framework="pt")
    except safetensor_error as exc:
        raise CacheCorruptError(
            f"{path}: not a readable safetensors file ({exc}): truncated or damaged. "
            "Restore the shard, or re-run the producer that wrote this cache."
        ) from None
    missing = [key for key in keys if key not in handle.keys()]
    if missing:
        raise CacheFormatError(
            f"{path}: has no tensor {missing[0]!r} (it holds {sorted(handle.keys())}). "
            "Re-run the producer that wrote this cache, or read the keys it has."
        )
    expected = shard_samples(shard_index, num_samples, shard_size)
    for key in keys:
        rows = handle.get_slice(key).get_shape()[:1]
        if rows != [expected]:
            raise CacheFormatError(
                f"{path}: tensor {key!r} holds {rows[0] if rows else 0} samples, expected {expected} "
                "(the manifest's counts). Re-run the producer that wrote this cache."
            )
    return handle


class CachedTensorDataset(Dataset):
    """Lazily read fixed-key safetensors shards by sample index (the original's dataset).

    At most :attr:`max_open_shards` shard handles stay open. Samples are read from
    the shard files into tensors of their own: ``ds[i]`` is a plain dict of them,
    and a batched DataLoader gets :class:`speccache.read.SampleView` samples, which
    :func:`collate_cached` reads straight into the batch. A native speccache cache
    (a manifest with a key schema) is read through :class:`speccache.read.CacheDataset`,
    ragged keys at each sample's length.

    Args:
        cache_dir: the cache directory.
        cache_name: name used in messages.
        format_version: the manifest version expected.
        disk_keys: keys each sample returns.
        verify: check a native cache's tensors against their checksums before their first read, as
            :class:`speccache.read.CacheDataset` does by default; off here, as NeMo's reader checks none.
    """

    max_open_shards = 64

    def __init__(
        self, cache_dir: str, cache_name: str, format_version: int, disk_keys: tuple[str, ...], *, verify: bool = False
    ) -> None:
        self.cache_dir = cache_dir
        self.cache_name = cache_name
        self.manifest = read_manifest(cache_dir, cache_name=cache_name, format_version=format_version)
        self.shard_size = int(self.manifest["shard_size"])
        self.num_samples = int(self.manifest["num_samples"])
        self._disk_keys = tuple(disk_keys)
        self._native = (
            CacheDataset(cache_dir, list(disk_keys), cache_name=cache_name, verify=verify)
            if "keys" in self.manifest
            else None
        )
        self._shard_indices = validate_contiguous_shards(cache_dir, cache_name, self.num_samples, self.shard_size)
        self._open_handles: OrderedDict[int, _ShardHandle] = OrderedDict()

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open_handles"] = OrderedDict()  # a worker opens its own
        return state

    def _handle(self, shard_index: int) -> _ShardHandle:
        """Shard ``shard_index`` as a ``safetensors.safe_open`` handle whose tensors are the caller's own copies
        (opened on first use, LRU-bounded)."""
        handle = self._open_handles.get(shard_index)
        if handle is None:
            opened = open_seed_shard(
                self.cache_dir, shard_index, self._disk_keys, self.num_samples, self.shard_size, self.cache_name
            )
            path = shard_path(self.cache_dir, shard_index)
            expected = shard_samples(shard_index, self.num_samples, self.shard_size)
            samples = open_stacked_file(path, self._disk_keys, expected)
            handle = self._open_handles[shard_index] = _ShardHandle(opened, samples)
            if len(self._open_handles) > self.max_open_shards:
                self._open_handles.popitem(last=False)
        else:
            self._open_handles.move_to_end(shard_index)
        return handle

    def _sample(self, index: int) -> SampleView:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        return SampleView(self._handle(index // self.shard_size).samples, index % self.shard_size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._native is not None:
            return self._native[index]
        return dict(self._sample(index))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """``[self[i] for i in indices]``: a subclass's ``__getitem__`` decides what batched loaders get; this class's
        own samples come as :class:`speccache.read.SampleView` (read when accessed or collated)."""
        if self._native is not None or type(self).__getitem__ is not CachedTensorDataset.__getitem__:
            return [self[i] for i in indices]
        return [self._sample(i) for i in indices]


class _ShardHandle:
    """A ``safe_open`` handle whose tensors never alias the handle's mapping (later reads see the file, not edits),
    read only while the file is as long as when it was opened; ``samples`` reads the same file for the dataset."""

    def __init__(self, handle: Any, samples: Any) -> None:
        self._handle = handle
        self.samples = samples

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def metadata(self) -> dict[str, str]:
        return dict(self._handle.metadata() or {})

    def get_tensor(self, name: str) -> torch.Tensor:
        self.samples.check_size()
        return self._handle.get_tensor(name).clone()

    def get_slice(self, name: str) -> _TensorSlice:
        return _TensorSlice(self._handle.get_slice(name), self.samples)


class _TensorSlice:
    """``handle.get_slice(name)``: index it to read part of a tensor (a copy)."""

    def __init__(self, sliced: Any, samples: Any) -> None:
        self._slice = sliced
        self._samples = samples

    def __getitem__(self, index: Any) -> torch.Tensor:
        self._samples.check_size()
        return self._slice[index].clone()

    def get_shape(self) -> list[int]:
        return list(self._slice.get_shape())


_BATCH_MEMORY = BufferPool()
"""Memory of earlier batches that nothing references any more, reused by :func:`collate_cached` (fresh memory
costs a page fault per 4 KiB, about as much as reading the data into it)."""


def collate_cached(features: list[dict[str, torch.Tensor]], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Stack per-sample cache dicts into a batch (the keys of :class:`CachedTensorDataset`'s samples read straight
    from the shard files into it)."""
    rows = batch_rows(features)
    batch = {}
    for key in keys:
        layout = readable_layout(features, rows, key, ragged=False)
        if layout is None:
            batch[key] = torch.stack([feature[key] for feature in features], dim=0)
        else:
            assert rows is not None  # readable_layout finds a layout only in a batch read from shards
            shape = (len(features), *layout.shape)
            batch[key] = out = batch_tensor(shape, layout.dtype, pin=False, pool=_BATCH_MEMORY)
            read_into(out, rows, key, layout, range(0, len(features) * layout.row_bytes, layout.row_bytes))
    return batch


def build_cached_dataloader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    collate_fn: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    num_workers: int = 0,
    distributed: bool = False,
) -> DataLoader:
    """A DataLoader over a cache dataset (``DistributedSampler`` when ``distributed``; never drops the last batch)."""
    sampler: DistributedSampler | None = DistributedSampler(dataset, shuffle=shuffle) if distributed else None
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


def resume_start_sample(existing_shards: set[int], shard_size: int) -> int:
    """Sample index where a sequential resume starts: ``len(existing) * shard_size``.

    Raises:
        ValueError: ``existing_shards`` is not exactly ``{0, ..., k-1}``.
    """
    expected = set(range(len(existing_shards)))
    if set(existing_shards) != expected:
        raise ValueError(
            f"--resume expects existing shards to be a contiguous prefix {sorted(expected)}, "
            f"but found {sorted(existing_shards)}. Delete stale shards or restart from a clean directory."
        )
    return len(existing_shards) * shard_size


def _sequential_subset_loader(dataloader: DataLoader, start: int, end: int) -> DataLoader:
    """A sequential loader over ``dataset[start:end)`` with ``dataloader``'s batching and worker settings."""
    return subset_loader(dataloader, start, end, DataLoader, Subset)


def dataloader_from_sample(dataloader: DataLoader, start_sample: int) -> DataLoader:
    """A sequential loader equivalent to ``dataloader`` from ``start_sample`` on.

    Returns ``dataloader`` itself when ``start_sample <= 0`` and an empty loader
    (no worker processes) past the end. Samples before ``start_sample`` are never read.
    """
    if start_sample <= 0:
        return dataloader
    end = len(dataloader.dataset)  # type: ignore[arg-type]
    if start_sample >= end:
        return DataLoader(
            Subset(dataloader.dataset, range(0)),
            batch_size=getattr(dataloader, "batch_size", None) or 1,
            shuffle=False,
            num_workers=0,
            collate_fn=getattr(dataloader, "collate_fn", None),
            drop_last=False,
        )
    return _sequential_subset_loader(dataloader, start_sample, end)


def write_cache_shards(
    dataloader: Any,
    output_dir: str,
    shard_size: int,
    start_shard_index: int,
    compute_batch: Callable[[Any], dict[str, torch.Tensor]],
    write_shard_fn: Callable[[str, int, dict[str, torch.Tensor]], str],
    logger: logging.Logger,
    ragged_keys: tuple[str, ...] = (),
) -> None:
    """Compute every batch of ``dataloader`` and write sequential shards from ``start_shard_index``."""
    accumulator = _ShardAccumulator(output_dir, shard_size, start_shard_index, write_shard_fn, logger, ragged_keys)
    for batch in dataloader:
        accumulator.add(compute_batch(batch))
    accumulator.finalize()


def write_cache_shards_distributed(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    world_size: int,
    rank: int,
    compute_batch: Callable[[Any], dict[str, torch.Tensor]],
    write_shard_fn: Callable[[str, int, dict[str, torch.Tensor]], str],
    logger: logging.Logger,
    sync_max_steps: Callable[[int], int] | None = None,
    ragged_keys: tuple[str, ...] = (),
) -> None:
    """Distributed precompute: this rank writes its contiguous shard block in lockstep with the others.

    ``compute_batch`` may be a collective (a target sharded across ranks), so every
    rank calls it ``sync_max_steps(local_steps)`` times; ranks with fewer batches
    pad with a one-sample dummy batch (read only if needed) whose output is
    discarded. With ``world_size == 1`` this writes what :func:`write_cache_shards` writes.
    """
    dataset = dataloader.dataset
    collate_fn = getattr(dataloader, "collate_fn", None)
    batch_size = int(getattr(dataloader, "batch_size", None) or 1)
    start_shard, start_sample, local = partition_cache_shards(len(dataset), shard_size, world_size, rank)  # type: ignore[arg-type]
    local_steps = ceil_div(local, batch_size)
    global_steps = local_steps if sync_max_steps is None else sync_max_steps(local_steps)
    logger.info(
        "Rank %d/%d: samples [%d, %d) -> shards from %d (%d/%d steps)",
        rank,
        world_size,
        start_sample,
        start_sample + local,
        start_shard,
        local_steps,
        global_steps,
    )
    batches = iter(_sequential_subset_loader(dataloader, start_sample, start_sample + local)) if local else iter(())
    accumulator = _ShardAccumulator(output_dir, shard_size, start_shard, write_shard_fn, logger, ragged_keys)
    dummy = None
    for _ in range(global_steps):
        batch = next(batches, None)
        if batch is None and dummy is None:
            dummy = collate_fn([dataset[0]]) if collate_fn is not None else dataset[0]
        out = compute_batch(batch if batch is not None else dummy)
        if batch is not None:
            accumulator.add(out)
    accumulator.finalize()
