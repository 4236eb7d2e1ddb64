"""``precompute --append``: append then read yields the samples of a cache written from the concatenated data, in
order; a failed append is finished by the same command; other settings are refused, naming them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from speccache.cli import main
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.errors import CacheCorruptError, CacheIncompleteError, ConfigMismatchError
from speccache.format import SKIPPED_ROWS_FILE, load_manifest_json, manifest_path, write_bytes_file
from speccache.format.manifest import write_manifest_file
from speccache.methods import finite
from speccache.precompute import PrecomputeConfig, run_precompute
from speccache.read import CacheDataset
from support.cachecmp import all_samples

# --threads 1: with torch's own thread count, a busy machine (load >= CPUs) adds its thread warning to the logs that
# the append tests require to be free of warnings
COMMON = ["--max-length", "96", "--model-dtype", "fp32", "--dtype", "fp32", "--batch-size", "2", "--shard-size", "4",
          "--quiet", "--nonfinite", "skip", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    base = tmp_path_factory.mktemp("append")
    model = build_tiny_model_dir(str(base / "model"), "llama", seed=0)
    with open(demo_data_path("sharegpt")) as f:
        lines = [line for line in f if line.strip()][:11]
    # a_bad and b_bad end in a malformed row: with --skip-bad-rows they give a's and b's samples, and one skip each
    files = {"a": lines[:5], "b": lines[5:], "ab": lines, "a_bad": [*lines[:5], "{\n"], "b_bad": [*lines[5:], "{\n"]}
    paths = {}
    for name, rows in files.items():
        paths[name] = str(base / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(rows)
    whole = str(base / "whole")
    assert main(["precompute", "--model", model, "--data", paths["ab"], "--out", whole, *COMMON]) == 0
    yield model, paths, whole, base
    mp.undo()


def _run(model: str, data: str, out: str, *extra: str) -> int:
    return main(["precompute", "--model", model, "--data", data, "--out", out, *COMMON, *extra])


def _same_as_whole(out: str, whole: str) -> None:
    got, want = all_samples(out), all_samples(whole)
    assert len(got) == len(want) == 11
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            if key == "source_row":  # the row in its own file: appended rows count from their file's start
                assert int(a[key]) == int(b[key]) - (5 if i >= 5 else 0)
            else:
                assert torch.equal(a[key], b[key]), (i, key)


def _skipped(out: str) -> list[tuple[str, int, str]]:
    with open(os.path.join(out, SKIPPED_ROWS_FILE)) as f:
        return [(r["data"], r["row"], r["reason"]) for r in map(json.loads, f)]


def test_skipped_rows_of_every_data_file_are_listed_once_naming_it(setup):
    model, paths, whole, base = setup
    out = str(base / "skips")
    assert _run(model, paths["a_bad"], out, "--skip-bad-rows") == 0
    assert _skipped(out) == [(paths["a_bad"], 5, "malformed")]
    # as versions before the data field wrote it: such lines list rows of the cache's first data file
    path = os.path.join(out, SKIPPED_ROWS_FILE)
    with open(path) as f:
        legacy = "".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "data"}) + "\n" for line in f)
    body = load_manifest_json(manifest_path(out))
    body["side_files"][SKIPPED_ROWS_FILE] = {"bytes": len(legacy), "xxh3_128": write_bytes_file(path, legacy.encode())}
    write_manifest_file(out, body)
    assert _run(model, paths["b_bad"], out, "--skip-bad-rows", "--append") == 0
    _same_as_whole(out, whole)
    assert _skipped(out) == [(paths["a_bad"], 5, "malformed"), (paths["b_bad"], 6, "malformed")]
    assert load_manifest_json(manifest_path(out))["stats"]["skipped_rows"] == {"malformed": 2, "nonfinite": 0}
    assert main(["verify", out]) == 0  # the manifest lists the rewritten file's checksum


def test_append_equals_a_cache_of_the_concatenated_data(setup, caplog):
    model, paths, whole, base = setup
    out = str(base / "grown")
    assert _run(model, paths["a"], out) == 0
    caplog.clear()
    assert _run(model, paths["b"], out, "--append") == 0
    # the old partial last shard (sample 4 alone) is recomputed as planned: nothing to warn about
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    _same_as_whole(out, whole)
    body = load_manifest_json(manifest_path(out))
    assert body["complete"] and body["num_samples"] == 11
    assert body["config"]["appended"][0]["first_sample"] == 5
    assert body["stats"]["samples"] == 11
    assert body["stats"]["tokens"] == load_manifest_json(manifest_path(whole))["stats"]["tokens"]
    assert _run(model, paths["b"], out, "--append") == 1  # the same data twice: refused, nothing changed


def test_a_reader_open_during_an_append_is_told_to_reopen(setup):
    model, paths, _, base = setup
    out = str(base / "read-during-append")
    assert _run(model, paths["a"], out) == 0
    ds = CacheDataset(out, max_open_shards=1)
    assert int(ds[0]["source_row"]) == 0
    assert _run(model, paths["b"], out, "--append") == 0
    with pytest.raises(CacheCorruptError, match=r"the cache was appended to \(11 samples now, sealed\).*Reopen the"):
        ds[4]  # its shard now holds samples 4..7
    assert len(CacheDataset(out)) == 11


def test_a_failed_append_is_finished_by_the_same_command(setup, monkeypatch):
    model, paths, whole, base = setup
    out = str(base / "crashed")
    assert _run(model, paths["a"], out) == 0
    real = finite.ClearedCounter.write_shard
    calls = []

    def dies_after_one(self, output_dir, index, rows):
        if calls:
            raise KeyboardInterrupt  # the process stops after the old partial shard was rewritten
        calls.append(index)
        return real(self, output_dir, index, rows)

    monkeypatch.setattr(finite.ClearedCounter, "write_shard", dies_after_one)
    assert _run(model, paths["b"], out, "--append") == 130  # Ctrl-C's exit code, the one line instead of a traceback
    monkeypatch.setattr(finite.ClearedCounter, "write_shard", real)
    assert calls == [1] and not load_manifest_json(manifest_path(out))["complete"]
    assert _run(model, paths["b"], out, "--append") == 0
    _same_as_whole(out, whole)


def test_append_with_other_settings_is_refused(setup):
    model, paths, _, base = setup
    out = str(base / "other")
    assert _run(model, paths["a"], out) == 0
    before = load_manifest_json(manifest_path(out))
    with pytest.raises(ConfigMismatchError, match="config.dtype: cache has 'fp32', this run has 'bf16'"):
        cfg = PrecomputeConfig(model=model, data=paths["b"], out=out, batch_size=2, shard_size=4, max_length=96,
                               dtype="bf16", model_dtype="fp32", append=True, nonfinite="skip")  # fmt: skip
        run_precompute(cfg, progress=False)
    assert load_manifest_json(manifest_path(out)) == before
    # Without --nonfinite skip the old partial shard's cleared samples could not be recomputed: refused up front.
    with pytest.raises(ConfigMismatchError, match="config.nonfinite: cache has 'skip', this run has 'fail'"):
        cfg = PrecomputeConfig(model=model, data=paths["b"], out=out, batch_size=2, shard_size=4, max_length=96,
                               dtype="fp32", model_dtype="fp32", append=True)  # fmt: skip
        run_precompute(cfg, progress=False)
    assert load_manifest_json(manifest_path(out)) == before


def test_a_cache_older_than_the_nonfinite_field_reads_as_fail(setup):
    model, paths, _, base = setup
    out = str(base / "older")
    default = COMMON[: COMMON.index("--nonfinite")]
    assert main(["precompute", "--model", model, "--data", paths["a"], "--out", out, *default]) == 0
    body = load_manifest_json(manifest_path(out))
    assert body["config"].pop("nonfinite") == "fail"
    write_manifest_file(out, body)  # as a cache written before the field existed
    assert main(["precompute", "--model", model, "--data", paths["b"], "--out", out, *default, "--append"]) == 0
    assert load_manifest_json(manifest_path(out))["config"]["nonfinite"] == "fail"


@pytest.mark.parametrize("fault", ["after_manifest_begin", "mid_shard_write:1", "mid_manifest_write:1", "before_seal"])
def test_an_append_killed_anywhere_is_finished_by_the_same_command(setup, fault):
    """A real SIGKILL at each write of the append; the sealed cache stays readable or the rerun completes it."""
    model, paths, whole, base = setup
    out = str(base / f"killed-{fault.replace(':', '-')}")
    assert _run(model, paths["a_bad"], out, "--skip-bad-rows") == 0
    argv = [
        "precompute",
        "--model",
        model,
        "--data",
        paths["b_bad"],
        "--out",
        out,
        *COMMON,
        "--skip-bad-rows",
        "--append",
    ]
    env = {**os.environ, "SPECCACHE_FAULT": fault, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-m", "speccache.testing.faults", "speccache.cli", *argv],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    try:  # what a reader sees meanwhile: the sealed cache of the first file, or a refusal naming the append
        assert len(CacheDataset(out)) == 5
    except CacheIncompleteError as exc:
        assert "re-running the same precompute --append command" in str(exc)
    assert _run(model, paths["b_bad"], out, "--skip-bad-rows", "--append") == 0
    _same_as_whole(out, whole)
    assert _skipped(out) == [(paths["a_bad"], 5, "malformed"), (paths["b_bad"], 6, "malformed")]
    assert main(["verify", out]) == 0
    shutil.rmtree(out)
