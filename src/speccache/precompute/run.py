"""``speccache precompute``: run a Hugging Face target over a chat dataset and write an EAGLE-3 or layers cache.

Everything that can be checked without the model (paths, flags, the model
config, the data) is checked first, so a bad invocation fails in seconds and
writes nothing. The run then follows :class:`speccache.cache_writer.CacheWriter`
(lock, checks, side file, unsealed manifest, shards, seal), alone or under
``torchrun``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.data import DataLoader, Dataset

from speccache.data import (
    DROPPED_FIELDS_FILE,
    REASONING_MODES,
    SAMPLE_TURN_KEY,
    SKIPPED_ROWS_FILE,
    TURN_MODES,
    DataStats,
    TokenizedSamples,
    chat_format,
    check_dropped_mode,
    check_model_source,
    data_root,
    dropped_summary,
    file_content_hash,
    is_hub_id,
    load_chat_tokenizer,
    load_samples,
    merge_parts,
    sample_turn_spec,
    tokenizer_hash,
)
from speccache.devices import DTYPES, dtype_name, target_device
from speccache.engines.base import add_gpu_memory_utilization_argument, check_gpu_memory_utilization
from speccache.engines.registry import engine_class
from speccache.errors import DataError, SpeccacheError, UsageError
from speccache.format import (
    LENGTHS_KEY,
    Manifest,
    Schema,
    existing_shard_indices,
    load_manifest_json,
    manifest_path,
    shard_samples,
)
from speccache.format.encoding import parse_encodings
from speccache.format.reclaim import read_reclaims
from speccache.methods.base import Method, MethodPlan, PrePass, model_config_hash, text_config
from speccache.methods.finite import SKIP_REASON, ClearedCounter, check_nonfinite_mode
from speccache.methods.layers import parse_layer_ids
from speccache.methods.registry import METHODS, method_for
from speccache.precompute.append import DATA_FIELDS, AppendedDataset, merge_stats, plan_append
from speccache.units import counted, human_bytes, parse_bytes
from speccache.write import (
    CacheWriter,
    Comm,
    DiskCap,
    LocalComm,
    SideFile,
    WriteRun,
    compute_shard_runs,
    data_parallel_groups,
    init_from_env,
    shutdown,
)
from speccache.write.loops import shard_batches

__all__ = [
    "Plan",
    "PrecomputeConfig",
    "TokenizedDataset",
    "add_precompute_arguments",
    "batch_pad_id",
    "check_out_outside_data",
    "computed_tokens",
    "make_plan",
    "pad_tokens",
    "padded_probs_bytes",
    "register_commands",
    "resume_argv",
    "run_precompute",
    "summary_line",
]

log = logging.getLogger("speccache.precompute")


# ---------------------------------------------------------------------------
# arguments


def add_precompute_arguments(p: argparse.ArgumentParser) -> None:
    """The flags shared by ``precompute`` and ``estimate``: every flag that can change what a run writes.

    A new flag that changes a cache's bytes (its samples, keys, dtypes, encodings or side files) belongs here, so
    that ``estimate`` predicts the run it describes; flags of how a run computes go in :func:`register_commands`.
    """
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub id where the network allows)")
    p.add_argument(
        "--data", required=True, help=".jsonl/.json chat data (ShareGPT, OpenAI messages, or input_ids+loss_mask)"
    )
    p.add_argument(
        "--data-split",
        default=None,
        help="the split of a saved DatasetDict or of a hub dataset given to --data as name or org/name (hub: train)",
    )
    p.add_argument("--method", default="eagle3", help=f"speculative method ({', '.join(METHODS)})")
    p.add_argument("--max-length", type=int, default=2048, help="truncate samples to this many tokens (default 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per target forward (default 8)")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="instead of --batch-size: the most padded tokens (samples x the longest) one forward may hold",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="compute samples longer than N tokens N at a time, a KV cache carried across the chunks (bounded "
        "activation memory for long samples; --engine vllm: its chunked prefill, N tokens per step)",
    )
    p.add_argument(
        "--batching",
        choices=["sorted", "ordered"],
        default="sorted",
        help="sorted (default): each shard's samples computed longest first, so batches hold little padding; "
        "ordered: in stored order (what caches written before this option used)",
    )
    p.add_argument(
        "--shard-size", type=int, default=256, help="samples per shard; a multiple of --batch-size (default 256)"
    )
    p.add_argument("--dtype", default="bf16", help="storage dtype of float features: bf16, fp16, fp32 (default bf16)")
    p.add_argument(
        "--model-dtype",
        default="auto",
        help="dtype to run the target in: auto (checkpoint), bf16, fp16, fp32; the side file's weights are stored "
        "in it",
    )
    p.add_argument(
        "--aux-layers", default=None, help="three decoder layer ids, e.g. 1,15,28 (default [1, L//2-1, L-4])"
    )
    p.add_argument(
        "--layers",
        default=None,
        help="layer methods: layer ids to store, e.g. 1,9,17 (-1 the embeddings; default: the preset's)",
    )
    p.add_argument("--last-hidden", action="store_true", help="--method layers: also store last_hidden_state")
    p.add_argument(
        "--last-prenorm", action="store_true", help="layer methods: also store the last layer's output before the norm"
    )
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary size (default: the target's)")
    p.add_argument(
        "--draft-vocab-from",
        default=None,
        metavar="TRAIN_CACHE",
        help="eagle3: take the draft vocabulary from this cache of the same target instead of counting this "
        "data's tokens (a held-out cache that does not leak into the training cache's vocabulary)",
    )
    p.add_argument("--supervision", default="hidden", help="hidden (default), probs, or topk:K")
    p.add_argument(
        "--encode", default="", help="per-feature encodings, e.g. aux_hidden_states=fp8,last_hidden_state=zbf16"
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N usable rows")
    p.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="count and skip rows that fail (malformed, template errors, unplaceable masks) instead of failing",
    )
    p.add_argument(
        "--on-dropped",
        default="warn",
        help="a row whose rendering lacks a field it carries (tool calls, tools, reasoning, a content): warn "
        "(default: kept, counted, listed in dropped_fields.jsonl), skip (left out, counted) or fail",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--system-prompt", default=None, help="a system message added to rows that have none")
    p.add_argument(
        "--num-proc", type=int, default=None, help="tokenizer processes (default: this rank's share of the cores, <= 8)"
    )
    p.add_argument(
        "--reasoning",
        default="keep",
        help="rendered <think> reasoning: keep (trained on, default) or mask (in the input, not in the loss)",
    )
    p.add_argument("--tools", default=None, help="a JSON list of tool schemas rendered for rows that carry no 'tools'")
    p.add_argument(
        "--turns",
        default="all",
        help="assistant turns supervised: all (default) or last (earlier turns are context)",
    )
    p.add_argument(
        "--expand-turns",
        action="store_true",
        help="one sample per assistant turn: the conversation up to it, only it supervised (records sample_turn)",
    )


@dataclass
class PrecomputeConfig:
    """Validated ``precompute`` settings."""

    model: str
    data: str
    out: str
    method: str = "eagle3"
    max_length: int = 2048
    batch_size: int = 8
    max_batch_tokens: int | None = None
    prefill_chunk: int | None = None
    batching: str = "sorted"
    shard_size: int = 256
    dtype: str = "bf16"
    aux_layers: list[int] | None = None
    layers: list[int] | None = None
    last_hidden: bool = False
    last_prenorm: bool = False
    draft_vocab_size: int | None = None
    draft_vocab_from: str | None = None
    supervision: str = "hidden"
    encodings: dict[str, str] = field(default_factory=dict)
    limit: int | None = None
    skip_bad_rows: bool = False
    on_dropped: str = "warn"
    chat_template: str | None = None
    system_prompt: str | None = None
    reasoning: str = "keep"
    tools: str | None = None
    turns: str = "all"
    expand_turns: bool = False
    num_proc: int | None = None
    data_split: str | None = None
    resume: bool = False
    append: bool = False
    device: str | None = None
    timeout: float = 1800.0
    model_dtype: str = "auto"
    nonfinite: str = "fail"
    shard_target: str = "replicate"
    tp_size: int | None = None
    engine: str = "hf"
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float | None = None
    threads: int | None = None
    max_cache_bytes: int | None = None
    max_cache_shards: int | None = None
    argv: list[str] | None = None
    """The command line (``speccache`` left out), recorded in the manifest's ``producer``."""
    _checked: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    """The settings :meth:`check` last passed: checked once, however many entry points check them."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PrecomputeConfig:
        """Build from parsed CLI arguments and check what can be checked without the model.

        Raises:
            UsageError: a bad flag value; the message names the flag and the fix.
            FileNotFoundError: the data file or a local model directory is missing.
        """
        cfg = cls(
            model=args.model,
            data=args.data,
            out=getattr(args, "out", ""),
            method=args.method,
            max_length=args.max_length,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
            prefill_chunk=getattr(args, "prefill_chunk", None),
            batching=args.batching,
            shard_size=args.shard_size,
            dtype=args.dtype,
            aux_layers=parse_layer_ids(args.aux_layers, "--aux-layers"),
            layers=parse_layer_ids(getattr(args, "layers", None), "--layers"),
            last_hidden=getattr(args, "last_hidden", False),
            last_prenorm=getattr(args, "last_prenorm", False),
            draft_vocab_size=args.draft_vocab_size,
            draft_vocab_from=getattr(args, "draft_vocab_from", None),
            supervision=args.supervision,
            encodings=parse_encodings(args.encode),
            limit=args.limit,
            skip_bad_rows=args.skip_bad_rows,
            on_dropped=getattr(args, "on_dropped", "warn"),
            chat_template=getattr(args, "chat_template", None),
            system_prompt=getattr(args, "system_prompt", None),
            reasoning=getattr(args, "reasoning", "keep"),
            tools=getattr(args, "tools", None),
            turns=getattr(args, "turns", "all"),
            expand_turns=getattr(args, "expand_turns", False),
            num_proc=getattr(args, "num_proc", None),
            data_split=getattr(args, "data_split", None),
            resume=getattr(args, "resume", False),
            append=getattr(args, "append", False),
            device=getattr(args, "device", None),
            timeout=getattr(args, "timeout", 1800.0),
            model_dtype=getattr(args, "model_dtype", "auto"),
            nonfinite=getattr(args, "nonfinite", "fail"),
            shard_target=getattr(args, "shard_target", "replicate"),
            tp_size=getattr(args, "tp_size", None),
            engine=getattr(args, "engine", "hf"),
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
            gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
            threads=getattr(args, "threads", None),
            max_cache_bytes=None
            if getattr(args, "max_cache_bytes", None) is None
            else parse_bytes(args.max_cache_bytes, "--max-cache-bytes"),
            max_cache_shards=getattr(args, "max_cache_shards", None),
            argv=getattr(args, "argv", None),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        """Check every setting that needs neither the model nor the data contents, and normalise the dtype names.

        :func:`run_precompute` and :func:`~speccache.precompute.estimate.estimate_cache` run it, so a config built
        by hand meets the command line's refusals; settings unchanged since they passed are not checked again
        (the model check may ask the hub).

        Raises:
            UsageError: a bad setting; the message names its flag and the fix.
            FileNotFoundError, NotADirectoryError: the data, model, template or tools file is missing, or ``out``
                is a file.
            DataError: ``out`` lies inside the data directory.
        """
        if self._checked == self._settings():
            return
        method_for(self.method).check_flags(self)
        check_gpu_memory_utilization(self.gpu_memory_utilization, self.engine)
        check_nonfinite_mode(self.nonfinite)
        self.dtype = dtype_name(self.dtype, "--dtype")
        self.model_dtype = dtype_name(self.model_dtype, "--model-dtype", ("auto", *DTYPES))
        if self.max_length < 2:
            raise UsageError(
                f"--max-length must be >= 2 (a sample needs a token and its successor), got {self.max_length}"
            )
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.batching not in ("sorted", "ordered"):
            raise UsageError(f"--batching {self.batching!r} must be sorted or ordered")
        if self.max_batch_tokens is not None and (self.max_batch_tokens < 1 or self.batching != "sorted"):
            raise UsageError(
                f"--max-batch-tokens {self.max_batch_tokens} must be >= 1, with --batching sorted (the default)"
            )
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk must be >= 1 tokens, got {self.prefill_chunk}")
        if self.shard_size < 1 or self.shard_size % self.batch_size:
            raise UsageError(
                f"--shard-size {self.shard_size} must be a positive multiple of --batch-size {self.batch_size}, "
                "so that a "
                "resumed or distributed run computes exactly the batches of an uninterrupted one"
            )
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be >= 1, got {self.limit}")
        if self.max_cache_shards is not None and self.max_cache_shards < 1:
            raise UsageError(f"--max-cache-shards must be >= 1, got {self.max_cache_shards}")
        if not os.path.exists(self.data) and not is_hub_id(self.data):
            raise FileNotFoundError(f"--data {self.data}: no such file")
        if self.out and not is_hub_id(self.data):
            check_out_outside_data(self.out, data_root(self.data, self.data_split))
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise FileNotFoundError(f"--chat-template {self.chat_template}: no such file")
        if self.tools is not None and not os.path.isfile(self.tools):
            raise FileNotFoundError(f"--tools {self.tools}: no such file")
        if self.turns not in TURN_MODES:
            raise UsageError(f"--turns {self.turns!r} is unknown; choose one of {', '.join(TURN_MODES)}")
        if self.num_proc is not None and self.num_proc < 1:
            raise UsageError(f"--num-proc must be >= 1, got {self.num_proc}")
        if self.reasoning not in REASONING_MODES:
            raise UsageError(f"--reasoning {self.reasoning!r} is unknown; choose one of {', '.join(REASONING_MODES)}")
        check_dropped_mode(self.on_dropped)
        check_model_source(self.model)
        engine_class(self.engine).check_flags(self)
        if self.out and os.path.exists(self.out) and not os.path.isdir(self.out):
            raise NotADirectoryError(f"--out {self.out} is a file; give a directory for the cache")
        self._checked = self._settings()

    def _settings(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if f.init)


def check_out_outside_data(out: str, root: str) -> None:
    """Refuse an output directory inside ``root``, the data directory (or file) that the data hash covers.

    Refused rather than left out of the hash: the hash stays a function of the data alone, which anyone can
    recompute from the dataset, and a cache does not belong among a dataset's files anyway.

    Raises:
        DataError: ``out`` is ``root`` or lies inside it.
    """
    real_out, real_root = os.path.realpath(out), os.path.realpath(root)
    if os.path.commonpath([real_out, real_root]) == real_root:
        raise DataError(
            f"--out {out} lies inside --data {root}, whose files are the data's identity (its hash): the cache's "
            "own files would change it, so the cache could never be resumed or appended to; write the cache "
            f"outside {root}"
        )


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

    @property
    def draft_vocab_size(self) -> int:
        """The vocabulary a draft predicts over (the target's, but for an EAGLE-3 reduced draft vocabulary)."""
        return self.method_plan.draft_vocab_size


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
    samples, stats = _load_data(cfg, tokenizer, fmt, comm or LocalComm())
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
    }
    return Plan(
        cfg, model_config, tokenizer, samples, stats, vocab_size, hidden, schema, manifest_config, method, method_plan
    )


def _load_data(cfg: PrecomputeConfig, tokenizer: Any, fmt: Any, comm: Comm) -> tuple[TokenizedSamples, DataStats]:
    """Tokenize the data; under torchrun (without --limit) each rank reads every world_size-th row, then all join."""
    kwargs = dict(
        skip_bad_rows=cfg.skip_bad_rows,
        fmt=fmt,
        num_proc=cfg.num_proc or default_num_proc(),
        split=cfg.data_split,
        on_dropped=cfg.on_dropped,
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


class TokenizedDataset(Dataset):
    """The tokenized samples as tensors."""

    def __init__(self, samples: TokenizedSamples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples.arrays(index)
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.bool_)),
            "sample_index": torch.tensor(index, dtype=torch.int64),  # names the sample in a non-finite error
            "source_row": torch.tensor(int(self.samples.source_rows[index]), dtype=torch.int64),
            SAMPLE_TURN_KEY: torch.tensor(int(self.samples.turns[index]), dtype=torch.int64),
        }


def batch_pad_id(tokenizer: Any) -> int:
    """The token id batches are right-padded with: the tokenizer's pad token, else 0."""
    return tokenizer.pad_token_id if isinstance(tokenizer.pad_token_id, int) else 0


def pad_tokens(items: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad token samples into a batch with ``attention_mask``."""
    longest = max(t["input_ids"].numel() for t in items)
    ids = torch.full((len(items), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(items), longest), dtype=torch.bool)
    attn = torch.zeros((len(items), longest), dtype=torch.int64)
    for i, t in enumerate(items):
        n = t["input_ids"].numel()
        ids[i, :n], mask[i, :n], attn[i, :n] = t["input_ids"], t["loss_mask"], 1
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}
    for key in ("sample_index", "source_row", SAMPLE_TURN_KEY):
        # an append's batch may mix stored samples (the keys their schema has) with new ones
        if all(key in t for t in items):
            batch[key] = torch.stack([t[key] for t in items])
    return batch


def padded_probs_bytes(num_samples: int, length: int, hidden: int, draft_vocab: int, itemsize: int) -> int:
    """Bytes of the layout other tools write: each sample padded to ``length`` tokens, full draft-vocab
    probabilities (``stats.padded_probs_bytes`` pads to ``--max-length``, ``padded_probs_longest_bytes`` to the
    longest sample)."""
    per_token = (3 * hidden + draft_vocab) * itemsize + 8 + 1
    return num_samples * length * per_token


def run_precompute(cfg: PrecomputeConfig, comm: Comm | None = None, progress: bool = True) -> Manifest:
    """Write the cache of ``cfg.method`` with ``cfg.engine``; returns the sealed manifest.

    The method (:mod:`speccache.methods.registry`) plans the schema and what it reads of the target, and runs
    its pre-pass; the engine (:mod:`speccache.engines.registry`) loads the target and computes those states;
    the method turns them into rows, which the writer stores.

    Under ``--shard-target tp`` the ranks form groups of ``--tp-size``: every rank of a group computes the
    group's batches (the forward is a collective of the group) and the group's first rank writes them.

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
    comm = comm or LocalComm()
    engine = engine_class(cfg.engine)(cfg, comm)
    plan = make_plan(cfg, comm)
    groups = data_parallel_groups(comm, engine.group_size)
    extension = plan_append(cfg.out, plan.manifest_config, len(plan.samples), cfg.shard_size) if cfg.append else None
    writer = None
    if groups.writers is not None:
        writer = CacheWriter(
            cfg.out,
            cache_name=plan.cache_name,
            schema=plan.schema,
            shard_size=cfg.shard_size,
            num_samples=len(plan.samples) if extension is None else extension.num_samples,
            config=plan.manifest_config if extension is None else extension.config,
            resume=cfg.resume,
            comm=groups.writers,
            append_fields=None if extension is None else DATA_FIELDS,
            cap=DiskCap(cfg.out, cfg.max_cache_bytes, cfg.max_cache_shards)
            if cfg.max_cache_bytes or cfg.max_cache_shards
            else None,
            command=cfg.argv,
        )
    groups.from_writer(None if writer is None else writer.preflight)
    method, method_plan = plan.method, plan.method_plan
    prepass = PrePass(plan.samples, plan.tokenizer, cfg.shard_size, comm, cfg.out if extension is not None else None)
    prepared = method.prepare(method_plan, prepass)
    try:
        loaded = engine.open(method_plan.request, groups, int(np.diff(plan.samples.offsets).max()))
        target = method.target(method_plan, loaded, engine.capture, prepared, DTYPES[cfg.dtype], cfg.nonfinite)
        compute = target.compute_batch
        if SAMPLE_TURN_KEY in plan.schema:

            def compute(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                return {**target.compute_batch(batch), SAMPLE_TURN_KEY: batch[SAMPLE_TURN_KEY]}

        pad_id = batch_pad_id(plan.tokenizer)
        dataset: Dataset = TokenizedDataset(plan.samples)
        loader = DataLoader(
            dataset if extension is None else AppendedDataset(extension, dataset),
            batch_size=cfg.batch_size,
            collate_fn=lambda b: pad_tokens(b, pad_id),
        )
        ragged = [k for k, s in plan.schema.items() if s.ragged]

        def shard_plan(start: int, end: int) -> list[list[int]]:
            lengths = [int(loader.dataset[i]["input_ids"].numel()) for i in range(start, end)]
            return [[start + i for i in b] for b in shard_batches(lengths, cfg.batch_size, cfg.max_batch_tokens)]

        sorted_plan = shard_plan if cfg.batching == "sorted" else None
        # A forward that is a collective of all ranks (fsdp) needs every rank to take the same number of steps;
        # a tensor-parallel forward is a collective of its group, whose ranks all compute the same batches.
        lockstep = comm.max_int if comm.world_size > 1 and groups.size == 1 else None
        if writer is None:  # a tensor-parallel rank that computes its group's batches for the group's writer
            shards = groups.from_writer(None)
            compute_shard_runs(loader, cfg.out, cfg.shard_size, shards, compute, _discard, log, shard_plan=sorted_plan)
            comm.max_int(0)  # returns once every writer has sealed the cache
            return Manifest.read(cfg.out)

        itemsize = DTYPES[cfg.dtype].itemsize
        started = time.monotonic()
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
        with contextlib.ExitStack() as stack:
            run: WriteRun | None = None

            def begin() -> list[int]:
                nonlocal run
                run = stack.enter_context(writer.writing(side_files=side_files))
                return run.shards

            groups.from_writer(begin)  # the group's other ranks compute the same shards
            assert run is not None
            todo_samples = sum(shard_samples(i, writer.manifest.num_samples, cfg.shard_size) for i in run.shards)
            if cfg.resume:
                todo = writer.comm.sum_tensor(torch.tensor([len(run.shards), todo_samples])).tolist()
                # --resume on a new directory (as the demo runs every step) keeps nothing: nothing to report
                if progress and comm.rank == 0 and todo[0] < writer.manifest.num_shards:
                    print(resume_line(cfg.out, writer.manifest, *todo), flush=True)
            bar = _Progress(todo_samples, progress and comm.rank == 0, writer.shard_writer.records)

            def on_batch(out: dict[str, torch.Tensor]) -> None:
                bar.update(int(out[LENGTHS_KEY].numel()), int(out[LENGTHS_KEY].sum()))

            cleared = ClearedCounter(run.write_shard)
            cleared.count_kept(cfg.out, plan.schema, sorted(set(writer.local_shards) - set(run.shards)))
            try:
                compute_shard_runs(
                    loader,
                    cfg.out,
                    cfg.shard_size,
                    run.shards,
                    compute,
                    cleared.write_shard,
                    log,
                    ragged_keys=ragged,
                    sync_max_steps=lockstep,
                    on_batch=on_batch,
                    shard_plan=sorted_plan,
                )
            finally:
                bar.close()
            run.stats = {
                "rows_read": plan.stats.rows_read,
                "skipped_rows": dict(sorted(plan.stats.skipped.items())),
                "rows_truncated": plan.stats.rows_truncated,
                **({"dropped_fields": dict(sorted(plan.stats.dropped.items()))} if plan.stats.dropped else {}),
                "samples": len(plan.samples),
                "tokens": plan.num_tokens,
                "computed_tokens": computed_tokens(plan.samples.lengths.tolist(), cfg)
                if engine.pads
                else plan.num_tokens,
                "padded_probs_bytes": padded_probs_bytes(
                    len(plan.samples), cfg.max_length, plan.hidden_size, plan.draft_vocab_size, itemsize
                ),
                "longest_sample": int(plan.samples.lengths.max()),
            }
            if extension is not None:
                run.stats = merge_stats(extension.stats_before, run.stats)
            if "longest_sample" in run.stats:  # of the whole cache, an append's too
                run.stats["padded_probs_longest_bytes"] = padded_probs_bytes(
                    run.stats["samples"], run.stats["longest_sample"], plan.hidden_size, plan.draft_vocab_size, itemsize
                )
            # counted over every shard of the cache (an append's too): a total, not a sum
            nonfinite = int(writer.comm.sum_tensor(torch.tensor([cleared.total], dtype=torch.int64))[0])
            if nonfinite or cfg.nonfinite == "skip":
                run.stats.setdefault("skipped_rows", {})[SKIP_REASON] = nonfinite
            run.stats.update(engine.record())
    finally:
        engine.close()
    if groups.size > 1:
        comm.max_int(0)  # the group's other ranks return once the cache is sealed
    manifest = writer.manifest
    if comm.rank == 0 and progress:
        print(summary_line(manifest, time.monotonic() - started))
        if writer.cap is not None:
            print(
                f"speccache: paused {writer.cap.waited:.1f}s at the disk cap ({writer.cap.pauses} shards waited); "
                f"at most {human_bytes(writer.cap.high_water)} of unconsumed shards seen on disk"
            )
    return manifest


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


def _discard(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
    """The shard writer of a rank whose group's first rank writes: the group computed the shard, one rank keeps it."""
    return ""


def summary_line(manifest: Manifest, seconds: float) -> str:
    """The closing line of a run: samples, tokens, the size in all and per token (shards alone and with the side
    files), the padded full-probability size for comparison, and the measured error of lossy keys."""
    stats = manifest.stats
    shard_bytes = manifest.total_bytes or 0
    side_bytes = sum(r.bytes for r in manifest.side_files.values())
    total = shard_bytes + side_bytes
    tokens = manifest.num_tokens or 1
    if "padded_probs_longest_bytes" in stats:
        padded = int(stats["padded_probs_longest_bytes"])
        padding = f"padded to the longest sample, {stats['longest_sample']} tokens"
    else:  # a manifest written before the longest sample was recorded (an append to such a cache)
        padded = int(stats.get("padded_probs_bytes", 0))
        padding = f"padded to --max-length, {manifest.config.get('max_length')} tokens"
    if not total or not padded:
        ratio = ""
    else:  # a few samples of a target with a large side file can take more than the padded shards
        ratio = f"{padded / total:.1f}x smaller" if padded >= total else f"{total / padded:.1f}x larger"
        ratio = f"; this cache is {ratio} than that"
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
        f"in {seconds:.1f}s; padded full-probability layout ({padding}) would take {human_bytes(padded)}{ratio}"
        + "".join(
            f"; {key} error: relative RMS {e['rms']:.4f}, max {e['max']:.4f} of row amax"
            for key, e in sorted((stats.get("encoding_error") or {}).items())
        )
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


# ---------------------------------------------------------------------------
# CLI


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name V`` or ``--name=V``; the last one, as argparse takes it)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1 :]
    return found


def resume_argv(argv: list[str]) -> list[str]:
    """``precompute --out DIR --resume`` without ``--model`` or ``--data``: the command recorded in DIR's manifest
    (``producer.argv``) followed by the flags given, which override the recorded ones (a resume still refuses
    settings that differ from the cache's). Any other command line is returned unchanged.

    Raises:
        ValueError: the manifest records no command, or one run from another directory (its relative paths).
        CacheFormatError: DIR's manifest cannot be read.
    """
    out = _flag(argv, "--out")
    if argv[:1] != ["precompute"] or "--resume" not in argv or out is None:
        return argv
    if _flag(argv, "--model") is not None and _flag(argv, "--data") is not None:
        return argv
    if not os.path.lexists(manifest_path(out)):
        raise UsageError(
            f"--resume without --model and --data runs the command recorded in {manifest_path(out)}, which does not "
            "exist (nothing of a cache was written there); give the whole command"
        )
    producer = load_manifest_json(manifest_path(out)).get("producer") or {}
    recorded, cwd = producer.get("argv"), producer.get("cwd")
    if not (
        isinstance(recorded, list) and recorded[:1] == ["precompute"] and all(isinstance(a, str) for a in recorded)
    ):
        raise UsageError(
            f"--resume without --model and --data: {manifest_path(out)} records no command line (written by "
            f"speccache {producer.get('version')}); give the original command's flags with --resume"
        )
    if cwd != os.getcwd():
        raise UsageError(
            f"--resume without --model and --data: the command recorded in {manifest_path(out)} ran in {cwd}, and "
            f"its paths may be relative to it; resume from there: cd {shlex.quote(str(cwd))} && "
            f"{shlex.join(['speccache', *recorded, '--resume'])}"
        )
    return [*recorded, *argv[1:]]


def describe_interrupted(args: argparse.Namespace, command: str) -> str:
    """What an interrupted ``precompute`` keeps in ``--out`` and the command that resumes it."""
    out = args.out
    try:
        producer = load_manifest_json(manifest_path(out)).get("producer") or {}
    except (OSError, SpeccacheError):
        producer = {}
    recorded = isinstance(producer.get("argv"), list) and producer.get("cwd") == os.getcwd()  # resume_argv's needs
    shards = len(existing_shard_indices(out)) + len(read_reclaims(out)) if os.path.isdir(out) else 0
    if args.append:
        return f"the sealed samples of {out} are kept; finish the append with the same command: {command}"
    if not producer and not shards:
        return f"nothing was written to {out}; start again: {command}"
    if recorded:
        again = f"speccache precompute --out {shlex.quote(out)} --resume"
    else:
        again = command if "--resume" in args.argv else f"{command} --resume"
    return f"{shards} whole shards are kept in {out}; resume with: {again}"


def cmd_precompute(args: argparse.Namespace) -> int:
    """Run ``speccache precompute``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = PrecomputeConfig.from_args(args)
    comm = init_from_env(target_device(cfg.device), cfg.timeout)
    try:
        run_precompute(cfg, comm, progress=not args.quiet)
    finally:
        shutdown(comm)
    return 0


def register_commands(sub: Any) -> None:
    """Add ``precompute`` to the CLI."""
    p = sub.add_parser(
        "precompute", help="run a target over chat data and write its features (EAGLE-3, layers, DSpark, DFlash, MTP)"
    )
    add_precompute_arguments(p)
    # How the run computes and where it writes: none of these changes the bytes of the cache.
    p.add_argument("--out", required=True, help="cache directory to write")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run with the same settings")
    p.add_argument(
        "--append",
        action="store_true",
        help="add --data's rows to the sealed cache at --out as new samples (same model and settings); "
        "re-run the same command to finish a killed append",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's own, which follows OMP_NUM_THREADS and the CPU affinity); "
        "warns when the CPUs are oversubscribed",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a rank waits for the others under torchrun")
    p.add_argument(
        "--shard-target",
        default="replicate",
        help="under torchrun: replicate (a whole target per rank, default), fsdp (FSDP2 over all ranks) "
        "or tp (tensor parallel over groups of --tp-size ranks)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=None,
        help="--shard-target tp: ranks per tensor-parallel group (default: all); world_size / T groups split the data",
    )
    p.add_argument(
        "--nonfinite",
        default="fail",
        help="a NaN/Inf feature: fail (default; names sample, row, key, layer) or skip (clear the sample, count it)",
    )
    p.add_argument(
        "--engine",
        default="hf",
        help="what runs the target: hf (transformers, default) or vllm (pip install speccache[vllm]; "
        "see docs/engines.md)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="--engine vllm: vLLM's tensor-parallel size (default 1); under torchrun, each rank's engine's",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="--engine vllm: vLLM's expert parallelism (a mixture of experts' experts spread over the "
        "--tensor-parallel-size GPUs of each engine)",
    )
    add_gpu_memory_utilization_argument(p)
    p.add_argument(
        "--max-cache-bytes",
        default=None,
        help="pause before each shard while the shards no trainer has reclaimed reach this size (e.g. 500G); a "
        "trainer reading with follow and reclaim frees them (docs/training.md); the cap is exceeded by at most "
        "one shard per rank",
    )
    p.add_argument(
        "--max-cache-shards",
        type=int,
        default=None,
        help="as --max-cache-bytes, in shards: at most this many unreclaimed shards on disk (per run, all ranks)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_precompute, interrupted=describe_interrupted)
