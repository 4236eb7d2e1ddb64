"""``fp8``: float8 e4m3fn values with one fp32 scale per row (lossy).

Each row is divided by ``amax(|row|) / 448`` so that its largest magnitude maps
onto e4m3fn's largest finite value, then rounded to e4m3fn. With 3 mantissa bits
the rounding error of an element is at most ``2**-4`` of its magnitude (elements
in e4m3's subnormal range err by at most ``amax * 2**-10 / 448``), so a row's
error is bounded by ``amax * 2**-4``; RMS error is about 2 % on activation-like data.
At 1 byte per value plus 4 bytes per row, a row of width 4096 costs 50.05 % of
its bf16 size.

Parts: ``""`` float8_e4m3fn ``[num_rows, *shape]`` and ``scale`` float32
``[num_rows]``; both slice per sample without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from speccache.errors import UsageError
from speccache.format.encoding._base import PartLayout

__all__ = ["Fp8Encoding", "fp8_error", "FP8_MAX"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A row whose amax / 448 underflows fp32 still needs a non-zero scale so that its
# values land inside e4m3's range instead of dividing by zero.
_MIN_SCALE = 2.0**-149
_FP8_TO_FP32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_BLOCK_VALUES = 1 << 18


class Fp8Encoding:
    """float8 e4m3fn with a per-row fp32 scale; accepts bf16, fp16 and fp32 keys."""

    name = "fp8"
    lossless = False
    zero_copy = False

    def parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, PartLayout]:
        return {"": PartLayout(torch.float8_e4m3fn, tuple(shape)), "scale": PartLayout(torch.float32)}

    def check_dtype(self, key: str, dtype: torch.dtype) -> None:
        if dtype not in _FLOAT_DTYPES:
            raise UsageError(
                f"key {key!r}: encoding 'fp8' stores only bfloat16/float16/float32 values, got {dtype}; use 'raw'"
            )

    def encode(self, rows: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        if rows.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"fp8 encoding needs bfloat16/float16/float32 rows, got {rows.dtype}")
        if rows.ndim == 0:
            raise ValueError("fp8 encoding needs rows of shape [num_rows, *shape], got a scalar")
        x = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
        # |x| and max are exact in the input dtype, which is cheaper than a float copy.
        if x.shape[1]:
            amax = x.abs().amax(dim=1).float()
        else:
            amax = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        # amax propagates NaN and inf, so only a bad shard pays for the full scan.
        if not bool(torch.isfinite(amax).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise ValueError(
                f"fp8 encoding cannot store non-finite values: {bad} of {x.numel()} values are NaN or inf; "
                "use 'raw' or 'zbf16' for this key"
            )
        scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(_MIN_SCALE), torch.ones_like(amax))
        values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        block = max(1, _BLOCK_VALUES // max(x.shape[1], 1))
        for a in range(0, x.shape[0], block):
            b = min(a + block, x.shape[0])
            # x / scale can exceed 448 by an fp32 ulp; round-to-nearest still lands on 448.
            values[a:b] = x[a:b].to(torch.float32, copy=True).div_(scale[a:b, None])
        return {"": values.reshape(rows.shape), "scale": scale}

    def decode(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return _decode_span(parts, int(offsets[start]), int(offsets[end]), dtype)

    def decode_rows(
        self, parts: Mapping[str, torch.Tensor], offsets: torch.Tensor, sample: int, first: int, last: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        base = int(offsets[sample])  # each row has its own scale: a run of rows decodes on its own
        return _decode_span(parts, base + first, base + last, dtype)


def _decode_span(parts: Mapping[str, torch.Tensor], r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the shard's key as ``dtype``."""
    values = parts[""][r0:r1]
    num_rows, width = values.shape[0], math.prod(values.shape[1:])
    codes = values.view(torch.uint8).reshape(num_rows, width).numpy()
    scale = parts["scale"][r0:r1].numpy()
    out = torch.empty((num_rows, width), dtype=dtype)
    # torch's fp8 -> fp32 cast runs at ~150 M values/s per core; a 256-entry table
    # lookup plus an fp32 multiply gives the same bits ~5x faster. Working in
    # blocks keeps the fp32 intermediate in cache.
    block = max(1, _BLOCK_VALUES // max(width, 1))
    buf = np.empty((min(block, num_rows), width), dtype=np.float32)
    buf_t = torch.from_numpy(buf)
    for a in range(0, num_rows, block):
        b = min(a + block, num_rows)
        np.take(_FP8_TO_FP32, codes[a:b], out=buf[: b - a])
        np.multiply(buf[: b - a], scale[a:b, None], out=buf[: b - a])
        out[a:b].copy_(buf_t[: b - a])
    return out.reshape(values.shape)


def fp8_error(original: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """Error of ``decoded`` against ``original`` (both ``[num_rows, *shape]``).

    Returns:
        ``rel_rms``: ``||x - y|| / ||x||`` over all elements (0 when both are zero);
        ``max_rel_to_row_amax``: ``max |x - y| / amax(|row of x|)`` (rows of zeros
        count ``|x - y|`` against 1 so that any error shows).
    """
    x = original.double()
    diff = x - decoded.double()
    norm = float(torch.linalg.vector_norm(x))
    err = float(torch.linalg.vector_norm(diff))
    rel_rms = err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))
    if x.numel() == 0:
        return {"rel_rms": rel_rms, "max_rel_to_row_amax": 0.0}
    num_rows = x.shape[0] if x.ndim else 1
    amax = x.reshape(num_rows, -1).abs().amax(dim=1)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    row_err = diff.reshape(num_rows, -1).abs().amax(dim=1)
    return {"rel_rms": rel_rms, "max_rel_to_row_amax": float((row_err / amax).max())}
