"""The key schema: which tensors a cache stores per sample, their dtypes, shapes and encodings."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from speccache.errors import CacheFormatError
from speccache.format.encoding import get_encoding
from speccache.format.names import MAX_ELEMENTS, SAMPLE_TURN_KEY, SOURCE_ROW_KEY

__all__ = [
    "KeySpec",
    "Schema",
    "dtype_from_name",
    "dtype_name",
    "dtype_of_safetensors_code",
    "safetensors_code",
    "sample_turn_spec",
    "schema_from_json",
    "schema_to_json",
    "source_row_spec",
]

_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
_BY_TORCH = {dt: name for name, (dt, _) in _DTYPES.items()}
_BY_ST = {st: dt for _, (dt, st) in _DTYPES.items()}
_ST_OF = {dt: st for _, (dt, st) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise CacheFormatError(f"dtype {dtype} cannot be stored; use one of {sorted(_DTYPES)}") from None


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors header's name of a storable dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    dtype_name(dtype)
    return _ST_OF[dtype]


def dtype_of_safetensors_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors header dtype name; ``KeyError`` for an unknown one."""
    return _BY_ST[code]


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype of a manifest dtype name."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise CacheFormatError(f"unknown dtype {name!r} in key schema; known: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KeySpec:
    """One stored key.

    Attributes:
        name: tensor name.
        dtype: dtype the reader returns.
        shape: per-sample shape of a fixed key; per-row trailing shape of a ragged key.
        ragged: whether each sample has its own number of rows (concatenated, with offsets).
        encoding: storage encoding (``raw``, ``fp8``, ``zbf16``).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False
    encoding: str = "raw"

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("__") or "." in self.name:
            raise ValueError(f"key name {self.name!r} is reserved or invalid: use a non-empty name without '.' or '__'")
        dtype_name(self.dtype)
        get_encoding(self.encoding).check_dtype(self.name, self.dtype)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"key {self.name!r}: shape {self.shape} must be non-negative integers")
        if math.prod(self.shape) >= MAX_ELEMENTS:
            raise ValueError(f"key {self.name!r}: shape {self.shape} has too many elements per row")

    def to_json(self) -> dict[str, Any]:
        """The key's manifest entry."""
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "ragged": self.ragged,
            "encoding": self.encoding,
        }

    @classmethod
    def from_json(cls, name: str, entry: Mapping[str, Any]) -> KeySpec:
        """Parse a manifest entry.

        Raises:
            CacheFormatError: a malformed entry.
        """
        try:
            return cls(
                name=name,
                dtype=dtype_from_name(entry["dtype"]),
                shape=tuple(int(d) for d in entry["shape"]),
                ragged=bool(entry["ragged"]),
                encoding=str(entry.get("encoding", "raw")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CacheFormatError(f"malformed key schema entry for {name!r}: {entry!r} ({exc})") from None


Schema = dict[str, KeySpec]


def source_row_spec() -> KeySpec:
    """The fixed int64 key under which every sample records its 0-based row in the data file.

    Every method's schema adds it, and its ``compute_batch`` copies the batch's ``source_row`` column.
    """
    return KeySpec(SOURCE_ROW_KEY, torch.int64, ())


def sample_turn_spec() -> KeySpec:
    """The fixed int64 key under which an --expand-turns cache records each sample's 0-based assistant turn."""
    return KeySpec(SAMPLE_TURN_KEY, torch.int64, ())


def schema_to_json(schema: Schema) -> dict[str, Any]:
    """The manifest's ``keys`` object."""
    return {name: spec.to_json() for name, spec in schema.items()}


def schema_from_json(keys: Any, where: str) -> Schema:
    """Parse a manifest's ``keys`` object.

    Raises:
        CacheFormatError: not an object or a malformed entry (message names ``where``).
    """
    if not isinstance(keys, dict) or not keys:
        raise CacheFormatError(f"{where}: 'keys' must be a non-empty object mapping key names to their schema")
    try:
        return {name: KeySpec.from_json(name, entry) for name, entry in keys.items()}
    except CacheFormatError as exc:
        raise CacheFormatError(f"{where}: {exc}") from None
