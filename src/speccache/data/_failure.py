"""Why a row cannot be used: :class:`RowFailure`, and the failures every reader of rows names alike."""

from __future__ import annotations

from typing import Any

from speccache.errors import DataError

__all__ = ["RowFailure", "not_an_object", "row_error", "unplaceable"]


class RowFailure(DataError):
    """One row cannot be used; ``reason`` is the short snake_case name it is counted under when skipped."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason  # kept across pickling (worker processes, ranks) by the exception's __dict__


def row_error(message: str) -> RowFailure:
    """A row that is not a valid row (counted as ``malformed``)."""
    return RowFailure(message, "malformed")


def not_an_object(where: str, value: Any) -> RowFailure:
    """A row ``where`` whose value is not a JSON object."""
    return row_error(f"{where}: expected a JSON object per row, got {type(value).__name__}; fix or remove the row")


def unplaceable(where: str, why: str) -> RowFailure:
    """A row whose assistant turns cannot be located in its rendering (counted as ``mask_unplaceable``)."""
    return RowFailure(
        f"{where}: cannot locate the assistant turns in the rendered conversation ({why}); pass a --chat-template "
        "that marks assistant output with {% generation %}, or skip such rows with --skip-bad-rows",
        "mask_unplaceable",
    )
