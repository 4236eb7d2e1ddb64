"""Message normalisation: a ShareGPT or OpenAI row as OpenAI-form messages and tool schemas.

Roles are mapped to OpenAI's, content parts joined, tool calls decoded, reasoning fields checked; the
reasoning an assistant message carries is found in its field or inline (``<think>...</think>`` in the content).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from speccache.data._failure import RowFailure, row_error

__all__ = [
    "REASONING_FIELDS",
    "THINK",
    "chat_messages",
    "has_reasoning",
    "reasoning_field",
    "split_reasoning",
    "tool_list",
    "with_system_prompt",
]

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
_OPENAI_ROLES = {r: r for r in ("system", "user", "assistant", "tool", "ipython")}
_CHAT_KEYS = ("conversations", "messages")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
THINK = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.DOTALL)


def chat_messages(row: dict, where: str) -> tuple[list[dict], list[dict] | None]:
    """The OpenAI-form messages and the tool schemas (None: the row has none) of a ShareGPT or OpenAI row.

    Its ``input_ids``, if any, are not looked at (a pre-tokenized row's ids win only where rows are tokenized).

    Raises:
        RowFailure: the row is not one chat row (the message starts with ``where``).
    """
    kinds = [key for key in _CHAT_KEYS if key in row]
    if len(kinds) != 1:
        found = ", ".join(repr(k) for k in kinds) if kinds else "none of them"
        raise row_error(
            f"{where}: a row needs exactly one of 'conversations' (ShareGPT), 'messages' (OpenAI) or "
            f"'input_ids' with 'loss_mask' (pre-tokenized); found {found}; fix the row"
        )
    if kinds[0] == "conversations":
        messages = _message_list(row, "conversations", "from", "value", _SHAREGPT_ROLES, where)
    else:
        messages = _message_list(row, "messages", "role", "content", _OPENAI_ROLES, where)
    return messages, None if row.get("tools") is None else tool_list(row["tools"], f"{where}: 'tools'")


def _message_list(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str], where: str) -> list[dict]:
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise row_error(f"{where}: {key!r} must be a non-empty list of messages; fix the row")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise row_error(f"{where}: {key}[{i}] must be an object with {role_key!r} and {text_key!r}; fix the row")
        role = turn.get(role_key)
        if not isinstance(role, str) or role not in roles:
            raise row_error(
                f"{where}: {key}[{i}].{role_key} must be one of {', '.join(roles)}, got {role!r}; fix the row"
            )
        name = f"{where}: {key}[{i}]"
        if key == "conversations":
            messages.append(_sharegpt_message(roles[role], turn[text_key] if text_key in turn else None, name, role))
        else:
            messages.append(_openai_message(turn, name))
    system = row.get("system")
    if key == "conversations" and system is not None and system != "":
        if not isinstance(system, str):
            raise row_error(f"{where}: 'system' must be a string, got {type(system).__name__}; fix the row")
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is not None and first["role"] == "assistant":
        raise row_error(f"{where}: the conversation starts with an assistant message; add the prompt before it")
    return messages


def _sharegpt_message(role: str, value: Any, name: str, given: str) -> dict:
    if given != "function_call":
        return {"role": role, "content": _text(value, f"{name}.value")}
    # The call (or a list of parallel calls) is a JSON string {"name", "arguments"}, as function-calling sets store it.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise row_error(
                f'{name}.value: a function_call must be a JSON object {{"name", "arguments"}} or a list of '
                f"them ({e.msg}); fix the row"
            ) from e
    return {"role": "assistant", "content": "", "tool_calls": _tool_calls(value, f"{name}.value")}


def _openai_message(turn: dict, name: str) -> dict:
    # Every field is kept (tool_call_id, name, reasoning_content...): templates read them.
    message = dict(turn)
    if turn["role"] == "assistant" and turn.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(turn["tool_calls"], f"{name}.tool_calls")
    if turn.get("content") is None and message.get("tool_calls"):
        # OpenAI's tool-call turn; "" as serving engines pass it, since most templates concatenate the content.
        message["content"] = ""
    else:
        message["content"] = _text(turn.get("content"), f"{name}.content")
    for key in REASONING_FIELDS:
        if turn.get(key) is not None and not isinstance(turn[key], str):
            raise row_error(f"{name}.{key} must be a string, got {type(turn[key]).__name__}; fix the row")
    return message


def _text(content: Any, name: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts joined by newlines (as serving engines do)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise row_error(f"{name} must be a string or a list of text parts, got {type(content).__name__}; fix the row")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and not isinstance(part.get("text"), str):
            raise row_error(f"{name}[{j}] is a text part without a string 'text'; fix the row")
        if kind != "text":
            raise row_error(
                f'{name}[{j}] is a {kind!r} part; only text parts ({{"type": "text", "text": str}}) can be '
                "cached: drop the row, or its other parts"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, name: str) -> list[dict]:
    """OpenAI tool calls, each ``{"type": "function", "function": {"name", "arguments": object}}``.

    Arguments given as a JSON string are decoded, as serving engines do before they render a template.
    """
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise row_error(
                f'{name}[{j}] must be a tool call {{"type": "function", "function": {{"name": str, '
                '"arguments": object or JSON string}}; fix the row'
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise row_error(
                    f"{name}[{j}]: the arguments string is not JSON ({e.msg}); give an object or its JSON text"
                ) from e
        if not isinstance(arguments, dict):
            raise row_error(
                f"{name}[{j}]: the arguments must be an object, got {type(arguments).__name__}; fix the row"
            )
        function = {**function, "arguments": arguments}
        out.append({**call, "function": function} if "function" in call else {"type": "function", "function": function})
    return out


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


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``system_prompt`` prepended when it is set and they have no system message."""
    if system_prompt is None or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def split_reasoning(content: Any) -> tuple[str | None, Any]:
    found = THINK.match(content) if isinstance(content, str) else None
    if found is None or not found.group(1).strip():
        return None, content
    return found.group(1), found.group(2)


def reasoning_field(message: Mapping[str, Any]) -> str | None:
    """The field that carries an assistant message's reasoning (``reasoning_content``, ...), or None."""
    return next((k for k in REASONING_FIELDS if isinstance(message.get(k), str)), None)


def has_reasoning(message: Mapping[str, Any]) -> bool:
    field = reasoning_field(message)
    return bool(message[field].strip()) if field else split_reasoning(message.get("content"))[0] is not None
