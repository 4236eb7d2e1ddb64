"""User requests for ``speccache regenerate``: the prompt set of ``make acceptance`` and the demo.

The rows are composed from the building blocks in ``data/prompt_parts.json`` (topics, paragraphs, code tasks,
phrases, situations... written for speccache, under its licence) crossed with task forms: explain, list, compare,
define, summarise or rewrite a given paragraph, short code, code review, arithmetic word problems, advice,
translation, how-to, creative writing, plus follow-up turns ("Shorter please.", "Can you give an example?") and
second questions. The composition is a pure function of that file and ``SEED``: a fixed seed drives every
choice, and nothing iterates over a set.

Every row ends each user turn with an empty assistant turn, which ``speccache regenerate`` replaces with the
target's answer to the (regenerated) history before it. The held-out split is chosen by a hash of the row's
first user turn, so it stays put when rows are added or reordered.

``python -m speccache.demo.prompts --split train --out prompts.jsonl`` writes a split as JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from speccache.format.durable import atomic_write

__all__ = ["SPLITS", "prompt_rows", "write_prompts"]

SPLITS = ("train", "eval")
SEED = 20261201
# Percent of rows held out (by the hash of their first user turn).
EVAL_PERCENT = 10
# Share of rows given one or two follow-up turns, and of rows given a second, unrelated request.
FOLLOW_UP_SHARE = 0.25
SECOND_REQUEST_SHARE = 0.08
_PARTS = Path(__file__).resolve().parent / "data" / "prompt_parts.json"

Parts = dict[str, Any]
Request = tuple[str, str]  # (kind, text): the kind picks the follow-ups that fit


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def _crossed(rng: random.Random, count: int, *lists: list) -> list[tuple]:
    """``count`` distinct combinations of one item from each list, drawn without replacement."""
    sizes = [len(items) for items in lists]
    total = 1
    for size in sizes:
        total *= size
    picks = []
    for index in rng.sample(range(total), min(count, total)):
        combo = []
        for items, size in zip(lists, sizes):
            index, at = divmod(index, size)
            combo.append(items[at])
        picks.append(tuple(combo))
    return picks


def _topics(p: Parts, rng: random.Random) -> list[Request]:
    return [("text", form.format(topic=t)) for t, form in _crossed(rng, 300, p["topics"], p["topic_forms"])]


def _compare(p: Parts, rng: random.Random) -> list[Request]:
    return [
        ("text", form.format(a=a, b=b, A=_capitalised(a)))
        for (a, b), form in _crossed(rng, 90, p["compare_pairs"], p["compare_forms"])
    ]


def _words(p: Parts, rng: random.Random) -> list[Request]:
    return [("text", form.format(word=w)) for w, form in _crossed(rng, 90, p["words"], p["word_forms"])]


def _paragraphs(p: Parts, rng: random.Random) -> list[Request]:
    return [("text", form.format(text=t)) for t, form in _crossed(rng, 110, p["paragraphs"], p["paragraph_forms"])]


def _code(p: Parts, rng: random.Random) -> list[Request]:
    tasks = _crossed(rng, 150, p["code_tasks"], sorted(set(p["code_languages"])))
    # The form is drawn apart from the (task, language) pair so no pair repeats under two phrasings.
    return [("code", rng.choice(p["code_forms"]).format(task=task, lang=lang)) for task, lang in tasks]


def _snippets(p: Parts, rng: random.Random) -> list[Request]:
    return [("code", form.format(code=c)) for c, form in _crossed(rng, 40, p["code_snippets"], p["snippet_forms"])]


def _advice(p: Parts, rng: random.Random) -> list[Request]:
    return [
        ("text", form.format(s=s, S=_capitalised(s))) for s, form in _crossed(rng, 90, p["advice"], p["advice_forms"])
    ]


def _translations(p: Parts, rng: random.Random) -> list[Request]:
    return [
        ("text", form.format(p=phrase, lang=lang))
        for phrase, lang, form in _crossed(rng, 90, p["phrases"], p["languages"], p["translate_forms"])
    ]


def _creative(p: Parts, rng: random.Random) -> list[Request]:
    return [("text", form.format(x=x)) for x, form in _crossed(rng, 70, p["creative_things"], p["creative"])]


def _howto(p: Parts, rng: random.Random) -> list[Request]:
    return [("text", form.format(h=h)) for h, form in _crossed(rng, 80, p["howto"], p["howto_forms"])]


def _questions(p: Parts, rng: random.Random) -> list[Request]:
    return [("text", q) for q in p["open_questions"]]


def _word_problem(p: Parts, rng: random.Random) -> str:
    name, other = rng.sample(p["names"], 2)
    item, price = rng.choice(p["items"])
    a, b = rng.randint(12, 95), rng.randint(2, 11)
    forms = [
        f"{name} buys {b} {item} at {price} dollars each. How much does {name} pay?",
        f"{name} has {a} {item} and gives {b} to {other}. How many are left?",
        f"A train travels {a * b} km in {b} hours. What is its average speed?",
        f"What is {a} times {b}?",
        f"What is {a * 7} plus {b * 13}?",
        f"What is {b * 5}% of {a * 20}?",
        f"A shirt costs {a} dollars and is {b * 5}% off. What is the sale price?",
        f"{name} saves {b} dollars a week. How many weeks does it take to save {a * b} dollars?",
        f"A recipe needs {a * 10} grams of flour for {b} people. How much flour is needed for {b * 3} people?",
        f"{name} reads {b} pages a day. How many pages does {name} read in {a} days?",
        f"{name} and {other} share {a * 2} {item} equally. How many does each get?",
        f"The average of three numbers is {a}. Two of them are {a - b} and {a + 2 * b}. What is the third?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"{name} leaves at 8:{b + 10:02d} and the trip takes {a} minutes. When does {name} arrive?",
    ]
    return rng.choice(forms) + rng.choice(["", " Show your steps.", " Explain briefly.", " Just give the answer."])


def _arithmetic(p: Parts, rng: random.Random) -> list[Request]:
    return [("math", _word_problem(p, rng)) for _ in range(120)]


_KINDS: tuple[Callable[[Parts, random.Random], list[Request]], ...] = (
    _topics,
    _compare,
    _words,
    _paragraphs,
    _code,
    _snippets,
    _advice,
    _translations,
    _creative,
    _howto,
    _questions,
    _arithmetic,
)
_MATH_FOLLOW_UPS = ["Can you check your answer?", "Explain the steps.", "Now make the numbers twice as big."]


def _follow_ups(p: Parts, kind: str) -> list[str]:
    if kind == "code":
        return p["code_followups"]
    return _MATH_FOLLOW_UPS if kind == "math" else p["followups"]


def _conversation(user_turns: list[str]) -> list[dict[str, str]]:
    messages = []
    for text in user_turns:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    return messages


@cache
def _all_rows() -> tuple[tuple[str, str], ...]:
    """Every row as ``(split, json)``, in a fixed shuffled order."""
    parts = json.loads(_PARTS.read_text(encoding="utf-8"))
    rng = random.Random(SEED)
    requests: list[Request] = []
    seen: set[str] = set()
    for make in _KINDS:
        for kind, text in make(parts, rng):
            if text not in seen:  # a word problem can repeat by chance; a repeat would be a free hit for lookups
                seen.add(text)
                requests.append((kind, text))
    rng.shuffle(requests)
    rows = []
    for number, (kind, text) in enumerate(requests):
        turns = [text]
        draw = rng.random()
        if draw < FOLLOW_UP_SHARE:
            turns += rng.sample(_follow_ups(parts, kind), rng.choice((1, 1, 2)))
        elif draw < FOLLOW_UP_SHARE + SECOND_REQUEST_SHARE:
            turns.append(rng.choice(("Another question: ", "One more thing. ", "Next: ", "")) + rng.choice(requests)[1])
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        split = "eval" if int.from_bytes(digest[:4], "big") % 100 < EVAL_PERCENT else "train"
        row = {"id": f"prompt-{number:04d}", "messages": _conversation(turns)}
        rows.append((split, json.dumps(row, ensure_ascii=False)))
    return tuple(rows)


def prompt_rows(split: str) -> list[dict]:
    """The chat rows of ``split`` (``"train"`` or ``"eval"``), always in the same order.

    Each row is ``{"id", "messages"}``: user turns, each followed by an empty assistant turn for
    ``speccache regenerate`` to fill. A prefix of the list is a smaller prompt set of the same mix.

    Raises:
        ValueError: ``split`` is not one of :data:`SPLITS`.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; use one of {', '.join(SPLITS)}")
    return [json.loads(line) for s, line in _all_rows() if s == split]


def write_prompts(path: str, split: str, limit: int | None = None) -> int:
    """Write the first ``limit`` rows (all by default) of ``split`` to ``path`` as JSON lines, atomically.

    Returns:
        The number of rows written.
    """
    rows = prompt_rows(split)[:limit]

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    atomic_write(path, write)
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=SPLITS, required=True)
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    parser.add_argument("--limit", type=int, default=None, help="only the first N rows of the split")
    args = parser.parse_args(argv)
    print(f"{write_prompts(args.out, args.split, args.limit)} rows -> {args.out}")


if __name__ == "__main__":
    main()
