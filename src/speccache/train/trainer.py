"""``speccache train``: the reference EAGLE-3 draft trained from a cache with soft cross-entropy.

The cache is read through :mod:`speccache.read.source` (a cache, a view, or a cache being written, followed with
:class:`speccache.read.follow.Follow`) as :class:`speccache.methods.eagle3.build_eagle3_dataloader` reads it, with
:class:`speccache.methods.eagle3.TargetHead`; :func:`speccache.methods.eagle3.draft_view` aligns each batch
(slot ``j``: ``aux[j]``, ``input_ids[j + 1]``, row ``j + 1``'s distribution, ``position_mask[j + 1]``). Each
training-time-test step ``a`` is graded on the slots ``j >= a`` of the mask against the same distribution,
and the loss is the steps' mean weighted by ``step_decay ** a`` (1: the plain mean). ``supervise="all"`` grades
every row the cache holds (prompts and template tokens too: the target's distribution is stored at every row),
not only the generated ones the loss mask marks; on little data that taught the draft more (docs/acceptance.md).
``draft_inputs`` says what the draft reads at each slot and at which position (:mod:`speccache.train.inputs`:
what vLLM serves, by default; the merged image embeddings; or the text habit); on a text cache they are one.

Batches hold samples of similar length (:class:`LengthGroupedSampler`), so little of a batch is padding. The
learning rate warms up linearly over the first ``warmup`` share of the steps, then follows a cosine to
zero at the last step; gradients are clipped to norm 1.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import Sampler

from speccache.devices import DTYPES, dtype_name, target_device
from speccache.errors import UsageError
from speccache.methods.eagle3 import (
    CACHE_NAME,
    SIDE_FILE,
    Eagle3CacheDataset,
    TargetHead,
    build_eagle3_dataloader,
    draft_view,
    read_side_file,
)
from speccache.read import LocalityShuffleSampler
from speccache.read.follow import Follow, FollowLoader
from speccache.read.source import open_source, reader_sampler
from speccache.train.draft import LOSS_CURVE, TRAIN_LOG, DraftConfig, Eagle3Draft, check_new_draft_dir, save_draft
from speccache.train.inputs import DRAFT_INPUTS, check_draft_inputs, slot_inputs, target_mrope
from speccache.train.plots import loss_curve, not_drawn

__all__ = [
    "COMPUTE_DTYPES",
    "LengthGroupedSampler",
    "StepRecord",
    "TrainResult",
    "draft_for_cache",
    "draft_loss",
    "graded_loss",
    "lr_factor",
    "make_optimizer",
    "train",
    "train_steps",
]


def _shape(hidden: int) -> tuple[int, int]:
    """``(heads, head_dim)`` of the draft's attention: 64-wide heads when they divide ``hidden``, else 16-wide."""
    head_dim = 64 if hidden % 64 == 0 and hidden >= 128 else 16
    return hidden // head_dim, head_dim


class EpochSampler(Protocol):
    """A sampler whose order is set per epoch (what :class:`LengthGroupedSampler` groups)."""

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...


class LengthGroupedSampler(Sampler[int]):
    """The reader's shuffled epoch (shard-local windows, a view's ``--weights``) in runs of ``batch_size`` samples
    of similar length.

    Each window of ``window`` batches' worth of the shuffled order is sorted by length and cut into batches, and
    the batches are shuffled: a padded batch costs its longest sample times its size, and on chat data of mixed
    lengths a plain shuffle pads most batches to nearly twice their tokens.
    """

    def __init__(self, base: EpochSampler, lengths: list[int], batch_size: int, seed: int = 0, window: int = 32):
        self.base, self.lengths, self.batch_size, self.seed, self.window = base, lengths, batch_size, seed, window
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for ``epoch`` (the same seed and epoch give the same order)."""
        self.base.set_epoch(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Iterator[int]:
        order = list(self.base)
        span = self.window * self.batch_size
        batches = []
        for start in range(0, len(order), span):
            run = sorted(order[start : start + span], key=lambda i: self.lengths[i])
            batches += [run[i : i + self.batch_size] for i in range(0, len(run), self.batch_size)]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        for b in torch.randperm(len(batches), generator=generator).tolist():
            yield from batches[b]


def draft_for_cache(
    cache_dir: str, intermediate_size: int | None = None, draft_inputs: str = DRAFT_INPUTS[0]
) -> tuple[Eagle3Draft, TargetHead]:
    """A fresh draft shaped for an EAGLE-3 cache (seed torch first), and the cache's :class:`TargetHead`.

    The draft's embedding is the side file's ``embed_tokens`` (frozen), its head starts from the side file's
    LM-head rows, its vocabulary maps are the side file's ``d2t``/``t2d``; ``intermediate_size`` defaults to
    ``2 * hidden``. With ``draft_inputs`` ``served`` or ``merged`` on a cache that holds M-RoPE ``positions`` it is
    an M-RoPE draft with the target's sections (its heads as wide as the sections span, ``2 * sum(section)``).

    Raises:
        UsageError: ``draft_inputs`` unknown or refused for this cache (:func:`check_draft_inputs`), or an M-RoPE
            target whose config cannot be read or whose heads do not divide the hidden size.
    """
    source = open_source(cache_dir, CACHE_NAME)  # the manifest's, sealed or still being written
    check_draft_inputs(draft_inputs, source)
    config = source.config
    hidden = int(config["hidden_size"])
    heads, head_dim = _shape(hidden)
    mrope = target_mrope(draft_inputs, source)
    if mrope:
        head_dim = 2 * sum(mrope["mrope_section"])  # vLLM's MRotaryEmbedding rotates the whole head by the sections
        if hidden % head_dim:
            raise UsageError(
                f"--draft-inputs {draft_inputs}: the target's mrope_section {mrope['mrope_section']} spans heads of "
                f"{head_dim}, which do not divide the hidden size {hidden}; use --draft-inputs tokens"
            )
        heads = hidden // head_dim
    shape = DraftConfig(
        hidden_size=hidden,
        vocab_size=int(config["vocab_size"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * hidden,
        aux_layers=[int(i) for i in config["aux_layers"]],
        **mrope,
    )
    tensors = read_side_file(os.path.join(cache_dir, SIDE_FILE), ("embed_tokens", "lm_head", "d2t", "t2d"))
    draft = Eagle3Draft(shape, tensors["embed_tokens"], tensors["lm_head"], tensors["d2t"], tensors["t2d"])
    return draft, TargetHead.from_cache(cache_dir)


COMPUTE_DTYPES = ("fp32", "bf16")
"""``--compute-dtype`` names: fp32, or bf16 under autocast (fp16 would need a gradient scaler)."""

# Gradients are clipped to this norm: the first steps on a fresh fc layer can be large.
MAX_GRAD_NORM = 1.0


def graded_loss(
    draft: Eagle3Draft,
    batch: Mapping[str, torch.Tensor],
    head: TargetHead,
    steps: int,
    step_decay: float = 1.0,
    supervise: str = "generated",
    draft_inputs: str = DRAFT_INPUTS[0],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_loss` and each training-time-test step's top-1 accuracy ``[steps]`` (detached): the share of
    the step's counted slots where the draft's argmax is the target distribution's."""
    if supervise == "all":
        batch = {**batch, "loss_mask": batch["attention_mask"]}
    view = draft_view(batch, head)
    slots = torch.arange(view["mask"].shape[1], device=view["mask"].device)
    losses, accuracy = [], []
    embeds, positions = slot_inputs(draft, view, draft_inputs)
    for a, states in enumerate(draft.states(view["hidden"].float(), view["input_ids"], steps, positions, embeds)):
        mask = view["mask"] & (slots >= a)
        # the head runs on the counted slots only: prompts and padding (a quarter to a half of chat data) are not
        logits = draft.logits(states[mask])
        target = view["target"][mask]
        per_slot = -(target.float() * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        counted = mask.sum().clamp_min(1)
        losses.append(per_slot.sum() / counted)
        with torch.no_grad():
            accuracy.append((logits.argmax(-1) == target.argmax(-1)).sum() / counted)
    weights = step_decay ** torch.arange(len(losses), dtype=torch.float32, device=losses[0].device)
    return (torch.stack(losses) * weights).sum() / weights.sum(), torch.stack(accuracy)


def draft_loss(
    draft: Eagle3Draft,
    batch: Mapping[str, torch.Tensor],
    head: TargetHead,
    steps: int,
    step_decay: float = 1.0,
    supervise: str = "generated",
    draft_inputs: str = DRAFT_INPUTS[0],
) -> torch.Tensor:
    """Soft cross-entropy of the draft's ``steps`` training-time-test steps against the target, on the aligned mask.

    Step ``a`` counts the slots ``j >= a`` whose ``mask`` is set; the result is the mean over the steps of each
    step's mean over its counted slots, step ``a`` weighted by ``step_decay ** a``. With ``supervise="all"`` the
    mask counts every real row (``attention_mask``) instead of the generated ones (``loss_mask``). ``draft_inputs``
    is what the draft reads at each slot (:mod:`speccache.train.inputs`).
    """
    return graded_loss(draft, batch, head, steps, step_decay, supervise, draft_inputs)[0]


@dataclass
class StepRecord:
    """One optimizer step of :func:`train_steps`: its loss, the learning rate it used, the batch's real tokens
    and each training-time-test step's top-1 accuracy (see :func:`graded_loss`)."""

    loss: float
    lr: float
    tokens: int
    accuracy: list[float]


def train_steps(
    draft: Eagle3Draft,
    batches: Iterable[Mapping[str, torch.Tensor]],
    head: TargetHead,
    optimizer: torch.optim.Optimizer,
    steps: int = 1,
    on_step: Callable[[int, StepRecord], None] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    step_decay: float = 1.0,
    supervise: str = "generated",
    compute_dtype: torch.dtype = torch.float32,
    draft_inputs: str = DRAFT_INPUTS[0],
) -> list[float]:
    """One optimizer step per batch (then one ``scheduler`` step); returns the losses (``on_step(i, record)`` after
    each, with its :class:`StepRecord`). A ``compute_dtype`` other than fp32 runs the forward under autocast (the
    weights, their gradients and the optimizer stay fp32; the loss is taken in fp32)."""
    draft.train()
    device_type = next(draft.parameters()).device.type
    losses = []
    for i, batch in enumerate(batches):
        with torch.autocast(device_type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            loss, accuracy = graded_loss(draft, batch, head, steps, step_decay, supervise, draft_inputs)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            tokens = int(batch["attention_mask"].sum())
            on_step(i, StepRecord(losses[-1], lr, tokens, accuracy.tolist()))
    return losses


def make_optimizer(draft: Eagle3Draft, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the embedding is frozen)."""
    return torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def lr_factor(step: int, total: int, warmup: float) -> float:
    """The learning rate's multiplier at optimizer step ``step`` of ``total``: a linear warm-up over the first
    ``warmup`` share of the steps, then a cosine from 1 down to 0 after the last step."""
    warm = math.ceil(warmup * total)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


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
    warmup: float = 0.05,
    step_decay: float = 1.0,
    supervise: str = "generated",
    intermediate_size: int | None = None,
    compute_dtype: str = "fp32",
    draft_inputs: str = DRAFT_INPUTS[0],
    device: str | None = None,
    follow: Follow | None = None,
    log: Callable[[str], None] | None = None,
    verify: bool = True,
) -> TrainResult:
    """Train a fresh draft on ``cache_dir`` and save it to ``out`` (see :mod:`speccache.train.draft`), with its
    training log (``train_log.jsonl``: one JSON line per optimizer step, written as it trains) and loss curve
    (``loss.png``, when matplotlib is installed) beside it.

    ``warmup`` is the share of the steps the learning rate warms up over before its cosine decay, ``step_decay``
    the weight ratio of consecutive training-time-test steps in the loss, ``supervise`` which rows the loss grades
    (``generated``: the loss mask's; ``all``: every row), ``intermediate_size`` the draft's MLP width (default
    twice the hidden size), ``compute_dtype`` the forward's (``fp32``, or ``bf16`` under autocast: 1.6x faster on
    a CPU with bf16 instructions, docs/training.md), ``draft_inputs`` what the draft reads at each slot
    (``served``, ``merged`` or ``tokens``: :mod:`speccache.train.inputs`), ``device`` where to train (see
    :func:`speccache.devices.target_device`). ``follow`` trains while the cache is written: one pass over each
    shard as it is sealed (``follow.replay`` passes within its window), in batches of consecutive samples of the
    shuffled passes, ending once the producer has sealed the cache; the schedule spans the samples the cache
    declares (docs/training.md). ``verify=False`` skips the check of each shard's data before its first read
    (a follower checks every shard it reads whatever it says; see :class:`speccache.read.CacheDataset`).

    Raises:
        CacheCorruptError: a tensor read from a shard differs from its checksum (names the shard and the tensor).
        FileExistsError: ``out`` already holds a draft (checked before training).
        ValueError: a non-positive ``epochs``, ``batch_size``, ``ttt_steps``, ``lr``, ``max_steps``,
            ``step_decay`` or ``intermediate_size``, a ``warmup`` outside [0, 1), an unknown ``supervise``,
            ``compute_dtype`` or ``draft_inputs`` (or ``merged`` without image embeddings), or an unusable
            ``device``; ``epochs`` other than 1 with ``follow`` (its ``replay`` gives the repeats).
        FollowTimeoutError: with ``follow``, the producer wrote no shard within ``follow.timeout``.
    """
    counts = {"--epochs": epochs, "--batch-size": batch_size, "--ttt-steps": ttt_steps, "--max-steps": max_steps}
    for name, value in counts.items():
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} must be at least 1")
    if intermediate_size is not None and intermediate_size < 1:
        raise UsageError(f"--intermediate-size {intermediate_size} must be at least 1")
    if not lr > 0:
        raise UsageError(f"--lr {lr} must be a positive learning rate")
    if not step_decay > 0:
        raise UsageError(f"--step-decay {step_decay} must be a positive weight ratio")
    if supervise not in ("generated", "all"):
        raise UsageError(f"--supervise {supervise!r} is unknown; choose one of generated, all")
    if not 0 <= warmup < 1:
        raise UsageError(f"--warmup {warmup} must be a share of the steps in [0, 1)")
    compute_dtype = dtype_name(compute_dtype, "--compute-dtype", COMPUTE_DTYPES)
    check_draft_inputs(draft_inputs)  # the cache's side of it once its manifest is there (draft_for_cache)
    if follow is not None and epochs != 1:
        raise UsageError(f"--epochs {epochs} with --follow: a stream is read once; --replay K reads each shard K times")
    where = target_device(device)
    check_new_draft_dir(out)
    torch.manual_seed(seed)
    if follow is not None:  # built first: it waits for the producer's manifest, which the draft's shape needs
        loader = build_eagle3_dataloader(cache_dir, batch_size, shuffle=True, seed=seed, follow=follow)
    else:
        dataset = Eagle3CacheDataset(cache_dir, keys=["input_ids"])
        base = reader_sampler(dataset, shuffle=True, distributed=False, seed=seed)
        assert isinstance(base, LocalityShuffleSampler)  # what a shuffled reader_sampler is
        sampler = LengthGroupedSampler(base, dataset.sample_lengths(), batch_size, seed)
        loader = build_eagle3_dataloader(
            cache_dir, batch_size=batch_size, shuffle=False, sampler=sampler, verify=verify
        )
    draft, head = draft_for_cache(cache_dir, intermediate_size, draft_inputs)
    draft, head = draft.to(where), head.to(where)
    optimizer = make_optimizer(draft, lr)
    total = epochs * len(loader) if max_steps is None else min(max_steps, epochs * len(loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup))
    losses: list[float] = []
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    log_path = os.path.join(out, TRAIN_LOG)
    dtype = DTYPES[compute_dtype]

    def report(i: int, step: StepRecord, epoch: int) -> None:
        done = len(losses) + i + 1
        seconds = time.monotonic() - started
        records.append({"step": done, "epoch": epoch + 1, **asdict(step), "seconds": round(seconds, 3)})
        log_file.write(json.dumps(records[-1]) + "\n")
        log_file.flush()  # readable while training runs
        if log is not None and (done % max(1, total // 20) == 0 or done == total):
            log(f"step {done}/{total}  loss {step.loss:.4f}  {seconds:.0f}s")

    os.makedirs(out, exist_ok=True)
    # an interrupted run's log describes no draft: a new run into the same directory starts it afresh
    with open(log_path, "w", encoding="utf-8") as log_file:
        for epoch in range(epochs):
            if follow is None:
                sampler.set_epoch(epoch)
            left = total - len(losses)
            if left <= 0:
                break
            batches = (
                {k: v.to(where, non_blocking=True) for k, v in b.items()} for b in itertools.islice(loader, left)
            )
            on_step = functools.partial(report, epoch=epoch)
            losses += train_steps(
                draft,
                batches,
                head,
                optimizer,
                ttt_steps,
                on_step,
                scheduler,
                step_decay,
                supervise,
                dtype,
                draft_inputs,
            )
    if follow is not None:
        assert isinstance(loader, FollowLoader)  # what build_eagle3_dataloader returns with follow=
        loader.acknowledge()  # the last batch is trained on: reclaim its shards (the loader was not asked again)
    seconds = time.monotonic() - started
    trained = {
        "epochs": epochs,
        "lr": lr,
        "ttt_steps": ttt_steps,
        "batch_size": batch_size,
        "seed": seed,
        "warmup": warmup,
        "step_decay": step_decay,
        "supervise": supervise,
        "compute_dtype": compute_dtype,
        "draft_inputs": draft_inputs,
        "schedule": "cosine",
    }
    extra = {
        "cache": os.path.abspath(cache_dir),
        "target": open_source(cache_dir, CACHE_NAME).config.get("model"),
        "training": {**trained, "steps": len(losses), "final_loss": losses[-1]},
    }
    save_draft(draft.cpu(), out, extra)
    png = os.path.join(out, LOSS_CURVE)
    drawn = loss_curve(records, png)  # after the draft is saved: a failed picture loses no training
    if log is not None:
        log(f"training log: {log_path}; " + (f"loss curve: {png}" if drawn else not_drawn(png)))
    return TrainResult(losses, len(losses), seconds)
