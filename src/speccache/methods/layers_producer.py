"""The layer methods' producer: the presets (:data:`PRESETS`), what a run stores (:class:`LayerSelection`), the
key schema, the side file, the target that computes the rows (:class:`LayersTarget`) and the method ``precompute``
runs (:data:`LAYERS`).

What a layers cache stores and its trainer-facing readers: :mod:`speccache.methods.layers`.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speccache.errors import UsageError
from speccache.format import LENGTHS_KEY, SOURCE_ROW_KEY, KeySpec, Schema, source_row_spec
from speccache.methods.base import (
    CaptureRequest,
    LoadedTarget,
    MethodPlan,
    MethodSettings,
    PrePass,
    stores_vision_inputs,
    text_config,
)
from speccache.methods.decoder import (
    POSITIONS,
    Capture,
    batch_image_inputs,
    capture_batch,
    decoder_layers,
    forward_capturing,
    is_mrope,
)
from speccache.methods.eagle3 import Supervision
from speccache.methods.finite import check_nonfinite_mode, guard_nonfinite
from speccache.methods.layers import (
    CACHE_NAME,
    EMBEDDINGS,
    LAST_HIDDEN,
    SIDE_FILE,
    dflash_layer_ids,
    dspark_layer_ids,
)
from speccache.methods.side import TIED_KEY, stores_head, tied_metadata, ties_embeddings

__all__ = [
    "PRESETS",
    "Feature",
    "LayerSelection",
    "preset_selection",
    "layers_schema",
    "LayersTarget",
    "side_tensors",
    "LayersMethod",
    "LAYERS",
]


@dataclass(frozen=True)
class Feature:
    """One stored feature: its key, the layer id it comes from, and whether it is before/after the final norm."""

    key: str
    layer: int
    norm: str  # "pre" (decoder layer output), "post" (final-norm output) or "embed" (embedding output)

    @property
    def convention(self) -> str:
        """Where the feature sits in a transformers forward with ``output_hidden_states=True``."""
        if self.norm == "embed":
            return "hidden_states[0] (embedding output)"
        if self.norm == "post":
            return (
                f"hidden_states[{self.layer + 1}] (final-norm output; the DSpark/DFlash feature of layer {self.layer})"
            )
        if self.key.endswith("_prenorm"):
            return f"decoder layer {self.layer} output before the final norm (EAGLE-3's aux rule; not in hidden_states)"
        return (
            f"hidden_states[{self.layer + 1}] (decoder layer {self.layer} output: the DSpark/DFlash feature of "
            f"layer {self.layer} and EAGLE-3's aux rule alike)"
        )

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "norm": self.norm, "convention": self.convention}


@dataclass(frozen=True)
class LayerSelection:
    """What a layers run stores.

    Args:
        layers: layer ids in the DSpark/DFlash convention (``-1`` the embeddings, ``L - 1`` the final-norm output).
        num_layers: ``L``, the target's decoder layers.
        last_hidden: also store ``last_hidden_state``.
        last_prenorm: also store the last decoder layer's output before the final norm.
    """

    layers: tuple[int, ...]
    num_layers: int
    last_hidden: bool = False
    last_prenorm: bool = False

    def __post_init__(self) -> None:
        ids, last = list(self.layers), self.num_layers - 1
        if len(set(ids)) != len(ids) or any(not -1 <= i <= last for i in ids) or ids != sorted(ids):
            raise UsageError(
                f"--layers {ids} must be distinct increasing layer ids in [-1, {last}] (-1 is the embedding output, "
                f"{last} the final-norm output; the target has {self.num_layers} layers)"
            )
        if not ids and not self.last_hidden and not self.last_prenorm:
            raise UsageError("--method layers stores nothing: give --layers, --last-hidden or --last-prenorm")

    def manifest_config(self, model_config: Any) -> dict[str, Any]:
        """The manifest's config fields of this selection of ``model_config``'s layers (what readers resolve ids by)."""
        return {
            "layers": list(self.layers),
            "last_hidden": self.last_hidden,
            "last_prenorm": self.last_prenorm,
            "num_layers": self.num_layers,
            "architecture": (getattr(model_config, "architectures", None) or [type(model_config).__name__])[0],
            "model_type": getattr(model_config, "model_type", None),
            "features": {f.key: f.to_json() for f in self.features()},
        }

    def features(self) -> list[Feature]:
        """The stored features, in layer order (``last_hidden_state`` and the pre-norm last layer at the end)."""
        last = self.num_layers - 1
        out = [
            Feature(EMBEDDINGS, -1, "embed") if i == -1 else Feature(f"layer_{i:02d}", i, "pre")
            for i in self.layers
            if i != last
        ]
        if self.last_prenorm:
            out.append(Feature(f"layer_{last:02d}_prenorm", last, "pre"))
        if self.last_hidden or last in self.layers:
            out.append(Feature(LAST_HIDDEN, last, "post"))
        return out


PRESETS: dict[str, str] = {
    "layers": "exactly --layers (with --last-hidden / --last-prenorm as given)",
    "dspark": "DSpark: K=5 layers spread over [1, L-1] (its build_target_layer_ids) + last_hidden_state",
    "dflash": "DFlash: K=5 layers spread over [1, L-3] + last_hidden_state",
    "mtp": "MTP heads: last_hidden_state only",
}
"""The layer-family methods of ``--method`` and what each stores."""


def preset_selection(
    method: str, num_layers: int, layers: Sequence[int] | None, last_hidden: bool, last_prenorm: bool
) -> LayerSelection:
    """The layer selection of a preset; ``layers`` overrides a preset's default ids.

    Raises:
        ValueError: an unknown preset, ``--method layers`` without ``--layers``, ``--layers`` given to ``mtp``,
            or bad ids.
    """
    if method == "layers":
        if layers is None:
            raise UsageError("--method layers needs --layers, e.g. --layers 1,9,17 (layer ids; -1 the embeddings)")
        return LayerSelection(tuple(layers), num_layers, last_hidden, last_prenorm)
    if method == "mtp":
        if layers:
            raise UsageError("--method mtp stores the last hidden state only; drop --layers (or use --method layers)")
        return LayerSelection((), num_layers, True, last_prenorm)
    if method in ("dspark", "dflash"):
        default = dspark_layer_ids if method == "dspark" else dflash_layer_ids
        ids = tuple(layers) if layers is not None else tuple(default(num_layers))
        return LayerSelection(ids, num_layers, True, last_prenorm)
    raise UsageError(f"--method {method!r} is not a layer preset; choose one of {', '.join(PRESETS)}")


def layers_schema(
    selection: LayerSelection,
    hidden_size: int,
    dtype: torch.dtype,
    encodings: Mapping[str, str] | None = None,
    positions: bool = False,
) -> Schema:
    """The key schema of a layers cache (with ``positions``: an M-RoPE target's 3-D positions of each token, as
    :func:`speccache.methods.eagle3_producer.eagle3_schema` stores them).

    Raises:
        ValueError: an encoding names a key that is not a feature of this cache.
    """
    enc = dict(encodings or {})
    names = [f.key for f in selection.features()]
    unknown = sorted(set(enc) - set(names))
    if unknown:
        raise UsageError(f"--encode names {unknown}, which are not float features of this cache; choose from {names}")
    specs = [KeySpec("input_ids", torch.int32, (), ragged=True), KeySpec("loss_mask", torch.bool, (), ragged=True)]
    specs += [KeySpec(n, dtype, (hidden_size,), ragged=True, encoding=enc.get(n, "raw")) for n in names]
    if positions:
        specs.append(KeySpec(POSITIONS, torch.int32, (3,), ragged=True))
    specs.append(source_row_spec())
    return {s.name: s for s in specs}


class LayersTarget:
    """A frozen target that turns padded token batches into the features of a :class:`LayerSelection`.

    Hooks on the decoder layers capture their outputs (and the first layer's input for the embeddings);
    ``last_hidden_state`` is the decoder's final-norm output. A vision-language target's batch runs with its
    images, as for EAGLE-3 (:func:`speccache.methods.decoder.forward_capturing`): the embeddings are then the
    merged input embeddings, and an M-RoPE target's rows add its ``positions``.

    Args:
        model: a Hugging Face causal LM (eval mode is set here).
        selection: what to store.
        dtype: storage dtype of the features.
        nonfinite: ``fail`` or ``skip`` samples whose features are NaN/Inf (see :mod:`speccache.methods.finite`).
        capture: the forward that captures the layers (default: ``model``'s own, :func:`forward_capturing`).

    Raises:
        ValueError: the model's layer count differs from the selection's, or a bad ``nonfinite`` mode.
    """

    def __init__(
        self,
        model: nn.Module,
        selection: LayerSelection,
        dtype: torch.dtype,
        nonfinite: str = "fail",
        capture: Capture | None = None,
    ) -> None:
        self.nonfinite = check_nonfinite_mode(nonfinite)
        self.model = model.eval()
        self.capture: Capture = capture or functools.partial(forward_capturing, self.model)
        self.layers = decoder_layers(model)
        if len(self.layers) != selection.num_layers:
            raise ValueError(f"the model has {len(self.layers)} decoder layers, the plan {selection.num_layers}")
        self.features = selection.features()
        self.dtype = dtype
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def forward_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Padded features ``[B, T, H]`` of one batch, in the model's dtype, keyed as stored (and an M-RoPE
        target's ``positions``, int32)."""
        embed = next((f.key for f in self.features if f.norm == "embed"), None)
        outputs: dict[Hashable, int] = {f.key: f.layer for f in self.features if f.norm == "pre"}
        last, captured = capture_batch(self.capture, input_ids, attention_mask, outputs, embed, image_inputs)
        captured[LAST_HIDDEN] = last
        feats = {f.key: captured[f.key] for f in self.features}
        if POSITIONS in captured:
            feats[POSITIONS] = captured[POSITIONS].to(torch.int32)
        return feats

    def layer_of(self, key: str, column: int) -> str:
        """Where feature ``key`` comes from in the target (for error messages)."""
        f = next(f for f in self.features if f.key == key)
        return f.convention

    def compute_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``compute_batch`` for the write loops: a padded token batch in, ragged cache rows out.

        Raises:
            NonFiniteFeatureError: a feature is NaN/Inf and the mode is ``fail``.
        """
        attention_mask = batch["attention_mask"].to(self.device)
        images = batch_image_inputs(self.model.config, batch, self.device)
        feats = self.forward_features(batch["input_ids"].to(self.device), attention_mask, images)
        real = attention_mask.bool()
        rows: dict[str, torch.Tensor] = {
            "loss_mask": batch["loss_mask"].to(self.device)[real].bool(),
            LENGTHS_KEY: real.sum(1).to(torch.int64),
        }
        rows.update(
            (name, value[real].to(self.dtype) if value.is_floating_point() else value[real])
            for name, value in feats.items()
        )
        source = batch.get("source_row")
        guard_nonfinite(rows, self.nonfinite, self.layer_of, batch.get("sample_index"), source)
        out = {"input_ids": batch["input_ids"][batch["attention_mask"].bool()].to(torch.int32)}
        out.update((name, value.cpu()) for name, value in rows.items())
        out[SOURCE_ROW_KEY] = source if source is not None else torch.full((real.shape[0],), -1, dtype=torch.int64)
        return out


def side_tensors(embed_tokens: torch.Tensor, lm_head: torch.Tensor, tied: bool) -> dict[str, torch.Tensor]:
    """The side file's tensors from the target's input embeddings ``[V, H]`` and its whole LM head ``[V, H]``;
    a tied target's head is left out (:func:`~speccache.methods.side.stores_head`)."""
    head = {"lm_head": lm_head.contiguous()} if stores_head(embed_tokens, lm_head, tied) else {}
    return {"embed_tokens": embed_tokens.contiguous(), **head}


class LayersMethod:
    """The layer methods in ``precompute`` (:class:`speccache.methods.base.Method`): every preset of :data:`PRESETS`
    is this producer with its own :class:`LayerSelection`; no pre-pass."""

    cache_name = CACHE_NAME
    side_file = SIDE_FILE
    presets: Mapping[str, str] = PRESETS

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """``--layers``, ``--last-hidden`` and ``--last-prenorm``."""
        p.add_argument(
            "--layers",
            help="layer methods: layer ids to store, e.g. 1,9,17 (-1 the embeddings; default: the preset's)",
        )
        p.add_argument("--last-hidden", action="store_true", help="--method layers: also store last_hidden_state")
        p.add_argument(
            "--last-prenorm",
            action="store_true",
            help="layer methods: also store the last layer's output before the norm",
        )

    def check_flags(self, cfg: MethodSettings) -> None:
        """EAGLE-3's ``--supervision`` (other than hidden), ``--aux-layers``, ``--draft-vocab-size``,
        ``--draft-vocab-from`` are refused."""
        if Supervision.parse(cfg.supervision).mode != "hidden":
            raise UsageError(
                f"--supervision {cfg.supervision} is for --method eagle3; --method {cfg.method} stores "
                "last_hidden_state, from which the LM head in its side file gives the logits"
            )
        if cfg.aux_layers is not None or cfg.draft_vocab_size is not None or cfg.draft_vocab_from is not None:
            raise UsageError(
                "--aux-layers and --draft-vocab-size are for --method eagle3, as is --draft-vocab-from; --method "
                f"{cfg.method} takes --layers (the EAGLE-3 reader of a layers cache picks its aux layers from them)"
            )

    def plan(self, cfg: MethodSettings, model_config: Any, dtype: torch.dtype) -> MethodPlan:
        """The preset's selection (:func:`preset_selection`) and its schema.

        Raises:
            ValueError: bad layer ids or encodings, or flags the preset does not take.
        """
        text = text_config(model_config)
        num_layers = int(text.num_hidden_layers)
        selection = preset_selection(cfg.method, num_layers, cfg.layers, cfg.last_hidden, cfg.last_prenorm)
        features = selection.features()
        config = selection.manifest_config(model_config)
        positions = stores_vision_inputs(cfg, model_config, config) and is_mrope(model_config)
        return MethodPlan(
            schema=layers_schema(selection, int(text.hidden_size), dtype, cfg.encodings, positions),
            config=config,
            request=CaptureRequest(
                layers=tuple(f.layer for f in features if f.norm == "pre"),
                embeddings=any(f.norm == "embed" for f in features),
            ),
            draft_vocab_size=int(text.vocab_size),
            settings=selection,
            side_metadata=tied_metadata(ties_embeddings(model_config)),
        )

    def prepare(self, plan: MethodPlan, data: PrePass) -> None:
        """No pre-pass."""

    def target(
        self,
        plan: MethodPlan,
        loaded: LoadedTarget,
        capture: Capture,
        prepared: None,
        dtype: torch.dtype,
        nonfinite: str,
    ) -> LayersTarget:
        """A :class:`LayersTarget` over ``capture``."""
        return LayersTarget(loaded.model, plan.settings, dtype, nonfinite, capture)

    def side_tensors(self, plan: MethodPlan, loaded: LoadedTarget, prepared: None) -> dict[str, torch.Tensor]:
        """The whole ``embed_tokens`` and ``lm_head`` (once for a tied target)."""
        tied = TIED_KEY in plan.side_metadata
        return side_tensors(loaded.input_embeddings(), loaded.output_embeddings(), tied)


LAYERS = LayersMethod()
"""The layer methods (registered as each ``--method`` of :data:`PRESETS`)."""
