"""``speccache train --draft-inputs``: what the draft reads at each slot, and at which position (docs/vision.md).

* ``served`` (the default): what vLLM 0.32's proposer feeds an EAGLE-3 draft of a vision-language target:
  ``embed_tokens(input_ids)`` at every slot (the image placeholder's embedding at image tokens: the EAGLE-3 llama
  draft ignores multimodal embeddings) and, when the cache holds ``positions`` (an M-RoPE target), the target's
  3-D positions, which vLLM gives a draft whose config has an ``mrope_section``: the draft is then an M-RoPE draft
  with the target's sections.
* ``merged``: the target's merged input embeddings at image tokens (the cache's ``image_embeds``), the embedding of
  the ids elsewhere, and the target's positions: for an engine that feeds a draft the multimodal embeddings.
* ``tokens``: the embedding of the ids everywhere and positions ``0..T-1``: an ordinary text draft.

A text target's cache has neither image tokens nor ``positions``: the three are the same training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from speccache.errors import UsageError
from speccache.read.source import CacheSource
from speccache.train.draft import Eagle3Draft

__all__ = ["DRAFT_INPUTS", "check_draft_inputs", "slot_inputs", "target_mrope"]

DRAFT_INPUTS = ("served", "merged", "tokens")
"""``--draft-inputs`` names; the first is the default."""


def check_draft_inputs(mode: str, source: CacheSource | None = None) -> None:
    """Refuse an unknown ``mode`` and, given the cache's ``source``, ``merged`` on a vision-language cache without its
    image embeddings.

    Raises:
        UsageError: names ``--draft-inputs`` and what to use instead.
    """
    if mode not in DRAFT_INPUTS:
        raise UsageError(f"unknown --draft-inputs {mode!r}; choose one of {', '.join(DRAFT_INPUTS)}")
    if mode != "merged" or source is None:
        return
    vision = source.config.get("vision")  # None for a text target's cache: nothing to merge, nothing refused
    if vision is not None and ("image_embeds" not in source.schema or "image_token_id" not in vision):
        raise UsageError(
            f"--draft-inputs merged: {source.path} holds no image_embeds (and the image token id) to merge; "
            "use --draft-inputs served (what vLLM feeds an EAGLE-3 draft), or precompute again keeping them (without "
            "--no-vision-inputs)"
        )


def target_mrope(mode: str, source: CacheSource) -> dict[str, Any]:
    """The :class:`speccache.train.draft.DraftConfig` fields of an M-RoPE draft, from the target's text config
    (``mrope_section``, ``mrope_interleaved``, and ``rope_theta``, so that the draft rotates the target's positions
    as the target does), when the draft reads the cache's 3-D ``positions`` (``served`` or ``merged`` on a cache
    that holds them); else none (``{}``: a 1-D draft).

    Read from the target's ``config.json`` (the manifest's ``model``): the cache holds positions, not sections.

    Raises:
        UsageError: the target's config cannot be read, or has no ``mrope_section``.
    """
    if mode == "tokens" or "positions" not in source.schema:
        return {}
    from transformers import AutoConfig

    model = str(source.config.get("model"))
    try:
        text = AutoConfig.from_pretrained(model).get_text_config()
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(
            f"--draft-inputs {mode}: {source.path} holds M-RoPE positions, and the draft takes its sections from the "
            f"target's config, which cannot be read at {model!r} ({e}); make the target's directory available there, "
            "or train a text-position draft with --draft-inputs tokens"
        ) from e
    rope: Mapping[str, Any] = getattr(text, "rope_parameters", None) or {}
    if "mrope_section" not in rope:
        raise UsageError(
            f"--draft-inputs {mode}: {source.path} holds M-RoPE positions but the target's config at {model!r} has "
            "no mrope_section; use --draft-inputs tokens"
        )
    return {
        "mrope_section": [int(s) for s in rope["mrope_section"]],
        "mrope_interleaved": bool(rope.get("mrope_interleaved", False)),
        "rope_theta": float(rope["rope_theta"]),  # transformers 5 keeps it among the rope parameters
    }


def slot_inputs(
    draft: Eagle3Draft, view: Mapping[str, torch.Tensor], mode: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(embeds, positions)`` of :meth:`Eagle3Draft.states` for ``mode`` over a :func:`draft_view`; ``None`` is
    the draft's own default (the embedding of the ids; positions ``0..T-1``)."""
    if mode == "tokens":
        return None, None
    embeds = None
    if mode == "merged" and "image_embeds" in view:
        own = draft.embed_tokens(view["input_ids"].long())
        embeds = torch.where(view["image_mask"][..., None], view["image_embeds"].to(own.dtype), own)
    return embeds, view.get("positions")
