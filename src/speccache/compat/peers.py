"""SpecForge's and speculators' offline layouts, written from a speccache cache and read back into one.

Both peers store one file per sample and read them with their own trainers; each layout is its own module
(:mod:`~speccache.compat.specforge`, :mod:`~speccache.compat.speculators`), which plans what an export reads and
writes and what an import checks and converts. This module runs those plans.

Export streams one speccache shard at a time, prints the size first, writes every file atomically and
refuses a non-empty output directory. docs/interop.md has the tables and the measured sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from safetensors import SafetensorError

from speccache.compat import specforge, speculators
from speccache.compat._base import DTYPES, BadFile, batches, check_export_dir, load_target, refuse_vision
from speccache.compat.specforge import SPECFORGE, SPECFORGE_DFLASH, SPECFORGE_DSPARK
from speccache.compat.speculators import SPECULATORS
from speccache.errors import CacheFormatError, UsageError
from speccache.format import Manifest
from speccache.format.durable import ensure_writable_dir, writes_to
from speccache.read.source import open_source
from speccache.units import human_bytes

__all__ = ["IMPORTS", "LAYOUTS", "SKIPPED_FILES", "export_peer", "import_peer"]

LAYOUTS = (SPECFORGE, SPECFORGE_DFLASH, SPECFORGE_DSPARK, SPECULATORS)
IMPORTS = (SPECFORGE, SPECULATORS)


def export_peer(
    cache_dir: str,
    out: str,
    to: str,
    layer_ids: Sequence[int] | None = None,
    log: Callable[[str], None] = print,
    verify: bool = True,
) -> int:
    """Export ``cache_dir`` to ``out`` in SpecForge's or speculators' offline layout.

    Args:
        cache_dir: a sealed speccache cache (EAGLE-3 with ``hidden`` supervision, or layers).
        out: the output directory (absent or empty).
        to: ``specforge`` (EAGLE-3), ``specforge-dflash``, ``specforge-dspark`` or ``speculators``.
        layer_ids: aux layer ids to read from a layers cache (default: EAGLE-3's for the target's depth).
        log: where the size line goes, before anything is written.
        verify: check the tensors read from each shard against their checksums (``False``: ``--no-verify``).

    Returns:
        The number of samples written.

    Raises:
        CacheCorruptError: (``verify``) a tensor read differs from its checksum; nothing of its shard is written.
        CacheExistsError: ``out`` is not empty.
        CacheFormatError: the cache cannot give what the layout needs (the message says what is missing).
        OutputError: the operating system refuses ``out`` or a write in it.
    """
    if to not in LAYOUTS:
        raise UsageError(f"--to {to!r} is unknown; choose one of {', '.join(LAYOUTS)}")
    check_export_dir(out)
    source = open_source(cache_dir)  # a cache or a view: a view exports the samples it selects
    if to != SPECULATORS:
        refuse_vision(cache_dir, source.config, to, specforge.NO_VISION_PATH)
    plans = {
        SPECFORGE: specforge.export_plan,
        SPECFORGE_DFLASH: specforge.dflash_family_export_plan(dspark=False),
        SPECFORGE_DSPARK: specforge.dflash_family_export_plan(dspark=True),
        SPECULATORS: speculators.export_plan,
    }
    export = plans[to](cache_dir, source, layer_ids, verify)
    ds = export.dataset
    tokens = sum(ds.sample_lengths())
    if len(ds):
        # Every stored feature is per token, so the first sample's bytes per token give the total.
        first = export.sample_files(out, 0, dict(ds[0]))
        nbytes = sum(t.numel() * t.element_size() for f in first.values() for t in f.values())
        total = nbytes * tokens // max(1, ds[0]["input_ids"].numel())
    else:
        total = 0
    log(
        f"speccache export: {len(ds)} samples, {tokens} tokens -> {out} ({to}, one file per sample): "
        f"about {human_bytes(total)}"
    )
    ensure_writable_dir(out)
    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    # Only the writes are wrapped: a failed read of the source keeps its own message. Every file is written
    # atomically, so a full disk leaves nothing half-written under a final name.
    for start, samples in batches(ds):
        for offset, sample in enumerate(samples):
            for path, tensors in export.sample_files(out, start + offset, sample).items():
                with writes_to(out, SafetensorError):
                    export.write(path, tensors)
            ids.append(sample["input_ids"].to(torch.int64))
            masks.append(sample["loss_mask"].to(torch.int64))
    with writes_to(out, SafetensorError):
        export.finish(out, ids, masks)
    return len(ds)


# ---------------------------------------------------------------------------
# import: every file read and checked, the good ones converted, the rest reported

SKIPPED_FILES = "skipped_files.jsonl"
"""The import's report: one ``{"file", "reason", "detail"}`` object per file left out."""


def _source_digest(src: str) -> str:
    """Names, sizes and times of every file under ``src``: a resumed import must read the same source."""
    import xxhash

    h = xxhash.xxh3_128()
    for root, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            st = os.stat(os.path.join(root, name))
            h.update(f"{os.path.relpath(os.path.join(root, name), src)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def import_peer(
    src: str,
    out: str,
    layout: str,
    model: str,
    layer_ids: Sequence[int] | None = None,
    encodings: dict[str, str] | None = None,
    shard_size: int = 256,
    resume: bool = False,
) -> Manifest:
    """Import a SpecForge or speculators offline directory as a sealed speccache cache.

    Every file is read and checked first (keys, shapes, dtypes, token ids; SpecForge's pickles with
    ``weights_only=True``); the good ones become samples in sorted order, the others are listed in
    ``skipped_files.jsonl`` with their reason and counted in the manifest's ``stats.skipped_files``.

    Args:
        src: the peer's directory.
        out: the cache to write.
        layout: ``specforge`` (an EAGLE-3 cache, ``hidden`` supervision) or ``speculators`` (a layers cache with
            the aux layers and the last layer before the final norm).
        model: the target model directory the features came from (its embeddings and LM head fill the side file).
        layer_ids: the aux layer ids (speccache's convention, decoder layer ``l``; required for speculators).
        encodings: ``--encode`` per feature.
        shard_size: samples per shard.
        resume: finish an interrupted import of the same source.

    Returns:
        The sealed manifest.

    Raises:
        CacheFormatError: ``src`` is not such a directory, or a file changed while it was imported.
        CacheExistsError, ConfigMismatchError, CacheLockedError: ``out`` cannot be used.
    """
    import json

    from speccache.format import LENGTHS_KEY, SOURCE_ROW_KEY
    from speccache.write import CacheWriter, SideFile

    if layout not in IMPORTS:
        raise UsageError(f"--from {layout!r} is unknown; choose one of nemo-eagle3, {', '.join(IMPORTS)}")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: no such directory")
    target = load_target(model)
    plan = (specforge.import_plan if layout == SPECFORGE else speculators.import_plan)(
        src, target, layer_ids, encodings or {}
    )
    if not plan.entries:
        raise CacheFormatError(f"{src}: no importable file ({len(plan.skipped)} skipped: see the reasons above)")
    reasons: dict[str, int] = {}
    for bad in plan.skipped:
        reasons[bad["reason"]] = reasons.get(bad["reason"], 0) + 1
        print(f"speccache import: skipped {bad['file']}: {bad['reason']}: {bad['detail']}")
    config = {
        **plan.config,
        "imported_from": os.path.abspath(src),
        "imported_layout": layout,
        "source_digest": _source_digest(src),
        "model": os.path.abspath(model),
        "max_length": max(e.length for e in plan.entries),
        "dtype": {v: k for k, v in DTYPES.items()}[
            next(s.dtype for s in plan.schema.values() if s.dtype.is_floating_point)
        ],
        "vocab_size": target.vocab,
        "hidden_size": target.hidden,
        "encodings": {k: s.encoding for k, s in plan.schema.items() if s.encoding != "raw"},
    }
    writer = CacheWriter(
        out,
        cache_name=plan.cache_name,
        schema=plan.schema,
        shard_size=shard_size,
        num_samples=len(plan.entries),
        config=config,
        resume=resume,
    )
    side_files = [SideFile(plan.side_name, plan.side, {"speccache_side": plan.cache_name})]
    if plan.skipped:
        report = "".join(json.dumps(bad) + "\n" for bad in plan.skipped).encode()
        side_files.append(SideFile(SKIPPED_FILES, content=lambda: report))
    with writer.writing(side_files=tuple(side_files), overlap=False) as run:
        for index in run.shards:
            batch = plan.entries[index * shard_size : (index + 1) * shard_size]
            try:
                samples = [plan.rows(e) for e in batch]
            except BadFile as bad:
                raise CacheFormatError(
                    f"{src}: a file changed since it was checked ({bad}); re-run the import on a source nobody writes"
                ) from None
            rows = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
            rows[LENGTHS_KEY] = torch.tensor([e.length for e in batch], dtype=torch.int64)
            rows[SOURCE_ROW_KEY] = torch.tensor([e.source_row for e in batch], dtype=torch.int64)
            run.write_shard(out, index, rows)
        run.stats = {"skipped_files": reasons} if reasons else {}
    return writer.manifest
