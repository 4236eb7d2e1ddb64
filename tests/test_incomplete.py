"""Reading a cache whose manifest is not sealed: refused with the resume command, or its whole-shard prefix."""

from __future__ import annotations

import os

import pytest

import speccache.format.manifest as manifest_module
import speccache.testing.synthetic as synthetic
from speccache import cli
from speccache.errors import CacheIncompleteError
from speccache.format import shard_path
from speccache.read import CacheDataset
from speccache.read.verify import inspect_cache, verify_cache
from speccache.testing.synthetic import write_synthetic_cache
from support.cachecmp import all_samples, same_samples

ARGS = dict(num_samples=30, shard_size=4, batch_size=4, hidden=16, max_len=24)  # 8 shards, the last one of 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "cache")
    write_synthetic_cache(path, overlap=False, **ARGS)
    return all_samples(path)


def _interrupted(path: str, monkeypatch, batches: int) -> None:
    """Run the producer and stop it with an error after ``batches`` batches (one shard each), or at the seal."""
    if batches >= 8:  # every shard written: fail the sealing manifest write instead
        real = manifest_module.write_manifest_file

        def write_manifest_file(cache_dir, body):
            if body.get("complete"):
                raise RuntimeError("the job was preempted")
            return real(cache_dir, body)

        monkeypatch.setattr(manifest_module, "write_manifest_file", write_manifest_file)
        with pytest.raises(RuntimeError, match="preempted"):
            write_synthetic_cache(path, overlap=False, **ARGS)
        monkeypatch.undo()
        return
    make = synthetic.make_compute

    def failing_make(*args):
        compute = make(*args)
        calls = [0]

        def compute_then_fail(batch):
            if calls[0] == batches:
                raise RuntimeError("the job was preempted")
            calls[0] += 1
            return compute(batch)

        return compute_then_fail

    monkeypatch.setattr(synthetic, "make_compute", failing_make)
    with pytest.raises(RuntimeError, match="preempted"):
        write_synthetic_cache(path, overlap=False, **ARGS)
    monkeypatch.undo()


@pytest.mark.parametrize("shards", [0, 3, 8])
def test_an_interrupted_cache_is_refused_with_the_resume_command(tmp_path, monkeypatch, reference, shards):
    out = str(tmp_path / "cache")
    _interrupted(out, monkeypatch, shards)
    with pytest.raises(CacheIncompleteError) as info:
        CacheDataset(out)
    message = str(info.value)
    assert out in message and "still being written" in message and "interrupted" in message and "--resume" in message
    assert "allow_incomplete=True" in message
    prefix = all_samples(out, allow_incomplete=True, verify=True)
    assert len(prefix) == min(shards * 4, ARGS["num_samples"])
    assert same_samples(prefix, reference[: len(prefix)])
    assert inspect_cache(out)["complete"] is False
    report = verify_cache(out)
    assert not report.ok and any("not complete" in p.reason and "--resume" in p.reason for p in report.problems)
    write_synthetic_cache(out, overlap=False, resume=True, **ARGS)
    assert same_samples(all_samples(out, verify=True), reference)


def test_allow_incomplete_reads_only_the_contiguous_prefix_of_whole_shards(tmp_path, monkeypatch, reference):
    out = str(tmp_path / "cache")
    _interrupted(out, monkeypatch, 6)
    os.unlink(shard_path(out, 2))  # e.g. a damaged shard removed by hand: shards 3.. are not a prefix any more
    with pytest.raises(CacheIncompleteError):
        CacheDataset(out)
    got = all_samples(out, allow_incomplete=True)
    assert len(got) == 8 and same_samples(got, reference[:8])
    with pytest.raises(IndexError):
        CacheDataset(out, allow_incomplete=True)[8]


def test_inspect_cli_says_an_unsealed_cache_is_not_complete(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "cache")
    _interrupted(out, monkeypatch, 2)
    assert cli.main(["inspect", out]) == 0
    assert "NO (interrupted or still being written)" in capsys.readouterr().out
    assert cli.main(["verify", out]) == 1
    assert "not complete" in capsys.readouterr().out
