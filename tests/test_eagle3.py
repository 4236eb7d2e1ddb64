"""EAGLE-3 cache contents against a live forward of the same target, supervision modes, draft vocab, reader.

Every cache here is written by ``speccache precompute`` (in-process) from tiny
random targets built with :func:`speccache.demo.build_tiny_model_dir` and the
bundled demo data, then compared token by token with an independent forward of
the target on each sample alone (``output_hidden_states=True``).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speccache.data import load_samples
from speccache.demo import demo_data_path
from speccache.errors import CacheFormatError
from speccache.format import ShardFile, load_manifest_json, manifest_path
from speccache.methods.eagle3 import (
    SIDE_FILE,
    Eagle3CacheDataset,
    Supervision,
    TargetHead,
    build_eagle3_dataloader,
    check_aux_layers,
    default_aux_layers,
    draft_view,
)
from speccache.methods.eagle3_producer import select_draft_vocab, vocab_mapping
from speccache.read import CacheDataset
from speccache.read.sampler import LocalityShuffleSampler

LIMIT = 8
MAX_LENGTH = 128  # the first 8 demo rows are 81..240 tokens long: some get truncated, batches of 4 are right-padded
DATA = demo_data_path("sharegpt")
NUM_LAYERS = 8  # the tiny demo shape
SPECIALS = (0, 1, 2, 3)  # <unk> <s> </s> <pad> of the demo tokenizer

# Each run: architecture, extra precompute flags. Built lazily, once per module.
RUNS = {
    # batch size 1, fp32: exact equality with a live forward
    "llama_bs1": ("llama", ["--batch-size", "1", "--shard-size", "3", "--dtype", "fp32", "--draft-vocab-size", "300"]),
    "qwen3_bs1": ("qwen3", ["--batch-size", "1", "--shard-size", "4", "--dtype", "fp32", "--aux-layers", "0,2,6"]),
    "mistral_bs1": ("mistral", ["--batch-size", "1", "--shard-size", "4", "--dtype", "fp32", "--aux-layers", "2,4,7"]),
    "llama_bf16_bs1": ("llama", ["--batch-size", "1", "--shard-size", "8", "--dtype", "bf16"]),
    "llama_topk_bs1": (
        "llama",
        ["--batch-size", "1", "--shard-size", "4", "--dtype", "fp32", "--supervision", "topk:8"],
    ),
    # batch size 4 (right-padded batches)
    "llama_bs4": ("llama", ["--batch-size", "4", "--shard-size", "4", "--dtype", "fp32"]),
    "llama_probs_bs4": (
        "llama",
        [
            "--batch-size",
            "4",
            "--shard-size",
            "4",
            "--dtype",
            "fp32",
            "--supervision",
            "probs",
            "--draft-vocab-size",
            "300",
        ],
    ),
    "llama_bf16_bs4": ("llama", ["--batch-size", "4", "--shard-size", "8", "--dtype", "bf16"]),
}


pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def model_dirs(tiny_models):
    return tiny_models


@pytest.fixture(scope="module")
def runs(precompute_runs):
    return precompute_runs(RUNS, DATA, LIMIT, MAX_LENGTH)


class Live:
    """A target loaded independently of speccache, run on each sample alone."""

    def __init__(self, model_dir: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.samples, self.stats = load_samples(DATA, self.tokenizer, MAX_LENGTH, limit=LIMIT)
        self.outputs = []
        with torch.no_grad():
            for s in self.samples:
                ids = torch.tensor([s.input_ids])
                out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
                base = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
                self.outputs.append(
                    {"hidden_states": [h[0] for h in out.hidden_states], "last": base[0], "logits": out.logits[0]}
                )

    def aux(self, i: int, layers: list[int]) -> torch.Tensor:
        """Concatenated outputs of decoder layers ``layers`` (before the final norm) for sample ``i``."""
        hs = self.outputs[i]["hidden_states"]
        assert all(layer < len(hs) - 2 for layer in layers), "hidden_states[L] is after the final norm"
        return torch.cat([hs[layer + 1] for layer in layers], dim=-1)


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


def _side(cache_dir: str) -> dict[str, torch.Tensor]:
    side = ShardFile(os.path.join(cache_dir, SIDE_FILE))
    return {k: side.tensor(k).clone() for k in side.keys()}


def _next_token_supervised(loss_mask: torch.Tensor) -> torch.Tensor:
    """Row t's supervision (the prediction of token t + 1) counts when token t + 1 is generated."""
    return torch.cat([loss_mask[1:].bool(), torch.zeros(1, dtype=torch.bool)])


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 representable steps between two bf16 tensors."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _expected_selection(samples, vocab: int, size: int, specials) -> list[int]:
    """The documented draft-vocab order, computed independently: specials, then count desc / id asc, then id asc."""
    counts = Counter(t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m)
    order = list(dict.fromkeys(specials))
    rest = sorted((i for i in range(vocab) if i not in order), key=lambda i: (-counts.get(i, 0), i))
    return sorted((order + rest)[:size])


# ---------------------------------------------------------------------------
# 1. equivalence with a live forward


def _check_tokens(ds, lv: Live) -> None:
    assert len(ds) == len(lv.samples) == LIMIT
    for i, s in enumerate(lv.samples):
        got = ds[i]
        assert got["input_ids"].dtype == torch.int32 and got["loss_mask"].dtype == torch.bool
        assert got["input_ids"].tolist() == s.input_ids
        assert got["loss_mask"].tolist() == [bool(m) for m in s.loss_mask]


@pytest.mark.parametrize(
    "name, arch, aux",
    [("llama_bs1", "llama", [1, 3, 4]), ("qwen3_bs1", "qwen3", [0, 2, 6]), ("mistral_bs1", "mistral", [2, 4, 7])],
)
def test_batch_size_1_equals_live_forward_exactly(runs, live, name, arch, aux):
    out = runs(name)
    lv = live(arch)
    assert _config(out)["aux_layers"] == aux
    ds = Eagle3CacheDataset(out)
    _check_tokens(ds, lv)
    lm_head = lv.model.get_output_embeddings()
    norm = lv.model.get_decoder().norm
    side = _side(out)
    selected = side["selected_token_ids"]
    for i, o in enumerate(lv.outputs):
        got = ds[i]
        t = len(lv.samples[i].input_ids)
        assert got["aux_hidden_states"].dtype == torch.float32 and got["aux_hidden_states"].shape == (t, 3 * 64)
        low = [layer for layer in aux if layer < NUM_LAYERS - 1]
        cached_aux = got["aux_hidden_states"].view(t, 3, 64)
        assert torch.equal(cached_aux[:, : len(low)].reshape(t, -1), lv.aux(i, low))
        if NUM_LAYERS - 1 in aux:
            # HF's last hidden_states entry is after the final norm; the aux feature of layer L-1 is before it.
            top = cached_aux[:, aux.index(NUM_LAYERS - 1)]
            with torch.no_grad():
                assert torch.equal(norm(top), o["hidden_states"][-1])
            assert not torch.equal(top, o["hidden_states"][-1])
        assert torch.equal(got["last_hidden_state"], o["last"])
        assert torch.equal(got["last_hidden_state"], o["hidden_states"][-1])
        with torch.no_grad():
            assert torch.equal(lm_head(got["last_hidden_state"]), o["logits"])
        if "in_draft" in got:
            assert torch.equal(got["in_draft"], torch.isin(o["logits"].argmax(-1), selected))


def test_target_head_from_cache(runs, live):
    out = runs("llama_bs1")
    lv = live("llama")
    head = TargetHead.from_cache(out)
    ds = Eagle3CacheDataset(out)
    selected = _side(out)["selected_token_ids"]
    assert head.selected_token_ids.tolist() == selected.tolist() and len(selected) == 300
    assert torch.equal(head.weight, lv.model.get_output_embeddings().weight.detach()[selected])
    for i, o in enumerate(lv.outputs):
        got = ds[i]
        probs, mask = head(got["last_hidden_state"], got["loss_mask"], got["in_draft"])
        assert probs.dtype == torch.float32 and probs.shape == (len(got["input_ids"]), 300)
        torch.testing.assert_close(probs, torch.softmax(o["logits"][:, selected], -1), atol=1e-5, rtol=0)
        assert torch.equal(mask, _next_token_supervised(got["loss_mask"]) & got["in_draft"])


def test_batched_fp32_equals_live_forward_within_tolerance(runs, live):
    out = runs("llama_bs4")
    lv = live("llama")
    ds = Eagle3CacheDataset(out)
    _check_tokens(ds, lv)
    lengths = [len(s.input_ids) for s in lv.samples]
    assert len(set(lengths[:4])) > 1 and len(set(lengths[4:])) > 1, "batches must be right-padded for this test"
    lm_head = lv.model.get_output_embeddings()
    exact = True
    for i, o in enumerate(lv.outputs):
        got = ds[i]
        aux = lv.aux(i, [1, 3, 4])
        # Not exact: padding a sample into a longer batch changes the shapes of the matmuls and of the masked
        # attention (an explicit padding mask instead of the plain causal path), hence the floating-point
        # reduction order. Observed on CPU: padded samples differ from a lone forward by ~2e-6 (values up to ~5);
        # the longest sample of each batch happened to be bit-identical. So: a tight tolerance, not equality.
        torch.testing.assert_close(got["aux_hidden_states"], aux, atol=1e-5, rtol=0)
        torch.testing.assert_close(got["last_hidden_state"], o["last"], atol=1e-5, rtol=0)
        with torch.no_grad():
            torch.testing.assert_close(lm_head(got["last_hidden_state"]), o["logits"], atol=1e-5, rtol=0)
        exact &= torch.equal(got["aux_hidden_states"], aux) and torch.equal(got["last_hidden_state"], o["last"])
    print(f"batched fp32 features bit-identical to lone forwards: {exact}")


@pytest.mark.parametrize("name, max_ulps", [("llama_bf16_bs1", 0), ("llama_bf16_bs4", 1)])
def test_bf16_storage_is_the_fp32_result_rounded(runs, live, name, max_ulps):
    out = runs(name)
    lv = live("llama")
    ds = Eagle3CacheDataset(out)
    _check_tokens(ds, lv)
    assert _config(out)["dtype"] == "bf16" and _config(out)["model_dtype"] == "fp32"
    worst = 0
    for i, o in enumerate(lv.outputs):
        got = ds[i]
        for key, want in (("aux_hidden_states", lv.aux(i, [1, 3, 4])), ("last_hidden_state", o["last"])):
            assert got[key].dtype == torch.bfloat16
            # Batch size 1: exactly the fp32 result rounded to bf16. Batched (right-padded) forwards may differ
            # from a lone one in the last fp32 bits (see above), which can move the rounding by one bf16 step.
            ulps = _bf16_ulps(got[key], want.to(torch.bfloat16))
            assert int(ulps.max()) <= max_ulps, key
            worst = max(worst, int(ulps.max()))
    print(f"{name}: worst distance {worst} bf16 ulp(s)")


# ---------------------------------------------------------------------------
# 2. supervision modes and the draft vocabulary


def test_probs_supervision_and_draft_vocab(runs, live):
    out = runs("llama_probs_bs4")
    lv = live("llama")
    cfg = _config(out)
    assert cfg["supervision"] == "probs" and cfg["draft_vocab_size"] == 300 and cfg["vocab_size"] == 1024
    side = _side(out)
    selected = side["selected_token_ids"]
    assert selected.dtype == torch.int64 and selected.shape == (300,)
    assert torch.all(selected[1:] > selected[:-1])
    assert set(SPECIALS) <= set(selected.tolist())
    assert selected.tolist() == _expected_selection(lv.samples, 1024, 300, SPECIALS)
    assert torch.equal(side["d2t"], selected - torch.arange(300))
    assert torch.equal(torch.arange(300) + side["d2t"], selected)  # target_id = draft_id + d2t[draft_id]
    t2d = torch.zeros(1024, dtype=torch.bool)
    t2d[selected] = True
    assert side["t2d"].dtype == torch.bool and torch.equal(side["t2d"], t2d)
    assert torch.equal(side["lm_head"], lv.model.get_output_embeddings().weight.detach()[selected])
    assert torch.equal(side["embed_tokens"], lv.model.get_input_embeddings().weight.detach())

    raw = CacheDataset(out)
    assert set(raw.schema) == {"input_ids", "loss_mask", "aux_hidden_states", "target_probs", "in_draft", "source_row"}
    ds = Eagle3CacheDataset(out)
    _check_tokens(ds, lv)
    some_in, some_out = False, False
    for i, o in enumerate(lv.outputs):
        got, stored = ds[i], raw[i]
        want = torch.softmax(o["logits"][:, selected], -1)
        assert got["target_probs"].shape == want.shape
        torch.testing.assert_close(got["target_probs"], want, atol=1e-5, rtol=0)
        # batched run: aux within tolerance (padding changes matmul shapes)
        torch.testing.assert_close(got["aux_hidden_states"], lv.aux(i, [1, 3, 4]), atol=1e-5, rtol=0)
        in_draft = torch.isin(o["logits"].argmax(-1), selected)
        assert torch.equal(stored["in_draft"], in_draft)
        assert "in_draft" not in got
        assert torch.equal(got["position_mask"], _next_token_supervised(got["loss_mask"]) & in_draft)
        some_in |= bool(in_draft.any())
        some_out |= bool((~in_draft & got["loss_mask"]).any())
    assert some_in and some_out, "the test needs positions on both sides of the draft vocabulary"


def test_topk_supervision_full_vocab(runs, live):
    out = runs("llama_topk_bs1")
    lv = live("llama")
    cfg = _config(out)
    assert cfg["supervision"] == "topk:8" and cfg["draft_vocab_size"] == cfg["vocab_size"] == 1024
    side = _side(out)
    # identity mapping when Vd == V
    assert torch.equal(side["selected_token_ids"], torch.arange(1024))
    assert torch.equal(side["d2t"], torch.zeros(1024, dtype=torch.int64))
    assert bool(side["t2d"].all())
    raw = CacheDataset(out)
    assert raw.schema["topk_ids"].dtype == torch.int32 and raw.schema["topk_probs"].shape == (8,)
    assert "in_draft" not in raw.schema
    ds = Eagle3CacheDataset(out)
    _check_tokens(ds, lv)
    for i, o in enumerate(lv.outputs):
        stored, got = raw[i], ds[i]
        t = len(lv.samples[i].input_ids)
        assert stored["topk_ids"].dtype == torch.int32 and stored["topk_ids"].shape == (t, 8)
        probs = torch.softmax(o["logits"], -1)
        values, ids = probs.topk(8, dim=-1)
        assert torch.equal(stored["topk_ids"].long(), ids)
        torch.testing.assert_close(stored["topk_probs"], values / values.sum(-1, keepdim=True), atol=1e-6, rtol=0)
        torch.testing.assert_close(stored["topk_probs"].sum(-1), torch.ones(t), atol=1e-5, rtol=0)
        dense = got["target_probs"]
        assert dense.shape == (t, 1024) and "topk_ids" not in got and "topk_probs" not in got
        assert torch.equal((dense != 0).sum(-1), torch.full((t,), 8))
        assert torch.equal(dense.gather(1, ids), stored["topk_probs"])
        assert torch.equal(got["position_mask"], _next_token_supervised(got["loss_mask"]))


@pytest.mark.parametrize(
    "keys",
    [["aux_hidden_states"], ["aux_hidden_states", "target_probs"], ["loss_mask"], ["input_ids", "in_draft"]],
)
def test_key_subsets_give_the_same_position_mask(runs, keys):
    """position_mask needs loss_mask and in_draft: they are read whether asked for or not, then left out."""
    out = runs("llama_probs_bs4")
    full, subset = Eagle3CacheDataset(out), Eagle3CacheDataset(out, keys=keys)
    assert set(subset[0]) == (set(keys) - {"in_draft"}) | {"position_mask"}
    for i in range(len(full)):
        assert torch.equal(subset[i]["position_mask"], full[i]["position_mask"]), i
    batch = next(iter(build_eagle3_dataloader(out, 4, shuffle=False, keys=keys)))
    assert torch.equal(
        batch["position_mask"], next(iter(build_eagle3_dataloader(out, 4, shuffle=False)))["position_mask"]
    )


def test_topk_key_subsets_read_both_parts_or_refuse_by_name(runs):
    out = runs("llama_topk_bs1")
    full = Eagle3CacheDataset(out)
    for keys in (["target_probs"], ["topk_probs"], ["topk_ids", "aux_hidden_states"]):
        ds = Eagle3CacheDataset(out, keys=keys)
        assert torch.equal(ds[2]["target_probs"], full[2]["target_probs"]) and "topk_ids" not in ds[2]
    with pytest.raises(CacheFormatError, match=r"\['last_hidden_state'\] are not in this EAGLE-3 cache; it offers"):
        Eagle3CacheDataset(out, keys=["last_hidden_state"])


def test_select_draft_vocab_order_and_ties():
    counts = torch.tensor([0, 5, 3, 5, 0, 3, 1, 0, 0, 0])
    # specials first, then count desc with ties by ascending id
    assert select_draft_vocab(counts, 3, [0, 2]).tolist() == [0, 1, 2]  # 1 and 3 tie at 5: 1 wins
    assert select_draft_vocab(counts, 4, [0, 2]).tolist() == [0, 1, 2, 3]
    assert select_draft_vocab(counts, 5, [0, 2]).tolist() == [0, 1, 2, 3, 5]  # 2 (count 3) is already in as special
    assert select_draft_vocab(counts, 6, [0, 2]).tolist() == [0, 1, 2, 3, 5, 6]
    # zero counts fill by ascending id
    assert select_draft_vocab(counts, 8, [0, 2]).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert select_draft_vocab(counts, 7, [9]).tolist() == [0, 1, 2, 3, 5, 6, 9]  # 9 (count 0) is special; 0 fills
    # specials are always selected even with count 0; duplicates and out-of-range ids are ignored
    assert select_draft_vocab(counts, 3, [9, 9, 8, -1, 10]).tolist() == [1, 8, 9]
    # ties among many equal counts: ascending id
    assert select_draft_vocab(torch.ones(10, dtype=torch.int64), 4, []).tolist() == [0, 1, 2, 3]
    assert select_draft_vocab(torch.tensor([2, 7, 7, 7, 1, 7]), 3, []).tolist() == [1, 2, 3]
    # result is int64 and ascending; identity when Vd == V
    sel = select_draft_vocab(counts, 10, [0, 2])
    assert sel.dtype == torch.int64 and sel.tolist() == list(range(10))
    for bad in (0, 11, -1):
        with pytest.raises(ValueError, match="--draft-vocab-size"):
            select_draft_vocab(counts, bad, [])


def test_select_draft_vocab_matches_independent_order():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        vocab = 40
        counts = torch.randint(0, 4, (vocab,), generator=gen) * torch.randint(0, 2, (vocab,), generator=gen)
        specials = torch.randint(0, vocab, (3,), generator=gen).tolist()
        size = 5 + trial
        order = list(dict.fromkeys(specials))
        rest = sorted((i for i in range(vocab) if i not in order), key=lambda i: (-int(counts[i]), i))
        assert select_draft_vocab(counts, size, specials).tolist() == sorted((order + rest)[:size])


def test_vocab_mapping():
    selected = torch.tensor([0, 3, 4, 9])
    m = vocab_mapping(selected, 12)
    assert m["selected_token_ids"].tolist() == [0, 3, 4, 9]
    assert m["d2t"].tolist() == [0, 2, 2, 6]
    assert (torch.arange(4) + m["d2t"]).tolist() == [0, 3, 4, 9]
    assert m["t2d"].tolist() == [i in (0, 3, 4, 9) for i in range(12)]
    ident = vocab_mapping(torch.arange(5), 5)
    assert ident["d2t"].tolist() == [0] * 5 and bool(ident["t2d"].all())


def test_supervision_parse():
    assert Supervision.parse("hidden") == Supervision("hidden")
    assert Supervision.parse("probs") == Supervision("probs")
    assert Supervision.parse("topk:4") == Supervision("topk", 4) and str(Supervision.parse("topk:4")) == "topk:4"
    for bad in ("topk:0", "topk:", "topk:x", "logits", "", "topk:-2"):
        with pytest.raises(ValueError, match="--supervision"):
            Supervision.parse(bad)


# ---------------------------------------------------------------------------
# 7. the trainer's data loader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_pads_and_covers_every_sample_once(runs, num_workers):
    out = runs("llama_probs_bs4")
    ds = Eagle3CacheDataset(out)
    reference = [ds[i] for i in range(len(ds))]
    by_ids = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(reference)}
    assert len(by_ids) == len(ds) == LIMIT
    loader = build_eagle3_dataloader(out, batch_size=3, shuffle=True, num_workers=num_workers, seed=1)
    epochs = []
    for _ in range(2):
        seen = []
        for batch in loader:
            b, tmax = batch["input_ids"].shape
            lengths = batch["lengths"]
            assert batch["attention_mask"].dtype == torch.int64 and lengths.dtype == torch.int64
            assert torch.equal(batch["attention_mask"], (torch.arange(tmax)[None] < lengths[:, None]).long())
            assert int(lengths.max()) == tmax
            assert batch["aux_hidden_states"].shape == (b, tmax, 192)
            assert batch["target_probs"].shape == (b, tmax, 300)
            assert batch["position_mask"].shape == (b, tmax) and batch["position_mask"].dtype == torch.bool
            for row in range(b):
                n = int(lengths[row])
                i = by_ids[tuple(batch["input_ids"][row, :n].tolist())]
                seen.append(i)
                assert int(batch["source_row"][row]) == int(reference[i]["source_row"])  # a per-sample key
                for key, want in reference[i].items():
                    if key == "source_row":
                        continue
                    assert torch.equal(batch[key][row, :n], want), key
                    assert not batch[key][row, n:].any(), key  # padding is zero
        assert sorted(seen) == list(range(LIMIT))
        epochs.append(seen)
    assert epochs[0] != list(range(LIMIT)) or epochs[1] != list(range(LIMIT))  # shuffled
    ordered = build_eagle3_dataloader(out, batch_size=5, shuffle=False, num_workers=num_workers)
    got = [
        i
        for batch in ordered
        for i in (by_ids[tuple(r[: int(n)].tolist())] for r, n in zip(batch["input_ids"], batch["lengths"]))
    ]
    assert got == list(range(LIMIT))


# ---------------------------------------------------------------------------
# 8. default aux layers


def test_default_aux_layers(runs):
    assert default_aux_layers(8) == [1, 3, 4]
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(28) == [1, 13, 24]
    assert _config(runs("llama_bs4"))["aux_layers"] == [1, 3, 4]  # no --aux-layers given
    assert check_aux_layers([0, 3, 7], 8) == [0, 3, 7]
    for bad in ([1, 1, 3], [1, 3, 8], [-1, 2, 3], [1, 2], [1, 2, 3, 4]):
        with pytest.raises(ValueError, match="--aux-layers"):
            check_aux_layers(bad, 8)


def test_shuffled_loader_uses_the_locality_sampler_and_resumes_mid_epoch(runs):
    out = runs("llama_probs_bs4")
    loader = build_eagle3_dataloader(out, batch_size=2, shuffle=True, seed=3)
    assert isinstance(loader.sampler, LocalityShuffleSampler)
    loader.sampler.set_epoch(1)
    epoch = [batch["input_ids"] for batch in loader]
    consumed_batches = 2
    resumed = build_eagle3_dataloader(out, batch_size=2, shuffle=True, seed=3)
    resumed.sampler.load_state_dict(loader.sampler.state_dict(consumed=2 * consumed_batches))
    rest = [batch["input_ids"] for batch in resumed]
    assert len(rest) == len(epoch) - consumed_batches
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch[consumed_batches:]))


@pytest.mark.parametrize("name", ["llama_probs_bs4", "llama_bs4"])
def test_draft_view_slot_j_reads_aux_j_and_token_j_plus_1_and_is_graded_on_row_j_plus_1(runs, name):
    out = runs(name)
    head = TargetHead.from_cache(out)
    for batch in build_eagle3_dataloader(out, 4, shuffle=False):
        view = draft_view(batch, head)
        if "target_probs" in batch:
            probs, mask = batch["target_probs"], batch["position_mask"]
        else:
            probs, mask = head(batch["last_hidden_state"], batch["loss_mask"], batch.get("in_draft"))
        for b, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            for j in range(n - 1):
                assert torch.equal(view["hidden"][b, j], batch["aux_hidden_states"][b, j])
                assert int(view["input_ids"][b, j]) == int(batch["input_ids"][b, j + 1])
                assert torch.equal(view["target"][b, j], probs[b, j + 1])
                assert bool(view["mask"][b, j]) == bool(mask[b, j + 1])
                # counted when token j + 2 (what row j + 1 predicts) is generated, and (reduced vocabulary)
                # row j + 1's argmax is in the draft vocabulary
                generated = j + 2 < n and bool(batch["loss_mask"][b, j + 2])
                assert bool(view["mask"][b, j]) == generated if name == "llama_bs4" else generated >= view["mask"][b, j]
            assert not view["mask"][b, n - 1 :].any()
