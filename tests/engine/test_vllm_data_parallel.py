"""--engine vllm under torchrun, 2 ranks, an engine each (data parallel): the cache equals a 1-rank vllm run's
(token ids and masks; features within 1e-4, fp32), the manifest records the parallel settings, and a run whose
ranks are killed mid-way leaves no vLLM process behind and resumes.

Each rank's engine core runs in a process of its own, bound to one of this machine's two cores
(``VLLM_CPU_OMP_THREADS_BIND``, set per rank by ``rank_environment``); a torchrun run takes about 2 minutes here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from enginelib import assert_caches_close, engine_record, require_vllm

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.format import Manifest
from speccache.read import verify_cache

require_vllm()

pytestmark = [pytest.mark.usefixtures("offline_single_thread"), pytest.mark.torchrun]  # runs is a torchrun run

FLAGS = ["--limit", "12", "--max-length", "96", "--batch-size", "2", "--shard-size", "2", "--dtype", "fp32",
         "--model-dtype", "fp32", "--aux-layers", "0,1,2", "--engine", "vllm", "--quiet"]  # fmt: skip
MARK = "SPECCACHE_TEST_RUN"  # inherited by every process a run starts, vLLM's included


def _argv(model: str, out: str) -> list[str]:
    return ["precompute", "--model", model, "--data", demo_data_path("sharegpt"), "--out", out, *FLAGS]


def _torchrun(module: list[str], argv: list[str], **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Two ranks of ``python -m MODULE ARGV`` under torchrun; returns the result and the run's mark."""
    mark = uuid.uuid4().hex
    environ = {**os.environ, MARK: mark, "OMP_NUM_THREADS": "1", **env}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        *module,
        *argv,
    ]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=900), mark


def _processes_marked(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"{MARK}={mark}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.fixture(scope="module")
def runs(vllm_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("dp")
    model = vllm_models("llama")
    one, dp = str(base / "one"), str(base / "dp")
    assert main(_argv(model, one)) == 0
    done, _ = _torchrun(["speccache"], _argv(model, dp))
    assert done.returncode == 0, done.stderr[-4000:]
    return model, one, dp, base


def test_two_ranks_write_the_one_rank_cache(runs):
    _, one, dp, _ = runs
    assert verify_cache(dp).ok
    assert_caches_close(one, dp)


def test_manifest_records_the_parallel_settings(runs):
    _, one, dp, _ = runs
    record = engine_record(dp)
    assert record["data_parallel_size"] == 2 and record["tensor_parallel_size"] == 1
    assert record["enable_expert_parallel"] is False
    assert engine_record(one)["data_parallel_size"] == 1


def test_a_killed_data_parallel_run_leaves_no_vllm_process_and_resumes(runs):
    model, one, _, base = runs
    out = str(base / "killed")
    killed, mark = _torchrun(
        ["speccache.testing.faults", "speccache.cli"], _argv(model, out), SPECCACHE_FAULT="mid_shard_write:3"
    )
    assert killed.returncode != 0, killed.stderr[-4000:]
    assert not Manifest.read(out).complete
    assert any(name.startswith("shard-") and name.endswith(".safetensors") for name in os.listdir(out))
    deadline = time.monotonic() + 30  # the kernel kills the engine cores, then their workers
    while (left := _processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"vLLM processes outlived their killed rank: {left}"
    resumed, _ = _torchrun(["speccache"], [*_argv(model, out), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert verify_cache(out).ok
    assert_caches_close(one, out)
