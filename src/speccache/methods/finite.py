"""The non-finite guard: every float feature of every sample is checked for NaN/Inf before it is written.

A producer calls :func:`guard_nonfinite` on its ragged rows while they are still
on the compute device, before the copy to the host. The common case (all finite)
costs one ``aminmax`` per float key and one host sync for the whole batch:
``aminmax`` propagates NaN and reports +-Inf, so a non-finite value anywhere
shows in the two numbers, and nothing of the size of the features is allocated.
Only a batch that has a non-finite value is searched sample by sample.

``--nonfinite fail`` raises :class:`speccache.errors.NonFiniteFeatureError`
naming the sample, its source row, the key, the layer and the token position.
``--nonfinite skip`` keeps the sample's slot (shard ``i`` still holds samples
``[i * shard_size, ...)``, so resumed and distributed runs write the same bytes)
but zeroes its features (every key but ``input_ids`` and its fixed integer keys) and clears its ``loss_mask``: a trainer
reads a sample with no supervised position, which contributes nothing to the
loss. Every planned sample has at least one supervised token (rows without one
are dropped before planning), so a stored sample whose ``loss_mask`` is all
false is exactly a skipped one: :func:`count_cleared` counts them from the
shards themselves (and a reclaimed shard's record, written before the file went), which is what makes the
count exact across resumes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

import torch

from speccache.errors import NonFiniteFeatureError, UsageError
from speccache.format import LENGTHS_KEY, NativeShard, Schema, shard_path
from speccache.format.reclaim import read_reclaims
from speccache.format.shard import count_unsupervised

__all__ = [
    "NONFINITE_MODES",
    "SKIP_REASON",
    "ClearedCounter",
    "check_nonfinite_mode",
    "count_cleared",
    "guard_nonfinite",
]

NONFINITE_MODES = ("fail", "skip")
SKIP_REASON = "nonfinite"
"""The reason under which skipped samples are counted in the manifest's ``stats["skipped_rows"]``."""

KEPT_ON_SKIP = frozenset({"input_ids"})
"""Keys a skipped sample keeps: its tokens (so it can still be identified); every other ragged key and every
float key is zeroed, fixed per-sample integers (its source row) are kept."""

Where = tuple[str, int, int]
"""``(key, token position, column)`` of a sample's first non-finite value."""

LayerOf = Callable[[str, int], str]
"""``(key, column) -> where the value comes from`` (e.g. ``decoder layer 3 output``), for error messages."""


def check_nonfinite_mode(mode: str) -> str:
    """Return ``mode`` if it is ``fail`` or ``skip``.

    Raises:
        ValueError: anything else; names the flag and the choices.
    """
    if mode not in NONFINITE_MODES:
        raise UsageError(f"--nonfinite {mode!r} is unknown; choose one of {', '.join(NONFINITE_MODES)}")
    return mode


def _offsets(value: torch.Tensor, offsets: list[int]) -> list[int]:
    # A ragged key has a row per token, a fixed per-sample key a row per sample (identical when every sample is
    # one token long, so the test on the row count is exact).
    return offsets if value.shape[0] == offsets[-1] else list(range(len(offsets)))


def _first_nonfinite(rows: Mapping[str, torch.Tensor], offsets: list[int], keys: Sequence[str]) -> dict[int, Where]:
    """Per offending sample (position in the batch): the first key, token position and column that is not finite."""
    found: dict[int, Where] = {}
    for key in keys:
        starts = _offsets(rows[key], offsets)
        bad = ~torch.isfinite(rows[key].reshape(rows[key].shape[0], -1))
        for row in bad.any(1).nonzero().flatten().tolist():
            sample = bisect.bisect_right(starts, row) - 1
            if sample not in found:
                found[sample] = (key, row - starts[sample], int(bad[row].nonzero()[0, 0]))
    return found


def guard_nonfinite(
    rows: dict[str, torch.Tensor],
    mode: str,
    layer_of: LayerOf,
    sample_ids: Sequence[int] | torch.Tensor | None = None,
    source_rows: Sequence[int] | torch.Tensor | None = None,
) -> int:
    """Check every float key of a computed batch; fail or clear the samples that are not finite.

    Args:
        rows: ragged rows of one batch with ``__lengths__`` (on the compute device); edited in place on ``skip``.
        mode: ``fail`` or ``skip``.
        layer_of: names where a key's column comes from, for the message.
        sample_ids: the batch's sample indices in the cache (for the message; a batch's ``sample_index``).
        source_rows: the batch's rows in the data file (for the message; a batch's ``source_row``).

    Returns:
        The number of samples cleared (always 0 with ``fail``).

    Raises:
        NonFiniteFeatureError: ``fail`` and a feature is NaN or Inf.
    """
    keys = [k for k, v in rows.items() if k != LENGTHS_KEY and v.is_floating_point() and v.numel()]
    if not keys:
        return 0
    # One host sync for the whole batch; a key's min and max are finite exactly when all its values are.
    extremes = torch.stack([torch.stack(torch.aminmax(rows[k])).float() for k in keys])
    if bool(torch.isfinite(extremes).all()):
        return 0
    lengths = rows[LENGTHS_KEY].tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    found = _first_nonfinite(rows, offsets, keys)
    if mode == "fail":
        sample, (key, position, column) = min(found.items())
        where = f"sample {int(sample_ids[sample])}" if sample_ids is not None else f"batch item {sample}"
        row = f" (data row {int(source_rows[sample])})" if source_rows is not None else ""
        raise NonFiniteFeatureError(
            f"{where}{row}: {key} is not finite (NaN or Inf) at token {position}, column {column}, from "
            f"{layer_of(key, column)}; {len(found)} sample(s) of this batch are affected. Check the target's dtype "
            "(--model-dtype fp32 rules out fp16 overflow) and weights, or pass --nonfinite skip to drop such samples"
        )
    for key, value in rows.items():
        if key in KEPT_ON_SKIP or key == LENGTHS_KEY or (value.shape[0] != offsets[-1] and key not in keys):
            continue  # fixed per-sample integers (the source row) describe the sample, not the target
        starts = _offsets(value, offsets)
        for sample in found:
            value[starts[sample] : starts[sample + 1]] = 0
    return len(found)


def count_cleared(rows: Mapping[str, torch.Tensor]) -> int:
    """Samples of a shard's ragged rows (with ``__lengths__``) whose ``loss_mask`` is all false: the skipped ones."""
    return count_unsupervised(rows[LENGTHS_KEY], rows["loss_mask"])


class ClearedCounter:
    """Counts the skipped samples of the shards one rank owns, wherever they come from.

    Shards this run writes are counted as they pass through :meth:`write_shard`
    (a wrapper of the run's ``write_shard``); shards a resume keeps are counted
    from their ``loss_mask`` on disk, or from the reclaim record of one a following trainer deleted or moved
    (:meth:`count_kept`). Summed over ranks, the
    result is the cache's count whatever was interrupted and resumed.

    Args:
        write_shard: the run's ``write_shard_fn``.
    """

    def __init__(self, write_shard: Callable[[str, int, dict[str, torch.Tensor]], str]) -> None:
        self._write_shard = write_shard
        self.counts: dict[int, int] = {}

    def write_shard(self, output_dir: str, index: int, rows: dict[str, torch.Tensor]) -> str:
        """Count, then write (same signature as the wrapped function)."""
        self.counts[index] = count_cleared(rows)
        return self._write_shard(output_dir, index, rows)

    def count_kept(self, cache_dir: str, schema: Schema, indices: Sequence[int]) -> None:
        """Count the shards ``indices`` a resume kept: from the file (checked when the resume kept it), or, for a
        shard a following trainer reclaimed (deleted or moved after use, maybe while this runs), from its reclaim
        record, which is written before the file goes (a record older than the count counts 0).

        Raises:
            FileNotFoundError: a kept shard is gone with no reclaim record.
        """
        reclaims = read_reclaims(cache_dir)
        for index in indices:
            counted = None if index in reclaims else _count_file(shard_path(cache_dir, index), schema, index)
            if counted is None and index not in reclaims:
                reclaims = read_reclaims(cache_dir)  # reclaimed since the resume kept it
                if index not in reclaims:
                    raise FileNotFoundError(
                        f"{shard_path(cache_dir, index)}: a kept shard is gone, with no reclaim record"
                    )
            self.counts[index] = (reclaims[index].cleared or 0) if counted is None else counted

    @property
    def total(self) -> int:
        """Skipped samples counted so far."""
        return sum(self.counts.values())


def _count_file(path: str, schema: Schema, index: int) -> int | None:
    """The cleared samples of the shard file at ``path``; ``None`` when it is gone."""
    try:
        shard = NativeShard(path, schema, index, None)
    except FileNotFoundError:
        return None
    try:
        return shard.unsupervised_samples()
    finally:
        shard.close()
