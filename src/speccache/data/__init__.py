"""Chat data: rows read from files, rendered with the chat template, masked and tokenized.

Its modules: :mod:`~speccache.data.chat` (the load path: ``load_samples``, ``merge_parts``, ``tokenize_row``),
:mod:`~speccache.data.template` (``ChatFormat``: rendering, turn location, masks),
:mod:`~speccache.data.regenerated` (the directory ``speccache regenerate`` writes); behind them, private:
``_files`` (file kinds, raw rows, data hashes), ``_messages`` (message normalisation), ``_samples`` (samples,
skip and drop accounting), ``_encode`` (one row to samples), ``_pool`` (worker processes), ``_tokenizer``
(tokenizer, template and tools files), ``_mistral`` (the mistral-common backend), ``_dropped`` (the fields a
rendering drops), ``_failure`` (``RowFailure``).
"""

from speccache.data._failure import RowFailure
from speccache.data._files import data_root, file_content_hash, is_hub_id, iter_rows
from speccache.data._images import (
    check_image_root,
    has_images,
    image_messages,
    image_root_of,
    row_images,
    sample_images,
)
from speccache.data._messages import chat_messages
from speccache.data._processor import (
    ProcessorRecord,
    load_processor,
    processor_record,
    recorded_processor,
    vision_processor_class,
)
from speccache.data._samples import (
    DROPPED_MODES,
    DataStats,
    DroppedField,
    SkippedRow,
    TokenizedSample,
    TokenizedSamples,
    check_dropped_mode,
    dropped_summary,
)
from speccache.data._tokenizer import (
    chat_template_of,
    check_model_source,
    load_chat_tokenizer,
    load_template_file,
    load_tools_file,
    tokenizer_hash,
)
from speccache.data._vision import MODALITY_KEYS, Vision, bare_images, image_count, image_token_id, processor_inputs
from speccache.data.chat import load_samples, merge_parts, tokenize_row
from speccache.data.template import REASONING_MODES, TURN_MODES, ChatFormat, chat_format, today

__all__ = [
    "DROPPED_MODES",
    "MODALITY_KEYS",
    "REASONING_MODES",
    "ChatFormat",
    "DataStats",
    "DroppedField",
    "ProcessorRecord",
    "RowFailure",
    "SkippedRow",
    "TokenizedSample",
    "TokenizedSamples",
    "Vision",
    "bare_images",
    "chat_format",
    "chat_messages",
    "chat_template_of",
    "check_image_root",
    "check_dropped_mode",
    "check_model_source",
    "data_root",
    "dropped_summary",
    "load_chat_tokenizer",
    "load_processor",
    "file_content_hash",
    "has_images",
    "image_count",
    "image_messages",
    "image_root_of",
    "image_token_id",
    "is_hub_id",
    "iter_rows",
    "load_samples",
    "load_template_file",
    "load_tools_file",
    "merge_parts",
    "processor_inputs",
    "processor_record",
    "recorded_processor",
    "row_images",
    "sample_images",
    "TURN_MODES",
    "today",
    "tokenize_row",
    "tokenizer_hash",
    "vision_processor_class",
]
