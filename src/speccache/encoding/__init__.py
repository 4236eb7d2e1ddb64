"""Per-key storage encodings.

A key's rows (tokens for a ragged key, samples for a fixed key) are stored in a
shard as one or more *parts*: safetensors tensors named ``key`` (suffix ``""``)
or ``f"{key}.{suffix}"``. An encoding turns a shard's rows into parts and reads
a run of samples back out of them. Readers never special-case an encoding: they
hand the shard's parts (zero-copy views) to :meth:`Encoding.decode`.

``raw`` stores the rows as they are. ``fp8`` and ``zbf16`` live in their own
modules and register themselves here.
"""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

__all__ = ["Encoding", "RawEncoding", "get_encoding", "register_encoding", "ENCODINGS", "part_name"]


class Encoding(Protocol):
    """How one key's rows are laid out in a shard.

    Attributes:
        name: the name recorded in the manifest key schema (``"raw"``, ``"fp8"``...).
        lossless: whether ``decode(encode(x)) == x`` bit for bit.
    """

    name: str
    lossless: bool

    def check_dtype(self, key: str, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` naming ``key`` if this encoding cannot store ``dtype``."""

    def encode(self, rows: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode one shard's rows.

        Args:
            rows: ``[num_rows, *shape]``, every sample's rows concatenated.
            offsets: int64 ``[n + 1]``; sample ``i`` owns ``rows[offsets[i]:offsets[i+1]]``.

        Returns:
            Parts by suffix (``""`` is the main part), each contiguous.
        """

    def decode(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Return the rows of samples ``[start, end)`` as ``dtype``.

        ``parts`` are views of the whole shard's parts. The result may be a view
        into them (callers copy before handing data out).
        """


class RawEncoding:
    """Rows stored as they are: one part, sliced without a copy."""

    name = "raw"
    lossless = True

    def check_dtype(self, key: str, dtype: torch.dtype) -> None:
        return None

    def encode(self, rows: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"": rows.contiguous()}

    def decode(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return parts[""][int(offsets[start]) : int(offsets[end])]


ENCODINGS: dict[str, Encoding] = {}


def register_encoding(encoding: Encoding) -> Encoding:
    """Make ``encoding`` available by its name to writers and readers."""
    ENCODINGS[encoding.name] = encoding
    return encoding


def get_encoding(name: str) -> Encoding:
    """Return the encoding called ``name``.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown encoding {name!r}; choose one of {sorted(ENCODINGS)}") from None


def part_name(key: str, suffix: str) -> str:
    """Name of the safetensors tensor that holds part ``suffix`` of ``key``."""
    return key if not suffix else f"{key}.{suffix}"


register_encoding(RawEncoding())

from speccache.encoding import fp8 as _fp8, zbf16 as _zbf16  # noqa: E402,F401  (register)
