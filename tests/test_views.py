"""Views: merge and subset read exactly the selected samples (tensor for tensor against a directly written cache of
those samples), refuse mismatched schemas and configurations, fail at open when a source shard changed or vanished,
and a killed view writer leaves no view (and a rerun writes the same one)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from speccache.cli import main
from speccache.errors import CacheCorruptError, CacheExistsError, CacheFormatError
from speccache.format import LENGTHS_KEY, STAT_PREFIX, KeySpec, shard_path
from speccache.format.view import VIEW_NAME, is_view
from speccache.read import CacheDataset, PackCollator, PadCollator, open_dataset
from speccache.read._batch import batch_rows
from speccache.read.follow import Follow, FollowDataset
from speccache.read.sampler import LocalityShuffleSampler
from speccache.read.view import ViewDataset, make_merge_view, make_subset_view, parse_where
from speccache.testing.synthetic import write_synthetic_cache
from speccache.write import CacheWriter
from support.cachecmp import all_samples, same_samples

SYN = dict(shard_size=4, hidden=8, max_len=10)
SCHEMA = {
    "input_ids": KeySpec("input_ids", torch.int32, (), ragged=True),
    "loss_mask": KeySpec("loss_mask", torch.bool, (), ragged=True),
    "hidden": KeySpec("hidden", torch.float32, (4,), ragged=True),
}


def write_samples(
    out: str, samples: list[dict[str, torch.Tensor]], config: dict, shard_size: int = 4, side_files: tuple = ()
) -> None:
    """A cache of exactly ``samples`` (with ``supervised_tokens`` statistics), written shard by shard."""
    writer = CacheWriter(
        out, cache_name="viewtest", schema=SCHEMA, shard_size=shard_size, num_samples=len(samples), config=config
    )
    with writer.writing(side_files=side_files, overlap=False) as run:
        for index in run.shards:
            chunk = samples[index * shard_size : (index + 1) * shard_size]
            rows = {k: torch.cat([s[k] for s in chunk]) for k in SCHEMA}
            rows[LENGTHS_KEY] = torch.tensor([len(s["input_ids"]) for s in chunk])
            rows[STAT_PREFIX + "supervised_tokens"] = torch.tensor([int(s["loss_mask"].sum()) for s in chunk])
            run.write_shard(out, index, rows)


def make_samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 9, (1,), generator=g))
        out.append(
            {
                "input_ids": torch.randint(0, 100, (length,), generator=g, dtype=torch.int32),
                "loss_mask": torch.rand(length, generator=g) < 0.5,
                "hidden": torch.randn(length, 4, generator=g),
            }
        )
    return out


@pytest.fixture
def two(tmp_path):
    a, b = make_samples(10, 0), make_samples(7, 1)
    write_samples(str(tmp_path / "a"), a, {"model": "m", "data": "a.jsonl"})
    write_samples(str(tmp_path / "b"), b, {"model": "m", "data": "b.jsonl"})
    return tmp_path, a, b


def test_merge_reads_the_concatenation_tensor_for_tensor(two):
    tmp, a, b = two
    write_samples(str(tmp / "direct"), a + b, {"model": "m", "data": "ab.jsonl"})
    assert main(["merge", str(tmp / "a"), str(tmp / "b"), "--out", str(tmp / "v"), "--weights", "2,1"]) == 0
    assert is_view(str(tmp / "v"))
    view = ViewDataset(str(tmp / "v"))
    assert len(view) == 17
    assert same_samples([dict(view[i]) for i in range(len(view))], all_samples(str(tmp / "direct")))
    assert view.sample_weights() == [2.0] * 10 + [1.0] * 7
    plain = CacheDataset(str(tmp / "v"), max_open_shards=2)  # the reader accepts a view wherever a cache goes
    assert isinstance(plain, ViewDataset) and same_samples(
        [dict(plain[i]) for i in range(17)], all_samples(str(tmp / "direct"))
    )
    body = json.loads((tmp / "v" / VIEW_NAME).read_text())
    assert [s["path"] for s in body["sources"]] == ["../a", "../b"]  # relative: the tree can move as a whole


class KeysReader(CacheDataset):
    """A reader subclass, to see that the one asked for reads the cache, a view's sources and a follower's shards."""


@pytest.mark.parametrize("spelling", ["open_dataset", "CacheDataset"])
def test_open_dataset_says_which_reader_a_directory_gets(two, spelling):
    tmp, a, b = two
    make_merge_view([str(tmp / "a"), str(tmp / "b")], str(tmp / "v"))

    def open_(path, *args, **kwargs):
        if spelling == "open_dataset":
            return open_dataset(path, *args, dataset_cls=KeysReader, **kwargs)
        return KeysReader(path, *args, **kwargs)

    cache = open_(str(tmp / "a"), ["hidden"])
    assert type(cache) is KeysReader and cache.keys == ("hidden",)
    view = open_(str(tmp / "v"), ["hidden"], max_open_shards=1)
    assert type(view) is ViewDataset and [type(s) for s in view.sources] == [KeysReader, KeysReader]
    assert torch.equal(view[10]["hidden"], b[0]["hidden"]) and view.sources[0].max_open_shards == 1
    follower = open_(str(tmp / "a"), follow=Follow(timeout=1))
    assert type(follower) is FollowDataset and type(follower.reader) is KeysReader
    assert len(list(follower)) == len(a)
    with pytest.raises(CacheFormatError, match="is a view, which selects samples of sealed caches"):
        open_(str(tmp / "v"), follow=True)


def test_a_view_opens_through_the_reader_module_alone(two):
    """``CacheDataset(view)`` needs no import of the view reader by its caller (nor by the reader's module)."""
    tmp, _, _ = two
    make_merge_view([str(tmp / "a"), str(tmp / "b")], str(tmp / "v"))
    code = (
        "from speccache.read.dataset import CacheDataset\n"
        f"print(type(CacheDataset({str(tmp / 'v')!r})).__name__, len(CacheDataset({str(tmp / 'v')!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ViewDataset", "17"]


def test_a_batch_mixing_sources_is_read_straight_from_their_files(two):
    """The sources' shards share one key layout, so a batch drawn from both goes the collators' one-pass path
    (each sample's bytes copied from its shard file), and equals the batch of a directly written cache."""
    tmp, a, b = two
    write_samples(str(tmp / "direct"), a + b, {"model": "m", "data": "ab.jsonl"})
    make_merge_view([str(tmp / "a"), str(tmp / "b")], str(tmp / "v"))
    view, direct = ViewDataset(str(tmp / "v")), CacheDataset(str(tmp / "direct"))
    order = [12, 3, 16, 0, 9, 10]  # both sources, interleaved
    samples = view.__getitems__(order)
    assert batch_rows(samples) is not None
    ragged = list(SCHEMA)
    for collate in (PackCollator(ragged), PadCollator(ragged, pad_values={"loss_mask": False})):
        got, want = collate(samples), collate(direct.__getitems__(order))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_subset_reads_exactly_the_selected_samples(two, capsys):
    tmp, a, _ = two
    chosen = [s for s in a if 2 <= int(s["loss_mask"].sum()) < 4]
    assert 0 < len(chosen) < len(a)
    write_samples(str(tmp / "direct"), chosen, {"model": "m", "data": "a.jsonl"})
    where = "supervised_tokens >= 2 and supervised_tokens < 4"
    assert main(["subset", str(tmp / "a"), "--out", str(tmp / "s"), "--where", where]) == 0
    view = ViewDataset(str(tmp / "s"))
    assert same_samples([dict(view[i]) for i in range(len(view))], all_samples(str(tmp / "direct")))
    assert main(["verify", str(tmp / "s")]) == 0
    assert main(["inspect", str(tmp / "s")]) == 0
    assert f"{len(chosen)} samples from 1 caches" in capsys.readouterr().out
    with pytest.raises(ValueError, match="does not record per sample"):
        make_subset_view(str(tmp / "a"), str(tmp / "s2"), "mean_entropy < 1")


def test_where_grammar():
    assert parse_where("a >= 1 and b<2.5e1") == [("a", ">=", 1.0), ("b", "<", 25.0)]
    for bad in ("a >= x", "a => 1", "a >= 1 or b < 2", ""):
        with pytest.raises(ValueError, match="must look like NAME OP NUMBER"):
            parse_where(bad)


def test_merge_refuses_other_schema_or_settings(two, tmp_path):
    tmp, a, _ = two
    write_samples(str(tmp / "other"), a, {"model": "other-model", "data": "a.jsonl"})
    with pytest.raises(CacheFormatError, match=r"config.model: 'm' != 'other-model'"):
        make_merge_view([str(tmp / "a"), str(tmp / "other")], str(tmp / "v"))
    write_synthetic_cache(str(tmp / "syn"), num_samples=8, **SYN)
    with pytest.raises(CacheFormatError, match=r"cache_name: 'viewtest' != 'synthetic'; keys:"):
        make_merge_view([str(tmp / "a"), str(tmp / "syn")], str(tmp / "v"))
    assert not os.path.exists(tmp / "v" / VIEW_NAME)


def test_merge_reads_settings_as_a_resume_does_and_lets_appended_data_differ(two, tmp_path):
    tmp, a, b = two
    # a cache written before --nonfinite was recorded stands for the default, fail; an appended cache differs in data
    write_samples(str(tmp / "old"), a, {"model": "m", "data": "a.jsonl"})
    write_samples(str(tmp / "new"), b, {"model": "m", "data": "b.jsonl", "nonfinite": "fail", "appended": [{}]})
    view = make_merge_view([str(tmp / "old"), str(tmp / "new")], str(tmp / "v"))
    assert view.num_samples == len(a) + len(b)
    write_samples(str(tmp / "skip"), b, {"model": "m", "data": "b.jsonl", "nonfinite": "skip"})
    with pytest.raises(CacheFormatError, match=r"config.nonfinite: 'fail' != 'skip'"):
        make_merge_view([str(tmp / "old"), str(tmp / "skip")], str(tmp / "v2"))


def test_changed_or_vanished_source_fails_at_open(two):
    tmp, a, _ = two
    make_merge_view([str(tmp / "a"), str(tmp / "b")], str(tmp / "v"))
    os.rename(shard_path(str(tmp / "b"), 1), str(tmp / "kept"))
    with pytest.raises(CacheCorruptError, match=r"shard-000001.safetensors: a shard of view .* vanished"):
        ViewDataset(str(tmp / "v"))
    os.rename(str(tmp / "kept"), shard_path(str(tmp / "b"), 1))
    assert len(ViewDataset(str(tmp / "v"))) == 17
    # the source regenerated in place (other data, same shape): its manifest changed
    write_samples(str(tmp / "b2"), make_samples(7, 5), {"model": "m", "data": "b.jsonl"})
    for name in sorted(os.listdir(tmp / "b2")):
        os.replace(tmp / "b2" / name, tmp / "b" / name)
    with pytest.raises(CacheCorruptError, match=r"manifest.json: a source of view .* changed since the view was made"):
        ViewDataset(str(tmp / "v"))
    assert main(["verify", str(tmp / "v")]) == 1


@pytest.mark.parametrize("command", ["merge", "subset"])
def test_a_view_writer_killed_mid_write_leaves_no_view_and_the_rerun_writes_it(two, command):
    """A real SIGKILL with half of view.json in its temporary file (speccache.testing.faults)."""
    tmp, _, _ = two
    out = str(tmp / "v")
    argv = [command, str(tmp / "a"), *([str(tmp / "b")] if command == "merge" else ["--where", "tokens >= 1"])]
    argv += ["--out", out]
    killed = subprocess.run(
        [sys.executable, "-m", "speccache.testing.faults", "speccache.cli", *argv],
        env={**os.environ, "SPECCACHE_FAULT": "mid_view_write"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not is_view(out) and any(".tmp-" in name for name in os.listdir(out))
    with pytest.raises(CacheFormatError, match="not a readable view"):
        ViewDataset(out)
    assert main(argv) == 0
    assert len(ViewDataset(out)) == (17 if command == "merge" else 10)
    assert main(argv) == 1  # a written view is never overwritten
    assert len(CacheDataset(str(tmp / "a"))) == 10


@pytest.mark.parametrize("into", ["a", "view", "foreign"])
def test_the_view_writers_refuse_a_directory_holding_a_cache_a_view_or_other_files(two, into):
    """The refusal lives in the API the CLI calls: a view written into one of its own sources would turn that cache
    into a view of itself (its readers recursed until RecursionError)."""
    tmp, a, _ = two
    assert main(["subset", str(tmp / "b"), "--where", "tokens >= 1", "--out", str(tmp / "view")]) == 0
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in (tmp / into).iterdir()}
    with pytest.raises(CacheExistsError, match=re.escape(str(tmp / into))):
        make_merge_view([str(tmp / "a"), str(tmp / "b")], str(tmp / into))
    with pytest.raises(CacheExistsError, match=re.escape(str(tmp / into))):
        make_subset_view(str(tmp / "a"), str(tmp / into), "tokens >= 1")
    assert {p: p.read_bytes() for p in (tmp / into).iterdir()} == before  # nothing written, nothing removed
    assert same_samples([dict(s) for s in CacheDataset(str(tmp / "a"))], a)


def test_locality_sampler_honours_weights():
    weights = [2.0] * 10 + [1.0] * 7
    sampler = LocalityShuffleSampler(17, 4, seed=3, weights=weights)
    first = sampler.epoch_order(0).tolist()
    assert Counter(first) == Counter({**{i: 2 for i in range(10)}, **{i: 1 for i in range(10, 17)}})
    assert sampler.epoch_order(1).tolist() != first and len(sampler) == 27
    half = LocalityShuffleSampler(1000, 8, seed=0, weights=[0.5] * 1000)
    picked = set(half.epoch_order(0).tolist())
    assert 400 < len(picked) < 600 and picked == set(half.epoch_order(1).tolist())  # a fixed seeded half
    two = [LocalityShuffleSampler(17, 4, seed=3, weights=weights, rank=r, world_size=2) for r in range(2)]
    assert Counter(two[0].rank_order(0).tolist() + two[1].rank_order(0).tolist()) - Counter(first) == Counter(
        {first[0]: 1}
    )
    with pytest.raises(ValueError, match="one finite weight >= 0 per sample"):
        LocalityShuffleSampler(3, 4, weights=[1.0, -1.0, 1.0])


def test_inspect_stats_and_verify_json_accept_a_view(two, capsys):
    tmp, a, b = two
    out = str(tmp / "v")
    assert main(["subset", str(tmp / "a"), "--where", "supervised_tokens >= 2", "--out", out]) == 0
    picked = [s for s in a if int(s["loss_mask"].sum()) >= 2]
    capsys.readouterr()
    assert main(["inspect", out, "--stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["sample_stats"]
    assert stats["supervised_tokens"] == [int(s["loss_mask"].sum()) for s in picked]
    assert stats["tokens"] == [len(s["input_ids"]) for s in picked]
    assert main(["inspect", out, "--stats"]) == 0
    assert f"stats      supervised_tokens: {len(picked)} samples" in capsys.readouterr().out
    assert main(["verify", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"cache_dir": out, "view": True, "ok": True, "problems": []}
    os.unlink(shard_path(str(tmp / "a"), 0))
    assert main(["verify", out, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and "shard-000000" in report["problems"][0]
