"""EAGLE-3: what the cache stores for a draft, how it is computed from a target, and how a trainer reads it.

Per sample (ragged, no padding), row ``t`` of every feature is the target's
state after reading tokens ``0..t``:

* ``input_ids`` (int32) and ``loss_mask`` (bool, 1 where token ``t`` is an assistant token);
* ``aux_hidden_states`` ``[T, 3H]``: outputs of the three aux decoder layers
  (before the final norm), concatenated low/mid/high;
* the supervision for token ``t + 1``, one of
  ``hidden``: ``last_hidden_state`` ``[T, H]`` (the final-norm output; the
  target's logits are ``lm_head(last_hidden_state)``, which :class:`TargetHead`
  recomputes on the trainer's device from the LM-head rows in the side file),
  ``probs``: ``target_probs`` ``[T, Vd]`` (softmax over the draft-vocabulary
  columns of the logits), or ``topk:K``: ``topk_probs``/``topk_ids`` ``[T, K]``
  (renormalised; the reader scatters them back to ``[T, Vd]``);
* ``in_draft`` (bool), only when the draft vocabulary is smaller than the
  target's: whether the target's argmax at ``t`` lies in the draft vocabulary.

So the draft's prediction at position ``t`` is trained against row ``t`` of the
supervision, and counts when token ``t + 1`` is an assistant token
(``loss_mask[t + 1]``); ``position_mask[t]`` is ``loss_mask[t]`` and ``in_draft[t]``
as stored, and a trainer shifts it exactly as it shifts ``loss_mask``.

The side file ``eagle3_side.safetensors`` holds ``embed_tokens`` ``[V, H]`` (the
draft initialises its embedding from it), ``lm_head`` ``[Vd, H]`` (the draft rows),
``selected_token_ids`` (int64 ``[Vd]``, ascending), ``d2t`` (int64 ``[Vd]``,
``target_id = draft_id + d2t[draft_id]`` as vLLM uses it) and ``t2d`` (bool ``[V]``,
as SGLang uses it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from speccache.data import SOURCE_ROW_KEY, source_row_spec
from speccache.errors import CacheFormatError
from speccache.format import LENGTHS_KEY, STAT_PREFIX, KeySpec, Schema, ShardFile
from speccache.methods.decoder import Capture, decoder_layers, forward_capturing
from speccache.methods.finite import check_nonfinite_mode, guard_nonfinite
from speccache.read import CacheDataset, PadCollator, Sample
from speccache.read.source import open_source, reader_sampler
from speccache.read.view import ViewDataset

CACHE_NAME = "eagle3"
SIDE_FILE = "eagle3_side.safetensors"

__all__ = [
    "CACHE_NAME",
    "SIDE_FILE",
    "Supervision",
    "default_aux_layers",
    "check_aux_layers",
    "eagle3_schema",
    "select_draft_vocab",
    "vocab_mapping",
    "Eagle3Target",
    "Eagle3CacheDataset",
    "build_eagle3_dataloader",
    "TargetHead",
]


@dataclass(frozen=True)
class Supervision:
    """The supervision mode: ``hidden``, ``probs`` or ``topk`` with ``k``."""

    mode: str
    k: int = 0

    @classmethod
    def parse(cls, text: str) -> Supervision:
        """Parse ``hidden``, ``probs`` or ``topk:K``.

        Raises:
            ValueError: anything else; names the argument and the choices.
        """
        if text in ("hidden", "probs"):
            return cls(text)
        if text.startswith("topk:"):
            try:
                k = int(text[5:])
            except ValueError:
                k = 0
            if k >= 1:
                return cls("topk", k)
        raise ValueError(f"--supervision {text!r} is not one of hidden, probs, topk:K (K >= 1)")

    def __str__(self) -> str:
        return f"topk:{self.k}" if self.mode == "topk" else self.mode


def has_logits(supervision: Supervision, full_vocab: bool) -> bool:
    """Whether the producer computes the target's logits (then samples also record its entropy and top-1)."""
    return supervision.mode != "hidden" or not full_vocab


def sample_stat_names(supervision: Supervision, full_vocab: bool) -> tuple[str, ...]:
    """The per-sample statistics an EAGLE-3 shard records (besides ``tokens``)."""
    return ("supervised_tokens", *(("mean_entropy", "mean_top1") if has_logits(supervision, full_vocab) else ()))


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers ``[1, L//2 - 1, L - 4]`` for ``L`` decoder layers.

    Those collide below 7 layers; there (``3 <= L < 7``) the first, middle and last layers
    ``[0, L//2, L - 1]`` are used instead, three distinct layers.
    """
    layers = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(layers)) == 3 and layers[0] < layers[1] < layers[2]:
        return layers
    return [0, num_layers // 2, num_layers - 1]


def check_aux_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Return ``layers`` if they are exactly three distinct ids in ``[0, num_layers)``.

    Raises:
        ValueError: names the argument, the offending ids and the valid range.
    """
    layers = list(layers)
    if len(layers) != 3 or len(set(layers)) != 3 or any(not 0 <= i < num_layers for i in layers):
        raise ValueError(
            f"--aux-layers {layers} must be exactly 3 distinct decoder layer ids in [0, {num_layers - 1}] "
            f"(the target has {num_layers} layers; the default is {default_aux_layers(num_layers)})"
        )
    return layers


def eagle3_schema(
    hidden_size: int,
    dtype: torch.dtype,
    supervision: Supervision,
    draft_vocab_size: int,
    full_vocab: bool,
    encodings: Mapping[str, str] | None = None,
) -> Schema:
    """The key schema of an EAGLE-3 cache.

    Args:
        hidden_size: the target's hidden size ``H``.
        dtype: storage dtype of float features.
        supervision: what supervises the draft.
        draft_vocab_size: ``Vd``.
        full_vocab: whether the draft vocabulary is the whole target vocabulary (then no ``in_draft`` key).
        encodings: key -> encoding for float features (default ``raw``).

    Raises:
        ValueError: an encoding names a key that is not a float feature of this schema, or cannot store ``dtype``.
    """
    enc = dict(encodings or {})
    float_keys: dict[str, tuple[int, ...]] = {"aux_hidden_states": (3 * hidden_size,)}
    if supervision.mode == "hidden":
        float_keys["last_hidden_state"] = (hidden_size,)
    elif supervision.mode == "probs":
        float_keys["target_probs"] = (draft_vocab_size,)
    else:
        float_keys["topk_probs"] = (supervision.k,)
    unknown = sorted(set(enc) - set(float_keys))
    if unknown:
        raise ValueError(
            f"--encode names {unknown}, which are not float features of this cache; choose from {sorted(float_keys)}"
        )
    specs = [KeySpec("input_ids", torch.int32, (), ragged=True), KeySpec("loss_mask", torch.bool, (), ragged=True)]
    specs += [
        KeySpec(name, dtype, shape, ragged=True, encoding=enc.get(name, "raw")) for name, shape in float_keys.items()
    ]
    if supervision.mode == "topk":
        specs.append(KeySpec("topk_ids", torch.int32, (supervision.k,), ragged=True))
    if not full_vocab:
        specs.append(KeySpec("in_draft", torch.bool, (), ragged=True))
    specs.append(source_row_spec())
    return {s.name: s for s in specs}


# ---------------------------------------------------------------------------
# draft vocabulary


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, special_ids: Sequence[int]) -> torch.Tensor:
    """Choose the draft vocabulary: specials first, then by descending count (ties by id), then by ascending id.

    Args:
        counts: int64 ``[V]`` occurrences of each token among loss-masked tokens.
        draft_vocab_size: ``Vd``.
        special_ids: bos, eos, pad, unk ids (absent ones omitted).

    Returns:
        int64 ``[Vd]`` selected target ids, ascending (identity when ``Vd == V``).
    """
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"--draft-vocab-size {draft_vocab_size} must be in [1, {vocab}] (the target vocabulary)")
    order: list[int] = list(dict.fromkeys(i for i in special_ids if 0 <= i < vocab))
    ids = torch.arange(vocab)
    # A stable sort on -count keeps ascending ids among equal counts; zero counts come last, in id order.
    by_count = ids[torch.sort(-counts, stable=True).indices]
    chosen = set(order)
    for i in by_count.tolist():
        if len(order) >= draft_vocab_size:
            break
        if i not in chosen:
            order.append(i)
            chosen.add(i)
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.int64)


def vocab_mapping(selected: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """``selected_token_ids``, ``d2t`` (offsets, vLLM) and ``t2d`` (mask, SGLang) of a draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return {"selected_token_ids": selected, "d2t": selected - torch.arange(selected.numel()), "t2d": t2d}


# ---------------------------------------------------------------------------
# the target side


class Eagle3Target:
    """A frozen target that turns padded token batches into EAGLE-3 features.

    Args:
        model: a Hugging Face causal LM (eval mode is set here).
        aux_layers: the three aux decoder layer ids.
        supervision: what to compute.
        selected: the draft vocabulary (ascending target ids).
        dtype: storage dtype of float features.
        nonfinite: ``fail`` or ``skip`` samples whose features are NaN/Inf (see :mod:`speccache.methods.finite`).
        capture: the forward that captures the layers (default: ``model``'s own, :func:`forward_capturing`).

    Raises:
        ValueError: bad aux layers or ``nonfinite`` mode.
    """

    def __init__(
        self,
        model: nn.Module,
        aux_layers: Sequence[int],
        supervision: Supervision,
        selected: torch.Tensor,
        dtype: torch.dtype,
        nonfinite: str = "fail",
        capture: Capture | None = None,
    ) -> None:
        self.nonfinite = check_nonfinite_mode(nonfinite)
        self.model = model.eval()
        self.capture: Capture = capture or functools.partial(forward_capturing, self.model)
        self.layers = decoder_layers(model)
        self.aux_layers = check_aux_layers(aux_layers, len(self.layers))
        self.supervision = supervision
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.selected = selected.to(self.device)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.full_vocab = selected.numel() == self.vocab_size
        self.lm_head = model.get_output_embeddings()

    @torch.no_grad()
    def forward_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Padded features ``[B, T, ...]`` of one batch, in the model's dtype: aux, last hidden, logits-derived."""
        last, captured = self.capture(input_ids, attention_mask, {i: i for i in self.aux_layers}, None)
        feats = {
            "aux_hidden_states": torch.cat([captured[i] for i in self.aux_layers], dim=-1),
            "last_hidden_state": last,
        }
        if has_logits(self.supervision, self.full_vocab):
            logits = self.lm_head(last).float()
            log_probs = torch.log_softmax(logits, dim=-1)
            feats[STAT_PREFIX + "mean_entropy"] = -(log_probs.exp() * log_probs).sum(-1)
            feats[STAT_PREFIX + "mean_top1"] = log_probs.amax(-1).exp()
            draft_logits = logits[..., self.selected]
            if not self.full_vocab:
                in_draft = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                in_draft[self.selected] = True
                feats["in_draft"] = in_draft[logits.argmax(-1)]
            if self.supervision.mode != "hidden":
                probs = torch.softmax(draft_logits, dim=-1)
                if self.supervision.mode == "probs":
                    feats["target_probs"] = probs
                else:
                    values, ids = probs.topk(self.supervision.k, dim=-1)
                    feats["topk_probs"] = values / values.sum(-1, keepdim=True)
                    feats["topk_ids"] = ids.to(torch.int32)
        return feats

    def layer_of(self, key: str, column: int) -> str:
        """Where column ``column`` of feature ``key`` comes from in the target (for error messages)."""
        if key == "aux_hidden_states":
            width = int(self.lm_head.weight.shape[1])
            return f"decoder layer {self.aux_layers[column // width]} (aux layer {column // width} of 3)"
        if key == "last_hidden_state":
            return f"the final norm after decoder layer {len(self.layers) - 1}"
        return "the LM head (softmax of the logits)"

    def compute_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``compute_batch`` for the write loops: a padded token batch in, ragged cache rows out.

        Raises:
            NonFiniteFeatureError: a feature is NaN/Inf and the mode is ``fail``.
        """
        input_ids = batch["input_ids"].to(self.device)
        attention_mask = batch["attention_mask"].to(self.device)
        feats = self.forward_features(input_ids, attention_mask)
        real = attention_mask.bool()
        if self.supervision.mode != "hidden":
            feats.pop("last_hidden_state")
        loss_mask = batch["loss_mask"].to(self.device).bool() & real
        rows: dict[str, torch.Tensor] = {"loss_mask": loss_mask[real], LENGTHS_KEY: real.sum(1).to(torch.int64)}
        # Row t predicts token t + 1: the target's distribution counts where loss_mask[t + 1] is set.
        predicts = torch.zeros_like(loss_mask)
        predicts[:, :-1] = loss_mask[:, 1:]
        for name in [k for k in feats if k.startswith(STAT_PREFIX)]:
            value = torch.where(predicts, feats.pop(name), 0.0)  # padding is never read, whatever it holds
            rows[name] = value.sum(1) / predicts.sum(1).clamp_min(1)
        for name, value in feats.items():
            rows[name] = value[real].to(self.dtype) if value.is_floating_point() else value[real]
        source = batch.get("source_row")
        guard_nonfinite(rows, self.nonfinite, self.layer_of, batch.get("sample_index"), source)
        # after the guard, so that a cleared sample counts no supervised token
        owner = torch.repeat_interleave(torch.arange(real.shape[0], device=self.device), rows[LENGTHS_KEY])
        supervised = torch.zeros(real.shape[0], dtype=torch.int64, device=self.device)
        rows[STAT_PREFIX + "supervised_tokens"] = supervised.index_add_(0, owner, rows["loss_mask"].to(torch.int64))
        out = {"input_ids": batch["input_ids"][batch["attention_mask"].bool()].to(torch.int32)}
        out.update((name, value.cpu()) for name, value in rows.items())
        out[SOURCE_ROW_KEY] = source if source is not None else torch.full((real.shape[0],), -1, dtype=torch.int64)
        return out


# ---------------------------------------------------------------------------
# the trainer side


class Eagle3CacheDataset(CacheDataset):
    """An EAGLE-3 cache as a dataset of samples ready for a trainer.

    Each sample has ``input_ids``, ``loss_mask``, ``aux_hidden_states`` and either
    ``last_hidden_state`` (``hidden``) or ``target_probs`` ``[T, Vd]`` (``probs``,
    ``topk``, scattered back), plus ``position_mask`` when the cache stores
    probabilities. Encoded keys (fp8, zbf16) come back decoded.

    With ``keys``, a sample holds those keys and what is derived from them;
    the stored keys a derived field needs are read too, whether named or not:
    ``position_mask`` always needs ``loss_mask`` and (with a reduced draft
    vocabulary) ``in_draft``; ``target_probs`` of a ``topk`` cache needs both
    ``topk_probs`` and ``topk_ids``.

    Args:
        cache_dir: the cache directory, or a view of EAGLE-3 caches (it opens as a
            :class:`speccache.read.view.ViewDataset` of these readers, one per source).
        keys: stored keys to return (default: all), or ``target_probs`` for a ``topk`` cache.
        verify: check each shard's checksum when first opened.
        **kwargs: passed to :class:`speccache.read.CacheDataset`.

    Raises:
        CacheFormatError: a key neither stored nor derivable (the message lists what the cache offers).
    """

    def __init__(
        self, cache_dir: str, keys: Sequence[str] | str | None = None, verify: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(cache_dir, keys, cache_name=CACHE_NAME, verify=verify, **kwargs)

    def _stored_keys(self, keys: list[str]) -> list[str]:
        config = self.manifest.config
        self.supervision = Supervision.parse(config.get("supervision", "hidden"))
        self.draft_vocab_size = int(config["draft_vocab_size"])
        stored = set(self.manifest.schema)
        wanted = set(keys)
        if self.supervision.mode == "topk" and wanted & {"target_probs", "topk_probs", "topk_ids"}:
            wanted = (wanted - {"target_probs"}) | {"topk_probs", "topk_ids"}
        unknown = sorted(wanted - stored)
        if unknown:
            offered = sorted(stored | ({"target_probs"} if self.supervision.mode == "topk" else set()))
            raise CacheFormatError(
                f"{self.cache_dir}: keys {unknown} are not in this EAGLE-3 cache; it offers {offered}"
            )
        needed = set(wanted)
        if self.supervision.mode != "hidden":
            needed |= {"loss_mask"} | ({"in_draft"} & stored)
        self._implicit = frozenset(needed - wanted)
        return [k for k in self.manifest.schema if k in needed]

    def _finish(self, sample: Sample) -> Sample:
        if self.supervision.mode == "topk" and "topk_probs" in sample:
            values, ids = sample.pop("topk_probs"), sample.pop("topk_ids")
            probs = torch.zeros((values.shape[0], self.draft_vocab_size), dtype=values.dtype)
            sample["target_probs"] = probs.scatter_(1, ids.long(), values)
        if self.supervision.mode != "hidden":
            in_draft = sample.pop("in_draft", None)
            sample["position_mask"] = sample["loss_mask"] if in_draft is None else sample["loss_mask"] & in_draft
        for key in self._implicit & set(sample):
            del sample[key]
        return sample

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        return [self._finish(s) for s in super().__getitems__(indices)]

    def collator(self, pin_memory: bool | None = None) -> PadCollator:
        """The padding collator of this cache's samples (adds ``attention_mask`` and ``lengths``)."""
        ragged = {k for k, s in self.schema.items() if s.ragged} | {"target_probs", "position_mask"}
        return PadCollator(ragged - {"topk_probs", "topk_ids"}, pin_memory=pin_memory)


def build_eagle3_dataloader(
    cache_dir: str,
    batch_size: int,
    shuffle: bool,
    *,
    num_workers: int = 0,
    distributed: bool = False,
    seed: int = 0,
    sampler: Sampler | None = None,
    verify: bool = False,
    keys: Sequence[str] | None = None,
    max_open_shards: int = 64,
    allow_incomplete: bool = False,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader of padded EAGLE-3 batches (with ``attention_mask`` and ``lengths``).

    Args:
        cache_dir: the cache directory, or a view (``speccache merge``/``subset``; its ``--weights`` are honoured).
        batch_size: samples per batch.
        shuffle: shuffle with shard locality (:class:`speccache.read.LocalityShuffleSampler`);
            call ``loader.sampler.set_epoch(e)`` each epoch, and ``state_dict``/``load_state_dict`` to resume mid-epoch.
        num_workers: DataLoader workers.
        distributed: give each rank its share (``torch.distributed`` must be initialised).
        seed: shuffling seed, the same on every rank.
        sampler: a sampler to use instead of the default.
        verify: check shard checksums when first opened.
        keys: stored keys to read (see :class:`Eagle3CacheDataset`).
        max_open_shards: LRU bound on open shards per worker.
        allow_incomplete: read the whole shards of an unsealed cache.
        **loader_kwargs: passed to ``DataLoader``.

    Raises:
        RuntimeError: ``distributed`` without an initialised process group.
    """
    dataset: Eagle3CacheDataset | ViewDataset = Eagle3CacheDataset(
        cache_dir, keys, verify=verify, max_open_shards=max_open_shards, allow_incomplete=allow_incomplete
    )
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


class TargetHead(nn.Module):
    """Turns cached ``last_hidden_state`` into draft-vocabulary target probabilities on the trainer's device.

    Built from the cache's side file (the LM-head rows of the draft vocabulary),
    so the trainer never loads the target.

    Args:
        lm_head_rows: ``[Vd, H]`` LM-head rows of the draft vocabulary.
        selected_token_ids: ``[Vd]`` their target ids.
    """

    def __init__(self, lm_head_rows: torch.Tensor, selected_token_ids: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", lm_head_rows.detach().clone())
        self.register_buffer("selected_token_ids", selected_token_ids.detach().clone())

    @classmethod
    def from_cache(cls, cache_dir: str, device: torch.device | str | None = None) -> TargetHead:
        """Build the head from the side file of an EAGLE-3 cache, or of a view's sources (one target: one file).

        Raises:
            CacheFormatError: not an EAGLE-3 cache or view, or a view whose sources' side files differ.
        """
        side = ShardFile(open_source(cache_dir, CACHE_NAME).side_file(SIDE_FILE))
        head = cls(side.tensor("lm_head").clone(), side.tensor("selected_token_ids").clone())
        return head.to(device) if device is not None else head

    def forward(
        self, last_hidden_state: torch.Tensor, loss_mask: torch.Tensor, in_draft: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(target_probs [..., Vd] fp32, position_mask [...] bool)``.

        ``position_mask`` is ``loss_mask`` and (when the cache stores it) ``in_draft``,
        i.e. the positions whose target argmax the draft vocabulary can express.
        """
        logits = last_hidden_state.to(self.weight.dtype) @ self.weight.T
        probs = torch.softmax(logits.float(), dim=-1)
        mask = loss_mask.bool() if in_draft is None else loss_mask.bool() & in_draft.bool()
        return probs, mask
