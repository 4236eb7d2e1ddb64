"""What the layout modules share: the output directory rule, the dtype names, the shard-by-shard read of a source,
the plans a peer's export and import fill in, and the checks of a peer's file.

Private plumbing of :mod:`speccache.compat`: :mod:`~speccache.compat.nemo`, :mod:`~speccache.compat.specforge`,
:mod:`~speccache.compat.speculators` and :mod:`~speccache.compat.peers` import it; it imports none of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from speccache.devices import DTYPES
from speccache.errors import CacheExistsError, CacheFormatError
from speccache.format import atomic_write
from speccache.read import CacheDataset

__all__ = [
    "DTYPES",
    "BadFile",
    "Entry",
    "PeerExport",
    "PeerImport",
    "Target",
    "batches",
    "check",
    "check_export_dir",
    "refuse_vision",
    "load_target",
    "own",
    "scan",
    "torch_save",
]


def check_export_dir(out: str) -> None:
    """Refuse an ``--out`` that holds anything: an export writes a whole layout of its own there.

    Raises:
        CacheExistsError: ``out`` is not empty.
    """
    if os.path.isdir(out) and os.listdir(out):
        raise CacheExistsError(f"--out {out} is not empty; export into a new or empty directory")


def refuse_vision(cache_dir: str, config: Mapping[str, Any], to: str, why: str) -> None:
    """Refuse to export a vision-language target's cache (``config.vision``) to a layout whose trainer has no
    vision-language path (``why``: the peer's own record of it).

    Raises:
        CacheFormatError: the cache's rows hold images.
    """
    if "vision" in config:
        raise CacheFormatError(
            f"{cache_dir}: a vision-language target's cache (its manifest records config.vision); --to {to} "
            f"has no path for image rows: {why}. Train with speccache train, or export --to speculators (its "
            "trainer reads the rows text-only: docs/vision.md)"
        )


def batches(ds: CacheDataset) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    """A source's samples one shard at a time, as ``(index of the first, samples)``: an export holds one shard."""
    for start in range(0, len(ds), ds.shard_size):
        yield start, [dict(s) for s in ds.__getitems__(list(range(start, min(start + ds.shard_size, len(ds)))))]


@dataclass
class PeerExport:
    """What an export reads (``dataset``), turns each sample into (``sample_files``: path -> tensors, written by
    ``write``) and writes once at the end (``finish``)."""

    dataset: CacheDataset
    sample_files: Callable[[str, int, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]
    write: Callable[[str, dict[str, torch.Tensor]], Any]
    finish: Callable[[str, list[torch.Tensor], list[torch.Tensor]], None]  # out, every sample's ids and mask


def torch_save(path: str, obj: Any) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically: a peer's file is whole or absent."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def own(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes a tensor's whole storage: a sample that views a larger buffer would carry it along.
    return t.contiguous().clone()


class BadFile(Exception):
    """A peer file that cannot be imported; ``reason`` is its skip reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class Entry:
    """A checked sample of the source: where it is and its length."""

    name: str  # relative to the source directory
    source_row: int
    length: int


@dataclass
class PeerImport:
    """What an import writes: its schema and config, the checked entries, the skipped files, and the rows."""

    cache_name: str
    schema: Any
    config: dict[str, Any]
    entries: list[Entry]
    skipped: list[dict[str, str]]
    side: Callable[[], dict[str, torch.Tensor]]
    side_name: str
    rows: Callable[[Entry], dict[str, torch.Tensor]]  # one entry's ragged rows, re-read and re-checked


def check(ok: bool, reason: str, detail: str) -> None:
    """Raise :class:`BadFile` (``reason``, ``detail``) unless ``ok``: one check of a peer's file."""
    if not ok:
        raise BadFile(reason, detail)


def scan(names: Sequence[str], length: Callable[[int, str], int]) -> tuple[list[Entry], list[dict[str, str]]]:
    """Check every source file (``length(row, name)`` gives its length or raises :class:`BadFile`)."""
    entries: list[Entry] = []
    skipped: list[dict[str, str]] = []
    for row, name in enumerate(names):
        try:
            entries.append(Entry(name, row, length(row, name)))
        except BadFile as bad:
            skipped.append({"file": name, "reason": bad.reason, "detail": str(bad)})
    return entries, skipped


@dataclass
class Target:
    """What an import takes from the target model: its shape and the weights of its side file."""

    config: Any
    num_layers: int
    hidden: int
    vocab: int
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor


def load_target(model: str) -> Target:
    """Load ``--model`` (fp32) for what an import takes from it.

    Raises:
        FileNotFoundError: nothing loadable at ``model``.
    """
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    except OSError as exc:
        raise FileNotFoundError(f"--model {model}: no model directory or loadable model there ({exc})") from None
    text = loaded.config.get_text_config()
    return Target(
        loaded.config,
        int(text.num_hidden_layers),
        int(text.hidden_size),
        int(text.vocab_size),
        cast(torch.Tensor, loaded.get_input_embeddings().weight).detach(),  # typed as a Module's attribute
        loaded.get_output_embeddings().weight.detach(),
    )
