"""``speccache precompute`` on the command line: its flags (those that change what a run writes are shared with
``estimate``), the command, and what an interrupted run keeps and how to resume it."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from collections.abc import Sequence
from typing import Any

from speccache.devices import target_device
from speccache.engines.registry import ENGINES
from speccache.errors import SpeccacheError, UsageError
from speccache.format import existing_shard_indices, load_manifest_json, manifest_path
from speccache.format.reclaim import read_reclaims
from speccache.methods.registry import METHODS
from speccache.precompute.config import PrecomputeConfig, set_flag_defaults
from speccache.precompute.run import run_precompute
from speccache.write import init_from_env, shutdown

__all__ = ["add_precompute_arguments", "describe_interrupted", "register_commands", "resume_argv"]


def add_image_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a vision-language target's image rows (``precompute``, ``estimate``, ``regenerate``)."""
    p.add_argument("--image-root", help="the folder relative image paths in rows resolve against (default: the data's)")
    p.add_argument("--min-pixels", type=int, help="a Qwen-VL target's least pixels per image (size.shortest_edge)")
    p.add_argument("--max-pixels", type=int, help="a Qwen-VL target's most pixels per image (size.longest_edge)")


def add_precompute_arguments(p: argparse.ArgumentParser) -> None:
    """The flags shared by ``precompute`` and ``estimate``: every flag that can change what a run writes.

    A new flag that changes a cache's bytes (its samples, keys, dtypes, encodings or side files) belongs here, so
    that ``estimate`` predicts the run it describes; flags of how a run computes go in :func:`register_commands`.
    Each default is the :class:`~speccache.precompute.config.PrecomputeConfig` field's.
    """
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub id where the network allows)")
    p.add_argument(
        "--data", required=True, help=".jsonl/.json chat data (ShareGPT, OpenAI messages, or input_ids+loss_mask)"
    )
    p.add_argument(
        "--data-split",
        help="the split of a saved DatasetDict or of a hub dataset given to --data as name or org/name (hub: train)",
    )
    p.add_argument("--method", help=f"speculative method ({', '.join(METHODS)}; default %(default)s)")
    p.add_argument("--max-length", type=int, help="truncate samples to this many tokens (default %(default)s)")
    p.add_argument("--batch-size", type=int, help="samples per target forward (default %(default)s)")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        help="instead of --batch-size: the most padded tokens (samples x the longest) one forward may hold",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        help="compute samples longer than N tokens N at a time, a KV cache carried across the chunks (bounded "
        "activation memory for long samples; --engine vllm: its chunked prefill, N tokens per step)",
    )
    p.add_argument(
        "--batching",
        choices=["sorted", "ordered"],
        help="sorted (default): each shard's samples computed longest first, so batches hold little padding; "
        "ordered: in stored order (what caches written before this option used)",
    )
    p.add_argument("--shard-size", type=int, help="samples per shard; a multiple of --batch-size (default %(default)s)")
    p.add_argument("--dtype", help="storage dtype of float features: bf16, fp16, fp32 (default %(default)s)")
    p.add_argument(
        "--model-dtype",
        help="dtype to run the target in: auto (checkpoint), bf16, fp16, fp32; the side file's weights are stored "
        "in it",
    )
    for method in dict.fromkeys(METHODS.values()):  # a method with several presets adds its flags once
        add_arguments = getattr(method, "add_arguments", None)
        if add_arguments is not None:
            add_arguments(p)
    p.add_argument("--encode", help="per-feature encodings, e.g. aux_hidden_states=fp8,last_hidden_state=zbf16")
    p.add_argument("--limit", type=int, help="use only the first N usable rows")
    p.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="count and skip rows that fail (malformed, template errors, unplaceable masks) instead of failing",
    )
    p.add_argument(
        "--on-dropped",
        help="a row whose rendering lacks a field it carries (tool calls, tools, reasoning, a content): warn "
        "(default: kept, counted, listed in dropped_fields.jsonl), skip (left out, counted) or fail",
    )
    p.add_argument("--chat-template", help="a Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--system-prompt", help="a system message added to rows that have none")
    p.add_argument("--num-proc", type=int, help="tokenizer processes (default: this rank's share of the cores, <= 8)")
    add_image_arguments(p)
    p.add_argument(
        "--no-vision-inputs",
        action="store_true",
        help="a vision-language target: store neither image_embeds nor positions (for a draft trained text-only)",
    )
    p.add_argument(
        "--reasoning",
        help="rendered <think> reasoning: keep (trained on, default) or mask (in the input, not in the loss)",
    )
    p.add_argument("--tools", help="a JSON list of tool schemas rendered for rows that carry no 'tools'")
    p.add_argument(
        "--turns",
        help="assistant turns supervised: all (default) or last (earlier turns are context)",
    )
    p.add_argument(
        "--expand-turns",
        action="store_true",
        help="one sample per assistant turn: the conversation up to it, only it supervised (records sample_turn)",
    )
    set_flag_defaults(p)


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
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--timeout", type=float, help="seconds a rank waits for the others under torchrun")
    p.add_argument(
        "--nonfinite",
        help="a NaN/Inf feature: fail (default; names sample, row, key, layer) or skip (clear the sample, count it)",
    )
    p.add_argument(
        "--engine", help=f"what runs the target: {', '.join(ENGINES)} (default %(default)s; see docs/engines.md)"
    )
    for engine in ENGINES.values():  # each engine's own flags, checked by its check_flags
        add_arguments = getattr(engine, "add_arguments", None)
        if add_arguments is not None:
            add_arguments(p)
    p.add_argument(
        "--max-cache-bytes",
        help="pause before each shard while the shards no trainer has reclaimed reach this size (e.g. 500G); a "
        "trainer reading with follow and reclaim frees them (docs/training.md); the cap is exceeded by at most "
        "one shard per rank",
    )
    p.add_argument(
        "--max-cache-shards",
        type=int,
        help="as --max-cache-bytes, in shards: at most this many unreclaimed shards on disk (per run, all ranks)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    set_flag_defaults(p)
    p.set_defaults(func=cmd_precompute, interrupted=describe_interrupted)
