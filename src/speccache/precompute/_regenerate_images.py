"""The images of a row ``speccache regenerate`` answers for a vision-language target (docs/vision.md, "Evaluate
and regenerate").

The row is read as precompute reads image rows (:func:`speccache.data.image_messages`); the template renders
each image as its bare placeholder, and each prompt's text is tokenized by the target's processor with the
images it places, which expands every placeholder into the image's tokens, as ``apply_chat_template`` does. The
written row keeps the input's non-assistant messages as the input gave them (their image parts and paths) and
its ``image``/``images`` field, so that it reads back with the same images.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from speccache.data import MODALITY_KEYS, bare_images, chat_messages, image_messages, processor_inputs
from speccache.errors import DataError

__all__ = ["ImageTurns"]

IMAGE_FIELDS = ("image", "images")


class ImageTurns:
    """A row's messages (images as bare placeholders), their written forms, and its images as prompts reach them.

    Attributes:
        messages: the row's messages, each image part ``{"type": "image"}``.
        tools: the row's tools (None: the run's).
        shown: per message, its form in the written row (the input's own message).
        fields: the row's ``image``/``images`` field, written again.
    """

    def __init__(self, row: dict, where: str, processor: Any, image_root: str) -> None:
        messages, self.tools, images = image_messages(row, where, image_root)
        self.messages = bare_images(messages)
        self.where, self.processor, self.images = where, processor, [i.image for i in images]
        # a ShareGPT row's messages (or a row-level system prompt) are normalised; their text keeps its markers
        given = row.get("messages")
        self.shown = list(given) if isinstance(given, list) else chat_messages(row, where)[0]
        if len(self.shown) != len(self.messages):
            raise DataError(
                f"{where}: its {len(self.shown)} messages read as {len(self.messages)}; regenerate keeps an image "
                "row's messages as given: give the system prompt as the first message"
            )
        self.fields = {k: row[k] for k in IMAGE_FIELDS if k in row}
        try:
            json.dumps([self.shown, self.fields])
        except (TypeError, ValueError) as e:
            raise DataError(
                f"{where}: its images are held as decoded pixels or bytes (a datasets image column), which a "
                f"written row cannot hold as JSON ({e}); save the images as files and give their paths"
            ) from e
        self.placed = 0  # the images the prompts so far hold

    def tokens(self, text: str, messages: list[dict]) -> list[int]:
        """The ids of a prompt's ``text`` (rendered from ``messages``, the messages so far), its new images'
        placeholders expanded by the processor."""
        upto = sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image")
        new, self.placed = self.images[self.placed : upto], upto
        out = self.processor(text=[text], images=new or None, add_special_tokens=False)
        return list(out["input_ids"][0])

    def inputs(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """The target's image inputs for ``ids`` (the row's prompt so far) as a batch of one."""
        made = processor_inputs(self.processor, ids, self.images[: self.placed], self.where)
        return {k: v[None] if k in MODALITY_KEYS else v for k, v in made.items()}
