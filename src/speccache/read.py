"""Reading caches: a lazy map-style dataset and the collators that batch its samples.

:class:`CacheDataset` reads the manifest and lists the directory once; shards
are opened (one ``mmap`` each) on first use in each process, kept in an LRU of
``max_open_shards``, and never pickled, so DataLoader workers of any start
method each open their own. ``__getitems__`` (used by the DataLoader for a whole
batch) returns zero-copy views grouped by shard; the collators then copy each
byte once into the batch tensors.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Collection, Iterable, Mapping, Sequence

import torch
from torch.utils.data import Dataset, get_worker_info

from speccache.errors import CacheCorruptError, CacheFormatError, CacheIncompleteError
from speccache.format import (
    FORMAT_VERSION,
    SHARD_META_CHECKSUMS,
    Schema,
    check_cache_name,
    ShardFile,
    existing_shard_indices,
    file_checksum,
    num_shards,
    read_manifest,
    schema_from_json,
    shard_path,
    validate_contiguous_shards,
)
from speccache.shard import NativeShard, verify_tensor_checksums

Sample = dict[str, torch.Tensor]

__all__ = ["CacheDataset", "PadCollator", "PackCollator", "Sample"]


class _SeedShard:
    """A shard of the seed layout (fixed keys stacked ``[n, ...]``), read with the native interface."""

    def __init__(self, path: str, keys: Sequence[str], num_samples: int, verify: bool) -> None:
        self.file = ShardFile(path)
        if verify and SHARD_META_CHECKSUMS in self.file.metadata:
            verify_tensor_checksums(self.file)
        self.path = path
        self.num_samples = num_samples
        self.row_offsets = list(range(num_samples + 1))
        for key in keys:
            if key not in self.file.entries:
                raise CacheFormatError(
                    f"{path}: has no tensor {key!r} (it holds {sorted(self.file.keys())}). "
                    "Re-run the producer that wrote this cache, or read the keys it has."
                )
            rows = self.file.entries[key][1][:1]
            if rows != (num_samples,):
                raise CacheFormatError(f"{path}: tensor {key!r} holds {rows[0] if rows else 0} samples, expected {num_samples}")

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.file.tensor(name)[start:end]


class CacheDataset(Dataset):
    """A cache directory as a map-style dataset of per-sample tensor dicts.

    Fixed keys come back with their per-sample shape, ragged keys at each
    sample's true length ``[T, *shape]``.

    Args:
        cache_dir: the cache directory.
        keys: keys to read (default: every key of the schema; required for a seed-layout cache).
        cache_name: kind of cache expected; default: whatever the manifest says.
        format_version: version the caller reads (native caches: :data:`speccache.format.FORMAT_VERSION`).
        verify: check each shard's checksum the first time this process opens it.
        max_open_shards: LRU bound on open shards per process.
        allow_incomplete: read the whole shards of an unsealed cache (the contiguous prefix).

    Raises:
        FileNotFoundError: no manifest.
        CacheFormatError: wrong version or cache name, malformed manifest, missing or extra shards.
        CacheIncompleteError: the cache is not sealed and ``allow_incomplete`` is off.
    """

    def __init__(
        self,
        cache_dir: str,
        keys: Sequence[str] | None = None,
        *,
        cache_name: str | None = None,
        format_version: int = FORMAT_VERSION,
        verify: bool = False,
        max_open_shards: int = 64,
        allow_incomplete: bool = False,
    ) -> None:
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.cache_dir = cache_dir
        probe_name = cache_name if cache_name is not None else _manifest_cache_name(cache_dir)
        self.cache_name = probe_name
        self.manifest = read_manifest(cache_dir, cache_name=probe_name, format_version=format_version)
        try:
            self.shard_size = int(self.manifest["shard_size"])
            self.num_samples = int(self.manifest["num_samples"])
        except (KeyError, TypeError, ValueError):
            raise CacheFormatError(f"{cache_dir}/manifest.json: needs integer 'shard_size' and 'num_samples'") from None
        if self.shard_size < 1 or self.num_samples < 0:
            raise CacheFormatError(f"{cache_dir}/manifest.json: shard_size must be >= 1 and num_samples >= 0")
        self.native = "keys" in self.manifest
        if self.native:
            check_cache_name(self.manifest, cache_dir, probe_name)
        self.verify = verify
        self.max_open_shards = max_open_shards
        if self.native:
            schema = schema_from_json(self.manifest["keys"], f"{cache_dir}/manifest.json")
            keys = list(schema) if keys is None else list(keys)
            unknown = [k for k in keys if k not in schema]
            if unknown:
                raise CacheFormatError(f"{cache_dir}: keys {unknown} are not in the cache; it holds {sorted(schema)}")
            self.schema: Schema = {k: schema[k] for k in keys}
            self._shard_schema: Schema = schema  # shards hold every key; only self.keys are read
        elif keys is None:
            raise ValueError(f"{cache_dir}: a cache without a key schema needs the keys to read (disk_keys)")
        else:
            self.schema = {}
            self._shard_schema = {}
        self.keys: tuple[str, ...] = tuple(keys)
        self._checksums = {int(r["index"]): r.get("xxh3_128") for r in self.manifest.get("shards", []) if isinstance(r, dict)}
        if self.native and not self.manifest.get("complete", False):
            if not allow_incomplete:
                raise CacheIncompleteError(
                    f"cache at {cache_dir} is not complete: it is still being written or its writer was interrupted. "
                    "Finish it by re-running the same precompute command with --resume (or pass allow_incomplete=True "
                    "to read its whole shards)."
                )
            self.num_samples = _complete_prefix(cache_dir, self.num_samples, self.shard_size)
        else:
            validate_contiguous_shards(cache_dir, self.cache_name, self.num_samples, self.shard_size)
        self._open: OrderedDict[int, Any] = OrderedDict()

    @property
    def ragged_keys(self) -> frozenset[str]:
        """Keys whose samples have their own number of rows."""
        return frozenset(k for k, s in self.schema.items() if s.ragged)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def _shard(self, index: int) -> Any:
        shard = self._open.get(index)
        if shard is not None:
            self._open.move_to_end(index)
            return shard
        path = shard_path(self.cache_dir, index)
        expected = min(self.shard_size, self.num_samples - index * self.shard_size)
        if self.verify and self._checksums.get(index) and file_checksum(path) != self._checksums[index]:
            raise CacheCorruptError(
                f"{path}: file checksum differs from the manifest's shard table (damaged shard). "
                "Delete it and re-run the producer with --resume."
            )
        if self.native:
            shard = NativeShard(path, self._shard_schema, index, expected, verify=self.verify and not self._checksums.get(index))
        else:
            shard = _SeedShard(path, self.keys, expected, self.verify)
        self._open[index] = shard
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return shard

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index out of range for a cache of {self.num_samples} samples")
        return divmod(index, self.shard_size)

    def __getitem__(self, index: int) -> Sample:
        """One sample, copied out of the shard."""
        return {k: v.clone() for k, v in self.__getitems__([index])[0].items()}

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """Samples at ``indices`` (in that order) as views into the shards; read-only by contract.

        Each shard's samples are read as one run of rows per key when they lie close together.
        """
        out: list[Sample | None] = [None] * len(indices)
        groups: dict[int, list[tuple[int, int]]] = {}
        for position, index in enumerate(indices):
            shard, local = self._locate(int(index))
            groups.setdefault(shard, []).append((local, position))
        for shard_index, members in groups.items():
            shard = self._shard(shard_index)
            members.sort()
            lo, hi = members[0][0], members[-1][0] + 1
            if hi - lo <= 4 * len(members):
                spans = [(lo, hi, members)]
            else:
                spans = [(local, local + 1, [(local, pos)]) for local, pos in members]
            for a, b, part in spans:
                for local, pos in part:
                    out[pos] = {}
                for key in self.keys:
                    block = shard.rows(key, a, b)
                    ragged = key in self.schema and self.schema[key].ragged
                    offsets = shard.row_offsets
                    base = offsets[a]
                    for local, pos in part:
                        sample = out[pos]
                        assert sample is not None
                        if ragged:
                            sample[key] = block[offsets[local] - base : offsets[local + 1] - base]
                        else:
                            sample[key] = block[local - a]
        return out  # type: ignore[return-value]

    def sample_lengths(self) -> list[int]:
        """Rows of each sample's ragged keys (all 1 when no key is ragged); reads only shard offsets."""
        lengths: list[int] = []
        for index in range(num_shards(self.num_samples, self.shard_size)):
            o = self._shard(index).row_offsets
            lengths.extend(o[i + 1] - o[i] for i in range(len(o) - 1))
        return lengths


def _manifest_cache_name(cache_dir: str) -> str:
    from speccache.format import load_manifest_json, manifest_path

    name = load_manifest_json(manifest_path(cache_dir)).get("cache_name")
    return name if isinstance(name, str) else os.path.basename(os.path.normpath(cache_dir))


def _complete_prefix(cache_dir: str, num_samples: int, shard_size: int) -> int:
    present = existing_shard_indices(cache_dir)
    k = 0
    while k in present:
        k += 1
    return min(k * shard_size, num_samples)


# ---------------------------------------------------------------------------
# collation


def _pin() -> bool:
    # Pinning from a worker process would initialise CUDA there; the DataLoader pins in the main process.
    return torch.cuda.is_available() and get_worker_info() is None


def _stack(tensors: list[torch.Tensor], pin: bool) -> torch.Tensor:
    first = tensors[0]
    out = torch.empty((len(tensors), *first.shape), dtype=first.dtype, pin_memory=pin)
    return torch.stack(tensors, out=out)


class PadCollator:
    """Batches samples by padding ragged keys to the longest sample.

    Output: fixed keys stacked ``[B, *shape]``; ragged keys ``[B, T_max, *shape]``
    padded with ``pad_values[key]`` (default 0); ``lengths`` (int64 ``[B]``) and
    ``attention_mask`` (int64 ``[B, T_max]``, 1 on real rows).

    Args:
        ragged_keys: keys to pad.
        pad_values: per-key pad value.
        pin_memory: allocate the batch in pinned memory (default: when CUDA is available, in the main process).
    """

    def __init__(
        self, ragged_keys: Collection[str], pad_values: Mapping[str, float | int | bool] | None = None, pin_memory: bool | None = None
    ) -> None:
        self.ragged_keys = frozenset(ragged_keys)
        self.pad_values = dict(pad_values or {})
        self.pin_memory = pin_memory

    def __call__(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        pin = _pin() if self.pin_memory is None else self.pin_memory
        batch: dict[str, torch.Tensor] = {}
        lengths: list[int] | None = None
        for key in samples[0]:
            tensors = [s[key] for s in samples]
            if key not in self.ragged_keys:
                batch[key] = _stack(tensors, pin)
                continue
            lengths = [t.shape[0] for t in tensors]
            longest = max(lengths)
            first = tensors[0]
            out = torch.empty((len(tensors), longest, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
            pad = self.pad_values.get(key, 0)
            for row, t in zip(out, tensors):
                row[: t.shape[0]].copy_(t)
                row[t.shape[0] :].fill_(pad)
            batch[key] = out
        if lengths is not None:
            lens = torch.tensor(lengths, dtype=torch.int64)
            batch["lengths"] = lens
            batch["attention_mask"] = (torch.arange(max(lengths)).unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64)
        return batch


class PackCollator:
    """Batches samples by concatenating ragged keys (no padding), for varlen attention.

    Output: ragged keys ``[sum T, *shape]``, ``cu_seqlens`` (int32 ``[B + 1]``),
    ``lengths`` (int64 ``[B]``); fixed keys stacked ``[B, *shape]``.

    Args:
        ragged_keys: keys to concatenate.
        pin_memory: as for :class:`PadCollator`.
    """

    def __init__(self, ragged_keys: Collection[str], pin_memory: bool | None = None) -> None:
        self.ragged_keys = frozenset(ragged_keys)
        self.pin_memory = pin_memory

    def __call__(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        pin = _pin() if self.pin_memory is None else self.pin_memory
        batch: dict[str, torch.Tensor] = {}
        lengths: list[int] | None = None
        for key in samples[0]:
            tensors = [s[key] for s in samples]
            if key not in self.ragged_keys:
                batch[key] = _stack(tensors, pin)
                continue
            lengths = [t.shape[0] for t in tensors]
            first = tensors[0]
            out = torch.empty((sum(lengths), *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
            batch[key] = torch.cat(tensors, out=out)
        if lengths is not None:
            lens = torch.tensor(lengths, dtype=torch.int64)
            batch["lengths"] = lens
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            torch.cumsum(lens, 0, out=cu[1:])
            batch["cu_seqlens"] = cu
        return batch


def iter_samples(dataset: CacheDataset, batch: int = 64) -> Iterable[Sample]:
    """Every sample in order, read a batch at a time (views; copy to keep)."""
    for start in range(0, len(dataset), batch):
        yield from dataset.__getitems__(range(start, min(start + batch, len(dataset))))
