"""``speccache precompute`` end to end: resume, manifest, data handling, and refusing bad input early.

Runs go through ``speccache.cli.main`` in-process (one through ``python -m
speccache``) on a tiny random Llama with the demo tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import xxhash
from transformers import AutoTokenizer

import speccache.engines.hf as hf_engine
import speccache.precompute.run as precompute
import speccache.write
from speccache.cli import main
from speccache.data import load_samples, tokenizer_hash
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.format import load_manifest_json, manifest_path
from speccache.methods.eagle3 import SIDE_FILE, Eagle3CacheDataset

SHAREGPT = demo_data_path("sharegpt")
OPENAI = demo_data_path("openai")
# limit 8, max length 64, 4 shards of 2; draft vocab smaller than the 1024-token vocabulary, so the
# side file carries a real selection.
BASE_FLAGS = [
    "--limit",
    "8",
    "--max-length",
    "64",
    "--batch-size",
    "2",
    "--shard-size",
    "2",
    "--draft-vocab-size",
    "300",
]


pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("models") / "llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _argv(model_dir: str, data: str, out: str, *extra: str) -> list[str]:
    return ["precompute", "--model", model_dir, "--data", data, "--out", str(out), "--quiet", *extra]


def _run(model_dir: str, data: str, out, *extra: str) -> None:
    assert main(_argv(model_dir, data, str(out), *extra)) == 0


def snapshot(directory) -> dict[str, tuple[bytes, int]]:
    """Every entry (hidden ones too) of a directory: name -> (bytes, mtime_ns); a subdirectory's bytes: its listing."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            out[name] = ("\0".join(sorted(os.listdir(path))).encode(), os.stat(path).st_mtime_ns)
            continue
        with open(path, "rb") as f:
            out[name] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def _contents(directory) -> dict[str, bytes]:
    """Every file's bytes; the manifest's without ``producer``, which records each run's own command line."""
    files = {name: data for name, (data, _) in snapshot(directory).items()}
    if "manifest.json" in files:
        manifest = json.loads(files["manifest.json"])
        manifest.pop("producer", None)
        files["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """An uninterrupted run (hidden supervision, bf16, Vd 300) over the ShareGPT demo data."""
    out = tmp_path_factory.mktemp("ref") / "cache"
    _run(model_dir, SHAREGPT, out, *BASE_FLAGS)
    return out


def _fail_load(*args, **kwargs):
    pytest.fail("the target model was loaded although the invocation should have been refused first")


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(hf_engine, "load_target", _fail_load)


# ---------------------------------------------------------------------------
# 3. resume


def test_interrupted_run_resumes_byte_identical(model_dir, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cache"
    real_call = speccache.write.NativeShardWriter.__call__
    written = []

    def failing_call(self, output_dir, shard_index, samples):
        if len(written) == 2:
            raise OSError("simulated crash after two shards")
        written.append(shard_index)
        return real_call(self, output_dir, shard_index, samples)

    monkeypatch.setattr(speccache.write.NativeShardWriter, "__call__", failing_call)
    assert main(_argv(model_dir, SHAREGPT, str(out), *BASE_FLAGS)) == 1
    assert "simulated crash" in capsys.readouterr().err
    monkeypatch.undo()
    assert written == [0, 1]
    names = sorted(os.listdir(out))
    assert names == ["eagle3_side.safetensors", "manifest.json", "shard-000000.safetensors", "shard-000001.safetensors"]
    assert load_manifest_json(manifest_path(str(out)))["complete"] is False
    kept = {n: os.stat(out / n).st_mtime_ns for n in ("shard-000000.safetensors", "shard-000001.safetensors")}

    # a resume with other settings is refused before the model loads and changes nothing
    monkeypatch.setattr(hf_engine, "load_target", _fail_load)
    before = snapshot(out)
    assert main(_argv(model_dir, SHAREGPT, str(out), *BASE_FLAGS, "--resume", "--aux-layers", "0,2,5")) == 1
    err = capsys.readouterr().err
    assert "config.aux_layers" in err and "nothing was changed" in err
    assert snapshot(out) == before
    monkeypatch.undo()

    _run(model_dir, SHAREGPT, out, *BASE_FLAGS, "--resume")
    assert _contents(out) == _contents(reference)
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference))
    assert len([n for n in os.listdir(out) if n.startswith("shard-")]) == 4
    # the two whole shards were kept, not recomputed
    assert {n: os.stat(out / n).st_mtime_ns for n in kept} == kept


# ---------------------------------------------------------------------------
# 4. manifest


def test_manifest_records_the_run(model_dir, reference, tokenizer):
    manifest = load_manifest_json(manifest_path(str(reference)))
    cfg = manifest["config"]
    assert manifest["complete"] is True and manifest["cache_name"] == "eagle3"
    assert cfg["method"] == "eagle3"
    assert cfg["model"] == os.path.abspath(model_dir)
    assert isinstance(cfg["model_config_hash"], str) and len(cfg["model_config_hash"]) == 32
    assert cfg["tokenizer_hash"] == tokenizer_hash(tokenizer)
    assert cfg["data"] == os.path.abspath(SHAREGPT)
    with open(SHAREGPT, "rb") as f:
        assert cfg["data_hash"] == xxhash.xxh3_128_hexdigest(f.read())
    assert cfg["max_length"] == 64 and cfg["batch_size"] == 2 and cfg["limit"] == 8
    assert cfg["aux_layers"] == [1, 3, 4]
    assert cfg["dtype"] == "bf16"
    assert cfg["supervision"] == "hidden"
    assert cfg["draft_vocab_size"] == 300 and cfg["vocab_size"] == 1024 and cfg["hidden_size"] == 64
    samples, _ = load_samples(SHAREGPT, tokenizer, 64, limit=8)
    tokens = sum(len(s.input_ids) for s in samples)
    stats = manifest["stats"]
    assert stats["rows_read"] == 8 and stats["skipped_rows"] == {}
    assert stats["samples"] == manifest["num_samples"] == 8
    assert stats["tokens"] == manifest["num_tokens"] == tokens
    assert stats["rows_truncated"] == sum(1 for s in samples if len(s.input_ids) == 64) > 0
    assert [row["index"] for row in manifest["shards"]] == [0, 1, 2, 3]
    assert manifest["side_files"][SIDE_FILE]["bytes"] == os.path.getsize(reference / SIDE_FILE)


def test_model_config_hash_follows_the_config_not_the_path(model_dir, tmp_path):
    def config_hash(path: str) -> str:
        cfg = precompute.PrecomputeConfig(model=path, data=SHAREGPT, out="", max_length=32, limit=1)
        return precompute.make_plan(cfg).manifest_config["model_config_hash"]

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert config_hash(str(copy)) == config_hash(model_dir)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert config_hash(str(copy)) != config_hash(model_dir)


def test_resume_with_other_settings_names_every_difference(model_dir, reference, capsys, no_model_load):
    before = snapshot(reference)
    assert SIDE_FILE in before
    argv = _argv(
        model_dir, SHAREGPT, str(reference), *BASE_FLAGS, "--resume", "--max-length", "96", "--aux-layers", "0,2,5"
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "config.max_length" in err and "64" in err and "96" in err
    assert "config.aux_layers" in err and "[1, 3, 4]" in err and "[0, 2, 5]" in err
    assert "nothing was changed" in err and "Traceback" not in err
    assert snapshot(reference) == before


def test_dtypes_take_torch_names_too_and_keep_the_short_ones(model_dir):
    cfg = precompute.PrecomputeConfig(model=model_dir, data=SHAREGPT, out="", dtype="bfloat16", model_dtype="float32")
    cfg.check()
    assert (cfg.dtype, cfg.model_dtype) == ("bf16", "fp32")  # what the manifest records and a resume compares
    with pytest.raises(ValueError, match="--model-dtype 'half' is unknown; choose one of auto, bf16, fp16, fp32"):
        precompute.PrecomputeConfig(model=model_dir, data=SHAREGPT, out="", model_dtype="half").check()


def test_existing_cache_without_resume_is_refused(model_dir, reference, capsys, no_model_load):
    before = snapshot(reference)
    assert main(_argv(model_dir, SHAREGPT, str(reference), *BASE_FLAGS)) == 1
    err = capsys.readouterr().err
    assert "already holds a cache" in err and "--resume" in err
    assert snapshot(reference) == before


# ---------------------------------------------------------------------------
# 5. data


def test_sharegpt_and_openai_give_identical_caches(model_dir, reference, tmp_path):
    out = tmp_path / "openai"
    _run(model_dir, OPENAI, out, *BASE_FLAGS)
    a, b = _contents(reference), _contents(out)
    assert sorted(a) == sorted(b)
    for name in a:
        if name != "manifest.json":
            assert a[name] == b[name], name
    ma, mb = (load_manifest_json(manifest_path(str(d))) for d in (reference, out))
    assert ma["config"].pop("data") != mb["config"].pop("data")
    assert ma["config"].pop("data_hash") != mb["config"].pop("data_hash")
    assert ma.pop("producer")["argv"] != mb.pop("producer")["argv"]
    assert ma == mb


def _demo_row(path: str, index: int) -> dict:
    with open(path) as f:
        return json.loads(f.readlines()[index])


LONG_PROMPT = " ".join(f"word{i}" for i in range(200))
PRETOKENIZED = {
    "input_ids": [1, 5, 100, 101, 102, 7, 6, 200, 201, 202, 7],
    "loss_mask": [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
}


def _mixed_lines() -> list[tuple[str, str | None]]:
    """(line text, kind): the kind of each line of the mixed data file."""
    rows = [
        (json.dumps(_demo_row(SHAREGPT, 0)), "usable"),
        (json.dumps(PRETOKENIZED), "usable"),
        (json.dumps({"conversations": [{"from": "human", "value": "hello there"}]}), "no_assistant"),
        ('{"conversations": [ not json', "bad"),
        (json.dumps(_demo_row(OPENAI, 2)), "usable"),
        (json.dumps({"input_ids": [1, 5, 9, 7], "loss_mask": [0, 0, 0, 0]}), "no_assistant"),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": LONG_PROMPT}, {"role": "assistant", "content": "ok"}]}
            ),
            "no_assistant",
        ),
        ("", None),  # blank lines are not rows
        (json.dumps(_demo_row(SHAREGPT, 4)), "usable"),
    ]
    return rows


@pytest.fixture(scope="module")
def mixed(model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("mixed")
    path = base / "mixed.jsonl"
    path.write_text("\n".join(text for text, _ in _mixed_lines()) + "\n")
    out = base / "cache"
    _run(model_dir, str(path), out, "--max-length", "64", "--batch-size", "1", "--shard-size", "1", "--skip-bad-rows")
    return path, out


def _expected_tokens(tokenizer, row: dict, max_length: int) -> tuple[list[int], list[int]] | None:
    if "input_ids" in row:
        return row["input_ids"][:max_length], row["loss_mask"][:max_length]
    if "conversations" in row:
        role = {"human": "user", "gpt": "assistant", "system": "system"}
        messages = [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]]
    else:
        messages = row["messages"]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(enc["input_ids"])[:max_length], list(enc["assistant_masks"])[:max_length]


def test_mixed_rows_skip_count_and_keep_order(mixed, tokenizer, capsys, tmp_path):
    path, out = mixed
    manifest = load_manifest_json(manifest_path(str(out)))
    stats = manifest["stats"]
    lines = _mixed_lines()
    assert stats["rows_read"] == sum(kind is not None for _, kind in lines) == 8
    # the long prompt's assistant reply lies beyond --max-length 64: counted apart from rows with no assistant
    assert stats["skipped_rows"] == {"malformed": 1, "no_assistant_token": 2, "no_assistant_within_max_length": 1}
    assert stats["samples"] == manifest["num_samples"] == 4
    with open(out / "skipped_rows.jsonl") as f:
        skipped = [json.loads(line) for line in f]
    assert [(r["row"], r["reason"]) for r in skipped] == [
        (2, "no_assistant_token"),
        (3, "malformed"),
        (5, "no_assistant_token"),
        (6, "no_assistant_within_max_length"),
    ]
    assert skipped[1]["detail"].startswith(f"{path}:4: invalid JSON")
    assert manifest["side_files"]["skipped_rows.jsonl"]["bytes"] == os.path.getsize(out / "skipped_rows.jsonl")
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert (
        "skipped    4 rows: malformed 1, no_assistant_token 2, no_assistant_within_max_length 1"
        in capsys.readouterr().out
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    with open(damaged / "skipped_rows.jsonl", "a") as f:
        f.write("\n")
    assert main(["verify", str(damaged)]) == 1  # the plain-bytes side file is checksummed like the others
    ds = Eagle3CacheDataset(str(out))
    usable = [json.loads(text) for text, kind in lines if kind == "usable"]
    assert len(ds) == len(usable)
    for i, row in enumerate(usable):
        ids, mask = _expected_tokens(tokenizer, row, 64)
        assert ds[i]["input_ids"].tolist() == ids
        assert ds[i]["loss_mask"].tolist() == [bool(m) for m in mask]
    assert ds[1]["input_ids"].tolist() == PRETOKENIZED["input_ids"]
    # every sample records its 0-based line in the data file
    assert [int(ds[i]["source_row"]) for i in range(len(ds))] == [i for i, (_, k) in enumerate(lines) if k == "usable"]


def test_malformed_row_fails_naming_file_and_line(model_dir, mixed, tmp_path, capsys, no_model_load):
    path, _ = mixed
    out = tmp_path / "cache"
    assert (
        main(_argv(model_dir, str(path), str(out), "--max-length", "64", "--batch-size", "1", "--shard-size", "1")) != 0
    )
    err = capsys.readouterr().err
    assert f"{path}:4" in err and "invalid JSON" in err
    assert not out.exists()


def test_json_list_form_and_limit(model_dir, mixed, tmp_path):
    _, jsonl_out = mixed
    rows = [json.loads(text) for text, kind in _mixed_lines() if kind in ("usable", "no_assistant")]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1))
    out = tmp_path / "cache"
    _run(model_dir, str(path), out, "--max-length", "64", "--batch-size", "1", "--shard-size", "1", "--limit", "3")
    manifest = load_manifest_json(manifest_path(str(out)))
    # --limit 3 stops after the third usable row (row index 3; row 2 had no assistant)
    assert manifest["num_samples"] == 3
    assert manifest["stats"]["rows_read"] == 4 and manifest["stats"]["skipped_rows"] == {"no_assistant_token": 1}
    a, b = _contents(out), _contents(jsonl_out)
    assert sorted(n for n in a if n.startswith("shard-")) == [f"shard-00000{i}.safetensors" for i in range(3)]
    assert a[SIDE_FILE] == b[SIDE_FILE]
    # the same samples; only their source rows differ (list index here, line of the .jsonl there)
    from_json, from_jsonl = Eagle3CacheDataset(str(out)), Eagle3CacheDataset(str(jsonl_out))
    for i in range(3):
        x, y = from_json[i], from_jsonl[i]
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x if k != "source_row"), i
    assert [int(from_json[i]["source_row"]) for i in range(3)] == [0, 1, 3]


# ---------------------------------------------------------------------------
# 6. bad input: refused before the model loads, nothing written


def _bad_cases(model_dir: str, tmp) -> list[tuple[str, list[str], list[str], str | None]]:
    """(id, argv, substrings the message must hold, path that must stay unchanged or absent)."""
    empty = tmp / "no_usable.jsonl"
    empty.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    a_file = tmp / "a_file"
    a_file.write_text("not a directory\n")
    (tmp / "empty_model").mkdir()
    good = ["--limit", "4", "--max-length", "32"]
    return [
        (
            "missing_model",
            ["--model", str(tmp / "nope" / "model"), "--data", SHAREGPT, *good],
            ["--model", str(tmp / "nope")],
            None,
        ),
        # "models/llama" has the shape of a hub id ("org/name"); relative to the cwd it is a missing directory
        (
            "missing_model_relative",
            ["--model", "models/llama", "--data", SHAREGPT, *good],
            ["--model models/llama"],
            None,
        ),
        (
            "model_without_config",
            ["--model", str(tmp / "empty_model"), "--data", SHAREGPT, *good],
            [str(tmp / "empty_model")],
            None,
        ),
        (
            "missing_data",
            ["--model", model_dir, "--data", str(tmp / "missing.jsonl"), *good],
            ["--data", "missing.jsonl"],
            None,
        ),
        (
            "unknown_method",
            ["--model", model_dir, "--data", SHAREGPT, "--method", "medusa", *good],
            ["--method", "medusa"],
            None,
        ),
        (
            "unknown_supervision",
            ["--model", model_dir, "--data", SHAREGPT, "--supervision", "logits", *good],
            ["--supervision", "logits"],
            None,
        ),
        (
            "topk_0",
            ["--model", model_dir, "--data", SHAREGPT, "--supervision", "topk:0", *good],
            ["--supervision"],
            None,
        ),
        (
            "aux_out_of_range",
            ["--model", model_dir, "--data", SHAREGPT, "--aux-layers", "1,3,8", *good],
            ["--aux-layers", "[0, 7]"],
            None,
        ),
        (
            "aux_duplicated",
            ["--model", model_dir, "--data", SHAREGPT, "--aux-layers", "1,3,3", *good],
            ["--aux-layers", "distinct"],
            None,
        ),
        ("max_length_1", ["--model", model_dir, "--data", SHAREGPT, "--max-length", "1"], ["--max-length"], None),
        (
            "draft_vocab_0",
            ["--model", model_dir, "--data", SHAREGPT, "--draft-vocab-size", "0", *good],
            ["--draft-vocab-size", "1024"],
            None,
        ),
        (
            "draft_vocab_big",
            ["--model", model_dir, "--data", SHAREGPT, "--draft-vocab-size", "1025", *good],
            ["--draft-vocab-size", "1024"],
            None,
        ),
        (
            "shard_not_multiple",
            ["--model", model_dir, "--data", SHAREGPT, "--batch-size", "4", "--shard-size", "6", *good],
            ["--shard-size", "--batch-size"],
            None,
        ),
        (
            "no_usable_row",
            ["--model", model_dir, "--data", str(empty), *good],
            ["--data", str(empty), "no usable row"],
            None,
        ),
        ("out_is_a_file", ["--model", model_dir, "--data", SHAREGPT, *good], ["--out", str(a_file)], str(a_file)),
    ]


CASE_IDS = [
    "missing_model", "missing_model_relative", "model_without_config", "missing_data", "unknown_method",
    "unknown_supervision", "topk_0", "aux_out_of_range",
    "aux_duplicated", "max_length_1", "draft_vocab_0", "draft_vocab_big", "shard_not_multiple", "no_usable_row",
    "out_is_a_file",
]  # fmt: skip


@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_invocation_is_refused_before_loading(model_dir, tmp_path, capsys, monkeypatch, no_model_load, case):
    monkeypatch.chdir(tmp_path)
    cases = {c[0]: c for c in _bad_cases(model_dir, tmp_path)}
    _, args, needles, keep = cases[case]
    out = keep or str(tmp_path / "out")
    before = sorted(os.listdir(tmp_path))
    kept = snapshot(tmp_path) if keep else None
    rc = main(["precompute", *args, "--out", out, "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before  # no out dir, nothing else
    if kept is not None:
        assert snapshot(tmp_path) == kept


def test_bad_invocation_via_python_m(model_dir, tmp_path):
    out = tmp_path / "out"
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "speccache", "precompute", "--model", model_dir, "--data", str(missing),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "--data" in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
