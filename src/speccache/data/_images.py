"""Image rows: the forms people store images in, normalised to transformers' content parts with the images loaded.

A row's images come from its message parts or from a row-level ``image``/``images`` field:

* OpenAI parts ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": "..."``), the url a
  relative or absolute path, a ``file://`` URL or a ``data:image/...;base64,`` URI;
* transformers parts ``{"type": "image", "path"|"url"|"image": ...}``; a part ``{"type": "image"}`` without one
  takes the row's next ``image``/``images`` entry;
* ShareGPT4V / LLaVA rows: ``image`` (one or a list) and an ``<image>`` marker in the text for each, in order
  (whitespace beside a marker is dropped: it only set the marker apart);
* ``datasets`` columns ``image``/``images`` of PIL images or ``{"bytes", "path"}`` dicts (the ``Image`` feature).

Relative paths resolve against ``image_root`` (``--image-root``, default the data file's folder). http(s) URLs and
videos are refused. A row whose images are missing, unreadable, too few or too many for its markers fails with a
:class:`~speccache.data.RowFailure` naming the row and the image, which ``--skip-bad-rows`` skips.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import xxhash

from speccache.data._failure import RowFailure, row_error
from speccache.data._files import iter_rows
from speccache.data._messages import chat_messages

__all__ = [
    "BAD_IMAGE",
    "IMAGE_MARKER",
    "RowImage",
    "check_image_root",
    "has_images",
    "image_messages",
    "image_root_of",
    "row_images",
    "sample_images",
]

IMAGE_MARKER = "<image>"
BAD_IMAGE = "bad_image"  # the skip reason of a row whose image is missing or unreadable
_IMAGE_FIELDS = ("image", "images")
_IMAGE_PARTS = ("image", "image_url", "input_image")
_VIDEO_PARTS = ("video", "video_url", "input_video")
_MARKER_SPLIT = re.compile(r"\s*" + re.escape(IMAGE_MARKER) + r"\s*")
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


@dataclass(frozen=True)
class RowImage:
    """One image of a row, loaded.

    Attributes:
        source: where it comes from, enough to load it again: an absolute path, or ``xxh3:<digest>`` of the
            bytes (or pixels) the row itself holds (reread from the sample's source row).
        image: the decoded ``PIL.Image.Image``.
    """

    source: str
    image: Any


def _parts(content: Any) -> list:
    return content if isinstance(content, list) else []


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in _IMAGE_PARTS or "image_url" in part)


def _is_video_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in _VIDEO_PARTS or "video" in part)


def check_image_root(image_root: str | None) -> None:
    """Refuse an ``--image-root`` that is not a directory.

    Raises:
        FileNotFoundError: naming the flag.
    """
    if image_root is not None and not os.path.isdir(image_root):
        raise FileNotFoundError(f"--image-root {image_root}: no such directory")


def image_root_of(data: str, image_root: str | None) -> str:
    """The folder a row's relative image paths resolve against: ``--image-root``, else the data file's folder."""
    return image_root or os.path.dirname(os.path.abspath(data))


def has_images(row: Any) -> bool:
    """Whether a row carries an image: an ``image``/``images`` field, or an image part in a message's content."""
    if not isinstance(row, dict):
        return False
    if any(row.get(key) not in (None, []) for key in _IMAGE_FIELDS):
        return True
    turns = row.get("messages")
    return isinstance(turns, list) and any(
        _is_image_part(part) for turn in turns if isinstance(turn, dict) for part in _parts(turn.get("content"))
    )


class _Loader:
    """Loads a row's images, naming the row and the image in every failure."""

    def __init__(self, where: str, root: str) -> None:
        self.where, self.root = where, root

    def fail(self, what: str, why: str) -> Exception:
        return RowFailure(f"{self.where}: image {what}: {why}", BAD_IMAGE)

    def load(self, value: Any, what: str) -> RowImage:
        from PIL import Image

        if isinstance(value, Image.Image):
            # A decoded column (datasets' Image feature): the pixels are the row's, named by their digest.
            return RowImage(f"xxh3:{xxhash.xxh3_128_hexdigest(value.tobytes())}", value)
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            if value.get("bytes") is not None:
                return self._decode(bytes(value["bytes"]), value.get("path") or what)
            value = value.get("path")
        if not isinstance(value, str) or not value:
            raise self.fail(what, f"expected a path, URL or image, got {type(value).__name__}; fix the row")
        found = _DATA_URI.fullmatch(value)
        if found:
            try:
                data = base64.b64decode(found.group(1), validate=True)
            except (binascii.Error, ValueError) as e:
                raise self.fail("data URI", f"not valid base64 ({e}); fix the row") from e
            return self._decode(data, "data URI")
        if value.startswith(("http://", "https://")):
            raise self.fail(value, "http(s) URLs are not fetched; download the images and give their paths")
        if value.startswith("data:"):
            raise self.fail(value[:40], "only data:image/...;base64, URIs are read; fix the row")
        path = urllib.parse.unquote(urllib.parse.urlparse(value).path) if value.startswith("file://") else value
        path = os.path.abspath(os.path.join(self.root, os.path.expanduser(path)))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise self.fail(path, f"cannot be read ({e.strerror or e}); check the path or --image-root") from e
        return RowImage(path, self._decode(data, path).image)

    def _decode(self, data: bytes, what: str) -> RowImage:
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            # PIL raises SyntaxError for a PNG with a damaged chunk
            raise self.fail(what, f"not a readable image ({e}); replace or remove it") from e
        return RowImage(f"xxh3:{xxhash.xxh3_128_hexdigest(data)}", image)


def _row_images(row: dict, loader: _Loader) -> list[Any]:
    """The raw values of the row's ``image``/``images`` field, in order."""
    given = [key for key in _IMAGE_FIELDS if row.get(key) not in (None, [])]
    if len(given) > 1:
        raise row_error(f"{loader.where}: the row has both 'image' and 'images'; keep one")
    if not given:
        return []
    value = row[given[0]]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def image_messages(row: dict, where: str, image_root: str) -> tuple[list[dict], list[dict] | None, list[RowImage]]:
    """The OpenAI-form messages of an image row with transformers' image parts, its tools, and its images.

    Every message's non-empty content becomes a list of parts (``{"type": "text", "text"}`` and
    ``{"type": "image", "image": PIL image}``), in the row's order.

    Args:
        row: A ShareGPT or OpenAI row (see the module docstring for where its images may be).
        where: How to name the row in messages (``file:line``).
        image_root: The folder relative image paths resolve against.

    Returns:
        ``(messages, tools, images)``: the images in the order they appear.

    Raises:
        RowFailure: the row is not a valid chat row, or its images cannot be placed or loaded.
    """
    loader = _Loader(where, image_root)
    pending = _row_images(row, loader)
    key = "messages" if "messages" in row else "conversations"
    turns = row.get(key)
    originals = [t.get("content") if isinstance(t, dict) else None for t in turns] if isinstance(turns, list) else []
    if key == "messages" and isinstance(turns, list):
        # chat_messages checks the row without its image and video parts; the images are put back below.
        texts = [
            {
                **t,
                "content": [p for p in _parts(t.get("content")) if not (_is_image_part(p) or _is_video_part(p))] or "",
            }
            if isinstance(t, dict) and isinstance(t.get("content"), list)
            else t
            for t in turns
        ]
        row = {**row, "messages": texts}
    messages, tools = chat_messages(row, where)
    offset = len(messages) - len(originals)  # a ShareGPT row's top-level system message comes first
    images: list[RowImage] = []
    used = 0

    def take(what: str) -> dict:
        nonlocal used
        if used >= len(pending):
            raise row_error(
                f"{where}: {what} but the row has only {len(pending)} image(s) in 'image'/'images'; "
                "give one image per marker"
            )
        used += 1
        images.append(loader.load(pending[used - 1], f"{used - 1} of 'image'/'images'"))
        return {"type": "image", "image": images[-1].image}

    out = []
    for i, message in enumerate(messages):
        original = originals[i - offset] if i >= offset else None
        parts: list[dict] = []
        if isinstance(original, list):
            for j, part in enumerate(original):
                name = f"{key}[{i - offset}].content[{j}]"
                if _is_video_part(part):
                    raise row_error(f"{where}: {name} is a video; only images are read: drop the video or the row")
                if not _is_image_part(part):
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                source = part.get("image_url", part.get("path", part.get("url", part.get("image"))))
                if isinstance(source, dict):
                    source = source.get("url")
                if source is None:
                    parts.append(take(f"{name} is an image part without a source"))
                    continue
                images.append(loader.load(source, str(source)[:200] if isinstance(source, str) else name))
                parts.append({"type": "image", "image": images[-1].image})
        elif isinstance(message["content"], str) and pending and IMAGE_MARKER in message["content"]:
            pieces = _MARKER_SPLIT.split(message["content"])
            for k, piece in enumerate(pieces):
                if k:
                    parts.append(take(f"{key}[{i - offset}] has an {IMAGE_MARKER} marker"))
                if piece:
                    parts.append({"type": "text", "text": piece})
        elif message["content"]:
            parts = [{"type": "text", "text": message["content"]}]
        if any(p["type"] == "image" for p in parts) and message["role"] != "user":
            raise row_error(f"{where}: {key}[{i - offset}] is a {message['role']} message with an image; "
                            "images are read in user messages only: move it or drop the row")  # fmt: skip
        out.append({**message, "content": parts or message["content"]})
    if used < len(pending):
        surplus = pending[used] if isinstance(pending[used], str) else f"{used} of 'image'/'images'"
        raise row_error(
            f"{where}: image {surplus}: the row has {len(pending)} image(s) in 'image'/'images' but places only "
            f"{used} ({IMAGE_MARKER} markers or image parts without a source); give one marker per image"
        )
    return out, tools, images


def sample_images(
    sources: tuple[str, ...], source_row: int, data: str, split: str | None, image_root: str
) -> list[Any]:
    """A sample's images loaded again from their sources (:attr:`RowImage.source`): a path is reopened; an
    ``xxh3:`` digest is found among the images of the sample's source row, reread from ``data``.

    Args:
        sources: the sample's image sources, in order.
        source_row: the 0-based row of ``data`` the sample comes from.
        data: the data file (or saved dataset) the sample was read from.
        split: its split, as the run read it.
        image_root: the folder relative paths resolve against (as the run read the row).

    Returns:
        The decoded ``PIL.Image.Image`` of each source.

    Raises:
        DataError: an image is gone or changed since the row was read (a digest no longer in the row).
    """
    where = f"{data}:{source_row + 1}"
    loader = _Loader(where, image_root)
    in_row: dict[str, Any] | None = None
    out = []
    for source in sources:
        if not source.startswith("xxh3:"):
            out.append(loader.load(source, source).image)
            continue
        if in_row is None:  # the row's own bytes: read it again, once per sample
            in_row = {i.source: i.image for i in _reread(data, split, source_row, image_root)}
        if source not in in_row:
            raise RowFailure(
                f"{where}: its image {source} is no longer in the row: --data changed while the run read it; "
                "rerun on unchanged data",
                BAD_IMAGE,
            )
        out.append(in_row[source])
    return out


def _reread(data: str, split: str | None, source_row: int, image_root: str) -> list[RowImage]:
    """The images of row ``source_row`` (0-based) of ``data``, read again (none if the row is gone)."""
    row = next((r for n, r in iter_rows(data, split) if n == source_row), None)
    return [] if row is None else image_messages(row, f"{data}:{source_row + 1}", image_root)[2]


def row_images(data: str, split: str | None, source_row: int, image_root: str) -> list[Any]:
    """The decoded images of row ``source_row`` (0-based) of ``data``, in the order its samples' image tokens
    hold them, read again as precompute read the row (relative paths against ``image_root``).

    Raises:
        RowFailure: an image is missing or unreadable.
    """
    return [image.image for image in _reread(data, split, source_row, image_root)]
