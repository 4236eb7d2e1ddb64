"""A model directory's multimodal processor, loaded as transformers loads it, and what makes its pixels.

``AutoProcessor.from_pretrained`` cannot load a Qwen2.5-VL or Qwen3-VL processor without torchvision: both carry
a video processor, which needs it, and none of its keyword arguments leaves the video processor out
(``video_processor=None`` is read as "not given" and loaded anyway). The processors built here are the
image-only subclass of the same class: transformers derives a processor's parts from its ``__init__``
signature, so a subclass whose ``__init__`` has no ``video_processor`` loads and saves only the image processor
and the tokenizer, and renders images exactly as the original (video parts are refused before it is called).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from speccache.errors import DataError, UsageError

__all__ = [
    "ProcessorRecord",
    "image_only",
    "load_processor",
    "processor_record",
    "recorded_processor",
    "vision_processor_class",
]

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_PIXEL_SIZE_FLAGS = ("min_pixels", "max_pixels")


def image_only(processor_cls: Any) -> Any:
    """The subclass of ``processor_cls`` (a processor class with a video processor) that has none.

    Args:
        processor_cls: e.g. ``Qwen2_5_VLProcessor`` or ``Qwen3VLProcessor``.

    Returns:
        A class of the same name (so ``save_pretrained`` records the same ``processor_class``) whose
        ``__init__`` takes ``image_processor``, ``tokenizer`` and ``chat_template`` only.
    """

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any):
        processor_cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kw)

    return type(processor_cls.__name__, (processor_cls,), {"__init__": __init__, "__module__": __name__})


def _processor_class(path: str) -> str | None:
    """The ``processor_class`` a model directory's processor files name; None when it has none."""
    for name in _PROCESSOR_FILES:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                value = json.load(f).get("processor_class")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{file}: not a readable processor config ({e}); save the processor again") from e
        if isinstance(value, str):
            return value
    return None


def vision_processor_class(path: str) -> str | None:
    """The multimodal processor class model directory ``path`` names (``Qwen2_5_VLProcessor``...); None for a
    text-only model (no processor files, or a tokenizer only).

    Raises:
        DataError: a processor file is not readable JSON.
    """
    name = _processor_class(path)
    return None if name is None or name.endswith(("Tokenizer", "TokenizerFast")) else name


def load_processor(path: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any | None:
    """The processor of model directory ``path``; None when it has none (a text-only target).

    Args:
        path: A local model directory.
        min_pixels: Qwen-VL's ``size.shortest_edge`` (``--min-pixels``); None keeps the directory's.
        max_pixels: Qwen-VL's ``size.longest_edge`` (``--max-pixels``); None keeps the directory's.

    Returns:
        The processor, or None.

    Raises:
        DataError: the processor files cannot be loaded.
        UsageError: ``--min-pixels``/``--max-pixels`` for a processor without those settings.
    """
    import transformers

    name = vision_processor_class(path) if os.path.isdir(path) else None
    if name is None:
        if min_pixels is not None or max_pixels is not None:
            raise UsageError(
                f"--min-pixels/--max-pixels: {path} has no image processor (a text-only target); drop the flags"
            )
        return None
    cls = getattr(transformers, name, None)
    try:
        if cls is not None and "video_processor" in getattr(cls, "get_attributes", lambda: [])():
            processor = image_only(cls).from_pretrained(path)
        else:
            processor = transformers.AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, ImportError, TypeError) as e:
        raise DataError(f"{path}: cannot load its processor {name} ({e}); check the model directory") from e
    _set_pixel_limits(processor, path, min_pixels, max_pixels)
    return processor


def _set_pixel_limits(processor: Any, path: str, min_pixels: int | None, max_pixels: int | None) -> None:
    if min_pixels is None and max_pixels is None:
        return
    image_processor = processor.image_processor
    size = _size_settings(image_processor)
    if size.get("shortest_edge") is None or size.get("longest_edge") is None:
        raise UsageError(
            f"--min-pixels/--max-pixels: the image processor of {path} ({type(image_processor).__name__}) has "
            "no pixel budget (only Qwen-VL's has); drop the flags"
        )
    low = size["shortest_edge"] if min_pixels is None else min_pixels
    high = size["longest_edge"] if max_pixels is None else max_pixels
    if not 0 < low <= high:
        raise UsageError(f"--min-pixels {low} / --max-pixels {high}: need 0 < min-pixels <= max-pixels")
    # The same type as it holds (transformers' SizeDict), as the image processor reads it on every call.
    image_processor.size = type(image_processor.size)(**{**size, "shortest_edge": low, "longest_edge": high})


def _size_settings(image_processor: Any) -> dict:
    """The image processor's ``size`` settings that are set, as a plain dict."""
    size: Any = getattr(image_processor, "size", None)
    if dataclasses.is_dataclass(size) and not isinstance(size, type):
        size = dataclasses.asdict(size)
    return {k: v for k, v in dict(size or {}).items() if v is not None}


@dataclass(frozen=True)
class ProcessorRecord:
    """What makes a VLM target's pixels, for the manifest.

    Attributes:
        processor: the processor class (``Qwen2_5_VLProcessor``...).
        image_processor: the image processor class (``Qwen2VLImageProcessorPil``...).
        backend: how it resizes: ``pil`` or ``torchvision`` (their pixels differ).
        size: its size settings (``{"shortest_edge", "longest_edge"}`` for Qwen-VL, ``{"height", "width"}``...).
    """

    processor: str
    image_processor: str
    backend: str
    size: dict

    def as_dict(self) -> dict:
        return {
            "processor": self.processor,
            "image_processor": self.image_processor,
            "backend": self.backend,
            "size": dict(self.size),
        }


def processor_record(processor: Any) -> ProcessorRecord:
    """The :class:`ProcessorRecord` of a loaded processor."""
    image_processor = processor.image_processor
    name = type(image_processor).__name__
    return ProcessorRecord(
        processor=type(processor).__name__,
        image_processor=name,
        backend="pil" if name.endswith("Pil") else "torchvision",
        size=_size_settings(image_processor),
    )


def recorded_processor(path: str, recorded: dict, what: str) -> Any:
    """The processor of model directory ``path`` set as a cache recorded it (``config.vision``: its size settings
    applied as ``--min-pixels``/``--max-pixels`` where the processor has that budget), so that it makes the
    pixels the cache's samples were computed with.

    Raises:
        DataError: ``path`` has no processor, or its processor (class, resizing backend, sizes) differs from the
            recorded one; ``what`` names the cache.
    """
    size = recorded.get("size", {})
    budget = "shortest_edge" in size and "longest_edge" in size  # Qwen-VL's (CLIP's has a shortest edge only)
    pixels = (size["shortest_edge"], size["longest_edge"]) if budget else (None, None)
    if not os.path.isdir(path) or vision_processor_class(path) is None:
        raise DataError(f"--model {path} has no image processor, but {what} is a vision-language target's cache; "
                        "give the target the cache was computed with")  # fmt: skip
    processor = load_processor(path, *pixels)
    have = processor_record(processor).as_dict()
    differ = [f"{k} {recorded.get(k)!r} (now {v!r})" for k, v in have.items() if recorded.get(k) != v]
    if differ:
        raise DataError(
            f"{what} was computed with another image processor: {'; '.join(differ)}; use the target and the "
            "environment it was computed in (the torchvision backend resizes differently from pil)"
        )
    return processor
