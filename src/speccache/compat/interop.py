"""SpecForge's and speculators' offline layouts, written from a speccache cache and read back into one.

Both peers store one file per sample and read them with their own trainers:

* ``specforge`` (SpecForge 0.2.0, ``specforge/runtime/data_plane/offline_reader.py`` and
  ``feature_store.load_feature_file``): a tree of ``*.ckpt`` files read in sorted path order, each a
  ``torch.save`` dict of one sample: ``input_ids`` int64 ``[S]``, ``loss_mask`` int64 ``[S]``,
  ``aux_hidden_state`` ``[1, S, 3H]`` (the aux decoder layers before the final norm) and ``hidden_state``
  ``[1, S, H]`` (the final-norm output, the LM-head input); ``vocab_mapping.pt`` (``d2t``/``t2d``) beside them
  when the draft vocabulary is smaller than the target's.
* ``speculators`` (speculators 0.9.0, ``speculators/train/data.py`` ``ArrowDataset``): an Arrow
  ``save_to_disk`` directory (``input_ids``, ``loss_mask``, ``seq_len``; torch format), ``token_freq.pt`` (the
  supervised tokens' counts) and ``hidden_states/hs_{row}.safetensors`` holding ``hidden_states``
  ``[T, K + 1, H]`` (the K aux layers, then the last decoder layer before the final norm) and ``token_ids``
  int64 ``[T]``.

Export streams one speccache shard at a time, prints the size first, writes every file atomically and
refuses a non-empty output directory. docs/interop.md has the tables and the measured sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speccache.errors import CacheExistsError, CacheFormatError
from speccache.format import Manifest, ShardFile, atomic_write, write_safetensors
from speccache.methods import eagle3, layers
from speccache.read import CacheDataset
from speccache.units import human_bytes

__all__ = ["LAYOUTS", "export_peer", "specforge_path", "speculators_hs_path"]

SPECFORGE = "specforge"
SPECULATORS = "speculators"
LAYOUTS = (SPECFORGE, SPECULATORS)
FILES_PER_DIR = 5000
"""SpecForge's hidden-state preparation groups its files in folders of this many rows."""
VOCAB_MAPPING = "vocab_mapping.pt"
TOKEN_FREQ = "token_freq.pt"
HS_DIR = "hidden_states"


def specforge_path(out: str, index: int) -> str:
    """Sample ``index``'s file: zero-padded names, so SpecForge's sorted path order is the cache's sample order."""
    first = index - index % FILES_PER_DIR
    return os.path.join(out, f"rows_{first:08d}-{first + FILES_PER_DIR:08d}", f"data_{index:08d}.ckpt")


def speculators_hs_path(out: str, index: int) -> str:
    """Row ``index``'s hidden-state file, named as speculators' ``FileTransfer`` looks it up."""
    return os.path.join(out, HS_DIR, f"hs_{index}.safetensors")


@dataclass
class _Export:
    """What an export reads (``dataset``), turns each sample into (``sample_files``: path -> tensors, written by
    ``write``) and writes once at the end (``finish``)."""

    dataset: CacheDataset
    sample_files: Callable[[str, int, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]
    write: Callable[[str, dict[str, torch.Tensor]], Any]
    finish: Callable[[str, list[torch.Tensor], list[torch.Tensor]], None]  # out, every sample's ids and mask


def _torch_save(path: str, obj: Any) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _own(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes a tensor's whole storage: a sample that views a larger buffer would carry it along.
    return t.contiguous().clone()


def _specforge(cache_dir: str, manifest: Manifest, layer_ids: Sequence[int] | None) -> _Export:
    vocab: dict[str, torch.Tensor] | None = None
    if manifest.cache_name == eagle3.CACHE_NAME:
        supervision = manifest.config.get("supervision", "hidden")
        if supervision != "hidden":
            raise CacheFormatError(
                f"{cache_dir}: --to specforge stores the final-norm output (SpecForge's hidden_state); this cache "
                f"stores --supervision {supervision} instead. Export a cache written with --supervision hidden"
            )
        ds: CacheDataset = eagle3.Eagle3CacheDataset(
            cache_dir, keys=["input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"]
        )
        side = ShardFile(os.path.join(cache_dir, eagle3.SIDE_FILE))
        if int(manifest.config["draft_vocab_size"]) < int(manifest.config["vocab_size"]):
            vocab = {"d2t": side.tensor("d2t").clone(), "t2d": side.tensor("t2d").clone()}
    elif manifest.cache_name == layers.CACHE_NAME:
        ds = layers.eagle3_dataset(cache_dir, layer_ids)
    else:
        raise CacheFormatError(
            f"{cache_dir}: --to specforge reads an eagle3 or layers cache, not a {manifest.cache_name!r} one"
        )

    def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        sample = {
            "input_ids": s["input_ids"].to(torch.int64),
            "loss_mask": s["loss_mask"].to(torch.int64),
            "aux_hidden_state": _own(s["aux_hidden_states"])[None],
            "hidden_state": _own(s["last_hidden_state"])[None],
        }
        return {specforge_path(out, index): sample}

    def finish(out: str, ids: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        if vocab is not None:
            _torch_save(os.path.join(out, VOCAB_MAPPING), vocab)

    return _Export(ds, sample_files, _torch_save, finish)


def _speculators(cache_dir: str, manifest: Manifest, layer_ids: Sequence[int] | None) -> _Export:
    if manifest.cache_name != layers.CACHE_NAME:
        raise CacheFormatError(
            f"{cache_dir}: --to speculators needs the last decoder layer's output before the final norm, which only "
            f"a layers cache stores; this is a {manifest.cache_name!r} cache. Write one with --method layers "
            "--layers A,B,C --last-prenorm"
        )
    num_layers = int(manifest.config["num_layers"])
    aux = list(layer_ids) if layer_ids is not None else eagle3.default_aux_layers(num_layers)
    ds = layers.LayerFeatureDataset(cache_dir, {"hidden_states": [*aux, num_layers - 1]}, prenorm=True)
    hidden = int(manifest.config["hidden_size"])

    def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        ids = s["input_ids"].to(torch.int64)
        states = s["hidden_states"].reshape(ids.numel(), len(aux) + 1, hidden)
        return {speculators_hs_path(out, index): {"hidden_states": states.contiguous(), "token_ids": ids}}

    def finish(out: str, ids: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        import pyarrow as pa
        from datasets import Dataset

        supervised = torch.cat([i[m.bool()] for i, m in zip(ids, masks)]) if ids else torch.empty(0, dtype=torch.long)
        tokens, counts = supervised.unique(return_counts=True)
        _torch_save(os.path.join(out, TOKEN_FREQ), dict(zip(tokens.tolist(), counts.tolist())))
        lengths = torch.tensor([0, *(i.numel() for i in ids)], dtype=torch.int64)
        offsets = pa.array(lengths.cumsum(0).numpy(), pa.int64())

        def column(parts: list[torch.Tensor]) -> pa.Array:
            values = torch.cat(parts).to(torch.int64) if parts else torch.empty(0, dtype=torch.int64)
            return pa.LargeListArray.from_arrays(offsets, pa.array(values.numpy()))

        table = pa.table(
            {"input_ids": column(ids), "loss_mask": column(masks), "seq_len": pa.array(lengths[1:].numpy())}
        )
        data = Dataset(table)
        data.set_format(type="torch")  # as speculators' prepare_data saves it: its trainer compares torch tensors
        data.save_to_disk(out)

    return _Export(ds, sample_files, write_safetensors, finish)


def _batches(ds: CacheDataset) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    for start in range(0, len(ds), ds.shard_size):
        yield start, [dict(s) for s in ds.__getitems__(list(range(start, min(start + ds.shard_size, len(ds)))))]


def export_peer(
    cache_dir: str,
    out: str,
    to: str,
    layer_ids: Sequence[int] | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Export ``cache_dir`` to ``out`` in SpecForge's or speculators' offline layout.

    Args:
        cache_dir: a sealed speccache cache (EAGLE-3 with ``hidden`` supervision, or layers).
        out: the output directory (absent or empty).
        to: ``specforge`` or ``speculators``.
        layer_ids: aux layer ids to read from a layers cache (default: EAGLE-3's for the target's depth).
        log: where the size line goes, before anything is written.

    Returns:
        The number of samples written.

    Raises:
        CacheExistsError: ``out`` is not empty.
        CacheFormatError: the cache cannot give what the layout needs (the message says what is missing).
    """
    if to not in LAYOUTS:
        raise ValueError(f"--to {to!r} is unknown; choose one of {', '.join(LAYOUTS)}")
    if os.path.isdir(out) and os.listdir(out):
        raise CacheExistsError(f"--out {out} is not empty; export into a new or empty directory")
    manifest = Manifest.read(cache_dir)
    export = (_specforge if to == SPECFORGE else _speculators)(cache_dir, manifest, layer_ids)
    ds = export.dataset
    if len(ds):
        # Every stored feature is per token, so the first sample's bytes per token give the total.
        first = export.sample_files(out, 0, dict(ds[0]))
        nbytes = sum(t.numel() * t.element_size() for f in first.values() for t in f.values())
        total = nbytes * manifest.num_tokens // max(1, ds[0]["input_ids"].numel())
    else:
        total = 0
    log(
        f"speccache export: {len(ds)} samples, {manifest.num_tokens} tokens -> {out} ({to}, one file per sample): "
        f"about {human_bytes(total)}"
    )
    os.makedirs(out, exist_ok=True)
    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for start, samples in _batches(ds):
        for offset, sample in enumerate(samples):
            for path, tensors in export.sample_files(out, start + offset, sample).items():
                export.write(path, tensors)
            ids.append(sample["input_ids"].to(torch.int64))
            masks.append(sample["loss_mask"].to(torch.int64))
    export.finish(out, ids, masks)
    return len(ds)
