"""Per-sample statistics of a cache, as its shards' metadata records them, and their distribution as text.

The shard writer stores, per sample, the producer's statistics and ``tokens``
(EAGLE-3: ``supervised_tokens``, and with the target's logits at hand
``mean_entropy`` and ``mean_top1``). They are read from the shard headers only,
so ``speccache inspect --stats`` costs one header read per shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from speccache.format import Manifest, NativeShard, existing_shard_indices, shard_path
from speccache.format.view import View, is_view

__all__ = ["cache_sample_stats", "histogram"]


def cache_sample_stats(cache_dir: str) -> dict[str, list[Any]]:
    """Every per-sample statistic of the cache's shards (or of the samples a view selects), in sample order.

    A statistic some shard lacks (written before statistics existed) is absent.

    Raises:
        CacheFormatError, CacheCorruptError: no manifest, or a shard that does not match it; for a view, a
            source that changed or vanished.
    """
    if is_view(cache_dir):
        view = View.read(cache_dir)
        per_source = [cache_sample_stats(view.source_dir(i)) for i in range(len(view.sources))]
        names = set.intersection(*(set(stats) for stats in per_source)) if per_source else set()
        return {
            name: [v for source, start, end in view.runs for v in per_source[source][name][start:end]]
            for name in sorted(names)
        }
    manifest = Manifest.read(cache_dir)
    present = existing_shard_indices(cache_dir)
    out: dict[str, list[Any]] | None = None
    for index in range(manifest.num_shards):
        if index not in present:
            break  # an unsealed cache: its contiguous prefix
        shard = NativeShard(shard_path(cache_dir, index), manifest.schema, index, manifest.shard_samples(index))
        try:
            stats = shard.sample_stats()
        finally:
            shard.close()
        if out is None:
            out = {name: list(values) for name, values in stats.items()}
        else:
            for name in list(out):
                if name in stats:
                    out[name].extend(stats[name])
                else:
                    del out[name]
    return out or {}


def histogram(values: Sequence[float | None], bins: int = 10, width: int = 40) -> list[str]:
    """A text histogram of ``values`` (``None`` counted apart): one line per bin, ``[low, high)  count  bar``."""
    known = [float(v) for v in values if v is not None]
    lines: list[str] = []
    if known:
        low, high = min(known), max(known)
        step = (high - low) / bins if high > low else 1.0
        counts = [0] * bins
        for v in known:
            counts[min(int((v - low) / step), bins - 1)] += 1
        most = max(counts)
        for i, count in enumerate(counts):
            bar = "#" * math.ceil(width * count / most) if count else ""
            lines.append(f"  [{low + i * step:>10.4g}, {low + (i + 1) * step:>10.4g})  {count:>8}  {bar}")
    missing = len(values) - len(known)
    if missing:
        lines.append(f"  no value (no supervised position)  {missing}")
    return lines
