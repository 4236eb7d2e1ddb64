"""``speccache inspect`` and ``speccache verify`` on synthetic caches: output and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from speccache.cli import main
from speccache.format import manifest_path, shard_path
from speccache.testing.synthetic import write_synthetic_cache

NUM_SAMPLES, SHARD_SIZE, HIDDEN = 12, 4, 8


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "cache")
    manifest = write_synthetic_cache(
        path, num_samples=NUM_SAMPLES, shard_size=SHARD_SIZE, hidden=HIDDEN, max_len=10, overlap=False
    )
    return path, manifest.to_json()


@pytest.fixture
def cache(pristine, tmp_path):
    path = str(tmp_path / "cache")
    shutil.copytree(pristine[0], path)
    return path


def run_main(argv: list[str]) -> int:
    """Exit code of the in-process CLI, whether it returns it or exits with it (argparse does)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x10]))


# ---------------------------------------------------------------------------
# sound caches


def test_inspect_json_describes_the_cache(pristine, capsys):
    path, manifest = pristine
    assert run_main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cache_name"] == "synthetic" and info["complete"] is True
    assert info["num_samples"] == NUM_SAMPLES and info["shard_size"] == SHARD_SIZE and info["num_shards"] == 3
    assert info["num_tokens"] == manifest["num_tokens"]
    assert set(info["keys"]) == {"input_ids", "loss_mask", "hidden", "sample_id"}
    assert info["keys"]["hidden"]["dtype"] == "bfloat16" and info["keys"]["hidden"]["shape"] == [HIDDEN]
    assert info["keys"]["hidden"]["bytes"] == manifest["num_tokens"] * HIDDEN * 2
    assert info["shard_bytes"] == manifest["total_bytes"]


def test_inspect_prints_a_table(pristine, capsys):
    path, _ = pristine
    assert run_main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "synthetic" in out and "hidden" in out and "bfloat16" in out and f"{NUM_SAMPLES} in 3 shards" in out


def test_verify_a_sound_cache_exits_zero(pristine, capsys):
    path, _ = pristine
    assert run_main(["verify", path]) == 0
    out = capsys.readouterr().out
    assert "sound" in out and "3 shards checked" in out
    for i in range(3):
        assert os.path.basename(shard_path(path, i)) in out


def test_verify_json_of_a_sound_cache(pristine, capsys):
    path, manifest = pristine
    assert run_main(["verify", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["problems"] == []
    assert [s["xxh3_128"] for s in report["shards"]] == [row["xxh3_128"] for row in manifest["shards"]]


# ---------------------------------------------------------------------------
# damaged caches


def test_verify_a_flipped_byte_exits_one_naming_the_shard(cache, capsys):
    flip_last_byte(shard_path(cache, 1))
    assert run_main(["verify", cache]) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problems and all("shard-000001.safetensors" in line for line in problems)
    assert "1 problem" in out or "problem(s)" in out


def test_verify_json_of_a_damaged_cache_by_subprocess(cache):
    # The one run through `python -m speccache` (a new interpreter costs seconds); the rest call main().
    os.truncate(shard_path(cache, 2), os.path.getsize(shard_path(cache, 2)) - 3)
    proc = subprocess.run(
        [sys.executable, "-m", "speccache", "verify", cache, "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert {p["file"] for p in report["problems"]} == {"shard-000002.safetensors"}
    assert "truncated" in report["problems"][0]["reason"]


def test_verify_a_missing_shard_exits_one(cache, capsys):
    os.unlink(shard_path(cache, 0))
    assert run_main(["verify", cache, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {"file": "shard-000000.safetensors", "reason": "missing shard"} in report["problems"]


def test_verify_an_unsealed_cache_exits_one(cache, capsys):
    manifest = json.load(open(manifest_path(cache)))
    manifest["complete"] = False
    with open(manifest_path(cache), "w") as f:
        json.dump(manifest, f)
    assert run_main(["verify", cache]) == 1
    assert "not complete" in capsys.readouterr().out


def test_verify_a_directory_without_a_manifest_exits_one(tmp_path, capsys):
    assert run_main(["verify", str(tmp_path)]) == 1
    assert manifest_path(str(tmp_path)) in capsys.readouterr().out


def test_inspect_a_damaged_shard_exits_one_naming_it(cache, capsys):
    os.truncate(shard_path(cache, 1), 10)
    assert run_main(["inspect", cache]) == 1
    err = capsys.readouterr().err
    assert "shard-000001.safetensors" in err and "Traceback" not in err


def test_inspect_without_a_manifest_exits_one(tmp_path, capsys):
    assert run_main(["inspect", str(tmp_path)]) == 1
    assert "manifest" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# bad usage


@pytest.mark.parametrize(
    "argv", [[], ["inspect"], ["verify"], ["frobnicate", "x"], ["verify", "x", "--bogus"], ["inspect", "a", "b"]]
)
def test_bad_usage_exits_two(argv, capsys):
    assert run_main(argv) == 2
    assert "usage" in capsys.readouterr().err
