"""What every encoding is built from: the layout of a part (:class:`PartLayout`) and the :class:`Encoding` protocol.

The encodings (``raw`` in the package, :mod:`~speccache.format.encoding.fp8`,
:mod:`~speccache.format.encoding.zbf16`, :mod:`~speccache.format.encoding.sparse`) import only this module; the
package imports them and builds the registry, so no encoding module imports the package that imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Encoding", "PartLayout"]


@dataclass(frozen=True)
class PartLayout:
    """One part of an encoded key: its dtype and how its shape follows from a shard's counts.

    Attributes:
        dtype: the part's dtype.
        trailing: the shape after the first dimension.
        length: what the first dimension counts: ``"rows"`` (one per row of the key), ``"samples+1"``
            (offsets, one per sample plus one), or, depending on the values, ``"bytes"`` (e.g. compressed
            bytes) or ``"stored"`` (the rows an encoding keeps, e.g. a sparse key's non-zero rows).
    """

    dtype: torch.dtype
    trailing: tuple[int, ...] = ()
    length: str = "rows"

    def shape(self, num_rows: int, num_samples: int, data_length: int = 0) -> tuple[int, ...]:
        """The part's shape in a shard of ``num_samples`` samples and ``num_rows`` rows of the key; ``data_length``
        is the first dimension of a part whose length depends on the values (``"bytes"``, ``"stored"``)."""
        first = {"rows": num_rows, "samples+1": num_samples + 1, "bytes": data_length, "stored": data_length}[
            self.length
        ]
        return (first, *self.trailing)

    def nbytes(self, num_rows: int, num_samples: int, data_length: int = 0) -> int:
        """The part's size in bytes (see :meth:`shape`)."""
        return math.prod(self.shape(num_rows, num_samples, data_length)) * self.dtype.itemsize


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
