"""The trainer's fast loss is the reference loss: the same loss and gradients within fp32 reordering.

``draft_loss`` runs each training-time-test step over its own slots only (the earlier steps' keys and values
kept in a cache) and the draft's head over the counted slots only. The reference below is the plain
definition: at step ``a`` the layer reruns over all ``a + 1`` blocks under :func:`chain_mask`, the head
scores every slot and the per-slot losses are masked afterwards. Both compute the same sums in another order
(matrix products over fewer rows, a sum without the zeroed slots), so they agree to fp32 rounding: the loss
within 1e-6 relative, each gradient within 1e-5 of its largest entry (docs/training.md, "The trainer").
"""

from __future__ import annotations

import pytest
import torch

from speccache.methods.eagle3 import TargetHead, draft_view
from speccache.train.draft import DraftConfig, Eagle3Draft, chain_mask
from speccache.train.trainer import draft_loss

pytestmark = pytest.mark.usefixtures("offline_single_thread")

HIDDEN, VOCAB, DRAFT_VOCAB, BATCH, LENGTH = 64, 500, 120, 3, 40


def reference_loss(draft: Eagle3Draft, batch: dict, head: TargetHead, steps: int, decay: float) -> torch.Tensor:
    """The loss as first written: every step reruns the whole chain, the head runs on every slot."""
    view = draft_view(batch, head)
    length = view["input_ids"].shape[1]
    embeds = draft.embed_tokens(view["input_ids"].long())
    slots = torch.arange(length)
    states = [draft.fc(view["hidden"].float())]
    losses = []
    for a in range(steps):
        mask = chain_mask(length, a + 1)
        out = draft.layer(embeds.repeat(1, a + 1, 1), torch.cat(states, dim=1), slots.repeat(a + 1), mask)
        out = out[:, a * length :]
        per_slot = -(view["target"] * torch.log_softmax(draft.logits(out), dim=-1)).sum(-1)
        counted = view["mask"] & (slots >= a)
        losses.append((per_slot * counted).sum() / counted.sum().clamp_min(1))
        states.append(torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1))
    weights = decay ** torch.arange(steps, dtype=torch.float32)
    return (torch.stack(losses) * weights).sum() / weights.sum()


@pytest.fixture
def setup():
    """A random draft and a batch of three samples of different lengths (padding, prompts not counted)."""
    torch.manual_seed(0)
    config = DraftConfig(HIDDEN, VOCAB, DRAFT_VOCAB, 4, 4, 16, 128, aux_layers=[0, 1, 2])
    d2t = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True
    draft = Eagle3Draft(config, torch.randn(VOCAB, HIDDEN), torch.randn(DRAFT_VOCAB, HIDDEN) * 0.1, d2t, t2d)
    lengths = torch.tensor([LENGTH, 31, 17])
    real = torch.arange(LENGTH)[None] < lengths[:, None]
    batch = {
        "input_ids": torch.randint(0, VOCAB, (BATCH, LENGTH)) * real,
        "aux_hidden_states": torch.randn(BATCH, LENGTH, 3 * HIDDEN) * real[..., None],
        "target_probs": torch.softmax(torch.randn(BATCH, LENGTH, DRAFT_VOCAB) * 3, dim=-1),
        "position_mask": real & (torch.arange(LENGTH)[None] >= 8) & (torch.rand(BATCH, LENGTH) < 0.9),
        "attention_mask": real.long(),
    }
    head = TargetHead(torch.zeros(DRAFT_VOCAB, HIDDEN), torch.arange(DRAFT_VOCAB))  # unused: the batch has probs
    return draft, batch, head


def _loss_and_grads(loss_fn, draft, batch, head, steps, decay):
    draft.zero_grad(set_to_none=True)
    loss = loss_fn(draft, batch, head, steps, decay)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("steps, decay", [(1, 1.0), (2, 0.8), (3, 1.0)])
def test_fast_loss_equals_the_reference(setup, steps, decay):
    draft, batch, head = setup
    loss, grads = _loss_and_grads(draft_loss, draft, batch, head, steps, decay)
    want, want_grads = _loss_and_grads(reference_loss, draft, batch, head, steps, decay)
    assert loss == pytest.approx(want, rel=1e-6)
    for name, grad in grads.items():
        scale = float(want_grads[name].abs().max())
        assert scale > 0, name
        assert float((grad - want_grads[name]).abs().max()) <= 1e-5 * scale, name
