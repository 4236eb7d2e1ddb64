"""Offline = online beyond fp32: training steps from a bf16 or fp8 cache stay within the storage's rounding.

``tests/test_train.py`` checks that an fp32 cache gives exactly the losses of features computed live. A cache
stored in bf16 or fp8 rounds every feature value ``x`` to ``x (1 + eta)`` with ``|eta| <= eps`` (bf16 keeps 8
significant bits, ``eps = 2**-9``; fp8 e4m3 under its per-row scale keeps 4, ``eps = 2**-4``). The rounding
errors are independent with standard deviation at most ``eps / sqrt(3)``, so to first order a step's loss
moves by ``sum_i g_i x_i eta_i`` (``g`` the loss's gradient at the live features), of standard deviation at
most ``eps / sqrt(3) * ||g * x||_2``. Each step's cached loss must lie within five of those of the live
one (docs/training.md, "Offline = online"), and the same bound must be broken by features shifted by one row
or taken from another layer, so the check would catch either.

Plain SGD keeps the steps comparable: Adam's normalised update turns a rounding-sized change in a tiny
gradient component into a full step, which no first-order bound covers.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.format import Manifest
from speccache.methods.eagle3 import Supervision, TargetHead, build_eagle3_dataloader
from speccache.methods.eagle3_producer import Eagle3Target
from speccache.train.trainer import MAX_GRAD_NORM, draft_for_cache, draft_loss, train_steps

pytestmark = pytest.mark.usefixtures("offline_single_thread")

STORAGE = {  # --dtype/--encode of each cache and the largest relative rounding error of its float features
    "bf16": (["--dtype", "bf16"], 2**-9),
    "fp8": (["--dtype", "bf16", "--encode", "aux_hidden_states=fp8,last_hidden_state=fp8"], 2**-4),
}
SIGMAS = 5
STEPS, TTT, LR = 4, 2, 1.0
FEATURES = ("aux_hidden_states", "last_hidden_state")


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    """The bf16 and fp8 caches of the same 16 rows (batch size 1: each feature is a lone forward's, rounded),
    the fp32 target, and the four batches every run trains on."""
    base = tmp_path_factory.mktemp("tolerance")
    model_dir = tiny_models("llama")
    common = ["--model", model_dir, "--data", demo_data_path("sharegpt"), "--limit", "16", "--batch-size", "1",
              "--max-length", "128", "--draft-vocab-size", "300", "--model-dtype", "fp32", "--quiet"]  # fmt: skip
    caches = {}
    for name, (flags, _) in STORAGE.items():
        caches[name] = str(base / name)
        assert main(["precompute", *common, "--out", caches[name], *flags]) == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batches = {
        name: [b for _, b in zip(range(STEPS), build_eagle3_dataloader(cache, batch_size=4, shuffle=True, seed=3))]
        for name, cache in caches.items()
    }
    return caches, model, batches


def _sgd(draft: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in draft.parameters() if p.requires_grad], lr=LR)


def _live(batch: dict[str, torch.Tensor], model: torch.nn.Module, selected: torch.Tensor, layers: list[int],
          shift: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """The batch with fp32 features computed now, sample by sample, from ``layers`` (aux rows ``shift`` late)."""
    target = Eagle3Target(model, layers, Supervision("hidden"), selected, torch.float32)
    aux = torch.zeros(batch["aux_hidden_states"].shape, dtype=torch.float32)
    last = torch.zeros(batch["last_hidden_state"].shape, dtype=torch.float32)
    for b, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ids = batch["input_ids"][b : b + 1, :n].long()
        feats = target.forward_features(ids, torch.ones_like(ids))
        rows = feats["aux_hidden_states"][0]
        aux[b, :n] = torch.cat([rows[shift:], rows[n - shift :]]) if shift else rows
        last[b, :n] = feats["last_hidden_state"][0]
    keep = ("input_ids", "loss_mask", "attention_mask", "in_draft")
    return {**{k: batch[k] for k in keep if k in batch}, "aux_hidden_states": aux, "last_hidden_state": last}


def _online(cache: str, feed: list[dict[str, torch.Tensor]], head: TargetHead) -> tuple[list[float], list[float]]:
    """The losses of training on live features, and each step's ``||g * x||_2`` over the float features."""
    torch.manual_seed(7)
    draft, _ = draft_for_cache(cache)
    optimizer = _sgd(draft)
    draft.train()
    losses, scales = [], []
    for batch in feed:
        batch = {**batch, **{k: batch[k].clone().requires_grad_(True) for k in FEATURES}}
        loss = draft_loss(draft, batch, head, TTT)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), MAX_GRAD_NORM)  # as train_steps does
        optimizer.step()
        losses.append(float(loss.detach()))
        scales.append(math.sqrt(sum(float(((batch[k].grad * batch[k].detach()) ** 2).sum()) for k in FEATURES)))
    return losses, scales


def _offline(cache: str, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    torch.manual_seed(7)
    draft, head = draft_for_cache(cache)
    return train_steps(draft, iter(batches), head, _sgd(draft), steps=TTT)


@pytest.mark.parametrize("storage", sorted(STORAGE))
def test_cached_losses_lie_within_the_storage_rounding_of_the_live_ones(setup, storage):
    caches, model, batches = setup
    cache, eps = caches[storage], STORAGE[storage][1]
    selected = TargetHead.from_cache(cache).selected_token_ids
    head = TargetHead(model.get_output_embeddings().weight.detach()[selected], selected)

    def live(layers: list[int], shift: int = 0) -> list[dict[str, torch.Tensor]]:
        return [_live(b, model, selected, layers, shift) for b in batches[storage]]

    low, mid, high = Manifest.read(cache).config["aux_layers"]
    online, scales = _online(cache, live([low, mid, high]), head)
    tolerance = [SIGMAS * eps / math.sqrt(3) * s for s in scales]
    offline = _offline(cache, batches[storage])
    assert len(offline) == STEPS
    for step, (a, b, tol) in enumerate(zip(offline, online, tolerance)):
        assert abs(a - b) <= tol, f"step {step}: cached {a} vs live {b}, beyond {tol}"
    assert offline != online, "the storage rounds: the losses are close, not equal"

    # the bound catches features one row late and features of another layer
    for name, feed in (
        ("shifted by one row", live([low, mid, high], shift=1)),
        ("the low aux layer's predecessor", live([low - 1, mid, high])),
        ("the mid aux layer's predecessor", live([low, mid - 1, high])),
    ):
        wrong, _ = _online(cache, feed, head)
        assert any(abs(w - b) > tol for w, b, tol in zip(wrong, online, tolerance)), name
