"""Write the bundled demo chat dataset, in ShareGPT and OpenAI form.

Run ``python tools/make_demo_data.py`` after editing ``tools/demo_data/conversations.json`` (the
conversations' text) or the arithmetic below; it rewrites ``src/speccache/demo/data/chat_sharegpt.jsonl`` and
``chat_openai.jsonl`` (both are committed and ship with the package; this tool and its text do not). The output
is a pure function of those two files: a fixed seed drives every choice and nothing iterates over a set or a
hash-ordered container.

The demo tokenizer is trained on these files, so changing them changes the
demo vocabulary; bump ``DEMO_VERSION`` in ``speccache.demo`` when you do, so
cached demo targets built from the old vocabulary are not reused.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONVERSATIONS", "build_conversations", "main", "write_files"]

SEED = 20240917
N_CONVERSATIONS = 240
CONVERSATIONS = Path(__file__).resolve().parent / "demo_data" / "conversations.json"
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "src" / "speccache" / "demo" / "data"

Exchange = tuple[str, str]
Item = tuple[str, str, list[Exchange]]


@dataclass(frozen=True)
class _Text:
    """The literal text of ``conversations.json``: what the random choices below pick from."""

    system_prompts: list[str]
    topics: dict[str, list[Item]]  # topic -> (question, answer, follow-up exchanges)
    closers: list[Exchange]
    another: list[str]  # prefixes of a later exchange's question


def _exchange(entry: dict[str, str]) -> Exchange:
    return entry["user"], entry["assistant"]


def _load_text(path: Path) -> _Text:
    raw = json.loads(path.read_text(encoding="utf-8"))
    topics = {
        topic: [(item["user"], item["assistant"], [_exchange(e) for e in item.get("follow_ups", [])]) for item in items]
        for topic, items in raw["topics"].items()
    }
    return _Text(raw["system_prompts"], topics, [_exchange(e) for e in raw["closers"]], raw["another"])


def _add(rng: random.Random) -> list[Exchange]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    c = rng.randint(2, 9)
    return [
        (f"What is {a} + {b}?", f"{a} + {b} = {a + b}."),
        (
            f"Now multiply that by {c}.",
            f"{a + b} * {c} = {(a + b) * c}.",
        ),
    ]


def _subtract(rng: random.Random) -> list[Exchange]:
    a = rng.randint(100, 5000)
    b = rng.randint(1, a)
    return [
        (
            f"Compute {a} - {b}.",
            f"{a} - {b} = {a - b}.",
        ),
        (
            "Can you check it?",
            f"Adding back: {a - b} + {b} = {a}, which matches, so {a - b} is correct.",
        ),
    ]


def _multiply(rng: random.Random) -> list[Exchange]:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    tens, ones = b // 10 * 10, b % 10
    steps = (
        f"Split {b} into {tens} + {ones}. Then {a} * {tens} = {a * tens} and "
        f"{a} * {ones} = {a * ones}. Adding them: {a * tens} + {a * ones} = {a * b}."
    )
    return [
        (f"What is {a} times {b}? Show your steps.", f"{steps} So {a} * {b} = {a * b}."),
        (f"And {a} times {b + 1}?", f"That is one more {a}: {a * b} + {a} = {a * (b + 1)}."),
    ]


def _divide(rng: random.Random) -> list[Exchange]:
    b = rng.randint(3, 19)
    q = rng.randint(5, 120)
    r = rng.randint(0, b - 1)
    a = b * q + r
    answer = f"{a} divided by {b} is {q} with a remainder of {r}, because {b} * {q} = {b * q} and {a} - {b * q} = {r}."
    if r == 0:
        answer = f"{a} divided by {b} is exactly {q}, because {b} * {q} = {a}."
    return [
        (f"Divide {a} by {b}.", answer),
        ("As a decimal?", f"{a} / {b} = {a / b:.4f}, rounded to four decimal places."),
    ]


def _percent(rng: random.Random) -> list[Exchange]:
    p = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75])
    price = rng.randint(8, 400)
    off = price * p / 100
    return [
        (
            f"A jacket costs ${price} and is {p}% off. What is the sale price?",
            f"{p}% of {price} is {price} * {p} / 100 = {off:g}. The sale price is "
            f"{price} - {off:g} = ${price - off:g}.",
        ),
        (
            "And if there is 8% sales tax on the sale price?",
            f"The tax is {price - off:g} * 0.08 = {(price - off) * 0.08:.2f}, so you pay "
            f"{(price - off) * 1.08:.2f} dollars in total.",
        ),
    ]


def _word_problem(rng: random.Random) -> list[Exchange]:
    per_box = rng.randint(4, 24)
    boxes = rng.randint(3, 30)
    eaten = rng.randint(1, per_box * boxes - 1)
    left = per_box * boxes - eaten
    friends = rng.randint(2, 6)
    return [
        (
            f"A baker packs {per_box} cookies in each box and fills {boxes} boxes. "
            f"Then {eaten} cookies are sold. How many cookies are left?",
            f"First the total: {per_box} * {boxes} = {per_box * boxes} cookies. After "
            f"selling {eaten}, {per_box * boxes} - {eaten} = {left} cookies are left.",
        ),
        (
            f"If the rest is shared equally among {friends} friends, how many does each get?",
            f"{left} divided by {friends} is {left // friends} with {left % friends} "
            f"left over, so each friend gets {left // friends} cookies.",
        ),
    ]


def _average(rng: random.Random) -> list[Exchange]:
    scores = [rng.randint(50, 100) for _ in range(rng.randint(3, 6))]
    total = sum(scores)
    listed = ", ".join(str(s) for s in scores)
    return [
        (
            f"What is the average of {listed}?",
            f"Add them: {' + '.join(str(s) for s in scores)} = {total}. There are "
            f"{len(scores)} numbers, so the average is {total} / {len(scores)} = "
            f"{total / len(scores):.2f}.",
        ),
        (
            "What is the largest and the smallest?",
            f"The largest is {max(scores)} and the smallest is {min(scores)}, so the "
            f"range is {max(scores) - min(scores)}.",
        ),
    ]


ARITHMETIC = [_add, _subtract, _multiply, _divide, _percent, _word_problem, _average]


class _Pool:
    """Deals items in a reshuffled cycle so every item is used before any repeats."""

    def __init__(self, items: list[Item], rng: random.Random) -> None:
        self._items = items
        self._rng = rng
        self._queue: list[Item] = []

    def draw(self) -> Item:
        if not self._queue:
            self._queue = list(self._items)
            self._rng.shuffle(self._queue)
        return self._queue.pop()


def _arithmetic_item(rng: random.Random) -> Item:
    first, *rest = rng.choice(ARITHMETIC)(rng)
    return first[0], first[1], rest


def build_conversations(
    seed: int = SEED, n: int = N_CONVERSATIONS, text: str | Path = CONVERSATIONS
) -> list[list[dict[str, str]]]:
    """Build the demo conversations as OpenAI-style message lists.

    Args:
        seed: Seed of the random generator that picks topics, lengths and numbers.
        n: Number of conversations.
        text: The JSON file of the conversations' literal text.

    Returns:
        ``n`` conversations; each is a list of ``{"role", "content"}`` dicts with
        1-4 user/assistant exchanges and sometimes a leading system message.
    """
    content = _load_text(Path(text))
    rng = random.Random(seed)
    pools = {topic: _Pool(items, rng) for topic, items in content.topics.items()}
    topics = ["everyday", "science", "programming", "arithmetic", "greeting"]
    weights = [3, 3, 3, 3, 1]

    def draw(topic: str) -> Item:
        return _arithmetic_item(rng) if topic == "arithmetic" else pools[topic].draw()

    conversations = []
    for _ in range(n):
        topic = rng.choices(topics, weights)[0]
        n_exchanges = rng.choices([1, 2, 3, 4], [4, 3, 3, 2])[0]
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(content.system_prompts)})
        question, answer, follow_ups = draw(topic)
        exchanges = [(question, answer), *follow_ups]
        while len(exchanges) < n_exchanges:
            if rng.random() < 0.25:
                exchanges.append(rng.choice(content.closers))
                continue
            question, answer, follow_ups = draw(rng.choices(topics, weights)[0])
            exchanges += [(rng.choice(content.another) + question, answer), *follow_ups]
        for question, answer in exchanges[:n_exchanges]:
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        conversations.append(messages)
    return conversations


_SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def write_files(out_dir: str | Path) -> None:
    """Write ``chat_sharegpt.jsonl`` and ``chat_openai.jsonl`` (same conversations) into ``out_dir``.

    Args:
        out_dir: Destination directory, created if missing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conversations = build_conversations()
    with open(out / "chat_openai.jsonl", "w", encoding="ascii", newline="\n") as f:
        for i, messages in enumerate(conversations):
            f.write(json.dumps({"id": f"demo-{i:04d}", "messages": messages}) + "\n")
    with open(out / "chat_sharegpt.jsonl", "w", encoding="ascii", newline="\n") as f:
        for i, messages in enumerate(conversations):
            turns = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]
            f.write(json.dumps({"id": f"demo-{i:04d}", "conversations": turns}) + "\n")


def main() -> None:
    """Regenerate the bundled files in ``src/speccache/demo/data/``."""
    write_files(BUNDLED_DIR)


if __name__ == "__main__":
    main()
