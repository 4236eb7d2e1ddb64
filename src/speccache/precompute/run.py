"""``speccache precompute``: run a Hugging Face target over a chat dataset and write an EAGLE-3 or layers cache.

Everything that can be checked without the model (paths, flags, the model
config, the data) is checked first (:class:`~speccache.precompute.config.PrecomputeConfig`, then
:func:`make_plan`), so a bad invocation fails in seconds and writes nothing. The run then follows
:class:`speccache.cache_writer.CacheWriter` (lock, checks, side file, unsealed manifest, shards, seal), alone or
under ``torchrun``. The method and the engine are looked up in their registries and called through their
protocols: this module names neither.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.data import DataLoader

from speccache.data import (
    DataStats,
    TokenizedSamples,
    chat_format,
    file_content_hash,
    image_root_of,
    is_hub_id,
    load_chat_tokenizer,
    load_processor,
    load_samples,
    merge_parts,
    processor_record,
    tokenizer_hash,
    vision_processor_class,
)
from speccache.devices import DTYPES
from speccache.engines.base import Engine
from speccache.engines.registry import engine_class
from speccache.errors import DataError, SpeccacheError, UsageError
from speccache.format import (
    DROPPED_FIELDS_FILE,
    SAMPLE_TURN_KEY,
    SKIPPED_ROWS_FILE,
    Manifest,
    Schema,
    load_manifest_json,
    manifest_path,
    sample_turn_spec,
    shard_samples,
)
from speccache.methods.base import (
    LoadedTarget,
    Method,
    MethodPlan,
    MethodTarget,
    PrePass,
    model_config_hash,
    text_config,
)
from speccache.methods.decoder import model_image_token_id
from speccache.methods.finite import SKIP_REASON, ClearedCounter
from speccache.methods.registry import method_for
from speccache.precompute._tokens import ImageInputs, batch_pad_id, sample_length, token_loader
from speccache.precompute.append import DATA_FIELDS, AppendPlan, merge_stats, plan_append
from speccache.precompute.config import PrecomputeConfig
from speccache.precompute.report import _Progress, computed_tokens, padded_layout_stats, print_summary, resume_line
from speccache.write import (
    CacheWriter,
    Comm,
    DataParallelGroups,
    DiskCap,
    LocalComm,
    SideFile,
    WriteRun,
    compute_shard_runs,
    data_parallel_groups,
)
from speccache.write.loops import shard_batches

__all__ = ["Plan", "default_num_proc", "make_plan", "run_precompute"]

log = logging.getLogger("speccache.precompute")


# ---------------------------------------------------------------------------
# the plan: everything decided before the model is loaded


@dataclass
class Plan:
    """What a run will write, derived from the config, the model config, the tokenizer and the data."""

    cfg: PrecomputeConfig
    model_config: Any
    tokenizer: Any
    samples: TokenizedSamples
    stats: DataStats
    vocab_size: int
    hidden_size: int
    schema: Schema
    manifest_config: dict[str, Any]
    method: Method
    method_plan: MethodPlan
    processor: Any = None  # a vision-language target's (docs/vision.md); None for a text-only one

    @property
    def num_tokens(self) -> int:
        """Tokens in all samples."""
        return self.samples.num_tokens

    @property
    def cache_name(self) -> str:
        """The manifest's ``cache_name``: the method's (``eagle3``, or ``layers`` for every layer method)."""
        return self.method.cache_name

    @property
    def side_file(self) -> str:
        """The method's side file name."""
        return self.method.side_file


def make_plan(cfg: PrecomputeConfig, comm: Comm | None = None) -> Plan:
    """Load the model config and tokenizer, read the data, and decide the schema; the model is not loaded.

    Raises:
        FileNotFoundError: the model config cannot be loaded from ``--model``.
        ValueError: aux layers, draft vocab size or encodings do not fit the model.
        DataError: the data has no usable row, or a malformed row.
    """
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(cfg.model)
    except OSError as exc:  # a missing "dir/name" path looks like a hub id; a directory may lack config.json
        raise FileNotFoundError(
            f"--model {cfg.model}: no model directory or loadable model config there ({exc})"
        ) from exc
    engine_class(cfg.engine).check_model(cfg, model_config, (comm or LocalComm()).world_size)
    method = method_for(cfg.method)
    method_plan = method.plan(cfg, model_config, DTYPES[cfg.dtype])
    schema = dict(method_plan.schema)
    tokenizer = load_chat_tokenizer(cfg.model, cfg.chat_template)
    vocab_size, hidden = int(text_config(model_config).vocab_size), int(text_config(model_config).hidden_size)
    fmt = chat_format(
        tokenizer,
        cfg.chat_template,
        cfg.reasoning,
        cfg.system_prompt,
        _pinned_date(cfg),
        tools_file=cfg.tools,
        turns=cfg.turns,
        expand_turns=cfg.expand_turns,
    )
    if cfg.expand_turns:
        schema[SAMPLE_TURN_KEY] = sample_turn_spec()
    processor = load_processor(cfg.model, cfg.min_pixels, cfg.max_pixels) if os.path.isdir(cfg.model) else None
    samples, stats = _load_data(cfg, tokenizer, fmt, processor, comm or LocalComm())
    if not samples:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.skipped.items())) or "none skipped"
        raise DataError(
            f"--data {cfg.data}: no usable row ({stats.rows_read} read; skipped: {reasons}). "
            'Check the file\'s format (docs/data.md, "Row forms").'
        )
    manifest_config = {
        "method": cfg.method,
        "model": os.path.abspath(cfg.model) if os.path.exists(cfg.model) else cfg.model,
        "model_config_hash": model_config_hash(model_config),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "data": cfg.data if is_hub_id(cfg.data) else os.path.abspath(cfg.data),
        "data_hash": file_content_hash(cfg.data, cfg.data_split),
        **({"data_split": cfg.data_split} if cfg.data_split is not None else {}),
        "max_length": cfg.max_length,
        "batch_size": cfg.batch_size,
        "batching": cfg.batching,
        "max_batch_tokens": cfg.max_batch_tokens,
        **method_plan.config,
        "dtype": cfg.dtype,
        "model_dtype": cfg.model_dtype,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "encodings": {k: s.encoding for k, s in schema.items() if s.encoding != "raw"},
        "limit": cfg.limit,
        "skip_bad_rows": cfg.skip_bad_rows,
        "chat_template_hash": None if fmt is None else xxhash.xxh3_128_hexdigest(fmt.template.encode()),
        "system_prompt": cfg.system_prompt,
        "reasoning": cfg.reasoning,
        "chat_date": fmt.date if fmt is not None and fmt.uses_date else None,
        "nonfinite": cfg.nonfinite,
        # recorded only when set, so that caches written before these options resume unchanged
        **({"tools_hash": _json_hash(fmt.tools)} if fmt is not None and fmt.tools is not None else {}),
        **({"turns": cfg.turns} if cfg.turns != "all" else {}),
        **({"expand_turns": True} if cfg.expand_turns else {}),
        **({"on_dropped": cfg.on_dropped} if cfg.on_dropped != "warn" else {}),
        # chunks change the features' rounding, as batches do: a resume computes the same ones
        **({"prefill_chunk": cfg.prefill_chunk} if cfg.prefill_chunk is not None else {}),
        "engine": cfg.engine,
        **({"vision": _vision_config(cfg, processor, model_config)} if processor is not None else {}),
    }
    return Plan(
        cfg,
        model_config,
        tokenizer,
        samples,
        stats,
        vocab_size,
        hidden,
        schema,
        manifest_config,
        method,
        method_plan,
        processor,
    )


def _vision_config(cfg: PrecomputeConfig, processor: Any, model_config: Any) -> dict[str, Any]:
    """What makes a vision-language target's pixels and finds its images, and the id of its image tokens (the
    manifest's ``config.vision``)."""
    return {
        **processor_record(processor).as_dict(),
        "image_root": os.path.abspath(image_root_of(cfg.data, cfg.image_root)),
        "image_token_id": model_image_token_id(model_config),
    }


def _load_data(
    cfg: PrecomputeConfig, tokenizer: Any, fmt: Any, processor: Any, comm: Comm
) -> tuple[TokenizedSamples, DataStats]:
    """Tokenize the data; under torchrun (without --limit) each rank reads every world_size-th row, then all join."""
    kwargs = dict(
        skip_bad_rows=cfg.skip_bad_rows,
        fmt=fmt,
        num_proc=cfg.num_proc or default_num_proc(),
        split=cfg.data_split,
        on_dropped=cfg.on_dropped,
        processor=processor,
        image_root=cfg.image_root,
    )
    if comm.world_size == 1 or cfg.limit is not None:
        return load_samples(cfg.data, tokenizer, cfg.max_length, limit=cfg.limit, **kwargs)
    try:
        mine: Any = load_samples(cfg.data, tokenizer, cfg.max_length, part=(comm.rank, comm.world_size), **kwargs)
    except DataError as e:
        mine = e
    parts = comm.all_gather(mine)
    errors = [p for p in parts if isinstance(p, BaseException)]
    if errors:  # every rank raises the error of the first bad row in the file
        raise min(errors, key=lambda e: getattr(e, "row", -1))
    return merge_parts(parts)


def default_num_proc() -> int:
    """``--num-proc`` by default: this rank's share of the cores, at most 8."""
    per_rank = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, per_rank))


def _pinned_date(cfg: PrecomputeConfig) -> str | None:
    """The date a resumed run's template renders: the one its manifest recorded (None: today's)."""
    if not (cfg.resume or cfg.append) or not cfg.out or not os.path.exists(manifest_path(cfg.out)):
        return None
    try:
        return load_manifest_json(manifest_path(cfg.out)).get("config", {}).get("chat_date")
    except (OSError, SpeccacheError, AttributeError):
        return None  # the writer's own checks report an unreadable manifest


def _json_hash(value: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(value, sort_keys=True, ensure_ascii=True).encode())


# ---------------------------------------------------------------------------
# running


def run_precompute(cfg: PrecomputeConfig, comm: Comm | None = None, progress: bool = True) -> Manifest:
    """Write the cache of ``cfg.method`` with ``cfg.engine``; returns the sealed manifest.

    The method (:mod:`speccache.methods.registry`) plans the schema and what it reads of the target, and runs
    its pre-pass; the engine (:mod:`speccache.engines.registry`) loads the target and computes those states;
    the method turns them into rows, which the writer stores.

    An engine whose ranks compute each batch together (its ``group_size``, e.g. ``--shard-target tp``'s groups
    of ``--tp-size``) has every rank of a group compute the group's batches (the forward is a collective of the
    group) and the group's first rank write them.

    Args:
        cfg: the settings; checked first (:meth:`PrecomputeConfig.check`) unless they passed already.
        comm: the process group (default: this process alone).
        progress: show the progress bar and the summary line (rank 0).

    Raises:
        CacheExistsError, ConfigMismatchError, CacheLockedError: the output directory cannot be used (nothing changed).
        UsageError: a bad setting (nothing written).
        DataError, ValueError: bad data (nothing written).
    """
    cfg.check()
    vision = vision_processor_class(cfg.model) if os.path.isdir(cfg.model) else None
    if vision is not None:
        check_vision_run(cfg, vision)
    comm = comm or LocalComm()
    engine = engine_class(cfg.engine)(cfg, comm)
    plan = make_plan(cfg, comm)
    groups = data_parallel_groups(comm, engine.group_size)
    extension = plan_append(cfg.out, plan.manifest_config, len(plan.samples), cfg.shard_size) if cfg.append else None
    writer = None if groups.writers is None else _cache_writer(cfg, plan, extension, groups.writers)
    groups.from_writer(None if writer is None else writer.preflight)
    method, method_plan = plan.method, plan.method_plan
    prepass = PrePass(plan.samples, plan.tokenizer, cfg.shard_size, comm, cfg.out if extension is not None else None)
    prepared = method.prepare(method_plan, prepass)
    try:
        loaded = engine.open(method_plan.request, groups, int(np.diff(plan.samples.offsets).max()))
        target = method.target(method_plan, loaded, engine.capture, prepared, DTYPES[cfg.dtype], cfg.nonfinite)
        batches = _batches(cfg, plan, extension, target, comm, groups)
        if writer is None:  # a tensor-parallel rank that computes its group's batches for the group's writer
            shards: list[int] = groups.from_writer(None)
            compute_shard_runs(
                batches.loader,
                cfg.out,
                cfg.shard_size,
                shards,
                batches.compute,
                _discard,
                log,
                shard_plan=batches.shard_plan,
            )
            comm.max_int(0)  # returns once every writer has sealed the cache
            return Manifest.read(cfg.out)
        started = time.monotonic()
        side_files = _side_files(plan, extension, loaded, prepared)
        _write_shards(cfg, plan, extension, writer, groups, batches, side_files, engine, progress and comm.rank == 0)
    finally:
        engine.close()
    if groups.size > 1:
        comm.max_int(0)  # the group's other ranks return once the cache is sealed
    if comm.rank == 0 and progress:
        print_summary(writer.manifest, time.monotonic() - started, writer.cap)
    return writer.manifest


def check_vision_run(cfg: PrecomputeConfig, vision: str) -> None:
    """Refuse, before anything is read, what a vision-language target (processor class ``vision``) is not run
    with here: ``--append``; each engine refuses its own settings (``check_model``).

    Raises:
        UsageError: the flag that is refused, and what to use instead.
    """
    target = f"--model {cfg.model} is a vision-language target ({vision})"
    if cfg.append:
        raise UsageError(f"{target}: --append does not extend its caches yet; write a new cache (--out)")


def _cache_writer(cfg: PrecomputeConfig, plan: Plan, extension: AppendPlan | None, writers: Comm) -> CacheWriter:
    """The writer of a rank that writes (``writers``: the ranks that do): of a new cache, or of an append."""
    return CacheWriter(
        cfg.out,
        cache_name=plan.cache_name,
        schema=plan.schema,
        shard_size=cfg.shard_size,
        num_samples=len(plan.samples) if extension is None else extension.num_samples,
        config=plan.manifest_config if extension is None else extension.config,
        resume=cfg.resume,
        comm=writers,
        append_fields=None if extension is None else DATA_FIELDS,
        cap=DiskCap(cfg.out, cfg.max_cache_bytes, cfg.max_cache_shards)
        if cfg.max_cache_bytes or cfg.max_cache_shards
        else None,
        command=cfg.argv,
    )


@dataclass(frozen=True)
class _Batches:
    """What a rank computes its shards with (the arguments of ``compute_shard_runs``).

    Attributes:
        loader: the padded token batches.
        compute: the rows of a batch.
        shard_plan: the batches of a shard's samples, longest first (``--batching sorted``); ``None``: in order.
        lockstep: the step barrier of a forward that is a collective of all ranks, else ``None``.
        ragged: the schema's ragged keys.
    """

    loader: DataLoader
    compute: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    shard_plan: Callable[[int, int], list[list[int]]] | None
    lockstep: Callable[[int], int] | None
    ragged: list[str]


def _batches(
    cfg: PrecomputeConfig,
    plan: Plan,
    extension: AppendPlan | None,
    target: MethodTarget,
    comm: Comm,
    groups: DataParallelGroups,
) -> _Batches:
    """How this rank computes its shards of ``plan`` with the method's ``target``."""
    images = None
    if plan.processor is not None:
        images = ImageInputs(plan.processor, cfg.data, cfg.data_split, plan.manifest_config["vision"]["image_root"])
    loader = token_loader(plan.samples, extension, cfg.batch_size, batch_pad_id(plan.tokenizer), images)
    sorted_plan = functools.partial(_sorted_shard_plan, loader, cfg) if cfg.batching == "sorted" else None
    # A forward that is a collective of all ranks (fsdp) needs every rank to take the same number of steps;
    # a tensor-parallel forward is a collective of its group, whose ranks all compute the same batches.
    lockstep = comm.max_int if comm.world_size > 1 and groups.size == 1 else None
    ragged = [k for k, s in plan.schema.items() if s.ragged]
    return _Batches(loader, _row_maker(target, plan.schema), sorted_plan, lockstep, ragged)


def _row_maker(target: MethodTarget, schema: Schema) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The method's rows of a batch, with each sample's turn where the schema records it (``--expand-turns``)."""
    if SAMPLE_TURN_KEY not in schema:
        return target.compute_batch
    return lambda batch: {**target.compute_batch(batch), SAMPLE_TURN_KEY: batch[SAMPLE_TURN_KEY]}


def _sorted_shard_plan(loader: DataLoader, cfg: PrecomputeConfig, start: int, end: int) -> list[list[int]]:
    """The batches of the samples ``[start, end)`` (a shard), longest first."""
    lengths = [sample_length(loader.dataset, i) for i in range(start, end)]
    return [[start + i for i in b] for b in shard_batches(lengths, cfg.batch_size, cfg.max_batch_tokens)]


def _side_files(plan: Plan, extension: AppendPlan | None, loaded: LoadedTarget, prepared: Any) -> tuple[SideFile, ...]:
    """The method's side file, and the lists of skipped rows and dropped fields where a row was skipped or
    dropped one (of the whole cache: an append's earlier data files' rows first)."""
    method, method_plan = plan.method, plan.method_plan
    side_file = SideFile(
        plan.side_file,
        lambda: method.side_tensors(method_plan, loaded, prepared),
        {"speccache_side": plan.cache_name, **method_plan.side_metadata},
    )
    skipped = plan.stats.skipped_rows_jsonl(plan.manifest_config["data"])
    if extension is not None:  # the rows of the cache's earlier data files, then this file's
        skipped = extension.skipped_before + skipped
    # skipped_rows.jsonl is written only when a row was skipped, so a clean dataset's cache has no empty file.
    skipped_file = SideFile(SKIPPED_ROWS_FILE, content=lambda: skipped, rewritten_on_append=True)
    side_files: tuple[SideFile, ...] = (side_file, skipped_file) if skipped else (side_file,)
    dropped = plan.stats.dropped_rows_jsonl(plan.manifest_config["data"])
    if extension is not None:
        dropped = extension.dropped_before + dropped
    if dropped:  # like skipped_rows.jsonl, only when a kept row drops a field
        side_files += (SideFile(DROPPED_FIELDS_FILE, content=lambda: dropped, rewritten_on_append=True),)
    return side_files


def _write_shards(
    cfg: PrecomputeConfig,
    plan: Plan,
    extension: AppendPlan | None,
    writer: CacheWriter,
    groups: DataParallelGroups,
    batches: _Batches,
    side_files: tuple[SideFile, ...],
    engine: Engine,
    show: bool,
) -> None:
    """Compute and write the shards this rank's group still lacks, and seal the cache with the run's stats
    (``show``: the resume line and the progress bar)."""
    comm = writer.comm
    with contextlib.ExitStack() as stack:
        opened: list[WriteRun] = []

        def begin() -> list[int]:  # run by from_writer, so that a refusal to write reaches the group's every rank
            opened.append(stack.enter_context(writer.writing(side_files=side_files)))
            return opened[0].shards

        groups.from_writer(begin)  # the group's other ranks compute the same shards
        run = opened[0]
        todo_samples = sum(shard_samples(i, writer.manifest.num_samples, cfg.shard_size) for i in run.shards)
        if cfg.resume:
            todo = comm.sum_tensor(torch.tensor([len(run.shards), todo_samples])).tolist()
            # --resume on a new directory (as the demo runs every step) keeps nothing: nothing to report
            if show and todo[0] < writer.manifest.num_shards:
                print(resume_line(cfg.out, writer.manifest, *todo), flush=True)
        bar = _Progress(todo_samples, show, writer.shard_writer.records)
        cleared = ClearedCounter(run.write_shard)
        cleared.count_kept(cfg.out, plan.schema, sorted(set(writer.local_shards) - set(run.shards)))
        try:
            compute_shard_runs(
                batches.loader,
                cfg.out,
                cfg.shard_size,
                run.shards,
                batches.compute,
                cleared.write_shard,
                log,
                ragged_keys=batches.ragged,
                sync_max_steps=batches.lockstep,
                on_batch=bar.on_batch,
                shard_plan=batches.shard_plan,
            )
        finally:
            bar.close()
        run.stats = _run_stats(cfg, plan, extension, engine.pads)
        # counted over every shard of the cache (an append's too): a total, not a sum
        nonfinite = int(comm.sum_tensor(torch.tensor([cleared.total], dtype=torch.int64))[0])
        if nonfinite or cfg.nonfinite == "skip":
            run.stats.setdefault("skipped_rows", {})[SKIP_REASON] = nonfinite
        run.stats.update(engine.record())


def _run_stats(cfg: PrecomputeConfig, plan: Plan, extension: AppendPlan | None, pads: bool) -> dict[str, Any]:
    """The manifest's ``stats`` of the data and the samples (of the whole cache, for an append), and the padded
    layout's size that the summary compares with (when the method names one)."""
    itemsize = DTYPES[cfg.dtype].itemsize

    def padded(num_samples: int, length: int, key: str) -> dict[str, int]:
        return padded_layout_stats(plan.method, plan.method_plan, plan.hidden_size, itemsize, num_samples, length, key)

    stats: dict[str, Any] = {
        "rows_read": plan.stats.rows_read,
        "skipped_rows": dict(sorted(plan.stats.skipped.items())),
        "rows_truncated": plan.stats.rows_truncated,
        **({"dropped_fields": dict(sorted(plan.stats.dropped.items()))} if plan.stats.dropped else {}),
        "samples": len(plan.samples),
        "tokens": plan.num_tokens,
        "computed_tokens": computed_tokens(plan.samples.lengths.tolist(), cfg) if pads else plan.num_tokens,
        **padded(len(plan.samples), cfg.max_length, "padded_probs_bytes"),
        "longest_sample": int(plan.samples.lengths.max()),
    }
    if extension is not None:
        stats = merge_stats(extension.stats_before, stats)
    if "longest_sample" in stats:  # of the whole cache, an append's too
        stats.update(padded(stats["samples"], stats["longest_sample"], "padded_probs_longest_bytes"))
    return stats


def _discard(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
    """The shard writer of a rank whose group's first rank writes: the group computed the shard, one rank keeps it."""
    return ""
