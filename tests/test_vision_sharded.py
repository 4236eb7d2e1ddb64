"""``--shard-target fsdp`` and ``tp`` on vision-language targets (docs/vision.md, "Sharded targets"): the language
model is sharded (FSDP2 over the ranks, or transformers' tensor-parallel plan), the vision tower and projector are
whole on every rank. Over 2 Gloo ranks, the cache of batches mixing image and text rows equals the one-process
cache: features within 1e-5 (fp32), ids, masks and M-RoPE positions exactly. A plan that splits no decoder layer
(Qwen3-VL's) is refused up front, naming fsdp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from speccache.cli import main
from speccache.demo.real_target import ensure_real_target
from speccache.engines.hf import HfEngine
from speccache.errors import UsageError
from speccache.testing.vlm import FAMILIES, ensure_vlm_target
from support.cachecmp import max_relative_error
from support.ranks import launch, rank_env
from support.vision import write_image_data

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(600)]

AUX = ["--aux-layers", "0,1,2"]  # the tiny targets have 4 decoder layers
FLAGS = [*AUX, "--dtype", "fp32", "--model-dtype", "fp32", "--batch-size", "2", "--shard-size", "2"]
FLAGS += ["--device", "cpu", "--quiet"]
# Shards of two rows (batches of two): over 2 ranks, rank 0 computes shards 0 and 1 (an image row with a text
# row, then two image rows), rank 1 shard 2 (a text row) and then joins rank 0's second forward with a lockstep
# dummy batch (sample 0, an image row): every decoder forward of a sharded target is a collective of all ranks.
ROWS = [
    (["a.png"], "What is red?", "A square."),
    ([], "Tell me a story, a longer one please.", "Once upon a time."),
    (["b.png"], "And this?", "A line."),
    (["a.png", "b.png"], "Compare them.", "Two pictures."),
    ([], "Say hello.", "Hello there."),
]
TP_FAMILIES = ("qwen2_5_vl", "gemma3")  # LLaVA runs the same Llama plan; Qwen3-VL's splits no decoder layer


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_data(tmp_path_factory.mktemp("vision-data"), ROWS) / "data.jsonl"


@pytest.fixture(scope="module")
def reference(offline_single_thread, data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Each family's (target dir, one-process cache)."""
    out = {}
    for family in FAMILIES:
        model = ensure_vlm_target(family, ensure_real_target())
        cache = tmp_path_factory.mktemp(family) / "cache"
        assert main(["precompute", "--model", model, "--data", str(data), "--out", str(cache), *FLAGS]) == 0
        out[family] = (model, cache)
    return out


def _sharded(model: str, data: Path, out: Path, mode: str) -> None:
    proc = launch(
        ["precompute", "--model", model, "--data", str(data), "--out", str(out), *FLAGS, "--shard-target", mode], 2
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "manifest.json").read_text())["stats"]["parallel"]["shard_target"] == mode


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_cache_equals_one_process_cache(family, reference, data, tmp_path) -> None:
    model, want = reference[family]
    _sharded(model, data, tmp_path / "fsdp", "fsdp")
    assert max_relative_error(tmp_path / "fsdp", want) <= 1e-5
    side = "eagle3_side.safetensors"  # read from the checkpoint (its older key layout renamed as transformers does)
    assert (tmp_path / "fsdp" / side).read_bytes() == (want / side).read_bytes()


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp_cache_agrees_with_one_process_cache(family, reference, data, tmp_path) -> None:
    model, want = reference[family]
    _sharded(model, data, tmp_path / "tp", "tp")
    assert max_relative_error(tmp_path / "tp", want) <= 1e-5


def test_tp_on_a_plan_that_splits_no_decoder_layer_is_refused(reference) -> None:
    from transformers import AutoConfig

    model, _ = reference["qwen3_vl"]
    cfg = SimpleNamespace(model=model, shard_target="tp", tp_size=None, prefill_chunk=None)
    with pytest.raises(UsageError, match="splits none of its decoder layers; shard it with --shard-target fsdp"):
        HfEngine.check_model(cfg, AutoConfig.from_pretrained(model), 2)


def test_chunked_prefill_of_a_sharded_target_is_refused(reference) -> None:
    from transformers import AutoConfig

    model, _ = reference["qwen2_5_vl"]
    cfg = SimpleNamespace(model=model, shard_target="fsdp", tp_size=None, prefill_chunk=8)
    with pytest.raises(UsageError, match="in chunks with --shard-target replicate only; leave out --prefill-chunk"):
        HfEngine.check_model(cfg, AutoConfig.from_pretrained(model), 2)


_RANK = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from speccache.engines.hf import load_target

dist.init_process_group("gloo")
model = load_target(sys.argv[1], "fp32", torch.device("cpu"), "fsdp").model
held = {n: [isinstance(p, DTensor), list((p.to_local() if isinstance(p, DTensor) else p).shape)]
        for n, p in model.named_parameters()}
with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(held, f)
dist.destroy_process_group()
"""


def test_fsdp_shards_the_language_model_and_keeps_the_vision_tower_whole(reference, tmp_path) -> None:
    from transformers import AutoModelForImageTextToText

    model, _ = reference["qwen3_vl"]
    (tmp_path / "rank.py").write_text(_RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*cmd, str(tmp_path / "rank.py"), model, str(tmp_path)], env=rank_env(), capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    whole = {n: list(p.shape) for n, p in AutoModelForImageTextToText.from_pretrained(model).named_parameters()}
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held.keys() == whole.keys()
        for name, (sharded, shape) in held.items():
            if name.startswith("model.visual."):  # the vision tower, its merger and deepstack mergers included
                assert not sharded and shape == whole[name], name
            else:  # the language model and the head: each rank holds its half of the rows (rank 0 the odd one)
                rows = whole[name][0]
                assert sharded and shape == [(rows + 1 - rank) // 2, *whole[name][1:]], name
