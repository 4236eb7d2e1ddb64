"""``sparse``: lossless storage of a key whose rows are mostly zero (a VLM cache's ``image_embeds``, non-zero at
image tokens only).

A row is stored when any of its bits is set: ``-0.0`` and NaN rows are kept as they are, so that decoding gives
back every value bit for bit; a row of ``+0.0`` (all bits clear) is left out and decodes as zeros.

Parts:
    ``""`` (the main part): ``[stored, *shape]``, the kept rows in row order (``stored`` depends on the values:
    :class:`~speccache.format.encoding._base.PartLayout` length ``"stored"``).
    ``index``: int32 ``[num_rows]``, each row's position among the kept rows, or -1 for a zero row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from speccache.format.encoding._base import PartLayout

__all__ = ["SparseEncoding"]


class SparseEncoding:
    """Only the rows that are not all zero bits, and each row's index among them."""

    name = "sparse"
    lossless = True
    zero_copy = False

    def parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, PartLayout]:
        return {"": PartLayout(dtype, tuple(shape), length="stored"), "index": PartLayout(torch.int32)}

    def check_dtype(self, key: str, dtype: torch.dtype) -> None:
        return None

    def encode(self, rows: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        if rows.ndim == 0:
            raise ValueError("sparse encoding needs rows of shape [num_rows, *shape], got a scalar")
        # Bits, not values: -0.0 == 0.0 as a float, but it is not the row a decoder rebuilds.
        rows = rows.detach().cpu().contiguous()
        bits = rows.reshape(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)
        kept = (bits != 0).any(dim=1)
        index = torch.full((rows.shape[0],), -1, dtype=torch.int32)
        index[kept] = torch.arange(int(kept.sum()), dtype=torch.int32)
        return {"": rows[kept].contiguous(), "index": index}

    def decode(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return _expand(parts[""], parts["index"][int(offsets[start]) : int(offsets[end])])

    def decode_rows(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, sample: int, first: int, last: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        base = int(offsets[sample])
        return _expand(parts[""], parts["index"][base + first : base + last])


def _expand(stored: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` names: ``stored[index[i]]``, or zeros where ``index[i]`` is -1.

    Raises:
        ValueError: an index outside ``[-1, len(stored))`` (parts that disagree: damaged data).
    """
    out = torch.zeros((index.shape[0], *stored.shape[1:]), dtype=stored.dtype)
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < -1 or high >= stored.shape[0]:
            raise ValueError(f"sparse: row index {low if low < -1 else high} outside [-1, {stored.shape[0]})")
        kept = index >= 0
        out[kept] = stored[index[kept].long()]
    return out
