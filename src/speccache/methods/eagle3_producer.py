"""EAGLE-3's producer: the key schema, the draft-vocabulary pre-pass, the side file, the target that computes
the rows (:class:`Eagle3Target`) and the method ``precompute`` runs (:data:`EAGLE3`).

What the cache stores, its alignment and its trainer-facing readers: :mod:`speccache.methods.eagle3`.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from speccache.data import TokenizedSamples
from speccache.errors import ConfigMismatchError, UsageError
from speccache.format import (
    LENGTHS_KEY,
    SOURCE_ROW_KEY,
    STAT_PREFIX,
    KeySpec,
    Schema,
    ShardFile,
    source_row_spec,
    tensor_checksum,
)
from speccache.methods.base import (
    CaptureRequest,
    LoadedTarget,
    MethodPlan,
    MethodSettings,
    PrePass,
    model_config_hash,
    stores_vision_inputs,
    text_config,
)
from speccache.methods.decoder import (
    IMAGE_EMBEDS,
    POSITIONS,
    Capture,
    batch_image_inputs,
    capture_batch,
    decoder_layers,
    forward_capturing,
    is_mrope,
)
from speccache.methods.eagle3 import (
    CACHE_NAME,
    SIDE_FILE,
    Supervision,
    check_aux_layers,
    default_aux_layers,
)
from speccache.methods.finite import check_nonfinite_mode, guard_nonfinite
from speccache.methods.side import read_side_file, stores_head, tied_metadata, ties_embeddings
from speccache.read.source import open_source
from speccache.write import Comm, partition_cache_shards

__all__ = [
    "sample_stat_names",
    "eagle3_schema",
    "padded_probs_token_bytes",
    "select_draft_vocab",
    "vocab_mapping",
    "side_metadata",
    "side_tensors",
    "Eagle3Target",
    "Eagle3Method",
    "EAGLE3",
    "draft_token_counts",
    "stored_selection",
]


def has_logits(supervision: Supervision, full_vocab: bool) -> bool:
    """Whether the producer computes the target's logits (then samples also record its entropy and top-1)."""
    return supervision.mode != "hidden" or not full_vocab


def sample_stat_names(supervision: Supervision, full_vocab: bool) -> tuple[str, ...]:
    """The per-sample statistics an EAGLE-3 shard records (besides ``tokens``)."""
    return ("supervised_tokens", *(("mean_entropy", "mean_top1") if has_logits(supervision, full_vocab) else ()))


def eagle3_schema(
    hidden_size: int,
    dtype: torch.dtype,
    supervision: Supervision,
    draft_vocab_size: int,
    full_vocab: bool,
    encodings: Mapping[str, str] | None = None,
    positions: bool = False,
    image_embeds: bool = False,
) -> Schema:
    """The key schema of an EAGLE-3 cache.

    Args:
        hidden_size: the target's hidden size ``H``.
        dtype: storage dtype of float features.
        supervision: what supervises the draft.
        draft_vocab_size: ``Vd``.
        full_vocab: whether the draft vocabulary is the whole target vocabulary (then no ``in_draft`` key).
        encodings: key -> encoding for float features (default ``raw``).
        positions: store the target's own 3-D positions of each token (``positions``, an M-RoPE target's).
        image_embeds: store a vision-language target's merged input embeddings at its image tokens
            (``image_embeds``, ``[T, H]`` in ``dtype``, zero elsewhere, encoded ``sparse``: only image rows take space).

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
        raise UsageError(
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
    if positions:
        specs.append(KeySpec(POSITIONS, torch.int32, (3,), ragged=True))
    if image_embeds:
        specs.append(KeySpec(IMAGE_EMBEDS, dtype, (hidden_size,), ragged=True, encoding="sparse"))
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
        raise UsageError(f"--draft-vocab-size {draft_vocab_size} must be in [1, {vocab}] (the target vocabulary)")
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
# the side file


def side_metadata(tied: bool) -> dict[str, str]:
    """The side file's safetensors metadata; ``tied``: the target's config ties its head to its embedding."""
    return {"speccache_side": CACHE_NAME, **tied_metadata(tied)}


def side_tensors(
    embed_tokens: torch.Tensor, lm_head: torch.Tensor, selected: torch.Tensor, vocab_size: int, tied: bool
) -> dict[str, torch.Tensor]:
    """The side file's tensors from the target's input embedding and whole LM head ``[V, H]`` and the draft
    vocabulary; a tied target's head is left out (:func:`~speccache.methods.side.stores_head`)."""
    head = {"lm_head": lm_head[selected].contiguous()} if stores_head(embed_tokens, lm_head, tied) else {}
    return {"embed_tokens": embed_tokens.contiguous(), **head, **vocab_mapping(selected, vocab_size)}


# ---------------------------------------------------------------------------
# the target side


HEAD_VALUES = 1 << 28
"""The most fp32 logits (1 GiB) the EAGLE-3 target computes at once: longer batches run the head in runs of rows."""


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
        vision_inputs: keep a vision-language target's :data:`IMAGE_EMBEDS` and M-RoPE ``positions`` (``False``:
            ``--no-vision-inputs``, a draft trained text-only).

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
        vision_inputs: bool = True,
    ) -> None:
        self.vision_inputs = vision_inputs
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
    def forward_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Padded features ``[B, T, ...]`` of one batch, in the model's dtype: aux, last hidden, logits-derived
        (and, unless ``vision_inputs`` is off, a vision-language target's ``image_embeds`` and an M-RoPE target's
        ``positions``, int32)."""
        outputs: dict[Hashable, int] = {i: i for i in self.aux_layers}
        last, captured = capture_batch(self.capture, input_ids, attention_mask, outputs, None, image_inputs)
        feats = {
            "aux_hidden_states": torch.cat([captured[i] for i in self.aux_layers], dim=-1),
            "last_hidden_state": last,
        }
        if self.vision_inputs:
            if POSITIONS in captured:
                feats[POSITIONS] = captured[POSITIONS].to(torch.int32)
            if IMAGE_EMBEDS in captured:
                feats[IMAGE_EMBEDS] = captured[IMAGE_EMBEDS]
        if has_logits(self.supervision, self.full_vocab):
            # The head's fp32 logits are [B, T, V]: a long sample's (128K tokens of a 128K vocabulary: 64 GiB) are
            # computed in runs of rows, each row's features alone, so that at most HEAD_VALUES of them are held.
            rows = max(1, HEAD_VALUES // max(1, last.shape[0] * self.vocab_size))
            runs = [self._head_features(last[:, a : a + rows]) for a in range(0, last.shape[1], rows)]
            feats.update({k: torch.cat([r[k] for r in runs], dim=1) for k in runs[0]} if len(runs) > 1 else runs[0])
        return feats

    def _head_features(self, last: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logits-derived features of ``last`` (``[B, t, H]``, final-norm output), each row's from its own."""
        feats: dict[str, torch.Tensor] = {}
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
        if key == IMAGE_EMBEDS:
            return "the merged input embeddings (the image features the vision tower computed)"
        return "the LM head (softmax of the logits)"

    def compute_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``compute_batch`` for the write loops: a padded token batch in, ragged cache rows out.

        Raises:
            NonFiniteFeatureError: a feature is NaN/Inf and the mode is ``fail``.
        """
        input_ids = batch["input_ids"].to(self.device)
        attention_mask = batch["attention_mask"].to(self.device)
        feats = self.forward_features(
            input_ids, attention_mask, batch_image_inputs(self.model.config, batch, self.device)
        )
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
# the method in precompute


def draft_token_counts(samples: TokenizedSamples, shard_size: int, vocab_size: int, comm: Comm) -> torch.Tensor:
    """Loss-masked token counts over the whole dataset: each rank counts its block of shards, then all ranks sum."""
    _, start, n = partition_cache_shards(len(samples), shard_size, comm.world_size, comm.rank)
    offsets, end = samples.offsets, len(samples)
    # a rank that owns no shard starts past the last sample: its block is empty
    a, b = int(offsets[min(start, end)]), int(offsets[min(start + n, end)])
    ids = samples.input_ids[a:b][samples.loss_mask[a:b].astype(bool)]
    counts = np.bincount(np.clip(ids, 0, vocab_size - 1), minlength=vocab_size)
    return comm.sum_tensor(torch.from_numpy(counts.astype(np.int64)))


def stored_selection(cache_dir: str) -> torch.Tensor:
    """The draft vocabulary of the EAGLE-3 cache at ``cache_dir`` (``selected_token_ids`` of its side file)."""
    side = ShardFile(os.path.join(cache_dir, SIDE_FILE))
    try:
        return side.tensor("selected_token_ids").clone()
    finally:
        side.close()


def borrowed_draft_vocab(cfg: MethodSettings, model_config: Any, vocab_size: int) -> torch.Tensor:
    """``--draft-vocab-from``'s draft vocabulary (its side file's ``selected_token_ids``), from a cache (or view)
    of this run's target.

    Raises:
        FileNotFoundError: no cache there.
        CacheFormatError: not an EAGLE-3 cache.
        ConfigMismatchError: a cache of another target (model config or vocabulary size).
    """
    assert cfg.draft_vocab_from is not None  # plan calls it only when the flag is set
    source = open_source(cfg.draft_vocab_from, CACHE_NAME)
    theirs = (source.config.get("model_config_hash"), source.config.get("vocab_size"))
    ours = (model_config_hash(model_config), vocab_size)
    if theirs != ours:
        raise ConfigMismatchError(
            f"--draft-vocab-from {cfg.draft_vocab_from} was written from another target than --model {cfg.model} "
            f"(model_config_hash {theirs[0]} vs {ours[0]}, vocab_size {theirs[1]} vs {ours[1]}); give a cache "
            "of the same target, or leave the flag out to count this data's tokens"
        )
    return read_side_file(source.side_file(SIDE_FILE), ("selected_token_ids",))["selected_token_ids"]


def _special_ids(tokenizer: Any) -> list[int]:
    ids = [getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")]
    return [i for i in ids if isinstance(i, int)]


def padded_probs_token_bytes(hidden_size: int, draft_vocab_size: int, itemsize: int) -> int:
    """Bytes per token of the layout other EAGLE-3 tools write, each sample padded: three aux states and the full
    draft-vocabulary probabilities in ``itemsize`` bytes each, an int64 id and a bool mask."""
    return (3 * hidden_size + draft_vocab_size) * itemsize + 8 + 1


@dataclass(frozen=True)
class Eagle3Settings:
    """What an EAGLE-3 run decided: the aux layers, the supervision and the vocabularies."""

    aux_layers: list[int]
    supervision: Supervision
    vocab_size: int
    draft_vocab_size: int
    borrowed: torch.Tensor | None  # --draft-vocab-from's selected_token_ids
    tied: bool  # the target's config ties its LM head to its embedding
    vision_inputs: bool  # a vision-language target's image_embeds and positions are stored


class Eagle3Method:
    """EAGLE-3 in ``precompute`` (:class:`speccache.methods.base.Method`): its pre-pass chooses the draft vocabulary
    (``prepare`` returns the selected target ids), its side file holds the embeddings and the draft's LM-head rows."""

    cache_name = CACHE_NAME
    side_file = SIDE_FILE
    presets: Mapping[str, str] = {
        "eagle3": "EAGLE-3: three aux layers (--aux-layers) and --supervision over --draft-vocab-size tokens"
    }

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """``--aux-layers``, ``--draft-vocab-size``, ``--draft-vocab-from`` and ``--supervision``."""
        p.add_argument("--aux-layers", help="three decoder layer ids, e.g. 1,15,28 (default [1, L//2-1, L-4])")
        p.add_argument("--draft-vocab-size", type=int, help="draft vocabulary size (default: the target's)")
        p.add_argument(
            "--draft-vocab-from",
            metavar="TRAIN_CACHE",
            help="eagle3: take the draft vocabulary from this cache of the same target instead of counting this "
            "data's tokens (a held-out cache that does not leak into the training cache's vocabulary)",
        )
        p.add_argument("--supervision", help="hidden (default), probs, or topk:K")

    def check_flags(self, cfg: MethodSettings) -> None:
        """``--supervision`` must parse; the layer methods' flags are refused."""
        Supervision.parse(cfg.supervision)
        if cfg.layers is not None or cfg.last_hidden or cfg.last_prenorm:
            raise UsageError(
                "--layers, --last-hidden and --last-prenorm are for the layer methods; "
                "--method eagle3 takes --aux-layers"
            )

    def plan(self, cfg: MethodSettings, model_config: Any, dtype: torch.dtype) -> MethodPlan:
        """The aux layers (default :func:`default_aux_layers`), the draft vocabulary size and the schema.

        Raises:
            ValueError: bad aux layers, draft vocabulary size, ``topk`` K or encodings.
        """
        text = text_config(model_config)
        num_layers, vocab, hidden = int(text.num_hidden_layers), int(text.vocab_size), int(text.hidden_size)
        aux = check_aux_layers(
            cfg.aux_layers if cfg.aux_layers is not None else default_aux_layers(num_layers), num_layers
        )
        borrow_from = cfg.draft_vocab_from
        borrowed = None if borrow_from is None else borrowed_draft_vocab(cfg, model_config, vocab)
        draft = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else vocab
        if borrowed is not None:
            if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != borrowed.numel():
                raise UsageError(
                    f"--draft-vocab-size {cfg.draft_vocab_size} differs from --draft-vocab-from "
                    f"{cfg.draft_vocab_from}'s {borrowed.numel()} draft tokens; leave --draft-vocab-size out"
                )
            draft = borrowed.numel()
        if not 1 <= draft <= vocab:
            raise UsageError(f"--draft-vocab-size {draft} must be in [1, {vocab}] (the target vocabulary)")
        supervision = Supervision.parse(cfg.supervision)
        if supervision.mode == "topk" and supervision.k > draft:
            raise UsageError(f"--supervision topk:{supervision.k} asks for more than the {draft} draft tokens")
        config: dict[str, Any] = {"aux_layers": aux, "supervision": str(supervision), "draft_vocab_size": draft}
        if borrow_from is not None and borrowed is not None:  # recorded only when set: a resume compares them
            config["draft_vocab_from"] = {
                "cache": os.path.abspath(borrow_from),
                "selected_token_ids_xxh3_128": tensor_checksum(borrowed),
            }
        stores_vision = stores_vision_inputs(cfg, model_config, config)
        tied = ties_embeddings(model_config)
        return MethodPlan(
            schema=eagle3_schema(
                hidden,
                dtype,
                supervision,
                draft,
                draft == vocab,
                cfg.encodings,
                positions=stores_vision and is_mrope(model_config),
                image_embeds=stores_vision,
            ),
            config=config,
            request=CaptureRequest(layers=tuple(aux)),
            draft_vocab_size=draft,
            settings=Eagle3Settings(aux, supervision, vocab, draft, borrowed, tied, stores_vision),
            side_metadata=side_metadata(tied),
        )

    def padded_token_bytes(self, plan: MethodPlan, hidden_size: int, itemsize: int) -> int:
        """:func:`padded_probs_token_bytes` of the plan's draft vocabulary (``stats.padded_probs_bytes``)."""
        return padded_probs_token_bytes(hidden_size, plan.draft_vocab_size, itemsize)

    def prepare(self, plan: MethodPlan, data: PrePass) -> torch.Tensor:
        """The draft vocabulary: an append's cache's own, ``--draft-vocab-from``'s, or chosen from the
        loss-masked token counts."""
        s: Eagle3Settings = plan.settings
        if data.appending_to is not None:
            return stored_selection(data.appending_to)
        if s.borrowed is not None:
            return s.borrowed
        counts = draft_token_counts(data.samples, data.shard_size, s.vocab_size, data.comm)
        return select_draft_vocab(counts, s.draft_vocab_size, _special_ids(data.tokenizer))

    def target(
        self,
        plan: MethodPlan,
        loaded: LoadedTarget,
        capture: Capture,
        prepared: torch.Tensor,
        dtype: torch.dtype,
        nonfinite: str,
    ) -> Eagle3Target:
        """An :class:`Eagle3Target` over ``capture``, supervising over the draft vocabulary ``prepared``."""
        s: Eagle3Settings = plan.settings
        return Eagle3Target(
            loaded.model, s.aux_layers, s.supervision, prepared, dtype, nonfinite, capture, s.vision_inputs
        )

    def side_tensors(self, plan: MethodPlan, loaded: LoadedTarget, prepared: torch.Tensor) -> dict[str, torch.Tensor]:
        """``embed_tokens``, the draft rows of ``lm_head`` (left out for a tied target) and the vocabulary
        mapping (:func:`side_tensors`)."""
        s: Eagle3Settings = plan.settings
        return side_tensors(loaded.input_embeddings(), loaded.output_embeddings(), prepared, s.vocab_size, s.tied)


EAGLE3 = Eagle3Method()
"""The EAGLE-3 method (registered as ``--method eagle3``)."""
