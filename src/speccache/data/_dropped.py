"""Dropped fields: what a conversation carries that its rendering lacks (``--on-dropped``; docs/data.md)."""

from __future__ import annotations

import json
from typing import Any

from speccache.data._messages import reasoning_field, split_reasoning

__all__ = ["INLINE_REASONING", "dropped_fields"]

INLINE_REASONING = "<think> in content"  # the dropped-field name of reasoning written inline in the content


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
        field = reasoning_field(message) if assistant else None
        content = message.get("content")
        inline, content = split_reasoning(content) if assistant and field is None else (None, content)
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
