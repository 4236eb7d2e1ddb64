"""The method protocol: what ``speccache precompute`` asks of a speculative method (``--method``).

A method declares what it reads of the target (a :class:`CaptureRequest`), an engine computes it for each
batch, and the method turns it into the rows the writer takes. ``precompute/run.py`` only looks a method up
in :mod:`.registry` and calls it: a new method is one module of this room and one registry entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xxhash
from torch import nn

from speccache.data import TokenizedSamples
from speccache.errors import UsageError
from speccache.format import Schema
from speccache.methods.decoder import Capture, is_vision_language
from speccache.write import Comm

__all__ = [
    "stores_vision_inputs",
    "CaptureRequest",
    "LoadedTarget",
    "Method",
    "MethodPlan",
    "MethodTarget",
    "PrePass",
    "model_config_hash",
    "text_config",
]


def model_config_hash(model_config: Any) -> str:
    """The manifest's ``model_config_hash``: the model config without the entries that name where and by which
    transformers it was saved, so a copy of a target hashes the same."""
    body = model_config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash"):
        body.pop(volatile, None)
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, default=str).encode())


def text_config(model_config: Any) -> Any:
    """The text model's config of ``model_config`` (itself for a text-only model)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


@dataclass(frozen=True)
class CaptureRequest:
    """What a method reads of the target for every token, besides the final-norm output (which every engine
    returns as ``last_hidden_state``; logits are the method's, from the LM head of :attr:`LoadedTarget.model`).

    Attributes:
        layers: decoder layers whose outputs (before the final norm) it reads; the last layer's is the pre-norm
            last state.
        embeddings: whether it reads the embedding output (the first decoder layer's input).
    """

    layers: tuple[int, ...] = ()
    embeddings: bool = False


@dataclass
class LoadedTarget:
    """A target ready for inference, as an engine hands it to a method, and its full embedding matrices.

    Attributes:
        model: the causal LM (plain, FSDP2-wrapped, tensor-parallel, or only its modules outside the decoder
            layers when an engine runs those itself): what a method applies the LM head of.
        input_embeddings: the full input embedding matrix, on the CPU (called only by the writing rank).
        output_embeddings: the full LM-head matrix, on the CPU (called only by the writing rank).
    """

    model: nn.Module
    input_embeddings: Callable[[], torch.Tensor]
    output_embeddings: Callable[[], torch.Tensor]


@dataclass
class MethodPlan:
    """What a method decided from the config and the model config, before the data or the model is read.

    Attributes:
        schema: the cache's keys (``source_row`` included; precompute adds what is not the method's).
        config: the method's fields of the manifest's ``config`` (what a resume compares).
        request: what it reads of the target.
        draft_vocab_size: the vocabulary a draft predicts over.
        settings: the method's own decisions, for its :meth:`Method.prepare`, :meth:`Method.target` and
            :meth:`Method.side_tensors`.
        side_metadata: its side file's safetensors metadata besides ``speccache_side`` (what its readers need
            to know of the layout, e.g. that a tied target's embedding is stored once).
    """

    schema: Schema
    config: dict[str, Any]
    request: CaptureRequest
    draft_vocab_size: int
    settings: Any
    side_metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrePass:
    """What a method's whole-dataset pre-pass (before the model is loaded) may read.

    Attributes:
        samples: every sample of the cache's new data.
        tokenizer: the target's tokenizer.
        shard_size: samples per shard (which block of samples a rank holds).
        comm: the process group (a pre-pass that counts sums over every rank).
        appending_to: the sealed cache an ``--append`` extends, else ``None``: what its pre-pass decided is
            kept from that cache (its side file).
    """

    samples: TokenizedSamples
    tokenizer: Any
    shard_size: int
    comm: Comm
    appending_to: str | None


class MethodTarget(Protocol):
    """A method's producer of rows over an opened target."""

    def compute_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A padded token batch in, ragged cache rows (and ``__lengths__``) out, on the CPU."""


class MethodSettings(Protocol):
    """The settings a method reads from a run's :class:`speccache.precompute.config.PrecomputeConfig` (the flags of
    ``speccache precompute`` of the same names)."""

    model: str
    method: str
    aux_layers: list[int] | None
    layers: list[int] | None
    last_hidden: bool
    last_prenorm: bool
    draft_vocab_size: int | None
    draft_vocab_from: str | None
    supervision: str
    encodings: dict[str, str]
    no_vision_inputs: bool


class Method(Protocol):
    """A speculative method's part in ``precompute``. ``cfg`` holds the run's :class:`MethodSettings`.

    A method with settings of its own defines ``add_arguments(parser)``, adding their flags to ``precompute``'s and
    ``estimate``'s parser (their defaults are ``PrecomputeConfig``'s). A method may define
    ``padded_token_bytes(plan, hidden_size, itemsize) -> int``: the bytes per token of the
    padded layout other tools write for it, which a run's summary and stats compare the cache with (EAGLE-3's
    full-probability layout); without it they make no comparison.

    Attributes:
        cache_name: the manifest's ``cache_name`` (what its readers open).
        side_file: the name of its side file.
        presets: each ``--method`` name it answers to, and what that stores.
    """

    cache_name: str
    side_file: str
    presets: Mapping[str, str]

    def check_flags(self, cfg: MethodSettings) -> None:
        """Refuse, before anything is read, the flags this method does not take (``UsageError``: the CLI exits 2)."""

    def plan(self, cfg: MethodSettings, model_config: Any, dtype: torch.dtype) -> MethodPlan:
        """Decide the schema (float features stored as ``dtype``), the manifest fields and the capture request
        from the settings and the model config (``ValueError`` for bad settings)."""

    def prepare(self, plan: MethodPlan, data: PrePass) -> Any:
        """The whole-dataset pre-pass (e.g. EAGLE-3's draft vocabulary), run before the model is loaded."""

    def target(
        self,
        plan: MethodPlan,
        loaded: LoadedTarget,
        capture: Capture,
        prepared: Any,
        dtype: torch.dtype,
        nonfinite: str,
    ) -> MethodTarget:
        """The producer of rows over ``loaded``, whose hidden states ``capture`` computes."""

    def side_tensors(self, plan: MethodPlan, loaded: LoadedTarget, prepared: Any) -> dict[str, torch.Tensor]:
        """The tensors of its side file (called by the writing rank only)."""


def stores_vision_inputs(cfg: MethodSettings, model_config: Any, config: dict[str, Any]) -> bool:
    """Whether a method stores a vision-language target's vision inputs (``image_embeds``, an M-RoPE target's
    ``positions``): yes, unless ``--no-vision-inputs``, which is recorded in the manifest's ``config`` (only when
    set, so that a resume compares it).

    Raises:
        UsageError: ``--no-vision-inputs`` for a text-only target.
    """
    vision = is_vision_language(model_config)
    if cfg.no_vision_inputs:
        if not vision:
            raise UsageError(
                f"--no-vision-inputs: {cfg.model} is a text-only target, whose cache has no vision inputs to "
                "leave out; drop the flag"
            )
        config["vision_inputs"] = False
    return vision and not cfg.no_vision_inputs
