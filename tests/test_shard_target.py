"""``--shard-target fsdp`` and ``tp`` under torchrun (Gloo on CPU): the target is sharded over the ranks.

fsdp: every rank builds the target on the meta device, wraps it with FSDP2 and reads only its own rows of each
checkpoint tensor; the forward is a collective, so a rank with fewer (or no) shards joins it with dummy steps.
Shards and the side file must equal a one-process run's byte for byte; the manifest differs only in the
informational ``stats.parallel`` record.

tp: transformers splits every layer over groups of ``--tp-size`` ranks; each group computes its block of shards
and its first rank writes. The sums inside a layer are reduced in another order, so features agree with the
one-process cache within a relative error of 1e-5 (fp32), and byte for byte with any other run of the same
``--tp-size`` (one group or several, an idle group included).

A run killed mid-way resumes under another mode and world size.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import speccache.engines._hf_load as target_module
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.engines.hf import check_shard_target
from speccache.read.verify import verify_cache
from speccache.write import LocalComm, data_parallel_groups
from support.cachecmp import max_relative_error
from support.ranks import rank_env

# 6 samples in shards of 4 (4 + 2): over 2 ranks the second rank has one step to the first's two (a dummy step),
# over 3 ranks the third owns no shard and runs only dummy steps; --draft-vocab-size makes the LM head run too.
ARGS = ["--limit", "6", "--max-length", "48", "--batch-size", "2", "--shard-size", "4", "--draft-vocab-size", "300"]
ARGS += ["--device", "cpu", "--quiet"]


def _precompute(model: str, out: Path, dtype: str, nproc: int, *extra: str, **env: str) -> int:
    module = (
        ["-m", "speccache"] if "SPECCACHE_FAULT" not in env else ["-m", "speccache.testing.faults", "speccache.cli"]
    )
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        extra = (*extra, "--timeout", "60")
    cmd = [*launcher, *module, "precompute", "--model", model, "--data", demo_data_path("sharegpt"), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *ARGS, "--dtype", dtype, *extra], env=rank_env(**env), timeout=240, capture_output=True
    )
    if proc.returncode and "SPECCACHE_FAULT" not in env:
        raise AssertionError(proc.stderr.decode()[-4000:])
    return proc.returncode


def _without_parallel(manifest: bytes) -> dict:
    body = json.loads(manifest)
    body.get("stats", {}).pop("parallel", None)
    body.pop("producer")  # each run's own command line
    return body


def _names(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))


def _assert_same_cache(got: Path, want: Path) -> None:
    assert _names(got) == _names(want)
    for name in _names(want):
        if name == "manifest.json":
            assert _without_parallel((got / name).read_bytes()) == _without_parallel((want / name).read_bytes())
        else:
            assert (got / name).read_bytes() == (want / name).read_bytes(), name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("models") / "llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reference")
    out = {dtype: root / dtype for dtype in ("fp32", "bf16")}
    for dtype, path in out.items():
        _precompute(model_dir, path, dtype, 1)
    return out


@pytest.mark.torchrun
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,dtype", [(2, "fp32"), (3, "bf16")])
def test_fsdp_cache_equals_one_process_cache(model_dir, reference, tmp_path, nproc, dtype) -> None:
    out = tmp_path / "fsdp"
    _precompute(model_dir, out, dtype, nproc, "--shard-target", "fsdp")
    _assert_same_cache(out, reference[dtype])
    parallel = json.loads((out / "manifest.json").read_text())["stats"]["parallel"]
    assert parallel == {"shard_target": "fsdp", "world_size": nproc}


@pytest.mark.torchrun
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_killed_sharded_run_resumes_in_one_replicated_process(model_dir, reference, tmp_path, mode) -> None:
    out = tmp_path / "cache"
    # The writing rank's second safetensors write (the side file, then shard 0) is killed half-way; the others
    # then fail.
    code = _precompute(model_dir, out, "fp32", 2, "--shard-target", mode, SPECCACHE_FAULT="mid_shard_write:2")
    assert code != 0
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    _precompute(model_dir, out, "fp32", 1, "--resume")
    assert verify_cache(str(out)).ok
    _assert_same_cache(out, reference["fp32"])
    assert "parallel" not in json.loads((out / "manifest.json").read_text())["stats"]


def test_fsdp_outside_torchrun_is_refused_before_loading(model_dir, tmp_path, capsys) -> None:
    from speccache.cli import main

    args = ["precompute", "--model", model_dir, "--data", demo_data_path("sharegpt"), "--out", str(tmp_path / "c")]
    assert main([*args, *ARGS, "--shard-target", "fsdp"]) == 2
    assert "--shard-target fsdp runs under torchrun" in capsys.readouterr().err


def test_unknown_shard_target_is_refused() -> None:
    with pytest.raises(ValueError, match="--shard-target 'ep' is unknown; choose one of replicate, fsdp, tp"):
        check_shard_target("ep")


# ---------------------------------------------------------------------------
# a mixture of experts: the checkpoint holds one tensor per expert, transformers fuses them into one parameter


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    model = build_tiny_model_dir(str(root / "qwen3_moe"), "qwen3_moe", seed=3)
    _precompute(model, root / "reference", "fp32", 1)
    return model, root / "reference"


@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_fsdp_moe_cache_equals_one_process_cache(moe, tmp_path) -> None:
    # 8 experts over 3 ranks (3, 3, 2): each rank reads and holds only its own experts of each layer
    model, reference = moe
    _precompute(model, tmp_path / "fsdp", "fp32", 3, "--shard-target", "fsdp")
    _assert_same_cache(tmp_path / "fsdp", reference)


@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_tp_moe_cache_agrees_with_one_process_cache(moe, tmp_path) -> None:
    model, reference = moe
    _precompute(model, tmp_path / "tp", "fp32", 2, "--shard-target", "tp")
    assert max_relative_error(tmp_path / "tp", reference) <= 1e-5


def test_fused_experts_are_read_one_rank_share_at_a_time(tmp_path, monkeypatch) -> None:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = build_tiny_model_dir(str(tmp_path / "qwen3_moe"), "qwen3_moe", seed=3)
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    checkpoint = target_module.Checkpoint(model_dir)
    readers = target_module.parameter_readers(meta, checkpoint)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    full = readers[name](None)
    read: list[str] = []
    original = checkpoint.read
    monkeypatch.setattr(checkpoint, "read", lambda key, rows=None: read.append(key) or original(key, rows))
    share = readers[name](slice(3, 6))
    assert torch.equal(share, full[3:6])
    assert sorted(read) == sorted(
        f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in (3, 4, 5) for p in ("gate_proj", "up_proj")
    )
    # the fused layout: gate rows, then up rows, of each expert
    assert torch.equal(
        full[4],
        torch.cat(
            [
                original("model.layers.1.mlp.experts.4.gate_proj.weight"),
                original("model.layers.1.mlp.experts.4.up_proj.weight"),
            ]
        ),
    )


# ---------------------------------------------------------------------------
# tp


@pytest.fixture(scope="module")
def tp_cache(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp") / "cache"
    _precompute(model_dir, out, "fp32", 2, "--shard-target", "tp")
    return out


@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_tp_cache_agrees_with_one_process_cache(tp_cache, reference) -> None:
    want = reference["fp32"]
    assert max_relative_error(tp_cache, want) <= 1e-5
    # the side file is read from the checkpoint, not gathered from the sharded model: exactly the same bytes
    assert (tp_cache / "eagle3_side.safetensors").read_bytes() == (want / "eagle3_side.safetensors").read_bytes()
    got, ref = (json.loads((c / "manifest.json").read_text()) for c in (tp_cache, want))
    assert got["config"] == ref["config"] and got["num_samples"] == ref["num_samples"]
    assert got["stats"]["parallel"] == {"shard_target": "tp", "world_size": 2, "tp_size": 2}
    assert verify_cache(str(tp_cache)).ok


@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_tp_groups_of_two_over_four_ranks_write_the_one_group_cache(model_dir, tp_cache, tmp_path) -> None:
    # 2 groups of 2: group 0 writes shard 0 (2 steps), group 1 shard 1 (1 step), with no collective between them.
    out = tmp_path / "tp4"
    _precompute(model_dir, out, "fp32", 4, "--shard-target", "tp", "--tp-size", "2")
    _assert_same_cache(out, tp_cache)
    parallel = json.loads((out / "manifest.json").read_text())["stats"]["parallel"]
    assert parallel == {"shard_target": "tp", "world_size": 4, "tp_size": 2}


@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_tp_group_without_shards_finishes(model_dir, tp_cache, tmp_path) -> None:
    # 4 samples make one shard: the second group owns none and never runs a forward.
    out = tmp_path / "idle"
    _precompute(model_dir, out, "fp32", 4, "--shard-target", "tp", "--tp-size", "2", "--limit", "4")
    assert _names(out) == ["eagle3_side.safetensors", "manifest.json", "shard-000000.safetensors"]
    # The same 4 samples as the 6-sample cache's shard 0, computed by the same split of the layers: the same
    # features (the draft vocabulary, chosen from the counts of all samples, differs).
    got, want = load_file(out / "shard-000000.safetensors"), load_file(tp_cache / "shard-000000.safetensors")
    for key in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"):
        assert torch.equal(got[key], want[key]), key
    assert verify_cache(str(out)).ok


@pytest.mark.torchrun
@pytest.mark.timeout(300)
def test_writer_refusal_fails_every_rank_of_its_group(model_dir, tp_cache, tmp_path) -> None:
    # Only a group's first rank checks the directory; the other rank must fail with the same error, not wait.
    out = tmp_path / "existing"
    shutil.copytree(tp_cache, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "speccache"]
    cmd += ["precompute", "--model", model_dir, "--data", demo_data_path("sharegpt"), "--out", str(out), *ARGS]
    cmd += ["--dtype", "fp32", "--shard-target", "tp", "--timeout", "60"]
    proc = subprocess.run(cmd, env=rank_env(), timeout=240, capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.count("already holds a cache") == 2, proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.torchrun
@pytest.mark.timeout(300)
def test_architecture_without_tp_plan_is_refused_before_loading(model_dir, tmp_path) -> None:
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"  # the tiny model's tokenizer with a GPT-2 config: refused before any weight is read
    gpt2.mkdir()
    for tokenizer_file in Path(model_dir).glob("*token*"):
        (gpt2 / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1024).save_pretrained(gpt2)
    out = tmp_path / "c"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "speccache"]
    cmd += ["precompute", "--model", str(gpt2), "--data", demo_data_path("sharegpt"), "--out", str(out), *ARGS]
    proc = subprocess.run([*cmd, "--shard-target", "tp"], env=rank_env(), timeout=240, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "no tensor-parallel plan for the 'gpt2' architecture; shard it with --shard-target fsdp" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "mode,tp_size,world,message",
    [
        ("fsdp", 2, None, "--tp-size is for --shard-target tp"),
        ("tp", 1, None, "--tp-size must be >= 2"),
        ("tp", None, 1, "--shard-target tp runs under torchrun"),
    ],
)
def test_tp_flags_are_checked(mode, tp_size, world, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_shard_target(mode, tp_size, world)


def test_tp_size_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match=r"--tp-size 2 must divide the number of ranks \(1\)"):
        data_parallel_groups(LocalComm(), 2)
