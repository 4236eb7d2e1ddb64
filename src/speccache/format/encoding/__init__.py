"""Per-key storage encodings.

A key's rows (tokens for a ragged key, samples for a fixed key) are stored in a
shard as one or more *parts*: safetensors tensors named ``key`` (suffix ``""``)
or ``f"{key}.{suffix}"``. An encoding turns a shard's rows into parts and reads
a run of samples back out of them. Readers never special-case an encoding: they
hand the shard's parts (zero-copy views) to :meth:`Encoding.decode`.

Each encoding also describes its parts without data (:meth:`Encoding.parts`), so
the shard checks, size estimates and readers ask it instead of knowing its layout.

``raw`` stores the rows as they are. ``fp8`` and ``zbf16`` live in their own
modules and register themselves here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from speccache.errors import UsageError

__all__ = [
    "Encoding",
    "PartLayout",
    "RawEncoding",
    "get_encoding",
    "parse_encodings",
    "register_encoding",
    "ENCODINGS",
    "part_name",
]


@dataclass(frozen=True)
class PartLayout:
    """One part of an encoded key: its dtype and how its shape follows from a shard's counts.

    Attributes:
        dtype: the part's dtype.
        trailing: the shape after the first dimension.
        length: what the first dimension counts: ``"rows"`` (one per row of the key), ``"samples+1"``
            (offsets, one per sample plus one) or ``"bytes"`` (data-dependent, e.g. compressed bytes).
    """

    dtype: torch.dtype
    trailing: tuple[int, ...] = ()
    length: str = "rows"

    def shape(self, num_rows: int, num_samples: int, data_bytes: int = 0) -> tuple[int, ...]:
        """The part's shape in a shard of ``num_samples`` samples and ``num_rows`` rows of the key."""
        first = {"rows": num_rows, "samples+1": num_samples + 1, "bytes": data_bytes}[self.length]
        return (first, *self.trailing)

    def nbytes(self, num_rows: int, num_samples: int, data_bytes: int = 0) -> int:
        """The part's size in bytes (see :meth:`shape`)."""
        return math.prod(self.shape(num_rows, num_samples, data_bytes)) * self.dtype.itemsize


class Encoding(Protocol):
    """How one key's rows are laid out in a shard.

    Attributes:
        name: the name recorded in the manifest key schema (``"raw"``, ``"fp8"``...).
        lossless: whether ``decode(encode(x)) == x`` bit for bit.
        zero_copy: whether the main part holds the rows exactly as readers return them, so that
            a reader may copy its bytes straight into a batch instead of calling :meth:`decode`.
    """

    name: str
    lossless: bool
    zero_copy: bool

    def parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, PartLayout]:
        """The parts a key of ``dtype`` and per-row ``shape`` is stored as, by suffix."""

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

    def decode_rows(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, sample: int, first: int, last: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """Return rows ``[first, last)`` of sample ``sample`` (positions within it) as ``dtype``, touching only the
        parts' bytes those rows need (as little of them as the encoding allows); may be a view, as :meth:`decode`."""


class RawEncoding:
    """Rows stored as they are: one part, sliced without a copy."""

    name = "raw"
    lossless = True
    zero_copy = True

    def parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, PartLayout]:
        return {"": PartLayout(dtype, tuple(shape))}

    def check_dtype(self, key: str, dtype: torch.dtype) -> None:
        return None

    def encode(self, rows: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"": rows.contiguous()}

    def decode(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return parts[""][int(offsets[start]) : int(offsets[end])]

    def decode_rows(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, sample: int, first: int, last: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        base = int(offsets[sample])
        return parts[""][base + first : base + last]


ENCODINGS: dict[str, Encoding] = {}


def register_encoding(encoding: Encoding) -> Encoding:
    """Make ``encoding`` available by its name to writers and readers."""
    ENCODINGS[encoding.name] = encoding
    return encoding


def parse_encodings(text: str) -> dict[str, str]:
    """Parse ``--encode KEY=ENCODING,...`` (e.g. ``aux_hidden_states=fp8,last_hidden_state=zbf16``).

    Raises:
        ValueError: an item that is not ``KEY=ENCODING``.
    """
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, enc = item.partition("=")
        if not sep or not key or not enc:
            raise UsageError(f"--encode item {item!r} must look like KEY=ENCODING (e.g. aux_hidden_states=fp8)")
        out[key.strip()] = enc.strip()
    return out


def get_encoding(name: str) -> Encoding:
    """Return the encoding called ``name``.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    try:
        return ENCODINGS[name]
    except KeyError:
        raise UsageError(f"unknown encoding {name!r}; choose one of {sorted(ENCODINGS)}") from None


def part_name(key: str, suffix: str) -> str:
    """Name of the safetensors tensor that holds part ``suffix`` of ``key``."""
    return key if not suffix else f"{key}.{suffix}"


register_encoding(RawEncoding())

from speccache.format.encoding import fp8, zbf16  # noqa: E402, F401 - importing them registers them
