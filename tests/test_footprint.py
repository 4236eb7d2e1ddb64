"""The smallest cache: size estimates against real runs, measured fp8 error, encoded caches read like raw ones."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from speccache.cli import main
from speccache.demo import demo_data_path, ensure_demo_target
from speccache.format import LENGTHS_KEY, KeySpec, Manifest, load_manifest_json, manifest_path
from speccache.format.encoding.fp8 import fp8_error
from speccache.format.manifest import encoding_error_summary
from speccache.methods.eagle3 import Eagle3CacheDataset, build_eagle3_dataloader
from speccache.precompute import PrecomputeConfig, summary_line
from speccache.precompute.estimate import ZBF16_HI_FRACTION, estimate_cache, estimate_shards
from speccache.read.verify import inspect_cache, verify_cache
from speccache.write import NativeShardWriter

FLOAT_KEYS = ("aux_hidden_states", "last_hidden_state")
# Small enough for a loaded 2-core machine; two shards of 8 plus a partial one, a draft vocabulary smaller
# than the target's (so in_draft is stored too).
COMMON = ["--limit", "20", "--max-length", "128", "--shard-size", "8", "--batch-size", "4", "--draft-vocab-size", "512"]
ENCODES = {
    "raw": "",
    "fp8": "aux_hidden_states=fp8,last_hidden_state=fp8",
    "zbf16": "aux_hidden_states=zbf16,last_hidden_state=zbf16",
}


@pytest.fixture(scope="module")
def target():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield ensure_demo_target()


def args_for(target: str, encode: str, *extra: str) -> list[str]:
    return ["--model", target, "--data", demo_data_path(), *COMMON, "--encode", encode, *extra]


@pytest.fixture(scope="module")
def caches(target, tmp_path_factory):
    """The same run stored raw, fp8 and zbf16."""
    root = tmp_path_factory.mktemp("footprint")
    out = {}
    for name, encode in ENCODES.items():
        out[name] = str(root / name)
        assert main(["precompute", *args_for(target, encode), "--out", out[name], "--device", "cpu", "--quiet"]) == 0
    return out


def estimate_for(target: str, encode: str) -> dict:
    parser_args = ["estimate", *args_for(target, encode)]
    from speccache.cli import build_parser

    return estimate_cache(PrecomputeConfig.from_args(build_parser().parse_args(parser_args)))


def all_samples(cache_dir: str) -> list[dict[str, torch.Tensor]]:
    ds = Eagle3CacheDataset(cache_dir)
    return [ds[i] for i in range(len(ds))]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t


# --- estimate vs real -----------------------------------------------------------


@pytest.mark.parametrize("name", ["raw", "fp8"])
def test_estimate_matches_real_size(caches, target, name):
    est = estimate_for(target, ENCODES[name])
    manifest = load_manifest_json(manifest_path(caches[name]))
    real = manifest["total_bytes"]
    assert est["shard_bytes_low"] == est["shard_bytes_high"]
    assert abs(est["shard_bytes_low"] - real) <= 0.02 * real
    # headers included: only the digits of measured floats differ (fp8 error sums; this run's reduced draft
    # vocabulary also records each sample's mean entropy and top-1 probability), a few bytes per sample
    per_sample = 4 if name == "raw" else 8
    assert abs(est["shard_bytes_low"] - real) <= per_sample * manifest["num_samples"]
    assert est["side_file_bytes"] == manifest["side_files"]["eagle3_side.safetensors"]["bytes"]
    assert est["tokens"] == manifest["num_tokens"] and est["num_shards"] == len(manifest["shards"])
    for key in ("padded_probs_bytes", "padded_probs_longest_bytes", "longest_sample"):
        assert est[key] == manifest["stats"][key], key
    info = inspect_cache(caches[name])
    for key, k in info["keys"].items():
        assert est["keys"][key]["bytes_low"] == k["bytes"], key


def test_zbf16_real_size_is_inside_the_estimated_range(caches, target):
    est = estimate_for(target, ENCODES["zbf16"])
    real = load_manifest_json(manifest_path(caches["zbf16"]))["total_bytes"]
    assert est["shard_bytes_low"] < real < est["shard_bytes_high"]
    info = inspect_cache(caches["zbf16"])
    for key in FLOAT_KEYS:
        assert est["keys"][key]["bytes_low"] < info["keys"][key]["bytes"] < est["keys"][key]["bytes_high"]


def test_estimate_cli_text_and_json(target, capsys):
    assert main(["estimate", *args_for(target, ENCODES["zbf16"]), "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["zbf16_hi_fraction"] == list(ZBF16_HI_FRACTION)
    assert est["total_bytes_low"] == est["shard_bytes_low"] + est["side_file_bytes"]
    assert main(["estimate", *args_for(target, ENCODES["fp8"])]) == 0
    text = capsys.readouterr().out
    assert "aux_hidden_states" in text and "fp8" in text and "padded full-probability" in text


def test_estimate_shards_other_supervision_and_fixed_keys():
    schema = {
        "input_ids": KeySpec("input_ids", torch.int32, (), ragged=True),
        "topk_probs": KeySpec("topk_probs", torch.bfloat16, (4,), ragged=True, encoding="zbf16"),
        "label": KeySpec("label", torch.float32, (3,), encoding="fp8"),
    }
    est = estimate_shards(schema, [5, 7, 1], 2, 0.5)
    assert est["num_shards"] == 2
    assert est["keys"]["input_ids"] == 13 * 4
    assert est["keys"]["topk_probs"] == 13 * 4 + round(0.5 * 12 * 4) + round(0.5 * 1 * 4) + 8 * (3 + 2)
    assert est["keys"]["label"] == 3 * (3 + 4)


# --- measured fp8 error ----------------------------------------------------------


def test_fp8_error_in_manifest_matches_the_decoded_cache(caches):
    manifest = load_manifest_json(manifest_path(caches["fp8"]))
    error = manifest["stats"]["encoding_error"]
    assert set(error) == set(FLOAT_KEYS)
    raw, fp8 = all_samples(caches["raw"]), all_samples(caches["fp8"])
    for key in FLOAT_KEYS:
        want = fp8_error(torch.cat([s[key] for s in raw]), torch.cat([s[key] for s in fp8]))
        assert error[key]["rms"] == pytest.approx(want["rel_rms"], rel=1e-5)
        assert error[key]["max"] == pytest.approx(want["max_rel_to_row_amax"], rel=1e-6)
        assert 0.005 < error[key]["rms"] < 0.04 and error[key]["max"] < 2**-4 + 2**-8
    assert all(set(row["encoding_error"]) == set(FLOAT_KEYS) for row in manifest["shards"])
    line = summary_line(Manifest.read(caches["fp8"]), 1.0)
    assert "aux_hidden_states error: relative RMS" in line and "last_hidden_state error" in line
    for lossless in ("raw", "zbf16"):
        m = load_manifest_json(manifest_path(caches[lossless]))
        assert "encoding_error" not in m["stats"] and "encoding_error" not in summary_line(
            Manifest.read(caches[lossless]), 1.0
        )


def test_inspect_reports_fp8_error(caches, capsys):
    assert main(["inspect", caches["fp8"]]) == 0
    text = capsys.readouterr().out
    error = load_manifest_json(manifest_path(caches["fp8"]))["stats"]["encoding_error"]
    for key in FLOAT_KEYS:
        assert f"fp8 error  {key}: relative RMS {error[key]['rms']:.4f}, max {error[key]['max']:.4f}" in text
    assert main(["inspect", caches["zbf16"]]) == 0
    assert "fp8 error" not in capsys.readouterr().out


def test_fp8_error_survives_resume(caches, target, tmp_path):
    import shutil

    copy = str(tmp_path / "fp8")
    shutil.copytree(caches["fp8"], copy)
    os.unlink(os.path.join(copy, "shard-000001.safetensors"))
    assert (
        main(["precompute", *args_for(target, ENCODES["fp8"]), "--out", copy, "--device", "cpu", "--quiet", "--resume"])
        == 0
    )
    before = load_manifest_json(manifest_path(caches["fp8"]))
    after = load_manifest_json(manifest_path(copy))
    assert after["stats"]["encoding_error"] == before["stats"]["encoding_error"]
    assert after["shards"] == before["shards"]


# Squares of 1e25 overflow fp32 and of 1e-25 underflow it: those blocks are redone in float64.
@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 10.0), (torch.float32, 1e25), (torch.float32, 1e-25)])
def test_error_sums_gathered_across_writers_equal_one_pass(tmp_path, dtype, scale):
    g = torch.Generator().manual_seed(0)
    schema = {"x": KeySpec("x", dtype, (32,), ragged=True, encoding="fp8")}
    lengths = [[3, 9], [5, 0, 7]]
    shards = [{"x": (torch.randn(sum(ls), 32, generator=g) * torch.rand(32, generator=g) * scale).to(dtype),
               LENGTHS_KEY: torch.tensor(ls)} for ls in lengths]  # fmt: skip
    rows = []
    for rank, shard in enumerate(shards):  # one writer per rank, then all_gather (which pickles)
        writer = NativeShardWriter(schema)
        writer(str(tmp_path), rank, shard)
        rows += pickle.loads(pickle.dumps(list(writer.records.values())))
    from speccache.format.encoding import get_encoding

    decoded = []
    for shard, ls in zip(shards, lengths):
        offsets = torch.tensor([0, *np.cumsum(ls)])
        enc = get_encoding("fp8")
        decoded.append(enc.decode(enc.encode(shard["x"], offsets), offsets, 0, len(ls), dtype))
    want = fp8_error(torch.cat([s["x"] for s in shards]), torch.cat(decoded))
    got = encoding_error_summary(rows)["x"]
    assert got["rms"] == pytest.approx(want["rel_rms"], rel=1e-5)
    assert got["max"] == pytest.approx(want["max_rel_to_row_amax"], rel=1e-6)


# --- --encode errors fail before the model loads -----------------------------------


@pytest.mark.parametrize(
    "encode, extra, message",
    [
        ("hidden_states=fp8", [], "--encode names ['hidden_states'], which are not float features"),
        ("aux_hidden_states=zbf16", ["--dtype", "fp32"], "encoding 'zbf16' stores only bfloat16 values"),
        ("aux_hidden_states=gzip", [], "unknown encoding 'gzip'; choose one of"),
        ("aux_hidden_states", [], "must look like KEY=ENCODING"),
    ],
)
def test_bad_encode_fails_before_loading_the_model(target, tmp_path, monkeypatch, capsys, encode, extra, message):
    import speccache.engines.hf as hf_engine

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(hf_engine, "load_target", no_model)
    out = tmp_path / "cache"
    for command in (["precompute", "--out", str(out), "--device", "cpu"], ["estimate"]):
        assert main([command[0], *args_for(target, encode, *extra), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not out.exists()


# --- every reader decodes transparently --------------------------------------------


def test_zbf16_cache_equals_raw_bit_for_bit(caches):
    raw, z = all_samples(caches["raw"]), all_samples(caches["zbf16"])
    assert len(raw) == len(z) == 20
    for a, b in zip(raw, z):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(bits(a[key]), bits(b[key])), key


@pytest.mark.parametrize("name", ["fp8", "zbf16"])
def test_every_reader_path_decodes(caches, name, capsys):
    raw = Eagle3CacheDataset(caches["raw"])
    ds = Eagle3CacheDataset(caches[name], verify=True)
    indices = [19, 0, 8, 9, 3, 17]
    views = ds.__getitems__(indices)
    for i, view in zip(indices, views):
        item, want = ds[i], raw[i]
        assert item.keys() == want.keys() == view.keys()
        for key in item:
            assert torch.equal(bits(view[key]), bits(item[key])), key
            assert item[key].dtype == want[key].dtype and item[key].shape == want[key].shape
            if key in FLOAT_KEYS and name == "fp8":
                assert fp8_error(want[key], item[key])["rel_rms"] < 0.05
            else:
                assert torch.equal(bits(item[key]), bits(want[key])), key
    batch = next(iter(build_eagle3_dataloader(caches[name], batch_size=4, shuffle=False)))
    assert batch["aux_hidden_states"].dtype == torch.bfloat16 and batch["aux_hidden_states"].shape[0] == 4
    assert verify_cache(caches[name]).ok
    assert main(["verify", caches[name]]) == 0
    info = inspect_cache(caches[name])
    assert all(info["keys"][k]["encoding"] == name for k in FLOAT_KEYS)
    raw_bytes = inspect_cache(caches["raw"])["keys"]
    for key in FLOAT_KEYS:  # fp8: 1 byte a value plus a 4-byte row scale; zbf16: 1 + about 0.35 bytes a value
        assert info["keys"][key]["bytes"] < {"fp8": 0.55, "zbf16": 0.7}[name] * raw_bytes[key]["bytes"]
    capsys.readouterr()
