"""``speccache precompute --append``: add the rows of a new data file to a sealed cache as new samples.

The result is the cache a single run over the concatenated data would have
written: samples ``[0, base)`` stay, the new file's samples follow from
``base``. Shards holding only old samples are kept as they are; the old last
shard, when partial, is recomputed from the tokens stored in it (so the old data
file need not exist any more), together with the first new samples, so that
every shard but the last is full and its batches are those of a single run. The
draft vocabulary is the cache's own (its side file), whatever the new data's
token counts.

Crash safety is the writer's: the run unseals the manifest with the appended
configuration, writes whole shards atomically and seals once. A killed append
is finished by the same command (``--append`` recognises its own unsealed
manifest); until the old last shard is rewritten, the shards of the previous
cache are all intact.

Only the data may differ: the writer compares every other configuration field
with the cache's (:data:`DATA_FIELDS` are exempt) and refuses, listing them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from speccache.errors import CacheCorruptError, CacheExistsError, CacheIncompleteError, DataError
from speccache.format import (
    DROPPED_FIELDS_FILE,
    SAMPLE_TURN_KEY,
    SKIPPED_ROWS_FILE,
    SOURCE_ROW_KEY,
    Manifest,
    NativeShard,
    load_manifest_json,
    manifest_path,
    shard_path,
)
from speccache.read.view import CACHE_DATA_FIELDS
from speccache.read.view import DATA_FIELDS as VIEW_DATA_FIELDS

__all__ = ["DATA_FIELDS", "AppendPlan", "AppendedDataset", "merge_stats", "plan_append"]

DATA_FIELDS = CACHE_DATA_FIELDS
"""Configuration fields an append may change: which data the samples come from (those merged views may differ in)."""
_PER_SAMPLE = (SOURCE_ROW_KEY, SAMPLE_TURN_KEY)  # fixed int64 keys a recomputed stored sample keeps


@dataclass
class AppendPlan:
    """What an append writes.

    Attributes:
        base: samples of the cache before this append (the new file's first sample index).
        num_samples: samples after it.
        config: the manifest configuration after it (the cache's, plus this file in ``appended``).
        tail: stored tokens of samples ``[tail_start, base)`` (the old partial last shard), recomputed with the new.
        tail_start: first sample index of ``tail``.
        stats_before: the sealed cache's statistics, which the new run's are added to.
        skipped_before: the lines of ``skipped_rows.jsonl`` that list the skipped rows of the cache's earlier data
            files, each naming its file; the new file's lines follow them.
        dropped_before: the same for ``dropped_fields.jsonl``.
    """

    base: int
    num_samples: int
    config: dict[str, Any]
    tail: list[dict[str, torch.Tensor]]
    tail_start: int
    stats_before: dict[str, Any]
    skipped_before: bytes
    dropped_before: bytes = b""


def plan_append(out: str, run_config: Mapping[str, Any], new_samples: int, shard_size: int) -> AppendPlan:
    """Read the cache at ``out`` and plan appending ``new_samples`` samples computed with ``run_config``.

    Raises:
        CacheExistsError: no cache at ``out``.
        CacheIncompleteError: the cache is unsealed by something other than this very append.
        DataError: the new file's data is already in the cache.
    """
    if not os.path.exists(manifest_path(out)):
        raise CacheExistsError(f"--append: {out} holds no cache; write one first (without --append)")
    body = load_manifest_json(manifest_path(out))
    config = dict(body.get("config") or {})
    appended = list(config.get("appended") or [])
    entry = {k: run_config[k] for k in sorted(VIEW_DATA_FIELDS) if k in run_config}
    resuming = not body.get("complete") and bool(appended) and appended[-1]["data_hash"] == entry["data_hash"]
    if not body.get("complete") and not resuming:
        raise CacheIncompleteError(
            f"--append: {out} is not sealed (interrupted or being written); finish it with --resume first"
        )
    if body.get("complete") and entry["data_hash"] in {config.get("data_hash"), *(a["data_hash"] for a in appended)}:
        raise DataError(
            f"--append: the data of {entry['data']} is already in {out} (same content hash); nothing was changed"
        )
    skipped = _skipped_lines(out, str(config.get("data")))
    dropped = _skipped_lines(out, str(config.get("data")), DROPPED_FIELDS_FILE)
    if resuming:
        base, stats_before = int(appended[-1]["first_sample"]), dict(appended[-1]["stats_before"])
        # A killed append may have written its file's lines already: keep those of the earlier files only.
        skipped = skipped[: int(appended[-1].get("skipped_rows_before", len(skipped)))]
        dropped = dropped[: int(appended[-1].get("dropped_fields_before", 0))]  # recorded when not 0
    else:
        base, stats_before = int(body["num_samples"]), dict(body.get("stats") or {})
        before = {"first_sample": base, "stats_before": stats_before, "skipped_rows_before": len(skipped)}
        appended.append({**entry, **before, **({"dropped_fields_before": len(dropped)} if dropped else {})})
    settings = {k: v for k, v in run_config.items() if k not in DATA_FIELDS}
    merged = {**settings, **{k: config[k] for k in DATA_FIELDS if k in config}, "appended": appended}
    tail_start = base - base % shard_size
    tail = _stored_tokens(out, body, tail_start // shard_size, base - tail_start) if base > tail_start else []
    return AppendPlan(
        base, base + new_samples, merged, tail, tail_start, stats_before, b"".join(skipped), b"".join(dropped)
    )


def _skipped_lines(out: str, first_data: str, name: str = SKIPPED_ROWS_FILE) -> list[bytes]:
    """The lines of the cache's ``skipped_rows.jsonl`` (or ``name``), each naming its data file (a line written before
    lines named theirs lists a row of the cache's first file, ``first_data``)."""
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = [line for line in f if line.strip()]
    try:
        rows = [json.loads(line) for line in lines]
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError("a line is not a JSON object")
    except ValueError as exc:
        raise CacheCorruptError(
            f"--append: {path} is not one JSON object per line ({exc}), so the rows it lists cannot be kept. "
            "Restore it (speccache verify checks it against the manifest's side_files), then re-run the append."
        ) from None
    return [(json.dumps({**row, "data": row.get("data", first_data)}) + "\n").encode("utf-8") for row in rows]


def _stored_tokens(out: str, body: Mapping[str, Any], index: int, count: int) -> list[dict[str, torch.Tensor]]:
    # The shard may already be the rewritten, fuller one of an interrupted append: its first samples are the same.
    manifest = Manifest.from_json(body, manifest_path(out))
    shard = NativeShard(shard_path(out, index), manifest.schema, index, None, verify=True)
    try:
        keys = [k for k in ("input_ids", "loss_mask", *_PER_SAMPLE) if k in manifest.schema]
        rows = {k: shard.rows(k, 0, count).clone() for k in keys}
        offsets = shard.row_offsets
    finally:
        shard.close()
    items = []
    for i in range(count):
        a, b = offsets[i], offsets[i + 1]
        item = {
            "input_ids": rows["input_ids"][a:b].to(torch.int64),
            "loss_mask": rows["loss_mask"][a:b].bool(),
            # A sample cleared by --nonfinite skip stores no supervised token: recomputed, it is cleared again.
        }
        item.update((k, rows[k][i].to(torch.int64)) for k in _PER_SAMPLE if k in rows)
        items.append(item)
    return items


class AppendedDataset(Dataset):
    """Samples by cache index: the stored tail ``[tail_start, base)``, then the new samples from ``base``.

    Indices below ``tail_start`` are never computed (their shards are kept); they return the first available sample,
    which only the lockstep's discarded dummy batches read.
    """

    def __init__(self, plan: AppendPlan, new: Dataset) -> None:
        self.plan = plan
        self.new = new

    def __len__(self) -> int:
        return self.plan.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = max(index, self.plan.tail_start)
        if index < self.plan.base:
            return {**self.plan.tail[index - self.plan.tail_start], "sample_index": torch.tensor(index)}
        item = dict(self.new[index - self.plan.base])
        item["sample_index"] = torch.tensor(index)
        return item


# Statistics that are maxima, not counts; a cache written before one was recorded has an unknown maximum.
MAX_STATS = ("longest_sample",)


def merge_stats(before: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The statistics of the cache after an append: counts summed (per reason for dicts), maxima the larger
    (left out when the cache lacks them), the rest the new run's."""
    out: dict[str, Any] = dict(new)
    for key in MAX_STATS:
        if key in before and key in out:
            out[key] = max(out[key], before[key])
        else:
            out.pop(key, None)
    for key, value in before.items():
        if key in MAX_STATS:
            continue
        if isinstance(value, int) and isinstance(new.get(key), int):
            out[key] = value + new[key]
        elif isinstance(value, dict) and isinstance(new.get(key), dict) and key != "encoding_error":
            merged = dict(value)
            for k, v in new[key].items():
                merged[k] = merged.get(k, 0) + v if isinstance(v, int) else v
            out[key] = merged
        elif key not in out:
            out[key] = value
    return out
