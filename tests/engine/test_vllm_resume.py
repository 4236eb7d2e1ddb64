"""A --engine vllm run killed mid-way resumes: the finished cache verifies and matches --engine hf within 1e-4
(vLLM composes its own batches, so a resumed cache agrees within tolerance, not byte for byte)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from enginelib import assert_caches_close, require_vllm

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.format import Manifest
from speccache.read import verify_cache

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")

FLAGS = ["--limit", "12", "--max-length", "96", "--batch-size", "2", "--shard-size", "2", "--dtype", "fp32",
         "--model-dtype", "fp32", "--aux-layers", "0,1,2", "--quiet"]  # fmt: skip


def test_a_killed_vllm_run_resumes(vllm_models, tmp_path):
    model = vllm_models("llama")
    argv = ["precompute", "--model", model, "--data", demo_data_path("sharegpt"), *FLAGS]
    hf, out = str(tmp_path / "hf"), str(tmp_path / "vllm")
    assert main([*argv, "--out", hf]) == 0
    env = {**os.environ, "SPECCACHE_FAULT": "mid_shard_write:3", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-m", "speccache.testing.faults", "speccache.cli", *argv, "--out", out, "--engine", "vllm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not Manifest.read(out).complete
    assert any(name.startswith("shard-") for name in os.listdir(out))  # killed after some shards
    assert main([*argv, "--out", out, "--engine", "vllm", "--resume"]) == 0
    assert verify_cache(out).ok
    assert_caches_close(hf, out)
