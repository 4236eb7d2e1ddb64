"""Image chat rows for the vision-language tests: two drawn pictures, rows as a data file holds them, and the same
rows as the processor renders them (PIL images)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from speccache.testing.vlm import draw_image

Row = tuple[Sequence[str], str, str]
"""A row's images (file names, or a name with a space: the picture as a ``data:`` URI), question and answer."""


def chat_row(images: Sequence[str], question: str, answer: str, root: Path | None = None) -> dict:
    """A user turn of OpenAI ``image_url`` parts and the question, then the answer (as text parts); an image named
    ``"b.png as a data URI"`` is ``root/b.png``'s bytes as a ``data:`` URI (the row holds the picture)."""
    import base64

    def url(name: str) -> str:
        if " " not in name:
            return name
        assert root is not None, "a data URI needs the folder of the pictures"
        return "data:image/png;base64," + base64.b64encode((root / name.split()[0]).read_bytes()).decode()

    parts = [{"type": "image_url", "image_url": {"url": url(name)}} for name in images]
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def write_image_data(root: Path, rows: Sequence[Row]) -> Path:
    """Draw ``a.png`` (56x84) and ``b.png`` (64x40) in ``root`` and write ``rows`` (:func:`chat_row`) to
    ``root/data.jsonl``; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    draw_image(str(root / "a.png"), 56, 84, seed=0)
    draw_image(str(root / "b.png"), 64, 40, seed=1)
    lines = [json.dumps(chat_row(*row, root=root)) for row in rows]
    (root / "data.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return root


def rendered(root: Path, row: Row) -> list[dict]:
    """``row`` as transformers messages with its pictures opened (what the processor renders)."""
    from PIL import Image

    images, question, answer = row
    parts = [{"type": "image", "image": Image.open(root / name.split()[0])} for name in images]
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
