"""Chat data through ``speccache precompute``: input formats, a pinned template date across a resume,
tokenizers without a chat template API, FastChat rows, the truncation warning, small targets' aux layers."""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import zstandard

import speccache.data.template as template_module
from speccache.cli import main
from speccache.data import file_content_hash, is_hub_id, iter_rows, load_chat_tokenizer, load_samples, tokenize_row
from speccache.demo import build_demo_tokenizer, build_tiny_model_dir, demo_data_path
from speccache.errors import DataError
from speccache.format import load_manifest_json, manifest_path
from speccache.methods.eagle3 import SIDE_FILE, check_aux_layers, default_aux_layers
from support.faults import crash_after_one_shard

FLAGS = ["--limit", "6", "--max-length", "48", "--batch-size", "2", "--shard-size", "2", "--quiet"]
DATED_TEMPLATE = (
    "{{- bos_token + '<|system|>Today is ' + strftime_now('%d %B %Y') + '.<|end|>' -}}"
    "{%- for m in messages -%}{{- '<|' + m.role + '|>' + m.content + '<|end|>' -}}{%- endfor -%}"
)


pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("models") / "llama"), "llama", seed=0)


def _rows(n: int = 8) -> list[dict]:
    with open(demo_data_path("sharegpt")) as f:
        return [json.loads(line) for line in f][:n]


def _shards(out) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out)) if n.startswith("shard-") or n == SIDE_FILE}


def _precompute(model_dir, data, out, *extra) -> None:
    assert main(["precompute", "--model", model_dir, "--data", str(data), "--out", str(out), *FLAGS, *extra]) == 0


def test_parquet_compressed_jsonl_and_saved_dataset_give_the_jsonl_cache(model_dir, tmp_path):
    import datasets

    rows = _rows()
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "d.jsonl").write_bytes(text)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    _precompute(model_dir, tmp_path / "d.jsonl", tmp_path / "ref")
    reference = _shards(tmp_path / "ref")
    assert len(reference) == 4
    for name in ("d.jsonl.gz", "d.jsonl.zst", "d.parquet", "saved"):
        out = tmp_path / f"out-{name}"
        _precompute(model_dir, tmp_path / name, out)
        assert _shards(out) == reference, name
    config = load_manifest_json(manifest_path(str(tmp_path / "out-saved")))["config"]
    assert len(config["data_hash"]) == 32


def test_resume_on_a_later_day_renders_the_pinned_date(model_dir, tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    template = tmp_path / "dated.jinja"
    template.write_text(DATED_TEMPLATE)
    flags = ("--chat-template", str(template), "--system-prompt", "Be brief.")
    monkeypatch.setattr(template_module, "today", lambda: "2026-12-01")
    _precompute(model_dir, data, tmp_path / "day1", *flags)
    config = load_manifest_json(manifest_path(str(tmp_path / "day1")))["config"]
    assert config["chat_date"] == "2026-12-01" and config["system_prompt"] == "Be brief."
    assert config["reasoning"] == "keep" and len(config["chat_template_hash"]) == 32

    # the same run interrupted after one shard on day 1 ...
    out = tmp_path / "interrupted"
    with crash_after_one_shard(monkeypatch):
        assert main(["precompute", "--model", model_dir, "--data", str(data), "--out", str(out), *FLAGS, *flags]) == 1
    # ... and resumed on day 2: the pinned date is the manifest's, so the bytes are day 1's.
    monkeypatch.setattr(template_module, "today", lambda: "2026-12-02")
    _precompute(model_dir, data, out, *flags, "--resume")
    assert _shards(out) == _shards(tmp_path / "day1")
    # a fresh run on day 2 renders day 2: the date does reach the tokens
    _precompute(model_dir, data, tmp_path / "day2", *flags)
    assert _shards(tmp_path / "day2") != _shards(tmp_path / "day1")


class _NoTemplateBackend:
    """Stands in for transformers' MistralCommonBackend: no get_chat_template, no offsets."""

    is_fast = False

    def get_chat_template(self, *args, **kwargs):
        raise NotImplementedError("MistralCommonBackend does not implement get_chat_template")


def test_tokenizer_without_a_chat_template_api_falls_back_to_tokenizer_json(model_dir, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _NoTemplateBackend())
    tokenizer = load_chat_tokenizer(model_dir)
    assert tokenizer.is_fast and tokenizer.get_chat_template() == build_demo_tokenizer().chat_template
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    os.unlink(bare / "tokenizer.json")
    with pytest.raises(DataError, match="the tokenizer loads as _NoTemplateBackend.*tokenizer.json"):
        load_chat_tokenizer(str(bare))


def test_fastchat_system_field_is_the_first_message():
    tok = build_demo_tokenizer()
    turns = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]
    with_field = tokenize_row({"system": "Be kind.", "conversations": turns}, tok, 256, where="x")
    with_message = tokenize_row(
        {"conversations": [{"from": "system", "value": "Be kind."}, *turns]}, tok, 256, where="x"
    )
    assert with_field == with_message != tokenize_row({"conversations": turns}, tok, 256, where="x")


def test_no_sequence_length_warning_for_rows_truncated_on_purpose(tmp_path, capfd):
    tok = build_demo_tokenizer()
    tok.model_max_length = 16
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    samples, _ = load_samples(str(path), tok, 256)
    assert len(samples) == 3 and all(len(s.input_ids) > 16 for s in samples)
    assert "longer than the specified maximum" not in capfd.readouterr().err


@pytest.mark.parametrize("num_layers", range(3, 12))
def test_default_aux_layers_are_three_distinct_layers_for_small_targets(num_layers):
    layers = default_aux_layers(num_layers)
    assert check_aux_layers(layers, num_layers) == layers and layers == sorted(layers)
    if num_layers >= 7:
        assert layers == [1, num_layers // 2 - 1, num_layers - 4]


@pytest.mark.torchrun
@pytest.mark.timeout(420)
def test_torchrun_ranks_split_the_tokenization_and_write_the_one_process_cache(model_dir, tmp_path):
    import subprocess
    import sys

    lines = [json.dumps(r) for r in _rows(11)]
    lines.insert(4, "{not json")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--model", model_dir, "--data", str(data), "--max-length", "48", "--batch-size", "2", "--shard-size", "2"]
    args += ["--dtype", "fp32", "--device", "cpu", "--quiet", "--skip-bad-rows"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    subprocess.run([sys.executable, "-m", "speccache", "precompute", *args, "--out", str(single)], check=True, env=env)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    subprocess.run(
        [*launcher, "-m", "speccache", "precompute", *args, "--out", str(multi), "--timeout", "120"],
        check=True,
        env=env,
        timeout=300,
    )
    files = {p.name: p.read_bytes() for p in sorted(single.iterdir()) if not p.name.startswith(".")}
    assert "skipped_rows.jsonl" in files
    written = {p.name: p.read_bytes() for p in sorted(multi.iterdir()) if not p.name.startswith(".")}
    manifests = [json.loads(f.pop("manifest.json")) for f in (files, written)]
    assert written == files
    # the manifests differ only in the command each run records (its own --out, torchrun's --timeout)
    assert [m.pop("producer")["argv"][-1] for m in manifests] == [str(single), "120"]
    assert manifests[0] == manifests[1]


# ---------------------------------------------------------------------------
# --data-split: a saved DatasetDict's split, or a hub dataset


def _split_rows() -> dict[str, list[dict]]:
    rows = [json.loads(line) for line in open(demo_data_path("sharegpt"))]
    return {"train": rows[:5], "test": rows[5:9]}


def test_a_saved_dataset_dict_needs_a_split_and_reads_the_one_named(tmp_path):
    import datasets

    splits = _split_rows()
    saved = str(tmp_path / "dd")
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(saved)
    with pytest.raises(DataError, match="holds several splits .*--data-split"):
        list(iter_rows(saved))
    with pytest.raises(DataError, match="no split 'dev'"):
        list(iter_rows(saved, split="dev"))
    got = [row for _, row in iter_rows(saved, split="test")]
    assert [r["conversations"] for r in got] == [r["conversations"] for r in splits["test"]]


def _saved_dict(tmp_path) -> str:
    import datasets

    saved = str(tmp_path / "dd")
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in _split_rows().items()}).save_to_disk(saved)
    return saved


def test_caches_of_two_splits_merge_and_one_appends_to_the_other(model_dir, tmp_path):
    saved = _saved_dict(tmp_path)
    for split in ("train", "test"):
        _precompute(model_dir, saved, tmp_path / split, "--data-split", split)
    assert main(["merge", str(tmp_path / "train"), str(tmp_path / "test"), "--out", str(tmp_path / "v")]) == 0
    _precompute(model_dir, saved, tmp_path / "train", "--data-split", "test", "--append")
    config = load_manifest_json(manifest_path(tmp_path / "train"))["config"]
    assert config["data_split"] == "train" and config["appended"][0]["data_split"] == "test"
    # A split is the data of its own directory: the same rows under another name are refused as already there.
    assert file_content_hash(saved, "test") == file_content_hash(os.path.join(saved, "test"))
    assert main(["precompute", "--model", model_dir, "--data", os.path.join(saved, "test"), "--out",
                 str(tmp_path / "train"), *FLAGS, "--append"]) == 1  # fmt: skip


def test_a_split_of_data_without_splits_is_refused_naming_the_argument(model_dir, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    with pytest.raises(DataError, match="--data-split train: .* has no splits"):
        list(iter_rows(str(data), split="train"))
    argv = ["precompute", "--model", model_dir, "--data", str(data), "--out", str(tmp_path / "out"), *FLAGS]
    assert main([*argv, "--data-split", "train"]) == 1
    assert "error: --data-split train:" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_an_invalid_dataset_dict_json_is_an_error_naming_it(tmp_path):
    saved = _saved_dict(tmp_path)
    with open(os.path.join(saved, "dataset_dict.json"), "w") as f:
        f.write('{"splits": ["train", "te')
    with pytest.raises(DataError, match=r"dd/dataset_dict.json: not a valid dataset_dict.json"):
        list(iter_rows(saved, split="train"))


def test_out_inside_the_saved_dataset_it_reads_is_refused_up_front(model_dir, tmp_path, capsys):
    saved = _saved_dict(tmp_path)
    before = file_content_hash(saved, "train")
    out = os.path.join(saved, "train", "cache")
    argv = ["precompute", "--model", model_dir, "--data", saved, "--data-split", "train", "--out", out, *FLAGS]
    assert main(argv) == 1
    assert "lies inside --data" in capsys.readouterr().err
    assert not os.path.exists(out) and file_content_hash(saved, "train") == before
    _precompute(model_dir, saved, os.path.join(saved, "cache"), "--data-split", "train")  # beside the split: fine


def test_a_chat_template_with_a_syntax_error_fails_up_front_naming_the_file_and_line(model_dir, tmp_path, capsys):
    template = tmp_path / "broken.jinja"
    template.write_text("{%- for m in messages -%}\n{{ m.content }\n{%- endfor -%}\n")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    argv = ["precompute", "--model", model_dir, "--data", str(data), "--out", str(tmp_path / "out"), *FLAGS]
    assert main([*argv, "--chat-template", str(template), "--skip-bad-rows"]) == 1
    err = capsys.readouterr().err
    assert f"error: --chat-template {template}: line 2: not a valid Jinja template" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_hub_id_is_read_through_load_dataset_with_its_split(monkeypatch):
    import datasets

    splits = _split_rows()
    asked: list[tuple[str, str]] = []

    def fake_load_dataset(name, split):  # the hub itself is out of reach here: the routing is what is tested
        asked.append((name, split))
        return datasets.Dataset.from_list(splits[split])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert is_hub_id("org/chat-data") and not is_hub_id("missing.jsonl") and not is_hub_id("./org/chat")
    got = [row for _, row in iter_rows("org/chat-data", split="test")]
    assert [r["conversations"] for r in got] == [r["conversations"] for r in splits["test"]]
    assert len(list(iter_rows("org/chat-data"))) == 5 and asked == [
        ("org/chat-data", "test"),
        ("org/chat-data", "train"),
    ]
    assert file_content_hash("org/chat-data", "test") != file_content_hash("org/chat-data", "train")


def test_an_unreachable_hub_dataset_is_a_data_error(monkeypatch):
    import datasets

    def offline(name, split):
        raise ConnectionError("Couldn't reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="cannot load it as a Hugging Face hub dataset.*Couldn't reach"):
        list(iter_rows("org/chat-data"))


# Ctrl-C while worker processes tokenize


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
def test_ctrl_c_while_worker_processes_tokenize_ends_the_run_and_its_workers(model_dir, tmp_path):
    rows = _rows()
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(rows[i % len(rows)]) + "\n" for i in range(100_000)))
    command = [sys.executable, "-m", "speccache", "precompute", "--model", model_dir, "--data", str(data)]
    command += ["--out", str(tmp_path / "out"), "--num-proc", "2", "--max-length", "48", "--quiet"]
    # A shell starts background jobs with SIGINT ignored, and the run would inherit that: restore the default.
    restore = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(command, start_new_session=True, preexec_fn=restore, stderr=subprocess.PIPE, text=True)
    try:
        while len(_group(proc.pid)) < 3 and proc.poll() is None:  # the run itself and its two workers
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code = proc.wait(timeout=60)  # a hang guard: it ends within seconds
        left = _group(proc.pid)  # the run joins its workers before it exits, wherever the Ctrl-C lands
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code != 0
    assert not left, "worker processes outlived the run"
    assert not (tmp_path / "out" / "manifest.json").exists()


THINKING_TEMPLATE = (  # reasoning rendered only after the last user message, as Qwen3's template does
    "{{- bos_token -}}{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|assistant|>' -}}"
    "{%- if m.reasoning_content and loop.index0 > ns.last -%}{{- '<think>' + m.reasoning_content + '</think>' -}}"
    "{%- endif -%}{{- m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|' + m.role + '|>' + m.content + '<|end|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def _thinking_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        turns = [{"role": "user", "content": f"Question {i}?"}]
        for k in range(1 + i % 3):
            turns.append({"role": "assistant", "content": f"Answer {i}.{k}.", "reasoning_content": f"think {i} {k}"})
            turns.append({"role": "user", "content": "And then?"})
        rows.append({"messages": turns[:-1]})
    return rows


def test_expand_turns_caches_one_sample_per_turn_and_resumes_byte_identical(model_dir, tmp_path, monkeypatch):
    from speccache.read import CacheDataset

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _thinking_rows(4)))  # 1 + 2 + 3 + 1 assistant turns
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    flags = ["--chat-template", str(template), "--expand-turns", "--max-length", "96", "--shard-size", "2"]
    flags += ["--batch-size", "2", "--quiet"]
    args = ["precompute", "--model", model_dir, "--data", str(data), *flags]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    config = load_manifest_json(manifest_path(str(tmp_path / "whole")))["config"]
    assert config["expand_turns"] is True and "turns" not in config
    ds = CacheDataset(str(tmp_path / "whole"))
    assert len(ds) == 7
    assert [(int(ds[i]["source_row"]), int(ds[i]["sample_turn"])) for i in range(7)] == [
        (0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 0)
    ]  # fmt: skip
    tok = load_chat_tokenizer(model_dir)
    masked = tok.decode(ds[4]["input_ids"][ds[4]["loss_mask"].bool()].tolist())
    assert "think 2 1" in masked and "Answer 2.1." in masked and "Answer 2.0" not in masked

    out = tmp_path / "interrupted"
    with crash_after_one_shard(monkeypatch):
        assert main([*args, "--out", str(out)]) == 1
    assert main([*args, "--out", str(out), "--turns", "last", "--resume"]) == 1  # another turn mode: refused
    assert main([*args, "--out", str(out), "--resume"]) == 0
    assert _shards(out) == _shards(tmp_path / "whole")


def test_tools_file_is_rendered_for_rows_without_tools_and_recorded(model_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact."}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    template = tmp_path / "t.jinja"
    template.write_text(
        "{%- if tools -%}{{- '<|system|>' + (tools | tojson) + '<|end|>' -}}{%- endif -%}"
        "{%- for m in messages -%}{{- '<|' + m.role + '|>' + m.content + '<|end|>' -}}{%- endfor -%}"
    )
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    flags = ("--chat-template", str(template), "--max-length", "400", "--tools", str(tmp_path / "tools.json"))
    _precompute(model_dir, data, tmp_path / "with", *flags)
    _precompute(model_dir, data, tmp_path / "without", *flags[:4])
    config = load_manifest_json(manifest_path(str(tmp_path / "with")))["config"]
    assert len(config["tools_hash"]) == 32
    assert "tools_hash" not in load_manifest_json(manifest_path(str(tmp_path / "without")))["config"]
    assert _shards(tmp_path / "with") != _shards(tmp_path / "without")
    assert main(["precompute", "--model", model_dir, "--data", str(data), "--out", str(tmp_path / "x"),
                 "--tools", str(tmp_path / "missing.json")]) == 1  # fmt: skip


@pytest.fixture(scope="module")
def tekken_model_dir(tmp_path_factory):
    """A tiny random Mistral whose folder ships only tekken.json, as Mistral's recent releases do."""
    mistral_common = pytest.importorskip("mistral_common")
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tekken")
    shutil.copy(
        os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json"), folder / "tekken.json"
    )
    config = MistralConfig(vocab_size=131072, hidden_size=16, intermediate_size=32, num_hidden_layers=4)
    config.update({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8})
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


def test_a_tekken_only_target_is_cached_through_mistral_common(tekken_model_dir, tmp_path):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from speccache.read import CacheDataset

    tokenizer = load_chat_tokenizer(tekken_model_dir)
    assert type(tokenizer).__name__ == "MistralCommonBackend"  # it has no Jinja template and no offsets
    encoder = MistralTokenizer.from_file(os.path.join(tekken_model_dir, "tekken.json"), ValidationMode.finetuning)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}."},
            ]
        }
        for i in range(4)
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _precompute(tekken_model_dir, data, tmp_path / "out")
    ds = CacheDataset(str(tmp_path / "out"))
    assert len(ds) == 4
    for i, row in enumerate(rows):
        ids, mask = ds[i]["input_ids"], ds[i]["loss_mask"].bool()
        assert ids.tolist() == encoder.encode_chat_completion(ChatCompletionRequest.from_openai(row["messages"])).tokens
        assert tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False) == f"{2 * i}.</s>"
