"""SpecForge's offline layout (SpecForge 0.2.0), written from a speccache cache and read back into one.

``specforge/runtime/data_plane/offline_reader.py`` and ``feature_store.load_feature_file`` read a tree of
``*.ckpt`` files in sorted path order, each a ``torch.save`` dict of one sample: ``input_ids`` int64 ``[S]``,
``loss_mask`` int64 ``[S]``, ``aux_hidden_state`` ``[1, S, 3H]`` (the aux decoder layers before the final norm) and
``hidden_state`` ``[1, S, H]`` (the final-norm output, the LM-head input); ``vocab_mapping.pt`` (``d2t``/``t2d``)
beside them when the draft vocabulary is smaller than the target's. Its DFlash and DSpark trainers
(``specforge/algorithms/common/dflash_family_data.py``) read the same files with ``hidden_states`` ``[1, S, K*H]``
(the method's layers concatenated) and, for DSpark, ``target_last_hidden_states`` ``[1, S, H]``:
``specforge-dflash`` and ``specforge-dspark``, from a layers cache.

:mod:`speccache.compat.peers` runs the plans made here; docs/interop.md has the tables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speccache.compat._base import BadFile, Entry, PeerExport, PeerImport, Target, check, own, scan, torch_save
from speccache.errors import CacheFormatError
from speccache.methods import eagle3, eagle3_producer, layers
from speccache.read import CacheDataset
from speccache.read.source import CacheSource

__all__ = [
    "FILES_PER_DIR",
    "SPECFORGE",
    "SPECFORGE_DFLASH",
    "SPECFORGE_DSPARK",
    "VOCAB_MAPPING",
    "dflash_family_export_plan",
    "export_plan",
    "import_plan",
    "specforge_path",
]

SPECFORGE = "specforge"
SPECFORGE_DFLASH = "specforge-dflash"
SPECFORGE_DSPARK = "specforge-dspark"
FILES_PER_DIR = 5000
"""SpecForge's hidden-state preparation groups its files in folders of this many rows."""
VOCAB_MAPPING = "vocab_mapping.pt"


def specforge_path(out: str, index: int) -> str:
    """Sample ``index``'s file: zero-padded names, so SpecForge's sorted path order is the cache's sample order."""
    first = index - index % FILES_PER_DIR
    return os.path.join(out, f"rows_{first:08d}-{first + FILES_PER_DIR:08d}", f"data_{index:08d}.ckpt")


NO_VISION_PATH = (
    "SpecForge removed its vision-language training path (SpecForge #678) after drafts trained on it accepted about "
    "one token (#310), and its offline capture dropped the pixels (#497)"
)


def export_plan(cache_dir: str, source: CacheSource, layer_ids: Sequence[int] | None, verify: bool) -> PeerExport:
    """Plan ``--to specforge``: an EAGLE-3 cache (``hidden`` supervision) or a layers cache, a ``*.ckpt`` a sample."""
    vocab: dict[str, torch.Tensor] | None = None
    if source.cache_name == eagle3.CACHE_NAME:
        supervision = source.config.get("supervision", "hidden")
        if supervision != "hidden":
            raise CacheFormatError(
                f"{cache_dir}: --to specforge stores the final-norm output (SpecForge's hidden_state); this cache "
                f"stores --supervision {supervision} instead. Export a cache written with --supervision hidden"
            )
        ds: CacheDataset = eagle3.Eagle3CacheDataset(
            cache_dir, keys=["input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"], verify=verify
        )
        if int(source.config["draft_vocab_size"]) < int(source.config["vocab_size"]):
            vocab = eagle3.read_side_file(source.side_file(eagle3.SIDE_FILE), ("d2t", "t2d"))
    elif source.cache_name == layers.CACHE_NAME:
        ds = layers.eagle3_dataset(cache_dir, layer_ids, verify=verify)
    else:
        raise CacheFormatError(
            f"{cache_dir}: --to specforge reads an eagle3 or layers cache, not a {source.cache_name!r} one"
        )

    def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        sample = {
            "input_ids": s["input_ids"].to(torch.int64),
            "loss_mask": s["loss_mask"].to(torch.int64),
            "aux_hidden_state": own(s["aux_hidden_states"])[None],
            "hidden_state": own(s["last_hidden_state"])[None],
        }
        return {specforge_path(out, index): sample}

    def finish(out: str, ids: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        if vocab is not None:
            torch_save(os.path.join(out, VOCAB_MAPPING), vocab)

    return PeerExport(ds, sample_files, torch_save, finish)


def dflash_family_export_plan(dspark: bool) -> Callable[[str, CacheSource, Sequence[int] | None, bool], PeerExport]:
    """The planner of ``--to specforge-dspark`` (``dspark``) or ``--to specforge-dflash``: a layers cache's layers."""

    def plan(cache_dir: str, source: CacheSource, layer_ids: Sequence[int] | None, verify: bool) -> PeerExport:
        to = SPECFORGE_DSPARK if dspark else SPECFORGE_DFLASH
        if source.cache_name != layers.CACHE_NAME:
            raise CacheFormatError(
                f"{cache_dir}: --to {to} reads a layers cache (--method dspark, dflash or layers), "
                f"not a {source.cache_name!r} cache"
            )
        ds = (layers.dspark_dataset if dspark else layers.dflash_dataset)(cache_dir, layer_ids, verify=verify)

        def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
            sample = {
                "input_ids": s["input_ids"].to(torch.int64),
                "loss_mask": s["loss_mask"].to(torch.int64),
                "hidden_states": own(s["target_hidden_states"])[None],
            }
            if dspark:
                sample["target_last_hidden_states"] = own(s["target_last_hidden_states"])[None]
            return {specforge_path(out, index): sample}

        return PeerExport(ds, sample_files, torch_save, lambda out, ids, masks: None)

    return plan


def _load(path: str) -> dict[str, Any]:
    """One SpecForge file, read as tensors and plain containers only (never unpickling code)."""
    import gzip
    import io
    import pickle
    import zlib

    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return torch.load(io.BytesIO(f.read()), weights_only=True)
        return torch.load(path, weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise BadFile(
            "unsafe",
            f"needs more than tensors and plain containers to load ({str(exc).splitlines()[0]}); refused rather "
            "than loaded with weights_only=False, which could run code from the file",
        ) from None
    except (OSError, EOFError, RuntimeError, zlib.error, ValueError) as exc:
        raise BadFile("unreadable", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def _sample(raw: Any, hidden: int, vocab: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    check(isinstance(raw, dict), "bad_keys", f"holds a {type(raw).__name__}, not a dict of tensors")
    missing = [k for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state") if k not in raw]
    check(not missing, "bad_keys", f"lacks {missing}")
    ids, mask, aux, last = (raw[k] for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"))
    check(all(isinstance(t, torch.Tensor) for t in (ids, mask, aux, last)), "bad_keys", "a feature is not a tensor")
    ids, mask = ids.reshape(-1), mask.reshape(-1)
    n = ids.numel()
    check(n > 0 and not ids.is_floating_point(), "bad_shape", f"input_ids {tuple(ids.shape)} {ids.dtype}")
    check(mask.numel() == n and bool(((mask == 0) | (mask == 1)).all()), "bad_shape", "loss_mask is not 0/1 of [S]")
    check(bool(((ids >= 0) & (ids < vocab)).all()), "bad_tokens", f"a token id is outside the vocabulary of {vocab}")
    want = {"aux_hidden_state": (1, n, 3 * hidden), "hidden_state": (1, n, hidden)}
    for key, t in (("aux_hidden_state", aux), ("hidden_state", last)):
        check(tuple(t.shape) == want[key], "bad_shape", f"{key} is {tuple(t.shape)}, expected {want[key]}")
        check(t.dtype == (dtype or t.dtype), "bad_dtype", f"{key} is {t.dtype}; the first file's features are {dtype}")
    return {"input_ids": ids, "loss_mask": mask, "aux_hidden_states": aux[0], "last_hidden_state": last[0]}


def import_plan(src: str, target: Target, layer_ids: Sequence[int] | None, encodings: dict[str, str]) -> PeerImport:
    """Plan ``--from specforge``: every ``*.ckpt`` under ``src`` checked, into an EAGLE-3 cache (``hidden``)."""
    names = [os.path.relpath(p, src) for p in _files(src)]
    if not names:
        raise CacheFormatError(f"{src}: no SpecForge feature files (*.ckpt, *.ckpt.gz) under it")
    dtype: list[torch.dtype] = []

    def load(name: str) -> dict[str, torch.Tensor]:
        sample = _sample(_load(os.path.join(src, name)), target.hidden, target.vocab, dtype[0] if dtype else None)
        dtype[:1] = [sample["aux_hidden_states"].dtype]
        return sample

    entries, skipped = scan(names, lambda _row, name: load(name)["input_ids"].numel())
    mapping = os.path.join(src, VOCAB_MAPPING)
    if os.path.exists(mapping):
        t2d = _load(mapping)["t2d"].bool()
        selected = t2d.nonzero()[:, 0]
    else:
        selected = torch.arange(target.vocab)
    draft = int(selected.numel())
    aux = list(layer_ids) if layer_ids is not None else eagle3.default_aux_layers(target.num_layers)
    features = dtype[0] if dtype else torch.bfloat16
    supervision = eagle3.Supervision("hidden")
    schema = eagle3_producer.eagle3_schema(
        target.hidden, features, supervision, draft, draft == target.vocab, encodings
    )
    config = {
        "method": eagle3.CACHE_NAME,
        "aux_layers": aux,
        "supervision": str(supervision),
        "draft_vocab_size": draft,
        "last_hidden_state": "the final-norm output, as SpecForge's hidden_state",
    }
    head = target.lm_head

    def rows(entry: Entry) -> dict[str, torch.Tensor]:
        s = load(entry.name)
        out = {
            "input_ids": s["input_ids"].to(torch.int32),
            "loss_mask": s["loss_mask"].bool(),
            "aux_hidden_states": s["aux_hidden_states"],
            "last_hidden_state": s["last_hidden_state"],
        }
        if draft < target.vocab:
            argmax = torch.nn.functional.linear(s["last_hidden_state"].float(), head).argmax(-1)
            out["in_draft"] = torch.isin(argmax, selected)
        return out

    def side() -> dict[str, torch.Tensor]:
        return {
            "embed_tokens": target.embed_tokens.to(features).contiguous(),
            "lm_head": head[selected].to(features).contiguous(),
            **eagle3_producer.vocab_mapping(selected, target.vocab),
        }

    return PeerImport(eagle3.CACHE_NAME, schema, config, entries, skipped, side, eagle3.SIDE_FILE, rows)


def _files(src: str) -> list[str]:
    # As SpecForge's list_feature_files: every *.ckpt / *.ckpt.gz under src, in sorted path order.
    found = [
        os.path.join(root, name)
        for root, _dirs, names in os.walk(src)
        for name in names
        if name.endswith((".ckpt", ".ckpt.gz"))
    ]
    return sorted(found)
