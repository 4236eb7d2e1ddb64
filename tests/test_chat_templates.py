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

import numpy as np
import pytest

from speccache.data import ChatFormat, RowFailure, load_samples
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
"""

PHI3_LIKE = (
    "{{- bos_token -}}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|user|>\\n' + m.content + '<|end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|assistant|>\\n' + m.content + '<|end|>\\n' -}}{%- endif -%}{%- endfor -%}"
)

GENERATION_MARKED = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- m.content + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
)


def _strip_think(content: str) -> tuple[str | None, str]:
    if "</think>" not in content:
        return None, content
    thought, answer = content.split("</think>", 1)
    return thought.split("<think>")[-1], answer


def _last_user(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)


# What each template renders for an assistant message (index i) that the loss must cover, per reasoning mode.
def _raw(content: str, end: str, reasoning: str) -> str:
    """A template that renders the content as is: the reasoning starts after the literal ``<think>``."""
    thought, answer = _strip_think(content)
    if thought is None or not thought.strip():
        return content + end
    return (thought + "</think>" if reasoning == "keep" else "") + answer + end


def _expect_chatml(messages, i, reasoning):
    return _raw(messages[i]["content"], "<|im_end|>", reasoning)


def _expect_generation(messages, i, reasoning):
    # {% generation %} spans cover the whole content; only --reasoning mask needs the sentinel path.
    if reasoning == "keep":
        return messages[i]["content"] + "<|im_end|>"
    return _raw(messages[i]["content"], "<|im_end|>", reasoning)


def _expect_qwen3(messages, i, reasoning):
    thought, answer = _strip_think(messages[i]["content"])
    thought = (thought or "").strip("\n")
    answer = answer.lstrip("\n") if "</think>" in messages[i]["content"] else answer
    if i > _last_user(messages) and thought and reasoning == "keep":
        return thought + "\n</think>\n\n" + answer + "<|im_end|>"
    return answer + "<|im_end|>"


def _expect_r1(messages, i, reasoning):
    return _strip_think(messages[i]["content"])[1] + "</s>"


def _expect_harmony(messages, i, reasoning):
    return _raw(messages[i]["content"], "<|return|>" if i == len(messages) - 1 else "<|end|>", reasoning)


def _expect_end(messages, i, reasoning):
    return _raw(messages[i]["content"], "<|end|>", reasoning)


def _expect_mistral(messages, i, reasoning):
    return _raw(messages[i]["content"], "</s>", reasoning)


def _expect_gemma(messages, i, reasoning):
    return _raw(messages[i]["content"].strip(), "<end_of_turn>", reasoning)


# name: (template, what an assistant turn must have masked, the text that opens an assistant turn)
TEMPLATES = {
    "chatml": (CHATML, _expect_chatml, "<|im_start|>assistant\n"),
    "qwen3_like": (QWEN3_LIKE, _expect_qwen3, "<|im_start|>assistant\n"),
    "r1_like": (R1_LIKE, _expect_r1, "<|Assistant|>"),
    "harmony_like": (HARMONY_LIKE, _expect_harmony, "<|start|>assistant<|channel|>final<|message|>"),
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
    starting inside an assistant string are masked."""
    starts = np.array(
        [
            a
            for a, _ in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)[
                "offset_mapping"
            ]
        ]
    )
    mask = np.zeros(len(starts), dtype=np.uint8)
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
            mask[(starts >= at) & (starts < at + len(piece))] = 1
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
    assert only_keep == "Multiply three by three.\n</think>\n\n"  # the earlier turn's reasoning is not rendered


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


def test_a_64_turn_row_renders_twice_whatever_its_length(tok, monkeypatch):
    calls = []
    real = ChatFormat.render

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatFormat, "render", counting)
    fmt = ChatFormat.for_tokenizer(tok, QWEN3_LIKE, date="2026-12-01")
    messages = [m for i in range(32) for m in (Q1, A1 if i % 2 else THINK1)]
    mask_conversation(tok, fmt, messages, "x")
    assert len(calls) == 2
