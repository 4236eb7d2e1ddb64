"""Per-key storage encodings.

A key's rows (tokens for a ragged key, samples for a fixed key) are stored in a
shard as one or more *parts*: safetensors tensors named ``key`` (suffix ``""``)
or ``f"{key}.{suffix}"``. An encoding turns a shard's rows into parts and reads
a run of samples back out of them. Readers never special-case an encoding: they
hand the shard's parts (zero-copy views) to :meth:`Encoding.decode`.

Each encoding also describes its parts without data (:meth:`Encoding.parts`), so
the shard checks, size estimates and readers ask it instead of knowing its layout.

``raw`` stores the rows as they are. ``fp8``, ``zbf16`` and ``sparse`` live in
their own modules; this package imports them and registers all four.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from speccache.errors import UsageError
from speccache.format.encoding._base import Encoding, PartLayout
from speccache.format.encoding.fp8 import Fp8Encoding
from speccache.format.encoding.sparse import SparseEncoding
from speccache.format.encoding.zbf16 import Zbf16Encoding

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


ENCODINGS: dict[str, Encoding] = {e.name: e for e in (RawEncoding(), Fp8Encoding(), Zbf16Encoding(), SparseEncoding())}
"""Every encoding by its name: the four built in, and any :func:`register_encoding` adds."""


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
