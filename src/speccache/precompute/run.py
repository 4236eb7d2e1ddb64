"""``speccache precompute``: run a Hugging Face target over a chat dataset and write an EAGLE-3 cache.

Everything that can be checked without the model (paths, flags, the model
config, the data) is checked first, so a bad invocation fails in seconds and
writes nothing. The run then follows :class:`speccache.cache_writer.CacheWriter`
(lock, checks, side file, unsealed manifest, shards, seal), alone or under
``torchrun``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.utils.data import DataLoader, Dataset

from speccache.data import DataStats, TokenizedSample, file_content_hash, load_samples, tokenizer_hash
from speccache.errors import DataError
from speccache.format import LENGTHS_KEY, Manifest, Schema, shard_samples
from speccache.methods.eagle3 import (
    CACHE_NAME,
    SIDE_FILE,
    Eagle3Target,
    Supervision,
    check_aux_layers,
    default_aux_layers,
    eagle3_schema,
    select_draft_vocab,
    vocab_mapping,
)
from speccache.units import human_bytes
from speccache.write import (
    CacheWriter,
    Comm,
    LocalComm,
    SideFile,
    compute_shard_runs,
    init_from_env,
    partition_cache_shards,
    shutdown,
)

log = logging.getLogger("speccache.precompute")

METHODS = ("eagle3",)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------
# arguments


def add_precompute_arguments(p: argparse.ArgumentParser) -> None:
    """The flags shared by ``precompute`` and ``estimate``."""
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub id where the network allows)")
    p.add_argument(
        "--data", required=True, help=".jsonl/.json chat data (ShareGPT, OpenAI messages, or input_ids+loss_mask)"
    )
    p.add_argument("--method", default="eagle3", help=f"speculative method ({', '.join(METHODS)})")
    p.add_argument("--max-length", type=int, default=2048, help="truncate samples to this many tokens (default 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per target forward (default 8)")
    p.add_argument(
        "--shard-size", type=int, default=256, help="samples per shard; a multiple of --batch-size (default 256)"
    )
    p.add_argument("--dtype", default="bf16", help="storage dtype of float features: bf16, fp16, fp32 (default bf16)")
    p.add_argument(
        "--aux-layers", default=None, help="three decoder layer ids, e.g. 1,15,28 (default [1, L//2-1, L-4])"
    )
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary size (default: the target's)")
    p.add_argument("--supervision", default="hidden", help="hidden (default), probs, or topk:K")
    p.add_argument(
        "--encode", default="", help="per-feature encodings, e.g. aux_hidden_states=fp8,last_hidden_state=zbf16"
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N usable rows")
    p.add_argument("--skip-bad-rows", action="store_true", help="count and skip malformed rows instead of failing")


@dataclass
class PrecomputeConfig:
    """Validated ``precompute`` settings."""

    model: str
    data: str
    out: str
    method: str = "eagle3"
    max_length: int = 2048
    batch_size: int = 8
    shard_size: int = 256
    dtype: str = "bf16"
    aux_layers: list[int] | None = None
    draft_vocab_size: int | None = None
    supervision: str = "hidden"
    encodings: dict[str, str] = field(default_factory=dict)
    limit: int | None = None
    skip_bad_rows: bool = False
    resume: bool = False
    device: str | None = None
    timeout: float = 1800.0
    model_dtype: str = "auto"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PrecomputeConfig:
        """Build from parsed CLI arguments and check what can be checked without the model.

        Raises:
            ValueError: a bad flag value; the message names the flag and the fix.
            FileNotFoundError: the data file or a local model directory is missing.
        """
        cfg = cls(
            model=args.model,
            data=args.data,
            out=getattr(args, "out", ""),
            method=args.method,
            max_length=args.max_length,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            dtype=args.dtype,
            aux_layers=_parse_layers(args.aux_layers),
            draft_vocab_size=args.draft_vocab_size,
            supervision=args.supervision,
            encodings=_parse_encodings(args.encode),
            limit=args.limit,
            skip_bad_rows=args.skip_bad_rows,
            resume=getattr(args, "resume", False),
            device=getattr(args, "device", None),
            timeout=getattr(args, "timeout", 1800.0),
            model_dtype=getattr(args, "model_dtype", "auto"),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        """Check every setting that needs neither the model nor the data contents."""
        if self.method not in METHODS:
            raise ValueError(f"--method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        Supervision.parse(self.supervision)
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if self.model_dtype not in ("auto", *DTYPES):
            raise ValueError(
                f"--model-dtype {self.model_dtype!r} is unknown; choose auto or one of {', '.join(DTYPES)}"
            )
        if self.max_length < 2:
            raise ValueError(
                f"--max-length must be >= 2 (a sample needs a token and its successor), got {self.max_length}"
            )
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.shard_size < 1 or self.shard_size % self.batch_size:
            raise ValueError(
                f"--shard-size {self.shard_size} must be a positive multiple of --batch-size {self.batch_size}, "
                "so that a "
                "resumed or distributed run computes exactly the batches of an uninterrupted one"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if not os.path.isfile(self.data):
            raise FileNotFoundError(f"--data {self.data}: no such file")
        if _looks_local(self.model) and not os.path.isdir(self.model):
            raise FileNotFoundError(f"--model {self.model}: no such model directory")
        if self.out and os.path.exists(self.out) and not os.path.isdir(self.out):
            raise NotADirectoryError(f"--out {self.out} is a file; give a directory for the cache")


def _looks_local(model: str) -> bool:
    # A hub id is "name" or "org/name"; anything that exists, or looks like a path, is a local directory.
    return os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") > 1


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--aux-layers {text!r} must be comma-separated integers, e.g. 1,15,28") from None


def _parse_encodings(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, enc = item.partition("=")
        if not sep or not key or not enc:
            raise ValueError(f"--encode item {item!r} must look like KEY=ENCODING (e.g. aux_hidden_states=fp8)")
        out[key.strip()] = enc.strip()
    return out


# ---------------------------------------------------------------------------
# the plan: everything decided before the model is loaded


@dataclass
class Plan:
    """What a run will write, derived from the config, the model config, the tokenizer and the data."""

    cfg: PrecomputeConfig
    model_config: Any
    tokenizer: Any
    samples: list[TokenizedSample]
    stats: DataStats
    aux_layers: list[int]
    vocab_size: int
    hidden_size: int
    draft_vocab_size: int
    schema: Schema
    manifest_config: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        """Tokens in all samples."""
        return sum(len(s.input_ids) for s in self.samples)


def make_plan(cfg: PrecomputeConfig) -> Plan:
    """Load the model config and tokenizer, read the data, and decide the schema; the model is not loaded.

    Raises:
        FileNotFoundError: the model config cannot be loaded from ``--model``.
        ValueError: aux layers, draft vocab size or encodings do not fit the model.
        DataError: the data has no usable row, or a malformed row.
    """
    from transformers import AutoConfig, AutoTokenizer

    try:
        model_config = AutoConfig.from_pretrained(cfg.model)
    except OSError as exc:  # a missing "dir/name" path looks like a hub id; a directory may lack config.json
        raise FileNotFoundError(
            f"--model {cfg.model}: no model directory or loadable model config there ({exc})"
        ) from exc
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_layers = int(text_config.num_hidden_layers)
    aux = check_aux_layers(cfg.aux_layers if cfg.aux_layers is not None else default_aux_layers(num_layers), num_layers)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    vocab_size = int(text_config.vocab_size)
    draft = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else vocab_size
    if not 1 <= draft <= vocab_size:
        raise ValueError(f"--draft-vocab-size {draft} must be in [1, {vocab_size}] (the target vocabulary)")
    supervision = Supervision.parse(cfg.supervision)
    if supervision.mode == "topk" and supervision.k > draft:
        raise ValueError(f"--supervision topk:{supervision.k} asks for more than the {draft} draft tokens")
    hidden = int(text_config.hidden_size)
    schema = eagle3_schema(hidden, DTYPES[cfg.dtype], supervision, draft, draft == vocab_size, cfg.encodings)
    samples, stats = load_samples(cfg.data, tokenizer, cfg.max_length, limit=cfg.limit, skip_bad_rows=cfg.skip_bad_rows)
    if not samples:
        raise DataError(
            f"--data {cfg.data}: no usable row ({stats.rows_read} read, {stats.rows_skipped_no_assistant} without an "
            f"assistant token, {stats.rows_skipped_bad} malformed). Check the file's format (see the README)."
        )
    manifest_config = {
        "method": cfg.method,
        "model": os.path.abspath(cfg.model) if os.path.exists(cfg.model) else cfg.model,
        "model_config_hash": _config_hash(model_config),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "data": os.path.abspath(cfg.data),
        "data_hash": file_content_hash(cfg.data),
        "max_length": cfg.max_length,
        "batch_size": cfg.batch_size,
        "aux_layers": aux,
        "dtype": cfg.dtype,
        "model_dtype": cfg.model_dtype,
        "supervision": str(supervision),
        "draft_vocab_size": draft,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "encodings": {k: s.encoding for k, s in schema.items() if s.encoding != "raw"},
        "limit": cfg.limit,
        "skip_bad_rows": cfg.skip_bad_rows,
    }
    return Plan(cfg, model_config, tokenizer, samples, stats, aux, vocab_size, hidden, draft, schema, manifest_config)


def _config_hash(model_config: Any) -> str:
    body = model_config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash"):
        body.pop(volatile, None)
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, default=str).encode())


# ---------------------------------------------------------------------------
# running


class TokenizedDataset(Dataset):
    """The tokenized samples as tensors."""

    def __init__(self, samples: Sequence[TokenizedSample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.samples[index]
        return {
            "input_ids": torch.tensor(s.input_ids, dtype=torch.int64),
            "loss_mask": torch.tensor(s.loss_mask, dtype=torch.bool),
        }


def pad_tokens(items: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad token samples into a batch with ``attention_mask``."""
    longest = max(t["input_ids"].numel() for t in items)
    ids = torch.full((len(items), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(items), longest), dtype=torch.bool)
    attn = torch.zeros((len(items), longest), dtype=torch.int64)
    for i, t in enumerate(items):
        n = t["input_ids"].numel()
        ids[i, :n], mask[i, :n], attn[i, :n] = t["input_ids"], t["loss_mask"], 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def draft_token_counts(plan: Plan, comm: Comm) -> torch.Tensor:
    """Loss-masked token counts over the whole dataset: each rank counts its block, then all ranks sum."""
    _, start, n = partition_cache_shards(len(plan.samples), plan.cfg.shard_size, comm.world_size, comm.rank)
    counts = torch.zeros(plan.vocab_size, dtype=torch.int64)
    for s in plan.samples[start : start + n]:
        ids = torch.tensor(s.input_ids, dtype=torch.int64)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids.clamp(0, plan.vocab_size - 1), minlength=plan.vocab_size)
    return comm.sum_tensor(counts)


def _special_ids(tokenizer: Any) -> list[int]:
    ids = [getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")]
    return [i for i in ids if isinstance(i, int)]


def load_target(cfg: PrecomputeConfig, device: torch.device) -> torch.nn.Module:
    """Load the target model for inference."""
    from transformers import AutoModelForCausalLM

    dtype: Any = "auto" if cfg.model_dtype == "auto" else DTYPES[cfg.model_dtype]
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def padded_probs_bytes(num_samples: int, max_length: int, hidden: int, draft_vocab: int, itemsize: int) -> int:
    """Bytes of the layout other tools write: each sample padded to ``max_length``, full draft-vocab probabilities."""
    per_token = (3 * hidden + draft_vocab) * itemsize + 8 + 1
    return num_samples * max_length * per_token


def target_device(cfg: PrecomputeConfig) -> torch.device:
    """The target's device: ``--device``, else CUDA (``cuda:LOCAL_RANK`` under torchrun) if available, else CPU."""
    if cfg.device:
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_precompute(cfg: PrecomputeConfig, comm: Comm | None = None, progress: bool = True) -> Manifest:
    """Write an EAGLE-3 cache; returns the sealed manifest.

    Args:
        cfg: the validated settings.
        comm: the process group (default: this process alone).
        progress: show the progress bar and the summary line (rank 0).

    Raises:
        CacheExistsError, ConfigMismatchError, CacheLockedError: the output directory cannot be used (nothing changed).
        DataError, ValueError: bad data or settings (nothing written).
    """
    comm = comm or LocalComm()
    device = target_device(cfg)
    plan = make_plan(cfg)
    writer = CacheWriter(
        cfg.out,
        cache_name=CACHE_NAME,
        schema=plan.schema,
        shard_size=cfg.shard_size,
        num_samples=len(plan.samples),
        config=plan.manifest_config,
        resume=cfg.resume,
        comm=comm,
    )
    writer.preflight()
    counts = draft_token_counts(plan, comm)
    selected = select_draft_vocab(counts, plan.draft_vocab_size, _special_ids(plan.tokenizer))
    model = load_target(cfg, device)
    target = Eagle3Target(model, plan.aux_layers, Supervision.parse(cfg.supervision), selected, DTYPES[cfg.dtype])

    def side_tensors() -> dict[str, torch.Tensor]:
        return {
            "embed_tokens": model.get_input_embeddings().weight.detach().cpu().contiguous(),
            "lm_head": model.get_output_embeddings().weight.detach()[selected.to(device)].cpu().contiguous(),
            **vocab_mapping(selected, plan.vocab_size),
        }

    pad_id = plan.tokenizer.pad_token_id if isinstance(plan.tokenizer.pad_token_id, int) else 0
    loader = DataLoader(
        TokenizedDataset(plan.samples), batch_size=cfg.batch_size, collate_fn=lambda b: pad_tokens(b, pad_id)
    )
    ragged = [k for k, s in plan.schema.items() if s.ragged]
    itemsize = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
    started = time.monotonic()
    with writer.writing(side_files=(SideFile(SIDE_FILE, side_tensors, {"speccache_side": CACHE_NAME}),)) as run:
        todo_samples = sum(shard_samples(i, len(plan.samples), cfg.shard_size) for i in run.shards)
        bar = _Progress(todo_samples, enabled=progress and comm.rank == 0)

        def on_batch(out: dict[str, torch.Tensor]) -> None:
            bar.update(int(out[LENGTHS_KEY].numel()), int(out[LENGTHS_KEY].sum()), writer.shard_writer.records)

        try:
            compute_shard_runs(
                loader,
                cfg.out,
                cfg.shard_size,
                run.shards,
                target.compute_batch,
                run.write_shard,
                log,
                ragged_keys=ragged,
                sync_max_steps=comm.max_int if comm.world_size > 1 else None,
                on_batch=on_batch,
            )
        finally:
            bar.close()
        run.stats = {
            "rows_read": plan.stats.rows_read,
            "rows_skipped_no_assistant": plan.stats.rows_skipped_no_assistant,
            "rows_skipped_bad": plan.stats.rows_skipped_bad,
            "rows_truncated": plan.stats.rows_truncated,
            "samples": len(plan.samples),
            "tokens": plan.num_tokens,
            "padded_probs_bytes": padded_probs_bytes(
                len(plan.samples), cfg.max_length, plan.hidden_size, plan.draft_vocab_size, itemsize
            ),
        }
    manifest = writer.manifest
    if comm.rank == 0 and progress:
        print(summary_line(manifest, time.monotonic() - started))
    return manifest


def summary_line(manifest: Manifest, seconds: float) -> str:
    """The closing line of a run: samples, tokens, bytes per token, the padded full-probability size for comparison,
    and the measured error of lossy keys."""
    stats = manifest.stats
    shard_bytes = manifest.total_bytes or 0
    total = shard_bytes + sum(r.bytes for r in manifest.side_files.values())
    tokens = manifest.num_tokens or 0
    padded = int(stats.get("padded_probs_bytes", 0))
    ratio = f"{padded / total:.1f}x smaller" if total else "-"
    skipped = stats.get("rows_skipped_no_assistant", 0) + stats.get("rows_skipped_bad", 0)
    return (
        f"speccache: {manifest.num_samples} samples ({skipped} rows skipped), {tokens} tokens, "
        f"{human_bytes(total)} ({shard_bytes / (tokens or 1):.0f} bytes/token) in {seconds:.1f}s; "
        f"padded full-probability layout would take {human_bytes(padded)} ({ratio})"
        + "".join(
            f"; {key} error: relative RMS {e['rms']:.4f}, max {e['max']:.4f} of row amax"
            for key, e in sorted((stats.get("encoding_error") or {}).items())
        )
    )


class _Progress:
    """A tqdm bar over samples with tokens/s and MB/s written in its postfix."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="sample", desc="precompute", disable=not enabled, dynamic_ncols=True)
        self.tokens = 0
        self.start = time.monotonic()

    def update(self, samples: int, tokens: int, records: dict[int, Any]) -> None:
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.start, 1e-9)
        written = sum(r.bytes for r in list(records.values()))
        self.bar.set_postfix_str(
            f"{self.tokens / elapsed:.0f} tok/s, {written / elapsed / 1e6:.1f} MB/s written", refresh=False
        )
        self.bar.update(samples)

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------
# CLI


def cmd_precompute(args: argparse.Namespace) -> int:
    """Run ``speccache precompute``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = PrecomputeConfig.from_args(args)
    comm = init_from_env(target_device(cfg), cfg.timeout)
    try:
        run_precompute(cfg, comm, progress=not args.quiet)
    finally:
        shutdown(comm)
    return 0


def register_commands(sub: Any) -> None:
    """Add ``precompute`` to the CLI."""
    p = sub.add_parser("precompute", help="run a target over chat data and write its features (EAGLE-3)")
    add_precompute_arguments(p)
    p.add_argument("--out", required=True, help="cache directory to write")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run with the same settings")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--model-dtype", default="auto", help="dtype to run the target in: auto (checkpoint), bf16, fp16, fp32"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a rank waits for the others under torchrun")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_precompute)
