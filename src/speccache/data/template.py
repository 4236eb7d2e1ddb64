"""Chat templates: render a conversation once and locate every assistant turn in it, for any template.

The rendering is exactly ``tokenizer.apply_chat_template(messages, tools=tools)``'s: the same messages
(None fields dropped, reasoning under each name templates read), the tool schemas, the tokenizer's special
tokens, and nothing else a serving engine would not pass; only ``strftime_now`` is pinned for a run.

The loss mask of a chat row is 1 on the tokens the model generates in each assistant turn: everything the
template writes for the turn after the generation prompt (``add_generation_prompt=True``) ends, so
``<think>`` where the prompt lacks it, the reasoning (with ``reasoning="keep"``), the content, the tool calls
as the template renders them, and the end-of-turn token(s); never tool results, tool schemas, system or
user text, or role headers. A token is supervised when it starts in that text or shares a non-whitespace
character with it (so SentencePiece's ``▁The``, whose space the template writes, is; a token that merges a
header's newline with the content's is not).

The turns are found without assuming the template is prefix-stable:

1. A template with ``{% generation %}`` markers gives the assistant character spans directly.
2. Otherwise the conversation is rendered once more with every assistant content, reasoning and tool-call
   name replaced by unique sentinel strings (``<think>R</think>C`` when the content carries reasoning).
   The text between sentinels is template scaffolding; locating each piece in order in the real rendering
   leaves, in the gaps, the exact rendered text of each, whatever the template did to it (stripped,
   reasoning moved or dropped). A turn starts where the rendering leaves its generation prompt (a render
   of the conversation before it with the prompt, and without where that is not a prefix of the whole;
   where the conversation before it renders otherwise, after the longest tail of that prompt found before
   its first gap, else at that gap) and ends with the special token
   that closes its content (after optional whitespace) or its last tool call.

Character spans become token masks through the fast tokenizer's offsets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np

from speccache.data._failure import RowFailure, unplaceable
from speccache.data._messages import (
    REASONING_FIELDS,
    THINK,
    has_reasoning,
    reasoning_field,
    split_reasoning,
    with_system_prompt,
)
from speccache.data._mistral import MistralCommonFormat, mistral_common_mask, mistral_common_path, mistral_encoder
from speccache.data._tokenizer import load_template_file, load_tools_file, tokenizer_template
from speccache.errors import DataError, UsageError

__all__ = [
    "REASONING_MODES",
    "TURN_MODES",
    "ChatFormat",
    "chat_format",
    "conversation_samples",
    "masked_text",
    "mask_conversation",
    "samples_and_text",
    "split_generated_reasoning",
    "text_after_turn",
    "today",
]

REASONING_MODES = ("keep", "mask")
TURN_MODES = ("all", "last")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_DATE_USE = re.compile(r"strftime_now")
# What str.isspace() calls whitespace, as code points, so a whole rendering is classified at once.
_WHITESPACE = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)
_DATE_FORMAT = "%Y-%m-%d"


def today() -> str:
    """Today's date as ``YYYY-MM-DD`` (the date pinned for templates that render it)."""
    return datetime.now().strftime(_DATE_FORMAT)


@dataclass(frozen=True)
class ChatFormat:
    """How chat rows become text and masks.

    Attributes:
        template: the Jinja chat template.
        reasoning: ``keep`` (rendered reasoning is trained on) or ``mask`` (in the input, not in the loss).
        system_prompt: added as the first message of rows that have no system message.
        date: ``YYYY-MM-DD`` the template sees as today (``strftime_now``).
        special_tokens: the tokenizer's special token strings (``bos_token``... variables of the template).
        end_tokens: special token strings that can close a turn, longest first.
        tools: the tool schemas of rows that carry none (``--tools FILE``).
        turns: ``all`` assistant turns supervised, or only the ``last``.
        expand_turns: one sample per assistant turn (see :func:`conversation_samples`).
    """

    template: str
    reasoning: str
    system_prompt: str | None
    date: str
    special_tokens: Mapping[str, Any]
    end_tokens: tuple[str, ...]
    tools: list[dict] | None = None
    turns: str = "all"
    expand_turns: bool = False

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        template: str,
        reasoning: str = "keep",
        system_prompt: str | None = None,
        date: str | None = None,
        tools: list[dict] | None = None,
        turns: str = "all",
        expand_turns: bool = False,
    ) -> ChatFormat:
        """Build the format of a fast tokenizer with ``template``.

        Raises:
            ValueError: ``reasoning`` is not one of :data:`REASONING_MODES`, or ``turns`` of :data:`TURN_MODES`.
        """
        if reasoning not in REASONING_MODES:
            raise UsageError(f"--reasoning {reasoning!r} is unknown; choose one of {', '.join(REASONING_MODES)}")
        if turns not in TURN_MODES:
            raise UsageError(f"--turns {turns!r} is unknown; choose one of {', '.join(TURN_MODES)}")
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
            tools=tools,
            turns=turns,
            expand_turns=expand_turns,
        )

    @property
    def uses_date(self) -> bool:
        """Whether the template can render the current date."""
        return bool(_DATE_USE.search(self.template))

    @property
    def has_generation_markers(self) -> bool:
        """Whether the template marks assistant output with ``{% generation %}``."""
        return bool(_GENERATION_TAG.search(self.template))

    @property
    def has_generation_prompt(self) -> bool:
        """Whether the template writes a generation prompt (reads ``add_generation_prompt``)."""
        return "add_generation_prompt" in self.template

    @property
    def end_pattern(self) -> re.Pattern[str]:
        """A regex matching any of :attr:`end_tokens` (longest first)."""
        return _alternation(self.end_tokens)

    def _variables(self) -> dict[str, Any]:
        pinned = datetime.strptime(self.date, _DATE_FORMAT)
        strftime_now: Callable[[str], str] = pinned.strftime
        return {**self.special_tokens, "strftime_now": strftime_now}

    def render(
        self,
        messages: list[dict],
        where: str,
        tools: list[dict] | None = None,
        track: bool = False,
        generation_prompt: bool = False,
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and, with ``track``, its ``{% generation %}`` character spans.

        Raises:
            RowFailure: the template rejected the conversation (reason ``template_error``).
        """
        from jinja2 import TemplateError
        from transformers.utils import chat_template_utils as utils

        compiled = utils._compile_jinja_template(self.template)
        # As apply_chat_template: None fields dropped, reasoning copied under the names templates read.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        chat = getattr(utils, "_alias_reasoning_fields", lambda c: c)(chat)
        try:
            if track:
                text, spans = utils._render_with_assistant_indices(
                    compiled, chat, tools, None, generation_prompt, **self._variables()
                )
                return text, [(int(a), int(b)) for a, b in spans]
            return compiled.render(
                messages=chat, tools=tools, documents=None, add_generation_prompt=generation_prompt, **self._variables()
            ), []
        except (TemplateError, TypeError, ValueError) as e:
            raise RowFailure(
                f"{where}: the chat template rejected the conversation ({type(e).__name__}: {e}); fix what it "
                "names in the row, pass --chat-template, or skip such rows with --skip-bad-rows",
                "template_error",
            ) from e

    def with_system_prompt(self, messages: list[dict]) -> list[dict]:
        """``messages`` with :attr:`system_prompt` prepended when they have no system message."""
        return with_system_prompt(messages, self.system_prompt)


@lru_cache(maxsize=16)
def _alternation(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in tokens) or r"(?!)")


def chat_format(
    tokenizer: Any,
    template_file: str | None = None,
    reasoning: str = "keep",
    system_prompt: str | None = None,
    date: str | None = None,
    tools_file: str | None = None,
    turns: str = "all",
    expand_turns: bool = False,
) -> ChatFormat | MistralCommonFormat | None:
    """The chat format of a run: ``--chat-template`` or the tokenizer's template; None when there is none.

    Raises:
        DataError: the template or tools file cannot be read, or the template is not valid Jinja.
        ValueError: unknown ``reasoning`` or ``turns``.
    """
    template = load_template_file(template_file) if template_file else tokenizer_template(tokenizer)
    tools = load_tools_file(tools_file) if tools_file else None
    if template is None:
        path = mistral_common_path(tokenizer)
        if path is None:
            return None
        return MistralCommonFormat(path, reasoning, system_prompt, date or today(), tools, turns, expand_turns)
    _check_syntax(template, f"--chat-template {template_file}" if template_file else "the tokenizer's chat template")
    return ChatFormat.for_tokenizer(tokenizer, template, reasoning, system_prompt, date, tools, turns, expand_turns)


def _check_syntax(template: str, source: str) -> None:
    # A syntax error is the run's configuration, not a row's: found before any row, whatever --skip-bad-rows says.
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise DataError(f"{source}: line {e.lineno}: not a valid Jinja template ({e.message}); fix the template") from e


@dataclass
class _Gap:
    """Where one sentinel's real text lies in the rendering: scaffolding from ``before``, the text ``[start, end)``,
    then scaffolding up to ``after``."""

    kind: str  # A (answer), R (reasoning) or F (a tool call's function name)
    before: int
    start: int
    end: int
    after: int


def _sentinel_messages(messages: list[dict]) -> tuple[list[dict], dict[str, tuple[int, str]], str]:
    """Assistant texts replaced by sentinels; returns the messages, ``{sentinel: (turn, kind)}`` and the pattern."""
    taken = json.dumps(messages, ensure_ascii=False)
    tag = "SPCQ"
    while tag in taken:
        tag += "Q"
    out: list[dict] = []
    marks: dict[str, tuple[int, str]] = {}

    def mark(turn: int, kind: str, n: int = 0) -> str:
        sentinel = f"{tag}{turn}{kind}{n}{tag}"
        marks[sentinel] = (turn, kind)
        return sentinel

    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            out.append(message)
            continue
        shadow = dict(message)
        field = reasoning_field(message)
        content = message.get("content")
        inline, _ = split_reasoning(content) if field is None else (None, content)
        if field is not None and message[field].strip():
            thought = mark(turn, "R")
            shadow.update({k: thought for k in REASONING_FIELDS if isinstance(message.get(k), str)})
        # An empty content beside tool calls stays empty: templates test it (``if message.content``).
        if isinstance(content, str) and (content or not message.get("tool_calls")):
            answer = mark(turn, "A")
            shadow["content"] = answer if inline is None else f"<think>{mark(turn, 'R')}</think>{answer}"
        elif isinstance(content, list) and content:  # text parts (a vision target's rows): one sentinel part
            shadow["content"] = [{"type": "text", "text": mark(turn, "A")}]
        if message.get("tool_calls"):
            calls = []
            for n, call in enumerate(message["tool_calls"]):
                function = dict(call["function"])
                function["name"] = mark(turn, "F", n)
                calls.append({**call, "function": function})
            shadow["tool_calls"] = calls
        out.append(shadow)
    return out, marks, f"{tag}\\d+[ARF]\\d+{tag}"


def _locate(fmt: ChatFormat, messages: list[dict], text: str, where: str, tools: Any) -> dict[int, list[_Gap]]:
    """Each assistant turn's sentinel gaps in ``text`` (the real rendering), found by the sentinel rendering."""
    shadow_messages, marks, pattern = _sentinel_messages(messages)
    shadow, _ = fmt.render(shadow_messages, where, tools)
    parts = re.split(f"({pattern})", shadow)
    # parts alternates scaffolding, sentinel, scaffolding, ...; an answer or reasoning appears at most once
    # (a function name may recur, as in gpt-oss's header of the tool's result; its first place is the call).
    found = parts[1::2]
    once = [s for s in found if marks[s][1] != "F"]
    if len(once) != len(set(once)):
        raise unplaceable(where, "the template renders an assistant message more than once")
    if not text.startswith(parts[0]):
        raise unplaceable(where, "the rendering does not start like the sentinel rendering")
    turns: dict[int, list[_Gap]] = {}
    seen: set[str] = set()
    pos, before = len(parts[0]), 0
    for i, sentinel in enumerate(found):
        after = parts[2 * i + 2]
        if 2 * i + 3 >= len(parts):
            end = len(text) - len(after)
            if end < pos or not text.endswith(after):
                raise unplaceable(where, "the rendering does not end like the sentinel rendering")
        elif after:
            end = text.find(after, pos)
            if end < 0:
                raise unplaceable(where, "template text around an assistant message changes with its content")
        else:
            raise unplaceable(where, "two assistant parts are rendered with nothing between them")
        if sentinel not in seen:
            seen.add(sentinel)
            turn, kind = marks[sentinel]
            turns.setdefault(turn, []).append(_Gap(kind, before, pos, end, end + len(after)))
        pos, before = end + len(after), end
    return turns


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _turn_start(
    fmt: ChatFormat, messages: list[dict], turn: int, text: str, where: str, tools: Any, window: tuple[int, int]
) -> int | None:
    """Where turn ``turn``'s generated text starts: where the rendering leaves the generation prompt.

    Text the template writes for the turn but the generation prompt lacks (``<think>``, a harmony channel
    header) is generated by the model; a template without a generation prompt (Mistral's) prompts with the
    bare conversation. Where the template renders the conversation so far differently when it ends there
    (Mistral v0.3 writes the system prompt only into a final user turn), the turn starts after the longest
    tail of the prompt found in ``window``, the scaffolding of ``text`` before the turn's first located text.
    None when not even that is found (then the turn's first located text starts it).
    """
    try:
        prompt, _ = fmt.render(messages[:turn], where, tools, generation_prompt=fmt.has_generation_prompt)
        if text.startswith(prompt):  # the common case: no second render needed
            return len(prompt)
        context = fmt.render(messages[:turn], where, tools)[0] if fmt.has_generation_prompt else prompt
    except RowFailure:
        return None
    # The prompt leaves the bare context where its header begins (a template may end the bare context with
    # an eos instead); the whole rendering must agree with the prompt up to there at least.
    header = _common_prefix(prompt, context)
    start = _common_prefix(prompt, text)
    return start if start >= header else _tail_end(prompt, text, *window)


def _tail_end(prompt: str, text: str, lo: int, hi: int) -> int | None:
    """The end of the last place in ``text[lo:hi]`` of the longest tail of ``prompt`` found there; None when the
    tail found holds no non-whitespace character."""
    shortest, longest = 0, min(len(prompt), hi - lo)
    while shortest < longest:  # a tail found in the window has every shorter tail in it too: binary search
        n = (shortest + longest + 1) // 2
        if text.rfind(prompt[len(prompt) - n :], lo, hi) >= 0:
            shortest = n
        else:
            longest = n - 1
    tail = prompt[len(prompt) - shortest :]
    return text.rfind(tail, lo, hi) + len(tail) if tail.strip() else None


def _sentinel_spans(
    fmt: ChatFormat, messages: list[dict], text: str, where: str, tools: Any, turns: str
) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the real rendering) the loss covers."""
    located = _locate(fmt, messages, text, where, tools)
    if turns == "last":
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        located = {last: located[last]} if last in located else {}
    spans: list[tuple[int, int]] = []
    for turn, gaps in sorted(located.items()):
        gaps.sort(key=lambda g: g.start)
        first, final = gaps[0], gaps[-1]
        start = _turn_start(fmt, messages, turn, text, where, tools, (first.before, first.start))
        start = first.start if start is None or start > first.start else start
        if final.kind == "F":
            # A tool call runs to the first turn-closing token after its name; tokens the turn opened
            # with (harmony's <|channel|>, <|message|>) do not close it.
            opening = set(fmt.end_pattern.findall(text, start, first.start))
            close = next((m for m in fmt.end_pattern.finditer(text, final.end) if m.group() not in opening), None)
            end = final.end if close is None else close.end()
        else:
            end = final.end + _end_of_turn(text[final.end : final.after], fmt.end_tokens)
        reasoning = next((g for g in gaps if g.kind == "R"), None)
        if fmt.reasoning == "mask" and reasoning is not None:
            start = max(start, reasoning.after)  # the reasoning block, its tags included, is input only
        if start < end:
            spans.append((start, end))
    return spans


def text_after_turn(fmt: ChatFormat, messages: list[dict], where: str, tools: Any = None) -> str:
    """What the template writes after the end-of-turn token of ``messages``' last assistant message, through the
    generation prompt of the turn after ``messages``: the later user and tool turns and the next assistant header.

    So a generator that keeps the exact tokens the model wrote (its end-of-turn token included) can prompt the
    next turn with those tokens followed by this text, whatever the template does to earlier turns.

    Raises:
        RowFailure: the template rejects the conversation, or does not write the last answer's text verbatim
            (reason ``mask_unplaceable``).
    """
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    shadow, marks, _ = _sentinel_messages(messages)
    answer = next((s for s, mark in marks.items() if mark == (last, "A")), None)
    text, _ = fmt.render(shadow, where, tools, generation_prompt=fmt.has_generation_prompt)
    if answer is None or text.count(answer) != 1:
        raise unplaceable(where, "the template does not render the last answer once")
    after = text.split(answer, 1)[1]
    return after[_end_of_turn(after, fmt.end_tokens) :]


def split_generated_reasoning(fmt: ChatFormat, prompt: str, text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of an answer ``text`` the model wrote after ``prompt``.

    A template that renders reasoning itself (it reads ``reasoning_content`` or writes ``</think>``) gets the
    ``<think>...</think>`` block split off, as Qwen3's does for its own history (an empty block is dropped); a
    prompt that opens the block (the R1 distills' ``<think>\n``) counts as its start. Otherwise the answer is all
    content.
    """
    if "reasoning_content" not in fmt.template and "</think>" not in fmt.template:
        return None, text
    opened = "<think>" if prompt.rstrip().endswith("<think>") else ""
    found = THINK.match(opened + text)
    if found is None:
        return None, text
    # an empty block (Qwen3 with thinking off) leaves no reasoning, and no tags in the content either
    return found.group(1).strip("\n") or None, found.group(2).lstrip("\n")


def _end_of_turn(scaffolding: str, end_tokens: tuple[str, ...]) -> int:
    """Length of the end-of-turn prefix of the text after a turn: optional whitespace, then a special token."""
    stripped = scaffolding.lstrip()
    for token in end_tokens:
        if stripped.startswith(token):
            return len(scaffolding) - len(stripped) + len(token)
    return 0


def _solid_prefix(text: str) -> np.ndarray:
    """``out[k]``: how many non-whitespace characters ``text[:k]`` holds."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    solid = ~np.isin(codes, _WHITESPACE)
    out = np.zeros(len(codes) + 1, dtype=np.int64)
    np.cumsum(solid, out=out[1:])
    return out


def _spans_to_mask(text: str, offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on each token that starts in a span or shares a non-whitespace character with one.

    So ``▁The``, whose space the template writes, is supervised; a token that merges a header's newline
    with the content's is not.
    """
    solid = _solid_prefix(text)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        lo, hi = np.maximum(starts, a), np.minimum(ends, b)
        overlap = lo < hi
        shares = overlap & (solid[np.where(overlap, hi, 0)] > solid[np.where(overlap, lo, 0)])
        mask[shares | ((starts >= a) & (starts < b))] = 1
    return mask


def mask_conversation(
    tokenizer: Any,
    fmt: ChatFormat | MistralCommonFormat,
    messages: list[dict],
    where: str,
    tools: list[dict] | None = None,
    turns: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Render, tokenize and mask one conversation.

    Args:
        tokenizer: a fast Hugging Face tokenizer (its offsets map characters to tokens).
        fmt: the chat format.
        messages: OpenAI-form message dicts; at least one assistant message.
        where: how to name the row in messages (``file:line``).
        tools: the tool schemas the template renders (default: ``fmt.tools``).
        turns: ``all`` or ``last`` assistant turns supervised (default: ``fmt.turns``).

    Returns:
        ``(input_ids int32, loss_mask uint8)`` of the whole conversation: the ids are those of
        ``tokenizer.apply_chat_template(messages, tools=tools)``.

    Raises:
        RowFailure: the template rejects the conversation, or its assistant turns cannot be located.
    """
    ids, mask, _ = masked_text(tokenizer, fmt, messages, where, tools, turns)
    return ids, mask


def masked_text(
    tokenizer: Any,
    fmt: ChatFormat | MistralCommonFormat,
    messages: list[dict],
    where: str,
    tools: list[dict] | None = None,
    turns: str | None = None,
) -> tuple[np.ndarray, np.ndarray, str]:
    """:func:`mask_conversation`'s ids and mask, and the text they encode (decoded where mistral-common encodes)."""
    messages = fmt.with_system_prompt(messages)
    tools = fmt.tools if tools is None else tools
    turns = turns or fmt.turns
    if isinstance(fmt, MistralCommonFormat):
        ids, mask = mistral_common_mask(fmt, messages, where, tools, turns)
        # Decoded without the special tokens: with them, SentencePiece's "▁" stays in place of spaces.
        return ids, mask, mistral_encoder(fmt.tokenizer_path).decode(ids.tolist())
    use_markers = fmt.has_generation_markers and not (
        fmt.reasoning == "mask" and any(has_reasoning(m) for m in messages if m["role"] == "assistant")
    )
    text, spans = fmt.render(messages, where, tools, track=use_markers)
    if not use_markers:
        spans = _sentinel_spans(fmt, messages, text, where, tools, turns)
    elif turns == "last":
        spans = spans[-1:]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return ids, _spans_to_mask(text, offsets, spans), text


def conversation_samples(
    tokenizer: Any,
    fmt: ChatFormat | MistralCommonFormat,
    messages: list[dict],
    where: str,
    tools: list[dict] | None = None,
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(turn, input_ids, loss_mask)`` of each sample a conversation gives.

    One sample (turn -1) masked per ``fmt.turns``; with ``fmt.expand_turns``, one per assistant turn
    ``k`` (0-based among the assistant messages): the conversation up to that turn, only it supervised.

    Raises:
        RowFailure: as :func:`mask_conversation`.
    """
    return samples_and_text(tokenizer, fmt, messages, where, tools)[0]


def samples_and_text(
    tokenizer: Any,
    fmt: ChatFormat | MistralCommonFormat,
    messages: list[dict],
    where: str,
    tools: list[dict] | None = None,
) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], str]:
    """:func:`conversation_samples`, and the text of its samples (joined by newlines) for :func:`dropped_fields`.

    Raises:
        RowFailure: as :func:`mask_conversation`.
    """
    if not fmt.expand_turns:
        ids, mask, text = masked_text(tokenizer, fmt, messages, where, tools)
        return [(-1, ids, mask)], text
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    done = [
        masked_text(tokenizer, fmt, messages[: end + 1], f"{where} (turn {k})", tools, "last")
        for k, end in enumerate(ends)
    ]
    return [(k, ids, mask) for k, (ids, mask, _) in enumerate(done)], "\n".join(text for _, _, text in done)
