"""``speccache regenerate``: the target writes the assistant turns of a chat dataset (self-distillation data).

Each row's assistant turns are replaced, turn by turn, by the target's answer to the regenerated history so
far (user, system and tool turns kept); a conversation that ends in a user or tool turn gets one answer
more. A row keeps the exact tokens: ``input_ids`` is the first turn's prompt as the chat template renders it,
then per turn the ids the model generated (its end-of-turn token included) and the template's text up to the
next generation prompt (:func:`speccache.data.template.text_after_turn`), and ``loss_mask`` is 1 exactly on
the generated ids. ``messages`` holds the text (reasoning split into ``reasoning_content`` where the template
separates it). Precompute reads the directory as data and caches the ids (docs/data.md).

Generation is the ``--engine``'s generator (:mod:`speccache.engines.generation`; ``hf``: a transformers loop
with a KV cache, ``vllm``: vLLM), given each round's prompts of a part sorted by prompt length; every row
samples with its own stream seeded from ``--seed`` and the row's number, so what a row gets does not depend on
the rows generated with it. Rows are written in input order, in parts of ``part_size`` rows
(``part-00000.jsonl``...), each atomically and followed by the progress record ``regenerate.json``
(:mod:`speccache.data.regenerated`), so a killed run resumes with ``--resume`` to the same bytes (``vllm``:
where vLLM reproduces its answers, see :mod:`speccache.engines.vllm_generate`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from speccache.data import (
    Vision,
    chat_format,
    chat_messages,
    check_image_root,
    check_model_source,
    file_content_hash,
    image_root_of,
    iter_rows,
    load_chat_tokenizer,
    load_processor,
    tokenizer_hash,
)
from speccache.data.regenerated import (
    REGENERATE_FORMAT,
    REGENERATE_NAME,
    check_regenerate_dir,
    is_regenerated,
    part_name,
    read_progress,
)
from speccache.data.template import ChatFormat, split_generated_reasoning, text_after_turn
from speccache.devices import TORCH_DTYPE_NAMES, check_device, dtype_name
from speccache.engines.base import add_gpu_memory_utilization_argument, check_gpu_memory_utilization
from speccache.engines.generation import GenerationSettings, Generator
from speccache.engines.registry import GENERATORS, generator_class
from speccache.errors import CacheCorruptError, CacheExistsError, ConfigMismatchError, DataError, UsageError
from speccache.format import durable
from speccache.format.durable import ensure_writable_dir, file_checksum, remove_temp_files, writes_to
from speccache.format.lock import CacheLock
from speccache.precompute._regenerate_images import ImageTurns
from speccache.precompute.command import add_image_arguments
from speccache.units import counted

__all__ = ["RegenerateConfig", "RegenerateResult", "regenerate", "register_commands"]

log = logging.getLogger("speccache.regenerate")

RESUME_SETTINGS = (
    "model",
    "model_config_hash",
    "tokenizer_hash",
    "data",
    "data_split",
    "data_hash",
    "chat_template_hash",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "limit",
    "model_dtype",
    "engine",
    "part_size",
    "image_root",
    "min_pixels",
    "max_pixels",
)
"""What a ``--resume`` compares with the run it continues (the batch size, device and engine version are not
among them: a row's output does not depend on them, up to floating-point rounding)."""
_FLAG = {"model_config_hash": "--model (its config.json)", "tokenizer_hash": "--model (its tokenizer)"}
_FLAG |= {"data_hash": "--data (its content)", "chat_template_hash": "--chat-template"}


@dataclass
class RegenerateConfig:
    """``speccache regenerate`` settings (the CLI's flags; see ``speccache regenerate --help``)."""

    model: str
    data: str
    out: str
    data_split: str | None = None
    chat_template: str | None = None
    max_new_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    limit: int | None = None
    model_dtype: str = "fp32"
    device: str | None = None
    resume: bool = False
    engine: str = "hf"
    gpu_memory_utilization: float | None = None
    part_size: int = 256
    image_root: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    progress: bool = field(default=False, repr=False)
    """Show the progress bar on stderr (the CLI's, unless ``--quiet``)."""

    def check(self) -> None:
        """Check the settings without the model; :func:`regenerate` runs it (as ``run_precompute`` runs
        :meth:`~speccache.precompute.config.PrecomputeConfig.check`).

        Raises:
            UsageError: a setting out of range, naming the flag.
        """
        self.model_dtype = dtype_name(self.model_dtype, "--model-dtype")
        for name in ("max_new_tokens", "batch_size", "part_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be >= 1, got {self.limit}")
        if not self.temperature >= 0:
            raise UsageError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0: no top-k), got {self.top_k}")
        check_device(self.device)
        check_image_root(self.image_root)
        check_gpu_memory_utilization(self.gpu_memory_utilization, self.engine)
        generator_class(self.engine).check_flags(self)


@dataclass
class RegenerateResult:
    """What a run wrote: the progress record's counts."""

    out: str
    rows: int
    turns: int
    generated_tokens: int
    truncated_rows: int
    parts: int


# ---------------------------------------------------------------------------
# sampling and the generation loop


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s generator: a hash of ``--seed`` and the row number."""
    return xxhash.xxh64_intdigest(f"{seed}:{row}".encode()) & ((1 << 63) - 1)


# ---------------------------------------------------------------------------
# rows


class _Row:
    """One data row being regenerated: the messages so far, the exact ids and mask, what is left to answer."""

    def __init__(
        self,
        number: int,
        source_row: int,
        where: str,
        row: dict,
        fmt: ChatFormat,
        tokenizer: Any,
        stream: Any,
        vision: Vision | None = None,
    ) -> None:
        if "messages" not in row and "conversations" not in row:
            raise DataError(
                f"{where}: regenerate needs chat rows ('messages' or 'conversations'); a pre-tokenized row "
                "has no turns to answer: give the chat rows it was made from"
            )
        self.number, self.source_row, self.where = number, source_row, where
        # a vision-language target's rows, with images or without, are tokenized by its processor, as precompute's
        self.images = None if vision is None else ImageTurns(row, where, vision.processor, vision.image_root)
        if self.images is None:
            self.pending, self.tools = chat_messages(row, where)
            self.shown = list(self.pending)
        else:
            self.pending, self.tools, self.shown = list(self.images.messages), self.images.tools, self.images.shown
        self.tools = fmt.tools if self.tools is None else self.tools
        self.written: list[dict] = []  # the messages as the output row gives them
        self.fmt, self.tokenizer = fmt, tokenizer
        self.messages: list[dict] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.turns = 0
        self.truncated_turn: int | None = None
        self.stream = stream  # the generator's sampling state of this row, from row_seed
        self.prompt_text = ""
        self.done = False  # nothing is left to generate
        self._advance()

    def _advance(self) -> None:
        """Keep the input's turns up to its next assistant turn, and prompt for that turn (or finish)."""
        while self.pending and self.pending[0]["role"] != "assistant":
            self.messages.append(self.pending.pop(0))
            self.written.append(self.shown.pop(0))
        if self.pending:
            self.pending.pop(0)  # replaced by the model's answer
            self.shown.pop(0)
        elif not self.messages or self.messages[-1]["role"] == "assistant":
            self.done = True
            return
        if self.turns == 0:
            text, _ = self.fmt.render(self.messages, self.where, self.tools, generation_prompt=True)
        else:
            text = text_after_turn(self.fmt, self.messages, self.where, self.tools)
        self.prompt_text = text
        if self.images is None:
            prompt = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        else:
            prompt = self.images.tokens(text, self.messages)
        self.ids += prompt
        self.mask += [0] * len(prompt)

    def answer(self, new_ids: list[int], ended: bool) -> None:
        """Take the model's answer to the current prompt; the next turn's prompt follows unless it was cut."""
        self.ids += new_ids
        self.mask += [1] * len(new_ids)
        text = self.tokenizer.decode(new_ids[:-1] if ended else new_ids, skip_special_tokens=False)
        reasoning, content = split_generated_reasoning(self.fmt, self.prompt_text, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        self.messages.append(message)
        self.written.append(message)
        self.turns += 1
        if ended:
            self._advance()
        else:
            self.truncated_turn = self.turns - 1
            self.done = True

    def to_json(self) -> dict[str, Any]:
        """The output row (docs/data.md, "Regenerating answers")."""
        row: dict[str, Any] = {"messages": self.written, **({} if self.images is None else self.images.fields)}
        if self.tools is not None:
            row["tools"] = self.tools
        row |= {"input_ids": self.ids, "loss_mask": self.mask, "source_row": self.source_row}
        row["truncated"] = self.truncated_turn is not None
        if self.truncated_turn is not None:
            row["truncated_turn"] = self.truncated_turn
            row["not_generated"] = len(self.pending)
        return row


def _part_rows(rows: list[_Row], generator: Generator, progress: _Progress) -> None:
    """Generate every turn of ``rows``: each round answers every row's next turn, the shortest prompts first (the
    ``hf`` generator batches neighbours, so prompts of like lengths are padded together)."""
    while True:
        todo = sorted((r for r in rows if not r.done), key=lambda r: (len(r.ids), r.number))
        if not todo:
            return
        # image inputs go to a vision-language target's generator only: a text generator keeps its three arguments
        inputs = [r.images.inputs(r.ids) for r in todo if r.images is not None]
        images = {"images": inputs} if inputs else {}
        answers = generator.generate([r.ids for r in todo], [r.stream for r in todo], progress.tokens, **images)
        for r, (new_ids, ended) in zip(todo, answers):
            r.answer(new_ids, ended)
        progress.rows(sum(r.done for r in todo))


class _Progress:
    """The run's bar on stderr: rows answered in full (rate, and ETA where the number of rows is known), with the
    tokens generated and tokens/s in its postfix; rows a resumed run finds written count in no rate."""

    def __init__(self, total: int | None, written: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=written, unit="row", desc="regenerate", disable=not enabled, dynamic_ncols=True
        )
        self.generated = 0
        self.start = time.monotonic()

    def tokens(self, n: int) -> None:
        """``n`` more tokens generated."""
        self.generated += n
        rate = self.generated / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.generated} tokens, {rate:.0f} tok/s", refresh=False)
        self.bar.update(0)  # redraws at tqdm's own pace: a long answer moves the tokens while no row ends

    def rows(self, n: int) -> None:
        """``n`` more rows answered in full."""
        self.bar.update(n)


# ---------------------------------------------------------------------------
# the run


def _settings(config: RegenerateConfig, fmt: ChatFormat, tokenizer: Any) -> dict[str, Any]:
    config_json = os.path.join(config.model, "config.json")
    return {
        "model": os.path.abspath(config.model) if os.path.exists(config.model) else config.model,
        "model_config_hash": file_checksum(config_json) if os.path.isfile(config_json) else None,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "data": os.path.abspath(config.data) if os.path.exists(config.data) else config.data,
        "data_split": config.data_split,
        "data_hash": file_content_hash(config.data, config.data_split),
        "chat_template_hash": xxhash.xxh3_128_hexdigest(fmt.template.encode("utf-8")),
        "date": fmt.date,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "seed": config.seed,
        "limit": config.limit,
        "model_dtype": config.model_dtype,
        "engine": config.engine,
        "engine_version": generator_class(config.engine).version(),
        "part_size": config.part_size,
        # a vision-language target's rows' images: where they are found, and how large the processor makes them
        "image_root": None if config.image_root is None else os.path.abspath(config.image_root),
        "min_pixels": config.min_pixels,
        "max_pixels": config.max_pixels,
    }


def _check_resume(out: str, record: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse a ``--resume`` with other settings, or a part that differs from its recorded checksum."""
    for name in RESUME_SETTINGS:
        recorded = record["settings"].get(name)
        if name == "model_dtype":  # earlier runs recorded torch's name of it
            recorded = TORCH_DTYPE_NAMES.get(recorded, recorded)
        if recorded != settings[name]:
            flag = _FLAG.get(name, f"--{name.replace('_', '-')}")
            raise ConfigMismatchError(
                f"--resume: {flag} is {settings[name]!r} but the run in {out} was started with "
                f"{recorded!r}; resume with the run's settings, or regenerate into a new --out"
            )
    for part in record["parts"]:
        path = os.path.join(out, part["name"])
        if not os.path.isfile(path) or file_checksum(path) != part["xxh3_128"]:
            raise CacheCorruptError(
                f"{path}: the part differs from the checksum {REGENERATE_NAME} records (changed or removed "
                "after it was written); restore it, or regenerate into a new --out"
            )


def _rows(config: RegenerateConfig) -> Iterator[tuple[int, int, str, dict]]:
    """``(ordinal, row number, where, row)`` of the input, at most ``--limit`` rows."""
    for ordinal, (number, row) in enumerate(iter_rows(config.data, config.data_split)):
        if config.limit is not None and ordinal >= config.limit:
            return
        yield ordinal, number, f"{config.data}[row {number}]", row


def _write_record(out: str, record: dict[str, Any]) -> None:
    data = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode("utf-8")
    durable.atomic_write(os.path.join(out, REGENERATE_NAME), functools.partial(_write_file, data=data))


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def regenerate(config: RegenerateConfig) -> RegenerateResult:
    """Regenerate the assistant turns of ``config.data`` with ``config.model`` into ``config.out``.

    Raises:
        CacheExistsError: ``out`` holds another regenerate run (without ``resume``) or files regenerate did not write.
        ConfigMismatchError: ``resume`` with settings that differ from the run's (the setting is named).
        CacheCorruptError: ``resume`` finds a written part changed.
        DataError: the data cannot be read, or a row is not a chat row the template renders.
        OutputError: ``out`` cannot be written.
        UsageError: a bad setting.
    """
    config.check()
    out = config.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CacheExistsError(f"--out {out} is a file; choose a new directory to regenerate into")
    check_regenerate_dir(out)
    if os.path.isdir(out) and is_regenerated(out) and not config.resume:
        raise CacheExistsError(
            f"--out {out} already holds a regenerate run; pass --resume to continue it, or choose a new directory"
        )
    check_model_source(config.model)
    ensure_writable_dir(out)
    tokenizer = load_chat_tokenizer(config.model, config.chat_template)
    processor = (
        load_processor(config.model, config.min_pixels, config.max_pixels) if os.path.isdir(config.model) else None
    )
    vision = None if processor is None else Vision(processor, image_root_of(config.data, config.image_root))
    fmt = chat_format(tokenizer, config.chat_template)
    if not isinstance(fmt, ChatFormat):
        raise DataError(
            f"--model {config.model}: regenerate needs a Jinja chat template, and the tokenizer has none; "
            "pass --chat-template FILE"
        )
    with CacheLock(out), writes_to(out):
        remove_temp_files(out)
        settings = _settings(config, fmt, tokenizer)
        record: dict[str, Any] = {"format": REGENERATE_FORMAT, "version": 1, "complete": False, "parts": []}
        if is_regenerated(out):
            record = read_progress(out)
            _check_resume(out, record, settings)
            # the date the template saw is the run's, as precompute pins its manifest's on --resume
            fmt = ChatFormat.for_tokenizer(tokenizer, fmt.template, date=record["settings"]["date"])
            settings["date"] = fmt.date
        record["settings"] = settings
        record["run"] = {"batch_size": config.batch_size, "device": config.device}
        if not record["complete"]:
            _run(config, fmt, tokenizer, out, record, vision)
    counts = record["counts"]
    return RegenerateResult(
        out, counts["rows"], counts["turns"], counts["generated_tokens"], counts["truncated_rows"], len(record["parts"])
    )


def _run(
    config: RegenerateConfig, fmt: ChatFormat, tokenizer: Any, out: str, record: dict[str, Any], vision: Vision | None
) -> None:
    done = len(record["parts"])
    rows = itertools.islice(_rows(config), done * config.part_size, None)

    stop_ids = _stop_ids(config.model, tokenizer)
    if record.setdefault("stop_ids", sorted(stop_ids)) != sorted(stop_ids):
        raise ConfigMismatchError(
            f"--resume: the target's end-of-answer ids are {sorted(stop_ids)} (generation_config.json, tokenizer) "
            f"but the run in {out} was started with {record['stop_ids']}; resume with the run's settings, "
            "or regenerate into a new --out"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    settings = GenerationSettings(
        config.model,
        config.model_dtype,
        config.device,
        config.batch_size,
        config.max_new_tokens,
        config.temperature,
        config.top_p,
        config.top_k,
        config.seed,
        stop_ids,
        pad_id,
        config.gpu_memory_utilization,
    )
    generator = generator_class(config.engine)(settings)  # it starts the target at its first answer

    def next_part() -> list[_Row]:
        return [
            _Row(
                number, source_row, where, row, fmt, tokenizer, generator.stream(row_seed(config.seed, number)), vision
            )
            for number, source_row, where, row in itertools.islice(rows, config.part_size)
        ]

    states = next_part()  # a bad row of the first part fails before the target starts
    total = config.limit
    if config.progress:  # the rows of the input, for the bar's ETA (a pass that reads no model)
        total = sum(1 for _ in _rows(config))
    progress = _Progress(total, done * config.part_size, config.progress)
    try:
        with progress.bar:
            while states:
                _part_rows(states, generator, progress)
                lines = "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in states).encode("utf-8")
                name = part_name(len(record["parts"]))
                durable.atomic_write(os.path.join(out, name), functools.partial(_write_file, data=lines))
                record["parts"].append(
                    {
                        "name": name,
                        "rows": len(states),
                        "xxh3_128": xxhash.xxh3_128_hexdigest(lines),
                        "turns": sum(s.turns for s in states),
                        "generated_tokens": sum(sum(s.mask) for s in states),
                        "truncated_rows": sum(s.truncated_turn is not None for s in states),
                    }
                )
                record["counts"] = _counts(record)
                _write_record(out, record)
                states = next_part()
    finally:
        generator.close()
    record["complete"] = True
    record["counts"] = _counts(record)
    _write_record(out, record)


def _counts(record: dict[str, Any]) -> dict[str, int]:
    keys = ("rows", "turns", "generated_tokens", "truncated_rows")
    return {k: sum(p[k] for p in record["parts"]) for k in keys}


def _stop_ids(model: str, tokenizer: Any) -> frozenset[int]:
    """The tokens that end an answer: the generation config's eos ids and the tokenizer's eos.

    The generation config is read as transformers reads a loaded model's (``generation_config.json``, else the
    one ``config.json`` gives), so every ``--engine`` stops where the transformers model would, and the target
    need not be loaded to know it.
    """
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model)
    except OSError:
        generation = GenerationConfig.from_pretrained(model, config_file_name="config.json", _from_model_config=True)
    ids: set[int] = set()
    for value in (getattr(generation, "eos_token_id", None), tokenizer.eos_token_id):
        ids |= set(value) if isinstance(value, list) else {value} if value is not None else set()
    if not ids:
        raise DataError(
            f"--model {model}: the target has no end-of-sequence token (neither its "
            "generation_config nor its tokenizer names one), so regenerate cannot tell where an answer ends; "
            "set eos_token_id in its generation_config.json"
        )
    return frozenset(ids)


# ---------------------------------------------------------------------------
# the command line


def add_regenerate_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``speccache regenerate``."""
    p.add_argument("--model", required=True, help="Hugging Face model directory of the target")
    p.add_argument("--data", required=True, help="chat data, in any form precompute reads")
    p.add_argument("--out", required=True, help="the directory to write (parts and regenerate.json)")
    p.add_argument("--data-split", default=None, help="the split of a saved DatasetDict")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    p.add_argument(
        "--batch-size", type=int, default=16, help="rows per generation batch (default 16; vllm: its max_num_seqs)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="the seed each row's generator is derived from (default 0)")
    p.add_argument("--limit", type=int, default=None, help="regenerate only the first N rows")
    p.add_argument(
        "--model-dtype", default="fp32", help="the target's compute: fp32 (default), bf16 or fp16 (or torch's names)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--resume", action="store_true", help="continue a killed run in --out (same settings)")
    p.add_argument(
        "--engine", default="hf", choices=sorted(GENERATORS), help="hf (default: transformers' loop) or vllm (vLLM)"
    )
    add_gpu_memory_utilization_argument(p)
    add_image_arguments(p)
    p.add_argument("--part-size", type=int, default=256, help="rows per part file (default 256)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")


def cmd_regenerate(args: argparse.Namespace) -> int:
    """Run ``speccache regenerate``."""
    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "quiet", "interrupted", "argv")}
    config = RegenerateConfig(**options, progress=not args.quiet)
    result = regenerate(config)
    if args.quiet:
        return 0
    print(
        f"{result.out}: {counted(result.rows, 'row')}, {counted(result.turns, 'answer')}, "
        f"{counted(result.generated_tokens, 'generated token')}, {counted(result.truncated_rows, 'row')} cut at "
        f"--max-new-tokens, in {counted(result.parts, 'part')}"
    )
    return 0


def register_commands(sub: Any) -> None:
    """Add ``regenerate`` to the CLI."""
    p = sub.add_parser("regenerate", help="the target writes the assistant turns of chat data (self-distillation)")
    add_regenerate_arguments(p)
    p.set_defaults(
        func=cmd_regenerate,
        interrupted=lambda args, command: (
            f"the parts written so far in {args.out} are kept; resume with: "
            + (command if args.resume else f"{command} --resume")
        ),
    )
