"""A view is read wherever a cache goes: every layer-method reader and its loader, the EAGLE-3 reader and loader,
``TargetHead`` and ``speccache export`` give, for a merge of two tiny caches and for a subset of one, exactly what
they give for the selected samples of the caches read directly (tensor for tensor), and the loaders' samplers cover
every view sample (a merge's ``--weights`` included).

The caches are written by ``speccache precompute`` from the tiny llama target; the second cache is computed from
other conversations, so a sample read from the wrong source cannot pass for the right one.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.errors import CacheFormatError
from speccache.format import ShardFile, load_manifest_json, manifest_path
from speccache.format.manifest import Manifest, write_manifest_file
from speccache.format.view import View, source_record
from speccache.methods.eagle3 import SIDE_FILE, Eagle3CacheDataset, TargetHead, build_eagle3_dataloader
from speccache.methods.layers import (
    LayerFeatureDataset,
    build_layer_dataloader,
    dflash_dataset,
    dspark_dataset,
    eagle3_dataset,
    mtp_dataset,
)
from speccache.read.stats import cache_sample_stats
from speccache.read.view import ViewDataset, make_merge_view, make_subset_view
from support.cachecmp import same_samples

DATA = demo_data_path("sharegpt")
SETTINGS = ["--batch-size", "2", "--shard-size", "2", "--dtype", "fp32"]
RUNS = {
    # every layer any layer reader below asks for: DSpark's [1, 2, 4, 5, 7], DFlash's [1..5], EAGLE-3's [1, 3, 4]
    "layers": ("llama", ["--method", "layers", "--layers", "1,2,3,4,5,6,7", "--last-prenorm", *SETTINGS]),
    "eagle3": ("llama", ["--method", "eagle3", *SETTINGS]),
}
SIZES = {"a": 6, "b": 5}  # b ends in a partial shard

pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def caches(precompute_runs, tmp_path_factory):
    """``caches[kind][name]``: cache ``a`` (the demo conversations) and ``b`` (others), of each kind."""
    other = tmp_path_factory.mktemp("data") / "other.jsonl"
    other.write_text("\n".join(reversed(Path(DATA).read_text().splitlines())) + "\n")
    runs = {"a": precompute_runs(RUNS, DATA, SIZES["a"], 64), "b": precompute_runs(RUNS, str(other), SIZES["b"], 64)}
    return {kind: {name: get(kind) for name, get in runs.items()} for kind in RUNS}


def _subset_view(cache: str, out: str, chosen: list[int]) -> None:
    """The view ``speccache subset`` writes for these samples (a layers cache records no statistics to select by)."""
    m = Manifest.read(cache)
    shards = sorted({i // m.shard_size for i in chosen})
    View(m.cache_name, m.schema, [source_record(out, cache, m, shards, 1.0)], [(0, i, i + 1) for i in chosen]).write(
        out
    )


@pytest.fixture(scope="module")
def views(caches, tmp_path_factory):
    """``views[kind][shape]``: ``(view dir, [(cache, sample index)] of its samples in order)``."""
    base = tmp_path_factory.mktemp("views")
    supervised = cache_sample_stats(caches["eagle3"]["a"])["supervised_tokens"]
    threshold = sorted(supervised)[len(supervised) // 2]
    chosen = [i for i, v in enumerate(supervised) if v >= threshold]
    assert 0 < len(chosen) < SIZES["a"]
    out = {}
    for kind, c in caches.items():
        merged, subset = str(base / f"{kind}-merge"), str(base / f"{kind}-subset")
        make_merge_view([c["a"], c["b"]], merged)
        if kind == "eagle3":
            make_subset_view(c["a"], subset, f"supervised_tokens >= {threshold}")
        else:
            _subset_view(c["a"], subset, chosen)
        out[kind] = {
            "merge": (merged, [(c["a"], i) for i in range(SIZES["a"])] + [(c["b"], i) for i in range(SIZES["b"])]),
            "subset": (subset, [(c["a"], i) for i in chosen]),
        }
    return out


READERS = {
    "dspark": ("layers", dspark_dataset),
    "dspark_layers": ("layers", lambda d: dspark_dataset(d, layers=[2, 6])),
    "dflash": ("layers", dflash_dataset),
    "mtp": ("layers", mtp_dataset),
    "eagle3_of_layers": ("layers", eagle3_dataset),
    "fields": ("layers", lambda d: LayerFeatureDataset(d, {"x": [3, "last"], "emb": [1]}, max_open_shards=1)),
    "eagle3": ("eagle3", Eagle3CacheDataset),
    "eagle3_keys": ("eagle3", lambda d: Eagle3CacheDataset(d, ["input_ids", "last_hidden_state"], verify=True)),
}


def _direct(selected, make) -> list[dict[str, torch.Tensor]]:
    readers = {cache: make(cache) for cache in {cache for cache, _ in selected}}
    return [dict(readers[cache][i]) for cache, i in selected]


@pytest.mark.parametrize("shape", ["merge", "subset"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_reads_a_view_as_the_samples_it_selects(views, reader, shape):
    kind, make = READERS[reader]
    view, selected = views[kind][shape]
    want = _direct(selected, make)
    ds = make(view)
    assert isinstance(ds, ViewDataset) and len(ds) == len(want)
    assert same_samples([dict(ds[i]) for i in range(len(ds))], want)
    backwards = list(reversed(range(len(ds))))  # one batch drawing on both sources, out of order
    assert same_samples([dict(s) for s in ds.__getitems__(backwards)], [want[i] for i in backwards])
    assert same_samples([dict(s) for s in pickle.loads(pickle.dumps(ds)).__getitems__(backwards)], want[::-1])
    ds.prefetch(range(len(ds)))
    assert ds.sample_lengths() == [len(s["input_ids"]) for s in want]


def _batches_in_sampler_order(loader, want, collate) -> None:
    order = list(loader.sampler)
    batches = list(loader)
    assert len(batches) == -(-len(order) // loader.batch_size)
    for k, batch in enumerate(batches):
        expected = collate([dict(want[i]) for i in order[k * loader.batch_size : (k + 1) * loader.batch_size]])
        assert set(batch) == set(expected)
        for key in batch:
            assert torch.equal(batch[key], expected[key]), key


@pytest.mark.parametrize("shape", ["merge", "subset"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_loaders_read_a_view_in_their_sampler_order(views, shape, shuffle):
    view, selected = views["layers"][shape]
    ds = dspark_dataset(view)
    loader = build_layer_dataloader(ds, batch_size=3, shuffle=shuffle, seed=1)
    _batches_in_sampler_order(loader, _direct(selected, dspark_dataset), ds.collator())
    view, selected = views["eagle3"][shape]
    loader = build_eagle3_dataloader(view, batch_size=3, shuffle=shuffle, seed=1)
    _batches_in_sampler_order(loader, _direct(selected, Eagle3CacheDataset), Eagle3CacheDataset(view).collator())
    if shuffle:
        assert Counter(loader.sampler) == Counter(range(len(selected)))


def test_the_layer_loader_honours_merge_weights(caches, tmp_path):
    view = str(tmp_path / "weighted")
    assert main(["merge", caches["layers"]["a"], caches["layers"]["b"], "--out", view, "--weights", "2,1"]) == 0
    loader = build_layer_dataloader(mtp_dataset(view), batch_size=4, shuffle=True)
    assert Counter(loader.sampler) == Counter({**{i: 2 for i in range(6)}, **{i: 1 for i in range(6, 11)}})
    assert sum(int(b["lengths"].numel()) for b in loader) == 2 * SIZES["a"] + SIZES["b"]


def test_a_cache_or_view_of_the_wrong_kind_is_refused_naming_both_kinds(caches, views):
    with pytest.raises(CacheFormatError, match=r"selects samples of 'eagle3' caches, not 'layers'"):
        dspark_dataset(views["eagle3"]["merge"][0])
    with pytest.raises(CacheFormatError, match=r"selects samples of 'layers' caches, not 'eagle3'"):
        TargetHead.from_cache(views["layers"]["subset"][0])
    with pytest.raises(CacheFormatError, match=r"is a 'layers' cache, not 'eagle3'"):  # once a bare FileNotFoundError
        TargetHead.from_cache(caches["layers"]["a"])


@pytest.mark.parametrize("shape", ["merge", "subset"])
def test_target_head_of_a_view_is_its_sources_head(caches, views, shape):
    head, direct = TargetHead.from_cache(views["eagle3"][shape][0]), TargetHead.from_cache(caches["eagle3"]["a"])
    assert torch.equal(head.weight, direct.weight) and torch.equal(head.selected_token_ids, direct.selected_token_ids)


def test_target_head_and_audit_refuse_a_view_whose_sources_hold_different_side_files(caches, tmp_path, capsys):
    """A view made without merge's side-file check (written directly): its sources' heads would disagree."""
    a, b = caches["eagle3"]["a"], str(shutil.copytree(caches["eagle3"]["b"], tmp_path / "b"))
    body = load_manifest_json(manifest_path(b))
    body["side_files"][SIDE_FILE]["xxh3_128"] = "0" * 32  # another draft vocabulary, as its manifest records it
    write_manifest_file(b, body)
    out = str(tmp_path / "v")
    manifests = [Manifest.read(a), Manifest.read(b)]
    records = [source_record(out, d, m, range(m.num_shards), 1.0) for d, m in zip((a, b), manifests)]
    View(manifests[0].cache_name, manifests[0].schema, records, [(0, 0, 6), (1, 0, 5)]).write(out)
    with pytest.raises(CacheFormatError, match=r"sources of this view hold different side files eagle3_side"):
        TargetHead.from_cache(out)
    assert main(["audit", out]) == 2  # which source's vocabulary would it recompute against?
    assert "hold different side files" in capsys.readouterr().err
    assert len(Eagle3CacheDataset(out)) == 11  # the samples themselves still read


def _exported(path: str) -> dict[str, torch.Tensor]:
    """Every key of an exported NeMo cache, its shards concatenated."""
    shards = sorted(n for n in os.listdir(path) if n.startswith("shard-"))
    files = [ShardFile(os.path.join(path, n)) for n in shards]
    return {k: torch.cat([f.tensor(k) for f in files]) for k in files[0].keys()}


def _side_tensors(path: str) -> dict[str, torch.Tensor]:
    (name,) = [n for n in os.listdir(path) if n.startswith("target_")]
    f = ShardFile(os.path.join(path, name))
    return {k: f.tensor(k).clone() for k in f.keys()}


@pytest.mark.parametrize("shape", ["merge", "subset"])
@pytest.mark.parametrize(
    ("kind", "to"), [("layers", "nemo-dspark"), ("layers", "nemo-eagle3"), ("eagle3", "nemo-eagle3")]
)
def test_export_of_a_view_writes_the_samples_it_selects(caches, views, tmp_path, capsys, kind, to, shape):
    view, selected = views[kind][shape]
    direct = {}
    for name in ("a", "b"):
        assert main(["export", "--to", to, caches[kind][name], str(tmp_path / name)]) == 0
        direct[caches[kind][name]] = _exported(str(tmp_path / name))
    assert main(["export", "--to", to, view, str(tmp_path / "view")]) == 0
    assert f"{len(selected)} samples padded" in capsys.readouterr().out
    got = _exported(str(tmp_path / "view"))
    assert set(got) == set(direct[caches[kind]["a"]])
    for key, value in got.items():
        want = torch.stack([direct[cache][key][i] for cache, i in selected])
        assert torch.equal(value, want), key
    assert load_manifest_json(manifest_path(str(tmp_path / "view")))["num_samples"] == len(selected)
    side, want_side = _side_tensors(str(tmp_path / "view")), _side_tensors(str(tmp_path / "a"))
    assert side.keys() == want_side.keys() and all(torch.equal(side[k], want_side[k]) for k in side)
