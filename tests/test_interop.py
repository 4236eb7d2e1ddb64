"""SpecForge and speculators layouts: exports read by the peers' own reader code (their PyPI packages, installed
without their dependencies by ``make install``) give exactly the samples speccache's readers give."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.compat.specforge import FILES_PER_DIR, specforge_path
from speccache.demo import demo_data_path
from speccache.format import ShardFile
from speccache.methods.eagle3 import Eagle3CacheDataset
from speccache.methods.layers import LayerFeatureDataset
from support.cachecmp import file_tree

LIMIT = 7
MAX_LENGTH = 80
BS = ["--batch-size", "3", "--shard-size", "3", "--dtype", "fp32"]
RUNS = {
    "eagle3": ("llama", ["--method", "eagle3", "--draft-vocab-size", "300", *BS]),
    "eagle3_probs": ("llama", ["--method", "eagle3", "--supervision", "probs", *BS]),
    "layers": ("llama", ["--method", "layers", "--layers", "1,3,4", "--last-hidden", "--last-prenorm", *BS]),
    "eagle3_bf16": ("llama", ["--method", "eagle3", "--batch-size", "3", "--shard-size", "3", "--dtype", "bf16"]),
    "dflash": ("llama", ["--method", "dflash", *BS]),
    "dspark": ("llama", ["--method", "dspark", *BS]),
}
AUX = [1, 3, 4]
H = 64  # the tiny demo targets' width
L = 8  # and depth

pytestmark = pytest.mark.usefixtures("offline_single_thread")


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(module.split(".")[0]) is None,
        reason=f"{module} is not installed (make install installs the peers' packages without their dependencies)",
    )


@pytest.fixture(scope="module")
def runs(precompute_runs):
    return precompute_runs(RUNS, demo_data_path("sharegpt"), LIMIT, MAX_LENGTH)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _export(cache: str, out: Path, to: str, capsys, *extra: str) -> None:
    assert main(["export", "--to", to, *extra, cache, str(out)]) == 0
    assert "one file per sample): about" in capsys.readouterr().out


@_needs("specforge")
@pytest.mark.parametrize("source", ["eagle3", "layers"])
def test_specforge_export_is_read_by_specforges_offline_reader_as_speccaches_samples(runs, tmp_path, capsys, source):
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader, list_feature_files
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    out = tmp_path / "sf"
    _export(runs(source), out, "specforge", capsys, *(("--layers", "1,3,4") if source == "layers" else ()))
    if source == "eagle3":
        ours = Eagle3CacheDataset(runs(source))
    else:
        ours = LayerFeatureDataset(
            runs(source), {"aux_hidden_states": AUX, "last_hidden_state": ["last"]}, prenorm=True
        )
    files = list_feature_files(str(out))
    refs = OfflineManifestReader(str(out), validate_files=True).read()
    assert len(files) == len(refs) == LIMIT and files == sorted(files)
    supervised: dict[int, int] = {}
    for i, path in enumerate(files):
        assert path == str(Path(specforge_path(str(out), i)).resolve())
        raw, want = load_feature_file(path), ours[i]
        t = want["input_ids"].numel()
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["input_ids"].tolist() == want["input_ids"].tolist()
        assert raw["loss_mask"].tolist() == want["loss_mask"].long().tolist()
        assert raw["aux_hidden_state"].shape == (1, t, 3 * H) and raw["hidden_state"].shape == (1, t, H)
        assert torch.equal(raw["aux_hidden_state"][0], want["aux_hidden_states"])
        assert torch.equal(raw["hidden_state"][0], want["last_hidden_state"])
        assert refs[i].num_tokens == t
        for tok in want["input_ids"][want["loss_mask"]].tolist():
            supervised[tok] = supervised.get(tok, 0) + 1
    assert dict(count_effective_feature_tokens(str(out))) == supervised
    mapping = out / "vocab_mapping.pt"
    if source == "eagle3":  # a 300-token draft vocabulary: its maps, as SpecForge's trainer loads them
        vocab = torch.load(mapping, weights_only=True)
        assert vocab["d2t"].dtype == torch.int64 and vocab["t2d"].dtype == torch.bool
        assert vocab["d2t"].numel() == 300 and int(vocab["t2d"].sum()) == 300
        assert torch.equal(torch.arange(300) + vocab["d2t"], vocab["t2d"].nonzero()[:, 0])
    else:
        assert not mapping.exists()


@_needs("specforge")
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_specforge_dflash_family_export_is_normalised_by_specforges_loader_as_speccaches_samples(
    runs, tmp_path, capsys, method
):
    from specforge.algorithms.common.dflash_family_data import normalize_dspark_offline_sample, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    from speccache.methods.layers import dflash_dataset, dspark_dataset

    out = tmp_path / method
    _export(runs(method), out, f"specforge-{method}", capsys)
    ours = (dspark_dataset if method == "dspark" else dflash_dataset)(runs(method))
    normalise = normalize_dspark_offline_sample if method == "dspark" else normalize_offline_sample
    files = list_feature_files(str(out))
    assert len(files) == LIMIT
    for i, path in enumerate(files):
        got, want = normalise(load_feature_file(path), MAX_LENGTH), ours[i]
        assert got["input_ids"][0].tolist() == want["input_ids"].tolist()
        assert got["loss_mask"][0].tolist() == want["loss_mask"].long().tolist()
        assert torch.equal(got["hidden_states"][0], want["target_hidden_states"])
        if method == "dspark":
            assert torch.equal(got["target_last_hidden_states"][0], want["target_last_hidden_states"])
        else:
            assert "target_last_hidden_states" not in got


def test_specforge_names_sort_in_sample_order_across_folders():
    names = [specforge_path("/c", i) for i in (0, 9, 10, FILES_PER_DIR - 1, FILES_PER_DIR, 10 * FILES_PER_DIR + 3)]
    assert names == sorted(names) and len({Path(n).parent for n in names}) == 3


@_needs("speculators")
def test_speculators_export_is_read_by_speculators_arrow_dataset_as_speccaches_samples(runs, tmp_path, capsys):
    from speculators.train.data import ArrowDataset

    out = tmp_path / "sp"
    _export(runs("layers"), out, "speculators", capsys, "--layers", "1,3,4")
    ours = LayerFeatureDataset(runs("layers"), {"aux": AUX, "pre": [L - 1]}, prenorm=True)
    ds = ArrowDataset(max_len=MAX_LENGTH, datapath=str(out), on_missing="raise")
    assert len(ds) == LIMIT
    supervised: dict[int, int] = {}
    for i in range(LIMIT):
        got, want = ds[i], ours[i]
        t = want["input_ids"].numel()
        assert got["input_ids"].tolist() == want["input_ids"].tolist()
        assert got["loss_mask"].tolist() == want["loss_mask"].long().tolist()
        assert got["lengths"].tolist() == [t]
        assert torch.equal(got["hidden_states"], want["aux"])  # [T, 3H]: the aux layers
        assert torch.equal(got["verifier_last_hidden_states"], want["pre"])  # before the final norm
        for tok in want["input_ids"][want["loss_mask"]].tolist():
            supervised[tok] = supervised.get(tok, 0) + 1
    assert ds.approx_lengths == [ours[i]["input_ids"].numel() for i in range(LIMIT)]
    assert torch.load(out / "token_freq.pt", weights_only=True) == supervised


def test_exports_refuse_what_the_layout_cannot_hold(runs, tmp_path, capsys):
    assert main(["export", "--to", "specforge", runs("eagle3_probs"), str(tmp_path / "a")]) == 1
    assert "stores --supervision probs instead" in capsys.readouterr().err
    assert main(["export", "--to", "speculators", runs("eagle3"), str(tmp_path / "b")]) == 1
    assert "only a layers cache stores" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("keep")
    assert main(["export", "--to", "specforge", runs("eagle3"), str(tmp_path / "c")]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "c" / "mine.txt").read_text() == "keep"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------
# import: round trips, bad files reported, never unpickling code, resume


def _import(src: Path, out: Path, layout: str, model: str, *extra: str) -> int:
    return main(["import", "--from", layout, "--model", model, "--shard-size", "3", *extra, str(src), str(out)])


class _Planted:
    """An object whose unpickling would write a file: a pickle that must never be loaded with weights_only=False."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


@_needs("specforge")
def test_specforge_import_of_an_export_gives_back_the_cache_and_reports_bad_files(runs, tiny_models, tmp_path, capsys):
    from speccache.read.verify import verify_cache

    src, out = tmp_path / "sf", tmp_path / "imported"
    _export(runs("eagle3"), src, "specforge", capsys)
    first_dir = Path(specforge_path(str(src), 0)).parent
    good = sorted(first_dir.iterdir())
    truncated, garbage, unsafe = good[1], first_dir / "data_zz_garbage.ckpt", first_dir / "data_zz_unsafe.ckpt"
    truncated.write_bytes(truncated.read_bytes()[:200])
    garbage.write_bytes(b"not a torch file")
    marker = tmp_path / "code-ran"
    torch.save({"input_ids": torch.zeros(3, dtype=torch.long), "x": _Planted(str(marker))}, unsafe)
    assert _import(src, out, "specforge", tiny_models("llama"), "--layers", "1,3,4") == 0
    captured = capsys.readouterr().out
    assert not marker.exists()
    report = [json.loads(line) for line in (out / "skipped_files.jsonl").read_text().splitlines()]
    assert {(Path(r["file"]).name, r["reason"]) for r in report} == {
        (truncated.name, "unreadable"),
        (garbage.name, "unreadable"),
        (unsafe.name, "unsafe"),
    }
    assert all(Path(r["file"]).name in captured for r in report)
    assert verify_cache(str(out)).ok
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stats"]["skipped_files"] == {"unreadable": 2, "unsafe": 1}
    original, imported = Eagle3CacheDataset(runs("eagle3")), Eagle3CacheDataset(str(out))
    kept = [i for i in range(LIMIT) if i != 1]
    assert len(imported) == len(kept)
    for j, i in enumerate(kept):
        want, got = original[i], imported[j]
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
    side = lambda d: ShardFile(str(Path(d) / "eagle3_side.safetensors"))  # noqa: E731
    a, b = side(runs("eagle3")), side(out)
    for key in ("embed_tokens", "lm_head", "selected_token_ids", "d2t", "t2d"):
        assert torch.equal(a.tensor(key), b.tensor(key)), key


@_needs("speculators")
def test_speculators_import_of_an_export_gives_back_the_cache_and_its_export(runs, tiny_models, tmp_path, capsys):
    from speccache.read.verify import verify_cache

    src, out, again = tmp_path / "sp", tmp_path / "imported", tmp_path / "again"
    _export(runs("layers"), src, "speculators", capsys, "--layers", "1,3,4")
    assert _import(src, out, "speculators", tiny_models("llama"), "--layers", "1,3,4") == 0
    assert verify_cache(str(out)).ok and not (out / "skipped_files.jsonl").exists()
    fields = {"aux": AUX, "pre": [L - 1]}
    original = LayerFeatureDataset(runs("layers"), fields, prenorm=True)
    imported = LayerFeatureDataset(str(out), fields, prenorm=True)
    assert len(imported) == LIMIT
    for i in range(LIMIT):
        want, got = original[i], imported[i]
        for key in ("input_ids", "loss_mask", "aux", "pre"):
            assert torch.equal(got[key], want[key]), key
    _export(str(out), again, "speculators", capsys, "--layers", "1,3,4")
    for i in range(LIMIT):
        name = f"hidden_states/hs_{i}.safetensors"
        assert (again / name).read_bytes() == (src / name).read_bytes()
    assert (again / "token_freq.pt").read_bytes() == (src / "token_freq.pt").read_bytes()


@_needs("speculators")
def test_speculators_import_skips_missing_truncated_and_mismatched_files(runs, tiny_models, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src, out = tmp_path / "sp", tmp_path / "imported"
    _export(runs("layers"), src, "speculators", capsys, "--layers", "1,3,4")
    hs = src / "hidden_states"
    (hs / "hs_0.safetensors").unlink()
    (hs / "hs_2.safetensors").write_bytes((hs / "hs_2.safetensors").read_bytes()[:100])
    other = load_file(hs / "hs_4.safetensors")
    other["token_ids"] = other["token_ids"].flip(0)
    save_file(other, hs / "hs_4.safetensors")
    assert _import(src, out, "speculators", tiny_models("llama"), "--layers", "1,3,4") == 0
    report = [json.loads(line) for line in (out / "skipped_files.jsonl").read_text().splitlines()]
    assert [(r["file"], r["reason"]) for r in report] == [
        ("hidden_states/hs_0.safetensors", "missing"),
        ("hidden_states/hs_2.safetensors", "unreadable"),
        ("hidden_states/hs_4.safetensors", "token_mismatch"),
    ]
    kept = LayerFeatureDataset(str(out), {"aux": AUX}, prenorm=True)
    original = LayerFeatureDataset(runs("layers"), {"aux": AUX}, prenorm=True)
    assert len(kept) == LIMIT - 3
    for j, i in enumerate([1, 3, 5, 6]):  # each kept sample names the row of the speculators dataset it came from
        assert kept[j]["source_row"].item() == i
        assert torch.equal(kept[j]["aux"], original[i]["aux"])


@_needs("specforge")
@pytest.mark.parametrize("fault", ["mid_shard_write:2", "before_seal"])
def test_a_killed_import_is_finished_by_resume_to_the_same_bytes(runs, tiny_models, tmp_path, capsys, fault):
    src, whole, killed = tmp_path / "sf", tmp_path / "whole", tmp_path / "killed"
    _export(runs("eagle3"), src, "specforge", capsys)
    assert _import(src, whole, "specforge", tiny_models("llama")) == 0
    argv = [
        "import",
        "--from",
        "specforge",
        "--model",
        tiny_models("llama"),
        "--shard-size",
        "3",
        str(src),
        str(killed),
    ]
    env = {**os.environ, "SPECCACHE_FAULT": fault, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "speccache.testing.faults", "speccache.cli", *argv],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == -9, run.stderr[-2000:]
    assert main([*argv[:-2], "--resume", str(src), str(killed)]) == 0
    assert file_tree(killed) == file_tree(whole)
    again = tmp_path / "again"  # and the imported cache exports to the very files it came from
    _export(str(whole), again, "specforge", capsys)
    assert _files(again) == _files(src)
    os.utime(specforge_path(str(src), 0))  # a source written since: a resume refuses it, naming the digest
    assert main([*argv[:-2], "--resume", str(src), str(killed)]) == 1
    assert "config.source_digest" in capsys.readouterr().err


@_needs("specforge")
def test_an_import_compresses_with_any_encoding_and_keeps_the_samples(runs, tiny_models, tmp_path, capsys):
    src, out = tmp_path / "sf", tmp_path / "zbf16"
    _export(runs("eagle3_bf16"), src, "specforge", capsys)
    encode = "aux_hidden_states=zbf16,last_hidden_state=fp8"
    assert _import(src, out, "specforge", tiny_models("llama"), "--layers", "1,3,4", "--encode", encode) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["encodings"] == {"aux_hidden_states": "zbf16", "last_hidden_state": "fp8"}
    original, imported = Eagle3CacheDataset(runs("eagle3_bf16")), Eagle3CacheDataset(str(out))
    for i in range(LIMIT):
        assert torch.equal(imported[i]["aux_hidden_states"], original[i]["aux_hidden_states"])  # lossless
        torch.testing.assert_close(
            imported[i]["last_hidden_state"], original[i]["last_hidden_state"], rtol=0.07, atol=0.02
        )


@_needs("specforge")
def test_a_view_exports_the_samples_it_selects(runs, tmp_path, capsys):
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    view, out = tmp_path / "view", tmp_path / "sf"
    assert main(["subset", runs("eagle3"), "--out", str(view), "--where", "tokens >= 60"]) == 0
    selected = Eagle3CacheDataset(str(view))
    assert 0 < len(selected) < LIMIT
    _export(str(view), out, "specforge", capsys)
    files = list_feature_files(str(out))
    assert len(files) == len(selected)
    for i, path in enumerate(files):
        raw = load_feature_file(path)
        assert raw["input_ids"].tolist() == selected[i]["input_ids"].tolist()
        assert torch.equal(raw["hidden_state"][0], selected[i]["last_hidden_state"])
