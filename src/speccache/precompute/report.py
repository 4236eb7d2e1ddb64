"""What a run tells: its progress bar, the resume line, the closing summary and the stats it records."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from speccache.data import dropped_summary
from speccache.format import LENGTHS_KEY, SKIPPED_ROWS_FILE, Manifest
from speccache.methods.base import Method, MethodPlan
from speccache.precompute.config import PrecomputeConfig
from speccache.units import counted, human_bytes
from speccache.write import DiskCap
from speccache.write.loops import shard_batches

__all__ = ["computed_tokens", "padded_layout_stats", "print_summary", "resume_line", "summary_line"]


def padded_layout_stats(
    method: Method, plan: MethodPlan, hidden_size: int, itemsize: int, num_samples: int, length: int, key: str
) -> dict[str, int]:
    """``{key: bytes}`` of the padded layout other tools write for ``method`` (its ``padded_token_bytes``), each
    of ``num_samples`` samples padded to ``length`` tokens; ``{}`` for a method that names no such layout.

    ``stats.padded_probs_bytes`` pads to ``--max-length``, ``padded_probs_longest_bytes`` to the longest sample.
    """
    per_token = getattr(method, "padded_token_bytes", None)
    return {} if per_token is None else {key: num_samples * length * per_token(plan, hidden_size, itemsize)}


def resume_line(out: str, manifest: Manifest, todo_shards: int, todo_samples: int) -> str:
    """What a resume keeps and computes, e.g. ``resuming c: kept 3 of 4 shards (48 samples), computing 1 shard
    (16 samples)``."""
    kept = manifest.num_shards - todo_shards
    shards = "shard" if todo_shards == 1 else "shards"
    computing = f"computing {todo_shards} {shards} ({todo_samples} samples)" if todo_shards else "nothing to compute"
    return (
        f"speccache: resuming {out}: kept {kept} of {manifest.num_shards} shards "
        f"({manifest.num_samples - todo_samples} samples), {computing}"
    )


def computed_tokens(lengths: Sequence[int], cfg: PrecomputeConfig) -> int:
    """Tokens the target computes for samples of these ``lengths`` (padding included), batched as ``cfg`` says."""
    total = 0
    for start in range(0, len(lengths), cfg.shard_size):
        shard = list(lengths[start : start + cfg.shard_size])
        if cfg.batching == "sorted":
            batches = shard_batches(shard, cfg.batch_size, cfg.max_batch_tokens)
        else:
            batches = [
                list(range(i, min(i + cfg.batch_size, len(shard)))) for i in range(0, len(shard), cfg.batch_size)
            ]
        total += sum(len(b) * max(shard[i] for i in b) for b in batches)
    return total


def summary_line(manifest: Manifest, seconds: float) -> str:
    """The closing line of a run: samples, tokens, the size in all and per token (shards alone and with the side
    files), the padded full-probability size for comparison, and the measured error of lossy keys."""
    stats = manifest.stats
    shard_bytes = manifest.total_bytes or 0
    side_bytes = sum(r.bytes for r in manifest.side_files.values())
    total = shard_bytes + side_bytes
    tokens = manifest.num_tokens or 1
    comparison = _padded_comparison(manifest, total)
    skipped = counted(sum((stats.get("skipped_rows") or {}).values()), "row") + " skipped"
    if SKIPPED_ROWS_FILE in manifest.side_files:
        skipped += f", listed in {os.path.join(os.path.dirname(manifest.path), SKIPPED_ROWS_FILE)}"
    dropped = dropped_summary(stats.get("dropped_fields") or {})
    computed = stats.get("computed_tokens")
    work = f" (the target computed {computed / tokens:.2f}x as many with padding)" if computed else ""
    return (
        f"speccache: {counted(manifest.num_samples, 'sample')} ({skipped}{'; ' * bool(dropped)}{dropped}), "
        f"{manifest.num_tokens or 0} "
        f"tokens{work}, {human_bytes(total)} in all ({total / tokens:.0f} bytes/token: shards "
        f"{human_bytes(shard_bytes)}, {shard_bytes / tokens:.0f} bytes/token, + side files {human_bytes(side_bytes)}) "
        f"in {seconds:.1f}s{comparison}"
        + "".join(
            f"; {key} error: relative RMS {e['rms']:.4f}, max {e['max']:.4f} of row amax"
            for key, e in sorted((stats.get("encoding_error") or {}).items())
        )
    )


def _padded_comparison(manifest: Manifest, total: int) -> str:
    """The summary's comparison with the padded full-probability layout its stats record ("" where none)."""
    stats = manifest.stats
    if "padded_probs_longest_bytes" in stats:
        padded = int(stats["padded_probs_longest_bytes"])
        padding = f"padded to the longest sample, {stats['longest_sample']} tokens"
    elif "padded_probs_bytes" in stats:  # a manifest written before the longest sample was recorded (an append)
        padded = int(stats["padded_probs_bytes"])
        padding = f"padded to --max-length, {manifest.config.get('max_length')} tokens"
    else:  # a method that names no padded layout
        return ""
    if not total or not padded:
        ratio = ""
    else:  # a few samples of a target with a large side file can take more than the padded shards
        ratio = f"{padded / total:.1f}x smaller" if padded >= total else f"{total / padded:.1f}x larger"
        ratio = f"; this cache is {ratio} than that"
    return f"; padded full-probability layout ({padding}) would take {human_bytes(padded)}{ratio}"


def print_summary(manifest: Manifest, seconds: float, cap: DiskCap | None) -> None:
    """Print :func:`summary_line` and, for a run under a disk cap, how long it paused there."""
    print(summary_line(manifest, seconds))
    if cap is not None:
        print(
            f"speccache: paused {cap.waited:.1f}s at the disk cap ({cap.pauses} shards waited); "
            f"at most {human_bytes(cap.high_water)} of unconsumed shards seen on disk"
        )


class _Progress:
    """A tqdm bar over this run's samples with its tokens/s and MB/s written in the postfix.

    ``records`` is the writer's shard table, read at each update; the shards it holds at the start (kept by a
    resume, or an append's earlier shards) were not written by this run, so they count in no rate.
    """

    def __init__(self, total: int, enabled: bool, records: dict[int, Any]) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="sample", desc="precompute", disable=not enabled, dynamic_ncols=True)
        self.tokens = 0
        self.records, self.kept = records, set(records)
        self.start = time.monotonic()

    def update(self, samples: int, tokens: int) -> None:
        self.tokens += tokens
        self._rates()
        self.bar.update(samples)

    def on_batch(self, rows: dict[str, torch.Tensor]) -> None:
        """Count a computed batch's samples and tokens (``compute_shard_runs``' ``on_batch``)."""
        self.update(int(rows[LENGTHS_KEY].numel()), int(rows[LENGTHS_KEY].sum()))

    def close(self) -> None:
        """Show the run's rates over its whole time, the last shards' writes included, and close the bar."""
        self._rates()
        self.bar.close()

    def _rates(self) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        written = sum(r.bytes for i, r in list(self.records.items()) if i not in self.kept)
        # shards are written whole in the background: until the first is done there is no rate to show
        bytes_rate = f", {written / elapsed / 1e6:.1f} MB/s written" if written else ""
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.0f} tok/s{bytes_rate}", refresh=False)
