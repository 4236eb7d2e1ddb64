"""A superset of target layers in one cache, and the readers of the methods that use it (its producer and presets
are :mod:`speccache.methods.layers_producer`).

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

Presets are named layer sets over the same producer (:data:`~speccache.methods.layers_producer.PRESETS`):
``layers`` (exactly ``--layers``), ``dspark`` (K layers + last hidden state;
default K=5 spread by the home project's ``build_target_layer_ids``),
``dflash`` (K=5 spread over ``[1, L - 3]`` as DFlash does, + last hidden state; fewer ids for a target
too shallow for 5 distinct ones, see :func:`dflash_layer_ids`)
and ``mtp`` (the last hidden state only). The side file ``layers_side.safetensors``
holds the target's ``embed_tokens`` ``[V, H]`` and ``lm_head`` ``[V, H]`` (what a
DSpark trainer initialises from, and what turns ``last_hidden_state`` into logits); for a tied target
(``tie_word_embeddings``) it stores the matrix once, records the tying in its metadata, and
:func:`~speccache.methods.side.read_side_file` gives ``lm_head`` as ``embed_tokens``.

Readers (:class:`LayerFeatureDataset` and the per-method builders) pick what a
method needs from any cache holding it and fail at open, naming the layers
present, when it does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from speccache.errors import CacheFormatError, UsageError
from speccache.format import SOURCE_ROW_KEY
from speccache.methods.eagle3 import default_aux_layers
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
    "EMBEDDINGS",
    "dspark_layer_ids",
    "dflash_layer_ids",
    "parse_layer_ids",
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
