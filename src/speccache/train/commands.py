"""``speccache train`` and ``speccache evaluate``: their arguments and commands. The draft, trainer and evaluator
(and transformers) are imported only when a command runs, so ``speccache --help`` stays fast."""

from __future__ import annotations

import argparse
import json
from typing import Any, cast

import torch

from speccache.data import check_model_source
from speccache.devices import DTYPES, dtype_name, target_device
from speccache.errors import UsageError
from speccache.read.dataset import NO_VERIFY_HELP
from speccache.units import counted

__all__ = ["loss_summary", "register_commands"]


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``speccache train``."""
    torch.set_num_threads(args.threads)
    from speccache.read.follow import Follow
    from speccache.train.trainer import train

    if not args.follow and (args.reclaim or args.reclaim_to or args.replay != 1 or args.ordered):
        raise UsageError("--reclaim, --reclaim-to, --replay and --ordered read a cache being written: add --follow")

    result = train(
        args.cache_dir,
        args.out,
        epochs=args.epochs,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        batch_size=args.batch_size,
        max_steps=args.max_steps,
        seed=args.seed,
        warmup=args.warmup,
        step_decay=args.step_decay,
        supervise=args.supervise,
        intermediate_size=args.intermediate_size,
        compute_dtype=args.compute_dtype,
        draft_inputs=args.draft_inputs,
        device=args.device,
        verify=not args.no_verify,
        follow=Follow(
            replay=args.replay,
            reclaim=args.reclaim,
            reclaim_to=args.reclaim_to,
            ordered=args.ordered,
            timeout=args.follow_timeout,
        )
        if args.follow
        else None,
        log=lambda line: print(line, flush=True),
    )
    print(
        f"{args.out}: EAGLE-3 draft trained {counted(result.steps, 'step')} in {result.seconds:.1f}s; "
        + loss_summary(result.losses)
    )
    return 0


def loss_summary(losses: list[float]) -> str:
    """How the loss moved: the mean of the first steps and of the last (at most 10 each, never the same steps)."""
    if len(losses) < 2:
        return f"loss {losses[0]:.4f} (one step)" if losses else "no step taken"
    n = min(10, len(losses) // 2)
    steps = "step" if n == 1 else f"{n} steps"
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return f"loss {first:.4f} (mean of the first {steps}) -> {last:.4f} (of the last {steps})"


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Run ``speccache evaluate``."""
    for name, value in (("--k", args.k), ("--max-new-tokens", args.max_new_tokens), ("--prompts", args.prompts)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} must be at least 1")
    from speccache.train.plots import acceptance_chart, chart_path, not_drawn

    chart = chart_path(args.json) if args.json else None  # refused before the minutes of evaluation
    if args.model:
        check_model_source(args.model)
    model_dtype = DTYPES[dtype_name(args.model_dtype, "--model-dtype")]
    device = target_device(args.device)
    torch.set_num_threads(args.threads)
    from speccache.train.draft import draft_record, load_draft
    from speccache.train.evaluate import (
        DraftProposer,
        NgramTable,
        PromptLookup,
        Proposer,
        TargetRunner,
        eos_ids,
        eval_prompts,
        image_prompts,
        speculative,
        teacher_forced,
    )

    draft = load_draft(args.draft).to(device)
    train_cache = args.train_cache or draft_record(args.draft).get("cache")
    ngram = NgramTable.from_cache(train_cache) if train_cache else None
    report: dict[str, Any] = {"draft": args.draft, "train_cache": train_cache, "cache": args.cache, "k": args.k}
    tf = teacher_forced(draft, args.cache, args.k, ngram)
    report["teacher_forced"] = tf
    chains = tf["draft"]["chains"]
    print(f"teacher-forced on {args.cache}: {chains} chain starts, k={args.k}")
    for name, r in tf.items():
        steps = " ".join(f"{p:.3f}" for p in r["per_step"])
        print(f"  {name:<14} per-step acceptance {steps}  mean accepted length {r['mean_accepted']:.3f}")
    if args.model:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from speccache.format import Manifest

        # a vision-language target's cache records how its pixels were made: its prompts decode with their images
        vision = "vision" in Manifest.read(args.cache).config
        images = image_prompts(args.cache, args.prompts, args.model) if vision else None
        loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = loader.from_pretrained(args.model, dtype=model_dtype)
        # PreTrainedModel.to is declared through functools.wraps(nn.Module.to), whose stub loses the bound self
        cast(torch.nn.Module, model).to(device)
        runner = TargetRunner(model, draft.config.aux_layers)
        prompts = eval_prompts(args.cache, args.prompts) if images is None else images[0]
        proposers: dict[str, Proposer] = {"draft": DraftProposer(draft), "prompt_lookup": PromptLookup()}
        if ngram is not None:
            proposers["ngram"] = ngram
        spec = speculative(
            runner,
            prompts,
            proposers,
            args.k,
            args.max_new_tokens,
            eos_ids(model),
            not args.quiet,
            None if images is None else images[1],
        )
        report["speculative"] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, **spec}
        print(f"speculative greedy decoding, {len(prompts)} prompts, k={args.k}, max {args.max_new_tokens} new tokens:")
        for name, r in spec.items():
            print(
                f"  {name:<14} tau {r['tau']:.3f}  {r['tokens']} tokens in {r['seconds']:.1f}s  "
                f"speed-up {r['speedup']:.2f}x  identical to greedy: {'yes' if r['identical_to_greedy'] else 'NO'}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        assert chart is not None  # set whenever --json is
        drawn = acceptance_chart(report, chart)
        print(f"report: {args.json}; " + (f"acceptance chart: {chart}" if drawn else not_drawn(chart)))
    spec_ok = all(r["identical_to_greedy"] for r in report.get("speculative", {}).values() if isinstance(r, dict))
    return 0 if spec_ok else 1


def register_commands(sub: Any) -> None:
    """Add ``train`` and ``evaluate`` to the CLI's subparsers."""
    p = sub.add_parser("train", help="train the reference EAGLE-3 draft from an EAGLE-3 cache")
    p.add_argument("cache_dir", help="an EAGLE-3 cache (speccache precompute --method eagle3)")
    p.add_argument("--out", required=True, help="the draft directory to write (config.json + model.safetensors)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=1, help="training-time-test steps (1: plain EAGLE training)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup", type=float, default=0.05, help="share of the steps the learning rate warms up over (then cosine)"
    )
    p.add_argument(
        "--step-decay",
        type=float,
        default=1.0,
        help="loss weight of each training-time-test step relative to the one before (default 1: the plain mean)",
    )
    p.add_argument(
        "--supervise",
        default="generated",
        help="rows the loss grades: generated (default: the loss mask's) or all (prompts too; more to learn from)",
    )
    p.add_argument("--intermediate-size", type=int, default=None, help="the draft's MLP width (default 2 * hidden)")
    p.add_argument(
        "--compute-dtype",
        default="fp32",
        help="the draft's forward: fp32 (default, exact) or bf16 (autocast; fp32 weights and optimizer)",
    )
    p.add_argument(
        "--draft-inputs",
        default="served",
        help="what the draft reads on a vision-language cache: served (default: what vLLM feeds an EAGLE-3 draft, "
        "the target's M-RoPE positions), merged (the target's image embeddings at image tokens) or tokens "
        "(text positions, the peers' habit); one training on a text cache",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest on a busy CPU)")
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    p.add_argument(
        "--follow",
        action="store_true",
        help="train while the cache is written: each shard as it is sealed, until the producer seals the cache",
    )
    p.add_argument("--replay", type=int, default=1, help="--follow: read each shard K times within a window of K")
    p.add_argument(
        "--reclaim", action="store_true", help="--follow: delete each shard once trained on (frees a --max-cache-* cap)"
    )
    p.add_argument("--reclaim-to", default=None, help="--follow --reclaim: move finished shards here instead")
    p.add_argument("--ordered", action="store_true", help="--follow: shards strictly in index order (reproducible)")
    p.add_argument(
        "--follow-timeout", type=float, default=600.0, help="--follow: seconds to wait for a shard (default 600)"
    )
    p.set_defaults(
        func=cmd_train,
        interrupted=lambda args, command: (
            f"nothing was saved to {args.out} (the draft is written when training ends); train again with: {command}"
        ),
    )
    p = sub.add_parser("evaluate", help="measure a draft's acceptance: teacher-forced on a cache, and real decoding")
    p.add_argument("draft", help="a draft directory written by speccache train")
    p.add_argument("--cache", required=True, help="a held-out EAGLE-3 cache of the same target")
    p.add_argument("--model", default=None, help="the target model directory: also run greedy speculative decoding")
    p.add_argument("--train-cache", default=None, help="the n-gram baseline's data (default: the draft's cache)")
    p.add_argument("--k", type=int, default=3, help="tokens drafted per chain (default 3)")
    p.add_argument("--prompts", type=int, default=None, help="decode at most this many prompts of --cache")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--model-dtype", default="fp32", help="the target's compute: fp32 (default), bf16 or fp16 (or torch's names)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest on a busy CPU)")
    p.add_argument(
        "--json", default=None, help="also write the report to this JSON file, and its chart beside it (.png)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar while decoding")
    p.set_defaults(
        func=cmd_evaluate, interrupted=lambda args, command: f"no report was written; evaluate again with: {command}"
    )
