"""Chat data: rows read from files, rendered with the tokenizer's chat template, masked and tokenized."""

from speccache.data.chat import (
    DataStats,
    TokenizedSample,
    file_content_hash,
    iter_rows,
    load_samples,
    tokenize_row,
    tokenizer_hash,
)

__all__ = [
    "DataStats",
    "TokenizedSample",
    "file_content_hash",
    "iter_rows",
    "load_samples",
    "tokenize_row",
    "tokenizer_hash",
]
