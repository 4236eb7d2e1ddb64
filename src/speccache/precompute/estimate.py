"""``speccache estimate``: the size a ``precompute`` would write, without loading the model weights.

The plan (:func:`speccache.precompute.make_plan`) gives the samples exactly as a
run would tokenize them (real tokenizer, chat template, truncation) and the
schema from the model config; sizes follow from the shard layout:

* ``raw`` and ``fp8`` parts have sizes fixed by the row counts, and each shard's
  safetensors header is built by the writer's own code from those shapes, so the
  estimate is exact apart from the digits of measured floats in the shard
  metadata: the fp8 error sums (a few bytes per shard) and, when the run has the
  target's logits at hand, each sample's mean entropy and top-1 probability (a
  few bytes per sample; the counts of the per-sample statistics are exact).
* ``zbf16`` stores the low byte of every value as it is (exact) and the high
  byte (sign and top 7 exponent bits) entropy-coded, so only a range can be given
  for it: :data:`ZBF16_HI_FRACTION` of the high plane's raw size.
* The side files are exact: the method's (embeddings, draft LM-head rows,
  vocabulary maps, in ``--model-dtype``, the dtype the run loads the target in)
  and ``skipped_rows.jsonl``, which the plan's skipped rows give byte for byte.

``estimate`` takes every flag that changes what a run writes: they are defined
once, by :func:`speccache.precompute.command.add_precompute_arguments`, for both
commands. It also reports what the data gave, as ``precompute`` records it: rows
read, truncated and skipped (per reason, each skipped row named ``file:line``).

The bounds of :data:`ZBF16_HI_FRACTION`, from measurements (``zbf16_plane_stats``,
compressed high plane / its raw size): the demo target's aux and final hidden
states 0.341-0.345; synthetic width-4096 bf16 activations: a plain Gaussian 0.336,
Student-t (3 dof) 0.357, Gaussian with lognormal per-channel scales (sigma 0.7)
and x50 outlier channels 0.376, Laplace with per-token scales 0.384, lognormal
per-channel scales with sigma 1.5 (about 2 binades of scale spread) 0.442. The
sign bit alone is 1/8 of the plane and a zero-mean Gaussian's exponent spans
several binades at any scale, which is why no activation-like source came in
under a third; the upper bound leaves room for wider scale spreads than any
measured. Data outside that family (constant rows, or values spread over many
more binades) can fall outside the range; the high plane never exceeds its raw
size (zbf16 stores a chunk raw when zstd would not shrink it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from speccache.data import DataStats, dropped_summary, image_token_id
from speccache.format import (
    DROPPED_FIELDS_FILE,
    OFFSETS_KEY,
    SKIPPED_ROWS_FILE,
    KeySpec,
    Schema,
    get_encoding,
    part_name,
    safetensors_prefix,
)
from speccache.format.shard import shard_metadata
from speccache.methods.decoder import IMAGE_EMBEDS, model_image_token_id
from speccache.methods.eagle3 import CACHE_NAME, Supervision
from speccache.methods.eagle3_producer import sample_stat_names
from speccache.methods.side import tied_metadata, ties_embeddings
from speccache.units import human_bytes

__all__ = [
    "ZBF16_HI_FRACTION",
    "key_parts",
    "estimate_shards",
    "side_file_bytes",
    "estimate_cache",
    "register_commands",
]

ZBF16_HI_FRACTION = (0.30, 0.50)
"""Low and high bound of a zbf16 key's compressed high plane, as a fraction of its raw size (one byte per value)."""

# Typical reprs of a shard's measured error sums: the header holds them as JSON text.
_ERROR_PLACEHOLDER = {"max": 0.03821656050955414, "sq_err": 115.24556454832772, "sq_ref": 173069.4694921707}

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def key_parts(spec: KeySpec, num_samples: int, num_rows: int, data_length: int = 0) -> Layout:
    """Dtypes and shapes of the parts ``spec``'s encoding writes for a shard, as the encoding describes them.

    Args:
        spec: the key.
        num_samples: samples in the shard.
        num_rows: rows of a ragged key in the shard (ignored for a fixed key, which has one row per sample).
        data_length: first dimension of a data-dependent part (a zbf16 key's compressed high plane in bytes, a
            sparse key's stored rows).
    """
    rows = num_rows if spec.ragged else num_samples
    parts = get_encoding(spec.encoding).parts(spec.dtype, spec.shape)
    return {suffix: (p.dtype, p.shape(rows, num_samples, data_length)) for suffix, p in parts.items()}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def estimate_shards(
    schema: Schema,
    lengths: Sequence[int],
    shard_size: int,
    hi_fraction: float | Mapping[str, float],
    sample_stats: Mapping[str, Sequence[Any]] | None = None,
    stored_rows: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Bytes of the native shards holding samples of these lengths, in order.

    Args:
        schema: the key schema.
        lengths: rows (tokens) of each sample.
        shard_size: samples per shard.
        hi_fraction: a zbf16 high plane's compressed size as a fraction of its raw size (one for
            every key, or per key).
        sample_stats: the per-sample statistics the producer records (besides ``tokens``), one value per
            sample (exact for counts; a typical value for the floats, whose digits vary).
        stored_rows: for each key whose encoding keeps some of its rows (``sparse``), the rows it keeps of each
            sample.

    Returns:
        ``keys`` (data bytes per key, as ``speccache inspect`` counts them),
        ``overhead`` (headers and row offsets), ``total`` and ``num_shards``.

    Raises:
        ValueError: a key that keeps some of its rows is missing from ``stored_rows``.
    """
    ragged = any(s.ragged for s in schema.values())
    key_bytes = {name: 0 for name in schema}
    overhead = 0
    num_shards = 0
    for index, start in enumerate(range(0, len(lengths), shard_size)):
        n = min(shard_size, len(lengths) - start)
        rows = int(sum(lengths[start : start + n])) if ragged else 0
        layout: Layout = {OFFSETS_KEY: (torch.int64, (n + 1,))} if ragged else {}
        for name, spec in schema.items():
            if _keeps_rows(spec):
                if stored_rows is None or name not in stored_rows:
                    raise ValueError(f"key {name!r} ({spec.encoding}): give the rows it keeps of each sample")
                data_length = int(sum(stored_rows[name][start : start + n]))
            else:
                values = math.prod(spec.shape) * (rows if spec.ragged else n)
                fraction = hi_fraction if isinstance(hi_fraction, (int, float)) else hi_fraction.get(name, 1.0)
                data_length = min(values, round(fraction * values))
            for suffix, (dtype, shape) in key_parts(spec, n, rows, data_length).items():
                layout[part_name(name, suffix)] = (dtype, shape)
                key_bytes[name] += _nbytes(dtype, shape)
        # The writer's metadata has the same fixed-length checksum strings for any data; empty tensors stand in.
        stand_ins = {name: torch.empty(0, dtype=torch.uint8) for name in layout}
        errors = {name: _ERROR_PLACEHOLDER for name, spec in schema.items() if not get_encoding(spec.encoding).lossless}
        stats = None
        if sample_stats:
            stats = {"tokens": list(lengths[start : start + n])}
            stats.update((name, list(values[start : start + n])) for name, values in sample_stats.items())
        prefix, _ = safetensors_prefix(layout, shard_metadata(index, n, rows, stand_ins, errors, stats))
        overhead += len(prefix) + (_nbytes(*layout[OFFSETS_KEY]) if ragged else 0)
        num_shards += 1
    return {
        "keys": key_bytes,
        "overhead": overhead,
        "total": sum(key_bytes.values()) + overhead,
        "num_shards": num_shards,
    }


def side_file_bytes(
    vocab_size: int,
    draft_vocab_size: int,
    hidden_size: int,
    weight_dtype: torch.dtype,
    cache_name: str = CACHE_NAME,
    tied: bool = False,
) -> int:
    """Bytes of a method's side file: EAGLE-3's (``embed_tokens``, draft ``lm_head`` rows unless ``tied``,
    vocabulary maps) or, for ``cache_name="layers"``, the layer methods' (``embed_tokens`` and, unless
    ``tied``, the whole ``lm_head``)."""
    layout: Layout = {"embed_tokens": (weight_dtype, (vocab_size, hidden_size))}
    metadata = {"speccache_side": cache_name, **tied_metadata(tied)}
    if not tied:
        layout["lm_head"] = (weight_dtype, (draft_vocab_size, hidden_size))
    if cache_name == CACHE_NAME:
        layout |= {
            "selected_token_ids": (torch.int64, (draft_vocab_size,)),
            "d2t": (torch.int64, (draft_vocab_size,)),
            "t2d": (torch.bool, (vocab_size,)),
        }
    prefix, _ = safetensors_prefix(layout, metadata)
    return len(prefix) + sum(_nbytes(*v) for v in layout.values())


# A typical repr of a mean entropy or top-1 probability: the header holds them as JSON text.
_FLOAT_STAT_PLACEHOLDER = 0.6931471805599453


def _sample_stats(plan: Any) -> dict[str, list[Any]] | None:
    """The per-sample statistics an EAGLE-3 run records for these samples (none for other methods)."""
    if plan.cache_name != CACHE_NAME:
        return None
    names = sample_stat_names(
        Supervision.parse(plan.cfg.supervision), plan.method_plan.draft_vocab_size == plan.vocab_size
    )
    masks = plan.samples.loss_mask.astype(np.int64)
    supervised = np.diff(np.concatenate([[0], np.cumsum(masks)])[plan.samples.offsets]).tolist()
    return {
        name: supervised if name == "supervised_tokens" else [_FLOAT_STAT_PLACEHOLDER] * len(supervised)
        for name in names
    }


def _weight_dtype(model_config: Any, model_dtype: str) -> torch.dtype:
    from speccache.devices import DTYPES

    if model_dtype != "auto":
        return DTYPES[model_dtype]
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    dtype = getattr(text, "dtype", None) or getattr(model_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    # A checkpoint that records no dtype loads in torch's default.
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()


def _data_counts(stats: DataStats) -> dict[str, Any]:
    """Every count the plan's data statistics hold (numbers and per-reason or per-field tallies), by name: what
    ``precompute`` records of the data in the manifest's ``stats``, so a new count shows in ``estimate`` unasked."""
    values = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    return {
        name: dict(sorted(v.items())) if isinstance(v, dict) else v
        for name, v in values.items()
        if not isinstance(v, list)
    }


def _image_counts(plan: Any) -> dict[str, int]:
    """A vision-language target's image rows, the images in its samples, and the image tokens they expand to."""
    samples, token = plan.samples, image_token_id(plan.processor)
    tokens = sum(int((samples.arrays(i)[0] == token).sum()) for i in samples.images)
    rows = {int(samples.source_rows[i]) for i in samples.images}
    return {"image_rows": len(rows), "images": sum(map(len, samples.images.values())), "image_tokens": tokens}


def _exact(spec: KeySpec) -> bool:
    """Whether a key's size follows from the counts (no part sized by its bytes' values, as zbf16's is; a
    sparse key's kept rows are counted: :func:`_stored_rows`)."""
    return all(p.length != "bytes" for p in get_encoding(spec.encoding).parts(spec.dtype, spec.shape).values())


def _keeps_rows(spec: KeySpec) -> bool:
    """Whether a key's encoding keeps only some of its rows (a part of length ``"stored"``, as sparse's)."""
    return any(p.length == "stored" for p in get_encoding(spec.encoding).parts(spec.dtype, spec.shape).values())


def _stored_rows(plan: Any) -> dict[str, list[int]]:
    """The rows each sample keeps of its sparse keys: ``image_embeds`` is non-zero at the image tokens (the
    model config's image token id, as precompute finds them) and zero elsewhere."""
    if IMAGE_EMBEDS not in plan.schema:
        return {}
    samples, token = plan.samples, model_image_token_id(plan.model_config)
    at_image = np.concatenate([[0], np.cumsum(samples.input_ids == token)])
    return {IMAGE_EMBEDS: np.diff(at_image[samples.offsets]).tolist()}


def estimate_cache(cfg: Any) -> dict[str, Any]:
    """Predict the size of the cache ``precompute`` would write with ``cfg`` (a :class:`PrecomputeConfig`).

    Loads the model config, tokenizer and data, never the weights.

    Returns:
        ``samples``, ``tokens``, ``num_shards``, ``keys`` (per key: ``encoding``, ``bytes_low``/``bytes_high``,
        ``share_low``/``share_high`` (its part of the shards' bytes) and ``exact``: false for a key whose size
        depends on its values, zbf16's, whose range is a bound),
        ``overhead_bytes``, ``shard_bytes_low``/``_high``, ``side_files`` (bytes of each side file the run writes:
        the method's, stored in ``weight_dtype``, and ``skipped_rows.jsonl`` when a row is skipped),
        ``side_file_bytes`` (the method's side file), ``total_bytes_low``/``_high`` (shards and side files, as the
        precompute summary counts), ``exact`` (every key exact), ``bytes_per_token_low``/``_high`` (shards only,
        as ``inspect`` counts), ``data_stats`` (the counts precompute records of the data: ``rows_read``,
        ``rows_truncated``, ``skipped`` per reason...), ``skipped_rows`` (each skipped row's ``row``, ``where``
        (file:line), ``reason`` and ``detail``, as ``skipped_rows.jsonl`` lists them), ``longest_sample``,
        ``images`` (a vision-language target's only: ``image_rows``, ``images`` in the samples, and the
        ``image_tokens`` they expand to, counted in ``tokens``), ``padded_probs_bytes`` (padded to
        ``--max-length``), ``padded_probs_longest_bytes`` (to the longest sample: what the report and the
        precompute summary compare with; both only for a method that names such a layout, as EAGLE-3 does),
        and ``zbf16_hi_fraction``.

    Raises:
        UsageError, DataError, FileNotFoundError: what ``precompute`` would reject before loading the model.
    """
    from speccache.devices import DTYPES
    from speccache.precompute.report import padded_layout_stats
    from speccache.precompute.run import make_plan

    cfg.check()
    plan = make_plan(cfg)
    lengths = plan.samples.lengths.tolist()
    stats = _sample_stats(plan)
    stored = _stored_rows(plan)
    low = estimate_shards(plan.schema, lengths, cfg.shard_size, ZBF16_HI_FRACTION[0], stats, stored)
    high = estimate_shards(plan.schema, lengths, cfg.shard_size, ZBF16_HI_FRACTION[1], stats, stored)
    weight_dtype = _weight_dtype(plan.model_config, cfg.model_dtype)
    side = side_file_bytes(
        plan.vocab_size,
        plan.method_plan.draft_vocab_size,
        plan.hidden_size,
        weight_dtype,
        plan.cache_name,
        ties_embeddings(plan.model_config),
    )
    data = plan.manifest_config["data"]
    side_files = {plan.side_file: side}
    skipped_jsonl = plan.stats.skipped_rows_jsonl(data)
    if skipped_jsonl:  # precompute writes the file only when a row was skipped
        side_files[SKIPPED_ROWS_FILE] = len(skipped_jsonl)
    dropped_jsonl = plan.stats.dropped_rows_jsonl(data)
    if dropped_jsonl:  # and this one only when a kept row drops a field
        side_files[DROPPED_FIELDS_FILE] = len(dropped_jsonl)
    side_total = sum(side_files.values())
    tokens = sum(lengths)
    itemsize = DTYPES[cfg.dtype].itemsize

    def padded(length: int, key: str) -> dict[str, int]:
        return padded_layout_stats(plan.method, plan.method_plan, plan.hidden_size, itemsize, len(lengths), length, key)

    return {
        "model": cfg.model,
        "data": cfg.data,
        "samples": len(lengths),
        "tokens": tokens,
        "max_length": cfg.max_length,
        "shard_size": cfg.shard_size,
        "num_shards": low["num_shards"],
        "keys": {
            name: {
                "dtype": spec.to_json()["dtype"],
                "shape": list(spec.shape),
                "encoding": spec.encoding,
                "bytes_low": low["keys"][name],
                "bytes_high": high["keys"][name],
                "share_low": low["keys"][name] / low["total"],
                "share_high": high["keys"][name] / high["total"],
                "exact": _exact(spec),
            }
            for name, spec in plan.schema.items()
        },
        "overhead_bytes": low["overhead"],
        "shard_bytes_low": low["total"],
        "shard_bytes_high": high["total"],
        "method": cfg.method,
        "model_dtype": cfg.model_dtype,
        "weight_dtype": str(weight_dtype).removeprefix("torch."),
        "side_file": plan.side_file,
        "side_file_bytes": side,
        "side_files": side_files,
        "total_bytes_low": low["total"] + side_total,
        "total_bytes_high": high["total"] + side_total,
        "exact": all(_exact(spec) for spec in plan.schema.values()),
        "bytes_per_token_low": low["total"] / tokens,
        "bytes_per_token_high": high["total"] / tokens,
        "data_stats": _data_counts(plan.stats),
        "skipped_rows": [
            {"row": r.row, "where": r.where(cfg.data), "reason": r.reason, "detail": r.detail}
            for r in plan.stats.skipped_rows
        ],
        **({"images": _image_counts(plan)} if plan.processor is not None else {}),
        "longest_sample": max(lengths),
        **padded(cfg.max_length, "padded_probs_bytes"),
        **padded(max(lengths), "padded_probs_longest_bytes"),
        "zbf16_hi_fraction": list(ZBF16_HI_FRACTION),
    }


def _span(lo: float, hi: float, fmt: Any = human_bytes) -> str:
    return fmt(lo) if lo == hi else f"{fmt(lo)} - {fmt(hi)}"


def _percent(share: float) -> str:
    return f"{share:.1%}"


def _count(value: Any) -> str:
    """A count of the data statistics as text: a number, or a tally ``name n, name n``."""
    if isinstance(value, dict):
        return ", ".join(f"{name} {n}" for name, n in value.items()) or "none"
    return str(value)


_LISTED_ROWS = 10  # skipped rows named per reason in the text report (--json lists every one)


def _data_lines(est: Mapping[str, Any]) -> list[str]:
    """What the data gave: rows read, skipped (per reason, naming the rows), and every other count."""
    counts = dict(est["data_stats"])
    skipped = counts.pop("skipped", {})
    lines = [
        f"rows       {counts.pop('rows_read')} read: {est['samples']} samples, "
        f"{counts.pop('rows_truncated')} truncated to --max-length, {sum(skipped.values())} skipped"
        + (f" (precompute lists them in {SKIPPED_ROWS_FILE})" if skipped else "")
    ]
    for reason, n in skipped.items():
        rows = [r["where"] for r in est["skipped_rows"] if r["reason"] == reason]
        more = f", ... ({n} in all; --json lists every row)" if n > _LISTED_ROWS else ""
        lines.append(f"skipped    {reason} {n}: {', '.join(rows[:_LISTED_ROWS])}{more}")
    dropped = dropped_summary(counts.pop("dropped", {}))
    if dropped:
        lines.append(f"dropped    {dropped}")
    # any other count the run records of the data shows here
    lines += [f"{name:<10} {_count(value)}" for name, value in counts.items()]
    return lines


def format_estimate(est: Mapping[str, Any]) -> str:
    """The human-readable report of :func:`estimate_cache`."""
    tokens = est["tokens"]
    per_token = lambda b: f"{b / tokens:.1f}"  # noqa: E731
    lines = [
        f"estimate   {est['samples']} samples, {tokens} tokens (max length {est['max_length']}) "
        f"in {est['num_shards']} shards of {est['shard_size']}",
        f"{'key':<20} {'dtype':<10} {'shape':<10} {'encoding':<9} {'bytes':>21} {'B/token':>13} {'share':>11}",
    ]
    for name, k in est["keys"].items():
        lines.append(
            f"{name:<20} {k['dtype']:<10} {str(k['shape']):<10} {k['encoding']:<9} "
            f"{_span(k['bytes_low'], k['bytes_high']):>21} {_span(k['bytes_low'], k['bytes_high'], per_token):>13} "
            f"{_span(k['share_low'], k['share_high'], _percent):>11}" + ("" if k["exact"] else "  (a bound)")
        )
    lines.append(
        f"{'headers, offsets':<51} {human_bytes(est['overhead_bytes']):>21} {per_token(est['overhead_bytes']):>13}"
    )
    lo, hi = est["zbf16_hi_fraction"]
    side = ", ".join(f"{name} {human_bytes(size)}" for name, size in est["side_files"].items())
    lines += [
        f"shards     {_span(est['shard_bytes_low'], est['shard_bytes_high'])} "
        f"({_span(est['bytes_per_token_low'], est['bytes_per_token_high'], lambda b: f'{b:.1f}')} bytes/token)",
        f"side files {side} (weights in {est['weight_dtype']}, --model-dtype {est['model_dtype']})",
        f"total      {_span(est['total_bytes_low'], est['total_bytes_high'])}"
        + (
            ""
            if est["exact"]
            else f": a bound, not a prediction: a zbf16 key's size depends on its values (its high bytes are taken "
            f"as {lo:.0%}-{hi:.0%} of their raw size)"
        ),
        *_data_lines(est),
    ]
    if "images" in est:
        images = est["images"]
        lines.append(
            f"images     {images['image_rows']} image rows, {images['images']} images, "
            f"{images['image_tokens']} image tokens (of the {tokens} tokens)"
        )
    if "padded_probs_longest_bytes" in est:  # a method that names a padded layout
        padded = est["padded_probs_longest_bytes"]
        lines.append(
            f"padded full-probability layout (to the longest sample, {est['longest_sample']} tokens) would take "
            f"{human_bytes(padded)} "
            f"({_span(padded / est['total_bytes_high'], padded / est['total_bytes_low'], lambda r: f'{r:.1f}x')} "
            "the size of this cache)"
        )
    return "\n".join(lines)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Run ``speccache estimate``."""
    from speccache.precompute.config import PrecomputeConfig

    est = estimate_cache(PrecomputeConfig.from_args(args))
    print(json.dumps(est, indent=2) if args.json else format_estimate(est))
    return 0


def register_commands(sub: Any) -> None:
    """Add ``estimate`` to the CLI."""
    from speccache.precompute.command import add_precompute_arguments

    p = sub.add_parser("estimate", help="predict a precompute's cache size without loading the model weights")
    add_precompute_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_estimate, out="")  # an estimate writes nothing: its config has no output directory
