"""The mistral-common backend: rows of a target without a Jinja template, encoded by mistral-common."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from speccache.data._failure import RowFailure, unplaceable
from speccache.data._messages import with_system_prompt

__all__ = ["MistralCommonFormat", "mistral_common_mask", "mistral_common_path", "mistral_encoder"]


@dataclass(frozen=True)
class MistralCommonFormat:
    """How chat rows become tokens and masks for a tokenizer with no Jinja template (``MistralCommonBackend``).

    Rows are encoded by ``mistral-common``'s own chat requests (fine-tuning validation, which takes a final
    assistant message), as Mistral's serving stack encodes them; each assistant message's tokens, as its
    encoder writes them, are located in the whole. Attributes as :class:`ChatFormat`'s.
    """

    tokenizer_path: str
    reasoning: str
    system_prompt: str | None
    date: str
    tools: list[dict] | None = None
    turns: str = "all"
    expand_turns: bool = False
    template: str = ""  # no Jinja template: recorded as the hash of nothing
    uses_date = False

    def with_system_prompt(self, messages: list[dict]) -> list[dict]:
        """``messages`` with :attr:`system_prompt` prepended when they have no system message."""
        return with_system_prompt(messages, self.system_prompt)

    def encode(self, messages: list[dict], where: str, tools: Any) -> tuple[list[int], list[list[int]]]:
        """The conversation's tokens and, in order, each assistant message's own tokens.

        Raises:
            RowFailure: mistral-common refuses the conversation (reason ``template_error``).
        """
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        encoder = mistral_encoder(self.tokenizer_path)
        instruct = encoder.instruct_tokenizer
        assistant: list[list[int]] = []
        encode_assistant = instruct.encode_assistant_message

        def recording(*args: Any, **kwargs: Any) -> list[int]:
            tokens = encode_assistant(*args, **kwargs)
            assistant.append(list(tokens))
            return tokens

        instruct.encode_assistant_message = recording  # an instance attribute: this encoder only, this call
        try:
            request = ChatCompletionRequest.from_openai(messages=messages, tools=tools or None)
            tokens = list(encoder.encode_chat_completion(request).tokens)
        except Exception as e:  # mistral-common's validation raises its own exception types and pydantic's
            raise RowFailure(
                f"{where}: mistral-common rejected the conversation ({type(e).__name__}: {e}); fix the row's "
                "roles or order, or skip such rows with --skip-bad-rows",
                "template_error",
            ) from e
        finally:
            del instruct.encode_assistant_message
        return tokens, assistant


@lru_cache(maxsize=4)
def mistral_encoder(path: str) -> Any:
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(path, mode=ValidationMode.finetuning)


def mistral_common_mask(
    fmt: MistralCommonFormat, messages: list[dict], where: str, tools: Any, turns: str
) -> tuple[np.ndarray, np.ndarray]:
    tokens, assistant = fmt.encode(messages, where, tools)
    mask = np.zeros(len(tokens), dtype=np.uint8)
    spans, pos = [], 0
    for piece in assistant:
        at = next((i for i in range(pos, len(tokens) - len(piece) + 1) if tokens[i : i + len(piece)] == piece), -1)
        if at < 0:
            raise unplaceable(where, "an assistant message's tokens are not in the encoded conversation")
        spans.append((at, at + len(piece)))
        pos = at + len(piece)
    for a, b in spans[-1:] if turns == "last" else spans:
        mask[a:b] = 1
    return np.asarray(tokens, dtype=np.int32), mask


def mistral_common_path(tokenizer: Any) -> str | None:
    """The tokenizer file of a ``MistralCommonBackend`` (rows are then encoded by mistral-common), else None."""
    path = getattr(tokenizer, "_tokenizer_path", None)
    inner = getattr(tokenizer, "__dict__", {}).get("tokenizer")
    return str(path) if path is not None and hasattr(inner, "encode_chat_completion") else None
