"""Readers and the reference trainer on vision-language caches (docs/vision.md, "What a draft trainer reads"):
the batches hand the draft the cache's ``positions``, ``image_embeds`` and ``image_mask`` aligned to its slots
(padded and packed); an M-RoPE draft rotates as the target family does and, at equal rows, as the 1-D draft; its
training-time-test chain sits where serving puts it; ``speccache train --draft-inputs served|merged|tokens``
trains end to end and saves what vLLM needs to build an M-RoPE draft; on a text cache the three are one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, DynamicCache

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.demo.real_target import ensure_real_target
from speccache.errors import UsageError
from speccache.format import FORMAT_VERSION
from speccache.methods.eagle3 import Eagle3CacheDataset, TargetHead, build_eagle3_dataloader, draft_view
from speccache.offline_cache import CachedTensorDataset
from speccache.testing.vlm import ensure_vlm_target
from speccache.train.draft import DraftConfig, Eagle3Draft, load_draft
from speccache.train.trainer import draft_for_cache, make_optimizer, train_steps
from support.cachecmp import all_samples
from support.vision import write_image_data

pytestmark = pytest.mark.usefixtures("offline_single_thread")

MROPE = ("qwen2_5_vl", "qwen3_vl")  # the M-RoPE families: their caches hold positions
FLAGS = ["--aux-layers", "0,1,2", "--dtype", "fp32", "--model-dtype", "fp32", "--batch-size", "2", "--shard-size", "2"]
FLAGS += ["--device", "cpu", "--quiet"]
ROWS = [  # (images, question, answer): image rows of one and two images, and a text row
    (["a.png"], "What is red?", "A square."),
    ([], "Tell me a story, a longer one please.", "Once upon a time."),
    (["b.png"], "And this?", "A line."),
    (["a.png", "b.png"], "Compare them.", "Two pictures."),
]
TRAIN = ["--batch-size", "2", "--ttt-steps", "2", "--device", "cpu", "--seed", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_data(tmp_path_factory.mktemp("vision-train-data"), ROWS)


@pytest.fixture(scope="module")
def caches(data, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each M-RoPE family's (target dir, cache dir), precomputed through the CLI."""
    out = {}
    for family in MROPE:
        model = ensure_vlm_target(family, ensure_real_target())
        cache = str(tmp_path_factory.mktemp(family) / "cache")
        assert main(["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", cache, *FLAGS]) == 0
        out[family] = (model, cache)
    return out


@pytest.fixture(scope="module")
def embeds_cache(caches) -> tuple[str, int]:
    """The Qwen2.5-VL cache (it holds image_embeds) and its model's image token id."""
    model, cache = caches["qwen2_5_vl"]
    return cache, int(AutoConfig.from_pretrained(model).image_token_id)


@pytest.fixture(scope="module")
def text_only_cache(caches, data, tmp_path_factory) -> str:
    """The same rows for the Qwen2.5-VL target with --no-vision-inputs: no image_embeds, no positions."""
    model, _ = caches["qwen2_5_vl"]
    cache = str(tmp_path_factory.mktemp("text-only") / "cache")
    argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", cache, *FLAGS]
    assert main([*argv, "--no-vision-inputs"]) == 0
    return cache


@pytest.mark.parametrize("family", MROPE)
def test_a_padded_batch_hands_each_slot_its_state_position(family, caches):
    _, cache = caches[family]
    samples = all_samples(cache)
    batch = next(iter(build_eagle3_dataloader(cache, batch_size=len(samples), shuffle=False)))
    view = draft_view(batch, TargetHead.from_cache(cache))
    assert "image_mask" in view and "image_embeds" in view
    for b, sample in enumerate(samples):
        n = sample["input_ids"].shape[0]
        assert torch.equal(view["positions"][b, : n - 1], sample["positions"][: n - 1])  # slot j: positions[j]
        assert not view["positions"][b, n:].any()  # padding
    assert any((s["positions"][:, 0] != s["positions"][:, 1]).any() for s in samples)  # real 3-D positions


@pytest.mark.parametrize("which", ["qwen3_vl", "embeds"])
def test_a_packed_batch_holds_the_cached_rows(which, caches, embeds_cache):
    cache = embeds_cache[0] if which == "embeds" else caches[which][1]
    dataset = Eagle3CacheDataset(cache)
    batch = dataset.collator(pack=True)(dataset.__getitems__(range(len(dataset))))
    samples = all_samples(cache)
    # a packed draft takes each sample's own rows for its position ids, not an arange from cu_seqlens
    assert torch.equal(batch["positions"], torch.cat([s["positions"] for s in samples]))
    if which == "embeds":
        assert torch.equal(batch["image_embeds"], torch.cat([s["image_embeds"] for s in samples]))
        assert torch.equal(batch["image_mask"], torch.cat([s["input_ids"] == embeds_cache[1] for s in samples]))


def test_image_embeds_and_image_mask_are_the_next_tokens(embeds_cache):
    cache, image_token_id = embeds_cache
    samples = all_samples(cache)
    batch = next(iter(build_eagle3_dataloader(cache, batch_size=len(samples), shuffle=False)))
    view = draft_view(batch, TargetHead.from_cache(cache))
    for b, sample in enumerate(samples):
        n = sample["input_ids"].shape[0]
        assert torch.equal(view["image_mask"][b, : n - 1], sample["input_ids"][1:] == image_token_id)
        assert torch.equal(view["image_embeds"][b, : n - 1], sample["image_embeds"][1:])
        assert not view["image_mask"][b, n - 1 :].any()
    assert view["image_mask"].any() and not view["image_mask"].all()


def _draft(config: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    hidden, vocab = config.hidden_size, 32
    return Eagle3Draft(
        config,
        torch.randn(vocab, hidden),
        torch.randn(vocab, hidden),
        torch.zeros(vocab, dtype=torch.long),
        torch.ones(vocab, dtype=torch.bool),
    )


def _shape(**kw) -> DraftConfig:
    return DraftConfig(
        hidden_size=64,
        vocab_size=32,
        draft_vocab_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=64,
        **kw,
    )


@pytest.mark.parametrize("family", MROPE)
def test_the_mrope_draft_rotates_as_the_target_family(family, caches):
    model_dir, cache = caches[family]
    draft, _ = draft_for_cache(cache, draft_inputs="served")
    target = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    text = target.config.get_text_config()
    assert draft.uses_mrope
    assert draft.config.mrope_section == text.rope_parameters["mrope_section"]
    assert draft.config.mrope_interleaved == (family == "qwen3_vl")
    positions = torch.stack([torch.arange(12), torch.arange(12) // 3, torch.arange(12) % 4 + 2], dim=-1)  # [S, 3]
    x = torch.zeros(1, 12, 64)
    ours = draft.rotary(x, draft.position_ids(positions, 1))
    theirs = target.model.language_model.rotary_emb(x, positions.T[:, None])  # the target's [3, B, S]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # and as vLLM's MRotaryEmbedding lays the sections out: frequency i rotates by the row its section names
    # (Qwen2.5-VL: consecutive sections t, h, w; Qwen3-VL: interleaved t h w t h w ..., each row up to 3 * section)
    section, half = draft.config.mrope_section, draft.config.head_dim // 2
    if draft.config.mrope_interleaved:
        rows = [i % 3 if i < 3 * section[i % 3] else 0 for i in range(half)]
    else:
        rows = [k for k, n in enumerate(section) for _ in range(n)]
    inv_freq = 1.0 / (draft.config.rope_theta ** (torch.arange(0, half * 2, 2).float() / (half * 2)))
    angles = positions[:, rows].float() * inv_freq
    assert torch.allclose(ours[0][0], torch.cat([angles, angles], -1).cos(), atol=1e-6, rtol=0)


def test_equal_rows_give_the_1d_draft(caches):
    """Qwen2.5-VL's sections at a text token's positions (three equal rows) rotate as plain RoPE."""
    mrope, plain = _draft(_shape(mrope_section=[2, 3, 3])), _draft(_shape())
    plain.load_state_dict(mrope.state_dict())
    embeds, states = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    p = torch.arange(3, 10)
    want = plain.layer(embeds, states, p, mask)
    assert torch.allclose(mrope.layer(embeds, states, p[:, None].expand(-1, 3), mask), want, atol=1e-6, rtol=0)
    assert torch.equal(
        mrope.layer(embeds, states, p, mask), mrope.layer(embeds, states, p[:, None].expand(-1, 3), mask)
    )


@pytest.mark.parametrize("mrope", [[2, 3, 3], None])
def test_a_training_chain_step_sits_where_serving_puts_it(mrope):
    """Step 1 of the training-time test at slot ``j`` equals a served chain started at slot ``j - 1``: the true
    context's keys, then the drafted slot at the start's position advanced by one (every row)."""
    draft = _draft(_shape(mrope_section=mrope))
    torch.manual_seed(1)
    length = 9
    hidden, ids = torch.randn(1, length, 192), torch.randint(0, 32, (1, length))
    rows = torch.stack([torch.arange(length), torch.arange(length) // 2, torch.arange(length) % 3], dim=-1)
    positions = rows[None] if mrope else torch.arange(length)[None]
    trained = draft.states(hidden, ids, steps=2, positions=positions)[1]
    embeds, fused = draft.embed_tokens(ids), draft.fc(hidden)
    for j in (3, 8):
        cache = DynamicCache()
        context = draft.layer(
            embeds[:, :j], fused[:, :j], positions[0, :j], torch.ones(j, j, dtype=torch.bool).tril(), cache
        )
        served = draft.layer(
            embeds[:, j : j + 1],
            context[:, j - 1 :],
            positions[0, j - 1 : j] + 1,
            torch.ones(1, j + 1, dtype=torch.bool),
            cache,
        )
        assert torch.allclose(trained[:, j], served[:, 0], atol=1e-5, rtol=0)


def _config(out: str) -> dict:
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("family", MROPE)
def test_train_served_and_tokens_end_to_end(family, caches, tmp_path):
    _, cache = caches[family]
    for mode in ("served", "tokens"):
        out = str(tmp_path / mode)
        assert main(["train", cache, "--out", out, "--draft-inputs", mode, *TRAIN]) == 0
        config = _config(out)
        assert config["speccache"]["training"]["draft_inputs"] == mode
        draft = load_draft(out)
        if mode == "served":
            section = config["rope_parameters"]["mrope_section"]
            assert section == config["rope_scaling"]["mrope_section"] == draft.config.mrope_section
            assert config["rope_parameters"].get("mrope_interleaved", False) == (family == "qwen3_vl")
            assert 2 * sum(section) == config["head_dim"] and draft.uses_mrope
        else:
            assert "rope_parameters" not in config and "rope_scaling" not in config and not draft.uses_mrope
        assert draft.config == draft_for_cache(cache, draft_inputs=mode)[0].config  # mrope fields and theta too
        saved = load_file(os.path.join(out, "model.safetensors"))
        assert all(torch.equal(saved[k], v) for k, v in draft.state_dict().items())


def test_train_merged_reads_the_image_embeds(embeds_cache, text_only_cache, tmp_path, capsys):
    cache, _ = embeds_cache
    out = str(tmp_path / "merged")
    assert main(["train", cache, "--out", out, "--draft-inputs", "merged", *TRAIN]) == 0
    assert _config(out)["rope_parameters"]["mrope_section"] == load_draft(out).config.mrope_section
    # merged and served differ exactly by the image slots' embeddings
    losses = {}
    for mode in ("merged", "served"):
        draft, head = draft_for_cache(cache, draft_inputs=mode)
        batches = build_eagle3_dataloader(cache, batch_size=4, shuffle=False)
        losses[mode] = train_steps(draft, batches, head, make_optimizer(draft, 1e-3), 2, draft_inputs=mode)
    assert losses["merged"] != losses["served"]
    refused = str(tmp_path / "refused")
    assert main(["train", text_only_cache, "--out", refused, "--draft-inputs", "merged", *TRAIN]) == 2
    assert "holds no image_embeds" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(refused, "config.json"))
    with pytest.raises(UsageError, match="use --draft-inputs served"):
        draft_for_cache(text_only_cache, draft_inputs="merged")


def test_an_unknown_mode_is_refused(caches, tmp_path, capsys):
    out = str(tmp_path / "d")
    assert main(["train", caches["qwen3_vl"][1], "--out", out, "--draft-inputs", "pixels", *TRAIN]) == 2
    assert "unknown --draft-inputs 'pixels'; choose one of served, merged, tokens" in capsys.readouterr().err


def test_a_text_cache_trains_identically_in_every_mode(tiny_models, tmp_path):
    cache = str(tmp_path / "cache")
    args = ["--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--limit", "8", "--out", cache]
    assert main(["precompute", *args, "--dtype", "fp32", "--model-dtype", "fp32", "--device", "cpu", "--quiet"]) == 0
    losses = {}
    for mode in ("served", "merged", "tokens"):
        out = str(tmp_path / mode)
        assert main(["train", cache, "--out", out, "--draft-inputs", mode, *TRAIN]) == 0
        with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
            losses[mode] = [json.loads(line)["loss"] for line in f]
        assert not load_draft(out).uses_mrope
    assert losses["served"] == losses["merged"] == losses["tokens"]


def test_the_nemo_drop_in_hands_the_cached_positions_as_they_are(caches):
    _, cache = caches["qwen2_5_vl"]
    dataset = CachedTensorDataset(cache, "eagle3", FORMAT_VERSION, ("input_ids", "positions"))
    assert all(torch.equal(dataset[i]["positions"], s["positions"]) for i, s in enumerate(all_samples(cache)))


def test_an_unreadable_target_config_is_refused_naming_the_way_out(caches, monkeypatch):
    def missing(*args, **kwargs):
        raise OSError("no config.json")

    monkeypatch.setattr(AutoConfig, "from_pretrained", missing)
    with pytest.raises(UsageError, match="holds M-RoPE positions, and the draft takes its sections from the"):
        draft_for_cache(caches["qwen3_vl"][1], draft_inputs="served")
    assert not draft_for_cache(caches["qwen3_vl"][1], draft_inputs="tokens")[0].uses_mrope  # reads no config
