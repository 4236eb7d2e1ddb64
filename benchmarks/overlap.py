"""Section 2: precompute wall time with compute overlapped with writing, against ``max(compute, write)``.

The compute step is a sleep (a GPU forward leaves the CPU free) calibrated to the measured write time; the
overlapped loop (``compute_shard_runs`` + ``OverlappedShardWriter``) and the synchronous one are timed beside the
seed's ``write_cache_shards`` (NeMo AutoModel 0.7.0, loaded from ``--upstream`` or downloaded into the work
directory; its rows are left out when neither works), the best of ``--rounds`` interleaved rounds.

The report goes between ``<!-- overlap-benchmark:begin -->`` and ``<!-- overlap-benchmark:end -->`` of ``--out``.

Usage: python benchmarks/overlap.py --out docs/benchmarks.md [--work bench-out] [--scale 1.0] [--rounds 3]
[--upstream FILE]
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import types
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from fixtures import SEED_KEYS, Pool, add_upstream_flag, load_upstream, native_shard, seed_shard  # benchmarks/
from harness import Report, bench_args, best_of, start, write_report
from speccache.format import shard_path
from speccache.testing.synthetic import synthetic_schema
from speccache.write import CacheWriter, compute_shard_runs

log = logging.getLogger("bench")


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _first_index(batch: list[int]) -> int:
    return batch[0]


def bench_overlap(report: Report, work: str, scale: float, rounds: int, upstream: types.ModuleType | None) -> None:
    shard_size, batch, length, hidden = 8, 4, 256, 4096
    n = max(64, int(384 * scale)) // shard_size * shard_size
    pool = Pool(hidden, 8192, seed=2)
    native = [native_shard([length] * batch, a, pool) for a in range(0, n, batch)]
    seed = [seed_shard([length] * batch, a, length, pool) for a in range(0, n, batch)]
    schema = synthetic_schema(hidden)
    loader = DataLoader(_Indices(n), batch_size=batch, collate_fn=_first_index)
    out = os.path.join(work, "overlap")
    ragged = [k for k, s in schema.items() if s.ragged]
    delay = {"ours": 0.0, "seed": 0.0}

    def compute(outputs: list[dict[str, torch.Tensor]], who: str) -> Callable[[int], dict[str, torch.Tensor]]:
        def step(first: int) -> dict[str, torch.Tensor]:
            if delay[who]:
                time.sleep(delay[who])
            return outputs[first // batch]

        return step

    def ours(write: str) -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        if write == "none":  # compute alone: the same loop, shards dropped
            compute_shard_runs(
                loader,
                out,
                shard_size,
                range(n // shard_size),
                compute(native, "ours"),
                lambda d, i, s: shard_path(d, i),
                log,
                ragged_keys=ragged,
            )
            return time.perf_counter() - t
        writer = CacheWriter(
            out,
            cache_name="synthetic",
            schema=schema,
            shard_size=shard_size,
            num_samples=n,
            config={"bench": "overlap"},
        )
        with writer.writing(overlap=write == "overlapped") as run:
            compute_shard_runs(
                loader, out, shard_size, run.shards, compute(native, "ours"), run.write_shard, log, ragged_keys=ragged
            )
        return time.perf_counter() - t

    def theirs(write: bool = True) -> float:
        assert upstream is not None
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        os.sync()

        def write_fn(d: str, i: int, s: dict[str, torch.Tensor]) -> str:
            return upstream.write_tensor_shard(d, i, s, SEED_KEYS, "bench") if write else shard_path(d, i)

        t = time.perf_counter()
        upstream.write_cache_shards(
            dataloader=loader,
            output_dir=out,
            shard_size=shard_size,
            start_shard_index=0,
            compute_batch=compute(seed, "seed"),
            write_shard_fn=write_fn,
            logger=log,
        )
        elapsed = time.perf_counter() - t
        os.sync()  # its writes skip fsync: flush them before the next timing, outside this one
        return elapsed

    # Writes alone (no compute) calibrate each loop's compute step to take as long in all.
    alone = best_of(rounds, {"ours": lambda: ours("sync"), **({"seed": theirs} if upstream else {})})
    delay["ours"] = alone["ours"] / len(native)

    def without_compute(who: str, loop: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            step, delay[who] = delay[who], 0.0
            try:
                return loop()
            finally:
                delay[who] = step

        return run

    # The writes are timed again in the same rounds as the loops, so that the disk's drift between the
    # calibration and the rounds does not move the bound.
    jobs: dict[str, Callable[[], float]] = {
        "compute": lambda: ours("none"),
        "writes": without_compute("ours", lambda: ours("sync")),
        "overlapped": lambda: ours("overlapped"),
        "sync": lambda: ours("sync"),
    }
    if upstream is not None:
        delay["seed"] = alone["seed"] / len(seed)
        jobs.update(
            {
                "seed compute": lambda: theirs(write=False),
                "seed writes": without_compute("seed", theirs),
                "seed": theirs,
            }
        )
    best = best_of(rounds, jobs)
    shutil.rmtree(out, ignore_errors=True)
    c, w = best["compute"], best["writes"]
    bound = max(c, w)
    report.add("## 2. Precompute: compute overlapped with writing")
    report.add()
    report.add(
        f"{n // shard_size} shards of {shard_size} samples x {length} tokens x {hidden} bf16, batches of {batch}. "
        "The compute step is a sleep (the CPU stays free, as during a GPU forward) calibrated so that the loop "
        "with compute only takes as long as the loop with writes only: "
        f"{delay['ours'] * 1e3:.1f} ms per batch for speccache (`CacheWriter` + `compute_shard_runs`, "
        "`OverlappedShardWriter` or the `NativeShardWriter` itself)"
        + (
            f", {delay['seed'] * 1e3:.1f} ms for the seed's `write_cache_shards`, whose `save_file` writes "
            "do not fsync."
            if upstream is not None
            else "."
        )
        + " The writes-only loops are timed again in the rounds of the others (best of each), so that the bound "
        "moves with the disk as the loops do."
    )
    report.add()
    rows = [
        ["speccache: compute only (shards dropped)", f"{c:.2f}", ""],
        ["speccache: writes only (no compute)", f"{w:.2f}", ""],
        ["speccache: one shard's write (the last cannot overlap compute)", f"{w / (n // shard_size):.2f}", ""],
        [
            "speccache: overlapped loop",
            f"{best['overlapped']:.2f}",
            f"{best['overlapped'] / bound:.2f}x max(compute, write)",
        ],
        [
            "speccache: synchronous loop",
            f"{best['sync']:.2f}",
            f"{best['sync'] / bound:.2f}x max(compute, write); {best['sync'] / (c + w):.2f}x (compute + write)",
        ],
    ]
    if upstream is not None:
        cs, ws = best["seed compute"], best["seed writes"]
        rows += [
            ["seed: compute only", f"{cs:.2f}", ""],
            ["seed: writes only", f"{ws:.2f}", ""],
            [
                "seed: synchronous loop",
                f"{best['seed']:.2f}",
                f"{best['seed'] / max(cs, ws):.2f}x max(compute, write); {best['seed'] / (cs + ws):.2f}x (compute "
                "+ write)",
            ],
        ]
    report.table(["run", "seconds", "ratio"], rows)
    r = best["overlapped"] / bound
    report.target("precompute overlapped loop <= 1.15x max(compute, write)", f"{r:.2f}x", r <= 1.15)
    if upstream is not None:
        report.target(
            "seed synchronous loop: about compute + write (reported)",
            f"{best['seed'] / (cs + ws):.2f}x (compute + write)",
            None,
        )


def main(argv: list[str] | None = None) -> None:
    p = bench_args(__doc__)
    add_upstream_flag(p)
    args, run = start(p, __file__, argv)
    upstream, where = load_upstream(args.upstream, args.work)
    report = Report()
    bench_overlap(report, args.work, args.scale, args.rounds, upstream)
    report.add(f"Seed module: {where}.")
    write_report("overlap", report, run, args.out)


if __name__ == "__main__":
    main()
