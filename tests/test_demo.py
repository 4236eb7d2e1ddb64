"""Tests of speccache.demo: deterministic tokenizer, bundled data, tiny target models, the demo's acceptance part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import speccache.demo as demo
from speccache.data import iter_rows, load_samples, tokenizer_hash
from speccache.demo import (
    ARCHITECTURES,
    build_demo_tokenizer,
    build_tiny_model_dir,
    demo_data_path,
    ensure_demo_target,
)
from support import load_tool


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_tokenizer_shape(tok):
    assert 300 <= len(tok) <= 2000
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == ("<unk>", "<s>", "</s>", "<pad>")
    markers = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    assert tok.convert_tokens_to_ids(["<unk>", "<s>", "</s>", "<pad>", *markers]) == list(range(8))
    assert set(markers) <= set(tok.all_special_tokens)
    assert "{% generation %}" in tok.chat_template
    text = "Hello, world!\n  def f(x):\n    return x * 2  # ok"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tokenizer_is_deterministic_across_processes(tok):
    code = (
        "from speccache.demo import build_demo_tokenizer as b\n"
        "from speccache.data import tokenizer_hash as h\n"
        "print(h(b()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == tokenizer_hash(tok) == tokenizer_hash(build_demo_tokenizer())
    assert build_demo_tokenizer().get_vocab() == tok.get_vocab()


def test_demo_data_files(tok):
    paths = {form: demo_data_path(form) for form in ("sharegpt", "openai")}
    rows = {form: [row for _, row in iter_rows(path)] for form, path in paths.items()}
    assert len(rows["openai"]) == len(rows["sharegpt"]) >= 200
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    for o, s in zip(rows["openai"], rows["sharegpt"]):
        assert o["messages"] == [{"role": role[t["from"]], "content": t["value"]} for t in s["conversations"]]
    exchanges = {sum(m["role"] == "assistant" for m in r["messages"]) for r in rows["openai"]}
    assert exchanges == {1, 2, 3, 4}
    assert any(r["messages"][0]["role"] == "system" for r in rows["openai"])
    for path in paths.values():
        assert Path(path).read_bytes().isascii()
    samples, _ = load_samples(paths["openai"], tok, 4096)
    lengths = [len(s.input_ids) for s in samples]
    assert min(lengths) < 32 and max(lengths) > 300
    with pytest.raises(ValueError, match="sharegpt, openai"):
        demo_data_path("alpaca")


def test_make_data_reproduces_bundled_files(tmp_path):
    load_tool("make_demo_data").write_files(tmp_path)
    for form in ("sharegpt", "openai"):
        assert (tmp_path / f"chat_{form}.jsonl").read_bytes() == Path(demo_data_path(form)).read_bytes()


def test_ensure_demo_target_builds_once_and_reloads(tmp_path, monkeypatch, tok):
    target = tmp_path / "cache" / "demo"
    monkeypatch.setenv("SPECCACHE_DEMO_TARGET", str(target))
    assert ensure_demo_target() == str(target)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the demo target was rebuilt")

    monkeypatch.setattr(demo, "_save_model", no_rebuild)
    assert ensure_demo_target() == str(target)
    assert ensure_demo_target(str(target)) == str(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo"]

    model = AutoModelForCausalLM.from_pretrained(target)
    loaded_tok = AutoTokenizer.from_pretrained(target)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 8, 4, 2)
    assert cfg.intermediate_size == 128 and cfg.vocab_size == len(tok)
    assert model.dtype == torch.float32
    assert tokenizer_hash(loaded_tok) == tokenizer_hash(tok)
    assert loaded_tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}]
    )
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|end|>"), tok.eos_token_id]


def test_ensure_demo_target_default_location(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECCACHE_DEMO_TARGET", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ensure_demo_target() == str(tmp_path / ".cache" / "speccache" / f"demo-target-v{demo.DEMO_VERSION}")


def test_racing_builders_share_one_directory(tmp_path):
    target = tmp_path / "race"
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda seed: build_tiny_model_dir(str(target), "llama", seed), [0, 0]))
    assert results == [str(target)] * 2
    assert [p.name for p in tmp_path.iterdir()] == ["race"]
    assert json.loads((target / "speccache_demo.json").read_text())["seed"] == 0


def test_existing_foreign_directory_is_not_overwritten(tmp_path):
    target = tmp_path / "other"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="delete it or choose another path"):
        build_tiny_model_dir(str(target), "llama")
    build_tiny_model_dir(str(tmp_path / "m"), "llama", seed=1)
    with pytest.raises(FileExistsError):
        build_tiny_model_dir(str(tmp_path / "m"), "llama", seed=2)
    with pytest.raises(ValueError, match="unknown architecture"):
        build_tiny_model_dir(str(tmp_path / "x"), "gpt2")


def test_same_seed_same_weights_and_caller_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model_dir(str(tmp_path / "a"), "llama", seed=5)
    assert torch.equal(torch.rand(3), expected)
    b = build_tiny_model_dir(str(tmp_path / "b"), "llama", seed=5)
    assert (Path(a) / "model.safetensors").read_bytes() == (Path(b) / "model.safetensors").read_bytes()


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_tiny_architectures_load_and_run(tmp_path, tok, architecture):
    path = build_tiny_model_dir(str(tmp_path / architecture), architecture)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == architecture
    assert model.config.num_hidden_layers == 8
    loaded_tok = AutoTokenizer.from_pretrained(path)
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert loaded_tok.chat_template == tok.chat_template
    if architecture != "qwen2":  # transformers maps model_type qwen2 to Qwen2Tokenizer's own pre-tokenizer
        assert tokenizer_hash(loaded_tok) == tokenizer_hash(tok)
    ids = loaded_tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == 9
    assert out.logits.shape == (1, ids.shape[1], len(tok))
    for layer in (1, 3, 4):
        h = out.hidden_states[layer][0]
        assert h.shape == (ids.shape[1], 64) and torch.isfinite(h).all()
        unit = torch.nn.functional.normalize(h, dim=-1)
        off_diagonal = (unit @ unit.T)[~torch.eye(len(h), dtype=torch.bool)]
        assert off_diagonal.abs().mean() < 0.8, "hidden states at different positions are nearly identical"


def test_demo_target_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ensure_demo_target("~/t") == os.path.join(str(tmp_path), "t")


@pytest.mark.usefixtures("offline_single_thread")
def test_demo_acceptance_part_reports_and_reuses_its_work(tiny_models, tmp_path, capsys):
    """The demo's acceptance part on the tiny target (the demo runs it on SmolLM2): regenerated answers, their
    caches, a draft, real speculative decoding, the summary against both baselines; a second run resumes the
    answers and caches and keeps the draft."""
    from speccache.demo.run import acceptance, acceptance_summary, conclusions, outputs

    out = str(tmp_path / "real")
    sizes = {"train_rows": 16, "eval_rows": 2, "answer_tokens": 16, "draft_vocab_size": 300, "epochs": 1,
             "max_new_tokens": 8}  # fmt: skip
    report = acceptance(tiny_models("llama"), out, **sizes)
    first = capsys.readouterr().out
    assert first.count("\n$ speccache regenerate ") == first.count("\n$ speccache precompute ") == 2
    assert "\n$ speccache train " in first and "\n$ speccache evaluate " in first
    summary = acceptance_summary(report)
    assert "acceptance on 2 held-out prompts, k=3" in summary
    where = outputs(out)  # the draft's log and the pictures, named at the demo's end
    assert f"training log: {os.path.join(out, 'draft', 'train_log.jsonl')}" in where
    assert f"loss curve: {os.path.join(out, 'draft', 'loss.png')}" in where
    assert f"acceptance chart: {os.path.join(out, 'report.png')}" in where
    winner = max(("draft", "ngram", "prompt_lookup"), key=lambda n: report["speculative"][n]["tau"])
    named = {"draft": "EAGLE-3 draft", "ngram": "n-gram table", "prompt_lookup": "prompt lookup"}[winner]
    assert conclusions(report, 16, 1).startswith(f"Most tokens per target forward in real decoding: {named}")
    for label in ("EAGLE-3 draft", "n-gram table", "prompt lookup"):
        assert f"  {label} " in summary and "mean accepted length" in summary
    assert summary.endswith("greedy output identical: yes")
    drafted = os.path.getmtime(os.path.join(out, "draft", "model.safetensors"))
    again = acceptance(tiny_models("llama"), out, **sizes)
    second = capsys.readouterr().out
    assert "\n$ speccache train " not in second and "reused (delete it to train again)" in second
    assert os.path.getmtime(os.path.join(out, "draft", "model.safetensors")) == drafted
    assert again["teacher_forced"] == report["teacher_forced"]


def _report(draft_tau: float, ngram_tau: float, lookup_tau: float, accepted: tuple[float, float, float]) -> dict:
    """A ``speccache evaluate`` report of 100 tokens per proposer with these taus and mean accepted lengths."""
    taus = {"greedy": 1.0, "draft": draft_tau, "ngram": ngram_tau, "prompt_lookup": lookup_tau}
    spec = {name: {"tau": tau, "tokens": 100, "forwards": round(100 / tau)} for name, tau in taus.items()}
    tf = {name: {"mean_accepted": a} for name, a in zip(("draft", "ngram", "prompt_lookup"), accepted)}
    return {"k": 3, "speculative": {"prompts": 8, **spec}, "teacher_forced": tf}


def test_demo_conclusions_name_the_winner_the_numbers_give():
    from speccache.demo.run import MEASURED_SCALE, conclusions

    # the n-gram table wins in real decoding (the run where the demo used to credit the draft), prompt lookup
    # accepts the longest teacher-forced chains
    lines = conclusions(_report(1.17, 1.27, 1.14, (0.28, 0.30, 0.61)), 48, 5).splitlines()
    assert lines[0] == (
        "Most tokens per target forward in real decoding: n-gram table, tau 1.270 against EAGLE-3 draft 1.170 and "
        "prompt lookup 1.140 (1.09x the runner-up); 79 target forwards for 100 tokens, where greedy decoding took 100."
    )
    assert (
        lines[1]
        == "Longest teacher-forced chains: prompt lookup, mean accepted length 0.610 against n-gram table 0.300."
    )
    assert lines[2] == f"This draft trained 5 epochs on 48 answers and did not win; {MEASURED_SCALE}."
    assert "make acceptance" in MEASURED_SCALE and "docs/acceptance.md" in MEASURED_SCALE

    # the draft wins both measures
    lines = conclusions(_report(1.85, 1.46, 1.28, (0.98, 0.52, 0.89)), 1148, 20).splitlines()
    assert lines[0].startswith("Most tokens per target forward in real decoding: EAGLE-3 draft, tau 1.850 against ")
    assert "n-gram table 1.460 and prompt lookup 1.280 (1.27x the runner-up); 54 target forwards" in lines[0]
    assert lines[1].startswith("Longest teacher-forced chains: EAGLE-3 draft, mean accepted length 0.980 against")
    assert lines[2].startswith("This draft trained 20 epochs on 1148 answers and won; ")

    # a tie at the top is a tie, not a win
    lines = conclusions(_report(1.25, 1.25, 1.1, (0.3, 0.3, 0.1)), 48, 5).splitlines()
    assert "EAGLE-3 draft and n-gram table tied at tau 1.250, prompt lookup 1.100;" in lines[0]
    assert "and did not win;" in lines[2]
