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
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np

from speccache.errors import DataError, UsageError

__all__ = [
    "REASONING_FIELDS",
    "REASONING_MODES",
    "TURN_MODES",
    "ChatFormat",
    "MistralCommonFormat",
    "RowFailure",
    "chat_format",
    "conversation_samples",
    "dropped_fields",
    "load_chat_tokenizer",
    "load_template_file",
    "load_tools_file",
    "mask_conversation",
    "samples_and_text",
    "split_generated_reasoning",
    "text_after_turn",
    "today",
    "tokenizer_template",
    "tool_list",
]

REASONING_MODES = ("keep", "mask")
TURN_MODES = ("all", "last")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
INLINE_REASONING = "<think> in content"  # the dropped-field name of reasoning written inline in the content
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_DATE_USE = re.compile(r"strftime_now")
# What str.isspace() calls whitespace, as code points, so a whole rendering is classified at once.
_WHITESPACE = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)
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


def tool_list(value: Any, what: str) -> list[dict]:
    """``value`` as a list of tool schema objects; a JSON string of one is decoded (as some datasets store it).

    Raises:
        RowFailure: it is neither (the message starts with ``what``).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowFailure(f"{what} is a string but not JSON ({e.msg}); give a list of tool schemas") from e
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowFailure(
            f'{what} must be a list of tool schema objects ({{"type": "function", "function": {{...}}}}), '
            f"got {type(value).__name__}; fix it"
        )
    return value


def load_tools_file(path: str) -> list[dict]:
    """Read a ``--tools`` file: a JSON list of tool schemas, rendered for every row that has none.

    Raises:
        DataError: the file cannot be read or is not such a list.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--tools {path}: cannot read the file ({e}); pass a UTF-8 JSON file") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"--tools {path}:{e.lineno}: invalid JSON ({e.msg}); the file holds one JSON list of tool schemas"
        ) from e
    try:
        return tool_list(value, f"--tools {path}")
    except RowFailure as e:
        raise DataError(str(e)) from None


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
        if self.system_prompt is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]


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
        return ChatFormat.with_system_prompt(self, messages)  # type: ignore[arg-type]

    def encode(self, messages: list[dict], where: str, tools: Any) -> tuple[list[int], list[list[int]]]:
        """The conversation's tokens and, in order, each assistant message's own tokens.

        Raises:
            RowFailure: mistral-common refuses the conversation (reason ``template_error``).
        """
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        encoder = _mistral_encoder(self.tokenizer_path)
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
def _mistral_encoder(path: str) -> Any:
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(path, mode=ValidationMode.finetuning)


def _mistral_common_mask(
    fmt: MistralCommonFormat, messages: list[dict], where: str, tools: Any, turns: str
) -> tuple[np.ndarray, np.ndarray]:
    tokens, assistant = fmt.encode(messages, where, tools)
    mask = np.zeros(len(tokens), dtype=np.uint8)
    spans, pos = [], 0
    for piece in assistant:
        at = next((i for i in range(pos, len(tokens) - len(piece) + 1) if tokens[i : i + len(piece)] == piece), -1)
        if at < 0:
            raise _unplaceable(where, "an assistant message's tokens are not in the encoded conversation")
        spans.append((at, at + len(piece)))
        pos = at + len(piece)
    for a, b in spans[-1:] if turns == "last" else spans:
        mask[a:b] = 1
    return np.asarray(tokens, dtype=np.int32), mask


@lru_cache(maxsize=16)
def _alternation(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in tokens) or r"(?!)")


def tokenizer_template(tokenizer: Any) -> str | None:
    try:
        return tokenizer.get_chat_template()
    except (ValueError, NotImplementedError, AttributeError):
        return None


def check_model_source(model: str, flag: str = "--model") -> None:
    """Refuse, within seconds, a model that is neither a local directory nor a hub id this machine can load.

    A name that is no directory is read as a hub id (``name`` or ``org/name``): it passes when the local
    Hugging Face cache holds it, or when the hub answers for it; offline (``HF_HUB_OFFLINE``) or unreachable,
    transformers would otherwise spend half a minute in retries before saying so.

    Raises:
        FileNotFoundError: neither reading gives a model; the message names both and the fix.
    """
    if os.path.isdir(model):
        return
    if os.path.exists(model):
        raise FileNotFoundError(f"{flag} {model} is a file; give the model's directory")
    missing = f"{flag} {model}: no such model directory"
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or not model.strip("/"):
        raise FileNotFoundError(f"{missing}; fix the path")
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        cached = huggingface_hub.try_to_load_from_cache(model, "config.json")
    except HFValidationError:  # not a valid hub id either
        raise FileNotFoundError(f"{missing}; fix the path") from None
    if isinstance(cached, str):
        return
    hub = f"and as a hub id it is not in the local Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE})"
    fix = f"give the model's local directory, or download it first (hf download {model})"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{missing}, {hub} and HF_HUB_OFFLINE is set; {fix}")
    try:
        huggingface_hub.model_info(model, timeout=10)
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{missing}, {hub} nor on the hub (or it is private: log in); {fix}") from None
    except Exception as exc:  # noqa: BLE001 - the hub client's network errors come from its own HTTP library
        raise FileNotFoundError(f"{missing}, {hub}, and the hub cannot be reached ({exc}); {fix}") from None


def load_chat_tokenizer(model: str, template_file: str | None = None) -> Any:
    """Load ``model``'s tokenizer as a fast tokenizer, the kind whose offsets the masks need.

    ``AutoTokenizer`` may give a backend without ``get_chat_template`` or offsets (``MistralCommonBackend``
    when ``mistral-common`` is installed and the folder has ``tekken.json``); then the folder's tokenizer is
    loaded as a ``PreTrainedTokenizerFast`` instead, where it has a chat template (or ``template_file``, the
    ``--chat-template``, gives one). Otherwise a ``MistralCommonBackend`` is kept: its rows are encoded by
    mistral-common itself (:class:`MistralCommonFormat`).

    Raises:
        DataError: neither a fast tokenizer nor a ``MistralCommonBackend`` can be loaded from the folder.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(model)
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer"):
        return tokenizer
    try:
        fast = PreTrainedTokenizerFast.from_pretrained(model)
    except (OSError, ValueError) as e:
        fast, error = None, e
    if fast is not None and (template_file or tokenizer_template(fast) is not None):
        return fast
    if _mistral_common_path(tokenizer) is not None:
        return tokenizer
    if fast is not None:
        return fast
    raise DataError(
        f"--model {model}: the tokenizer loads as {type(tokenizer).__name__}, which gives neither a chat "
        "template nor token offsets, and the folder has no loadable tokenizer.json; add the model's "
        f"tokenizer.json (a Hugging Face fast tokenizer) to the folder ({error})"
    ) from error


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
        path = _mistral_common_path(tokenizer)
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


def _mistral_common_path(tokenizer: Any) -> str | None:
    """The tokenizer file of a ``MistralCommonBackend`` (rows are then encoded by mistral-common), else None."""
    path = getattr(tokenizer, "_tokenizer_path", None)
    inner = getattr(tokenizer, "__dict__", {}).get("tokenizer")
    return str(path) if path is not None and hasattr(inner, "encode_chat_completion") else None


def _split_reasoning(content: Any) -> tuple[str | None, Any]:
    found = _THINK.match(content) if isinstance(content, str) else None
    if found is None or not found.group(1).strip():
        return None, content
    return found.group(1), found.group(2)


def _reasoning_field(message: Mapping[str, Any]) -> str | None:
    """The field that carries an assistant message's reasoning (``reasoning_content``, ...), or None."""
    return next((k for k in REASONING_FIELDS if isinstance(message.get(k), str)), None)


def _has_reasoning(message: Mapping[str, Any]) -> bool:
    field = _reasoning_field(message)
    return bool(message[field].strip()) if field else _split_reasoning(message.get("content"))[0] is not None


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
        field = _reasoning_field(message)
        content = message.get("content")
        inline, _ = _split_reasoning(content) if field is None else (None, content)
        if field is not None and message[field].strip():
            thought = mark(turn, "R")
            shadow.update({k: thought for k in REASONING_FIELDS if isinstance(message.get(k), str)})
        # An empty content beside tool calls stays empty: templates test it (``if message.content``).
        if isinstance(content, str) and (content or not message.get("tool_calls")):
            answer = mark(turn, "A")
            shadow["content"] = answer if inline is None else f"<think>{mark(turn, 'R')}</think>{answer}"
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
        raise _unplaceable(where, "the template renders an assistant message more than once")
    if not text.startswith(parts[0]):
        raise _unplaceable(where, "the rendering does not start like the sentinel rendering")
    turns: dict[int, list[_Gap]] = {}
    seen: set[str] = set()
    pos, before = len(parts[0]), 0
    for i, sentinel in enumerate(found):
        after = parts[2 * i + 2]
        if 2 * i + 3 >= len(parts):
            end = len(text) - len(after)
            if end < pos or not text.endswith(after):
                raise _unplaceable(where, "the rendering does not end like the sentinel rendering")
        elif after:
            end = text.find(after, pos)
            if end < 0:
                raise _unplaceable(where, "template text around an assistant message changes with its content")
        else:
            raise _unplaceable(where, "two assistant parts are rendered with nothing between them")
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
        raise _unplaceable(where, "the template does not render the last answer once")
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
    found = _THINK.match(opened + text)
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


def _unplaceable(where: str, why: str) -> RowFailure:
    return RowFailure(
        f"{where}: cannot locate the assistant turns in the rendered conversation ({why}); pass a --chat-template "
        "that marks assistant output with {% generation %}, or skip such rows with --skip-bad-rows",
        "mask_unplaceable",
    )


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
    ids, mask, _ = _masked_text(tokenizer, fmt, messages, where, tools, turns)
    return ids, mask


def _masked_text(
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
        ids, mask = _mistral_common_mask(fmt, messages, where, tools, turns)
        # Decoded without the special tokens: with them, SentencePiece's "▁" stays in place of spaces.
        return ids, mask, _mistral_encoder(fmt.tokenizer_path).decode(ids.tolist())
    use_markers = fmt.has_generation_markers and not (
        fmt.reasoning == "mask" and any(_has_reasoning(m) for m in messages if m["role"] == "assistant")
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
        ids, mask, text = _masked_text(tokenizer, fmt, messages, where, tools)
        return [(-1, ids, mask)], text
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    done = [
        _masked_text(tokenizer, fmt, messages[: end + 1], f"{where} (turn {k})", tools, "last")
        for k, end in enumerate(ends)
    ]
    return [(k, ids, mask) for k, (ids, mask, _) in enumerate(done)], "\n".join(text for _, _, text in done)


def _squashed(text: str) -> str:
    return "".join(text.split())


def _leaves(value: Any) -> list[Any]:
    """The leaf values of a tool call's arguments (or a text itself)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _written(value: Any, text: str) -> bool:
    """Whether squashed ``text`` holds ``value`` as a template may write it: raw, as JSON (either escaping, as a
    tool result through ``tojson``) or as Python would; the other forms are built only when the raw one is absent."""
    if not isinstance(value, str):
        return json.dumps(value) in text or str(value) in text
    if _squashed(value) in text:
        return True
    forms = (json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1], repr(value)[1:-1])
    return any(_squashed(form) in text for form in forms)


def dropped_fields(messages: list[dict], tools: list[dict] | None, rendered: str) -> list[tuple[int, str]]:
    """What a conversation carries that its rendering lacks, as ``(message index, field)`` (index -1: ``tools``).

    Whitespace is ignored (templates trim and re-indent): a content or reasoning is rendered if its text
    appears; a tool call if its function name and each of its arguments' values appear, raw or as JSON or
    Python writes them; a tool schema of ``tools`` if its name appears. Empty texts are never dropped.

    Args:
        messages: the row's OpenAI-form messages, as :func:`~speccache.data.chat_messages` gives them.
        tools: the tool schemas rendered with them (None: none).
        rendered: the text the template wrote for them (or the decoded tokens).

    Returns:
        The dropped fields in message order: ``content``, ``tool_calls``, the reasoning field's name
        (``reasoning_content``...), :data:`INLINE_REASONING`, or ``tools``.
    """
    text = _squashed(rendered)

    def shown(value: Any) -> bool:  # a text may be written as JSON (a tool result through tojson) or as Python would
        return value is None or all(_written(leaf, text) for leaf in _leaves(value))

    out: list[tuple[int, str]] = []
    names = [t.get("function", t).get("name") for t in tools or ()]
    if not all(shown(name) for name in names):
        out.append((-1, "tools"))
    for i, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        field = _reasoning_field(message) if assistant else None
        content = message.get("content")
        inline, content = _split_reasoning(content) if assistant and field is None else (None, content)
        if not shown(content):
            out.append((i, "content"))
        if field is not None and not shown(message[field]):
            out.append((i, field))
        if inline is not None and not shown(inline):
            out.append((i, INLINE_REASONING))
        for call in message.get("tool_calls") or () if assistant else ():
            function = call["function"]
            if not shown(function["name"]) or not shown(function.get("arguments")):
                out.append((i, "tool_calls"))
                break
    return out
