"""``speccache train``: the reference EAGLE-3 draft trained from a cache with soft cross-entropy.

The cache is read only through :func:`speccache.methods.eagle3.build_eagle3_dataloader` and
:class:`speccache.methods.eagle3.TargetHead`; :func:`speccache.methods.eagle3.draft_view` aligns each batch
(slot ``j``: ``aux[j]``, ``input_ids[j + 1]``, row ``j + 1``'s distribution, ``position_mask[j + 1]``). Each
training-time-test step ``a`` is graded on the slots ``j >= a`` of the mask against the same distribution,
and the loss is the mean over the steps.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from speccache.methods.eagle3 import (
    SIDE_FILE,
    Eagle3CacheDataset,
    TargetHead,
    build_eagle3_dataloader,
    draft_view,
    read_side_file,
)
from speccache.train.draft import DraftConfig, Eagle3Draft, check_new_draft_dir, save_draft

__all__ = [
    "TrainResult",
    "draft_for_cache",
    "draft_loss",
    "make_optimizer",
    "train",
    "train_steps",
]


def _shape(hidden: int) -> tuple[int, int]:
    """``(heads, head_dim)`` of the draft's attention: 64-wide heads when they divide ``hidden``, else 16-wide."""
    head_dim = 64 if hidden % 64 == 0 and hidden >= 128 else 16
    return hidden // head_dim, head_dim


def draft_for_cache(cache_dir: str, intermediate_size: int | None = None) -> tuple[Eagle3Draft, TargetHead]:
    """A fresh draft shaped for an EAGLE-3 cache (seed torch first), and the cache's :class:`TargetHead`.

    The draft's embedding is the side file's ``embed_tokens`` (frozen), its head starts from the side file's
    LM-head rows, its vocabulary maps are the side file's ``d2t``/``t2d``; ``intermediate_size`` defaults to
    ``2 * hidden``.
    """
    config = Eagle3CacheDataset(cache_dir, keys=["input_ids"]).manifest.config
    hidden = int(config["hidden_size"])
    heads, head_dim = _shape(hidden)
    shape = DraftConfig(
        hidden_size=hidden,
        vocab_size=int(config["vocab_size"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * hidden,
        aux_layers=[int(i) for i in config["aux_layers"]],
    )
    tensors = read_side_file(os.path.join(cache_dir, SIDE_FILE), ("embed_tokens", "lm_head", "d2t", "t2d"))
    draft = Eagle3Draft(shape, tensors["embed_tokens"], tensors["lm_head"], tensors["d2t"], tensors["t2d"])
    return draft, TargetHead.from_cache(cache_dir)


def draft_loss(draft: Eagle3Draft, batch: Mapping[str, torch.Tensor], head: TargetHead, steps: int) -> torch.Tensor:
    """Soft cross-entropy of the draft's ``steps`` training-time-test steps against the target, on the aligned mask.

    Step ``a`` counts the slots ``j >= a`` whose ``mask`` is set; the result is the mean over the steps of each
    step's mean over its counted slots.
    """
    view = draft_view(batch, head)
    slots = torch.arange(view["mask"].shape[1], device=view["mask"].device)
    losses = []
    for a, logits in enumerate(draft(view["hidden"].float(), view["input_ids"], steps)):
        mask = view["mask"] & (slots >= a)
        per_slot = -(view["target"].float() * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        losses.append((per_slot * mask).sum() / mask.sum().clamp_min(1))
    return torch.stack(losses).mean()


def train_steps(
    draft: Eagle3Draft,
    batches: Iterable[Mapping[str, torch.Tensor]],
    head: TargetHead,
    optimizer: torch.optim.Optimizer,
    steps: int = 1,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """One optimizer step per batch; returns the losses (``on_step(i, loss)`` after each)."""
    draft.train()
    losses = []
    for i, batch in enumerate(batches):
        loss = draft_loss(draft, batch, head, steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(i, losses[-1])
    return losses


def make_optimizer(draft: Eagle3Draft, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the embedding is frozen)."""
    return torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


@dataclass
class TrainResult:
    """What :func:`train` did: the loss of every step, the number of steps and the seconds it took."""

    losses: list[float]
    steps: int
    seconds: float


def train(
    cache_dir: str,
    out: str,
    *,
    epochs: int = 1,
    lr: float = 1e-3,
    ttt_steps: int = 1,
    batch_size: int = 8,
    max_steps: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train a fresh draft on ``cache_dir`` and save it to ``out`` (see :mod:`speccache.train.draft`).

    Raises:
        FileExistsError: ``out`` already holds a draft (checked before training).
        ValueError: a non-positive ``epochs``, ``batch_size``, ``ttt_steps``, ``lr`` or ``max_steps``.
    """
    counts = {"--epochs": epochs, "--batch-size": batch_size, "--ttt-steps": ttt_steps, "--max-steps": max_steps}
    for name, value in counts.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} {value} must be at least 1")
    if not lr > 0:
        raise ValueError(f"--lr {lr} must be a positive learning rate")
    check_new_draft_dir(out)
    torch.manual_seed(seed)
    draft, head = draft_for_cache(cache_dir)
    optimizer = make_optimizer(draft, lr)
    loader = build_eagle3_dataloader(cache_dir, batch_size=batch_size, shuffle=True, seed=seed)
    total = epochs * len(loader) if max_steps is None else min(max_steps, epochs * len(loader))
    losses: list[float] = []
    started = time.monotonic()

    def report(i: int, loss: float) -> None:
        done = len(losses) + i + 1
        if log is not None and (done % max(1, total // 20) == 0 or done == total):
            log(f"step {done}/{total}  loss {loss:.4f}  {time.monotonic() - started:.0f}s")

    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        left = total - len(losses)
        if left <= 0:
            break
        losses += train_steps(draft, itertools.islice(loader, left), head, optimizer, ttt_steps, report)
    seconds = time.monotonic() - started
    trained = {"epochs": epochs, "lr": lr, "ttt_steps": ttt_steps, "batch_size": batch_size, "seed": seed}
    extra = {
        "cache": os.path.abspath(cache_dir),
        "target": Eagle3CacheDataset(cache_dir, keys=["input_ids"]).manifest.config.get("model"),
        "training": {**trained, "steps": len(losses), "final_loss": losses[-1]},
    }
    save_draft(draft, out, extra)
    return TrainResult(losses, len(losses), seconds)
