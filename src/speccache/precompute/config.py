"""``PrecomputeConfig``: the settings of ``speccache precompute`` (and ``estimate``), checked before anything is read.

Each setting's default is written once, as its field's default here: :func:`set_flag_defaults` gives the
command line's flags the same ones, and :meth:`PrecomputeConfig.from_args` reads each field from its flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from speccache.data import (
    REASONING_MODES,
    TURN_MODES,
    check_dropped_mode,
    check_image_root,
    check_model_source,
    data_root,
    is_hub_id,
)
from speccache.devices import DTYPES, dtype_name
from speccache.engines.registry import DEFAULT_ENGINE, engine_class
from speccache.errors import DataError, UsageError
from speccache.format.encoding import parse_encodings
from speccache.methods.finite import check_nonfinite_mode
from speccache.methods.layers import parse_layer_ids
from speccache.methods.registry import DEFAULT_METHOD, method_for
from speccache.units import parse_bytes

__all__ = ["PrecomputeConfig", "check_out_outside_data", "set_flag_defaults"]


def _parsed(parse: Any, flag: str | None = None) -> dict[str, Any]:
    """A field's metadata: its flag's text is turned into the field's value by ``parse(text, flag)``; ``flag``
    where the flag is not the field's name (``--encode`` fills ``encodings``)."""
    return {"parse": parse, **({"flag": flag} if flag is not None else {})}


@dataclass
class PrecomputeConfig:
    """Validated ``precompute`` settings."""

    model: str
    data: str
    out: str
    method: str = DEFAULT_METHOD
    max_length: int = 2048
    batch_size: int = 8
    max_batch_tokens: int | None = None
    prefill_chunk: int | None = None
    batching: str = "sorted"
    shard_size: int = 256
    dtype: str = "bf16"
    aux_layers: list[int] | None = field(default=None, metadata=_parsed(parse_layer_ids))
    layers: list[int] | None = field(default=None, metadata=_parsed(parse_layer_ids))
    last_hidden: bool = False
    last_prenorm: bool = False
    draft_vocab_size: int | None = None
    draft_vocab_from: str | None = None
    supervision: str = "hidden"
    no_vision_inputs: bool = False
    encodings: dict[str, str] = field(
        default_factory=dict, metadata=_parsed(lambda text, flag: parse_encodings(text), "--encode")
    )
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
    image_root: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    resume: bool = False
    append: bool = False
    device: str | None = None
    timeout: float = 1800.0
    model_dtype: str = "auto"
    nonfinite: str = "fail"
    shard_target: str = "replicate"
    tp_size: int | None = None
    engine: str = DEFAULT_ENGINE
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float | None = None
    threads: int | None = None
    max_cache_bytes: int | None = field(default=None, metadata=_parsed(parse_bytes))
    max_cache_shards: int | None = None
    argv: list[str] | None = None
    """The command line (``speccache`` left out), recorded in the manifest's ``producer``."""
    _checked: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    """The settings :meth:`check` last passed: checked once, however many entry points check them."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PrecomputeConfig:
        """Build from parsed CLI arguments and check what can be checked without the model.

        Each field is read from its flag (``--max-length`` fills ``max_length``); a field whose flag the command
        lacks (``estimate`` has no ``--out``) keeps its default.

        Raises:
            UsageError: a bad flag value; the message names the flag and the fix.
            FileNotFoundError: the data file or a local model directory is missing.
        """
        values: dict[str, Any] = {}
        for f in fields(cls):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            dest = flag[2:].replace("-", "_")
            if not f.init or not hasattr(args, dest):
                continue
            value, parse = getattr(args, dest), f.metadata.get("parse")
            if parse is not None:
                if value is None:  # the flag not given: the field's default
                    continue
                value = parse(value, flag)
            values[f.name] = value
        cfg = cls(**values)
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
        check_image_root(self.image_root)
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


def set_flag_defaults(p: argparse.ArgumentParser) -> None:
    """Give each of ``p``'s flags that fills a :class:`PrecomputeConfig` field the field's default (the flags of
    :meth:`PrecomputeConfig.from_args`'s parsed fields keep ``None``: not given)."""
    dests = {action.dest for action in p._actions}
    p.set_defaults(
        **{
            f.name: f.default
            for f in fields(PrecomputeConfig)
            if f.name in dests and f.default is not MISSING and "parse" not in f.metadata
        }
    )
