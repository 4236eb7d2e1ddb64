"""``make demo``: the whole job on the bundled tiny target and chat data, offline, in a few minutes on a CPU.

Runs ``speccache precompute`` (with ``--resume``, so a second ``make demo`` checks
and keeps the existing cache), ``speccache verify``, ``speccache inspect``, then
one training epoch's worth of reading through ``build_eagle3_dataloader`` with
``TargetHead``, and prints a summary.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from speccache import cli
from speccache.demo import demo_data_path, ensure_demo_target
from speccache.methods.eagle3 import TargetHead, build_eagle3_dataloader


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


def main(argv: list[str] | None = None) -> None:
    """Run the demo end to end."""
    p = argparse.ArgumentParser(prog="python -m speccache.demo.run", description=__doc__)
    p.add_argument("--out", default="demo-out", help="cache directory (default demo-out)")
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args(argv)
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
    print("\ndemo complete.")


if __name__ == "__main__":
    main()
