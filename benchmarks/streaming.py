"""Training while the cache is written, against the offline two-step run on the same data.

    python benchmarks/streaming.py --out docs/benchmarks.md    # replaces the "streaming" section there

One producer (``write_synthetic_cache`` in its own spawned process, ``--compute-seconds`` of stand-in target work
per batch of ``--producer-batch`` samples, then the real shard write) and one trainer (this process: a
``FollowLoader`` of ``--batch-size``, ``--step-seconds`` of stand-in training per batch, reading every key). Both
run on one thread each (``OMP_NUM_THREADS=1``, set here), so on 2 cores neither takes the other's core. Four runs
on the same ``--samples`` samples:

* offline: the producer writes the whole cache, then the trainer reads it (``CacheDataset``, no follow);
* streaming: the trainer follows the cache while it is written (``follow=True``), nothing deleted;
* cap K: the producer is capped at K unconsumed shards (``DiskCap(max_shards=K)``, i.e. ``precompute
  --max-cache-shards K``) and the trainer reclaims what it has consumed (``reclaim=True``), for each ``--caps``.

Reported per run: the end-to-end wall time (the producer's start to the trainer's last step), the trainer's idle
fraction (time blocked on the next batch, including its wait for the first shard, over the trainer's wall time),
the producer's stall fraction (``DiskCap.waited`` over the producer's wall time), and the disk high-water mark:
the most bytes of files in the cache directory (shards, temporary files being written, the manifest, reclaim
records), sampled by a thread every few milliseconds, with the bound ``cap + one shard``. Every run's trainer must
read exactly the offline cache's samples: the multiset of ``sample_id`` and the sum of every feature value.

Usage: python benchmarks/streaming.py [--samples N] [--shard-size S] [--hidden H] [--max-len L]
    [--compute-seconds C] [--step-seconds T] [--caps K ...] [--work-dir DIR] [--out FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread per process on a shared 2-core machine

import argparse
import multiprocessing
import shutil
import threading
import time
from collections import Counter
from typing import Any

import torch

from harness import machine_summary, replace_section  # benchmarks/, beside this script
from speccache.read import CacheDataset, PadCollator
from speccache.read.follow import Follow
from speccache.testing.synthetic import write_synthetic_cache
from speccache.units import human_bytes
from speccache.write.cap import DiskCap

BEGIN, END = "<!-- streaming-benchmark:begin -->", "<!-- streaming-benchmark:end -->"


def produce(out: str, cache_args: dict[str, Any], cap_shards: int | None, ready: Any, report: Any) -> None:
    """The producer process: write the cache (under the cap, if any) and report its times and stalls."""
    torch.set_num_threads(1)
    cap = None if cap_shards is None else DiskCap(out, max_shards=cap_shards, poll=0.005)
    start = time.time()
    ready.set()  # imports done: the clocks of both sides start here
    write_synthetic_cache(out, cap=cap, **cache_args)
    report.put({"start": start, "end": time.time(), "waited": 0.0 if cap is None else cap.waited})


class DiskMonitor(threading.Thread):
    """Samples the bytes of every file in a directory until stopped; ``high_water`` is the most seen."""

    def __init__(self, path: str, every: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.path, self.every = path, every
        self.high_water = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            try:
                with os.scandir(self.path) as entries:
                    for entry in entries:
                        try:
                            total += entry.stat().st_size
                        except FileNotFoundError:
                            continue  # deleted (reclaimed, or a temporary file renamed) while listed
            except FileNotFoundError:
                pass
            self.high_water = max(self.high_water, total)
            time.sleep(self.every)


def train(loader: Any, step_seconds: float, start: float) -> dict[str, Any]:
    """Step through ``loader``; the samples seen and the seconds blocked on the next batch, counted from ``start``."""
    ids: Counter[int] = Counter()
    total = 0.0
    idle = 0.0
    it = iter(loader)
    while True:
        before = time.time()
        try:
            batch = next(it)
        except StopIteration:
            idle += time.time() - before
            break
        idle += time.time() - before
        ids.update(batch["sample_id"].tolist())
        total += sum(float(v.double().sum()) for k, v in batch.items() if v.is_floating_point())
        time.sleep(step_seconds)
    end = time.time()
    return {"ids": ids, "sum": total, "idle": idle, "wall": end - start, "end": end}


def run(
    mode: str, work: str, args: argparse.Namespace, step_seconds: float, cap_shards: int | None = None
) -> dict[str, Any]:
    """One producer/trainer run in ``mode`` (``offline``, ``streaming`` or ``cap``); its measures."""
    out = os.path.join(work, f"{mode}{cap_shards or ''}")
    shutil.rmtree(out, ignore_errors=True)
    cache_args = dict(
        num_samples=args.samples,
        shard_size=args.shard_size,
        batch_size=args.producer_batch,
        hidden=args.hidden,
        min_len=args.max_len // 2,
        max_len=args.max_len,
        compute_delay=args.compute_seconds,
    )
    ctx = multiprocessing.get_context("spawn")
    ready, report = ctx.Event(), ctx.Queue()
    producer = ctx.Process(target=produce, args=(out, cache_args, cap_shards, ready, report))
    monitor = DiskMonitor(out)
    monitor.start()
    producer.start()
    ready.wait()
    if mode == "offline":
        produced = report.get()
        producer.join()
        reader_start = time.time()
        dataset = CacheDataset(out)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, collate_fn=PadCollator(set(dataset.ragged_keys))
        )
        trained = train(loader, step_seconds, reader_start)
    else:
        follow = Follow(shuffle=True, poll=0.005, timeout=300.0, reclaim=cap_shards is not None)
        # the trainer starts with the producer: its wait for the manifest and the first shard is idle time
        reader_start = time.time()
        stream = CacheDataset(out, follow=follow)
        trained = train(stream.loader(args.batch_size), step_seconds, reader_start)
        produced = report.get()
        producer.join()
    monitor.stop.set()
    monitor.join()
    if producer.exitcode != 0:
        raise SystemExit(f"the {mode} producer failed with exit code {producer.exitcode}")
    shard_bytes = max((os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.startswith("shard-")),
                      default=0)  # fmt: skip
    producer_wall = produced["end"] - produced["start"]
    result = {
        "mode": mode,
        "cap": cap_shards,
        "wall": max(trained["end"], produced["end"]) - produced["start"],
        "trainer_idle": trained["idle"] / trained["wall"],
        "producer_stall": produced["waited"] / producer_wall,
        "producer_wall": producer_wall,
        "trainer_wall": trained["wall"],
        "high_water": monitor.high_water,
        "ids": trained["ids"],
        "sum": trained["sum"],
        "shard_bytes": shard_bytes,
    }
    shutil.rmtree(out, ignore_errors=True)
    return result


def label(r: dict[str, Any]) -> str:
    """A run's row name."""
    if r["mode"] == "offline":
        return "offline (precompute, then train)"
    return "streaming, no cap" if r["cap"] is None else f"streaming, cap {r['cap']} shards, reclaim"


def regime(args: argparse.Namespace, step_seconds: float) -> tuple[list[str], list[str]]:
    """The runs at one trainer step time: a Markdown table, and the runs that read wrong samples or broke the bound."""
    runs = [run("offline", args.work_dir, args, step_seconds), run("streaming", args.work_dir, args, step_seconds)]
    runs += [run("cap", args.work_dir, args, step_seconds, cap) for cap in args.caps]
    offline = runs[0]
    assert sum(offline["ids"].values()) == args.samples and set(offline["ids"]) == set(range(args.samples))
    for r in runs:
        r["same"] = r["ids"] == offline["ids"] and abs(r["sum"] - offline["sum"]) <= 1e-9 * abs(offline["sum"])
        r["bound"] = None if r["cap"] is None else (r["cap"] + 1) * offline["shard_bytes"]
    side = "trainer" if offline["trainer_wall"] > offline["producer_wall"] else "producer"
    table = [
        f"Trainer step {step_seconds:g} s per batch: the {side} is the slower side "
        f"(offline: producer {offline['producer_wall']:.2f} s, trainer {offline['trainer_wall']:.2f} s).",
        "",
        "| run | end to end | vs offline | trainer idle | producer stalled | disk high-water | cap + one shard "
        "| same samples |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {label(r)} | {r['wall']:.2f} s | {r['wall'] / offline['wall']:.2f}x | {100 * r['trainer_idle']:.1f}% "
        f"| {100 * r['producer_stall']:.1f}% | {human_bytes(r['high_water'])} "
        f"| {'-' if r['bound'] is None else human_bytes(r['bound'])} | {'yes' if r['same'] else 'NO'} |"
        for r in runs
    ]
    failed = [
        f"{label(r)} at step {step_seconds:g} s"
        for r in runs
        if not r["same"] or (r["bound"] is not None and r["high_water"] > r["bound"])
    ]
    return table, failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--shard-size", type=int, default=16)
    p.add_argument("--producer-batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--compute-seconds", type=float, default=0.04, help="stand-in target work per producer batch")
    p.add_argument(
        "--step-seconds", type=float, nargs="+", default=[0.05, 0.15], help="stand-in training steps per trainer batch"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--caps", type=int, nargs="+", default=[2, 8])
    p.add_argument("--work-dir", default="bench-out/streaming")
    p.add_argument("--out", default=None, help="Markdown report to replace the streaming section of")
    args = p.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)

    tables, failed = [], []
    for step_seconds in args.step_seconds:
        table, bad = regime(args, step_seconds)
        tables += [*table, ""]
        failed += bad
    text = "\n".join(
        [
            BEGIN,
            "## Training while the cache is written (benchmarks/streaming.py)",
            "",
            f"`python benchmarks/streaming.py --out docs/benchmarks.md` (`make bench`), {machine_summary()}, "
            f"one thread per process (`OMP_NUM_THREADS=1`). {args.samples} synthetic "
            f"samples of {args.max_len // 2}-{args.max_len} tokens, bf16 hidden {args.hidden}, "
            f"{args.shard_size} per shard; the producer (its own process) spends {args.compute_seconds:g} s per "
            f"batch of {args.producer_batch} standing in for the target's forward, then writes the shard; the "
            f"trainer reads every key in batches of {args.batch_size} and sleeps a stand-in training step after "
            "each. Offline: the whole cache, then the training; the others follow it (`follow=True`), the capped "
            "ones as `precompute --max-cache-shards K` with `train --follow --reclaim`.",
            "",
            *tables,
            "End to end: from the producer's start (after its imports) to the trainer's last step. Trainer idle: "
            "the time it waited for its next batch (when following, including the wait for the first shard) over "
            "its wall time. Producer stalled: time paused at the cap over its wall time. Disk high-water: the most "
            "bytes of all files in the cache directory (shards, the one being written, manifest, reclaim records), "
            "sampled every 2 ms; the bound is the cap plus one shard, of the largest shard's size. Same samples: "
            "the multiset of `sample_id` and the sum of every feature value the trainer read equal the offline "
            "run's.",
            END,
            "",
        ]
    )
    print(text)
    if args.out:
        replace_section(args.out, text, BEGIN, END)
    if failed:
        raise SystemExit(f"streaming benchmark: wrong samples or disk above the bound in {failed}")


if __name__ == "__main__":
    main()
