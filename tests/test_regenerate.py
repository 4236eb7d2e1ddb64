"""``speccache regenerate``: the target writes the assistant turns, turn by turn on its own history; the rows keep
the exact generated ids, which precompute caches; cut answers are marked; sampling follows per-row seeds; a killed
run resumes to the same bytes; other settings and foreign directories are refused."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from speccache.cli import main
from speccache.data import ChatFormat, load_chat_tokenizer
from speccache.data.template import split_generated_reasoning, text_after_turn
from speccache.demo import demo_data_path, ensure_demo_target
from speccache.engines.hf_generate import Sampling, generate_batch
from speccache.errors import CacheExistsError, DataError
from speccache.read import CacheDataset
from speccache.regenerate import RegenerateConfig, regenerate

pytestmark = pytest.mark.usefixtures("offline_single_thread")

END = 7  # the demo tokenizer's <|end|>, which closes a turn in its template
FLAGS = ["--limit", "10", "--max-new-tokens", "12", "--part-size", "4", "--batch-size", "3"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """The demo target, made to end answers: its LM head scores <|end|> as it scores 'e', a token its greedy
    answers often reach, and ties go to the lower id, so some answers end and some are cut."""
    out = tmp_path_factory.mktemp("models") / "ending"
    shutil.copytree(ensure_demo_target(), out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][END] = weights["lm_head.weight"][76]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _regenerate(target, out, *extra, data=None) -> int:
    return main(
        ["regenerate", "--model", target, "--data", data or demo_data_path("openai"), "--out", str(out), *extra]
    )


def _rows(out) -> list[dict]:
    record = json.loads((out / "regenerate.json").read_text())
    return [json.loads(line) for part in record["parts"] for line in (out / part["name"]).read_text().splitlines()]


def _segments(row: dict) -> list[list[int]]:
    """The runs of generated ids (loss mask 1) of a row, one per answer."""
    runs, prev = [], 0
    for token, m in zip(row["input_ids"], row["loss_mask"]):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(token)
        prev = m
    return runs


@pytest.fixture(scope="module")
def greedy(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen") / "greedy"
    assert _regenerate(target, out, *FLAGS) == 0
    return out


def test_answers_end_or_are_marked_cut_and_later_turns_are_not_generated(greedy):
    rows = _rows(greedy)
    with open(demo_data_path("openai")) as f:
        inputs = [json.loads(line) for line in f][:10]
    assert [r["source_row"] for r in rows] == list(range(10))  # input order, whatever the batches were
    cut = [r for r in rows if r["truncated"]]
    assert cut and len(cut) < len(rows)  # the fixture gives both kinds
    for row, given in zip(rows, inputs):
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        segments = _segments(row)
        assert len(segments) == len(answers) >= 1
        for k, segment in enumerate(segments):
            last = row["truncated"] and k == len(segments) - 1
            # a cut answer gets no end-of-turn token the model never emitted; every other one ends with its own
            assert (segment[-1] == END) is not last and END not in segment[:-1]
            if last:
                assert len(segment) == 12 and row["truncated_turn"] == k
        kept = [m for m in given["messages"] if m["role"] != "assistant"]
        mine = [m for m in row["messages"] if m["role"] != "assistant"]
        assert mine == kept[: len(mine)]  # user and system turns kept, in order
        if row["truncated"]:
            assert row["not_generated"] == len(given["messages"]) - len(row["messages"])
        else:
            assert "not_generated" not in row and len(row["messages"]) == len(given["messages"])


def test_each_turn_is_the_answer_to_the_regenerated_history(greedy, target):
    """A later turn's prompt is the exact ids so far (the model's own answers) and the template's text up to the
    next generation prompt; regenerating that turn alone from that prompt gives the same answer."""
    tokenizer = load_chat_tokenizer(target)
    fmt = ChatFormat.for_tokenizer(tokenizer, tokenizer.get_chat_template())
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    multi = [r for r in _rows(greedy) if len(_segments(r)) >= 2]
    assert multi
    for row in multi[:3]:
        messages = row["messages"]
        ids, at = row["input_ids"], 0
        first = messages.index(next(m for m in messages if m["role"] == "assistant"))
        prompt = fmt.render(messages[:first], "t", generation_prompt=True)[0]
        expected = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for k, segment in enumerate(_segments(row)):
            assert ids[at : at + len(expected)] == expected
            at += len(expected)
            (new, _), *_ = generate_batch(model, [ids[:at]], [torch.Generator()], Sampling(), 12, {END, 2}, 3)
            assert new == segment == ids[at : at + len(segment)]
            assert tokenizer.decode(segment[:-1] if segment[-1] == END else segment) == messages[answers[k]]["content"]
            at += len(segment)
            if k + 1 < len(answers):
                text = text_after_turn(fmt, messages[: answers[k + 1]], "t")
                expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert at == len(ids)


def test_precompute_caches_exactly_the_generated_ids(greedy, target, tmp_path):
    out = tmp_path / "cache"
    argv = ["precompute", "--model", target, "--data", str(greedy), "--out", str(out), "--shard-size", "4"]
    assert main([*argv, "--batch-size", "2", "--max-length", "512", "--quiet"]) == 0
    cache = CacheDataset(str(out))
    rows = _rows(greedy)
    assert len(cache) == len(rows)
    for i, row in enumerate(rows):
        sample = cache[i]
        assert sample["input_ids"].tolist() == row["input_ids"]
        assert sample["loss_mask"].tolist() == row["loss_mask"]
        assert int(sample["source_row"]) == i


def test_turn_modes_take_the_answers_as_turns(greedy, target, tmp_path):
    """--turns last supervises only a row's last answer; --expand-turns gives one sample per answer, up to its end."""
    rows = _rows(greedy)
    base = ["precompute", "--model", target, "--data", str(greedy), "--shard-size", "4", "--batch-size", "2"]
    caches = {}
    for name, flags in {"last": ["--turns", "last"], "expand": ["--expand-turns"]}.items():
        assert main([*base, "--out", str(tmp_path / name), "--max-length", "512", "--quiet", *flags]) == 0
        caches[name] = CacheDataset(str(tmp_path / name))
    expected = []
    for i, row in enumerate(rows):
        mask = row["loss_mask"]
        starts = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]
        ends = [t + 1 for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]
        last = caches["last"][i]
        assert last["input_ids"].tolist() == row["input_ids"]
        assert last["loss_mask"].tolist() == [int(starts[-1] <= t < ends[-1]) for t in range(len(mask))]
        expected += [
            (i, k, row["input_ids"][:end], [int(a <= t < end) for t in range(end)])
            for k, (a, end) in enumerate(zip(starts, ends))
        ]
    expand = caches["expand"]
    got = [
        (int(s["source_row"]), int(s["sample_turn"]), s["input_ids"].tolist(), s["loss_mask"].tolist())
        for s in (expand[j] for j in range(len(expand)))
    ]
    assert sorted(got) == sorted(expected) and any(k > 0 for _, k, _, _ in got)


def test_sampling_is_seeded_per_row_and_independent_of_batch_size(target, tmp_path):
    sampled = ["--temperature", "1.0", "--top-k", "50", "--top-p", "0.9", "--limit", "6", "--max-new-tokens", "6"]
    outs = {}
    for name, extra in {"b1": ["--batch-size", "1"], "b4": ["--batch-size", "4"], "seed": ["--seed", "1"]}.items():
        assert _regenerate(target, tmp_path / name, *sampled, *extra) == 0
        outs[name] = (tmp_path / name / "part-00000.jsonl").read_bytes()
    assert outs["b1"] == outs["b4"]
    assert outs["seed"] != outs["b1"]


KILLS = {
    # the second part's temporary file half-written
    "mid_part_write": "    if path.endswith('part-00001.jsonl'):\n"
    "        tmp = durable.temp_path(path)\n"
    "        fn(tmp)\n"
    "        os.truncate(tmp, os.path.getsize(tmp) // 2)\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n",
    # the second part in place, the record not yet updated: it lists one part
    "before_record": "    if path.endswith('regenerate.json') and os.path.exists(path[: -len('regenerate.json')] + "
    "'part-00001.jsonl'):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n",
}


@pytest.mark.parametrize("point", sorted(KILLS))
def test_a_killed_run_resumes_to_the_same_bytes(greedy, target, tmp_path, point):
    """The process is SIGKILLed inside the second part's writes; --resume completes the run to the same bytes."""
    out = tmp_path / "killed"
    argv = ["regenerate", "--model", target, "--data", demo_data_path("openai"), "--out", str(out), *FLAGS]
    kill = (
        "import os, signal, sys\n"
        "from speccache.format import durable\n"
        "real = durable.atomic_write\n"
        "def write(path, fn):\n"
        f"{KILLS[point]}"
        "    return real(path, fn)\n"
        "durable.atomic_write = write\n"
        "from speccache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run([sys.executable, "-c", kill, *argv], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    record = json.loads((out / "regenerate.json").read_text())
    assert record["complete"] is False and [p["name"] for p in record["parts"]] == ["part-00000.jsonl"]
    assert main([*argv, "--resume"]) == 0
    assert sorted(os.listdir(out)) == sorted(os.listdir(greedy))
    for name in os.listdir(greedy):
        if name != "regenerate.json":
            assert (out / name).read_bytes() == (greedy / name).read_bytes(), name
    assert main([*argv, "--resume"]) == 0  # a complete run resumed: nothing to do


def test_refusals(greedy, target, tmp_path, capsys):
    argv = ["regenerate", "--model", target, "--data", demo_data_path("openai"), "--out", str(greedy), *FLAGS]
    before = {n: (greedy / n).read_bytes() for n in os.listdir(greedy)}
    assert main(argv) == 1
    assert "already holds a regenerate run; pass --resume" in capsys.readouterr().err
    assert main([*argv, "--resume", "--temperature", "0.5"]) == 1
    assert "--temperature is 0.5 but the run" in capsys.readouterr().err
    assert main([*argv, "--resume", "--max-new-tokens", "13"]) == 1
    assert "--max-new-tokens is 13" in capsys.readouterr().err
    assert {n: (greedy / n).read_bytes() for n in os.listdir(greedy)} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CacheExistsError, match="did not write"):
        regenerate(RegenerateConfig(target, demo_data_path("openai"), str(foreign)))
    assert os.listdir(foreign) == ["notes.txt"]
    for flags, message in [
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must lie in"),
        (["--top-k", "-2"], "--top-k must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--model-dtype", "int8"], "--model-dtype 'int8' is unknown; choose one of bf16, fp16, fp32"),
        (["--device", "tpu"], "--device 'tpu' is unknown"),
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization is vLLM's"),
        (["--engine", "vllm", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization must lie in (0, 1]"),
    ]:
        assert _regenerate(target, tmp_path / "bad", *flags) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert _regenerate(target, tmp_path / "v", "--engine", "vllm", "--device", "cpu") == 2
    assert "--device cpu is the hf engine's" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    import speccache.engines.hf_generate as module

    with mock.patch.object(module, "load_target", side_effect=AssertionError("the model was loaded")):
        with pytest.raises(DataError, match="regenerate needs chat rows"):  # found before the model loads
            regenerate(RegenerateConfig(target, str(ids), str(tmp_path / "i")))


def test_model_dtype_takes_either_name_and_records_the_short_one(greedy, target, tmp_path):
    out = tmp_path / "named"
    shutil.copytree(greedy, out)
    record = json.loads((out / "regenerate.json").read_text())
    assert record["settings"]["model_dtype"] == "fp32"
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    assert _regenerate(target, out, *FLAGS, "--model-dtype", "float32", "--resume") == 0  # torch's name of it
    record["settings"]["model_dtype"] = "float32"  # as runs before the short names recorded it
    (out / "regenerate.json").write_text(json.dumps(record))
    assert _regenerate(target, out, *FLAGS, "--resume") == 0
    assert {n: (out / n).read_bytes() for n in os.listdir(out) if n != "regenerate.json"} == {
        n: b for n, b in before.items() if n != "regenerate.json"
    }
    assert _regenerate(target, out, *FLAGS, "--model-dtype", "bfloat16", "--resume") == 1  # still compared


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_is_refused_before_anything_is_written(target, tmp_path, capsys):
    assert _regenerate(target, tmp_path / "v", "--engine", "vllm", *FLAGS) == 2
    err = capsys.readouterr().err
    assert "speccache regenerate: error: --engine vllm needs vLLM" in err and "Traceback" not in err
    assert not (tmp_path / "v").exists()


def test_the_record_names_the_engine_and_its_version(greedy):
    import transformers

    settings = json.loads((greedy / "regenerate.json").read_text())["settings"]
    assert (settings["engine"], settings["engine_version"]) == ("hf", transformers.__version__)


def test_reads_sharegpt_rows_from_a_compressed_file(target, tmp_path):
    """The same readers as precompute: ShareGPT with a top-level system prompt, gzip; the output is OpenAI form."""
    with open(demo_data_path("sharegpt")) as f:
        rows = [json.loads(line) for line in f][:3]
    rows[0]["system"] = "Be brief."
    data = tmp_path / "rows.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = tmp_path / "out"
    assert _regenerate(target, out, "--max-new-tokens", "4", data=str(data)) == 0
    written = _rows(out)
    assert written[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    for row, given in zip(written, rows):
        users = [t["value"] for t in given["conversations"] if t["from"] == "human"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == users[: len(_segments(row))]


def test_resume_refuses_a_part_changed_after_it_was_written(greedy, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(greedy, damaged)
    with open(damaged / "part-00001.jsonl", "a") as f:
        f.write("\n")
    record = json.loads((greedy / "regenerate.json").read_text())["settings"]
    argv = ["regenerate", "--model", record["model"], "--data", demo_data_path("openai"), "--out", str(damaged)]
    assert main([*argv, *FLAGS, "--resume"]) == 1
    assert "part-00001.jsonl: the part differs from the checksum" in capsys.readouterr().err


def test_precompute_refuses_an_unfinished_run(greedy, target, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(greedy, unfinished)
    record = json.loads((unfinished / "regenerate.json").read_text())
    record["complete"] = False
    (unfinished / "regenerate.json").write_text(json.dumps(record))
    argv = ["precompute", "--model", target, "--data", str(unfinished), "--out", str(tmp_path / "c"), "--quiet"]
    assert main(argv) == 1
    assert "an unfinished speccache regenerate run" in capsys.readouterr().err


QWEN3_LIKE = (  # Qwen3's shape: reasoning rendered only after the last user message, think tags around it
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if loop.last or loop.index0 > ns_last_user %}"
    "<think>\n{{ (message.reasoning_content or '').strip('\n') }}\n</think>\n\n"
    "{% endif %}"
    "{{ message.content.lstrip('\n') }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen3_like(last_user: int) -> ChatFormat:
    template = QWEN3_LIKE.replace("ns_last_user", str(last_user))
    return ChatFormat(template, "keep", None, "2026-01-01", {}, ("<|im_start|>", "<|im_end|>"))


def test_reasoning_is_split_off_where_the_template_separates_it():
    qwen = _qwen3_like(-1)
    answer = "<think>\nFirst 2, then 3.\n</think>\n\nIt is 5."
    assert split_generated_reasoning(qwen, "<|im_start|>assistant\n", answer) == ("First 2, then 3.", "It is 5.")
    # an R1-style prompt opens the block itself
    assert split_generated_reasoning(qwen, "<|im_start|>assistant\n<think>\n", "a\n</think>\n\nb") == ("a", "b")
    assert split_generated_reasoning(qwen, "", "no thinking") == (None, "no thinking")
    assert split_generated_reasoning(qwen, "", "<think>\n\n</think>\n\nquick") == (None, "quick")
    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_target())
    plain = ChatFormat.for_tokenizer(tokenizer, tokenizer.get_chat_template())
    assert split_generated_reasoning(plain, "", answer) == (None, answer)


DEMO_QWEN3_LIKE = (  # the same shape in the demo tokenizer's tokens
    "{{ bos_token }}{% for message in messages %}{% if message.role == 'assistant' %}<|assistant|>"
    "{% if loop.last %}<think>\n{{ (message.reasoning_content or '').strip('\n') }}\n</think>\n\n{% endif %}"
    "{{ message.content }}<|end|>{% else %}<|{{ message.role }}|>{{ message.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_thinking_answers_fill_reasoning_content_and_the_history_keeps_the_ids(target, tmp_path, monkeypatch):
    """A model that thinks (scripted here: the demo target cannot) under a template that renders reasoning only in
    its last turn: each answer's block goes to reasoning_content, and the next prompt follows the ids it wrote."""
    import speccache.engines.hf_generate as module

    tokenizer = load_chat_tokenizer(target)
    said: list[list[int]] = []

    def thinking(model, prompts, generators, sampling, max_new_tokens, stop_ids, pad_id, on_tokens=None, images=None):
        out = []
        for prompt in prompts:
            n = len(said)
            said.append(list(prompt))
            text = f"<think>\nstep {n}\n</think>\n\nanswer {n}"
            out.append((tokenizer(text, add_special_tokens=False)["input_ids"] + [END], True))
        return out

    monkeypatch.setattr(module, "generate_batch", thinking)
    template = tmp_path / "qwen3_like.jinja"
    template.write_text(DEMO_QWEN3_LIKE)
    data = tmp_path / "two_turns.jsonl"
    turns = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "4+4?"},
    ]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    out = tmp_path / "out"
    assert _regenerate(target, out, "--chat-template", str(template), data=str(data)) == 0
    (row,) = _rows(out)
    assert row["messages"] == [
        turns[0],
        {"role": "assistant", "content": "answer 0", "reasoning_content": "step 0"},
        turns[2],
        {"role": "assistant", "content": "answer 1", "reasoning_content": "step 1"},
    ]
    first, second = _segments(row)
    # the second prompt holds the first answer's think block as the model wrote it (the template would drop it)
    assert (
        said[1]
        == said[0] + first + tokenizer("<|user|>4+4?<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    )
    assert row["input_ids"] == said[1] + second


def test_text_after_turn_is_what_follows_the_end_token_whatever_the_history_renders_as():
    """Qwen3 drops the reasoning of turns before the last user message; the text after the turn is the same."""
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "It is 5.", "reasoning_content": "First 2, then 3."},
        {"role": "user", "content": "and 4+4?"},
    ]
    expected = "\n<|im_start|>user\nand 4+4?<|im_end|>\n<|im_start|>assistant\n"
    assert text_after_turn(_qwen3_like(99), messages, "t") == expected
    assert text_after_turn(_qwen3_like(-1), messages, "t") == expected


@pytest.mark.slow
def test_real_target_batched_greedy_equals_one_prompt_at_a_time(real_model):
    """SmolLM2-135M in fp32: left padding, position ids and rows leaving the batch as they end change no answer."""
    tokenizer = load_chat_tokenizer(real_model)
    fmt = ChatFormat.for_tokenizer(tokenizer, tokenizer.get_chat_template())
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    questions = [
        "Hi!",
        "Name three primes.",
        "What is 2+2? Answer with one number.",
        "Say yes.",
        "Why is the sky blue?",
    ]
    prompts = [
        tokenizer(fmt.render([{"role": "user", "content": q}], "t", generation_prompt=True)[0])["input_ids"]
        for q in questions
    ]
    stops = frozenset({tokenizer.eos_token_id})
    alone = [generate_batch(model, [p], [torch.Generator()], Sampling(), 24, stops, 0)[0] for p in prompts]
    together = generate_batch(model, prompts, [torch.Generator() for _ in prompts], Sampling(), 24, stops, 0)
    assert together == alone
    assert any(ended for _, ended in alone) and not all(ended for _, ended in alone)
