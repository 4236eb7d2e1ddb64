"""A superset of target layers in one cache, and the presets and readers of the methods that use it.

One run of the target stores, per token (ragged, no padding), ``input_ids``
(int32), ``loss_mask`` (bool) and one key per requested feature:

* ``layer_NN`` for a layer id ``0 <= l < L - 1``: the output of decoder layer
  ``l`` (before the final norm). This is ``hidden_states[l + 1]`` of a
  transformers forward with ``output_hidden_states=True`` (the DSpark/DFlash
  convention) and also EAGLE-3's aux-layer rule: the two agree here.
* ``layer_emb`` for id ``-1``: the embedding output, ``hidden_states[0]``.
* ``last_hidden_state``: the final-norm output (``lm_head`` of it is the
  target's logits). In the DSpark/DFlash convention this *is* the feature of
  the last layer id ``L - 1`` (``hidden_states[L]``), so asking for ``L - 1``
  stores it once, under this key.
* ``layer_NN_prenorm`` for ``l = L - 1``: the last decoder layer's output before
  the final norm, EAGLE-3's rule for that id, stored with ``--last-prenorm`` (or
  when an EAGLE-3 aux layer is the last one).

The manifest's ``config.features`` records each feature key's layer id, its
``norm`` (``pre``, ``post`` or ``embed``) and its ``convention``; ``config.layers``
the ids in order, ``config.architecture`` the target's class and ``config.num_layers``.

Presets are named layer sets over the same producer (:data:`PRESETS`):
``layers`` (exactly ``--layers``), ``dspark`` (K layers + last hidden state;
default K=5 spread by the home project's ``build_target_layer_ids``),
``dflash`` (K=5 spread over ``[1, L - 3]`` as DFlash does, + last hidden state; fewer ids for a target
too shallow for 5 distinct ones, see :func:`dflash_layer_ids`)
and ``mtp`` (the last hidden state only). The side file ``layers_side.safetensors``
holds the target's ``embed_tokens`` ``[V, H]`` and ``lm_head`` ``[V, H]`` (what a
DSpark trainer initialises from, and what turns ``last_hidden_state`` into logits); for a tied target
(``tie_word_embeddings``) it stores the matrix once, records the tying in its metadata, and
:func:`~speccache.methods.base.read_side_file` gives ``lm_head`` as ``embed_tokens``.

Readers (:class:`LayerFeatureDataset` and the per-method builders) pick what a
method needs from any cache holding it and fail at open, naming the layers
present, when it does not.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from speccache.errors import CacheFormatError, UsageError
from speccache.format import LENGTHS_KEY, SOURCE_ROW_KEY, KeySpec, Schema, source_row_spec
from speccache.methods.base import (
    TIED_KEY,
    CaptureRequest,
    LoadedTarget,
    MethodPlan,
    MethodSettings,
    PrePass,
    stores_head,
    text_config,
    tied_metadata,
    ties_embeddings,
)
from speccache.methods.decoder import Capture, decoder_layers, forward_capturing
from speccache.methods.eagle3 import Supervision, default_aux_layers
from speccache.methods.finite import check_nonfinite_mode, guard_nonfinite
from speccache.read import CacheDataset, PadCollator, Sample
from speccache.read.follow import FollowDataset, check_follow_loader
from speccache.read.source import open_source, reader_sampler
from speccache.read.view import ViewDataset

CACHE_NAME = "layers"
SIDE_FILE = "layers_side.safetensors"
LAST_HIDDEN = "last_hidden_state"
EMBEDDINGS = "layer_emb"
DEFAULT_K = 5

__all__ = [
    "CACHE_NAME",
    "SIDE_FILE",
    "LAST_HIDDEN",
    "PRESETS",
    "Feature",
    "LayerSelection",
    "dspark_layer_ids",
    "dflash_layer_ids",
    "parse_layer_ids",
    "preset_selection",
    "layers_schema",
    "LayersTarget",
    "side_tensors",
    "LAYERS",
    "LayerFeatureDataset",
    "build_layer_dataloader",
    "dspark_dataset",
    "dflash_dataset",
    "mtp_dataset",
    "eagle3_dataset",
]


def dspark_layer_ids(num_layers: int, k: int = DEFAULT_K) -> list[int]:
    """DSpark's default: ``k`` ids spread evenly over ``[1, L - 1]`` (``build_target_layer_ids`` of its registry).

    For ``L = 32``, ``k = 5`` that is ``[1, 8, 16, 24, 31]``: the last id is the final-norm output. Like DSpark's,
    a target with fewer than ``k + 1`` layers gets one id per layer of the range; DSpark refuses ``L = 1``, where
    this returns its one-layer choice, the last id (``[0]``, the final-norm output).
    """
    k = max(1, min(k, num_layers - 1))
    last = num_layers - 1
    if k == 1:
        return [last]
    step = (last - 1) / (k - 1)
    return sorted({int(round(1 + i * step)) for i in range(k)})


def dflash_layer_ids(num_layers: int, k: int = DEFAULT_K) -> list[int]:
    """DFlash's default: ``k`` ids spread evenly over ``[1, L - 3]`` (``build_target_layer_ids`` of its Qwen3 draft).

    DFlash's own formula repeats ids when that range holds fewer than ``k`` (``L < k + 3``) and, when it is empty,
    leaves it (down to ``-1`` for ``L = 2``). Here a shallower target gets one id per layer of the range, and one
    whose range holds at most one id (``L <= 4``) gets DFlash's choice for a one-layer draft, ``L // 2``.
    """
    start, end = 1, num_layers - 3
    k = min(k, end - start + 1)
    if k <= 1:
        return [num_layers // 2]
    return [int(round(start + (i * (end - start)) / (k - 1))) for i in range(k)]


def parse_layer_ids(text: str | None, flag: str) -> list[int] | None:
    """The layer ids of ``flag``'s value, ``"1,15,28"`` (brackets allowed: ``"[1, 15, 28]"``); None when not given.

    Raises:
        UsageError: an entry is not an integer (the message names ``flag``).
    """
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r} must be comma-separated integers, e.g. 1,15,28") from None


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
    selection: LayerSelection, hidden_size: int, dtype: torch.dtype, encodings: Mapping[str, str] | None = None
) -> Schema:
    """The key schema of a layers cache.

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
    specs.append(source_row_spec())
    return {s.name: s for s in specs}


class LayersTarget:
    """A frozen target that turns padded token batches into the features of a :class:`LayerSelection`.

    Hooks on the decoder layers capture their outputs (and the first layer's input for the embeddings);
    ``last_hidden_state`` is the decoder's final-norm output.

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
    def forward_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Padded features ``[B, T, H]`` of one batch, in the model's dtype, keyed as stored."""
        embed = next((f.key for f in self.features if f.norm == "embed"), None)
        outputs: dict[Hashable, int] = {f.key: f.layer for f in self.features if f.norm == "pre"}
        last, captured = self.capture(input_ids, attention_mask, outputs, embed)
        captured[LAST_HIDDEN] = last
        return {f.key: captured[f.key] for f in self.features}

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
        feats = self.forward_features(batch["input_ids"].to(self.device), attention_mask)
        real = attention_mask.bool()
        rows: dict[str, torch.Tensor] = {
            "loss_mask": batch["loss_mask"].to(self.device)[real].bool(),
            LENGTHS_KEY: real.sum(1).to(torch.int64),
        }
        rows.update((name, value[real].to(self.dtype)) for name, value in feats.items())
        source = batch.get("source_row")
        guard_nonfinite(rows, self.nonfinite, self.layer_of, batch.get("sample_index"), source)
        out = {"input_ids": batch["input_ids"][batch["attention_mask"].bool()].to(torch.int32)}
        out.update((name, value.cpu()) for name, value in rows.items())
        out[SOURCE_ROW_KEY] = source if source is not None else torch.full((real.shape[0],), -1, dtype=torch.int64)
        return out


def side_tensors(embed_tokens: torch.Tensor, lm_head: torch.Tensor, tied: bool) -> dict[str, torch.Tensor]:
    """The side file's tensors from the target's input embeddings ``[V, H]`` and its whole LM head ``[V, H]``;
    a tied target's head is left out (:func:`~speccache.methods.base.stores_head`)."""
    head = {"lm_head": lm_head.contiguous()} if stores_head(embed_tokens, lm_head, tied) else {}
    return {"embed_tokens": embed_tokens.contiguous(), **head}


class LayersMethod:
    """The layer methods in ``precompute`` (:class:`speccache.methods.base.Method`): every preset of :data:`PRESETS`
    is this producer with its own :class:`LayerSelection`; no pre-pass."""

    cache_name = CACHE_NAME
    side_file = SIDE_FILE
    presets: Mapping[str, str] = PRESETS

    def check_flags(self, cfg: MethodSettings) -> None:
        """EAGLE-3's ``--supervision`` (other than hidden), ``--aux-layers``, ``--draft-vocab-size`` and
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
        return MethodPlan(
            schema=layers_schema(selection, int(text.hidden_size), dtype, cfg.encodings),
            config=selection.manifest_config(model_config),
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


# ---------------------------------------------------------------------------
# the trainer side


class LayerFeatureDataset(CacheDataset):
    """Samples of a method's fields, each the concatenation of stored feature keys, from any cache holding them.

    Args:
        cache_dir: a layers cache (any preset), or a view of layers caches (it opens as a
            :class:`speccache.read.view.ViewDataset` of these readers, one per source).
        fields: output name -> the layer ids it concatenates, in order; the id ``"last"`` is ``last_hidden_state``.
            A layer id follows the DSpark/DFlash convention unless ``prenorm`` is set (EAGLE-3's rule: the
            last layer's id then means its output before the final norm).
        prenorm: resolve layer ids with EAGLE-3's pre-norm rule.
        verify, **kwargs: passed to :class:`speccache.read.CacheDataset`.

    Raises:
        CacheFormatError: the cache lacks a requested layer (the message lists the layers it has).
    """

    def __init__(
        self,
        cache_dir: str,
        fields: Mapping[str, Sequence[int | str]],
        *,
        prenorm: bool = False,
        verify: bool = True,
        **kwargs: Any,
    ) -> None:
        self.fields = {name: list(ids) for name, ids in fields.items()}
        self._prenorm = prenorm
        super().__init__(cache_dir, None, cache_name=CACHE_NAME, verify=verify, **kwargs)

    def _resolve(self, layer: int | str, features: dict[str, dict[str, Any]]) -> str:
        num_layers = int(self.manifest.config["num_layers"])
        if layer == "last":
            wanted = (num_layers - 1, "post")
        elif layer == -1:
            wanted = (-1, "embed")
        elif self._prenorm or layer != num_layers - 1:
            wanted = (int(layer), "pre")
        else:
            wanted = (int(layer), "post")
        for key, f in features.items():
            if (f["layer"], f["norm"]) == wanted:
                return key
        present = ", ".join(
            f"{f['layer']} ({'embeddings' if f['norm'] == 'embed' else f['norm'] + '-norm'}, {key})"
            for key, f in sorted(features.items(), key=lambda kv: (kv[1]["layer"], kv[1]["norm"]))
        )
        rule = {
            "post": "(after the final norm)",
            "embed": "(the embedding output)",
            "pre": "before the final norm (EAGLE-3's rule)" if wanted[0] == num_layers - 1 else "(its output)",
        }[wanted[1]]
        raise CacheFormatError(
            f"{self.cache_dir}: layer {wanted[0]} {rule} is not in this cache; it holds layers {present}. "
            "Re-run precompute with --method layers including it "
            "(or --last-prenorm for the last layer before its norm)."
        )

    def _stored_keys(self, keys: list[str]) -> list[str]:
        features = self.manifest.config.get("features") or {}
        self.sources = {name: [self._resolve(i, features) for i in ids] for name, ids in self.fields.items()}
        needed = {"input_ids", "loss_mask", SOURCE_ROW_KEY} | {k for ks in self.sources.values() for k in ks}
        return [k for k in self.manifest.schema if k in needed]

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        out: list[Sample] = []
        for view in super().__getitems__(indices):
            sample: Sample = {k: view[k] for k in ("input_ids", "loss_mask", SOURCE_ROW_KEY) if k in view}
            for name, keys in self.sources.items():
                parts = [view[k] for k in keys]
                sample[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            out.append(sample)
        return out

    def collator(self, pin_memory: bool | None = None) -> PadCollator:
        """The padding collator of these samples (adds ``attention_mask`` and ``lengths``)."""
        return PadCollator({"input_ids", "loss_mask", *self.sources}, pin_memory=pin_memory)


def _config(cache_dir: str) -> dict[str, Any]:
    return open_source(cache_dir, CACHE_NAME).config


def dspark_dataset(cache_dir: str, layers: Sequence[int] | None = None, **kwargs: Any) -> LayerFeatureDataset:
    """DSpark samples: ``input_ids``, ``loss_mask``, ``target_hidden_states`` (layers concatenated in order) and
    ``target_last_hidden_states``. ``layers`` defaults to DSpark's default ids for this target."""
    ids = list(layers) if layers is not None else dspark_layer_ids(int(_config(cache_dir)["num_layers"]))
    fields: dict[str, Sequence[int | str]] = {"target_hidden_states": ids, "target_last_hidden_states": ["last"]}
    return LayerFeatureDataset(cache_dir, fields, **kwargs)


def dflash_dataset(cache_dir: str, layers: Sequence[int] | None = None, **kwargs: Any) -> LayerFeatureDataset:
    """DFlash samples: as :func:`dspark_dataset`, ``layers`` defaulting to DFlash's ids for this target."""
    ids = list(layers) if layers is not None else dflash_layer_ids(int(_config(cache_dir)["num_layers"]))
    fields: dict[str, Sequence[int | str]] = {"target_hidden_states": ids, "target_last_hidden_states": ["last"]}
    return LayerFeatureDataset(cache_dir, fields, **kwargs)


def mtp_dataset(cache_dir: str, **kwargs: Any) -> LayerFeatureDataset:
    """MTP samples: ``input_ids``, ``loss_mask``, ``last_hidden_state``."""
    return LayerFeatureDataset(cache_dir, {LAST_HIDDEN: ["last"]}, **kwargs)


def eagle3_dataset(cache_dir: str, aux_layers: Sequence[int] | None = None, **kwargs: Any) -> LayerFeatureDataset:
    """EAGLE-3 samples (``hidden`` supervision, full vocabulary): ``input_ids``, ``loss_mask``,
    ``aux_hidden_states`` (three decoder outputs before the final norm, low/mid/high) and ``last_hidden_state``,
    as :class:`speccache.methods.eagle3.Eagle3CacheDataset` reads them from an EAGLE-3 cache."""
    ids = list(aux_layers) if aux_layers is not None else default_aux_layers(int(_config(cache_dir)["num_layers"]))
    fields: dict[str, Sequence[int | str]] = {"aux_hidden_states": ids, LAST_HIDDEN: ["last"]}
    return LayerFeatureDataset(cache_dir, fields, prenorm=True, **kwargs)


def build_layer_dataloader(
    dataset: LayerFeatureDataset | ViewDataset | FollowDataset,
    batch_size: int,
    shuffle: bool,
    *,
    num_workers: int = 0,
    distributed: bool = False,
    seed: int = 0,
    sampler: Sampler | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader of padded batches (with ``attention_mask`` and ``lengths``) of a method's dataset.

    Args:
        dataset: e.g. ``dspark_dataset(cache_dir)`` (of a cache or a view: a view's ``--weights`` are honoured).
        batch_size, shuffle, num_workers, distributed, seed, sampler, **loader_kwargs: as
            :func:`speccache.methods.eagle3.build_eagle3_dataloader`. A following dataset
            (``dspark_dataset(cache, follow=Follow(...))``) brings its own order and share: its loader is a
            :class:`speccache.read.follow.FollowLoader`, and ``shuffle`` must match its settings.

    Raises:
        RuntimeError: ``distributed`` without an initialised process group.
        ValueError: a following dataset with a ``sampler``, or a ``shuffle`` other than its own.
    """
    if isinstance(dataset, FollowDataset):
        check_follow_loader(dataset, shuffle, sampler)
        return dataset.loader(batch_size, num_workers=num_workers, **loader_kwargs)
    if sampler is None:
        sampler = reader_sampler(dataset, shuffle=shuffle, distributed=distributed, seed=seed)
    loader_kwargs.setdefault("pin_memory", torch.cuda.is_available())
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=dataset.collator(),
        **loader_kwargs,
    )
