"""``speccache audit``: agrees on fresh caches, disagrees when the weights, aux layers, storage dtype, model dtype
or chat template differ from what the cache records; exit 2 on bad usage."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.format import load_manifest_json, manifest_path
from speccache.format.manifest import write_manifest_file
from speccache.methods.eagle3 import build_eagle3_dataloader
from speccache.precompute.audit import audit_cache
from speccache.read.view import make_merge_view

DATA = demo_data_path("sharegpt")
COMMON = ["--data", DATA, "--limit", "6", "--max-length", "96", "--model-dtype", "fp32", "--batch-size", "2",
          "--shard-size", "2", "--quiet"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    base = tmp_path_factory.mktemp("audit")
    model = build_tiny_model_dir(str(base / "model"), "llama", seed=0)
    out = {"model": model, "base": str(base)}
    for name, extra in {
        "fp32": ["--dtype", "fp32", "--aux-layers", "1,3,4"],
        "bf16": ["--dtype", "bf16", "--encode", "aux_hidden_states=fp8", "--draft-vocab-size", "300"],
        "topk": ["--dtype", "fp32", "--supervision", "topk:4"],
    }.items():
        out[name] = str(base / name)
        assert main(["precompute", "--model", model, "--out", out[name], *COMMON, *extra]) == 0
    return out


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(cache: str, dst: str, **changes) -> str:
    shutil.copytree(cache, dst)
    body = load_manifest_json(manifest_path(dst))
    body["config"].update(changes)
    write_manifest_file(dst, body)
    return dst


@pytest.mark.parametrize("name", ["fp32", "bf16", "topk"])
def test_fresh_cache_agrees(caches, name, capsys):
    assert main(["audit", caches[name], "--samples", "4", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "aux_hidden_states" in out and "agrees" in out
    report = audit_cache(caches[name], samples=100)
    assert report.ok and report.samples == list(range(6))
    # each sample is recomputed in its own precompute batch (--batch-size 2) on the same device: the very forward,
    # so every key stored without a lossy encoding agrees exactly
    lossy = load_manifest_json(manifest_path(caches[name]))["config"]["encodings"]
    assert {k: e["max_error"] for k, e in report.keys.items() if k not in lossy} == dict.fromkeys(
        [k for k in report.keys if k not in lossy], 0.0
    )


def test_changed_weights_disagree(caches, capsys):
    other = _copy(caches["model"], os.path.join(caches["base"], "weights"))
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(1.05)  # a subtly different checkpoint, same config
    model.save_pretrained(other)
    assert main(["audit", caches["fp32"], "--model", other, "--samples", "2"]) == 1
    out = capsys.readouterr().out
    assert "DISAGREE sample" in out and "aux_hidden_states differs from the live forward" in out
    assert "last_hidden_state" in out


def test_changed_model_dtype_disagrees(caches):
    other = _copy(caches["model"], os.path.join(caches["base"], "bf16-weights"))
    AutoModelForCausalLM.from_pretrained(other, dtype=torch.bfloat16).save_pretrained(other)
    report = audit_cache(caches["fp32"], other)  # run in the recorded fp32, from weights rounded to bf16
    assert any("model config differs" in p for p in report.problems)
    assert any("aux_hidden_states differs" in p for p in report.problems)
    assert any("lm_head differs from the live model's weights" in p for p in report.problems)


def test_mixed_up_aux_layers_disagree(caches):
    wrong = _edit_config(caches["fp32"], os.path.join(caches["base"], "layers"), aux_layers=[1, 3, 5])
    report = audit_cache(wrong, samples=2)
    assert [p for p in report.problems if "aux_hidden_states differs" in p]
    assert not [p for p in report.problems if "last_hidden_state" in p]  # only the mixed-up key


def test_storage_dtype_other_than_recorded_disagrees(caches):
    wrong = _edit_config(caches["bf16"], os.path.join(caches["base"], "dtype"), dtype="fp32")
    report = audit_cache(wrong, samples=2)
    assert any("last_hidden_state differs" in p for p in report.problems)


def test_changed_chat_template_disagrees(caches):
    other = _copy(caches["model"], os.path.join(caches["base"], "template"))
    path = os.path.join(other, "chat_template.jinja")
    with open(path) as f:
        template = f.read()
    assert "<|assistant|>" in template
    with open(path, "w") as f:
        f.write(template.replace("<|assistant|>", "<|assistant|> "))
    report = audit_cache(caches["fp32"], other, samples=1)
    assert any("tokenizer or chat template differs" in p for p in report.problems)


def test_bad_usage_exits_2(caches, tmp_path, capsys):
    assert main(["audit", str(tmp_path / "missing")]) == 2
    assert main(["audit", caches["fp32"], "--samples", "0"]) == 2
    assert main(["audit", caches["fp32"], "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--samples must be >= 1" in err and "no such model directory" in err


def test_views_of_eagle3_caches_audit_and_train(caches, tmp_path):
    small = str(tmp_path / "small")  # the same target and settings over fewer rows: only the data differs
    args = [
        "precompute",
        "--model",
        caches["model"],
        "--out",
        small,
        *COMMON,
        "--dtype",
        "fp32",
        "--aux-layers",
        "1,3,4",
    ]
    assert main([*args, "--limit", "4"]) == 0
    view = str(tmp_path / "merged")
    make_merge_view([caches["fp32"], small], view, weights=[2, 1])
    report = audit_cache(view, samples=100)
    assert report.ok and report.samples == list(range(10))
    loader = build_eagle3_dataloader(view, batch_size=4, shuffle=True)
    assert sum(int(b["lengths"].numel()) for b in loader) == 2 * 6 + 4  # --weights 2,1: the first cache twice
    subset = str(tmp_path / "subset")
    assert main(["subset", caches["fp32"], "--out", subset, "--where", "supervised_tokens >= 20"]) == 0
    assert audit_cache(subset, samples=100).ok


def _broken_copy(caches, name: str, edit) -> str:
    other = _copy(caches["model"], os.path.join(caches["base"], name))
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    with torch.no_grad():
        edit(model)
    model.save_pretrained(other)
    return other


def test_nonfinite_live_forward_is_a_finding_naming_the_weights(caches, capsys):
    other = _broken_copy(
        caches, "nan-layer", lambda m: m.model.layers[2].mlp.down_proj.weight[0, 0].fill_(float("nan"))
    )
    assert main(["audit", caches["fp32"], "--model", other, "--samples", "2"]) == 1  # a finding, not bad usage
    out, err = capsys.readouterr()
    assert "error:" not in err and "Traceback" not in err
    lines = [line for line in out.splitlines() if line.startswith("DISAGREE")]
    assert len(lines) == 2 and all("the target's live forward is not finite" in line for line in lines)
    assert "model.layers.2.mlp.down_proj.weight hold NaN or Inf" in out and "check the model weights" in out
    assert "--nonfinite" not in out and "differs from the live" not in out  # neither precompute's advice nor a key


def test_nonfinite_embedding_rows_are_named_as_such(caches):
    # <unk> (row 0): byte-level BPE never emits it, so only the weight rows show the damage, not the forward
    other = _broken_copy(caches, "nan-embed", lambda m: m.model.embed_tokens.weight[0].fill_(float("nan")))
    report = audit_cache(caches["fp32"], other, samples=1)
    side = os.path.join(caches["fp32"], "eagle3_side.safetensors")
    assert report.problems == [
        f"{side}: embed_tokens holds NaN or Inf in 1 of 1024 rows of the live model's weights (first: row 0); "
        "the model directory's weights are broken"
    ]


def test_appended_cache_is_recomputed_in_its_own_batches(caches, tmp_path):
    out = str(tmp_path / "appended")
    args = ["precompute", "--model", caches["model"], "--out", out, *COMMON, "--dtype", "fp32", "--aux-layers", "1,3,4"]
    assert main([*args, "--limit", "3"]) == 0  # a short last batch [2, 3), recomputed as [2, 4) by the append
    assert main([*args, "--data", demo_data_path("openai"), "--limit", "3", "--append"]) == 0
    report = audit_cache(out, samples=100)
    assert report.ok and report.samples == list(range(6))
    assert {e["max_error"] for e in report.keys.values()} == {0.0}
