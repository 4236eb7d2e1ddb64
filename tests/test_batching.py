"""Length-sorted batches within each shard: little padding, the same bytes in any resume, the audit's batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.read import CacheDataset
from speccache.write.loops import batch_of, shard_batches

pytestmark = pytest.mark.usefixtures("offline_single_thread")
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "batching.py"


@pytest.mark.parametrize("budget", [None, 1, 40, 100])
def test_shard_batches_partition_the_shard_longest_first_within_the_budget(budget):
    lengths = [5, 17, 3, 17, 9, 1, 30, 2, 9, 9, 4]
    batches = shard_batches(lengths, 3, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # a partition
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # longest first
    assert flat == sorted(flat, key=lambda i: (-lengths[i], i))  # ties by index: deterministic
    for b in batches:
        if budget is None:
            assert len(b) <= 3
        elif len(b) > 1:
            assert len(b) * lengths[b[0]] <= budget
    assert shard_batches(lengths, 3, budget) == batches
    for index in range(len(lengths)):
        assert index in batch_of(index, lengths, len(lengths), 3, budget)


def _precompute(tiny_models, out: Path, *extra: str) -> dict:
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--out", str(out),
            "--limit", "24", "--max-length", "128", "--model-dtype", "fp32", "--dtype", "fp32", "--quiet",
            "--shard-size", "8", *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "manifest.json").read_text())


def test_sorted_batches_compute_less_padding_and_agree_with_stored_order(tiny_models, tmp_path):
    ordered = _precompute(tiny_models, tmp_path / "ordered", "--batch-size", "4", "--batching", "ordered")
    sorted_ = _precompute(tiny_models, tmp_path / "sorted", "--batch-size", "4")
    budget = _precompute(tiny_models, tmp_path / "budget", "--max-batch-tokens", "256")
    real = ordered["stats"]["tokens"]
    assert sorted_["stats"]["tokens"] == budget["stats"]["tokens"] == real
    assert real < sorted_["stats"]["computed_tokens"] < ordered["stats"]["computed_tokens"]
    assert sorted_["config"]["batching"] == "sorted" and budget["config"]["max_batch_tokens"] == 256
    a, b, c = (CacheDataset(str(tmp_path / n)) for n in ("ordered", "sorted", "budget"))
    for i in range(len(a)):  # the stored order is the data's, whatever the batches
        for key in ("input_ids", "loss_mask", "source_row"):
            assert torch.equal(a[i][key], b[i][key]) and torch.equal(a[i][key], c[i][key])
        for key in ("aux_hidden_states", "last_hidden_state"):
            torch.testing.assert_close(b[i][key], a[i][key], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c[i][key], a[i][key], rtol=1e-5, atol=1e-5)


def test_a_resumed_sorted_run_writes_the_same_bytes(tiny_models, tmp_path):
    whole = tmp_path / "whole"
    _precompute(tiny_models, whole, "--max-batch-tokens", "300")
    part = tmp_path / "part"
    part.mkdir()
    for name in os.listdir(whole):
        if name != "shard-000001.safetensors":
            (part / name).write_bytes((whole / name).read_bytes())
    _precompute(tiny_models, part, "--max-batch-tokens", "300", "--resume")
    assert sorted(os.listdir(part)) == sorted(os.listdir(whole))
    for name in os.listdir(whole):
        assert (part / name).read_bytes() == (whole / name).read_bytes(), name


def test_the_audit_recomputes_a_sorted_cache_in_its_own_batches(tiny_models, tmp_path):
    from speccache.precompute.audit import audit_cache

    out = tmp_path / "c"
    _precompute(tiny_models, out, "--batch-size", "4")
    report = audit_cache(str(out), samples=24, device="cpu")
    assert report.ok, report.problems
    assert all(entry["max_error"] == 0 for entry in report.keys.values())


def test_a_cache_from_before_sorted_batches_resumes_with_batching_ordered(tiny_models, tmp_path, capsys):
    out = tmp_path / "old"
    _precompute(tiny_models, out, "--batch-size", "4", "--batching", "ordered")
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("batching", "max_batch_tokens"):  # as a manifest written before the option has it
        del manifest["config"][key]
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "shard-000002.safetensors").unlink()
    argv = ["--batch-size", "4", "--resume"]
    with pytest.raises(AssertionError):  # the new default batches otherwise: refused, naming the field
        _precompute(tiny_models, out, *argv)
    assert "config.batching: cache has 'ordered', this run has 'sorted'" in capsys.readouterr().err
    _precompute(tiny_models, out, *argv, "--batching", "ordered")
    assert json.loads((out / "manifest.json").read_text())["complete"] is True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_batching_benchmark_reports_each_setting_in_its_own_section(tmp_path):
    doc, work = tmp_path / "benchmarks.md", tmp_path / "work"
    doc.write_text("# Benchmarks\n\nkept\n")
    cmd = [sys.executable, str(BENCH), "--samples", "16", "--mean", "64", "--max-length", "256", "--budgets", "512",
           "--targets", "tiny", "--no-demo", "--work-dir", str(work), "--out", str(doc)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n\n<!-- batching-benchmark:begin -->")
    rows = {line.split(" | ")[2]: line.split(" | ") for line in text.splitlines() if line.startswith("| tiny |")}
    ordered, sorted_, budget = (rows[f"`{s}`"] for s in ("--batching ordered --batch-size 8",
                                "--batching sorted --batch-size 8", "--max-batch-tokens 512"))  # fmt: skip
    assert 1 <= float(sorted_[4]) < float(ordered[4]) and 1 <= float(budget[4])  # computed / real tokens
    assert sorted_[8].startswith("equal: ") and budget[8].startswith("equal: ")  # the caches were compared
    assert sorted(os.listdir(work)) == ["long-tailed.jsonl", "tiny"]  # the caches are removed, the target kept
