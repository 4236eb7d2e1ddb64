"""Chat templates: render a conversation once and locate every assistant turn in it, for any template.

The loss mask of a chat row is 1 on the tokens the model generates in each assistant turn: the turn's
content (and its rendered reasoning with ``reasoning="keep"``) plus the end-of-turn token(s) the template
writes right after it, never system or user text or role headers. A token belongs to a turn when its
first character does (so a token that merges a header's newline with the content's is not trained on).

The turns are found without assuming the template is prefix-stable:

1. A template with ``{% generation %}`` markers gives the assistant character spans directly.
2. Otherwise the conversation is rendered twice: once as is, once with every assistant content replaced
   by unique sentinel strings (``<think>R</think>C`` when the content carries reasoning, so templates
   that split reasoning off treat both renders alike). The text between sentinels is template
   scaffolding; locating each scaffolding piece in order in the real rendering leaves, in the gaps, the
   exact rendered text of each assistant content, whatever the template did to it (stripped, reasoning
   moved or dropped). The end-of-turn is the special token that starts the scaffolding after the content
   (after optional whitespace).

Character spans become token masks through the fast tokenizer's offsets. Either way each conversation
costs at most two renders and one tokenization, whatever its number of turns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from speccache.errors import DataError

__all__ = [
    "REASONING_MODES",
    "ChatFormat",
    "RowFailure",
    "chat_format",
    "load_chat_tokenizer",
    "load_template_file",
    "mask_conversation",
    "today",
    "tokenizer_template",
]

REASONING_MODES = ("keep", "mask")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_DATE_USE = re.compile(r"strftime_now|date_string")
_THINK = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.DOTALL)
_DATE_FORMAT = "%Y-%m-%d"


class RowFailure(DataError):
    """One row cannot be used; ``reason`` is the short snake_case name it is counted under when skipped."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason  # kept across pickling (worker processes, ranks) by the exception's __dict__


def today() -> str:
    """Today's date as ``YYYY-MM-DD`` (the date pinned for templates that render it)."""
    return datetime.now().strftime(_DATE_FORMAT)


def load_template_file(path: str) -> str:
    """Read a ``--chat-template`` Jinja file.

    Raises:
        DataError: the file cannot be read as UTF-8 text.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--chat-template {path}: cannot read the template ({e}); pass a UTF-8 Jinja file") from e


@dataclass(frozen=True)
class ChatFormat:
    """How chat rows become text and masks.

    Attributes:
        template: the Jinja chat template.
        reasoning: ``keep`` (rendered reasoning is trained on) or ``mask`` (in the input, not in the loss).
        system_prompt: added as the first message of rows that have no system message.
        date: ``YYYY-MM-DD`` the template sees as today (``strftime_now``, ``date_string``).
        special_tokens: the tokenizer's special token strings (``bos_token``... variables of the template).
        end_tokens: special token strings that can close a turn, longest first.
    """

    template: str
    reasoning: str
    system_prompt: str | None
    date: str
    special_tokens: Mapping[str, Any]
    end_tokens: tuple[str, ...]

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        template: str,
        reasoning: str = "keep",
        system_prompt: str | None = None,
        date: str | None = None,
    ) -> ChatFormat:
        """Build the format of a fast tokenizer with ``template``.

        Raises:
            ValueError: ``reasoning`` is not one of :data:`REASONING_MODES`.
        """
        if reasoning not in REASONING_MODES:
            raise ValueError(f"--reasoning {reasoning!r} is unknown; choose one of {', '.join(REASONING_MODES)}")
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {str(t) for t in tokenizer.all_special_tokens}
        specials |= {str(t) for t in added.values() if getattr(t, "special", False)}
        return cls(
            template=template,
            reasoning=reasoning,
            system_prompt=system_prompt,
            date=date or today(),
            special_tokens=dict(tokenizer.special_tokens_map),
            end_tokens=tuple(sorted((s for s in specials if s), key=len, reverse=True)),
        )

    @property
    def uses_date(self) -> bool:
        """Whether the template can render the current date."""
        return bool(_DATE_USE.search(self.template))

    @property
    def has_generation_markers(self) -> bool:
        """Whether the template marks assistant output with ``{% generation %}``."""
        return bool(_GENERATION_TAG.search(self.template))

    def _variables(self) -> dict[str, Any]:
        pinned = datetime.strptime(self.date, _DATE_FORMAT)
        strftime_now: Callable[[str], str] = pinned.strftime
        return {**self.special_tokens, "strftime_now": strftime_now, "date_string": pinned.strftime("%d %b %Y")}

    def render(self, messages: list[dict], where: str, track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and, with ``track``, its ``{% generation %}`` character spans.

        Raises:
            RowFailure: the template rejected the conversation (reason ``template_error``).
        """
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _compile_jinja_template, _render_with_assistant_indices

        compiled = _compile_jinja_template(self.template)
        try:
            if track:
                text, spans = _render_with_assistant_indices(compiled, messages, None, None, False, **self._variables())
                return text, [(int(a), int(b)) for a, b in spans]
            return compiled.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=False, **self._variables()
            ), []
        except (TemplateError, TypeError, ValueError) as e:
            raise RowFailure(
                f"{where}: the chat template rejected the conversation ({e}); fix the row's roles or order, "
                "or pass --chat-template",
                "template_error",
            ) from e

    def with_system_prompt(self, messages: list[dict]) -> list[dict]:
        """``messages`` with :attr:`system_prompt` prepended when they have no system message."""
        if self.system_prompt is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]


def tokenizer_template(tokenizer: Any) -> str | None:
    try:
        return tokenizer.get_chat_template()
    except (ValueError, NotImplementedError, AttributeError):
        return None


def load_chat_tokenizer(model: str) -> Any:
    """Load ``model``'s tokenizer as a fast tokenizer, the kind whose offsets the masks need.

    ``AutoTokenizer`` may give a backend without ``get_chat_template`` or offsets (``MistralCommonBackend``
    when ``mistral-common`` is installed and the folder has ``tekken.json``); then the folder's
    ``tokenizer.json`` is loaded as a ``PreTrainedTokenizerFast`` instead.

    Raises:
        DataError: no fast tokenizer can be loaded from the folder.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(model)
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer"):
        return tokenizer
    try:
        return PreTrainedTokenizerFast.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise DataError(
            f"--model {model}: the tokenizer loads as {type(tokenizer).__name__}, which gives neither a chat "
            "template nor token offsets, and the folder has no loadable tokenizer.json; add the model's "
            f"tokenizer.json (a Hugging Face fast tokenizer) to the folder ({e})"
        ) from e


def chat_format(
    tokenizer: Any,
    template_file: str | None = None,
    reasoning: str = "keep",
    system_prompt: str | None = None,
    date: str | None = None,
) -> ChatFormat | None:
    """The chat format of a run: ``--chat-template`` or the tokenizer's template; None when there is none.

    Raises:
        DataError: the template file cannot be read, or the template is not valid Jinja.
        ValueError: unknown ``reasoning``.
    """
    template = load_template_file(template_file) if template_file else tokenizer_template(tokenizer)
    if template is None:
        return None
    _check_syntax(template, f"--chat-template {template_file}" if template_file else "the tokenizer's chat template")
    return ChatFormat.for_tokenizer(tokenizer, template, reasoning, system_prompt, date)


def _check_syntax(template: str, source: str) -> None:
    # A syntax error is the run's configuration, not a row's: found before any row, whatever --skip-bad-rows says.
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise DataError(f"{source}: line {e.lineno}: not a valid Jinja template ({e.message}); fix the template") from e


def _split_reasoning(content: str) -> tuple[str | None, str]:
    found = _THINK.match(content)
    if found is None or not found.group(1).strip():
        return None, content
    return found.group(1), found.group(2)


def _sentinel_messages(messages: list[dict]) -> tuple[list[dict], list[tuple[str, int, str]], str]:
    """Assistant contents replaced by sentinels; returns the messages, ``(sentinel, turn, part)`` and the pattern."""
    taken = "".join(m["content"] for m in messages)
    tag = "SPCQ"
    while tag in taken:
        tag += "Q"
    out, marks = [], []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            out.append(message)
            continue
        reasoning, _ = _split_reasoning(message["content"])
        answer = f"{tag}{turn}A{tag}"
        marks.append((answer, turn, "answer"))
        if reasoning is None:
            content = answer
        else:
            thought = f"{tag}{turn}R{tag}"
            marks.append((thought, turn, "reasoning"))
            content = f"<think>{thought}</think>{answer}"
        out.append({**message, "content": content})
    return out, marks, f"{tag}\\d+[AR]{tag}"


def _sentinel_spans(fmt: ChatFormat, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the real rendering) the loss covers, found by the sentinel rendering."""
    shadow_messages, marks, pattern = _sentinel_messages(messages)
    shadow, _ = fmt.render(shadow_messages, where)
    parts = re.split(f"({pattern})", shadow)
    # parts alternates scaffolding, sentinel, scaffolding, ...; each sentinel must appear at most once.
    found = parts[1::2]
    if len(found) != len(set(found)):
        raise _unplaceable(where, "the template renders an assistant message more than once")
    part_of = {s: part for s, _, part in marks}
    spans: list[tuple[int, int]] = []
    pos = 0
    if not text.startswith(parts[0]):
        raise _unplaceable(where, "the rendering does not start like the sentinel rendering")
    pos = len(parts[0])
    for i, sentinel in enumerate(found):
        after = parts[2 * i + 2]
        last = 2 * i + 3 >= len(parts)
        if last:
            end = len(text) - len(after)
            if end < pos or not text.endswith(after):
                raise _unplaceable(where, "the rendering does not end like the sentinel rendering")
        elif after:
            end = text.find(after, pos)
            if end < 0:
                raise _unplaceable(where, "template text around an assistant message changes with its content")
        else:
            raise _unplaceable(where, "two assistant parts are rendered with nothing between them")
        kind = part_of[sentinel]
        if kind == "reasoning":
            if fmt.reasoning == "keep":
                # The text between the reasoning and the answer (closing tag...) is generated too.
                spans.append((pos, end + len(after)))
        else:
            spans.append((pos, end + _end_of_turn(after, fmt.end_tokens)))
        pos = end + len(after)
    return spans


def _end_of_turn(scaffolding: str, end_tokens: tuple[str, ...]) -> int:
    """Length of the end-of-turn prefix of the text after a turn: optional whitespace, then a special token."""
    stripped = scaffolding.lstrip()
    for token in end_tokens:
        if stripped.startswith(token):
            return len(scaffolding) - len(stripped) + len(token)
    return 0


def _unplaceable(where: str, why: str) -> RowFailure:
    return RowFailure(
        f"{where}: cannot locate the assistant turns in the rendered conversation ({why}); pass a --chat-template "
        "that marks assistant output with {% generation %}, or skip such rows with --skip-bad-rows",
        "mask_unplaceable",
    )


def _spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    starts = offsets[:, 0]
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return mask


def mask_conversation(
    tokenizer: Any, fmt: ChatFormat, messages: list[dict], where: str
) -> tuple[np.ndarray, np.ndarray]:
    """Render, tokenize and mask one conversation.

    Args:
        tokenizer: a fast Hugging Face tokenizer (its offsets map characters to tokens).
        fmt: the chat format.
        messages: ``{"role", "content"}`` dicts; at least one assistant message.
        where: how to name the row in messages (``file:line``).

    Returns:
        ``(input_ids int32, loss_mask uint8)`` of the whole conversation.

    Raises:
        RowFailure: the template rejects the conversation, or its assistant turns cannot be located.
    """
    messages = fmt.with_system_prompt(messages)
    use_markers = fmt.has_generation_markers and not (
        fmt.reasoning == "mask" and any(_split_reasoning(m["content"])[0] for m in messages if m["role"] == "assistant")
    )
    text, spans = fmt.render(messages, where, track=use_markers)
    if not use_markers:
        spans = _sentinel_spans(fmt, messages, text, where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return ids, _spans_to_mask(offsets, spans)
