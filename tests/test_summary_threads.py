"""The closing summary line of ``speccache precompute`` and its ``--threads`` flag.

* bytes per token is shown both for the shards alone and for everything the total counts (the side files too);
* the padded full-probability comparison pads to the longest cached sample (not ``--max-length``) and says so;
  an append recomputes it over the whole cache; a manifest without the field falls back to ``--max-length``;
* ``--threads N`` sets torch's threads, and more threads than the CPUs the process may use, or a busy machine,
  gets a warning that names the fix.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.engines.hf import cpu_thread_advice
from speccache.format import Manifest
from speccache.methods.eagle3 import Eagle3CacheDataset
from speccache.precompute import summary_line
from speccache.units import human_bytes

pytestmark = pytest.mark.usefixtures("offline_single_thread")

DATA = demo_data_path("sharegpt")
COMMON = ["--model-dtype", "fp32", "--dtype", "bf16", "--batch-size", "4", "--shard-size", "8",
          "--draft-vocab-size", "300", "--threads", "1"]  # fmt: skip
HIDDEN, DRAFT, ITEMSIZE = 64, 300, 2  # the tiny llama's width, the draft vocabulary, bf16


def _per_token() -> int:
    """Bytes per token of the padded full-probability layout: three aux states, the probabilities, two ids."""
    return (3 * HIDDEN + DRAFT) * ITEMSIZE + 8 + 1


def _longest(cache: str) -> int:
    ds = Eagle3CacheDataset(cache, keys=["input_ids"])
    return max(ds[i]["input_ids"].numel() for i in range(len(ds)))


def test_summary_counts_the_side_file_and_pads_to_the_longest_sample(tiny_models, tmp_path, capsys):
    out = str(tmp_path / "c")
    assert main(["precompute", "--model", tiny_models("llama"), "--data", DATA, "--out", out, "--limit", "12",
                 *COMMON]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()[-1]
    manifest = Manifest.read(out)
    shards, tokens = manifest.total_bytes, manifest.num_tokens
    side = sum(r.bytes for r in manifest.side_files.values())
    assert f"{human_bytes(shards + side)} in all ({(shards + side) / tokens:.0f} bytes/token: shards" in line
    assert f"shards {human_bytes(shards)}, {shards / tokens:.0f} bytes/token, + side files {human_bytes(side)})" in line
    longest = _longest(out)
    assert longest < 2048 and manifest.stats["longest_sample"] == longest
    padded = manifest.stats["padded_probs_longest_bytes"]
    assert padded == 12 * longest * _per_token()
    assert manifest.stats["padded_probs_bytes"] == 12 * 2048 * _per_token(), "its meaning is kept"
    assert f"(padded to the longest sample, {longest} tokens) would take {human_bytes(padded)}" in line
    assert f"; this cache is {padded / (shards + side):.1f}x smaller than that" in line

    # a cache larger than the padded layout (its side file outweighs a few short samples) says so
    manifest.stats["padded_probs_longest_bytes"] = (shards + side) // 4
    assert "; this cache is 4.0x larger than that" in summary_line(manifest, 1.0)

    # a manifest written before the field existed: the comparison it recorded, named for what it is
    for key in ("longest_sample", "padded_probs_longest_bytes"):
        del manifest.stats[key]
    old = summary_line(manifest, 1.0)
    assert f"(padded to --max-length, 2048 tokens) would take {human_bytes(12 * 2048 * _per_token())}" in old


def test_an_append_pads_every_sample_to_the_longest_of_the_whole_cache(tiny_models, tmp_path, capsys):
    rows = Path(DATA).read_text(encoding="utf-8").splitlines(keepends=True)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(rows[:6]), encoding="utf-8")
    second.write_text("".join(rows[6:16]), encoding="utf-8")
    out, model = str(tmp_path / "c"), tiny_models("llama")
    for data, extra in ((first, []), (second, ["--append"])):
        assert main(["precompute", "--model", model, "--data", str(data), "--out", out, *COMMON, *extra]) == 0
    stats = Manifest.read(out).stats
    assert stats["samples"] == 16 and stats["longest_sample"] == _longest(out)
    assert stats["padded_probs_longest_bytes"] == 16 * _longest(out) * _per_token()
    assert f"padded to the longest sample, {_longest(out)} tokens" in capsys.readouterr().out


def test_threads_sets_torchs_threads_and_warns_past_the_affinity(tiny_models, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    out = str(tmp_path / "c")
    args = ["precompute", "--model", tiny_models("llama"), "--data", DATA, "--out", out, "--limit", "4", "--quiet"]
    with caplog.at_level(logging.WARNING, logger="speccache.engines.hf"):
        assert main([*args, *COMMON, "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    assert "torch runs 2 threads but this process may use only 1 CPUs" in caplog.text
    assert "pass --threads 1" in caplog.text


def test_thread_advice_on_a_busy_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    assert "the machine is busy (load 3.5 on 2 CPUs)" in cpu_thread_advice(2)
    assert cpu_thread_advice(1) is None, "one thread contends with no one"
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    assert cpu_thread_advice(2) is None and "only 2 CPUs" in cpu_thread_advice(3)


def test_threads_must_be_positive(tiny_models, tmp_path, capsys):
    args = ["precompute", "--model", tiny_models("llama"), "--data", DATA, "--out", str(tmp_path / "c")]
    assert main([*args, *COMMON, "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")


def test_threads_is_refused_for_the_vllm_engine(tiny_models, tmp_path, capsys):
    # vLLM's workers run the target, so this process's torch threads would change nothing
    args = ["precompute", "--model", tiny_models("llama"), "--data", DATA, "--out", str(tmp_path / "c")]
    assert main([*args, "--engine", "vllm", "--threads", "1"]) == 2
    assert "--threads is the hf engine's" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")
