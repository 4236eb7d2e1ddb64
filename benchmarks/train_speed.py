"""``speccache train``'s speed: milliseconds per cached token per epoch, on the first steps of the recipe.

    OMP_NUM_THREADS=1 python benchmarks/train_speed.py CACHE [--steps 30] [--ttt-steps 2] [--batch-size 4]
        [--compute-dtypes fp32,bf16] [--supervise generated]

It builds the draft and the length-grouped batches exactly as ``train`` does (seed 0), runs ``--steps`` optimizer
steps of the acceptance recipe (lr 2e-3, step decay 0.8, gradients clipped) on one thread, and prints the wall
and CPU milliseconds per token (the batches' real tokens, padding not counted), the peak memory, the load average
and the losses, so that two versions of the trainer can be compared for speed and for identical results (run it
with ``PYTHONPATH`` set to each version's ``src``). The first step is not timed (one-time allocations). With
several ``--compute-dtypes`` the same steps run in each, one after the other from the same fresh draft, and the
last line gives each run's speed against the first's (name a dtype twice to alternate them).
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import time

import torch

from speccache.devices import DTYPES, dtype_name
from speccache.methods.eagle3 import Eagle3CacheDataset, build_eagle3_dataloader
from speccache.read.source import reader_sampler
from speccache.train.trainer import COMPUTE_DTYPES, LengthGroupedSampler, draft_for_cache, make_optimizer, train_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache", help="an EAGLE-3 cache (speccache precompute --method eagle3)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps timed (after one untimed step)")
    p.add_argument("--ttt-steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--compute-dtypes", default="fp32", help="train's --compute-dtype, comma-separated: each is timed")
    p.add_argument("--supervise", default="generated", help="train's --supervise: generated or all")
    args = p.parse_args()
    torch.set_num_threads(1)
    dataset = Eagle3CacheDataset(args.cache, keys=["input_ids"])
    base = reader_sampler(dataset, shuffle=True, distributed=False, seed=0)
    sampler = LengthGroupedSampler(base, dataset.sample_lengths(), args.batch_size, 0)
    loader = build_eagle3_dataloader(args.cache, batch_size=args.batch_size, shuffle=False, sampler=sampler)
    sampler.set_epoch(0)
    batches = list(itertools.islice(loader, args.steps + 1))
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:])
    walls = []
    for name in args.compute_dtypes.split(","):
        dtype = DTYPES[dtype_name(name, "--compute-dtypes", COMPUTE_DTYPES)]
        torch.manual_seed(0)
        draft, head = draft_for_cache(args.cache)
        optimizer = make_optimizer(draft, 2e-3)
        run = {"steps": args.ttt_steps, "step_decay": 0.8, "supervise": args.supervise, "compute_dtype": dtype}
        losses = train_steps(draft, batches[:1], head, optimizer, **run)
        wall, cpu = time.perf_counter(), time.process_time()
        losses += train_steps(draft, batches[1:], head, optimizer, **run)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        walls.append((name, wall))
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"{name}: {args.steps} steps, {tokens} tokens (--ttt-steps {args.ttt_steps}, batches of "
            f"{args.batch_size}, --supervise {args.supervise}):"
        )
        print(
            f"  {1000 * wall / tokens:.3f} ms/token wall, {1000 * cpu / tokens:.3f} ms/token CPU, "
            f"peak RSS {peak:.0f} MiB"
        )
        print(f"  load average {load}")
        print("  losses " + " ".join(f"{loss:.9g}" for loss in losses))
    speeds = ", ".join(f"{name} {walls[0][1] / wall:.2f}x" for name, wall in walls)
    print(f"speed (wall per token) against the first run ({walls[0][0]}): {speeds}")


if __name__ == "__main__":
    main()
