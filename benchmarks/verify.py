"""What checked reads cost: the default reader (``verify=True``) against ``verify=False``, epoch by epoch.

Each job opens a fresh ``CacheDataset`` and reads one shuffled epoch through a DataLoader
(``LocalityShuffleSampler`` with its prefetch, ``PackCollator``, ``num_workers=0``), as
``benchmarks/reads.py`` does, of large (~2 MB) and small (~32 KB) samples
(``benchmarks/fixtures.py``'s ``LARGE`` and ``SMALL`` caches). The jobs:

* the first epoch, warm (the files read whole just before) and cold (dropped from the
  page cache just before, as reads.py drops them), verified and not: the verified one
  hashes every tensor it reads once, on the read-ahead thread where the sampler
  prefetches;
* a later epoch of the same process (one epoch read untimed first, by the same dataset,
  warm): verified and not, which should cost the same (each shard is checked once);
* the first epoch verified with every check run by the shard's first read on the reading
  thread (no checker thread: the design the thread replaced), warm and cold.

All jobs of a kind run once per round, in a new shuffled order each round, and each
figure is the median over the rounds of the per-round ratio (verified time / unverified
time), with the smallest and largest ratio beside it (``benchmarks/harness.py``'s ``paired_rounds``).

The report goes between ``<!-- verify-benchmark:begin -->`` and ``<!-- verify-benchmark:end -->`` of ``--out``.

Usage: OMP_NUM_THREADS=1 python benchmarks/verify.py --out docs/benchmarks.md [--work bench-out] [--scale 0.25]
[--rounds 5]
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable

from fixtures import LARGE, SMALL, Kind, Pool, epoch, shard_paths, write_native_cache  # benchmarks/, beside this
from harness import PageCache, Report, bench_args, cooled, paired_rounds, start, verdict, warmed, write_report
from speccache.read import CacheDataset, PackCollator
from speccache.read.sampler import LocalityShuffleSampler

COLD_TARGET, WARM_TARGET, LATER_TARGET = 1.10, 1.25, 1.05


class _NoThread:
    def submit(self, check: object) -> None:
        pass  # left to the shard's first read


class SerialChecks(CacheDataset):
    """The default reader with no checker thread: each shard's check runs at its first read (reads the reader's
    internals on purpose)."""

    def _checker(self) -> _NoThread:  # type: ignore[override]
        return _NoThread()


def epochs(cache_dir: str, kind: Kind, verify: bool | str, skip: int) -> float:
    """Seconds of one epoch of a fresh reader after ``skip`` untimed ones of the same reader (``verify="serial"``:
    a :class:`SerialChecks` reader)."""
    ds = SerialChecks(cache_dir) if verify == "serial" else CacheDataset(cache_dir, verify=bool(verify))
    sampler = LocalityShuffleSampler(ds, ds.shard_size, seed=0, prefetch=ds.prefetch)
    collate = PackCollator(["input_ids", "loss_mask", "hidden"])
    for e in range(skip):
        sampler.set_epoch(e)
        epoch(ds, sampler, kind.batch, collate)
    sampler.set_epoch(skip)
    return epoch(ds, sampler, kind.batch, collate)


def bench(report: Report, work: str, kinds: list[Kind], rounds: int) -> None:
    cache = PageCache()
    rows = []
    buf = mmap.mmap(-1, 16 << 20)
    for kind in kinds:
        native_dir = os.path.join(work, f"read-{kind.name}")
        write_native_cache(native_dir, kind, Pool(kind.hidden, max(8192, kind.shard_size * kind.max_len * 2), seed=3))
        files = shard_paths(native_dir)
        nbytes = sum(os.path.getsize(p) for p in files)
        jobs: dict[str, Callable[[], float]] = {}
        for verify in (True, False):
            name = "verified" if verify else "unverified"
            first = functools.partial(epochs, native_dir, kind, verify, 0)
            jobs[f"{name} first warm"] = warmed(buf, files, first)
            jobs[f"{name} first cold"] = cooled(cache, files, first)
            jobs[f"{name} later warm"] = warmed(buf, files, functools.partial(epochs, native_dir, kind, verify, 1))
        serial = functools.partial(epochs, native_dir, kind, "serial", 0)
        jobs["serial first warm"] = warmed(buf, files, serial)
        jobs["serial first cold"] = cooled(cache, files, serial)
        times = paired_rounds(rounds, jobs)
        for what, target in (("first cold", COLD_TARGET), ("first warm", WARM_TARGET), ("later warm", LATER_TARGET)):
            r = times.ratio(f"verified {what}", f"unverified {what}")
            spread = times.spread(f"verified {what}", f"unverified {what}")
            rows.append(
                (
                    f"{kind.name} ({kind.num_samples} samples, {nbytes / 2**20:.0f} MiB)",
                    what,
                    f"{times[f'verified {what}']:.3f} s",
                    f"{times[f'unverified {what}']:.3f} s",
                    f"{r:.2f}x ({spread})",
                    f"<= {target:.2f}x: {verdict(r <= target)}",
                )
            )
            report.target(
                f"{kind.name} {what} epoch: verified / verify=False <= {target:.2f}x", f"{r:.2f}x", r <= target
            )
        for what in ("first cold", "first warm"):
            r = times.ratio(f"serial {what}", f"unverified {what}")
            rows.append(
                (
                    f"{kind.name}, checks at first read (no checker thread)",
                    what,
                    f"{times[f'serial {what}']:.3f} s",
                    f"{times[f'unverified {what}']:.3f} s",
                    f"{r:.2f}x ({times.spread(f'serial {what}', f'unverified {what}')})",
                    "(the design replaced)",
                )
            )
    report.table(["cache", "epoch", "verified (median)", "verify=False (median)", "ratio (spread)", "target"], rows)
    report.add(cache.describe())


def main(argv: list[str] | None = None) -> None:
    args, run = start(bench_args(__doc__, scale=0.25, rounds=5), __file__, argv)
    report = Report()
    report.add("## Checked reads: the default reader against `verify=False` (benchmarks/verify.py)")
    report.add()
    report.add(
        f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}`. Each ratio is verified time / unverified time, the "
        "median of the per-round ratios of jobs run in a shuffled order each round; a busy shared machine makes "
        "single rounds noisy (see the spread)."
    )
    report.add()
    kinds = [LARGE.scaled(args.scale), SMALL.scaled(args.scale)]
    bench(report, args.work, kinds, args.rounds)
    write_report("verify", report, run, args.out)


if __name__ == "__main__":
    main()
