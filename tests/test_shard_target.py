"""``--shard-target fsdp`` under torchrun (Gloo on CPU): the target is sharded, the cache is the one-process cache.

Every rank builds the target on the meta device, wraps it with FSDP2 and reads only its own rows of each
checkpoint tensor; the forward is a collective, so a rank with fewer (or no) shards joins it with dummy steps.
Shards and the side file must equal a one-process run's byte for byte; the manifest differs only in the
informational ``stats.parallel`` record. A run killed mid-way resumes under another mode and world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.precompute.target import check_shard_target
from speccache.read.verify import verify_cache

# 6 samples in shards of 4 (4 + 2): over 2 ranks the second rank has one step to the first's two (a dummy step),
# over 3 ranks the third owns no shard and runs only dummy steps; --draft-vocab-size makes the LM head run too.
ARGS = ["--limit", "6", "--max-length", "48", "--batch-size", "2", "--shard-size", "4", "--draft-vocab-size", "300"]
ARGS += ["--device", "cpu", "--quiet"]


def _env(**extra: str) -> dict[str, str]:
    # One thread per process: the same GEMM kernels in the reference and in every rank, so bytes can match.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECCACHE_FAULT", None)
    return {**env, **extra}


def _precompute(model: str, out: Path, dtype: str, nproc: int, *extra: str, **env: str) -> int:
    module = (
        ["-m", "speccache"] if "SPECCACHE_FAULT" not in env else ["-m", "speccache.testing.faults", "speccache.cli"]
    )
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        extra = (*extra, "--timeout", "60")
    cmd = [*launcher, *module, "precompute", "--model", model, "--data", demo_data_path("sharegpt"), "--out", str(out)]
    proc = subprocess.run([*cmd, *ARGS, "--dtype", dtype, *extra], env=_env(**env), timeout=240, capture_output=True)
    if proc.returncode and "SPECCACHE_FAULT" not in env:
        raise AssertionError(proc.stderr.decode()[-4000:])
    return proc.returncode


def _without_parallel(manifest: bytes) -> dict:
    body = json.loads(manifest)
    body.get("stats", {}).pop("parallel", None)
    return body


def _assert_same_cache(got: Path, want: Path) -> None:
    names = sorted(p.name for p in want.iterdir() if not p.name.startswith("."))
    assert sorted(p.name for p in got.iterdir() if not p.name.startswith(".")) == names
    for name in names:
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,dtype", [(2, "fp32"), (3, "bf16")])
def test_fsdp_cache_equals_one_process_cache(model_dir, reference, tmp_path, nproc, dtype) -> None:
    out = tmp_path / "fsdp"
    _precompute(model_dir, out, dtype, nproc, "--shard-target", "fsdp")
    _assert_same_cache(out, reference[dtype])
    parallel = json.loads((out / "manifest.json").read_text())["stats"]["parallel"]
    assert parallel == {"shard_target": "fsdp", "world_size": nproc}


@pytest.mark.timeout(600)
def test_killed_fsdp_run_resumes_in_one_replicated_process(model_dir, reference, tmp_path) -> None:
    out = tmp_path / "cache"
    # Rank 0's second safetensors write (the side file, then shard 0) is killed half-way; rank 1 then fails.
    code = _precompute(model_dir, out, "fp32", 2, "--shard-target", "fsdp", SPECCACHE_FAULT="mid_shard_write:2")
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
    with pytest.raises(ValueError, match="--shard-target 'tp' is unknown; choose one of replicate, fsdp"):
        check_shard_target("tp")
