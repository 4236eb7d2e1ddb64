"""EAGLE-3 precompute under torchrun (Gloo on CPU) writes the one-process cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speccache.demo import build_tiny_model_dir, demo_data_path

ARGS = [
    "--limit",
    "12",
    "--max-length",
    "64",
    "--batch-size",
    "2",
    "--shard-size",
    "2",
    "--draft-vocab-size",
    "300",
    "--dtype",
    "fp32",
    "--device",
    "cpu",
    "--quiet",
]


def _env() -> dict[str, str]:
    # One thread per process: the same GEMM kernels in the reference and in every rank, so bytes can match.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _files(cache: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(cache.iterdir()) if not p.name.startswith(".")}
    manifest = json.loads(files["manifest.json"])
    del manifest["producer"]  # each run's own command line
    return {**files, "manifest.json": json.dumps(manifest, sort_keys=True).encode()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("models") / "llama"), "llama", seed=3)


@pytest.mark.torchrun
@pytest.mark.timeout(420)
def test_torchrun_eagle3_equals_one_process_cache(model_dir: str, tmp_path: Path) -> None:
    data = demo_data_path("sharegpt")
    single, multi = tmp_path / "single", tmp_path / "multi"
    base = [sys.executable, "-m", "speccache", "precompute", "--model", model_dir, "--data", data]
    subprocess.run([*base, "--out", str(single), *ARGS], check=True, env=_env(), timeout=300)
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "3",
        "-m",
        "speccache",
    ]
    subprocess.run(
        [*launcher, "precompute", "--model", model_dir, "--data", data, "--out", str(multi), *ARGS, "--timeout", "120"],
        check=True,
        env=_env(),
        timeout=300,
    )
    # 12 samples in shards of 2 over 3 ranks; the draft vocabulary (side file) is counted per rank and summed.
    assert _files(multi) == _files(single)
