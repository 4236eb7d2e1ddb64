"""Layer-superset caches (``--method layers`` and the dspark/dflash/mtp presets) against a live forward, and the
per-method readers of a superset cache against dedicated per-method runs.

Caches are written by ``speccache precompute`` (in-process) from the tiny demo targets (8 layers, width 64);
the live side is an independent transformers forward with ``output_hidden_states=True`` on each sample alone.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import speccache.offline_cache as oc
from speccache.cli import main
from speccache.data import load_samples
from speccache.demo import demo_data_path
from speccache.errors import CacheFormatError
from speccache.format import ShardFile, load_manifest_json, manifest_path, shard_path
from speccache.methods.eagle3 import Eagle3CacheDataset, build_eagle3_dataloader
from speccache.methods.layers import (
    SIDE_FILE,
    LayerFeatureDataset,
    build_layer_dataloader,
    dflash_dataset,
    dflash_layer_ids,
    dspark_dataset,
    dspark_layer_ids,
    eagle3_dataset,
    mtp_dataset,
)
from speccache.methods.layers_producer import PRESETS, preset_selection

LIMIT = 6
MAX_LENGTH = 96
DATA = demo_data_path("sharegpt")
L = 8  # decoder layers of the tiny demo targets
FP32_BS1 = ["--batch-size", "1", "--shard-size", "3", "--dtype", "fp32"]
BS3 = ["--batch-size", "3", "--shard-size", "3", "--dtype", "fp32"]

RUNS = {
    # superset, exact: the embeddings, a middle layer, the last layer (post-norm) and its pre-norm output
    "llama_layers": ("llama", ["--method", "layers", "--layers=-1,0,3,7", "--last-prenorm", *FP32_BS1]),
    "qwen3_layers": ("qwen3", ["--method", "layers", "--layers=-1,2,6", "--last-hidden", *FP32_BS1]),
    "mistral_layers": ("mistral", ["--method", "layers", "--layers=-1,1,5,7", "--last-prenorm", *FP32_BS1]),
    # every preset on every architecture, exact
    **{
        f"{arch}_{preset}": (arch, ["--method", preset, *FP32_BS1])
        for arch in ("llama", "qwen3", "mistral")
        for preset in ("dspark", "dflash", "mtp")
    },
    "llama_dspark_bf16": ("llama", ["--method", "dspark", "--batch-size", "3", "--shard-size", "3", "--dtype", "bf16"]),
    # one superset against dedicated runs (right-padded batches of 3)
    "superset": ("llama", ["--method", "layers", "--layers", "1,2,3,4,5,6,7", *BS3]),
    "eagle3": ("llama", ["--method", "eagle3", *BS3]),
    "eagle3_bs1": ("llama", ["--method", "eagle3", "--draft-vocab-size", "300", *FP32_BS1]),
    "dspark": ("llama", ["--method", "dspark", *BS3]),
    "dflash": ("llama", ["--method", "dflash", *BS3]),
}


pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def model_dirs(tiny_models):
    return tiny_models


@pytest.fixture(scope="module")
def runs(precompute_runs):
    return precompute_runs(RUNS, DATA, LIMIT, MAX_LENGTH)


class Live:
    """The target loaded independently of speccache, run on each sample alone."""

    def __init__(self, model_dir: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.samples, _ = load_samples(DATA, AutoTokenizer.from_pretrained(model_dir), MAX_LENGTH, limit=LIMIT)
        with torch.no_grad():
            outputs = [
                self.model(input_ids=torch.tensor([s.input_ids]), output_hidden_states=True) for s in self.samples
            ]
        self.hidden = [[h[0] for h in o.hidden_states] for o in outputs]
        self.logits = [o.logits[0] for o in outputs]

    def feature(self, i: int, layer: int) -> torch.Tensor:
        """The DSpark/DFlash feature of layer id ``layer``: ``hidden_states[layer + 1]`` (``-1``: the embeddings)."""
        return self.hidden[i][layer + 1]


@pytest.fixture(scope="module")
def live(model_dirs):
    cache: dict[str, Live] = {}

    def get(arch: str) -> Live:
        if arch not in cache:
            cache[arch] = Live(model_dirs(arch))
        return cache[arch]

    return get


def _config(cache_dir: str) -> dict:
    return load_manifest_json(manifest_path(cache_dir))["config"]


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


# ---------------------------------------------------------------------------
# 1. every feature equals the live forward


@pytest.mark.parametrize(
    "name, arch, layers",
    [
        ("llama_layers", "llama", [-1, 0, 3, 7]),
        ("qwen3_layers", "qwen3", [-1, 2, 6]),
        ("mistral_layers", "mistral", [-1, 1, 5, 7]),
        *(
            (f"{arch}_{preset}", arch, layers)
            for arch in ("llama", "qwen3", "mistral")
            for preset, layers in (("dspark", [1, 2, 4, 6, 7]), ("dflash", [1, 2, 3, 4, 5]), ("mtp", []))
        ),
    ],
)
def test_fp32_batch_size_1_features_equal_live_hidden_states_exactly(runs, live, name, arch, layers):
    out, lv = runs(name), live(arch)
    assert _config(out)["layers"] == layers
    ds = LayerFeatureDataset(out, {f"f{layer}": [layer] for layer in layers} | {"last": ["last"]})
    norm = lv.model.get_decoder().norm
    prenorm = _config(out)["last_prenorm"]
    raw = LayerFeatureDataset(out, {"pre": [L - 1]}, prenorm=True) if prenorm else None
    assert len(ds) == LIMIT
    for i, s in enumerate(lv.samples):
        got = ds[i]
        assert got["input_ids"].tolist() == s.input_ids and got["loss_mask"].tolist() == [bool(m) for m in s.loss_mask]
        for layer in layers:
            assert got[f"f{layer}"].dtype == torch.float32
            assert torch.equal(got[f"f{layer}"], lv.feature(i, layer)), (name, layer)
        assert torch.equal(got["last"], lv.hidden[i][L])  # hidden_states[L] is the final-norm output
        if raw is not None:
            top = raw[i]["pre"]  # the last decoder layer before the norm: EAGLE-3's rule for id L-1
            with torch.no_grad():
                assert torch.equal(norm(top), lv.hidden[i][L])
            assert not torch.equal(top, lv.hidden[i][L])


def test_bf16_storage_is_the_fp32_result_rounded_within_one_ulp(runs, live):
    out, lv = runs("llama_dspark_bf16"), live("llama")
    ds = dspark_dataset(out)
    for i in range(LIMIT):
        got = ds[i]
        want = torch.cat([lv.feature(i, layer) for layer in dspark_layer_ids(L)], dim=-1)
        assert got["target_hidden_states"].dtype == torch.bfloat16
        assert int(_bf16_ulps(got["target_hidden_states"], want.to(torch.bfloat16)).max()) <= 1
        assert int(_bf16_ulps(got["target_last_hidden_states"], lv.hidden[i][L].to(torch.bfloat16)).max()) <= 1


def test_manifest_records_layers_conventions_and_architecture(runs, model_dirs):
    config = _config(runs("llama_layers"))
    assert config["method"] == "layers" and config["architecture"] == "LlamaForCausalLM"
    assert config["num_layers"] == L and config["model_type"] == "llama"
    features = config["features"]
    assert set(features) == {"layer_emb", "layer_00", "layer_03", "layer_07_prenorm", "last_hidden_state"}
    assert features["layer_emb"] == {"layer": -1, "norm": "embed", "convention": "hidden_states[0] (embedding output)"}
    assert features["layer_03"]["norm"] == "pre" and features["layer_03"]["convention"].startswith("hidden_states[4] ")
    assert features["last_hidden_state"]["layer"] == L - 1 and features["last_hidden_state"]["norm"] == "post"
    assert features["layer_07_prenorm"] == {
        "layer": 7,
        "norm": "pre",
        "convention": features["layer_07_prenorm"]["convention"],
    }
    manifest = load_manifest_json(manifest_path(runs("llama_layers")))
    assert manifest["cache_name"] == "layers"
    assert set(manifest["keys"]) == {"input_ids", "loss_mask", "source_row", *features}
    side = ShardFile(f"{runs('llama_layers')}/{SIDE_FILE}")
    model = AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32)
    assert torch.equal(side.tensor("lm_head"), model.get_output_embeddings().weight.detach())
    assert torch.equal(side.tensor("embed_tokens"), model.get_input_embeddings().weight.detach())


def test_preset_layer_choices():
    assert dspark_layer_ids(32) == [1, 8, 16, 24, 31]  # DSpark's build_target_layer_ids(32, 5)
    assert dspark_layer_ids(L) == [1, 2, 4, 6, 7]
    assert dflash_layer_ids(36) == [1, 9, 17, 25, 33]  # DFlash's build_target_layer_ids(36, 5)
    assert dflash_layer_ids(L) == [1, 2, 3, 4, 5]
    assert dflash_layer_ids(L, 1) == [4] and dspark_layer_ids(L, 1) == [7]


def _upstream_dflash(num_layers: int, k: int) -> list[int]:
    # DFlash's build_target_layer_ids (z-lab/dflash model/utils.py), the formula its 5 ids follow
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + (i * (num_layers - 4)) / (k - 1))) for i in range(k)]


@pytest.mark.parametrize("method", sorted(PRESETS))
def test_every_preset_picks_valid_distinct_layers_at_any_depth(method):
    for depth in range(1, 41):
        if method == "layers":  # no default ids: the user names them
            with pytest.raises(ValueError, match="--method layers needs --layers"):
                preset_selection(method, depth, None, False, False)
            continue
        selection = preset_selection(method, depth, None, False, False)  # LayerSelection refuses bad or repeated ids
        ids = list(selection.layers)
        assert all(0 <= i <= depth - 1 for i in ids), (depth, ids)
        if method == "dspark":
            assert len(ids) == min(5, max(1, depth - 1)) and ids[-1] == depth - 1, (depth, ids)
        elif method == "dflash":
            assert len(ids) == max(1, min(5, depth - 3)), (depth, ids)
            assert depth < 8 or ids == _upstream_dflash(depth, 5), (depth, ids)
            assert depth > 4 or ids == [depth // 2], (depth, ids)
        else:
            assert ids == [] and selection.last_hidden


# ---------------------------------------------------------------------------
# 2. one superset run serves every method's reader as its dedicated run does


def _batches(loader) -> list[dict[str, torch.Tensor]]:
    return list(loader)


def _assert_same_batches(a, b) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_superset_reader_equals_dedicated_run(runs, method):
    make = dspark_dataset if method == "dspark" else dflash_dataset
    superset = build_layer_dataloader(make(runs("superset")), batch_size=4, shuffle=False)
    dedicated = build_layer_dataloader(make(runs(method)), batch_size=4, shuffle=False)
    batches = _batches(superset)
    assert set(batches[0]) == {
        "input_ids",
        "loss_mask",
        "source_row",
        "target_hidden_states",
        "target_last_hidden_states",
        "attention_mask",
        "lengths",
    }
    assert batches[0]["target_hidden_states"].shape[-1] == 5 * 64
    _assert_same_batches(batches, _batches(dedicated))


def test_superset_eagle3_reader_equals_an_eagle3_cache(runs):
    superset = build_layer_dataloader(eagle3_dataset(runs("superset")), batch_size=4, shuffle=False)
    dedicated = build_eagle3_dataloader(runs("eagle3"), batch_size=4, shuffle=False)
    _assert_same_batches(_batches(superset), _batches(dedicated))


def test_mtp_reader_reads_the_last_hidden_state_of_any_layers_cache(runs):
    a, b = mtp_dataset(runs("superset")), mtp_dataset(runs("dspark"))
    for i in range(LIMIT):
        assert torch.equal(a[i]["last_hidden_state"], b[i]["last_hidden_state"])


def test_a_missing_layer_fails_at_open_naming_the_layers_present(runs):
    with pytest.raises(
        CacheFormatError,
        match=r"layer 0 \(its output\) is not in this cache; it holds layers 1 \(pre-norm, layer_01\), 2 ",
    ):
        dspark_dataset(runs("dspark"), layers=[0, 1])
    # EAGLE-3's rule for the last layer is its pre-norm output, which only --last-prenorm stores
    with pytest.raises(CacheFormatError, match=r"layer 7 before the final norm .*--last-prenorm"):
        eagle3_dataset(runs("superset"), aux_layers=[1, 3, 7])
    assert len(mtp_dataset(runs("llama_layers"))) == LIMIT  # layer L-1 of --layers is the final-norm output
    with pytest.raises(CacheFormatError, match=r"layer 0 \(its output\) .* it holds layers 7 \(post-norm"):
        dspark_dataset(runs("mistral_mtp"), layers=[0])


# ---------------------------------------------------------------------------
# 3. bad flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "layers"], "--method layers needs --layers"),
        (["--method", "layers", "--layers", "3,1"], "distinct increasing layer ids in [-1, 7]"),
        (["--method", "layers", "--layers", "8"], "distinct increasing layer ids in [-1, 7]"),
        (["--method", "mtp", "--layers", "1"], "--method mtp stores the last hidden state only"),
        (["--method", "dspark", "--supervision", "probs"], "--supervision probs is for --method eagle3"),
        (
            ["--method", "dspark", "--aux-layers", "1,2,3"],
            "--aux-layers and --draft-vocab-size are for --method eagle3",
        ),
        (["--method", "eagle3", "--layers", "1"], "--method eagle3 takes --aux-layers"),
        (["--method", "dspark", "--encode", "layer_05=fp8"], "--encode names ['layer_05']"),
    ],
)
def test_bad_layer_flags_are_refused_before_writing(model_dirs, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    argv = ["precompute", "--model", model_dirs("llama"), "--data", DATA, "--out", str(out), "--quiet", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------------
# 4. speccache estimate covers every preset


@pytest.mark.parametrize(
    "name", ["llama_layers", "llama_dspark", "qwen3_dflash", "mistral_mtp"]
)  # eagle3: test_footprint
def test_estimate_equals_the_written_size_for_every_preset(runs, model_dirs, capsys, name):
    out = runs(name)
    arch, extra = RUNS[name]
    argv = ["estimate", "--model", model_dirs(arch), "--data", DATA, "--limit", str(LIMIT),
            "--max-length", str(MAX_LENGTH), "--json", *extra]  # fmt: skip
    assert main(argv) == 0
    est = json.loads(capsys.readouterr().out)
    manifest = load_manifest_json(manifest_path(out))
    assert est["method"] == manifest["config"]["method"]
    assert est["shard_bytes_low"] == est["shard_bytes_high"] == manifest["total_bytes"]  # raw: byte for byte
    (side_name, side), *_ = manifest["side_files"].items()
    assert est["side_file"] == side_name and est["side_file_bytes"] == side["bytes"]
    assert set(est["keys"]) == set(manifest["keys"])


# ---------------------------------------------------------------------------
# 5. export to NeMo AutoModel's layouts, read by its own (unmodified) reader modules

NEMO_LLM = Path(
    os.environ.get("SPECCACHE_SEED", "/tmp/nemo/nemo_automodel/components/datasets/llm/offline_cache.py")
).parent
needs_nemo = pytest.mark.skipif(not (NEMO_LLM / "dspark_cache.py").is_file(), reason=f"no NeMo modules in {NEMO_LLM}")


def _upstream(name: str, monkeypatch) -> types.ModuleType:
    """NeMo's ``name`` module as shipped, its ``offline_cache`` import answered by speccache.offline_cache."""
    monkeypatch.setitem(sys.modules, "nemo_automodel.components.datasets.llm.offline_cache", oc)
    module = types.ModuleType(f"_nemo_{name}")
    exec(compile((NEMO_LLM / f"{name}.py").read_text(), f"{name}.py", "exec"), module.__dict__)
    return module


def _export(cache: str, out, to: str, capsys, *extra: str) -> None:
    assert main(["export", "--to", to, *extra, cache, str(out)]) == 0
    assert "about" in capsys.readouterr().out


@needs_nemo
def test_nemo_dspark_export_read_by_the_upstream_reader_equals_the_live_forward(
    runs, live, tmp_path, monkeypatch, capsys
):
    out, lv = tmp_path / "dspark", live("llama")
    _export(runs("llama_dspark"), out, "nemo-dspark", capsys)
    nemo = _upstream("dspark_cache", monkeypatch)
    manifest = nemo.read_manifest(str(out))
    assert manifest["target_layer_ids"] == dspark_layer_ids(L) and manifest["seq_length"] == MAX_LENGTH
    assert manifest["complete"] is True and manifest["target_hidden_dim"] == 5 * 64
    ds = nemo.CachedDSparkDataset(str(out))
    assert len(ds) == LIMIT
    for i, s in enumerate(lv.samples):
        got, t = ds[i], len(s.input_ids)
        assert got["input_ids"].dtype == torch.int64 and got["input_ids"].shape == (MAX_LENGTH,)
        assert got["input_ids"][:t].tolist() == s.input_ids and not got["input_ids"][t:].any()
        assert got["loss_mask"][:t].tolist() == list(s.loss_mask) and not got["loss_mask"][t:].any()
        want = torch.cat([lv.feature(i, layer) for layer in dspark_layer_ids(L)], dim=-1)
        assert torch.equal(got["target_hidden_states"][:t], want) and not got["target_hidden_states"][t:].any()
        assert torch.equal(got["target_last_hidden_states"][:t], lv.hidden[i][L])
    embed, head = nemo.read_target_weight_modules(str(out))
    assert torch.equal(head.weight, lv.model.get_output_embeddings().weight.detach())
    assert torch.equal(embed.weight, lv.model.get_input_embeddings().weight.detach())
    batch = next(iter(nemo.build_cached_dspark_dataloader(cache_dir=str(out), batch_size=4, shuffle=False)))
    assert batch["target_hidden_states"].shape == (4, MAX_LENGTH, 5 * 64)


@needs_nemo
@pytest.mark.parametrize("source", ["eagle3_bs1", "llama_layers"])
def test_nemo_eagle3_export_read_by_the_upstream_reader_equals_the_live_forward(
    runs, live, tmp_path, monkeypatch, capsys, source
):
    out, lv = tmp_path / "eagle3", live("llama")
    # a layers cache with --last-prenorm serves EAGLE-3 aux layer 7 (its output before the final norm)
    extra = ("--layers", "0,3,7") if source == "llama_layers" else ()
    _export(runs(source), out, "nemo-eagle3", capsys, *extra)
    nemo = _upstream("eagle3_cache", monkeypatch)
    ds = nemo.CachedEagle3Dataset(str(out))
    manifest = nemo.read_manifest(str(out))
    aux = manifest["aux_layer_ids"]
    selected = torch.tensor(manifest["selected_token_ids"])
    assert aux == ([0, 3, 7] if extra else [1, 3, 4]) and len(selected) == (1024 if extra else 300)
    norm = lv.model.get_decoder().norm
    for i, s in enumerate(lv.samples):
        # The draft's view, as NeMo's target.py shifts it: slot j holds row j's aux states and, shifted left by one
        # with a zero tail, token j + 1, its loss mask and row j + 1's distribution.
        got, t = ds[i], len(s.input_ids)
        assert set(got) == set(nemo.CACHE_KEYS)
        assert got["attention_mask"].tolist() == [1] * t + [0] * (MAX_LENGTH - t)
        assert got["input_ids"][:t].tolist() == [*s.input_ids[1:], 0]
        loss_mask = torch.tensor([*s.loss_mask[1:], 0], dtype=torch.bool)
        assert torch.equal(got["loss_mask"][:t].bool(), loss_mask)
        cached = got["aux_hidden_states"][:t].view(t, 3, 64)
        for j, layer in enumerate(aux):
            if layer == L - 1:
                with torch.no_grad():
                    assert torch.equal(norm(cached[:, j]), lv.hidden[i][L])
            else:
                assert torch.equal(cached[:, j], lv.feature(i, layer))
        shifted = torch.cat((lv.logits[i][1:], torch.zeros_like(lv.logits[i][:1])))
        want = torch.softmax(shifted[:, selected].float(), dim=-1)
        if extra:  # the whole vocabulary: the same product as the live LM head, bit for bit
            assert torch.equal(got["target_probs"][:t], want)
        else:
            torch.testing.assert_close(got["target_probs"][:t], want, rtol=1e-5, atol=1e-7)
        assert torch.allclose(got["target_probs"][t - 1], torch.full((len(selected),), 1 / len(selected)))
        in_draft = torch.isin(shifted.argmax(-1), selected)
        assert torch.equal(got["position_mask"][:t, 0], loss_mask & in_draft)
        assert not got["position_mask"][t:].any() and not got["target_probs"][t:].any()


def test_export_refuses_a_non_empty_directory_and_a_cache_without_the_layers(runs, tmp_path, capsys):
    (tmp_path / "x").write_text("")
    assert main(["export", "--to", "nemo-dspark", runs("llama_dspark"), str(tmp_path)]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert main(["export", "--to", "nemo-dspark", runs("eagle3"), str(tmp_path / "o")]) == 1
    assert "reads a layers cache" in capsys.readouterr().err
    assert main(["export", "--to", "nemo-eagle3", runs("mistral_mtp"), str(tmp_path / "o")]) == 1
    assert "is not in this cache; it holds layers" in capsys.readouterr().err


def _imported_position(nemo_sample: dict, t: int, full_vocab: bool) -> torch.Tensor:
    """The row-aligned position mask of an imported NeMo sample of ``t`` slots: row r's supervision counts when the
    next row's token is generated (NeMo's shifted loss mask at slot r + 1) and, with a reduced draft vocabulary,
    where NeMo's position mask says row r's argmax is in it (unknown, so left out, where its slot is unsupervised)."""
    loss = nemo_sample["loss_mask"][: t - 1].bool()
    mask = torch.zeros_like(loss)
    mask[:-1] = loss[1:]
    return mask if full_vocab else mask & nemo_sample["position_mask"][: t - 1, 0]


@needs_nemo
@pytest.mark.parametrize("source", ["eagle3_bs1", "llama_layers"])
def test_import_of_a_nemo_eagle3_cache_gives_back_what_its_reader_yields(runs, tmp_path, monkeypatch, capsys, source):
    nemo_dir, imported = tmp_path / "nemo", tmp_path / "imported"
    _export(runs(source), nemo_dir, "nemo-eagle3", capsys, *(("--layers", "0,3,7") if source == "llama_layers" else ()))
    assert main(["import", "--from", "nemo-eagle3", str(nemo_dir), str(imported)]) == 0
    nemo = _upstream("eagle3_cache", monkeypatch).CachedEagle3Dataset(str(nemo_dir))
    ds = Eagle3CacheDataset(str(imported))
    assert _config(str(imported))["supervision"] == "probs" and len(ds) == len(nemo) == LIMIT
    original = Eagle3CacheDataset(runs(source)) if source == "eagle3_bs1" else eagle3_dataset(runs(source), [0, 3, 7])
    for i in range(LIMIT):
        # T NeMo slots make T - 1 rows: row r is slot r + 1's aux states and slot r's token, mask and distribution
        want, got = nemo[i], ds[i]
        t = int(want["attention_mask"].sum())
        assert got["input_ids"].tolist() == want["input_ids"][: t - 1].tolist()
        assert torch.equal(got["loss_mask"], want["loss_mask"][: t - 1].bool())
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"][1:t])
        assert torch.equal(got["target_probs"], want["target_probs"][: t - 1])
        assert torch.equal(got["position_mask"], _imported_position(want, t, full_vocab=source == "llama_layers"))
        # and it is the original cache's sample from its second token on
        assert torch.equal(got["input_ids"], original[i]["input_ids"][1:].to(got["input_ids"].dtype))
        assert torch.equal(got["aux_hidden_states"], original[i]["aux_hidden_states"][1:])


def _nemo_eagle3_cache(src: str, num_samples: int) -> str:
    """A NeMo EAGLE-3 cache of 5 samples in shards of 2 (full draft vocabulary) whose manifest says ``num_samples``."""
    g = torch.Generator().manual_seed(0)
    n, seq, vocab = 5, 6, 16
    attention = (torch.arange(seq)[None] < torch.tensor([6, 3, 1, 5, 2])[:, None]).long()
    loss = attention * torch.randint(0, 2, (n, seq), generator=g)
    stored = {
        "input_ids": torch.randint(0, vocab, (n, seq), generator=g) * attention,
        "attention_mask": attention,
        "loss_mask": loss,
        "aux_hidden_states": torch.randn(n, seq, 12, generator=g).to(torch.bfloat16),
        "position_mask": loss.bool()[..., None],
        "target_probs": torch.softmax(torch.randn(n, seq, vocab, generator=g), -1).to(torch.bfloat16),
    }
    for index, start in enumerate(range(0, n, 2)):
        shard = {key: v[start : start + 2] for key, v in stored.items()}
        oc.write_tensor_shard(src, index, shard, tuple(stored), "EAGLE-3")
    fields = {"num_samples": num_samples, "shard_size": 2, "draft_vocab_size": vocab, "dtype": "bf16"}
    fields |= {"target_vocab_size": vocab, "aux_hidden_dim": 12, "aux_layer_ids": [1, 2, 3], "seq_length": seq}
    oc.write_manifest(src, {**fields, "target_model": "m", "selected_token_ids": list(range(vocab))}, 2)
    save_file, _ = oc.load_safetensors("EAGLE-3")
    save_file({"weight": torch.randn(vocab, 4, generator=g)}, os.path.join(src, "target_embeddings.safetensors"))
    return src


def test_import_checks_the_nemo_counts_and_every_shard_before_writing(tmp_path, capsys):
    src = _nemo_eagle3_cache(str(tmp_path / "nemo"), 5)
    assert main(["import", "--from", "nemo-eagle3", src, str(tmp_path / "good")]) == 0
    assert main(["verify", str(tmp_path / "good")]) == 0
    capsys.readouterr()
    for name, num_samples, damage, message in [
        ("more", 6, None, "shard-000002.safetensors: tensor 'input_ids' holds 1 samples, expected 2"),
        ("fewer", 3, None, "declares 3 samples (2 shards of 2) but found shard indices [0, 1, 2]"),
        ("torn", 5, 1, "shard-000001.safetensors: not a readable safetensors file"),
    ]:
        src = _nemo_eagle3_cache(str(tmp_path / f"nemo-{name}"), num_samples)
        if damage is not None:
            path = shard_path(src, damage)
            os.truncate(path, os.path.getsize(path) - 16)
        out = tmp_path / f"imported-{name}"
        assert main(["import", "--from", "nemo-eagle3", src, str(out)]) == 1, name
        err = capsys.readouterr().err
        assert err.startswith("speccache import: error: ") and message in err and "Traceback" not in err, err
        assert not out.exists() or not os.listdir(out), name  # refused before anything was written


def test_a_resumed_layers_run_writes_the_same_bytes(runs, tmp_path):
    done = Path(runs("superset"))
    copy = tmp_path / "resumed"
    copy.mkdir()
    for name in os.listdir(done):
        if name != "shard-000001.safetensors":  # as if the run had stopped before its last shard
            (copy / name).write_bytes((done / name).read_bytes())
    arch, extra = RUNS["superset"]
    argv = ["precompute", "--model", str(Path(_config(str(done))["model"])), "--data", DATA, "--out", str(copy),
            "--limit", str(LIMIT), "--max-length", str(MAX_LENGTH), "--model-dtype", "fp32", "--quiet", "--resume",
            *extra]  # fmt: skip
    assert main(argv) == 0
    assert sorted(os.listdir(copy)) == sorted(os.listdir(done))
    for name in os.listdir(done):
        assert (copy / name).read_bytes() == (done / name).read_bytes(), name


@needs_nemo
def test_import_of_a_top_k_nemo_eagle3_cache_written_by_the_upstream_module(tmp_path, monkeypatch):
    nemo = _upstream("eagle3_cache", monkeypatch)
    n, seq, vocab, draft, k = 5, 6, 40, 16, 4
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 1, 5, 2])
    attention = (torch.arange(seq)[None] < lengths[:, None]).long()
    loss = attention * torch.randint(0, 2, (n, seq), generator=g)
    position = (loss.bool() & (torch.rand(n, seq, generator=g) < 0.7))[..., None]
    values, indices = nemo.compress_target_probs(torch.softmax(torch.randn(n, seq, draft, generator=g), -1), k)
    stored = {
        "input_ids": torch.randint(0, vocab, (n, seq), generator=g) * attention,
        "attention_mask": attention,
        "loss_mask": loss,
        "aux_hidden_states": (torch.randn(n, seq, 12, generator=g) * attention[..., None]).to(torch.bfloat16),
        "position_mask": position,
        "target_probs_values": values.to(torch.bfloat16),
        "target_probs_indices": indices,
    }
    src = str(tmp_path / "nemo")
    for index, start in enumerate(range(0, n, 2)):
        nemo.write_shard(src, index, {key: v[start : start + 2] for key, v in stored.items()})
    selected = sorted(torch.randperm(vocab, generator=g)[:draft].tolist())
    fields = {"num_samples": n, "shard_size": 2, "draft_vocab_size": draft, "target_probs_topk": k, "dtype": "bf16"}
    fields |= {"target_vocab_size": vocab, "aux_hidden_dim": 12, "aux_layer_ids": [1, 2, 3], "seq_length": seq}
    nemo.write_manifest(src, {**fields, "target_model": "m", "selected_token_ids": selected})
    nemo.write_target_embeddings(src, torch.randn(vocab, 4, generator=g))
    out = str(tmp_path / "imported")
    assert main(["import", "--from", "nemo-eagle3", src, out]) == 0
    assert _config(out)["supervision"] == f"topk:{k}" and _config(out)["hidden_size"] == 4
    reader, ds = nemo.CachedEagle3Dataset(src), Eagle3CacheDataset(out)
    assert torch.equal(ShardFile(f"{out}/eagle3_side.safetensors").tensor("selected_token_ids"), torch.tensor(selected))
    for i in range(n):  # T slots make T - 1 rows (a one-token sample none)
        want, got, t = reader[i], ds[i], int(lengths[i])
        assert got["input_ids"].tolist() == want["input_ids"][: t - 1].tolist()
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"][1:t])
        assert torch.equal(got["target_probs"], want["target_probs"][: t - 1])
        assert torch.equal(got["position_mask"], _imported_position(want, t, full_vocab=False))
