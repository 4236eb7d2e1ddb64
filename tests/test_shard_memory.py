"""Memory per rank: ``--shard-target fsdp`` and ``tp`` hold their share of the target, ``replicate`` all of it.

Runs ``benchmarks/shard_memory.py`` (torchrun worlds of Gloo ranks on the CPU): each rank loads the target
through ``load_target`` and runs forwards while a thread samples its anonymous memory (``RssAnon``); the fixed
overhead is the same run's peak on the tiny demo model. The bound asserted is ``overhead + M / W + 3 U`` (M the
model's bytes, U its largest FSDP unit; see docs/distributed.md, docs/benchmarks.md), on the 514 MB target of
narrow layers and on a small target of wide ones, whose freed gathers glibc would otherwise keep.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speccache.demo import build_tiny_model_dir

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "shard_memory.py"


@pytest.mark.torchrun
@pytest.mark.timeout(900)
def test_sharded_ranks_hold_their_share_of_the_model(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH), "--targets", "narrow", "--world", "2", "--modes", "replicate", "fsdp", "tp"]
    cmd += ["--model-dir", str(tmp_path / "model"), "--tiny-dir", str(tmp_path / "tiny")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in (json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"target"'))}
    fsdp, replicate, tp = rows["fsdp"], rows["replicate"], rows["tp"]
    model, unit = fsdp["model_mb"], fsdp["unit_mb"]
    assert model >= 400
    # Sharded over 2 ranks: half the model plus three units. (A replicated rank's weights are views of the
    # memory-mapped checkpoint, file pages that RssAnon leaves out, as are the slices tp keeps as views.)
    assert fsdp["bound_mb"] == pytest.approx(fsdp["overhead_mb"] + model / 2 + 3 * unit)
    assert fsdp["peak_mb"] <= fsdp["bound_mb"], fsdp
    assert tp["peak_mb"] <= tp["bound_mb"], tp
    # Each rank holds its part of the parameter bytes (tp: norms replicated, a fraction of a percent more).
    assert replicate["weights_mb"] == pytest.approx(model)
    assert fsdp["weights_mb"] == pytest.approx(model / 2, rel=0.01)
    assert model / 2 <= tp["weights_mb"] <= 1.01 * model / 2


def _bench():
    spec = importlib.util.spec_from_file_location("shard_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Wide layers on a small target: 2 layers of 26 MiB, each MLP weight an 8 MiB block (4 MiB per rank), the sizes
# glibc's dynamic mmap threshold serves from a heap it keeps; 61 MiB in all, so that both torchrun worlds are short.
SMALL_WIDE = dict(
    hidden_size=512,
    intermediate_size=4096,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@pytest.mark.torchrun
@pytest.mark.timeout(300)
def test_fsdp_rank_on_wide_layers_holds_its_share_plus_three_units(tmp_path: Path) -> None:
    bench = _bench()
    model = bench.build_model_dir(str(tmp_path / "wide"), SMALL_WIDE)
    tiny = build_tiny_model_dir(str(tmp_path / "tiny"), "llama", seed=0)
    (fsdp,) = bench.run("small wide", model, tiny, [2], ["fsdp"])
    assert fsdp["unit_mb"] >= 20 and fsdp["model_mb"] <= 80  # wide layers: a unit is a third of the model
    # overhead + M / W + 3 U: the freed gathers of one forward after another are given back, not kept
    assert fsdp["peak_mb"] <= fsdp["bound_mb"], fsdp
